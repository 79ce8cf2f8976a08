//! An IPv6-only uplink with a NAT64 translator behind it, for the tests of
//! the engine's NAT64 support (`core/tests/nat64.rs`).
//!
//! ```text
//!  client ns (engine)          topology's server ns = "nat64"        v4 ns
//!  ktc  fd00:19:N::1/64 ─────── kts fd00:19:N::2/64
//!  (no IPv4 address)            local 64:ff9b::/96 dev lo
//!  64:ff9b::/96 via ::2         translator, DNS64        ktv 198.21.N.1/24 ─── ktvs 198.21.N.2/24
//! ```
//!
//! The translator is userspace (no jool here): the nat64 namespace routes
//! the well-known prefix 64:ff9b::/96 locally, so a listener on `[::]`
//! accepts a connection to any address inside it; the accepted socket's
//! local address holds the IPv4 destination in its last 32 bits (RFC 6052
//! section 2.2, /96), which the translator connects to over IPv4 and copies
//! both ways. UDP the same way per datagram: the destination of each one
//! comes from its `IPV6_PKTINFO`, and replies leave from that address.
//! Everything lives in the namespaces and goes with them.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::tokio_servers::{InProcess, in_process};
use crate::{CLIENT_VETH, Netns, Topology};

/// The prefix the translator serves (RFC 6052 section 2.1).
pub const PREFIX: &str = "64:ff9b::/96";

/// What the DNS64 answers for `ipv4only.arpa`: 192.0.0.170 and
/// 192.0.0.171 inside [`PREFIX`] (RFC 7050 section 2.2).
pub const IPV4ONLY_ANSWERS: [Ipv6Addr; 2] = [
    Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0xc000, 0xaa),
    Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0xc000, 0xab),
];

/// The IPv4 address inside [`PREFIX`], if `a` is in it.
pub fn extract(a: Ipv6Addr) -> Option<Ipv4Addr> {
    let o = a.octets();
    (o[..12] == IPV4ONLY_ANSWERS[0].octets()[..12])
        .then(|| Ipv4Addr::new(o[12], o[13], o[14], o[15]))
}

/// The IPv6-only uplink, the v4 namespace and the translator (which the
/// caller starts with [`Nat64Net::translate`] once its servers listen).
#[derive(Debug)]
pub struct Nat64Net {
    /// The IPv4-only namespace behind the translator: the tests' servers.
    pub v4: Netns,
    id: u8,
}

impl Nat64Net {
    /// Turn `topo` into the picture above: the client's uplink loses its
    /// IPv4 address, the server namespace becomes the translator's, and a
    /// new IPv4-only namespace sits behind it.
    pub fn new(topo: &Topology) -> io::Result<Nat64Net> {
        let id = topo.id as u8;
        topo.client
            .ip(&["-4", "addr", "flush", "dev", CLIENT_VETH])?;
        let v4 = Netns::new(&format!("v{id}"))?;
        topo.server.ip(&[
            "link",
            "add",
            "ktv",
            "type",
            "veth",
            "peer",
            "name",
            "ktvs",
            "netns",
            v4.name(),
        ])?;
        let net = Nat64Net { v4, id };
        topo.server
            .addr_up("ktv", &format!("{}/24", net.gateway_v4()))?;
        net.v4.addr_up("ktvs", &format!("{}/24", net.server_v4()))?;
        topo.server
            .ip(&["-6", "route", "add", "local", PREFIX, "dev", "lo"])?;
        // Replies leave from the destination the client used, an address
        // of the prefix no interface carries.
        topo.server
            .exec("sysctl", &["-qw", "net.ipv6.ip_nonlocal_bind=1"])?;
        topo.client.ip(&[
            "-6",
            "route",
            "add",
            PREFIX,
            "via",
            &topo.server_v6().to_string(),
            "dev",
            CLIENT_VETH,
        ])?;
        Ok(net)
    }

    /// The translator's IPv4 address (its source toward the servers).
    pub fn gateway_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 21, self.id, 1)
    }

    /// The servers' IPv4 address.
    pub fn server_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 21, self.id, 2)
    }

    /// A socket address on the servers' namespace.
    pub fn server_addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.server_v4()), port)
    }

    /// Run the translator in `topo`'s server namespace for TCP to
    /// `tcp_ports` and UDP to `udp_ports` (a listener on `[::]` takes one
    /// port). [`InProcess::relayed`] counts the connections and datagrams
    /// it translated.
    pub fn translate(topo: &Topology, tcp_ports: &[u16], udp_ports: &[u16]) -> InProcess {
        let (tcp_ports, udp_ports) = (tcp_ports.to_vec(), udp_ports.to_vec());
        in_process(&topo.server, move |ready, translated| async move {
            let mut tcp = Vec::new();
            for p in &tcp_ports {
                match tokio::net::TcpListener::bind((Ipv6Addr::UNSPECIFIED, *p)).await {
                    Ok(l) => tcp.push(l),
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                }
            }
            let mut udp = Vec::new();
            for p in &udp_ports {
                match udp_listener(*p) {
                    Ok(s) => udp.push(s),
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                }
            }
            let _ = ready.send(Ok(()));
            for l in tcp {
                tokio::spawn(tcp_loop(l, translated.clone()));
            }
            for s in udp {
                tokio::spawn(udp_loop(s, translated.clone()));
            }
            std::future::pending::<()>().await;
        })
    }
}

async fn tcp_loop(l: tokio::net::TcpListener, translated: Arc<AtomicU64>) {
    while let Ok((mut inside, _)) = l.accept().await {
        let Ok(SocketAddr::V6(local)) = inside.local_addr() else {
            continue;
        };
        let Some(v4) = extract(*local.ip()) else {
            continue;
        };
        let translated = translated.clone();
        tokio::spawn(async move {
            let Ok(mut outside) = tokio::net::TcpStream::connect((v4, local.port())).await else {
                return;
            };
            translated.fetch_add(1, Relaxed);
            let _ = tokio::io::copy_bidirectional(&mut inside, &mut outside).await;
        });
    }
}

/// A UDP socket on `[::]:port` that reports each datagram's destination.
fn udp_listener(port: u16) -> io::Result<tokio::net::UdpSocket> {
    use nix::sys::socket::{setsockopt, sockopt};
    let s = std::net::UdpSocket::bind((Ipv6Addr::UNSPECIFIED, port))?;
    setsockopt(&s, sockopt::Ipv6RecvPacketInfo, &true).map_err(io::Error::from)?;
    s.set_nonblocking(true)?;
    tokio::net::UdpSocket::from_std(s)
}

/// One IPv4 socket per (client, destination) pair, its replies sent back
/// from the destination's IPv6 address.
async fn udp_loop(s: tokio::net::UdpSocket, translated: Arc<AtomicU64>) {
    let s = Arc::new(s);
    let mut pairs: HashMap<(SocketAddrV6, SocketAddrV6), Arc<tokio::net::UdpSocket>> =
        HashMap::new();
    let mut buf = vec![0u8; 65_536];
    loop {
        let got = s
            .async_io(tokio::io::Interest::READABLE, || {
                recv_with_dst(&s, &mut buf)
            })
            .await;
        let Ok((n, client, dst)) = got else { continue };
        let Some(v4) = extract(*dst.ip()) else {
            continue;
        };
        let out = match pairs.get(&(client, dst)) {
            Some(o) => o.clone(),
            None => {
                let Ok(o) = tokio::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await else {
                    continue;
                };
                if o.connect((v4, dst.port())).await.is_err() {
                    continue;
                }
                let o = Arc::new(o);
                pairs.insert((client, dst), o.clone());
                tokio::spawn(udp_replies(o.clone(), s.clone(), client, dst));
                o
            }
        };
        if out.send(&buf[..n]).await.is_ok() {
            translated.fetch_add(1, Relaxed);
        }
    }
}

fn recv_with_dst(
    s: &tokio::net::UdpSocket,
    buf: &mut [u8],
) -> io::Result<(usize, SocketAddrV6, SocketAddrV6)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, SockaddrIn6, recvmsg};
    use std::os::fd::AsRawFd;
    let mut iov = [io::IoSliceMut::new(buf)];
    let mut cmsg = nix::cmsg_space!(nix::libc::in6_pktinfo);
    let m = recvmsg::<SockaddrIn6>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty())
        .map_err(io::Error::from)?;
    let from = m
        .address
        .map(SocketAddrV6::from)
        .ok_or_else(|| io::Error::other("no source"))?;
    let port = s.local_addr()?.port();
    let dst = m
        .cmsgs()
        .map_err(io::Error::from)?
        .find_map(|c| match c {
            ControlMessageOwned::Ipv6PacketInfo(i) => Some(Ipv6Addr::from(i.ipi6_addr.s6_addr)),
            _ => None,
        })
        .ok_or_else(|| io::Error::other("no IPV6_PKTINFO"))?;
    Ok((m.bytes, from, SocketAddrV6::new(dst, port, 0, 0)))
}

async fn udp_replies(
    out: Arc<tokio::net::UdpSocket>,
    inside: Arc<tokio::net::UdpSocket>,
    client: SocketAddrV6,
    from: SocketAddrV6,
) {
    let mut buf = vec![0u8; 65_536];
    while let Ok(n) = out.recv(&mut buf).await {
        let payload = &buf[..n];
        let _ = inside
            .async_io(tokio::io::Interest::WRITABLE, || {
                send_from(&inside, payload, client, *from.ip())
            })
            .await;
    }
}

/// `sendmsg` to `to` with the source address `from` (`IPV6_PKTINFO`).
fn send_from(
    s: &tokio::net::UdpSocket,
    payload: &[u8],
    to: SocketAddrV6,
    from: Ipv6Addr,
) -> io::Result<usize> {
    use nix::sys::socket::{ControlMessage, MsgFlags, SockaddrIn6, sendmsg};
    use std::os::fd::AsRawFd;
    let info = nix::libc::in6_pktinfo {
        ipi6_addr: nix::libc::in6_addr {
            s6_addr: from.octets(),
        },
        ipi6_ifindex: 0,
    };
    let iov = [io::IoSlice::new(payload)];
    let to = SockaddrIn6::from(to);
    sendmsg(
        s.as_raw_fd(),
        &iov,
        &[ControlMessage::Ipv6PacketInfo(&info)],
        MsgFlags::empty(),
        Some(&to),
    )
    .map_err(io::Error::from)
}
