//! QUIC sniffing: a new flow to a sniffed port, where a domain rule could
//! change its route (`Dispatcher::plan` answers `Sniff`, as for a TCP
//! connection), is routed by the server name in its QUIC Initial packets
//! (`kerntun_proto::sniff::quic::QuicSniffer`: the ClientHello's SNI, across
//! up to 4 Initials and 8 datagrams). While the sniffer needs more, the
//! flow's datagrams are held (copied, at most [`HELD_BYTES`]); once it
//! answers, the flow opens along the route the rules give the name (or the
//! address, when the datagrams name none: not QUIC, or no SNI) and the held
//! datagrams go first, in order. A flow past `sniff.timeout_ms` without an
//! answer is routed by its address with its next datagram or at the next
//! cleanup tick.
//!
//! A flow the rules refuse by its name is remembered as refused until it
//! idles out (`timeouts.udp_unreplied_s`): every datagram it sends is
//! answered as refused (`reject.rs`), so a later datagram that names
//! nothing (a 0-RTT or Handshake packet) cannot open it by its address.
//!
//! Bounded: at most [`READING_MAX`] flows read at once and
//! `budget.udp_flows` flows read or remembered, the oldest forgotten first
//! (the datagrams it held are counted as `udp_queue_full`; a QUIC client
//! sends its Initial again, and that is read anew). A sniffer holds at most
//! 32 KiB while it reads (its CRYPTO stream and one packet's plaintext,
//! `sniff::MAX_SNIFF` each) and its flow's held datagrams [`HELD_BYTES`]:
//! 768 KiB for all at most, and only while that many flows' first
//! datagrams are in flight. The copies are made only for these first
//! datagrams of a flow, never once it is open.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use super::UdpTable;
use crate::dispatch::Routing;
use crate::nat::FlowKey;
use crate::outbound::{Route, Why};
use crate::packet::IpInfo;
use crate::sniff::Sniffed;
use crate::sniff::quic::QuicSniffer;
use crate::stats::{EngineDrop, LocalCounters};

pub(crate) use crate::budget::{QUIC_SNIFF_HELD as HELD_BYTES, QUIC_SNIFF_READING as READING_MAX};

/// A sniffed flow's route, why it was taken, the routing generation both
/// belong to, the domain its QUIC Initial named (if any), and the datagrams held while it was read.
pub(super) type Decided = (Route, Why, Arc<Routing>, Option<Box<str>>, Vec<Vec<u8>>);

/// A new flow whose route waits for its QUIC Initials, or a flow the rules
/// refused by name.
#[derive(Debug)]
pub(super) enum Sniffing {
    Reading {
        sniffer: Box<QuicSniffer>,
        /// The payloads held, in order.
        held: Vec<Vec<u8>>,
        bytes: usize,
        started: Instant,
    },
    /// Refused on its name (a `reject` rule, or a proxy with `udp =
    /// false`); `last` datagram seen then, `why` the drop each of its
    /// datagrams counts.
    Refused { last: Instant, why: EngineDrop },
}

impl UdpTable {
    /// Read one datagram of the flow `key` (to a sniffed port): the route
    /// once decided, with the datagrams held before this one, to be sent
    /// first; `None` while the flow waits, or when it is refused (answered
    /// and counted here).
    pub(super) fn sniff(
        &mut self,
        key: FlowKey,
        buf: &[u8],
        ip: &IpInfo,
        payload: &[u8],
        now: Instant,
        local: &mut LocalCounters,
    ) -> Option<Decided> {
        if !self.sniffing.contains_key(&key) {
            let reading = self
                .sniffing
                .values()
                .filter(|s| s.held().is_some())
                .count();
            if reading >= READING_MAX {
                self.forget_oldest_sniffing(true, local);
            } else if self.sniffing.len() >= self.shared.max_flows {
                self.forget_oldest_sniffing(false, local);
            }
        }
        let entry = self
            .sniffing
            .entry(key)
            .or_insert_with(|| Sniffing::Reading {
                sniffer: Box::default(),
                held: Vec::new(),
                bytes: 0,
                started: now,
            });
        let (sniffer, held, bytes, started) = match entry {
            Sniffing::Refused { last, why } => {
                *last = now;
                local.drop(*why);
                let tun = &self.shared.tun;
                self.unreachable.answer(buf, ip, tun, now, local);
                return None;
            }
            Sniffing::Reading {
                sniffer,
                held,
                bytes,
                started,
            } => (sniffer, held, bytes, *started),
        };
        let timeout = Duration::from_millis(self.shared.d.routing().sniff.timeout_ms);
        let room = *bytes + payload.len() <= HELD_BYTES;
        let route = match sniffer.push(payload) {
            Sniffed::NeedMore if room && now.saturating_duration_since(started) < timeout => {
                *bytes += payload.len();
                held.push(payload.to_vec());
                return None;
            }
            Sniffed::Domain { name, .. } => {
                self.shared.d.stats.dns.sniffed.fetch_add(1, Relaxed);
                let route = self.shared.d.route_sniffed_udp(key.server, Some(name));
                route.map(|(r, why, on)| (r, why, on, Some(Box::from(name))))
            }
            _ => {
                self.shared.d.stats.dns.sniff_misses.fetch_add(1, Relaxed);
                let route = self.shared.d.route_sniffed_udp(key.server, None);
                route.map(|(r, why, on)| (r, why, on, None))
            }
        };
        let held = std::mem::take(held);
        let (route, why, on, name) = match route {
            Ok(routed) => routed,
            Err(refusal) => {
                // This datagram and those held: all refused.
                let why = refusal.udp_drop();
                for _ in 0..=held.len() {
                    local.drop(why);
                }
                self.sniffing
                    .insert(key, Sniffing::Refused { last: now, why });
                let tun = &self.shared.tun;
                self.unreachable.answer(buf, ip, tun, now, local);
                return None;
            }
        };
        self.sniffing.remove(&key);
        Some((route, why, on, name, held))
    }

    /// Forget the flow (of those being read, with `reading`) seen longest
    /// ago; the datagrams it held are counted as dropped. O(n) over a
    /// bounded map, only when it is full.
    fn forget_oldest_sniffing(&mut self, reading: bool, local: &mut LocalCounters) {
        let oldest = self
            .sniffing
            .iter()
            .filter(|(_, s)| !reading || s.held().is_some())
            .min_by_key(|(_, s)| s.last_seen())
            .map(|(k, _)| *k);
        if let Some(s) = oldest.and_then(|k| self.sniffing.remove(&k)) {
            for _ in 0..s.held().unwrap_or(0) {
                local.drop(EngineDrop::UdpQueueFull);
            }
        }
    }

    /// The cleanup tick's part: flows whose sniffer has not answered within
    /// `sniff.timeout_ms` are routed by their address and their held
    /// datagrams sent; refused flows idle for `timeouts.udp_unreplied_s`
    /// are forgotten.
    pub(super) fn sweep_sniffing(&mut self, now: Instant, local: &mut LocalCounters) {
        let timeout = Duration::from_millis(self.shared.d.routing().sniff.timeout_ms);
        let unreplied = self.shared.unreplied;
        let mut due = Vec::new();
        self.sniffing.retain(|k, s| match s {
            Sniffing::Refused { last, .. } => now.saturating_duration_since(*last) < unreplied,
            Sniffing::Reading { started, .. } => {
                if now.saturating_duration_since(*started) >= timeout {
                    due.push(*k);
                }
                true
            }
        });
        for key in due {
            let Some(Sniffing::Reading { held, .. }) = self.sniffing.remove(&key) else {
                continue;
            };
            self.shared.d.stats.dns.sniff_misses.fetch_add(1, Relaxed);
            let (route, why, on) = match self.shared.d.route_sniffed_udp(key.server, None) {
                Ok(routed) => routed,
                Err(refusal) => {
                    for _ in 0..held.len() {
                        local.drop(refusal.udp_drop());
                    }
                    continue;
                }
            };
            let dst = crate::outbound::Address::Ip(key.server);
            if self.open_planned(key, route, dst, &on, why, None, now, local) {
                for p in held {
                    self.forward(key, &p, None, now, local);
                }
            }
        }
    }
}

impl Sniffing {
    fn last_seen(&self) -> Instant {
        match self {
            Sniffing::Reading { started, .. } => *started,
            Sniffing::Refused { last, .. } => *last,
        }
    }

    /// How many datagrams a flow being read holds; `None` if refused.
    fn held(&self) -> Option<usize> {
        match self {
            Sniffing::Reading { held, .. } => Some(held.len()),
            Sniffing::Refused { .. } => None,
        }
    }
}
