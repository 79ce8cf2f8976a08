//! Replies: a flow's received datagrams turned back into IP packets from
//! its server to its client and written to the TUN. One function writes a
//! reply ([`write_reply`]: headers in place, one packet, or IP fragments
//! when it does not fit one); how replies are received is the platform's:
//!
//! * `linux.rs` (Linux, Android): up to 16 datagrams per `recvmmsg(2)`
//!   into a flow's slots, a thread's spill area for long ones;
//! * `darwin.rs` (macOS, iOS): one `recvmsg` per datagram.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use super::UdpEnv;
use crate::nat::FlowKey;
use crate::packet::{self, HEADROOM, IPV4_UDP_HEADERS, IPV6_UDP_HEADERS};
use crate::stats::{EngineDrop, Stats};

#[cfg_attr(linux_like, path = "linux.rs")]
#[cfg_attr(apple, path = "darwin.rs")]
mod imp;

pub(super) use imp::reply_loop;

/// Reply datagrams up to this size are sent to the app as IP fragments
/// when they do not fit one TUN packet (`packet::frag::fragment_at`; the
/// app's stack reassembles them), larger ones are dropped and counted
/// (`udp_reply_too_big`), never truncated. 16 KiB covers large DNS answers
/// over EDNS0 (4096 is the common buffer size), games, VoIP and tunnels at
/// jumbo sizes, and bounds what one receive takes: a direct flow's buffer
/// while replies arrive (freed when they stop), or on Linux/Android a reply
/// slot with its spill area ([`reply_loop`]).
pub(crate) const FRAGMENTED_REPLY_MAX: usize = 16 * 1024;

/// Identification of the reply datagrams the engine fragments (RFC 6864:
/// unique per source, destination and protocol while fragments may live).
static FRAG_ID: AtomicU32 = AtomicU32::new(1);

/// IP + UDP header bytes for datagrams from `server`, and the payload that
/// still fits one TUN packet of the device MTU (a larger DNS answer is
/// truncated with TC set; a larger reply datagram is fragmented).
pub(super) fn udp_room(mtu: u16, server: SocketAddr) -> (usize, usize) {
    let hdr = if server.is_ipv6() {
        IPV6_UDP_HEADERS
    } else {
        IPV4_UDP_HEADERS
    };
    (hdr, usize::from(mtu).saturating_sub(hdr))
}

/// Write the reply of `len` bytes at `b[HEADROOM + header..]` to the app as a
/// datagram from the flow's server to its client, headers written in place.
pub(super) async fn send_reply(env: &UdpEnv, b: &mut [u8], key: FlowKey, len: usize) {
    if write_reply(env, b, key, len).await {
        let stats: &Stats = &env.d.stats;
        stats.udp_packets_down.fetch_add(1, Relaxed);
        stats.udp_bytes_down.fetch_add(len as u64, Relaxed);
    }
}

/// [`send_reply`] without counting what was delivered: true if it was
/// (every failure is counted here).
pub(super) async fn write_reply(
    env: &UdpEnv,
    b: &mut [u8],
    FlowKey { client, server }: FlowKey,
    len: usize,
) -> bool {
    let stats: &Stats = &env.d.stats;
    let mtu = usize::from(env.mtu);
    match packet::write_udp_headers(&mut b[HEADROOM..], server, client, len) {
        Ok(total) if total <= mtu => {
            // Without waiting first: the device's queue is rarely full.
            let sent = match env.tun.try_send(b, total) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => env.tun.send(b, total).await,
                r => r,
            };
            if sent.is_err() {
                stats.drop(EngineDrop::TunWrite);
            }
            sent.is_ok()
        }
        Ok(total) => {
            // Larger than one TUN packet: as fragments, which the app's
            // stack puts back together. One buffer per such reply.
            let id = FRAG_ID.fetch_add(1, Relaxed);
            let pkt = &b[HEADROOM..HEADROOM + total];
            let mut frag = vec![0u8; HEADROOM + mtu];
            let mut off = 0;
            while let Some((n, next)) =
                packet::frag::fragment_at(pkt, mtu, id, off, &mut frag[HEADROOM..])
            {
                if env.tun.send(&mut frag, n).await.is_err() {
                    stats.drop(EngineDrop::TunWrite);
                    return false;
                }
                off = next;
            }
            if off == 0 {
                // The MTU leaves no room for a fragment (never below 1280).
                stats.drop(EngineDrop::UdpReplyTooBig);
                return false;
            }
            true
        }
        Err(r) => {
            stats.rejects[r.index()].fetch_add(1, Relaxed);
            false
        }
    }
}
