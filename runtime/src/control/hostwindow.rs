//! A host's ranks as one reporter: the coordinator sends a relay one window
//! for consecutive ranks of its host (the steps once, the samples of those
//! ranks together), the relay gives each rank its share as the coordinator
//! would have, and sums the ranks' accounts of the window into one report.
//! The coordinator's work per window is then O(hosts), not O(ranks): one
//! window encoded and one report read per host.
//!
//! Summing keeps what the coordinator needs of each step: the positions
//! (consecutive ranks hold consecutive positions), the loss and the
//! program's metrics (each rank's is already weighted by its share), the
//! slowest rank's compute, the teachers' statistics, and the noise scale's
//! terms ([`NoiseTerms`]). A host whose ranks cannot be summed (a rank that
//! failed or was lost mid-window) has its ranks' reports passed on one by
//! one, in window order, as they would have come without the relay.

use crate::control::proto::{FromWorker, Generation, Share, StepDone, StepPlan, ToWorker};
use crate::coordinator::machine::noise::NoiseTerms;
use crate::distill::stats::TeacherRequests;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The coordinator to a relay: a new generation for consecutive ranks of
/// its host, the first of them rank `first` (`generation.rank`'s value is
/// not read: each rank is told its own).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostGeneration {
    pub conns: Vec<u64>,
    pub first: usize,
    pub generation: Generation,
}

impl HostGeneration {
    /// The generation's ranks behind the relay.
    pub fn ranks(&self) -> std::ops::Range<usize> {
        self.first..self.first + self.conns.len()
    }

    /// Each rank's `Generation` message, as the coordinator would have sent
    /// it; in the order of `conns`.
    pub fn split(&self) -> Vec<(u64, ToWorker)> {
        let each = |(i, &conn): (usize, &u64)| {
            let g = Generation { rank: self.first + i, ..self.generation.clone() };
            (conn, ToWorker::Generation(Box::new(g)))
        };
        self.conns.iter().enumerate().map(each).collect()
    }
}

/// The coordinator to a relay: one window for consecutive ranks of its host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostWindow {
    pub generation: u64,
    /// The generation's ranks.
    pub world: usize,
    /// The epoch's samples, by which shares are cut.
    pub samples: usize,
    pub steps: Vec<StepPlan>,
    /// The host's workers (their numbers on the relay) in rank order, the
    /// first of them rank `first`.
    pub conns: Vec<u64>,
    pub first: usize,
    /// Per step: the positions of those ranks together and the sample
    /// indices there.
    pub shares: Vec<Share>,
}

impl HostWindow {
    /// Each rank's `Steps` message, with its own share of every step, as
    /// the coordinator would have sent it; in the order of `conns`.
    pub fn split(&self) -> Result<Vec<(u64, ToWorker)>, String> {
        let mut out = Vec::with_capacity(self.conns.len());
        for (i, &conn) in self.conns.iter().enumerate() {
            let rank = self.first + i;
            let mut shares = Vec::with_capacity(self.steps.len());
            for (p, host) in self.steps.iter().zip(&self.shares) {
                let gb = p.hyper.global_batch.max(1) as usize;
                let r = crate::trainer::data::shard(p.cursor, gb, rank, self.world, self.samples);
                let (lo, hi) =
                    (r.start.checked_sub(host.start as usize), r.end.checked_sub(host.start as usize));
                let indices = match (lo, hi) {
                    (Some(lo), Some(hi)) if hi <= host.indices.len() && lo <= hi => &host.indices[lo..hi],
                    _ => {
                        return Err(format!(
                            "step {}: rank {rank}'s positions {r:?} are not among the host's {}..{}",
                            p.step, host.start, host.end
                        ));
                    }
                };
                shares.push(Share { start: r.start as u32, end: r.end as u32, indices: indices.to_vec() });
            }
            out.push((
                conn,
                ToWorker::Steps { generation: self.generation, steps: self.steps.clone(), shares },
            ));
        }
        Ok(out)
    }
}

/// A relay to the coordinator: the ranks of a host window reported it, as one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostDone {
    /// The host's workers (their numbers on the relay), in rank order.
    pub conns: Vec<u64>,
    /// The ranks' accounts summed.
    pub done: FromWorker,
}

/// A window sent to a host's ranks, and their accounts of it so far.
struct Gathering {
    conns: Vec<u64>,
    /// Per worker: its steps and set-up time.
    got: BTreeMap<u64, (Vec<StepDone>, f64)>,
}

/// The windows a relay's host ranks are working on, by generation, first
/// step and first worker (a host's ranks may be split in two runs).
#[derive(Default)]
pub struct Gatherings {
    open: BTreeMap<(u64, u64, u64), Gathering>,
    /// The newest generation a window came for.
    generation: u64,
    /// Workers gone (numbers are not reused), and workers that failed a
    /// step of a generation: a window of theirs cannot be summed, and
    /// their host's reports of it go up one by one, including those of
    /// windows sent ahead that the others finish later.
    gone: std::collections::BTreeSet<u64>,
    failed: std::collections::BTreeSet<(u64, u64)>,
}

/// What a relay sends up for a worker's message.
#[derive(Debug, PartialEq)]
pub enum Up {
    /// The worker's message, to go up as it is.
    Line(FromWorker),
    /// Held until the host's other ranks report the same window.
    Held,
    /// The host's window, every rank's account summed; and the accounts
    /// one by one, to go up instead where the sum is larger than a frame
    /// holds.
    Summed(HostDone, Vec<(u64, FromWorker)>),
    /// Reports held before, to go up one by one (each its worker's), ahead
    /// of the worker's message as it is.
    Release(Vec<(u64, FromWorker)>, FromWorker),
}

impl Gatherings {
    /// A host window was sent: its ranks' reports are gathered. Windows of
    /// earlier generations are dropped (none of theirs can commit now).
    pub fn expect(&mut self, w: &HostWindow) {
        let (Some(first), Some(&lead)) = (w.steps.first(), w.conns.first()) else { return };
        if w.generation > self.generation {
            self.generation = w.generation;
            self.open.retain(|(g, ..), _| *g >= w.generation);
            self.failed.retain(|(_, g)| *g >= w.generation);
            // Gone workers are in no window of a newer generation.
            self.gone.clear();
        }
        let g = Gathering { conns: w.conns.clone(), got: BTreeMap::new() };
        self.open.insert((w.generation, first.step, lead), g);
    }

    /// Worker `conn` said `msg`.
    pub fn take(&mut self, conn: u64, msg: FromWorker) -> Up {
        match msg {
            FromWorker::Done { generation, steps, setup_ms } => {
                let step = steps.first().map_or(u64::MAX, |s| s.step);
                let found = self
                    .open
                    .range((generation, step, 0)..=(generation, step, u64::MAX))
                    .find(|(_, g)| g.conns.contains(&conn))
                    .map(|(k, _)| *k);
                let as_it_is = |steps, setup_ms| FromWorker::Done { generation, steps, setup_ms };
                let Some((key, g)) = found.and_then(|k| Some((k, self.open.get_mut(&k)?))) else {
                    return Up::Line(as_it_is(steps, setup_ms));
                };
                let broken = |c: &u64| self.gone.contains(c) || self.failed.contains(&(*c, generation));
                if g.conns.iter().any(broken) {
                    let g = self.open.remove(&key).expect("found above");
                    return Up::Release(one_by_one(generation, g), as_it_is(steps, setup_ms));
                }
                g.got.insert(conn, (steps, setup_ms));
                if g.got.len() < g.conns.len() {
                    return Up::Held;
                }
                let mut g = self.open.remove(&key).expect("found above");
                match sum(generation, &g) {
                    Some(done) => {
                        Up::Summed(HostDone { conns: g.conns.clone(), done }, one_by_one(generation, g))
                    }
                    // Its own goes up as it came, after the others'.
                    None => {
                        let (steps, setup_ms) = g.got.remove(&conn).expect("put in above");
                        Up::Release(one_by_one(generation, g), as_it_is(steps, setup_ms))
                    }
                }
            }
            // A worker that failed ends its host's sums: what the others
            // reported goes up as theirs, before the failure.
            msg @ FromWorker::Failed { generation, .. } => {
                self.failed.insert((conn, generation));
                Up::Release(self.release(conn), msg)
            }
            msg => Up::Line(msg),
        }
    }

    /// Worker `conn` is gone: the reports held with its, one by one, in
    /// window order (and so are its host's later ones).
    pub fn gone(&mut self, conn: u64) -> Vec<(u64, FromWorker)> {
        self.gone.insert(conn);
        self.release(conn)
    }

    fn release(&mut self, conn: u64) -> Vec<(u64, FromWorker)> {
        let keys: Vec<(u64, u64, u64)> =
            self.open.iter().filter(|(_, g)| g.conns.contains(&conn)).map(|(k, _)| *k).collect();
        let mut out = Vec::new();
        for key in keys {
            let g = self.open.remove(&key).expect("listed above");
            out.extend(one_by_one(key.0, g));
        }
        out
    }
}

/// A gathering's reports, each its own worker's.
fn one_by_one(generation: u64, g: Gathering) -> Vec<(u64, FromWorker)> {
    g.got
        .into_iter()
        .map(|(conn, (steps, setup_ms))| (conn, FromWorker::Done { generation, steps, setup_ms }))
        .collect()
}

/// The ranks' accounts as one (`None` where they do not sum: other steps,
/// or positions that do not follow on from rank to rank).
fn sum(generation: u64, g: &Gathering) -> Option<FromWorker> {
    let reports: Vec<&(Vec<StepDone>, f64)> = g.conns.iter().map(|c| g.got.get(c)).collect::<Option<_>>()?;
    let (first, _) = reports.first()?;
    if reports.iter().any(|(s, _)| s.len() != first.len()) {
        return None;
    }
    let mut steps = Vec::with_capacity(first.len());
    for i in 0..first.len() {
        let each: Vec<&StepDone> = reports.iter().map(|(s, _)| s.get(i)).collect::<Option<_>>()?;
        steps.push(sum_step(&each)?);
    }
    let setup_ms = reports.iter().map(|(_, s)| *s).fold(0.0, f64::max);
    Some(FromWorker::Done { generation, steps, setup_ms })
}

fn sum_step(each: &[&StepDone]) -> Option<StepDone> {
    let (head, last) = (each.first()?, each.last()?);
    let follows = each.windows(2).all(|p| p[0].end == p[1].start && p[0].step == p[1].step);
    // A range that runs backwards is not summed: it goes up as it came, for
    // the coordinator to find it is not the rank's share.
    let ordered = each.iter().all(|d| d.start <= d.end);
    if !follows || !ordered || each.iter().any(|d| d.step != head.step || d.epoch != head.epoch) {
        return None;
    }
    let mut metrics: Vec<(String, f64)> = Vec::new();
    let mut calls: BTreeMap<String, TeacherRequests> = BTreeMap::new();
    let mut terms = NoiseTerms::default();
    let mut measured = true;
    for d in each {
        for (name, v) in &d.metrics {
            match metrics.iter_mut().find(|(n, _)| n == name) {
                Some((_, sum)) => *sum += v,
                None => metrics.push((name.clone(), *v)),
            }
        }
        for c in &d.teacher_calls {
            calls
                .entry(c.addr.clone())
                .or_insert_with(|| TeacherRequests { addr: c.addr.clone(), ..Default::default() })
                .merge(c.clone());
        }
        match (d.noise_terms, d.grad_sq) {
            (Some(t), _) => terms.add(t),
            (None, Some(sq)) => terms.add(NoiseTerms::of((d.end - d.start) as usize, sq)),
            (None, None) => measured = false,
        }
    }
    let n = each.len() as f64;
    Some(StepDone {
        step: head.step,
        epoch: head.epoch,
        start: head.start,
        end: last.end,
        loss: each.iter().map(|d| d.loss).sum(),
        // The host's step takes as long as its slowest rank.
        compute_ms: each.iter().map(|d| d.compute_ms).fold(0.0, f64::max),
        teacher_wait_ms: each.iter().map(|d| d.teacher_wait_ms).sum::<f64>() / n,
        metrics,
        teacher_calls: calls.into_values().collect(),
        grad_sq: None,
        noise_terms: measured.then_some(terms),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordinator::machine::noise::GradSq;
    use edl_plugin_sdk::Hyperparams;

    fn plans(n: u64) -> Vec<StepPlan> {
        let hyper = Hyperparams { global_batch: 10, local_batch: 10, lr: 0.1, momentum: 0.9 };
        (0..n).map(|s| StepPlan { step: s, epoch: 0, cursor: 10 * s as usize, hyper }).collect()
    }

    /// Ranks 1..4 of 4 on one host, over `samples` whose permutation is the identity.
    fn window(samples: usize) -> HostWindow {
        let steps = plans(2);
        let shares = steps
            .iter()
            .map(|p| {
                let lo = crate::trainer::data::shard(p.cursor, 10, 1, 4, samples).start;
                let hi = crate::trainer::data::shard(p.cursor, 10, 3, 4, samples).end;
                Share { start: lo as u32, end: hi as u32, indices: (lo as u32..hi as u32).collect() }
            })
            .collect();
        HostWindow { generation: 2, world: 4, samples, steps, conns: vec![7, 8, 9], first: 1, shares }
    }

    #[test]
    fn each_rank_of_a_host_generation_is_told_its_own_rank_and_the_rest_as_sent() {
        let g = Generation {
            generation: 4,
            rank: 0,
            world: 9,
            rendezvous: "10.0.0.1:7000".into(),
            rendezvous_key: "job/generation-4".into(),
            committed_steps: 120,
            init: Some("ckpt/step-0000000120".into()),
            ps: None,
        };
        let hg = HostGeneration { conns: vec![11, 12, 15], first: 3, generation: g.clone() };
        let told: Vec<(u64, usize)> = hg
            .split()
            .into_iter()
            .map(|(conn, msg)| match msg {
                ToWorker::Generation(mine) => {
                    assert_eq!(*mine, Generation { rank: mine.rank, ..g.clone() });
                    (conn, mine.rank)
                }
                other => panic!("a generation, not {other:?}"),
            })
            .collect();
        assert_eq!(told, [(11, 3), (12, 4), (15, 5)]);
    }

    #[test]
    fn each_rank_gets_the_share_the_coordinator_would_have_sent() {
        let w = window(15);
        let split = w.split().unwrap();
        assert_eq!(split.iter().map(|(c, _)| *c).collect::<Vec<_>>(), vec![7, 8, 9]);
        for (i, (_, msg)) in split.iter().enumerate() {
            let ToWorker::Steps { generation, steps, shares } = msg else { panic!("{msg:?}") };
            assert_eq!((*generation, steps), (2, &w.steps));
            for (p, s) in steps.iter().zip(shares) {
                let r = crate::trainer::data::shard(p.cursor, 10, i + 1, 4, 15);
                assert_eq!((s.start as usize, s.end as usize), (r.start, r.end));
                assert_eq!(s.indices, (r.start as u32..r.end as u32).collect::<Vec<_>>());
            }
        }
        // The epoch's end cuts the second step short (5 samples): shares follow.
        let ToWorker::Steps { shares, .. } = &split[2].1 else { unreachable!() };
        assert_eq!((shares[1].start, shares[1].end), (13, 15));
        let mut bad = window(15);
        bad.shares[0].start += 1;
        assert!(bad.split().unwrap_err().contains("not among the host's"));
    }

    fn done(conn: u64, w: &HostWindow, loss: f64) -> FromWorker {
        let rank = w.first + w.conns.iter().position(|c| *c == conn).unwrap();
        let steps = w
            .steps
            .iter()
            .map(|p| {
                let r = crate::trainer::data::shard(p.cursor, 10, rank, 4, w.samples);
                StepDone {
                    step: p.step,
                    epoch: p.epoch,
                    start: r.start as u32,
                    end: r.end as u32,
                    loss,
                    compute_ms: conn as f64,
                    teacher_wait_ms: 1.0,
                    metrics: vec![("acc".into(), loss / 2.0)],
                    teacher_calls: Vec::new(),
                    grad_sq: Some(GradSq { local: conn as f64, reduced: 1.0 }),
                    noise_terms: None,
                }
            })
            .collect();
        FromWorker::Done { generation: w.generation, steps, setup_ms: conn as f64 }
    }

    #[test]
    fn a_host_s_ranks_are_summed_into_one_report_once_all_are_in() {
        let w = window(40);
        let mut g = Gatherings::default();
        g.expect(&w);
        assert_eq!(g.take(7, done(7, &w, 0.1)), Up::Held);
        assert_eq!(g.take(9, done(9, &w, 0.3)), Up::Held);
        let Up::Summed(h, _) = g.take(8, done(8, &w, 0.2)) else { panic!("summed") };
        assert_eq!(h.conns, vec![7, 8, 9]);
        let FromWorker::Done { generation, steps, setup_ms } = h.done else { panic!() };
        assert_eq!((generation, setup_ms), (2, 9.0));
        let s = &steps[0];
        assert_eq!((s.start, s.end), (2, 10), "ranks 1..4 of step 0: positions 2..10");
        assert!((s.loss - 0.6).abs() < 1e-12 && (s.metrics[0].1 - 0.3).abs() < 1e-12);
        assert_eq!((s.compute_ms, s.teacher_wait_ms), (9.0, 1.0));
        let mut want = NoiseTerms::default();
        for (conn, rows) in [(7, 3), (8, 2), (9, 3)] {
            want.add(NoiseTerms::of(rows, GradSq { local: conn as f64, reduced: 1.0 }));
        }
        assert_eq!((s.grad_sq, s.noise_terms), (None, Some(want)));
        // Accounts that do not sum (a rank with other positions): the
        // others' go up one by one, the last one's as it came.
        g.expect(&w);
        g.take(7, done(7, &w, 0.1));
        g.take(8, done(8, &w, 0.2));
        let FromWorker::Done { generation, mut steps, setup_ms } = done(9, &w, 0.3) else { unreachable!() };
        steps[0].start += 1;
        let mine = FromWorker::Done { generation, steps, setup_ms };
        let Up::Release(held, own) = g.take(9, mine.clone()) else { panic!() };
        assert_eq!(held.iter().map(|(c, _)| *c).collect::<Vec<_>>(), vec![7, 8]);
        assert_eq!(own, mine, "its own after the others', as it came");
        // Nor do positions that run backwards (a worker's bad report),
        // which could not be counted in rows.
        g.expect(&w);
        g.take(7, done(7, &w, 0.1));
        g.take(8, done(8, &w, 0.2));
        let FromWorker::Done { generation, mut steps, setup_ms } = done(9, &w, 0.3) else { unreachable!() };
        steps[0].end = steps[0].start - 1;
        let backwards = FromWorker::Done { generation, steps, setup_ms };
        let Up::Release(held, own) = g.take(9, backwards.clone()) else { panic!("not summed") };
        assert_eq!((held.len(), own), (2, backwards));
        // A report for a window nobody gathers goes up as it came.
        assert_eq!(g.take(7, done(7, &w, 0.1)), Up::Line(done(7, &w, 0.1)));
    }

    #[test]
    fn a_rank_that_fails_or_is_lost_releases_the_others_reports_one_by_one() {
        let w = window(40);
        let mut g = Gatherings::default();
        g.expect(&w);
        g.take(7, done(7, &w, 0.1));
        g.take(8, done(8, &w, 0.2));
        let failed = FromWorker::Failed { generation: 2, step: 0, error: "boom".into(), cause: None };
        let Up::Release(held, own) = g.take(9, failed.clone()) else { panic!() };
        assert_eq!(own, failed);
        assert_eq!(held.iter().map(|(c, _)| *c).collect::<Vec<_>>(), vec![7, 8]);
        assert_eq!(held[0].1, done(7, &w, 0.1));

        // Later windows of the failed generation go up one by one too.
        let later = HostWindow { steps: plans(4)[2..].to_vec(), ..w.clone() };
        g.expect(&later);
        assert_eq!(g.take(7, done(7, &later, 0.1)), Up::Release(Vec::new(), done(7, &later, 0.1)));

        let mut g = Gatherings::default();
        g.expect(&w);
        g.take(8, done(8, &w, 0.2));
        assert_eq!(g.gone(9).len(), 1, "the one report held goes up");
        assert!(g.gone(9).is_empty());
        // A window sent ahead that the others finish after the loss.
        let ahead = HostWindow { steps: plans(6)[4..].to_vec(), ..w.clone() };
        g.expect(&ahead);
        assert_eq!(g.take(8, done(8, &ahead, 0.2)), Up::Release(Vec::new(), done(8, &ahead, 0.2)));

        // A newer generation's window drops the older's gatherings.
        g.expect(&w);
        g.take(8, done(8, &w, 0.2));
        g.expect(&HostWindow { generation: 3, ..w.clone() });
        assert_eq!(g.gone(8), Vec::new());
    }
}
