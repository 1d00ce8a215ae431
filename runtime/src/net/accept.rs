//! Accepting a listener's connections, each served on a thread of its own,
//! with a bound on those that have not yet proven the job's secret: a port
//! open to a network costs at most [`MAX_PROVING`] threads, each for at most
//! its handshake's deadline, however fast connections are opened.

use std::{
    net::{TcpListener, TcpStream},
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

/// Most connections of one listener proving the secret at once; past it,
/// the next is accepted only once a place is given up (it waits in the
/// listener's queue meanwhile).
pub const MAX_PROVING: usize = 256;

/// The places taken, and a wake-up when one is given up.
#[derive(Default)]
struct Places {
    taken: Mutex<usize>,
    freed: Condvar,
}

impl Places {
    fn lock(&self) -> std::sync::MutexGuard<'_, usize> {
        self.taken.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A connection's place among its listener's connections proving the
/// secret, given up when dropped (once it has proven it, or failed to).
pub struct Proving(Arc<Places>);

impl Drop for Proving {
    fn drop(&mut self) {
        *self.0.lock() -= 1;
        self.0.freed.notify_one();
    }
}

/// Accepts `listener`'s connections on a thread named `name` and serves
/// each with `serve` on a thread of its own (`name`-conn), with its
/// [`Proving`] place: `serve` drops it once the secret is proven. With
/// [`MAX_PROVING`] places taken, the next connection is accepted only once
/// one is given up (each is given up within its handshake's deadline, so a
/// stranger holding every place delays the others, it does not turn them
/// away; said at the 1st, 2nd, 4th, 8th... wait, so that a flood does not
/// flood the log). An accept that fails (out of descriptors) is tried again
/// 100 ms later rather than at once. `what` names the listener in its
/// warnings.
pub fn serve_each<F>(listener: TcpListener, name: &str, what: &'static str, serve: F) -> std::io::Result<()>
where
    F: Fn(TcpStream, Proving) + Clone + Send + 'static,
{
    let conn_name = format!("{name}-conn");
    std::thread::Builder::new().name(name.into()).spawn(move || {
        let places = Arc::new(Places::default());
        let mut waits = 0u64;
        loop {
            let mut taken = places.lock();
            if *taken >= MAX_PROVING {
                waits += 1;
                if waits.is_power_of_two() {
                    tracing::warn!(
                        "{what}: {MAX_PROVING} connections proving the secret; the next waits for one to end \
                         ({waits} waits so far)"
                    );
                }
                while *taken >= MAX_PROVING {
                    taken = places.freed.wait(taken).unwrap_or_else(|p| p.into_inner());
                }
            }
            drop(taken);
            let conn = match listener.accept() {
                Ok((c, _)) => c,
                Err(e) => {
                    // The connection stays queued: wait for descriptors
                    // to close instead of spinning on it.
                    tracing::warn!("{what}: accept: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            *places.lock() += 1;
            let (place, serve) = (Proving(places.clone()), serve.clone());
            // A thread that cannot start drops its closure, and the place with it.
            if let Err(e) =
                std::thread::Builder::new().name(conn_name.clone()).spawn(move || serve(conn, place))
            {
                tracing::warn!("{what}: no thread for a new connection: {e}");
            }
        }
    })?;
    Ok(())
}

/// The warnings of refused connections, at most one a second, each with
/// the count of those refused since the last said: connections that fail
/// the secret's check as fast as they can be opened (a port open to a
/// network, a scanner) do not flood the log.
#[derive(Default)]
pub struct Refusals {
    /// When the last warning was said, and how many refusals went unsaid since.
    said: std::sync::Mutex<(Option<Instant>, u64)>,
}

impl Refusals {
    /// Whether a refusal at `now` is said, and if so how many before it
    /// went unsaid.
    fn say(&self, now: Instant) -> Option<u64> {
        let mut said = self.said.lock().unwrap_or_else(|p| p.into_inner());
        let (last, unsaid) = &mut *said;
        if last.is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(1)) {
            *unsaid += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(unsaid))
    }

    /// Warns that `what` from `peer` was refused (`why`), or says it at
    /// debug level within a second of the last warning.
    pub fn refused(&self, what: &str, peer: &str, why: &dyn std::fmt::Display) {
        match self.say(Instant::now()) {
            Some(0) => tracing::warn!("refused {what} from {peer}: {why}"),
            Some(n) => tracing::warn!(
                "refused {what} from {peer}: {why} ({n} more refused since the last warning of one, said at debug level)"
            ),
            None => tracing::debug!("refused {what} from {peer}: {why}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{io::Read, sync::mpsc};

    #[test]
    fn refused_connections_are_said_at_most_once_a_second_with_the_count_of_those_not_said() {
        let r = Refusals::default();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(r.say(at(0)), Some(0), "the first is said");
        assert_eq!(r.say(at(10)), None);
        assert_eq!(r.say(at(999)), None);
        // A second after the last said: said, with the two in between.
        assert_eq!(r.say(at(1000)), Some(2));
        assert_eq!(r.say(at(1500)), None);
        assert_eq!(r.say(at(5000)), Some(1));
        assert_eq!(r.say(at(6000)), Some(0));
    }

    /// Connections that never prove anything hold their places; past the
    /// bound, the next one waits (open, not served) until a place is given
    /// up, and is served then.
    #[test]
    fn past_the_bound_of_connections_proving_the_secret_the_next_waits_for_a_place() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (places_tx, places) = mpsc::channel::<Proving>();
        serve_each(listener, "test-accept", "test", move |conn, place| {
            // Kept open and its place held until the test lets it go.
            std::mem::forget(conn);
            let _ = places_tx.send(place);
        })
        .unwrap();
        let held: Vec<TcpStream> = (0..MAX_PROVING).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let mut taken: Vec<Proving> =
            (0..MAX_PROVING).map(|_| places.recv_timeout(Duration::from_secs(60)).unwrap()).collect();
        let mut next = TcpStream::connect(addr).unwrap();
        assert!(places.recv_timeout(Duration::from_millis(300)).is_err(), "served past the bound");
        next.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let e = next.read(&mut [0u8; 1]).unwrap_err();
        assert!(matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{e}");
        drop(taken.pop());
        assert!(places.recv_timeout(Duration::from_secs(60)).is_ok(), "served once a place was given up");
        drop(held);
    }
}
