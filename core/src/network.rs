//! The network the engine's outbound sockets leave on, as the host reports
//! it ([`crate::Engine::network_changed`]), and how the engine's parts learn
//! that it moved.
//!
//! A phone moves between networks (Wi-Fi to cellular, one Wi-Fi to another,
//! waking from sleep). An outbound socket connected on the old network is
//! dead once its local address is gone, but nothing tells its relay: the
//! peer never answers, and TCP keepalive finds it only after 7 minutes
//! (`outbound::KEEPALIVE_IDLE`). So on every change the engine reads the
//! addresses the host's interfaces carry ([`Addresses::read`]) and
//! publishes them ([`NetworkWatch::publish`]); each relay and the UDP flow
//! table check their own sockets against them ([`Addresses::strands`]) and
//! end the ones that can no longer send, so apps see a reset at once and
//! reconnect on the new network. A socket whose address is still there is
//! kept, even if the default interface moved elsewhere: the network it
//! left on still carries it (Wi-Fi stays up while cellular becomes the
//! default).

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::sync::Arc;

use parking_lot::Mutex;
use socket2::SockRef;
use tokio::sync::watch;

/// The host's default interface: its name (Linux/Android bind by name) and
/// its index (Darwin binds by index).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefaultInterface {
    pub name: String,
    /// 0 when unknown.
    pub index: u32,
}

/// What the host knows of the network it is on now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetworkInfo {
    /// The default interface; `None` while the host has no network.
    pub interface: Option<DefaultInterface>,
    pub has_ipv4: bool,
    pub has_ipv6: bool,
    /// The network's own DNS servers: they resolve proxy host names
    /// unless `[direct] bootstrap` is set (`outbound::resolve::choose`),
    /// and are what a `"platform"` entry of `dns.upstreams` asks
    /// (`dns::Dns::set_platform`).
    pub dns_servers: Vec<IpAddr>,
    /// A metered network (cellular, a hotspot).
    pub expensive: bool,
    /// A network in a low-data mode.
    pub constrained: bool,
}

/// Why [`crate::Engine::network_changed`] did nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetworkError {
    /// The engine is stopped or failed: there is nothing to move.
    #[error("the engine is not running")]
    NotRunning,
    /// The interfaces' addresses could not be read (getifaddrs), so the
    /// engine cannot tell which connections the change stranded.
    #[error("reading the interfaces' addresses: {0}")]
    Interfaces(io::Error),
}

/// One address an interface carries.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Held {
    ip: IpAddr,
    index: u32,
    name: String,
}

/// The addresses every interface of the host carries, at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Addresses(Vec<Held>);

/// The interface a socket is bound to, as its platform names it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Bound {
    /// SO_BINDTODEVICE (Linux/Android).
    #[cfg_attr(not(linux_like), allow(dead_code))]
    Name(Vec<u8>),
    /// IP_BOUND_IF / IPV6_BOUND_IF (Darwin).
    #[cfg_attr(not(apple), allow(dead_code))]
    Index(u32),
}

impl Addresses {
    /// The host's addresses now (sorted, so two readings compare equal
    /// when nothing changed).
    pub fn read() -> io::Result<Addresses> {
        let mut held: Vec<Held> = getifaddrs::getifaddrs()?
            .filter_map(|i| {
                Some(Held {
                    ip: i.address.ip_addr()?,
                    index: i.index.unwrap_or(0),
                    name: i.name,
                })
            })
            .collect();
        held.sort();
        held.dedup();
        Ok(Addresses(held))
    }

    /// Whether a socket whose local address is `local`, bound to `bound`,
    /// can no longer send: its address is on no interface, or (an
    /// unbound address: an unconnected UDP socket) the interface it is
    /// bound to carries no address of its family. A socket neither bound
    /// to an address nor to an interface leaves wherever the routes say:
    /// never stranded.
    fn stranded(&self, local: SocketAddr, bound: Option<&Bound>) -> bool {
        let ip = local.ip();
        if !ip.is_unspecified() {
            return !self.0.iter().any(|h| h.ip == ip);
        }
        let Some(bound) = bound else {
            return false;
        };
        !self.0.iter().any(|h| {
            h.ip.is_ipv6() == local.is_ipv6()
                && match bound {
                    Bound::Name(n) => h.name.as_bytes() == n.as_slice(),
                    Bound::Index(i) => h.index == *i,
                }
        })
    }

    /// Whether `sock` can no longer send ([`Addresses::stranded`]). A
    /// socket whose address cannot be read is kept: nothing says it moved.
    pub fn strands<S: AsFd>(&self, sock: &S) -> bool {
        let s = SockRef::from(sock);
        let Some(local) = s.local_addr().ok().and_then(|a| a.as_socket()) else {
            return false;
        };
        self.stranded(local, bound_interface(&s, local.is_ipv6()).as_ref())
    }
}

/// The interface `s` is bound to, if any.
#[cfg(linux_like)]
fn bound_interface(s: &SockRef<'_>, _v6: bool) -> Option<Bound> {
    s.device().ok().flatten().map(Bound::Name)
}

/// The interface `s` is bound to, if any.
#[cfg(apple)]
fn bound_interface(s: &SockRef<'_>, v6: bool) -> Option<Bound> {
    let idx = if v6 {
        s.device_index_v6()
    } else {
        s.device_index_v4()
    };
    idx.ok().flatten().map(|i| Bound::Index(i.get()))
}

/// No interface binding elsewhere.
#[cfg(not(any(linux_like, apple)))]
fn bound_interface(_: &SockRef<'_>, _v6: bool) -> Option<Bound> {
    None
}

/// The last network the engine was told of, and the channel its relays and
/// its UDP flow table hear a change on.
#[derive(Debug)]
pub(crate) struct NetworkWatch {
    /// `None` until the first change: nothing to check before it.
    tx: watch::Sender<Option<Arc<Addresses>>>,
    /// What the host said last, and the addresses then; `None` info until
    /// the host says anything.
    last: Mutex<(Option<NetworkInfo>, Option<Arc<Addresses>>)>,
}

impl Default for NetworkWatch {
    fn default() -> Self {
        Self {
            tx: watch::Sender::new(None),
            last: Mutex::new((None, None)),
        }
    }
}

impl NetworkWatch {
    /// Record `info` with the addresses read now. `None` when both are
    /// what they were (nothing to do); else the addresses, which the
    /// caller publishes once it has moved what the change moves.
    pub fn record(&self, info: &NetworkInfo, addrs: Addresses) -> Option<Arc<Addresses>> {
        let mut last = self.last.lock();
        if last.0.as_ref() == Some(info) && last.1.as_deref() == Some(&addrs) {
            return None;
        }
        let addrs = Arc::new(addrs);
        *last = (Some(info.clone()), Some(addrs.clone()));
        Some(addrs)
    }

    /// What the host said last (`None`: nothing yet).
    pub fn last_info(&self) -> Option<NetworkInfo> {
        self.last.lock().0.clone()
    }

    /// Tell every relay and the flow table the addresses of the new network.
    pub fn publish(&self, addrs: Arc<Addresses>) {
        self.tx.send_replace(Some(addrs));
    }

    /// A receiver that hears changes from now on (the driver's).
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Addresses>>> {
        self.tx.subscribe()
    }

    /// Resolves once a change strands `sock` ([`Addresses::strands`]);
    /// never on a network that still carries it. After the first change it
    /// also checks at once against the last one: a socket connected on the
    /// old network whose relay starts only after the change (its accept
    /// came later) is caught too, for one `getsockname` per relay.
    pub async fn stranded<S: AsFd>(&self, sock: &S) {
        let mut rx = self.tx.subscribe();
        if rx.borrow().is_some() {
            rx.mark_changed();
        }
        loop {
            if rx.changed().await.is_err() {
                // The sender lives as long as the engine's lifecycle.
                return std::future::pending().await;
            }
            let gone = rx
                .borrow_and_update()
                .as_ref()
                .is_some_and(|a| a.strands(sock));
            if gone {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(ip: &str, index: u32, name: &str) -> Held {
        Held {
            ip: ip.parse().expect("a test address"),
            index,
            name: name.into(),
        }
    }

    fn addrs() -> Addresses {
        Addresses(vec![
            held("10.0.0.2", 2, "wlan0"),
            held("fd00::2", 2, "wlan0"),
            held("100.64.0.7", 3, "rmnet0"),
        ])
    }

    #[test]
    fn a_socket_is_stranded_when_its_address_or_its_interface_went() {
        let a = addrs();
        let sa = |s: &str| s.parse::<SocketAddr>().expect("a test socket address");
        // Bound to an address: kept while some interface carries it.
        assert!(!a.stranded(sa("10.0.0.2:4000"), None));
        assert!(!a.stranded(sa("[fd00::2]:4000"), None));
        assert!(a.stranded(sa("10.0.0.9:4000"), None));
        assert!(a.stranded(sa("[fd00::9]:4000"), Some(&Bound::Name(b"wlan0".to_vec()))));
        // Unbound address on a bound interface: kept while that interface
        // has an address of the socket's family.
        let wlan = Bound::Name(b"wlan0".to_vec());
        assert!(!a.stranded(sa("0.0.0.0:4000"), Some(&wlan)));
        assert!(!a.stranded(sa("[::]:4000"), Some(&wlan)));
        assert!(a.stranded(sa("[::]:4000"), Some(&Bound::Index(3))));
        assert!(!a.stranded(sa("0.0.0.0:4000"), Some(&Bound::Index(3))));
        assert!(a.stranded(sa("0.0.0.0:4000"), Some(&Bound::Name(b"eth9".to_vec()))));
        // Neither: the routes decide, never stranded.
        assert!(!a.stranded(sa("0.0.0.0:4000"), None));
        assert!(!Addresses::default().stranded(sa("[::]:1"), None));
    }

    #[test]
    fn the_same_info_and_addresses_twice_is_no_change() {
        let w = NetworkWatch::default();
        let info = NetworkInfo {
            interface: Some(DefaultInterface {
                name: "wlan0".into(),
                index: 2,
            }),
            has_ipv4: true,
            ..NetworkInfo::default()
        };
        assert!(w.record(&info, addrs()).is_some(), "the first report");
        assert!(w.record(&info, addrs()).is_none(), "nothing changed");
        // The same info over other addresses is a change (an interface
        // lost its address while the default stayed).
        let mut fewer = addrs();
        fewer.0.remove(0);
        assert!(w.record(&info, fewer.clone()).is_some());
        let cell = NetworkInfo {
            expensive: true,
            ..info
        };
        assert!(w.record(&cell, fewer).is_some(), "the info alone changed");
    }

    #[test]
    fn a_relay_hears_only_the_change_that_strands_its_socket() {
        let rt = crate::testutil::runtime();
        rt.block_on(async {
            let w = NetworkWatch::default();
            let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind on loopback");
            let lost = w.stranded(&sock);
            tokio::pin!(lost);
            assert!(!ready(lost.as_mut()), "nothing changed yet");
            // A network that still has 127.0.0.1: kept.
            w.publish(Arc::new(Addresses(vec![held("127.0.0.1", 1, "lo")])));
            assert!(!ready(lost.as_mut()), "its address is still there");
            // One without it: stranded.
            w.publish(Arc::new(Addresses(vec![held("10.0.0.2", 2, "wlan0")])));
            assert!(ready(lost.as_mut()), "its address went");
            // A relay that starts after that change checks against it at once.
            let late = w.stranded(&sock);
            tokio::pin!(late);
            assert!(ready(late.as_mut()), "connected before, relayed after");
            w.publish(Arc::new(Addresses(vec![held("127.0.0.1", 1, "lo")])));
            let fine = w.stranded(&sock);
            tokio::pin!(fine);
            assert!(
                !ready(fine.as_mut()),
                "a relay on the current network waits"
            );
        });
    }

    /// Poll once; true when ready.
    fn ready<F: std::future::Future<Output = ()>>(f: std::pin::Pin<&mut F>) -> bool {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        f.poll(&mut cx).is_ready()
    }
}
