//! Relays whose writes are held, so that what the coordinator sends them
//! in one turn (a window's commit and the next window; a generation, its
//! first windows and the last generation's last commit) reaches each in
//! one write.

use crate::control::outbox::RelayOut;
use std::ops::Range;

/// Relays held (see [`RelayOut::hold`]), each with its run's ranks; each
/// is released when this is, or dropped on any path.
pub(super) struct HeldRelays(Vec<(RelayOut, Range<usize>)>);

impl HeldRelays {
    pub(super) fn hold(relays: Vec<(RelayOut, Range<usize>)>) -> Self {
        relays.iter().for_each(|(out, _)| out.hold());
        HeldRelays(relays)
    }

    /// Writes what each relay was sent meanwhile; returns the ranks behind
    /// those whose write failed (the relay is shut: they are lost).
    pub(super) fn release(mut self) -> Vec<(usize, String)> {
        self.release_each()
    }

    /// Lets the relays go without writing what they were sent meanwhile
    /// (a deposed coordinator's last words).
    pub(super) fn discard(mut self) {
        self.0.drain(..).for_each(|(out, _)| out.discard());
    }

    fn release_each(&mut self) -> Vec<(usize, String)> {
        let mut lost = Vec::new();
        for (out, ranks) in self.0.drain(..) {
            if let Err(why) = out.release() {
                lost.extend(ranks.map(|rank| (rank, why.clone())));
            }
        }
        lost
    }
}

impl Drop for HeldRelays {
    fn drop(&mut self) {
        // A failed write shuts the relay's connection: its reader reports it.
        self.release_each();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::frame::Frame;
    use crate::control::outbox::{failed_relay, relay_pair};

    #[test]
    fn a_relay_whose_held_write_fails_loses_its_run_s_ranks_and_no_other() {
        let (failed, why) = failed_relay();
        let (good, mut peer) = relay_pair();
        let lost = HeldRelays::hold(vec![(good.clone(), 0..2), (failed, 2..5)]).release();
        assert_eq!(lost, [(2, why.clone()), (3, why.clone()), (4, why)]);
        // Dropped unreleased (an error on the way), a relay is released too:
        // what it is sent next is written at once.
        drop(HeldRelays::hold(vec![(good.clone(), 0..2)]));
        good.send(&[Frame::Beat]).unwrap();
        let mut beat = Vec::new();
        Frame::Beat.encode(&mut beat);
        let mut got = vec![0u8; beat.len()];
        std::io::Read::read_exact(&mut peer, &mut got).expect("the relay's send was written");
        assert_eq!(got, beat);
    }
}
