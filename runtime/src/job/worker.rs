//! A worker: one process per device. It joins the coordinator, then runs the
//! steps it is given. Each step reads this rank's share of the global batch
//! (soft labels from the teachers through the DistillReader, read ahead on
//! the assumption that the plan stays the same), computes the gradient,
//! sums it over the generation's ring and applies it.
//!
//! A worker keeps the state of the last *committed* step beside its current
//! one: when a generation fails part way through a step, every survivor goes
//! back to the committed state and the step is redone, whoever had applied
//! it. A new generation builds a new ring and broadcasts parameters and
//! optimiser state from rank 0 (a survivor), so joiners start from exactly
//! the state the others have.

use super::proto::{
    FailCause, FromWorker, Generation, JobSpec, Receiver, StepDone, StepPlan, TeacherSource, ToWorker,
    Written, send,
};
use crate::checkpoint::{Checkpoints, Manifest};
use crate::data::{self, Dataset, Source};
use crate::distill::{DistillConfig, DistillError, DistillReader, Teachers};
use crate::model::Mlp;
use crate::plugin::{HostOptions, Limits, PluginHost, TransformPlugin};
use crate::train::Trainer;
use anyhow::{Context, Result, anyhow, bail};
use edl_host_gpu::comm::{Communicator, ReduceOp, RingOptions, TcpRendezvous, TcpRing};
use edl_host_gpu::{Device, loss::SoftLabelLoss};
use edl_plugin_sdk::{Batch, Dtype};
use std::{
    collections::{BTreeMap, VecDeque},
    net::{SocketAddr, TcpStream},
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

/// The training set and test set a job's spec names.
pub fn load_data(spec: &JobSpec) -> Result<(Dataset, Dataset)> {
    let source = match spec.dataset.as_str() {
        "mnist5k" => Source::Mnist5k,
        "digits" => Source::Digits,
        other => bail!("unknown data set {other:?} (expected mnist5k or digits)"),
    };
    let (mut train, test) = Dataset::load(source)?.split(spec.test_rows, spec.split_seed);
    if let Some(n) = spec.train_samples {
        let n = n.min(train.len());
        train.features.truncate(n * train.dim);
        train.labels.truncate(n);
    }
    Ok((train, test))
}

/// The samples (training-set indices) of a rank's share of a step, with the
/// epoch's permutation (of `len` samples under `seed`) kept in `perm`.
fn shard_ids(seed: u64, at: &Stream, len: usize, perm: &mut Option<(u64, Vec<u32>)>) -> Vec<u32> {
    if perm.as_ref().map(|p| p.0) != Some(at.epoch) {
        *perm = Some((at.epoch, data::permutation(len, seed, at.epoch)));
    }
    let p = &perm.as_ref().expect("set above").1;
    p[data::shard(at.cursor, at.global_batch, at.rank, at.world, len)].to_vec()
}

/// A rank's features, labels and (when distilling) teacher logits.
type Rows = (Vec<f32>, Vec<u32>, Option<Vec<f32>>);

fn batch_of(train: &Dataset, ids: &[u32], seed: u64, epoch: u64) -> Batch {
    let (x, y) = train.gather(ids);
    Batch {
        data: crate::oip::f32_bytes(&x),
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

/// A rank's place in the data: its share of the step at (`epoch`, `cursor`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Stream {
    rank: usize,
    world: usize,
    global_batch: usize,
    /// Where the next batch it yields starts.
    epoch: u64,
    cursor: usize,
}

struct Reader {
    stream: Stream,
    reader: DistillReader,
}

/// Parameters and optimiser velocity at a step boundary.
struct Snapshot {
    params: Vec<f32>,
    velocity: Vec<f32>,
}

/// The generation a worker is in.
#[derive(Clone, Copy)]
struct Place {
    generation: u64,
    rank: usize,
    world: usize,
}

/// A step waiting to run, and where it sits in its window.
struct Queued {
    plan: StepPlan,
    opens: bool,
    closes: bool,
}

/// Gathers the training rows of planned steps on a thread of its own, so
/// that a step finds its batch ready (the plain path: no teachers, no
/// transform). Results come back in the order asked for.
struct Loader {
    ask: mpsc::Sender<(u64, u64, Stream)>,
    ready: mpsc::Receiver<(u64, u64, Vec<f32>, Vec<u32>)>,
    /// (generation, step) asked for and not taken yet, in order.
    asked: VecDeque<(u64, u64)>,
}

/// Batches gathered ahead at most (each a global batch's share of rows).
const LOAD_AHEAD: usize = 4;

impl Loader {
    fn start(train: Arc<Dataset>, seed: u64) -> Result<Self> {
        let (ask, asks) = mpsc::channel::<(u64, u64, Stream)>();
        let (done, ready) = mpsc::sync_channel(LOAD_AHEAD);
        std::thread::Builder::new().name("edl-loader".into()).spawn(move || {
            let mut perm = None;
            for (generation, step, at) in asks {
                let ids = shard_ids(seed, &at, train.len(), &mut perm);
                let (x, y) = train.gather(&ids);
                if done.send((generation, step, x, y)).is_err() {
                    return;
                }
            }
        })?;
        Ok(Loader { ask, ready, asked: VecDeque::new() })
    }

    fn ask(&mut self, generation: u64, step: u64, at: Stream) {
        if self.ask.send((generation, step, at)).is_ok() {
            self.asked.push_back((generation, step));
        }
    }

    /// The rows of (generation, step) if they were asked for; batches asked
    /// for before it and no longer wanted (a failed generation) are dropped.
    fn take(&mut self, generation: u64, step: u64) -> Option<(Vec<f32>, Vec<u32>)> {
        if !self.asked.contains(&(generation, step)) {
            return None;
        }
        while let Some(front) = self.asked.pop_front() {
            let (g, s, x, y) = self.ready.recv().ok()?;
            debug_assert_eq!((g, s), front);
            if (g, s) == (generation, step) {
                return Some((x, y));
            }
        }
        None
    }
}

/// The state of one worker process.
struct Worker {
    id: u64,
    spec: JobSpec,
    train: Arc<Dataset>,
    trainer: Trainer,
    loss: SoftLabelLoss,
    /// Steps applied to the current parameters (None: nothing yet, a joiner).
    applied: Option<u64>,
    /// Rollback points: the state at the start of each window not known
    /// to be committed, and at the last committed step.
    snapshots: BTreeMap<u64, Arc<Snapshot>>,
    /// A released rollback point's buffers, for the next one.
    spare: Option<Snapshot>,
    place: Option<Place>,
    /// The generation in which this worker failed a step (its later steps are dropped).
    failed: Option<u64>,
    queue: VecDeque<Queued>,
    /// Steps of the current window done so far, and the generation's set-up time.
    window: Vec<StepDone>,
    setup_ms: f64,
    ring: Option<(u64, TcpRing)>,
    perm: Option<(u64, Vec<u32>)>,
    reader: Option<Reader>,
    /// Read-ahead of the plain path.
    loader: Option<Loader>,
    transform: Option<Box<dyn TransformPlugin>>,
    host: Option<Arc<PluginHost>>,
    rt: tokio::runtime::Runtime,
    /// A checkpoint being written in the background: its step and thread.
    writing: Option<(u64, std::thread::JoinHandle<Result<std::path::PathBuf>>)>,
    /// Checkpoint writes that ended, not reported yet.
    written: Vec<Written>,
}

/// Runs worker `id` of the coordinator at `coordinator` until it is told to stop.
pub fn run(coordinator: SocketAddr, id: u64) -> Result<()> {
    let stream = TcpStream::connect_timeout(&coordinator, Duration::from_secs(10))
        .with_context(|| format!("worker {id}: cannot reach the coordinator at {coordinator}"))?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    super::proto::keepalive(&stream);
    let mut out = stream.try_clone()?;
    let mut rx = Receiver::new(stream);
    send(&mut out, &FromWorker::Hello { worker: id, pid: std::process::id() })?;
    let spec = match rx.recv::<ToWorker>()? {
        ToWorker::Welcome(spec) => *spec,
        ToWorker::Stop { reason } => {
            tracing::info!("worker {id}: not needed: {reason}");
            return Ok(());
        }
        _ => bail!("worker {id}: the coordinator sent something before the job"),
    };
    let (train, _) = load_data(&spec)?;
    let device: Device = spec.device.parse().map_err(|e: String| anyhow!("worker {id}: {e}"))?;
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
    let transform = match (&spec.transform, &host, &spec.teachers) {
        // Without teachers the worker applies the transform itself.
        (Some(path), Some(h), None) => Some(h.load_transform(path, &spec.transform_config)?),
        _ => None,
    };
    let mut w = Worker {
        id,
        trainer: Trainer::on(device, Mlp::random(&spec.layers, spec.seed))
            .with_context(|| format!("worker {id}"))?,
        loss: SoftLabelLoss { temperature: spec.temperature, alpha: spec.alpha },
        train: Arc::new(train),
        spec,
        applied: None,
        snapshots: BTreeMap::new(),
        spare: None,
        place: None,
        failed: None,
        queue: VecDeque::new(),
        window: Vec::new(),
        setup_ms: 0.0,
        ring: None,
        perm: None,
        reader: None,
        loader: None,
        transform,
        host,
        rt: tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?,
        writing: None,
        written: Vec::new(),
    };
    if w.spec.teachers.is_none() && w.transform.is_none() {
        w.loader = Some(Loader::start(w.train.clone(), w.spec.seed)?);
    }
    send(&mut out, &FromWorker::Ready)?;
    tracing::info!("worker {id}: ready, {} training samples", w.train.len());
    // Messages are read on a thread of their own, so that windows sent
    // ahead queue up while steps run.
    let (tx, inbox) = mpsc::channel();
    std::thread::Builder::new().name("edl-control".into()).spawn(move || {
        loop {
            let msg = rx.recv::<ToWorker>();
            let end = msg.is_err();
            if tx.send(msg).is_err() || end {
                return;
            }
        }
    })?;
    loop {
        // Checkpoint writes that ended go out first (the final one is
        // written before its commit is done with).
        w.reap_write(false);
        if !w.written.is_empty() {
            send(&mut out, &FromWorker::Saved { checkpoints: std::mem::take(&mut w.written) })?;
        }
        let msg = if w.queue.is_empty() {
            match inbox.recv_timeout(Duration::from_millis(100)) {
                Ok(m) => Some(m),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("worker {id}: lost the coordinator"),
            }
        } else {
            inbox.try_recv().ok()
        };
        if let Some(msg) = msg {
            match msg {
                Ok(ToWorker::Stop { reason }) => {
                    tracing::info!("worker {id}: stopping: {reason}");
                    // A checkpoint under way is finished, not left half written.
                    w.reap_write(true);
                    return Ok(());
                }
                Ok(ToWorker::Welcome(_)) => bail!("worker {id}: a second welcome"),
                Ok(ToWorker::Generation(g)) => {
                    if let Err(e) = w.start_generation(&g) {
                        let failed = w.failure(g.generation, g.committed_steps, e);
                        send(&mut out, &failed)?;
                    }
                }
                Ok(ToWorker::Steps { generation, steps }) => w.enqueue(generation, steps),
                Ok(ToWorker::Commit { step, checkpoint, wait }) => w.commit(step, checkpoint, wait),
                Err(e) => bail!("worker {id}: lost the coordinator: {e}"),
            }
            continue;
        }
        let Some(q) = w.queue.pop_front() else { continue };
        let place = w.place.expect("steps are queued within a generation");
        match w.run_step(place, &q) {
            Ok(done) => {
                w.window.push(done);
                if q.closes {
                    let steps = std::mem::take(&mut w.window);
                    let setup_ms = std::mem::take(&mut w.setup_ms);
                    send(&mut out, &FromWorker::Done { generation: place.generation, steps, setup_ms })?;
                }
            }
            Err(e) => {
                let failed = w.failure(place.generation, q.plan.step, e);
                send(&mut out, &failed)?;
            }
        }
    }
}

impl Worker {
    /// Reports a failed step; the generation's remaining steps are dropped
    /// and its ring, unusable now, is closed (which ends its peers' waits).
    fn failure(&mut self, generation: u64, step: u64, e: anyhow::Error) -> FromWorker {
        tracing::warn!("worker {}: generation {generation} step {step}: {e:#}", self.id);
        self.ring = None;
        self.queue.clear();
        self.window.clear();
        self.failed = Some(generation);
        let cause = e
            .chain()
            .any(|c| matches!(c.downcast_ref(), Some(DistillError::NoTeachers { .. })))
            .then_some(FailCause::NoTeachers);
        FromWorker::Failed { generation, step, error: format!("{e:#}"), cause }
    }

    /// Queues a window of the current generation.
    fn enqueue(&mut self, generation: u64, steps: Vec<StepPlan>) {
        let current = self.place.is_some_and(|p| p.generation == generation);
        if !current || self.failed == Some(generation) {
            return;
        }
        let n = steps.len();
        if let (Some(loader), Some(p)) = (self.loader.as_mut(), self.place) {
            for s in &steps {
                let gb = s.hyper.global_batch.max(1) as usize;
                let at = Stream {
                    rank: p.rank,
                    world: p.world,
                    global_batch: gb,
                    epoch: s.epoch,
                    cursor: s.cursor,
                };
                loader.ask(generation, s.step, at);
            }
        }
        self.queue.extend(steps.into_iter().enumerate().map(|(i, plan)| Queued {
            plan,
            opens: i == 0,
            closes: i + 1 == n,
        }));
    }

    /// Every step before `step` is committed: earlier rollback points go;
    /// rank 0 writes the checkpoint asked for.
    fn commit(&mut self, step: u64, checkpoint: Option<Manifest>, wait: bool) {
        if self.applied == Some(step) && !self.snapshots.contains_key(&step) {
            self.snapshot();
        }
        self.release_before(step);
        let Some(manifest) = checkpoint else { return };
        if let Err(e) = self.start_write(manifest) {
            self.written.push(Written { step, result: Err(format!("{e:#}")) });
        }
        if wait {
            self.reap_write(true);
        }
    }

    /// Keeps the current state as the rollback point of step `applied`,
    /// in the buffers of a released one when there is one.
    fn snapshot(&mut self) {
        if let Some(a) = self.applied {
            let mut s = self.spare.take().unwrap_or(Snapshot { params: Vec::new(), velocity: Vec::new() });
            self.trainer.state_into(&mut s.params, &mut s.velocity);
            self.snapshots.insert(a, Arc::new(s));
        }
    }

    /// Drops the rollback points before `step`, keeping one's buffers.
    fn release_before(&mut self, step: u64) {
        let kept = self.snapshots.split_off(&step);
        for old in std::mem::replace(&mut self.snapshots, kept).into_values() {
            // Shared with a checkpoint writer: that one frees it.
            if let Ok(s) = Arc::try_unwrap(old) {
                self.spare = Some(s);
            }
        }
    }

    fn restore(&mut self, s: &Snapshot, step: u64) -> Result<()> {
        self.trainer.load_params_flat(&s.params)?;
        self.trainer.load_velocity(&s.velocity)?;
        self.applied = Some(step);
        Ok(())
    }

    /// Joins a generation: brings the state to its committed step (a
    /// checkpoint, the current state, a rollback point, or rank 0's by
    /// broadcast for a joiner), then builds the ring.
    fn start_generation(&mut self, g: &Generation) -> Result<()> {
        self.queue.clear();
        self.window.clear();
        self.ring = None;
        self.place = Some(Place { generation: g.generation, rank: g.rank, world: g.world });
        self.failed = None;
        let n = g.committed_steps;
        if let Some(path) = &g.init {
            let (restored, skipped) =
                Checkpoints::new(&self.spec.checkpoint_dir, self.spec.keep_checkpoints).latest();
            for e in skipped {
                tracing::warn!("worker {}: skipped checkpoint: {e}", self.id);
            }
            let r = restored.ok_or_else(|| anyhow!("no usable checkpoint in {}", path.display()))?;
            if r.manifest.step != n {
                bail!("checkpoint {} is at step {}, the plan says {n}", r.path.display(), r.manifest.step);
            }
            self.trainer.load_params_flat(&r.model.params_flat())?;
            self.trainer.load_velocity(&r.velocity)?;
            self.applied = Some(n);
            self.snapshots.clear();
        }
        if self.applied.is_none() && n == 0 && g.init.is_none() {
            // Every worker starts from the same seeded initial weights.
            self.applied = Some(0);
        }
        match self.applied {
            Some(a) if a == n => {}
            Some(a) => {
                let s = self.snapshots.get(&n).cloned().ok_or_else(|| {
                    anyhow!(
                        "state at step {a} (rollback points {:?}) cannot serve committed step {n}",
                        self.snapshots.keys().collect::<Vec<_>>()
                    )
                })?;
                self.restore(&s, n)?;
            }
            None => {} // a joiner: gets the state by broadcast
        }
        self.snapshots.retain(|&k, _| k == n);
        self.setup_ms = self.join_generation(g)?;
        if !self.snapshots.contains_key(&n) {
            self.snapshot();
        }
        Ok(())
    }

    /// Builds the generation's ring and shares rank 0's state, when the generation is new.
    fn join_generation(&mut self, g: &Generation) -> Result<f64> {
        let start = Instant::now();
        let opts = RingOptions {
            timeout: Duration::from_millis(self.spec.collective_timeout_ms),
            ..RingOptions::default()
        };
        let rdv = TcpRendezvous::new(g.rendezvous, g.rendezvous_key.clone());
        let mut ring = TcpRing::connect(g.rank, g.world, &rdv, opts)
            .with_context(|| format!("building the ring of generation {}", g.generation))?;
        if g.world > 1 {
            let n = self.trainer.param_count();
            let mut state = if self.applied.is_some() {
                let mut s = self.trainer.params_flat();
                s.extend_from_slice(self.trainer.velocity());
                s
            } else {
                vec![0.0; 2 * n]
            };
            ring.broadcast(&mut state, 0).context("broadcasting parameters from rank 0")?;
            self.trainer.load_params_flat(&state[..n])?;
            self.trainer.load_velocity(&state[n..])?;
            self.applied = Some(g.committed_steps);
            // Rank 0's state is everyone's rollback point now.
            self.snapshots.clear();
        } else if self.applied.is_none() {
            bail!("a world of one with a worker that has no state");
        }
        self.ring = Some((g.generation, ring));
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }

    /// This rank's batch: soft labels from the teachers when distilling.
    fn read(&mut self, want: Stream, ids: &[u32], step: (u64, u64)) -> Result<Rows> {
        let Some(source) = self.spec.teachers.clone() else {
            let Some(t) = self.transform.as_mut() else {
                // Straight from the training set: gathered ahead, or now.
                let (x, y) = match self.loader.as_mut().and_then(|l| l.take(step.0, step.1)) {
                    Some(rows) => rows,
                    None => self.train.gather(ids),
                };
                if y.len() != ids.len() {
                    bail!("the loader gathered {} rows for a share of {}", y.len(), ids.len());
                }
                return Ok((x, y, None));
            };
            let b = t
                .apply(&batch_of(&self.train, ids, self.spec.seed, want.epoch))
                .context("reader transform")?;
            return Ok((features_of(&b)?, b.labels, None));
        };
        if self.reader.as_ref().map(|r| r.stream) != Some(want) {
            self.reader = Some(self.start_reader(want, &source)?);
        }
        let r = self.reader.as_mut().expect("started above");
        let got = self
            .rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(120), r.reader.next()).await })
            .map_err(|_| anyhow!("no soft labels within 120 s"))?
            .ok_or_else(|| anyhow!("the distill reader ended early"))?
            .context("distill reader")?;
        let (mut got_ids, mut want_ids): (Vec<u64>, Vec<u64>) =
            (got.batch.ids.clone(), ids.iter().map(|&i| i as u64).collect());
        got_ids.sort_unstable();
        want_ids.sort_unstable();
        if got_ids != want_ids {
            self.reader = None;
            bail!("the distill reader returned other samples than the step's");
        }
        // Where the read-ahead goes next under an unchanged plan.
        let len = self.train.len();
        let mut next = want;
        next.cursor += want.global_batch;
        if next.cursor >= len {
            next.cursor = 0;
            next.epoch += 1;
        }
        while data::shard(next.cursor, next.global_batch, next.rank, next.world, len).is_empty() {
            next.cursor += next.global_batch;
            if next.cursor >= len {
                next.cursor = 0;
                next.epoch += 1;
            }
        }
        r.stream = next;
        let x = features_of(&got.batch)?;
        Ok((x, got.batch.labels, Some(got.soft)))
    }

    fn start_reader(&mut self, from: Stream, source: &TeacherSource) -> Result<Reader> {
        let teachers = match source {
            TeacherSource::Fixed(list) => Teachers::Fixed(list.clone()),
            TeacherSource::Discovered { store, service } => {
                let _guard = self.rt.enter();
                Teachers::Discovered {
                    store: Arc::new(crate::store::AnyStore::open(store)?),
                    service: service.clone(),
                }
            }
        };
        let transform = match (&self.spec.transform, &self.host) {
            (Some(path), Some(h)) => Some(h.load_transform(path, &self.spec.transform_config)?),
            _ => None,
        };
        let (train, seed, epochs) = (self.train.clone(), self.spec.seed, self.spec.epochs);
        let len = train.len();
        let mut at = from;
        let mut perm: Option<(u64, Vec<u32>)> = None;
        let batches = std::iter::from_fn(move || {
            loop {
                if at.epoch >= epochs || len == 0 {
                    return None;
                }
                let ids = shard_ids(seed, &at, len, &mut perm);
                let b = batch_of(&train, &ids, seed, at.epoch);
                at.cursor += at.global_batch;
                if at.cursor >= len {
                    at.cursor = 0;
                    at.epoch += 1;
                }
                if !ids.is_empty() {
                    return Some(b);
                }
            }
        });
        let config = DistillConfig {
            model_name: self.spec.teacher_model_name.clone(),
            classes: Some(*self.spec.layers.last().unwrap_or(&10)),
            teacher_batch: 64,
            read_ahead: 4,
            wait_for_teachers: Duration::from_millis(self.spec.teacher_wait_ms),
            ..DistillConfig::default()
        };
        let _guard = self.rt.enter();
        let reader = DistillReader::start(batches, transform, teachers, config);
        Ok(Reader { stream: from, reader })
    }

    /// Runs one step of the current generation: this rank's share of the
    /// batch, its gradient, the ring's sum, the update.
    fn run_step(&mut self, place: Place, q: &Queued) -> Result<StepDone> {
        let plan = &q.plan;
        if self.applied != Some(plan.step) {
            bail!("state at step {:?}, the plan is for step {}", self.applied, plan.step);
        }
        if q.opens && !self.snapshots.contains_key(&plan.step) {
            // The rollback point of this window, until a later commit.
            self.snapshot();
        }
        let start = Instant::now();
        let gb = plan.hyper.global_batch.max(1) as usize;
        let len = self.train.len();
        let at = Stream {
            rank: place.rank,
            world: place.world,
            global_batch: gb,
            epoch: plan.epoch,
            cursor: plan.cursor,
        };
        let positions = data::shard(plan.cursor, gb, place.rank, place.world, len);
        let ids = shard_ids(self.spec.seed, &at, len, &mut self.perm);
        let global_rows = (plan.cursor + gb).min(len) - plan.cursor;
        let mut loss = 0.0;
        if !ids.is_empty() {
            let (x, y, soft) = self.read(at, &ids, (place.generation, plan.step))?;
            loss = self.trainer.compute_gradient(&x, &y, soft.as_deref(), &self.loss, global_rows)?
                / global_rows as f64;
        } else {
            self.trainer.grad_mut().iter_mut().for_each(|g| *g = 0.0);
        }
        if self.spec.step_delay_ms > 0 {
            std::thread::sleep(Duration::from_millis(self.spec.step_delay_ms));
        }
        let compute_ms = start.elapsed().as_secs_f64() * 1e3;
        let ring = match self.ring.as_mut() {
            Some((g, r)) if *g == place.generation => r,
            _ => bail!("no ring for generation {}", place.generation),
        };
        ring.all_reduce(self.trainer.grad_mut(), ReduceOp::Sum)
            .with_context(|| format!("all-reduce of step {}", plan.step))?;
        self.trainer.apply(plan.hyper.lr, plan.hyper.momentum)?;
        self.applied = Some(plan.step + 1);
        Ok(StepDone {
            step: plan.step,
            epoch: plan.epoch,
            start: positions.start as u32,
            end: positions.end as u32,
            loss,
            compute_ms,
        })
    }

    /// Starts writing the committed state (rank 0) on a thread of its own,
    /// from a copy, so that the step and its collectives do not wait for the
    /// disk. An earlier write still under way is finished first.
    fn start_write(&mut self, manifest: Manifest) -> Result<()> {
        self.reap_write(true);
        let n = manifest.step;
        let state = self.snapshots.get(&n).cloned().ok_or_else(|| {
            anyhow!(
                "no state of step {n} to save (rollback points {:?})",
                self.snapshots.keys().collect::<Vec<_>>()
            )
        })?;
        let model = self.trainer.model().clone();
        let store = Checkpoints::new(&self.spec.checkpoint_dir, self.spec.keep_checkpoints);
        let handle = std::thread::Builder::new().name("edl-checkpoint".into()).spawn(move || {
            let mut t = Trainer::new(model);
            t.load_params_flat(&state.params)?;
            t.load_velocity(&state.velocity)?;
            Ok(store.save(&t, manifest)?)
        })?;
        self.writing = Some((n, handle));
        Ok(())
    }

    /// Collects the background write's outcome once it has ended (or
    /// waits for it, with `wait`), to be reported with the next answer.
    fn reap_write(&mut self, wait: bool) {
        if !self.writing.as_ref().is_some_and(|(_, h)| wait || h.is_finished()) {
            return;
        }
        let Some((step, handle)) = self.writing.take() else { return };
        let result = match handle.join() {
            Ok(r) => r.map_err(|e| format!("{e:#}")),
            Err(_) => Err("the checkpoint writer panicked".to_string()),
        };
        if let Err(e) = &result {
            tracing::warn!("worker {}: checkpoint of step {step}: {e}", self.id);
        }
        self.written.push(Written { step, result });
    }
}
