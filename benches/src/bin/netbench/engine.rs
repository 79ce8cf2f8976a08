//! The engine under measurement: `kerntun run` as its own process in the
//! client namespace (`ip netns exec` execs it, so its pid is the engine's),
//! a fresh one per run, started the one way every profile shares.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kerntun_benches::scenario::{self, Scenario};
use kerntun_testkit::CLIENT_VETH;
use kerntun_testkit::router::Router;
use kerntun_testkit::uid_route::UidRoute;
use nix::sys::signal::Signal;
use serde_json::Value;

use super::procs::{Proc, next_seq, wait_for};
use super::{Ctx, SS_PORT, TUN, TUN_IPV4};

/// How the client's traffic reaches the TUN.
#[derive(Debug, Clone, Copy)]
pub(super) enum Route<'a> {
    /// The client runs in the engine's namespace: a route to the server.
    Local,
    /// The client runs in the router's app namespace: a route in the
    /// table its policy rule looks up.
    Router(&'a Router),
    /// The client runs in the engine's namespace as the rule's uid: a
    /// route in the table the rule looks up.
    Uid(&'a UidRoute),
}

/// What one engine run is.
#[derive(Debug, Clone)]
pub(super) struct EngineSpec {
    pub(super) scenario: &'static Scenario,
    /// MTU of the TUN.
    pub(super) mtu: u16,
    /// `tun.tx_queue_len` where the profile sets it (else the engine's default).
    pub(super) tx_queue_len: Option<u32>,
    /// `workers` where the profile sets it (else the engine's default).
    pub(super) workers: Option<usize>,
    /// The binary: the engine under test, or the earlier one of a
    /// before/after comparison.
    pub(super) binary: PathBuf,
    /// `--stats-interval` (0: only the final line).
    pub(super) stats_interval: u64,
}

impl EngineSpec {
    /// The engine under test with the harness's TUN MTU.
    pub(super) fn of(ctx: &Ctx, scenario: &'static Scenario) -> EngineSpec {
        EngineSpec {
            scenario,
            mtu: ctx.args.mtu,
            tx_queue_len: None,
            workers: None,
            binary: ctx.engine.clone(),
            stats_interval: 0,
        }
    }

    /// The engine's TOML config: the scenario's, and the runtime threads
    /// and the TUN's transmit queue where the profile sets them.
    fn config(&self, ss_server: &str) -> Option<String> {
        let mut cfg = self.scenario.config?.replace("{ss_server}", ss_server);
        if let Some(w) = self.workers {
            // A top-level key: before the scenario's first table.
            cfg = format!("workers = {w}\n{cfg}");
        }
        if let Some(q) = self.tx_queue_len {
            cfg.push_str(&format!("\n[tun]\ntx_queue_len = {q}\n"));
        }
        Some(cfg)
    }
}

pub(super) struct Engine {
    proc: Proc,
}

pub(super) enum Start {
    Ready(Engine),
    /// The build refuses this scenario (the engine's words).
    Unavailable(String),
    Failed(String),
}

/// Start the engine of `spec` and, once its TUN is up, route the client's
/// traffic into it (`route`).
pub(super) fn start(ctx: &Ctx, spec: &EngineSpec, route: Route) -> Start {
    let sc = spec.scenario;
    let ss = SocketAddr::new(ctx.server_ip(), SS_PORT).to_string();
    let Some(cfg) = spec.config(&ss) else {
        return Start::Failed("the baseline has no engine".into());
    };
    let path = ctx.tmp.join(format!("{:03}-{}.toml", next_seq(), sc.id));
    if let Err(e) = std::fs::write(&path, cfg) {
        return Start::Failed(format!("{}: {e}", path.display()));
    }
    let path_s = path.to_string_lossy().into_owned();
    let mtu = spec.mtu.to_string();
    let interval = spec.stats_interval.to_string();
    let mut proc = match Proc::spawn(
        &ctx.tmp,
        &format!("engine-{}", sc.id),
        ctx.topo.client.name(),
        &spec.binary,
        &[
            "run",
            "--config",
            &path_s,
            "--tun-name",
            TUN,
            "--ipv4",
            TUN_IPV4,
            "--mtu",
            &mtu,
            "--driver",
            sc.driver,
            "--interface",
            CLIENT_VETH,
            "--stats-interval",
            &interval,
        ],
        false,
    ) {
        Ok(p) => p,
        Err(e) => return Start::Failed(e),
    };
    let mut exited = None;
    let ready = wait_for(Duration::from_secs(10), || {
        if let Some(s) = proc.exited() {
            exited = Some(s);
            return true;
        }
        proc.stderr_text().contains("kerntun started on")
    });
    if let Some(status) = exited.or_else(|| proc.exited()) {
        let err = proc.stderr_text();
        return if let Some(why) = scenario::unavailable_reason(&err) {
            Start::Unavailable(why)
        } else {
            let words = err
                .lines()
                .filter(|l| !l.trim().is_empty())
                .collect::<Vec<_>>()
                .join(" / ");
            Start::Failed(format!("engine exited at start ({status}): {words}"))
        };
    }
    if !ready {
        return Start::Failed("engine not ready within 10 s".into());
    }
    // `ip netns exec` execs the program (no fork), so the pid is the engine's;
    // check it rather than measure the wrong process.
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", proc.pid())).unwrap_or_default();
    let want: String = spec
        .binary
        .file_name()
        .map(|n| n.to_string_lossy().chars().take(15).collect())
        .unwrap_or_default();
    if comm.trim() != want {
        return Start::Failed(format!(
            "pid {} is {:?}, not the engine {want:?}",
            proc.pid(),
            comm.trim()
        ));
    }
    let routed = match route {
        Route::Local => {
            let dst = format!("{}/32", ctx.server_ip());
            ctx.topo.client.ip(&["route", "add", &dst, "dev", TUN])
        }
        Route::Router(r) => r.route_via_tun(&ctx.topo, TUN),
        Route::Uid(u) => u.route_via_tun(TUN),
    };
    if let Err(e) = routed {
        return Start::Failed(format!("route via the TUN: {e}"));
    }
    Start::Ready(Engine { proc })
}

impl Engine {
    pub(super) fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// The last statistics line the engine printed.
    pub(super) fn last_stats(&self) -> Option<Value> {
        let text = self.proc.stdout_text();
        let line = text.lines().rev().find(|l| l.starts_with('{'))?;
        serde_json::from_str(line).ok()
    }

    /// SIGINT (the engine stops, prints its final statistics and exits).
    pub(super) fn stop(mut self) -> (Option<Value>, Option<String>) {
        let r = self.proc.stop(Signal::SIGINT, Duration::from_secs(10));
        let stats = self.last_stats();
        let err = match r {
            Ok(s) if s.success() => None,
            Ok(s) => Some(format!(
                "engine exited with {s}: {}",
                self.proc.stderr_text().lines().last().unwrap_or("")
            )),
            Err(e) => Some(e),
        };
        (stats, err)
    }
}

/// Whether the engine can run a scenario: start it and stop it.
pub(super) fn probe(ctx: &Ctx, sc: &'static Scenario) -> (bool, Option<String>) {
    if sc.config.is_none() {
        return (true, None);
    }
    match start(ctx, &EngineSpec::of(ctx, sc), Route::Local) {
        Start::Ready(e) => match e.stop() {
            (_, None) => (true, None),
            (_, Some(err)) => (false, Some(format!("engine failed to stop: {err}"))),
        },
        Start::Unavailable(why) => (false, Some(why)),
        Start::Failed(why) => (false, Some(format!("engine failed to start: {why}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kerntun::config::Config;
    use kerntun_benches::phone::{ANDROID_TXQUEUELEN, ANDROID_WORKERS, DRIVERS};
    use kerntun_benches::scenario::SCENARIOS;

    fn spec(id: &str, tx_queue_len: Option<u32>) -> EngineSpec {
        EngineSpec {
            scenario: SCENARIOS.iter().find(|s| s.id == id).expect("scenario"),
            mtu: 1500,
            tx_queue_len,
            workers: tx_queue_len.map(|_| ANDROID_WORKERS),
            binary: PathBuf::from("kerntun"),
            stats_interval: 0,
        }
    }

    /// What the harness writes is a config the engine takes, with the
    /// TUN's transmit queue where the profile sets one (the android
    /// topology's) and the engine's default elsewhere.
    #[test]
    fn configs_set_the_tun_queue_only_where_asked() {
        let (_, per_packet) = DRIVERS[0];
        let cfg = spec(per_packet, Some(ANDROID_TXQUEUELEN))
            .config("198.19.1.2:8388")
            .expect("an engine scenario");
        let parsed: Config = toml::from_str(&cfg).expect("the engine's config");
        assert_eq!(parsed.tun.tx_queue_len, 500, "{cfg}");
        assert_eq!(parsed.workers, ANDROID_WORKERS, "{cfg}");
        let default: Config = toml::from_str(
            &spec(per_packet, None)
                .config("198.19.1.2:8388")
                .expect("an engine scenario"),
        )
        .expect("the engine's config");
        assert_eq!(default.tun.tx_queue_len, Config::default().tun.tx_queue_len);
        assert_eq!(default.workers, Config::default().workers);
        // After the Shadowsocks scenario's tables, still its outbound and rule.
        let ss = spec("ss-none-splice", Some(500))
            .config("198.19.1.2:8388")
            .expect("an engine scenario");
        let parsed: Config = toml::from_str(&ss).expect("the engine's config");
        assert_eq!(parsed.tun.tx_queue_len, 500);
        assert_eq!(parsed.workers, ANDROID_WORKERS);
        assert!(parsed.outbounds.contains_key("ss"), "{ss}");
        assert_eq!(parsed.rules.len(), 1, "{ss}");
        assert!(spec("baseline", Some(500)).config("x").is_none());
    }
}
