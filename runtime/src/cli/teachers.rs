//! The teachers of a job of steps: the endpoints it is given, teacher
//! processes it starts serving a wider model it trains here (or takes from
//! the cache), or those registered in its store.

use super::{
    flags::TeachersArg,
    plugin_path,
    workload::{JobArgs, Prepared, StudentArgs, sizes},
};
use anyhow::{Context, Result, bail};
use edl_runtime::plugin::PluginHost;
use edl_runtime::{
    job::{
        JobDirs, PoolStart, TeacherSource, TeacherStart,
        teacher_pool::{TeacherTraining, teacher_model},
    },
    trainer::data::Dataset,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

/// Where the job's students get soft labels: the endpoints given, those
/// registered in the store, and teacher processes the job starts serving a
/// teacher trained here (or cached).
pub(super) struct TeacherPlan {
    /// What workers are told (None: the teachers the job starts, in a job
    /// without a shared store, or no teachers at all).
    pub(super) source: Option<TeacherSource>,
    /// Teacher processes the job starts.
    pub(super) start: Option<TeacherStart>,
    /// What sizes them, for the job's header (a pool's policy).
    pub(super) pool_line: Option<String>,
}

impl TeacherPlan {
    pub(super) fn new(
        host: &Arc<PluginHost>,
        args: &JobArgs,
        name: &str,
        work: &Prepared,
        distill: bool,
        dirs: &JobDirs,
    ) -> Result<Self> {
        let d = &args.distillation;
        let mut plan = TeacherPlan { source: None, start: None, pool_line: None };
        if let Prepared::Builtin { student, .. } = work
            && student.pool.teacher_command.is_some()
            && (!distill || matches!(d.teachers, Some(TeachersArg::Endpoints(_))))
        {
            bail!(
                "--teacher-command starts the job's own teachers; {}",
                if distill {
                    "--teachers host:port,... names others"
                } else {
                    "with --no-distill there are none"
                }
            );
        }
        if let Prepared::Builtin { student, .. } = work
            && student.pool.max_teachers.is_some()
        {
            if !distill {
                bail!("--max-teachers sizes the job's teachers; with --no-distill there are none");
            }
            if matches!(d.teachers, Some(TeachersArg::Endpoints(_))) {
                bail!(
                    "--max-teachers sizes the teachers the job starts; --teachers host:port,... names others"
                );
            }
        }
        // A launched program may ask the teachers it is given, even with --no-distill.
        if let Some(TeachersArg::Endpoints(list)) = &d.teachers
            && (distill || matches!(work, Prepared::Program { .. }))
        {
            plan.source = Some(TeacherSource::Fixed(list.clone()));
            return Ok(plan);
        }
        if !distill {
            return Ok(plan);
        }
        let store = &args.state.store;
        let service = d.service.clone().unwrap_or_else(|| format!("{name}-teachers"));
        if let Prepared::Builtin { student, train, test, .. } = work {
            let count = match d.teachers {
                Some(TeachersArg::Count(n)) => n,
                _ => student.teacher_processes,
            };
            let pool = teacher_pool(host, student, args, store)?;
            plan.pool_line = pool.as_ref().map(|(_, line)| line.clone());
            let pool = pool.map(|(p, _)| p);
            let count = match &pool {
                Some(p) => count.clamp(p.min, p.max),
                None => count,
            };
            if count > 0 {
                let training = teacher_training(student, train)?;
                let dataset = student.dataset.clone();
                let (train, test, root) = (train.clone(), test.clone(), dirs.root.clone());
                plan.start = Some(TeacherStart {
                    count,
                    model: Box::new(move || {
                        let (path, accuracy) = train_teacher(&training, &dataset, &train, &test, &root)?;
                        Ok((path, Some(accuracy)))
                    }),
                    exe: std::env::current_exe().context("locating edl-runtime")?,
                    service: service.clone(),
                    token_file: d.teacher_access.teacher_token_file.clone(),
                    emulate_row_us: student.pool.teacher_emulate_row_us,
                    command: student.pool.command(),
                    pool,
                });
            }
        }
        if store != "memory" {
            plan.source = Some(TeacherSource::Discovered { store: store.clone(), service });
        } else if plan.start.is_none() {
            bail!(
                "no teachers: give --teacher-processes N, --teachers host:port,..., or --store redis://... \
                 where teachers are registered, or --no-distill"
            );
        }
        Ok(plan)
    }
}

/// The pool that sizes the job's teachers, when `--max-teachers` asks for one.
fn teacher_pool(
    host: &Arc<PluginHost>,
    student: &StudentArgs,
    args: &JobArgs,
    store: &str,
) -> Result<Option<(PoolStart, String)>> {
    let p = &student.pool;
    let Some(max) = p.max_teachers else { return Ok(None) };
    if p.min_teachers == 0 || max < p.min_teachers {
        bail!("--min-teachers {} --max-teachers {max}: the pool needs 1 <= min <= max", p.min_teachers);
    }
    if store == "memory" {
        bail!(
            "--max-teachers needs a shared --store (redis://..., etcd://...): students find the pool's \
             teachers there as they come and go"
        );
    }
    let every = super::flags::secs(p.teacher_decide_secs, "teacher-decide-secs")?;
    if every.is_zero() {
        bail!("--teacher-decide-secs must be above 0");
    }
    let path = plugin_path::resolve("--teacher-policy", &p.teacher_policy)?;
    let policy = host
        .load_teacher_policy(&path, &p.teacher_policy_config)
        .with_context(|| format!("--teacher-policy {}", p.teacher_policy.display()))?;
    let info = policy.info();
    let line = format!(
        "teachers  a pool of {}..{max}, sized by {} {} ({}, {}) every {every:?}",
        p.min_teachers,
        info.name,
        info.version,
        path.display(),
        policy.backend()
    );
    let start = PoolStart {
        policy: Box::new(policy),
        min: p.min_teachers,
        max,
        every,
        price_per_teacher_hour: p.price_per_teacher_hour,
        in_flight: args.distillation.teacher_calls.teacher_in_flight.min(64) as u32,
    };
    Ok(Some((start, line)))
}

/// How the built-in student's teacher is trained: a wider model on hard labels.
fn teacher_training(student: &StudentArgs, train: &Dataset) -> Result<TeacherTraining> {
    Ok(TeacherTraining {
        layers: std::iter::once(train.dim)
            .chain(sizes(&student.teacher_hidden, "teacher-hidden")?)
            .chain([train.classes])
            .collect(),
        epochs: student.teacher_epochs,
        batch: 64,
        lr: 0.05,
        momentum: 0.9,
        seed: 7,
        device: student.device,
    })
}

/// The built-in student's teacher, trained (or taken from the cache).
/// Returns its file and its test accuracy.
fn train_teacher(
    t: &TeacherTraining,
    dataset: &str,
    train: &Dataset,
    test: &Dataset,
    root: &Path,
) -> Result<(PathBuf, f64)> {
    let bar = ProgressBar::new(t.epochs);
    bar.set_style(ProgressStyle::with_template("teacher   [{bar:30}] epoch {pos}/{len} {msg}")?);
    let (path, model, trained) = teacher_model(&root.join("teachers"), dataset, train, t, |e, l| {
        bar.set_position(e + 1);
        bar.set_message(format!("loss {l:.4}"));
    })?;
    bar.finish_and_clear();
    let acc = model.accuracy(test) as f64;
    println!(
        "teacher   {:?} {} ({}), test accuracy {:.2}%",
        t.layers,
        if trained { "trained now" } else { "from the cache" },
        path.display(),
        acc * 100.0
    );
    Ok((path, acc))
}
