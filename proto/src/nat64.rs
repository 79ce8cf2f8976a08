//! IPv4 addresses inside IPv6 ones, for reaching IPv4 through a NAT64
//! translator on a network without IPv4.
//!
//! RFC 6052 section 2.2 places the 32 bits of an IPv4 address after a
//! prefix of 32, 40, 48, 56, 64 or 96 bits, skipping bits 64 to 71 (the
//! "u-octet", kept zero for compatibility with the interface identifier
//! format): [`Prefix::embed`] and [`Prefix::extract`]. RFC 7050 finds the
//! prefix a network's DNS64 uses by asking for the AAAA records of
//! `ipv4only.arpa`, whose only A records are the well-known addresses
//! 192.0.0.170 and 192.0.0.171: [`Prefix::discover`] reads the prefix back
//! out of the synthesized answers.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// The name whose AAAA records give the prefix away (RFC 7050 section 2).
pub const IPV4ONLY_ARPA: &str = "ipv4only.arpa";

/// The two A records of `ipv4only.arpa` (RFC 7050 section 2.2).
pub const WELL_KNOWN_V4: [Ipv4Addr; 2] =
    [Ipv4Addr::new(192, 0, 0, 170), Ipv4Addr::new(192, 0, 0, 171)];

/// Byte 8 of the address: bits 64 to 71, the u-octet (RFC 6052 section 2.2).
const U_OCTET: usize = 8;

/// A NAT64 prefix: its length is one RFC 6052 allows and every bit past it
/// is zero, so two prefixes compare equal when they embed alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Prefix {
    octets: [u8; 16],
    len: u8,
}

/// Why a prefix was refused ([`Prefix::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadPrefix {
    /// Not 32, 40, 48, 56, 64 or 96 (RFC 6052 section 2.2).
    Length(u8),
    /// A /96 whose bits 64 to 71 are not zero (RFC 6052 section 2.2: the
    /// u-octet "MUST be set to zero").
    UOctet,
}

impl fmt::Display for BadPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BadPrefix::Length(l) => write!(
                f,
                "a NAT64 prefix is /32, /40, /48, /56, /64 or /96, not /{l}"
            ),
            BadPrefix::UOctet => f.write_str("bits 64 to 71 of a NAT64 prefix must be zero"),
        }
    }
}

impl std::error::Error for BadPrefix {}

impl Prefix {
    /// The lengths RFC 6052 section 2.2 defines, shortest first.
    pub const LENGTHS: [u8; 6] = [32, 40, 48, 56, 64, 96];

    /// The well-known prefix 64:ff9b::/96 (RFC 6052 section 2.1).
    pub const WELL_KNOWN: Prefix = Prefix {
        octets: [0, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        len: 96,
    };

    /// The prefix of length `len` that `addr` starts with (the bits past
    /// `len` are ignored).
    pub fn new(addr: Ipv6Addr, len: u8) -> Result<Prefix, BadPrefix> {
        if !Self::LENGTHS.contains(&len) {
            return Err(BadPrefix::Length(len));
        }
        let mut octets = addr.octets();
        let keep = usize::from(len / 8);
        octets.iter_mut().skip(keep).for_each(|b| *b = 0);
        if octets[U_OCTET] != 0 {
            return Err(BadPrefix::UOctet);
        }
        Ok(Prefix { octets, len })
    }

    /// The prefix's bits as an address (zero past its length).
    pub fn addr(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.octets)
    }

    /// Its length in bits.
    pub fn length(&self) -> u8 {
        self.len
    }

    /// Where the IPv4 address's four bytes go: from the end of the prefix
    /// on, skipping the u-octet.
    fn positions(len: u8) -> [usize; 4] {
        let mut out = [0; 4];
        let mut at = usize::from(len / 8);
        for slot in &mut out {
            if at == U_OCTET {
                at += 1;
            }
            *slot = at;
            at += 1;
        }
        out
    }

    /// The IPv6 address that stands for `v4` behind this prefix (RFC 6052
    /// section 2.2; the suffix past the IPv4 bits is zero).
    pub fn embed(&self, v4: Ipv4Addr) -> Ipv6Addr {
        let mut octets = self.octets;
        for (at, b) in Self::positions(self.len).into_iter().zip(v4.octets()) {
            octets[at] = b;
        }
        Ipv6Addr::from(octets)
    }

    /// The IPv4 address `v6` stands for behind this prefix, or `None` when
    /// `v6` does not start with it or its u-octet is not zero.
    pub fn extract(&self, v6: Ipv6Addr) -> Option<Ipv4Addr> {
        let o = v6.octets();
        let keep = usize::from(self.len / 8);
        if o[..keep] != self.octets[..keep] || o[U_OCTET] != 0 {
            return None;
        }
        let [a, b, c, d] = Self::positions(self.len);
        Some(Ipv4Addr::new(o[a], o[b], o[c], o[d]))
    }

    /// The prefix a DNS64 used to synthesize `answers`, the AAAA records of
    /// `ipv4only.arpa` (RFC 7050 section 3): each answer is read at every
    /// length for one of [`WELL_KNOWN_V4`].
    ///
    /// A match with a zero suffix (what RFC 6052 section 2.2 has a DNS64
    /// write) is unique: a match at a longer length ends in the well-known
    /// address's last byte (0xaa or 0xab), which sits in the suffix of
    /// every shorter length. A DNS64 configured with a suffix of its own
    /// gives no such match; an answer that then matches at exactly one
    /// length gives the prefix, one that matches at several (a prefix
    /// whose own bits spell a well-known address) is skipped. `None` when
    /// no answer carries a well-known address (no DNS64 on this network).
    /// With several distinct prefixes (RFC 7050 allows a network more than
    /// one) the first answer's is taken.
    pub fn discover(answers: &[Ipv6Addr]) -> Option<Prefix> {
        let matches = |a: Ipv6Addr| {
            Self::LENGTHS.into_iter().filter_map(move |len| {
                let p = Prefix::new(a, len).ok()?;
                let v4 = p.extract(a)?;
                WELL_KNOWN_V4.contains(&v4).then_some((p, p.embed(v4) == a))
            })
        };
        let exact = answers
            .iter()
            .find_map(|&a| matches(a).find_map(|(p, zero_suffix)| zero_suffix.then_some(p)));
        exact.or_else(|| {
            answers.iter().find_map(|&a| {
                let mut m = matches(a);
                let (p, _) = m.next()?;
                m.next().is_none().then_some(p)
            })
        })
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr(), self.len)
    }
}

/// Whether an outbound connection to `v4` should go through the NAT64
/// prefix on a network without IPv4: every address but those that never
/// leave the host or its link (0.0.0.0/8 "this network", loopback,
/// 169.254.0.0/16 link-local, multicast, the limited broadcast). Private
/// addresses are synthesized too: which ones the translator forwards is
/// its decision (RFC 6052 section 3.1 has it drop non-global ones behind
/// the well-known prefix), and on a network without IPv4 they cannot be
/// reached any other way.
pub fn synthesizable(v4: Ipv4Addr) -> bool {
    !(v4.octets()[0] == 0
        || v4.is_loopback()
        || v4.is_link_local()
        || v4.is_multicast()
        || v4.is_broadcast())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v6(s: &str) -> Ipv6Addr {
        s.parse().expect("an IPv6 address")
    }

    /// RFC 6052 section 2.4, the table of examples: 192.0.2.33 behind
    /// 2001:db8::/32 to /96, and behind the well-known prefix.
    const EXAMPLES: [(&str, u8, &str); 7] = [
        ("2001:db8::", 32, "2001:db8:c000:221::"),
        ("2001:db8:100::", 40, "2001:db8:1c0:2:21::"),
        ("2001:db8:122::", 48, "2001:db8:122:c000:2:2100::"),
        ("2001:db8:122:300::", 56, "2001:db8:122:3c0:0:221::"),
        ("2001:db8:122:344::", 64, "2001:db8:122:344:c0:2:2100:0"),
        ("2001:db8:122:344::", 96, "2001:db8:122:344::c000:221"),
        ("64:ff9b::", 96, "64:ff9b::c000:221"),
    ];

    #[test]
    fn embeds_and_extracts_as_rfc_6052_shows() {
        let v4 = Ipv4Addr::new(192, 0, 2, 33);
        for (prefix, len, want) in EXAMPLES {
            let p = Prefix::new(v6(prefix), len).expect("a valid prefix");
            assert_eq!(p.embed(v4), v6(want), "/{len}");
            assert_eq!(p.extract(v6(want)), Some(v4), "/{len}");
        }
        assert_eq!(
            Prefix::new(v6("64:ff9b::"), 96).expect("the well-known prefix"),
            Prefix::WELL_KNOWN
        );
        assert_eq!(Prefix::WELL_KNOWN.to_string(), "64:ff9b::/96");
    }

    #[test]
    fn refuses_other_lengths_and_a_set_u_octet() {
        for len in [0, 16, 33, 72, 95, 128] {
            assert_eq!(
                Prefix::new(v6("2001:db8::"), len),
                Err(BadPrefix::Length(len))
            );
        }
        assert_eq!(
            Prefix::new(v6("2001:db8:0:0:100::"), 96),
            Err(BadPrefix::UOctet)
        );
        // Bits past a shorter length (the u-octet included) are not the
        // prefix's: dropped.
        let p = Prefix::new(v6("2001:db8:1:2:ff00::9"), 64).expect("a /64");
        assert_eq!(p.addr(), v6("2001:db8:1:2::"));
    }

    #[test]
    fn extract_refuses_other_prefixes_and_a_set_u_octet() {
        let p = Prefix::new(v6("2001:db8::"), 32).expect("a /32");
        assert_eq!(p.extract(v6("2001:db9:c000:221::")), None);
        assert_eq!(p.extract(v6("2001:db8:c000:221:100::")), None, "u-octet");
        assert_eq!(Prefix::WELL_KNOWN.extract(v6("64:ff9c::1.2.3.4")), None);
    }

    #[test]
    fn every_length_round_trips() {
        let base = v6("2001:db8:aabb:ccdd:ee:1122:3344:5566");
        for len in Prefix::LENGTHS {
            let p = Prefix::new(base, len).expect("a valid prefix");
            for v4 in [
                Ipv4Addr::new(0, 0, 0, 0),
                Ipv4Addr::new(255, 255, 255, 255),
                Ipv4Addr::new(10, 1, 2, 3),
                Ipv4Addr::new(192, 0, 0, 170),
            ] {
                let a = p.embed(v4);
                assert_eq!(p.extract(a), Some(v4), "{p} {v4}");
                assert_eq!(a.octets()[U_OCTET], 0, "{p}: the u-octet stays zero");
                assert_eq!(Prefix::new(a, len), Ok(p), "{p}: the prefix bits stay");
            }
        }
    }

    #[test]
    fn discovers_the_prefix_from_the_ipv4only_arpa_answers() {
        for (prefix, len, _) in EXAMPLES {
            let p = Prefix::new(v6(prefix), len).expect("a valid prefix");
            let answers = WELL_KNOWN_V4.map(|w| p.embed(w));
            assert_eq!(Prefix::discover(&answers), Some(p), "{p}");
            // One answer is enough.
            assert_eq!(Prefix::discover(&answers[1..]), Some(p), "{p}");
        }
        // Real AAAA records of a name, not synthesized: no prefix.
        assert_eq!(
            Prefix::discover(&[v6("2001:db8::1"), v6("2606:4700::1111")]),
            None
        );
        assert_eq!(Prefix::discover(&[]), None);
    }

    #[test]
    fn a_prefix_spelling_a_well_known_address_is_read_at_its_own_length() {
        // A /64 whose own bits 32..63 spell 192.0.0.170: its answers read
        // as a /32 too, but only with a non-zero suffix.
        let p = Prefix::new(v6("2001:db8:c000:aa::"), 64).expect("a /64");
        let answers = WELL_KNOWN_V4.map(|w| p.embed(w));
        assert_eq!(Prefix::discover(&answers), Some(p));
        assert_eq!(Prefix::discover(&[answers[1], answers[0]]), Some(p));
    }

    #[test]
    fn a_dns64_suffix_is_read_where_the_match_is_unique() {
        // A /64 prefix, and a DNS64 configured to write a suffix of its own.
        let p = Prefix::new(v6("2001:db8:1:2::"), 64).expect("a /64");
        let mut o = p.embed(WELL_KNOWN_V4[0]).octets();
        o[15] = 0x42;
        assert_eq!(Prefix::discover(&[Ipv6Addr::from(o)]), Some(p));
    }

    #[test]
    fn only_addresses_that_leave_the_link_are_synthesized() {
        for a in ["192.0.2.33", "10.0.0.1", "198.51.100.7", "8.8.8.8"] {
            assert!(synthesizable(a.parse().expect("v4")), "{a}");
        }
        for a in [
            "0.0.0.0",
            "0.1.2.3",
            "127.0.0.1",
            "169.254.1.1",
            "224.0.0.251",
            "255.255.255.255",
        ] {
            assert!(!synthesizable(a.parse().expect("v4")), "{a}");
        }
    }
}
