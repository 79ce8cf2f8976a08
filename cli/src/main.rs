//! `kerntun`: the desktop command line.
//!
//! * `kerntun run`: run the engine on a TUN device (created, or an inherited
//!   `--tun-fd`) from a TOML config plus flags, printing statistics as JSON
//!   lines until SIGINT, SIGTERM or SIGHUP (each stops the engine and prints
//!   the final statistics).
//!   With `--auto-route` (Linux) it also routes the host's traffic (and
//!   `--route-from` interfaces' forwarded traffic) into the TUN and removes
//!   that routing again on exit (autoroute.rs, docs/linux-routing.md).
//! * `kerntun demo`: as root, build a client and a server namespace joined by
//!   veth, start the engine on a TUN in the client namespace, move real TCP
//!   and UDP traffic through it with byte-for-byte checks, print throughput
//!   and statistics, and clean up (also on Ctrl-C and on failure).

#[cfg(target_os = "linux")]
mod autoroute;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use kerntun::config::{Config, DriverMode, OutboundConfig, StackKind};
use kerntun::outbound::link::Link;
use kerntun::rules::{Action, Rule};
use kerntun::{Engine, TunSource};

#[derive(Parser, Debug)]
#[command(
    name = "kerntun",
    version,
    about = "TUN proxy engine (system netstack or smoltcp)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the engine until interrupted.
    Run(RunArgs),
    /// Network-namespace demo moving real traffic through the engine (root).
    Demo(DemoArgs),
}

/// `auto` is the engine's choice: the system netstack unless the kernel
/// listener cannot work (the engine logs which and why).
#[derive(ValueEnum, Clone, Copy, Debug)]
enum Stack {
    Auto,
    System,
    Smoltcp,
}

impl From<Stack> for StackKind {
    fn from(s: Stack) -> Self {
        match s {
            Stack::Auto => StackKind::Auto,
            Stack::System => StackKind::System,
            Stack::Smoltcp => StackKind::Smoltcp,
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum Driver {
    Auto,
    Batch,
    PerPacket,
}

impl From<Driver> for DriverMode {
    fn from(d: Driver) -> Self {
        match d {
            Driver::Auto => DriverMode::Auto,
            Driver::Batch => DriverMode::Batch,
            Driver::PerPacket => DriverMode::PerPacket,
        }
    }
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// TOML configuration file (see docs/configuration.md).
    #[arg(short, long)]
    config: Option<PathBuf>,
    /// Use this already-open TUN descriptor instead of creating a device.
    #[arg(long)]
    tun_fd: Option<i32>,
    /// Name of the TUN device to create.
    #[arg(long)]
    tun_name: Option<String>,
    /// Gateway address/prefix, e.g. 198.18.0.1/16.
    #[arg(long)]
    ipv4: Option<String>,
    /// IPv6 gateway address/prefix, e.g. fd00:18::1/64.
    #[arg(long)]
    ipv6: Option<String>,
    #[arg(long)]
    mtu: Option<u16>,
    /// TCP stack (overrides the config file's `stack`).
    #[arg(long, value_enum)]
    stack: Option<Stack>,
    #[arg(long, value_enum)]
    driver: Option<Driver>,
    /// Bind direct outbound sockets to this interface.
    #[arg(long)]
    interface: Option<String>,
    /// Mark direct outbound sockets (policy routing).
    #[arg(long)]
    fwmark: Option<u32>,
    /// Print statistics every N seconds (0 = only at exit).
    #[arg(long, default_value_t = 5)]
    stats_interval: u64,
    /// Route the host's traffic into the TUN with policy routing (IPv4 and
    /// IPv6; the engine's own sockets are excluded by their fwmark), point the
    /// host's DNS at the engine's resolver when [dns] is on, and undo it all
    /// on exit. Linux, root. See docs/linux-routing.md.
    #[arg(long)]
    auto_route: bool,
    /// With --auto-route: also route traffic forwarded from this interface
    /// (a LAN behind this host) into the TUN; turns IP forwarding on while
    /// running. Repeatable.
    #[arg(long, requires = "auto_route", value_name = "IFACE")]
    route_from: Vec<String>,
    /// With --auto-route and [dns] on: how the host is pointed at the engine's
    /// resolver.
    #[cfg(target_os = "linux")]
    #[arg(long, value_enum, default_value_t = autoroute::DnsSetup::Auto, requires = "auto_route")]
    dns_setup: autoroute::DnsSetup,
    /// Send everything the config's rules do not route elsewhere through
    /// this proxy: an `ss://` or `socks5://` link (outbound name `proxy`).
    #[arg(long, value_name = "URL")]
    proxy: Option<String>,
}

#[derive(clap::Args, Debug)]
struct DemoArgs {
    /// MiB sent (and echoed back) over IPv4, split across the streams.
    #[arg(long, default_value_t = 512)]
    mib: usize,
    /// Parallel TCP streams.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// TCP stack; `auto` is the system stack.
    #[arg(long, value_enum, default_value_t = Stack::Auto)]
    stack: Stack,
    #[arg(long, value_enum, default_value_t = Driver::Auto)]
    driver: Driver,
    /// TUN MTU (65535 is the desktop default).
    #[arg(long)]
    mtu: Option<u16>,
    /// Print the final statistics as JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: piped into a file or a log collector,
        // escape codes are noise.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let r = match cli.cmd {
        Cmd::Run(a) => run(a),
        Cmd::Demo(a) => demo(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kerntun: {e}");
            ExitCode::FAILURE
        }
    }
}

fn load_config(args: &RunArgs) -> Result<Config, String> {
    let mut cfg = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?;
            toml::from_str::<Config>(&text).map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => Config::default(),
    };
    if let Some(n) = &args.tun_name {
        cfg.tun.name = n.clone();
    }
    if let Some(v) = &args.ipv4 {
        cfg.tun.ipv4 = Some(v.parse().map_err(|e| format!("--ipv4 {v}: {e}"))?);
    }
    if let Some(v) = &args.ipv6 {
        cfg.tun.ipv6 = Some(v.parse().map_err(|e| format!("--ipv6 {v}: {e}"))?);
    }
    if let Some(m) = args.mtu {
        cfg.tun.mtu = m;
    }
    if let Some(s) = args.stack {
        cfg.stack = s.into();
    }
    if let Some(d) = args.driver {
        cfg.driver = d.into();
    }
    if let Some(i) = &args.interface {
        cfg.direct.interface = Some(i.clone());
    }
    if let Some(m) = args.fwmark {
        cfg.direct.fwmark = Some(m);
    }
    if let Some(url) = &args.proxy {
        add_proxy(&mut cfg, url)?;
    }
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// `--proxy URL`: an outbound named `proxy` from the link, and a catch-all
/// rule to it after the config's own rules.
fn add_proxy(cfg: &mut Config, url: &str) -> Result<(), String> {
    let link = Link::parse(url).map_err(|e| format!("--proxy: {e}"))?;
    if cfg.outbounds.contains_key(PROXY) {
        return Err(format!(
            "--proxy: the config already has an outbound named {PROXY:?}"
        ));
    }
    cfg.outbounds
        .insert(PROXY.into(), OutboundConfig::from(link));
    cfg.rules.push(Rule {
        action: Action::from(PROXY),
        ..Rule::default()
    });
    Ok(())
}

/// The outbound `--proxy` adds.
const PROXY: &str = "proxy";

fn run(args: RunArgs) -> Result<(), String> {
    #[cfg_attr(not(target_os = "linux"), allow(unused_mut))]
    let mut cfg = load_config(&args)?;
    // Installed first: a signal during the start (or the routing setup) is
    // then a clean stop too, never a half-applied routing left behind.
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::Relaxed))
        .map_err(|e| format!("installing the signal handler: {e}"))?;
    #[cfg(target_os = "linux")]
    let plan = if args.auto_route {
        let plan = autoroute::Plan::new(&mut cfg, &args.route_from, args.dns_setup)?;
        autoroute::clean_stale()?;
        Some(plan)
    } else {
        None
    };
    #[cfg(not(target_os = "linux"))]
    if args.auto_route {
        return Err("--auto-route is Linux-only".into());
    }
    // `--tun-fd`: inherited from the parent process, which lends it; this
    // process never closes it.
    let mut engine = match args.tun_fd {
        Some(fd) => kerntun::tun::with_lent_fd(fd, |lent| match lent {
            Some(lent) => Engine::start(cfg, TunSource::Fd(lent), None).map_err(|e| e.to_string()),
            None => Err(format!("--tun-fd {fd}: not an open descriptor")),
        })?,
        None => Engine::start(cfg, TunSource::Create, None).map_err(|e| e.to_string())?,
    };
    #[cfg(target_os = "linux")]
    let routing = match &plan {
        Some(plan) => {
            let installed = engine
                .tun_name()
                .ok_or_else(|| "auto-route: the TUN's name is unknown".to_string())
                .and_then(|tun| autoroute::AutoRoute::install(plan, &tun));
            match installed {
                Ok(r) => Some(r),
                Err(e) => {
                    engine.stop();
                    return Err(e);
                }
            }
        }
        None => None,
    };
    let interval = Duration::from_secs(args.stats_interval);
    let mut last = Instant::now();
    while !interrupted.load(Ordering::Relaxed) && engine.is_running() {
        std::thread::sleep(Duration::from_millis(100));
        if !interval.is_zero() && last.elapsed() >= interval {
            last = Instant::now();
            print_json(&engine.stats());
        }
    }
    let failed = engine.error();
    // Routing first: the host's traffic leaves the TUN before the engine
    // that serves it stops.
    #[cfg(target_os = "linux")]
    let unrouted = routing.map_or(Ok(()), autoroute::AutoRoute::remove);
    #[cfg(not(target_os = "linux"))]
    let unrouted: Result<(), String> = Ok(());
    engine.stop();
    print_json(&engine.stats());
    match (failed, unrouted) {
        (Some(e), Err(r)) => Err(format!("{e}; {r}")),
        (Some(e), Ok(())) => Err(e),
        (None, r) => r,
    }
}

fn print_json(s: &kerntun::StatsSnapshot) {
    match serde_json::to_string(s) {
        Ok(line) => println!("{line}"),
        Err(e) => eprintln!("kerntun: stats: {e}"),
    }
}

/// A failed transfer: print what the engine saw while it is still running
/// (the demo drops it on error), then hand the error back.
fn failure_report(engine: &Engine, error: String) -> String {
    eprintln!("kerntun demo: {error}; engine state at the failure:");
    match serde_json::to_string(&engine.stats()) {
        Ok(line) => eprintln!("stats: {line}"),
        Err(e) => eprintln!("stats: {e}"),
    }
    for line in engine.debug_smol() {
        eprintln!("{line}");
    }
    error
}

fn demo(args: DemoArgs) -> Result<(), String> {
    use kerntun_testkit::servers::{self, Mode};
    use kerntun_testkit::{Topology, client};

    if !kerntun_testkit::have_root() {
        return Err(
            "demo needs root, /dev/net/tun and `ip netns` (it creates namespaces and a TUN)".into(),
        );
    }
    let streams = args.streams.max(1);
    let per_stream = (args.mib * 1024 * 1024 / streams).max(1);
    let topo = Topology::new().map_err(|e| format!("building namespaces: {e}"))?;
    // Ctrl-C: delete the namespaces (the TUN goes with the client one) and leave.
    let names = [topo.client.name().to_owned(), topo.server.name().to_owned()];
    ctrlc::set_handler(move || {
        for n in &names {
            let _ = kerntun_testkit::sh("ip", &["netns", "del", n]);
        }
        eprintln!("\nkerntun demo: interrupted, namespaces removed");
        std::process::exit(130);
    })
    .map_err(|e| format!("installing the signal handler: {e}"))?;

    let tcp4 = servers::tcp(&topo.server, topo.server_addr(false, 5201), Mode::Echo)
        .map_err(|e| format!("tcp server: {e}"))?;
    let tcp6 = servers::tcp(&topo.server, topo.server_addr(true, 5201), Mode::Echo)
        .map_err(|e| format!("tcp6 server: {e}"))?;
    let udp4 = servers::udp_echo(&topo.server, topo.server_addr(false, 5353))
        .map_err(|e| format!("udp server: {e}"))?;
    let udp6 = servers::udp_echo(&topo.server, topo.server_addr(true, 5353))
        .map_err(|e| format!("udp6 server: {e}"))?;

    topo.client
        .enter()
        .map_err(|e| format!("entering the client namespace: {e}"))?;
    let mut cfg = Config::default();
    cfg.tun.name = format!("ktdemo{}", topo.id);
    cfg.tun.ipv6 = Some("fd00:18::1/64".parse().map_err(|e| format!("{e}"))?);
    cfg.stack = args.stack.into();
    cfg.driver = args.driver.into();
    if let Some(m) = args.mtu {
        cfg.tun.mtu = m;
    }
    cfg.direct.interface = Some(kerntun_testkit::CLIENT_VETH.into());
    let mtu = cfg.tun.mtu;
    let mut engine = Engine::start(cfg, TunSource::Create, None).map_err(|e| e.to_string())?;
    let tun = engine.tun_name().unwrap_or_default();
    topo.route_via_tun(&tun)
        .map_err(|e| format!("routes: {e}"))?;
    println!(
        "kerntun demo: engine on {tun} (mtu {mtu}, {} stack, {} driver) in netns {}, servers in {}",
        engine.stats().stack,
        engine.stats().driver,
        topo.client.name(),
        topo.server.name()
    );

    // TCP over IPv4: parallel echo streams, every byte checked both ways.
    let start = Instant::now();
    let handles: Vec<_> = (0..streams)
        .map(|i| {
            let addr = tcp4.addr;
            std::thread::spawn(move || client::echo_transfer(addr, i as u64, per_stream, false))
        })
        .collect();
    for h in handles {
        h.join()
            .map_err(|_| "client thread panicked".to_string())?
            .map_err(|e| failure_report(&engine, format!("TCP/IPv4 transfer: {e}")))?;
    }
    let secs = start.elapsed().as_secs_f64();
    let total = (per_stream * streams) as f64;
    println!(
        "TCP  IPv4: {streams} streams, {:.0} MiB each way, verified, {:.2} s, {:.2} Gbit/s per direction",
        total / 1048576.0,
        secs,
        total * 8.0 / secs / 1e9
    );

    // TCP over IPv6: one stream, a quarter of the volume.
    let v6_len = (args.mib * 1024 * 1024 / 4).max(1);
    let t = client::echo_transfer(tcp6.addr, 1000, v6_len, false)
        .map_err(|e| failure_report(&engine, format!("TCP/IPv6 transfer: {e}")))?;
    println!(
        "TCP  IPv6: 1 stream, {:.0} MiB each way, verified, {:.2} s, {:.2} Gbit/s per direction",
        v6_len as f64 / 1048576.0,
        t.elapsed.as_secs_f64(),
        t.gbit_per_s()
    );

    // UDP request/response, both families.
    for (name, srv) in [("IPv4", &udp4), ("IPv6", &udp6)] {
        let start = Instant::now();
        let ok =
            client::udp_round_trips(srv.addr, 1000, 512).map_err(|e| format!("UDP/{name}: {e}"))?;
        println!(
            "UDP  {name}: {ok}/1000 round trips verified, {:.0} us mean RTT",
            start.elapsed().as_secs_f64() * 1e6 / 1000.0
        );
        if ok < 990 {
            return Err(format!("UDP/{name}: only {ok}/1000 round trips"));
        }
    }

    let stats = engine.stats();
    engine.stop();
    if args.json {
        print_json(&stats);
    } else {
        println!(
            "engine: {} TCP sessions, {} UDP flows, {} packets up / {} down through the TUN, {} TUN reads (max batch {}), drops: {:?}",
            stats.tcp_sessions_total,
            stats.udp_flows_total,
            stats.packets_up,
            stats.packets_down,
            stats.tun_reads,
            stats.tun_read_max_batch,
            stats.drops
        );
    }
    println!("kerntun demo: ok (namespaces removed)");
    Ok(())
}

#[cfg(test)]
mod proxy_tests {
    use super::*;

    fn run_args(args: &[&str]) -> RunArgs {
        let argv = ["kerntun", "run"].into_iter().chain(args.iter().copied());
        match Cli::try_parse_from(argv).expect("arguments").cmd {
            Cmd::Run(a) => a,
            Cmd::Demo(_) => panic!("not run"),
        }
    }

    #[test]
    fn proxy_routes_everything_else_to_the_link() {
        let cfg = load_config(&run_args(&[
            "--proxy",
            "ss://YWVzLTI1Ni1nY206c2VjcmV0@ss.example.com:8388#t",
        ]))
        .expect("config");
        match &cfg.outbounds[PROXY] {
            OutboundConfig::Shadowsocks(s) => {
                assert_eq!(s.server.to_string(), "ss.example.com:8388");
                assert_eq!(s.password, "secret");
            }
            other => panic!("{other:?}"),
        }
        let last = cfg.rules.last().expect("a rule");
        assert_eq!(last.action, Action::from(PROXY));
        assert!(last.cidr.is_none() && last.ports.is_none(), "a catch-all");
        let e = load_config(&run_args(&["--proxy", "socks5://h"])).expect_err("no port");
        assert!(e.starts_with("--proxy: ") && e.contains("port"), "{e}");
    }
}
