//! Opening an outbound: a TCP stream along a route (the proxy's handshake
//! included, the outcome counted per outbound), the connection to a proxy
//! server given by address or by host name, and a proxy's UDP association
//! with its datagram framing. Apart from `mod.rs`, which builds the
//! outbounds and decides routes without opening anything.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpStream, UdpSocket};

use super::config::OutboundUdp;
use super::shadowsocks::UdpSession;
use super::{
    Address, OutboundError, OutboundStream, Outbounds, Proxy, Route, Server, SocketFactory,
    resolve, shadowsocks, socks5,
};
use crate::framing::Framing;
use crate::stats::{OutboundCounters, Stats};

impl Outbounds {
    /// Open a TCP outbound to `dst` along `route`, handshake included, and
    /// count the outcome per outbound.
    pub async fn connect(
        &self,
        route: Route,
        dst: &Address,
        stats: &Stats,
    ) -> Result<OutboundStream, OutboundError> {
        let _ = stats;
        let r = self.connect_inner(route, dst).await;
        if let Route::Proxy(i) = route
            && let Some(c) = self.counters.get(i)
        {
            match &r {
                Ok(_) => c.tcp_connects.fetch_add(1, Relaxed),
                Err(OutboundError::Resolve { .. }) => c.resolve_failures.fetch_add(1, Relaxed),
                Err(e) if e.is_protocol() => c.protocol_errors.fetch_add(1, Relaxed),
                Err(_) => c.tcp_failures.fetch_add(1, Relaxed),
            };
        }
        r
    }

    pub(super) async fn connect_inner(
        &self,
        route: Route,
        dst: &Address,
    ) -> Result<OutboundStream, OutboundError> {
        let timeout = self.factory.connect_timeout;
        let proxy = match route {
            Route::Reject => return Err(OutboundError::Rejected),
            Route::Direct => {
                // A direct connection needs an address: the caller resolves
                // domains first (through kerntun's DNS, never the host's).
                let Address::Ip(dst) = dst else {
                    return Err(OutboundError::Unresolved(dst.to_string()));
                };
                return Ok(OutboundStream {
                    stream: self.factory.connect_tcp(*dst).await?,
                    framing: None,
                    route,
                    why: None,
                    counters: None,
                });
            }
            Route::Proxy(i) => self.proxies.get(i).ok_or(OutboundError::Rejected)?,
        };
        match proxy {
            Proxy::Socks5 { server, creds, .. } => {
                let (mut s, _) = self.connect_server(route, server).await?;
                socks5::handshake(
                    &mut s,
                    creds.as_ref(),
                    socks5::Command::Connect,
                    dst,
                    timeout,
                )
                .await?;
                Ok(OutboundStream {
                    stream: s,
                    framing: None,
                    route,
                    why: None,
                    counters: self.counters_of_route(route),
                })
            }
            Proxy::Shadowsocks { server, key, .. } => {
                let (mut s, _) = self.connect_server(route, server).await?;
                let session = shadowsocks::tcp_session(key, dst)?;
                match tokio::time::timeout(timeout, s.write_all(&session.header)).await {
                    Ok(r) => r?,
                    Err(_) => return Err(OutboundError::Timeout(timeout)),
                }
                Ok(OutboundStream {
                    stream: s,
                    framing: session.framing.map(|f| Box::new(f) as Box<dyn Framing>),
                    route,
                    why: None,
                    counters: self.counters_of_route(route),
                })
            }
        }
    }

    /// A TCP connection to a proxy server, and the address it reached.
    async fn connect_server(
        &self,
        route: Route,
        server: &Server,
    ) -> Result<(TcpStream, SocketAddr), OutboundError> {
        let n = match server {
            Server::Ip(a) => return Ok((self.factory.connect_tcp(*a).await?, *a)),
            Server::Name(n) => n,
        };
        let addrs = self.server_addresses(route, n).await?;
        match resolve::connect_happy(&self.factory, &addrs).await {
            Ok((s, a)) => {
                n.connected(a.ip()).await;
                Ok((s, a))
            }
            Err(e) => {
                n.connect_failed().await;
                Err(io::Error::new(
                    e.kind(),
                    format!("{} ({}): {e}", n.name(), self.name(route)),
                )
                .into())
            }
        }
    }

    /// The addresses of a named proxy server, from the cache or the resolvers.
    async fn server_addresses(
        &self,
        route: Route,
        n: &resolve::Named,
    ) -> Result<Vec<SocketAddr>, OutboundError> {
        n.addresses(&self.factory, &self.resolvers)
            .await
            .map_err(|reason| OutboundError::Resolve {
                outbound: self.name(route).to_owned(),
                name: n.name().to_owned(),
                reason,
            })
    }

    fn counters_of_route(&self, route: Route) -> Option<Arc<OutboundCounters>> {
        match route {
            Route::Proxy(i) => self.counters.get(i).cloned(),
            Route::Direct | Route::Reject => None,
        }
    }

    /// Whether UDP flows on `route` go through a proxy (the queued path).
    pub fn udp_proxied(&self, route: Route) -> bool {
        matches!(route, Route::Proxy(_)) && self.proxy_udp(route) == OutboundUdp::Relay
    }

    /// The route a UDP flow the rules send along `route` takes: the same,
    /// or direct for a proxy with `udp = "direct"`; `None` when the proxy
    /// refuses UDP (`udp = false`), which the caller counts and answers
    /// like a `reject` rule's refusal.
    pub fn udp_route(&self, route: Route) -> Option<Route> {
        match self.proxy_udp(route) {
            OutboundUdp::Relay => Some(route),
            OutboundUdp::Direct => Some(Route::Direct),
            OutboundUdp::Refuse => None,
        }
    }

    /// A proxy route's `udp` setting; `Relay` for the built-in routes
    /// (they are what they say).
    fn proxy_udp(&self, route: Route) -> OutboundUdp {
        match route {
            Route::Proxy(i) => match self.proxies.get(i) {
                Some(Proxy::Socks5 { udp, .. } | Proxy::Shadowsocks { udp, .. }) => *udp,
                None => OutboundUdp::Refuse,
            },
            Route::Direct | Route::Reject => OutboundUdp::Relay,
        }
    }

    /// The socket factory (direct UDP flows use it as it is).
    pub fn factory(&self) -> &SocketFactory {
        &self.factory
    }

    /// Open a UDP association through proxy `i` (SOCKS5 UDP ASSOCIATE, or a
    /// Shadowsocks UDP session).
    pub async fn udp(&self, i: usize) -> Result<ProxyUdp, OutboundError> {
        let timeout = self.factory.connect_timeout;
        match self.proxies.get(i) {
            Some(Proxy::Socks5 {
                server,
                creds,
                udp: OutboundUdp::Relay,
            }) => {
                let (mut control, server) = self.connect_server(Route::Proxy(i), server).await?;
                // The client's own UDP address is not known before the socket
                // is connected; the unspecified address says "any" (RFC 1928).
                let any = match server.ip() {
                    IpAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
                    IpAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
                };
                let bound = socks5::handshake(
                    &mut control,
                    creds.as_ref(),
                    socks5::Command::UdpAssociate,
                    &Address::Ip(any),
                    timeout,
                )
                .await?;
                let relay = socks5::udp_relay_addr(&bound, server);
                let sock = self.factory.udp_connected(relay)?;
                Ok(ProxyUdp {
                    sock,
                    control: Some(control),
                    codec: UdpCodec { session: None },
                })
            }
            Some(Proxy::Shadowsocks {
                server,
                key,
                udp: OutboundUdp::Relay,
            }) => Ok(ProxyUdp {
                sock: match server {
                    Server::Ip(a) => self.factory.udp_connected(*a)?,
                    Server::Name(n) => {
                        let addrs = self.server_addresses(Route::Proxy(i), n).await?;
                        resolve::udp_first(&self.factory, &addrs)?
                    }
                },
                control: None,
                codec: UdpCodec {
                    session: Some(UdpSession::new(key)),
                },
            }),
            _ => Err(OutboundError::Rejected),
        }
    }
}

/// One UDP flow's association with a proxy.
#[derive(Debug)]
pub struct ProxyUdp {
    /// Connected to the SOCKS5 relay address or the Shadowsocks server.
    pub sock: UdpSocket,
    /// SOCKS5: the association lives as long as this TCP connection.
    pub control: Option<TcpStream>,
    /// The datagram framing.
    pub codec: UdpCodec,
}

/// SOCKS5 or Shadowsocks datagram framing (sans-I/O).
#[derive(Debug)]
pub struct UdpCodec {
    /// Shadowsocks session; `None` for SOCKS5.
    session: Option<UdpSession>,
}

impl UdpCodec {
    /// SOCKS5's framing, for tests of what decodes it.
    #[cfg(test)]
    pub(crate) fn socks5() -> Self {
        UdpCodec { session: None }
    }

    /// Wrap `payload` for `target` into `out` (cleared first).
    pub fn encode(
        &mut self,
        target: &Address,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), OutboundError> {
        match &mut self.session {
            Some(s) => Ok(s.encode(target, payload, out)?),
            None => {
                out.clear();
                socks5::encode_udp_header(target, out)?;
                out.extend_from_slice(payload);
                Ok(())
            }
        }
    }

    /// Unwrap a datagram from the proxy in place: its source and the payload.
    pub fn decode(&mut self, buf: &mut [u8]) -> Result<(Address, Range<usize>), OutboundError> {
        match &mut self.session {
            Some(s) => Ok(s.decode(buf)?),
            None => {
                let (a, off) = socks5::parse_udp(buf)?;
                Ok((a, off..buf.len()))
            }
        }
    }
}
