//! Bounded waits: for a condition, for a value while a process runs, for a
//! line of a job's output. The bounds only keep a broken run from hanging
//! the suite.

use std::{
    process::Child,
    sync::mpsc,
    time::{Duration, Instant},
};

/// Waits (up to `within`) for `f` to hold, asking every 100 ms.
pub(crate) fn until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < end, "waited {within:?} for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Polls `check` every 20 ms until it gives a value; panics if `child`
/// exits first or nothing comes within `within` (`context` says what was
/// there). The bound only keeps a broken job from hanging the suite.
pub(crate) fn poll_while_running<T>(
    child: &mut Child,
    what: &str,
    within: Duration,
    mut check: impl FnMut() -> Option<T>,
    context: impl Fn() -> String,
) -> T {
    let until = Instant::now() + within;
    loop {
        if let Some(v) = check() {
            return v;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("it exited ({status}) before {what}: {}", context());
        }
        assert!(Instant::now() < until, "no {what} within {within:?}: {}", context());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for a line with `needle` (every line seen goes to `seen`).
pub(crate) fn wait_for(rx: &mpsc::Receiver<String>, needle: &str, seen: &mut Vec<String>, within: Duration) {
    let until = Instant::now() + within;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => {
                let hit = l.contains(needle);
                seen.push(l);
                if hit {
                    return;
                }
            }
            Err(_) => {
                panic!("no line with {needle:?} within {within:?}; output so far:\n{}", seen.join("\n"))
            }
        }
    }
}

/// Waits (up to `within`) for `child` to end; past that, kills it and
/// panics naming `what`, with what `context` says.
pub(crate) fn wait_exit(
    child: &mut Child,
    what: &str,
    within: Duration,
    context: impl Fn() -> String,
) -> std::process::ExitStatus {
    let until = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("{what} did not exit within {within:?}: {}", context());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
