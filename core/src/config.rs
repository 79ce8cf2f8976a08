//! Engine configuration: what the CLI reads from TOML and the FFI builds from
//! records. Every field has a default that works on the platform it is
//! compiled for; [`Config::validate`] turns a bad combination into a
//! [`ConfigError`] that names the field before anything is opened.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use crate::budget::Platform;
pub use crate::dns::DnsConfig;
use crate::rules::{Action, Rule};
pub use crate::sniff::SniffConfig;

/// Which TCP stack turns TUN packets into streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StackKind {
    /// The platform's choice, logged with its reason at start: the system
    /// stack on iOS/Android (no per-connection socket buffers in the 50 MiB
    /// extension budget), smoltcp on desktop (no NAT address or kernel
    /// listener to set up, the TUN is the only thing it needs), and smoltcp
    /// wherever the kernel listener cannot work (`tun.include_all_networks`).
    #[default]
    Auto,
    /// Kernel TCP behind an in-place NAT (DESIGN.md "system netstack"): the
    /// only stack with the splice(2) relay. Refused with
    /// `tun.include_all_networks`.
    System,
    /// A userspace TCP stack (smoltcp, DESIGN.md part 7).
    Smoltcp,
}

/// How the TUN device is read and written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DriverMode {
    /// Batched GRO/GSO I/O where the device supports offload, else per-packet.
    #[default]
    Auto,
    /// Linux `virtio_net_hdr` offload: one read may carry a 64 KiB TCP super-packet.
    Batch,
    /// One packet per read/write, draining up to 32 packets per readiness edge.
    PerPacket,
}

/// The TUN device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TunConfig {
    /// Interface name when kerntun creates the device (Linux desktop).
    pub name: String,
    /// Device MTU. Desktop Linux default 65535; iOS 4064 and Android 9000 are the
    /// values peers settled on (DESIGN.md "Field notes").
    pub mtu: u16,
    /// Gateway address and prefix, e.g. `198.18.0.1/16`. The NAT address is gateway + 1.
    pub ipv4: Option<Ipv4Net>,
    /// IPv6 gateway address and prefix, e.g. `fd00:18::1/64`.
    pub ipv6: Option<Ipv6Net>,
    /// Transmit queue length set on a device kerntun creates. The kernel default of
    /// 500 overflows under load (seed measurements); 10000 is what the benchmarks use.
    pub tx_queue_len: u32,
    /// iOS: the tunnel's `NETunnelProviderProtocol.includeAllNetworks` is on.
    /// The system then routes everything, loopback included, into the tunnel
    /// and the engine's kernel listener never sees the rewritten SYNs, so the
    /// system stack cannot work: `auto` picks smoltcp and an explicit
    /// `stack = "system"` is refused.
    pub include_all_networks: bool,
}

impl Default for TunConfig {
    fn default() -> Self {
        Self {
            name: "kerntun0".into(),
            mtu: Platform::current().default_mtu(),
            ipv4: Some(Ipv4Net::new(Ipv4Addr::new(198, 18, 0, 1), 16).expect("static prefix")),
            ipv6: None,
            tx_queue_len: 10_000,
            include_all_networks: false,
        }
    }
}

/// How direct outbound sockets avoid looping back into the TUN.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DirectConfig {
    /// Bind outbound sockets to this interface (`SO_BINDTODEVICE`).
    pub interface: Option<String>,
    /// Mark outbound sockets (`SO_MARK`) for policy routing.
    pub fwmark: Option<u32>,
    /// Upper bound on an outbound TCP connect; the app sees a reset after it.
    pub connect_timeout_ms: u64,
}

impl Default for DirectConfig {
    fn default() -> Self {
        Self {
            interface: None,
            fwmark: None,
            connect_timeout_ms: 5_000,
        }
    }
}

/// Limits that come from the platform unless overridden (DESIGN.md part 10).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetConfig {
    /// Platform whose budget is the starting point; defaults to the build target.
    pub platform: Option<Platform>,
    /// NAT entries (system stack).
    pub nat_entries: Option<usize>,
    /// TCP admission permits at normal pressure (elevated and critical are 1/2 and 1/4).
    pub tcp_sessions: Option<usize>,
    /// Concurrent UDP flows; the least recently used flow is evicted past it.
    pub udp_flows: Option<usize>,
    /// Kernel listener backlog.
    pub backlog: Option<u32>,
    /// Userspace relay buffer per direction, allocated only while data flows.
    pub relay_buffer: Option<usize>,
}

/// Timeouts of the flow tables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutConfig {
    /// Idle UDP flows are closed after this many seconds.
    pub udp_idle_s: u64,
    /// Active TCP NAT entries with no packet for this long are dropped
    /// (RFC 5382 REQ-5 asks for at least 2 h 4 min).
    pub tcp_idle_s: u64,
    /// Closing NAT entries are kept this long so late FIN/ACKs are translated.
    pub tcp_linger_s: u64,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        Self {
            udp_idle_s: 60,
            tcp_idle_s: 7_440,
            tcp_linger_s: 10,
        }
    }
}

/// A Shadowsocks method (the names shadowsocks-rust uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShadowsocksMethod {
    /// No encryption: the target address, then the application's bytes
    /// unchanged (spliced on Linux/Android).
    #[serde(rename = "none", alias = "plain")]
    None,
    #[serde(rename = "aes-128-gcm")]
    Aes128Gcm,
    #[serde(rename = "aes-256-gcm")]
    Aes256Gcm,
    #[serde(rename = "chacha20-ietf-poly1305")]
    Chacha20IetfPoly1305,
    /// AEAD-2022: the password is a base64 16-byte key.
    #[serde(rename = "2022-blake3-aes-128-gcm")]
    Blake3Aes128Gcm,
    /// AEAD-2022: the password is a base64 32-byte key.
    #[serde(rename = "2022-blake3-aes-256-gcm")]
    Blake3Aes256Gcm,
}

/// A Shadowsocks server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShadowsocksConfig {
    /// The server's IP address and port (not resolved: the engine has no DNS).
    pub server: SocketAddr,
    pub method: ShadowsocksMethod,
    /// The password (SIP004 methods), or the base64 key (AEAD-2022); ignored by `none`.
    #[serde(default)]
    pub password: String,
    /// Relay UDP flows through the server too (else they go direct).
    #[serde(default = "yes")]
    pub udp: bool,
}

/// A SOCKS5 proxy (RFC 1928), optionally with username/password (RFC 1929).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Socks5Config {
    /// The proxy's IP address and port.
    pub server: SocketAddr,
    /// Username and password go together, 1..=255 bytes each.
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// Relay UDP flows with UDP ASSOCIATE (else they go direct).
    #[serde(default = "yes")]
    pub udp: bool,
}

fn yes() -> bool {
    true
}

/// A named proxy outbound that rules can send flows to (`action = "<name>"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutboundConfig {
    Socks5(Socks5Config),
    Shadowsocks(ShadowsocksConfig),
}

impl OutboundConfig {
    /// The proxy's address (where the engine's sockets connect).
    pub fn server(&self) -> SocketAddr {
        match self {
            OutboundConfig::Socks5(c) => c.server,
            OutboundConfig::Shadowsocks(c) => c.server,
        }
    }
}

/// How TCP bytes move between the app's socket and the outbound's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RelayConfig {
    /// Linux/Android: relay plain kernel sockets (direct, SOCKS5, Shadowsocks
    /// `none`) with splice(2), so the payload never enters userspace. `false`
    /// forces the userspace copy (for comparisons). Ignored elsewhere.
    pub splice: bool,
    /// Pipe capacity asked for per spliced direction (best effort; a smaller
    /// pipe than 64 KiB means the userspace copy).
    pub pipe_size: usize,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            splice: true,
            pipe_size: crate::relay::PIPE_SIZE,
        }
    }
}

/// Everything [`crate::Engine::start`] needs besides the device itself.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub stack: StackKind,
    pub driver: DriverMode,
    pub tun: TunConfig,
    pub direct: DirectConfig,
    pub budget: BudgetConfig,
    pub timeouts: TimeoutConfig,
    /// Ordered rules; the first match decides. No match means `direct`; a
    /// rule with neither `cidr` nor `ports` is a catch-all default.
    pub rules: Vec<Rule>,
    /// Tokio worker threads of the engine's own runtime (0 = platform default).
    pub workers: usize,
    /// Named proxies (`[outbounds.NAME]`), the targets of rule actions.
    pub outbounds: BTreeMap<String, OutboundConfig>,
    /// TCP relay options (`[relay]`).
    pub relay: RelayConfig,
    /// DNS hijack, forwarding, cache and fake-ip (`[dns]`).
    pub dns: crate::dns::DnsConfig,
    /// Domain sniffing from TLS SNI / HTTP Host (`[sniff]`).
    pub sniff: crate::sniff::SniffConfig,
}

/// A configuration the engine refuses, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Neither `tun.ipv4` nor `tun.ipv6` is set.
    #[error("tun: at least one of tun.ipv4 / tun.ipv6 must be set")]
    NoAddress,
    /// The prefix leaves no room for gateway + 1 as the NAT address.
    #[error("tun.{field}: {net} has no usable address after the gateway for NAT")]
    NoRoomForNat { field: &'static str, net: IpNet },
    /// MTU outside what IPv4/IPv6 over a TUN can carry.
    #[error("tun.mtu: {0} is outside 1280..=65535")]
    BadMtu(u16),
    /// A zero budget would refuse everything.
    #[error("budget.{0}: must be greater than zero")]
    ZeroBudget(&'static str),
    /// The chosen stack is not available in this build or platform.
    #[error("stack: {0}")]
    UnsupportedStack(&'static str),
    /// A rule names an outbound that is not configured.
    #[error(
        "rules[{rule}].action: no outbound named {name:?} (direct, reject, or a key of [outbounds])"
    )]
    UnknownOutbound { rule: usize, name: String },
    /// An outbound's settings are unusable.
    #[error("outbounds.{name}: {reason}")]
    BadOutbound { name: String, reason: String },
    /// A rule's condition is unusable (e.g. a domain list that cannot be read).
    #[error("rules[{rule}]: {reason}")]
    BadRule { rule: usize, reason: String },
    /// A `[dns]` setting is unusable.
    #[error("dns.{field}: {reason}")]
    Dns { field: &'static str, reason: String },
    /// A `[sniff]` setting is unusable.
    #[error("sniff.{field}: {reason}")]
    Sniff { field: &'static str, reason: String },
}

impl Config {
    /// Check the combination before any descriptor is opened.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tun.ipv4.is_none() && self.tun.ipv6.is_none() {
            return Err(ConfigError::NoAddress);
        }
        if self.tun.mtu < 1280 {
            return Err(ConfigError::BadMtu(self.tun.mtu));
        }
        if self.tun.include_all_networks && self.stack == StackKind::System {
            // Not a platform check: the host tells us the tunnel captures
            // everything, and then no SYN rewritten to the NAT address ever
            // reaches the kernel listener, whatever the OS.
            return Err(ConfigError::UnsupportedStack(
                "\"system\" needs a kernel listener that includeAllNetworks (tun.include_all_networks) cuts off; use \"smoltcp\" or \"auto\"",
            ));
        }
        if let Some(net) = self.tun.ipv4 {
            nat_address(IpNet::V4(net)).ok_or(ConfigError::NoRoomForNat {
                field: "ipv4",
                net: IpNet::V4(net),
            })?;
        }
        if let Some(net) = self.tun.ipv6 {
            nat_address(IpNet::V6(net)).ok_or(ConfigError::NoRoomForNat {
                field: "ipv6",
                net: IpNet::V6(net),
            })?;
        }
        let b = &self.budget;
        for (name, v) in [
            ("nat_entries", b.nat_entries),
            ("tcp_sessions", b.tcp_sessions),
            ("udp_flows", b.udp_flows),
            ("relay_buffer", b.relay_buffer),
        ] {
            if v == Some(0) {
                return Err(ConfigError::ZeroBudget(name));
            }
        }
        if b.backlog == Some(0) {
            return Err(ConfigError::ZeroBudget("backlog"));
        }
        for (name, o) in &self.outbounds {
            check_outbound(name, o)?;
        }
        for (i, r) in self.rules.iter().enumerate() {
            if let Action::Outbound(name) = &r.action
                && !self.outbounds.contains_key(name.as_ref())
            {
                return Err(ConfigError::UnknownOutbound {
                    rule: i,
                    name: name.to_string(),
                });
            }
        }
        self.dns.validate(&self.tun)?;
        self.sniff.validate()?;
        Ok(())
    }

    /// Parse the engine's TOML and validate it. Syntax and type errors name
    /// the line and column (the toml crate's message); a validation error
    /// about a rule or an outbound names the line its table starts on.
    pub fn from_toml(text: &str) -> Result<Config, String> {
        let cfg: Config = toml::from_str(text).map_err(|e| e.to_string())?;
        if let Err(e) = cfg.validate() {
            let line = match &e {
                ConfigError::UnknownOutbound { rule, .. } | ConfigError::BadRule { rule, .. } => {
                    table_line(text, "[[rules]]", *rule)
                }
                ConfigError::BadOutbound { name, .. } => outbound_line(text, name),
                _ => None,
            };
            return Err(match line {
                Some(l) => format!("line {l}: {e}"),
                None => e.to_string(),
            });
        }
        Ok(cfg)
    }

    /// UDP idle timeout.
    pub fn udp_idle(&self) -> Duration {
        Duration::from_secs(self.timeouts.udp_idle_s.max(1))
    }
}

/// The 1-based line of the `n`-th occurrence of a table header.
fn table_line(text: &str, header: &str, n: usize) -> Option<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| l.trim_start().starts_with(header))
        .nth(n)
        .map(|(i, _)| i + 1)
}

/// The line of `[outbounds.NAME]` (bare or quoted key).
fn outbound_line(text: &str, name: &str) -> Option<usize> {
    let forms = [
        format!("[outbounds.{name}]"),
        format!("[outbounds.\"{name}\"]"),
    ];
    text.lines()
        .position(|l| forms.iter().any(|f| l.trim() == f))
        .map(|i| i + 1)
}

/// Settings of one outbound that are wrong whatever the platform.
fn check_outbound(name: &str, o: &OutboundConfig) -> Result<(), ConfigError> {
    let bad = |reason: String| ConfigError::BadOutbound {
        name: name.to_owned(),
        reason,
    };
    if name == "direct" || name == "reject" {
        return Err(bad(
            "`direct` and `reject` are built in; pick another name".into()
        ));
    }
    match o {
        OutboundConfig::Socks5(c) => match (&c.username, &c.password) {
            (None, None) => {}
            (Some(u), Some(p)) => {
                if u.is_empty() || p.is_empty() || u.len() > 255 || p.len() > 255 {
                    return Err(bad("username and password must be 1..=255 bytes".into()));
                }
            }
            _ => return Err(bad("username and password go together".into())),
        },
        OutboundConfig::Shadowsocks(c) => {
            crate::outbound::shadowsocks::Key::new(c.method, &c.password)
                .map_err(|e| bad(e.to_string()))?;
            if c.method != ShadowsocksMethod::None && c.password.is_empty() {
                return Err(bad("password is empty".into()));
            }
        }
    }
    Ok(())
}

/// The NAT address of a gateway prefix: gateway + 1, which must stay inside the
/// prefix and not be its broadcast address (IPv4).
pub fn nat_address(net: IpNet) -> Option<IpAddr> {
    match net {
        IpNet::V4(n) => {
            let next = u32::from(n.addr()).checked_add(1)?;
            let a = Ipv4Addr::from(next);
            (n.contains(&a) && a != n.broadcast() && a != n.network()).then_some(IpAddr::V4(a))
        }
        IpNet::V6(n) => {
            let next = u128::from(n.addr()).checked_add(1)?;
            let a = Ipv6Addr::from(next);
            n.contains(&a).then_some(IpAddr::V6(a))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nat_address_is_gateway_plus_one_inside_prefix() {
        let net: IpNet = "198.18.0.1/16".parse().expect("net");
        assert_eq!(nat_address(net), Some("198.18.0.2".parse().expect("ip")));
        let tight: IpNet = "198.18.0.1/31".parse().expect("net");
        assert_eq!(nat_address(tight), None, "a /31 has no room for NAT");
        let bcast: IpNet = "198.18.0.254/24".parse().expect("net");
        assert_eq!(
            nat_address(bcast),
            None,
            "gateway+1 is the broadcast address"
        );
        let v6: IpNet = "fd00:18::1/64".parse().expect("net");
        assert_eq!(nat_address(v6), Some("fd00:18::2".parse().expect("ip")));
    }

    #[test]
    fn validate_names_the_field() {
        let mut c = Config::default();
        c.tun.ipv4 = None;
        assert_eq!(c.validate(), Err(ConfigError::NoAddress));
        let mut c = Config::default();
        c.budget.udp_flows = Some(0);
        assert_eq!(c.validate(), Err(ConfigError::ZeroBudget("udp_flows")));
        let mut c = Config::default();
        c.tun.mtu = 500;
        assert_eq!(c.validate(), Err(ConfigError::BadMtu(500)));
        assert_eq!(Config::default().validate(), Ok(()));
    }

    const OUTBOUNDS: &str = r#"
[outbounds.ss-none]
type = "shadowsocks"
server = "198.19.1.2:8388"
method = "none"

[outbounds.ss2022]
type = "shadowsocks"
server = "[fd00:19:1::2]:8389"
method = "2022-blake3-aes-256-gcm"
password = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="
udp = false

[outbounds.corp]
type = "socks5"
server = "127.0.0.1:1080"
username = "u"
password = "p"

[relay]
splice = false

[[rules]]
cidr = "10.0.0.0/8"
action = "corp"

[[rules]]
ports = "443"
action = "ss2022"

[[rules]]
action = "ss-none"
"#;

    #[test]
    fn outbounds_rules_and_relay_from_toml() {
        let c = Config::from_toml(OUTBOUNDS).expect("parse");
        assert_eq!(c.outbounds.len(), 3);
        assert!(!c.relay.splice);
        assert_eq!(c.relay.pipe_size, crate::relay::PIPE_SIZE);
        match &c.outbounds["ss-none"] {
            OutboundConfig::Shadowsocks(s) => {
                assert_eq!(s.method, ShadowsocksMethod::None);
                assert!(s.udp, "udp defaults to on");
            }
            o => panic!("wrong type {o:?}"),
        }
        assert_eq!(c.rules[2].action, Action::from("ss-none"));
        assert!(Config::default().relay.splice, "splice is on by default");
    }

    #[test]
    fn errors_name_the_line() {
        // A rule naming a missing outbound: the line of its [[rules]] table.
        let text = OUTBOUNDS.replace("action = \"ss2022\"", "action = \"nope\"");
        let e = Config::from_toml(&text).expect_err("unknown outbound");
        let line = OUTBOUNDS
            .lines()
            .position(|l| l.contains("ports = \"443\""))
            .expect("l");
        assert!(
            e.starts_with(&format!("line {line}: rules[1].action")),
            "{e}"
        );
        // A bad key: the line of its [outbounds.NAME] table.
        let text = OUTBOUNDS.replace("AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=", "short");
        let e = Config::from_toml(&text).expect_err("bad key");
        let line = 1 + OUTBOUNDS
            .lines()
            .position(|l| l == "[outbounds.ss2022]")
            .expect("l");
        assert!(
            e.starts_with(&format!("line {line}: outbounds.ss2022")),
            "{e}"
        );
        // Unknown fields and syntax errors: the toml crate's line numbers.
        let text = OUTBOUNDS.replace("udp = false", "udp = false\ncolour = 1");
        let e = Config::from_toml(&text).expect_err("unknown field");
        assert!(
            e.contains(&format!("line {line}")) && e.contains("colour"),
            "{e}"
        );
        let e = Config::from_toml("[relay]\nsplice = maybe\n").expect_err("syntax");
        assert!(e.contains("line 2"), "{e}");
        // Half a credential pair, and a built-in name.
        let text = OUTBOUNDS.replace("password = \"p\"\n", "");
        assert!(
            Config::from_toml(&text)
                .expect_err("creds")
                .contains("go together")
        );
        let text = OUTBOUNDS.replace("[outbounds.corp]", "[outbounds.direct]");
        assert!(
            Config::from_toml(&text)
                .expect_err("name")
                .contains("built in")
        );
    }

    #[test]
    fn toml_round_trip_with_rules() {
        let text = r#"
            stack = "system"
            driver = "per_packet"
            [tun]
            name = "kt0"
            mtu = 9000
            ipv4 = "198.18.0.1/16"
            ipv6 = "fd00:18::1/64"
            [direct]
            interface = "veth0"
            [[rules]]
            cidr = "198.19.9.0/24"
            action = "reject"
            [[rules]]
            ports = "8000-8999"
            action = "direct"
        "#;
        let c: Config = toml::from_str(text).expect("parse");
        assert_eq!(c.stack, StackKind::System);
        assert_eq!(c.driver, DriverMode::PerPacket);
        assert_eq!(c.tun.mtu, 9000);
        assert_eq!(c.rules.len(), 2);
        assert_eq!(c.validate(), Ok(()));
        let err = toml::from_str::<Config>("[tun]\nmtu = \"x\"\n").expect_err("bad type");
        assert!(err.to_string().contains("line 2"), "{err}");
    }

    #[test]
    fn include_all_networks_refuses_only_an_explicit_system_stack() {
        let c = Config::from_toml("[tun]\ninclude_all_networks = true\n").expect("auto is fine");
        assert!(c.tun.include_all_networks);
        assert!(
            !Config::default().tun.include_all_networks,
            "off unless the host says so"
        );
        for ok in ["auto", "smoltcp"] {
            let text = format!("stack = \"{ok}\"\n[tun]\ninclude_all_networks = true\n");
            assert!(Config::from_toml(&text).is_ok(), "{ok}");
        }
        let mut c = Config {
            stack: StackKind::System,
            ..Config::default()
        };
        assert_eq!(c.validate(), Ok(()), "system without the flag");
        c.tun.include_all_networks = true;
        let e = c.validate().expect_err("system with includeAllNetworks");
        assert!(matches!(e, ConfigError::UnsupportedStack(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.starts_with("stack: ")
                && msg.contains("includeAllNetworks")
                && msg.contains("smoltcp"),
            "the reason names the cause and the way out: {msg}"
        );
        let e = Config::from_toml("stack = \"system\"\n[tun]\ninclude_all_networks = true\n")
            .expect_err("toml too");
        assert!(e.contains("include_all_networks"), "{e}");
    }
}
