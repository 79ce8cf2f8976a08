//! The phone profiles: what the engine sees on a phone, measured side by
//! side in one run. A phone's VpnService descriptor has no offload, so one
//! read and one write move one packet; its apps send segments of the TUN's
//! MTU (1500, up to about 9000). Each profile is a topology, an MTU for
//! every link and the TUN, and a driver:
//!
//! * **router**: the client sits in a namespace of its own, routed over a
//!   veth into the engine's namespace, which forwards it into the TUN
//!   (`kerntun_testkit::router`); **local**: the client runs next to the
//!   engine, routed into the TUN (the topology of the desktop scenarios);
//! * **per-packet** (the TUN opened without `IFF_VNET_HDR`, as Android's
//!   descriptor is) and **batch** (virtio-net offload) drivers, system
//!   stack, direct outbound, splice on; and the no-TUN **baseline** of the
//!   same topology and MTU.
//!
//! Every run records the engine's CPU, its final statistics and its
//! system-call and context-switch counts from `/proc` (free: nothing is
//! attached to the engine). A second, shorter pass counts the engine's
//! system calls by kind with `perf stat` tracepoints, which cost time per
//! call, so its runs are kept apart from the measured ones.
//!
//! This module holds the profile list, the records, the parsing of `/proc`
//! and `perf stat` output and the page section; the harness
//! (`src/bin/netbench/phone.rs`) runs them.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use kerntun_testkit::router::{APP_TABLE, GATEWAY_VETH};

use crate::record::{Direction, Integrity, Meta, Record};

/// Where the client sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Topo {
    /// In its own namespace, forwarded by the engine's namespace into the TUN.
    Router,
    /// In the engine's namespace, routed into the TUN.
    Local,
}

impl Topo {
    pub fn as_str(self) -> &'static str {
        match self {
            Topo::Router => "router",
            Topo::Local => "local",
        }
    }
}

impl std::str::FromStr for Topo {
    type Err = String;

    fn from_str(s: &str) -> Result<Topo, String> {
        match s {
            "router" => Ok(Topo::Router),
            "local" => Ok(Topo::Local),
            _ => Err(format!("unknown topology {s:?} (router, local)")),
        }
    }
}

/// The engine side of the profiles: (driver, the scenario of
/// [`crate::scenario::SCENARIOS`] that runs it).
pub const DRIVERS: [(&str, &str); 2] = [
    ("per-packet", "system-per-packet"),
    ("batch", "system-batch"),
];

/// One phone profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhoneProfile {
    pub topo: Topo,
    /// MTU of the TUN and of every veth on the way.
    pub mtu: u16,
    /// `None` for the no-TUN baseline.
    pub driver: Option<&'static str>,
}

impl PhoneProfile {
    /// `router-1500-per-packet`, `local-9000-baseline`, ...
    pub fn id(&self) -> String {
        format!(
            "{}-{}-{}",
            self.topo.as_str(),
            self.mtu,
            self.driver.unwrap_or("baseline")
        )
    }

    /// The engine scenario (`None` for the baseline).
    pub fn scenario(&self) -> Option<&'static crate::scenario::Scenario> {
        let driver = self.driver?;
        if driver == SMOLTCP_DRIVER {
            return Some(&SMOLTCP_PER_PACKET);
        }
        let (_, id) = DRIVERS.iter().find(|(d, _)| *d == driver)?;
        crate::scenario::SCENARIOS.iter().find(|s| s.id == *id)
    }
}

/// Every profile, grouped by topology and MTU, baseline first in each group.
pub fn profiles(topos: &[Topo], mtus: &[u16]) -> Vec<PhoneProfile> {
    let mut out = Vec::new();
    for &topo in topos {
        for &mtu in mtus {
            out.push(PhoneProfile {
                topo,
                mtu,
                driver: None,
            });
            for (driver, _) in DRIVERS {
                out.push(PhoneProfile {
                    topo,
                    mtu,
                    driver: Some(driver),
                });
            }
        }
    }
    // Last in the list; the harness runs each group's profiles together.
    for &topo in topos {
        out.extend(mtus.iter().filter_map(|&mtu| smoltcp_profile(topo, mtu)));
    }
    out
}

// ---------------------------------------------------------------------------
// The smoltcp stack on the Android path.

/// The driver name of the smoltcp profile in the records and the page.
pub const SMOLTCP_DRIVER: &str = "smoltcp-per-packet";

/// The smoltcp stack behind the per-packet driver (the stack iOS uses where
/// the kernel listener cannot work), direct outbound. Not in
/// [`crate::scenario::SCENARIOS`]: only the phone profiles run it.
pub const SMOLTCP_PER_PACKET: crate::scenario::Scenario = crate::scenario::Scenario {
    id: "smoltcp-per-packet",
    label: "smoltcp stack, per-packet driver, direct",
    stack: "smoltcp",
    driver: "per-packet",
    outbound: crate::scenario::Outbound::Direct,
    splice: None,
    config: Some("stack = \"smoltcp\"\n"),
    scale: false,
};

/// The smoltcp profile of a group: router topology at MTU 1500 only (the
/// path the per-packet targets are about).
fn smoltcp_profile(topo: Topo, mtu: u16) -> Option<PhoneProfile> {
    (topo == Topo::Router && mtu == 1500).then_some(PhoneProfile {
        topo,
        mtu,
        driver: Some(SMOLTCP_DRIVER),
    })
}

/// Keep the profiles whose driver is in `drivers` (`per-packet`, `batch`,
/// `smoltcp-per-packet`), and every baseline; empty `drivers` keeps all.
pub fn only_drivers(profiles: Vec<PhoneProfile>, drivers: &[String]) -> Vec<PhoneProfile> {
    if drivers.is_empty() {
        return profiles;
    }
    profiles
        .into_iter()
        .filter(|p| p.driver.is_none_or(|d| drivers.iter().any(|x| x == d)))
        .collect()
}

// ---------------------------------------------------------------------------
// Records.

/// The phone run: its own command and machine figures, because `--phone`
/// runs it alone and keeps the other records of `results.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PhoneMeta {
    /// Date, command, machine, load average, seconds per run, wall time.
    pub run: Meta,
    pub topologies: Vec<Topo>,
    pub mtus: Vec<u16>,
    /// Streams of the `perf stat` pass.
    pub syscall_streams: Vec<u32>,
    /// Why system calls were not counted by kind, when they were not.
    pub syscalls_error: Option<String>,
}

/// One iperf3 run of one phone profile (a fresh engine per run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhoneRun {
    /// [`PhoneProfile::id`].
    pub profile: String,
    pub topology: Topo,
    pub mtu: u16,
    /// `None` for the baseline.
    pub driver: Option<String>,
    pub streams: u32,
    pub direction: Direction,
    /// A run of the `perf stat` pass (system calls counted by kind), not
    /// one of the measured runs.
    pub counted: bool,
    /// `None` when the run failed.
    pub gbit_per_s: Option<f64>,
    pub bytes: u64,
    pub secs: f64,
    pub retransmits: Option<u64>,
    pub engine_cpu_s: Option<f64>,
    pub cpu_s_per_gb: Option<f64>,
    /// Engine VmHWM (peak RSS since its start), KiB.
    pub hwm_kib: Option<u64>,
    pub tun_tx_dropped: Option<u64>,
    /// The engine's system calls and context switches from `/proc` over the run.
    pub proc_counts: Option<ProcCounts>,
    /// The engine's system calls by kind (`perf stat`), counted runs only.
    pub syscalls: Option<Syscalls>,
    /// The engine's final statistics line.
    pub engine_stats: Option<serde_json::Value>,
    pub load1: Option<f64>,
    pub error: Option<String>,
    /// A run of the earlier engine of the before/after comparison
    /// (`--phone-before`), named by its label; `None` for the engine under
    /// test.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
}

impl PhoneRun {
    fn stat(&self, key: &str) -> Option<u64> {
        self.engine_stats.as_ref()?.get(key)?.as_u64()
    }

    /// A count per 10^9 payload bytes moved.
    fn per_gb(&self, n: u64) -> Option<f64> {
        (self.bytes > 0).then(|| n as f64 / (self.bytes as f64 / 1e9))
    }

    /// TUN writes per IP packet read from the TUN (the engine's counters):
    /// below 1 where written-back segments were merged.
    pub fn writes_per_read(&self) -> Option<f64> {
        let read = self.stat("tun_read_packets")?;
        (read > 0).then(|| self.stat("tun_writes").unwrap_or(0) as f64 / read as f64)
    }

    /// IP packets read from the TUN per read system call on it.
    pub fn packets_per_read(&self) -> Option<f64> {
        let calls = self.syscalls.as_ref()?.tun_read;
        (calls > 0).then(|| self.stat("tun_read_packets").unwrap_or(0) as f64 / calls as f64)
    }

    /// IP packets the engine handed to the TUN per write system call on it
    /// (the batch driver's writes carry coalesced segments).
    pub fn packets_per_write(&self) -> Option<f64> {
        let calls = self.syscalls.as_ref()?.tun_write;
        (calls > 0).then(|| self.stat("tun_writes").unwrap_or(0) as f64 / calls as f64)
    }

    /// The same two from `/proc` (read- and write-family calls on any
    /// descriptor), for the measured runs: (per read, per write).
    pub fn packets_per_call_proc(&self) -> Option<(f64, f64)> {
        let c = self.proc_counts.as_ref()?;
        let per = |packets: u64, calls: u64| (calls > 0).then(|| packets as f64 / calls as f64);
        Some((
            per(self.stat("tun_read_packets")?, c.read_calls)?,
            per(self.stat("tun_writes")?, c.write_calls)?,
        ))
    }

    /// How far `/proc`'s read and write calls were from perf's counts on the
    /// TUN descriptor (the larger of the two relative differences), in a
    /// counted run.
    pub fn proc_vs_perf(&self) -> Option<f64> {
        let (c, s) = (self.proc_counts.as_ref()?, self.syscalls.as_ref()?);
        let diff = |a: u64, b: u64| (b > 0).then(|| a.abs_diff(b) as f64 / b as f64);
        Some(diff(c.read_calls, s.tun_read)?.max(diff(c.write_calls, s.tun_write)?))
    }

    /// Voluntary context switches of the engine's threads per GB: each is a
    /// thread going to sleep, to be woken by the next event.
    pub fn wakeups_per_gb(&self) -> Option<f64> {
        self.per_gb(self.proc_counts.as_ref()?.voluntary_switches)
    }

    /// Relayed TCP bytes the engine counted against the bytes iperf3 moved:
    /// far below 1 means the traffic did not go through the engine.
    pub fn relayed_share(&self) -> Option<f64> {
        let relayed = self.stat("tcp_bytes_up")? + self.stat("tcp_bytes_down")?;
        (self.bytes > 0).then(|| relayed as f64 / self.bytes as f64)
    }
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
    pub fn read(pid: u32) -> std::io::Result<ProcSample> {
        let io = std::fs::read_to_string(format!("/proc/{pid}/io"))?;
        let (syscr, syscw) = parse_io(&io)
            .ok_or_else(|| std::io::Error::other(format!("/proc/{pid}/io: no syscr/syscw")))?;
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

/// `syscr` and `syscw` of a `/proc/<pid>/io` file.
pub fn parse_io(text: &str) -> Option<(u64, u64)> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].trim().parse().ok()
    };
    Some((field("syscr:")?, field("syscw:")?))
}

/// (voluntary, involuntary) context switches of a `/proc/<pid>/status` file.
pub fn parse_switches(status: &str) -> Option<(u64, u64)> {
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].trim().parse().ok()
    };
    Some((
        field("voluntary_ctxt_switches:")?,
        field("nonvoluntary_ctxt_switches:")?,
    ))
}

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

/// Records a phone run writes (the UDP part's included).
pub fn is_phone(r: &Record) -> bool {
    matches!(
        r,
        Record::PhoneMeta(_) | Record::Phone(_) | Record::PhoneIntegrity(_)
    ) || crate::phone_udp::is_udp(r)
}

/// What `--phone` does to `results.jsonl`: drop the phone records of
/// `data`, keep every other record (the last full run's), append the
/// phone records of `fresh`.
pub fn replace(data: &mut Vec<Record>, fresh: &[Record]) {
    data.retain(|r| !is_phone(r));
    data.extend(fresh.iter().filter(|r| is_phone(r)).cloned());
}

// ---------------------------------------------------------------------------
// The page section.

struct View<'a> {
    meta: Option<&'a PhoneMeta>,
    runs: Vec<&'a PhoneRun>,
    /// Runs of the earlier engine (`PhoneRun::engine`), kept apart.
    before: Vec<&'a PhoneRun>,
    integrity: Vec<&'a Integrity>,
}

/// (topology, MTU, driver) of a profile as the records carry it.
type Key<'a> = (Topo, u16, Option<&'a str>);

impl<'a> View<'a> {
    fn new(records: &'a [Record]) -> Self {
        let mut v = View {
            meta: None,
            runs: Vec::new(),
            before: Vec::new(),
            integrity: Vec::new(),
        };
        for r in records {
            match r {
                Record::PhoneMeta(m) => v.meta = Some(m),
                Record::Phone(x) if x.engine.is_some() => v.before.push(x),
                Record::Phone(x) => v.runs.push(x),
                Record::PhoneIntegrity(i) => v.integrity.push(i),
                _ => {}
            }
        }
        v
    }

    /// Profiles in the order they were measured (topology, MTU, baseline first).
    fn keys(&self) -> Vec<Key<'a>> {
        let mut out: Vec<Key<'a>> = Vec::new();
        for r in self.runs.iter().copied() {
            let k = (r.topology, r.mtu, r.driver.as_deref());
            if !out.contains(&k) {
                out.push(k);
            }
        }
        out
    }

    fn streams(&self) -> Vec<u32> {
        let mut s: Vec<u32> = self
            .runs
            .iter()
            .filter(|r| !r.counted)
            .map(|r| r.streams)
            .collect();
        s.sort_unstable();
        s.dedup();
        s
    }

    fn measured(&self, k: Key, streams: u32, dir: Direction) -> Option<&'a PhoneRun> {
        self.runs.iter().copied().find(|r| {
            !r.counted
                && (r.topology, r.mtu, r.driver.as_deref()) == k
                && r.streams == streams
                && r.direction == dir
                && r.error.is_none()
        })
    }

    fn gbit(&self, k: Key, streams: u32, dir: Direction) -> Option<f64> {
        self.measured(k, streams, dir)?.gbit_per_s
    }

    /// Throughput as a fraction of the same topology and MTU's baseline.
    fn fraction(&self, k: Key, streams: u32, dir: Direction) -> Option<f64> {
        let g = self.gbit(k, streams, dir)?;
        let b = self.gbit((k.0, k.1, None), streams, dir)?;
        (b > 0.0).then_some(g / b)
    }
}

fn percent(x: Option<f64>) -> String {
    x.map_or("–".into(), |f| format!("{:.0} %", 100.0 * f))
}

/// A count per GB, short: 712k, 1.24M.
fn count(x: Option<f64>) -> String {
    match x {
        None => "–".into(),
        Some(n) if n >= 1e6 => format!("{:.2}M", n / 1e6),
        Some(n) if n >= 1e4 => format!("{:.0}k", n / 1e3),
        Some(n) if n >= 1e3 => format!("{:.1}k", n / 1e3),
        Some(n) => format!("{n:.0}"),
    }
}

fn driver_name(d: Option<&str>) -> &str {
    d.unwrap_or("none (baseline)")
}

/// The Android path the targets are about: router, MTU 1500, per-packet.
const TARGET_KEY: Key<'static> = (Topo::Router, 1500, Some("per-packet"));

/// Summary lines for the top of the page: the Android path's fractions and CPU.
pub fn summary(records: &[Record]) -> Vec<String> {
    let v = View::new(records);
    let streams = v.streams();
    let mut out = Vec::new();
    for k in v
        .keys()
        .into_iter()
        .filter(|k| k.0 == Topo::Router && k.2.is_some())
    {
        if k.1 != 1500 {
            continue;
        }
        let mut parts = Vec::new();
        for dir in [Direction::Upload, Direction::Download] {
            let f: Vec<String> = streams
                .iter()
                .map(|&s| percent(v.fraction(k, s, dir)))
                .collect();
            parts.push(format!("{} {}", dir.as_str(), f.join(" / ")));
        }
        let cpu: Vec<f64> = v
            .runs
            .iter()
            .filter(|r| !r.counted && r.error.is_none())
            .filter(|r| (r.topology, r.mtu, r.driver.as_deref()) == k)
            .filter_map(|r| r.cpu_s_per_gb)
            .collect();
        let cpu = if cpu.is_empty() {
            String::new()
        } else {
            let lo = cpu.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = cpu.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("; engine {lo:.2}–{hi:.2} CPU s/GB")
        };
        out.push(format!(
            "- Phone profile, router topology, MTU 1500, {} driver: {} of the same topology's \
             no-TUN baseline at {} streams{cpu} (\"Phone profiles\").",
            driver_name(k.2),
            parts.join(", "),
            streams
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(" / "),
        ));
    }
    out
}

/// The "Phone profiles" section, or nothing when the records have none.
pub fn section(records: &[Record]) -> String {
    let v = View::new(records);
    let mut p = String::new();
    let udp = crate::phone_udp::section(records);
    if v.runs.is_empty() && v.meta.is_none() {
        if !udp.is_empty() {
            let _ = writeln!(p, "## Phone profiles\n\n{udp}");
        }
        return p;
    }
    let _ = writeln!(p, "## Phone profiles\n");
    if let Some(m) = v.meta {
        let r = &m.run;
        let _ = writeln!(
            p,
            "Measured by:\n\n```sh\n{}\n```\n\n{}, kerntun `{}`, {} cores, iperf3 {} s per \
             run, a fresh engine per run; load average (1 min) {} at the start and {} at the end; \
             {:.0} s.\n",
            r.command,
            r.date,
            r.git_rev,
            r.cores,
            r.duration_s,
            r.load_start.map_or("–".into(), |l| format!("{l:.2}")),
            r.load_end.map_or("–".into(), |l| format!("{l:.2}")),
            r.wall_s,
        );
    }
    let _ = writeln!(
        p,
        "What the engine sees on a phone: Android's VpnService descriptor has no offload (one \
         packet per read and per write), and apps send segments of the TUN's MTU. Every \
         profile sets one MTU on the TUN and on every veth. **router**: the iperf3 client runs \
         in an app namespace routed over a veth into the engine's namespace, which forwards \
         (`ip_forward`) and sends what arrives from that veth into the TUN (a policy rule, \
         `ip rule add iif {GATEWAY_VETH} lookup {APP_TABLE}`, `kerntun_testkit::router`); the \
         TUN sees MTU-sized packets built by another kernel's TCP. **local**: the client runs in the engine's namespace, its route to the \
         server through the TUN. **per-packet**: the TUN without `IFF_VNET_HDR`, as Android's; \
         **batch**: virtio-net offload (Linux only), for comparison. Both: system stack, \
         direct outbound, splice on. **baseline**: the same namespaces and MTU with no engine \
         (router: the engine's namespace forwards straight to the server).\n"
    );
    if v.keys().iter().any(|k| k.2 == Some(SMOLTCP_DRIVER)) {
        let _ = writeln!(
            p,
            "**{SMOLTCP_DRIVER}**: the per-packet driver with the smoltcp stack (the userspace \
             TCP iOS uses where the kernel listener cannot work), direct outbound, router \
             topology at MTU 1500 only.\n"
        );
    }
    let streams = v.streams();
    let joined = |f: &dyn Fn(u32) -> String| {
        streams
            .iter()
            .map(|&s| f(s))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    let stream_list = joined(&|s| s.to_string());
    let agree = v
        .runs
        .iter()
        .filter(|r| r.counted && r.error.is_none())
        .filter_map(|r| r.proc_vs_perf())
        .reduce(f64::max);
    let _ = writeln!(p, "### Throughput and engine cost\n");
    let _ = writeln!(
        p,
        "At {stream_list} streams: iperf3 Gbit/s at the receiver; the fraction of the baseline of \
         the same topology and MTU; the engine's CPU (user + system) per 10^9 payload bytes; \
         its wake-ups per GB, the voluntary context switches of its threads (each one a \
         thread that went to sleep and was woken again; `/proc/<pid>/task/*/status`); and the \
         IP packets it read from the TUN per read call and handed to it per write call (its \
         counters `tun_read_packets` and `tun_writes` over the read- and write-family calls in \
         `/proc/<pid>/io`, which count every descriptor{}). Upload: client to server; download: \
         `iperf3 -R`.\n",
        match agree {
            Some(x) => format!(
                ": in the counted runs below they were within {:.1} % of perf's counts on the \
                 TUN descriptor alone",
                100.0 * x
            ),
            None => String::new(),
        }
    );
    let _ = writeln!(
        p,
        "| topology | MTU | driver | direction | Gbit/s | of baseline | engine CPU s/GB | wake-ups per GB | TUN packets per read | TUN packets per write |\n\
         |---|---:|---|---|---:|---:|---:|---:|---:|---:|"
    );
    for k in v.keys() {
        for dir in [Direction::Upload, Direction::Download] {
            let cell = |f: &dyn Fn(&PhoneRun) -> Option<String>| {
                joined(&|s| match v.measured(k, s, dir) {
                    Some(r) => f(r).unwrap_or_else(|| "–".into()),
                    None if v.runs.iter().any(|r| {
                        (r.topology, r.mtu, r.driver.as_deref()) == k
                            && r.streams == s
                            && r.direction == dir
                            && !r.counted
                    }) =>
                    {
                        "failed".into()
                    }
                    None => "–".into(),
                })
            };
            let engine = k.2.is_some();
            let _ = writeln!(
                p,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                k.0.as_str(),
                k.1,
                driver_name(k.2),
                dir.as_str(),
                cell(&|r| r.gbit_per_s.map(|g| format!("{g:.2}"))),
                if engine {
                    joined(&|s| percent(v.fraction(k, s, dir)))
                } else {
                    "–".into()
                },
                if engine {
                    cell(&|r| r.cpu_s_per_gb.map(|c| format!("{c:.2}")))
                } else {
                    "–".into()
                },
                if engine {
                    cell(&|r| Some(count(r.wakeups_per_gb())))
                } else {
                    "–".into()
                },
                if engine {
                    cell(&|r| r.packets_per_call_proc().map(|(x, _)| format!("{x:.2}")))
                } else {
                    "–".into()
                },
                if engine {
                    cell(&|r| r.packets_per_call_proc().map(|(_, y)| format!("{y:.2}")))
                } else {
                    "–".into()
                },
            );
        }
    }
    let _ = writeln!(p);
    let failed: Vec<&&PhoneRun> = v.runs.iter().filter(|r| r.error.is_some()).collect();
    if !failed.is_empty() {
        let _ = writeln!(p, "Failed runs (no number is shown for them):\n");
        for r in failed {
            let _ = writeln!(
                p,
                "- `{}` {} streams {}{}: {}",
                r.profile,
                r.streams,
                r.direction.as_str(),
                if r.counted { " (counted run)" } else { "" },
                r.error.as_deref().unwrap_or("").replace('\n', " ")
            );
        }
        let _ = writeln!(p);
    }
    before_after(&mut p, &v);
    syscalls(&mut p, &v);
    targets(&mut p, &v);
    p.push_str(&udp);
    if !v.integrity.is_empty() {
        let _ = writeln!(p, "### Integrity\n");
        let _ = writeln!(
            p,
            "One TCP connection per engine profile, from the profile's client, echoed and checked \
             byte for byte, FIN and the answer after it included \
             (`kerntun_testkit::client::echo_transfer`).\n"
        );
        crate::report::integrity_table(&mut p, "profile", &v.integrity);
    }
    p
}

/// The earlier engine's runs beside the current one's, profile by
/// profile: fraction of the baseline, engine CPU per GB, TUN packets per
/// write call (each pair from consecutive runs, same streams and direction).
fn before_after(p: &mut String, v: &View) {
    let Some(label) = v.before.first().and_then(|r| r.engine.clone()) else {
        return;
    };
    let streams = v.streams();
    let _ = writeln!(p, "### Before and after\n");
    let _ = writeln!(
        p,
        "The engine at `{label}` (before) ran right after each run of the engine under test \
         (after), same profile, streams and direction, so each pair met the same load; both \
         against the same baseline run. At {} streams, before → after. TUN writes per packet \
         read: below 1 where segments were merged before they were written back \
         (`packet::coalesce`) or, on smoltcp, where its ACKs were held to one per flow and \
         drain; above 1 on smoltcp downloads, whose data segments smoltcp builds from the \
         outbound socket (never read from the TUN).\n",
        streams
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" / ")
    );
    let _ = writeln!(
        p,
        "| topology | MTU | driver | direction | of baseline | engine CPU s/GB | TUN writes per packet read |\n\
         |---|---:|---|---|---|---|---|"
    );
    let before = |k: Key, s: u32, dir: Direction| {
        v.before.iter().copied().find(|r| {
            (r.topology, r.mtu, r.driver.as_deref()) == k
                && r.streams == s
                && r.direction == dir
                && r.error.is_none()
        })
    };
    let pair = |a: Option<String>, b: Option<String>| {
        format!(
            "{} → {}",
            a.unwrap_or_else(|| "–".into()),
            b.unwrap_or_else(|| "–".into())
        )
    };
    for k in v.keys().into_iter().filter(|k| k.2.is_some()) {
        if !streams.iter().any(|&s| {
            before(k, s, Direction::Upload).is_some() || before(k, s, Direction::Download).is_some()
        }) {
            continue;
        }
        for dir in [Direction::Upload, Direction::Download] {
            let cells = |f: &dyn Fn(&PhoneRun, Option<f64>) -> Option<String>| {
                streams
                    .iter()
                    .map(|&s| {
                        let base = v.gbit((k.0, k.1, None), s, dir);
                        pair(
                            before(k, s, dir).and_then(|r| f(r, base)),
                            v.measured(k, s, dir).and_then(|r| f(r, base)),
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(" / ")
            };
            let _ = writeln!(
                p,
                "| {} | {} | {} | {} | {} | {} | {} |",
                k.0.as_str(),
                k.1,
                driver_name(k.2),
                dir.as_str(),
                cells(&|r, base| {
                    let (g, b) = (r.gbit_per_s?, base?);
                    (b > 0.0).then(|| percent(Some(g / b)))
                }),
                cells(&|r, _| r.cpu_s_per_gb.map(|c| format!("{c:.2}"))),
                cells(&|r, _| r.writes_per_read().map(|x| format!("{x:.2}"))),
            );
        }
    }
    let _ = writeln!(p);
}

fn syscalls(p: &mut String, v: &View) {
    let _ = writeln!(p, "### System calls\n");
    let counted: Vec<&&PhoneRun> = v
        .runs
        .iter()
        .filter(|r| r.counted && r.error.is_none() && r.syscalls.is_some())
        .collect();
    if counted.is_empty() {
        let why = v
            .meta
            .and_then(|m| m.syscalls_error.clone())
            .unwrap_or_else(|| "no counted runs in this data".into());
        let _ = writeln!(p, "Not counted in this run: {}.\n", why.replace('\n', " "));
        return;
    }
    let _ = writeln!(
        p,
        "Separate runs (not the measured ones above: tracepoints cost time per call) with \
         `perf stat -p <engine pid>` counting the engine's system calls: \
         `raw_syscalls:sys_enter` (all), `read`/`readv` and `write`/`writev` with a filter on the \
         TUN's descriptor, `splice`, `epoll_wait`/`epoll_pwait`. Packets per call divide the \
         engine's own counters (`tun_read_packets`, and `tun_writes`, the packets it handed to \
         the device) by those calls; a read that found nothing (EAGAIN) is a call too. The \
         batch driver's writes carry segments coalesced again (GRO), so it shows more than one \
         packet per write. Wake-ups as above. Counts per 10^9 payload bytes.\n"
    );
    let _ = writeln!(
        p,
        "| topology | MTU | driver | streams | direction | TUN packets per read | TUN packets per write | TUN reads per GB | TUN writes per GB | splice per GB | epoll waits per GB | all system calls per GB | wake-ups per GB | CPU s/GB (counted run) |\n\
         |---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in counted {
        let Some(sc) = r.syscalls else { continue };
        let _ = writeln!(
            p,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.topology.as_str(),
            r.mtu,
            driver_name(r.driver.as_deref()),
            r.streams,
            r.direction.as_str(),
            r.packets_per_read()
                .map_or("–".into(), |x| format!("{x:.2}")),
            r.packets_per_write()
                .map_or("–".into(), |x| format!("{x:.2}")),
            count(r.per_gb(sc.tun_read)),
            count(r.per_gb(sc.tun_write)),
            count(r.per_gb(sc.splice)),
            count(r.per_gb(sc.epoll_wait)),
            count(r.per_gb(sc.all)),
            count(r.wakeups_per_gb()),
            r.cpu_s_per_gb.map_or("–".into(), |c| format!("{c:.2}")),
        );
    }
    let _ = writeln!(p);
}

/// The per-packet path's targets, checked against the router profile.
fn targets(p: &mut String, v: &View) {
    let want = [(1, 0.35), (16, 0.30), (64, 0.25)];
    let mut lines = Vec::new();
    for dir in [Direction::Upload, Direction::Download] {
        let got: Vec<String> = want
            .iter()
            .filter_map(|&(s, t)| {
                let f = v.fraction(TARGET_KEY, s, dir)?;
                Some(format!(
                    "{s} streams {} (≥ {:.0} %: {})",
                    percent(Some(f)),
                    100.0 * t,
                    if f >= t { "met" } else { "not met" }
                ))
            })
            .collect();
        if !got.is_empty() {
            lines.push(format!("- {}: {}.", dir.as_str(), got.join(", ")));
        }
    }
    let cpu: Vec<(u32, f64)> = v
        .runs
        .iter()
        .filter(|r| !r.counted && r.error.is_none())
        .filter(|r| (r.topology, r.mtu, r.driver.as_deref()) == TARGET_KEY)
        .filter_map(|r| Some((r.streams, r.cpu_s_per_gb?)))
        .collect();
    if let Some(hi) = cpu.iter().map(|c| c.1).reduce(f64::max) {
        lines.push(format!(
            "- engine CPU: at most {hi:.2} s/GB over {} runs (≤ 2.0: {}).",
            cpu.len(),
            if hi <= 2.0 { "met" } else { "not met" }
        ));
    }
    let jumbo = (Topo::Router, 9000, Some("per-packet"));
    let j: Vec<String> = [Direction::Upload, Direction::Download]
        .iter()
        .filter_map(|&d| {
            let f = v.fraction(jumbo, 1, d)?;
            Some(format!(
                "{} {} (≥ 50 %: {})",
                d.as_str(),
                percent(Some(f)),
                if f >= 0.5 { "met" } else { "not met" }
            ))
        })
        .collect();
    if !j.is_empty() {
        lines.push(format!("- MTU 9000, 1 stream: {}.", j.join(", ")));
    }
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(
        p,
        "### Targets\n\nThe per-packet path's targets, router topology, MTU 1500 unless said, \
         single runs:\n\n{}\n",
        lines.join("\n")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_group_by_topology_and_mtu_with_the_baseline_first() {
        let all = profiles(&[Topo::Router, Topo::Local], &[1500, 9000]);
        let ids: Vec<String> = all.iter().map(PhoneProfile::id).collect();
        assert_eq!(
            ids.len(),
            13,
            "12 system-stack profiles and the smoltcp one"
        );
        assert_eq!(
            ids[..4],
            [
                "router-1500-baseline",
                "router-1500-per-packet",
                "router-1500-batch",
                "router-9000-baseline"
            ]
        );
        assert_eq!(ids[11], "local-9000-batch");
        for p in &all {
            match p.driver {
                None => assert!(p.scenario().is_none()),
                Some(d) => {
                    let sc = p.scenario().expect("engine scenario");
                    assert_eq!(sc.driver, d.trim_start_matches("smoltcp-"));
                    assert_eq!(
                        sc.stack,
                        if d == SMOLTCP_DRIVER {
                            "smoltcp"
                        } else {
                            "system"
                        }
                    );
                }
            }
        }
        assert_eq!("local".parse::<Topo>(), Ok(Topo::Local));
        assert!("phone".parse::<Topo>().is_err());
    }

    #[test]
    fn the_smoltcp_profile_is_router_1500_and_can_run_alone() {
        let all = profiles(&[Topo::Router, Topo::Local], &[1500, 9000]);
        let smol: Vec<&PhoneProfile> = all
            .iter()
            .filter(|p| p.driver == Some(SMOLTCP_DRIVER))
            .collect();
        assert_eq!(smol.len(), 1);
        assert_eq!(smol[0].id(), "router-1500-smoltcp-per-packet");
        let sc = smol[0].scenario().expect("engine scenario");
        assert_eq!((sc.stack, sc.driver), ("smoltcp", "per-packet"));
        assert!(
            crate::scenario::SCENARIOS.iter().all(|s| s.id != sc.id),
            "a phone-only scenario"
        );
        let only = only_drivers(all.clone(), &[SMOLTCP_DRIVER.to_string()]);
        let ids: Vec<String> = only.iter().map(PhoneProfile::id).collect();
        assert_eq!(
            ids,
            [
                "router-1500-baseline",
                "router-9000-baseline",
                "local-1500-baseline",
                "local-9000-baseline",
                "router-1500-smoltcp-per-packet"
            ]
        );
        assert_eq!(only_drivers(all.clone(), &[]), all);
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

    fn run(
        topo: Topo,
        mtu: u16,
        driver: Option<&str>,
        streams: u32,
        dir: Direction,
        g: f64,
    ) -> PhoneRun {
        PhoneRun {
            profile: format!("{}-{mtu}-{}", topo.as_str(), driver.unwrap_or("baseline")),
            topology: topo,
            mtu,
            driver: driver.map(Into::into),
            streams,
            direction: dir,
            counted: false,
            gbit_per_s: Some(g),
            bytes: 2_000_000_000,
            secs: 5.0,
            retransmits: Some(0),
            engine_cpu_s: driver.map(|_| 3.0),
            cpu_s_per_gb: driver.map(|_| 1.5),
            hwm_kib: None,
            tun_tx_dropped: Some(0),
            proc_counts: driver.map(|_| ProcCounts {
                read_calls: 1_400_000,
                write_calls: 350_000,
                voluntary_switches: 300_000,
                ..ProcCounts::default()
            }),
            syscalls: None,
            engine_stats: driver.map(|_| {
                serde_json::json!({
                    "tun_read_packets": 1_400_000u64,
                    "tun_writes": 700_000u64,
                    "tcp_bytes_up": 2_000_000_000u64,
                    "tcp_bytes_down": 0u64,
                })
            }),
            load1: Some(1.0),
            error: None,
            engine: None,
        }
    }

    /// The earlier engine's runs are kept out of the main table and shown
    /// beside the current ones, each against the same baseline.
    #[test]
    fn before_runs_render_beside_the_current_ones() {
        let up = Direction::Upload;
        let mut old = run(Topo::Router, 1500, Some("per-packet"), 1, up, 1.0);
        old.engine = Some("24b3908".into());
        old.cpu_s_per_gb = Some(4.25);
        let records = vec![
            Record::Phone(run(Topo::Router, 1500, None, 1, up, 8.0)),
            Record::Phone(run(Topo::Router, 1500, Some("per-packet"), 1, up, 2.0)),
            Record::Phone(old),
        ];
        let page = section(&records);
        assert!(page.contains("### Before and after"), "{page}");
        assert!(page.contains("`24b3908`"), "{page}");
        assert!(
            page.contains(
                "| router | 1500 | per-packet | upload | 12 % → 25 % | 4.25 → 1.50 | 0.50 → 0.50 |"
            ),
            "{page}"
        );
        // One row per profile and direction in the main table: the earlier
        // engine's run is not among them.
        let main = page
            .split("### Before and after")
            .next()
            .expect("main part");
        assert_eq!(
            main.matches("| router | 1500 | per-packet | upload |")
                .count(),
            1
        );
        assert!(main.contains("| 2.00 | 25 % |"), "{main}");
        // Without earlier runs there is no such part.
        let page = section(&records[..2]);
        assert!(!page.contains("Before and after"), "{page}");
    }

    #[test]
    fn section_shows_fractions_cost_syscalls_and_targets() {
        let up = Direction::Upload;
        let mut counted = run(Topo::Router, 1500, Some("per-packet"), 16, up, 1.0);
        counted.counted = true;
        counted.cpu_s_per_gb = Some(1.9);
        counted.syscalls = Some(Syscalls {
            all: 5_000_000,
            tun_read: 1_400_000,
            tun_write: 700_000,
            splice: 40_000,
            epoll_wait: 9_000,
        });
        let mut failed = run(Topo::Router, 1500, Some("per-packet"), 16, up, 0.0);
        failed.gbit_per_s = None;
        failed.error = Some("iperf3: unable to connect".into());
        let records = vec![
            Record::PhoneMeta(PhoneMeta {
                run: Meta {
                    command: "bash scripts/bench.sh --phone".into(),
                    cores: 2,
                    duration_s: 5,
                    ..Meta::default()
                },
                ..PhoneMeta::default()
            }),
            Record::Phone(run(Topo::Router, 1500, None, 1, up, 8.0)),
            Record::Phone(run(Topo::Router, 1500, Some("per-packet"), 1, up, 2.0)),
            Record::Phone(run(Topo::Router, 1500, None, 16, up, 6.0)),
            Record::Phone(failed),
            Record::Phone(counted),
            Record::PhoneIntegrity(Integrity {
                scenario: "router-1500-per-packet".into(),
                bytes: 64 << 20,
                ok: true,
                secs: 1.0,
                error: None,
            }),
        ];
        let page = section(&records);
        assert!(
            page.contains("```sh\nbash scripts/bench.sh --phone\n```"),
            "{page}"
        );
        assert!(
            page.contains(
                "| router | 1500 | none (baseline) | upload | 8.00 / 6.00 | – | – | – | – | – |"
            ),
            "{page}"
        );
        // 2.0 of 8.0 at 1 stream; the 16-stream run failed.
        assert!(
            page.contains("| router | 1500 | per-packet | upload | 2.00 / failed | 25 % / – | 1.50 / failed | 150k / failed | 1.00 / failed | 2.00 / failed |"),
            "{page}"
        );
        // The counted run: /proc saw 350k writes where perf saw 700k on the TUN.
        assert!(page.contains("within 50.0 % of perf's counts"), "{page}");
        assert!(page.contains("iperf3: unable to connect"), "{page}");
        // 1.4M packets in 1.4M reads, 700k packets in 700k writes, per 2 GB.
        assert!(
            page.contains("| router | 1500 | per-packet | 16 | upload | 1.00 | 1.00 | 700k | 350k | 20k | 4.5k | 2.50M | 150k | 1.90 |"),
            "{page}"
        );
        assert!(page.contains("1 streams 25 % (≥ 35 %: not met)"), "{page}");
        assert!(
            page.contains("at most 1.50 s/GB over 1 runs (≤ 2.0: met)"),
            "{page}"
        );
        assert!(
            page.contains("| `router-1500-per-packet` | 64 MiB | identical |"),
            "{page}"
        );
        let lines = summary(&records);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("per-packet driver: upload 25 % / –, download – / –"),
            "{lines:?}"
        );
        assert!(lines[0].contains("engine 1.50–1.50 CPU s/GB"), "{lines:?}");
        // No phone records: no section (the rest of the page renders as before).
        assert_eq!(section(&records[..0]), "");
    }

    #[test]
    fn a_phone_run_replaces_only_the_phone_records() {
        let integrity = |id: &str| Integrity {
            scenario: id.into(),
            bytes: 1,
            ok: true,
            secs: 0.1,
            error: None,
        };
        let up = Direction::Upload;
        let mut data = vec![
            Record::Meta(Meta::default()),
            Record::PhoneMeta(PhoneMeta::default()),
            Record::Integrity(integrity("system-batch")),
            Record::Phone(run(Topo::Local, 1500, None, 1, up, 1.0)),
            Record::PhoneIntegrity(integrity("local-1500-batch")),
        ];
        let fresh = vec![
            Record::PhoneMeta(PhoneMeta {
                mtus: vec![9000],
                ..PhoneMeta::default()
            }),
            Record::Phone(run(Topo::Router, 9000, None, 1, up, 2.0)),
        ];
        replace(&mut data, &fresh);
        assert_eq!(
            data,
            vec![
                Record::Meta(Meta::default()),
                Record::Integrity(integrity("system-batch")),
                fresh[0].clone(),
                fresh[1].clone(),
            ]
        );
    }

    #[test]
    fn a_run_that_bypassed_the_engine_shows_in_its_relayed_share() {
        let mut r = run(Topo::Router, 1500, Some("batch"), 1, Direction::Upload, 5.0);
        assert_eq!(r.relayed_share(), Some(1.0));
        r.engine_stats = Some(serde_json::json!({"tcp_bytes_up": 1000u64, "tcp_bytes_down": 0u64}));
        assert!(r.relayed_share().is_some_and(|s| s < 0.01));
        assert_eq!(count(Some(999.4)), "999");
        assert_eq!(count(Some(4_500.0)), "4.5k");
        assert_eq!(count(Some(1_240_000.0)), "1.24M");
    }
}
