//! The coordinator's loop, watched from a thread of its own. The job's
//! lease is renewed and its workers are beaten from other threads, so a
//! loop that stops coming back to its workers' news (a native plugin that
//! never returns, a file system that hangs under the checkpoints, a bug)
//! would hold the job, its workers and its lease for ever while training
//! nothing, and no standby could take it over. A loop that has not come
//! back within `--loop-stall-secs` is a stalled coordinator: the watchdog
//! says where its thread is (computing, or waiting in the kernel and on
//! what), and the process ends ([`ending_the_process`]), as a coordinator
//! that died would (its lease lapses; a standby or a rerun resumes the job
//! from its newest checkpoint).
//!
//! The loop is watched from the first time it waits for its workers: a
//! standby waiting for the job's lease, and a resume verifying its
//! checkpoint, come before. What it does between two waits afterwards is
//! watched, and the bound must be above the longest of it: verifying the
//! newest checkpoint after every worker was lost (its state file read and
//! hashed), the parameter servers' shards moved at a boundary.

use std::{
    io::Write,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

/// What is done with a stall: the error that says it.
pub type OnStall = Box<dyn FnOnce(anyhow::Error) + Send>;

/// How long what is done with a stall before the process ends may take
/// (it may wait on what the loop hangs on: a report on a hung file system).
const LAST_WORDS: Duration = Duration::from_secs(10);

/// Watches the thread that started it, from the first time the loop comes
/// back; stops watching when dropped.
pub struct Watchdog {
    base: Instant,
    /// When the loop last came back, 1 + ms after `base` (0: not yet).
    turned: Arc<AtomicU64>,
    /// Dropped: a stall seen from now on is not one.
    over: Arc<AtomicBool>,
    _stop: mpsc::Sender<()>,
}

impl Watchdog {
    /// Watches the calling thread: once [`Watchdog::turned`] is called,
    /// unless it is called again at least once every `bound`, `stalled` is
    /// given the error. A process frozen (SIGSTOP, a paused machine) that
    /// wakes past the bound is not taken for a stall: the watchdog, frozen
    /// too, counts from its own waking. Without a thread for it (the system
    /// refused one) nothing is watched.
    pub fn start(what: Watched, bound: Duration, stalled: OnStall) -> Watchdog {
        let tid = this_thread();
        let base = Instant::now();
        let turned = Arc::new(AtomicU64::new(0));
        let over = Arc::new(AtomicBool::new(false));
        let (stop, stopped) = mpsc::channel::<()>();
        let (last, ended) = (turned.clone(), over.clone());
        let look = (bound / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let spawned = std::thread::Builder::new().name("edl-watchdog".into()).spawn(move || {
            let mut looked = Instant::now();
            // The turn the time forgiven is for, and that time.
            let (mut of, mut forgiven) = (0, Duration::ZERO);
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(look) {
                let gap = std::mem::replace(&mut looked, Instant::now()).elapsed();
                let Some(at) = last.load(Ordering::Relaxed).checked_sub(1) else { continue };
                if at != of {
                    (of, forgiven) = (at, Duration::ZERO);
                }
                let idle = base.elapsed().saturating_sub(Duration::from_millis(at));
                if let Some(idle) = stall(idle, gap, look, bound, &mut forgiven)
                    && !ended.load(Ordering::SeqCst)
                {
                    stalled(anyhow::Error::new(Stalled { what, idle, bound, thread: thread_state(tid) }));
                    return;
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("{} is not watched (no thread for it: {e})", what.name());
        }
        Watchdog { base, turned, over, _stop: stop }
    }

    /// The loop came back.
    pub fn turned(&self) {
        self.turned.store(1 + self.base.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

/// Whether a loop away for `idle` has stalled, given that the watchdog
/// last looked `gap` ago where it looks every `look`: where it did not run
/// for much longer than that (a process frozen whole, SIGSTOP or a paused
/// machine; a machine so loaded that it starves), the time beyond its look
/// is `forgiven` the loop, which did not run either. Each look that comes
/// adds at least `look` to the idle time counted, so a watchdog starved at
/// every look still sees a real stall, later. Returns the idle time
/// counted, once it reaches `bound`.
fn stall(
    idle: Duration,
    gap: Duration,
    look: Duration,
    bound: Duration,
    forgiven: &mut Duration,
) -> Option<Duration> {
    if gap > look * 2 + Duration::from_secs(1) {
        *forgiven += gap - look;
    }
    let counted = idle.saturating_sub(*forgiven);
    (counted >= bound).then_some(counted)
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.over.store(true, Ordering::SeqCst);
    }
}

/// What a stall does to the process: its error written to the standard
/// error (straight to the descriptor: the stalled thread may hold the
/// stream's lock), `said` given it on a thread of its own for at most
/// [`LAST_WORDS`], and the process ended with status 1 at once, running
/// nothing more of its own (the stalled thread may be inside a native
/// plugin, or waiting on a file system).
pub fn ending_the_process(said: OnStall) -> OnStall {
    Box::new(move |e| {
        let text = format!("Error: {e:#}\n");
        let mut stderr = std::mem::ManuallyDrop::new(stderr_fd());
        let _ = stderr.write_all(text.as_bytes());
        let (done, finished) = mpsc::channel::<()>();
        let saying = std::thread::Builder::new().name("edl-stalled".into()).spawn(move || {
            said(e);
            let _ = done.send(());
        });
        match saying {
            Ok(_) => {
                let _ = finished.recv_timeout(LAST_WORDS);
            }
            Err(e) => {
                let _ = writeln!(stderr, "(no report written: no thread for it: {e})");
            }
        }
        // SAFETY: _exit(2) takes no pointers and does not return; no Rust
        // code of the process runs after it, so no invariant is left broken.
        unsafe { libc::_exit(1) }
    })
}

/// The standard error's descriptor as a file (not to be closed).
fn stderr_fd() -> std::fs::File {
    use std::os::fd::FromRawFd;
    // SAFETY: descriptor 2 is open for the process's whole life (the
    // standard library opens /dev/null on 0-2 at start where they were
    // closed, and nothing here closes it); the caller never drops the file,
    // so it is never closed through this handle.
    unsafe { std::fs::File::from_raw_fd(2) }
}

/// The calling thread's id, as `/proc/self/task` names it.
#[cfg(target_os = "linux")]
fn this_thread() -> i32 {
    // SAFETY: gettid(2) takes no arguments and cannot fail.
    unsafe { libc::gettid() }
}

#[cfg(not(target_os = "linux"))]
fn this_thread() -> i32 {
    0
}

/// The loop a watchdog watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watched {
    /// The coordinator's: its stall ends the process.
    Coordinator,
    /// The teacher pool's thread: its stall is said, and the students keep
    /// the teachers they have meanwhile.
    TeacherPool,
}

impl Watched {
    fn name(self) -> &'static str {
        match self {
            Watched::Coordinator => "the coordinator's loop",
            Watched::TeacherPool => "the teacher pool's loop",
        }
    }
}

/// A watched loop did not come back within its bound.
#[derive(Debug)]
pub struct Stalled {
    pub what: Watched,
    pub idle: Duration,
    pub bound: Duration,
    /// Where the loop's thread is, as the kernel says.
    pub thread: String,
}

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (idle, bound, thread) = (self.idle.as_secs_f64(), self.bound.as_secs_f64(), &self.thread);
        match self.what {
            Watched::Coordinator => write!(
                f,
                "the coordinator's loop has not come back to its workers for {idle:.1} s (--loop-stall-secs \
                 {bound}): its thread is {thread}. The job stops rather than hold its lease and its workers \
                 while it trains nothing; a standby or a rerun resumes it from its newest checkpoint"
            ),
            Watched::TeacherPool => write!(
                f,
                "the teacher pool's loop has not come back for {idle:.1} s (--loop-stall-secs {bound}): its \
                 thread is {thread}. Until it does, no teacher is started, stopped or replaced; the students \
                 keep the teachers they have"
            ),
        }
    }
}

impl std::error::Error for Stalled {}

/// Where thread `tid` of this process is: running, or waiting in the
/// kernel and in which function (`/proc/self/task/TID/stat` and `wchan`;
/// unknown where there is none).
fn thread_state(tid: i32) -> String {
    let task = format!("/proc/self/task/{tid}");
    let state = std::fs::read_to_string(format!("{task}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()));
    let wchan = std::fs::read_to_string(format!("{task}/wchan")).ok().filter(|w| !w.is_empty() && w != "0");
    let within = wchan.map(|w| format!(" in {w}")).unwrap_or_default();
    match state {
        Some('R') => "running (computing, not waiting: a loop that does not end)".into(),
        Some('D') => format!("waiting on a device or a file system, uninterruptibly{within}"),
        Some('S') => format!("waiting in the kernel{within}"),
        Some(c) => format!("in state {c}{within}"),
        None => "unknown (not readable in /proc)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_that_stops_coming_back_is_said_stalled_and_where_its_thread_waits() {
        let (tx, rx) = mpsc::channel();
        let dog = Watchdog::start(
            Watched::Coordinator,
            Duration::from_millis(500),
            Box::new(move |e| tx.send(e.to_string()).unwrap()),
        );
        // Not watched before the loop first comes back.
        std::thread::sleep(Duration::from_millis(1500));
        assert!(rx.try_recv().is_err(), "stalled before it first came back");
        dog.turned();
        // This thread now waits in the kernel (on the channel) without
        // coming back.
        let said = rx.recv_timeout(Duration::from_secs(30)).expect("said stalled");
        drop(dog);
        assert!(
            said.contains("has not come back to its workers") && said.contains("--loop-stall-secs 0.5"),
            "{said}"
        );
        assert!(said.contains("its thread is waiting in the kernel"), "{said}");
    }

    #[test]
    fn time_the_watchdog_did_not_run_is_forgiven_and_a_starved_watchdog_still_sees_a_stall() {
        let (ms, s) = (Duration::from_millis, Duration::from_secs);
        let (look, bound) = (s(1), s(10));
        let mut forgiven = Duration::ZERO;
        // Looking on time: a stall at the bound, not before.
        assert_eq!(stall(s(9), look, look, bound, &mut forgiven), None);
        assert_eq!(stall(s(10), look, look, bound, &mut forgiven), Some(s(10)));
        // Frozen for an hour, a second after the loop came back: no stall
        // on waking; the loop's own time away counts on from there.
        assert_eq!(stall(s(3601), s(3601), look, bound, &mut forgiven), None);
        assert_eq!(stall(s(3609), look, look, bound, &mut forgiven), None);
        assert_eq!(stall(s(3610), look, look, bound, &mut forgiven), Some(s(10)));
        // Starved at every look (4 s each): the idle time counted still grows
        // by the look each time, and reaches the bound.
        let mut forgiven = Duration::ZERO;
        let mut idle = Duration::ZERO;
        let looks = (1..100).find(|_| {
            idle += s(4);
            stall(idle, s(4), look, bound, &mut forgiven).is_some()
        });
        assert_eq!(looks, Some(10), "stalled after {:?} idle", idle);
        // Short gaps forgive nothing.
        let mut forgiven = Duration::ZERO;
        assert_eq!(stall(s(10), ms(2900), look, bound, &mut forgiven), Some(s(10)));
    }

    #[test]
    fn a_loop_that_keeps_coming_back_is_not_stalled_and_a_dropped_watchdog_says_nothing() {
        let (tx, rx) = mpsc::channel();
        let dog = Watchdog::start(
            Watched::Coordinator,
            Duration::from_secs(5),
            Box::new(move |e| tx.send(e.to_string()).unwrap()),
        );
        for _ in 0..50 {
            dog.turned();
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(rx.try_recv().is_err(), "stalled while turning");
        drop(dog);
        // The thread is gone with it: the callback is dropped, never called.
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Err(mpsc::RecvTimeoutError::Disconnected));
    }

    #[test]
    fn a_thread_computing_is_said_to_be_running() {
        let (tx, rx) = mpsc::channel();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = done.clone();
        let spinning = std::thread::spawn(move || {
            let dog = Watchdog::start(
                Watched::Coordinator,
                Duration::from_millis(100),
                Box::new(move |e| tx.send(e.to_string()).unwrap()),
            );
            dog.turned();
            let mut x = 1u64;
            while !stop.load(Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            drop(dog);
        });
        let said = rx.recv_timeout(Duration::from_secs(30));
        done.store(true, Ordering::Relaxed);
        spinning.join().unwrap();
        let said = said.expect("said stalled");
        assert!(said.contains("its thread is running (computing"), "{said}");
    }
}
