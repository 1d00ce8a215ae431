//! Flag groups more than one subcommand takes, and the parsers of their values.
//!
//! One name, one meaning, across subcommands: `--teachers` is always a list
//! of teacher endpoints, `--listen` always an address with an optional
//! port, and a duration or a cadence names its unit (`-secs`, `-ms`,
//! `-every-steps`). docs/training.md has the table of every flag and the
//! subcommands that take it; a unit test in `cli/mod.rs` keeps the two in step.

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

/// The scaling policy and batch adapter a job, a launched program or a
/// simulation runs with.
#[derive(Args)]
#[command(next_help_heading = "Plugins")]
pub struct PluginArgs {
    /// Scaling-policy plugin (`.wasm` component or native `.so`); a
    /// relative path not found here is also looked for beside the executable.
    #[arg(long, value_name = "FILE", default_value = "plugins/autoscale.wasm")]
    pub policy: PathBuf,
    /// Policy configuration, `key=value` (repeatable).
    #[arg(long = "policy-config", value_name = "KEY=VALUE", value_parser = parse_pair)]
    pub policy_config: Vec<(String, String)>,
    /// Batch-adapter plugin (called at each step and each resize).
    #[arg(long, value_name = "FILE")]
    pub adapter: Option<PathBuf>,
    /// Adapter configuration, `key=value` (repeatable).
    #[arg(long = "adapter-config", value_name = "KEY=VALUE", value_parser = parse_pair)]
    pub adapter_config: Vec<(String, String)>,
}

/// The reader transform, which the built-in worker applies to every batch
/// (and `simulate` to a standard one).
#[derive(Args)]
#[command(next_help_heading = "Plugins")]
pub struct TransformArgs {
    /// Reader-transform plugin, applied to every batch before teachers and
    /// student (`simulate` runs it once on a standard batch).
    #[arg(long, value_name = "FILE")]
    pub transform: Option<PathBuf>,
    /// Transform configuration, `key=value` (repeatable).
    #[arg(long = "transform-config", value_name = "KEY=VALUE", value_parser = parse_pair)]
    pub transform_config: Vec<(String, String)>,
}

/// The bounds of the world size, shared by every command that scales.
#[derive(Args)]
#[command(next_help_heading = "Workers and scaling")]
pub struct WorkerBounds {
    /// Fewest workers: the policy never goes below, and lost workers are
    /// replaced up to it.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub min_workers: u32,
    /// Most workers the policy may ask for.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub max_workers: u32,
    /// Workers at the start (default: --min-workers).
    #[arg(long, value_name = "N")]
    pub workers: Option<u32>,
}

impl WorkerBounds {
    /// Workers at the start.
    pub fn initial(&self) -> u32 {
        self.workers.unwrap_or(self.min_workers)
    }
}

/// How a job of steps scales: its bounds, how often the policy decides,
/// what a worker costs.
#[derive(Args)]
#[command(next_help_heading = "Workers and scaling")]
pub struct ScalingArgs {
    #[command(flatten)]
    pub bounds: WorkerBounds,
    /// Committed steps between two scaling-policy decisions.
    #[arg(long, alias = "decide-every", value_name = "STEPS", default_value_t = 8)]
    pub decide_every_steps: u64,
    /// Price of a worker-hour, shown to the policy.
    #[arg(long, value_name = "PRICE", default_value_t = 0.0)]
    pub price: f64,
    /// Workers kept started and ready outside the ring, within
    /// --max-workers: a growth or a lost worker's place takes one at the
    /// next step boundary, and another is started behind it.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warm_spares: u32,
}

/// The job's parameter servers, for programs with sparse tables.
#[derive(Args)]
#[command(next_help_heading = "Parameter servers")]
pub struct PsArgs {
    /// Parameter servers the job starts beside the coordinator (0: none):
    /// they hold the tables programs declare with `job.table(...)`.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub ps_servers: u32,
    /// Most memory each server's rows may take, MiB (0: no bound); new rows
    /// past it are refused, naming the table.
    #[arg(long, value_name = "MIB", default_value_t = 0)]
    pub ps_memory_mib: u64,
    /// Steps a pull may run ahead of the pushes applied (0: every step sees
    /// every update before it).
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub ps_staleness: u64,
    /// Servers holding each shard (1 or 2): with 2, every push is applied on
    /// a shard's owner and its replica, and a server lost loses nothing;
    /// with 1, the job goes back to its newest checkpoint.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub ps_replicas: usize,
    /// Most parameter servers (default: --ps-servers): another is started
    /// when a server's rows pass 80% of --ps-memory-mib (or a scaling
    /// policy that sizes them asks), and takes its share of the shards at
    /// the next step boundary.
    #[arg(long, value_name = "N")]
    pub max_ps: Option<u32>,
    /// Fewest parameter servers a scaling policy that sizes them may ask
    /// for (default 1, and at least --ps-replicas); below it (a lost server
    /// not replaced), the job starts more.
    #[arg(long, value_name = "N")]
    pub min_ps: Option<u32>,
    /// Start each parameter server by this command on a host of --ps-hosts
    /// (`sh -c`), instead of beside the coordinator: `ssh {host} {program}`,
    /// `srun -w {host} {program}`, `ip netns exec {host} {program}`.
    /// {program} is the server's command line; also {id}, {host}, {addr},
    /// {port}, {job}, {exe}. It stays in the foreground while the server serves.
    /// Without --ps-hosts the command places each server (`srun {program}`),
    /// which says its address. Under --scaler slurm without this flag, each
    /// server is an `srun` of its own.
    #[arg(long, value_name = "TEMPLATE")]
    pub ps_command: Option<String>,
    /// With --ps-command: hosts servers run on, `host[:slots]` or
    /// `name=addr[:slots]` (a node's name for the command, {host}, and the
    /// address the job reaches, {addr}), comma separated.
    #[arg(long, value_name = "HOSTS", value_delimiter = ',', requires = "ps_command")]
    pub ps_hosts: Vec<String>,
    /// With --ps-command: the port of each host's first server; its next
    /// ones serve on the ports after it. Under --scaler kubernetes: the
    /// port each server's Pod serves on. Default 8300.
    #[arg(long, value_name = "PORT")]
    pub ps_port: Option<u16>,
    /// Under --scaler kubernetes (each server a Pod of its own): the image
    /// the server Pods run, with `edl-runtime` on its PATH (default: --kube-image).
    #[arg(long, value_name = "IMAGE", conflicts_with = "ps_command")]
    pub ps_kube_image: Option<String>,
    /// Under --scaler kubernetes: a resource each server Pod asks for and is
    /// limited to, e.g. `memory=16Gi`, `cpu=4` (repeat for more). Without
    /// `memory`, a Pod asks for --ps-memory-mib and a quarter more, plus 256 MiB.
    #[arg(long, value_name = "NAME=QUANTITY", value_parser = parse_pair, conflicts_with = "ps_command")]
    pub ps_kube_resource: Vec<(String, String)>,
    /// Under --scaler kubernetes: a node label the server Pods must match,
    /// e.g. `node.kubernetes.io/instance-type=r6i.4xlarge` (repeat for more).
    #[arg(long, value_name = "LABEL=VALUE", value_parser = parse_pair, conflicts_with = "ps_command")]
    pub ps_kube_node_selector: Vec<(String, String)>,
}

/// What a job trains with: epochs and the starting hyperparameters.
#[derive(Args)]
#[command(next_help_heading = "Training")]
pub struct TrainingArgs {
    /// Epochs to train.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub epochs: u64,
    /// Global batch at the start (the adapter may change it).
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub batch: u32,
    /// Learning rate at the start (the adapter may change it).
    #[arg(long, value_name = "LR", default_value_t = 0.05)]
    pub lr: f32,
    /// The largest global batch a batch adapter may choose (`goodput`'s
    /// bound); default 16 times --batch, at most the training samples.
    #[arg(long, value_name = "N")]
    pub batch_max: Option<u32>,
    /// SGD momentum, in [0, 1).
    #[arg(long, value_name = "M", default_value_t = 0.9)]
    pub momentum: f32,
    /// Seed of the student's weights and of the data order.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
}

/// Where a job keeps its state and checkpoints, and how often it writes them.
#[derive(Args)]
#[command(next_help_heading = "Checkpoints and state")]
pub struct StateArgs {
    /// Discovery and job state: `memory` (embedded) or `redis://host:port`
    /// (a URL with a password is better given in $EDL_STORE than on a command line).
    #[arg(long, value_name = "URL", default_value = "memory", env = "EDL_STORE", hide_env_values = true)]
    pub store: String,
    /// Where checkpoints go: a directory, or object storage shared by every
    /// host (`s3://bucket/prefix`, `gs://...`, `az://...`, credentials from
    /// the usual AWS_/GOOGLE_/AZURE_ environment). Default: .edl/<job>/checkpoints.
    #[arg(long, value_name = "DIR|URL")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoints kept.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Committed steps between checkpoints (one is also written at each
    /// epoch's end and after --checkpoint-secs of training).
    #[arg(long, alias = "checkpoint-every", value_name = "STEPS")]
    pub checkpoint_every_steps: Option<u64>,
    /// Longest training time between two checkpoints, seconds (one is also
    /// written at each epoch's end).
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub checkpoint_secs: u64,
    /// When another coordinator runs the job (its lock here, its lease in
    /// the store), wait as its standby and take the job over when it is
    /// gone, instead of refusing to start. With a shared --store the job
    /// goes on from its last stored commit and the workers come back to
    /// this coordinator with their state.
    #[arg(long)]
    pub standby: bool,
    /// Train a job that finished before again, from step 0. Without it, a
    /// coordinator (or standby) that finds the job finished says so, names
    /// its final checkpoint and exits 0. The finished run's checkpoints are
    /// set aside (`finished-step-*`) and removed only once the new run has
    /// finished too. A job that has not finished resumes, as without it. Not with --standby (a standby that restarted every job
    /// it found finished would train it again and again).
    #[arg(long, conflicts_with = "standby")]
    pub restart: bool,
}

/// Where a job's students get soft labels, and how they call teachers.
#[derive(Args)]
#[command(next_help_heading = "Distillation")]
pub struct DistillationArgs {
    /// Train on hard labels only: no teachers.
    #[arg(long)]
    pub no_distill: bool,
    /// Teacher endpoints, comma separated: `host:port`, `host:port/model[/version]`,
    /// `grpcs://` for gRPC over TLS, `http(s)://` for KServe v2 over REST, `@probs`
    /// or `@logits` after one that says what it returns.
    #[arg(long, alias = "teacher-addrs", value_name = "ENDPOINTS", value_parser = parse_teachers)]
    pub teachers: Option<TeachersArg>,
    /// Service name teachers register under in --store (default: <job>-teachers).
    #[arg(long, value_name = "NAME")]
    pub service: Option<String>,
    /// Seconds a worker waits with no teacher answering before the job
    /// stops, naming the teachers (below --step-timeout-secs).
    #[arg(long, value_name = "SECS", default_value_t = 20)]
    pub teacher_wait_secs: u64,
    #[command(flatten)]
    pub teacher_calls: TeacherCallArgs,
    #[command(flatten)]
    pub teacher_io: TeacherIoArgs,
    #[command(flatten)]
    pub teacher_access: TeacherAccessArgs,
}

/// `--teachers`: endpoints. A bare number is the count of teacher
/// processes the built-in job starts, the flag's old meaning there (a
/// number is never an endpoint, so the two cannot be confused).
#[derive(Clone, Debug, PartialEq)]
pub enum TeachersArg {
    Endpoints(Vec<String>),
    Count(u32),
}

impl TeachersArg {
    /// The endpoints, for a subcommand (`sub`) that starts no teachers.
    pub fn endpoints(&self, sub: &str) -> Result<Vec<String>> {
        match self {
            TeachersArg::Endpoints(list) => Ok(list.clone()),
            TeachersArg::Count(n) => bail!(
                "--teachers {n}: `{sub}` starts no teacher processes (that is the built-in job's \
                 --teacher-processes); give the teachers' endpoints, host:port,..."
            ),
        }
    }
}

/// Why a flag's value was refused (clap shows it after the flag's name).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    #[error("expected teacher endpoints, host:port,...")]
    NoTeachers,
    /// A `--job` name the runtime refuses, and why.
    #[error(transparent)]
    JobName(#[from] edl_runtime::job::JobNameError),
    #[error("expected key=value, got {0:?}")]
    NotAPair(String),
    #[error("{0:?}: expected an address (10.0.0.5) or address:port (0.0.0.0:7070)")]
    NotAnAddress(String),
    #[error("{given:?}: a worker's ring listens on a new port each generation; give the address only ({ip})")]
    RingPort { given: String, ip: IpAddr },
}

/// Parses `--teachers`: a count of teacher processes, or endpoints.
pub fn parse_teachers(s: &str) -> Result<TeachersArg, FlagError> {
    if let Ok(n) = s.trim().parse::<u32>() {
        return Ok(TeachersArg::Count(n));
    }
    let list = edl_runtime::distill::endpoints(s);
    if list.is_empty() {
        return Err(FlagError::NoTeachers);
    }
    Ok(TeachersArg::Endpoints(list))
}

/// Which tensors students send and read, and what the outputs hold.
#[derive(Args)]
#[command(next_help_heading = "Distillation")]
pub struct TeacherIoArgs {
    /// The input to send the features as (default: the model's first input,
    /// from its metadata; FP32 or FP64).
    #[arg(long, value_name = "NAME")]
    pub teacher_input: Option<String>,
    /// The output to read (default: `logits`, `probs`, `probabilities`,
    /// `predict_proba` or `output_probability` if the model has one, else
    /// its first floating-point output).
    #[arg(long, value_name = "NAME")]
    pub teacher_output_name: Option<String>,
    /// What the teachers' outputs hold: `logits` or `probs` (turned into
    /// log-probabilities). A teacher given as `host:port[/model]@probs` or
    /// `@logits` says so for itself, so a fleet may mix them.
    #[arg(long, value_name = "KIND", default_value = "logits")]
    pub teacher_output: edl_runtime::distill::OutputKind,
}

impl TeacherIoArgs {
    pub fn io(&self) -> edl_runtime::distill::TeacherIo {
        edl_runtime::distill::TeacherIo {
            input_name: self.teacher_input.clone(),
            output_name: self.teacher_output_name.clone(),
            output: self.teacher_output,
        }
    }
}

/// How students call their teachers.
#[derive(Args)]
#[command(next_help_heading = "Distillation")]
pub struct TeacherCallArgs {
    /// Longest a teacher may take to answer one request, ms (then it is
    /// retried elsewhere and the teacher rests).
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub teacher_timeout_ms: u64,
    /// Rows per teacher request.
    #[arg(long, value_name = "ROWS", default_value_t = 64)]
    pub teacher_batch: usize,
    /// Requests in flight per teacher.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub teacher_in_flight: usize,
    /// How long a teacher rests after a failure, ms; doubled after each
    /// failure in a row, up to 30 s.
    #[arg(long, value_name = "MS", default_value_t = 2000)]
    pub teacher_cooldown_ms: u64,
}

impl TeacherCallArgs {
    pub fn calls(&self) -> edl_runtime::distill::TeacherCalls {
        edl_runtime::distill::TeacherCalls {
            request_timeout_ms: self.teacher_timeout_ms,
            teacher_batch: self.teacher_batch,
            in_flight: self.teacher_in_flight,
            cooldown_ms: self.teacher_cooldown_ms,
        }
    }
}

/// How students reach teachers that need a token or serve TLS.
#[derive(Args)]
#[command(next_help_heading = "Distillation")]
pub struct TeacherAccessArgs {
    /// A file holding the bearer token sent on every teacher call.
    #[arg(long, value_name = "FILE")]
    pub teacher_token_file: Option<PathBuf>,
    /// CA certificate (PEM) that teachers' TLS certificates are checked
    /// against; with it, teachers given as `host:port` are reached over TLS
    /// (`grpcs://` and `https://` teachers are, always; without a CA, against the web PKI roots).
    #[arg(long, value_name = "FILE")]
    pub teacher_ca: Option<PathBuf>,
    /// Send the teacher token to teachers reached without TLS too (on a
    /// network trusted as a whole); without it they are refused.
    #[arg(long)]
    pub allow_insecure_token: bool,
}

impl TeacherAccessArgs {
    pub fn read(&self) -> Result<edl_runtime::distill::TeacherAccess> {
        Ok(edl_runtime::distill::TeacherAccess {
            token: read_token(self.teacher_token_file.as_deref(), "--teacher-token-file")?,
            ca_pem: match &self.teacher_ca {
                Some(f) => Some(
                    std::fs::read_to_string(f).with_context(|| format!("--teacher-ca {}", f.display()))?,
                ),
                None => None,
            },
            allow_insecure_token: self.allow_insecure_token,
        })
    }
}

/// Where the coordinator listens and how it starts workers.
#[derive(Args)]
#[command(next_help_heading = "Cluster")]
pub struct ClusterArgs {
    /// Where the coordinator listens: an address (`0.0.0.0` for every
    /// interface), optionally with its control port (`10.0.0.5:7070`;
    /// without one, any free port). Loopback keeps the job on this machine.
    #[arg(long, value_name = "ADDR[:PORT]", default_value = "127.0.0.1", value_parser = listen_on(0))]
    pub listen: SocketAddr,
    /// Host name or address workers and teachers on other hosts reach the
    /// coordinator at (default: the --listen address; this host's routable
    /// address when listening on every interface).
    #[arg(long, value_name = "HOST")]
    pub advertise: Option<String>,
    /// Port of the rendezvous where each generation's ring meets (default: any free one).
    #[arg(long, value_name = "PORT", default_value_t = 0)]
    pub rendezvous_port: u16,
    /// How workers are started: `local` (child processes here), `command`
    /// (--worker-command per worker, on --hosts: ssh, srun, ...), `slurm`
    /// (a Slurm batch job per worker), `kubernetes` (a Pod per worker),
    /// `external` (started by another engine; they join with
    /// `edl-runtime worker`).
    #[arg(long, value_name = "KIND", value_enum, default_value_t = ScalerKind::Local)]
    pub scaler: ScalerKind,
    /// With --scaler command: the command that starts worker {id}, run with
    /// `sh -c`; placeholders {id} {coordinator} {host} {slot} {job} {exe}. The
    /// job's secret comes on its standard input (`--secret-file -`).
    #[arg(long, value_name = "CMD", required_if_eq("scaler", "command"))]
    pub worker_command: Option<String>,
    /// With --scaler command: a command that stops worker {id} (scancel,
    /// kubectl delete, ...), run after the worker was told to stop and
    /// did not exit within the grace.
    #[arg(long, value_name = "CMD", requires = "worker_command")]
    pub worker_stop_command: Option<String>,
    /// With --scaler command: hosts to start workers on, `host` or
    /// `host:slots`, comma separated ({host} in the command).
    #[arg(long, value_name = "HOSTS", value_delimiter = ',', requires = "worker_command")]
    pub hosts: Vec<String>,
    /// The workers of each host reach the coordinator through one relay
    /// process there (`edl-runtime relay`), one connection for all of them
    /// instead of one each; lost, it is a host's loss, and the next worker
    /// started there starts another. With --scaler local (this host),
    /// command (each of --hosts), slurm (each node, a batch job) and
    /// kubernetes (each node, a Pod, found through the job's Service).
    #[arg(long)]
    pub relay: bool,
    /// The job's secret (64 hex digits), which every worker proves on its
    /// connections: read from this file, or written there (mode 0600) when
    /// it does not exist. Default: a new secret per run in .edl/<job>/secret.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Send the gradient ring's data in clear, authenticated only (nothing
    /// changed, forged or replayed gets through, but it can be read on the
    /// way). Control, rendezvous and store traffic is always encrypted, and
    /// so is the ring unless this is given. See docs/benchmarks.md for what
    /// each costs.
    #[arg(long)]
    pub gradients_in_clear: bool,
    #[command(flatten)]
    pub slurm: SlurmArgs,
    #[command(flatten)]
    pub kube: KubeArgs,
}

/// How `--scaler kubernetes` makes the worker Pods.
#[derive(Args)]
#[command(next_help_heading = "Kubernetes (--scaler kubernetes)")]
pub struct KubeArgs {
    /// The image the worker Pods run (with `edl-runtime` on its PATH, or
    /// your program under `launch`).
    #[arg(long, value_name = "IMAGE", required_if_eq("scaler", "kubernetes"))]
    pub kube_image: Option<String>,
    /// The Kubernetes Secret holding the job's secret under the key
    /// `secret` (mounted read-only into each worker Pod).
    #[arg(long, value_name = "NAME", required_if_eq("scaler", "kubernetes"))]
    pub kube_secret: Option<String>,
    /// The namespace of the worker Pods (default: the coordinator's own).
    #[arg(long, value_name = "NAME")]
    pub kube_namespace: Option<String>,
    /// GPUs each worker Pod asks for (`nvidia.com/gpu`).
    #[arg(long, value_name = "N")]
    pub kube_gpus: Option<u32>,
    /// What owns the worker Pods: `pod` (the coordinator's Pod: they go
    /// with it) or `controller` (its Deployment's ReplicaSet: they outlive
    /// one coordinator Pod, for standby coordinators).
    #[arg(long, value_name = "KIND", value_enum, default_value_t = KubeOwner::Pod)]
    pub kube_owner: KubeOwner,
    /// A worker Pod not running after this many seconds is deleted and
    /// reported (a parameter server's Pod: not serving).
    #[arg(long, value_name = "SECS", default_value_t = 300)]
    pub kube_pending_secs: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KubeOwner {
    Pod,
    Controller,
}

impl KubeArgs {
    pub fn options(&self) -> edl_runtime::scalers::kubernetes::KubeOptions {
        use edl_runtime::scalers::kubernetes::{KubeOptions, Owner};
        KubeOptions {
            namespace: self.kube_namespace.clone(),
            image: self.kube_image.clone().unwrap_or_default(),
            secret: self.kube_secret.clone().unwrap_or_default(),
            gpus: self.kube_gpus,
            owner: match self.kube_owner {
                KubeOwner::Pod => Owner::Pod,
                KubeOwner::Controller => Owner::Controller,
            },
            pending_bound: std::time::Duration::from_secs(self.kube_pending_secs.max(1)),
            // The downward API's name, else the host name a Pod is given.
            pod_name: std::env::var("POD_NAME").ok().or_else(|| {
                std::env::var("KUBERNETES_SERVICE_HOST").ok().and_then(|_| std::env::var("HOSTNAME").ok())
            }),
        }
    }
}

/// Where `--scaler slurm` submits the workers.
#[derive(Args)]
#[command(next_help_heading = "Slurm (--scaler slurm)")]
pub struct SlurmArgs {
    /// The partition workers are submitted to; its idle nodes are the free
    /// capacity the scaling policy is told of.
    #[arg(long, value_name = "NAME")]
    pub slurm_partition: Option<String>,
    /// The account workers are charged to.
    #[arg(long, value_name = "NAME")]
    pub slurm_account: Option<String>,
    /// The quality of service workers run under.
    #[arg(long, value_name = "NAME")]
    pub slurm_qos: Option<String>,
    /// One more `sbatch` option for every worker, as it is (repeatable):
    /// `--slurm-arg=--time=2:00:00 --slurm-arg=--gres=gpu:1`.
    #[arg(long = "slurm-arg", value_name = "OPTION", allow_hyphen_values = true)]
    pub slurm_args: Vec<String>,
    /// A worker Slurm has not started after this many seconds is cancelled
    /// and reported (the job goes on without it).
    #[arg(long, value_name = "SECS", default_value_t = 300)]
    pub slurm_pending_secs: u64,
}

impl SlurmArgs {
    pub fn options(&self) -> edl_runtime::scalers::slurm::SlurmOptions {
        edl_runtime::scalers::slurm::SlurmOptions {
            partition: self.slurm_partition.clone(),
            account: self.slurm_account.clone(),
            qos: self.slurm_qos.clone(),
            extra: self.slurm_args.clone(),
            pending_bound: std::time::Duration::from_secs(self.slurm_pending_secs.max(1)),
        }
    }
}

/// How workers are started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScalerKind {
    Local,
    Command,
    Slurm,
    Kubernetes,
    External,
}

/// The bounds after which a worker or a step is given up.
#[derive(Args)]
#[command(next_help_heading = "Failure detection")]
pub struct LivenessArgs {
    /// Seconds a rank that owes steps may go without reporting any before it
    /// is declared dead (it reports each window of steps it finishes).
    #[arg(long, value_name = "SECS", alias = "step-timeout", default_value_t = 60)]
    pub step_timeout_secs: u64,
    /// Bound on every collective, milliseconds (with no byte from the previous rank).
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub collective_timeout_ms: u64,
    /// Seconds a worker may go without being heard (its heartbeats come a
    /// few times per lease) before it is declared dead and the job goes on without it.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    pub worker_lease_secs: u64,
    /// Seconds a worker that lost its connection to the coordinator keeps
    /// trying to reach it again, to hear where it stands: a worker the job
    /// went on without is refused (its generation is over) and exits with
    /// that reason; one that reaches nothing exits when the time is up.
    /// With a shared --store it follows a coordinator that took the job
    /// over meanwhile (the store names it).
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub worker_reconnect_secs: u64,
    /// Seconds a worker asked for may take to join before it is given up.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub join_timeout_secs: u64,
    /// Seconds the coordinator's loop may go without coming back to its
    /// workers (a native plugin that never returns, a file system that
    /// hangs) before the coordinator ends, saying where its thread is,
    /// rather than hold the job's lease and workers while it trains
    /// nothing; the teacher pool's loop past it is said, and the job goes
    /// on (0: never).
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub loop_stall_secs: u64,
    /// Restarts after the same failure before the job gives up. A job of
    /// steps: every worker lost to the same program error (its exception)
    /// at about the same step, from the same checkpoint (default 1: once more,
    /// then the job ends with the traceback). With --torchrun: group
    /// restarts after rank failures (default 3; resizes do not count).
    #[arg(long, value_name = "N")]
    pub max_restarts: Option<u32>,
}

/// What a run writes besides its output lines.
#[derive(Args)]
#[command(next_help_heading = "Output")]
pub struct OutputArgs {
    /// Write the run's report (JSON) here.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Draw world size, throughput and loss over time to this SVG file.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
}

/// Watching a job while it runs: its live page and its metrics.
#[derive(Args)]
#[command(next_help_heading = "Watching")]
pub struct WatchArgs {
    /// Serve the job's live page (`/`) and its Prometheus metrics
    /// (`/metrics`) on ADDR[:PORT] (port 9464 when none is given; 0 picks a
    /// free one). Beyond loopback only with --metrics-tls-cert/--metrics-tls-key
    /// and --metrics-token-file.
    #[arg(long, value_name = "ADDR[:PORT]", value_parser = listen_on(9464))]
    pub metrics_listen: Option<SocketAddr>,
    /// A file holding the token every request for the job's state and
    /// metrics must carry (`Authorization: Bearer TOKEN`); in a browser, open
    /// the page as `/#token=TOKEN` (it sends the token on in a header).
    #[arg(long, value_name = "FILE", requires = "metrics_listen")]
    pub metrics_token_file: Option<PathBuf>,
    /// Serve the page and the metrics over HTTPS with this certificate (PEM,
    /// with its chain).
    #[arg(long, value_name = "FILE", requires_all = ["metrics_listen", "metrics_tls_key"])]
    pub metrics_tls_cert: Option<PathBuf>,
    /// The key of --metrics-tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "metrics_tls_cert")]
    pub metrics_tls_key: Option<PathBuf>,
    /// Write the job's curves (loss, the program's metrics, samples/s,
    /// workers, batch, learning rate, teachers) as TensorBoard event files
    /// into DIR (`tensorboard --logdir DIR`).
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
}

/// The plugin sandbox: flags of every subcommand, before or after it.
#[derive(Args)]
#[command(next_help_heading = "Plugin sandbox")]
pub struct SandboxArgs {
    /// CPU deadline of one plugin call, in milliseconds.
    #[arg(long, value_name = "MS", global = true, default_value_t = 100)]
    pub plugin_deadline_ms: u64,
    /// Memory cap of one plugin instance, in MiB.
    #[arg(long, value_name = "MIB", global = true, default_value_t = 64)]
    pub plugin_memory_mib: usize,
    /// Directory of compiled plugins (default: $EDL_PLUGIN_CACHE or ~/.cache/edl/plugins).
    #[arg(long, value_name = "DIR", global = true)]
    pub plugin_cache: Option<PathBuf>,
    /// Compile plugins at every load.
    #[arg(long, global = true)]
    pub no_plugin_cache: bool,
    /// Allow native plugin libraries (.so/.dylib/.dll): they run unsandboxed,
    /// with this process's rights, and are refused without this flag.
    #[arg(long, global = true)]
    pub allow_native: bool,
}

/// A `--job` name ([`edl_runtime::job::check_job_name`]).
pub fn job_name(s: &str) -> Result<String, FlagError> {
    edl_runtime::job::check_job_name(s).map(|()| s.to_string()).map_err(FlagError::JobName)
}

/// Parses `key=value`.
pub fn parse_pair(s: &str) -> Result<(String, String), FlagError> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .ok_or_else(|| FlagError::NotAPair(s.to_string()))
}

/// Parses `--listen`: an address with or without a port (`0.0.0.0`,
/// `10.0.0.5:7070`, `[::]:7070`, `::`); without one, `default_port`.
pub fn listen_on(default_port: u16) -> impl Fn(&str) -> Result<SocketAddr, FlagError> + Clone + Send + Sync {
    move |s: &str| {
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(a);
        }
        s.trim_matches(|c| c == '[' || c == ']')
            .parse::<IpAddr>()
            .map(|ip| SocketAddr::new(ip, default_port))
            .map_err(|_| FlagError::NotAnAddress(s.to_string()))
    }
}

/// Parses a worker's `--listen`: an address; a port, if given, must be 0,
/// since the ring takes a new port each generation.
pub fn parse_ring_listen(s: &str) -> Result<IpAddr, FlagError> {
    let a = listen_on(0)(s)?;
    if a.port() != 0 {
        return Err(FlagError::RingPort { given: s.to_string(), ip: a.ip() });
    }
    Ok(a.ip())
}

/// A bearer token from a file (its first line), never from a command line.
pub fn read_token(file: Option<&Path>, flag: &str) -> Result<Option<String>> {
    let Some(f) = file else { return Ok(None) };
    let text = std::fs::read_to_string(f).with_context(|| format!("{flag} {}", f.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.is_empty() {
        bail!("{flag} {}: the file holds no token", f.display());
    }
    Ok(Some(token))
}

/// A non-negative number of seconds, named by its flag when it is not one.
pub fn secs(v: f64, flag: &str) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(v)
        .map_err(|_| anyhow::anyhow!("--{flag} {v}: expected a number of seconds >= 0"))
}

/// The job's name and secret for a process the job starts (a parameter
/// server, a relay): the secret from `secret_file` (`-`: standard input)
/// or $EDL_JOB_SECRET, the name from `job` or $EDL_JOB.
pub fn job_auth(
    secret_file: Option<&Path>,
    job: Option<String>,
) -> Result<edl_runtime::worker::session::JobAuth> {
    use edl_runtime::worker::session::{self, JobAuth};
    Ok(match (secret_file, job) {
        (Some(p), job) => {
            let job =
                job.or_else(|| std::env::var("EDL_JOB").ok()).context("--job or $EDL_JOB names the job")?;
            JobAuth { job, secret: session::read_secret(p).context("--secret-file")? }
        }
        (None, Some(job)) => JobAuth { job, secret: session::auth_from_env()?.secret },
        (None, None) => session::auth_from_env()?,
    })
}

/// For a process started by a command (ssh, srun) that holds its standard
/// input open while the job wants it: that input's end is the job's stop (a
/// signal to the local ssh reaches no process on the other host), so the
/// process exits then, saying so as `who`.
pub fn stop_when_stdin_closes(who: String, what: &'static str) {
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        eprintln!("{who}: standard input closed: the job let go of this {what}; stopping");
        std::process::exit(0);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_takes_an_address_with_or_without_a_port() {
        let teacher = listen_on(8001);
        assert_eq!(teacher("0.0.0.0").unwrap(), "0.0.0.0:8001".parse().unwrap());
        assert_eq!(teacher("10.0.0.5:7070").unwrap(), "10.0.0.5:7070".parse().unwrap());
        assert_eq!(teacher("[::1]").unwrap(), "[::1]:8001".parse().unwrap());
        assert_eq!(listen_on(0)("::").unwrap(), "[::]:0".parse().unwrap());
        assert!(teacher("node-1").unwrap_err().to_string().contains("expected an address"));
        assert_eq!(parse_ring_listen("10.0.0.5").unwrap(), "10.0.0.5".parse::<IpAddr>().unwrap());
        assert_eq!(parse_ring_listen("10.0.0.5:0").unwrap(), "10.0.0.5".parse::<IpAddr>().unwrap());
        assert!(
            parse_ring_listen("10.0.0.5:7070").unwrap_err().to_string().contains("new port each generation")
        );
    }

    #[test]
    fn teachers_are_endpoints_or_on_the_job_a_count() {
        assert_eq!(parse_teachers("2").unwrap(), TeachersArg::Count(2));
        assert_eq!(
            parse_teachers("a:1, b:2/m@probs").unwrap(),
            TeachersArg::Endpoints(vec!["a:1".into(), "b:2/m@probs".into()])
        );
        assert!(parse_teachers(" , ").is_err());
        let e = TeachersArg::Count(2).endpoints("launch").unwrap_err().to_string();
        assert!(e.contains("--teachers 2") && e.contains("--teacher-processes"), "{e}");
    }
}
