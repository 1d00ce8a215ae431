//! A job channel after the secret's proof: every byte encrypted and
//! authenticated with the keys of the Noise handshake that ran inside that
//! proof (see [`super::auth`]).
//!
//! On the wire a sealed channel is a run of frames, each a 2-byte big-endian
//! length and one Noise transport message (at most 65,535 bytes: the
//! ciphertext and its 16-byte tag). Each direction counts its own messages,
//! and a message is opened with its count as the nonce: a frame that was
//! changed, dropped, replayed or moved fails to open, and the channel is
//! then unusable (reads keep failing), since a stream cipher's sequence
//! cannot be resynchronised.
//!
//! The two directions are separate values ([`Sealer`], [`Opener`]) so that a
//! reader thread and a writer thread need no lock between them; the
//! [`SealedReader`], [`SealedWriter`] and [`SealedStream`] wrappers put them
//! on a socket as `Read` and `Write`.

use std::{
    io::{self, Read, Write},
    net::TcpStream,
    sync::Arc,
};

/// Largest transport message Noise allows.
const MAX_MESSAGE: usize = 65_535;
/// Bytes a message adds to its plaintext: the AEAD tag.
const TAG: usize = 16;
/// Largest plaintext one frame carries.
pub const MAX_PLAIN: usize = MAX_MESSAGE - TAG;

/// The keys of one connection, both directions.
#[derive(Clone)]
pub struct Keys(Arc<snow::StatelessTransportState>);

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(redacted)")
    }
}

impl Keys {
    pub(crate) fn new(state: snow::StatelessTransportState) -> Self {
        Keys(Arc::new(state))
    }

    /// The sending and the receiving half.
    pub fn split(self) -> (Sealer, Opener) {
        (
            Sealer { keys: self.0.clone(), count: 0 },
            Opener { keys: self.0, count: 0, raw: Vec::new(), start: 0, broken: false },
        )
    }
}

fn broken(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("the sealed channel is unusable: {what}"))
}

/// Seals what one side sends.
#[derive(Debug)]
pub struct Sealer {
    keys: Arc<snow::StatelessTransportState>,
    count: u64,
}

impl Sealer {
    /// Appends `plain` to `out` as sealed frames.
    pub fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        for piece in plain.chunks(MAX_PLAIN) {
            let at = out.len();
            let len = piece.len() + TAG;
            out.resize(at + 2 + len, 0);
            out[at..at + 2].copy_from_slice(&(len as u16).to_be_bytes());
            let n = self
                .keys
                .write_message(self.count, piece, &mut out[at + 2..])
                .map_err(|e| broken(&format!("sealing: {e}")))?;
            debug_assert_eq!(n, len);
            self.count = self.count.checked_add(1).ok_or_else(|| broken("2^64 messages sent"))?;
        }
        // An empty write still says something (a keep-alive of zero bytes is
        // not sent: there is nothing to seal).
        Ok(())
    }
}

/// Opens what the other side sent, from raw bytes in any pieces.
#[derive(Debug)]
pub struct Opener {
    keys: Arc<snow::StatelessTransportState>,
    count: u64,
    /// Raw bytes not yet a whole frame (from `start` on).
    raw: Vec<u8>,
    start: usize,
    broken: bool,
}

impl Opener {
    /// Takes `raw` bytes as they came and appends to `plain` the contents
    /// of every frame they complete. A frame that fails to open is an
    /// error, now and on every later call.
    pub fn open(&mut self, raw: &[u8], plain: &mut Vec<u8>) -> io::Result<()> {
        if self.broken {
            return Err(broken("an earlier message failed its authentication"));
        }
        self.raw.extend_from_slice(raw);
        loop {
            let pending = &self.raw[self.start..];
            if pending.len() < 2 {
                break;
            }
            let len = u16::from_be_bytes([pending[0], pending[1]]) as usize;
            if len < TAG {
                self.broken = true;
                return Err(broken(&format!("a frame of {len} bytes is shorter than its tag")));
            }
            if pending.len() < 2 + len {
                break;
            }
            let at = plain.len();
            plain.resize(at + len - TAG, 0);
            match self.keys.read_message(self.count, &pending[2..2 + len], &mut plain[at..]) {
                Ok(n) => plain.truncate(at + n),
                Err(_) => {
                    plain.truncate(at);
                    self.broken = true;
                    return Err(broken(
                        "a message failed its authentication (changed on the way, or not from this job's peer)",
                    ));
                }
            }
            self.count += 1;
            self.start += 2 + len;
        }
        if self.start > 0 && self.start * 2 >= self.raw.len() {
            self.raw.drain(..self.start);
            self.start = 0;
        }
        Ok(())
    }

    /// Whether bytes of an unfinished frame are waiting.
    pub fn midway(&self) -> bool {
        self.start < self.raw.len()
    }
}

/// The reading side of a channel: sealed when it has an [`Opener`], plain
/// otherwise (a job without a secret).
#[derive(Debug)]
pub struct SealedReader<R = TcpStream> {
    inner: R,
    opener: Option<Opener>,
    plain: Vec<u8>,
    pos: usize,
    raw: Vec<u8>,
}

impl<R: Read> SealedReader<R> {
    pub fn new(inner: R, opener: Option<Opener>) -> Self {
        let raw = if opener.is_some() { vec![0u8; 2 + MAX_MESSAGE] } else { Vec::new() };
        SealedReader { inner, opener, plain: Vec::new(), pos: 0, raw }
    }

    pub fn get_ref(&self) -> &R {
        &self.inner
    }
}

impl<R: Read> Read for SealedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(opener) = self.opener.as_mut() else { return self.inner.read(buf) };
        while self.pos == self.plain.len() {
            self.plain.clear();
            self.pos = 0;
            // A timeout here leaves what came of a frame in the opener: the
            // next read goes on from it.
            let n = self.inner.read(&mut self.raw)?;
            if n == 0 {
                if opener.midway() {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the channel ended inside a message"));
                }
                return Ok(0);
            }
            opener.open(&self.raw[..n], &mut self.plain)?;
        }
        let n = buf.len().min(self.plain.len() - self.pos);
        buf[..n].copy_from_slice(&self.plain[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// The writing side of a channel: sealed when it has a [`Sealer`], plain
/// otherwise.
#[derive(Debug)]
pub struct SealedWriter<W = TcpStream> {
    inner: W,
    sealer: Option<Sealer>,
    frame: Vec<u8>,
}

impl<W: Write> SealedWriter<W> {
    pub fn new(inner: W, sealer: Option<Sealer>) -> Self {
        SealedWriter { inner, sealer, frame: Vec::new() }
    }

    pub fn get_ref(&self) -> &W {
        &self.inner
    }

    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }
}

impl<W: Write> Write for SealedWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let Some(sealer) = self.sealer.as_mut() else { return self.inner.write(buf) };
        let n = buf.len().min(MAX_PLAIN);
        self.frame.clear();
        sealer.seal(&buf[..n], &mut self.frame)?;
        // A frame goes out whole or the channel is broken: a half-written
        // frame cannot be taken back.
        self.inner.write_all(&self.frame)?;
        Ok(n)
    }

    /// Sealed whole: one write to the socket for a message of any size up to a frame.
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let Some(sealer) = self.sealer.as_mut() else { return self.inner.write_all(buf) };
        self.frame.clear();
        sealer.seal(buf, &mut self.frame)?;
        self.inner.write_all(&self.frame)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Both sides of a channel over one TCP connection.
#[derive(Debug)]
pub struct SealedStream {
    pub reader: SealedReader<TcpStream>,
    pub writer: SealedWriter<TcpStream>,
}

impl SealedStream {
    /// Puts `stream` under `keys` (none: plain).
    pub fn new(stream: TcpStream, keys: Option<Keys>) -> io::Result<Self> {
        let (sealer, opener) = match keys {
            Some(k) => {
                let (s, o) = k.split();
                (Some(s), Some(o))
            }
            None => (None, None),
        };
        let reader = SealedReader::new(stream.try_clone()?, opener);
        Ok(SealedStream { reader, writer: SealedWriter::new(stream, sealer) })
    }

    pub fn get_ref(&self) -> &TcpStream {
        self.writer.get_ref()
    }
}

impl Read for SealedStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
}

impl Write for SealedStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.writer.write(buf)
    }
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.writer.write_all(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.writer.flush()
    }
}
