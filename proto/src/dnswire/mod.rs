//! The DNS wire format, shared by the engine's DNS service and its resolver
//! of proxy host names: messages (`msg`, on hickory-proto), the length
//! prefix of DNS over TCP (`frame` reads it, [`length_prefixed`] writes
//! it), and upstream addresses as configured. No sockets, no state.

use std::io;
use std::net::SocketAddr;

pub mod frame;
pub mod msg;

/// How an upstream is spoken to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamProto {
    Udp,
    Tcp,
    Tls,
    /// DNS over HTTPS (RFC 8484): HTTP/2 over TLS.
    Https,
}

impl UpstreamProto {
    /// Spoken over TLS (`tls://`, `https://`): needs a TLS client, and is
    /// not for the bootstrap resolver of proxy host names.
    pub fn over_tls(self) -> bool {
        matches!(self, UpstreamProto::Tls | UpstreamProto::Https)
    }
}

/// One parsed `upstreams` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub proto: UpstreamProto,
    pub addr: SocketAddr,
    /// TLS server name (DNS over TLS, DNS over HTTPS).
    pub server_name: Option<String>,
    /// The request path of a DNS-over-HTTPS upstream (`/dns-query`).
    pub path: Option<String>,
}

/// Port of `https://` upstreams written without one.
const HTTPS_PORT: u16 = 443;

impl std::str::FromStr for Upstream {
    type Err = String;
    /// `udp://IP:PORT`, `tcp://IP:PORT`, `tls://IP:PORT#NAME`, or
    /// `https://IP[:PORT][/PATH]#NAME` (port 443 and path `/dns-query`
    /// when left out; an IPv6 address in brackets).
    fn from_str(s: &str) -> Result<Self, String> {
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| format!("{s:?}: expected udp://, tcp://, tls:// or https://"))?;
        let (addr, name) = match rest.split_once('#') {
            Some((a, n)) => (a, Some(n.to_owned())),
            None => (rest, None),
        };
        let proto = match scheme {
            "udp" => UpstreamProto::Udp,
            "tcp" => UpstreamProto::Tcp,
            "tls" => UpstreamProto::Tls,
            "https" => UpstreamProto::Https,
            other => return Err(format!("{s:?}: unknown scheme {other:?}")),
        };
        let (addr, path) = match proto {
            UpstreamProto::Https => {
                let (a, p) = match addr.find('/') {
                    Some(i) => addr.split_at(i),
                    None => (addr, "/dns-query"),
                };
                if p.bytes().any(|c| c <= b' ' || c == b'?' || c >= 0x7f) {
                    return Err(format!(
                        "{s:?}: the path must be plain (no spaces, no query string)"
                    ));
                }
                (https_addr(a), Some(p.to_owned()))
            }
            _ => (addr.parse(), None),
        };
        let addr: SocketAddr = addr.map_err(|e| format!("{s:?}: {e} (an IP address and port)"))?;
        if proto.over_tls() && name.as_deref().is_none_or(str::is_empty) {
            return Err(format!("{s:?}: {scheme}:// needs #server-name"));
        }
        Ok(Upstream {
            proto,
            addr,
            server_name: name,
            path,
        })
    }
}

/// `IP:PORT`, `[IPv6]:PORT`, or either without the port (443).
fn https_addr(a: &str) -> Result<SocketAddr, std::net::AddrParseError> {
    a.parse().or_else(|e| {
        let ip = a.strip_prefix('[').and_then(|v| v.strip_suffix(']'));
        match ip.unwrap_or(a).parse::<std::net::IpAddr>() {
            Ok(ip) => Ok(SocketAddr::new(ip, HTTPS_PORT)),
            Err(_) => Err(e),
        }
    })
}

/// `wire` with its two-byte length in front (RFC 1035 section 4.2.2).
pub fn length_prefixed(wire: &[u8]) -> io::Result<Vec<u8>> {
    let len =
        u16::try_from(wire.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut v = Vec::with_capacity(2 + wire.len());
    v.extend_from_slice(&len.to_be_bytes());
    v.extend_from_slice(wire);
    Ok(v)
}
