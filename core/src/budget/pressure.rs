//! The host's memory pressure: the level it reported, how that level
//! decays when no new report comes ([`PressureDecay`], sans-I/O: every
//! call takes `now`), and the one-word form every budget reads on the
//! packet path ([`Pressure`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

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

/// The host's memory pressure as every budget reads it: one atomic word, so
/// the driver can read it on its path without a lock. It holds the last
/// report and when it came (nanoseconds from an epoch, either side of it);
/// the level in force decays from it as [`PressureDecay`] says.
#[derive(Debug)]
pub struct Pressure {
    /// Report times count from here.
    epoch: Instant,
    /// `level << 62 | (nanoseconds from epoch + PRESSURE_TIME_BIAS)`;
    /// 0: never reported.
    word: AtomicU64,
}

impl Default for Pressure {
    fn default() -> Self {
        Pressure {
            epoch: Instant::now(),
            word: AtomicU64::new(0),
        }
    }
}

const PRESSURE_TIME_MASK: u64 = (1 << 62) - 1;
/// Times within about 73 years either side of the epoch are exact.
const PRESSURE_TIME_BIAS: i128 = 1 << 61;

impl Pressure {
    /// The host reported `level` at `now`.
    pub fn report(&self, level: MemoryPressure, now: Instant) {
        let offset = match now.checked_duration_since(self.epoch) {
            Some(d) => d.as_nanos() as i128,
            None => -(self.epoch.duration_since(now).as_nanos() as i128),
        };
        let time = (offset + PRESSURE_TIME_BIAS).clamp(1, PRESSURE_TIME_MASK as i128) as u64;
        self.word
            .store(((level as u64) << 62) | time, Ordering::Relaxed);
    }

    /// The last report as a [`PressureDecay`].
    fn decay(&self) -> PressureDecay {
        let word = self.word.load(Ordering::Relaxed);
        let mut d = PressureDecay::new();
        if word != 0 {
            let offset = (word & PRESSURE_TIME_MASK) as i128 - PRESSURE_TIME_BIAS;
            let at = if offset >= 0 {
                self.epoch.checked_add(Duration::from_nanos(offset as u64))
            } else {
                self.epoch
                    .checked_sub(Duration::from_nanos((-offset) as u64))
            };
            d.report(
                MemoryPressure::from_u8((word >> 62) as u8),
                at.unwrap_or(self.epoch),
            );
        }
        d
    }

    /// The level in force at `now`.
    pub fn level(&self, now: Instant) -> MemoryPressure {
        self.decay().level(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-word pressure says what [`PressureDecay`] says.
    #[test]
    fn pressure_word_matches_the_decay() {
        let t0 = Instant::now();
        let p = Pressure::default();
        let mut d = PressureDecay::new();
        assert_eq!(p.level(t0), MemoryPressure::Normal);
        for (level, at) in [
            (MemoryPressure::Critical, t0 + Duration::from_millis(5)),
            (MemoryPressure::Elevated, t0 + Duration::from_secs(300)),
            (MemoryPressure::Normal, t0 + Duration::from_secs(301)),
            (MemoryPressure::Critical, t0 + Duration::from_secs(400)),
        ] {
            p.report(level, at);
            d.report(level, at);
            for later in [0, 1, 119, 120, 239, 240, 10_000] {
                let now = at + Duration::from_secs(later);
                assert_eq!(p.level(now), d.level(now), "{level:?} +{later}s");
            }
        }
    }
}
