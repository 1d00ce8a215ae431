//! For tests of code that uses CUDA: they run where a GPU is usable and say
//! why they are skipped elsewhere.

use crate::device::{CudaUnavailable, check_cuda, cublas_present};

/// Whether a CUDA test can run on device 0 (driver, device, NVRTC and
/// cuBLAS): false, with a `SKIPPED <test>: <reason>` line on stderr, on a
/// machine without them. With `EDL_REQUIRE_CUDA=1` in the environment (set
/// on GPU machines) a missing GPU fails the test instead of skipping it.
pub fn cuda_or_skip(test: &str) -> bool {
    let usable =
        check_cuda(0).and_then(|()| if cublas_present() { Ok(()) } else { Err(CudaUnavailable::NoCublas) });
    match usable {
        Ok(()) => true,
        Err(why) if std::env::var_os("EDL_REQUIRE_CUDA").is_some_and(|v| v == "1") => {
            panic!("{test}: EDL_REQUIRE_CUDA=1 but CUDA is unusable here: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            false
        }
    }
}
