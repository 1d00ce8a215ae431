//! The `edl` Python package's native part: the worker side of an elastic
//! job ([`edl_runtime::worker::session::Session`]) for a training loop written
//! in Python. The program registers its state (float32 arrays: NumPy, or
//! PyTorch CPU tensors through their NumPy view), then iterates the job's
//! steps; the runtime snapshots, restores, broadcasts and checkpoints those
//! arrays in place, and sums gradients over the generation's ring.

use anyhow::anyhow;
use edl_host_gpu::comm::KvClient;
use edl_plugin_sdk::{Batch, Dtype};
use edl_runtime::distill::{DistillConfig, DistillReader, Distilled, Teachers};
use edl_runtime::job::TeacherSource;
use edl_runtime::state::{Layout, TensorSpec};
use edl_runtime::worker::session::{Event, JobAuth, Joined, Secret, Session, State, Step};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

pyo3::create_exception!(_edl, EdlError, PyRuntimeError, "An error of the elastic runtime, with its message.");

fn err(e: impl std::fmt::Display) -> PyErr {
    EdlError::new_err(e.to_string())
}

fn anyhow_err(e: anyhow::Error) -> PyErr {
    EdlError::new_err(format!("{e:#}"))
}

/// The registered arrays, as the session's state.
struct Arrays {
    layout: Layout,
    buffers: Vec<PyBuffer<f32>>,
    /// The program's own steps around the runtime's reads and writes of
    /// the arrays (`Job._state_hooks`): `pack` brings copies it keeps in
    /// the arrays up to date just before they are read (a rollback point,
    /// a checkpoint, a broadcast), `unpack` reads them back just after they
    /// were written; never on the step's path otherwise.
    pack: Option<Py<PyAny>>,
    unpack: Option<Py<PyAny>>,
}

/// Calls a program's state hook, naming it in the error.
fn call_hook(py: Python<'_>, hook: &Option<Py<PyAny>>, what: &str) -> anyhow::Result<()> {
    match hook {
        Some(f) => f.call0(py).map(drop).map_err(|e| anyhow!("the program's {what} of its state: {e}")),
        None => Ok(()),
    }
}

impl State for Arrays {
    fn layout(&self) -> &Layout {
        &self.layout
    }

    fn save_into(&mut self, out: &mut Vec<f32>) -> anyhow::Result<()> {
        out.clear();
        out.resize(self.layout.numel(), 0.0);
        Python::attach(|py| {
            call_hook(py, &self.pack, "copy")?;
            for (b, (t, r)) in self.buffers.iter().zip(self.layout.ranges()) {
                b.copy_to_slice(py, &mut out[r])
                    .map_err(|e| anyhow!("reading state tensor {:?}: {e}", t.name))?;
            }
            Ok(())
        })
    }

    fn load(&mut self, values: &[f32]) -> anyhow::Result<()> {
        if values.len() != self.layout.numel() {
            anyhow::bail!("{} values for a state of {}", values.len(), self.layout.numel());
        }
        Python::attach(|py| {
            for (b, (t, r)) in self.buffers.iter().zip(self.layout.ranges()) {
                b.copy_from_slice(py, &values[r])
                    .map_err(|e| anyhow!("writing state tensor {:?}: {e}", t.name))?;
            }
            call_hook(py, &self.unpack, "reading back")
        })
    }

    fn idle(&mut self) -> anyhow::Result<()> {
        // Ctrl-C while the program waits for the coordinator.
        Python::attach(|py| py.check_signals()).map_err(|e| anyhow!("interrupted: {e}"))
    }
}

/// What a read-ahead is fed: a step's samples (the program's features
/// function reads them) or rows the program gave.
enum Feed {
    Indices(Vec<u32>),
    Rows { x: Vec<f32>, rows: usize },
}

/// Soft labels from the job's teachers, read ahead of the steps when the
/// program gave a features function.
struct Teach {
    feed: mpsc::Sender<Feed>,
    /// Steps fed and not taken yet, in order.
    fed: VecDeque<(u64, u64)>,
    reader: DistillReader,
    /// Why the source stopped (the features function raised).
    source_error: Arc<Mutex<Option<String>>>,
}

/// A read-ahead source batch from what was fed.
fn batch_of(features: &Option<Py<PyAny>>, feed: Feed) -> Result<Batch, String> {
    let (x, rows, ids) = match feed {
        Feed::Rows { x, rows } => (x, rows, (0..rows as u64).collect()),
        Feed::Indices(ids) => {
            let f = features.as_ref().ok_or("no features function")?;
            let (x, rows) = Python::attach(|py| -> PyResult<(Vec<f32>, usize)> {
                let idx = indices_array(py, &ids)?;
                let out = f.call1(py, (idx,))?;
                let out = as_float32(py, out.bind(py))?;
                let buf = PyBuffer::<f32>::get(&out)?;
                Ok((buf.to_vec(py)?, buf.shape().first().copied().unwrap_or(0)))
            })
            .map_err(|e| format!("the features function: {e}"))?;
            if rows != ids.len() {
                return Err(format!("the features function returned {rows} rows for {} indices", ids.len()));
            }
            (x, rows, ids.iter().map(|&i| i as u64).collect())
        }
    };
    let dim = x.len().checked_div(rows).unwrap_or(0);
    if rows == 0 || dim * rows != x.len() {
        return Err(format!("{} values are not {rows} rows", x.len()));
    }
    Ok(Batch {
        data: edl_runtime::distill::oip::f32_bytes(&x),
        shape: vec![rows as u32, dim as u32],
        dtype: Dtype::Float32,
        labels: vec![0; rows],
        ids,
        seed: 0,
    })
}

/// `numpy.asarray(x, dtype=float32)`, C-contiguous.
fn as_float32<'py>(py: Python<'py>, x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let np = py.import("numpy")?;
    np.call_method1("ascontiguousarray", (x, "float32"))
}

/// `numpy.frombuffer`, looked up once.
static FROMBUFFER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// Sample indices as a NumPy int64 array (writable: a view of a bytearray
/// it keeps alive, one copy).
fn indices_array<'py>(py: Python<'py>, ids: &[u32]) -> PyResult<Bound<'py, PyAny>> {
    let wide: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
    let bytes = pyo3::types::PyByteArray::new(py, bytemuck::cast_slice(&wide));
    FROMBUFFER.import(py, "numpy", "frombuffer")?.call1((bytes, "int64"))
}

/// Float32 values as a NumPy array of `shape`.
fn float_array<'py>(py: Python<'py>, values: &[f32], shape: (usize, usize)) -> PyResult<Bound<'py, PyAny>> {
    // One copy: into a bytearray the array is a writable view of (and keeps alive).
    let bytes = pyo3::types::PyByteArray::new(py, bytemuck::cast_slice(values));
    let a = py.import("numpy")?.call_method1("frombuffer", (bytes, "float32"))?;
    a.call_method1("reshape", (shape,))
}

struct Inner {
    session: Session,
    state: Arrays,
    ready: bool,
    stopped: Option<String>,
    features: Option<Py<PyAny>>,
    teach: Option<Teach>,
    rt: tokio::runtime::Runtime,
    /// The step being run, when it started, and whether it was abandoned.
    current: Option<(Step, Instant)>,
    /// Sparse tables on the job's parameter servers.
    tables: edl_runtime::ps::Tables,
}

/// An elastic job, joined as one of its workers.
#[pyclass(module = "edl")]
struct Job {
    inner: Mutex<Inner>,
    id: u64,
    /// The job's samples; 0 until the program declares them when the job
    /// was launched without `--samples`.
    samples: std::sync::atomic::AtomicUsize,
    epochs: u64,
    seed: u64,
    job: String,
    distill: bool,
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes the job's lock from Python, waiting for it without the GIL: the
/// thread that holds it may be waiting for the GIL (a step's fetch checks
/// for Ctrl-C and writes the state back through Python), so a thread that
/// held the GIL while it waited (a read-ahead thread asking `job.planned()`)
/// would wait for it forever.
fn lock_held<'a>(py: Python<'_>, m: &'a Mutex<Inner>) -> std::sync::MutexGuard<'a, Inner> {
    loop {
        match m.try_lock() {
            Ok(g) => return g,
            Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
            // Wait for its holder to let go, without the GIL, then try again.
            Err(std::sync::TryLockError::WouldBlock) => py.detach(|| drop(lock(m))),
        }
    }
}

#[pymethods]
impl Job {
    /// Joins the job named by the environment `edl-runtime launch` sets
    /// (`EDL_COORDINATOR`, `EDL_WORKER_ID`, `EDL_JOB`, `EDL_JOB_SECRET`; without
    /// `EDL_WORKER_ID` the coordinator gives the worker an id). `features(indices) -> float32
    /// array` lets the runtime read teachers' soft labels ahead of the steps.
    #[staticmethod]
    #[pyo3(signature = (features=None))]
    fn from_env(py: Python<'_>, features: Option<Py<PyAny>>) -> PyResult<Option<Self>> {
        let var = |k: &str| {
            std::env::var(k)
                .map_err(|_| err(format!("{k} is not set: run the program under `edl-runtime launch`")))
        };
        // Through the relay `EDL_RELAY` names, where one answers (a
        // Kubernetes job's relay on this node).
        let coordinator = var("EDL_COORDINATOR")?;
        let at = py.detach(|| edl_runtime::net::worker_reaches(&coordinator));
        let addr = edl_runtime::net::resolve(&at).map_err(|e| err(format!("{at}: {e:#}")))?;
        // Without an id (a worker started by another engine) the coordinator gives one.
        let id: u64 = match std::env::var("EDL_WORKER_ID") {
            Ok(v) => v.parse().map_err(|e| err(format!("EDL_WORKER_ID: {e}")))?,
            Err(_) => 0,
        };
        let auth = edl_runtime::worker::session::auth_from_env().map_err(anyhow_err)?;
        Self::join(py, addr, id, auth, features)
    }

    /// Joins job `job` of the coordinator at `coordinator` (`host:port`) as
    /// worker `worker_id`, proving the job's `secret` (its hex form, as in
    /// `.edl/<job>/secret`).
    #[staticmethod]
    #[pyo3(signature = (coordinator, worker_id, job, secret, features=None))]
    fn connect(
        py: Python<'_>,
        coordinator: &str,
        worker_id: u64,
        job: String,
        secret: &str,
        features: Option<Py<PyAny>>,
    ) -> PyResult<Option<Self>> {
        let addr = edl_runtime::net::resolve(coordinator)
            .map_err(|e| err(format!("coordinator {coordinator:?}: {e:#}")))?;
        let secret = Secret::from_hex(secret).map_err(|e| err(format!("secret: {e}")))?;
        Self::join(py, addr, worker_id, JobAuth { job, secret }, features)
    }

    /// Registers a float32 array (C-contiguous, writable) as part of the
    /// state under `name`. Register everything before the first step.
    fn register(&self, py: Python<'_>, name: &str, array: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut inner = lock_held(py, &self.inner);
        if inner.ready {
            return Err(err(format!("state {name:?}: register the state before the first step")));
        }
        let buf = PyBuffer::<f32>::get(array)
            .map_err(|e| PyValueError::new_err(format!("state {name:?}: not a float32 array ({e})")))?;
        if buf.readonly() || !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "state {name:?}: the array must be writable and C-contiguous"
            )));
        }
        let mut tensors = inner.state.layout.tensors().to_vec();
        tensors.push(TensorSpec::new(name, buf.shape().to_vec()));
        inner.state.layout = Layout::new(tensors).map_err(|e| PyValueError::new_err(e.to_string()))?;
        inner.state.buffers.push(buf);
        Ok(())
    }

    /// `pack()` is called just before the runtime reads the registered
    /// arrays (a window's rollback point, a checkpoint, a joiner's
    /// broadcast), `unpack()` just after it wrote them (a rollback, rank
    /// 0's state, a checkpoint loaded): for a program that keeps copies of
    /// its state in them (`edl.torch.ElasticState`), so the copies cost
    /// nothing on the steps between. Set before the first step. They run
    /// inside the job's own calls (its lock held): they copy arrays and
    /// must not call the job or its steps.
    fn _state_hooks(&self, py: Python<'_>, pack: Py<PyAny>, unpack: Py<PyAny>) -> PyResult<()> {
        let mut inner = lock_held(py, &self.inner);
        if inner.ready {
            return Err(err("state hooks: set them before the first step"));
        }
        inner.state.pack = Some(pack);
        inner.state.unpack = Some(unpack);
        Ok(())
    }

    /// Defines a sparse table on the job's parameter servers (`--ps-servers
    /// N`): rows of `dim` float32 values, made on first touch by `init`
    /// (`"uniform"` in [-scale, scale], `"normal"` with std `scale`, or
    /// `"zeros"`; the same values on any server, from `seed`), updated on
    /// the servers by `optimizer` (`"sgd"`, `"adagrad"` or `"adam"`, at
    /// `lr`). Every worker defines the same tables; `step.pull` and
    /// `step.push` use them.
    #[pyo3(signature = (name, dim, optimizer="adagrad", lr=0.05, init="uniform", scale=0.05, seed=0))]
    #[allow(clippy::too_many_arguments)]
    fn table(
        &self,
        py: Python<'_>,
        name: &str,
        dim: usize,
        optimizer: &str,
        lr: f32,
        init: &str,
        scale: f32,
        seed: u64,
    ) -> PyResult<()> {
        use edl_runtime::ps::{Init, Optimizer, TableSpec};
        let optimizer = match optimizer {
            "sgd" => Optimizer::sgd(lr),
            "adagrad" => Optimizer::adagrad(lr),
            "adam" => Optimizer::adam(lr),
            o => {
                return Err(PyValueError::new_err(format!(
                    "table {name:?}: optimizer {o:?} is not sgd, adagrad or adam"
                )));
            }
        };
        let init = match init {
            "uniform" => Init::Uniform { scale },
            "normal" => Init::Normal { std: scale },
            "zeros" => Init::Zeros,
            i => {
                return Err(PyValueError::new_err(format!(
                    "table {name:?}: init {i:?} is not uniform, normal or zeros"
                )));
            }
        };
        let spec = TableSpec { name: name.to_string(), dim, optimizer, init, seed };
        let mut inner = lock_held(py, &self.inner);
        let started = inner.ready;
        inner.tables.define(spec, started).map_err(|e| PyValueError::new_err(format!("{e:#}")))?;
        if let Some(export) = inner.tables.exporter() {
            inner.session.set_table_export(export);
        }
        Ok(())
    }

    /// The registered state's names and shapes.
    #[getter]
    fn state_layout(&self, py: Python<'_>) -> Vec<(String, Vec<usize>)> {
        let inner = lock_held(py, &self.inner);
        inner.state.layout.tensors().iter().map(|t| (t.name.clone(), t.shape.clone())).collect()
    }

    /// The steps planned for this worker after the current one, in order:
    /// `[(generation, step, indices)]` (for reading their data ahead; a
    /// generation change drops them and plans again).
    fn planned<'py>(&self, py: Python<'py>) -> PyResult<Vec<(u64, u64, Bound<'py, PyAny>)>> {
        let inner = lock_held(py, &self.inner);
        inner.session.planned().map(|s| Ok((s.generation, s.step, indices_array(py, &s.indices)?))).collect()
    }

    /// The steps this worker runs, until the job ends or scales it in.
    fn steps(slf: Py<Self>) -> Steps {
        Steps { job: slf }
    }

    /// Why the job stopped this worker (None while it runs).
    #[getter]
    fn stopped(&self, py: Python<'_>) -> Option<String> {
        lock_held(py, &self.inner).stopped.clone()
    }

    #[getter]
    fn worker_id(&self) -> u64 {
        self.id
    }
    /// The job's samples: indices `0..samples` (0 while unknown: a job
    /// launched without `--samples` takes them from its first worker).
    #[getter]
    fn samples(&self) -> usize {
        self.samples.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Declares the samples of the program's data set (`len(dataset)`),
    /// before the first step: a job launched without `--samples` takes the
    /// first worker's number; a worker whose number differs from the job's
    /// stops the job with an error naming both.
    #[setter]
    fn set_samples(&self, py: Python<'_>, n: usize) -> PyResult<()> {
        if lock_held(py, &self.inner).ready {
            return Err(err("job.samples: declare the samples before the first step"));
        }
        if n == 0 {
            return Err(PyValueError::new_err("job.samples: a data set of 0 samples"));
        }
        let most = edl_runtime::trainer::data::MAX_SAMPLES;
        if n > most {
            return Err(PyValueError::new_err(format!(
                "job.samples: {n} samples; a job holds at most {most} (a step's positions are 32-bit)"
            )));
        }
        self.samples.store(n, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    #[getter]
    fn epochs(&self) -> u64 {
        self.epochs
    }
    /// The job's seed (initialise the model with it: every worker must start alike).
    #[getter]
    fn seed(&self) -> u64 {
        self.seed
    }
    #[getter]
    fn name(&self) -> String {
        self.job.clone()
    }
    /// Whether the job has teachers to distil from.
    #[getter]
    fn distill(&self) -> bool {
        self.distill
    }
}

impl Job {
    fn join(
        py: Python<'_>,
        addr: std::net::SocketAddr,
        id: u64,
        auth: JobAuth,
        features: Option<Py<PyAny>>,
    ) -> PyResult<Option<Self>> {
        init_logging();
        let joined = py.detach(|| Session::join(addr, id, auth)).map_err(anyhow_err)?;
        let session = match joined {
            Joined::Welcome(s) => *s,
            Joined::NotNeeded(reason) => {
                tracing::info!("worker {id}: not needed: {reason}");
                return Ok(None);
            }
        };
        let spec = session.spec().clone();
        let tables = edl_runtime::ps::Tables::new(spec.ps.clone(), session.auth().clone(), session.id());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(err)?;
        Ok(Some(Job {
            // The coordinator's, when it gave this worker its id.
            id: session.id(),
            samples: std::sync::atomic::AtomicUsize::new(spec.samples),
            epochs: spec.epochs,
            seed: spec.seed,
            job: spec.job.clone(),
            distill: spec.teachers.is_some(),
            inner: Mutex::new(Inner {
                session,
                state: Arrays { layout: Layout::default(), buffers: Vec::new(), pack: None, unpack: None },
                ready: false,
                stopped: None,
                features,
                teach: None,
                rt,
                current: None,
                tables,
            }),
        }))
    }

    /// The next step, or None when the job is over for this worker.
    fn next_step(&self, py: Python<'_>) -> PyResult<Option<StepInfo>> {
        let mut guard = lock_held(py, &self.inner);
        let inner = &mut *guard;
        if inner.stopped.is_some() {
            return Ok(None);
        }
        if !inner.ready {
            if inner.state.buffers.is_empty() {
                return Err(err("register the state (job.register(name, array)) before the first step"));
            }
            let declared = (self.samples() > 0).then(|| self.samples() as u64);
            inner.session.ready(inner.state.layout.clone(), declared).map_err(anyhow_err)?;
            inner.ready = true;
        }
        if inner.current.take().is_some() && inner.session.in_step() {
            tracing::warn!("worker {}: a step was left without commit; it is redone", self.id);
        }
        let (session, state) = (&mut inner.session, &mut inner.state);
        let event = py.detach(|| session.next(state)).map_err(anyhow_err)?;
        match event {
            Event::Stop(reason) => {
                inner.stopped = Some(reason);
                Ok(None)
            }
            Event::Step(s) => {
                let info = StepInfo::of(&s);
                inner.tables.follow(inner.session.ps_topology().cloned());
                inner.tables.restore = inner
                    .session
                    .restored_from()
                    .map(|p| (inner.session.spec().checkpoint_dir.clone(), p.to_path_buf()));
                inner.current = Some((s, Instant::now()));
                Ok(Some(info))
            }
        }
    }
}

/// A generation's key-value store, with the operations of a
/// `torch.distributed` `Store` (`edl.torch` wraps it as one). Every call
/// releases the GIL while it waits.
#[pyclass(module = "edl")]
struct Store {
    client: Mutex<KvClient>,
    #[pyo3(get)]
    generation: u64,
}

fn wait_of(timeout: Option<f64>) -> PyResult<Duration> {
    match timeout {
        None => Ok(Duration::from_secs(300)),
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Duration::from_secs_f64(t)),
        Some(t) => Err(PyValueError::new_err(format!("timeout {t}: need seconds, 0 or more"))),
    }
}

impl Store {
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut KvClient) -> Result<T, edl_host_gpu::comm::CommError> + Send,
    ) -> PyResult<T> {
        // The lock is taken without the GIL: a thread that holds it while
        // waiting on the store never waits for the GIL another one holds.
        let client = &self.client;
        py.detach(|| {
            let mut c = client.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut c)
        })
        .map_err(err)
    }
}

#[pymethods]
impl Store {
    fn set(&self, py: Python<'_>, key: &str, value: &[u8]) -> PyResult<()> {
        self.call(py, |c| c.set(key, value))
    }

    /// The value of `key`, waiting up to `timeout` seconds (default 300) for it.
    #[pyo3(signature = (key, timeout=None))]
    fn get<'py>(&self, py: Python<'py>, key: &str, timeout: Option<f64>) -> PyResult<Bound<'py, PyBytes>> {
        let wait = wait_of(timeout)?;
        let v = self.call(py, |c| c.get(key, wait))?;
        Ok(PyBytes::new(py, &v))
    }

    fn add(&self, py: Python<'_>, key: &str, amount: i64) -> PyResult<i64> {
        self.call(py, |c| c.add(key, amount))
    }

    fn compare_set<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let v = self.call(py, |c| c.compare_set(key, expected, desired))?;
        Ok(PyBytes::new(py, &v))
    }

    fn check(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<bool> {
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.call(py, |c| c.check(&keys))
    }

    #[pyo3(signature = (keys, timeout=None))]
    fn wait(&self, py: Python<'_>, keys: Vec<String>, timeout: Option<f64>) -> PyResult<()> {
        let wait = wait_of(timeout)?;
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.call(py, |c| c.wait(&keys, wait))
    }

    fn delete_key(&self, py: Python<'_>, key: &str) -> PyResult<bool> {
        self.call(py, |c| c.delete(key))
    }

    fn num_keys(&self, py: Python<'_>) -> PyResult<u64> {
        self.call(py, |c| c.num_keys())
    }
}

/// The iterator of a job's steps.
#[pyclass(module = "edl")]
struct Steps {
    job: Py<Job>,
}

#[pymethods]
impl Steps {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<StepView>> {
        let job = self.job.bind(py).borrow();
        Ok(job.next_step(py)?.map(|info| StepView {
            job: self.job.clone_ref(py),
            info,
            done: false,
            given_up: false,
            norms: Mutex::new(Vec::new()),
            indices: PyOnceLock::new(),
        }))
    }
}

/// What a step says, copied out of the session's plan.
#[derive(Clone)]
struct StepInfo {
    generation: u64,
    rank: usize,
    world: usize,
    step: u64,
    epoch: u64,
    global_batch: u32,
    lr: f32,
    momentum: f32,
    indices: Vec<u32>,
    global_rows: usize,
    base: u64,
    ends_epoch: bool,
}

impl StepInfo {
    fn of(s: &Step) -> Self {
        StepInfo {
            generation: s.generation,
            rank: s.rank,
            world: s.world,
            step: s.step,
            epoch: s.epoch,
            global_batch: s.hyper.global_batch,
            lr: s.hyper.lr,
            momentum: s.hyper.momentum,
            indices: s.indices.clone(),
            global_rows: s.global_rows,
            base: s.base,
            ends_epoch: s.ends_epoch,
        }
    }
}

/// A parameter-server request failed: when the step is to be redone (a
/// server gone, the generation over), the step is abandoned and the
/// connections dropped; any other error is raised.
fn abandon_for(py: Python<'_>, inner: &mut Inner, e: anyhow::Error) -> PyResult<()> {
    if !inner.tables.failed(&e) {
        return Err(anyhow_err(e));
    }
    tracing::warn!("worker {}: {e:#}; the step is redone", inner.session.id());
    inner.current = None;
    if inner.session.in_step() {
        let session = &mut inner.session;
        py.detach(|| session.fail(e, None)).map_err(anyhow_err)?;
    }
    Ok(())
}

/// Sparse-table ids from Python: integers >= 0, as u64.
fn ids_of(py: Python<'_>, table: &str, ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    // An int64 buffer (a NumPy array, as `edl.torch` passes) read as it is;
    // anything else (lists, other dtypes, tensors) through NumPy.
    let v = match PyBuffer::<i64>::get(ids) {
        Ok(buf) => buf.to_vec(py)?,
        Err(_) => return ids_through_numpy(py, table, ids),
    };
    if let Some(bad) = v.iter().find(|&&i| i < 0) {
        return Err(PyValueError::new_err(format!("table {table:?}: id {bad} is negative")));
    }
    Ok(v.into_iter().map(|i| i as u64).collect())
}

fn ids_through_numpy(py: Python<'_>, table: &str, ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let np = py.import("numpy")?;
    let a = np.call_method1("asarray", (ids,))?;
    let kind: String = a.getattr("dtype")?.getattr("kind")?.extract()?;
    let unsigned = match kind.as_str() {
        "u" => true,
        "i" => false,
        // An empty list is floats to NumPy: no ids.
        "f" if a.getattr("size")?.extract::<usize>()? == 0 => false,
        _ => {
            let dtype = a.getattr("dtype")?.str()?.to_string();
            return Err(PyValueError::new_err(format!("table {table:?}: ids must be integers, not {dtype}")));
        }
    };
    // uint64 ids travel as their bits (ids of 2^63 and more, from hashing).
    let a = np.call_method1("ascontiguousarray", (a, if unsigned { "uint64" } else { "int64" }))?;
    let a = if unsigned { a.call_method1("view", ("int64",))? } else { a };
    let v = PyBuffer::<i64>::get(&a)?.to_vec(py)?;
    if !unsigned && let Some(bad) = v.iter().find(|&&i| i < 0) {
        return Err(PyValueError::new_err(format!("table {table:?}: id {bad} is negative")));
    }
    Ok(v.into_iter().map(|i| i as u64).collect())
}

impl StepView {
    /// Where this step's requests to the parameter servers stand.
    fn mark(&self) -> edl_runtime::ps::Mark {
        edl_runtime::ps::Mark::of_worker(self.info.generation, self.info.base)
    }

    /// Where this rank's pushes of the step belong.
    fn tag(&self) -> edl_runtime::ps::PushTag {
        let (step, rank, world) = (self.info.step, self.info.rank as u32, self.info.world as u32);
        edl_runtime::ps::PushTag { mark: self.mark(), step, rank, world }
    }
}

/// One step of this worker.
#[pyclass(module = "edl", name = "Step")]
struct StepView {
    job: Py<Job>,
    info: StepInfo,
    /// Committed or abandoned.
    done: bool,
    /// Abandoned: by the program, or by its failed `all_reduce`.
    given_up: bool,
    /// Squared norms a communication hook told (`gradient_norms`), read
    /// at the commit: numbers, or 0-d tensors still being computed.
    /// Behind a lock of its own: a hook tells them from gloo's thread while
    /// the step is borrowed elsewhere (a table's push from backward).
    norms: Mutex<Vec<(Py<PyAny>, Py<PyAny>)>>,
    /// `indices` as a NumPy array, made at its first read.
    indices: PyOnceLock<Py<PyAny>>,
}

#[pymethods]
impl StepView {
    /// This rank's samples: indices into `0..job.samples` (int64 array; may be empty).
    #[getter]
    /// The same array at every read of one step: copy it to change it.
    fn indices<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if let Some(a) = self.indices.get(py) {
            return Ok(a.bind(py).clone());
        }
        let a = indices_array(py, &self.info.indices)?;
        Ok(self.indices.get_or_init(py, || a.clone().unbind()).bind(py).clone())
    }
    /// How many samples this rank has in the step (`len(step.indices)`,
    /// without making the array).
    #[getter]
    fn rows(&self) -> usize {
        self.info.indices.len()
    }
    #[getter]
    fn step(&self) -> u64 {
        self.info.step
    }
    /// Whether this is the last step of its epoch (for an evaluation at
    /// the epoch's end).
    #[getter]
    fn ends_epoch(&self) -> bool {
        self.info.ends_epoch
    }
    #[getter]
    fn epoch(&self) -> u64 {
        self.info.epoch
    }
    #[getter]
    fn generation(&self) -> u64 {
        self.info.generation
    }
    #[getter]
    fn rank(&self) -> usize {
        self.info.rank
    }
    #[getter]
    fn world(&self) -> usize {
        self.info.world
    }
    /// The global batch (the adapter may change it between steps).
    #[getter]
    fn batch_size(&self) -> u32 {
        self.info.global_batch
    }
    /// Samples of this step over every rank (the last step of an epoch may be short).
    #[getter]
    fn global_rows(&self) -> usize {
        self.info.global_rows
    }
    #[getter]
    fn lr(&self) -> f32 {
        self.info.lr
    }
    #[getter]
    fn momentum(&self) -> f32 {
        self.info.momentum
    }
    /// Whether the step was abandoned (`abandon`, or its `all_reduce`
    /// failed): the runtime redoes it in the next generation, from the
    /// state before it. False for a step committed or still under way.
    #[getter]
    fn abandoned(&self) -> bool {
        self.given_up
    }

    /// Where the generation's ring meets, for `torch.distributed`-style
    /// collectives of your own: `{"rank", "world", "generation", "host", "port", "key"}`.
    #[getter]
    fn rendezvous<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let job = self.job.bind(py).borrow();
        let inner = lock_held(py, &job.inner);
        let r = inner.session.rendezvous().ok_or_else(|| err("no generation yet"))?;
        let d = PyDict::new(py);
        d.set_item("rank", r.rank)?;
        d.set_item("world", r.world)?;
        d.set_item("generation", r.generation)?;
        d.set_item("host", r.addr.ip().to_string())?;
        d.set_item("port", r.addr.port())?;
        d.set_item("key", r.key.clone())?;
        Ok(d)
    }

    /// The generation's key-value store (a `torch.distributed` process
    /// group's rendezvous), reached through the job's authenticated
    /// rendezvous port; `timeout` bounds each request that does not wait.
    #[pyo3(signature = (timeout=30.0))]
    fn store(&self, py: Python<'_>, timeout: f64) -> PyResult<Store> {
        let job = self.job.bind(py).borrow();
        let inner = lock_held(py, &job.inner);
        let r = inner.session.rendezvous().ok_or_else(|| err("no generation yet"))?.clone();
        let auth = inner.session.auth().clone();
        drop(inner);
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(PyValueError::new_err(format!("timeout {timeout}: need seconds above 0")));
        }
        let limit = Duration::from_secs_f64(timeout);
        let client = py
            .detach(|| KvClient::connect(r.addr, &auth, r.generation, r.rank as u64, limit))
            .map_err(err)?;
        Ok(Store { client: Mutex::new(client), generation: r.generation })
    }

    /// Gives the step up: `reason` (a collective of your own failed, a peer
    /// died) is reported, the step is redone by the next generation from the
    /// state before it, and the loop goes on with the next step it is given.
    fn abandon(&mut self, py: Python<'_>, reason: &str) -> PyResult<()> {
        if self.done {
            return Ok(());
        }
        let job = self.job.bind(py).borrow();
        let mut inner = lock_held(py, &job.inner);
        inner.current = None;
        self.done = true;
        self.given_up = true;
        let e = anyhow!("step {}: {reason}", self.info.step);
        if inner.session.in_step() {
            let session = &mut inner.session;
            py.detach(|| session.fail(e, None)).map_err(anyhow_err)?;
        }
        Ok(())
    }

    /// Rows `ids` (integers >= 0; repeats allowed) of sparse table `table`
    /// as they are after the steps before this one (or within the job's
    /// `--ps-staleness`): a float32 array `[len(ids), dim]`. None when a
    /// server is gone or the step's generation is over: the step is
    /// abandoned and redone by the next generation.
    fn pull<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        if self.done {
            return Err(err(format!("step {} is over", self.info.step)));
        }
        let ids = ids_of(py, table, ids)?;
        let job = self.job.bind(py).borrow();
        let mut inner = lock_held(py, &job.inner);
        let mark = self.mark();
        let tables = &mut inner.tables;
        let dim = tables.dim(table).map_err(anyhow_err)?;
        let step = self.info.step;
        match py.detach(|| tables.pull(table, mark, step, &ids)) {
            Ok(rows) => float_array(py, &rows, (ids.len(), dim)).map(Some),
            Err(e) => abandon_for(py, &mut inner, e).map(|()| None),
        }
    }

    /// [`StepView::pull`] of several tables at once, `reads` a list of
    /// `(table, ids)`: every table's request is sent to the servers before
    /// any answer is read (one flight instead of a round trip per table).
    /// A list of float32 arrays in the order of `reads`, or None as `pull`.
    fn pull_many<'py>(
        &self,
        py: Python<'py>,
        reads: Vec<(String, Bound<'py, PyAny>)>,
    ) -> PyResult<Option<Vec<Bound<'py, PyAny>>>> {
        if self.done {
            return Err(err(format!("step {} is over", self.info.step)));
        }
        let ids: Vec<Vec<u64>> = reads.iter().map(|(t, ids)| ids_of(py, t, ids)).collect::<PyResult<_>>()?;
        let job = self.job.bind(py).borrow();
        let mut inner = lock_held(py, &job.inner);
        let mark = self.mark();
        let tables = &mut inner.tables;
        let dims: Vec<usize> =
            reads.iter().map(|(t, _)| tables.dim(t)).collect::<anyhow::Result<_>>().map_err(anyhow_err)?;
        let step = self.info.step;
        let asked: Vec<(&str, &[u64])> =
            reads.iter().zip(&ids).map(|((t, _), ids)| (t.as_str(), &ids[..])).collect();
        match py.detach(|| tables.pull_many(&asked, mark, step)) {
            Ok(rows) => rows
                .iter()
                .zip(ids.iter().zip(dims))
                .map(|(r, (ids, dim))| float_array(py, r, (ids.len(), dim)))
                .collect::<PyResult<Vec<_>>>()
                .map(Some),
            Err(e) => abandon_for(py, &mut inner, e).map(|()| None),
        }
    }

    /// This rank's gradients of sparse table `table`'s rows `ids` (float32
    /// `[len(ids), dim]`; a repeated id's rows are summed): applied on the
    /// servers, summed over the ranks, once every rank's push of the step
    /// is in. Each table at most once a step; a table not pushed is pushed
    /// empty at the commit. Sent without waiting for the servers, whose
    /// answers are read at the commit: a refusal there (a server gone, the
    /// generation over) abandons the step, which is redone. False when it
    /// could not be sent (the same): the step is abandoned and redone.
    fn push(
        &self,
        py: Python<'_>,
        table: &str,
        ids: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        if self.done {
            return Err(err(format!("step {} is over", self.info.step)));
        }
        let ids = ids_of(py, table, ids)?;
        let g = as_float32(py, grads)?;
        let buf = PyBuffer::<f32>::get(&g)?;
        let grads = buf.to_vec(py)?;
        let job = self.job.bind(py).borrow();
        let mut inner = lock_held(py, &job.inner);
        let tag = self.tag();
        let tables = &mut inner.tables;
        let dim = tables.dim(table).map_err(anyhow_err)?;
        if grads.len() != ids.len() * dim {
            return Err(PyValueError::new_err(format!(
                "table {table:?}: gradients of shape {:?} for {} ids of dimension {dim}",
                buf.shape(),
                ids.len()
            )));
        }
        match py.detach(|| tables.push(table, tag, &ids, &grads)) {
            Ok(()) => Ok(true),
            Err(e) => abandon_for(py, &mut inner, e).map(|()| false),
        }
    }

    /// Tells the squared norms of what a collective of this step gave
    /// (`local`: this rank's share of the mean gradient) and got back
    /// (`reduced`: the mean), numbers or 0-d tensors, read at the commit:
    /// how a DDP communication hook measures the gradient noise scale
    /// (`edl.torch.ElasticDDP` installs one). `step.all_reduce` measures
    /// its arrays itself.
    fn gradient_norms(&self, local: Py<PyAny>, reduced: Py<PyAny>) {
        if !self.done {
            self.norms.lock().unwrap_or_else(|e| e.into_inner()).push((local, reduced));
        }
    }

    /// Sums `arrays` (float32, writable, C-contiguous) over the generation's
    /// ring, in place. False when the ring broke: the step is abandoned and
    /// will be redone; the arrays are then left as they were.
    fn all_reduce(&mut self, py: Python<'_>, arrays: Vec<Bound<'_, PyAny>>) -> PyResult<bool> {
        if self.done {
            return Err(err(format!("step {} is over", self.info.step)));
        }
        let bufs = arrays
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let b = PyBuffer::<f32>::get(a).map_err(|e| {
                    PyValueError::new_err(format!("all_reduce: array {i} is not float32 ({e})"))
                })?;
                if b.readonly() || !b.is_c_contiguous() {
                    return Err(PyValueError::new_err(format!(
                        "all_reduce: array {i} is not writable and C-contiguous"
                    )));
                }
                Ok(b)
            })
            .collect::<PyResult<Vec<_>>>()?;
        let total: usize = bufs.iter().map(|b| b.item_count()).sum();
        let mut flat = vec![0.0f32; total];
        let mut at = 0;
        for b in &bufs {
            b.copy_to_slice(py, &mut flat[at..at + b.item_count()])?;
            at += b.item_count();
        }
        let job = self.job.bind(py).borrow();
        let mut inner = lock_held(py, &job.inner);
        let session = &mut inner.session;
        if py.detach(|| session.all_reduce(&mut flat)).is_err() {
            self.done = true;
            self.given_up = true;
            inner.current = None;
            return Ok(false);
        }
        drop(inner);
        let mut at = 0;
        for b in &bufs {
            b.copy_from_slice(py, &flat[at..at + b.item_count()])?;
            at += b.item_count();
        }
        Ok(true)
    }

    /// The step is done on this rank and its update applied to the state.
    /// `loss`: this rank's mean loss over its samples (weighted by its share
    /// of the step for the job's curve); `metrics` (`accuracy=0.93`, ...):
    /// numbers of the program's own, averaged the same way, shown in the
    /// progress, the report and the plot. A no-op on an abandoned step.
    #[pyo3(signature = (loss=0.0, **metrics))]
    fn commit(&mut self, py: Python<'_>, loss: f64, metrics: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        if self.done {
            return Ok(());
        }
        let (mut local, mut reduced) = (0.0, 0.0);
        let told = std::mem::take(&mut *self.norms.lock().unwrap_or_else(|e| e.into_inner()));
        for (l, r) in told {
            local += l.bind(py).extract::<f64>()?;
            reduced += r.bind(py).extract::<f64>()?;
        }
        if !loss.is_finite() {
            return Err(PyValueError::new_err(format!("step {}: loss {loss} is not finite", self.info.step)));
        }
        let mut named = Vec::new();
        for (k, v) in metrics.into_iter().flat_map(|d| d.iter()) {
            let name: String = k.extract()?;
            let value: f64 = v.extract().map_err(|_| {
                PyValueError::new_err(format!("step {}: metric {name:?} is not a number", self.info.step))
            })?;
            if !value.is_finite() {
                return Err(PyValueError::new_err(format!(
                    "step {}: metric {name:?} is {value}, not a finite number",
                    self.info.step
                )));
            }
            named.push((name, value));
        }
        let job = self.job.bind(py).borrow();
        let mut guard = lock_held(py, &job.inner);
        let inner = &mut *guard;
        let Some((_, started)) = inner.current.take() else {
            self.done = true;
            return Ok(());
        };
        let share = self.info.indices.len() as f64 / self.info.global_rows.max(1) as f64;
        let compute_ms = started.elapsed().as_secs_f64() * 1e3;
        let session = &mut inner.session;
        if local.is_finite() && reduced.is_finite() && (local > 0.0 || reduced > 0.0) {
            session.reduced_norms(local, reduced);
        }
        let weighted = named.into_iter().map(|(k, v)| (k, v * share)).collect();
        let (tag, tables) = (self.tag(), &mut inner.tables);
        if let Err(e) = py.detach(|| tables.finish(tag)) {
            // Not committed: redone by the next generation.
            self.done = true;
            self.given_up = true;
            return abandon_for(py, inner, e);
        }
        let session = &mut inner.session;
        py.detach(|| session.finish_with(loss * share, compute_ms, weighted)).map_err(anyhow_err)?;
        self.done = true;
        Ok(())
    }

    /// The teachers' logits for this step's samples, `[rows, classes]`
    /// float32, or None when the job does not distil. With a features
    /// function (`Job.from_env(features=...)`) they were read ahead; else
    /// `x` (this step's features, `[rows, dim]`) is sent now.
    #[pyo3(signature = (x=None))]
    fn teacher_logits<'py>(
        &self,
        py: Python<'py>,
        x: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let job = self.job.bind(py).borrow();
        if !job.distill {
            return Ok(None);
        }
        if self.done {
            return Err(err(format!("step {} is over", self.info.step)));
        }
        let mut guard = lock_held(py, &job.inner);
        let inner = &mut *guard;
        if self.info.indices.is_empty() {
            return Ok(Some(float_array(py, &[], (0, 0))?));
        }
        let x = features_to_send(py, x.as_ref(), inner.features.is_some())?;
        let key = (self.info.generation, self.info.step);
        ensure_teach(inner, key)?;
        let teach = inner.teach.as_mut().expect("started above");
        match x {
            Some(x) => teach.feed_rows(key, x, self.info.indices.len()),
            None => {
                let ahead = inner.session.planned().map(|s| ((s.generation, s.step), s.indices.clone()));
                teach.feed_indices(std::iter::once((key, self.info.indices.clone())).chain(ahead));
            }
        }
        if teach.fed.pop_front() != Some(key) {
            inner.teach = None;
            return Err(err(format!("teacher read-ahead is not at step {}", self.info.step)));
        }
        // This student calls its share of the teachers.
        teach.reader.place(self.info.rank, self.info.world);
        let asked = std::time::Instant::now();
        let got = teach.next_soft_labels(py, &inner.rt);
        // What the job's teacher pool is sized by, as for the built-in student.
        inner.session.waited_for_teachers(asked.elapsed().as_secs_f64() * 1e3);
        inner.session.called_teachers(teach.reader.take_calls());
        match got {
            Ok(d) => Ok(Some(float_array(py, &d.soft, (d.batch.ids.len(), d.classes))?)),
            Err(e) => {
                inner.teach = None;
                Err(err(format!("step {}: {e}", self.info.step)))
            }
        }
    }
}

/// This step's features to send to the teachers now: `x` as float32, or
/// None where the job's features function reads them ahead instead.
fn features_to_send(
    py: Python<'_>,
    x: Option<&Bound<'_, PyAny>>,
    by_features: bool,
) -> PyResult<Option<Vec<f32>>> {
    match (x, by_features) {
        (_, true) => Ok(None),
        (Some(x), false) => {
            let x = as_float32(py, x)?;
            let b = PyBuffer::<f32>::get(&x)?;
            Ok(Some(b.to_vec(py)?))
        }
        (None, false) => {
            Err(err("teacher_logits: pass this step's features, or give Job.from_env(features=...)"))
        }
    }
}

/// Makes sure the job's teacher reader is there for step `key`: a new
/// generation (or a failure, which dropped it) starts a new read-ahead.
fn ensure_teach(inner: &mut Inner, key: (u64, u64)) -> PyResult<()> {
    if inner.teach.as_ref().is_some_and(|t| t.fed.front().is_some_and(|&f| f.0 != key.0 || f > key)) {
        inner.teach = None;
    }
    if inner.teach.is_none() {
        inner.teach = Some(start_teach(inner).map_err(anyhow_err)?);
    }
    Ok(())
}

impl Teach {
    /// Sends step `key`'s features `x` (`rows` rows) to the teachers.
    fn feed_rows(&mut self, key: (u64, u64), x: Vec<f32>, rows: usize) {
        if self.feed.send(Feed::Rows { x, rows }).is_ok() {
            self.fed.push_back(key);
        }
    }

    /// Hands the features function the samples of each step in `steps`
    /// (this one, then those planned after it) not fed yet, to read ahead.
    fn feed_indices(&mut self, steps: impl IntoIterator<Item = ((u64, u64), Vec<u32>)>) {
        for (k, ids) in steps {
            if ids.is_empty() || self.fed.back().is_some_and(|&b| b >= k) {
                continue;
            }
            if self.feed.send(Feed::Indices(ids)).is_ok() {
                self.fed.push_back(k);
            }
        }
    }

    /// The soft labels of the step fed first, waited for up to 120 s
    /// without the GIL; else why there are none.
    fn next_soft_labels(
        &mut self,
        py: Python<'_>,
        rt: &tokio::runtime::Runtime,
    ) -> Result<Distilled, String> {
        let reader = &mut self.reader;
        let got = py.detach(|| {
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(120), reader.next()).await })
        });
        match got {
            Err(_) => Err("no soft labels within 120 s".to_string()),
            Ok(None) => Err(self
                .source_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_else(|| "the teacher reader ended".into())),
            Ok(Some(Err(e))) => Err(format!("teachers: {e}")),
            Ok(Some(Ok(d))) => Ok(d),
        }
    }
}

fn start_teach(inner: &mut Inner) -> anyhow::Result<Teach> {
    let spec = inner.session.spec();
    let teachers = match spec.teachers.clone() {
        Some(TeacherSource::Fixed(list)) => Teachers::Fixed(list),
        Some(TeacherSource::Discovered { store, service }) => {
            let _guard = inner.rt.enter();
            let store = Arc::new(edl_runtime::store::AnyStore::open(&store)?);
            let key =
                edl_runtime::leader::seal::RecordKey::teacher_registrations(&inner.session.auth().secret);
            Teachers::Discovered { store, service, key }
        }
        Some(TeacherSource::InProcess { .. }) => {
            anyhow::bail!(
                "the job's teacher is computed in the built-in students' processes, not served to a program"
            )
        }
        None => anyhow::bail!("the job has no teachers"),
    };
    let config = spec.teacher_calls.apply(DistillConfig {
        model_name: spec.teacher_model_name.clone(),
        read_ahead: 4,
        wait_for_teachers: Duration::from_millis(spec.teacher_wait_ms),
        access: spec.teacher_access.clone(),
        io: spec.teacher_io.clone(),
        ..DistillConfig::default()
    });
    let (feed, fed_rx) = mpsc::channel::<Feed>();
    let features = Python::attach(|py| inner.features.as_ref().map(|f| f.clone_ref(py)));
    let source_error = Arc::new(Mutex::new(None));
    let errors = source_error.clone();
    let batches = std::iter::from_fn(move || {
        let f = fed_rx.recv().ok()?;
        match batch_of(&features, f) {
            Ok(b) => Some(b),
            Err(e) => {
                *errors.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                None
            }
        }
    });
    let _guard = inner.rt.enter();
    let reader = DistillReader::start(batches, None, teachers, config);
    Ok(Teach { feed, fed: VecDeque::new(), reader, source_error })
}

fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("EDL_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init();
    });
}

/// The built-in student's data, split as the runtime splits it:
/// `{"train_x", "train_y", "test_x", "test_y"}` (float32 rows, int64 labels).
/// `name`: `mnist5k` or `digits`.
#[pyfunction]
#[pyo3(signature = (name="mnist5k"))]
fn builtin_data<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
    let model = edl_runtime::job::BuiltinModel {
        dataset: name.into(),
        test_rows: if name == "digits" { 400 } else { 1000 },
        split_seed: 1,
        train_samples: None,
        layers: Vec::new(),
    };
    let (train, test) = edl_runtime::trainer::worker::load_data(&model).map_err(anyhow_err)?;
    let d = PyDict::new(py);
    for (prefix, set) in [("train", &train), ("test", &test)] {
        d.set_item(format!("{prefix}_x"), float_array(py, &set.features, (set.len(), set.dim))?)?;
        let labels: Vec<u32> = set.labels.clone();
        d.set_item(format!("{prefix}_y"), indices_array(py, &labels)?)?;
    }
    Ok(d)
}

/// A checkpoint's tensors, verified (each file against its sha256), as
/// `{name: float32 array}` in their shapes, and its manifest's step and
/// epoch: `edl.torch.load_checkpoint` puts them back into a model.
#[pyfunction]
fn read_checkpoint<'py>(py: Python<'py>, path: &str) -> PyResult<Bound<'py, PyDict>> {
    let r = py
        .detach(|| edl_runtime::checkpoint::Checkpoints::read_newest(std::path::Path::new(path)))
        .map_err(|e| err(format!("checkpoint {path}: {e}")))?;
    let tensors = PyDict::new(py);
    let np = py.import("numpy")?;
    for (t, range) in r.layout.ranges() {
        let flat = float_array(py, &r.values[range], (1, t.numel()))?;
        let shaped = np.getattr("reshape")?.call1((flat, t.shape.clone()))?;
        tensors.set_item(&t.name, shaped)?;
    }
    // The sparse tables: per table its ids (uint64), values [n, dim] and
    // optimiser state [n, slots * dim] (float32), update counts (uint32).
    let tables = PyDict::new(py);
    for t in &r.tables {
        let (n, dim) = (t.ids.len(), t.spec.dim);
        let width = t.spec.width();
        let (mut values, mut state) = (Vec::with_capacity(n * dim), Vec::with_capacity(n * (width - dim)));
        for row in t.rows.chunks_exact(width) {
            values.extend_from_slice(&row[..dim]);
            state.extend_from_slice(&row[dim..]);
        }
        let ids: Vec<u8> = t.ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        let updates: Vec<u8> = t.updates.iter().flat_map(|u| u.to_le_bytes()).collect();
        let one = PyDict::new(py);
        one.set_item(
            "ids",
            np.call_method1("frombuffer", (PyBytes::new(py, &ids), "uint64"))?.call_method0("copy")?,
        )?;
        one.set_item("values", float_array(py, &values, (n, dim))?)?;
        one.set_item("state", float_array(py, &state, (n, width - dim))?)?;
        one.set_item(
            "updates",
            np.call_method1("frombuffer", (PyBytes::new(py, &updates), "uint32"))?.call_method0("copy")?,
        )?;
        one.set_item("spec", serde_json::to_string(&t.spec).map_err(err)?)?;
        tables.set_item(&t.spec.name, one)?;
    }
    let d = PyDict::new(py);
    d.set_item("tensors", tensors)?;
    d.set_item("tables", tables)?;
    d.set_item("step", r.manifest.step)?;
    d.set_item("epoch", r.manifest.epoch)?;
    Ok(d)
}

/// The built-in student's initial weights for layer `sizes` (input first)
/// under `seed`: a list of `(weight [in, out], bias [out])` float32 arrays.
#[pyfunction]
fn mlp_init<'py>(
    py: Python<'py>,
    sizes: Vec<usize>,
    seed: u64,
) -> PyResult<Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
    if sizes.len() < 2 || sizes.contains(&0) {
        return Err(PyValueError::new_err(format!("sizes {sizes:?}: need two or more positive sizes")));
    }
    let m = edl_runtime::trainer::model::Mlp::random(&sizes, seed);
    m.layers
        .iter()
        .map(|l| {
            let b = float_array(py, &l.bias, (1, l.outputs))?.call_method1("reshape", (l.outputs,))?;
            Ok((float_array(py, &l.weight, (l.inputs, l.outputs))?, b))
        })
        .collect()
}

#[pymodule]
fn _edl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(builtin_data, m)?)?;
    m.add_function(wrap_pyfunction!(mlp_init, m)?)?;
    m.add_function(wrap_pyfunction!(read_checkpoint, m)?)?;
    m.add_class::<Job>()?;
    m.add_class::<Steps>()?;
    m.add_class::<StepView>()?;
    m.add_class::<Store>()?;
    m.add("EdlError", m.py().get_type::<EdlError>())?;
    Ok(())
}
