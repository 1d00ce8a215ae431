//! Compiles the Open Inference Protocol proto with protox (pure Rust: no
//! `protoc` to install) and tonic.

fn main() {
    let proto = "proto/grpc_predict_v2.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"]).expect("proto/grpc_predict_v2.proto compiles");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .expect("tonic code generation");
}
