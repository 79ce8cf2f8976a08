//! The system netstack: kerntun does not implement TCP. Each TCP packet read
//! from the TUN is rewritten in place (source NAT) and written back, so the
//! kernel's own TCP accepts it on a listener bound to the gateway address; the
//! accepted socket's peer port is the NAT port, which the NAT table maps back
//! to the app's original 5-tuple (DESIGN.md parts 4-5).
//!
//! Connect-first: a new connection's SYN is routed by the rules and held
//! while the outbound connects. Only when the outbound answers is the SYN
//! rewritten and handed to the kernel; if the outbound refuses or times out,
//! the app receives an RST answering its SYN. The app therefore sees the same
//! thing a real network would show it (`ECONNREFUSED`, not a connection that
//! opens and then dies), which keeps happy-eyeballs and fallback logic in apps
//! working. A SYN retransmitted while the connect is pending is absorbed.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::budget::{Admission, Budget, OwnedPermit};
use crate::dispatch::{self, Plan};
use crate::nat::{FlowKey, NatGuard, NatTable};
use crate::outbound::Address;
use crate::outbound::{OutboundStream, Outbounds, Route, SocketFactory, reset_on_close};
use crate::packet::{self, Disposition, IpInfo, TcpInfo};
use crate::relay;
use crate::smol::{self, SmolStack, TunSink};
use crate::stats::{EngineDrop, LocalCounters, Stats, WarnLimiter};
use crate::tun::{HEADROOM, Tun};
use crate::udp::UdpTable;

/// Engine phases. Draining: sessions reset their connections and accept
/// loops end, while the driver keeps running so the kernel's RSTs are still
/// translated and reach the apps. Stopped: everything ends.
pub(crate) const RUNNING: u8 = 0;
pub(crate) const DRAINING: u8 = 1;
pub(crate) const STOPPED: u8 = 2;

pub(crate) use crate::translate::FamilyAddrs;
use crate::translate::{self, Cause, StackAddrs, TcpStep};

/// An outbound connection waiting for the kernel to accept the app's side.
#[derive(Debug)]
pub(crate) enum Pending {
    /// The outbound connect is in flight; the app's SYN is held.
    Connecting,
    /// The SYN went to the kernel; the accepted connection goes on to
    /// `next`. Expires if never accepted.
    Ready {
        next: Next,
        permit: OwnedPermit,
        since: Instant,
    },
}

/// What an accepted connection does.
#[derive(Debug)]
pub(crate) enum Next {
    /// Relay to the outbound connected at SYN time (handshake done; it
    /// carries the route and the framing).
    Relay(OutboundStream),
    /// DNS over TCP, answered by kerntun.
    Dns,
    /// Sniff the domain from the first bytes, then route and connect.
    Sniff,
}

/// State shared by the driver, the accept loops, connect tasks and sessions.
#[derive(Debug)]
pub(crate) struct Shared {
    pub nat: Arc<NatTable>,
    pub tun: Tun,
    pub factory: SocketFactory,
    /// Proxies, the rules resolved to them, and the relay options.
    pub outbounds: Arc<Outbounds>,
    pub budget: Budget,
    pub admission: Arc<Admission>,
    pub stats: Stats,
    pub warn: WarnLimiter,
    pub pending: Mutex<HashMap<u16, Pending>>,
    pub v4: Option<FamilyAddrs>,
    pub v6: Option<FamilyAddrs>,
    pub mtu: u16,
    pub udp_idle: Duration,
    pub half_open_timeout: Duration,
    /// Lifecycle phase ([`RUNNING`], [`DRAINING`], [`STOPPED`]) watched by every loop.
    pub stop: watch::Sender<u8>,
    pub fatal: Mutex<Option<String>>,
    /// The smoltcp stack, when it is the one selected: TCP packets go to it
    /// instead of the NAT translation (UDP and ICMP paths are shared).
    pub smol: Option<Arc<SmolStack>>,
    /// The DNS service, when `[dns]` is on.
    pub dns: Option<Arc<crate::dns::Dns>>,
    /// Domain sniffing (`[sniff]`).
    pub sniff: crate::sniff::SniffConfig,
}

impl Shared {
    /// Record a fatal error (the first one wins) and stop the engine's loops.
    pub fn fail(&self, what: String) {
        tracing::error!("kerntun stopping: {what}");
        self.fatal.lock().get_or_insert(what);
        self.stop.send_replace(STOPPED);
    }
}

/// The per-packet processing function shared by every driver. Owns the UDP
/// flow table so the uplink datagram path takes no locks.
#[derive(Debug)]
pub(crate) struct Processor {
    pub shared: Arc<Shared>,
    pub local: LocalCounters,
    pub udp: UdpTable,
    /// The clock reading for the current batch (one `Instant::now()` per read).
    pub now: Instant,
    last_ip: Option<IpInfo>,
}

impl Processor {
    pub fn new(shared: Arc<Shared>) -> Self {
        let now = Instant::now();
        Self {
            udp: UdpTable::new(shared.clone(), now),
            shared,
            local: LocalCounters::new(now),
            now,
            last_ip: None,
        }
    }

    /// Process one packet in place. The driver acts on the result:
    /// `WriteBack(n)` -> write `buf[..n]` to the TUN, `ForwardUdp` -> call
    /// [`Processor::forward_udp`] with the same buffer, `Done` -> nothing.
    #[inline]
    pub fn process(&mut self, buf: &mut [u8]) -> Disposition {
        let ip = match packet::parse_ip(buf) {
            Ok(ip) => ip,
            Err(r) => {
                self.local.reject(r);
                return Disposition::Done;
            }
        };
        match ip.protocol {
            6 => self.tcp(buf, &ip),
            17 => {
                self.last_ip = Some(ip);
                Disposition::ForwardUdp
            }
            1 | 58 => self.icmp(buf, &ip),
            _ => {
                self.local.reject(packet::Reject::UnsupportedProtocol);
                Disposition::Done
            }
        }
    }

    /// The datagram path for a packet `process` answered `ForwardUdp` for.
    pub fn forward_udp(&mut self, buf: &[u8]) {
        if let Some(ip) = self.last_ip.take() {
            self.udp.handle(buf, &ip, self.now, &mut self.local);
        }
    }

    fn family(&self, addr: IpAddr) -> Option<FamilyAddrs> {
        match addr {
            IpAddr::V4(_) => self.shared.v4,
            IpAddr::V6(_) => self.shared.v6,
        }
    }

    fn icmp(&mut self, buf: &mut [u8], ip: &IpInfo) -> Disposition {
        let is_gateway = self.family(ip.dst).is_some_and(|f| f.gateway == ip.dst);
        if is_gateway && let Ok(n) = packet::echo_reply_in_place(buf, ip) {
            self.local.icmp_echo_replies += 1;
            return Disposition::WriteBack(n);
        }
        self.local.drop(EngineDrop::IcmpUnhandled);
        Disposition::Done
    }

    fn tcp(&mut self, buf: &mut [u8], ip: &IpInfo) -> Disposition {
        if let Some(stack) = &self.shared.smol {
            return smol_tcp(&mut self.local, &self.shared, stack, self.now, buf, ip);
        }
        let sh = &*self.shared;
        let addrs = StackAddrs {
            v4: sh.v4,
            v6: sh.v6,
        };
        let held = |port| matches!(sh.pending.lock().get(&port), Some(Pending::Connecting));
        match translate::translate_tcp(buf, ip, &sh.nat, &addrs, self.now, held) {
            TcpStep::Uplink(n) => {
                self.local.packets_up += 1;
                self.local.bytes_up += n as u64;
                Disposition::WriteBack(n)
            }
            TcpStep::Downlink(n) => {
                self.local.packets_down += 1;
                self.local.bytes_down += n as u64;
                Disposition::WriteBack(n)
            }
            TcpStep::NewFlow { key, port, tcp } => self.new_connection(buf, ip, &tcp, key, port),
            TcpStep::Reset { len, cause } => {
                if matches!(cause, EngineDrop::NatTableFull | EngineDrop::NatNoFreePort) {
                    sh.warn.warn(format_args!(
                        "NAT table refused a new flow ({})",
                        cause.as_str()
                    ));
                }
                self.local.drop(cause);
                Disposition::WriteBack(len)
            }
            TcpStep::Drop(Cause::Reject(r)) => {
                self.local.reject(r);
                Disposition::Done
            }
            TcpStep::Drop(Cause::Engine(d)) => {
                self.local.drop(d);
                Disposition::Done
            }
        }
    }

    /// A SYN that created a NAT entry: plan it, take an admission permit,
    /// then hold it while the outbound connects, or (DNS, sniffing) hand it
    /// to the kernel at once.
    fn new_connection(
        &mut self,
        buf: &mut [u8],
        ip: &IpInfo,
        tcp: &TcpInfo,
        key: FlowKey,
        port: u16,
    ) -> Disposition {
        let sh = &self.shared;
        let plan = dispatch::plan(sh, key.server);
        if let Plan::Refuse(why) = plan {
            sh.nat.abort_half_open(port, self.now);
            why.count(&sh.stats);
            return Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, tcp));
        }
        let Some(permit) = sh.admission.try_acquire_owned(self.now) else {
            sh.nat.abort_half_open(port, self.now);
            sh.stats.admission_refused.fetch_add(1, Relaxed);
            sh.warn.warn(format_args!(
                "TCP admission refused a session ({} active, limit {} at {:?} pressure)",
                sh.admission.active(),
                sh.admission.limit(self.now),
                sh.admission.pressure(self.now)
            ));
            return Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, tcp));
        };
        let (route, dst) = match plan {
            Plan::Connect { route, dst } => (route, dst),
            Plan::Dns | Plan::Sniff => {
                // Nothing to connect first: the kernel accepts now and the
                // session does the rest.
                let Some(fam) = self.family(key.server.ip()) else {
                    return Disposition::Done;
                };
                let nat_src = SocketAddr::new(fam.nat, port);
                let listener = SocketAddr::new(fam.gateway, fam.listen_port);
                let next = if matches!(plan, Plan::Dns) {
                    Next::Dns
                } else {
                    Next::Sniff
                };
                sh.pending.lock().insert(
                    port,
                    Pending::Ready {
                        next,
                        permit,
                        since: self.now,
                    },
                );
                return match packet::rewrite_tcp(buf, ip, nat_src, listener) {
                    Ok(()) => Disposition::WriteBack(ip.len),
                    Err(r) => {
                        sh.pending.lock().remove(&port);
                        sh.nat.abort_half_open(port, self.now);
                        self.local.reject(r);
                        Disposition::Done
                    }
                };
            }
            Plan::Refuse(_) => return Disposition::Done,
        };
        // One small allocation per new connection (the held SYN, ~60-80 bytes).
        let mut syn = vec![0u8; HEADROOM + ip.len].into_boxed_slice();
        syn[HEADROOM..].copy_from_slice(&buf[..ip.len]);
        sh.pending.lock().insert(port, Pending::Connecting);
        tokio::spawn(connect_then_release(
            sh.clone(),
            key,
            port,
            syn,
            permit,
            route,
            dst,
        ));
        Disposition::Done
    }

    /// Whether there is state a cleanup tick could expire.
    pub fn has_state(&self) -> bool {
        !self.shared.nat.is_empty() || self.udp.len() > 0 || !self.shared.pending.lock().is_empty()
    }

    /// The periodic cleanup: NAT entries, unaccepted outbounds, idle UDP flows.
    pub fn cleanup(&mut self, now: Instant) {
        self.shared.nat.cleanup(now);
        let timeout = self.shared.half_open_timeout;
        self.shared.pending.lock().retain(|_, p| match p {
            Pending::Connecting => true,
            Pending::Ready { since, .. } => now.saturating_duration_since(*since) < timeout,
        });
        self.udp.sweep(now);
    }
}

/// The smoltcp stack's TCP path: the same connect-first admission as
/// [`Processor::new_connection`], then the segment goes to smoltcp, whose
/// answers are written to the TUN from inside its poll.
fn smol_tcp(
    local: &mut LocalCounters,
    sh: &Arc<Shared>,
    stack: &Arc<SmolStack>,
    now: Instant,
    buf: &mut [u8],
    ip: &IpInfo,
) -> Disposition {
    let tcp = match packet::parse_tcp(buf, ip) {
        Ok(t) => t,
        Err(r) => {
            local.reject(r);
            return Disposition::Done;
        }
    };
    let fam = match ip.dst {
        IpAddr::V4(_) => sh.v4,
        IpAddr::V6(_) => sh.v6,
    };
    if fam.is_none() {
        local.drop(EngineDrop::FamilyDisabled);
        return Disposition::Done;
    }
    if !smol::is_unicast(ip.src) || !smol::is_unicast(ip.dst) {
        local.drop(EngineDrop::StrayTcp);
        return Disposition::Done;
    }
    local.packets_up += 1;
    local.bytes_up += ip.len as u64;
    if tcp.is_syn_only() {
        let key = (
            SocketAddr::new(ip.src, tcp.src_port),
            SocketAddr::new(ip.dst, tcp.dst_port),
        );
        match stack.syn(key) {
            smol::Syn::Known => {}
            smol::Syn::Connecting => {
                local.drop(EngineDrop::SynWhileConnecting);
                return Disposition::Done;
            }
            smol::Syn::Full => {
                local.drop(EngineDrop::NatTableFull);
                sh.warn.warn(format_args!(
                    "smoltcp socket budget refused a new flow ({})",
                    EngineDrop::NatTableFull.as_str()
                ));
                return Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, &tcp));
            }
            smol::Syn::New => {
                let plan = dispatch::plan(sh, key.1);
                if let Plan::Refuse(why) = plan {
                    stack.unmark(&key);
                    why.count(&sh.stats);
                    return Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, &tcp));
                }
                let Some(permit) = sh.admission.try_acquire_owned(now) else {
                    stack.unmark(&key);
                    sh.stats.admission_refused.fetch_add(1, Relaxed);
                    sh.warn.warn(format_args!(
                        "TCP admission refused a session ({} active, limit {} at {:?} pressure)",
                        sh.admission.active(),
                        sh.admission.limit(now),
                        sh.admission.pressure(now)
                    ));
                    return Disposition::WriteBack(packet::tcp_rst_reply(buf, ip, &tcp));
                };
                // As in the system stack: the SYN is held (one small
                // allocation per new connection) while the outbound connects.
                let mut syn = vec![0u8; HEADROOM + ip.len].into_boxed_slice();
                syn[HEADROOM..].copy_from_slice(&buf[..ip.len]);
                tokio::spawn(smol::connect_then_accept(
                    sh.clone(),
                    stack.clone(),
                    key,
                    syn,
                    permit,
                    plan,
                ));
                return Disposition::Done;
            }
        }
    }
    stack.input(&buf[..ip.len], now, &mut TunSink(&sh.tun), &sh.stats);
    Disposition::Done
}

/// Connect the outbound for a held SYN along the route chosen at SYN time,
/// then release the SYN to the kernel (success) or answer the app with an
/// RST (failure).
async fn connect_then_release(
    sh: Arc<Shared>,
    key: FlowKey,
    port: u16,
    mut syn: Box<[u8]>,
    permit: OwnedPermit,
    route: Route,
    dst: Address,
) {
    let len = syn.len() - HEADROOM;
    let result = dispatch::connect(&sh, route, &dst, key.server.is_ipv6()).await;
    let pkt = &mut syn[HEADROOM..];
    let (ip, tcp) =
        match packet::parse_ip(pkt).and_then(|ip| Ok((ip, packet::parse_tcp(pkt, &ip)?))) {
            Ok(v) => v,
            Err(_) => return, // parsed once already; cannot happen
        };
    let fam = match key.server.ip() {
        IpAddr::V4(_) => sh.v4,
        IpAddr::V6(_) => sh.v6,
    };
    let Some(fam) = fam else { return };
    match result {
        Ok(out) => {
            let nat_src = SocketAddr::new(fam.nat, port);
            let listener = SocketAddr::new(fam.gateway, fam.listen_port);
            if packet::rewrite_tcp(pkt, &ip, nat_src, listener).is_err() {
                return;
            }
            sh.pending.lock().insert(
                port,
                Pending::Ready {
                    next: Next::Relay(out),
                    permit,
                    since: Instant::now(),
                },
            );
            if sh.tun.send(&mut syn, len).await.is_err() {
                sh.stats.drop(EngineDrop::TunWrite);
            }
        }
        Err(e) => {
            sh.pending.lock().remove(&port);
            sh.nat.abort_half_open(port, Instant::now());
            sh.stats.tcp_connect_failed.fetch_add(1, Relaxed);
            tracing::debug!(
                "connect {} -> {dst} via {}: {e}",
                key.client,
                sh.outbounds.name(route)
            );
            drop(permit);
            let n = packet::tcp_rst_reply(pkt, &ip, &tcp);
            if sh.tun.send(&mut syn, n).await.is_err() {
                sh.stats.drop(EngineDrop::TunWrite);
            }
        }
    }
}

/// Bind the kernel listener for one family on the gateway address, port 0.
pub(crate) fn bind_listener(
    gateway: IpAddr,
    backlog: u32,
    #[allow(unused_variables)] tun_index: Option<u32>,
) -> io::Result<TcpListener> {
    let sock = Socket::new(
        Domain::for_address(SocketAddr::new(gateway, 0)),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    sock.set_nonblocking(true)?;
    if gateway.is_ipv6() {
        sock.set_only_v6(true)?;
        // The gateway address may still be tentative (DAD) right after the
        // device came up; FREEBIND lets the bind succeed anyway.
        #[cfg(any(target_os = "linux", target_os = "android"))]
        sock.set_freebind_v6(true)?;
    }
    // Darwin: SYNs rewritten onto the utun only reach a listener bound to that
    // interface (IP_BOUND_IF / IPV6_BOUND_IF), set before bind.
    #[cfg(any(target_os = "macos", target_os = "ios"))]
    if let Some(idx) = tun_index.and_then(std::num::NonZeroU32::new) {
        if gateway.is_ipv6() {
            sock.bind_device_by_index_v6(Some(idx))?;
        } else {
            sock.bind_device_by_index_v4(Some(idx))?;
        }
    }
    let bound = sock.bind(&SocketAddr::new(gateway, 0).into());
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    let bound = match bound {
        // No FREEBIND elsewhere: fall back to the wildcard (the peer filter in
        // the accept loop still admits only the NAT address).
        Err(_) if gateway.is_ipv6() => {
            sock.bind(&SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), 0).into())
        }
        other => other,
    };
    bound?;
    sock.listen(i32::try_from(backlog).unwrap_or(i32::MAX))?;
    TcpListener::from_std(sock.into())
}

/// Accept kernel-side connections, match them to their outbound and start the
/// relay. Returns only on a fatal listener error.
pub(crate) async fn accept_loop(sh: Arc<Shared>, listener: TcpListener, fam: FamilyAddrs) {
    let mut stop = sh.stop.subscribe();
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s >= DRAINING) => return,
            r = listener.accept() => r,
        };
        let (app, peer) = match accepted {
            Ok(v) => v,
            Err(e) => {
                sh.stats.accept_errors.fetch_add(1, Relaxed);
                match e.raw_os_error() {
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                        sh.warn
                            .warn(format_args!("accept on {}: {e}; backing off", fam.gateway));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Some(libc::EINTR | libc::EPROTO | libc::ECONNABORTED) => {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    _ => {
                        sh.fail(format!("listener on {} failed: {e}", fam.gateway));
                        return;
                    }
                }
                continue;
            }
        };
        // Only the NAT address may connect: another local process reaching the
        // listener's port is refused and counted.
        if peer.ip() != fam.nat {
            sh.stats.accept_foreign_peer.fetch_add(1, Relaxed);
            reset_on_close(&app);
            continue;
        }
        let now = Instant::now();
        let accepted = match sh.nat.accept(peer.port(), now) {
            Ok(a) => a,
            Err(_) => {
                sh.stats.accept_unknown_port.fetch_add(1, Relaxed);
                reset_on_close(&app);
                continue;
            }
        };
        let pending = sh.pending.lock().remove(&peer.port());
        let Some(Pending::Ready { next, permit, .. }) = pending else {
            // No outbound waiting (expired): close now and keep the mapping in
            // Closing so the kernel's RST reaches the app, instead of deleting
            // it and blackholing the app.
            sh.nat.mark_closing(accepted.port, accepted.generation, now);
            sh.stats.accept_unknown_port.fetch_add(1, Relaxed);
            reset_on_close(&app);
            continue;
        };
        let guard = sh.nat.guard(&accepted);
        let _ = app.set_nodelay(true);
        let server = accepted.key.server;
        match next {
            Next::Relay(out) => {
                tokio::spawn(session(sh.clone(), app, out, guard, permit));
            }
            Next::Dns => {
                tokio::spawn(dns_session(sh.clone(), app, guard, permit));
            }
            Next::Sniff => {
                tokio::spawn(sniff_session(sh.clone(), app, server, guard, permit));
            }
        }
    }
}

/// Counts a session as active for as long as it lives (also when aborted).
struct ActiveSession<'a>(&'a Stats);

impl Drop for ActiveSession<'_> {
    fn drop(&mut self) {
        self.0.tcp_sessions_active.fetch_sub(1, Relaxed);
    }
}

async fn session(
    sh: Arc<Shared>,
    app: TcpStream,
    out: OutboundStream,
    guard: NatGuard,
    permit: OwnedPermit,
) {
    sh.stats.tcp_sessions_total.fetch_add(1, Relaxed);
    sh.stats.tcp_sessions_active.fetch_add(1, Relaxed);
    let active = ActiveSession(&sh.stats);
    let mut phase = sh.stop.subscribe();
    let OutboundStream {
        stream: out,
        codec,
        route,
    } = out;
    let meter = relay::Meter {
        up: &sh.stats.tcp_bytes_up,
        down: &sh.stats.tcp_bytes_down,
        spliced: &sh.stats.tcp_bytes_spliced,
        copied: &sh.stats.tcp_bytes_copied,
    };
    let opts = &sh.outbounds.relay;
    let relayed = async {
        match codec {
            // Plain kernel sockets on both sides: splice where possible.
            None => relay::relay(&app, &out, opts, &meter).await,
            Some(codec) => {
                let (mut seal, mut open) = *codec;
                relay::relay_codec(&app, &out, &mut seal, &mut open, opts.buffer, &meter).await
            }
        }
    };
    let r = tokio::select! {
        r = relayed => r,
        _ = phase.wait_for(|p| *p >= DRAINING) => Err(io::Error::other("engine stopping")),
    };
    match &r {
        Ok(done) => {
            let fell_back = [done.up, done.down]
                .iter()
                .filter(|l| {
                    !matches!(l.fallback, None | Some(relay::Fallback::Disabled)) && l.bytes() > 0
                })
                .count();
            if fell_back > 0 {
                sh.stats
                    .splice_fallbacks
                    .fetch_add(fell_back as u64, Relaxed);
            }
        }
        Err(e) => {
            // A Shadowsocks frame that does not decrypt is the proxy's fault.
            if e.kind() == io::ErrorKind::InvalidData
                && let Route::Proxy(i) = route
                && let Some(c) = sh.stats.outbounds.get(i)
            {
                c.protocol_errors.fetch_add(1, Relaxed);
            }
            // Propagate a failure as a reset on both sides rather than a clean FIN.
            tracing::debug!("relay via {} ended with {e}", sh.outbounds.name(route));
            reset_on_close(&app);
            reset_on_close(&out);
        }
    }
    drop(active);
    drop(permit);
    drop(guard);
}

/// DNS over TCP to a hijacked address: answered here, never relayed.
async fn dns_session(sh: Arc<Shared>, mut app: TcpStream, guard: NatGuard, permit: OwnedPermit) {
    let mut phase = sh.stop.subscribe();
    if let Some(dns) = sh.dns.clone() {
        let r = tokio::select! {
            r = dns.serve_tcp(&mut app, &sh.stats) => r,
            _ = phase.wait_for(|p| *p >= DRAINING) => Err(io::Error::other("engine stopping")),
        };
        if let Err(e) = r {
            tracing::debug!("dns over tcp ended with {e}");
            reset_on_close(&app);
        }
    }
    drop(app);
    drop(permit);
    drop(guard);
}

/// A connection accepted before routing: read its domain from the first
/// bytes (peeked, so the relay still moves every byte), route, connect, relay.
/// A refusal or a failed connect resets the app's connection.
async fn sniff_session(
    sh: Arc<Shared>,
    app: TcpStream,
    server: SocketAddr,
    guard: NatGuard,
    permit: OwnedPermit,
) {
    let timeout = Duration::from_millis(sh.sniff.timeout_ms);
    let mut phase = sh.stop.subscribe();
    let connected = async {
        let domain = dispatch::sniff_peek(&app, timeout, &sh.stats).await;
        let route = dispatch::route_sniffed(&sh, server, domain.as_deref());
        if route == Route::Reject {
            sh.stats.tcp_rejected_by_rule.fetch_add(1, Relaxed);
            return None;
        }
        match dispatch::connect(&sh, route, &Address::Ip(server), server.is_ipv6()).await {
            Ok(out) => Some(out),
            Err(e) => {
                sh.stats.tcp_connect_failed.fetch_add(1, Relaxed);
                tracing::debug!(
                    "connect {server} ({}) via {}: {e}",
                    domain.as_deref().unwrap_or("no domain"),
                    sh.outbounds.name(route)
                );
                None
            }
        }
    };
    let out = tokio::select! {
        out = connected => out,
        _ = phase.wait_for(|p| *p >= DRAINING) => None,
    };
    match out {
        Some(out) => Box::pin(session(sh, app, out, guard, permit)).await,
        None => {
            reset_on_close(&app);
            drop(app);
            drop(permit);
            drop(guard);
        }
    }
}
