//! Proof of a job's secret on a connection, before anything else is said on
//! it: a mutual challenge-response with HMAC-SHA256. The secret never
//! crosses the wire; both sides' fresh nonces make an old exchange useless to
//! replay; and what the connection is for (its [`Claim`]: the job, the
//! channel, the generation) is bound into both proofs, so the accepting side
//! can refuse a process of another job or of an old generation by name.
//!
//! The exchange, in frames of a 4-byte little-endian length and the bytes:
//!
//! 1. acceptor -> connector: `EDLA2` and a 32-byte nonce `a`;
//! 2. connector -> acceptor: a 32-byte nonce `c`, the claim (JSON), and
//!    `HMAC(secret, "edl connector" | a | c | claim)`;
//! 3. acceptor -> connector: `ok` and `HMAC(secret, "edl acceptor" | c | a | claim)`,
//!    or `no` and the reason, after which it closes the connection.
//!
//! The same two messages carry a Noise handshake (`NNpsk0`: fresh X25519
//! keys on both sides, AES-256-GCM, BLAKE2s) whose pre-shared key is
//! `HMAC(secret, "edl channel key" | a | c | claim)`: only the two peers of
//! this exchange can derive it, and the session keys it yields (returned as
//! [`Keys`]) seal everything said on the connection afterwards (see
//! [`super::sealed`]). Its ephemeral keys make the traffic of a connection
//! unreadable later even to someone who learns the secret then. The Noise
//! message rides in message 2 after `c` (a 2-byte length and the message)
//! and in message 3 after the acceptor's proof.

pub use super::sealed::Keys;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::{
    fmt,
    io::{Read, Write},
    path::Path,
};

const HELLO: &[u8] = b"EDLA2";
/// The Noise protocol that keys a channel.
const NOISE: &str = "Noise_NNpsk0_25519_AESGCM_BLAKE2s";
/// Longest frame of the exchange: a claim is a few dozen bytes.
const MAX_FRAME: usize = 4096;

/// A job's secret: 32 random bytes, shown only as hex where it is handed on
/// (a file of mode 0600, an environment variable), never in `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; 32]);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(redacted)")
    }
}

impl Secret {
    /// A new secret from the operating system's random source.
    pub fn generate() -> Result<Secret, AuthError> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).map_err(|e| AuthError::Io(format!("random source: {e}")))?;
        Ok(Secret(b))
    }

    /// Parses the hex form (64 hex digits; surrounding whitespace ignored).
    pub fn from_hex(text: &str) -> Result<Secret, AuthError> {
        let bad = || AuthError::BadSecret(NOT_A_SECRET.into());
        let bytes = hex::decode(text.trim()).map_err(|_| bad())?;
        let b: [u8; 32] = bytes.try_into().map_err(|_| bad())?;
        Ok(Secret(b))
    }

    /// The hex form, for a secret file or a child's environment.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// What is wrong with a secret file's permissions, if anything: one
    /// that others on the host may read (group or world bits set) lets
    /// them join the job. A warning, not a refusal: a volume mounted from a
    /// Kubernetes Secret is 0644 unless its `defaultMode` says otherwise.
    pub fn exposure(path: &Path) -> Option<String> {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
        (mode & 0o077 != 0).then(|| {
            format!(
                "{}: the job's secret is readable by others on this host (mode {mode:03o}): anyone who reads it \
                 can join the job; chmod 600 it (or set the Secret volume's defaultMode to 0400)",
                path.display()
            )
        })
    }

    /// Reads a secret file.
    pub fn read(path: &Path) -> Result<Secret, AuthError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| AuthError::Io(format!("{}: cannot read the job secret: {e}", path.display())))?;
        Secret::from_hex(&text).map_err(|e| AuthError::BadSecret(format!("{}: {e}", path.display())))
    }

    /// Writes the secret to `path`, readable by its owner only (created with
    /// mode 0600, so it is never readable by others, not even briefly).
    pub fn write(&self, path: &Path) -> Result<(), AuthError> {
        use std::os::unix::fs::OpenOptionsExt;
        let io = |e: std::io::Error| {
            AuthError::Io(format!("{}: cannot write the job secret: {e}", path.display()))
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let _ = std::fs::remove_file(path);
        let mut f =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(io)?;
        f.write_all(self.to_hex().as_bytes()).map_err(io)
    }

    fn mac(&self, label: &[u8], parts: [&[u8]; 3]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0).expect("HMAC takes keys of any size");
        m.update(label);
        for p in parts {
            m.update(&(p.len() as u32).to_le_bytes());
            m.update(p);
        }
        m
    }
}

/// What a text that is not a job's secret is told.
const NOT_A_SECRET: &str =
    "not a job secret: a job secret is 64 hex digits (`openssl rand -hex 32` makes one)";

/// A job's identity on its connections: its name and its secret.
#[derive(Clone, Debug)]
pub struct JobAuth {
    pub job: String,
    pub secret: Secret,
}

impl JobAuth {
    /// What this job's process claims when it connects on `channel`.
    pub fn claim(&self, channel: &str, generation: u64, who: u64) -> Claim {
        Claim { job: self.job.clone(), channel: channel.into(), generation, who, protocol: 0 }
    }

    /// Checks a proven claim: this job, this channel, and (where given) the
    /// current generation; the error is the reason the peer is told.
    pub fn check(&self, c: &Claim, channel: &str, generation: Option<u64>) -> Result<(), String> {
        if c.job != self.job {
            return Err(format!("this is job {:?}, not {:?}", self.job, c.job));
        }
        if c.channel != channel {
            return Err(format!("this is the {channel} channel, not {}", c.channel));
        }
        match generation {
            Some(g) if c.generation < g => {
                Err(format!("generation {} is over (the job is at {g})", c.generation))
            }
            Some(g) if c.generation > g => {
                Err(format!("generation {} has not started (the job is at {g})", c.generation))
            }
            _ => Ok(()),
        }
    }
}

/// What a connection is for; the acceptor checks it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Claim {
    pub job: String,
    /// `control`, `rendezvous`, `ring`...
    pub channel: String,
    /// The generation the connector belongs to (0 where none applies yet).
    pub generation: u64,
    /// Who connects (a worker id, a rank), for the acceptor's messages.
    pub who: u64,
    /// The version of the protocol the connector speaks on the channel,
    /// where the channel's messages carry none of their own (0: it says
    /// none, as a connector of an edl before it did).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub protocol: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Claim {
    /// The same claim, saying the connector speaks `protocol`.
    pub fn speaking(self, protocol: u32) -> Claim {
        Claim { protocol, ..self }
    }
}

impl fmt::Display for Claim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of job {:?} (generation {}, from {})",
            self.channel, self.job, self.generation, self.who
        )
    }
}

/// Why an exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("the peer does not know the job's secret")]
    WrongSecret,
    #[error("refused: {0}")]
    Refused(String),
    #[error("not an edl peer, or a malformed exchange: {0}")]
    Malformed(String),
    #[error("{0}")]
    Io(String),
    /// What was given as the job's secret is not one.
    #[error("{0}")]
    BadSecret(String),
    /// The peer closed the connection before its part of the exchange (a
    /// probe of the port, a readiness check).
    #[error("the peer closed the connection during the secret's exchange")]
    Closed,
}

/// A read of the exchange that failed: the peer's closing it, or another error.
fn read_failed(e: std::io::Error) -> AuthError {
    use std::io::ErrorKind::{ConnectionReset, UnexpectedEof};
    match e.kind() {
        UnexpectedEof | ConnectionReset => AuthError::Closed,
        _ => AuthError::Io(format!("during the secret's exchange: {e}")),
    }
}

fn read_frame(s: &mut impl Read) -> Result<Vec<u8>, AuthError> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(read_failed)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(AuthError::Malformed(format!("a frame of {len} bytes")));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf).map_err(read_failed)?;
    Ok(buf)
}

fn write_frame<W: Write + ?Sized>(s: &mut W, parts: &[&[u8]]) -> Result<(), AuthError> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut buf = Vec::with_capacity(4 + len);
    buf.extend_from_slice(&(len as u32).to_le_bytes());
    for p in parts {
        buf.extend_from_slice(p);
    }
    s.write_all(&buf)
        .and_then(|_| s.flush())
        .map_err(|e| AuthError::Io(format!("during the secret's exchange: {e}")))
}

fn nonce() -> Result<[u8; 32], AuthError> {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n).map_err(|e| AuthError::Io(format!("random source: {e}")))?;
    Ok(n)
}

/// A stream whose reads all end by one deadline: a handshake that a peer
/// trickles a byte at a time ends when the deadline passes, not later (a
/// per-read timeout alone would be reset by every byte). The stream's own
/// read timeout is back as it was once the deadline is dropped: a
/// connection that stays idle after its handshake is not cut.
pub struct Deadline<'a> {
    stream: &'a mut std::net::TcpStream,
    until: std::time::Instant,
    before: Option<std::time::Duration>,
}

impl<'a> Deadline<'a> {
    pub fn new(stream: &'a mut std::net::TcpStream, within: std::time::Duration) -> Self {
        let before = stream.read_timeout().ok().flatten();
        Deadline { stream, until: std::time::Instant::now() + within, before }
    }
}

impl Drop for Deadline<'_> {
    fn drop(&mut self) {
        let _ = self.stream.set_read_timeout(self.before);
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the handshake's time is up"));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// The channel's pre-shared key for the Noise handshake of one exchange.
fn channel_key(secret: &Secret, a: &[u8], c: &[u8], claim: &[u8]) -> [u8; 32] {
    secret.mac(b"edl channel key", [a, c, claim]).finalize().into_bytes().into()
}

/// The key that authenticates one direction's frames of an
/// authenticated-only channel (see [`super::sealed`]).
fn mac_key(secret: &Secret, direction: &[u8], a: &[u8], c: &[u8], claim: &[u8]) -> [u8; 32] {
    secret.mac(direction, [a, c, claim]).finalize().into_bytes().into()
}

fn noise(e: snow::Error) -> AuthError {
    AuthError::Malformed(format!("the channel's key exchange: {e}"))
}

fn noise_builder(psk: &[u8; 32]) -> Result<snow::Builder<'_>, AuthError> {
    let params: snow::params::NoiseParams = NOISE.parse().map_err(noise)?;
    snow::Builder::new(params).prologue(HELLO).map_err(noise)?.psk(0, psk).map_err(noise)
}

/// Splits `bytes` after a 2-byte big-endian length and that many bytes.
fn take_sized(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = bytes.split_first_chunk::<2>()?;
    let len = u16::from_be_bytes(*len) as usize;
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// The accepting side: challenges the connector, checks its proof and then
/// its claim with `check` (`Err(reason)` refuses it, and the connector is
/// told the reason). Returns the proven claim and the keys that seal the
/// connection from now on. Bound the stream's reads before, as a whole (see
/// [`Deadline`]): a silent or trickling connector must not hold the acceptor.
pub fn accept(
    s: &mut (impl Read + Write),
    secret: &Secret,
    check: impl FnOnce(&Claim) -> Result<(), String>,
) -> Result<(Claim, Keys), AuthError> {
    let a = nonce()?;
    write_frame(s, &[HELLO, &a])?;
    let msg = read_frame(s)?;
    let short = || AuthError::Malformed("a short answer to the challenge".into());
    let (c, rest) = msg.split_first_chunk::<32>().ok_or_else(short)?;
    let (offer, rest) = take_sized(rest).ok_or_else(short)?;
    if rest.len() < 32 {
        return Err(short());
    }
    let (claim_bytes, proof) = rest.split_at(rest.len() - 32);
    let refuse = |s: &mut dyn Write, e: AuthError| {
        let reason = match &e {
            AuthError::Refused(r) => r.clone(),
            other => other.to_string(),
        };
        let _ = write_frame(s, &[b"no", reason.as_bytes()]);
        Err(e)
    };
    if secret.mac(b"edl connector", [&a, c, claim_bytes]).verify_slice(proof).is_err() {
        return refuse(s, AuthError::WrongSecret);
    }
    let claim: Claim = match serde_json::from_slice(claim_bytes) {
        Ok(c) => c,
        Err(e) => return refuse(s, AuthError::Malformed(format!("the claim: {e}"))),
    };
    if let Err(reason) = check(&claim) {
        return refuse(s, AuthError::Refused(reason));
    }
    let psk = channel_key(secret, &a, c, claim_bytes);
    let mut hs = noise_builder(&psk)?.build_responder().map_err(noise)?;
    let mut scratch = [0u8; 256];
    hs.read_message(offer, &mut scratch).map_err(noise)?;
    let mut reply = [0u8; 256];
    let n = hs.write_message(&[], &mut reply).map_err(noise)?;
    let keys = Keys::new(
        hs.into_stateless_transport_mode().map_err(noise)?,
        mac_key(secret, b"edl acceptor's frames", &a, c, claim_bytes),
        mac_key(secret, b"edl connector's frames", &a, c, claim_bytes),
    );
    let mine = secret.mac(b"edl acceptor", [c, &a, claim_bytes]).finalize().into_bytes();
    write_frame(s, &[b"ok", &mine, &reply[..n]])?;
    Ok((claim, keys))
}

/// The connecting side: answers the challenge with `claim` and checks that
/// the acceptor knows the secret too. Returns the keys that seal the
/// connection from now on.
pub fn connect(s: &mut (impl Read + Write), secret: &Secret, claim: &Claim) -> Result<Keys, AuthError> {
    let hello = read_frame(s)?;
    let a = hello.strip_prefix(HELLO).filter(|a| a.len() == 32).ok_or_else(|| {
        AuthError::Malformed("no challenge from the peer (another edl version, or another service?)".into())
    })?;
    let c = nonce()?;
    let claim_bytes = serde_json::to_vec(claim).map_err(|e| AuthError::Malformed(e.to_string()))?;
    let proof = secret.mac(b"edl connector", [a, &c, &claim_bytes]).finalize().into_bytes();
    let psk = channel_key(secret, a, &c, &claim_bytes);
    let mut hs = noise_builder(&psk)?.build_initiator().map_err(noise)?;
    let mut offer = [0u8; 256];
    let n = hs.write_message(&[], &mut offer).map_err(noise)?;
    write_frame(s, &[&c, &(n as u16).to_be_bytes(), &offer[..n], &claim_bytes, &proof])?;
    let answer = read_frame(s)?;
    if let Some(reason) = answer.strip_prefix(b"no") {
        let reason = String::from_utf8_lossy(reason).into_owned();
        return Err(if reason == AuthError::WrongSecret.to_string() {
            AuthError::WrongSecret
        } else {
            AuthError::Refused(reason)
        });
    }
    let theirs = answer
        .strip_prefix(b"ok")
        .ok_or_else(|| AuthError::Malformed("an answer that is neither ok nor no".into()))?;
    if theirs.len() < 32 {
        return Err(AuthError::Malformed("a short answer".into()));
    }
    let (theirs, reply) = theirs.split_at(32);
    secret.mac(b"edl acceptor", [&c, a, &claim_bytes]).verify_slice(theirs).map_err(|_| {
        AuthError::Malformed("the peer's proof is wrong: it does not know the job's secret".into())
    })?;
    let mut scratch = [0u8; 256];
    hs.read_message(reply, &mut scratch).map_err(noise)?;
    Ok(Keys::new(
        hs.into_stateless_transport_mode().map_err(noise)?,
        mac_key(secret, b"edl connector's frames", a, &c, &claim_bytes),
        mac_key(secret, b"edl acceptor's frames", a, &c, &claim_bytes),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    fn claim(job: &str, generation: u64) -> Claim {
        Claim { job: job.into(), channel: "ring".into(), generation, who: 3, protocol: 0 }
    }

    /// Runs one exchange over loopback; returns (acceptor's, connector's) results.
    fn exchange(
        acceptor: Secret,
        connector: Secret,
        c: Claim,
        check: impl FnOnce(&Claim) -> Result<(), String> + Send + 'static,
    ) -> (Result<(Claim, Keys), AuthError>, Result<Keys, AuthError>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(&mut s, &acceptor, check)
        });
        let mut s = TcpStream::connect(addr).unwrap();
        let mine = connect(&mut s, &connector, &c);
        (t.join().unwrap(), mine)
    }

    #[test]
    fn a_connection_idle_after_its_handshake_is_not_cut_by_the_handshake_s_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut s, _) = l.accept().unwrap();
        peer.write_all(b"hi").unwrap();
        let mut buf = [0u8; 2];
        Deadline::new(&mut s, std::time::Duration::from_millis(50)).read_exact(&mut buf).unwrap();
        assert_eq!(s.read_timeout().unwrap(), None, "no read timeout left behind");
        let wanted = Some(std::time::Duration::from_secs(7));
        s.set_read_timeout(wanted).unwrap();
        peer.write_all(b"hi").unwrap();
        Deadline::new(&mut s, std::time::Duration::from_millis(50)).read_exact(&mut buf).unwrap();
        assert_eq!(s.read_timeout().unwrap(), wanted, "the stream's own timeout kept");
    }

    #[test]
    fn a_peer_that_closes_without_a_word_is_told_apart_from_one_that_fails_the_exchange() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        drop(TcpStream::connect(l.local_addr().unwrap()).unwrap());
        let (mut s, _) = l.accept().unwrap();
        let secret = Secret::generate().unwrap();
        assert_eq!(accept(&mut s, &secret, |_| Ok(())).unwrap_err(), AuthError::Closed);
        let (theirs, _) = exchange(secret, Secret::generate().unwrap(), claim("j", 1), |_| Ok(()));
        assert_eq!(theirs.unwrap_err(), AuthError::WrongSecret);
    }

    #[test]
    fn both_sides_that_know_the_secret_agree_on_the_claim() {
        let k = Secret::generate().unwrap();
        let (a, c) =
            exchange(k.clone(), k, claim("j", 4), |c| (c.generation == 4).then_some(()).ok_or("old".into()));
        let (proven, acceptor_keys) = a.unwrap();
        assert_eq!(proven, claim("j", 4));
        let connector_keys = c.unwrap();

        // The keys both sides got seal one direction each, for the other side alone.
        let (mut seal_c, mut open_c) = connector_keys.split();
        let (mut seal_a, mut open_a) = acceptor_keys.split();
        let mut wire = Vec::new();
        seal_c.seal(b"the teacher token", &mut wire).unwrap();
        assert!(!wire.windows(7).any(|w| w == b"teacher"), "sealed bytes show no plaintext");
        let mut got = Vec::new();
        // In any pieces, as TCP may deliver them.
        for piece in wire.chunks(5) {
            open_a.open(piece, &mut got).unwrap();
        }
        assert_eq!(got, b"the teacher token");
        let mut back = Vec::new();
        seal_a.seal(b"welcome", &mut back).unwrap();
        let mut got = Vec::new();
        open_c.open(&back, &mut got).unwrap();
        assert_eq!(got, b"welcome");

        // A changed byte, a replayed frame: refused, and the channel stays refused.
        let mut changed = Vec::new();
        seal_c.seal(b"allow_native: false", &mut changed).unwrap();
        let last = changed.len() - 20;
        changed[last] ^= 1;
        let e = open_a.open(&changed, &mut Vec::new()).unwrap_err();
        assert!(e.to_string().contains("failed its authentication"), "{e}");
        let mut fresh = Vec::new();
        seal_c.seal(b"next", &mut fresh).unwrap();
        assert!(open_a.open(&fresh, &mut Vec::new()).is_err(), "a broken channel stays broken");
        assert!(open_c.open(&back, &mut Vec::new()).is_err(), "a replayed frame does not open");
    }

    #[test]
    fn authenticated_only_frames_are_in_clear_and_refused_when_changed_or_replayed() {
        let k = Secret::generate().unwrap();
        let (a, c) = exchange(k.clone(), k, claim("j", 1), |_| Ok(()));
        let (connector, acceptor) = (c.unwrap(), a.unwrap().1);
        let (mut seal, _) = connector.clone().split_authenticated();
        let (_, mut open) = acceptor.clone().split_authenticated();
        let mut wire = Vec::new();
        seal.seal(b"gradient bytes", &mut wire).unwrap();
        assert!(wire.windows(8).any(|w| w == b"gradient"), "in clear, as asked");
        let mut got = Vec::new();
        for piece in wire.chunks(3) {
            open.open(piece, &mut got).unwrap();
        }
        assert_eq!(got, b"gradient bytes");
        // A replay of the same frame carries the wrong count.
        assert!(open.open(&wire, &mut Vec::new()).is_err(), "a replayed frame");
        // One changed byte of the data.
        let (_, mut fresh) = acceptor.clone().split_authenticated();
        let mut changed = wire.clone();
        changed[6] ^= 0x40;
        assert!(fresh.open(&changed, &mut Vec::new()).is_err(), "a changed frame");
        // The connector's own key does not open its frames on the way back:
        // each direction has its own.
        let (_, mut reflected) = connector.split_authenticated();
        assert!(reflected.open(&wire, &mut Vec::new()).is_err(), "a reflected frame");
    }

    #[test]
    fn two_connections_of_the_same_job_get_different_keys() {
        let k = Secret::generate().unwrap();
        let (a1, _) = exchange(k.clone(), k.clone(), claim("j", 1), |_| Ok(()));
        let (a2, c2) = exchange(k.clone(), k, claim("j", 1), |_| Ok(()));
        let (mut seal1, _) = a1.unwrap().1.split();
        let (_, mut open2) = c2.unwrap().split();
        let _ = a2;
        let mut wire = Vec::new();
        seal1.seal(b"gradient", &mut wire).unwrap();
        assert!(
            open2.open(&wire, &mut Vec::new()).is_err(),
            "one connection's frames mean nothing on another"
        );
    }

    #[test]
    fn a_wrong_secret_is_refused_on_both_sides() {
        let (a, c) =
            exchange(Secret::generate().unwrap(), Secret::generate().unwrap(), claim("j", 1), |_| Ok(()));
        assert_eq!(a.unwrap_err(), AuthError::WrongSecret);
        assert_eq!(c.unwrap_err(), AuthError::WrongSecret);
    }

    #[test]
    fn a_claim_the_acceptor_rejects_is_refused_with_its_reason() {
        let k = Secret::generate().unwrap();
        let (a, c) =
            exchange(k.clone(), k, claim("j", 2), |c| Err(format!("generation {} is over", c.generation)));
        assert_eq!(a.unwrap_err(), AuthError::Refused("generation 2 is over".into()));
        assert_eq!(c.unwrap_err(), AuthError::Refused("generation 2 is over".into()));
    }

    #[test]
    fn a_peer_that_is_no_acceptor_is_named_as_such() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"\x05\0\0\0HTTP/").unwrap();
        });
        let mut s = TcpStream::connect(addr).unwrap();
        let e = connect(&mut s, &Secret::generate().unwrap(), &claim("j", 0)).unwrap_err();
        assert!(matches!(e, AuthError::Malformed(_)), "{e}");
        t.join().unwrap();
    }

    #[test]
    fn secrets_round_trip_through_hex_and_files_of_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let k = Secret::generate().unwrap();
        assert_eq!(Secret::from_hex(&k.to_hex()).unwrap(), k);
        assert!(Secret::from_hex("abc").is_err());
        assert_eq!(format!("{k:?}"), "Secret(redacted)");
        let dir = std::env::temp_dir().join(format!("edl-secret-{}", std::process::id()));
        let p = dir.join("secret");
        k.write(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(Secret::read(&p).unwrap(), k);
        assert_eq!(Secret::exposure(&p), None);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let said = Secret::exposure(&p).expect("a secret others may read is named");
        assert!(said.contains("mode 644") && said.contains("chmod 600"), "{said}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
