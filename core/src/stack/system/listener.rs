//! The kernel side of the system stack: one listener per address family on
//! the gateway address, and the loop that accepts the rewritten connections
//! and starts their sessions.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;

use super::{Pending, SystemStack};
use crate::dispatch::session;
use crate::lifecycle::Phase;
use crate::outbound::reset_on_close;
use crate::translate::FamilyAddrs;

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
        #[cfg(linux_like)]
        sock.set_freebind_v6(true)?;
    }
    // Darwin: SYNs rewritten onto the utun only reach a listener bound to that
    // interface (IP_BOUND_IF / IPV6_BOUND_IF), set before bind.
    #[cfg(apple)]
    if let Some(idx) = tun_index.and_then(std::num::NonZeroU32::new) {
        if gateway.is_ipv6() {
            sock.bind_device_by_index_v6(Some(idx))?;
        } else {
            sock.bind_device_by_index_v4(Some(idx))?;
        }
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
        let now = Instant::now();
        let accepted = match st.nat.accept(peer.port(), now) {
            Ok(a) => a,
            Err(_) => {
                d.stats.accept_unknown_port.fetch_add(1, Relaxed);
                reset_on_close(&app);
                continue;
            }
        };
        let pending = st.pending.lock().remove(&peer.port());
        let Some(Pending::Ready { next, permit, .. }) = pending else {
            // No outbound waiting (expired): close now and keep the mapping in
            // Closing so the kernel's RST reaches the app, instead of deleting
            // it and blackholing the app.
            st.nat.mark_closing(accepted.port, accepted.generation, now);
            d.stats.accept_unknown_port.fetch_add(1, Relaxed);
            reset_on_close(&app);
            continue;
        };
        let guard = st.nat.guard(&accepted);
        let _ = app.set_nodelay(true);
        let server = accepted.key.server;
        tokio::spawn(session::run(d.clone(), app, next, server, (permit, guard)));
    }
}
