//! The sockets the engine opens toward the network: [`SocketFactory`]
//! applies the host's loop avoidance (an interface, an fwmark, the
//! `protect(fd)` hook) and the uplink the host reported last to every one
//! of them before its first packet, and sets the TCP options every relayed
//! connection gets (keepalive, reset on close). Apart from `mod.rs`, which
//! holds what the outbounds are and how rules pick one.

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
#[cfg(linux_like)]
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::net::{TcpSocket, TcpStream, UdpSocket};

use super::config::DirectConfig;
use super::nat64;

/// The host's hook to exempt a socket from the VPN (Android
/// `VpnService.protect(fd)`). Called once per outbound socket, before connect.
pub trait Protect: Send + Sync + fmt::Debug {
    /// Return an error to abort the connection (it is counted and the app sees a reset).
    fn protect(&self, fd: i32) -> Result<(), String>;
}

/// Creates outbound sockets with the configured loop avoidance applied.
#[derive(Debug, Clone)]
pub struct SocketFactory {
    interface: Option<String>,
    fwmark: Option<u32>,
    protect: Option<Arc<dyn Protect>>,
    pub(super) connect_timeout: Duration,
    /// The default interface the host reported last
    /// (`Engine::network_changed`), shared by every clone: once the host
    /// reported one, new sockets bind to it instead of `direct.interface`.
    /// Read once per new socket, never per packet.
    uplink: Arc<parking_lot::RwLock<Uplink>>,
    /// The network's NAT64 prefix, shared by every clone: connects to IPv4
    /// go inside it while the network has no IPv4 (`nat64.rs`).
    nat64: Arc<nat64::Nat64>,
}

/// Where new direct sockets are bound ([`SocketFactory::rebind`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
enum Uplink {
    /// The host never reported a network: `direct.interface`, if set.
    #[default]
    Configured,
    /// The host's default interface (`None`: no network, nothing to bind to).
    Host(Option<crate::network::DefaultInterface>),
}

impl SocketFactory {
    pub fn new(cfg: &DirectConfig, protect: Option<Arc<dyn Protect>>) -> Self {
        Self {
            interface: cfg.interface.clone(),
            fwmark: cfg.fwmark,
            protect,
            connect_timeout: Duration::from_millis(cfg.connect_timeout_ms.max(1)),
            uplink: Arc::default(),
            nat64: Arc::default(),
        }
    }

    /// The NAT64 prefix its connects use (`nat64.rs`).
    pub fn nat64(&self) -> &Arc<nat64::Nat64> {
        &self.nat64
    }

    /// Bind the sockets made from now on (by this factory and its clones)
    /// to the host's new default interface: by name with SO_BINDTODEVICE
    /// (Linux/Android), by index with IP_BOUND_IF (Darwin). Sockets made
    /// before keep their binding.
    pub fn rebind(&self, to: Option<crate::network::DefaultInterface>) {
        *self.uplink.write() = Uplink::Host(to);
    }

    fn prepare(&self, sock: &Socket, v6: bool) -> io::Result<()> {
        sock.set_nonblocking(true)?;
        let uplink = self.uplink.read().clone();
        #[cfg(linux_like)]
        {
            match &uplink {
                Uplink::Configured => {
                    if let Some(ifname) = &self.interface {
                        sock.bind_device(Some(ifname.as_bytes()))?;
                    }
                }
                Uplink::Host(Some(i)) if !i.name.is_empty() => bind_host_name(sock, &i.name)?,
                Uplink::Host(_) => {}
            }
            if let Some(mark) = self.fwmark {
                sock.set_mark(mark)?;
            }
        }
        #[cfg(not(linux_like))]
        {
            if self.interface.is_some() || self.fwmark.is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "direct.interface / direct.fwmark are Linux-only; use the protect hook",
                ));
            }
        }
        #[cfg(apple)]
        if let Uplink::Host(Some(i)) = &uplink
            && let Some(idx) = std::num::NonZeroU32::new(i.index)
        {
            if v6 {
                sock.bind_device_by_index_v6(Some(idx))?;
            } else {
                sock.bind_device_by_index_v4(Some(idx))?;
            }
        }
        #[cfg(not(apple))]
        let _ = v6; // only Darwin binds per family
        if let Some(p) = &self.protect {
            p.protect(sock.as_raw_fd())
                .map_err(|e| io::Error::other(format!("protect(fd) refused: {e}")))?;
        }
        Ok(())
    }

    /// The configured connect timeout (also bounds proxy handshakes).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Connect a direct TCP socket, bounded by the configured timeout (to
    /// IPv4 through the network's NAT64 prefix while it has one).
    pub async fn connect_tcp(&self, dst: SocketAddr) -> io::Result<TcpStream> {
        let dst = self.nat64.synthesize(dst);
        let sock = Socket::new(Domain::for_address(dst), Type::STREAM, Some(Protocol::TCP))?;
        self.prepare(&sock, dst.is_ipv6())?;
        // Best effort: a connection without keepalive still works.
        let _ = set_keepalive(SockRef::from(&sock));
        let sock = TcpSocket::from_std_stream(std::net::TcpStream::from(sock));
        match tokio::time::timeout(self.connect_timeout, sock.connect(dst)).await {
            Ok(r) => {
                let s = r?;
                s.set_nodelay(true)?;
                Ok(s)
            }
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connect to {dst} timed out"),
            )),
        }
    }

    /// A connected direct UDP socket for one flow (to IPv4 through the
    /// network's NAT64 prefix while it has one).
    pub fn udp_connected(&self, dst: SocketAddr) -> io::Result<UdpSocket> {
        let dst = self.nat64.synthesize(dst);
        let sock = Socket::new(Domain::for_address(dst), Type::DGRAM, Some(Protocol::UDP))?;
        self.prepare(&sock, dst.is_ipv6())?;
        sock.connect(&dst.into())?;
        UdpSocket::from_std(std::net::UdpSocket::from(sock))
    }

    /// An unconnected direct UDP socket of one family, bound to a port of
    /// its own: an endpoint-independent mapping, sent from to any
    /// destination (`udp/flow.rs`, `Mapping`).
    pub fn udp_unconnected(&self, v6: bool) -> io::Result<UdpSocket> {
        let any: SocketAddr = if v6 {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        };
        let sock = Socket::new(Domain::for_address(any), Type::DGRAM, Some(Protocol::UDP))?;
        self.prepare(&sock, v6)?;
        if v6 {
            sock.set_only_v6(true)?;
        }
        sock.bind(&any.into())?;
        UdpSocket::from_std(std::net::UdpSocket::from(sock))
    }
}

/// SO_BINDTODEVICE to the host's default interface. Kernels before 5.7
/// refuse it without CAP_NET_RAW, which an Android app does not hold: the
/// socket then stays unbound (warned once per process), and the protect
/// hook and the routes keep it off the TUN as they did before any network
/// change: a refused option costs the pinning, not the connection.
#[cfg(linux_like)]
fn bind_host_name(sock: &Socket, name: &str) -> io::Result<()> {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    match sock.bind_device(Some(name.as_bytes())) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            if !WARNED.swap(true, Relaxed) {
                tracing::warn!(
                    "binding outbound sockets to {name}: {e}; they stay unbound (the routes pick the interface)"
                );
            }
            Ok(())
        }
        other => other,
    }
}

/// TCP keepalive on both legs of a relayed connection (the outbound socket
/// and, on the system stack, the app's accepted socket): a peer that
/// vanished without a FIN or an RST (a server whose host died, a path that
/// went dark) is found after [`KEEPALIVE_IDLE`] of silence plus
/// [`KEEPALIVE_PROBES`] unanswered probes [`KEEPALIVE_INTERVAL`] apart, 7
/// minutes in all, instead of never (the kernel's default is off, and 2 h
/// plus 9 x 75 s when on). The relay then fails and the session frees its
/// task, its two descriptors and its admission permit.
///
/// Why 5 minutes: probes go out only on a connection idle that long, so a
/// connection moving data costs nothing, and an idle one costs one small
/// packet per 5 minutes (applications that keep connections open longer,
/// such as push channels, ping more often than that themselves). Four
/// probes 30 s apart ride out a short loss of coverage.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(300);
/// See [`KEEPALIVE_IDLE`].
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// See [`KEEPALIVE_IDLE`].
pub const KEEPALIVE_PROBES: u32 = 4;

/// Turn on TCP keepalive with the engine's values ([`KEEPALIVE_IDLE`]).
pub fn set_keepalive(s: SockRef<'_>) -> io::Result<()> {
    let ka = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    s.set_tcp_keepalive(&ka)
}

/// Close a TCP socket with an RST instead of a FIN (SO_LINGER 0), so the
/// peer learns at once that the connection failed.
pub fn reset_on_close(s: &TcpStream) {
    let _ = SockRef::from(s).set_linger(Some(Duration::ZERO));
}
