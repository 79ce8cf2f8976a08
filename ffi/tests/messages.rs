//! `Engine.handleMessage` on a real engine, as root in namespaces
//! (testkit): each command's reply, the typed errors of a running and of a
//! stopped engine. The envelope's own errors (version, malformed input,
//! size) are unit tests in ffi/src/messages.rs; the bindings' side is the
//! JVM test (ffi/tests/kotlin/engine_test.kts).

use std::collections::HashMap;
use std::io::Read;
use std::sync::Arc;
use std::time::Instant;

use kerntun_ffi::{
    DirectOptions, Engine, EngineConfig, GroupOptions, GroupType, HookError, LogLevel,
    PlatformHooks, Stack, TunOptions,
};
use kerntun_testkit::servers::Mode;
use kerntun_testkit::{CLIENT_VETH, client, root_topology};
use serde_json::{Value, json};

struct Hooks;

impl PlatformHooks for Hooks {
    fn protect(&self, _fd: i32) -> Result<(), HookError> {
        Ok(())
    }

    fn log(&self, _level: LogLevel, _message: String) -> Result<(), HookError> {
        Ok(())
    }
}

/// Send one request; the reply parsed, its envelope checked.
fn ask(engine: &Engine, id: u64, cmd: &str, args: Value) -> Value {
    let request = json!({ "v": 1, "id": id, "cmd": cmd, "args": args });
    let reply = engine.handle_message(serde_json::to_vec(&request).expect("request"));
    let v: Value = serde_json::from_slice(&reply).expect("the reply is JSON");
    assert_eq!(v["v"], json!(1), "{v}");
    assert_eq!(v["id"], json!(id), "{v}");
    v
}

fn ok(v: Value) -> Value {
    assert!(v.get("error").is_none(), "{v}");
    v["ok"].clone()
}

fn error(v: &Value) -> (&str, Option<&str>) {
    assert!(v.get("ok").is_none(), "{v}");
    (
        v["error"]["kind"].as_str().expect("kind"),
        v["error"]["field"].as_str(),
    )
}

/// A request that must be refused: its id, command and arguments, and the
/// error's kind and field.
type Refusal = (
    u64,
    &'static str,
    Value,
    (&'static str, Option<&'static str>),
);

/// Send each request; each must be refused as its case says (a failure
/// names the case's id and command).
fn refused(engine: &Engine, cases: impl IntoIterator<Item = Refusal>) {
    for (id, cmd, args, want) in cases {
        assert_eq!(error(&ask(engine, id, cmd, args)), want, "{id} {cmd}");
    }
}

#[test]
fn every_command_answers_through_handle_message() {
    let topo = root_topology!();
    let srv = topo.tcp_server(false, Mode::Echo);
    topo.client.enter().expect("enter client namespace");
    let tun = "ktffimsg";
    let config = EngineConfig {
        stack: Some(Stack::System),
        tun: TunOptions {
            name: tun.into(),
            ..Default::default()
        },
        direct: DirectOptions {
            interface: Some(CLIENT_VETH.into()),
            ..Default::default()
        },
        groups: HashMap::from([(
            "g".to_string(),
            GroupOptions {
                kind: GroupType::Select,
                members: vec!["direct".into(), "reject".into()],
                default_member: None,
                url: None,
                interval_ms: None,
                tolerance_ms: None,
                timeout_ms: None,
            },
        )]),
        rules: vec![kerntun_ffi::RuleOptions {
            action: kerntun_ffi::RuleAction::Outbound { name: "g".into() },
            ..Default::default()
        }],
        log_level: Some(LogLevel::Info),
        ..Default::default()
    };
    let engine = Engine::start(config, -1, Arc::new(Hooks)).expect("start");
    topo.route_via_tun(tun).expect("route");

    let status = ok(ask(&engine, 1, "status", json!({})));
    assert_eq!(status["running"], json!(true));
    assert_eq!(status["tun_name"], json!(tun));
    assert_eq!(status["error"], Value::Null);

    // One held connection, echoing.
    let mut held = client::held_echo(srv.addr, b"ping");

    let stats = ok(ask(&engine, 2, "stats", json!({})));
    assert_eq!(stats["stack"], json!("system"));
    assert!(stats["tcp_sessions_active"].as_u64() >= Some(1), "{stats}");
    assert!(stats["dns"]["queries"].is_u64(), "{stats}");
    assert!(stats["drops"].is_array(), "{stats}");

    let listed = ok(ask(&engine, 3, "connections", json!({ "limit": 10 })));
    let conns = listed["connections"].as_array().expect("list");
    let ours = conns
        .iter()
        .find(|c| c["destination"] == json!(srv.addr.to_string()))
        .unwrap_or_else(|| panic!("the held connection is listed: {listed}"));
    assert_eq!(ours["network"], json!("tcp"));
    assert_eq!(ours["outbound"], json!("direct"));
    assert_eq!(ours["chain"], json!(["g"]));
    assert_eq!(ours["state"], json!("relaying"));
    assert!(ours["bytes_up"].as_u64() >= Some(4), "{ours}");
    assert_eq!(listed["truncated"], json!(false));
    let zero = ok(ask(&engine, 4, "connections", json!({ "limit": 0 })));
    assert_eq!(zero["connections"], json!([]));
    assert_eq!(
        zero["truncated"],
        json!(true),
        "a limit below the count truncates"
    );

    let groups = ok(ask(&engine, 5, "groups", json!({})));
    assert_eq!(groups["groups"][0]["name"], json!("g"));
    assert_eq!(groups["groups"][0]["kind"], json!("select"));
    assert_eq!(groups["groups"][0]["selected"], json!("direct"));
    assert_eq!(groups["groups"][0]["members"][1]["name"], json!("reject"));
    assert_eq!(
        groups["groups"][0]["members"][1]["health"],
        json!("unknown")
    );
    refused(
        &engine,
        [
            (
                6,
                "select",
                json!({ "group": "nope", "member": "direct" }),
                ("unknown_group", None),
            ),
            (
                7,
                "select",
                json!({ "group": "g", "member": "nope" }),
                ("unknown_member", None),
            ),
            (
                8,
                "select",
                json!({ "group": "g" }),
                ("bad_request", Some("args")),
            ),
        ],
    );
    assert_eq!(
        ok(ask(
            &engine,
            9,
            "select",
            json!({ "group": "g", "member": "reject" })
        )),
        json!({})
    );
    let groups = ok(ask(&engine, 10, "groups", json!({})));
    assert_eq!(groups["groups"][0]["selected"], json!("reject"));

    // An unknown outbound, a URL the probe cannot speak, a misspelt filter
    // (it closes nothing): each its kind of error; a bad address names the
    // field.
    refused(
        &engine,
        [
            (
                11,
                "test_latency",
                json!({ "outbound": "nope", "url": "http://a.test/" }),
                ("unknown_outbound", None),
            ),
            (
                12,
                "test_latency",
                json!({ "outbound": "direct", "url": "ftp://a" }),
                ("invalid_url", None),
            ),
            (
                13,
                "close_connections",
                json!({ "destination": "1.2.3.4" }),
                ("bad_request", Some("args")),
            ),
            (
                14,
                "close_connections",
                json!({ "destination_ip": "not-an-ip" }),
                ("config", Some("destination_ip")),
            ),
        ],
    );
    let closed = ok(ask(
        &engine,
        15,
        "close_connections",
        json!({ "destination_ip": srv.addr.ip().to_string(), "network": "tcp" }),
    ));
    assert_eq!(closed["closed"], json!(1));
    let after = held.read(&mut [0u8; 4]);
    assert!(
        matches!(after, Ok(0) | Err(_)),
        "the closed connection ends: {after:?}"
    );
    // A connection asked to close stays listed until its session has
    // ended (`close_connection` is true while it is listed): wait for
    // that, then closing it again finds nothing.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while ok(ask(&engine, 16, "connections", json!({})))["connections"]
        .as_array()
        .expect("list")
        .iter()
        .any(|c| c["id"] == ours["id"])
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the closed connection is still listed after 5 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let v = ok(ask(
        &engine,
        16,
        "close_connection",
        json!({ "id": ours["id"] }),
    ));
    assert_eq!(v["closed"], json!(false), "already closed");

    assert_eq!(
        ok(ask(
            &engine,
            17,
            "set_log_level",
            json!({ "level": "debug" })
        )),
        json!({})
    );
    refused(
        &engine,
        [(
            18,
            "set_log_level",
            json!({ "level": "loud" }),
            ("bad_request", Some("args")),
        )],
    );
    let logs = ok(ask(&engine, 19, "recent_logs", json!({ "limit": 3 })));
    let lines = logs["lines"].as_array().expect("lines");
    assert!(!lines.is_empty() && lines.len() <= 3, "{logs}");
    assert!(
        lines[0]["message"].is_string() && lines[0]["unix_ms"].is_u64(),
        "{logs}"
    );

    // reload: the named sections replace the running ones, the others
    // (here tun, which only a restart may change) stay as started.
    let report = ok(ask(
        &engine,
        20,
        "reload",
        json!({ "config": { "rules": [{ "ports": "9", "action": "reject" }, { "action": "direct" }],
                            "groups": {} } }),
    ));
    assert!(
        report["closed"].is_u64() && report["fake_ip_kept"].is_boolean(),
        "{report}"
    );
    assert_eq!(
        ok(ask(&engine, 21, "groups", json!({})))["groups"],
        json!([])
    );
    refused(
        &engine,
        [
            (
                22,
                "reload",
                json!({ "config": { "tun": { "name": "other0" } } }),
                ("needs_restart", Some("tun.name")),
            ),
            (
                23,
                "reload",
                json!({ "config": { "rules": [{ "action": "nowhere" }] } }),
                ("config", Some("rules[0].action")),
            ),
            (
                24,
                "reload",
                json!({ "config": { "rulez": [] } }),
                ("config", Some("rulez")),
            ),
            (25, "reload", json!({}), ("bad_request", Some("args"))),
        ],
    );
    // The reloaded rules still connect.
    drop(client::held_echo(srv.addr, b"pong"));

    // Stopped: what the calls still answer, and not_running for the rest.
    let t = Instant::now();
    engine.stop();
    eprintln!("stop took {:?}", t.elapsed());
    let status = ok(ask(&engine, 30, "status", json!({})));
    assert_eq!(status["running"], json!(false));
    assert_eq!(status["tun_name"], Value::Null);
    let stats = ok(ask(&engine, 31, "stats", json!({})));
    assert!(stats["tcp_sessions_total"].as_u64() >= Some(2), "{stats}");
    assert_eq!(
        ok(ask(&engine, 32, "connections", json!({})))["connections"],
        json!([])
    );
    refused(
        &engine,
        [
            (
                33,
                "select",
                json!({ "group": "g", "member": "direct" }),
                ("not_running", None),
            ),
            (
                34,
                "reload",
                json!({ "config": { "rules": [] } }),
                ("not_running", None),
            ),
        ],
    );
    assert!(
        !ok(ask(&engine, 35, "recent_logs", json!({})))["lines"]
            .as_array()
            .expect("lines")
            .is_empty()
    );
}
