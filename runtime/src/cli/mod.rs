//! The `edl-runtime` command line: the flags of each subcommand and what runs them.
//!
//! One file per subcommand: `job.rs` (the built-in job, and the job runner
//! `launch` shares, with its `workload.rs`, `teachers.rs`, `progress.rs` and
//! `summary.rs`), `launch.rs`, `teacher.rs`, `distill.rs`, `simulate.rs`,
//! `plugin.rs`, `worker.rs`, `agent.rs`, `devices.rs`. The flag groups
//! several of them take are in `flags.rs`; `refusals.rs` turns a flag given
//! where it does not apply into an error naming where it does;
//! `plugin_path.rs` finds plugin files.

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use edl_runtime::plugin::{ArtifactCache, HostOptions, Limits, PluginHost};
use std::{ffi::OsString, process::ExitCode, sync::Arc, time::Duration};

mod agent;
mod devices;
mod distill;
mod flags;
mod job;
mod launch;
mod plugin;
mod plugin_path;
mod progress;
mod ps;
mod refusals;
mod relay;
mod simulate;
mod summary;
mod teacher;
mod teachers;
mod worker;
mod workload;

use flags::SandboxArgs;
use workload::{JobArgs, StudentArgs, Workload};

const EXAMPLES: &str = "\
Without a subcommand, edl-runtime runs the built-in job: a student MLP trained
by distillation from teachers it starts, on worker processes that a scaling
policy adds and removes.

Examples:
  edl-runtime --policy plugins/autoscale.wasm
      the built-in job on this machine: teachers, a coordinator, 1..4 workers
  edl-runtime --max-workers 8 --adapter plugins/dynamic-batch.wasm --report run.json
  edl-runtime --dataset ctr --ps-servers 2 --ps-replicas 2
      a wide-and-deep click-through model, its embeddings on parameter servers
  edl-runtime launch --samples 60000 --max-workers 8 -- python train.py
      your own program as the job's workers
  edl-runtime launch --torchrun -- python train_ddp.py
  edl-runtime simulate --policy plugins/autoscale.wasm --plot run.svg

A subcommand's flags go after it: `edl-runtime launch --max-workers 8 -- ...`;
`edl-runtime <command> --help` lists them. Every flag, and which commands take
it: docs/training.md.";

#[derive(Parser)]
#[command(
    name = "edl-runtime",
    version,
    about = "Elastic deep-learning runtime with WebAssembly plugins",
    after_help = EXAMPLES,
    args_override_self = true
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: JobArgs,
    #[command(flatten)]
    student: StudentArgs,
    /// Job name: its keys in the store and its directories under .edl/
    /// [default: mnist; ctr for --dataset ctr].
    #[arg(long, value_name = "NAME", value_parser = flags::job_name, help_heading = "Checkpoints and state")]
    job: Option<String>,
    #[command(flatten)]
    sandbox: SandboxArgs,
}

impl Cli {
    /// The built-in job's name: as given, else its data set's (`mnist` for
    /// the image data sets).
    fn builtin_job_name(&self) -> String {
        let default = if self.student.dataset == "ctr" { "ctr" } else { "mnist" };
        self.job.clone().unwrap_or_else(|| default.into())
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run your own training program as the job's workers.
    #[command(after_help = LAUNCH_EXAMPLES)]
    Launch(Box<launch::LaunchArgs>),
    /// Join a job as one of its workers.
    #[command(after_help = WORKER_EXAMPLES)]
    Worker(worker::WorkerArgs),
    /// Run one host's ranks of a `launch --torchrun` job across hosts.
    #[command(after_help = AGENT_EXAMPLES)]
    Agent(agent::AgentCliArgs),
    /// Serve a model as a teacher over the Open Inference Protocol.
    #[command(after_help = TEACHER_EXAMPLES)]
    Teacher(teacher::TeacherArgs),
    /// Pull soft labels for synthetic batches from teachers; reports throughput.
    #[command(after_help = DISTILL_EXAMPLES)]
    Distill(distill::DistillArgs),
    /// Drive a scaling policy (and a batch adapter) against a simulated cluster.
    #[command(after_help = SIMULATE_EXAMPLES)]
    Simulate(simulate::SimArgs),
    /// Work with plugin files.
    #[command(after_help = PLUGIN_EXAMPLES)]
    Plugin {
        #[command(subcommand)]
        command: plugin::PluginCommand,
    },
    /// Serve a job's sparse tables as one of its parameter servers.
    Ps(ps::PsArgs),
    /// Carry one host's workers to the coordinator over one connection.
    Relay(relay::RelayArgs),
    /// Print the devices and CUDA libraries this machine offers.
    Devices,
}

const LAUNCH_EXAMPLES: &str = "\
The program joins through the `edl` package (docs/your-own-program.md): the
job's coordinator, policy, store, checkpoints and report, as for the built-in job.

Examples:
  edl-runtime launch --samples 60000 --max-workers 8 -- python train.py
  edl-runtime launch --samples 4000 --teachers 10.0.0.7:8001 -- python train.py
  edl-runtime launch --torchrun --min-workers 2 --max-workers 4 -- python train_ddp.py

The built-in student's flags (--dataset, --hidden, --temperature, ...) are not
launch's: the program trains its own model. With --torchrun the script also
keeps its own data, checkpoints and teachers.";

const WORKER_EXAMPLES: &str = "\
What the coordinator's scaler starts, and what another engine (ssh, srun,
Kubernetes) runs on other hosts.

Example:
  edl-runtime worker --coordinator 10.0.0.5:7070 --secret-file job.secret";

const AGENT_EXAMPLES: &str = "\
What `launch --torchrun --scaler command` starts on each host, and what another
engine runs with `--scaler external`: it runs --nproc-per-node ranks of each
group the launcher forms, with torchrun's environment across hosts.

Example:
  edl-runtime agent --coordinator 10.0.0.5:7070 --job train --secret-file job.secret";

const TEACHER_EXAMPLES: &str = "\
KServe v2 gRPC, and REST with --http-listen; registered in --store, where
students discover it.

Examples:
  edl-runtime teacher --model teacher.safetensors --listen 0.0.0.0 --store redis://10.0.0.2:6379
  edl-runtime teacher --model t.safetensors --listen 127.0.0.1:0 --http-listen 127.0.0.1";

const DISTILL_EXAMPLES: &str = "\
Through the DistillReader, from fixed teachers (any OIP server) or ones
discovered in a store.

Examples:
  edl-runtime distill --teachers 127.0.0.1:8001,127.0.0.1:8002 --batches 50
  edl-runtime distill --store redis://127.0.0.1:6379 --service teachers --features 784";

const SIMULATE_EXAMPLES: &str = "\
A quick look at a policy's behaviour without training: throughput saturates at
4 workers, worker 1 turns slow half way, and capacity drops for a while near the end.

Examples:
  edl-runtime simulate --policy plugins/autoscale.wasm --adapter plugins/dynamic-batch.wasm
  edl-runtime simulate --policy target/wasm32-wasip2/release/my_policy.wasm --watch";

const PLUGIN_EXAMPLES: &str = "\
Examples:
  edl-runtime plugin new scaling-policy my-policy
  edl-runtime plugin inspect plugins/autoscale.wasm
  edl-runtime plugin replay --policy plugins/autoscale.wasm --trace examples/traces/straggler.json";

/// Reads the process's command line; on a flag that does not apply there,
/// exits with clap's message and status 2.
pub fn parse() -> Cli {
    let args: Vec<OsString> = std::env::args_os().collect();
    parse_from(&args).unwrap_or_else(|e| e.exit())
}

/// Reads a command line (`args[0]` is the program), refusing flags given
/// where they do not apply with a message naming where they do.
pub fn parse_from(args: &[OsString]) -> Result<Cli, clap::Error> {
    let tree = Cli::command();
    refusals::misplaced(&tree, args)?;
    let mut cmd = Cli::command();
    let matches = cmd.try_get_matches_from_mut(args).map_err(|e| refusals::explain(&tree, e, args))?;
    refusals::unused_by_torchrun(&tree, &matches)?;
    Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))
}

/// The plugin host the sandbox flags describe.
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

/// Runs the command the line names.
pub fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        None => {
            let name = cli.builtin_job_name();
            job::run(&host(&cli.sandbox)?, name, cli.run, Workload::Builtin(cli.student))
        }
        Some(Command::Launch(l)) => launch::run(&host(&cli.sandbox)?, *l),
        Some(Command::Worker(w)) => worker::run(w),
        Some(Command::Agent(a)) => agent::run(a),
        Some(Command::Teacher(args)) => teacher::run(args),
        Some(Command::Distill(args)) => distill::run(args),
        Some(Command::Simulate(args)) => simulate::run(&host(&cli.sandbox)?, args),
        Some(Command::Plugin { command }) => plugin::run(&*host(&cli.sandbox)?, command),
        Some(Command::Ps(args)) => ps::run(args),
        Some(Command::Relay(args)) => relay::run(args),
        Some(Command::Devices) => Ok(devices::run()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Command as ClapCommand;

    fn parse(line: &str) -> Result<Cli, clap::Error> {
        let args: Vec<OsString> =
            std::iter::once("edl-runtime").chain(line.split_whitespace()).map(Into::into).collect();
        parse_from(&args)
    }

    /// Every command with its path (`[]` for the built-in job).
    fn commands() -> Vec<(Vec<String>, ClapCommand)> {
        fn walk(cmd: &ClapCommand, path: Vec<String>, out: &mut Vec<(Vec<String>, ClapCommand)>) {
            out.push((path.clone(), cmd.clone()));
            for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
                walk(sub, [path.clone(), vec![sub.get_name().to_string()]].concat(), out);
            }
        }
        let mut root = Cli::command();
        root.build();
        let mut out = Vec::new();
        walk(&root, Vec::new(), &mut out);
        out
    }

    #[test]
    fn servers_under_kubernetes_are_pods_whose_command_edl_runtime_ps_takes() {
        let line = "--scaler kubernetes --kube-image reg/edl:1 --kube-secret edl-ctr --dataset ctr \
                    --ps-servers 2 --ps-memory-mib 512 --ps-port 9100 --ps-kube-resource cpu=2";
        let cli = parse(line).unwrap();
        job::check_ps(&cli.run.ps, &cli.run.cluster).unwrap();
        let spec = job::ps_kube(&cli.run.ps, &cli.run.cluster).expect("servers in Pods");
        assert_eq!((spec.image.as_str(), spec.secret.as_str(), spec.port), ("reg/edl:1", "edl-ctr", 9100));
        assert_eq!(spec.resources, [("cpu".to_string(), "2".to_string())]);
        let pod = edl_runtime::job::ps_kube::server_pod(&spec, "ctr", 4, 512, None);
        let words = pod.spec.unwrap().containers[0].command.clone().unwrap();
        assert_eq!(words[0], "edl-runtime");
        let Some(Command::Ps(a)) = parse(&words[1..].join(" ")).unwrap().command else { panic!("{words:?}") };
        assert_eq!((a.id, a.listen.to_string(), a.memory_mib), (4, "0.0.0.0:9100".to_string(), 512));
        assert_eq!((a.job.as_deref(), a.secret_file.unwrap()), (Some("ctr"), "/run/edl/secret".into()));
        // Their own image, where given; none without Kubernetes or with a command of the operator's.
        let own = parse(&format!("{line} --ps-kube-image reg/edl-ps:1")).unwrap();
        assert_eq!(job::ps_kube(&own.run.ps, &own.run.cluster).unwrap().image, "reg/edl-ps:1");
        let by_command = parse(&format!(
            "{} --ps-command ssh_{{host}}_{{program}} --ps-hosts a",
            line.replace("--ps-kube-resource cpu=2", "")
        ))
        .unwrap();
        assert!(job::ps_kube(&by_command.run.ps, &by_command.run.cluster).is_none());
        let refused = |line: &str| {
            let cli = parse(line).unwrap();
            job::check_ps(&cli.run.ps, &cli.run.cluster).unwrap_err().to_string()
        };
        let e = refused("--dataset ctr --ps-servers 2 --ps-kube-image reg/edl:1");
        assert!(e.contains("servers in Pods (--scaler kubernetes)"), "{e}");
        let e = refused("--dataset ctr --ps-servers 2 --ps-port 9100");
        assert!(e.contains("--ps-port is for servers started by --ps-command or in Pods"), "{e}");
        let e = refused(&line.replace("9100", "0"));
        assert!(e.contains("--ps-port 0"), "{e}");
    }

    #[test]
    fn the_command_tree_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_argument_and_command_has_help() {
        let mut missing = Vec::new();
        for (path, cmd) in commands() {
            if !path.is_empty() && cmd.get_about().is_none() {
                missing.push(format!("`edl-runtime {}` has no about", path.join(" ")));
            }
            for arg in cmd.get_arguments() {
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("`{}` of `edl-runtime {}`", arg.get_id(), path.join(" ")));
                }
            }
        }
        assert!(missing.is_empty(), "without help text: {missing:#?}");
    }

    /// The flag table of docs/training.md: each row's flag and the commands
    /// it says take it (`job` is the built-in job).
    fn documented() -> Vec<(String, Vec<String>)> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/training.md");
        let text = std::fs::read_to_string(path).unwrap();
        let mut rows = Vec::new();
        let mut in_table = false;
        for line in text.lines() {
            if line.starts_with("| flag | default | meaning | taken by |") {
                in_table = true;
            } else if !line.starts_with('|') {
                in_table = false;
            } else if in_table && line.starts_with("| `--") {
                let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
                let flag = cells[0].trim_start_matches('`').split([' ', '`']).next().unwrap().to_string();
                let by = cells
                    .last()
                    .unwrap()
                    .split(',')
                    .map(|c| c.trim().trim_matches('`').to_string())
                    .collect();
                rows.push((flag, by));
            }
        }
        rows
    }

    #[test]
    fn the_docs_table_lists_every_flag_with_the_commands_that_take_it() {
        let docs = documented();
        let row = |flag: &str| docs.iter().find(|(f, _)| f == flag).map(|(_, by)| by.clone());
        let mut wrong = Vec::new();
        for (path, cmd) in commands() {
            let name = if path.is_empty() { "job".to_string() } else { path.join(" ") };
            for arg in cmd.get_arguments().filter(|a| !a.is_positional()) {
                let Some(long) = arg.get_long().filter(|l| !["help", "version"].contains(l)) else {
                    continue;
                };
                let flag = format!("--{long}");
                let want = if arg.is_global_set() { "every command".to_string() } else { name.clone() };
                let torchrun = path == ["launch"] && launch::TORCHRUN_FLAGS.contains(&arg.get_id().as_str());
                let by = row(&flag).unwrap_or_default();
                if by.is_empty() {
                    wrong.push(format!("{flag}: no row"));
                } else if torchrun && !by.iter().any(|b| b == "launch --torchrun") {
                    wrong.push(format!("{flag}: row lacks \"launch --torchrun\" ({by:?})"));
                } else if !torchrun && !by.contains(&want) {
                    wrong.push(format!("{flag}: row lacks {want:?} ({by:?})"));
                }
            }
        }
        // And no row names a command that does not take its flag.
        let all = commands();
        for (flag, by) in &docs {
            for name in by {
                let takes = |path: &[&str]| {
                    let cmd = &all
                        .iter()
                        .find(|(p, _)| p.iter().map(String::as_str).eq(path.iter().copied()))
                        .unwrap()
                        .1;
                    cmd.get_arguments().any(|a| a.get_long() == flag.strip_prefix("--"))
                };
                let ok = match name.as_str() {
                    "job" => takes(&[]),
                    "every command" => Cli::command()
                        .get_arguments()
                        .any(|a| a.is_global_set() && a.get_long() == flag.strip_prefix("--")),
                    "launch --torchrun" => {
                        let launch = Cli::command().find_subcommand("launch").unwrap().clone();
                        launch.get_arguments().any(|a| {
                            a.get_long() == flag.strip_prefix("--")
                                && launch::TORCHRUN_FLAGS.contains(&a.get_id().as_str())
                        })
                    }
                    other => {
                        all.iter().any(|(p, _)| !p.is_empty() && p.join(" ") == other)
                            && takes(&other.split(' ').collect::<Vec<_>>())
                    }
                };
                if !ok {
                    wrong.push(format!("{flag}: listed for {name:?}, which does not take it"));
                }
            }
        }
        assert!(wrong.is_empty(), "docs/training.md's flag table: {wrong:#?}");
    }

    #[test]
    fn flags_before_a_subcommand_are_refused_naming_where_they_go() {
        let e = parse("--max-workers 8 launch --samples 4 -- true").err().unwrap().to_string();
        assert!(
            e.contains("`--max-workers 8` goes after the subcommand: edl-runtime launch --max-workers 8"),
            "{e}"
        );
        let e = parse("--hidden 64 launch --samples 4 -- true").err().unwrap().to_string();
        assert!(e.contains("`--hidden` is a flag of the built-in job"), "{e}");
        // A program without `--` before it.
        let e = parse("launch --samples 4 python train.py").err().unwrap().to_string();
        assert!(
            e.contains("the program to run goes after `--`: `edl-runtime launch [FLAGS] -- python ...`"),
            "{e}"
        );
        // A value that names a subcommand is a value, and the sandbox flags go either side.
        let cli = parse("--job launch --plugin-cache /a").unwrap();
        assert!(cli.command.is_none() && cli.job.as_deref() == Some("launch"));
        let cli = parse("--allow-native launch --plugin-deadline-ms 7 --samples 4 -- true").unwrap();
        assert!(cli.sandbox.allow_native && cli.sandbox.plugin_deadline_ms == 7);
    }

    #[test]
    fn each_subcommand_has_its_own_default_job_name() {
        let job = |line: &str| match parse(line).unwrap() {
            Cli { command: Some(Command::Launch(l)), .. } => l.job,
            c @ Cli { command: None, .. } => c.builtin_job_name(),
            _ => unreachable!(),
        };
        assert_eq!(job(""), "mnist");
        assert_eq!(job("--dataset digits"), "mnist");
        assert_eq!(job("--dataset ctr --ps-servers 2"), "ctr");
        assert_eq!(job("--dataset ctr --job clicks"), "clicks");
        assert_eq!(job("launch --samples 4 -- true"), "launch");
        assert_eq!(job("launch --job mnist --samples 4 -- true"), "mnist");
    }

    #[test]
    fn old_spellings_still_work() {
        let cli = parse("--decide-every 3 --checkpoint-every 5 --step-timeout 9 --teachers 1").unwrap();
        assert_eq!(cli.run.scaling.decide_every_steps, 3);
        assert_eq!(cli.run.state.checkpoint_every_steps, Some(5));
        assert_eq!(cli.run.liveness.step_timeout_secs, 9);
        assert_eq!(cli.run.distillation.teachers, Some(flags::TeachersArg::Count(1)));
        let cli = parse("launch --samples 4 --teacher-addrs a:1,b:2 -- true").unwrap();
        let Some(Command::Launch(l)) = cli.command else { unreachable!() };
        assert_eq!(
            l.run.distillation.teachers,
            Some(flags::TeachersArg::Endpoints(vec!["a:1".into(), "b:2".into()]))
        );
        assert!(parse("distill --teachers a:1 --batch-size 3 --wait-secs 2").is_ok());
        assert!(parse("--teachers a:1 --teacher-processes 2").is_err(), "endpoints or processes, not both");
    }

    #[test]
    fn the_subcommand_a_line_names_skips_flag_values() {
        let path = |line: &str| {
            let args: Vec<OsString> =
                std::iter::once("edl-runtime").chain(line.split_whitespace()).map(Into::into).collect();
            refusals::command_path(&Cli::command(), &args)
        };
        assert_eq!(path("--job launch --hidden 3"), Vec::<String>::new());
        assert_eq!(path("--plugin-cache plugin plugin replay --policy x"), ["plugin", "replay"]);
        assert_eq!(path("launch --job simulate -- simulate"), ["launch"]);
    }
}
