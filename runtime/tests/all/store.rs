//! The store, in memory, in a real Redis and in a real three-member etcd
//! cluster, each started by the test itself: the same behaviour from all,
//! leases, fencing tokens, watchers, a Redis restart in the middle, and an
//! etcd cluster losing its leader.

use edl_runtime::store::{AnyStore, Cas, Change, Lease, MemoryStore, RedisStore, Store, keys, watch};
use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

/// A redis-server of this test's own on a free loopback port.
pub struct RedisServer {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    password: Option<String>,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// A server that wants `password` from every client.
    pub fn start_with(password: Option<&str>) -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let password = password.map(str::to_string);
        let mut s = RedisServer { port, dir: tempfile::tempdir().unwrap(), child: None, password };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let bin =
            std::env::var_os("EDL_REDIS_SERVER").map(PathBuf::from).unwrap_or_else(|| "redis-server".into());
        let child = Command::new(&bin)
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string(), "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(self.password.iter().flat_map(|p| ["--requirepass", p]))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {}: {e}. The store tests need redis-server (.ci/run installs it: apt-get install redis-server)", bin.display())
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not listen on port {}", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}/", self.port),
            None => format!("redis://127.0.0.1:{}/", self.port),
        }
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the server: while frozen it
    /// holds its connections and answers nothing, as a server cut off by
    /// the network does.
    pub fn freeze(&self, frozen: bool) {
        if let Some(c) = &self.child {
            let sig = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: signalling our own child, which is not reaped.
            unsafe { libc::kill(c.id() as libc::pid_t, sig) };
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// An etcd cluster of this test's own (Debian's etcd-server), its members
/// on free loopback ports, or on one network-namespace host.
pub struct EtcdCluster {
    dir: tempfile::TempDir,
    /// The address the members listen on.
    ip: String,
    /// The namespace host they run on (None: this machine's loopback).
    host: Option<String>,
    /// Each member's name, client port, peer port and process.
    members: Vec<(String, u16, u16, Option<Child>)>,
}

impl EtcdCluster {
    pub fn start(n: usize) -> Self {
        let free = || TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let ports = (0..n).map(|_| (free(), free())).collect();
        Self::start_at(None, "127.0.0.1", ports)
    }

    /// `n` members on namespace host `name` of `hosts`, at its address.
    pub fn start_on(hosts: &crate::cluster::Hosts, name: &str, n: usize) -> Self {
        let ports = (0..n as u16).map(|i| (2379 + 2 * i, 2380 + 2 * i)).collect();
        Self::start_at(Some(hosts.ns(name)), &hosts.ip(name), ports)
    }

    fn start_at(host: Option<String>, ip: &str, ports: Vec<(u16, u16)>) -> Self {
        let members =
            ports.into_iter().enumerate().map(|(i, (c, p))| (format!("m{i}"), c, p, None)).collect();
        let mut c = EtcdCluster { dir: tempfile::tempdir().unwrap(), ip: ip.to_string(), host, members };
        let initial: Vec<String> =
            c.members.iter().map(|(name, _, peer, _)| format!("{name}=http://{ip}:{peer}")).collect();
        let initial = initial.join(",");
        let bin = std::env::var_os("EDL_ETCD").map(PathBuf::from).unwrap_or_else(|| "etcd".into());
        for (name, client, peer, child) in &mut c.members {
            let (client_url, peer_url) = (format!("http://{ip}:{client}"), format!("http://{ip}:{peer}"));
            let mut cmd = match &c.host {
                Some(ns) => {
                    let mut cmd = Command::new("ip");
                    cmd.args(["netns", "exec", ns]).arg(&bin);
                    cmd
                }
                None => Command::new(&bin),
            };
            let spawned = cmd
                .args(["--name", name, "--data-dir"])
                .arg(c.dir.path().join(name.as_str()))
                .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
                .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &initial, "--initial-cluster-state", "new"])
                .args([
                    "--initial-cluster-token",
                    "edl-test",
                    "--heartbeat-interval",
                    "50",
                    "--election-timeout",
                    "500",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "cannot start {}: {e}. The etcd tests need etcd-server (.ci/run installs it)",
                        bin.display()
                    )
                });
            *child = Some(spawned);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while c.leader().is_none() {
            assert!(Instant::now() < deadline, "the etcd cluster elected no leader");
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }

    pub fn url(&self) -> String {
        let all: Vec<String> =
            self.members.iter().map(|(_, client, _, _)| format!("{}:{client}", self.ip)).collect();
        format!("etcd://{}", all.join(","))
    }

    /// Which running member leads, asked through etcd's JSON gateway.
    pub fn leader(&self) -> Option<usize> {
        match &self.host {
            Some(ns) => crate::cluster::in_netns(ns, || self.leader_here()),
            None => self.leader_here(),
        }
    }

    fn leader_here(&self) -> Option<usize> {
        use std::io::{Read, Write};
        for (i, (_, client, _, child)) in self.members.iter().enumerate() {
            if child.is_none() {
                continue;
            }
            let Ok(mut s) = std::net::TcpStream::connect((self.ip.as_str(), *client)) else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let req = "POST /v3/maintenance/status HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
            if s.write_all(req.as_bytes()).is_err() {
                continue;
            }
            let mut answer = String::new();
            let _ = s.read_to_string(&mut answer);
            let Some(body) = answer.split("\r\n\r\n").nth(1) else { continue };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else { continue };
            let (me, leader) = (&v["header"]["member_id"], &v["leader"]);
            if !leader.is_null() && me == leader {
                return Some(i);
            }
            let _ = i;
        }
        None
    }

    /// Kills member `i` (as a crash does).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].3.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The behaviour every store must have.
/// `slow` stretches every lease and wait: etcd counts leases in whole
/// seconds (1 for Redis and memory).
async fn contract<S: Store>(store: Arc<S>, slow: u32) {
    let ms = |n: u64| Duration::from_millis(n) * slow;
    // put, get, tokens, list by prefix, delete
    let t1 = store.put("a/1", b"one", None).await.unwrap();
    let t2 = store.put("a/1", b"uno", None).await.unwrap();
    assert!(t2 > t1, "tokens grow");
    store.put("a/2", b"two", None).await.unwrap();
    store.put("b/1", b"other", None).await.unwrap();
    let e = store.get("a/1").await.unwrap().unwrap();
    assert_eq!((e.value.as_slice(), e.token), (&b"uno"[..], t2));
    let listed: Vec<String> = store.list("a/").await.unwrap().into_iter().map(|e| e.key).collect();
    assert_eq!(listed, vec!["a/1", "a/2"]);
    assert!(store.delete("a/2").await.unwrap());
    assert!(!store.delete("a/2").await.unwrap());
    // delete_if: only the holder of the token removes the key, in one step.
    let t = store.put("a/3", b"mine", None).await.unwrap();
    let next = store.put("a/3", b"the next holder's", None).await.unwrap();
    assert!(!store.delete_if("a/3", t).await.unwrap(), "an old token removed the key");
    assert_eq!(store.get("a/3").await.unwrap().unwrap().value, b"the next holder's");
    assert!(store.delete_if("a/3", next).await.unwrap());
    assert!(store.get("a/3").await.unwrap().is_none());
    assert!(!store.delete_if("a/3", next).await.unwrap());
    assert!(store.get("a/2").await.unwrap().is_none());
    // A key written again after it was deleted gets a higher token than
    // any it had: an old holder's token never becomes valid again.
    let again = store.put("a/3", b"back", None).await.unwrap();
    assert!(again > next, "{again} after {next}");

    // compare-and-set with a fencing token
    let Cas::Written(s1) = store.compare_and_set("s", None, b"v1", None).await.unwrap() else {
        panic!("the first write of a key")
    };
    assert_eq!(
        store.compare_and_set("s", None, b"v1'", None).await.unwrap(),
        Cas::Conflict { current: Some(s1) }
    );
    let Cas::Written(s2) = store.compare_and_set("s", Some(s1), b"v2", None).await.unwrap() else {
        panic!("a write with the current token")
    };
    assert!(s2 > s1);
    assert_eq!(
        store.compare_and_set("s", Some(s1), b"stale", None).await.unwrap(),
        Cas::Conflict { current: Some(s2) }
    );
    assert_eq!(
        store.compare_and_set("gone", Some(3), b"x", None).await.unwrap(),
        Cas::Conflict { current: None }
    );
    assert_eq!(store.get("s").await.unwrap().unwrap().value, b"v2");

    // A lease taken again after it expired: its token is higher than the
    // last one of the lapsed holder (who may still think it holds).
    let Cas::Written(first) = store.compare_and_set("l/fenced", None, b"a", Some(ms(100))).await.unwrap()
    else {
        panic!("a new lease")
    };
    let Cas::Written(renewed) =
        store.compare_and_set("l/fenced", Some(first), b"a", Some(ms(100))).await.unwrap()
    else {
        panic!("a renewal")
    };
    tokio::time::sleep(ms(250)).await;
    let Cas::Written(taken) = store.compare_and_set("l/fenced", None, b"b", Some(ms(100))).await.unwrap()
    else {
        panic!("the lapsed lease taken")
    };
    assert!(taken > renewed, "the new holder's token {taken} is not above the old one's {renewed}");

    // a lease lives while refreshed and vanishes after its TTL
    store.put("l/x", b"lease", Some(ms(300))).await.unwrap();
    tokio::time::sleep(ms(200)).await;
    assert!(store.refresh("l/x", ms(300)).await.unwrap());
    tokio::time::sleep(ms(200)).await;
    assert!(store.get("l/x").await.unwrap().is_some(), "refreshed lease expired early");
    tokio::time::sleep(ms(250)).await;
    assert!(store.get("l/x").await.unwrap().is_none(), "lease outlived its TTL");
    assert!(!store.refresh("l/x", ms(300)).await.unwrap());

    // a held lease stays; a released one goes
    let lease = Lease::hold(store.clone(), "l/held".into(), b"me".to_vec(), ms(300)).await.unwrap();
    tokio::time::sleep(ms(700)).await;
    assert!(store.get("l/held").await.unwrap().is_some());
    lease.release().await.unwrap();
    assert!(store.get("l/held").await.unwrap().is_none());

    // a watcher sees an addition and a removal within one second
    let mut rx = watch(store.clone(), keys::teachers("svc"), ms(100));
    let start = Instant::now();
    store.put(&keys::teacher("svc", "t1"), b"127.0.0.1:9000", Some(ms(400))).await.unwrap();
    match tokio::time::timeout(ms(1000), rx.recv()).await {
        Ok(Some(Change::Added(e))) => assert_eq!(e.value, b"127.0.0.1:9000"),
        other => panic!("no addition seen within 1 s: {other:?}"),
    }
    // Not refreshed: the lease expires and the watcher reports it.
    match tokio::time::timeout(ms(2000), rx.recv()).await {
        Ok(Some(Change::Removed(k))) => assert_eq!(k, keys::teacher("svc", "t1")),
        other => panic!("no removal seen: {other:?}"),
    }
    assert!(start.elapsed() < ms(2000));
}

#[test]
fn the_memory_store_keeps_the_contract() {
    runtime().block_on(contract(Arc::new(MemoryStore::new()), 1));
}

#[test]
fn the_redis_store_keeps_the_contract() {
    let server = RedisServer::start();
    runtime().block_on(async {
        let store = match AnyStore::open(&server.url()).unwrap() {
            AnyStore::Redis(r) => r,
            _ => unreachable!(),
        };
        contract(Arc::new(store), 1).await
    });
}

#[test]
fn the_etcd_store_keeps_the_contract() {
    let cluster = EtcdCluster::start(3);
    runtime().block_on(async {
        let store = match AnyStore::open(&cluster.url()).unwrap() {
            AnyStore::Etcd(e) => e,
            _ => unreachable!(),
        };
        contract(Arc::new(store), 10).await
    });
}

#[test]
fn an_etcd_store_that_loses_its_leader_goes_on_with_what_it_held() {
    let mut cluster = EtcdCluster::start(3);
    let rt = runtime();
    let store = rt.block_on(async { AnyStore::open(&cluster.url()).unwrap() });
    let before = rt.block_on(async {
        let Cas::Written(t) = store.compare_and_set("edl/jobs/j/state", None, b"gen 4", None).await.unwrap()
        else {
            panic!("the first write")
        };
        store.put("edl/jobs/j/workers/1", b"w1", None).await.unwrap();
        t
    });
    let leader = cluster.leader().expect("a leader");
    cluster.kill(leader);
    rt.block_on(async {
        // A blip while the others elect a new leader; then every operation
        // works, and nothing written before is lost.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut token = before;
        let after = loop {
            match store.compare_and_set("edl/jobs/j/state", Some(token), b"gen 5", None).await {
                Ok(Cas::Written(t)) => break t,
                Ok(Cas::Conflict { current }) => token = current.expect("the state is there"),
                Err(e) => {
                    assert!(Instant::now() < deadline, "no write within 30 s of losing the leader: {e}")
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(after > before);
        assert_eq!(store.get("edl/jobs/j/workers/1").await.unwrap().unwrap().value, b"w1");
        let mut last = after;
        for i in 0..20 {
            let t = store.put("edl/jobs/j/workers/2", format!("{i}").as_bytes(), None).await.unwrap();
            assert!(t > last, "tokens strictly increase: {t} after {last}");
            last = t;
        }
    });
    assert!(cluster.leader().is_some_and(|l| l != leader), "a new leader");
}

#[test]
fn the_redis_store_reconnects_after_a_restart() {
    let mut server = RedisServer::start();
    let rt = runtime();
    let store = rt.block_on(async { Arc::new(RedisStore::open(&server.url()).unwrap()) });
    rt.block_on(async {
        store.put("k", b"before", None).await.unwrap();
    });
    server.stop();
    let err = rt.block_on(async {
        let start = Instant::now();
        let r = store.put("k", b"during", None).await;
        (r, start.elapsed())
    });
    let (result, took) = err;
    let e = result.expect_err("Redis is down");
    assert!(e.to_string().contains(&server.url()), "the error names the server: {e}");
    assert!(took < Duration::from_secs(5), "a failing call must not hang ({took:?})");
    server.restart();
    rt.block_on(async {
        // The data did not survive (no persistence); the connection does.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match store.put("k", b"after", None).await {
                Ok(_) => break,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("no reconnect within 10 s: {e}"),
            }
        }
        assert_eq!(store.get("k").await.unwrap().unwrap().value, b"after");
    });
}

#[test]
fn store_urls_are_checked() {
    assert!(AnyStore::open("memory").is_ok());
    assert!(AnyStore::open("etcd://10.0.0.1:2379,10.0.0.2:2379").is_ok(), "nothing is contacted yet");
    let e = AnyStore::open("etcd://").err().expect("no member").to_string();
    assert!(e.contains("etcd://host:port"), "{e}");
    assert!(AnyStore::open("consul://x").is_err());
}
