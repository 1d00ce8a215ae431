//! NVRTC for the kernel-compilation test on machines without a CUDA toolkit.
//!
//! NVRTC needs no GPU, so every machine can check that the CUDA C compiles:
//! where the system has no `libnvrtc`, it comes from NVIDIA's
//! `nvidia-cuda-nvrtc-cu12` wheel (PyPI), installed once per machine into a
//! virtual environment at `$EDL_NVRTC_VENV`, else `~/.cache/edl/venv-nvrtc`.

use edl_host_gpu::device::CudaUnavailable;
use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

/// The wheel, pinned: a new NVRTC may reject what an older one accepted, and
/// a kernel that stops compiling should be a change to this line, not a
/// surprise. Its CUDA 12 major version is the one cudarc's `cuda-12040`
/// feature looks for (`libnvrtc.so.12`).
const WHEEL: &str = "nvidia-cuda-nvrtc-cu12==12.9.86";

/// Whether `test` can compile kernels with NVRTC: false, with a
/// `SKIPPED <test>: <reason>` line on stderr, where neither the system nor the
/// wheel provides it. Under CI (`CI=true`) that fails the test instead, so a
/// kernel that does not compile cannot pass CI unnoticed.
pub fn nvrtc_or_skip(test: &str) -> bool {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    let usable = if edl_host_gpu::device::nvrtc_present() {
        Ok(())
    } else {
        LOADED
            .get_or_init(load_from_wheel)
            .clone()
            .map_err(|why| format!("{}; none from {WHEEL} either: {why}", CudaUnavailable::NoNvrtc))
    };
    match usable {
        Ok(()) => true,
        Err(why) if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") => {
            panic!("{test}: CI is set but NVRTC is unusable here: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            false
        }
    }
}

fn venv() -> Result<PathBuf, String> {
    if let Some(v) = std::env::var_os("EDL_NVRTC_VENV") {
        return Ok(PathBuf::from(v));
    }
    let home = std::env::var_os("HOME").ok_or("HOME is not set: give EDL_NVRTC_VENV")?;
    Ok(Path::new(&home).join(".cache/edl/venv-nvrtc"))
}

/// `lib/pythonX.Y/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12` in `venv`.
fn library_in(venv: &Path) -> Option<PathBuf> {
    std::fs::read_dir(venv.join("lib"))
        .ok()?
        .flatten()
        .map(|python| python.path().join("site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
        .find(|lib| lib.is_file())
}

/// Makes the wheel's NVRTC the one cudarc finds, installing it first when
/// the environment lacks it.
fn load_from_wheel() -> Result<(), String> {
    if !cfg!(target_os = "linux") {
        return Err("the wheel is loaded on Linux only".into());
    }
    let venv = venv()?;
    let lib = match library_in(&venv) {
        Some(lib) => lib,
        None => {
            install(&venv)?;
            library_in(&venv).ok_or_else(|| format!("{WHEEL} in {} has no libnvrtc.so.12", venv.display()))?
        }
    };
    load(&lib)?;
    if !edl_host_gpu::device::nvrtc_present() {
        return Err(format!("{} is loaded but cudarc does not find it", lib.display()));
    }
    Ok(())
}

fn install(venv: &Path) -> Result<(), String> {
    let run = |cmd: &mut Command, what: &str| {
        let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
        if out.status.success() {
            return Ok(());
        }
        let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        Err(format!("{what} failed ({}):\n{log}", out.status))
    };
    run(Command::new("python3").args(["-m", "venv"]).arg(venv), "python3 -m venv")?;
    run(
        Command::new(venv.join("bin/python"))
            .args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
            .arg(WHEEL),
        &format!("installing {WHEEL} from the package registry"),
    )
}

/// Loads `lib` by its full path for the rest of the process.
///
/// cudarc's dynamic loading opens NVRTC by bare names (`libnvrtc.so.12`
/// among them), which the dynamic linker resolves from `LD_LIBRARY_PATH` as
/// read at process start, the executable's run path and the system's
/// directories, never the wheel's. But glibc's `dlopen` of a bare name first
/// returns an object already loaded under that soname, so loading the file
/// here once, and never closing it, is enough; unlike `LD_LIBRARY_PATH` it
/// needs nothing set before the test binary starts and touches no other
/// process. NVRTC then opens its `libnvrtc-builtins.so.12.*` through its own
/// run path (`$ORIGIN`), that is from the wheel's directory beside it.
#[cfg(target_os = "linux")]
fn load(lib: &Path) -> Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading NVIDIA's NVRTC runs only its own initialisers; the
    // library is never closed (kept loaded for the rest of the process), so
    // nothing of it is used after an unload.
    let loaded = unsafe { Library::open(Some(lib), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| format!("loading {}: {e}", lib.display()))?;
    std::mem::forget(loaded);
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn load(lib: &Path) -> Result<(), String> {
    Err(format!("{}: the wheel is loaded on Linux only", lib.display()))
}
