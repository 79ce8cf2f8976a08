//! IPv4 header view (RFC 791 3.1).

use std::net::Ipv4Addr;

use super::{DEFAULT_TTL, IpInfo, Reject, checksum};

/// Field offsets of the fixed IPv4 header (RFC 791 3.1, figure 4).
pub mod field {
    use std::ops::Range;

    /// Version (high nibble) and IHL in 32-bit words (low nibble).
    pub const VER_IHL: usize = 0;
    /// DSCP and ECN (RFC 2474, RFC 3168), formerly type of service.
    pub const TOS: usize = 1;
    pub const TOTAL_LEN: Range<usize> = 2..4;
    pub const IDENT: Range<usize> = 4..6;
    /// Flags (reserved, DF, MF) and the 13-bit fragment offset.
    pub const FLAGS_FRAG: Range<usize> = 6..8;
    pub const TTL: usize = 8;
    pub const PROTOCOL: usize = 9;
    pub const CHECKSUM: Range<usize> = 10..12;
    pub const SRC: Range<usize> = 12..16;
    pub const DST: Range<usize> = 16..20;
    /// Source and destination together: the words a NAT rewrite replaces.
    pub const ADDRS: Range<usize> = 12..20;
}

/// Length of the IPv4 header without options (IHL 5, RFC 791).
pub const HEADER_LEN: usize = field::DST.end;

const FLAG_DF: u16 = 0x4000;
const FLAG_MF: u16 = 0x2000;
const FRAG_OFFSET_MASK: u16 = 0x1fff;

header_view! {
    /// A read/write view of an IPv4 header over a buffer.
    pub struct Ipv4Packet, at least HEADER_LEN bytes;
    pub tos, set_tos: u8 = field::TOS;
    pub total_len, set_total_len: u16 = field::TOTAL_LEN;
    pub ident, set_ident: u16 = field::IDENT;
    flags_frag, set_flags_frag: u16 = field::FLAGS_FRAG;
    pub ttl, set_ttl: u8 = field::TTL;
    pub protocol, set_protocol: u8 = field::PROTOCOL;
    pub checksum, set_checksum: u16 = field::CHECKSUM;
    pub src_addr, set_src_addr: Ipv4Addr = field::SRC;
    pub dst_addr, set_dst_addr: Ipv4Addr = field::DST;
}

impl<T: AsRef<[u8]>> Ipv4Packet<T> {
    /// Wraps untrusted input after every structural check: at least 20
    /// bytes, version 4, IHL >= 5, and header length <= total length <=
    /// buffer length. After this no accessor can panic. Fragments are not
    /// rejected here (that is [`super::parse_ip`]'s policy).
    pub fn new_checked(buffer: T) -> Result<Self, Reject> {
        let b = buffer.as_ref();
        let Some(hdr) = b.first_chunk::<HEADER_LEN>() else {
            return Err(Reject::Ipv4Truncated);
        };
        let hdr = Ipv4Packet::new_unchecked(hdr);
        if hdr.version() != 4 {
            return Err(Reject::BadVersion);
        }
        let header_len = hdr.header_len();
        if header_len < HEADER_LEN {
            return Err(Reject::Ipv4BadHeaderLength);
        }
        let total = usize::from(hdr.total_len());
        if total < header_len || total > b.len() {
            return Err(Reject::Ipv4BadTotalLength);
        }
        Ok(Ipv4Packet { buffer })
    }

    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_IHL] >> 4
    }

    /// Header length in bytes (IHL * 4).
    pub fn header_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[field::VER_IHL] & 0x0f) * 4
    }

    pub fn dont_frag(&self) -> bool {
        self.flags_frag() & FLAG_DF != 0
    }

    pub fn more_frags(&self) -> bool {
        self.flags_frag() & FLAG_MF != 0
    }

    /// Fragment offset in 8-byte units (RFC 791).
    pub fn frag_offset(&self) -> u16 {
        self.flags_frag() & FRAG_OFFSET_MASK
    }

    /// Whether this is any fragment but a whole datagram: MF set or a
    /// nonzero offset (the first fragment has MF, the last a nonzero offset).
    pub fn is_fragment(&self) -> bool {
        self.flags_frag() & (FLAG_MF | FRAG_OFFSET_MASK) != 0
    }

    /// Whether the header checksum (over IHL * 4 bytes) verifies.
    pub fn verify_checksum(&self) -> bool {
        let hdr = &self.buffer.as_ref()[..self.header_len()];
        checksum::fold(checksum::sum_bytes(hdr)) == 0xffff
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv4Packet<T> {
    /// Sets version 4 and the header length in bytes (a multiple of 4).
    pub fn set_version_header_len(&mut self, header_len: usize) {
        self.buffer.as_mut()[field::VER_IHL] = 0x40 | ((header_len / 4) as u8 & 0x0f);
    }

    /// Sets DF and clears MF and the fragment offset: a whole datagram.
    pub fn set_unfragmented(&mut self, dont_frag: bool) {
        self.set_flags_frag(if dont_frag { FLAG_DF } else { 0 });
    }

    /// Recomputes the header checksum from scratch (RFC 791: the ones'
    /// complement of the ones' complement sum of the header's 16-bit words,
    /// taken with the field zero).
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let len = self.header_len();
        let c = checksum::finish(checksum::sum_bytes(&self.buffer.as_ref()[..len]));
        self.set_checksum(c);
    }
}

/// Writes a 20-byte header for a locally originated datagram: no options,
/// TOS 0, identification 0 with DF set (RFC 6864 4.1 allows any ID on
/// atomic datagrams), TTL [`DEFAULT_TTL`], and a fresh checksum.
/// `payload_len` must be at most 65515 (the caller checks).
pub fn emit_header(
    hdr: &mut [u8; HEADER_LEN],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    protocol: u8,
    payload_len: u16,
) {
    let mut p = Ipv4Packet::new_unchecked(hdr);
    p.set_version_header_len(HEADER_LEN);
    p.set_tos(0);
    p.set_total_len(payload_len.saturating_add(HEADER_LEN as u16));
    p.set_ident(0);
    p.set_unfragmented(true);
    p.set_ttl(DEFAULT_TTL);
    p.set_protocol(protocol);
    p.set_src_addr(src);
    p.set_dst_addr(dst);
    p.fill_checksum();
}

/// IPv4 half of [`super::parse_ip`].
#[inline]
pub fn parse(buf: &[u8]) -> Result<IpInfo, Reject> {
    let p = Ipv4Packet::new_checked(buf)?;
    if p.is_fragment() {
        return Err(Reject::Ipv4Fragment);
    }
    Ok(IpInfo {
        src: p.src_addr().into(),
        dst: p.dst_addr().into(),
        protocol: p.protocol(),
        l4_offset: p.header_len(),
        len: usize::from(p.total_len()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::testutil::*;
    use crate::packet::{parse_ip, protocol, tcp_flags};

    fn syn() -> Vec<u8> {
        tcp_v4(
            "10.0.0.9:12345",
            "1.1.1.1:443",
            7,
            0,
            tcp_flags::SYN,
            &[],
            b"",
        )
    }

    #[test]
    fn view_reads_fields() {
        let p = syn();
        let v = Ipv4Packet::new_checked(&p[..]).expect("valid");
        assert_eq!(v.version(), 4);
        assert_eq!(v.header_len(), 20);
        assert_eq!(v.total_len(), 40);
        assert_eq!(v.ttl(), 64);
        assert_eq!(v.protocol(), protocol::TCP);
        assert_eq!(v.src_addr(), Ipv4Addr::new(10, 0, 0, 9));
        assert_eq!(v.dst_addr(), Ipv4Addr::new(1, 1, 1, 1));
        assert!(v.dont_frag());
        assert!(!v.is_fragment());
        assert!(v.verify_checksum());
    }

    #[test]
    fn truncated_at_every_length() {
        let p = syn();
        for n in 1..HEADER_LEN {
            assert_eq!(parse_ip(&p[..n]), Err(Reject::Ipv4Truncated), "len {n}");
        }
        // From the fixed header up to the declared length: the buffer no
        // longer holds what the header declares.
        for n in HEADER_LEN..p.len() {
            assert_eq!(
                parse_ip(&p[..n]),
                Err(Reject::Ipv4BadTotalLength),
                "len {n}"
            );
        }
        assert!(parse_ip(&p).is_ok());
    }

    #[test]
    fn header_length_checks() {
        for ihl in 0..5u8 {
            let mut p = syn();
            p[0] = 0x40 | ihl;
            assert_eq!(parse_ip(&p), Err(Reject::Ipv4BadHeaderLength), "ihl {ihl}");
        }
        // IHL 15 (60 bytes) in a 40-byte packet: total length below header.
        let mut p = syn();
        p[0] = 0x4f;
        assert_eq!(parse_ip(&p), Err(Reject::Ipv4BadTotalLength));
        // Total length below IHL * 4 even though the buffer is long.
        let mut p = syn();
        p[2..4].copy_from_slice(&19u16.to_be_bytes());
        assert_eq!(parse_ip(&p), Err(Reject::Ipv4BadTotalLength));
    }

    #[test]
    fn options_shift_l4_offset() {
        // 8 bytes of options: two NOPs and EOL padding (RFC 791 3.1).
        let l4 = tcp_segment(1, 2, 0, 0, tcp_flags::SYN, &[], b"");
        let p = ipv4_packet_with_options("10.0.0.1", "10.0.0.2", &[1, 1, 0, 0, 0, 0, 0, 0], 6, &l4);
        let ip = parse_ip(&p).expect("valid");
        assert_eq!(ip.l4_offset, 28);
        assert_eq!(ip.len, 48);
    }

    #[test]
    fn fragments_rejected() {
        // MF alone (first fragment), offset alone (last), both (middle).
        for flags_frag in [0x2000u16, 0x0001, 0x2001, 0x1fff, 0x3fff] {
            let mut p = syn();
            p[6..8].copy_from_slice(&flags_frag.to_be_bytes());
            assert_eq!(parse_ip(&p), Err(Reject::Ipv4Fragment), "{flags_frag:#x}");
        }
        // DF and the reserved bit are not fragmentation.
        for flags_frag in [0x4000u16, 0x8000, 0] {
            let mut p = syn();
            p[6..8].copy_from_slice(&flags_frag.to_be_bytes());
            assert!(parse_ip(&p).is_ok(), "{flags_frag:#x}");
        }
    }

    #[test]
    fn emit_header_is_valid() {
        let mut hdr = [0xaau8; HEADER_LEN];
        emit_header(
            &mut hdr,
            Ipv4Addr::new(198, 18, 0, 1),
            Ipv4Addr::new(10, 0, 0, 9),
            protocol::UDP,
            100,
        );
        let v = Ipv4Packet::new_unchecked(&hdr);
        assert!(v.verify_checksum());
        assert_eq!(v.total_len(), 120);
        assert_eq!((v.ttl(), v.dont_frag(), v.ident()), (64, true, 0));
        assert_eq!(reference_sum(&hdr), 0xffff);
    }
}
