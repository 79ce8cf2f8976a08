//! The kernel side of the system stack: one listener per address family on
//! the gateway address, and the loop that accepts the rewritten connections
//! and starts their sessions.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::net::TcpListener;

use super::SystemStack;
use super::pending::Pending;
use crate::budget::OwnedPermit;
use crate::dispatch::session::{self, Hold};
use crate::lifecycle::Phase;
use crate::nat::{NatError, NatTable};
use crate::outbound::{reset_on_close, set_keepalive};
use crate::packet::tcp::SavedSyn;
use crate::translate::FamilyAddrs;

/// The interface the kernel listener is bound to, so that it takes only
/// connections that came in through the TUN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ListenOn<'a> {
    /// Linux/Android: SO_BINDTODEVICE by name. Without it, a local process
    /// that can source the NAT address (IP_TRANSPARENT, IPV6_FREEBIND)
    /// reaches the listener through loopback and would pass the accept
    /// loop's peer check.
    Name(&'a str),
    /// Darwin: IP_BOUND_IF / IPV6_BOUND_IF by index. SYNs rewritten onto
    /// the utun reach only a listener bound to it.
    Index(NonZeroU32),
    /// Unbound: the TUN's name is unknown (a descriptor whose interface
    /// could not be named); the accept loop's peer check still applies.
    Any,
}

/// Darwin: the utun's interface index is unknown, so the listener cannot
/// be bound to it (`StartError::TunIndex`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NoTunIndex;

/// Where the listener binds, from what is known of the TUN (`darwin`: the
/// Darwin rules apply; a pure function so that both are tested on Linux).
/// Darwin needs the index, or no TCP connection ever reaches the listener:
/// a missing one is an error, never a silently unbound listener. Linux
/// binds by name when it is known.
pub(crate) fn listen_on(
    darwin: bool,
    name: Option<&str>,
    index: Option<u32>,
) -> Result<ListenOn<'_>, NoTunIndex> {
    if darwin {
        return index
            .and_then(NonZeroU32::new)
            .map(ListenOn::Index)
            .ok_or(NoTunIndex);
    }
    Ok(name.map_or(ListenOn::Any, ListenOn::Name))
}

/// Bind the kernel listener for one family on the gateway address, port 0,
/// to the TUN interface `on`.
pub(crate) fn bind_listener(
    gateway: IpAddr,
    backlog: u32,
    on: ListenOn<'_>,
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
        #[cfg(linux_like)]
        sock.set_freebind_v6(true)?;
    }
    // The accept loop checks each connection's SYN against the one its NAT
    // entry recorded ([`syn_isn`]). Without it (a kernel before 4.2) the
    // peer address and the device binding are what remains.
    #[cfg(linux_like)]
    if let Err(e) = crate::sys::set_save_syn(std::os::fd::AsFd::as_fd(&sock)) {
        tracing::warn!(
            "TCP_SAVE_SYN on the kernel listener: {e}; accepted connections are matched by address only"
        );
    }
    // Set before bind, so no connection from elsewhere is ever queued.
    match on {
        ListenOn::Name(name) => bind_to_name(&sock, name)?,
        ListenOn::Index(idx) => bind_to_index(&sock, gateway, idx)?,
        ListenOn::Any => {}
    }
    let bound = sock.bind(&SocketAddr::new(gateway, 0).into());
    #[cfg(not(linux_like))]
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

/// SO_BINDTODEVICE. Kernels before 5.7 refuse it without CAP_NET_RAW,
/// which an Android app does not hold: the listener then stays unbound
/// (said in the start log) and the accept loop's peer check is what
/// remains: a refused option costs the pinning, not the listener.
#[cfg(linux_like)]
fn bind_to_name(sock: &Socket, name: &str) -> io::Result<()> {
    match sock.bind_device(Some(name.as_bytes())) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            tracing::warn!(
                "binding the kernel listener to {name}: {e}; it stays unbound (accepts are still checked against the NAT address)"
            );
            Ok(())
        }
        other => other,
    }
}

/// `listen_on` names the device only where SO_BINDTODEVICE exists.
#[cfg(not(linux_like))]
fn bind_to_name(_: &Socket, name: &str) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        format!("no SO_BINDTODEVICE here to bind the listener to {name}"),
    ))
}

/// IP_BOUND_IF / IPV6_BOUND_IF.
#[cfg(apple)]
fn bind_to_index(sock: &Socket, gateway: IpAddr, idx: NonZeroU32) -> io::Result<()> {
    if gateway.is_ipv6() {
        sock.bind_device_by_index_v6(Some(idx))
    } else {
        sock.bind_device_by_index_v4(Some(idx))
    }
}

/// `listen_on` asks for an index only on Darwin.
#[cfg(not(apple))]
fn bind_to_index(_: &Socket, gateway: IpAddr, idx: NonZeroU32) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        format!("no IP_BOUND_IF here to bind the listener on {gateway} to interface {idx}"),
    ))
}

/// What a system-stack session holds until it ends: its admission permit
/// and its flow, which it marks Closing when it drops (normally, on abort,
/// or while a panic unwinds) unless a newer flow holds the port, so an
/// Active entry is never leaked. The session ends (both sides reset) once
/// the entry has seen no packet for `timeouts.tcp_idle_s`, as the table
/// would drop it then and leave the session holding its sockets and permit
/// for a connection nothing can reach any more.
#[derive(Debug)]
pub(crate) struct FlowHold {
    /// Released when the hold drops, after the entry is marked.
    _permit: OwnedPermit,
    table: Arc<NatTable<Pending>>,
    port: u16,
    /// Stamped by the accept: the mark touches no newer flow on the port.
    generation: u64,
}

impl FlowHold {
    /// The hold on the flow at `port` that the accept stamped `generation`.
    pub(super) fn new(
        permit: OwnedPermit,
        table: Arc<NatTable<Pending>>,
        port: u16,
        generation: u64,
    ) -> Self {
        FlowHold {
            _permit: permit,
            table,
            port,
            generation,
        }
    }
}

impl Drop for FlowHold {
    fn drop(&mut self) {
        // The table reads no clock: the real one is read here, when the
        // session ends. No panic path inside: parking_lot locks do not
        // poison, so this is safe during an unwind.
        self.table
            .mark_closing(self.port, self.generation, Instant::now());
    }
}

impl Hold for FlowHold {
    async fn idle(&self) {
        // One timer per session, armed for the whole idle period: a busy
        // connection wakes it once per period, to find a later packet.
        while let Some(left) = self
            .table
            .idle_left(self.port, self.generation, Instant::now())
        {
            if left.is_zero() {
                return;
            }
            tokio::time::sleep(left).await;
        }
    }
}

/// Accept kernel-side connections, match them to their outbound and start the
/// relay. Returns only on a fatal listener error.
pub(crate) async fn accept_loop(st: Arc<SystemStack>, listener: TcpListener, fam: FamilyAddrs) {
    let d = &st.d;
    loop {
        let accepted = tokio::select! {
            biased;
            () = d.life.reached(Phase::Draining) => return,
            r = listener.accept() => r,
        };
        let (app, peer) = match accepted {
            Ok(v) => v,
            Err(e) => {
                d.stats.accept_errors.fetch_add(1, Relaxed);
                match e.raw_os_error() {
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
                        d.warn
                            .warn(format_args!("accept on {}: {e}; backing off", fam.gateway));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Some(libc::EINTR | libc::EPROTO | libc::ECONNABORTED) => {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    _ => {
                        d.life
                            .fail(format!("listener on {} failed: {e}", fam.gateway));
                        return;
                    }
                }
                continue;
            }
        };
        // Only the NAT address may connect: another local process reaching the
        // listener's port is refused and counted.
        if peer.ip() != fam.nat {
            d.stats.accept_foreign_peer.fetch_add(1, Relaxed);
            reset_on_close(&app);
            continue;
        }
        let isn = match syn_isn(&app) {
            SavedSyn::Isn(isn) => Some(isn),
            SavedSyn::Missing => {
                d.stats.accept_syn_unverified.fetch_add(1, Relaxed);
                None
            }
            // Saved, but not as the app's rewritten SYN reads: refused
            // like a SYN the entry did not record.
            SavedSyn::Unreadable => {
                d.stats.accept_foreign_peer.fetch_add(1, Relaxed);
                reset_on_close(&app);
                continue;
            }
        };
        let now = Instant::now();
        let accepted = match st.nat.accept_syn(peer.port(), isn, now) {
            Ok(a) => a,
            // Not the app's SYN: a local process that sourced the NAT
            // address and port (IP_TRANSPARENT, IPV6_FREEBIND) to take over
            // the app's outbound. The entry stays half-open for the app.
            Err(NatError::IsnMismatch) => {
                d.stats.accept_foreign_peer.fetch_add(1, Relaxed);
                reset_on_close(&app);
                continue;
            }
            Err(_) => {
                d.stats.accept_unknown_port.fetch_add(1, Relaxed);
                reset_on_close(&app);
                continue;
            }
        };
        let (next, permit) = match accepted.payload {
            Some(Pending::Ready { next, permit }) => (next, permit),
            // No outbound waiting: the engine never released this flow's
            // SYN (still connecting), so the connection is not the app's.
            // Close now and keep the mapping in Closing so the kernel's RST
            // reaches the app, instead of deleting it and blackholing the
            // app. (A flow whose handshake timed out is Closing already:
            // refused above.)
            other => {
                if let Some(p) = other {
                    p.close();
                }
                st.nat.mark_closing(accepted.port, accepted.generation, now);
                d.stats.accept_unknown_port.fetch_add(1, Relaxed);
                reset_on_close(&app);
                continue;
            }
        };
        let hold = FlowHold::new(permit, st.nat.clone(), accepted.port, accepted.generation);
        let _ = app.set_nodelay(true);
        let _ = set_keepalive(SockRef::from(&app));
        let (client, server) = (accepted.key.client, accepted.key.server);
        tokio::spawn(session::run(d.clone(), app, next, client, server, hold));
    }
}

/// The SYN that opened `conn`, from the headers the listener saved
/// (`TCP_SAVE_SYN`): the NAT entry recorded the app's ISN, and a
/// connection from anything else carries another (its sender's kernel
/// chose it). [`SavedSyn::Missing`] where the kernel saved none: a SYN
/// cookie completed the handshake (the listener's SYN queue was full), the
/// option is missing, or not Linux (Darwin binds the listener to the utun
/// instead, which a local process cannot source from). Headers longer than
/// the buffer (EINVAL: extension headers the app's SYNs do not carry) are
/// [`SavedSyn::Unreadable`].
fn syn_isn(conn: &tokio::net::TcpStream) -> SavedSyn {
    #[cfg(linux_like)]
    {
        // IPv6 (40) or IPv4 with options (60), TCP with options (60), and
        // room for IPv6 extension headers.
        let mut headers = [0u8; 512];
        match crate::sys::saved_syn(std::os::fd::AsFd::as_fd(conn), &mut headers) {
            Ok(n) => crate::packet::tcp::saved_syn(&headers[..n]),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => SavedSyn::Unreadable,
            Err(_) => SavedSyn::Missing,
        }
    }
    #[cfg(not(linux_like))]
    {
        let _ = conn;
        SavedSyn::Missing
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn darwin_without_the_utun_index_is_an_error_never_an_unbound_listener() {
        // Before, a missing index left the listener unbound and start
        // succeeded although no TCP connection could reach it.
        assert_eq!(listen_on(true, Some("utun4"), None), Err(NoTunIndex));
        assert_eq!(listen_on(true, None, Some(0)), Err(NoTunIndex));
        let idx = NonZeroU32::new(17).expect("nonzero");
        assert_eq!(
            listen_on(true, Some("utun4"), Some(17)),
            Ok(ListenOn::Index(idx))
        );
    }

    /// A flow accepted into `t` and its session's hold.
    fn held_flow(t: &Arc<NatTable<Pending>>, now: Instant) -> FlowHold {
        use crate::budget::Admission;
        use crate::nat::FlowKey;
        let key = FlowKey::new(
            "10.0.0.1:1000".parse().expect("sa"),
            "10.0.0.2:80".parse().expect("sa"),
        );
        let u = t.uplink(&key, Some(1), now).expect("syn");
        let accepted = t.accept(u.port, now).expect("accept");
        let admission = Arc::new(Admission::new([1, 1, 1]));
        let permit = admission.try_acquire_owned(now).expect("permit");
        FlowHold::new(permit, Arc::clone(t), accepted.port, accepted.generation)
    }

    fn table() -> Arc<NatTable<Pending>> {
        Arc::new(NatTable::new(
            crate::nat::NatConfig::default(),
            Instant::now(),
        ))
    }

    /// The idle watch sits inside every relay session's future, so its size
    /// is memory per connection: one timer and a few words.
    #[test]
    fn the_idle_watch_costs_a_timer_per_session() {
        let t = table();
        let hold = held_flow(&t, Instant::now());
        println!("[size] session hold {} B", std::mem::size_of_val(&hold));
        assert!(std::mem::size_of_val(&hold) <= 32);
        let watch = hold.idle();
        let size = std::mem::size_of_val(&watch);
        let sleep = std::mem::size_of::<tokio::time::Sleep>();
        println!("[size] idle watch {size} B, a tokio Sleep {sleep} B");
        assert!(size <= sleep + 64, "idle watch {size} B, a Sleep {sleep} B");
    }

    /// The hold marks its flow Closing when it drops, at the real time of
    /// the drop (the table reads no clock), and leaves a newer flow alone.
    #[test]
    fn dropping_the_hold_marks_its_flow_closing_now() {
        use crate::nat::NatState;
        let t = table();
        let start = Instant::now();
        let hold = held_flow(&t, start);
        let port = hold.port;
        std::thread::sleep(Duration::from_millis(20));
        let before = Instant::now();
        drop(hold);
        let after = Instant::now();
        let Some(NatState::Closing { since }) = t.state(port) else {
            panic!("not Closing: {:?}", t.state(port));
        };
        // The table keeps milliseconds since its epoch.
        let ms = Duration::from_millis(1);
        assert!(since + ms >= before && since <= after, "{since:?}");
        assert_eq!(t.counts().active, 0);
        t.check_invariants().expect("invariants");
    }

    #[test]
    fn a_hold_dropped_while_its_session_panics_marks_closing() {
        use crate::nat::NatState;
        use std::panic::{self, AssertUnwindSafe};
        let t = table();
        let hold = held_flow(&t, Instant::now());
        let port = hold.port;
        let result = panic::catch_unwind(AssertUnwindSafe(move || {
            let _hold = hold;
            panic!("session task failed (expected by this test)");
        }));
        assert!(result.is_err());
        assert!(matches!(t.state(port), Some(NatState::Closing { .. })));
        assert_eq!(t.counts().active, 0);
    }

    #[test]
    fn linux_binds_by_name_when_it_is_known() {
        assert_eq!(
            listen_on(false, Some("kt0"), None),
            Ok(ListenOn::Name("kt0"))
        );
        assert_eq!(
            listen_on(false, Some("kt0"), Some(3)),
            Ok(ListenOn::Name("kt0"))
        );
        assert_eq!(listen_on(false, None, None), Ok(ListenOn::Any));
    }
}
