//! How the coordinator reaches a generation's ranks: consecutive ranks
//! behind one relay as one run (one window and one commit for them all),
//! every other rank on its own connection.

use crate::control::outbox::{Outbox, RelayOut};
use crate::coordinator::machine::membership::Worker;
use std::collections::HashMap;

/// Consecutive ranks `first..end`: behind one relay (which gets one window
/// and one commit for them all), or a single rank on its own connection.
pub struct Run {
    pub first: usize,
    pub end: usize,
    pub relay: Option<Relayed>,
}

/// A run's relay: its host's number, its connection, and the run's
/// workers' numbers on it, in rank order.
pub struct Relayed {
    host: u64,
    pub out: RelayOut,
    pub conns: Vec<u64>,
}

/// The ranks as runs, kept while the members and their connections stay
/// (checked by each rank's connection number, a comparison, not a lookup):
/// looking up every rank's connection at every window and commit was most
/// of the coordinator's work per step at thousands of ranks.
pub struct Routes {
    /// Each rank's connection, as the runs were made for.
    members: Vec<u64>,
    pub runs: Vec<Run>,
    /// The run of each relay's host.
    by_host: HashMap<u64, usize>,
}

impl Routes {
    /// The runs of `members`, made again if they are not the ones kept
    /// (a connection that ended clears them: see its handling).
    pub fn of<'a>(
        kept: &'a mut Option<Routes>,
        members: &[Worker],
        conns: &HashMap<u64, Outbox>,
    ) -> &'a Routes {
        let fresh = kept.as_ref().is_some_and(|r| r.members.iter().eq(members.iter().map(|m| &m.conn)));
        if !fresh {
            let runs = routes_of(members, conns);
            let by_host =
                runs.iter().enumerate().filter_map(|(i, r)| r.relay.as_ref().map(|x| (x.host, i))).collect();
            *kept = Some(Routes { members: members.iter().map(|m| m.conn).collect(), runs, by_host });
        }
        kept.as_ref().expect("made above")
    }

    /// The run of relay `host`, if its workers are `carried` (their
    /// numbers on the relay, in rank order).
    pub fn carried_by(&self, host: u64, carried: &[u64]) -> Option<&Run> {
        let run = &self.runs[*self.by_host.get(&host)?];
        run.relay.as_ref().is_some_and(|r| r.conns == carried).then_some(run)
    }
}

/// The ranks as runs.
fn routes_of(members: &[Worker], conns: &HashMap<u64, Outbox>) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for (rank, m) in members.iter().enumerate() {
        let Some((host, conn, out)) = conns.get(&m.conn).and_then(Outbox::relay) else {
            runs.push(Run { first: rank, end: rank + 1, relay: None });
            continue;
        };
        match runs.last_mut() {
            Some(Run { end, relay: Some(r), .. }) if r.host == host => {
                *end = rank + 1;
                r.conns.push(conn);
            }
            _ => runs.push(Run {
                first: rank,
                end: rank + 1,
                relay: Some(Relayed { host, out: out.clone(), conns: vec![conn] }),
            }),
        }
    }
    runs
}
