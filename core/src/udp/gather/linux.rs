//! Linux and Android: the uplink datagrams of one direct flow read in the
//! same drain leave with one GSO send (`UDP_SEGMENT`, Linux 4.18).

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;

use tokio::net::UdpSocket;

use super::send::send_one;
use crate::nat::FlowKey;
use crate::stats::{EngineDrop, LocalCounters};
use crate::sys::udp::{GSO_MAX_BYTES, GSO_MAX_SEGMENTS};

/// Whether flows gather at all: the kernel has `UDP_SEGMENT` (probed once
/// per process, `sys::udp::gso_supported`: an older kernel ignores the
/// control message and would send a whole batch as one datagram).
pub(super) fn supported() -> bool {
    crate::sys::udp::gso_supported()
}

/// Consecutive uplink datagrams of one direct flow, read in the same TUN
/// drain, gathered back to back for one GSO send (`UDP_SEGMENT`): every
/// datagram but the last has the first one's size, the last may be
/// shorter, at most [`GSO_MAX_SEGMENTS`] and [`GSO_MAX_BYTES`] in all. A
/// datagram of another flow, a longer one, or a full batch sends what is
/// gathered first, so each flow's datagrams keep their order. The kernel
/// then builds one packet for the batch instead of one per datagram, and
/// splits it at the device or in software.
#[derive(Debug, Default)]
pub(super) struct Gso {
    /// The payloads (allocated once, at the first batch).
    buf: Vec<u8>,
    key: Option<FlowKey>,
    sock: Option<Arc<UdpSocket>>,
    /// Where a mapped flow's batch goes (`None`: the socket is connected).
    to: Option<SocketAddr>,
    /// Size of every segment but the last.
    seg: usize,
    count: usize,
    /// A shorter datagram ended the batch.
    closed: bool,
}

impl Gso {
    pub(super) fn new() -> Self {
        Self::default()
    }

    /// Gather one datagram of flow `key`; only one whose packet fit the
    /// TUN (`fits`: its payload room) is gathered, a longer one (the app
    /// sent it as fragments) would exceed the path's MTU as a segment.
    /// Returns a flow whose path refused a GSO send while making room (it
    /// sends one by one from then on).
    pub(super) fn push(
        &mut self,
        key: FlowKey,
        sock: &Arc<UdpSocket>,
        to: Option<SocketAddr>,
        payload: &[u8],
        fits: usize,
        local: &mut LocalCounters,
    ) -> Option<FlowKey> {
        let len = payload.len();
        // Nothing to segment: an empty datagram, or one GSO cannot carry.
        let alone = len == 0 || len > fits.min(GSO_MAX_BYTES);
        let mut refused = None;
        if self.count > 0
            && (alone
                || self.key != Some(key)
                || self.closed
                || len > self.seg
                || self.count == GSO_MAX_SEGMENTS
                || self.buf.len() + len > GSO_MAX_BYTES)
        {
            refused = self.flush(local);
        }
        if alone || refused == Some(key) {
            // Nothing to segment (or this flow just lost GSO): as before.
            send_one(sock, to, payload, local);
            return refused;
        }
        if self.count == 0 {
            if self.buf.capacity() == 0 {
                self.buf.reserve_exact(GSO_MAX_BYTES);
            }
            self.key = Some(key);
            self.sock = Some(sock.clone());
            self.to = to;
            self.seg = len;
            self.closed = false;
        } else if len < self.seg {
            self.closed = true;
        }
        self.buf.extend_from_slice(payload);
        self.count += 1;
        refused
    }

    /// Send what is gathered: one datagram plainly, more with one GSO send.
    /// A batch the kernel refuses goes out one datagram at a time, each
    /// counted on its own, so an error loses nothing silently (a send
    /// buffer too full for the whole batch may still take some; once it
    /// takes none, the rest are counted `udp_send_full` without trying).
    /// If the refusal says the path cannot segment (`EIO`: no checksum
    /// offload or IPsec on the route; `EINVAL`: a segment above the path
    /// MTU), the flow is returned to stop gathering.
    pub(super) fn flush(&mut self, local: &mut LocalCounters) -> Option<FlowKey> {
        let (Some(sock), Some(key)) = (self.sock.take(), self.key.take()) else {
            return None;
        };
        let (count, seg) = (self.count, self.seg);
        self.count = 0;
        let mut refused = None;
        let to = self.to.take();
        if count == 1 {
            send_one(&sock, to, &self.buf, local);
        } else {
            let name = to.map(socket2::SockAddr::from);
            match crate::sys::udp::send_gso(sock.as_fd(), name.as_ref(), &self.buf, seg as u16) {
                Ok(_) => {
                    local.udp_packets_up += count as u64;
                    local.udp_bytes_up += self.buf.len() as u64;
                }
                Err(e) => {
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
                    ) {
                        refused = Some(key);
                    }
                    let mut full = false;
                    for d in self.buf.chunks(seg) {
                        if full {
                            local.drop(EngineDrop::UdpSendFull);
                        } else {
                            full = send_one(&sock, to, d, local);
                        }
                    }
                }
            }
        }
        self.buf.clear();
        refused
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::{Duration, Instant};

    use super::*;

    /// A receiving socket on loopback and a connected tokio socket to it.
    fn pair(v6: bool) -> (Arc<UdpSocket>, std::net::UdpSocket) {
        let any = if v6 { "[::1]:0" } else { "127.0.0.1:0" };
        let rx = std::net::UdpSocket::bind(any).expect("bind");
        rx.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let tx = std::net::UdpSocket::bind(any).expect("bind");
        tx.connect(rx.local_addr().expect("addr")).expect("connect");
        tx.set_nonblocking(true).expect("nonblocking");
        (Arc::new(UdpSocket::from_std(tx).expect("tokio")), rx)
    }

    fn datagram(i: usize, len: usize) -> Vec<u8> {
        (0..len)
            .map(|k| (i * 131 + k * 3 + k / 253) as u8)
            .collect()
    }

    fn key(v6: bool, port: u16) -> FlowKey {
        let ip: std::net::IpAddr = if v6 {
            "fd00::9".parse()
        } else {
            "10.0.0.9".parse()
        }
        .expect("static");
        FlowKey::new(SocketAddr::new(ip, port), SocketAddr::new(ip, 53))
    }

    /// Gathered uplink datagrams of two flows, interleaved, with runs of
    /// equal sizes, a short last segment, a longer one (ends a batch), an
    /// empty one and more than one batch holds (64): each flow's receiver
    /// gets every datagram whole and in order, v4 and v6, all counted sent.
    #[tokio::test]
    async fn gathered_datagrams_leave_whole_in_order_and_counted() {
        for v6 in [false, true] {
            let (a, rx_a) = pair(v6);
            let (b, rx_b) = pair(v6);
            let (ka, kb) = (key(v6, 1000), key(v6, 2000));
            let mut plan: Vec<(bool, usize)> = Vec::new();
            plan.extend(std::iter::repeat_n((true, 1200), 5));
            plan.extend([(true, 600), (true, 1200), (false, 1200), (false, 1200)]);
            plan.extend([(true, 1200), (true, 0), (true, 1)]);
            plan.extend(std::iter::repeat_n((true, 1000), 70));
            plan.extend([(true, 1300), (true, 1300), (false, 7)]);
            // Longer than one TUN packet: sent alone, in its place.
            plan.extend([(true, 1200), (true, 3000), (true, 1200), (true, 1200)]);
            let mut local = LocalCounters::new(Instant::now());
            let mut g = Gso::default();
            let mut sent = (Vec::new(), Vec::new());
            for (i, &(to_a, len)) in plan.iter().enumerate() {
                let d = datagram(i, len);
                let (k, s) = if to_a { (ka, &a) } else { (kb, &b) };
                assert_eq!(g.push(k, s, None, &d, 1472, &mut local), None);
                if to_a { &mut sent.0 } else { &mut sent.1 }.push(d);
            }
            assert_eq!(g.flush(&mut local), None);
            let mut buf = vec![0u8; 65536];
            for (rx, want) in [(&rx_a, &sent.0), (&rx_b, &sent.1)] {
                for (i, w) in want.iter().enumerate() {
                    let n = rx.recv(&mut buf).expect("datagram");
                    assert_eq!(&buf[..n], &w[..], "v6 {v6}: datagram {i}");
                }
            }
            assert_eq!(local.udp_packets_up, plan.len() as u64);
            let bytes: usize = plan.iter().map(|p| p.1).sum();
            assert_eq!(local.udp_bytes_up, bytes as u64);
            assert!(local.drops.iter().all(|&d| d == 0), "{:?}", local.drops);
            // A run of one flow left as one packet: a receiver with UDP_GRO
            // gets it whole, with the segment size, in one read.
            let (c, rx_c) = pair(v6);
            crate::sys::udp::testing::set_gro(rx_c.as_fd()).expect("UDP_GRO");
            let run: Vec<Vec<u8>> = (0..11)
                .map(|i| datagram(i, if i < 10 { 1200 } else { 500 }))
                .collect();
            for d in &run {
                assert_eq!(g.push(key(v6, 3000), &c, None, d, 1472, &mut local), None);
            }
            g.flush(&mut local);
            let (n, seg) =
                crate::sys::udp::testing::recv_gro(rx_c.as_fd(), &mut buf).expect("batch");
            assert_eq!((n, seg), (12_500, Some(1200)), "v6 {v6}");
            assert_eq!(&buf[..n], &run.concat()[..]);
        }
    }

    /// A batch the kernel refuses (here: a socket without UDP checksums,
    /// which GSO needs) goes out one datagram at a time, nothing lost and
    /// each counted, and the flow is named so it stops gathering. A send
    /// buffer too small for the whole batch takes it one by one too.
    #[tokio::test]
    async fn a_refused_batch_goes_one_by_one_counted() {
        let sizes: Vec<usize> = std::iter::repeat_n(1200, 8).chain([100]).collect();
        let k = key(false, 1000);
        let mut buf = vec![0u8; 65536];
        for small_buffer in [false, true] {
            let (s, rx) = pair(false);
            if small_buffer {
                // The kernel's minimum (about 4.5 KiB): 9 datagrams do not fit at once.
                socket2::SockRef::from(&*s)
                    .set_send_buffer_size(1)
                    .expect("sndbuf");
            } else {
                crate::sys::udp::testing::set_no_check(s.as_fd()).expect("SO_NO_CHECK");
            }
            let mut local = LocalCounters::new(Instant::now());
            let mut g = Gso::default();
            for (i, &l) in sizes.iter().enumerate() {
                assert_eq!(g.push(k, &s, None, &datagram(i, l), 1472, &mut local), None);
            }
            let refused = g.flush(&mut local);
            assert_eq!(
                refused,
                (!small_buffer).then_some(k),
                "small {small_buffer}"
            );
            for (i, &l) in sizes.iter().enumerate() {
                let n = rx.recv(&mut buf).expect("datagram");
                assert_eq!(&buf[..n], &datagram(i, l)[..], "small {small_buffer}: {i}");
            }
            assert_eq!(local.udp_packets_up, sizes.len() as u64);
            assert!(local.drops.iter().all(|&d| d == 0), "{:?}", local.drops);
        }
    }
}
