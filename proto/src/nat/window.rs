//! Ring-aware window clamping: the numbers behind it, kept pure.
//!
//! Every packet of the system stack crosses the TUN's transmit queue on its
//! way to the engine: the app's segments and the kernel listener's, data
//! one way and ACKs the other. The kernel's TUN transmit orphans each
//! packet before queueing it, so neither TCP is ever throttled by that
//! queue: a full queue drops, and the senders learn of it by
//! retransmitting. The only bound on what they keep in flight is the
//! window the other side advertises, and the listener autotunes its own to
//! megabytes. So the translation lowers the window of every segment it
//! rewrites (both directions, SYNs excepted) to a share of the queue:
//! what the queue holds ([`WindowBudget::queue_packets`]), less room for
//! the ACKs the data causes, split among the flow directions that carried
//! payload in the last two epochs ([`Busy`]: a flow moving data both ways
//! counts twice, one only acknowledging counts once), never below
//! [`FLOOR_SEGMENTS`] segments.
//!
//! A window field is scaled by the shift its sender announced in its SYN
//! (RFC 7323 2.2): the app's by the option in its SYN, the listener's by
//! the one in its SYN-ACK, and neither when either SYN lacked the option.
//! The flow's entry records both as its handshake passes through the
//! translation ([`WindowScale`]); until the SYN-ACK has passed, the flow
//! is not clamped.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use crate::packet::tcp::MAX_WINDOW_SCALE;

/// A window never clamped below this many full segments per flow, so a
/// flow among many still keeps several segments in flight.
pub const FLOOR_SEGMENTS: u32 = 4;

/// The share of the queue the busy flows' data may fill, as a fraction.
/// The rest is room for the segments the data causes the other way and
/// for bursts. With merged write-back the receiving TCP gets few, large
/// segments (the per-packet driver wrote 0.04-0.44 packets per packet it
/// read on the phone profile). Three quarters against a half, one run per MTU on the phone's own TUN: 0-28 %
/// more throughput at 16 and 64 streams at MTU 1500 and 4064 with the same
/// drops (at most 0.03 % of the queue's packets); the whole queue dropped
/// up to 0.10 % at 64 streams (docs/notes.md, "Window clamping: the data's
/// share of the queue").
pub const DATA_SHARE: (u64, u64) = (3, 4);

/// Window grants: with more flow directions busy than this, only this
/// many hold a grant at a time and advertise [`WindowBudget::granted`];
/// the others keep the right edge they advertised (their windows close as
/// their data is acknowledged) until a grant reopens them: their newest
/// ACK written again with the granted window. Fewer flows sending at once,
/// each with a larger window, cost less per byte than every flow sending a
/// few segments. On the phone's own TUN, against 8 grants, 2 took 9-23 %
/// more throughput at 9-20 % less CPU per byte at 16 and 64 streams and
/// every MTU, with drops of at most 0.04 % of the TUN's packets; 4 came
/// between the two, and 1 was faster still at MTU 1500 but leaves every
/// other busy direction waiting on one sender (docs/notes.md, "Window
/// grants: how many").
pub const GRANTS: usize = 2;

/// How long one grant lasts, in milliseconds; the driver also wakes this
/// often while ACKs wait for one.
pub const GRANT_MS: u64 = 4;

/// What a parked ACK may advertise now ([`NatTable::regrant`]).
///
/// [`NatTable::regrant`]: super::NatTable::regrant
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Regrant {
    /// Write it again with this window field (its edge is recorded).
    Open(u16),
    /// Every grant is held: keep it.
    Wait,
    /// Its flow is gone: drop it.
    Gone,
}

/// The grant slots: each free (0), or the direction that holds it (its
/// port and direction, plus one) and when it took it (ms since the table's
/// epoch, wrapping at 32 bits).
#[derive(Debug, Default)]
pub(super) struct Grants {
    slots: [AtomicU64; GRANTS],
}

impl Grants {
    fn key(port: u16, dir: Dir) -> u64 {
        ((u64::from(port) << 1) | dir as u64) + 1
    }

    fn live(slot: u64, now_ms: u64) -> bool {
        slot != 0 && (now_ms as u32).wrapping_sub(slot as u32) < GRANT_MS as u32
    }

    /// Whether `port`/`dir` holds a live grant.
    pub(super) fn holds(&self, port: u16, dir: Dir, now_ms: u64) -> bool {
        let code = Self::key(port, dir);
        self.slots.iter().any(|s| {
            let v = s.load(Relaxed);
            v >> 32 == code && Self::live(v, now_ms)
        })
    }

    /// Take a free or expired slot for `port`/`dir`.
    pub(super) fn take(&self, port: u16, dir: Dir, now_ms: u64) -> bool {
        let want = (Self::key(port, dir) << 32) | (now_ms & 0xFFFF_FFFF);
        for s in &self.slots {
            let v = s.load(Relaxed);
            if !Self::live(v, now_ms) && s.compare_exchange(v, want, Relaxed, Relaxed).is_ok() {
                return true;
            }
        }
        false
    }
}

/// Length of one [`Busy`] epoch in milliseconds: a flow counts as busy for
/// one to two epochs after its last packet.
pub const EPOCH_MS: u64 = 100;

/// A flow's direction, as the busy count tells them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dir {
    /// The app's segments.
    Up = 0,
    /// The listener's segments.
    Down = 1,
}

/// Shift code: the SYN had no window scale option.
pub(super) const NO_OPTION: u8 = 15;
/// Shift code: that SYN has not passed through the translation (yet).
pub(super) const UNSEEN: u8 = u8::MAX;

/// The shift code of a SYN's window scale option (`None`: it had none).
#[inline]
pub(super) fn code(option: Option<u8>) -> u8 {
    option.map_or(NO_OPTION, |s| s.min(MAX_WINDOW_SCALE))
}

/// What a flow's handshake said about window scaling, as far as it has
/// passed through the translation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowScale {
    app: u8,
    listener: u8,
}

impl Default for WindowScale {
    fn default() -> Self {
        Self::UNKNOWN
    }
}

impl WindowScale {
    /// Neither SYN seen.
    pub const UNKNOWN: Self = Self {
        app: UNSEEN,
        listener: UNSEEN,
    };

    /// From the codes a flow entry keeps.
    pub(super) fn from_codes(app: u8, listener: u8) -> Self {
        Self { app, listener }
    }

    /// The scale of the app's SYN option `app` and the listener's SYN-ACK
    /// option `listener` (`None`: no option), as the translation records
    /// them.
    pub fn new(app: Option<u8>, listener: Option<u8>) -> Self {
        Self::from_codes(code(app), code(listener))
    }

    /// `(app, listener)`: the shifts of the windows each side advertises,
    /// once both SYNs have passed; `(0, 0)` when either lacked the option
    /// (scaling is then off in both directions, RFC 7323 2.2); `None`
    /// before that.
    pub fn shifts(self) -> Option<(u8, u8)> {
        if self.app == UNSEEN || self.listener == UNSEEN {
            return None;
        }
        if self.app == NO_OPTION || self.listener == NO_OPTION {
            return Some((0, 0));
        }
        Some((self.app, self.listener))
    }
}

/// What the translation reads from the listener's SYN-ACK for the clamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynAck {
    /// Its window scale option (`None`: it had none).
    pub option: Option<u8>,
    /// Its sequence number: the listener's initial one.
    pub seq: u32,
    /// Its acknowledgment: the app's initial sequence number plus one.
    pub ack: u32,
    /// Its window field (never scaled in a SYN).
    pub window: u16,
}

/// Bytes beyond `ack` that a right edge `edge` already lets the sender
/// send (0 once `ack` has reached or passed it), in sequence space.
#[inline]
pub fn open(edge: u32, ack: u32) -> u32 {
    let ahead = edge.wrapping_sub(ack);
    if ahead == 0 || ahead > i32::MAX as u32 {
        0
    } else {
        ahead
    }
}

/// The window field at `shift` for a share of `want` bytes that does not
/// move the right edge back: at least the `open` bytes the sender was
/// already offered (rounded up to the field's unit), at most 0xFFFF.
///
/// A shrunk window is no mere throttle for the kernel's TCP: with its
/// next byte to send beyond the window's end, Linux sends its ACKs with
/// that end as their sequence number (`tcp_acceptable_seq`), below what
/// the peer has already received, and the peer drops them as old. When
/// both directions of a flow shrink, neither side hears the other's
/// acknowledgments, and the flow stalls until retransmission timeouts
/// back off past 20 s. That stall failed
/// `e2e::window_clamp_keeps_16_echoes_within_a_500_packet_queue` in 2 of
/// 4 runs before the edge was kept (docs/notes.md, "Window clamping on
/// the phone's TUN").
#[inline]
pub fn no_shrink_field(want: u32, open: u32, shift: u8) -> u16 {
    let shift = shift.min(MAX_WINDOW_SCALE);
    let keep = open.div_ceil(1 << shift);
    u16::try_from((want >> shift).max(keep)).unwrap_or(u16::MAX)
}

/// What the clamp is derived from: the TUN's transmit queue in packets and
/// the largest segment's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowBudget {
    /// Packets the TUN's transmit queue holds (its `txqueuelen`).
    pub queue_packets: u32,
    /// Payload bytes of a full segment (the MTU less the headers).
    pub mss: u32,
}

impl WindowBudget {
    /// Bytes one of `flows` busy flow directions may have in flight:
    /// [`DATA_SHARE`] of the queue, split evenly, at least
    /// [`FLOOR_SEGMENTS`].
    pub fn per_flow(self, flows: usize) -> u32 {
        let flows = u32::try_from(flows.max(1)).unwrap_or(u32::MAX);
        let (num, den) = DATA_SHARE;
        let data = u64::from(self.queue_packets) * num / den;
        let segments = u32::try_from(data / u64::from(flows))
            .unwrap_or(u32::MAX)
            .max(FLOOR_SEGMENTS);
        segments.saturating_mul(self.mss.max(1))
    }

    /// Bytes a grant holder may have in flight: the queue split as among
    /// twice [`GRANTS`] directions, since a holder whose grant ended keeps
    /// the window it was given until its data is acknowledged. (Split
    /// among [`GRANTS`] alone, 16 holders dropped 2-3.5 % of the queue's
    /// packets at 64 streams: docs/notes.md, "Window grants".)
    pub fn granted(self) -> u32 {
        self.per_flow(2 * GRANTS)
    }

    /// The window field that advertises `bytes` at `shift` (rounded down,
    /// at most 0xFFFF).
    pub fn field(bytes: u32, shift: u8) -> u16 {
        u16::try_from(bytes >> shift.min(MAX_WINDOW_SCALE)).unwrap_or(u16::MAX)
    }
}

/// How many flow directions carried payload recently: in the current
/// [`EPOCH_MS`] epoch, or in the previous one if that counted more. A
/// direction counts once per epoch (its first segment with payload in it,
/// stamped on the entry), so this costs one counter update per direction
/// per epoch, none per packet.
#[derive(Debug, Default)]
pub(super) struct Busy {
    epoch: AtomicU64,
    current: AtomicUsize,
    previous: AtomicUsize,
}

impl Busy {
    /// Count one direction's first segment with payload in `epoch`.
    #[inline]
    pub(super) fn note(&self, epoch: u64) {
        self.roll(epoch);
        self.current.fetch_add(1, Relaxed);
    }

    /// Directions busy in `epoch` or the one before it (the larger count).
    #[inline]
    pub(super) fn count(&self, epoch: u64) -> usize {
        self.roll(epoch);
        self.current.load(Relaxed).max(self.previous.load(Relaxed))
    }

    #[inline]
    fn roll(&self, epoch: u64) {
        let seen = self.epoch.load(Relaxed);
        if seen < epoch
            && self
                .epoch
                .compare_exchange(seen, epoch, Relaxed, Relaxed)
                .is_ok()
        {
            let ended = self.current.swap(0, Relaxed);
            let previous = if epoch == seen + 1 { ended } else { 0 };
            self.previous.store(previous, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shifts_need_both_syns_and_both_options() {
        assert_eq!(WindowScale::UNKNOWN.shifts(), None);
        assert_eq!(WindowScale::from_codes(7, UNSEEN).shifts(), None);
        assert_eq!(WindowScale::from_codes(UNSEEN, 7).shifts(), None);
        assert_eq!(WindowScale::new(Some(7), Some(9)).shifts(), Some((7, 9)));
        assert_eq!(WindowScale::new(Some(7), None).shifts(), Some((0, 0)));
        assert_eq!(WindowScale::new(None, Some(9)).shifts(), Some((0, 0)));
        assert_eq!(WindowScale::new(Some(20), Some(0)).shifts(), Some((14, 0)));
    }

    #[test]
    fn per_flow_splits_the_data_share_above_a_floor() {
        let b = WindowBudget {
            queue_packets: 500,
            mss: 1460,
        };
        assert_eq!(b.per_flow(0), 375 * 1460, "no busy flow counts as one");
        assert_eq!(b.per_flow(1), 375 * 1460);
        assert_eq!(b.per_flow(16), 23 * 1460);
        assert_eq!(b.per_flow(64), 5 * 1460);
        assert_eq!(b.per_flow(128), FLOOR_SEGMENTS * 1460, "the floor");
        assert_eq!(b.per_flow(usize::MAX), FLOOR_SEGMENTS * 1460);
        // Segments in flight across 16 flows, plus an ACK per three, fit.
        let segs = 16 * b.per_flow(16) / 1460;
        assert!(segs + segs / 3 <= 500, "{segs}");
        let huge = WindowBudget {
            queue_packets: u32::MAX,
            mss: u32::MAX,
        };
        assert_eq!(huge.per_flow(1), u32::MAX, "saturates");
    }

    #[test]
    fn field_scales_down_and_caps() {
        assert_eq!(WindowBudget::field(22_000, 0), 22_000);
        assert_eq!(WindowBudget::field(22_000, 7), 171);
        assert_eq!(WindowBudget::field(1_000_000, 0), u16::MAX);
        assert_eq!(WindowBudget::field(100, 9), 0, "the caller keeps it open");
        assert_eq!(WindowBudget::field(1 << 20, 30), 64, "shift capped at 14");
    }

    #[test]
    fn open_counts_bytes_ahead_of_the_ack_across_the_wrap() {
        assert_eq!(open(1000, 400), 600);
        assert_eq!(open(400, 1000), 0, "the ack passed the edge");
        assert_eq!(open(1000, 1000), 0);
        assert_eq!(open(100, u32::MAX - 99), 200, "across the wrap");
        assert_eq!(open(u32::MAX - 99, 100), 0);
    }

    #[test]
    fn no_shrink_field_keeps_the_edge_and_rounds_it_up() {
        // The share alone when nothing more was offered.
        assert_eq!(no_shrink_field(21_900, 0, 7), 171);
        assert_eq!(no_shrink_field(21_900, 10_000, 7), 171);
        // An edge 300,000 bytes ahead is kept: 300,000 / 128 rounded up
        // (2,344 * 128 = 300,032).
        assert_eq!(no_shrink_field(21_900, 300_000, 7), 2344);
        assert_eq!(no_shrink_field(5_840, 1_025, 10), 5, "5,840 >> 10");
        assert_eq!(
            no_shrink_field(0, 1_025, 10),
            2,
            "1,025 bytes need 2 KiB units"
        );
        assert_eq!(no_shrink_field(0, u32::MAX, 0), u16::MAX, "capped");
        assert_eq!(no_shrink_field(0, 1, 30), 1, "shift capped at 14");
    }

    #[test]
    fn busy_counts_flows_per_epoch_and_forgets_quiet_ones() {
        let b = Busy::default();
        assert_eq!(b.count(1), 0);
        for _ in 0..3 {
            b.note(1);
        }
        assert_eq!(b.count(1), 3);
        b.note(2);
        assert_eq!(b.count(2), 3, "the previous epoch counted more");
        b.note(2);
        b.note(2);
        b.note(2);
        assert_eq!(b.count(2), 4);
        assert_eq!(b.count(3), 4, "epoch 2 is now the previous");
        assert_eq!(b.count(5), 0, "two quiet epochs: nothing busy");
        b.note(9);
        assert_eq!(b.count(9), 1);
        assert_eq!(b.count(8), 1, "an older epoch does not roll back");
    }
}
