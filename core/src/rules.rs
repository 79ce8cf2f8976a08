//! Routing rules: the first rule whose every condition matches a flow's
//! destination decides its outbound. Evaluated once per connection at SYN time
//! (or once its domain is sniffed) and once per UDP flow, never per packet.
//!
//! Conditions are the destination network (`cidr`), its port (`ports`), the
//! transport (`network`: TCP or UDP), the domain (`domain`,
//! `domain_suffix`, `domain_keyword`, `domain_list`) and the app that owns
//! the flow (`package`, `uid`; known only where the host can look it up,
//! `owner.rs`).
//! [`RuleSet`] compiles them at start so that deciding costs a few hash
//! lookups per rule, whatever the size of its domain lists.

use std::collections::HashSet;
use std::fmt;
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A rule the configuration cannot use, by its index in `rules`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RuleError {
    /// A condition is malformed (a bad domain entry, an unreadable list).
    #[error("rules[{rule}]: {reason}")]
    Bad { rule: usize, reason: String },
    /// The action names an outbound that is not configured.
    #[error(
        "rules[{rule}].action: no outbound named {name:?} (direct, reject, or a key of [outbounds] or [groups])"
    )]
    UnknownOutbound { rule: usize, name: String },
}

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

/// The transport of a flow, for the `network` condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Network {
    Tcp,
    Udp,
}

/// One rule. Absent conditions match everything; present ones must all hold.
///
/// Domain conditions (`domain`, `domain_suffix`, `domain_keyword`,
/// `domain_list`) together are one condition: the destination must have a
/// domain (from fake-ip or sniffing) and it must match any one of them.
/// Matching is ASCII case-insensitive and ignores a trailing dot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// What the connection list calls this rule; absent, its place and
    /// conditions (`rules[2] domain_suffix=b.test ports=443`,
    /// [`Rule::label`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Destination network. Never matches a fake-ip address: that address
    /// is a placeholder from the pool, not where the connection goes.
    #[serde(default)]
    pub cidr: Option<IpNet>,
    /// Destination ports.
    #[serde(default)]
    pub ports: Option<PortRange>,
    /// Only flows of this transport (`"tcp"` or `"udp"`); absent, both.
    /// `network = "udp"` with `ports = "443"` names QUIC (HTTP/3): rejecting
    /// it for some domains makes their apps fall back to TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Network>,
    /// Domains matched exactly.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domain: Vec<String>,
    /// Domains matched with their subdomains, on label boundaries
    /// (`b.org` matches `b.org` and `a.b.org`, not `xb.org`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domain_suffix: Vec<String>,
    /// Substrings of the domain.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domain_keyword: Vec<String>,
    /// A file read once at start: one entry a line, `full:NAME`,
    /// `domain:NAME` (suffix), `keyword:TEXT` or a bare `NAME` (suffix);
    /// `#` starts a comment. A relative path is taken from the process's
    /// working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain_list: Option<PathBuf>,
    /// Package names of the app that owns the flow (`com.example.app`),
    /// matched exactly. With `uid`, one condition: the owner must be known
    /// and be any of them. A flow whose owner is not known (no lookup on
    /// this platform, or it failed) never matches.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub package: Vec<String>,
    /// User ids of the app that owns the flow (Android: one per app).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uid: Vec<u32>,
    pub action: Action,
}

/// What a routing decision looks at: the address the app sent to, the
/// transport, and, when known (fake-ip lookup, sniffed SNI / Host / QUIC
/// Initial), the domain behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    pub addr: SocketAddr,
    pub domain: Option<&'a str>,
    /// `addr` is a fake-ip placeholder (`cidr` conditions do not apply).
    pub fake: bool,
    /// TCP unless made with [`Target::udp`].
    pub network: Network,
    /// The app that owns the flow, when the host named it
    /// ([`Target::owned_by`]): its uid and package.
    pub owner: Option<(u32, Option<&'a str>)>,
}

impl<'a> Target<'a> {
    /// A TCP destination known only by its address.
    pub fn ip(addr: SocketAddr) -> Self {
        Target {
            addr,
            domain: None,
            fake: false,
            network: Network::Tcp,
            owner: None,
        }
    }

    /// A real TCP address whose domain was sniffed (SNI / Host): both the
    /// address and the domain conditions apply.
    pub fn sniffed(addr: SocketAddr, domain: &'a str) -> Self {
        Target {
            domain: Some(domain),
            ..Target::ip(addr)
        }
    }

    /// A fake-ip address and the domain it stands for: `cidr` never
    /// matches, ports and domain conditions do. TCP unless made UDP.
    pub fn fake_ip(addr: SocketAddr, domain: &'a str) -> Self {
        Target {
            domain: Some(domain),
            fake: true,
            ..Target::ip(addr)
        }
    }

    /// The same destination, for a UDP flow: `Target::ip(a).udp()`,
    /// `Target::sniffed(a, d).udp()` (a QUIC Initial's SNI),
    /// `Target::fake_ip(a, d).udp()`.
    pub fn udp(self) -> Self {
        self.on(Network::Udp)
    }

    /// The same destination on `network`.
    pub fn on(self, network: Network) -> Self {
        Target { network, ..self }
    }

    /// The same flow, owned by the app with `uid` (and `package`, when the
    /// host named one): `package` and `uid` conditions apply.
    pub fn owned_by(self, uid: u32, package: Option<&'a str>) -> Self {
        Target {
            owner: Some((uid, package)),
            ..self
        }
    }
}

impl Rule {
    /// The rule's name in the connection list: `name` if given, otherwise
    /// `rules[i]` and its conditions, the first entry of each domain
    /// condition with how many more it holds (`domain_suffix=b.test+2`).
    pub fn label(&self, i: usize) -> String {
        use std::fmt::Write;
        if let Some(n) = &self.name {
            return n.clone();
        }
        let mut s = format!("rules[{i}]");
        let mut list = |key: &str, v: &[String]| {
            if let Some(first) = v.first() {
                let _ = write!(s, " {key}={first}");
                if v.len() > 1 {
                    let _ = write!(s, "+{}", v.len() - 1);
                }
            }
        };
        list("domain", &self.domain);
        list("domain_suffix", &self.domain_suffix);
        list("domain_keyword", &self.domain_keyword);
        list("package", &self.package);
        if let Some(p) = &self.domain_list {
            let _ = write!(s, " domain_list={}", p.display());
        }
        if let Some(u) = self.uid.first() {
            let _ = write!(s, " uid={u}");
            if self.uid.len() > 1 {
                let _ = write!(s, "+{}", self.uid.len() - 1);
            }
        }
        if let Some(c) = self.cidr {
            let _ = write!(s, " cidr={c}");
        }
        if let Some(p) = self.ports {
            let _ = write!(s, " ports={p}");
        }
        if let Some(n) = self.network {
            let _ = write!(
                s,
                " network={}",
                match n {
                    Network::Tcp => "tcp",
                    Network::Udp => "udp",
                }
            );
        }
        s
    }

    /// Whether the rule has domain conditions (then it only matches
    /// destinations with a domain).
    pub fn has_domain(&self) -> bool {
        !self.domain.is_empty()
            || !self.domain_suffix.is_empty()
            || !self.domain_keyword.is_empty()
            || self.domain_list.is_some()
    }

    /// Whether the rule has owner conditions (`package`, `uid`): it then
    /// matches only flows whose owner the host named.
    pub fn has_owner(&self) -> bool {
        !self.package.is_empty() || !self.uid.is_empty()
    }

    /// Whether the address conditions (`cidr`, `ports`, `network`) hold
    /// for `t` (domain conditions are checked by the compiled [`RuleSet`]).
    pub fn matches_addr(&self, t: &Target<'_>) -> bool {
        addr_matches(self.cidr, self.ports, self.network, t)
    }
}

/// `cidr` (never for a fake-ip address), `ports` and `network`, absent ones
/// matching.
fn addr_matches(
    cidr: Option<IpNet>,
    ports: Option<PortRange>,
    network: Option<Network>,
    t: &Target<'_>,
) -> bool {
    cidr.is_none_or(|n| !t.fake && n.contains(&t.addr.ip()))
        && ports.is_none_or(|p| (p.start..=p.end).contains(&t.addr.port()))
        && network.is_none_or(|n| n == t.network)
}

/// Longest name a domain condition can match (RFC 1035 section 2.3.4:
/// 255 octets on the wire, 253 characters written without the final dot).
const MAX_NAME: usize = 253;

/// Largest `domain_list` file read (a 100k-entry list is ~2 MB); guards
/// against pointing it at a device or a wrong, huge file.
const MAX_LIST_BYTES: u64 = 64 << 20;

/// `name` lower-cased into `buf`, trailing dot dropped; `None` if too long
/// to match anything.
fn normalize<'b>(name: &str, buf: &'b mut [u8; MAX_NAME]) -> Option<&'b str> {
    let name = name.strip_suffix('.').unwrap_or(name);
    let out = buf.get_mut(..name.len())?;
    out.copy_from_slice(name.as_bytes());
    out.make_ascii_lowercase();
    // ASCII lower-casing leaves UTF-8 valid.
    std::str::from_utf8(out).ok()
}

/// A configured domain entry, checked and lower-cased: labels of ASCII
/// letters, digits, `-`, `_`, 1..=63 bytes each, at most 253 in all.
fn check_domain(s: &str) -> Result<String, String> {
    let n = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
    if n.is_empty() || n.len() > MAX_NAME {
        return Err(format!("{s:?}: a domain has 1..={MAX_NAME} characters"));
    }
    for label in n.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(format!("{s:?}: empty or over-long (>63) label"));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(format!(
                "{s:?}: {c:?} is not allowed (letters, digits, '-', '_'; IDNs in punycode)"
            ));
        }
    }
    Ok(n)
}

/// A configured keyword, lower-cased: non-empty, no whitespace.
fn check_keyword(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > MAX_NAME || s.chars().any(|c| c.is_whitespace()) {
        return Err(format!(
            "{s:?}: a keyword has 1..={MAX_NAME} characters and no whitespace"
        ));
    }
    Ok(s.to_ascii_lowercase())
}

/// One rule's domain conditions, compiled: hash sets for exact and suffix
/// entries (a lookup per label suffix of the name, whatever the list size),
/// a list for keywords (they are few; a substring search each).
#[derive(Debug, Default)]
struct DomainSet {
    exact: HashSet<Box<str>>,
    suffix: HashSet<Box<str>>,
    keywords: Vec<Box<str>>,
}

impl DomainSet {
    /// `name` must be [`normalize`]d.
    fn matches(&self, name: &str) -> bool {
        if self.exact.contains(name) {
            return true;
        }
        if !self.suffix.is_empty() {
            // `a.b.org`, then `b.org`, then `org`: only whole labels.
            let mut rest = name;
            loop {
                if self.suffix.contains(rest) {
                    return true;
                }
                match rest.split_once('.') {
                    Some((_, r)) => rest = r,
                    None => break,
                }
            }
        }
        self.keywords.iter().any(|k| name.contains(&**k))
    }

    fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.suffix.is_empty() && self.keywords.is_empty()
    }

    fn add_exact(&mut self, s: &str) -> Result<(), String> {
        self.exact.insert(check_domain(s)?.into());
        Ok(())
    }

    fn add_suffix(&mut self, s: &str) -> Result<(), String> {
        // `.b.org` is written by some to mean the same.
        let s = s.strip_prefix('.').unwrap_or(s);
        self.suffix.insert(check_domain(s)?.into());
        Ok(())
    }

    fn add_keyword(&mut self, s: &str) -> Result<(), String> {
        let k: Box<str> = check_keyword(s)?.into();
        if !self.keywords.contains(&k) {
            self.keywords.push(k);
        }
        Ok(())
    }

    /// Read a `domain_list` file into the set.
    fn load(&mut self, path: &Path) -> Result<(), String> {
        let shown = path.display();
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_LIST_BYTES + 1).read_to_string(&mut text))
            .map_err(|e| format!("domain_list {shown}: {e}"))?;
        if text.len() as u64 > MAX_LIST_BYTES {
            return Err(format!(
                "domain_list {shown}: larger than {} MiB",
                MAX_LIST_BYTES >> 20
            ));
        }
        for (i, line) in text.lines().enumerate() {
            let entry = line.split_once('#').map_or(line, |(e, _)| e).trim();
            if entry.is_empty() {
                continue;
            }
            let r = match entry.split_once(':') {
                Some(("full", d)) => self.add_exact(d),
                Some(("domain", d)) => self.add_suffix(d),
                Some(("keyword", k)) => self.add_keyword(k),
                Some((kind, _)) => Err(format!(
                    "unknown entry type {kind:?} (full:, domain:, keyword: or a bare domain)"
                )),
                None => self.add_suffix(entry),
            };
            r.map_err(|e| format!("domain_list {shown}: line {}: {e}", i + 1))?;
        }
        Ok(())
    }
}

/// One rule's owner conditions: the packages and uids, any of which the
/// flow's owner must be. Few entries each (an app's rule names a handful of
/// apps): a scan.
#[derive(Debug, Default)]
struct OwnerSet {
    packages: Box<[Box<str>]>,
    uids: Box<[u32]>,
}

impl OwnerSet {
    fn matches(&self, owner: Option<(u32, Option<&str>)>) -> bool {
        let Some((uid, package)) = owner else {
            return false;
        };
        self.uids.contains(&uid) || package.is_some_and(|p| self.packages.iter().any(|q| **q == *p))
    }
}

/// A configured package name: non-empty, no whitespace, at most 255 bytes
/// (Android caps a package name's length there, `PackageParser`).
fn check_package(s: &str) -> Result<Box<str>, String> {
    if s.is_empty() || s.len() > 255 || s.chars().any(char::is_whitespace) {
        return Err(format!(
            "{s:?}: a package name has 1..=255 characters and no whitespace"
        ));
    }
    Ok(s.into())
}

/// A rule, compiled.
#[derive(Debug)]
struct Compiled<T> {
    cidr: Option<IpNet>,
    ports: Option<PortRange>,
    network: Option<Network>,
    /// `Some` for a rule with domain conditions.
    domains: Option<Box<DomainSet>>,
    /// `Some` for a rule with owner conditions.
    owners: Option<Box<OwnerSet>>,
    route: T,
}

impl<T> Compiled<T> {
    fn matches_addr(&self, t: &Target<'_>) -> bool {
        addr_matches(self.cidr, self.ports, self.network, t)
    }

    fn matches_owner(&self, t: &Target<'_>) -> bool {
        self.owners.as_ref().is_none_or(|o| o.matches(t.owner))
    }
}

/// Rules compiled once at start (domain lists read, entries checked and
/// indexed), each carrying what it resolves to (`T`, e.g. an outbound
/// index). Deciding walks the rules in order and allocates nothing.
#[derive(Debug)]
pub struct RuleSet<T> {
    rules: Vec<Compiled<T>>,
    /// Some rule has domain conditions.
    any_domain: bool,
    /// Some rule has owner conditions.
    any_owner: bool,
}

impl<T> Default for RuleSet<T> {
    fn default() -> Self {
        Self {
            rules: Vec::new(),
            any_domain: false,
            any_owner: false,
        }
    }
}

impl<T> RuleSet<T> {
    /// Compile `rules`, resolving each one's action with `route`. A bad
    /// domain entry or an unreadable domain list is
    /// [`RuleError::Bad`] naming the rule (and the file and line).
    pub fn compile(
        rules: &[Rule],
        mut route: impl FnMut(usize, &Rule) -> Result<T, RuleError>,
    ) -> Result<Self, RuleError> {
        let mut out = Vec::with_capacity(rules.len());
        for (i, r) in rules.iter().enumerate() {
            let domains = if r.has_domain() {
                let bad = |reason: String| RuleError::Bad { rule: i, reason };
                let mut set = DomainSet::default();
                for (j, d) in r.domain.iter().enumerate() {
                    set.add_exact(d)
                        .map_err(|e| bad(format!("domain[{j}]: {e}")))?;
                }
                for (j, d) in r.domain_suffix.iter().enumerate() {
                    set.add_suffix(d)
                        .map_err(|e| bad(format!("domain_suffix[{j}]: {e}")))?;
                }
                for (j, k) in r.domain_keyword.iter().enumerate() {
                    set.add_keyword(k)
                        .map_err(|e| bad(format!("domain_keyword[{j}]: {e}")))?;
                }
                if let Some(p) = &r.domain_list {
                    set.load(p).map_err(bad)?;
                }
                set.exact.shrink_to_fit();
                set.suffix.shrink_to_fit();
                Some(Box::new(set))
            } else {
                None
            };
            let owners = if r.has_owner() {
                let packages = (r.package.iter().enumerate())
                    .map(|(j, p)| {
                        check_package(p).map_err(|e| RuleError::Bad {
                            rule: i,
                            reason: format!("package[{j}]: {e}"),
                        })
                    })
                    .collect::<Result<_, _>>()?;
                Some(Box::new(OwnerSet {
                    packages,
                    uids: r.uid.clone().into(),
                }))
            } else {
                None
            };
            out.push(Compiled {
                cidr: r.cidr,
                ports: r.ports,
                network: r.network,
                domains,
                owners,
                route: route(i, r)?,
            });
        }
        Ok(RuleSet {
            any_domain: out.iter().any(|c| c.domains.is_some()),
            any_owner: out.iter().any(|c| c.owners.is_some()),
            rules: out,
        })
    }

    /// The first matching rule's route, `None` if no rule matches.
    pub fn decide(&self, t: &Target<'_>) -> Option<&T> {
        self.decide_at(t).map(|(_, route)| route)
    }

    /// [`RuleSet::decide`], with the matching rule's index.
    pub fn decide_at(&self, t: &Target<'_>) -> Option<(usize, &T)> {
        let mut buf = [0u8; MAX_NAME];
        // Lower-cased once per decision, on the stack.
        let name = match t.domain {
            Some(d) if self.any_domain => normalize(d, &mut buf),
            _ => None,
        };
        self.rules
            .iter()
            .enumerate()
            .find(|(_, r)| {
                r.matches_addr(t)
                    && r.matches_owner(t)
                    && match &r.domains {
                        None => true,
                        Some(set) => name.is_some_and(|n| set.matches(n)),
                    }
            })
            .map(|(i, r)| (i, &r.route))
    }

    /// Whether some domain could route a TCP connection to the real
    /// address `addr` differently than the address alone does: a rule with
    /// domain conditions whose address conditions hold comes before the
    /// first address-only rule that matches, and leads elsewhere than that
    /// rule (or `default` when none matches). Sniffing is only worth its
    /// wait when this holds.
    pub fn needs_domain(&self, addr: SocketAddr, default: &T) -> bool
    where
        T: PartialEq,
    {
        self.needs_domain_on(Network::Tcp, addr, default)
    }

    /// [`needs_domain`](Self::needs_domain) for a flow on `network` (a UDP
    /// flow to port 443 is worth sniffing for its QUIC Initial only when
    /// this holds for UDP).
    pub fn needs_domain_on(&self, network: Network, addr: SocketAddr, default: &T) -> bool
    where
        T: PartialEq,
    {
        if !self.any_domain {
            return false;
        }
        let t = Target::ip(addr).on(network);
        let fallback_at = self
            .rules
            .iter()
            .position(|r| r.domains.is_none() && r.matches_addr(&t));
        let fallback = fallback_at.map_or(default, |i| &self.rules[i].route);
        let before = fallback_at.unwrap_or(self.rules.len());
        self.rules[..before].iter().any(|r| {
            r.domains.as_ref().is_some_and(|s| !s.is_empty())
                && r.matches_addr(&t)
                && r.route != *fallback
        })
    }

    /// Whether the owner of a flow of `network` to `addr` could matter: some
    /// rule with owner conditions has address conditions that hold for it.
    /// Only then does the flow wait for its owner before it is routed
    /// (`owner.rs`); otherwise the owner is looked up for the connection
    /// list alone, after routing.
    pub fn needs_owner_on(&self, network: Network, addr: SocketAddr) -> bool {
        if !self.any_owner {
            return false;
        }
        let t = Target::ip(addr).on(network);
        self.rules
            .iter()
            .any(|r| r.owners.is_some() && r.matches_addr(&t))
    }

    /// Number of rules.
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// Whether there are no rules.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }
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
                ..Rule::default()
            },
            Rule {
                cidr: Some("198.19.0.0/16".parse().expect("net")),
                ports: None,
                action: Action::Direct,
                ..Rule::default()
            },
            Rule {
                cidr: None,
                ports: Some("25".parse().expect("ports")),
                action: Action::Reject,
                ..Rule::default()
            },
        ];
        assert_eq!(
            route(&compile(&rules).expect("compile"), &sa("198.19.9.1:85")),
            Action::Reject
        );
        assert_eq!(
            route(&compile(&rules).expect("compile"), &sa("198.19.9.1:443")),
            Action::Direct
        );
        assert_eq!(
            route(&compile(&rules).expect("compile"), &sa("1.2.3.4:25")),
            Action::Reject
        );
        assert_eq!(
            route(&compile(&rules).expect("compile"), &sa("[fd00::1]:25")),
            Action::Reject
        );
        assert_eq!(
            route(&compile(&rules).expect("compile"), &sa("[fd00::1]:26")),
            Action::Direct
        );
        assert_eq!(
            route(&compile(&[]).expect("compile"), &sa("1.2.3.4:1")),
            Action::Direct
        );
    }

    #[test]
    fn actions_name_outbounds() {
        let rules = vec![
            Rule {
                cidr: Some("fd00::/8".parse().expect("net")),
                ports: None,
                action: Action::from("ss"),
                ..Rule::default()
            },
            Rule {
                cidr: None,
                ports: None,
                action: Action::from("corp"),
                ..Rule::default()
            },
        ];
        assert_eq!(
            route(&compile(&rules).expect("compile"), &sa("[fd00::1]:443")),
            Action::Outbound("ss".into())
        );
        assert_eq!(
            route(&compile(&rules).expect("compile"), &sa("1.1.1.1:53")),
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

    /// A file under the temp dir, removed on drop (also when a test fails).
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new(tag: &str, text: &str) -> TempFile {
            let p = std::env::temp_dir()
                .join(format!("kerntun-rules-{}-{tag}.txt", std::process::id()));
            std::fs::write(&p, text).expect("write list");
            TempFile(p)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn compile(rules: &[Rule]) -> Result<RuleSet<Action>, RuleError> {
        RuleSet::compile(rules, |_, r| Ok(r.action.clone()))
    }

    fn route(set: &RuleSet<Action>, t: &Target<'_>) -> Action {
        set.decide(t).cloned().unwrap_or_default()
    }

    fn dom(addr: &str, name: &'static str) -> Target<'static> {
        Target::sniffed(addr.parse().expect("addr"), name)
    }

    fn out(name: &str) -> Action {
        Action::from(name)
    }

    #[test]
    fn exact_suffix_keyword_with_case_and_trailing_dot() {
        let set = compile(&[
            Rule {
                domain: vec!["Exact.Example.COM.".into()],
                action: out("exact"),
                ..Rule::default()
            },
            Rule {
                domain_suffix: vec!["b.org".into(), ".c.net".into()],
                action: out("suffix"),
                ..Rule::default()
            },
            Rule {
                domain_keyword: vec!["ADS".into()],
                action: out("kw"),
                ..Rule::default()
            },
        ])
        .expect("compile");
        let a = "198.19.1.1:443";
        assert_eq!(route(&set, &dom(a, "exact.example.com")), out("exact"));
        assert_eq!(route(&set, &dom(a, "EXACT.example.com.")), out("exact"));
        // Exact is exact: no subdomains, no parents.
        assert_eq!(
            route(&set, &dom(a, "www.exact.example.com")),
            Action::Direct
        );
        assert_eq!(route(&set, &dom(a, "example.com")), Action::Direct);
        // Suffix: the domain itself and subdomains, on label boundaries.
        for n in ["b.org", "a.b.org", "x.y.B.ORG.", "c.net", "deep.er.c.net"] {
            assert_eq!(route(&set, &dom(a, n)), out("suffix"), "{n}");
        }
        for n in ["xb.org", "b.org.evil", "org", "bc.net", "c.net.x"] {
            assert_eq!(route(&set, &dom(a, n)), Action::Direct, "{n}");
        }
        // Keyword: any substring, case-insensitive.
        assert_eq!(route(&set, &dom(a, "my-Ads-server.io")), out("kw"));
        assert_eq!(route(&set, &dom(a, "roads.example")), out("kw"));
        // No domain: a domain rule never matches.
        assert_eq!(
            route(&set, &Target::ip(a.parse().expect("a"))),
            Action::Direct
        );
        // Longer than any DNS name: matches nothing, does not panic.
        let long: &'static str = Box::leak(format!("{}.b.org", "a".repeat(300)).into_boxed_str());
        assert_eq!(route(&set, &dom(a, long)), Action::Direct);
        assert_eq!(route(&set, &dom(a, "")), Action::Direct);
    }

    #[test]
    fn first_match_with_address_conditions_anded() {
        let set = compile(&[
            // Domain AND port.
            Rule {
                ports: Some("443".parse().expect("port")),
                domain_suffix: vec!["video.test".into()],
                action: out("tls-video"),
                ..Rule::default()
            },
            // Domain AND network.
            Rule {
                cidr: Some("198.19.5.0/24".parse().expect("net")),
                domain_suffix: vec!["video.test".into()],
                action: Action::Reject,
                ..Rule::default()
            },
            Rule {
                cidr: Some("198.19.0.0/16".parse().expect("net")),
                action: out("net"),
                ..Rule::default()
            },
            // After the address rule: reached only outside 198.19/16.
            Rule {
                domain: vec!["late.test".into()],
                action: out("late"),
                ..Rule::default()
            },
            Rule {
                action: out("default"),
                ..Rule::default()
            },
        ])
        .expect("compile");
        assert_eq!(
            route(&set, &dom("198.19.5.1:443", "a.video.test")),
            out("tls-video")
        );
        assert_eq!(
            route(&set, &dom("198.19.5.1:80", "a.video.test")),
            Action::Reject
        );
        assert_eq!(
            route(&set, &dom("198.19.6.1:80", "a.video.test")),
            out("net")
        );
        assert_eq!(route(&set, &dom("198.19.6.1:80", "late.test")), out("net"));
        assert_eq!(route(&set, &dom("192.0.2.1:80", "late.test")), out("late"));
        assert_eq!(
            route(&set, &dom("192.0.2.1:80", "other.test")),
            out("default")
        );
        // A fake-ip address is no network: cidr rules skip it, ports and
        // domains still apply.
        let fake = |n| Target::fake_ip("198.19.5.9:80".parse().expect("a"), n);
        assert_eq!(route(&set, &fake("a.video.test")), out("default"));
        assert_eq!(route(&set, &fake("late.test")), out("late"));
        let fake443 = Target::fake_ip("198.19.5.9:443".parse().expect("a"), "x.video.test");
        assert_eq!(route(&set, &fake443), out("tls-video"));
    }

    #[test]
    fn domain_list_file() {
        let list = TempFile::new(
            "list",
            "# a comment\n\
             \n\
             full:Only.Exact.test\n\
             domain:suffix.test   # trailing comment\n\
             keyword:tracker\n\
             bare.test\n\
             \t  spaced.test  \n",
        );
        let set = compile(&[
            Rule {
                domain_list: Some(list.0.clone()),
                domain: vec!["inline.test".into()],
                action: out("listed"),
                ..Rule::default()
            },
            Rule {
                domain_suffix: vec!["test".into()],
                action: out("rest"),
                ..Rule::default()
            },
        ])
        .expect("compile");
        let a = "192.0.2.1:443";
        for n in [
            "only.exact.test",
            "x.suffix.test",
            "suffix.test",
            "my-tracker.example",
            "bare.test",
            "a.bare.test",
            "spaced.test",
            "inline.test",
        ] {
            assert_eq!(route(&set, &dom(a, n)), out("listed"), "{n}");
        }
        for n in ["www.only.exact.test", "comment.test", "xbare.test"] {
            assert_eq!(route(&set, &dom(a, n)), out("rest"), "{n}");
        }
    }

    #[test]
    fn bad_entries_name_rule_file_and_line() {
        let list = TempFile::new("bad", "ok.test\n# fine\nregexp:.*\\.test\n");
        let err = compile(&[
            Rule::default(),
            Rule {
                domain_list: Some(list.0.clone()),
                ..Rule::default()
            },
        ])
        .expect_err("unknown entry type");
        let RuleError::Bad { rule, reason } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(*rule, 1);
        assert!(
            reason.contains(&list.0.display().to_string()) && reason.contains("line 3"),
            "{reason}"
        );
        assert!(reason.contains("regexp"), "{reason}");
        let list = TempFile::new("badname", "a.test\nfull:a b.test\n");
        let e = compile(&[Rule {
            domain_list: Some(list.0.clone()),
            ..Rule::default()
        }])
        .expect_err("space");
        assert!(e.to_string().contains("line 2"), "{e}");
        let e = compile(&[Rule {
            domain_list: Some("/nonexistent/kerntun/list.txt".into()),
            ..Rule::default()
        }])
        .expect_err("missing");
        assert!(
            e.to_string()
                .starts_with("rules[0]: domain_list /nonexistent/kerntun/list.txt:"),
            "{e}"
        );
        for (rule, field) in [
            (
                Rule {
                    domain: vec!["ok.test".into(), "a..b".into()],
                    ..Rule::default()
                },
                "domain[1]",
            ),
            (
                Rule {
                    domain_suffix: vec!["x/y".into()],
                    ..Rule::default()
                },
                "domain_suffix[0]",
            ),
            (
                Rule {
                    domain_keyword: vec!["".into()],
                    ..Rule::default()
                },
                "domain_keyword[0]",
            ),
            (
                Rule {
                    domain: vec![format!("{}.test", "a".repeat(64))],
                    ..Rule::default()
                },
                "domain[0]",
            ),
        ] {
            let e = compile(&[rule]).expect_err(field).to_string();
            assert!(e.starts_with(&format!("rules[0]: {field}: ")), "{e}");
        }
    }

    #[test]
    fn list_of_100k_entries() {
        let mut text = String::with_capacity(3 << 20);
        for i in 0..100_000 {
            match i % 4 {
                0 => text.push_str(&format!("full:host{i}.exact.test\n")),
                1 => text.push_str(&format!("domain:zone{i}.test\n")),
                _ => text.push_str(&format!("site{i}.example\n")),
            }
        }
        let list = TempFile::new("100k", &text);
        let set = compile(&[
            Rule {
                domain_list: Some(list.0.clone()),
                action: Action::Reject,
                ..Rule::default()
            },
            Rule {
                action: out("other"),
                ..Rule::default()
            },
        ])
        .expect("compile");
        let a = "192.0.2.1:443";
        let started = std::time::Instant::now();
        let mut hits = 0;
        for i in 0..100_000 {
            let name = match i % 4 {
                0 => format!("host{i}.exact.test"),
                1 => format!("www.zone{i}.test"),
                _ => format!("SITE{i}.example."),
            };
            let t = Target::sniffed(a.parse().expect("a"), &name);
            if set.decide(&t) == Some(&Action::Reject) {
                hits += 1;
            }
        }
        assert_eq!(hits, 100_000, "every listed name matches");
        for n in [
            "www.host0.exact.test",
            "zone0.test",
            "xsite2.example",
            "site100000.example",
        ] {
            assert_eq!(route(&set, &dom(a, n)), out("other"), "{n}");
        }
        // Hash lookups, not a scan: 100k decisions against a 100k list take
        // milliseconds (a scan would be 10^10 comparisons). Generous bound
        // for a loaded, unoptimized test build.
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_secs(20), "{took:?}");
    }

    #[test]
    fn needs_domain_only_where_a_domain_could_change_the_route() {
        let set = compile(&[
            Rule {
                cidr: Some("10.0.0.0/8".parse().expect("net")),
                action: Action::Direct,
                ..Rule::default()
            },
            Rule {
                ports: Some("443".parse().expect("port")),
                domain_suffix: vec!["video.test".into()],
                action: out("proxy"),
                ..Rule::default()
            },
            // Same outcome as the default: knowing the domain changes nothing.
            Rule {
                domain: vec!["same.test".into()],
                action: out("default"),
                ..Rule::default()
            },
            Rule {
                action: out("default"),
                ..Rule::default()
            },
        ])
        .expect("compile");
        let def = Action::Direct;
        let n = |s: &str| s.parse::<SocketAddr>().expect("addr");
        assert!(set.needs_domain(n("192.0.2.1:443"), &def));
        // Decided by address before any domain rule.
        assert!(!set.needs_domain(n("10.1.2.3:443"), &def));
        // Port 80: only the same-outcome domain rule is in play.
        assert!(!set.needs_domain(n("192.0.2.1:80"), &def));
        // No catch-all: the default route is compared against.
        let set = compile(&[Rule {
            domain: vec!["a.test".into()],
            action: Action::Direct,
            ..Rule::default()
        }])
        .expect("compile");
        assert!(!set.needs_domain(n("192.0.2.1:443"), &Action::Direct));
        assert!(set.needs_domain(n("192.0.2.1:443"), &Action::Reject));
        // No domain rules at all, or an empty domain list.
        let empty = TempFile::new("empty", "# nothing\n");
        let set = compile(&[
            Rule {
                domain_list: Some(empty.0.clone()),
                action: Action::Reject,
                ..Rule::default()
            },
            Rule {
                cidr: Some("192.0.2.0/24".parse().expect("net")),
                action: Action::Reject,
                ..Rule::default()
            },
        ])
        .expect("compile");
        assert!(!set.needs_domain(n("192.0.2.1:443"), &def));
        assert!(!set.needs_domain(n("198.19.0.1:443"), &def));
    }

    #[test]
    fn network_condition() {
        let set = compile(&[
            // Reject QUIC to these domains: their apps fall back to TCP.
            Rule {
                network: Some(Network::Udp),
                ports: Some("443".parse().expect("port")),
                domain_suffix: vec!["video.test".into()],
                action: Action::Reject,
                ..Rule::default()
            },
            Rule {
                network: Some(Network::Tcp),
                ports: Some("22".parse().expect("port")),
                action: out("ssh"),
                ..Rule::default()
            },
            Rule {
                network: Some(Network::Udp),
                cidr: Some("192.0.2.0/24".parse().expect("net")),
                action: out("udp-net"),
                ..Rule::default()
            },
            Rule {
                action: out("default"),
                ..Rule::default()
            },
        ])
        .expect("compile");
        let a = |s: &str| s.parse::<SocketAddr>().expect("addr");
        let quic = Target::sniffed(a("198.51.100.1:443"), "a.video.test").udp();
        assert_eq!(quic.network, Network::Udp);
        assert_eq!(route(&set, &quic), Action::Reject);
        // The same name over TCP, or QUIC to another domain or port.
        assert_eq!(
            route(
                &set,
                &Target::sniffed(a("198.51.100.1:443"), "a.video.test")
            ),
            out("default")
        );
        assert_eq!(
            route(
                &set,
                &Target::sniffed(a("198.51.100.1:443"), "other.test").udp()
            ),
            out("default")
        );
        assert_eq!(
            route(
                &set,
                &Target::sniffed(a("198.51.100.1:8443"), "a.video.test").udp()
            ),
            out("default")
        );
        // A fake-ip UDP flow carries its domain too.
        let fake = Target::fake_ip(a("198.19.0.7:443"), "b.video.test");
        assert_eq!(route(&set, &fake.udp()), Action::Reject);
        assert_eq!(route(&set, &fake), out("default"));
        // Address-only rules per network.
        assert_eq!(route(&set, &Target::ip(a("198.51.100.1:22"))), out("ssh"));
        assert_eq!(
            route(&set, &Target::ip(a("198.51.100.1:22")).udp()),
            out("default")
        );
        assert_eq!(
            route(&set, &Target::ip(a("192.0.2.9:53")).udp()),
            out("udp-net")
        );
        assert_eq!(
            route(&set, &Target::ip(a("192.0.2.9:53")).on(Network::Tcp)),
            out("default")
        );
        // Sniffing a UDP flow is worth it only where a UDP rule names a
        // domain; TCP to the same address needs no domain.
        let def = Action::Direct;
        assert!(set.needs_domain_on(Network::Udp, a("198.51.100.1:443"), &def));
        assert!(!set.needs_domain_on(Network::Udp, a("198.51.100.1:80"), &def));
        assert!(!set.needs_domain(a("198.51.100.1:443"), &def));
        // The QUIC rule comes before the UDP address rule: here too.
        assert!(set.needs_domain_on(Network::Udp, a("192.0.2.9:443"), &def));
        assert!(!set.needs_domain_on(Network::Udp, a("192.0.2.9:80"), &def));
    }

    /// `package` and `uid` are one condition: the owner must be known and
    /// be any of them; the other conditions still apply. A flow without an
    /// owner never matches, whatever the rule names.
    #[test]
    fn owner_conditions() {
        let set = compile(&[
            Rule {
                package: vec!["com.example.blocked".into()],
                action: Action::Reject,
                ..Rule::default()
            },
            Rule {
                package: vec!["org.example.browser".into()],
                uid: vec![10_200],
                network: Some(Network::Tcp),
                action: out("proxy"),
                ..Rule::default()
            },
            Rule {
                uid: vec![1000],
                domain_suffix: vec!["update.test".into()],
                action: out("system"),
                ..Rule::default()
            },
            Rule {
                action: out("default"),
                ..Rule::default()
            },
        ])
        .expect("compile");
        let a: SocketAddr = "192.0.2.1:443".parse().expect("addr");
        let by = |uid, pkg| Target::ip(a).owned_by(uid, pkg);
        assert_eq!(
            route(&set, &by(10_100, Some("com.example.blocked"))),
            Action::Reject
        );
        assert_eq!(
            route(&set, &by(10_100, Some("com.example.blocked")).udp()),
            Action::Reject,
            "both networks"
        );
        // Package or uid, over TCP only.
        assert_eq!(
            route(&set, &by(10_101, Some("org.example.browser"))),
            out("proxy")
        );
        assert_eq!(
            route(&set, &by(10_200, None)),
            out("proxy"),
            "the uid alone"
        );
        assert_eq!(
            route(&set, &by(10_200, None).udp()),
            out("default"),
            "the network condition still applies"
        );
        // Exact names: no prefix, no case folding.
        for pkg in [
            "com.example",
            "com.example.blocked.extra",
            "COM.EXAMPLE.BLOCKED",
        ] {
            assert_eq!(route(&set, &by(10_300, Some(pkg))), out("default"), "{pkg}");
        }
        // Owner and domain together.
        let sniffed = Target::sniffed(a, "dl.update.test").owned_by(1000, None);
        assert_eq!(route(&set, &sniffed), out("system"));
        assert_eq!(route(&set, &by(1000, None)), out("default"), "no domain");
        // No owner known: no owner rule matches.
        assert_eq!(route(&set, &Target::ip(a)), out("default"));
        assert_eq!(
            route(&set, &Target::sniffed(a, "dl.update.test")),
            out("default")
        );
        // Needed before routing only where an owner rule's address
        // conditions hold.
        assert!(set.needs_owner_on(Network::Udp, a));
        let tcp_only = compile(&[Rule {
            package: vec!["a.b".into()],
            network: Some(Network::Tcp),
            ports: Some("443".parse().expect("port")),
            action: Action::Reject,
            ..Rule::default()
        }])
        .expect("compile");
        assert!(tcp_only.needs_owner_on(Network::Tcp, a));
        assert!(!tcp_only.needs_owner_on(Network::Udp, a));
        assert!(!tcp_only.needs_owner_on(Network::Tcp, "192.0.2.1:80".parse().expect("a")));
        let none = compile(&[Rule {
            domain: vec!["a.test".into()],
            action: Action::Reject,
            ..Rule::default()
        }])
        .expect("compile");
        assert!(!none.needs_owner_on(Network::Tcp, a), "no owner rules");
    }

    #[test]
    fn owner_rules_parse_label_and_refuse_bad_names() {
        #[derive(Deserialize, Serialize)]
        struct Rules {
            rules: Vec<Rule>,
        }
        let text = r#"
[[rules]]
package = ["org.example.browser", "com.example.mail"]
uid = [10123]
action = "proxy"

[[rules]]
action = "direct"
"#;
        let r: Rules = toml::from_str(text).expect("parse");
        assert_eq!(
            r.rules[0].package,
            ["org.example.browser", "com.example.mail"]
        );
        assert_eq!(r.rules[0].uid, [10_123]);
        assert!(r.rules[0].has_owner() && !r.rules[1].has_owner());
        assert_eq!(
            r.rules[0].label(0),
            "rules[0] package=org.example.browser+1 uid=10123"
        );
        let ser = toml::to_string(&r).expect("ser");
        let back: Rules = toml::from_str(&ser).expect("re-parse");
        assert_eq!(back.rules, r.rules);
        assert!(
            !toml::to_string(&Rules {
                rules: vec![r.rules[1].clone()]
            })
            .expect("ser")
            .contains("package")
        );
        for (bad, field) in [("", "package[0]"), ("com.example app", "package[0]")] {
            let e = compile(&[Rule {
                package: vec![bad.into()],
                ..Rule::default()
            }])
            .expect_err(bad)
            .to_string();
            assert!(e.starts_with(&format!("rules[0]: {field}: ")), "{e}");
        }
        let err = toml::from_str::<Rules>("[[rules]]\nuid = [-1]\naction = \"direct\"\n");
        assert!(err.is_err(), "a uid is unsigned");
    }

    #[test]
    fn network_in_toml() {
        #[derive(Deserialize, Serialize)]
        struct Rules {
            rules: Vec<Rule>,
        }
        let text = r#"
[[rules]]
network = "udp"
ports = "443"
domain_suffix = ["video.test"]
action = "reject"

[[rules]]
network = "tcp"
action = "proxy"

[[rules]]
action = "direct"
"#;
        let r: Rules = toml::from_str(text).expect("parse");
        let nets: Vec<_> = r.rules.iter().map(|r| r.network).collect();
        assert_eq!(nets, [Some(Network::Udp), Some(Network::Tcp), None]);
        let ser = toml::to_string(&r).expect("ser");
        assert_eq!(ser.matches("network").count(), 2, "{ser}");
        let back: Rules = toml::from_str(&ser).expect("re-parse");
        assert_eq!(back.rules, r.rules);
        let err = toml::from_str::<Rules>("[[rules]]\nnetwork = \"quic\"\naction = \"direct\"\n")
            .err()
            .expect("unknown network");
        let msg = err.to_string();
        assert!(msg.contains("quic") && msg.contains("udp"), "{msg}");
    }

    #[test]
    fn toml_fields() {
        #[derive(Deserialize, Serialize)]
        struct Rules {
            rules: Vec<Rule>,
        }
        let text = r#"
[[rules]]
domain = ["a.test"]
domain_suffix = ["b.test"]
domain_keyword = ["ads"]
domain_list = "/etc/kerntun/ads.txt"
ports = "443"
action = "reject"

[[rules]]
action = "proxy"
"#;
        let r: Rules = toml::from_str(text).expect("parse");
        assert_eq!(r.rules[0].domain, ["a.test"]);
        assert_eq!(r.rules[0].domain_suffix, ["b.test"]);
        assert_eq!(r.rules[0].domain_keyword, ["ads"]);
        assert_eq!(
            r.rules[0].domain_list.as_deref(),
            Some(Path::new("/etc/kerntun/ads.txt"))
        );
        assert!(r.rules[0].has_domain() && !r.rules[1].has_domain());
        let back: Rules = toml::from_str(&toml::to_string(&r).expect("ser")).expect("re-parse");
        assert_eq!(back.rules, r.rules);
        // Address-only rules serialize without the empty domain fields.
        assert!(
            !toml::to_string(&Rules {
                rules: vec![r.rules[1].clone()]
            })
            .expect("ser")
            .contains("domain")
        );
        let err = toml::from_str::<Rules>("[[rules]]\ndomains = [\"x\"]\naction = \"direct\"\n")
            .err()
            .expect("unknown field");
        assert!(err.to_string().contains("domains"), "{err}");
    }
}
