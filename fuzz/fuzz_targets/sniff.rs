//! Fuzz target for the SNI / Host sniffer: the first bytes of a connection
//! are whatever the app (or malware on the device) chose to send.
//!
//! Invariants: nothing panics; a returned name is a slice of the input that
//! passes the name checks (ASCII, at most 253 bytes plus a trailing dot, no
//! ':'); an answer other than `NeedMore` is final, i.e. the whole input
//! gives the same answer as any prefix that already gave one.
#![no_main]

use kerntun::sniff::{MAX_SNIFF, Sniffed, sniff};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let full = sniff(data);
    if let Sniffed::Domain { name, .. } = full {
        let range = data.as_ptr_range();
        assert!(range.contains(&name.as_ptr()), "name not borrowed from the input");
        assert!(name.len() <= 254, "{name:?}");
        assert!(
            name.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c)),
            "{name:?}"
        );
    }
    if data.len() >= MAX_SNIFF {
        assert_ne!(full, Sniffed::NeedMore, "waits past the cap");
    }
    // A few prefixes, one of them chosen by the input itself.
    let pick = data.first().map_or(0, |&b| usize::from(b) * data.len() / 256);
    for cut in [pick, data.len() / 2, data.len().saturating_sub(1)] {
        let part = sniff(&data[..cut.min(data.len())]);
        if part != Sniffed::NeedMore {
            assert_eq!(part, full, "answer at {cut} bytes changed with more");
        }
    }
});
