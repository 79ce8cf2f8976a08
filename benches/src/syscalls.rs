//! The engine's system calls by kind, counted by `perf stat` tracepoints
//! attached to it during a run of its own (tracepoints cost time per call,
//! so these runs are kept apart from the measured ones): every call, the
//! reads and writes on the TUN descriptor, splice and epoll waits.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The engine's system calls by kind over a counted run (`perf stat`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Syscalls {
    /// Every system call.
    pub all: u64,
    /// read/readv and write/writev on the TUN descriptor (EAGAIN included).
    pub tun_read: u64,
    pub tun_write: u64,
    pub splice: u64,
    /// epoll_wait and epoll_pwait.
    pub epoll_wait: u64,
}

const ALL: &str = "raw_syscalls:sys_enter";
const TUN_READ: [&str; 2] = ["syscalls:sys_enter_read", "syscalls:sys_enter_readv"];
const TUN_WRITE: [&str; 2] = ["syscalls:sys_enter_write", "syscalls:sys_enter_writev"];
const SPLICE: &str = "syscalls:sys_enter_splice";
const EPOLL: [&str; 2] = [
    "syscalls:sys_enter_epoll_wait",
    "syscalls:sys_enter_epoll_pwait",
];

/// The `perf stat` event arguments: every system call, the TUN's reads and
/// writes (a tracepoint filter on the descriptor numbers `tun_fds`), splice
/// and epoll waits.
pub fn perf_events(tun_fds: &[i32]) -> Vec<String> {
    let filter = tun_fds
        .iter()
        .map(|f| format!("fd == {f}"))
        .collect::<Vec<_>>()
        .join(" || ");
    let mut a = vec!["-e".to_string(), ALL.to_string()];
    for ev in TUN_READ.iter().chain(TUN_WRITE.iter()) {
        a.extend(["-e".into(), (*ev).into(), "--filter".into(), filter.clone()]);
    }
    for ev in std::iter::once(&SPLICE).chain(EPOLL.iter()) {
        a.extend(["-e".into(), (*ev).into()]);
    }
    a
}

/// Parse `perf stat -x,` output (`value,unit,event,...` per line). Every
/// event of [`perf_events`] must be there with a count.
pub fn parse_perf_stat(csv: &str) -> Result<Syscalls, String> {
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    for line in csv.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        let (Some(value), Some(event)) = (f.first(), f.get(2)) else {
            continue;
        };
        let Ok(n) = value.trim().parse::<u64>() else {
            return Err(format!("perf stat: {event}: {value}"));
        };
        *counts.entry(event.trim()).or_default() += n;
    }
    let get = |ev: &str| {
        counts
            .get(ev)
            .copied()
            .ok_or_else(|| format!("perf stat: no count for {ev}"))
    };
    let sum = |evs: &[&str]| evs.iter().map(|e| get(e)).sum::<Result<u64, String>>();
    Ok(Syscalls {
        all: get(ALL)?,
        tun_read: sum(&TUN_READ[..])?,
        tun_write: sum(&TUN_WRITE[..])?,
        splice: get(SPLICE)?,
        epoll_wait: sum(&EPOLL[..])?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_stat_csv_sums_the_kinds_and_refuses_missing_counts() {
        let args = perf_events(&[9, 12]).join(" ");
        assert!(
            args.starts_with("-e raw_syscalls:sys_enter -e syscalls:sys_enter_read --filter fd == 9 || fd == 12 -e"),
            "{args}"
        );
        assert_eq!(args.matches("--filter").count(), 4, "{args}");
        let csv = "# started on Tue Dec  1 10:00:00 2026\n\n\
                   2000000,,raw_syscalls:sys_enter,5001,100.00,,\n\
                   700000,,syscalls:sys_enter_read,5001,100.00,,\n\
                   0,,syscalls:sys_enter_readv,5001,100.00,,\n\
                   650000,,syscalls:sys_enter_write,5001,100.00,,\n\
                   10,,syscalls:sys_enter_writev,5001,100.00,,\n\
                   30000,,syscalls:sys_enter_splice,5001,100.00,,\n\
                   4000,,syscalls:sys_enter_epoll_wait,5001,100.00,,\n\
                   1,,syscalls:sys_enter_epoll_pwait,5001,100.00,,\n";
        assert_eq!(
            parse_perf_stat(csv),
            Ok(Syscalls {
                all: 2_000_000,
                tun_read: 700_000,
                tun_write: 650_010,
                splice: 30_000,
                epoll_wait: 4001,
            })
        );
        let bad = csv.replace(
            "30000,,syscalls:sys_enter_splice",
            "<not counted>,,syscalls:sys_enter_splice",
        );
        assert!(
            parse_perf_stat(&bad)
                .expect_err("not counted")
                .contains("splice")
        );
        let short: String = csv.lines().take(3).map(|l| format!("{l}\n")).collect();
        assert!(
            parse_perf_stat(&short)
                .expect_err("missing")
                .contains("no count")
        );
    }
}
