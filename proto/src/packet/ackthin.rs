//! Which segments written back to a TUN may wait for the end of a drain.
//!
//! On the system stack every segment of both TCP endpoints is read from the
//! TUN and written back to it, and each write runs the receiving TCP in the
//! writer's context. A cumulative acknowledgement makes the ones before it
//! redundant: of the pure ACKs a drain writes for one flow and direction,
//! the newest says all the earlier ones did. The driver holds the newest
//! aside ([`classify`] names the segments it may hold and their flow) and
//! writes it at the end of the drain, or before any other segment of the
//! same flow and direction, so a flow's segments keep their order.
//!
//! What is never thinned, so that loss recovery sees what it counts on:
//! * an ACK that repeats the held one's acknowledgement number and window
//!   (a duplicate ACK: three of them trigger the sender's fast retransmit,
//!   RFC 5681 3.2), which [`supersedes`] refuses;
//! * an ACK with options other than NOP, EOL and timestamps (a SACK block
//!   reports one hole each; RFC 2018), with ECE or CWR (RFC 3168 signals),
//!   PSH, URG, or any other control bit;
//! * a segment with IPv4 options or IPv6 extension headers.
//!
//! Nothing here allocates, performs I/O or reads a clock.

use super::ipv6;
use super::tcp::{HEADER_LEN as TCP_HEADER_LEN, PlainTcp, field as tcpf, flags};

/// A TCP segment's flow and direction: its source and destination
/// addresses and ports as bytes (IPv4 12, IPv6 36 of [`SegmentKey::MAX`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentKey {
    bytes: [u8; Self::MAX],
    len: u8,
}

impl SegmentKey {
    /// Bytes of the longest key (two IPv6 addresses and two ports).
    pub const MAX: usize = 36;
}

/// A pure ACK [`classify`] lets wait: its sequence and acknowledgement
/// numbers and window field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PureAck {
    pub seq: u32,
    pub ack: u32,
    pub window: u16,
}

/// Largest pure ACK that may be held: an IPv6 header and a TCP header with
/// the most options a header can carry.
pub const ACK_MAX: usize = ipv6::HEADER_LEN + 60;

/// The flow of a TCP segment with no IPv4 options or IPv6 extension
/// headers, and whether it is a pure ACK that may wait (module docs).
/// `None` for anything else (UDP, ICMP, other headers, malformed input):
/// such a packet has no flow here and is written at once.
pub fn classify(pkt: &[u8]) -> Option<(SegmentKey, Option<PureAck>)> {
    classify_plain(pkt, &super::tcp::parse_plain_tcp(pkt)?)
}

/// [`classify`] of `pkt` whose headers `plain` are (parsed by
/// `packet::tcp::parse_plain_tcp`).
#[inline]
pub fn classify_plain(pkt: &[u8], plain: &PlainTcp) -> Option<(SegmentKey, Option<PureAck>)> {
    let PlainTcp { ip, tcp } = *plain;
    let mut key = SegmentKey {
        bytes: [0; SegmentKey::MAX],
        len: 0,
    };
    let mut put = |b: &[u8]| {
        let at = usize::from(key.len);
        key.bytes[at..at + b.len()].copy_from_slice(b);
        key.len += b.len() as u8;
    };
    match (ip.src, ip.dst) {
        (std::net::IpAddr::V4(s), std::net::IpAddr::V4(d)) => {
            put(&s.octets());
            put(&d.octets());
        }
        (std::net::IpAddr::V6(s), std::net::IpAddr::V6(d)) => {
            put(&s.octets());
            put(&d.octets());
        }
        _ => return None,
    }
    put(&tcp.src_port.to_be_bytes());
    put(&tcp.dst_port.to_be_bytes());
    let l4 = &pkt[ip.l4_offset..ip.len];
    let thinnable = tcp.flags == flags::ACK
        && tcp.payload_len == 0
        && ip.len <= ACK_MAX
        && only_timestamps(&l4[TCP_HEADER_LEN..tcp.header_len]);
    let ack = thinnable.then(|| PureAck {
        seq: tcp.seq,
        ack: tcp.ack,
        window: u16::from_be_bytes([l4[tcpf::WINDOW.start], l4[tcpf::WINDOW.start + 1]]),
    });
    Some((key, ack))
}

/// Whether the pure ACK `new`, written after `held` in the same flow and
/// direction, says everything `held` said: it acknowledges more, or the
/// same with another window (a window update). An equal acknowledgement
/// with an equal window is a duplicate ACK and must reach the sender too.
/// A segment behind `held` in sequence (a zero-window probe, which TCP
/// sends at SND.UNA - 1) never does: its receiver does not take a window
/// from a segment older than one it has (RFC 9293, 3.10.7.4, SND.WL1), so
/// `held`'s window would be lost with it.
pub fn supersedes(new: PureAck, held: PureAck) -> bool {
    if (new.seq.wrapping_sub(held.seq) as i32) < 0 {
        return false;
    }
    let advance = new.ack.wrapping_sub(held.ack) as i32;
    advance > 0 || (advance == 0 && new.window != held.window)
}

/// TCP options made only of NOP, EOL and timestamps (kind 8, length 10):
/// none that reports something an earlier ACK's copy would lose.
fn only_timestamps(mut opts: &[u8]) -> bool {
    while let Some(&kind) = opts.first() {
        match kind {
            0 => return true,
            1 => opts = &opts[1..],
            8 if opts.get(1) == Some(&10) && opts.len() >= 10 => opts = &opts[10..],
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::testutil::{ExtHdr, tcp_v4, tcp_v6, udp_v4};

    const C4: &str = "198.18.0.7:40000";
    const S4: &str = "198.18.0.2:443";
    const C6: &str = "[fd00::7]:40000";
    const S6: &str = "[fd00::2]:443";
    const TS: [u8; 12] = [1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2];

    fn ack_of(pkt: &[u8]) -> Option<PureAck> {
        classify(pkt).and_then(|(_, a)| a)
    }

    #[test]
    fn pure_acks_with_timestamps_may_wait() {
        for opts in [&[][..], &TS[..]] {
            let a = ack_of(&tcp_v4(C4, S4, 1, 500, flags::ACK, opts, b"")).expect("pure ACK");
            assert_eq!((a.ack, a.window), (500, 0xffff));
            assert!(ack_of(&tcp_v6(C6, S6, &[], 1, 9, flags::ACK, opts, b"")).is_some());
        }
    }

    #[test]
    fn what_loss_recovery_counts_on_never_waits() {
        // A SACK block (kind 5), data, and every control bit but ACK.
        let sack = [1, 1, 5, 10, 0, 0, 0, 1, 0, 0, 0, 2];
        assert!(ack_of(&tcp_v4(C4, S4, 1, 500, flags::ACK, &sack, b"")).is_none());
        assert!(ack_of(&tcp_v4(C4, S4, 1, 500, flags::ACK, &[], b"x")).is_none());
        for f in [
            flags::PSH,
            flags::ECE,
            flags::CWR,
            flags::URG,
            flags::FIN,
            flags::RST,
            flags::SYN,
        ] {
            let pkt = tcp_v4(C4, S4, 1, 500, flags::ACK | f, &[], b"");
            assert!(ack_of(&pkt).is_none(), "flags {f:#x} wait");
            assert!(classify(&pkt).is_some(), "flags {f:#x} still have a flow");
        }
        // An extension header: no flow at all (written at once).
        let ext = [ExtHdr::DestOpts { units: 1 }];
        assert!(classify(&tcp_v6(C6, S6, &ext, 1, 9, flags::ACK, &[], b"")).is_none());
        assert!(classify(&udp_v4(C4, S4, b"x")).is_none());
        assert!(classify(&[0x45, 0, 0]).is_none());
    }

    #[test]
    fn keys_name_flow_and_direction() {
        let (up, _) = classify(&tcp_v4(C4, S4, 1, 1, flags::ACK, &[], b"d")).expect("tcp");
        let (up2, _) = classify(&tcp_v4(C4, S4, 9, 3, flags::ACK, &[], b"")).expect("tcp");
        let (down, _) = classify(&tcp_v4(S4, C4, 1, 1, flags::ACK, &[], b"")).expect("tcp");
        let (other, _) =
            classify(&tcp_v4("198.18.0.7:40001", S4, 1, 1, flags::ACK, &[], b"")).expect("tcp");
        assert_eq!(up, up2);
        assert_ne!(up, down);
        assert_ne!(up, other);
    }

    #[test]
    fn newer_acks_supersede_duplicates_do_not() {
        let a = |ack, window| PureAck {
            seq: 7,
            ack,
            window,
        };
        assert!(supersedes(a(200, 10), a(100, 10)));
        assert!(supersedes(a(5, 10), a(u32::MAX - 5, 10)), "across the wrap");
        assert!(supersedes(a(100, 20), a(100, 10)), "window update");
        assert!(!supersedes(a(100, 10), a(100, 10)), "duplicate ACK");
        assert!(!supersedes(a(50, 10), a(100, 10)), "older");
    }

    #[test]
    fn a_zero_window_probe_supersedes_nothing() {
        // The held ACK at SND.NXT 1000 opens the window; the probe the same
        // TCP sends later at SND.UNA - 1 carries another window field but
        // would not be taken as a window update, so it must not replace it.
        let held = PureAck {
            seq: 1000,
            ack: 500,
            window: 64,
        };
        let probe = PureAck {
            seq: 999,
            window: 0,
            ..held
        };
        assert!(!supersedes(probe, held));
        let wrapped = PureAck { seq: 3, ..held };
        let behind = PureAck {
            seq: u32::MAX - 3,
            window: 0,
            ..held
        };
        assert!(!supersedes(behind, wrapped), "behind across the wrap");
        assert!(
            supersedes(PureAck { seq: 1000, ..probe }, held),
            "same sequence, new window"
        );
        assert!(
            classify(&tcp_v4(C4, S4, 999, 500, flags::ACK, &[], b""))
                .and_then(|(_, a)| a)
                .is_some_and(|a| !supersedes(a, held)),
            "as classified from the wire"
        );
    }
}
