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
//! A channel may instead be *authenticated only* ([`Keys::split_authenticated`]):
//! each frame (a 4-byte big-endian length, the bytes in clear, and a 32-byte
//! keyed BLAKE3 hash of the frame's count and bytes, under a key of that
//! direction and that connection) is refused when changed, dropped, replayed
//! or moved, but can be read on the way. The gradient ring uses it where a
//! job asks for it (`--gradients-in-clear`); docs/benchmarks.md has what
//! each costs.
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
/// Largest authenticated-only frame: small enough that the receiver checks
/// and passes on a segment's first bytes while its last are on the way.
const MAX_CLEAR: usize = 64 << 10;

/// The keys of one connection, both directions. Not `Clone`: two sealers
/// of one connection would count their messages from 0 twice (a nonce
/// reused), so the keys are split once.
#[cfg_attr(test, derive(Clone))]
pub struct Keys {
    noise: Arc<snow::StatelessTransportState>,
    /// Authentication-only keys: this side's sending one, and the peer's.
    mac_out: [u8; 32],
    mac_in: [u8; 32],
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(redacted)")
    }
}

impl Keys {
    pub(crate) fn new(state: snow::StatelessTransportState, mac_out: [u8; 32], mac_in: [u8; 32]) -> Self {
        Keys { noise: Arc::new(state), mac_out, mac_in }
    }

    /// The sending and the receiving half, encrypting.
    pub fn split(self) -> (Sealer, Opener) {
        (Sealer::new(Cipher::Noise(self.noise.clone())), Opener::new(Cipher::Noise(self.noise)))
    }

    /// The sending and the receiving half, authenticating only.
    pub fn split_authenticated(self) -> (Sealer, Opener) {
        (Sealer::new(Cipher::Mac(self.mac_out)), Opener::new(Cipher::Mac(self.mac_in)))
    }
}

/// How a channel's frames are protected.
#[derive(Clone)]
enum Cipher {
    /// Encrypted and authenticated (Noise transport messages).
    Noise(Arc<snow::StatelessTransportState>),
    /// In clear, authenticated with keyed BLAKE3.
    Mac([u8; 32]),
}

impl std::fmt::Debug for Cipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Cipher::Noise(_) => "encrypted",
            Cipher::Mac(_) => "authenticated",
        })
    }
}

/// Length of an authenticated-only frame's MAC.
const MAC: usize = 32;

/// The MAC of frame number `count` holding `data`.
fn mac(key: &[u8; 32], count: u64, data: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&count.to_be_bytes());
    h.update(data);
    h.finalize()
}

fn broken(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("the sealed channel is unusable: {what}"))
}

/// Seals what one side sends.
#[derive(Debug)]
pub struct Sealer {
    cipher: Cipher,
    count: u64,
}

impl Sealer {
    fn new(cipher: Cipher) -> Self {
        Sealer { cipher, count: 0 }
    }

    /// Appends `plain` to `out` as sealed frames.
    pub fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        let end = self.seal_at(plain, out, out.len())?;
        out.truncate(end);
        Ok(())
    }

    /// Writes `plain` as sealed frames into `out` from byte `at` on, growing
    /// it only where it is too short (a buffer kept between calls is not
    /// cleared again each time); returns where the frames end.
    pub fn seal_at(&mut self, plain: &[u8], out: &mut Vec<u8>, mut at: usize) -> io::Result<usize> {
        let room = |out: &mut Vec<u8>, end: usize| {
            if out.len() < end {
                out.resize(end, 0);
            }
        };
        for piece in plain.chunks(match self.cipher {
            Cipher::Noise(_) => MAX_PLAIN,
            Cipher::Mac(_) => MAX_CLEAR,
        }) {
            at = match &self.cipher {
                Cipher::Noise(keys) => {
                    let len = piece.len() + TAG;
                    room(out, at + 2 + len);
                    out[at..at + 2].copy_from_slice(&(len as u16).to_be_bytes());
                    let n = keys
                        .write_message(self.count, piece, &mut out[at + 2..at + 2 + len])
                        .map_err(|e| broken(&format!("sealing: {e}")))?;
                    debug_assert_eq!(n, len);
                    at + 2 + len
                }
                Cipher::Mac(key) => {
                    let end = at + 4 + piece.len() + MAC;
                    room(out, end);
                    out[at..at + 4].copy_from_slice(&(piece.len() as u32).to_be_bytes());
                    out[at + 4..end - MAC].copy_from_slice(piece);
                    out[end - MAC..end].copy_from_slice(mac(key, self.count, piece).as_bytes());
                    end
                }
            };
            self.count = self.count.checked_add(1).ok_or_else(|| broken("2^64 messages sent"))?;
        }
        Ok(at)
    }
}

/// Opens what the other side sent, from raw bytes in any pieces.
#[derive(Debug)]
pub struct Opener {
    cipher: Cipher,
    count: u64,
    /// Raw bytes not yet opened: `raw[start..end]` (the buffer is kept, not
    /// cleared, between reads).
    raw: Vec<u8>,
    start: usize,
    end: usize,
    broken: bool,
}

/// Where the next frame stands in an opener's buffer.
enum Next {
    /// More bytes are needed.
    Incomplete,
    /// A whole frame: its header's length, the payload's length, and the
    /// length of its plaintext.
    Whole { header: usize, payload: usize, plain: usize },
}

impl Opener {
    fn new(cipher: Cipher) -> Self {
        Opener { cipher, count: 0, raw: Vec::new(), start: 0, end: 0, broken: false }
    }

    fn refuse(&mut self, what: String) -> io::Error {
        self.broken = true;
        broken(&what)
    }

    /// Takes `raw` bytes as they came and appends to `plain` the contents
    /// of every frame they complete. A frame that fails to open is an
    /// error, now and on every later call.
    pub fn open(&mut self, raw: &[u8], plain: &mut Vec<u8>) -> io::Result<()> {
        self.spare(raw.len())[..raw.len()].copy_from_slice(raw);
        self.filled(raw.len());
        while let Some(len) = self.ready()? {
            let at = plain.len();
            plain.resize(at + len, 0);
            let n = self.open_next(&mut plain[at..])?;
            plain.truncate(at + n);
        }
        self.compact();
        Ok(())
    }

    /// The plaintext length of the next frame when it is here whole.
    fn ready(&mut self) -> io::Result<Option<usize>> {
        match self.next()? {
            Next::Whole { plain, .. } => Ok(Some(plain)),
            Next::Incomplete => Ok(None),
        }
    }

    fn next(&mut self) -> io::Result<Next> {
        if self.broken {
            return Err(broken("an earlier message failed its authentication"));
        }
        let pending = &self.raw[self.start..self.end];
        let (header, payload, plain) = match &self.cipher {
            Cipher::Noise(_) => {
                let Some(len) = pending.first_chunk::<2>() else { return Ok(Next::Incomplete) };
                let len = u16::from_be_bytes(*len) as usize;
                if len < TAG {
                    return Err(self.refuse(format!("a frame of {len} bytes is shorter than its tag")));
                }
                (2, len, len - TAG)
            }
            Cipher::Mac(_) => {
                let Some(len) = pending.first_chunk::<4>() else { return Ok(Next::Incomplete) };
                let len = u32::from_be_bytes(*len) as usize;
                if len > MAX_CLEAR {
                    return Err(self.refuse(format!("a frame of {len} bytes (at most {MAX_CLEAR})")));
                }
                (4, len + MAC, len)
            }
        };
        Ok(if pending.len() < header + payload {
            Next::Incomplete
        } else {
            Next::Whole { header, payload, plain }
        })
    }

    /// Opens the next frame, which is here whole, into `out` (at least its
    /// plaintext long); returns the plaintext's length.
    fn open_next(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let Next::Whole { header, payload, plain } = self.next()? else {
            return Err(broken("no whole frame to open"));
        };
        let frame = &self.raw[self.start + header..self.start + header + payload];
        let opened = match &self.cipher {
            Cipher::Noise(keys) => keys.read_message(self.count, frame, &mut out[..plain]).ok(),
            Cipher::Mac(key) => {
                let (data, tag) = frame.split_at(plain);
                let tag: [u8; MAC] = tag.try_into().expect("a MAC's length");
                // blake3::Hash compares in constant time.
                (mac(key, self.count, data) == blake3::Hash::from_bytes(tag)).then(|| {
                    out[..plain].copy_from_slice(data);
                    plain
                })
            }
        };
        let Some(n) = opened else {
            return Err(self.refuse(
                "a message failed its authentication (changed on the way, or not from this job's peer)"
                    .into(),
            ));
        };
        self.count += 1;
        self.start += header + payload;
        Ok(n)
    }

    /// Moves the bytes of an unfinished frame to the front of the buffer.
    fn compact(&mut self) {
        if self.start > 0 {
            self.raw.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// Room for at least `min` more raw bytes, to read into.
    fn spare(&mut self, min: usize) -> &mut [u8] {
        if self.raw.len() - self.end < min {
            self.compact();
            if self.raw.len() - self.end < min {
                self.raw.resize(self.end + min, 0);
            }
        }
        &mut self.raw[self.end..]
    }

    /// After reading into [`Self::spare`]: how many bytes came.
    fn filled(&mut self, got: usize) {
        self.end += got;
    }

    /// Whether bytes of an unfinished frame are waiting.
    pub fn midway(&self) -> bool {
        self.start < self.end
    }
}

/// The reading side of a channel: sealed when it has an [`Opener`], plain
/// otherwise (a job without a secret).
#[derive(Debug)]
pub struct SealedReader<R = TcpStream> {
    inner: R,
    opener: Option<Opener>,
    /// A frame's plaintext that did not fit the caller's buffer, from `pos` on.
    plain: Vec<u8>,
    pos: usize,
}

impl<R: Read> SealedReader<R> {
    pub fn new(inner: R, opener: Option<Opener>) -> Self {
        SealedReader { inner, opener, plain: Vec::new(), pos: 0 }
    }

    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// Whether a read returns bytes that are here already, without waiting
    /// for the connection: the rest of an opened message, or a whole sealed
    /// one received. Unsealed, nothing is known to be here.
    pub fn holds_whole(&mut self) -> bool {
        self.pos < self.plain.len() || self.opener.as_mut().is_some_and(|o| matches!(o.ready(), Ok(Some(_))))
    }
}

impl<R: Read> Read for SealedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(opener) = self.opener.as_mut() else { return self.inner.read(buf) };
        if self.pos < self.plain.len() {
            let n = buf.len().min(self.plain.len() - self.pos);
            buf[..n].copy_from_slice(&self.plain[self.pos..self.pos + n]);
            self.pos += n;
            return Ok(n);
        }
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if let Some(len) = opener.ready()? {
                if len == 0 {
                    // An empty frame says nothing (and 0 would read as the end).
                    opener.open_next(&mut [])?;
                    continue;
                }
                // Straight into the caller's buffer where it fits.
                if len <= buf.len() {
                    return opener.open_next(buf);
                }
                self.plain.resize(len, 0);
                let n = opener.open_next(&mut self.plain)?;
                self.plain.truncate(n);
                let n = n.min(buf.len());
                buf[..n].copy_from_slice(&self.plain[..n]);
                self.pos = n;
                return Ok(n);
            }
            // A timeout here leaves what came of a frame in the opener: the
            // next read goes on from it.
            const CHUNK: usize = 2 + MAX_MESSAGE;
            let room = opener.spare(CHUNK);
            let got = self.inner.read(room);
            opener.filled(*got.as_ref().unwrap_or(&0));
            match got? {
                0 if opener.midway() => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the channel ended inside a message",
                    ));
                }
                0 => return Ok(0),
                _ => {}
            }
        }
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
        let end = sealer.seal_at(&buf[..n], &mut self.frame, 0)?;
        // A frame goes out whole or the channel is broken: a half-written
        // frame cannot be taken back.
        self.inner.write_all(&self.frame[..end])?;
        Ok(n)
    }

    /// Sealed whole: one write to the socket for a message of any size up to a frame.
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let Some(sealer) = self.sealer.as_mut() else { return self.inner.write_all(buf) };
        let end = sealer.seal_at(buf, &mut self.frame, 0)?;
        self.inner.write_all(&self.frame[..end])
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
