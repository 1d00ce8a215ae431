//! The end of a job of steps: the closing summary, the report and the plot.

use super::flags::OutputArgs;
use anyhow::{Context, Result};
use edl_runtime::{
    coordinator::{self, report::Report},
    plot,
};
use std::{path::Path, process::ExitCode};

/// A job that ended unfinished: its report and plot of what it did until
/// then, and its end (a stop by a signal exits with the signal's status, a
/// failure with its error).
pub(super) fn unfinished(
    u: coordinator::Unfinished,
    output: &OutputArgs,
    name: &str,
    checkpoint_dir: &Path,
    report_of: impl FnOnce(coordinator::JobOutcome) -> Report,
) -> Result<ExitCode> {
    let so_far = u.so_far.map(|o| report_of(*o));
    write_failed_report(output, name, &u.error, checkpoint_dir, so_far.as_ref());
    let Some(stop) = u.error.downcast_ref::<edl_runtime::process::StopSignalled>() else {
        return Err(u.error);
    };
    eprintln!("{}", u.error);
    Ok(ExitCode::from(stop.exit_code()))
}

/// Refuses a `--report` or `--plot` that could not be written at the
/// job's end (a directory that is missing or not writable, a directory in
/// the file's place), before the job trains.
pub(super) fn check_outputs(output: &OutputArgs) -> Result<()> {
    let asked = [("--report", &output.report), ("--plot", &output.plot)];
    for (flag, path) in asked.into_iter().filter_map(|(f, p)| p.as_ref().map(|p| (f, p))) {
        if path.is_dir() {
            anyhow::bail!("{flag} {}: a directory, not a file", path.display());
        }
        if path.exists() {
            continue;
        }
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            anyhow::bail!("{flag} {}: there is no directory {}", path.display(), dir.display());
        }
        tempfile::Builder::new()
            .prefix(".edl-")
            .tempfile_in(dir)
            .with_context(|| format!("{flag} {}: cannot write in {}", path.display(), dir.display()))?;
    }
    Ok(())
}

/// A job found finished before: said, with the report and plot asked for
/// that are not written (nothing ran to write them from), and `--epochs`
/// (`epochs`) where it asks for other than the finished run trained.
pub(super) fn already_finished(
    done: &coordinator::AlreadyFinished,
    output: &OutputArgs,
    epochs: Option<u64>,
) -> ExitCode {
    println!("done      {done}");
    if let (Some(trained), Some(asked)) = (done.epochs, epochs)
        && trained != asked
    {
        println!(
            "note      it trained its {trained} epochs; a finished job is not trained on to --epochs {asked} \
             (--restart trains it again from step 0 with them)"
        );
    }
    let asked: Vec<String> =
        [&output.report, &output.plot].into_iter().flatten().map(|p| p.display().to_string()).collect();
    if !asked.is_empty() {
        println!(
            "note      nothing was trained, so {} not written; the finished run's are where it wrote them",
            asked.join(" and ") + if asked.len() == 1 { " is" } else { " are" }
        );
    }
    ExitCode::SUCCESS
}

/// What a coordinator whose loop stalled leaves before the process ends
/// (its error is printed by then): a report, where one is asked for, that
/// says the job failed and why (what it did until then is held by the loop
/// that stalled).
pub(super) fn on_stall(
    output: &OutputArgs,
    name: &str,
    checkpoint_dir: &Path,
) -> coordinator::watchdog::OnStall {
    let output = OutputArgs { report: output.report.clone(), plot: None };
    let (name, dir) = (name.to_string(), checkpoint_dir.to_path_buf());
    Box::new(move |e| write_failed_report(&output, &name, &e, &dir, None))
}

/// A failed job still says what happened, for whoever reads the reports:
/// why it ended and, when it had begun, what it did until then (`so_far`:
/// its steps, scale events and epochs, its plugins' decisions to replay),
/// drawn too where a plot is asked for.
fn write_failed_report(
    output: &OutputArgs,
    name: &str,
    e: &anyhow::Error,
    checkpoint_dir: &Path,
    so_far: Option<&Report>,
) {
    let stopped = e.is::<edl_runtime::process::StopSignalled>();
    if let Some(out) = &output.report {
        let mut failed = serde_json::json!({
            "job": name,
            "status": if stopped { "stopped" } else { "failed" },
            "error": format!("{e:#}"),
            "checkpoint_dir": checkpoint_dir,
        });
        if let (Some(serde_json::Value::Object(fields)), Some(all)) =
            (so_far.map(serde_json::to_value).and_then(|v| v.ok()), failed.as_object_mut())
        {
            for (k, v) in fields {
                all.entry(k).or_insert(v);
            }
            // It has no final checkpoint: the newest is in `checkpoints`.
            all.remove("final_checkpoint");
        }
        let written = serde_json::to_vec_pretty(&failed)
            .map_err(anyhow::Error::from)
            .and_then(|bytes| replace_file(out, &bytes));
        if let Err(w) = written {
            eprintln!("could not write the report {}: {w}", out.display());
        }
    }
    if let (Some(out), Some(r)) = (&output.plot, so_far.filter(|r| !r.timeline.is_empty())) {
        let title = format!("{} with {} ({})", r.job, r.policy, if stopped { "stopped" } else { "failed" });
        if let Err(w) = plot::training_run(out, &title, &r.timeline, &r.scale_events, &r.teacher_events) {
            eprintln!("could not draw the plot {}: {w}", out.display());
        }
    }
}

/// Prints the closing summary, writes the report and the plot, and marks
/// the job complete. Fails the command if any epoch's accounting is off.
pub(super) fn summarize(
    report: &Report,
    output: &OutputArgs,
    checkpoint_dir: &Path,
    spec_checkpoint_dir: &Path,
) -> Result<ExitCode> {
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
    if let (Some(auc), Some(loss)) = (report.student_test_auc, report.student_test_log_loss) {
        println!("          test AUC {auc:.4}, log loss {loss:.4}");
    }
    let resizes = report.scale_events.iter().filter(|e| e.from > 0).count();
    println!(
        "          {resizes} resizes, median pause {}; generations {}..{}",
        report.rescale_pause_ms_median.map(|p| format!("{p:.0} ms")).unwrap_or_else(|| "-".into()),
        report.generations.0,
        report.generations.1
    );
    if let (Some(first), Some(last)) = (report.teacher_events.first(), report.teacher_events.last()) {
        let n = report.teacher_events.len();
        let most = report.teacher_events.iter().map(|e| e.to).max().unwrap_or(last.to).max(first.from);
        println!(
            "          teacher pool: {} -> {} teachers in {n} change{} (at most {most})",
            first.from,
            last.to,
            if n == 1 { "" } else { "s" }
        );
    }
    let bad: u64 = report.epochs.iter().map(|e| e.duplicates + e.missing).sum();
    println!(
        "          {} epochs, every sample exactly once: {}",
        report.epochs.len(),
        if bad == 0 { "yes".to_string() } else { format!("NO ({bad} samples off)") }
    );
    println!("          checkpoints in {} (final: {})", checkpoint_dir.display(), report.final_checkpoint);
    if let Some(out) = &output.report {
        replace_file(out, &serde_json::to_vec_pretty(report)?)?;
        println!("          report written to {}", out.display());
    }
    if let Some(out) = &output.plot {
        let title = format!("{} with {}", report.job, report.policy);
        plot::training_run(out, &title, &report.timeline, &report.scale_events, &report.teacher_events)?;
        println!("          plot written to {}", out.display());
    }
    coordinator::mark_complete(spec_checkpoint_dir, &report.epochs)?;
    Ok(if bad == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Writes `bytes` to `path` whole: into a temporary file beside it, forced
/// to disk, then renamed over it, so that a crash or a full disk leaves the
/// file as it was (a report of an earlier run) or as written, never cut off.
/// A link is written through (to the file it names), an existing file keeps
/// its permissions, and what is not a plain file (`/dev/stdout`), or a file
/// in a directory this process cannot create files in or rename over
/// (another user's in a sticky directory), is written in place.
pub(crate) fn replace_file(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::{io::Write, os::unix::fs::PermissionsExt};
    let target = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
        }
        _ => path.to_path_buf(),
    };
    let mode = match std::fs::metadata(&target) {
        Ok(m) if !m.is_file() => {
            return std::fs::write(&target, bytes).with_context(|| path.display().to_string());
        }
        Ok(m) => m.permissions(),
        // Readable as a file written plainly would be (within the umask's
        // bounds), not only by its owner as a temporary file is made.
        Err(_) => std::fs::Permissions::from_mode(0o644),
    };
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    let tmp = match tempfile::Builder::new().prefix(".edl-").permissions(mode).tempfile_in(dir) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return std::fs::write(&target, bytes).with_context(|| path.display().to_string());
        }
        Err(e) => return Err(anyhow::Error::from(e).context(path.display().to_string())),
    };
    let write = |mut tmp: tempfile::NamedTempFile| -> std::io::Result<()> {
        tmp.write_all(bytes)?;
        tmp.as_file().sync_all()?;
        match tmp.persist(&target) {
            Ok(_) => Ok(()),
            // Not ours to rename over (a sticky directory): written in place.
            Err(e) if e.error.kind() == std::io::ErrorKind::PermissionDenied => {
                std::fs::write(&target, bytes)
            }
            Err(e) => Err(e.error),
        }
    };
    write(tmp).with_context(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report written over an earlier one replaces it whole and leaves no
    /// temporary file beside it; one that cannot be written says where and
    /// leaves the earlier one as it was.
    #[test]
    fn a_report_replaces_the_earlier_one_whole_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("report.json");
        std::fs::write(&out, b"{\"earlier\": true, \"padding\": \"a longer earlier report\"}").unwrap();
        replace_file(&out, b"{}").unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"{}");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["report.json"], "nothing left beside it");
        // Through a link, to the file it names; and to what is not a file.
        let link = dir.path().join("latest.json");
        std::os::unix::fs::symlink(&out, &link).unwrap();
        replace_file(&link, b"[1]").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "still a link");
        assert_eq!(std::fs::read(&out).unwrap(), b"[1]");
        replace_file(std::path::Path::new("/dev/null"), b"{}").unwrap();
        std::fs::remove_file(&link).unwrap();
        replace_file(&out, b"{}").unwrap();
        let nowhere = dir.path().join("missing").join("report.json");
        let e = format!("{:#}", replace_file(&nowhere, b"{}").unwrap_err());
        assert!(e.contains("missing/report.json"), "{e}");
        assert_eq!(std::fs::read(&out).unwrap(), b"{}");
    }
}
