//! An entry point for the criterion bench `smoltcp`
//! (`benches/benches/smoltcp.rs`), not part of the API: one inbound data
//! segment into the smoltcp stack, the way the driver hands it over
//! ([`Sockets::input`]), with a number of other connections open and
//! idle, and the session's read of what it carried.
//!
//! Built for tests and with the `bench-internals` feature only.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use ipnet::IpNet;

use super::device::Sink;
use super::half_open::Syn;
use super::sockets::Sockets;
use super::stream::SmolStream;
use super::wire;
use crate::nat::FlowKey;
use crate::packet::{self, HEADROOM, checksum, tcp_flags};
use crate::stats::Stats;

/// Payload of each measured segment: a full segment at MTU 1500.
pub const PAYLOAD: usize = 1460;
const BUFFER: usize = 64 * 1024;

/// The sink: keeps the sequence number of the last segment smoltcp sent
/// (the handshake needs the SYN-ACK's) and counts the rest.
#[derive(Debug, Default)]
struct Last {
    seq: u32,
    sent: u64,
}

impl Sink for Last {
    fn send(&mut self, buf: &mut [u8], len: usize) -> bool {
        let pkt = &buf[HEADROOM..HEADROOM + len];
        if let Ok(ip) = packet::parse_ip(pkt)
            && let Ok(t) = packet::parse_tcp(pkt, &ip)
        {
            self.seq = t.seq;
        }
        self.sent += 1;
        true
    }
}

/// An IPv4 TCP segment `key.client -> key.server` with valid checksums,
/// window 65535, carrying `data_len` bytes 0, 1, 2, ...
fn segment(key: FlowKey, seq: u32, ack: u32, flags: u8, data_len: usize) -> Vec<u8> {
    let data: Vec<u8> = (0..data_len).map(|i| i as u8).collect();
    wire::segment(key, seq, ack, flags, 65535, &[], &data)
}

fn fill(p: &mut [u8]) {
    if let Ok(ip) = packet::parse_ip(p) {
        p[36..38].fill(0);
        checksum::fill_transport_checksum(p, &ip);
    }
}

/// A stack with `idle` established, idle connections and one more that
/// the bench sends data on.
#[derive(Debug)]
pub struct Flows {
    st: Arc<Sockets>,
    stats: Stats,
    sink: Last,
    now: Instant,
    _idle: Vec<SmolStream>,
    active: SmolStream,
    /// The active flow's next data segment.
    pkt: Vec<u8>,
    seq: u32,
    buf: Vec<u8>,
    received: u64,
    segments: u64,
}

impl Flows {
    pub fn new(idle: usize) -> Flows {
        let nets: [IpNet; 1] = ["198.18.0.1/16".parse().expect("static prefix")];
        let st = Arc::new(Sockets::new(
            &nets,
            1500,
            BUFFER,
            Duration::from_secs(7440),
            Duration::from_secs(10),
            idle + 1,
        ));
        let stats = Stats::default();
        let mut sink = Last::default();
        let now = Instant::now();
        let mut open = |key: FlowKey| {
            let isn = 1000u32;
            let syn = segment(key, isn, 0, tcp_flags::SYN, 0);
            assert_eq!(st.syn(key), Syn::New, "bench setup: a new flow");
            let h = st
                .accept(key, &syn, now, &mut sink)
                .expect("bench setup: smoltcp takes the SYN");
            let ack = sink.seq.wrapping_add(1);
            let p = segment(key, isn + 1, ack, tcp_flags::ACK, 0);
            st.input(&p, now, &mut sink, &stats);
            (SmolStream::new(st.clone(), h, key, None), isn + 1, ack)
        };
        let server = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(1, 1, 1, 1)), 443);
        let idle: Vec<SmolStream> = (0..idle)
            .map(|i| {
                let client = SocketAddr::new(
                    IpAddr::V4(Ipv4Addr::new(10, 0, (i >> 8) as u8, i as u8)),
                    40000 + (i >> 16) as u16,
                );
                open(FlowKey::new(client, server)).0
            })
            .collect();
        let key = FlowKey::new(SocketAddr::from(([10, 1, 0, 1], 50000)), server);
        let (active, seq, ack) = open(key);
        Flows {
            st,
            stats,
            sink,
            now,
            _idle: idle,
            active,
            pkt: segment(key, seq, ack, tcp_flags::ACK | tcp_flags::PSH, PAYLOAD),
            seq,
            buf: vec![0u8; BUFFER],
            received: 0,
            segments: 0,
        }
    }

    /// One data segment of the active flow into the stack, and the
    /// session's read of its payload. The clock moves 1 µs per segment.
    pub fn segment(&mut self) {
        self.now += Duration::from_micros(1);
        self.pkt[24..28].copy_from_slice(&self.seq.to_be_bytes());
        fill(&mut self.pkt);
        self.st
            .input(&self.pkt, self.now, &mut self.sink, &self.stats);
        self.seq = self.seq.wrapping_add(PAYLOAD as u32);
        self.segments += 1;
        while let Poll::Ready(Ok(n)) = self.st.poll_recv(self.active.h, None, &mut self.buf) {
            if n == 0 {
                break;
            }
            self.received += n as u64;
        }
    }

    /// Whether the session read every byte sent so far: the bench measured
    /// the path, not a drop.
    pub fn all_received(&self) -> bool {
        self.segments > 0 && self.received == self.segments * PAYLOAD as u64
    }

    /// Sockets in the stack.
    pub fn sockets(&self) -> usize {
        self.st.counts().0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_segment_reaches_the_session_with_idle_flows_open() {
        let mut f = Flows::new(100);
        assert_eq!(f.sockets(), 101);
        for _ in 0..1000 {
            f.segment();
        }
        assert!(f.all_received());
        assert_eq!(f.received, 1000 * PAYLOAD as u64);
    }
}
