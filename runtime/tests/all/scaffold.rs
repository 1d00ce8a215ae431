//! `edl-runtime plugin new`: for each world the generated crate builds, its
//! own tests pass, and the runtime loads the component it builds. The crates
//! are generated under target/ (inside the repository, so they depend on the
//! SDK by path) and built with the workspace's lockfile and target
//! directories, so what the workspace build compiled is reused.

use crate::support::{process::output_of, root};
use edl_plugin_sdk::{Action, ClusterView, Hyperparams, ResizeEvent, TeacherView, testing};
use edl_runtime::plugin::{ArtifactCache, HostOptions, PluginHost};
use std::{path::Path, process::Command};

/// Runs `cmd`, which must succeed; returns its output.
fn run(cmd: &mut Command) -> String {
    let what = format!("{cmd:?}");
    output_of(cmd, &what).unwrap_or_else(|e| panic!("{e}"))
}

fn cargo(dir: &Path, target_dir: &Path, args: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(cargo)
        .current_dir(dir)
        .args(args)
        .env("CARGO_TARGET_DIR", target_dir)
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS"))
}

#[test]
fn scaffolded_plugins_build_pass_their_tests_and_load() {
    let root = root();
    let base = root.join("target/scaffold-tests");
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let host = PluginHost::new(HostOptions { cache: ArtifactCache::at(cache.path()), ..Default::default() })
        .unwrap();

    // (what `plugin new` takes, the WIT world, the crate)
    for (kind, world, name) in [
        ("scaling-policy", "scaling-policy", "my-policy"),
        ("batch-adapter", "batch-adapter", "my-adapter"),
        ("reader-transform", "reader-transform", "my-transform"),
        ("teacher-policy", "teacher-pool-policy", "my-teachers"),
    ] {
        let out = run(Command::new(env!("CARGO_BIN_EXE_edl-runtime")).args([
            "plugin",
            "new",
            kind,
            name,
            "--dir",
            base.to_str().unwrap(),
        ]));
        assert!(out.contains("cargo test"), "{out}");
        let dir = base.join(name);
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        assert!(
            manifest.contains("path = \"../../../plugin-sdk\""),
            "inside the repo the SDK is used by path:\n{manifest}"
        );
        for file in ["README.md", "src/lib.rs", "rust-toolchain.toml"] {
            assert!(dir.join(file).exists(), "{file}");
        }
        let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
        assert!(
            readme.contains("cargo test")
                && readme.contains("--target wasm32-wasip2")
                && readme.contains("edl-runtime")
        );
        std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();

        let tests = cargo(&dir, &root.join("target"), &["test", "--offline"]);
        assert!(tests.contains("test result: ok. "), "{tests}");
        cargo(
            &dir,
            &root.join("target/plugin-build"),
            &["build", "--offline", "--release", "--target", "wasm32-wasip2"],
        );
        let wasm = root
            .join("target/plugin-build/wasm32-wasip2/release")
            .join(format!("{}.wasm", name.replace('-', "_")));

        let info = host.inspect(&wasm).unwrap();
        assert_eq!(info.world.name(), world);
        assert_eq!(info.info.name, name);
        match world {
            "scaling-policy" => {
                let mut p = host.load_policy(&wasm, &[]).unwrap();
                let mut sim = testing::SimCluster::saturating(4, 1, 8);
                sim.run(30, |v: &ClusterView| p.decide(v).unwrap());
                assert_eq!(sim.world_size(), 4);
                assert_eq!(p.decide(&sim.view()).unwrap(), vec![Action::Hold]);
            }
            "teacher-pool-policy" => {
                let mut p = host.load_teacher_policy(&wasm, &[]).unwrap();
                let mut pool = testing::SimTeacherPool::new(4, 1, 1, 8);
                pool.run(4, |v: &TeacherView| p.decide(v).unwrap());
                assert_eq!(pool.teachers(), 2);
            }
            "batch-adapter" => {
                let mut a = host.load_adapter(&wasm, &[]).unwrap();
                let h = Hyperparams { global_batch: 128, local_batch: 64, lr: 0.1, momentum: 0.9 };
                let out =
                    a.on_resize(&ResizeEvent { step: 1, old_world_size: 2, new_world_size: 4 }, &h).unwrap();
                assert_eq!(out.global_batch, 256);
            }
            _ => {
                let mut t = host.load_transform(&wasm, &[]).unwrap();
                let out = t.apply(&testing::standard_batch()).unwrap();
                assert_eq!(out.data.len(), 256 * 784 * 4);
            }
        }
    }
}

#[test]
fn plugin_new_refuses_bad_names_and_existing_crates() {
    let dir = tempfile::tempdir().unwrap();
    let new = |name: &str| {
        Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
            .args(["plugin", "new", "scaling-policy", name, "--dir", dir.path().to_str().unwrap()])
            .output()
            .unwrap()
    };
    assert!(!new("Bad Name").status.success());
    assert!(new("fine").status.success());
    let again = new("fine");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
    // Outside the repository the SDK comes by path to this checkout, or by version.
    let manifest = std::fs::read_to_string(dir.path().join("fine/Cargo.toml")).unwrap();
    assert!(
        manifest.contains("edl-plugin-sdk = { path = \"/") || manifest.contains("edl-plugin-sdk = \"0.1"),
        "{manifest}"
    );
}
