//! `edl-runtime simulate`: a scaling policy (and a batch adapter) drive a
//! simulated cluster, a quick look at a policy's behaviour without training.

use super::{
    flags::{PluginArgs, TransformArgs, WorkerBounds},
    plugin_path,
};
use anyhow::{Context, Result};
use clap::Args;
use edl_plugin_sdk::{Hyperparams, testing::standard_batch};
use edl_runtime::{
    plot,
    plugin::{
        AdapterPlugin, PluginHost, PolicyPlugin, Reloading,
        replay::{self, Scenario, ScenarioEvent, SlowWorker},
    },
};
use std::{path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

#[derive(Args)]
pub struct SimArgs {
    #[command(flatten)]
    plugins: PluginArgs,
    #[command(flatten)]
    transform: TransformArgs,
    /// Reload the plugins when their files change, and run the scenario
    /// again and again, a decision every `--decide-every-secs`, until
    /// interrupted (Ctrl-C).
    #[arg(long, help_heading = "Plugins")]
    watch: bool,
    /// Seconds between two decisions (default: 1 with --watch, else none:
    /// the decisions run at once).
    #[arg(long, value_name = "SECS", help_heading = "Simulation")]
    decide_every_secs: Option<f64>,
    #[command(flatten)]
    bounds: WorkerBounds,
    /// Price of a worker-hour the simulated cluster shows the policy
    /// (`price_per_worker_hour` of the view), for cost-aware policies.
    #[arg(long, value_name = "PRICE", default_value_t = 0.0, help_heading = "Workers and scaling")]
    price: f64,
    /// Policy decisions to simulate (one every 20 steps).
    #[arg(long, value_name = "N", default_value_t = 60, help_heading = "Simulation")]
    decisions: usize,
    /// Draw world size and throughput over the steps to this SVG file.
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    plot: Option<PathBuf>,
}

/// The plugins of a simulation, found where the flags say or beside the
/// executable, and loaded (reloading when their files change, with --watch).
struct SimPlugins {
    policy: Box<dyn PolicyPlugin>,
    policy_path: PathBuf,
    adapter: Option<Box<dyn AdapterPlugin>>,
}

impl SimPlugins {
    fn load(host: &Arc<PluginHost>, args: &SimArgs) -> Result<SimPlugins> {
        let (p, watch) = (&args.plugins, args.watch);
        let policy_path = plugin_path::resolve("--policy", &p.policy)?;
        let policy: Box<dyn PolicyPlugin> = if watch {
            Box::new(Reloading::policy(host.clone(), &policy_path, &p.policy_config)?)
        } else {
            host.load_policy(&policy_path, &p.policy_config)?
        };
        let adapter: Option<Box<dyn AdapterPlugin>> = match &p.adapter {
            None => None,
            Some(a) => {
                let a = plugin_path::resolve("--adapter", a)?;
                Some(if watch {
                    Box::new(Reloading::adapter(host.clone(), &a, &p.adapter_config)?)
                } else {
                    host.load_adapter(&a, &p.adapter_config)?
                })
            }
        };
        Ok(SimPlugins { policy, policy_path, adapter })
    }
}

/// Runs the simulation and prints each scale event; with `--watch`, runs
/// it round after round until interrupted, the plugins reloaded as their
/// files change.
pub fn run(host: &Arc<PluginHost>, args: SimArgs) -> Result<ExitCode> {
    if !(args.price.is_finite() && args.price >= 0.0) {
        edl_runtime::refuse!("--price {}: need a finite price of 0 or more", args.price);
    }
    // The bounds a job would refuse, refused alike.
    let b = &args.bounds;
    if let Err(e) = edl_runtime::job::config::worker_bounds(b.min_workers, b.max_workers, b.initial()) {
        edl_runtime::refuse!("{e}");
    }
    let pace = match (args.decide_every_secs, args.watch) {
        (Some(s), _) => Duration::try_from_secs_f64(s).map_err(|_| {
            anyhow::anyhow!("--decide-every-secs {s}: need a finite number of seconds, 0 or more")
        })?,
        (None, true) => Duration::from_secs(1),
        (None, false) => Duration::ZERO,
    };
    let SimPlugins { mut policy, policy_path, mut adapter } = SimPlugins::load(host, &args)?;
    let info = policy.info().clone();
    println!("policy    {} {} ({}, {})", info.name, info.version, policy_path.display(), policy.backend());
    if let Some(a) = &adapter {
        println!("adapter   {} {}", a.info().name, a.info().version);
    }
    if let Some(path) = &args.transform.transform {
        try_transform(host, &plugin_path::resolve("--transform", path)?, &args.transform.transform_config)?;
    }
    if args.watch {
        println!(
            "watching  {}{}: a changed file is loaded at the next decision; a decision every {:?}; Ctrl-C ends it",
            policy_path.display(),
            if adapter.is_some() { " and the adapter" } else { "" },
            pace
        );
    }
    for round in 1.. {
        if args.watch {
            println!("round {round}");
        }
        let adapter = adapter.as_mut().map(|a| a.as_mut() as &mut dyn AdapterPlugin);
        let done = simulate_once(&args, policy.as_mut(), adapter, pace);
        if !args.watch {
            done?;
            break;
        }
        // Watching, a failing version is said and the next round waits for a better one.
        if let Err(e) = done {
            println!(
                "round {round} failed: {e:#}; the next starts in {:?}",
                pace.max(Duration::from_secs(1))
            );
            std::thread::sleep(pace.max(Duration::from_secs(1)));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One run of the scenario: its decisions, paced `pace` apart; says each
/// scale event and, at the end, the outcome (and writes the plot).
fn simulate_once(
    args: &SimArgs,
    policy: &mut dyn PolicyPlugin,
    adapter: Option<&mut dyn AdapterPlugin>,
    pace: Duration,
) -> Result<()> {
    let scenario = demo_scenario(args);
    let mut sim = scenario.cluster();
    println!(
        "simulated cluster: {}..{} workers at {} per worker-hour, throughput saturates at 4, \
         worker 1 slows to 0.5x at step {}, capacity drops to {} at step {} and comes back at step {}",
        args.bounds.min_workers,
        args.bounds.max_workers,
        args.price,
        scenario.events[0].at as u64 * sim.steps_per_decision,
        scenario.events[1].capacity.unwrap_or(0),
        scenario.events[1].at as u64 * sim.steps_per_decision,
        scenario.events[2].at as u64 * sim.steps_per_decision,
    );
    let hyper = Hyperparams { global_batch: 64 * sim.world_size(), local_batch: 64, lr: 0.1, momentum: 0.9 };
    let run = replay::simulate(
        policy,
        adapter,
        &mut sim,
        scenario.decisions,
        hyper,
        |r, s| {
            if r > 0 && !pace.is_zero() {
                std::thread::sleep(pace);
            }
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
        print_scale_event,
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
        let title = format!("{} on the simulated cluster", policy.info().name);
        plot::policy_run(out, &title, &run.decisions, false)?;
        println!("plot written to {}", out.display());
    }
    Ok(())
}

/// Runs the transform once on a standard batch and says what it did.
fn try_transform(host: &PluginHost, path: &std::path::Path, config: &[(String, String)]) -> Result<()> {
    let mut t = host.load_transform(path, config)?;
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
    Ok(())
}

fn print_scale_event(d: &replay::Decision, e: Option<&replay::SimulatedResize>) {
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
}

/// The simulated cluster: throughput saturates at 4 workers, one worker
/// turns slow half way, and the cluster takes capacity back for a while
/// near the end.
fn demo_scenario(args: &SimArgs) -> Scenario {
    let n = args.decisions;
    let (min, max) = (args.bounds.min_workers, args.bounds.max_workers);
    Scenario {
        curve: None,
        knee: Some(4),
        start: args.bounds.initial(),
        min_workers: min,
        max_workers: max,
        capacity: None,
        decisions: n,
        price_per_worker_hour: args.price,
        events: vec![
            ScenarioEvent { at: n / 2, slow: Some(SlowWorker { worker: 1, speed: 0.5 }), capacity: None },
            ScenarioEvent { at: n * 3 / 4, slow: None, capacity: Some(2.max(min)) },
            ScenarioEvent { at: n * 7 / 8, slow: None, capacity: Some(max) },
        ],
    }
}
