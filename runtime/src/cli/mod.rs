//! The `edl-runtime` command line: the flags of each subcommand and what runs them.

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use edl_host_gpu::Device;
use edl_plugin_sdk::{Hyperparams, testing::standard_batch};
use edl_runtime::{
    plot,
    plugin::{
        AdapterPlugin, ArtifactCache, HostOptions, Limits, PluginHost, PolicyPlugin, Reloading, World,
        replay::{self, Scenario, ScenarioEvent, SlowWorker, Trace},
        scaffold,
    },
};
use std::{path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

mod run;

#[derive(Parser)]
#[command(
    name = "edl-runtime",
    version,
    about = "Elastic deep-learning runtime with WebAssembly plugins",
    args_override_self = true
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
    #[command(flatten)]
    sandbox: SandboxArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Print the devices and CUDA libraries this machine offers.
    Devices,
    /// Serve a model as a teacher over the Open Inference Protocol (KServe v2 gRPC).
    Teacher(TeacherArgs),
    /// Pull soft labels for synthetic batches through the DistillReader from
    /// fixed teachers (any OIP server) or discovered ones; reports throughput.
    Distill(DistillArgs),
    /// Drive a scaling policy (and a batch adapter) against a simulated
    /// cluster: a quick look at a policy's behaviour without training.
    Simulate(SimArgs),
    /// Run your own training program as the job's workers:
    /// `edl-runtime launch --samples N [job flags] -- CMD ARGS...`. The
    /// program joins through the `edl` package (see docs/your-own-program.md).
    Launch(Box<LaunchArgs>),
    /// Join a job as one of its workers: what the coordinator starts, and
    /// what another engine (ssh, srun, Kubernetes) runs on other hosts.
    Worker(WorkerArgs),
    /// Work with plugin files.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum WorldArg {
    ScalingPolicy,
    BatchAdapter,
    ReaderTransform,
}

impl From<WorldArg> for World {
    fn from(w: WorldArg) -> World {
        match w {
            WorldArg::ScalingPolicy => World::ScalingPolicy,
            WorldArg::BatchAdapter => World::BatchAdapter,
            WorldArg::ReaderTransform => World::ReaderTransform,
        }
    }
}

#[derive(Subcommand)]
enum PluginCommand {
    /// Create a plugin crate: a working example, a unit test, a bench and a README.
    New {
        world: WorldArg,
        /// Crate name (lowercase letters, digits, '-', '_').
        name: String,
        /// Directory to create the crate in (default: the current one).
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Print a plugin's world, interface version, info, exports, size and cache state.
    Inspect { file: PathBuf },
    /// Run a policy over a trace (JSON lines of cluster views) or a scenario
    /// (a simulated cluster, see examples/traces/) and print its decisions.
    Replay {
        #[arg(long)]
        policy: PathBuf,
        #[arg(long)]
        trace: PathBuf,
        /// Draw world size and throughput over the steps to this SVG file.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Policy configuration, `key=value` (repeatable), as for the main command.
        #[arg(long = "policy-config", alias = "config", value_parser = parse_pair)]
        config: Vec<(String, String)>,
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
        /// Price of a worker-hour shown to the policy, in place of the
        /// trace's (`price_per_worker_hour`).
        #[arg(long)]
        price: Option<f64>,
    },
}

#[derive(Args)]
struct TeacherArgs {
    /// Address to serve on (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8001")]
    listen: std::net::SocketAddr,
    /// The model, a safetensors file of the runtime's MLP.
    #[arg(long)]
    model: PathBuf,
    /// Where to register: `memory` (this process only) or `redis://host:port`
    /// (a URL with a password is better given in $EDL_STORE).
    #[arg(long, default_value = "memory", env = "EDL_STORE", hide_env_values = true)]
    store: String,
    /// Host name or address students reach this teacher at, registered with
    /// the port (default: the listen address; this host's routable address
    /// when listening on all interfaces).
    #[arg(long)]
    advertise: Option<String>,
    /// Service name the teacher registers under.
    #[arg(long, default_value = "teachers")]
    service: String,
    /// A file holding the bearer token every call must carry
    /// (`authorization: Bearer TOKEN`); without it any client may call.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Serve TLS with this certificate (PEM, with its chain); needs --tls-key.
    /// The teacher registers as `grpcs://host:port`.
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// Model name clients ask for.
    #[arg(long, default_value = "teacher")]
    model_name: String,
    /// Most rows run through the model together (concurrent requests are batched up to it).
    #[arg(long, default_value_t = 512)]
    max_batch: usize,
    /// Longest the first request of a batch waits for others to join it, ms.
    #[arg(long, default_value_t = 2)]
    max_delay_ms: u64,
    /// Most rows one request may hold; larger ones are refused
    /// (RESOURCE_EXHAUSTED), and the transport refuses messages that could
    /// only hold more before reading them.
    #[arg(long, default_value_t = 4096)]
    max_request_rows: usize,
    /// Also serve KServe v2 over HTTP/REST on this address (`/v2/...`:
    /// health, metadata, infer with JSON or binary tensors, config, stats),
    /// with the same token (plain HTTP).
    #[arg(long)]
    http_listen: Option<std::net::SocketAddr>,
}

#[derive(Args)]
struct DistillArgs {
    /// Fixed teacher endpoints, comma separated: `host:port`, or
    /// `host:port/model[/version]` to ask that teacher for its own model;
    /// `grpcs://` in front for gRPC over TLS, `http://` or `https://` for a
    /// teacher that speaks KServe v2 over HTTP/REST.
    #[arg(long)]
    teachers: Option<String>,
    /// Store to discover teachers in (with --service), e.g. redis://127.0.0.1:6379.
    #[arg(long)]
    store: Option<String>,
    /// Service name the teachers registered under (with --store).
    #[arg(long, default_value = "teachers")]
    service: String,
    /// Model name asked of every teacher.
    #[arg(long, default_value = "teacher")]
    model_name: String,
    /// Features per sample the teachers take.
    #[arg(long, default_value_t = 784)]
    features: usize,
    /// Synthetic batches to read through the teachers.
    #[arg(long, default_value_t = 20)]
    batches: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    /// Seconds to wait for a teacher before failing.
    #[arg(long, default_value_t = 30)]
    wait_secs: u64,
    #[command(flatten)]
    teacher_calls: TeacherCallArgs,
    #[command(flatten)]
    teacher_io: TeacherIoArgs,
    #[command(flatten)]
    teacher_access: TeacherAccessArgs,
}

/// Which tensors students send and read, and what the outputs hold.
#[derive(Args)]
struct TeacherIoArgs {
    /// The input to send the features as (default: the model's first input,
    /// from its metadata; FP32 or FP64).
    #[arg(long)]
    teacher_input: Option<String>,
    /// The output to read (default: `logits`, `probs`, `probabilities`,
    /// `predict_proba` or `output_probability` if the model has one, else
    /// its first floating-point output).
    #[arg(long)]
    teacher_output_name: Option<String>,
    /// What the teachers' outputs hold: `logits` or `probs` (turned into
    /// log-probabilities). A teacher given as `host:port[/model]@probs` or
    /// `@logits` says so for itself, so a fleet may mix them.
    #[arg(long, default_value = "logits")]
    teacher_output: edl_runtime::distill::OutputKind,
}

impl TeacherIoArgs {
    fn io(&self) -> edl_runtime::distill::TeacherIo {
        edl_runtime::distill::TeacherIo {
            input_name: self.teacher_input.clone(),
            output_name: self.teacher_output_name.clone(),
            output: self.teacher_output,
        }
    }
}

/// How a job's students call their teachers.
#[derive(Args)]
struct TeacherCallArgs {
    /// Longest a teacher may take to answer one request, ms (then it is
    /// retried elsewhere and the teacher rests).
    #[arg(long, default_value_t = 5000)]
    teacher_timeout_ms: u64,
    /// Rows per teacher request.
    #[arg(long, default_value_t = 64)]
    teacher_batch: usize,
    /// Requests in flight per teacher.
    #[arg(long, default_value_t = 4)]
    teacher_in_flight: usize,
    /// How long a teacher rests after a failure, ms; doubled after each
    /// failure in a row, up to 30 s.
    #[arg(long, default_value_t = 2000)]
    teacher_cooldown_ms: u64,
}

impl TeacherCallArgs {
    fn calls(&self) -> edl_runtime::distill::TeacherCalls {
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
struct TeacherAccessArgs {
    /// A file holding the bearer token sent on every teacher call.
    #[arg(long)]
    teacher_token_file: Option<PathBuf>,
    /// CA certificate (PEM) that teachers' TLS certificates are checked
    /// against; with it, teachers given as `host:port` are reached over TLS
    /// (`grpcs://` and `https://` teachers are, always; without a CA, against the web PKI roots).
    #[arg(long)]
    teacher_ca: Option<PathBuf>,
}

impl TeacherAccessArgs {
    fn read(&self) -> Result<edl_runtime::distill::TeacherAccess> {
        Ok(edl_runtime::distill::TeacherAccess {
            token: read_token(self.teacher_token_file.as_deref(), "--teacher-token-file")?,
            ca_pem: match &self.teacher_ca {
                Some(f) => Some(
                    std::fs::read_to_string(f).with_context(|| format!("--teacher-ca {}", f.display()))?,
                ),
                None => None,
            },
        })
    }
}

/// The plugins a job (or a simulation) runs with.
#[derive(Args)]
struct PluginArgs {
    /// Scaling-policy plugin (`.wasm` component or native `.so`).
    #[arg(long, default_value = "plugins/autoscale.wasm")]
    policy: PathBuf,
    /// Batch-adapter plugin (called at each step and each resize).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Reader-transform plugin (applied to every batch; `simulate` runs it on a standard batch).
    #[arg(long)]
    transform: Option<PathBuf>,
    /// Policy configuration, `key=value` (repeatable).
    #[arg(long = "policy-config", value_parser = parse_pair)]
    policy_config: Vec<(String, String)>,
    /// Adapter configuration, `key=value` (repeatable).
    #[arg(long = "adapter-config", value_parser = parse_pair)]
    adapter_config: Vec<(String, String)>,
}

#[derive(Args)]
struct WorkerArgs {
    /// The coordinator's control port, `host:port`.
    #[arg(long)]
    coordinator: String,
    /// This worker's id (default: the coordinator gives one).
    #[arg(long, default_value_t = 0)]
    id: u64,
    /// The job's name (default: $EDL_JOB, else `mnist`, the coordinator's default).
    #[arg(long)]
    job: Option<String>,
    /// A file holding the job's secret, or `-` to read it from standard input
    /// (default: $EDL_JOB_SECRET). Never give the secret itself on a command line.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Address this worker's ring listens on (default: the address it
    /// reaches the coordinator from).
    #[arg(long)]
    listen: Option<std::net::IpAddr>,
    /// Address the other workers reach this one's ring at (behind NAT;
    /// default: the listen address).
    #[arg(long)]
    advertise: Option<std::net::IpAddr>,
}

#[derive(Args)]
struct LaunchArgs {
    /// The job's samples: steps hand each worker indices in 0..N.
    #[arg(long, required_unless_present = "torchrun")]
    samples: Option<usize>,
    /// Teachers' OIP endpoints (`host:port`, comma separated) that the
    /// program's steps get soft labels from (`step.teacher_logits`).
    #[arg(long = "teacher-addrs", value_delimiter = ',', conflicts_with = "torchrun")]
    teacher_addrs: Vec<String>,
    /// Run an unmodified torchrun script: its ranks get torchrun's
    /// environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and the whole group
    /// restarts when the policy changes its size or a rank fails.
    #[arg(long)]
    torchrun: bool,
    /// With --torchrun: group restarts after rank failures before the job
    /// gives up (resizes do not count).
    #[arg(long, default_value_t = 3, requires = "torchrun")]
    max_restarts: u32,
    /// With --torchrun: seconds between two scaling-policy decisions (each
    /// resize restarts the group, so not too often).
    #[arg(long, default_value_t = 30.0, requires = "torchrun")]
    decide_secs: f64,
    /// With --torchrun: seconds a stopped rank gets after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = 15.0, requires = "torchrun")]
    stop_grace_secs: f64,
    #[command(flatten)]
    run: RunArgs,
    /// The program and its arguments, run as each worker.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    plugins: PluginArgs,
    /// Transform configuration, `key=value` (repeatable).
    #[arg(long = "transform-config", value_parser = parse_pair)]
    transform_config: Vec<(String, String)>,
    /// Epochs to train.
    #[arg(long, default_value_t = 5)]
    epochs: u64,
    #[arg(long, default_value_t = 1)]
    min_workers: u32,
    #[arg(long, default_value_t = 4)]
    max_workers: u32,
    /// Workers at the start (default: --min-workers).
    #[arg(long)]
    workers: Option<u32>,
    /// Teacher processes to start (0: use teachers already registered in --store).
    #[arg(long, default_value_t = 2)]
    teachers: u32,
    /// Discovery and job state: `memory` (embedded) or `redis://host:port`
    /// (a URL with a password is better given in $EDL_STORE than on a command line).
    #[arg(long, default_value = "memory", env = "EDL_STORE", hide_env_values = true)]
    store: String,
    /// Where checkpoints go: a directory, or object storage shared by every
    /// host (`s3://bucket/prefix`, `gs://...`, `az://...`, credentials from
    /// the usual AWS_/GOOGLE_/AZURE_ environment). Default: .edl/<job>/checkpoints.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoints kept.
    #[arg(long, default_value_t = 3)]
    keep_checkpoints: usize,
    /// Steps between checkpoints (one is also written at each epoch's end
    /// and after --checkpoint-secs of training).
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Longest training time between two checkpoints, seconds (one is also
    /// written at each epoch's end).
    #[arg(long, default_value_t = 30)]
    checkpoint_secs: u64,
    /// Seed of the student's weights and of the data order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Train on hard labels only: no teachers.
    #[arg(long)]
    no_distill: bool,
    /// Write the run's report (JSON) here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Draw world size, throughput and loss over time to this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Job name (keys in the store, default directories).
    #[arg(long, default_value = "mnist")]
    job: String,
    /// `mnist5k` (4000 train / 1000 test) or `digits` (1397 / 400).
    #[arg(long, default_value = "mnist5k")]
    dataset: String,
    /// Train the student on the first N training samples only (a small transfer set).
    #[arg(long)]
    train_samples: Option<usize>,
    /// Student hidden layer sizes, comma separated.
    #[arg(long, default_value = "128")]
    hidden: String,
    /// Teacher hidden layer sizes, comma separated.
    #[arg(long, default_value = "512")]
    teacher_hidden: String,
    #[arg(long, default_value_t = 10)]
    teacher_epochs: u64,
    /// Global batch at the start.
    #[arg(long, default_value_t = 64)]
    batch: u32,
    #[arg(long, default_value_t = 0.05)]
    lr: f32,
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    /// Distillation temperature.
    #[arg(long, default_value_t = 4.0)]
    temperature: f32,
    /// Weight of the soft-label term (1 - alpha goes to the hard labels).
    #[arg(long, default_value_t = 0.7)]
    alpha: f32,
    /// Steps between two scaling-policy decisions.
    #[arg(long, default_value_t = 8)]
    decide_every: u64,
    /// Seconds a rank that owes steps may go without reporting any before it
    /// is declared dead (it reports each window of steps it finishes).
    #[arg(long, default_value_t = 60)]
    step_timeout: u64,
    /// Seconds a worker waits with no teacher answering before the job
    /// stops, naming the teachers (below --step-timeout).
    #[arg(long, default_value_t = 20)]
    teacher_wait_secs: u64,
    /// Bound on every collective, milliseconds.
    #[arg(long, default_value_t = 5000)]
    collective_timeout_ms: u64,
    /// Extra milliseconds each step takes on each worker (emulates slower devices).
    #[arg(long, default_value_t = 0)]
    step_delay_ms: u64,
    /// Where workers compute: `cpu`, `cuda` or `cuda:N` (cuBLAS and the CUDA
    /// loss kernel; checked before the job starts).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Price of a worker-hour, shown to the policy.
    #[arg(long, default_value_t = 0.0)]
    price: f64,
    /// Service name teachers register under (default: <job>-teachers).
    #[arg(long)]
    service: Option<String>,
    /// The job's secret (64 hex digits), which every worker proves on its
    /// connections: read from this file, or written there (mode 0600) when
    /// it does not exist. Default: a new secret per run in .edl/<job>/secret.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    #[command(flatten)]
    teacher_access: TeacherAccessArgs,
    #[command(flatten)]
    teacher_io: TeacherIoArgs,
    #[command(flatten)]
    teacher_calls: TeacherCallArgs,
    /// Where the coordinator listens: an address (`0.0.0.0` for every
    /// interface) and optionally its control port (`10.0.0.5:7070`; default:
    /// any free port). Loopback keeps the job on this machine.
    #[arg(long, default_value = "127.0.0.1", value_parser = edl_runtime::job::net::parse_listen)]
    listen: std::net::SocketAddr,
    /// Host name or address workers and teachers on other hosts reach the
    /// coordinator at (default: the --listen address; this host's routable
    /// address when listening on every interface).
    #[arg(long)]
    advertise: Option<String>,
    /// Port of the rendezvous where each generation's ring meets (default: any free one).
    #[arg(long, default_value_t = 0)]
    rendezvous_port: u16,
    /// How workers are started: `local` (child processes here), `command`
    /// (--worker-command per worker, on --hosts), `external` (started by
    /// another engine; they join with `edl-runtime worker`).
    #[arg(long, value_enum, default_value_t = ScalerKind::Local)]
    scaler: ScalerKind,
    /// With --scaler command: the command that starts worker {id}, run with
    /// `sh -c`; placeholders {id} {coordinator} {host} {slot} {job} {exe}. The
    /// job's secret comes on its standard input (`--secret-file -`).
    #[arg(long, required_if_eq("scaler", "command"))]
    worker_command: Option<String>,
    /// With --scaler command: a command that stops worker {id} (scancel,
    /// kubectl delete, ...), run after the worker was told to stop and
    /// did not exit within the grace.
    #[arg(long, requires = "worker_command")]
    worker_stop_command: Option<String>,
    /// With --scaler command: hosts to start workers on, `host` or
    /// `host:slots`, comma separated ({host} in the command).
    #[arg(long, value_delimiter = ',', requires = "worker_command")]
    hosts: Vec<String>,
    /// Seconds a worker may go without being heard (its heartbeats come a
    /// few times per lease) before it is declared dead and the job goes on without it.
    #[arg(long, default_value_t = 10)]
    worker_lease_secs: u64,
    /// Seconds a worker that lost its connection to the coordinator keeps
    /// trying to reach it again, to hear where it stands: a worker the job
    /// went on without is refused (its generation is over) and exits with
    /// that reason; one that reaches nothing exits when the time is up.
    #[arg(long, default_value_t = 30)]
    worker_reconnect_secs: u64,
    /// Seconds a worker asked for may take to join before it is given up.
    #[arg(long, default_value_t = 60)]
    join_timeout_secs: u64,
}

/// How the job's workers are started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ScalerKind {
    Local,
    Command,
    External,
}

#[derive(Args)]
struct SimArgs {
    #[command(flatten)]
    plugins: PluginArgs,
    /// Draw world size and throughput over the steps to this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    min_workers: u32,
    #[arg(long, default_value_t = 8)]
    max_workers: u32,
    /// Policy decisions to simulate (one every 20 steps).
    #[arg(long, default_value_t = 60)]
    decisions: usize,
    /// Reload the plugins when their files change.
    #[arg(long)]
    watch: bool,
    /// Price of a worker-hour the simulated cluster shows the policy
    /// (`price_per_worker_hour` of the view), for cost-aware policies.
    #[arg(long, default_value_t = 0.0)]
    price: f64,
}

#[derive(Args)]
struct SandboxArgs {
    /// CPU deadline of one plugin call, in milliseconds.
    #[arg(long, global = true, default_value_t = 100)]
    plugin_deadline_ms: u64,
    /// Memory cap of one plugin instance, in MiB.
    #[arg(long, global = true, default_value_t = 64)]
    plugin_memory_mib: usize,
    /// Directory of compiled plugins (default: $EDL_PLUGIN_CACHE or ~/.cache/edl/plugins).
    #[arg(long, global = true)]
    plugin_cache: Option<PathBuf>,
    /// Compile plugins at every load.
    #[arg(long, global = true)]
    no_plugin_cache: bool,
    /// Allow native plugin libraries (.so/.dylib/.dll): they run unsandboxed,
    /// with this process's rights, and are refused without this flag.
    #[arg(long, global = true)]
    allow_native: bool,
}

fn parse_pair(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

fn host(args: &SandboxArgs) -> Result<Arc<PluginHost>> {
    let cache = match (&args.plugin_cache, args.no_plugin_cache) {
        (_, true) => ArtifactCache::disabled(),
        (Some(dir), false) => ArtifactCache::at(dir),
        (None, false) => ArtifactCache::default_location(),
    };
    let limits = Limits {
        deadline: Duration::from_millis(args.plugin_deadline_ms),
        memory_bytes: args.plugin_memory_mib << 20,
        ..Limits::default()
    };
    Ok(PluginHost::new(HostOptions { limits, cache, allow_native: args.allow_native })?)
}

pub fn run(cli: Cli) -> Result<ExitCode> {
    if let Some(Command::Devices) = cli.command {
        println!("{}", edl_host_gpu::DeviceReport::probe());
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(Command::Teacher(args)) = cli.command {
        return teacher(args);
    }
    if let Some(Command::Distill(args)) = cli.command {
        return distill(args);
    }
    if let Some(Command::Worker(w)) = cli.command {
        edl_runtime::trainer::worker::run(worker_join(w)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let host = host(&cli.sandbox)?;
    match cli.command {
        Some(Command::Devices) | Some(Command::Teacher(_)) | Some(Command::Distill(_)) => {
            unreachable!("handled above")
        }
        Some(Command::Worker(_)) => unreachable!("handled above"),
        Some(Command::Launch(l)) => {
            let l = *l;
            if l.torchrun {
                let secs = |v: f64, flag: &str| {
                    Duration::try_from_secs_f64(v)
                        .map_err(|_| anyhow::anyhow!("--{flag} {v}: expected a number of seconds >= 0"))
                };
                let t = run::Torchrun {
                    command: l.command,
                    max_restarts: l.max_restarts,
                    decide_every: secs(l.decide_secs, "decide-secs")?,
                    grace: secs(l.stop_grace_secs, "stop-grace-secs")?,
                };
                return run::torchrun(&host, l.run, t);
            }
            let samples = l.samples.context("--samples is required without --torchrun")?;
            let launch = run::Launch { samples, command: l.command, teacher_addrs: l.teacher_addrs };
            run::run(&host, l.run, Some(launch))
        }
        Some(Command::Simulate(args)) => simulate(&host, args),
        Some(Command::Plugin { command: PluginCommand::Inspect { file } }) => inspect(&host, &file),
        Some(Command::Plugin { command: PluginCommand::New { world, name, dir } }) => {
            let created = scaffold::new_plugin(world.into(), &name, &dir, None)?;
            println!("created {} ({} plugin); next:", created.display(), World::from(world));
            println!("  cd {}", created.display());
            println!("  cargo test");
            println!("  cargo build --release --target wasm32-wasip2");
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::Plugin {
            command: PluginCommand::Replay { policy, trace, plot, config, json, price },
        }) => {
            // Printing a table to a closed pipe (`| head`) ends the command
            // quietly, as it does for other Unix tools, instead of panicking.
            // SAFETY: restoring a signal's default disposition has no preconditions.
            unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
            let mut p = host.load_policy(&policy, &config)?;
            if let Some(price) = price
                && !(price.is_finite() && price >= 0.0)
            {
                bail!("--price {price}: need a finite price of 0 or more");
            }
            let (decisions, recorded) = match replay::read_trace(&trace)?.priced(price) {
                Trace::Recorded(views) => (replay::replay(p.as_mut(), &views)?, true),
                Trace::Scenario(sc) => {
                    let mut sim = sc.cluster();
                    let hyper = Hyperparams::default();
                    let run = replay::simulate(
                        p.as_mut(),
                        None,
                        &mut sim,
                        sc.decisions,
                        hyper,
                        |r, s| sc.before(r, s),
                        |_, _| {},
                    )?;
                    (run.decisions, false)
                }
            };
            for d in &decisions {
                if json {
                    println!("{}", serde_json::to_string(d)?);
                } else {
                    let actions: Vec<String> = d.actions.iter().map(|a| a.to_string()).collect();
                    println!(
                        "step {:>7}  world {:>3} -> {:>3}  {:>10.1} samples/s  {}",
                        d.step,
                        d.world_size,
                        d.chosen,
                        d.throughput,
                        actions.join(", ")
                    );
                }
            }
            if let Some(out) = plot {
                let title = format!("{} on {}", p.info().name, trace.display());
                plot::policy_run(&out, &title, &decisions, recorded)?;
                eprintln!("plot written to {}", out.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        None => run::run(&host, cli.run, None),
    }
}

/// A bearer token from a file (its first line), never from a command line.
fn read_token(file: Option<&std::path::Path>, flag: &str) -> Result<Option<String>> {
    let Some(f) = file else { return Ok(None) };
    let text = std::fs::read_to_string(f).with_context(|| format!("{flag} {}", f.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.is_empty() {
        bail!("{flag} {}: the file holds no token", f.display());
    }
    Ok(Some(token))
}

/// Who a worker is and how it proves it: the job's name and secret from
/// the flags, or from the environment the coordinator's scaler set.
fn worker_join(w: WorkerArgs) -> Result<edl_runtime::trainer::worker::Join> {
    use edl_runtime::job::session::JobAuth;
    let coordinator = edl_runtime::job::net::resolve(&w.coordinator).context("--coordinator")?;
    let job = w.job.or_else(|| std::env::var("EDL_JOB").ok()).unwrap_or_else(|| "mnist".into());
    let secret = match &w.secret_file {
        Some(p) => edl_runtime::job::session::read_secret(p).context("--secret-file")?,
        None => edl_runtime::job::session::auth_from_env()?.secret,
    };
    Ok(edl_runtime::trainer::worker::Join {
        coordinator,
        id: w.id,
        auth: JobAuth { job, secret },
        ring_listen: w.listen,
        ring_advertise: w.advertise,
    })
}

fn inspect(host: &PluginHost, file: &std::path::Path) -> Result<ExitCode> {
    let i = host.inspect(file)?;
    println!("file:        {} ({} bytes)", file.display(), i.size);
    println!(
        "kind:        {}",
        if i.kind == "wasm" { "WebAssembly component (sandboxed)" } else { "native library (trusted)" }
    );
    println!("world:       {}", i.world);
    println!("interface:   {}", i.interface_version);
    println!("plugin:      {} {}", i.info.name, i.info.version);
    println!("description: {}", i.info.description);
    println!("exports:     {}", i.exports.join(", "));
    match (i.cached, &i.cache_entry) {
        (Some(c), Some(entry)) => {
            println!("cached:      {} ({})", if c { "yes" } else { "no, compiled now" }, entry.display())
        }
        (_, _) if i.kind == "wasm" => println!("cached:      cache disabled"),
        _ => println!("cached:      not applicable"),
    }
    Ok(ExitCode::SUCCESS)
}

/// The cluster the main command simulates: throughput saturates at 4
/// workers, one worker turns slow half way, and the cluster takes capacity
/// back for a while near the end.
fn demo_scenario(args: &SimArgs) -> Scenario {
    let n = args.decisions;
    Scenario {
        curve: None,
        knee: Some(4),
        start: args.min_workers,
        min_workers: args.min_workers,
        max_workers: args.max_workers,
        capacity: None,
        decisions: n,
        price_per_worker_hour: args.price,
        events: vec![
            ScenarioEvent { at: n / 2, slow: Some(SlowWorker { worker: 1, speed: 0.5 }), capacity: None },
            ScenarioEvent { at: n * 3 / 4, slow: None, capacity: Some(2.max(args.min_workers)) },
            ScenarioEvent { at: n * 7 / 8, slow: None, capacity: Some(args.max_workers) },
        ],
    }
}

/// `edl-runtime simulate`: the policy (and the adapter) drive a simulated cluster.
fn simulate(host: &Arc<PluginHost>, args: SimArgs) -> Result<ExitCode> {
    if !(args.price.is_finite() && args.price >= 0.0) {
        bail!("--price {}: need a finite price of 0 or more", args.price);
    }
    if !args.plugins.policy.exists() {
        bail!(
            "{}: no such plugin; `cargo build --release` builds the shipped plugins into plugins/",
            args.plugins.policy.display()
        );
    }
    let mut policy: Box<dyn PolicyPlugin> = if args.watch {
        Box::new(Reloading::policy(host.clone(), &args.plugins.policy, &args.plugins.policy_config)?)
    } else {
        host.load_policy(&args.plugins.policy, &args.plugins.policy_config)?
    };
    let mut adapter: Option<Box<dyn AdapterPlugin>> = match &args.plugins.adapter {
        None => None,
        Some(p) if args.watch => {
            Some(Box::new(Reloading::adapter(host.clone(), p, &args.plugins.adapter_config)?))
        }
        Some(p) => Some(host.load_adapter(p, &args.plugins.adapter_config)?),
    };
    let info = policy.info().clone();
    println!(
        "policy    {} {} ({}, {})",
        info.name,
        info.version,
        args.plugins.policy.display(),
        policy.backend()
    );
    if let Some(a) = &adapter {
        println!("adapter   {} {}", a.info().name, a.info().version);
    }
    if let Some(path) = &args.plugins.transform {
        let mut t = host.load_transform(path, &[])?;
        let batch = standard_batch();
        let start = std::time::Instant::now();
        let out = t.apply(&batch)?;
        println!(
            "transform {} {}: {} samples {:?} {:?} -> {:?} {:?} in {:.0} us",
            t.info().name,
            t.info().version,
            batch.len(),
            batch.shape,
            batch.dtype,
            out.shape,
            out.dtype,
            start.elapsed().as_secs_f64() * 1e6
        );
    }
    let scenario = demo_scenario(&args);
    let mut sim = scenario.cluster();
    println!(
        "simulated cluster: {}..{} workers at {} per worker-hour, throughput saturates at 4, \
         worker 1 slows to 0.5x at step {}, capacity drops to {} at step {} and comes back at step {}",
        args.min_workers,
        args.max_workers,
        args.price,
        scenario.events[0].at as u64 * sim.steps_per_decision,
        scenario.events[1].capacity.unwrap_or(0),
        scenario.events[1].at as u64 * sim.steps_per_decision,
        scenario.events[2].at as u64 * sim.steps_per_decision,
    );
    let hyper = Hyperparams { global_batch: 64 * sim.world_size(), local_batch: 64, lr: 0.1, momentum: 0.9 };
    let print = |d: &replay::Decision, e: Option<&replay::ScaleEvent>| {
        if let Some(e) = e {
            let hp = e
                .hyperparams
                .map(|h| format!("  global batch {} lr {:.4}", h.global_batch, h.lr))
                .unwrap_or_default();
            println!(
                "step {:>5}  {} -> {} workers  [{}]  {:.0} samples/s before{hp}",
                e.step, e.from, e.to, e.reason, d.throughput
            );
        }
    };
    let run = replay::simulate(
        policy.as_mut(),
        adapter.as_mut().map(|a| a.as_mut() as &mut dyn AdapterPlugin),
        &mut sim,
        scenario.decisions,
        hyper,
        |r, s| {
            for e in scenario.events.iter().filter(|e| e.at == r) {
                if let Some(c) = e.capacity {
                    println!(
                        "step {:>5}  the cluster now offers {c} devices",
                        r as u64 * s.steps_per_decision
                    );
                }
            }
            scenario.before(r, s)
        },
        print,
    )
    .context("simulation")?;
    println!(
        "done: {} decisions, {} scale events, final world size {}, throughput {:.0} samples/s",
        args.decisions,
        run.events.len(),
        sim.world_size(),
        sim.throughput()
    );
    if let Some(out) = &args.plot {
        plot::policy_run(out, &format!("{} on the simulated cluster", info.name), &run.decisions, false)?;
        println!("plot written to {}", out.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `edl-runtime teacher`: serves until Ctrl-C or SIGTERM, then deregisters.
fn teacher(args: TeacherArgs) -> Result<ExitCode> {
    use edl_runtime::{distill::teacher, store::AnyStore, trainer::model::Mlp};
    let model = Mlp::load(&args.model)?;
    let token = read_token(args.token_file.as_deref(), "--token-file")?;
    let access = teacher::Access {
        token: token.clone(),
        tls: match (&args.tls_cert, &args.tls_key) {
            (Some(c), Some(k)) => Some((
                std::fs::read(c).with_context(|| format!("--tls-cert {}", c.display()))?,
                std::fs::read(k).with_context(|| format!("--tls-key {}", k.display()))?,
            )),
            (None, None) => None,
            _ => bail!("--tls-cert and --tls-key go together"),
        },
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let store = Arc::new(AnyStore::open(&args.store)?);
        let config = teacher::TeacherConfig {
            model_name: args.model_name.clone(),
            max_batch: args.max_batch,
            max_delay: Duration::from_millis(args.max_delay_ms),
            max_request_rows: args.max_request_rows,
            ..Default::default()
        };
        let (inputs, outputs) = (model.input_dim(), model.output_dim());
        let service = teacher::TeacherService::new(model, config);
        let registration = Some((store, args.service.clone(), Duration::from_secs(3)));
        let serving = teacher::Serving {
            advertise: args.advertise.clone(),
            access,
            ..teacher::Serving::on(args.listen)
        }
        .max_rows(args.max_request_rows, inputs);
        let rest = args.http_listen.map(|a| (a, service.clone(), token.clone()));
        let t = teacher::Teacher::serve(serving, service, registration).await?;
        println!(
            "teacher {:?} ({inputs} -> {outputs}) serving on {} as service {:?} (store {})",
            args.model_name,
            t.advertised,
            args.service,
            edl_runtime::store::redact(&args.store)
        );
        if let Some((addr, service, token)) = rest {
            let listener =
                tokio::net::TcpListener::bind(addr).await.with_context(|| format!("--http-listen {addr}"))?;
            let at = listener.local_addr()?;
            tokio::spawn(edl_runtime::distill::rest::serve(
                listener,
                edl_runtime::distill::rest::router(service, token),
            ));
            println!("teacher {:?} serving KServe v2 REST on http://{at}", args.model_name);
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("teacher on {}: stopping, deregistering", t.addr);
        t.shutdown().await;
        Ok(ExitCode::SUCCESS)
    })
}

/// `edl-runtime distill`: synthetic batches through the DistillReader.
fn distill(args: DistillArgs) -> Result<ExitCode> {
    use edl_runtime::distill::{self, DistillConfig, DistillReader, Teachers};
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let teachers = match (&args.teachers, &args.store) {
            (Some(list), None) => Teachers::Fixed(distill::endpoints(list)),
            (None, Some(url)) => Teachers::Discovered {
                store: Arc::new(edl_runtime::store::AnyStore::open(url)?),
                service: args.service.clone(),
            },
            _ => bail!("give either --teachers host:port,... or --store URL (with --service)"),
        };
        let (n, rows, dim) = (args.batches, args.batch_size, args.features);
        let source = (0..n).map(move |b| {
            let ids: Vec<u64> = (0..rows as u64).map(|i| (b * rows) as u64 + i).collect();
            let feats: Vec<f32> = ids
                .iter()
                .flat_map(|&id| (0..dim).map(move |k| ((id as usize * 31 + k) % 255) as f32 / 255.0))
                .collect();
            edl_plugin_sdk::Batch {
                data: edl_runtime::distill::oip::f32_bytes(&feats),
                shape: vec![rows as u32, dim as u32],
                dtype: edl_plugin_sdk::Dtype::Float32,
                labels: vec![0; rows],
                ids,
                seed: 0,
            }
        });
        let cfg = args.teacher_calls.calls().apply(DistillConfig {
            model_name: args.model_name.clone(),
            wait_for_teachers: Duration::from_secs(args.wait_secs),
            access: args.teacher_access.read()?,
            io: args.teacher_io.io(),
            ..Default::default()
        });
        let mut reader = DistillReader::start(source, None, teachers, cfg);
        let start = std::time::Instant::now();
        let (mut samples, mut next_id, mut classes) = (0usize, 0u64, 0usize);
        while let Some(b) = reader.next().await {
            let b = b?;
            for &id in &b.batch.ids {
                if id != next_id {
                    bail!("sample {next_id} expected, {id} received");
                }
                next_id += 1;
            }
            samples += b.batch.len();
            classes = b.classes;
            println!(
                "batch {:>4}: {} samples, {} soft labels each",
                b.batch.ids[0] / rows as u64,
                b.batch.len(),
                b.classes
            );
        }
        println!(
            "done: {samples} samples in order with {classes}-class soft labels, {:.0} samples/s",
            samples as f64 / start.elapsed().as_secs_f64()
        );
        Ok(ExitCode::SUCCESS)
    })
}
