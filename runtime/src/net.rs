//! Where the job's listeners bind and what they tell others. A one-machine
//! job binds loopback; a job across hosts binds an interface (or all of
//! them) and advertises an address the other hosts reach: given, or the
//! address this host routes from.

use anyhow::{Context, Result, anyhow};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};

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
