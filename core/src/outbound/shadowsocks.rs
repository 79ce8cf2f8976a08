//! Shadowsocks client framing, TCP and UDP: `none`, the AEAD methods of
//! SIP004 (`aes-128-gcm`, `aes-256-gcm`, `chacha20-ietf-poly1305`) and
//! AEAD-2022 / SIP022 (`2022-blake3-aes-128-gcm`, `2022-blake3-aes-256-gcm`).
//!
//! The ciphers, key derivations and nonce counters are shadowsocks-rust's own
//! (`shadowsocks-crypto`); this module only lays out the frames around them,
//! as sans-I/O encoders and decoders over byte slices, so they are testable
//! without sockets and every length read from the network is checked.
//!
//! `none` has no frames: the TCP stream is the target address followed by
//! the application's bytes, so once the address is out the socket is a plain
//! kernel socket and goes to the splice relay.

use std::io;
use std::ops::Range;
use std::time::{SystemTime, UNIX_EPOCH};

use aes::cipher::{BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use base64::Engine as _;
use shadowsocks_crypto::CipherKind;
use shadowsocks_crypto::utils::random_iv_or_salt;
use shadowsocks_crypto::v1::{Cipher as V1Cipher, openssl_bytes_to_key};
use shadowsocks_crypto::v2::tcp::TcpCipher;
use shadowsocks_crypto::v2::udp::UdpCipher;

use super::addr::{AddrError, Address};
use super::config::ShadowsocksMethod as Method;
use crate::relay::{Open, Seal};

/// SIP004: a chunk carries at most 0x3FFF bytes (the top two length bits
/// are reserved).
const AEAD_MAX_CHUNK: usize = 0x3FFF;
/// SIP022: chunks carry up to 0xFFFF bytes.
const AEAD2022_MAX_CHUNK: usize = 0xFFFF;
/// SIP022: a request with no initial payload carries 1..=900 bytes of padding.
const MAX_PADDING: usize = 900;
/// SIP022: timestamps more than 30 s off are replays or clock trouble.
const MAX_TIME_DIFF: u64 = 30;
const TYPE_CLIENT: u8 = 0;
const TYPE_SERVER: u8 = 1;

/// A Shadowsocks frame the client cannot accept. Counted per outbound; the
/// app sees a reset (TCP) or the datagram is dropped (UDP).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShadowsocksError {
    /// An AEAD tag did not verify (wrong key or method, or tampering).
    #[error("decryption failed (wrong password or method?)")]
    Decrypt,
    /// A SIP004 chunk length with the reserved bits set.
    #[error("chunk length {0:#06x} exceeds 0x3fff")]
    ChunkTooLong(usize),
    /// SIP022 header of the wrong direction.
    #[error("stream/packet type {0} where the server's (1) was expected")]
    BadType(u8),
    /// SIP022 timestamp too far from now.
    #[error("timestamp {0} is more than 30 s from now")]
    BadTimestamp(u64),
    /// SIP022 response header for another request (salt or session id).
    #[error("response belongs to another request")]
    NotOurs,
    /// The server closed the stream inside a frame.
    #[error("stream ended inside a frame")]
    Truncated,
    /// A datagram too short for its header.
    #[error("datagram too short")]
    ShortPacket,
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

/// A method with its key, derived once at start.
#[derive(Clone)]
pub struct Key {
    method: Method,
    key: Box<[u8]>,
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
            key: key.into_boxed_slice(),
        })
    }

    pub fn method(&self) -> Method {
        self.method
    }

    /// The derived key (tests compare it with shadowsocks-rust's).
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.key
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn check_time(ts: u64) -> Result<(), ShadowsocksError> {
    if unix_now().abs_diff(ts) > MAX_TIME_DIFF {
        Err(ShadowsocksError::BadTimestamp(ts))
    } else {
        Ok(())
    }
}

fn random_padding_len() -> usize {
    let mut b = [0u8; 2];
    random_iv_or_salt(&mut b);
    1 + usize::from(u16::from_le_bytes(b)) % MAX_PADDING
}

/// The per-direction stream cipher: nonce counter and subkey inside.
enum ChunkCipher {
    V1(V1Cipher),
    V2(TcpCipher),
}

impl ChunkCipher {
    fn new(k: &Key, salt: &[u8]) -> ChunkCipher {
        if k.method.is_2022() {
            ChunkCipher::V2(TcpCipher::new(k.method.kind(), &k.key, salt))
        } else {
            ChunkCipher::V1(V1Cipher::new(k.method.kind(), &k.key, salt))
        }
    }
    /// Encrypt `buf` in place; its last `tag` bytes receive the tag.
    fn seal(&mut self, buf: &mut [u8]) {
        match self {
            ChunkCipher::V1(c) => c.encrypt_packet(buf),
            ChunkCipher::V2(c) => c.encrypt_packet(buf),
        }
    }
    /// Decrypt and verify `buf` (ciphertext + tag, at least a tag long).
    fn open(&mut self, buf: &mut [u8]) -> bool {
        match self {
            ChunkCipher::V1(c) => c.decrypt_packet(buf),
            ChunkCipher::V2(c) => c.decrypt_packet(buf),
        }
    }
}

/// Append `plain` sealed as one AEAD message.
fn push_sealed(c: &mut ChunkCipher, tag: usize, plain: &[u8], out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(plain);
    out.resize(start + plain.len() + tag, 0);
    c.seal(&mut out[start..]);
}

/// The client-to-server half of an AEAD stream.
pub struct SsSeal {
    cipher: ChunkCipher,
    tag: usize,
    max_chunk: usize,
}

impl std::fmt::Debug for SsSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SsSeal")
    }
}

impl Seal for SsSeal {
    fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) {
        for chunk in plain.chunks(self.max_chunk) {
            let len = (chunk.len() as u16).to_be_bytes();
            push_sealed(&mut self.cipher, self.tag, &len, out);
            push_sealed(&mut self.cipher, self.tag, chunk, out);
        }
    }
}

/// The wire bytes and the two stream halves of a new TCP connection.
#[derive(Debug)]
pub struct TcpSession {
    /// Salt and request header (AEAD), or the bare address (`none`): send first.
    pub header: Vec<u8>,
    /// `None` for the `none` method (no framing: splice).
    pub codec: Option<(SsSeal, SsOpen)>,
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
            codec: None,
        });
    }
    let kind = k.method.kind();
    let (tag, salt_len) = (kind.tag_len(), kind.salt_len());
    let mut salt = vec![0u8; salt_len];
    random_iv_or_salt(&mut salt);
    header.extend_from_slice(&salt);
    let mut cipher = ChunkCipher::new(k, &salt);
    let mut addr = Vec::with_capacity(target.encoded_len() + 2 + MAX_PADDING);
    target.encode(&mut addr)?;
    let max_chunk = if k.method.is_2022() {
        // SIP022 request: a fixed header (type, timestamp, length of the
        // variable header), then the variable header (address, padding).
        let pad = random_padding_len();
        addr.extend_from_slice(&(pad as u16).to_be_bytes());
        addr.resize(addr.len() + pad, 0);
        let mut fixed = [0u8; 11];
        fixed[0] = TYPE_CLIENT;
        fixed[1..9].copy_from_slice(&unix_now().to_be_bytes());
        fixed[9..11].copy_from_slice(&(addr.len() as u16).to_be_bytes());
        push_sealed(&mut cipher, tag, &fixed, &mut header);
        push_sealed(&mut cipher, tag, &addr, &mut header);
        AEAD2022_MAX_CHUNK
    } else {
        // SIP004: the address is the start of the stream, in a normal chunk.
        push_sealed(
            &mut cipher,
            tag,
            &(addr.len() as u16).to_be_bytes(),
            &mut header,
        );
        push_sealed(&mut cipher, tag, &addr, &mut header);
        AEAD_MAX_CHUNK
    };
    let seal = SsSeal {
        cipher,
        tag,
        max_chunk,
    };
    let open = SsOpen {
        key: k.clone(),
        request_salt: if k.method.is_2022() { Some(salt) } else { None },
        cipher: None,
        state: OpenState::Salt,
        pending: Vec::new(),
    };
    Ok(TcpSession {
        header,
        codec: Some((seal, open)),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpenState {
    /// Waiting for the server's salt (and, SIP022, its fixed header).
    Salt,
    /// Waiting for an encrypted length.
    Length,
    /// Waiting for a payload chunk of this many bytes.
    Data(usize),
}

/// The server-to-client half of an AEAD stream.
pub struct SsOpen {
    key: Key,
    /// SIP022: our salt, which the server's response header must echo.
    request_salt: Option<Vec<u8>>,
    cipher: Option<ChunkCipher>,
    state: OpenState,
    /// Bytes of an incomplete frame, kept across reads (at most one frame).
    pending: Vec<u8>,
}

impl std::fmt::Debug for SsOpen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SsOpen({:?})", self.state)
    }
}

impl SsOpen {
    /// Bytes the current state needs.
    fn need(&self) -> usize {
        let kind = self.key.method.kind();
        let tag = kind.tag_len();
        match self.state {
            OpenState::Salt if self.key.method.is_2022() => {
                kind.salt_len() + 1 + 8 + kind.salt_len() + 2 + tag
            }
            OpenState::Salt => kind.salt_len(),
            OpenState::Length => 2 + tag,
            OpenState::Data(n) => n + tag,
        }
    }

    /// Consume one complete frame at the start of `frame` (exactly `need()`
    /// bytes), appending any plaintext to `out`.
    fn step(&mut self, frame: &mut [u8], out: &mut Vec<u8>) -> Result<(), ShadowsocksError> {
        let kind = self.key.method.kind();
        let tag = kind.tag_len();
        match self.state {
            OpenState::Salt => {
                let (salt, rest) = frame.split_at_mut(kind.salt_len());
                let mut c = ChunkCipher::new(&self.key, salt);
                if let Some(req) = &self.request_salt {
                    // SIP022 response: type, timestamp, request salt, length.
                    if !c.open(rest) {
                        return Err(ShadowsocksError::Decrypt);
                    }
                    let h = &rest[..rest.len() - tag];
                    if h[0] != TYPE_SERVER {
                        return Err(ShadowsocksError::BadType(h[0]));
                    }
                    let mut ts = [0u8; 8];
                    ts.copy_from_slice(&h[1..9]);
                    check_time(u64::from_be_bytes(ts))?;
                    let n = req.len();
                    if h[9..9 + n] != req[..] {
                        return Err(ShadowsocksError::NotOurs);
                    }
                    let len = usize::from(u16::from_be_bytes([h[9 + n], h[10 + n]]));
                    self.state = OpenState::Data(len);
                } else {
                    self.state = OpenState::Length;
                }
                self.cipher = Some(c);
            }
            OpenState::Length => {
                let c = self.cipher.as_mut().ok_or(ShadowsocksError::Truncated)?;
                if !c.open(frame) {
                    return Err(ShadowsocksError::Decrypt);
                }
                let len = usize::from(u16::from_be_bytes([frame[0], frame[1]]));
                if self.request_salt.is_none() && len > AEAD_MAX_CHUNK {
                    return Err(ShadowsocksError::ChunkTooLong(len));
                }
                self.state = OpenState::Data(len);
            }
            OpenState::Data(len) => {
                let c = self.cipher.as_mut().ok_or(ShadowsocksError::Truncated)?;
                if !c.open(frame) {
                    return Err(ShadowsocksError::Decrypt);
                }
                out.extend_from_slice(&frame[..len]);
                self.state = OpenState::Length;
            }
        }
        Ok(())
    }

    /// Sans-I/O core of [`Open::open`].
    pub fn feed(&mut self, mut wire: &[u8], out: &mut Vec<u8>) -> Result<(), ShadowsocksError> {
        // Finish a frame started in an earlier read.
        if !self.pending.is_empty() {
            let need = self.need();
            let take = (need - self.pending.len()).min(wire.len());
            self.pending.extend_from_slice(&wire[..take]);
            wire = &wire[take..];
            if self.pending.len() < need {
                return Ok(());
            }
            let mut frame = std::mem::take(&mut self.pending);
            self.step(&mut frame, out)?;
        }
        // Whole frames straight from the read buffer (copied once to decrypt
        // in place: the read buffer is shared with the next read).
        let mut scratch = Vec::new();
        loop {
            let need = self.need();
            if wire.len() < need {
                break;
            }
            scratch.clear();
            scratch.extend_from_slice(&wire[..need]);
            self.step(&mut scratch, out)?;
            wire = &wire[need..];
        }
        if !wire.is_empty() {
            self.pending.extend_from_slice(wire);
        }
        Ok(())
    }
}

impl Open for SsOpen {
    fn open(&mut self, wire: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        Ok(self.feed(wire, out)?)
    }
    fn finish(&mut self) -> io::Result<()> {
        // EOF between frames is clean (also before the server's first byte);
        // inside one, or after a length without its chunk, it is not.
        if self.pending.is_empty() && matches!(self.state, OpenState::Length | OpenState::Salt) {
            Ok(())
        } else {
            Err(ShadowsocksError::Truncated.into())
        }
    }
}

/// UDP: one datagram per packet, each self-contained (SIP004), or a session
/// with packet ids (SIP022).
pub struct UdpSession {
    key: Key,
    /// SIP022 client session id and the next packet id.
    session_id: u64,
    packet_id: u64,
    /// SIP022 body cipher for our session (keyed by session id).
    out_cipher: Option<UdpCipher>,
    /// SIP022 body cipher of the server's session, cached.
    in_cipher: Option<(u64, UdpCipher)>,
}

impl std::fmt::Debug for UdpSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UdpSession({:?})", self.key.method)
    }
}

/// SIP022 UDP with AES: the 16-byte session/packet id header is encrypted
/// with AES-ECB under the pre-shared key.
fn aes_block(key: &[u8], block: &mut [u8], encrypt: bool) -> Result<(), ShadowsocksError> {
    let bad = |_| ShadowsocksError::BadKey("AES key length".into());
    let Ok(b) = <&mut aes::Block>::try_from(block) else {
        return Err(ShadowsocksError::ShortPacket);
    };
    if key.len() == 16 {
        let c = aes::Aes128::new_from_slice(key).map_err(bad)?;
        if encrypt {
            c.encrypt_block(b)
        } else {
            c.decrypt_block(b)
        }
    } else {
        let c = aes::Aes256::new_from_slice(key).map_err(bad)?;
        if encrypt {
            c.encrypt_block(b)
        } else {
            c.decrypt_block(b)
        }
    }
    Ok(())
}

impl UdpSession {
    pub fn new(k: &Key) -> UdpSession {
        let mut id = [0u8; 8];
        random_iv_or_salt(&mut id);
        let session_id = u64::from_be_bytes(id);
        let out_cipher = k
            .method
            .is_2022()
            .then(|| UdpCipher::new(k.method.kind(), &k.key, session_id));
        UdpSession {
            key: k.clone(),
            session_id,
            packet_id: 0,
            out_cipher,
            in_cipher: None,
        }
    }

    /// Append the datagram for `payload` to `target` to `out` (cleared first).
    pub fn encode(
        &mut self,
        target: &Address,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), ShadowsocksError> {
        out.clear();
        let kind = self.key.method.kind();
        match self.key.method {
            Method::None => {
                target.encode(out)?;
                out.extend_from_slice(payload);
            }
            m if !m.is_2022() => {
                // Salts are at most 32 bytes (the key length); no allocation.
                let mut salt_buf = [0u8; 32];
                let salt = &mut salt_buf[..kind.salt_len().min(32)];
                random_iv_or_salt(salt);
                out.extend_from_slice(salt);
                let start = out.len();
                target.encode(out)?;
                out.extend_from_slice(payload);
                out.resize(out.len() + kind.tag_len(), 0);
                // A fresh cipher per datagram: nonce zero under a per-salt subkey.
                V1Cipher::new(kind, &self.key.key, salt).encrypt_packet(&mut out[start..]);
            }
            _ => {
                self.packet_id = self.packet_id.wrapping_add(1);
                out.extend_from_slice(&self.session_id.to_be_bytes());
                out.extend_from_slice(&self.packet_id.to_be_bytes());
                out.push(TYPE_CLIENT);
                out.extend_from_slice(&unix_now().to_be_bytes());
                let pad = if payload.is_empty() {
                    random_padding_len()
                } else {
                    0
                };
                out.extend_from_slice(&(pad as u16).to_be_bytes());
                out.resize(out.len() + pad, 0);
                target.encode(out)?;
                out.extend_from_slice(payload);
                out.resize(out.len() + kind.tag_len(), 0);
                let (header, body) = out.split_at_mut(16);
                let Some(c) = &self.out_cipher else {
                    return Err(ShadowsocksError::BadKey("no session cipher".into()));
                };
                // The nonce is the last 12 bytes of the plaintext header.
                c.encrypt_packet(&header[4..16], body);
                aes_block(&self.key.key, header, true)?;
            }
        }
        Ok(())
    }

    /// Decrypt a datagram from the server in place: the source address and
    /// the payload's range within `buf`.
    pub fn decode(&mut self, buf: &mut [u8]) -> Result<(Address, Range<usize>), ShadowsocksError> {
        let kind = self.key.method.kind();
        // (`tag_len` panics for `none`, which has no tag.)
        let tag = if self.key.method == Method::None {
            0
        } else {
            kind.tag_len()
        };
        let body: Range<usize> = match self.key.method {
            Method::None => 0..buf.len(),
            m if !m.is_2022() => {
                let salt_len = kind.salt_len();
                if buf.len() < salt_len + tag {
                    return Err(ShadowsocksError::ShortPacket);
                }
                let (salt, rest) = buf.split_at_mut(salt_len);
                if !V1Cipher::new(kind, &self.key.key, salt).decrypt_packet(rest) {
                    return Err(ShadowsocksError::Decrypt);
                }
                salt_len..buf.len() - tag
            }
            _ => {
                // header(16) + type(1) + timestamp(8) + client session(8) + padding length(2)
                if buf.len() < 16 + 1 + 8 + 8 + 2 + tag {
                    return Err(ShadowsocksError::ShortPacket);
                }
                let (header, rest) = buf.split_at_mut(16);
                aes_block(&self.key.key, header, false)?;
                let server_session = u64::from_be_bytes(
                    header[..8]
                        .try_into()
                        .map_err(|_| ShadowsocksError::ShortPacket)?,
                );
                let cipher = match &self.in_cipher {
                    Some((id, c)) if *id == server_session => c,
                    _ => {
                        let c = UdpCipher::new(kind, &self.key.key, server_session);
                        &self.in_cipher.insert((server_session, c)).1
                    }
                };
                if !cipher.decrypt_packet(&header[4..16], rest) {
                    return Err(ShadowsocksError::Decrypt);
                }
                let p = &rest[..rest.len() - tag];
                if p[0] != TYPE_SERVER {
                    return Err(ShadowsocksError::BadType(p[0]));
                }
                check_time(u64::from_be_bytes(
                    p[1..9]
                        .try_into()
                        .map_err(|_| ShadowsocksError::ShortPacket)?,
                ))?;
                let client = u64::from_be_bytes(
                    p[9..17]
                        .try_into()
                        .map_err(|_| ShadowsocksError::ShortPacket)?,
                );
                if client != self.session_id {
                    return Err(ShadowsocksError::NotOurs);
                }
                let pad = usize::from(u16::from_be_bytes([p[17], p[18]]));
                let start = 16 + 19 + pad;
                let end = buf.len() - tag;
                if start > end {
                    return Err(ShadowsocksError::ShortPacket);
                }
                start..end
            }
        };
        let Some((addr, n)) = Address::parse(&buf[body.clone()])? else {
            return Err(ShadowsocksError::ShortPacket);
        };
        Ok((addr, body.start + n..body.end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PSK32: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

    fn target() -> Address {
        Address::Ip("198.19.1.2:7".parse().expect("a"))
    }

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
        assert_eq!(Key::new(Method::Aes256Gcm, "pw").expect("k").key.len(), 32);
    }

    #[test]
    fn none_header_is_the_bare_address() {
        let k = Key::new(Method::None, "").expect("k");
        let s = tcp_session(&k, &target()).expect("s");
        assert_eq!(s.header, [1, 198, 19, 1, 2, 0, 7]);
        assert!(s.codec.is_none());
    }

    /// Play the server for SIP004: decrypt what the client sealed, and feed
    /// back a server stream split at every possible point.
    #[test]
    fn aead_stream_round_trip_at_every_split() {
        for m in [
            Method::Aes128Gcm,
            Method::Aes256Gcm,
            Method::Chacha20IetfPoly1305,
        ] {
            let k = Key::new(m, "secret").expect("k");
            let s = tcp_session(&k, &target()).expect("s");
            let (mut seal, _) = s.codec.expect("codec");
            // The client's stream decrypts with a server-side reader (same framing).
            let mut wire = s.header.clone();
            seal.seal(b"hello", &mut wire);
            let mut server_reader = SsOpen {
                key: k.clone(),
                request_salt: None,
                cipher: None,
                state: OpenState::Salt,
                pending: Vec::new(),
            };
            let mut plain = Vec::new();
            server_reader.feed(&wire, &mut plain).expect("server reads");
            let mut want = Vec::new();
            target().encode(&mut want).expect("a");
            want.extend_from_slice(b"hello");
            assert_eq!(plain, want);
            // A server stream (same framing, its own salt), fed in two pieces
            // split at every offset.
            let mut salt = vec![0u8; m.kind().salt_len()];
            random_iv_or_salt(&mut salt);
            let mut srv = SsSeal {
                cipher: ChunkCipher::new(&k, &salt),
                tag: m.kind().tag_len(),
                max_chunk: AEAD_MAX_CHUNK,
            };
            let mut down = salt.clone();
            let body: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
            srv.seal(&body, &mut down);
            for cut in [
                0,
                1,
                15,
                salt.len(),
                salt.len() + 17,
                salt.len() + 18,
                down.len() / 2,
                down.len(),
            ] {
                let (_, mut open) = tcp_session(&k, &target()).expect("s").codec.expect("c");
                let mut got = Vec::new();
                open.feed(&down[..cut], &mut got).expect("first part");
                open.feed(&down[cut..], &mut got).expect("second part");
                assert_eq!(got, body, "{m:?} split at {cut}");
                open.finish().expect("clean EOF");
            }
            // A flipped bit is a typed error, and a cut frame is Truncated at EOF.
            let (_, mut open) = tcp_session(&k, &target()).expect("s").codec.expect("c");
            let mut bad = down.clone();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            assert_eq!(
                open.feed(&bad, &mut Vec::new()),
                Err(ShadowsocksError::Decrypt)
            );
            let (_, mut open) = tcp_session(&k, &target()).expect("s").codec.expect("c");
            open.feed(&down[..down.len() - 3], &mut Vec::new())
                .expect("partial");
            assert!(open.finish().is_err());
        }
    }

    #[test]
    fn udp_round_trip_all_methods() {
        for (m, pw) in [
            (Method::None, ""),
            (Method::Aes128Gcm, "pw"),
            (Method::Aes256Gcm, "pw"),
            (Method::Chacha20IetfPoly1305, "pw"),
        ] {
            let k = Key::new(m, pw).expect("k");
            let mut s = UdpSession::new(&k);
            let mut out = Vec::new();
            s.encode(&target(), b"ping", &mut out).expect("enc");
            // SIP004 datagrams are symmetric: the client can decode its own.
            let (a, r) = s.decode(&mut out).expect("dec");
            assert_eq!(a, target());
            assert_eq!(&out[r], b"ping");
        }
        // SIP022: the client refuses its own datagram (type 0, not the server's).
        let k = Key::new(Method::Blake3Aes256Gcm, PSK32).expect("k");
        let mut s = UdpSession::new(&k);
        let mut out = Vec::new();
        s.encode(&target(), b"ping", &mut out).expect("enc");
        assert_eq!(
            s.decode(&mut out.clone()),
            Err(ShadowsocksError::BadType(0))
        );
        assert_eq!(
            s.decode(&mut out[..20].to_vec()),
            Err(ShadowsocksError::ShortPacket)
        );
    }
}
