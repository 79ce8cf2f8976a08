//! The packet demux: every packet the driver reads is parsed once here and
//! handed to what owns its protocol. TCP goes to the stack
//! ([`Stack::tcp`]), UDP to the flow table (`udp::UdpTable`, owned here, so
//! the uplink datagram path takes no locks), an ICMP echo request to the
//! gateway is answered in place, and IP fragments wait in the reassembler
//! until their datagram is whole. No I/O of the device: the readers in
//! `driver/` read, call [`Demux::process`] and write back what it asks for.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::nat::Regrant;
use crate::network::Addresses;
use crate::packet::frag::{Limits, Reassembler};
use crate::packet::{self, Disposition, IpInfo, Reject, protocol};
use crate::stack::Stack;
use crate::stats::{EngineDrop, LocalCounters, Stats};
use crate::udp::UdpTable;

/// The per-packet processing every reader shares: the stack for TCP, the
/// flow table for UDP, echo replies for pings to the gateway, reassembly.
#[derive(Debug)]
pub(crate) struct Demux {
    stack: Stack,
    udp: UdpTable,
    /// IP fragments from the app, until their datagram is whole.
    frags: Reassembler,
    /// Where a reassembled datagram is written (kept while small).
    frag_out: Vec<u8>,
    /// The TUN's own addresses (IPv4, IPv6): pings to them are answered.
    gateways: (Option<IpAddr>, Option<IpAddr>),
    stats: Arc<Stats>,
    pub local: LocalCounters,
    /// The clock reading for the current drain (one `Instant::now()` per edge).
    pub now: Instant,
    /// Pure ACKs whose window was held at its edge for want of a window
    /// grant, as they were written, oldest first: reopened when grants come
    /// free (`kerntun_proto::nat::GRANTS`), at the end of each drain.
    parked: std::collections::VecDeque<ParkedAck>,
}

/// Most parked ACKs kept (one per flow direction; about 140 bytes each,
/// allocated with the demux). Past it an ACK is not kept (counted,
/// `parked_ack_not_kept`), and its sender waits for its persist timer to
/// ask for the window again.
const PARKED_MAX: usize = 1024;

// The parked ACKs are within their line of the memory budget's worst case
// (`budget::write_back_bytes`).
const _: () = assert!(PARKED_MAX * size_of::<ParkedAck>() <= crate::budget::PARKED_ACKS_BYTES);

/// A parked ACK as it was written, with the headroom the TUN write needs.
#[derive(Debug)]
struct ParkedAck {
    p: crate::translate::Parked,
    len: usize,
    buf: [u8; packet::HEADROOM + kerntun_proto::packet::ackthin::ACK_MAX],
}

impl Demux {
    pub fn new(
        stack: Stack,
        udp: UdpTable,
        gateways: (Option<IpAddr>, Option<IpAddr>),
        stats: Arc<Stats>,
    ) -> Self {
        let now = Instant::now();
        Self {
            stack,
            udp,
            frags: Reassembler::new(Limits::default()),
            frag_out: Vec::new(),
            gateways,
            stats,
            local: LocalCounters::new(now),
            now,
            parked: std::collections::VecDeque::with_capacity(PARKED_MAX),
        }
    }

    /// Keep the pure ACK at `pkt`, whose window was just held for want of
    /// a grant (`local.parked`), in place of its flow direction's older one
    /// (keeping that one's turn), unless it is behind that one in sequence.
    fn park(&mut self, pkt: &[u8]) {
        let Some(p) = self.local.parked.take() else {
            return;
        };
        if pkt.len() > crate::packet::ackthin::ACK_MAX {
            return self.local.drop(EngineDrop::ParkedAckNotKept);
        }
        let at = self
            .parked
            .iter()
            .position(|e| e.p.port == p.port && e.p.down == p.down);
        let e = match at {
            // A probe behind the copy keeps the copy (`Parked::replaces`).
            Some(i) if !p.replaces(&self.parked[i].p) => return,
            Some(i) => &mut self.parked[i],
            None if self.parked.len() < PARKED_MAX => {
                self.parked.push_back(ParkedAck {
                    p,
                    len: 0,
                    buf: [0; packet::HEADROOM + crate::packet::ackthin::ACK_MAX],
                });
                self.parked.back_mut().expect("pushed")
            }
            None => return self.local.drop(EngineDrop::ParkedAckNotKept),
        };
        e.p = p;
        e.len = pkt.len();
        e.buf[packet::HEADROOM..packet::HEADROOM + pkt.len()].copy_from_slice(pkt);
    }

    /// Whether parked ACKs wait for grants.
    pub fn has_parked(&self) -> bool {
        !self.parked.is_empty()
    }

    /// Write the parked ACKs that free grants reopen, oldest first: each
    /// again with its window raised to the grant (the same sequence and
    /// acknowledgment numbers and timestamps, so the sender's TCP takes it
    /// as a window update). A write the device refuses is counted and the
    /// ACK dropped: its sender's persist timer asks again.
    fn regrant(&mut self) {
        let Stack::System(sys) = &self.stack else {
            self.parked.clear();
            return;
        };
        while let Some(e) = self.parked.front_mut() {
            let field = match sys.regrant(&e.p, self.now) {
                Regrant::Open(field) => field,
                Regrant::Wait => return,
                Regrant::Gone => {
                    self.parked.pop_front();
                    continue;
                }
            };
            let len = e.len;
            let pkt = &mut e.buf[packet::HEADROOM..packet::HEADROOM + len];
            if let Ok(ip) = packet::parse_ip(pkt) {
                packet::set_window(pkt, &ip, field);
            }
            self.local.writes += 1;
            if sys.write(&mut e.buf, len).is_err() {
                self.local.drop(EngineDrop::TunWrite);
            }
            self.parked.pop_front();
        }
    }

    /// Process one packet in place: `WriteBack(n)` asks the driver to write
    /// `buf[..n]` to the TUN.
    #[inline]
    pub fn process(&mut self, buf: &mut [u8]) -> Disposition {
        let ip = match packet::parse_ip(buf) {
            Ok(ip) => ip,
            Err(Reject::Ipv4Fragment | Reject::Ipv6Fragment) => {
                self.fragment(buf);
                return Disposition::Done;
            }
            Err(r) => {
                self.local.reject(r);
                return Disposition::Done;
            }
        };
        match ip.protocol {
            protocol::TCP => {
                let d = self.stack.tcp(buf, &ip, self.now, &mut self.local);
                if self.local.parked.is_some() {
                    if let Disposition::WriteBack(n) = d {
                        self.park(&buf[..n]);
                    }
                    self.local.parked = None;
                }
                d
            }
            protocol::UDP => {
                self.udp.handle(buf, &ip, self.now, &mut self.local);
                Disposition::Done
            }
            protocol::ICMP | protocol::ICMPV6 => self.icmp(buf, &ip),
            _ => {
                self.local.reject(packet::Reject::UnsupportedProtocol);
                Disposition::Done
            }
        }
    }

    /// One IP fragment: held until its datagram is whole, which then takes
    /// the UDP path like any datagram (only UDP is reassembled; TCP never
    /// needs it). Every discard is counted.
    #[cold]
    fn fragment(&mut self, buf: &[u8]) {
        let mut out = std::mem::take(&mut self.frag_out);
        let local = &mut self.local;
        let pushed = self.frags.push(buf, self.now, &mut out, |d| {
            local.drop(EngineDrop::of_frag(d));
        });
        match pushed {
            Ok(Some(n)) => match packet::parse_ip(&out[..n]) {
                Ok(ip) if ip.protocol == protocol::UDP => {
                    let longest = self.frags.longest_fragment();
                    self.udp
                        .handle_reassembled(&out[..n], &ip, longest, self.now, &mut self.local);
                }
                _ => self.local.drop(EngineDrop::FragMalformed),
            },
            Ok(None) => {}
            Err(d) => self.local.drop(EngineDrop::of_frag(d)),
        }
        // A buffer that held a large datagram is not kept.
        if out.capacity() <= 16 * 1024 {
            self.frag_out = out;
        }
    }

    fn icmp(&mut self, buf: &mut [u8], ip: &IpInfo) -> Disposition {
        let gateway = match ip.dst {
            IpAddr::V4(_) => self.gateways.0,
            IpAddr::V6(_) => self.gateways.1,
        };
        if gateway == Some(ip.dst)
            && let Ok(n) = packet::echo_reply_in_place(buf, ip)
        {
            self.local.icmp_echo_replies += 1;
            return Disposition::WriteBack(n);
        }
        self.local.drop(EngineDrop::IcmpUnhandled);
        Disposition::Done
    }

    /// Whether a packet to be written back goes to the TUN's own address:
    /// the system stack's uplink to its kernel listener, always delivered
    /// locally, so a packet above the MTU never has to leave the host. Its
    /// TCP data segments may be merged with their flow's neighbours (the
    /// write-back tells them from the rest, `driver/writeback.rs`).
    pub fn to_listener(&self, pkt: &[u8]) -> bool {
        match pkt.first().map(|b| b >> 4) {
            Some(4) => pkt.get(16..20).is_some_and(|d| {
                self.gateways.0 == Some(IpAddr::from(<[u8; 4]>::try_from(d).unwrap_or_default()))
            }),
            Some(6) => pkt.get(24..40).is_some_and(|d| {
                self.gateways.1 == Some(IpAddr::from(<[u8; 16]>::try_from(d).unwrap_or_default()))
            }),
            _ => false,
        }
    }

    /// Whether TCP goes through the system stack (translated and written
    /// back), not smoltcp.
    pub fn system_stack(&self) -> bool {
        matches!(self.stack, Stack::System(_))
    }

    /// Whether the kernel verifies the app's data segments of known flows
    /// (the system stack on a Linux TUN without offload): the write-back
    /// then merges them untranslated without summing them either.
    pub fn defers_data_sums(&self) -> bool {
        matches!(&self.stack, Stack::System(s) if s.defers_data_sums())
    }

    /// Count `n` packets read in this drain, which ended: what the stack
    /// held back during it goes out.
    pub fn read_done(&mut self, n: u64) {
        self.stack.drain_done();
        self.local.read_done(n, &self.stats, self.now);
    }

    /// Whether the last drain aborted tasks whose resources are freed only
    /// when the runtime drops them (evicted UDP flows and their sockets).
    pub fn owes_yield(&mut self) -> bool {
        self.udp.take_evicted()
    }

    /// Whether there is state a cleanup tick could expire.
    pub fn has_state(&self) -> bool {
        self.stack.has_state() || self.udp.has_state() || !self.frags.is_empty()
    }

    /// The periodic cleanup: NAT entries, unaccepted outbounds, idle UDP
    /// flows, datagrams whose fragments stopped coming.
    pub fn cleanup(&mut self, now: Instant) {
        self.stack.cleanup(now);
        self.udp.sweep(now, &mut self.local);
        let stats = &self.stats;
        self.frags
            .expire(now, |d| Stats::drop(stats, EngineDrop::of_frag(d)));
    }

    /// Told when a held UDP flow's owner lookup answered.
    pub fn held_answered(&self) -> Arc<tokio::sync::Notify> {
        self.udp.held_answered()
    }

    /// Route the held UDP flows whose owner lookup answered: their held
    /// datagrams leave now.
    pub fn settle_held(&mut self, now: Instant) {
        self.udp.settle_held(now, &mut self.local);
    }

    /// The host moved to another network: close the direct UDP flows whose
    /// sockets it stranded (`udp::UdpTable::network_changed`).
    pub fn network_changed(&mut self, addrs: &Addresses) {
        self.udp.network_changed(addrs, &mut self.local);
    }

    /// A drain ended: the uplink datagrams gathered in it leave now (one GSO
    /// send per flow's run of datagrams, `udp::UdpTable::flush`); a reader
    /// that found the device `empty` is about to sleep, so what it counted
    /// is published too.
    pub fn drained(&mut self, empty: bool) {
        self.udp.flush(&mut self.local);
        if !self.parked.is_empty() {
            self.regrant();
        }
        if empty {
            self.commit(self.now);
        }
    }

    /// The engine's shared statistics (the TUN reader thread counts in them).
    #[cfg(linux_like)]
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// Publish the driver-local counts to the shared statistics.
    pub fn commit(&mut self, now: Instant) {
        self.local.commit(&self.stats, now);
    }
}
