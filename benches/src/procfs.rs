//! The few `/proc` figures the harness needs: a process's CPU time and
//! memory, the whole machine's CPU time, and the load average.

use std::io;

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
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].split_whitespace().next()?.parse().ok()
    };
    Some(Mem {
        rss_kib: field("VmRSS:")?,
        hwm_kib: field("VmHWM:")?,
        anon_kib: field("RssAnon:").unwrap_or(0),
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
}
