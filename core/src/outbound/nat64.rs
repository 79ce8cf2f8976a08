//! Reaching IPv4 from a network without it, through the network's NAT64.
//!
//! On an IPv6-only network (common on cellular carriers) the host has no
//! IPv4 route, so a proxy given as an IPv4 literal, a proxy name with only
//! A records, or an app's IPv4 destination cannot be reached directly. The
//! network's NAT64 translator reaches them when they are addressed inside
//! its prefix. [`discover`] asks the network's DNS servers for the AAAA
//! records of `ipv4only.arpa`, which a DNS64 synthesizes inside that
//! prefix (RFC 7050); [`Nat64`] keeps what was found for the network the
//! host is on, and [`SocketFactory`] connects every
//! outbound socket bound for IPv4 to the embedded address instead
//! ([`Nat64::synthesize`]), so all outbounds (direct, SOCKS5, Shadowsocks,
//! TCP and UDP, and the DNS service's upstreams) go through one place.
//!
//! The prefix is read once per new outbound socket, never per packet, and
//! without a lock: it lives in two atomic words behind a sequence counter
//! (a seqlock), written only when the host reports a network change or a
//! discovery ends.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicU64, fence};
use std::time::Duration;

use kerntun_proto::nat64::{IPV4ONLY_ARPA, Prefix, synthesizable};
use parking_lot::Mutex;

use super::SocketFactory;
use crate::dnswire::{Upstream, msg};

/// DNS servers asked in turn for `ipv4only.arpa`: three, the most a
/// resolv.conf lists (resolv.conf(5), `MAXNS`); with the configured DNS
/// timeout per try, this bounds a discovery at three timeouts.
pub const MAX_SERVERS: usize = 3;

/// `lo`'s bit that says a prefix is set.
const PRESENT: u64 = 1;

/// The NAT64 prefix of the network the host is on, if it has one, and what
/// was done with it.
#[derive(Debug, Default)]
pub struct Nat64 {
    /// Even while no write is under way; bumped before and after one.
    seq: AtomicU64,
    /// The prefix's bytes 0..8.
    hi: AtomicU64,
    /// Its bytes 8..12 (the rest of a /96) in the high 32 bits, its length
    /// in bits 8..16, [`PRESENT`] in bit 0.
    lo: AtomicU64,
    /// Serializes the writers and says which network a discovery belongs
    /// to, so the answer for a network the host already left is dropped.
    state: Mutex<Discovery>,
    /// Outbound connects sent to a synthesized address.
    synthesized: AtomicU64,
    /// Discoveries on an IPv6-only network that found no prefix.
    failed: AtomicU64,
}

#[derive(Debug, Default)]
struct Discovery {
    /// Bumped on every network the host reports.
    generation: u64,
    /// A discovery for `generation` is under way.
    pending: bool,
}

/// What [`Nat64::begin`] asks of the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Begin {
    /// Run [`discover`] and hand its result to [`Nat64::settle`] with this
    /// generation.
    Discover(u64),
    /// Nothing to discover (the network has IPv4, or no network at all: the
    /// prefix is dropped), or a discovery for this network is under way or
    /// already found its prefix.
    Nothing,
}

impl Nat64 {
    /// The prefix now (three atomic loads; retried only while a write is
    /// under way).
    pub fn prefix(&self) -> Option<Prefix> {
        loop {
            let before = self.seq.load(Acquire);
            if before & 1 == 0 {
                let (hi, lo) = (self.hi.load(Relaxed), self.lo.load(Relaxed));
                fence(Acquire);
                if self.seq.load(Relaxed) == before {
                    return decode(hi, lo);
                }
            }
            std::hint::spin_loop();
        }
    }

    fn store(&self, p: Option<Prefix>) {
        let (hi, lo) = encode(p);
        let s = self.seq.load(Relaxed);
        self.seq.store(s.wrapping_add(1), Relaxed);
        fence(Release);
        self.hi.store(hi, Relaxed);
        self.lo.store(lo, Relaxed);
        self.seq.store(s.wrapping_add(2), Release);
    }

    /// Where a connect to `dst` goes: inside the prefix when there is one
    /// and `dst` is an IPv4 address that leaves the link
    /// ([`synthesizable`]), counted; else `dst` itself.
    pub fn synthesize(&self, dst: SocketAddr) -> SocketAddr {
        let SocketAddr::V4(v4) = dst else {
            return dst;
        };
        if !synthesizable(*v4.ip()) {
            return dst;
        }
        match self.prefix() {
            Some(p) => {
                self.synthesized.fetch_add(1, Relaxed);
                SocketAddr::new(IpAddr::V6(p.embed(*v4.ip())), v4.port())
            }
            None => dst,
        }
    }

    /// Whether a connect to `ip` goes inside the prefix now.
    pub fn applies_to(&self, ip: IpAddr) -> bool {
        matches!(ip, IpAddr::V4(v4) if synthesizable(v4)) && self.prefix().is_some()
    }

    /// The host reported a network (`changed`: a different one than last
    /// time). One with IPv6 and no IPv4 needs a prefix: discovered again
    /// on every change (the one found on the last network is used until
    /// then), and on a repeated report while none was found. Any other
    /// drops it at once.
    pub fn begin(&self, has_ipv4: bool, has_ipv6: bool, changed: bool) -> Begin {
        let mut st = self.state.lock();
        if has_ipv4 || !has_ipv6 {
            if changed {
                st.generation += 1;
                st.pending = false;
                self.store(None);
            }
            return Begin::Nothing;
        }
        if !changed && (st.pending || self.prefix().is_some()) {
            return Begin::Nothing;
        }
        st.generation += 1;
        st.pending = true;
        Begin::Discover(st.generation)
    }

    /// The discovery of `generation` ended with `found`. False (and nothing
    /// changes) when the host reported another network since. A discovery
    /// that found nothing drops the prefix and is counted.
    pub fn settle(&self, generation: u64, found: Option<Prefix>) -> bool {
        let mut st = self.state.lock();
        if st.generation != generation {
            return false;
        }
        st.pending = false;
        if found.is_none() {
            self.failed.fetch_add(1, Relaxed);
        }
        self.store(found);
        true
    }

    /// Connects sent to a synthesized address so far.
    pub fn synthesized(&self) -> u64 {
        self.synthesized.load(Relaxed)
    }

    /// Discoveries that found no prefix so far.
    pub fn failed(&self) -> u64 {
        self.failed.load(Relaxed)
    }
}

fn encode(p: Option<Prefix>) -> (u64, u64) {
    let Some(p) = p else {
        return (0, 0);
    };
    let o = p.addr().octets();
    let hi = u64::from_be_bytes([o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]]);
    let mid = u32::from_be_bytes([o[8], o[9], o[10], o[11]]);
    (
        hi,
        u64::from(mid) << 32 | u64::from(p.length()) << 8 | PRESENT,
    )
}

fn decode(hi: u64, lo: u64) -> Option<Prefix> {
    if lo & PRESENT == 0 {
        return None;
    }
    let mut o = [0u8; 16];
    o[..8].copy_from_slice(&hi.to_be_bytes());
    o[8..12].copy_from_slice(&((lo >> 32) as u32).to_be_bytes());
    Prefix::new(o.into(), (lo >> 8) as u8).ok()
}

/// Ask the first [`MAX_SERVERS`] of `servers` in turn for the AAAA records
/// of `ipv4only.arpa`, each try bounded by `timeout`, and read the prefix
/// from the first answer ([`Prefix::discover`]). A server that answers
/// without a synthesized address (no DNS64 there) ends the search: the
/// network has no NAT64. `None` also when no server answered.
///
/// Without servers (iOS: `NWPath` carries none) the system's resolver is
/// asked instead (getaddrinfo(3) on tokio's blocking pool, bounded by
/// `timeout`), which sends the question to the network's own DNS.
pub async fn discover(
    factory: &SocketFactory,
    servers: &[Upstream],
    timeout: Duration,
) -> Option<Prefix> {
    if servers.is_empty() {
        let lookup = tokio::net::lookup_host((IPV4ONLY_ARPA, 0));
        return match tokio::time::timeout(timeout, lookup).await {
            Ok(Ok(addrs)) => {
                let answers: Vec<_> = addrs
                    .filter_map(|a| match a {
                        SocketAddr::V6(v6) => Some(*v6.ip()),
                        SocketAddr::V4(_) => None,
                    })
                    .collect();
                Prefix::discover(&answers)
            }
            Ok(Err(e)) => {
                tracing::debug!("{IPV4ONLY_ARPA} from the system resolver: {e}");
                None
            }
            Err(_) => None,
        };
    }
    for up in servers.iter().take(MAX_SERVERS) {
        match super::resolve::query(factory, up, IPV4ONLY_ARPA, true, timeout).await {
            Ok(m) => {
                let answers: Vec<_> = msg::addresses(&m, true)
                    .filter_map(|a| match a {
                        IpAddr::V6(v6) => Some(v6),
                        IpAddr::V4(_) => None,
                    })
                    .collect();
                return Prefix::discover(&answers);
            }
            Err(e) => tracing::debug!("{IPV4ONLY_ARPA} from {}: {e}", up.addr),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("a socket address")
    }

    #[test]
    fn the_prefix_survives_its_encoding() {
        let n = Nat64::default();
        assert_eq!(n.prefix(), None);
        for len in Prefix::LENGTHS {
            let p = Prefix::new("2001:db8:aabb:ccdd:0:1122::".parse().expect("v6"), len)
                .expect("a prefix");
            n.store(Some(p));
            assert_eq!(n.prefix(), Some(p), "/{len}");
        }
        n.store(None);
        assert_eq!(n.prefix(), None);
    }

    #[test]
    fn only_ipv4_that_leaves_the_link_is_synthesized_while_a_prefix_is_known() {
        let n = Nat64::default();
        assert_eq!(n.synthesize(sa("192.0.2.1:1080")), sa("192.0.2.1:1080"));
        assert_eq!(n.synthesized(), 0, "no prefix, nothing counted");
        let Begin::Discover(g) = n.begin(false, true, true) else {
            panic!("an IPv6-only network is discovered");
        };
        assert!(n.settle(g, Some(Prefix::WELL_KNOWN)));
        assert_eq!(
            n.synthesize(sa("192.0.2.1:1080")),
            sa("[64:ff9b::c000:201]:1080")
        );
        assert_eq!(
            n.synthesize(sa("[2001:db8::1]:443")),
            sa("[2001:db8::1]:443")
        );
        assert_eq!(n.synthesize(sa("127.0.0.1:53")), sa("127.0.0.1:53"));
        assert_eq!(n.synthesized(), 1);
    }

    #[test]
    fn a_network_with_ipv4_drops_the_prefix_and_a_late_answer_is_ignored() {
        let n = Nat64::default();
        let Begin::Discover(g1) = n.begin(false, true, true) else {
            panic!("discover");
        };
        // The same network again while that runs: one discovery at a time.
        assert_eq!(n.begin(false, true, false), Begin::Nothing);
        assert!(n.settle(g1, Some(Prefix::WELL_KNOWN)));
        // Found: a repeated report does not ask again, a new network does
        // (keeping the old prefix until its answer).
        assert_eq!(n.begin(false, true, false), Begin::Nothing);
        let Begin::Discover(g2) = n.begin(false, true, true) else {
            panic!("discover again");
        };
        assert_eq!(n.prefix(), Some(Prefix::WELL_KNOWN));
        // IPv4 is back before the answer: dropped at once, the answer too.
        assert_eq!(n.begin(true, true, true), Begin::Nothing);
        assert_eq!(n.prefix(), None);
        assert!(!n.settle(g2, Some(Prefix::WELL_KNOWN)));
        assert_eq!(n.prefix(), None);
        // No answer on an IPv6-only network: counted, asked again on the
        // next report even if nothing changed.
        let Begin::Discover(g3) = n.begin(false, true, true) else {
            panic!("discover");
        };
        assert!(n.settle(g3, None));
        assert_eq!(n.failed(), 1);
        assert!(matches!(n.begin(false, true, false), Begin::Discover(_)));
    }
}
