//! Flow owners (`core/src/owner.rs`) through a real engine, on both TCP
//! stacks: a fake `OwnerLookup` names an owner for the client sockets the
//! test registers by source port and none for the rest.
//!
//! * With a `package` rule that rejects one app: that app's TCP connection
//!   is reset and its UDP flow refused, the other app's connection and
//!   flow echo and are listed with the uid and package the lookup named; a
//!   flow with no owner is not matched by the rule.
//! * With an owner rule that cannot match these flows (another port): the
//!   flows are routed at once and their records get the owner afterwards
//!   (the lookup for the list only).
//!
//! Needs root (namespaces, TUN); otherwise each test prints why it skipped.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use kerntun::config::StackKind;
use kerntun::conns::Connection;
use kerntun::rules::{Action, Network, PortRange, Rule};
use kerntun::{Owner, OwnerLookup};
use kerntun_testkit::rig::Rig;
use kerntun_testkit::servers::{Mode, Server};
use kerntun_testkit::{pattern, uninterrupted, within};
use parking_lot::Mutex;

kerntun_testkit::root_tests!(package_rule_routes_by_owner;
    routes_system(StackKind::System),
    routes_smoltcp(StackKind::Smoltcp),
);

kerntun_testkit::root_tests!(owner_recorded_after_routing;
    recorded_system(StackKind::System),
    recorded_smoltcp(StackKind::Smoltcp),
);

const OWNED: &str = "com.example.owned";
const BLOCKED: &str = "com.example.blocked";

/// Names the owner of the flows from the source ports registered with
/// [`Owners::name`]; every other flow has none. Counts what it was asked.
#[derive(Debug, Default)]
struct Owners {
    by_port: Mutex<HashMap<u16, Owner>>,
    asked: Mutex<Vec<(Network, SocketAddr, SocketAddr)>>,
}

impl Owners {
    fn name(&self, port: u16, uid: u32, package: &str) {
        let owner = Owner {
            uid,
            package: Some(package.into()),
        };
        self.by_port.lock().insert(port, owner);
    }
}

impl OwnerLookup for Owners {
    fn owner(
        &self,
        network: Network,
        source: SocketAddr,
        destination: SocketAddr,
    ) -> Result<Option<Owner>, String> {
        self.asked.lock().push((network, source, destination));
        Ok(self.by_port.lock().get(&source.port()).cloned())
    }
}

/// A TCP socket bound before it connects, so that its source port (which
/// the lookup keys on) is known first.
fn connect_from(
    to: SocketAddr,
    owners: &Owners,
    owner: Option<(u32, &str)>,
) -> std::io::Result<TcpStream> {
    let s =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    s.bind(&SocketAddr::from(([0, 0, 0, 0], 0)).into())
        .expect("bind");
    let port = s
        .local_addr()
        .expect("local")
        .as_socket()
        .expect("inet")
        .port();
    if let Some((uid, package)) = owner {
        owners.name(port, uid, package);
    }
    s.connect_timeout(&to.into(), Duration::from_secs(3))?;
    let s: TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    Ok(s)
}

/// Whether `data` comes back whole on `s` (false on a reset or EOF).
fn echoes(s: &mut TcpStream, data: &[u8]) -> bool {
    if s.write_all(data).is_err() {
        return false;
    }
    let mut back = vec![0u8; data.len()];
    s.read_exact(&mut back).is_ok() && back == data
}

/// A UDP socket connected to `to`, its owner registered; whether one
/// datagram comes back (the first datagram of a held flow goes out once
/// its owner is known: the lookup's answer wakes the driver).
fn udp_from(to: SocketAddr, owners: &Owners, owner: Option<(u32, &str)>) -> (UdpSocket, bool) {
    let (s, ok, _) = udp_timed(to, owners, owner);
    (s, ok)
}

/// [`udp_from`], and how long the datagram took to come back.
fn udp_timed(
    to: SocketAddr,
    owners: &Owners,
    owner: Option<(u32, &str)>,
) -> (UdpSocket, bool, Duration) {
    let s = UdpSocket::bind("0.0.0.0:0").expect("udp bind");
    s.connect(to).expect("udp connect");
    s.set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    if let Some((uid, package)) = owner {
        owners.name(s.local_addr().expect("addr").port(), uid, package);
    }
    let out = pattern(7, 300);
    let sent = std::time::Instant::now();
    s.send(&out).expect("udp send");
    let mut back = [0u8; 2048];
    let ok = matches!(uninterrupted(|| s.recv(&mut back)), Ok(n) if back[..n] == out[..]);
    (s, ok, sent.elapsed())
}

fn listed(rig: &Rig, source: SocketAddr, network: Network) -> Option<Connection> {
    rig.engine
        .connections()
        .connections
        .into_iter()
        .find(|c| c.source == source && c.network == network)
}

/// Wait until the record of the flow from `source` carries `uid`.
fn wait_owner(rig: &Rig, source: SocketAddr, network: Network, uid: u32) -> Connection {
    let mut last = None;
    let ok = within(Duration::from_secs(2), || {
        last = listed(rig, source, network);
        last.as_ref().is_some_and(|c| c.uid == Some(uid))
    });
    assert!(
        ok.is_some(),
        "{network:?} from {source} has uid {uid}: {last:?}"
    );
    last.expect("listed")
}

/// An engine (IPv4 only) on `stack` that asks `owners` who owns a flow,
/// with `rule` as its one rule, and a TCP and a UDP echo server behind it.
fn owner_rig(stack: StackKind, owners: &Arc<Owners>, rule: Rule) -> (Rig, Server, Server) {
    let rig = Rig::builder()
        .stack(stack)
        .ipv4_only()
        .owner(owners.clone())
        .rule(rule)
        .start();
    let tcp = rig.tcp_server(false, Mode::Echo);
    let udp = rig.udp_echo(false);
    (rig, tcp, udp)
}

fn package_rule_routes_by_owner(stack: StackKind) {
    let owners = Arc::new(Owners::default());
    let rule = Rule {
        name: Some("blocked-app".into()),
        package: vec![BLOCKED.into()],
        action: Action::Reject,
        ..Rule::default()
    };
    let (rig, tcp, udp) = owner_rig(stack, &owners, rule);

    // (a) The owned app's connection echoes and is listed with its owner.
    let mut owned = connect_from(tcp.addr, &owners, Some((10_077, OWNED))).expect("connect");
    assert!(echoes(&mut owned, &pattern(1, 20_000)), "owned app echoes");
    let src = owned.local_addr().expect("local");
    let c = wait_owner(&rig, src, Network::Tcp, 10_077);
    assert_eq!(c.package.as_deref(), Some(OWNED));
    assert_eq!(c.outbound.as_deref(), Some("direct"));
    assert_eq!(c.rule, None, "the package rule did not match it");

    // (b) The blocked app's connection: accepted, then reset by the rule
    // (on smoltcp the reset may come before the handshake completes).
    let rejected = rig.stats().tcp_rejected_by_rule;
    let refused = match connect_from(tcp.addr, &owners, Some((10_078, BLOCKED))) {
        Err(_) => true,
        Ok(mut blocked) => !echoes(&mut blocked, &pattern(2, 1_000)),
    };
    assert!(refused, "the package rule rejects the blocked app");
    rig.wait_until("the rejection counted", Duration::from_secs(2), |s| {
        s.tcp_rejected_by_rule == rejected + 1
    });

    // A connection with no owner known is not matched by the rule.
    let mut nobody = connect_from(tcp.addr, &owners, None).expect("connect");
    assert!(
        echoes(&mut nobody, &pattern(3, 1_000)),
        "no owner: not matched"
    );
    let c = listed(&rig, nobody.local_addr().expect("local"), Network::Tcp).expect("listed");
    assert_eq!((c.uid, c.package), (None, None));

    // UDP: the same rule refuses the blocked app's flow, not the owned one's.
    let (owned_udp, ok, took) = udp_timed(udp.addr, &owners, Some((10_079, OWNED)));
    // Held until the lookup answers (within owner::TIMEOUT, 250 ms), not
    // until the next cleanup tick (1 s).
    assert!(
        took < Duration::from_millis(600),
        "the owned app's datagram left when its owner was known: {took:?}"
    );
    assert!(
        ok,
        "owned app's UDP flow echoes: {:?} {:?} {:?}",
        rig.stats(),
        rig.engine.connections(),
        owners.asked.lock()
    );
    let src = owned_udp.local_addr().expect("local");
    let c = wait_owner(&rig, src, Network::Udp, 10_079);
    assert_eq!(c.package.as_deref(), Some(OWNED));
    let (_blocked_udp, ok) = udp_from(udp.addr, &owners, Some((10_080, BLOCKED)));
    assert!(!ok, "the package rule refuses the blocked app's UDP flow");
    rig.wait_until("the refusal counted", Duration::from_secs(2), |s| {
        s.drop_count("udp_rejected") >= 1
    });

    let s = rig.stats();
    assert_eq!(s.owner_failed, 0, "{s:?}");
    assert!(s.owner_lookups >= 5, "{}", s.owner_lookups);
    assert!(
        owners
            .asked
            .lock()
            .iter()
            .any(|(n, _, d)| *n == Network::Udp && *d == udp.addr),
        "UDP flows are asked about as UDP"
    );
}

fn owner_recorded_after_routing(stack: StackKind) {
    let owners = Arc::new(Owners::default());
    // An owner rule no flow here can match: lookups are for the list.
    let rule = Rule {
        package: vec![BLOCKED.into()],
        ports: Some(PortRange { start: 9, end: 9 }),
        action: Action::Reject,
        ..Rule::default()
    };
    let (rig, tcp, udp) = owner_rig(stack, &owners, rule);
    let mut blocked = connect_from(tcp.addr, &owners, Some((10_081, BLOCKED))).expect("connect");
    assert!(
        echoes(&mut blocked, &pattern(4, 5_000)),
        "not matched: echoes"
    );
    let c = wait_owner(
        &rig,
        blocked.local_addr().expect("local"),
        Network::Tcp,
        10_081,
    );
    assert_eq!(c.package.as_deref(), Some(BLOCKED));
    let (u, ok) = udp_from(udp.addr, &owners, Some((10_082, OWNED)));
    assert!(ok, "UDP echoes at once");
    wait_owner(&rig, u.local_addr().expect("local"), Network::Udp, 10_082);
}
