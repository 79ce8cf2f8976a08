//! Sending one uplink datagram on a flow the table found: gathered for a
//! GSO send, sent at once with a non-blocking send, or queued to the flow's
//! task. Apart from `mod.rs` because the gathering (`gather/`) sends through
//! it too.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use tokio::net::UdpSocket;
use tokio::sync::mpsc;

use super::flow::{Flow, FlowIo};
use super::gather::Gso;
use super::reply;
use crate::nat::FlowKey;
use crate::stats::{EngineDrop, LocalCounters};

/// Send one uplink datagram on `flow` (the flow table's entry for `key`):
/// gathered for a GSO send, sent at once, or queued to the flow's task.
/// Returns a flow whose path refused a GSO send (the caller stops
/// gathering for it).
#[allow(clippy::too_many_arguments)]
pub(super) fn send_on(
    flow: &mut Flow,
    key: FlowKey,
    gso: &mut Gso,
    mtu: u16,
    payload: &[u8],
    longest: Option<usize>,
    now: Instant,
    local: &mut LocalCounters,
) -> Option<FlowKey> {
    flow.last_up = now;
    let up = &flow.listed.record.up;
    up.fetch_add(payload.len() as u64, Relaxed);
    if let Some(longest) = longest {
        flow.state.lower_mtu(longest, key.server.is_ipv6());
    }
    let to = matches!(flow.io, FlowIo::Mapped(_)).then_some(key.server);
    match &mut flow.io {
        FlowIo::Direct(sock) | FlowIo::Mapped(sock) if flow.gso => {
            let fits = reply::udp_room(mtu, key.server).1;
            return gso.push(key, sock, to, payload, fits, local);
        }
        FlowIo::Direct(sock) | FlowIo::Mapped(sock) => {
            send_one(sock, to, payload, local);
        }
        FlowIo::Queued(q) => {
            // Charged at the buffer's capacity, a reassembled datagram's
            // excess over the MTU included.
            let Some(buf) = q.load(payload, now) else {
                local.drop(EngineDrop::UdpQueueFull);
                return None;
            };
            match q.tx.try_send(buf) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(b)) => {
                    q.keep(b);
                    local.drop(EngineDrop::UdpQueueFull)
                }
                // The association failed or ended; the flow idles out.
                Err(mpsc::error::TrySendError::Closed(b)) => {
                    q.keep(b);
                    local.drop(EngineDrop::UdpSendError)
                }
            }
        }
    }
    None
}

/// One non-blocking `send(2)` of a direct flow's datagram (`sendto(2)`
/// for a mapped flow: `to`), counted. True if the socket's send buffer was
/// full (the datagram is a counted drop).
pub(super) fn send_one(
    sock: &UdpSocket,
    to: Option<SocketAddr>,
    payload: &[u8],
    local: &mut LocalCounters,
) -> bool {
    // A direct non-blocking send(2): tokio's `try_send` consults its cached
    // readiness first and answers WouldBlock on a socket epoll has not yet
    // reported writable, which would drop every flow's first datagram.
    let sent = match to {
        None => socket2::SockRef::from(sock).send(payload),
        Some(to) => socket2::SockRef::from(sock).send_to(payload, &to.into()),
    };
    match sent {
        Ok(_) => {
            local.udp_packets_up += 1;
            local.udp_bytes_up += payload.len() as u64;
        }
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            local.drop(EngineDrop::UdpSendFull);
            return true;
        }
        Err(_) => local.drop(EngineDrop::UdpSendError),
    }
    false
}
