//! Engine lifecycle: the synchronous API the CLI and the FFI wrap.
//!
//! An [`Engine`] owns its own tokio runtime, so several engines can run in one
//! process and the host never needs an async context. `start` returns only once
//! the device's addresses are verified and the kernel listeners are bound
//! (ready); `stop` is bounded in time, idempotent, and releases every
//! descriptor, task and thread; dropping the engine stops it.

use crate::conns::{Connections, LIST_CAP, Listing};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::runtime::Runtime;

use crate::budget::{Admission, MemoryPressure};
use crate::config::ConfigError;
use crate::dispatch::Current;
use crate::driver::DriverKind;
use crate::lifecycle::{Lifecycle, Phase};
use crate::network::{Addresses, NetworkError, NetworkInfo};
use crate::outbound::SocketFactory;
use crate::outbound::nat64::Begin;
use crate::owner::OwnerLookup;
use crate::stack::Stack;
use crate::stats::{Stats, StatsSnapshot};
use crate::tun::Tun;

mod groups;
mod reload;
mod start;
pub use groups::{LatencyError, SelectionError};
pub use reload::{ReloadError, ReloadReport};

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
    /// Darwin: the utun's interface index could not be found, so the system
    /// stack's kernel listener cannot be bound to the utun (IP_BOUND_IF),
    /// and an unbound listener would never receive the tunnel's connections.
    #[error(
        "the TUN's interface index is unknown, so the system stack's listener cannot be bound to it and would never receive a connection; stack = \"smoltcp\" needs no listener"
    )]
    TunIndex,
}

/// Why [`Engine::sleep`] or [`Engine::wake`] did nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SleepError {
    /// The engine is stopped or failed: it has no timers to pause.
    #[error("the engine is not running")]
    NotRunning,
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
    /// The host's lookup of the app that owns a flow (Android), for the
    /// connection list and `package` / `uid` rules (`owner.rs`); `None`:
    /// no owner is ever known, and those rules never match.
    pub owner: Option<Arc<dyn OwnerLookup>>,
}

impl StartOptions {
    /// Options with this engine's own log dispatcher.
    pub fn with_dispatch(dispatch: tracing::Dispatch) -> Self {
        Self {
            dispatch: Some(dispatch),
            owner: None,
        }
    }

    /// The same options with the host's owner lookup.
    pub fn with_owner(self, owner: Arc<dyn OwnerLookup>) -> Self {
        Self {
            owner: Some(owner),
            ..self
        }
    }
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
    parts: Parts,
    started: Instant,
    driver: DriverKind,
}

/// What the engine's handle keeps of the running parts: enough to stop them
/// and to report on them.
#[derive(Debug, Clone)]
struct Parts {
    life: Arc<Lifecycle>,
    stats: Arc<Stats>,
    admission: Arc<Admission>,
    /// Rules, outbounds, DNS and sniffing, as new flows read them
    /// (`dispatch::Current`); `Engine::reload` replaces them. The DNS
    /// service is trimmed when the host raises the memory pressure, and
    /// its answers are forgotten when the network moves.
    routing: Arc<Current>,
    /// Rebound, and its proxies' names forgotten, when the network moves.
    factory: SocketFactory,
    /// What a reload needs to build a new routing generation and to tell
    /// what it may not change.
    reload: Arc<reload::State>,
    stack: Stack,
    tun: Arc<Tun>,
    mtu: u16,
    /// The live connection list (`conns.rs`).
    conns: Arc<Connections>,
}

impl Engine {
    /// A snapshot of every counter.
    pub fn stats(&self) -> StatsSnapshot {
        match &self.inner {
            Some(inner) => snapshot(inner),
            None => self.last.lock().clone().unwrap_or_default(),
        }
    }

    /// The live connections: one record per relayed or sniffed TCP
    /// connection (both stacks) and per UDP flow, at most [`crate::conns::LIST_CAP`]
    /// (`truncated` says when there were more). Empty once stopped.
    pub fn connections(&self) -> Listing {
        self.connections_up_to(LIST_CAP)
    }

    /// The live connections as [`Engine::connections`] lists them, at most
    /// `cap` (capped at [`crate::conns::LIST_CAP`]): a caller that shows a
    /// page copies only that page.
    pub fn connections_up_to(&self, cap: usize) -> Listing {
        match &self.inner {
            Some(inner) => inner.parts.conns.list(cap.min(LIST_CAP)),
            None => Listing::default(),
        }
    }

    /// Close the connection `id`: the app hears a reset and the outbound
    /// is closed. False when no such connection is live (ended already,
    /// never was, or the engine stopped). Counted
    /// (`connections_closed_by_host`).
    pub fn close_connection(&self, id: u64) -> bool {
        self.inner
            .as_ref()
            .is_some_and(|i| i.parts.conns.close(id, &i.parts.stats))
    }

    /// Close every live connection `filter` matches, as
    /// [`Engine::close_connection`] closes one; how many were asked to
    /// close (0 once stopped).
    pub fn close_connections(&self, filter: &crate::conns::ConnectionFilter) -> u64 {
        self.inner.as_ref().map_or(0, |i| {
            let parts = &i.parts;
            parts.conns.close_matching(filter, &parts.stats)
        })
    }

    /// Forward the host's memory-pressure level: admission of new TCP
    /// sessions and every memory budget follow it; what is held already
    /// (sessions' permits, queued datagrams) stays until released.
    pub fn set_memory_pressure(&self, level: MemoryPressure) {
        if let Some(inner) = &self.inner {
            let admission = &inner.parts.admission;
            let now = Instant::now();
            // Every memory budget shares this pressure; the DNS cache and the
            // fake-ip pool give up what the new tier does not allow at once.
            admission.set_pressure(level, now);
            if let Some(dns) = &inner.parts.routing.load().dns {
                dns.trim(now, &inner.parts.stats);
            }
            tracing::info!(
                "memory pressure {level:?}: admission limit {}",
                admission.limit(now)
            );
        }
    }

    /// The host's network moved (or its addresses changed): direct
    /// sockets opened from now on bind to `info`'s interface; the TCP
    /// sessions and UDP flows (direct, or through a proxy with its SOCKS5
    /// control connection) whose outbound socket the change left
    /// without its address (or its interface without an address of the
    /// socket's family) are reset and closed, so apps reconnect at once,
    /// while those the new network still carries go on; cached DNS answers
    /// and the addresses of proxies given by host name are forgotten
    /// (fake-ip mappings stay: apps hold those addresses), and `info`'s DNS
    /// servers resolve proxy host names from now on unless `[direct]
    /// bootstrap` is set (docs/configuration.md, "Host names") and answer
    /// for a `"platform"` entry of `dns.upstreams` (docs/dns.md). The event
    /// sink hears [`crate::EngineEvent::NetworkChanged`]. On a network with
    /// IPv6 and no IPv4, its NAT64 prefix is looked up from `info`'s DNS
    /// servers on the engine's runtime, and outbound connects to IPv4 go
    /// through it once found (`outbound/nat64.rs`; `nat64_prefix` in the
    /// statistics); a network with IPv4 drops it at once.
    ///
    /// Returns whether anything changed: the same `info` over the same
    /// interface addresses as last time is a no-op (nothing counted; only
    /// a NAT64 prefix not found yet is looked up again). The
    /// resets happen on the engine's threads right after this returns
    /// (`network_changes`, `sessions_reset_on_network_change`,
    /// `udp_flows_dropped_on_network_change` count them). Never blocks on
    /// the network; safe to call from any thread.
    pub fn network_changed(&self, info: NetworkInfo) -> Result<bool, NetworkError> {
        let Some(inner) = self
            .inner
            .as_ref()
            .filter(|i| i.parts.life.phase() == Phase::Running)
        else {
            return Err(NetworkError::NotRunning);
        };
        let parts = &inner.parts;
        let addrs = Addresses::read().map_err(NetworkError::Interfaces)?;
        let net = parts.life.network();
        let Some(addrs) = net.record(&info, addrs) else {
            // Nothing changed, but a NAT64 prefix not found yet is asked
            // for again.
            discover_nat64(inner, &info, false);
            return Ok(false);
        };
        let interface = info.interface.as_ref().map(|i| i.name.clone());
        // New sockets first, so nothing opened after the resets below
        // leaves on the old network.
        parts.factory.rebind(info.interface.clone());
        // Under the reload lock: a reload building a generation now either
        // sees this network or is finished and gets told of it here.
        let reloading = parts.reload.lock();
        let on = parts.routing.load();
        if let Some(dns) = &on.dns {
            dns.forget_answers();
            dns.set_platform(&info.dns_servers);
        }
        on.outbounds.set_platform_dns(&info.dns_servers);
        on.outbounds.forget_names();
        drop(reloading);
        discover_nat64(inner, &info, true);
        parts.stats.network_changes.fetch_add(1, Relaxed);
        net.publish(addrs);
        tracing::info!(
            "network changed: default interface {} (index {}), IPv4 {}, IPv6 {}, DNS {:?}{}{}",
            interface.as_deref().unwrap_or("none"),
            info.interface.as_ref().map_or(0, |i| i.index),
            info.has_ipv4,
            info.has_ipv6,
            info.dns_servers,
            if info.expensive { ", expensive" } else { "" },
            if info.constrained {
                ", constrained"
            } else {
                ""
            },
        );
        parts
            .life
            .emit(crate::EngineEvent::NetworkChanged { interface });
        Ok(true)
    }

    /// The device is going to sleep (iOS `NEPacketTunnelProvider.sleep`):
    /// the engine's periodic ticks stop and keep no timer until
    /// [`Engine::wake`]: the driver's cleanup tick (NAT entries, unaccepted
    /// outbounds, idle UDP flows; `driver::CLEANUP_TICK`) and the heap trim
    /// after load (`housekeeping::TICK`, Linux with glibc). Nothing else
    /// changes: connections and flows stay, packets are still read and
    /// relayed, and the timers that belong to a connection (its idle
    /// timeout, smoltcp's retransmissions) run as before.
    ///
    /// Returns whether the engine was awake (a second call does nothing).
    /// `timer_ticks` in the stats counts the ticks. Safe from any thread.
    pub fn sleep(&self) -> Result<bool, SleepError> {
        self.set_asleep(true)
    }

    /// The device woke (iOS `NEPacketTunnelProvider.wake`): the periodic
    /// ticks [`Engine::sleep`] paused resume, each ticking once at once so
    /// what expired while asleep is expired now. Returns whether the
    /// engine was asleep (a second call does nothing).
    pub fn wake(&self) -> Result<bool, SleepError> {
        self.set_asleep(false)
    }

    /// [`Engine::sleep`] (`asleep`) or [`Engine::wake`]: whether that
    /// changed the state, which the log says.
    fn set_asleep(&self, asleep: bool) -> Result<bool, SleepError> {
        let life = self.running_life().ok_or(SleepError::NotRunning)?;
        let changed = life.set_asleep(asleep);
        if changed && asleep {
            tracing::info!("asleep: periodic ticks paused");
        } else if changed {
            tracing::info!("awake: periodic ticks resumed");
        }
        Ok(changed)
    }

    /// The lifecycle of a running engine (not stopping, stopped or failed).
    fn running_life(&self) -> Option<&Arc<Lifecycle>> {
        self.inner
            .as_ref()
            .map(|i| &i.parts.life)
            .filter(|l| l.phase() == Phase::Running)
    }

    /// Diagnostics: one line per smoltcp socket (state, queues, windows,
    /// timers) and the poller's deadline; empty with the system stack.
    #[doc(hidden)]
    pub fn debug_smol(&self) -> Vec<String> {
        match self.inner.as_ref().map(|i| &i.parts.stack) {
            Some(Stack::Smoltcp(s)) => s.sockets.debug_sockets(),
            _ => Vec::new(),
        }
    }

    /// Tell `sink` of every change of the engine's state from now on
    /// (`None`: nobody). It hears the current state at once: `Running`, or
    /// `Failed` with the reason; `Stopped` once [`Engine::stop`] finished.
    /// On a stopped engine it hears `Stopped` at once.
    pub fn set_event_sink(&self, sink: Option<Arc<dyn crate::EventSink>>) {
        match &self.inner {
            Some(inner) => inner.parts.life.set_sink(sink),
            None => {
                if let Some(s) = sink {
                    s.event(crate::EngineEvent::Stopped);
                }
            }
        }
    }

    /// Whether the engine is running (not stopped and no fatal error).
    pub fn is_running(&self) -> bool {
        self.inner
            .as_ref()
            .is_some_and(|i| i.parts.life.phase() == Phase::Running)
    }

    /// The fatal error that stopped the engine's loops, if any: a device or
    /// listener failure, or an engine task that panicked or ended.
    pub fn error(&self) -> Option<String> {
        self.inner.as_ref().and_then(|i| i.parts.life.fatal())
    }

    /// Tests only (cargo feature `fault-injection`): make one of the
    /// engine's tasks panic or end, to see the engine report it through
    /// [`Engine::is_running`] and [`Engine::error`]. A DNS fault hits the
    /// next hijacked query.
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn inject_fault(&self, task: crate::EngineTask, fault: crate::Fault) {
        if let Some(inner) = &self.inner {
            inner.parts.life.inject(task, fault);
        }
    }

    /// The TUN interface name, when known.
    pub fn tun_name(&self) -> Option<String> {
        self.inner.as_ref().and_then(|i| i.parts.tun.name.clone())
    }

    /// The kernel listeners' addresses (gateway and port per family); empty
    /// with the smoltcp stack, which binds none.
    pub fn listen_addrs(&self) -> Vec<SocketAddr> {
        match self.inner.as_ref().map(|i| &i.parts.stack) {
            Some(Stack::System(st)) => st.listen_addrs(),
            _ => Vec::new(),
        }
    }

    /// Stop: end every loop and session, close the device and the listeners,
    /// join the runtime's threads (bounded by a timeout). Safe to call twice.
    pub fn stop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let parts = &inner.parts;
        // Drain first: sessions reset their connections while the driver still
        // runs, so apps see an RST at once instead of waiting for a timeout on
        // a vanished device. Bounded by DRAIN_TIMEOUT.
        parts.life.advance(Phase::Draining);
        let in_runtime = tokio::runtime::Handle::try_current().is_ok();
        if !in_runtime {
            let deadline = Instant::now() + DRAIN_TIMEOUT;
            while parts.stats.tcp_sessions_active.load(Relaxed) > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            // Let the driver translate the kernel's RSTs (and the apps' answers
            // to them, RFC 5961 challenge ACKs included) until the device has
            // been quiet for 20 ms.
            loop {
                let seen = parts.stats.tun_read_packets.load(Relaxed);
                std::thread::sleep(Duration::from_millis(20));
                let now_seen = parts.stats.tun_read_packets.load(Relaxed);
                if now_seen == seen || Instant::now() >= deadline {
                    break;
                }
            }
        }
        *self.last.lock() = Some(snapshot(&inner));
        parts.life.advance(Phase::Stopped);
        let Inner { rt, parts, .. } = inner;
        if in_runtime {
            // Called from inside another runtime: blocking here would panic.
            rt.shutdown_background();
        } else {
            rt.shutdown_timeout(STOP_TIMEOUT);
        }
        tracing::info!("kerntun stopped");
        parts.life.emit(crate::EngineEvent::Stopped);
        drop(parts);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Find the NAT64 prefix of a network without IPv4 (or drop the last
/// one: `outbound/nat64.rs`), asking `info`'s DNS servers on the engine's
/// runtime; `network_changed` does not wait for it. Logged once per
/// discovery.
fn discover_nat64(inner: &Inner, info: &NetworkInfo, changed: bool) {
    let factory = &inner.parts.factory;
    let nat64 = factory.nat64().clone();
    let Begin::Discover(generation) = nat64.begin(info.has_ipv4, info.has_ipv6, changed) else {
        return;
    };
    let servers = crate::outbound::resolve::Resolvers::platform_list(&info.dns_servers);
    let timeout = inner.parts.routing.load().outbounds.resolver_timeout();
    let factory = factory.clone();
    inner.rt.spawn(async move {
        let found = crate::outbound::nat64::discover(&factory, &servers, timeout).await;
        if !nat64.settle(generation, found) {
            return;
        }
        match found {
            Some(p) => tracing::info!(
                "NAT64 prefix {p} (ipv4only.arpa): IPv4 destinations and proxies are reached through it"
            ),
            None => tracing::info!(
                "no NAT64 prefix on this IPv6-only network (ipv4only.arpa from {}): IPv4 stays unreachable",
                match servers.len().min(crate::outbound::nat64::MAX_SERVERS) {
                    0 => "the system resolver".to_owned(),
                    n => format!("{n} DNS servers"),
                }
            ),
        }
    });
}

fn snapshot(inner: &Inner) -> StatsSnapshot {
    let parts = &inner.parts;
    let mut s = parts.stats.snapshot();
    s.tcp_flows = parts.stack.counts();
    s.stack = parts.stack.name();
    s.driver = inner.driver.as_str();
    let now = Instant::now();
    s.memory_pressure = match parts.admission.pressure(now) {
        MemoryPressure::Normal => "normal",
        MemoryPressure::Elevated => "elevated",
        MemoryPressure::Critical => "critical",
    };
    s.admission_limit = parts.admission.limit(now) as u64;
    s.uptime_ms = inner.started.elapsed().as_millis() as u64;
    let nat64 = parts.factory.nat64();
    s.nat64_prefix = nat64.prefix().map(|p| p.to_string());
    s.nat64_synthesized = nat64.synthesized();
    s.nat64_discovery_failed = nat64.failed();
    s.timer_ticks = parts.life.timer_ticks();
    s
}
