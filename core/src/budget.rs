//! One platform budget for every bounded resource: NAT
//! entries, TCP admission permits, UDP flows, the listener backlog and relay
//! buffers all derive from it, so a phone's limits are set in one place.
//!
//! Admission is a counter, not a semaphore: raising the memory pressure lowers
//! the limit new sessions are checked against, while sessions that already
//! hold a permit keep it until they end.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

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
    pressure: AtomicU8,
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
            pressure: AtomicU8::new(MemoryPressure::Normal as u8),
            active: AtomicUsize::new(0),
        }
    }

    pub fn set_pressure(&self, level: MemoryPressure) {
        self.pressure.store(level as u8, Ordering::Relaxed);
    }

    pub fn pressure(&self) -> MemoryPressure {
        MemoryPressure::from_u8(self.pressure.load(Ordering::Relaxed))
    }

    /// The limit new sessions are checked against right now.
    pub fn limit(&self) -> usize {
        self.limits[self.pressure() as usize]
    }

    /// Sessions currently holding a permit.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Take a permit if the current limit allows one. Never blocks.
    pub fn try_acquire(&self) -> Option<Permit<'_>> {
        // `then`, not `then_some`: a Permit built eagerly would be dropped on
        // refusal and release a permit nobody took.
        self.try_increment().then(|| Permit { owner: self })
    }

    fn try_increment(&self) -> bool {
        let limit = self.limit();
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
    pub fn try_acquire_owned(self: &std::sync::Arc<Self>) -> Option<OwnedPermit> {
        self.try_increment().then(|| OwnedPermit {
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
        let a = Arc::new(Admission::new(
            Budget::for_platform(Platform::Ios).tcp_sessions,
        ));
        let held: Vec<_> = (0..40)
            .map(|_| a.try_acquire_owned().expect("permit"))
            .collect();
        a.set_pressure(MemoryPressure::Elevated);
        assert_eq!(a.limit(), 32);
        assert!(
            a.try_acquire().is_none(),
            "40 held > 32: new sessions refused"
        );
        assert_eq!(a.active(), 40, "existing sessions keep their permits");
        drop(held);
        assert_eq!(a.active(), 0);
        let held: Vec<_> = (0..32)
            .map(|_| a.try_acquire_owned().expect("permit"))
            .collect();
        assert!(a.try_acquire().is_none());
        a.set_pressure(MemoryPressure::Critical);
        assert_eq!(a.limit(), 16);
        a.set_pressure(MemoryPressure::Normal);
        assert_eq!(a.limit(), 64);
        assert!(a.try_acquire().is_some());
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
