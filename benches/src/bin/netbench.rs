//! `kerntun-netbench`: the netns benchmark harness behind
//! `scripts/bench.sh` (run as root). One run measures, side by side:
//!
//! * iperf3 throughput at each stream count, upload and download, through a
//!   no-TUN baseline (the ceiling) and every engine scenario of
//!   [`kerntun_benches::scenario::SCENARIOS`] this build can run, with a
//!   fresh engine process per run: engine CPU seconds per GB (from
//!   `/proc/<pid>/stat` before and after), its current and peak RSS, and the
//!   TUN's counters;
//! * a byte-for-byte checked echo transfer through every scenario;
//! * engine RSS with 1k/4k/10k idle TCP connections held through it;
//! * the criterion benches of the packet core and the NAT table;
//! * the phone profiles (`--phone` alone; [`kerntun_benches::phone`]): the
//!   phone's own TUN (a client routed by its uid, the TUN at Android's
//!   transmit queue), a client routed through a forwarding namespace or
//!   local to the TUN, per-packet and batch drivers, each against the
//!   no-TUN baseline of its topology, with the engine's system calls,
//!   wake-ups, the TUN's drops and the TCP retransmissions; and their UDP
//!   part (`--phone-udp-only` alone): 1200-byte datagrams at full rate,
//!   both directions.
//!
//! Every iperf3 run goes through one runner (`runner`): each kind of run is
//! a [`runner::Profile`] saying what differs (`desktop`, `phone`).
//!
//! It writes `docs/benchmarks/results.jsonl`, renders `docs/benchmarks.md`
//! from those records and draws the chart with `benches/plot.py`.
//!
//! The engine runs as its own process (`ip netns exec <client ns> kerntun
//! run ...`, `engine`) so its CPU and memory are measured alone. Every
//! process the harness starts is registered and killed, and the namespaces
//! deleted, on any exit: normal, error, panic, Ctrl-C or SIGTERM (`procs`).

use std::fs::File;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime};

use clap::Parser;
use kerntun_benches::record::{Meta, Record, Topo, to_lines};
use kerntun_benches::scenario::{Outbound, SCENARIOS};
use kerntun_benches::{crit, phone as ph, procfs, record, report};
use kerntun_testkit::Topology;
use kerntun_testkit::servers::{self, Mode};

#[path = "netbench/desktop.rs"]
mod desktop;
#[path = "netbench/engine.rs"]
mod engine;
#[path = "netbench/phone.rs"]
mod phone;
#[path = "netbench/procs.rs"]
mod procs;
#[path = "netbench/runner.rs"]
mod runner;

use procs::{
    CleanupGuard, Proc, cleanup_all, listening, register_ns, spawn_registered, unregister_pid,
    wait_for,
};

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
    /// kept, the records of the topologies measured (and of the UDP part,
    /// when it runs) replaced and the page re-rendered.
    #[arg(long)]
    phone: bool,
    /// Run only the phone's own TUN (the android topology, TCP): the same as
    /// `--phone --phone-topologies android --skip-phone-udp`.
    #[arg(long, conflicts_with_all = ["phone_udp_only", "skip_phone"])]
    phone_tun_only: bool,
    /// Leave the phone profiles out of a full run.
    #[arg(long, conflicts_with = "phone")]
    skip_phone: bool,
    /// MTUs of the router and local phone profiles (the TUN and every veth).
    #[arg(long, value_delimiter = ',', default_value = "1500,9000")]
    phone_mtus: Vec<u16>,
    /// MTUs of the android topology (the phone's own TUN).
    #[arg(long, value_delimiter = ',', default_value = "1500,4064,9000")]
    phone_android_mtus: Vec<u16>,
    /// Topologies of the phone profiles: android (the phone's own TUN: the
    /// client as an app's uid next to the engine, routed by a uid rule,
    /// the TUN at txqueuelen 500, the engine on one runtime thread), router (the client in a namespace of its
    /// own, forwarded into the TUN), local (the client next to the engine).
    #[arg(long, value_delimiter = ',', default_value = "android,router,local")]
    phone_topologies: Vec<Topo>,
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
    /// per-packet profile's run (TCP and UDP, every topology) with the same
    /// streams and direction, so the page shows before and after from one run
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

struct Ctx {
    args: Args,
    topo: Topology,
    tmp: PathBuf,
    helper: PathBuf,
    /// The engine under test.
    engine: PathBuf,
    iperf_server: Option<Proc>,
    ss_server: Option<Proc>,
    /// The echo server of the integrity checks; kept for its life.
    _echo: servers::Server,
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
    if !works("setpriv", &["--version"]) {
        missing.push(
            "setpriv (util-linux: the android topology's client runs as an app's uid)".into(),
        );
        apt.push("util-linux");
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
    if args.phone_tun_only {
        args.phone = true;
        args.phone_topologies = vec![Topo::Android];
        args.skip_phone_udp = true;
    }
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
    register_ns(topo.client.name());
    register_ns(topo.server.name());
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
        _echo: echo,
        nofile,
    };
    restart_iperf_server(&mut ctx)?;
    start_ss_server(&mut ctx)?;

    // The desktop scenarios (none of them with `--phone`).
    let runnable = desktop::runnable(&ctx, &mut records);
    records.extend(desktop::throughput(&mut ctx, &runnable));
    if !ctx.args.skip_profile && !ctx.args.phone {
        records.extend(desktop::cpu_profiles(&mut ctx, &runnable));
    }
    records.extend(desktop::integrity(&ctx, &runnable));
    if !ctx.args.skip_phone && !udp_only {
        records.extend(phone::run(&mut ctx));
    }
    if !ctx.args.skip_phone && !ctx.args.skip_phone_udp {
        records.extend(phone::run_udp(&mut ctx));
    }
    if !ctx.args.skip_scale {
        records.extend(desktop::scale_all(&ctx, &runnable));
    }

    drop(ctx.ss_server.take());
    drop(ctx.iperf_server.take());
    finish_meta(&mut meta, started);
    meta.duration_s = ctx.args.duration;
    meta.mtu = ctx.args.mtu;
    meta.integrity_bytes = ctx.args.integrity_mib << 20;
    std::fs::create_dir_all(&ctx.args.data_dir)
        .map_err(|e| format!("{}: {e}", ctx.args.data_dir.display()))?;
    let data = ctx.args.data_dir.join("results.jsonl");
    let all = if ctx.args.phone {
        // Keep what the last full run measured; replace what this one did.
        let mut kept = match std::fs::read_to_string(&data) {
            Ok(text) => {
                record::parse_lines(&text).map_err(|e| format!("{}: {e}", data.display()))?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(format!("{}: {e}", data.display())),
        };
        ph::replace(&mut kept, &records);
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
            Record::Throughput(t) => t.run.error.is_some(),
            Record::Integrity(i) | Record::PhoneIntegrity(i) => !i.ok,
            Record::Scale(s) => s.error.is_some(),
            Record::Phone(r) => r.run.error.is_some(),
            Record::PhoneUdp(r) => r.run.error.is_some(),
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
    let page = report::render(&records, &rel)?;
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
        .and_then(|m| procfs::field_after(&m, "MemTotal:"))
        .map_or(0.0, |kib| kib as f64 / 1048576.0);
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

/// The end of a run on its meta: the load average now, the wall time
/// since `started`.
fn finish_meta(meta: &mut Meta, started: Instant) {
    meta.load_end = procfs::load1();
    meta.wall_s = started.elapsed().as_secs_f64();
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

/// A server in the server namespace, once it listens on `port`.
fn serve(ctx: &Ctx, name: &str, program: &Path, args: &[&str], port: u16) -> Result<Proc, String> {
    let p = Proc::spawn(&ctx.tmp, name, ctx.topo.server.name(), program, args, false)?;
    if !wait_for(Duration::from_secs(5), || {
        listening(ctx.topo.server.name(), port)
    }) {
        return Err(format!("{name} did not start listening within 5 s"));
    }
    Ok(p)
}

/// (Re)start the iperf3 server (a failed client can leave it stuck in its
/// test).
fn restart_iperf_server(ctx: &mut Ctx) -> Result<(), String> {
    drop(ctx.iperf_server.take());
    let ip = ctx.server_ip().to_string();
    let port = IPERF_PORT.to_string();
    let args = ["-s", "-B", &ip, "-p", &port];
    ctx.iperf_server = Some(serve(
        ctx,
        "iperf3-server",
        Path::new("iperf3"),
        &args,
        IPERF_PORT,
    )?);
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
    let args = ["ss-none", "--listen", &listen];
    ctx.ss_server = Some(serve(ctx, "ss-none", &ctx.helper, &args, SS_PORT)?);
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
