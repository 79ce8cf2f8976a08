use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use proptest::prelude::*;

use super::*;
use crate::sniff::tests::{client_hello_message, find, first_flight, rustls_client, sni_ext};

fn unhex(s: &str) -> Vec<u8> {
    let s: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
    s.chunks(2)
        .map(|c| u8::from_str_radix(std::str::from_utf8(c).expect("ascii"), 16).expect("hex"))
        .collect()
}

/// RFC 9001 appendix A.2: the client's Initial (1200 bytes, protected).
fn rfc9001_initial() -> Vec<u8> {
    unhex(include_str!("testdata/rfc9001-a2-client-initial.hex"))
}

/// RFC 9369 appendix A.2: the same hello in a QUIC v2 Initial.
fn rfc9369_initial() -> Vec<u8> {
    unhex(include_str!("testdata/rfc9369-a2-client-initial.hex"))
}

/// The CRYPTO frame both appendices carry (ClientHello for example.com).
fn rfc_crypto_frame() -> Vec<u8> {
    unhex(include_str!("testdata/rfc9001-a2-crypto-frame.hex"))
}

/// The Destination Connection ID of both appendices.
const RFC_DCID: [u8; 8] = [0x83, 0x94, 0xc8, 0xf0, 0x3e, 0x51, 0x57, 0x08];

fn quic(name: &str) -> Sniffed<'_> {
    Sniffed::Domain {
        proto: Sniffer::Quic,
        name,
    }
}

/// Push every datagram; the answers, as owned strings for comparing.
fn answers(dgrams: &[Vec<u8>]) -> Vec<String> {
    let mut s = QuicSniffer::new();
    dgrams.iter().map(|d| show(s.push(d))).collect()
}

fn show(r: Sniffed<'_>) -> String {
    match r {
        Sniffed::Domain { proto, name } => format!("{proto:?}:{name}"),
        r => format!("{r:?}"),
    }
}

fn varint_bytes(v: u64) -> Vec<u8> {
    match v {
        0..=63 => vec![v as u8],
        64..=16383 => (0x4000 | v as u16).to_be_bytes().to_vec(),
        16384..=0x3fff_ffff => (0x8000_0000 | v as u32).to_be_bytes().to_vec(),
        _ => (0xc000_0000_0000_0000 | v).to_be_bytes().to_vec(),
    }
}

fn crypto_frame(offset: usize, data: &[u8]) -> Vec<u8> {
    let mut f = vec![CRYPTO];
    f.extend(varint_bytes(offset as u64));
    f.extend(varint_bytes(data.len() as u64));
    f.extend_from_slice(data);
    f
}

/// A protected long-header packet, as a client makes it (RFC 9001
/// section 5): `kind` Initial (with an empty token), 0-RTT or Handshake,
/// keys from `dcid`, `frames` padded with PADDING to `pad_to` bytes of
/// payload.
struct Seal {
    version: Version,
    kind: Kind,
    dcid: Vec<u8>,
    scid: Vec<u8>,
    pn: u64,
    pn_len: usize,
}

impl Seal {
    fn initial(version: Version, dcid: &[u8], pn: u64) -> Seal {
        Seal {
            version,
            kind: Kind::Initial,
            dcid: dcid.to_vec(),
            scid: vec![0x5c; 8],
            pn,
            pn_len: 2,
        }
    }

    fn packet(&self, frames: &[u8], pad_to: usize) -> Vec<u8> {
        let bits = match (self.version, self.kind) {
            (Version::V1, Kind::Initial) => 0,
            (Version::V1, Kind::ZeroRtt) => 1,
            (Version::V1, Kind::Handshake) => 2,
            (Version::V1, Kind::Retry) => 3,
            (Version::V2, Kind::Initial) => 1,
            (Version::V2, Kind::ZeroRtt) => 2,
            (Version::V2, Kind::Handshake) => 3,
            (Version::V2, Kind::Retry) => 0,
        };
        let wire = match self.version {
            Version::V1 => VERSION_1,
            Version::V2 => VERSION_2,
        };
        let mut payload = frames.to_vec();
        payload.resize(payload.len().max(pad_to).max(20), PADDING);
        let mut h = vec![0xc0 | bits << 4 | (self.pn_len as u8 - 1)];
        h.extend_from_slice(&wire.to_be_bytes());
        h.push(self.dcid.len() as u8);
        h.extend_from_slice(&self.dcid);
        h.push(self.scid.len() as u8);
        h.extend_from_slice(&self.scid);
        if self.kind == Kind::Initial {
            h.push(0); // token length
        }
        let length = (self.pn_len + payload.len() + TAG) as u16;
        h.extend_from_slice(&(0x4000 | length).to_be_bytes());
        let pn_offset = h.len();
        h.extend_from_slice(&self.pn.to_be_bytes()[8 - self.pn_len..]);
        let (key, iv, hp) = initial_secrets(self.version, &self.dcid).expect("secrets");
        let aead = Aes128Gcm::new_from_slice(&key).expect("key");
        let mut nonce = iv;
        for (n, p) in nonce[4..].iter_mut().zip(self.pn.to_be_bytes()) {
            *n ^= p;
        }
        let tag = aead
            .encrypt_inout_detached(&nonce.into(), &h, payload.as_mut_slice().into())
            .expect("seal");
        let mut pkt = h;
        pkt.extend_from_slice(&payload);
        pkt.extend_from_slice(&tag);
        let hp = aes::Aes128::new_from_slice(&hp).expect("hp");
        let mut mask =
            aes::Block::try_from(&pkt[pn_offset + 4..pn_offset + 4 + SAMPLE]).expect("sample");
        hp.encrypt_block(&mut mask);
        pkt[0] ^= mask[0] & 0x0f;
        for i in 0..self.pn_len {
            pkt[pn_offset + i] ^= mask[1 + i];
        }
        pkt
    }
}

/// A rustls client's ClientHello as a bare handshake message (what QUIC
/// carries in CRYPTO frames).
fn hello_message(server: &str, alpn: usize) -> Vec<u8> {
    let mut cfg = rustls_client(&[&rustls::version::TLS13]);
    cfg.alpn_protocols = (0..alpn)
        .map(|i| format!("proto-{i:04}").into_bytes())
        .collect();
    let mut out = first_flight(cfg, server);
    let len = usize::from(u16::from_be_bytes([out[3], out[4]]));
    assert_eq!(out.len(), 5 + len, "one record");
    out.split_off(5)
}

/// A ClientHello handshake message whose `server_name` comes after a
/// padding extension of `padding` bytes.
fn hand_hello(padding: usize, name: &str) -> Vec<u8> {
    client_hello_message(&[
        (21, vec![0; padding]), // padding
        sni_ext(&[(0, name.as_bytes())]),
    ])
}

/// The first datagrams of a real QUIC client (quinn) connecting to
/// `server` (`alpn` extra protocols make its hello longer).
fn quinn_initials(server: &str, alpn: usize) -> Vec<Vec<u8>> {
    let mut crypto = rustls_client(&[&rustls::version::TLS13]);
    crypto.alpn_protocols = (0..alpn)
        .map(|i| format!("a-rather-long-protocol-name-{i:04}").into_bytes())
        .collect();
    let crypto = quinn_proto::crypto::rustls::QuicClientConfig::try_from(crypto).expect("quic tls");
    let cfg = quinn_proto::ClientConfig::new(Arc::new(crypto));
    let mut ep = quinn_proto::Endpoint::new(
        Arc::new(quinn_proto::EndpointConfig::default()),
        None,
        false,
        None,
    );
    let now = Instant::now();
    let remote: SocketAddr = "192.0.2.1:443".parse().expect("addr");
    let (_, mut conn) = ep.connect(now, cfg, remote, server).expect("connect");
    let mut out = Vec::new();
    let mut buf = Vec::new();
    while let Some(t) = conn.poll_transmit(now, 1, &mut buf) {
        let seg = t.segment_size.unwrap_or(t.size);
        out.extend(buf[..t.size].chunks(seg).map(<[u8]>::to_vec));
        buf.clear();
        if out.len() > 10 {
            break;
        }
    }
    assert!(!out.is_empty(), "quinn sent nothing");
    out
}

#[test]
fn rfc_keys() {
    let (key, iv, hp) = initial_secrets(Version::V1, &RFC_DCID).expect("v1");
    assert_eq!(key.to_vec(), unhex("1f369613dd76d5467730efcbe3b1a22d"));
    assert_eq!(iv.to_vec(), unhex("fa044b2f42a3fd3b46fb255c"));
    assert_eq!(hp.to_vec(), unhex("9f50449e04a0e810283a1e9933adedd2"));
    let (key, iv, hp) = initial_secrets(Version::V2, &RFC_DCID).expect("v2");
    assert_eq!(key.to_vec(), unhex("8b1a0bc121284290a29e0971b5cd045d"));
    assert_eq!(iv.to_vec(), unhex("91f73e2351d8fa91660e909f"));
    assert_eq!(hp.to_vec(), unhex("45b95e15235d6f45a6b19cbcb0294ba9"));
    // RFC 9001 A.2's header protection mask for its sample.
    let keys = Keys::derive(Version::V1, &RFC_DCID).expect("keys");
    let mask = keys
        .mask(&unhex("d1b1c98dd7689fb8ec11d242b123dc9b"))
        .expect("mask");
    assert_eq!(mask[..5].to_vec(), unhex("437b9aec36"));
}

#[test]
fn rfc_initials_v1_and_v2() {
    for (v, pkt) in [
        (Version::V1, rfc9001_initial()),
        (Version::V2, rfc9369_initial()),
    ] {
        assert_eq!(QuicSniffer::new().push(&pkt), quic("example.com"), "{v:?}");
        // The test sealer makes the appendix's packet byte for byte, so
        // the packets it makes below are what a client would send.
        let mut crypto = rfc_crypto_frame();
        crypto.resize(1162, PADDING);
        let s = Seal {
            version: v,
            kind: Kind::Initial,
            dcid: RFC_DCID.to_vec(),
            scid: Vec::new(),
            pn: 2,
            pn_len: 4,
        };
        assert_eq!(s.packet(&crypto, 0), pkt, "{v:?}");
    }
}

#[test]
fn quinn_client_initial() {
    let d = quinn_initials("video.example.com", 1);
    let mut s = QuicSniffer::new();
    assert_eq!(s.push(&d[0]), quic("video.example.com"));
    // Final: retransmissions or anything else change nothing.
    assert_eq!(s.push(b"junk"), quic("video.example.com"));
    assert_eq!(s.push(&rfc9001_initial()), quic("video.example.com"));
    // quinn's name checks: an address names no domain (no SNI is sent).
    let d = quinn_initials("192.0.2.7", 1);
    assert_eq!(QuicSniffer::new().push(&d[0]), Sniffed::NoDomain);
}

#[test]
fn quinn_hello_across_two_initials() {
    // 60 protocols of 32 bytes: a ~2.3 KB hello in two Initials. rustls
    // shuffles its extensions, so the name lands in the first or the
    // second; over 40 connections both happen (each about half the time).
    let want = "Quic:two.example.net";
    let mut needed_second = 0;
    for _ in 0..40 {
        let d = quinn_initials("two.example.net", 60);
        assert!(d.len() >= 2, "{} datagrams", d.len());
        let got = answers(&d);
        let done = got.iter().position(|a| a == want).expect("answered");
        assert!(got[..done].iter().all(|a| a == "NeedMore"), "{got:?}");
        assert!(got[done..].iter().all(|a| a == want), "{got:?}");
        if done > 0 {
            needed_second += 1;
        }
        // Reordered: the hello's tail first, which is no start of a hello.
        let rev: Vec<Vec<u8>> = d.iter().rev().cloned().collect();
        let got = answers(&rev);
        assert_eq!(got[0], "NeedMore");
        assert_eq!(got.last().map(String::as_str), Some(want), "{got:?}");
    }
    assert!(
        needed_second > 0,
        "the name was always in the first Initial"
    );
}

#[test]
fn hello_in_fragments_across_v2_packets() {
    // The name late in a 1.4 KB hello, past what packet 1 holds.
    let hs = hand_hello(1300, "frag.example.org");
    let at = find(&hs, b"frag.example.org");
    let dcid = [0xab; 8];
    // Packet 1: the middle third and the head in small pieces out of
    // order, with PING and PADDING among them (as some clients scramble
    // their first flight); packet 2: the last third, with the name.
    let third = hs.len() / 3;
    assert!(at > 2 * third);
    let mut f = Vec::new();
    f.extend(crypto_frame(third, &hs[third..2 * third]));
    f.push(PING);
    for start in (0..third).step_by(100).rev() {
        let end = (start + 100).min(third);
        f.extend(crypto_frame(start, &hs[start..end]));
        f.extend([PADDING, PADDING]);
    }
    let p1 = Seal::initial(Version::V2, &dcid, 0).packet(&f, 1150);
    let p2 = Seal::initial(Version::V2, &dcid, 1)
        .packet(&crypto_frame(2 * third, &hs[2 * third..]), 1150);
    assert_eq!(
        answers(&[p1.clone(), p2.clone()]),
        ["NeedMore", "Quic:frag.example.org"]
    );
    assert_eq!(answers(&[p2, p1]), ["NeedMore", "Quic:frag.example.org"]);
}

#[test]
fn coalesced_zero_rtt_handshake_and_retry() {
    let hs = hand_hello(1000, "co.example.com");
    let half = find(&hs, b"co.example.com");
    let dcid = [7; 10];
    let i1 = Seal::initial(Version::V1, &dcid, 0).packet(&crypto_frame(0, &hs[..half]), 0);
    let i2 = Seal::initial(Version::V1, &dcid, 1).packet(&crypto_frame(half, &hs[half..]), 0);
    let other = |kind| Seal {
        kind,
        ..Seal::initial(Version::V1, &dcid, 5)
    };
    let zero_rtt = other(Kind::ZeroRtt).packet(&[0x08, 0, 0], 100);
    let handshake = other(Kind::Handshake).packet(&[CRYPTO, 0, 1, 0x14], 50);
    // Initial + 0-RTT in one datagram, then Handshake + Initial.
    let d1 = [i1.clone(), zero_rtt.clone()].concat();
    let d2 = [handshake.clone(), i2.clone()].concat();
    assert_eq!(answers(&[d1, d2]), ["NeedMore", "Quic:co.example.com"]);
    // A datagram of 0-RTT only, between the Initials.
    assert_eq!(
        answers(&[i1.clone(), zero_rtt.clone(), i2.clone()]),
        ["NeedMore", "NeedMore", "Quic:co.example.com"]
    );
    // A first datagram that does not start with an Initial is no QUIC
    // connection's start.
    assert_eq!(answers(&[zero_rtt.clone(), i1.clone()]), ["NoDomain"; 2]);
    assert_eq!(answers(std::slice::from_ref(&handshake)), ["NoDomain"]);
    let mut retry = vec![0xf0];
    retry.extend_from_slice(&VERSION_1.to_be_bytes());
    retry.extend_from_slice(&[0, 8, 1, 2, 3, 4, 5, 6, 7, 8, 0xaa, 0xbb]);
    retry.extend_from_slice(&[0; 16]);
    assert_eq!(answers(&[retry.clone()]), ["NoDomain"]);
    // Nothing after a Retry in a datagram is read.
    assert_eq!(
        answers(&[i1.clone(), [retry, i2.clone()].concat()]),
        ["NeedMore", "NeedMore"]
    );
}

#[test]
fn new_keys_after_a_retry() {
    // The client's second Initial goes to the server's new connection
    // ID with keys from it: both open.
    let hs = hello_message("retry.example.com", 0);
    let first = Seal::initial(Version::V1, &[1; 8], 0).packet(&crypto_frame(0, &hs[..50]), 1150);
    let again = Seal::initial(Version::V1, &[2; 12], 1).packet(&crypto_frame(0, &hs), 1150);
    assert_eq!(
        answers(&[first, again]),
        ["NeedMore", "Quic:retry.example.com"]
    );
}

#[test]
fn damaged_and_foreign_datagrams() {
    let good = rfc9001_initial();
    // A flipped byte in the payload: the packet does not open and is
    // dropped; its retransmission opens.
    let mut bad = good.clone();
    bad[600] ^= 1;
    assert_eq!(answers(&[bad.clone()]), ["NeedMore"]);
    assert_eq!(
        answers(&[bad, good.clone()]),
        ["NeedMore", "Quic:example.com"]
    );
    // A flipped tag byte, or a protected header byte.
    for at in [good.len() - 1, 18, 0] {
        let mut bad = good.clone();
        bad[at] ^= 0x01;
        assert_eq!(answers(&[bad]), ["NeedMore"], "byte {at}");
    }
    // Another version, a short header, a connection ID past 20 bytes,
    // DNS, nothing: not the start of a QUIC v1/v2 connection.
    let mut draft = good.clone();
    draft[1..5].copy_from_slice(&0xff00_001du32.to_be_bytes());
    let mut long_cid = good.clone();
    long_cid[5] = 21;
    let dns = unhex("123401000001000000000000076578616d706c6503636f6d0000010001");
    for d in [draft, long_cid, vec![0x40; 1200], dns, Vec::new()] {
        assert_eq!(
            answers(std::slice::from_ref(&d)),
            ["NoDomain"],
            "{:02x?}",
            &d[..d.len().min(8)]
        );
    }
    // Every truncation: the Length field overruns the datagram.
    for cut in 0..good.len() {
        assert_eq!(answers(&[good[..cut].to_vec()]), ["NoDomain"], "cut {cut}");
        // After a good start, a damaged datagram is skipped.
        let start = Seal::initial(Version::V1, &RFC_DCID, 0).packet(&crypto_frame(0, &[1]), 1150);
        assert_eq!(
            answers(&[start, good[..cut].to_vec()]),
            ["NeedMore"; 2],
            "cut {cut}"
        );
    }
}

#[test]
fn frames_an_initial_may_not_hold() {
    let hs = hello_message("f.example.com", 0);
    let dcid = [3; 8];
    let seal = |frames: &[u8]| Seal::initial(Version::V1, &dcid, 0).packet(frames, 1150);
    // ACK and ACK_ECN (two ranges) before the hello: fine.
    let mut f = vec![ACK, 5, 0, 2, 0, 1, 1, 1, 1];
    f.extend([ACK_ECN, 5, 0, 0, 0, 1, 2, 3]);
    f.extend(crypto_frame(0, &hs));
    assert_eq!(answers(&[seal(&f)]), ["Quic:f.example.com"]);
    // A STREAM frame, a two-byte frame type, an ACK whose range count
    // overruns, a CRYPTO frame longer than the packet.
    for f in [
        vec![0x08, 0, 1, 0x61],
        vec![0x40, 0x06, 0, 1, 1],
        vec![ACK, 5, 0, 0x7f, 0xff, 0],
        vec![CRYPTO, 0, 0x7f, 0xff],
    ] {
        assert_eq!(answers(&[seal(&f)]), ["NoDomain"], "{f:02x?}");
    }
    // CONNECTION_CLOSE: a hello already whole still counts; a part does not.
    let mut f = crypto_frame(0, &hs);
    f.extend([CONNECTION_CLOSE, 0x0a, 0, 0]);
    assert_eq!(answers(&[seal(&f)]), ["Quic:f.example.com"]);
    let mut f = crypto_frame(0, &hs[..40]);
    f.extend([CONNECTION_CLOSE, 0x0a, 0, 0]);
    assert_eq!(answers(&[seal(&f)]), ["NoDomain"]);
    // Not a ClientHello (a ServerHello's type byte).
    let mut sh = hs.clone();
    sh[0] = 2;
    assert_eq!(answers(&[seal(&crypto_frame(0, &sh))]), ["NoDomain"]);
}

#[test]
fn bounded() {
    let hs = hand_hello(1000, "b.example.com");
    let dcid = [9; 8];
    // Only the hello's tail, again and again: no answer after four
    // Initials.
    let tail: Vec<Vec<u8>> = (0..5)
        .map(|pn| Seal::initial(Version::V1, &dcid, pn).packet(&crypto_frame(100, &hs[100..]), 0))
        .collect();
    assert_eq!(
        answers(&tail),
        ["NeedMore", "NeedMore", "NeedMore", "NoDomain", "NoDomain"]
    );
    // Four Initials coalesced in one datagram count as four.
    assert_eq!(answers(&[tail[..4].concat()]), ["NoDomain"]);
    // Datagrams without Initials count too.
    let zero_rtt = Seal {
        kind: Kind::ZeroRtt,
        ..Seal::initial(Version::V1, &dcid, 9)
    }
    .packet(&[1], 0);
    let mut d = vec![tail[0].clone()];
    d.extend(std::iter::repeat_n(zero_rtt, MAX_DATAGRAMS));
    let got = answers(&d);
    assert_eq!(got[MAX_DATAGRAMS - 2], "NeedMore");
    assert_eq!(got[MAX_DATAGRAMS - 1], "NoDomain");
    // A hello whose name lies past 16 KiB of CRYPTO stream: an answer once
    // the stream reaches the cap, even though the hello goes on.
    let big = hand_hello(20_000, "late.example.com");
    let halves: Vec<Vec<u8>> = [0, 8192]
        .iter()
        .enumerate()
        .map(|(pn, &at)| {
            Seal::initial(Version::V1, &dcid, pn as u64)
                .packet(&crypto_frame(at, &big[at..at + 8192 + 100]), 0)
        })
        .collect();
    assert_eq!(answers(&halves), ["NeedMore", "NoDomain"]);
    // A packet over MAX_PACKET is not opened.
    let huge = Seal::initial(Version::V1, &dcid, 0).packet(&crypto_frame(0, &hs), MAX_PACKET);
    assert_eq!(answers(&[huge]), ["NeedMore"]);
    // More gaps than MAX_RANGES: refused, not tracked.
    let mut f = Vec::new();
    for i in 0..=MAX_RANGES {
        f.extend(crypto_frame(10 + 2 * i, &[0]));
    }
    let p = Seal::initial(Version::V1, &dcid, 0).packet(&f, 1150);
    assert_eq!(answers(&[p]), ["NoDomain"]);
}

#[test]
fn plaintext_frames_for_the_fuzz_target() {
    let mut s = QuicSniffer::new();
    assert_eq!(s.push_plaintext(&rfc_crypto_frame()), quic("example.com"));
    let hs = hand_hello(100, "p.example.com");
    let mut s = QuicSniffer::new();
    assert_eq!(
        s.push_plaintext(&crypto_frame(60, &hs[60..])),
        Sniffed::NeedMore
    );
    assert_eq!(
        s.push_plaintext(&crypto_frame(0, &hs[..60])),
        quic("p.example.com")
    );
    assert_eq!(
        QuicSniffer::new().push_plaintext(&[0x08]),
        Sniffed::NoDomain
    );
}

/// The fuzz target's seed corpus (`fuzz/corpus/quic/`, in its input
/// format: a mode byte, then datagrams behind two-byte lengths) answers
/// what it was made to; `KERNTUN_QUIC_CORPUS=DIR` writes it anew.
#[test]
fn fuzz_seeds() {
    let seed = |mode: u8, ds: &[Vec<u8>]| {
        let mut out = vec![mode];
        for d in ds {
            out.extend_from_slice(&(d.len() as u16).to_be_bytes());
            out.extend_from_slice(d);
        }
        out
    };
    let hs = hand_hello(1000, "seed.example.com");
    let half = find(&hs, b"seed.example.com");
    let dcid = [0x42; 8];
    let i1 = Seal::initial(Version::V1, &dcid, 0).packet(&crypto_frame(0, &hs[..half]), 0);
    let i2 = Seal::initial(Version::V1, &dcid, 1).packet(&crypto_frame(half, &hs[half..]), 0);
    let seeds = [
        ("rfc9001_initial", seed(0, &[rfc9001_initial()])),
        ("rfc9369_initial", seed(0, &[rfc9369_initial()])),
        (
            "quinn_initials",
            seed(0, &quinn_initials("q.example.com", 60)),
        ),
        ("two_initials", seed(0, &[i1, i2])),
        (
            "plaintext_two",
            seed(
                1,
                &[
                    crypto_frame(half, &hs[half..]),
                    [vec![ACK, 5, 0, 0, 0, PING], crypto_frame(0, &hs[..half])].concat(),
                ],
            ),
        ),
        ("plaintext_rfc", seed(1, &[rfc_crypto_frame()])),
    ];
    if let Some(dir) = std::env::var_os("KERNTUN_QUIC_CORPUS") {
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).expect("dir");
        for (name, bytes) in &seeds {
            std::fs::write(dir.join(name), bytes).expect("write");
        }
    }
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/quic");
    for (name, want) in [
        ("rfc9001_initial", "example.com"),
        ("rfc9369_initial", "example.com"),
        ("quinn_initials", "q.example.com"),
        ("two_initials", "seed.example.com"),
        ("plaintext_two", "seed.example.com"),
        ("plaintext_rfc", "example.com"),
    ] {
        let bytes = std::fs::read(corpus.join(name)).expect("seed file");
        let (&mode, mut rest) = bytes.split_first().expect("mode");
        let mut s = QuicSniffer::new();
        let mut last = String::new();
        while let [a, b, tail @ ..] = rest {
            let (d, more) = tail.split_at(usize::from(u16::from_be_bytes([*a, *b])));
            last = show(if mode % 2 == 0 {
                s.push(d)
            } else {
                s.push_plaintext(d)
            });
            rest = more;
        }
        assert_eq!(last, format!("Quic:{want}"), "{name}");
    }
}

#[test]
fn reassembly_ranges_merge() {
    let mut s = QuicSniffer::new();
    for (a, b) in [
        (10, 20),
        (30, 40),
        (0, 5),
        (20, 30),
        (5, 10),
        (50, 60),
        (45, 55),
    ] {
        assert!(s.add_range(a, b));
    }
    assert_eq!(&s.ranges[..s.n_ranges], &[(0, 40), (45, 60)]);
    assert!(s.add_range(38, 46));
    assert_eq!(&s.ranges[..s.n_ranges], &[(0, 60)]);
}

#[test]
fn packet_numbers() {
    // RFC 9000 appendix A.3's example.
    assert_eq!(decode_pn(Some(0xa82f30ea), 0x9b32, 16), 0xa82f9b32);
    assert_eq!(decode_pn(None, 2, 32), 2);
    assert_eq!(decode_pn(Some(255), 0, 8), 256);
    assert_eq!(
        decode_pn(Some(u64::MAX >> 2), 0xff, 8),
        0x3fff_ffff_ffff_ffff
    );
}

proptest! {
    /// Hostile datagrams: never a panic, and an answer other than
    /// NeedMore never changes.
    #[test]
    fn arbitrary_datagrams(d in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..1400), 1..6)) {
        check_final(&d);
    }

    /// The appendix's Initial with a few bytes changed, followed by the
    /// original.
    #[test]
    fn mutated_initials(flips in proptest::collection::vec((0usize..1200, any::<u8>()), 1..4)) {
        let good = rfc9001_initial();
        let mut bad = good.clone();
        for (i, v) in flips {
            bad[i] = v;
        }
        check_final(&[bad, good]);
    }
}

fn check_final(d: &[Vec<u8>]) {
    let mut s = QuicSniffer::new();
    let mut decided: Option<String> = None;
    for x in d {
        let r = s.push(x);
        if let Sniffed::Domain { name, .. } = r {
            assert!(super::super::valid_name(name.as_bytes()));
        }
        let r = show(r);
        match &decided {
            Some(a) => assert_eq!(&r, a, "final answer changed"),
            None if r != "NeedMore" => decided = Some(r),
            None => {}
        }
    }
}
