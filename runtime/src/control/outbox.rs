//! Where the coordinator writes to a worker: the worker's own connection,
//! or the relay that carries it ([`crate::control::relay`]); and a sending
//! side shared by threads.

use crate::control::proto::{Link, ProtoError, encode, peer, send_encoded};
use crate::control::relay::Frame;
use serde::Serialize;

/// Where the coordinator writes to one worker: its own connection, or the
/// connection of the relay that carries it (see [`crate::control::relay`]).
pub enum Outbox {
    Direct(Link),
    /// The worker's number on the relay, and the relay's connection.
    Relayed {
        conn: u64,
        /// The relay's connection here (its host's number, unique in the job).
        host: u64,
        relay: RelayOut,
        name: String,
    },
}

impl Outbox {
    /// Writes one message as a JSON line.
    pub fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), ProtoError> {
        let line = encode(msg).map_err(|detail| ProtoError::Malformed { peer: self.peer(), detail })?;
        self.send_encoded(&line)
    }

    /// Writes a line made by [`encode`]. Through a relay: a relay that
    /// failed says so, and its workers' connections close.
    pub fn send_encoded(&mut self, line: &[u8]) -> Result<(), ProtoError> {
        match self {
            Outbox::Direct(stream) => send_encoded(stream, line),
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
            Outbox::Direct(s) => peer(s.get_ref()),
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
    buf: Vec<u8>,
    /// Frames are gathered in `buf` until [`RelayOut::release`].
    held: bool,
    /// Why a write failed: the connection is shut, and every later send
    /// fails at once with this.
    failed: Option<String>,
}

impl RelayOut {
    pub fn new(link: Link) -> Self {
        RelayOut(std::sync::Arc::new(std::sync::Mutex::new(RelayWriter {
            link,
            buf: Vec::new(),
            held: false,
            failed: None,
        })))
    }

    /// Writes `frames` in one write (held: adds them to the next one). A
    /// write that fails shuts the connection down (its reader then reports
    /// the relay and its workers lost) and fails every later send too.
    pub fn send(&self, frames: &[Frame]) -> Result<(), String> {
        let mut w = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &w.failed {
            return Err(why.clone());
        }
        frames.iter().for_each(|f| f.encode(&mut w.buf));
        if w.held { Ok(()) } else { w.write() }
    }

    /// Holds the frames sent from now on until [`RelayOut::release`], which
    /// writes them together: a commit and the window after it reach a
    /// relay in one write (one system call and one wake-up on each side).
    pub fn hold(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).held = true;
    }

    /// Writes what was held, in one write. A failure is handled as a
    /// failed [`RelayOut::send`]'s.
    pub fn release(&self) -> Result<(), String> {
        let mut w = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !std::mem::replace(&mut w.held, false) || w.failed.is_some() || w.buf.is_empty() {
            return Ok(());
        }
        w.write()
    }
}

impl RelayWriter {
    fn write(&mut self) -> Result<(), String> {
        use std::io::Write;
        let RelayWriter { link, buf, failed, .. } = self;
        let written = link.write_all(buf);
        buf.clear();
        // A burst as large as a generation's messages is not kept here.
        if buf.capacity() > 1 << 20 {
            *buf = Vec::new();
        }
        written.map_err(|e| {
            let why = format!("writing to the relay at {}: {e}", peer(link.get_ref()));
            let _ = link.get_ref().shutdown(std::net::Shutdown::Both);
            *failed = Some(why.clone());
            why
        })
    }
}

/// Relays' writes held while it lives ([`RelayOut::hold`]), each released
/// in one write when it is dropped, on every path out of the scope that
/// holds it.
pub struct Held(Vec<RelayOut>);

impl Held {
    pub fn new(relays: impl IntoIterator<Item = RelayOut>) -> Self {
        let relays: Vec<RelayOut> = relays.into_iter().collect();
        relays.iter().for_each(RelayOut::hold);
        Held(relays)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // A relay whose write fails is shut; its reader reports it lost.
        for r in &self.0 {
            let _ = r.release();
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    /// A relay's writing side and the socket it writes to.
    fn pair() -> (RelayOut, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let out = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (peer, _) = l.accept().unwrap();
        peer.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        (RelayOut::new(Link::new(out, None)), peer)
    }

    fn line(conn: u64, text: &str) -> Frame {
        Frame::Line { conn, line: text.as_bytes().to_vec() }
    }

    /// Reads frames until `n` have arrived.
    fn read_frames(peer: &mut TcpStream, n: usize) -> Vec<Frame> {
        let (mut bytes, mut got) = (Vec::new(), Vec::new());
        while got.len() < n {
            let mut chunk = [0u8; 4096];
            let k = peer.read(&mut chunk).expect("the frames within 10 s");
            assert!(k > 0, "the connection closed after {} frames", got.len());
            bytes.extend_from_slice(&chunk[..k]);
            while let Some((frame, len)) = Frame::first(&bytes).unwrap() {
                bytes.drain(..len);
                got.push(frame);
            }
        }
        got
    }

    fn nothing_arrived(peer: &TcpStream) -> bool {
        peer.set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        let none = matches!((&*peer).read(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        peer.set_nonblocking(false).unwrap();
        none
    }

    #[test]
    fn frames_sent_while_held_are_written_together_in_order_when_released() {
        let (out, mut peer) = pair();
        out.send(&[line(1, "before")]).unwrap();
        assert_eq!(read_frames(&mut peer, 1), vec![line(1, "before")]);
        let held = Held::new([out.clone(), out.clone()]);
        out.send(&[line(1, "commit")]).unwrap();
        out.send(&[line(2, "window"), line(3, "window")]).unwrap();
        assert!(nothing_arrived(&peer), "a held frame was written before the release");
        drop(held);
        let want = vec![line(1, "commit"), line(2, "window"), line(3, "window")];
        assert_eq!(read_frames(&mut peer, 3), want);
        // Released, each send is written at once again.
        out.send(&[line(4, "after")]).unwrap();
        assert_eq!(read_frames(&mut peer, 1), vec![line(4, "after")]);
    }

    #[test]
    fn a_held_write_that_fails_on_release_fails_every_later_send() {
        let (out, peer) = pair();
        out.hold();
        out.send(&[line(1, "lost")]).unwrap();
        // The relay's end goes away; the release's write is refused, a
        // first one perhaps accepted before the reset comes back.
        drop(peer);
        let mut failed = out.release().err();
        for _ in 0..1000 {
            if failed.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
            failed = out.send(&[line(1, "again")]).err();
        }
        let why = failed.expect("a write to a closed connection fails");
        assert!(why.contains("writing to the relay at"), "{why}");
        assert_eq!(out.send(&[line(2, "later")]), Err(why));
    }
}
