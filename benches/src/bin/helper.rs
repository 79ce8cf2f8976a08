//! Helper processes for the netns harness, each run by `ip netns exec` in
//! its namespace so the engine's memory is measured alone:
//!
//! * `hold-server --listen ADDR`: accepts connections, answers each one's
//!   first byte, then holds it open without reading until the peer closes.
//! * `hold-client --connect ADDR --steps 1000,4000,10000`: opens connections
//!   in steps (at most `--concurrency` connects in flight), checks each with
//!   a one-byte ping, prints `{"holding":N,"failed":F,"secs":S}` after each
//!   step and waits for a line on stdin before the next step (`next`, or
//!   `next N` to go to N instead of the planned step). Closing stdin ends
//!   it, closing every connection.
//! * `ss-none --listen ADDR`: a Shadowsocks server for method `none`: reads
//!   the address header (SOCKS5 address: type, address, port), connects and
//!   relays. Prints one line per connection so the harness can check that
//!   traffic really went through it.
//! * `echo --connect ADDR --bytes N`: the integrity check, from the
//!   client's namespace and uid: one connection to an echo server sends N
//!   bytes of a pattern, half-closes and checks every byte that comes back
//!   and the answer after EOF (`kerntun_testkit::client::echo_transfer`);
//!   prints `{"secs":S}`, or the error on stderr and exits non-zero.
//!
//! One current-thread tokio runtime per process: thousands of idle
//! connections cost a task each, not a thread.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

#[derive(Parser, Debug)]
#[command(
    name = "kerntun-bench-helper",
    about = "helper processes for kerntun-netbench"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    HoldServer {
        #[arg(long)]
        listen: SocketAddr,
    },
    HoldClient {
        #[arg(long)]
        connect: SocketAddr,
        /// Cumulative connection counts to reach, in order.
        #[arg(long, value_delimiter = ',', required = true)]
        steps: Vec<usize>,
        /// Connects in flight at once. The engine's listener backlog is 1024
        /// on desktop; staying well under it keeps SYNs from being dropped.
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// Upper bound for one connect + ping, seconds.
        #[arg(long, default_value_t = 10)]
        timeout: u64,
        /// Only connect: no byte crosses the connections (the relay never
        /// allocates a buffer for them).
        #[arg(long)]
        no_ping: bool,
    },
    SsNone {
        #[arg(long)]
        listen: SocketAddr,
    },
    Echo {
        #[arg(long)]
        connect: SocketAddr,
        /// Bytes sent (and checked on their way back).
        #[arg(long)]
        bytes: usize,
        /// The pattern's seed.
        #[arg(long, default_value_t = 0x6b74)]
        seed: u64,
    },
}

/// The byte each held connection is checked with.
const PING: u8 = 0x5a;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Cmd::Echo {
        connect,
        bytes,
        seed,
    } = cli.cmd
    {
        return echo(connect, bytes, seed);
    }
    // 10k connections need 10k descriptors on each side; the harness raised
    // the hard limit for us, take all of it.
    raise_nofile();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kerntun-bench-helper: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(async {
        match cli.cmd {
            Cmd::HoldServer { listen } => hold_server(listen).await,
            Cmd::HoldClient {
                connect,
                steps,
                concurrency,
                timeout,
                no_ping,
            } => {
                let t = Duration::from_secs(timeout);
                hold_client(connect, steps, concurrency, t, !no_ping).await
            }
            Cmd::SsNone { listen } => ss_none(listen).await,
            Cmd::Echo { .. } => Ok(()),
        }
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kerntun-bench-helper: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The integrity check (blocking: one connection, nothing else to run).
fn echo(to: SocketAddr, bytes: usize, seed: u64) -> ExitCode {
    match kerntun_testkit::client::echo_transfer(to, seed, bytes, false) {
        Ok(t) => {
            say(&format!("{{\"secs\":{}}}", t.elapsed.as_secs_f64()));
            ExitCode::SUCCESS
        }
        Err(e) => {
            match e.kind() {
                // The checker's socket has a 20 s read timeout.
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    eprintln!("stalled: no byte came back for 20 s ({e})")
                }
                _ => eprintln!("echo transfer: {e}"),
            }
            ExitCode::FAILURE
        }
    }
}

fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The next connection; an accept error is printed and tried again after
/// 50 ms.
async fn accept(l: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match l.accept().await {
            Ok(v) => return v,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn hold_server(listen: SocketAddr) -> Result<(), String> {
    let l = TcpListener::bind(listen)
        .await
        .map_err(|e| format!("bind {listen}: {e}"))?;
    say(&format!("listening {listen}"));
    loop {
        let (mut s, _) = accept(&l).await;
        tokio::spawn(async move {
            // Answer each byte (the client's ping) until the peer closes,
            // one byte at a time: nothing is buffered per connection.
            let mut b = [0u8; 1];
            while let Ok(1) = s.read(&mut b).await {
                if s.write_all(&b).await.is_err() {
                    return;
                }
            }
        });
    }
}

async fn open_one(to: SocketAddr, timeout: Duration, ping: bool) -> Result<TcpStream, String> {
    let fut = async {
        let mut s = TcpStream::connect(to).await.map_err(|e| e.to_string())?;
        if !ping {
            return Ok(s);
        }
        s.write_all(&[PING]).await.map_err(|e| e.to_string())?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.map_err(|e| e.to_string())?;
        if b[0] != PING {
            return Err(format!("ping answered with {:#x}", b[0]));
        }
        Ok(s)
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| "connect + ping timed out".to_string())?
}

async fn hold_client(
    to: SocketAddr,
    steps: Vec<usize>,
    concurrency: usize,
    timeout: Duration,
    ping: bool,
) -> Result<(), String> {
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let mut held: Vec<TcpStream> = Vec::new();
    let mut first_error: Option<String> = None;
    let mut planned = steps.into_iter();
    let mut next = planned.next();
    while let Some(step) = next {
        let start = Instant::now();
        let need = step.saturating_sub(held.len());
        let (mut launched, mut failed) = (0usize, 0usize);
        let mut set = JoinSet::new();
        while launched < need || !set.is_empty() {
            while launched < need && set.len() < concurrency.max(1) {
                set.spawn(open_one(to, timeout, ping));
                launched += 1;
            }
            match set.join_next().await {
                Some(Ok(Ok(s))) => held.push(s),
                Some(Ok(Err(e))) => {
                    failed += 1;
                    first_error.get_or_insert(e);
                }
                Some(Err(e)) => {
                    failed += 1;
                    first_error.get_or_insert(e.to_string());
                }
                None => break,
            }
        }
        let err = first_error
            .take()
            .map_or("null".to_string(), |e| format!("{e:?}"));
        say(&format!(
            "{{\"holding\":{},\"failed\":{failed},\"secs\":{:.3},\"first_error\":{err}}}",
            held.len(),
            start.elapsed().as_secs_f64()
        ));
        // `next` goes on to the planned step; `next N` to N instead (the
        // harness lowers a step the descriptor limit cannot hold).
        let line = match stdin.next_line().await {
            Ok(Some(line)) => line,
            _ => return Ok(()),
        };
        let plan = planned.next();
        next = match line.trim().strip_prefix("next").map(str::trim) {
            Some(n) if !n.is_empty() && plan.is_some() => n.parse().ok().or(plan),
            _ => plan,
        };
    }
    // Hold until told to go (stdin closed).
    while let Ok(Some(_)) = stdin.next_line().await {}
    Ok(())
}

async fn ss_none(listen: SocketAddr) -> Result<(), String> {
    let l = TcpListener::bind(listen)
        .await
        .map_err(|e| format!("bind {listen}: {e}"))?;
    say(&format!("listening {listen}"));
    ss_none_serve(l).await
}

async fn ss_none_serve(l: TcpListener) -> Result<(), String> {
    loop {
        let (s, peer) = accept(&l).await;
        tokio::spawn(async move {
            if let Err(e) = ss_none_conn(s, peer).await {
                eprintln!("ss-none {peer}: {e}");
            }
        });
    }
}

async fn ss_none_conn(mut s: TcpStream, peer: SocketAddr) -> Result<(), String> {
    let target = read_address(&mut s).await?;
    say(&format!("conn {peer} -> {target}"));
    let mut out = TcpStream::connect(target)
        .await
        .map_err(|e| format!("connect {target}: {e}"))?;
    let _ = s.set_nodelay(true);
    let _ = out.set_nodelay(true);
    tokio::io::copy_bidirectional(&mut s, &mut out)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The Shadowsocks address header: SOCKS5 ATYP (1 = IPv4, 3 = domain,
/// 4 = IPv6), the address, and a big-endian port.
async fn read_address(s: &mut TcpStream) -> Result<SocketAddr, String> {
    let e = |e: std::io::Error| format!("address header: {e}");
    let atyp = s.read_u8().await.map_err(e)?;
    let ip = match atyp {
        1 => {
            let mut a = [0u8; 4];
            s.read_exact(&mut a).await.map_err(e)?;
            IpAddr::V4(Ipv4Addr::from(a))
        }
        4 => {
            let mut a = [0u8; 16];
            s.read_exact(&mut a).await.map_err(e)?;
            IpAddr::V6(Ipv6Addr::from(a))
        }
        3 => {
            let n = s.read_u8().await.map_err(e)?;
            let mut name = vec![0u8; usize::from(n)];
            s.read_exact(&mut name).await.map_err(e)?;
            let port = s.read_u16().await.map_err(e)?;
            let host = String::from_utf8(name).map_err(|_| "domain is not UTF-8".to_string())?;
            return tokio::net::lookup_host((host.as_str(), port))
                .await
                .map_err(|e| format!("resolve {host}: {e}"))?
                .next()
                .ok_or_else(|| format!("{host}: no address"));
        }
        other => return Err(format!("address type {other}")),
    };
    let port = s.read_u16().await.map_err(e)?;
    Ok(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn ss_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(ss_none_serve(l));
        addr
    }

    /// Address header then payload, the way a Shadowsocks `none` client
    /// sends them; the echo must come back unframed.
    async fn round_trip(ss: SocketAddr, header: Vec<u8>) -> Vec<u8> {
        let mut c = TcpStream::connect(ss).await.expect("connect");
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        c.write_all(&header).await.expect("header");
        c.write_all(&payload).await.expect("payload");
        c.shutdown().await.expect("half-close");
        let mut back = Vec::new();
        c.read_to_end(&mut back).await.expect("read");
        assert_eq!(back, payload);
        back
    }

    #[tokio::test]
    async fn ss_none_relays_ipv4_and_domain_targets() {
        let echo = echo_server().await;
        let ss = ss_server().await;
        let port = echo.port().to_be_bytes();
        round_trip(ss, vec![1, 127, 0, 0, 1, port[0], port[1]]).await;
        let mut domain = vec![3, 9];
        domain.extend_from_slice(b"localhost");
        domain.extend_from_slice(&port);
        round_trip(ss, domain).await;
    }

    #[tokio::test]
    async fn ss_none_refuses_an_unknown_address_type() {
        let ss = ss_server().await;
        let mut c = TcpStream::connect(ss).await.expect("connect");
        c.write_all(&[9, 1, 2, 3]).await.expect("write");
        let mut b = Vec::new();
        // The server drops the connection: EOF or a reset, never data.
        let n = c.read_to_end(&mut b).await.unwrap_or(0);
        assert_eq!(n, 0);
    }

    #[tokio::test]
    async fn hold_server_answers_every_byte() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        tokio::spawn(hold_server(addr));
        let mut s = None;
        for _ in 0..100 {
            if let Ok(c) = open_one(addr, Duration::from_secs(5), true).await {
                s = Some(c);
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut s = s.expect("hold server reachable and answering the ping");
        s.write_all(&[PING]).await.expect("second ping");
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.expect("second answer");
        assert_eq!(b[0], PING);
    }
}
