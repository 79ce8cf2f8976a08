//! `kerntun-netbench`: the netns benchmark harness behind
//! `scripts/bench.sh` (run as root). One run measures, side by side:
//!
//! * iperf3 throughput at each stream count, upload and download, through a
//!   no-TUN baseline (the ceiling) and every engine scenario of
//!   [`kerntun_benches::scenario::SCENARIOS`] this build can run, with a
//!   fresh engine process per run: engine CPU seconds per GB (from
//!   `/proc/<pid>/stat` before and after), its current and peak RSS, and the
//!   TUN's TX drops;
//! * a byte-for-byte checked echo transfer through every scenario;
//! * engine RSS with 1k/4k/10k idle TCP connections held through it;
//! * the criterion benches of the packet core and the NAT table;
//! * the phone profiles (`--phone` alone; [`kerntun_benches::phone`]): a
//!   client routed through a forwarding namespace or local to the TUN, MTU
//!   1500 and 9000, per-packet and batch drivers, each against the no-TUN
//!   baseline of its topology, with the engine's system calls and wake-ups;
//!   and their UDP part ([`kerntun_benches::phone_udp`], `--phone-udp-only`
//!   alone): 1200-byte datagrams at full rate, both directions.
//!
//! It writes `docs/benchmarks/results.jsonl`, renders `docs/benchmarks.md`
//! from those records and draws the chart with `benches/plot.py`.
//!
//! The engine runs as its own process (`ip netns exec <client ns> kerntun
//! run ...`) so its CPU and memory are measured alone. Every process the
//! harness starts is registered and killed, and the namespaces deleted, on
//! any exit: normal, error, panic, Ctrl-C or SIGTERM.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, ExitStatus, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime};

use clap::Parser;
use kerntun_benches::procfs::{self, Mem, SystemCpu};
use kerntun_benches::profile::{self, Profile};
use kerntun_benches::record::{
    Direction, Integrity, Meta, Record, Scale, ScenarioInfo, Throughput, to_lines,
};
use kerntun_benches::scenario::{self, Outbound, SCENARIOS, Scenario};
use kerntun_benches::{crit, iperf, record, report};
use kerntun_testkit::servers::{self, Mode};
use kerntun_testkit::{CLIENT_VETH, Topology, client};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

#[path = "netbench/phone.rs"]
mod phone;
#[path = "netbench/phone_udp.rs"]
mod phone_udp;

#[derive(Parser, Debug)]
#[command(
    name = "kerntun-netbench",
    about = "netns benchmark harness for kerntun (root); see scripts/bench.sh"
)]
struct Args {
    /// The engine binary (`cargo build --release -p kerntun-cli`).
    #[arg(long, default_value = "target/release/kerntun")]
    engine: PathBuf,
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 5)]
    duration: u64,
    /// iperf3 parallel streams.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    streams: Vec<u32>,
    /// Idle connections held through the engine (cumulative steps).
    #[arg(long, value_delimiter = ',', default_value = "1000,4000,10000")]
    connections: Vec<u32>,
    /// MiB echoed (and checked byte for byte) through each scenario.
    #[arg(long, default_value_t = 256)]
    integrity_mib: u64,
    /// TUN MTU.
    #[arg(long, default_value_t = 65535)]
    mtu: u16,
    /// Only these scenario ids (the baseline always runs).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Do not run the criterion benches (the page then says so).
    #[arg(long)]
    skip_criterion: bool,
    /// Do not run the connection-scale test.
    #[arg(long)]
    skip_scale: bool,
    /// Do not profile the splice/copy scenarios with `perf record` (the
    /// page then says so). Without `perf` on PATH they are skipped too.
    #[arg(long)]
    skip_profile: bool,
    /// iperf3 streams of the profiled runs (one extra run per splice/copy
    /// scenario, direction and stream count).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    profile_streams: Vec<u32>,
    /// Idle connections carry no byte at all (by default each is checked
    /// with a one-byte ping through the engine and its answer).
    #[arg(long)]
    no_ping: bool,
    /// Where criterion writes its results (default: $CARGO_TARGET_DIR/criterion or target/criterion).
    #[arg(long)]
    criterion_dir: Option<PathBuf>,
    #[arg(long, default_value = "docs/benchmarks.md")]
    page: PathBuf,
    #[arg(long, default_value = "docs/benchmarks")]
    data_dir: PathBuf,
    /// The chart renderer (python3 + matplotlib).
    #[arg(long, default_value = "benches/plot.py")]
    plot_script: PathBuf,
    #[arg(long, default_value = "python3")]
    python: String,
    /// The command line recorded in the page (scripts/bench.sh passes itself).
    #[arg(long)]
    command: Option<String>,
    /// Re-render the page and the chart from the existing results.jsonl.
    #[arg(long)]
    render_only: bool,
    /// Run the phone profiles only: the other records of results.jsonl are
    /// kept, the phone records replaced and the page re-rendered.
    #[arg(long)]
    phone: bool,
    /// Leave the phone profiles out of a full run.
    #[arg(long, conflicts_with = "phone")]
    skip_phone: bool,
    /// MTUs of the phone profiles (the TUN and every veth).
    #[arg(long, value_delimiter = ',', default_value = "1500,9000")]
    phone_mtus: Vec<u16>,
    /// Topologies of the phone profiles: router (the client in a namespace
    /// of its own, forwarded into the TUN), local (the client next to the
    /// engine).
    #[arg(long, value_delimiter = ',', default_value = "router,local")]
    phone_topologies: Vec<kerntun_benches::phone::Topo>,
    /// iperf3 streams of the phone profiles' extra runs with the engine's
    /// system calls counted by `perf stat` (0: none).
    #[arg(long, value_delimiter = ',', default_value = "16")]
    phone_syscall_streams: Vec<u32>,
    /// Only the phone profiles of these drivers (per-packet, batch,
    /// smoltcp-per-packet; the baselines always run). With `--phone
    /// --phone-topologies router --phone-mtus 1500 --phone-drivers
    /// smoltcp-per-packet` it measures the smoltcp stack alone.
    #[arg(long, value_delimiter = ',')]
    phone_drivers: Vec<String>,
    /// A second engine binary (an earlier revision) run right after each
    /// per-packet profile's run with the same streams and direction, so
    /// the page shows before and after from one run
    /// (`scripts/bench.sh --phone-before-rev REV` builds and passes it).
    #[arg(long)]
    phone_before: Option<PathBuf>,
    /// What the page calls the `--phone-before` engine (a git revision).
    #[arg(long, default_value = "before")]
    phone_before_label: String,
    /// Run only the phone profiles' UDP part (QUIC-shaped: 1200-byte
    /// datagrams at full rate, router topology): every other record of
    /// results.jsonl is kept, its UDP records replaced, the page re-rendered.
    #[arg(long, conflicts_with_all = ["phone", "skip_phone"])]
    phone_udp_only: bool,
    /// Leave the UDP part out of the phone profiles.
    #[arg(long, conflicts_with = "phone_udp_only")]
    skip_phone_udp: bool,
    /// MTUs of the UDP profiles.
    #[arg(long, value_delimiter = ',', default_value = "1500")]
    phone_udp_mtus: Vec<u16>,
    /// Drivers of the UDP profiles (per-packet, batch); the baseline always runs.
    #[arg(long, value_delimiter = ',', default_value = "per-packet,batch")]
    phone_udp_drivers: Vec<String>,
    /// iperf3 streams of the UDP profiles.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    phone_udp_streams: Vec<u32>,
}

/// Gateway of the engine's TUN; the NAT address is the next one.
const TUN_IPV4: &str = "198.18.0.1/16";
const TUN: &str = "kt0";
const IPERF_PORT: u16 = 5201;
const ECHO_PORT: u16 = 7000;
const HOLD_PORT: u16 = 7100;
const SS_PORT: u16 = 8388;
/// Descriptors for us and our children: at 10k held connections the engine
/// has two sockets per session and each holder one per connection.
const NOFILE: u64 = 65_536;

// ---------------------------------------------------------------------------
// Cleanup: every child pid and namespace is registered; `cleanup_all` runs
// from the Ctrl-C/SIGTERM handler and from a guard dropped on any exit.

static PIDS: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static NAMESPACES: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Set by the signal handler before it kills: no child is started after it.
static STOPPING: AtomicBool = AtomicBool::new(false);

/// Start a child and register its pid under the registry's lock, so the
/// signal handler (which sets [`STOPPING`] and then takes the lock) either
/// sees the pid or prevents the start: no child outlives the harness.
fn spawn_registered(cmd: &mut Command) -> std::io::Result<Child> {
    let mut pids = PIDS
        .lock()
        .map_err(|_| std::io::Error::other("pid registry poisoned"))?;
    if STOPPING.load(Ordering::SeqCst) {
        return Err(std::io::Error::other("stopping"));
    }
    let child = cmd.spawn()?;
    pids.push(child.id());
    Ok(child)
}

fn unregister_pid(pid: u32) {
    if let Ok(mut p) = PIDS.lock() {
        p.retain(|&x| x != pid);
    }
}

fn cleanup_all() {
    STOPPING.store(true, Ordering::SeqCst);
    let pids = PIDS.lock().map(|mut p| std::mem::take(&mut *p));
    for pid in pids.unwrap_or_default() {
        if let Ok(p) = i32::try_from(pid) {
            let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
        }
    }
    let names = NAMESPACES.lock().map(|mut n| std::mem::take(&mut *n));
    for ns in names.unwrap_or_default() {
        let _ = kerntun_testkit::sh("ip", &["netns", "del", &ns]);
    }
}

struct CleanupGuard;

impl Drop for CleanupGuard {
    fn drop(&mut self) {
        cleanup_all();
    }
}

// ---------------------------------------------------------------------------
// Child processes.

/// A child process in a namespace, killed and reaped on drop.
struct Proc {
    child: Child,
    name: String,
    out: Option<PathBuf>,
    err: PathBuf,
}

impl Proc {
    /// `ip netns exec <ns> <program> <args>`; stdout to a file unless
    /// `stdout` is given, stderr always to a file.
    fn spawn(
        tmp: &Path,
        name: &str,
        ns: &str,
        program: &Path,
        args: &[&str],
        piped: bool,
    ) -> Result<Proc, String> {
        let n = next_seq();
        let err = tmp.join(format!("{n:03}-{name}.err"));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns])
            .arg(program)
            .args(args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stderr(File::create(&err).map_err(|e| format!("{}: {e}", err.display()))?);
        let out = if piped {
            cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
            None
        } else {
            let out = tmp.join(format!("{n:03}-{name}.out"));
            cmd.stdin(Stdio::null())
                .stdout(File::create(&out).map_err(|e| format!("{}: {e}", out.display()))?);
            Some(out)
        };
        let child = spawn_registered(&mut cmd)
            .map_err(|e| format!("starting {}: {e}", program.display()))?;
        Ok(Proc {
            child,
            name: name.to_owned(),
            out,
            err,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    fn wait_timeout(&mut self, limit: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + limit;
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, sig: Signal) {
        if let Ok(p) = i32::try_from(self.pid()) {
            let _ = kill(Pid::from_raw(p), sig);
        }
    }

    /// Send `sig`, wait up to `grace`, then SIGKILL. Returns the exit status,
    /// or an error naming the process when it had to be killed.
    fn stop(&mut self, sig: Signal, grace: Duration) -> Result<ExitStatus, String> {
        if let Some(s) = self.exited() {
            return Ok(s);
        }
        self.signal(sig);
        if let Some(s) = self.wait_timeout(grace) {
            return Ok(s);
        }
        self.signal(Signal::SIGKILL);
        let _ = self.child.wait();
        Err(format!(
            "{} did not stop within {grace:?} of {sig}; killed",
            self.name
        ))
    }

    fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    fn stdout_text(&self) -> String {
        self.out
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// Lines of a piped stdout, delivered through a channel by a thread (so
    /// reads can time out).
    fn stdout_lines(&mut self) -> Option<Receiver<String>> {
        let out = self.child.stdout.take()?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Some(rx)
    }

    fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.child.stdin.take()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.signal(Signal::SIGKILL);
            let _ = self.child.wait();
        }
        unregister_pid(self.child.id());
    }
}

fn next_seq() -> u32 {
    use std::sync::atomic::AtomicU32;
    static SEQ: AtomicU32 = AtomicU32::new(0);
    SEQ.fetch_add(1, Ordering::Relaxed)
}

// ---------------------------------------------------------------------------
// The run.

struct Ctx {
    args: Args,
    topo: Topology,
    tmp: PathBuf,
    helper: PathBuf,
    engine: PathBuf,
    iperf_server: Option<Proc>,
    ss_server: Option<Proc>,
    echo: servers::Server,
    /// RLIMIT_NOFILE of the harness and its children.
    nofile: u64,
}

impl Ctx {
    fn server_ip(&self) -> IpAddr {
        self.topo.server(false)
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.render_only {
        return match render(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kerntun-netbench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if let Err(missing) = prerequisites(&args) {
        eprintln!("kerntun-netbench: missing prerequisites:\n{missing}");
        return ExitCode::from(2);
    }
    if let Err(e) = ctrlc::set_handler(|| {
        eprintln!("\nkerntun-netbench: interrupted; stopping processes and removing namespaces");
        cleanup_all();
        std::process::exit(130);
    }) {
        eprintln!("kerntun-netbench: signal handler: {e}");
        return ExitCode::FAILURE;
    }
    let _guard = CleanupGuard;
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kerntun-netbench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn prerequisites(args: &Args) -> Result<(), String> {
    let mut missing = Vec::new();
    let mut apt = Vec::new();
    if !nix::unistd::geteuid().is_root() {
        missing.push("root (namespaces, veth and a TUN device): run as root".to_string());
    }
    if !Path::new("/dev/net/tun").exists() {
        missing.push("/dev/net/tun (modprobe tun, or mknod /dev/net/tun c 10 200)".into());
    }
    let works = |cmd: &str, a: &[&str]| {
        Command::new(cmd)
            .args(a)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !works("ip", &["-V"]) {
        missing.push("ip (iproute2)".into());
        apt.push("iproute2");
    }
    if !works("iperf3", &["--version"]) {
        missing.push("iperf3".into());
        apt.push("iperf3");
    }
    if !works(&args.python, &["-c", "import matplotlib"]) {
        missing.push(format!("{} with matplotlib (the chart)", args.python));
        apt.push("python3-matplotlib");
    }
    if !args.engine.is_file() {
        missing.push(format!(
            "{} (cargo build --release -p kerntun-cli)",
            args.engine.display()
        ));
    }
    if !helper_path().is_some_and(|p| p.is_file()) {
        missing.push("kerntun-bench-helper next to this binary (cargo build --release -p kerntun-benches --bins)".into());
    }
    if !args.plot_script.is_file() {
        missing.push(format!(
            "{} (run from the repository root)",
            args.plot_script.display()
        ));
    }
    if missing.is_empty() {
        return Ok(());
    }
    let mut msg: String = missing.iter().map(|m| format!("  - {m}\n")).collect();
    if !apt.is_empty() {
        msg.push_str(&format!("  apt-get install -y {}\n", apt.join(" ")));
    }
    Err(msg)
}

fn helper_path() -> Option<PathBuf> {
    Some(
        std::env::current_exe()
            .ok()?
            .parent()?
            .join("kerntun-bench-helper"),
    )
}

fn run(args: Args) -> Result<(), String> {
    let started = Instant::now();
    let nofile = raise_nofile()?;
    let mut meta = machine_meta(&args);
    meta.nofile = nofile;
    meta.requested_connections = args.connections.clone();
    let cap = max_connections(nofile);
    let mut args = args;
    // The UDP part alone is a phone run: nothing else is measured.
    let udp_only = args.phone_udp_only;
    args.phone |= udp_only;
    if args.connections.iter().any(|&n| n > cap) && !args.phone {
        eprintln!(
            "kerntun-netbench: RLIMIT_NOFILE is {nofile} and cannot be raised here; \
             idle-connection steps capped at {cap} (2 engine sockets per connection)"
        );
        let mut steps: Vec<u32> = args.connections.iter().map(|&n| n.min(cap)).collect();
        steps.dedup();
        args.connections = steps;
    }
    meta.load_start = procfs::load1();
    let tmp = std::env::temp_dir().join(format!("kerntun-netbench-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    eprintln!(
        "kerntun-netbench: {} ({} cores), kernel {}, logs in {}",
        meta.cpu_model,
        meta.cores,
        meta.kernel,
        tmp.display()
    );
    let mut records = Vec::new();

    // Criterion first, while nothing of ours is running.
    if !args.skip_criterion && !args.phone {
        match run_criterion(&args, &tmp) {
            Ok(c) => {
                meta.criterion_load = Some(c.load);
                meta.criterion_s = Some(c.secs);
                records.extend(c.figures.into_iter().map(Record::Criterion));
            }
            Err(e) => {
                eprintln!("kerntun-netbench: {e}; going on with the netns measurements");
                meta.criterion_error = Some(e);
            }
        }
    }

    let topo = Topology::new().map_err(|e| format!("building namespaces: {e}"))?;
    if let Ok(mut n) = NAMESPACES.lock() {
        n.push(topo.client.name().to_owned());
        n.push(topo.server.name().to_owned());
    }
    let server_ip = topo.server(false);
    let echo = servers::tcp(
        &topo.server,
        SocketAddr::new(server_ip, ECHO_PORT),
        Mode::Echo,
    )
    .map_err(|e| format!("echo server: {e}"))?;
    let helper = helper_path().ok_or("cannot locate kerntun-bench-helper")?;
    let engine = std::fs::canonicalize(&args.engine)
        .map_err(|e| format!("{}: {e}", args.engine.display()))?;
    let mut ctx = Ctx {
        args,
        topo,
        tmp,
        helper,
        engine,
        iperf_server: None,
        ss_server: None,
        echo,
        nofile,
    };
    start_iperf_server(&mut ctx)?;
    start_ss_server(&mut ctx)?;

    // Which scenarios can this build run? (None of them with `--phone`.)
    let mut runnable: Vec<&'static Scenario> = Vec::new();
    for sc in SCENARIOS.iter().filter(|_| !ctx.args.phone) {
        if sc.config.is_some()
            && !ctx.args.only.is_empty()
            && !ctx.args.only.iter().any(|o| o == sc.id)
        {
            continue;
        }
        let (available, reason) = probe(&ctx, sc);
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
            runnable.push(sc);
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

    // Throughput: interleave scenarios inside each (streams, direction) so a
    // change in background load hits all of them alike.
    let total = ctx.args.streams.len() * 2 * runnable.len();
    let mut n = 0;
    let mut baseline = std::collections::HashMap::new();
    for &streams in &ctx.args.streams.clone() {
        for dir in [Direction::Upload, Direction::Download] {
            for sc in &runnable {
                n += 1;
                let t = throughput_run(&mut ctx, sc, streams, dir);
                if sc.id == "baseline"
                    && let Some(g) = t.gbit_per_s
                {
                    baseline.insert((streams, dir), g);
                }
                eprintln!(
                    "[{n}/{total}] {}",
                    describe(&t, baseline.get(&(streams, dir)))
                );
                records.push(Record::Throughput(t));
            }
        }
    }

    if !ctx.args.skip_profile && !ctx.args.phone {
        if perf_available() {
            let profiled: Vec<&&Scenario> =
                runnable.iter().filter(|s| s.splice.is_some()).collect();
            for &streams in &ctx.args.profile_streams.clone() {
                for dir in [Direction::Upload, Direction::Download] {
                    for sc in &profiled {
                        let x = profile_run(&mut ctx, sc, streams, dir);
                        eprintln!(
                            "profile {:<18} {:>2} streams {:<8} {}",
                            sc.id,
                            streams,
                            dir.as_str(),
                            match &x.error {
                                None => format!(
                                    "{} samples: relay {:.0} %, TUN {:.0} %, userspace {:.0} %",
                                    x.samples,
                                    100.0 * x.path_share(profile::Path::Relay).0,
                                    100.0 * x.path_share(profile::Path::Tun).0,
                                    100.0 * x.path_share(profile::Path::User).0,
                                ),
                                Some(e) => format!("FAILED: {e}"),
                            }
                        );
                        records.push(Record::Profile(x));
                    }
                }
            }
        } else {
            eprintln!(
                "kerntun-netbench: perf not found (Debian: apt-get install linux-perf); no profiles"
            );
        }
    }

    for sc in &runnable {
        let i = integrity(&ctx, sc);
        eprintln!(
            "integrity {:<18} {} MiB: {}",
            sc.id,
            i.bytes >> 20,
            match &i.error {
                None => format!("ok, {:.2} s", i.secs),
                Some(e) => format!("FAILED: {e}"),
            }
        );
        records.push(Record::Integrity(i));
    }

    if !ctx.args.skip_phone && !udp_only {
        records.extend(phone::run(&mut ctx));
    }
    if !ctx.args.skip_phone && !ctx.args.skip_phone_udp {
        records.extend(phone_udp::run(&mut ctx));
    }

    if !ctx.args.skip_scale {
        for sc in runnable.iter().filter(|s| s.scale) {
            for s in scale(&ctx, sc) {
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
                records.push(Record::Scale(s));
            }
        }
    }

    drop(ctx.ss_server.take());
    drop(ctx.iperf_server.take());
    meta.load_end = procfs::load1();
    meta.wall_s = started.elapsed().as_secs_f64();
    meta.duration_s = ctx.args.duration;
    meta.mtu = ctx.args.mtu;
    meta.integrity_bytes = ctx.args.integrity_mib << 20;
    std::fs::create_dir_all(&ctx.args.data_dir)
        .map_err(|e| format!("{}: {e}", ctx.args.data_dir.display()))?;
    let data = ctx.args.data_dir.join("results.jsonl");
    let all = if ctx.args.phone {
        // Keep what the last full run measured; replace its phone records.
        let mut kept = match std::fs::read_to_string(&data) {
            Ok(text) => {
                record::parse_lines(&text).map_err(|e| format!("{}: {e}", data.display()))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(format!("{}: {e}", data.display())),
        };
        if udp_only {
            kerntun_benches::phone_udp::replace(&mut kept, &records);
        } else {
            kerntun_benches::phone::replace(&mut kept, &records);
        }
        kept
    } else {
        records.insert(0, Record::Meta(meta));
        records.clone()
    };
    std::fs::write(&data, to_lines(&all)).map_err(|e| format!("{}: {e}", data.display()))?;
    eprintln!("wrote {}", data.display());
    render(&ctx.args)?;
    let failures = records
        .iter()
        .filter(|r| match r {
            Record::Throughput(t) => t.error.is_some(),
            Record::Integrity(i) => !i.ok,
            Record::Scale(s) => s.error.is_some(),
            Record::Phone(r) => r.error.is_some(),
            Record::PhoneIntegrity(i) => !i.ok,
            Record::PhoneUdp(r) => r.error.is_some(),
            _ => false,
        })
        .count();
    let criterion_failed = records
        .iter()
        .any(|r| matches!(r, Record::Meta(m) if m.criterion_error.is_some()));
    if failures == 0 && !criterion_failed {
        let _ = std::fs::remove_dir_all(&ctx.tmp);
    } else {
        eprintln!("kerntun-netbench: logs kept in {}", ctx.tmp.display());
    }
    eprintln!(
        "kerntun-netbench: done in {:.0} s{}",
        started.elapsed().as_secs_f64(),
        if failures > 0 {
            format!(", {failures} measurement(s) failed (see the page)")
        } else {
            String::new()
        }
    );
    Ok(())
}

fn render(args: &Args) -> Result<(), String> {
    let data = args.data_dir.join("results.jsonl");
    let text = std::fs::read_to_string(&data).map_err(|e| format!("{}: {e}", data.display()))?;
    let records = record::parse_lines(&text).map_err(|e| format!("{}: {e}", data.display()))?;
    let chart = args.data_dir.join("chart.png");
    let out = Command::new(&args.python)
        .arg(&args.plot_script)
        .arg(&data)
        .arg(&chart)
        .output()
        .map_err(|e| format!("{}: {e}", args.plot_script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "chart: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    // The page links the chart relative to itself.
    let rel = relative_to(&chart, args.page.parent().unwrap_or(Path::new(".")));
    let page = report::render(&records, &rel);
    std::fs::write(&args.page, page).map_err(|e| format!("{}: {e}", args.page.display()))?;
    eprintln!("wrote {} and {}", args.page.display(), chart.display());
    Ok(())
}

fn relative_to(path: &Path, base: &Path) -> String {
    path.strip_prefix(base)
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

/// Raise RLIMIT_NOFILE for us and the children (they inherit it) to
/// [`NOFILE`], or to the hard limit where we may not raise that (a container
/// without CAP_SYS_RESOURCE). Returns the limit in effect.
fn raise_nofile() -> Result<u64, String> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) =
        getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| format!("getrlimit(NOFILE): {e}"))?;
    if soft >= NOFILE {
        return Ok(soft);
    }
    if setrlimit(Resource::RLIMIT_NOFILE, NOFILE, NOFILE.max(hard)).is_ok() {
        return Ok(NOFILE);
    }
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
        .map_err(|e| format!("raising RLIMIT_NOFILE to {hard}: {e}"))?;
    Ok(hard)
}

/// The engine holds two sockets per session (the kernel-accepted app side
/// and the outbound) plus a few of its own (TUN, listeners, epoll, stdio):
/// the largest connection count a descriptor limit allows.
fn max_connections(nofile: u64) -> u32 {
    u32::try_from(nofile.saturating_sub(64) / 2).unwrap_or(u32::MAX)
}

fn machine_meta(args: &Args) -> Meta {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown".into(), |(_, v)| v.trim().to_owned());
    let virtualized = cpuinfo
        .lines()
        .any(|l| l.starts_with("flags") && l.split_whitespace().any(|f| f == "hypervisor"));
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let l = m.lines().find(|l| l.starts_with("MemTotal:"))?;
            l.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kib| kib / 1048576.0);
    let cmd_out = |c: &str, a: &[&str]| {
        Command::new(c)
            .args(a)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    Meta {
        date: cmd_out("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]).unwrap_or_default(),
        command: args
            .command
            .clone()
            .unwrap_or_else(|| std::env::args().collect::<Vec<_>>().join(" ")),
        cpu_model,
        cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
        mem_gib,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_or("unknown".into(), |s| s.trim().to_owned()),
        virtualized,
        iperf3: cmd_out("iperf3", &["--version"])
            .and_then(|v| v.lines().next().map(str::to_owned))
            .unwrap_or_default(),
        git_rev: cmd_out("git", &["describe", "--always", "--dirty"])
            .unwrap_or_else(|| "unknown".into()),
        ..Meta::default()
    }
}

/// What the criterion step produced: figures, load average before and
/// after, wall seconds.
struct CriterionRun {
    figures: Vec<record::CriterionFigure>,
    load: (f64, f64),
    secs: f64,
}

fn run_criterion(args: &Args, tmp: &Path) -> Result<CriterionRun, String> {
    let dir = args.criterion_dir.clone().unwrap_or_else(|| {
        PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
            .join("criterion")
    });
    // Whole seconds: some filesystems keep coarse modification times.
    let since = SystemTime::now() - Duration::from_secs(1);
    let load0 = procfs::load1().unwrap_or(f64::NAN);
    let start = Instant::now();
    let log = tmp.join("criterion.log");
    eprintln!(
        "criterion: cargo bench -p kerntun-benches --bench packet --bench nat (log {})",
        log.display()
    );
    let mut cmd = Command::new("cargo");
    cmd.args([
        "bench",
        "-p",
        "kerntun-benches",
        "--bench",
        "packet",
        "--bench",
        "nat",
    ])
    .stdout(File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?)
    .stderr(Stdio::inherit());
    let mut child = spawn_registered(&mut cmd).map_err(|e| format!("cargo bench: {e}"))?;
    let status = child.wait().map_err(|e| format!("cargo bench: {e}"));
    unregister_pid(child.id());
    let status = status?;
    if !status.success() {
        return Err(format!(
            "cargo bench failed ({status}); see {}",
            log.display()
        ));
    }
    let figures = crit::collect(&dir, since);
    if figures.is_empty() {
        return Err(format!("no criterion results under {}", dir.display()));
    }
    Ok(CriterionRun {
        figures,
        load: (load0, procfs::load1().unwrap_or(f64::NAN)),
        secs: start.elapsed().as_secs_f64(),
    })
}

/// Poll until `check` holds, up to `limit`.
fn wait_for(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    check()
}

fn listening(ns: &str, port: u16) -> bool {
    Command::new("ip")
        .args(["netns", "exec", ns, "ss", "-Hltn"])
        .arg(format!("sport = :{port}"))
        .output()
        .is_ok_and(|o| !o.stdout.is_empty())
}

fn start_iperf_server(ctx: &mut Ctx) -> Result<(), String> {
    drop(ctx.iperf_server.take());
    let ip = ctx.server_ip().to_string();
    let port = IPERF_PORT.to_string();
    let p = Proc::spawn(
        &ctx.tmp,
        "iperf3-server",
        ctx.topo.server.name(),
        Path::new("iperf3"),
        &["-s", "-B", &ip, "-p", &port],
        false,
    )?;
    ctx.iperf_server = Some(p);
    if !wait_for(Duration::from_secs(5), || {
        listening(ctx.topo.server.name(), IPERF_PORT)
    }) {
        return Err("iperf3 server did not start listening within 5 s".into());
    }
    Ok(())
}

fn start_ss_server(ctx: &mut Ctx) -> Result<(), String> {
    if !SCENARIOS
        .iter()
        .any(|s| s.outbound == Outbound::ShadowsocksNone)
    {
        return Ok(());
    }
    let listen = SocketAddr::new(ctx.server_ip(), SS_PORT).to_string();
    let p = Proc::spawn(
        &ctx.tmp,
        "ss-none",
        ctx.topo.server.name(),
        &ctx.helper,
        &["ss-none", "--listen", &listen],
        false,
    )?;
    ctx.ss_server = Some(p);
    if !wait_for(Duration::from_secs(5), || {
        listening(ctx.topo.server.name(), SS_PORT)
    }) {
        return Err("Shadowsocks none server did not start within 5 s".into());
    }
    Ok(())
}

/// Connections the Shadowsocks server has logged so far.
fn ss_connections(ctx: &Ctx) -> usize {
    ctx.ss_server.as_ref().map_or(0, |p| {
        p.stdout_text()
            .lines()
            .filter(|l| l.starts_with("conn "))
            .count()
    })
}

// ---------------------------------------------------------------------------
// The engine.

struct Engine {
    proc: Proc,
}

enum Start {
    Ready(Engine),
    /// The build refuses this scenario (the engine's words).
    Unavailable(String),
    Failed(String),
}

/// Where the client's traffic enters the TUN.
#[derive(Debug, Clone, Copy)]
enum RouteIn<'a> {
    /// The client runs in the engine's namespace: a route to the server.
    Local,
    /// The client runs in the router's app namespace: a route in the
    /// table its policy rule looks up.
    Router(&'a kerntun_testkit::router::Router),
}

fn start_engine(ctx: &Ctx, sc: &Scenario, stats_interval: u64) -> Start {
    start_engine_at(ctx, sc, stats_interval, ctx.args.mtu, RouteIn::Local)
}

fn start_engine_at(
    ctx: &Ctx,
    sc: &Scenario,
    stats_interval: u64,
    mtu: u16,
    route: RouteIn,
) -> Start {
    let Some(cfg) = sc.config else {
        return Start::Failed("the baseline has no engine".into());
    };
    let ss = SocketAddr::new(ctx.server_ip(), SS_PORT).to_string();
    let path = ctx.tmp.join(format!("{:03}-{}.toml", next_seq(), sc.id));
    if let Err(e) = std::fs::write(&path, cfg.replace("{ss_server}", &ss)) {
        return Start::Failed(format!("{}: {e}", path.display()));
    }
    let path_s = path.to_string_lossy().into_owned();
    let mtu = mtu.to_string();
    let interval = stats_interval.to_string();
    let mut proc = match Proc::spawn(
        &ctx.tmp,
        &format!("engine-{}", sc.id),
        ctx.topo.client.name(),
        &ctx.engine,
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
    let want: String = ctx
        .engine
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
        RouteIn::Local => {
            let dst = format!("{}/32", ctx.server_ip());
            ctx.topo.client.ip(&["route", "add", &dst, "dev", TUN])
        }
        RouteIn::Router(r) => r.route_via_tun(&ctx.topo, TUN),
    };
    if let Err(e) = routed {
        return Start::Failed(format!("route via the TUN: {e}"));
    }
    Start::Ready(Engine { proc })
}

impl Engine {
    fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// The last statistics line the engine printed.
    fn last_stats(&self) -> Option<Value> {
        let text = self.proc.stdout_text();
        let line = text.lines().rev().find(|l| l.starts_with('{'))?;
        serde_json::from_str(line).ok()
    }

    /// SIGINT (the engine stops, prints its final statistics and exits).
    fn stop(mut self) -> (Option<Value>, Option<String>) {
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

/// Open descriptors of a process.
fn count_fds(pid: u32) -> Option<u64> {
    let d = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    Some(d.count() as u64)
}

/// Whether the engine can run a scenario: start it and stop it.
fn probe(ctx: &Ctx, sc: &Scenario) -> (bool, Option<String>) {
    if sc.config.is_none() {
        return (true, None);
    }
    match start_engine(ctx, sc, 0) {
        Start::Ready(e) => match e.stop() {
            (_, None) => (true, None),
            (_, Some(err)) => (false, Some(format!("engine failed to stop: {err}"))),
        },
        Start::Unavailable(why) => (false, Some(why)),
        Start::Failed(why) => (false, Some(format!("engine failed to start: {why}"))),
    }
}

/// TX packets and drops of the TUN device in the client namespace.
fn tun_tx(ctx: &Ctx) -> Option<(u64, u64)> {
    let out = Command::new("ip")
        .args([
            "-n",
            ctx.topo.client.name(),
            "-s",
            "-j",
            "link",
            "show",
            "dev",
            TUN,
        ])
        .output()
        .ok()?;
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    let tx = v.get(0)?.get("stats64")?.get("tx")?;
    Some((tx.get("packets")?.as_u64()?, tx.get("dropped")?.as_u64()?))
}

fn run_iperf(ctx: &Ctx, streams: u32, dir: Direction) -> Result<iperf::IperfRun, String> {
    run_iperf_in(ctx, ctx.topo.client.name(), streams, dir)
}

/// An iperf3 client run in namespace `ns`.
fn run_iperf_in(
    ctx: &Ctx,
    ns: &str,
    streams: u32,
    dir: Direction,
) -> Result<iperf::IperfRun, String> {
    let server = ctx.server_ip().to_string();
    let (t, p, port) = (
        ctx.args.duration.to_string(),
        streams.to_string(),
        IPERF_PORT.to_string(),
    );
    let mut a = vec![
        "-c",
        &server,
        "-p",
        &port,
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
        "iperf3-client",
        ns,
        Path::new("iperf3"),
        &a,
        false,
    )?;
    let limit = Duration::from_secs(ctx.args.duration + 30);
    match proc.wait_timeout(limit) {
        Some(_) => iperf::parse(&proc.stdout_text()),
        None => {
            let _ = proc.stop(Signal::SIGKILL, Duration::from_secs(2));
            Err(format!("iperf3 did not finish within {limit:?}"))
        }
    }
}

fn throughput_run(ctx: &mut Ctx, sc: &Scenario, streams: u32, dir: Direction) -> Throughput {
    let mut t = Throughput {
        scenario: sc.id.into(),
        streams,
        direction: dir,
        gbit_per_s: None,
        bytes: 0,
        secs: 0.0,
        retransmits: None,
        engine_cpu_s: None,
        cpu_s_per_gb: None,
        rss_kib: None,
        hwm_kib: None,
        tun_tx_dropped: None,
        tun_tx_packets: None,
        system_busy: 0.0,
        iperf_cpu_client: None,
        iperf_cpu_server: None,
        load1: procfs::load1(),
        engine_stats: None,
        error: None,
    };
    let engine = if sc.config.is_some() {
        match start_engine(ctx, sc, 0) {
            Start::Ready(e) => Some(e),
            Start::Unavailable(why) | Start::Failed(why) => {
                t.error = Some(why);
                return t;
            }
        }
    } else {
        None
    };
    let ss_before = ss_connections(ctx);
    let ticks0 = engine
        .as_ref()
        .and_then(|e| procfs::process_ticks(e.pid()).ok());
    let sys0 = SystemCpu::read().ok();
    let result = run_iperf(ctx, streams, dir);
    let sys1 = SystemCpu::read().ok();
    if let Some(e) = &engine {
        let ticks1 = procfs::process_ticks(e.pid()).ok();
        if let (Some(a), Some(b)) = (ticks0, ticks1) {
            t.engine_cpu_s = Some(b.saturating_sub(a) as f64 / procfs::ticks_per_second());
        }
        if let Ok(Mem {
            rss_kib, hwm_kib, ..
        }) = procfs::process_mem(e.pid())
        {
            t.rss_kib = Some(rss_kib);
            t.hwm_kib = Some(hwm_kib);
        }
        if let Some((packets, dropped)) = tun_tx(ctx) {
            t.tun_tx_packets = Some(packets);
            t.tun_tx_dropped = Some(dropped);
        }
    }
    if let (Some(a), Some(b)) = (sys0, sys1) {
        t.system_busy = b.busy_since(&a);
    }
    match result {
        Ok(r) => {
            t.gbit_per_s = Some(r.bits_per_second / 1e9);
            t.bytes = r.bytes;
            t.secs = r.seconds;
            t.retransmits = r.retransmits;
            t.iperf_cpu_client = r.cpu_host;
            t.iperf_cpu_server = r.cpu_remote;
            t.cpu_s_per_gb = t.engine_cpu_s.map(|c| c / (r.bytes as f64 / 1e9));
        }
        Err(e) => {
            t.error = Some(e);
            // A failed client can leave the server stuck in its test.
            if let Err(e) = start_iperf_server(ctx) {
                eprintln!("restarting the iperf3 server: {e}");
            }
        }
    }
    if sc.outbound == Outbound::ShadowsocksNone && ss_connections(ctx) == ss_before {
        t.error.get_or_insert(
            "no connection reached the Shadowsocks server: not a Shadowsocks run".into(),
        );
        t.gbit_per_s = None;
    }
    if let Some(e) = engine {
        let (stats, err) = e.stop();
        t.engine_stats = stats;
        if let Some(err) = err {
            t.error.get_or_insert(err);
        }
    }
    t
}

fn perf_available() -> bool {
    Command::new("perf")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// One extra iperf3 run with the engine sampled by `perf record -g`, sorted
/// into paths ([`kerntun_benches::profile`]).
fn profile_run(ctx: &mut Ctx, sc: &Scenario, streams: u32, dir: Direction) -> Profile {
    let mut x = Profile {
        scenario: sc.id.into(),
        streams,
        direction: dir,
        samples: 0,
        cpu_s_per_gb: None,
        buckets: Vec::new(),
        error: None,
    };
    let engine = match start_engine(ctx, sc, 0) {
        Start::Ready(e) => e,
        Start::Unavailable(why) | Start::Failed(why) => {
            x.error = Some(why);
            return x;
        }
    };
    let data = ctx
        .tmp
        .join(format!("{:03}-perf-{}.data", next_seq(), sc.id));
    let secs = (ctx.args.duration + 1).to_string();
    let pid = engine.pid().to_string();
    let mut cmd = Command::new("perf");
    cmd.args(["record", "-q", "-F", "999", "-g", "-p", &pid, "-o"])
        .arg(&data)
        .args(["--", "sleep", &secs])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut perf = match spawn_registered(&mut cmd) {
        Ok(c) => c,
        Err(e) => {
            x.error = Some(format!("perf record: {e}"));
            let _ = engine.stop();
            return x;
        }
    };
    let ticks0 = procfs::process_ticks(engine.pid()).ok();
    let result = run_iperf(ctx, streams, dir);
    let ticks1 = procfs::process_ticks(engine.pid()).ok();
    // perf stops by itself after `sleep`; bounded wait, then kill.
    let end = Instant::now() + Duration::from_secs(ctx.args.duration + 20);
    let status = loop {
        match perf.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = perf.kill();
                let _ = perf.wait();
                break None;
            }
        }
    };
    unregister_pid(perf.id());
    let _ = engine.stop();
    match result {
        Ok(r) => {
            if let (Some(a), Some(b)) = (ticks0, ticks1) {
                let cpu = b.saturating_sub(a) as f64 / procfs::ticks_per_second();
                x.cpu_s_per_gb = Some(cpu / (r.bytes.max(1) as f64 / 1e9));
            }
        }
        Err(e) => {
            x.error = Some(format!("iperf3: {e}"));
            if let Err(e) = start_iperf_server(ctx) {
                eprintln!("restarting the iperf3 server: {e}");
            }
        }
    }
    if !status.is_some_and(|s| s.success()) {
        x.error
            .get_or_insert(format!("perf record ended with {status:?}"));
        return x;
    }
    let out = Command::new("perf")
        .args(["script", "-F", "tid,period,ip,sym", "-i"])
        .arg(&data)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output();
    let _ = std::fs::remove_file(&data);
    match out {
        Ok(o) if o.status.success() => {
            let (n, buckets) = profile::tally(&String::from_utf8_lossy(&o.stdout));
            x.samples = n;
            x.buckets = buckets;
            if n == 0 {
                x.error.get_or_insert("no samples".into());
            }
        }
        Ok(o) => {
            x.error.get_or_insert(format!("perf script: {}", o.status));
        }
        Err(e) => {
            x.error.get_or_insert(format!("perf script: {e}"));
        }
    }
    x
}

fn describe(t: &Throughput, baseline: Option<&f64>) -> String {
    let head = format!(
        "{:<18} {:>2} streams {:<8}",
        t.scenario,
        t.streams,
        t.direction.as_str()
    );
    match (t.gbit_per_s, &t.error) {
        (Some(g), None) => {
            let mut s = format!("{head} {g:6.2} Gbit/s");
            if let Some(b) = baseline.filter(|_| t.scenario != "baseline") {
                s.push_str(&format!(" ({:.0} % of baseline)", 100.0 * g / b));
            }
            if let Some(c) = t.cpu_s_per_gb {
                s.push_str(&format!(", {c:.2} CPU s/GB"));
            }
            if let Some(r) = t.hwm_kib {
                s.push_str(&format!(", peak RSS {:.1} MiB", r as f64 / 1024.0));
            }
            if let Some(d) = t.tun_tx_dropped {
                s.push_str(&format!(", {d} TUN TX drops"));
            }
            if let Some(f) = report::spliced_share(t) {
                s.push_str(&format!(", {:.0} % spliced", 100.0 * f));
            }
            s
        }
        (_, Some(e)) => format!("{head} FAILED: {e}"),
        (None, None) => format!("{head} no result"),
    }
}

fn integrity(ctx: &Ctx, sc: &Scenario) -> Integrity {
    let len = ctx.args.integrity_mib << 20;
    let mut i = Integrity {
        scenario: sc.id.into(),
        bytes: len,
        ok: false,
        secs: 0.0,
        error: None,
    };
    let engine = if sc.config.is_some() {
        match start_engine(ctx, sc, 0) {
            Start::Ready(e) => Some(e),
            Start::Unavailable(why) | Start::Failed(why) => {
                i.error = Some(why);
                return i;
            }
        }
    } else {
        None
    };
    let ss_before = ss_connections(ctx);
    let addr = ctx.echo.addr;
    let r = ctx
        .topo
        .client
        .spawn(move || client::echo_transfer(addr, 0x6b74, len as usize, false))
        .map_err(|e| format!("client thread: {e}"))
        .and_then(|h| h.join().map_err(|_| "client thread panicked".to_string()))
        .and_then(|r| {
            r.map_err(|e| match e.kind() {
                // The checker's socket has a 20 s read timeout.
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    format!("stalled: no byte came back for 20 s ({e})")
                }
                _ => format!("echo transfer: {e}"),
            })
        });
    match r {
        Ok(t) => {
            i.ok = true;
            i.secs = t.elapsed.as_secs_f64();
        }
        Err(e) => i.error = Some(e),
    }
    if sc.outbound == Outbound::ShadowsocksNone && ss_connections(ctx) == ss_before {
        i.ok = false;
        i.error
            .get_or_insert("no connection reached the Shadowsocks server".into());
    }
    if let Some(e) = engine {
        let (stats, err) = e.stop();
        if let Some(err) = err {
            i.ok = false;
            i.error.get_or_insert(err);
        }
        // Where a failed transfer stopped, in the engine's own counts.
        if let (Some(msg), Some(st)) = (i.error.as_mut(), stats) {
            let n = |k: &str| st.get(k).and_then(Value::as_u64).unwrap_or(0);
            msg.push_str(&format!(
                "; the engine had relayed {:.1} MiB up and {:.1} MiB down",
                n("tcp_bytes_up") as f64 / 1048576.0,
                n("tcp_bytes_down") as f64 / 1048576.0
            ));
        }
    }
    i
}

/// Engine RSS with idle connections held through it, in cumulative steps.
fn scale(ctx: &Ctx, sc: &Scenario) -> Vec<Scale> {
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
    let engine = match start_engine(ctx, sc, 1) {
        Start::Ready(e) => e,
        Start::Unavailable(why) | Start::Failed(why) => {
            fail(&mut out, first, why);
            return out;
        }
    };
    let listen = SocketAddr::new(ctx.server_ip(), HOLD_PORT).to_string();
    let server = Proc::spawn(
        &ctx.tmp,
        "hold-server",
        ctx.topo.server.name(),
        &ctx.helper,
        &["hold-server", "--listen", &listen],
        false,
    );
    let server = match server {
        Ok(s) => s,
        Err(e) => {
            fail(&mut out, first, e);
            return out;
        }
    };
    if !wait_for(Duration::from_secs(5), || {
        listening(ctx.topo.server.name(), HOLD_PORT)
    }) {
        fail(&mut out, first, "hold server did not start".into());
        return out;
    }
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
