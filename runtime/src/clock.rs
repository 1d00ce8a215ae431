//! Time that a lease can be measured in. `std::time::Instant` reads
//! CLOCK_MONOTONIC, which stops while the machine is suspended (and, on
//! many hypervisors, while a VM is paused): a coordinator resumed after
//! its successor took over would think its lease still held. A
//! [`BootInstant`] reads CLOCK_BOOTTIME, which counts that time too.

use std::time::Duration;

/// A point in time on CLOCK_BOOTTIME.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct BootInstant(Duration);

impl BootInstant {
    pub fn now() -> Self {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid, writable timespec; CLOCK_BOOTTIME exists
        // on every Linux this runs on (2.6.39 and later).
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
        if rc != 0 {
            // Not reachable on Linux; the monotonic clock is the fallback.
            // SAFETY: as above.
            unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        }
        BootInstant(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
    }

    /// The time since this instant (zero if it is in the future).
    pub fn elapsed(&self) -> Duration {
        Self::now().0.saturating_sub(self.0)
    }

    /// This instant moved `d` earlier (saturating at the clock's start).
    pub fn earlier(&self, d: Duration) -> Self {
        BootInstant(self.0.saturating_sub(d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_time_moves_forward_with_the_monotonic_clock_at_least() {
        let (b, m) = (BootInstant::now(), std::time::Instant::now());
        std::thread::sleep(Duration::from_millis(20));
        assert!(b.elapsed() >= Duration::from_millis(20));
        // Read a moment apart, the two clocks agree to within it.
        assert!(b.elapsed() + Duration::from_millis(5) >= m.elapsed());
        assert!(BootInstant::now() > b);
        assert!(b.earlier(Duration::from_secs(5)).elapsed() >= Duration::from_secs(5));
    }
}
