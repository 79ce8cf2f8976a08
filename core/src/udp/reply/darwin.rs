//! Darwin: a direct flow's replies, one `recvmsg` per datagram.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;

use tokio::net::UdpSocket;

use super::super::listed::TallyCache;
use super::{DARWIN_REPLY_MAX, recv_error_is_transient, send_reply, udp_room};
use crate::nat::FlowKey;
use crate::packet::HEADROOM;
use crate::stats::{EngineDrop, Stats};
use crate::udp::{ReplyState, UdpEnv};

/// Receive replies for one flow and write them to the TUN as IP packets from
/// its server to its client; without a `server` (an endpoint-independent
/// mapping's unconnected socket) from the source `recvmsg` names. The
/// buffer exists only while replies are arriving.
pub(crate) async fn reply_loop(
    sock: Arc<UdpSocket>,
    shared: Arc<UdpEnv>,
    client: SocketAddr,
    server: Option<SocketAddr>,
    state: Arc<ReplyState>,
) {
    let (hdr, max_payload) = udp_room(shared.mtu, client);
    let room = max_payload.max(DARWIN_REPLY_MAX);
    let mut buf: Option<Box<[u8]>> = None;
    let mut tally = TallyCache::default();
    loop {
        if sock.readable().await.is_err() {
            return;
        }
        let b = buf.get_or_insert_with(|| vec![0u8; HEADROOM + hdr + room].into_boxed_slice());
        // recvmsg, not recv: a datagram longer than the room is dropped and
        // counted, never passed on cut to the room's size.
        let room = &mut b[HEADROOM + hdr..];
        let got = sock.try_io(tokio::io::Interest::READABLE, || {
            crate::sys::recv_datagram(sock.as_fd(), room)
        });
        match got {
            Ok((_, true, _)) => {
                state.mark();
                Stats::drop(&shared.d.stats, EngineDrop::UdpReplyTooBig);
            }
            Ok((n, false, source)) => {
                state.mark();
                let Some(peer) = server.or(source) else {
                    Stats::drop(&shared.d.stats, EngineDrop::UdpSendError);
                    continue;
                };
                let key = FlowKey::new(client, peer);
                if send_reply(&shared, b, key, n, state.mtu()).await {
                    tally.count(&state.tally, peer, n);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => buf = None,
            // ICMP errors (port unreachable) surface as errors on a connected
            // UDP socket; the flow stays usable.
            Err(e) if recv_error_is_transient(&e) => {}
            Err(_) => return,
        }
    }
}
