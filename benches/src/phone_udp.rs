//! The phone profiles' UDP part: QUIC-shaped traffic, 1200-byte datagrams
//! at full rate (`iperf3 -u -b 0 -l 1200`), upload and download (`-R`),
//! through the router topology of [`crate::phone`] (the app in a namespace
//! of its own, forwarded into the TUN), per-packet and batch drivers,
//! system stack, direct outbound, beside the no-TUN baseline of the same
//! topology and MTU. A fresh engine per run, as the TCP profiles.
//!
//! `bash scripts/bench.sh --phone` runs these after the TCP profiles;
//! `--phone-udp-only` runs them alone and replaces only their records.
//!
//! This module holds the records and the page's subsection; the harness
//! (`src/bin/netbench/phone_udp.rs`) runs them.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::phone::{ProcCounts, Topo};
use crate::record::{Direction, Meta, Record};

/// The datagram payload: QUIC's usual packet size (RFC 9000 requires
/// paths to carry at least 1200 bytes; stacks send that or a little more).
pub const DATAGRAM: u32 = 1200;

/// The target for the per-packet driver at MTU 1500: this fraction of the
/// baseline in both directions, and at most this much engine CPU per GB.
pub const TARGET_FRACTION: f64 = 0.5;
pub const TARGET_CPU_S_PER_GB: f64 = 2.5;

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

/// One iperf3 UDP run of one profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhoneUdpRun {
    /// `router-1500-per-packet-udp`, `router-1500-baseline-udp`.
    pub profile: String,
    pub topology: Topo,
    pub mtu: u16,
    /// `None` for the baseline.
    pub driver: Option<String>,
    pub streams: u32,
    pub direction: Direction,
    pub datagram: u32,
    /// At the receiver; `None` when the run failed.
    pub gbit_per_s: Option<f64>,
    /// Payload bytes received, and sent.
    pub bytes: u64,
    pub sent_bytes: u64,
    pub secs: f64,
    /// iperf3's lost datagrams and the datagrams it accounted for.
    pub lost_packets: u64,
    pub packets: u64,
    pub engine_cpu_s: Option<f64>,
    /// Engine CPU seconds per 10^9 payload bytes received.
    pub cpu_s_per_gb: Option<f64>,
    pub hwm_kib: Option<u64>,
    pub tun_tx_dropped: Option<u64>,
    pub proc_counts: Option<ProcCounts>,
    pub engine_stats: Option<serde_json::Value>,
    pub load1: Option<f64>,
    pub error: Option<String>,
}

impl PhoneUdpRun {
    fn stat(&self, key: &str) -> Option<u64> {
        self.engine_stats.as_ref()?.get(key)?.as_u64()
    }

    /// Lost over all datagrams, as iperf3's receiver counted them.
    pub fn loss(&self) -> Option<f64> {
        (self.packets > 0).then(|| self.lost_packets as f64 / self.packets as f64)
    }

    /// What the sender offered, Gbit/s.
    pub fn offered_gbit_per_s(&self) -> Option<f64> {
        (self.secs > 0.0).then(|| self.sent_bytes as f64 * 8.0 / self.secs / 1e9)
    }

    /// IP packets per TUN read and per TUN write call: the engine's
    /// counters over the read- and write-family calls of `/proc/<pid>/io`
    /// (UDP sockets' recvmsg/sendmsg are not among them). Packets written
    /// are the driver's write-backs plus the reply datagrams.
    pub fn packets_per_call(&self) -> Option<(f64, f64)> {
        let c = self.proc_counts.as_ref()?;
        let per = |packets: u64, calls: u64| (calls > 0).then(|| packets as f64 / calls as f64);
        let written = self.stat("tun_writes")? + self.stat("udp_packets_down")?;
        Some((
            per(self.stat("tun_read_packets")?, c.read_calls)?,
            per(written, c.write_calls)?,
        ))
    }

    /// Voluntary context switches of the engine's threads per GB received.
    pub fn wakeups_per_gb(&self) -> Option<f64> {
        let v = self.proc_counts.as_ref()?.voluntary_switches;
        (self.bytes > 0).then(|| v as f64 / (self.bytes as f64 / 1e9))
    }

    /// UDP payload the engine relayed against what the receiver got: far
    /// below 1, the traffic did not go through the engine.
    pub fn relayed_share(&self) -> Option<f64> {
        let relayed = self.stat("udp_bytes_up")? + self.stat("udp_bytes_down")?;
        (self.bytes > 0).then(|| relayed as f64 / self.bytes as f64)
    }
}

/// Records the UDP run writes.
pub fn is_udp(r: &Record) -> bool {
    matches!(r, Record::PhoneUdpMeta(_) | Record::PhoneUdp(_))
}

/// What `--phone-udp-only` does to `results.jsonl`: drop the UDP records
/// of `data`, keep every other one, append the UDP records of `fresh`.
pub fn replace(data: &mut Vec<Record>, fresh: &[Record]) {
    data.retain(|r| !is_udp(r));
    data.extend(fresh.iter().filter(|r| is_udp(r)).cloned());
}

struct View<'a> {
    meta: Option<&'a PhoneUdpMeta>,
    runs: Vec<&'a PhoneUdpRun>,
}

/// (topology, MTU, driver).
type Key<'a> = (Topo, u16, Option<&'a str>);

impl<'a> View<'a> {
    fn new(records: &'a [Record]) -> Self {
        let mut v = View {
            meta: None,
            runs: Vec::new(),
        };
        for r in records {
            match r {
                Record::PhoneUdpMeta(m) => v.meta = Some(m),
                Record::PhoneUdp(x) => v.runs.push(x),
                _ => {}
            }
        }
        v
    }

    fn key(r: &'a PhoneUdpRun) -> Key<'a> {
        (r.topology, r.mtu, r.driver.as_deref())
    }

    /// (key, streams) in the order measured.
    fn rows(&self) -> Vec<(Key<'a>, u32)> {
        let mut out = Vec::new();
        for r in &self.runs {
            let k = (Self::key(r), r.streams);
            if !out.contains(&k) {
                out.push(k);
            }
        }
        // Baseline first within each (topology, MTU, streams), then the
        // drivers in the order measured.
        out.sort_by_key(|((t, m, d), s)| (*t, *m, *s, d.is_some()));
        out
    }

    fn measured(&self, k: Key, streams: u32, dir: Direction) -> Option<&'a PhoneUdpRun> {
        self.runs.iter().copied().find(|r| {
            Self::key(r) == k && r.streams == streams && r.direction == dir && r.error.is_none()
        })
    }

    fn fraction(&self, k: Key, streams: u32, dir: Direction) -> Option<f64> {
        let g = self.measured(k, streams, dir)?.gbit_per_s?;
        let b = self.measured((k.0, k.1, None), streams, dir)?.gbit_per_s?;
        (b > 0.0).then_some(g / b)
    }
}

fn percent(x: Option<f64>) -> String {
    x.map_or("–".into(), |f| format!("{:.0} %", 100.0 * f))
}

fn fixed(x: Option<f64>) -> String {
    x.map_or("–".into(), |f| format!("{f:.2}"))
}

/// The Android path the target is about.
const TARGET_KEY: Key<'static> = (Topo::Router, 1500, Some("per-packet"));

/// Whether `got` meets the target line (fractions in both directions, CPU).
fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "not met" }
}

/// The target line for the per-packet driver, router, MTU 1500, at the
/// lowest stream count measured.
fn target_line(v: &View) -> Option<String> {
    let streams = v
        .runs
        .iter()
        .filter(|r| View::key(r) == TARGET_KEY)
        .map(|r| r.streams)
        .min()?;
    let mut parts = Vec::new();
    for dir in [Direction::Upload, Direction::Download] {
        let f = v.fraction(TARGET_KEY, streams, dir);
        parts.push(format!(
            "{} {} (≥ {:.0} %: {})",
            dir.as_str(),
            percent(f),
            100.0 * TARGET_FRACTION,
            match f {
                Some(f) => verdict(f >= TARGET_FRACTION),
                None => "not measured",
            }
        ));
    }
    let cpu = [Direction::Upload, Direction::Download]
        .iter()
        .filter_map(|&d| v.measured(TARGET_KEY, streams, d)?.cpu_s_per_gb)
        .reduce(f64::max);
    if let Some(c) = cpu {
        parts.push(format!(
            "engine at most {c:.2} CPU s/GB (≤ {TARGET_CPU_S_PER_GB}: {})",
            verdict(c <= TARGET_CPU_S_PER_GB)
        ));
    }
    Some(format!(
        "router topology, MTU 1500, per-packet driver, {streams} stream{}: {}",
        if streams == 1 { "" } else { "s" },
        parts.join(", ")
    ))
}

/// The summary line for the top of the page.
pub fn summary(records: &[Record]) -> Vec<String> {
    let v = View::new(records);
    target_line(&v)
        .map(|l| {
            format!(
                "- Phone profile, UDP ({DATAGRAM}-byte datagrams at full rate), {l} (\"UDP, \
                 QUIC-shaped\")."
            )
        })
        .into_iter()
        .collect()
}

/// The "UDP, QUIC-shaped" subsection of "Phone profiles", or nothing when
/// the records have none.
pub fn section(records: &[Record]) -> String {
    let v = View::new(records);
    let mut p = String::new();
    if v.runs.is_empty() && v.meta.is_none() {
        return p;
    }
    let datagram = v.meta.map_or(DATAGRAM, |m| m.datagram);
    let _ = writeln!(p, "### UDP, QUIC-shaped\n");
    if let Some(m) = v.meta {
        let r = &m.run;
        let _ = writeln!(
            p,
            "Measured by:\n\n```sh\n{}\n```\n\n{}, kerntun `{}`, {} cores, iperf3 {} s per \
             run, a fresh engine per run; load average (1 min) {} at the start and {} at the \
             end; {:.0} s.\n",
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
        "A large share of phone traffic is QUIC: {datagram}-byte UDP datagrams at full rate, \
         both directions. `iperf3 -u -b 0 -l {datagram}` (upload; download with `-R`) from the \
         router topology's app namespace, through the engine's direct UDP flows (a connected \
         socket per flow, `core/src/udp/`), beside the no-TUN baseline of the same topology \
         and MTU. Gbit/s and loss are iperf3's receiver's (loss: datagrams missing from its \
         sequence over all it accounted for; the sender offers more than any path here \
         carries, so loss is high everywhere, the baseline included); offered: what the sender \
         sent. Engine CPU per 10^9 payload bytes received; wake-ups and TUN packets per call \
         as in the TCP table (packets written: the driver's write-backs plus the reply \
         datagrams). `/proc` counts the calls on every descriptor, the runtime's own wake-up \
         reads and writes included, so packets per read mean something for the upload (the \
         TUN carries the datagrams in) and packets per write for the download; the other \
         direction hardly uses the TUN.\n"
    );
    let _ = writeln!(
        p,
        "| topology | MTU | driver | streams | direction | Gbit/s | of baseline | loss | offered Gbit/s | engine CPU s/GB | wake-ups per GB | TUN packets per read | TUN packets per write |\n\
         |---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (k, s) in v.rows() {
        for dir in [Direction::Upload, Direction::Download] {
            let Some(r) = v
                .runs
                .iter()
                .copied()
                .find(|r| View::key(r) == k && r.streams == s && r.direction == dir)
            else {
                continue;
            };
            let engine = k.2.is_some();
            let ok = r.error.is_none();
            let dash = || "–".to_string();
            let _ = writeln!(
                p,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                k.0.as_str(),
                k.1,
                k.2.unwrap_or("none (baseline)"),
                s,
                dir.as_str(),
                if ok {
                    fixed(r.gbit_per_s)
                } else {
                    "failed".into()
                },
                if engine && ok {
                    percent(v.fraction(k, s, dir))
                } else {
                    dash()
                },
                if ok { percent(r.loss()) } else { dash() },
                if ok {
                    fixed(r.offered_gbit_per_s())
                } else {
                    dash()
                },
                if engine && ok {
                    fixed(r.cpu_s_per_gb)
                } else {
                    dash()
                },
                if engine && ok {
                    r.wakeups_per_gb()
                        .map_or_else(dash, |w| format!("{:.0}k", w / 1e3))
                } else {
                    dash()
                },
                if engine && ok {
                    fixed(r.packets_per_call().map(|x| x.0))
                } else {
                    dash()
                },
                if engine && ok {
                    fixed(r.packets_per_call().map(|x| x.1))
                } else {
                    dash()
                },
            );
        }
    }
    let _ = writeln!(p);
    let failed: Vec<&&PhoneUdpRun> = v.runs.iter().filter(|r| r.error.is_some()).collect();
    if !failed.is_empty() {
        let _ = writeln!(p, "Failed runs (no number is shown for them):\n");
        for r in failed {
            let _ = writeln!(
                p,
                "- `{}` {} streams {}: {}",
                r.profile,
                r.streams,
                r.direction.as_str(),
                r.error.as_deref().unwrap_or("").replace('\n', " ")
            );
        }
        let _ = writeln!(p);
    }
    let _ = writeln!(
        p,
        "Target: at least {:.0} % of the baseline in both directions and at most \
         {TARGET_CPU_S_PER_GB} engine CPU s per GB received (router topology, MTU 1500, \
         per-packet driver).{}\n",
        100.0 * TARGET_FRACTION,
        match target_line(&v) {
            Some(l) => format!(" Measured: {l}."),
            None => " Not measured in this data.".into(),
        }
    );
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(driver: Option<&str>, dir: Direction, g: f64, cpu: f64) -> PhoneUdpRun {
        PhoneUdpRun {
            profile: format!("router-1500-{}-udp", driver.unwrap_or("baseline")),
            topology: Topo::Router,
            mtu: 1500,
            driver: driver.map(Into::into),
            streams: 1,
            direction: dir,
            datagram: DATAGRAM,
            gbit_per_s: Some(g),
            bytes: 1_000_000_000,
            sent_bytes: 4_000_000_000,
            secs: 4.0,
            lost_packets: 2_500_000,
            packets: 3_333_333,
            engine_cpu_s: driver.map(|_| cpu),
            cpu_s_per_gb: driver.map(|_| cpu),
            hwm_kib: None,
            tun_tx_dropped: Some(0),
            proc_counts: driver.map(|_| ProcCounts {
                read_calls: 1_000_000,
                write_calls: 400_000,
                voluntary_switches: 20_000,
                involuntary_switches: 0,
            }),
            engine_stats: driver.map(|_| {
                serde_json::json!({
                    "tun_read_packets": 1_000_000u64,
                    "tun_writes": 0u64,
                    "udp_packets_down": 800_000u64,
                    "udp_bytes_up": 1_000_000_000u64,
                    "udp_bytes_down": 0u64,
                })
            }),
            load1: Some(1.0),
            error: None,
        }
    }

    #[test]
    fn udp_subsection_shows_fraction_loss_cost_and_the_target() {
        let (up, down) = (Direction::Upload, Direction::Download);
        let mut failed = run(Some("batch"), down, 0.0, 0.0);
        failed.gbit_per_s = None;
        failed.error = Some("iperf3 did not finish".into());
        let records = vec![
            Record::PhoneUdpMeta(PhoneUdpMeta {
                run: Meta {
                    command: "bash scripts/bench.sh --phone-udp-only".into(),
                    cores: 2,
                    duration_s: 5,
                    ..Meta::default()
                },
                topology: Some(Topo::Router),
                mtus: vec![1500],
                drivers: vec!["per-packet".into(), "batch".into()],
                streams: vec![1],
                datagram: DATAGRAM,
            }),
            Record::PhoneUdp(run(None, up, 4.0, 0.0)),
            Record::PhoneUdp(run(Some("per-packet"), up, 2.4, 2.0)),
            Record::PhoneUdp(run(Some("batch"), up, 3.0, 1.0)),
            Record::PhoneUdp(run(None, down, 4.0, 0.0)),
            Record::PhoneUdp(run(Some("per-packet"), down, 1.0, 5.5)),
            Record::PhoneUdp(failed),
        ];
        let page = section(&records);
        assert!(page.starts_with("### UDP, QUIC-shaped\n"), "{page}");
        assert!(
            page.contains("```sh\nbash scripts/bench.sh --phone-udp-only\n```"),
            "{page}"
        );
        // 2.4 of 4.0; 2.5M of 3.33M lost; 4 GB in 4 s offered; 1M packets
        // in 1M reads; 800k reply datagrams in 400k writes.
        assert!(
            page.contains("| router | 1500 | per-packet | 1 | upload | 2.40 | 60 % | 75 % | 8.00 | 2.00 | 20k | 1.00 | 2.00 |"),
            "{page}"
        );
        assert!(
            page.contains("| router | 1500 | none (baseline) | 1 | download | 4.00 | – | 75 % | 8.00 | – | – | – | – |"),
            "{page}"
        );
        assert!(
            page.contains("| router | 1500 | batch | 1 | download | failed | – |"),
            "{page}"
        );
        assert!(page.contains("iperf3 did not finish"), "{page}");
        assert!(
            page.contains(
                "Measured: router topology, MTU 1500, per-packet driver, 1 stream: upload 60 % \
                 (≥ 50 %: met), download 25 % (≥ 50 %: not met), engine at most 5.50 CPU s/GB \
                 (≤ 2.5: not met)."
            ),
            "{page}"
        );
        let lines = summary(&records);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains("upload 60 %"), "{lines:?}");
        // The records survive JSON lines, and no UDP records: no subsection.
        let text = crate::record::to_lines(&records);
        assert_eq!(crate::record::parse_lines(&text).expect("parse"), records);
        assert_eq!(section(&records[..0]), "");
        assert!(summary(&records[..0]).is_empty());
    }

    #[test]
    fn a_udp_only_run_replaces_only_the_udp_records() {
        let up = Direction::Upload;
        let mut data = vec![
            Record::Meta(Meta::default()),
            Record::PhoneUdpMeta(PhoneUdpMeta::default()),
            Record::PhoneUdp(run(None, up, 1.0, 0.0)),
            Record::PhoneMeta(crate::phone::PhoneMeta::default()),
        ];
        let fresh = vec![
            Record::PhoneUdpMeta(PhoneUdpMeta {
                datagram: 1200,
                ..PhoneUdpMeta::default()
            }),
            Record::PhoneUdp(run(Some("per-packet"), up, 2.0, 1.0)),
        ];
        replace(&mut data, &fresh);
        assert_eq!(
            data,
            vec![
                Record::Meta(Meta::default()),
                Record::PhoneMeta(crate::phone::PhoneMeta::default()),
                fresh[0].clone(),
                fresh[1].clone(),
            ]
        );
        // A whole phone run replaces them too.
        assert!(crate::phone::is_phone(&fresh[1]));
    }
}
