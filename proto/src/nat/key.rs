//! The packed flow key stored in both maps, and the hasher for shards and maps.

use std::hash::{BuildHasher, Hash, Hasher};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::FlowKey;

/// A [`FlowKey`] as stored: 38 bytes instead of 64.
///
/// `SocketAddr` is 32 bytes because `SocketAddrV6` carries `flowinfo` and
/// `scope_id`; neither is part of a TCP connection's identity (RFC 9293: a
/// connection is identified by its pair of sockets, address and port at each
/// end), and packets parsed from the TUN carry neither as addressing. The key is stored twice per connection
/// (forward key and reverse value), so dropping them is 52 bytes per
/// connection. Consequence: two `FlowKey`s that differ only in those fields
/// are the same flow, and keys handed back have them zeroed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PackedKey {
    client_ip: [u8; 16],
    server_ip: [u8; 16],
    client_port: u16,
    server_port: u16,
    /// Bit 0: client is IPv6. Bit 1: server is IPv6. A v4 flow and a v6 flow
    /// between v4-mapped addresses are different flows.
    families: u8,
}

const CLIENT_V6: u8 = 1;
const SERVER_V6: u8 = 2;

fn pack_ip(ip: IpAddr) -> ([u8; 16], bool) {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, d] = v4.octets();
            ([a, b, c, d, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], false)
        }
        IpAddr::V6(v6) => (v6.octets(), true),
    }
}

fn unpack_ip(bytes: [u8; 16], v6: bool) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::from(bytes))
    } else {
        let [a, b, c, d, ..] = bytes;
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }
}

impl PackedKey {
    pub(crate) fn new(key: &FlowKey) -> Self {
        let (client_ip, c6) = pack_ip(key.client.ip());
        let (server_ip, s6) = pack_ip(key.server.ip());
        let families = if c6 { CLIENT_V6 } else { 0 } | if s6 { SERVER_V6 } else { 0 };
        Self {
            client_ip,
            server_ip,
            client_port: key.client.port(),
            server_port: key.server.port(),
            families,
        }
    }

    /// The app's address (what the half-open bounds count per source).
    pub(crate) fn client_ip(&self) -> IpAddr {
        unpack_ip(self.client_ip, self.families & CLIENT_V6 != 0)
    }

    pub(crate) fn to_flow_key(self) -> FlowKey {
        FlowKey {
            client: SocketAddr::new(
                unpack_ip(self.client_ip, self.families & CLIENT_V6 != 0),
                self.client_port,
            ),
            server: SocketAddr::new(
                unpack_ip(self.server_ip, self.families & SERVER_V6 != 0),
                self.server_port,
            ),
        }
    }
}

impl Hash for PackedKey {
    // Five word writes instead of the derived per-field, length-prefixed byte
    // writes: this runs twice per uplink packet (shard choice, map probe).
    fn hash<H: Hasher>(&self, state: &mut H) {
        let c = u128::from_ne_bytes(self.client_ip);
        let s = u128::from_ne_bytes(self.server_ip);
        state.write_u64(c as u64);
        state.write_u64((c >> 64) as u64);
        state.write_u64(s as u64);
        state.write_u64((s >> 64) as u64);
        state.write_u64(
            u64::from(self.client_port)
                | (u64::from(self.server_port) << 16)
                | (u64::from(self.families) << 32),
        );
    }
}

/// A multiply-rotate word hasher (the FxHash scheme from rustc) with a
/// murmur3 `fmix64` finaliser, keyed: its state starts at a secret `k0` and
/// `k1` is mixed in before the finaliser, both drawn at random per table
/// ([`KeyedBuild::random`]).
///
/// Why keyed: flow keys come from apps on the device, and with a fixed hash
/// an app choosing its source ports (or, with a raw socket, its addresses)
/// can compute which keys share a shard and a bucket run and aim a flood at
/// one lock. Without the key it cannot: the shard bits depend on `k0`
/// through every multiply. Why not std's SipHash (`RandomState`): it is
/// several times slower on short keys, and this runs twice on every uplink
/// packet; the budget (`max_entries`) and the 64-way sharding bound what a
/// collision could cost anyway. Why the finaliser: the Fx step leaves the
/// low bits weakly mixed, and hashbrown takes its bucket index from the low
/// bits and its tag from the top 7; the shard index takes bits 40..46 (see
/// [`shard_index`]), so all three need good bits.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher {
    hash: u64,
    k1: u64,
}

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn finish(&self) -> u64 {
        let mut h = self.hash ^ self.k1;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let word = chunk.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
            self.add(word);
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
}

/// `BuildHasher` for both maps and the shard choice of one table: the
/// table's key (never printed: `Debug` leaves it out).
#[derive(Clone, Copy)]
pub(crate) struct KeyedBuild {
    k0: u64,
    k1: u64,
}

impl KeyedBuild {
    /// A fresh random key. std's `RandomState` carries 128 bits seeded from
    /// the OS's random source once per thread (and stepped per instance);
    /// hashing two constants under it yields two words an app cannot
    /// predict, without a dependency on a random number crate.
    pub(crate) fn random() -> Self {
        let s = std::hash::RandomState::new();
        KeyedBuild {
            k0: s.hash_one(0x6b65_726e_u64),
            k1: s.hash_one(0x7475_6e00_u64),
        }
    }

    /// Hash of a flow key, as the forward map computes it.
    #[inline]
    pub(crate) fn hash_key(&self, key: &PackedKey) -> u64 {
        self.hash_one(key)
    }
}

impl std::fmt::Debug for KeyedBuild {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyedBuild").finish_non_exhaustive()
    }
}

impl BuildHasher for KeyedBuild {
    type Hasher = FxHasher;

    #[inline]
    fn build_hasher(&self) -> FxHasher {
        FxHasher {
            hash: self.k0,
            k1: self.k1,
        }
    }
}

/// Shard of a forward-map key: bits 40..46 of its hash. hashbrown uses the
/// low bits (bucket index, for tables under 2^40 buckets) and the top 7 bits
/// (control tag); taking either would leave every key in a shard agreeing on
/// those bits and degrade probing inside the shard.
#[inline]
pub(crate) fn shard_index(hash: u64) -> usize {
    ((hash >> 40) as usize) & (super::SHARDS - 1)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::net::SocketAddrV6;

    #[test]
    fn pack_round_trips_v4_v6_and_mixed() {
        let keys = [
            FlowKey::new(
                "10.0.0.9:12345".parse().unwrap(),
                "1.1.1.1:443".parse().unwrap(),
            ),
            FlowKey::new(
                "[fd00::9]:65535".parse().unwrap(),
                "[2606:4700::1111]:0".parse().unwrap(),
            ),
            FlowKey::new(
                "10.0.0.9:1".parse().unwrap(),
                "[::ffff:1.1.1.1]:443".parse().unwrap(),
            ),
        ];
        for k in keys {
            assert_eq!(PackedKey::new(&k).to_flow_key(), k);
        }
    }

    #[test]
    fn v4_and_v4_mapped_v6_are_distinct() {
        let v4 = FlowKey::new("1.2.3.4:1".parse().unwrap(), "5.6.7.8:2".parse().unwrap());
        let v6 = FlowKey::new(
            "[::ffff:1.2.3.4]:1".parse().unwrap(),
            "[::ffff:5.6.7.8]:2".parse().unwrap(),
        );
        assert_ne!(PackedKey::new(&v4), PackedKey::new(&v6));
    }

    #[test]
    fn flowinfo_and_scope_are_not_identity() {
        let ip: Ipv6Addr = "fd00::9".parse().unwrap();
        let server: SocketAddr = "[fd00::1]:80".parse().unwrap();
        let a = FlowKey::new(SocketAddr::V6(SocketAddrV6::new(ip, 5, 0, 0)), server);
        let b = FlowKey::new(SocketAddr::V6(SocketAddrV6::new(ip, 5, 7, 3)), server);
        assert_eq!(PackedKey::new(&a), PackedKey::new(&b));
        assert_eq!(PackedKey::new(&b).to_flow_key(), a);
    }

    /// Two tables place the same keys in different shards: an app that
    /// picks its source ports cannot know which of them share a shard.
    /// With an unkeyed hash both partitions would be the same.
    #[test]
    fn shard_choice_depends_on_the_tables_key() {
        let keys: Vec<PackedKey> = (1024u16..5120)
            .map(|p| {
                PackedKey::new(&FlowKey::new(
                    SocketAddr::from(([10, 0, 0, 9], p)),
                    "1.1.1.1:443".parse().unwrap(),
                ))
            })
            .collect();
        let (a, b) = (KeyedBuild::random(), KeyedBuild::random());
        let shard = |h: &KeyedBuild, k: &PackedKey| shard_index(h.hash_key(k));
        // Of the keys in table a's shard 0, how many share table b's most
        // common shard: about 1/64 + noise when the keys are independent,
        // all of them when the hash is not keyed.
        let in_a0: Vec<&PackedKey> = keys.iter().filter(|k| shard(&a, k) == 0).collect();
        assert!(in_a0.len() > 20, "{} keys in shard 0", in_a0.len());
        let mut per_b = [0usize; crate::nat::SHARDS];
        for k in &in_a0 {
            per_b[shard(&b, k)] += 1;
        }
        let most = per_b.iter().max().copied().unwrap_or(0);
        assert!(
            most * 4 < in_a0.len(),
            "{most} of {} keys share a shard in both tables",
            in_a0.len()
        );
        // Each table still spreads the keys evenly.
        for h in [&a, &b] {
            let mut per = [0usize; crate::nat::SHARDS];
            for k in &keys {
                per[shard(h, k)] += 1;
            }
            let (lo, hi) = (per.iter().min().unwrap(), per.iter().max().unwrap());
            assert!(*lo > 20 && *hi < 120, "uneven shards: {lo}..{hi}");
        }
    }

    #[test]
    fn sequential_ports_spread_over_hash_bits() {
        // Sequential ports (what the allocator hands out) must not collapse
        // onto a few hashbrown tags: count distinct top-7-bit tags.
        let mut tags = std::collections::HashSet::new();
        for port in 0u16..1024 {
            let mut h = FxHasher::default();
            h.write_u16(port);
            tags.insert(h.finish() >> 57);
        }
        assert!(tags.len() > 100, "only {} distinct tags", tags.len());
    }
}
