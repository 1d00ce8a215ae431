//! Stores the tests start themselves: a redis-server and an etcd cluster,
//! on loopback or on a network-namespace host.

use crate::support::hosts::{Hosts, in_netns};
use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A redis-server of this test's own on a free loopback port.
pub(crate) struct RedisServer {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    password: Option<String>,
}

impl RedisServer {
    pub(crate) fn start() -> Self {
        Self::start_with(None)
    }

    /// A server that wants `password` from every client.
    pub(crate) fn start_with(password: Option<&str>) -> Self {
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

    pub(crate) fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}/", self.port),
            None => format!("redis://127.0.0.1:{}/", self.port),
        }
    }

    /// Freezes (SIGSTOP) or thaws (SIGCONT) the server: while frozen it
    /// holds its connections and answers nothing, as a server cut off by
    /// the network does.
    pub(crate) fn freeze(&self, frozen: bool) {
        if let Some(c) = &self.child {
            let sig = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: signalling our own child, which is not reaped.
            unsafe { libc::kill(c.id() as libc::pid_t, sig) };
        }
    }

    pub(crate) fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub(crate) fn restart(&mut self) {
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
pub(crate) struct EtcdCluster {
    dir: tempfile::TempDir,
    /// The address the members listen on.
    ip: String,
    /// The namespace host they run on (None: this machine's loopback).
    host: Option<String>,
    /// Each member's name, client port, peer port and process.
    members: Vec<(String, u16, u16, Option<Child>)>,
}

impl EtcdCluster {
    pub(crate) fn start(n: usize) -> Self {
        let free = || TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let ports = (0..n).map(|_| (free(), free())).collect();
        Self::start_at(None, "127.0.0.1", ports)
    }

    /// `n` members on namespace host `name` of `hosts`, at its address.
    pub(crate) fn start_on(hosts: &Hosts, name: &str, n: usize) -> Self {
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
                    // etcd's own defaults: shorter ones let a loaded
                    // machine's starved members lose their leader again
                    // and again.
                    "--heartbeat-interval",
                    "100",
                    "--election-timeout",
                    "1000",
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

    pub(crate) fn url(&self) -> String {
        let all: Vec<String> =
            self.members.iter().map(|(_, client, _, _)| format!("{}:{client}", self.ip)).collect();
        format!("etcd://{}", all.join(","))
    }

    /// Which running member leads, asked through etcd's JSON gateway.
    pub(crate) fn leader(&self) -> Option<usize> {
        match &self.host {
            Some(ns) => in_netns(ns, || self.leader_here()),
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
    pub(crate) fn kill(&mut self, i: usize) {
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
