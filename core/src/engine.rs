//! Engine lifecycle: the synchronous API the CLI and the FFI wrap.
//!
//! An [`Engine`] owns its own tokio runtime, so several engines can run in one
//! process and the host never needs an async context. `start` returns only once
//! the device's addresses are verified and the kernel listeners are bound
//! (ready); `stop` is bounded in time, idempotent, and releases every
//! descriptor, task and thread; dropping the engine stops it.

use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use parking_lot::Mutex;
use tokio::runtime::Runtime;

use crate::budget::{Admission, Budget, MemoryPressure, Platform};
use crate::config::{Config, ConfigError, DriverMode, StackKind, nat_address};
use crate::driver::{self, DriverKind};
use crate::nat::{NatConfig, NatTable, SystemClock};
use crate::outbound::{Outbounds, Protect, SocketFactory};
use crate::smol::{self, SmolStack};
use crate::stats::{NatSnapshot, Stats, StatsSnapshot, WarnLimiter};
use crate::system::{self, FamilyAddrs, Shared};
use crate::tun::{Tun, TunSource};

/// How long `stop` waits for tasks and worker threads before giving up on them.
const STOP_TIMEOUT: Duration = Duration::from_secs(3);
/// How long `stop` lets sessions reset their connections before closing the device.
const DRAIN_TIMEOUT: Duration = Duration::from_millis(500);

/// Why the engine did not start. Nothing is left open when `start` fails.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration was refused before anything was opened.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// The engine's runtime could not be created (threads, epoll).
    #[error("creating the engine runtime: {0}")]
    Runtime(io::Error),
    /// The TUN device could not be created or adopted.
    #[error("opening the TUN device: {0}")]
    Tun(io::Error),
    /// The device does not carry the configured gateway address(es).
    #[error("verifying the TUN addresses: {0}")]
    Address(io::Error),
    /// The kernel listener could not be bound on the gateway.
    #[error("binding the kernel listener on {addr}: {source}")]
    Listener { addr: IpAddr, source: io::Error },
}

/// Options for embedding the engine that are not configuration (the FFI
/// uses them; the CLI does not).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct StartOptions {
    /// Log through this dispatcher on every thread of the engine's runtime,
    /// instead of the process-wide default: lets several engines in one
    /// process log to different sinks without installing a global logger.
    pub dispatch: Option<tracing::Dispatch>,
}

impl StartOptions {
    /// Options with this engine's own log dispatcher.
    pub fn with_dispatch(dispatch: tracing::Dispatch) -> Self {
        Self {
            dispatch: Some(dispatch),
        }
    }
}

thread_local! {
    /// The dispatcher guard of a runtime thread started with
    /// [`StartOptions::dispatch`]; dropped when the thread stops.
    static THREAD_DISPATCH: std::cell::RefCell<Option<tracing::dispatcher::DefaultGuard>> =
        const { std::cell::RefCell::new(None) };
}

/// A running engine.
#[derive(Debug)]
pub struct Engine {
    inner: Option<Inner>,
    /// Kept after stop so `stats()` still answers.
    last: Mutex<Option<StatsSnapshot>>,
}

#[derive(Debug)]
struct Inner {
    rt: Runtime,
    shared: Arc<Shared>,
    started: Instant,
    driver: DriverKind,
}

impl Engine {
    /// Start an engine on the given device. Blocks until it is ready.
    ///
    /// `protect` is the host's hook for exempting outbound sockets from the VPN
    /// (Android); pass `None` where `direct.interface`/`direct.fwmark` or
    /// routing already keep outbound traffic off the TUN.
    pub fn start(
        config: Config,
        source: TunSource,
        protect: Option<Arc<dyn Protect>>,
    ) -> Result<Engine, StartError> {
        Self::start_with(config, source, protect, StartOptions::default())
    }

    /// [`Engine::start`] with embedding options (see [`StartOptions`]).
    pub fn start_with(
        config: Config,
        source: TunSource,
        protect: Option<Arc<dyn Protect>>,
        options: StartOptions,
    ) -> Result<Engine, StartError> {
        config.validate()?;
        let budget = Budget::resolve(&config.budget);
        let (stack, why) = choose_stack(
            config.stack,
            budget.platform,
            config.tun.include_all_networks,
        );
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
        let (shared, listeners, driver) =
            rt.block_on(prepare(&config, source, protect, budget, stack))?;
        let _enter = rt.enter();
        for (listener, fam) in listeners {
            rt.spawn(system::accept_loop(shared.clone(), listener, fam));
        }
        if let Some(smol) = &shared.smol {
            rt.spawn(smol.clone().run_poller(shared.clone()));
        }
        rt.spawn(driver::run(shared.clone(), driver));
        tracing::info!(
            "kerntun started on {} ({} stack: {why}; {} driver, mtu {})",
            shared.tun.name.as_deref().unwrap_or("fd"),
            stack_name(stack),
            driver.as_str(),
            shared.mtu
        );
        drop(_enter);
        Ok(Engine {
            inner: Some(Inner {
                rt,
                shared,
                started: Instant::now(),
                driver,
            }),
            last: Mutex::new(None),
        })
    }

    /// A snapshot of every counter.
    pub fn stats(&self) -> StatsSnapshot {
        match &self.inner {
            Some(inner) => snapshot(inner),
            None => self.last.lock().clone().unwrap_or_default(),
        }
    }

    /// Forward the host's memory-pressure level: admission of new TCP
    /// sessions follows it; sessions already running keep their permits.
    pub fn set_memory_pressure(&self, level: MemoryPressure) {
        if let Some(inner) = &self.inner {
            inner.shared.admission.set_pressure(level);
            tracing::info!(
                "memory pressure {level:?}: admission limit {}",
                inner.shared.admission.limit()
            );
        }
    }

    /// Diagnostics: one line per smoltcp socket (state, queues, windows,
    /// timers) and the poller's deadline; empty with the system stack.
    #[doc(hidden)]
    pub fn debug_smol(&self) -> Vec<String> {
        self.inner
            .as_ref()
            .and_then(|i| i.shared.smol.as_ref())
            .map(|s| s.debug_sockets())
            .unwrap_or_default()
    }

    /// Whether the engine is running (not stopped and no fatal error).
    pub fn is_running(&self) -> bool {
        self.inner
            .as_ref()
            .is_some_and(|i| *i.shared.stop.borrow() == system::RUNNING)
    }

    /// The fatal error that stopped the engine's loops, if any.
    pub fn error(&self) -> Option<String> {
        self.inner
            .as_ref()
            .and_then(|i| i.shared.fatal.lock().clone())
    }

    /// The TUN interface name, when known.
    pub fn tun_name(&self) -> Option<String> {
        self.inner.as_ref().and_then(|i| i.shared.tun.name.clone())
    }

    /// The kernel listeners' addresses (gateway and port per family); empty
    /// with the smoltcp stack, which binds none.
    pub fn listen_addrs(&self) -> Vec<std::net::SocketAddr> {
        let Some(inner) = &self.inner else {
            return Vec::new();
        };
        [inner.shared.v4, inner.shared.v6]
            .into_iter()
            .flatten()
            // Port 0: no kernel listener (the smoltcp stack).
            .filter(|f| f.listen_port != 0)
            .map(|f| std::net::SocketAddr::new(f.gateway, f.listen_port))
            .collect()
    }

    /// Stop: end every loop and session, close the device and the listeners,
    /// join the runtime's threads (bounded by a timeout). Safe to call twice.
    pub fn stop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        // Drain first: sessions reset their connections while the driver still
        // runs, so apps see an RST at once instead of waiting for a timeout on
        // a vanished device. Bounded by DRAIN_TIMEOUT.
        inner.shared.stop.send_if_modified(|p| {
            let was = *p;
            *p = (*p).max(system::DRAINING);
            was != *p
        });
        let in_runtime = tokio::runtime::Handle::try_current().is_ok();
        if !in_runtime {
            let deadline = Instant::now() + DRAIN_TIMEOUT;
            while inner
                .shared
                .stats
                .tcp_sessions_active
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(5));
            }
            // Let the driver translate the kernel's RSTs (and the apps' answers
            // to them, RFC 5961 challenge ACKs included) until the device has
            // been quiet for 20 ms.
            loop {
                let seen = inner
                    .shared
                    .stats
                    .tun_read_packets
                    .load(std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
                let now_seen = inner
                    .shared
                    .stats
                    .tun_read_packets
                    .load(std::sync::atomic::Ordering::Relaxed);
                if now_seen == seen || Instant::now() >= deadline {
                    break;
                }
            }
        }
        *self.last.lock() = Some(snapshot(&inner));
        inner.shared.stop.send_replace(system::STOPPED);
        let Inner { rt, shared, .. } = inner;
        if in_runtime {
            // Called from inside another runtime: blocking here would panic.
            rt.shutdown_background();
        } else {
            rt.shutdown_timeout(STOP_TIMEOUT);
        }
        drop(shared);
        tracing::info!("kerntun stopped");
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Who resolves proxy host names (docs/configuration.md, "Host names").
fn proxy_resolvers(config: &Config) -> Result<crate::outbound::resolve::Resolvers, ConfigError> {
    let bootstrap = config
        .direct
        .parsed_bootstrap()
        .map_err(ConfigError::Direct)?;
    let upstreams = config.dns.parsed_upstreams().map_err(ConfigError::from)?;
    Ok(crate::outbound::resolve::Resolvers::pick(
        &bootstrap,
        &upstreams,
        std::time::Duration::from_millis(config.dns.timeout_ms.max(1)),
    ))
}

type Prepared = (
    Arc<Shared>,
    Vec<(tokio::net::TcpListener, FamilyAddrs)>,
    DriverKind,
);

async fn prepare(
    config: &Config,
    source: TunSource,
    protect: Option<Arc<dyn Protect>>,
    budget: Budget,
    stack: StackKind,
) -> Result<Prepared, StartError> {
    // Everything that can fail on the configuration alone (rules with their
    // domain lists, proxy keys, DNS upstreams) comes before any descriptor
    // is opened.
    let factory = SocketFactory::new(&config.direct, protect);
    let outbounds = Arc::new(
        Outbounds::new(
            &config.outbounds,
            &config.rules,
            &config.relay,
            factory.clone(),
            budget.relay_buffer,
            proxy_resolvers(config)?,
        )
        .map_err(ConfigError::from)?,
    );
    let stats = Stats::with_outbounds(outbounds.names());
    let nets: Vec<IpNet> = config.tun.nets();
    let dns =
        crate::dns::Dns::new(&config.dns, &nets, outbounds.clone()).map_err(ConfigError::from)?;
    let offload = config.driver != DriverMode::PerPacket;
    let tun = Tun::open(&config.tun, offload, source).map_err(StartError::Tun)?;
    tun.verify_addresses(&nets)
        .await
        .map_err(StartError::Address)?;
    let tun_index = tun.if_index();
    let mut listeners = Vec::new();
    let mut fams = [None, None];
    for net in &nets {
        let gateway = net.addr();
        let nat = nat_address(*net).ok_or(ConfigError::NoRoomForNat {
            field: if gateway.is_ipv4() { "ipv4" } else { "ipv6" },
            net: *net,
        })?;
        if stack == StackKind::Smoltcp {
            // No kernel listener: smoltcp answers for every address itself.
            fams[usize::from(gateway.is_ipv6())] = Some(FamilyAddrs {
                gateway,
                nat,
                listen_port: 0,
            });
            continue;
        }
        let listener =
            system::bind_listener(gateway, budget.backlog, tun_index).map_err(|source| {
                StartError::Listener {
                    addr: gateway,
                    source,
                }
            })?;
        let port = listener
            .local_addr()
            .map_err(|source| StartError::Listener {
                addr: gateway,
                source,
            })?
            .port();
        let fam = FamilyAddrs {
            gateway,
            nat,
            listen_port: port,
        };
        fams[usize::from(gateway.is_ipv6())] = Some(fam);
        listeners.push((listener, fam));
    }
    let driver = match (config.driver, tun.supports_batch()) {
        (DriverMode::PerPacket, _) | (DriverMode::Auto, false) => DriverKind::PerPacket,
        (DriverMode::Auto | DriverMode::Batch, true) => DriverKind::Batch,
        (DriverMode::Batch, false) => {
            tracing::warn!("driver = batch but the device has no offload; using per-packet");
            DriverKind::PerPacket
        }
    };
    let nat_cfg = NatConfig {
        max_entries: budget.nat_entries,
        idle_timeout: Duration::from_secs(config.timeouts.tcp_idle_s.max(1)),
        linger: Duration::from_secs(config.timeouts.tcp_linger_s),
        ..NatConfig::default()
    };
    let half_open_timeout = nat_cfg.half_open_timeout;
    let (stop, _) = tokio::sync::watch::channel(system::RUNNING);
    let smol = (stack == StackKind::Smoltcp).then(|| {
        Arc::new(SmolStack::new(
            &nets,
            config.tun.mtu,
            smol::socket_buffer(budget.platform),
            Duration::from_secs(config.timeouts.tcp_idle_s.max(1)),
            Duration::from_secs(config.timeouts.tcp_linger_s),
            budget.nat_entries,
        ))
    });
    let shared = Arc::new(Shared {
        nat: Arc::new(NatTable::new(nat_cfg, Arc::new(SystemClock))),
        factory,
        outbounds,
        admission: Arc::new(Admission::new(budget.tcp_sessions)),
        budget,
        stats,
        warn: WarnLimiter::new(Duration::from_secs(5)),
        pending: Mutex::new(Default::default()),
        v4: fams[0],
        v6: fams[1],
        mtu: config.tun.mtu,
        udp_idle: config.udp_idle(),
        half_open_timeout,
        stop,
        fatal: Mutex::new(None),
        tun,
        smol,
        dns,
        sniff: config.sniff.clone(),
    });
    Ok((shared, listeners, driver))
}

/// The stack to run and why (logged at start). `auto`:
/// * smoltcp wherever the kernel listener cannot receive the tunnel's
///   connections (`tun.include_all_networks`, iOS `includeAllNetworks`);
///   an explicit `system` there never gets here, `validate` refuses it;
/// * the system stack on iOS and Android, where kernel TCP costs no
///   per-connection socket buffers inside a tight memory budget;
/// * smoltcp on desktop (DESIGN.md part 7): memory is not the constraint
///   there, and it needs no NAT address routed back to a kernel listener, so
///   it runs on any TUN whatever the host's routing and firewall. The system
///   stack (with the splice relay) stays one `stack = "system"` away.
fn choose_stack(
    kind: StackKind,
    platform: Platform,
    include_all_networks: bool,
) -> (StackKind, &'static str) {
    match kind {
        StackKind::System => (StackKind::System, "configured"),
        StackKind::Smoltcp => (StackKind::Smoltcp, "configured"),
        StackKind::Auto if include_all_networks => (
            StackKind::Smoltcp,
            "auto with includeAllNetworks: the kernel listener of the system stack would never see the tunnel's SYNs",
        ),
        StackKind::Auto => match platform {
            Platform::Ios | Platform::Android => (
                StackKind::System,
                "auto on mobile: kernel TCP costs no per-connection buffers",
            ),
            Platform::Desktop => (
                StackKind::Smoltcp,
                "auto on desktop: userspace TCP needs no NAT address or kernel listener (stack = \"system\" for kernel TCP and splice)",
            ),
        },
    }
}

fn stack_name(kind: StackKind) -> &'static str {
    match kind {
        StackKind::Smoltcp => "smoltcp",
        _ => "system",
    }
}

fn snapshot(inner: &Inner) -> StatsSnapshot {
    let sh = &inner.shared;
    let mut s = sh.stats.snapshot();
    let c = sh.nat.counts();
    s.nat = NatSnapshot {
        half_open: c.half_open as u64,
        active: c.active as u64,
        closing: c.closing as u64,
    };
    if let Some(smol) = &sh.smol {
        // smoltcp has no NAT table: its sockets (open or closing) and the
        // connects in flight fill the same slots.
        let (sockets, connecting) = smol.counts();
        s.nat = NatSnapshot {
            half_open: connecting as u64,
            active: sockets as u64,
            closing: 0,
        };
    }
    s.stack = if sh.smol.is_some() {
        stack_name(StackKind::Smoltcp)
    } else {
        stack_name(StackKind::System)
    };
    s.driver = inner.driver.as_str();
    s.memory_pressure = match sh.admission.pressure() {
        MemoryPressure::Normal => "normal",
        MemoryPressure::Elevated => "elevated",
        MemoryPressure::Critical => "critical",
    };
    s.admission_limit = sh.admission.limit() as u64;
    s.uptime_ms = inner.started.elapsed().as_millis() as u64;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stack_choice_follows_config_then_platform() {
        for p in [Platform::Ios, Platform::Android, Platform::Desktop] {
            for all in [false, true] {
                // An explicit choice is kept (validate refuses system + all).
                assert_eq!(
                    choose_stack(StackKind::Smoltcp, p, all).0,
                    StackKind::Smoltcp
                );
                assert_eq!(choose_stack(StackKind::System, p, all).1, "configured");
            }
            assert_eq!(
                choose_stack(StackKind::System, p, false).0,
                StackKind::System
            );
            // includeAllNetworks forbids the kernel listener on any platform.
            let (auto, why) = choose_stack(StackKind::Auto, p, true);
            assert_eq!(auto, StackKind::Smoltcp, "{p:?}");
            assert!(why.contains("includeAllNetworks"), "{why}");
        }
        let mobile = [Platform::Ios, Platform::Android];
        for p in mobile {
            let (auto, why) = choose_stack(StackKind::Auto, p, false);
            assert_eq!(auto, StackKind::System, "{p:?}");
            assert!(
                why.starts_with("auto on mobile"),
                "the log line says why: {why}"
            );
        }
        let (auto, why) = choose_stack(StackKind::Auto, Platform::Desktop, false);
        assert_eq!(auto, StackKind::Smoltcp);
        assert!(
            why.starts_with("auto on desktop"),
            "the log line says why: {why}"
        );
        assert_eq!(stack_name(StackKind::Smoltcp), "smoltcp");
        assert_eq!(stack_name(StackKind::System), "system");
    }
}
