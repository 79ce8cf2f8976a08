//! The DNS service end to end: an engine over a TUN in the client namespace
//! answers the app's queries to the hijacked address, forwarding to an
//! in-process DNS server in the server namespace (testkit::dns) that counts
//! what reaches it. Cache, timeouts, failover, fake-ip (with a SOCKS5
//! outbound that records the domain it is given), pool exhaustion,
//! malformed queries, DNS over TCP from 2 000 attackers against the iOS
//! budget, DNS over TLS (feature `dot`) and DNS over HTTPS through a SOCKS5
//! outbound (feature `doh`), and the `"platform"` upstream following the
//! DNS servers `Engine::network_changed` reports.
//!
//! Needs root (CI runs as root); otherwise each test prints why it skipped.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use kerntun::budget::{Budget, Platform};
use kerntun::config::{Config, DriverMode, OutboundUdp, StackKind};
use kerntun::network::{DefaultInterface, NetworkInfo};
use kerntun::rules::{Action, Rule};
use kerntun::{Engine, TunSource};
use kerntun_testkit::child::{self, EngineProcess};
use kerntun_testkit::dns::{self, DnsServer, Socks5Recorder, Zone};
use kerntun_testkit::rig::{self, RESOLVER, Rig, RigBuilder};
use kerntun_testkit::{CLIENT_VETH, Topology, require_root, root_topology};

const WAIT: Duration = Duration::from_secs(3);

/// An engine whose DNS service answers the app at [`RESOLVER`], asking
/// `upstreams`, and gives up on an upstream after 500 ms unless the test
/// says otherwise.
fn rig<'a>(upstreams: Vec<String>) -> RigBuilder<'a> {
    Rig::builder()
        .driver(DriverMode::PerPacket)
        .dns(upstreams)
        .config(|_, c| c.dns.timeout_ms = 500)
}

fn upstream(topo: &Topology, zone: Zone) -> DnsServer {
    DnsServer::start(&topo.server, topo.server_addr(false, 53), zone).expect("dns server")
}

fn ask(q: &[u8]) -> Message {
    dns::ask_udp(RESOLVER, q, WAIT)
        .expect("ask")
        .expect("an answer")
}

#[test]
fn hijacked_udp_query_is_answered_and_cached_for_its_ttl() {
    let topo = root_topology!();
    let web: IpAddr = "198.19.7.7".parse().expect("ip");
    let srv = upstream(&topo, Zone::new(2).with("www.test", web));
    let rig = rig(vec![format!("udp://{}", srv.addr)]).start_in(topo);

    let r = ask(&dns::query("www.test", RecordType::A, 0x1234));
    assert_eq!(r.metadata.id, 0x1234);
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    assert_eq!(dns::first_addr(&r), Some(web));
    assert_eq!(srv.queries(), 1);

    // Again, other case and ID: from the cache, not seen upstream.
    let r = ask(&dns::query("WWW.Test", RecordType::A, 0x4321));
    assert_eq!(r.metadata.id, 0x4321);
    assert_eq!(dns::first_addr(&r), Some(web));
    assert!(r.answers[0].ttl <= 2);
    assert_eq!(srv.queries(), 1, "answered from the cache");
    let s = rig.stats();
    assert_eq!(s.dns.queries, 2);
    assert_eq!(s.dns.cache_hits, 1);

    // After the TTL the upstream is asked again.
    std::thread::sleep(Duration::from_millis(2_100));
    let r = ask(&dns::query("www.test", RecordType::A, 7));
    assert_eq!(dns::first_addr(&r), Some(web));
    assert_eq!(srv.queries(), 2, "expired entry asked upstream");

    // NXDOMAIN is cached by the SOA's negative TTL.
    let r = ask(&dns::query("nope.test", RecordType::A, 8));
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    let r = ask(&dns::query("nope.test", RecordType::A, 9));
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    assert_eq!(srv.queries(), 3);
    assert_eq!(rig.stats().dns.cache_hits, 2);
}

/// DNS over TLS to the hijacked address is reset at once, so a resolver
/// that tries it first falls back to port 53 (`dns.reset_dot`, on by
/// default), and counted; port 53 there keeps answering.
#[test]
fn dot_to_the_hijacked_address_is_reset_and_port_53_answers() {
    let topo = root_topology!();
    let web: IpAddr = "198.19.7.8".parse().expect("ip");
    let srv = upstream(&topo, Zone::new(60).with("dot.test", web));
    let rig = rig(vec![format!("udp://{}", srv.addr)]).start_in(topo);
    let dot = SocketAddr::new(RESOLVER.ip(), 853);
    let t0 = Instant::now();
    let err = std::net::TcpStream::connect_timeout(&dot, WAIT).expect_err("reset");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "at once: {:?}",
        t0.elapsed()
    );
    // Counted in the drain that wrote the RST, published at its end: it
    // can trail the app's refused connect.
    rig.wait_until("the reset counted", Duration::from_secs(2), |s| {
        s.drop_count("dns_tls_reset") == 1
    });
    let r = ask(&dns::query("dot.test", RecordType::A, 5));
    assert_eq!(dns::first_addr(&r), Some(web));
}

/// `dns.strategy`: with `ipv4_only` an AAAA query through the hijacked
/// address gets NOERROR with zero answers, over UDP and TCP, without
/// reaching the upstream (which has an AAAA record for the name), while A
/// is answered as before; with the default (`auto`) on a TUN without IPv6
/// the same holds, and `dual_stack` there passes the AAAA answer on.
#[test]
fn aaaa_is_answered_empty_when_the_strategy_leaves_ipv6_out() {
    require_root!();
    use kerntun::config::DnsStrategy;
    let v4: IpAddr = "198.19.7.9".parse().expect("ip");
    let v6: IpAddr = "fd00:19::9".parse().expect("ip");
    let zone = || Zone::new(60).with("both.test", v4).with("both.test", v6);
    let empty = |r: &Message, id: u16| {
        assert_eq!(r.metadata.id, id);
        assert_eq!(r.metadata.response_code, ResponseCode::NoError, "{r:?}");
        assert_eq!(r.answers.len(), 0, "{r:?}");
    };
    // (tun with IPv6, strategy, AAAA answered empty)
    for (tun6, strategy, left_out) in [
        (true, DnsStrategy::Ipv4Only, true),
        (false, DnsStrategy::Auto, true),
        (false, DnsStrategy::DualStack, false),
    ] {
        let case = format!("tun6 {tun6}, {strategy:?}");
        let topo = Topology::new().expect("topology");
        let srv = upstream(&topo, zone());
        let b =
            rig(vec![format!("udp://{}", srv.addr)]).config(move |_, c| c.dns.strategy = strategy);
        let rig = if tun6 { b } else { b.ipv4_only() }.start_in(topo);
        let r = ask(&dns::query("both.test", RecordType::AAAA, 21));
        let tcp = dns::ask_tcp(
            RESOLVER,
            &[dns::query("both.test", RecordType::AAAA, 22)],
            WAIT,
        )
        .expect("ask over TCP");
        if left_out {
            empty(&r, 21);
            empty(&tcp[0], 22);
            assert_eq!(srv.queries(), 0, "{case}: the upstream is not asked");
            assert_eq!(rig.stats().dns.strategy_empty, 2, "{case}");
        } else {
            assert_eq!(dns::first_addr(&r), Some(v6), "{case}: {r:?}");
            assert_eq!(dns::first_addr(&tcp[0]), Some(v6), "{case}");
            assert_eq!(rig.stats().dns.strategy_empty, 0, "{case}");
        }
        let r = ask(&dns::query("both.test", RecordType::A, 23));
        assert_eq!(dns::first_addr(&r), Some(v4), "{case}: {r:?}");
        assert!(srv.queries() >= 1, "{case}");
    }
}

#[test]
fn upstream_down_is_servfail_within_the_timeout() {
    let topo = root_topology!();
    let srv = upstream(
        &topo,
        Zone::new(60).with("a.test", "198.19.1.1".parse().expect("ip")),
    );
    srv.set_silent(true);
    let rig = rig(vec![format!("udp://{}", srv.addr)])
        .config(|_, c| c.dns.timeout_ms = 400)
        .start_in(topo);
    let t0 = Instant::now();
    let r = ask(&dns::query("a.test", RecordType::A, 77));
    let took = t0.elapsed();
    assert_eq!(r.metadata.id, 77);
    assert_eq!(r.metadata.response_code, ResponseCode::ServFail);
    assert!(
        took >= Duration::from_millis(380) && took < Duration::from_millis(1_400),
        "SERVFAIL after the 400 ms try, took {took:?}"
    );
    assert_eq!(srv.queries(), 1);
    let s = rig.stats();
    assert_eq!(s.dns.servfail, 1);
    assert_eq!(s.dns.upstream_failures, 1);
}

#[test]
fn failover_to_the_next_upstream_over_tcp() {
    let topo = root_topology!();
    let ip: IpAddr = "198.19.2.2".parse().expect("ip");
    let dead = DnsServer::start(&topo.server, topo.server_addr(false, 5353), Zone::new(60))
        .expect("dns server");
    dead.set_silent(true);
    let good = upstream(&topo, Zone::new(60).with("b.test", ip));
    let ups = vec![
        format!("udp://{}", dead.addr),
        format!("tcp://{}", good.addr),
    ];
    let rig = rig(ups)
        .config(|_, c| c.dns.timeout_ms = 300)
        .start_in(topo);
    let t0 = Instant::now();
    let r = ask(&dns::query("b.test", RecordType::A, 5));
    assert!(
        t0.elapsed() >= Duration::from_millis(280),
        "the first try timed out"
    );
    assert_eq!(dns::first_addr(&r), Some(ip));
    assert_eq!((dead.queries(), good.queries()), (1, 1));
    let s = rig.stats();
    assert_eq!(s.dns.upstream_failures, 1);
    assert_eq!(s.dns.servfail, 0);
}

#[test]
fn malformed_packets_are_counted_drops() {
    let topo = root_topology!();
    let srv = upstream(&topo, Zone::new(60));
    let rig = rig(vec![format!("udp://{}", srv.addr)]).start_in(topo);
    let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
    s.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    s.connect(RESOLVER).expect("connect");
    s.send(b"definitely not dns").expect("send");
    // A response is not a query either.
    let mut resp = dns::query("x.test", RecordType::A, 1);
    resp[2] |= 0x80;
    s.send(&resp).expect("send");
    let mut buf = [0u8; 512];
    assert!(
        kerntun_testkit::uninterrupted(|| s.recv(&mut buf)).is_err(),
        "no answer to garbage"
    );
    rig.wait_until("malformed queries counted", WAIT, |s| s.dns.malformed >= 2);
    assert_eq!(srv.queries(), 0);
    // The service still answers afterwards.
    let r = ask(&dns::query("x.test", RecordType::A, 2));
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
}

/// A socks5 outbound `proxy` for domains; everything else direct.
fn fake_ip_rig(topo: Topology, pool: &str, proxy: SocketAddr, upstream: String) -> Rig {
    let pool = pool.parse().expect("pool");
    rig(vec![upstream])
        .config(move |_, c| {
            c.dns.fake_ip = true;
            c.dns.fake_ip_pool = pool;
            c.dns.fake_ip_filter = vec!["real.test".into()];
        })
        .outbound("proxy", rig::socks5(proxy, None, OutboundUdp::Relay))
        // Domains (fake addresses) go to the proxy; the upstream's address
        // has none and stays direct.
        .rule(Rule {
            domain_suffix: vec!["com".into(), "test".into()],
            action: Action::from("proxy"),
            ..Rule::default()
        })
        .start_in(topo)
}

#[test]
fn fake_ip_answer_then_udp_through_socks5_names_the_domain() {
    let topo = root_topology!();
    let real: IpAddr = "198.19.3.3".parse().expect("ip");
    let srv = upstream(&topo, Zone::new(60).with("www.real.test", real));
    let socks = Socks5Recorder::start(&topo.server, topo.server_addr(false, 1080)).expect("socks");
    let rig = fake_ip_rig(
        topo,
        "198.18.128.0/17",
        socks.addr,
        format!("udp://{}", srv.addr),
    );
    let r = ask(&dns::query("Video.Example.com", RecordType::A, 1));
    let Some(IpAddr::V4(fake)) = dns::first_addr(&r) else {
        panic!("an A answer: {r:?}")
    };
    assert!(
        "198.18.128.0/17"
            .parse::<ipnet::Ipv4Net>()
            .expect("net")
            .contains(&fake)
    );
    assert!(r.answers[0].ttl <= 1);
    assert_eq!(srv.queries(), 0, "fake answers ask no upstream");
    // Same domain, same address.
    let again = ask(&dns::query("video.example.com", RecordType::A, 2));
    assert_eq!(dns::first_addr(&again), Some(IpAddr::V4(fake)));
    // Filtered: the real address.
    let r = ask(&dns::query("www.real.test", RecordType::A, 3));
    assert_eq!(dns::first_addr(&r), Some(real));
    let s = rig.stats();
    assert_eq!(s.dns.fakeip_answers, 2);
    assert_eq!(s.dns.fakeip_active, 1);

    // A datagram to the fake address goes to the proxy with the domain and
    // the reply comes back from the fake address.
    let u = UdpSocket::bind("0.0.0.0:0").expect("bind");
    u.set_read_timeout(Some(WAIT)).expect("timeout");
    let to = SocketAddr::new(IpAddr::V4(fake), 7000);
    let mut got = None;
    for _ in 0..3 {
        u.send_to(b"hello fake", to).expect("send");
        let mut buf = [0u8; 64];
        if let Ok((n, from)) = kerntun_testkit::uninterrupted(|| u.recv_from(&mut buf)) {
            got = Some((buf[..n].to_vec(), from));
            break;
        }
    }
    let Some((payload, from)) = got else {
        panic!(
            "no echo through the proxy; proxy asked {:?}; {:?}",
            socks.asked(),
            rig.stats()
        )
    };
    assert_eq!(payload, b"hello fake");
    assert_eq!(from, to, "the reply comes from the fake address");
    assert!(
        socks.asked().iter().any(|a| a == "video.example.com:7000"),
        "the proxy was given the domain: {:?}",
        socks.asked()
    );
}

// ---- Hostile DNS over TCP, the engine in a process of its own --------------

/// Set in the child: the engine's TUN name and its upstream, space apart.
const ENGINE_CHILD: &str = "KERNTUN_DNS_ENGINE_CHILD";
/// The attack: this many connections to the hijacked address, each
/// announcing a query of [`ANNOUNCED`] bytes, sending [`SENT`] of them and
/// stalling.
const ATTACKERS: usize = 2_000;
const ANNOUNCED: u16 = 65_535;
const SENT: usize = 65_000;
/// The test's own name, which the child runs again.
const ATTACK_TEST: &str = "tcp_queries_announced_past_the_cap_hold_no_memory_under_the_ios_budget";

/// The engine's side: the iOS budget, the system stack, [`RESOLVER`]
/// hijacked and answered from `upstream`. Says READY with its TUN's name,
/// answers `stats` lines, stops when stdin closes.
fn engine_child(arg: &str) {
    let (tun, upstream) = arg.split_once(' ').expect("tun and upstream");
    let mut c = Config {
        stack: StackKind::System,
        driver: DriverMode::PerPacket,
        ..Config::default()
    };
    c.budget.platform = Some(Platform::Ios);
    c.tun.name = tun.into();
    c.tun.mtu = Platform::Ios.default_mtu();
    c.tun.ipv4 = Some("198.18.0.1/16".parse().expect("net"));
    c.direct.interface = Some(kerntun_testkit::CLIENT_VETH.into());
    c.direct.connect_timeout_ms = 2_000;
    c.dns.enabled = true;
    c.dns.hijack = vec![RESOLVER.ip()];
    c.dns.upstreams = vec![format!("udp://{upstream}")];
    c.dns.timeout_ms = 1_000;
    let engine = Engine::start(c, TunSource::Create, None).expect("engine");
    child::serve(engine, |s| {
        vec![
            s.dns.tcp_queries,
            s.drop_count("dns_query_too_long"),
            s.drop_count("dns_queue_full"),
            s.admission_refused,
            s.dns.queries,
        ]
    });
}

/// TCP queries, `dns_query_too_long`, `dns_queue_full`, admission
/// refusals and all queries, as the engine counts them.
fn attack_stats(engine: &mut EngineProcess) -> [u64; 5] {
    engine.stats().try_into().expect("five numbers")
}

/// Resident memory of process `pid`, in KiB (0 once it is gone).
fn rss_kib(pid: u32) -> u64 {
    kerntun_testkit::vm_kib(Some(pid), "VmRSS").unwrap_or(0)
}

/// Enough descriptors for the attack's connections (root may raise it).
fn raise_nofile() {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let soft: u64 = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if soft < 8192 {
        let pid = std::process::id().to_string();
        kerntun_testkit::sh("prlimit", &["--pid", &pid, "--nofile=8192:8192"])
            .expect("raise RLIMIT_NOFILE");
    }
}

/// One attacker: connect to the hijacked address over TCP, announce
/// [`ANNOUNCED`] bytes, send up to [`SENT`] of them (for at most half a
/// second) and keep the connection open. `None` when it did not connect.
fn attack_once() -> Option<std::net::TcpStream> {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect_timeout(&RESOLVER, Duration::from_secs(3)).ok()?;
    s.set_write_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let mut w = ANNOUNCED.to_be_bytes().to_vec();
    w.resize(2 + SENT, 0x5a);
    // Closed by the engine (a reset) or stalled (the timeout): either way
    // the connection is held as it is.
    let _ = s.write_all(&w);
    Some(s)
}

/// The UDP and TCP answers to a fresh question for `name`.
fn ask_both(name: &str, id: u16) -> (Option<IpAddr>, Option<IpAddr>) {
    let q = dns::query(name, RecordType::A, id);
    let udp = dns::ask_udp(RESOLVER, &q, WAIT).ok().flatten();
    let tcp = dns::ask_tcp(RESOLVER, &[q], WAIT)
        .ok()
        .and_then(|mut r| r.pop());
    (
        udp.as_ref().and_then(dns::first_addr),
        tcp.as_ref().and_then(dns::first_addr),
    )
}

/// DNS over TCP as an attacker speaks it, against an engine under the iOS
/// budget (in a process of its own, so its memory is read alone): 2 000
/// connections to the hijacked address, each announcing a 65 535-byte
/// query, sending 65 000 bytes of it and stalling. The engine's resident
/// memory grows by no more than `Budget::worst_case` allows in all, and
/// fresh questions over UDP and TCP are answered while the attackers hold
/// their connections. (Each such query used to get a buffer of the length
/// announced, uncharged, filled as the bytes came, for up to the 10 s the
/// service waits for the rest: the engine's RSS grew by 60.6 and 67.7
/// MiB in two runs here, against a worst case of 25.5.)
#[test]
fn tcp_queries_announced_past_the_cap_hold_no_memory_under_the_ios_budget() {
    if let Some(arg) = std::env::var_os(ENGINE_CHILD) {
        return engine_child(&arg.to_string_lossy());
    }
    require_root!();
    raise_nofile();
    let t0 = Instant::now();
    let worst_case: usize = Budget::for_platform(Platform::Ios)
        .worst_case(Platform::Ios.default_mtu())
        .iter()
        .map(|r| r.1)
        .sum();
    let topo = Topology::new().expect("topology");
    let (warm, fresh): (IpAddr, IpAddr) = (
        "198.19.9.1".parse().expect("ip"),
        "198.19.9.2".parse().expect("ip"),
    );
    let srv = upstream(
        &topo,
        Zone::new(60)
            .with("warm.test", warm)
            .with("fresh.test", fresh),
    );
    topo.client.enter().expect("enter client ns");
    let mut engine = EngineProcess::start(
        ATTACK_TEST,
        (ENGINE_CHILD, &format!("kt{} {}", topo.id, srv.addr)),
        &[],
    );
    let tun = engine.line();
    let tun = tun.strip_prefix("READY ").expect("ready line");
    topo.route_via_tun(tun).expect("routes");
    assert_eq!(
        ask_both("warm.test", 1),
        (Some(warm), Some(warm)),
        "warm-up"
    );
    let pid = engine.pid();
    let rss0 = rss_kib(pid);

    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_kib(pid));
                std::thread::sleep(Duration::from_millis(10));
            }
            peak
        })
    };
    // Many at once: most of an attacker's time is waiting for the engine.
    let threads = 40;
    // Bounded: attackers still to start after 40 s are not started (the
    // test then fails, saying so).
    let deadline = Instant::now() + Duration::from_secs(40);
    let attackers: Vec<_> = (0..threads)
        .map(|_| {
            let ns = &topo.client;
            ns.spawn(move || {
                let mut ran = 0;
                let mut held = Vec::new();
                while ran < ATTACKERS / threads && Instant::now() < deadline {
                    ran += 1;
                    held.extend(attack_once());
                }
                (ran, held)
            })
            .expect("attacker thread")
        })
        .collect();
    let (mut ran, mut held) = (0, Vec::new());
    for h in attackers {
        let (r, hs) = h.join().expect("attacker");
        ran += r;
        held.extend(hs);
    }
    let attack_took = t0.elapsed();
    // The attackers still hold their connections: fresh questions.
    let during = ask_both("fresh.test", 2);
    let [tcp_queries, too_long, queue_full, refused, queries] = attack_stats(&mut engine);
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.join().expect("sampler");
    let grown = usize::try_from(peak.saturating_sub(rss0) * 1024).unwrap_or(usize::MAX);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!(
        "[dns] {ran} attackers ({threads} threads, {} connected) in {attack_took:?}: engine RSS {rss0} -> {peak} KiB \
         (+{:.1} MiB, worst case {:.1} MiB); tcp_queries {tcp_queries}, dns_query_too_long {too_long}, \
         dns_queue_full {queue_full}, admission_refused {refused}, queries {queries}; \
         fresh answers during the attack (udp, tcp) {during:?}; load {}",
        held.len(),
        grown as f64 / 1048576.0,
        worst_case as f64 / 1048576.0,
        load.trim_end(),
    );
    assert!(
        grown <= worst_case,
        "engine RSS grew {grown} B, over the iOS budget's worst case {worst_case} B"
    );
    assert_eq!(
        during,
        (Some(fresh), Some(fresh)),
        "fresh questions answered"
    );
    assert_eq!(ran, ATTACKERS, "attackers started within 40 s");
    assert!(
        too_long + refused >= held.len() as u64 * 9 / 10,
        "each attacker closed unread or refused: {too_long} + {refused} of {}",
        held.len()
    );
    drop(held);
}

/// A full pool whose addresses were all used within the grace period
/// hands none of them to a new domain: it gets the real answer (here the
/// upstream's NXDOMAIN), counted, and the least recently used domain keeps
/// its address. An address no domain holds is a counted drop.
#[test]
fn fake_ip_pool_exhaustion_answers_the_real_address_and_unknown_addresses_drop() {
    let topo = root_topology!();
    let srv = upstream(&topo, Zone::new(60));
    let socks = Socks5Recorder::start(&topo.server, topo.server_addr(false, 1080)).expect("socks");
    // A /29: six usable addresses.
    let rig = fake_ip_rig(
        topo,
        "198.18.200.0/29",
        socks.addr,
        format!("udp://{}", srv.addr),
    );
    let mut addrs = Vec::new();
    for i in 0..6 {
        let r = ask(&dns::query(&format!("d{i}.test"), RecordType::A, i));
        addrs.push(dns::first_addr(&r).expect("fake"));
    }
    let mut unique = addrs.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 6);
    assert_eq!(rig.stats().dns.fakeip_evictions, 0);
    // Refresh d0: d1 is now the least recently used, but used just now.
    let r = ask(&dns::query("d0.test", RecordType::A, 100));
    assert_eq!(dns::first_addr(&r), Some(addrs[0]));
    assert_eq!(srv.queries(), 0);
    let r = ask(&dns::query("new.test", RecordType::A, 101));
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    assert_eq!(dns::first_addr(&r), None, "not d1's address: {r:?}");
    assert_eq!(srv.queries(), 1, "asked upstream");
    let s = rig.stats();
    assert_eq!(s.dns.fakeip_evictions, 0);
    assert_eq!(s.dns.fakeip_fallbacks, 1);
    assert_eq!(s.dns.fakeip_active, 6);
    let r = ask(&dns::query("d1.test", RecordType::A, 102));
    assert_eq!(dns::first_addr(&r), Some(addrs[1]), "d1 keeps its address");

    // The pool's last address (the broadcast of the /29) was never handed
    // out: a datagram to it is a counted drop, not a flow.
    let u = UdpSocket::bind("0.0.0.0:0").expect("bind");
    u.send_to(b"x", "198.18.200.7:9000").expect("send");
    rig.wait_until("the drop counted", WAIT, |s| {
        s.drop_count("fake_ip_unknown") >= 1
    });
    assert!(socks.asked().is_empty());
}

/// The network the engine's sockets leave on (the topology's veth), with
/// `dns` as its DNS servers.
fn network_with_dns(dns: &[IpAddr]) -> NetworkInfo {
    NetworkInfo {
        interface: Some(DefaultInterface {
            name: CLIENT_VETH.into(),
            index: 0,
        }),
        has_ipv4: true,
        dns_servers: dns.to_vec(),
        ..NetworkInfo::default()
    }
}

/// `upstreams = ["platform", fallback]`, with a rule that rejects the
/// server namespace's IPv4 /24, where the network's DNS servers are: the
/// `"platform"` entry asks the servers the last `network_changed` named,
/// sent direct whatever the rules say, and follows a second report to
/// another server; before any report, and after one without a usable
/// server, it yields nothing (counted) and the fallback answers.
#[test]
fn the_platform_upstream_asks_the_servers_the_network_reported() {
    let topo = root_topology!();
    let first_ip = IpAddr::V4(topo.server_v4());
    let second_ip = IpAddr::V4(std::net::Ipv4Addr::new(198, 19, topo.id as u8, 3));
    topo.server
        .ip(&["addr", "add", &format!("{second_ip}/24"), "dev", "kts"])
        .expect("a second server address");
    let answer = |last: u8| IpAddr::V4(std::net::Ipv4Addr::new(198, 19, 99, last));
    let zone = |last: u8| Zone::new(60).with("who.test", answer(last));
    let first = DnsServer::start(&topo.server, SocketAddr::new(first_ip, 53), zone(1))
        .expect("the first network's dns");
    let second = DnsServer::start(&topo.server, SocketAddr::new(second_ip, 53), zone(2))
        .expect("the second network's dns");
    let fallback = DnsServer::start(&topo.server, topo.server_addr(true, 5353), zone(3))
        .expect("the configured upstream");
    let v4_net = format!("198.19.{}.0/24", topo.id);
    let rig = rig(vec!["platform".into(), format!("udp://{}", fallback.addr)])
        .rule(Rule {
            cidr: Some(v4_net.parse().expect("the server's /24")),
            action: Action::Reject,
            ..Rule::default()
        })
        .start_in(topo);
    let who = |id: u16| dns::first_addr(&ask(&dns::query("who.test", RecordType::A, id)));

    // No network reported yet: the entry yields nothing, the fallback answers.
    assert_eq!(who(1), Some(answer(3)));
    assert_eq!(
        (first.queries(), second.queries(), fallback.queries()),
        (0, 0, 1)
    );
    assert_eq!(rig.stats().dns.platform_unavailable, 1);

    // The network names the first server: asked (the report forgot the
    // cached answer), direct although the rules reject its address.
    assert!(
        rig.engine
            .network_changed(network_with_dns(&[first_ip]))
            .expect("running")
    );
    assert_eq!(who(2), Some(answer(1)));
    assert_eq!(
        (first.queries(), second.queries(), fallback.queries()),
        (1, 0, 1)
    );

    // Another network, another server: that one is asked, no restart.
    let loopback: IpAddr = "127.0.0.1".parse().expect("ip");
    let report = network_with_dns(&[loopback, second_ip]);
    assert!(rig.engine.network_changed(report).expect("running"));
    assert_eq!(who(3), Some(answer(2)));
    assert_eq!(
        (first.queries(), second.queries(), fallback.queries()),
        (1, 1, 1)
    );

    // A network without a usable server (loopback is left out): the
    // fallback again, counted.
    let report = network_with_dns(&[loopback]);
    assert!(rig.engine.network_changed(report).expect("running"));
    assert_eq!(who(4), Some(answer(3)));
    assert_eq!(
        (first.queries(), second.queries(), fallback.queries()),
        (1, 1, 2)
    );
    let s = rig.stats();
    assert_eq!(s.dns.platform_unavailable, 2, "{s:?}");
    assert_eq!(s.dns.upstream_failures, 0, "{s:?}");
    assert_eq!(s.dns.servfail, 0, "{s:?}");
}

/// `"platform"` alone, before the host reported a network: the query
/// fails at once as with an unreachable upstream (SERVFAIL), counted.
#[test]
fn the_platform_upstream_alone_without_a_network_is_servfail() {
    let topo = root_topology!();
    let rig = rig(vec!["platform".to_string()]).start_in(topo);
    let t0 = Instant::now();
    let r = ask(&dns::query("who.test", RecordType::A, 9));
    assert_eq!(r.metadata.id, 9);
    assert_eq!(r.metadata.response_code, ResponseCode::ServFail);
    assert!(
        t0.elapsed() < Duration::from_millis(400),
        "no upstream waited on: {:?}",
        t0.elapsed()
    );
    let s = rig.stats();
    assert_eq!(s.dns.platform_unavailable, 1, "{s:?}");
    assert_eq!(s.dns.servfail, 1, "{s:?}");
}

#[cfg(feature = "dot")]
mod dot {
    use super::*;
    use kerntun_testkit::tokio_servers::{InProcess, in_process, listen};
    use std::sync::Arc;

    /// A DNS-over-TLS server (rustls, a certificate for `dns.test` signed by
    /// a CA written to `ca_path`) in front of `zone`.
    fn dot_server(
        ns: &kerntun_testkit::Netns,
        addr: SocketAddr,
        zone: Zone,
        ca_path: &std::path::Path,
    ) -> InProcess {
        use tokio_rustls::rustls;
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).expect("ca");
        std::fs::write(ca_path, ca.pem()).expect("write ca");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["dns.test".to_owned()])
            .expect("params")
            .signed_by(&key, &rcgen::Issuer::new(ca_params, ca_key))
            .expect("cert");
        let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls_pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        in_process(ns, move |ready, _| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let Some(l) = listen(addr, &ready).await else {
                return;
            };
            while let Ok((s, _)) = l.accept().await {
                let (acceptor, zone) = (acceptor.clone(), zone.clone());
                tokio::spawn(async move {
                    let Ok(mut t) = acceptor.accept(s).await else {
                        return;
                    };
                    let mut len = [0u8; 2];
                    while t.read_exact(&mut len).await.is_ok() {
                        let mut q = vec![0u8; usize::from(u16::from_be_bytes(len))];
                        if t.read_exact(&mut q).await.is_err() {
                            return;
                        }
                        let Some(r) = zone.answer(&q) else { return };
                        let mut f = (r.len() as u16).to_be_bytes().to_vec();
                        f.extend_from_slice(&r);
                        if t.write_all(&f).await.is_err() {
                            return;
                        }
                    }
                });
            }
        })
    }

    #[test]
    fn dns_over_tls_upstream_with_a_private_ca() {
        let topo = root_topology!();
        let ip: IpAddr = "198.19.5.5".parse().expect("ip");
        let ca = std::env::temp_dir().join(format!("kerntun-dot-ca-{}.pem", std::process::id()));
        let addr = topo.server_addr(false, 853);
        let server = dot_server(
            &topo.server,
            addr,
            Zone::new(60).with("secure.test", ip),
            &ca,
        );
        let ca2 = ca.clone();
        let rig = rig(vec![format!("tls://{addr}#dns.test")])
            .config(move |_, c| {
                c.dns.tls_ca_file = Some(ca2);
                c.dns.timeout_ms = 2_000;
            })
            .start_in(topo);
        let r = ask(&dns::query("secure.test", RecordType::A, 42));
        assert_eq!(r.metadata.id, 42);
        assert_eq!(dns::first_addr(&r), Some(ip));
        assert_eq!(rig.stats().dns.upstream_failures, 0);
        drop(server);
        let _ = std::fs::remove_file(&ca);
    }
}

#[cfg(feature = "doh")]
mod doh {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;

    use kerntun_testkit::dns::DohServer;
    use kerntun_testkit::tokio_servers::{Socks5Options, socks5_server_with};

    #[test]
    fn dns_over_https_through_socks5_shares_one_connection() {
        let topo = root_topology!();
        let (one, two, three): (IpAddr, IpAddr, IpAddr) = (
            "198.19.6.1".parse().expect("ip"),
            "198.19.6.2".parse().expect("ip"),
            "198.19.6.3".parse().expect("ip"),
        );
        let zone = Zone::new(60)
            .with("one.test", one)
            .with("two.test", two)
            .with("three.test", three);
        let doh_addr = topo.server_addr(false, 443);
        let server =
            DohServer::start(&topo.server, doh_addr, "dns.test", "/q", zone).expect("doh server");
        // fast-socks5, CONNECT only; `relayed` counts the CONNECTs.
        let proxy = socks5_server_with(
            &topo.server,
            topo.server_addr(false, 1080),
            Socks5Options {
                connect_timeout: Duration::from_secs(5),
                ..Socks5Options::default()
            },
        );
        let ca = std::env::temp_dir().join(format!("kerntun-doh-ca-{}.pem", std::process::id()));
        std::fs::write(&ca, &server.ca_pem).expect("write ca");
        let (ca2, proxy_addr) = (ca.clone(), topo.server_addr(false, 1080));
        let rig = rig(vec![format!("https://{doh_addr}/q#dns.test")])
            .config(move |_, c| {
                c.dns.tls_ca_file = Some(ca2);
                c.dns.timeout_ms = 3_000;
            })
            .outbound("proxy", rig::socks5(proxy_addr, None, OutboundUdp::Refuse))
            // The upstream's address goes through the proxy.
            .rule(Rule {
                cidr: Some(format!("{}/32", doh_addr.ip()).parse().expect("net")),
                action: Action::from("proxy"),
                ..Rule::default()
            })
            .start_in(topo);
        // Two queries: answered through the proxy, one TCP connection and
        // one HTTP/2 connection for both.
        let r = ask(&dns::query("one.test", RecordType::A, 7));
        assert_eq!(r.metadata.id, 7);
        assert_eq!(dns::first_addr(&r), Some(one));
        let r = ask(&dns::query("two.test", RecordType::A, 8));
        assert_eq!(r.metadata.id, 8);
        assert_eq!(dns::first_addr(&r), Some(two));
        assert_eq!(server.queries(), 2);
        assert_eq!(server.connections(), 1, "both queries on one connection");
        assert_eq!(
            proxy.relayed.load(Relaxed),
            1,
            "one CONNECT through the proxy"
        );
        assert_eq!(rig.stats().dns.upstream_failures, 0);

        // The server closes its connections: the next query notices and
        // makes a new one, through the proxy again.
        server.drop_connections();
        let r = ask(&dns::query("three.test", RecordType::A, 9));
        assert_eq!(r.metadata.id, 9);
        assert_eq!(dns::first_addr(&r), Some(three));
        assert_eq!(server.queries(), 3);
        assert_eq!(server.connections(), 2, "a new connection");
        assert_eq!(proxy.relayed.load(Relaxed), 2);
        assert_eq!(rig.stats().dns.upstream_failures, 0);
        drop(server);
        let _ = std::fs::remove_file(&ca);
    }
}
