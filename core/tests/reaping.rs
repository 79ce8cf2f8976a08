//! Dead peers are reaped: a system-stack session whose peer vanished
//! without a FIN or an RST frees its task, its two descriptors and its
//! admission permit once its connection has been idle for
//! `timeouts.tcp_idle_s`, and both of its sockets carry TCP keepalive
//! (outbound::KEEPALIVE_IDLE) to find such a peer even when that timeout
//! is long.
//!
//! Needs root (namespaces, TUN); otherwise each test prints why it skipped.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use kerntun::config::{DriverMode, StackKind};
use kerntun::outbound::KEEPALIVE_IDLE;
use kerntun_testkit::rig::Rig;
use kerntun_testkit::servers::Mode;
use kerntun_testkit::{Topology, client, require_root, within};

/// One row of /proc/net/tcp: the socket's timer and inode.
#[derive(Debug, Clone, Copy)]
struct TcpRow {
    /// 2: the keepalive timer (for an established, idle socket).
    timer: u8,
    /// Time left on that timer, in clock ticks (USER_HZ, 100 per second).
    ticks: u64,
    inode: u64,
}

/// IPv4 TCP sockets of the calling thread's namespace, by (local, remote).
fn tcp_sockets() -> HashMap<(SocketAddr, SocketAddr), TcpRow> {
    // thread-self: the test thread entered the client namespace, the
    // process's main thread did not.
    let text = std::fs::read_to_string("/proc/thread-self/net/tcp").expect("/proc/net/tcp");
    let addr = |s: &str| -> SocketAddr {
        let (ip, port) = s.split_once(':').expect("ip:port");
        // The address is the network-order word printed as a host integer.
        let ip = u32::from_str_radix(ip, 16).expect("hex ip").to_ne_bytes();
        let port = u16::from_str_radix(port, 16).expect("hex port");
        SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), port)
    };
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (timer, ticks) = f.get(5)?.split_once(':')?;
            let row = TcpRow {
                timer: u8::from_str_radix(timer, 16).ok()?,
                ticks: u64::from_str_radix(ticks, 16).ok()?,
                inode: f.get(9)?.parse().ok()?,
            };
            Some(((addr(f.get(1)?), addr(f.get(2)?)), row))
        })
        .collect()
}

/// Whether this process still holds a descriptor for socket `inode`.
fn holds_socket(inode: u64) -> bool {
    let want = format!("socket:[{inode}]");
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .flatten()
        .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy() == want))
}

/// Send `n` bytes and read the echo back.
fn echo(s: &mut TcpStream, n: usize) {
    let data = vec![7u8; n];
    s.write_all(&data).expect("write");
    let mut back = vec![0u8; n];
    s.read_exact(&mut back).expect("echo");
    assert_eq!(back, data);
}

#[test]
fn a_vanished_peer_frees_the_session_its_sockets_and_its_permit() {
    require_root!();
    const IDLE_S: u64 = 3;
    let topo = Topology::new().expect("topology");
    let srv = topo.tcp_server(false, Mode::Echo);
    let rig = Rig::builder()
        .stack(StackKind::System)
        .driver(DriverMode::PerPacket)
        .ipv4_only()
        .timeouts(|t| t.tcp_idle_s = IDLE_S)
        // One admission permit: the next session is admitted only if the
        // reaped one gave its permit back.
        .budget(|b| b.tcp_sessions = Some(1))
        .start_in(topo);
    let (topo, engine) = (&rig.topo, &rig.engine);
    let listener = rig.listener(false);

    let mut app = TcpStream::connect_timeout(&srv.addr, Duration::from_secs(3)).expect("connect");
    app.set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    echo(&mut app, 1000);
    assert_eq!(engine.stats().tcp_sessions_active, 1);

    // The engine's two sockets: the outbound (to the server) and the app's
    // side accepted on the listener (from the NAT address). Their keepalive
    // timers run once the last data is acknowledged (bounded wait).
    let legs = || {
        let socks = tcp_sockets();
        let find = |pick: &dyn Fn(&SocketAddr, &SocketAddr) -> bool| {
            let found: Vec<TcpRow> = socks
                .iter()
                .filter(|((l, r), _)| pick(l, r))
                .map(|(_, row)| *row)
                .collect();
            assert_eq!(found.len(), 1, "{found:?} in {socks:?}");
            found[0]
        };
        let client = IpAddr::V4(topo.client_v4());
        (
            find(&|l, r| *r == srv.addr && l.ip() == client),
            find(&|l, r| *l == listener && r.port() != 0),
        )
    };
    let (mut outbound, mut accepted) = legs();
    let _ = within(Duration::from_secs(1), || {
        (outbound, accepted) = legs();
        (outbound.timer, accepted.timer) == (2, 2)
    });
    for (leg, row) in [("outbound", outbound), ("app", accepted)] {
        // Keepalive armed with the engine's idle time (ticks are 1/100 s).
        let left = Duration::from_millis(row.ticks * 10);
        assert!(
            row.timer == 2 && left <= KEEPALIVE_IDLE && left > KEEPALIVE_IDLE / 2,
            "{leg} leg: keepalive timer {row:?}"
        );
        assert!(holds_socket(row.inode), "{leg} leg open");
    }

    // The server vanishes: no FIN, no RST, nothing reaches it any more.
    topo.server
        .ip(&["link", "set", "kts", "down"])
        .expect("link down");
    rig.wait_until("the session reaped", Duration::from_secs(IDLE_S + 4), |s| {
        s.tcp_sessions_active == 0 && !holds_socket(outbound.inode) && !holds_socket(accepted.inode)
    });
    // The app hears of it, at the latest when it speaks again: its
    // connection is reset, not left hanging.
    let _ = app.write_all(b"x");
    let (ended, r) = client::read_ended(&mut app);
    assert!(ended, "{r:?}");

    // The permit came back: with a budget of one, a new session is admitted.
    topo.server
        .ip(&["link", "set", "kts", "up"])
        .expect("link up");
    let mut again = None;
    for _ in 0..50 {
        match TcpStream::connect_timeout(&srv.addr, Duration::from_secs(1)) {
            Ok(s) => {
                again = Some(s);
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    let mut again = again.expect("a new session after the reap");
    again
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    echo(&mut again, 1000);
    assert_eq!(engine.stats().admission_refused, 0, "{:?}", engine.stats());
}
