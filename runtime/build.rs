//! Compiles the Open Inference Protocol proto with protox (pure Rust: no
//! `protoc` to install) and tonic. In debug builds (what `cargo test`
//! makes) it also makes sure `redis-server` is there for the store tests,
//! installing it with apt-get when it is missing and this user may.

use std::process::Command;

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

fn ensure_redis_server() {
    if on_path("redis-server") || !on_path("apt-get") {
        return;
    }
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0"));
    let sudo = !root && Command::new("sudo").args(["-n", "true"]).status().is_ok_and(|s| s.success());
    if !root && !sudo {
        println!(
            "cargo:warning=redis-server is missing and cannot be installed here; the store tests will say so"
        );
        return;
    }
    println!("cargo:warning=installing redis-server for the store tests (apt-get install redis-server)");
    let apt = |args: &[&str]| {
        let mut c = if root { Command::new("apt-get") } else { Command::new("sudo") };
        if !root {
            c.arg("apt-get");
        }
        c.args(args).env("DEBIAN_FRONTEND", "noninteractive").status().is_ok_and(|s| s.success())
    };
    let installed = apt(&["install", "-y", "-q", "redis-server"])
        || (apt(&["update", "-q"]) && apt(&["install", "-y", "-q", "redis-server"]));
    if !installed {
        println!("cargo:warning=apt-get could not install redis-server; the store tests will say so");
    }
    // The package starts a system-wide server; the tests start their own.
    let _ = Command::new("service").args(["redis-server", "stop"]).output();
}

fn main() {
    if std::env::var("PROFILE").as_deref() == Ok("debug") {
        ensure_redis_server();
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
