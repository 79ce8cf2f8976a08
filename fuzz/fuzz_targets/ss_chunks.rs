//! Fuzz target for the Shadowsocks chunk reader
//! (`kerntun_proto::framing::shadowsocks::AeadOpen`, the server-to-client
//! half the relay drives through `Open`): a server stream the input
//! describes, fed in reads the input cuts.
//!
//! Input: a flags byte (bit 0: AEAD-2022 `2022-blake3-aes-128-gcm`, else
//! SIP004 `aes-128-gcm`; bit 1: the rest is the stream itself, raw; bit 2:
//! flip one byte of the stream; bit 3: each read is opened with 2,048
//! bytes of room for a cut frame, as the relay first gives, and its rest
//! again with the room the reader asks for), a read size byte (reads of its square plus
//! one bytes: 1 to 65,026), two bytes naming the byte to flip, then the chunk lengths, two
//! bytes each (each cut to the method's largest chunk, at most 96 KiB in
//! all; a stream is read in 2,048 pieces at most), from which a real server stream is sealed.
//!
//! Invariants: nothing panics; what the reader holds of a cut frame
//! (`Open::held`) never passes the largest frame the method has, nor the
//! room it was given; a read it stops short of leaves it holding nothing
//! and a rest shorter than the frame it asks room for; the
//! plaintext delivered is always a prefix of what the server sealed, and
//! nothing after an error; an intact stream fed whole is delivered whole,
//! ends cleanly, and leaves nothing held (given one chunk at least); raw
//! bytes (which verify only by
//! forging the AEAD tag) deliver nothing.
#![no_main]

use kerntun_proto::framing::Open;
use kerntun_proto::framing::shadowsocks::{
    AEAD_MAX_CHUNK, AEAD2022_MAX_CHUNK, AeadKey, AeadStream, Request, TYPE_SERVER,
};
use libfuzzer_sys::fuzz_target;
use shadowsocks_crypto::CipherKind;
use shadowsocks_crypto::v1::Cipher as V1Cipher;
use shadowsocks_crypto::v2::tcp::TcpCipher;

const NOW: u64 = 1_700_000_000;
const BODY_MAX: usize = 96 * 1024;
/// Reads per run at most: a long stream is read in longer pieces.
const READS_MAX: usize = 2048;

enum Cipher {
    V1(V1Cipher),
    V2(TcpCipher),
}

impl Cipher {
    /// Append `plain` sealed as one AEAD message.
    fn push(&mut self, plain: &[u8], tag: usize, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(plain);
        out.resize(start + plain.len() + tag, 0);
        match self {
            Cipher::V1(c) => c.encrypt_packet(&mut out[start..]),
            Cipher::V2(c) => c.encrypt_packet(&mut out[start..]),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let [flags, read, flip_hi, flip_lo, rest @ ..] = data else {
        return;
    };
    let v2 = flags & 1 != 0;
    let raw = flags & 2 != 0;
    let room = if flags & 8 != 0 { 2048 } else { usize::MAX };
    let flip = (flags & 4 != 0).then(|| usize::from(u16::from_be_bytes([*flip_hi, *flip_lo])));
    let read = usize::from(*read).pow(2) + 1;
    let kind = if v2 {
        CipherKind::AEAD2022_BLAKE3_AES_128_GCM
    } else {
        CipherKind::AES_128_GCM
    };
    let (tag, salt_len) = (kind.tag_len(), kind.salt_len());
    let key_bytes: Vec<u8> = (0..kind.key_len() as u8).collect();
    let key = AeadKey::new(kind, key_bytes.clone().into_boxed_slice());
    let request_salt = vec![1u8; salt_len];
    let req = Request {
        address: &[1, 198, 19, 1, 2, 0, 7],
        salt: &request_salt,
        padding: 1,
    };
    let mut header = Vec::new();
    let Some(mut stream) = AeadStream::client(&key, req, || NOW, &mut header) else {
        panic!("an AEAD method starts a stream");
    };
    let max_chunk = if v2 { AEAD2022_MAX_CHUNK } else { AEAD_MAX_CHUNK };
    // The longest frame: a chunk with its tag, or the first frame (salt and
    // header) if longer.
    let first = if v2 {
        salt_len + 1 + 8 + salt_len + 2 + tag
    } else {
        salt_len + 2 + tag
    };
    let largest = (max_chunk + tag).max(first);

    // The server's stream and the plaintext it carries.
    let mut body = Vec::new();
    let mut wire = Vec::new();
    let mut chunks = 0;
    if raw {
        wire.extend_from_slice(rest);
    } else {
        let server_salt = vec![2u8; salt_len];
        wire.extend_from_slice(&server_salt);
        let mut c = if v2 {
            Cipher::V2(TcpCipher::new(kind, &key_bytes, &server_salt))
        } else {
            Cipher::V1(V1Cipher::new(kind, &key_bytes, &server_salt))
        };
        let lens: Vec<usize> = rest
            .chunks_exact(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])) % (max_chunk + 1))
            .collect();
        for (i, &len) in lens.iter().enumerate() {
            if body.len() + len > BODY_MAX {
                break;
            }
            let chunk: Vec<u8> = (0..len).map(|j| (i + j) as u8).collect();
            let len_bytes = (len as u16).to_be_bytes();
            if v2 && i == 0 {
                // The fixed response header carries the first length.
                let mut fixed = vec![TYPE_SERVER];
                fixed.extend_from_slice(&NOW.to_be_bytes());
                fixed.extend_from_slice(&request_salt);
                fixed.extend_from_slice(&len_bytes);
                c.push(&fixed, tag, &mut wire);
            } else {
                c.push(&len_bytes, tag, &mut wire);
            }
            c.push(&chunk, tag, &mut wire);
            body.extend_from_slice(&chunk);
            chunks += 1;
        }
    }
    let flipped = match flip {
        Some(at) if !wire.is_empty() => {
            let at = at % wire.len();
            wire[at] ^= 0x80;
            true
        }
        _ => false,
    };

    let read = read.max(wire.len().div_ceil(READS_MAX));
    let open: &mut dyn Open = &mut stream.open;
    let mut out = Vec::new();
    let mut failed = false;
    for piece in wire.chunks(read) {
        let mut opened = open.open(piece, &mut out, room);
        if let Ok(n) = opened
            && n < piece.len()
        {
            let wants = open.wants();
            assert_eq!(open.held(), 0, "stopped short, holding a frame");
            assert!(wants > room && piece.len() - n < wants, "stopped at {n} for {wants}");
            opened = open.open(&piece[n..], &mut out, wants);
            if let Ok(m) = opened {
                assert_eq!(m, piece.len() - n, "the rest with the room it asked for");
                assert!(open.held() <= wants, "held {} > {wants}", open.held());
            }
        }
        if opened.is_err() {
            failed = true;
            break;
        }
        assert!(open.held() <= largest, "held {} > {largest}", open.held());
        assert!(body.starts_with(&out), "delivered what was not sealed");
    }
    if raw {
        assert!(out.is_empty(), "unsealed bytes delivered");
    } else if !flipped {
        assert!(!failed, "an intact stream fails");
        assert_eq!(out, body);
        // A server salt alone is a clean (empty) SIP004 stream, and a
        // truncated SIP022 one (no response header).
        if chunks > 0 {
            assert!(open.finish().is_ok(), "an intact stream ends cleanly");
            assert_eq!(open.held(), 0, "nothing held after the last frame");
        }
    }
});
