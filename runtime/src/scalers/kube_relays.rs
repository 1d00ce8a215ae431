//! `--relay` under `--scaler kubernetes`: a relay on each node the job's
//! worker Pods run on, itself a Pod pinned there (`nodeName`), through which
//! that node's workers reach the coordinator over one connection.
//!
//! The scheduler places each worker's Pod, so a worker's node is known only
//! once the Pod is bound. The scaler sees it in its listing and makes that
//! node's relay Pod then (one a node, made again after its loss). Workers
//! find their node's relay through one Service of the job's, made with the
//! first worker: it selects the job's relay Pods and routes with
//! `internalTrafficPolicy: Local`, so a connection to it reaches the relay
//! on the connecting Pod's own node, or nothing. Each worker Pod is told the
//! Service's name (`EDL_RELAY`); a worker tries it for up to
//! [`crate::net::RELAY_WAIT`] (its node's first workers wait for the relay
//! their start caused) and otherwise connects to the coordinator itself.
//! A relay counts as up when its readiness probe (a TCP connection to its
//! port) passes: only then does the Service route to it.
//!
//! A relay's Pod asks for a tenth of a CPU and 128 MiB and no GPU. It
//! ignores SIGTERM (`trap '' TERM`, so the image needs a shell), so that
//! the node's workers, told to go by a drain, hand their state over through
//! it within their own notice; its deletion's grace then ends it. A relay
//! whose node runs none of the job's workers any more is deleted; a node
//! whose relays were lost [`RELAY_TRIES`] times goes without one. Relay
//! Pods this coordinator did not make (a coordinator's before it, whose
//! relays end with its connection) are deleted when seen.

use super::kube_objects::{
    JOB_LABEL, KubeOptions, job_hash, job_label, job_pod_meta, of_job, pod_name_of, secret_mount,
    secret_path, secret_volume,
};
use k8s_openapi::{
    api::core::v1::{
        Container, ContainerPort, Pod, PodSpec, Probe, ResourceRequirements, Service, ServicePort,
        ServiceSpec, TCPSocketAction,
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{ObjectMeta, OwnerReference},
        util::intstr::IntOrString,
    },
};
use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

/// The port a relay listens on in its Pod, and the Service's.
pub const RELAY_PORT: u16 = 7079;
/// The label that marks a relay's Pod (its value: the relay's number).
pub(crate) const RELAY_LABEL: &str = "edl.dev/relay";
/// The labels the Service selects relays by: their role, and the hash of
/// the job's exact name (the job label may be cut short, and shared).
const ROLE_LABEL: &str = "edl.dev/role";
const JOB_HASH_LABEL: &str = "edl.dev/job-hash";
/// Relays lost on one node before its workers connect directly.
pub const RELAY_TRIES: u32 = 3;
/// How long a relay Pod may take to be ready before its node's workers go
/// without one: to run (its image pulled), the job's pending bound; then to
/// pass its readiness probe, [`Bounds::READY`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bounds {
    pub pending: Duration,
    pub ready: Duration,
    /// How long the API's answer to a relay Pod's creation is waited for
    /// (each call is bounded well within it): past it, the relay is lost.
    pub asked: Duration,
}

impl Bounds {
    pub(crate) const READY: Duration = Duration::from_secs(60);
    pub(crate) const ASKED: Duration = Duration::from_secs(30);
}

/// The name of job `job`'s relay Service.
pub fn service_name(job: &str) -> String {
    pod_name_of(job, 's', 0)
}

/// Where job `job`'s workers look for their node's relay (`EDL_RELAY`).
pub fn relay_address(job: &str) -> String {
    format!("{}:{RELAY_PORT}", service_name(job))
}

/// The labels by which job `job`'s Service selects its relay Pods.
fn relay_labels(job: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (JOB_LABEL.to_string(), job_label(job)),
        (JOB_HASH_LABEL.to_string(), job_hash(job)),
        (ROLE_LABEL.to_string(), "relay".to_string()),
    ])
}

/// Job `job`'s relay Service: it selects the job's relay Pods and reaches,
/// from a Pod, only the relay on that Pod's node.
pub fn relay_service(opts: &KubeOptions, job: &str, owner: Option<OwnerReference>) -> Service {
    let selector = relay_labels(job);
    let mut metadata = job_pod_meta(job, service_name(job), opts.namespace.clone(), (ROLE_LABEL, 0), owner);
    if let Some(l) = metadata.labels.as_mut() {
        l.insert(ROLE_LABEL.into(), "relays".into());
    }
    Service {
        metadata,
        spec: Some(ServiceSpec {
            selector: Some(selector),
            ports: Some(vec![ServicePort {
                name: Some("relay".into()),
                port: RELAY_PORT.into(),
                target_port: Some(IntOrString::Int(RELAY_PORT.into())),
                protocol: Some("TCP".into()),
                ..Default::default()
            }]),
            internal_traffic_policy: Some("Local".into()),
            ..Default::default()
        }),
        status: None,
    }
}

/// Relay `id`'s Pod on `node`, for the coordinator at `coordinator`,
/// keeping the job's worker `lease`.
pub fn relay_pod(
    opts: &KubeOptions,
    job: &str,
    (id, node): (u64, &str),
    coordinator: &str,
    lease: Duration,
    owner: Option<OwnerReference>,
) -> Pod {
    let mut metadata =
        job_pod_meta(job, pod_name_of(job, 'r', id), opts.namespace.clone(), (RELAY_LABEL, id), owner);
    if let Some(l) = metadata.labels.as_mut() {
        l.extend(relay_labels(job));
    }
    // IPv4 and IPv6 both (IPv4 alone on a node without IPv6).
    let listen = format!("[::]:{RELAY_PORT}");
    let command = ["sh", "-c", "trap '' TERM; exec \"$0\" \"$@\"", "edl-runtime"]
        .iter()
        .map(|w| w.to_string())
        .chain(super::relay::relay_words(coordinator, id, job, lease, &listen))
        .chain(["--secret-file".to_string(), secret_path()])
        .collect();
    let requests = BTreeMap::from([
        ("cpu".to_string(), Quantity("100m".into())),
        ("memory".to_string(), Quantity("128Mi".into())),
    ]);
    Pod {
        metadata,
        spec: Some(PodSpec {
            node_name: Some(node.to_string()),
            restart_policy: Some("Never".into()),
            termination_grace_period_seconds: Some(30),
            containers: vec![Container {
                name: "relay".into(),
                image: Some(opts.image.clone()),
                command: Some(command),
                ports: Some(vec![ContainerPort {
                    name: Some("relay".into()),
                    container_port: RELAY_PORT.into(),
                    protocol: Some("TCP".into()),
                    ..Default::default()
                }]),
                readiness_probe: Some(Probe {
                    tcp_socket: Some(TCPSocketAction {
                        port: IntOrString::Int(RELAY_PORT.into()),
                        host: None,
                    }),
                    period_seconds: Some(2),
                    ..Default::default()
                }),
                resources: Some(ResourceRequirements { requests: Some(requests), ..Default::default() }),
                volume_mounts: Some(vec![secret_mount()]),
                ..Default::default()
            }],
            volumes: Some(vec![secret_volume(&opts.secret)]),
            ..Default::default()
        }),
        status: None,
    }
}

/// A node's relay.
#[derive(Debug)]
enum NodeRelay {
    /// Its Pod, `asked` for at a time: `made` once the API said so (in
    /// flight before: no listing judges it), `running` since its container
    /// was first seen running, `ready` once its probe passed.
    Relay {
        id: u64,
        name: String,
        asked: Instant,
        made: Option<Instant>,
        running: Option<Instant>,
        ready: bool,
    },
    /// This node's workers connect directly.
    Direct,
}

/// What the scaler is to do about the relays.
#[derive(Debug, PartialEq)]
pub(crate) enum RelayCall {
    /// Make relay `id`'s Pod on `node`.
    Make { id: u64, node: String },
    /// Delete the Pod `name`, as listed (`meta`).
    Delete { name: String, meta: Box<ObjectMeta> },
}

/// The relays of a Kubernetes job's nodes.
#[derive(Debug, Default)]
pub(crate) struct KubeRelays {
    by_node: BTreeMap<String, NodeRelay>,
    /// Relays lost on each node.
    losses: BTreeMap<String, u32>,
    /// The next relay's number (above any listed).
    next: u64,
}

/// What a listing shows of a relay's Pod.
fn relay_state(pod: &Pod) -> (String, bool) {
    let status = pod.status.clone().unwrap_or_default();
    let ready = (status.conditions.iter().flatten()).any(|c| c.type_ == "Ready" && c.status == "True");
    (status.phase.unwrap_or_else(|| "Unknown".into()), ready)
}

/// The deletion of a listed relay Pod, if it is job `job`'s.
fn delete_call(pod: &Pod, job: &str) -> Option<RelayCall> {
    let meta = pod.metadata.clone();
    of_job(&meta, job).ok()?;
    Some(RelayCall::Delete { name: meta.name.clone().unwrap_or_default(), meta: Box::new(meta) })
}

impl KubeRelays {
    /// Tends the relays, given the job's Pods as listed by a call sent at
    /// `at` and the nodes this job's workers are bound to: a relay ready is
    /// said, one that ended or is gone is forgotten and counted lost (made
    /// again while workers run on its node), one not ready within
    /// `bounds` is deleted and its node's workers connect directly,
    /// one whose node runs no worker any more is deleted; a node running
    /// workers without a relay gets one. Relay Pods of the job that are not
    /// this scaler's are deleted.
    pub(crate) fn tend(
        &mut self,
        job: &str,
        at: Instant,
        listed: &[Pod],
        nodes: &BTreeSet<String>,
        bounds: Bounds,
    ) -> Vec<RelayCall> {
        let relays: BTreeMap<&str, &Pod> = listed
            .iter()
            .filter(|p| p.metadata.labels.as_ref().is_some_and(|l| l.contains_key(RELAY_LABEL)))
            .filter_map(|p| Some((p.metadata.name.as_deref()?, p)))
            .collect();
        for p in relays.values() {
            let id = p.metadata.labels.as_ref().and_then(|l| l.get(RELAY_LABEL)?.parse::<u64>().ok());
            self.next = self.next.max(id.map_or(0, |i| i + 1));
        }
        let ours: BTreeSet<String> = self.names().into_iter().collect();
        // Another coordinator's, or one of ours forgotten: deleted.
        let mut calls: Vec<RelayCall> = (relays.iter())
            .filter(|(n, _)| !ours.contains(**n))
            .filter_map(|(_, p)| delete_call(p, job))
            .collect();
        let nodes_known: Vec<String> = self.by_node.keys().cloned().collect();
        for node in nodes_known {
            let busy = nodes.contains(&node);
            calls.extend(self.tend_node(job, &node, (busy, at, bounds), &relays));
        }
        for node in nodes {
            if !self.by_node.contains_key(node) {
                if self.losses.get(node).copied().unwrap_or(0) >= RELAY_TRIES {
                    tracing::warn!("{RELAY_TRIES} relays lost on {node}: its workers connect directly");
                    self.by_node.insert(node.clone(), NodeRelay::Direct);
                    continue;
                }
                self.next = self.next.max(1);
                let id = self.next;
                self.next += 1;
                calls.push(RelayCall::Make { id, node: node.clone() });
            }
        }
        calls
    }

    /// Tends `node`'s relay (`busy`: workers run there), given the relay
    /// Pods listed by a call sent at `at`; what to delete.
    fn tend_node(
        &mut self,
        job: &str,
        node: &str,
        (busy, at, bounds): (bool, Instant, Bounds),
        relays: &BTreeMap<&str, &Pod>,
    ) -> Option<RelayCall> {
        let Some(NodeRelay::Relay { id, name, asked, made, running, ready }) = self.by_node.get_mut(node)
        else {
            if !busy {
                self.by_node.remove(node);
            }
            return None;
        };
        let (id, name) = (*id, name.clone());
        match relays.get(name.as_str()) {
            Some(pod) if !busy => {
                self.by_node.remove(node);
                delete_call(pod, job)
            }
            Some(pod) => match relay_state(pod) {
                (phase, _) if phase == "Succeeded" || phase == "Failed" => {
                    tracing::warn!(
                        "relay {id} on {node} ended ({phase}): its workers there are lost with it"
                    );
                    self.lost_on(node);
                    delete_call(pod, job)
                }
                (_, true) => {
                    if !*ready {
                        tracing::info!("relay {id} carries {node}'s workers (its Pod {name})");
                    }
                    *ready = true;
                    None
                }
                (phase, false) if !*ready => {
                    if phase == "Running" {
                        running.get_or_insert_with(Instant::now);
                    }
                    let late = match (*running, *made) {
                        (Some(r), _) => (r.elapsed() > bounds.ready).then_some(bounds.ready),
                        (None, Some(m)) => (m.elapsed() > bounds.pending).then_some(bounds.pending),
                        (None, None) => None,
                    };
                    let bound = late?;
                    tracing::warn!(
                        "relay {id} on {node} was not ready within {bound:?} ({phase}); {node}'s workers connect \
                         directly"
                    );
                    self.by_node.insert(node.to_string(), NodeRelay::Direct);
                    delete_call(pod, job)
                }
                _ => None,
            },
            // Its creation's answer never came (it cannot be told made):
            // lost, and another asked for while workers run there.
            None if made.is_none() && asked.elapsed() > bounds.asked => {
                tracing::warn!("relay {id}'s Pod {name} on {node} was not made within {:?}", bounds.asked);
                self.lost_on(node);
                None
            }
            // Not made yet, or made after the listing was sent: not in it.
            None if made.is_none_or(|m| m > at) => None,
            None if busy => {
                tracing::warn!(
                    "relay {id}'s Pod {name} on {node} is gone: its workers there are lost with it"
                );
                self.lost_on(node);
                None
            }
            None => {
                self.by_node.remove(node);
                None
            }
        }
    }

    /// Relay `id`'s Pod `name` on `node` was asked for.
    pub(crate) fn asked(&mut self, id: u64, node: &str, name: String) {
        let relay =
            NodeRelay::Relay { id, name, asked: Instant::now(), made: None, running: None, ready: false };
        self.by_node.insert(node.to_string(), relay);
    }

    /// Relay `id`'s Pod was made: listings sent from now on show it.
    pub(crate) fn made(&mut self, id: u64) {
        for r in self.by_node.values_mut() {
            if let NodeRelay::Relay { id: i, made, .. } = r
                && *i == id
            {
                made.get_or_insert_with(Instant::now);
            }
        }
    }

    /// Relay `id`'s Pod could not be made: a loss on its node.
    pub(crate) fn refused(&mut self, id: u64) {
        if let Some(node) = self.node_of(id) {
            self.lost_on(&node);
        }
    }

    /// The coordinator lost relay `id`'s connection: its Pod's name, to
    /// delete; another is made while workers run on its node.
    pub(crate) fn lost(&mut self, id: u64) -> Option<String> {
        let node = self.node_of(id)?;
        let name = match self.by_node.get(&node) {
            Some(NodeRelay::Relay { name, .. }) => name.clone(),
            _ => return None,
        };
        self.lost_on(&node);
        Some(name)
    }

    /// Every relay Pod of this scaler's, by name (to delete at the end).
    pub(crate) fn names(&self) -> Vec<String> {
        (self.by_node.values())
            .filter_map(|r| match r {
                NodeRelay::Relay { name, .. } => Some(name.clone()),
                NodeRelay::Direct => None,
            })
            .collect()
    }

    /// Forgets every relay (the coordinator that leads now has its own).
    pub(crate) fn clear(&mut self) {
        self.by_node.clear();
    }

    fn node_of(&self, id: u64) -> Option<String> {
        self.by_node.iter().find_map(|(node, r)| match r {
            NodeRelay::Relay { id: i, .. } if *i == id => Some(node.clone()),
            _ => None,
        })
    }

    fn lost_on(&mut self, node: &str) {
        self.by_node.remove(node);
        *self.losses.entry(node.to_string()).or_default() += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};

    fn opts() -> KubeOptions {
        KubeOptions {
            namespace: Some("ml".into()),
            image: "r/edl:1".into(),
            secret: "s".into(),
            ..Default::default()
        }
    }

    /// Relay `id`'s Pod of job `job`, as a listing shows it.
    fn listed(job: &str, id: u64, phase: &str, ready: bool) -> Pod {
        let mut pod = relay_pod(&opts(), job, (id, "n1"), "10.0.0.5:7070", Duration::from_secs(10), None);
        pod.metadata.uid = Some(format!("uid-r{id}"));
        let condition = PodCondition {
            type_: "Ready".into(),
            status: if ready { "True" } else { "False" }.into(),
            ..Default::default()
        };
        pod.status = Some(PodStatus {
            phase: Some(phase.into()),
            conditions: Some(vec![condition]),
            ..Default::default()
        });
        pod
    }

    fn nodes(n: &[&str]) -> BTreeSet<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_relay_pod_is_pinned_to_its_node_listens_on_its_port_ignores_sigterm_and_carries_no_secret() {
        let pod = relay_pod(&opts(), "mnist", (4, "gpu-7"), "10.0.0.5:7070", Duration::from_secs(30), None);
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("gpu-7"));
        let c = &spec.containers[0];
        let line = c.command.as_ref().unwrap().join(" ");
        assert!(line.starts_with("sh -c trap '' TERM; exec \"$0\" \"$@\" edl-runtime relay"), "{line}");
        for part in
            ["--coordinator 10.0.0.5:7070", "--listen [::]:7079", "--id 4", "--job mnist", "--lease-ms 30000"]
        {
            assert!(line.contains(part), "{part} in {line}");
        }
        assert!(line.ends_with(&format!("--secret-file {}", secret_path())), "{line}");
        assert!(c.env.is_none(), "no secret in its variables");
        let probe = c.readiness_probe.as_ref().unwrap().tcp_socket.as_ref().unwrap();
        assert_eq!(probe.port, IntOrString::Int(7079));
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels.get(RELAY_LABEL).map(String::as_str), Some("4"));
        assert_eq!(labels.get(ROLE_LABEL).map(String::as_str), Some("relay"));
        // The job's Service selects it, and reaches the relay on the caller's node only.
        let svc = relay_service(&opts(), "mnist", None);
        let spec = svc.spec.unwrap();
        let selector = spec.selector.unwrap();
        assert!(selector.iter().all(|(k, v)| labels.get(k) == Some(v)), "{selector:?}");
        assert_eq!(spec.internal_traffic_policy.as_deref(), Some("Local"));
        assert_eq!(relay_address("mnist"), format!("{}:7079", service_name("mnist")));
        // A worker's Pod, or a relay of a job whose name makes the same
        // label (`mnist_`), is not selected.
        let worker = crate::scalers::kubernetes::worker_pod(&opts(), "mnist", 1, "c:1", vec![], None, None);
        let worker_labels = worker.metadata.labels.unwrap();
        assert!(!selector.iter().all(|(k, v)| worker_labels.get(k) == Some(v)), "{worker_labels:?}");
        let alike =
            relay_pod(&opts(), "mnist_", (4, "gpu-7"), "10.0.0.5:7070", Duration::from_secs(30), None);
        let alike = alike.metadata.labels.unwrap();
        assert_eq!(alike.get(JOB_LABEL), labels.get(JOB_LABEL), "one label for both jobs");
        assert!(!selector.iter().all(|(k, v)| alike.get(k) == Some(v)), "{alike:?}");
    }

    const BOUNDS: Bounds =
        Bounds { pending: Duration::from_secs(300), ready: Bounds::READY, asked: Bounds::ASKED };

    /// `r` asked for relay `id` on `node`, and the API made it.
    fn make(r: &mut KubeRelays, id: u64, node: &str) {
        r.asked(id, node, pod_name_of("mnist", 'r', id));
        r.made(id);
    }

    #[test]
    fn a_node_with_workers_gets_one_relay_made_again_after_its_loss_until_it_goes_without() {
        let mut r = KubeRelays::default();
        let t = Instant::now();
        assert!(r.tend("mnist", t, &[], &nodes(&[]), BOUNDS).is_empty());
        let calls = r.tend("mnist", t, &[], &nodes(&["n1", "n2"]), BOUNDS);
        assert_eq!(
            calls,
            [RelayCall::Make { id: 1, node: "n1".into() }, RelayCall::Make { id: 2, node: "n2".into() }]
        );
        // Asked for, not made yet: no listing, however late, takes it for gone
        // while the answer may come.
        r.asked(1, "n1", pod_name_of("mnist", 'r', 1));
        r.asked(2, "n2", pod_name_of("mnist", 'r', 2));
        assert!(r.tend("mnist", Instant::now(), &[], &nodes(&["n1", "n2"]), BOUNDS).is_empty());
        // An answer that never comes: lost after its bound, and asked again.
        let mut never = KubeRelays::default();
        never.asked(5, "n1", pod_name_of("mnist", 'r', 5));
        std::thread::sleep(Duration::from_millis(5));
        let short = Bounds { asked: Duration::from_millis(1), ..BOUNDS };
        let calls = never.tend("mnist", Instant::now(), &[], &nodes(&["n1"]), short);
        assert!(matches!(&calls[..], [RelayCall::Make { node, .. }] if node == "n1"), "{calls:?}");
        assert_eq!(never.losses["n1"], 1);
        r.made(1);
        r.made(2);
        // Not in a listing sent before they were made: waited for.
        assert!(r.tend("mnist", t, &[], &nodes(&["n1", "n2"]), BOUNDS).is_empty());
        // Ready on n1; n2's workers are gone: its relay deleted.
        let later = Instant::now();
        let (one, two) = (listed("mnist", 1, "Running", true), listed("mnist", 2, "Running", false));
        let calls = r.tend("mnist", later, &[one.clone(), two], &nodes(&["n1"]), BOUNDS);
        assert!(
            matches!(&calls[..], [RelayCall::Delete { name, meta }] if *name == pod_name_of("mnist", 'r', 2) && meta.uid.as_deref() == Some("uid-r2")),
            "{calls:?}"
        );
        assert!(r.tend("mnist", later, std::slice::from_ref(&one), &nodes(&["n1"]), BOUNDS).is_empty());
        // Lost (its connection): made again, with a new number, up to RELAY_TRIES.
        for n in 0..RELAY_TRIES {
            let id = match &r.by_node["n1"] {
                NodeRelay::Relay { id, .. } => *id,
                NodeRelay::Direct => panic!("direct after {n} losses"),
            };
            assert_eq!(r.lost(id), Some(pod_name_of("mnist", 'r', id)));
            let calls = r.tend("mnist", Instant::now(), &[], &nodes(&["n1"]), BOUNDS);
            if n + 1 < RELAY_TRIES {
                assert!(
                    matches!(&calls[..], [RelayCall::Make { id: new, node }] if *new > id && node == "n1"),
                    "{calls:?}"
                );
                let RelayCall::Make { id: new, .. } = calls[0] else { unreachable!() };
                make(&mut r, new, "n1");
            } else {
                assert!(calls.is_empty(), "{calls:?}");
                assert!(matches!(r.by_node["n1"], NodeRelay::Direct));
            }
        }
    }

    #[test]
    fn a_relay_not_running_within_the_pending_bound_or_not_ready_once_running_leaves_its_node_direct() {
        let mut r = KubeRelays::default();
        make(&mut r, 1, "n1");
        make(&mut r, 2, "n2");
        let t = Instant::now();
        let listing = [listed("mnist", 1, "Pending", false), listed("mnist", 2, "Running", false)];
        // Within both bounds: waited for.
        assert!(r.tend("mnist", t, &listing, &nodes(&["n1", "n2"]), BOUNDS).is_empty());
        // Past them: deleted, and their nodes' workers go direct, for good.
        std::thread::sleep(Duration::from_millis(5));
        let over = Bounds { ready: Duration::from_millis(1), pending: Duration::from_millis(1), ..BOUNDS };
        let calls = r.tend("mnist", Instant::now(), &listing, &nodes(&["n1", "n2"]), over);
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert!(calls.iter().all(|c| matches!(c, RelayCall::Delete { .. })), "{calls:?}");
        assert!(r.tend("mnist", Instant::now(), &[], &nodes(&["n1", "n2"]), over).is_empty());
        assert!(r.by_node.values().all(|n| matches!(n, NodeRelay::Direct)));
        // A pending one is bound by the pending bound alone, not the probe's.
        let mut r = KubeRelays::default();
        make(&mut r, 1, "n1");
        std::thread::sleep(Duration::from_millis(5));
        let listing = [listed("mnist", 1, "Pending", false)];
        let pulling = Bounds { ready: Duration::from_millis(1), ..BOUNDS };
        assert!(r.tend("mnist", Instant::now(), &listing, &nodes(&["n1"]), pulling).is_empty());
    }

    #[test]
    fn a_relay_that_ended_is_lost_one_not_this_scaler_s_is_deleted_and_numbers_go_above_the_listed() {
        let mut r = KubeRelays::default();
        // A coordinator before left relay 7 running; another job's is left alone.
        let theirs = listed("mnist", 7, "Running", true);
        let other_job = listed("cifar", 9, "Running", true);
        let calls = r.tend("mnist", Instant::now(), &[theirs, other_job], &nodes(&["n1"]), BOUNDS);
        assert!(
            matches!(&calls[..], [RelayCall::Delete { name, .. }, RelayCall::Make { id: 10, .. }] if *name == pod_name_of("mnist", 'r', 7)),
            "{calls:?}"
        );
        make(&mut r, 10, "n1");
        let ended = [listed("mnist", 10, "Failed", false)];
        let calls = r.tend("mnist", Instant::now(), &ended, &nodes(&["n1"]), BOUNDS);
        assert!(
            matches!(&calls[..], [RelayCall::Delete { .. }, RelayCall::Make { id: 11, .. }]),
            "{calls:?}"
        );
        assert_eq!(r.losses["n1"], 1);
        // A relay whose Pod could not be made counts as lost too.
        r.asked(11, "n1", pod_name_of("mnist", 'r', 11));
        r.refused(11);
        assert_eq!(r.losses["n1"], 2);
        assert!(r.names().is_empty());
    }
}
