//! What clients and servers say on a parameter-server connection (sealed,
//! after the job's handshake on the `ps` channel): each message a frame of
//! a JSON header and a binary body,
//!
//! ```text
//! u32 LE header length | header (JSON) | u32 LE body length | body
//! ```
//!
//! where a body is little-endian `u64` ids followed by `f32` values: rows
//! and gradients travel as raw floats, not as JSON numbers.

use super::server::{Mark, PushTag, Pushed, Stats};
use super::table::TableSpec;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// Largest header: a table spec or an error is far smaller.
const MAX_HEADER: usize = 1 << 20;
/// Largest body: 256 MiB (exports and copies go a few shards at a time).
pub const MAX_BODY: usize = 256 << 20;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// Makes the table if it is new here: empty, or with this server's
    /// shards of it from a checkpoint (`restore`).
    Declare {
        table: TableSpec,
        mark: Mark,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        restore: Option<Restore>,
    },
    /// The table as it was after its steps before `step`: the body is its
    /// ids, their update counts (as u64) and its rows.
    Export {
        table: String,
        step: u64,
        /// Only these shards (None: all).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shards: Option<Vec<u32>>,
        /// Only the rows the steps from this one on changed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since: Option<u64>,
        /// The generation whose servers the asker knows: refused by a
        /// server that gave shards away in a newer one (it would leave
        /// their rows out).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        generation: Option<u64>,
    },
    /// Rows copied from another server (the body as an export's), the
    /// table made as of `mark` if it is new.
    Import {
        table: TableSpec,
        mark: Mark,
        rows: usize,
    },
    /// A new generation for every table (rolled back to its base).
    Enter {
        mark: Mark,
    },
    /// Forget these shards of every table: they moved.
    Drop {
        shards: Vec<u32>,
    },
    /// Forget every table: the job goes back to a checkpoint, from which
    /// the tables are made again.
    Reset,
    /// Forget how to undo the steps before `step`.
    Trim {
        step: u64,
    },
    /// Rows of the body's ids, once the steps before `need` are applied;
    /// with `peek`, rows not held are not made (their initial values).
    Pull {
        table: String,
        mark: Mark,
        need: u64,
        #[serde(default)]
        peek: bool,
    },
    /// [`Request::Pull`] of several tables at once: the body is each
    /// table's ids in turn (`tables`: each one's name and count of ids);
    /// the answer, each table's rows in turn.
    PullMany {
        tables: Vec<(String, usize)>,
        mark: Mark,
        need: u64,
        #[serde(default)]
        peek: bool,
    },
    /// The body: `ids` ids, then their gradients.
    Push {
        table: String,
        tag: PushTag,
        ids: usize,
    },
    Stats,
}

/// Where a table's rows come from when a server makes it: the checkpoint
/// at `path` in the job's checkpoint `location`, of which the server keeps
/// the shards it owns among `servers`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Restore {
    pub location: std::path::PathBuf,
    pub path: std::path::PathBuf,
    pub servers: Vec<u64>,
    /// Servers holding each shard: a server keeps the shards it owns or
    /// is a replica of.
    #[serde(default = "one")]
    pub replicas: usize,
}

fn one() -> usize {
    1
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Response {
    /// Done; a pull's rows are the body.
    Ok {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pushed: Option<Pushed>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stats: Option<Stats>,
        /// An export's table and its rows in the body.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exported: Option<(TableSpec, usize)>,
    },
    Refused {
        error: String,
        /// The request's generation is over (a newer one asked): the step
        /// is redone in the next generation.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        over: bool,
        /// The server is at its memory bound: new rows wait for more servers.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        full: bool,
        /// The answer would pass the wire's bound on a body: fewer shards
        /// at a time are to be asked for.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        too_large: bool,
    },
}

impl Response {
    pub fn ok() -> Self {
        Response::Ok { pushed: None, stats: None, exported: None }
    }
}

/// Writes one frame.
pub fn write(w: &mut impl Write, header: &impl Serialize, body: &[u8]) -> io::Result<()> {
    if body.len() > MAX_BODY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a body of {} bytes passes the wire's bound of {MAX_BODY} bytes: ask for fewer rows at a time",
                body.len()
            ),
        ));
    }
    let head = serde_json::to_vec(header).map_err(io::Error::other)?;
    let mut frame = Vec::with_capacity(8 + head.len() + body.len());
    frame.extend_from_slice(&(head.len() as u32).to_le_bytes());
    frame.extend_from_slice(&head);
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    w.write_all(&frame)?;
    w.flush()
}

/// Reads one frame; `None` when the peer closed the connection between frames.
pub fn read<H: for<'de> Deserialize<'de>>(r: &mut impl Read) -> io::Result<Option<(H, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        other => other?,
    }
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_HEADER {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a header of {n} bytes")));
    }
    let mut head = vec![0u8; n];
    r.read_exact(&mut head)?;
    let header = serde_json::from_slice(&head)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("a header that is not one: {e}")))?;
    r.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_BODY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a body of {n} bytes (at most {MAX_BODY})"),
        ));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body)?;
    Ok(Some((header, body)))
}

/// `ids` then `values`, little-endian.
pub fn encode(ids: &[u64], values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ids.len() * 8 + values.len() * 4);
    ids.iter().for_each(|i| out.extend_from_slice(&i.to_le_bytes()));
    values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
    out
}

/// `ids` ids and then floats to the end; `None` if the body does not split so.
pub fn decode(body: &[u8], ids: usize) -> Option<(Vec<u64>, Vec<f32>)> {
    let split = ids.checked_mul(8).filter(|&n| n <= body.len())?;
    let (a, b) = body.split_at(split);
    if b.len() % 4 != 0 {
        return None;
    }
    let ids = a.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    let values = b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
    Some((ids, values))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_ones_are_errors() {
        let mut buf = Vec::new();
        let req = Request::Pull { table: "t".into(), mark: Mark::default(), need: 3, peek: false };
        write(&mut buf, &req, &encode(&[1, u64::MAX], &[0.5])).unwrap();
        let (back, body): (Request, Vec<u8>) = read(&mut buf.as_slice()).unwrap().unwrap();
        assert!(matches!(back, Request::Pull { need: 3, .. }));
        assert_eq!(decode(&body, 2), Some((vec![1, u64::MAX], vec![0.5])));
        assert_eq!(decode(&body, 3), None, "more ids than bytes");
        assert!(read::<Request>(&mut [].as_slice()).unwrap().is_none(), "closed between frames");
        let mut huge = Vec::new();
        huge.extend_from_slice(&(MAX_HEADER as u32 + 1).to_le_bytes());
        assert!(read::<Request>(&mut huge.as_slice()).is_err());
        let mut junk = Vec::new();
        write(&mut junk, &"not a request", &[]).unwrap();
        let e = read::<Request>(&mut junk.as_slice()).unwrap_err();
        assert!(e.to_string().contains("not one"), "{e}");
    }
}
