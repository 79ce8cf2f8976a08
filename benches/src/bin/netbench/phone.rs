//! The phone profiles' runs ([`kerntun_benches::phone`] says what they
//! are). The router topology's app namespace is attached to the harness's
//! topology for this part only; every veth and the TUN take the profile's
//! MTU, and the veths go back to 1500 afterwards.

use super::*;
use kerntun_benches::phone::{
    self as ph, PhoneMeta, PhoneProfile, PhoneRun, ProcSample, Topo, perf_events,
};
use kerntun_testkit::router::Router;

/// Below this share of iperf3's bytes relayed by the engine, a run did
/// not go through it (a route missing or gone): an error, not a number.
const MIN_RELAYED_SHARE: f64 = 0.5;

/// Measure every phone profile; the records in the order of
/// [`ph::profiles`], the meta record first.
pub(super) fn run(ctx: &mut Ctx) -> Vec<Record> {
    let started = Instant::now();
    let mut meta = PhoneMeta {
        run: machine_meta(&ctx.args),
        topologies: ctx.args.phone_topologies.clone(),
        mtus: ctx.args.phone_mtus.clone(),
        syscall_streams: ctx
            .args
            .phone_syscall_streams
            .iter()
            .copied()
            .filter(|&s| s > 0)
            .collect(),
        syscalls_error: None,
    };
    meta.run.load_start = procfs::load1();
    meta.run.duration_s = ctx.args.duration;
    meta.run.integrity_bytes = ctx.args.integrity_mib << 20;
    let mut out = Vec::new();
    let router = if meta.topologies.contains(&Topo::Router) {
        match Router::attach(&ctx.topo) {
            Ok(r) => {
                if let Ok(mut n) = NAMESPACES.lock() {
                    n.push(r.app.name().to_owned());
                }
                Some(r)
            }
            Err(e) => {
                eprintln!("phone: the router topology: {e}; measuring the others");
                meta.topologies.retain(|&t| t != Topo::Router);
                None
            }
        }
    } else {
        None
    };
    if meta.syscall_streams.is_empty() {
        meta.syscalls_error = Some("not asked for (`--phone-syscall-streams 0`)".into());
    } else if let Err(e) = perf_stat_works() {
        eprintln!("phone: system calls not counted: {e}");
        meta.syscalls_error = Some(e);
    }
    let profiles = ph::only_drivers(
        ph::profiles(&meta.topologies, &meta.mtus),
        &ctx.args.phone_drivers,
    );
    let mut baseline = std::collections::HashMap::new();
    for &topo in &meta.topologies {
        for &mtu in &meta.mtus {
            let group: Vec<&PhoneProfile> = profiles
                .iter()
                .filter(|p| p.topo == topo && p.mtu == mtu)
                .collect();
            let net = Net::new(ctx, router.as_ref(), topo);
            if let Err(e) = set_mtu(ctx, router.as_ref(), mtu) {
                eprintln!("phone: MTU {mtu}: {e}");
                continue;
            }
            for &streams in &ctx.args.streams.clone() {
                for dir in [Direction::Upload, Direction::Download] {
                    for p in &group {
                        let r = phone_run(ctx, &net, p, streams, dir, false);
                        if p.driver.is_none()
                            && let Some(g) = r.gbit_per_s
                        {
                            baseline.insert((topo, mtu, streams, dir), g);
                        }
                        eprintln!(
                            "phone {}",
                            describe_phone(&r, baseline.get(&(topo, mtu, streams, dir)))
                        );
                        out.push(Record::Phone(r));
                        if let Some(r) = before_run(ctx, &net, p, streams, dir) {
                            eprintln!(
                                "phone {} {}",
                                ctx.args.phone_before_label,
                                describe_phone(&r, baseline.get(&(topo, mtu, streams, dir)))
                            );
                            out.push(Record::Phone(r));
                        }
                    }
                }
            }
            if meta.syscalls_error.is_none() {
                for &streams in &meta.syscall_streams {
                    for dir in [Direction::Upload, Direction::Download] {
                        for p in group.iter().filter(|p| p.driver.is_some()) {
                            let r = phone_run(ctx, &net, p, streams, dir, true);
                            eprintln!("phone counted {}", describe_phone(&r, None));
                            out.push(Record::Phone(r));
                        }
                    }
                }
            }
            for p in group.iter().filter(|p| p.driver.is_some()) {
                let i = phone_integrity(ctx, &net, p);
                eprintln!(
                    "phone integrity {:<24} {} MiB: {}",
                    i.scenario,
                    i.bytes >> 20,
                    match &i.error {
                        None => format!("ok, {:.2} s", i.secs),
                        Some(e) => format!("FAILED: {e}"),
                    }
                );
                out.push(Record::PhoneIntegrity(i));
            }
        }
    }
    if let Err(e) = set_mtu(ctx, router.as_ref(), 1500) {
        eprintln!("phone: MTU back to 1500: {e}");
    }
    if let Some(r) = router {
        let name = r.app.name().to_owned();
        drop(r);
        if let Ok(mut n) = NAMESPACES.lock() {
            n.retain(|x| *x != name);
        }
    }
    meta.run.load_end = procfs::load1();
    meta.run.wall_s = started.elapsed().as_secs_f64();
    out.insert(0, Record::PhoneMeta(meta));
    out
}

/// Where a profile's client runs and how its traffic enters the TUN.
#[derive(Debug, Clone)]
pub(super) struct Net<'a> {
    /// The client's namespace.
    pub(super) ns: String,
    pub(super) route: RouteIn<'a>,
}

impl<'a> Net<'a> {
    pub(super) fn new(ctx: &Ctx, router: Option<&'a Router>, topo: Topo) -> Net<'a> {
        match (topo, router) {
            (Topo::Router, Some(r)) => Net {
                ns: r.app.name().to_owned(),
                route: RouteIn::Router(r),
            },
            // `run` drops the router topology when it cannot be built.
            _ => Net {
                ns: ctx.topo.client.name().to_owned(),
                route: RouteIn::Local,
            },
        }
    }
}

pub(super) fn set_mtu(ctx: &Ctx, router: Option<&Router>, mtu: u16) -> std::io::Result<()> {
    match router {
        Some(r) => r.set_mtu(&ctx.topo, mtu),
        None => {
            let m = mtu.to_string();
            ctx.topo
                .client
                .ip(&["link", "set", CLIENT_VETH, "mtu", &m])?;
            ctx.topo.server.ip(&["link", "set", "kts", "mtu", &m])
        }
    }
}

/// Whether `perf stat` can count the tracepoints this part uses, with a
/// descriptor filter (a kernel without tracefs, or perf without
/// permission, refuses).
fn perf_stat_works() -> Result<(), String> {
    if !perf_available() {
        return Err("perf not found (Debian: apt-get install linux-perf)".into());
    }
    let out = Command::new("perf")
        .args(["stat", "-x,"])
        .args(perf_events(&[0]))
        .args(["--", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .map_err(|e| format!("perf stat: {e}"))?;
    let text = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!(
            "perf stat refused the system-call tracepoints: {}",
            text.lines().last().unwrap_or("").trim()
        ));
    }
    ph::parse_perf_stat(&text).map(|_| ())
}

/// The engine's descriptors on the TUN device.
fn tun_fds(pid: u32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == Path::new("/dev/net/tun")))
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// The same run with the `--phone-before` engine, for the per-packet
/// profiles (the phone path): right after the current engine's, so both
/// meet the same load.
fn before_run(
    ctx: &mut Ctx,
    net: &Net,
    p: &PhoneProfile,
    streams: u32,
    dir: Direction,
) -> Option<PhoneRun> {
    let before = ctx.args.phone_before.clone()?;
    let before = std::fs::canonicalize(&before).unwrap_or(before);
    if p.driver.is_none_or(|d| d == "batch") {
        return None;
    }
    let current = std::mem::replace(&mut ctx.engine, before);
    let mut r = phone_run(ctx, net, p, streams, dir, false);
    ctx.engine = current;
    r.engine = Some(ctx.args.phone_before_label.clone());
    Some(r)
}

/// One iperf3 run of a profile with a fresh engine; `counted`: with
/// `perf stat` counting the engine's system calls.
fn phone_run(
    ctx: &mut Ctx,
    net: &Net,
    p: &PhoneProfile,
    streams: u32,
    dir: Direction,
    counted: bool,
) -> PhoneRun {
    let mut r = PhoneRun {
        profile: p.id(),
        topology: p.topo,
        mtu: p.mtu,
        driver: p.driver.map(Into::into),
        streams,
        direction: dir,
        counted,
        gbit_per_s: None,
        bytes: 0,
        secs: 0.0,
        retransmits: None,
        engine_cpu_s: None,
        cpu_s_per_gb: None,
        hwm_kib: None,
        tun_tx_dropped: None,
        proc_counts: None,
        syscalls: None,
        engine_stats: None,
        load1: procfs::load1(),
        error: None,
        engine: None,
    };
    let engine = match p.scenario() {
        None => None,
        Some(sc) => match start_engine_at(ctx, sc, 0, p.mtu, net.route) {
            Start::Ready(e) => Some(e),
            Start::Unavailable(why) | Start::Failed(why) => {
                r.error = Some(why);
                return r;
            }
        },
    };
    let mut perf = None;
    if let (true, Some(e)) = (counted, &engine) {
        match start_perf_stat(ctx, e.pid()) {
            Ok(x) => perf = Some(x),
            Err(why) => r.error = Some(why),
        }
    }
    let pid = engine.as_ref().map(Engine::pid);
    let ticks0 = pid.and_then(|p| procfs::process_ticks(p).ok());
    let sample0 = pid.and_then(|p| ProcSample::read(p).ok());
    let result = run_iperf_in(ctx, &net.ns, streams, dir);
    if let Some(pid) = pid {
        let ticks1 = procfs::process_ticks(pid).ok();
        if let (Some(a), Some(b)) = (ticks0, ticks1) {
            r.engine_cpu_s = Some(b.saturating_sub(a) as f64 / procfs::ticks_per_second());
        }
        if let (Some(a), Ok(b)) = (&sample0, ProcSample::read(pid)) {
            r.proc_counts = Some(b.since(a));
        }
        r.hwm_kib = procfs::process_mem(pid).ok().map(|m| m.hwm_kib);
        r.tun_tx_dropped = tun_tx(ctx).map(|(_, d)| d);
    }
    if let Some((mut proc, file)) = perf {
        let _ = proc.stop(Signal::SIGINT, Duration::from_secs(5));
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        match ph::parse_perf_stat(&text) {
            Ok(s) => r.syscalls = Some(s),
            Err(e) => {
                r.error
                    .get_or_insert(format!("{e} ({})", proc.stderr_text().trim()));
            }
        }
        let _ = std::fs::remove_file(&file);
    }
    match result {
        Ok(x) => {
            r.gbit_per_s = Some(x.bits_per_second / 1e9);
            r.bytes = x.bytes;
            r.secs = x.seconds;
            r.retransmits = x.retransmits;
            r.cpu_s_per_gb = r.engine_cpu_s.map(|c| c / (x.bytes as f64 / 1e9));
        }
        Err(e) => {
            r.error.get_or_insert(e);
            if let Err(e) = start_iperf_server(ctx) {
                eprintln!("restarting the iperf3 server: {e}");
            }
        }
    }
    if let Some(e) = engine {
        let (stats, err) = e.stop();
        r.engine_stats = stats;
        if let Some(err) = err {
            r.error.get_or_insert(err);
        }
        if let Some(share) = r.relayed_share()
            && share < MIN_RELAYED_SHARE
        {
            r.error.get_or_insert(format!(
                "the engine relayed {:.0} % of the bytes iperf3 moved: the traffic bypassed it",
                100.0 * share
            ));
        }
    }
    if r.error.is_some() {
        r.gbit_per_s = None;
        r.cpu_s_per_gb = None;
    }
    r
}

/// `perf stat` attached to the engine, counting into a file.
fn start_perf_stat(ctx: &Ctx, pid: u32) -> Result<(Proc, PathBuf), String> {
    let fds = tun_fds(pid);
    if fds.is_empty() {
        return Err(format!("no /dev/net/tun descriptor in /proc/{pid}/fd"));
    }
    let file = ctx
        .tmp
        .join(format!("{:03}-perf-stat-{pid}.csv", next_seq()));
    let file_s = file.to_string_lossy().into_owned();
    let pid_s = pid.to_string();
    let mut args: Vec<String> = ["stat", "-x,", "-o", file_s.as_str(), "-p", pid_s.as_str()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(perf_events(&fds));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut proc = Proc::spawn(
        &ctx.tmp,
        "perf-stat",
        ctx.topo.client.name(),
        Path::new("perf"),
        &args,
        false,
    )?;
    // perf opens its counters on every thread of the engine before it
    // counts; a run that starts earlier loses its first packets' calls.
    std::thread::sleep(Duration::from_millis(300));
    if let Some(s) = proc.exited() {
        return Err(format!(
            "perf stat exited at start ({s}): {}",
            proc.stderr_text().trim()
        ));
    }
    Ok((proc, file))
}

/// The echo check through a profile's engine, from its client.
fn phone_integrity(ctx: &Ctx, net: &Net, p: &PhoneProfile) -> Integrity {
    let len = ctx.args.integrity_mib << 20;
    let mut i = Integrity {
        scenario: p.id(),
        bytes: len,
        ok: false,
        secs: 0.0,
        error: None,
    };
    let Some(sc) = p.scenario() else {
        i.error = Some("the baseline has no engine".into());
        return i;
    };
    let engine = match start_engine_at(ctx, sc, 0, p.mtu, net.route) {
        Start::Ready(e) => e,
        Start::Unavailable(why) | Start::Failed(why) => {
            i.error = Some(why);
            return i;
        }
    };
    let addr = ctx.echo.addr;
    let work = move || client::echo_transfer(addr, 0x7068, len as usize, false);
    let spawned = match net.route {
        RouteIn::Router(r) => r.app.spawn(work),
        RouteIn::Local => ctx.topo.client.spawn(work),
    };
    let result = spawned
        .map_err(|e| format!("client thread: {e}"))
        .and_then(|h| h.join().map_err(|_| "client thread panicked".to_string()))
        .and_then(|r| r.map_err(|e| format!("echo transfer: {e}")));
    match result {
        Ok(t) => {
            i.ok = true;
            i.secs = t.elapsed.as_secs_f64();
        }
        Err(e) => i.error = Some(e),
    }
    let (stats, err) = engine.stop();
    if let Some(err) = err {
        i.ok = false;
        i.error.get_or_insert(err);
    }
    // The echo moved `len` bytes each way; fewer through the engine means
    // the check did not test it.
    let relayed = stats.as_ref().map(|s| {
        let n = |k: &str| s.get(k).and_then(Value::as_u64).unwrap_or(0);
        n("tcp_bytes_up") + n("tcp_bytes_down")
    });
    if i.ok && relayed.is_some_and(|b| (b as f64) < MIN_RELAYED_SHARE * 2.0 * len as f64) {
        i.ok = false;
        i.error = Some(format!(
            "the engine relayed {} bytes of the {} the echo moved: the traffic bypassed it",
            relayed.unwrap_or(0),
            2 * len
        ));
    }
    i
}

fn describe_phone(r: &PhoneRun, baseline: Option<&f64>) -> String {
    let head = format!(
        "{:<24} {:>2} streams {:<8}",
        r.profile,
        r.streams,
        r.direction.as_str()
    );
    match (r.gbit_per_s, &r.error) {
        (Some(g), None) => {
            let mut s = format!("{head} {g:6.2} Gbit/s");
            if let Some(b) = baseline.filter(|_| r.driver.is_some()) {
                s.push_str(&format!(" ({:.0} % of baseline)", 100.0 * g / b));
            }
            if let Some(c) = r.cpu_s_per_gb {
                s.push_str(&format!(", {c:.2} CPU s/GB"));
            }
            if let Some(w) = r.wakeups_per_gb() {
                s.push_str(&format!(", {:.0}k wake-ups/GB", w / 1e3));
            }
            if let (Some(x), Some(y)) = (r.packets_per_read(), r.packets_per_write()) {
                s.push_str(&format!(", {x:.2} packets/read, {y:.2} packets/write"));
            }
            s
        }
        (_, Some(e)) => format!("{head} FAILED: {e}"),
        (None, None) => format!("{head} no result"),
    }
}
