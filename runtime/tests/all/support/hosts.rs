//! Hosts built from Linux network namespaces: veth pairs to a bridge,
//! private addresses that exist only inside the namespaces.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// Hosts made of network namespaces: each has `eth0` on a private subnet,
/// its veth peer on a bridge in a namespace of its own (the switch). The
/// switch side of a host's link can be taken down: a partition the host
/// itself does not see. Everything is removed (its processes killed) on drop.
pub(crate) struct Hosts {
    pub(crate) prefix: String,
    subnet: u8,
    names: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Hosts {
    /// Builds the hosts, or says why it cannot (not root, no `ip`).
    pub(crate) fn build(names: &[&str]) -> Result<Hosts, String> {
        // Tests run side by side in one process: each set of hosts has
        // names of its own (a second `...-sw` would collide, and one set's
        // drop would remove the other's).
        static BUILT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = BUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = std::process::id();
        let h = Hosts {
            prefix: format!("edl{id}n{n}"),
            // A /24 per set of hosts, inside its namespaces only.
            subnet: ((id + n * 37) % 200 + 20) as u8,
            names: names.iter().map(|n| n.to_string()).collect(),
        };
        let sw = h.ns("sw");
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for (i, name) in names.iter().enumerate() {
            let ns = h.ns(name);
            let port = format!("v{i}");
            ip(&["netns", "add", &ns])?;
            ip(&["-n", &sw, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns])?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0", "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", h.ip(name)), "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(h)
    }

    /// The hosts, or None (and why, printed) where namespaces cannot be
    /// made (not root, no `ip`); under CI (root) that is a failure.
    pub(crate) fn build_or_skip(names: &[&str]) -> Option<Hosts> {
        match Hosts::build(names) {
            Ok(h) => Some(h),
            Err(why) if std::env::var_os("CI").is_some() => panic!("network namespaces: {why}"),
            Err(why) => {
                eprintln!("skipped: network namespaces cannot be made here ({why}); this test needs root");
                None
            }
        }
    }

    /// A redis-server on host `name` (its address, port 6379, files in
    /// `dir`), listening when this returns.
    pub(crate) fn redis(&self, name: &str, dir: &Path) -> Child {
        let ip = self.ip(name);
        let mut c = self.on(name, "redis-server");
        c.args([
            "--bind",
            &ip,
            "--port",
            "6379",
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ]);
        let child = c.arg("--dir").arg(dir).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        self.wait_listening(name, 6379);
        child
    }

    pub(crate) fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    pub(crate) fn ip(&self, name: &str) -> String {
        let i = self.names.iter().position(|n| n == name).expect("a host of the cluster");
        format!("10.{}.0.{}", self.subnet, i + 1)
    }

    /// A command run on host `name`.
    pub(crate) fn on(&self, name: &str, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(name), program]);
        c
    }

    /// Connects or cuts host `name` at the switch.
    pub(crate) fn link(&self, name: &str, up: bool) {
        let i = self.names.iter().position(|n| n == name).unwrap();
        ip(&["-n", &self.ns("sw"), "link", "set", &format!("v{i}"), if up { "up" } else { "down" }]).unwrap();
    }

    /// Waits (bounded) until something listens on TCP `port` on host `name`.
    pub(crate) fn wait_listening(&self, name: &str, port: u16) {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let out = self.on(name, "ss").arg("-ltnH").output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            if text.split_whitespace().any(|w| w.ends_with(&format!(":{port}"))) {
                return;
            }
            assert!(Instant::now() < until, "nothing listens on port {port} on {name}: {text}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every process on host `name`.
    pub(crate) fn pids(&self, name: &str) -> Vec<i32> {
        let out = Command::new("ip").args(["netns", "pids", &self.ns(name)]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse().ok()).collect()
    }

    /// Every process on host `name`, with its command line (words joined
    /// by spaces).
    pub(crate) fn command_lines(&self, name: &str) -> Vec<(i32, String)> {
        self.pids(name)
            .into_iter()
            .filter_map(|p| {
                let raw = std::fs::read(format!("/proc/{p}/cmdline")).ok()?;
                Some((p, String::from_utf8_lossy(&raw).replace('\0', " ")))
            })
            .collect()
    }

    /// Kills every process on host `name` (SIGKILL); returns how many.
    pub(crate) fn kill_all(&self, name: &str) -> usize {
        let pids = self.pids(name);
        for &p in &pids {
            // SAFETY: sending a signal has no memory-safety preconditions;
            // the pids were just read from the namespace's process list.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        pids.len()
    }
}

/// Runs `f` on a thread inside network namespace `ns` (its sockets are
/// that namespace's), and returns what it returned.
pub(crate) fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(format!("/var/run/netns/{ns}")).expect("the namespace's file");
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: setns on this thread only, with a descriptor that
            // stays open for the call; the thread ends with the scope.
            let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns {ns}: {}", std::io::Error::last_os_error());
            f()
        })
        .join()
        .expect("the thread in the namespace")
    })
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for name in self.names.clone().iter().map(String::as_str).chain(["sw"]) {
            if name != "sw" {
                self.kill_all(name);
            }
            let _ = ip(&["netns", "del", &self.ns(name)]);
        }
    }
}
