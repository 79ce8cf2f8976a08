//! Fuzz target for everything kerntun parses from a proxy server: SOCKS5
//! method/auth/CONNECT replies and UDP headers, the address format shared
//! with Shadowsocks, and Shadowsocks TCP response streams and UDP datagrams
//! for every AEAD method. All of it is data from the network, i.e. possibly
//! an attacker.
//!
//! Invariants: nothing panics; consumed lengths never exceed the input and
//! agree between `reply_len` and `parse_reply`; a parsed address re-encodes
//! to the exact bytes it was read from; decrypted output is never longer
//! than the ciphertext it came from.
#![no_main]

use std::net::{Ipv4Addr, SocketAddr};

use kerntun::config::ShadowsocksMethod as Method;
use kerntun::outbound::Address;
use kerntun::outbound::shadowsocks::{Key, UdpSession, tcp_session};
use kerntun::outbound::socks5;
use libfuzzer_sys::fuzz_target;

const METHODS: [(Method, &str); 5] = [
    (Method::Aes128Gcm, "fuzz-password"),
    (Method::Aes256Gcm, "fuzz-password"),
    (Method::Chacha20IetfPoly1305, "fuzz-password"),
    // base64 of 16 and 32 zero-to-n bytes: valid AEAD-2022 keys.
    (Method::Blake3Aes128Gcm, "AAECAwQFBgcICQoLDA0ODw=="),
    (
        Method::Blake3Aes256Gcm,
        "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
    ),
];

fuzz_target!(|data: &[u8]| {
    if data.len() >= 2 {
        let pair = [data[0], data[1]];
        let _ = socks5::parse_method_choice(pair, data[0] & 1 == 0);
        let _ = socks5::parse_auth_reply(pair);
    }
    match (socks5::reply_len(data), socks5::parse_reply(data)) {
        (Ok(Some(n)), Ok(Some((_, used)))) => {
            assert_eq!(n, used, "reply_len and parse_reply agree");
            assert!(used <= data.len());
        }
        (_, Ok(Some((_, used)))) => assert!(used <= data.len()),
        _ => {}
    }
    if let Ok((_, offset)) = socks5::parse_udp(data) {
        assert!(offset <= data.len());
    }
    if let Ok(Some((addr, used))) = Address::parse(data) {
        assert!(used <= data.len());
        let mut again = Vec::new();
        if addr.encode(&mut again).is_ok() {
            assert_eq!(again, &data[..used], "address round trip");
        }
    }

    // Shadowsocks: the first byte picks the method, the rest is the server's stream.
    let Some((&pick, wire)) = data.split_first() else {
        return;
    };
    let (method, password) = METHODS[usize::from(pick) % METHODS.len()];
    let Ok(key) = Key::new(method, password) else {
        return;
    };
    let target = Address::Ip(SocketAddr::from((Ipv4Addr::new(198, 19, 1, 2), 443)));
    if let Ok(session) = tcp_session(&key, &target) {
        if let Some(mut stream) = session.framing {
            let mut out = Vec::new();
            // Feed in two pieces to exercise frames split across reads.
            let cut = usize::from(pick) % (wire.len() + 1);
            let r = stream.open.feed(&wire[..cut], &mut out);
            if r.is_ok() {
                let _ = stream.open.feed(&wire[cut..], &mut out);
            }
            assert!(out.len() <= wire.len(), "plaintext never exceeds ciphertext");
        }
    }
    let mut datagram = wire.to_vec();
    if let Ok((_, range)) = UdpSession::new(&key).decode(&mut datagram) {
        assert!(range.end <= datagram.len() && range.start <= range.end);
    }
});
