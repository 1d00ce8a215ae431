//! The `edl` Python package in virtual environments: with NumPy and
//! pytest (built once per test run), and with PyTorch (once per machine).

use crate::support::{process::output_of, root};
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::OnceLock,
};

pub(crate) struct PyEnv {
    /// The virtual environment's `bin/`.
    bin: PathBuf,
    /// What goes on PYTHONPATH: holds the `edl` package.
    site: PathBuf,
}

/// Builds the package and its environment once per test run.
pub(crate) fn py() -> &'static PyEnv {
    static ENV: OnceLock<Result<PyEnv, String>> = OnceLock::new();
    ENV.get_or_init(setup).as_ref().unwrap_or_else(|e| panic!("{e}"))
}

/// The package in an environment with PyTorch (CPU use of the PyPI
/// wheel) and TensorBoard, made once per machine and reused by every later run: at
/// `$EDL_TORCH_VENV`, else `~/.cache/edl/venv-torch`.
pub(crate) fn torch_py() -> &'static PyEnv {
    static ENV: OnceLock<Result<PyEnv, String>> = OnceLock::new();
    ENV.get_or_init(|| {
        let site = py().site.clone();
        let venv = match std::env::var_os("EDL_TORCH_VENV") {
            Some(v) => PathBuf::from(v),
            None => {
                let home = std::env::var_os("HOME").ok_or("HOME is not set: give EDL_TORCH_VENV")?;
                Path::new(&home).join(".cache/edl/venv-torch")
            }
        };
        // tensorboard: its EventAccumulator reads a job's event files back.
        let bin = venv_with(
            &venv,
            "import torch, numpy, pytest, tensorboard",
            &["torch>=2.4", "numpy>=1.22", "pytest>=7", "tensorboard>=2.14"],
        )?;
        Ok(PyEnv { bin, site })
    })
    .as_ref()
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A virtual environment at `venv` in which `probe` runs: made, and
/// `packages` installed from the package registry, only when it does not.
pub(crate) fn venv_with(venv: &Path, probe: &str, packages: &[&str]) -> Result<PathBuf, String> {
    let bin = venv.join("bin");
    let ready = |bin: &Path| {
        Command::new(bin.join("python"))
            .args(["-c", probe])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !ready(&bin) {
        output_of(Command::new("python3").args(["-m", "venv"]).arg(venv), "python3 -m venv")?;
        output_of(
            Command::new(bin.join("python"))
                .args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
                .args(packages),
            &format!("installing {} from the package registry", packages.join(", ")),
        )?;
    }
    Ok(bin)
}

fn setup() -> Result<PyEnv, String> {
    let exe = Path::new(env!("CARGO_BIN_EXE_edl-runtime"));
    let profile = exe.parent().unwrap();
    let target = profile.parent().unwrap();
    // `cargo test --workspace` has built it already; this is then a no-op.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build.current_dir(root()).args(["build", "-p", "edl-python"]).env("CARGO_TARGET_DIR", target);
    if profile.file_name().is_some_and(|n| n == "release") {
        build.arg("--release");
    }
    output_of(&mut build, "building the edl package (cargo build -p edl-python)")?;
    let base = target.join("edl-python");
    // noiseprotocol: an independent Noise implementation, which the
    // package's tests speak the job channel's handshake with;
    // prometheus_client: the reference parser of a job's metrics.
    let bin = venv_with(
        &base.join("venv"),
        "import numpy, pytest, noise, prometheus_client",
        &["numpy>=1.22", "pytest>=7", "noiseprotocol>=0.3", "prometheus_client>=0.17"],
    )?;
    let site = base.join("site");
    let pkg = site.join("edl");
    std::fs::create_dir_all(&pkg).map_err(|e| format!("{}: {e}", pkg.display()))?;
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to)
            .map(|_| ())
            .map_err(|e| format!("{} -> {}: {e}", from.display(), to.display()))
    };
    for source in ["__init__.py", "torch.py"] {
        copy(&root().join("runtime/python/python/edl").join(source), &pkg.join(source))?;
    }
    copy(&profile.join("lib_edl.so"), &pkg.join("_edl.abi3.so"))?;
    Ok(PyEnv { bin, site })
}

impl PyEnv {
    pub(crate) fn python(&self) -> Command {
        let mut c = Command::new(self.bin.join("python"));
        self.env(&mut c);
        c
    }

    pub(crate) fn bin(&self) -> &Path {
        &self.bin
    }

    pub(crate) fn env(&self, c: &mut Command) {
        let path = std::env::var("PATH").unwrap_or_default();
        c.env("PYTHONPATH", &self.site).env("PATH", format!("{}:{path}", self.bin.display()));
    }
}
