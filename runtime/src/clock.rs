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

/// Notices steps of the wall clock (NTP stepping it, a person with `date
/// -s`) by comparing it with the boot clock between two looks. Nothing
/// that keeps the job's lease or fences it reads the wall clock; the step
/// is said so that a person reading the log knows why its times jump.
pub struct WallWatch {
    last: Option<(std::time::SystemTime, BootInstant)>,
}

/// A step smaller than this is taken for the looks' own delay.
const STEP_SAID: Duration = Duration::from_secs(2);

impl WallWatch {
    pub fn new() -> Self {
        WallWatch { last: None }
    }

    /// The wall clock's step since the last look, in seconds (positive:
    /// forward), when it is larger than [`STEP_SAID`].
    pub fn look(&mut self) -> Option<f64> {
        let now = (std::time::SystemTime::now(), BootInstant::now());
        let step = self.last.replace(now).map(|(wall, boot)| {
            let walked = match now.0.duration_since(wall) {
                Ok(d) => d.as_secs_f64(),
                Err(back) => -back.duration().as_secs_f64(),
            };
            walked - now.1.0.saturating_sub(boot.0).as_secs_f64()
        })?;
        (step.abs() >= STEP_SAID.as_secs_f64()).then_some(step)
    }
}

impl Default for WallWatch {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wall_clock_in_step_with_the_boot_clock_is_no_news_and_a_step_is() {
        let mut w = WallWatch::new();
        assert_eq!(w.look(), None, "the first look has nothing to compare with");
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(w.look(), None);
        // As if the wall clock had been set an hour ahead since the last look.
        let (wall, boot) = w.last.unwrap();
        w.last = Some((wall - Duration::from_secs(3600), boot));
        let step = w.look().unwrap();
        assert!((step - 3600.0).abs() < 1.0, "{step}");
        let (wall, boot) = w.last.unwrap();
        w.last = Some((wall + Duration::from_secs(600), boot));
        assert!((w.look().unwrap() + 600.0).abs() < 1.0);
    }

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
