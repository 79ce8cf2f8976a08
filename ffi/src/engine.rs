//! The [`Engine`] object: a running kerntun engine owned by the app.
//!
//! Calls from the app's main thread (`stats`, `is_running`, a stats timer)
//! must never wait on `stop`, which takes up to a few seconds (it drains the
//! sessions, then joins the runtime). So the core engine sits behind a lock
//! held only long enough to clone or take an `Arc`: `stop` takes it out and
//! stops it outside any lock the other calls take, and from that moment
//! those calls answer from what `stop` saved (the last snapshot, then the
//! final one).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use kerntun::{StartOptions, StatsSnapshot, TunSource};
use parking_lot::Mutex;

use crate::config::{EngineConfig, LogLevel, MemoryPressure};
use crate::connections::{ConnectionFilter, ConnectionRecord};
use crate::error::{KerntunError, guard, panic_message};
use crate::events::{Delivery, EngineEvent, EngineListener};
use crate::hooks::{HookOwner, HookProtect, OwnerHooks, PlatformHooks};
use crate::logging::{EngineLog, LogRecord};
use crate::stats::EngineStats;

/// A running engine. Several may run in one process; each owns its own
/// runtime threads. Stopping (or dropping) one never affects the others and
/// never exits the process.
#[derive(uniffi::Object)]
pub struct Engine {
    /// The core engine until `stop` takes it. Locked only to clone or take
    /// the `Arc`, never across a call into the engine.
    core: Mutex<Option<Arc<kerntun::Engine>>>,
    /// What the calls answer once `stop` began: the statistics (at the
    /// start of `stop`, then the final ones) and the fatal error, if any.
    stopped: Mutex<Stopped>,
    /// Held for the whole of `stop` (and only by it), so a second `stop`
    /// returns once the first finished.
    stopping: Mutex<()>,
    /// The engine's own logging (its dispatcher, also used for the lines
    /// `stop` logs on the caller's thread, and its ring of recent lines).
    log: EngineLog,
    /// Events the listeners' queues had no room for.
    events_dropped: Arc<AtomicU64>,
    /// The configuration it runs: the one it started with, then the last
    /// one `reload` took. A `reload` message (src/messages.rs) changes
    /// only the sections it names and keeps these for the rest.
    config: Mutex<EngineConfig>,
}

/// What `Engine.reload` did.
#[derive(Debug, Clone, PartialEq, Eq, uniffi::Record, serde::Serialize)]
pub struct ReloadReport {
    /// Running connections closed because their outbound is gone.
    pub closed: u64,
    /// Whether the fake-ip pool was kept (its range and size did not
    /// change): the fake addresses apps hold still stand for their domains.
    pub fake_ip_kept: bool,
    /// Select groups whose selected member was carried over.
    pub selections_kept: u32,
}

#[derive(Debug, Default)]
struct Stopped {
    stats: StatsSnapshot,
    error: Option<String>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

fn scoped<T>(dispatch: &tracing::Dispatch, f: impl FnOnce() -> T) -> T {
    tracing::dispatcher::with_default(dispatch, f)
}

impl Engine {
    /// `reload` with the configuration `make` draws from the running one.
    /// The configuration stays locked throughout, so two reloads (a call
    /// and a message) never build on the same one and lose a change.
    pub(crate) fn reload_from(
        &self,
        make: impl FnOnce(&EngineConfig) -> Result<EngineConfig, KerntunError>,
    ) -> Result<ReloadReport, KerntunError> {
        let mut running = self.config.lock();
        let config = make(&running)?;
        let core = config.to_core()?;
        let Some(e) = self.running() else {
            return Err(KerntunError::from(kerntun::ReloadError::NotRunning));
        };
        let r = scoped(&self.log.dispatch, || e.reload(core))?;
        *running = config;
        Ok(ReloadReport {
            closed: r.closed,
            fake_ip_kept: r.fake_ip_kept,
            selections_kept: u32::try_from(r.selections_kept).unwrap_or(u32::MAX),
        })
    }

    /// The core engine, if `stop` has not taken it yet.
    pub(crate) fn running(&self) -> Option<Arc<kerntun::Engine>> {
        self.core.lock().clone()
    }

    /// Take the core engine out (saving what the other calls answer from
    /// then on) and stop it. Returns once it stopped; a no-op after that.
    fn stop_core(&self) {
        let _one_at_a_time = self.stopping.lock();
        let taken = {
            let mut core = self.core.lock();
            if let Some(e) = core.as_ref() {
                // Saved under the same lock: a call that finds the engine
                // gone finds these already in place.
                *self.stopped.lock() = Stopped {
                    stats: e.stats(),
                    error: e.error(),
                };
            }
            core.take()
        };
        let Some(mut engine) = taken else {
            return;
        };
        // Calls that cloned the Arc just before it was taken finish in
        // microseconds (a snapshot, a flag, one log line); no new ones start.
        let mut engine = loop {
            match Arc::try_unwrap(engine) {
                Ok(e) => break e,
                Err(shared) => {
                    engine = shared;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        };
        engine.stop();
        let final_stats = engine.stats();
        self.stopped.lock().stats = final_stats;
    }
}

#[uniffi::export]
impl Engine {
    /// Start an engine and return once it is ready (device adopted, addresses
    /// verified, kernel listeners bound). Blocks for at most ~1 s; call it off
    /// the main thread.
    ///
    /// `tun_fd`: the platform's TUN descriptor (iOS: [`crate::find_tun_fd`]
    /// after the tunnel settings are applied; Android: `establish()` then
    /// `detachFd()`). The engine duplicates it, so the app keeps (and may
    /// close) its own copy; on iOS never close the utun descriptor. Pass `-1`
    /// to have the engine create the device named `config.tun.name` itself
    /// (desktop Linux/macOS, needs CAP_NET_ADMIN/root).
    #[uniffi::constructor]
    pub fn start(
        config: EngineConfig,
        tun_fd: i32,
        platform: Arc<dyn PlatformHooks>,
    ) -> Result<Arc<Self>, KerntunError> {
        Self::start_inner(config, tun_fd, platform, None)
    }

    /// [`Engine::start`] with the app's lookup of the app that owns each
    /// flow (Android 10+: `ConnectivityManager.getConnectionOwnerUid`):
    /// connection records then carry `uid` and `package`, and `package` /
    /// `uid` rules match. It is asked off the packet path, from a thread of
    /// the engine's own, at most 250 ms waited for per flow
    /// (`docs/integration-android.md`).
    #[uniffi::constructor]
    pub fn start_with_owner(
        config: EngineConfig,
        tun_fd: i32,
        platform: Arc<dyn PlatformHooks>,
        owner: Arc<dyn OwnerHooks>,
    ) -> Result<Arc<Self>, KerntunError> {
        Self::start_inner(config, tun_fd, platform, Some(owner))
    }
}

impl Engine {
    fn start_inner(
        config: EngineConfig,
        tun_fd: i32,
        platform: Arc<dyn PlatformHooks>,
        owner: Option<Arc<dyn OwnerHooks>>,
    ) -> Result<Arc<Self>, KerntunError> {
        guard(|| {
            let core = config.to_core()?;
            let log = EngineLog::new(
                config.log_level.map(|_| platform.clone()),
                config.log_level.unwrap_or(LogLevel::Info),
            );
            let mut options = StartOptions::with_dispatch(log.dispatch.clone());
            if let Some(owner) = owner {
                options = options.with_owner(Arc::new(HookOwner(owner)));
            }
            let protect = Arc::new(HookProtect(platform));
            // The app lends `tun_fd` until this call returns (documented above).
            let engine = kerntun::tun::with_lent_fd(tun_fd, |lent| {
                let source = match lent {
                    _ if tun_fd < 0 => TunSource::Create,
                    Some(fd) => TunSource::Fd(fd),
                    None => {
                        return Err(KerntunError::Tun {
                            reason: format!("tun_fd {tun_fd} is not an open descriptor"),
                        });
                    }
                };
                scoped(&log.dispatch, || {
                    kerntun::Engine::start_with(core, source, Some(protect), options)
                })
                .map_err(KerntunError::from)
            })?;
            Ok(Arc::new(Engine {
                core: Mutex::new(Some(Arc::new(engine))),
                stopped: Mutex::new(Stopped::default()),
                stopping: Mutex::new(()),
                log,
                events_dropped: Arc::new(AtomicU64::new(0)),
                config: Mutex::new(config),
            }))
        })
    }
}

#[uniffi::export]
impl Engine {
    /// Stop: reset the connections, close the device copy and the listeners,
    /// join the engine's threads (bounded: a few seconds at worst; call it
    /// off the main thread). Idempotent; a second call returns once the
    /// first finished. The other calls never wait for it: from the moment
    /// it begins `is_running()` is false and `stats()` answers with the
    /// counts at that moment, then with the final ones.
    pub fn stop(&self) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            scoped(&self.log.dispatch, || self.stop_core());
        }));
        if let Err(p) = r {
            tracing::error!("kerntun stop panicked: {}", panic_message(p.as_ref()));
        }
    }

    /// A snapshot of every counter (the final one after `stop`). Never
    /// blocks on `stop`.
    pub fn stats(&self) -> EngineStats {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let s = match self.running() {
                Some(e) => e.stats(),
                None => self.stopped.lock().stats.clone(),
            };
            EngineStats::from(s)
        }))
        .unwrap_or_default()
    }

    /// Forward the platform's memory pressure (iOS dispatch source, Android
    /// `onTrimMemory`): new TCP sessions are admitted against a lower limit;
    /// running ones keep going. A raised level decays by itself after quiet
    /// minutes (`core/src/budget/pressure.rs`, `PRESSURE_DECAY_STEP`).
    pub fn set_memory_pressure(&self, level: MemoryPressure) {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if let Some(e) = self.running() {
                scoped(&self.log.dispatch, || e.set_memory_pressure(level.into()));
            }
        }));
    }

    /// Tell the engine that the device's network moved (iOS: an `NWPath`
    /// update; Android: the default network's callback): direct sockets
    /// opened from now on bind to `info.interface_name` (Linux/Android) or
    /// `info.interface_index` (iOS/macOS); TCP connections and direct UDP
    /// flows whose outbound socket the change left without its address are
    /// reset at once, so apps reconnect on the new network, while those the
    /// new network still carries go on; cached DNS answers and the
    /// addresses of proxies given by host name are forgotten (fake-ip
    /// addresses stay valid). The listener hears
    /// `EngineEvent.NetworkChanged`; `stats()` counts `network_changes`,
    /// `sessions_reset_on_network_change`,
    /// `udp_flows_dropped_on_network_change`. On a network with IPv6 and
    /// no IPv4 (`has_ipv6` without `has_ipv4`), the NAT64 prefix is looked
    /// up in the background from `info.dns_servers` (`ipv4only.arpa`), and
    /// IPv4 proxies and destinations are reached through it
    /// (`stats().nat64_prefix`, `nat64_synthesized`).
    ///
    /// Returns whether anything changed: the same info over the same
    /// interface addresses as last time does nothing (but looks for a
    /// NAT64 prefix again if none was found). Fast (reads the
    /// interfaces' addresses; never waits on the network); callable from
    /// any thread. Errors: `NotRunning` on a stopped or failed engine,
    /// `Network` for a DNS server that is not an IP address.
    pub fn network_changed(&self, info: NetworkInfo) -> Result<bool, KerntunError> {
        guard(|| {
            let info = info.to_core()?;
            let Some(e) = self.running() else {
                return Err(KerntunError::from(
                    kerntun::network::NetworkError::NotRunning,
                ));
            };
            scoped(&self.log.dispatch, || e.network_changed(info)).map_err(KerntunError::from)
        })
    }

    /// Replace the rules, outbounds, groups, DNS settings, domain lists and
    /// sniffing of the running engine with `config`'s, without closing the
    /// TUN (given the way `start` takes it). New connections and UDP flows
    /// follow the new configuration; running ones keep their outbound,
    /// except those through an outbound `config` no longer has, which are
    /// reset and counted (`stats().reload_closed`). The fake-ip pool is
    /// kept when its range is the same, and each select group keeps its
    /// member when the group still has it. The listener hears
    /// `EngineEvent.Reloaded`.
    ///
    /// Nothing changes on an error: `Config` (naming the field) for a
    /// configuration that does not validate, `NeedsRestart` (naming the
    /// field) when it changes what only a restart can (`tun`, `stack`,
    /// `driver`, `workers`, `budget`, `timeouts`, `relay`, `direct` but
    /// its `bootstrap`), `NotRunning` on a stopped engine. Blocks while the
    /// configuration is compiled (domain list files are read): call it off
    /// the main thread.
    pub fn reload(&self, config: EngineConfig) -> Result<ReloadReport, KerntunError> {
        guard(|| self.reload_from(|_| Ok(config)))
    }

    /// The device is going to sleep (iOS: the provider's
    /// `sleep(completionHandler:)`): the engine's periodic ticks stop and
    /// keep no timer until [`Engine::wake`]: the cleanup of expired flows
    /// (once a second while there are flows) and, on Linux with glibc, the
    /// heap trim after load (every 2 s). Nothing else changes: connections
    /// stay, packets are still relayed, a connection's own timers (its
    /// idle timeout) run as before. `stats()` counts the ticks in
    /// `timer_ticks`, which stands still while asleep.
    ///
    /// Returns whether the engine was awake (a second call does nothing).
    /// Fast; callable from any thread. Errors: `NotRunning` on a stopped
    /// or failed engine.
    pub fn sleep(&self) -> Result<bool, KerntunError> {
        guard(|| {
            let Some(e) = self.running() else {
                return Err(KerntunError::from(kerntun::SleepError::NotRunning));
            };
            scoped(&self.log.dispatch, || e.sleep()).map_err(KerntunError::from)
        })
    }

    /// The device woke (iOS: the provider's `wake()`): the ticks
    /// [`Engine::sleep`] stopped resume, each once at once, so flows that
    /// expired while asleep are closed now. Returns whether the engine was
    /// asleep (a second call does nothing). Errors: `NotRunning` on a
    /// stopped or failed engine.
    pub fn wake(&self) -> Result<bool, KerntunError> {
        guard(|| {
            let Some(e) = self.running() else {
                return Err(KerntunError::from(kerntun::SleepError::NotRunning));
            };
            scoped(&self.log.dispatch, || e.wake()).map_err(KerntunError::from)
        })
    }

    /// Whether the engine is running (not stopping or stopped, no fatal
    /// error). Never blocks on `stop`.
    pub fn is_running(&self) -> bool {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.running().is_some_and(|e| e.is_running())
        }))
        .unwrap_or(false)
    }

    /// The fatal error that stopped the engine on its own (device gone,
    /// listener failed), if any; still answered after `stop`.
    pub fn error(&self) -> Option<String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match self.running() {
            Some(e) => e.error(),
            None => self.stopped.lock().error.clone(),
        }))
        .unwrap_or_else(|p| Some(panic_message(p.as_ref())))
    }

    /// Hear the engine's state changes ([`EngineEvent`]) on a thread of the
    /// listener's own, instead of polling `is_running()`. The listener hears
    /// the current state at once (`Running`, `Failed`, or `Stopped` on a
    /// stopped engine), then each change. A new listener replaces the
    /// previous one (which still hears what was queued for it); `None`
    /// removes it.
    pub fn set_listener(&self, listener: Option<Arc<dyn EngineListener>>) {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let delivery = match listener {
                Some(l) => match Delivery::start(l, self.events_dropped.clone()) {
                    Ok(d) => Some(Arc::new(d)),
                    Err(e) => {
                        scoped(&self.log.dispatch, || {
                            tracing::error!("no thread for the engine listener: {e}")
                        });
                        return;
                    }
                },
                None => None,
            };
            match self.running() {
                Some(e) => e.set_event_sink(delivery.map(|d| d as Arc<dyn kerntun::EventSink>)),
                None => {
                    if let Some(d) = delivery {
                        d.send(EngineEvent::Stopped);
                    }
                }
            }
        }));
    }

    /// Events no listener had room for (a listener that stopped taking
    /// them); see [`crate::events::QUEUE`].
    pub fn events_dropped(&self) -> u64 {
        self.events_dropped.load(Relaxed)
    }

    /// Change the level of the engine's log (its `PlatformHooks.log` lines,
    /// when `EngineConfig.log_level` was set, and its ring of recent lines)
    /// while it runs.
    pub fn set_log_level(&self, level: LogLevel) {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.log.set_level(level);
        }));
    }

    /// The engine's last lines ([`crate::logging::RING_LINES`] at most,
    /// oldest first), at its level (`EngineConfig.log_level`, else info;
    /// [`Engine::set_log_level`]); still answered after `stop`, so an app
    /// can show why a tunnel failed.
    pub fn recent_logs(&self) -> Vec<LogRecord> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.log.ring.lines()))
            .unwrap_or_default()
    }

    /// The live connections, one record per TCP connection (relayed or
    /// sniffed, both stacks) and per UDP flow, at most [`crate::MAX_CONNECTIONS`] (10,000): a list that long may have left
    /// some out. Empty once stopped.
    pub fn connections(&self) -> Vec<ConnectionRecord> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.running()
                .map(|e| {
                    let l = e.connections();
                    l.connections
                        .into_iter()
                        .map(ConnectionRecord::from)
                        .collect()
                })
                .unwrap_or_default()
        }))
        .unwrap_or_default()
    }

    /// Close the connection `id` (a [`ConnectionRecord`]'s): the app hears
    /// a reset, the outbound is closed. False when it is no longer live (or
    /// never was, or the engine stopped). Counted
    /// (`EngineStats.connections_closed_by_host`).
    pub fn close_connection(&self, id: u64) -> bool {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.running().is_some_and(|e| e.close_connection(id))
        }))
        .unwrap_or(false)
    }

    /// Close every live connection `filter` matches, as `closeConnection`
    /// closes one; how many were asked to close (0 once stopped). A
    /// `destination_ip` that is not an address is a `Config` error naming
    /// it.
    pub fn close_connections(&self, filter: ConnectionFilter) -> Result<u64, KerntunError> {
        crate::error::guard(|| {
            let core = filter.to_core().ok_or_else(|| KerntunError::Config {
                field: "destination_ip".into(),
                reason: format!(
                    "{:?} is not an IP address",
                    filter.destination_ip.as_deref().unwrap_or_default()
                ),
            })?;
            Ok(self.running().map_or(0, |e| e.close_connections(&core)))
        })
    }

    /// The TUN interface name, when known (`utun4`, `kerntun0`); `None`
    /// once stopped.
    pub fn tun_name(&self) -> Option<String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.running().and_then(|e| e.tun_name())
        }))
        .unwrap_or(None)
    }
}

/// What the platform knows of the network the device is on now, for
/// [`Engine::network_changed`].
#[derive(Debug, Clone, Default, PartialEq, Eq, uniffi::Record)]
pub struct NetworkInfo {
    /// The default interface's name (`en0`, `pdp_ip0`, `wlan0`,
    /// `rmnet_data0`); `None` while the device has no network.
    pub interface_name: Option<String>,
    /// Its index (`if_nametoindex`; iOS/macOS bind by it); 0 when unknown.
    pub interface_index: u32,
    pub has_ipv4: bool,
    pub has_ipv6: bool,
    /// The network's DNS servers, as IP addresses (`8.8.8.8`,
    /// `2001:4860:4860::8888`; a scope suffix such as `%en0` is ignored).
    /// They resolve proxy host names unless `direct.bootstrap` is set,
    /// answer for a `"platform"` entry of `dns.upstreams`, and are asked
    /// for the NAT64 prefix on a network without IPv4.
    pub dns_servers: Vec<String>,
    /// A metered network (cellular, a personal hotspot).
    pub expensive: bool,
    /// A network in a low-data mode.
    pub constrained: bool,
}

impl NetworkInfo {
    fn to_core(&self) -> Result<kerntun::network::NetworkInfo, KerntunError> {
        let dns_servers = self
            .dns_servers
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let ip = s.split('%').next().unwrap_or_default();
                ip.parse().map_err(|_| KerntunError::Network {
                    field: format!("dns_servers[{i}]"),
                    reason: format!("{s:?} is not an IP address"),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(kerntun::network::NetworkInfo {
            interface: self.interface_name.as_ref().map(|name| {
                kerntun::network::DefaultInterface {
                    name: name.clone(),
                    index: self.interface_index,
                }
            }),
            has_ipv4: self.has_ipv4,
            has_ipv6: self.has_ipv6,
            dns_servers,
            expensive: self.expensive,
            constrained: self.constrained,
        })
    }
}

/// Tests only (cargo feature `fault-injection`): an engine task that
/// [`Engine::inject_fault`] makes fail.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum)]
pub enum FaultTask {
    Driver,
    AcceptLoop,
    Poller,
    /// The next hijacked DNS query's task.
    Dns,
}

/// Tests only (cargo feature `fault-injection`): how the task fails.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, uniffi::Enum)]
pub enum FaultKind {
    Panic,
    End,
}

#[cfg(feature = "fault-injection")]
#[uniffi::export]
impl Engine {
    /// Tests only (cargo feature `fault-injection`, which
    /// ffi/tests/kotlin/run.sh builds with): make one of the engine's tasks
    /// panic or end, to see `is_running()` and `error()` report it.
    pub fn inject_fault(&self, task: FaultTask, fault: FaultKind) {
        let task = match task {
            FaultTask::Driver => kerntun::EngineTask::Driver,
            FaultTask::AcceptLoop => kerntun::EngineTask::AcceptLoop,
            FaultTask::Poller => kerntun::EngineTask::Poller,
            FaultTask::Dns => kerntun::EngineTask::Dns,
        };
        let fault = match fault {
            FaultKind::Panic => kerntun::Fault::Panic,
            FaultKind::End => kerntun::Fault::End,
        };
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if let Some(e) = self.running() {
                e.inject_fault(task, fault);
            }
        }));
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The foreign side released its last reference (Kotlin `close()`,
        // its cleaner, Swift `deinit`) without stopping first. That release
        // may happen on the app's main thread, on the platform's cleaner
        // thread, or at the end of whichever call was still in flight: none
        // of them should wait seconds. So a running engine is stopped on a
        // thread of its own; `stop()` first is how an app knows when the
        // device and sockets are gone.
        let Some(core) = self.core.get_mut().take() else {
            return;
        };
        let dispatch = self.log.dispatch.clone();
        // No call can be in flight (they borrow `self`), so this is the last
        // reference: dropping it stops the core engine (its own `Drop`).
        // Should the spawn fail, the closure, and the engine in it, is
        // dropped right here instead: stopped inline, late rather than never.
        let _ = std::thread::Builder::new()
            .name("kerntun-stop".into())
            .spawn(move || {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    scoped(&dispatch, || drop(core));
                }));
            });
    }
}
