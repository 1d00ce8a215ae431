//! Checkpoints in object storage, against a real S3-compatible server:
//! moto's server mode, installed from the package registry into a virtual
//! environment under the target directory (once per target directory).

use crate::support::{
    job::{finish, job, lines, report},
    wait::wait_for,
};
use edl_plugin_artifacts as art;
use edl_runtime::checkpoint::{Checkpoints, objects::ObjectDir};
use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

/// The virtual environment holding moto's server (`bin/`).
fn moto_bin() -> &'static Path {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let made = BIN.get_or_init(|| {
        let exe = Path::new(env!("CARGO_BIN_EXE_edl-runtime"));
        let venv = exe.parent().unwrap().parent().unwrap().join("moto/venv");
        let bin = venv.join("bin");
        if bin.join("moto_server").exists() {
            return Ok(bin);
        }
        let run = |cmd: &mut Command, what: &str| -> Result<(), String> {
            let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
            if out.status.success() {
                return Ok(());
            }
            Err(format!(
                "{what} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        };
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv), "python3 -m venv")?;
        let pip = ["-m", "pip", "install", "--disable-pip-version-check", "-q", "moto[server]>=5,<6"];
        run(Command::new(bin.join("python")).args(pip), "installing moto from the package registry")?;
        Ok(bin)
    });
    made.as_deref().unwrap_or_else(|e| panic!("{e}"))
}

/// An S3 server of this test's own on a free loopback port, with a bucket.
struct S3 {
    port: u16,
    child: Child,
}

impl S3 {
    fn start(bucket: &str) -> S3 {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(moto_bin().join("moto_server"))
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let s3 = S3 { port, child };
        let until = Instant::now() + Duration::from_secs(60);
        // The bucket, made with a plain request (moto takes unsigned ones).
        loop {
            let made = TcpStream::connect(("127.0.0.1", port)).and_then(|mut c| {
                write!(c, "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
                let mut answer = String::new();
                c.read_to_string(&mut answer)?;
                Ok(answer)
            });
            match made {
                Ok(a) if a.starts_with("HTTP/1.1 200") => return s3,
                Ok(a) => panic!("creating bucket {bucket}: {a}"),
                Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(100)),
                Err(e) => panic!("moto_server did not answer on port {}: {e}", port),
            }
        }
    }

    /// `prefix` of the bucket `edl`, opened here as `url`.
    fn dir(&self, url: &str, prefix: &str) -> ObjectDir {
        let store = object_store::aws::AmazonS3Builder::new()
            .with_bucket_name("edl")
            .with_endpoint(format!("http://127.0.0.1:{}", self.port))
            .with_allow_http(true)
            .with_access_key_id("testing")
            .with_secret_access_key("testing")
            .with_region("us-east-1")
            .build()
            .unwrap();
        ObjectDir::with_store(std::sync::Arc::new(store), prefix.into(), url).unwrap()
    }

    /// The environment object storage clients read (credentials moto accepts).
    fn env(&self) -> [(&'static str, String); 5] {
        [
            ("AWS_ENDPOINT", format!("http://127.0.0.1:{}", self.port)),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_ACCESS_KEY_ID", "testing".into()),
            ("AWS_SECRET_ACCESS_KEY", "testing".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_job_keeps_its_checkpoints_in_s3_and_resumes_from_there_after_it_was_killed() {
    let s3 = S3::start("edl");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = "s3://edl/jobs/mnist";
    let args = [
        "--policy",
        art::HOSTILE_POLICY_WASM,
        "--policy-config",
        "mode=hold",
        "--no-distill",
        "--teachers",
        "0",
        "--epochs",
        "3",
        "--checkpoint-every",
        "5",
        "--step-delay-ms",
        "30",
        "--checkpoint-dir",
        url,
    ];
    let start = || {
        let mut c = job(d, &args);
        for (k, v) in s3.env() {
            c.env(k, v);
        }
        c.spawn().unwrap()
    };
    let mut child = start();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "epoch     0 done", &mut seen, Duration::from_secs(120));
    // The whole job dies at once; its workers die with it.
    child.kill().unwrap();
    child.wait().unwrap();

    // What the killed job left is in the bucket, and complete.
    let cps = Checkpoints::in_objects(s3.dir(url, "jobs/mnist"), 3);
    let (newest, skipped) = cps.latest().unwrap();
    let newest = newest.expect("a checkpoint in the bucket");
    assert!(skipped.is_empty(), "{skipped:?}");
    assert!(newest.manifest.step >= 5, "{}", newest.manifest.step);
    assert!(!d.join(".edl/mnist/checkpoints").exists(), "nothing was written to the local disk");

    // A new run resumes from the bucket and trains every sample exactly once.
    let mut child = start();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, &format!("from {url}/step-"), &mut seen, Duration::from_secs(120));
    let status = finish(child, rx, &mut seen);
    assert!(status.success(), "{}", seen.join("\n"));
    let r = report(d);
    for e in r["epochs"].as_array().unwrap() {
        assert_eq!(
            (&e["samples_committed"], &e["duplicates"], &e["missing"]),
            (&1200.into(), &0.into(), &0.into()),
            "{e}"
        );
    }
    assert_eq!(r["epochs"].as_array().unwrap().len(), 3);
    assert!(r["final_checkpoint"].as_str().unwrap().starts_with(url), "{r}");
    // The report lists the checkpoints written there (the newest kept).
    let listed: Vec<&str> = r["checkpoints"].as_array().unwrap().iter().filter_map(|c| c.as_str()).collect();
    assert!(!listed.is_empty() && listed.iter().all(|c| c.starts_with(url)), "{r}");
    assert!(cps.has_file("complete.json").unwrap(), "the finished job is marked in the bucket");
}
