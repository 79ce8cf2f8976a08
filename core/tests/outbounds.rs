//! Outbounds end to end: the app's traffic enters the TUN in the client
//! namespace, the rules send it to a proxy in the server namespace, and the
//! proxy reaches the test servers there. The proxies are the real thing,
//! started in-process on a thread (with its own runtime) in the server
//! namespace (`kerntun_testkit::tokio_servers`): shadowsocks-rust's server for every
//! method, and the `fast-socks5` server for SOCKS5 with and without
//! username/password. TCP and UDP, every byte checked.
//!
//! Also: direct connections are spliced (and are not with `relay.splice =
//! false`), a SOCKS5 proxy that answers garbage is a typed, counted error and
//! an RST for the app, and the SOCKS5 client speaks domain addresses.
//!
//! Needs root (CI runs as root); otherwise each test prints why it skipped.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use kerntun::StatsSnapshot;
use kerntun::config::{
    DriverMode, OutboundConfig, OutboundUdp, ShadowsocksConfig, ShadowsocksMethod, StackKind,
    UdpNat,
};
use kerntun::rules::{Action, Rule};
use kerntun_testkit::rig::{Rig, RigBuilder, socks5};
use kerntun_testkit::servers::{self, Mode};
use kerntun_testkit::tokio_servers::{
    InProcess, Socks5Options, in_process, listen, shadowsocks, socks5_server_with,
};
use kerntun_testkit::{Netns, Topology, client, require_root, root_topology, uninterrupted};

const MIB: usize = 1024 * 1024;
/// The AEAD-2022 keys (base64 of 16 and 32 bytes).
const PSK16: &str = "AAECAwQFBgcICQoLDA0ODw==";
const PSK32: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

/// An engine whose catch-all rule sends everything to the outbound named
/// `proxy`, when there is one. The system stack: these tests assert which
/// bytes are spliced, and only kernel sockets on both sides can be.
fn rig<'a>(proxy: Option<OutboundConfig>) -> RigBuilder<'a> {
    let b = Rig::builder()
        .stack(StackKind::System)
        .driver(DriverMode::PerPacket);
    match proxy {
        Some(p) => b.outbound("proxy", p).rule(Rule {
            action: Action::from("proxy"),
            ..Rule::default()
        }),
        None => b,
    }
}

// ---------------------------------------------------------------- Shadowsocks

fn ss_outbound(server: SocketAddr, method: ShadowsocksMethod, password: &str) -> OutboundConfig {
    OutboundConfig::Shadowsocks(ShadowsocksConfig {
        server: server.into(),
        method,
        password: password.into(),
        udp: OutboundUdp::Relay,
    })
}

/// One method: TCP echo with half-close (and a server that speaks first),
/// UDP round trips, through the TUN and the real server.
fn shadowsocks_method(method: ShadowsocksMethod, name: &str, password: &str, v6: bool) {
    let topo = Topology::new().expect("topology");
    let ss_addr = topo.server_addr(v6, 8388);
    let ss = shadowsocks(&topo.server, ss_addr, name, password);
    let rig = rig(Some(ss_outbound(ss_addr, method, password))).start_in(topo);
    let echo = rig.tcp_server(v6, Mode::Echo);
    let first = rig.tcp_server(v6, Mode::SpeakFirst);
    let udp = rig.udp_echo(v6);

    client::echo_transfer(echo.addr, 11, 4 * MIB, false).expect("TCP echo through shadowsocks");
    client::echo_transfer(first.addr, 12, 100_000, true).expect("server speaks first");
    let ok = client::udp_round_trips(udp.addr, 50, 1000).expect("UDP through shadowsocks");
    assert_eq!(ok, 50, "{name}: every datagram answered");

    let s = rig.stats();
    assert_eq!(echo.accepted.load(Relaxed), 1);
    assert_eq!(
        udp.accepted.load(Relaxed),
        50,
        "{name}: no duplicates, none lost"
    );
    let o = &s.outbounds[0];
    assert_eq!((o.tcp_connects, o.udp_flows), (2, 1), "{name}: {s:?}");
    assert_eq!(
        o.protocol_errors + o.tcp_failures + o.udp_failures,
        0,
        "{name}: {s:?}"
    );
    assert!(
        ss.relayed.load(Relaxed) >= 8 * MIB as u64,
        "{name}: the server carried the bytes"
    );
    if method == ShadowsocksMethod::None {
        // After the address header the socket is plain: spliced.
        assert!(
            s.tcp_bytes_spliced >= 8 * MIB as u64,
            "{name}: none is spliced: {s:?}"
        );
    } else {
        assert_eq!(s.tcp_bytes_spliced, 0, "{name}: AEAD is never spliced");
        assert!(s.tcp_bytes_copied >= 8 * MIB as u64, "{name}: {s:?}");
    }
    // 8000-byte datagrams: reassembled from the app's fragments, relayed,
    // their echoes fragmented back to the app.
    let ok =
        client::udp_round_trips(udp.addr, 10, 8000).expect("8000-byte UDP through shadowsocks");
    assert_eq!(ok, 10, "{name}: {:?}", rig.stats());
}

kerntun_testkit::root_tests!(shadowsocks_method;
    shadowsocks_none(ShadowsocksMethod::None, "none", "", false),
    shadowsocks_none_v6(ShadowsocksMethod::None, "none", "", true),
    shadowsocks_aes_128_gcm(ShadowsocksMethod::Aes128Gcm, "aes-128-gcm", "kerntun-test", false),
    shadowsocks_aes_256_gcm(ShadowsocksMethod::Aes256Gcm, "aes-256-gcm", "kerntun-test", false),
    shadowsocks_chacha20_ietf_poly1305(
        ShadowsocksMethod::Chacha20IetfPoly1305,
        "chacha20-ietf-poly1305",
        "kerntun-test",
        true
    ),
    shadowsocks_2022_blake3_aes_128_gcm(
        ShadowsocksMethod::Blake3Aes128Gcm,
        "2022-blake3-aes-128-gcm",
        PSK16,
        false
    ),
    shadowsocks_2022_blake3_aes_256_gcm(
        ShadowsocksMethod::Blake3Aes256Gcm,
        "2022-blake3-aes-256-gcm",
        PSK32,
        false
    ),
    shadowsocks_2022_blake3_aes_256_gcm_v6(
        ShadowsocksMethod::Blake3Aes256Gcm,
        "2022-blake3-aes-256-gcm",
        PSK32,
        true
    ),
);

/// A Shadowsocks server (`aes-256-gcm`) in the server namespace, and a rig
/// whose rule sends everything through it.
fn aes_256_gcm<'a>(topo: &Topology) -> (InProcess, RigBuilder<'a>) {
    let ss_addr = topo.server_addr(false, 8388);
    let password = "kerntun-test";
    let ss = shadowsocks(&topo.server, ss_addr, "aes-256-gcm", password);
    let out = ss_outbound(ss_addr, ShadowsocksMethod::Aes256Gcm, password);
    (ss, rig(Some(out)))
}

/// `count` echo transfers of 512 KiB to `addr` at once, each on its own
/// thread, seeds from `seed`: each one's bytes must come back exact.
fn echo_at_once(addr: SocketAddr, count: u64, seed: u64) {
    let transfers: Vec<_> = (0..count)
        .map(|i| {
            std::thread::spawn(move || client::echo_transfer(addr, seed + i, 512 * 1024, false))
        })
        .collect();
    for (i, t) in transfers.into_iter().enumerate() {
        t.join()
            .expect("transfer thread")
            .unwrap_or_else(|e| panic!("transfer {i}: {e}"));
    }
}

/// Shadowsocks through the smoltcp stack under the iOS budget, whose
/// sessions are admitted without the relay's fallback share (the framing's
/// state, its cut frames and its fallback buffers are charged as the relay
/// goes: `relay::Scratch`): 12 echo transfers at once. Every byte comes
/// back exact, nothing is refused, no protocol error. (With the relay pool
/// kept full, a direction whose read cuts a frame longer than 2 KiB waits
/// for room, `relay::copy` tests.)
#[test]
fn shadowsocks_through_smoltcp_on_the_ios_budget() {
    let topo = root_topology!();
    let (_ss, rig) = aes_256_gcm(&topo);
    let rig = rig
        .stack(StackKind::Smoltcp)
        .platform(kerntun::budget::Platform::Ios)
        .start_in(topo);
    let echo = rig.tcp_server(false, Mode::Echo);
    echo_at_once(echo.addr, 12, 100);
    let s = rig.stats();
    assert_eq!(echo.accepted.load(Relaxed), 12);
    assert_eq!(s.admission_refused, 0, "{s:?}");
    let o = &s.outbounds[0];
    assert_eq!(o.tcp_connects, 12, "{s:?}");
    assert_eq!(o.protocol_errors + o.tcp_failures, 0, "{s:?}");
    assert!(s.tcp_bytes_copied >= 12 * 1024 * 1024, "{s:?}");
}

/// Shadowsocks with the relay pool kept full: the iOS budget's 4 MiB pool
/// and 256 KiB relay buffers (512 KiB a framed direction), 40 echo
/// transfers at once. Most directions copy through fallback buffers, so
/// the server's 16 KiB chunks arrive cut, and each cut chunk needs pool
/// room the busy directions hold: those directions wait for it. Every
/// byte comes back exact and no session is reset for want of room.
#[test]
fn shadowsocks_with_the_relay_pool_full_loses_nothing() {
    let topo = root_topology!();
    let (_ss, rig) = aes_256_gcm(&topo);
    let rig = rig
        .platform(kerntun::budget::Platform::Ios)
        .budget(|b| b.relay_buffer = Some(256 * 1024))
        .start_in(topo);
    let echo = rig.tcp_server(false, Mode::Echo);
    echo_at_once(echo.addr, 40, 200);
    let s = rig.stats();
    assert_eq!(s.drop_count("relay_frame_refused"), 0, "{s:?}");
    assert_eq!(s.admission_refused, 0, "{s:?}");
    let o = &s.outbounds[0];
    assert_eq!(o.tcp_connects, 40, "{s:?}");
    assert_eq!(o.protocol_errors + o.tcp_failures, 0, "{s:?}");
}

#[test]
fn shadowsocks_wrong_password_reaches_nothing() {
    let topo = root_topology!();
    let ss_addr = topo.server_addr(false, 8388);
    let _ss = shadowsocks(&topo.server, ss_addr, "aes-256-gcm", "right");
    let rig = rig(Some(ss_outbound(
        ss_addr,
        ShadowsocksMethod::Aes256Gcm,
        "wrong",
    )))
    .start_in(topo);
    let echo = rig.tcp_server(false, Mode::SpeakFirst);
    // The connect succeeds (Shadowsocks has no handshake reply), but the
    // server cannot decrypt the header: it closes, and the app never gets a
    // byte; no banner arrives.
    let r = client::echo_transfer(echo.addr, 1, 1000, true);
    assert!(r.is_err(), "no banner through a wrong key");
    assert_eq!(
        echo.accepted.load(Relaxed),
        0,
        "the server never reached the target"
    );
}

/// Connect to `addr` through the TUN and read until the test server's
/// banner is complete, the stream ends or fails: the bytes that arrived.
fn read_banner(addr: SocketAddr) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    let mut got = Vec::new();
    let mut b = [0u8; 256];
    while got.len() < servers::BANNER.len() {
        match kerntun_testkit::uninterrupted(|| s.read(&mut b)) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if got.is_empty() => return Err(e),
            Err(_) => break,
        }
    }
    Ok(got)
}

/// An on-path attacker between the client and a real server records the
/// server's stream of the first connection and sends it back on every later
/// one. SIP004 does not bind a response to its request, so without the
/// client's salt filter the app would read the first connection's bytes
/// again; with it the replay is a counted protocol error and an RST.
#[test]
fn shadowsocks_replayed_server_stream_is_refused() {
    require_root!();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let topo = Topology::new().expect("topology");
    let ss_addr = topo.server_addr(false, 8388);
    let _ss = shadowsocks(&topo.server, ss_addr, "aes-256-gcm", "kerntun-test");
    let mitm = topo.server_addr(false, 8389);
    let recorded = Arc::new(parking_lot::Mutex::new(Vec::<u8>::new()));
    let rec = recorded.clone();
    let _mitm = in_process(&topo.server, move |ready, _| async move {
        let Some(l) = listen(mitm, &ready).await else {
            return;
        };
        let mut first = true;
        while let Ok((client, _)) = l.accept().await {
            let rec = rec.clone();
            if std::mem::take(&mut first) {
                // Relay to the real server, recording what it sends.
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(ss_addr).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::io::copy(&mut cr, &mut sw);
                    let down = async {
                        let mut b = [0u8; 4096];
                        while let Ok(n @ 1..) = sr.read(&mut b).await {
                            rec.lock().extend_from_slice(&b[..n]);
                            if cw.write_all(&b[..n]).await.is_err() {
                                break;
                            }
                        }
                        let _ = cw.shutdown().await;
                    };
                    let _ = tokio::join!(up, down);
                });
            } else {
                // Replay the recording; swallow the client's request.
                let bytes = rec.lock().clone();
                tokio::spawn(async move {
                    let mut client = client;
                    let _ = client.write_all(&bytes).await;
                    let mut b = [0u8; 4096];
                    while let Ok(1..) = client.read(&mut b).await {}
                });
            }
        }
    });
    let rig = rig(Some(ss_outbound(
        mitm,
        ShadowsocksMethod::Aes256Gcm,
        "kerntun-test",
    )))
    .start_in(topo);
    let target = rig.tcp_server(false, Mode::SpeakFirst);
    assert_eq!(
        read_banner(target.addr).expect("first connection"),
        servers::BANNER,
        "the first connection is relayed"
    );
    assert!(!recorded.lock().is_empty(), "the attacker recorded it");
    let replayed = read_banner(target.addr);
    assert!(
        replayed.as_ref().map_or(true, |b| b.is_empty()),
        "a replayed server stream reaches the app: {replayed:?}"
    );
    rig.wait_until("the replay counted", Duration::from_secs(3), |s| {
        s.outbounds[0].protocol_errors > 0
    });
    let s = rig.stats();
    assert_eq!(s.outbounds[0].protocol_errors, 1, "{s:?}");
    assert_eq!(target.accepted.load(Relaxed), 1, "only the real request");
}

// ---------------------------------------------------------------- SOCKS5

/// fast-socks5's server on `addr`: CONNECT and UDP ASSOCIATE, with
/// username/password when `creds` is set. Counts the requests it served.
fn socks5_server(ns: &Netns, addr: SocketAddr, creds: Option<(&str, &str)>) -> InProcess {
    let opts = Socks5Options {
        creds: creds.map(|(u, p)| (u.to_owned(), p.to_owned())),
        udp: true,
        uncounted: None,
        connect_timeout: Duration::from_secs(5),
    };
    socks5_server_with(ns, addr, opts)
}

fn socks5_case(creds: Option<(&str, &str)>, v6: bool) {
    let topo = Topology::new().expect("topology");
    let proxy = topo.server_addr(v6, 1080);
    let srv = socks5_server(&topo.server, proxy, creds);
    let rig = rig(Some(socks5(proxy, creds, OutboundUdp::Relay))).start_in(topo);
    let echo = rig.tcp_server(v6, Mode::Echo);
    let udp = rig.udp_echo(v6);
    client::echo_transfer(echo.addr, 21, 4 * MIB, false).expect("TCP through SOCKS5");
    let ok = client::udp_round_trips(udp.addr, 50, 1000).expect("UDP through SOCKS5");
    assert_eq!(ok, 50);
    let s = rig.stats();
    assert_eq!(udp.accepted.load(Relaxed), 50, "{s:?}");
    assert_eq!(
        srv.relayed.load(Relaxed),
        2,
        "one CONNECT, one UDP ASSOCIATE"
    );
    let o = &s.outbounds[0];
    assert_eq!((o.tcp_connects, o.udp_flows), (1, 1), "{s:?}");
    // After CONNECT the proxy socket is plain TCP: spliced.
    assert!(s.tcp_bytes_spliced >= 8 * MIB as u64, "{s:?}");
    // 8000-byte datagrams: reassembled from the app's fragments, relayed,
    // their echoes fragmented back to the app.
    let ok = client::udp_round_trips(udp.addr, 10, 8000).expect("8000-byte UDP through SOCKS5");
    assert_eq!(ok, 10, "{:?}", rig.stats());
}

kerntun_testkit::root_tests!(socks5_case;
    socks5_no_auth_v4(None, false),
    socks5_no_auth_v6(None, true),
    socks5_username_password(Some(("kerntun", "s3cret")), false),
);

#[test]
fn socks5_wrong_password_is_a_counted_refusal() {
    let topo = root_topology!();
    let proxy = topo.server_addr(false, 1080);
    let _srv = socks5_server(&topo.server, proxy, Some(("kerntun", "s3cret")));
    let rig = rig(Some(socks5(
        proxy,
        Some(("kerntun", "nope")),
        OutboundUdp::Relay,
    )))
    .start_in(topo);
    let to = rig.topo.server_addr(false, 9);
    let start = Instant::now();
    let e = TcpStream::connect_timeout(&to, Duration::from_secs(3)).expect_err("refused");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    assert!(start.elapsed() < Duration::from_secs(2), "RST at SYN time");
    let s = rig.stats();
    assert_eq!(s.outbounds[0].protocol_errors, 1, "{s:?}");
    assert_eq!(s.tcp_connect_failed, 1, "{s:?}");
}

/// A "proxy" that accepts the method and then answers the request with
/// garbage: a typed error, counted, and an RST for the app.
#[test]
fn socks5_garbage_reply_is_a_counted_refusal() {
    let topo = root_topology!();
    let proxy = topo.server_addr(false, 1080);
    let _srv = in_process(&topo.server, move |ready, _| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let Some(l) = listen(proxy, &ready).await else {
            return;
        };
        while let Ok((mut s, _)) = l.accept().await {
            let mut b = [0u8; 64];
            let _ = s.read(&mut b).await; // greeting
            let _ = s.write_all(&[5, 0]).await;
            let _ = s.read(&mut b).await; // request
            let _ = s.write_all(&[5, 0, 0, 9, 1, 2, 3, 4, 5, 6]).await; // ATYP 9
        }
    });
    let rig = rig(Some(socks5(proxy, None, OutboundUdp::Relay))).start_in(topo);
    let e = TcpStream::connect_timeout(&rig.topo.server_addr(false, 9), Duration::from_secs(3))
        .expect_err("refused");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    let s = rig.stats();
    assert_eq!(s.outbounds[0].protocol_errors, 1, "{s:?}");
}

/// The client's domain addresses, against the same server on loopback
/// (domains never come out of the TUN; this checks the wire format).
#[test]
fn socks5_domain_address_on_loopback() {
    use kerntun::outbound::Address;
    use kerntun::outbound::socks5::{Command, Credentials, handshake};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    rt.block_on(async {
        // A target on loopback, named "localhost".
        let target = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = target.local_addr().expect("addr").port();
        tokio::spawn(async move {
            let (mut s, _) = target.accept().await.expect("accept");
            let mut b = [0u8; 5];
            s.read_exact(&mut b).await.expect("read");
            s.write_all(&b).await.expect("echo");
        });
        let proxy = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let paddr = proxy.local_addr().expect("addr");
        tokio::spawn(async move {
            use fast_socks5::server::{Socks5ServerProtocol, run_tcp_proxy};
            let (s, _) = proxy.accept().await.expect("accept");
            let proto = Socks5ServerProtocol::accept_password_auth(s, |u, p| u == "a" && p == "b")
                .await
                .expect("auth")
                .0;
            let (proto, _, target) = proto.read_command().await.expect("cmd");
            let target = match target.resolve_dns().await {
                Ok(t) => t,
                Err(e) => panic!("resolve: {e}"),
            };
            let _ = run_tcp_proxy(proto, &target, Duration::from_secs(5), true).await;
        });
        let mut s = tokio::net::TcpStream::connect(paddr)
            .await
            .expect("connect");
        let creds = Credentials {
            username: "a".into(),
            password: "b".into(),
        };
        handshake(
            &mut s,
            Some(&creds),
            Command::Connect,
            &Address::Domain("localhost".into(), port),
            Duration::from_secs(5),
        )
        .await
        .expect("handshake with a domain target");
        s.write_all(b"hello").await.expect("w");
        let mut back = [0u8; 5];
        s.read_exact(&mut back).await.expect("r");
        assert_eq!(&back, b"hello");
    });
}

// ---------------------------------------------------------------- direct + splice

fn direct_bulk(splice: bool) -> StatsSnapshot {
    let rig = rig(None).config(|_, c| c.relay.splice = splice).start();
    let echo = rig.tcp_server(false, Mode::Echo);
    client::echo_transfer(echo.addr, 31, 8 * MIB, false).expect("direct echo");
    rig.stats()
}

#[test]
fn direct_connections_are_spliced_by_default() {
    require_root!();
    let s = direct_bulk(true);
    let total = 16 * MIB as u64 + servers::TRAILER.len() as u64;
    assert_eq!(s.tcp_bytes_up + s.tcp_bytes_down, total, "{s:?}");
    assert_eq!(s.tcp_bytes_spliced, total, "every byte spliced: {s:?}");
    assert_eq!((s.tcp_bytes_copied, s.splice_fallbacks), (0, 0), "{s:?}");
}

#[test]
fn relay_splice_false_copies() {
    require_root!();
    let s = direct_bulk(false);
    let total = 16 * MIB as u64 + servers::TRAILER.len() as u64;
    assert_eq!(s.tcp_bytes_spliced, 0, "{s:?}");
    assert_eq!(s.tcp_bytes_copied, total, "{s:?}");
}

/// A proxy outbound with `udp = "direct"` sends UDP flows direct; a
/// `reject` rule drops them (counted) and answers with an ICMP port
/// unreachable, which the app's connected socket reports as
/// `ECONNREFUSED`.
#[test]
fn udp_rules_per_flow() {
    let topo = root_topology!();
    let proxy = topo.server_addr(false, 1080);
    let srv = socks5_server(&topo.server, proxy, None);
    let udp_a = topo.udp_echo(false);
    let udp_b = topo.udp_echo(false);
    let b_port = udp_b.addr.port();
    let rig = rig(Some(socks5(proxy, None, OutboundUdp::Direct)))
        .config(move |_, c| {
            c.rules.insert(
                0,
                Rule {
                    cidr: None,
                    ports: Some(format!("{b_port}").parse().expect("port")),
                    action: Action::Reject,
                    ..Rule::default()
                },
            );
        })
        .start_in(topo);
    assert_eq!(client::udp_round_trips(udp_a.addr, 10, 100).expect("a"), 10);
    let refused = client::udp_round_trips(udp_b.addr, 2, 100).expect_err("b refused");
    assert_eq!(
        refused.kind(),
        io::ErrorKind::ConnectionRefused,
        "{refused}"
    );
    let s = rig.stats();
    assert_eq!(
        srv.relayed.load(Relaxed),
        0,
        "no association for udp = \"direct\""
    );
    assert!(s.drop_count("udp_rejected") >= 1, "{s:?}");
    assert_eq!(s.drop_count("udp_outbound_refused"), 0, "{s:?}");
    assert_eq!(udp_b.accepted.load(Relaxed), 0);
}

/// How long an app's connected UDP socket waits for the refusal of what
/// it sends: an ICMP port unreachable written back at once
/// (`core/src/udp/reject.rs`) takes microseconds through the TUN; a
/// second leaves room for a loaded CI machine and is still far below the
/// seconds a QUIC client or resolver would wait out.
const REFUSAL_BOUND: Duration = Duration::from_secs(1);

/// One datagram from a fresh connected socket to `to`, and the error its
/// next receive reports, with the time from the send to that error (a
/// receive that times out after [`REFUSAL_BOUND`] reports `WouldBlock` or
/// `TimedOut`).
fn send_and_wait(to: SocketAddr) -> (io::Error, Duration) {
    let bind: SocketAddr = match to {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().expect("static"),
        SocketAddr::V6(_) => "[::]:0".parse().expect("static"),
    };
    let s = UdpSocket::bind(bind).expect("bind");
    s.connect(to).expect("connect");
    s.set_read_timeout(Some(REFUSAL_BOUND)).expect("timeout");
    let start = Instant::now();
    s.send(b"must not leave past the proxy").expect("send");
    let mut buf = [0u8; 64];
    let e = match uninterrupted(|| s.recv(&mut buf)) {
        Ok(n) => panic!("a reply of {n} bytes: the datagram got through"),
        Err(e) => e,
    };
    (e, start.elapsed())
}

/// A SOCKS5 outbound with `udp = false` refuses the UDP flows the rules
/// send it: no datagram reaches the server (counted there), no UDP
/// ASSOCIATE is asked for, the app's connected socket fails with
/// `ECONNREFUSED` within [`REFUSAL_BOUND`] (an ICMP port unreachable, as
/// for a `reject` rule), and each datagram is counted as
/// `udp_outbound_refused`. TCP still goes through the proxy.
fn udp_false_refuses_udp(v6: bool) {
    let topo = Topology::new().expect("topology");
    let proxy = topo.server_addr(v6, 1080);
    let srv = socks5_server(&topo.server, proxy, None);
    let rig = rig(Some(socks5(proxy, None, OutboundUdp::Refuse))).start_in(topo);
    let udp = rig.udp_echo(v6);
    // Three sockets, three flows: each is refused, none opens.
    for i in 0..3 {
        let (e, took) = send_and_wait(udp.addr);
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{i}: {e}");
        assert!(took < REFUSAL_BOUND, "{i}: refused after {took:?}");
    }
    // The round-trip client sends again on a timeout: still refused.
    let e = client::udp_round_trips(udp.addr, 2, 100).expect_err("refused");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    let echo = rig.tcp_server(v6, Mode::Echo);
    client::echo_transfer(echo.addr, 1, 64 * 1024, false).expect("TCP through SOCKS5");
    // Anything that leaked would have reached the server by now: what the
    // refusals took is well past a datagram's time across the veth.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(udp.accepted.load(Relaxed), 0, "no datagram at the server");
    assert_eq!(
        srv.relayed.load(Relaxed),
        1,
        "one CONNECT, no UDP ASSOCIATE"
    );
    let s = rig.stats();
    assert!(s.drop_count("udp_outbound_refused") >= 4, "{s:?}");
    assert_eq!(
        s.drop_count("udp_rejected"),
        0,
        "not a rule's refusal: {s:?}"
    );
    assert_eq!(
        (s.outbounds[0].tcp_connects, s.outbounds[0].udp_flows),
        (1, 0)
    );
    assert_eq!(s.udp_flows_total, 0, "no flow opened: {s:?}");
}

#[test]
fn udp_false_refuses_udp_v4() {
    require_root!();
    udp_false_refuses_udp(false);
}

#[test]
fn udp_false_refuses_udp_v6() {
    require_root!();
    udp_false_refuses_udp(true);
}

/// `udp = "direct"`: the same datagrams reach the server, from the
/// client's own address, and no UDP ASSOCIATE is asked for.
#[test]
fn udp_direct_sends_udp_around_the_proxy() {
    let topo = root_topology!();
    let proxy = topo.server_addr(false, 1080);
    let srv = socks5_server(&topo.server, proxy, None);
    let rig = rig(Some(socks5(proxy, None, OutboundUdp::Direct))).start_in(topo);
    let udp = rig.udp_echo(false);
    assert_eq!(
        client::udp_round_trips(udp.addr, 10, 100).expect("direct"),
        10
    );
    assert_eq!(
        udp.accepted.load(Relaxed),
        10,
        "every datagram at the server"
    );
    assert_eq!(srv.relayed.load(Relaxed), 0, "no UDP ASSOCIATE");
    let s = rig.stats();
    assert_eq!(s.drop_count("udp_outbound_refused"), 0, "{s:?}");
    assert_eq!(s.outbounds[0].udp_flows, 0, "{s:?}");
}

/// A second address of the server, 198.19.N.3 / fd00:19:N::3, on its link,
/// routed into the TUN in the client namespace (replies from it reach the
/// app through the engine, as a peer's would).
fn second_server_address(rig: &Rig, v6: bool) -> IpAddr {
    let second: IpAddr = match rig.topo.server(v6) {
        IpAddr::V4(a) => {
            let o = a.octets();
            Ipv4Addr::new(o[0], o[1], o[2], 3).into()
        }
        IpAddr::V6(a) => {
            let mut s = a.segments();
            s[7] = 3;
            Ipv6Addr::from(s).into()
        }
    };
    let (fam, len) = if v6 { ("-6", 64) } else { ("-4", 24) };
    let addr = format!("{second}/{len}");
    let mut args = vec![fam, "addr", "add", &addr, "dev", "kts"];
    if v6 {
        // Usable at once (no DAD), and deprecated, so the server's kernel
        // never picks it as the source of what the proxies send from their
        // unbound sockets (the engine's association is connected to the
        // proxy's first address).
        args.extend(["nodad", "preferred_lft", "0"]);
    }
    rig.topo.server.ip(&args).expect("second address");
    let tun = rig.tun();
    rig.topo
        .client
        .ip(&[fam, "route", "add", &second.to_string(), "dev", &tun])
        .expect("second route");
    second
}

/// Through a SOCKS5 UDP association and a Shadowsocks UDP relay, the app
/// sends to the server's port A; the server answers from A, from its port
/// B and from a second address. With endpoint-independent filtering (the
/// default, `direct.udp_nat`) all three reach the app, each from the address
/// and port the proxy names (the real source); with `udp_nat = "connected"`
/// only A's. Both families. The test kit's proxies relay replies from any
/// address (fast-socks5 and shadowsocks-rust read their outbound sockets
/// unconnected).
#[test]
fn proxied_udp_replies_from_any_address() {
    require_root!();
    for via in [Via::Socks5, Via::Shadowsocks] {
        for nat in [UdpNat::EndpointIndependent, UdpNat::Connected] {
            for v6 in [false, true] {
                let topo = Topology::new().expect("topology");
                let proxy_addr = topo.server_addr(v6, 1080);
                let (_proxy, outbound) = match via {
                    Via::Socks5 => (
                        socks5_server(&topo.server, proxy_addr, None),
                        socks5(proxy_addr, None, OutboundUdp::Relay),
                    ),
                    Via::Shadowsocks => (
                        shadowsocks(&topo.server, proxy_addr, "aes-256-gcm", "kerntun-test"),
                        ss_outbound(proxy_addr, ShadowsocksMethod::Aes256Gcm, "kerntun-test"),
                    ),
                };
                let rig = rig(Some(outbound))
                    .config(move |_, c| c.direct.udp_nat = nat)
                    .start_in(topo);
                let second = second_server_address(&rig, v6);
                let server = rig.topo.server(v6);
                let (got, sent) =
                    client::replies_from_three_places(&rig.topo.server, server, second);
                let want = if nat == UdpNat::EndpointIndependent {
                    &sent[..]
                } else {
                    &sent[..1]
                };
                assert_eq!(got, want, "{via:?} {nat:?} v6 {v6}: {:?}", rig.stats());
                assert_eq!(rig.stats().outbounds[0].udp_flows, 1, "{via:?}");
            }
        }
    }
}

// ---------------------------------------------------------------- DNS upstreams

/// Which proxy carries the DNS service's upstream exchange.
#[derive(Debug, Clone, Copy)]
enum Via {
    Shadowsocks,
    Socks5,
}

/// The DNS service reaches its upstream through the proxy the rules choose
/// for the upstream's address (here the catch-all `proxy`): UDP through the
/// proxy's UDP relay, TCP through a proxied stream (framed by the
/// Shadowsocks AEAD codec when there is one).
fn dns_through_proxy(via: Via, upstream_proto: &'static str) {
    use hickory_proto::rr::RecordType;
    use kerntun_testkit::dns::{self, DnsServer, Zone};
    let topo = Topology::new().expect("topology");
    let (_proxy, outbound) = match via {
        Via::Shadowsocks => {
            let addr = topo.server_addr(false, 8388);
            let srv = shadowsocks(&topo.server, addr, "aes-256-gcm", "kerntun-test");
            (
                srv,
                ss_outbound(addr, ShadowsocksMethod::Aes256Gcm, "kerntun-test"),
            )
        }
        Via::Socks5 => {
            let addr = topo.server_addr(false, 1080);
            (
                socks5_server(&topo.server, addr, None),
                socks5(addr, None, OutboundUdp::Relay),
            )
        }
    };
    let real = topo.server_addr(false, 0).ip();
    let up_addr = topo.server_addr(false, 53);
    let rig = rig(Some(outbound))
        .dns([format!("{upstream_proto}://{up_addr}")])
        .config(|_, c| c.dns.timeout_ms = 2_000)
        .start_in(topo);
    let up = DnsServer::start(
        &rig.topo.server,
        up_addr,
        Zone::new(60).with("p.test", real),
    )
    .expect("dns server");
    let r = dns::ask_udp(
        kerntun_testkit::rig::RESOLVER,
        &dns::query("p.test", RecordType::A, 9),
        Duration::from_secs(5),
    )
    .expect("ask")
    .expect("an answer");
    assert_eq!(dns::first_addr(&r), Some(real), "{r:?}");
    assert_eq!(up.queries(), 1, "the upstream was asked once");
    let s = rig.stats();
    let o = &s.outbounds[0];
    if upstream_proto == "udp" {
        assert!(
            o.udp_flows >= 1,
            "the query went through the proxy's UDP: {s:?}"
        );
    } else {
        assert!(
            o.tcp_connects >= 1,
            "the query went through a proxied stream: {s:?}"
        );
    }
    assert_eq!(s.dns.servfail + s.dns.upstream_failures, 0, "{:?}", s.dns);
}

kerntun_testkit::root_tests!(dns_through_proxy;
    dns_upstream_udp_through_shadowsocks(Via::Shadowsocks, "udp"),
    dns_upstream_tcp_through_shadowsocks(Via::Shadowsocks, "tcp"),
    dns_upstream_udp_through_socks5(Via::Socks5, "udp"),
    dns_upstream_tcp_through_socks5(Via::Socks5, "tcp"),
);
