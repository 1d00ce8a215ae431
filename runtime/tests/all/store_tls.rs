//! The stores reached over TLS, started by the test itself: an etcd member
//! that demands client certificates and, once auth is enabled, a user and
//! password (`etcds://`), and a Redis that serves only TLS (`rediss://`).
//! A job runs to its end on each; what lacks a certificate or the password
//! is refused with an error naming the store, without the password.

use crate::support::{
    job::{assert_exactly_once, finish, job, lines, report},
    runtime,
};
use edl_plugin_artifacts as art;
use edl_runtime::store::{AnyStore, Store};
use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A CA, and certificates it signed for 127.0.0.1: the server's and a
/// client's, written under `dir`.
struct Certs {
    ca: PathBuf,
    server: (PathBuf, PathBuf),
    client: (PathBuf, PathBuf),
}

fn certs(dir: &Path) -> Certs {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let pair = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        (write(&format!("{name}.pem"), cert.pem()), write(&format!("{name}.key"), key.serialize_pem()))
    };
    let (server, client) = (pair("server"), pair("client"));
    Certs { ca: write("ca.pem", ca.pem()), server, client }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Kills the child when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `store` until it answers (bounded).
fn answers(url: &str) -> Result<(), String> {
    let rt = runtime();
    let store = rt.block_on(async { AnyStore::open(url) }).map_err(|e| e.to_string())?;
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        match rt.block_on(store.get("edl/probe")) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= until => return Err(e.to_string()),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Runs a small job on `store` to its end; returns its output.
fn small_job(dir: &Path, store: &str) -> String {
    let flags = ["--policy", art::AUTOSCALE_WASM, "--no-distill", "--train-samples", "400", "--epochs", "2"];
    let mut c = job(dir, &[&flags[..], &["--store", store, "--job", "tls"]].concat()).spawn().unwrap();
    let rx = lines(&mut c);
    let mut seen = Vec::new();
    let status = finish(c, rx, &mut seen);
    let out = seen.join("\n");
    assert!(status.success(), "{out}");
    assert_exactly_once(&report(dir), 2, 400);
    out
}

#[test]
fn an_etcd_member_with_client_certificates_and_auth_is_reached_over_etcds_and_a_job_runs_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let c = certs(dir.path());
    let (client, peer) = (free_port(), free_port());
    let bin = std::env::var_os("EDL_ETCD").map(PathBuf::from).unwrap_or_else(|| "etcd".into());
    let _etcd = Killed(
        Command::new(&bin)
            .args(["--name", "m0", "--data-dir"])
            .arg(dir.path().join("m0"))
            .args(["--listen-client-urls", &format!("https://127.0.0.1:{client}")])
            .args(["--advertise-client-urls", &format!("https://127.0.0.1:{client}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &format!("m0=http://127.0.0.1:{peer}")])
            .arg("--cert-file")
            .arg(&c.server.0)
            .arg("--key-file")
            .arg(&c.server.1)
            .arg("--client-cert-auth")
            .arg("--trusted-ca-file")
            .arg(&c.ca)
            // Tokens that expire while the job runs: the client gets new ones.
            .args(["--auth-token-ttl", "2"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd (.ci/run installs etcd-server)"),
    );
    let tls = format!("ca={}&cert={}&key={}", c.ca.display(), c.client.0.display(), c.client.1.display());
    let plain = format!("etcds://127.0.0.1:{client}/?{tls}");
    answers(&plain).unwrap();
    // Auth on: a root user with a password (through the client itself).
    runtime().block_on(async {
        use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
        let read = |p: &PathBuf| std::fs::read(p).unwrap();
        let options = ConnectOptions::new().with_tls(
            TlsOptions::new()
                .ca_certificate(Certificate::from_pem(read(&c.ca)))
                .identity(Identity::from_pem(read(&c.client.0), read(&c.client.1))),
        );
        let mut admin =
            Client::connect([format!("https://127.0.0.1:{client}")], Some(options)).await.unwrap();
        admin.user_add("root", "s3cret-pw", None).await.unwrap();
        admin.user_grant_role("root", "root").await.unwrap();
        admin.auth_enable().await.unwrap();
    });
    let with_user = format!("etcds://root:s3cret-pw@127.0.0.1:{client}/?{tls}");
    answers(&with_user).unwrap();
    // Without the password, with a wrong one, without a client certificate,
    // or without TLS: refused, naming the store and never the password.
    let refusals = [
        plain.clone(),
        format!("etcds://root:wrong@127.0.0.1:{client}/?{tls}"),
        format!("etcds://root:s3cret-pw@127.0.0.1:{client}/?ca={}", c.ca.display()),
        format!("etcd://127.0.0.1:{client}"),
    ];
    for url in &refusals {
        let rt = runtime();
        let store = rt.block_on(async { AnyStore::open(url) }).unwrap();
        let e = rt.block_on(store.put("edl/probe", b"x", None)).unwrap_err().to_string();
        assert!(e.contains(&format!("127.0.0.1:{client}")) && !e.contains("s3cret-pw"), "{url}: {e}");
    }
    // A password over etcd:// is refused before anything is sent; so are a
    // file that is not there and a setting that is not one.
    let e = AnyStore::open(&format!("etcd://root:s3cret-pw@127.0.0.1:{client}")).err().unwrap().to_string();
    assert!(e.contains("would cross in clear") && !e.contains("s3cret-pw"), "{e}");
    let e = AnyStore::open(&format!("etcds://127.0.0.1:{client}/?ca=/nope.pem")).err().unwrap().to_string();
    assert!(e.contains("ca=/nope.pem"), "{e}");
    let e = AnyStore::open(&format!("etcds://127.0.0.1:{client}/?cafile=x")).err().unwrap().to_string();
    assert!(e.contains("unknown setting \"cafile\""), "{e}");
    // TLS settings on a URL in clear would be ignored: refused.
    let e = AnyStore::open(&format!("etcd://127.0.0.1:{client}/?{tls}")).err().unwrap().to_string();
    assert!(e.contains("use etcds://"), "{e}");
    // A job (its coordinator and its workers) runs on it to its end.
    let out = small_job(dir.path(), &with_user);
    assert!(!out.contains("s3cret-pw"), "{out}");
}

#[test]
fn a_redis_that_serves_only_tls_is_reached_over_rediss_and_a_job_runs_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let c = certs(dir.path());
    let port = free_port();
    let bin =
        std::env::var_os("EDL_REDIS_SERVER").map(PathBuf::from).unwrap_or_else(|| "redis-server".into());
    let _redis = Killed(
        Command::new(&bin)
            .args(["--bind", "127.0.0.1", "--port", "0", "--tls-port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--tls-auth-clients", "optional"])
            .arg("--tls-cert-file")
            .arg(&c.server.0)
            .arg("--tls-key-file")
            .arg(&c.server.1)
            .arg("--tls-ca-cert-file")
            .arg(&c.ca)
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (.ci/run installs it)"),
    );
    let url = format!("rediss://127.0.0.1:{port}/?ca={}", c.ca.display());
    answers(&url).unwrap();
    let e = runtime()
        .block_on(async { AnyStore::open(&format!("redis://127.0.0.1:{port}/?ca={}", c.ca.display())) })
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("use rediss://"), "{e}");
    // In clear, or without the CA that signed the server's certificate: refused.
    for url in [format!("redis://127.0.0.1:{port}/"), format!("rediss://127.0.0.1:{port}/")] {
        let rt = runtime();
        let store = rt.block_on(async { AnyStore::open(&url) }).unwrap();
        assert!(rt.block_on(store.put("edl/probe", b"x", None)).is_err(), "{url}");
    }
    small_job(dir.path(), &url);
}
