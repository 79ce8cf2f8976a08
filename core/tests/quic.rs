//! UDP refused and routed as QUIC apps meet it: a datagram a `reject` rule
//! refuses is answered with an ICMP port unreachable, so a connected UDP
//! socket fails at once (`udp/reject.rs`).
//!
//! Needs root (CI runs as root); otherwise each test prints why it skipped.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use kerntun::config::StackKind;
use kerntun::rules::{Action, Network, Rule};
use kerntun_testkit::require_root;
use kerntun_testkit::rig::Rig;

/// The port every test here rejects UDP to.
const REJECTED: u16 = 4433;

/// A rule that refuses UDP to [`REJECTED`], first.
fn reject_udp() -> Rule {
    Rule {
        ports: Some(format!("{REJECTED}").parse().expect("port")),
        network: Some(Network::Udp),
        action: Action::Reject,
        ..Rule::default()
    }
}

/// An app's connected UDP socket to `to`, reads given up after 2 s.
fn connected(to: SocketAddr) -> UdpSocket {
    let any: SocketAddr = if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }
        .parse()
        .expect("addr");
    let s = UdpSocket::bind(any).expect("app socket");
    s.connect(to).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    s
}

/// A connected UDP socket sending to a destination a rule rejects gets
/// `ECONNREFUSED` on its next receive well within 200 ms (the engine
/// answers with an ICMP port unreachable), on both stacks (UDP takes the
/// same path on both) and both families, while UDP to another port of the
/// same server is untouched. A burst past the answers' rate limit is
/// counted (`icmp_rate_limited`), each datagram still `udp_rejected`.
#[test]
fn rejected_udp_is_refused_at_once() {
    require_root!();
    for stack in [StackKind::System, StackKind::Smoltcp] {
        let rig = Rig::builder()
            .stack(stack)
            .config(|_, c| c.rules.insert(0, reject_udp()))
            .start();
        for v6 in [false, true] {
            let echo = rig.udp_echo(v6);
            let to = SocketAddr::new(rig.topo.server(v6), REJECTED);
            let app = connected(to);
            let sent = Instant::now();
            app.send(b"an Initial, say").expect("send");
            let mut buf = [0u8; 64];
            let err = kerntun_testkit::uninterrupted(|| app.recv(&mut buf))
                .expect_err("refused, not answered");
            let took = sent.elapsed();
            assert_eq!(
                err.kind(),
                io::ErrorKind::ConnectionRefused,
                "{stack:?} v6 {v6}: {err} after {took:?}: {:?}",
                rig.stats()
            );
            assert!(
                took < Duration::from_millis(200),
                "{stack:?} v6 {v6}: {took:?}"
            );
            // Another port of the same server is not refused.
            let ok = kerntun_testkit::client::udp_round_trips(echo.addr, 3, 100).expect("echo");
            assert_eq!(ok, 3, "{stack:?} v6 {v6}");
        }
        let s = rig.stats();
        assert_eq!(s.drop_count("udp_rejected"), 2, "{stack:?}: {s:?}");
        assert_eq!(s.drop_count("icmp_rate_limited"), 0, "{stack:?}: {s:?}");
        // 300 refused datagrams at once (within the TUN's queue of 500):
        // about 50 answered (the burst, and 1 per 10 ms while they are
        // sent), every one counted as refused, the rest as not answered.
        let flood = UdpSocket::bind("0.0.0.0:0").expect("flood socket");
        let to = SocketAddr::new(rig.topo.server(false), REJECTED);
        for _ in 0..300 {
            flood.send_to(b"x", to).expect("send");
        }
        rig.wait_until("the flood refused", Duration::from_secs(5), |s| {
            s.drop_count("udp_rejected") >= 302
        });
        let s = rig.stats();
        assert_eq!(s.drop_count("udp_rejected"), 302, "{stack:?}: {s:?}");
        // At most 300 - 50; at least 150 unless sending took over a second.
        let limited = s.drop_count("icmp_rate_limited");
        assert!(
            (150..=250).contains(&limited),
            "{stack:?}: {limited} limited: {s:?}"
        );
    }
}
