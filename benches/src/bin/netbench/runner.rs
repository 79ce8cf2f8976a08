//! The one runner every profile goes through (desktop scenarios, phone
//! profiles over TCP and UDP): a fresh engine (none for a baseline), the
//! same samples of the engine, the TUN and the namespace before and after
//! one iperf3 run, the same checks that the traffic went where it should,
//! into the shared [`Run`]. A [`Profile`] supplies only what differs: what
//! to start, where the client runs, what it sends, and its record.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kerntun_benches::iperf::{self, IperfRun, IperfUdp};
use kerntun_benches::procfs::{self, LinkCounts, Mem, ProcSample, SystemCpu};
use kerntun_benches::record::{Direction, Integrity, Run};
use kerntun_benches::syscalls::{self, Syscalls};
use nix::sys::signal::Signal;
use serde_json::Value;

use super::engine::{self, Engine, EngineSpec, Route, Start};
use super::procs::{Proc, next_seq, spawn_registered, unregister_pid};
use super::{Ctx, ECHO_PORT, IPERF_PORT, TUN, restart_iperf_server, ss_connections};

/// Where the client runs.
#[derive(Debug, Clone)]
pub(super) struct Client<'a> {
    pub(super) ns: String,
    /// The uid it runs as (`None`: root, as the harness).
    pub(super) uid: Option<u32>,
    pub(super) route: Route<'a>,
}

impl Client<'_> {
    /// Next to the engine, routed through the main table (the desktop
    /// scenarios).
    pub(super) fn local(ctx: &Ctx) -> Client<'static> {
        Client {
            ns: ctx.topo.client.name().to_owned(),
            uid: None,
            route: Route::Local,
        }
    }
}

/// What the client sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Load {
    /// `iperf3` over TCP.
    Tcp,
    /// `iperf3 -u -b 0 -l <datagram>`: UDP datagrams at full rate.
    Udp { datagram: u32 },
}

/// What one run of a profile is.
pub(super) struct Plan<'a> {
    /// `None`: the no-TUN baseline.
    pub(super) engine: Option<EngineSpec>,
    pub(super) client: Client<'a>,
    pub(super) load: Load,
    /// The engine's relay counters that must have carried at least
    /// [`MIN_RELAYED_SHARE`] of what the receiver got; below it a run did
    /// not go through the engine (a route missing or gone): an error, not
    /// a number. `None`: not checked.
    pub(super) relayed: Option<&'static [&'static str]>,
    /// The traffic goes through the harness's Shadowsocks server, which
    /// must have seen it.
    pub(super) via_ss: bool,
}

/// The engine's relay counters of each load.
pub(super) const TCP_RELAYED: &[&str] = &["tcp_bytes_up", "tcp_bytes_down"];
pub(super) const UDP_RELAYED: &[&str] = &["udp_bytes_up", "udp_bytes_down"];

/// Below this share of the receiver's bytes relayed by the engine, a run
/// did not go through it.
const MIN_RELAYED_SHARE: f64 = 0.5;

/// A kind of run: what it starts and where, and the record it makes.
pub(super) trait Profile {
    type Record;

    /// How to run it.
    fn plan<'s>(&'s self, ctx: &Ctx) -> Plan<'s>;

    /// Its record, from what the runner measured.
    fn record(&self, m: Measured) -> Self::Record;
}

/// What iperf3 reported.
#[derive(Debug, Clone)]
pub(super) enum Traffic {
    Tcp(IperfRun),
    Udp(IperfUdp),
}

/// `perf` attached to the engine for the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Attach {
    None,
    /// `perf stat` counting its system calls by kind.
    Syscalls,
    /// `perf record -g` sampling where its CPU goes.
    Samples,
}

/// What the runner measured: the shared figures, iperf3's own, and what
/// perf gathered when attached.
#[derive(Debug)]
pub(super) struct Measured {
    pub(super) run: Run,
    pub(super) traffic: Option<Traffic>,
    pub(super) syscalls: Option<Syscalls>,
    /// `perf script` output of a sampled run.
    pub(super) samples: Option<String>,
}

/// Run `p` once (a fresh engine) and make its record.
pub(super) fn run<P: Profile>(
    ctx: &mut Ctx,
    p: &P,
    streams: u32,
    dir: Direction,
    attach: Attach,
) -> P::Record {
    p.record(measured(ctx, p, streams, dir, attach))
}

/// Run `p` once and hand back what was measured, before it becomes a
/// record.
pub(super) fn measured<P: Profile>(
    ctx: &mut Ctx,
    p: &P,
    streams: u32,
    dir: Direction,
    attach: Attach,
) -> Measured {
    let plan = p.plan(ctx);
    measure(ctx, &plan, streams, dir, attach)
}

/// One iperf3 run of a plan, with a fresh engine.
fn measure(ctx: &mut Ctx, plan: &Plan, streams: u32, dir: Direction, attach: Attach) -> Measured {
    let mut m = Measured {
        run: Run {
            load1: procfs::load1(),
            ..Run::new(streams, dir)
        },
        traffic: None,
        syscalls: None,
        samples: None,
    };
    let engine = match start(ctx, plan) {
        Ok(e) => e,
        Err(why) => {
            m.run.error = Some(why);
            return m;
        }
    };
    let mut perf = None;
    if let (Attach::Syscalls | Attach::Samples, Some(e)) = (attach, &engine) {
        match Perf::attach(ctx, attach, e.pid()) {
            Ok(x) => perf = Some(x),
            Err(why) => m.run.error = Some(why),
        }
    }
    let ss_before = plan.via_ss.then(|| ss_connections(ctx));
    let before = Sample::take(ctx, engine.as_ref());
    let traffic = iperf(ctx, &plan.client, plan.load, streams, dir);
    let after = Sample::take(ctx, engine.as_ref());
    after.since(&before, &mut m.run);
    if let Some(perf) = perf {
        match perf.finish() {
            Ok(Gathered::Syscalls(s)) => m.syscalls = Some(s),
            Ok(Gathered::Samples(s)) => m.samples = Some(s),
            Err(e) => {
                m.run.error.get_or_insert(e);
            }
        }
    }
    match traffic {
        Ok(t) => {
            let (bps, bytes, secs) = match &t {
                Traffic::Tcp(x) => (x.bits_per_second, x.bytes, x.seconds),
                Traffic::Udp(x) => (x.bits_per_second, x.bytes, x.seconds),
            };
            let r = &mut m.run;
            r.gbit_per_s = Some(bps / 1e9);
            r.bytes = bytes;
            r.secs = secs;
            if let Traffic::Tcp(x) = &t {
                r.retransmits = x.retransmits;
            }
            r.cpu_s_per_gb = r.engine_cpu_s.map(|c| c / (bytes as f64 / 1e9));
            m.traffic = Some(t);
        }
        Err(e) => {
            m.run.error.get_or_insert(e);
            // A failed client can leave the server stuck in its test.
            if let Err(e) = restart_iperf_server(ctx) {
                eprintln!("restarting the iperf3 server: {e}");
            }
        }
    }
    if ss_before.is_some_and(|n| ss_connections(ctx) == n) {
        m.run.error.get_or_insert(
            "no connection reached the Shadowsocks server: not a Shadowsocks run".into(),
        );
    }
    if let Some(e) = engine {
        let (stats, err) = e.stop();
        m.run.engine_stats = stats;
        if let Some(err) = err {
            m.run.error.get_or_insert(err);
        }
        if let Some(keys) = plan.relayed
            && let Some(share) = m.run.relayed_share(keys)
            && share < MIN_RELAYED_SHARE
        {
            m.run.error.get_or_insert(format!(
                "the engine relayed {:.0} % of the bytes iperf3 moved: the traffic bypassed it",
                100.0 * share
            ));
        }
    }
    if m.run.error.is_some() {
        m.run.gbit_per_s = None;
        m.run.cpu_s_per_gb = None;
    }
    m
}

/// The plan's engine (`None` for a baseline), its client's traffic routed
/// into it; why not, when it did not start.
fn start(ctx: &Ctx, plan: &Plan) -> Result<Option<Engine>, String> {
    let Some(spec) = &plan.engine else {
        return Ok(None);
    };
    match engine::start(ctx, spec, plan.client.route) {
        Start::Ready(e) => Ok(Some(e)),
        Start::Unavailable(why) | Start::Failed(why) => Err(why),
    }
}

/// What the runner reads before and after a run.
#[derive(Debug, Default)]
struct Sample {
    /// The engine's CPU ticks and `/proc` counters.
    ticks: Option<u64>,
    proc: Option<ProcSample>,
    /// The TUN's counters (no TUN without an engine).
    tun: Option<LinkCounts>,
    /// `TcpRetransSegs` of the engine's namespace.
    retrans: Option<u64>,
    system: Option<SystemCpu>,
    /// The engine's memory (what it is now, and its peak so far).
    mem: Option<Mem>,
}

impl Sample {
    fn take(ctx: &Ctx, engine: Option<&Engine>) -> Sample {
        let pid = engine.map(Engine::pid);
        let ns = ctx.topo.client.name();
        Sample {
            ticks: pid.and_then(|p| procfs::process_ticks(p).ok()),
            proc: pid.and_then(|p| ProcSample::read(p).ok()),
            tun: engine.and_then(|_| link_counts(ns, TUN)),
            retrans: snmp(ns, "Tcp", "RetransSegs"),
            system: SystemCpu::read().ok(),
            mem: pid.and_then(|p| procfs::process_mem(p).ok()),
        }
    }

    /// Fill `run` with what happened between `earlier` and `self`.
    fn since(&self, earlier: &Sample, run: &mut Run) {
        if let (Some(a), Some(b)) = (earlier.ticks, self.ticks) {
            run.engine_cpu_s = Some(b.saturating_sub(a) as f64 / procfs::ticks_per_second());
        }
        if let (Some(a), Some(b)) = (&earlier.proc, &self.proc) {
            run.proc_counts = Some(b.since(a));
        }
        if let (Some(a), Some(b)) = (&earlier.tun, &self.tun) {
            let d = b.since(a);
            run.tun_tx_dropped = Some(d.tx_dropped);
            run.tun_tx_packets = Some(d.tx_packets);
            run.tun_rx_packets = Some(d.rx_packets);
            run.tun_txqueuelen = d.txqlen;
        }
        if let (Some(a), Some(b)) = (earlier.retrans, self.retrans) {
            run.tcp_retrans_segs = Some(b.saturating_sub(a));
        }
        if let (Some(a), Some(b)) = (&earlier.system, &self.system) {
            run.system_busy = Some(b.busy_since(a));
        }
        if let Some(m) = self.mem {
            run.rss_kib = Some(m.rss_kib);
            run.hwm_kib = Some(m.hwm_kib);
        }
    }
}

/// A device's counters in namespace `ns`.
fn link_counts(ns: &str, dev: &str) -> Option<LinkCounts> {
    let out = Command::new("ip")
        .args(["-n", ns, "-s", "-j", "link", "show", "dev", dev])
        .output()
        .ok()?;
    procfs::parse_link(&String::from_utf8_lossy(&out.stdout))
}

/// A counter of namespace `ns`'s `/proc/net/snmp`.
fn snmp(ns: &str, proto: &str, name: &str) -> Option<u64> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "cat", "/proc/net/snmp"])
        .output()
        .ok()?;
    procfs::parse_snmp(&String::from_utf8_lossy(&out.stdout), proto, name)
}

/// An iperf3 client run of `load` from `client`.
fn iperf(
    ctx: &Ctx,
    client: &Client,
    load: Load,
    streams: u32,
    dir: Direction,
) -> Result<Traffic, String> {
    let server = ctx.server_ip().to_string();
    let (t, p, port) = (
        ctx.args.duration.to_string(),
        streams.to_string(),
        IPERF_PORT.to_string(),
    );
    let mut a = vec!["-c", &server, "-p", &port, "-t", &t, "-P", &p];
    let len;
    if let Load::Udp { datagram } = load {
        len = datagram.to_string();
        a.extend(["-u", "-b", "0", "-l", &len]);
    }
    a.extend(["-J", "--connect-timeout", "5000"]);
    if dir == Direction::Download {
        a.push("-R");
    }
    let mut proc = Proc::spawn_as(
        &ctx.tmp,
        "iperf3-client",
        &client.ns,
        client.uid,
        Path::new("iperf3"),
        &a,
    )?;
    let limit = Duration::from_secs(ctx.args.duration + 30);
    if proc.wait_timeout(limit).is_none() {
        let _ = proc.stop(Signal::SIGKILL, Duration::from_secs(2));
        return Err(format!("iperf3 did not finish within {limit:?}"));
    }
    let out = proc.stdout_text();
    match load {
        Load::Tcp => iperf::parse(&out).map(Traffic::Tcp),
        Load::Udp { .. } => iperf::parse_udp(&out).map(Traffic::Udp),
    }
}

/// A byte-for-byte checked echo transfer of `bytes` through a profile's
/// engine (none for a baseline), from its client (`kerntun-bench-helper
/// echo`, as the client's uid).
pub(super) fn integrity<P: Profile>(ctx: &Ctx, p: &P, id: String, bytes: u64) -> Integrity {
    let plan = p.plan(ctx);
    let mut i = Integrity {
        scenario: id,
        bytes,
        ok: false,
        secs: 0.0,
        error: None,
    };
    let engine = match start(ctx, &plan) {
        Ok(e) => e,
        Err(why) => {
            i.error = Some(why);
            return i;
        }
    };
    let ss_before = plan.via_ss.then(|| ss_connections(ctx));
    match echo(ctx, &plan.client, bytes) {
        Ok(secs) => {
            i.ok = true;
            i.secs = secs;
        }
        Err(e) => i.error = Some(e),
    }
    if ss_before.is_some_and(|n| ss_connections(ctx) == n) {
        i.ok = false;
        i.error
            .get_or_insert("no connection reached the Shadowsocks server".into());
    }
    let Some(engine) = engine else {
        return i;
    };
    let (stats, err) = engine.stop();
    if let Some(err) = err {
        i.ok = false;
        i.error.get_or_insert(err);
    }
    let relayed = |k: &str| {
        stats
            .as_ref()
            .and_then(|s| s.get(k))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    let (up, down) = (relayed("tcp_bytes_up"), relayed("tcp_bytes_down"));
    // The echo moved `bytes` each way; fewer through the engine means the
    // check did not test it.
    if i.ok
        && plan.relayed.is_some()
        && ((up + down) as f64) < MIN_RELAYED_SHARE * 2.0 * bytes as f64
    {
        i.ok = false;
        i.error = Some(format!(
            "the engine relayed {} bytes of the {} the echo moved: the traffic bypassed it",
            up + down,
            2 * bytes
        ));
    } else if let Some(msg) = i.error.as_mut() {
        // Where a failed transfer stopped, in the engine's own counts.
        msg.push_str(&format!(
            "; the engine had relayed {:.1} MiB up and {:.1} MiB down",
            up as f64 / 1048576.0,
            down as f64 / 1048576.0
        ));
    }
    i
}

/// `kerntun-bench-helper echo` from `client`: the seconds it took.
fn echo(ctx: &Ctx, client: &Client, bytes: u64) -> Result<f64, String> {
    let to = std::net::SocketAddr::new(ctx.server_ip(), ECHO_PORT).to_string();
    let n = bytes.to_string();
    let helper = ctx.helper.to_string_lossy().into_owned();
    let mut proc = Proc::spawn_as(
        &ctx.tmp,
        "echo",
        &client.ns,
        client.uid,
        Path::new(&helper),
        &["echo", "--connect", &to, "--bytes", &n],
    )?;
    // Generous: the checker itself gives up after 20 s without a byte.
    let limit = Duration::from_secs(600);
    let Some(status) = proc.wait_timeout(limit) else {
        let _ = proc.stop(Signal::SIGKILL, Duration::from_secs(2));
        return Err(format!("echo transfer did not finish within {limit:?}"));
    };
    if !status.success() {
        return Err(proc.stderr_text().trim().to_owned());
    }
    let v: Value = serde_json::from_str(proc.stdout_text().trim())
        .map_err(|e| format!("echo helper output: {e}"))?;
    v.get("secs")
        .and_then(Value::as_f64)
        .ok_or_else(|| "echo helper output: no secs".into())
}

/// `perf` attached to the engine, writing into a file.
struct Perf {
    kind: Attach,
    child: std::process::Child,
    file: PathBuf,
    /// Its stderr.
    err: PathBuf,
    /// How long a sampling run may last before perf is killed.
    deadline: Instant,
}

enum Gathered {
    Syscalls(Syscalls),
    Samples(String),
}

impl Perf {
    fn attach(ctx: &Ctx, kind: Attach, pid: u32) -> Result<Perf, String> {
        let pid_s = pid.to_string();
        let mut cmd = Command::new("perf");
        let file = match kind {
            Attach::Syscalls => {
                let fds = tun_fds(pid);
                if fds.is_empty() {
                    return Err(format!("no /dev/net/tun descriptor in /proc/{pid}/fd"));
                }
                let file = ctx
                    .tmp
                    .join(format!("{:03}-perf-stat-{pid}.csv", next_seq()));
                cmd.args(["stat", "-x,", "-o"])
                    .arg(&file)
                    .args(["-p", &pid_s])
                    .args(syscalls::perf_events(&fds));
                file
            }
            Attach::Samples | Attach::None => {
                let file = ctx.tmp.join(format!("{:03}-perf-{pid}.data", next_seq()));
                let secs = (ctx.args.duration + 1).to_string();
                cmd.args(["record", "-q", "-F", "999", "-g", "-p", &pid_s, "-o"])
                    .arg(&file)
                    .args(["--", "sleep", &secs]);
                file
            }
        };
        let err = file.with_extension("err");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&err).map_err(|e| format!("{}: {e}", err.display()))?);
        let mut child = spawn_registered(&mut cmd).map_err(|e| format!("perf: {e}"))?;
        // perf opens its counters on every thread of the engine before it
        // counts; a run that starts earlier loses its first packets' calls.
        std::thread::sleep(Duration::from_millis(300));
        if let Ok(Some(s)) = child.try_wait() {
            unregister_pid(child.id());
            let words = std::fs::read_to_string(&err).unwrap_or_default();
            return Err(format!("perf exited at start ({s}): {}", words.trim()));
        }
        Ok(Perf {
            kind,
            child,
            file,
            err,
            deadline: Instant::now() + Duration::from_secs(ctx.args.duration + 20),
        })
    }

    /// Stop counting (`perf stat` on SIGINT) or wait for the sampling to
    /// end (`perf record` stops by itself after its `sleep`), and read
    /// what it gathered.
    fn finish(mut self) -> Result<Gathered, String> {
        if self.kind == Attach::Syscalls
            && let Ok(p) = i32::try_from(self.child.id())
        {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), Signal::SIGINT);
            self.deadline = Instant::now() + Duration::from_secs(5);
        }
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if Instant::now() < self.deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break None;
                }
            }
        };
        unregister_pid(self.child.id());
        let words = std::fs::read_to_string(&self.err).unwrap_or_default();
        let result = match self.kind {
            Attach::Syscalls => {
                let text = std::fs::read_to_string(&self.file).unwrap_or_default();
                syscalls::parse_perf_stat(&text)
                    .map(Gathered::Syscalls)
                    .map_err(|e| format!("{e} ({})", words.trim()))
            }
            Attach::Samples | Attach::None if !status.is_some_and(|s| s.success()) => {
                Err(format!("perf record ended with {status:?}"))
            }
            Attach::Samples | Attach::None => script(&self.file).map(Gathered::Samples),
        };
        let _ = std::fs::remove_file(&self.file);
        result
    }
}

/// `perf script` of a `perf record` file, as `cpu_profile::tally` reads it.
fn script(file: &Path) -> Result<String, String> {
    let out = Command::new("perf")
        .args(["script", "-F", "tid,period,ip,sym", "-i"])
        .arg(file)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map_err(|e| format!("perf script: {e}"))?;
    if !out.status.success() {
        return Err(format!("perf script: {}", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
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

/// Whether `perf` runs at all.
pub(super) fn perf_available() -> bool {
    Command::new("perf")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether `perf stat` can count the tracepoints [`Attach::Syscalls`] uses,
/// with a descriptor filter (a kernel without tracefs, or perf without
/// permission, refuses).
pub(super) fn perf_stat_works() -> Result<(), String> {
    if !perf_available() {
        return Err("perf not found (Debian: apt-get install linux-perf)".into());
    }
    let out = Command::new("perf")
        .args(["stat", "-x,"])
        .args(syscalls::perf_events(&[0]))
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
    syscalls::parse_perf_stat(&text).map(|_| ())
}
