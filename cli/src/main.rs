//! `kerntun`: the desktop command line.
//!
//! * `kerntun run`: run the engine on a TUN device (created, or an inherited
//!   `--tun-fd`) from a TOML config plus flags, printing statistics as JSON
//!   lines until SIGINT, SIGTERM or SIGHUP (each stops the engine and prints
//!   the final statistics).
//!   With `--auto-route` (Linux) it also routes the host's traffic (and
//!   `--route-from` interfaces' forwarded traffic) into the TUN and removes
//!   that routing again on exit (autoroute.rs, docs/linux-routing.md).
//!
//! The namespace demo is an example of this crate (`examples/demo.rs`,
//! `cargo run --release -p kerntun-cli --example demo`): it is built on the
//! test kit, which this binary does not link.

#[cfg(target_os = "linux")]
mod autoroute;
mod controller;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
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
    Run(Box<RunArgs>),
    /// Moved out of this binary: says where the demo is now.
    #[command(hide = true)]
    Demo,
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

#[derive(clap::Args, Debug, Clone)]
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
    /// Serve the Clash-style HTTP API web dashboards use on this address
    /// (e.g. 127.0.0.1:9090; overrides the config's [controller] listen).
    /// See docs/controller.md.
    #[arg(long, value_name = "ADDR")]
    controller: Option<SocketAddr>,
    /// The controller's secret: requests need `Authorization: Bearer
    /// SECRET`. Required for an address other than loopback.
    #[arg(long, value_name = "SECRET")]
    secret: Option<String>,
}

/// glibc arenas the CLI's process keeps (`kerntun::limit_malloc_arenas`):
/// memory comes back after load (docs/reliability.md).
const MALLOC_ARENAS: u16 = 1;

fn main() -> ExitCode {
    kerntun::limit_malloc_arenas(MALLOC_ARENAS);
    let cli = Cli::parse();
    let logging = init_tracing();
    let r = match cli.cmd {
        Cmd::Run(a) => run(*a, logging),
        Cmd::Demo => Err(DEMO_MOVED.into()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kerntun: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What the logging setup hands to `run`: the log lines `/logs` streams,
/// the level the filter started at, and a way to change it.
struct Logging {
    hub: controller::LogHub,
    level: String,
    set_level: controller::LevelHandle,
}

/// stderr (filtered by `RUST_LOG`, `info` by default) and the controller's
/// log stream, behind one filter the controller may change at run time.
fn init_tracing() -> Logging {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let env = std::env::var("RUST_LOG").ok();
    let filter = env
        .as_deref()
        .and_then(|e| tracing_subscriber::EnvFilter::try_new(e).ok())
        .unwrap_or_else(|| "info".into());
    let level = match filter.max_level_hint().and_then(|l| l.into_level()) {
        Some(l) if l >= tracing::Level::DEBUG => "debug",
        Some(tracing::Level::INFO) => "info",
        Some(tracing::Level::WARN) => "warning",
        Some(_) => "error",
        None => "silent",
    };
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let hub = controller::LogHub::default();
    tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                // Colour only on a terminal: piped into a file or a log
                // collector, escape codes are noise.
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
        )
        .with(hub.layer())
        .init();
    let set_level: controller::LevelHandle = Arc::new(move |name: &str| {
        let directive = match name {
            "warning" => "warn",
            "silent" => "off",
            other => other,
        };
        let f = tracing_subscriber::EnvFilter::try_new(directive).map_err(|e| e.to_string())?;
        handle.reload(f).map_err(|e| e.to_string())
    });
    Logging {
        hub,
        level: level.into(),
        set_level,
    }
}

/// A config file's text: the engine's [`Config`] and the command's own
/// `[controller]` section, which the engine's config does not know.
pub(crate) fn parse_config(text: &str) -> Result<(Config, Option<controller::Section>), String> {
    let mut table: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
    let section = match table.remove("controller") {
        Some(v) => Some(
            v.try_into::<controller::Section>()
                .map_err(|e| format!("controller: {e}"))?,
        ),
        None => None,
    };
    // Without the section, parsed from the text itself so errors keep
    // their line and column.
    let cfg = match section {
        None => toml::from_str::<Config>(text).map_err(|e| e.to_string())?,
        Some(_) => toml::Value::Table(table)
            .try_into::<Config>()
            .map_err(|e| e.to_string())?,
    };
    Ok((cfg, section))
}

#[cfg(test)]
fn load_config(args: &RunArgs) -> Result<Config, String> {
    load_config_and_controller(args).map(|(cfg, _)| cfg)
}

/// The engine's config and the controller's settings, flags over the file.
fn load_config_and_controller(
    args: &RunArgs,
) -> Result<(Config, Option<controller::Settings>), String> {
    let (mut cfg, section) = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("reading {}: {e}", path.display()))?;
            parse_config(&text).map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => (Config::default(), None),
    };
    let settings = controller::Settings::resolve(args.controller, args.secret.clone(), section)?;
    apply_flags(&mut cfg, args)?;
    Ok((cfg, settings))
}

/// The command's flags over a config read from the file (at start, and for
/// each reload through the controller's `PUT /configs`), validated.
fn apply_flags(cfg: &mut Config, args: &RunArgs) -> Result<(), String> {
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
        add_proxy(cfg, url)?;
    }
    cfg.validate().map_err(|e| e.to_string())
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

fn run(args: RunArgs, logging: Logging) -> Result<(), String> {
    #[cfg_attr(not(target_os = "linux"), allow(unused_mut))]
    let (mut cfg, control) = load_config_and_controller(&args)?;
    // Bound before the engine starts: a taken port is an error, not an
    // engine running without its controller.
    let listener = control.as_ref().map(controller::bind).transpose()?;
    let st = controller::Static::from_config(&cfg);
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
    // Shared with the controller, which only reads; the stop below writes
    // once the controller has stopped.
    let engine = Arc::new(RwLock::new(engine));
    let read = |e: &Arc<RwLock<Engine>>| e.read().unwrap_or_else(|p| p.into_inner()).is_running();
    let mut ctl = match (control, listener) {
        (Some(settings), Some(listener)) => {
            let flags = args.clone();
            let parts = controller::Parts {
                prepare: Arc::new(move |mut cfg: kerntun::Config| {
                    apply_flags(&mut cfg, &flags).map(|()| cfg)
                }),
                settings,
                st,
                logs: logging.hub,
                level: logging.level,
                set_level: logging.set_level,
            };
            match controller::Controller::start(listener, engine.clone(), parts) {
                Ok(c) => Some(c),
                Err(e) => {
                    #[cfg(target_os = "linux")]
                    if let Some(r) = routing {
                        let _ = autoroute::AutoRoute::remove(r);
                    }
                    engine.write().unwrap_or_else(|p| p.into_inner()).stop();
                    return Err(e);
                }
            }
        }
        _ => None,
    };
    let interval = Duration::from_secs(args.stats_interval);
    let mut last = Instant::now();
    while !interrupted.load(Ordering::Relaxed) && read(&engine) {
        std::thread::sleep(Duration::from_millis(100));
        if !interval.is_zero() && last.elapsed() >= interval {
            last = Instant::now();
            print_json(&engine.read().unwrap_or_else(|p| p.into_inner()).stats());
        }
    }
    if let Some(c) = ctl.as_mut() {
        c.stop();
    }
    let mut engine = engine.write().unwrap_or_else(|p| p.into_inner());
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

/// What `kerntun demo` answers: the demo needs the test kit, which this
/// binary does not link.
const DEMO_MOVED: &str = "the demo is not part of the kerntun binary; run it from the \
     repository as root: cargo run --release -p kerntun-cli --example demo";

#[cfg(test)]
mod proxy_tests {
    use super::*;

    fn run_args(args: &[&str]) -> RunArgs {
        let argv = ["kerntun", "run"].into_iter().chain(args.iter().copied());
        match Cli::try_parse_from(argv).expect("arguments").cmd {
            Cmd::Run(a) => *a,
            Cmd::Demo => panic!("not run"),
        }
    }

    #[test]
    fn the_controller_section_is_the_commands() {
        let (cfg, section) = parse_config(
            "[tun]\nipv4 = \"198.18.0.1/16\"\n[controller]\nlisten = \"127.0.0.1:9090\"\nsecret = \"s\"\n",
        )
        .expect("parsed");
        assert!(cfg.tun.ipv4.is_some());
        let section = section.expect("a section");
        assert_eq!(
            section.listen,
            Some("127.0.0.1:9090".parse().expect("addr"))
        );
        assert_eq!(section.secret.as_deref(), Some("s"));
        let e = parse_config("[controller]\nport = 1\n").expect_err("unknown field");
        assert!(e.starts_with("controller: ") && e.contains("port"), "{e}");
        // Without the section, the engine's errors keep their line.
        let e = parse_config("[tun]\nmtu = \"x\"\n").expect_err("bad mtu");
        assert!(e.contains("line 2"), "{e}");
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
