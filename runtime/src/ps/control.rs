//! The job's side of its parameter servers: which servers hold which
//! shards, and what changes at a generation boundary. A new generation
//! first rolls every server's tables back to the step it starts from; then,
//! when servers were lost or added, shards are copied to the servers that
//! hold them from now on (from a surviving holder, as of that step) and
//! forgotten where they no longer belong, before any worker of the new
//! generation asks for a row.

use super::placement;
use super::server::Mark;
use super::service::Client;
use super::table::SHARDS;
use crate::job::spec::PsTopology;
use crate::worker::session::JobAuth;
use anyhow::{Context, Result, bail};
use std::collections::{BTreeMap, BTreeSet};

use super::service::JOB_CLIENT;

/// The servers a job's tables are on, and how many hold each shard.
pub struct PsControl {
    auth: JobAuth,
    topology: PsTopology,
    /// Connections to the servers of `topology`, kept between the job's
    /// looks and trims (made again when the servers change or one fails).
    kept: Option<(Vec<(u64, String)>, Client)>,
}

/// Shards whose every holder was lost: their rows are gone (the job goes
/// back to its newest checkpoint).
#[derive(Debug, thiserror::Error)]
#[error(
    "{shards} of {SHARDS} shards had all their holders among the servers lost ({lost:?}, {replicas} replica(s)): their rows are gone"
)]
pub struct ShardsLost {
    pub shards: usize,
    pub lost: Vec<u64>,
    pub replicas: usize,
}

/// What a change of servers did.
#[derive(Debug, Default, PartialEq)]
pub struct Moved {
    /// Rows copied, and the (from, to) pairs they went between.
    pub rows: usize,
    pub copies: Vec<(u64, u64)>,
}

/// Longest the job waits for a server's answer (a server wedged, not gone,
/// fails the request instead of holding the coordinator).
const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

/// The job's connections to `servers`.
fn job_client(servers: &[(u64, std::net::SocketAddr)], replicas: usize, auth: &JobAuth) -> Result<Client> {
    let mut c = Client::connect(servers, replicas, auth, JOB_CLIENT)?;
    c.set_timeout(ANSWER_WITHIN)?;
    Ok(c)
}

/// Waits, until `within` passes, for server `id` to answer the job at
/// `addr`: a sealed connection made with the job's secret, and its stats
/// naming it (not another server, nor another job's, at that address).
pub fn await_serving(auth: &JobAuth, id: u64, addr: &str, within: std::time::Duration) -> Result<()> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let tried = crate::net::resolve(addr).and_then(|at| {
            let mut c = job_client(&[(id, at)], 1, auth)?;
            Ok(c.stats()?.first().map(|s| s.server))
        });
        match tried {
            Ok(Some(said)) if said == id => return Ok(()),
            // Another server of the job's answers there: waiting will not change that.
            Ok(Some(other)) => bail!("the server at {addr} answers as parameter server {other}, not {id}"),
            Ok(None) => bail!("the server at {addr} answered with no stats: not parameter server {id}"),
            Err(e) if std::time::Instant::now() >= deadline => {
                return Err(
                    e.context(format!("parameter server {id} does not answer at {addr} within {within:?}"))
                );
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(200)),
        }
    }
}

/// The servers' addresses, resolved.
fn resolve_all(servers: &[(u64, String)]) -> Result<Vec<(u64, std::net::SocketAddr)>> {
    servers
        .iter()
        .map(|(id, a)| Ok((*id, crate::net::resolve(a).with_context(|| format!("parameter server {id}"))?)))
        .collect()
}

/// The holders of `shard` among `servers`: its owner, then its replicas.
fn holders(servers: &[u64], replicas: usize, shard: u32) -> Vec<u64> {
    placement::ranked(servers, shard).into_iter().take(replicas.max(1)).collect()
}

impl PsControl {
    pub fn new(auth: JobAuth, topology: PsTopology) -> Self {
        PsControl { auth, topology, kept: None }
    }

    pub fn topology(&self) -> &PsTopology {
        &self.topology
    }

    /// Says whether servers may still be added.
    pub fn set_room(&mut self, room: bool) {
        self.topology.room = room;
    }

    fn ids(&self) -> Vec<u64> {
        self.topology.servers.iter().map(|(id, _)| *id).collect()
    }

    /// A new generation as of `mark`, on the servers there are now: those
    /// of `lost` are gone, those of `leaving` give their shards up (copied
    /// from them) and go, those of `added` join. Fails, naming them, when a
    /// shard had no holder left ([`ShardsLost`]). `ahead`: the shards
    /// added servers were given while training went on ([`copy_ahead`]);
    /// of those they hold now, they get only the rows changed since (of the
    /// tables copied then); any other shard, or table, whole; those they do
    /// not hold after all are forgotten.
    pub fn reform(
        &mut self,
        mark: Mark,
        (lost, leaving): (&[u64], &[u64]),
        added: &[(u64, String)],
        ahead: Option<&Ahead>,
    ) -> Result<Moved> {
        let staying = |id: &u64| !lost.contains(id) && !leaving.contains(id);
        let mut after: Vec<(u64, String)> =
            self.topology.servers.iter().filter(|(id, _)| staying(id)).cloned().collect();
        after.extend(added.iter().cloned());
        if after.is_empty() {
            bail!("no parameter server left");
        }
        let now: Vec<u64> = after.iter().map(|(id, _)| *id).collect();
        let r = self.topology.replicas;
        let plan = plan(&self.ids(), &now, r, (lost, leaving));
        if !plan.lost.is_empty() {
            return Err(ShardsLost { shards: plan.lost.len(), lost: lost.to_vec(), replicas: r }.into());
        }
        // The servers that go on, and those leaving (their shards are copied from them).
        let reached: Vec<(u64, String)> = after
            .iter()
            .cloned()
            .chain(self.topology.servers.iter().filter(|(id, _)| leaving.contains(id)).cloned())
            .collect();
        let mut c = job_client(&resolve_all(&reached)?, r, &self.auth)?;
        c.enter_all(mark)?;
        let tables: BTreeSet<String> =
            c.stats()?.into_iter().flat_map(|s| s.tables).map(|t| t.name).collect();
        let mut moved = Moved::default();
        for ((from, to), shards) in &plan.copies {
            for table in &tables {
                // Rows changed since the copy are known only for a table it
                // copied, and only while the job has not gone back before it.
                let early = ahead
                    .filter(|a| a.tables.contains(table) && a.since <= mark.base)
                    .and_then(|a| Some((a.since, a.shards.get(to)?)));
                let (later, whole): (Vec<u32>, Vec<u32>) =
                    shards.iter().partition(|s| early.is_some_and(|(_, e)| e.binary_search(s).is_ok()));
                let since = early.map(|(since, _)| since);
                for (shards, since) in [(&later, since), (&whole, None)] {
                    if !shards.is_empty() {
                        moved.rows += c.copy_shards(table, (shards, since), mark.base, (*from, *to), mark)?;
                    }
                }
            }
            moved.copies.push((*from, *to));
        }
        for (server, shards) in &plan.drops {
            c.drop_shards(*server, shards)?;
        }
        // Shards copied ahead to a server that does not hold them after all
        // (the servers changed otherwise meanwhile).
        for (to, shards) in ahead.iter().flat_map(|a| &a.shards).filter(|(to, _)| now.contains(to)) {
            let extra: Vec<u32> =
                shards.iter().copied().filter(|s| !holders(&now, r, *s).contains(to)).collect();
            if !extra.is_empty() {
                c.drop_shards(*to, &extra)?;
            }
        }
        self.topology.servers = after;
        Ok(moved)
    }

    /// What [`copy_ahead`] needs to run on a thread of its own: the
    /// servers to join and those to leave.
    pub fn ahead_of(&self, (added, leaving): (&[(u64, String)], &[u64]), mark: Mark) -> AheadJob {
        let (topology, added, leaving) = (self.topology.clone(), added.to_vec(), leaving.to_vec());
        AheadJob { auth: self.auth.clone(), topology, added, leaving, mark }
    }

    /// Every server's tables and memory, and whether it was told to go;
    /// each forgets how to undo the steps before `trim`.
    pub fn stats(&mut self, trim: u64) -> Result<Vec<crate::ps::Stats>> {
        self.with_kept(|c| {
            c.trim_all(trim)?;
            c.stats()
        })
    }

    /// Every server forgets how to undo the steps before `step` (they are
    /// committed, and no checkpoint of an earlier step is still to come).
    pub fn trim(&mut self, step: u64) -> Result<()> {
        self.with_kept(|c| c.trim_all(step))
    }

    /// Runs `f` on the kept connections (made first where the servers
    /// changed); a failure drops them.
    fn with_kept<R>(&mut self, f: impl FnOnce(&mut Client) -> Result<R>) -> Result<R> {
        if self.kept.as_ref().is_none_or(|(servers, _)| *servers != self.topology.servers) {
            self.kept = None;
            let addrs = resolve_all(&self.topology.servers)?;
            let c = job_client(&addrs, self.topology.replicas, &self.auth)?;
            self.kept = Some((self.topology.servers.clone(), c));
        }
        let (_, c) = self.kept.as_mut().expect("just made");
        let r = f(c);
        if r.is_err() {
            self.kept = None;
        }
        r
    }

    /// Starts the tables over on the servers there are now (those of
    /// `gone` leave, those of `added` join): every table forgotten, to be
    /// made again from the checkpoint the job goes back to.
    pub fn reset(&mut self, gone: &[u64], added: &[(u64, String)]) -> Result<()> {
        let mut after: Vec<(u64, String)> =
            self.topology.servers.iter().filter(|(id, _)| !gone.contains(id)).cloned().collect();
        after.extend(added.iter().cloned());
        job_client(&resolve_all(&after)?, self.topology.replicas, &self.auth)?.reset_all()?;
        self.topology.servers = after;
        Ok(())
    }
}

/// The copies and drops a change of servers makes, and the shards it
/// leaves without a holder.
struct Plan {
    /// Per (from, to): the shards to copy.
    copies: BTreeMap<(u64, u64), Vec<u32>>,
    /// Per server: the shards it gives up.
    drops: BTreeMap<u64, Vec<u32>>,
    lost: BTreeSet<u32>,
}

/// The change from servers `before` to `now` (`r` holders a shard), those
/// of `gone` lost and those of `leaving` copied from before they go.
fn plan(before: &[u64], now: &[u64], r: usize, (gone, leaving): (&[u64], &[u64])) -> Plan {
    let mut p = Plan { copies: BTreeMap::new(), drops: BTreeMap::new(), lost: BTreeSet::new() };
    for shard in 0..SHARDS {
        let had: Vec<u64> = holders(before, r, shard).into_iter().filter(|s| !gone.contains(s)).collect();
        let has = holders(now, r, shard);
        let Some(&source) = had.first() else {
            p.lost.insert(shard);
            continue;
        };
        for to in has.iter().filter(|s| !had.contains(s)) {
            p.copies.entry((source, *to)).or_default().push(shard);
        }
        for from in had.iter().filter(|s| !has.contains(s) && !leaving.contains(s)) {
            p.drops.entry(*from).or_default().push(shard);
        }
    }
    p
}

/// Shards given ahead to the servers that will hold them after a change
/// of servers (some joining, some leaving), while training goes on.
#[derive(Clone, Debug, PartialEq)]
pub struct Ahead {
    /// The step their copies are of: the rows changed from it on are
    /// copied again when they join.
    pub since: u64,
    /// Per server, the shards it was given (in order).
    pub shards: BTreeMap<u64, Vec<u32>>,
    /// The tables copied: one made after the copy began (its rows restored
    /// from a checkpoint, or a table first used since) is copied whole.
    pub tables: BTreeSet<String>,
    /// Rows copied.
    pub rows: usize,
}

/// A copy ahead of a change of servers: the job's servers, those to join
/// and to leave, and the step (the committed one) the copy is of.
pub struct AheadJob {
    auth: JobAuth,
    topology: PsTopology,
    added: Vec<(u64, String)>,
    leaving: Vec<u64>,
    mark: Mark,
}

/// Gives each server the shards it will hold once the servers of
/// `job.added` have joined and those of `job.leaving` left, as of the job's
/// committed step, from their holders now; training goes on meanwhile (the
/// holders must keep what undoes the steps after that one until the change).
/// The tables are made on new servers as of the mark; they take the
/// generation they join as theirs. A server that holds a table already
/// keeps the rows of shards it does not hold yet beside it, untouched by
/// the steps until the change.
pub fn copy_ahead(job: AheadJob) -> Result<Ahead> {
    let AheadJob { auth, topology, added, leaving, mark } = job;
    let before: Vec<u64> = topology.servers.iter().map(|(id, _)| *id).collect();
    let now: Vec<u64> = before
        .iter()
        .copied()
        .filter(|id| !leaving.contains(id))
        .chain(added.iter().map(|(id, _)| *id))
        .collect();
    let plan = plan(&before, &now, topology.replicas, (&[], &leaving));
    let servers: Vec<(u64, String)> = topology.servers.iter().chain(&added).cloned().collect();
    let mut c = job_client(&resolve_all(&servers)?, topology.replicas, &auth)?;
    let tables: BTreeSet<String> = c.stats()?.into_iter().flat_map(|s| s.tables).map(|t| t.name).collect();
    let (mut rows, mut given) = (0, BTreeMap::<u64, Vec<u32>>::new());
    for ((from, to), shards) in &plan.copies {
        for table in &tables {
            rows += c.copy_shards(table, (shards, None), mark.base, (*from, *to), mark)?;
        }
        given.entry(*to).or_default().extend(shards);
    }
    given.values_mut().for_each(|s| s.sort_unstable());
    Ok(Ahead { since: mark.base, shards: given, tables, rows })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::{Init, Optimizer, PushTag, Server, Service, TableSpec};
    use edl_host_gpu::comm::auth::Secret;
    use std::{net::TcpListener, time::Duration};

    /// Table `t` of dimension `dim`, zeros and SGD at 1 (an update is minus its gradient).
    fn sgd_table(dim: usize) -> TableSpec {
        TableSpec { name: "t".into(), dim, optimizer: Optimizer::sgd(1.0), init: Init::Zeros, seed: 0 }
    }

    fn start(job: &JobAuth, id: u64) -> Service {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        Service::start(l, job.clone(), Server::new(id, None), Duration::from_secs(10)).unwrap()
    }

    /// A job's secret and three servers (ids 1..=3): the services, their
    /// ids and addresses as a topology lists them, and as clients dial them.
    type Three = (JobAuth, Vec<Service>, Vec<(u64, String)>, Vec<(u64, std::net::SocketAddr)>);

    fn three_servers() -> Three {
        let job = JobAuth { job: "ctr".into(), secret: Secret::generate().unwrap() };
        let services: Vec<Service> = (1..=3).map(|id| start(&job, id)).collect();
        let all = services.iter().zip(1..).map(|(s, id)| (id, s.addr().to_string())).collect();
        let addrs = services.iter().zip(1..).map(|(s, id)| (id, s.addr())).collect();
        (job, services, all, addrs)
    }

    #[test]
    fn a_server_given_its_shards_ahead_gets_only_the_rows_changed_since_and_holds_them_as_a_whole_copy_would()
    {
        let (job, services, all, addrs) = three_servers();
        let spec = sgd_table(2);
        let g1 = Mark { generation: 1, base: 0, committed: 0 };
        let mut w = Client::connect(&addrs[..2], 1, &job, 1).unwrap();
        w.declare(spec.clone(), g1, None).unwrap();
        let step = |w: &mut Client, step: u64, ids: &[u64]| {
            let grads: Vec<f32> = ids.iter().flat_map(|&i| [i as f32 + step as f32, 1.0]).collect();
            w.push("t", PushTag { mark: g1, step, rank: 0, world: 1 }, ids, &grads).unwrap();
        };
        let ids: Vec<u64> = (0..400).collect();
        step(&mut w, 0, &ids);
        step(&mut w, 1, &ids);
        // Server 3 is started and given its shards as of step 2 ...
        let topology = PsTopology { servers: all[..2].to_vec(), staleness: 0, replicas: 1, room: true };
        let mut control = PsControl::new(job.clone(), topology);
        let ahead = copy_ahead(control.ahead_of((&all[2..], &[]), Mark { base: 2, ..g1 })).unwrap();
        assert_eq!(ahead.since, 2);
        assert_eq!(ahead.shards.keys().collect::<Vec<_>>(), [&3]);
        assert!(ahead.rows > 0, "{ahead:?}");
        // ... while training goes on: some rows change, some are new.
        let changed: Vec<u64> = (0..40).chain(400..430).collect();
        step(&mut w, 2, &changed);
        step(&mut w, 3, &changed[10..]);
        let want = w.pull("t", g1, 4, &(0..430).collect::<Vec<_>>()).unwrap();
        // A step applied and then undone by the new generation (base 4).
        step(&mut w, 4, &ids);
        drop(w);
        let g2 = Mark { generation: 2, base: 4, committed: 2 };
        let moved = control.reform(g2, (&[], &[]), &all[2..], Some(&ahead)).unwrap();
        assert!(moved.rows > 0 && moved.rows < ahead.rows, "only what changed: {moved:?} after {ahead:?}");
        // Every row as a worker of the new generation reads it, wherever it is now.
        let mut w = Client::connect(&addrs, 1, &job, 1).unwrap();
        w.declare(spec, g2, None).unwrap();
        assert_eq!(w.pull("t", g2, 4, &(0..430).collect::<Vec<_>>()).unwrap(), want);
        assert!(!services[2].rows("t").is_empty(), "server 3 holds its shards");
    }

    #[test]
    fn a_server_given_shards_ahead_gets_the_others_whole_when_another_leaves_meanwhile() {
        let (job, _services, all, addrs) = three_servers();
        let spec = sgd_table(2);
        let g1 = Mark { generation: 1, base: 0, committed: 0 };
        let mut w = Client::connect(&addrs[..2], 1, &job, 1).unwrap();
        w.declare(spec.clone(), g1, None).unwrap();
        let ids: Vec<u64> = (0..600).collect();
        let grads: Vec<f32> = ids.iter().flat_map(|&i| [i as f32, 1.0]).collect();
        w.push("t", PushTag { mark: g1, step: 0, rank: 0, world: 1 }, &ids, &grads).unwrap();
        let want = w.pull("t", g1, 1, &ids).unwrap();
        let topology = PsTopology { servers: all[..2].to_vec(), staleness: 0, replicas: 1, room: true };
        let mut control = PsControl::new(job.clone(), topology);
        let ahead = copy_ahead(control.ahead_of((&all[2..], &[]), Mark { base: 1, ..g1 })).unwrap();
        // Server 1 is told to go before 3 joins: 3 takes shards of 1's it
        // was not given ahead, whole.
        let g2 = Mark { generation: 2, base: 1, committed: 1 };
        control.reform(g2, (&[], &[1]), &all[2..], Some(&ahead)).unwrap();
        let mut w2 = Client::connect(&addrs[1..], 1, &job, 1).unwrap();
        w2.declare(spec.clone(), g2, None).unwrap();
        assert_eq!(w2.pull("t", g2, 1, &ids).unwrap(), want, "every row as it was");
        // An export by a client that knows generation 1's servers is refused
        // by those that gave shards away in generation 2, instead of leaving
        // their rows out.
        w.know(spec);
        let e = format!("{:#}", w.export("t", 1, Some(1)).unwrap_err());
        assert!(
            e.contains("shards moved away from parameter server") && e.contains("after generation 1"),
            "{e}"
        );
    }

    #[test]
    fn a_server_leaving_has_its_shards_copied_ahead_and_only_the_rows_changed_since_at_the_boundary() {
        let (job, services, all, addrs) = three_servers();
        let spec = sgd_table(2);
        let g1 = Mark { generation: 1, base: 0, committed: 0 };
        let mut w = Client::connect(&addrs, 2, &job, 1).unwrap();
        w.declare(spec.clone(), g1, None).unwrap();
        let push = |w: &mut Client, step: u64, ids: &[u64]| {
            let grads: Vec<f32> = ids.iter().flat_map(|&i| [i as f32 - step as f32, 0.5]).collect();
            w.push("t", PushTag { mark: g1, step, rank: 0, world: 1 }, ids, &grads).unwrap();
        };
        let ids: Vec<u64> = (0..500).collect();
        push(&mut w, 0, &ids);
        // Server 3 is told to go: its shards go to their next holders as of
        // step 1, while steps 1 and 2 change some rows.
        let topology = PsTopology { servers: all.clone(), staleness: 0, replicas: 2, room: false };
        let mut control = PsControl::new(job.clone(), topology);
        let ahead = copy_ahead(control.ahead_of((&[], &[3]), Mark { base: 1, ..g1 })).unwrap();
        assert!(ahead.rows > 0 && !ahead.shards.contains_key(&3), "{ahead:?}");
        push(&mut w, 1, &ids[..60]);
        push(&mut w, 2, &ids[30..90]);
        let want = w.pull("t", g1, 3, &ids).unwrap();
        drop(w);
        // The undo records of the steps since the copy are kept (the job
        // pins them until the change).
        let g2 = Mark { generation: 2, base: 3, committed: 1 };
        let moved = control.reform(g2, (&[], &[3]), &[], Some(&ahead)).unwrap();
        assert!(moved.rows < ahead.rows, "only what changed: {moved:?} after {ahead:?}");
        // Server 3 gone: every row on the two left, as it was.
        drop(services.into_iter().nth(2));
        let mut w = Client::connect(&addrs[..2], 2, &job, 1).unwrap();
        w.declare(spec, g2, None).unwrap();
        assert_eq!(w.pull("t", g2, 3, &ids).unwrap(), want);
    }

    #[test]
    fn a_lost_server_s_shards_are_served_by_their_replicas_and_copied_to_new_ones() {
        let job = JobAuth { job: "ctr".into(), secret: Secret::generate().unwrap() };
        let services: Vec<Service> = (1..=3).map(|id| start(&job, id)).collect();
        let servers: Vec<(u64, String)> =
            services.iter().zip(1..).map(|(s, id)| (id, s.addr().to_string())).collect();
        let topology = PsTopology { servers: servers.clone(), staleness: 0, replicas: 2, room: false };
        let addrs: Vec<_> = services.iter().zip(1..).map(|(s, id)| (id, s.addr())).collect();
        let spec = sgd_table(2);
        let mark = Mark { generation: 1, base: 0, committed: 0 };
        let mut w = Client::connect(&addrs, 2, &job, 1).unwrap();
        w.declare(spec.clone(), mark, None).unwrap();
        let ids: Vec<u64> = (0..300).collect();
        let grads: Vec<f32> = ids.iter().flat_map(|&i| [i as f32, 1.0]).collect();
        w.push("t", PushTag { mark, step: 0, rank: 0, world: 1 }, &ids, &grads).unwrap();
        let want = w.pull("t", mark, 1, &ids).unwrap();
        // Every row is on two servers.
        let held: usize = services.iter().map(|s| s.rows("t").len()).sum();
        assert_eq!(held, 600);
        drop(w);

        // Server 2 is gone: its shards' replicas take over, and each gets a
        // second holder again.
        let mut control = PsControl::new(job.clone(), topology);
        let next = Mark { generation: 2, base: 1, committed: 1 };
        let moved = control.reform(next, (&[2], &[]), &[], None).unwrap();
        assert!(moved.rows > 0 && moved.copies.iter().all(|(f, t)| *f != 2 && *t != 2), "{moved:?}");
        assert_eq!(control.topology().servers.len(), 2);
        let left: Vec<_> = addrs.iter().filter(|(id, _)| *id != 2).cloned().collect();
        let mut w = Client::connect(&left, 2, &job, 1).unwrap();
        w.declare(spec, next, None).unwrap();
        assert_eq!(w.pull("t", next, 1, &ids).unwrap(), want, "every row as it was");
        for s in [&services[0], &services[2]] {
            assert_eq!(s.rows("t").len(), 300, "two servers, two replicas: every row on both");
        }
        // Server 3 too: with one server left and two replicas a shard has
        // one holder; none is lost.
        control.reform(Mark { generation: 3, base: 1, committed: 1 }, (&[3], &[]), &[], None).unwrap();
        assert_eq!(services[0].rows("t").len(), 300);
        // And the last one: nothing is left to hold the rows.
        let e = control
            .reform(Mark { generation: 4, base: 1, committed: 1 }, (&[1], &[]), &[], None)
            .unwrap_err();
        assert!(e.to_string().contains("no parameter server left"), "{e}");
    }

    #[test]
    fn a_server_added_takes_its_share_and_the_others_forget_it() {
        let job = JobAuth { job: "ctr".into(), secret: Secret::generate().unwrap() };
        let services: Vec<Service> = (1..=3).map(|id| start(&job, id)).collect();
        let addrs: Vec<_> = services.iter().zip(1..).map(|(s, id)| (id, s.addr())).collect();
        let spec = sgd_table(1);
        let mark = Mark { generation: 1, base: 0, committed: 0 };
        let mut w = Client::connect(&addrs[..2], 1, &job, 1).unwrap();
        w.declare(spec.clone(), mark, None).unwrap();
        let ids: Vec<u64> = (0..400).collect();
        w.push("t", PushTag { mark, step: 0, rank: 0, world: 1 }, &ids, &vec![1.0; 400]).unwrap();
        let want = w.pull("t", mark, 1, &ids).unwrap();
        drop(w);
        let two = PsTopology {
            servers: addrs[..2].iter().map(|(i, a)| (*i, a.to_string())).collect(),
            staleness: 0,
            replicas: 1,
            room: false,
        };
        let mut control = PsControl::new(job.clone(), two);
        let next = Mark { generation: 2, base: 1, committed: 1 };
        let moved = control.reform(next, (&[], &[]), &[(3, addrs[2].1.to_string())], None).unwrap();
        assert!(moved.copies.iter().all(|(_, to)| *to == 3), "{moved:?}");
        let on: Vec<usize> = services.iter().map(|s| s.rows("t").len()).collect();
        assert_eq!(on.iter().sum::<usize>(), 400, "each row on one server: {on:?}");
        assert!(on[2] > 80, "the new server took about a third: {on:?}");
        let mut w = Client::connect(&addrs, 1, &job, 1).unwrap();
        w.declare(spec, next, None).unwrap();
        assert_eq!(w.pull("t", next, 1, &ids).unwrap(), want);
    }

    /// A checkpoint of step `step` in `dir` holding `table` (and a dense
    /// array of one value); its path.
    fn checkpoint_with(dir: &std::path::Path, table: crate::ps::SavedTable, step: u64) -> std::path::PathBuf {
        use crate::checkpoint::{Checkpoints, Manifest};
        use crate::state::{Layout, TensorSpec};
        let layout = Layout::new(vec![TensorSpec::new("w", vec![1])]).unwrap();
        let manifest = Manifest {
            step,
            epoch: 0,
            cursor: 0,
            seed: 0,
            hyperparams: Default::default(),
            plugin_state: Default::default(),
            files: Default::default(),
            fence: None,
        };
        Checkpoints::new(dir, 2).save_with_tables(&layout, &[0.5], &[table], manifest).unwrap()
    }

    #[test]
    fn a_checkpoint_s_tables_come_back_on_every_holder_of_each_shard() {
        let job = JobAuth { job: "ctr".into(), secret: Secret::generate().unwrap() };
        let dir = tempfile::tempdir().unwrap();
        let spec = sgd_table(2);
        let ids: Vec<u64> = (0..200).collect();
        let saved = crate::ps::SavedTable {
            spec: spec.clone(),
            ids: ids.clone(),
            rows: ids.iter().flat_map(|&i| [i as f32, -(i as f32)]).collect(),
            updates: vec![1; 200],
        };
        let at = checkpoint_with(dir.path(), saved, 5);
        // Three servers, two replicas: every row on the two servers that hold its shard.
        let services: Vec<Service> = (1..=3).map(|id| start(&job, id)).collect();
        let addrs: Vec<_> = services.iter().zip(1..).map(|(s, id)| (id, s.addr())).collect();
        let mut w = Client::connect(&addrs, 2, &job, 1).unwrap();
        let mark = Mark { generation: 2, base: 5, committed: 5 };
        w.declare(spec.clone(), mark, Some((dir.path(), &at))).unwrap();
        let held: usize = services.iter().map(|s| s.rows("t").len()).sum();
        assert_eq!(held, 400, "each row on two servers");
        for s in &services {
            for (id, row) in s.rows("t") {
                assert_eq!(row, [id as f32, -(id as f32)], "server {}", s.stats().server);
            }
        }
        assert_eq!(w.pull("t", mark, 5, &[7, 199]).unwrap(), [7.0, -7.0, 199.0, -199.0]);
    }

    #[test]
    fn a_table_restored_after_a_copy_ahead_began_is_copied_whole_to_the_server_joining() {
        let (job, services, all, addrs) = three_servers();
        let dir = tempfile::tempdir().unwrap();
        let spec = sgd_table(2);
        let ids: Vec<u64> = (0..300).collect();
        let saved = crate::ps::SavedTable {
            spec: spec.clone(),
            ids: ids.clone(),
            rows: ids.iter().flat_map(|&i| [i as f32, 1.0]).collect(),
            updates: vec![1; 300],
        };
        let at = checkpoint_with(dir.path(), saved, 4);
        // The job just went back to its checkpoint: servers 1 and 2 hold no
        // table yet when server 3's copy ahead runs (as of step 4) ...
        let topology = PsTopology { servers: all[..2].to_vec(), staleness: 0, replicas: 1, room: true };
        let mut control = PsControl::new(job.clone(), topology);
        let g2 = Mark { generation: 2, base: 4, committed: 4 };
        let ahead = copy_ahead(control.ahead_of((&all[2..], &[]), g2)).unwrap();
        assert!(ahead.tables.is_empty() && ahead.rows == 0, "{ahead:?}");
        // ... then the workers declare the table from the checkpoint, and
        // one step changes a few rows.
        let mut w = Client::connect(&addrs[..2], 1, &job, 1).unwrap();
        w.declare(spec.clone(), g2, Some((dir.path(), &at))).unwrap();
        let grads: Vec<f32> = (0..10).flat_map(|_| [1.0, 1.0]).collect();
        w.push("t", PushTag { mark: g2, step: 4, rank: 0, world: 1 }, &ids[..10], &grads).unwrap();
        let want = w.pull("t", g2, 5, &ids).unwrap();
        drop(w);
        // Server 3 joins at step 5: its shards' rows all there, not only
        // the ten the step changed.
        // The coordinator keeps the undo records since the copy ahead's step.
        let g3 = Mark { generation: 3, base: 5, committed: 4 };
        let moved = control.reform(g3, (&[], &[]), &all[2..], Some(&ahead)).unwrap();
        assert!(moved.rows > 10, "{moved:?}");
        let mut w = Client::connect(&addrs, 1, &job, 1).unwrap();
        w.declare(spec, g3, None).unwrap();
        assert_eq!(w.pull("t", g3, 5, &ids).unwrap(), want);
        assert!(!services[2].rows("t").is_empty(), "server 3 holds its shards");
    }
}
