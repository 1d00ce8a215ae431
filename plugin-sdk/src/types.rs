//! The Rust form of the `edl:plugins/types` WIT interface (and of the
//! teacher policy's own records).
//!
//! The guest bindings are generated against these very types (wit-bindgen's
//! `with` remapping), so a plugin works with plain Rust values and nothing is
//! converted at the boundary. The teacher policy's records are declared in
//! its own exported interface, which wit-bindgen cannot remap, so
//! `export_teacher_policy!` copies them field by field (a few numbers and the
//! teacher list per decision). Field names and order follow the WIT file; the
//! `#[repr(C)]` types are also the native (`.so`) ABI's.

use serde::{Deserialize, Serialize};
use std::fmt;

/// What a plugin says about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub description: String,
}

/// An error a plugin expects and reports itself (a WIT `result` error, not a trap).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PluginError {
    /// `init` rejected a configuration key or value.
    InvalidConfig(String),
    /// The input is not something the plugin can handle.
    InvalidInput(String),
    /// Anything else.
    Failed(String),
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginError::InvalidConfig(m) => write!(f, "invalid config: {m}"),
            PluginError::InvalidInput(m) => write!(f, "invalid input: {m}"),
            PluginError::Failed(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for PluginError {}

/// Measured throughput of one worker over the last window.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerStats {
    pub id: u64,
    /// Samples per second.
    pub throughput: f64,
}

/// What a scaling policy sees at each decision.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterView {
    pub step: u64,
    pub epoch: u32,
    pub world_size: u32,
    pub min_workers: u32,
    pub max_workers: u32,
    /// Devices the cluster could give the job right now.
    pub free_slots: u32,
    pub global_batch: u32,
    /// Whole-job samples per second over the last window.
    pub throughput: f64,
    pub workers: Vec<WorkerStats>,
    /// Seconds since the last change of world size.
    pub secs_since_change: f64,
    pub price_per_worker_hour: f64,
    /// Samples left to train on in the whole job.
    pub samples_remaining: u64,
}

/// What a scaling policy asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    Hold,
    ScaleOut(u32),
    ScaleIn(u32),
    /// Start a replacement worker first, then remove this one.
    Replace(u64),
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Hold => write!(f, "hold"),
            Action::ScaleOut(n) => write!(f, "scale-out({n})"),
            Action::ScaleIn(n) => write!(f, "scale-in({n})"),
            Action::Replace(id) => write!(f, "replace({id})"),
        }
    }
}

/// Optimiser and batch settings that a batch adapter controls.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct Hyperparams {
    pub global_batch: u32,
    pub local_batch: u32,
    pub lr: f32,
    pub momentum: f32,
}

/// A change of world size, applied at `step`. `old_world_size` is the world
/// the hyperparameters in force were set for: 0 when the job starts (they
/// are then the job's own); when it starts again from a checkpoint, the
/// world that checkpoint's hyperparameters were set for (0 where the
/// checkpoint does not say).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResizeEvent {
    pub step: u64,
    pub old_world_size: u32,
    pub new_world_size: u32,
}

/// Element type of a batch's data buffer.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    Uint8 = 0,
    Float32 = 1,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Uint8 => 1,
            Dtype::Float32 => 4,
        }
    }

    /// Decodes the WIT discriminant (used by the generated guest bindings).
    ///
    /// # Safety
    /// Never unsafe in practice: an unknown value panics. The signature is the
    /// one wit-bindgen expects of a remapped enum.
    #[doc(hidden)]
    pub unsafe fn _lift(val: u8) -> Dtype {
        Dtype::from_u8(val).expect("invalid dtype discriminant")
    }

    /// The dtype with this discriminant, if any.
    pub fn from_u8(val: u8) -> Option<Dtype> {
        match val {
            0 => Some(Dtype::Uint8),
            1 => Some(Dtype::Float32),
            _ => None,
        }
    }
}

/// A columnar batch: one flat row-major buffer holds every sample.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct Batch {
    /// Little-endian elements of `dtype`; `shape` row-major, `shape[0]` samples.
    pub data: Vec<u8>,
    pub shape: Vec<u32>,
    pub dtype: Dtype,
    pub labels: Vec<u32>,
    pub ids: Vec<u64>,
    /// Seed for any randomness, so a transform is reproducible.
    pub seed: u64,
}

impl Batch {
    /// Number of samples (`shape[0]`, or 0 for an empty shape).
    pub fn len(&self) -> usize {
        self.shape.first().copied().unwrap_or(0) as usize
    }

    /// True when the batch holds no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements per sample (product of `shape[1..]`).
    pub fn sample_elems(&self) -> usize {
        self.shape.iter().skip(1).map(|&d| d as usize).product()
    }

    /// Checks that the buffer, labels and ids agree with the shape and dtype.
    pub fn validate(&self) -> Result<(), PluginError> {
        let n = self.len();
        let want = n * self.sample_elems() * self.dtype.size();
        if self.shape.is_empty() {
            return Err(PluginError::InvalidInput("batch has an empty shape".into()));
        }
        if self.data.len() != want {
            return Err(PluginError::InvalidInput(format!(
                "batch data has {} bytes, shape {:?} of {:?} needs {want}",
                self.data.len(),
                self.shape,
                self.dtype
            )));
        }
        if self.labels.len() != n || self.ids.len() != n {
            return Err(PluginError::InvalidInput(format!(
                "batch of {n} samples has {} labels and {} ids",
                self.labels.len(),
                self.ids.len()
            )));
        }
        Ok(())
    }

    /// The data as f32 values (copies; `None` unless dtype is float32).
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        (self.dtype == Dtype::Float32).then(|| {
            self.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        })
    }
}

/// One teacher of the pool over the last window, from its own statistics
/// (KServe v2's statistics extension, as Triton reports it).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TeacherStats {
    pub id: u64,
    /// Share of the window its model was computing (0 to 1).
    pub utilisation: f64,
    /// Requests waiting in its queue, on average over the window.
    pub queue_depth: f64,
    /// Rows of soft labels answered per second.
    pub rows_per_sec: f64,
    /// Mean time a request took, queue included, ms.
    pub latency_ms: f64,
    /// Mean time a request waited in its queue, ms.
    pub queue_ms: f64,
    /// Requests that failed in the window.
    pub errors: u64,
    /// Median and 99th percentile of the time the students' requests to it
    /// took over the window, as the students measured them (network and
    /// queue included), ms; 0 where none was answered.
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// What a teacher policy sees at each decision.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TeacherView {
    pub step: u64,
    /// Share of the students' step time spent waiting for soft labels (0 to 1).
    pub wait_share: f64,
    /// The students' samples per second over the window.
    pub student_throughput: f64,
    /// Students now.
    pub student_world_size: u32,
    /// Students the scaling policy last asked for (`student_world_size` when
    /// no change is planned).
    pub student_world_planned: u32,
    /// Teachers serving now (with `teachers`' statistics).
    pub teacher_count: u32,
    pub min_teachers: u32,
    pub max_teachers: u32,
    /// Requests each student keeps in flight at each teacher now.
    pub in_flight_per_teacher: u32,
    pub teachers: Vec<TeacherStats>,
    /// Seconds since the pool last changed size.
    pub secs_since_change: f64,
    pub price_per_teacher_hour: f64,
}

impl TeacherView {
    /// Mean utilisation of the teachers with statistics (0 when none has any).
    pub fn mean_utilisation(&self) -> f64 {
        if self.teachers.is_empty() {
            return 0.0;
        }
        self.teachers.iter().map(|t| t.utilisation).sum::<f64>() / self.teachers.len() as f64
    }
}

/// What a teacher policy asks for: the pool's size and the requests each
/// student keeps in flight at each teacher. The host clamps `teachers` to
/// the view's bounds and `in_flight_per_teacher` to 1..=64.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct TeacherPlan {
    pub teachers: u32,
    pub in_flight_per_teacher: u32,
}

impl TeacherPlan {
    /// The plan that changes nothing in `view`.
    pub fn keep(view: &TeacherView) -> Self {
        TeacherPlan { teachers: view.teacher_count, in_flight_per_teacher: view.in_flight_per_teacher }
    }
}

/// The mean time of a committed step at one world size and global batch.
#[derive(Clone, Copy, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct StepTime {
    pub world_size: u32,
    pub global_batch: u32,
    pub secs: f64,
    /// Steps the mean is over.
    pub steps: u32,
}

/// What the host measured of the training, told to a batch adapter after
/// each decision of the scaling policy ([`crate::BatchAdapter::on_training`]).
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainingStats {
    pub step: u64,
    pub world_size: u32,
    /// The gradient noise scale (smoothed); 0 until two ranks measured a step.
    pub noise_scale: f64,
    /// The job's own global batch and learning rate (`--batch`, `--lr`).
    pub base_batch: u32,
    pub base_lr: f32,
    /// The largest global batch the adapter may ask for (`--batch-max`).
    pub max_batch: u32,
    /// Committed samples per second over the last window.
    pub throughput: f64,
    pub step_times: Vec<StepTime>,
}

/// One parameter server as a scaling policy that sizes them sees it
/// ([`crate::ScalingPolicy::decide_servers`]).
#[repr(C)]
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerStats {
    pub id: u64,
    /// Rows of every table it holds (as a shard's owner or replica), and their bytes.
    pub rows: u64,
    pub bytes: u64,
    /// Bytes besides the rows (undo records, staged pushes); the memory
    /// bound counts them with the rows.
    pub working_bytes: u64,
    /// Its memory bound, bytes (0: none).
    pub bound_bytes: u64,
    /// Pulls and pushes it answered per second since the job's look before.
    pub requests_per_sec: f64,
    /// New rows it refused at its bound, all told.
    pub refused: u64,
}

/// What a scaling policy that sizes the parameter servers sees.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerView {
    pub step: u64,
    pub servers: Vec<ServerStats>,
    /// The bounds of the servers' number (`--min-ps`, `--max-ps`).
    pub min_servers: u32,
    pub max_servers: u32,
    /// Servers holding each shard (`--ps-replicas`).
    pub replicas: u32,
    /// Seconds since the servers last changed.
    pub secs_since_change: f64,
}

/// What a scaling policy that sizes the warm spares sees
/// ([`crate::ScalingPolicy::decide_spares`]). Plain data, passed as it is
/// through the native C ABI: a field added changes that ABI.
#[repr(C)]
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct SpareView {
    pub step: u64,
    pub world_size: u32,
    pub min_workers: u32,
    pub max_workers: u32,
    /// Spares the job keeps now (`--warm-spares` until the policy answers otherwise).
    pub spares_wanted: u32,
    /// Spares ready to join now, and those still starting or loading the job.
    pub spares_ready: u32,
    pub spares_starting: u32,
    /// What a spare costs an hour: a worker's price (`--price`).
    pub price_per_spare_hour: f64,
    /// Hours of spares the job has held so far; times the price, what they cost.
    pub spare_hours: f64,
    /// Growths and lost members' places a spare took, and those for which
    /// a worker had to be started (no spare was there), all told.
    pub from_spares: u64,
    pub started_cold: u64,
    /// Members lost with a failed generation or told to go by their
    /// scheduler, all told (not those the policy or the job stopped).
    pub members_lost: u64,
    /// Mean seconds a worker took from its start to ready; 0 until one was.
    pub ready_secs: f64,
    /// Hours the job has trained (since its first generation formed).
    pub hours: f64,
    /// Seconds since the spares wanted last changed.
    pub secs_since_change: f64,
}
