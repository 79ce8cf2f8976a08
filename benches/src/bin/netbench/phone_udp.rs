//! The phone profiles' UDP runs ([`kerntun_benches::phone_udp`] says what
//! they are): the router topology, each MTU, the no-TUN baseline and each
//! driver interleaved per (streams, direction), `iperf3 -u -b 0 -l 1200`.

use super::phone::{Net, set_mtu};
use super::*;
use kerntun_benches::phone::{PhoneProfile, ProcSample, Topo};
use kerntun_benches::phone_udp::{self as pu, PhoneUdpMeta, PhoneUdpRun};
use kerntun_testkit::router::Router;

/// Below this share of the received bytes relayed by the engine, a run did
/// not go through it: an error, not a number.
const MIN_RELAYED_SHARE: f64 = 0.5;

/// Measure the UDP profiles; the meta record first.
pub(super) fn run(ctx: &mut Ctx) -> Vec<Record> {
    let started = Instant::now();
    let mut meta = PhoneUdpMeta {
        run: machine_meta(&ctx.args),
        topology: Some(Topo::Router),
        mtus: ctx.args.phone_udp_mtus.clone(),
        drivers: ctx.args.phone_udp_drivers.clone(),
        streams: ctx.args.phone_udp_streams.clone(),
        datagram: pu::DATAGRAM,
    };
    meta.run.load_start = procfs::load1();
    meta.run.duration_s = ctx.args.duration;
    let mut out = Vec::new();
    let router = match Router::attach(&ctx.topo) {
        Ok(r) => {
            if let Ok(mut n) = NAMESPACES.lock() {
                n.push(r.app.name().to_owned());
            }
            r
        }
        Err(e) => {
            eprintln!("phone udp: the router topology: {e}; no UDP profiles");
            meta.topology = None;
            return vec![Record::PhoneUdpMeta(meta)];
        }
    };
    for &mtu in &meta.mtus {
        let net = Net::new(ctx, Some(&router), Topo::Router);
        if let Err(e) = set_mtu(ctx, Some(&router), mtu) {
            eprintln!("phone udp: MTU {mtu}: {e}");
            continue;
        }
        let mut group = vec![None];
        group.extend(meta.drivers.iter().map(|d| Some(d.as_str())));
        // `--phone-before`: the earlier engine beside the per-packet driver.
        let before = ctx
            .args
            .phone_before
            .as_ref()
            .map(|p| format!("per-packet@{}", p.display()));
        if let Some(b) = &before
            && meta.drivers.iter().any(|d| d == "per-packet")
        {
            group.push(Some(b.as_str()));
        }
        for &streams in &meta.streams {
            for dir in [Direction::Upload, Direction::Download] {
                let mut baseline = None;
                for &driver in &group {
                    let r = udp_run(ctx, &net, mtu, driver, streams, dir);
                    if driver.is_none() {
                        baseline = r.gbit_per_s;
                    }
                    eprintln!("phone udp {}", describe_udp(&r, baseline));
                    out.push(Record::PhoneUdp(r));
                }
            }
        }
    }
    if let Err(e) = set_mtu(ctx, Some(&router), 1500) {
        eprintln!("phone udp: MTU back to 1500: {e}");
    }
    let name = router.app.name().to_owned();
    drop(router);
    if let Ok(mut n) = NAMESPACES.lock() {
        n.retain(|x| *x != name);
    }
    meta.run.load_end = procfs::load1();
    meta.run.wall_s = started.elapsed().as_secs_f64();
    out.insert(0, Record::PhoneUdpMeta(meta));
    out
}

/// One iperf3 UDP run with a fresh engine (`driver` `None`: the baseline).
fn udp_run(
    ctx: &mut Ctx,
    net: &Net,
    mtu: u16,
    driver: Option<&str>,
    streams: u32,
    dir: Direction,
) -> PhoneUdpRun {
    // `per-packet@path/to/kerntun-before`: another engine binary, for a
    // before/after comparison in one run (recorded as `per-packet@kerntun-before`).
    let (driver, other) = match driver.and_then(|d| d.split_once('@')) {
        Some((d, path)) => (Some(d), Some(PathBuf::from(path))),
        None => (driver, None),
    };
    let label = match (driver, &other) {
        // The `--phone-before` engine goes by its label (a revision).
        (Some(d), Some(p)) if ctx.args.phone_before.as_ref() == Some(p) => {
            Some(format!("{d}@{}", ctx.args.phone_before_label))
        }
        (Some(d), Some(p)) => Some(format!(
            "{d}@{}",
            p.file_name().map_or("?".into(), |n| n.to_string_lossy())
        )),
        (d, _) => d.map(Into::into),
    };
    let mut r = PhoneUdpRun {
        profile: format!(
            "router-{mtu}-{}-udp",
            label.as_deref().unwrap_or("baseline")
        ),
        topology: Topo::Router,
        mtu,
        driver: label,
        streams,
        direction: dir,
        datagram: pu::DATAGRAM,
        gbit_per_s: None,
        bytes: 0,
        sent_bytes: 0,
        secs: 0.0,
        lost_packets: 0,
        packets: 0,
        engine_cpu_s: None,
        cpu_s_per_gb: None,
        hwm_kib: None,
        tun_tx_dropped: None,
        proc_counts: None,
        engine_stats: None,
        load1: procfs::load1(),
        error: None,
    };
    let engine = match driver {
        None => None,
        Some(d) => {
            // The TCP profiles' driver names and scenarios.
            let profile = PhoneProfile {
                topo: Topo::Router,
                mtu,
                driver: kerntun_benches::phone::DRIVERS
                    .iter()
                    .find(|(x, _)| *x == d)
                    .map(|(x, _)| *x),
            };
            let Some(sc) = profile.scenario() else {
                r.error = Some(format!("unknown driver {d:?} (per-packet, batch)"));
                return r;
            };
            let own = match other {
                Some(p) => match std::fs::canonicalize(&p) {
                    Ok(p) => Some(std::mem::replace(&mut ctx.engine, p)),
                    Err(e) => {
                        r.error = Some(format!("{}: {e}", p.display()));
                        return r;
                    }
                },
                None => None,
            };
            let started = start_engine_at(ctx, sc, 0, mtu, net.route);
            if let Some(own) = own {
                ctx.engine = own;
            }
            match started {
                Start::Ready(e) => Some(e),
                Start::Unavailable(why) | Start::Failed(why) => {
                    r.error = Some(why);
                    return r;
                }
            }
        }
    };
    let pid = engine.as_ref().map(Engine::pid);
    let ticks0 = pid.and_then(|p| procfs::process_ticks(p).ok());
    let sample0 = pid.and_then(|p| ProcSample::read(p).ok());
    let tx0 = tun_tx(ctx).map(|(_, d)| d);
    let result = run_iperf_udp(ctx, &net.ns, streams, dir);
    if let Some(pid) = pid {
        if let (Some(a), Ok(b)) = (ticks0, procfs::process_ticks(pid)) {
            r.engine_cpu_s = Some(b.saturating_sub(a) as f64 / procfs::ticks_per_second());
        }
        if let (Some(a), Ok(b)) = (&sample0, ProcSample::read(pid)) {
            r.proc_counts = Some(b.since(a));
        }
        r.hwm_kib = procfs::process_mem(pid).ok().map(|m| m.hwm_kib);
        r.tun_tx_dropped = match (tx0, tun_tx(ctx).map(|(_, d)| d)) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
    }
    match result {
        Ok(x) => {
            r.gbit_per_s = Some(x.bits_per_second / 1e9);
            r.bytes = x.bytes;
            r.sent_bytes = x.sent_bytes;
            r.secs = x.seconds;
            r.lost_packets = x.lost_packets;
            r.packets = x.packets;
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
                "the engine relayed {:.0} % of the bytes iperf3 received: the traffic bypassed it",
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

/// `iperf3 -u -b 0 -l 1200` in namespace `ns`.
fn run_iperf_udp(
    ctx: &Ctx,
    ns: &str,
    streams: u32,
    dir: Direction,
) -> Result<iperf::IperfUdp, String> {
    let server = ctx.server_ip().to_string();
    let (t, p, port, len) = (
        ctx.args.duration.to_string(),
        streams.to_string(),
        IPERF_PORT.to_string(),
        pu::DATAGRAM.to_string(),
    );
    let mut a = vec![
        "-c",
        &server,
        "-p",
        &port,
        "-u",
        "-b",
        "0",
        "-l",
        &len,
        "-t",
        &t,
        "-P",
        &p,
        "-J",
        "--connect-timeout",
        "5000",
    ];
    if dir == Direction::Download {
        a.push("-R");
    }
    let mut proc = Proc::spawn(
        &ctx.tmp,
        "iperf3-udp-client",
        ns,
        Path::new("iperf3"),
        &a,
        false,
    )?;
    let limit = Duration::from_secs(ctx.args.duration + 30);
    match proc.wait_timeout(limit) {
        Some(_) => iperf::parse_udp(&proc.stdout_text()),
        None => {
            let _ = proc.stop(Signal::SIGKILL, Duration::from_secs(2));
            Err(format!("iperf3 did not finish within {limit:?}"))
        }
    }
}

fn describe_udp(r: &PhoneUdpRun, baseline: Option<f64>) -> String {
    let head = format!(
        "{:<28} {:>2} streams {:<8}",
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
            if let Some(l) = r.loss() {
                s.push_str(&format!(", loss {:.0} %", 100.0 * l));
            }
            if let Some(o) = r.offered_gbit_per_s() {
                s.push_str(&format!(", offered {o:.2}"));
            }
            if let Some(c) = r.cpu_s_per_gb {
                s.push_str(&format!(", {c:.2} CPU s/GB"));
            }
            if let Some(w) = r.wakeups_per_gb() {
                s.push_str(&format!(", {:.0}k wake-ups/GB", w / 1e3));
            }
            if let Some((x, y)) = r.packets_per_call() {
                s.push_str(&format!(", {x:.2} packets/read, {y:.2} packets/write"));
            }
            s
        }
        (_, Some(e)) => format!("{head} FAILED: {e}"),
        (None, None) => format!("{head} no result"),
    }
}
