//! The engine configuration as uniffi records and enums, mirroring
//! [`kerntun::Config`]. Every field has a default, so an app writes only what
//! differs (`EngineConfig(tun = TunOptions(ipv4 = "10.7.0.1/24"))` in Kotlin,
//! `EngineConfig(tun: TunOptions(mtu: 4064))` in Swift). Platform-dependent
//! defaults are spelled as "unset" (`0`, `null`/`nil`) and resolved by the
//! engine for the platform it runs on, so the committed bindings say the
//! same thing on every platform.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;

use ipnet::{Ipv4Net, Ipv6Net};
use kerntun::budget::Platform as CorePlatform;
use kerntun::config as core;
use kerntun::outbound::link::{Link, parse_server};
use kerntun::rules::{Action, Network, PortRange, Rule as CoreRule};

use crate::error::KerntunError;

/// Which TCP stack turns TUN packets into streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stack {
    /// Kernel TCP behind an in-place NAT: one ~100-byte NAT entry per
    /// connection, the default. Unavailable with
    /// `TunOptions.include_all_networks`.
    System,
    /// A userspace TCP stack (smoltcp): the default where the kernel
    /// listener cannot work (`TunOptions.include_all_networks`).
    Smoltcp,
}

/// How the TUN device is read and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Driver {
    /// Batched reads: Linux GRO/GSO offload, Darwin `recvmsg_x` (probed at
    /// start, falling back to per-packet reads on any error).
    Batch,
    /// One packet per read/write, up to 32 packets per readiness edge.
    PerPacket,
}

/// The platform a budget is tuned for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Platform {
    /// iOS Network Extension: 50 MiB process-wide, fatal when exceeded.
    Ios,
    /// Android VpnService.
    Android,
    /// Linux/macOS desktop or server.
    Desktop,
}

/// Memory pressure as the host reports it (iOS dispatch source, Android
/// `onTrimMemory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryPressure {
    Normal,
    Elevated,
    Critical,
}

/// Log verbosity, most severe first.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    uniffi::Enum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

/// What a matching rule does.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Enum)]
pub enum RuleAction {
    /// Connect from this host, bypassing the TUN.
    Direct,
    /// Refuse: TCP gets an RST at SYN time, UDP datagrams are dropped and counted.
    Reject,
    /// Send through the proxy outbound configured under this name in
    /// `EngineConfig.outbounds`.
    Outbound { name: String },
}

/// In a JSON configuration (`reload` through `Engine.handleMessage`,
/// docs/messages.md) an action is written as in the TOML: `"direct"`,
/// `"reject"`, or an outbound's or group's name.
impl<'de> serde::Deserialize<'de> for RuleAction {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Ok(match name.as_str() {
            "direct" => RuleAction::Direct,
            "reject" => RuleAction::Reject,
            _ => RuleAction::Outbound { name },
        })
    }
}

/// An outbound's `udp` when a JSON configuration leaves it out (as the
/// TOML's default).
fn relay() -> OutboundUdp {
    OutboundUdp::Relay
}

/// The transport a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleNetwork {
    Tcp,
    /// UDP flows; with `ports = "443"` this names QUIC (HTTP/3).
    Udp,
}

/// A Shadowsocks method (shadowsocks-rust's names in the comments).
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Deserialize)]
pub enum ShadowsocksMethod {
    /// `none`: the target address, then the app's bytes unchanged (spliced
    /// on Linux/Android).
    #[serde(rename = "none", alias = "plain")]
    Plain,
    /// `aes-128-gcm`
    #[serde(rename = "aes-128-gcm")]
    Aes128Gcm,
    /// `aes-256-gcm`
    #[serde(rename = "aes-256-gcm")]
    Aes256Gcm,
    /// `chacha20-ietf-poly1305`
    #[serde(rename = "chacha20-ietf-poly1305")]
    Chacha20IetfPoly1305,
    /// `2022-blake3-aes-128-gcm` (the password is a base64 16-byte key)
    #[serde(rename = "2022-blake3-aes-128-gcm")]
    Blake3Aes128Gcm,
    /// `2022-blake3-aes-256-gcm` (the password is a base64 32-byte key)
    #[serde(rename = "2022-blake3-aes-256-gcm")]
    Blake3Aes256Gcm,
}

/// What a proxy outbound does with the UDP flows the rules send it
/// (`udp = true | false | "direct"` in the TOML).
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutboundUdp {
    /// Relayed through the proxy (SOCKS5 UDP ASSOCIATE, Shadowsocks UDP).
    Relay,
    /// Refused: the app's socket gets an ICMP port unreachable
    /// (`ECONNREFUSED`), counted as the drop `udp_outbound_refused`.
    /// Nothing leaves outside the proxy.
    Refuse,
    /// Sent direct, from the device's own address, outside the proxy.
    Direct,
}

/// A proxy outbound that rules can send flows to.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Enum, serde::Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Outbound {
    /// A SOCKS5 proxy (RFC 1928), optionally with username/password (RFC 1929).
    Socks5 {
        /// `ip:port`, `[v6]:port` or `name:port` (see `DirectOptions.bootstrap`).
        server: String,
        #[serde(default)]
        username: Option<String>,
        #[serde(default)]
        password: Option<String>,
        /// What happens to UDP flows routed here (`Relay`: UDP ASSOCIATE).
        #[serde(default = "relay")]
        udp: OutboundUdp,
    },
    /// A Shadowsocks server.
    Shadowsocks {
        /// `ip:port`, `[v6]:port` or `name:port` (see `DirectOptions.bootstrap`).
        server: String,
        method: ShadowsocksMethod,
        /// The password (SIP004 methods) or base64 key (AEAD-2022); ignored by `Plain`.
        #[serde(default)]
        password: String,
        /// What happens to UDP flows routed here (`Relay`: through the server).
        #[serde(default = "relay")]
        udp: OutboundUdp,
    },
}

/// How TCP bytes move between the app's socket and the outbound's.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RelayOptions {
    /// Linux/Android: relay plain kernel sockets with splice(2) so payload
    /// never enters userspace; `false` forces the userspace copy.
    #[uniffi(default = true)]
    pub splice: bool,
    /// Pipe capacity asked for per spliced direction, in bytes
    /// (`null`/`nil` = the engine's default, 256 KiB).
    #[uniffi(default = None)]
    pub pipe_size: Option<u64>,
}

/// The TUN device.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TunOptions {
    /// Interface name when the engine creates the device itself (desktop Linux,
    /// `tun_fd = -1`). Ignored for a descriptor handed over by the platform.
    #[uniffi(default = "kerntun0")]
    pub name: String,
    /// Device MTU; 0 = the platform's default (iOS 4064, Android 9000,
    /// desktop 65535). Must equal the MTU the platform configured.
    #[uniffi(default = 0)]
    pub mtu: u16,
    /// Gateway address and prefix, e.g. `198.18.0.1/16`: the address the
    /// platform gave the TUN. The NAT address is gateway + 1 and must fit.
    #[uniffi(default = Some("198.18.0.1/16"))]
    pub ipv4: Option<String>,
    /// IPv6 gateway address and prefix, e.g. `fd00:18::1/64`.
    #[uniffi(default = None)]
    pub ipv6: Option<String>,
    /// Transmit queue length of a device the engine creates (Linux).
    #[uniffi(default = 10000)]
    pub tx_queue_len: u32,
    /// iOS: pass `protocolConfiguration.includeAllNetworks`. With it on the
    /// kernel listener cannot receive the tunnel's connections, so the engine
    /// uses the smoltcp stack (an explicit `Stack.System` is refused).
    #[uniffi(default = false)]
    pub include_all_networks: bool,
    /// System stack: clamp TCP windows to a share of the TUN's transmit
    /// queue, so the queue never overflows (the kernel drops what does).
    /// None: on where the per-packet driver reads a queue of at most 1000
    /// packets, as on Android (500), else off. At MTU 9000 it costs at most
    /// 16 % of the throughput; at 1500 15-60 % at 16-64 streams
    /// (docs/architecture.md, "Window clamping").
    #[uniffi(default = None)]
    pub window_clamp: Option<bool>,
}

/// How direct outbound sockets avoid looping back into the TUN.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DirectOptions {
    /// Bind outbound sockets to this interface (Linux/Android `SO_BINDTODEVICE`).
    /// Elsewhere use [`crate::PlatformHooks::protect`].
    #[uniffi(default = None)]
    pub interface: Option<String>,
    /// Mark outbound sockets (Linux/Android `SO_MARK`) for policy routing.
    #[uniffi(default = None)]
    pub fwmark: Option<u32>,
    /// Upper bound on an outbound TCP connect, in milliseconds.
    #[uniffi(default = 5000)]
    pub connect_timeout_ms: u64,
    /// Resolvers for proxy host names (`udp://IP:PORT`, `tcp://IP:PORT`),
    /// asked on protected sockets. Empty: `dns.upstreams` (UDP/TCP ones).
    /// Android and iOS have no system list the engine can read, so a
    /// host-name server needs one of the two.
    #[uniffi(default = [])]
    pub bootstrap: Vec<String>,
}

/// Limits that come from the platform unless overridden. `null`/`nil` keeps
/// the platform's value.
#[derive(Debug, Clone, Default, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetOptions {
    /// Platform whose budget is the starting point; defaults to the one the
    /// library was built for.
    #[uniffi(default = None)]
    pub platform: Option<Platform>,
    /// TCP flows the running stack tracks at once: the system stack's NAT
    /// entries, or smoltcp's sockets plus its connects in flight.
    #[uniffi(default = None)]
    pub tcp_flows: Option<u64>,
    /// TCP admission permits at normal pressure (elevated and critical get
    /// 1/2 and 1/4).
    #[uniffi(default = None)]
    pub tcp_sessions: Option<u64>,
    /// Concurrent UDP flows; the least recently used one is evicted past it.
    #[uniffi(default = None)]
    pub udp_flows: Option<u64>,
    /// Kernel listener backlog.
    #[uniffi(default = None)]
    pub backlog: Option<u32>,
    /// Userspace relay buffer per direction, allocated only while data flows.
    #[uniffi(default = None)]
    pub relay_buffer: Option<u64>,
}

/// Timeouts of the flow tables, in seconds.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutOptions {
    /// Idle UDP flows are closed after this long.
    #[uniffi(default = 60)]
    pub udp_idle_s: u64,
    /// UDP flows that never saw a reply are closed after this long (at
    /// most `udp_idle_s`) and are evicted first when the flow budget is full.
    #[uniffi(default = 30)]
    pub udp_unreplied_s: u64,
    /// Active TCP NAT entries with no packet for this long are dropped
    /// (RFC 5382 REQ-5 asks for at least 2 h 4 min).
    #[uniffi(default = 7440)]
    pub tcp_idle_s: u64,
    /// Closing NAT entries are kept this long so late FIN/ACKs are translated.
    #[uniffi(default = 10)]
    pub tcp_linger_s: u64,
}

/// One routing rule; absent conditions match everything, present ones must
/// all hold. The first match decides; no match means direct.
///
/// The four domain fields together are one condition: the connection must
/// have a domain (from fake-ip or sniffing) matching any of them. Matching
/// is case-insensitive and ignores a trailing dot.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleOptions {
    /// Destination network, e.g. `10.0.0.0/8` or `fd00::/8`. Never matches
    /// a fake-ip address.
    #[serde(default)]
    #[uniffi(default = None)]
    pub cidr: Option<String>,
    /// Destination ports: `443` or `8000-8999`.
    #[serde(default)]
    #[uniffi(default = None)]
    pub ports: Option<String>,
    /// Only TCP connections or only UDP flows; `null`/`nil`, both. A
    /// `Reject` rule with `Udp`, ports `443` and some domains makes those
    /// apps fall back from QUIC to TCP.
    #[serde(default)]
    #[uniffi(default = None)]
    pub network: Option<RuleNetwork>,
    /// Domains matched exactly.
    #[serde(default)]
    #[uniffi(default = [])]
    pub domain: Vec<String>,
    /// Domains matched with their subdomains (`b.org`: `b.org`, `a.b.org`,
    /// not `xb.org`).
    #[serde(default)]
    #[uniffi(default = [])]
    pub domain_suffix: Vec<String>,
    /// Substrings of the domain.
    #[serde(default)]
    #[uniffi(default = [])]
    pub domain_keyword: Vec<String>,
    /// Absolute path of a list file read at start: one entry a line,
    /// `full:NAME`, `domain:NAME` (suffix), `keyword:TEXT` or a bare
    /// `NAME` (suffix); `#` comments.
    #[serde(default)]
    #[uniffi(default = None)]
    pub domain_list: Option<String>,
    /// Package names of the app that owns the flow (`com.example.app`;
    /// the TOML's `package`, named apart from Kotlin's `package` keyword).
    /// With `uids`, one condition: the owner must be known and be any of
    /// them. Owners are known only with `OwnerHooks`
    /// (`Engine.startWithOwner`, Android 10+); without, these rules never
    /// match.
    #[serde(default)]
    #[uniffi(default = [])]
    pub packages: Vec<String>,
    /// User ids of the app that owns the flow (the TOML's `uid`).
    #[serde(default)]
    #[uniffi(default = [])]
    pub uids: Vec<u32>,
    pub action: RuleAction,
    /// What the connection list calls this rule (`ConnectionRecord.rule`);
    /// `null`/`nil`: its place and conditions (`rules[2] ports=443`).
    #[serde(default)]
    #[uniffi(default = None)]
    pub name: Option<String>,
}

/// Domain sniffing: reading the TLS SNI or HTTP Host of connections to real
/// addresses so domain rules apply to them. Only connections whose route a
/// domain could change wait for it.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SniffOptions {
    #[uniffi(default = true)]
    pub enabled: bool,
    /// Destination ports sniffed, each `443` or `8000-8999`;
    /// `null`/`nil` = 80 and 443.
    #[uniffi(default = None)]
    pub ports: Option<Vec<String>>,
    /// Longest wait for the app's first bytes before routing by address.
    #[uniffi(default = 300)]
    pub timeout_ms: u64,
}

/// The DNS service: hijacked queries answered from a cache, the fake-ip
/// pool, or upstreams reached through the rules' outbound.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DnsOptions {
    /// Answer hijacked queries. Off: port-53 traffic is an ordinary flow.
    #[uniffi(default = false)]
    pub enabled: bool,
    /// Addresses whose port-53 traffic (UDP and TCP) is hijacked; empty =
    /// gateway + 2 of each TUN prefix (`198.18.0.3`, `fd00:18::3`): see
    /// [`resolver_addresses`] for what to announce as the tunnel's DNS.
    #[uniffi(default = [])]
    pub hijack: Vec<String>,
    /// Hijack port 53 whatever the destination.
    #[uniffi(default = false)]
    pub hijack_all: bool,
    /// Reset TCP to port 853 (DNS over TLS) of the hijacked addresses, so
    /// Android's Private DNS (automatic mode) falls back to port 53 and
    /// kerntun answers; counted as the drop `dns_tls_reset`. Off: an
    /// ordinary flow.
    #[uniffi(default = true)]
    pub reset_dot: bool,
    /// Upstreams tried in order: `udp://IP:PORT`, `tcp://IP:PORT`, and,
    /// only in a library built with kerntun-ffi's `dot` / `doh` features,
    /// `tls://IP:PORT#server-name` (DNS over TLS) and
    /// `https://IP[:PORT][/PATH]#server-name` (DNS over HTTPS). The iOS and
    /// Android libraries this repository's scripts build have neither
    /// feature (their TLS library, ring, needs a C compiler for the target
    /// that the Linux CI does not have): there `tls://` and `https://` are
    /// refused at start with a `Config` error on `dns.upstreams`. `doh`
    /// adds about 1.5 MiB to the stripped library (measured on Linux
    /// x86_64, docs/shipping.md). The entry `"platform"` stands for the
    /// network's own DNS servers, as the last `Engine.networkChanged` gave
    /// them (`dns_servers`): each over UDP port 53, sent direct whatever
    /// the rules say; before the first report (or with none usable) it
    /// yields nothing and the next entry is asked (counted in
    /// `DnsStats.platform_unavailable`). Needed when `enabled`.
    #[uniffi(default = [])]
    pub upstreams: Vec<String>,
    /// Time allowed to one upstream try.
    #[uniffi(default = 2000)]
    pub timeout_ms: u64,
    /// Cached answers (0 disables the cache).
    #[uniffi(default = 4096)]
    pub cache_entries: u64,
    /// Answer A/AAAA with addresses from the fake-ip pool.
    #[uniffi(default = false)]
    pub fake_ip: bool,
    /// IPv4 fake-ip pool, inside 198.18.0.0/15 and clear of the TUN's own
    /// addresses.
    #[uniffi(default = "198.18.128.0/17")]
    pub fake_ip_pool: String,
    /// IPv6 fake-ip pool (AAAA for fake domains is answered empty without one).
    #[uniffi(default = None)]
    pub fake_ip_pool6: Option<String>,
    /// Domains holding a fake address at once; the least recently used one
    /// gives its address back past this.
    #[uniffi(default = 65536)]
    pub fake_ip_entries: u64,
    /// Domains (and their subdomains) that get real answers under fake-ip.
    #[uniffi(default = [])]
    pub fake_ip_filter: Vec<String>,
    /// Path of extra trust anchors (PEM) for `tls://` and `https://`
    /// upstreams, on top of the Mozilla roots: a private resolver's CA.
    #[uniffi(default = None)]
    pub tls_ca_file: Option<String>,
    /// Which families A/AAAA queries are answered with; a query for a
    /// family left out gets NOERROR without records (counted in
    /// `DnsStats.strategy_empty`). `null`/`nil` = automatic: both, except
    /// AAAA when the tunnel has no IPv6 address (`tun.ipv6` unset).
    #[uniffi(default = None)]
    pub strategy: Option<DnsStrategy>,
}

/// Which families the DNS service answers A/AAAA queries with
/// (`dns.strategy`; `null`/`nil` in [`DnsOptions`] is automatic).
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DnsStrategy {
    /// Both families, whatever the tunnel has.
    DualStack,
    /// A only: AAAA answered empty.
    Ipv4Only,
    /// AAAA only: A answered empty (needs `tun.ipv6`).
    Ipv6Only,
}

/// Everything [`crate::Engine::start`] needs besides the device.
#[derive(Debug, Clone, Default, PartialEq, Eq, uniffi::Record, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// `null`/`nil` = the default: the system stack, or smoltcp under
    /// `tun.include_all_networks`.
    #[uniffi(default = None)]
    pub stack: Option<Stack>,
    /// `null`/`nil` = batched where the device supports it, else per-packet.
    #[uniffi(default = None)]
    pub driver: Option<Driver>,
    #[uniffi(default)]
    pub tun: TunOptions,
    #[uniffi(default)]
    pub direct: DirectOptions,
    #[uniffi(default)]
    pub budget: BudgetOptions,
    #[uniffi(default)]
    pub timeouts: TimeoutOptions,
    /// Ordered rules; the first match decides.
    #[uniffi(default = [])]
    pub rules: Vec<RuleOptions>,
    /// Worker threads of the engine's own runtime (0 = platform default:
    /// 1 on mobile, 2 on desktop).
    #[uniffi(default = 0)]
    pub workers: u32,
    /// Proxy outbounds by name, for `RuleAction.Outbound`.
    #[uniffi(default)]
    pub outbounds: HashMap<String, Outbound>,
    /// Outbound groups by name, which `RuleAction.Outbound` may name too
    /// (`crate::groups`).
    #[uniffi(default)]
    pub groups: HashMap<String, crate::groups::GroupOptions>,
    #[uniffi(default)]
    pub relay: RelayOptions,
    #[uniffi(default)]
    pub dns: DnsOptions,
    #[uniffi(default)]
    pub sniff: SniffOptions,
    /// Send this engine's log events at or above this level to
    /// [`crate::PlatformHooks::log`] (and not to the process-wide logger).
    /// `null`/`nil`: the engine logs through whatever [`crate::init_logging`]
    /// installed, or nowhere.
    #[uniffi(default = None)]
    pub log_level: Option<LogLevel>,
}

impl Default for TunOptions {
    fn default() -> Self {
        Self {
            name: "kerntun0".into(),
            mtu: 0,
            ipv4: Some("198.18.0.1/16".into()),
            ipv6: None,
            tx_queue_len: 10_000,
            include_all_networks: false,
            window_clamp: None,
        }
    }
}

impl Default for DirectOptions {
    /// The core's defaults.
    fn default() -> Self {
        let core::DirectConfig {
            interface,
            fwmark,
            connect_timeout_ms,
            bootstrap,
            ..
        } = core::DirectConfig::default();
        Self {
            interface,
            fwmark,
            connect_timeout_ms,
            bootstrap,
        }
    }
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            splice: true,
            pipe_size: None,
        }
    }
}

impl Default for RuleOptions {
    /// A catch-all `direct` rule (Rust callers fill in what differs).
    fn default() -> Self {
        Self {
            cidr: None,
            ports: None,
            network: None,
            domain: Vec::new(),
            domain_suffix: Vec::new(),
            domain_keyword: Vec::new(),
            domain_list: None,
            packages: Vec::new(),
            uids: Vec::new(),
            action: RuleAction::Direct,
            name: None,
        }
    }
}

impl Default for SniffOptions {
    fn default() -> Self {
        Self {
            enabled: true,
            ports: None,
            timeout_ms: 300,
        }
    }
}

impl Default for DnsOptions {
    /// The core's defaults.
    fn default() -> Self {
        moved!(core::DnsConfig::default(); core::DnsConfig => DnsOptions {
            enabled,
            hijack_all,
            reset_dot,
            upstreams,
            timeout_ms,
            fake_ip,
            fake_ip_filter,
        } converted {
            hijack: hijack.iter().map(ToString::to_string).collect(),
            cache_entries: cache_entries as u64,
            fake_ip_entries: fake_ip_entries as u64,
            fake_ip_pool: fake_ip_pool.to_string(),
            fake_ip_pool6: fake_ip_pool6.map(|p| p.to_string()),
            tls_ca_file: tls_ca_file.map(|p| p.display().to_string()),
            strategy: match strategy {
                core::DnsStrategy::Auto => None,
                core::DnsStrategy::DualStack => Some(DnsStrategy::DualStack),
                core::DnsStrategy::Ipv4Only => Some(DnsStrategy::Ipv4Only),
                core::DnsStrategy::Ipv6Only => Some(DnsStrategy::Ipv6Only),
            },
        })
    }
}

impl DnsOptions {
    fn to_core(&self) -> Result<core::DnsConfig, KerntunError> {
        let hijack = self
            .hijack
            .iter()
            .enumerate()
            .map(|(i, a)| parse::<IpAddr>(&format!("dns.hijack[{i}]"), a))
            .collect::<Result<_, _>>()?;
        // Upstreams are checked by the core (`DnsConfig::validate`), which
        // names `dns.upstreams` with the reason.
        Ok(core::DnsConfig {
            enabled: self.enabled,
            hijack,
            hijack_all: self.hijack_all,
            reset_dot: self.reset_dot,
            upstreams: self.upstreams.clone(),
            timeout_ms: self.timeout_ms,
            cache_entries: count("dns.cache_entries", self.cache_entries)?,
            fake_ip: self.fake_ip,
            fake_ip_pool: parse("dns.fake_ip_pool", &self.fake_ip_pool)?,
            fake_ip_pool6: self
                .fake_ip_pool6
                .as_deref()
                .map(|s| parse::<Ipv6Net>("dns.fake_ip_pool6", s))
                .transpose()?,
            fake_ip_entries: count("dns.fake_ip_entries", self.fake_ip_entries)?,
            fake_ip_filter: self.fake_ip_filter.clone(),
            tls_ca_file: self.tls_ca_file.as_ref().map(PathBuf::from),
            strategy: match self.strategy {
                None => core::DnsStrategy::Auto,
                Some(DnsStrategy::DualStack) => core::DnsStrategy::DualStack,
                Some(DnsStrategy::Ipv4Only) => core::DnsStrategy::Ipv4Only,
                Some(DnsStrategy::Ipv6Only) => core::DnsStrategy::Ipv6Only,
            },
        })
    }
}

impl SniffOptions {
    fn to_core(&self) -> Result<core::SniffConfig, KerntunError> {
        let defaults = core::SniffConfig::default();
        Ok(core::SniffConfig {
            enabled: self.enabled,
            ports: match &self.ports {
                None => defaults.ports,
                Some(ports) => ports
                    .iter()
                    .enumerate()
                    .map(|(i, p)| parse::<PortRange>(&format!("sniff.ports[{i}]"), p))
                    .collect::<Result<_, _>>()?,
            },
            timeout_ms: self.timeout_ms,
        })
    }
}

moved!(both core::TimeoutConfig, TimeoutOptions {
    udp_idle_s,
    udp_unreplied_s,
    tcp_idle_s,
    tcp_linger_s,
});

impl Default for TimeoutOptions {
    /// The core's defaults.
    fn default() -> Self {
        core::TimeoutConfig::default().into()
    }
}

impl From<Platform> for CorePlatform {
    fn from(p: Platform) -> Self {
        match p {
            Platform::Ios => CorePlatform::Ios,
            Platform::Android => CorePlatform::Android,
            Platform::Desktop => CorePlatform::Desktop,
        }
    }
}

impl From<OutboundUdp> for core::OutboundUdp {
    fn from(u: OutboundUdp) -> Self {
        match u {
            OutboundUdp::Relay => core::OutboundUdp::Relay,
            OutboundUdp::Refuse => core::OutboundUdp::Refuse,
            OutboundUdp::Direct => core::OutboundUdp::Direct,
        }
    }
}

paired!(ShadowsocksMethod, core::ShadowsocksMethod {
    Plain => None,
    Aes128Gcm => Aes128Gcm,
    Aes256Gcm => Aes256Gcm,
    Chacha20IetfPoly1305 => Chacha20IetfPoly1305,
    Blake3Aes128Gcm => Blake3Aes128Gcm,
    Blake3Aes256Gcm => Blake3Aes256Gcm,
});

impl From<MemoryPressure> for kerntun::MemoryPressure {
    fn from(p: MemoryPressure) -> Self {
        match p {
            MemoryPressure::Normal => kerntun::MemoryPressure::Normal,
            MemoryPressure::Elevated => kerntun::MemoryPressure::Elevated,
            MemoryPressure::Critical => kerntun::MemoryPressure::Critical,
        }
    }
}

fn bad(field: impl Into<String>, reason: impl Into<String>) -> KerntunError {
    KerntunError::Config {
        field: field.into(),
        reason: reason.into(),
    }
}

fn parse<T: FromStr>(field: &str, text: &str) -> Result<T, KerntunError>
where
    T::Err: std::fmt::Display,
{
    text.trim()
        .parse()
        .map_err(|e| bad(field, format!("{text:?}: {e}")))
}

fn count(field: &str, n: u64) -> Result<usize, KerntunError> {
    usize::try_from(n).map_err(|_| bad(field, format!("{n} does not fit this platform")))
}

fn size(field: &str, v: Option<u64>) -> Result<Option<usize>, KerntunError> {
    v.map(|n| count(field, n)).transpose()
}

impl EngineConfig {
    /// Translate to the core configuration, naming the field of the first
    /// value that does not parse. The core's own checks (`validate`) run at
    /// start and are reported the same way.
    pub fn to_core(&self) -> Result<core::Config, KerntunError> {
        let platform = self
            .budget
            .platform
            .map_or_else(CorePlatform::current, CorePlatform::from);
        let mtu = match self.tun.mtu {
            0 => platform.default_mtu(),
            m => m,
        };
        let ipv4 = self
            .tun
            .ipv4
            .as_deref()
            .map(|s| parse::<Ipv4Net>("tun.ipv4", s))
            .transpose()?;
        let ipv6 = self
            .tun
            .ipv6
            .as_deref()
            .map(|s| parse::<Ipv6Net>("tun.ipv6", s))
            .transpose()?;
        let mut rules = Vec::with_capacity(self.rules.len());
        for (i, r) in self.rules.iter().enumerate() {
            let cidr = r
                .cidr
                .as_deref()
                .map(|s| parse(&format!("rules[{i}].cidr"), s))
                .transpose()?;
            let ports = r
                .ports
                .as_deref()
                .map(|s| parse::<PortRange>(&format!("rules[{i}].ports"), s))
                .transpose()?;
            rules.push(CoreRule {
                name: r.name.clone(),
                cidr,
                ports,
                network: r.network.map(|n| match n {
                    RuleNetwork::Tcp => Network::Tcp,
                    RuleNetwork::Udp => Network::Udp,
                }),
                domain: r.domain.clone(),
                domain_suffix: r.domain_suffix.clone(),
                domain_keyword: r.domain_keyword.clone(),
                domain_list: r.domain_list.as_ref().map(PathBuf::from),
                package: r.packages.clone(),
                uid: r.uids.clone(),
                action: match &r.action {
                    RuleAction::Direct => Action::Direct,
                    RuleAction::Reject => Action::Reject,
                    RuleAction::Outbound { name } => Action::Outbound(name.as_str().into()),
                },
            });
        }
        let mut outbounds = BTreeMap::new();
        for (name, o) in &self.outbounds {
            let server = |s: &str| {
                parse_server(s).map_err(|e| KerntunError::Config {
                    field: format!("outbounds.{name}.server"),
                    reason: e.to_string(),
                })
            };
            let out = match o {
                Outbound::Socks5 {
                    server: addr,
                    username,
                    password,
                    udp,
                } => core::OutboundConfig::Socks5(core::Socks5Config {
                    server: server(addr)?,
                    username: username.clone(),
                    password: password.clone(),
                    udp: (*udp).into(),
                }),
                Outbound::Shadowsocks {
                    server: addr,
                    method,
                    password,
                    udp,
                } => core::OutboundConfig::Shadowsocks(core::ShadowsocksConfig {
                    server: server(addr)?,
                    method: (*method).into(),
                    password: password.clone(),
                    udp: (*udp).into(),
                }),
            };
            outbounds.insert(name.clone(), out);
        }
        let relay_defaults = core::RelayConfig::default();
        let b = &self.budget;
        Ok(core::Config {
            stack: match self.stack {
                None => core::StackKind::Auto,
                Some(Stack::System) => core::StackKind::System,
                Some(Stack::Smoltcp) => core::StackKind::Smoltcp,
            },
            driver: match self.driver {
                None => core::DriverMode::Auto,
                Some(Driver::Batch) => core::DriverMode::Batch,
                Some(Driver::PerPacket) => core::DriverMode::PerPacket,
            },
            tun: core::TunConfig {
                name: self.tun.name.clone(),
                mtu,
                ipv4,
                ipv6,
                tx_queue_len: self.tun.tx_queue_len,
                include_all_networks: self.tun.include_all_networks,
                window_clamp: self.tun.window_clamp,
                ..core::TunConfig::default()
            },
            direct: core::DirectConfig {
                interface: self.direct.interface.clone(),
                fwmark: self.direct.fwmark,
                connect_timeout_ms: self.direct.connect_timeout_ms,
                bootstrap: self.direct.bootstrap.clone(),
                ..core::DirectConfig::default()
            },
            budget: core::BudgetConfig {
                platform: b.platform.map(CorePlatform::from),
                tcp_flows: size("budget.tcp_flows", b.tcp_flows)?,
                tcp_sessions: size("budget.tcp_sessions", b.tcp_sessions)?,
                udp_flows: size("budget.udp_flows", b.udp_flows)?,
                backlog: b.backlog,
                relay_buffer: size("budget.relay_buffer", b.relay_buffer)?,
            },
            timeouts: self.timeouts.clone().into(),
            rules,
            workers: usize::try_from(self.workers).unwrap_or(usize::MAX),
            outbounds,
            groups: crate::groups::to_core(&self.groups),
            relay: core::RelayConfig {
                splice: self.relay.splice,
                pipe_size: size("relay.pipe_size", self.relay.pipe_size)?
                    .unwrap_or(relay_defaults.pipe_size),
            },
            dns: self.dns.to_core()?,
            sniff: self.sniff.to_core()?,
        })
    }
}

/// The configuration with every default filled in for this platform: a
/// starting point to copy and change (`defaultConfig().copy(...)` in Kotlin).
#[uniffi::export]
pub fn default_config() -> EngineConfig {
    EngineConfig::default()
}

/// An outbound from a share link: `ss://` (SIP002, or the whole-base64
/// form) or `socks5://[user:pass@]host:port`. UDP is relayed; change it
/// with `copy(udp = OutboundUdp.REFUSE)` (Kotlin). The link's `#tag` is not
/// kept: the app names the outbound when it puts it into
/// `EngineConfig.outbounds`.
#[uniffi::export]
pub fn outbound_from_url(url: String) -> Result<Outbound, KerntunError> {
    crate::error::guard(|| {
        let link = Link::parse(&url).map_err(|e| KerntunError::Link {
            reason: e.to_string(),
        })?;
        Ok(match link {
            Link::Shadowsocks(l) => Outbound::Shadowsocks {
                server: l.server.to_string(),
                method: l.method.into(),
                password: l.password,
                udp: OutboundUdp::Relay,
            },
            Link::Socks5(l) => {
                let (username, password) = l.credentials.unzip();
                Outbound::Socks5 {
                    server: l.server.to_string(),
                    username,
                    password,
                    udp: OutboundUdp::Relay,
                }
            }
        })
    })
}

/// The addresses the engine answers DNS on for `config`: what the VPN
/// profile should announce as its DNS servers (iOS `NEDNSSettings`, Android
/// `addDnsServer`). Empty when `dns.enabled` is off (or `hijack_all` alone
/// is wanted and no address was named): then announce real resolvers,
/// whose queries the engine relays like any flow.
#[uniffi::export]
pub fn resolver_addresses(config: EngineConfig) -> Result<Vec<String>, KerntunError> {
    crate::error::guard(|| {
        let c = config.to_core()?;
        c.validate()?;
        if !c.dns.enabled {
            return Ok(Vec::new());
        }
        if !c.dns.hijack.is_empty() {
            return Ok(c.dns.hijack.iter().map(ToString::to_string).collect());
        }
        Ok([
            c.tun.ipv4.map(ipnet::IpNet::V4),
            c.tun.ipv6.map(ipnet::IpNet::V6),
        ]
        .into_iter()
        .flatten()
        .filter_map(kerntun::dns::default_resolver)
        .map(|a| a.to_string())
        .collect())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolver_addresses_follow_the_dns_options() {
        let mut c = EngineConfig::default();
        assert!(
            resolver_addresses(c.clone()).expect("ok").is_empty(),
            "dns off"
        );
        c.dns.enabled = true;
        c.dns.upstreams = vec!["udp://198.19.0.53:53".into()];
        c.tun.ipv6 = Some("fd00:18::1/64".into());
        assert_eq!(
            resolver_addresses(c.clone()).expect("ok"),
            ["198.18.0.3", "fd00:18::3"]
        );
        c.dns.hijack = vec!["198.18.0.53".into()];
        assert_eq!(resolver_addresses(c.clone()).expect("ok"), ["198.18.0.53"]);
        c.dns.upstreams.clear();
        assert!(
            resolver_addresses(c).is_err(),
            "an invalid config is an error"
        );
    }

    #[test]
    fn defaults_match_the_core_defaults() {
        let c = EngineConfig::default()
            .to_core()
            .expect("defaults translate");
        let core = core::Config::default();
        assert_eq!(c, core, "FFI defaults must say what the core says");
    }

    #[test]
    fn bad_values_name_their_field() {
        let mut c = EngineConfig::default();
        c.tun.ipv4 = Some("198.18.0.300/16".into());
        match c.to_core() {
            Err(KerntunError::Config { field, .. }) => assert_eq!(field, "tun.ipv4"),
            other => panic!("expected a config error, got {other:?}"),
        }
        let c = EngineConfig {
            rules: vec![
                RuleOptions {
                    cidr: Some("10.0.0.0/8".into()),
                    action: RuleAction::Reject,
                    ..Default::default()
                },
                RuleOptions {
                    ports: Some("9-1".into()),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        match c.to_core() {
            Err(KerntunError::Config { field, reason }) => {
                assert_eq!(field, "rules[1].ports");
                assert!(reason.contains("empty"), "{reason}");
            }
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn outbounds_from_links() {
        let o = outbound_from_url(
            "ss://2022-blake3-aes-256-gcm:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8%3D@203.0.113.7:8388#x"
                .into(),
        )
        .expect("ss link");
        assert_eq!(
            o,
            Outbound::Shadowsocks {
                server: "203.0.113.7:8388".into(),
                method: ShadowsocksMethod::Blake3Aes256Gcm,
                password: "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".into(),
                udp: OutboundUdp::Relay,
            }
        );
        let o = outbound_from_url("socks5://me:p%40ss@[2001:db8::5]:1080".into()).expect("socks");
        assert_eq!(
            o,
            Outbound::Socks5 {
                server: "[2001:db8::5]:1080".into(),
                username: Some("me".into()),
                password: Some("p@ss".into()),
                udp: OutboundUdp::Relay,
            }
        );
        let e =
            outbound_from_url("ss://aes-256-gcm:secret@h.example:1/?plugin=v2ray-plugin".into())
                .expect_err("plugin");
        match e {
            KerntunError::Link { reason } => {
                assert!(reason.contains("v2ray-plugin"), "{reason}");
                assert!(!reason.contains("secret"), "{reason}");
            }
            other => panic!("wrong error {other:?}"),
        }
    }

    #[test]
    fn outbounds_and_rule_targets_translate() {
        let mut c = EngineConfig::default();
        c.outbounds.insert(
            "proxy".into(),
            Outbound::Shadowsocks {
                server: "[fd00::5]:8388".into(),
                method: ShadowsocksMethod::Chacha20IetfPoly1305,
                password: "secret".into(),
                udp: OutboundUdp::Refuse,
            },
        );
        c.outbounds.insert(
            "socks".into(),
            Outbound::Socks5 {
                server: "198.19.1.2:1080".into(),
                username: None,
                password: None,
                udp: OutboundUdp::Direct,
            },
        );
        c.rules.push(RuleOptions {
            ports: Some("443".into()),
            action: RuleAction::Outbound {
                name: "proxy".into(),
            },
            ..Default::default()
        });
        c.relay.splice = false;
        let k = c.to_core().expect("translate");
        assert_eq!(k.rules[0].action, Action::Outbound("proxy".into()));
        assert_eq!(k.outbounds.len(), 2);
        match &k.outbounds["proxy"] {
            core::OutboundConfig::Shadowsocks(s) => {
                assert_eq!(s.server.to_string(), "[fd00::5]:8388");
                assert_eq!(s.method, core::ShadowsocksMethod::Chacha20IetfPoly1305);
                assert_eq!(s.udp, core::OutboundUdp::Refuse);
            }
            other => panic!("wrong outbound {other:?}"),
        }
        assert_eq!(k.outbounds["socks"].udp(), core::OutboundUdp::Direct);
        assert!(!k.relay.splice);
        assert_eq!(k.relay.pipe_size, core::RelayConfig::default().pipe_size);
        assert_eq!(k.validate(), Ok(()));

        c.outbounds.insert(
            "bad".into(),
            Outbound::Socks5 {
                server: "nowhere".into(),
                username: None,
                password: None,
                udp: OutboundUdp::Relay,
            },
        );
        match c.to_core() {
            Err(KerntunError::Config { field, .. }) => assert_eq!(field, "outbounds.bad.server"),
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn include_all_networks_reaches_the_core() {
        let mut c = EngineConfig::default();
        assert!(!c.tun.include_all_networks);
        c.tun.include_all_networks = true;
        let k = c.to_core().expect("translate");
        assert!(k.tun.include_all_networks);
        assert_eq!(k.validate(), Ok(()), "auto falls back to smoltcp");
        c.stack = Some(Stack::System);
        let refused = c
            .to_core()
            .expect("translate")
            .validate()
            .expect_err("refused");
        match KerntunError::from(refused) {
            KerntunError::Config { field, reason } => {
                assert_eq!(field, "stack");
                assert!(reason.contains("includeAllNetworks"), "{reason}");
            }
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn rules_and_overrides_translate() {
        let mut c = EngineConfig {
            stack: Some(Stack::System),
            driver: Some(Driver::PerPacket),
            ..Default::default()
        };
        c.tun.mtu = 9000;
        c.tun.ipv6 = Some("fd00:18::1/64".into());
        c.tun.window_clamp = Some(false);
        c.budget.tcp_sessions = Some(7);
        c.rules.push(RuleOptions {
            cidr: Some("198.19.9.0/24".into()),
            ports: Some("80-90".into()),
            action: RuleAction::Reject,
            ..Default::default()
        });
        c.rules.push(RuleOptions {
            network: Some(RuleNetwork::Udp),
            ports: Some("443".into()),
            domain_suffix: vec!["video.test".into()],
            action: RuleAction::Reject,
            ..Default::default()
        });
        let k = c.to_core().expect("translate");
        assert_eq!(k.stack, core::StackKind::System);
        assert_eq!(k.driver, core::DriverMode::PerPacket);
        assert_eq!(k.tun.mtu, 9000);
        assert_eq!(k.tun.window_clamp, Some(false));
        assert_eq!(
            EngineConfig::default()
                .to_core()
                .expect("defaults")
                .tun
                .window_clamp,
            None
        );
        assert_eq!(k.tun.ipv6, Some("fd00:18::1/64".parse().expect("net")));
        assert_eq!(k.budget.tcp_sessions, Some(7));
        assert_eq!(k.rules.len(), 2);
        assert_eq!(k.rules[0].action, Action::Reject);
        assert_eq!(k.rules[0].network, None);
        assert_eq!(k.rules[1].network, Some(Network::Udp));
        assert_eq!(k.rules[1].domain_suffix, ["video.test"]);
        assert_eq!(k.validate(), Ok(()));
    }

    #[test]
    fn domain_rules_dns_and_sniff_translate() {
        let mut c = EngineConfig::default();
        c.rules.push(RuleOptions {
            ports: Some("443".into()),
            domain: vec!["a.test".into()],
            domain_suffix: vec!["b.test".into()],
            domain_keyword: vec!["ads".into()],
            domain_list: Some("/etc/kerntun/list.txt".into()),
            action: RuleAction::Reject,
            ..Default::default()
        });
        c.rules.push(RuleOptions {
            packages: vec!["com.example.app".into()],
            uids: vec![10_123],
            action: RuleAction::Reject,
            ..Default::default()
        });
        c.dns = DnsOptions {
            enabled: true,
            hijack: vec!["198.18.0.1".into(), "fd00:18::1".into()],
            upstreams: vec!["udp://198.19.1.2:53".into()],
            cache_entries: 10,
            fake_ip: true,
            fake_ip_pool: "198.19.128.0/18".into(),
            fake_ip_pool6: Some("fd00:99::/96".into()),
            fake_ip_entries: 100,
            fake_ip_filter: vec!["real.test".into()],
            tls_ca_file: Some("/data/ca.pem".into()),
            strategy: Some(DnsStrategy::Ipv4Only),
            ..Default::default()
        };
        c.sniff = SniffOptions {
            enabled: true,
            ports: Some(vec!["443".into(), "8000-8100".into()]),
            timeout_ms: 50,
        };
        let k = c.to_core().expect("translate");
        let r = &k.rules[0];
        assert_eq!(r.domain, ["a.test"]);
        assert_eq!(r.domain_suffix, ["b.test"]);
        assert_eq!(r.domain_keyword, ["ads"]);
        assert_eq!(
            r.domain_list.as_deref(),
            Some(std::path::Path::new("/etc/kerntun/list.txt"))
        );
        assert_eq!(r.ports, Some("443".parse().expect("port")));
        assert!(r.package.is_empty() && r.uid.is_empty());
        assert_eq!(k.rules[1].package, ["com.example.app"]);
        assert_eq!(k.rules[1].uid, [10_123]);
        assert_eq!(k.dns.hijack.len(), 2);
        assert_eq!(k.dns.hijack[1], "fd00:18::1".parse::<IpAddr>().expect("ip"));
        assert_eq!(k.dns.upstreams, ["udp://198.19.1.2:53"]);
        assert_eq!(k.dns.cache_entries, 10);
        assert!(k.dns.enabled && k.dns.fake_ip);
        assert_eq!(k.dns.fake_ip_pool, "198.19.128.0/18".parse().expect("net"));
        assert_eq!(
            k.dns.fake_ip_pool6,
            Some("fd00:99::/96".parse().expect("net"))
        );
        assert_eq!(k.dns.fake_ip_entries, 100);
        assert_eq!(k.dns.fake_ip_filter, ["real.test"]);
        assert_eq!(
            k.dns.tls_ca_file.as_deref(),
            Some(std::path::Path::new("/data/ca.pem"))
        );
        assert_eq!(k.sniff.ports.len(), 2);
        assert!(k.sniff.covers(8050) && !k.sniff.covers(80));
        assert_eq!(k.sniff.timeout_ms, 50);
        assert_eq!(k.dns.strategy, core::DnsStrategy::Ipv4Only);
        // No strategy given: automatic, the core's default.
        assert_eq!(DnsOptions::default().strategy, None);
        c.dns.strategy = None;
        assert_eq!(
            c.to_core().expect("translate").dns.strategy,
            core::DnsStrategy::Auto
        );
        // Sniffing on by default with the core's ports; an empty list is no ports.
        assert_eq!(
            EngineConfig::default().to_core().expect("defaults").sniff,
            core::SniffConfig::default()
        );
        c.sniff.ports = Some(Vec::new());
        assert!(!c.to_core().expect("translate").sniff.covers(443));
    }

    /// The library as this repository's scripts build it for iOS and
    /// Android (no `dot`/`doh` feature) refuses `tls://` and `https://`
    /// upstreams at start, naming the feature.
    #[cfg(not(any(feature = "dot", feature = "doh")))]
    #[test]
    fn encrypted_upstreams_are_refused_without_their_feature() {
        for (up, feature) in [
            ("tls://1.1.1.1:853#cloudflare-dns.com", "`dot`"),
            ("https://1.1.1.1/dns-query#cloudflare-dns.com", "`doh`"),
        ] {
            let mut c = EngineConfig::default();
            c.dns.enabled = true;
            c.dns.upstreams = vec!["udp://198.19.1.2:53".into(), up.into()];
            let err = c
                .to_core()
                .expect("translate")
                .validate()
                .map_err(KerntunError::from);
            match err {
                Err(KerntunError::Config { field, reason }) => {
                    assert_eq!(field, "dns.upstreams");
                    assert!(reason.contains(feature), "{reason}");
                }
                other => panic!("{up}: expected a config error, got {other:?}"),
            }
        }
    }

    /// `"platform"` passes through the FFI and validates, alone or with
    /// servers; a near miss is a `Config` error on `dns.upstreams` naming
    /// both forms.
    #[test]
    fn the_platform_upstream_is_accepted_and_a_near_miss_named() {
        let with = |ups: &[&str]| {
            let mut c = EngineConfig::default();
            c.dns.enabled = true;
            c.dns.upstreams = ups.iter().map(|u| u.to_string()).collect();
            c.to_core()
                .expect("translate")
                .validate()
                .map_err(KerntunError::from)
        };
        assert_eq!(with(&["platform"]), Ok(()));
        assert_eq!(with(&["platform", "udp://198.19.1.2:53"]), Ok(()));
        match with(&["Platform"]) {
            Err(KerntunError::Config { field, reason }) => {
                assert_eq!(field, "dns.upstreams");
                assert!(reason.contains("\"platform\""), "{reason}");
            }
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn dns_and_sniff_errors_name_their_field() {
        let field_of = |c: &EngineConfig| match c.to_core() {
            Err(KerntunError::Config { field, .. }) => field,
            Ok(k) => match k.validate().map_err(KerntunError::from) {
                Err(KerntunError::Config { field, .. }) => field,
                other => panic!("expected a config error, got {other:?}"),
            },
            other => panic!("expected a config error, got {other:?}"),
        };
        let mut c = EngineConfig::default();
        c.dns.hijack = vec!["198.18.0.1".into(), "dns.google".into()];
        assert_eq!(field_of(&c), "dns.hijack[1]");
        let mut c = EngineConfig::default();
        c.dns.fake_ip_pool = "198.18.128.0/33".into();
        assert_eq!(field_of(&c), "dns.fake_ip_pool");
        let mut c = EngineConfig::default();
        c.dns.fake_ip_pool6 = Some("198.18.0.0/16".into());
        assert_eq!(field_of(&c), "dns.fake_ip_pool6");
        let mut c = EngineConfig::default();
        c.sniff.ports = Some(vec!["443".into(), "x".into()]);
        assert_eq!(field_of(&c), "sniff.ports[1]");
        // Checked by the core at start, reported the same way.
        let mut c = EngineConfig::default();
        c.dns.enabled = true;
        assert_eq!(field_of(&c), "dns.upstreams");
        c.dns.upstreams = vec!["udp://198.19.1.2:53".into()];
        c.dns.fake_ip = true;
        c.dns.fake_ip_pool = "10.0.0.0/8".into();
        assert_eq!(field_of(&c), "dns.fake_ip_pool");
        let mut c = EngineConfig::default();
        c.sniff.timeout_ms = 0;
        assert_eq!(field_of(&c), "sniff.timeout_ms");
        // A domain list is read when the engine starts; its error names the rule.
        let e = KerntunError::from(core::ConfigError::BadRule {
            rule: 2,
            reason: "domain_list /x: line 3: ...".into(),
        });
        assert!(
            matches!(e, KerntunError::Config { ref field, .. } if field == "rules[2]"),
            "{e:?}"
        );
    }
}
