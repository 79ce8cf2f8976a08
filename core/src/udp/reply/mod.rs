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
/// when they do not fit one packet toward it (`packet::frag::fragment_at`;
/// the app's stack reassembles them), never truncated. On Linux/Android
/// (`reply/linux.rs`) this is every datagram UDP can carry (65,535 bytes of
/// IPv6 payload less the UDP header): a reply slot with its spill area
/// holds it, and a reply longer than its slot is copied out only while the
/// UDP byte budget has room (else dropped, `udp_reply_too_big`). Darwin
/// receives into one buffer per flow and keeps [`DARWIN_REPLY_MAX`]; a
/// proxied flow keeps [`PROXIED_REPLY_MAX`].
#[cfg_attr(apple, allow(dead_code))]
pub(crate) const FRAGMENTED_REPLY_MAX: usize = 65_535 - packet::udp::HEADER_LEN;

/// The longest reply a Darwin flow passes on, and so the size of its
/// receive buffer while replies arrive (`reply/darwin.rs`): 16 KiB covers
/// large DNS answers over EDNS0 (4096 is the common buffer size), games,
/// VoIP and tunnels at jumbo sizes. Longer ones are dropped and counted
/// (`udp_reply_too_big`).
#[cfg_attr(not(apple), allow(dead_code))]
pub(crate) const DARWIN_REPLY_MAX: usize = 16 * 1024;

/// The longest reply payload a proxied flow passes on (`proxied.rs`): its
/// receive buffer holds this and the proxy's framing while replies arrive.
pub(crate) const PROXIED_REPLY_MAX: usize = 16 * 1024;

/// A reply packet longer than this, written whole, goes without DF so a
/// router between the TUN and the app may fragment it
/// (`packet::frag::allow_fragmenting`): the least datagram every IPv4 host
/// takes (RFC 791), so shorter ones stay atomic (RFC 6864).
const V4_ATOMIC_MAX: usize = 576;

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

/// Whether a receive error leaves the flow usable: ICMP errors (port
/// unreachable) surface as errors on a connected UDP socket, and an
/// interrupted call is tried again on the next wake-up.
pub(super) fn recv_error_is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::Interrupted
    )
}

/// Write the reply of `len` bytes at `b[HEADROOM + header..]` to the app as a
/// datagram from the flow's server to its client, headers written in place;
/// a packet longer than `mtu` goes as fragments.
/// True if it was delivered.
pub(super) async fn send_reply(
    env: &UdpEnv,
    b: &mut [u8],
    key: FlowKey,
    len: usize,
    mtu: usize,
) -> bool {
    let delivered = write_reply(env, b, key, len, mtu).await;
    if delivered {
        let stats: &Stats = &env.d.stats;
        stats.udp_packets_down.fetch_add(1, Relaxed);
        stats.udp_bytes_down.fetch_add(len as u64, Relaxed);
    }
    delivered
}

/// [`send_reply`] without counting what was delivered: true if it was
/// (every failure is counted here).
pub(super) async fn write_reply(
    env: &UdpEnv,
    b: &mut [u8],
    FlowKey { client, server }: FlowKey,
    len: usize,
    mtu: usize,
) -> bool {
    let stats: &Stats = &env.d.stats;
    let mtu = mtu.min(usize::from(env.mtu));
    match packet::write_udp_headers(&mut b[HEADROOM..], server, client, len) {
        Ok(total) if total <= mtu => {
            if total > V4_ATOMIC_MAX {
                let id = FRAG_ID.fetch_add(1, Relaxed) as u16;
                packet::frag::allow_fragmenting(&mut b[HEADROOM..HEADROOM + total], id);
            }
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
