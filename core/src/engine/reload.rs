//! `Engine::reload`: new rules, outbounds, groups, DNS settings, domain
//! lists and sniffing for a running engine, without touching the TUN.
//!
//! Everything a new flow reads to be routed is one generation,
//! [`Routing`], behind an `ArcSwap` (`dispatch::Current`). A reload builds
//! the next generation from the new configuration off the packet path
//! (everything that can fail on the configuration fails here, changing
//! nothing), then stores it: flows planned from then on take it, flows
//! already running keep the stream and the generation they were connected
//! with. Connections relaying through an outbound the new configuration
//! no longer has are closed (the app hears a reset) and counted
//! (`reload_closed`).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use parking_lot::{Mutex, MutexGuard};
use tokio::task::AbortHandle;

use super::start::proxy_resolvers;
use super::{Engine, groups};
use crate::budget::{Budget, ByteBudget};
use crate::config::{Config, ConfigError};
use crate::dispatch::Routing;
use crate::dns::Dns;
use crate::lifecycle::Phase;
use crate::outbound::Outbounds;
use crate::outbound::group::GroupKind;

/// Why [`Engine::reload`] changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReloadError {
    /// The engine is stopped or failed.
    #[error("the engine is not running")]
    NotRunning,
    /// The new configuration does not validate (the error names the field).
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// The new configuration changes `field`, which a running engine
    /// cannot change: stop it and start it with the new configuration.
    #[error("{field} cannot change while the engine runs: restart the engine to change it")]
    NeedsRestart { field: &'static str },
}

/// What a reload did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReloadReport {
    /// Running connections closed because their outbound is gone
    /// (also added to `reload_closed` in the statistics).
    pub closed: u64,
    /// Whether the fake-ip pool was kept (its ranges and size did not
    /// change), so the fake addresses apps hold still stand for their
    /// domains.
    pub fake_ip_kept: bool,
    /// `select` groups whose selection was carried over (the group and
    /// its selected member are in the new configuration too).
    pub selections_kept: usize,
}

/// The DNS service's memory budgets, shared by every generation (answers
/// and queries of the old one are still charged to them while they live).
#[derive(Debug)]
pub(super) struct DnsBudgets {
    pub cache: Arc<ByteBudget>,
    pub in_flight: Arc<ByteBudget>,
    pub fake: Arc<ByteBudget>,
}

/// What a reload needs besides the parts.
#[derive(Debug)]
pub(super) struct State {
    /// The configuration running now. Held for the whole of a reload, so
    /// reloads (and the network change's update of the current
    /// generation) run one at a time.
    config: Mutex<Config>,
    budget: Budget,
    dns: DnsBudgets,
    /// The current generation's probe tasks (`url-test`, `fallback`).
    probes: Mutex<Vec<AbortHandle>>,
}

impl State {
    pub fn new(config: Config, budget: Budget, dns: DnsBudgets) -> Self {
        State {
            config: Mutex::new(config),
            budget,
            dns,
            probes: Mutex::new(Vec::new()),
        }
    }

    /// Replace the probe tasks, aborting those of the last generation.
    pub fn set_probes(&self, probes: Vec<AbortHandle>) {
        for old in std::mem::replace(&mut *self.probes.lock(), probes) {
            old.abort();
        }
    }

    /// Hold off reloads while the current generation is updated.
    pub fn lock(&self) -> MutexGuard<'_, Config> {
        self.config.lock()
    }
}

/// The first field `new` changes that only a restart can change: the TUN
/// device, the stack and driver, the runtime's workers, the budget, the
/// flow tables' timeouts, the relay's options and the direct sockets' options (all built into
/// what start opened). `direct.bootstrap` only resolves proxy names, which
/// a reload redoes.
pub(super) fn needs_restart(old: &Config, new: &Config) -> Option<&'static str> {
    // The name of the first of the fields that differs between `a` and `b`,
    // behind `prefix`.
    macro_rules! first_changed {
        ($a:expr, $b:expr, $prefix:literal { $($field:ident),* $(,)? }) => {
            [$(($a.$field != $b.$field, concat!($prefix, stringify!($field)))),*]
                .into_iter()
                .find_map(|(changed, name)| changed.then_some(name))
        };
    }
    let (a, b) = (&old.tun, &new.tun);
    let tun = first_changed!(a, b, "tun." {
        name,
        mtu,
        ipv4,
        ipv6,
        tx_queue_len,
        include_all_networks,
        coalesce,
        window_clamp,
        queue_packets,
    });
    if tun.is_some() {
        return tun;
    }
    // Whatever else `[tun]` holds (a field added later) restarts too.
    if a != b {
        return Some("tun");
    }
    first_changed!(old, new, "" { stack, driver, workers, budget, timeouts, relay }).or_else(|| {
        first_changed!(old.direct, new.direct, "direct." {
            interface,
            fwmark,
            connect_timeout_ms,
            udp_nat,
        })
    })
}

impl Engine {
    /// Replace the rules, outbounds, groups, DNS settings (upstreams,
    /// hijack, fake-ip), domain lists and sniffing of the running engine
    /// with `config`'s, without closing the TUN: new TCP connections and
    /// UDP flows follow them, running ones keep their outbound, except
    /// those relaying through an outbound `config` no longer has, which
    /// are closed (the app hears a reset) and counted (`reload_closed`).
    ///
    /// Carried over: the fake-ip pool when its ranges and size are the
    /// same (apps cache fake addresses), each `select` group's selection
    /// when the group still has that member, the per-outbound statistics
    /// of every outbound whose name stays, and the network's DNS servers
    /// the host reported. The DNS answer cache starts empty; `url-test`
    /// and `fallback` groups are probed afresh (the old probes stop).
    ///
    /// Nothing changes when `config` does not validate
    /// ([`ReloadError::Config`], naming the field) or changes what only a
    /// restart can (`[tun]`, `stack`, `driver`, `workers`, `[budget]`,
    /// `[timeouts]`, `[relay]`, and `[direct]` but its `bootstrap`:
    /// [`ReloadError::NeedsRestart`]). The event sink hears
    /// [`crate::EngineEvent::Reloaded`]. Blocks only while the new
    /// configuration is compiled (domain list files are read); safe from
    /// any thread.
    pub fn reload(&self, config: Config) -> Result<ReloadReport, ReloadError> {
        let inner = self
            .inner
            .as_ref()
            .filter(|i| i.parts.life.phase() == Phase::Running)
            .ok_or(ReloadError::NotRunning)?;
        let parts = &inner.parts;
        let state = &parts.reload;
        let mut running = state.lock();
        config.validate()?;
        if let Some(field) = needs_restart(&running, &config) {
            return Err(ReloadError::NeedsRestart { field });
        }
        let old = parts.routing.load_full();

        // Build the next generation; any failure leaves everything as it was.
        let mut outbounds = Outbounds::new(
            &config.outbounds,
            &config.groups,
            &config.rules,
            &config.relay,
            parts.factory.clone(),
            state.budget.relay_buffer,
            proxy_resolvers(&config)?,
        )
        .map_err(ConfigError::from)?;
        outbounds.carry_counters(&old.outbounds);
        if let Some(info) = parts.life.network().last_info() {
            outbounds.set_platform_dns(&info.dns_servers);
        }
        let mut selections_kept = 0;
        for g in old.outbounds.groups().states() {
            if g.kind == GroupKind::Select
                && outbounds.groups().select(&g.name, &g.selected).is_ok()
            {
                selections_kept += 1;
            }
        }
        let outbounds = Arc::new(outbounds);
        let mut dns = Dns::new(
            &config.dns,
            &config.tun.nets(),
            outbounds.clone(),
            state.dns.cache.clone(),
            state.dns.in_flight.clone(),
            state.dns.fake.clone(),
        )
        .map_err(ConfigError::from)?;
        let fake_ip_kept = match (&mut dns, &old.dns) {
            (Some(new), Some(old)) => Dns::carry_over(new, old),
            _ => false,
        };

        // Switch: new flows take the new generation from here on.
        parts.stats.set_outbounds(outbounds.counters());
        parts.routing.store(Arc::new(Routing {
            outbounds: outbounds.clone(),
            dns,
            sniff: config.sniff.clone(),
        }));
        state.set_probes(groups::spawn_probes(inner.rt.handle(), parts, &outbounds));
        let closed = parts
            .conns
            .close_unless(|name| outbounds.has_outbound(name));
        parts.stats.reload_closed.fetch_add(closed, Relaxed);
        let rules = config.rules.len();
        *running = config;
        drop(running);
        tracing::info!(
            "reloaded: {} outbounds, {} rules; {closed} connections closed (outbound gone), fake-ip pool {}",
            outbounds.names().len(),
            rules,
            if fake_ip_kept { "kept" } else { "new or off" },
        );
        parts.life.emit(crate::EngineEvent::Reloaded { closed });
        Ok(ReloadReport {
            closed,
            fake_ip_kept,
            selections_kept,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every restart-only field is named; what a reload may change is not.
    #[test]
    fn restart_only_fields_are_named() {
        let base = Config::default();
        let named = |f: &dyn Fn(&mut Config)| {
            let mut c = base.clone();
            f(&mut c);
            needs_restart(&base, &c)
        };
        assert_eq!(named(&|c| c.tun.mtu = 1400), Some("tun.mtu"));
        assert_eq!(named(&|c| c.tun.name = "kt9".into()), Some("tun.name"));
        assert_eq!(
            named(&|c| c.tun.ipv4 = Some("10.9.0.1/24".parse().expect("net"))),
            Some("tun.ipv4")
        );
        assert_eq!(
            named(&|c| c.stack = crate::config::StackKind::Smoltcp),
            Some("stack")
        );
        assert_eq!(
            named(&|c| c.driver = crate::config::DriverMode::PerPacket),
            Some("driver")
        );
        assert_eq!(named(&|c| c.workers = 7), Some("workers"));
        assert_eq!(named(&|c| c.timeouts.udp_idle_s = 5), Some("timeouts"));
        assert_eq!(named(&|c| c.relay.splice = false), Some("relay"));
        assert_eq!(named(&|c| c.direct.fwmark = Some(9)), Some("direct.fwmark"));
        // What a reload changes.
        assert_eq!(named(&|c| c.rules.push(Default::default())), None);
        assert_eq!(named(&|c| c.dns.enabled = !c.dns.enabled), None);
        assert_eq!(named(&|c| c.sniff.timeout_ms += 1), None);
        assert_eq!(
            named(&|c| c.direct.bootstrap = vec!["udp://192.0.2.1:53".into()]),
            None
        );
        assert_eq!(named(&|_| ()), None);
    }
}
