//! Network-namespace fixtures for kerntun's end-to-end tests, the demo
//! (`cli/examples/demo.rs`) and the benchmark harness (Linux, root).
//!
//! A [`Topology`] is two fresh namespaces joined by a veth pair:
//!
//! ```text
//!  client ns                                   server ns
//!  app ── route 198.19.N.2/32 ─► TUN (engine)   server on 198.19.N.2
//!                                 │ direct out
//!  veth "ktc" 198.19.N.1/24 ─────────────────── veth "kts" 198.19.N.2/24
//!             fd00:19:N::1/64                              fd00:19:N::2/64
//! ```
//!
//! The engine runs inside the client namespace (threads inherit the
//! namespace of the thread that creates them) with its outbound sockets bound
//! to the veth, so they bypass the TUN route. Namespaces are deleted on drop,
//! also when a test panics; names carry the pid so stale ones from a killed
//! run are recognisable and swept by [`sweep_stale`].
//!
//! [`router::Router`] adds a third namespace whose traffic the client
//! namespace forwards into the TUN (the router topology of the benchmark's
//! phone profiles); [`uid_route::UidRoute`] routes one uid of the client
//! namespace into the TUN, as Android routes an app (their android
//! topology). [`rig::Rig`] is an engine running in a topology, as the
//! end-to-end tests start it.

use std::fs::File;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub mod child;
pub mod dns;
pub mod nat64;
pub mod rig;
pub mod router;
pub mod router_v6;
pub mod stun;
pub mod tokio_servers;
pub mod uid_route;

/// Whether this process can create namespaces and TUN devices.
pub fn have_root() -> bool {
    nix::unistd::geteuid().is_root() && std::path::Path::new("/dev/net/tun").exists()
}

/// Skip a test with a printed reason when not root (CI runs as root).
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::have_root() {
            eprintln!("SKIPPED: needs root, /dev/net/tun and ip netns");
            return;
        }
    };
}

/// A fresh [`Topology`], once [`require_root!`] let the test go on:
/// `let topo = root_topology!();`.
#[macro_export]
macro_rules! root_topology {
    () => {{
        $crate::require_root!();
        $crate::Topology::new().expect("topology")
    }};
}

/// [`root_topology!`] for a test that holds this binary's [`serial`] lock,
/// taken first so that building the namespaces is inside it too:
/// `let (_serial, topo) = serial_topology!();`.
#[macro_export]
macro_rules! serial_topology {
    () => {{
        $crate::require_root!();
        ($crate::serial(), $crate::Topology::new().expect("topology"))
    }};
}

/// One `#[test]` per case, each skipped without root ([`require_root!`])
/// and otherwise calling `$run` with the case's arguments:
/// `root_tests!(run; v4(false), v6(true));` makes tests `v4` and `v6`.
#[macro_export]
macro_rules! root_tests {
    ($run:path; $($case:ident($($arg:expr),* $(,)?)),* $(,)?) => {$(
        #[test]
        fn $case() {
            $crate::require_root!();
            $run($($arg),*);
        }
    )*};
}

/// Run a command, turning a non-zero exit into an error with its stderr.
pub fn sh(cmd: &str, args: &[&str]) -> io::Result<()> {
    let out = Command::new(cmd).args(args).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// A named network namespace, deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

const PREFIX: &str = "ktns";

/// `ip -n NS route add HOST/32|128 dev DEV [table TABLE]`.
fn route_host(ns: &str, host: IpAddr, dev: &str, table: Option<&str>) -> io::Result<()> {
    let dst = format!("{host}/{}", if host.is_ipv6() { 128 } else { 32 });
    let mut args = vec!["-n", ns, "route", "add", &dst, "dev", dev];
    if let Some(table) = table {
        args.extend(["table", table]);
    }
    sh("ip", &args)
}

impl Netns {
    /// Create `ktns-<pid>-<tag>` with loopback up.
    pub fn new(tag: &str) -> io::Result<Netns> {
        let name = format!("{PREFIX}-{}-{tag}", std::process::id());
        let _ = sh("ip", &["netns", "del", &name]);
        sh("ip", &["netns", "add", &name])?;
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip -n <ns> ARGS`.
    pub fn ip(&self, args: &[&str]) -> io::Result<()> {
        let mut a = vec!["-n", self.name.as_str()];
        a.extend_from_slice(args);
        sh("ip", &a)
    }

    /// Route `host` (a /32 or /128) into the device `dev`, in the main
    /// table or in `table`.
    pub fn route_host(&self, host: IpAddr, dev: &str, table: Option<&str>) -> io::Result<()> {
        route_host(&self.name, host, dev, table)
    }

    /// Give the device `dev` the IPv4 address `addr` (with its prefix
    /// length, `a.b.c.d/n`) and bring it up.
    pub fn addr_up(&self, dev: &str, addr: &str) -> io::Result<()> {
        self.ip(&["addr", "add", addr, "dev", dev])?;
        self.ip(&["link", "set", dev, "up"])
    }

    /// A permanent neighbour entry: `addr` is at `mac` on `dev`, for the
    /// family `family` (`-4` or `-6`).
    pub fn pin_neighbour(&self, family: &str, addr: &str, mac: &str, dev: &str) -> io::Result<()> {
        self.ip(&[
            family,
            "neigh",
            "replace",
            addr,
            "lladdr",
            mac,
            "dev",
            dev,
            "nud",
            "permanent",
        ])
    }

    /// Run a command inside the namespace and return its stdout.
    pub fn exec(&self, cmd: &str, args: &[&str]) -> io::Result<String> {
        let mut a = vec!["netns", "exec", self.name.as_str(), cmd];
        a.extend_from_slice(args);
        let out = Command::new("ip").args(&a).output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "{cmd} in {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Move the calling thread into this namespace. Threads it spawns later
    /// (including a runtime's workers) start there too.
    pub fn enter(&self) -> io::Result<()> {
        let f = File::open(format!("/var/run/netns/{}", self.name))?;
        nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)
    }

    /// Run `f` on a new thread inside the namespace.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> io::Result<JoinHandle<T>> {
        let path = format!("/var/run/netns/{}", self.name);
        let file = File::open(path)?;
        Ok(std::thread::spawn(move || {
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("setns into test namespace");
            drop(file);
            f()
        }))
    }

    /// Bind on a new thread inside the namespace and serve there: `bind`
    /// returns what it bound and the address to report; once it did, this
    /// returns that address and the thread, which goes on to run `serve`
    /// with it. A failed bind is this call's error.
    pub fn serve<S, A: Send + 'static>(
        &self,
        bind: impl FnOnce() -> io::Result<(S, A)> + Send + 'static,
        serve: impl FnOnce(S) + Send + 'static,
    ) -> io::Result<(A, JoinHandle<()>)> {
        let (tx, rx) = std::sync::mpsc::channel();
        let handle = self.spawn(move || match bind() {
            Ok((bound, reported)) => {
                let _ = tx.send(Ok(reported));
                serve(bound);
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        })?;
        let reported = rx
            .recv()
            .map_err(|_| io::Error::other("server thread died before binding"))??;
        Ok((reported, handle))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = sh("ip", &["netns", "del", &self.name]);
    }
}

/// Delete namespaces left behind by test processes that no longer exist.
pub fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir("/var/run/netns") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(&format!("{PREFIX}-")) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid
            && pid != std::process::id()
            && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = sh("ip", &["netns", "del", &name]);
        }
    }
}

static NEXT_ID: AtomicU32 = AtomicU32::new(1);

/// Client and server namespaces joined by a veth pair.
#[derive(Debug)]
pub struct Topology {
    pub client: Netns,
    pub server: Netns,
    /// Per-topology subnet index N (198.19.N.0/24, fd00:19:N::/64).
    pub id: u32,
}

/// The name of the client side of the veth pair (the engine's outbound interface).
pub const CLIENT_VETH: &str = "ktc";

impl Topology {
    pub fn new() -> io::Result<Topology> {
        sweep_stale();
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed) % 250 + 1;
        let client = Netns::new(&format!("c{id}"))?;
        let server = Netns::new(&format!("s{id}"))?;
        let (cmac, smac) = (
            format!("02:6b:74:00:{:02x}:01", id),
            format!("02:6b:74:00:{:02x}:02", id),
        );
        client.ip(&[
            "link",
            "add",
            CLIENT_VETH,
            "address",
            &cmac,
            "type",
            "veth",
            "peer",
            "name",
            "kts",
            "address",
            &smac,
            "netns",
            server.name(),
        ])?;
        // Addresses on the engine's TUN would otherwise stay tentative for
        // about a second (DAD), delaying the first IPv6 connections.
        client.exec("sysctl", &["-qw", "net.ipv6.conf.default.accept_dad=0"])?;
        client.exec("sysctl", &["-qw", "net.ipv6.conf.all.accept_dad=0"])?;
        let t = Topology { client, server, id };
        let (c4, s4) = (t.client_v4().to_string(), t.server_v4().to_string());
        let (c6, s6) = (t.client_v6().to_string(), t.server_v6().to_string());
        t.client
            .ip(&["addr", "add", &format!("{c4}/24"), "dev", CLIENT_VETH])?;
        t.client.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{c6}/64"),
            "dev",
            CLIENT_VETH,
            "nodad",
        ])?;
        t.client.ip(&["link", "set", CLIENT_VETH, "up"])?;
        t.server
            .ip(&["addr", "add", &format!("{s4}/24"), "dev", "kts"])?;
        t.server.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{s6}/64"),
            "dev",
            "kts",
            "nodad",
        ])?;
        t.server.ip(&["link", "set", "kts", "up"])?;
        // Static neighbours: a fresh veth otherwise loses about a second to
        // the first IPv6 neighbour resolution, which tests would read as a
        // slow engine.
        for (ns, dev, peer4, peer6, mac) in [
            (&t.client, CLIENT_VETH, &s4, &s6, &smac),
            (&t.server, "kts", &c4, &c6, &cmac),
        ] {
            for (family, peer) in [("-4", peer4), ("-6", peer6)] {
                ns.pin_neighbour(family, peer, mac, dev)?;
            }
        }
        Ok(t)
    }

    pub fn client_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, self.id as u8, 1)
    }
    pub fn server_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, self.id as u8, 2)
    }
    pub fn client_v6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x19, self.id as u16, 0, 0, 0, 0, 1)
    }
    pub fn server_v6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x19, self.id as u16, 0, 0, 0, 0, 2)
    }

    /// The server address of a family.
    pub fn server(&self, v6: bool) -> IpAddr {
        if v6 {
            self.server_v6().into()
        } else {
            self.server_v4().into()
        }
    }

    /// Send the app's traffic for the server (and `extra` hosts) into the TUN
    /// (call once the engine created `tun`). The engine's own sockets are bound
    /// to the veth and keep using the connected /24 and /64 routes.
    pub fn route_via_tun(&self, tun: &str) -> io::Result<()> {
        self.client.route_host(self.server(false), tun, None)?;
        self.client.route_host(self.server(true), tun, None)
    }

    /// A socket address on the server.
    pub fn server_addr(&self, v6: bool, port: u16) -> SocketAddr {
        SocketAddr::new(self.server(v6), port)
    }

    /// The name of the TUN an engine creates in this topology (`kt<N>`).
    pub fn tun_name(&self) -> String {
        format!("kt{}", self.id)
    }

    /// A TCP test server on the server, on a port of its own.
    pub fn tcp_server(&self, v6: bool, mode: servers::Mode) -> servers::Server {
        servers::tcp(&self.server, self.server_addr(v6, 0), mode).expect("tcp server")
    }

    /// A UDP echo server on the server, on a port of its own.
    pub fn udp_echo(&self, v6: bool) -> servers::Server {
        servers::udp_echo(&self.server, self.server_addr(v6, 0)).expect("udp server")
    }
}

/// Run a blocking socket call again for as long as it fails with EINTR.
///
/// A call on a socket with a read timeout fails with EINTR when the process
/// is stopped and continued, or a signal arrives, even under `SA_RESTART`
/// (signal(7)); std's `read_exact` retries, `read`, `recv` and `accept` do
/// not. Seen on CI as a datagram "lost" mid-test.
pub fn uninterrupted<T>(mut call: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match call() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// Deterministic test payload for stream `seed` (xorshift64, 8 bytes per step).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Open descriptors of this process.
pub fn count_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Threads of this process.
pub fn count_threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

/// A memory figure of a process in KiB, from `/proc/<pid>/status` (`None`:
/// this process): `field` is `"VmRSS"` (resident now), `"VmHWM"` (peak
/// resident) or another `Vm*` line.
pub fn vm_kib(pid: Option<u32>, field: &str) -> Option<u64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/status"),
        None => "/proc/self/status".to_owned(),
    };
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Resident memory of this process, in KiB (0 when unreadable).
pub fn rss_kib() -> u64 {
    vm_kib(None, "VmRSS").unwrap_or(0)
}

/// One mapping of this process's address space and what of it is
/// resident (`/proc/self/smaps`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub size_kib: u64,
    pub rss_kib: u64,
    /// The file or `[heap]`/`[stack]`; empty for anonymous memory (glibc's
    /// arenas, thread stacks, mmap'd allocations).
    pub name: String,
}

/// This process's mappings now (empty when `/proc` is unreadable).
pub fn mappings() -> Vec<Mapping> {
    let Ok(text) = std::fs::read_to_string("/proc/self/smaps") else {
        return Vec::new();
    };
    let mut out: Vec<Mapping> = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            let name = words.nth(4).unwrap_or("").to_string();
            out.push(Mapping {
                start,
                size_kib: (end - start) / 1024,
                rss_kib: 0,
                name,
            });
        } else if first == "Rss:"
            && let (Some(m), Some(kib)) = (out.last_mut(), words.next())
        {
            m.rss_kib = kib.parse().unwrap_or(0);
        }
    }
    out
}

/// Where resident memory grew between two [`mappings`] readings: the
/// mappings whose resident size grew most (new ones included), largest
/// first, at most `top` of them, one per line.
pub fn resident_growth(before: &[Mapping], after: &[Mapping], top: usize) -> String {
    let mut grown: Vec<(i64, &Mapping)> = after
        .iter()
        .map(|m| {
            let was = before
                .iter()
                .find(|b| b.start == m.start)
                .map_or(0, |b| b.rss_kib);
            (m.rss_kib as i64 - was as i64, m)
        })
        .filter(|(d, _)| *d != 0)
        .collect();
    grown.sort_by_key(|(d, _)| -d);
    let total: i64 = grown.iter().map(|(d, _)| d).sum();
    let mut s = format!("resident growth {total} KiB over {} mappings:", grown.len());
    for (d, m) in grown.iter().take(top) {
        s.push_str(&format!(
            "\n  {d:+} KiB: {:x} size {} KiB rss {} KiB {}",
            m.start, m.size_kib, m.rss_kib, m.name
        ));
    }
    s
}

/// Peak resident memory of this process, in KiB (0 when unreadable).
pub fn peak_rss_kib() -> u64 {
    vm_kib(None, "VmHWM").unwrap_or(0)
}

/// How often [`within`] looks: a test waits at most this long past the
/// moment its condition holds.
pub const POLL: Duration = Duration::from_millis(20);

/// How long `ok` took to hold, looked at every [`POLL`]; `None` if it did
/// not within `limit`. It is looked at once more after `limit` passed, so a
/// thread that a loaded machine let sleep past the deadline does not fail a
/// condition that holds.
pub fn within(limit: Duration, mut ok: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    loop {
        let late = started.elapsed() >= limit;
        if ok() {
            return Some(started.elapsed());
        }
        if late {
            return None;
        }
        std::thread::sleep(POLL);
    }
}

/// [`within`], failing the test when `ok` did not hold in time. Where an
/// engine runs in this process, [`rig::Rig::wait_until`] also prints its
/// statistics.
pub fn wait_until(what: &str, limit: Duration, ok: impl FnMut() -> bool) -> Duration {
    within(limit, ok).unwrap_or_else(|| panic!("timed out after {limit:?} waiting for {what}"))
}

static SERIAL: Mutex<()> = Mutex::new(());

/// Held by the tests of one test binary that must not overlap (they measure
/// this process's descriptors, threads or memory, or load the machine): one
/// runs at a time, whatever `--test-threads` says. A test that failed while
/// holding it does not stop the others. The first call caps this process's
/// malloc arenas as the CLI's process does (`kerntun::limit_malloc_arenas`,
/// `MALLOC_ARENAS` in cli/src/main.rs), so that what these tests measure of
/// the process's memory is what the CLI would hold.
pub fn serial() -> MutexGuard<'static, ()> {
    static ARENAS: std::sync::Once = std::sync::Once::new();
    ARENAS.call_once(|| {
        kerntun::limit_malloc_arenas(1);
    });
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Blocking test servers that run on threads inside a namespace.
pub mod servers {
    use super::Netns;
    use std::io::{self, Read, Write};
    use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::thread::JoinHandle;
    use std::time::Duration;

    /// What a TCP server does with each connection.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Mode {
        /// Echo every byte; after the client's EOF send `TRAILER`, then close.
        Echo,
        /// Send `BANNER` first, then behave like `Echo`.
        SpeakFirst,
        /// Read and count until EOF, then close (upload sink).
        Sink,
        /// Hold the connection open without reading until the peer closes.
        Hold,
        /// Read one request, echo it, then close first (the server is the
        /// active closer, as in HTTP/1.0): for connection churn.
        OneShot,
        /// Echo until this many bytes were received, then reset (SO_LINGER 0).
        ResetAfter(usize),
        /// Read and discard at about this many bytes per second (a slow reader).
        SlowSink(usize),
    }

    /// Sent by `Echo`/`SpeakFirst` after the client half-closed.
    pub const TRAILER: &[u8] = b"answer-after-eof";
    /// Sent by `SpeakFirst` right after accept.
    pub const BANNER: &[u8] = b"220 kerntun test server\r\n";

    /// A running server; stopped and joined on drop.
    #[derive(Debug)]
    pub struct Server {
        pub addr: SocketAddr,
        /// Connections accepted so far.
        pub accepted: Arc<AtomicU64>,
        stop: Arc<AtomicBool>,
        handle: Option<JoinHandle<()>>,
    }

    impl Server {
        /// A server on a thread in `ns` ([`Netns::serve`]): `bind` returns
        /// the socket and its address; `serve` runs until the stop flag it
        /// is given is set (when the server is dropped), counting into the
        /// counter it is given (`accepted`).
        pub fn start<S>(
            ns: &Netns,
            bind: impl FnOnce() -> io::Result<(S, SocketAddr)> + Send + 'static,
            serve: impl FnOnce(S, &Arc<AtomicBool>, &AtomicU64) + Send + 'static,
        ) -> io::Result<Server> {
            let stop = Arc::new(AtomicBool::new(false));
            let accepted = Arc::new(AtomicU64::new(0));
            let (stop2, accepted2) = (stop.clone(), accepted.clone());
            let (addr, handle) = ns.serve(bind, move |s| serve(s, &stop2, &accepted2))?;
            Ok(Server {
                addr,
                accepted,
                stop,
                handle: Some(handle),
            })
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            if let Some(h) = self.handle.take() {
                let _ = h.join();
            }
        }
    }

    /// Start a TCP server in `ns` on `addr` (port 0 picks one).
    pub fn tcp(ns: &Netns, addr: SocketAddr, mode: Mode) -> io::Result<Server> {
        accepting(ns, addr, move |s, stop| {
            let _ = s.set_nonblocking(false);
            let stop = stop.clone();
            std::thread::spawn(move || serve(s, mode, &stop));
        })
    }

    /// A TCP server in `ns` on `addr` (port 0 picks one) that counts each
    /// connection it accepts and hands it to `each` (still nonblocking),
    /// with the server's stop flag.
    pub fn accepting(
        ns: &Netns,
        addr: SocketAddr,
        mut each: impl FnMut(TcpStream, &Arc<AtomicBool>) + Send + 'static,
    ) -> io::Result<Server> {
        Server::start(
            ns,
            move || listen(addr),
            move |l, stop, accepted| {
                while !stop.load(Ordering::Relaxed) {
                    match l.accept() {
                        Ok((s, _)) => {
                            accepted.fetch_add(1, Ordering::Relaxed);
                            each(s, stop);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(2)),
                    }
                }
            },
        )
    }

    /// A nonblocking listener on `addr` (port 0 picks one), and its address.
    pub fn listen(addr: SocketAddr) -> io::Result<(TcpListener, SocketAddr)> {
        let l = TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        let a = l.local_addr()?;
        Ok((l, a))
    }

    fn serve(mut s: TcpStream, mode: Mode, stop: &AtomicBool) {
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        if mode == Mode::SpeakFirst && s.write_all(BANNER).is_err() {
            return;
        }
        let size = match mode {
            Mode::SlowSink(rate) => (rate / 10).max(1),
            _ => 64 * 1024,
        };
        let mut buf = vec![0u8; size];
        let mut received = 0usize;
        loop {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            if mode == Mode::Hold {
                match s.read(&mut buf[..1]) {
                    Ok(0) => return,
                    Ok(_) => continue,
                    Err(e) if is_timeout(&e) => continue,
                    Err(_) => return,
                }
            }
            let chunk = match mode {
                // 10 reads per second of rate/10 bytes each.
                Mode::SlowSink(rate) => (rate / 10).max(1),
                _ => buf.len(),
            };
            match s.read(&mut buf[..chunk]) {
                Ok(0) => {
                    if !matches!(mode, Mode::Sink | Mode::SlowSink(_)) {
                        let _ = s.write_all(TRAILER);
                    }
                    let _ = s.shutdown(Shutdown::Write);
                    return;
                }
                Ok(n) => {
                    received += n;
                    match mode {
                        Mode::Sink => {}
                        Mode::SlowSink(_) => std::thread::sleep(Duration::from_millis(100)),
                        Mode::OneShot => {
                            let _ = s.write_all(&buf[..n]);
                            let _ = s.shutdown(Shutdown::Both);
                            return;
                        }
                        Mode::ResetAfter(limit) if received >= limit => {
                            let _ = socket_linger_zero(&s);
                            return;
                        }
                        _ => {
                            if s.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    }
                }
                Err(e) if is_timeout(&e) => continue,
                Err(_) => return,
            }
        }
    }

    /// Make the next close send an RST.
    fn socket_linger_zero(s: &TcpStream) -> io::Result<()> {
        nix::sys::socket::setsockopt(
            s,
            nix::sys::socket::sockopt::Linger,
            &nix::libc::linger {
                l_onoff: 1,
                l_linger: 0,
            },
        )
        .map_err(io::Error::from)
    }

    /// Whether a read with a timeout ended for want of data (or a signal),
    /// not because the connection did.
    pub(crate) fn is_timeout(e: &io::Error) -> bool {
        matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
        )
    }

    /// Start a UDP echo server in `ns`.
    pub fn udp_echo(ns: &Netns, addr: SocketAddr) -> io::Result<Server> {
        let bind = move || {
            let s = UdpSocket::bind(addr)?;
            s.set_read_timeout(Some(Duration::from_millis(50)))?;
            let a = s.local_addr()?;
            Ok((s, a))
        };
        Server::start(ns, bind, |s, stop, count| {
            let mut buf = vec![0u8; 65536];
            while !stop.load(Ordering::Relaxed) {
                if let Ok((n, from)) = s.recv_from(&mut buf) {
                    count.fetch_add(1, Ordering::Relaxed);
                    let _ = s.send_to(&buf[..n], from);
                }
            }
        })
    }
}

/// A UDP echo server whose socket has `UDP_GRO` on (Linux): a batch the
/// sender gave the kernel as one GSO packet arrives here whole, with its
/// segment size, and is echoed one datagram per segment, as sent. `accepted`
/// counts the reads that carried more than one datagram, i.e. the sender's
/// GSO batches (veth passes them through unsplit).
#[cfg(target_os = "linux")]
pub fn udp_gro_echo(ns: &Netns, addr: std::net::SocketAddr) -> io::Result<servers::Server> {
    use nix::sys::socket::{
        ControlMessageOwned, MsgFlags, SockaddrStorage, recvmsg, setsockopt, sockopt,
    };
    use std::io::IoSliceMut;
    use std::net::UdpSocket;
    use std::sync::atomic::Ordering;
    let bind = move || {
        let s = UdpSocket::bind(addr)?;
        setsockopt(&s, sockopt::UdpGroSegment, &true).map_err(io::Error::from)?;
        s.set_read_timeout(Some(std::time::Duration::from_millis(50)))?;
        let a = s.local_addr()?;
        Ok((s, a))
    };
    servers::Server::start(ns, bind, |s, stop, count| {
        let mut buf = vec![0u8; 65536];
        let mut space = nix::cmsg_space!(i32);
        while !stop.load(Ordering::Relaxed) {
            let (n, from, seg) = {
                let mut iov = [IoSliceMut::new(&mut buf)];
                let Ok(m) = recvmsg::<SockaddrStorage>(
                    std::os::fd::AsRawFd::as_raw_fd(&s),
                    &mut iov,
                    Some(&mut space),
                    MsgFlags::empty(),
                ) else {
                    continue;
                };
                let mut seg = None;
                if let Ok(cmsgs) = m.cmsgs() {
                    for c in cmsgs {
                        if let ControlMessageOwned::UdpGroSegments(g) = c {
                            seg = usize::try_from(g).ok().filter(|&g| g > 0);
                        }
                    }
                }
                let from = m.address.and_then(|a| {
                    a.as_sockaddr_in()
                        .map(|v4| std::net::SocketAddr::from(std::net::SocketAddrV4::from(*v4)))
                        .or_else(|| {
                            a.as_sockaddr_in6().map(|v6| {
                                std::net::SocketAddr::from(std::net::SocketAddrV6::from(*v6))
                            })
                        })
                });
                (m.bytes, from, seg)
            };
            let Some(from) = from else { continue };
            let seg = seg.unwrap_or(n.max(1));
            if n > seg {
                count.fetch_add(1, Ordering::Relaxed);
            }
            if n == 0 {
                let _ = s.send_to(&[], from);
            }
            // Never cut short: split exactly where the kernel says.
            for d in buf[..n].chunks(seg) {
                let _ = s.send_to(d, from);
            }
        }
    })
}

/// Client-side checks used by the tests and the demo.
pub mod client {
    use super::{Netns, pattern, servers};
    use std::io::{self, Read, Write};
    use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream, UdpSocket};
    use std::time::{Duration, Instant};

    /// Outcome of an echo transfer.
    #[derive(Debug, Clone, Copy)]
    pub struct Transfer {
        pub bytes: u64,
        pub elapsed: Duration,
    }

    impl Transfer {
        /// Payload throughput in one direction, in Gbit/s.
        pub fn gbit_per_s(&self) -> f64 {
            self.bytes as f64 * 8.0 / self.elapsed.as_secs_f64() / 1e9
        }
    }

    /// A connection to the echo server at `to`, held open once `data` came
    /// back on it byte for byte (its reads time out after 5 s).
    pub fn held_echo(to: SocketAddr, data: &[u8]) -> TcpStream {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(3)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s.write_all(data).expect("write");
        let mut back = vec![0u8; data.len()];
        s.read_exact(&mut back).expect("echo");
        assert!(back == data, "the echo differs from what was sent");
        s
    }

    /// One read of `s` (retried on EINTR), and whether it found the
    /// connection ended: EOF or a reset. Bytes, or an error of another kind
    /// (a read timeout), say it did not.
    pub fn read_ended(s: &mut TcpStream) -> (bool, io::Result<usize>) {
        let mut buf = [0u8; 64];
        let r = crate::uninterrupted(|| s.read(&mut buf));
        let ended = matches!(r, Ok(0))
            || r.as_ref()
                .is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset);
        (ended, r)
    }

    /// Send `len` bytes of `pattern(seed)` to an `Echo`/`SpeakFirst` server,
    /// half-close, and check byte for byte that the same bytes come back
    /// followed by the trailer sent after EOF.
    pub fn echo_transfer(
        to: SocketAddr,
        seed: u64,
        len: usize,
        speak_first: bool,
    ) -> io::Result<Transfer> {
        let start = Instant::now();
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        if speak_first {
            let mut banner = vec![0u8; servers::BANNER.len()];
            s.read_exact(&mut banner)?;
            if banner != servers::BANNER {
                return Err(io::Error::other("banner mismatch"));
            }
        }
        let data = pattern(seed, len);
        let mut w = s.try_clone()?;
        let writer = std::thread::spawn(move || -> io::Result<()> {
            for chunk in data.chunks(256 * 1024) {
                w.write_all(chunk)?;
            }
            w.shutdown(Shutdown::Write)
        });
        let want = pattern(seed, len);
        let mut got = 0usize;
        let mut buf = vec![0u8; 256 * 1024];
        while got < len {
            let n = crate::uninterrupted(|| s.read(&mut buf))?;
            if n == 0 {
                return Err(io::Error::other(format!("EOF after {got} of {len} bytes")));
            }
            let take = n.min(len - got);
            if buf[..take] != want[got..got + take] {
                return Err(io::Error::other(format!("mismatch near offset {got}")));
            }
            got += take;
            if take < n {
                // The trailer started in this read.
                let mut rest = buf[take..n].to_vec();
                s.read_to_end(&mut rest)?;
                return finish(writer, rest, len, start);
            }
        }
        let mut rest = Vec::new();
        s.read_to_end(&mut rest)?;
        finish(writer, rest, len, start)
    }

    fn finish(
        writer: std::thread::JoinHandle<io::Result<()>>,
        trailer: Vec<u8>,
        len: usize,
        start: Instant,
    ) -> io::Result<Transfer> {
        writer
            .join()
            .map_err(|_| io::Error::other("writer panicked"))??;
        if trailer != servers::TRAILER {
            return Err(io::Error::other(format!(
                "expected the post-EOF answer, got {:?}",
                String::from_utf8_lossy(&trailer)
            )));
        }
        Ok(Transfer {
            bytes: len as u64,
            elapsed: start.elapsed(),
        })
    }

    /// An app's UDP socket of a family, on any address; reads give up after
    /// 700 ms.
    pub fn udp_app_socket(v6: bool) -> UdpSocket {
        let any: SocketAddr = if v6 { "[::]:0" } else { "0.0.0.0:0" }
            .parse()
            .expect("addr");
        let app = UdpSocket::bind(any).expect("app socket");
        app.set_read_timeout(Some(Duration::from_millis(700)))
            .expect("timeout");
        app
    }

    /// Datagrams as (source, payload).
    pub type Datagrams = Vec<(SocketAddr, Vec<u8>)>;

    /// Replies to one datagram from three places: the app (a
    /// [`udp_app_socket`] of `server`'s family, in this thread's namespace)
    /// sends `hello` to port A on `server` in `ns`; the server answers from
    /// A, then from its port B on the same address, then from a port on
    /// `second`. Returns what reached the app, in order, until a read timed
    /// out, and the three replies as the server sent them (source, payload),
    /// A's first: a test of endpoint-independent filtering wants all three,
    /// one of connected filtering A's alone.
    pub fn replies_from_three_places(
        ns: &Netns,
        server: IpAddr,
        second: IpAddr,
    ) -> (Datagrams, Datagrams) {
        let (tx, rx) = std::sync::mpsc::channel();
        let peer = ns
            .spawn(move || -> io::Result<Vec<SocketAddr>> {
                let a = UdpSocket::bind(SocketAddr::new(server, 0))?;
                let b = UdpSocket::bind(SocketAddr::new(server, 0))?;
                let c = UdpSocket::bind(SocketAddr::new(second, 0))?;
                let _ = tx.send(a.local_addr()?);
                a.set_read_timeout(Some(Duration::from_secs(3)))?;
                let mut buf = [0u8; 64];
                let (n, app) = crate::uninterrupted(|| a.recv_from(&mut buf))?;
                a.send_to(&buf[..n], app)?;
                b.send_to(b"from port B", app)?;
                c.send_to(b"from the second address", app)?;
                Ok(vec![a.local_addr()?, b.local_addr()?, c.local_addr()?])
            })
            .expect("server thread");
        let to = rx.recv().expect("server address");
        let app = udp_app_socket(server.is_ipv6());
        app.send_to(b"hello", to).expect("send");
        let from = peer.join().expect("server thread").expect("server");
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        while let Ok((n, src)) = crate::uninterrupted(|| app.recv_from(&mut buf)) {
            got.push((src, buf[..n].to_vec()));
        }
        let sent = vec![
            (from[0], b"hello".to_vec()),
            (from[1], b"from port B".to_vec()),
            (from[2], b"from the second address".to_vec()),
        ];
        (got, sent)
    }

    /// One UDP request/response round trip per datagram, each checked. Each
    /// datagram starts with its sequence number; a timed-out request is sent
    /// again (up to 3 times) and stale duplicates of earlier replies are skipped.
    pub fn udp_round_trips(to: SocketAddr, count: usize, size: usize) -> io::Result<usize> {
        let bind: SocketAddr = if to.is_ipv6() {
            "[::]:0".parse().expect("static")
        } else {
            "0.0.0.0:0".parse().expect("static")
        };
        let s = std::net::UdpSocket::bind(bind)?;
        s.connect(to)?;
        s.set_read_timeout(Some(Duration::from_millis(500)))?;
        let mut ok = 0;
        let mut buf = vec![0u8; size.max(8) + 16];
        for i in 0..count {
            let mut msg = pattern(i as u64, size.max(8));
            msg[..8].copy_from_slice(&(i as u64).to_be_bytes());
            s.send(&msg)?;
            let mut sends = 1;
            loop {
                match crate::uninterrupted(|| s.recv(&mut buf)) {
                    Ok(n) if buf[..n] == msg[..] => {
                        ok += 1;
                        break;
                    }
                    Ok(n)
                        if n >= 8
                            && u64::from_be_bytes(buf[..8].try_into().expect("8")) < i as u64 => {}
                    Ok(_) => return Err(io::Error::other("udp reply mismatch")),
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) =>
                    {
                        if sends == 3 {
                            break;
                        }
                        sends += 1;
                        s.send(&msg)?;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(ok)
    }
}
