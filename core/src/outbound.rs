//! Outbound sockets. Every socket the engine opens toward the network goes
//! through [`SocketFactory`], which applies the loop-avoidance the host chose
//! (bind to an interface, an fwmark, or the app's `protect(fd)` hook) before
//! the first packet leaves, so nothing the engine sends loops back into the TUN.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::net::{TcpSocket, TcpStream, UdpSocket};

use crate::config::DirectConfig;

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
    connect_timeout: Duration,
}

impl SocketFactory {
    pub fn new(cfg: &DirectConfig, protect: Option<Arc<dyn Protect>>) -> Self {
        Self {
            interface: cfg.interface.clone(),
            fwmark: cfg.fwmark,
            protect,
            connect_timeout: Duration::from_millis(cfg.connect_timeout_ms.max(1)),
        }
    }

    fn prepare(&self, sock: &Socket) -> io::Result<()> {
        sock.set_nonblocking(true)?;
        #[cfg(any(target_os = "linux", target_os = "android"))]
        {
            if let Some(ifname) = &self.interface {
                sock.bind_device(Some(ifname.as_bytes()))?;
            }
            if let Some(mark) = self.fwmark {
                sock.set_mark(mark)?;
            }
        }
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        {
            if self.interface.is_some() || self.fwmark.is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "direct.interface / direct.fwmark are Linux-only; use the protect hook",
                ));
            }
        }
        if let Some(p) = &self.protect {
            p.protect(sock.as_raw_fd())
                .map_err(|e| io::Error::other(format!("protect(fd) refused: {e}")))?;
        }
        Ok(())
    }

    /// Connect a direct TCP socket, bounded by the configured timeout.
    pub async fn connect_tcp(&self, dst: SocketAddr) -> io::Result<TcpStream> {
        let sock = Socket::new(Domain::for_address(dst), Type::STREAM, Some(Protocol::TCP))?;
        self.prepare(&sock)?;
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

    /// A connected direct UDP socket for one flow.
    pub fn udp_connected(&self, dst: SocketAddr) -> io::Result<UdpSocket> {
        let sock = Socket::new(Domain::for_address(dst), Type::DGRAM, Some(Protocol::UDP))?;
        self.prepare(&sock)?;
        sock.connect(&dst.into())?;
        UdpSocket::from_std(std::net::UdpSocket::from(sock))
    }
}

/// Close a TCP socket with an RST instead of a FIN (SO_LINGER 0), so the
/// peer learns at once that the connection failed.
pub fn reset_on_close(s: &TcpStream) {
    let _ = SockRef::from(s).set_linger(Some(Duration::ZERO));
}
