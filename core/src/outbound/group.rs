//! Outbound groups (`[groups.NAME]`): a name rules can send flows to that
//! stands for one of its members at a time.
//!
//! * `select`: the member the host picked (`Engine::select`), `default`
//!   until then;
//! * `url-test`: the fastest healthy member by probe, kept until another is
//!   faster by more than `tolerance_ms`;
//! * `fallback`: the first healthy member, in the order written.
//!
//! A member is a proxy of `[outbounds]`, `direct`, `reject` or another
//! group; cycles are refused at load. A new flow routed to a group takes the
//! group's current member, followed down nested groups with one atomic load
//! per level ([`Groups::resolve`]): the decision is made once per flow,
//! before its session exists, and the session carries only the member's
//! [`Route`], as for a rule that names the member. Running flows keep the
//! outbound they started on.
//!
//! A probe ([`Outbounds::probe`]) is a TCP connect plus an HTTP/1.1 GET
//! through the member, the time until the first bytes of a status line
//! (any status: the member reached the target). `url-test` and `fallback`
//! groups probe every member every `interval_ms` on the engine's runtime
//! ([`probe_loop`]), each probe bounded by `timeout_ms`, and start the next
//! round only when the last one ended: at most one probe per member of a
//! group is in flight. An engine without such a group runs no probe task.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicUsize};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::addr::Address;
use super::link::parse_server;
use super::{Outbounds, Route};

mod probe;
pub use probe::{ProbeError, probe_loop};

/// A group the configuration cannot use, named by its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("groups.{name}: {reason}")]
pub struct BadGroup {
    pub name: String,
    pub reason: String,
}

/// How a group picks its member.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GroupKind {
    /// The host's choice (`Engine::select`), `default` until then.
    Select,
    /// The fastest healthy member by probe.
    UrlTest,
    /// The first healthy member, in order.
    Fallback,
}

impl GroupKind {
    /// The name written in `type`.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupKind::Select => "select",
            GroupKind::UrlTest => "url-test",
            GroupKind::Fallback => "fallback",
        }
    }

    fn probes(self) -> bool {
        self != GroupKind::Select
    }
}

/// Probe interval when `interval_ms` is not set: 5 minutes, one small
/// request per member, so an idle phone is not woken often for it.
pub const DEFAULT_INTERVAL_MS: u64 = 300_000;
/// Probe timeout when `timeout_ms` is not set: the default
/// `direct.connect_timeout_ms`, what a connection gets before it fails.
pub const DEFAULT_TIMEOUT_MS: u64 = 5_000;
/// `url-test` keeps its member until another is this much faster, so two
/// members a few milliseconds apart do not trade places every round.
pub const DEFAULT_TOLERANCE_MS: u64 = 50;

/// One `[groups.NAME]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// `"select"`, `"url-test"` or `"fallback"`.
    #[serde(rename = "type")]
    pub kind: GroupKind,
    /// Proxies of `[outbounds]`, `direct`, `reject` or other groups; at
    /// least one, each once.
    pub members: Vec<String>,
    /// `select`: the member until the host selects another (default: the
    /// first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// `url-test`, `fallback`: the probe target, `http://host[:port]/path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// `url-test`, `fallback`: time between probe rounds
    /// ([`DEFAULT_INTERVAL_MS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_ms: Option<u64>,
    /// `url-test`: how much faster another member must be to take over
    /// ([`DEFAULT_TOLERANCE_MS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerance_ms: Option<u64>,
    /// `url-test`, `fallback`: a probe that has no answer by then failed
    /// ([`DEFAULT_TIMEOUT_MS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

impl GroupConfig {
    /// A group of `kind` over `members`, every other field at its default.
    pub fn new(kind: GroupKind, members: &[&str]) -> GroupConfig {
        GroupConfig {
            kind,
            members: members.iter().map(|m| (*m).to_owned()).collect(),
            default: None,
            url: None,
            interval_ms: None,
            tolerance_ms: None,
            timeout_ms: None,
        }
    }
}

/// A probe target: `http://host[:port]/path`, checked at load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeUrl {
    /// Where the probe connects (through the outbound).
    pub target: Address,
    /// The request's path (with its query), `/` when the URL has none.
    pub path: String,
    /// The `Host` header: the URL's authority as written.
    pub host: String,
}

impl FromStr for ProbeUrl {
    type Err = String;
    fn from_str(s: &str) -> Result<ProbeUrl, String> {
        let rest = s
            .get(..7)
            .filter(|p| p.eq_ignore_ascii_case("http://"))
            .map(|_| &s[7..])
            .ok_or_else(|| {
                format!(
                    "{s:?}: an http:// URL (the probe is a TCP connect and a plain HTTP/1.1 GET)"
                )
            })?;
        let rest = rest.split('#').next().unwrap_or_default();
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) if rest[i..].starts_with('/') => (&rest[..i], rest[i..].to_owned()),
            Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
            None => (rest, "/".to_owned()),
        };
        if authority.contains('@') {
            return Err(format!("{s:?}: credentials in a probe URL are not sent"));
        }
        if path.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(format!("{s:?}: the path has spaces or control characters"));
        }
        // `host` or `[v6]` without a port: HTTP's 80.
        let has_port = match authority.rfind(']') {
            Some(end) => authority[end..].contains(':'),
            None => authority.contains(':'),
        };
        let with_port = if has_port {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        let target = parse_server(&with_port).map_err(|e| format!("{s:?}: {e}"))?;
        Ok(ProbeUrl {
            target,
            path,
            host: authority.to_owned(),
        })
    }
}

impl ProbeUrl {
    /// The request the probe sends.
    fn request(&self) -> Vec<u8> {
        format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: kerntun\r\nConnection: close\r\n\r\n",
            self.path, self.host
        )
        .into_bytes()
    }
}

/// Check every group against the proxies `is_outbound` knows: names,
/// members, fields that go with the type, probe settings, cycles.
pub fn check(
    groups: &BTreeMap<String, GroupConfig>,
    is_outbound: impl Fn(&str) -> bool,
) -> Result<(), BadGroup> {
    for (name, g) in groups {
        let bad = |reason: String| BadGroup {
            name: name.clone(),
            reason,
        };
        super::config::check_key(name).map_err(bad)?;
        if is_outbound(name) {
            return Err(bad(format!(
                "outbounds.{name} has the same name; a rule could not tell them apart"
            )));
        }
        if g.members.is_empty() {
            return Err(bad("members: at least one is needed".into()));
        }
        for (i, m) in g.members.iter().enumerate() {
            if !(m == "direct" || m == "reject" || is_outbound(m) || groups.contains_key(m)) {
                return Err(bad(format!(
                    "members[{i}]: no outbound or group named {m:?} (direct, reject, a key of [outbounds] or of [groups])"
                )));
            }
            if g.members[..i].contains(m) {
                return Err(bad(format!("members[{i}]: {m:?} is listed twice")));
            }
        }
        let only = |field: &str, set: bool, kinds: &str| {
            if set {
                Err(bad(format!(
                    "{field}: only for {kinds} groups, not {}",
                    g.kind.as_str()
                )))
            } else {
                Ok(())
            }
        };
        match g.kind {
            GroupKind::Select => {
                only("url", g.url.is_some(), "url-test and fallback")?;
                only(
                    "interval_ms",
                    g.interval_ms.is_some(),
                    "url-test and fallback",
                )?;
                only(
                    "timeout_ms",
                    g.timeout_ms.is_some(),
                    "url-test and fallback",
                )?;
                only("tolerance_ms", g.tolerance_ms.is_some(), "url-test")?;
                if let Some(d) = &g.default
                    && !g.members.contains(d)
                {
                    return Err(bad(format!("default: {d:?} is not one of the members")));
                }
            }
            GroupKind::UrlTest | GroupKind::Fallback => {
                only("default", g.default.is_some(), "select")?;
                if g.kind == GroupKind::Fallback {
                    only("tolerance_ms", g.tolerance_ms.is_some(), "url-test")?;
                }
                let url = g.url.as_deref().ok_or_else(|| {
                    bad("url is needed (the probe target, http://host[:port]/path)".into())
                })?;
                url.parse::<ProbeUrl>()
                    .map_err(|e| bad(format!("url: {e}")))?;
                if g.interval_ms == Some(0) {
                    return Err(bad("interval_ms: must be greater than zero".into()));
                }
                if g.timeout_ms == Some(0) {
                    return Err(bad("timeout_ms: must be greater than zero".into()));
                }
            }
        }
    }
    // Cycles: a depth-first walk from every group along group members;
    // a group whose walk ended without a cycle is not walked again, so
    // each group is walked once however the groups nest.
    let mut done = std::collections::BTreeSet::new();
    for (name, g) in groups {
        let mut path = vec![name.as_str()];
        if let Some(i) = cycle(groups, g, &mut path, &mut done) {
            return Err(BadGroup {
                name: name.clone(),
                reason: format!(
                    "members[{i}]: {:?} leads back to {:?} ({}): groups may not contain themselves",
                    g.members[i],
                    path.last().copied().unwrap_or_default(),
                    path.join(" -> ")
                ),
            });
        }
    }
    Ok(())
}

/// The first member of `g` (the last group of `path`) whose groups lead
/// back into `path`: its index, with `path` then ending in the cycle.
/// Groups in `done` are known to lead to no cycle.
fn cycle<'a>(
    groups: &'a BTreeMap<String, GroupConfig>,
    g: &'a GroupConfig,
    path: &mut Vec<&'a str>,
    done: &mut std::collections::BTreeSet<&'a str>,
) -> Option<usize> {
    for (i, m) in g.members.iter().enumerate() {
        let Some(sub) = groups.get(m) else { continue };
        if done.contains(m.as_str()) {
            continue;
        }
        path.push(m);
        if path[..path.len() - 1].contains(&m.as_str()) || cycle(groups, sub, path, done).is_some()
        {
            return Some(i);
        }
        path.pop();
    }
    if let Some(last) = path.last() {
        done.insert(last);
    }
    None
}

/// What a rule resolves to: a route, or a group decided per flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    Route(Route),
    /// Index into [`Groups`].
    Group(usize),
}

/// A member's health as the last probe found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Not probed (yet, or never: `select` groups do not probe).
    Unknown,
    /// The last probe had an answer.
    Up,
    /// The last probe failed.
    Down,
}

// `MemberHealth::state`: 0 (the default) is not probed yet.
const UP: u8 = 1;
const DOWN: u8 = 2;

#[derive(Debug, Default)]
struct MemberHealth {
    state: AtomicU8,
    /// The last good probe's time, in ms.
    latency_ms: AtomicU32,
}

impl MemberHealth {
    fn health(&self) -> Health {
        match self.state.load(Relaxed) {
            UP => Health::Up,
            DOWN => Health::Down,
            _ => Health::Unknown,
        }
    }
}

/// What the probes of a group need.
#[derive(Debug)]
struct ProbeSpec {
    url: ProbeUrl,
    interval: Duration,
    timeout: Duration,
    tolerance_ms: u64,
}

#[derive(Debug)]
struct Group {
    name: String,
    kind: GroupKind,
    member_names: Vec<String>,
    members: Vec<Pick>,
    /// Index into `members`: the member new flows take.
    current: AtomicUsize,
    health: Box<[MemberHealth]>,
    probe: Option<ProbeSpec>,
}

/// The groups of one engine, with their current members.
#[derive(Debug, Default)]
pub struct Groups {
    list: Vec<Group>,
}

/// One member as [`Groups::states`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberState {
    pub name: String,
    pub health: Health,
    /// The last good probe's time; `None` before one.
    pub latency_ms: Option<u32>,
}

/// One group as [`Groups::states`] reports it (what an app draws its
/// server list from).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupState {
    pub name: String,
    pub kind: GroupKind,
    pub members: Vec<MemberState>,
    /// The member new flows take.
    pub selected: String,
}

/// Why [`Groups::select`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SelectError {
    /// No group has this name.
    #[error("no group named {0:?}")]
    UnknownGroup(String),
    /// The group picks its member itself (`url-test`, `fallback`).
    #[error("group {group:?} is a {kind} group; only select groups take a selection")]
    NotSelect { group: String, kind: &'static str },
    /// The group has no such member.
    #[error("group {group:?} has no member named {member:?}")]
    UnknownMember { group: String, member: String },
}

/// A change the host hears of (`EngineEvent::GroupSelected`,
/// `EngineEvent::OutboundHealth`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupEvent {
    Selected {
        group: String,
        member: String,
    },
    Health {
        group: String,
        member: String,
        healthy: bool,
        latency_ms: Option<u32>,
    },
}

impl Groups {
    /// Build checked groups; `index` finds a proxy's index by name.
    pub fn new(
        groups: &BTreeMap<String, GroupConfig>,
        index: impl Fn(&str) -> Option<usize>,
    ) -> Result<Groups, BadGroup> {
        check(groups, |n| index(n).is_some())?;
        let position = |n: &str| groups.keys().position(|k| k == n);
        let mut list = Vec::with_capacity(groups.len());
        for (name, g) in groups {
            let members: Vec<Pick> = g
                .members
                .iter()
                .map(|m| match m.as_str() {
                    "direct" => Pick::Route(Route::Direct),
                    "reject" => Pick::Route(Route::Reject),
                    m => match index(m) {
                        Some(i) => Pick::Route(Route::Proxy(i)),
                        // Checked above: a member is a proxy or a group.
                        None => Pick::Group(position(m).unwrap_or(0)),
                    },
                })
                .collect();
            let current = g
                .default
                .as_ref()
                .and_then(|d| g.members.iter().position(|m| m == d))
                .unwrap_or(0);
            let probe = match (g.kind.probes(), &g.url) {
                (true, Some(url)) => Some(ProbeSpec {
                    url: url.parse().map_err(|e| BadGroup {
                        name: name.clone(),
                        reason: format!("url: {e}"),
                    })?,
                    interval: Duration::from_millis(g.interval_ms.unwrap_or(DEFAULT_INTERVAL_MS)),
                    timeout: Duration::from_millis(g.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS)),
                    tolerance_ms: g.tolerance_ms.unwrap_or(DEFAULT_TOLERANCE_MS),
                }),
                _ => None,
            };
            list.push(Group {
                name: name.clone(),
                kind: g.kind,
                member_names: g.members.clone(),
                health: g.members.iter().map(|_| MemberHealth::default()).collect(),
                members,
                current: AtomicUsize::new(current),
                probe,
            });
        }
        Ok(Groups { list })
    }

    /// The index of the group `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.list.iter().position(|g| g.name == name)
    }

    /// Whether no group is configured.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The route a new flow sent to group `g` takes now: its current
    /// member, followed down nested groups. One atomic load per level; no
    /// lock, no allocation.
    pub fn resolve(&self, g: usize) -> Route {
        self.resolve_path(g, &mut super::Why::default())
    }

    /// [`Groups::resolve`], noting in `why` each group the walk went
    /// through (the first [`super::MAX_CHAIN`] of them).
    pub fn resolve_path(&self, mut g: usize, why: &mut super::Why) -> Route {
        // Cycles are refused at load, so a walk visits each group at most
        // once; the bound only keeps a bug from looping.
        for _ in 0..=self.list.len() {
            let Some(group) = self.list.get(g) else { break };
            why.push_group(g);
            match group.members.get(group.current.load(Relaxed)) {
                Some(Pick::Route(r)) => return *r,
                Some(Pick::Group(h)) => g = *h,
                None => break,
            }
        }
        Route::Reject
    }

    /// The name of group `g` (`?` for an index no group has).
    pub fn name(&self, g: usize) -> &str {
        self.list.get(g).map_or("?", |g| g.name.as_str())
    }

    /// Make `member` the member of the select group `group` for new flows.
    /// `Ok(true)` when that changed the selection.
    pub fn select(&self, group: &str, member: &str) -> Result<bool, SelectError> {
        let g = self
            .list
            .iter()
            .find(|g| g.name == group)
            .ok_or_else(|| SelectError::UnknownGroup(group.to_owned()))?;
        if g.kind != GroupKind::Select {
            return Err(SelectError::NotSelect {
                group: group.to_owned(),
                kind: g.kind.as_str(),
            });
        }
        let i = g
            .member_names
            .iter()
            .position(|m| m == member)
            .ok_or_else(|| SelectError::UnknownMember {
                group: group.to_owned(),
                member: member.to_owned(),
            })?;
        Ok(g.current.swap(i, Relaxed) != i)
    }

    /// Every group, its members' health and its current member.
    pub fn states(&self) -> Vec<GroupState> {
        self.list
            .iter()
            .map(|g| GroupState {
                name: g.name.clone(),
                kind: g.kind,
                members: g
                    .member_names
                    .iter()
                    .zip(g.health.iter())
                    .map(|(name, h)| MemberState {
                        name: name.clone(),
                        health: h.health(),
                        latency_ms: match h.latency_ms.load(Relaxed) {
                            0 => None,
                            ms => Some(ms),
                        },
                    })
                    .collect(),
                selected: g
                    .member_names
                    .get(g.current.load(Relaxed))
                    .cloned()
                    .unwrap_or_default(),
            })
            .collect()
    }

    /// The indices of the groups that probe their members.
    pub fn probed(&self) -> Vec<usize> {
        (0..self.list.len())
            .filter(|&i| self.list[i].probe.is_some())
            .collect()
    }
}

impl Outbounds {
    /// The route new flows sent to `name` take now: `direct`, `reject`, a
    /// proxy, or a group's current member. `None` for an unknown name.
    pub fn route_of(&self, name: &str) -> Option<Route> {
        match name {
            "direct" => Some(Route::Direct),
            "reject" => Some(Route::Reject),
            n => match self.names.iter().position(|x| x == n) {
                Some(i) => Some(Route::Proxy(i)),
                None => self.groups.index(n).map(|g| self.groups.resolve(g)),
            },
        }
    }

    /// The groups of this engine.
    pub fn groups(&self) -> &Groups {
        &self.groups
    }
}

/// The member a probing group should take now, `None` when none is up
/// (the current one stays: nothing better is known).
fn choose(group: &Group) -> Option<usize> {
    let up = |i: &usize| group.health[*i].state.load(Relaxed) == UP;
    let ms = |i: usize| u64::from(group.health[i].latency_ms.load(Relaxed));
    match group.kind {
        GroupKind::Select => None,
        GroupKind::Fallback => (0..group.members.len()).find(up),
        GroupKind::UrlTest => {
            let best = (0..group.members.len()).filter(up).min_by_key(|&i| ms(i))?;
            let cur = group.current.load(Relaxed);
            let tolerance = group.probe.as_ref().map_or(0, |p| p.tolerance_ms);
            if up(&cur) && ms(cur) <= ms(best) + tolerance {
                Some(cur)
            } else {
                Some(best)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn groups(text: &str) -> Result<BTreeMap<String, GroupConfig>, String> {
        crate::config::toml_tables(text, "groups")
    }

    fn proxies(n: &str) -> Option<usize> {
        ["hk", "us"].iter().position(|p| *p == n)
    }

    #[test]
    fn probe_urls() {
        let u: ProbeUrl = "http://example.com/generate_204".parse().expect("url");
        assert_eq!(u.target, Address::Domain("example.com".into(), 80));
        assert_eq!(
            (u.path.as_str(), u.host.as_str()),
            ("/generate_204", "example.com")
        );
        let u: ProbeUrl = "HTTP://[2001:db8::1]:8080?x=1".parse().expect("url");
        assert_eq!(
            u.target,
            Address::Ip("[2001:db8::1]:8080".parse().expect("a"))
        );
        assert_eq!(u.path, "/?x=1");
        let u: ProbeUrl = "http://192.0.2.1".parse().expect("url");
        assert_eq!(u.target, Address::Ip("192.0.2.1:80".parse().expect("a")));
        assert_eq!(u.path, "/");
        assert!(
            String::from_utf8(u.request())
                .expect("ascii")
                .starts_with("GET / HTTP/1.1\r\nHost: 192.0.2.1\r\n")
        );
        for bad in [
            "https://example.com/",
            "example.com",
            "http://u:p@example.com/",
            "http://example.com/a b",
            "http://",
        ] {
            assert!(bad.parse::<ProbeUrl>().is_err(), "{bad}");
        }
    }

    #[test]
    fn groups_resolve_and_select() {
        let g = groups(
            r#"
            [groups.auto]
            type = "fallback"
            members = ["us", "hk"]
            url = "http://192.0.2.1/"
            [groups.proxy]
            type = "select"
            members = ["hk", "auto", "direct", "reject"]
            default = "auto"
            "#,
        )
        .expect("parse");
        let gs = Groups::new(&g, proxies).expect("valid");
        let proxy = gs.index("proxy").expect("proxy");
        // `auto`'s first member until a probe says otherwise.
        assert_eq!(gs.resolve(proxy), Route::Proxy(1));
        assert_eq!(gs.select("proxy", "hk"), Ok(true));
        assert_eq!(gs.select("proxy", "hk"), Ok(false));
        assert_eq!(gs.resolve(proxy), Route::Proxy(0));
        assert_eq!(gs.select("proxy", "direct"), Ok(true));
        assert_eq!(gs.resolve(proxy), Route::Direct);
        assert_eq!(gs.select("proxy", "reject"), Ok(true));
        assert_eq!(gs.resolve(proxy), Route::Reject);
        assert_eq!(
            gs.select("nope", "hk"),
            Err(SelectError::UnknownGroup("nope".into()))
        );
        assert!(matches!(
            gs.select("auto", "hk"),
            Err(SelectError::NotSelect { .. })
        ));
        assert!(matches!(
            gs.select("proxy", "jp"),
            Err(SelectError::UnknownMember { .. })
        ));
        let s = gs.states();
        assert_eq!(s[1].selected, "reject");
        assert_eq!(s[0].members[0].health, Health::Unknown);
        assert_eq!(gs.probed(), vec![gs.index("auto").expect("auto")]);
    }

    #[test]
    fn fallback_and_url_test_choose() {
        let g = groups(
            r#"
            [groups.f]
            type = "fallback"
            members = ["hk", "us", "direct"]
            url = "http://192.0.2.1/"
            [groups.u]
            type = "url-test"
            members = ["hk", "us", "direct"]
            url = "http://192.0.2.1/"
            tolerance_ms = 20
            "#,
        )
        .expect("parse");
        let gs = Groups::new(&g, proxies).expect("valid");
        let set = |g: &Group, states: [(u8, u32); 3]| {
            for (h, (s, ms)) in g.health.iter().zip(states) {
                h.state.store(s, Relaxed);
                h.latency_ms.store(ms, Relaxed);
            }
        };
        let f = &gs.list[gs.index("f").expect("f")];
        set(f, [(DOWN, 0), (UP, 300), (UP, 10)]);
        assert_eq!(choose(f), Some(1), "the first healthy, not the fastest");
        set(f, [(DOWN, 0), (DOWN, 0), (DOWN, 0)]);
        assert_eq!(choose(f), None, "none up: keep what there is");
        let u = &gs.list[gs.index("u").expect("u")];
        set(u, [(UP, 100), (UP, 85), (DOWN, 1)]);
        assert_eq!(choose(u), Some(0), "15 ms better is within the tolerance");
        set(u, [(UP, 100), (UP, 79), (DOWN, 1)]);
        assert_eq!(choose(u), Some(1), "21 ms better is past it");
        set(u, [(DOWN, 100), (UP, 200), (UP, 250)]);
        assert_eq!(choose(u), Some(1), "the current one is down");
    }

    /// The whole configuration: rules may name groups, and a bad group's
    /// error names the line of its table.
    #[test]
    fn in_the_engine_config() {
        let head = r#"
            [tun]
            ipv4 = "198.18.0.1/16"
            [[rules]]
            action = "proxy"
            [outbounds.tokyo]
            url = "socks5://192.0.2.1:1080"
            [outbounds.paris]
            url = "socks5://192.0.2.2:1080"
            [groups.proxy]
            type = "select"
            members = ["auto", "tokyo", "direct"]
            default = "auto"
            [groups.auto]
            type = "url-test"
            members = ["tokyo", "paris"]
            url = "http://www.gstatic.com/generate_204"
            interval_ms = 300000
            timeout_ms = 5000
            tolerance_ms = 50
            "#;
        let c = crate::Config::from_toml(head).expect("valid");
        assert_eq!(c.groups["auto"].kind, GroupKind::UrlTest);
        assert_eq!(c.groups["proxy"].default.as_deref(), Some("auto"));
        let bad = format!(
            "{head}
[groups.loop]
type = \"select\"\nmembers = [\"loop\"]\n"
        );
        let e = crate::Config::from_toml(&bad).expect_err("cycle");
        assert!(e.starts_with("line 22: groups.loop: members[0]"), "{e}");
        let e = crate::Config::from_toml(&head.replace("action = \"proxy\"", "action = \"nope\""))
            .expect_err("unknown action");
        assert!(e.contains("[outbounds] or [groups]"), "{e}");
    }

    /// Each group is walked once in the cycle check: 40 groups, each
    /// containing every one before it (2^40 paths), load at once.
    #[test]
    fn deep_nesting_is_checked_in_linear_walks() {
        let mut g = BTreeMap::new();
        for i in 0..40 {
            let mut members: Vec<String> = (0..i).map(|j| format!("g{j:02}")).collect();
            members.push("us".into());
            let members: Vec<&str> = members.iter().map(String::as_str).collect();
            g.insert(
                format!("g{i:02}"),
                GroupConfig::new(GroupKind::Select, &members),
            );
        }
        let start = Instant::now();
        let gs = Groups::new(&g, proxies).expect("no cycle");
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(gs.resolve(gs.index("g39").expect("g39")), Route::Proxy(1));
        g.get_mut("g00").expect("g00").members.push("g39".into());
        let e = Groups::new(&g, proxies).expect_err("g00 -> g39 -> g00");
        assert!(e.to_string().contains("leads back to"), "{e}");
    }

    #[test]
    fn bad_groups_name_the_field() {
        for (text, want) in [
            (
                "[groups.g]\ntype = \"select\"\nmembers = []",
                "groups.g: members: at least one",
            ),
            (
                "[groups.g]\ntype = \"select\"\nmembers = [\"jp\"]",
                "groups.g: members[0]: no outbound or group named \"jp\"",
            ),
            (
                "[groups.g]\ntype = \"select\"\nmembers = [\"hk\", \"hk\"]",
                "members[1]: \"hk\" is listed twice",
            ),
            (
                "[groups.hk]\ntype = \"select\"\nmembers = [\"us\"]",
                "groups.hk: outbounds.hk has the same name",
            ),
            (
                "[groups.direct]\ntype = \"select\"\nmembers = [\"us\"]",
                "built in",
            ),
            (
                "[groups.g]\ntype = \"select\"\nmembers = [\"us\"]\ndefault = \"hk\"",
                "default: \"hk\" is not one of the members",
            ),
            (
                "[groups.g]\ntype = \"select\"\nmembers = [\"us\"]\nurl = \"http://a/\"",
                "url: only for url-test and fallback",
            ),
            (
                "[groups.g]\ntype = \"fallback\"\nmembers = [\"us\"]",
                "url is needed",
            ),
            (
                "[groups.g]\ntype = \"fallback\"\nmembers = [\"us\"]\nurl = \"http://a/\"\ntolerance_ms = 5",
                "tolerance_ms: only for url-test",
            ),
            (
                "[groups.g]\ntype = \"url-test\"\nmembers = [\"us\"]\nurl = \"https://a/\"",
                "url: \"https://a/\": an http:// URL",
            ),
            (
                "[groups.g]\ntype = \"url-test\"\nmembers = [\"us\"]\nurl = \"http://a/\"\ninterval_ms = 0",
                "interval_ms: must be greater than zero",
            ),
            (
                "[groups.a]\ntype = \"select\"\nmembers = [\"b\"]\n[groups.b]\ntype = \"select\"\nmembers = [\"us\", \"a\"]",
                "groups.a: members[0]: \"b\" leads back to \"a\" (a -> b -> a)",
            ),
            (
                "[groups.a]\ntype = \"select\"\nmembers = [\"a\"]",
                "groups.a: members[0]: \"a\" leads back to \"a\"",
            ),
        ] {
            let g = groups(text).expect(text);
            let e = Groups::new(&g, proxies).expect_err(text).to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        let e = groups("[groups.g]\ntype = \"round-robin\"\nmembers = [\"us\"]").expect_err("type");
        assert!(e.contains("url-test"), "{e}");
    }
}
