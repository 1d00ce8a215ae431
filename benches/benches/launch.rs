//! Your own program under the runtime: the NumPy example
//! (`examples/numpy-mlp/train.py`) under `edl-runtime launch` with one
//! worker and no teachers, against the same loop run bare
//! (`benches/numpy_bare.py`: same data, weights, gradient, update and batch).
//!
//!     cargo build --release -p edl-runtime -p edl-python && cargo bench -p edl-benches --bench launch
//!
//! For step times of about 5 ms and 50 ms (the example's `STEP_DELAY_MS`
//! added to its ~1 ms of NumPy), side by side in one run: the steady-state
//! seconds per step of each (the launched job's from its report's timeline
//! after the first fifth of the steps, as the `job` bench; the bare loop's
//! the same way), the median of three runs each. The ratio is launched
//! samples/s over bare samples/s (1.0: the runtime costs nothing).
//!
//! Python with NumPy comes from `target/edl-python/venv` (made here, from
//! the package registry, when it is missing).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace").to_path_buf()
}

/// target/release, where the runtime and the package were built.
fn release_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the bench's path");
    let dir = exe.parent().and_then(Path::parent).expect("target/release").to_path_buf();
    for built in ["edl-runtime", "lib_edl.so"] {
        assert!(
            dir.join(built).exists(),
            "build first: cargo build --release -p edl-runtime -p edl-python ({} missing)",
            dir.join(built).display()
        );
    }
    dir
}

fn check(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Python with NumPy and the release build of the `edl` package on its path.
struct Python {
    bin: PathBuf,
    site: PathBuf,
}

impl Python {
    fn new(release: &Path) -> Python {
        let base = release.parent().expect("target").join("edl-python");
        let bin = base.join("venv/bin");
        let has_numpy = Command::new(bin.join("python")).args(["-c", "import numpy"]).status();
        if !has_numpy.is_ok_and(|s| s.success()) {
            check(Command::new("python3").args(["-m", "venv"]).arg(base.join("venv")), "python3 -m venv");
            check(
                Command::new(bin.join("python")).args(["-m", "pip", "install", "-q", "numpy>=1.22"]),
                "pip install numpy",
            );
        }
        let pkg = base.join("release-site/edl");
        std::fs::create_dir_all(&pkg).expect("the package's directory");
        std::fs::copy(root().join("runtime/python/python/edl/__init__.py"), pkg.join("__init__.py"))
            .expect("the package's Python part");
        std::fs::copy(release.join("lib_edl.so"), pkg.join("_edl.abi3.so")).expect("the package's extension");
        Python { bin, site: base.join("release-site") }
    }

    fn command(&self, program: &Path, delay_ms: u32) -> Command {
        let mut c = Command::new(program);
        let path = std::env::var("PATH").unwrap_or_default();
        c.current_dir(root())
            .env("PYTHONPATH", &self.site)
            .env("PATH", format!("{}:{path}", self.bin.display()))
            .env("STEP_DELAY_MS", delay_ms.to_string());
        c
    }
}

/// Steady-state seconds per step of the bare loop.
fn bare_step(py: &Python, delay_ms: u32, epochs: u32) -> f64 {
    let out = check(
        py.command(&py.bin.join("python"), delay_ms)
            .arg(root().join("benches/numpy_bare.py"))
            .args([epochs.to_string(), "64".into()]),
        "the bare loop",
    );
    out.trim().parse().expect("seconds per step")
}

/// Steady-state seconds per committed step of the example under `launch`.
fn launch_step(py: &Python, release: &Path, delay_ms: u32, epochs: u32, dir: &Path, run: u32) -> f64 {
    let name = format!("bench-launch-{delay_ms}ms-{run}");
    let report = dir.join(format!("{name}.json"));
    check(
        py.command(&release.join("edl-runtime"), delay_ms)
            .args(["launch", "--samples", "4000", "--no-distill", "--max-workers", "1", "--batch", "64"])
            .args(["--job", &name, "--epochs", &epochs.to_string()])
            .arg("--checkpoint-dir")
            .arg(dir.join(&name))
            .arg("--report")
            .arg(&report)
            .args(["--", "python", "examples/numpy-mlp/train.py"]),
        "the launched example",
    );
    edl_benches::steady_step_secs(&report)
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` does not: nothing to measure then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let release = release_dir();
    let py = Python::new(&release);
    let dir = tempfile::tempdir().expect("a scratch directory");
    println!("| step delay | bare step | launched step | launched / bare samples/s |");
    println!("|---|---|---|---|");
    for (delay_ms, epochs) in [(4u32, 8u32), (49, 3)] {
        let bare = median((0..3).map(|_| bare_step(&py, delay_ms, epochs)).collect());
        let launched =
            median((0..3).map(|run| launch_step(&py, &release, delay_ms, epochs, dir.path(), run)).collect());
        println!(
            "| {delay_ms} ms | {:.2} ms | {:.2} ms | {:.3} |",
            bare * 1e3,
            launched * 1e3,
            bare / launched
        );
    }
}
