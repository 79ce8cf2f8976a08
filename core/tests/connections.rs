//! The live connection list (`Engine::connections`, `core/src/conns.rs`)
//! against real connections through the engine, on both TCP stacks: two
//! echo connections are listed flow for flow (addresses, network, outbound,
//! bytes after a known transfer); closing one resets the app's socket
//! within 1 s and counts it, while the other keeps echoing byte-exact; an
//! unknown id is refused. UDP flows are listed beside them with the rule
//! and the group that routed them, and closed by a filter.
//!
//! Needs root (namespaces, TUN); otherwise each test prints why it skipped.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kerntun::config::{GroupConfig, GroupKind, StackKind};
use kerntun::conns::{ConnState, Connection, ConnectionFilter, DomainSource};
use kerntun::rules::{Action, Network, PortRange, Rule};
use kerntun_testkit::rig::Rig;
use kerntun_testkit::servers::Mode;
use kerntun_testkit::{pattern, uninterrupted, within};

kerntun_testkit::root_tests!(list_and_close;
    system(StackKind::System),
    smoltcp(StackKind::Smoltcp),
);

kerntun_testkit::root_tests!(udp_flows_listed_with_rule_and_chain;
    udp_rule_chain_system(StackKind::System),
    udp_rule_chain_smoltcp(StackKind::Smoltcp),
);

/// Send `data` on `s` and read back as many bytes, which must be equal.
fn echo(s: &mut TcpStream, data: &[u8]) {
    let mut back = vec![0u8; data.len()];
    std::thread::scope(|t| {
        let mut w = s.try_clone().expect("clone");
        t.spawn(move || w.write_all(data).expect("send"));
        s.read_exact(&mut back).expect("echo");
    });
    assert!(back == data, "echoed byte-exact");
}

fn list_and_close(stack: StackKind) {
    let rig = Rig::builder().stack(stack).ipv4_only().start();
    let srv = rig.tcp_server(false, Mode::Echo);
    let mut a = TcpStream::connect_timeout(&srv.addr, Duration::from_secs(3)).expect("a");
    let mut b = TcpStream::connect_timeout(&srv.addr, Duration::from_secs(3)).expect("b");
    const A_BYTES: usize = 300_000;
    const B_BYTES: usize = 5_000;
    echo(&mut a, &pattern(1, A_BYTES));
    echo(&mut b, &pattern(2, B_BYTES));

    // The relay adds to a record after each chunk it moved: by the time
    // the echo is back, both directions are counted.
    let find = |list: &[Connection], s: &TcpStream| -> Option<Connection> {
        let local = s.local_addr().expect("local address");
        list.iter().find(|c| c.source == local).cloned()
    };
    let mut last = None;
    let counted = within(Duration::from_secs(2), || {
        let l = rig.engine.connections();
        let done = [(&a, A_BYTES), (&b, B_BYTES)].iter().all(|(s, n)| {
            find(&l.connections, s)
                .is_some_and(|c| c.bytes_up == *n as u64 && c.bytes_down == *n as u64)
        });
        last = Some(l);
        done
    });
    let l = last.expect("listed once");
    assert!(counted.is_some(), "both echoes counted: {l:?}");
    assert!(!l.truncated);
    assert_eq!(l.connections.len(), 2, "two connections: {l:?}");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    let ca = find(&l.connections, &a).expect("a listed");
    let cb = find(&l.connections, &b).expect("b listed");
    for c in [&ca, &cb] {
        assert_eq!(c.network, Network::Tcp);
        assert_eq!(c.destination, srv.addr);
        assert_eq!(c.outbound.as_deref(), Some("direct"));
        assert_eq!(
            (c.domain.as_deref(), c.domain_source),
            (None, DomainSource::None)
        );
        assert_eq!(c.state, ConnState::Relaying);
        assert!(
            c.started_unix_ms <= now_ms && now_ms - c.started_unix_ms < 60_000,
            "started {} ms, now {now_ms} ms",
            c.started_unix_ms
        );
    }
    assert_ne!(ca.id, cb.id);

    // An id never handed out is refused and closes nothing.
    let unknown = ca.id.max(cb.id) + 1000;
    assert!(!rig.engine.close_connection(unknown));
    assert_eq!(rig.stats().connections_closed_by_host, 0);

    // Closing a: its app socket hears a reset within 1 s.
    assert!(rig.engine.close_connection(ca.id));
    a.set_read_timeout(Some(Duration::from_secs(1)))
        .expect("read timeout");
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let r = a.read(&mut buf);
    let took = started.elapsed();
    match r {
        Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionReset, "after {took:?}: {e}"),
        Ok(n) => panic!("a read {n} bytes after its close ({took:?}), not a reset"),
    }
    assert!(took < Duration::from_secs(1), "reset after {took:?}");
    assert_eq!(rig.stats().connections_closed_by_host, 1);

    // b goes on, byte-exact, and is the only one left listed.
    echo(&mut b, &pattern(3, 100_000));
    let gone = within(Duration::from_secs(2), || {
        let l = rig.engine.connections().connections;
        l.len() == 1 && l[0].id == cb.id
    });
    assert!(
        gone.is_some(),
        "a left the list: {:?}",
        rig.engine.connections()
    );
    assert!(!rig.engine.close_connection(ca.id), "a ended");
}

/// Two UDP flows to an echo server, routed by a named rule through a
/// select group to `direct`, and a TCP connection routed by no rule: each
/// listed with its rule, chain and bytes; closing the UDP flows by a
/// filter closes both and leaves the TCP connection; the app's next
/// datagram opens a new flow that is listed again.
fn udp_flows_listed_with_rule_and_chain(stack: StackKind) {
    use std::net::UdpSocket;
    let echo_port = std::sync::OnceLock::new();
    let rig = Rig::builder()
        .stack(stack)
        .ipv4_only()
        .config(|topo, c| {
            let srv = topo.udp_echo(false);
            let port = srv.addr.port();
            let _ = echo_port.set(srv);
            c.groups.insert(
                "outer".into(),
                GroupConfig::new(GroupKind::Select, &["inner"]),
            );
            c.groups.insert(
                "inner".into(),
                GroupConfig::new(GroupKind::Select, &["direct", "reject"]),
            );
            c.rules.push(Rule {
                name: Some("udp-echo".into()),
                network: Some(Network::Udp),
                ports: Some(PortRange {
                    start: port,
                    end: port,
                }),
                action: Action::Outbound("outer".into()),
                ..Rule::default()
            });
        })
        .start();
    let srv = echo_port.get().expect("udp echo started");
    let tcp = rig.tcp_server(false, Mode::Echo);
    let mut t = TcpStream::connect_timeout(&tcp.addr, Duration::from_secs(3)).expect("tcp");
    echo(&mut t, &pattern(4, 1_000));

    let sockets: Vec<UdpSocket> = (0..2)
        .map(|_| {
            let s = UdpSocket::bind("0.0.0.0:0").expect("udp bind");
            s.connect(srv.addr).expect("udp connect");
            s.set_read_timeout(Some(Duration::from_secs(2)))
                .expect("timeout");
            s
        })
        .collect();
    const SIZES: [usize; 3] = [100, 700, 1200];
    for s in &sockets {
        for (i, n) in SIZES.iter().enumerate() {
            let out = pattern(10 + i as u64, *n);
            s.send(&out).expect("udp send");
            let mut back = vec![0u8; 2048];
            let got = uninterrupted(|| s.recv(&mut back)).expect("udp echo back");
            assert_eq!(&back[..got], &out[..], "echoed datagram {i}");
        }
    }
    let total: u64 = SIZES.iter().sum::<usize>() as u64;
    let udp_of = |l: &[Connection]| -> Vec<Connection> {
        l.iter()
            .filter(|c| c.network == Network::Udp)
            .cloned()
            .collect()
    };
    let mut last = None;
    let listed = within(Duration::from_secs(2), || {
        let l = rig.engine.connections().connections;
        let ok = udp_of(&l).len() == 2
            && udp_of(&l)
                .iter()
                .all(|c| c.bytes_up == total && c.bytes_down == total);
        last = Some(l);
        ok
    });
    let l = last.expect("listed once");
    assert!(listed.is_some(), "two UDP flows with their bytes: {l:#?}");
    for c in udp_of(&l) {
        assert_eq!(c.destination, srv.addr);
        assert_eq!(c.rule.as_deref(), Some("udp-echo"));
        assert_eq!(c.chain, ["outer", "inner"]);
        assert_eq!(c.outbound.as_deref(), Some("direct"));
        assert_eq!(c.state, ConnState::Relaying);
    }
    let mut ports: Vec<u16> = udp_of(&l).iter().map(|c| c.source.port()).collect();
    ports.sort_unstable();
    let mut want: Vec<u16> = sockets
        .iter()
        .map(|s| s.local_addr().expect("addr").port())
        .collect();
    want.sort_unstable();
    assert_eq!(ports, want, "one record per app socket");
    let tcp_rec = l
        .iter()
        .find(|c| c.network == Network::Tcp)
        .expect("tcp listed");
    assert_eq!(tcp_rec.rule, None, "no rule matched the TCP connection");
    assert!(tcp_rec.chain.is_empty());

    // A filter on the group closes the UDP flows, not the TCP connection.
    let by_group = ConnectionFilter {
        group: Some("inner".into()),
        ..ConnectionFilter::default()
    };
    assert_eq!(rig.engine.close_connections(&by_group), 2);
    assert_eq!(
        rig.engine.close_connections(&by_group),
        0,
        "closing already"
    );
    let gone = within(Duration::from_secs(3), || {
        udp_of(&rig.engine.connections().connections).is_empty()
    });
    assert!(
        gone.is_some(),
        "UDP flows left: {:#?}",
        rig.engine.connections()
    );
    assert_eq!(rig.stats().connections_closed_by_host, 2);
    echo(&mut t, &pattern(5, 1_000));

    // The next datagram opens a new flow, listed from 0 bytes.
    let s = &sockets[0];
    s.send(b"again").expect("udp send");
    let mut back = [0u8; 16];
    assert_eq!(
        uninterrupted(|| s.recv(&mut back)).expect("echo after close"),
        5
    );
    let again = within(Duration::from_secs(2), || {
        let u = udp_of(&rig.engine.connections().connections);
        u.len() == 1 && u[0].bytes_up == 5 && u[0].bytes_down == 5
    });
    assert!(again.is_some(), "{:#?}", rig.engine.connections());
}
