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
    /// Why a write failed: the connection is shut, and every later send
    /// fails at once with this.
    failed: Option<String>,
}

impl RelayOut {
    pub fn new(link: Link) -> Self {
        RelayOut(std::sync::Arc::new(std::sync::Mutex::new(RelayWriter {
            link,
            buf: Vec::new(),
            failed: None,
        })))
    }

    /// Writes `frames` in one write. A write that fails shuts the
    /// connection down (its reader then reports the relay and its workers
    /// lost) and fails every later send too.
    pub fn send(&self, frames: &[Frame]) -> Result<(), String> {
        use std::io::Write;
        let mut w = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let RelayWriter { link, buf, failed } = &mut *w;
        if let Some(why) = failed {
            return Err(why.clone());
        }
        buf.clear();
        frames.iter().for_each(|f| f.encode(buf));
        let written = link.write_all(buf);
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
