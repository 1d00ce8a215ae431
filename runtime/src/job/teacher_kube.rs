//! Teachers in Kubernetes Pods (`--teacher-kube-image`): each teacher of
//! the pool is a Pod of its own image (Triton, MLServer, an image with
//! `edl-runtime`), with its own resources (`nvidia.com/gpu`, cpu, memory)
//! and node selector, beside or apart from the workers' Pods.
//!
//! A teacher's Pod is made through the API server (the `kube` crate), owned
//! as the workers' Pods are (by the coordinator's Pod or its controller),
//! and joins the pool once it runs, has an address, and its server and
//! model answer ready over KServe v2 at `podIP:--teacher-port`; the job then
//! registers that endpoint for the students. Told to go, it is deregistered,
//! the students are given a moment to stop sending, and the Pod is deleted
//! with a grace period: its server gets SIGTERM and drains. A Pod that ends
//! or is gone on its own is reported as an exited teacher (the pool starts
//! another). Never run here against a real API server (none can run on the
//! development machine): its calls are checked against a stand-in on
//! loopback, with a real teacher answering at the Pod's address.

use super::teacher_command::{Registered, Registry, wait_ready};
use crate::distill::TeacherAccess;
use crate::leader::record::TeacherHandle;
use crate::scalers::kubernetes::{
    JOB_LABEL, Owner, call, connect, delete_pod, job_label, job_pod_meta, node_selector, of_job, pod_name_of,
    quantities, running_ip,
};
use anyhow::{Result, bail};
use k8s_openapi::{
    api::core::v1::{Container, ContainerPort, Pod, PodSpec, ResourceRequirements},
    apimachinery::pkg::apis::meta::v1::OwnerReference,
};
use kube::api::{Api, ListParams, PostParams};
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// The label that marks a teacher's Pod (its value: the teacher's number).
const TEACHER_LABEL: &str = "edl.dev/teacher";
/// The notice a deleted teacher's server gets to drain.
const GRACE_SECS: u32 = 30;
/// How long students following the store take to stop sending to a
/// teacher taken out of it (they look every 200 ms).
const DRAIN: Duration = Duration::from_secs(1);

/// How the job's teacher Pods are made.
#[derive(Clone, Debug, Default)]
pub struct KubeTeacherSpec {
    pub image: String,
    /// The container's command, as `sh` would split it, after `{port}`,
    /// `{id}`, `{job}` and `{service}` are filled in.
    pub command: String,
    /// The port its server answers KServe v2 gRPC on.
    pub port: u16,
    /// Resource limits (and requests), e.g. `nvidia.com/gpu=1`, `memory=8Gi`.
    pub resources: Vec<(String, String)>,
    pub node_selector: Vec<(String, String)>,
    /// As the workers' Pods: the namespace, what owns the Pods, and the
    /// coordinator's own Pod's name.
    pub namespace: Option<String>,
    pub owner: Owner,
    pub pod_name: Option<String>,
    /// How long a teacher may take from its Pod's making to answering ready.
    pub ready_within: Duration,
}

impl KubeTeacherSpec {
    /// The container's command for teacher `id` of `job`.
    fn words(&self, id: u32, job: &str, service: &str) -> Result<Vec<String>> {
        let filled = self
            .command
            .replace("{port}", &self.port.to_string())
            .replace("{id}", &id.to_string())
            .replace("{job}", job)
            .replace("{service}", service);
        match shlex::split(&filled) {
            Some(w) if !w.is_empty() => Ok(w),
            _ => bail!(
                "--teacher-kube-command {:?}: not a command (unbalanced quotes, or empty)",
                self.command
            ),
        }
    }
}

/// The Pod of teacher `id` of `job`, running `command`.
pub fn teacher_pod(
    spec: &KubeTeacherSpec,
    job: &str,
    id: u32,
    command: Vec<String>,
    owner: Option<OwnerReference>,
) -> Pod {
    let quantities = quantities(&spec.resources);
    let resources = (!quantities.is_empty()).then(|| ResourceRequirements {
        limits: Some(quantities.clone()),
        requests: Some(quantities),
        ..Default::default()
    });
    Pod {
        metadata: job_pod_meta(
            job,
            pod_name_of(job, 't', id as u64),
            spec.namespace.clone(),
            (TEACHER_LABEL, id as u64),
            owner,
        ),
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            termination_grace_period_seconds: Some(GRACE_SECS.into()),
            node_selector: node_selector(&spec.node_selector),
            containers: vec![Container {
                name: "teacher".into(),
                image: Some(spec.image.clone()),
                command: Some(command),
                ports: Some(vec![ContainerPort {
                    container_port: spec.port.into(),
                    name: Some("grpc".into()),
                    ..Default::default()
                }]),
                resources,
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    }
}

/// One teacher's Pod, as the job keeps it.
struct KubeTeacher {
    id: u32,
    name: String,
    registered: Option<Registered>,
}

/// The job's teachers in Pods: made, watched and deleted through the API.
pub struct KubeTeachers {
    spec: KubeTeacherSpec,
    rt: tokio::runtime::Runtime,
    api: Option<(Api<Pod>, Option<OwnerReference>)>,
    job: String,
    service: String,
    /// None with the in-process store: students get the endpoints as a list.
    registry: Option<Registry>,
    access: TeacherAccess,
    model_name: String,
    /// By endpoint.
    pods: BTreeMap<String, KubeTeacher>,
    next: u32,
    /// Numbers are past those of the job's Pods already there (looked up
    /// once, before the first Pod this coordinator makes).
    numbered: bool,
    polled: Option<Instant>,
    /// The handles of the teachers serving, for the job's state, where
    /// their Pods outlive the coordinator's (owned by its controller).
    handles: Arc<Mutex<Vec<TeacherHandle>>>,
}

impl KubeTeachers {
    pub fn new(
        spec: KubeTeacherSpec,
        (job, service): (&str, &str),
        registry: Option<Registry>,
        access: TeacherAccess,
        model_name: &str,
    ) -> Result<KubeTeachers> {
        if spec.image.is_empty() {
            crate::refuse!("--teacher-kube-image is empty");
        }
        spec.words(0, job, service)?;
        // A token goes only where the students would send it.
        if let Some(why) = access.refusal(&format!("<Pod IP>:{}", spec.port)) {
            crate::refuse!("--teacher-kube-image: {why}");
        }
        Ok(KubeTeachers {
            spec,
            rt: tokio::runtime::Builder::new_current_thread().enable_all().build()?,
            api: None,
            job: job.to_string(),
            service: service.to_string(),
            registry,
            access,
            model_name: model_name.to_string(),
            pods: BTreeMap::new(),
            next: 0,
            numbered: false,
            polled: None,
            handles: Arc::default(),
        })
    }

    /// Its teachers' Pods outlive a coordinator killed without notice (they
    /// are its controller's, not its own Pod's), for the one that takes the
    /// job over.
    pub fn lasting(&self) -> bool {
        self.spec.owner == Owner::Controller
    }

    /// The handles of its teachers as they are when read (none unless
    /// [`lasting`](Self::lasting)).
    pub fn handles(&self) -> Arc<Mutex<Vec<TeacherHandle>>> {
        self.handles.clone()
    }

    fn note_handles(&self) {
        let now = match self.lasting() {
            true => self
                .pods
                .iter()
                .map(|(addr, t)| TeacherHandle { addr: addr.clone(), slot: 0, id: t.id })
                .collect(),
            false => Vec::new(),
        };
        *self.handles.lock().unwrap_or_else(|e| e.into_inner()) = now;
    }

    fn api(&mut self) -> Result<(Api<Pod>, Option<OwnerReference>)> {
        if let Some(a) = &self.api {
            return Ok(a.clone());
        }
        let s = &self.spec;
        let found = connect(&self.rt, s.namespace.clone(), s.pod_name.clone(), s.owner)?;
        self.api = Some(found.clone());
        Ok(found)
    }

    /// The endpoints of the teachers serving.
    pub fn addrs(&self) -> Vec<String> {
        self.pods.keys().cloned().collect()
    }

    /// Makes a teacher's Pod; returns its endpoint once it answers ready
    /// (and is registered). One that ends, or does not get ready in time,
    /// is deleted, and the error says why.
    pub fn start(&mut self) -> Result<String> {
        let (api, owner) = self.api()?;
        if !self.numbered {
            self.next = self.next.max(self.first_free(&api)?);
            self.numbered = true;
        }
        let id = self.next;
        self.next += 1;
        let words = self.spec.words(id, &self.job, &self.service)?;
        let pod = teacher_pod(&self.spec, &self.job, id, words, owner);
        let name = pod.metadata.name.clone().unwrap_or_default();
        call(&self.rt, &format!("creating the Pod {name}"), api.create(&PostParams::default(), &pod))?;
        tracing::info!("teacher {id}: Pod {name}");
        let started = Instant::now();
        let ready = self.running_at(&api, &name).and_then(|ip| {
            let endpoint = crate::net::host_port(&ip, self.spec.port);
            let left = self.spec.ready_within.saturating_sub(started.elapsed());
            wait_ready(&endpoint, &self.model_name, &self.access, left, || None)?;
            let registered = self.registry.as_ref().map(|r| r.hold(&endpoint)).transpose()?;
            Ok((endpoint, registered))
        });
        match ready {
            Ok((endpoint, registered)) => {
                self.pods.insert(endpoint.clone(), KubeTeacher { id, name, registered });
                self.note_handles();
                Ok(endpoint)
            }
            Err(e) => {
                self.delete(&api, &name);
                Err(e.context(format!("teacher {id} (Pod {name})")))
            }
        }
    }

    /// The first teacher number no Pod of this job has (Pods a coordinator
    /// before left keep theirs, for the one that takes them over).
    fn first_free(&self, api: &Api<Pod>) -> Result<u32> {
        let selector = format!("{JOB_LABEL}={},{TEACHER_LABEL}", job_label(&self.job));
        let listed =
            call(&self.rt, "listing the teacher Pods", api.list(&ListParams::default().labels(&selector)))?;
        let taken = listed
            .items
            .iter()
            .filter_map(|p| p.metadata.labels.as_ref()?.get(TEACHER_LABEL)?.parse::<u32>().ok());
        Ok(taken.map(|id| id + 1).max().unwrap_or(0))
    }

    /// Waits, within the ready bound, for the Pod `name` to run with an
    /// address; returns it.
    fn running_at(&self, api: &Api<Pod>, name: &str) -> Result<String> {
        running_ip(&self.rt, api, name, self.spec.ready_within)
    }

    /// Deletes the Pod `name` with its grace period (its server drains).
    fn delete(&self, api: &Api<Pod>, name: &str) {
        delete_pod(&self.rt, api, name, None, GRACE_SECS);
    }

    /// Tells the teacher at `addr` to go: deregistered, a moment for the
    /// students to stop sending, then its Pod deleted (SIGTERM: it drains).
    pub fn stop(&mut self, addr: &str) {
        let Some(mut t) = self.pods.remove(addr) else { return };
        self.note_handles();
        if let Some(mut r) = t.registered.take() {
            r.release();
            std::thread::sleep(DRAIN);
        }
        if let Ok((api, _)) = self.api() {
            self.delete(&api, &t.name);
        }
    }

    /// Teachers whose Pods ended or are gone since the last call (at most
    /// one look a second): (endpoint, how). An ended Pod is deleted.
    pub fn exited(&mut self) -> Vec<(String, String)> {
        if self.pods.is_empty() || self.polled.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return Vec::new();
        }
        self.polled = Some(Instant::now());
        let Ok((api, _)) = self.api() else { return Vec::new() };
        let selector = format!("{JOB_LABEL}={},{TEACHER_LABEL}", job_label(&self.job));
        let listed = match call(
            &self.rt,
            "listing the teacher Pods",
            api.list(&ListParams::default().labels(&selector)),
        ) {
            Ok(l) => l.items,
            Err(e) => {
                tracing::warn!("kubernetes: {e:#}");
                return Vec::new();
            }
        };
        let phases: BTreeMap<String, String> = listed
            .into_iter()
            .filter_map(|p| Some((p.metadata.name?, p.status.and_then(|s| s.phase).unwrap_or_default())))
            .collect();
        let mut out = Vec::new();
        let ended: Vec<(String, String)> = self
            .pods
            .iter()
            .filter_map(|(addr, t)| match phases.get(&t.name).map(String::as_str) {
                None => Some((addr.clone(), format!("teacher {addr}: its Pod {} is gone", t.name))),
                Some(p @ ("Succeeded" | "Failed")) => {
                    Some((addr.clone(), format!("teacher {addr}: its Pod {} ended: {p}", t.name)))
                }
                Some(_) => None,
            })
            .collect();
        for (addr, how) in ended {
            if let Some(mut t) = self.pods.remove(&addr) {
                if let Some(mut r) = t.registered.take() {
                    r.release();
                }
                self.delete(&api, &t.name);
            }
            out.push((addr, how));
        }
        self.note_handles();
        out
    }

    /// Takes over the teacher a coordinator before this one started
    /// (`h`, from the job's state): only the Pod this job would have made
    /// for that teacher, that says it is this job's, runs at `h`'s
    /// endpoint and answers ready. It is registered again and is this
    /// coordinator's to stop.
    pub fn adopt(&mut self, h: &TeacherHandle) -> Result<String> {
        let (api, _) = self.api()?;
        let name = pod_name_of(&self.job, 't', h.id as u64);
        let Some(pod) = call(&self.rt, &format!("reading the Pod {name}"), api.get_opt(&name))? else {
            bail!("its Pod {name} is gone");
        };
        let meta = &pod.metadata;
        if meta.name.as_deref() != Some(name.as_str()) {
            bail!("the API answered for {:?}, not its Pod {name}", meta.name);
        }
        of_job(meta, &self.job).map_err(|why| anyhow::anyhow!("its Pod {name} is not this job's: {why}"))?;
        let numbered = meta.labels.as_ref().and_then(|l| l.get(TEACHER_LABEL));
        if numbered != Some(&h.id.to_string()) {
            bail!("its Pod {name} is not teacher {}'s: {TEACHER_LABEL} is {numbered:?}", h.id);
        }
        let status = pod.status.clone().unwrap_or_default();
        // This job's teacher's Pod, not running or gone quiet, is deleted:
        // nothing else would.
        let ip = match (status.phase.as_deref(), status.pod_ip) {
            (Some("Running"), Some(ip)) if !ip.is_empty() => ip,
            (phase, _) => {
                self.delete(&api, &name);
                bail!("its Pod {name} is not running (phase {phase:?}); deleted")
            }
        };
        let endpoint = crate::net::host_port(&ip, self.spec.port);
        if endpoint != h.addr {
            bail!("its Pod {name} serves at {endpoint}, not {}", h.addr);
        }
        if self.pods.contains_key(&endpoint) {
            bail!("{endpoint} is this coordinator's own teacher's");
        }
        let within = super::teacher_command::TAKEOVER_READY;
        if !super::teacher_command::ready_within(&endpoint, &self.model_name, &self.access, within) {
            self.delete(&api, &name);
            bail!("its Pod {name} does not answer ready at {endpoint}; deleted");
        }
        let registered = self.registry.as_ref().map(|r| r.hold(&endpoint)).transpose()?;
        self.pods.insert(endpoint.clone(), KubeTeacher { id: h.id, name, registered });
        self.next = self.next.max(h.id + 1);
        self.note_handles();
        Ok(endpoint)
    }
}

impl KubeTeachers {
    /// The coordinator was deposed: Pods that outlive it are the new
    /// leader's, and are let go (not deleted, not deregistered).
    pub fn release(&mut self) {
        if self.lasting() {
            for (_, mut t) in std::mem::take(&mut self.pods) {
                drop(t.registered.take());
            }
            self.note_handles();
        }
    }
}

impl Drop for KubeTeachers {
    fn drop(&mut self) {
        // What is left when the job ends goes with it: all taken out of the
        // store at once, one moment for the students, then every Pod deleted.
        let mut pods = std::mem::take(&mut self.pods);
        let mut released = false;
        for t in pods.values_mut() {
            if let Some(mut r) = t.registered.take() {
                r.release();
                released = true;
            }
        }
        if released {
            std::thread::sleep(DRAIN);
        }
        if let Ok((api, _)) = self.api() {
            for t in pods.values() {
                self.delete(&api, &t.name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distill::teacher::{Teacher, TeacherConfig, TeacherService};
    use crate::scalers::{kube_objects::JOB_ANNOTATION, kubernetes::tests::StandIn};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn spec(port: u16) -> KubeTeacherSpec {
        KubeTeacherSpec {
            image: "nvcr.io/nvidia/tritonserver:24.08-py3".into(),
            command: "tritonserver --model-repository=/models --grpc-port={port} --log-info='{job} {id}'"
                .into(),
            port,
            resources: vec![("nvidia.com/gpu".into(), "1".into()), ("memory".into(), "8Gi".into())],
            node_selector: vec![("node.kubernetes.io/instance-type".into(), "g4dn.xlarge".into())],
            namespace: Some("ml".into()),
            ready_within: Duration::from_secs(20),
            ..Default::default()
        }
    }

    #[test]
    fn a_teacher_pod_runs_its_image_on_its_port_with_its_resources_and_node_selector() {
        let s = spec(8001);
        let words = s.words(3, "ctr-job", "ctr-teachers").unwrap();
        assert_eq!(
            words,
            ["tritonserver", "--model-repository=/models", "--grpc-port=8001", "--log-info=ctr-job 3"]
        );
        let pod = teacher_pod(&s, "ctr-job", 3, words.clone(), None);
        // The API's own type, through JSON and back, loses nothing.
        let json = serde_json::to_value(&pod).unwrap();
        assert_eq!(serde_json::to_value(serde_json::from_value::<Pod>(json.clone()).unwrap()).unwrap(), json);
        assert!(pod.metadata.name.as_deref().unwrap().ends_with("-t3"), "{:?}", pod.metadata.name);
        assert_eq!(pod.metadata.labels.as_ref().unwrap()[TEACHER_LABEL], "3");
        assert_eq!(pod.metadata.annotations.as_ref().unwrap()[JOB_ANNOTATION], "ctr-job");
        let p = pod.spec.unwrap();
        assert_eq!(p.restart_policy.as_deref(), Some("Never"));
        assert_eq!(p.node_selector.unwrap()["node.kubernetes.io/instance-type"], "g4dn.xlarge");
        let c = &p.containers[0];
        assert_eq!(c.command.as_ref().unwrap(), &words);
        assert_eq!(c.ports.as_ref().unwrap()[0].container_port, 8001);
        let limits = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
        assert_eq!(limits["nvidia.com/gpu"], Quantity("1".into()));
        assert_eq!(limits["memory"], Quantity("8Gi".into()));
        // A command sh could not split is refused up front.
        let bad = KubeTeacherSpec { command: "serve 'unclosed".into(), ..spec(1) };
        let refused = KubeTeachers::new(bad, ("j", "s"), None, TeacherAccess::default(), "teacher");
        assert!(refused.err().unwrap().to_string().contains("unbalanced quotes"));
    }

    /// A real teacher answering where the stand-in's Pods run (127.0.0.1),
    /// and teachers whose API is the stand-in's.
    fn teachers(api: &StandIn) -> (KubeTeachers, Teacher, tokio::runtime::Runtime) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let model = crate::trainer::model::Mlp::random(&[4, 8, 3], 1);
        let service = {
            let _in = rt.enter();
            TeacherService::new(model, TeacherConfig::default())
        };
        let server = rt.block_on(Teacher::start("127.0.0.1:0".parse().unwrap(), service, None)).unwrap();
        let mut k = KubeTeachers::new(
            spec(server.addr.port()),
            ("ctr", "ctr-teachers"),
            None,
            TeacherAccess::default(),
            "teacher",
        )
        .unwrap();
        k.api = Some((api.pods(&k.rt), None));
        (k, server, rt)
    }

    #[test]
    fn a_teacher_pod_joins_once_it_runs_and_answers_and_is_deleted_when_told_to_go_or_when_it_ends() {
        let api = StandIn::start("");
        let (mut k, server, _rt) = teachers(&api);
        let at = k.start().unwrap();
        assert_eq!(at, format!("127.0.0.1:{}", server.addr.port()));
        let made = api.heard("POST");
        assert_eq!(made.len(), 1);
        assert!(made[0].contains("tritonserver") && made[0].contains("nvidia.com/gpu"), "{made:?}");
        assert!(k.exited().is_empty(), "running");
        // Told to go: its Pod is deleted with a grace period.
        k.stop(&at);
        let deleted = api.heard("DELETE");
        assert_eq!(deleted.len(), 1);
        assert!(
            deleted[0].contains("-t0")
                && deleted[0].contains(&format!("\"gracePeriodSeconds\":{GRACE_SECS}"))
        );
        assert!(k.addrs().is_empty());
        // Another, whose Pod then fails: reported once, and deleted.
        let at = k.start().unwrap();
        *api.phase.lock().unwrap() = "Failed".into();
        k.polled = None;
        let exited = k.exited();
        assert!(matches!(&exited[..], [(a, how)] if *a == at && how.contains("ended: Failed")), "{exited:?}");
        assert_eq!(api.heard("DELETE").len(), 2);
        k.polled = None;
        assert!(k.exited().is_empty(), "reported once");
    }

    #[test]
    fn a_coordinator_that_takes_the_job_over_takes_its_teacher_pods_and_no_other() {
        let api = StandIn::start("");
        let (mut before, server, _rt) = teachers(&api);
        // Owned by the coordinator's own Pod, the teachers go with it: no handle.
        let at = before.start().unwrap();
        assert!(before.handles().lock().unwrap().is_empty());
        before.stop(&at);
        before.spec.owner = Owner::Controller;
        let at = before.start().unwrap();
        let handles = before.handles().lock().unwrap().clone();
        assert_eq!(handles, [TeacherHandle { addr: at.clone(), slot: 0, id: 1 }]);
        // The coordinator is killed: its teacher Pods stay.
        before.pods.clear();
        drop(before);
        let deleted = api.heard("DELETE").len();

        let (mut after, _other, _rt2) = teachers(&api);
        after.spec = KubeTeacherSpec { owner: Owner::Controller, ..spec(server.addr.port()) };
        // Handles that do not name this job's Pod for that teacher, at its address, are refused.
        let wrong_id = TeacherHandle { id: 4, ..handles[0].clone() };
        let e = format!("{:#}", after.adopt(&wrong_id).unwrap_err());
        assert!(e.contains("-t4 is gone"), "{e}");
        let elsewhere = TeacherHandle { addr: "127.0.0.1:9".into(), ..handles[0].clone() };
        let e = format!("{:#}", after.adopt(&elsewhere).unwrap_err());
        assert!(e.contains("serves at") && e.contains("not 127.0.0.1:9"), "{e}");
        let mut stranger = teachers(&api).0;
        stranger.job = "another".into();
        let e = format!("{:#}", stranger.adopt(&handles[0]).unwrap_err());
        assert!(e.contains("is gone"), "another job's Pod is not looked for: {e}");
        stranger.pods.clear();
        // Its own: taken over, serving, with its handle, and its to stop.
        assert_eq!(after.adopt(&handles[0]).unwrap(), at);
        assert_eq!(after.addrs(), std::slice::from_ref(&at));
        assert_eq!(*after.handles().lock().unwrap(), handles);
        assert!(after.adopt(&handles[0]).is_err(), "taken once");
        assert_eq!(api.heard("DELETE").len(), deleted, "nothing deleted on the way");
        after.stop(&at);
        let heard = api.heard("DELETE");
        assert_eq!(heard.len(), deleted + 1);
        assert!(heard.last().unwrap().contains("-t1"), "{heard:?}");
        // A teacher numbered after it gets the next number.
        assert_eq!(after.next, 2);
    }

    #[test]
    fn a_teacher_pod_that_ends_before_it_answers_is_deleted_and_named() {
        let api = StandIn::start("");
        let (mut k, _server, _rt) = teachers(&api);
        *api.phase.lock().unwrap() = "Failed".into();
        let e = format!("{:#}", k.start().unwrap_err());
        assert!(e.contains("teacher 0 (Pod") && e.contains("its Pod ended: Failed"), "{e}");
        assert_eq!(api.heard("DELETE").len(), 1);
        assert!(k.addrs().is_empty());
    }
}
