//! `Engine.handleMessage`: the engine's run-time control as JSON messages,
//! for an app whose UI runs in another process than the engine (iOS: the
//! containing app and its Packet Tunnel extension,
//! `NETunnelProviderSession.sendProviderMessage` ->
//! `handleAppMessage`; Android: an activity and the VpnService, through a
//! `Messenger`). The schema (v1) is documented in docs/messages.md; in
//! short:
//!
//! * request: `{"v":1, "id":<string|number|null>, "cmd":"stats", "args":{...}}`
//! * reply: `{"v":1, "id":<the request's>, "ok":{...}}` or
//!   `{"v":1, "id":..., "error":{"kind":"not_running", "message":"...", "field":...}}`
//!
//! Each command calls the `Engine` method of the same name, so a message
//! answers exactly what the call answers in the engine's process. Bounded:
//! a request over [`MAX_REQUEST_BYTES`] is refused unread, a connection
//! list carries at most [`MAX_MESSAGE_CONNECTIONS`] records, a latency
//! probe waits at most [`MAX_LATENCY_TIMEOUT_MS`]. Nothing the sender
//! writes makes it panic; should the library panic anyway, the reply is an
//! `internal` error.

use std::collections::HashMap;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use crate::config::{EngineConfig, LogLevel};
use crate::connections::{ConnectionFilter, ConnectionRecord};
use crate::engine::Engine;
use crate::error::{KerntunError, panic_message};
use crate::logging::LogRecord;

/// The schema version this library speaks (the `v` of requests and
/// replies).
pub const MESSAGE_VERSION: u64 = 1;

/// Largest request accepted, in bytes (1 MiB): room for a `reload` with a
/// configuration of thousands of rules, while a sender cannot make the
/// engine's process parse (and hold) an arbitrary amount. Larger ones get
/// a `too_large` error.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// Records a `connections` reply carries at most (also its default
/// `limit`). A record with the longest domain (253 bytes), a 140-byte rule,
/// three groups, IPv6 addresses, a uid and a 150-byte package name is
/// 1,072 bytes of JSON (`a_full_connections_page_stays_under_a_mib`), so a
/// full reply stays under 1 MiB; the `Engine.connections` call in the engine's own process
/// lists up to [`crate::MAX_CONNECTIONS`].
pub const MAX_MESSAGE_CONNECTIONS: u64 = 900;

/// Longest `timeout_ms` a `test_latency` message may ask for (30 s), and
/// what one without it gets (5 s): the reply waits for the probe.
pub const MAX_LATENCY_TIMEOUT_MS: u32 = 30_000;
const DEFAULT_LATENCY_TIMEOUT_MS: u32 = 5_000;

/// Why a message failed: `kind` is the stable name the app matches on
/// (docs/messages.md, "Errors"); `field` names the argument or the
/// configuration field at fault, when there is one.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MessageError {
    kind: &'static str,
    message: String,
    field: Option<String>,
}

impl MessageError {
    fn new(kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            field: None,
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new("bad_request", message)
    }

    fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    fn not_running(cmd: &str) -> Self {
        Self::new("not_running", format!("{cmd} needs a running engine"))
    }
}

impl From<KerntunError> for MessageError {
    fn from(e: KerntunError) -> Self {
        let message = e.to_string();
        let (kind, field) = match e {
            KerntunError::Config { field, .. } => ("config", Some(field)),
            KerntunError::Network { field, .. } => ("network", Some(field)),
            KerntunError::NeedsRestart { field } => ("needs_restart", Some(field)),
            KerntunError::NotRunning { .. } => ("not_running", None),
            KerntunError::UnknownGroup { .. } => ("unknown_group", None),
            KerntunError::NotSelectGroup { .. } => ("not_select_group", None),
            KerntunError::UnknownMember { .. } => ("unknown_member", None),
            KerntunError::UnknownOutbound { .. } => ("unknown_outbound", None),
            KerntunError::InvalidUrl { .. } => ("invalid_url", None),
            KerntunError::LatencyTimeout { .. } => ("latency_timeout", None),
            KerntunError::Unreachable { .. } => ("unreachable", None),
            KerntunError::Link { .. } => ("link", None),
            KerntunError::Runtime { .. } => ("runtime", None),
            KerntunError::Tun { .. } => ("tun", None),
            KerntunError::Address { .. } => ("address", None),
            KerntunError::Listener { .. } => ("listener", None),
            KerntunError::Logging { .. } => ("logging", None),
            KerntunError::Internal { .. } => ("internal", None),
        };
        Self {
            kind,
            message,
            field: field.filter(|f| !f.is_empty()),
        }
    }
}

/// A request's envelope, read field by field so that a reply can echo the
/// `id` even when the rest is wrong.
struct Request {
    id: Value,
    cmd: String,
    args: Map<String, Value>,
}

/// Parse and check a request: size, JSON, envelope, version. The error
/// carries the id when one was read.
fn parse_request(bytes: &[u8]) -> Result<Request, (Value, MessageError)> {
    if bytes.len() > MAX_REQUEST_BYTES {
        return Err((
            Value::Null,
            MessageError::new(
                "too_large",
                format!(
                    "the request has {} bytes; at most {MAX_REQUEST_BYTES} are read",
                    bytes.len()
                ),
            ),
        ));
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        (
            Value::Null,
            MessageError::bad_request(format!("not JSON: {e}")),
        )
    })?;
    let Value::Object(mut envelope) = value else {
        return Err((
            Value::Null,
            MessageError::bad_request("the request is not a JSON object"),
        ));
    };
    let id = match envelope.remove("id") {
        None => Value::Null,
        Some(id @ (Value::Null | Value::String(_) | Value::Number(_))) => id,
        Some(_) => {
            return Err((
                Value::Null,
                MessageError::bad_request("id must be a string, a number or null").with_field("id"),
            ));
        }
    };
    let fail = |e: MessageError| -> Result<Request, (Value, MessageError)> { Err((id.clone(), e)) };
    match envelope.get("v") {
        None => return fail(MessageError::bad_request("v is missing").with_field("v")),
        Some(v) if v.as_u64() == Some(MESSAGE_VERSION) => {}
        Some(v) => {
            return fail(
                MessageError::new(
                    "unsupported_version",
                    format!(
                        "version {v} is not spoken here; this engine speaks v{MESSAGE_VERSION}"
                    ),
                )
                .with_field("v"),
            );
        }
    }
    let cmd = match envelope.remove("cmd") {
        Some(Value::String(cmd)) => cmd,
        Some(_) => {
            return fail(MessageError::bad_request("cmd must be a string").with_field("cmd"));
        }
        None => return fail(MessageError::bad_request("cmd is missing").with_field("cmd")),
    };
    let args = match envelope.remove("args") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(args)) => args,
        Some(_) => {
            return fail(MessageError::bad_request("args must be an object").with_field("args"));
        }
    };
    Ok(Request { id, cmd, args })
}

/// A command's arguments as `T`: unknown or mistyped ones are refused
/// (`bad_request`), never ignored: a misspelt filter of
/// `close_connections` must not close everything.
fn args<T: DeserializeOwned>(cmd: &str, args: Map<String, Value>) -> Result<T, MessageError> {
    serde_json::from_value(Value::Object(args))
        .map_err(|e| MessageError::bad_request(format!("{cmd} args: {e}")).with_field("args"))
}

/// Arguments of the commands that take none (any given are refused).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoArgs {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ConnectionsArgs {
    limit: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CloseConnectionArgs {
    id: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SelectArgs {
    group: String,
    member: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TestLatencyArgs {
    outbound: String,
    url: String,
    timeout_ms: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReloadArgs {
    config: Map<String, Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LevelArgs {
    level: LogLevel,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RecentLogsArgs {
    limit: Option<u64>,
}

/// The commands, in the order docs/messages.md lists them.
pub(crate) const COMMANDS: &[&str] = &[
    "status",
    "stats",
    "connections",
    "close_connection",
    "close_connections",
    "groups",
    "select",
    "test_latency",
    "reload",
    "set_log_level",
    "recent_logs",
];

fn to_value<T: serde::Serialize>(v: &T) -> Value {
    // Serializing these records into a `Value` cannot fail: their keys are
    // field names and their values numbers, strings and lists.
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// Run one command on `engine` (`None`: no engine in this process).
fn run(engine: Option<&Engine>, cmd: &str, a: Map<String, Value>) -> Result<Value, MessageError> {
    if !COMMANDS.contains(&cmd) {
        return Err(MessageError::new(
            "unknown_command",
            format!(
                "no command {cmd:?}; this engine knows {}",
                COMMANDS.join(", ")
            ),
        )
        .with_field("cmd"));
    }
    if cmd == "status" {
        args::<NoArgs>(cmd, a)?;
        return Ok(status(engine));
    }
    let Some(engine) = engine else {
        return Err(MessageError::not_running(cmd));
    };
    match cmd {
        "stats" => {
            args::<NoArgs>(cmd, a)?;
            Ok(to_value(&engine.stats()))
        }
        "connections" => {
            let ConnectionsArgs { limit } = args(cmd, a)?;
            Ok(connections(engine, limit))
        }
        "close_connection" => {
            let CloseConnectionArgs { id } = args(cmd, a)?;
            Ok(json!({ "closed": engine.close_connection(id) }))
        }
        "close_connections" => {
            let filter: ConnectionFilter = args(cmd, a)?;
            Ok(json!({ "closed": engine.close_connections(filter)? }))
        }
        "groups" => {
            args::<NoArgs>(cmd, a)?;
            Ok(json!({ "groups": to_value(&engine.groups()) }))
        }
        "select" => {
            let SelectArgs { group, member } = args(cmd, a)?;
            engine.select(group, member)?;
            Ok(json!({}))
        }
        "test_latency" => {
            let TestLatencyArgs {
                outbound,
                url,
                timeout_ms,
            } = args(cmd, a)?;
            let timeout = timeout_ms
                .unwrap_or(DEFAULT_LATENCY_TIMEOUT_MS)
                .min(MAX_LATENCY_TIMEOUT_MS);
            Ok(json!({ "latency_ms": engine.test_latency(outbound, url, timeout)? }))
        }
        "reload" => {
            let ReloadArgs { config } = args(cmd, a)?;
            let report = engine.reload_from(|running| merge(running, config))?;
            Ok(to_value(&report))
        }
        "set_log_level" => {
            let LevelArgs { level } = args(cmd, a)?;
            engine.set_log_level(level);
            Ok(json!({}))
        }
        "recent_logs" => {
            let RecentLogsArgs { limit } = args(cmd, a)?;
            Ok(recent_logs(engine.recent_logs(), limit))
        }
        // Every name in COMMANDS has its arm above.
        _ => Err(MessageError::new(
            "internal",
            format!("{cmd} has no handler"),
        )),
    }
}

fn status(engine: Option<&Engine>) -> Value {
    json!({
        "running": engine.is_some_and(Engine::is_running),
        "error": engine.and_then(Engine::error),
        "tun_name": engine.and_then(Engine::tun_name),
        "events_dropped": engine.map_or(0, Engine::events_dropped),
        "version": kerntun::VERSION,
        "message_versions": [MESSAGE_VERSION],
    })
}

/// At most `limit` connections (default and cap
/// [`MAX_MESSAGE_CONNECTIONS`]); only that many are copied out of the
/// engine. `truncated`: there were more.
fn connections(engine: &Engine, limit: Option<u64>) -> Value {
    let cap = limit
        .unwrap_or(MAX_MESSAGE_CONNECTIONS)
        .min(MAX_MESSAGE_CONNECTIONS);
    let listing = engine
        .running()
        .map(|e| e.connections_up_to(usize::try_from(cap).unwrap_or(usize::MAX)))
        .unwrap_or_default();
    let records: Vec<ConnectionRecord> = listing
        .connections
        .into_iter()
        .map(ConnectionRecord::from)
        .collect();
    json!({ "connections": to_value(&records), "truncated": listing.truncated })
}

/// The newest `limit` lines (default: all the ring keeps), oldest first.
fn recent_logs(mut lines: Vec<LogRecord>, limit: Option<u64>) -> Value {
    if let Some(limit) = limit {
        let keep = usize::try_from(limit)
            .unwrap_or(usize::MAX)
            .min(lines.len());
        lines.drain(..lines.len() - keep);
    }
    json!({ "lines": to_value(&lines) })
}

/// The running configuration with the sections `patch` names replaced
/// (each as a whole: `rules` is the new rule list, `dns` the new DNS
/// options, with defaults for what it leaves out); the others stay.
fn merge(running: &EngineConfig, patch: Map<String, Value>) -> Result<EngineConfig, KerntunError> {
    fn section<T: DeserializeOwned>(name: &str, value: Value) -> Result<T, KerntunError> {
        serde_json::from_value(value).map_err(|e| KerntunError::Config {
            field: name.to_string(),
            reason: e.to_string(),
        })
    }
    let mut config = running.clone();
    // No `..`: a field added to EngineConfig fails to compile here until
    // a message can set it too.
    let EngineConfig {
        stack,
        driver,
        tun,
        direct,
        budget,
        timeouts,
        rules,
        workers,
        outbounds,
        groups,
        relay,
        dns,
        sniff,
        log_level,
    } = &mut config;
    for (name, value) in patch {
        match name.as_str() {
            "stack" => *stack = section(&name, value)?,
            "driver" => *driver = section(&name, value)?,
            "tun" => *tun = section(&name, value)?,
            "direct" => *direct = section(&name, value)?,
            "budget" => *budget = section(&name, value)?,
            "timeouts" => *timeouts = section(&name, value)?,
            "rules" => *rules = section(&name, value)?,
            "workers" => *workers = section(&name, value)?,
            "outbounds" => *outbounds = section::<HashMap<_, _>>(&name, value)?,
            "groups" => *groups = section::<HashMap<_, _>>(&name, value)?,
            "relay" => *relay = section(&name, value)?,
            "dns" => *dns = section(&name, value)?,
            "sniff" => *sniff = section(&name, value)?,
            "log_level" => *log_level = section(&name, value)?,
            _ => {
                return Err(KerntunError::Config {
                    field: name,
                    reason: "no such configuration field".into(),
                });
            }
        }
    }
    Ok(config)
}

/// The reply to `request` as bytes: never fails, never panics.
fn reply(engine: Option<&Engine>, request: &[u8]) -> Vec<u8> {
    let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        match parse_request(request) {
            Err((id, e)) => (id, Err(e)),
            Ok(Request { id, cmd, args }) => (id, run(engine, &cmd, args)),
        }
    }))
    .unwrap_or_else(|p| {
        (
            Value::Null,
            Err(MessageError::new("internal", panic_message(p.as_ref()))),
        )
    });
    let body = match answer {
        (id, Ok(ok)) => json!({ "v": MESSAGE_VERSION, "id": id, "ok": ok }),
        (id, Err(e)) => {
            let mut error = json!({ "kind": e.kind, "message": e.message });
            if let Some(field) = e.field {
                error["field"] = Value::String(field);
            }
            json!({ "v": MESSAGE_VERSION, "id": id, "error": error })
        }
    };
    // A `Value` of strings, numbers and objects always serializes.
    serde_json::to_vec(&body).unwrap_or_default()
}

#[uniffi::export]
impl Engine {
    /// Answer one JSON message from the app's other process (the iOS
    /// containing app through `sendProviderMessage`, an Android activity
    /// through the service): `request` is a v1 request, the result its
    /// reply (docs/messages.md). Every reply is a JSON object, also for
    /// malformed input. Commands block as the calls they make do
    /// (`test_latency` up to its timeout, `reload` while it compiles the
    /// configuration): call it off the main thread.
    pub fn handle_message(&self, request: Vec<u8>) -> Vec<u8> {
        reply(Some(self), &request)
    }
}

/// The reply to `request` in a process with no engine (the tunnel is not
/// started, or stopped and released): `status` answers `running: false`,
/// the other commands a `not_running` error; malformed requests get the
/// same errors as [`Engine::handle_message`] gives.
#[uniffi::export]
pub fn handle_message_without_engine(request: Vec<u8>) -> Vec<u8> {
    reply(None, &request)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(engine: Option<&Engine>, request: &str) -> Value {
        let r = reply(engine, request.as_bytes());
        let v: Value = serde_json::from_slice(&r).expect("every reply is JSON");
        assert_eq!(v["v"], json!(1), "{v}");
        v
    }

    fn error_kind(v: &Value) -> &str {
        assert!(v.get("ok").is_none(), "{v}");
        v["error"]["kind"].as_str().expect("error.kind is a string")
    }

    #[test]
    fn envelope_errors_are_replies() {
        let v = ask(None, "{not json");
        assert_eq!(error_kind(&v), "bad_request");
        assert_eq!(v["id"], Value::Null);
        let v = ask(None, "[1,2]");
        assert_eq!(error_kind(&v), "bad_request");
        let v = ask(None, r#"{"id":7,"cmd":"status"}"#);
        assert_eq!(error_kind(&v), "bad_request");
        assert_eq!(v["id"], json!(7));
        assert_eq!(v["error"]["field"], json!("v"));
        let v = ask(None, r#"{"v":1,"id":"a"}"#);
        assert_eq!(error_kind(&v), "bad_request");
        assert_eq!(v["id"], json!("a"));
        let v = ask(None, r#"{"v":1,"id":{"x":1},"cmd":"status"}"#);
        assert_eq!(error_kind(&v), "bad_request");
        let v = ask(None, r#"{"v":1,"cmd":"status","args":[1]}"#);
        assert_eq!(error_kind(&v), "bad_request");
        let v = ask(None, "");
        assert_eq!(error_kind(&v), "bad_request");
        let v = ask(None, "\u{0}\u{1}");
        assert_eq!(error_kind(&v), "bad_request");
    }

    #[test]
    fn other_versions_are_refused_with_the_id() {
        for version in ["2", "0", "\"1\"", "1.5", "null"] {
            let v = ask(
                None,
                &format!(r#"{{"v":{version},"id":"x","cmd":"status"}}"#),
            );
            assert_eq!(error_kind(&v), "unsupported_version", "{version}: {v}");
            assert_eq!(v["id"], json!("x"));
        }
    }

    #[test]
    fn oversized_requests_are_refused_unread() {
        let mut big = String::from(r#"{"v":1,"id":1,"cmd":"status","pad":""#);
        big.push_str(&"x".repeat(MAX_REQUEST_BYTES));
        big.push_str("\"}");
        let v = ask(None, &big);
        assert_eq!(error_kind(&v), "too_large");
    }

    #[test]
    fn unknown_commands_and_args_are_named() {
        let v = ask(None, r#"{"v":1,"id":3,"cmd":"frobnicate"}"#);
        assert_eq!(error_kind(&v), "unknown_command");
        assert_eq!(v["id"], json!(3));
        assert!(
            v["error"]["message"]
                .as_str()
                .expect("present")
                .contains("frobnicate")
        );
        let v = ask(
            None,
            r#"{"v":1,"id":3,"cmd":"status","args":{"verbose":true}}"#,
        );
        assert_eq!(error_kind(&v), "bad_request");
        assert!(
            v["error"]["message"]
                .as_str()
                .expect("a message")
                .contains("verbose"),
            "{v}"
        );
    }

    #[test]
    fn without_an_engine_status_answers_and_the_rest_is_not_running() {
        let v = ask(None, r#"{"v":1,"id":1,"cmd":"status","extra":"ignored"}"#);
        assert_eq!(v["ok"]["running"], json!(false));
        assert_eq!(v["ok"]["version"], json!(kerntun::VERSION));
        assert_eq!(v["ok"]["message_versions"], json!([1]));
        for cmd in COMMANDS.iter().filter(|c| **c != "status") {
            let v = ask(None, &format!(r#"{{"v":1,"id":1,"cmd":"{cmd}"}}"#));
            assert_eq!(error_kind(&v), "not_running", "{cmd}: {v}");
        }
    }

    #[test]
    fn kerntun_errors_keep_their_kind_and_field() {
        let e = MessageError::from(KerntunError::NeedsRestart {
            field: "tun".into(),
        });
        assert_eq!((e.kind, e.field.as_deref()), ("needs_restart", Some("tun")));
        let e = MessageError::from(KerntunError::UnknownGroup { group: "g".into() });
        assert_eq!((e.kind, e.field), ("unknown_group", None));
    }

    #[test]
    fn reload_replaces_only_the_sections_it_names() {
        let mut running = EngineConfig::default();
        running.tun.mtu = 4064;
        running.workers = 2;
        let patch = json!({
            "rules": [
                {"domain_suffix": ["example.com"], "action": "px"},
                {"ports": "53", "network": "udp", "action": "direct"},
                {"action": "reject", "name": "rest"}
            ],
            "outbounds": {
                "px": {"type": "socks5", "server": "127.0.0.1:1080"},
                "ss": {"type": "shadowsocks", "server": "127.0.0.1:8388",
                       "method": "2022-blake3-aes-256-gcm",
                       "password": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=", "udp": "refuse"}
            },
            "groups": {"g": {"kind": "url-test", "members": ["px", "ss"], "url": "http://a.test/",
                             "interval_ms": 1000}},
            "dns": {"enabled": true, "fake_ip": true, "upstreams": ["192.0.2.53"]}
        });
        let Value::Object(patch) = patch else {
            unreachable!()
        };
        let c = merge(&running, patch).expect("merges");
        assert_eq!(c.tun.mtu, 4064, "sections not named stay");
        assert_eq!(c.workers, 2);
        assert_eq!(c.rules.len(), 3);
        assert_eq!(
            c.rules[0].action,
            crate::RuleAction::Outbound { name: "px".into() }
        );
        assert_eq!(c.rules[1].network, Some(crate::config::RuleNetwork::Udp));
        assert_eq!(c.rules[2].action, crate::RuleAction::Reject);
        assert!(matches!(
            c.outbounds["px"],
            crate::Outbound::Socks5 { udp: crate::OutboundUdp::Relay, ref username, .. } if username.is_none()
        ));
        assert!(matches!(
            c.outbounds["ss"],
            crate::Outbound::Shadowsocks {
                method: crate::ShadowsocksMethod::Blake3Aes256Gcm,
                udp: crate::OutboundUdp::Refuse,
                ..
            }
        ));
        assert_eq!(c.groups["g"].kind, crate::GroupType::UrlTest);
        assert_eq!(c.groups["g"].interval_ms, Some(1000));
        assert!(c.dns.enabled && c.dns.fake_ip);
        assert_eq!(
            c.dns.cache_entries,
            crate::config::DnsOptions::default().cache_entries,
            "a named section's missing fields take their defaults"
        );
        assert!(c.to_core().is_ok(), "{:?}", c.to_core());
    }

    #[test]
    fn reload_refuses_unknown_and_mistyped_fields_naming_them() {
        let running = EngineConfig::default();
        for (patch, field) in [
            (json!({"rulez": []}), "rulez"),
            (
                json!({"rules": [{"action": "direct", "port": "80"}]}),
                "rules",
            ),
            (json!({"rules": [{"ports": "80"}]}), "rules"),
            (json!({"dns": {"enabled": "yes"}}), "dns"),
            (
                json!({"outbounds": {"x": {"type": "http", "server": "a:1"}}}),
                "outbounds",
            ),
            (
                json!({"outbounds": {"x": {"type": "socks5", "server": "a:1", "passwd": "p"}}}),
                "outbounds",
            ),
            (
                json!({"groups": {"g": {"kind": "select", "members": [], "defualt": "a"}}}),
                "groups",
            ),
            (json!({"tun": {"mtu": 70000}}), "tun"),
        ] {
            let Value::Object(patch) = patch else {
                unreachable!()
            };
            match merge(&running, patch) {
                Err(KerntunError::Config { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    /// The bound docs/messages.md gives for a full `connections` page.
    #[test]
    fn a_full_connections_page_stays_under_a_mib() {
        use crate::connections::{ConnectionNetwork, ConnectionState, DomainSource};
        let long = |n: usize| "a".repeat(n);
        let record = ConnectionRecord {
            id: u64::MAX,
            network: ConnectionNetwork::Udp,
            source: "[fd00:18:ffff:ffff:ffff:ffff:ffff:fffe]:65535".into(),
            destination: "[2001:db8:ffff:ffff:ffff:ffff:ffff:ffff]:65535".into(),
            domain: Some(long(253)),
            domain_source: DomainSource::FakeIp,
            rule: Some(format!(
                "rules[9999] domain_suffix={} ports=65535",
                long(100)
            )),
            chain: vec![long(32), long(32), long(32)],
            outbound: Some(long(32)),
            bytes_up: u64::MAX,
            bytes_down: u64::MAX,
            started_unix_ms: u64::MAX,
            state: ConnectionState::Relaying,
            uid: Some(u32::MAX),
            // Google Play's longest application id.
            package_name: Some(long(150)),
        };
        let one = serde_json::to_vec(&record).expect("serializes").len();
        let page = one * usize::try_from(MAX_MESSAGE_CONNECTIONS).expect("fits");
        eprintln!("one record: {one} bytes, a full page: {page} bytes");
        assert!(one <= 1100, "{one}");
        assert!(page < 1 << 20, "{page}");
    }

    #[test]
    fn recent_logs_keeps_the_newest() {
        let lines: Vec<LogRecord> = (0..5)
            .map(|i| LogRecord {
                unix_ms: i,
                level: LogLevel::Info,
                message: format!("line {i}"),
            })
            .collect();
        let v = recent_logs(lines.clone(), Some(2));
        let got: Vec<u64> = v["lines"]
            .as_array()
            .expect("lines")
            .iter()
            .map(|l| l["unix_ms"].as_u64().expect("unix_ms"))
            .collect();
        assert_eq!(got, [3, 4]);
        assert_eq!(v["lines"][0]["level"], json!("info"));
        assert_eq!(
            recent_logs(lines.clone(), None)["lines"]
                .as_array()
                .expect("present")
                .len(),
            5
        );
        assert_eq!(
            recent_logs(lines, Some(99))["lines"]
                .as_array()
                .expect("present")
                .len(),
            5
        );
    }
}
