//! Engine configuration: what the CLI reads from TOML and the FFI builds from
//! records. Every field has a default that works on the platform it is
//! compiled for; [`Config::validate`] turns a bad combination into a
//! [`ConfigError`] that names the field before anything is opened.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use crate::budget::Platform;
use crate::rules::Rule;

/// Which TCP stack turns TUN packets into streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StackKind {
    /// The platform default: the system stack.
    #[default]
    Auto,
    /// Kernel TCP behind an in-place NAT (DESIGN.md "system netstack").
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
}

impl Default for TunConfig {
    fn default() -> Self {
        Self {
            name: "kerntun0".into(),
            mtu: Platform::current().default_mtu(),
            ipv4: Some(Ipv4Net::new(Ipv4Addr::new(198, 18, 0, 1), 16).expect("static prefix")),
            ipv6: None,
            tx_queue_len: 10_000,
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
    /// Ordered rules; the first match decides. No match means `direct`.
    pub rules: Vec<Rule>,
    /// Tokio worker threads of the engine's own runtime (0 = platform default).
    pub workers: usize,
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
        Ok(())
    }

    /// UDP idle timeout.
    pub fn udp_idle(&self) -> Duration {
        Duration::from_secs(self.timeouts.udp_idle_s.max(1))
    }
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
}
