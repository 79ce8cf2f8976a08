//! The app's SYN, held while its outbound connects (both stacks).

use crate::packet::{self, HEADROOM};
use crate::stats::{EngineDrop, Stats};
use crate::tun::Tun;

/// A new connection's SYN, copied out of the driver's buffer (one small
/// allocation per connection, ~60-80 bytes) and held while the outbound
/// connects; then handed to the stack, or answered with an RST.
#[derive(Debug)]
pub(crate) struct HeldSyn(Box<[u8]>);

impl HeldSyn {
    /// Hold the packet `pkt` (headroom kept in front for the device header).
    pub fn new(pkt: &[u8]) -> Self {
        let mut b = vec![0u8; HEADROOM + pkt.len()].into_boxed_slice();
        b[HEADROOM..].copy_from_slice(pkt);
        HeldSyn(b)
    }

    /// The held packet.
    pub fn packet(&self) -> &[u8] {
        &self.0[HEADROOM..]
    }

    /// The held packet, to rewrite in place.
    pub fn packet_mut(&mut self) -> &mut [u8] {
        &mut self.0[HEADROOM..]
    }

    /// Write the (rewritten) packet to the TUN.
    pub async fn send(mut self, tun: &Tun, stats: &Stats) {
        let len = self.0.len() - HEADROOM;
        if tun.send(&mut self.0, len).await.is_err() {
            stats.drop(EngineDrop::TunWrite);
        }
    }

    /// Answer the app's SYN with an RST (the connect failed or was refused).
    pub async fn refuse(mut self, tun: &Tun, stats: &Stats) {
        let pkt = self.packet_mut();
        let n = match packet::parse_ip(pkt).and_then(|ip| Ok((ip, packet::parse_tcp(pkt, &ip)?))) {
            Ok((ip, tcp)) => packet::tcp_rst_reply(pkt, &ip, &tcp),
            // Parsed once already by the driver; cannot fail.
            Err(_) => return,
        };
        if n > 0 && tun.send(&mut self.0, n).await.is_err() {
            stats.drop(EngineDrop::TunWrite);
        }
    }
}
