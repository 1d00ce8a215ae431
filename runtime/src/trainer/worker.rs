//! The built-in worker: the MLP student on a shipped data set, one process
//! per device, driving a [`Session`]. Each step reads this rank's samples
//! (soft labels from the teachers through the DistillReader, fed the
//! planned steps' samples ahead), computes the gradient, sums it over the
//! generation's ring and applies it. Its state for the session is the
//! parameters and the momentum buffer, as named tensors.

use crate::control::proto::FailCause;
use crate::distill::{DistillConfig, DistillError, DistillReader, Teachers};
use crate::job::spec::{BuiltinModel, Program, TeacherSource};
use crate::plugin::{HostOptions, Limits, PluginHost, TransformPlugin};
use crate::trainer::builtin::MlpState;
pub use crate::trainer::builtin::{load_data, mlp_layout, mlp_of};
use crate::trainer::data::Dataset;
use crate::trainer::model::Mlp;
use crate::trainer::train::Trainer;
use crate::worker::session::{Event, Joined, Session, Step};
use anyhow::{Context, Result, anyhow, bail};
use edl_host_gpu::{Device, loss::SoftLabelLoss};
use edl_plugin_sdk::{Batch, Dtype};
use std::{
    collections::VecDeque,
    net::SocketAddr,
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

fn batch_of(train: &Dataset, ids: &[u32], seed: u64, epoch: u64) -> Batch {
    let (x, y) = train.gather(ids);
    Batch {
        data: crate::distill::oip::f32_bytes(&x),
        shape: vec![ids.len() as u32, train.dim as u32],
        dtype: Dtype::Float32,
        labels: y,
        ids: ids.iter().map(|&i| i as u64).collect(),
        seed: seed ^ epoch.wrapping_mul(0x9E37_79B9),
    }
}

fn features_of(b: &Batch) -> Result<Vec<f32>> {
    if b.dtype != Dtype::Float32 {
        bail!("the reader transform returned {:?} data; the trainer takes float32", b.dtype);
    }
    Ok(b.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// A rank's features, labels and (when distilling) teacher logits.
type Rows = (Vec<f32>, Vec<u32>, Option<Vec<f32>>);

/// What a step of this rank reads, identified for the read-ahead.
type Key = (u64, u64);

/// Reads the samples of planned steps ahead: the plain path gathers rows
/// on a thread of its own; distillation feeds them to the DistillReader.
/// Results come in the order the steps were fed; a new generation (or a
/// failure) starts a new read-ahead.
struct ReadAhead {
    feed: mpsc::Sender<(Vec<u32>, u64)>,
    /// Steps fed and not taken yet, in order.
    fed: VecDeque<Key>,
    source: Ahead,
    /// How long the last step taken waited for its soft labels.
    waited: Duration,
}

enum Ahead {
    Rows(mpsc::Receiver<(Vec<f32>, Vec<u32>)>),
    Teachers(DistillReader),
    /// The rows, and the teacher computed here on the step's path.
    InProcess {
        rows: mpsc::Receiver<(Vec<f32>, Vec<u32>)>,
        teacher: Box<Mlp>,
        row_us: u64,
    },
}

/// Batches gathered ahead at most on the plain path.
const LOAD_AHEAD: usize = 4;

impl ReadAhead {
    fn rows(train: Arc<Dataset>) -> Result<Self> {
        let (feed, asks) = mpsc::channel::<(Vec<u32>, u64)>();
        let (done, ready) = mpsc::sync_channel(LOAD_AHEAD);
        std::thread::Builder::new().name("edl-loader".into()).spawn(move || {
            for (ids, _) in asks {
                if done.send(train.gather(&ids)).is_err() {
                    return;
                }
            }
        })?;
        Ok(ReadAhead { feed, fed: VecDeque::new(), source: Ahead::Rows(ready), waited: Duration::ZERO })
    }

    /// The plain path, and the teacher computed here on each step's rows
    /// as the step takes them (with an accelerator emulated as a teacher
    /// service emulates it: `row_us` more a row).
    fn in_process(train: Arc<Dataset>, model: &std::path::Path, row_us: u64) -> Result<Self> {
        let teacher = Mlp::load(model).with_context(|| format!("the teacher model {}", model.display()))?;
        let mut r = Self::rows(train)?;
        let Ahead::Rows(rows) = std::mem::replace(&mut r.source, Ahead::Rows(mpsc::sync_channel(0).1)) else {
            unreachable!("the plain path reads rows")
        };
        r.source = Ahead::InProcess { rows, teacher: Box::new(teacher), row_us };
        Ok(r)
    }

    fn teachers(
        w: &BuiltinWorker,
        teachers: Teachers,
        transform: Option<Box<dyn TransformPlugin>>,
        config: DistillConfig,
    ) -> Self {
        let (feed, asks) = mpsc::channel::<(Vec<u32>, u64)>();
        let (train, seed) = (w.train.clone(), w.seed);
        let batches =
            std::iter::from_fn(move || asks.recv().ok().map(|(ids, e)| batch_of(&train, &ids, seed, e)));
        let _guard = w.rt.enter();
        let reader = DistillReader::start(batches, transform, teachers, config);
        ReadAhead { feed, fed: VecDeque::new(), source: Ahead::Teachers(reader), waited: Duration::ZERO }
    }

    /// Feeds a step's samples (unless fed already).
    fn feed(&mut self, s: &Step) {
        if let Ahead::Teachers(reader) = &self.source {
            // This student's share of the teachers follows its place.
            reader.place(s.rank, s.world);
        }
        let key = (s.generation, s.step);
        if s.indices.is_empty() || self.fed.back().is_some_and(|&b| b >= key) {
            return;
        }
        if self.feed.send((s.indices.clone(), s.epoch)).is_ok() {
            self.fed.push_back(key);
        }
    }

    /// The rows of step `key`: fed before, and the next in order.
    fn take(&mut self, key: Key, indices: &[u32], rt: &tokio::runtime::Runtime) -> Result<Rows> {
        if self.fed.pop_front() != Some(key) {
            bail!("the read-ahead is not at step {} of generation {}", key.1, key.0);
        }
        match &mut self.source {
            Ahead::Rows(ready) => {
                let (x, y) = ready.recv().map_err(|_| anyhow!("the loader thread ended"))?;
                Ok((x, y, None))
            }
            Ahead::InProcess { rows, teacher, row_us } => {
                let (x, y) = rows.recv().map_err(|_| anyhow!("the loader thread ended"))?;
                let asked = Instant::now();
                let soft = teacher.forward(&x, y.len());
                // The accelerator the student shares with its teacher is busy that long.
                std::thread::sleep(Duration::from_micros(row_us.saturating_mul(y.len() as u64)));
                self.waited = asked.elapsed();
                Ok((x, y, Some(soft)))
            }
            Ahead::Teachers(reader) => {
                let asked = Instant::now();
                let got = rt
                    .block_on(async { tokio::time::timeout(Duration::from_secs(120), reader.next()).await });
                self.waited = asked.elapsed();
                let got = got
                    .map_err(|_| anyhow!("no soft labels within 120 s"))?
                    .ok_or_else(|| anyhow!("the distill reader ended early"))?
                    .context("distill reader")?;
                let mut got_ids = got.batch.ids.clone();
                let mut want: Vec<u64> = indices.iter().map(|&i| i as u64).collect();
                got_ids.sort_unstable();
                want.sort_unstable();
                if got_ids != want {
                    bail!("the distill reader returned other samples than step {}'s", key.1);
                }
                Ok((features_of(&got.batch)?, got.batch.labels, Some(got.soft)))
            }
        }
    }
}

/// The built-in worker's parts besides its session and state.
struct BuiltinWorker {
    id: u64,
    seed: u64,
    model: BuiltinModel,
    teachers: Option<TeacherSource>,
    /// Opens the registrations of teachers found in the store.
    registrations: crate::leader::seal::RecordKey,
    teacher_model_name: String,
    teacher_wait: Duration,
    step_delay: Duration,
    train: Arc<Dataset>,
    loss: SoftLabelLoss,
    read_ahead: Option<ReadAhead>,
    /// What the step being computed waited for its soft labels, ms.
    waited_ms: f64,
    /// The reader transform applied by the worker itself (no teachers).
    transform: Option<Box<dyn TransformPlugin>>,
    /// The transform's copy here, and the name the user gave it.
    transform_path: Option<(std::path::PathBuf, String)>,
    transform_config: Vec<(String, String)>,
    /// The teachers' token and TLS trust, and the tensors read and sent.
    access: crate::distill::TeacherAccess,
    io: crate::distill::TeacherIo,
    calls: crate::distill::TeacherCalls,
    host: Option<Arc<PluginHost>>,
    rt: tokio::runtime::Runtime,
}

/// How a built-in worker joins its job.
pub struct Join {
    /// The coordinator's control port.
    pub coordinator: SocketAddr,
    /// 0: the coordinator gives one.
    pub id: u64,
    pub auth: crate::worker::session::JobAuth,
    /// Where the ring listens (None: the address the control connection
    /// leaves from) and what the other ranks are told (None: the same).
    pub ring_listen: Option<std::net::IpAddr>,
    pub ring_advertise: Option<std::net::IpAddr>,
}

/// Runs one built-in worker until the coordinator stops it.
pub fn run(join: Join) -> Result<()> {
    let id = join.id;
    let mut session = match Session::join(join.coordinator, id, join.auth)? {
        Joined::Welcome(s) => s,
        Joined::NotNeeded(reason) => {
            tracing::info!("worker {id}: not needed: {reason}");
            return Ok(());
        }
    };
    if let Some(bind) = join.ring_listen {
        session.set_ring_address(bind, join.ring_advertise);
    } else if let Some(ip) = join.ring_advertise {
        session.set_ring_address(std::net::IpAddr::from([0u8; 4]), Some(ip));
    }
    // A worker that joined without an id has one now.
    let id = session.id();
    let spec = session.spec().clone();
    let Program::Builtin(model) = spec.program.clone() else {
        bail!(
            "worker {id}: this job runs its own program (`edl-runtime launch`); its workers are not built in"
        )
    };
    let (train, _) = load_data(&model)?;
    if train.len() != spec.samples {
        bail!("worker {id}: {} training samples here, the job has {}", train.len(), spec.samples);
    }
    if model.dataset == "ctr" {
        return crate::trainer::ctr::run(&mut session, &model, train);
    }
    let device: Device = spec.device.parse().map_err(|e: String| anyhow!("worker {id}: {e}"))?;
    let (host, transform_path, transform) = transform_of(id, &spec)?;
    let trainer =
        Trainer::on(device, Mlp::random(&model.layers, spec.seed)).with_context(|| format!("worker {id}"))?;
    let mut state = MlpState::new(trainer, mlp_layout(&model.layers));
    let mut w = BuiltinWorker {
        id,
        seed: spec.seed,
        teachers: spec.teachers.clone(),
        registrations: crate::leader::seal::RecordKey::teacher_registrations(&session.auth().secret),
        teacher_model_name: spec.teacher_model_name.clone(),
        teacher_wait: Duration::from_millis(spec.teacher_wait_ms),
        step_delay: Duration::from_millis(spec.step_delay_ms),
        train: Arc::new(train),
        loss: SoftLabelLoss { temperature: spec.temperature, alpha: spec.alpha },
        read_ahead: None,
        waited_ms: 0.0,
        transform,
        transform_path,
        transform_config: spec.transform_config.clone(),
        access: spec.teacher_access.clone(),
        io: spec.teacher_io.clone(),
        calls: spec.teacher_calls.clone(),
        host,
        model,
        rt: tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?,
    };
    session.ready(state.layout.clone(), None)?;
    tracing::info!("worker {id}: ready, {} training samples", w.train.len());
    w.train_until_stopped(&mut session, &mut state)
}

/// The plugin host a worker loads its reader transform with, the
/// transform's copy here (and the name the user gave it), and the transform
/// itself when the worker applies it (without teachers; with them the
/// DistillReader does).
#[allow(clippy::type_complexity)]
fn transform_of(
    id: u64,
    spec: &crate::job::JobSpec,
) -> Result<(Option<Arc<PluginHost>>, Option<(std::path::PathBuf, String)>, Option<Box<dyn TransformPlugin>>)>
{
    let host = match &spec.transform {
        Some(_) => Some(PluginHost::new(HostOptions {
            limits: Limits {
                deadline: Duration::from_millis(spec.plugin_deadline_ms),
                memory_bytes: spec.plugin_memory_mib << 20,
                ..Limits::default()
            },
            allow_native: spec.allow_native,
            ..HostOptions::default()
        })?),
        None => None,
    };
    // The coordinator sent the plugin's bytes: written once per content,
    // beside this user's compiled-plugin cache (or in the job's directory).
    let transform_path = match &spec.transform {
        Some(shipped) => {
            // Loaded from this copy, named as the user named the file.
            let cache = crate::plugin::ArtifactCache::default_location();
            let dir = match cache.dir() {
                Some(d) => d.join("shipped"),
                None => std::env::temp_dir().join(format!("edl-shipped-plugins-{}", std::process::id())),
            };
            let copy = shipped.unpack(&dir).with_context(|| format!("worker {id}: the reader transform"))?;
            Some((copy, shipped.name.clone()))
        }
        None => None,
    };
    let transform = match (&transform_path, &host, &spec.teachers) {
        // Without teachers the worker applies the transform itself.
        (Some((path, shown)), Some(h), None) => {
            Some(h.load_transform_as(path, shown, &spec.transform_config)?)
        }
        _ => None,
    };
    Ok((host, transform_path, transform))
}

/// Steps between those a worker alone (on the CPU) computes in two parts
/// for the gradient noise scale: on the development machine, the student's
/// step at batch 64 costs 65% more in two parts (an eighth more for a
/// 784-1024-1024-10 network at 512), about 16% over every four steps.
const PARTS_EVERY: u64 = 4;

impl BuiltinWorker {
    /// Trains the steps the coordinator plans until it says stop. A step
    /// that fails is reported and redone by the next generation.
    fn train_until_stopped(&mut self, session: &mut Session, state: &mut MlpState) -> Result<()> {
        let id = self.id;
        loop {
            let step = match session.next(state)? {
                Event::Stop(reason) => {
                    tracing::info!("worker {id}: {reason}");
                    return Ok(());
                }
                Event::Step(s) => s,
            };
            let start = Instant::now();
            let loss = match self.compute(session, &step, &mut state.trainer) {
                Ok(l) => l,
                Err(e) => {
                    self.read_ahead = None;
                    let cause = e
                        .chain()
                        .any(|c| matches!(c.downcast_ref(), Some(DistillError::NoTeachers { .. })))
                        .then_some(FailCause::NoTeachers);
                    session.fail(e, cause)?;
                    continue;
                }
            };
            let compute_ms = start.elapsed().as_secs_f64() * 1e3;
            // The coordinator sent the next window while this step computed
            // (at the step's start it was often not here yet): asking the
            // teachers for its soft labels now hides their latency behind
            // the all-reduce and the next step's start.
            session.take_in_windows();
            if let Some(r) = self.read_ahead.as_mut() {
                session.planned().for_each(|s| r.feed(s));
            }
            session.waited_for_teachers(std::mem::take(&mut self.waited_ms));
            if let Some(ReadAhead { source: Ahead::Teachers(reader), .. }) = &self.read_ahead {
                session.called_teachers(reader.take_calls());
            }
            if session.all_reduce(state.trainer.grad_mut()).is_err() {
                // Reported by the session; the next step is the redone one.
                self.read_ahead = None;
                continue;
            }
            if let Err(e) = state.trainer.apply(step.hyper.lr, step.hyper.momentum) {
                session.fail(e.into(), None)?;
                continue;
            }
            session.finish(loss, compute_ms)?;
        }
    }

    /// This rank's gradient of the step (zero without samples), and its
    /// loss summed and divided by the step's global rows.
    fn compute(&mut self, session: &mut Session, step: &Step, trainer: &mut Trainer) -> Result<f64> {
        let mut loss = 0.0;
        self.waited_ms = 0.0;
        if !step.indices.is_empty() {
            let (x, y, soft) = self.read(session, step)?;
            if let Some(r) = &self.read_ahead {
                self.waited_ms = r.waited.as_secs_f64() * 1e3;
            }
            // Alone, the rank's batch in two parts every few steps: the
            // gradient noise scale compares them where there are no other
            // ranks to compare (two smaller products cost more than one).
            let alone = step.world == 1 && trainer.device() == Device::Cpu;
            let summed = if alone && step.step.is_multiple_of(PARTS_EVERY) {
                let (summed, parts) = trainer.compute_gradient_in_parts(
                    &x,
                    &y,
                    soft.as_deref(),
                    &self.loss,
                    step.global_rows,
                )?;
                session.gradient_parts(parts);
                summed
            } else {
                trainer.compute_gradient(&x, &y, soft.as_deref(), &self.loss, step.global_rows)?
            };
            loss = summed / step.global_rows as f64;
        } else {
            trainer.grad_mut().iter_mut().for_each(|g| *g = 0.0);
        }
        if !self.step_delay.is_zero() {
            std::thread::sleep(self.step_delay);
        }
        Ok(loss)
    }

    /// This rank's batch: soft labels from the teachers when distilling.
    fn read(&mut self, session: &Session, step: &Step) -> Result<Rows> {
        if self.teachers.is_none()
            && let Some(t) = self.transform.as_mut()
        {
            let b = t
                .apply(&batch_of(&self.train, &step.indices, self.seed, step.epoch))
                .context("reader transform")?;
            return Ok((features_of(&b)?, b.labels, None));
        }
        let key = (step.generation, step.step);
        if self.read_ahead.as_ref().is_some_and(|r| r.fed.front().is_some_and(|&f| f.0 != key.0 || f > key)) {
            self.read_ahead = None;
        }
        if self.read_ahead.is_none() {
            self.read_ahead = Some(self.start_read_ahead()?);
        }
        let r = self.read_ahead.as_mut().expect("started above");
        r.feed(step);
        for s in session.planned() {
            r.feed(s);
        }
        let rows = r.take(key, &step.indices, &self.rt)?;
        if rows.1.len() != step.indices.len() {
            bail!("the read-ahead gave {} rows for a share of {}", rows.1.len(), step.indices.len());
        }
        Ok(rows)
    }

    fn start_read_ahead(&mut self) -> Result<ReadAhead> {
        let Some(source) = self.teachers.clone() else { return ReadAhead::rows(self.train.clone()) };
        let teachers = match source {
            TeacherSource::InProcess { model, emulate_row_us } => {
                return ReadAhead::in_process(self.train.clone(), &model, emulate_row_us);
            }
            TeacherSource::Fixed(list) => Teachers::Fixed(list),
            TeacherSource::Discovered { store, service } => {
                let _guard = self.rt.enter();
                let store = Arc::new(crate::store::AnyStore::open(&store)?);
                Teachers::Discovered { store, service, key: self.registrations.clone() }
            }
        };
        let transform = match (&self.transform_path, &self.host) {
            (Some((path, shown)), Some(h)) => {
                Some(h.load_transform_as(path, shown, &self.transform_config)?)
            }
            _ => None,
        };
        let config = self.calls.apply(DistillConfig {
            model_name: self.teacher_model_name.clone(),
            classes: Some(*self.model.layers.last().unwrap_or(&10)),
            read_ahead: 4,
            wait_for_teachers: self.teacher_wait,
            access: self.access.clone(),
            io: self.io.clone(),
            ..DistillConfig::default()
        });
        tracing::debug!("worker {}: reading ahead from the teachers", self.id);
        Ok(ReadAhead::teachers(self, teachers, transform, config))
    }
}
