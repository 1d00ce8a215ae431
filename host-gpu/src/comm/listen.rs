//! Listening sockets whose queue of connections not yet accepted is deep
//! enough for a job's workers all connecting at once.
//!
//! The standard library listens with a queue of 128. When thousands of
//! workers connect together (a job's start, every rank reaching a new
//! generation's rendezvous), the kernel drops the connections past the
//! queue, and each one dropped is retried after one, then three, seven...
//! seconds: a coordinator that accepts at once still sees its workers
//! arrive a few a second.

use std::io;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};

/// Connections queued before they are accepted (the kernel caps it at
/// `net.core.somaxconn`, 4096 by default since Linux 5.4).
pub const BACKLOG: i32 = 16_384;

/// A listener on `addr` with a queue of [`BACKLOG`] connections. On the
/// IPv6 unspecified address (`[::]`) it takes IPv4 connections too (dual
/// stack, whatever `net.ipv6.bindv6only` says), and on a host without IPv6
/// it listens on IPv4's (`0.0.0.0`) instead, on the same port.
pub fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    listen_with(addr, bind)
}

/// [`listen`], binding with `bind`.
fn listen_with(
    addr: SocketAddr,
    bind: impl Fn(SocketAddr) -> io::Result<TcpListener>,
) -> io::Result<TcpListener> {
    let any_v6 = addr.is_ipv6() && addr.ip().is_unspecified();
    match bind(addr) {
        // A kernel without IPv6.
        Err(e) if any_v6 && e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            bind(SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), addr.port()))
        }
        bound => bound,
    }
}

fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    // As the standard library's listeners: a port in TIME_WAIT can be taken again.
    #[cfg(unix)]
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

/// [`listen`] on the first address `addr` resolves to.
pub fn listen_on(addr: impl ToSocketAddrs) -> io::Result<TcpListener> {
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        match listen(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address to listen on")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;
    use std::time::Duration;

    /// A connection past a full queue is dropped by the kernel and retried
    /// a second later; one queued completes at once. 600 connections to a
    /// listener that accepts none of them until all are made: each would
    /// wait out its retries behind a queue of 128.
    #[test]
    fn hundreds_of_connections_made_at_once_are_queued_not_dropped() {
        let cap =
            std::fs::read_to_string("/proc/sys/net/core/somaxconn").ok().and_then(|s| s.trim().parse().ok());
        if cap.is_some_and(|c: usize| c < 600) {
            eprintln!(
                "skipped: net.core.somaxconn is {} here, below the 600 this test queues",
                cap.unwrap_or(0)
            );
            return;
        }
        let listener = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let n = 600;
        let mut clients = Vec::with_capacity(n);
        for i in 0..n {
            // A dropped connection's retry comes after a second: two seconds
            // is one retry, the first, also dropped while nothing is accepted.
            let c = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
                .unwrap_or_else(|e| panic!("connection {i} of {n} not queued: {e}"));
            clients.push(c);
        }
        listener.set_nonblocking(true).unwrap();
        let accepted = std::iter::from_fn(|| listener.accept().ok()).count();
        assert_eq!(accepted, n);
    }

    #[test]
    fn a_listener_on_any_ipv6_address_takes_ipv4_connections_too_and_is_ipv4_s_without_ipv6() {
        let any = listen("[::]:0".parse().unwrap()).unwrap();
        let port = any.local_addr().unwrap().port();
        TcpStream::connect(("127.0.0.1", port)).expect("an IPv4 connection");
        // Where IPv6 is there and its loopback up (not so in every container).
        let v6_loopback = std::fs::read_to_string("/proc/net/if_inet6")
            .is_ok_and(|s| s.lines().any(|l| l.starts_with("00000000000000000000000000000001")));
        if any.local_addr().unwrap().is_ipv6() && v6_loopback {
            TcpStream::connect(("::1", port)).expect("an IPv6 connection");
        }
        // A host without IPv6: the socket cannot be made (EAFNOSUPPORT).
        let no_v6 = |a: SocketAddr| match a.is_ipv6() {
            true => Err(io::Error::from_raw_os_error(libc::EAFNOSUPPORT)),
            false => bind(a),
        };
        let l = listen_with("[::]:0".parse().unwrap(), no_v6).unwrap();
        assert!(l.local_addr().unwrap().ip().is_unspecified() && l.local_addr().unwrap().is_ipv4());
        TcpStream::connect(("127.0.0.1", l.local_addr().unwrap().port())).expect("an IPv4 connection");
        // Only the unspecified address falls back: another refusal is the caller's.
        let e = listen_with("[::1]:0".parse().unwrap(), no_v6).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EAFNOSUPPORT));
    }

    #[test]
    fn a_port_in_use_is_refused_as_the_standard_library_refuses_it() {
        let first = listen_on("127.0.0.1:0").unwrap();
        let e = listen_on(first.local_addr().unwrap()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
    }
}
