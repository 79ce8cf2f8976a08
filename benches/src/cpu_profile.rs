//! Where the engine's CPU goes on the relay paths. The harness records the
//! engine process with `perf record -g` during one extra iperf3 run per
//! splice/copy scenario (never during the measured runs: sampling costs CPU)
//! and sorts every sample by its call chain into buckets:
//!
//! * relay: the `splice(2)` calls (socket -> pipe, pipe -> socket) or the
//!   `recv`/`send` of the userspace copy, with everything the kernel does
//!   inside them: TCP transmit, and the softirq that delivers the segment
//!   over the veth to the peer's TCP in the same call;
//! * TUN: `read`/`write` on the TUN device, including the kernel's TCP/IP
//!   receive of each packet the engine writes back (it runs inside the
//!   `write`);
//! * engine userspace: packet parsing, NAT, checksums, the driver's
//!   `memcpy` of segments into its write buffers;
//! * rest: interrupts and softirqs outside a system call, epoll, other calls.
//!
//! Samples whose innermost kernel frame is a copy routine (`_copy_to_iter`,
//! `_copy_from_iter`...) are also counted as copies of their bucket, which
//! shows what splicing saves: the relay's copies, and nothing of the TUN's.
//!
//! Parsing `perf script` output is plain text work, unit-tested here.

use serde::{Deserialize, Serialize};

use crate::iperf::Direction;

/// One bucket of a profile: its share of all samples, and the share of all
/// samples that were copies inside it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    pub name: String,
    pub share: f64,
    pub copy_share: f64,
}

/// A sampled profile of the engine during one iperf3 run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CpuProfile {
    pub scenario: String,
    pub streams: u32,
    pub direction: Direction,
    /// Samples attributed (all threads of the engine).
    pub samples: u64,
    /// Engine CPU s/GB of this (sampled, hence slower) run.
    pub cpu_s_per_gb: Option<f64>,
    /// Largest first.
    pub buckets: Vec<Bucket>,
    pub error: Option<String>,
}

/// The bucket names, grouped into the paths the page reports.
pub const RELAY_SPLICE_IN: &str = "relay: splice socket -> pipe";
pub const RELAY_SPLICE_OUT: &str = "relay: splice pipe -> socket (+ TCP transmit)";
pub const RELAY_RECV: &str = "relay: recv";
pub const RELAY_SEND: &str = "relay: send (+ TCP transmit)";
pub const TUN_READ: &str = "TUN: read";
pub const TUN_WRITE: &str = "TUN: write (skb allocation and copy)";
pub const TUN_WRITE_RX: &str = "TUN: write -> kernel TCP/IP receive";
pub const USER_MEMCPY: &str = "userspace: memcpy";
pub const USER_CHECKSUM: &str = "userspace: checksum";
pub const USER_OTHER: &str = "userspace: other (driver, NAT, runtime)";
pub const INTERRUPT: &str = "interrupts and softirq outside a call";
pub const WAIT: &str = "epoll, futex";
pub const OTHER: &str = "other system calls";

/// Which reported path a bucket belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Relay,
    Tun,
    User,
    Rest,
}

pub fn path_of(bucket: &str) -> Path {
    if bucket.starts_with("relay:") {
        Path::Relay
    } else if bucket.starts_with("TUN:") {
        Path::Tun
    } else if bucket.starts_with("userspace:") {
        Path::User
    } else {
        Path::Rest
    }
}

/// Innermost kernel frames that copy payload between user and kernel memory.
const COPY_FRAMES: [&str; 6] = [
    "_copy_to_iter",
    "_copy_from_iter",
    "copy_page_from_iter",
    "copy_page_to_iter",
    "rep_movs_alternative",
    "copy_user",
];

/// Sort one sample by its frames (innermost first; `true` = kernel frame).
/// Returns the bucket and whether the sample was a copy.
pub fn classify(frames: &[(bool, &str)]) -> (&'static str, bool) {
    let kernel: Vec<&str> = frames.iter().filter(|f| f.0).map(|f| f.1).collect();
    let Some(&leaf) = kernel.first() else {
        let leaf = frames.first().map_or("", |f| f.1);
        let b = if leaf.contains("memmove") || leaf.contains("memcpy") {
            USER_MEMCPY
        } else if leaf.contains("checksum") || leaf.contains("csum") {
            USER_CHECKSUM
        } else {
            USER_OTHER
        };
        return (b, b == USER_MEMCPY);
    };
    let copy = COPY_FRAMES.iter().any(|c| leaf.contains(c));
    let has = |name: &str| kernel.contains(&name);
    let has_part = |part: &str| kernel.iter().any(|k| k.contains(part));
    let bucket = if has("tun_chr_read_iter") || has("tun_do_read") {
        TUN_READ
    } else if has("tun_chr_write_iter") || has("tun_get_user") {
        if has("tcp_v4_rcv") || has("tcp_v6_rcv") {
            TUN_WRITE_RX
        } else {
            TUN_WRITE
        }
    } else if has("__x64_sys_splice") || has("__arm64_sys_splice") || has("do_splice") {
        if has("splice_to_socket") {
            RELAY_SPLICE_OUT
        } else {
            RELAY_SPLICE_IN
        }
    } else if has_part("tcp_recvmsg") {
        RELAY_RECV
    } else if has_part("tcp_sendmsg") {
        RELAY_SEND
    } else if has_part("epoll_wait") || has_part("sys_futex") {
        WAIT
    } else if has_part("sys_") || has("do_syscall_64") {
        OTHER
    } else {
        INTERRUPT
    };
    (bucket, copy)
}

/// Tally `perf script -F tid,period,ip,sym` output (with call chains): one
/// block per sample, a header line (`tid period`) then one `addr symbol`
/// line per frame, innermost first; blocks separated by empty lines.
pub fn tally(script: &str) -> (u64, Vec<Bucket>) {
    use std::collections::BTreeMap;
    let mut by: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
    let mut total = 0u64;
    let mut samples = 0u64;
    let mut period: Option<u64> = None;
    let mut frames: Vec<(bool, &str)> = Vec::new();
    let mut flush = |period: &mut Option<u64>, frames: &mut Vec<(bool, &str)>| {
        if let Some(p) = period.take() {
            let (b, copy) = classify(frames);
            let e = by.entry(b).or_default();
            e.0 += p;
            if copy {
                e.1 += p;
            }
            total += p;
            samples += 1;
        }
        frames.clear();
    };
    for line in script.lines() {
        if line.trim().is_empty() {
            flush(&mut period, &mut frames);
            continue;
        }
        let mut words = line.split_whitespace();
        if period.is_none() {
            // Header: `tid period` (a line that is not one is skipped).
            let _tid = words.next();
            period = words.next().and_then(|w| w.parse().ok());
            continue;
        }
        let Some(addr) = words.next() else { continue };
        let sym = line
            .trim_start()
            .get(addr.len()..)
            .map_or("", str::trim)
            .split(" (")
            .next()
            .unwrap_or("");
        let kernel = addr.len() == 16 && addr.starts_with("ffff");
        frames.push((kernel, sym));
    }
    flush(&mut period, &mut frames);
    let mut buckets: Vec<Bucket> = by
        .into_iter()
        .map(|(name, (p, c))| Bucket {
            name: name.to_owned(),
            share: p as f64 / total.max(1) as f64,
            copy_share: c as f64 / total.max(1) as f64,
        })
        .collect();
    buckets.sort_by(|a, b| b.share.total_cmp(&a.share));
    (samples, buckets)
}

impl CpuProfile {
    /// Share of all samples on one path, and the copies in it.
    pub fn path_share(&self, path: Path) -> (f64, f64) {
        self.buckets
            .iter()
            .filter(|b| path_of(&b.name) == path)
            .fold((0.0, 0.0), |(s, c), b| (s + b.share, c + b.copy_share))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRIPT: &str = "\
 9971     250000 
\tffffffff81e32f90 sock_def_readable
\tffffffff8201f2c5 tcp_data_queue
\tffffffff81e6743b net_rx_action
\tffffffff8200ec65 tcp_sendmsg
\tffffffff8170e145 splice_to_socket
\tffffffff8170e76a do_splice
\tffffffff8170ef94 __x64_sys_splice
\tffffffff821ed511 do_syscall_64
\t          10915b splice (/usr/lib/x86_64-linux-gnu/libc.so.6)

 9971     250000 
\tffffffff81b6a460 _copy_from_iter
\tffffffff81b6b799 copy_page_from_iter
\tffffffff81db4b8b tun_get_user
\tffffffff81db5f37 tun_chr_write_iter
\tffffffff816b9856 ksys_write
\t           f838f __GI___libc_write

 9972     250000 
\t    7f0000001234 __memmove_avx512_unaligned_erms

 9972     500000 
\tffffffff81e407de skb_release_data
\tffffffff82034822 tcp_v4_rcv
\tffffffff81db50a8 tun_get_user
\tffffffff81db5f37 tun_chr_write_iter

 9972     250000 
\tffffffff81b6a460 _copy_to_iter
\tffffffff8200aaaa tcp_recvmsg_locked
\tffffffff8200bbbb __x64_sys_recvfrom
";

    #[test]
    fn samples_land_in_their_path_by_call_chain() {
        let (n, buckets) = tally(SCRIPT);
        assert_eq!(n, 5);
        let get = |name: &str| {
            buckets
                .iter()
                .find(|b| b.name == name)
                .map(|b| (b.share, b.copy_share))
        };
        // Five samples, one of them twice the period: sixths.
        let sixth = 1.0 / 6.0;
        let near = |got: Option<(f64, f64)>, share: f64, copy: f64| {
            got.is_some_and(|(s, c)| (s - share).abs() < 1e-9 && (c - copy).abs() < 1e-9)
        };
        assert!(near(get(RELAY_SPLICE_OUT), sixth, 0.0));
        assert!(
            near(get(TUN_WRITE), sixth, sixth),
            "a copy inside tun_get_user"
        );
        assert!(
            near(get(TUN_WRITE_RX), 2.0 * sixth, 0.0),
            "weighted by period"
        );
        assert!(near(get(USER_MEMCPY), sixth, sixth));
        assert!(near(get(RELAY_RECV), sixth, sixth));
        assert_eq!(buckets[0].name, TUN_WRITE_RX, "largest first");
        let total: f64 = buckets.iter().map(|b| b.share).sum();
        assert!((total - 1.0).abs() < 1e-9);
        let p = CpuProfile {
            scenario: "x".into(),
            streams: 1,
            direction: Direction::Upload,
            samples: n,
            cpu_s_per_gb: None,
            buckets,
            error: None,
        };
        let (tun, tun_copy) = p.path_share(Path::Tun);
        assert!((tun - 0.5).abs() < 1e-9 && (tun_copy - sixth).abs() < 1e-9);
        let (relay, relay_copy) = p.path_share(Path::Relay);
        assert!((relay - 2.0 * sixth).abs() < 1e-9 && (relay_copy - sixth).abs() < 1e-9);
    }

    #[test]
    fn splice_in_interrupts_and_garbage() {
        let k = |s| (true, s);
        assert_eq!(
            classify(&[k("tcp_splice_read"), k("do_splice"), k("__x64_sys_splice")]).0,
            RELAY_SPLICE_IN
        );
        assert_eq!(
            classify(&[k("handle_softirqs"), k("sysvec_apic_timer_interrupt")]).0,
            INTERRUPT
        );
        assert_eq!(
            classify(&[k("ep_poll"), k("do_epoll_wait"), k("__x64_sys_epoll_wait")]).0,
            WAIT
        );
        assert_eq!(classify(&[]).0, USER_OTHER);
        // Not perf output: nothing counted, no panic.
        let (n, b) = tally("garbage\n\nmore garbage here\n\t\n");
        assert_eq!(n, 0);
        assert!(b.is_empty());
    }
}
