//! The thread that advances the plugin engine's epoch, by which a guest
//! call's deadline is counted: every [`EPOCH_TICK`] while a call runs, and
//! not at all while none does. A job calls its plugins a few times a
//! second or less; a tick that never stops would wake a thread 500 times a
//! second for nothing, on the cores the job trains on.

use super::limits::EPOCH_TICK;
use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst},
};
use std::time::Duration;
use wasmtime::Engine;

/// While the engine lives, a parked ticker looks whether it is still
/// there this often. (Tests wait far longer than they ever need to: a
/// call that failed to wake the ticker shows as one that never ticks.)
#[cfg(not(test))]
const IDLE_LOOK: Duration = Duration::from_secs(1);
#[cfg(test)]
const IDLE_LOOK: Duration = Duration::from_secs(600);

/// Shared by the host and its plugins: [`Ticker::enter`] before a call into a guest.
#[derive(Clone)]
pub(crate) struct Ticker(Arc<Shared>);

struct Shared {
    /// Calls into guests running now.
    running: AtomicUsize,
    /// The thread is parked (or about to be) until a call starts.
    parked: AtomicBool,
    /// Epoch increments made, for tests.
    ticks: AtomicU64,
    thread: std::sync::OnceLock<std::thread::Thread>,
}

/// A call in flight: the epoch advances until it is dropped.
pub(crate) struct Ticking<'a>(&'a Shared);

impl Drop for Ticking<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, SeqCst);
    }
}

impl Ticker {
    /// Starts the thread; it ends once `engine` is dropped everywhere.
    pub(crate) fn start(engine: &Engine) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            running: AtomicUsize::new(0),
            parked: AtomicBool::new(false),
            ticks: AtomicU64::new(0),
            thread: std::sync::OnceLock::new(),
        });
        let (weak, mine) = (engine.weak(), shared.clone());
        let handle = std::thread::Builder::new().name("edl-plugin-epoch".into()).spawn(move || {
            loop {
                if mine.running.load(SeqCst) == 0 {
                    mine.parked.store(true, SeqCst);
                    // A call that started after the look above finds it
                    // parked and wakes it (a wake before the park is kept).
                    if mine.running.load(SeqCst) == 0 {
                        std::thread::park_timeout(IDLE_LOOK);
                    }
                    mine.parked.store(false, SeqCst);
                    if weak.upgrade().is_none() {
                        return;
                    }
                    continue;
                }
                std::thread::sleep(EPOCH_TICK);
                let Some(engine) = weak.upgrade() else { return };
                engine.increment_epoch();
                mine.ticks.fetch_add(1, SeqCst);
            }
        })?;
        let _ = shared.thread.set(handle.thread().clone());
        Ok(Ticker(shared))
    }

    /// A call into a guest starts: the epoch advances while it runs.
    pub(crate) fn enter(&self) -> Ticking<'_> {
        self.0.running.fetch_add(1, SeqCst);
        if self.0.parked.swap(false, SeqCst)
            && let Some(t) = self.0.thread.get()
        {
            t.unpark();
        }
        Ticking(&self.0)
    }

    #[cfg(test)]
    fn ticks(&self) -> u64 {
        self.0.ticks.load(SeqCst)
    }

    #[cfg(test)]
    fn parked(&self) -> bool {
        self.0.parked.load(SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits (at most ten seconds, far less than [`IDLE_LOOK`]) for `what`.
    fn until(what: impl Fn() -> bool) -> bool {
        (0..10_000).any(|_| {
            what() || {
                std::thread::sleep(Duration::from_millis(1));
                false
            }
        })
    }

    #[test]
    fn the_epoch_advances_while_a_call_runs_and_stands_still_while_none_does() {
        let engine = Engine::default();
        let ticker = Ticker::start(&engine).unwrap();
        assert!(until(|| ticker.parked()), "the ticker never parked with no call running");
        let idle = ticker.ticks();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(ticker.ticks(), idle, "the epoch advanced with no call running");
        let call = ticker.enter();
        assert!(until(|| ticker.ticks() >= idle + 3), "the epoch did not advance during a call");
        drop(call);
        assert!(until(|| ticker.parked()), "the ticker did not park after the call");
        let after = ticker.ticks();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(ticker.ticks(), after, "the epoch advanced after the call ended");
        // Calls started one after another each wake it again.
        for _ in 0..3 {
            let seen = ticker.ticks();
            let call = ticker.enter();
            assert!(until(|| ticker.ticks() > seen), "a later call found the epoch standing still");
            drop(call);
        }
    }
}
