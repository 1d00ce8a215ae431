//! The coordinator's loop, watched from a thread of its own. The job's
//! lease is renewed and its workers are beaten from other threads, so a
//! loop that stops coming back to its workers' news (a native plugin that
//! never returns, a file system that hangs under the checkpoints, a bug)
//! would hold the job, its workers and its lease for ever while training
//! nothing, and no standby could take it over. A loop that has not come
//! back within `--loop-stall-secs` is a stalled coordinator: the watchdog
//! says where its thread is (computing, or waiting in the kernel and on
//! what), and the process ends, as a coordinator that died would (its
//! lease lapses; a standby or a rerun resumes the job from its newest
//! checkpoint).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

/// What is done with a stall: the error that says it.
pub type OnStall = Box<dyn FnOnce(anyhow::Error) + Send>;

/// Watches the thread that started it, from the first time the loop comes
/// back (a standby waiting for the job's lease, a resume verifying its
/// checkpoint, come before); stops watching when dropped.
pub struct Watchdog {
    base: Instant,
    /// When the loop last came back, 1 + ms after `base` (0: not yet).
    turned: Arc<AtomicU64>,
    _stop: mpsc::Sender<()>,
}

impl Watchdog {
    /// Watches the calling thread: once [`Watchdog::turned`] is called,
    /// unless it is called again at least once every `bound`, `stalled` is
    /// given the error. Without a thread for it (the system refused one)
    /// nothing is watched.
    pub fn start(bound: Duration, stalled: OnStall) -> Watchdog {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let base = Instant::now();
        let turned = Arc::new(AtomicU64::new(0));
        let (stop, stopped) = mpsc::channel::<()>();
        let last = turned.clone();
        let look = (bound / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let spawned = std::thread::Builder::new().name("edl-watchdog".into()).spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(look) {
                let Some(at) = last.load(Ordering::Relaxed).checked_sub(1) else { continue };
                let idle = base.elapsed().saturating_sub(Duration::from_millis(at));
                if idle >= bound {
                    stalled(anyhow::Error::new(Stalled { idle, bound, thread: thread_state(tid) }));
                    return;
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("the coordinator's loop is not watched (no thread for it: {e})");
        }
        Watchdog { base, turned, _stop: stop }
    }

    /// The loop came back.
    pub fn turned(&self) {
        self.turned.store(1 + self.base.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

/// The coordinator's loop did not come back within its bound.
#[derive(Debug, thiserror::Error)]
#[error(
    "the coordinator's loop has not come back to its workers for {:.1} s (--loop-stall-secs {}): its thread \
     is {thread}. The job stops rather than hold its lease and its workers while it trains nothing; a standby \
     or a rerun resumes it from its newest checkpoint",
    idle.as_secs_f64(),
    bound.as_secs_f64()
)]
pub struct Stalled {
    pub idle: Duration,
    pub bound: Duration,
    /// Where the loop's thread is, as the kernel says.
    pub thread: String,
}

/// Where thread `tid` of this process is: running, or waiting in the
/// kernel and in which function (`/proc/self/task/TID/stat` and `wchan`).
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
        None => "gone, or unreadable in /proc".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_that_stops_coming_back_is_said_stalled_and_where_its_thread_waits() {
        let (tx, rx) = mpsc::channel();
        let dog =
            Watchdog::start(Duration::from_millis(100), Box::new(move |e| tx.send(e.to_string()).unwrap()));
        // Not watched before the loop first comes back.
        std::thread::sleep(Duration::from_millis(400));
        assert!(rx.try_recv().is_err(), "stalled before it first came back");
        dog.turned();
        // This thread now waits in the kernel (on the channel) without
        // coming back.
        let said = rx.recv_timeout(Duration::from_secs(30)).expect("said stalled");
        drop(dog);
        assert!(
            said.contains("has not come back to its workers") && said.contains("--loop-stall-secs 0.1"),
            "{said}"
        );
        assert!(said.contains("its thread is waiting in the kernel"), "{said}");
    }

    #[test]
    fn a_loop_that_keeps_coming_back_is_not_stalled_and_a_dropped_watchdog_says_nothing() {
        let (tx, rx) = mpsc::channel();
        let dog = Watchdog::start(Duration::from_secs(5), Box::new(move |e| tx.send(e.to_string()).unwrap()));
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
