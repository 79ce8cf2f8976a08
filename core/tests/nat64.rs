//! IPv4 from an IPv6-only network through NAT64 (`core/src/outbound/nat64.rs`).
//!
//! The engine's namespace has no IPv4 address or route on its uplink; a
//! userspace translator (`testkit/src/nat64.rs`) behind it reaches an
//! IPv4-only namespace through 64:ff9b::/96, and a DNS64 answers
//! `ipv4only.arpa` there. A Shadowsocks proxy given as an IPv4 literal
//! (TCP and UDP) and by a name with only an A record (TCP), a direct IPv4
//! TCP server and a direct IPv4 UDP server are
//! reached byte-exact once the host reports the IPv6-only network and the
//! prefix is found; before that, while the DNS64 does not answer, and
//! again once the host says the network has IPv4, the same connections
//! fail: without the NAT64 support nothing here is reachable.
//!
//! Needs root (namespaces, TUN); otherwise each test prints why it skipped.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use kerntun::config::{
    OutboundConfig, OutboundUdp, ShadowsocksConfig, ShadowsocksMethod, StackKind,
};
use kerntun::network::{DefaultInterface, NetworkInfo};
use kerntun::outbound::Address;
use kerntun::rules::{Action, PortRange, Rule};
use kerntun_testkit::dns::{DnsServer, Zone};
use kerntun_testkit::nat64::Nat64Net;
use kerntun_testkit::rig::Rig;
use kerntun_testkit::servers::{self, Mode};
use kerntun_testkit::tokio_servers::shadowsocks;
use kerntun_testkit::{CLIENT_VETH, Topology, client, root_tests};

const MIB: usize = 1024 * 1024;
/// The Shadowsocks server's port (TCP and UDP).
const SS_PORT: u16 = 8388;
/// Reached direct.
const DIRECT_TCP: u16 = 7001;
const DIRECT_UDP: u16 = 7002;
/// Routed to the proxy by the rule below.
const PROXIED_TCP: u16 = 7003;
const PROXIED_UDP: u16 = 7004;
/// Routed to the same proxy given by a name with only an A record.
const BY_NAME_TCP: u16 = 7005;
const PASSWORD: &str = "kerntun-nat64";

fn info(topo: &Topology, has_ipv4: bool) -> NetworkInfo {
    NetworkInfo {
        interface: Some(DefaultInterface {
            name: CLIENT_VETH.into(),
            index: 0,
        }),
        has_ipv4,
        has_ipv6: true,
        dns_servers: vec![IpAddr::V6(topo.server_v6())],
        expensive: true,
        constrained: false,
    }
}

/// Whether a short TCP echo to `to` goes through.
fn tcp_reaches(to: SocketAddr) -> bool {
    client::echo_transfer(to, 9, 1000, false).is_ok()
}

fn ipv4_through_nat64(stack: StackKind) {
    let topo = Topology::new().expect("topology");
    let net = Nat64Net::new(&topo).expect("the IPv6-only uplink and the v4 namespace");
    let direct = servers::tcp(&net.v4, net.server_addr(DIRECT_TCP), Mode::Echo).expect("tcp");
    let proxied = servers::tcp(&net.v4, net.server_addr(PROXIED_TCP), Mode::Echo).expect("tcp");
    let by_name = servers::tcp(&net.v4, net.server_addr(BY_NAME_TCP), Mode::Echo).expect("tcp");
    let direct_udp = servers::udp_echo(&net.v4, net.server_addr(DIRECT_UDP)).expect("udp");
    let proxied_udp = servers::udp_echo(&net.v4, net.server_addr(PROXIED_UDP)).expect("udp");
    let ss_addr = net.server_addr(SS_PORT);
    let ss = shadowsocks(&net.v4, ss_addr, "aes-256-gcm", PASSWORD);
    let translator = Nat64Net::translate(&topo, &[SS_PORT, DIRECT_TCP], &[SS_PORT, DIRECT_UDP]);
    let dns64 = DnsServer::start(
        &topo.server,
        SocketAddr::new(IpAddr::V6(topo.server_v6()), 53),
        Zone::new(300)
            .with_dns64()
            .with("ss.test", IpAddr::V4(net.server_v4())),
    )
    .expect("DNS64");
    let rig = Rig::builder()
        .stack(stack)
        .outbound(
            "ss",
            OutboundConfig::Shadowsocks(ShadowsocksConfig {
                server: ss_addr.into(),
                method: ShadowsocksMethod::Aes256Gcm,
                password: PASSWORD.into(),
                udp: OutboundUdp::Relay,
            }),
        )
        .outbound(
            "ss-name",
            OutboundConfig::Shadowsocks(ShadowsocksConfig {
                server: Address::Domain("ss.test".into(), SS_PORT),
                method: ShadowsocksMethod::Aes256Gcm,
                password: PASSWORD.into(),
                udp: OutboundUdp::Relay,
            }),
        )
        .rule(Rule {
            ports: Some(PortRange {
                start: PROXIED_TCP,
                end: PROXIED_UDP,
            }),
            action: Action::from("ss"),
            ..Rule::default()
        })
        .rule(Rule {
            ports: Some(PortRange {
                start: BY_NAME_TCP,
                end: BY_NAME_TCP,
            }),
            action: Action::from("ss-name"),
            ..Rule::default()
        })
        // One discovery try gives up after this.
        .config(|_, c| c.dns.timeout_ms = 500)
        .start_in(topo);
    let topo = &rig.topo;
    topo.client
        .route_host(IpAddr::V4(net.server_v4()), &rig.tun(), None)
        .expect("the v4 servers' address into the TUN");
    let (to_direct, to_proxied) = (direct.addr, proxied.addr);

    // No network reported: IPv4 has no route from the uplink.
    assert!(!tcp_reaches(to_direct), "direct IPv4 without a route");
    assert!(!tcp_reaches(to_proxied), "the proxy's IPv4 without a route");
    assert_eq!(rig.stats().nat64_prefix, None);

    // IPv6-only, but the DNS64 does not answer: no prefix, counted.
    dns64.set_silent(true);
    assert!(
        rig.engine
            .network_changed(info(topo, false))
            .expect("running")
    );
    rig.wait_until("the discovery gave up", Duration::from_secs(5), |s| {
        s.nat64_discovery_failed == 1
    });
    assert_eq!(rig.stats().nat64_prefix, None);
    assert!(!tcp_reaches(to_direct), "no prefix, no IPv4");

    // The same network reported again: nothing changed, but the prefix
    // is asked for again, and found.
    dns64.set_silent(false);
    assert!(
        !rig.engine
            .network_changed(info(topo, false))
            .expect("running")
    );
    rig.wait_until("the prefix found", Duration::from_secs(5), |s| {
        s.nat64_prefix.as_deref() == Some("64:ff9b::/96")
    });

    // Direct and through the proxy given as an IPv4 literal, TCP and UDP.
    client::echo_transfer(to_direct, 1, 2 * MIB, false).expect("direct TCP through NAT64");
    client::echo_transfer(to_proxied, 2, 2 * MIB, false).expect("Shadowsocks TCP through NAT64");
    // The name resolves (through the network's DNS server the host
    // reported) to an A record only: its address is synthesized too.
    client::echo_transfer(by_name.addr, 3, MIB, false).expect("Shadowsocks by name through NAT64");
    let ok = client::udp_round_trips(direct_udp.addr, 20, 1000).expect("direct UDP");
    assert_eq!(ok, 20, "direct UDP through NAT64");
    let ok = client::udp_round_trips(proxied_udp.addr, 20, 1000).expect("proxied UDP");
    assert_eq!(ok, 20, "Shadowsocks UDP through NAT64");
    let s = rig.stats();
    // One outbound socket each: the direct TCP connection, the proxy's
    // two TCP connections (by address, by name), the direct UDP flow, the
    // proxy's UDP association.
    assert_eq!(s.nat64_synthesized, 5, "{s:?}");
    assert_eq!(s.outbounds[1].tcp_connects, 1, "{s:?}");
    assert_eq!(
        (s.outbounds[0].tcp_connects, s.outbounds[0].udp_flows),
        (1, 1),
        "{s:?}"
    );
    assert_eq!(direct_udp.accepted.load(Relaxed), 20);
    assert_eq!(proxied_udp.accepted.load(Relaxed), 20);
    // The server's byte count is its library's flow statistic, sampled
    // every 10 ms (`tokio_servers::shadowsocks`): it may trail the echoes
    // the client already verified.
    let moved = kerntun_testkit::within(Duration::from_secs(3), || {
        ss.relayed.load(Relaxed) >= 6 * MIB as u64
    });
    assert!(
        moved.is_some(),
        "the proxy moved the streams: {} bytes",
        ss.relayed.load(Relaxed)
    );
    assert!(
        translator.relayed.load(Relaxed) >= 5,
        "{}",
        translator.relayed.load(Relaxed)
    );

    // IPv4 back (as the host says): the prefix goes at once, and IPv4
    // is unreachable again from this uplink.
    assert!(
        rig.engine
            .network_changed(info(topo, true))
            .expect("running")
    );
    assert_eq!(rig.stats().nat64_prefix, None);
    assert!(!tcp_reaches(to_direct), "the prefix was dropped");
    assert!(!tcp_reaches(to_proxied), "the prefix was dropped");
    assert!(!tcp_reaches(by_name.addr), "the prefix was dropped");
    assert_eq!(rig.stats().nat64_synthesized, 5);
}

root_tests!(ipv4_through_nat64;
    system(StackKind::System),
    smoltcp(StackKind::Smoltcp),
);
