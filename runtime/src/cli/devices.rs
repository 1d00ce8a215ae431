//! `edl-runtime devices`: the devices and CUDA libraries this machine offers.

use std::process::ExitCode;

pub fn run() -> ExitCode {
    println!("{}", edl_host_gpu::DeviceReport::probe());
    ExitCode::SUCCESS
}
