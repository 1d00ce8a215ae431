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
    /// The runs behind relays, by their host and their first worker's
    /// number on the relay (a host may have two runs: rank 0 stays first).
    by_host: HashMap<(u64, u64), usize>,
}

impl Routes {
    /// The runs of `members`, made again if they are not the ones kept.
    pub fn of<'a>(
        kept: &'a mut Option<Routes>,
        members: &[Worker],
        conns: &HashMap<u64, Outbox>,
    ) -> &'a Routes {
        let fresh = kept.as_ref().is_some_and(|r| r.members.iter().eq(members.iter().map(|m| &m.conn)));
        if !fresh {
            let runs = routes_of(members, conns);
            let by_host = runs
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.relay.as_ref().map(|x| ((x.host, x.conns[0]), i)))
                .collect();
            *kept = Some(Routes { members: members.iter().map(|m| m.conn).collect(), runs, by_host });
        }
        kept.as_ref().expect("made above")
    }

    /// The run of relay `host`, if its workers are `carried` (their
    /// numbers on the relay, in rank order).
    pub fn carried_by(&self, host: u64, carried: &[u64]) -> Option<&Run> {
        let run = &self.runs[*self.by_host.get(&(host, *carried.first()?))?];
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::proto::Link;
    use std::net::{TcpListener, TcpStream};

    /// A connected socket on loopback (its peer dropped: nothing is sent).
    fn socket() -> TcpStream {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        TcpStream::connect(l.local_addr().unwrap()).unwrap()
    }

    fn worker(conn: u64) -> Worker {
        Worker { id: conn, conn, pid: 1, since: std::time::Instant::now() }
    }

    #[test]
    fn ranks_behind_one_relay_are_one_run_and_a_report_is_matched_to_its_run_only() {
        let (a, b) = (RelayOut::new(Link::new(socket(), None)), RelayOut::new(Link::new(socket(), None)));
        let relayed = |host: u64, conn: u64, out: &RelayOut| Outbox::Relayed {
            conn,
            host,
            relay: out.clone(),
            name: format!("worker through relay {host}"),
        };
        // Rank 0 on host 10 first, a direct rank, host 11's two, host 10's other two.
        let mut conns = HashMap::new();
        conns.insert(1, relayed(10, 6, &a));
        conns.insert(2, Outbox::direct(Link::new(socket(), None)));
        conns.insert(3, relayed(11, 7, &b));
        conns.insert(4, relayed(11, 8, &b));
        conns.insert(5, relayed(10, 4, &a));
        conns.insert(6, relayed(10, 5, &a));
        let members: Vec<Worker> = (1..=6).map(worker).collect();
        let mut kept = None;
        let routes = Routes::of(&mut kept, &members, &conns);
        let shape: Vec<(usize, usize, Option<Vec<u64>>)> =
            routes.runs.iter().map(|r| (r.first, r.end, r.relay.as_ref().map(|x| x.conns.clone()))).collect();
        assert_eq!(
            shape,
            [(0, 1, Some(vec![6])), (1, 2, None), (2, 4, Some(vec![7, 8])), (4, 6, Some(vec![4, 5]))]
        );
        let ranks = |host, carried: &[u64]| routes.carried_by(host, carried).map(|r| (r.first, r.end));
        assert_eq!(ranks(10, &[6]), Some((0, 1)));
        assert_eq!(ranks(10, &[4, 5]), Some((4, 6)), "a host's second run is found too");
        assert_eq!(ranks(11, &[7, 8]), Some((2, 4)));
        // Another relay's numbers, a part of a run, or more than it: none.
        assert_eq!(ranks(10, &[7, 8]), None);
        assert_eq!(ranks(11, &[7]), None);
        assert_eq!(ranks(11, &[7, 8, 9]), None);
        assert_eq!(ranks(11, &[]), None);
        // Kept while the members stay, even when a connection ends; made
        // again when they change.
        conns.remove(&4);
        assert_eq!(Routes::of(&mut kept, &members, &conns).runs.len(), 4);
        let fewer = &members[..5];
        let runs = &Routes::of(&mut kept, fewer, &conns).runs;
        let shape: Vec<(usize, usize)> = runs.iter().map(|r| (r.first, r.end)).collect();
        assert_eq!(shape, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)], "rank 3 has no connection now");
    }
}
