//! `edl-runtime plugin`: create a plugin crate, inspect a plugin file, and
//! replay a policy over a trace or a scenario.

use super::{flags::parse_pair, plugin_path};
use anyhow::Result;
use clap::{Subcommand, ValueEnum};
use edl_plugin_sdk::Hyperparams;
use edl_runtime::{
    plot,
    plugin::{
        PluginHost, PolicyPlugin, World,
        replay::{self, Decision, Trace},
        scaffold,
    },
};
use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

#[derive(Subcommand)]
pub enum PluginCommand {
    /// Create a plugin crate: a working example, a unit test, a bench and a README.
    New {
        /// The plugin's world: what it decides.
        world: WorldArg,
        /// Crate name (lowercase letters, digits, '-', '_').
        name: String,
        /// Directory to create the crate in (default: the current one).
        #[arg(long, value_name = "DIR", default_value = ".")]
        dir: PathBuf,
    },
    /// Print a plugin's world, interface version, info, exports, size and cache state.
    Inspect {
        /// The plugin file (`.wasm` component or native library); a relative
        /// path not found here is also looked for beside the executable.
        file: PathBuf,
    },
    /// Run a policy over a trace (JSON lines of cluster views) or a scenario
    /// (a simulated cluster, see examples/traces/) and print its decisions;
    /// or a teacher policy over a job's report (its `teacher_decisions`) or
    /// JSON lines of teacher views; with `--servers`, a policy's sizing of
    /// the parameter servers over a job's report (its `server_decisions`);
    /// with `--spares`, of the warm spares (its `spare_decisions`).
    Replay(ReplayArgs),
}

#[derive(clap::Args)]
#[group(skip)]
#[command(group(clap::ArgGroup::new("replayed").required(true).args(["policy", "teacher_policy", "adapter"])))]
pub struct ReplayArgs {
    /// Scaling-policy plugin to replay; a relative path not found here is
    /// also looked for beside the executable.
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
    /// Replay the policy's sizing of the parameter servers (its
    /// `decide-servers`) instead, over a job's report (its
    /// `server_decisions`) or JSON lines of server views.
    #[arg(long, requires = "policy")]
    servers: bool,
    /// Replay the policy's sizing of the warm spares (its `decide-spares`)
    /// instead, over a job's report (its `spare_decisions`) or JSON lines
    /// of spare views.
    #[arg(long, requires = "policy", conflicts_with = "servers")]
    spares: bool,
    /// Teacher-policy plugin to replay instead, over a job's report or
    /// JSON lines of teacher views.
    #[arg(long, value_name = "FILE")]
    teacher_policy: Option<PathBuf>,
    /// Batch adapter to replay instead, over a job's report (its
    /// `adapter_decisions`: what the adapter was told of the training).
    #[arg(long, value_name = "FILE")]
    adapter: Option<PathBuf>,
    /// Adapter configuration, `key=value` (repeatable), as for the main command.
    #[arg(long = "adapter-config", value_name = "KEY=VALUE", value_parser = parse_pair)]
    adapter_config: Vec<(String, String)>,
    /// Policy configuration, `key=value` (repeatable), as for the main command.
    #[arg(long = "policy-config", alias = "config", value_name = "KEY=VALUE", value_parser = parse_pair)]
    config: Vec<(String, String)>,
    /// The trace: JSON lines of cluster views, or a scenario (JSON).
    #[arg(long, value_name = "FILE")]
    trace: PathBuf,
    /// Price of a worker-hour shown to the policy, in place of the
    /// trace's (`price_per_worker_hour`).
    #[arg(long, value_name = "PRICE")]
    price: Option<f64>,
    /// Print JSON lines instead of a table.
    #[arg(long, help_heading = "Output")]
    json: bool,
    /// Draw world size and throughput over the steps to this SVG file.
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    plot: Option<PathBuf>,
}

/// A plugin's world, as `plugin new` takes it.
#[derive(Clone, Copy, ValueEnum)]
pub enum WorldArg {
    /// Decides the world size.
    ScalingPolicy,
    /// Sets the batch size and learning rate at each step and resize.
    BatchAdapter,
    /// Changes every batch the reader hands out.
    ReaderTransform,
    /// Sizes the teacher pool and the requests in flight at each teacher.
    #[value(alias = "teacher-pool-policy")]
    TeacherPolicy,
}

impl From<WorldArg> for World {
    fn from(w: WorldArg) -> World {
        match w {
            WorldArg::ScalingPolicy => World::ScalingPolicy,
            WorldArg::BatchAdapter => World::BatchAdapter,
            WorldArg::ReaderTransform => World::ReaderTransform,
            WorldArg::TeacherPolicy => World::TeacherPolicy,
        }
    }
}

pub fn run(host: &PluginHost, command: PluginCommand) -> Result<ExitCode> {
    match command {
        PluginCommand::New { world, name, dir } => new(world, &name, &dir),
        PluginCommand::Inspect { file } => inspect(host, &plugin_path::resolve("plugin inspect", &file)?),
        PluginCommand::Replay(args) => replay(host, args),
    }
}

fn new(world: WorldArg, name: &str, dir: &Path) -> Result<ExitCode> {
    let created = scaffold::new_plugin(world.into(), name, dir, None)?;
    println!("created {} ({} plugin); next:", created.display(), World::from(world));
    println!("  cd {}", created.display());
    println!("  cargo test");
    println!("  cargo build --release --target wasm32-wasip2");
    Ok(ExitCode::SUCCESS)
}

fn inspect(host: &PluginHost, file: &Path) -> Result<ExitCode> {
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
    match host.describe_config(file) {
        Ok(Some(keys)) if keys.is_empty() => println!("config:      none"),
        Ok(Some(keys)) => {
            let flag = match i.world {
                edl_runtime::plugin::World::BatchAdapter => "--adapter-config",
                edl_runtime::plugin::World::ReaderTransform => "--transform-config",
                edl_runtime::plugin::World::TeacherPolicy => "--teacher-policy-config",
                edl_runtime::plugin::World::ScalingPolicy => "--policy-config",
            };
            println!("config:      {flag} KEY=VALUE, for");
            for k in keys {
                let kind =
                    k.kind.map(|t| format!(" ({})", t.rsplit("::").next().unwrap_or(&t))).unwrap_or_default();
                match k.default {
                    Some(d) => println!("  {} = {d}{kind}", k.key),
                    None => println!("  {}{kind}", k.key),
                }
            }
        }
        Ok(None) => {
            println!("config:      not described (a plugin built with an older SDK, or not with the SDK)")
        }
        Err(e) => println!("config:      not described: {e}"),
    }
    match (i.cached, &i.cache_entry) {
        (Some(c), Some(entry)) => {
            println!("cached:      {} ({})", if c { "yes" } else { "no, compiled now" }, entry.display())
        }
        (_, _) if i.kind == "wasm" => println!("cached:      cache disabled"),
        _ => println!("cached:      not applicable"),
    }
    Ok(ExitCode::SUCCESS)
}

fn replay(host: &PluginHost, args: ReplayArgs) -> Result<ExitCode> {
    if let Some(price) = args.price
        && !(price.is_finite() && price >= 0.0)
    {
        edl_runtime::refuse!("--price {price}: need a finite price of 0 or more");
    }
    if args.adapter.is_some() {
        return replay_adapter(host, args);
    }
    let Some(policy) = &args.policy else { return replay_teachers(host, args) };
    if args.servers {
        return replay_sizing(host, args, &SERVERS);
    }
    if args.spares {
        return replay_sizing(host, args, &SPARES);
    }
    let mut p = host.load_policy(&plugin_path::resolve("--policy", policy)?, &args.config)?;
    let (decisions, recorded) = match replay::read_trace(&args.trace)?.priced(args.price) {
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
    let mut out = std::io::stdout().lock();
    for d in &decisions {
        match print_decision(&mut out, d, args.json) {
            Ok(()) => {}
            // A closed pipe (`| head`) has read enough: stop printing, quietly.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => break,
            Err(e) => return Err(e.into()),
        }
    }
    drop(out);
    eprintln!("{}", replay_summary(&p.info().name, &args.trace, &decisions));
    if let Some(out) = args.plot {
        let title = format!("{} on {}", p.info().name, args.trace.display());
        plot::policy_run(&out, &title, &decisions, recorded)?;
        eprintln!("plot written to {}", out.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// What a scaling policy's replay came to, in one line: its decisions,
/// how many would resize (grow, shrink) and the world size the last one
/// leaves (a recorded trace does not react: each is against its own view).
fn replay_summary(name: &str, trace: &std::path::Path, decisions: &[replay::Decision]) -> String {
    let grow = decisions.iter().filter(|d| d.chosen > d.world_size).count();
    let shrink = decisions.iter().filter(|d| d.chosen < d.world_size).count();
    let last = decisions.last().map_or(String::from("-"), |d| d.chosen.to_string());
    format!(
        "{} decisions of {name} over {}: {} would resize ({grow} grow, {shrink} shrink); the last leaves {last} workers",
        decisions.len(),
        trace.display(),
        grow + shrink
    )
}

/// Replays a batch adapter over what a job's report says it was told of
/// the training: each answer as a line (or JSON) beside the job's, then
/// how many changed the batch and how many the job's answer matched.
fn replay_adapter(host: &PluginHost, args: ReplayArgs) -> Result<ExitCode> {
    let path = args.adapter.as_ref().expect("one of the group is given");
    if args.plot.is_some() || args.price.is_some() {
        edl_runtime::refuse!("--plot and --price are for a scaling policy's replay");
    }
    let mut p = host.load_adapter(&plugin_path::resolve("--adapter", path)?, &args.adapter_config)?;
    let decisions = replay::read_adapter_trace(&args.trace)?;
    let (mut out, mut changed, mut same) = (std::io::stdout().lock(), 0, 0);
    for d in &decisions {
        // As in the job: told, then asked at the next step (if one came
        // before the job ended or the adapter was told again).
        let told = p.on_training(&d.stats);
        if d.step == u64::MAX && told.is_ok() {
            continue;
        }
        let answer = told.and_then(|_| p.on_step(d.step, &d.current));
        let h = answer.as_ref().ok();
        changed += usize::from(h.is_some_and(|h| h.global_batch != d.current.global_batch));
        same += usize::from(h.is_some() && h == d.answer.as_ref());
        let line = match (&answer, args.json) {
            (_, true) => serde_json::json!({
                "step": d.step,
                "noise_scale": d.stats.noise_scale,
                "current": d.current,
                "answer": h,
                "in_the_job": d.answer,
                "error": answer.as_ref().err().map(|e| e.to_string()),
            })
            .to_string(),
            (Ok(h), false) => format!(
                "step {:>7}  noise scale {:>8.1}  batch {:>5} -> {:>5}  lr {:.4} -> {:.4}",
                d.step, d.stats.noise_scale, d.current.global_batch, h.global_batch, d.current.lr, h.lr
            ),
            (Err(e), false) => format!("step {:>7}  error: {e}", d.step),
        };
        if !print_line(&mut out, &line)? {
            break;
        }
    }
    drop(out);
    eprintln!(
        "{} decisions of {} over {}: {changed} changed the batch; {same} answered as in the job",
        decisions.len(),
        p.info().name,
        args.trace.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// What a replay of a policy's sizing of something (the parameter
/// servers, the warm spares) needs of it.
struct Sizing<V> {
    /// What is sized, in the output: `servers`, `spares`.
    what: &'static str,
    read: fn(&Path) -> Result<Vec<replay::SizingTraceEntry<V>>, replay::TraceError>,
    ask: fn(&mut dyn PolicyPlugin, &V) -> Result<Option<u32>, edl_runtime::plugin::Error>,
    /// The view's step and how many there were then.
    now: fn(&V) -> (u64, u32),
    /// The view's other figures worth a line.
    more: fn(&V) -> String,
}

const SERVERS: Sizing<edl_plugin_sdk::ServerView> = Sizing {
    what: "servers",
    read: replay::read_server_trace,
    ask: |p, v| p.decide_servers(v),
    now: |v| (v.step, v.servers.len() as u32),
    more: |v| format!("rows {:>10}", v.servers.iter().map(|s| s.rows).sum::<u64>()),
};

const SPARES: Sizing<edl_plugin_sdk::SpareView> = Sizing {
    what: "spares",
    read: replay::read_spare_trace,
    ask: |p, v| p.decide_spares(v),
    now: |v| (v.step, v.spares_wanted),
    more: |v| {
        format!(
            "ready {}  spare-hours {:.3} at {}/h  from spares {}  cold {}  lost {}",
            v.spares_ready,
            v.spare_hours,
            v.price_per_spare_hour,
            v.from_spares,
            v.started_cold,
            v.members_lost
        )
    },
};

/// Replays a scaling policy's sizing of the servers or the spares over the
/// views of a trace: each answer as a line (or JSON) beside the job's,
/// then how many would change the number and how many answered as in the
/// job.
fn replay_sizing<V>(host: &PluginHost, args: ReplayArgs, kind: &Sizing<V>) -> Result<ExitCode> {
    let path = args.policy.as_ref().expect("--servers and --spares require --policy");
    if args.plot.is_some() || args.price.is_some() {
        edl_runtime::refuse!("--plot and --price are for a scaling policy's replay of its workers");
    }
    let mut p = host.load_policy(&plugin_path::resolve("--policy", path)?, &args.config)?;
    let entries = (kind.read)(&args.trace)?;
    let (mut out, mut changes, mut same, mut recorded) = (std::io::stdout().lock(), 0, 0, 0);
    let what = kind.what;
    for e in &entries {
        let answer = (kind.ask)(p.as_mut(), &e.view);
        let asked = answer.as_ref().ok().copied().flatten();
        let (step, had) = (kind.now)(&e.view);
        changes += usize::from(asked.is_some_and(|n| n != had));
        if let Some(job) = e.in_the_job {
            recorded += 1;
            same += usize::from(answer.is_ok() && asked == job);
        }
        let line = match (&answer, args.json) {
            (_, true) => serde_json::json!({
                "step": step,
                what: had,
                "answer": asked,
                "in_the_job": e.in_the_job,
                "error": answer.as_ref().err().map(|e| e.to_string()),
            })
            .to_string(),
            (Ok(a), false) => {
                let to = a.map_or("left be".to_string(), |n| format!("-> {n:>3}"));
                let job = match e.in_the_job {
                    Some(Some(n)) => format!("  (in the job: {n})"),
                    Some(None) => "  (in the job: left be)".to_string(),
                    None => String::new(),
                };
                format!("step {step:>7}  {what} {had:>3} {to}  {}{job}", (kind.more)(&e.view))
            }
            (Err(err), false) => format!("step {step:>7}  {what} {had:>3}  the policy failed: {err}"),
        };
        if !print_line(&mut out, &line)? {
            break;
        }
    }
    drop(out);
    eprintln!(
        "{} decisions of {} over {}: {changes} would change the {what}; {same} of {recorded} answered as in the job",
        entries.len(),
        p.info().name,
        args.trace.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Replays a teacher policy over the views of a trace: each decision as a
/// line (or JSON), then how many changed the pool's size.
fn replay_teachers(host: &PluginHost, args: ReplayArgs) -> Result<ExitCode> {
    let path = args.teacher_policy.as_ref().expect("one of the group is given");
    if args.plot.is_some() {
        edl_runtime::refuse!(
            "--plot draws a scaling policy's run; a teacher policy's replay is printed only"
        );
    }
    let mut p = host.load_teacher_policy(&plugin_path::resolve("--teacher-policy", path)?, &args.config)?;
    let mut views = replay::read_teacher_trace(&args.trace)?;
    let mut out = std::io::stdout().lock();
    let mut changes = 0;
    for v in &mut views {
        if let Some(price) = args.price {
            v.price_per_teacher_hour = price;
        }
        let answer = p.decide(v);
        if answer.as_ref().is_ok_and(|a| a.teachers != v.teacher_count) {
            changes += 1;
        }
        let line = match (&answer, args.json) {
            (_, true) => serde_json::json!({
                "step": v.step,
                "teachers": v.teacher_count,
                "plan": answer.as_ref().ok(),
                "error": answer.as_ref().err().map(|e| e.to_string()),
            })
            .to_string(),
            (Ok(a), false) => format!(
                "step {:>7}  teachers {:>3} -> {:>3}  in flight {:>2}  students waited {:>3.0}%, teachers {:>3.0}% busy",
                v.step,
                v.teacher_count,
                a.teachers,
                a.in_flight_per_teacher,
                v.wait_share * 100.0,
                v.mean_utilisation() * 100.0
            ),
            (Err(e), false) => {
                format!("step {:>7}  teachers {:>3}  the policy failed: {e}", v.step, v.teacher_count)
            }
        };
        if !print_line(&mut out, &line)? {
            break;
        }
    }
    drop(out);
    eprintln!(
        "{} decisions of {} over {}: {changes} would change the pool's size",
        views.len(),
        p.info().name,
        args.trace.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Writes one line of a replay; false when the reader has gone (a closed
/// pipe, `| head`, has read enough: the replay stops printing, quietly).
fn print_line(out: &mut impl std::io::Write, line: &str) -> Result<bool> {
    match writeln!(out, "{line}") {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

fn print_decision(out: &mut impl std::io::Write, d: &Decision, json: bool) -> std::io::Result<()> {
    if json {
        writeln!(out, "{}", serde_json::to_string(d)?)?;
    } else {
        let actions: Vec<String> = d.actions.iter().map(|a| a.to_string()).collect();
        writeln!(
            out,
            "step {:>7}  world {:>3} -> {:>3}  {:>10.1} samples/s  {}",
            d.step,
            d.world_size,
            d.chosen,
            d.throughput,
            actions.join(", ")
        )?;
    }
    Ok(())
}
