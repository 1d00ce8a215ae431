//! What the main job shows while it runs: a progress bar on a terminal,
//! plain lines where output goes to a file, a pipe or a log collector
//! (Kubernetes, CI, `| tee`), which cannot show a bar.

use edl_runtime::coordinator::Progress;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::Write;
use std::time::{Duration, Instant};

/// Longest time between two plain progress lines.
pub const PLAIN_EVERY: Duration = Duration::from_secs(5);

/// The job's progress: a bar redrawn at every step, or, without a terminal
/// on stderr (where the bar would be drawn), a line at the first step and
/// then at most every [`PLAIN_EVERY`] and at each epoch's end. Scale events,
/// epochs and notes are a line each either way.
pub struct ProgressDisplay {
    bar: ProgressBar,
    /// Samples in an epoch and epochs in the job.
    rows: u64,
    epochs: u64,
    /// When the last plain line was printed (`None`: none yet).
    last_plain: Option<Instant>,
    /// The newest step's line when it was not printed, for the epoch's end.
    pending: Option<String>,
    /// The parameter servers, as last looked at: how many, and their rows' MiB.
    servers: Option<(usize, f64)>,
}

impl ProgressDisplay {
    pub fn new(rows: u64, epochs: u64) -> anyhow::Result<Self> {
        let bar = ProgressBar::new(epochs * rows);
        bar.set_style(
            ProgressStyle::with_template("[{elapsed_precise}] [{bar:30}] {percent:>3}% {eta} left {msg}")?
                .progress_chars("=> "),
        );
        // Workers' lines go to standard output as ever, above the bar (which
        // is cleared while one is written), not through it.
        let lines = bar.clone();
        edl_runtime::process::lines_to(move |l| {
            lines.suspend(|| {
                let _ = writeln!(std::io::stdout().lock(), "{l}");
            })
        });
        Ok(ProgressDisplay { bar, rows, epochs, last_plain: None, pending: None, servers: None })
    }

    /// Shows one event of the job.
    pub fn show(&mut self, p: Progress) {
        match p {
            Progress::Step(s) => {
                let line = self.step_line(s);
                if self.bar.is_hidden() {
                    if self.last_plain.is_none_or(|t| t.elapsed() >= PLAIN_EVERY) {
                        self.last_plain = Some(Instant::now());
                        self.pending = None;
                        let _ = writeln!(std::io::stdout().lock(), "progress  {line}");
                    } else {
                        self.pending = Some(line);
                    }
                } else {
                    self.bar
                        .set_position((s.epoch * self.rows + s.cursor as u64).min(self.epochs * self.rows));
                    self.bar.set_message(line);
                }
            }
            Progress::Scale(e) => self.say(format!(
                "scale     step {:>5}: {} -> {} workers (generation {}), paused {:.0} ms{}: {}",
                e.step,
                e.from,
                e.to,
                e.generation,
                e.pause_ms,
                match (e.join_ms, e.recovery) {
                    (_, Some(r)) => format!(
                        " (seen after {:.0} ms, survivors out in {:.0} ms, formed in {:.0} ms, first step in {:.0} ms)",
                        r.detect_ms, r.abort_ms, r.form_ms, r.first_step_ms
                    ),
                    (Some(j), None) => format!(", new worker ready {j:.0} ms after the decision"),
                    (None, None) => String::new(),
                },
                e.reason
            )),
            Progress::Epoch(r) => {
                // Each epoch's last step is shown, however soon it ends.
                if let Some(line) = self.pending.take() {
                    self.last_plain = Some(Instant::now());
                    let _ = writeln!(std::io::stdout().lock(), "progress  {line}");
                }
                self.say(format!(
                    "epoch     {} done: {} samples committed, {} duplicates, {} missing",
                    r.epoch, r.samples_committed, r.duplicates, r.missing
                ))
            }
            Progress::Checkpoint { step, path, secs, bytes } => {
                tracing::debug!(
                    "checkpoint at step {step}: {} ({bytes} bytes in {secs:.3} s)",
                    path.display()
                )
            }
            // Said by the coordinator's note; counted by the watch.
            Progress::Redone { .. }
            | Progress::Decision { .. }
            | Progress::Workers(_)
            | Progress::TeacherView(_)
            | Progress::WorkerReady { .. } => {}
            Progress::ParameterServers(s) => {
                let bytes: u64 = s.iter().map(|s| s.bytes).sum();
                self.servers = Some((s.len(), bytes as f64 / (1 << 20) as f64));
            }
            Progress::Note(n) => self.say(format!("note      {n}")),
            Progress::Teachers(e) => self
                .say(format!("teachers  step {:>5}: {} -> {} teachers: {}", e.step, e.from, e.to, e.reason)),
        }
    }

    /// A step's progress line: where the job is, its workers, speed, loss,
    /// the program's metrics and the parameter servers.
    fn step_line(&self, s: &edl_runtime::coordinator::StepRecord) -> String {
        let mut line = format!(
            "epoch {}/{} step {} | {} workers | {:.0} samples/s | loss {:.4}",
            (s.epoch + 1).min(self.epochs),
            self.epochs,
            s.step,
            s.world,
            s.samples_per_sec,
            s.loss
        );
        for (name, v) in &s.metrics {
            line.push_str(&format!(" | {name} {v:.4}"));
        }
        if let Some((n, mib)) = self.servers {
            line.push_str(&format!(" | {n} parameter servers, {mib:.1} MiB of rows"));
        }
        line
    }

    /// Prints above the bar, or plainly when there is no terminal.
    fn say(&self, line: String) {
        if self.bar.is_hidden() {
            let _ = writeln!(std::io::stdout().lock(), "{line}");
        } else {
            self.bar.println(line);
        }
    }

    /// Removes the bar (the job ended, or failed).
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
