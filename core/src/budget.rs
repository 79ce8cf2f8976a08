//! One platform budget for every bounded resource: NAT
//! entries, TCP admission permits, UDP flows, the listener backlog and relay
//! buffers all derive from it, so a phone's limits are set in one place.
//!
//! Admission is a counter, not a semaphore: raising the memory pressure lowers
//! the limit new sessions are checked against, while sessions that already
//! hold a permit keep it until they end.
//!
//! A pressure tier raised by the host decays by itself ([`PressureDecay`]):
//! iOS warns a process nearing its own limit but reports `.normal` only
//! when pressure recovers system-wide, and Android 14+ delivers no trim
//! level that says pressure ended, so without decay a single warning would
//! hold admission at the critical tier for the tunnel's life. The core
//! reads no clock: the engine passes `now` in.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use serde::{Deserialize, Serialize};

/// The platform a budget is tuned for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Platform {
    /// iOS Network Extension: 50 MiB process-wide, fatal when exceeded.
    Ios,
    /// Android VpnService: a background-process budget.
    Android,
    /// Linux/macOS desktop or server.
    Desktop,
}

impl Platform {
    /// The platform this library was compiled for.
    pub const fn current() -> Self {
        if cfg!(target_os = "ios") {
            Platform::Ios
        } else if cfg!(target_os = "android") {
            Platform::Android
        } else {
            Platform::Desktop
        }
    }

    /// MTUs peers settled on: iOS throughput drops above 4064 in a Network
    /// Extension, some Android devices return ENOBUFS at 65535, desktop Linux
    /// takes 65535 (the values sing-box settled on per platform).
    pub const fn default_mtu(self) -> u16 {
        match self {
            Platform::Ios => 4064,
            Platform::Android => 9000,
            Platform::Desktop => 65535,
        }
    }
}

/// Limits that come from the platform unless overridden .
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetConfig {
    /// Platform whose budget is the starting point; defaults to the build target.
    pub platform: Option<Platform>,
    /// NAT entries (system stack).
    pub nat_entries: Option<usize>,
    /// TCP admission permits at normal pressure (elevated and critical are 1/2 and 1/4).
    pub tcp_sessions: Option<usize>,
    /// Concurrent UDP flows; the least recently used flow is evicted past it.
    pub udp_flows: Option<usize>,
    /// Kernel listener backlog.
    pub backlog: Option<u32>,
    /// Userspace relay buffer per direction, allocated only while data flows.
    pub relay_buffer: Option<usize>,
}

impl BudgetConfig {
    /// The first field that is set to zero, if any (every limit must admit
    /// at least one).
    pub fn zero_field(&self) -> Option<&'static str> {
        [
            ("nat_entries", self.nat_entries),
            ("tcp_sessions", self.tcp_sessions),
            ("udp_flows", self.udp_flows),
            ("relay_buffer", self.relay_buffer),
            ("backlog", self.backlog.map(|b| b as usize)),
        ]
        .into_iter()
        .find_map(|(name, v)| (v == Some(0)).then_some(name))
    }
}

/// Memory pressure as reported by the host (iOS dispatch source, Android
/// `onTrimMemory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum MemoryPressure {
    Normal = 0,
    Elevated = 1,
    Critical = 2,
}

impl MemoryPressure {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => MemoryPressure::Normal,
            1 => MemoryPressure::Elevated,
            _ => MemoryPressure::Critical,
        }
    }
}

/// How long a tier raised by the host holds with no new report before it
/// steps down one tier: critical to elevated after 2 minutes, to normal
/// after 4. Two minutes because sessions admitted before a warning have
/// mostly ended by then (servers close idle HTTP keep-alive connections
/// after 60 to 120 s, browsers drop idle pooled ones on similar timers), so
/// the footprint has had time to settle at the lower tier; if it climbs
/// again the host warns again and the clock restarts. One tier per step,
/// not straight back to normal, so a process still near its limit is
/// warned at the elevated tier before it admits the full count.
pub const PRESSURE_DECAY_STEP: Duration = Duration::from_secs(120);

/// The host's memory-pressure reports and how they decay (sans-I/O: every
/// call takes `now`). The latest report is the level at once, whether it
/// raises or lowers the tier; then every [`PRESSURE_DECAY_STEP`] without a
/// new report lowers it one tier, down to normal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PressureDecay {
    reported: MemoryPressure,
    /// When the host last reported (`None`: never, normal).
    at: Option<Instant>,
}

impl Default for PressureDecay {
    fn default() -> Self {
        Self::new()
    }
}

impl PressureDecay {
    pub const fn new() -> Self {
        PressureDecay {
            reported: MemoryPressure::Normal,
            at: None,
        }
    }

    /// The host reported `level` at `now`.
    pub fn report(&mut self, level: MemoryPressure, now: Instant) {
        self.reported = level;
        self.at = Some(now);
    }

    /// The level in force at `now`.
    pub fn level(&self, now: Instant) -> MemoryPressure {
        let Some(at) = self.at else {
            return self.reported;
        };
        let quiet = now.saturating_duration_since(at);
        let steps = quiet.as_millis() / PRESSURE_DECAY_STEP.as_millis();
        let steps = u8::try_from(steps).unwrap_or(u8::MAX);
        MemoryPressure::from_u8((self.reported as u8).saturating_sub(steps))
    }
}

/// Resolved limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Budget {
    pub platform: Platform,
    pub nat_entries: usize,
    /// Admission permits at normal, elevated and critical pressure.
    pub tcp_sessions: [usize; 3],
    pub udp_flows: usize,
    pub backlog: u32,
    pub relay_buffer: usize,
}

impl Budget {
    /// The platform defaults. iOS: 64/32/16 sessions and
    /// 16 KiB relay buffers, so 64 busy sessions cost at most 2 MiB of buffers.
    pub fn for_platform(platform: Platform) -> Self {
        match platform {
            Platform::Ios => Budget {
                platform,
                nat_entries: 2_048,
                tcp_sessions: [64, 32, 16],
                udp_flows: 128,
                backlog: 64,
                relay_buffer: 16 * 1024,
            },
            Platform::Android => Budget {
                platform,
                nat_entries: 8_192,
                tcp_sessions: [512, 256, 128],
                udp_flows: 512,
                backlog: 256,
                relay_buffer: 32 * 1024,
            },
            Platform::Desktop => Budget {
                platform,
                nat_entries: 50_000,
                tcp_sessions: [20_000, 10_000, 5_000],
                udp_flows: 4_096,
                backlog: 1_024,
                relay_buffer: 64 * 1024,
            },
        }
    }

    /// Platform defaults with the configured overrides applied.
    pub fn resolve(cfg: &BudgetConfig) -> Self {
        let mut b = Budget::for_platform(cfg.platform.unwrap_or(Platform::current()));
        if let Some(v) = cfg.nat_entries {
            b.nat_entries = v;
        }
        if let Some(v) = cfg.tcp_sessions {
            b.tcp_sessions = [v, (v / 2).max(1), (v / 4).max(1)];
        }
        if let Some(v) = cfg.udp_flows {
            b.udp_flows = v;
        }
        if let Some(v) = cfg.backlog {
            b.backlog = v;
        }
        if let Some(v) = cfg.relay_buffer {
            b.relay_buffer = v;
        }
        b
    }
}

/// TCP admission under memory pressure.
#[derive(Debug)]
pub struct Admission {
    limits: [usize; 3],
    /// Taken once per new session and per host report: never contended
    /// for long.
    pressure: Mutex<PressureDecay>,
    active: AtomicUsize,
}

/// A held admission; released on drop.
#[derive(Debug)]
pub struct Permit<'a> {
    owner: &'a Admission,
}

impl Admission {
    pub fn new(limits: [usize; 3]) -> Self {
        Self {
            limits,
            pressure: Mutex::new(PressureDecay::new()),
            active: AtomicUsize::new(0),
        }
    }

    /// The host reported `level` at `now` (see [`PressureDecay`]).
    pub fn set_pressure(&self, level: MemoryPressure, now: Instant) {
        self.pressure.lock().report(level, now);
    }

    /// The pressure in force at `now`: the host's last report, decayed.
    pub fn pressure(&self, now: Instant) -> MemoryPressure {
        self.pressure.lock().level(now)
    }

    /// The limit new sessions are checked against at `now`.
    pub fn limit(&self, now: Instant) -> usize {
        self.limits[self.pressure(now) as usize]
    }

    /// Sessions currently holding a permit.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Take a permit if the limit at `now` allows one. Never blocks.
    pub fn try_acquire(&self, now: Instant) -> Option<Permit<'_>> {
        // `then`, not `then_some`: a Permit built eagerly would be dropped on
        // refusal and release a permit nobody took.
        self.try_increment(now).then(|| Permit { owner: self })
    }

    fn try_increment(&self, now: Instant) -> bool {
        let limit = self.limit(now);
        self.active
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok()
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.owner.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An owned permit for session tasks (`'static`).
#[derive(Debug)]
pub struct OwnedPermit {
    owner: std::sync::Arc<Admission>,
}

impl Admission {
    /// [`Admission::try_acquire`] for an `Arc`, yielding a `'static` permit.
    pub fn try_acquire_owned(self: &std::sync::Arc<Self>, now: Instant) -> Option<OwnedPermit> {
        self.try_increment(now).then(|| OwnedPermit {
            owner: self.clone(),
        })
    }
}

impl Drop for OwnedPermit {
    fn drop(&mut self) {
        self.owner.active.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn ios_admission_follows_pressure_and_keeps_existing_permits() {
        let t = Instant::now();
        let a = Arc::new(Admission::new(
            Budget::for_platform(Platform::Ios).tcp_sessions,
        ));
        let held: Vec<_> = (0..40)
            .map(|_| a.try_acquire_owned(t).expect("permit"))
            .collect();
        a.set_pressure(MemoryPressure::Elevated, t);
        assert_eq!(a.limit(t), 32);
        assert!(
            a.try_acquire(t).is_none(),
            "40 held > 32: new sessions refused"
        );
        assert_eq!(a.active(), 40, "existing sessions keep their permits");
        drop(held);
        assert_eq!(a.active(), 0);
        let held: Vec<_> = (0..32)
            .map(|_| a.try_acquire_owned(t).expect("permit"))
            .collect();
        assert!(a.try_acquire(t).is_none());
        a.set_pressure(MemoryPressure::Critical, t);
        assert_eq!(a.limit(t), 16);
        a.set_pressure(MemoryPressure::Normal, t);
        assert_eq!(a.limit(t), 64);
        assert!(a.try_acquire(t).is_some());
        drop(held);
    }

    /// A critical warning and then silence: elevated after one step, normal
    /// after two, and admission follows. A new warning restarts the clock;
    /// the host's own "normal" takes effect at once.
    #[test]
    fn host_pressure_decays_after_quiet_minutes() {
        let t0 = Instant::now();
        let step = PRESSURE_DECAY_STEP;
        let a = Admission::new(Budget::for_platform(Platform::Ios).tcp_sessions);
        assert_eq!(a.pressure(t0), MemoryPressure::Normal, "never reported");
        a.set_pressure(MemoryPressure::Critical, t0);
        let held: Vec<_> = (0..16)
            .map(|_| a.try_acquire(t0).expect("permit"))
            .collect();
        assert!(a.try_acquire(t0 + step / 2).is_none(), "critical: 16");
        let just_before = t0 + step - Duration::from_millis(1);
        assert_eq!(a.pressure(just_before), MemoryPressure::Critical);
        assert_eq!(a.pressure(t0 + step), MemoryPressure::Elevated);
        assert_eq!(a.limit(t0 + step), 32);
        assert!(a.try_acquire(t0 + step).is_some(), "room again at elevated");
        assert_eq!(a.pressure(t0 + 2 * step), MemoryPressure::Normal);
        assert_eq!(a.pressure(t0 + 100 * step), MemoryPressure::Normal);
        assert_eq!(a.limit(t0 + 2 * step), 64);
        // A new warning while decaying restarts the clock from its level.
        let t1 = t0 + step + step / 2;
        a.set_pressure(MemoryPressure::Critical, t1);
        assert_eq!(a.pressure(t0 + 2 * step), MemoryPressure::Critical);
        assert_eq!(a.pressure(t1 + step), MemoryPressure::Elevated);
        // An elevated report decays straight to normal after one step.
        a.set_pressure(MemoryPressure::Elevated, t1);
        assert_eq!(a.pressure(t1 + step), MemoryPressure::Normal);
        // The host's own all-clear is immediate.
        a.set_pressure(MemoryPressure::Critical, t1);
        a.set_pressure(MemoryPressure::Normal, t1 + Duration::from_secs(1));
        assert_eq!(
            a.pressure(t1 + Duration::from_secs(1)),
            MemoryPressure::Normal
        );
        // A clock read before the report (another thread's older `now`)
        // sees the report undecayed.
        assert_eq!(
            {
                let mut d = PressureDecay::new();
                d.report(MemoryPressure::Critical, t1);
                d.level(t0)
            },
            MemoryPressure::Critical
        );
        drop(held);
    }

    #[test]
    fn overrides_apply() {
        let cfg = BudgetConfig {
            platform: Some(Platform::Android),
            tcp_sessions: Some(10),
            ..Default::default()
        };
        let b = Budget::resolve(&cfg);
        assert_eq!(b.tcp_sessions, [10, 5, 2]);
        assert_eq!(b.udp_flows, 512);
    }
}
