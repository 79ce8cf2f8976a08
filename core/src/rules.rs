//! Routing rules: the first rule whose every condition matches a flow's
//! destination decides its outbound. Evaluated once per connection at SYN time
//! (and once per UDP flow), never per packet.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What happens to a matching flow: `direct`, `reject`, or the name of a
/// configured outbound (`[outbounds.NAME]`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Action {
    /// Connect from this host, bypassing the TUN.
    #[default]
    Direct,
    /// Refuse: TCP gets an RST at SYN time, UDP datagrams are dropped and counted.
    Reject,
    /// Send through the named proxy outbound.
    Outbound(Arc<str>),
}

impl Action {
    fn as_str(&self) -> &str {
        match self {
            Action::Direct => "direct",
            Action::Reject => "reject",
            Action::Outbound(n) => n,
        }
    }
}

impl From<&str> for Action {
    fn from(s: &str) -> Self {
        match s {
            "direct" => Action::Direct,
            "reject" => Action::Reject,
            name => Action::Outbound(name.into()),
        }
    }
}

impl Serialize for Action {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Action {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.is_empty() {
            return Err(serde::de::Error::custom("empty action"));
        }
        Ok(Action::from(s.as_str()))
    }
}

/// An inclusive destination port range, written `443` or `8000-8999`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub start: u16,
    pub end: u16,
}

impl FromStr for PortRange {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parse = |p: &str| {
            p.trim()
                .parse::<u16>()
                .map_err(|e| format!("bad port {p:?}: {e}"))
        };
        let (start, end) = match s.split_once('-') {
            Some((a, b)) => (parse(a)?, parse(b)?),
            None => {
                let p = parse(s)?;
                (p, p)
            }
        };
        if start > end {
            return Err(format!("port range {s:?} is empty (start > end)"));
        }
        Ok(PortRange { start, end })
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.start == self.end {
            write!(f, "{}", self.start)
        } else {
            write!(f, "{}-{}", self.start, self.end)
        }
    }
}

impl Serialize for PortRange {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PortRange {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Num(u16),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Num(p) => Ok(PortRange { start: p, end: p }),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// One rule. Absent conditions match everything.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Destination network.
    #[serde(default)]
    pub cidr: Option<IpNet>,
    /// Destination ports.
    #[serde(default)]
    pub ports: Option<PortRange>,
    pub action: Action,
}

/// What a routing decision looks at: the address the app sent to and, when
/// known (fake-ip lookup, sniffed SNI / Host), the domain behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    pub addr: SocketAddr,
    pub domain: Option<&'a str>,
}

impl<'a> Target<'a> {
    /// A destination known only by its address.
    pub fn ip(addr: SocketAddr) -> Self {
        Target { addr, domain: None }
    }
}

impl Rule {
    /// Whether every condition of the rule holds for `t`.
    pub fn matches(&self, t: &Target<'_>) -> bool {
        self.cidr.is_none_or(|n| n.contains(&t.addr.ip()))
            && self
                .ports
                .is_none_or(|p| (p.start..=p.end).contains(&t.addr.port()))
    }
}

/// The first matching rule's action, or [`Action::Direct`].
pub fn decide(rules: &[Rule], t: &Target<'_>) -> Action {
    decide_ref(rules, t).clone()
}

/// [`decide`] without the clone.
pub fn decide_ref<'a>(rules: &'a [Rule], t: &Target<'_>) -> &'a Action {
    static DIRECT: Action = Action::Direct;
    rules
        .iter()
        .find(|r| r.matches(t))
        .map_or(&DIRECT, |r| &r.action)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> Target<'static> {
        Target::ip(s.parse().expect("addr"))
    }

    #[test]
    fn first_match_wins_and_default_is_direct() {
        let rules = vec![
            Rule {
                cidr: Some("198.19.9.0/24".parse().expect("net")),
                ports: Some("80-90".parse().expect("ports")),
                action: Action::Reject,
            },
            Rule {
                cidr: Some("198.19.0.0/16".parse().expect("net")),
                ports: None,
                action: Action::Direct,
            },
            Rule {
                cidr: None,
                ports: Some("25".parse().expect("ports")),
                action: Action::Reject,
            },
        ];
        assert_eq!(decide(&rules, &sa("198.19.9.1:85")), Action::Reject);
        assert_eq!(decide(&rules, &sa("198.19.9.1:443")), Action::Direct);
        assert_eq!(decide(&rules, &sa("1.2.3.4:25")), Action::Reject);
        assert_eq!(decide(&rules, &sa("[fd00::1]:25")), Action::Reject);
        assert_eq!(decide(&rules, &sa("[fd00::1]:26")), Action::Direct);
        assert_eq!(decide(&[], &sa("1.2.3.4:1")), Action::Direct);
    }

    #[test]
    fn actions_name_outbounds() {
        let rules = vec![
            Rule {
                cidr: Some("fd00::/8".parse().expect("net")),
                ports: None,
                action: Action::from("ss"),
            },
            Rule {
                cidr: None,
                ports: None,
                action: Action::from("corp"),
            },
        ];
        assert_eq!(
            decide(&rules, &sa("[fd00::1]:443")),
            Action::Outbound("ss".into())
        );
        assert_eq!(
            decide(&rules, &sa("1.1.1.1:53")),
            Action::Outbound("corp".into())
        );
        assert_eq!(Action::from("direct"), Action::Direct);
        assert_eq!(Action::from("reject"), Action::Reject);
    }

    #[test]
    fn port_range_parse_errors_are_clear() {
        assert!(
            "9-1"
                .parse::<PortRange>()
                .expect_err("empty")
                .contains("empty")
        );
        assert!(
            "x".parse::<PortRange>()
                .expect_err("bad")
                .contains("bad port")
        );
        assert_eq!(
            "1-65535".parse::<PortRange>(),
            Ok(PortRange {
                start: 1,
                end: 65535
            })
        );
    }
}
