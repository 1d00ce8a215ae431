//! Teachers started by a command the operator gives (`--teacher-command`):
//! any KServe v2 server (Triton, MLServer, `edl-runtime teacher`) on a list
//! of hosts and ports, as workers are started by `--worker-command`.
//!
//! A teacher's slot is a host of `--teacher-hosts` and a port from
//! `--teacher-port` (the slot's index on its host times two above it, so a
//! server that opens two ports has `{port}` and `{port2}`). The command runs
//! with `sh -c` in a process group of its own and must stay in the
//! foreground while the server serves (`ssh host tritonserver ...`, `srun
//! ...`, or the server itself). The teacher joins the pool once its server
//! and model answer ready (`ServerReady`/`ModelReady` over gRPC, or
//! `/v2/health/ready` and `/v2/models/M/ready` over REST); the job then
//! registers its endpoint for the students, sealed, and holds that
//! registration while it serves. A teacher told to go is deregistered,
//! served on for the drain while students stop sending to it, then given
//! the stop command (if any) and SIGTERM on its group.

use crate::distill::{TeacherAccess, oip::pb, parse_endpoint, reader::host_port};
use crate::scalers::command::{fill_known, named_host_slots};
use crate::store::{AnyStore, Lease, keys};
use anyhow::{Context, Result, bail};
use std::{path::PathBuf, sync::Arc, time::Duration};

/// What a template may name.
pub const PLACEHOLDERS: [&str; 10] =
    ["id", "host", "addr", "port", "port2", "slot", "job", "service", "model", "exe"];

/// How the job's teachers are started by command.
#[derive(Clone, Debug)]
pub struct TeacherCommand {
    /// Starts teacher `{id}` on `{host}`, serving on `{port}`.
    pub start: String,
    /// Run before its group is signalled, when a teacher is told to go.
    pub stop: Option<String>,
    /// What the students reach: `{addr}:{port}` (gRPC), `grpcs://...`,
    /// `http://{addr}:{port}/MODEL@probs` (REST), ...
    pub endpoint: String,
    /// `host`, `host:slots`, `name=addr` or `name=addr:slots` entries: a
    /// host's name for its command (`srun -w {host}`) and the address
    /// students reach it at (`{addr}`; the name when none is given).
    pub hosts: Vec<String>,
    /// The first slot's port on each host.
    pub port: u16,
    /// Longest a teacher may take to answer ready.
    pub ready_within: Duration,
}

/// A place a teacher runs: a host, its index there and its port.
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    pub host: String,
    pub addr: String,
    pub index: usize,
    pub port: u16,
}

/// The values a template's placeholders take for one teacher.
pub struct Filling<'a> {
    pub id: u32,
    pub slot: &'a Slot,
    pub job: &'a str,
    pub service: &'a str,
    pub model: &'a std::path::Path,
    pub exe: &'a std::path::Path,
}

impl TeacherCommand {
    /// Checks the templates, and returns the slots in the order they are
    /// handed out (across the hosts in turn).
    pub fn slots(&self) -> Result<Vec<Slot>> {
        let templates =
            [("--teacher-command", Some(&self.start)), ("--teacher-stop-command", self.stop.as_ref())];
        for (flag, t) in templates.into_iter().chain([("--teacher-endpoint", Some(&self.endpoint))]) {
            if let Some(t) = t {
                fill_known(t, &PLACEHOLDERS, |_| (String::new(), false))
                    .with_context(|| format!("{flag} {t:?}"))?;
            }
        }
        let mut slots = Vec::new();
        for (host, addr, index) in named_host_slots(&self.hosts, "--teacher-hosts")? {
            let port = u16::try_from(self.port as usize + 2 * index + 1).map(|p2| p2 - 1).map_err(|_| {
                anyhow::anyhow!("--teacher-port {}: slot {index} on {host} has no port", self.port)
            })?;
            slots.push(Slot { host, addr, index, port });
        }
        if slots.is_empty() {
            crate::refuse!("--teacher-command needs --teacher-hosts (the hosts and slots teachers run on)");
        }
        Ok(slots)
    }

    /// `template` filled for one teacher: quoted for the shell when
    /// `shell` (twice where the template runs through `ssh`, whose far
    /// side's shell parses the line again).
    pub fn fill(&self, template: &str, f: &Filling, shell: bool) -> Result<String> {
        let twice = shell && crate::scalers::command::runs_remote_shell(template);
        let value = |name: &str| {
            let v = match name {
                "id" => f.id.to_string(),
                "host" => f.slot.host.clone(),
                "addr" => f.slot.addr.clone(),
                "port" => f.slot.port.to_string(),
                "port2" => (f.slot.port + 1).to_string(),
                "slot" => f.slot.index.to_string(),
                "job" => f.job.to_string(),
                "service" => f.service.to_string(),
                "model" => f.model.to_string_lossy().into_owned(),
                _ => f.exe.to_string_lossy().into_owned(),
            };
            match twice {
                true => (crate::scalers::command::quote(&v).unwrap_or(v), true),
                false => (v, shell),
            }
        };
        fill_known(template, &PLACEHOLDERS, value)
    }
}

/// Waits until the teacher at `endpoint` answers ready (its server and its
/// model), for up to `within`; `gone` says whether its command exited
/// meanwhile (then the wait ends at once).
pub fn wait_ready(
    endpoint: &str,
    default_model: &str,
    access: &TeacherAccess,
    within: Duration,
    mut gone: impl FnMut() -> Option<String>,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (_, model, version) = parse_endpoint(endpoint.rsplit_once('@').map_or(endpoint, |(e, _)| e));
    let model = model.unwrap_or_else(|| default_model.to_string());
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(how) = gone() {
            bail!("its command exited before it was ready ({how})");
        }
        let probe = ready(endpoint, &model, version.as_deref().unwrap_or(""), access);
        let last = match rt.block_on(async { tokio::time::timeout(Duration::from_secs(2), probe).await }) {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e,
            Err(_) => "no answer within 2 s".to_string(),
        };
        if std::time::Instant::now() >= deadline {
            bail!("not ready within {within:?} (last: {last})");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// How long a teacher the coordinator before left may take to answer
/// ready when it is taken over (a network still settling) before it is
/// taken for gone.
pub const TAKEOVER_READY: Duration = Duration::from_secs(10);

/// Whether a server answers ready at `endpoint` now (one look).
pub fn answers_ready(endpoint: &str, default_model: &str, access: &TeacherAccess) -> bool {
    ready_within(endpoint, default_model, access, Duration::ZERO)
}

/// Whether a server answers ready at `endpoint` within `within` (asked
/// again and again until then).
pub fn ready_within(endpoint: &str, default_model: &str, access: &TeacherAccess, within: Duration) -> bool {
    wait_ready(endpoint, default_model, access, within, || None).is_ok()
}

/// One look: the server is ready and so is `model`.
async fn ready(endpoint: &str, model: &str, version: &str, access: &TeacherAccess) -> Result<(), String> {
    let (addr, _, _) = parse_endpoint(endpoint.rsplit_once('@').map_or(endpoint, |(e, _)| e));
    if addr.starts_with("http://") || addr.starts_with("https://") {
        let mut http = reqwest::Client::builder().connect_timeout(Duration::from_secs(1));
        if let Some(ca) = &access.ca_pem {
            let certs = reqwest::Certificate::from_pem_bundle(ca.as_bytes()).map_err(|e| e.to_string())?;
            http = http.tls_certs_only(certs);
        }
        let http = http.build().map_err(|e| e.to_string())?;
        let model_path = match version {
            "" => format!("/v2/models/{model}/ready"),
            v => format!("/v2/models/{model}/versions/{v}/ready"),
        };
        for path in ["/v2/health/ready", model_path.as_str()] {
            let mut req = http.get(format!("{addr}{path}"));
            if let Some(t) = &access.token {
                req = req.bearer_auth(t);
            }
            let resp = req.send().await.map_err(|e| format!("GET {path}: {e}"))?;
            if !resp.status().is_success() {
                return Err(format!("GET {path}: {}", resp.status()));
            }
        }
        return Ok(());
    }
    let (tls, authority) = match addr.split_once("://") {
        Some(("grpcs", a)) => (true, a.to_string()),
        Some((_, a)) => (false, a.to_string()),
        None => (access.ca_pem.is_some(), addr.clone()),
    };
    let mut client = grpc_client(&authority, tls, access).map_err(|e| e.to_string())?;
    fn asked<M>(m: M, access: &TeacherAccess) -> tonic::Request<M> {
        let mut r = tonic::Request::new(m);
        if let Some(t) = access.token.as_ref().and_then(|t| format!("Bearer {t}").parse().ok()) {
            r.metadata_mut().insert("authorization", t);
        }
        r
    }
    let server =
        client.server_ready(asked(pb::ServerReadyRequest {}, access)).await.map_err(|s| s.to_string())?;
    if !server.into_inner().ready {
        return Err("the server says it is not ready".into());
    }
    let m = pb::ModelReadyRequest { name: model.to_string(), version: version.to_string() };
    let answer = client.model_ready(asked(m, access)).await.map_err(|s| s.to_string())?;
    if !answer.into_inner().ready {
        return Err(format!("model {model:?} is not ready"));
    }
    Ok(())
}

fn grpc_client(
    authority: &str,
    tls: bool,
    access: &TeacherAccess,
) -> Result<crate::distill::oip::GrpcInferenceServiceClient<tonic::transport::Channel>, tonic::transport::Error>
{
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    let mut ep = Endpoint::from_shared(format!("{}://{authority}", if tls { "https" } else { "http" }))?;
    if tls {
        ep = ep.tls_config(match &access.ca_pem {
            Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)),
            None => ClientTlsConfig::new().with_webpki_roots(),
        })?;
    }
    Ok(crate::distill::oip::GrpcInferenceServiceClient::new(
        ep.connect_timeout(Duration::from_secs(1)).connect_lazy(),
    ))
}

/// Where the job registers the endpoints of the teachers it starts by
/// command (they do not register themselves): its store, under its
/// service, sealed with its registration key, each held by a lease.
pub struct Registry {
    rt: Arc<LeaseRuntime>,
    store: Arc<AnyStore>,
    service: String,
    key: crate::leader::seal::RecordKey,
}

/// The runtime that renews the leases; shut down without waiting, from
/// wherever it is dropped.
struct LeaseRuntime(Option<tokio::runtime::Runtime>);

impl Drop for LeaseRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl LeaseRuntime {
    /// Runs `f` to its end on this runtime, from any thread (one inside
    /// another runtime included).
    fn run<T: Send + 'static>(&self, f: impl std::future::Future<Output = T> + Send + 'static) -> Option<T> {
        let handle = self.0.as_ref()?.handle().clone();
        if tokio::runtime::Handle::try_current().is_ok() {
            return std::thread::scope(|s| s.spawn(|| handle.block_on(f)).join().ok());
        }
        Some(handle.block_on(f))
    }
}

/// A teacher's registration, held until released (or dropped: then it
/// lapses with its TTL).
pub struct Registered {
    rt: Arc<LeaseRuntime>,
    lease: Option<Lease<AnyStore>>,
}

/// How long a registration outlives a job that stopped renewing it.
const REGISTRATION_TTL: Duration = Duration::from_secs(3);

impl Registry {
    pub fn open(store_url: &str, service: &str, key: crate::leader::seal::RecordKey) -> Result<Registry> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let store = {
            let _in = rt.enter();
            Arc::new(AnyStore::open(store_url)?)
        };
        Ok(Registry { rt: Arc::new(LeaseRuntime(Some(rt))), store, service: service.to_string(), key })
    }

    /// Registers `endpoint` for the students, and holds it.
    pub fn hold(&self, endpoint: &str) -> Result<Registered> {
        let at = keys::teacher(&self.service, &host_port(endpoint));
        let sealed = self.key.seal(&at, endpoint.as_bytes());
        let store = self.store.clone();
        let held = self
            .rt
            .run(async move {
                tokio::time::timeout(Duration::from_secs(5), Lease::hold(store, at, sealed, REGISTRATION_TTL))
                    .await
            })
            .context("the registration runtime is gone")?;
        let lease = held
            .map_err(|_| anyhow::anyhow!("the store did not answer within 5 s"))?
            .with_context(|| format!("registering teacher {endpoint}"))?;
        Ok(Registered { rt: self.rt.clone(), lease: Some(lease) })
    }
}

impl Registered {
    /// Deregisters (students following the store stop sending to it).
    pub fn release(&mut self) {
        let Some(lease) = self.lease.take() else { return };
        let key = lease.key().to_string();
        let done =
            self.rt.run(async move { tokio::time::timeout(Duration::from_secs(5), lease.release()).await });
        match done {
            Some(Ok(Ok(()))) => {}
            Some(Ok(Err(e))) => tracing::warn!("{key}: could not deregister: {e}"),
            _ => tracing::warn!("{key}: could not deregister within 5 s; it lapses in {REGISTRATION_TTL:?}"),
        }
    }
}

/// The log file of command teacher `id`.
pub fn log_path(log_dir: &std::path::Path, id: u32) -> PathBuf {
    log_dir.join(format!("teacher-{id}.log"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(start: &str) -> TeacherCommand {
        TeacherCommand {
            start: start.into(),
            stop: None,
            endpoint: "{addr}:{port}".into(),
            hosts: vec!["a:2".into(), "b".into()],
            port: 8001,
            ready_within: Duration::from_secs(1),
        }
    }

    #[test]
    fn slots_go_round_the_hosts_two_ports_apart_and_templates_are_checked() {
        let slots = command("serve --port {port}").slots().unwrap();
        let got: Vec<(&str, usize, u16)> = slots.iter().map(|s| (s.host.as_str(), s.index, s.port)).collect();
        assert_eq!(got, [("a", 0, 8001), ("b", 0, 8001), ("a", 1, 8003)]);
        let f = Filling {
            id: 7,
            slot: &slots[2],
            job: "my job",
            service: "svc",
            model: std::path::Path::new("/m/t.safetensors"),
            exe: std::path::Path::new("/bin/edl-runtime"),
        };
        let c = command("serve --id {id} --ports {port},{port2} --job {job} --model {model}");
        assert_eq!(
            c.fill(&c.start, &f, true).unwrap(),
            "serve --id 7 --ports 8003,8004 --job 'my job' --model /m/t.safetensors"
        );
        // Through ssh, the far side's shell parses the line again: each
        // value arrives there whole.
        let c = command("ssh {host} serve --job {job}");
        let here = shlex::split(&c.fill(&c.start, &f, true).unwrap()).unwrap();
        assert_eq!(here[..3], ["ssh", "a", "serve"]);
        let there = shlex::split(&here[2..].join(" ")).unwrap();
        assert_eq!(there, ["serve", "--job", "my job"]);
        assert_eq!(c.fill("http://{addr}:{port}/m@probs", &f, false).unwrap(), "http://a:8003/m@probs");
        // A node's name for the command, its address for the students.
        let named =
            TeacherCommand { hosts: vec!["n1=10.0.0.5:2".into(), "n2=10.0.0.6".into()], ..command("x") };
        let slots = named.slots().unwrap();
        let got: Vec<(&str, &str, u16)> =
            slots.iter().map(|s| (s.host.as_str(), s.addr.as_str(), s.port)).collect();
        assert_eq!(got, [("n1", "10.0.0.5", 8001), ("n2", "10.0.0.6", 8001), ("n1", "10.0.0.5", 8003)]);
        let e = TeacherCommand { hosts: vec!["=10.0.0.5".into()], ..command("x") }.slots().unwrap_err();
        assert!(e.to_string().contains("name=addr"), "{e}");
        let e = command("serve {coordinator}").slots().unwrap_err();
        assert!(
            format!("{e:#}").contains("--teacher-command")
                && format!("{e:#}").contains("unknown placeholder")
        );
        let e = TeacherCommand { hosts: vec![], ..command("serve") }.slots().unwrap_err();
        assert!(e.to_string().contains("--teacher-hosts"), "{e}");
        let e = TeacherCommand { port: 65535, ..command("serve") }.slots().unwrap_err();
        assert!(e.to_string().contains("has no port"), "{e}");
    }

    #[test]
    fn a_server_that_never_answers_or_whose_command_exits_is_not_taken() {
        let access = TeacherAccess::default();
        // Nothing listens on this port.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let e = wait_ready(&format!("127.0.0.1:{port}"), "m", &access, Duration::from_millis(300), || None)
            .unwrap_err();
        assert!(e.to_string().contains("not ready within"), "{e}");
        let e =
            wait_ready(&format!("http://127.0.0.1:{port}/m"), "m", &access, Duration::from_secs(60), || {
                Some("exit status: 3".into())
            })
            .unwrap_err();
        assert!(e.to_string().contains("exited before it was ready (exit status: 3)"), "{e}");
    }
}
