//! The per-packet path (`uplink`, `downlink`), a new SYN's entry (port
//! allocation, budget, replacement), and the full table's eviction of its
//! oldest unanswered entry.

use std::collections::VecDeque;
use std::collections::hash_map::Entry as MapEntry;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use super::key::PackedKey;
use super::shard::{ForwardShard, Mapping, Phase};
use super::window::{self, Regrant, SynAck, WindowBudget, WindowScale};
use super::{Evicted, FlowKey, NatError, NatTable, Refused, Stage, Uplink};

impl<P> NatTable<P> {
    /// Hot path, per uplink segment. `syn` is `Some(isn)` for a SYN without
    /// ACK (its initial sequence number), `None` for every other segment.
    ///
    /// * HalfOpen/Active entry: refresh it and return its port. A SYN with the
    ///   entry's ISN is a retransmit and reuses the mapping ([`Uplink::held`]
    ///   while the table holds that SYN for its connect).
    /// * Active entry, SYN with a *different* ISN, before the app sent a FIN
    ///   or an RST on it: a segment of the old connection, translated to its
    ///   port. The old connection's kernel socket answers it with a challenge
    ///   ACK (RFC 5961 4), so a SYN spoofed onto a live 4-tuple cannot end it;
    ///   the app's own TCP, whose side is still open, never sends one.
    /// * HalfOpen entry, or Active after the app's FIN or RST, SYN with a
    ///   *different* ISN: the app opened a new connection on the same 4-tuple
    ///   (its side of the old one is gone; a passive closer keeps no
    ///   TIME_WAIT) before the old session ended. Handled like a Closing
    ///   entry below; reusing the port would land the SYN on the old
    ///   connection's kernel socket, which in TIME_WAIT accepts it as a second
    ///   connection on the same NAT port. A half-open entry's attachment comes
    ///   back as [`Uplink::replaced`].
    /// * Closing entry, SYN (a new connection reusing the 4-tuple): the old
    ///   entry is removed from both maps and a *different* port is allocated,
    ///   `created = true`.
    /// * Closing entry, not a SYN: its port (late FIN/ACK), without extending
    ///   the linger.
    /// * No entry, SYN: a new `HalfOpen(New)` mapping, `created = true`. A
    ///   full table first evicts its oldest unanswered entry
    ///   ([`Uplink::evicted`], or [`Refused::evicted`] if the SYN is refused
    ///   all the same).
    /// * No entry, not a SYN: [`NatError::NoMapping`], counted; a stray
    ///   segment never allocates.
    ///
    /// A segment without FIN or RST; [`NatTable::uplink_segment`] says which.
    pub fn uplink(
        &self,
        key: &FlowKey,
        syn: Option<u32>,
        now: Instant,
    ) -> Result<Uplink<P>, Refused<P>> {
        self.uplink_segment(key, syn, false, now)
    }

    /// [`NatTable::uplink`] for a segment that says whether it carries the
    /// app's FIN or RST (`app_closing`), which lets a later SYN with another
    /// ISN replace the flow.
    pub fn uplink_segment(
        &self,
        key: &FlowKey,
        syn: Option<u32>,
        app_closing: bool,
        now: Instant,
    ) -> Result<Uplink<P>, Refused<P>> {
        self.uplink_data(key, syn, app_closing, false, now)
    }

    /// [`NatTable::uplink_segment`] that also counts the flow's uplink
    /// busy when the segment carries `data` (the window clamp's share,
    /// [`NatTable::busy_flows`]).
    pub fn uplink_data(
        &self,
        key: &FlowKey,
        syn: Option<u32>,
        app_closing: bool,
        data: bool,
        now: Instant,
    ) -> Result<Uplink<P>, Refused<P>> {
        let pk = PackedKey::new(key);
        let fshard = self.forward_shard(&pk);
        let now_ms = self.ms(now);
        {
            let fwd = fshard.read();
            if let Some(&port) = fwd.get(&pk) {
                // Forward then reverse: the lock order.
                let rev = self.reverse_shard(port).read();
                if let Some(m) = rev.map.get(&port).filter(|m| m.key == pk) {
                    match m.phase {
                        Phase::HalfOpen(_) | Phase::Active
                            if syn.is_none_or(|isn| isn == m.isn) =>
                        {
                            m.touch(now_ms);
                            self.note_data(m, window::Dir::Up, data, now_ms);
                            if app_closing && m.phase == Phase::Active {
                                m.app_closed.store(true, Relaxed);
                            }
                            let held =
                                syn.is_some() && m.phase == Phase::HalfOpen(Stage::Connecting);
                            return Ok(Uplink::existing(port, m.generation, held)
                                .with_scale(m.window_scale()));
                        }
                        // Another ISN on a connection the app has not closed:
                        // the old socket's to answer (not refreshed: a spoofer
                        // must not keep an idle flow alive).
                        Phase::Active if !m.app_closed.load(Relaxed) => {
                            self.errors.syn_on_active.fetch_add(1, Relaxed);
                            return Ok(Uplink::existing(port, m.generation, false));
                        }
                        Phase::HalfOpen(_) | Phase::Active => {} // new ISN: replaced below
                        Phase::Closing if syn.is_none() => {
                            return Ok(Uplink::existing(port, m.generation, false)
                                .with_scale(m.window_scale()));
                        }
                        Phase::Closing => {} // replaced below, under write locks
                    }
                }
                // A forward entry whose reverse side is missing or another
                // flow's breaks an invariant (check_invariants reports it);
                // never translate through it. A SYN repairs it below.
            }
        }
        let Some(isn) = syn else {
            self.errors.uplink_no_mapping.fetch_add(1, Relaxed);
            return Err(NatError::NoMapping.into());
        };
        // A full table makes room by evicting the oldest entry the kernel
        // never accepted, before the key's forward shard is locked (the
        // victim's may be another: one shard per map at a time). A flood
        // of SYNs that are never answered thus recycles its own entries
        // instead of locking out the next connection.
        let evicted = if self.len.load(Relaxed) >= self.cfg.max_entries {
            self.evict_unanswered()
        } else {
            None
        };
        match self.uplink_syn(pk, isn, fshard, now_ms) {
            Ok(mut up) => {
                up.evicted = evicted;
                Ok(up)
            }
            Err(error) => Err(Refused { error, evicted }),
        }
    }

    /// Remove the oldest entry that a SYN created and no accept answered
    /// (HalfOpen, or Closing after its connect failed), from both maps,
    /// counted as `evicted`.
    #[cold]
    fn evict_unanswered(&self) -> Option<Evicted<P>> {
        loop {
            let (port, generation) = self.unanswered.lock().pop_front()?;
            let key = {
                let rev = self.reverse_shard(port).read();
                match rev.map.get(&port) {
                    Some(m) if m.generation == generation => m.key,
                    _ => continue, // accepted, replaced or expired since
                }
            };
            // Forward before reverse: the lock order.
            let mut fwd = self.forward_shard(&key).write();
            let mut rev = self.reverse_shard(port).write();
            if rev
                .map
                .get(&port)
                .is_none_or(|m| m.generation != generation)
            {
                continue;
            }
            let Some((phase, payload)) = rev.remove(port) else {
                continue;
            };
            if fwd.get(&key) == Some(&port) {
                fwd.remove(&key);
            }
            self.len.fetch_sub(1, Relaxed);
            self.count_out(phase);
            self.errors.evicted.fetch_add(1, Relaxed);
            return Some(Evicted { port, payload });
        }
    }

    /// Queue a new entry as an eviction candidate. The queue holds stale
    /// entries too (accepted or removed since); past twice the budget it
    /// is pruned to the live ones, so its length stays within a small
    /// multiple of the budget and the pruning costs O(1) per entry
    /// amortised. No other lock is held while pruning.
    fn note_unanswered(&self, port: u16, generation: u64) {
        let len = {
            let mut q = self.unanswered.lock();
            q.push_back((port, generation));
            q.len()
        };
        if len <= 2 * self.cfg.max_entries.max(1) {
            return;
        }
        let old = std::mem::take(&mut *self.unanswered.lock());
        let kept: VecDeque<(u16, u64)> = old
            .into_iter()
            .filter(|&(p, g)| {
                self.reverse_shard(p)
                    .read()
                    .map
                    .get(&p)
                    .is_some_and(|m| m.generation == g)
            })
            .collect();
        let mut q = self.unanswered.lock();
        let newer = std::mem::replace(&mut *q, kept);
        q.extend(newer);
    }

    /// New-connection path: holds the key's forward shard for writing
    /// throughout, so concurrent SYNs of one flow agree on one port.
    #[cold]
    fn uplink_syn(
        &self,
        pk: PackedKey,
        isn: u32,
        fshard: &ForwardShard,
        now_ms: u64,
    ) -> Result<Uplink<P>, NatError> {
        let mut fwd = fshard.write();
        // The port of the entry being replaced.
        let mut replacing = None;
        if let Some(&port) = fwd.get(&pk) {
            let rev = self.reverse_shard(port).read();
            if let Some(m) = rev.map.get(&port).filter(|m| m.key == pk) {
                if m.phase == Phase::Active && m.isn != isn && !m.app_closed.load(Relaxed) {
                    // Accepted since the read above: the old connection's
                    // segment, as there.
                    self.errors.syn_on_active.fetch_add(1, Relaxed);
                    return Ok(Uplink::existing(port, m.generation, false));
                }
                if m.phase == Phase::Closing || m.isn != isn {
                    replacing = Some(port);
                } else {
                    // Another thread's SYN won the race, or a retransmit.
                    m.touch(now_ms);
                    let held = m.phase == Phase::HalfOpen(Stage::Connecting);
                    return Ok(Uplink::existing(port, m.generation, held));
                }
            }
        }
        // A replacement takes over the old entry's budget slot.
        if replacing.is_none() && !self.reserve() {
            self.errors.table_full.fetch_add(1, Relaxed);
            return Err(NatError::TableFull);
        }
        // The old Closing entry stays in the reverse map while probing, so
        // its port is skipped like any other in use: the new connection gets
        // a different port, and the kernel never sees the new SYN land on the
        // old connection's socket.
        let Some((port, generation)) = self.allocate(pk, isn, now_ms) else {
            if replacing.is_none() {
                self.len.fetch_sub(1, Relaxed);
            }
            self.errors.no_free_port.fetch_add(1, Relaxed);
            return Err(NatError::NoFreePort);
        };
        let mut replaced = None;
        if let Some(old) = replacing {
            // The old entry may have changed phase since it was read above
            // (its session ended: Closing; its accept came: Active, with a
            // new generation; its connect moved it on), but not flow: only
            // holders of this forward shard remove it. It goes whatever its
            // phase, and is counted out of the phase it has now.
            let mut rev = self.reverse_shard(old).write();
            let same_flow = rev.map.get(&old).is_some_and(|m| m.key == pk);
            match if same_flow { rev.remove(old) } else { None } {
                Some((phase, payload)) => {
                    self.count_out(phase);
                    replaced = payload;
                }
                // Cannot happen (see above), but the budget must stay exact
                // if it ever does: the new entry needs its own slot.
                None => {
                    self.len.fetch_add(1, Relaxed);
                }
            }
        }
        fwd.insert(pk, port);
        Ok(Uplink {
            port,
            created: true,
            generation,
            held: false,
            evicted: None,
            replaced,
            scale: WindowScale::UNKNOWN,
        })
    }

    /// Takes one budget slot, or returns false when none is left.
    fn reserve(&self) -> bool {
        let max = self.cfg.max_entries;
        self.len
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .is_ok()
    }

    /// Probes at most `max_probes` candidates from the rotating cursor and
    /// inserts a `HalfOpen(New)` mapping on the first vacant one: its port
    /// and the generation stamped on it.
    fn allocate(&self, key: PackedKey, isn: u32, now_ms: u64) -> Option<(u16, u64)> {
        if self.range_len == 0 {
            return None;
        }
        let probes = self.cfg.max_probes.min(self.range_len);
        for _ in 0..probes {
            let offset = self.cursor.fetch_add(1, Relaxed) % self.range_len;
            // start + offset <= end <= 65535, so this conversion never fails.
            let Ok(port) = u16::try_from(u32::from(self.range_start) + offset) else {
                continue;
            };
            if port == 0 {
                continue;
            }
            let mut rev = self.reverse_shard(port).write();
            if let MapEntry::Vacant(v) = rev.map.entry(port) {
                let generation = self.next_generation.fetch_add(1, Relaxed);
                let phase = Phase::HalfOpen(Stage::New);
                v.insert(Mapping {
                    generation,
                    last_seen: AtomicU64::new(now_ms),
                    key,
                    phase,
                    isn,
                    app_closed: AtomicBool::new(false),
                    app_wscale: AtomicU8::new(window::UNSEEN),
                    listener_wscale: AtomicU8::new(window::UNSEEN),
                    data_epoch: std::array::from_fn(|_| {
                        AtomicU8::new((now_ms / window::EPOCH_MS) as u8 ^ 0x80)
                    }),
                    edge: [AtomicU32::new(0), AtomicU32::new(0)],
                });
                self.count_in(phase);
                drop(rev);
                self.note_unanswered(port, generation);
                return Some((port, generation));
            }
        }
        None
    }

    /// Hot path, per downlink segment: the original flow of NAT port `port`,
    /// refreshing it (Closing entries are translated but not refreshed).
    /// `None` (counted) means drop the segment: never forward a wrong tuple.
    pub fn downlink(&self, port: u16, now: Instant) -> Option<FlowKey> {
        self.downlink_segment(port, None, false, now)
            .map(|(key, _)| key)
    }

    /// [`NatTable::downlink`] that also records what the window clamp needs
    /// of the listener's SYN-ACK (`syn_ack`: `Some` for a SYN-ACK), counts
    /// the direction busy if the segment carries `data`, and returns what
    /// the flow's handshake said about window scaling.
    pub fn downlink_segment(
        &self,
        port: u16,
        syn_ack: Option<SynAck>,
        data: bool,
        now: Instant,
    ) -> Option<(FlowKey, WindowScale)> {
        let rev = self.reverse_shard(port).read();
        match rev.map.get(&port) {
            Some(m) => {
                let now_ms = self.ms(now);
                m.touch(now_ms);
                self.note_data(m, window::Dir::Down, data, now_ms);
                if let Some(s) = syn_ack {
                    m.note_syn_ack(s);
                }
                Some((m.key.to_flow_key(), m.window_scale()))
            }
            None => {
                self.errors.downlink_no_mapping.fetch_add(1, Relaxed);
                None
            }
        }
    }

    /// Record the window scale option and the window of the app's SYN that
    /// created the entry at `port` (stamped `generation`; another entry
    /// there is left alone). Off the per-packet path: once per new flow.
    pub fn record_app_syn(&self, port: u16, generation: u64, option: Option<u8>, window: u16) {
        let rev = self.reverse_shard(port).read();
        if let Some(m) = rev.map.get(&port).filter(|m| m.generation == generation) {
            m.app_wscale.store(window::code(option), Relaxed);
            m.edge[window::Dir::Up as usize].store(u32::from(window), Relaxed);
        }
    }

    /// The window clamp's field for a segment of direction `dir` on the
    /// flow at `port` that acknowledges `ack` and advertises `field` at
    /// `shift`: the share `want` (bytes), raised to keep the right edge
    /// that direction already advertised ([`window::no_shrink_field`]),
    /// never above `field`. Records the edge the result advertises. A
    /// port with no entry gets `field` back. Two threads translating the
    /// same direction of one flow at once can record the lower of two
    /// edges; the next segment then keeps that one.
    pub(super) fn clamp_field(
        &self,
        port: u16,
        dir: window::Dir,
        ack: u32,
        field: u16,
        shift: u8,
        want: u32,
    ) -> u16 {
        let rev = self.reverse_shard(port).read();
        let Some(m) = rev.map.get(&port) else {
            return field;
        };
        let slot = &m.edge[dir as usize];
        let edge = slot.load(Relaxed);
        let out = window::no_shrink_field(want, window::open(edge, ack), shift)
            .max(1)
            .min(field);
        let shift = shift.min(crate::packet::tcp::MAX_WINDOW_SCALE);
        let advertised = ack.wrapping_add(u32::from(out) << shift);
        if window::open(advertised, edge) > 0 {
            slot.store(advertised, Relaxed);
        }
        out
    }

    /// The share a pure ACK of direction `dir` on the flow at `port` may
    /// advertise, and whether it is parked: with more busy directions than
    /// [`window::GRANTS`] and none carried by this direction itself, a
    /// grant holder gets [`WindowBudget::granted`]
    /// and any other is parked (0: its window keeps the edge it already
    /// advertised, and closes as its data is acknowledged); otherwise the
    /// busy flows' share. A free grant goes to the oldest parked ACK
    /// ([`NatTable::regrant`], at the end of a drain), not to whichever
    /// flow's ACK comes next, so that flows whose ACKs keep coming do not
    /// keep the grants from those waiting.
    pub(super) fn granted_want(
        &self,
        port: u16,
        dir: window::Dir,
        budget: WindowBudget,
        now: Instant,
    ) -> (u32, bool) {
        let busy = self.busy_flows(now);
        if busy <= window::GRANTS || self.sends_data(port, dir, now) {
            (budget.per_flow(busy), false)
        } else if self.grants.holds(port, dir, self.ms(now)) {
            (budget.granted(), false)
        } else {
            (0, true)
        }
    }

    /// Whether the direction `dir` of the flow at `port` carried payload
    /// in the last one to two epochs. Such a direction's ACKs are not
    /// parked: its data segments advertise windows too, and a copy of an
    /// older pure ACK written after them would not be taken as a window
    /// update (its sequence number is behind theirs).
    fn sends_data(&self, port: u16, dir: window::Dir, now: Instant) -> bool {
        let epoch = self.ms(now) / window::EPOCH_MS;
        let rev = self.reverse_shard(port).read();
        rev.map.get(&port).is_some_and(|m| m.sends_data(dir, epoch))
    }

    /// What a parked ACK of the flow at `port` (direction `down` or up,
    /// acknowledging `ack`, advertising `field` before the clamp, at
    /// `shift`) may advertise now: [`Regrant::Open`] with its window field
    /// (its edge recorded) when a grant was free or none is needed, else
    /// [`Regrant::Wait`]; [`Regrant::Gone`] when the flow has no entry.
    #[allow(clippy::too_many_arguments)]
    pub fn regrant(
        &self,
        port: u16,
        down: bool,
        ack: u32,
        field: u16,
        shift: u8,
        budget: WindowBudget,
        now: Instant,
    ) -> Regrant {
        if !self.reverse_shard(port).read().map.contains_key(&port) {
            return Regrant::Gone;
        }
        let dir = if down {
            window::Dir::Down
        } else {
            window::Dir::Up
        };
        let busy = self.busy_flows(now);
        let want = if busy <= window::GRANTS {
            budget.per_flow(busy)
        } else if self.grants.take(port, dir, self.ms(now)) {
            budget.granted()
        } else {
            return Regrant::Wait;
        };
        Regrant::Open(self.clamp_field(port, dir, ack, field, shift, want))
    }

    /// Flow directions that carried payload in the last one to two
    /// [`window::EPOCH_MS`] epochs (`window::Busy`): what the window clamp
    /// splits the queue among.
    #[inline]
    pub fn busy_flows(&self, now: Instant) -> usize {
        self.busy.count(self.ms(now) / window::EPOCH_MS)
    }

    /// Count `m`'s direction `dir` busy if its segment carries `data` and
    /// is its first with payload in this epoch.
    #[inline]
    fn note_data(&self, m: &Mapping, dir: window::Dir, data: bool, now_ms: u64) {
        let epoch = now_ms / window::EPOCH_MS;
        if data && m.carried(dir, epoch) {
            self.busy.note(epoch);
        }
    }
}
