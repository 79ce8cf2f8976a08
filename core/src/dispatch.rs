//! Where a new TCP connection goes, decided once per connection for both
//! stacks: answered here (DNS over TCP to a hijacked address), routed now and
//! connected first (the common case, and fake-ip addresses, whose domain is
//! known at SYN time), accepted first so its domain can be sniffed from the
//! first bytes, or refused with an RST.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::outbound::{Address, OutboundError, OutboundStream, Route};
use crate::rules::Target;
use crate::sniff::{self, Sniffed};
use crate::stats::{EngineDrop, Stats};
use crate::system::Shared;

/// The decision for a new connection's SYN.
#[derive(Debug)]
pub(crate) enum Plan {
    /// DNS over TCP to a hijacked address: answered by kerntun's DNS service.
    Dns,
    /// Route chosen now; connect the outbound before the app's SYN is answered.
    Connect { route: Route, dst: Address },
    /// Accept the app's connection first, read its TLS SNI / HTTP Host
    /// (bounded wait), then route by domain and connect.
    Sniff,
    /// Answer the SYN with an RST.
    Refuse(Refusal),
}

/// Why a SYN is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A `reject` rule matched.
    Rule,
    /// A fake-ip address that stands for no domain (evicted, or never given).
    UnknownFake,
}

impl Refusal {
    /// Count the refusal.
    pub(crate) fn count(self, stats: &Stats) {
        match self {
            Refusal::Rule => stats.tcp_rejected_by_rule.fetch_add(1, Relaxed),
            Refusal::UnknownFake => {
                stats.drops[EngineDrop::FakeIpUnknown as usize].fetch_add(1, Relaxed)
            }
        };
    }
}

/// Decide what happens to a new connection to `server`. No await, no I/O:
/// called from the driver for every SYN.
pub(crate) fn plan(sh: &Shared, server: SocketAddr) -> Plan {
    if let Some(dns) = &sh.dns {
        if dns.hijacks(server) {
            return Plan::Dns;
        }
        if dns.is_fake(server.ip()) {
            let Some(domain) = dns.fake_domain(server.ip()) else {
                return Plan::Refuse(Refusal::UnknownFake);
            };
            return match sh.outbounds.route(&Target::fake_ip(server, &domain)) {
                Route::Reject => Plan::Refuse(Refusal::Rule),
                route => Plan::Connect {
                    route,
                    dst: Address::Domain(domain.to_string(), server.port()),
                },
            };
        }
    }
    if sniff_worthwhile(sh, server) {
        return Plan::Sniff;
    }
    match sh.outbounds.route(&Target::ip(server)) {
        Route::Reject => Plan::Refuse(Refusal::Rule),
        route => Plan::Connect {
            route,
            dst: Address::Ip(server),
        },
    }
}

/// Sniffing delays routing until the app speaks, so it is only done where a
/// domain could change the route.
fn sniff_worthwhile(sh: &Shared, server: SocketAddr) -> bool {
    let cfg = &sh.sniff;
    cfg.enabled
        && cfg
            .ports
            .iter()
            .any(|p| (p.start..=p.end).contains(&server.port()))
        && sh.outbounds.needs_domain(server)
}

/// Connect `dst` along `route`. A domain on a direct route is resolved
/// through kerntun's DNS service (never the host's resolver, which would
/// leak the query around the tunnel); the family follows the address the app
/// used.
pub(crate) async fn connect(
    sh: &Shared,
    route: Route,
    dst: &Address,
    v6: bool,
) -> Result<OutboundStream, OutboundError> {
    if let (Route::Direct, Address::Domain(domain, port)) = (route, dst) {
        let Some(dns) = &sh.dns else {
            return Err(OutboundError::Unresolved(dst.to_string()));
        };
        let ip = dns
            .resolve(domain, v6, &sh.stats)
            .await
            .map_err(|e| OutboundError::Unresolved(format!("{dst}: {e}")))?;
        let resolved = Address::Ip(SocketAddr::new(ip, *port));
        return sh.outbounds.connect(route, &resolved, &sh.stats).await;
    }
    sh.outbounds.connect(route, dst, &sh.stats).await
}

/// The route for a sniffed connection and the address the outbound is given
/// (the address the app used: the sniffed name only picks the rule).
pub(crate) fn route_sniffed(sh: &Shared, server: SocketAddr, domain: Option<&str>) -> Route {
    sh.outbounds.route(&match domain {
        Some(d) => Target::sniffed(server, d),
        None => Target::ip(server),
    })
}

/// How long sniffing waits between looks when the first bytes are
/// incomplete (peek cannot wait for *more* data than it already saw).
const SNIFF_RETRY: Duration = Duration::from_millis(5);

/// Sniff a kernel socket without consuming anything (MSG_PEEK): the relay
/// later moves every byte, spliced or copied. Returns the domain, if the
/// first bytes named one within `timeout`.
pub(crate) async fn sniff_peek(
    app: &TcpStream,
    timeout: Duration,
    stats: &Stats,
) -> Option<String> {
    let mut buf = vec![0u8; sniff::MAX_SNIFF];
    let found = tokio::time::timeout(timeout, async {
        loop {
            let n = app.peek(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            match sniff::sniff(&buf[..n]) {
                Sniffed::Domain { name, .. } => return Some(name.to_owned()),
                Sniffed::NoDomain => return None,
                Sniffed::NeedMore if n == buf.len() => return None,
                Sniffed::NeedMore => tokio::time::sleep(SNIFF_RETRY).await,
            }
        }
    })
    .await
    .ok()
    .flatten();
    count_sniff(stats, found.is_some());
    found
}

pub(crate) fn count_sniff(stats: &Stats, found: bool) {
    if found {
        stats.dns.sniffed.fetch_add(1, Relaxed);
    } else {
        stats.dns.sniff_misses.fetch_add(1, Relaxed);
    }
}

/// The app's side of a connection, as the DNS-over-TCP loop needs it.
pub(crate) trait AppStream {
    /// Read into `buf`; 0 at the app's FIN.
    async fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize>;
    /// Write all of `data`.
    async fn send_all(&mut self, data: &[u8]) -> io::Result<()>;
    /// Fill `buf` exactly; `UnexpectedEof` if the app closes first.
    async fn read_exact(&mut self, mut buf: &mut [u8]) -> io::Result<()> {
        while !buf.is_empty() {
            let n = self.recv(buf).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            buf = &mut buf[n..];
        }
        Ok(())
    }
}

impl AppStream for TcpStream {
    async fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read(buf).await
    }
    async fn send_all(&mut self, data: &[u8]) -> io::Result<()> {
        self.write_all(data).await
    }
}
