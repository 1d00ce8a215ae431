//! One step of a sparse model on a parameter server: the pull of a batch's
//! rows and the push of their gradients, for the two tables of the CTR
//! example (`wide`, 1 float a row, and `deep`, 8), per-row Adam, on a
//! batch of 128 Criteo-shaped rows (26 fields, each Zipf(1.2) over 20,000
//! values, as `examples/ctr/criteo.py` makes them).
//!
//!     cargo bench -p edl-benches --bench ps_server
//!
//! - `server`: the server's state alone (`ps::Server`), no I/O;
//! - `loopback`: a worker's client and a server (`ps::Service`) over a
//!   sealed loopback connection, the pushes answered as each is sent;
//! - `loopback-pipelined`: the same with the pushes' answers read at the
//!   step's end (`Client::push_later` / `Client::settle`);
//! - `loopback-pipelined-2-servers`, `-4-servers`: the same client with the
//!   tables' shards over two and four servers (each its own threads), asked
//!   at once: what more servers give a worker whose steps wait on them.
//!
//! The tables are warmed first (every id of 400 batches made), so a step
//! reads and updates rows that exist, as a job past its first epoch does.

use criterion::{Criterion, criterion_group, criterion_main};
use edl_runtime::ps::{Client, Init, Mark, Optimizer, PushTag, Server, Service, TableSpec};
use edl_runtime::worker::session::{JobAuth, Secret};
use std::time::Duration;

const FIELDS: u64 = 26;
const VOCAB: u64 = 20_000;
const BATCH: usize = 128;
const WARM: usize = 400;

/// A small seeded generator (xorshift64*): the bench's batches, the same each run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in (0, 1).
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

/// Zipf(1.2) over `0..VOCAB` by inverse transform on the cumulative weights.
struct Zipf(Vec<f64>);

impl Zipf {
    fn new() -> Zipf {
        let mut acc = 0.0;
        let cdf: Vec<f64> = (1..=VOCAB)
            .map(|k| {
                acc += (k as f64).powf(-1.2);
                acc
            })
            .collect();
        Zipf(cdf.iter().map(|c| c / acc).collect())
    }

    fn draw(&self, rng: &mut Rng) -> u64 {
        let u = rng.unit();
        self.0.partition_point(|&c| c < u) as u64
    }
}

/// `n` batches' ids (`BATCH * FIELDS` each, field-major ids).
fn batches(n: usize, seed: u64) -> Vec<Vec<u64>> {
    let (zipf, mut rng) = (Zipf::new(), Rng(seed | 1));
    (0..n)
        .map(|_| {
            (0..BATCH)
                .flat_map(|_| (0..FIELDS).map(|f| f * VOCAB + zipf.draw(&mut rng)).collect::<Vec<_>>())
                .collect()
        })
        .collect()
}

fn tables() -> [TableSpec; 2] {
    let adam = Optimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 };
    [
        TableSpec { name: "wide".into(), dim: 1, optimizer: adam, init: Init::Zeros, seed: 0 },
        TableSpec {
            name: "deep".into(),
            dim: 8,
            optimizer: adam,
            init: Init::Uniform { scale: 0.05 },
            seed: 0,
        },
    ]
}

/// Step `step` of generation 1, every step before it committed.
fn mark(step: u64) -> Mark {
    Mark { generation: 1, base: 0, committed: step }
}

fn tag(step: u64) -> PushTag {
    PushTag { mark: mark(step), step, rank: 0, world: 1 }
}

/// A step on the server alone: each table pulled and pushed, its ids
/// once each (as a worker's client sends them).
fn server_step(s: &mut Server, step: u64, ids: &[u64]) {
    let mut seen = std::collections::HashSet::new();
    let ids: Vec<u64> = ids.iter().copied().filter(|id| seen.insert(*id)).collect();
    let ids = &ids[..];
    for t in tables() {
        let rows = s.pull(&t.name, 1, mark(step), step, ids).expect("pull").expect("applied");
        let grads: Vec<f32> = rows.iter().map(|w| 0.01 * w + 0.001).collect();
        s.push(&t.name, 1, tag(step), ids.to_vec(), grads).expect("push");
    }
}

/// A step through a client: each table pulled and pushed; `later`: the
/// pushes' answers read once both are sent.
fn client_step(c: &mut Client, step: u64, ids: &[u64], later: bool) {
    for t in tables() {
        let rows = c.pull(&t.name, mark(step), step, ids).expect("pull");
        let grads: Vec<f32> = rows.iter().map(|w| 0.01 * w + 0.001).collect();
        if later {
            c.push_later(&t.name, tag(step), ids, &grads).expect("push");
        } else {
            c.push(&t.name, tag(step), ids, &grads).expect("push");
        }
    }
    if later {
        c.settle().expect("the pushes' answers");
    }
}

fn bench(c: &mut Criterion) {
    let warm = batches(WARM, 7);
    let steps = batches(64, 11);
    let unique =
        steps.iter().map(|b| b.iter().collect::<std::collections::BTreeSet<_>>().len()).sum::<usize>()
            / steps.len();
    eprintln!("ps_server: {} ids a batch, {unique} distinct on average", BATCH as u64 * FIELDS);
    let mut g = c.benchmark_group("ps_step");
    g.sample_size(30).measurement_time(Duration::from_secs(8));

    let mut server = Server::new(1, None);
    tables().into_iter().for_each(|t| server.declare(1, t, mark(0)).expect("declare"));
    let mut step = 0u64;
    for ids in &warm {
        server_step(&mut server, step, ids);
        step += 1;
    }
    g.bench_function("server", |b| {
        b.iter(|| {
            server_step(&mut server, step, &steps[step as usize % steps.len()]);
            step += 1;
        })
    });

    for (servers, later) in [(1, false), (1, true), (2, true), (4, true)] {
        let auth = JobAuth { job: "bench".into(), secret: Secret::generate().expect("a secret") };
        let services: Vec<Service> = (1..=servers)
            .map(|id| {
                let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
                Service::start(listener, auth.clone(), Server::new(id, None), Duration::from_secs(60))
                    .expect("serve")
            })
            .collect();
        let at: Vec<(u64, std::net::SocketAddr)> =
            services.iter().zip(1..).map(|(s, id)| (id, s.addr())).collect();
        let mut client = Client::connect(&at, 1, &auth, 1).expect("connect");
        tables().into_iter().for_each(|t| client.declare(t, mark(0), None).expect("declare"));
        let mut step = 0u64;
        for ids in &warm {
            client_step(&mut client, step, ids, later);
            step += 1;
        }
        let name = match (servers, later) {
            (1, false) => "loopback".to_string(),
            (1, true) => "loopback-pipelined".to_string(),
            (n, _) => format!("loopback-pipelined-{n}-servers"),
        };
        g.bench_function(name, |b| {
            b.iter(|| {
                client_step(&mut client, step, &steps[step as usize % steps.len()], later);
                step += 1;
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
