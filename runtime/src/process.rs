//! Other programs the job runs and waits for (a scheduler's client, a
//! notice hook), each within a bound: a client whose server stopped
//! answering is killed at the bound instead of stalling the coordinator or
//! the worker that waits for it. And the children the job starts (workers,
//! teachers): made to die with it, stopped with a grace, their logs quoted.

use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use wait_timeout::ChildExt;

/// Runs `cmd` with `input` on its standard input and returns its output,
/// or an error naming `what` when it cannot start, or has not ended
/// `within` (it is then killed).
pub fn output(what: &str, cmd: &mut Command, input: &[u8], within: Duration) -> Result<Output> {
    // A process group of its own, so that what it started (a pipeline's
    // other commands) is stopped with it at the bound.
    let mut child = cmd
        .process_group(0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("{what}: cannot run it"))?;
    // Its input and output go on threads of their own, so that a program
    // that fills a pipe while this one waits cannot hold the wait.
    let mut stdin = child.stdin.take();
    let input = input.to_vec();
    let writer = std::thread::spawn(move || {
        if let Some(s) = stdin.as_mut() {
            let _ = s.write_all(&input);
        }
    });
    let readers = [drain(child.stdout.take()), drain(child.stderr.take())];
    let status = match child.wait_timeout(within).with_context(|| format!("{what}: waiting for it"))? {
        Some(status) => status,
        None => {
            // SAFETY: kill(2) has no memory-safety preconditions. The pid is
            // the leader of the group this call made (process_group(0)), and
            // wait_timeout said it still runs and did not reap it, so the pid
            // cannot have been reused: only that group is signalled.
            unsafe { libc::killpg(child.id() as i32, libc::SIGKILL) };
            let _ = child.wait();
            bail!("{what}: no answer within {within:?}; it was stopped");
        }
    };
    drop(writer);
    // A program that left a child holding its output open is not waited
    // for past a second: what it wrote by then is its answer.
    let [stdout, stderr] = readers.map(|r| r.recv_timeout(Duration::from_secs(1)).unwrap_or_default());
    Ok(Output { status, stdout, stderr })
}

/// Reads `pipe` to its end on a thread; the bytes come on the channel.
fn drain(pipe: Option<impl Read + Send + 'static>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut out = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut out);
        }
        let _ = tx.send(out);
    });
    rx
}

/// A scheduler's server that did not answer is asked again only after a
/// pause (30 s, doubling to 5 min while it stays silent): an unreachable
/// controller then costs the job one bounded wait per pause, not one at
/// every poll.
#[derive(Debug)]
pub struct Backoff {
    until: Option<Instant>,
    pause: Duration,
}

const FIRST_PAUSE: Duration = Duration::from_secs(30);
const LONGEST_PAUSE: Duration = Duration::from_secs(300);

impl Default for Backoff {
    fn default() -> Self {
        Backoff { until: None, pause: FIRST_PAUSE }
    }
}

impl Backoff {
    /// Whether the server may be asked now.
    pub fn open(&self) -> bool {
        self.until.is_none_or(|t| Instant::now() >= t)
    }

    /// It did not answer (`why`): said once per pause, the pause doubles.
    pub fn failed(&mut self, why: &anyhow::Error) {
        tracing::warn!("{why:#}; asking again in {:?}", self.pause);
        self.until = Some(Instant::now() + self.pause);
        self.pause = (self.pause * 2).min(LONGEST_PAUSE);
    }

    /// It answered: the next silence starts from the first pause.
    pub fn answered(&mut self) {
        *self = Backoff::default();
    }
}

/// Makes a child die with its parent (Linux); elsewhere a child notices the
/// closed control connection and exits. Linux sends the signal when the
/// *thread* that spawned the child ends: a thread that may end before the
/// process spawns through [`spawn_lasting`].
pub fn die_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe and touches only this process.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// Spawns `cmd` from a thread that lasts as long as the process, so that a
/// child made to [`die_with_parent`] outlives the thread asking for it
/// (a pool's thread that ends first, say) and dies only with the process.
pub fn spawn_lasting(cmd: Command) -> std::io::Result<Child> {
    type Ask = (Command, std::sync::mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: std::sync::OnceLock<std::sync::Mutex<std::sync::mpsc::Sender<Ask>>> =
        std::sync::OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Ask>();
        let started = std::thread::Builder::new().name("edl-spawner".into()).spawn(move || {
            for (mut cmd, reply) in rx {
                let _ = reply.send(cmd.spawn());
            }
        });
        if let Err(e) = started {
            tracing::warn!("no spawner thread ({e}); children are spawned by the threads asking");
        }
        std::sync::Mutex::new(tx)
    });
    let (reply, answer) = std::sync::mpsc::channel();
    let sent = spawner.lock().unwrap_or_else(|p| p.into_inner()).send((cmd, reply));
    match sent {
        Ok(()) => answer.recv().unwrap_or_else(|_| Err(std::io::Error::other("the spawner thread is gone"))),
        // No spawner thread: this thread spawns it.
        Err(std::sync::mpsc::SendError((mut cmd, _))) => cmd.spawn(),
    }
}

/// Sends SIGTERM, waits up to `grace`, then SIGKILL.
pub fn terminate(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    // SAFETY: signalling our own child by pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let until = Instant::now() + grace;
    while Instant::now() < until {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The last `lines` lines of a child's log, indented, for an error message
/// (empty when the log is empty or unreadable). A log that holds a Python
/// traceback gives the whole of its last traceback instead, however long
/// (up to [`MAX_TRACEBACK_LINES`]): the frame that raised is often far
/// above the last few lines.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(text) = std::fs::read(path) else { return String::new() };
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let from = match traceback_at(&all) {
        Some(t) => t.max(all.len().saturating_sub(MAX_TRACEBACK_LINES)),
        None => all.len().saturating_sub(lines),
    };
    let tail = &all[from..];
    if tail.is_empty() {
        return String::new();
    }
    // A traceback the workers' output showed already is not quoted again.
    if traceback_at(&all).is_some() && was_shown(tail) {
        return format!("; its traceback is shown above (whole in {})", path.display());
    }
    format!("; last lines of {}:\n    {}", path.display(), tail.join("\n    "))
}

/// Python tracebacks workers of this process printed to its terminal, by
/// their lines without blank ones or trailing spaces (a few dozen at most).
static TRACEBACKS_SHOWN: std::sync::Mutex<Vec<Vec<String>>> = std::sync::Mutex::new(Vec::new());

/// The lines of a traceback as it is compared: no blank lines, no trailing spaces.
fn traceback_key<S: AsRef<str>>(lines: &[S]) -> Vec<String> {
    lines.iter().map(|l| l.as_ref().trim_end().to_string()).filter(|l| !l.is_empty()).collect()
}

/// Whether the traceback `lines` was shown on this process's output
/// before; it counts as shown from now on either way.
pub fn traceback_shown<S: AsRef<str>>(lines: &[S]) -> bool {
    let key = traceback_key(lines);
    let mut shown = TRACEBACKS_SHOWN.lock().unwrap_or_else(|e| e.into_inner());
    if shown.contains(&key) {
        return true;
    }
    if shown.len() < 64 {
        shown.push(key);
    }
    false
}

/// Whether the traceback `lines` was shown on this process's output (it
/// is not counted as shown by asking).
fn was_shown(lines: &[&str]) -> bool {
    TRACEBACKS_SHOWN.lock().unwrap_or_else(|e| e.into_inner()).contains(&traceback_key(lines))
}

/// Where the Python traceback the log's lines end with starts. A traceback
/// counts when the log ends with it (its exception line last), not when
/// the program printed one it caught and went on.
fn traceback_at(all: &[&str]) -> Option<usize> {
    let ends_with_exception = all.last().is_some_and(|l| {
        let name = l.split(':').next().unwrap_or_default();
        !l.starts_with(' ')
            && !name.contains(' ')
            && ["Error", "Exception", "Interrupt", "Exit"].iter().any(|e| name.ends_with(e))
    });
    let t = all.iter().rposition(|l| l.starts_with("Traceback (most recent call last)"))?;
    ends_with_exception.then_some(t)
}

/// The exception a program's log ends with (a Python traceback's last
/// line), if it ends with one: what the program died of.
pub fn program_error(path: &Path) -> Option<String> {
    use std::io::Seek;
    // The end of the log is enough (a traceback is at most
    // MAX_TRACEBACK_LINES lines): a long log is not read whole.
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(std::io::SeekFrom::Start(len.saturating_sub(256 << 10))).ok()?;
    let mut text = Vec::new();
    f.read_to_end(&mut text).ok()?;
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    traceback_at(&all)?;
    all.last().map(|l| l.to_string())
}

/// The most lines of a Python traceback an error message quotes.
pub const MAX_TRACEBACK_LINES: usize = 200;

/// Removes the children that exited, and says how each ended.
pub fn reap<T>(children: &mut BTreeMap<u64, T>, child: impl Fn(&mut T) -> &mut Child) -> Vec<(u64, String)> {
    reap_by(children, child, Child::try_wait)
}

fn reap_by<T>(
    children: &mut BTreeMap<u64, T>,
    child: impl Fn(&mut T) -> &mut Child,
    try_reap: impl Fn(&mut Child) -> std::io::Result<Option<std::process::ExitStatus>>,
) -> Vec<(u64, String)> {
    let mut gone = Vec::new();
    children.retain(|id, c| match try_reap(child(c)) {
        Ok(Some(status)) => {
            gone.push((*id, status.to_string()));
            false
        }
        _ => true,
    });
    gone
}

/// Creates a log directory, naming it when that fails.
pub fn ensure_dir(p: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(p)
        .map_err(|e| anyhow::anyhow!("{}: cannot create log directory: {e}", p.display()))
}

/// Where a child stands, seen without reaping it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Standing {
    Running,
    /// Ended, not reaped: its pid (and the id of the group it led) cannot
    /// be given to another process until it is.
    Ended,
    /// Reaped already (or not a child of this process): its pid may name
    /// another process by now.
    Gone,
}

fn standing(child: &Child) -> Standing {
    // SAFETY: waitid writes only `info`, a plain C struct; WNOWAIT leaves
    // an ended child waitable, so std's own wait still sees it.
    let (ret, pid) = unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let flags = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
        let ret = libc::waitid(libc::P_PID, child.id(), &mut info, flags);
        (ret, info.si_pid())
    };
    match (ret, pid) {
        (0, 0) => Standing::Running,
        (0, _) => Standing::Ended,
        _ => Standing::Gone,
    }
}

/// Whether `child` still runs (an ended child is left unreaped).
pub fn runs(child: &Child) -> bool {
    standing(child) == Standing::Running
}

/// Signals the process group `child` leads (it was started with
/// `process_group(0)`), while its pid still names it.
pub fn signal_group(child: &Child, sig: libc::c_int) {
    if standing(child) != Standing::Gone {
        // SAFETY: kill(2) takes plain integers. The child is running or an
        // unreaped zombie, so its pid is still the id of the group it leads.
        unsafe {
            libc::kill(-(child.id() as libc::pid_t), sig);
        }
    }
}

/// Removes the children that exited, and says how each ended. Each led a
/// process group of its own, and what is left of it is killed before the
/// leader is reaped: a program's own children (a data loader's processes)
/// hold its sockets open, and its peers, waiting on those sockets in a
/// collective, would wait for their timeout instead of failing at once.
pub fn reap_groups<T>(
    children: &mut BTreeMap<u64, T>,
    child: impl Fn(&mut T) -> &mut Child,
) -> Vec<(u64, String)> {
    reap_by(children, child, reap_one)
}

/// Reaps `child` if it ended, having killed what is left of the process
/// group it led first; `Ok(None)` while it runs.
pub fn reap_one(child: &mut Child) -> std::io::Result<Option<std::process::ExitStatus>> {
    if standing(child) == Standing::Ended {
        signal_group(child, libc::SIGKILL);
    }
    child.try_wait()
}

/// Sends SIGTERM to a child's process group, waits up to `grace` for the
/// child, then SIGKILL to what is left of the group (the child's own
/// children too, had the child itself ended in time).
pub fn terminate_group(child: &mut Child, grace: Duration) {
    if standing(child) == Standing::Running {
        signal_group(child, libc::SIGTERM);
        let until = Instant::now() + grace;
        while Instant::now() < until && standing(child) == Standing::Running {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    signal_group(child, libc::SIGKILL);
    let _ = child.wait();
}

/// Where lines for the person at the terminal go (workers' output), when
/// the command shows more than lines (a progress bar they must not break).
static LINES: std::sync::OnceLock<Box<dyn Fn(&str) + Send + Sync>> = std::sync::OnceLock::new();

/// Sends the lines [`say_line`] is given to `sink` from now on (once a
/// process: the command that draws the terminal sets it).
pub fn lines_to(sink: impl Fn(&str) + Send + Sync + 'static) {
    let _ = LINES.set(Box::new(sink));
}

/// A line for the person at the terminal: standard output, or where
/// [`lines_to`] sent them.
pub fn say_line(line: &str) {
    match LINES.get() {
        Some(sink) => sink(line),
        None => {
            let _ = writeln!(std::io::stdout().lock(), "{line}");
        }
    }
}

/// The signal (SIGTERM or SIGINT) that asked this process to stop, 0 until
/// one came; the count of them.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);
static STOP_SIGNALS: AtomicU32 = AtomicU32::new(0);
/// Whether a loop that stops the job with notice looks at [`STOP_SIGNAL`].
static STOPS_WITH_NOTICE: AtomicBool = AtomicBool::new(false);
/// How long that loop may take to stop the job, ms (see [`StopsWithNotice`]).
static STOP_BOUND_MS: AtomicU64 = AtomicU64::new(30_000);

/// Longest a coordinator stopping on SIGTERM or SIGINT takes (a
/// checkpoint, its workers stopped, its report) before the process exits
/// regardless.
pub const STOP_WITHIN: Duration = Duration::from_secs(30);

/// Hears SIGTERM and SIGINT (once per process): a loop that calls
/// [`stop_requested`] (under [`StopsWithNotice`]) stops the job with notice
/// and exits 143 or 130 itself. Anywhere else, or at a second signal, or
/// past [`STOP_WITHIN`], the process says so and exits with that status.
pub fn hear_stop_signals() {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        for sig in [libc::SIGTERM, libc::SIGINT] {
            // SAFETY: the handler only stores to atomics (async-signal-safe).
            let installed = unsafe {
                signal_hook_registry::register(sig, move || {
                    let _ = STOP_SIGNAL.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
                    STOP_SIGNALS.fetch_add(1, Ordering::SeqCst);
                })
            };
            if let Err(e) = installed {
                tracing::warn!("{} will end this process without a checkpoint: {e}", signal_name(sig));
            }
        }
        let watchdog = std::thread::Builder::new().name("edl-stop".into()).spawn(|| {
            let mut since: Option<Instant> = None;
            loop {
                std::thread::sleep(Duration::from_millis(50));
                let sig = STOP_SIGNAL.load(Ordering::SeqCst);
                if sig == 0 {
                    continue;
                }
                let heard = *since.get_or_insert_with(Instant::now);
                let handled = STOPS_WITH_NOTICE.load(Ordering::SeqCst);
                let again = STOP_SIGNALS.load(Ordering::SeqCst) > 1;
                let bound = Duration::from_millis(STOP_BOUND_MS.load(Ordering::SeqCst));
                if !handled || again || heard.elapsed() >= bound {
                    eprintln!("stopped by {}", signal_name(sig));
                    std::process::exit(128 + sig);
                }
            }
        });
        if let Err(e) = watchdog {
            tracing::warn!("no watch on stop signals: {e}");
        }
    });
}

/// The signal that asked this process to stop, once one came.
pub fn stop_requested() -> Option<i32> {
    Some(STOP_SIGNAL.load(Ordering::SeqCst)).filter(|&s| s != 0)
}

/// While alive, a stop signal is left to the loop that holds it (see
/// [`hear_stop_signals`]), for up to its bound.
pub struct StopsWithNotice(());

impl StopsWithNotice {
    /// The loop stops the job within `within` (a coordinator: [`STOP_WITHIN`];
    /// a torchrun launcher: its ranks' grace and then some).
    pub fn begin(within: Duration) -> Self {
        STOP_BOUND_MS.store(within.as_millis() as u64, Ordering::SeqCst);
        STOPS_WITH_NOTICE.store(true, Ordering::SeqCst);
        StopsWithNotice(())
    }
}

impl Drop for StopsWithNotice {
    fn drop(&mut self) {
        STOPS_WITH_NOTICE.store(false, Ordering::SeqCst);
    }
}

/// The process was asked to stop by `signal`; `what` says what was kept.
#[derive(Debug, thiserror::Error)]
#[error("stopped by {}: {what}", signal_name(*signal))]
pub struct StopSignalled {
    pub signal: i32,
    pub what: String,
}

impl StopSignalled {
    /// The status a process that stopped so exits with (143, 130).
    pub fn exit_code(&self) -> u8 {
        u8::try_from(128 + self.signal).unwrap_or(1)
    }
}

/// `SIGTERM`, `SIGINT`, or the number.
pub fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGINT => "SIGINT".into(),
        n => format!("signal {n}"),
    }
}

/// Waits up to `within` for a line of `child`'s standard output (piped)
/// that `found` reads a value from, copying every line to `log` (at `path`)
/// as it comes, then and after. Lines before it are passed over (a banner,
/// a launcher's notes). A child that exits first, or stays silent, has its
/// process group stopped, and the error says why with its log's last lines.
pub fn await_line<T: Send + 'static>(
    child: &mut Child,
    path: &Path,
    mut log: std::fs::File,
    within: Duration,
    found: fn(&str) -> Option<T>,
) -> Result<T, String> {
    use std::io::{BufRead, Write};
    let Some(stdout) = child.stdout.take() else { return Err("its output is not piped".into()) };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tell = Some(tx);
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            let _ = writeln!(log, "{line}");
            if let Some(value) = tell.as_ref().and_then(|_| found(&line)) {
                let _ = tell.take().map(|tx| tx.send(value));
            }
        }
    });
    let why = match rx.recv_timeout(within) {
        Ok(value) => return Ok(value),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            "it exited before saying where it serves".to_string()
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            format!("it did not say where it serves within {within:?}")
        }
    };
    terminate_group(child, Duration::from_secs(1));
    Err(format!("{why}{}", log_tail(path, 5)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_spawned_lasting_outlives_the_thread_that_asked_for_it() {
        let spawn = |lasting: bool| {
            std::thread::spawn(move || {
                let mut cmd = Command::new("sleep");
                cmd.arg("30");
                die_with_parent(&mut cmd);
                if lasting { spawn_lasting(cmd) } else { cmd.spawn() }.unwrap()
            })
            .join()
            .unwrap()
        };
        let (mut kept, mut lost) = (spawn(true), spawn(false));
        // The asking threads are gone: the one spawned by its own thread is
        // killed with it, the other lives on.
        let died = lost.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&died), Some(libc::SIGKILL));
        assert!(kept.try_wait().unwrap().is_none(), "the lasting child lives");
        kept.kill().unwrap();
        kept.wait().unwrap();
    }

    #[test]
    fn a_program_that_answers_is_read_whole_with_its_input() {
        let out = output("cat", &mut Command::new("cat"), b"in and out", Duration::from_secs(30)).unwrap();
        assert!(out.status.success());
        assert_eq!(out.stdout, b"in and out");
    }

    #[test]
    fn a_program_that_never_answers_is_stopped_at_the_bound() {
        let mut cmd = Command::new("sleep");
        cmd.arg("600");
        let err = output("sleep 600", &mut cmd, b"", Duration::from_millis(200)).unwrap_err().to_string();
        assert!(err.contains("sleep 600: no answer within"), "{err}");
    }

    #[test]
    fn what_a_program_started_is_stopped_with_it_at_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let mut sh = Command::new("sh");
        sh.args(["-c", &format!("sleep 600 & echo $! > {}; wait", pid_file.display())]);
        assert!(output("a pipeline", &mut sh, b"", Duration::from_millis(300)).is_err());
        let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
        // The grandchild goes too (a zombie until init reaps it counts as gone).
        let alive = || {
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            state.split_whitespace().nth(2).is_some_and(|s| s != "Z")
        };
        let since = std::time::Instant::now();
        while alive() && since.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!alive(), "sleep {pid} outlived the bound");
    }

    #[test]
    fn a_traceback_shown_on_the_output_is_not_quoted_again_in_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("worker-9.log");
        let tb = ["Traceback (most recent call last):", "  File \"x_c9e1.py\", line 2", "KeyError: 'c9e1'"];
        std::fs::write(&log, format!("step 1\n{}\n", tb.join("\n"))).unwrap();
        let quoted = log_tail(&log, 3);
        assert!(quoted.contains("last lines of") && quoted.contains("KeyError: 'c9e1'"), "{quoted}");
        // Shown by a worker's output (trailing spaces and blank lines aside): named, not quoted.
        assert!(!traceback_shown(&[tb[0], "", &format!("{}  ", tb[1]), tb[2]]));
        assert!(traceback_shown(&tb), "counted as shown");
        let named = log_tail(&log, 3);
        assert_eq!(named, format!("; its traceback is shown above (whole in {})", log.display()));
    }

    #[test]
    fn a_server_that_does_not_answer_is_asked_again_after_a_growing_pause() {
        let mut b = Backoff::default();
        assert!(b.open());
        b.failed(&anyhow::anyhow!("squeue: no answer"));
        assert!(!b.open());
        assert_eq!(b.pause, FIRST_PAUSE * 2);
        for _ in 0..10 {
            b.failed(&anyhow::anyhow!("squeue: no answer"));
        }
        assert_eq!(b.pause, LONGEST_PAUSE);
        b.answered();
        assert!(b.open());
        assert_eq!(b.pause, FIRST_PAUSE);
    }

    #[test]
    fn a_program_that_is_not_there_is_named() {
        let err =
            output("no-such-client", &mut Command::new("/nonexistent/client"), b"", Duration::from_secs(5))
                .unwrap_err();
        assert!(format!("{err:#}").contains("no-such-client: cannot run it"), "{err:#}");
    }

    #[test]
    fn a_log_tail_holds_the_last_lines_that_say_something() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("teacher-0.log");
        assert_eq!(log_tail(&log, 3), "", "no log, nothing to add");
        std::fs::write(&log, "one\ntwo\n\nthree\nError: cannot reach the store\n\n").unwrap();
        let tail = log_tail(&log, 3);
        assert!(tail.starts_with(&format!("; last lines of {}:", log.display())), "{tail}");
        assert!(tail.ends_with("two\n    three\n    Error: cannot reach the store"), "{tail}");
        assert!(!tail.contains("one"));
    }

    #[test]
    fn a_log_tail_quotes_a_python_traceback_whole() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("worker-3.log");
        let mut text = String::from("epoch 0 step 1\nTraceback (most recent call last):\n");
        for i in 0..30 {
            text.push_str(&format!("  File \"train.py\", line {i}, in frame{i}\n"));
        }
        text.push_str("ValueError: shapes do not match\n");
        std::fs::write(&log, &text).unwrap();
        let tail = log_tail(&log, 3);
        assert!(tail.contains("Traceback (most recent call last):"), "{tail}");
        assert!(tail.contains("in frame0") && tail.contains("in frame29"), "{tail}");
        assert!(tail.ends_with("ValueError: shapes do not match"), "{tail}");
        assert!(!tail.contains("epoch 0 step 1"), "only the traceback: {tail}");
        assert_eq!(program_error(&log).as_deref(), Some("ValueError: shapes do not match"));
        // One the program caught and printed, then went on past: the last lines.
        text.push_str("recovered\nstep 2\nstep 3\nkilled by the policy\n");
        std::fs::write(&log, &text).unwrap();
        let tail = log_tail(&log, 3);
        assert!(!tail.contains("Traceback") && tail.ends_with("killed by the policy"), "{tail}");
        assert_eq!(program_error(&log), None, "it did not die of it");
    }
}
