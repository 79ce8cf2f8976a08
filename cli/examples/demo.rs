//! The demo: as root, build a client and a server namespace joined by veth,
//! start the engine on a TUN in the client namespace, move real TCP and UDP
//! traffic through it with byte-for-byte checks, print throughput and
//! statistics, and clean up (also on Ctrl-C and on failure).
//!
//! ```sh
//! cargo run --release -p kerntun-cli --example demo [-- --help]
//! ```
//!
//! An example of the CLI crate rather than a `kerntun` subcommand: the
//! namespaces, servers and checks come from the test kit
//! (`kerntun-testkit`), which the `kerntun` binary does not link.

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use kerntun::config::{Config, DriverMode, StackKind};
use kerntun::{Engine, TunSource};
use kerntun_testkit::servers::{self, Mode};
use kerntun_testkit::{Topology, client};

#[derive(Parser, Debug)]
#[command(
    name = "demo",
    about = "Network-namespace demo moving real traffic through the engine (root)"
)]
struct Args {
    /// MiB sent (and echoed back) over IPv4, split across the streams.
    #[arg(long, default_value_t = 512)]
    mib: usize,
    /// Parallel TCP streams.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// TCP stack: auto (the system stack here), system or smoltcp.
    #[arg(long, default_value = "auto", value_parser = stack)]
    stack: StackKind,
    /// TUN driver: auto, batch or per-packet.
    #[arg(long, default_value = "auto", value_parser = driver)]
    driver: DriverMode,
    /// TUN MTU (65535 is the desktop default).
    #[arg(long)]
    mtu: Option<u16>,
    /// Print the final statistics as JSON.
    #[arg(long)]
    json: bool,
}

/// The `--stack` values of `kerntun run`.
fn stack(s: &str) -> Result<StackKind, String> {
    match s {
        "auto" => Ok(StackKind::Auto),
        "system" => Ok(StackKind::System),
        "smoltcp" => Ok(StackKind::Smoltcp),
        _ => Err("auto, system or smoltcp".into()),
    }
}

/// The `--driver` values of `kerntun run`.
fn driver(s: &str) -> Result<DriverMode, String> {
    match s {
        "auto" => Ok(DriverMode::Auto),
        "batch" => Ok(DriverMode::Batch),
        "per-packet" => Ok(DriverMode::PerPacket),
        _ => Err("auto, batch or per-packet".into()),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match demo(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kerntun demo: {e}");
            ExitCode::FAILURE
        }
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

fn demo(args: Args) -> Result<(), String> {
    if !kerntun_testkit::have_root() {
        return Err(
            "needs root, /dev/net/tun and `ip netns` (it creates namespaces and a TUN)".into(),
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
    cfg.stack = args.stack;
    cfg.driver = args.driver;
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
        match serde_json::to_string(&stats) {
            Ok(line) => println!("{line}"),
            Err(e) => eprintln!("kerntun demo: stats: {e}"),
        }
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
