//! The JSON the dashboards read, built from the engine's run-time API
//! (`Engine::groups`, `Engine::connections`, `Engine::stats`) and from the
//! config the command started with (outbounds, rules). Field names and types
//! are those the dashboards parse (docs/controller.md lists them).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use kerntun::config::{Config, OutboundConfig};
use kerntun::conns::{Connection, Listing};
use kerntun::outbound::group::{GroupKind, GroupState, Health};
use kerntun::rules::{Network, Rule};
use kerntun::{EngineEvent, EventSink, StatsSnapshot};
use serde_json::{Value, json};

/// Latencies kept per outbound (`history` in `/proxies`).
const HISTORY: usize = 10;

/// What the controller knows of the config: the plain outbounds with their
/// dashboard type, and the rules.
#[derive(Debug, Clone)]
pub struct Static {
    /// Name and type (`Direct`, `Reject`, `Socks5`, `Shadowsocks`), in
    /// the config's order after `direct` and `reject`.
    pub outbounds: Vec<(String, &'static str)>,
    pub rules: Vec<Rule>,
    /// `tun.ipv6` is set.
    pub ipv6: bool,
}

impl Static {
    pub fn from_config(cfg: &Config) -> Static {
        let mut outbounds = vec![
            ("direct".to_owned(), "Direct"),
            ("reject".to_owned(), "Reject"),
        ];
        for (name, ob) in &cfg.outbounds {
            let kind = match ob {
                OutboundConfig::Socks5(_) => "Socks5",
                OutboundConfig::Shadowsocks(_) => "Shadowsocks",
            };
            outbounds.push((name.clone(), kind));
        }
        Static {
            outbounds,
            rules: cfg.rules.clone(),
            ipv6: cfg.tun.ipv6.is_some(),
        }
    }
}

/// Measured latencies by outbound name: the controller's delay tests and
/// the group probes the engine reports (`EngineEvent::OutboundHealth`).
/// A few entries per name; names come from the config, so the map is
/// bounded by it.
#[derive(Debug, Default)]
pub struct History {
    by_name: Mutex<HashMap<String, VecDeque<(u64, u32)>>>,
}

impl History {
    pub fn record(&self, name: &str, delay_ms: u32) {
        let mut map = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        let h = map.entry(name.to_owned()).or_default();
        if h.len() == HISTORY {
            h.pop_front();
        }
        h.push_back((now_ms(), delay_ms));
    }

    fn json(&self, name: &str) -> Value {
        let map = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        let list: Vec<Value> = map.get(name).map_or_else(Vec::new, |h| {
            h.iter()
                .map(|(t, d)| json!({"time": rfc3339(*t), "delay": d}))
                .collect()
        });
        Value::Array(list)
    }
}

impl EventSink for History {
    fn event(&self, event: EngineEvent) {
        if let EngineEvent::OutboundHealth {
            member,
            healthy: true,
            latency_ms: Some(ms),
            ..
        } = event
        {
            self.record(&member, ms);
        }
    }
}

fn group_type(kind: GroupKind) -> &'static str {
    match kind {
        GroupKind::Select => "Selector",
        GroupKind::UrlTest => "URLTest",
        GroupKind::Fallback => "Fallback",
        // A kind added later still lists, under its own name.
        #[allow(unreachable_patterns)]
        other => other.as_str(),
    }
}

/// One group as `/proxies` shows it.
pub fn group_json(g: &GroupState, history: &History) -> Value {
    let alive = g
        .members
        .iter()
        .find(|m| m.name == g.selected)
        .is_none_or(|m| m.health != Health::Down);
    json!({
        "name": g.name,
        "type": group_type(g.kind),
        "all": g.members.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(),
        "now": g.selected,
        "history": history.json(&g.selected),
        "alive": alive,
        "udp": true,
    })
}

/// One plain outbound as `/proxies` shows it; `alive` is false when a
/// group's last probe of it failed.
pub fn outbound_json(name: &str, kind: &str, groups: &[GroupState], history: &History) -> Value {
    let down = groups
        .iter()
        .flat_map(|g| &g.members)
        .any(|m| m.name == name && m.health == Health::Down);
    json!({
        "name": name,
        "type": kind,
        "history": history.json(name),
        "alive": !down,
        "udp": kind != "Reject",
    })
}

/// `GET /proxies`: every group and plain outbound by name.
pub fn proxies_json(st: &Static, groups: &[GroupState], history: &History) -> Value {
    let mut all = serde_json::Map::new();
    for (name, kind) in &st.outbounds {
        all.insert(name.clone(), outbound_json(name, kind, groups, history));
    }
    for g in groups {
        all.insert(g.name.clone(), group_json(g, history));
    }
    json!({ "proxies": all })
}

/// One proxy or group by name, if there is one.
pub fn proxy_json(
    st: &Static,
    groups: &[GroupState],
    history: &History,
    name: &str,
) -> Option<Value> {
    if let Some(g) = groups.iter().find(|g| g.name == name) {
        return Some(group_json(g, history));
    }
    st.outbounds
        .iter()
        .find(|(n, _)| n == name)
        .map(|(n, kind)| outbound_json(n, kind, groups, history))
}

fn network(n: Network) -> &'static str {
    match n {
        Network::Tcp => "tcp",
        Network::Udp => "udp",
    }
}

/// One connection in Clash's shape: `chains` is the outbound that carries
/// it, then the groups that chose it from the innermost out (the record's
/// `chain` is outermost first); `rule` the rule's label (its `name`, or its
/// place and conditions), empty when no rule matched. The owning app, when
/// known (`owner.rs`), is `metadata.process` (its package, as mihomo names
/// an Android app's) and `metadata.uid`; `uid` is left out while unknown.
fn connection_json(c: &Connection, _groups: &[GroupState]) -> Value {
    let host = c.domain.clone().unwrap_or_default();
    let chains: Vec<&str> = (c.outbound.as_deref().into_iter())
        .chain(c.chain.iter().rev().map(String::as_str))
        .collect();
    let mut v = json!({
        "id": c.id.to_string(),
        "metadata": {
            "network": network(c.network),
            "type": "Tun",
            "sourceIP": c.source.ip().to_string(),
            "sourcePort": c.source.port().to_string(),
            "destinationIP": c.destination.ip().to_string(),
            "destinationPort": c.destination.port().to_string(),
            "host": host,
            "sniffHost": if c.domain_source == kerntun::conns::DomainSource::Sniffed { host.as_str() } else { "" },
            "dnsMode": if c.domain_source == kerntun::conns::DomainSource::FakeIp { "fake-ip" } else { "normal" },
            "processPath": "",
            "process": c.package.as_deref().unwrap_or(""),
        },
        "upload": c.bytes_up,
        "download": c.bytes_down,
        "start": rfc3339(c.started_unix_ms),
        "chains": chains,
        "rule": c.rule.as_deref().unwrap_or(if c.outbound.is_some() { "default" } else { "" }),
        "rulePayload": "",
    });
    if let Some(uid) = c.uid {
        v["metadata"]["uid"] = json!(uid);
    }
    v
}

/// Bytes moved so far, up and down (TCP and UDP payload).
pub fn totals(s: &StatsSnapshot) -> (u64, u64) {
    (
        s.tcp_bytes_up.saturating_add(s.udp_bytes_up),
        s.tcp_bytes_down.saturating_add(s.udp_bytes_down),
    )
}

/// `GET /connections`.
pub fn connections_json(list: &Listing, stats: &StatsSnapshot, groups: &[GroupState]) -> Value {
    let (up, down) = totals(stats);
    json!({
        "downloadTotal": down,
        "uploadTotal": up,
        "connections": list.connections.iter().map(|c| connection_json(c, groups)).collect::<Vec<_>>(),
        "truncated": list.truncated,
        "memory": 0,
    })
}

/// `GET /rules`: each rule with the dashboards' type names. A rule with
/// one kind of condition shows as that kind; several kinds show as `AND`
/// with each condition in parentheses; none is `Match`.
pub fn rules_json(rules: &[Rule]) -> Value {
    let list: Vec<Value> = rules
        .iter()
        .map(|r| {
            let mut parts: Vec<(&str, String)> = Vec::new();
            if let Some(c) = &r.cidr {
                let kind = if matches!(c, ipnet::IpNet::V6(_)) {
                    "IPCIDR6"
                } else {
                    "IPCIDR"
                };
                parts.push((kind, c.to_string()));
            }
            if let Some(p) = &r.ports {
                let text = serde_json::to_value(p)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned).or(Some(v.to_string())))
                    .unwrap_or_default();
                parts.push(("DstPort", text));
            }
            if let Some(n) = r.network {
                parts.push(("Network", network(n).to_owned()));
            }
            for (kind, list) in [
                ("Domain", &r.domain),
                ("DomainSuffix", &r.domain_suffix),
                ("DomainKeyword", &r.domain_keyword),
            ] {
                if !list.is_empty() {
                    parts.push((kind, list.join(",")));
                }
            }
            if let Some(path) = &r.domain_list {
                parts.push(("DomainList", path.display().to_string()));
            }
            // mihomo's PROCESS-NAME matches an Android package name.
            if !r.package.is_empty() {
                parts.push(("ProcessName", r.package.join(",")));
            }
            if !r.uid.is_empty() {
                let uids: Vec<String> = r.uid.iter().map(u32::to_string).collect();
                parts.push(("Uid", uids.join(",")));
            }
            let proxy = serde_json::to_value(&r.action)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            let (kind, payload) = match parts.len() {
                0 => ("Match".to_owned(), String::new()),
                1 => {
                    let (k, p) = parts.remove(0);
                    (k.to_owned(), p)
                }
                _ => (
                    "AND".to_owned(),
                    format!(
                        "({})",
                        parts
                            .iter()
                            .map(|(k, p)| format!("({k},{p})"))
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                ),
            };
            json!({"type": kind, "payload": payload, "proxy": proxy, "size": -1})
        })
        .collect();
    json!({ "rules": list })
}

/// `GET /configs`: kerntun has no local proxy ports and routes by rules.
pub fn configs_json(log_level: &str, ipv6: bool) -> Value {
    json!({
        "port": 0,
        "socks-port": 0,
        "redir-port": 0,
        "tproxy-port": 0,
        "mixed-port": 0,
        "allow-lan": false,
        "bind-address": "*",
        "mode": "rule",
        "log-level": log_level,
        "ipv6": ipv6,
    })
}

/// `GET /version`.
pub fn version_json() -> Value {
    json!({
        "version": format!("kerntun {}", env!("CARGO_PKG_VERSION")),
        "premium": false,
        "meta": false,
    })
}

/// An error body: `{"message": ...}`.
pub fn message(text: impl Into<String>) -> Value {
    let text: String = text.into();
    json!({ "message": text })
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Unix milliseconds as RFC 3339 in UTC with milliseconds
/// (`2026-12-02T15:44:02.123Z`).
pub fn rfc3339(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let ms = unix_ms % 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day): the
/// era arithmetic of a 400-year cycle (146,097 days).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        // date -u -d @951782400 : 2000-02-29 00:00:00 (a leap day)
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        // date -u -d @1796139842 : 2026-12-01 15:44:02
        assert_eq!(rfc3339(1_796_139_842_123), "2026-12-01T15:44:02.123Z");
        assert_eq!(rfc3339(4_107_542_399_999), "2100-02-28T23:59:59.999Z");
    }

    #[test]
    fn rules_show_in_dashboard_types() {
        let rules: Vec<Rule> = toml::from_str::<toml::Table>(
            r#"
            [[r]]
            cidr = "10.0.0.0/8"
            action = "reject"
            [[r]]
            domain_suffix = ["a.org", "b.org"]
            action = "direct"
            [[r]]
            cidr = "fd00::/8"
            ports = "443"
            action = "direct"
            [[r]]
            package = ["com.example.app"]
            action = "reject"
            [[r]]
            action = "direct"
            "#,
        )
        .expect("toml")["r"]
            .clone()
            .try_into()
            .expect("rules");
        let v = rules_json(&rules);
        let r = v["rules"].as_array().expect("array");
        assert_eq!(r[0]["type"], "IPCIDR");
        assert_eq!(r[0]["payload"], "10.0.0.0/8");
        assert_eq!(r[0]["proxy"], "reject");
        assert_eq!(r[1]["type"], "DomainSuffix");
        assert_eq!(r[1]["payload"], "a.org,b.org");
        assert_eq!(r[2]["type"], "AND");
        assert_eq!(r[2]["payload"], "((IPCIDR6,fd00::/8),(DstPort,443))");
        assert_eq!(r[3]["type"], "ProcessName");
        assert_eq!(r[3]["payload"], "com.example.app");
        assert_eq!(r[4]["type"], "Match");
    }

    /// The owning app shows as mihomo's `metadata.process` and `uid`;
    /// unknown, `process` is empty and `uid` absent.
    #[test]
    fn connections_carry_their_owner() {
        let c = Connection {
            id: 7,
            network: Network::Udp,
            source: "10.0.0.2:5000".parse().expect("addr"),
            destination: "192.0.2.1:443".parse().expect("addr"),
            domain: None,
            domain_source: kerntun::conns::DomainSource::None,
            rule: None,
            chain: Vec::new(),
            outbound: Some("direct".into()),
            bytes_up: 1,
            bytes_down: 2,
            started_unix_ms: 0,
            state: kerntun::conns::ConnState::Relaying,
            uid: Some(10_123),
            package: Some("com.example.app".into()),
        };
        let v = connection_json(&c, &[]);
        assert_eq!(v["metadata"]["process"], "com.example.app");
        assert_eq!(v["metadata"]["uid"], 10_123);
        let unknown = Connection {
            uid: None,
            package: None,
            ..c
        };
        let v = connection_json(&unknown, &[]);
        assert_eq!(v["metadata"]["process"], "");
        assert!(v["metadata"].get("uid").is_none());
    }
}
