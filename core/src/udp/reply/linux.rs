//! Linux and Android: a direct flow's replies, up to 16 per `recvmmsg(2)`.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use tokio::net::UdpSocket;

use super::super::listed::TallyCache;
use super::{FRAGMENTED_REPLY_MAX, recv_error_is_transient, udp_room, write_reply};
use crate::nat::FlowKey;
use crate::packet::HEADROOM;
use crate::stats::{EngineDrop, Stats};
use crate::udp::{ReplyState, UdpEnv};

/// Receive replies for one flow and write them to the TUN as IP packets from
/// `server` to `client`, up to `sys::udp::RECV_BATCH` (16) datagrams per
/// `recvmmsg(2)`, so one wake-up takes what queued up meanwhile. Without a
/// `server` (an endpoint-independent mapping's unconnected socket), each
/// datagram goes to the app from the peer `recvmmsg` names as its source.
///
/// Datagram `i` of a batch lands in slot `i` of the flow's buffer, room for
/// a reply that fits one TUN packet (at most [`SLOT_ROOM_MAX`]) behind space
/// for its headers, written in place. A longer one continues in the
/// thread's spill area ([`SPILL`], [`FRAGMENTED_REPLY_MAX`] per slot with
/// the slot's room: any datagram UDP carries), is copied out whole before
/// the next await, charged to the UDP byte budget (`budget.memory`'s UDP
/// queues) until it is written, and goes as fragments; one the budget has
/// no room for is dropped and counted (`udp_reply_too_big`), never passed
/// on cut short. The buffer (16 slots, about 24 KiB at MTU 1500) exists
/// only while replies are arriving.
///
/// A mapping's socket takes a batch shorter than 16 as the end of its
/// queue and clears its readiness with it, instead of asking once more only
/// to hear `WouldBlock`: one `recvmmsg` less per wake-up, half the calls of
/// a download paced at two datagrams a millisecond (docs/notes.md, "UDP
/// download: instructions per datagram"). A batch ends early only on an
/// empty queue or an error, and an unconnected socket is given no ICMP
/// errors; a datagram arriving after the receive raises a new readiness
/// event, which clearing the one this wake-up acted on does not erase.
/// (Kernels from before 2015 also ended a non-blocking receive at a
/// datagram whose checksum failed; there, what queued behind it waits for
/// the next datagram.) A connected socket reads on until `WouldBlock`: an
/// ICMP error pending on it ends a batch with datagrams still queued.
pub(crate) async fn reply_loop(
    sock: Arc<UdpSocket>,
    shared: Arc<UdpEnv>,
    client: SocketAddr,
    server: Option<SocketAddr>,
    state: Arc<ReplyState>,
) {
    use crate::sys::udp::{RECV_BATCH, Slots, recv_batch};
    let (hdr, max_payload) = udp_room(shared.mtu, client);
    let room = max_payload.clamp(1, SLOT_ROOM_MAX);
    let stride = HEADROOM + hdr + room;
    let spill_stride = FRAGMENTED_REPLY_MAX - room;
    let stats: &Stats = &shared.d.stats;
    let mut buf: Option<Box<[u8]>> = None;
    let mut got = [(0usize, false); RECV_BATCH];
    let mut from = [server; RECV_BATCH];
    let mut tally = TallyCache::default();
    loop {
        if sock.readable().await.is_err() {
            return;
        }
        let dense = buf.get_or_insert_with(|| batch_buffer(RECV_BATCH * stride));
        // Receive, and copy out what spilled, within one borrow of the
        // thread's spill area (no await in between).
        let mut spilled: Vec<(usize, Box<[u8]>)> = Vec::new();
        let mut charged = 0;
        let mut drained = None;
        let r = SPILL.with_borrow_mut(|spill| {
            let spill = spill
                .get_or_insert_with(|| vec![0u8; RECV_BATCH * SPILL_STRIDE_MAX].into_boxed_slice());
            let mut slots = Slots {
                dense: &mut dense[..],
                stride,
                start: HEADROOM + hdr,
                room,
                spill: &mut spill[..],
                spill_stride,
            };
            let names = server.is_none().then_some(&mut from[..]);
            let r = sock.try_io(tokio::io::Interest::READABLE, || {
                let n = recv_batch(sock.as_fd(), &mut slots, &mut got, names)?;
                if server.is_none() && n < RECV_BATCH {
                    // The queue is empty (above): tokio clears the
                    // readiness on WouldBlock; the batch is kept.
                    drained = Some(n);
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(n)
            });
            let n = match (r, drained) {
                (_, Some(n)) => n,
                (r, None) => r?,
            };
            for (i, &(len, trunc)) in got.iter().enumerate().take(n) {
                if len > room && !trunc {
                    // Held across the writes' awaits: charged, or dropped
                    // (below: a long datagram with no copy).
                    let cost = HEADROOM + hdr + len;
                    if !shared.queues.take(cost, Instant::now()) {
                        continue;
                    }
                    charged += cost;
                    let mut whole = vec![0u8; HEADROOM + hdr + len].into_boxed_slice();
                    let at = HEADROOM + hdr;
                    whole[at..at + room].copy_from_slice(&dense[i * stride + at..][..room]);
                    whole[at + room..].copy_from_slice(&spill[i * spill_stride..][..len - room]);
                    spilled.push((i, whole));
                }
            }
            Ok::<usize, io::Error>(n)
        });
        match r {
            Ok(n) => {
                state.mark();
                let mtu = state.mtu();
                let (mut packets, mut bytes) = (0u64, 0u64);
                let mut spilled = spilled.into_iter().peekable();
                for (i, &(len, trunc)) in got.iter().enumerate().take(n) {
                    // A mapping's peer, named by recvmmsg (never of
                    // another family than the socket's).
                    let Some(key) = from[i].map(|s| FlowKey::new(client, s)) else {
                        stats.drop(EngineDrop::UdpSendError);
                        continue;
                    };
                    let delivered = if trunc {
                        stats.drop(EngineDrop::UdpReplyTooBig);
                        false
                    } else if len <= room {
                        let b = &mut dense[i * stride..(i + 1) * stride];
                        write_reply(&shared, b, key, len, mtu).await
                    } else {
                        match spilled.next_if(|(j, _)| *j == i) {
                            Some((_, mut whole)) => {
                                write_reply(&shared, &mut whole, key, len, mtu).await
                            }
                            None => {
                                stats.drop(EngineDrop::UdpReplyTooBig);
                                false
                            }
                        }
                    };
                    if delivered {
                        packets += 1;
                        bytes += len as u64;
                        tally.count(&state.tally, key.server, len);
                    }
                }
                shared.queues.give_back(charged);
                if packets > 0 {
                    stats.udp_packets_down.fetch_add(packets, Relaxed);
                    stats.udp_bytes_down.fetch_add(bytes, Relaxed);
                }
                // The socket ran dry (its readiness is cleared): as below.
                if drained.is_some()
                    && let Some(b) = buf.take()
                {
                    keep_batch_buffer(b);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if let Some(b) = buf.take() {
                    keep_batch_buffer(b);
                }
            }
            // ICMP errors (port unreachable) surface as errors on a connected
            // UDP socket; the flow stays usable.
            Err(e) if recv_error_is_transient(&e) => {}
            Err(_) => return,
        }
    }
}

/// A batch buffer of at least `len` bytes: one a flow on this thread gave
/// back when its socket ran dry, else a new one. Taking and giving back
/// costs about 170 instructions a wake-up against about 35,000 for
/// allocating and zeroing a 16-slot buffer each time (callgrind, a loop of
/// the two; the method is in the commit that made this change), which a
/// download paid at each wake-up, often for one or two datagrams.
fn batch_buffer(len: usize) -> Box<[u8]> {
    BATCHES
        .with_borrow_mut(|p| {
            let i = p.iter().position(|b| b.len() >= len)?;
            Some(p.swap_remove(i))
        })
        .unwrap_or_else(|| vec![0u8; len].into_boxed_slice())
}

/// Give a flow's batch buffer back to this thread's pool (at most
/// [`BATCHES_KEPT`]; more are freed).
fn keep_batch_buffer(b: Box<[u8]>) {
    BATCHES.with_borrow_mut(|p| {
        if p.len() < BATCHES_KEPT {
            p.push(b);
        }
    });
}

/// Batch buffers a runtime thread keeps for its flows' next wake-ups: the
/// flows of a thread run one at a time, so one is taken and given back per
/// wake-up; a flow waiting on the TUN mid-batch keeps its own, hence two.
/// At MTU 9000, 2 x 34 KiB per thread.
const BATCHES_KEPT: usize = 2;

/// The most room a reply slot of [`reply_loop`] gives a datagram: QUIC's
/// and most UDP traffic's datagrams fit (at MTU 1500 the slot holds what
/// fits one TUN packet); longer ones continue in the spill area.
const SLOT_ROOM_MAX: usize = 2048;

/// Spill bytes per slot at most: a slot's room and its spill hold
/// [`FRAGMENTED_REPLY_MAX`] together.
const SPILL_STRIDE_MAX: usize = FRAGMENTED_REPLY_MAX;

thread_local! {
    /// Idle batch buffers of this thread's flows ([`batch_buffer`]).
    static BATCHES: std::cell::RefCell<Vec<Box<[u8]>>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Where the datagrams of a [`reply_loop`] batch that are longer than
    /// their slot continue: one area per worker thread, used only inside
    /// one synchronous receive (16 x 64 KiB, allocated zeroed on first use,
    /// so its pages become resident only as long datagrams arrive).
    static SPILL: std::cell::RefCell<Option<Box<[u8]>>> = const { std::cell::RefCell::new(None) };
}
