//! The pieces every Pod (and Service) of a job is made of, whatever it
//! runs (a worker, a relay, a teacher, a parameter server): its name, its
//! labels and the annotation that names the job exactly, its owner, and the
//! job's secret mounted from a Kubernetes Secret.

use k8s_openapi::{
    api::core::v1::{SecretVolumeSource, Volume, VolumeMount},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
};
use std::{collections::BTreeMap, time::Duration};

/// Where the secret is mounted in a worker's Pod.
const SECRET_DIR: &str = "/run/edl";
/// The label every worker Pod of a job carries (its value: the job).
pub(crate) const JOB_LABEL: &str = "edl.dev/job";
/// The annotation that names a worker Pod's job exactly (the label may be
/// cut short): a Pod is deleted or taken over only where it matches.
pub(crate) const JOB_ANNOTATION: &str = "edl.dev/job-name";
/// The longest Pod name: a DNS label.
const NAME_MAX: usize = 63;

/// Which object owns the worker Pods.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Owner {
    /// The coordinator's Pod: the workers go with it.
    #[default]
    Pod,
    /// The coordinator Pod's controller (its ReplicaSet): the workers
    /// outlive one coordinator Pod, for a standby to take them over.
    Controller,
}

/// How worker Pods are made.
#[derive(Clone, Debug, Default)]
pub struct KubeOptions {
    /// The namespace (default: the coordinator's own, else `default`).
    pub namespace: Option<String>,
    pub image: String,
    /// The Kubernetes Secret holding the job's secret under the key `secret`.
    pub secret: String,
    /// GPUs each worker asks for (`nvidia.com/gpu`), if any.
    pub gpus: Option<u32>,
    pub owner: Owner,
    /// A Pod not running after this long is deleted and reported.
    pub pending_bound: Duration,
    /// The coordinator's own Pod's name (`$POD_NAME` from the downward API,
    /// else the host name Kubernetes gives a Pod).
    pub pod_name: Option<String>,
}

/// The metadata of a Pod `name` of `job`: labelled with edl, the job and
/// its role (`role`: the label and the worker's or teacher's number),
/// annotated with the job's exact name, owned by `owner`.
pub(crate) fn job_pod_meta(
    job: &str,
    name: String,
    namespace: Option<String>,
    (role, id): (&str, u64),
    owner: Option<OwnerReference>,
) -> ObjectMeta {
    let labels = BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "edl".to_string()),
        (JOB_LABEL.to_string(), job_label(job)),
        (role.to_string(), id.to_string()),
    ]);
    ObjectMeta {
        name: Some(name),
        namespace,
        labels: Some(labels),
        annotations: Some(BTreeMap::from([(JOB_ANNOTATION.to_string(), job.to_string())])),
        owner_references: owner.map(|o| vec![o]),
        ..Default::default()
    }
}

/// Where a Pod's container finds the job's secret (read-only).
pub(crate) fn secret_mount() -> VolumeMount {
    VolumeMount {
        name: "edl-secret".into(),
        mount_path: SECRET_DIR.into(),
        read_only: Some(true),
        ..Default::default()
    }
}

/// The volume of the Kubernetes Secret `secret`, readable by its owner only.
pub(crate) fn secret_volume(secret: &str) -> Volume {
    Volume {
        name: "edl-secret".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.to_string()),
            default_mode: Some(0o400),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The file a Pod's container reads the job's secret from.
pub(crate) fn secret_path() -> String {
    format!("{SECRET_DIR}/secret")
}

/// The job's name as a label value (at most 63 characters, ending with a
/// letter or digit; job names start with one). Two jobs whose names differ
/// past that share the label, and each still finds its Pods by name.
pub(crate) fn job_label(job: &str) -> String {
    let head: String = job.chars().take(63).collect();
    head.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()).to_string()
}

/// A short hash of the exact job name (8 hex digits of its SHA-256): it
/// tells apart jobs whose names make the same DNS label.
pub(crate) fn job_hash(job: &str) -> String {
    use sha2::Digest;
    hex::encode(&sha2::Sha256::digest(job.as_bytes())[..4])
}

/// The name of `job`'s Pod `<kind><id>` (`w`: a worker, `t`: a teacher),
/// made as [`crate::scalers::kubernetes`]'s worker Pods are named.
pub(crate) fn pod_name_of(job: &str, kind: char, id: u64) -> String {
    let tail = format!("{}-{kind}{id}", job_hash(job));
    // At most 30 characters of tail (a u64 has 20 digits): 28 are left.
    let room = NAME_MAX - "edl-".len() - "-".len() - tail.len();
    let clean: String = job
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
        .take(room)
        .collect();
    match clean.trim_matches('-') {
        "" => format!("edl-{tail}"),
        head => format!("edl-{head}-{tail}"),
    }
}

/// Whether a Pod, as the API shows it, is one of job `job`'s: its job
/// label and its job annotation both name it. `Err` says why not (a Pod of
/// another job, or one edl did not make, that happens to bear the name).
pub fn of_job(meta: &ObjectMeta, job: &str) -> Result<(), String> {
    let label = meta.labels.as_ref().and_then(|l| l.get(JOB_LABEL));
    if label.map(String::as_str) != Some(job_label(job).as_str()) {
        return Err(format!("its label {JOB_LABEL} is {label:?}, not that of job {job:?}"));
    }
    let named = meta.annotations.as_ref().and_then(|a| a.get(JOB_ANNOTATION));
    if named.map(String::as_str) != Some(job) {
        return Err(format!("its annotation {JOB_ANNOTATION} is {named:?}, not {job:?}"));
    }
    Ok(())
}
