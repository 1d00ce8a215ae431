//! Compiles the Open Inference Protocol proto with protox (pure Rust: no
//! `protoc` to install) and tonic. In debug builds (what `cargo test`
//! makes) it also makes sure the servers and tools the tests use are there
//! (redis-server, etcd, tcpdump, nft, Slurm and munge), installing them with apt-get when
//! they are missing and this user may.

use std::process::Command;

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

/// The servers and tools the tests start or use, by the program that shows
/// each is there and the Debian package that brings it.
const TEST_TOOLS: [(&str, &str, &str); 6] = [
    ("redis-server", "redis-server", "the store and distillation tests"),
    ("etcd", "etcd-server", "the etcd store tests"),
    ("tcpdump", "tcpdump", "the test that captures a job's traffic"),
    ("nft", "nftables", "the test that firewalls a coordinator from its store"),
    ("slurmctld", "slurm-wlm", "the test that runs a job on a Slurm cluster"),
    ("munged", "munge", "the test that runs a job on a Slurm cluster"),
];

fn on_path_or_sbin(bin: &str) -> bool {
    on_path(bin) || ["/usr/sbin", "/sbin"].iter().any(|d| std::path::Path::new(d).join(bin).is_file())
}

/// Installs with apt-get what the tests need and this machine lacks, where
/// this user may (root, or password-less sudo).
fn ensure_test_tools() {
    let missing: Vec<&(&str, &str, &str)> =
        TEST_TOOLS.iter().filter(|(bin, _, _)| !on_path_or_sbin(bin)).collect();
    if missing.is_empty() || !on_path("apt-get") {
        return;
    }
    let packages: Vec<&str> = missing.iter().map(|(_, pkg, _)| *pkg).collect();
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0"));
    let sudo = !root && Command::new("sudo").args(["-n", "true"]).status().is_ok_and(|s| s.success());
    if !root && !sudo {
        for (_, pkg, what) in &missing {
            println!("cargo:warning={pkg} is missing and cannot be installed here; {what} will say so");
        }
        return;
    }
    println!("cargo:warning=installing {} for the tests (apt-get install)", packages.join(", "));
    let apt = |args: &[&str]| {
        let mut c = if root { Command::new("apt-get") } else { Command::new("sudo") };
        if !root {
            c.arg("apt-get");
        }
        c.args(args).env("DEBIAN_FRONTEND", "noninteractive").status().is_ok_and(|s| s.success())
    };
    let mut install = vec!["install", "-y", "-q"];
    install.extend_from_slice(&packages);
    let installed = apt(&install) || (apt(&["update", "-q"]) && apt(&install));
    if !installed {
        println!(
            "cargo:warning=apt-get could not install {}; the tests that need them will say so",
            packages.join(", ")
        );
    }
    // The packages start system-wide servers; the tests start their own.
    for service in ["redis-server", "etcd", "slurmctld", "slurmd", "munge"] {
        let _ = Command::new("service").args([service, "stop"]).output();
    }
}

fn main() {
    if std::env::var("PROFILE").as_deref() == Ok("debug") {
        ensure_test_tools();
    }
    let proto = "proto/grpc_predict_v2.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"]).expect("proto/grpc_predict_v2.proto compiles");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .expect("tonic code generation");
}
