//! One exchange with one upstream, through the outbound the rules choose for
//! the upstream's address: UDP (direct, or a proxy's UDP association), DNS
//! over TCP (RFC 7766 two-byte length framing; direct, SOCKS5, or inside a
//! Shadowsocks AEAD stream), DNS over TLS (RFC 7858, feature `dot`), or DNS
//! over HTTPS (RFC 8484, feature `doh`, in `doh`).
//!
//! One connection or socket per exchange, except DNS over HTTPS: upstream
//! queries are rare next to cache hits, and a fresh socket needs no
//! reconnect logic, no pipelining bookkeeping and no idle timers. DoH keeps
//! one HTTP/2 connection per upstream (`doh` says why). The caller bounds
//! each exchange in time.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::dnswire::{Upstream, UpstreamProto, length_prefixed, msg, read_frame};
use crate::outbound::{Address, OutboundError, OutboundStream, Outbounds, ProxyUdp, Route};
use crate::rules::Target;
use crate::stats::Stats;

/// Largest DNS message (the TCP length prefix is 16 bits).
const MAX_MESSAGE: usize = 65_535;

/// Why an exchange failed (the next upstream is tried).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExchangeError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Outbound(#[from] OutboundError),
    /// The rules reject the upstream's address: skipped, not a failure.
    #[error("the rules reject this upstream")]
    Rejected,
    #[error("{0}")]
    Unsupported(&'static str),
    #[error("the reply does not answer the query ({0:?})")]
    Reply(msg::BadReply),
    /// The in-flight byte budget had no room for a retry over TCP.
    #[error("too many DNS queries in flight")]
    Busy,
}

#[cfg(feature = "doh")]
mod doh;

/// TLS client state for `tls://` and `https://` upstreams (one per DNS
/// service): the TLS client, and the kept DoH connections.
#[cfg(feature = "dot")]
pub(crate) struct Tls {
    dot: tokio_rustls::TlsConnector,
    #[cfg(feature = "doh")]
    doh: doh::Pool,
}

#[cfg(feature = "dot")]
impl Tls {
    pub(crate) fn new(cfg: std::sync::Arc<tokio_rustls::rustls::ClientConfig>) -> Tls {
        Tls {
            #[cfg(feature = "doh")]
            doh: doh::Pool::new(&cfg),
            dot: tokio_rustls::TlsConnector::from(cfg),
        }
    }
}

#[cfg(feature = "dot")]
impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Tls");
        #[cfg(feature = "doh")]
        d.field("doh", &self.doh);
        d.finish_non_exhaustive()
    }
}

/// Without the `dot` feature `tls://` and `https://` are refused at
/// configuration time.
#[cfg(not(feature = "dot"))]
pub(crate) type Tls = ();

/// Send `wire` (a query with ID `id`) to `up` and return the raw reply, which
/// carries the same ID and the QR bit (other datagrams are ignored).
/// `direct`: sent direct whatever the rules say about `up`'s address (the
/// network's own servers, a `"platform"` entry: they answer only from the
/// network the device is on, and a proxy would carry the query elsewhere).
pub(crate) async fn exchange(
    ob: &Outbounds,
    up: &Upstream,
    direct: bool,
    tls: Option<&Tls>,
    wire: &[u8],
    id: u16,
    stats: &Stats,
) -> Result<Vec<u8>, ExchangeError> {
    // A udp:// upstream is a UDP flow for `network` rules; the others TCP.
    let target = match up.proto {
        UpstreamProto::Udp => Target::ip(up.addr).udp(),
        _ => Target::ip(up.addr),
    };
    let route = if direct {
        Route::Direct
    } else {
        ob.route(&target)
    };
    if route == Route::Reject {
        return Err(ExchangeError::Rejected);
    }
    match up.proto {
        UpstreamProto::Udp => match route {
            Route::Direct => udp_direct(ob, up, wire, id).await,
            Route::Proxy(i) if ob.udp_proxied(route) => udp_proxy(ob, i, up, wire, id, stats).await,
            // A proxy without UDP: DNS over TCP through it.
            _ => {
                let out = ob.connect(route, &Address::Ip(up.addr), stats).await?;
                framed(out, wire, id).await
            }
        },
        UpstreamProto::Tcp => {
            let out = ob.connect(route, &Address::Ip(up.addr), stats).await?;
            framed(out, wire, id).await
        }
        UpstreamProto::Tls => {
            #[cfg(feature = "dot")]
            {
                let Some(tls) = tls else {
                    return Err(ExchangeError::Unsupported("no TLS configuration"));
                };
                let out = ob.connect(route, &Address::Ip(up.addr), stats).await?;
                if out.framing.is_some() {
                    return Err(ExchangeError::Unsupported(
                        "DNS over TLS through a Shadowsocks AEAD outbound",
                    ));
                }
                let name = up.server_name.clone().unwrap_or_default();
                let name = rustls_pki_types::ServerName::try_from(name)
                    .map_err(|_| ExchangeError::Unsupported("bad TLS server name"))?;
                let mut s = tls.dot.connect(name, out.stream).await?;
                let r = plain_framed(&mut s, wire, id).await;
                let _ = s.shutdown().await;
                r
            }
            #[cfg(not(feature = "dot"))]
            {
                let _ = tls;
                Err(ExchangeError::Unsupported(
                    "tls:// upstreams need kerntun's `dot` feature",
                ))
            }
        }
        UpstreamProto::Https => {
            #[cfg(feature = "doh")]
            {
                let Some(tls) = tls else {
                    return Err(ExchangeError::Unsupported("no TLS configuration"));
                };
                doh::exchange(&tls.doh, ob, route, up, wire, id, stats).await
            }
            #[cfg(not(feature = "doh"))]
            {
                let _ = tls;
                Err(ExchangeError::Unsupported(
                    "https:// upstreams need kerntun's `doh` feature",
                ))
            }
        }
    }
}

async fn udp_direct(
    ob: &Outbounds,
    up: &Upstream,
    wire: &[u8],
    id: u16,
) -> Result<Vec<u8>, ExchangeError> {
    let sock = ob.factory().udp_connected(up.addr)?;
    sock.send(wire).await?;
    loop {
        // A connected socket only hears the upstream; the ID check drops
        // late replies to an earlier try and guesses at the ID.
        let reply = recv_datagram(&sock).await?;
        if msg::id_matches(&reply, id) {
            return Ok(reply);
        }
    }
}

/// The next datagram on `sock`, in a vector of its size. The 64 KiB
/// receive buffer exists only for the non-blocking receive once the socket
/// is readable, so an exchange waiting for its reply holds none (the
/// in-flight budget counts it that way, `super::UDP_EXCHANGE`).
async fn recv_datagram(sock: &tokio::net::UdpSocket) -> io::Result<Vec<u8>> {
    loop {
        sock.readable().await?;
        let mut buf = vec![0u8; MAX_MESSAGE];
        match sock.try_recv(&mut buf) {
            Ok(n) => return Ok(buf[..n].to_vec()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

async fn udp_proxy(
    ob: &Outbounds,
    i: usize,
    up: &Upstream,
    wire: &[u8],
    id: u16,
    stats: &Stats,
) -> Result<Vec<u8>, ExchangeError> {
    // Counted like an app's UDP flow through the proxy.
    let _ = stats;
    let assoc = ob.udp(i).await;
    if let Some(c) = ob.counters_of(i) {
        match &assoc {
            Ok(_) => c
                .udp_flows
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            Err(_) => c
                .udp_failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        };
    }
    // `control` keeps a SOCKS5 association open until the reply is in.
    let ProxyUdp {
        sock,
        control: _control,
        mut codec,
    } = assoc?;
    let target = Address::Ip(up.addr);
    let mut out = Vec::with_capacity(wire.len() + 64);
    codec.encode(&target, wire, &mut out)?;
    sock.send(&out).await?;
    loop {
        let mut buf = recv_datagram(&sock).await?;
        let Ok((_, range)) = codec.decode(&mut buf) else {
            continue;
        };
        let payload = &buf[range];
        if msg::id_matches(payload, id) {
            return Ok(payload.to_vec());
        }
    }
}

/// DNS over TCP on an outbound stream, through its framing when it has one.
async fn framed(out: OutboundStream, wire: &[u8], id: u16) -> Result<Vec<u8>, ExchangeError> {
    let OutboundStream {
        mut stream,
        framing,
        ..
    } = out;
    let Some(mut framing) = framing else {
        return plain_framed(&mut stream, wire, id).await;
    };
    let (seal, open) = framing.split();
    let frame = length_prefixed(wire)?;
    let mut sealed = Vec::with_capacity(frame.len() + 64);
    seal.seal(&frame, &mut sealed);
    stream.write_all(&sealed).await?;
    let mut plain = Vec::new();
    let mut buf = vec![0u8; 4096];
    loop {
        if let Some(reply) = complete_frame(&plain) {
            return check_id(reply.to_vec(), id);
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            open.finish()?;
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
        open.open(&buf[..n], &mut plain, usize::MAX)?;
        if plain.len() > MAX_MESSAGE + 2 {
            return Err(io::Error::from(io::ErrorKind::InvalidData).into());
        }
    }
}

async fn plain_framed<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    wire: &[u8],
    id: u16,
) -> Result<Vec<u8>, ExchangeError> {
    s.write_all(&length_prefixed(wire)?).await?;
    s.flush().await?;
    check_id(read_frame(s).await?, id)
}

fn check_id(reply: Vec<u8>, id: u16) -> Result<Vec<u8>, ExchangeError> {
    if msg::id_matches(&reply, id) {
        Ok(reply)
    } else {
        Err(ExchangeError::Reply(msg::BadReply::Mismatch))
    }
}

/// The first whole frame in `buf`, if it holds one.
fn complete_frame(buf: &[u8]) -> Option<&[u8]> {
    let len = usize::from(u16::from_be_bytes([*buf.first()?, *buf.get(1)?]));
    buf.get(2..2 + len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_syntax() {
        let up = |s: &str| s.parse::<Upstream>();
        let u = up("https://1.1.1.1/dns-query#cloudflare-dns.com").expect("doh");
        assert_eq!(u.proto, UpstreamProto::Https);
        assert_eq!(u.addr, "1.1.1.1:443".parse().expect("addr"));
        assert_eq!(u.server_name.as_deref(), Some("cloudflare-dns.com"));
        assert_eq!(u.path.as_deref(), Some("/dns-query"));
        // Port and path given; path left out; IPv6 with and without port.
        let u = up("https://192.0.2.1:8443/resolve/x#dns.test").expect("doh");
        assert_eq!(u.addr, "192.0.2.1:8443".parse().expect("addr"));
        assert_eq!(u.path.as_deref(), Some("/resolve/x"));
        let u = up("https://192.0.2.1#dns.test").expect("doh");
        assert_eq!(u.path.as_deref(), Some("/dns-query"));
        let u = up("https://[2606:4700::1111]/dns-query#one.one.one.one").expect("v6");
        assert_eq!(u.addr, "[2606:4700::1111]:443".parse().expect("addr"));
        let u = up("https://[2001:db8::1]:444/q#dns.test").expect("v6 port");
        assert_eq!(u.addr, "[2001:db8::1]:444".parse().expect("addr"));
        assert!(UpstreamProto::Https.over_tls() && UpstreamProto::Tls.over_tls());
        assert!(!UpstreamProto::Tcp.over_tls() && !UpstreamProto::Udp.over_tls());
        // The other schemes keep no path.
        assert_eq!(up("tls://192.0.2.1:853#dns.test").expect("dot").path, None);
        for (bad, says) in [
            ("https://1.1.1.1/dns-query", "needs #server-name"),
            ("https://1.1.1.1/dns-query#", "needs #server-name"),
            ("https://dns.google/dns-query#dns.google", "IP address"),
            ("https://1.1.1.1/dns-query?dns=x#a.test", "no query string"),
            ("https://1.1.1.1/a b#a.test", "no spaces"),
            ("http://1.1.1.1/dns-query#a.test", "unknown scheme"),
        ] {
            let e = up(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn frames() {
        let f = length_prefixed(b"abc").expect("frame");
        assert_eq!(f, [0, 3, b'a', b'b', b'c']);
        assert_eq!(complete_frame(&f), Some(&b"abc"[..]));
        assert_eq!(complete_frame(&f[..4]), None);
        assert_eq!(complete_frame(&f[..1]), None);
        assert!(length_prefixed(&vec![0; 70_000]).is_err());
    }
}
