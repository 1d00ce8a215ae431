//! Where the job's listeners bind and what they tell others. A one-machine
//! job binds loopback; a job across hosts binds an interface (or all of
//! them) and advertises an address the other hosts reach: given, or the
//! address this host routes from.

pub mod first_bytes;
pub mod tls;

use anyhow::{Context, Result, anyhow};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};

/// Whether an HTTP request's host (its URI's authority, else its `Host`)
/// names a loopback listener at `port`
/// (`127.0.0.1:PORT`, `localhost:PORT`, `[::1]:PORT`, or the name alone). An
/// endpoint on loopback without a token answers only these: a web page
/// whose name an attacker rebound to 127.0.0.1 sends its own name, and must
/// not reach it through the browser of someone on this machine.
pub fn loopback_host(uri: &axum::http::Uri, headers: &axum::http::HeaderMap, port: u16) -> bool {
    // HTTP/2's `:authority` (and an HTTP/1 request's absolute address) is
    // the URI's; otherwise the `Host` header names it.
    let named = uri.authority().map(|a| a.as_str());
    let header = || headers.get(axum::http::header::HOST).and_then(|h| h.to_str().ok());
    let Some(host) = named.or_else(header) else { return false };
    let port = format!(":{port}");
    let name = host.strip_suffix(port.as_str()).unwrap_or(host).to_ascii_lowercase();
    let literal = name.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>();
    name == "localhost" || literal.is_ok_and(|ip| ip.is_loopback())
}

/// The coordinator's listeners: the control port and the rendezvous.
#[derive(Clone, Debug, PartialEq)]
pub struct Addresses {
    /// Where the control port listens (port 0: any free one).
    pub listen: SocketAddr,
    /// The rendezvous listens on `listen`'s address, on this port (0: any).
    pub rendezvous_port: u16,
    /// The host name or address workers are told (None: the listen address,
    /// or this host's routable address when listening on all interfaces).
    pub advertise: Option<String>,
}

impl Default for Addresses {
    /// Loopback, any free ports: a job on this machine only.
    fn default() -> Self {
        Addresses {
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            rendezvous_port: 0,
            advertise: None,
        }
    }
}

impl Addresses {
    /// The host part workers reach this coordinator at.
    pub fn advertised_host(&self) -> Result<String> {
        if let Some(h) = &self.advertise {
            return Ok(h.clone());
        }
        let ip = self.listen.ip();
        if !ip.is_unspecified() {
            return Ok(ip.to_string());
        }
        routable_ip(ip.is_ipv6()).map(|ip| ip.to_string()).context(
            "--listen on all interfaces: cannot tell which address other hosts reach; give --advertise",
        )
    }
}

/// `host:port` with an IPv6 address in brackets.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The address this host sends from toward the rest of the network (the
/// interface of its default route); no packet is sent to find it.
pub fn routable_ip(v6: bool) -> Result<IpAddr> {
    // Documentation addresses (RFC 5737, RFC 3849): never reached, but
    // connecting a UDP socket to one makes the kernel pick the interface.
    let (bind, probe): (SocketAddr, SocketAddr) = if v6 {
        ("[::]:0".parse()?, "[2001:db8::1]:9".parse()?)
    } else {
        ("0.0.0.0:0".parse()?, "192.0.2.1:9".parse()?)
    };
    let s = UdpSocket::bind(bind)?;
    s.connect(probe).context("this host has no route to other hosts")?;
    let ip = s.local_addr()?.ip();
    if ip.is_unspecified() {
        return Err(anyhow!("this host has no address on a routed network"));
    }
    Ok(ip)
}

/// The address of this host on its route to `host` (a name or an address):
/// where a process of this host that `host` is to reach is found.
pub fn routable_toward(host: &str) -> Result<IpAddr> {
    let to = resolve(&host_port(host, 9))?;
    let bind: SocketAddr = if to.is_ipv6() { "[::]:0".parse()? } else { "0.0.0.0:0".parse()? };
    let s = UdpSocket::bind(bind)?;
    s.connect(to).with_context(|| format!("this host has no route to {host}"))?;
    let ip = s.local_addr()?.ip();
    if ip.is_unspecified() {
        return Err(anyhow!("this host has no address on its route to {host}"));
    }
    Ok(ip)
}

/// The variable that names a relay a worker tries before its coordinator
/// (`host:port`; under `--scaler kubernetes --relay`, the job's relay
/// Service, which reaches only the relay on the worker's own node).
pub const RELAY_VAR: &str = "EDL_RELAY";

/// How long a worker tries the relay [`RELAY_VAR`] names before it reaches
/// its coordinator directly: time for its node's relay, started once the
/// node's first worker runs, to come up.
pub const RELAY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Where a worker reaches its job: the relay `relay` names where a
/// connection to it opens within `within` (tried every 200 ms), else
/// `coordinator` (said in the log). The connection tried is closed before
/// a word is sent: the relay takes it for a probe.
pub fn through_relay(relay: Option<&str>, coordinator: &str, within: std::time::Duration) -> String {
    use std::time::{Duration, Instant};
    let Some(relay) = relay.filter(|r| !r.is_empty()) else { return coordinator.to_string() };
    let until = Instant::now() + within;
    let why = loop {
        let tried = resolve(relay).and_then(|a| {
            let left = until
                .saturating_duration_since(Instant::now())
                .clamp(Duration::from_millis(50), Duration::from_secs(1));
            std::net::TcpStream::connect_timeout(&a, left).with_context(|| format!("connecting to {a}"))
        });
        match tried {
            Ok(_) => return relay.to_string(),
            Err(e) if Instant::now() >= until => break e,
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    tracing::info!(
        "no relay at {relay} within {within:?} ({why:#}); reaching the coordinator at {coordinator} directly"
    );
    coordinator.to_string()
}

/// Where a worker of the coordinator at `coordinator` connects: through
/// the relay [`RELAY_VAR`] names, where one answers within [`RELAY_WAIT`]
/// (see [`through_relay`]), else to the coordinator.
pub fn worker_reaches(coordinator: &str) -> String {
    let relay = std::env::var(RELAY_VAR).ok();
    through_relay(relay.as_deref(), coordinator, RELAY_WAIT)
}

/// Resolves `host:port` (a name or an address) to its first address.
pub fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("{addr}: not a host:port that resolves"))?
        .next()
        .ok_or_else(|| anyhow!("{addr}: the name has no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_reaches_the_relay_that_answers_and_else_its_coordinator() {
        use std::time::Duration;
        let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = relay.local_addr().unwrap().to_string();
        assert_eq!(through_relay(Some(&at), "10.0.0.1:7070", Duration::from_secs(30)), at);
        // A relay that came up while the worker tried it.
        let later = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let later_at = later.local_addr().unwrap().to_string();
        drop(later);
        let up = std::thread::spawn({
            let at = later_at.clone();
            move || {
                std::thread::sleep(Duration::from_millis(300));
                std::net::TcpListener::bind(&at)
            }
        });
        let chosen = through_relay(Some(&later_at), "10.0.0.1:7070", Duration::from_secs(30));
        let held = up.join().unwrap();
        // (Where the port was taken meanwhile by another, the coordinator.)
        if held.is_ok() {
            assert_eq!(chosen, later_at);
        }
        // None there: the coordinator, once the wait is over.
        drop(relay);
        assert_eq!(through_relay(Some(&at), "10.0.0.1:7070", Duration::from_millis(300)), "10.0.0.1:7070");
        assert_eq!(through_relay(None, "10.0.0.1:7070", Duration::from_secs(30)), "10.0.0.1:7070");
        assert_eq!(through_relay(Some(""), "10.0.0.1:7070", Duration::from_secs(30)), "10.0.0.1:7070");
    }

    #[test]
    fn the_advertised_host_is_given_or_the_listen_address_or_a_routable_one() {
        let given = Addresses { advertise: Some("coord.svc".into()), ..Addresses::default() };
        assert_eq!(given.advertised_host().unwrap(), "coord.svc");
        assert_eq!(Addresses::default().advertised_host().unwrap(), "127.0.0.1");
        let all = Addresses { listen: "0.0.0.0:7070".parse().unwrap(), ..Addresses::default() };
        // Where this machine has a default route, its address; otherwise a
        // message that says to give --advertise.
        match all.advertised_host() {
            Ok(h) => assert!(!h.parse::<IpAddr>().unwrap().is_unspecified(), "{h}"),
            Err(e) => assert!(format!("{e:#}").contains("give --advertise"), "{e:#}"),
        }
        assert_eq!(host_port("::1", 5), "[::1]:5");
        assert_eq!(host_port("10.0.0.1", 5), "10.0.0.1:5");
    }
}
