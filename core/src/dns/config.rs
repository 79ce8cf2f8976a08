//! `[dns]` in the engine's TOML.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use ipnet::{Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use crate::dnswire::{Upstream, UpstreamProto};

/// A `[dns]` field the engine cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("dns.{field}: {reason}")]
pub struct DnsConfigError {
    pub field: &'static str,
    pub reason: String,
}

/// The DNS service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DnsConfig {
    /// Answer hijacked queries. Off: port-53 traffic is an ordinary flow.
    pub enabled: bool,
    /// Destinations whose port-53 traffic (UDP and TCP) is hijacked. Empty:
    /// [`default_resolver`] of each TUN prefix (gateway + 2, e.g.
    /// `198.18.0.3`), the address the VPN profile should name as its DNS.
    pub hijack: Vec<IpAddr>,
    /// Hijack port 53 whatever the destination.
    pub hijack_all: bool,
    /// Answer TCP connections to port 853 (DNS over TLS) of the hijacked
    /// addresses with an RST (counted `dns_tls_reset`), so a resolver that
    /// tries TLS first (Android's Private DNS, automatic mode) falls back to
    /// port 53 and its queries reach kerntun's DNS instead of going around
    /// it. Off: such a connection is an ordinary flow.
    pub reset_dot: bool,
    /// Which address families A/AAAA queries are answered with; the
    /// others get an empty NOERROR answer (counted `strategy_empty`).
    pub strategy: DnsStrategy,
    /// Upstreams, tried in order: `udp://IP:PORT`, `tcp://IP:PORT`,
    /// `tls://IP:PORT#server-name` (DNS over TLS, feature `dot`),
    /// `https://IP[:PORT][/PATH]#server-name` (DNS over HTTPS, feature
    /// `doh`). Each is reached through the outbound the rules choose for its
    /// address. `"platform"` ([`PLATFORM_UPSTREAM`]) stands for the DNS
    /// servers of the network the host reported last
    /// (`Engine::network_changed`): UDP port 53, always sent direct.
    pub upstreams: Vec<String>,
    /// Time allowed to one upstream try.
    pub timeout_ms: u64,
    /// Cached answers (0 disables the cache).
    pub cache_entries: usize,
    /// Answer A/AAAA with addresses from the fake-ip pool.
    pub fake_ip: bool,
    /// IPv4 fake-ip pool; inside 198.18.0.0/15 and clear of the TUN's
    /// gateway and NAT addresses.
    pub fake_ip_pool: Ipv4Net,
    /// IPv6 fake-ip pool (AAAA for fake domains is answered empty without one).
    pub fake_ip_pool6: Option<Ipv6Net>,
    /// Domains holding a fake address at once; the least recently used one
    /// gives its address back past this.
    pub fake_ip_entries: usize,
    /// Domains (and their subdomains) that get real answers under fake-ip.
    pub fake_ip_filter: Vec<String>,
    /// Extra trust anchors (PEM) for `tls://` and `https://` upstreams, on top of the
    /// Mozilla roots: a private resolver's CA.
    pub tls_ca_file: Option<PathBuf>,
}

impl Default for DnsConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            hijack: Vec::new(),
            hijack_all: false,
            reset_dot: true,
            strategy: DnsStrategy::default(),
            upstreams: Vec::new(),
            timeout_ms: 2_000,
            cache_entries: 4_096,
            fake_ip: false,
            fake_ip_pool: Ipv4Net::new(Ipv4Addr::new(198, 18, 128, 0), 17).expect("static prefix"),
            fake_ip_pool6: None,
            fake_ip_entries: 65_536,
            fake_ip_filter: Vec::new(),
            tls_ca_file: None,
        }
    }
}

/// The `dns.upstreams` entry that stands for the network's own DNS
/// servers, as the host reports them (`Engine::network_changed`).
pub const PLATFORM_UPSTREAM: &str = "platform";

/// One `dns.upstreams` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamEntry {
    /// A server given by address (`udp://`, `tcp://`, `tls://`, `https://`).
    Server(Upstream),
    /// [`PLATFORM_UPSTREAM`]: the DNS servers of the network the host
    /// reported last, each over UDP port 53, sent direct whatever the
    /// rules say (they serve the network the device is on, and answer
    /// only from it); none until the host reports some.
    Platform,
}

impl std::str::FromStr for UpstreamEntry {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == PLATFORM_UPSTREAM {
            return Ok(UpstreamEntry::Platform);
        }
        if !s.contains("://") {
            return Err(format!(
                "{s:?}: expected \"{PLATFORM_UPSTREAM}\" or udp://, tcp://, tls:// or https://"
            ));
        }
        s.parse().map(UpstreamEntry::Server)
    }
}

/// Which address families hijacked A/AAAA queries are answered with
/// (`dns.strategy`). A query for a family left out gets NOERROR with no
/// records (RFC 2308's NODATA: the name exists, without records of that
/// type), whether fake-ip or an upstream would have answered it, so the
/// app uses the other family at once instead of trying an address that
/// cannot work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DnsStrategy {
    /// Both families, except AAAA when the TUN has no IPv6 address: an
    /// app's IPv6 connection would then not enter the tunnel, so it either
    /// fails or leaves outside it (on a host with an IPv6 route of its
    /// own).
    #[default]
    Auto,
    /// Both families, as the fake-ip pool or the upstream answers them,
    /// whatever the TUN has.
    DualStack,
    /// A only: AAAA is answered empty.
    Ipv4Only,
    /// AAAA only: A is answered empty (needs `tun.ipv6`).
    Ipv6Only,
}

impl DnsStrategy {
    /// The family answered empty (`Some(true)`: AAAA, `Some(false)`: A)
    /// on a TUN with an IPv6 address or not.
    pub fn empty_family(self, tun_v6: bool) -> Option<bool> {
        match self {
            DnsStrategy::Auto => (!tun_v6).then_some(true),
            DnsStrategy::DualStack => None,
            DnsStrategy::Ipv4Only => Some(true),
            DnsStrategy::Ipv6Only => Some(false),
        }
    }
}

/// The error for an `https://` upstream in a build without DNS over HTTPS.
pub(crate) fn doh_missing() -> DnsConfigError {
    DnsConfigError {
        field: "upstreams",
        reason: "https:// upstreams need kerntun built with the `doh` feature".into(),
    }
}

/// The error for a `tls://` upstream in a build without DNS over TLS.
pub(crate) fn dot_missing() -> DnsConfigError {
    DnsConfigError {
        field: "upstreams",
        reason: "tls:// upstreams need kerntun built with the `dot` feature".into(),
    }
}

impl DnsConfig {
    /// Every upstream entry, parsed, in order (validated by
    /// [`DnsConfig::validate`]).
    pub fn upstream_entries(&self) -> Result<Vec<UpstreamEntry>, DnsConfigError> {
        self.upstreams
            .iter()
            .map(|u| {
                u.parse().map_err(|reason| DnsConfigError {
                    field: "upstreams",
                    reason,
                })
            })
            .collect()
    }

    /// The upstreams given by address, in order; a `"platform"` entry is
    /// left out (its servers are known only once the engine runs).
    pub fn parsed_upstreams(&self) -> Result<Vec<Upstream>, DnsConfigError> {
        Ok(self
            .upstream_entries()?
            .into_iter()
            .filter_map(|e| match e {
                UpstreamEntry::Server(up) => Some(up),
                UpstreamEntry::Platform => None,
            })
            .collect())
    }

    /// Check the section. `reserved`: the TUN's own addresses (gateway and
    /// NAT address per family), which no fake-ip pool may hold.
    pub fn validate(&self, reserved: &[IpAddr]) -> Result<(), DnsConfigError> {
        if !self.enabled {
            return Ok(());
        }
        let bad = |field, reason: String| DnsConfigError { field, reason };
        if self.upstreams.is_empty() {
            return Err(bad("upstreams", "at least one upstream is needed".into()));
        }
        self.upstream_entries()?;
        let ups = self.parsed_upstreams()?;
        if !cfg!(feature = "dot") && ups.iter().any(|u| u.proto == UpstreamProto::Tls) {
            return Err(dot_missing());
        }
        if !cfg!(feature = "doh") && ups.iter().any(|u| u.proto == UpstreamProto::Https) {
            return Err(doh_missing());
        }
        if self.timeout_ms == 0 {
            return Err(bad("timeout_ms", "must be greater than zero".into()));
        }
        let has = |v6: bool| reserved.iter().any(|a| a.is_ipv6() == v6);
        match self.strategy {
            DnsStrategy::Ipv4Only if !has(false) => {
                return Err(bad(
                    "strategy",
                    "ipv4_only needs tun.ipv4 (no IPv4 answer could enter the tunnel)".into(),
                ));
            }
            DnsStrategy::Ipv6Only if !has(true) => {
                return Err(bad(
                    "strategy",
                    "ipv6_only needs tun.ipv6 (no IPv6 answer could enter the tunnel)".into(),
                ));
            }
            _ => {}
        }
        if self.fake_ip {
            let bench: Ipv4Net = "198.18.0.0/15".parse().expect("static prefix");
            if !bench.contains(&self.fake_ip_pool) {
                return Err(bad(
                    "fake_ip_pool",
                    format!("{} is not inside 198.18.0.0/15", self.fake_ip_pool),
                ));
            }
            for &a in reserved {
                match a {
                    IpAddr::V4(a) if self.fake_ip_pool.contains(&a) => {
                        return Err(bad(
                            "fake_ip_pool",
                            format!("{} holds the TUN's own address {a}", self.fake_ip_pool),
                        ));
                    }
                    IpAddr::V6(a) if self.fake_ip_pool6.is_some_and(|p6| p6.contains(&a)) => {
                        let p6 = self.fake_ip_pool6.expect("checked above");
                        return Err(bad(
                            "fake_ip_pool6",
                            format!("{p6} holds the TUN's own address {a}"),
                        ));
                    }
                    _ => {}
                }
            }
            if self.fake_ip_entries == 0 {
                return Err(bad("fake_ip_entries", "must be greater than zero".into()));
            }
        }
        Ok(())
    }
}

/// The resolver address kerntun answers on by default: gateway + 2 of a TUN
/// prefix (the gateway is the TUN's own address, which the kernel delivers
/// locally without crossing the TUN; gateway + 1 is the NAT address).
/// `None` when the prefix has no room for it.
pub fn default_resolver(net: ipnet::IpNet) -> Option<IpAddr> {
    match net {
        ipnet::IpNet::V4(n) => {
            let a = std::net::Ipv4Addr::from(u32::from(n.addr()).checked_add(2)?);
            (n.contains(&a) && a != n.broadcast()).then_some(IpAddr::V4(a))
        }
        ipnet::IpNet::V6(n) => {
            let a = std::net::Ipv6Addr::from(u128::from(n.addr()).checked_add(2)?);
            n.contains(&a).then_some(IpAddr::V6(a))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enabled(strategy: DnsStrategy) -> DnsConfig {
        DnsConfig {
            enabled: true,
            upstreams: vec!["udp://192.0.2.53:53".into()],
            strategy,
            ..DnsConfig::default()
        }
    }

    /// What each strategy leaves out, and the one-family strategies need
    /// that family in the TUN.
    #[test]
    fn strategies_and_their_checks() {
        use DnsStrategy::*;
        assert_eq!(DnsConfig::default().strategy, Auto);
        assert_eq!(Auto.empty_family(true), None);
        assert_eq!(Auto.empty_family(false), Some(true));
        assert_eq!(DualStack.empty_family(false), None);
        assert_eq!(Ipv4Only.empty_family(true), Some(true));
        assert_eq!(Ipv6Only.empty_family(true), Some(false));
        let v4: IpAddr = "198.18.0.1".parse().expect("ip");
        let v6: IpAddr = "fd00:18::1".parse().expect("ip");
        for s in [Auto, DualStack, Ipv4Only] {
            assert_eq!(enabled(s).validate(&[v4]), Ok(()), "{s:?}");
        }
        let e = enabled(Ipv6Only).validate(&[v4]).expect_err("no tun.ipv6");
        assert_eq!(e.field, "strategy");
        assert!(e.to_string().starts_with("dns.strategy: "), "{e}");
        assert!(e.reason.contains("tun.ipv6"), "{e}");
        assert_eq!(enabled(Ipv6Only).validate(&[v4, v6]), Ok(()));
        let e = enabled(Ipv4Only).validate(&[v6]).expect_err("no tun.ipv4");
        assert!(e.reason.contains("tun.ipv4"), "{e}");
    }

    /// `"platform"` is an entry of its own, in its place in the order,
    /// alone or among servers; left out of the servers given by address.
    #[test]
    fn platform_is_an_upstream_entry() {
        let v4: IpAddr = "198.18.0.1".parse().expect("ip");
        let with = |ups: &[&str]| DnsConfig {
            enabled: true,
            upstreams: ups.iter().map(|u| u.to_string()).collect(),
            ..DnsConfig::default()
        };
        let server: Upstream = "udp://192.0.2.53:53".parse().expect("udp");
        let c = with(&["udp://192.0.2.53:53", "platform"]);
        assert_eq!(c.validate(&[v4]), Ok(()));
        assert_eq!(
            c.upstream_entries(),
            Ok(vec![
                UpstreamEntry::Server(server.clone()),
                UpstreamEntry::Platform
            ])
        );
        assert_eq!(c.parsed_upstreams(), Ok(vec![server]));
        let alone = with(&["platform"]);
        assert_eq!(alone.validate(&[v4]), Ok(()));
        assert_eq!(alone.upstream_entries(), Ok(vec![UpstreamEntry::Platform]));
        assert_eq!(alone.parsed_upstreams(), Ok(Vec::new()));
        // Anything else without a scheme is refused, naming both forms.
        for bad in ["Platform", "system", "platform:53", "192.0.2.53"] {
            let e = with(&[bad]).validate(&[v4]).expect_err(bad);
            assert_eq!(e.field, "upstreams");
            assert!(e.reason.contains("\"platform\""), "{bad}: {e}");
            assert!(e.reason.contains("udp://"), "{bad}: {e}");
        }
        // A bad server next to "platform" is still refused.
        let e = with(&["platform", "udp://nowhere:53"])
            .validate(&[v4])
            .expect_err("a host name");
        assert!(e.reason.contains("nowhere"), "{e}");
    }
}
