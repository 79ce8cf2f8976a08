//! The Shadowsocks outbound: its key, the start of a TCP connection and its
//! UDP sessions, for `none`, the AEAD methods of SIP004 (`aes-128-gcm`,
//! `aes-256-gcm`, `chacha20-ietf-poly1305`) and AEAD-2022 / SIP022
//! (`2022-blake3-aes-128-gcm`, `2022-blake3-aes-256-gcm`).
//!
//! The TCP stream's chunks are the pure crate's
//! (`kerntun_proto::framing::shadowsocks`): this module draws what a
//! request needs at random (salt, padding), reads the clock for it, and
//! hands the relay the stream's framing. `udp.rs` frames datagrams.
//!
//! `none` has no frames: the TCP stream is the target address followed by
//! the application's bytes, so once the address is out the socket is a plain
//! kernel socket and goes to the splice relay.
//!
//! Replay protection on what the server sends (an on-path attacker can
//! record and resend it; AEAD alone accepts a faithful copy):
//!
//! * TCP: every outbound remembers the salts of the last
//!   [`SALT_FILTER_CAPACITY`] server streams (the pure crate's `AeadKey`); a
//!   stream that opens with one of them is refused.
//! * SIP022 UDP: each session keeps a sliding window of the server's packet
//!   ids for each of the last [`SERVER_SESSIONS`] server sessions
//!   (`udp.rs`); an id seen before, or older than the window, is refused.
//! * Nothing is remembered, and no session state changes, before the AEAD
//!   tag of what is being remembered has verified.

use std::io;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use kerntun_proto::framing::shadowsocks::{AeadKey, AeadStream, MAX_PADDING, Request};
use shadowsocks_crypto::CipherKind;
use shadowsocks_crypto::utils::random_iv_or_salt;
use shadowsocks_crypto::v1::openssl_bytes_to_key;

use super::addr::{AddrError, Address};
use super::config::ShadowsocksMethod as Method;

mod udp;

pub use kerntun_proto::framing::shadowsocks::{AeadError, SALT_FILTER_CAPACITY};
pub use udp::{PACKET_WINDOW, SERVER_SESSIONS, UdpSession};

/// Why a Shadowsocks frame could not be built or read. Counted per
/// outbound; the app sees a reset (TCP) or the datagram is dropped (UDP).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShadowsocksError {
    /// A frame from the server the client cannot accept (a tag that does
    /// not verify, a replay, a header for another request...).
    #[error(transparent)]
    Frame(#[from] AeadError),
    /// A malformed address.
    #[error("address: {0}")]
    Address(#[from] AddrError),
    /// An AEAD-2022 key that is not base64 of the method's key length.
    #[error("{0}")]
    BadKey(String),
}

impl From<ShadowsocksError> for io::Error {
    fn from(e: ShadowsocksError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

impl Method {
    pub(crate) fn kind(self) -> CipherKind {
        match self {
            Method::None => CipherKind::NONE,
            Method::Aes128Gcm => CipherKind::AES_128_GCM,
            Method::Aes256Gcm => CipherKind::AES_256_GCM,
            Method::Chacha20IetfPoly1305 => CipherKind::CHACHA20_POLY1305,
            Method::Blake3Aes128Gcm => CipherKind::AEAD2022_BLAKE3_AES_128_GCM,
            Method::Blake3Aes256Gcm => CipherKind::AEAD2022_BLAKE3_AES_256_GCM,
        }
    }

    fn is_2022(self) -> bool {
        matches!(self, Method::Blake3Aes128Gcm | Method::Blake3Aes256Gcm)
    }
}

/// A method with its key, derived once at start, and the outbound's server
/// salt filter: every clone shares it, so all TCP sessions of one outbound
/// check against the same history.
#[derive(Clone)]
pub struct Key {
    method: Method,
    aead: AeadKey,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        write!(f, "Key({:?})", self.method)
    }
}

impl Key {
    /// SIP004 keys come from the password (EVP_BytesToKey, as every
    /// Shadowsocks implementation does); SIP022 keys are the password itself,
    /// base64 of exactly the method's key length.
    pub fn new(method: Method, password: &str) -> Result<Key, ShadowsocksError> {
        let kind = method.kind();
        let key: Vec<u8> = match method {
            Method::None => Vec::new(),
            _ if method.is_2022() => {
                let k = base64::engine::general_purpose::STANDARD
                    .decode(password.trim())
                    .map_err(|e| ShadowsocksError::BadKey(format!("key is not base64: {e}")))?;
                if k.len() != kind.key_len() {
                    return Err(ShadowsocksError::BadKey(format!(
                        "{} needs a {}-byte key (base64), got {} bytes",
                        kind,
                        kind.key_len(),
                        k.len()
                    )));
                }
                k
            }
            _ => {
                let mut k = vec![0u8; kind.key_len()];
                openssl_bytes_to_key(password.as_bytes(), &mut k);
                k
            }
        };
        Ok(Key {
            method,
            aead: AeadKey::new(kind, key.into_boxed_slice()),
        })
    }

    pub fn method(&self) -> Method {
        self.method
    }

    /// The derived key (tests compare it with shadowsocks-rust's).
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> &[u8] {
        self.aead.bytes()
    }
}

/// Seconds since the Unix epoch: the clock SIP022 timestamps are written
/// and checked with.
fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// SIP022: a random padding length in 1..=[`MAX_PADDING`].
fn random_padding_len() -> usize {
    let mut b = [0u8; 2];
    random_iv_or_salt(&mut b);
    1 + usize::from(u16::from_le_bytes(b)) % MAX_PADDING
}

/// The wire bytes and the stream framing of a new TCP connection.
#[derive(Debug)]
pub struct TcpSession {
    /// Salt and request header (AEAD), or the bare address (`none`): send first.
    pub header: Vec<u8>,
    /// `None` for the `none` method (no framing: splice).
    pub framing: Option<AeadStream>,
}

/// Start a TCP session to `target`: the request header goes out at once, so
/// the server connects to the target before the app's first byte (and
/// server-speaks-first protocols work).
pub fn tcp_session(k: &Key, target: &Address) -> Result<TcpSession, ShadowsocksError> {
    let mut header = Vec::with_capacity(64 + target.encoded_len() + MAX_PADDING);
    if k.method == Method::None {
        target.encode(&mut header)?;
        return Ok(TcpSession {
            header,
            framing: None,
        });
    }
    let mut address = Vec::with_capacity(target.encoded_len());
    target.encode(&mut address)?;
    let mut salt = vec![0u8; k.aead.kind().salt_len()];
    random_iv_or_salt(&mut salt);
    let req = Request {
        address: &address,
        salt: &salt,
        padding: if k.method.is_2022() {
            random_padding_len()
        } else {
            0
        },
    };
    let framing = AeadStream::client(&k.aead, req, unix_now, &mut header).ok_or_else(|| {
        // Unreachable for the configured methods: every one but `none` is
        // AEAD, the salt has its length and an address fits a chunk.
        ShadowsocksError::BadKey(format!("{} cannot start an AEAD stream", k.method.kind()))
    })?;
    Ok(TcpSession {
        header,
        framing: Some(framing),
    })
}

/// What the TCP and UDP tests share: a target and a working key for
/// every method.
#[cfg(test)]
mod fixtures {
    use super::*;

    /// 32 bytes, base64: a key for `2022-blake3-aes-256-gcm`.
    pub(super) const PSK32: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

    /// Every method with a key it accepts.
    pub(super) const KEYS: [(Method, &str); 6] = [
        (Method::None, ""),
        (Method::Aes128Gcm, "pw"),
        (Method::Aes256Gcm, "pw"),
        (Method::Chacha20IetfPoly1305, "pw"),
        (Method::Blake3Aes128Gcm, "AAECAwQFBgcICQoLDA0ODw=="),
        (Method::Blake3Aes256Gcm, PSK32),
    ];

    pub(super) fn target() -> Address {
        Address::Ip("198.19.1.2:7".parse().expect("a"))
    }
}

#[cfg(test)]
mod tests {
    use kerntun_proto::framing::Framing;

    use super::fixtures::{KEYS, PSK32, target};
    use super::*;

    #[test]
    fn keys_are_checked() {
        assert!(Key::new(Method::Blake3Aes256Gcm, PSK32).is_ok());
        assert!(matches!(
            Key::new(Method::Blake3Aes128Gcm, PSK32),
            Err(ShadowsocksError::BadKey(_))
        ));
        assert!(matches!(
            Key::new(Method::Blake3Aes256Gcm, "not base64!"),
            Err(ShadowsocksError::BadKey(_))
        ));
        assert_eq!(
            Key::new(Method::Aes256Gcm, "pw").expect("k").bytes().len(),
            32
        );
    }

    #[test]
    fn none_header_is_the_bare_address() {
        let k = Key::new(Method::None, "").expect("k");
        let s = tcp_session(&k, &target()).expect("s");
        assert_eq!(s.header, [1, 198, 19, 1, 2, 0, 7]);
        assert!(s.framing.is_none());
    }

    /// Every AEAD method starts a stream: a salt of the method's length,
    /// then sealed header chunks (the pure crate's tests read them back);
    /// each connection draws a salt of its own.
    #[test]
    fn aead_methods_start_a_framed_stream_with_a_fresh_salt() {
        for (m, pw) in KEYS.into_iter().filter(|&(m, _)| m != Method::None) {
            let k = Key::new(m, pw).expect("key");
            let salt_len = m.kind().salt_len();
            let (a, b) = (
                tcp_session(&k, &target()).expect("a"),
                tcp_session(&k, &target()).expect("b"),
            );
            assert_ne!(a.header[..salt_len], b.header[..salt_len], "{m:?}");
            let tag = m.kind().tag_len();
            let least = salt_len + 2 * tag + 7;
            assert!(a.header.len() >= least, "{m:?}: {} bytes", a.header.len());
            let mut framing = a.framing.expect("framed");
            let (seal, open) = framing.split();
            let mut wire = Vec::new();
            seal.seal(b"x", &mut wire);
            assert_eq!(wire.len(), 2 + tag + 1 + tag, "{m:?}: a length and a chunk");
            open.finish().expect("nothing received is a clean end");
        }
    }
}
