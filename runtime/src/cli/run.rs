//! The main command (an elastic training job of the built-in student with
//! teachers on this machine) and `launch` (the same job running the user's
//! own program as its workers).

use super::{PluginArgs, RunArgs, ScalerKind};
use anyhow::{Context, Result, bail};
use edl_host_gpu::{Device, comm::auth::Secret};
use edl_plugin_sdk::Hyperparams;
use edl_runtime::{
    checkpoint::Checkpoints,
    job::{
        self, BuiltinModel, JobConfig, JobSpec, LocalProcesses, Program, Progress, Scaler, TeacherSource,
        report::Report,
        scaler::{CommandScaler, ExternalWorkers},
        teachers::{TeacherProcess, TeacherTraining, teacher_model},
        torchrun::{self, Event as TorchrunEvent, TorchrunConfig},
    },
    plot,
    plugin::{AdapterPlugin, PluginHost, PolicyPlugin},
    trainer::{
        model::Mlp,
        train::Trainer,
        worker::{load_data, mlp_of},
    },
};
use indicatif::{ProgressBar, ProgressStyle};
use std::{
    path::PathBuf,
    process::ExitCode,
    sync::{Arc, Mutex},
    time::Duration,
};

fn sizes(list: &str, what: &str) -> Result<Vec<usize>> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<Vec<_>>>()
        .with_context(|| format!("--{what} {list:?}: expected positive sizes separated by commas"))
}

/// Prints above the progress bar, or plainly when there is no terminal.
fn say(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        println!("{line}");
    } else {
        bar.println(line);
    }
}

/// A job of the user's own program (`edl-runtime launch`).
pub struct Launch {
    /// The job's samples: steps hand out indices `0..samples`.
    pub samples: usize,
    /// The program and its arguments, run as each worker.
    pub command: Vec<String>,
    /// Teachers' OIP endpoints the program's steps may ask.
    pub teacher_addrs: Vec<String>,
}

/// The scaling policy and its name and version.
fn load_policy(host: &PluginHost, plugins: &PluginArgs) -> Result<(Box<dyn PolicyPlugin>, String)> {
    if !plugins.policy.exists() {
        bail!(
            "{}: no such plugin; `cargo build --release` builds the shipped plugins into plugins/",
            plugins.policy.display()
        );
    }
    let policy = host.load_policy(&plugins.policy, &plugins.policy_config)?;
    let name = format!("{} {}", policy.info().name, policy.info().version);
    Ok((policy, name))
}

/// The name of a launched job: the default name belongs to the built-in job.
/// The scaler `--scaler` names; `program`: the launched command, if any.
fn scaler(
    args: &RunArgs,
    exe: &std::path::Path,
    log_dir: &std::path::Path,
    program: Option<&[String]>,
) -> Result<Box<dyn Scaler>> {
    let (stop, hosts) = (args.worker_stop_command.as_deref(), &args.hosts[..]);
    Ok(match (args.scaler, program) {
        (ScalerKind::Local, None) => Box::new(LocalProcesses::new(exe, log_dir)),
        (ScalerKind::Local, Some(command)) => Box::new(LocalProcesses::program(command, log_dir)?),
        (ScalerKind::Command, program) => {
            let start = args.worker_command.as_deref().context("--scaler command needs --worker-command")?;
            Box::new(match program {
                None => CommandScaler::new(start, stop, hosts, exe, log_dir)?,
                Some(command) => CommandScaler::for_program(start, stop, hosts, log_dir, command)?,
            })
        }
        (ScalerKind::External, _) => Box::new(ExternalWorkers),
    })
}

fn launched_job_name(job: &str) -> String {
    if job == "mnist" { "launch".to_string() } else { job.to_string() }
}

pub fn run(host: &Arc<PluginHost>, args: RunArgs, launch: Option<Launch>) -> Result<ExitCode> {
    let (policy, policy_name) = load_policy(host, &args.plugins)?;
    let adapter: Option<Box<dyn AdapterPlugin>> = match &args.plugins.adapter {
        Some(p) => Some(host.load_adapter(p, &args.plugins.adapter_config)?),
        None => None,
    };
    if let Some(t) = &args.plugins.transform {
        // Loaded here once so a broken plugin fails the job before it starts.
        host.load_transform(t, &args.transform_config)?;
    }
    let adapter_name = adapter.as_ref().map(|a| format!("{} {}", a.info().name, a.info().version));
    let root = PathBuf::from(".edl");
    let job_name = if launch.is_some() { launched_job_name(&args.job) } else { args.job.clone() };
    let args = RunArgs { job: job_name, ..args };
    let checkpoint_dir =
        args.checkpoint_dir.clone().unwrap_or_else(|| root.join(&args.job).join("checkpoints"));
    // Checkpoints in object storage: the job's local files (logs, the lock,
    // the secret) stay in .edl/<job>/.
    let remote = edl_runtime::checkpoint::objects::is_url(&checkpoint_dir.to_string_lossy());
    let job_dir = if remote {
        root.join(&args.job)
    } else {
        checkpoint_dir.parent().unwrap_or(&checkpoint_dir).to_path_buf()
    };
    let log_dir = job_dir.join("logs");
    let exe = std::env::current_exe().context("locating edl-runtime")?;

    // The built-in student and its data, or the program's index range.
    let builtin = match &launch {
        None => {
            let mut model = BuiltinModel {
                dataset: args.dataset.clone(),
                test_rows: if args.dataset == "digits" { 400 } else { 1000 },
                split_seed: 1,
                train_samples: args.train_samples,
                layers: Vec::new(),
            };
            let (train, test) = load_data(&BuiltinModel { train_samples: None, ..model.clone() })?;
            let hidden = sizes(&args.hidden, "hidden")?;
            model.layers = std::iter::once(train.dim).chain(hidden).chain([train.classes]).collect();
            Some((model, train, test))
        }
        Some(_) => None,
    };
    let (student_rows, program) = match (&builtin, &launch) {
        (Some((model, train, _)), _) => {
            (args.train_samples.map_or(train.len(), |n| n.min(train.len())), Program::Builtin(model.clone()))
        }
        (None, Some(l)) => (l.samples, Program::External { command: l.command.clone() }),
        (None, None) => unreachable!("a job is built in or launched"),
    };
    let mut spec = JobSpec {
        job: args.job.clone(),
        samples: student_rows,
        seed: args.seed,
        epochs: args.epochs,
        program,
        temperature: args.temperature,
        alpha: args.alpha,
        teachers: None,
        teacher_model_name: "teacher".into(),
        transform: match &args.plugins.transform {
            Some(p) => Some(job::proto::ShippedPlugin::read(p)?),
            None => None,
        },
        transform_config: args.transform_config.clone(),
        collective_timeout_ms: args.collective_timeout_ms,
        checkpoint_dir: if remote { checkpoint_dir.clone() } else { std::path::absolute(&checkpoint_dir)? },
        keep_checkpoints: args.keep_checkpoints,
        step_delay_ms: args.step_delay_ms,
        device: args.device.to_string(),
        plugin_deadline_ms: host.limits().deadline.as_millis() as u64,
        plugin_memory_mib: host.limits().memory_bytes >> 20,
        allow_native: host.allows_native(),
        teacher_wait_ms: args.teacher_wait_secs.saturating_mul(1000),
        worker_lease_ms: args.worker_lease_secs.saturating_mul(1000),
        worker_reconnect_ms: args.worker_reconnect_secs.saturating_mul(1000),
        teacher_access: args.teacher_access.read()?,
        teacher_io: args.teacher_io.io(),
        teacher_calls: args.teacher_calls.calls(),
    };
    if let Some((model, _, _)) = &builtin
        && args.device != Device::Cpu
    {
        // A missing driver, GPU, cuBLAS or NVRTC stops the job here, before
        // any process starts.
        Trainer::on(args.device, Mlp::random(&model.layers, args.seed))
            .context("checking --device before the job starts")?;
    }
    // A launched program distils only from the teachers it is given.
    let no_distill = args.no_distill
        || launch.as_ref().is_some_and(|l| l.teacher_addrs.is_empty() && args.service.is_none());
    let mut cfg = JobConfig {
        spec: spec.clone(),
        min_workers: args.min_workers,
        max_workers: args.max_workers,
        initial_workers: args.workers.unwrap_or(args.min_workers),
        decide_every: args.decide_every,
        checkpoint_every: args.checkpoint_every,
        checkpoint_interval: Duration::from_secs(args.checkpoint_secs),
        hyper: Hyperparams {
            global_batch: args.batch,
            local_batch: args.batch,
            lr: args.lr,
            momentum: args.momentum,
        },
        store: args.store.clone(),
        step_timeout: Duration::from_secs(args.step_timeout),
        join_timeout: Duration::from_secs(args.join_timeout_secs.max(1)),
        price_per_worker_hour: args.price,
        teacher_watch: None,
        secret: match &args.secret_file {
            Some(f) if f.exists() => Secret::read(f)?,
            _ => Secret::generate()?,
        },
        addresses: job::net::Addresses {
            listen: args.listen,
            rendezvous_port: args.rendezvous_port,
            advertise: args.advertise.clone(),
        },
    };
    // Teachers this job starts listen beside the coordinator and are
    // reached at the same host.
    let advertised = cfg.addresses.advertised_host()?;
    // Everything a flag can get wrong is refused here, before a teacher or
    // worker starts.
    cfg.validate()?;
    if !no_distill {
        cfg.validate_teacher_wait()?;
    }
    job::preflight(&cfg)?;
    let lock = job::JobLock::acquire(if remote { &job_dir } else { &spec.checkpoint_dir }, &args.job)?;
    std::fs::create_dir_all(&log_dir).with_context(|| format!("{}", log_dir.display()))?;
    // A new secret is written where an operator finds it (mode 0600):
    // --secret-file, or .edl/<job>/secret.
    match &args.secret_file {
        Some(f) if f.exists() => {}
        f => cfg.secret.write(f.as_deref().unwrap_or(&log_dir.with_file_name("secret")))?,
    }
    let what = match (&builtin, &launch) {
        (Some((model, _, test)), _) => format!(
            "{} ({student_rows} training samples, {} test), student {:?}",
            args.dataset,
            test.len(),
            model.layers
        ),
        (None, Some(l)) => format!("{:?} on samples 0..{student_rows}", l.command.join(" ")),
        (None, None) => unreachable!("a job is built in or launched"),
    };
    println!(
        "job {:?}: {what}, {} epochs, {}..{} workers on {}, store {}",
        args.job,
        args.epochs,
        args.min_workers,
        args.max_workers,
        args.device,
        edl_runtime::store::redact(&args.store)
    );
    println!("policy    {policy_name} ({}, {})", args.plugins.policy.display(), policy.backend());
    if let Some(a) = &adapter_name {
        println!("adapter   {a}");
    }

    // Teachers: a wider model trained here (cached), served by teacher processes.
    let mut teacher_accuracy = None;
    let teacher_procs: Arc<Mutex<Vec<TeacherProcess>>> = Default::default();
    if let Some(l) = launch.as_ref().filter(|l| !l.teacher_addrs.is_empty()) {
        spec.teachers = Some(TeacherSource::Fixed(l.teacher_addrs.clone()));
    } else if !no_distill {
        let service = args.service.clone().unwrap_or_else(|| format!("{}-teachers", args.job));
        if let Some((_, train, test)) = builtin.as_ref().filter(|_| args.teachers > 0) {
            let t = TeacherTraining {
                layers: std::iter::once(train.dim)
                    .chain(sizes(&args.teacher_hidden, "teacher-hidden")?)
                    .chain([train.classes])
                    .collect(),
                epochs: args.teacher_epochs,
                batch: 64,
                lr: 0.05,
                momentum: 0.9,
                seed: 7,
                device: args.device,
            };
            let bar = ProgressBar::new(t.epochs);
            bar.set_style(ProgressStyle::with_template("teacher   [{bar:30}] epoch {pos}/{len} {msg}")?);
            let (path, model, trained) =
                teacher_model(&root.join("teachers"), &args.dataset, train, &t, |e, l| {
                    bar.set_position(e + 1);
                    bar.set_message(format!("loss {l:.4}"));
                })?;
            bar.finish_and_clear();
            let acc = model.accuracy(test) as f64;
            teacher_accuracy = Some(acc);
            println!(
                "teacher   {:?} {} ({}), test accuracy {:.2}%",
                t.layers,
                if trained { "trained now" } else { "from the cache" },
                path.display(),
                acc * 100.0
            );
            let store_for_teachers =
                if args.store == "memory" { "memory".to_string() } else { args.store.clone() };
            for i in 0..args.teachers {
                let log = log_dir.join(format!("teacher-{i}.log"));
                let at = (args.listen.ip(), advertised.as_str());
                let p = TeacherProcess::start(&exe, &path, at, &store_for_teachers, &service, &log)?;
                println!("teacher   {i} serving on {}", p.addr);
                teacher_procs.lock().unwrap_or_else(|e| e.into_inner()).push(p);
            }
        }
        spec.teachers = Some(if args.store == "memory" {
            let procs = teacher_procs.lock().unwrap_or_else(|e| e.into_inner());
            if procs.is_empty() {
                bail!(
                    "no teachers: give --teachers N, or --store redis://... where teachers are registered, or --no-distill"
                );
            }
            TeacherSource::Fixed(procs.iter().map(|p| p.addr.clone()).collect())
        } else {
            TeacherSource::Discovered { store: args.store.clone(), service }
        });
    }

    cfg.spec = spec.clone();
    if !teacher_procs.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
        cfg.teacher_watch = Some(Box::new(teacher_procs.clone()));
    }
    let total = args.epochs * student_rows as u64;
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("[{elapsed_precise}] [{bar:30}] {percent:>3}% {msg}")?
            .progress_chars("=> "),
    );
    let scaler = scaler(&args, &exe, &log_dir, launch.as_ref().map(|l| &l.command[..]))?;
    let epochs = args.epochs;
    let mut progress = |p: Progress| match p {
        Progress::Step(s) => {
            bar.set_position((s.epoch * student_rows as u64 + s.cursor as u64).min(total));
            bar.set_message(format!(
                "epoch {}/{} step {} | {} workers | {:.0} samples/s | loss {:.4}",
                (s.epoch + 1).min(epochs),
                epochs,
                s.step,
                s.world,
                s.samples_per_sec,
                s.loss
            ));
        }
        Progress::Scale(e) => say(
            &bar,
            format!(
                "scale     step {:>5}: {} -> {} workers (generation {}), paused {:.0} ms{}: {}",
                e.step,
                e.from,
                e.to,
                e.generation,
                e.pause_ms,
                e.join_ms
                    .map(|j| format!(", new worker ready {j:.0} ms after the decision"))
                    .unwrap_or_default(),
                e.reason
            ),
        ),
        Progress::Epoch(r) => say(
            &bar,
            format!(
                "epoch     {} done: {} samples committed, {} duplicates, {} missing",
                r.epoch, r.samples_committed, r.duplicates, r.missing
            ),
        ),
        Progress::Checkpoint { step, path } => {
            tracing::debug!("checkpoint at step {step}: {}", path.display())
        }
        Progress::Note(n) => say(&bar, format!("note      {n}")),
    };
    let outcome = match job::coordinator::run(cfg, lock, policy, adapter, scaler, &mut progress) {
        Ok(o) => o,
        Err(e) => {
            bar.finish_and_clear();
            if let Some(out) = &args.report {
                // A failed job still says what happened, for whoever reads the reports.
                let failed = serde_json::json!({
                    "job": args.job,
                    "status": "failed",
                    "error": format!("{e:#}"),
                    "checkpoint_dir": checkpoint_dir,
                });
                if let Err(w) = std::fs::write(out, serde_json::to_vec_pretty(&failed)?) {
                    eprintln!("could not write the report {}: {w}", out.display());
                }
            }
            return Err(e);
        }
    };
    bar.finish_and_clear();
    drop(teacher_procs);

    let student_accuracy = match &builtin {
        Some((_, _, test)) => {
            let store = Checkpoints::open(&spec.checkpoint_dir, 1)?;
            let restored = mlp_of(&store.read_at(&outcome.final_checkpoint)?)?;
            Some(restored.accuracy(test) as f64)
        }
        None => None,
    };
    let report = Report::new(
        &args.job,
        outcome,
        student_accuracy,
        teacher_accuracy,
        !no_distill,
        policy_name,
        adapter_name,
        &edl_runtime::store::redact(&args.store),
        args.device.to_string(),
        args.seed,
    );
    println!(
        "done      {} steps in {:.1} s, {:.0} samples/s, final world size {}",
        report.steps, report.train_secs, report.samples_per_sec, report.final_world_size
    );
    if let Some(step) = report.resumed_from_step {
        println!("          resumed from the checkpoint at step {step}");
    }
    if let Some(acc) = report.student_test_accuracy {
        println!(
            "          student test accuracy {:.2}%{}",
            acc * 100.0,
            report
                .teacher_test_accuracy
                .map(|t| format!(" (teacher {:.2}%)", t * 100.0))
                .unwrap_or_else(|| if report.distill { String::new() } else { " (no distillation)".into() })
        );
    }
    let resizes = report.scale_events.iter().filter(|e| e.from > 0).count();
    println!(
        "          {resizes} resizes, median pause {}; generations {}..{}",
        report.rescale_pause_ms_median.map(|p| format!("{p:.0} ms")).unwrap_or_else(|| "-".into()),
        report.generations.0,
        report.generations.1
    );
    let bad: u64 = report.epochs.iter().map(|e| e.duplicates + e.missing).sum();
    println!(
        "          {} epochs, every sample exactly once: {}",
        report.epochs.len(),
        if bad == 0 { "yes".to_string() } else { format!("NO ({bad} samples off)") }
    );
    println!("          checkpoints in {} (final: {})", checkpoint_dir.display(), report.final_checkpoint);
    if let Some(out) = &args.report {
        std::fs::write(out, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("{}", out.display()))?;
        println!("          report written to {}", out.display());
    }
    if let Some(out) = &args.plot {
        let title = format!("{} with {}", args.job, report.policy);
        plot::training_run(out, &title, &report.timeline, &report.scale_events)?;
        println!("          plot written to {}", out.display());
    }
    job::coordinator::mark_complete(&spec.checkpoint_dir, &report.epochs)?;
    Ok(if bad == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `launch --torchrun`: an unmodified torchrun script, restarted as a group.
pub struct Torchrun {
    pub command: Vec<String>,
    pub max_restarts: u32,
    pub decide_every: Duration,
    pub grace: Duration,
}

pub fn torchrun(host: &Arc<PluginHost>, args: RunArgs, t: Torchrun) -> Result<ExitCode> {
    if args.scaler != ScalerKind::Local {
        bail!(
            "--torchrun runs its group on this host: --scaler {:?} is for jobs without --torchrun",
            args.scaler
        );
    }
    let (mut policy, policy_name) = load_policy(host, &args.plugins)?;
    let job_name = launched_job_name(&args.job);
    let job_dir = PathBuf::from(".edl").join(&job_name);
    let lock_dir = std::path::absolute(job_dir.join("checkpoints"))?;
    let _lock = job::JobLock::acquire(&lock_dir, &job_name)?;
    let mut cfg = TorchrunConfig::new(&job_name, t.command, job_dir.join("logs"));
    cfg.min_workers = args.min_workers;
    cfg.max_workers = args.max_workers;
    cfg.initial_workers = args.workers.unwrap_or(args.min_workers);
    cfg.max_restarts = t.max_restarts;
    cfg.decide_every = t.decide_every;
    cfg.grace = t.grace;
    cfg.price_per_worker_hour = args.price;
    if cfg.min_workers == 0 || cfg.min_workers > cfg.max_workers {
        bail!(
            "--min-workers {} and --max-workers {}: expected 1 <= min <= max",
            cfg.min_workers,
            cfg.max_workers
        );
    }
    println!(
        "job {job_name:?}: torchrun script {:?}, {}..{} ranks on this host, up to {} restarts",
        cfg.command.join(" "),
        cfg.min_workers,
        cfg.max_workers,
        cfg.max_restarts
    );
    println!(
        "policy    {policy_name} ({}, {}), deciding every {:.1} s",
        args.plugins.policy.display(),
        policy.backend(),
        cfg.decide_every.as_secs_f64()
    );
    let outcome = torchrun::run(&cfg, policy.as_mut(), &mut |e| match e {
        TorchrunEvent::Started(g) => println!(
            "group     {}: {} ranks, restart {}/{}, master {}:{}, logs {}",
            g.group,
            g.world,
            g.restart_count,
            cfg.max_restarts,
            cfg.master_addr,
            g.master_port,
            g.log_dir.display()
        ),
        TorchrunEvent::Output { rank, line } => println!("[rank{rank}]: {line}"),
        TorchrunEvent::Restarting { reason, failure: true } => println!("restart   {reason}"),
        TorchrunEvent::Restarting { reason, failure: false } => println!("scale     {reason}"),
        TorchrunEvent::PolicyFailed(n) => println!("note      {n}"),
    })?;
    let resizes = outcome.groups.iter().filter(|g| g.ended.starts_with("resized")).count();
    if let Some(out) = &args.report {
        let report = serde_json::json!({
            "job": job_name,
            "mode": "torchrun",
            "status": if outcome.failure.is_none() { "succeeded" } else { "failed" },
            "policy": policy_name,
            "resizes": resizes,
            "outcome": outcome,
        });
        std::fs::write(out, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("{}", out.display()))?;
    }
    if let Some(out) = &args.plot {
        let title = format!("{job_name} (torchrun) with {policy_name}");
        plot::policy_run(out, &title, &outcome.decisions, false)?;
    }
    match outcome.failure {
        None => {
            println!(
                "done      every rank succeeded in {:.1} s: {} groups, {resizes} resizes, {} restarts",
                outcome.secs,
                outcome.groups.len(),
                outcome.restarts
            );
            Ok(ExitCode::SUCCESS)
        }
        Some(f) => {
            eprintln!("error: {f}");
            eprintln!("       no restart left ({} of {} used)", outcome.restarts, outcome.max_restarts);
            Ok(ExitCode::from(f.exit.launcher_code()))
        }
    }
}
