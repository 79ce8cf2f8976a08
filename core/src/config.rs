//! Engine configuration: what the CLI reads from TOML and the FFI builds from
//! records. Every field has a default that works on the platform it is
//! compiled for; [`Config::validate`] turns a bad combination into a
//! [`ConfigError`] that names the field before anything is opened.
//!
//! Each section belongs to the module that reads it (`[tun]` to
//! [`crate::tun`], `[budget]` to [`crate::budget`], `[dns]` to
//! [`crate::dns`], ...), which also checks it and reports its own error.
//! This module only collects the sections and turns their errors into a
//! [`ConfigError`]: nothing below the engine imports it
//! (docs/architecture.md, "Layers").

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

pub use crate::budget::BudgetConfig;
pub use crate::dns::{DnsConfig, DnsConfigError, DnsStrategy};
use crate::nat::NatConfig;
pub use crate::outbound::SetupError;
pub use crate::outbound::config::{
    BadOutbound, DirectConfig, OutboundConfig, OutboundUdp, ShadowsocksConfig, ShadowsocksMethod,
    Socks5Config, UdpNat,
};
pub use crate::outbound::group::{BadGroup, GroupConfig, GroupKind};
pub use crate::relay::RelayConfig;
use crate::rules::{Action, Rule, RuleError};
pub use crate::sniff::{SniffConfig, SniffConfigError};
pub use crate::translate::nat_address;
pub use crate::tun::TunConfig;

/// Which TCP stack turns TUN packets into streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StackKind {
    /// The engine's choice, logged with its reason at start: the system
    /// stack (no per-connection socket buffers, splice for direct traffic),
    /// and smoltcp wherever the kernel listener cannot work
    /// (`tun.include_all_networks`).
    #[default]
    Auto,
    /// Kernel TCP behind an in-place NAT (docs/architecture.md): the
    /// only stack with the splice(2) relay. Refused with
    /// `tun.include_all_networks`.
    System,
    /// A userspace TCP stack (smoltcp).
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
    /// One packet per read/write, draining up to 64 packets per readiness edge.
    PerPacket,
}

/// Timeouts of the flow tables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutConfig {
    /// Idle UDP flows are closed after this many seconds.
    pub udp_idle_s: u64,
    /// UDP flows that never saw a reply are closed after this many idle
    /// seconds (at most `udp_idle_s`), and are evicted first when the flow
    /// budget is full.
    pub udp_unreplied_s: u64,
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
            udp_unreplied_s: 30,
            tcp_idle_s: 7_440,
            tcp_linger_s: 10,
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
    /// Outbound groups (`[groups.NAME]`), which rules may name like outbounds.
    pub groups: BTreeMap<String, GroupConfig>,
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
        "rules[{rule}].action: no outbound named {name:?} (direct, reject, or a key of [outbounds] or [groups])"
    )]
    UnknownOutbound { rule: usize, name: String },
    /// An outbound's settings are unusable.
    #[error("outbounds.{name}: {reason}")]
    BadOutbound { name: String, reason: String },
    /// A group's settings are unusable (the reason starts with the field).
    #[error("groups.{name}: {reason}")]
    BadGroup { name: String, reason: String },
    /// A rule's condition is unusable (e.g. a domain list that cannot be read).
    #[error("rules[{rule}]: {reason}")]
    BadRule { rule: usize, reason: String },
    /// A `[dns]` setting is unusable.
    #[error("dns.{field}: {reason}")]
    Dns { field: &'static str, reason: String },
    /// A `[sniff]` setting is unusable.
    #[error("sniff.{field}: {reason}")]
    Sniff { field: &'static str, reason: String },
    /// A `[direct]` setting is unusable (the text starts with its field).
    #[error("direct.{0}")]
    Direct(String),
}

impl From<RuleError> for ConfigError {
    fn from(e: RuleError) -> Self {
        match e {
            RuleError::Bad { rule, reason } => ConfigError::BadRule { rule, reason },
            RuleError::UnknownOutbound { rule, name } => {
                ConfigError::UnknownOutbound { rule, name }
            }
        }
    }
}

impl From<BadOutbound> for ConfigError {
    fn from(BadOutbound { name, reason }: BadOutbound) -> Self {
        ConfigError::BadOutbound { name, reason }
    }
}

impl From<BadGroup> for ConfigError {
    fn from(BadGroup { name, reason }: BadGroup) -> Self {
        ConfigError::BadGroup { name, reason }
    }
}

impl From<SetupError> for ConfigError {
    fn from(e: SetupError) -> Self {
        match e {
            SetupError::Outbound(b) => b.into(),
            SetupError::Rule(r) => r.into(),
            SetupError::Group(g) => g.into(),
        }
    }
}

impl From<DnsConfigError> for ConfigError {
    fn from(DnsConfigError { field, reason }: DnsConfigError) -> Self {
        ConfigError::Dns { field, reason }
    }
}

impl From<SniffConfigError> for ConfigError {
    fn from(SniffConfigError { field, reason }: SniffConfigError) -> Self {
        ConfigError::Sniff { field, reason }
    }
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
        if let Some(field) = self.budget.zero_field() {
            return Err(ConfigError::ZeroBudget(field));
        }
        self.direct
            .parsed_bootstrap()
            .map_err(ConfigError::Direct)?;
        // The system stack holds the app's SYN in a HalfOpen NAT entry while
        // the outbound connects; past the entry's expiry its port may go to
        // another flow. Generations keep a late connect from touching that
        // flow (proto/src/nat/half_open.rs), and this bound keeps a direct
        // connect from ever arriving that late.
        let max_ms =
            u64::try_from(NatConfig::default().half_open_timeout.as_millis()).unwrap_or(u64::MAX);
        let ms = self.direct.connect_timeout_ms;
        if ms >= max_ms {
            return Err(ConfigError::Direct(format!(
                "connect_timeout_ms: {ms} must be below {max_ms}: an outbound connect may not outlive the NAT entry that holds its SYN"
            )));
        }
        for (name, o) in &self.outbounds {
            o.check(name)?;
        }
        crate::outbound::group::check(&self.groups, |n| self.outbounds.contains_key(n))?;
        for (i, r) in self.rules.iter().enumerate() {
            if let Action::Outbound(name) = &r.action
                && !self.outbounds.contains_key(name.as_ref())
                && !self.groups.contains_key(name.as_ref())
            {
                return Err(ConfigError::UnknownOutbound {
                    rule: i,
                    name: name.to_string(),
                });
            }
        }
        self.dns.validate(&self.reserved_addresses())?;
        self.sniff.validate()?;
        Ok(())
    }

    /// The TUN's gateway and NAT addresses: what no other service (the DNS
    /// service's fake-ip pool) may hand out.
    pub fn reserved_addresses(&self) -> Vec<IpAddr> {
        self.tun
            .nets()
            .into_iter()
            .flat_map(|net| [Some(net.addr()), nat_address(net)])
            .flatten()
            .collect()
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
                ConfigError::BadOutbound { name, .. } => key_line(text, "outbounds", name),
                ConfigError::BadGroup { name, .. } => key_line(text, "groups", name),
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

    /// Idle timeout of a UDP flow that never saw a reply (at most
    /// [`udp_idle`](Self::udp_idle)).
    pub fn udp_unreplied(&self) -> Duration {
        Duration::from_secs(self.timeouts.udp_unreplied_s.max(1)).min(self.udp_idle())
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

/// The line of `[SECTION.NAME]` (bare or quoted key).
fn key_line(text: &str, section: &str, name: &str) -> Option<usize> {
    let forms = [
        format!("[{section}.{name}]"),
        format!("[{section}.\"{name}\"]"),
    ];
    text.lines()
        .position(|l| forms.iter().any(|f| l.trim() == f))
        .map(|i| i + 1)
}

/// The `[SECTION.NAME]` tables of a TOML text, by name (a test's fixture,
/// parsed alone); the toml crate's message, with its line, on an error.
#[cfg(test)]
pub(crate) fn toml_tables<T: serde::de::DeserializeOwned>(
    text: &str,
    section: &str,
) -> Result<BTreeMap<String, T>, String> {
    let mut sections: BTreeMap<String, BTreeMap<String, T>> =
        toml::from_str(text).map_err(|e| e.to_string())?;
    sections
        .remove(section)
        .ok_or_else(|| format!("no [{section}] tables"))
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

    /// `budget.tcp_flows` was `nat_entries` when only the system stack read
    /// it: configurations that set the old name keep their bound.
    #[test]
    fn budget_tcp_flows_is_also_read_as_nat_entries() {
        for name in ["tcp_flows", "nat_entries"] {
            let c = Config::from_toml(&format!("[budget]\n{name} = 64\n")).expect("config");
            assert_eq!(c.budget.tcp_flows, Some(64), "{name}");
        }
        let both = "[budget]\ntcp_flows = 64\nnat_entries = 32\n";
        let e = Config::from_toml(both).expect_err("one bound, set twice");
        assert!(e.contains("tcp_flows"), "{e}");
    }

    #[test]
    fn a_connect_timeout_reaching_the_half_open_expiry_is_refused() {
        let half_open = NatConfig::default().half_open_timeout.as_millis() as u64;
        let mut c = Config::default();
        c.direct.connect_timeout_ms = half_open - 1;
        assert_eq!(c.validate(), Ok(()));
        for ms in [half_open, half_open + 1, u64::MAX] {
            c.direct.connect_timeout_ms = ms;
            let e = c.validate().expect_err("refused");
            assert!(
                e.to_string().starts_with("direct.connect_timeout_ms: "),
                "the error names the field: {e}"
            );
        }
        let e = Config::from_toml("[direct]\nconnect_timeout_ms = 60000\n").expect_err("refused");
        assert!(e.contains("must be below 30000"), "{e}");
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

    /// `dns.strategy` from TOML: the four names; anything else is an
    /// error that shows the line and the names accepted.
    #[test]
    fn dns_strategy_from_toml() {
        let dns = "[dns]\nenabled = true\nupstreams = [\"udp://192.0.2.53:53\"]\n";
        assert_eq!(
            Config::from_toml(dns).expect("default").dns.strategy,
            DnsStrategy::Auto
        );
        for (text, want) in [
            ("auto", DnsStrategy::Auto),
            ("dual_stack", DnsStrategy::DualStack),
            ("ipv4_only", DnsStrategy::Ipv4Only),
        ] {
            let c = Config::from_toml(&format!("{dns}strategy = \"{text}\"\n")).expect(text);
            assert_eq!(c.dns.strategy, want);
        }
        let e = Config::from_toml(&format!("{dns}strategy = \"ipv6_only\"\n"))
            .expect_err("the default TUN has no IPv6");
        assert!(
            e.starts_with("dns.strategy: ipv6_only needs tun.ipv6"),
            "{e}"
        );
        let e = Config::from_toml(&format!("{dns}strategy = \"prefer_ipv4\"\n"))
            .expect_err("not a strategy");
        assert!(e.contains("strategy = \"prefer_ipv4\""), "{e}");
        assert!(e.contains("`ipv4_only`"), "{e}");
    }

    #[test]
    fn outbounds_rules_and_relay_from_toml() {
        let c = Config::from_toml(OUTBOUNDS).expect("parse");
        assert_eq!(c.outbounds.len(), 3);
        assert!(!c.relay.splice);
        assert_eq!(c.relay.pipe_size, crate::relay::PIPE_SIZE);
        match &c.outbounds["ss-none"] {
            OutboundConfig::Shadowsocks(s) => {
                assert_eq!(s.method, ShadowsocksMethod::None);
                assert_eq!(s.udp, OutboundUdp::Relay, "udp defaults to relayed");
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
        let colour = 1 + text.lines().position(|l| l == "colour = 1").expect("l");
        assert!(
            e.contains(&format!("line {colour}")) && e.contains("colour"),
            "the line of the unknown field itself: {e}"
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
