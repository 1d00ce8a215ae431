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
    /// The worker's number on the relay, and the relay's writer (a thread
    /// that sends what is queued in bursts).
    Relayed {
        conn: u64,
        /// The relay's connection here (its host's number, unique in the job).
        host: u64,
        relay: std::sync::mpsc::Sender<Frame>,
        name: String,
    },
}

impl Outbox {
    /// Writes one message as a JSON line.
    pub fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), ProtoError> {
        let line = encode(msg).map_err(|detail| ProtoError::Malformed { peer: self.peer(), detail })?;
        self.send_encoded(&line)
    }

    /// Writes a line made by [`encode`]. Through a relay it is queued: a
    /// relay that failed says so, and its workers' connections close.
    pub fn send_encoded(&mut self, line: &[u8]) -> Result<(), ProtoError> {
        match self {
            Outbox::Direct(stream) => send_encoded(stream, line),
            Outbox::Relayed { conn, relay, name, .. } => relay
                .send(Frame::Line { conn: *conn, line: line.to_vec() })
                .map_err(|_| ProtoError::Closed { peer: name.clone() }),
        }
    }

    /// Through a relay: its host's number, the worker's number on the
    /// relay, and the relay's writer.
    pub fn relay(&self) -> Option<(u64, u64, &std::sync::mpsc::Sender<Frame>)> {
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
