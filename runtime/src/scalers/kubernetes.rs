//! `--scaler kubernetes`: each worker is a Pod, created and deleted through
//! the API server (the `kube` crate, typed by `k8s-openapi`).
//!
//! A worker's Pod runs `edl-runtime worker` (or the launched program) from
//! `--kube-image`, `restartPolicy: Never` (a worker that ended is the
//! coordinator's to replace), with the job's secret mounted read-only from
//! the Kubernetes Secret `--kube-secret` (key `secret`): never in the Pod's
//! spec, its environment or a command line. The Pod is owned (an owner
//! reference) by the coordinator's Pod, or with `--kube-owner controller` by
//! the coordinator Pod's own controller (the ReplicaSet of its Deployment,
//! for standby coordinators, so that workers outlive one coordinator Pod):
//! deleting the job's coordinator deletes its workers, and nothing is
//! orphaned. A Pod is ready when its worker joins the job (the coordinator
//! sees it), so no readiness probe is needed.
//!
//! What happens to the Pods is judged by [`judge`] from what the API says
//! (a pure function, tested without a cluster): a Pod the scheduler has not
//! started within the pending bound is deleted and reported, one that
//! failed or was evicted is reported with its reason, its log kept in the
//! job's log directory and the Pod then deleted. Never run here against a
//! real API server (none can run on the development machine): the Pods it
//! makes are checked against the API's schema types, its decisions as a
//! state machine, and its calls against a stand-in on loopback.

use crate::leader::keeper::LeaseFence;
pub(crate) use crate::scalers::kube_objects::{
    JOB_LABEL, job_label, job_pod_meta, pod_name_of, secret_mount, secret_path, secret_volume,
};
pub use crate::scalers::kube_objects::{KubeOptions, Owner, of_job};
use crate::scalers::kube_relays::{
    Bounds, KubeRelays, RelayCall, relay_address, relay_pod, relay_service, service_name,
};
use crate::scalers::{Lingering, Scaler};
use crate::worker::session::JobAuth;
use anyhow::{Context, Result, anyhow};
use k8s_openapi::{
    api::core::v1::{Container, EnvVar, Pod, PodSpec, ResourceRequirements, Service},
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::OwnerReference},
};
use kube::api::{Api, DeleteParams, ListParams, LogParams, ObjectMeta, PostParams, Preconditions};
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    sync::mpsc,
    time::{Duration, Instant},
};

/// The longest one call to the API server is waited for.
const CALL_WITHIN: Duration = Duration::from_secs(10);

/// Runs one call to the API server on `rt`, bounded by [`CALL_WITHIN`].
pub(crate) fn call<T>(
    rt: &tokio::runtime::Runtime,
    what: &str,
    f: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T> {
    rt.block_on(bounded(what, CALL_WITHIN, f))
}

/// One call to the API server, bounded by `within`.
async fn bounded<T>(
    what: &str,
    within: Duration,
    f: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T> {
    tokio::time::timeout(within, f)
        .await
        .map_err(|_| anyhow!("{what}: the Kubernetes API server did not answer within {within:?}"))?
        .map_err(|e| anyhow!("{what}: {e}"))
}

/// Most of an ended worker's log kept: its last lines, at most so many bytes.
const LOG_LINES: i64 = 20_000;
const LOG_KEPT: i64 = 16 << 20;
/// Times an ended worker's log is asked for before its Pod is left as it is.
const LOG_TRIES: u32 = 3;

const WORKER_LABEL: &str = "edl.dev/worker";
/// The Pod of worker `id` of `job`: `program` is its command (the words,
/// `{coordinator}` `{id}` `{job}` filled in already), `owner` the object it
/// belongs to.
pub fn worker_pod(
    opts: &KubeOptions,
    job: &str,
    id: u64,
    coordinator: &str,
    program: Vec<String>,
    owner: Option<OwnerReference>,
    relay: Option<String>,
) -> Pod {
    let env =
        |name: &str, value: String| EnvVar { name: name.into(), value: Some(value), ..Default::default() };
    let resources = opts.gpus.map(|n| ResourceRequirements {
        limits: Some(BTreeMap::from([("nvidia.com/gpu".to_string(), Quantity(n.to_string()))])),
        ..Default::default()
    });
    Pod {
        metadata: job_pod_meta(job, pod_name(job, id), opts.namespace.clone(), (WORKER_LABEL, id), owner),
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            // The notice a deleted worker gets: it leaves at a step boundary.
            termination_grace_period_seconds: Some(30),
            containers: vec![Container {
                name: "worker".into(),
                image: Some(opts.image.clone()),
                command: Some(program),
                env: Some(
                    vec![
                        env("EDL_COORDINATOR", coordinator.to_string()),
                        env("EDL_WORKER_ID", id.to_string()),
                        env("EDL_JOB", job.to_string()),
                        env("EDL_JOB_SECRET_FILE", secret_path()),
                        env("PYTHONUNBUFFERED", "1".into()),
                    ]
                    .into_iter()
                    .chain(relay.map(|r| env(crate::net::RELAY_VAR, r)))
                    .collect(),
                ),
                volume_mounts: Some(vec![secret_mount()]),
                resources,
                ..Default::default()
            }],
            volumes: Some(vec![secret_volume(&opts.secret)]),
            ..Default::default()
        }),
        status: None,
    }
}

/// Resource quantities from `name=quantity` pairs.
pub(crate) fn quantities(pairs: &[(String, String)]) -> BTreeMap<String, Quantity> {
    pairs.iter().map(|(k, v)| (k.clone(), Quantity(v.clone()))).collect()
}

/// A node selector from `label=value` pairs (None: no pair).
pub(crate) fn node_selector(pairs: &[(String, String)]) -> Option<BTreeMap<String, String>> {
    (!pairs.is_empty()).then(|| pairs.iter().cloned().collect())
}

/// Waits, until `deadline`, for the Pod `name` to run with an address;
/// returns it. A Pod that ends or is gone first is an error saying so.
pub(crate) fn running_ip(
    rt: &tokio::runtime::Runtime,
    api: &Api<Pod>,
    name: &str,
    within: Duration,
) -> Result<String> {
    let deadline = Instant::now() + within;
    loop {
        let read = rt.block_on(async { tokio::time::timeout(CALL_WITHIN, api.get_opt(name)).await });
        let pod = match read {
            Ok(Ok(pod)) => pod,
            // Refused (forbidden, invalid): asking again would not change it.
            Ok(Err(kube::Error::Api(s))) if s.code < 500 => {
                anyhow::bail!("reading the Pod {name}: {}", kube::Error::Api(s))
            }
            // Not answered, or a server error: it may answer before the deadline.
            failed if Instant::now() < deadline => {
                let why =
                    failed.map_or_else(|_| format!("no answer within {CALL_WITHIN:?}"), |e| format!("{e:?}"));
                tracing::warn!("kubernetes: reading the Pod {name}: {why}; asked again");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
            Ok(Err(e)) => anyhow::bail!("reading the Pod {name}: {e}"),
            Err(_) => anyhow::bail!(
                "reading the Pod {name}: the Kubernetes API server did not answer within {CALL_WITHIN:?}"
            ),
        };
        let Some(pod) = pod else { anyhow::bail!("its Pod is gone") };
        let status = pod.status.unwrap_or_default();
        let phase = status.phase.unwrap_or_default();
        match (phase.as_str(), status.pod_ip) {
            ("Running", Some(ip)) if !ip.is_empty() => return Ok(ip),
            ("Succeeded" | "Failed", _) => anyhow::bail!(
                "its Pod ended: {phase}{}",
                status.reason.map(|r| format!(" ({r})")).unwrap_or_default()
            ),
            _ => {}
        }
        if Instant::now() >= deadline {
            anyhow::bail!("its Pod is not running within {within:?} (phase {phase:?})");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Deletes the Pod `name` (only the Pod of that `uid`, where given: not one
/// made under the name since) with `grace` seconds of notice; one gone
/// already is no error.
pub(crate) fn delete_pod(
    rt: &tokio::runtime::Runtime,
    api: &Api<Pod>,
    name: &str,
    uid: Option<&str>,
    grace: u32,
) {
    let preconditions = uid.map(|u| Preconditions { uid: Some(u.to_string()), resource_version: None });
    let params = DeleteParams { grace_period_seconds: Some(grace), preconditions, ..Default::default() };
    let deleted = call(rt, &format!("deleting the Pod {name}"), api.delete(name, &params));
    if let Err(e) = deleted
        && !e.to_string().contains("NotFound")
    {
        tracing::warn!("kubernetes: {e:#}");
    }
}

/// The last lines of the Pod `name`'s log (bounded), kept at `path`.
pub(crate) fn keep_log(rt: &tokio::runtime::Runtime, api: &Api<Pod>, name: &str, path: &Path) -> Result<()> {
    rt.block_on(save_log(api, name, path, CALL_WITHIN))
}

/// [`keep_log`], the API's answer waited for `within`.
async fn save_log(api: &Api<Pod>, name: &str, path: &Path, within: Duration) -> Result<()> {
    // Its last lines, bounded: what a person reads after a crash.
    let params =
        LogParams { tail_lines: Some(LOG_LINES), limit_bytes: Some(LOG_KEPT), ..LogParams::default() };
    let text =
        bounded(&format!("reading the log of the Pod {name}"), within, api.logs(name, &params)).await?;
    // Written on a thread for blocking work: a slow disk holds up no call's bound.
    let at = path.to_path_buf();
    let written = tokio::task::spawn_blocking(move || {
        let dir = at.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&at, text))
    })
    .await
    .unwrap_or_else(|e| Err(std::io::Error::other(e)));
    written.with_context(|| format!("keeping the log of the Pod {name} in {}", path.display()))
}

/// The Pods' API in `namespace` (default: the client's) and the owner of
/// the Pods a coordinator makes, from its own Pod `pod_name` (in the
/// cluster: its service account; outside: the kubeconfig).
pub(crate) fn connect(
    rt: &tokio::runtime::Runtime,
    namespace: Option<String>,
    pod_name: Option<String>,
    owner: Owner,
) -> Result<(Api<Pod>, Option<OwnerReference>)> {
    rt.block_on(async move {
        let client = tokio::time::timeout(CALL_WITHIN, kube::Client::try_default())
            .await
            .map_err(|_| anyhow!("the Kubernetes API server did not answer within {CALL_WITHIN:?}"))?
            .context("reaching the Kubernetes API server")?;
        let namespace = namespace.unwrap_or_else(|| client.default_namespace().to_string());
        let api: Api<Pod> = Api::namespaced(client, &namespace);
        let me = match &pod_name {
            Some(name) => Some(
                tokio::time::timeout(CALL_WITHIN, api.get(name))
                    .await
                    .map_err(|_| {
                        anyhow!("reading this coordinator's Pod {name}: no answer within {CALL_WITHIN:?}")
                    })?
                    .with_context(|| format!("reading this coordinator's Pod {name}"))?,
            ),
            None => None,
        };
        let owned = me.as_ref().and_then(|p| owner_of(p, owner));
        if me.is_some() && owned.is_none() {
            tracing::warn!(
                "the Pods edl makes get no owner: this coordinator's Pod has no {owner:?} to name"
            );
        }
        anyhow::Ok((api, owned))
    })
}

/// Worker `id`'s Pod name: `edl-`, the job's name as a DNS label (lower
/// case, anything but a letter or digit as `-`, cut to fit), the hash of
/// the exact name and `w<id>`. Jobs whose names differ only in case or
/// punctuation (`Mnist`, `mnist`, `mnist_a`, `mnist-a`) get different Pods,
/// and a job gets the same ones on every coordinator.
fn pod_name(job: &str, id: u64) -> String {
    pod_name_of(job, 'w', id)
}

/// The owner reference for the worker Pods, from the coordinator's own Pod.
pub fn owner_of(pod: &Pod, owner: Owner) -> Option<OwnerReference> {
    let m = &pod.metadata;
    match owner {
        Owner::Pod => Some(OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: m.name.clone()?,
            uid: m.uid.clone()?,
            block_owner_deletion: Some(true),
            controller: Some(false),
        }),
        Owner::Controller => {
            let c = m.owner_references.as_ref()?.iter().find(|o| o.controller == Some(true))?;
            Some(OwnerReference { controller: Some(false), block_owner_deletion: Some(true), ..c.clone() })
        }
    }
}

/// What the API says of a worker's Pod.
#[derive(Clone, Debug, PartialEq)]
pub enum Seen {
    /// Not there (deleted, or never made).
    Gone,
    /// Its phase (`Pending`, `Running`, `Succeeded`, `Failed`, `Unknown`)
    /// and the reason the API gives, if any.
    Phase(String, Option<String>),
}

/// What to do about a worker's Pod.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Nothing: it runs, or may still start.
    Wait,
    /// It ended: report why.
    Ended(String),
    /// It did not start in time: delete it and report why.
    GiveUp(String),
}

/// The scaler's decision about a Pod made `age` ago, as the API sees it now.
pub fn judge(name: &str, seen: &Seen, age: Duration, pending_bound: Duration) -> Verdict {
    match seen {
        Seen::Gone => Verdict::Ended(format!("its Pod {name} is gone")),
        Seen::Phase(phase, reason) => {
            let why = reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default();
            match phase.as_str() {
                "Running" => Verdict::Wait,
                "Pending" | "Unknown" if age >= pending_bound => Verdict::GiveUp(format!(
                    "Kubernetes did not start its Pod {name} within {pending_bound:?} ({phase}{why}); deleted"
                )),
                "Pending" | "Unknown" => Verdict::Wait,
                "Succeeded" => Verdict::Ended(format!("its Pod {name} exited{why}")),
                other => Verdict::Ended(format!("its Pod {name} ended: {other}{why}")),
            }
        }
    }
}

/// What becomes of a worker's Pod once it is judged.
#[derive(Debug)]
enum Then {
    /// Nothing: it is gone, or not this job's.
    Nothing,
    /// Deleted: it never started.
    Delete(ObjectMeta),
    /// Its log kept in the job's log directory, then deleted: it ended.
    KeepLogAndDelete(ObjectMeta),
}

/// Workers as Pods.
///
/// The calls a running job makes to the API server (listing the Pods,
/// keeping an ended worker's log, deleting a Pod, killing a lingering
/// worker's) run on a thread of the scaler's own, each bounded, and what
/// they found is taken in at the coordinator's next look: an API server
/// that is slow or does not answer never holds up the coordinator's loop
/// (the steps, the other workers' failures). A worker's Pod is made there
/// too: [`Scaler::spawn`] returns once the Pod is asked for, and a Pod the
/// API refused is said by [`Scaler::failed_spawns`].
pub struct KubernetesScaler {
    opts: KubeOptions,
    program: Vec<String>,
    rt: tokio::runtime::Runtime,
    api: Option<(Api<Pod>, Option<OwnerReference>)>,
    job: String,
    /// Pods made and not deleted: worker id -> (name, when made).
    pods: BTreeMap<u64, (String, Instant)>,
    /// Every worker's Pod, for the report (kept after the Pod is gone).
    handles: BTreeMap<u64, String>,
    exited: Vec<(u64, String)>,
    /// Where ended workers' logs are kept (`worker-<id>.log`), and those kept.
    log_dir: PathBuf,
    logs: BTreeMap<u64, PathBuf>,
    /// Ended workers whose log could not be kept yet: their Pod, and tries.
    log_retries: BTreeMap<u64, (String, ObjectMeta, u32)>,
    polled: Option<Instant>,
    /// The API server did not answer: asked again after a pause.
    quiet: crate::process::Backoff,
    /// Workers silent for their lease whose Pods are deleted at once if
    /// they still run (see [`Scaler::kill_if_lingering`]).
    lingering: Lingering,
    /// Lingering workers killed since [`Scaler::kill_lingering`] last said so.
    killed: Vec<(u64, String)>,
    /// Pods being made: worker id -> its Pod's name, and the grace it is to
    /// be stopped with once made, where a stop came first.
    creating: BTreeMap<u64, (String, Option<Duration>)>,
    /// Workers whose Pod the API refused, since the last call.
    refused: Vec<(u64, String)>,
    /// The calls under way, and what those done came back with.
    calls: Vec<tokio::task::JoinHandle<()>>,
    done: (mpsc::Sender<Done>, mpsc::Receiver<Done>),
    /// A listing under way (since when); the workers whose log is being
    /// kept, or whose Pod is being killed.
    listing: Option<Instant>,
    keeping: BTreeSet<u64>,
    killing: BTreeSet<u64>,
    /// The coordinator's lease: a deletion made after it lapsed is not sent.
    fence: Option<LeaseFence>,
    /// A relay on each node the workers run on (`--relay`).
    relaying: Option<Relaying>,
}

/// The relays of a job's nodes, and what making them takes.
struct Relaying {
    relays: KubeRelays,
    /// The job's worker lease, which each relay keeps.
    lease: Duration,
    /// The coordinator the workers are started for (the relays connect to
    /// it), once one was.
    coordinator: Option<String>,
    /// The relays' Service was asked for, and the uid of the one had.
    service: bool,
    service_uid: Option<String>,
    /// The Service could not be had: no relays, none told of.
    off: bool,
    /// The scaler is going: no relay is tended.
    ending: bool,
}

/// What a call made off the coordinator's thread came back with.
enum Done {
    /// The job's Pods as listed by a call sent at `at`.
    Listed { at: Instant, pods: Result<Vec<Pod>> },
    /// Worker `id`'s log, asked for the `tries`th time: kept (its Pod then
    /// deleted) or not. `report`: why it ended, not yet reported.
    LogKept {
        id: u64,
        name: String,
        meta: Box<ObjectMeta>,
        tries: u32,
        report: Option<String>,
        kept: Result<PathBuf>,
    },
    /// Lingering worker `id`: its log kept (where it was), and its Pod killed.
    Killed { id: u64, log: Option<PathBuf>, outcome: Killing },
    /// Worker `id`'s Pod was made (Ok), or not (why).
    Created { id: u64, made: Result<()> },
    /// Relay `id`'s Pod was made, or could not be.
    RelayMade { id: u64, made: bool },
    /// What asking for the relays' Service came to (Err: a failure to ask
    /// again at the next start).
    Service(std::result::Result<ServiceAsked, String>),
}

/// How a lingering worker's kill went.
enum Killing {
    /// Its Pod was deleted: `how`.
    Done(String),
    /// It no longer runs (ended or gone): the next look reports it.
    NotRunning,
    /// The API server did not answer, or refused the deletion.
    Failed,
}

/// A listing not back after this long (each call is bounded, so it never
/// is) is taken for lost: the next look sends another.
const LISTING_LOST: Duration = Duration::from_secs(30);

/// The notice a lingering worker's Pod is deleted with: its container
/// killed a second after SIGTERM (a hung or frozen program heeds nothing
/// else), the Pod kept until it ends.
const LINGER_GRACE_SECS: u32 = 1;
/// How long a lingering worker's log is waited for before its Pod goes.
const LINGER_LOG_WITHIN: Duration = Duration::from_secs(2);

/// Deletes the Pod `name`, as the API showed it (`meta`), if it is one of
/// job `job`'s: only that very Pod (its uid a precondition), not one made
/// under the name since. A Pod of another job is left alone, and nothing is
/// deleted once `fence` says the coordinator's lease lapsed; each with a
/// warning naming it. Whether it was deleted.
async fn delete_of_job(
    api: &Api<Pod>,
    job: &str,
    fence: &Option<LeaseFence>,
    name: &str,
    meta: &ObjectMeta,
    mut params: DeleteParams,
) -> bool {
    if let Err(why) = of_job(meta, job) {
        tracing::warn!("kubernetes: not deleting the Pod {name}, which is not job {job:?}'s: {why}");
        return false;
    }
    if let Some(why) = crate::scalers::stop_fenced(fence) {
        tracing::warn!("kubernetes: not deleting the Pod {name}: {why}");
        return false;
    }
    params.preconditions = Some(Preconditions { uid: meta.uid.clone(), resource_version: None });
    match bounded(&format!("deleting the Pod {name}"), CALL_WITHIN, api.delete(name, &params)).await {
        Ok(_) => true,
        Err(e) => {
            tracing::warn!("kubernetes: {e:#}");
            false
        }
    }
}

/// Makes the Pod `pod` (named `name`), unless `fence` says the
/// coordinator's lease lapsed.
async fn create_fenced(api: &Api<Pod>, fence: &Option<LeaseFence>, name: &str, pod: &Pod) -> Result<()> {
    if let Some(why) = crate::scalers::stop_fenced(fence) {
        anyhow::bail!("its Pod {name} is not made: {why}");
    }
    bounded(&format!("creating the Pod {name}"), CALL_WITHIN, api.create(&PostParams::default(), pod))
        .await
        .map(drop)
}

/// The Pod `name` as the API shows it now (None: there is none).
async fn read_pod(api: &Api<Pod>, name: &str) -> Result<Option<Pod>> {
    bounded(&format!("reading the Pod {name}"), CALL_WITHIN, api.get_opt(name)).await
}

impl KubernetesScaler {
    /// Workers running `edl-runtime worker` from the image; the logs of
    /// those that ended are kept in `log_dir`.
    pub fn new(opts: KubeOptions, log_dir: &Path) -> Result<Self> {
        let program =
            ["edl-runtime", "worker", "--coordinator", "{coordinator}", "--id", "{id}", "--job", "{job}"];
        Self::with_program(opts, log_dir, program.iter().map(|w| w.to_string()).collect())
    }

    /// Workers running the user's `command` (under `launch`).
    pub fn for_program(opts: KubeOptions, log_dir: &Path, command: &[String]) -> Result<Self> {
        let program = command.iter().map(|w| w.replace('{', "{{").replace('}', "}}")).collect();
        Self::with_program(opts, log_dir, program)
    }

    fn with_program(opts: KubeOptions, log_dir: &Path, program: Vec<String>) -> Result<Self> {
        if opts.image.is_empty() || opts.secret.is_empty() {
            crate::refuse!("--scaler kubernetes needs --kube-image and --kube-secret");
        }
        // One thread of its own: the calls made while the job runs.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("edl-kube")
            .enable_all()
            .build()
            .context("starting the Kubernetes scaler's thread")?;
        Ok(KubernetesScaler {
            opts,
            program,
            rt,
            api: None,
            job: String::new(),
            pods: BTreeMap::new(),
            handles: BTreeMap::new(),
            exited: Vec::new(),
            log_dir: log_dir.to_path_buf(),
            logs: BTreeMap::new(),
            log_retries: BTreeMap::new(),
            polled: None,
            quiet: Default::default(),
            lingering: Lingering::default(),
            killed: Vec::new(),
            creating: BTreeMap::new(),
            refused: Vec::new(),
            calls: Vec::new(),
            done: mpsc::channel(),
            listing: None,
            keeping: BTreeSet::new(),
            killing: BTreeSet::new(),
            fence: None,
            relaying: None,
        })
    }

    /// Each node's workers reach the coordinator through a relay there (a
    /// Pod of its own, see [`crate::scalers::kube_relays`]), keeping `lease`.
    pub fn with_relays(mut self, lease: Duration) -> Self {
        self.relaying = Some(Relaying {
            relays: KubeRelays::default(),
            lease,
            coordinator: None,
            service: false,
            service_uid: None,
            off: false,
            ending: false,
        });
        self
    }

    /// The Pods' API and their owner, found on first use (in the cluster:
    /// its service account; outside: the kubeconfig).
    fn api(&mut self) -> Result<(Api<Pod>, Option<OwnerReference>)> {
        if let Some(a) = &self.api {
            return Ok(a.clone());
        }
        let found =
            connect(&self.rt, self.opts.namespace.clone(), self.opts.pod_name.clone(), self.opts.owner)?;
        self.api = Some(found.clone());
        Ok(found)
    }

    /// Runs `call` on the scaler's thread; what it sends back is taken in
    /// by [`KubernetesScaler::take_done`].
    fn start(&mut self, call: impl std::future::Future<Output = ()> + Send + 'static) {
        self.calls.retain(|c| !c.is_finished());
        self.calls.push(self.rt.spawn(call));
    }

    /// Asks the API where the workers' Pods stand (at most once a second,
    /// one listing at a time), and again for the logs not kept yet.
    fn poll(&mut self) {
        if self.pods.is_empty() && self.log_retries.is_empty()
            || self.listing.is_some_and(|t| t.elapsed() < LISTING_LOST)
            || self.polled.is_some_and(|t| t.elapsed() < Duration::from_secs(1))
            || !self.quiet.open()
        {
            return;
        }
        self.polled = Some(Instant::now());
        let Ok((api, _)) = self.api() else { return };
        let again: Vec<(u64, (String, ObjectMeta, u32))> = self
            .log_retries
            .iter()
            .filter(|(id, _)| !self.keeping.contains(id))
            .map(|(i, r)| (*i, r.clone()))
            .collect();
        for (id, (name, meta, tries)) in again {
            self.keep_log_and_delete(&api, id, name, meta, tries + 1, None);
        }
        if self.pods.is_empty() {
            return;
        }
        self.listing = Some(Instant::now());
        let selector = format!("{JOB_LABEL}={}", job_label(&self.job));
        let (tx, at) = (self.done.0.clone(), Instant::now());
        self.start(async move {
            let listed = bounded(
                "listing the worker Pods",
                CALL_WITHIN,
                api.list(&ListParams::default().labels(&selector)),
            )
            .await;
            let _ = tx.send(Done::Listed { at, pods: listed.map(|l| l.items) });
        });
    }

    /// Keeps the log of worker `id`'s ended Pod in the job's log directory
    /// (the `tries`th time it is asked for), then deletes the Pod. A Pod
    /// whose log cannot be kept stays, for a person to read, and the log
    /// message says so. `report`: why the worker ended, reported once this
    /// first try is done (with its log, where it was kept).
    fn keep_log_and_delete(
        &mut self,
        api: &Api<Pod>,
        id: u64,
        name: String,
        meta: ObjectMeta,
        tries: u32,
        report: Option<String>,
    ) {
        self.keeping.insert(id);
        let (api, job, fence, tx) = (api.clone(), self.job.clone(), self.fence.clone(), self.done.0.clone());
        let path = self.log_dir.join(format!("worker-{id}.log"));
        self.start(async move {
            let kept = save_log(&api, &name, &path, CALL_WITHIN).await.map(|()| path);
            let delete = kept.is_ok().then(|| (name.clone(), meta.clone()));
            // Its end is said with its log; the Pod goes after.
            let _ = tx.send(Done::LogKept { id, name, meta: Box::new(meta), tries, report, kept });
            if let Some((name, meta)) = delete {
                delete_of_job(&api, &job, &fence, &name, &meta, DeleteParams::default()).await;
            }
        });
    }

    /// Deletes the Pod `name`, as the API showed it (`meta`), on the
    /// scaler's thread (see [`delete_of_job`]).
    fn delete(&mut self, api: &Api<Pod>, name: String, meta: ObjectMeta, params: DeleteParams) {
        let (api, job, fence) = (api.clone(), self.job.clone(), self.fence.clone());
        self.start(async move {
            delete_of_job(&api, &job, &fence, &name, &meta, params).await;
        });
    }

    /// Takes in what the calls that came back found.
    fn take_done(&mut self) {
        while let Ok(done) = self.done.1.try_recv() {
            match done {
                Done::Listed { at, pods } => {
                    self.listing = None;
                    match pods {
                        Ok(pods) => {
                            self.quiet.answered();
                            self.take_listing(at, pods);
                        }
                        Err(e) => self.quiet.failed(&e.context("kubernetes")),
                    }
                }
                Done::LogKept { id, name, meta, tries, report, kept } => {
                    self.keeping.remove(&id);
                    match kept {
                        Ok(path) => {
                            self.logs.insert(id, path);
                            self.log_retries.remove(&id);
                        }
                        Err(e) if tries < LOG_TRIES => {
                            tracing::warn!("kubernetes: {e:#}; tried again at the next look");
                            self.log_retries.insert(id, (name, *meta, tries));
                        }
                        Err(e) => {
                            self.log_retries.remove(&id);
                            tracing::warn!("kubernetes: {e:#}; the Pod is left for its log");
                        }
                    }
                    if let Some(why) = report {
                        self.exited.push((id, why));
                    }
                }
                Done::Created { id, made } => {
                    let Some((name, stop)) = self.creating.remove(&id) else { continue };
                    match made {
                        Ok(()) => {
                            tracing::info!("worker {id}: Pod {name}");
                            self.pods.insert(id, (name, Instant::now()));
                            if let Some(grace) = stop {
                                self.stop(id, grace);
                            }
                        }
                        Err(e) => self.refused.push((id, format!("{e:#}"))),
                    }
                }
                Done::RelayMade { id, made } => {
                    if let Some(r) = &mut self.relaying {
                        match made {
                            true => r.relays.made(id),
                            false => r.relays.refused(id),
                        }
                    }
                }
                Done::Service(asked) => self.take_service(asked),
                Done::Killed { id, log, outcome } => {
                    self.killing.remove(&id);
                    if let Some(path) = log {
                        self.logs.insert(id, path);
                    }
                    match outcome {
                        Killing::Done(how) => self.killed.push((id, how)),
                        Killing::NotRunning => {}
                        Killing::Failed => self.lingering.again(id, Duration::from_secs(1)),
                    }
                }
            }
        }
    }

    /// Takes in what asking for the relays' Service came to.
    fn take_service(&mut self, asked: std::result::Result<ServiceAsked, String>) {
        let Some(r) = &mut self.relaying else { return };
        match asked {
            Ok(ServiceAsked::Had(uid)) => r.service_uid = uid,
            Ok(ServiceAsked::Foreign(why)) => {
                tracing::warn!(
                    "kubernetes: {why}; the workers connect to the coordinator directly, without relays"
                );
                r.off = true;
            }
            Err(why) => {
                tracing::warn!("kubernetes: {why}; asked again with the next worker");
                r.service = false;
            }
        }
    }

    /// Judges the Pods made before a listing sent at `at` by what it
    /// found, and acts on what ended.
    fn take_listing(&mut self, at: Instant, listed: Vec<Pod>) {
        let Ok((api, owner)) = self.api() else { return };
        self.tend_relays(&api, owner, at, &listed);
        for (id, why, then) in self.judge_listed(at, listed) {
            let Some((name, _)) = self.pods.remove(&id) else { continue };
            match then {
                Then::Nothing => self.exited.push((id, why)),
                Then::Delete(meta) => {
                    self.delete(&api, name, meta, DeleteParams::default());
                    self.exited.push((id, why));
                }
                Then::KeepLogAndDelete(meta) => self.keep_log_and_delete(&api, id, name, meta, 1, Some(why)),
            }
        }
    }

    /// The relays tended by a listing sent at `at` (see [`KubeRelays::tend`]):
    /// the nodes this scaler's workers are bound to are those its Pods, as
    /// listed, name.
    fn tend_relays(&mut self, api: &Api<Pod>, owner: Option<OwnerReference>, at: Instant, listed: &[Pod]) {
        let Some(r) = self.relaying.as_mut().filter(|r| !r.ending) else { return };
        let workers: BTreeSet<&str> = self.pods.values().map(|(name, _)| name.as_str()).collect();
        // Relays turned off: every node as if it ran no worker.
        let nodes: BTreeSet<String> = (listed.iter().filter(|_| !r.off))
            .filter(|p| p.metadata.name.as_deref().is_some_and(|n| workers.contains(n)))
            .filter(|p| {
                let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                matches!(phase, Some("Pending" | "Running"))
            })
            .filter_map(|p| p.spec.as_ref()?.node_name.clone())
            .collect();
        // Without a coordinator to point them at (one that took the job over
        // and has started no worker yet), relays are deleted, not made.
        let coordinator = r.coordinator.clone();
        let bounds = Bounds { pending: self.opts.pending_bound, ready: Bounds::READY, asked: Bounds::ASKED };
        let calls = r.relays.tend(&self.job, at, listed, &nodes, bounds);
        let lease = r.lease;
        for call in calls {
            match (call, &coordinator) {
                (RelayCall::Make { id, node }, Some(coordinator)) => {
                    let pod =
                        relay_pod(&self.opts, &self.job, (id, &node), coordinator, lease, owner.clone());
                    let name = pod.metadata.name.clone().unwrap_or_default();
                    tracing::info!("relay {id}: Pod {name} on {node}");
                    if let Some(r) = &mut self.relaying {
                        r.relays.asked(id, &node, name.clone());
                    }
                    let (api, fence, tx) = (api.clone(), self.fence.clone(), self.done.0.clone());
                    self.start(async move {
                        let made = create_fenced(&api, &fence, &name, &pod).await;
                        if let Err(e) = &made {
                            tracing::warn!("kubernetes: relay {id} on {node}: {e:#}");
                        }
                        let _ = tx.send(Done::RelayMade { id, made: made.is_ok() });
                    });
                }
                (RelayCall::Make { .. }, None) => {}
                // A relay deleted carries no one (or is lost already): it
                // goes at once, and takes no worker in its last seconds.
                (RelayCall::Delete { name, meta }, _) => {
                    let params = DeleteParams { grace_period_seconds: Some(1), ..Default::default() };
                    self.delete(api, name, *meta, params);
                }
            }
        }
    }

    /// Deletes the Pod `name` with `grace` of notice, on the scaler's
    /// thread: read first, so that only a Pod that says it is this job's
    /// is deleted. (`who`: whose Pod, for the log.)
    fn delete_named(&mut self, who: String, name: String, grace: Duration) {
        let Ok((api, _)) = self.api() else { return };
        let params =
            DeleteParams { grace_period_seconds: Some(grace.as_secs().max(1) as u32), ..Default::default() };
        let (job, fence) = (self.job.clone(), self.fence.clone());
        self.start(async move {
            match read_pod(&api, &name).await {
                Ok(Some(pod)) => drop(delete_of_job(&api, &job, &fence, &name, &pod.metadata, params).await),
                Ok(None) => {}
                Err(e) => tracing::warn!("kubernetes: {who} not stopped: {e:#}"),
            }
        });
    }

    /// Asks for the relays' Service, once. One there already is taken where
    /// it is this job's and has this coordinator's owner, made again where
    /// its owner is another's (a coordinator's before, whose end would take
    /// it); a Service that cannot be had turns the relays off.
    fn make_service(&mut self, owner: Option<OwnerReference>) {
        let Some(r) = self.relaying.as_mut().filter(|r| !r.service) else { return };
        r.service = true;
        let Ok((api, _)) = self.api() else { return };
        let svc = relay_service(&self.opts, &self.job, owner);
        let (job, fence, tx) = (self.job.clone(), self.fence.clone(), self.done.0.clone());
        self.start(async move {
            if crate::scalers::stop_fenced(&fence).is_some() {
                return;
            }
            let asked = have_service(&services(&api), &job, &svc, &fence).await;
            let _ = tx.send(Done::Service(asked.map_err(|e| format!("{e:#}"))));
        });
    }

    /// Judges the Pods this scaler keeps that were made before `at` (a
    /// later one may not be in the listing yet) by the listing: what
    /// ended, with why, and what to do with its Pod as listed. A listed
    /// Pod of a worker's name that is not this job's is not taken for the
    /// worker's: the worker's own is gone.
    fn judge_listed(&self, at: Instant, listed: Vec<Pod>) -> Vec<(u64, String, Then)> {
        let by_name: BTreeMap<String, (ObjectMeta, Seen)> = listed
            .into_iter()
            .filter_map(|p| {
                let status = p.status.unwrap_or_default();
                let seen = Seen::Phase(status.phase.unwrap_or_else(|| "Unknown".into()), status.reason);
                Some((p.metadata.name.clone()?, (p.metadata, seen)))
            })
            .collect();
        let mut gone = Vec::new();
        for (&id, (name, made)) in self.pods.iter().filter(|(_, (_, made))| *made <= at) {
            let (meta, seen) = match by_name.get(name) {
                Some((meta, seen)) => match of_job(meta, &self.job) {
                    Ok(()) => (Some(meta), seen.clone()),
                    Err(why) => {
                        tracing::warn!("kubernetes: the Pod {name} is not worker {id}'s ({why}); left alone");
                        (None, Seen::Gone)
                    }
                },
                None => (None, Seen::Gone),
            };
            match (judge(name, &seen, made.elapsed(), self.opts.pending_bound), meta) {
                (Verdict::Wait, _) => {}
                (Verdict::Ended(why), None) => gone.push((id, why, Then::Nothing)),
                (Verdict::Ended(why), Some(m)) => gone.push((id, why, Then::KeepLogAndDelete(m.clone()))),
                (Verdict::GiveUp(why), Some(m)) => gone.push((id, why, Then::Delete(m.clone()))),
                (Verdict::GiveUp(why), None) => gone.push((id, why, Then::Nothing)),
            }
        }
        gone
    }

    /// Takes worker `id`'s Pod, as the API showed it (`seen`; None: gone
    /// already, for the next poll to report), as this scaler's own: only the
    /// Pod it would have made for that worker of `job`, and only where the
    /// Pod says it is that job's.
    fn adopt_seen(&mut self, id: u64, handle: &str, job: &str, seen: Option<&ObjectMeta>) -> bool {
        let name = pod_name(job, id);
        if handle.strip_prefix("pod:") != Some(name.as_str()) {
            return false;
        }
        if let Some(Err(why)) = seen.map(|meta| of_job(meta, job)) {
            tracing::warn!(
                "kubernetes: not taking over the Pod {name} for worker {id} of job {job:?}: {why}"
            );
            return false;
        }
        self.job = job.to_string();
        self.pods.insert(id, (name, Instant::now()));
        self.handles.insert(id, handle.to_string());
        true
    }

    /// Kills lingering worker `id`'s Pod `name` on the scaler's thread: if
    /// it still runs, its log so far kept (where the API gives it within
    /// [`LINGER_LOG_WITHIN`]), then the Pod deleted with a second's notice.
    fn kill_pod(&mut self, api: &Api<Pod>, id: u64, name: String) {
        self.killing.insert(id);
        let (api, job, fence, tx) = (api.clone(), self.job.clone(), self.fence.clone(), self.done.0.clone());
        let path = self.log_dir.join(format!("worker-{id}.log"));
        self.start(async move {
            let meta = match read_pod(&api, &name).await {
                Ok(Some(pod)) if pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") => {
                    pod.metadata
                }
                Ok(_) => {
                    let _ = tx.send(Done::Killed { id, log: None, outcome: Killing::NotRunning });
                    return;
                }
                Err(e) => {
                    tracing::warn!("kubernetes: worker {id} not killed yet: {e:#}");
                    let _ = tx.send(Done::Killed { id, log: None, outcome: Killing::Failed });
                    return;
                }
            };
            let log = match save_log(&api, &name, &path, LINGER_LOG_WITHIN).await {
                Ok(()) => Some(path),
                Err(e) => {
                    tracing::warn!("kubernetes: worker {id}'s log is not kept before it is killed: {e:#}");
                    None
                }
            };
            let params = DeleteParams { grace_period_seconds: Some(LINGER_GRACE_SECS), ..Default::default() };
            let outcome = if delete_of_job(&api, &job, &fence, &name, &meta, params).await {
                Killing::Done(format!("its Pod {name} deleted with {LINGER_GRACE_SECS} s of notice"))
            } else {
                Killing::Failed
            };
            let _ = tx.send(Done::Killed { id, log, outcome });
        });
    }
}

impl Scaler for KubernetesScaler {
    /// Asks for worker `id`'s Pod on the scaler's thread: the Pod is the
    /// worker's once made (a listing sent before then does not judge it),
    /// and one the API refuses is said by [`Scaler::failed_spawns`].
    fn spawn(&mut self, id: u64, coordinator: &str, auth: &JobAuth) -> Result<()> {
        self.job = auth.job.clone();
        let (api, owner) = self.api()?;
        let program = crate::scalers::command::fill_words(&self.program, coordinator, id, &auth.job);
        let relay = self.relaying.as_mut().filter(|r| !r.off).map(|r| {
            r.coordinator = Some(coordinator.to_string());
            relay_address(&auth.job)
        });
        if relay.is_some() {
            self.make_service(owner.clone());
        }
        let pod = worker_pod(&self.opts, &auth.job, id, coordinator, program, owner, relay);
        let name = pod.metadata.name.clone().unwrap_or_default();
        self.handles.insert(id, format!("pod:{name}"));
        self.creating.insert(id, (name.clone(), None));
        let (fence, tx) = (self.fence.clone(), self.done.0.clone());
        self.start(async move {
            let made = create_fenced(&api, &fence, &name, &pod).await;
            let _ = tx.send(Done::Created { id, made });
        });
        Ok(())
    }

    fn failed_spawns(&mut self) -> Vec<(u64, String)> {
        self.take_done();
        std::mem::take(&mut self.refused)
    }

    /// Deletes the worker's Pod with `grace` of notice, on the scaler's
    /// thread: read first, so that only a Pod that says it is this job's
    /// is deleted.
    fn stop(&mut self, id: u64, grace: Duration) {
        if let Some((_, stop)) = self.creating.get_mut(&id) {
            // Stopped once it is made.
            *stop = Some(grace);
            return;
        }
        let Some((name, _)) = self.pods.remove(&id) else { return };
        // Told to stop over its connection already: the deletion's SIGTERM
        // and grace end one that did not exit.
        self.delete_named(format!("worker {id}"), name, grace);
    }

    /// Its Pod deleted at once (it ignores SIGTERM); another is made at the
    /// next look while workers run on its node.
    fn relay_lost(&mut self, id: u64) {
        if let Some(name) = self.relaying.as_mut().and_then(|r| r.relays.lost(id)) {
            self.delete_named(format!("relay {id}"), name, Duration::from_secs(1));
        }
    }

    fn exited(&mut self) -> Vec<(u64, String)> {
        self.take_done();
        self.poll();
        std::mem::take(&mut self.exited)
    }

    fn handle(&self, id: u64) -> Option<String> {
        self.handles.get(&id).cloned()
    }

    fn log_of(&self, id: u64) -> Option<PathBuf> {
        self.logs.get(&id).cloned()
    }

    fn release(&mut self) {
        // The workers follow the coordinator that leads now: their Pods
        // are its (those being made too), and nothing here deletes them.
        self.pods.clear();
        self.creating.clear();
        if let Some(r) = &mut self.relaying {
            // Their relays end with this coordinator's connection; the
            // Service is the job's, and stays.
            r.relays.clear();
            r.service = false;
            r.service_uid = None;
            r.coordinator = None;
        }
    }

    fn kill_if_lingering(&mut self, id: u64, after: Duration) {
        if self.pods.contains_key(&id) {
            self.lingering.mark(id, after);
        }
    }

    /// Deletes each such worker's Pod with a second's notice, its log so
    /// far kept first where the API gives it within [`LINGER_LOG_WITHIN`]
    /// (the others wait on this worker: a log that cannot be read is not
    /// waited for, and a warning says so), on the scaler's thread; the
    /// kills done are said at the next call. The Pod stays the worker's
    /// until the listing no longer shows it: its end is reported as any. An
    /// API server that does not answer is asked once more a second later.
    fn kill_lingering(&mut self) -> Vec<(u64, String)> {
        self.take_done();
        let (pods, killing) = (&self.pods, &self.killing);
        let due = self.lingering.due(|id| pods.contains_key(&id) || killing.contains(&id));
        for id in due {
            let Some((name, _)) = self.pods.get(&id).cloned() else { continue };
            match self.api() {
                Ok((api, _)) if self.quiet.open() && !self.killing.contains(&id) => {
                    self.kill_pod(&api, id, name)
                }
                Ok(_) if self.killing.contains(&id) => {}
                _ => {
                    tracing::warn!("kubernetes: worker {id} not killed yet: the API server does not answer");
                    self.lingering.again(id, Duration::from_secs(1));
                }
            }
        }
        std::mem::take(&mut self.killed)
    }

    fn adopt(&mut self, id: u64, handle: &str, job: &str) -> bool {
        // Only the Pod this scaler would have made for the worker: a handle
        // read from the store never names another Pod to delete.
        let name = pod_name(job, id);
        if handle.strip_prefix("pod:") != Some(name.as_str()) {
            return false;
        }
        let read = self.api().and_then(|(api, _)| self.rt.block_on(read_pod(&api, &name)));
        match read {
            Ok(pod) => self.adopt_seen(id, handle, job, pod.as_ref().map(|p| &p.metadata)),
            Err(e) => {
                tracing::warn!("kubernetes: worker {id}'s Pod {name} is not taken over: {e:#}");
                false
            }
        }
    }

    /// Waits for the calls under way (each bounded), and for those their
    /// answers start (a Pod made after its stop was asked for, deleted), so
    /// that no call of this coordinator's is sent after it let the job go.
    fn settle(&mut self) {
        loop {
            let calls = std::mem::take(&mut self.calls);
            if calls.is_empty() {
                return;
            }
            self.rt.block_on(async {
                for c in calls {
                    let _ = c.await;
                }
            });
            self.take_done();
        }
    }

    fn fence_stops(&mut self, fence: LeaseFence) {
        self.fence = Some(fence);
    }
}

impl Drop for KubernetesScaler {
    fn drop(&mut self) {
        // What is left when the job ends goes with it, the Pods being made
        // too; no relay is made meanwhile.
        if let Some(r) = &mut self.relaying {
            r.ending = true;
        }
        let grace = Duration::from_secs(5);
        for (_, stop) in self.creating.values_mut() {
            *stop = Some(grace);
        }
        self.settle();
        let ids: Vec<u64> = self.pods.keys().copied().collect();
        for id in ids {
            self.stop(id, grace);
        }
        if let Some(r) = &mut self.relaying {
            // Only the Service this coordinator made or took, as it was.
            let (names, service) = (r.relays.names(), r.service_uid.take());
            r.relays.clear();
            for name in names {
                self.delete_named("a relay".into(), name, Duration::from_secs(1));
            }
            if let (Some(uid), Ok((api, _))) = (service, self.api()) {
                let (name, fence) = (service_name(&self.job), self.fence.clone());
                self.start(async move {
                    if crate::scalers::stop_fenced(&fence).is_none() {
                        let preconditions = Some(Preconditions { uid: Some(uid), resource_version: None });
                        let (svcs, params) =
                            (services(&api), DeleteParams { preconditions, ..Default::default() });
                        let gone = svcs.delete(&name, &params);
                        if let Err(e) =
                            bounded(&format!("deleting the Service {name}"), CALL_WITHIN, gone).await
                        {
                            tracing::warn!("kubernetes: {e:#}");
                        }
                    }
                });
            }
        }
        self.settle();
    }
}

/// What asking for the relays' Service came to.
enum ServiceAsked {
    /// Made, or taken as this job's and this coordinator's: its uid.
    Had(Option<String>),
    /// The one of that name is another job's (why): no relays.
    Foreign(String),
}

/// Makes the Service `svc`: its uid, or None where one of its name is there.
async fn create_service(api: &Api<Service>, svc: &Service) -> Result<Option<Option<String>>> {
    let name = svc.metadata.name.clone().unwrap_or_default();
    let params = PostParams::default();
    match tokio::time::timeout(CALL_WITHIN, api.create(&params, svc)).await {
        Ok(Ok(made)) => Ok(Some(made.metadata.uid)),
        Ok(Err(kube::Error::Api(s))) if s.code == 409 => Ok(None),
        Ok(Err(e)) => Err(anyhow!("creating the Service {name}: {e}")),
        Err(_) => Err(anyhow!(
            "creating the Service {name}: the Kubernetes API server did not answer within {CALL_WITHIN:?}"
        )),
    }
}

/// The uids of the owners `refs` name (none and an empty list alike).
fn owner_uids(refs: &Option<Vec<OwnerReference>>) -> BTreeSet<&str> {
    refs.iter().flatten().map(|o| o.uid.as_str()).collect()
}

/// Makes job `job`'s relay Service `svc`, or takes the one there (see
/// [`KubernetesScaler::make_service`]); `fence` is asked again before a
/// Service of another owner is deleted.
async fn have_service(
    api: &Api<Service>,
    job: &str,
    svc: &Service,
    fence: &Option<LeaseFence>,
) -> Result<ServiceAsked> {
    let name = svc.metadata.name.clone().unwrap_or_default();
    if let Some(uid) = create_service(api, svc).await? {
        tracing::info!("kubernetes: the relays' Service {name}");
        return Ok(ServiceAsked::Had(uid));
    }
    let there = bounded(&format!("reading the Service {name}"), CALL_WITHIN, api.get(&name)).await?;
    if let Err(why) = of_job(&there.metadata, job) {
        return Ok(ServiceAsked::Foreign(format!("the Service {name} is not this job's: {why}")));
    }
    if owner_uids(&there.metadata.owner_references) == owner_uids(&svc.metadata.owner_references) {
        return Ok(ServiceAsked::Had(there.metadata.uid));
    }
    if let Some(why) = crate::scalers::stop_fenced(fence) {
        anyhow::bail!("the Service {name} is not made again: {why}");
    }
    let params = DeleteParams {
        preconditions: Some(Preconditions { uid: there.metadata.uid.clone(), resource_version: None }),
        ..Default::default()
    };
    let gone = format!("deleting the Service {name} of another owner");
    bounded(&gone, CALL_WITHIN, api.delete(&name, &params)).await?;
    match create_service(api, svc).await? {
        Some(uid) => Ok(ServiceAsked::Had(uid)),
        None => anyhow::bail!("the Service {name} was made again by another meanwhile"),
    }
}

/// The Services of the namespace of `pods`.
fn services(pods: &Api<Pod>) -> Api<Service> {
    let ns = pods.namespace().map(str::to_string);
    let client = pods.clone().into_client();
    match ns {
        Some(ns) => Api::namespaced(client, &ns),
        None => Api::default_namespaced(client),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::scalers::kube_objects::{JOB_ANNOTATION, job_hash};

    fn opts() -> KubeOptions {
        KubeOptions {
            namespace: Some("ml".into()),
            image: "registry.example/edl:1".into(),
            secret: "edl-mnist".into(),
            gpus: Some(1),
            owner: Owner::Pod,
            pending_bound: Duration::from_secs(120),
            pod_name: Some("coord-0".into()),
        }
    }

    fn coordinator_pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("edl-mnist-7d9c-abcde".into()),
                uid: Some("uid-pod".into()),
                owner_references: Some(vec![OwnerReference {
                    api_version: "apps/v1".into(),
                    kind: "ReplicaSet".into(),
                    name: "edl-mnist-7d9c".into(),
                    uid: "uid-rs".into(),
                    controller: Some(true),
                    block_owner_deletion: Some(true),
                }]),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_worker_pod_mounts_the_secret_names_its_owner_and_carries_no_secret_itself() {
        let owner = owner_of(&coordinator_pod(), Owner::Pod);
        let program =
            vec!["edl-runtime".into(), "worker".into(), "--coordinator".into(), "10.0.0.5:7070".into()];
        let pod = worker_pod(&opts(), "MNIST_big", 7, "10.0.0.5:7070", program, owner, None);
        // Through the API's own schema: what the server would be sent.
        let json = serde_json::to_value(&pod).unwrap();
        let back: Pod = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, pod);
        assert_eq!(json["apiVersion"], "v1");
        assert_eq!(json["kind"], "Pod");
        assert_eq!(json["metadata"]["name"], format!("edl-mnist-big-{}-w7", job_hash("MNIST_big")));
        assert_eq!(json["metadata"]["namespace"], "ml");
        assert_eq!(json["metadata"]["labels"]["edl.dev/job"], "MNIST_big");
        assert_eq!(json["metadata"]["labels"]["edl.dev/worker"], "7");
        assert_eq!(json["metadata"]["annotations"]["edl.dev/job-name"], "MNIST_big");
        let o = &json["metadata"]["ownerReferences"][0];
        assert_eq!((o["kind"].as_str(), o["uid"].as_str()), (Some("Pod"), Some("uid-pod")));
        let spec = &json["spec"];
        assert_eq!(spec["restartPolicy"], "Never");
        let c = &spec["containers"][0];
        assert_eq!(c["image"], "registry.example/edl:1");
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "1");
        assert_eq!(c["volumeMounts"][0]["mountPath"], "/run/edl");
        assert_eq!(spec["volumes"][0]["secret"]["secretName"], "edl-mnist");
        assert_eq!(spec["volumes"][0]["secret"]["defaultMode"], 0o400);
        let env: BTreeMap<String, String> = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["name"].as_str().unwrap().to_string(), e["value"].as_str().unwrap().to_string()))
            .collect();
        assert_eq!(env["EDL_JOB_SECRET_FILE"], "/run/edl/secret");
        assert_eq!(env["EDL_WORKER_ID"], "7");
        assert!(!env.contains_key("EDL_JOB_SECRET"), "the secret itself is in no variable");
    }

    #[test]
    fn a_job_name_that_is_no_label_value_is_made_one() {
        assert_eq!(job_label("mnist"), "mnist");
        assert_eq!(job_label("run-2."), "run-2");
        let long = format!("a{}", "b".repeat(63));
        assert_eq!(job_label(&long).len(), 63);
        assert_eq!(job_label(&format!("{}_-x", "c".repeat(61))), "c".repeat(61));
    }

    #[test]
    fn the_owner_is_the_coordinator_pod_or_its_controller() {
        let p = coordinator_pod();
        let pod = owner_of(&p, Owner::Pod).unwrap();
        assert_eq!((pod.kind.as_str(), pod.name.as_str()), ("Pod", "edl-mnist-7d9c-abcde"));
        let rs = owner_of(&p, Owner::Controller).unwrap();
        assert_eq!((rs.kind.as_str(), rs.uid.as_str(), rs.controller), ("ReplicaSet", "uid-rs", Some(false)));
        // A bare Pod has no controller: no owner to name.
        let bare = Pod {
            metadata: ObjectMeta { name: Some("c".into()), uid: Some("u".into()), ..Default::default() },
            ..Default::default()
        };
        assert_eq!(owner_of(&bare, Owner::Controller), None);
    }

    #[test]
    fn pods_are_waited_for_given_up_when_they_do_not_start_and_reported_when_they_end() {
        let bound = Duration::from_secs(60);
        let phase = |p: &str, r: Option<&str>| Seen::Phase(p.into(), r.map(String::from));
        let early = Duration::from_secs(5);
        assert_eq!(judge("w1", &phase("Pending", None), early, bound), Verdict::Wait);
        assert_eq!(judge("w1", &phase("Running", None), bound * 10, bound), Verdict::Wait);
        assert!(matches!(
            judge("w1", &phase("Pending", Some("Unschedulable")), bound, bound),
            Verdict::GiveUp(w) if w.contains("did not start its Pod w1 within 60s (Pending (Unschedulable))")
        ));
        assert!(matches!(
            judge("w1", &phase("Failed", Some("Evicted")), early, bound),
            Verdict::Ended(w) if w == "its Pod w1 ended: Failed (Evicted)"
        ));
        assert!(matches!(judge("w1", &Seen::Gone, early, bound), Verdict::Ended(w) if w.contains("gone")));
        assert!(matches!(judge("w1", &phase("Succeeded", None), early, bound), Verdict::Ended(_)));
    }

    /// Worker `id`'s Pod as the API would show it, for job `job`.
    fn listed(job: &str, id: u64, phase: &str) -> Pod {
        let mut pod = worker_pod(&opts(), job, id, "10.0.0.5:7070", vec!["w".into()], None, None);
        pod.metadata.uid = Some(format!("uid-{job}-{id}"));
        pod.status =
            Some(k8s_openapi::api::core::v1::PodStatus { phase: Some(phase.into()), ..Default::default() });
        pod
    }

    #[test]
    fn a_coordinator_that_took_the_job_over_takes_its_workers_pods_as_its_own() {
        let mut s = KubernetesScaler::new(opts(), Path::new("/nonexistent")).unwrap();
        let name = pod_name("mnist", 3);
        let handle = format!("pod:{name}");
        let ours = listed("mnist", 3, "Running").metadata;
        assert!(s.adopt_seen(3, &handle, "mnist", Some(&ours)));
        // Only the Pod made for that worker of that job.
        let (w4, other) = (format!("pod:{}", pod_name("mnist", 4)), format!("pod:{}", pod_name("other", 3)));
        for h in ["pod:", "pod:edl-mnist-w3", w4.as_str(), other.as_str(), "pod:coordinator-0", "slurm:12"] {
            assert!(!s.adopt(3, h, "mnist"), "{h}");
        }
        assert_eq!(s.pods.get(&3).map(|(n, _)| n.as_str()), Some(name.as_str()));
        assert_eq!(s.handle(3), Some(handle));
        // Its Pods are listed by the job's label, as those it made.
        assert_eq!(s.job, "mnist");
        s.release();
    }

    #[test]
    fn pod_names_differ_for_every_exact_job_name_and_are_dns_labels() {
        let dns_label = |n: &str| {
            let b = n.as_bytes();
            n.len() <= 63
                && b.iter().all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                && b.first().is_some_and(|c| c.is_ascii_alphanumeric())
                && b.last().is_some_and(|c| c.is_ascii_alphanumeric())
        };
        let long = format!("A{}", "b_.".repeat(21));
        let jobs =
            ["Mnist", "mnist", "mnist_a", "mnist-a", "mnist.a", "run-2.", "run-2", long.as_str(), "_", "x"];
        let mut names = std::collections::BTreeSet::new();
        for job in jobs {
            for id in [0, 7, u64::MAX] {
                let name = pod_name(job, id);
                assert!(dns_label(&name), "{job:?} {id}: {name:?}");
                assert_eq!(pod_name(job, id), name, "the same on every call");
                assert!(name.ends_with(&format!("-{}-w{id}", job_hash(job))), "{name}");
                assert!(names.insert(name.clone()), "{job:?} {id}: {name} is another job's too");
            }
        }
        // Readable: the job's name leads.
        assert!(pod_name("mnist_a", 1).starts_with("edl-mnist-a-"));
        assert_eq!(job_hash("mnist").len(), 8);
        assert_ne!(job_hash("Mnist"), job_hash("mnist"));
    }

    #[test]
    fn only_a_pod_that_names_this_exact_job_is_deleted_or_taken_over() {
        let ours = listed("mnist_a", 3, "Running").metadata;
        assert_eq!(of_job(&ours, "mnist_a"), Ok(()));
        // Another job's Pod, however alike its name, and one edl did not make.
        for job in ["mnist-a", "Mnist_a", "mnist"] {
            assert!(of_job(&ours, job).is_err(), "{job}");
        }
        let mut relabelled = ours.clone();
        relabelled.annotations = None;
        assert!(of_job(&relabelled, "mnist_a").unwrap_err().contains(JOB_ANNOTATION));
        // Two names of one label: the annotation tells them apart.
        let (a, b) = (format!("{}x", "c".repeat(63)), format!("{}y", "c".repeat(63)));
        assert_eq!(job_label(&a), job_label(&b));
        assert!(of_job(&listed(&a, 1, "Running").metadata, &b).is_err());
        // A Pod that bears worker 3's name but is another job's is refused,
        // and is not taken for the worker's own when the Pods are listed.
        // Any Pod still pending is overdue.
        let mut s = KubernetesScaler::new(
            KubeOptions { pending_bound: Duration::ZERO, ..opts() },
            Path::new("/nonexistent"),
        )
        .unwrap();
        let mut stranger = listed("mnist-a", 3, "Pending");
        stranger.metadata.name = Some(pod_name("mnist_a", 3));
        let handle = format!("pod:{}", pod_name("mnist_a", 3));
        assert!(!s.adopt_seen(3, &handle, "mnist_a", Some(&stranger.metadata)));
        assert!(s.pods.is_empty());
        assert!(s.adopt_seen(3, &handle, "mnist_a", None), "gone already: the next poll reports it");
        let judged = s.judge_listed(Instant::now(), vec![stranger]);
        assert!(matches!(&judged[..], [(3, why, Then::Nothing)] if why.contains("is gone")), "{judged:?}");
        // Its own Pod, stuck in Pending, is given up on and deleted.
        let judged = s.judge_listed(Instant::now(), vec![listed("mnist_a", 3, "Pending")]);
        assert!(
            matches!(&judged[..], [(3, _, Then::Delete(m))] if m.uid.as_deref() == Some("uid-mnist_a-3"))
        );
        s.release();
    }

    /// An API server's stand-in on loopback, for the paths the scaler uses:
    /// it creates Pods, lists them with the phase the test sets, serves a
    /// log, deletes them, and records every request's method, path and body.
    pub(crate) struct StandIn {
        url: String,
        /// Every Pod's phase, but where `phase_of` names the Pod.
        pub(crate) phase: Arc<Mutex<String>>,
        pub(crate) phase_of: Arc<Mutex<BTreeMap<String, String>>>,
        /// The address of the Pods `ip_of` names (the others: 127.0.0.1).
        pub(crate) ip_of: Arc<Mutex<BTreeMap<String, String>>>,
        /// The node each Pod `node_of` names is bound to (the others: none).
        pub(crate) node_of: Arc<Mutex<BTreeMap<String, String>>>,
        /// The Services made, by name.
        pub(crate) services: Arc<Mutex<BTreeMap<String, serde_json::Value>>>,
        /// While set, a Service is not made (a server error).
        pub(crate) failing_services: Arc<std::sync::atomic::AtomicBool>,
        /// While set, no request is answered (nor heard).
        pub(crate) stalled: Arc<std::sync::atomic::AtomicBool>,
        heard: Arc<Mutex<Vec<String>>>,
        _rt: tokio::runtime::Runtime,
    }

    use std::sync::{Arc, Mutex};

    /// What the stand-in holds: the Pods made (by name), what the test set
    /// of them, every request heard, and the log it serves.
    #[derive(Clone)]
    struct Cluster {
        made: Arc<Mutex<BTreeMap<String, serde_json::Value>>>,
        phase: Arc<Mutex<String>>,
        phase_of: Arc<Mutex<BTreeMap<String, String>>>,
        ip_of: Arc<Mutex<BTreeMap<String, String>>>,
        node_of: Arc<Mutex<BTreeMap<String, String>>>,
        services: Arc<Mutex<BTreeMap<String, serde_json::Value>>>,
        failing_services: Arc<std::sync::atomic::AtomicBool>,
        heard: Arc<Mutex<Vec<String>>>,
        log: &'static str,
    }

    impl Cluster {
        /// `pod` as the API shows it: a uid, its phase and its address.
        fn shown(&self, mut pod: serde_json::Value) -> serde_json::Value {
            pod["metadata"]["uid"] = "uid-7".into();
            let name = pod["metadata"]["name"].as_str().unwrap_or_default().to_string();
            let given = self.phase_of.lock().unwrap().get(&name).cloned();
            let phase = given.unwrap_or_else(|| self.phase.lock().unwrap().clone());
            // Every Pod runs on this host.
            let ip = self.ip_of.lock().unwrap().get(&name).cloned().unwrap_or_else(|| "127.0.0.1".into());
            let ready = if phase == "Running" { "True" } else { "False" };
            pod["status"] = serde_json::json!({
                "phase": phase, "podIP": ip, "conditions": [{ "type": "Ready", "status": ready }]
            });
            if let Some(node) = self.node_of.lock().unwrap().get(&name) {
                pod["spec"]["nodeName"] = node.clone().into();
            }
            pod
        }

        /// The answer to a request about Services.
        fn service(&self, method: &str, path: &str, body: &[u8]) -> axum::response::Response {
            use axum::{Json, response::IntoResponse};
            let mut services = self.services.lock().unwrap();
            if method == "POST" && self.failing_services.load(std::sync::atomic::Ordering::SeqCst) {
                return status(500, "InternalError", "etcdserver: request timed out");
            }
            if method == "POST" {
                let mut svc: serde_json::Value = serde_json::from_slice(body).unwrap();
                let name = svc["metadata"]["name"].as_str().unwrap_or_default().to_string();
                if services.contains_key(&name) {
                    return status(409, "AlreadyExists", &format!("services \"{name}\" already exists"));
                }
                svc["metadata"]["uid"] = format!("uid-{name}-{}", self.heard.lock().unwrap().len()).into();
                services.insert(name, svc.clone());
                return Json(svc).into_response();
            }
            let name = path.rsplit('/').next().unwrap_or_default().to_string();
            // A deletion's uid precondition, as the API server holds to it.
            let asked: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            let uid = asked["preconditions"]["uid"].as_str();
            let held = services.get(&name).and_then(|s| s["metadata"]["uid"].as_str().map(str::to_string));
            if method == "DELETE" && uid.is_some_and(|u| held.as_deref().is_some_and(|h| h != u)) {
                return status(409, "Conflict", "Precondition failed: UID in precondition does not match");
            }
            let found = match method {
                "DELETE" => services.remove(&name),
                _ => services.get(&name).cloned(),
            };
            match found {
                Some(svc) => Json(svc).into_response(),
                None => status(404, "NotFound", &format!("{path} not found")),
            }
        }

        /// The Pod `path` names, by its own name only.
        fn named(&self, path: &str) -> Option<(String, serde_json::Value)> {
            let made = self.made.lock().unwrap();
            made.iter().find(|(n, _)| path.ends_with(&format!("/{n}"))).map(|(n, p)| (n.clone(), p.clone()))
        }

        /// The answer to one request.
        fn answer(&self, method: &str, path: &str, body: &[u8]) -> axum::response::Response {
            use axum::{Json, response::IntoResponse};
            self.heard.lock().unwrap().push(format!("{method} {path} {}", String::from_utf8_lossy(body)));
            if path.contains("/services") {
                return self.service(method, path, body);
            }
            match (method, path.ends_with("/log")) {
                ("POST", _) => {
                    let pod: serde_json::Value = serde_json::from_slice(body).unwrap();
                    let name = pod["metadata"]["name"].as_str().unwrap_or_default().to_string();
                    if self.made.lock().unwrap().contains_key(&name) {
                        return status(409, "AlreadyExists", &format!("pods \"{name}\" already exists"));
                    }
                    self.made.lock().unwrap().insert(name, pod.clone());
                    Json(self.shown(pod)).into_response()
                }
                ("GET", true) => self.log.into_response(),
                ("GET", false) if path.ends_with("/pods") => {
                    let made: Vec<_> = self.made.lock().unwrap().values().cloned().collect();
                    let items: Vec<_> = made.into_iter().map(|p| self.shown(p)).collect();
                    Json(serde_json::json!({ "apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items }))
                        .into_response()
                }
                _ => match self.named(path) {
                    Some((name, pod)) => {
                        if method == "DELETE" {
                            self.made.lock().unwrap().remove(&name);
                        }
                        Json(self.shown(pod)).into_response()
                    }
                    None => status(404, "NotFound", &format!("{path} not found")),
                },
            }
        }
    }

    /// A refusal, as the API server words it.
    fn status(code: u16, reason: &str, message: &str) -> axum::response::Response {
        use axum::{Json, response::IntoResponse};
        let body = serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code
        });
        (axum::http::StatusCode::from_u16(code).unwrap(), Json(body)).into_response()
    }

    impl StandIn {
        pub(crate) fn start(log: &'static str) -> StandIn {
            use axum::{Router, extract::Request, routing::any};
            let cluster = Cluster {
                made: Arc::default(),
                phase: Arc::new(Mutex::new("Running".to_string())),
                phase_of: Arc::default(),
                ip_of: Arc::default(),
                node_of: Arc::default(),
                services: Arc::default(),
                failing_services: Arc::default(),
                heard: Arc::default(),
                log,
            };
            let c = cluster.clone();
            let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let stall = stalled.clone();
            let serve = move |req: Request| {
                let (c, stall) = (c.clone(), stall.clone());
                async move {
                    while stall.load(std::sync::atomic::Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    let (method, path) = (req.method().to_string(), req.uri().path().to_string());
                    let body = axum::body::to_bytes(req.into_body(), 1 << 20).await.unwrap_or_default();
                    c.answer(&method, &path, &body)
                }
            };
            let rt =
                tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
            let url = format!("http://{}", listener.local_addr().unwrap());
            rt.spawn(async move { axum::serve(listener, Router::new().fallback(any(serve))).await });
            let Cluster { phase, phase_of, ip_of, node_of, services, failing_services, heard, .. } = cluster;
            StandIn {
                url,
                phase,
                phase_of,
                ip_of,
                node_of,
                services,
                failing_services,
                stalled,
                heard,
                _rt: rt,
            }
        }

        /// A scaler whose API is this stand-in's, its logs kept in `dir`.
        fn scaler(&self, dir: &Path) -> KubernetesScaler {
            let mut s = KubernetesScaler::new(opts(), dir).unwrap();
            s.api = Some((self.pods(&s.rt), None));
            s
        }

        /// The Pods' API in namespace `ml` of this stand-in, for calls on `rt`.
        pub(crate) fn pods(&self, rt: &tokio::runtime::Runtime) -> Api<Pod> {
            let config = kube::Config::new(self.url.parse().unwrap());
            let client = rt.block_on(async { kube::Client::try_from(config) }).unwrap();
            Api::namespaced(client, "ml")
        }

        /// The requests it heard that start with `what` (a method).
        pub(crate) fn heard(&self, what: &str) -> Vec<String> {
            self.heard.lock().unwrap().iter().filter(|l| l.starts_with(what)).cloned().collect()
        }
    }

    impl KubernetesScaler {
        /// What [`Scaler::exited`] says once every call it started came back.
        fn exited_settled(&mut self) -> Vec<(u64, String)> {
            let mut said = Vec::new();
            for _ in 0..10 {
                said.extend(self.exited());
                if self.calls.is_empty() {
                    break;
                }
                self.settle();
            }
            said
        }

        /// What [`Scaler::kill_lingering`] says once the kills it started came back.
        fn kill_lingering_settled(&mut self) -> Vec<(u64, String)> {
            let mut said = self.kill_lingering();
            self.settle();
            said.extend(self.kill_lingering());
            said
        }
    }

    #[test]
    fn a_pod_made_after_a_listing_was_sent_is_not_judged_by_it() {
        let mut s = KubernetesScaler::new(opts(), Path::new("/nonexistent")).unwrap();
        s.job = "mnist".into();
        let sent = Instant::now();
        std::thread::sleep(Duration::from_millis(5));
        let handle = format!("pod:{}", pod_name("mnist", 4));
        assert!(s.adopt_seen(4, &handle, "mnist", None));
        // Not in a listing sent before it was made: not taken for gone.
        assert!(s.judge_listed(sent, vec![]).is_empty());
        let judged = s.judge_listed(Instant::now(), vec![]);
        assert!(matches!(&judged[..], [(4, why, Then::Nothing)] if why.contains("is gone")), "{judged:?}");
        s.release();
    }

    #[test]
    fn a_stop_a_look_and_a_kill_return_at_once_while_the_api_server_does_not_answer() {
        let api = StandIn::start("step 1\n");
        let dir = tempfile::tempdir().unwrap();
        let mut s = api.scaler(dir.path());
        let auth =
            JobAuth { job: "mnist".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        for id in [1, 2, 3] {
            s.spawn(id, "10.0.0.5:7070", &auth).unwrap();
        }
        s.settle();
        api.stalled.store(true, std::sync::atomic::Ordering::SeqCst);
        // Each returns with its call under way (on the coordinator's thread,
        // each would wait for the answer or its bound, and then give up).
        // The listing goes first: worker 1 is stopped while it is out.
        s.polled = None;
        assert!(s.exited().is_empty());
        s.stop(1, Duration::from_secs(5));
        s.kill_if_lingering(2, Duration::ZERO);
        assert!(s.kill_lingering().is_empty());
        assert!(s.listing.is_some() && s.killing.contains(&2), "under way");
        assert!(api.heard("GET").is_empty() && api.heard("DELETE").is_empty(), "nothing answered yet");
        // By the time it answers, worker 1 and worker 3 ended.
        for id in [1, 3] {
            api.phase_of.lock().unwrap().insert(pod_name("mnist", id), "Failed".into());
        }
        api.stalled.store(false, std::sync::atomic::Ordering::SeqCst);
        let killed = s.kill_lingering_settled();
        assert!(matches!(&killed[..], [(2, how)] if how.contains("1 s of notice")), "{killed:?}");
        let deletes = api.heard("DELETE");
        let stopped =
            deletes.iter().find(|d| d.contains(&format!("/pods/{} ", pod_name("mnist", 1)))).unwrap();
        assert!(stopped.contains("\"gracePeriodSeconds\":5") && stopped.contains("uid-7"), "{stopped}");
        // The listing judged the workers it was sent for but the one
        // stopped meanwhile: worker 3's end is said with its log; worker 1,
        // stopped, is not reported, nor its log read.
        let exited = s.exited_settled();
        assert!(exited.iter().any(|(id, why)| *id == 3 && why.contains("ended: Failed")), "{exited:?}");
        assert!(exited.iter().all(|(id, _)| *id != 1), "{exited:?}");
        assert!(s.log_of(3).is_some() && s.log_of(1).is_none());
        let logs = api.heard("GET");
        assert!(!logs.iter().any(|l| l.contains(&format!("/pods/{}/log", pod_name("mnist", 1)))), "{logs:?}");
        assert!(s.listing.is_none());
    }

    #[test]
    fn a_coordinator_whose_lease_lapsed_meanwhile_sends_no_deletion() {
        let api = StandIn::start("");
        let dir = tempfile::tempdir().unwrap();
        let mut s = api.scaler(dir.path());
        let auth =
            JobAuth { job: "mnist".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        for id in [1, 2] {
            s.spawn(id, "10.0.0.5:7070", &auth).unwrap();
        }
        s.settle();
        // A lease last confirmed long ago: over by this process's clock.
        let lapsed = crate::leader::keeper::LeaseFence::confirmed_at(
            crate::clock::BootInstant::now(),
            Duration::from_millis(1),
        );
        std::thread::sleep(Duration::from_millis(5));
        api.stalled.store(true, std::sync::atomic::Ordering::SeqCst);
        s.fence_stops(lapsed);
        s.stop(1, Duration::from_secs(5));
        s.kill_if_lingering(2, Duration::ZERO);
        assert!(s.kill_lingering().is_empty());
        api.stalled.store(false, std::sync::atomic::Ordering::SeqCst);
        assert!(s.kill_lingering_settled().is_empty(), "not killed");
        assert!(api.heard("DELETE").is_empty(), "{:?}", api.heard("DELETE"));
        // Nor is a Pod made.
        s.spawn(3, "10.0.0.5:7070", &auth).unwrap();
        s.settle();
        assert_eq!(api.heard("POST").len(), 2);
        let refused = s.failed_spawns();
        assert!(matches!(&refused[..], [(3, why)] if why.contains("fenced")), "{refused:?}");
        s.release();
    }

    #[test]
    fn a_pod_is_made_off_the_coordinator_s_thread_stopped_once_made_and_a_refused_one_is_said() {
        let api = StandIn::start("");
        let dir = tempfile::tempdir().unwrap();
        let mut s = api.scaler(dir.path());
        let auth =
            JobAuth { job: "mnist".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        // Asked for while the API server does not answer: spawn returns,
        // and a stop asked meanwhile waits for the Pod to be made.
        api.stalled.store(true, std::sync::atomic::Ordering::SeqCst);
        s.spawn(1, "10.0.0.5:7070", &auth).unwrap();
        s.spawn(2, "10.0.0.5:7070", &auth).unwrap();
        assert_eq!(s.handle(1), Some(format!("pod:{}", pod_name("mnist", 1))));
        s.stop(1, Duration::from_secs(3));
        assert!(api.heard("POST").is_empty() && s.failed_spawns().is_empty());
        api.stalled.store(false, std::sync::atomic::Ordering::SeqCst);
        s.settle();
        assert_eq!(api.heard("POST").len(), 2);
        let deletes = api.heard("DELETE");
        assert_eq!(deletes.len(), 1, "worker 1's Pod, stopped once made: {deletes:?}");
        assert!(deletes[0].contains(&format!("/pods/{} ", pod_name("mnist", 1))), "{deletes:?}");
        assert!(s.pods.contains_key(&2) && !s.pods.contains_key(&1));
        // A Pod the API refuses (one of that name is there already) is said
        // once, as a start that failed; it is not the worker's.
        s.spawn(2, "10.0.0.5:7070", &auth).unwrap();
        s.settle();
        let refused = s.failed_spawns();
        assert!(matches!(&refused[..], [(2, why)] if why.contains("already exists")), "{refused:?}");
        assert!(s.failed_spawns().is_empty());
    }

    #[test]
    fn with_relays_each_node_running_workers_gets_a_relay_pod_that_the_workers_find_through_a_local_service()
    {
        let api = StandIn::start("");
        let dir = tempfile::tempdir().unwrap();
        let mut s = api.scaler(dir.path()).with_relays(Duration::from_secs(10));
        let auth =
            JobAuth { job: "mnist".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        for id in [1, 2, 3] {
            s.spawn(id, "10.0.0.5:7070", &auth).unwrap();
        }
        s.settle();
        // One Service for the job, asked for with the first worker; every
        // worker is told it.
        let made = api.heard("POST");
        let svcs: Vec<&String> = made.iter().filter(|l| l.contains("/services")).collect();
        assert_eq!(svcs.len(), 1, "{made:?}");
        assert!(svcs[0].contains("\"internalTrafficPolicy\":\"Local\""), "{}", svcs[0]);
        let told = format!("{{\"name\":\"EDL_RELAY\",\"value\":\"{}\"}}", relay_address("mnist"));
        assert_eq!(made.iter().filter(|l| l.contains(&told)).count(), 3, "{made:?}");
        // Workers 1 and 2 bound to n1, worker 3 to n2: a relay on each node.
        let bind =
            |id: u64, node: &str| api.node_of.lock().unwrap().insert(pod_name("mnist", id), node.into());
        bind(1, "n1");
        bind(2, "n1");
        bind(3, "n2");
        let look = |s: &mut KubernetesScaler| {
            s.polled = None;
            s.exited_settled()
        };
        assert!(look(&mut s).is_empty());
        let relays = |api: &StandIn| -> Vec<String> {
            api.heard("POST").into_iter().filter(|l| l.contains("\"edl.dev/relay\"")).collect()
        };
        let made = relays(&api);
        assert_eq!(made.len(), 2, "{made:?}");
        for (node, id) in [("n1", 1), ("n2", 2)] {
            let pod = made.iter().find(|l| l.contains(&format!("\"nodeName\":\"{node}\""))).unwrap();
            assert!(pod.contains(&format!("\"--id\",\"{id}\"")) && pod.contains("\"[::]:7079\""), "{pod}");
        }
        // Running and ready: nothing more is made.
        assert!(look(&mut s).is_empty());
        assert_eq!(relays(&api).len(), 2);
        // n2's only worker stopped: its relay deleted at the next look.
        s.stop(3, Duration::from_secs(1));
        assert!(look(&mut s).is_empty());
        let deleted = api.heard("DELETE");
        assert!(
            deleted.iter().any(|l| l.contains(&format!("/pods/{} ", pod_name_of("mnist", 'r', 2)))),
            "{deleted:?}"
        );
        // n1's relay lost (its connection): deleted, and another made.
        s.relay_lost(1);
        s.settle();
        let deleted = api.heard("DELETE");
        assert!(
            deleted.iter().any(|l| l.contains(&format!("/pods/{} ", pod_name_of("mnist", 'r', 1)))),
            "{deleted:?}"
        );
        assert!(look(&mut s).is_empty());
        let made = relays(&api);
        assert_eq!(made.len(), 3, "{made:?}");
        assert!(made[2].contains("\"--id\",\"3\"") && made[2].contains("\"nodeName\":\"n1\""), "{}", made[2]);
        // The job's end takes the relays and the Service with it.
        drop(s);
        let deleted = api.heard("DELETE");
        assert!(
            deleted.iter().any(|l| l.contains(&format!("/pods/{} ", pod_name_of("mnist", 'r', 3)))),
            "{deleted:?}"
        );
        assert!(
            deleted.iter().any(|l| l.contains(&format!("/services/{}", service_name("mnist")))),
            "{deleted:?}"
        );
        assert!(api.services.lock().unwrap().is_empty());
    }

    /// A scaler with relays on `api`, its workers of job `mnist`, started or not.
    fn relaying(api: &StandIn, dir: &Path) -> (KubernetesScaler, JobAuth) {
        let s = api.scaler(dir).with_relays(Duration::from_secs(10));
        let auth =
            JobAuth { job: "mnist".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        (s, auth)
    }

    /// The relay Pods asked of `api`.
    fn relays_made(api: &StandIn) -> Vec<String> {
        api.heard("POST").into_iter().filter(|l| l.contains("\"edl.dev/relay\"")).collect()
    }

    /// A look at the Pods, whenever the last was.
    fn look(s: &mut KubernetesScaler) -> Vec<(u64, String)> {
        s.polled = None;
        s.exited_settled()
    }

    #[test]
    fn with_relays_a_service_of_another_job_turns_them_off_and_no_worker_is_told_of_one() {
        let api = StandIn::start("");
        let dir = tempfile::tempdir().unwrap();
        let (mut s, auth) = relaying(&api, dir.path());
        let name = service_name("mnist");
        let theirs = serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": { "name": name, "uid": "uid-s", "labels": { JOB_LABEL: "mnist" },
                          "annotations": { JOB_ANNOTATION: "mnist-2" } }
        });
        api.services.lock().unwrap().insert(name.clone(), theirs.clone());
        s.spawn(1, "10.0.0.5:7070", &auth).unwrap();
        s.settle();
        s.spawn(2, "10.0.0.5:7070", &auth).unwrap();
        s.settle();
        let made = api.heard("POST");
        let told: Vec<&String> = made.iter().filter(|l| l.contains("EDL_RELAY")).collect();
        assert_eq!(told.len(), 1, "only the worker asked for before the Service was refused: {made:?}");
        api.node_of.lock().unwrap().insert(pod_name("mnist", 2), "n1".into());
        assert!(look(&mut s).is_empty());
        assert!(relays_made(&api).is_empty());
        // The other job's Service is left as it was, at the job's end too.
        drop(s);
        assert_eq!(api.services.lock().unwrap().get(&name), Some(&theirs));
        assert!(api.heard("DELETE").iter().all(|l| !l.contains("/services/")));
    }

    #[test]
    fn with_relays_a_service_the_api_server_failed_to_make_is_asked_for_again_with_the_next_worker() {
        let api = StandIn::start("");
        let dir = tempfile::tempdir().unwrap();
        let (mut s, auth) = relaying(&api, dir.path());
        api.failing_services.store(true, std::sync::atomic::Ordering::SeqCst);
        s.spawn(1, "10.0.0.5:7070", &auth).unwrap();
        s.settle();
        assert!(api.services.lock().unwrap().is_empty());
        let r = s.relaying.as_ref().unwrap();
        assert!(!r.off && !r.service, "not turned off: asked again");
        api.failing_services.store(false, std::sync::atomic::Ordering::SeqCst);
        s.spawn(2, "10.0.0.5:7070", &auth).unwrap();
        s.settle();
        let asked = api.heard("POST").into_iter().filter(|l| l.contains("/services")).count();
        assert_eq!(asked, 2);
        assert_eq!(api.services.lock().unwrap().len(), 1);
        // Made by this coordinator: the job's end deletes it, by its uid.
        drop(s);
        assert!(api.services.lock().unwrap().is_empty());
    }

    #[test]
    fn with_relays_the_job_s_service_of_another_owner_is_made_again_and_its_own_is_kept() {
        let api = StandIn::start("");
        let dir = tempfile::tempdir().unwrap();
        let name = service_name("mnist");
        let mine = relay_service(&opts(), "mnist", None);
        let mut theirs = serde_json::to_value(&mine).unwrap();
        theirs["metadata"]["uid"] = "uid-old".into();
        theirs["metadata"]["ownerReferences"] = serde_json::json!([{
            "apiVersion": "v1", "kind": "Pod", "name": "coord-gone", "uid": "uid-gone", "controller": true
        }]);
        api.services.lock().unwrap().insert(name.clone(), theirs);
        let (mut s, auth) = relaying(&api, dir.path());
        s.spawn(1, "10.0.0.5:7070", &auth).unwrap();
        s.settle();
        let deleted = api.heard("DELETE");
        assert!(
            matches!(&deleted[..], [d] if d.contains(&format!("/services/{name}")) && d.contains("uid-old")),
            "{deleted:?}"
        );
        let now = api.services.lock().unwrap().get(&name).cloned().unwrap();
        assert!(now["metadata"].get("ownerReferences").is_none(), "made again as this coordinator's: {now}");
        assert!(!s.relaying.as_ref().unwrap().off);
        // This coordinator's own, found there by the next: kept as it is.
        let (mut next, auth) = relaying(&api, dir.path());
        next.spawn(2, "10.0.0.5:7070", &auth).unwrap();
        next.settle();
        assert_eq!(api.heard("DELETE").len(), 1);
        assert!(!next.relaying.as_ref().unwrap().off);
        next.release();
        s.release();
    }

    #[test]
    fn with_relays_a_coordinator_that_took_the_job_over_deletes_the_relays_before_it_and_makes_its_own() {
        let api = StandIn::start("");
        let dir = tempfile::tempdir().unwrap();
        let (mut before, auth) = relaying(&api, dir.path());
        before.spawn(1, "10.0.0.5:7070", &auth).unwrap();
        before.settle();
        api.node_of.lock().unwrap().insert(pod_name("mnist", 1), "n1".into());
        assert!(look(&mut before).is_empty());
        assert_eq!(relays_made(&api).len(), 1);
        // Deposed: its workers and relay stay; the next coordinator takes
        // the worker over and, before it starts one, deletes the relay of
        // the one before (which ends with its connection) and makes none.
        before.release();
        drop(before);
        assert!(api.heard("DELETE").is_empty());
        let (mut after, auth) = relaying(&api, dir.path());
        assert!(after.adopt(1, &format!("pod:{}", pod_name("mnist", 1)), "mnist"));
        assert!(look(&mut after).is_empty());
        let deleted = api.heard("DELETE");
        assert_eq!(deleted.len(), 1, "{deleted:?}");
        assert!(deleted[0].contains(&format!("/pods/{} ", pod_name_of("mnist", 'r', 1))), "{deleted:?}");
        assert!(deleted[0].contains("\"gracePeriodSeconds\":1"), "{deleted:?}");
        assert_eq!(relays_made(&api).len(), 1);
        // Once it starts a worker it knows its own address: n1 gets a relay
        // of its own, numbered past the one before.
        after.spawn(2, "10.0.0.6:7070", &auth).unwrap();
        after.settle();
        assert!(look(&mut after).is_empty());
        let made = relays_made(&api);
        assert_eq!(made.len(), 2, "{made:?}");
        assert!(
            made[1].contains("\"--coordinator\",\"10.0.0.6:7070\"") && !made[1].contains("\"--id\",\"1\""),
            "{}",
            made[1]
        );
    }

    #[test]
    fn an_ended_worker_s_pod_is_deleted_once_its_log_is_kept_and_the_log_is_there_to_read() {
        let api = StandIn::start("step 3\nValueError: boom\n");
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("logs");
        let mut s = api.scaler(&logs);
        let auth =
            JobAuth { job: "mnist".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        s.spawn(7, "10.0.0.5:7070", &auth).unwrap();
        assert!(s.exited_settled().is_empty(), "running");
        assert!(api.heard("DELETE").is_empty());

        *api.phase.lock().unwrap() = "Failed".into();
        s.polled = None;
        let exited = s.exited_settled();
        assert!(matches!(&exited[..], [(7, why)] if why.contains("ended: Failed")), "{exited:?}");
        let kept = s.log_of(7).expect("the log is kept");
        assert_eq!(kept, logs.join("worker-7.log"));
        assert_eq!(std::fs::read_to_string(&kept).unwrap(), "step 3\nValueError: boom\n");
        // Read before it was deleted, and deleted as that very Pod.
        let name = pod_name("mnist", 7);
        let (log_at, deletes) = (api.heard("GET"), api.heard("DELETE"));
        assert!(log_at.iter().any(|l| l.contains(&format!("/pods/{name}/log"))), "{log_at:?}");
        assert_eq!(deletes.len(), 1, "{deletes:?}");
        assert!(
            deletes[0].contains(&format!("/pods/{name} ")) && deletes[0].contains("uid-7"),
            "{deletes:?}"
        );
        let order: Vec<String> = api.heard.lock().unwrap().clone();
        let (read, deleted) = (
            order.iter().position(|l| l.contains("/log")).unwrap(),
            order.iter().position(|l| l.starts_with("DELETE")).unwrap(),
        );
        assert!(read < deleted, "{order:?}");
    }

    #[test]
    fn a_lingering_worker_s_pod_is_deleted_with_a_second_s_notice_its_log_kept_and_its_end_reported() {
        let api = StandIn::start("step 9\n");
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("logs");
        let mut s = api.scaler(&logs);
        let auth =
            JobAuth { job: "mnist".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        s.spawn(4, "10.0.0.5:7070", &auth).unwrap();
        s.spawn(5, "10.0.0.5:7070", &auth).unwrap();
        s.settle();
        // Not due yet: nothing is deleted.
        s.kill_if_lingering(4, Duration::from_secs(3600));
        assert!(s.kill_lingering_settled().is_empty());
        s.kill_if_lingering(4, Duration::ZERO);
        let killed = s.kill_lingering_settled();
        assert!(
            matches!(&killed[..], [(4, how)] if how.contains("deleted with 1 s of notice")),
            "{killed:?}"
        );
        assert!(s.kill_lingering_settled().is_empty(), "killed once");
        let name = pod_name("mnist", 4);
        let deletes = api.heard("DELETE");
        assert_eq!(deletes.len(), 1, "{deletes:?}");
        assert!(deletes[0].contains(&format!("/pods/{name} ")), "{deletes:?}");
        assert!(
            deletes[0].contains("\"gracePeriodSeconds\":1") && deletes[0].contains("uid-7"),
            "{deletes:?}"
        );
        assert_eq!(std::fs::read_to_string(logs.join("worker-4.log")).unwrap(), "step 9\n");
        // Its log read before its Pod was deleted.
        let order: Vec<String> = api.heard.lock().unwrap().clone();
        let read = order.iter().position(|l| l.contains(&format!("/pods/{name}/log"))).unwrap();
        let deleted = order.iter().position(|l| l.starts_with("DELETE")).unwrap();
        assert!(read < deleted, "{order:?}");
        // Gone from the listing: its end reported, its log the one kept.
        s.polled = None;
        let exited = s.exited_settled();
        assert!(matches!(&exited[..], [(4, why)] if why.contains("is gone")), "{exited:?}");
        assert_eq!(s.log_of(4), Some(logs.join("worker-4.log")));
        // A worker that ended before its time is not killed.
        s.kill_if_lingering(5, Duration::ZERO);
        *api.phase.lock().unwrap() = "Failed".into();
        assert!(s.kill_lingering_settled().is_empty());
        assert_eq!(api.heard("DELETE").len(), 1);
    }

    #[test]
    fn an_ended_pod_whose_log_cannot_be_kept_is_left_for_a_person_to_read() {
        let api = StandIn::start("lost if the Pod went");
        let dir = tempfile::tempdir().unwrap();
        // The log directory cannot be made: a file is in its way.
        let blocked = dir.path().join("logs");
        std::fs::write(&blocked, "").unwrap();
        let mut s = api.scaler(&blocked);
        let auth =
            JobAuth { job: "mnist".into(), secret: edl_host_gpu::comm::auth::Secret::generate().unwrap() };
        s.spawn(2, "10.0.0.5:7070", &auth).unwrap();
        *api.phase.lock().unwrap() = "Succeeded".into();
        assert_eq!(s.exited_settled().len(), 1);
        assert!(api.heard("DELETE").is_empty(), "deleted with its log lost");
        assert_eq!(s.log_of(2), None);
        // Asked again at the next looks, then left for good.
        for _ in 0..4 {
            s.polled = None;
            assert!(s.exited_settled().is_empty());
        }
        let reads = api.heard("GET").iter().filter(|l| l.contains("/log")).count();
        assert_eq!(reads, LOG_TRIES as usize, "the log is asked for {LOG_TRIES} times");
        assert!(api.heard("DELETE").is_empty() && s.log_retries.is_empty());
    }
}
