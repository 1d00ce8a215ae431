//! The teachers of a job of steps: the endpoints it is given, teacher
//! processes it starts serving a wider model it trains here (or takes from
//! the cache), or those registered in its store.

use super::{
    flags::{DistillationArgs, TeachersArg},
    plugin_path,
    workload::{JobArgs, Prepared, StudentArgs, TeacherPoolArgs, sizes},
};
use anyhow::{Context, Result};
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
    /// A line of the job's header on them (a pool's policy, teachers in
    /// the students' processes).
    pub(super) pool_line: Option<String>,
    /// The test accuracy of the teacher trained here, when it is computed
    /// in the students' processes (teachers the job starts tell theirs).
    pub(super) accuracy: Option<f64>,
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
        let mut plan = TeacherPlan { source: None, start: None, pool_line: None, accuracy: None };
        refuse_pool_flags(work, d, distill)?;
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
        let p = TeacherPoolArgs::of(work);
        if let Prepared::Builtin { student, .. } = work
            && student.teacher_in_process
        {
            let (model, accuracy) = teacher_model_of(work, dirs)?()?;
            let emulated = match p.teacher_emulate_row_us {
                0 => String::new(),
                us => format!(", emulating {us} us a row"),
            };
            plan.pool_line =
                Some(format!("teachers  computed in each student's process, on its step's path{emulated}"));
            plan.accuracy = accuracy;
            plan.source = Some(TeacherSource::InProcess { model, emulate_row_us: p.teacher_emulate_row_us });
            return Ok(plan);
        }
        let store = &args.state.store;
        let service = d.service.clone().unwrap_or_else(|| format!("{name}-teachers"));
        let pool = teacher_pool(host, p, args, store)?;
        plan.pool_line = pool.as_ref().map(|(_, line)| line.clone());
        let pool = pool.map(|(p, _)| p);
        let count = match (d.teachers.as_ref(), work) {
            (Some(TeachersArg::Count(n)), _) => *n,
            (_, Prepared::Builtin { student, .. }) => student.teacher_processes,
            // A launched program's teachers, by command: one unless told.
            (_, Prepared::Program { .. }) => {
                u32::from(p.teacher_command.is_some() || p.teacher_kube_image.is_some())
            }
        };
        let count = pool.as_ref().map_or(count, |pool| count.clamp(pool.min, pool.max));
        if count > 0 {
            let model = teacher_model_of(work, dirs)?;
            plan.start = Some(TeacherStart {
                count,
                model,
                exe: std::env::current_exe().context("locating edl-runtime")?,
                service: service.clone(),
                token_file: d.teacher_access.teacher_token_file.clone(),
                emulate_row_us: p.teacher_emulate_row_us,
                command: p.command(),
                kube: p.kube(&args.cluster.kube.options()),
                pool,
            });
        }
        if store != "memory" {
            plan.source = Some(TeacherSource::Discovered { store: store.clone(), service });
        } else if plan.start.is_none() {
            edl_runtime::refuse!(
                "no teachers: give --teacher-processes N, --teachers host:port,..., or --store redis://... \
                 where teachers are registered, or --no-distill"
            );
        }
        Ok(plan)
    }
}

/// Refuses pool and command flags where there is nothing for them to start.
fn refuse_pool_flags(work: &Prepared, d: &DistillationArgs, distill: bool) -> Result<()> {
    let p = TeacherPoolArgs::of(work);
    let named = matches!(d.teachers, Some(TeachersArg::Endpoints(_)));
    if let Prepared::Program { .. } = work {
        if (p.max_teachers.is_some() || matches!(d.teachers, Some(TeachersArg::Count(_))))
            && p.teacher_command.is_none()
            && p.teacher_kube_image.is_none()
        {
            edl_runtime::refuse!(
                "a launched program's teachers are started by --teacher-command or --teacher-kube-image (the \
                 job has no model of its own to serve them); or give --teachers host:port,..."
            );
        }
        if p.teacher_command.as_deref().is_some_and(|c| c.contains("{model}")) {
            edl_runtime::refuse!(
                "--teacher-command: {{model}} is the built-in job's teacher model; a launched program's \
                 teachers serve models of their own (name the file in the command)"
            );
        }
    }
    if (p.teacher_command.is_some() || p.teacher_kube_image.is_some()) && (!distill || named) {
        let flag = if p.teacher_command.is_some() { "--teacher-command" } else { "--teacher-kube-image" };
        edl_runtime::refuse!(
            "{flag} starts the job's own teachers; {}",
            if distill {
                "--teachers host:port,... names others"
            } else {
                "with --no-distill there are none"
            }
        );
    }
    if p.max_teachers.is_some() {
        if !distill {
            edl_runtime::refuse!("--max-teachers sizes the job's teachers; with --no-distill there are none");
        }
        if named {
            edl_runtime::refuse!(
                "--max-teachers sizes the teachers the job starts; --teachers host:port,... names others"
            );
        }
    }
    Ok(())
}

/// The model the job's own teachers serve: the built-in student's teacher,
/// trained here (or cached); none for a launched program's (its command
/// names its model).
fn teacher_model_of(work: &Prepared, dirs: &JobDirs) -> Result<edl_runtime::job::assembly::TeacherModel> {
    match work {
        Prepared::Builtin { student, train, test, .. } => {
            let training = teacher_training(student, train)?;
            let dataset = student.dataset.clone();
            let (train, test, root) = (train.clone(), test.clone(), dirs.root.clone());
            Ok(Box::new(move || {
                let (path, accuracy) = train_teacher(&training, &dataset, &train, &test, &root)?;
                Ok((path, Some(accuracy)))
            }))
        }
        Prepared::Program { .. } => Ok(Box::new(|| Ok((PathBuf::new(), None)))),
    }
}

/// The pool that sizes the job's teachers, when `--max-teachers` asks for one.
fn teacher_pool(
    host: &Arc<PluginHost>,
    p: &TeacherPoolArgs,
    args: &JobArgs,
    store: &str,
) -> Result<Option<(PoolStart, String)>> {
    let Some(max) = p.max_teachers else { return Ok(None) };
    if p.min_teachers == 0 || max < p.min_teachers {
        edl_runtime::refuse!(
            "--min-teachers {} --max-teachers {max}: the pool needs 1 <= min <= max",
            p.min_teachers
        );
    }
    if store == "memory" {
        edl_runtime::refuse!(
            "--max-teachers needs a shared --store (redis://..., etcd://...): students find the pool's \
             teachers there as they come and go"
        );
    }
    let every = super::flags::secs(p.teacher_decide_secs, "teacher-decide-secs")?;
    if every.is_zero() {
        edl_runtime::refuse!("--teacher-decide-secs must be above 0");
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
