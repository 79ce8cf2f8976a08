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
//!
//! Replay protection on what the server sends (an on-path attacker can
//! record and resend it; AEAD alone accepts a faithful copy):
//!
//! * TCP: every outbound remembers the salts of the last
//!   [`SALT_FILTER_CAPACITY`] server streams (`SaltFilter`); a stream that
//!   opens with one of them is refused.
//! * SIP022 UDP: each session keeps a sliding window of the server's packet
//!   ids (`PacketWindow`) for each of the last [`SERVER_SESSIONS`] server
//!   sessions; an id seen before, or older than the window, is refused.
//! * Nothing is remembered, and no session state changes, before the AEAD
//!   tag of what is being remembered has verified.

use std::collections::{HashSet, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use aes::cipher::{BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use base64::Engine as _;
use parking_lot::Mutex;
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
/// Server salts remembered per outbound. A replay older than this many TCP
/// connections through the outbound is not caught: for SIP022 the response
/// timestamp already refuses anything older than [`MAX_TIME_DIFF`], so 4096
/// covers a sustained 68 new connections per second over that 60 s span;
/// SIP004 has no timestamp, and the filter is its only defence. Memory: at
/// most 4096 x 8 bytes of FIFO plus a hash set of 4096 `u64` (8192 buckets
/// of 9 bytes), about 100 KiB per Shadowsocks outbound, and it grows only
/// as connections are made.
pub const SALT_FILTER_CAPACITY: usize = 4096;
/// SIP022 UDP: packet ids accepted behind the newest one, the room left for
/// reordering. Paths reorder by a few packets, rarely by hundreds; a
/// datagram overtaken by 1024 newer ones is dropped like a lost one. The
/// bitmap costs 136 bytes per server session (WireGuard keeps 8128 ids in
/// 1 KiB per peer; a UDP flow here is one app's socket, not a whole link).
pub const PACKET_WINDOW: u64 = 1024;
/// SIP022 UDP: server sessions one client session keeps a window for. A
/// server keeps one session per client session for the association's life
/// and starts another only when it restarts or forgets the association;
/// four covers such switches (and a replay from one of them within the
/// 30 s timestamp window) with room to spare. Each costs a cipher and a
/// 136-byte window, and exists only once the server used it.
pub const SERVER_SESSIONS: usize = 4;

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
    /// A TCP response whose salt this outbound already saw: a replayed
    /// server stream.
    #[error("server salt seen before (a replayed response)")]
    SaltReplay,
    /// A SIP022 datagram whose packet id was already accepted, or is too old
    /// for the window: a replayed datagram.
    #[error("server packet id {0} seen before or too old (a replayed datagram)")]
    PacketReplay(u64),
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
    key: Box<[u8]>,
    salts: Arc<Mutex<SaltFilter>>,
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
            salts: Arc::new(Mutex::new(SaltFilter::new(SALT_FILTER_CAPACITY))),
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

/// The salts of the last `capacity` server streams, oldest forgotten first.
///
/// Salts are kept as 64-bit SipHash values under a key drawn at random per
/// filter (std's `RandomState`), not as bytes: 8 bytes each instead of 32.
/// The cost is a false positive: a fresh salt whose hash equals one of the
/// remembered ones is refused as a replay. With at most 4096 remembered,
/// that happens with probability 4096 / 2^64 (about 2e-16) per connection,
/// and only that one connection is reset. The random key keeps anyone who
/// cannot read this process's memory from choosing salts that collide.
/// (shadowsocks-rust's client uses a pair of bloom filters for the same job
/// at a false-positive rate of 1e-15; an exact FIFO costs little more at
/// this size and forgets in order.)
#[derive(Debug)]
struct SaltFilter {
    capacity: usize,
    hasher: RandomState,
    /// Insertion order, for eviction.
    order: VecDeque<u64>,
    seen: HashSet<u64>,
}

impl SaltFilter {
    fn new(capacity: usize) -> Self {
        SaltFilter {
            capacity,
            hasher: RandomState::new(),
            order: VecDeque::new(),
            seen: HashSet::new(),
        }
    }

    /// Remember `salt`; false (and nothing changes) if it was already there.
    fn insert(&mut self, salt: &[u8]) -> bool {
        let h = self.hasher.hash_one(salt);
        if !self.seen.insert(h) {
            return false;
        }
        self.order.push_back(h);
        if self.order.len() > self.capacity
            && let Some(old) = self.order.pop_front()
        {
            self.seen.remove(&old);
        }
        true
    }
}

/// 64-bit blocks in the packet-id ring: [`PACKET_WINDOW`] bits plus one
/// block, so the ids of a full window never share a block with ids about
/// to be cleared (RFC 6479 section 2.2).
const WINDOW_BLOCKS: u64 = PACKET_WINDOW / 64 + 1;

/// SIP022 UDP packet ids of one server session: the newest accepted id and
/// a bitmap of the [`PACKET_WINDOW`] ids before it, kept as a ring of
/// 64-bit blocks so moving forward clears blocks instead of shifting bits
/// (RFC 6479, as WireGuard's replay counter).
#[derive(Debug, Clone)]
struct PacketWindow {
    newest: u64,
    ring: [u64; WINDOW_BLOCKS as usize],
}

impl PacketWindow {
    fn new() -> Self {
        PacketWindow {
            newest: 0,
            ring: [0; WINDOW_BLOCKS as usize],
        }
    }

    /// Accept `id` once: false for an id seen before or more than
    /// [`PACKET_WINDOW`] - 1 behind the newest. Call it only for a datagram
    /// whose tag verified, or forged ids would move the window.
    fn accept(&mut self, id: u64) -> bool {
        if id > self.newest {
            // Clear the blocks between the old newest and `id` (all of them
            // when it jumped a whole ring ahead).
            let (from, to) = (self.newest / 64, id / 64);
            for b in from + 1..=to.min(from + WINDOW_BLOCKS) {
                self.ring[(b % WINDOW_BLOCKS) as usize] = 0;
            }
            self.newest = id;
        } else if self.newest - id >= PACKET_WINDOW {
            return false;
        }
        let block = &mut self.ring[((id / 64) % WINDOW_BLOCKS) as usize];
        let bit = 1u64 << (id % 64);
        if *block & bit != 0 {
            return false;
        }
        *block |= bit;
        true
    }
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
            // The salt and the first AEAD message under it (SIP022's fixed
            // response header, SIP004's first length): one frame, so the
            // salt is remembered only once a tag under it verified.
            OpenState::Salt if self.key.method.is_2022() => {
                kind.salt_len() + 1 + 8 + kind.salt_len() + 2 + tag
            }
            OpenState::Salt => kind.salt_len() + 2 + tag,
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
                if !c.open(rest) {
                    return Err(ShadowsocksError::Decrypt);
                }
                let h = &rest[..rest.len() - tag];
                let len = if let Some(req) = &self.request_salt {
                    // SIP022 response: type, timestamp, request salt, length.
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
                    usize::from(u16::from_be_bytes([h[9 + n], h[10 + n]]))
                } else {
                    let len = usize::from(u16::from_be_bytes([h[0], h[1]]));
                    if len > AEAD_MAX_CHUNK {
                        return Err(ShadowsocksError::ChunkTooLong(len));
                    }
                    len
                };
                // A header that verified and belongs to us: its salt must be
                // new to this outbound.
                if !self.key.salts.lock().insert(salt) {
                    return Err(ShadowsocksError::SaltReplay);
                }
                self.state = OpenState::Data(len);
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
        // EOF between frames is clean (also before the server's first byte,
        // and after a SIP004 salt with no chunk: an empty stream); inside
        // one, or after a length without its chunk, it is not.
        let salt_only = self.state == OpenState::Salt
            && self.request_salt.is_none()
            && self.pending.len() == self.key.method.kind().salt_len();
        if salt_only
            || self.pending.is_empty() && matches!(self.state, OpenState::Length | OpenState::Salt)
        {
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
    /// SIP022: the server sessions that answered, most recent first, at
    /// most [`SERVER_SESSIONS`].
    servers: Vec<ServerSession>,
}

/// A SIP022 server session: its body cipher (derived from its id) and the
/// packet ids it used.
struct ServerSession {
    id: u64,
    cipher: UdpCipher,
    window: PacketWindow,
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

fn be_u64(b: &[u8]) -> Result<u64, ShadowsocksError> {
    Ok(u64::from_be_bytes(
        b.try_into().map_err(|_| ShadowsocksError::ShortPacket)?,
    ))
}

impl UdpSession {
    /// SIP022: decrypt and verify a server datagram's body in place under
    /// `cipher` (`header` is its decrypted 16-byte id header), and check
    /// the header inside: the server's type, a current timestamp and our
    /// session id. Changes no state.
    fn open_server_datagram(
        &self,
        cipher: &UdpCipher,
        header: &[u8],
        body: &mut [u8],
    ) -> Result<(), ShadowsocksError> {
        let tag = self.key.method.kind().tag_len();
        if !cipher.decrypt_packet(&header[4..16], body) {
            return Err(ShadowsocksError::Decrypt);
        }
        let p = &body[..body.len() - tag];
        if p[0] != TYPE_SERVER {
            return Err(ShadowsocksError::BadType(p[0]));
        }
        check_time(be_u64(&p[1..9])?)?;
        if be_u64(&p[9..17])? != self.session_id {
            return Err(ShadowsocksError::NotOurs);
        }
        Ok(())
    }

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
            servers: Vec::new(),
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
                let (server_session, packet_id) = (be_u64(&header[..8])?, be_u64(&header[8..16])?);
                // A session not seen yet is adopted only once the datagram
                // proved authentic and ours: forged datagrams (anyone can
                // send random bytes) must not evict a session and its window.
                let mut session = match self.servers.iter().position(|s| s.id == server_session) {
                    Some(i) => {
                        self.open_server_datagram(&self.servers[i].cipher, header, rest)?;
                        self.servers.remove(i)
                    }
                    None => {
                        let s = ServerSession {
                            id: server_session,
                            cipher: UdpCipher::new(kind, &self.key.key, server_session),
                            window: PacketWindow::new(),
                        };
                        self.open_server_datagram(&s.cipher, header, rest)?;
                        s
                    }
                };
                let fresh = session.window.accept(packet_id);
                // Most recent first; the least recently used one goes.
                self.servers.insert(0, session);
                self.servers.truncate(SERVER_SESSIONS);
                if !fresh {
                    return Err(ShadowsocksError::PacketReplay(packet_id));
                }
                let p = &rest[..rest.len() - tag];
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
                // A key of its own each time: the same server stream twice
                // under one key is a replay (see salt_replay_is_refused).
                let k = Key::new(m, "secret").expect("k");
                let (_, mut open) = tcp_session(&k, &target()).expect("s").codec.expect("c");
                let mut got = Vec::new();
                open.feed(&down[..cut], &mut got).expect("first part");
                open.feed(&down[cut..], &mut got).expect("second part");
                assert_eq!(got, body, "{m:?} split at {cut}");
                open.finish().expect("clean EOF");
            }
            // A flipped bit is a typed error, and a cut frame is Truncated at EOF.
            let k = Key::new(m, "secret").expect("k");
            let (_, mut open) = tcp_session(&k, &target()).expect("s").codec.expect("c");
            let mut bad = down.clone();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            assert_eq!(
                open.feed(&bad, &mut Vec::new()),
                Err(ShadowsocksError::Decrypt)
            );
            let k = Key::new(m, "secret").expect("k");
            let (_, mut open) = tcp_session(&k, &target()).expect("s").codec.expect("c");
            open.feed(&down[..down.len() - 3], &mut Vec::new())
                .expect("partial");
            assert!(open.finish().is_err());
            // A salt and nothing else is an empty stream; less is not.
            for (cut, clean) in [(salt.len(), true), (salt.len() - 1, false)] {
                let k = Key::new(m, "secret").expect("k");
                let (_, mut open) = tcp_session(&k, &target()).expect("s").codec.expect("c");
                open.feed(&down[..cut], &mut Vec::new()).expect("salt");
                assert_eq!(open.finish().is_ok(), clean, "{m:?} EOF after {cut} bytes");
            }
        }
    }

    /// A SIP004 server stream: `salt`, then `body` in chunks.
    fn sip004_server_stream(k: &Key, salt: &[u8], body: &[u8]) -> Vec<u8> {
        let mut srv = SsSeal {
            cipher: ChunkCipher::new(k, salt),
            tag: k.method.kind().tag_len(),
            max_chunk: AEAD_MAX_CHUNK,
        };
        let mut down = salt.to_vec();
        srv.seal(body, &mut down);
        down
    }

    /// A SIP022 server stream answering `open`'s request: salt, the fixed
    /// response header (type, timestamp, request salt, length), `body`.
    fn sip022_server_stream(k: &Key, open: &SsOpen, salt: &[u8], body: &[u8]) -> Vec<u8> {
        let tag = k.method.kind().tag_len();
        let mut c = ChunkCipher::new(k, salt);
        let mut fixed = vec![TYPE_SERVER];
        fixed.extend_from_slice(&unix_now().to_be_bytes());
        fixed.extend_from_slice(open.request_salt.as_deref().expect("2022 request salt"));
        fixed.extend_from_slice(&(body.len() as u16).to_be_bytes());
        let mut down = salt.to_vec();
        push_sealed(&mut c, tag, &fixed, &mut down);
        push_sealed(&mut c, tag, body, &mut down);
        down
    }

    /// The same server stream twice through one outbound (one key): the
    /// second is a replay, refused before any byte reaches the app. A
    /// stream that does not verify leaves no trace in the filter.
    #[test]
    fn salt_replay_is_refused() {
        let k = Key::new(Method::Aes256Gcm, "secret").expect("k");
        let salt = [7u8; 32];
        let down = sip004_server_stream(&k, &salt, b"hello");
        let (_, mut first) = tcp_session(&k, &target()).expect("s").codec.expect("c");
        let mut got = Vec::new();
        first.feed(&down, &mut got).expect("first stream");
        assert_eq!(got, b"hello");
        let (_, mut again) = tcp_session(&k, &target()).expect("s").codec.expect("c");
        let mut got = Vec::new();
        assert_eq!(
            again.feed(&down, &mut got),
            Err(ShadowsocksError::SaltReplay)
        );
        assert!(got.is_empty(), "nothing of a replay is delivered");
        // Another outbound (its own key and filter) has not seen it.
        let other = Key::new(Method::Aes256Gcm, "secret").expect("k");
        let (_, mut open) = tcp_session(&other, &target()).expect("s").codec.expect("c");
        open.feed(&down, &mut Vec::new()).expect("fresh filter");
        // A forged stream with a new salt fails its tag and is not
        // remembered: the real stream with that salt still gets through.
        let salt2 = [8u8; 32];
        let mut forged = sip004_server_stream(&k, &salt2, b"x");
        forged[33] ^= 1;
        let (_, mut open) = tcp_session(&k, &target()).expect("s").codec.expect("c");
        assert_eq!(
            open.feed(&forged, &mut Vec::new()),
            Err(ShadowsocksError::Decrypt)
        );
        let (_, mut open) = tcp_session(&k, &target()).expect("s").codec.expect("c");
        open.feed(&sip004_server_stream(&k, &salt2, b"x"), &mut Vec::new())
            .expect("the real one");

        // SIP022 binds the response to the request salt, so the filter is
        // a second line there: a server salt is refused even when the
        // request salt matches.
        let k = Key::new(Method::Blake3Aes256Gcm, PSK32).expect("k");
        let (_, mut first) = tcp_session(&k, &target()).expect("s").codec.expect("c");
        let down = sip022_server_stream(&k, &first, &[9u8; 32], b"hi");
        let mut got = Vec::new();
        first.feed(&down, &mut got).expect("first 2022 stream");
        assert_eq!(got, b"hi");
        let (_, mut again) = tcp_session(&k, &target()).expect("s").codec.expect("c");
        again.request_salt = first.request_salt.clone();
        assert_eq!(
            again.feed(&down, &mut Vec::new()),
            Err(ShadowsocksError::SaltReplay)
        );
    }

    /// The filter holds exactly its capacity: the oldest salt is forgotten
    /// first, the newest ones are all still refused.
    #[test]
    fn salt_filter_is_bounded_fifo() {
        let mut f = SaltFilter::new(SALT_FILTER_CAPACITY);
        let salt = |i: usize| (i as u64).to_le_bytes();
        for i in 0..=SALT_FILTER_CAPACITY {
            assert!(f.insert(&salt(i)), "salt {i} is new");
        }
        assert_eq!(f.order.len(), SALT_FILTER_CAPACITY);
        assert_eq!(f.seen.len(), SALT_FILTER_CAPACITY);
        assert!(!f.insert(&salt(SALT_FILTER_CAPACITY)), "newest remembered");
        assert!(!f.insert(&salt(1)), "second oldest still remembered");
        assert!(f.insert(&salt(0)), "the oldest was forgotten");
    }

    /// A SIP022 datagram as the server sends it, from `server` session with
    /// `packet_id`, to client session `client`.
    fn server_datagram(
        k: &Key,
        server: u64,
        packet_id: u64,
        client: u64,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&server.to_be_bytes());
        out.extend_from_slice(&packet_id.to_be_bytes());
        out.push(TYPE_SERVER);
        out.extend_from_slice(&unix_now().to_be_bytes());
        out.extend_from_slice(&client.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes());
        target().encode(&mut out).expect("a");
        out.extend_from_slice(payload);
        out.resize(out.len() + k.method.kind().tag_len(), 0);
        let (header, body) = out.split_at_mut(16);
        UdpCipher::new(k.method.kind(), &k.key, server).encrypt_packet(&header[4..16], body);
        aes_block(&k.key, header, true).expect("aes");
        out
    }

    #[test]
    fn packet_window_refuses_seen_and_old_ids() {
        let k = Key::new(Method::Blake3Aes256Gcm, PSK32).expect("k");
        let mut s = UdpSession::new(&k);
        let me = s.session_id;
        let mut dec = |id: u64| {
            s.decode(&mut server_datagram(&k, 7, id, me, b"pong"))
                .map(|_| ())
        };
        assert_eq!(dec(1), Ok(()));
        assert_eq!(dec(1), Err(ShadowsocksError::PacketReplay(1)));
        // Reordering inside the window is fine, once per id.
        assert_eq!(dec(3), Ok(()));
        assert_eq!(dec(2), Ok(()));
        assert_eq!(dec(2), Err(ShadowsocksError::PacketReplay(2)));
        // A jump ahead: PACKET_WINDOW - 1 behind the newest is the oldest
        // accepted; one more is too old, seen or not.
        let top = 5000;
        assert_eq!(dec(top), Ok(()));
        assert_eq!(dec(top - PACKET_WINDOW + 1), Ok(()));
        assert_eq!(
            dec(top - PACKET_WINDOW),
            Err(ShadowsocksError::PacketReplay(top - PACKET_WINDOW))
        );
        assert_eq!(dec(3), Err(ShadowsocksError::PacketReplay(3)));
        // Every id of a full window once, in reverse, then none again.
        let mut w = PacketWindow::new();
        assert!(w.accept(10_000));
        for id in (10_000 - PACKET_WINDOW + 1..10_000).rev() {
            assert!(w.accept(id), "{id}");
        }
        for id in 10_000 - PACKET_WINDOW + 1..=10_000 {
            assert!(!w.accept(id), "{id} twice");
        }
        // Moving by less than a block keeps the bits of the ids still inside.
        assert!(w.accept(10_001));
        assert!(!w.accept(10_000 - PACKET_WINDOW + 2));
    }

    /// Datagrams whose tag fails change nothing: they neither evict the
    /// server session (and with it the memory of its packet ids) nor
    /// install a session of their own. An authentic new server session
    /// (the server restarted) is adopted beside the old one.
    #[test]
    fn forged_datagrams_change_no_state() {
        let k = Key::new(Method::Blake3Aes256Gcm, PSK32).expect("k");
        let mut s = UdpSession::new(&k);
        let me = s.session_id;
        let first = server_datagram(&k, 7, 1, me, b"pong");
        s.decode(&mut first.clone()).expect("authentic");
        for forged_session in 100..100 + SERVER_SESSIONS as u64 + 1 {
            let mut d = server_datagram(&k, forged_session, 1, me, b"pong");
            let last = d.len() - 1;
            d[last] ^= 1;
            assert_eq!(s.decode(&mut d), Err(ShadowsocksError::Decrypt));
        }
        let ids: Vec<u64> = s.servers.iter().map(|x| x.id).collect();
        assert_eq!(ids, [7], "forged datagrams adopted nothing");
        assert_eq!(
            s.decode(&mut first.clone()),
            Err(ShadowsocksError::PacketReplay(1)),
            "session 7 still remembers packet 1"
        );
        // Datagrams for another client session verify but are not ours.
        let mut other = server_datagram(&k, 8, 1, me ^ 1, b"pong");
        assert_eq!(s.decode(&mut other), Err(ShadowsocksError::NotOurs));
        assert_eq!(s.servers.len(), 1);
        // A real new server session, then the old one again: both kept.
        s.decode(&mut server_datagram(&k, 8, 1, me, b"pong"))
            .expect("new server session");
        s.decode(&mut server_datagram(&k, 7, 2, me, b"pong"))
            .expect("old session continues");
        assert_eq!(
            s.decode(&mut server_datagram(&k, 8, 1, me, b"pong")),
            Err(ShadowsocksError::PacketReplay(1))
        );
        let ids: Vec<u64> = s.servers.iter().map(|x| x.id).collect();
        assert_eq!(ids, [8, 7], "most recent first");
        // Bounded: more sessions than SERVER_SESSIONS evict the least recent.
        for id in 20..20 + SERVER_SESSIONS as u64 {
            s.decode(&mut server_datagram(&k, id, 1, me, b"pong"))
                .expect("session");
        }
        assert_eq!(s.servers.len(), SERVER_SESSIONS);
        assert!(s.servers.iter().all(|x| x.id >= 20));
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
