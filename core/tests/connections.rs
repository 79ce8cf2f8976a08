//! The live connection list (`Engine::connections`, `core/src/conns.rs`)
//! against real connections through the engine, on both TCP stacks: two
//! echo connections are listed flow for flow (addresses, network, outbound,
//! bytes after a known transfer); closing one resets the app's socket
//! within 1 s and counts it, while the other keeps echoing byte-exact; an
//! unknown id is refused.
//!
//! Needs root (namespaces, TUN); otherwise each test prints why it skipped.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kerntun::config::StackKind;
use kerntun::conns::{ConnState, Connection, DomainSource};
use kerntun::rules::Network;
use kerntun_testkit::rig::Rig;
use kerntun_testkit::servers::Mode;
use kerntun_testkit::{pattern, within};

kerntun_testkit::root_tests!(list_and_close;
    system(StackKind::System),
    smoltcp(StackKind::Smoltcp),
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
