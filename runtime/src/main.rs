//! The `edl-runtime` command line.

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use edl_plugin_sdk::{Hyperparams, testing::SimCluster};
use edl_runtime::{
    plugin::{AdapterPlugin, ArtifactCache, HostOptions, Limits, PluginHost, PolicyPlugin, Reloading},
    replay,
};
use std::{path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

#[derive(Parser)]
#[command(name = "edl-runtime", version, about = "Elastic deep-learning runtime with WebAssembly plugins")]
struct Cli {
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
    /// Work with plugin files.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
}

#[derive(Subcommand)]
enum PluginCommand {
    /// Print a plugin's world, interface version, info, exports, size and cache state.
    Inspect { file: PathBuf },
    /// Feed a trace of cluster views (JSON lines) through a policy and print its decisions.
    Replay {
        #[arg(long)]
        policy: PathBuf,
        #[arg(long)]
        trace: PathBuf,
        /// Policy configuration, `key=value` (repeatable).
        #[arg(long = "config", value_parser = parse_pair)]
        config: Vec<(String, String)>,
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Scaling-policy plugin (`.wasm` component or native `.so`).
    #[arg(long, default_value = "plugins/autoscale.wasm")]
    policy: PathBuf,
    /// Batch-adapter plugin.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Policy configuration, `key=value` (repeatable).
    #[arg(long = "policy-config", value_parser = parse_pair)]
    policy_config: Vec<(String, String)>,
    /// Adapter configuration, `key=value` (repeatable).
    #[arg(long = "adapter-config", value_parser = parse_pair)]
    adapter_config: Vec<(String, String)>,
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
}

fn parse_pair(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
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
    Ok(PluginHost::new(HostOptions { limits, cache })?)
}

fn run(cli: Cli) -> Result<ExitCode> {
    if let Some(Command::Devices) = cli.command {
        println!("{}", edl_host_gpu::DeviceReport::probe());
        return Ok(ExitCode::SUCCESS);
    }
    let host = host(&cli.sandbox)?;
    match cli.command {
        Some(Command::Devices) => unreachable!("handled above"),
        Some(Command::Plugin { command: PluginCommand::Inspect { file } }) => inspect(&host, &file),
        Some(Command::Plugin { command: PluginCommand::Replay { policy, trace, config, json } }) => {
            let mut policy = host.load_policy(&policy, &config)?;
            let views = replay::read_trace(&trace)?;
            for d in replay::replay(policy.as_mut(), &views)? {
                if json {
                    println!("{}", serde_json::to_string(&d)?);
                } else {
                    let actions: Vec<String> = d.actions.iter().map(|a| a.to_string()).collect();
                    println!(
                        "step {:>7}  world {:>3}  {:>10.1} samples/s  {}",
                        d.step,
                        d.world_size,
                        d.throughput,
                        actions.join(", ")
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        None => simulate(&host, cli.run),
    }
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

/// The main job until training lands in this command: the policy (and the
/// adapter) drive a simulated cluster whose throughput saturates at 4 workers
/// and where one worker turns slow half way.
fn simulate(host: &Arc<PluginHost>, args: RunArgs) -> Result<ExitCode> {
    if !args.policy.exists() {
        bail!(
            "{}: no such plugin; `cargo build --release` builds the shipped plugins into plugins/",
            args.policy.display()
        );
    }
    let mut policy: Box<dyn PolicyPlugin> = if args.watch {
        Box::new(Reloading::policy(host.clone(), &args.policy, &args.policy_config)?)
    } else {
        host.load_policy(&args.policy, &args.policy_config)?
    };
    let mut adapter: Option<Box<dyn AdapterPlugin>> = match &args.adapter {
        None => None,
        Some(p) if args.watch => Some(Box::new(Reloading::adapter(host.clone(), p, &args.adapter_config)?)),
        Some(p) => Some(host.load_adapter(p, &args.adapter_config)?),
    };
    let info = policy.info().clone();
    println!("policy  {} {} ({}, {:?})", info.name, info.version, args.policy.display(), policy.backend());
    if let Some(a) = &adapter {
        println!("adapter {} {}", a.info().name, a.info().version);
    }
    let mut sim = SimCluster::saturating(4, args.min_workers, args.max_workers);
    println!(
        "simulated cluster: {}..{} workers, throughput saturates at 4 workers, worker 1 slows to 0.5x half way",
        args.min_workers, args.max_workers
    );
    let mut hyper =
        Hyperparams { global_batch: 64 * sim.world_size(), local_batch: 64, lr: 0.1, momentum: 0.9 };
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
    let half = args.decisions / 2;
    let first = replay::simulate(
        policy.as_mut(),
        adapter.as_mut().map(|a| a.as_mut() as &mut dyn AdapterPlugin),
        &mut sim,
        half,
        hyper,
        print,
    )
    .context("simulation")?;
    if let Some(h) = first.events.iter().rev().find_map(|e| e.hyperparams) {
        hyper = h;
    }
    if sim.world_size() > 1 {
        sim.set_speed(1, 0.5);
    }
    let second = replay::simulate(
        policy.as_mut(),
        adapter.as_mut().map(|a| a.as_mut() as &mut dyn AdapterPlugin),
        &mut sim,
        args.decisions - half,
        hyper,
        print,
    )
    .context("simulation")?;
    let events = first.events.len() + second.events.len();
    println!(
        "done: {} decisions, {} scale events, final world size {}, throughput {:.0} samples/s",
        args.decisions,
        events,
        sim.world_size(),
        sim.throughput()
    );
    Ok(ExitCode::SUCCESS)
}
