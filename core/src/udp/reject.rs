//! The answer to a datagram a `reject` rule refuses, or a proxy outbound
//! with `udp = false` (counted `udp_outbound_refused`): an ICMP "port
//! unreachable" written to the TUN, as the host would answer for a port
//! with no socket (`packet::port_unreachable`). A connected UDP socket in
//! the app then fails its next receive or send with `ECONNREFUSED`, so a
//! QUIC client or a resolver gives up at once instead of waiting out its
//! handshake timeout, which is what makes "reject QUIC so the app falls
//! back to TCP" quick (docs/configuration.md, "Domain rules"); a TCP
//! connection a rule refuses gets an RST, which the app sees as the same
//! error.
//!
//! Both stacks share this path: UDP never reaches smoltcp, the flow table
//! (`udp/mod.rs`) takes it for both.
//!
//! Bounded: answers are rate limited ([`BURST`], [`INTERVAL`]); beyond, a
//! refused datagram is still dropped and counted (`udp_rejected` or
//! `udp_outbound_refused`), and the answer it did not get is counted too
//! (`icmp_rate_limited`). The error is built in one buffer the flow table
//! owns, written with a non-blocking send (a full device queue is a
//! counted `tun_write`), nothing allocated per datagram.

use std::time::{Duration, Instant};

use crate::packet::icmp::ERROR_MAX_V6;
use crate::packet::{self, HEADROOM, IpInfo};
use crate::stats::{EngineDrop, LocalCounters};
use crate::tun::Tun;

/// Answers written back to back before the rate applies: a browser opening
/// a page starts a QUIC connection to each of a few dozen hosts within
/// milliseconds, and each should hear its refusal at once.
const BURST: u32 = 50;

/// One answer per 10 ms (100 a second) past the burst. An app needs one
/// answer per refused socket; a sender that keeps sending to a refused
/// destination (a flood, a broken client) costs the engine at most 100
/// extra TUN writes a second, a small share of what one flow's datagrams
/// cost it.
const INTERVAL: Duration = Duration::from_millis(10);

/// The rate limit (a token bucket of [`BURST`] tokens refilled one per
/// [`INTERVAL`], kept as the one instant the bucket is full again) and the
/// buffer answers are built in.
#[derive(Debug)]
pub(super) struct Unreachable {
    /// `HEADROOM` for the device's header, then the ICMP error.
    buf: Box<[u8; HEADROOM + ERROR_MAX_V6]>,
    /// When the bucket is full again (`None`: it is full).
    full_at: Option<Instant>,
}

impl Unreachable {
    pub fn new() -> Self {
        Self {
            buf: Box::new([0; HEADROOM + ERROR_MAX_V6]),
            full_at: None,
        }
    }

    /// Take one token at `now`: false when the bucket is empty.
    fn take(&mut self, now: Instant) -> bool {
        let full_at = self.full_at.map_or(now, |t| t.max(now));
        // The bucket holds BURST tokens: it is empty when refilling it
        // would take more than BURST - 1 intervals.
        if full_at.saturating_duration_since(now) > INTERVAL * (BURST - 1) {
            return false;
        }
        self.full_at = Some(full_at + INTERVAL);
        true
    }

    /// Answer the refused datagram `orig` (parsed as `ip`) with an ICMP
    /// port unreachable to the app, unless the rules of ICMP forbid an
    /// answer (a multicast or broadcast destination: nothing is sent) or
    /// the rate limit holds it back (counted).
    pub fn answer(
        &mut self,
        orig: &[u8],
        ip: &IpInfo,
        tun: &Tun,
        now: Instant,
        local: &mut LocalCounters,
    ) {
        let Some(n) = packet::port_unreachable(orig, ip, &mut self.buf[HEADROOM..]) else {
            return;
        };
        if !self.take(now) {
            return local.drop(EngineDrop::IcmpRateLimited);
        }
        if tun.try_send(&mut self.buf[..], n).is_err() {
            local.drop(EngineDrop::TunWrite);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A burst of BURST answers, then one per INTERVAL; an idle bucket
    /// fills up again, never beyond BURST.
    #[test]
    fn token_bucket_bounds_the_answers() {
        let mut u = Unreachable::new();
        let t0 = Instant::now();
        let taken = (0..200).filter(|_| u.take(t0)).count();
        assert_eq!(taken, BURST as usize);
        // One more per interval, not two.
        let t1 = t0 + INTERVAL;
        assert!(u.take(t1));
        assert!(!u.take(t1));
        // 10 intervals later: 10 tokens.
        let t2 = t1 + INTERVAL * 10;
        assert_eq!((0..100).filter(|_| u.take(t2)).count(), 10);
        // An hour idle: a full bucket, not more.
        let t3 = t2 + Duration::from_secs(3600);
        assert_eq!((0..200).filter(|_| u.take(t3)).count(), BURST as usize);
        // A steady 1 per interval is always answered.
        let t4 = t3 + Duration::from_secs(3600);
        for i in 0..1000 {
            assert!(u.take(t4 + INTERVAL * i), "{i}");
        }
    }
}
