//! Flows held before routing: QUIC sniffing, and the owner lookup.
//!
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
//! The owner lookup (`owner.rs`): a new flow that a `package` / `uid` rule
//! could match (`Dispatcher::plan` answers `Owner`, or `Sniff` when its
//! QUIC Initials are read too) asks the host for its owning app in a task
//! and is held the same way, bounded the same way, until the answer came
//! (or `owner::TIMEOUT` passed: routed without an owner, which no owner
//! rule matches). The task tells the driver when it answered
//! (`UdpEnv::held_answered`, a select arm of `driver::Head`), which routes
//! the flow then and sends what it held; the flow's next datagram and the
//! cleanup tick look too.
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

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::UdpTable;
use crate::dispatch::{Network, Refusal, Routing};
use crate::nat::FlowKey;
use crate::outbound::{Address, Route, Why};
use crate::owner::Owner;
use crate::packet::IpInfo;
use crate::sniff::Sniffed;
use crate::sniff::quic::QuicSniffer;
use crate::stats::{EngineDrop, LocalCounters};

pub(crate) use crate::budget::{QUIC_SNIFF_HELD as HELD_BYTES, QUIC_SNIFF_READING as READING_MAX};

/// Where the owner lookup's task leaves its answer (`None` inside: no
/// owner known, or the lookup failed).
type OwnerSlot = OnceLock<Option<Arc<Owner>>>;

/// A held flow, decided: its route, why it was taken, the routing
/// generation both belong to, where it goes (a fake address's domain, or
/// the address the app used), the domain its QUIC Initial named, its owner
/// (`asked`: whether it was looked up), and the datagrams held meanwhile.
pub(super) struct Decided {
    pub route: Route,
    pub why: Why,
    pub on: Arc<Routing>,
    pub dst: Address,
    pub sniffed: Option<Box<str>>,
    pub owner: Option<Arc<Owner>>,
    pub asked: bool,
    pub held: Vec<Vec<u8>>,
}

/// A new flow whose route waits for its QUIC Initials and/or its owner.
#[derive(Debug)]
pub(super) struct Reading {
    /// `None` when not sniffing, or once the sniffer answered.
    sniffer: Option<Box<QuicSniffer>>,
    /// What the sniffer answered.
    domain: Option<Box<str>>,
    /// `Some` while a rule needs the owner: the lookup's answer.
    owner: Option<Arc<OwnerSlot>>,
    /// The payloads held, in order.
    held: Vec<Vec<u8>>,
    bytes: usize,
    started: Instant,
    /// How long the flow may be held: the sniffing timeout, or the owner
    /// lookup's, whichever is longer of those it waits for.
    wait: Duration,
}

impl Reading {
    /// Whether something it waits for has not answered yet.
    fn waiting(&self) -> bool {
        self.sniffer.is_some() || self.owner.as_ref().is_some_and(|o| o.get().is_none())
    }

    fn due(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.started) >= self.wait
    }
}

/// A new flow held before routing, or a flow the rules refused by name.
#[derive(Debug)]
pub(super) enum Sniffing {
    Reading(Reading),
    /// Refused on its name or owner (a `reject` rule, or a proxy with
    /// `udp = false`); `last` datagram seen then, `why` the drop each of
    /// its datagrams counts.
    Refused {
        last: Instant,
        why: EngineDrop,
    },
}

impl UdpTable {
    /// Read one datagram of the flow `key`, held before routing (`quic`:
    /// its QUIC Initials are read; the owner is asked for when a rule
    /// needs it): the decision once made, with the datagrams held before
    /// this one, to be sent first; `None` while the flow waits, or when it
    /// is refused (answered and counted here).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sniff(
        &mut self,
        key: FlowKey,
        buf: &[u8],
        ip: &IpInfo,
        payload: &[u8],
        quic: bool,
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
            let r = self.start_reading(key, quic, now);
            self.sniffing.insert(key, Sniffing::Reading(r));
        }
        let r = match self.sniffing.get_mut(&key)? {
            Sniffing::Refused { last, why } => {
                *last = now;
                local.drop(*why);
                let tun = &self.shared.tun;
                self.unreachable.answer(buf, ip, tun, now, local);
                return None;
            }
            Sniffing::Reading(r) => r,
        };
        if let Some(sniffer) = &mut r.sniffer {
            let answer = match sniffer.push(payload) {
                Sniffed::NeedMore => None,
                Sniffed::Domain { name, .. } => Some(Some(Box::from(name))),
                _ => Some(None),
            };
            if let Some(domain) = answer {
                let stats = &self.shared.d.stats.dns;
                match domain.is_some() {
                    true => stats.sniffed.fetch_add(1, Relaxed),
                    false => stats.sniff_misses.fetch_add(1, Relaxed),
                };
                r.domain = domain;
                r.sniffer = None;
            }
        }
        if r.waiting() && r.bytes + payload.len() <= HELD_BYTES && !r.due(now) {
            r.bytes += payload.len();
            r.held.push(payload.to_vec());
            return None;
        }
        let Some(Sniffing::Reading(r)) = self.sniffing.remove(&key) else {
            return None;
        };
        match self.settle(key, r) {
            Ok(decided) => Some(decided),
            Err((refusal, held)) => {
                // This datagram and those held: all refused.
                let why = refusal.udp_drop();
                for _ in 0..=held {
                    local.drop(why);
                }
                if matches!(refusal, Refusal::Rule | Refusal::NoUdp) {
                    self.sniffing
                        .insert(key, Sniffing::Refused { last: now, why });
                    let tun = &self.shared.tun;
                    self.unreachable.answer(buf, ip, tun, now, local);
                }
                None
            }
        }
    }

    /// A new held flow: its sniffer if `quic`, and its owner asked for in
    /// a task when a rule needs it.
    fn start_reading(&self, key: FlowKey, quic: bool, now: Instant) -> Reading {
        let d = &self.shared.d;
        let mut wait = Duration::ZERO;
        if quic {
            wait = Duration::from_millis(d.routing().sniff.timeout_ms);
        }
        let owner = d.needs_owner(Network::Udp, key.server).then(|| {
            wait = wait.max(crate::owner::TIMEOUT);
            let slot = Arc::new(OwnerSlot::new());
            let (d, answer) = (d.clone(), slot.clone());
            let wake = self.shared.held_answered.clone();
            tokio::spawn(async move {
                let _ = answer.set(d.owner(Network::Udp, key.client, key.server).await);
                wake.notify_one();
            });
            slot
        });
        Reading {
            sniffer: quic.then(Box::default),
            domain: None,
            owner,
            held: Vec::new(),
            bytes: 0,
            started: now,
            wait,
        }
    }

    /// Route a held flow by what it learned (a sniffer that has not
    /// answered gave up: a miss), or why it is refused, with how many
    /// datagrams it held.
    fn settle(&self, key: FlowKey, r: Reading) -> Result<Decided, (Refusal, usize)> {
        let d = &self.shared.d;
        if r.sniffer.is_some() {
            d.stats.dns.sniff_misses.fetch_add(1, Relaxed);
        }
        let asked = r.owner.is_some();
        let owner = r.owner.and_then(|s| s.get().cloned().flatten());
        match d.route_held_udp(key.server, r.domain.as_deref(), owner.as_deref()) {
            Ok((route, why, dst, on)) => Ok(Decided {
                route,
                why,
                on,
                dst,
                sniffed: r.domain,
                owner,
                asked,
                held: r.held,
            }),
            Err(refusal) => Err((refusal, r.held.len())),
        }
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

    /// The cleanup tick's part: held flows whose sniffer has not answered
    /// within `sniff.timeout_ms`, or whose owner lookup answered (or ran
    /// out of time), are routed and their held datagrams sent (now, not
    /// gathered until the next drain); refused flows idle for
    /// `timeouts.udp_unreplied_s` are forgotten.
    /// What the driver waits on besides the device: an owner lookup of a
    /// held flow answered ([`UdpTable::settle_held`] routes it).
    pub fn held_answered(&self) -> Arc<tokio::sync::Notify> {
        self.shared.held_answered.clone()
    }

    /// Route the held flows whose owner lookup answered (and those due).
    pub fn settle_held(&mut self, now: Instant, local: &mut LocalCounters) {
        self.sweep_sniffing(now, local);
    }

    pub(super) fn sweep_sniffing(&mut self, now: Instant, local: &mut LocalCounters) {
        let unreplied = self.shared.unreplied;
        let mut due = Vec::new();
        self.sniffing.retain(|k, s| match s {
            Sniffing::Refused { last, .. } => now.saturating_duration_since(*last) < unreplied,
            Sniffing::Reading(r) => {
                if r.due(now) || !r.waiting() {
                    due.push(*k);
                }
                true
            }
        });
        let opened = !due.is_empty();
        for key in due {
            let Some(Sniffing::Reading(r)) = self.sniffing.remove(&key) else {
                continue;
            };
            match self.settle(key, r) {
                Ok(decided) => {
                    self.open_decided(key, decided, now, local);
                }
                Err((refusal, held)) => {
                    let why = refusal.udp_drop();
                    for _ in 0..held {
                        local.drop(why);
                    }
                    // Its next datagrams are refused as they come, not
                    // held and looked up again.
                    if matches!(refusal, Refusal::Rule | Refusal::NoUdp) {
                        self.sniffing
                            .insert(key, Sniffing::Refused { last: now, why });
                    }
                }
            }
        }
        // What the held datagrams put in the GSO gathering leaves now: no
        // drain ends after a tick to send it (`UdpTable::flush`).
        if opened {
            self.flush(local);
        }
    }
}

impl Sniffing {
    fn last_seen(&self) -> Instant {
        match self {
            Sniffing::Reading(r) => r.started,
            Sniffing::Refused { last, .. } => *last,
        }
    }

    /// How many datagrams a held flow holds; `None` if refused.
    fn held(&self) -> Option<usize> {
        match self {
            Sniffing::Reading(r) => Some(r.held.len()),
            Sniffing::Refused { .. } => None,
        }
    }
}
