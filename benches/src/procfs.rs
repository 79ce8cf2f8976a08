//! The few kernel counters the harness samples before and after a run: a
//! process's CPU time, memory, system calls and context switches
//! (`/proc/<pid>`), the whole machine's CPU time and load average, a
//! namespace's TCP retransmissions (`/proc/net/snmp`) and a device's packet
//! counters (`ip -s -j link`). Reading them is the harness's job; parsing
//! them is here, unit-tested.

use std::collections::BTreeMap;
use std::io;

use serde::{Deserialize, Serialize};

/// CPU time of one process (all its threads), in clock ticks.
pub fn process_ticks(pid: u32) -> io::Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat_ticks(&text)
        .ok_or_else(|| io::Error::other(format!("/proc/{pid}/stat: unexpected format")))
}

/// utime + stime from a `/proc/<pid>/stat` line. The command name (field 2)
/// may contain spaces and parentheses, so fields are counted after the last
/// `)`: state is field 3, utime field 14, stime field 15 (proc(5)).
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state), so field N is rest[N - 3].
    let utime: u64 = fields.get(14 - 3)?.parse().ok()?;
    let stime: u64 = fields.get(15 - 3)?.parse().ok()?;
    Some(utime + stime)
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`, 100 on every Linux ABI
/// the harness runs on; the fallback is only for a failed call).
pub fn ticks_per_second() -> f64 {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        Ok(Some(t)) if t > 0 => t as f64,
        _ => 100.0,
    }
}

/// Resident memory of a process, in KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mem {
    /// Current resident set (VmRSS).
    pub rss_kib: u64,
    /// Peak resident set since the process started (VmHWM).
    pub hwm_kib: u64,
    /// The anonymous part of VmRSS (heap, stacks): VmRSS without the mapped
    /// binary and libraries, whose pages come in as code paths first run.
    pub anon_kib: u64,
}

pub fn process_mem(pid: u32) -> io::Result<Mem> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    parse_status_mem(&text)
        .ok_or_else(|| io::Error::other(format!("/proc/{pid}/status: no VmRSS/VmHWM")))
}

pub fn parse_status_mem(status: &str) -> Option<Mem> {
    Some(Mem {
        rss_kib: field_after(status, "VmRSS:")?,
        hwm_kib: field_after(status, "VmHWM:")?,
        anon_kib: field_after(status, "RssAnon:").unwrap_or(0),
    })
}

/// Busy and total jiffies of all CPUs together, from the `cpu` line of
/// `/proc/stat`. Busy excludes idle and iowait.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SystemCpu {
    pub busy: u64,
    pub total: u64,
}

impl SystemCpu {
    pub fn read() -> io::Result<SystemCpu> {
        let text = std::fs::read_to_string("/proc/stat")?;
        parse_system_cpu(&text).ok_or_else(|| io::Error::other("/proc/stat: no cpu line"))
    }

    /// Fraction of all cores that was busy between `earlier` and `self`.
    pub fn busy_since(&self, earlier: &SystemCpu) -> f64 {
        let total = self.total.saturating_sub(earlier.total);
        if total == 0 {
            return 0.0;
        }
        self.busy.saturating_sub(earlier.busy) as f64 / total as f64
    }
}

pub fn parse_system_cpu(stat: &str) -> Option<SystemCpu> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice]; guest
    // time is already included in user, so only the first eight are summed.
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some(SystemCpu {
        busy: total.saturating_sub(idle),
        total,
    })
}

/// The 1-minute load average.
pub fn load1() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
}

/// The engine's counts from `/proc` over a run: read-family and
/// write-family system calls on any descriptor (`/proc/<pid>/io` `syscr`,
/// `syscw`; splice, recv and send are not among them), and context
/// switches summed over its threads (`/proc/<pid>/task/*/status`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcCounts {
    pub read_calls: u64,
    pub write_calls: u64,
    pub voluntary_switches: u64,
    pub involuntary_switches: u64,
}

/// A reading of those counters; two readings give a [`ProcCounts`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcSample {
    pub syscr: u64,
    pub syscw: u64,
    /// Per thread id: (voluntary, involuntary) context switches.
    pub threads: BTreeMap<u32, (u64, u64)>,
}

impl ProcSample {
    /// Read the counters of process `pid` and its threads.
    pub fn read(pid: u32) -> io::Result<ProcSample> {
        let io = std::fs::read_to_string(format!("/proc/{pid}/io"))?;
        let (syscr, syscw) = parse_io(&io)
            .ok_or_else(|| io::Error::other(format!("/proc/{pid}/io: no syscr/syscw")))?;
        let mut threads = BTreeMap::new();
        for e in std::fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
            let Some(tid) = e.file_name().to_str().and_then(|t| t.parse().ok()) else {
                continue;
            };
            // A thread that ended since the listing has no status: skip it.
            if let Ok(s) = std::fs::read_to_string(e.path().join("status"))
                && let Some(c) = parse_switches(&s)
            {
                threads.insert(tid, c);
            }
        }
        Ok(ProcSample {
            syscr,
            syscw,
            threads,
        })
    }

    /// What happened between `earlier` and `self`. A thread that started
    /// in between counts from zero; one that ended in between is lost
    /// (the engine's threads live as long as it does).
    pub fn since(&self, earlier: &ProcSample) -> ProcCounts {
        let (mut vol, mut invol) = (0, 0);
        for (tid, &(v, i)) in &self.threads {
            let (v0, i0) = earlier.threads.get(tid).copied().unwrap_or((0, 0));
            vol += v.saturating_sub(v0);
            invol += i.saturating_sub(i0);
        }
        ProcCounts {
            read_calls: self.syscr.saturating_sub(earlier.syscr),
            write_calls: self.syscw.saturating_sub(earlier.syscw),
            voluntary_switches: vol,
            involuntary_switches: invol,
        }
    }
}

/// The number after `name` on the first line that starts with it, its unit
/// (`VmRSS:  7060 kB`) left off.
pub fn field_after(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    line[name.len()..].split_whitespace().next()?.parse().ok()
}

/// `syscr` and `syscw` of a `/proc/<pid>/io` file.
pub fn parse_io(text: &str) -> Option<(u64, u64)> {
    Some((field_after(text, "syscr:")?, field_after(text, "syscw:")?))
}

/// (voluntary, involuntary) context switches of a `/proc/<pid>/status` file.
pub fn parse_switches(status: &str) -> Option<(u64, u64)> {
    Some((
        field_after(status, "voluntary_ctxt_switches:")?,
        field_after(status, "nonvoluntary_ctxt_switches:")?,
    ))
}

/// One counter of `/proc/net/snmp` (a header line `Tcp: Name...` followed by
/// a value line `Tcp: 1 2...`), e.g. (`Tcp`, `RetransSegs`).
pub fn parse_snmp(text: &str, proto: &str, name: &str) -> Option<u64> {
    let prefix = format!("{proto}:");
    let mut lines = text.lines().filter(|l| l.starts_with(&prefix));
    let names = lines.next()?;
    let values = lines.next()?;
    let at = names.split_whitespace().position(|n| n == name)?;
    values.split_whitespace().nth(at)?.parse().ok()
}

/// A network device's counters and transmit queue length.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkCounts {
    pub tx_packets: u64,
    pub tx_dropped: u64,
    pub rx_packets: u64,
    pub txqlen: Option<u32>,
}

impl LinkCounts {
    /// What happened between `earlier` and `self` (the queue length is
    /// `self`'s).
    pub fn since(&self, earlier: &LinkCounts) -> LinkCounts {
        LinkCounts {
            tx_packets: self.tx_packets.saturating_sub(earlier.tx_packets),
            tx_dropped: self.tx_dropped.saturating_sub(earlier.tx_dropped),
            rx_packets: self.rx_packets.saturating_sub(earlier.rx_packets),
            txqlen: self.txqlen,
        }
    }
}

/// The counters of the one device in `ip -s -j link show dev <name>`.
pub fn parse_link(json: &str) -> Option<LinkCounts> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let dev = v.get(0)?;
    let stats = dev.get("stats64")?;
    let n = |dir: &str, k: &str| stats.get(dir)?.get(k)?.as_u64();
    Some(LinkCounts {
        tx_packets: n("tx", "packets")?,
        tx_dropped: n("tx", "dropped")?,
        rx_packets: n("rx", "packets")?,
        txqlen: dev
            .get("txqlen")
            .and_then(serde_json::Value::as_u64)
            .and_then(|q| u32::try_from(q).ok()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_survive_odd_command_names() {
        // Fields 14 and 15 are 266 and 1731; the name has spaces and a ')'.
        let line = "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 1041 0 0 0 266 1731 0 0 20 0 4 0 \
                    123 12345678 1765 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(parse_stat_ticks(line), Some(1997));
        assert_eq!(parse_stat_ticks("12 (x) S 1 2"), None, "truncated line");
        assert_eq!(parse_stat_ticks("no parenthesis"), None);
    }

    #[test]
    fn status_mem() {
        let s = "Name:\tkerntun\nVmPeak:\t  100 kB\nVmHWM:\t   10940 kB\nVmRSS:\t    7060 kB\n\
                 RssAnon:\t    2048 kB\nRssFile:\t    5012 kB\n";
        assert_eq!(
            parse_status_mem(s),
            Some(Mem {
                rss_kib: 7060,
                hwm_kib: 10940,
                anon_kib: 2048,
            })
        );
        assert_eq!(parse_status_mem("Name:\tzombie\n"), None);
    }

    #[test]
    fn system_cpu_busy_fraction() {
        let a =
            parse_system_cpu("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3 4\n").expect("cpu line");
        assert_eq!(
            a,
            SystemCpu {
                busy: 200,
                total: 1000
            }
        );
        let b = parse_system_cpu("cpu  250 0 250 800 100 0 0 0 50 0\n").expect("cpu line");
        // 300 more busy of 400 more total; guest (50) is not counted twice.
        assert!(
            (b.busy_since(&a) - 0.75).abs() < 1e-9,
            "{}",
            b.busy_since(&a)
        );
        assert_eq!(a.busy_since(&a), 0.0);
    }

    #[test]
    fn proc_counters_parse_and_subtract_per_thread() {
        let io = "rchar: 10\nwchar: 20\nsyscr: 1234\nsyscw: 567\nread_bytes: 0\n";
        assert_eq!(parse_io(io), Some((1234, 567)));
        assert_eq!(parse_io("rchar: 1\n"), None);
        let st = "Name:\tkerntun\nvoluntary_ctxt_switches:\t812\nnonvoluntary_ctxt_switches:\t9\n";
        assert_eq!(parse_switches(st), Some((812, 9)));
        let a = ProcSample {
            syscr: 100,
            syscw: 50,
            threads: BTreeMap::from([(1, (10, 1)), (2, (20, 2)), (3, (5, 5))]),
        };
        // Thread 3 ended (lost), thread 4 started (counts from zero).
        let b = ProcSample {
            syscr: 160,
            syscw: 80,
            threads: BTreeMap::from([(1, (15, 1)), (2, (40, 4)), (4, (7, 1))]),
        };
        assert_eq!(
            b.since(&a),
            ProcCounts {
                read_calls: 60,
                write_calls: 30,
                voluntary_switches: 5 + 20 + 7,
                involuntary_switches: 2 + 1,
            }
        );
    }

    #[test]
    fn snmp_counters_are_found_by_name() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
                    Tcp: RtoAlgorithm RtoMin OutSegs RetransSegs InErrs\n\
                    Tcp: 1 200 4000 17 0\n\
                    Udp: InDatagrams NoPorts\nUdp: 5 6\n";
        assert_eq!(parse_snmp(snmp, "Tcp", "RetransSegs"), Some(17));
        assert_eq!(parse_snmp(snmp, "Udp", "NoPorts"), Some(6));
        assert_eq!(parse_snmp(snmp, "Tcp", "Nope"), None);
        assert_eq!(parse_snmp("Tcp: RetransSegs\n", "Tcp", "RetransSegs"), None);
    }

    #[test]
    fn link_counters_from_ip_json_and_their_difference() {
        // Trimmed from `ip -s -j link show dev kt0` (iproute2 6.1).
        let json = r#"[{"ifindex":5,"ifname":"kt0","mtu":1500,"txqlen":500,
            "stats64":{"rx":{"bytes":900,"packets":12,"errors":0,"dropped":0},
                       "tx":{"bytes":800,"packets":10,"errors":0,"dropped":3}}}]"#;
        let b = parse_link(json).expect("counters");
        assert_eq!(
            b,
            LinkCounts {
                tx_packets: 10,
                tx_dropped: 3,
                rx_packets: 12,
                txqlen: Some(500),
            }
        );
        let a = LinkCounts {
            tx_packets: 4,
            tx_dropped: 1,
            rx_packets: 2,
            txqlen: Some(500),
        };
        assert_eq!(
            b.since(&a),
            LinkCounts {
                tx_packets: 6,
                tx_dropped: 2,
                rx_packets: 10,
                txqlen: Some(500),
            }
        );
        assert_eq!(parse_link("[]"), None);
        assert_eq!(parse_link("not json"), None);
    }
}
