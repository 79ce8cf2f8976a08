//! Servers written on tokio (the real shadowsocks-rust server, and the
//! proxies and TLS servers the tests write themselves): each runs on a
//! thread of its own inside a namespace, on a current-thread runtime, until
//! its guard is dropped.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::Netns;

/// A connected pair of loopback TCP sockets: (the connecting end, the
/// accepted end).
pub async fn tcp_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let (c, s) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
    (c.expect("connect"), s.expect("accept").0)
}

/// A server running on its own thread and runtime; stopped and joined on
/// drop.
#[derive(Debug)]
pub struct InProcess {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
    /// Bytes the server relayed (its own view), where it reports them.
    pub relayed: Arc<AtomicU64>,
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Run `serve` in `ns` until the returned guard is dropped. `serve` gets a
/// channel to report its bind result on (this waits up to 10 s for it, and
/// fails the test on an error) and the counter behind
/// [`InProcess::relayed`].
pub fn in_process<F, Fut>(ns: &Netns, serve: F) -> InProcess
where
    F: FnOnce(std::sync::mpsc::Sender<io::Result<()>>, Arc<AtomicU64>) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let stop = Arc::new(AtomicBool::new(false));
    let relayed = Arc::new(AtomicU64::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop2, relayed2) = (stop.clone(), relayed.clone());
    let handle = ns
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("server runtime");
            rt.block_on(async move {
                let stopped = async {
                    while !stop2.load(Relaxed) {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                };
                tokio::select! {
                    () = serve(tx, relayed2) => {}
                    () = stopped => {}
                }
            });
        })
        .expect("spawn in ns");
    rx.recv_timeout(Duration::from_secs(10))
        .expect("server reported")
        .expect("server bound");
    InProcess {
        stop,
        handle: Some(handle),
        relayed,
    }
}

/// A listener on `addr` for an [`in_process`] server, its bind result
/// reported on `ready`: `None` (after reporting the error) if it failed.
pub async fn listen(
    addr: std::net::SocketAddr,
    ready: &std::sync::mpsc::Sender<io::Result<()>>,
) -> Option<tokio::net::TcpListener> {
    match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => {
            let _ = ready.send(Ok(()));
            Some(l)
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            None
        }
    }
}

/// An [`in_process`] TCP server on `addr` that hands each connection it
/// accepts to `each`, on a task of its own, with the counter behind
/// [`InProcess::relayed`]. A failed accept is skipped.
pub fn accept_each<F, Fut>(ns: &Netns, addr: std::net::SocketAddr, each: F) -> InProcess
where
    F: Fn(tokio::net::TcpStream, Arc<AtomicU64>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    in_process(ns, move |ready, counter| async move {
        let Some(l) = listen(addr, &ready).await else {
            return;
        };
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            tokio::spawn(each(s, counter.clone()));
        }
    })
}

/// fast-socks5's server on `addr`, CONNECT only, no authentication;
/// [`InProcess::relayed`] counts the CONNECTs it served, except those to
/// port `uncounted` (a probe target).
pub fn socks5_server(ns: &Netns, addr: std::net::SocketAddr, uncounted: Option<u16>) -> InProcess {
    socks5_server_with(
        ns,
        addr,
        Socks5Options {
            uncounted,
            ..Socks5Options::default()
        },
    )
}

/// What a [`socks5_server_with`] serves.
#[derive(Debug, Clone)]
pub struct Socks5Options {
    /// The username and password it requires; `None`: no authentication.
    pub creds: Option<(String, String)>,
    /// UDP ASSOCIATE too (relaying from the server's address); without,
    /// CONNECT only.
    pub udp: bool,
    /// CONNECTs to this port are served but not counted (a probe target).
    pub uncounted: Option<u16>,
    /// How long a CONNECT waits for its target.
    pub connect_timeout: Duration,
}

impl Default for Socks5Options {
    /// CONNECT only, no authentication, every CONNECT counted, 10 s.
    fn default() -> Self {
        Socks5Options {
            creds: None,
            udp: false,
            uncounted: None,
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// fast-socks5's server on `addr` as `opts` says; [`InProcess::relayed`]
/// counts the requests it served (but CONNECTs to `opts.uncounted`).
pub fn socks5_server_with(
    ns: &Netns,
    addr: std::net::SocketAddr,
    opts: Socks5Options,
) -> InProcess {
    use fast_socks5::Socks5Command;
    use fast_socks5::server::{Socks5ServerProtocol, run_tcp_proxy, run_udp_proxy};
    use fast_socks5::util::target_addr::TargetAddr;
    accept_each(ns, addr, move |s, served| {
        let opts = opts.clone();
        async move {
            let proto = match &opts.creds {
                None => Socks5ServerProtocol::accept_no_auth(s).await,
                Some((u, p)) => Socks5ServerProtocol::accept_password_auth(s, |user, pass| {
                    user == *u && pass == *p
                })
                .await
                .map(|(proto, _)| proto),
            };
            let Ok(proto) = proto else { return };
            let Ok((proto, cmd, target)) = proto.read_command().await else {
                return;
            };
            match cmd {
                Socks5Command::TCPConnect => {
                    let probe =
                        matches!(&target, TargetAddr::Ip(a) if Some(a.port()) == opts.uncounted);
                    if !probe {
                        served.fetch_add(1, Relaxed);
                    }
                    let _ = run_tcp_proxy(proto, &target, opts.connect_timeout, true).await;
                }
                Socks5Command::UDPAssociate if opts.udp => {
                    served.fetch_add(1, Relaxed);
                    let _ = run_udp_proxy(proto, &target, None, addr.ip(), None).await;
                }
                _ => {}
            }
        }
    })
}

/// shadowsocks-rust's server, TCP and UDP on `addr`, with `method` (its
/// name for it) and `password`; [`InProcess::relayed`] counts the bytes it
/// moved both ways.
#[cfg(feature = "shadowsocks")]
pub fn shadowsocks(
    ns: &Netns,
    addr: std::net::SocketAddr,
    method: &str,
    password: &str,
) -> InProcess {
    use shadowsocks_service::shadowsocks::config::{Mode, ServerConfig};
    use shadowsocks_service::shadowsocks::net::{AcceptOpts, ConnectOpts, UdpSocketOpts};
    let kind = method.parse().expect("method");
    let password = password.to_owned();
    in_process(ns, move |ready, relayed| async move {
        let mut cfg = match ServerConfig::new(addr, password, kind) {
            Ok(c) => c,
            Err(e) => {
                let _ = ready.send(Err(io::Error::other(format!("{e:?}"))));
                return;
            }
        };
        cfg.set_mode(Mode::TcpAndUdp);
        let mut builder = shadowsocks_service::server::ServerBuilder::new(cfg);
        // shadowsocks-rust sets DF on its UDP sockets unless told otherwise,
        // so its own 8000-byte replies could not leave over a 1500-byte
        // link; a server on a real path fragments them like any host.
        let udp = UdpSocketOpts {
            allow_fragmentation: true,
            ..Default::default()
        };
        builder.set_accept_opts(AcceptOpts {
            udp: udp.clone(),
            ..Default::default()
        });
        builder.set_connect_opts(ConnectOpts {
            udp,
            ..Default::default()
        });
        let flow = builder.flow_stat();
        let server = match builder.build().await {
            Ok(s) => s,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let _ = ready.send(Ok(()));
        let watch = async {
            loop {
                relayed.store(flow.tx() + flow.rx(), Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::select! {
            _ = server.run() => {}
            () = watch => {}
        }
    })
}

/// The `ss://` share link of a server at `addr`, as shadowsocks-rust's own
/// encoder writes it.
#[cfg(feature = "shadowsocks")]
pub fn shadowsocks_url(addr: std::net::SocketAddr, method: &str, password: &str) -> String {
    use shadowsocks_service::shadowsocks::config::ServerConfig;
    ServerConfig::new(addr, password, method.parse().expect("method"))
        .expect("server config")
        .to_url()
}
