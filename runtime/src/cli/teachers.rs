//! The teachers of a job of steps: the endpoints it is given, teacher
//! processes it starts serving a wider model it trains here (or takes from
//! the cache), or those registered in its store.

use super::{
    flags::TeachersArg,
    workload::{JobArgs, JobDirs, Prepared, StudentArgs, sizes},
};
use anyhow::{Result, bail};
use edl_runtime::{
    job::{
        TeacherSource,
        teacher_pool::{TeacherGuard, TeacherProcess, TeacherTls, TeacherTraining, teacher_model},
    },
    trainer::data::Dataset,
};
use indicatif::{ProgressBar, ProgressStyle};
use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

/// The job's teachers: the endpoints given, processes started here
/// serving a teacher trained here (or cached), or those registered in the store.
pub(super) struct Teachers {
    pub(super) source: Option<TeacherSource>,
    /// The certificate (PEM) of the teachers started here, when they serve
    /// TLS: students trust it beside any --teacher-ca.
    pub(super) ca_pem: Option<String>,
    /// The teacher's test accuracy, when it was trained (or cached) here.
    pub(super) accuracy: Option<f64>,
    /// The teacher processes this job started; they stop when dropped.
    pub(super) processes: Arc<Mutex<Vec<TeacherProcess>>>,
}

impl Teachers {
    pub(super) fn start(
        args: &JobArgs,
        name: &str,
        work: &Prepared,
        distill: bool,
        dirs: &JobDirs,
        (advertised, exe): (&str, &Path),
    ) -> Result<Teachers> {
        let d = &args.distillation;
        let mut out = Teachers { source: None, ca_pem: None, accuracy: None, processes: Default::default() };
        // A launched program may ask the teachers it is given, even with --no-distill.
        if let Some(TeachersArg::Endpoints(list)) = &d.teachers
            && (distill || matches!(work, Prepared::Program { .. }))
        {
            out.source = Some(TeacherSource::Fixed(list.clone()));
            return Ok(out);
        }
        if !distill {
            return Ok(out);
        }
        let store = &args.state.store;
        let service = d.service.clone().unwrap_or_else(|| format!("{name}-teachers"));
        if let Prepared::Builtin { student, train, test, .. } = work {
            let count = match d.teachers {
                Some(TeachersArg::Count(n)) => n,
                _ => student.teacher_processes,
            };
            if count > 0 {
                let (path, accuracy) = train_teacher(student, train, test, &dirs.root)?;
                out.accuracy = Some(accuracy);
                // The job's token, and TLS wherever the token is or the
                // teachers are reached from other hosts.
                let token_file = d.teacher_access.teacher_token_file.clone();
                let listen = args.cluster.listen.ip();
                let tls = if token_file.is_some() || !listen.is_loopback() {
                    let tls = TeacherTls::make(&dirs.job_dir.join("teacher-tls"), advertised)?;
                    out.ca_pem = Some(tls.pem.clone());
                    Some(tls)
                } else {
                    None
                };
                let guard = TeacherGuard { token_file, tls };
                let mut procs = out.processes.lock().unwrap_or_else(|e| e.into_inner());
                for i in 0..count {
                    let log = dirs.log_dir.join(format!("teacher-{i}.log"));
                    let at = (listen, advertised);
                    let p = TeacherProcess::start(exe, &path, at, (store, &service), &guard, &log)?;
                    println!("teacher   {i} serving on {}", p.addr);
                    procs.push(p);
                }
            }
        }
        out.source = Some(if store == "memory" {
            let procs = out.processes.lock().unwrap_or_else(|e| e.into_inner());
            if procs.is_empty() {
                bail!(
                    "no teachers: give --teacher-processes N, --teachers host:port,..., or --store redis://... \
                     where teachers are registered, or --no-distill"
                );
            }
            TeacherSource::Fixed(procs.iter().map(|p| p.addr.clone()).collect())
        } else {
            TeacherSource::Discovered { store: store.clone(), service }
        });
        Ok(out)
    }
}

/// The built-in student's teacher: a wider model trained on hard labels
/// (or taken from the cache). Returns its file and its test accuracy.
fn train_teacher(
    student: &StudentArgs,
    train: &Dataset,
    test: &Dataset,
    root: &Path,
) -> Result<(PathBuf, f64)> {
    let t = TeacherTraining {
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
    };
    let bar = ProgressBar::new(t.epochs);
    bar.set_style(ProgressStyle::with_template("teacher   [{bar:30}] epoch {pos}/{len} {msg}")?);
    let (path, model, trained) =
        teacher_model(&root.join("teachers"), &student.dataset, train, &t, |e, l| {
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
