//! The Shadowsocks AEAD stream framing of a TCP connection, client side:
//! the methods of SIP004 (`aes-128-gcm`, `aes-256-gcm`,
//! `chacha20-ietf-poly1305`) and AEAD-2022 / SIP022
//! (`2022-blake3-aes-128-gcm`, `2022-blake3-aes-256-gcm`).
//!
//! The ciphers, key derivations and nonce counters are shadowsocks-rust's own
//! (`shadowsocks-crypto`); this module only lays out the chunks around them,
//! over byte slices, so they are testable without sockets and every length
//! read from the network is checked. What the client chooses at random (the
//! salt, SIP022's padding) is passed in, and so is the clock SIP022's
//! timestamps are checked against ([`Clock`]): the engine owns both.
//!
//! A server stream that opens with a salt this outbound saw before is
//! refused: every [`AeadKey`] (one per outbound, shared by its connections)
//! remembers the salts of the last [`SALT_FILTER_CAPACITY`] server streams.
//! An on-path attacker can record and resend a server's stream, and AEAD
//! alone accepts a faithful copy. Nothing is remembered before the AEAD tag
//! under the salt has verified.
//!
//! The `none` method has no frames (the engine sends the bare address and
//! then splices), and the UDP datagram framing lives with the outbound
//! (`core/src/outbound/shadowsocks/`); both share [`AeadError`] and the
//! constants below.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::io;
use std::sync::Arc;

use parking_lot::Mutex;
use shadowsocks_crypto::CipherKind;
use shadowsocks_crypto::v1::Cipher as V1Cipher;
use shadowsocks_crypto::v2::tcp::TcpCipher;

use super::{Framing, Open, Seal};

/// SIP004: a chunk carries at most 0x3FFF bytes (the top two length bits
/// are reserved).
pub const AEAD_MAX_CHUNK: usize = 0x3FFF;
/// SIP022: chunks carry up to 0xFFFF bytes.
pub const AEAD2022_MAX_CHUNK: usize = 0xFFFF;
/// SIP022: a request with no initial payload carries 1..=900 bytes of padding.
pub const MAX_PADDING: usize = 900;
/// SIP022: timestamps more than 30 s off are replays or clock trouble.
pub const MAX_TIME_DIFF: u64 = 30;
/// SIP022: the type byte of what a client sends.
pub const TYPE_CLIENT: u8 = 0;
/// SIP022: the type byte of what a server sends.
pub const TYPE_SERVER: u8 = 1;
/// Server salts remembered per outbound. A replay older than this many TCP
/// connections through the outbound is not caught: for SIP022 the response
/// timestamp already refuses anything older than [`MAX_TIME_DIFF`], so 4096
/// covers a sustained 68 new connections per second over that 60 s span;
/// SIP004 has no timestamp, and the filter is its only defence. Memory: at
/// most 4096 x 8 bytes of FIFO plus a hash set of 4096 `u64` (8192 buckets
/// of 9 bytes), about 100 KiB per Shadowsocks outbound, and it grows only
/// as connections are made.
pub const SALT_FILTER_CAPACITY: usize = 4096;

/// Seconds since the Unix epoch, read by the engine (the pure crate reads
/// no clock): SIP022 stamps its requests with it and checks the server's
/// timestamps against it.
pub type Clock = fn() -> u64;

/// A Shadowsocks frame the client cannot accept, TCP or UDP. Counted per
/// outbound; the app sees a reset (TCP) or the datagram is dropped (UDP).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AeadError {
    /// An AEAD tag did not verify (wrong key or method, or tampering).
    Decrypt,
    /// A SIP004 chunk length with the reserved bits set.
    ChunkTooLong(usize),
    /// SIP022 header of the wrong direction.
    BadType(u8),
    /// SIP022 timestamp too far from now.
    BadTimestamp(u64),
    /// SIP022 response header for another request (salt or session id).
    NotOurs,
    /// The server closed the stream inside a frame.
    Truncated,
    /// A datagram too short for its header.
    ShortPacket,
    /// A TCP response whose salt this outbound already saw: a replayed
    /// server stream.
    SaltReplay,
    /// A SIP022 datagram whose packet id was already accepted, or is too old
    /// for the window: a replayed datagram.
    PacketReplay(u64),
}

impl fmt::Display for AeadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AeadError::Decrypt => f.write_str("decryption failed (wrong password or method?)"),
            AeadError::ChunkTooLong(n) => write!(f, "chunk length {n:#06x} exceeds 0x3fff"),
            AeadError::BadType(t) => {
                write!(
                    f,
                    "stream/packet type {t} where the server's (1) was expected"
                )
            }
            AeadError::BadTimestamp(t) => write!(f, "timestamp {t} is more than 30 s from now"),
            AeadError::NotOurs => f.write_str("response belongs to another request"),
            AeadError::Truncated => f.write_str("stream ended inside a frame"),
            AeadError::ShortPacket => f.write_str("datagram too short"),
            AeadError::SaltReplay => f.write_str("server salt seen before (a replayed response)"),
            AeadError::PacketReplay(id) => write!(
                f,
                "server packet id {id} seen before or too old (a replayed datagram)"
            ),
        }
    }
}

impl std::error::Error for AeadError {}

impl From<AeadError> for io::Error {
    fn from(e: AeadError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// A SIP022 timestamp `ts` checked against `now` (both Unix seconds).
pub fn check_time(ts: u64, now: u64) -> Result<(), AeadError> {
    if now.abs_diff(ts) > MAX_TIME_DIFF {
        Err(AeadError::BadTimestamp(ts))
    } else {
        Ok(())
    }
}

/// An outbound's key for one method, and the salts of the server streams
/// it received. Every clone shares the salt filter, so all TCP connections
/// of one outbound check against the same history.
#[derive(Clone)]
pub struct AeadKey {
    kind: CipherKind,
    key: Box<[u8]>,
    salts: Arc<Mutex<SaltFilter>>,
}

impl fmt::Debug for AeadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print key material.
        write!(f, "AeadKey({})", self.kind)
    }
}

impl AeadKey {
    /// `key`, derived for `kind` (the engine derives it from the configured
    /// password), with an empty salt filter.
    pub fn new(kind: CipherKind, key: Box<[u8]>) -> AeadKey {
        AeadKey {
            kind,
            key,
            salts: Arc::new(Mutex::new(SaltFilter::new(SALT_FILTER_CAPACITY))),
        }
    }

    pub fn kind(&self) -> CipherKind {
        self.kind
    }

    /// The key material.
    pub fn bytes(&self) -> &[u8] {
        &self.key
    }

    /// An AEAD-2022 method.
    pub fn is_2022(&self) -> bool {
        self.kind.is_aead_2022()
    }

    /// A method with AEAD frames (not `none`).
    fn is_framed(&self) -> bool {
        self.kind.is_aead() || self.kind.is_aead_2022()
    }
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
/// (A bloom filter would take less memory per salt but forgets in bulk;
/// at 4096 salts the exact FIFO costs 32 KiB of hashes plus the set's
/// table, and forgets the oldest salt first.)
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

/// The per-direction stream cipher: nonce counter and subkey inside.
enum ChunkCipher {
    V1(V1Cipher),
    V2(TcpCipher),
}

impl ChunkCipher {
    fn new(k: &AeadKey, salt: &[u8]) -> ChunkCipher {
        if k.is_2022() {
            ChunkCipher::V2(TcpCipher::new(k.kind, &k.key, salt))
        } else {
            ChunkCipher::V1(V1Cipher::new(k.kind, &k.key, salt))
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

/// What a client request carries that the engine chooses.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The target in the SOCKS5 address format (`core/src/outbound/addr.rs`).
    pub address: &'a [u8],
    /// A fresh random salt of the method's salt length.
    pub salt: &'a [u8],
    /// SIP022: bytes of padding after the address, drawn at random in
    /// 1..=[`MAX_PADDING`] (clamped to that range). Unused by SIP004.
    pub padding: usize,
}

/// Both directions of a Shadowsocks AEAD stream.
#[derive(Debug)]
pub struct AeadStream {
    /// Client to server.
    pub seal: AeadSeal,
    /// Server to client.
    pub open: AeadOpen,
}

impl AeadStream {
    /// Start a stream: append the salt and the request header for `req` to
    /// `header` (sent at once, so the server connects to the target before
    /// the app's first byte and server-speaks-first protocols work), and
    /// return the state of both directions. `None` for a method without
    /// AEAD frames (`none`), a salt that is not the method's length, or an
    /// address longer than a chunk.
    pub fn client(
        key: &AeadKey,
        req: Request<'_>,
        clock: Clock,
        header: &mut Vec<u8>,
    ) -> Option<AeadStream> {
        let kind = key.kind;
        if !key.is_framed()
            || req.salt.len() != kind.salt_len()
            || req.address.len() + 2 + MAX_PADDING > AEAD_MAX_CHUNK
        {
            return None;
        }
        let tag = kind.tag_len();
        header.extend_from_slice(req.salt);
        let mut cipher = ChunkCipher::new(key, req.salt);
        let max_chunk = if key.is_2022() {
            // SIP022 request: a fixed header (type, timestamp, length of the
            // variable header), then the variable header (address, padding).
            let pad = req.padding.clamp(1, MAX_PADDING);
            let mut var = Vec::with_capacity(req.address.len() + 2 + pad);
            var.extend_from_slice(req.address);
            var.extend_from_slice(&(pad as u16).to_be_bytes());
            var.resize(var.len() + pad, 0);
            let mut fixed = [0u8; 11];
            fixed[0] = TYPE_CLIENT;
            fixed[1..9].copy_from_slice(&clock().to_be_bytes());
            fixed[9..11].copy_from_slice(&(var.len() as u16).to_be_bytes());
            push_sealed(&mut cipher, tag, &fixed, header);
            push_sealed(&mut cipher, tag, &var, header);
            AEAD2022_MAX_CHUNK
        } else {
            // SIP004: the address is the start of the stream, in a normal chunk.
            let len = (req.address.len() as u16).to_be_bytes();
            push_sealed(&mut cipher, tag, &len, header);
            push_sealed(&mut cipher, tag, req.address, header);
            AEAD_MAX_CHUNK
        };
        Some(AeadStream {
            seal: AeadSeal {
                cipher,
                tag,
                max_chunk,
            },
            open: AeadOpen {
                key: key.clone(),
                request_salt: key.is_2022().then(|| req.salt.to_vec()),
                clock,
                cipher: None,
                state: OpenState::Salt,
                pending: Vec::new(),
            },
        })
    }
}

impl Framing for AeadStream {
    fn split(&mut self) -> (&mut dyn Seal, &mut dyn Open) {
        (&mut self.seal, &mut self.open)
    }
}

/// The client-to-server half of an AEAD stream.
pub struct AeadSeal {
    cipher: ChunkCipher,
    tag: usize,
    max_chunk: usize,
}

impl fmt::Debug for AeadSeal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AeadSeal")
    }
}

impl Seal for AeadSeal {
    fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) {
        for chunk in plain.chunks(self.max_chunk) {
            let len = (chunk.len() as u16).to_be_bytes();
            push_sealed(&mut self.cipher, self.tag, &len, out);
            push_sealed(&mut self.cipher, self.tag, chunk, out);
        }
    }
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

/// The largest frame of an AEAD stream that is not a payload chunk: a
/// SIP022 response header (32-byte salt, type, timestamp, the request's
/// 32-byte salt, length, 16-byte tag) is 91 bytes.
const HEADER_FRAME_MAX: usize = 96;

/// The server-to-client half of an AEAD stream.
pub struct AeadOpen {
    key: AeadKey,
    /// SIP022: our salt, which the server's response header must echo.
    request_salt: Option<Vec<u8>>,
    clock: Clock,
    cipher: Option<ChunkCipher>,
    state: OpenState,
    /// Bytes of an incomplete frame, kept across reads: at most one frame,
    /// allocated at its length ([`Open::held`]), freed once it completes.
    pending: Vec<u8>,
}

impl fmt::Debug for AeadOpen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AeadOpen({:?})", self.state)
    }
}

impl AeadOpen {
    /// Bytes the current state needs.
    fn need(&self) -> usize {
        let kind = self.key.kind;
        let tag = kind.tag_len();
        match self.state {
            // The salt and the first AEAD message under it (SIP022's fixed
            // response header, SIP004's first length): one frame, so the
            // salt is remembered only once a tag under it verified.
            OpenState::Salt if self.key.is_2022() => {
                kind.salt_len() + 1 + 8 + kind.salt_len() + 2 + tag
            }
            OpenState::Salt => kind.salt_len() + 2 + tag,
            OpenState::Length => 2 + tag,
            OpenState::Data(n) => n + tag,
        }
    }

    /// Consume one complete frame at the start of `frame` (exactly `need()`
    /// bytes), appending any plaintext to `out`.
    fn step(&mut self, frame: &mut [u8], out: &mut Vec<u8>) -> Result<(), AeadError> {
        let kind = self.key.kind;
        let tag = kind.tag_len();
        match self.state {
            OpenState::Salt => {
                let (salt, rest) = frame.split_at_mut(kind.salt_len());
                let mut c = ChunkCipher::new(&self.key, salt);
                if !c.open(rest) {
                    return Err(AeadError::Decrypt);
                }
                let h = &rest[..rest.len() - tag];
                let len = if let Some(req) = &self.request_salt {
                    // SIP022 response: type, timestamp, request salt, length.
                    if h[0] != TYPE_SERVER {
                        return Err(AeadError::BadType(h[0]));
                    }
                    let mut ts = [0u8; 8];
                    ts.copy_from_slice(&h[1..9]);
                    check_time(u64::from_be_bytes(ts), (self.clock)())?;
                    let n = req.len();
                    if h[9..9 + n] != req[..] {
                        return Err(AeadError::NotOurs);
                    }
                    usize::from(u16::from_be_bytes([h[9 + n], h[10 + n]]))
                } else {
                    let len = usize::from(u16::from_be_bytes([h[0], h[1]]));
                    if len > AEAD_MAX_CHUNK {
                        return Err(AeadError::ChunkTooLong(len));
                    }
                    len
                };
                // A header that verified and belongs to us: its salt must be
                // new to this outbound.
                if !self.key.salts.lock().insert(salt) {
                    return Err(AeadError::SaltReplay);
                }
                self.state = OpenState::Data(len);
                self.cipher = Some(c);
            }
            OpenState::Length => {
                let c = self.cipher.as_mut().ok_or(AeadError::Truncated)?;
                if !c.open(frame) {
                    return Err(AeadError::Decrypt);
                }
                let len = usize::from(u16::from_be_bytes([frame[0], frame[1]]));
                if self.request_salt.is_none() && len > AEAD_MAX_CHUNK {
                    return Err(AeadError::ChunkTooLong(len));
                }
                self.state = OpenState::Data(len);
            }
            OpenState::Data(len) => {
                let c = self.cipher.as_mut().ok_or(AeadError::Truncated)?;
                if !c.open(frame) {
                    return Err(AeadError::Decrypt);
                }
                out.extend_from_slice(&frame[..len]);
                self.state = OpenState::Length;
            }
        }
        Ok(())
    }

    /// [`AeadOpen::step`] over a copy of `frame` (exactly `need()` bytes):
    /// a payload chunk is copied to the end of `out` and decrypted there,
    /// its tag cut off (nothing of it stays if it does not verify); the
    /// salt and length frames, at most [`HEADER_FRAME_MAX`] bytes, on the
    /// stack.
    fn step_copied(&mut self, frame: &[u8], out: &mut Vec<u8>) -> Result<(), AeadError> {
        if let OpenState::Data(len) = self.state {
            let c = self.cipher.as_mut().ok_or(AeadError::Truncated)?;
            let start = out.len();
            out.extend_from_slice(frame);
            if !c.open(&mut out[start..]) {
                out.truncate(start);
                return Err(AeadError::Decrypt);
            }
            out.truncate(start + len);
            self.state = OpenState::Length;
            return Ok(());
        }
        let mut header = [0u8; HEADER_FRAME_MAX];
        let copy = header.get_mut(..frame.len()).ok_or(AeadError::Truncated)?;
        copy.copy_from_slice(frame);
        self.step(copy, out)
    }

    /// All of `wire`, with no bound on the cut frame kept:
    /// [`AeadOpen::feed_within`] with unlimited room.
    pub fn feed(&mut self, wire: &[u8], out: &mut Vec<u8>) -> Result<(), AeadError> {
        self.feed_within(wire, out, usize::MAX).map(drop)
    }

    /// Sans-I/O core of [`Open::open`], with the typed error: the bytes of
    /// `wire` consumed; a cut frame longer than `room` is not started.
    pub fn feed_within(
        &mut self,
        wire: &[u8],
        out: &mut Vec<u8>,
        room: usize,
    ) -> Result<usize, AeadError> {
        let whole = wire.len();
        let mut wire = wire;
        // Finish a frame started in an earlier read.
        if !self.pending.is_empty() {
            let need = self.need();
            let take = (need - self.pending.len()).min(wire.len());
            self.pending.extend_from_slice(&wire[..take]);
            wire = &wire[take..];
            if self.pending.len() < need {
                return Ok(whole);
            }
            let mut frame = std::mem::take(&mut self.pending);
            self.step(&mut frame, out)?;
        }
        // Whole frames straight from the read buffer, copied once to decrypt
        // in place (the read buffer is shared with the next read): a chunk
        // into `out`, where its plaintext stays, a header on the stack. No
        // allocation but `out`'s own growth.
        loop {
            let need = self.need();
            if wire.len() < need {
                break;
            }
            self.step_copied(&wire[..need], out)?;
            wire = &wire[need..];
        }
        if !wire.is_empty() {
            let need = self.need();
            if need > room {
                return Ok(whole - wire.len());
            }
            // The frame's whole length at once, so what is held is known
            // (and charged by the relay) before the rest arrives.
            self.pending.reserve_exact(need);
            self.pending.extend_from_slice(wire);
        }
        Ok(whole)
    }

    /// Sans-I/O core of [`Open::finish`], with the typed error.
    pub fn end(&self) -> Result<(), AeadError> {
        // EOF between frames is clean (also before the server's first byte,
        // and after a SIP004 salt with no chunk: an empty stream); inside
        // one, or after a length without its chunk, it is not.
        let salt_only = self.state == OpenState::Salt
            && self.request_salt.is_none()
            && self.pending.len() == self.key.kind.salt_len();
        if salt_only
            || self.pending.is_empty() && matches!(self.state, OpenState::Length | OpenState::Salt)
        {
            Ok(())
        } else {
            Err(AeadError::Truncated)
        }
    }
}

impl Open for AeadOpen {
    fn open(&mut self, wire: &[u8], out: &mut Vec<u8>, room: usize) -> io::Result<usize> {
        Ok(self.feed_within(wire, out, room)?)
    }
    fn finish(&mut self) -> io::Result<()> {
        Ok(self.end()?)
    }
    fn held(&self) -> usize {
        self.pending.capacity()
    }
    fn wants(&self) -> usize {
        self.need()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{SystemTime, UNIX_EPOCH};

    use shadowsocks_crypto::utils::random_iv_or_salt;
    use shadowsocks_crypto::v1::openssl_bytes_to_key;

    use super::*;

    /// 198.19.1.2:7 in the SOCKS5 address format.
    const TARGET: [u8; 7] = [1, 198, 19, 1, 2, 0, 7];

    fn unix_now() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    }

    /// A SIP004 key from a password, as the engine derives it.
    fn v1_key(kind: CipherKind, password: &str) -> AeadKey {
        let mut k = vec![0u8; kind.key_len()];
        openssl_bytes_to_key(password.as_bytes(), &mut k);
        AeadKey::new(kind, k.into_boxed_slice())
    }

    /// A SIP022 key: 0, 1, 2, ... (the method's key length).
    fn v2_key(kind: CipherKind) -> AeadKey {
        AeadKey::new(kind, (0..kind.key_len() as u8).collect())
    }

    /// A fresh client stream to [`TARGET`]: its header and its state.
    fn client(k: &AeadKey) -> (Vec<u8>, AeadStream) {
        let mut salt = vec![0u8; k.kind.salt_len()];
        random_iv_or_salt(&mut salt);
        let req = Request {
            address: &TARGET,
            salt: &salt,
            padding: 17,
        };
        let mut header = Vec::new();
        let s = AeadStream::client(k, req, unix_now, &mut header).expect("an AEAD method");
        (header, s)
    }

    /// A reader of the client's own stream, as a SIP004 server reads it.
    fn server_reader(k: &AeadKey) -> AeadOpen {
        AeadOpen {
            key: k.clone(),
            request_salt: None,
            clock: unix_now,
            cipher: None,
            state: OpenState::Salt,
            pending: Vec::new(),
        }
    }

    #[test]
    fn only_aead_methods_with_a_fitting_salt_and_address_start_a_stream() {
        let k = v1_key(CipherKind::AES_256_GCM, "pw");
        let salt = [0u8; 32];
        let mut h = Vec::new();
        let req = |address, salt| Request {
            address,
            salt,
            padding: 1,
        };
        assert!(AeadStream::client(&k, req(&TARGET, &salt), unix_now, &mut h).is_some());
        assert_eq!(h.len(), 32 + (2 + 16) + (7 + 16), "salt, length, address");
        assert!(AeadStream::client(&k, req(&TARGET, &salt[..16]), unix_now, &mut h).is_none());
        let long = [3u8; AEAD_MAX_CHUNK];
        assert!(AeadStream::client(&k, req(&long, &salt), unix_now, &mut h).is_none());
        let none = AeadKey::new(CipherKind::NONE, Box::new([]));
        assert!(AeadStream::client(&none, req(&TARGET, &[]), unix_now, &mut h).is_none());
    }

    /// Play the server for SIP004: decrypt what the client sealed, and feed
    /// back a server stream split at every possible point.
    #[test]
    fn aead_stream_round_trip_at_every_split() {
        for kind in [
            CipherKind::AES_128_GCM,
            CipherKind::AES_256_GCM,
            CipherKind::CHACHA20_POLY1305,
        ] {
            let k = v1_key(kind, "secret");
            let (mut wire, mut s) = client(&k);
            // The client's stream decrypts with a server-side reader (same framing).
            s.seal.seal(b"hello", &mut wire);
            let mut plain = Vec::new();
            server_reader(&k)
                .feed(&wire, &mut plain)
                .expect("server reads");
            let mut want = TARGET.to_vec();
            want.extend_from_slice(b"hello");
            assert_eq!(plain, want);
            // A server stream (same framing, its own salt), fed in two pieces
            // split at every offset.
            let mut salt = vec![0u8; kind.salt_len()];
            random_iv_or_salt(&mut salt);
            let body: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
            let down = sip004_server_stream(&k, &salt, &body);
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
                let (_, mut s) = client(&v1_key(kind, "secret"));
                let mut got = Vec::new();
                s.open.feed(&down[..cut], &mut got).expect("first part");
                s.open.feed(&down[cut..], &mut got).expect("second part");
                assert_eq!(got, body, "{kind} split at {cut}");
                s.open.end().expect("clean EOF");
            }
            // A flipped bit is a typed error, and a cut frame is Truncated at EOF.
            let (_, mut s) = client(&v1_key(kind, "secret"));
            let mut bad = down.clone();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            let mut got = Vec::new();
            assert_eq!(s.open.feed(&bad, &mut got), Err(AeadError::Decrypt));
            // The chunks before the bad one are out, nothing of it.
            assert!(got.len() < body.len(), "{kind}");
            assert_eq!(got, body[..got.len()], "{kind}");
            let (_, mut s) = client(&v1_key(kind, "secret"));
            s.open
                .feed(&down[..down.len() - 3], &mut Vec::new())
                .expect("partial");
            assert_eq!(s.open.end(), Err(AeadError::Truncated));
            // A salt and nothing else is an empty stream; less is not.
            for (cut, clean) in [(salt.len(), true), (salt.len() - 1, false)] {
                let (_, mut s) = client(&v1_key(kind, "secret"));
                s.open.feed(&down[..cut], &mut Vec::new()).expect("salt");
                assert_eq!(s.open.end().is_ok(), clean, "{kind} EOF after {cut} bytes");
            }
        }
    }

    /// Every frame but a payload chunk fits the stack copy
    /// ([`HEADER_FRAME_MAX`]) for every method, salt frame included.
    #[test]
    fn header_frames_fit_the_stack_copy() {
        for kind in [
            CipherKind::AES_128_GCM,
            CipherKind::AES_256_GCM,
            CipherKind::CHACHA20_POLY1305,
            CipherKind::AEAD2022_BLAKE3_AES_128_GCM,
            CipherKind::AEAD2022_BLAKE3_AES_256_GCM,
        ] {
            let k = if kind.is_aead_2022() {
                v2_key(kind)
            } else {
                v1_key(kind, "pw")
            };
            let (_, mut s) = client(&k);
            for state in [OpenState::Salt, OpenState::Length] {
                s.open.state = state;
                assert!(s.open.need() <= HEADER_FRAME_MAX, "{kind} {state:?}");
            }
        }
    }

    /// SIP022: the request header decrypts to type, timestamp, the length of
    /// the variable header, then the address and the padding; the response
    /// must echo the request's salt and carry a current timestamp.
    #[test]
    fn sip022_request_and_response_headers() {
        for kind in [
            CipherKind::AEAD2022_BLAKE3_AES_128_GCM,
            CipherKind::AEAD2022_BLAKE3_AES_256_GCM,
        ] {
            let k = v2_key(kind);
            let (tag, salt_len) = (kind.tag_len(), kind.salt_len());
            let (mut wire, mut s) = client(&k);
            let mut c = ChunkCipher::new(&k, &wire[..salt_len]);
            let fixed = &mut wire[salt_len..salt_len + 11 + tag];
            assert!(c.open(fixed), "{kind}: the fixed header verifies");
            assert_eq!(fixed[0], TYPE_CLIENT);
            let ts = u64::from_be_bytes(fixed[1..9].try_into().expect("8 bytes"));
            assert!(check_time(ts, unix_now()).is_ok());
            let var_len = usize::from(u16::from_be_bytes([fixed[9], fixed[10]]));
            assert_eq!(var_len, TARGET.len() + 2 + 17, "address, length, padding");
            let var = &mut wire[salt_len + 11 + tag..];
            assert_eq!(var.len(), var_len + tag);
            assert!(c.open(var));
            assert_eq!(var[..TARGET.len()], TARGET);

            let down = sip022_server_stream(&k, &s.open, &[9u8; 32][..salt_len], b"hi");
            let mut got = Vec::new();
            s.open.feed(&down, &mut got).expect("the server's answer");
            assert_eq!(got, b"hi");
            // Another request's salt, or an old timestamp: refused.
            let (_, mut other) = client(&k);
            let theirs = sip022_server_stream(&k, &s.open, &[8u8; 32][..salt_len], b"hi");
            assert_eq!(other.open.feed(&theirs, &mut got), Err(AeadError::NotOurs));
            let (_, mut late) = client(&k);
            late.open.clock = || unix_now() + MAX_TIME_DIFF + 1;
            let down = sip022_server_stream(&k, &late.open, &[7u8; 32][..salt_len], b"hi");
            assert!(matches!(
                late.open.feed(&down, &mut got),
                Err(AeadError::BadTimestamp(_))
            ));
        }
    }

    /// A SIP004 server stream: `salt`, then `body` in chunks.
    fn sip004_server_stream(k: &AeadKey, salt: &[u8], body: &[u8]) -> Vec<u8> {
        let mut srv = AeadSeal {
            cipher: ChunkCipher::new(k, salt),
            tag: k.kind.tag_len(),
            max_chunk: AEAD_MAX_CHUNK,
        };
        let mut down = salt.to_vec();
        srv.seal(body, &mut down);
        down
    }

    /// A SIP022 server stream answering `open`'s request: salt, the fixed
    /// response header (type, timestamp, request salt, length), `body`.
    fn sip022_server_stream(k: &AeadKey, open: &AeadOpen, salt: &[u8], body: &[u8]) -> Vec<u8> {
        let tag = k.kind.tag_len();
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
        let k = v1_key(CipherKind::AES_256_GCM, "secret");
        let salt = [7u8; 32];
        let down = sip004_server_stream(&k, &salt, b"hello");
        let (_, mut first) = client(&k);
        let mut got = Vec::new();
        first.open.feed(&down, &mut got).expect("first stream");
        assert_eq!(got, b"hello");
        let (_, mut again) = client(&k);
        let mut got = Vec::new();
        assert_eq!(again.open.feed(&down, &mut got), Err(AeadError::SaltReplay));
        assert!(got.is_empty(), "nothing of a replay is delivered");
        // Another outbound (its own key and filter) has not seen it.
        let (_, mut other) = client(&v1_key(CipherKind::AES_256_GCM, "secret"));
        other
            .open
            .feed(&down, &mut Vec::new())
            .expect("fresh filter");
        // A forged stream with a new salt fails its tag and is not
        // remembered: the real stream with that salt still gets through.
        let salt2 = [8u8; 32];
        let mut forged = sip004_server_stream(&k, &salt2, b"x");
        forged[33] ^= 1;
        let (_, mut s) = client(&k);
        assert_eq!(
            s.open.feed(&forged, &mut Vec::new()),
            Err(AeadError::Decrypt)
        );
        let (_, mut s) = client(&k);
        s.open
            .feed(&sip004_server_stream(&k, &salt2, b"x"), &mut Vec::new())
            .expect("the real one");

        // SIP022 binds the response to the request salt, so the filter is
        // a second line there: a server salt is refused even when the
        // request salt matches.
        let k = v2_key(CipherKind::AEAD2022_BLAKE3_AES_256_GCM);
        let (_, mut first) = client(&k);
        let down = sip022_server_stream(&k, &first.open, &[9u8; 32], b"hi");
        let mut got = Vec::new();
        first.open.feed(&down, &mut got).expect("first 2022 stream");
        assert_eq!(got, b"hi");
        let (_, mut again) = client(&k);
        again.open.request_salt = first.open.request_salt.clone();
        assert_eq!(
            again.open.feed(&down, &mut Vec::new()),
            Err(AeadError::SaltReplay)
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

    /// Through the traits the relay uses: what one half seals, a reader of
    /// the same framing opens, and a frame that does not verify is
    /// `InvalidData`.
    #[test]
    fn the_framing_halves_work_through_the_traits() {
        let k = v1_key(CipherKind::CHACHA20_POLY1305, "pw");
        let (mut wire, mut s) = client(&k);
        let framing: &mut dyn Framing = &mut s;
        let (seal, open) = framing.split();
        seal.seal(&[5u8; 20_000], &mut wire);
        let mut plain = Vec::new();
        server_reader(&k)
            .open(&wire, &mut plain, usize::MAX)
            .expect("reads");
        assert_eq!(plain[TARGET.len()..], [5u8; 20_000]);
        let e = open
            .open(&[0u8; 64], &mut plain, usize::MAX)
            .expect_err("garbage");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }

    /// A SIP022 server announces a 0xFFFF-byte chunk and stalls after part
    /// of it: the reader holds the whole frame's length from its first byte
    /// (what the relay charges, `Open::held`), and nothing once it
    /// completes. (Before, the held bytes grew with each read and no one
    /// saw them.)
    #[test]
    fn a_partial_frame_is_held_at_its_length() {
        let kind = CipherKind::AEAD2022_BLAKE3_AES_256_GCM;
        let k = v2_key(kind);
        let tag = kind.tag_len();
        let (_, mut s) = client(&k);
        let body = vec![4u8; AEAD2022_MAX_CHUNK];
        let down = sip022_server_stream(&k, &s.open, &[6u8; 32], &body);
        let header = 32 + 1 + 8 + 32 + 2 + tag;
        let mut got = Vec::new();
        let open: &mut dyn Open = &mut s.open;
        assert_eq!(open.held(), 0);
        let all = usize::MAX;
        let n = open.open(&down[..header + 1000], &mut got, all);
        assert_eq!(n.expect("header, part of the chunk"), header + 1000);
        assert!(got.is_empty());
        assert_eq!(open.held(), AEAD2022_MAX_CHUNK + tag, "the announced frame");
        open.open(&down[header + 1000..down.len() - 1], &mut got, all)
            .expect("more");
        assert_eq!(open.held(), AEAD2022_MAX_CHUNK + tag, "no growth past it");
        open.open(&down[down.len() - 1..], &mut got, all)
            .expect("the last byte");
        assert_eq!(got, body);
        assert_eq!(open.held(), 0, "a completed frame is freed");
    }

    /// With too little room for the frame a read cuts, the frames before
    /// it are opened and the cut one is not started: the caller keeps its
    /// bytes, learns its length, and hands them in again with room for
    /// it. The plaintext is the same as in one pass.
    #[test]
    fn a_cut_frame_past_the_room_is_left_to_the_caller() {
        let k = v1_key(CipherKind::AES_256_GCM, "pw");
        let tag = k.kind.tag_len();
        let body = vec![5u8; 3 * AEAD_MAX_CHUNK];
        let down = sip004_server_stream(&k, &[8u8; 32], &body);
        let mut s = server_reader(&k);
        let mut got = Vec::new();
        // Salt, first length and chunk, the second length, 100 bytes of
        // the second chunk.
        let first = 32 + 2 + tag + AEAD_MAX_CHUNK + tag;
        let cut = first + 2 + tag + 100;
        let open: &mut dyn Open = &mut s;
        let room = 2048;
        let n = open.open(&down[..cut], &mut got, room).expect("opens");
        assert_eq!(n, first + 2 + tag, "stops where the long chunk starts");
        assert_eq!(got, body[..AEAD_MAX_CHUNK], "the first chunk is out");
        assert_eq!(open.held(), 0, "nothing held of the cut chunk");
        assert_eq!(open.wants(), AEAD_MAX_CHUNK + tag);
        let rest = open.open(&down[first + 2 + tag..cut], &mut got, open.wants());
        assert_eq!(rest.expect("with room"), 100);
        assert_eq!(open.held(), AEAD_MAX_CHUNK + tag);
        let n = open.open(&down[cut..], &mut got, room).expect("the rest");
        assert_eq!(n, down.len() - cut);
        assert_eq!(got, body, "the same plaintext as in one pass");
        assert_eq!(open.held(), 0);
    }
}
