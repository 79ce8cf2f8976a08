//! The device smoltcp sees: one received packet borrowed from the driver's
//! buffer (no copy) per poll, and transmits written straight to a [`Sink`]
//! (the TUN in the engine, a checker in tests and the fuzz target).

use std::sync::atomic::Ordering::Relaxed;

use smoltcp::phy::{Device, DeviceCapabilities, Medium, RxToken, TxToken};
use smoltcp::time::Instant as SmolInstant;

use crate::packet::HEADROOM;
use crate::stats::{EngineDrop, Stats};
use crate::tun::Tun;

/// Where transmitted segments go: the TUN in the engine, a vector in tests.
pub(crate) trait Sink {
    /// Send the packet at `buf[HEADROOM..HEADROOM + len]`; false if dropped.
    fn send(&mut self, buf: &mut [u8], len: usize) -> bool;
}

/// The engine's sink: a non-blocking TUN write.
pub(crate) struct TunSink<'a>(pub &'a Tun);

impl Sink for TunSink<'_> {
    fn send(&mut self, buf: &mut [u8], len: usize) -> bool {
        self.0.try_send(buf, len).is_ok()
    }
}

#[derive(Debug, Default)]
pub(super) struct TxCount {
    pub(super) packets: u64,
    pub(super) bytes: u64,
    pub(super) dropped: u64,
}

impl TxCount {
    pub(super) fn commit(&mut self, stats: &Stats) {
        if self.packets > 0 {
            stats.packets_down.fetch_add(self.packets, Relaxed);
            stats.tun_writes.fetch_add(self.packets, Relaxed);
            stats.bytes_down.fetch_add(self.bytes, Relaxed);
        }
        if self.dropped > 0 {
            stats.drops[EngineDrop::TunWrite as usize].fetch_add(self.dropped, Relaxed);
        }
        *self = TxCount::default();
    }
}

/// The largest pure ACK: an IPv6 header and a TCP header without options.
const HELD_MAX: usize = 60;

/// A pure ACK of one flow held back until the end of the driver's drain
/// (`Sockets::input_held`): a later one of the same flow replaces it, so
/// the app's TCP gets one cumulative ACK per flow and drain instead of one
/// per two segments, each a TUN write that runs the kernel's forwarding and
/// the app's TCP in the engine's system call.
#[derive(Debug, Clone, Copy)]
pub(super) struct Held {
    /// Bytes held (0: none).
    len: usize,
    ack: u32,
    /// HEADROOM, then the packet.
    buf: [u8; HEADROOM + HELD_MAX],
}

impl Default for Held {
    fn default() -> Self {
        Held {
            len: 0,
            ack: 0,
            buf: [0; HEADROOM + HELD_MAX],
        }
    }
}

impl Held {
    /// Write the held ACK out, if any.
    pub(super) fn flush<S: Sink>(&mut self, sink: &mut S, count: &mut TxCount) {
        if self.len > 0 {
            let len = std::mem::take(&mut self.len);
            if sink.send(&mut self.buf, len) {
                count.packets += 1;
                count.bytes += len as u64;
            } else {
                count.dropped += 1;
            }
        }
    }

    /// Forget the held ACK (its socket is gone).
    pub(super) fn clear(&mut self) {
        self.len = 0;
    }
}

/// The acknowledgment number of a pure ACK: flags ACK alone, no payload,
/// no options (a SACK block, say), no IP options or extension headers.
fn pure_ack(p: &[u8]) -> Option<u32> {
    use crate::packet::{ipv4, ipv6, protocol, tcp, tcp_flags};
    let l4 = match p.first().map(|b| b >> 4) {
        Some(4)
            if p.len() == ipv4::HEADER_LEN + tcp::HEADER_LEN
                && p[ipv4::field::VER_IHL] & 0x0f == 5
                && p[ipv4::field::PROTOCOL] == protocol::TCP =>
        {
            ipv4::HEADER_LEN
        }
        Some(6)
            if p.len() == ipv6::HEADER_LEN + tcp::HEADER_LEN
                && p[ipv6::field::NEXT_HEADER] == protocol::TCP =>
        {
            ipv6::HEADER_LEN
        }
        _ => return None,
    };
    let t = &p[l4..];
    let plain = t[12] >> 4 == 5 && t[tcp::field::FLAGS] == tcp_flags::ACK;
    plain.then(|| u32::from_be_bytes([t[8], t[9], t[10], t[11]]))
}

/// The device smoltcp sees for one poll: at most one received packet
/// (borrowed from the driver's buffer, no copy), transmits into `sink`;
/// with `hold`, pure ACKs are held there instead (see [`Held`]).
pub(super) struct Dev<'a, S: Sink> {
    pub(super) rx: Option<&'a [u8]>,
    pub(super) tx: &'a mut [u8],
    pub(super) sink: &'a mut S,
    pub(super) count: &'a mut TxCount,
    pub(super) mtu: usize,
    pub(super) hold: Option<&'a mut Held>,
}

pub(super) struct Rx<'a>(&'a [u8]);

impl RxToken for Rx<'_> {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(self.0)
    }
}

pub(super) struct Tx<'a, S: Sink> {
    buf: &'a mut [u8],
    sink: &'a mut S,
    count: &'a mut TxCount,
    hold: Option<&'a mut Held>,
}

impl<S: Sink> TxToken for Tx<'_, S> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let end = HEADROOM + len;
        if end > self.buf.len() {
            // smoltcp honours the MTU it was given; should it not, the
            // segment is built and dropped (counted) rather than panicking.
            let mut tmp = vec![0u8; len];
            self.count.dropped += 1;
            return f(&mut tmp);
        }
        let r = f(&mut self.buf[HEADROOM..end]);
        shade_window(&mut self.buf[HEADROOM..end]);
        if let Some(held) = self.hold {
            match pure_ack(&self.buf[HEADROOM..end]) {
                // Cumulative: a newer ACK says all the held one said. A
                // duplicate ACK (same number) is no newer: both go out.
                Some(ack) if held.len == 0 || (ack.wrapping_sub(held.ack) as i32) > 0 => {
                    held.buf[..end].copy_from_slice(&self.buf[..end]);
                    held.len = len;
                    held.ack = ack;
                    return r;
                }
                // Anything else of the flow goes out after what is held.
                _ => held.flush(self.sink, self.count),
            }
        }
        if self.sink.send(self.buf, len) {
            self.count.packets += 1;
            self.count.bytes += len as u64;
        } else {
            self.count.dropped += 1;
        }
        r
    }
}

impl<S: Sink> Device for Dev<'_, S> {
    type RxToken<'b>
        = Rx<'b>
    where
        Self: 'b;
    type TxToken<'b>
        = Tx<'b, S>
    where
        Self: 'b;

    fn receive(&mut self, _: SmolInstant) -> Option<(Rx<'_>, Tx<'_, S>)> {
        let pkt = self.rx.take()?;
        Some((
            Rx(pkt),
            Tx {
                buf: self.tx,
                sink: self.sink,
                count: self.count,
                hold: self.hold.as_deref_mut(),
            },
        ))
    }

    fn transmit(&mut self, _: SmolInstant) -> Option<Tx<'_, S>> {
        Some(Tx {
            buf: self.tx,
            sink: self.sink,
            count: self.count,
            hold: self.hold.as_deref_mut(),
        })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ip;
        caps.max_transmission_unit = self.mtu;
        caps
    }
}

/// Advertise one window unit less than smoltcp does, so that the right
/// edge the app is told never passes an edge smoltcp will hold it to.
///
/// With window scaling smoltcp advertises its free space rounded down to the
/// scale unit (2^shift bytes, 16 with the desktop buffers) and trims every
/// segment at the edge of its *last* advertisement. Between two ACKs that
/// edge can move back by up to a unit minus one byte (the rounding remainder
/// grows as the buffer fills), so bytes the app sent inside the earlier edge
/// are dropped. If the buffer is then full, smoltcp takes no segment whose
/// sequence number is not exactly the next one it expects, ACK and window
/// field included (RFC 9293 3.10.7.4 asks to process them): every ACK the
/// app sends carries its SND.NXT, past the dropped bytes, so smoltcp never
/// learns that the app opened its window, and an echo-style session stalls
/// for good (`tests::window_edge_never_strands_the_sender` reproduces it).
/// One unit less keeps the advertised edge at least a
/// unit behind every edge smoltcp can later enforce (those never fall more
/// than a unit below its buffer end, which only moves forward), so nothing
/// sent inside it is dropped and the app's SND.NXT is smoltcp's next
/// expected sequence number when the window closes. SYN segments (window
/// not scaled) and RSTs are left alone; a zero window stays zero.
///
/// In place on a segment smoltcp just built (complete IPv4/IPv6 header, no
/// extension headers, valid checksum), with an RFC 1624 checksum update.
pub(super) fn shade_window(p: &mut [u8]) {
    use crate::packet::{checksum, ipv4, ipv6, protocol, tcp, tcp_flags};
    let l4 = match p.first().map(|b| b >> 4) {
        Some(4) if p.len() >= ipv4::HEADER_LEN && p[ipv4::field::PROTOCOL] == protocol::TCP => {
            usize::from(p[ipv4::field::VER_IHL] & 0x0f) * 4
        }
        Some(6) if p.len() >= ipv6::HEADER_LEN && p[ipv6::field::NEXT_HEADER] == protocol::TCP => {
            ipv6::HEADER_LEN
        }
        _ => return,
    };
    let Some(t) = p.get_mut(l4..l4 + tcp::HEADER_LEN) else {
        return;
    };
    if t[tcp::field::FLAGS] & (tcp_flags::SYN | tcp_flags::RST) != 0 {
        return;
    }
    let old = [t[tcp::field::WINDOW.start], t[tcp::field::WINDOW.start + 1]];
    let win = u16::from_be_bytes(old);
    if win == 0 {
        return;
    }
    let new = (win - 1).to_be_bytes();
    t[tcp::field::WINDOW].copy_from_slice(&new);
    let sum = u16::from_be_bytes([
        t[tcp::field::CHECKSUM.start],
        t[tcp::field::CHECKSUM.start + 1],
    ]);
    let sum = checksum::nonzero(checksum::update(sum, checksum::replaced(&old, &new)));
    t[tcp::field::CHECKSUM].copy_from_slice(&sum.to_be_bytes());
}
