//! An engine running in a [`Topology`], as the end-to-end tests start it.
//!
//! [`Rig::builder`] collects what a test changes (stack, driver, address
//! families, budgets, timeouts, outbounds and rules, DNS, sniffing, a
//! protect hook, anything else through [`RigBuilder::config`]) on top of
//! [`config`], the configuration every test starts from. Starting it enters
//! the topology's client namespace on the calling thread (threads spawned
//! from it later, the test's clients, start there too), starts the engine
//! on a TUN it creates, routes the server's addresses into that TUN and
//! checks that the engine runs the stack and driver asked for.
//!
//! [`Rig::inject`] writes packets into the TUN's transmit side from the
//! client namespace (`testkit/scripts/flood_via_tun.py`), so the engine reads
//! them as an app's; [`Rig::wait_until`] waits on the engine's statistics.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kerntun::budget::{BudgetConfig, Platform};
use kerntun::config::{
    Config, DriverMode, OutboundConfig, OutboundUdp, Socks5Config, StackKind, TimeoutConfig,
};
use kerntun::rules::{PortRange, Rule};
use kerntun::{Engine, OwnerLookup, Protect, StartOptions, StatsSnapshot, TunSource};

use crate::servers::{self, Mode};
use crate::{CLIENT_VETH, Topology, within};

/// The address the app's resolver is given where the rig turns DNS on
/// ([`RigBuilder::dns`]): inside the TUN's IPv4 prefix, so the kernel routes
/// it into the TUN, where the engine hijacks it.
pub const RESOLVER: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(198, 18, 0, 53)), 53);

/// The configuration every rig starts from, for a TUN named `tun`: MTU
/// 1500 (a link's, not the desktop's 65535: the fragmentation and
/// coalescing tests are written for it), the gateways 198.18.0.1/16 and
/// fd00:18::1/64, outbound sockets bound to the topology's veth
/// ([`CLIENT_VETH`]) so that they bypass the routes into the TUN, and an
/// outbound connect given up after 2 s instead of 5, within the tests' own
/// waits. The rest is `Config::default()`.
pub fn config(tun: &str) -> Config {
    let mut c = Config::default();
    c.tun.name = tun.to_owned();
    c.tun.mtu = 1500;
    c.tun.ipv4 = Some("198.18.0.1/16".parse().expect("static prefix"));
    c.tun.ipv6 = Some("fd00:18::1/64".parse().expect("static prefix"));
    c.direct.interface = Some(CLIENT_VETH.into());
    c.direct.connect_timeout_ms = 2_000;
    c
}

/// A SOCKS5 outbound to `server`, with username and password when `creds`
/// are given; `udp` says what happens to the UDP flows routed to it
/// (relayed with UDP ASSOCIATE, refused, or sent direct).
pub fn socks5(server: SocketAddr, creds: Option<(&str, &str)>, udp: OutboundUdp) -> OutboundConfig {
    OutboundConfig::Socks5(Socks5Config {
        server: server.into(),
        username: creds.map(|c| c.0.into()),
        password: creds.map(|c| c.1.into()),
        udp,
    })
}

type Tweak<'a> = Box<dyn FnOnce(&Topology, &mut Config) + 'a>;

/// What a test changes in [`config`]; the changes apply in the order given.
pub struct RigBuilder<'a> {
    stack: StackKind,
    driver: DriverMode,
    ipv6: bool,
    protect: Option<Arc<dyn Protect>>,
    owner: Option<Arc<dyn OwnerLookup>>,
    tweaks: Vec<Tweak<'a>>,
}

impl fmt::Debug for RigBuilder<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RigBuilder")
            .field("stack", &self.stack)
            .field("driver", &self.driver)
            .field("ipv6", &self.ipv6)
            .field("protect", &self.protect)
            .field("owner", &self.owner)
            .field("tweaks", &self.tweaks.len())
            .finish()
    }
}

impl<'a> RigBuilder<'a> {
    /// The TCP stack (default `auto`); a named one is checked at start.
    pub fn stack(mut self, stack: StackKind) -> Self {
        self.stack = stack;
        self
    }

    /// The TUN driver (default `auto`); a named one is checked at start.
    pub fn driver(mut self, driver: DriverMode) -> Self {
        self.driver = driver;
        self
    }

    /// No IPv6 gateway on the TUN (the engine then serves IPv4 only).
    pub fn ipv4_only(mut self) -> Self {
        self.ipv6 = false;
        self
    }

    /// The budgets of `platform` instead of the build target's.
    pub fn platform(self, platform: Platform) -> Self {
        self.config(move |_, c| c.budget.platform = Some(platform))
    }

    /// Change the budgets (`budget.*`).
    pub fn budget(self, f: impl FnOnce(&mut BudgetConfig) + 'a) -> Self {
        self.config(move |_, c| f(&mut c.budget))
    }

    /// Change the flow tables' timeouts (`timeouts.*`).
    pub fn timeouts(self, f: impl FnOnce(&mut TimeoutConfig) + 'a) -> Self {
        self.config(move |_, c| f(&mut c.timeouts))
    }

    /// A named outbound, for rules to send traffic to.
    pub fn outbound(self, name: &str, outbound: OutboundConfig) -> Self {
        let name = name.to_owned();
        self.config(move |_, c| {
            c.outbounds.insert(name, outbound);
        })
    }

    /// A rule after the ones given before.
    pub fn rule(self, rule: Rule) -> Self {
        self.config(move |_, c| c.rules.push(rule))
    }

    /// The DNS service on, answering the app at [`RESOLVER`] and asking
    /// `upstreams` (`udp://…`, `tcp://…`, `tls://…`).
    pub fn dns<S: Into<String>>(self, upstreams: impl IntoIterator<Item = S> + 'a) -> Self {
        self.config(move |_, c| {
            c.dns.enabled = true;
            c.dns.hijack = vec![RESOLVER.ip()];
            c.dns.upstreams = upstreams.into_iter().map(Into::into).collect();
        })
    }

    /// Sniff the domain of connections to `port`, waiting up to `timeout_ms`
    /// for the client's first bytes.
    pub fn sniff(self, port: u16, timeout_ms: u64) -> Self {
        self.sniff_ports(port, port)
            .config(move |_, c| c.sniff.timeout_ms = timeout_ms)
    }

    /// Sniff the domain of connections and flows to the ports `start` to
    /// `end` (inclusive); the rest of `sniff.*` as it was.
    pub fn sniff_ports(self, start: u16, end: u16) -> Self {
        self.config(move |_, c| c.sniff.ports = vec![PortRange { start, end }])
    }

    /// The hook the engine hands each outbound socket to.
    pub fn protect(mut self, protect: Arc<dyn Protect>) -> Self {
        self.protect = Some(protect);
        self
    }

    /// The host's lookup of each flow's owning app (`StartOptions::owner`).
    pub fn owner(mut self, owner: Arc<dyn OwnerLookup>) -> Self {
        self.owner = Some(owner);
        self
    }

    /// Any other change; `f` sees the topology the engine will run in.
    pub fn config(mut self, f: impl FnOnce(&Topology, &mut Config) + 'a) -> Self {
        self.tweaks.push(Box::new(f));
        self
    }

    /// The configuration this builder gives an engine in `topo`.
    pub fn config_in(self, topo: &Topology) -> Config {
        self.split(topo).0
    }

    fn split(self, topo: &Topology) -> (Config, Checks, Option<Arc<dyn Protect>>, StartOptions) {
        let mut c = config(&topo.tun_name());
        c.stack = self.stack;
        c.driver = self.driver;
        if !self.ipv6 {
            c.tun.ipv6 = None;
        }
        for tweak in self.tweaks {
            tweak(topo, &mut c);
        }
        let checks = Checks {
            stack: match self.stack {
                StackKind::System => Some("system"),
                StackKind::Smoltcp => Some("smoltcp"),
                StackKind::Auto => None,
            },
            driver: match self.driver {
                DriverMode::Batch => Some("batch"),
                DriverMode::PerPacket => Some("per_packet"),
                DriverMode::Auto => None,
            },
        };
        let mut options = StartOptions::default();
        if let Some(owner) = self.owner {
            options = options.with_owner(owner);
        }
        (c, checks, self.protect, options)
    }

    /// Start the engine in `topo`, which the caller keeps (several engines
    /// one after the other in one topology). The calling thread is left in
    /// the client namespace.
    pub fn engine_in(self, topo: &Topology) -> Engine {
        self.launch(topo).0
    }

    fn launch(self, topo: &Topology) -> (Engine, Config) {
        let (config, checks, protect, options) = self.split(topo);
        topo.client.enter().expect("enter the client namespace");
        let engine = Engine::start_with(config.clone(), TunSource::Create, protect, options)
            .expect("engine start");
        topo.route_via_tun(&engine.tun_name().expect("tun name"))
            .expect("routes into the TUN");
        let s = engine.stats();
        if let Some(want) = checks.stack {
            assert_eq!(s.stack, want, "stack selected as asked");
        }
        if let Some(want) = checks.driver {
            assert_eq!(s.driver, want, "driver selected as asked");
        }
        (engine, config)
    }

    /// Start the engine in `topo`, which may already run the test's servers.
    pub fn start_in(self, topo: Topology) -> Rig {
        let (engine, config) = self.launch(&topo);
        Rig {
            engine,
            config,
            topo,
        }
    }

    /// Start the engine in a new topology.
    pub fn start(self) -> Rig {
        self.start_in(Topology::new().expect("topology"))
    }
}

/// What the engine must report after start, where the test named it.
struct Checks {
    stack: Option<&'static str>,
    driver: Option<&'static str>,
}

/// An engine running in a topology, its routes set. Dropping it stops the
/// engine, then deletes the namespaces.
#[derive(Debug)]
pub struct Rig {
    pub engine: Engine,
    /// The configuration the engine started with.
    pub config: Config,
    pub topo: Topology,
}

/// What [`Rig::inject`] writes (`testkit/scripts/flood_via_tun.py`). Spoofed
/// sources are inside the TUN's own prefixes (198.18.0.0/16, fd00:18::/64),
/// which no namespace owns, so nothing ever answers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flood {
    /// IP-valid packets with broken L4, both families: bad TCP and UDP
    /// checksums, TCP flag combinations no endpoint sends, UDP lengths past
    /// the packet, zero UDP checksums over IPv6.
    MalformedL4,
    /// Packets the IP layer refuses or does not carry: random bytes,
    /// truncated headers, bad lengths, fragments that never complete, ESP,
    /// bad TCP data offsets, unknown protocols.
    MalformedIp,
    /// Valid SYNs to the given port from spoofed sources, both families.
    Syn,
    /// Valid 64-byte datagrams, one to each of as many ports, both families.
    Udp,
}

impl Flood {
    /// The script's name for it.
    pub fn arg(self) -> &'static str {
        match self {
            Flood::MalformedL4 => "malformed-l4",
            Flood::MalformedIp => "malformed-ip",
            Flood::Syn => "syn",
            Flood::Udp => "udp",
        }
    }
}

/// What an injection did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Injected {
    /// Packets the kernel took from the script.
    pub sent: u64,
    /// Of those, the ones the TUN's own queue did not drop: what reached
    /// the engine.
    pub reached: u64,
}

impl Rig {
    /// What to change in [`config`]; `start` it.
    pub fn builder<'a>() -> RigBuilder<'a> {
        RigBuilder {
            stack: StackKind::Auto,
            driver: DriverMode::Auto,
            ipv6: true,
            protect: None,
            owner: None,
            tweaks: Vec::new(),
        }
    }

    /// The engine's statistics now.
    pub fn stats(&self) -> StatsSnapshot {
        self.engine.stats()
    }

    /// The TUN's name.
    pub fn tun(&self) -> String {
        self.engine.tun_name().expect("tun name")
    }

    /// The address of the system stack's kernel listener of a family.
    pub fn listener(&self, v6: bool) -> SocketAddr {
        self.engine
            .listen_addrs()
            .into_iter()
            .find(|a| a.is_ipv6() == v6)
            .expect("a listener of this family")
    }

    /// Wait until the engine's statistics satisfy `ok` (the driver commits
    /// its counters in batches, the reply tasks after their writes): how
    /// long it took. Fails the test after `limit`, naming `what`, with the
    /// last statistics seen.
    pub fn wait_until(
        &self,
        what: &str,
        limit: Duration,
        mut ok: impl FnMut(&StatsSnapshot) -> bool,
    ) -> Duration {
        let mut last = None;
        let took = within(limit, || {
            let s = self.engine.stats();
            let done = ok(&s);
            last = Some(s);
            done
        });
        took.unwrap_or_else(|| panic!("timed out after {limit:?} waiting for {what}: {last:?}"))
    }

    /// A TCP test server on the server, on a port of its own.
    pub fn tcp_server(&self, v6: bool, mode: Mode) -> servers::Server {
        self.topo.tcp_server(v6, mode)
    }

    /// A UDP echo server on the server, on a port of its own.
    pub fn udp_echo(&self, v6: bool) -> servers::Server {
        self.topo.udp_echo(v6)
    }

    /// Packets the TUN's own transmit queue dropped so far: they never
    /// reached the engine. (`ip netns exec` mounts the namespace's sysfs, so
    /// this reads the right device.)
    pub fn tun_tx_dropped(&self) -> u64 {
        let path = format!("/sys/class/net/{}/statistics/tx_dropped", self.tun());
        self.topo
            .client
            .exec("cat", &[&path])
            .expect("tx_dropped")
            .trim()
            .parse()
            .expect("a number")
    }

    /// Write `count` packets of `flood` into the TUN as fast as the kernel
    /// takes them, generated from `seed`, aimed at the server (`port` for
    /// the SYNs).
    pub fn inject(&self, flood: Flood, count: usize, seed: u64, port: u16) -> Injected {
        self.run_injector(flood.arg(), count, seed, port, &[])
    }

    /// `count` SYNs with random sequence numbers (from `seed`) on one
    /// 4-tuple, `client` -> `server`, written into the TUN as the app's:
    /// spoofed onto a live connection. `server` is one of the topology's
    /// server addresses.
    pub fn inject_syns_on(
        &self,
        client: SocketAddr,
        server: SocketAddr,
        count: usize,
        seed: u64,
    ) -> Injected {
        assert!(
            server.ip() == IpAddr::from(self.topo.server_v4())
                || server.ip() == IpAddr::from(self.topo.server_v6()),
            "{server} is not one of the topology's servers"
        );
        let (src, sport) = (client.ip().to_string(), client.port().to_string());
        self.run_injector("syn-on", count, seed, server.port(), &[&src, &sport])
    }

    fn run_injector(
        &self,
        kind: &str,
        count: usize,
        seed: u64,
        port: u16,
        extra: &[&str],
    ) -> Injected {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/flood_via_tun.py");
        let (d4, d6) = (
            self.topo.server_v4().to_string(),
            self.topo.server_v6().to_string(),
        );
        let (tun, count, seed, port) = (
            self.tun(),
            count.to_string(),
            seed.to_string(),
            port.to_string(),
        );
        let mut args = vec![script, &tun, kind, &count, &seed, &d4, &d6, &port];
        args.extend_from_slice(extra);
        let dropped = self.tun_tx_dropped();
        let sent: u64 = self
            .topo
            .client
            .exec("python3", &args)
            .expect("flood script")
            .trim()
            .parse()
            .expect("a count");
        let reached = sent.saturating_sub(self.tun_tx_dropped() - dropped);
        Injected { sent, reached }
    }
}
