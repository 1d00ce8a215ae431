//! The TCP ring: results equal a sequential sum for 1..8 ranks and awkward
//! sizes, as threads and as processes; a dead or stalled rank makes the
//! others fail within the timeout.

use edl_host_gpu::comm::{
    CommError, Communicator, LocalRendezvous, ReduceOp, Rendezvous, RendezvousServer, RingOptions,
    TcpRendezvous, TcpRing,
};
use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

fn opts(timeout_ms: u64) -> RingOptions {
    RingOptions {
        timeout: Duration::from_millis(timeout_ms),
        segment_bytes: 64 << 10,
        ..RingOptions::default()
    }
}

/// Runs `f` on each rank of a world of `n` threads sharing one rendezvous.
fn with_ring<T: Send>(n: usize, o: RingOptions, f: impl Fn(&mut TcpRing) -> T + Sync) -> Vec<T> {
    let rdv = LocalRendezvous::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (rdv, o, f) = (rdv.clone(), o.clone(), &f);
                s.spawn(move || {
                    let mut ring = TcpRing::connect(rank, n, &rdv, o).unwrap();
                    f(&mut ring)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn input(rank: usize, len: usize) -> Vec<f32> {
    // Small integers: sums are exact in f32, so results compare bit for bit.
    (0..len).map(|i| ((i * 7 + rank * 13) % 17) as f32).collect()
}

fn sequential_sum(n: usize, len: usize) -> Vec<f32> {
    let mut sum = vec![0f32; len];
    for r in 0..n {
        for (s, v) in sum.iter_mut().zip(input(r, len)) {
            *s += v;
        }
    }
    sum
}

#[test]
fn all_reduce_equals_a_sequential_sum() {
    for n in 1..=8usize {
        let mut sizes = vec![0, 1, n.saturating_sub(1), 1_000_003];
        if n == 2 || n == 4 || n == 8 {
            sizes.push(4 << 20); // 16 MiB of f32
        }
        for &len in &sizes {
            let want = sequential_sum(n, len);
            let results = with_ring(n, opts(20_000), |ring| {
                let mut buf = input(ring.rank(), len);
                ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                buf
            });
            for (rank, got) in results.iter().enumerate() {
                assert!(got == &want, "n={n} len={len} rank={rank}: differs from the sequential sum");
            }
        }
    }
}

#[test]
fn average_broadcast_and_barrier() {
    let n = 5;
    let out = with_ring(n, opts(10_000), |ring| {
        let r = ring.rank() as f32;
        let mut avg = vec![r; 1001];
        ring.all_reduce(&mut avg, ReduceOp::Average).unwrap();
        let mut b =
            if ring.rank() == 3 { (0..70_001).map(|i| i as f32).collect() } else { vec![0f32; 70_001] };
        ring.broadcast(&mut b, 3).unwrap();
        ring.barrier().unwrap();
        (avg, b)
    });
    for (avg, b) in out {
        assert!(avg.iter().all(|&v| v == 2.0));
        assert!(b.iter().enumerate().all(|(i, &v)| v == i as f32));
    }
}

#[test]
fn a_stalled_rank_makes_the_others_time_out() {
    let n = 4;
    let start = Instant::now();
    let results = with_ring(n, opts(1_000), |ring| {
        if ring.rank() == 2 {
            std::thread::sleep(Duration::from_millis(2_500));
            return None;
        }
        let mut buf = vec![1f32; 100_000];
        let t = Instant::now();
        let r = ring.all_reduce(&mut buf, ReduceOp::Sum);
        let again = ring.all_reduce(&mut buf, ReduceOp::Sum);
        Some((r, t.elapsed(), again))
    });
    for (rank, res) in results.into_iter().enumerate() {
        let Some((first, took, again)) = res else { continue };
        let err = first.expect_err("an all-reduce with a stalled rank must fail");
        assert!(
            matches!(err, CommError::Timeout { .. } | CommError::PeerClosed { .. }),
            "rank {rank}: {err}"
        );
        assert!(took < Duration::from_millis(2_400), "rank {rank} took {took:?}");
        assert!(
            matches!(again, Err(CommError::Broken { .. })),
            "rank {rank}: a failed ring must refuse further use"
        );
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn rendezvous_server_serves_several_generations() {
    let server = RendezvousServer::start("127.0.0.1:0").unwrap();
    for generation in 0..2 {
        let n = 3;
        let rdv = TcpRendezvous::new(server.addr(), format!("job/{generation}"));
        let out: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|rank| {
                    let rdv = rdv.clone();
                    s.spawn(move || {
                        let mut ring = TcpRing::connect(rank, n, &rdv, opts(10_000)).unwrap();
                        let mut buf = vec![rank as f32 + 1.0; 10];
                        ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                        buf
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(out.iter().all(|b| b.iter().all(|&v| v == 6.0)));
    }
}

#[test]
fn a_registration_naming_a_huge_world_is_refused_and_the_server_serves_on() {
    use std::io::{Read, Write};
    let server = RendezvousServer::start("127.0.0.1:0").unwrap();
    server.set_max_world(8);
    let frame = |s: &mut std::net::TcpStream, b: &[u8]| {
        s.write_all(&(b.len() as u32).to_le_bytes()).unwrap();
        s.write_all(b).unwrap();
    };
    for world in [u32::MAX, 9] {
        let mut c = std::net::TcpStream::connect(server.addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        frame(&mut c, b"job/x");
        let header: Vec<u8> = [0u32.to_le_bytes(), world.to_le_bytes()].concat();
        frame(&mut c, &header);
        frame(&mut c, b"v");
        // Refused: the server closes the connection without an answer.
        let mut buf = [0u8; 4];
        assert_eq!(c.read(&mut buf).unwrap_or(0), 0, "a world of {world} was taken");
    }
    // The server is alive and serves a world within the bound.
    let rdv = TcpRendezvous::new(server.addr(), "job/ok");
    let got: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let rdv = rdv.clone();
                s.spawn(move || rdv.exchange(rank, 2, vec![rank as u8], Duration::from_secs(30)).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(got.iter().all(|v| *v == vec![vec![0u8], vec![1u8]]), "{got:?}");
}

// ---- ranks as processes: this test binary re-runs itself as each rank ----

const CHILD: &str = "EDL_RING_CHILD";

/// The body of a child rank (`EDL_RING_CHILD=addr,key,rank,world,mode`).
#[test]
#[ignore = "run by the process tests as a child rank"]
fn ring_child_rank() {
    let Ok(spec) = std::env::var(CHILD) else { return };
    let parts: Vec<&str> = spec.split(',').collect();
    let (addr, key, rank, world, mode) =
        (parts[0].parse().unwrap(), parts[1], parts[2].parse().unwrap(), parts[3].parse().unwrap(), parts[4]);
    let rdv = TcpRendezvous::new(addr, key);
    let mut ring = TcpRing::connect(rank, world, &rdv, opts(3_000)).unwrap();
    let len = 1_000_003;
    match mode {
        "once" => {
            let mut buf = input(rank, len);
            ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            let want = sequential_sum(world, len);
            assert!(buf == want);
            println!("ok");
        }
        _ => loop {
            let mut buf = vec![1f32; 4 << 20];
            match ring.all_reduce(&mut buf, ReduceOp::Sum) {
                Ok(()) => println!("round"),
                Err(e) => {
                    println!("error: {e}");
                    std::process::exit(3);
                }
            }
        },
    }
}

fn spawn_ranks(world: usize, mode: &str) -> Vec<std::process::Child> {
    let server = RendezvousServer::start("127.0.0.1:0").unwrap();
    // The server's thread serves for as long as this test process lives.
    let addr = server.addr();
    (0..world)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "comm::ring_child_rank", "--ignored", "--nocapture", "--test-threads=1"])
                .env(CHILD, format!("{addr},{mode}-{world},{rank},{world},{mode}"))
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect()
}

#[test]
fn ranks_in_separate_processes_agree() {
    for world in [2, 3] {
        for mut child in spawn_ranks(world, "once") {
            let out = BufReader::new(child.stdout.take().unwrap())
                .lines()
                .map_while(Result::ok)
                .collect::<Vec<_>>();
            assert!(child.wait().unwrap().success() && out.iter().any(|l| l == "ok"), "{out:?}");
        }
    }
}

#[test]
fn killing_a_rank_mid_operation_fails_the_others_within_the_timeout() {
    let world = 4;
    let mut children = spawn_ranks(world, "loop");
    // Wait until rank 0 has completed a round: everyone is mid-way through the next.
    let mut first = BufReader::new(children[0].stdout.take().unwrap());
    let mut line = String::new();
    while line.trim() != "round" {
        line.clear();
        assert!(first.read_line(&mut line).unwrap() > 0, "rank 0 ended before completing a round");
    }
    children[2].kill().unwrap(); // SIGKILL
    let killed_at = Instant::now();
    let _ = children[2].wait();
    let mut readers: Vec<Option<Box<dyn BufRead>>> = children
        .iter_mut()
        .map(|c| c.stdout.take().map(|s| Box::new(BufReader::new(s)) as Box<dyn BufRead>))
        .collect();
    readers[0] = Some(Box::new(first));
    for (rank, child) in children.iter_mut().enumerate() {
        if rank == 2 {
            continue;
        }
        let status = child.wait().unwrap();
        let took = killed_at.elapsed();
        let out: Vec<String> = readers[rank].take().unwrap().lines().map_while(Result::ok).collect();
        assert_eq!(status.code(), Some(3), "rank {rank} must fail, not succeed: {out:?}");
        assert!(out.last().is_some_and(|l| l.starts_with("error:")), "rank {rank}: {out:?}");
        assert!(took < Duration::from_secs(8), "rank {rank} failed only after {took:?}");
    }
}

mod secret {
    use super::*;
    use edl_host_gpu::comm::{
        Rendezvous,
        auth::{self, AuthError, JobAuth, Secret},
    };
    use std::{net::TcpStream, sync::Mutex};

    fn job() -> JobAuth {
        JobAuth { job: "j".into(), secret: Secret::generate().unwrap() }
    }

    /// A rendezvous that, once the ranks' addresses are known, has strangers
    /// try rank 1's listener before rank 0 links to it.
    struct Spy {
        inner: LocalRendezvous,
        strangers: Vec<(JobAuth, u64)>,
        refusals: Mutex<Vec<AuthError>>,
    }

    impl Rendezvous for Spy {
        fn exchange(
            &self,
            rank: usize,
            world: usize,
            mine: Vec<u8>,
            t: Duration,
        ) -> Result<Vec<Vec<u8>>, CommError> {
            let all = self.inner.exchange(rank, world, mine, t)?;
            if rank == 0 {
                let addr: std::net::SocketAddr = String::from_utf8_lossy(&all[1]).parse().unwrap();
                for (a, generation) in &self.strangers {
                    let mut s = TcpStream::connect(addr).unwrap();
                    let e = auth::connect(&mut s, &a.secret, &a.claim("ring", *generation, 0)).unwrap_err();
                    self.refusals.lock().unwrap().push(e);
                }
            }
            Ok(all)
        }
    }

    #[test]
    fn a_ring_link_needs_the_secret_and_the_generation_and_strays_do_not_stop_the_ring() {
        let a = job();
        let spy = Spy {
            inner: LocalRendezvous::new(),
            strangers: vec![(job(), 5), (a.clone(), 4)],
            refusals: Mutex::new(Vec::new()),
        };
        let o = RingOptions { auth: Some((a.clone(), 5)), ..opts(10_000) };
        let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let (spy, o) = (&spy, o.clone());
                    s.spawn(move || {
                        let mut ring = TcpRing::connect(rank, 2, spy, o).unwrap();
                        let mut buf = vec![rank as f32 + 1.0; 1000];
                        ring.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                        buf
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(sums.iter().all(|b| b.iter().all(|&v| v == 3.0)), "the ring works after refusing the strays");
        let refusals = spy.refusals.into_inner().unwrap();
        assert_eq!(refusals[0], AuthError::WrongSecret);
        assert_eq!(refusals[1], AuthError::Refused("generation 4 is over (the job is at 5)".into()));
    }

    #[test]
    fn a_ring_of_proven_links_sums_and_broadcasts_encrypted_and_authenticated_only() {
        for encrypt in [true, false] {
            let a = job();
            let rdv = LocalRendezvous::new();
            // Segments that are no multiple of a frame, a buffer of many frames.
            let o = RingOptions { auth: Some((a, 1)), encrypt, segment_bytes: 100_004, ..opts(10_000) };
            let n = 300_001;
            let got: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..3)
                    .map(|rank| {
                        let (rdv, o) = (rdv.clone(), o.clone());
                        s.spawn(move || {
                            let mut ring = TcpRing::connect(rank, 3, &rdv, o).unwrap();
                            let mut sum: Vec<f32> = (0..n).map(|i| (i % 97) as f32 + rank as f32).collect();
                            ring.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
                            let mut from_1 = vec![rank as f32; n];
                            ring.broadcast(&mut from_1, 1).unwrap();
                            (sum, from_1)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (sum, from_1) in got {
                assert!(sum.iter().enumerate().all(|(i, &v)| v == 3.0 * (i % 97) as f32 + 3.0), "{encrypt}");
                assert!(from_1.iter().all(|&v| v == 1.0), "{encrypt}");
            }
        }
    }

    #[test]
    fn the_rendezvous_admits_only_the_job_s_current_generation() {
        let a = job();
        let server = RendezvousServer::start_with("127.0.0.1:0", Some(a.clone())).unwrap();
        server.set_generation(3);
        let t = Duration::from_secs(10);
        let stranger = TcpRendezvous::new(server.addr(), "j/3").with_auth(job(), 3);
        let e = stranger.exchange(0, 1, b"x".to_vec(), t).unwrap_err().to_string();
        assert!(e.contains("the peer does not know the job's secret"), "{e}");
        let anonymous = TcpRendezvous::new(server.addr(), "j/3");
        let e = anonymous.exchange(0, 1, b"x".to_vec(), t).unwrap_err().to_string();
        assert!(e.contains(&server.addr().to_string()), "{e}");
        let stale = TcpRendezvous::new(server.addr(), "j/2").with_auth(a.clone(), 2);
        let e = stale.exchange(0, 1, b"x".to_vec(), t).unwrap_err().to_string();
        assert!(e.contains("generation 2 is over (the job is at 3)"), "{e}");
        let member = TcpRendezvous::new(server.addr(), "j/3").with_auth(a, 3);
        assert_eq!(member.exchange(0, 1, b"x".to_vec(), t).unwrap(), vec![b"x".to_vec()]);
    }

    /// A rendezvous for rank 0 alone: rank 1's address is a listener that
    /// never answers, and 50 strangers connect to rank 0's listener and say
    /// nothing, as the ring starts.
    struct Flood {
        silent: std::net::TcpListener,
        strangers: Mutex<Vec<TcpStream>>,
    }

    impl Rendezvous for Flood {
        fn exchange(
            &self,
            _: usize,
            _: usize,
            mine: Vec<u8>,
            _: Duration,
        ) -> Result<Vec<Vec<u8>>, CommError> {
            let addr: std::net::SocketAddr = String::from_utf8_lossy(&mine).parse().unwrap();
            let mut s = self.strangers.lock().unwrap();
            for _ in 0..50 {
                s.push(TcpStream::connect(addr).unwrap());
            }
            Ok(vec![mine, self.silent.local_addr().unwrap().to_string().into_bytes()])
        }
    }

    #[test]
    fn strangers_that_keep_coming_do_not_hold_the_ring_past_its_deadline() {
        let flood = std::sync::Arc::new(Flood {
            silent: std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
            strangers: Mutex::new(Vec::new()),
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let f = flood.clone();
        std::thread::spawn(move || {
            let _ = tx.send(TcpRing::connect(0, 2, &*f, opts(1500)).map(|_| ()));
        });
        // Each stranger may hold a link for a moment; 50 of them, one after
        // the other, would hold it for over a minute.
        let got = rx.recv_timeout(Duration::from_secs(60)).expect("the ring set-up ended");
        match got {
            Err(CommError::Timeout { op: "accept", .. }) => {}
            other => panic!("expected the set-up to time out, got {other:?}"),
        }
    }
}
