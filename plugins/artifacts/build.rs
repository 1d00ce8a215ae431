//! Builds every plugin crate of the workspace to a WebAssembly component
//! (`wasm32-wasip2`, release) and the shipped ones also to native `cdylib`s,
//! with a nested cargo in its own target directory (no lock shared with the
//! outer build). The shipped components are copied to `plugins/<name>.wasm`;
//! `gen.rs` records every path for the runtime's tests and benchmarks.
//! Inputs are tracked through cargo's dep-info files, so an unchanged plugin
//! costs one no-op cargo call.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

/// (package, library name, shipped?, also built native?)
const PLUGINS: &[(&str, &str, bool, bool)] = &[
    ("edl-plugin-autoscale", "autoscale", true, true),
    ("edl-plugin-schedule", "schedule", true, true),
    ("edl-plugin-dynamic-batch", "dynamic_batch", true, true),
    ("edl-plugin-augment", "augment", true, true),
    ("edl-plugin-teacher-autoscale", "teacher_autoscale", true, true),
    // Native adapters are not told the training's measures: goodput is a component only.
    ("edl-plugin-goodput", "goodput", true, false),
    ("edl-plugin-goodput-policy", "goodput_policy", true, false),
    ("edl-test-plugin-spin", "spin", false, true),
    ("edl-test-plugin-membomb", "membomb", false, false),
    ("edl-test-plugin-panicky", "panicky", false, true),
    ("edl-test-plugin-hostile-policy", "hostile_policy", false, false),
    ("edl-test-plugin-hostile-adapter", "hostile_adapter", false, false),
    ("edl-test-plugin-hostile-transform", "hostile_transform", false, false),
];

fn cargo(workspace: &Path, target_dir: &Path, target: Option<&str>, packages: &[&str]) {
    let mut cmd = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace).arg("build").arg("--release").arg("--target-dir").arg(target_dir);
    if let Some(t) = target {
        cmd.arg("--target").arg(t);
    }
    for p in packages {
        cmd.arg("-p").arg(p);
    }
    // The outer build's flags and jobserver are not the nested build's.
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_MAKEFLAGS",
        "MAKEFLAGS",
        "MFLAGS",
        "CARGO_PRIMARY_PACKAGE",
        "RUSTC_WORKSPACE_WRAPPER",
    ] {
        cmd.env_remove(var);
    }
    let status = cmd.status().expect("run cargo for the plugins");
    if !status.success() {
        panic!(
            "building the plugins for {} failed (is the target installed? `rustup target add wasm32-wasip2`)",
            target.unwrap_or("the host")
        );
    }
}

/// Emits rerun-if-changed for every input listed in a dep-info file.
fn track(dep_file: &Path) {
    let Ok(text) = fs::read_to_string(dep_file) else { return };
    let Some((_, deps)) = text.lines().next().and_then(|l| l.split_once(": ")) else { return };
    let mut path = String::new();
    for token in deps.split(' ') {
        // Paths with spaces are escaped as "\ ".
        if let Some(prefix) = token.strip_suffix('\\') {
            path.push_str(prefix);
            path.push(' ');
            continue;
        }
        path.push_str(token);
        if !path.is_empty() {
            println!("cargo:rerun-if-changed={path}");
        }
        path.clear();
    }
}

/// Adds the wasm32-wasip2 target when rustup manages the toolchain and it is
/// missing (rustup installs a toolchain file's targets only with the toolchain).
fn ensure_wasm_target() {
    let installed = Command::new("rustup").args(["target", "list", "--installed"]).output();
    let Ok(out) = installed else { return };
    if String::from_utf8_lossy(&out.stdout).lines().any(|l| l.trim() == "wasm32-wasip2") {
        return;
    }
    println!("cargo:warning=installing the wasm32-wasip2 target (rustup target add wasm32-wasip2)");
    let ok = Command::new("rustup").args(["target", "add", "wasm32-wasip2"]).status().map(|s| s.success());
    if !matches!(ok, Ok(true)) {
        println!("cargo:warning=`rustup target add wasm32-wasip2` failed; the plugin build will say why");
    }
}

fn main() {
    ensure_wasm_target();
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let workspace = manifest.parent().unwrap().parent().unwrap().to_path_buf();
    let target_dir = workspace.join("target").join("plugin-build");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", workspace.join("Cargo.lock").display());
    println!("cargo:rerun-if-changed={}", workspace.join("plugin-sdk/wit").display());

    let all: Vec<&str> = PLUGINS.iter().map(|p| p.0).collect();
    let native: Vec<&str> = PLUGINS.iter().filter(|p| p.3).map(|p| p.0).collect();
    cargo(&workspace, &target_dir, Some("wasm32-wasip2"), &all);
    cargo(&workspace, &target_dir, None, &native);

    let wasm_dir = target_dir.join("wasm32-wasip2/release");
    let native_dir = target_dir.join("release");
    let mut code = String::new();
    let mut each = String::new();
    for &(_, lib, shipped, native) in PLUGINS {
        let wasm = wasm_dir.join(format!("{lib}.wasm"));
        track(&wasm_dir.join(format!("{lib}.d")));
        let konst = lib.to_uppercase();
        let name = lib.replace('_', "-");
        code += &format!(
            "/// The `{name}` component.\npub const {konst}_WASM: &str = {:?};\n",
            wasm.display().to_string()
        );
        if shipped {
            let dest = workspace.join("plugins").join(format!("{name}.wasm"));
            let fresh = fs::read(&wasm).ok() != fs::read(&dest).ok();
            if fresh {
                fs::copy(&wasm, &dest).unwrap_or_else(|e| panic!("copy to {}: {e}", dest.display()));
            }
            if native {
                each += &format!("    ({name:?}, {konst}_WASM, {konst}_SO),\n");
            }
        }
        if native {
            let so = native_dir.join(format!("lib{lib}.so"));
            track(&native_dir.join(format!("lib{lib}.d")));
            code += &format!(
                "/// The native build of `{name}`.\npub const {konst}_SO: &str = {:?};\n",
                so.display().to_string()
            );
        }
    }
    code += &format!(
        "/// Every shipped plugin built both ways: (name, component, native library).\npub const SHIPPED: &[(&str, &str, &str)] = &[\n{each}];\n"
    );
    fs::write(out_dir.join("gen.rs"), code).unwrap();
}
