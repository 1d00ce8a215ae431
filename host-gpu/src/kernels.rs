//! The CUDA C sources this crate compiles at run time with NVRTC, each held
//! in `kernels/` and included here. The device probe compiles every one and
//! the loss and the MLP load their own; with the sources in a file of their
//! own, both sides depend on it and not on each other.

/// One CUDA C source file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// The file's name in `kernels/`: it names the source in messages and
    /// keys the cache of compiled modules.
    pub name: &'static str,
    /// The CUDA C text.
    pub code: &'static str,
}

/// The fused soft-label loss and its gradient, for [`crate::loss::CudaSoftLabel`].
pub const SOFT_LABEL: KernelSource =
    KernelSource { name: "soft_label.cu", code: include_str!("../kernels/soft_label.cu") };

/// The MLP trainer's element-wise and reduction kernels, for [`crate::mlp::CudaMlp`].
pub const MLP: KernelSource = KernelSource { name: "mlp.cu", code: include_str!("../kernels/mlp.cu") };

/// Every source as (file name, CUDA C), in the order the device report lists them.
pub const KERNEL_SOURCES: [(&str, &str); 2] = [(SOFT_LABEL.name, SOFT_LABEL.code), (MLP.name, MLP.code)];
