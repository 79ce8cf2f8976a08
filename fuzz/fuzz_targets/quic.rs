//! Fuzz target for the QUIC Initial sniffer: a UDP flow's datagrams are
//! whatever the app (or malware on the device) chose to send.
//!
//! Input: a mode byte, then datagrams, each behind a two-byte big-endian
//! length (the last one takes what is left). Mode even: the datagrams go
//! to `QuicSniffer::push` as they are. Mode odd: each is the plaintext
//! payload of an Initial that opened (`push_plaintext`), so the frame walk
//! and the CRYPTO reassembly are reached without the fuzzer having to
//! forge AES-GCM tags.
//!
//! Invariants: nothing panics; a returned name passes the name checks; an
//! answer other than `NeedMore` is final (every later datagram gives the
//! same answer); no answer is still pending after `MAX_DATAGRAMS`
//! datagrams.
#![no_main]

use kerntun::sniff::quic::{MAX_DATAGRAMS, QuicSniffer};
use kerntun::sniff::{Sniffed, Sniffer};
use libfuzzer_sys::fuzz_target;

fn datagrams(mut data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while !data.is_empty() && out.len() < 2 * MAX_DATAGRAMS {
        let (d, rest) = match data {
            [a, b, rest @ ..] => {
                let n = usize::from(u16::from_be_bytes([*a, *b])).min(rest.len());
                rest.split_at(n)
            }
            _ => (data, &[][..]),
        };
        out.push(d);
        data = rest;
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, data)) = data.split_first() else {
        return;
    };
    let mut s = QuicSniffer::new();
    let mut decided: Option<String> = None;
    for (i, d) in datagrams(data).into_iter().enumerate() {
        let r = if mode % 2 == 0 {
            s.push(d)
        } else {
            s.push_plaintext(d)
        };
        if let Sniffed::Domain { proto, name } = r {
            assert_eq!(proto, Sniffer::Quic);
            assert!(!name.is_empty() && name.len() <= 254, "{name:?}");
            assert!(
                name.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c)),
                "{name:?}"
            );
        }
        let shown = format!("{r:?}");
        match &decided {
            Some(a) => assert_eq!(&shown, a, "final answer changed at datagram {i}"),
            None if r != Sniffed::NeedMore => decided = Some(shown),
            None => {}
        }
        if i + 1 >= MAX_DATAGRAMS {
            assert_ne!(r, Sniffed::NeedMore, "pending after {} datagrams", i + 1);
        }
    }
});
