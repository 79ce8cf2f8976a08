//! IPv6 header view (RFC 8200 3) and the extension-header walk (RFC 8200 4).

use std::net::Ipv6Addr;

use super::view::Field;
use super::{DEFAULT_TTL, IpInfo, Reject};

/// Field offsets of the fixed IPv6 header (RFC 8200 3).
pub mod field {
    use std::ops::Range;

    /// Version (4 bits), traffic class (8), flow label (20).
    pub const VER_TC_FLOW: Range<usize> = 0..4;
    pub const PAYLOAD_LEN: Range<usize> = 4..6;
    pub const NEXT_HEADER: usize = 6;
    pub const HOP_LIMIT: usize = 7;
    pub const SRC: Range<usize> = 8..24;
    pub const DST: Range<usize> = 24..40;
    /// Source and destination together: the words a NAT rewrite replaces.
    pub const ADDRS: Range<usize> = 8..40;
}

/// Length of the fixed IPv6 header.
pub const HEADER_LEN: usize = field::DST.end;

/// Next-header values of the extension headers the walk knows (IANA "IPv6
/// Extension Header Types").
pub mod ext {
    /// Hop-by-Hop Options (RFC 8200 4.3), 8-byte units.
    pub const HOP_BY_HOP: u8 = 0;
    /// Routing (RFC 8200 4.4), 8-byte units.
    pub const ROUTING: u8 = 43;
    /// Fragment (RFC 8200 4.5), rejected.
    pub const FRAGMENT: u8 = 44;
    /// Encapsulating Security Payload (RFC 4303), rejected: opaque after it.
    pub const ESP: u8 = 50;
    /// Authentication Header (RFC 4302), 4-byte units.
    pub const AH: u8 = 51;
    /// No Next Header (RFC 8200 4.7).
    pub const NO_NEXT_HEADER: u8 = 59;
    /// Destination Options (RFC 8200 4.6), 8-byte units.
    pub const DEST_OPTS: u8 = 60;
}

header_view! {
    /// A read/write view of an IPv6 header over a buffer.
    pub struct Ipv6Packet, at least HEADER_LEN bytes;
    pub payload_len, set_payload_len: u16 = field::PAYLOAD_LEN;
    pub next_header, set_next_header: u8 = field::NEXT_HEADER;
    pub hop_limit, set_hop_limit: u8 = field::HOP_LIMIT;
    pub src_addr: Ipv6Addr = field::SRC;
    pub dst_addr: Ipv6Addr = field::DST;
}

impl<T: AsRef<[u8]>> Ipv6Packet<T> {
    /// Wraps untrusted input after every structural check of the fixed
    /// header: at least 40 bytes, version 6, and 40 + payload length within
    /// the buffer. After this no accessor can panic. Extension headers are
    /// checked by [`walk_extension_headers`].
    pub fn new_checked(buffer: T) -> Result<Self, Reject> {
        let b = buffer.as_ref();
        let Some(hdr) = b.first_chunk::<HEADER_LEN>() else {
            return Err(Reject::Ipv6Truncated);
        };
        let hdr = Ipv6Packet::new_unchecked(hdr);
        if hdr.version() != 6 {
            return Err(Reject::BadVersion);
        }
        if HEADER_LEN + usize::from(hdr.payload_len()) > b.len() {
            return Err(Reject::Ipv6BadPayloadLength);
        }
        Ok(Ipv6Packet { buffer })
    }

    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_TC_FLOW.start] >> 4
    }

    /// Header length plus payload length: the packet's declared length.
    pub fn total_len(&self) -> usize {
        HEADER_LEN + usize::from(self.payload_len())
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv6Packet<T> {
    /// Sets version 6, traffic class 0 and flow label 0.
    pub fn set_version_clear_flow(&mut self) {
        self.buffer.as_mut()[field::VER_TC_FLOW].copy_from_slice(&[0x60, 0, 0, 0]);
    }

    pub fn set_src_addr(&mut self, a: &Ipv6Addr) {
        Ipv6Addr::put(self.buffer.as_mut(), field::SRC, *a);
    }

    pub fn set_dst_addr(&mut self, a: &Ipv6Addr) {
        Ipv6Addr::put(self.buffer.as_mut(), field::DST, *a);
    }
}

/// Walks the extension-header chain of `pkt` (the packet cut to its
/// declared length) starting with next header `first`, and returns the
/// upper-layer protocol and its offset.
///
/// Every header's first two bytes (next header, length) and then its whole
/// length are checked against `pkt` before use. Each header is at least 8
/// bytes, so the walk ends after at most `pkt.len() / 8` steps. Hop-by-Hop
/// is accepted anywhere in the chain (RFC 8200 4.1 wants it first; the
/// kernel that receives the rewritten packet enforces that).
pub fn walk_extension_headers(pkt: &[u8], first: u8) -> Result<(u8, usize), Reject> {
    let mut next = first;
    let mut off = HEADER_LEN;
    loop {
        let four_byte_units = match next {
            ext::HOP_BY_HOP | ext::ROUTING | ext::DEST_OPTS => false,
            ext::AH => true,
            ext::FRAGMENT => return Err(Reject::Ipv6Fragment),
            ext::ESP => return Err(Reject::Ipv6Esp),
            upper => return Ok((upper, off)),
        };
        let Some(&[nh, len]) = pkt.get(off..).and_then(|r| r.first_chunk::<2>()) else {
            return Err(Reject::Ipv6ExtTruncated);
        };
        let size = if four_byte_units {
            // RFC 4302 2.2: "Payload Len" is the AH length in 32-bit words,
            // minus 2.
            (usize::from(len) + 2) * 4
        } else {
            // RFC 8200 4.3, 4.4, 4.6: "Hdr Ext Len" in 8-octet units, not
            // including the first 8 octets.
            (usize::from(len) + 1) * 8
        };
        let end = off + size;
        let Some(hdr) = pkt.get(off..end) else {
            return Err(Reject::Ipv6ExtTruncated);
        };
        // RFC 8200 4.4: with segments left != 0 the destination field names
        // the next hop, not the final destination. `size` >= 8 holds the
        // Segments Left octet (offset 3).
        if next == ext::ROUTING && hdr.get(3).is_some_and(|&s| s != 0) {
            return Err(Reject::Ipv6RoutingSegmentsLeft);
        }
        next = nh;
        off = end;
    }
}

/// Writes a 40-byte header for a locally originated packet: traffic class
/// and flow label 0, hop limit [`DEFAULT_TTL`], no extension headers.
pub fn emit_header(
    hdr: &mut [u8; HEADER_LEN],
    src: &Ipv6Addr,
    dst: &Ipv6Addr,
    next_header: u8,
    payload_len: u16,
) {
    let mut p = Ipv6Packet::new_unchecked(hdr);
    p.set_version_clear_flow();
    p.set_payload_len(payload_len);
    p.set_next_header(next_header);
    p.set_hop_limit(DEFAULT_TTL);
    p.set_src_addr(src);
    p.set_dst_addr(dst);
}

/// IPv6 half of [`super::parse_ip`].
#[inline]
pub fn parse(buf: &[u8]) -> Result<IpInfo, Reject> {
    let p = Ipv6Packet::new_checked(buf)?;
    let len = p.total_len();
    // RFC 2675: a jumbogram has payload length 0 and its real length in a
    // Hop-by-Hop option. A TUN's MTU never needs one; without the check the
    // walk would report a truncated Hop-by-Hop header instead.
    if len == HEADER_LEN && p.next_header() == ext::HOP_BY_HOP {
        return Err(Reject::Ipv6Jumbogram);
    }
    let pkt = buf.get(..len).ok_or(Reject::Ipv6BadPayloadLength)?;
    let (protocol, l4_offset) = walk_extension_headers(pkt, p.next_header())?;
    Ok(IpInfo {
        src: p.src_addr().into(),
        dst: p.dst_addr().into(),
        protocol,
        l4_offset,
        len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::testutil::*;
    use crate::packet::{parse_ip, parse_tcp, protocol, tcp_flags};

    fn syn_with(ext: &[ExtHdr]) -> Vec<u8> {
        tcp_v6(
            "[fd00::9]:12345",
            "[2001:db8::1]:443",
            ext,
            7,
            0,
            tcp_flags::SYN,
            &[],
            b"hello",
        )
    }

    #[test]
    fn view_reads_fields() {
        let p = syn_with(&[]);
        let v = Ipv6Packet::new_checked(&p[..]).expect("valid");
        assert_eq!(v.version(), 6);
        assert_eq!(v.payload_len(), 25);
        assert_eq!(v.next_header(), protocol::TCP);
        assert_eq!(v.hop_limit(), 64);
        assert_eq!(v.src_addr(), "fd00::9".parse::<Ipv6Addr>().expect("addr"));
        assert_eq!(
            v.dst_addr(),
            "2001:db8::1".parse::<Ipv6Addr>().expect("addr")
        );
    }

    #[test]
    fn ext_header_chains() {
        let chains: &[&[ExtHdr]] = &[
            &[],
            &[ExtHdr::HopByHop { units: 0 }],
            &[ExtHdr::HopByHop { units: 2 }, ExtHdr::DestOpts { units: 1 }],
            &[
                ExtHdr::HopByHop { units: 0 },
                ExtHdr::DestOpts { units: 0 },
                ExtHdr::Routing { segments_left: 0 },
                ExtHdr::Ah { words: 4 },
                ExtHdr::DestOpts { units: 3 },
            ],
            &[ExtHdr::Ah { words: 10 }],
            &[
                ExtHdr::Routing { segments_left: 0 },
                ExtHdr::Ah { words: 2 },
            ],
        ];
        for chain in chains {
            let p = syn_with(chain);
            let ip = parse_ip(&p).expect("valid chain");
            let ext_len: usize = chain.iter().map(ExtHdr::len).sum();
            assert_eq!(ip.l4_offset, HEADER_LEN + ext_len, "{chain:?}");
            assert_eq!(ip.protocol, protocol::TCP);
            assert_eq!(ip.len, p.len());
            let tcp = parse_tcp(&p, &ip).expect("tcp after chain");
            assert_eq!(
                (tcp.src_port, tcp.dst_port, tcp.payload_len),
                (12345, 443, 5)
            );
        }
    }

    #[test]
    fn ah_uses_four_byte_units() {
        // AH payload len 4 -> (4 + 2) * 4 = 24 bytes, where an 8-byte-unit
        // reading would give 40.
        let p = syn_with(&[ExtHdr::Ah { words: 4 }]);
        assert_eq!(parse_ip(&p).expect("valid").l4_offset, 40 + 24);
    }

    #[test]
    fn fragment_and_esp_rejected_anywhere_in_chain() {
        for chain in [
            vec![ExtHdr::Fragment],
            vec![ExtHdr::HopByHop { units: 0 }, ExtHdr::Fragment],
            vec![
                ExtHdr::DestOpts { units: 1 },
                ExtHdr::Ah { words: 4 },
                ExtHdr::Fragment,
            ],
        ] {
            let p = syn_with(&chain);
            assert_eq!(parse_ip(&p), Err(Reject::Ipv6Fragment), "{chain:?}");
        }
        for chain in [
            vec![ExtHdr::Esp],
            vec![ExtHdr::Routing { segments_left: 0 }, ExtHdr::Esp],
        ] {
            let p = syn_with(&chain);
            assert_eq!(parse_ip(&p), Err(Reject::Ipv6Esp), "{chain:?}");
        }
    }

    #[test]
    fn truncated_at_every_length() {
        let p = syn_with(&[]);
        for n in 1..HEADER_LEN {
            assert_eq!(parse_ip(&p[..n]), Err(Reject::Ipv6Truncated), "len {n}");
        }
        for n in HEADER_LEN..p.len() {
            assert_eq!(
                parse_ip(&p[..n]),
                Err(Reject::Ipv6BadPayloadLength),
                "len {n}"
            );
        }
    }

    /// Cutting a chain anywhere inside an extension header (with the payload
    /// length adjusted, so the IPv6 header itself is consistent) is
    /// `Ipv6ExtTruncated` at every length.
    #[test]
    fn ext_truncated_at_every_length() {
        let chain = [
            ExtHdr::HopByHop { units: 1 },
            ExtHdr::Routing { segments_left: 0 },
            ExtHdr::Ah { words: 4 },
            ExtHdr::DestOpts { units: 0 },
        ];
        let p = syn_with(&chain);
        let ext_end = HEADER_LEN + chain.iter().map(ExtHdr::len).sum::<usize>();
        for n in HEADER_LEN..ext_end {
            let cut = set_ip_len(&p, n);
            if n == HEADER_LEN {
                // Payload length 0 with Hop-by-Hop first reads as a jumbogram.
                assert_eq!(parse_ip(&cut), Err(Reject::Ipv6Jumbogram));
            } else {
                assert_eq!(parse_ip(&cut), Err(Reject::Ipv6ExtTruncated), "len {n}");
            }
        }
        // Exactly the chain and no transport bytes: the walk succeeds and
        // the transport parser reports the truncation.
        let cut = set_ip_len(&p, ext_end);
        let ip = parse_ip(&cut).expect("chain complete");
        assert_eq!(ip.l4_offset, ext_end);
        assert_eq!(parse_tcp(&cut, &ip), Err(Reject::TcpTruncated));
    }

    #[test]
    fn routing_segments_left() {
        let p = syn_with(&[ExtHdr::Routing { segments_left: 2 }]);
        assert_eq!(parse_ip(&p), Err(Reject::Ipv6RoutingSegmentsLeft));
    }

    #[test]
    fn jumbogram_and_no_next_header() {
        let mut p = syn_with(&[]);
        p.truncate(HEADER_LEN);
        p[4..6].copy_from_slice(&[0, 0]);
        p[6] = ext::NO_NEXT_HEADER;
        let ip = parse_ip(&p).expect("empty packet with no next header");
        assert_eq!(
            (ip.protocol, ip.l4_offset, ip.len),
            (ext::NO_NEXT_HEADER, 40, 40)
        );
        p[6] = ext::HOP_BY_HOP;
        assert_eq!(parse_ip(&p), Err(Reject::Ipv6Jumbogram));
    }

    #[test]
    fn unknown_upper_layer_ends_walk() {
        let p = ipv6_packet(
            "fd00::1",
            "fd00::2",
            &[ExtHdr::DestOpts { units: 0 }],
            253,
            &[1, 2, 3],
        );
        let ip = parse_ip(&p).expect("valid");
        assert_eq!((ip.protocol, ip.l4_offset), (253, 48));
    }
}
