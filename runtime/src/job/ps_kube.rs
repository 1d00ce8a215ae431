//! Parameter servers in Kubernetes Pods (`--scaler kubernetes` with
//! `--ps-servers N`): each server is a Pod of its own running
//! `edl-runtime ps` from the workers' image (or `--ps-kube-image`), with
//! the job's secret mounted read-only from `--kube-secret` as the workers'
//! is (never in the Pod's spec or on its command line), serving on
//! `--ps-port` at its Pod's address, owned as the workers' Pods are.
//!
//! A server's Pod joins the job once it runs, has an address, and the
//! server there answers the job over its sealed channel naming itself. A
//! server let go (its shards moved, or the job ended) has its Pod deleted
//! with a second's notice: it holds nothing the job still needs. A Pod the
//! cluster evicts gets SIGTERM, which the server takes as notice: it says
//! so to the job, which moves its shards and then lets it go. A Pod that
//! ends on its own is reported as a lost server, its log kept in the job's
//! log directory first. Servers are not taken over by a coordinator that
//! takes the job over (the tables come back from the job's checkpoint):
//! Pods of the job's servers that a coordinator before left are deleted
//! before the first server is made, and the new ones numbered past them.
//! Never run here against a real API server: its calls are checked against
//! a stand-in on loopback, with a real server answering at the Pod's
//! address.

use crate::scalers::kubernetes::{
    JOB_LABEL, Owner, call, connect, delete_pod, job_label, job_pod_meta, keep_log, node_selector, of_job,
    pod_name_of, quantities, running_ip, secret_mount, secret_path, secret_volume,
};
use crate::worker::session::JobAuth;
use anyhow::{Context, Result};
use k8s_openapi::{
    api::core::v1::{Container, ContainerPort, Pod, PodSpec, ResourceRequirements},
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::OwnerReference},
};
use kube::api::{Api, ListParams, PostParams};
use std::{
    collections::BTreeMap,
    path::Path,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

/// The label that marks a parameter server's Pod (its value: the server's id).
pub const PS_LABEL: &str = "edl.dev/ps";
/// The notice a server's Pod gets when the job lets it go: none is
/// needed (its shards were moved, or the job ended with its checkpoint).
const LET_GO_SECS: u32 = 1;
/// The notice the cluster gives a server it evicts is the Pod's own: time
/// for the job to move its shards.
const EVICTION_GRACE_SECS: i64 = 60;

/// How the job's server Pods are made.
#[derive(Clone, Debug, Default)]
pub struct KubePsSpec {
    /// The image, with `edl-runtime` on its PATH.
    pub image: String,
    /// The Kubernetes Secret holding the job's secret under the key `secret`.
    pub secret: String,
    /// The port each server serves on at its Pod's address.
    pub port: u16,
    /// Resource limits (and requests), e.g. `memory=16Gi`, `cpu=4`.
    pub resources: Vec<(String, String)>,
    pub node_selector: Vec<(String, String)>,
    /// As the workers' Pods: the namespace, what owns the Pods, and the
    /// coordinator's own Pod's name.
    pub namespace: Option<String>,
    pub owner: Owner,
    pub pod_name: Option<String>,
    /// How long a server may take from its Pod's making to answering.
    pub ready_within: Duration,
}

/// The memory a server's Pod asks for when its resources do not say: its
/// rows' bound, a quarter more for the optimiser's buffers and the
/// requests in flight, and 256 MiB for the process.
fn memory_request(memory_mib: u64) -> Option<Quantity> {
    (memory_mib > 0)
        .then(|| Quantity(format!("{}Mi", memory_mib.saturating_add(memory_mib / 4).saturating_add(256))))
}

/// The Pod of server `id` of `job`, whose rows may take `memory_mib` MiB
/// (0: no bound).
pub fn server_pod(
    spec: &KubePsSpec,
    job: &str,
    id: u64,
    memory_mib: u64,
    owner: Option<OwnerReference>,
) -> Pod {
    let command: Vec<String> = [
        "edl-runtime".to_string(),
        "ps".into(),
        "--id".into(),
        id.to_string(),
        "--listen".into(),
        format!("0.0.0.0:{}", spec.port),
        "--memory-mib".into(),
        memory_mib.to_string(),
        "--job".into(),
        job.to_string(),
        "--secret-file".into(),
        secret_path(),
    ]
    .into();
    let given = quantities(&spec.resources);
    let mut requests = given.clone();
    if !requests.contains_key("memory")
        && let Some(q) = memory_request(memory_mib)
    {
        requests.insert("memory".into(), q);
    }
    let resources = (!requests.is_empty()).then(|| ResourceRequirements {
        limits: (!given.is_empty()).then_some(given),
        requests: Some(requests),
        ..Default::default()
    });
    Pod {
        metadata: job_pod_meta(job, pod_name_of(job, 'p', id), spec.namespace.clone(), (PS_LABEL, id), owner),
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            termination_grace_period_seconds: Some(EVICTION_GRACE_SECS),
            // A server speaks to no API server: no token of the namespace's account.
            automount_service_account_token: Some(false),
            node_selector: node_selector(&spec.node_selector),
            containers: vec![Container {
                name: "ps".into(),
                image: Some(spec.image.clone()),
                command: Some(command),
                ports: Some(vec![ContainerPort {
                    container_port: spec.port.into(),
                    name: Some("ps".into()),
                    ..Default::default()
                }]),
                volume_mounts: Some(vec![secret_mount()]),
                resources,
                ..Default::default()
            }],
            volumes: Some(vec![secret_volume(&spec.secret)]),
            ..Default::default()
        }),
        status: None,
    }
}

/// A server's Pod: its name, and its uid as the API made it (only that
/// very Pod is deleted).
#[derive(Clone, Debug)]
pub struct ServerPod {
    pub name: String,
    pub uid: Option<String>,
}

/// The job's server Pods: made, watched and deleted through the API. Shared
/// by the threads that start servers.
pub struct PsPods {
    spec: KubePsSpec,
    job: String,
    rt: tokio::runtime::Runtime,
    api: Mutex<Option<(Api<Pod>, Option<OwnerReference>)>>,
    /// The last listing's phases by Pod name, and when it was made (at
    /// most one a second; after the API did not answer, a pause first).
    looked: Mutex<(Option<Instant>, BTreeMap<String, String>, crate::process::Backoff)>,
    /// The job let its servers go: a Pod made from now on is deleted at once.
    closing: AtomicBool,
}

impl PsPods {
    pub fn new(spec: KubePsSpec, job: &str) -> Result<PsPods> {
        if spec.image.is_empty() || spec.secret.is_empty() {
            crate::refuse!(
                "parameter servers in Pods need an image (--ps-kube-image or --kube-image) and --kube-secret"
            );
        }
        // Several threads start servers at once; one runs the API's calls.
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        Ok(PsPods {
            spec,
            job: job.to_string(),
            rt,
            api: Mutex::new(None),
            looked: Mutex::new((None, BTreeMap::new(), Default::default())),
            closing: AtomicBool::new(false),
        })
    }

    /// Its Pods made through the API `api` gives (a stand-in's), with no owner.
    #[cfg(test)]
    pub(crate) fn with_api(self, api: impl FnOnce(&tokio::runtime::Runtime) -> Api<Pod>) -> PsPods {
        *self.api.lock().unwrap() = Some((api(&self.rt), None));
        self
    }

    /// The Pods' API and their owner, found on first use.
    fn api(&self) -> Result<(Api<Pod>, Option<OwnerReference>)> {
        let mut api = self.api.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = &*api {
            return Ok(a.clone());
        }
        let s = &self.spec;
        let found = connect(&self.rt, s.namespace.clone(), s.pod_name.clone(), s.owner)?;
        *api = Some(found.clone());
        Ok(found)
    }

    /// The job's server Pods as the API lists them.
    fn listed(&self) -> Result<Vec<Pod>> {
        let (api, _) = self.api()?;
        let selector = format!("{JOB_LABEL}={},{PS_LABEL}", job_label(&self.job));
        let listed =
            call(&self.rt, "listing the server Pods", api.list(&ListParams::default().labels(&selector)))?;
        // Only Pods that say they are this very job's (the label may be cut short).
        Ok(listed.items.into_iter().filter(|p| of_job(&p.metadata, &self.job).is_ok()).collect())
    }

    /// Deletes the server Pods of this job a coordinator before left (their
    /// tables come back from the job's checkpoint); returns the first id
    /// past theirs.
    pub fn clear_left(&self) -> Result<u64> {
        let (api, _) = self.api()?;
        let mut next = 1;
        let left = self.listed().context("looking for the job's server Pods a coordinator before left")?;
        for pod in left {
            let id = pod.metadata.labels.as_ref().and_then(|l| l.get(PS_LABEL)?.parse::<u64>().ok());
            next = next.max(id.map_or(0, |i| i + 1));
            if let Some(name) = &pod.metadata.name {
                tracing::info!("parameter server Pod {name}: left by a coordinator before; deleted");
                delete_pod(&self.rt, &api, name, pod.metadata.uid.as_deref(), LET_GO_SECS);
            }
        }
        Ok(next)
    }

    /// Makes server `id`'s Pod; returns it and the server's address once
    /// the server answers the job there. One that ends, or does not answer
    /// in time, has its log kept at `log` and is deleted, and the error says why.
    pub fn start(&self, id: u64, memory_mib: u64, auth: &JobAuth, log: &Path) -> Result<(ServerPod, String)> {
        let (api, owner) = self.api()?;
        let pod = server_pod(&self.spec, &self.job, id, memory_mib, owner);
        let name = pod.metadata.name.clone().unwrap_or_default();
        let made = match call(
            &self.rt,
            &format!("creating the Pod {name}"),
            api.create(&PostParams::default(), &pod),
        ) {
            Ok(made) => ServerPod { name: name.clone(), uid: made.metadata.uid },
            Err(e) => {
                // It may have been made all the same (an answer lost on the
                // way); one that was there already is another's.
                if !e.to_string().contains("AlreadyExists") {
                    self.delete(&ServerPod { name: name.clone(), uid: None });
                }
                return Err(e);
            }
        };
        if self.closing.load(Ordering::SeqCst) {
            self.delete(&made);
            anyhow::bail!("the job let its servers go while the Pod {name} was made; deleted");
        }
        tracing::info!("parameter server {id}: Pod {name}");
        let started = Instant::now();
        let serving = running_ip(&self.rt, &api, &name, self.spec.ready_within).and_then(|ip| {
            let addr = crate::net::host_port(&ip, self.spec.port);
            let left = self.spec.ready_within.saturating_sub(started.elapsed());
            crate::ps::control::await_serving(auth, id, &addr, left)?;
            Ok(addr)
        });
        match serving {
            Ok(addr) => Ok((made, addr)),
            Err(e) => {
                self.keep_log(&name, log);
                self.delete(&made);
                Err(e.context(format!("the Pod {name}")))
            }
        }
    }

    /// Keeps the Pod `name`'s log at `log` (a warning where it cannot).
    pub fn keep_log(&self, name: &str, log: &Path) {
        let kept = self.api().and_then(|(api, _)| keep_log(&self.rt, &api, name, log));
        if let Err(e) = kept {
            tracing::warn!("kubernetes: {e:#}");
        }
    }

    /// The job lets its servers go: the Pods of those still starting
    /// (`ids`) are deleted, and any made from now on as soon as it is.
    pub fn close(&self, ids: &[u64]) {
        self.closing.store(true, Ordering::SeqCst);
        for id in ids {
            self.delete(&ServerPod { name: pod_name_of(&self.job, 'p', *id), uid: None });
        }
    }

    /// Lets the server in `pod` go: its Pod deleted.
    pub fn delete(&self, pod: &ServerPod) {
        match self.api() {
            Ok((api, _)) => delete_pod(&self.rt, &api, &pod.name, pod.uid.as_deref(), LET_GO_SECS),
            Err(e) => tracing::warn!("kubernetes: the Pod {} is not deleted: {e:#}", pod.name),
        }
    }

    /// Of the Pods `names`, those that ended or are gone, with how (at
    /// most one look at the API a second; none while it does not answer).
    pub fn ended(&self, names: &[&str]) -> Vec<(String, String)> {
        let mut looked = self.looked.lock().unwrap_or_else(|e| e.into_inner());
        if names.is_empty()
            || looked.0.is_some_and(|t| t.elapsed() < Duration::from_secs(1))
            || !looked.2.open()
        {
            return Vec::new();
        }
        looked.0 = Some(Instant::now());
        let listed = match self.listed() {
            Ok(l) => {
                looked.2.answered();
                l
            }
            Err(e) => {
                looked.2.failed(&e.context("kubernetes"));
                return Vec::new();
            }
        };
        looked.1 = listed
            .into_iter()
            .filter_map(|p| {
                let status = p.status.unwrap_or_default();
                let phase = status.phase.unwrap_or_default();
                let how = status.reason.map_or(phase.clone(), |r| format!("{phase} ({r})"));
                Some((p.metadata.name?, how))
            })
            .collect();
        names
            .iter()
            .filter_map(|name| match looked.1.get(*name) {
                None => Some((name.to_string(), format!("its Pod {name} is gone"))),
                Some(how) if how.starts_with("Succeeded") || how.starts_with("Failed") => {
                    Some((name.to_string(), format!("its Pod {name} ended: {how}")))
                }
                Some(_) => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::ps_servers::{PsServers, PsStart};
    use crate::ps::{server::Server, service::Service};
    use crate::scalers::{kube_objects::JOB_ANNOTATION, kubernetes::tests::StandIn};

    fn spec(port: u16) -> KubePsSpec {
        KubePsSpec {
            image: "ghcr.io/example/edl:1.4".into(),
            secret: "edl-ctr".into(),
            port,
            resources: vec![("cpu".into(), "4".into())],
            node_selector: vec![("node.kubernetes.io/instance-type".into(), "r6i.4xlarge".into())],
            namespace: Some("ml".into()),
            ready_within: Duration::from_secs(20),
            ..Default::default()
        }
    }

    #[test]
    fn a_server_pod_runs_edl_runtime_ps_on_its_port_with_the_mounted_secret_and_room_for_its_rows() {
        let pod = server_pod(&spec(8300), "ctr", 3, 4096, None);
        // The API's own type, through JSON and back, loses nothing.
        let json = serde_json::to_value(&pod).unwrap();
        assert_eq!(serde_json::to_value(serde_json::from_value::<Pod>(json.clone()).unwrap()).unwrap(), json);
        assert!(pod.metadata.name.as_deref().unwrap().ends_with("-p3"), "{:?}", pod.metadata.name);
        assert_eq!(pod.metadata.labels.as_ref().unwrap()[PS_LABEL], "3");
        assert_eq!(pod.metadata.annotations.as_ref().unwrap()[JOB_ANNOTATION], "ctr");
        let p = pod.spec.unwrap();
        assert_eq!(p.restart_policy.as_deref(), Some("Never"));
        assert_eq!(p.termination_grace_period_seconds, Some(EVICTION_GRACE_SECS));
        assert_eq!(p.automount_service_account_token, Some(false));
        assert_eq!(p.node_selector.unwrap()["node.kubernetes.io/instance-type"], "r6i.4xlarge");
        let c = &p.containers[0];
        assert_eq!(
            c.command.as_ref().unwrap(),
            &[
                "edl-runtime",
                "ps",
                "--id",
                "3",
                "--listen",
                "0.0.0.0:8300",
                "--memory-mib",
                "4096",
                "--job",
                "ctr",
                "--secret-file",
                "/run/edl/secret"
            ]
        );
        assert_eq!(c.ports.as_ref().unwrap()[0].container_port, 8300);
        // The secret from the job's Kubernetes Secret, read-only; in no variable.
        assert_eq!(c.volume_mounts.as_ref().unwrap()[0].mount_path, "/run/edl");
        assert_eq!(
            p.volumes.as_ref().unwrap()[0].secret.as_ref().unwrap().secret_name.as_deref(),
            Some("edl-ctr")
        );
        assert!(c.env.is_none());
        // The cpu given, as limit and request; memory asked for from the rows' bound, not limited.
        let r = c.resources.as_ref().unwrap();
        assert_eq!(r.limits.as_ref().unwrap().len(), 1);
        assert_eq!(r.requests.as_ref().unwrap()["cpu"], Quantity("4".into()));
        assert_eq!(r.requests.as_ref().unwrap()["memory"], Quantity(format!("{}Mi", 4096 + 1024 + 256)));
        // A memory given is kept as given; no bound and nothing given asks for nothing.
        let given = KubePsSpec { resources: vec![("memory".into(), "2Gi".into())], ..spec(8300) };
        let r =
            server_pod(&given, "ctr", 1, 4096, None).spec.unwrap().containers[0].resources.clone().unwrap();
        assert_eq!(r.requests.unwrap()["memory"], Quantity("2Gi".into()));
        let bare = KubePsSpec { resources: Vec::new(), ..spec(8300) };
        assert!(server_pod(&bare, "ctr", 1, 0, None).spec.unwrap().containers[0].resources.is_none());
    }

    /// A real server of job `auth` numbered `id`, serving on `ip` at `port`
    /// (0: any), as a server Pod's would.
    fn serving(auth: &JobAuth, id: u64, ip: &str, port: u16) -> Service {
        let listener = std::net::TcpListener::bind((ip, port)).unwrap();
        Service::start(listener, auth.clone(), Server::new(id, None), Duration::from_secs(5)).unwrap()
    }

    #[test]
    fn server_pods_join_once_their_server_answers_as_itself_and_are_deleted_when_let_go_or_ended() {
        let api = StandIn::start("ps 7 serving on 0.0.0.0:8300\nps 7: out of memory\n");
        let auth =
            JobAuth { job: "ctr".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        // Servers 6 and 7 answer at their Pods' addresses (loopback's own: one port for both).
        let first = serving(&auth, 6, "127.0.0.2", 0);
        let port = first.addr().port();
        let _second = serving(&auth, 7, "127.0.0.3", port);
        let name = |id| pod_name_of("ctr", 'p', id);
        for (id, ip) in [(6, "127.0.0.2"), (7, "127.0.0.3"), (8, "127.0.0.2")] {
            api.ip_of.lock().unwrap().insert(name(id), ip.into());
        }
        // A server Pod a coordinator before left.
        let (rt, mut pods) = (tokio::runtime::Runtime::new().unwrap(), spec(port));
        let left = server_pod(&pods, "ctr", 5, 0, None);
        rt.block_on(api.pods(&rt).create(&PostParams::default(), &left)).unwrap();

        pods.ready_within = Duration::from_secs(3);
        let start = PsStart {
            count: 2,
            memory_mib: 0,
            staleness: 0,
            replicas: 1,
            min: 1,
            max: 3,
            exe: "edl-runtime".into(),
            listen: std::net::Ipv4Addr::LOCALHOST.into(),
            advertise: "127.0.0.1".into(),
            command: None,
            kube: Some(pods),
        };
        let dir = tempfile::tempdir().unwrap();
        let mut servers = PsServers::start_with_api(&start, &auth, dir.path(), |p| api.pods(p)).unwrap();
        // The one left deleted, the new ones numbered past it, at their Pods' addresses.
        let deleted = api.heard("DELETE");
        assert!(matches!(&deleted[..], [d] if d.contains(&name(5))), "{deleted:?}");
        assert_eq!(servers.addrs(), [(6, format!("127.0.0.2:{port}")), (7, format!("127.0.0.3:{port}"))]);
        assert_eq!(api.heard("POST").len(), 3);
        assert!(servers.exited().is_empty(), "running");

        // A Pod that ends: reported with its log's end, the log kept, the Pod deleted.
        api.phase_of.lock().unwrap().insert(name(7), "Failed".into());
        std::thread::sleep(Duration::from_millis(1100)); // the API is looked at once a second
        let exited = servers.exited();
        assert!(
            matches!(&exited[..], [(7, how)] if how.contains("ended: Failed") && how.contains("out of memory")),
            "{exited:?}"
        );
        assert!(std::fs::read_to_string(dir.path().join("ps-7.log")).unwrap().contains("out of memory"));
        // Deleted on a thread of its own.
        let deleted = |id| {
            let until = Instant::now() + Duration::from_secs(30);
            while !api.heard("DELETE").iter().any(|d| d.contains(&name(id))) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
            api.heard("DELETE").into_iter().filter(|d| d.contains(&name(id))).collect::<Vec<String>>()
        };
        assert_eq!(deleted(7).len(), 1);

        // Another whose address answers as another server: refused, named, its Pod deleted.
        let e = format!("{:#}", servers.more(1).unwrap_err());
        assert!(e.contains("parameter server 8") && e.contains("answers as parameter server 6"), "{e}");
        assert!(api.heard("DELETE").iter().any(|d| d.contains(&name(8))));

        // Let go: its Pod deleted with a second's notice; the job's end deletes the rest.
        servers.stop(6);
        let of_6 = deleted(6);
        assert!(
            matches!(&of_6[..], [d] if d.contains(&format!("\"gracePeriodSeconds\":{LET_GO_SECS}")) && d.contains("uid-7")),
            "{of_6:?}"
        );
        assert!(servers.addrs().is_empty());
        drop(servers);
        assert_eq!(api.heard("DELETE").len(), 4);
    }

    #[test]
    fn a_server_pod_made_once_the_job_let_its_servers_go_is_deleted_at_once() {
        let api = StandIn::start("");
        let auth =
            JobAuth { job: "ctr".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        let pods = PsPods::new(spec(8300), "ctr").unwrap().with_api(|rt| api.pods(rt));
        // The job ends while server 9 starts: its Pod (not made yet) is
        // deleted by name, and the one made then is deleted at once.
        pods.close(&[9]);
        let dir = tempfile::tempdir().unwrap();
        let e = format!("{:#}", pods.start(9, 0, &auth, &dir.path().join("ps-9.log")).unwrap_err());
        assert!(e.contains("let its servers go"), "{e}");
        let name = pod_name_of("ctr", 'p', 9);
        assert_eq!(api.heard("POST").len(), 1);
        let deleted = api.heard("DELETE");
        assert!(deleted.len() == 2 && deleted.iter().all(|d| d.contains(&name)), "{deleted:?}");
        assert!(deleted[1].contains("uid-7"), "the Pod made, by its uid: {deleted:?}");
        // The API holds none of the job's server Pods.
        assert!(pods.listed().unwrap().is_empty());
    }
}
