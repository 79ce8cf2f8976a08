//! Darwin: no segmentation offload for UDP sockets, so nothing is
//! gathered; every uplink datagram leaves with its own `send(2)`.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::UdpSocket;

use super::send::send_one;
use crate::nat::FlowKey;
use crate::stats::LocalCounters;

/// Flows never gather here.
pub(super) fn supported() -> bool {
    false
}

/// The gatherer of a platform without GSO: it holds nothing.
#[derive(Debug)]
pub(super) struct Gso;

impl Gso {
    pub(super) fn new() -> Self {
        Gso
    }

    /// Send the datagram at once (no flow gathers here, see [`supported`]).
    pub(super) fn push(
        &mut self,
        _key: FlowKey,
        sock: &Arc<UdpSocket>,
        to: Option<SocketAddr>,
        payload: &[u8],
        _fits: usize,
        local: &mut LocalCounters,
    ) -> Option<FlowKey> {
        send_one(sock, to, payload, local);
        None
    }

    /// Nothing is ever held.
    pub(super) fn flush(&mut self, _local: &mut LocalCounters) -> Option<FlowKey> {
        None
    }
}
