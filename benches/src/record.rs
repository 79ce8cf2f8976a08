//! What one harness run measured, as JSON lines
//! (`docs/benchmarks/results.jsonl`): one object per line, tagged by `kind`.
//! The Markdown page and the chart are rendered from these records only, so
//! the page can be re-rendered from the data without re-running anything.

use serde::{Deserialize, Serialize};

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
    Profile(crate::profile::Profile),
    /// The phone profiles' run (`crate::phone`): its command and machine.
    PhoneMeta(crate::phone::PhoneMeta),
    /// One iperf3 run of a phone profile.
    Phone(crate::phone::PhoneRun),
    /// The echo check of a phone profile (`scenario` is the profile id).
    PhoneIntegrity(Integrity),
    /// The phone profiles' UDP run (`crate::phone_udp`): its command and machine.
    PhoneUdpMeta(crate::phone_udp::PhoneUdpMeta),
    /// One iperf3 UDP run of a phone profile.
    PhoneUdp(crate::phone_udp::PhoneUdpRun),
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Client (client namespace, through the TUN) sends to the server.
    Upload,
    /// `iperf3 -R`: the server sends to the client.
    Download,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Upload => "upload",
            Direction::Download => "download",
        }
    }
}

/// One iperf3 run through one scenario (a fresh engine per run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    pub scenario: String,
    pub streams: u32,
    pub direction: Direction,
    /// `None` when the run failed (see `error`).
    pub gbit_per_s: Option<f64>,
    pub bytes: u64,
    pub secs: f64,
    pub retransmits: Option<u64>,
    /// Engine CPU (user + system) during the run, seconds.
    pub engine_cpu_s: Option<f64>,
    /// Engine CPU seconds per 10^9 payload bytes moved.
    pub cpu_s_per_gb: Option<f64>,
    /// Engine VmRSS right after the run and VmHWM (peak since its start), KiB.
    pub rss_kib: Option<u64>,
    pub hwm_kib: Option<u64>,
    /// TUN device counters over the run (the device lives as long as the engine).
    pub tun_tx_dropped: Option<u64>,
    pub tun_tx_packets: Option<u64>,
    /// Fraction of all cores busy during the run (everything on the machine).
    pub system_busy: f64,
    /// iperf3's own CPU figures (percent of one core), client and server.
    pub iperf_cpu_client: Option<f64>,
    pub iperf_cpu_server: Option<f64>,
    pub load1: Option<f64>,
    /// The engine's final statistics line (`kerntun run` prints it at exit).
    pub engine_stats: Option<serde_json::Value>,
    pub error: Option<String>,
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
        ];
        let text = to_lines(&recs);
        assert_eq!(text.lines().count(), 2);
        assert!(text.starts_with(r#"{"kind":"meta""#), "{text}");
        assert_eq!(parse_lines(&text).expect("parse"), recs);
        let err = parse_lines("\n{\"kind\":\"nope\"}\n").expect_err("unknown kind");
        assert!(err.starts_with("line 2:"), "{err}");
    }
}
