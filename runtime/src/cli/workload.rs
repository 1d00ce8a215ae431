//! What a job of steps runs: the flags the built-in job and `launch`
//! share, the workload they name, prepared (the built-in student with its
//! data, or the user's program), and where the job keeps its files.
//! `job.rs` runs the job from these, and `teachers.rs` starts its teachers.

use super::flags::{
    ClusterArgs, DistillationArgs, LivenessArgs, OutputArgs, PluginArgs, PsArgs, ScalingArgs, StateArgs,
    TrainingArgs, TransformArgs, WatchArgs,
};
use anyhow::{Context, Result};
use clap::Args;
use edl_host_gpu::Device;
use edl_runtime::{
    checkpoint::Checkpoints,
    coordinator::JobOutcome,
    job::{BuiltinModel, Program},
    trainer::{
        clicks, ctr,
        data::Dataset,
        model::Mlp,
        train::Trainer,
        worker::{load_data, mlp_of},
    },
};
use std::path::Path;
use std::path::PathBuf;

/// Flags of every job of steps: the built-in one and `launch`'s.
#[derive(Args)]
pub struct JobArgs {
    #[command(flatten)]
    pub plugins: PluginArgs,
    #[command(flatten)]
    pub scaling: ScalingArgs,
    #[command(flatten)]
    pub training: TrainingArgs,
    #[command(flatten)]
    pub distillation: DistillationArgs,
    #[command(flatten)]
    pub state: StateArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub liveness: LivenessArgs,
    #[command(flatten)]
    pub output: OutputArgs,
    #[command(flatten)]
    pub watch: WatchArgs,
    #[command(flatten)]
    pub ps: PsArgs,
}

/// The built-in student's distillation temperature, by default; a
/// launched program's job carries it unused.
pub const TEMPERATURE: f32 = 4.0;
/// The built-in student's weight of the soft-label term, by default.
pub const ALPHA: f32 = 0.7;

/// Flags of the built-in student and its teachers only (`launch` refuses them).
#[derive(Args)]
#[command(next_help_heading = "Built-in student")]
pub struct StudentArgs {
    /// `mnist5k` (4000 train / 1000 test), `digits` (1397 / 400), or `ctr`
    /// (90000 / 10000 click-through rows of Criteo's shape: a wide-and-deep
    /// model with its embeddings on the parameter servers; needs
    /// --ps-servers).
    #[arg(long, value_name = "NAME", default_value = "mnist5k")]
    pub dataset: String,
    /// Train the student on the first N training samples only (a small transfer set).
    #[arg(long, value_name = "N")]
    pub train_samples: Option<usize>,
    /// Student hidden layer sizes, comma separated.
    #[arg(long, value_name = "SIZES", default_value = "128")]
    pub hidden: String,
    /// Where workers (and the teacher's training) compute: `cpu`, `cuda` or
    /// `cuda:N` (cuBLAS and the CUDA loss kernel; checked before the job starts).
    #[arg(long, value_name = "DEVICE", default_value = "cpu", help_heading = "Training")]
    pub device: Device,
    /// Extra milliseconds each step takes on each worker (emulates slower devices).
    #[arg(long, value_name = "MS", default_value_t = 0, help_heading = "Training")]
    pub step_delay_ms: u64,
    #[command(flatten)]
    pub transform: TransformArgs,
    /// Teacher processes to start, serving a wider model trained here and
    /// cached (0: use the teachers registered in --store).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 2,
        conflicts_with = "teachers",
        help_heading = "Distillation"
    )]
    pub teacher_processes: u32,
    /// Compute the teacher in each student's own process, on its step's
    /// path, instead of as a service (the seeds' "teacher and student on the
    /// same GPUs", to compare with): no teacher processes start; with
    /// --teacher-emulate-row-us each student sleeps that long a row instead
    /// of computing the teacher.
    #[arg(
        long,
        conflicts_with_all = ["teachers", "max_teachers", "teacher_command"],
        help_heading = "Distillation"
    )]
    pub teacher_in_process: bool,
    /// Teacher hidden layer sizes, comma separated.
    #[arg(long, value_name = "SIZES", default_value = "512", help_heading = "Distillation")]
    pub teacher_hidden: String,
    /// Epochs the teacher trains for, on hard labels (once: later runs with
    /// the same settings take it from .edl/teachers/).
    #[arg(long, value_name = "N", default_value_t = 10, help_heading = "Distillation")]
    pub teacher_epochs: u64,
    #[command(flatten)]
    pub pool: TeacherPoolArgs,
    /// Distillation temperature.
    #[arg(long, value_name = "T", default_value_t = TEMPERATURE, help_heading = "Distillation")]
    pub temperature: f32,
    /// Weight of the soft-label term (1 - alpha goes to the hard labels).
    #[arg(long, value_name = "A", default_value_t = ALPHA, help_heading = "Distillation")]
    pub alpha: f32,
}

/// The teacher pool of the built-in job: sized while it runs by a teacher
/// policy plugin, between bounds.
#[derive(Args)]
pub struct TeacherPoolArgs {
    /// Most teachers the pool may grow to; turns the pool on (its size is
    /// then --teacher-processes at the start, within the bounds). Needs a
    /// shared --store: students find the teachers there as they come and go.
    #[arg(long, value_name = "N", help_heading = "Teacher pool")]
    pub max_teachers: Option<u32>,
    /// Fewest teachers the pool keeps.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        requires = "max_teachers",
        help_heading = "Teacher pool"
    )]
    pub min_teachers: u32,
    /// Teacher-policy plugin (`.wasm` component or native `.so`) that sizes the pool.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "plugins/teacher-autoscale.wasm",
        help_heading = "Teacher pool"
    )]
    pub teacher_policy: PathBuf,
    /// A configuration key of the teacher policy (repeat for more).
    #[arg(long = "teacher-policy-config", value_name = "KEY=VALUE", value_parser = super::flags::parse_pair, help_heading = "Teacher pool")]
    pub teacher_policy_config: Vec<(String, String)>,
    /// Seconds between two decisions of the teacher policy.
    #[arg(long, value_name = "S", default_value_t = 5.0, help_heading = "Teacher pool")]
    pub teacher_decide_secs: f64,
    /// Price of a teacher-hour, shown to the teacher policy.
    #[arg(long, value_name = "P", default_value_t = 0.0, help_heading = "Teacher pool")]
    pub price_per_teacher_hour: f64,
    /// Each teacher the job starts emulates an accelerator: every batch also
    /// takes US microseconds per row, one batch at a time (a sleep, not
    /// compute: `teacher --emulate-row-us`).
    #[arg(long, value_name = "US", default_value_t = 0, help_heading = "Teacher pool")]
    pub teacher_emulate_row_us: u64,
    /// Start the job's teachers with this command instead of as processes
    /// here, run with `sh -c` on --teacher-hosts: any KServe v2 server
    /// (Triton, MLServer, `{exe} teacher`). Placeholders {id} {host} {addr}
    /// {port} {port2} {slot} {job} {service} {model} (the job's teacher
    /// model file) {exe}. It joins once its server and model answer ready.
    #[arg(long, value_name = "CMD", help_heading = "Teacher pool")]
    pub teacher_command: Option<String>,
    /// With --teacher-command: run when a teacher is told to go, before its
    /// command's process group is sent SIGTERM.
    #[arg(long, value_name = "CMD", requires = "teacher_command", help_heading = "Teacher pool")]
    pub teacher_stop_command: Option<String>,
    /// With --teacher-command: hosts teachers run on, `host[:slots]` or
    /// `name=addr[:slots]` (a node's name for the command, {host}, and the
    /// address students reach, {addr}), comma separated.
    #[arg(
        long,
        value_name = "HOSTS",
        value_delimiter = ',',
        default_value = "127.0.0.1:16",
        requires = "teacher_command",
        help_heading = "Teacher pool"
    )]
    pub teacher_hosts: Vec<String>,
    /// With --teacher-command: the port of each host's first slot ({port});
    /// slot i serves on PORT + 2i ({port2} is the one above it). With
    /// --teacher-kube-image: the port each teacher Pod serves on.
    #[arg(long, value_name = "PORT", default_value_t = 8001, help_heading = "Teacher pool")]
    pub teacher_port: u16,
    /// With --teacher-command: what students reach, e.g. `{addr}:{port}`
    /// (gRPC), `http://{addr}:{port}/MODEL@probs` (REST).
    #[arg(
        long,
        value_name = "TEMPLATE",
        default_value = "{addr}:{port}",
        requires = "teacher_command",
        help_heading = "Teacher pool"
    )]
    pub teacher_endpoint: String,
    /// With --teacher-command or --teacher-kube-image: seconds a teacher
    /// may take to answer ready.
    #[arg(long, value_name = "S", default_value_t = 120, help_heading = "Teacher pool")]
    pub teacher_ready_secs: u64,
    /// Start each teacher of the pool as a Kubernetes Pod of this image
    /// (Triton, MLServer, one with `edl-runtime`), in --kube-namespace,
    /// owned as --kube-owner says; it joins once it runs and answers ready
    /// at its Pod's address and --teacher-port. Needs --max-teachers.
    #[arg(
        long,
        value_name = "IMAGE",
        requires_all = ["teacher_kube_command", "max_teachers"],
        conflicts_with = "teacher_command",
        help_heading = "Teacher pool"
    )]
    pub teacher_kube_image: Option<String>,
    /// With --teacher-kube-image: the teacher container's command, split as
    /// sh would; placeholders {port} {id} {job} {service}.
    #[arg(long, value_name = "CMD", requires = "teacher_kube_image", help_heading = "Teacher pool")]
    pub teacher_kube_command: Option<String>,
    /// With --teacher-kube-image: a resource each teacher Pod asks for and
    /// is limited to, e.g. `nvidia.com/gpu=1`, `memory=8Gi` (repeat for more).
    #[arg(long, value_name = "NAME=QUANTITY", value_parser = super::flags::parse_pair, requires = "teacher_kube_image", help_heading = "Teacher pool")]
    pub teacher_kube_resource: Vec<(String, String)>,
    /// With --teacher-kube-image: a node label the teacher Pods must match,
    /// e.g. `cloud.google.com/gke-accelerator=nvidia-tesla-t4` (repeat for more).
    #[arg(long, value_name = "LABEL=VALUE", value_parser = super::flags::parse_pair, requires = "teacher_kube_image", help_heading = "Teacher pool")]
    pub teacher_kube_node_selector: Vec<(String, String)>,
}

impl TeacherPoolArgs {
    /// The pool and command flags of `work`, where it takes them.
    pub(super) fn of(work: &Prepared) -> &TeacherPoolArgs {
        match work {
            Prepared::Builtin { student, .. } => &student.pool,
            Prepared::Program { pool, .. } => pool,
        }
    }

    /// How teachers are started as Kubernetes Pods, if they are (`kube`:
    /// the job's namespace, owner and own Pod).
    pub fn kube(
        &self,
        kube: &edl_runtime::scalers::kubernetes::KubeOptions,
    ) -> Option<edl_runtime::job::teacher_kube::KubeTeacherSpec> {
        Some(edl_runtime::job::teacher_kube::KubeTeacherSpec {
            image: self.teacher_kube_image.clone()?,
            command: self.teacher_kube_command.clone().unwrap_or_default(),
            port: self.teacher_port,
            resources: self.teacher_kube_resource.clone(),
            node_selector: self.teacher_kube_node_selector.clone(),
            namespace: kube.namespace.clone(),
            owner: kube.owner,
            pod_name: kube.pod_name.clone(),
            ready_within: std::time::Duration::from_secs(self.teacher_ready_secs.max(1)),
        })
    }

    /// How teachers are started by command, if they are.
    pub fn command(&self) -> Option<edl_runtime::job::teacher_command::TeacherCommand> {
        Some(edl_runtime::job::teacher_command::TeacherCommand {
            start: self.teacher_command.clone()?,
            stop: self.teacher_stop_command.clone(),
            endpoint: self.teacher_endpoint.clone(),
            hosts: self.teacher_hosts.clone(),
            port: self.teacher_port,
            ready_within: std::time::Duration::from_secs(self.teacher_ready_secs.max(1)),
        })
    }
}

/// What the job's workers run.
#[allow(clippy::large_enum_variant, reason = "one value per run, never moved in a loop")]
pub enum Workload {
    /// The built-in student on its data set.
    Builtin(StudentArgs),
    /// The user's program (`launch`), on the samples `0..samples`.
    Program { samples: usize, command: Vec<String>, pool: Box<TeacherPoolArgs> },
}

/// The workload, ready: the built-in student with its data, or the program.
#[allow(clippy::large_enum_variant, reason = "one value per run, never moved in a loop")]
pub(super) enum Prepared {
    Builtin { student: StudentArgs, model: BuiltinModel, train: Dataset, test: Dataset },
    Program { samples: usize, command: Vec<String>, pool: Box<TeacherPoolArgs> },
}

impl Prepared {
    pub(super) fn new(work: Workload) -> Result<Prepared> {
        Ok(match work {
            Workload::Builtin(student) => {
                let mut model = BuiltinModel {
                    dataset: student.dataset.clone(),
                    test_rows: match student.dataset.as_str() {
                        "digits" => 400,
                        "ctr" => clicks::TEST_ROWS,
                        _ => 1000,
                    },
                    split_seed: 1,
                    train_samples: student.train_samples,
                    layers: Vec::new(),
                };
                let (train, test) = load_data(&BuiltinModel { train_samples: None, ..model.clone() })?;
                let hidden = sizes(&student.hidden, "hidden")?;
                model.layers = match student.dataset.as_str() {
                    "ctr" => ctr::layers(&hidden),
                    _ => std::iter::once(train.dim).chain(hidden).chain([train.classes]).collect(),
                };
                Prepared::Builtin { student, model, train, test }
            }
            Workload::Program { samples, command, pool } => Prepared::Program { samples, command, pool },
        })
    }

    /// Samples per epoch.
    pub(super) fn rows(&self) -> usize {
        match self {
            Prepared::Builtin { student, train, .. } => {
                student.train_samples.map_or(train.len(), |n| n.min(train.len()))
            }
            Prepared::Program { samples, .. } => *samples,
        }
    }

    pub(super) fn program(&self) -> Program {
        match self {
            Prepared::Builtin { model, .. } => Program::Builtin(model.clone()),
            Prepared::Program { command, .. } => Program::External { command: command.clone() },
        }
    }

    /// The launched command, if any.
    pub(super) fn command(&self) -> Option<&[String]> {
        match self {
            Prepared::Builtin { .. } => None,
            Prepared::Program { command, .. } => Some(command),
        }
    }

    /// Where the built-in workers compute (a launched program decides for itself).
    pub(super) fn device(&self) -> Device {
        match self {
            Prepared::Builtin { student, .. } => student.device,
            Prepared::Program { .. } => Device::Cpu,
        }
    }

    /// The built-in click-through model (its tables on parameter servers).
    fn is_ctr(&self) -> bool {
        matches!(self, Prepared::Builtin { model, .. } if model.dataset == "ctr")
    }

    /// Refuses what the click-through model cannot run with, before
    /// anything starts: it needs parameter servers, trains on the CPU, and
    /// has no teachers or reader transform.
    fn check_ctr(&self, ps_servers: u32) -> Result<()> {
        let Prepared::Builtin { student, .. } = self else { return Ok(()) };
        if !self.is_ctr() {
            return Ok(());
        }
        if ps_servers == 0 {
            edl_runtime::refuse!(
                "--dataset ctr keeps its embedding tables on parameter servers: add --ps-servers N (e.g. --ps-servers 2)"
            );
        }
        if student.device != Device::Cpu {
            edl_runtime::refuse!(
                "--dataset ctr trains on the CPU; --device {} is for mnist5k and digits",
                student.device
            );
        }
        if student.transform.transform.is_some() {
            edl_runtime::refuse!("--transform: reader transforms take image batches; --dataset ctr has none");
        }
        Ok(())
    }

    /// Whether the job distils: the built-in student unless --no-distill
    /// (the click-through model never: it has no teachers); a launched
    /// program only from the teachers it is given.
    pub(super) fn distills(&self, d: &DistillationArgs) -> bool {
        match self {
            Prepared::Builtin { .. } if self.is_ctr() => false,
            Prepared::Builtin { .. } => !d.no_distill,
            Prepared::Program { pool, .. } => {
                !d.no_distill
                    && (d.teachers.is_some() || d.service.is_some() || pool.teacher_command.is_some())
            }
        }
    }

    /// Refuses what the built-in model cannot run with, before any process
    /// starts: the click-through model's needs, and a missing driver, GPU,
    /// cuBLAS or NVRTC.
    pub(super) fn check(&self, seed: u64, ps_servers: u32) -> Result<()> {
        self.check_ctr(ps_servers)?;
        if let Prepared::Builtin { student, model, .. } = self
            && student.device != Device::Cpu
        {
            Trainer::on(student.device, Mlp::random(&model.layers, seed))
                .context("checking --device before the job starts")?;
        }
        Ok(())
    }

    /// What the job trains, for its first line.
    pub(super) fn describe(&self) -> String {
        match self {
            Prepared::Builtin { model, test, .. } if self.is_ctr() => format!(
                "ctr ({} training samples, {} test), wide and deep: {} embeddings of {} ids a row on the parameter servers, MLP {:?}",
                self.rows(),
                test.len(),
                ctr::EMBED,
                clicks::FIELDS,
                model.layers
            ),
            Prepared::Builtin { student, model, test, .. } => format!(
                "{} ({} training samples, {} test), student {:?}",
                student.dataset,
                self.rows(),
                test.len(),
                model.layers
            ),
            Prepared::Program { command, samples: 0, .. } => {
                format!("{:?} on the samples its data set holds", command.join(" "))
            }
            Prepared::Program { command, samples, .. } => {
                format!("{:?} on samples 0..{samples}", command.join(" "))
            }
        }
    }

    /// [`Prepared::student_scores`], or none where they cannot be had
    /// (said): the run and its report stand.
    pub(super) fn scores_or_none(&self, checkpoint_dir: &Path, outcome: &JobOutcome) -> StudentScores {
        self.student_scores(checkpoint_dir, outcome).unwrap_or_else(|e| {
            eprintln!("note      the final checkpoint could not be scored on the test set: {e:#}");
            StudentScores::default()
        })
    }

    /// The built-in student's test scores, from the final checkpoint: its
    /// accuracy, or the click-through model's AUC and logistic loss.
    pub(super) fn student_scores(
        &self,
        checkpoint_dir: &Path,
        outcome: &JobOutcome,
    ) -> Result<StudentScores> {
        let Prepared::Builtin { test, .. } = self else { return Ok(StudentScores::default()) };
        let store = Checkpoints::open(checkpoint_dir, 1)?;
        let restored = store.read_at(&outcome.final_checkpoint)?;
        if self.is_ctr() {
            let (auc, log_loss) = ctr::evaluate_checkpoint(&restored, test)?;
            return Ok(StudentScores { auc: Some(auc), log_loss: Some(log_loss), ..Default::default() });
        }
        let accuracy = mlp_of(&restored)?.accuracy(test) as f64;
        Ok(StudentScores { accuracy: Some(accuracy), ..Default::default() })
    }
}

/// The built-in student's scores on its test set.
#[derive(Default)]
pub(super) struct StudentScores {
    pub accuracy: Option<f64>,
    pub auc: Option<f64>,
    pub log_loss: Option<f64>,
}

/// Layer sizes from a comma-separated list (`--hidden 128,64`).
pub(super) fn sizes(list: &str, what: &str) -> Result<Vec<usize>> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<Vec<_>>>()
        .with_context(|| format!("--{what} {list:?}: expected positive sizes separated by commas"))
}
