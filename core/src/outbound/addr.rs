//! The SOCKS5 address format (RFC 1928 section 5), which Shadowsocks uses
//! too: `ATYP` then IPv4 (4 bytes), a length-prefixed domain, or IPv6 (16
//! bytes), then the port, big-endian. Pure functions over byte slices; every
//! index is checked, so hostile input is an error, never a panic.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// A destination: an IP socket address or a domain name and port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Address {
    Ip(SocketAddr),
    /// At most 255 bytes (the length is one byte on the wire).
    Domain(String, u16),
}

impl From<SocketAddr> for Address {
    fn from(a: SocketAddr) -> Self {
        Address::Ip(a)
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Address::Ip(a) => write!(f, "{a}"),
            Address::Domain(d, p) => write!(f, "{d}:{p}"),
        }
    }
}

pub const ATYP_IPV4: u8 = 0x01;
pub const ATYP_DOMAIN: u8 = 0x03;
pub const ATYP_IPV6: u8 = 0x04;

/// Why an address could not be read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddrError {
    /// `ATYP` is none of 1, 3, 4.
    #[error("unknown address type {0:#04x}")]
    BadType(u8),
    /// A domain of zero bytes.
    #[error("empty domain name")]
    EmptyDomain,
    /// A domain longer than 255 bytes cannot be encoded.
    #[error("domain name of {0} bytes is longer than 255")]
    DomainTooLong(usize),
    /// A domain that is not UTF-8.
    #[error("domain name is not UTF-8")]
    DomainNotUtf8,
}

impl Address {
    /// Bytes [`Address::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        match self {
            Address::Ip(SocketAddr::V4(_)) => 1 + 4 + 2,
            Address::Ip(SocketAddr::V6(_)) => 1 + 16 + 2,
            Address::Domain(d, _) => 1 + 1 + d.len() + 2,
        }
    }

    /// Append the wire form to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), AddrError> {
        match self {
            Address::Ip(SocketAddr::V4(a)) => {
                out.push(ATYP_IPV4);
                out.extend_from_slice(&a.ip().octets());
                out.extend_from_slice(&a.port().to_be_bytes());
            }
            Address::Ip(SocketAddr::V6(a)) => {
                out.push(ATYP_IPV6);
                out.extend_from_slice(&a.ip().octets());
                out.extend_from_slice(&a.port().to_be_bytes());
            }
            Address::Domain(d, port) => {
                let len = u8::try_from(d.len()).map_err(|_| AddrError::DomainTooLong(d.len()))?;
                if len == 0 {
                    return Err(AddrError::EmptyDomain);
                }
                out.push(ATYP_DOMAIN);
                out.push(len);
                out.extend_from_slice(d.as_bytes());
                out.extend_from_slice(&port.to_be_bytes());
            }
        }
        Ok(())
    }

    /// The total encoded length implied by the first bytes of `buf`, or
    /// `None` when `buf` is too short to tell (ATYP, plus the domain's length
    /// byte). Lets a reader fetch exactly the address and nothing behind it.
    pub fn wire_len(buf: &[u8]) -> Result<Option<usize>, AddrError> {
        let Some(&atyp) = buf.first() else {
            return Ok(None);
        };
        match atyp {
            ATYP_IPV4 => Ok(Some(1 + 4 + 2)),
            ATYP_IPV6 => Ok(Some(1 + 16 + 2)),
            ATYP_DOMAIN => match buf.get(1) {
                None => Ok(None),
                Some(0) => Err(AddrError::EmptyDomain),
                Some(&n) => Ok(Some(1 + 1 + usize::from(n) + 2)),
            },
            other => Err(AddrError::BadType(other)),
        }
    }

    /// Parse an address at the start of `buf`: `Ok(None)` when more bytes
    /// are needed, else the address and the bytes it took.
    pub fn parse(buf: &[u8]) -> Result<Option<(Address, usize)>, AddrError> {
        let Some(len) = Self::wire_len(buf)? else {
            return Ok(None);
        };
        let Some(b) = buf.get(..len) else {
            return Ok(None);
        };
        let port = u16::from_be_bytes([b[len - 2], b[len - 1]]);
        let addr = match b[0] {
            ATYP_IPV4 => {
                let ip: [u8; 4] = b[1..5].try_into().map_err(|_| AddrError::BadType(b[0]))?;
                Address::Ip(SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), port))
            }
            ATYP_IPV6 => {
                let ip: [u8; 16] = b[1..17].try_into().map_err(|_| AddrError::BadType(b[0]))?;
                Address::Ip(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(ip)), port))
            }
            _ => {
                let name =
                    std::str::from_utf8(&b[2..len - 2]).map_err(|_| AddrError::DomainNotUtf8)?;
                Address::Domain(name.to_owned(), port)
            }
        };
        Ok(Some((addr, len)))
    }

    /// The IP address with IPv4-mapped IPv6 folded back to IPv4 (a dual-stack
    /// proxy may answer for an IPv4 peer in that form).
    pub fn canonical_ip(&self) -> Option<SocketAddr> {
        match self {
            Address::Ip(SocketAddr::V6(a)) => match a.ip().to_ipv4_mapped() {
                Some(v4) => Some(SocketAddr::new(IpAddr::V4(v4), a.port())),
                None => Some(SocketAddr::V6(*a)),
            },
            Address::Ip(a) => Some(*a),
            Address::Domain(..) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(a: Address, wire: &[u8]) {
        let mut out = Vec::new();
        a.encode(&mut out).expect("encode");
        assert_eq!(out, wire);
        assert_eq!(a.encoded_len(), wire.len());
        let mut with_tail = wire.to_vec();
        with_tail.extend_from_slice(b"payload");
        assert_eq!(Address::parse(&with_tail), Ok(Some((a, wire.len()))));
        for cut in 0..wire.len() {
            assert_eq!(Address::parse(&wire[..cut]), Ok(None), "prefix of {cut}");
        }
    }

    #[test]
    fn every_type_round_trips_and_prefixes_ask_for_more() {
        round_trip(
            Address::Ip("1.2.3.4:443".parse().expect("a")),
            &[1, 1, 2, 3, 4, 1, 0xbb],
        );
        let mut v6 = vec![4];
        v6.extend_from_slice(&"fd00::1".parse::<Ipv6Addr>().expect("ip").octets());
        v6.extend_from_slice(&[0, 53]);
        round_trip(Address::Ip("[fd00::1]:53".parse().expect("a")), &v6);
        round_trip(
            Address::Domain("example.org".into(), 80),
            b"\x03\x0bexample.org\x00\x50",
        );
    }

    #[test]
    fn hostile_input_is_an_error() {
        assert_eq!(Address::parse(&[9, 0, 0]), Err(AddrError::BadType(9)));
        assert_eq!(Address::parse(&[3, 0, 0, 0]), Err(AddrError::EmptyDomain));
        assert_eq!(
            Address::parse(&[3, 2, 0xff, 0xfe, 0, 1]),
            Err(AddrError::DomainNotUtf8)
        );
        let long = Address::Domain("x".repeat(256), 1);
        assert_eq!(
            long.encode(&mut Vec::new()),
            Err(AddrError::DomainTooLong(256))
        );
        // Every byte string of up to 3 bytes parses or errors without panicking.
        for a in 0..=255u8 {
            for b in [0u8, 1, 2, 255] {
                let _ = Address::parse(&[a, b, 7]);
            }
        }
    }

    #[test]
    fn mapped_v4_folds_back() {
        let a = Address::Ip("[::ffff:198.19.1.2]:7".parse().expect("a"));
        assert_eq!(a.canonical_ip(), Some("198.19.1.2:7".parse().expect("a")));
    }
}
