//! DNS over TCP framing (RFC 1035 section 4.2.2, RFC 7766 section 8): every
//! message behind a two-byte length. Sans-I/O: the caller keeps the bytes
//! it has read of the current frame and asks [`decode`] what comes next.
//! The answer never asks for a byte past the frame, so a caller that reads
//! exactly what it is told holds one frame at a time, at most
//! [`PREFIX`]` + max` bytes, and learns the length a peer announces before
//! it has read (or allocated) any of the message.

/// Length of the length prefix.
pub const PREFIX: usize = 2;

/// What the bytes read so far of one frame call for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// Read this many more bytes (at least one): the rest of the prefix, or
    /// of the message it announced.
    Need(usize),
    /// A whole message of this many bytes, at `buf[PREFIX..PREFIX + len]`.
    Message(usize),
    /// The prefix announces this many bytes, more than the caller takes:
    /// close the connection without reading them.
    TooLong(usize),
}

/// What `buf`, the start of a frame, calls for when messages longer than
/// `max` bytes are refused. Bytes past the first frame are not looked at.
pub fn decode(buf: &[u8], max: usize) -> Frame {
    let Some(&prefix) = buf.first_chunk::<PREFIX>() else {
        return Frame::Need(PREFIX - buf.len());
    };
    let len = usize::from(u16::from_be_bytes(prefix));
    if len > max {
        return Frame::TooLong(len);
    }
    let have = buf.len() - PREFIX;
    if have < len {
        Frame::Need(len - have)
    } else {
        Frame::Message(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two frames as one write sends them.
    fn two_frames() -> Vec<u8> {
        let mut w = vec![0, 3, b'a', b'b', b'c', 0, 1, b'z'];
        w.extend_from_slice(&[0xff, 0xff]);
        w
    }

    #[test]
    fn a_caller_reading_what_it_is_told_gets_each_frame_alone() {
        let wire = two_frames();
        let mut at = 0;
        let mut buf = Vec::new();
        let mut got = Vec::new();
        loop {
            match decode(&buf, 512) {
                Frame::Need(n) => {
                    assert!(n >= 1);
                    assert!(buf.len() + n <= PREFIX + 512);
                    buf.extend_from_slice(&wire[at..at + n]);
                    at += n;
                }
                Frame::Message(len) => {
                    assert_eq!(buf.len(), PREFIX + len, "nothing read past the frame");
                    got.push(buf[PREFIX..].to_vec());
                    buf.clear();
                }
                Frame::TooLong(len) => {
                    assert_eq!(len, 65_535);
                    break;
                }
            }
        }
        assert_eq!(got, vec![b"abc".to_vec(), b"z".to_vec()]);
        assert_eq!(at, wire.len(), "the too-long prefix, and nothing after it");
    }

    #[test]
    fn lengths_at_the_edges() {
        assert_eq!(decode(&[], 10), Frame::Need(2));
        assert_eq!(decode(&[0], 10), Frame::Need(1));
        assert_eq!(decode(&[0, 0], 10), Frame::Message(0));
        assert_eq!(decode(&[0, 10], 10), Frame::Need(10));
        assert_eq!(decode(&[0, 11], 10), Frame::TooLong(11));
        assert_eq!(decode(&[0, 11, 1, 2, 3], 10), Frame::TooLong(11));
        let mut full = vec![0, 10];
        full.extend_from_slice(&[7; 10]);
        assert_eq!(decode(&full, 10), Frame::Message(10));
        full.extend_from_slice(&[0, 99]);
        assert_eq!(
            decode(&full, 10),
            Frame::Message(10),
            "the next frame waits"
        );
        assert_eq!(decode(&[0xff, 0xff], 65_535), Frame::Need(65_535));
        assert_eq!(decode(&[0xff, 0xff], 0), Frame::TooLong(65_535));
    }
}
