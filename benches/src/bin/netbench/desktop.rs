//! The desktop scenarios ([`SCENARIOS`]): which ones this build runs,
//! their throughput through the one runner, the perf-sampled runs of the
//! splice/copy scenarios, the echo checks, and the engine's memory with
//! idle connections held through it.

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use kerntun_benches::cpu_profile::{self, CpuProfile};
use kerntun_benches::procfs;
use kerntun_benches::record::{Direction, Integrity, Record, Scale, ScenarioInfo, Throughput};
use kerntun_benches::scenario::{Outbound, SCENARIOS, Scenario};
use nix::sys::signal::Signal;
use serde_json::Value;

use super::engine::{self, EngineSpec, Route, Start};
use super::procs::Proc;
use super::runner::{self, Attach, Client, Load, Measured, Plan, Profile, Traffic};
use super::{Ctx, HOLD_PORT, serve};

/// A desktop scenario: the client next to the engine, the harness's MTU,
/// TCP.
struct ScenarioProfile(&'static Scenario);

impl Profile for ScenarioProfile {
    type Record = Throughput;

    fn plan<'s>(&'s self, ctx: &Ctx) -> Plan<'s> {
        let sc = self.0;
        Plan {
            engine: sc.config.map(|_| EngineSpec::of(ctx, sc)),
            client: Client::local(ctx),
            load: Load::Tcp,
            relayed: None,
            via_ss: sc.outbound == Outbound::ShadowsocksNone,
        }
    }

    fn record(&self, m: Measured) -> Throughput {
        let cpu = match &m.traffic {
            Some(Traffic::Tcp(t)) => (t.cpu_host, t.cpu_remote),
            _ => (None, None),
        };
        Throughput {
            scenario: self.0.id.into(),
            run: m.run,
            iperf_cpu_client: cpu.0,
            iperf_cpu_server: cpu.1,
        }
    }
}

/// Which scenarios this build can run (none with `--phone`): each probed,
/// its record made; the runnable ones.
pub(super) fn runnable(ctx: &Ctx, records: &mut Vec<Record>) -> Vec<&'static Scenario> {
    let mut out = Vec::new();
    for sc in SCENARIOS.iter().filter(|_| !ctx.args.phone) {
        if sc.config.is_some()
            && !ctx.args.only.is_empty()
            && !ctx.args.only.iter().any(|o| o == sc.id)
        {
            continue;
        }
        let (available, reason) = engine::probe(ctx, sc);
        eprintln!(
            "scenario {:<18} {}",
            sc.id,
            if available {
                "available".to_string()
            } else {
                format!(
                    "not available in this build: {}",
                    reason.as_deref().unwrap_or("?")
                )
            }
        );
        if available {
            out.push(sc);
        }
        records.push(Record::Scenario(ScenarioInfo {
            id: sc.id.into(),
            label: sc.label.into(),
            stack: sc.stack.into(),
            driver: sc.driver.into(),
            outbound: sc.outbound.as_str().into(),
            splice: sc.splice,
            available,
            reason,
        }));
    }
    out
}

/// Throughput: scenarios interleaved inside each (streams, direction), so
/// a change in background load hits all of them alike.
pub(super) fn throughput(ctx: &mut Ctx, runnable: &[&'static Scenario]) -> Vec<Record> {
    let total = ctx.args.streams.len() * 2 * runnable.len();
    let mut out = Vec::new();
    let mut baseline = std::collections::HashMap::new();
    for streams in ctx.args.streams.clone() {
        for dir in Direction::BOTH {
            for &sc in runnable {
                let t = runner::run(ctx, &ScenarioProfile(sc), streams, dir, Attach::None);
                if sc.id == "baseline"
                    && let Some(g) = t.run.gbit_per_s
                {
                    baseline.insert((streams, dir), g);
                }
                eprintln!(
                    "[{}/{total}] {}",
                    out.len() + 1,
                    describe(&t, baseline.get(&(streams, dir)))
                );
                out.push(Record::Throughput(t));
            }
        }
    }
    out
}

/// One extra run per splice/copy scenario, direction and stream count, with
/// the engine sampled by `perf record -g` and the samples sorted into paths
/// ([`cpu_profile`]).
pub(super) fn cpu_profiles(ctx: &mut Ctx, runnable: &[&'static Scenario]) -> Vec<Record> {
    if !runner::perf_available() {
        eprintln!(
            "kerntun-netbench: perf not found (Debian: apt-get install linux-perf); no profiles"
        );
        return Vec::new();
    }
    let mut out = Vec::new();
    let profiled: Vec<&'static Scenario> = runnable
        .iter()
        .copied()
        .filter(|s| s.splice.is_some())
        .collect();
    for streams in ctx.args.profile_streams.clone() {
        for dir in Direction::BOTH {
            for &sc in &profiled {
                let m = runner::measured(ctx, &ScenarioProfile(sc), streams, dir, Attach::Samples);
                let (samples, buckets) = cpu_profile::tally(m.samples.as_deref().unwrap_or(""));
                let mut error = m.run.error.clone();
                if error.is_none() && samples == 0 {
                    error = Some("no samples".into());
                }
                let x = CpuProfile {
                    scenario: sc.id.into(),
                    streams,
                    direction: dir,
                    samples,
                    cpu_s_per_gb: m.run.cpu_s_per_gb,
                    buckets,
                    error,
                };
                eprintln!(
                    "profile {:<18} {:>2} streams {:<8} {}",
                    sc.id,
                    streams,
                    dir.as_str(),
                    match &x.error {
                        None => format!(
                            "{} samples: relay {:.0} %, TUN {:.0} %, userspace {:.0} %",
                            x.samples,
                            100.0 * x.path_share(cpu_profile::Path::Relay).0,
                            100.0 * x.path_share(cpu_profile::Path::Tun).0,
                            100.0 * x.path_share(cpu_profile::Path::User).0,
                        ),
                        Some(e) => format!("FAILED: {e}"),
                    }
                );
                out.push(Record::Profile(x));
            }
        }
    }
    out
}

/// The echo check through every runnable scenario.
pub(super) fn integrity(ctx: &Ctx, runnable: &[&'static Scenario]) -> Vec<Record> {
    runnable
        .iter()
        .map(|&sc| {
            let bytes = ctx.args.integrity_mib << 20;
            let i = runner::integrity(ctx, &ScenarioProfile(sc), sc.id.into(), bytes);
            report_integrity(&i);
            Record::Integrity(i)
        })
        .collect()
}

/// Print an echo check's outcome.
pub(super) fn report_integrity(i: &Integrity) {
    eprintln!(
        "integrity {:<24} {} MiB: {}",
        i.scenario,
        i.bytes >> 20,
        match &i.error {
            None => format!("ok, {:.2} s", i.secs),
            Some(e) => format!("FAILED: {e}"),
        }
    );
}

/// The idle-connection steps through every scenario that has them.
pub(super) fn scale_all(ctx: &Ctx, runnable: &[&'static Scenario]) -> Vec<Record> {
    let mut out = Vec::new();
    for &sc in runnable.iter().filter(|s| s.scale) {
        for s in scale(ctx, sc) {
            eprintln!(
                "scale {:<18} {:>6} conns: RSS {} KiB (idle {} KiB), {:.0} B/conn, engine sessions {:?}, failed {}{}",
                sc.id,
                s.connections,
                s.rss_kib,
                s.idle_rss_kib,
                s.per_conn_bytes,
                s.engine_sessions,
                s.failed,
                s.error
                    .as_deref()
                    .map(|e| format!(", error: {e}"))
                    .unwrap_or_default()
            );
            out.push(Record::Scale(s));
        }
    }
    out
}

fn describe(t: &Throughput, baseline: Option<&f64>) -> String {
    let r = &t.run;
    let head = format!(
        "{:<18} {:>2} streams {:<8}",
        t.scenario,
        r.streams,
        r.direction.as_str()
    );
    match (r.gbit_per_s, &r.error) {
        (Some(g), None) => {
            let mut s = format!("{head} {g:6.2} Gbit/s");
            if let Some(b) = baseline.filter(|_| t.scenario != "baseline") {
                s.push_str(&format!(" ({:.0} % of baseline)", 100.0 * g / b));
            }
            if let Some(c) = r.cpu_s_per_gb {
                s.push_str(&format!(", {c:.2} CPU s/GB"));
            }
            if let Some(x) = r.hwm_kib {
                s.push_str(&format!(", peak RSS {:.1} MiB", x as f64 / 1024.0));
            }
            if let Some(d) = r.tun_tx_dropped {
                s.push_str(&format!(", {d} TUN TX drops"));
            }
            if let Some(f) = t.spliced_share() {
                s.push_str(&format!(", {:.0} % spliced", 100.0 * f));
            }
            s
        }
        (_, Some(e)) => format!("{head} FAILED: {e}"),
        (None, None) => format!("{head} no result"),
    }
}

/// Open descriptors of a process.
fn count_fds(pid: u32) -> Option<u64> {
    let d = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    Some(d.count() as u64)
}

/// Engine RSS with idle connections held through it, in cumulative steps.
fn scale(ctx: &Ctx, sc: &'static Scenario) -> Vec<Scale> {
    let mut out = Vec::new();
    let fail = |out: &mut Vec<Scale>, n: u32, e: String| {
        out.push(Scale {
            scenario: sc.id.into(),
            connections: n,
            failed: n,
            pinged: !ctx.args.no_ping,
            engine_sessions: None,
            idle_rss_kib: 0,
            rss_kib: 0,
            hwm_kib: 0,
            per_conn_bytes: 0.0,
            idle_anon_kib: 0,
            anon_kib: 0,
            per_conn_anon_bytes: 0.0,
            engine_fds: None,
            idle_fds: None,
            fds_per_conn: None,
            open_secs: 0.0,
            error: Some(e),
        })
    };
    let first = ctx.args.connections.first().copied().unwrap_or(0);
    let spec = EngineSpec {
        stats_interval: 1,
        ..EngineSpec::of(ctx, sc)
    };
    let engine = match engine::start(ctx, &spec, Route::Local) {
        Start::Ready(e) => e,
        Start::Unavailable(why) | Start::Failed(why) => {
            fail(&mut out, first, why);
            return out;
        }
    };
    let listen = SocketAddr::new(ctx.server_ip(), HOLD_PORT).to_string();
    let args = ["hold-server", "--listen", &listen];
    let server = match serve(ctx, "hold-server", &ctx.helper, &args, HOLD_PORT) {
        Ok(s) => s,
        Err(e) => {
            fail(&mut out, first, e);
            return out;
        }
    };
    // Let the idle engine settle (first stats line, allocator warm-up).
    std::thread::sleep(Duration::from_secs(2));
    let idle = procfs::process_mem(engine.pid()).unwrap_or_default();
    let idle_fds = count_fds(engine.pid());
    let steps: Vec<String> = ctx.args.connections.iter().map(u32::to_string).collect();
    let steps = steps.join(",");
    let mut hold_args = vec!["hold-client", "--connect", &listen, "--steps", &steps];
    if ctx.args.no_ping {
        hold_args.push("--no-ping");
    }
    let client = Proc::spawn(
        &ctx.tmp,
        "hold-client",
        ctx.topo.client.name(),
        &ctx.helper,
        &hold_args,
        true,
    );
    let mut client = match client {
        Ok(c) => c,
        Err(e) => {
            fail(&mut out, first, e);
            return out;
        }
    };
    let (Some(lines), Some(mut stdin)) = (client.stdout_lines(), client.take_stdin()) else {
        fail(&mut out, first, "hold client pipes".into());
        return out;
    };
    let planned = ctx.args.connections.clone();
    let mut n = planned.first().copied().unwrap_or(0);
    for i in 0..planned.len() {
        let line = match lines.recv_timeout(Duration::from_secs(300)) {
            Ok(l) => l,
            Err(RecvTimeoutError::Timeout) => {
                fail(&mut out, n, "hold client: no answer within 300 s".into());
                break;
            }
            Err(RecvTimeoutError::Disconnected) => {
                let err = client.stderr_text();
                fail(&mut out, n, format!("hold client exited: {}", err.trim()));
                break;
            }
        };
        let v: Value = serde_json::from_str(&line).unwrap_or_default();
        let holding = v.get("holding").and_then(Value::as_u64).unwrap_or(0);
        // Past the engine's 1 s stats interval, so the last line counts these.
        std::thread::sleep(Duration::from_millis(1500));
        let mem = procfs::process_mem(engine.pid()).unwrap_or_default();
        let sessions = engine
            .last_stats()
            .and_then(|s| s.get("tcp_sessions_active")?.as_u64());
        let fds = count_fds(engine.pid());
        let fds_per_conn = match (fds, idle_fds) {
            (Some(f), Some(i)) if holding > 0 => Some(f.saturating_sub(i) as f64 / holding as f64),
            _ => None,
        };
        let failed = u32::try_from(u64::from(n).saturating_sub(holding)).unwrap_or(n);
        let error = (failed > 0).then(|| {
            format!(
                "{failed} of {n} connections failed; first error: {}",
                v.get("first_error").and_then(Value::as_str).unwrap_or("?")
            )
        });
        out.push(Scale {
            scenario: sc.id.into(),
            connections: n,
            failed,
            pinged: !ctx.args.no_ping,
            engine_sessions: sessions,
            idle_rss_kib: idle.rss_kib,
            rss_kib: mem.rss_kib,
            hwm_kib: mem.hwm_kib,
            per_conn_bytes: (mem.rss_kib.saturating_sub(idle.rss_kib) * 1024) as f64
                / holding.max(1) as f64,
            idle_anon_kib: idle.anon_kib,
            anon_kib: mem.anon_kib,
            per_conn_anon_bytes: (mem.anon_kib.saturating_sub(idle.anon_kib) * 1024) as f64
                / holding.max(1) as f64,
            engine_fds: fds,
            idle_fds,
            fds_per_conn,
            open_secs: v.get("secs").and_then(Value::as_f64).unwrap_or(0.0),
            error,
        });
        if failed > 0 {
            // Refused connections: the engine is at a limit; more steps would
            // only measure the refusals.
            break;
        }
        // The next step, lowered to what the descriptor limit can hold at the
        // descriptors per connection the engine just showed.
        let Some(&want) = planned.get(i + 1) else {
            let _ = writeln!(stdin, "next");
            break;
        };
        n = want;
        if let (Some(per), Some(idle_fds)) = (fds_per_conn, idle_fds)
            && per > 0.0
        {
            let room = ctx.nofile.saturating_sub(idle_fds + 64) as f64 / per;
            let room = room.floor().min(f64::from(u32::MAX)) as u32;
            if want > room {
                eprintln!(
                    "scale {}: {per:.1} descriptors per connection; RLIMIT_NOFILE {} holds {room}, not {want}",
                    sc.id, ctx.nofile
                );
                n = room;
            }
        }
        if u64::from(n) <= holding {
            // No room for more: a repeated step would measure nothing new.
            break;
        }
        if writeln!(stdin, "next {n}").is_err() {
            break;
        }
    }
    drop(stdin);
    let mut client = client;
    let _ = client.stop(Signal::SIGTERM, Duration::from_secs(10));
    drop(server);
    let (_, err) = engine.stop();
    if let (Some(err), Some(last)) = (err, out.last_mut()) {
        last.error.get_or_insert(err);
    }
    out
}
