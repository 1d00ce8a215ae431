//! The wire between a host's relay and the coordinator ([`crate::control::relay`]):
//! the channel a relay claims, and the frames inside the sealed channel: a
//! kind byte, the connection's number on the relay (u64, little-endian),
//! the payload's length (u32) and the payload. Read by the coordinator's
//! inbox and the relay, written by the coordinator's outbox and the relay.

use crate::control::hostwindow::{HostDone, HostGeneration, HostWindow};
use edl_host_gpu::comm::auth::Claim;
use std::{
    io::{self, Read, Write},
    sync::mpsc,
    time::{Duration, Instant},
};

/// The channel a relay claims on the coordinator's control port.
pub const CHANNEL: &str = "relay";

/// The relay to the coordinator: a worker proved the secret with this claim.
const OPEN: u8 = 1;
/// A line between a worker and the coordinator (either way).
const LINE: u8 = 2;
/// The relay to the coordinator: a worker's connection ended, and why (the
/// coordinator to the relay: close it).
const CLOSED: u8 = 3;
/// The relay to the coordinator: it is alive.
const BEAT: u8 = 4;
/// The coordinator to the relay: a window for consecutive ranks of its host.
const WINDOW: u8 = 5;
/// The relay to the coordinator: such a window, reported by all its ranks as one.
const DONE: u8 = 6;
/// The coordinator to the relay: one line for several of its workers.
const FAN: u8 = 7;
/// The coordinator to the relay: a new generation for consecutive ranks of its host.
const GENERATION: u8 = 8;

/// A frame's payload may not exceed this (a control line's own bound).
pub(crate) const MAX_PAYLOAD: usize = 64 << 20;
/// A frame's head: its kind, its connection's number, its payload's length.
pub(crate) const FRAME_HEADER: usize = 1 + 8 + 4;

/// One frame between relay and coordinator.
#[derive(Debug, PartialEq)]
pub enum Frame {
    Open { conn: u64, claim: Claim },
    Line { conn: u64, line: Vec<u8> },
    Closed { conn: u64, why: String },
    Beat,
    Window(Box<HostWindow>),
    Done(Box<HostDone>),
    Fan { conns: Vec<u64>, line: Vec<u8> },
    Generation(Box<HostGeneration>),
}

impl Frame {
    /// Whether `bytes` begin with a whole frame.
    pub(crate) fn whole_at_start(bytes: &[u8]) -> bool {
        bytes.get(9..FRAME_HEADER).is_some_and(|len| {
            let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
            bytes.len() - FRAME_HEADER >= len
        })
    }

    /// Appends the frame, as it goes on the wire, to `out`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        let (kind, conn, payload): (u8, u64, std::borrow::Cow<[u8]>) = match self {
            Frame::Open { conn, claim } => {
                (OPEN, *conn, serde_json::to_vec(claim).expect("a claim always encodes").into())
            }
            Frame::Line { conn, line } => (LINE, *conn, line.as_slice().into()),
            Frame::Closed { conn, why } => (CLOSED, *conn, why.as_bytes().into()),
            Frame::Beat => (BEAT, 0, (&[][..]).into()),
            Frame::Window(w) => (WINDOW, 0, serde_json::to_vec(w).expect("a window always encodes").into()),
            Frame::Generation(g) => {
                (GENERATION, 0, serde_json::to_vec(g).expect("a generation always encodes").into())
            }
            Frame::Done(d) => (DONE, 0, serde_json::to_vec(d).expect("a report always encodes").into()),
            Frame::Fan { conns, line } => {
                let mut p = Vec::with_capacity(4 + 8 * conns.len() + line.len());
                p.extend_from_slice(&(conns.len() as u32).to_le_bytes());
                conns.iter().for_each(|c| p.extend_from_slice(&c.to_le_bytes()));
                p.extend_from_slice(line);
                (FAN, 0, p.into())
            }
        };
        out.push(kind);
        out.extend_from_slice(&conn.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&payload);
    }

    /// The first frame of `bytes` and its length on the wire, once it has
    /// all arrived (`Ok(None)` until then); a frame announcing more than
    /// the bound is refused at its head.
    pub fn first(bytes: &[u8]) -> io::Result<Option<(Frame, usize)>> {
        let Some(head) = bytes.get(..FRAME_HEADER) else { return Ok(None) };
        let len = u32::from_le_bytes(head[9..13].try_into().expect("4 bytes")) as usize;
        if len > MAX_PAYLOAD {
            return Err(bad(format!("a frame of {len} bytes (at most {MAX_PAYLOAD})")));
        }
        let Some(whole) = bytes.get(..FRAME_HEADER + len) else { return Ok(None) };
        let frame = Frame::read(&mut &whole[..])?.expect("a whole frame is there");
        Ok(Some((frame, whole.len())))
    }

    /// The next frame; `Ok(None)` at a clean end between frames.
    pub fn read(r: &mut impl Read) -> io::Result<Option<Frame>> {
        let mut head = [0u8; FRAME_HEADER];
        match r.read(&mut head[..1])? {
            0 => return Ok(None),
            _ => r.read_exact(&mut head[1..])?,
        }
        let conn = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(head[9..13].try_into().expect("4 bytes")) as usize;
        if len > MAX_PAYLOAD {
            return Err(bad(format!("a frame of {len} bytes (at most {MAX_PAYLOAD})")));
        }
        let mut payload = vec![0u8; len];
        r.read_exact(&mut payload)?;
        let text = |p: Vec<u8>| String::from_utf8(p).map_err(|_| bad("a frame's text is not UTF-8".into()));
        Ok(Some(match head[0] {
            OPEN => Frame::Open {
                conn,
                claim: serde_json::from_slice(&payload).map_err(|e| bad(format!("a worker's claim: {e}")))?,
            },
            LINE => Frame::Line { conn, line: payload },
            CLOSED => Frame::Closed { conn, why: text(payload)? },
            BEAT => Frame::Beat,
            GENERATION => Frame::Generation(
                serde_json::from_slice(&payload).map_err(|e| bad(format!("a host's generation: {e}")))?,
            ),
            WINDOW => Frame::Window(
                serde_json::from_slice(&payload).map_err(|e| bad(format!("a host's window: {e}")))?,
            ),
            DONE => Frame::Done(
                serde_json::from_slice(&payload).map_err(|e| bad(format!("a host's report: {e}")))?,
            ),
            FAN => {
                let n = payload.get(..4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize);
                let at = n.and_then(|n| n.checked_mul(8)).map(|b| b + 4).filter(|&at| at <= payload.len());
                let (Some(n), Some(at)) = (n, at) else { return Err(bad("a fan frame cut short".into())) };
                let conns = (0..n)
                    .map(|i| u64::from_le_bytes(payload[4 + 8 * i..12 + 8 * i].try_into().expect("8 bytes")))
                    .collect();
                Frame::Fan { conns, line: payload[at..].to_vec() }
            }
            k => return Err(bad(format!("a frame of unknown kind {k}"))),
        }))
    }
}

fn bad(detail: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, detail)
}

/// Writes what is queued on `rx`, made into frames by `encode`, to `out`:
/// each burst in one write, until every sender is gone or a write fails.
/// Where `beat` is given, a heartbeat goes when nothing was written for
/// that long.
pub fn write_batches<T>(
    rx: mpsc::Receiver<T>,
    out: &mut impl Write,
    beat: Option<Duration>,
    mut encode: impl FnMut(T, &mut Vec<u8>),
) -> io::Result<()> {
    let mut buf = Vec::new();
    let mut wrote = Instant::now();
    loop {
        buf.clear();
        let first = match beat {
            Some(every) => match rx.recv_timeout(every.saturating_sub(wrote.elapsed())) {
                Ok(x) => Some(x),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            },
            None => match rx.recv() {
                Ok(x) => Some(x),
                Err(_) => return Ok(()),
            },
        };
        if let Some(x) = first {
            encode(x, &mut buf);
        }
        while buf.len() < MAX_PAYLOAD
            && let Ok(x) = rx.try_recv()
        {
            encode(x, &mut buf);
        }
        if buf.is_empty() && beat.is_some_and(|every| wrote.elapsed() >= every) {
            Frame::Beat.encode(&mut buf);
        }
        if !buf.is_empty() {
            out.write_all(&buf)?;
            wrote = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_read_back_as_written_and_bad_ones_are_refused() {
        let claim = Claim { job: "j".into(), channel: "control".into(), generation: 3, who: 7, protocol: 0 };
        let frames = vec![
            Frame::Open { conn: 1, claim },
            Frame::Line { conn: 1, line: b"{\"ready\":{}}\n".to_vec() },
            Frame::Beat,
            Frame::Closed { conn: 9, why: "gone".into() },
            Frame::Fan { conns: vec![3, 5, 8], line: b"{\"commit\":{}}\n".to_vec() },
            Frame::Fan { conns: vec![], line: Vec::new() },
            Frame::Generation(Box::new(HostGeneration {
                conns: vec![4, 6],
                first: 2,
                generation: crate::control::proto::Generation {
                    generation: 3,
                    rank: 2,
                    world: 5,
                    rendezvous: "127.0.0.1:9".into(),
                    rendezvous_key: "j/generation-3".into(),
                    committed_steps: 40,
                    init: None,
                    ps: None,
                },
            })),
        ];
        let mut bytes = Vec::new();
        for f in &frames {
            f.encode(&mut bytes);
        }
        let mut r = bytes.as_slice();
        let mut back = Vec::new();
        while let Some(f) = Frame::read(&mut r).unwrap() {
            back.push(f);
        }
        assert_eq!(back, frames);
        // Taken from a buffer as they arrive: nothing until a frame is whole.
        let mut at = 0;
        let mut taken = Vec::new();
        for end in 0..=bytes.len() {
            if let Some((f, len)) = Frame::first(&bytes[at..end]).unwrap() {
                taken.push(f);
                at += len;
            }
        }
        assert_eq!((taken, at), (frames, bytes.len()));

        // Cut inside a frame: an error, not a clean end.
        let mut cut = &bytes[..bytes.len() - 2];
        let mut err = None;
        loop {
            match Frame::read(&mut cut) {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        assert!(err.is_some(), "a frame cut short reads as an error");

        let mut unknown = vec![77u8];
        unknown.extend_from_slice(&[0; 12]);
        let e = Frame::read(&mut unknown.as_slice()).unwrap_err();
        assert!(e.to_string().contains("unknown kind 77"), "{e}");

        let mut fan = vec![FAN];
        fan.extend_from_slice(&0u64.to_le_bytes());
        fan.extend_from_slice(&8u32.to_le_bytes());
        fan.extend_from_slice(&5u32.to_le_bytes());
        fan.extend_from_slice(&[0; 4]);
        let e = Frame::read(&mut fan.as_slice()).unwrap_err();
        assert!(e.to_string().contains("cut short"), "{e}");

        let mut huge = vec![LINE];
        huge.extend_from_slice(&1u64.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        let e = Frame::read(&mut huge.as_slice()).unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
        let e = Frame::first(&huge).unwrap_err();
        assert!(e.to_string().contains("at most"), "refused at its head, not waited for: {e}");
    }

    #[test]
    fn a_burst_of_frames_goes_out_in_one_write() {
        struct Writes(Vec<Vec<u8>>);
        impl Write for Writes {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.push(b.to_vec());
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let (tx, rx) = mpsc::channel();
        for conn in 0..50 {
            tx.send(Frame::Line { conn, line: b"x\n".to_vec() }).unwrap();
        }
        drop(tx);
        let mut out = Writes(Vec::new());
        write_batches(rx, &mut out, None, |f: Frame, buf| f.encode(buf)).unwrap();
        assert_eq!(out.0.len(), 1, "fifty queued frames, one write");
        let mut r = out.0[0].as_slice();
        let mut n = 0;
        while let Some(Frame::Line { conn, .. }) = Frame::read(&mut r).unwrap() {
            assert_eq!(conn, n);
            n += 1;
        }
        assert_eq!(n, 50);
    }

    #[test]
    fn a_burst_that_makes_no_frame_still_keeps_the_heartbeat() {
        let (tx, rx) = mpsc::channel();
        for _ in 0..3 {
            tx.send(()).unwrap();
        }
        drop(tx);
        let mut out = Vec::new();
        write_batches(rx, &mut out, Some(Duration::ZERO), |(), _| {}).unwrap();
        let mut r = out.as_slice();
        let mut beats = 0;
        while let Some(f) = Frame::read(&mut r).unwrap() {
            assert_eq!(f, Frame::Beat, "nothing but heartbeats");
            beats += 1;
        }
        assert!(beats >= 1, "a heartbeat though the burst made no frame");
    }
}
