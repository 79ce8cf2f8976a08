//! How new TCP connections are dispatched by domain, end to end through a
//! real TUN in namespaces the tests create: the TLS SNI / HTTP Host sniffed
//! from the first bytes chooses the domain rule (without losing a byte of
//! the stream), and a connection that names no domain, or stays silent past
//! the sniff timeout, is routed by its address; a connection to a fake-ip
//! address goes out by its domain (to a SOCKS5 proxy as a domain address,
//! or direct after kerntun resolves it upstream); DNS over TCP to the
//! hijacked address is answered by the engine. Both stacks.
//!
//! Needs root (CI runs as root); otherwise each test prints why it skipped.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use hickory_proto::rr::RecordType;
use kerntun::config::{Config, DriverMode, OutboundUdp, StackKind};
use kerntun::rules::{Action, Rule};
use kerntun_testkit::Topology;
use kerntun_testkit::dns::{self, DnsServer, Socks5Recorder, Zone};
use kerntun_testkit::rig::{self, RESOLVER, Rig, RigBuilder};
use kerntun_testkit::servers::{self, Mode};

/// An engine of `stack` and `driver`, IPv4 only, sniffing `sniff_port`
/// (300 ms for the first bytes), with the rules of `rules_toml`.
fn rig<'a>(
    stack: StackKind,
    driver: DriverMode,
    rules_toml: &str,
    sniff_port: u16,
) -> RigBuilder<'a> {
    // Rules come from TOML so the test reads like a user's configuration.
    let rules = Config::from_toml(rules_toml).expect("rules").rules;
    Rig::builder()
        .stack(stack)
        .driver(driver)
        .ipv4_only()
        .sniff(sniff_port, 300)
        .config(move |_, c| c.rules = rules)
}

/// [`rig`] with [`RULES`], sniffing `port`, and a `mode` server on that
/// port (sniffed ports are configured before the server exists: a fixed
/// one).
fn sniffing(stack: StackKind, driver: DriverMode, port: u16, mode: Mode) -> (Rig, servers::Server) {
    let rig = rig(stack, driver, RULES, port).start();
    let srv =
        servers::tcp(&rig.topo.server, rig.topo.server_addr(false, port), mode).expect("server");
    (rig, srv)
}

/// A minimal TLS 1.2-style ClientHello carrying `sni` (hand-built test
/// vector: record header, handshake header, version, random, empty session
/// id, one cipher suite, null compression, the server_name extension).
fn client_hello(sni: &str) -> Vec<u8> {
    let name = sni.as_bytes();
    let mut ext = Vec::new();
    ext.extend_from_slice(&0u16.to_be_bytes()); // server_name
    let list_len = 3 + name.len();
    ext.extend_from_slice(&u16::try_from(list_len + 2).expect("len").to_be_bytes());
    ext.extend_from_slice(&u16::try_from(list_len).expect("len").to_be_bytes());
    ext.push(0); // host_name
    ext.extend_from_slice(&u16::try_from(name.len()).expect("len").to_be_bytes());
    ext.extend_from_slice(name);

    let mut body = vec![0x03, 0x03];
    body.extend_from_slice(&[7u8; 32]); // random
    body.push(0); // session id
    body.extend_from_slice(&[0x00, 0x02, 0x13, 0x01]); // one suite
    body.extend_from_slice(&[0x01, 0x00]); // null compression
    body.extend_from_slice(&u16::try_from(ext.len()).expect("len").to_be_bytes());
    body.extend_from_slice(&ext);

    let mut hs = vec![0x01];
    hs.extend_from_slice(&u32::try_from(body.len()).expect("len").to_be_bytes()[1..]);
    hs.extend_from_slice(&body);

    let mut rec = vec![0x16, 0x03, 0x01];
    rec.extend_from_slice(&u16::try_from(hs.len()).expect("len").to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

/// Send `first`, then a payload, half-close, and read everything back:
/// `Ok(echo)` when the connection was relayed, `Err` when it was refused or
/// reset before an answer.
fn exchange(to: SocketAddr, first: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(first)?;
    s.write_all(b"payload after the hello")?;
    s.shutdown(std::net::Shutdown::Write)?;
    let mut got = Vec::new();
    s.read_to_end(&mut got)?;
    if got.is_empty() {
        return Err(std::io::ErrorKind::ConnectionReset.into());
    }
    Ok(got)
}

const RULES: &str = r#"
[[rules]]
domain_suffix = ["blocked.test"]
action = "reject"
"#;

fn sniffed_domain_picks_the_rule(stack: StackKind, driver: DriverMode) {
    let (rig, srv) = sniffing(stack, driver, 8443, Mode::Echo);

    // A ClientHello naming a blocked domain: reset, and the server never sees it.
    let blocked = exchange(srv.addr, &client_hello("www.blocked.test"));
    assert!(blocked.is_err(), "blocked SNI was relayed: {blocked:?}");

    // An HTTP request with a blocked Host: reset too.
    let http = b"GET / HTTP/1.1\r\nHost: api.blocked.test:8443\r\nAccept: */*\r\n\r\n";
    let blocked_http = exchange(srv.addr, http);
    assert!(
        blocked_http.is_err(),
        "blocked Host was relayed: {blocked_http:?}"
    );
    assert_eq!(
        srv.accepted.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "refused connections never reached the server"
    );

    // An allowed SNI: relayed, every byte (the sniffed hello included) echoed.
    let hello = client_hello("ok.test");
    let got = exchange(srv.addr, &hello).expect("allowed SNI relayed");
    let mut want = hello.clone();
    want.extend_from_slice(b"payload after the hello");
    want.extend_from_slice(servers::TRAILER);
    assert_eq!(got, want, "the sniffed bytes reach the server unchanged");

    // No domain in the first bytes: routed by address (direct), intact.
    let got = exchange(srv.addr, b"\x00\x01binary protocol").expect("no-domain relayed");
    assert!(got.starts_with(b"\x00\x01binary protocol"));

    let s = rig.stats();
    assert!(s.dns.sniffed >= 3, "sniffed count: {:?}", s.dns);
    assert!(s.dns.sniff_misses >= 1, "misses: {:?}", s.dns);
    assert!(
        s.tcp_rejected_by_rule >= 2,
        "rule rejections: {}",
        s.tcp_rejected_by_rule
    );
}

/// An HTTP request whose header runs past the sniffing cap (20 KiB before
/// the Host line): sniffing gives up at `sniff::MAX_SNIFF` without a domain,
/// the connection is routed by its address, and every byte read while
/// sniffing reaches the server once, in order. Both stacks look at the
/// bytes where they wait (the kernel's queue, smoltcp's ring) and take
/// none out, so the relay moves every one of them.
fn large_http_header_is_relayed_byte_exact(stack: StackKind, driver: DriverMode) {
    let (rig, srv) = sniffing(stack, driver, 8080, Mode::Echo);
    let mut header = b"GET / HTTP/1.1\r\nX-Pad: ".to_vec();
    // Not a multiple of the sniffing reads, so a read straddles the cap.
    header.extend((0..20 * 1024 + 7).map(|i| b'a' + (i % 26) as u8));
    header.extend_from_slice(b"\r\nHost: ok.test\r\n\r\n");
    for round in 0..3 {
        let got = exchange(srv.addr, &header).expect("relayed");
        let mut want = header.clone();
        want.extend_from_slice(b"payload after the hello");
        want.extend_from_slice(servers::TRAILER);
        assert_eq!(got.len(), want.len(), "round {round}: bytes lost or added");
        assert!(got == want, "round {round}: the stream arrived changed");
    }
    let s = rig.stats();
    assert!(
        s.dns.sniff_misses >= 3,
        "no domain within the cap: {:?}",
        s.dns
    );
}

fn silent_client_is_routed_after_the_timeout(stack: StackKind, driver: DriverMode) {
    // The server speaks first: the client sends nothing, so sniffing times
    // out and the connection goes by its address.
    let (rig, srv) = sniffing(stack, driver, 8025, Mode::SpeakFirst);
    let start = Instant::now();
    let mut s = TcpStream::connect_timeout(&srv.addr, Duration::from_secs(3)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut banner = vec![0u8; servers::BANNER.len()];
    s.read_exact(&mut banner)
        .expect("banner after the sniff timeout");
    assert_eq!(banner, servers::BANNER);
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(250),
        "routed before the sniff timeout ({waited:?})"
    );
    assert!(
        waited < Duration::from_secs(3),
        "sniff wait unbounded ({waited:?})"
    );
    assert!(rig.stats().dns.sniff_misses >= 1);
}

fn unsniffed_port_is_connected_first(stack: StackKind, driver: DriverMode) {
    // A port not in sniff.ports keeps connect-first: a closed port is
    // refused at connect time, and the rule on the domain never applies.
    let rig = rig(stack, driver, RULES, 9).start();
    let srv = rig.tcp_server(false, Mode::Echo);
    let got = exchange(srv.addr, &client_hello("www.blocked.test")).expect("not sniffed");
    assert!(got.starts_with(&client_hello("www.blocked.test")));
    assert_eq!(rig.stats().dns.sniffed, 0);
}

/// Ask the hijacked resolver for `name` (A) and return the address given.
fn resolve_fake(name: &str) -> Ipv4Addr {
    let r = dns::ask_udp(
        RESOLVER,
        &dns::query(name, RecordType::A, 7),
        Duration::from_secs(3),
    )
    .expect("ask")
    .expect("an answer");
    match dns::first_addr(&r) {
        Some(IpAddr::V4(a)) => a,
        other => panic!("no A answer for {name}: {other:?}"),
    }
}

/// No rules, nothing sniffed, `[dns]` on with fake-ip, answering for the app
/// at [`RESOLVER`]; `zone` is the upstream, on the server's port 53.
fn dns_on<'a>(
    stack: StackKind,
    driver: DriverMode,
    topo: &Topology,
    zone: Zone,
) -> (RigBuilder<'a>, DnsServer) {
    let at = topo.server_addr(false, 53);
    let up = DnsServer::start(&topo.server, at, zone).expect("dns server");
    let rig = rig(stack, driver, "", 1)
        .dns([format!("udp://{at}")])
        .config(|_, c| {
            c.dns.timeout_ms = 1_000;
            c.dns.fake_ip = true;
        });
    (rig, up)
}

fn fake_ip_tcp_goes_to_socks5_as_a_domain(stack: StackKind, driver: DriverMode) {
    let topo = Topology::new().expect("topology");
    let proxy = topo.server_addr(false, 1080);
    let (rig, _up) = dns_on(stack, driver, &topo, Zone::new(60));
    let rig = rig
        .outbound("proxy", rig::socks5(proxy, None, OutboundUdp::Refuse))
        .rule(Rule {
            domain_suffix: vec!["site.test".into()],
            action: Action::from("proxy"),
            ..Rule::default()
        })
        .start_in(topo);
    let socks = Socks5Recorder::start(&rig.topo.server, proxy).expect("socks5");
    let fake = resolve_fake("www.site.test");
    let to = SocketAddr::new(IpAddr::V4(fake), 443);
    let got = exchange(to, b"hello by name").expect("relayed through the proxy");
    assert!(got.starts_with(b"hello by name"), "{got:?}");
    assert!(
        socks.asked().iter().any(|a| a == "www.site.test:443"),
        "the proxy was given the domain: {:?}",
        socks.asked()
    );
    let s = rig.stats();
    assert_eq!(s.outbounds[0].tcp_connects, 1, "{:?}", s.outbounds);
}

fn fake_ip_tcp_direct_is_resolved_upstream(stack: StackKind, driver: DriverMode) {
    let topo = Topology::new().expect("topology");
    let real = topo.server_addr(false, 0).ip();
    let (rig, up) = dns_on(stack, driver, &topo, Zone::new(60).with("srv.test", real));
    let rig = rig.start_in(topo);
    let srv = rig.tcp_server(false, Mode::Echo);
    let fake = resolve_fake("srv.test");
    assert_ne!(IpAddr::V4(fake), real, "a fake address, not the real one");
    assert_eq!(up.queries(), 0, "a fake answer asks no upstream");
    let to = SocketAddr::new(IpAddr::V4(fake), srv.addr.port());
    let got = exchange(to, b"direct by name").expect("relayed direct");
    assert!(got.starts_with(b"direct by name"));
    assert!(up.queries() >= 1, "the engine resolved the domain upstream");
    // An address of the pool that no domain holds is refused at once.
    let unknown = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(198, 18, 200, 200)), 80);
    assert!(exchange(unknown, b"x").is_err());
}

fn dns_over_tcp_is_answered_by_the_engine(stack: StackKind, driver: DriverMode) {
    let topo = Topology::new().expect("topology");
    let real = topo.server_addr(false, 0).ip();
    let (rig, up) = dns_on(stack, driver, &topo, Zone::new(60).with("a.test", real));
    let rig = rig.config(|_, c| c.dns.fake_ip = false).start_in(topo);
    let replies = dns::ask_tcp(
        RESOLVER,
        &[
            dns::query("a.test", RecordType::A, 1),
            dns::query("a.test", RecordType::A, 2),
        ],
        Duration::from_secs(3),
    )
    .expect("two queries on one connection");
    assert_eq!(replies.len(), 2);
    for (r, id) in replies.iter().zip([1u16, 2]) {
        assert_eq!(r.metadata.id, id);
        assert_eq!(dns::first_addr(r), Some(real));
    }
    assert_eq!(up.queries(), 1, "the second answer came from the cache");
    let s = rig.stats();
    assert_eq!(s.dns.tcp_queries, 2);
    assert!(s.dns.cache_hits >= 1);
}

macro_rules! both_stacks {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use kerntun::config::{DriverMode, StackKind};
            kerntun_testkit::root_tests!(crate::$name;
                system(StackKind::System, DriverMode::Batch),
                smoltcp(StackKind::Smoltcp, DriverMode::PerPacket),
            );
        }
    )*};
}

both_stacks!(
    fake_ip_tcp_goes_to_socks5_as_a_domain,
    fake_ip_tcp_direct_is_resolved_upstream,
    dns_over_tcp_is_answered_by_the_engine,
    sniffed_domain_picks_the_rule,
    large_http_header_is_relayed_byte_exact,
    silent_client_is_routed_after_the_timeout,
    unsniffed_port_is_connected_first,
);
