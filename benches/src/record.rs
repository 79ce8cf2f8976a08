//! What one harness run measured, as JSON lines
//! (`docs/benchmarks/results.jsonl`): one object per line, tagged by `kind`.
//! The Markdown page and the chart are rendered from these records only, so
//! the page can be re-rendered from the data without re-running anything.
//!
//! Every iperf3 run, whatever its profile (a desktop scenario, a phone
//! profile over TCP or UDP), carries the same [`Run`]: the figures the
//! harness's one runner samples around it. Each kind adds only what its
//! profile has of its own. Fields added after records were first written
//! default when missing, so older `results.jsonl` files stay readable.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::cpu_profile::CpuProfile;
pub use crate::iperf::Direction;
use crate::procfs::ProcCounts;
use crate::syscalls::Syscalls;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    Meta(Meta),
    Scenario(ScenarioInfo),
    Throughput(Throughput),
    Integrity(Integrity),
    Scale(Scale),
    Criterion(CriterionFigure),
    /// Where the engine's CPU went during one sampled run (`perf record`).
    Profile(CpuProfile),
    /// A phone run (`crate::phone`): its command, machine and topologies.
    PhoneMeta(PhoneMeta),
    /// One iperf3 run of a phone profile.
    Phone(PhoneRun),
    /// The echo check of a phone profile (`scenario` is the profile id).
    PhoneIntegrity(Integrity),
    /// The phone profiles' UDP run: its command and machine.
    PhoneUdpMeta(PhoneUdpMeta),
    /// One iperf3 UDP run of a phone profile.
    PhoneUdp(PhoneUdpRun),
}

/// The machine and the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// UTC start time, RFC 3339.
    pub date: String,
    /// The command that produced this data, as typed.
    pub command: String,
    pub cpu_model: String,
    pub cores: usize,
    pub mem_gib: f64,
    pub kernel: String,
    /// True when /proc/cpuinfo carries the `hypervisor` flag.
    pub virtualized: bool,
    pub iperf3: String,
    /// `git describe --always --dirty` of the tree that was built.
    pub git_rev: String,
    /// Seconds per iperf3 run.
    pub duration_s: u64,
    pub mtu: u16,
    /// Bytes of the integrity transfer in each scenario.
    pub integrity_bytes: u64,
    /// 1-minute load average at the start and the end of the run.
    pub load_start: Option<f64>,
    pub load_end: Option<f64>,
    /// Load average before and after the criterion benches (`None` when skipped).
    pub criterion_load: Option<(f64, f64)>,
    /// Why the criterion benches produced no figures, when they failed (the
    /// netns measurements still run).
    pub criterion_error: Option<String>,
    /// Wall time of the criterion benches, seconds.
    pub criterion_s: Option<f64>,
    /// RLIMIT_NOFILE of the harness and its children (engine included).
    pub nofile: u64,
    /// Idle-connection steps asked for; the steps measured are in the
    /// `scale` records (capped when the descriptor limit cannot hold them).
    pub requested_connections: Vec<u32>,
    /// Wall time of the whole run (including criterion), seconds.
    pub wall_s: f64,
}

/// A scenario, and whether this build can run it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioInfo {
    pub id: String,
    pub label: String,
    /// `none` for the no-TUN baseline.
    pub stack: String,
    pub driver: String,
    pub outbound: String,
    /// `None` where the relay's default is used.
    pub splice: Option<bool>,
    pub available: bool,
    /// Why it is not available (the engine's own words), or a note.
    pub reason: Option<String>,
}

/// What the runner measured around one iperf3 run, whatever the profile:
/// a fresh engine per run (none for a baseline), so every counter belongs
/// to that run alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Run {
    pub streams: u32,
    pub direction: Direction,
    /// At the receiver; `None` when the run failed (see `error`).
    pub gbit_per_s: Option<f64>,
    /// Payload bytes that reached the receiver, and its duration.
    pub bytes: u64,
    pub secs: f64,
    /// iperf3's TCP retransmits of the sending side of its own connection.
    pub retransmits: Option<u64>,
    /// TCP segments retransmitted in the engine's namespace over the run
    /// (`TcpRetransSegs` of its `/proc/net/snmp`): every socket there, the
    /// engine's own and, where the client runs next to it, the client's.
    #[serde(default)]
    pub tcp_retrans_segs: Option<u64>,
    /// Engine CPU (user + system) during the run, seconds, and per 10^9
    /// payload bytes received.
    pub engine_cpu_s: Option<f64>,
    pub cpu_s_per_gb: Option<f64>,
    /// Engine VmRSS right after the run and VmHWM (peak since its start), KiB.
    #[serde(default)]
    pub rss_kib: Option<u64>,
    pub hwm_kib: Option<u64>,
    /// The TUN device's counters over the run (`ip -s link`): packets the
    /// kernel sent into it (for the engine to read) and dropped because its
    /// queue was full, and packets the engine wrote.
    pub tun_tx_dropped: Option<u64>,
    #[serde(default)]
    pub tun_tx_packets: Option<u64>,
    #[serde(default)]
    pub tun_rx_packets: Option<u64>,
    /// The TUN's transmit queue length as the device had it.
    #[serde(default)]
    pub tun_txqueuelen: Option<u32>,
    /// The engine's system calls and context switches from `/proc`.
    #[serde(default)]
    pub proc_counts: Option<ProcCounts>,
    /// Fraction of all cores busy during the run (everything on the machine).
    #[serde(default)]
    pub system_busy: Option<f64>,
    pub load1: Option<f64>,
    /// The engine's final statistics line (`kerntun run` prints it at exit).
    pub engine_stats: Option<Value>,
    pub error: Option<String>,
    /// A run of an earlier engine of a before/after comparison
    /// (`--phone-before`), named by its label; `None` for the engine under
    /// test.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
}

impl Run {
    /// A run not measured yet.
    pub fn new(streams: u32, direction: Direction) -> Run {
        Run {
            streams,
            direction,
            gbit_per_s: None,
            bytes: 0,
            secs: 0.0,
            retransmits: None,
            tcp_retrans_segs: None,
            engine_cpu_s: None,
            cpu_s_per_gb: None,
            rss_kib: None,
            hwm_kib: None,
            tun_tx_dropped: None,
            tun_tx_packets: None,
            tun_rx_packets: None,
            tun_txqueuelen: None,
            proc_counts: None,
            system_busy: None,
            load1: None,
            engine_stats: None,
            error: None,
            engine: None,
        }
    }

    /// Measured, with no error.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// A counter of the engine's final statistics line.
    pub fn stat(&self, key: &str) -> Option<u64> {
        self.engine_stats.as_ref()?.get(key)?.as_u64()
    }

    /// A count per 10^9 payload bytes received.
    pub fn per_gb(&self, n: u64) -> Option<f64> {
        (self.bytes > 0).then(|| n as f64 / (self.bytes as f64 / 1e9))
    }

    /// Voluntary context switches of the engine's threads per GB: each is a
    /// thread going to sleep, to be woken by the next event.
    pub fn wakeups_per_gb(&self) -> Option<f64> {
        self.per_gb(self.proc_counts.as_ref()?.voluntary_switches)
    }

    /// Bytes the engine counted under `keys` (its relay counters) against
    /// the bytes the receiver got: far below 1, the traffic did not go
    /// through the engine.
    pub fn relayed_share(&self, keys: &[&str]) -> Option<f64> {
        let relayed = keys.iter().map(|k| self.stat(k)).sum::<Option<u64>>()?;
        ratio(relayed, self.bytes)
    }

    /// Packets the TUN carried over the run, both ways.
    pub fn tun_packets(&self) -> Option<u64> {
        Some(self.tun_tx_packets? + self.tun_rx_packets?)
    }

    /// TX drops over all packets the TUN carried.
    pub fn tun_drop_share(&self) -> Option<f64> {
        ratio(self.tun_tx_dropped.unwrap_or(0), self.tun_packets()?)
    }
}

/// `n` over `of`, or `None` when there is nothing to divide by.
fn ratio(n: u64, of: u64) -> Option<f64> {
    (of > 0).then(|| n as f64 / of as f64)
}

/// One iperf3 run through one desktop scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    pub scenario: String,
    #[serde(flatten)]
    pub run: Run,
    /// iperf3's own CPU figures (percent of one core), client and server.
    pub iperf_cpu_client: Option<f64>,
    pub iperf_cpu_server: Option<f64>,
}

impl Throughput {
    /// Share of relayed TCP bytes that went through splice, when the engine
    /// reports both counters and relayed anything.
    pub fn spliced_share(&self) -> Option<f64> {
        let spliced = self.run.stat("tcp_bytes_spliced")?;
        let copied = self.run.stat("tcp_bytes_copied")?;
        ratio(spliced, spliced + copied)
    }
}

/// Where a phone profile's client sits and how its traffic reaches the TUN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Topo {
    /// In its own namespace, forwarded by the engine's namespace into the TUN.
    Router,
    /// In the engine's namespace, its route to the server through the TUN.
    Local,
    /// The phone's own TUN: in the engine's namespace as an app's uid,
    /// routed into the TUN by a uid rule, the TUN at Android's transmit
    /// queue length.
    Android,
}

impl Topo {
    pub fn as_str(self) -> &'static str {
        match self {
            Topo::Router => "router",
            Topo::Local => "local",
            Topo::Android => "android",
        }
    }
}

impl std::str::FromStr for Topo {
    type Err = String;

    fn from_str(s: &str) -> Result<Topo, String> {
        match s {
            "router" => Ok(Topo::Router),
            "local" => Ok(Topo::Local),
            "android" => Ok(Topo::Android),
            _ => Err(format!("unknown topology {s:?} (android, router, local)")),
        }
    }
}

/// Which phone profile a run measured.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhoneShape {
    /// `router-1500-per-packet`, `android-4064-baseline`,
    /// `router-1500-per-packet-udp`...
    pub profile: String,
    pub topology: Topo,
    /// MTU of the TUN and of every link on the way.
    pub mtu: u16,
    /// `None` for the no-TUN baseline.
    pub driver: Option<String>,
}

/// One iperf3 TCP run of a phone profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhoneRun {
    #[serde(flatten)]
    pub shape: PhoneShape,
    /// A run of the `perf stat` pass (system calls counted by kind), not
    /// one of the measured runs.
    pub counted: bool,
    /// The engine's system calls by kind (`perf stat`), counted runs only.
    pub syscalls: Option<Syscalls>,
    #[serde(flatten)]
    pub run: Run,
}

impl PhoneRun {
    /// TUN writes per IP packet read from the TUN (the engine's counters):
    /// below 1 where written-back segments were merged.
    pub fn writes_per_read(&self) -> Option<f64> {
        let read = self.run.stat("tun_read_packets")?;
        ratio(self.run.stat("tun_writes").unwrap_or(0), read)
    }

    /// IP packets read from the TUN per read system call on it.
    pub fn packets_per_read(&self) -> Option<f64> {
        let calls = self.syscalls.as_ref()?.tun_read;
        ratio(self.run.stat("tun_read_packets").unwrap_or(0), calls)
    }

    /// IP packets the engine handed to the TUN per write system call on it
    /// (the batch driver's writes carry coalesced segments).
    pub fn packets_per_write(&self) -> Option<f64> {
        let calls = self.syscalls.as_ref()?.tun_write;
        ratio(self.run.stat("tun_writes").unwrap_or(0), calls)
    }

    /// The same two from `/proc` (read- and write-family calls on any
    /// descriptor), for the measured runs: (per read, per write).
    pub fn packets_per_call_proc(&self) -> Option<(f64, f64)> {
        let c = self.run.proc_counts.as_ref()?;
        Some((
            ratio(self.run.stat("tun_read_packets")?, c.read_calls)?,
            ratio(self.run.stat("tun_writes")?, c.write_calls)?,
        ))
    }

    /// How far `/proc`'s read and write calls were from perf's counts on the
    /// TUN descriptor (the larger of the two relative differences), in a
    /// counted run.
    pub fn proc_vs_perf(&self) -> Option<f64> {
        let (c, s) = (self.run.proc_counts.as_ref()?, self.syscalls.as_ref()?);
        let diff = |a: u64, b: u64| ratio(a.abs_diff(b), b);
        Some(diff(c.read_calls, s.tun_read)?.max(diff(c.write_calls, s.tun_write)?))
    }
}

/// One iperf3 UDP run of a phone profile (`-u -b 0 -l <datagram>`); the
/// run's bytes are the receiver's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhoneUdpRun {
    #[serde(flatten)]
    pub shape: PhoneShape,
    /// Payload bytes per datagram.
    pub datagram: u32,
    /// Payload bytes sent.
    pub sent_bytes: u64,
    /// iperf3's lost datagrams and the datagrams it accounted for.
    pub lost_packets: u64,
    pub packets: u64,
    #[serde(flatten)]
    pub run: Run,
}

impl PhoneUdpRun {
    /// Lost over all datagrams, as iperf3's receiver counted them.
    pub fn loss(&self) -> Option<f64> {
        ratio(self.lost_packets, self.packets)
    }

    /// What the sender offered, Gbit/s.
    pub fn offered_gbit_per_s(&self) -> Option<f64> {
        (self.run.secs > 0.0).then(|| self.sent_bytes as f64 * 8.0 / self.run.secs / 1e9)
    }

    /// IP packets per TUN read and per TUN write call: the engine's
    /// counters over the read- and write-family calls of `/proc/<pid>/io`
    /// (UDP sockets' recvmsg/sendmsg are not among them). Packets written
    /// are the driver's write-backs plus the reply datagrams.
    pub fn packets_per_call(&self) -> Option<(f64, f64)> {
        let r = &self.run;
        let c = r.proc_counts.as_ref()?;
        let written = r.stat("tun_writes")? + r.stat("udp_packets_down")?;
        Some((
            ratio(r.stat("tun_read_packets")?, c.read_calls)?,
            ratio(written, c.write_calls)?,
        ))
    }
}

/// A phone run's command and machine figures, and what it measured: a
/// phone run replaces the records of the topologies it lists and keeps
/// every other record of `results.jsonl`.
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

/// The UDP run's command and machine figures (`--phone-udp-only` runs it
/// alone and keeps every other record).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PhoneUdpMeta {
    pub run: Meta,
    pub topology: Option<Topo>,
    pub mtus: Vec<u16>,
    pub drivers: Vec<String>,
    pub streams: Vec<u32>,
    /// Payload bytes per datagram.
    pub datagram: u32,
}

/// A byte-for-byte checked echo transfer through a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Integrity {
    pub scenario: String,
    pub bytes: u64,
    pub ok: bool,
    pub secs: f64,
    pub error: Option<String>,
}

/// Engine memory with `connections` idle TCP connections held through it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scale {
    pub scenario: String,
    pub connections: u32,
    /// Connections the holder could not open or check.
    pub failed: u32,
    /// Each connection carried a one-byte ping and its answer before going
    /// idle (so the relay ran once for it); false with `--no-ping`.
    pub pinged: bool,
    /// Sessions the engine itself reported active at the measurement.
    pub engine_sessions: Option<u64>,
    /// VmRSS of the idle engine before the first connection, KiB.
    pub idle_rss_kib: u64,
    pub rss_kib: u64,
    pub hwm_kib: u64,
    /// (rss - idle) / connections, bytes.
    pub per_conn_bytes: f64,
    /// The same over anonymous memory only (RssAnon: heap and stacks, no
    /// binary pages), KiB and bytes per connection.
    pub idle_anon_kib: u64,
    pub anon_kib: u64,
    pub per_conn_anon_bytes: f64,
    /// Open descriptors of the engine at this step and when idle, and the
    /// difference per held connection (2 sockets, plus pipes while a spliced
    /// relay keeps them).
    pub engine_fds: Option<u64>,
    pub idle_fds: Option<u64>,
    pub fds_per_conn: Option<f64>,
    /// Time to open and ping this step's new connections, seconds.
    pub open_secs: f64,
    pub error: Option<String>,
}

/// One criterion bench: mean time per iteration and its 95 % interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CriterionFigure {
    pub id: String,
    pub mean_ns: f64,
    pub low_ns: f64,
    pub high_ns: f64,
    /// Packets (or flows) per iteration, when the bench declares it.
    pub elements: Option<u64>,
}

/// Parse a JSON-lines file, naming the line of the first bad record.
pub fn parse_lines(text: &str) -> Result<Vec<Record>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("line {}: {e}", i + 1)))
        .collect()
}

/// Render records as JSON lines.
pub fn to_lines(records: &[Record]) -> String {
    let mut out = String::new();
    for r in records {
        // Serialising these plain structs cannot fail (no maps with non-string keys).
        if let Ok(line) = serde_json::to_string(r) {
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_round_trip() {
        let recs = vec![
            Record::Meta(Meta {
                cores: 2,
                criterion_load: Some((0.5, 1.0)),
                ..Meta::default()
            }),
            Record::Integrity(Integrity {
                scenario: "system-batch".into(),
                bytes: 1 << 28,
                ok: true,
                secs: 1.5,
                error: None,
            }),
            Record::Phone(PhoneRun {
                shape: PhoneShape {
                    profile: "android-4064-per-packet".into(),
                    topology: Topo::Android,
                    mtu: 4064,
                    driver: Some("per-packet".into()),
                },
                counted: false,
                syscalls: None,
                run: Run {
                    tun_tx_dropped: Some(7),
                    tun_txqueuelen: Some(500),
                    tcp_retrans_segs: Some(40),
                    ..Run::new(16, Direction::Download)
                },
            }),
        ];
        let text = to_lines(&recs);
        assert_eq!(text.lines().count(), 3);
        assert!(text.starts_with(r#"{"kind":"meta""#), "{text}");
        // The shared fields sit at the top level of each line, beside the
        // kind's own.
        assert!(
            text.contains(r#""profile":"android-4064-per-packet","topology":"android""#),
            "{text}"
        );
        assert!(
            text.contains(r#""streams":16,"direction":"download""#),
            "{text}"
        );
        assert_eq!(parse_lines(&text).expect("parse"), recs);
        let err = parse_lines("\n{\"kind\":\"nope\"}\n").expect_err("unknown kind");
        assert!(err.starts_with("line 2:"), "{err}");
    }

    /// Lines written before the shared run record existed (the fields each
    /// kind had then, nothing more) still parse, the new fields empty.
    #[test]
    fn records_of_earlier_runs_stay_readable() {
        let throughput = r#"{"kind":"throughput","scenario":"system-batch","streams":1,"direction":"upload","gbit_per_s":8.32,"bytes":5200000000,"secs":5.0,"retransmits":0,"engine_cpu_s":3.6,"cpu_s_per_gb":0.692,"rss_kib":7600,"hwm_kib":7600,"tun_tx_dropped":0,"tun_tx_packets":91000,"system_busy":0.89,"iperf_cpu_client":40.1,"iperf_cpu_server":50.2,"load1":5.4,"engine_stats":{"tun_read_max_batch":2},"error":null}"#;
        let phone = r#"{"kind":"phone","profile":"router-1500-per-packet","topology":"router","mtu":1500,"driver":"per-packet","streams":16,"direction":"upload","counted":false,"gbit_per_s":2.84,"bytes":1775000000,"secs":5.0,"retransmits":12,"engine_cpu_s":6.5,"cpu_s_per_gb":3.68,"hwm_kib":5400,"tun_tx_dropped":0,"proc_counts":{"read_calls":1,"write_calls":2,"voluntary_switches":3,"involuntary_switches":4},"syscalls":null,"engine_stats":null,"load1":2.0,"error":null,"engine":"24b3908"}"#;
        let udp = r#"{"kind":"phone_udp","profile":"router-1500-per-packet@24b3908-udp","topology":"router","mtu":1500,"driver":"per-packet@24b3908","streams":1,"direction":"download","datagram":1200,"gbit_per_s":0.53,"bytes":331000000,"sent_bytes":1225000000,"secs":5.0,"lost_packets":748000,"packets":1024000,"engine_cpu_s":3.4,"cpu_s_per_gb":10.29,"hwm_kib":null,"tun_tx_dropped":0,"proc_counts":null,"engine_stats":null,"load1":1.5,"error":null}"#;
        let recs = parse_lines(&[throughput, phone, udp].join("\n")).expect("old lines");
        let Record::Throughput(t) = &recs[0] else {
            panic!("{:?}", recs[0])
        };
        assert_eq!(t.run.system_busy, Some(0.89));
        assert_eq!(t.run.tun_tx_packets, Some(91000));
        assert_eq!(t.run.tun_rx_packets, None);
        assert_eq!(t.iperf_cpu_server, Some(50.2));
        let Record::Phone(p) = &recs[1] else {
            panic!("{:?}", recs[1])
        };
        assert_eq!(p.shape.topology, Topo::Router);
        assert_eq!(p.run.engine.as_deref(), Some("24b3908"));
        assert_eq!(p.run.proc_counts.map(|c| c.involuntary_switches), Some(4));
        assert_eq!((p.run.rss_kib, p.run.tcp_retrans_segs), (None, None));
        let Record::PhoneUdp(u) = &recs[2] else {
            panic!("{:?}", recs[2])
        };
        assert_eq!(u.shape.driver.as_deref(), Some("per-packet@24b3908"));
        assert_eq!((u.lost_packets, u.run.retransmits), (748_000, None));
    }

    #[test]
    fn drops_are_a_share_of_what_the_tun_carried() {
        let mut r = Run::new(1, Direction::Upload);
        assert_eq!(r.tun_drop_share(), None, "not measured");
        r.tun_tx_packets = Some(900);
        r.tun_rx_packets = Some(100);
        r.tun_tx_dropped = Some(50);
        assert_eq!(r.tun_packets(), Some(1000));
        assert_eq!(r.tun_drop_share(), Some(0.05));
        r.bytes = 2_000_000_000;
        r.engine_stats = Some(serde_json::json!({"tcp_bytes_up": 1_000_000_000u64}));
        assert_eq!(r.relayed_share(&["tcp_bytes_up"]), Some(0.5));
        assert_eq!(r.relayed_share(&["tcp_bytes_up", "tcp_bytes_down"]), None);
        assert_eq!(r.per_gb(10), Some(5.0));
        assert_eq!("android".parse::<Topo>(), Ok(Topo::Android));
        assert!("phone".parse::<Topo>().is_err());
    }
}
