//! Records the job writes to a shared store carry a MAC under a key
//! derived from the job's secret, bound to the key they are stored under:
//! whoever can write to the store but lacks the secret can neither mark a
//! job finished, name another coordinator, nor fence one with a record of
//! its own (a record that does not verify is ignored, with a warning
//! naming its key). Teacher registrations carry one under a key of their
//! own, derived from the same secret, so that a teacher is trusted with
//! registering and not with the job.
//!
//! A sealed record is `edl-sealed-v1 <hex MAC>\n` followed by the record's
//! bytes; the MAC is BLAKE3 in keyed mode over the store key's length, the
//! store key and the bytes.

use edl_host_gpu::comm::auth::Secret;

const PREFIX: &[u8] = b"edl-sealed-v1 ";
/// Hex digits of a MAC.
const MAC_HEX: usize = 64;

/// A key that seals and opens records of one kind.
#[derive(Clone)]
pub struct RecordKey([u8; 32]);

impl std::fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecordKey(..)")
    }
}

/// Why a record could not be opened.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("{key} carries no MAC (not written by a party that knows the job's secret)")]
    Unsealed { key: String },
    #[error("{key} does not verify (altered, or written without the job's secret)")]
    Forged { key: String },
}

impl RecordKey {
    /// The key of the records the job's coordinators and launchers write
    /// (its state, handover, members' handles, the finished mark, leases).
    pub fn job_records(secret: &Secret) -> Self {
        Self::derive("edl 2026 job records", secret)
    }

    /// The key teachers register their endpoints with.
    pub fn teacher_registrations(secret: &Secret) -> Self {
        Self::derive("edl 2026 teacher registrations", secret)
    }

    fn derive(context: &str, secret: &Secret) -> Self {
        RecordKey(blake3::derive_key(context, secret.to_hex().as_bytes()))
    }

    /// A key given as 64 hex digits (a teacher's `--registration-key`).
    pub fn from_hex(text: &str) -> Option<Self> {
        hex::decode(text.trim()).ok()?.try_into().ok().map(RecordKey)
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    fn mac(&self, key: &str, value: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(&(key.len() as u64).to_le_bytes());
        h.update(key.as_bytes());
        h.update(value);
        h.finalize()
    }

    /// `value`, sealed for the store key `key`.
    pub fn seal(&self, key: &str, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(PREFIX.len() + MAC_HEX + 1 + value.len());
        out.extend_from_slice(PREFIX);
        out.extend_from_slice(self.mac(key, value).to_hex().as_bytes());
        out.push(b'\n');
        out.extend_from_slice(value);
        out
    }

    /// The record sealed in `sealed`, stored under `key`, if it verifies.
    pub fn open<'a>(&self, key: &str, sealed: &'a [u8]) -> Result<&'a [u8], SealError> {
        let unsealed = || SealError::Unsealed { key: key.to_string() };
        let rest = sealed.strip_prefix(PREFIX).ok_or_else(unsealed)?;
        if rest.len() < MAC_HEX + 1 || rest[MAC_HEX] != b'\n' {
            return Err(unsealed());
        }
        let (mac, value) = (&rest[..MAC_HEX], &rest[MAC_HEX + 1..]);
        let mac = std::str::from_utf8(mac).ok().and_then(|m| blake3::Hash::from_hex(m).ok());
        // blake3::Hash compares in constant time.
        match mac {
            Some(m) if m == self.mac(key, value) => Ok(value),
            _ => Err(SealError::Forged { key: key.to_string() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_record_opens_only_under_its_key_with_the_job_s_secret_and_unaltered() {
        let secret = Secret::generate().unwrap();
        let k = RecordKey::job_records(&secret);
        let sealed = k.seal("edl/jobs/a/state", br#"{"finished":false}"#);
        assert_eq!(k.open("edl/jobs/a/state", &sealed).unwrap(), br#"{"finished":false}"#);
        // Another store key (a record copied from another job), another
        // secret, another kind of key, or an altered record: refused.
        assert_eq!(
            k.open("edl/jobs/b/state", &sealed),
            Err(SealError::Forged { key: "edl/jobs/b/state".into() })
        );
        let other = RecordKey::job_records(&Secret::generate().unwrap());
        assert!(matches!(other.open("edl/jobs/a/state", &sealed), Err(SealError::Forged { .. })));
        let teachers = RecordKey::teacher_registrations(&secret);
        assert!(matches!(teachers.open("edl/jobs/a/state", &sealed), Err(SealError::Forged { .. })));
        let mut altered = sealed.clone();
        *altered.last_mut().unwrap() ^= 1;
        assert!(matches!(k.open("edl/jobs/a/state", &altered), Err(SealError::Forged { .. })));
        // A plain record, as a writer without the secret leaves it.
        let e = k.open("edl/jobs/a/state", br#"{"finished":true}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "edl/jobs/a/state carries no MAC (not written by a party that knows the job's secret)"
        );
        assert!(matches!(k.open("k", b"edl-sealed-v1 00\n{}"), Err(SealError::Unsealed { .. })));
    }

    #[test]
    fn a_registration_key_goes_out_as_hex_and_comes_back_the_same() {
        let k = RecordKey::teacher_registrations(&Secret::generate().unwrap());
        let back = RecordKey::from_hex(&k.to_hex()).unwrap();
        assert_eq!(back.open("t", &k.seal("t", b"10.0.0.1:8000")).unwrap(), b"10.0.0.1:8000");
        assert!(RecordKey::from_hex("abc").is_none());
        assert!(RecordKey::from_hex(&"zz".repeat(32)).is_none());
    }
}
