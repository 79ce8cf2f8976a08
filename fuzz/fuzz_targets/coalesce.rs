//! Fuzz target for write-back merging (`packet::coalesce`).
//!
//! The first two bytes (big-endian, modulo what follows) are the length of
//! the head packet; the rest of the input is the next packet. Invariants: nothing panics; a refused merge leaves the head
//! as it was; a merge gives a plain TCP segment whose length is the head's
//! plus the next payload, whose headers are what `append_untranslated`
//! tracked, and whose checksum verifies when the head's did (the unchecked
//! merge verifies the next segment); merging "as read" with a head whose
//! headers as read are its own gives exactly what the plain merge gives,
//! checked and unchecked; a merged packet cut back at the head's payload
//! length gives the head back.
#![no_main]

use kerntun::packet::checksum::verify_transport_checksum;
use kerntun::packet::coalesce::{
    MAX_PACKET, append, append_untranslated, append_verified, segment_at,
};
use kerntun::packet::parse_ip;
use kerntun::packet::tcp::parse_plain_tcp;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((split, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let at = usize::from(u16::from_be_bytes(*split)) % (rest.len() + 1);
    let (head, next) = rest.split_at(at);
    for checked in [true, false] {
        let mut a = vec![0u8; MAX_PACKET];
        a[..head.len()].copy_from_slice(head);
        let merged = if checked {
            append(&mut a, head.len(), next)
        } else {
            append_verified(&mut a, head.len(), next)
        };

        // As read, with the head's own headers as the ones read.
        let mut b = vec![0u8; MAX_PACKET];
        b[..head.len()].copy_from_slice(head);
        let (Some(mut h), Some(n)) = (
            parse_plain_tcp(head).filter(|h| h.ip.len == head.len()),
            parse_plain_tcp(next),
        ) else {
            assert_eq!(merged, None, "a merge needs two plain TCP segments");
            assert_eq!(&a[..head.len()], head);
            continue;
        };
        let raw = &head[..h.ip.l4_offset + h.tcp.header_len];
        let as_read = append_untranslated(&mut b, &mut h, raw, next, &n, !checked);
        assert_eq!(as_read, merged.is_some(), "checked {checked}");
        let Some(len) = merged else {
            assert_eq!(&a[..head.len()], head, "refused: untouched");
            assert_eq!(&b[..head.len()], head, "refused as read: untouched");
            continue;
        };
        assert_eq!(a[..len], b[..len], "the same merge either way");
        assert_eq!(h.ip.len, len);
        assert_eq!(parse_plain_tcp(&a[..len]), Some(h), "tracked headers");
        let head_ok = parse_ip(head).is_ok_and(|ip| verify_transport_checksum(head, &ip));
        let ip = parse_ip(&a[..len]).expect("merged parses");
        if checked && head_ok {
            assert!(verify_transport_checksum(&a[..len], &ip), "merge verifies");
        }
        // Cut back at the head's payload length: the head comes back, but
        // for its checksums, which the cut computes afresh (and which then
        // verify).
        let first = parse_plain_tcp(head).expect("head").tcp.payload_len;
        let mut out = vec![0u8; MAX_PACKET];
        let seg = segment_at(&a[..len], first, 0, &mut out).expect("first segment");
        assert_eq!(seg, head.len());
        let cut = &mut out[..seg];
        let cut_ip = parse_ip(cut).expect("cut parses");
        assert!(verify_transport_checksum(cut, &cut_ip));
        let mut want = head.to_vec();
        let l4 = cut_ip.l4_offset;
        for at in [l4 + 16, l4 + 17].into_iter().chain(if cut_ip.src.is_ipv4() { 10..12 } else { 0..0 }) {
            want[at] = 0;
            cut[at] = 0;
        }
        assert_eq!(cut, &want[..], "the head cut back");
    }
});
