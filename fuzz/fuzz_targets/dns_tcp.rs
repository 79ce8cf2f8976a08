//! Fuzz target for DNS-over-TCP framing (`kerntun_proto::dnswire::frame`):
//! the bytes a client sends on a hijacked TCP connection, driven the way
//! `Dns::serve_tcp` drives them (read what `decode` asks for, never more),
//! with reads cut short to at most the input's first byte's worth of bytes
//! so every partial buffer is decoded too. Each message goes through the
//! header check (`msg::parse_query`).
//!
//! Invariants: nothing panics; `Need` asks for at least one byte and never
//! for more than the frame has left, so the buffer never passes
//! `PREFIX + MAX_QUERY`; a `Message` is the whole buffer and as long as its
//! prefix says; `TooLong` is decided on the prefix alone; the frames read
//! are those a plain split of the same bytes by their prefixes gives, up to
//! the first one announced past the cap; a query `parse_query` takes is
//! within the cap with one question and no other records.
#![no_main]

use kerntun_proto::dnswire::frame::{Frame, PREFIX, decode};
use kerntun_proto::dnswire::msg::{Incoming, MAX_QUERY, parse_query};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&read_max, wire)) = data.split_first() else {
        return;
    };
    let read_max = usize::from(read_max).max(1);
    let mut at = 0;
    let mut buf = Vec::new();
    let mut frames = Vec::new();
    let mut closed = false;
    loop {
        match decode(&buf, MAX_QUERY) {
            Frame::Need(n) => {
                assert!(n >= 1, "asks for nothing");
                assert!(buf.len() + n <= PREFIX + MAX_QUERY, "past the cap");
                if at == wire.len() {
                    break;
                }
                let take = n.min(read_max).min(wire.len() - at);
                buf.extend_from_slice(&wire[at..at + take]);
                at += take;
            }
            Frame::Message(len) => {
                assert_eq!(buf.len(), PREFIX + len, "read past the frame");
                assert_eq!(usize::from(u16::from_be_bytes([buf[0], buf[1]])), len);
                assert!(len <= MAX_QUERY);
                if let Some(Incoming::Query(q)) = parse_query(&buf[PREFIX..]) {
                    assert_eq!(q.queries.len(), 1);
                    assert!(q.answers.is_empty() && q.authorities.is_empty());
                    assert!(q.additionals.is_empty());
                }
                frames.push(std::mem::take(&mut buf));
            }
            Frame::TooLong(len) => {
                assert_eq!(buf.len(), PREFIX, "decided on the prefix alone");
                assert!(len > MAX_QUERY);
                closed = true;
                break;
            }
        }
    }
    // The same bytes split by their prefixes.
    let mut r = 0;
    let mut expect = Vec::new();
    while wire.len() - r >= PREFIX {
        let len = usize::from(u16::from_be_bytes([wire[r], wire[r + 1]]));
        if len > MAX_QUERY {
            assert!(closed, "a frame past the cap closes the connection");
            break;
        }
        if wire.len() - r - PREFIX < len {
            break;
        }
        expect.push(wire[r..r + PREFIX + len].to_vec());
        r += PREFIX + len;
    }
    assert_eq!(frames, expect);
});
