//! `Engine::start`: building every part of an engine from its
//! configuration (everything that can fail on the configuration alone
//! first, then the device, the stack and the datagram path), then spawning
//! their tasks. Apart from `engine.rs`, which holds the handle the host
//! keeps and what it does while the engine runs (statistics, connections,
//! network changes, sleep, stop).

use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use parking_lot::Mutex;
use tokio::net::TcpListener;

use super::{Engine, Inner, Parts, StartError, StartOptions, groups, reload};
use crate::budget::{Admission, Budget, ByteBudget, Platform, Pressure, TcpStack};
use crate::config::{Config, ConfigError, DriverMode, StackKind, nat_address};
use crate::conns::Connections;
use crate::demux::Demux;
use crate::dispatch::{Current, Dispatcher, Routing};
use crate::driver::{self, DriverKind};
use crate::lifecycle::{EngineTask, Lifecycle, supervised};
use crate::nat::{NatConfig, WindowBudget};
use crate::outbound::{Outbounds, Protect, SocketFactory};
use crate::owner::{OwnerLookup, Owners};
use crate::stack::Stack;
use crate::stack::smoltcp::{SmoltcpStack, Sockets};
use crate::stack::system::{self, SystemStack};
use crate::stats::{Stats, WarnLimiter};
use crate::translate::{FamilyAddrs, StackAddrs};
use crate::tun::{Tun, TunSource};
use crate::udp::{UdpEnv, UdpTable};

thread_local! {
    /// The dispatcher guard of a runtime thread started with
    /// [`StartOptions::dispatch`]; dropped when the thread stops.
    static THREAD_DISPATCH: std::cell::RefCell<Option<tracing::dispatcher::DefaultGuard>> =
        const { std::cell::RefCell::new(None) };
}

impl Engine {
    /// Start an engine on the given device. Blocks until it is ready.
    ///
    /// `protect` is the host's hook for exempting outbound sockets from the VPN
    /// (Android); pass `None` where `direct.interface`/`direct.fwmark` or
    /// routing already keep outbound traffic off the TUN.
    pub fn start(
        config: Config,
        source: TunSource<'_>,
        protect: Option<Arc<dyn Protect>>,
    ) -> Result<Engine, StartError> {
        Self::start_with(config, source, protect, StartOptions::default())
    }

    /// [`Engine::start`] with embedding options (see [`StartOptions`]).
    pub fn start_with(
        config: Config,
        source: TunSource<'_>,
        protect: Option<Arc<dyn Protect>>,
        options: StartOptions,
    ) -> Result<Engine, StartError> {
        config.validate()?;
        let budget = Budget::resolve(&config.budget);
        let read_ring = config.tun.read_ring(budget.platform);
        let (stack, why) = choose_stack(config.stack, config.tun.include_all_networks);
        let workers = match config.workers {
            0 if budget.platform == Platform::Desktop => 2,
            0 => 1,
            n => n,
        };
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder
            .worker_threads(workers)
            .max_blocking_threads(2)
            .thread_name("kerntun")
            .enable_all();
        if let Some(dispatch) = options.dispatch.clone() {
            // Every thread of this engine's runtime logs to its own
            // dispatcher; the process-wide one stays the host's business.
            builder.on_thread_start(move || {
                THREAD_DISPATCH.with(|slot| {
                    *slot.borrow_mut() = Some(tracing::dispatcher::set_default(&dispatch));
                });
            });
            builder.on_thread_stop(|| THREAD_DISPATCH.with(|slot| drop(slot.borrow_mut().take())));
        }
        let rt = builder.build().map_err(StartError::Runtime)?;
        let owner = options.owner.clone();
        let assembled = rt.block_on(assemble(&config, source, protect, owner, budget, stack))?;
        let Assembled {
            parts,
            demux,
            listeners,
            driver,
        } = assembled;
        let _enter = rt.enter();
        // Every loop runs supervised: a panic or an early end fails the
        // engine with the reason (lifecycle.rs).
        let life = &parts.life;
        match &parts.stack {
            Stack::System(st) => {
                for (listener, fam) in listeners {
                    let accept = system::accept_loop(st.clone(), listener, fam);
                    rt.spawn(supervised(life.clone(), EngineTask::AcceptLoop, accept));
                }
            }
            Stack::Smoltcp(s) => {
                rt.spawn(supervised(life.clone(), EngineTask::Poller, s.poller()));
            }
        }
        let writes = driver::WriteOptions {
            coalesce: config.tun.coalesce,
            thin_acks: config.tun.ack_thinning,
        };
        let tun = parts.tun.clone();
        let read = driver::run(
            demux,
            tun,
            driver,
            life.clone(),
            parts.mtu,
            writes,
            read_ring,
        );
        rt.spawn(supervised(life.clone(), EngineTask::Driver, read));
        let probes = groups::spawn_probes(rt.handle(), &parts, &parts.routing.load().outbounds);
        parts.reload.set_probes(probes);
        // glibc keeps freed memory: trimmed once load stops.
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        rt.spawn(supervised(
            life.clone(),
            EngineTask::Housekeeping,
            crate::housekeeping::run(parts.stats.clone(), life.clone(), parts.stack.clone()),
        ));
        tracing::info!(
            "kerntun started on {} ({} stack: {why}; {} driver, mtu {})",
            parts.tun.name.as_deref().unwrap_or("fd"),
            parts.stack.name(),
            driver.as_str(),
            parts.mtu
        );
        drop(_enter);
        Ok(Engine {
            inner: Some(Inner {
                rt,
                parts,
                started: Instant::now(),
                driver,
            }),
            last: Mutex::new(None),
        })
    }
}

/// The engine's parts, wired, before their tasks are spawned.
struct Assembled {
    parts: Parts,
    /// Every packet's first stop, handed to the driver.
    demux: Demux,
    /// The system stack's kernel listeners (none for smoltcp).
    listeners: Vec<(TcpListener, FamilyAddrs)>,
    driver: DriverKind,
}

/// Who resolves proxy host names (docs/configuration.md, "Host names").
pub(super) fn proxy_resolvers(
    config: &Config,
) -> Result<crate::outbound::resolve::Resolvers, ConfigError> {
    let bootstrap = config
        .direct
        .parsed_bootstrap()
        .map_err(ConfigError::Direct)?;
    let upstreams = config.dns.parsed_upstreams().map_err(ConfigError::from)?;
    let timeout = std::time::Duration::from_millis(config.dns.timeout_ms.max(1));
    // Android's host reports the network's DNS servers (network_changed)
    // and there is no resolver file. iOS's path carries none, so a proxy
    // name there still needs a configured resolver, as on the desktop.
    Ok(match Budget::resolve(&config.budget).platform {
        Platform::Android => {
            crate::outbound::resolve::Resolvers::from_network(&bootstrap, &upstreams, timeout)
        }
        Platform::Ios | Platform::Desktop => {
            crate::outbound::resolve::Resolvers::pick(&bootstrap, &upstreams, timeout)
        }
    })
}

/// Build every part of an engine: everything that can fail on the
/// configuration alone (rules with their domain lists, proxy keys, DNS
/// upstreams) before any descriptor is opened, then the device (addresses
/// verified), the stack and the datagram path.
async fn assemble(
    config: &Config,
    source: TunSource<'_>,
    protect: Option<Arc<dyn Protect>>,
    owner: Option<Arc<dyn OwnerLookup>>,
    budget: Budget,
    stack: StackKind,
) -> Result<Assembled, StartError> {
    let factory = SocketFactory::new(&config.direct, protect);
    let outbounds = Arc::new(
        Outbounds::new(
            &config.outbounds,
            &config.groups,
            &config.rules,
            &config.relay,
            factory.clone(),
            budget.relay_buffer,
            proxy_resolvers(config)?,
        )
        .map_err(ConfigError::from)?,
    );
    let stats = Arc::new(Stats::with_outbounds(outbounds.counters()));
    let nets: Vec<IpNet> = config.tun.nets();
    // Every memory budget (admission too) reads the one pressure the host
    // reports through `set_memory_pressure`.
    let pressure = Arc::new(Pressure::default());
    let bytes = |normal| Arc::new(ByteBudget::new(normal, pressure.clone()));
    let mem = budget.memory;
    let dns_budgets = reload::DnsBudgets {
        cache: bytes(mem.dns_cache),
        in_flight: bytes(mem.dns_in_flight),
        fake: bytes(mem.fake_ip),
    };
    let dns = crate::dns::Dns::new(
        &config.dns,
        &nets,
        outbounds.clone(),
        dns_budgets.cache.clone(),
        dns_budgets.in_flight.clone(),
        dns_budgets.fake.clone(),
    )
    .map_err(ConfigError::from)?;
    let offload = config.driver != DriverMode::PerPacket;
    let tun = Tun::open(&config.tun, offload, source).map_err(StartError::Tun)?;
    tun.verify_addresses(&nets)
        .await
        .map_err(StartError::Address)?;
    let tun = Arc::new(tun);
    let driver = match (config.driver, tun.supports_batch()) {
        (DriverMode::PerPacket, _) | (DriverMode::Auto, false) => DriverKind::PerPacket,
        (DriverMode::Auto | DriverMode::Batch, true) => DriverKind::Batch,
        (DriverMode::Batch, false) => {
            tracing::warn!("driver = batch but the device has no offload; using per-packet");
            DriverKind::PerPacket
        }
    };
    let life = Arc::new(Lifecycle::default());
    let tcp_stack = match stack {
        StackKind::Smoltcp => TcpStack::Smoltcp,
        StackKind::System | StackKind::Auto => TcpStack::System,
    };
    let sessions = fit_sessions_to_descriptors(&budget, tcp_stack);
    let admission = Arc::new(Admission::with_pressure(sessions, pressure.clone()));
    let conns = Arc::new(Connections::default());
    let owners = match owner {
        Some(lookup) => Some(Arc::new(
            Owners::start(lookup, stats.clone()).map_err(StartError::Runtime)?,
        )),
        None => None,
    };
    let relay = outbounds.relay;
    let routing = Arc::new(Current::from_pointee(Routing {
        outbounds,
        dns,
        sniff: config.sniff.clone(),
    }));
    let d = Arc::new(Dispatcher {
        routing: routing.clone(),
        relay,
        admission: admission.clone(),
        relay_pool: bytes(mem.relay),
        stats: stats.clone(),
        warn: WarnLimiter::new(Duration::from_secs(5)),
        life: life.clone(),
        conns: conns.clone(),
        owners,
    });
    let tcp_idle = Duration::from_secs(config.timeouts.tcp_idle_s.max(1));
    let linger = Duration::from_secs(config.timeouts.tcp_linger_s);
    let mut listeners = Vec::new();
    let stack = match stack {
        StackKind::Smoltcp => {
            // No kernel listener: smoltcp answers for every address itself.
            let smol = Sockets::new(
                &nets,
                config.tun.mtu,
                budget.smoltcp_buffer,
                tcp_idle,
                linger,
                budget.tcp_flows,
            )
            .with_loans(
                crate::budget::SMOLTCP_SMALL_RING,
                budget.smoltcp_full_rings(),
                Some(pressure.clone()),
            )
            .with_half_open(crate::stack::HALF_OPEN_MAX.min(sessions[0] / 2));
            // Where the system stack would clamp windows (a short TUN
            // queue, per-packet), the sockets on full receive rings share
            // the queue's packets of window (half of it cost 17 % of the
            // 64-stream upload: docs/notes.md, "smoltcp: a window budget").
            let queue = tun.queue_packets(&config.tun);
            let smol = match config
                .tun
                .clamps_windows(driver == DriverKind::PerPacket, queue)
            {
                true => {
                    let packets = usize::try_from(queue).unwrap_or(usize::MAX);
                    let bytes = packets.saturating_mul(usize::from(config.tun.mtu));
                    tracing::info!(
                        "TCP windows on full smoltcp rings share {} KiB (the TUN's {queue} queued packets)",
                        bytes / 1024
                    );
                    smol.with_window_budget(bytes)
                }
                false => smol,
            };
            let families = (config.tun.ipv4.is_some(), config.tun.ipv6.is_some());
            Stack::Smoltcp(SmoltcpStack::new(smol, d.clone(), tun.clone(), families))
        }
        StackKind::System | StackKind::Auto => {
            let mut addrs = StackAddrs::default();
            // Only Darwin binds by index (and needs it).
            let tun_index = if cfg!(apple) { tun.if_index() } else { None };
            let on = system::listen_on(cfg!(apple), tun.name.as_deref(), tun_index)
                .map_err(|system::NoTunIndex| StartError::TunIndex)?;
            if on == system::ListenOn::Any {
                tracing::warn!(
                    "the TUN's name is unknown: the kernel listener is not bound to it (accepts are still checked against the NAT address)"
                );
            }
            for net in &nets {
                let (listener, fam) = bind_family(*net, budget.backlog, on)?;
                match fam.gateway {
                    IpAddr::V4(_) => addrs.v4 = Some(fam),
                    IpAddr::V6(_) => addrs.v6 = Some(fam),
                }
                listeners.push((listener, fam));
            }
            let nat_cfg = NatConfig {
                max_entries: budget.tcp_flows,
                idle_timeout: tcp_idle,
                linger,
                ..NatConfig::default()
            };
            let queue = tun.queue_packets(&config.tun);
            let per_packet = driver == DriverKind::PerPacket;
            let window = config.tun.clamps_windows(per_packet, queue).then(|| {
                let budget = WindowBudget {
                    queue_packets: queue,
                    // A full IPv4 segment's payload: the MTU less 20 + 20
                    // header bytes (IPv6 segments carry 20 less; the
                    // clamp is a share of packets, not exact bytes).
                    mss: u32::from(config.tun.mtu).saturating_sub(40).max(536),
                };
                tracing::info!(
                    "TCP windows clamped to a share of the TUN's {} queued packets",
                    budget.queue_packets
                );
                budget
            });
            let st = SystemStack::new(
                d.clone(),
                tun.clone(),
                nat_cfg,
                addrs,
                window,
                Instant::now(),
            );
            Stack::System(Arc::new(st))
        }
    };
    let udp = UdpTable::new(
        Arc::new(UdpEnv {
            d,
            tun: tun.clone(),
            factory: factory.clone(),
            mtu: config.tun.mtu,
            max_flows: budget.udp_flows,
            idle: config.udp_idle(),
            unreplied: config.udp_unreplied(),
            queues: bytes(mem.udp_queues),
            nat: config.direct.udp_nat,
            held_answered: Default::default(),
        }),
        Instant::now(),
    );
    let gateways = (
        config.tun.ipv4.map(|n| IpAddr::V4(n.addr())),
        config.tun.ipv6.map(|n| IpAddr::V6(n.addr())),
    );
    let demux = Demux::new(stack.clone(), udp, gateways, stats.clone());
    Ok(Assembled {
        parts: Parts {
            life,
            stats,
            admission,
            routing,
            reload: Arc::new(reload::State::new(config.clone(), budget, dns_budgets)),
            factory,
            stack,
            tun,
            mtu: config.tun.mtu,
            conns,
        },
        demux,
        listeners,
        driver,
    })
}

/// Bind the system stack's kernel listener for the family of `net` on its
/// gateway address; the family's addresses with the port it got.
fn bind_family(
    net: IpNet,
    backlog: u32,
    on: system::ListenOn<'_>,
) -> Result<(TcpListener, FamilyAddrs), StartError> {
    let gateway = net.addr();
    let nat = nat_address(net).ok_or(ConfigError::NoRoomForNat {
        field: if gateway.is_ipv4() { "ipv4" } else { "ipv6" },
        net,
    })?;
    let failed = |source: io::Error| StartError::Listener {
        addr: gateway,
        source,
    };
    let listener = system::bind_listener(gateway, backlog, on).map_err(failed)?;
    let port = listener.local_addr().map_err(failed)?.port();
    let fam = FamilyAddrs {
        gateway,
        nat,
        listen_port: port,
    };
    Ok((listener, fam))
}

/// The stack to run and why (logged at start). `auto`:
/// * the system stack wherever a kernel listener can see the tunnel's
///   connections, desktop included: kernel TCP costs no per-connection
///   buffers, splices direct traffic, and measured ahead of smoltcp with
///   MTU-sized segments and many connections (docs/benchmarks.md);
/// * smoltcp where it cannot (`tun.include_all_networks`, iOS
///   `includeAllNetworks`); an explicit `system` there never gets here,
///   `validate` refuses it.
fn choose_stack(kind: StackKind, include_all_networks: bool) -> (StackKind, &'static str) {
    match kind {
        StackKind::System => (StackKind::System, "configured"),
        StackKind::Smoltcp => (StackKind::Smoltcp, "configured"),
        StackKind::Auto if include_all_networks => (
            StackKind::Smoltcp,
            "auto with includeAllNetworks: the kernel listener of the system stack would never see the tunnel's SYNs",
        ),
        StackKind::Auto => (
            StackKind::System,
            "auto: kernel TCP costs no per-connection buffers and splices direct traffic (stack = \"smoltcp\" for userspace TCP)",
        ),
    }
}

/// The admission limits of the budget, within the descriptors the process
/// may open: the soft `RLIMIT_NOFILE` is raised to what the sessions and
/// UDP flows need (iOS starts extensions at 256, Android apps at 32768 on
/// recent releases), and where the hard limit stops it, admission is cut
/// to fit (logged), so a session is refused with an RST instead of failing
/// at accept or connect with EMFILE.
fn fit_sessions_to_descriptors(budget: &Budget, stack: TcpStack) -> [usize; 3] {
    let sessions = budget.tcp_sessions(stack);
    let want = crate::budget::descriptors_needed(sessions[0], stack, budget.udp_flows);
    match crate::sys::raise_nofile(want as u64) {
        Ok(nofile) if nofile >= want as u64 => sessions,
        Ok(nofile) => {
            let nofile = usize::try_from(nofile).unwrap_or(usize::MAX);
            let fit = crate::budget::fit_descriptors(sessions, stack, budget.udp_flows, nofile);
            tracing::warn!(
                "RLIMIT_NOFILE {nofile} (hard limit) holds {} TCP sessions, not {}: admission cut to fit",
                fit[0],
                sessions[0]
            );
            fit
        }
        Err(e) => {
            tracing::warn!(
                "RLIMIT_NOFILE: {e}; admission left at {} sessions",
                sessions[0]
            );
            sessions
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_choice_follows_config_then_the_listener() {
        for all in [false, true] {
            // An explicit choice is kept (validate refuses system + all).
            assert_eq!(choose_stack(StackKind::Smoltcp, all).0, StackKind::Smoltcp);
            assert_eq!(choose_stack(StackKind::System, all).1, "configured");
        }
        assert_eq!(choose_stack(StackKind::System, false).0, StackKind::System);
        // includeAllNetworks forbids the kernel listener.
        let (auto, why) = choose_stack(StackKind::Auto, true);
        assert_eq!(auto, StackKind::Smoltcp);
        assert!(why.contains("includeAllNetworks"), "{why}");
        // Everywhere else auto is the system stack, desktop included.
        let (auto, why) = choose_stack(StackKind::Auto, false);
        assert_eq!(auto, StackKind::System);
        assert!(
            why.starts_with("auto: kernel TCP"),
            "the log line says why: {why}"
        );
    }
}
