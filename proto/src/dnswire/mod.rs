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
}

/// One parsed `upstreams` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub proto: UpstreamProto,
    pub addr: SocketAddr,
    /// TLS server name (DNS over TLS).
    pub server_name: Option<String>,
}

impl std::str::FromStr for Upstream {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| format!("{s:?}: expected udp://, tcp:// or tls://"))?;
        let (addr, name) = match rest.split_once('#') {
            Some((a, n)) => (a, Some(n.to_owned())),
            None => (rest, None),
        };
        let proto = match scheme {
            "udp" => UpstreamProto::Udp,
            "tcp" => UpstreamProto::Tcp,
            "tls" => UpstreamProto::Tls,
            other => return Err(format!("{s:?}: unknown scheme {other:?}")),
        };
        let addr: SocketAddr = addr
            .parse()
            .map_err(|e| format!("{s:?}: {e} (an IP address and port)"))?;
        if proto == UpstreamProto::Tls && name.as_deref().is_none_or(str::is_empty) {
            return Err(format!("{s:?}: tls:// needs #server-name"));
        }
        Ok(Upstream {
            proto,
            addr,
            server_name: name,
        })
    }
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
