//! Where the coordinator writes to a worker: the worker's own connection,
//! or the relay that carries it ([`crate::control::relay`]); and a sending
//! side shared by threads.

use crate::control::frame::Frame;
use crate::control::proto::{Link, ProtoError, encode, peer, send_encoded};
use serde::Serialize;

/// Where the coordinator writes to one worker: its own connection, or the
/// connection of the relay that carries it (see [`crate::control::relay`]).
pub enum Outbox {
    /// The worker's own connection, shared with the coordinator's
    /// heartbeats to it (see [`crate::coordinator::beats`]).
    Direct(SharedLink),
    /// The worker's number on the relay, and the relay's connection.
    Relayed {
        conn: u64,
        /// The relay's connection here (its host's number, unique in the job).
        host: u64,
        relay: RelayOut,
        name: String,
    },
}

/// A connection's writing side, for threads that take turns on it: each
/// message is written whole under the lock.
pub type SharedLink = std::sync::Arc<std::sync::Mutex<Link>>;

/// The link behind `link`, whatever a thread that panicked left it as (a
/// message is one write: none is left half written).
pub fn lock_link(link: &SharedLink) -> std::sync::MutexGuard<'_, Link> {
    link.lock().unwrap_or_else(|p| p.into_inner())
}

impl Outbox {
    /// A worker's own connection.
    pub fn direct(link: Link) -> Self {
        Outbox::Direct(std::sync::Arc::new(std::sync::Mutex::new(link)))
    }

    /// Writes one message as a JSON line.
    pub fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), ProtoError> {
        let line = encode(msg).map_err(|detail| ProtoError::Malformed { peer: self.peer(), detail })?;
        self.send_encoded(&line)
    }

    /// Writes a line made by [`encode`]. Through a relay: a relay that
    /// failed says so, and its workers' connections close.
    pub fn send_encoded(&mut self, line: &[u8]) -> Result<(), ProtoError> {
        match self {
            Outbox::Direct(stream) => send_encoded(&mut lock_link(stream), line),
            Outbox::Relayed { conn, relay, name, .. } => relay
                .send(&[Frame::Line { conn: *conn, line: line.to_vec() }])
                .map_err(|detail| ProtoError::Io { peer: name.clone(), detail }),
        }
    }

    /// Through a relay: its host's number, the worker's number on the
    /// relay, and the relay's connection.
    pub fn relay(&self) -> Option<(u64, u64, &RelayOut)> {
        match self {
            Outbox::Direct(_) => None,
            Outbox::Relayed { conn, host, relay, .. } => Some((*host, *conn, relay)),
        }
    }

    fn peer(&self) -> String {
        match self {
            Outbox::Direct(s) => peer(lock_link(s).get_ref()),
            Outbox::Relayed { name, .. } => name.clone(),
        }
    }
}

/// The coordinator's writing side of a relay's connection, held by each
/// worker's [`Outbox`] behind it and written by the coordinator's thread
/// (the reader hands it what it has for a relay). Each call's frames go in
/// one sealed write: no thread of its own to wake per window, at the price
/// of a blocked write for a relay that stopped reading (the connection's
/// write timeout, 10 s, bounds each write that makes no progress), as for
/// a worker's own connection.
#[derive(Clone)]
pub struct RelayOut(std::sync::Arc<std::sync::Mutex<RelayWriter>>);

struct RelayWriter {
    link: Link,
    /// Frames encoded and not written yet (while held, more than one call's).
    buf: Vec<u8>,
    /// Frames are kept until [`RelayOut::release`].
    held: bool,
    /// Why a write failed: the connection is shut, and every later send
    /// fails at once with this.
    failed: Option<String>,
    /// The relay's address, as it was while connected (a reset connection
    /// no longer says it).
    peer: String,
}

impl RelayOut {
    pub fn new(link: Link) -> Self {
        let peer = peer(link.get_ref());
        RelayOut(std::sync::Arc::new(std::sync::Mutex::new(RelayWriter {
            link,
            buf: Vec::new(),
            held: false,
            failed: None,
            peer,
        })))
    }

    /// Keeps the frames of later sends until [`RelayOut::release`], which
    /// writes them in one write: the commit of a window and the window
    /// after it reach the relay together, one write and one wake-up for
    /// both.
    pub fn hold(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).held = true;
    }

    /// Writes what was kept since [`RelayOut::hold`]; later sends are
    /// written at once again. Fails as [`RelayOut::send`] does.
    pub fn release(&self) -> Result<(), String> {
        let mut w = self.0.lock().unwrap_or_else(|p| p.into_inner());
        w.held = false;
        w.write()
    }

    /// Drops what was kept since [`RelayOut::hold`], unwritten; later sends
    /// are written at once again.
    pub fn discard(&self) {
        let mut w = self.0.lock().unwrap_or_else(|p| p.into_inner());
        w.held = false;
        w.buf.clear();
    }

    /// Writes `frames` in one write. A write that fails shuts the
    /// connection down (its reader then reports the relay and its workers
    /// lost) and fails every later send too.
    pub fn send(&self, frames: &[Frame]) -> Result<(), String> {
        let mut w = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &w.failed {
            return Err(why.clone());
        }
        frames.iter().for_each(|f| f.encode(&mut w.buf));
        if w.held { Ok(()) } else { w.write() }
    }
}

impl RelayWriter {
    /// Writes the frames kept in `buf`, if any.
    fn write(&mut self) -> Result<(), String> {
        use std::io::Write;
        let RelayWriter { link, buf, failed, peer, .. } = self;
        if let Some(why) = failed {
            return Err(why.clone());
        }
        if buf.is_empty() {
            return Ok(());
        }
        let written = link.write_all(buf);
        buf.clear();
        // A burst as large as a generation's messages is not kept here.
        if buf.capacity() > 1 << 20 {
            *buf = Vec::new();
        }
        written.map_err(|e| {
            let why = format!("the relay at {peer} was lost: writing to it: {e}");
            let _ = link.get_ref().shutdown(std::net::Shutdown::Both);
            *failed = Some(why.clone());
            why
        })
    }
}

/// The sending side of a control connection, shared by the threads that
/// write to it: each message is written whole, under a lock.
#[derive(Clone)]
pub struct Sender(std::sync::Arc<std::sync::Mutex<Outbox>>);

impl Sender {
    pub fn new(stream: Outbox) -> Self {
        Sender(std::sync::Arc::new(std::sync::Mutex::new(stream)))
    }

    /// Writes one message as a JSON line.
    pub fn send<T: Serialize>(&self, msg: &T) -> Result<(), ProtoError> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).send(msg)
    }
}

/// A relay's connection here, and the relay's end of it (reads wait up to 10 s).
#[cfg(test)]
pub(crate) fn relay_pair() -> (RelayOut, std::net::TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let out = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (relay, _) = l.accept().unwrap();
    relay.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    (RelayOut::new(Link::new(out, None)), relay)
}

/// A relay's connection whose write failed (its peer closed), and why.
#[cfg(test)]
pub(crate) fn failed_relay() -> (RelayOut, String) {
    let (out, relay) = relay_pair();
    drop(relay);
    // Writes to a closed peer fail once its reset has come back.
    for _ in 0..2000 {
        if let Err(why) = out.send(&[Frame::Beat]) {
            return (out, why);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    panic!("writes to a closed relay never failed");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;

    /// The next `n` bytes at the relay's end (waiting up to 10 s for them).
    fn arrived(relay: &mut TcpStream, n: usize) -> Vec<u8> {
        use std::io::Read;
        let mut got = vec![0u8; n];
        relay.read_exact(&mut got).expect("the bytes written reach the relay");
        got
    }

    /// Nothing is waiting at the relay's end (after a moment for what a
    /// write would have sent to arrive).
    fn nothing_arrived(relay: &mut TcpStream) -> bool {
        use std::io::Read;
        std::thread::sleep(std::time::Duration::from_millis(50));
        relay.set_nonblocking(true).unwrap();
        let none = matches!(relay.read(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        relay.set_nonblocking(false).unwrap();
        none
    }

    #[test]
    fn frames_sent_while_held_go_out_together_in_order_at_release() {
        let (out, mut relay) = relay_pair();
        let fan = Frame::Fan { conns: vec![3, 4], line: b"{\"commit\":1}\n".to_vec() };
        let beat = Frame::Beat;
        let mut both = Vec::new();
        fan.encode(&mut both);
        beat.encode(&mut both);

        out.hold();
        out.send(std::slice::from_ref(&fan)).unwrap();
        out.send(std::slice::from_ref(&beat)).unwrap();
        assert!(nothing_arrived(&mut relay), "a held frame was written");
        out.release().unwrap();
        assert_eq!(arrived(&mut relay, both.len()), both, "the held frames, in order");
        assert!(nothing_arrived(&mut relay), "the held frames were written once");

        // Released: a send is written at once again.
        out.send(std::slice::from_ref(&beat)).unwrap();
        let mut one = Vec::new();
        beat.encode(&mut one);
        assert_eq!(arrived(&mut relay, one.len()), one);
        // Releasing with nothing held writes nothing.
        out.release().unwrap();
        assert!(nothing_arrived(&mut relay));
    }

    #[test]
    fn a_relay_whose_write_failed_fails_every_send_and_release_after() {
        let (out, why) = failed_relay();
        assert!(why.contains("the relay at 127.0.0.1:") && why.contains("was lost: writing to it"), "{why}");
        out.hold();
        assert_eq!(out.send(&[Frame::Beat]), Err(why.clone()));
        assert_eq!(out.release(), Err(why));
    }
}
