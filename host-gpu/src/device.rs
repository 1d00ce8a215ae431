//! Devices and what the machine offers.

pub use crate::kernels::KERNEL_SOURCES;
use crate::kernels::KernelSource;
use cudarc::{
    driver::{CudaContext, CudaModule},
    nvrtc::Ptx,
};
use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, OnceLock},
};

/// Where a computation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}: expected cpu, cuda or cuda:N")),
        }
    }
}

/// Why CUDA cannot be used here.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaUnavailable {
    #[error("no CUDA driver library (libcuda) found")]
    NoDriver,
    #[error("no NVRTC library (libnvrtc) found; it compiles the CUDA kernels at run time")]
    NoNvrtc,
    #[error("no cuBLAS library (libcublas) found; it runs the trainer's matrix products")]
    NoCublas,
    #[error("no NCCL library (libnccl) found")]
    NoNccl,
    #[error("the CUDA driver reports no device")]
    NoDevice,
    #[error("CUDA device {ordinal} does not exist (this machine has {count})")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("CUDA driver error: {0}")]
    Driver(String),
}

/// The CUDA driver library is loadable. Checked before any cudarc call,
/// because cudarc's loaders panic when the library is missing.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// NVRTC is loadable.
pub fn nvrtc_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// cuBLAS is loadable.
pub fn cublas_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// NCCL is loadable.
pub fn nccl_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// The number of CUDA devices, or why there are none usable.
pub fn cuda_device_count() -> Result<usize, CudaUnavailable> {
    if !driver_present() {
        return Err(CudaUnavailable::NoDriver);
    }
    match cudarc::driver::CudaContext::device_count() {
        Ok(0) => Err(CudaUnavailable::NoDevice),
        Ok(n) => Ok(n as usize),
        Err(e) => Err(CudaUnavailable::Driver(e.to_string())),
    }
}

/// Checks that `device` can run the CUDA kernels (driver, device, NVRTC).
pub fn check_cuda(ordinal: usize) -> Result<(), CudaUnavailable> {
    let count = cuda_device_count()?;
    if ordinal >= count {
        return Err(CudaUnavailable::NoSuchDevice { ordinal, count });
    }
    if !nvrtc_present() {
        return Err(CudaUnavailable::NoNvrtc);
    }
    Ok(())
}

/// Why a kernel source did not become a loaded module.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    #[error(transparent)]
    Unavailable(#[from] CudaUnavailable),
    /// NVRTC rejected the source; `log` is its compile log.
    #[error("compiling {name}: {log}")]
    Compile { name: &'static str, log: String },
    /// The driver did not load the compiled module.
    #[error("loading {name}: {reason}")]
    Load { name: &'static str, reason: String },
}

/// Compiles every kernel source with NVRTC, which needs no GPU: the PTX by
/// file name, or the first source's compile log. An error without NVRTC.
pub fn compile_kernels() -> Result<Vec<(&'static str, String)>, KernelError> {
    if !nvrtc_present() {
        return Err(CudaUnavailable::NoNvrtc.into());
    }
    KERNEL_SOURCES
        .iter()
        .map(|&(name, source)| {
            let ptx = cudarc::nvrtc::compile_ptx(source)
                .map_err(|e| KernelError::Compile { name, log: format!("{e:?}") })?;
            let text = ptx.as_bytes().map(String::from_utf8_lossy).unwrap_or_default();
            Ok((name, text.trim_end_matches('\0').to_string()))
        })
        .collect()
}

/// The module of `kernel` on device `ordinal`: compiled by NVRTC once per
/// process, loaded once per device.
pub(crate) fn kernel_module(
    ctx: &Arc<CudaContext>,
    ordinal: usize,
    kernel: KernelSource,
) -> Result<Arc<CudaModule>, KernelError> {
    type Compiled = HashMap<&'static str, Result<Ptx, KernelError>>;
    type Loaded = HashMap<(&'static str, usize), Arc<CudaModule>>;
    static PTX: OnceLock<Mutex<Compiled>> = OnceLock::new();
    static MODULES: OnceLock<Mutex<Loaded>> = OnceLock::new();
    let KernelSource { name, code } = kernel;
    let mut modules = MODULES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(m) = modules.get(&(name, ordinal)) {
        return Ok(m.clone());
    }
    let ptx = PTX
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(name)
        .or_insert_with(|| {
            cudarc::nvrtc::compile_ptx(code).map_err(|e| KernelError::Compile { name, log: format!("{e:?}") })
        })
        .clone()?;
    let m = ctx.load_module(ptx).map_err(|e| KernelError::Load { name, reason: format!("{e:?}") })?;
    modules.insert((name, ordinal), m.clone());
    Ok(m)
}

/// What this machine offers, for `edl-runtime devices`.
#[derive(Clone, Debug)]
pub struct DeviceReport {
    pub cpu_threads: usize,
    /// (ordinal, name) of each CUDA device, or why there is none.
    pub cuda: Result<Vec<(usize, String)>, CudaUnavailable>,
    pub nvrtc: bool,
    pub cublas: bool,
    /// Whether the kernels compile (with NVRTC), or why not.
    pub kernels: Result<(), KernelError>,
    pub nccl: Option<String>,
}

impl DeviceReport {
    /// Probes the machine; never panics.
    pub fn probe() -> Self {
        let cuda = cuda_device_count().and_then(|n| {
            (0..n)
                .map(|i| {
                    let ctx = cudarc::driver::CudaContext::new(i)
                        .map_err(|e| CudaUnavailable::Driver(e.to_string()))?;
                    let name = ctx.name().map_err(|e| CudaUnavailable::Driver(e.to_string()))?;
                    Ok((i, name))
                })
                .collect()
        });
        let nccl = nccl_present().then(|| match cudarc::nccl::result::get_nccl_version() {
            Ok(v) => format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100),
            Err(e) => format!("present, version unknown ({e:?})"),
        });
        DeviceReport {
            cpu_threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            cuda,
            nvrtc: nvrtc_present(),
            cublas: cublas_present(),
            kernels: compile_kernels().map(|_| ()),
            nccl,
        }
    }
}

impl fmt::Display for DeviceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "cpu      {} threads", self.cpu_threads)?;
        match &self.cuda {
            Ok(devices) => {
                for (i, name) in devices {
                    writeln!(f, "cuda:{i}   {name}")?;
                }
            }
            Err(why) => writeln!(f, "cuda     unavailable: {why}")?,
        }
        let found = |present: bool| if present { "present" } else { "not found" };
        writeln!(f, "nvrtc    {}", found(self.nvrtc))?;
        writeln!(f, "cublas   {}", found(self.cublas))?;
        match &self.kernels {
            Ok(()) => writeln!(f, "kernels  {} compile", KERNEL_SOURCES.map(|(name, _)| name).join(", "))?,
            Err(why) => writeln!(f, "kernels  not compiled: {why}")?,
        }
        write!(f, "nccl     {}", self.nccl.as_deref().unwrap_or("not found"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert!("tpu".parse::<Device>().is_err());
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }

    #[test]
    fn probing_never_panics() {
        let report = DeviceReport::probe();
        assert!(report.cpu_threads >= 1);
        // On a machine without a driver the answer is an error value.
        if !driver_present() {
            assert_eq!(report.cuda.unwrap_err(), CudaUnavailable::NoDriver);
        }
    }
}
