//! The domain of a QUIC connection: the SNI of the TLS ClientHello a client
//! carries in the CRYPTO frames of its Initial packets (RFC 9000 section
//! 17.2.2, RFC 9001 sections 4 and 5), for QUIC version 1 and version 2
//! (RFC 9369).
//!
//! Initial packets are encrypted with keys anyone can derive from the
//! packet's Destination Connection ID (RFC 9001 section 5.2), so reading
//! them takes no secret: derive the client's Initial keys, remove header
//! protection (one AES-128 block), open the payload (AES-128-GCM), collect
//! the CRYPTO frames by offset, and hand the ClientHello to the TLS reader
//! of the parent module ([`super::tls`], the same one TCP connections use;
//! QUIC has no TLS records, so it reads the bare handshake message).
//!
//! [`QuicSniffer`] is sans-I/O and per flow: the caller passes each
//! datagram the app sends while the answer is [`Sniffed::NeedMore`]. A
//! ClientHello with a large key share (post-quantum) or a long extension
//! list spans two or more Initial packets, possibly out of order; the
//! CRYPTO stream is reassembled across them. Every answer other than
//! `NeedMore` is final: more datagrams never change it. The sniffer is
//! bounded: the CRYPTO stream is kept up to [`MAX_CRYPTO`] bytes, packets
//! longer than [`MAX_PACKET`] are not opened, and the answer is `NoDomain`
//! once [`MAX_INITIALS`] Initial packets or [`MAX_DATAGRAMS`] datagrams
//! came without a whole ClientHello. It allocates only those two buffers,
//! and never panics.

use aes::cipher::{BlockCipherEncrypt, KeyInit};
use aes_gcm::{AeadInOut, Aes128Gcm};
use hkdf::Hkdf;
use sha2::Sha256;

use super::{MAX_SNIFF, Sniffed, Sniffer, tls};

/// The most CRYPTO stream bytes kept: the ClientHello must end within
/// them, as a TLS hello must within [`MAX_SNIFF`] on TCP.
pub const MAX_CRYPTO: usize = MAX_SNIFF;
/// Longest packet opened. QUIC datagrams are 1200 bytes to the path MTU;
/// a longer "Initial" is not read (and counts as one of the Initials).
pub const MAX_PACKET: usize = 16 * 1024;
/// Initial packets read before giving up (a ClientHello spans one to
/// three of them; retransmissions repeat them).
pub const MAX_INITIALS: usize = 4;
/// Datagrams read before giving up, whatever they hold (0-RTT packets may
/// follow the Initials before the hello is whole).
pub const MAX_DATAGRAMS: usize = 8;
/// Gaps the CRYPTO stream may have at once; more is not a client's
/// fragmentation but an attempt to make the reassembly work.
const MAX_RANGES: usize = 32;

/// QUIC version 1 (RFC 9000).
pub const VERSION_1: u32 = 1;
/// QUIC version 2 (RFC 9369).
pub const VERSION_2: u32 = 0x6b33_43cf;

/// The Initial salts (RFC 9001 section 5.2, RFC 9369 section 3.3.1).
const SALT_V1: [u8; 20] = [
    0x38, 0x76, 0x2c, 0xf7, 0xf5, 0x59, 0x34, 0xb3, 0x4d, 0x17, 0x9a, 0xe6, 0xa4, 0xc8, 0x0c, 0xad,
    0xcc, 0xbb, 0x7f, 0x0a,
];
const SALT_V2: [u8; 20] = [
    0x0d, 0xed, 0xe3, 0xde, 0xf7, 0x00, 0xa6, 0xdb, 0x81, 0x93, 0x81, 0xbe, 0x6e, 0x26, 0x9d, 0xcb,
    0xf9, 0xbd, 0x2e, 0xd9,
];

/// Longest connection ID in versions 1 and 2 (RFC 9000 section 17.2).
const MAX_CID: usize = 20;
/// AES-GCM tag, and the header protection sample.
const TAG: usize = 16;
const SAMPLE: usize = 16;

/// Frame types a client's Initial may hold (RFC 9000 section 12.4,
/// table 3).
const PADDING: u8 = 0x00;
const PING: u8 = 0x01;
const ACK: u8 = 0x02;
const ACK_ECN: u8 = 0x03;
const CRYPTO: u8 = 0x06;
const CONNECTION_CLOSE: u8 = 0x1c;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

/// Long-header packet types (RFC 9000 section 17.2, RFC 9369 section 3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Initial,
    ZeroRtt,
    Handshake,
    Retry,
}

impl Version {
    fn from_wire(v: u32) -> Option<Self> {
        match v {
            VERSION_1 => Some(Version::V1),
            VERSION_2 => Some(Version::V2),
            _ => None,
        }
    }

    fn salt(self) -> &'static [u8; 20] {
        match self {
            Version::V1 => &SALT_V1,
            Version::V2 => &SALT_V2,
        }
    }

    /// HKDF labels of the packet key, IV and header protection key.
    fn labels(self) -> [&'static [u8]; 3] {
        match self {
            Version::V1 => [b"quic key", b"quic iv", b"quic hp"],
            Version::V2 => [b"quicv2 key", b"quicv2 iv", b"quicv2 hp"],
        }
    }

    /// The packet type in bits 4-5 of the first byte.
    fn kind(self, bits: u8) -> Kind {
        match (self, bits & 3) {
            (Version::V1, 0) | (Version::V2, 1) => Kind::Initial,
            (Version::V1, 1) | (Version::V2, 2) => Kind::ZeroRtt,
            (Version::V1, 2) | (Version::V2, 3) => Kind::Handshake,
            _ => Kind::Retry,
        }
    }
}

/// HKDF-Expand-Label with an empty context (RFC 8446 section 7.1).
fn expand_label(prk: &Hkdf<Sha256>, label: &[u8], out: &mut [u8]) -> Option<()> {
    let len = u16::try_from(out.len()).ok()?.to_be_bytes();
    let label_len = [u8::try_from(b"tls13 ".len() + label.len()).ok()?];
    prk.expand_multi_info(&[&len, &label_len, b"tls13 ", label, &[0]], out)
        .ok()
}

/// The client's Initial packet key, IV and header protection key for a
/// Destination Connection ID (RFC 9001 section 5.2).
fn initial_secrets(version: Version, dcid: &[u8]) -> Option<([u8; 16], [u8; 12], [u8; 16])> {
    let initial = Hkdf::<Sha256>::new(Some(version.salt()), dcid);
    let mut client = [0u8; 32];
    expand_label(&initial, b"client in", &mut client)?;
    let client = Hkdf::<Sha256>::from_prk(&client).ok()?;
    let [key_label, iv_label, hp_label] = version.labels();
    let (mut key, mut iv, mut hp) = ([0u8; 16], [0u8; 12], [0u8; 16]);
    expand_label(&client, key_label, &mut key)?;
    expand_label(&client, iv_label, &mut iv)?;
    expand_label(&client, hp_label, &mut hp)?;
    Some((key, iv, hp))
}

/// A client's Initial keys, and what they were derived from.
struct Keys {
    version: Version,
    dcid: [u8; MAX_CID],
    dcid_len: usize,
    aead: Aes128Gcm,
    iv: [u8; 12],
    hp: aes::Aes128,
}

impl Keys {
    fn derive(version: Version, dcid: &[u8]) -> Option<Keys> {
        let (key, iv, hp) = initial_secrets(version, dcid)?;
        let mut id = [0u8; MAX_CID];
        id.get_mut(..dcid.len())?.copy_from_slice(dcid);
        Some(Keys {
            version,
            dcid: id,
            dcid_len: dcid.len(),
            aead: Aes128Gcm::new_from_slice(&key).ok()?,
            iv,
            hp: aes::Aes128::new_from_slice(&hp).ok()?,
        })
    }

    fn made_for(&self, version: Version, dcid: &[u8]) -> bool {
        self.version == version && self.dcid.get(..self.dcid_len) == Some(dcid)
    }

    /// The header protection mask for `sample` (RFC 9001 section 5.4.3).
    fn mask(&self, sample: &[u8]) -> Option<[u8; 16]> {
        let mut block = aes::Block::try_from(sample).ok()?;
        self.hp.encrypt_block(&mut block);
        let mut out = [0u8; 16];
        out.copy_from_slice(&block);
        Some(out)
    }

    /// Remove header protection from `pkt` (one whole long-header packet
    /// whose packet number starts at `pn_offset`) and open its payload,
    /// copying it into `scratch`. Returns the packet number and where the
    /// plaintext lies in `scratch`; `None` if the packet does not open.
    fn open(
        &self,
        pkt: &[u8],
        pn_offset: usize,
        largest: Option<u64>,
        scratch: &mut Vec<u8>,
    ) -> Option<(u64, std::ops::Range<usize>)> {
        // The sample assumes a 4-byte packet number (RFC 9001 5.4.2).
        let sample = pkt.get(pn_offset + 4..pn_offset + 4 + SAMPLE)?;
        let mask = self.mask(sample)?;
        // Long header: the low 4 bits of the first byte are protected.
        let first = pkt.first()? ^ (mask[0] & 0x0f);
        let pn_len = usize::from(first & 3) + 1;
        let hdr_len = pn_offset + pn_len;
        if pkt.len() < hdr_len + TAG {
            return None;
        }
        scratch.clear();
        scratch.extend_from_slice(pkt);
        scratch[0] = first;
        let mut truncated = 0u64;
        for (i, m) in mask[1..=pn_len].iter().enumerate() {
            let b = scratch.get_mut(pn_offset + i)?;
            *b ^= m;
            truncated = truncated << 8 | u64::from(*b);
        }
        let pn = decode_pn(largest, truncated, pn_len * 8);
        let mut nonce = self.iv;
        for (n, p) in nonce[4..].iter_mut().zip(pn.to_be_bytes()) {
            *n ^= p;
        }
        let (aad, body) = scratch.split_at_mut(hdr_len);
        let (ct, tag) = body.split_at_mut(body.len() - TAG);
        let tag = aes_gcm::Tag::try_from(&*tag).ok()?;
        self.aead
            .decrypt_inout_detached(&nonce.into(), aad, ct.into(), &tag)
            .ok()?;
        Some((pn, hdr_len..pkt.len() - TAG))
    }
}

/// The full packet number from its `bits` low bits (RFC 9000 appendix
/// A.3), next to the largest one opened so far.
fn decode_pn(largest: Option<u64>, truncated: u64, bits: usize) -> u64 {
    let expected = largest.map_or(0, |l| l + 1);
    let win = 1u64 << bits;
    let hwin = win / 2;
    let candidate = (expected & !(win - 1)) | truncated;
    if candidate + hwin <= expected && candidate < (1 << 62) - win {
        candidate + win
    } else if candidate > expected + hwin && candidate >= win {
        candidate - win
    } else {
        candidate
    }
}

/// A variable-length integer (RFC 9000 section 16), advancing `p`.
fn varint(p: &mut &[u8]) -> Option<u64> {
    let first = *p.first()?;
    let len = 1usize << (first >> 6);
    let (bytes, rest) = p.split_at_checked(len)?;
    let v = bytes[1..]
        .iter()
        .fold(u64::from(first & 0x3f), |v, &b| v << 8 | u64::from(b));
    *p = rest;
    Some(v)
}

fn varint_usize(p: &mut &[u8]) -> Option<usize> {
    usize::try_from(varint(p)?).ok()
}

/// A long-header packet of version 1 or 2 at the start of a datagram's
/// remainder.
struct Header<'a> {
    version: Version,
    kind: Kind,
    dcid: &'a [u8],
    /// Where the (protected) packet number starts.
    pn_offset: usize,
    /// The packet's length (the next coalesced packet starts there).
    len: usize,
}

/// The long header at the start of `b`; `None` for a short header, another
/// version, or a malformed one (RFC 9000 section 17.2). A Retry has no
/// length: its `len` is the rest of the datagram.
fn long_header(b: &[u8]) -> Option<Header<'_>> {
    let mut p = b;
    let (&first, rest) = p.split_first()?;
    if first & 0x80 == 0 {
        return None;
    }
    let (version, rest) = rest.split_first_chunk::<4>()?;
    let version = Version::from_wire(u32::from_be_bytes(*version))?;
    p = rest;
    let (&dcid_len, rest) = p.split_first()?;
    let dcid_len = usize::from(dcid_len);
    if dcid_len > MAX_CID {
        return None;
    }
    let (dcid, rest) = rest.split_at_checked(dcid_len)?;
    let (&scid_len, rest) = rest.split_first()?;
    let scid_len = usize::from(scid_len);
    if scid_len > MAX_CID {
        return None;
    }
    p = rest.get(scid_len..)?;
    let kind = version.kind(first >> 4);
    if kind == Kind::Retry {
        return Some(Header {
            version,
            kind,
            dcid,
            pn_offset: b.len(),
            len: b.len(),
        });
    }
    if kind == Kind::Initial {
        let token = varint_usize(&mut p)?;
        p = p.get(token..)?;
    }
    let length = varint_usize(&mut p)?;
    let pn_offset = b.len() - p.len();
    let len = pn_offset.checked_add(length)?;
    if len > b.len() {
        return None;
    }
    Some(Header {
        version,
        kind,
        dcid,
        pn_offset,
        len,
    })
}

/// What reading one packet's frames found.
enum Frames {
    /// Only the frames an Initial may hold.
    Ok,
    /// The client closes the connection (CONNECTION_CLOSE).
    Closed,
    /// A frame an Initial may not hold, or a malformed one.
    Bad,
}

/// The answer, once given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Pending,
    NoDomain,
    /// The name's place in the CRYPTO buffer.
    Domain {
        start: usize,
        len: usize,
    },
}

/// One QUIC flow's sniffer: feed it the datagrams the client sends, in
/// order, until it answers other than [`Sniffed::NeedMore`].
pub struct QuicSniffer {
    /// The client's Initial keys, once a packet opened with them.
    keys: Option<Keys>,
    /// Largest Initial packet number opened.
    largest: Option<u64>,
    /// The CRYPTO stream from offset 0, up to [`MAX_CRYPTO`] bytes.
    crypto: Vec<u8>,
    /// Byte ranges of `crypto` received: sorted, disjoint, not touching.
    ranges: [(usize, usize); MAX_RANGES],
    n_ranges: usize,
    /// Length of the contiguous prefix last given to the TLS reader.
    parsed: usize,
    /// One packet's plaintext, up to [`MAX_PACKET`] bytes.
    scratch: Vec<u8>,
    datagrams: usize,
    initials: usize,
    verdict: Verdict,
}

impl std::fmt::Debug for QuicSniffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicSniffer")
            .field("keys", &self.keys.as_ref().map(|k| k.version))
            .field("crypto", &self.crypto.len())
            .field("ranges", &&self.ranges[..self.n_ranges])
            .field("datagrams", &self.datagrams)
            .field("initials", &self.initials)
            .field("verdict", &self.verdict)
            .finish()
    }
}

impl Default for QuicSniffer {
    fn default() -> Self {
        Self::new()
    }
}

impl QuicSniffer {
    /// A sniffer for a new flow. Allocates nothing until the first
    /// Initial packet.
    pub fn new() -> Self {
        QuicSniffer {
            keys: None,
            largest: None,
            crypto: Vec::new(),
            ranges: [(0, 0); MAX_RANGES],
            n_ranges: 0,
            parsed: 0,
            scratch: Vec::new(),
            datagrams: 0,
            initials: 0,
            verdict: Verdict::Pending,
        }
    }

    /// Read one datagram the client sent (the UDP payload). The first
    /// one must begin with a QUIC v1 or v2 Initial packet, else the flow
    /// is not QUIC (or not its start) and the answer is `NoDomain`.
    /// Once the answer is final, later datagrams are not looked at.
    pub fn push(&mut self, datagram: &[u8]) -> Sniffed<'_> {
        if self.verdict == Verdict::Pending {
            self.datagrams += 1;
            let mut scratch = std::mem::take(&mut self.scratch);
            self.read_datagram(datagram, &mut scratch);
            self.give_up_past_bounds();
            if self.verdict == Verdict::Pending {
                self.scratch = scratch;
            }
        }
        self.answer()
    }

    /// The frames of an Initial packet as if it had just opened (its
    /// plaintext payload), counted as one datagram with one Initial. For
    /// the fuzz target (`fuzz/fuzz_targets/quic.rs`), which cannot make
    /// packets that open: it reaches the frame walk and the reassembly
    /// this way.
    #[doc(hidden)]
    pub fn push_plaintext(&mut self, payload: &[u8]) -> Sniffed<'_> {
        if self.verdict == Verdict::Pending {
            self.datagrams += 1;
            self.initials += 1;
            self.read_frames(payload);
            self.give_up_past_bounds();
        }
        self.answer()
    }

    /// No answer within [`MAX_INITIALS`] Initials or [`MAX_DATAGRAMS`]
    /// datagrams: the answer is `NoDomain`.
    fn give_up_past_bounds(&mut self) {
        if self.verdict == Verdict::Pending
            && (self.initials >= MAX_INITIALS || self.datagrams >= MAX_DATAGRAMS)
        {
            self.verdict = Verdict::NoDomain;
        }
    }

    /// The answer so far (what the last [`push`](Self::push) returned).
    pub fn answer(&self) -> Sniffed<'_> {
        match self.verdict {
            Verdict::Pending => Sniffed::NeedMore,
            Verdict::NoDomain => Sniffed::NoDomain,
            Verdict::Domain { start, len } => match self
                .crypto
                .get(start..start + len)
                .and_then(|n| std::str::from_utf8(n).ok())
            {
                Some(name) => Sniffed::Domain {
                    proto: Sniffer::Quic,
                    name,
                },
                None => Sniffed::NoDomain,
            },
        }
    }

    /// Walk the coalesced packets of one datagram (RFC 9000 section 12.2).
    fn read_datagram(&mut self, datagram: &[u8], scratch: &mut Vec<u8>) {
        let mut rest = datagram;
        let mut first = self.datagrams == 1;
        if first && rest.is_empty() {
            self.verdict = Verdict::NoDomain;
            return;
        }
        while self.verdict == Verdict::Pending && !rest.is_empty() {
            let Some(h) = long_header(rest) else {
                // A short header, another version, or a malformed packet:
                // nothing after it can be found (section 12.2).
                if first {
                    self.verdict = Verdict::NoDomain;
                }
                return;
            };
            if first && h.kind != Kind::Initial {
                // A client's first datagram starts with its Initial.
                self.verdict = Verdict::NoDomain;
                return;
            }
            first = false;
            let (pkt, next) = rest.split_at(h.len);
            rest = next;
            match h.kind {
                Kind::Initial => {
                    self.initials += 1;
                    if self.initials > MAX_INITIALS {
                        return;
                    }
                    self.read_initial(&h, pkt, scratch);
                }
                // Not for the client's hello: skipped by their length.
                Kind::ZeroRtt | Kind::Handshake => {}
                // A client sends none; nothing follows one in a datagram.
                Kind::Retry => return,
            }
        }
    }

    fn read_initial(&mut self, h: &Header<'_>, pkt: &[u8], scratch: &mut Vec<u8>) {
        if pkt.len() > MAX_PACKET {
            return;
        }
        let mut opened = None;
        if let Some(k) = &self.keys {
            if k.version == h.version {
                opened = k.open(pkt, h.pn_offset, self.largest, scratch);
            }
        }
        if opened.is_none()
            && !self
                .keys
                .as_ref()
                .is_some_and(|k| k.made_for(h.version, h.dcid))
        {
            // The first Initial, or one after a Retry (new Destination
            // Connection ID, new keys: RFC 9001 section 5.2).
            if let Some(k) = Keys::derive(h.version, h.dcid) {
                opened = k.open(pkt, h.pn_offset, self.largest, scratch);
                if opened.is_some() {
                    self.keys = Some(k);
                }
            }
        }
        // A packet that does not open (damaged, or not QUIC after all) is
        // dropped, as a server would (RFC 9001 section 5.5).
        let Some((pn, range)) = opened else {
            return;
        };
        self.largest = Some(self.largest.map_or(pn, |l| l.max(pn)));
        if let Some(plain) = scratch.get(range) {
            self.read_frames(plain);
        }
    }

    /// An opened Initial's frames, then the hello if the stream grew.
    fn read_frames(&mut self, plain: &[u8]) {
        match self.frames(plain) {
            Frames::Ok => self.check_hello(),
            Frames::Closed => {
                self.check_hello();
                if self.verdict == Verdict::Pending {
                    self.verdict = Verdict::NoDomain;
                }
            }
            Frames::Bad => self.verdict = Verdict::NoDomain,
        }
    }

    /// Read an Initial's frames, keeping CRYPTO data.
    fn frames(&mut self, mut p: &[u8]) -> Frames {
        while let Some((&ty, rest)) = p.split_first() {
            p = rest;
            let ok = match ty {
                PADDING | PING => Some(()),
                ACK | ACK_ECN => skip_ack(&mut p, ty == ACK_ECN),
                CRYPTO => match self.crypto_frame(&mut p) {
                    Some(true) => Some(()),
                    Some(false) => return Frames::Bad,
                    None => None,
                },
                CONNECTION_CLOSE => return Frames::Closed,
                // Frame types are minimally encoded (section 12.4): any
                // other first byte is a frame an Initial may not hold.
                _ => None,
            };
            if ok.is_none() {
                return Frames::Bad;
            }
        }
        Frames::Ok
    }

    /// One CRYPTO frame's data into the stream buffer. `None` if
    /// malformed, `Some(false)` if it fragments the stream past
    /// [`MAX_RANGES`] gaps.
    fn crypto_frame(&mut self, p: &mut &[u8]) -> Option<bool> {
        let offset = varint_usize(p)?;
        let len = varint_usize(p)?;
        let (data, rest) = p.split_at_checked(len)?;
        *p = rest;
        // The stream is at most 2^62 - 1 bytes (section 19.6).
        let end = offset.checked_add(len)?;
        if u64::try_from(end).ok()? >= 1 << 62 {
            return None;
        }
        // Only what lies under the cap is kept.
        let end = end.min(MAX_CRYPTO);
        if offset >= end {
            return Some(true);
        }
        if self.crypto.len() < end {
            self.crypto.resize(end, 0);
        }
        self.crypto
            .get_mut(offset..end)?
            .copy_from_slice(data.get(..end - offset)?);
        Some(self.add_range(offset, end))
    }

    /// Record `[start, end)` as received, merging with the ranges it
    /// touches; `false` if that would need more than [`MAX_RANGES`].
    fn add_range(&mut self, mut start: usize, mut end: usize) -> bool {
        let ranges = &mut self.ranges[..self.n_ranges];
        // First range that ends at or after `start`, and the first one
        // that starts after `end`: those between merge with the new one.
        let lo = ranges.partition_point(|&(_, e)| e < start);
        let hi = ranges.partition_point(|&(s, _)| s <= end);
        if lo < hi {
            start = start.min(ranges[lo].0);
            end = end.max(ranges[hi - 1].1);
            ranges[lo] = (start, end);
            self.ranges.copy_within(hi..self.n_ranges, lo + 1);
            self.n_ranges -= hi - lo - 1;
            return true;
        }
        if self.n_ranges == MAX_RANGES {
            return false;
        }
        self.ranges.copy_within(lo..self.n_ranges, lo + 1);
        self.ranges[lo] = (start, end);
        self.n_ranges += 1;
        true
    }

    /// Read the ClientHello from the stream's contiguous prefix when it
    /// grew.
    fn check_hello(&mut self) {
        let prefix = match self.ranges[..self.n_ranges].first() {
            Some(&(0, end)) => end,
            _ => return,
        };
        if prefix <= self.parsed {
            return;
        }
        self.parsed = prefix;
        let Some(stream) = self.crypto.get(..prefix) else {
            return;
        };
        self.verdict = match tls::sniff_handshake(stream, Sniffer::Quic) {
            Sniffed::NeedMore if prefix >= MAX_CRYPTO => Verdict::NoDomain,
            Sniffed::NeedMore => Verdict::Pending,
            Sniffed::NoDomain => Verdict::NoDomain,
            Sniffed::Domain { name, .. } => {
                // The name is a slice of `stream`, itself of `crypto`.
                let start = (name.as_ptr() as usize).wrapping_sub(stream.as_ptr() as usize);
                if start.checked_add(name.len()).is_some_and(|e| e <= prefix) {
                    Verdict::Domain {
                        start,
                        len: name.len(),
                    }
                } else {
                    Verdict::NoDomain
                }
            }
        };
    }
}

/// Skip an ACK frame's fields after its type (RFC 9000 section 19.3).
fn skip_ack(p: &mut &[u8], ecn: bool) -> Option<()> {
    let _largest = varint(p)?;
    let _delay = varint(p)?;
    let ranges = varint(p)?;
    let _first = varint(p)?;
    // Each range is two varints of at least a byte: a count larger than
    // what is left is malformed (and would only loop).
    if ranges > u64::try_from(p.len()).ok()? {
        return None;
    }
    for _ in 0..ranges {
        varint(p)?;
        varint(p)?;
    }
    if ecn {
        for _ in 0..3 {
            varint(p)?;
        }
    }
    Some(())
}

#[cfg(test)]
mod tests;
