//! The phone profiles' part of the page (`crate::phone` says what they
//! are): the phone's own TUN first, then every topology's throughput and
//! engine cost, the earlier engine beside the current one, system calls by
//! kind, the targets, the UDP part and the echo checks.

use std::fmt::Write as _;

use kerntun_testkit::router::{APP_TABLE, GATEWAY_VETH};
use kerntun_testkit::uid_route::UID_TABLE;

use super::template::Fill;
use super::{count, fixed, integrity_table, measured_by, percent, range, slashed, table};
use crate::phone::{ANDROID_UID, SMOLTCP_DRIVER};
use crate::record::{
    Direction, Integrity, PhoneMeta, PhoneRun, PhoneShape, PhoneUdpMeta, PhoneUdpRun, Record, Run,
    Topo,
};

/// (topology, MTU, driver) of a profile as the records carry it.
type Key<'a> = (Topo, u16, Option<&'a str>);

fn key(s: &PhoneShape) -> Key<'_> {
    (s.topology, s.mtu, s.driver.as_deref())
}

/// The Android path the per-packet targets are about: router, MTU 1500.
const TARGET_KEY: Key<'static> = (Topo::Router, 1500, Some("per-packet"));

/// The UDP target for the per-packet driver at MTU 1500: this fraction of
/// the baseline in both directions, and at most this much engine CPU per GB.
const UDP_TARGET_FRACTION: f64 = 0.5;
const UDP_TARGET_CPU_S_PER_GB: f64 = 2.5;

fn driver_name(d: Option<&str>) -> &str {
    d.unwrap_or("none (baseline)")
}

/// A cell of the engine's figures: `–` for the baseline, which has none.
fn engine_only(k: Key, cells: impl FnOnce() -> String) -> String {
    if k.2.is_some() { cells() } else { "–".into() }
}

/// The failed runs of a table (each with a note after its direction), one
/// list item each.
fn failed<'r>(runs: impl Iterator<Item = (&'r PhoneShape, &'r Run, &'static str)>) -> String {
    let lines: Vec<String> = runs
        .filter_map(|(shape, run, note)| {
            let e = run.error.as_deref()?;
            Some(format!(
                "- `{}` {} streams {}{note}: {}",
                shape.profile,
                run.streams,
                run.direction.as_str(),
                e.replace('\n', " ")
            ))
        })
        .collect();
    lines.join("\n")
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "not met" }
}

/// The TCP runs, by what they are.
struct Tcp<'a> {
    metas: Vec<&'a PhoneMeta>,
    runs: Vec<&'a PhoneRun>,
    /// Runs of the earlier engine (`Run::engine`), kept apart.
    before: Vec<&'a PhoneRun>,
    integrity: Vec<&'a Integrity>,
}

impl<'a> Tcp<'a> {
    fn new(records: &'a [Record]) -> Self {
        let mut v = Tcp {
            metas: Vec::new(),
            runs: Vec::new(),
            before: Vec::new(),
            integrity: Vec::new(),
        };
        for r in records {
            match r {
                Record::PhoneMeta(m) => v.metas.push(m),
                Record::Phone(x) if x.run.engine.is_some() => v.before.push(x),
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
            let k = key(&r.shape);
            if !out.contains(&k) {
                out.push(k);
            }
        }
        out
    }

    /// The stream counts measured in the topologies `which` holds.
    fn streams(&self, which: impl Fn(Topo) -> bool) -> Vec<u32> {
        let mut s: Vec<u32> = self
            .runs
            .iter()
            .filter(|r| !r.counted && which(r.shape.topology))
            .map(|r| r.run.streams)
            .collect();
        s.sort_unstable();
        s.dedup();
        s
    }

    /// The labels of the earlier engines that ran a profile (every profile
    /// for `None`), in the order they appear.
    fn labels(&self, k: Option<Key>) -> Vec<&'a str> {
        let mut out: Vec<&str> = Vec::new();
        for r in &self.before {
            if let Some(l) = r.run.engine.as_deref()
                && k.is_none_or(|k| key(&r.shape) == k)
                && !out.contains(&l)
            {
                out.push(l);
            }
        }
        out
    }

    /// The earlier engine `label`'s runs.
    fn before_of(&self, label: &str) -> Vec<&'a PhoneRun> {
        self.before
            .iter()
            .copied()
            .filter(|r| r.run.engine.as_deref() == Some(label))
            .collect()
    }

    /// Whether `r` is a measured (not counted) run of profile `k` at
    /// `streams` in direction `dir`.
    fn is_run(r: &PhoneRun, k: Key, streams: u32, dir: Direction) -> bool {
        !r.counted && key(&r.shape) == k && r.run.streams == streams && r.run.direction == dir
    }

    /// The measured (not counted) run of a profile, successful or not.
    fn find(runs: &[&'a PhoneRun], k: Key, streams: u32, dir: Direction) -> Option<&'a PhoneRun> {
        runs.iter()
            .copied()
            .find(|r| Self::is_run(r, k, streams, dir))
    }

    /// The same, successful.
    fn find_ok(
        runs: &[&'a PhoneRun],
        k: Key,
        streams: u32,
        dir: Direction,
    ) -> Option<&'a PhoneRun> {
        runs.iter()
            .copied()
            .find(|r| r.run.ok() && Self::is_run(r, k, streams, dir))
    }

    fn measured(&self, k: Key, streams: u32, dir: Direction) -> Option<&'a PhoneRun> {
        Self::find_ok(&self.runs, k, streams, dir)
    }

    fn gbit(&self, k: Key, streams: u32, dir: Direction) -> Option<f64> {
        self.measured(k, streams, dir)?.run.gbit_per_s
    }

    /// Throughput as a fraction of the same topology and MTU's baseline.
    fn fraction(&self, k: Key, streams: u32, dir: Direction) -> Option<f64> {
        self.fraction_in(&self.runs, k, streams, dir)
    }

    /// The same for the measured run among `runs` (an earlier engine's too),
    /// against the baseline of the engine under test.
    fn fraction_in(
        &self,
        runs: &[&'a PhoneRun],
        k: Key,
        streams: u32,
        dir: Direction,
    ) -> Option<f64> {
        let g = Self::find_ok(runs, k, streams, dir)?.run.gbit_per_s?;
        let b = self.gbit((k.0, k.1, None), streams, dir)?;
        (b > 0.0).then_some(g / b)
    }

    /// Those fractions, one per stream count.
    fn fractions(&self, runs: &[&'a PhoneRun], streams: &[u32], k: Key, dir: Direction) -> String {
        let f: Vec<String> = streams
            .iter()
            .map(|&s| percent(self.fraction_in(runs, k, s, dir)))
            .collect();
        f.join(" / ")
    }

    /// One cell per stream count: the measured run's figure, `failed` where
    /// the run failed, `–` where there is none.
    fn cells(
        runs: &[&'a PhoneRun],
        streams: &[u32],
        k: Key,
        dir: Direction,
        f: &dyn Fn(&PhoneRun) -> Option<String>,
    ) -> String {
        let cells: Vec<String> = streams
            .iter()
            .map(|&s| match Self::find_ok(runs, k, s, dir) {
                Some(r) => f(r).unwrap_or_else(|| "–".into()),
                None if Self::find(runs, k, s, dir).is_some() => "failed".into(),
                None => "–".into(),
            })
            .collect();
        cells.join(" / ")
    }

    /// The columns the TCP tables share, for profile `k` among `runs` in
    /// direction `dir`: Gbit/s, fraction of the baseline, engine CPU s/GB
    /// and wake-ups per GB.
    fn common_cells(
        &self,
        runs: &[&'a PhoneRun],
        streams: &[u32],
        k: Key,
        dir: Direction,
    ) -> [String; 4] {
        let engine = |f: &dyn Fn(&PhoneRun) -> Option<String>| {
            engine_only(k, || Self::cells(runs, streams, k, dir, f))
        };
        [
            Self::cells(runs, streams, k, dir, &|r| {
                r.run.gbit_per_s.map(|g| format!("{g:.2}"))
            }),
            engine_only(k, || self.fractions(runs, streams, k, dir)),
            engine(&|r| r.run.cpu_s_per_gb.map(|c| format!("{c:.2}"))),
            engine(&|r| Some(count(r.run.wakeups_per_gb()))),
        ]
    }

    /// A profile's measured runs that succeeded.
    fn ok_runs<'s>(&'s self, k: Key<'s>) -> impl Iterator<Item = &'a PhoneRun> + 's {
        self.runs
            .iter()
            .copied()
            .filter(move |r| !r.counted && r.run.ok() && key(&r.shape) == k)
    }

    /// The engine CPU per GB of a profile's measured runs.
    fn cpu(&self, k: Key) -> Vec<f64> {
        self.ok_runs(k).filter_map(|r| r.run.cpu_s_per_gb).collect()
    }
}

/// Fill the phone part of the page; returns its summary lines.
pub(super) fn fill(f: &mut Fill, records: &[Record]) -> Vec<String> {
    let tcp = Tcp::new(records);
    let udp = Udp::new(records);
    let has_tcp = !(tcp.runs.is_empty() && tcp.metas.is_empty());
    let has_udp = !(udp.runs.is_empty() && udp.meta.is_none());
    f.flag("phone", has_tcp || has_udp)
        .flag("phone_tcp", has_tcp)
        .flag("udp", has_udp);
    tcp_part(f, &tcp);
    udp_part(f, &udp);
    f.text(
        "phone_integrity",
        if has_tcp && !tcp.integrity.is_empty() {
            integrity_table("profile", &tcp.integrity)
        } else {
            String::new()
        },
    );
    let mut summary = tcp_summary(&tcp);
    summary.extend(udp.target_line().map(|l| {
        format!(
            "- Phone profile, UDP ({}-byte datagrams at full rate), {l} (\"UDP, QUIC-shaped\").",
            udp.datagram()
        )
    }));
    summary
}

/// Summary lines: the phone's own TUN, then the router topology (the
/// Linux gateway), MTU 1500, each driver.
fn tcp_summary(v: &Tcp) -> Vec<String> {
    let mut out = Vec::new();
    for topo in [Topo::Android, Topo::Router] {
        let streams = v.streams(|t| t == topo);
        for k in v.keys() {
            if k.0 != topo || k.1 != 1500 || k.2.is_none() {
                continue;
            }
            let fractions: Vec<String> = Direction::BOTH
                .iter()
                .map(|&dir| {
                    format!(
                        "{} {}",
                        dir.as_str(),
                        v.fractions(&v.runs, &streams, k, dir)
                    )
                })
                .collect();
            let cpu = range(&v.cpu(k))
                .map(|(lo, hi)| format!("; engine {lo:.2}–{hi:.2} CPU s/GB"))
                .unwrap_or_default();
            let (name, tail) = if topo == Topo::Android {
                ("Phone's own TUN (android topology)", android_tail(v, k))
            } else {
                ("Phone profile, router topology", String::new())
            };
            out.push(format!(
                "- {name}, MTU 1500, {} driver: {} of the same topology's no-TUN baseline at {} \
                 streams{cpu}{tail} (\"{}\").",
                driver_name(k.2),
                fractions.join(", "),
                slashed(&streams),
                if topo == Topo::Android {
                    "The phone's own TUN"
                } else {
                    "Phone profiles"
                }
            ));
        }
    }
    out
}

/// The android summary's drops and retransmissions over a profile's runs.
fn android_tail(v: &Tcp, k: Key) -> String {
    let runs: Vec<&Run> = v.ok_runs(k).map(|r| &r.run).collect();
    let drops: Vec<f64> = runs.iter().filter_map(|r| r.tun_drop_share()).collect();
    let retrans: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.tcp_retrans_segs.map(|n| n as f64))
        .collect();
    let mut tail = String::new();
    if let Some((lo, hi)) = range(&drops) {
        let _ = write!(
            tail,
            "; TUN TX drops {:.2}–{:.2} % of its packets",
            100.0 * lo,
            100.0 * hi
        );
    }
    if let Some((lo, hi)) = range(&retrans) {
        let _ = write!(tail, ", {lo:.0}–{hi:.0} TCP segments retransmitted");
    }
    tail
}

fn tcp_part(f: &mut Fill, v: &Tcp) {
    let several = v.metas.len() > 1;
    let metas = v
        .metas
        .iter()
        .map(|m| {
            let mut x = measured_by(&m.run);
            let topos: Vec<&str> = m.topologies.iter().map(|t| t.as_str()).collect();
            x.text(
                "which",
                if several {
                    format!(" ({})", topos.join(", "))
                } else {
                    String::new()
                },
            );
            x
        })
        .collect();
    let keys = v.keys();
    let streams = v.streams(|t| t != Topo::Android);
    f.list("phone_meta", metas)
        .text("gateway_veth", GATEWAY_VETH)
        .text("app_table", APP_TABLE)
        .flag("smoltcp", keys.iter().any(|k| k.2 == Some(SMOLTCP_DRIVER)))
        .text("smoltcp_driver", SMOLTCP_DRIVER)
        .text("streams", slashed(&streams));
    android(f, v);
    let agree = v
        .runs
        .iter()
        .filter(|r| r.counted && r.run.ok())
        .filter_map(|r| r.proc_vs_perf())
        .reduce(f64::max);
    f.text(
        "agree",
        agree
            .map(|x| format!("{:.1}", 100.0 * x))
            .unwrap_or_default(),
    );
    let mut rows = Vec::new();
    for k in keys.iter().copied().filter(|k| k.0 != Topo::Android) {
        for dir in Direction::BOTH {
            let engine = |f: &dyn Fn(&PhoneRun) -> Option<String>| {
                engine_only(k, || Tcp::cells(&v.runs, &streams, k, dir, f))
            };
            let [gbit, of_baseline, cpu, wakeups] = v.common_cells(&v.runs, &streams, k, dir);
            rows.push(format!(
                "| {} | {} | {} | {} | {gbit} | {of_baseline} | {cpu} | {wakeups} | {} | {} |",
                k.0.as_str(),
                k.1,
                driver_name(k.2),
                dir.as_str(),
                engine(&|r| r.packets_per_call_proc().map(|(x, _)| format!("{x:.2}"))),
                engine(&|r| r.packets_per_call_proc().map(|(_, y)| format!("{y:.2}"))),
            ));
        }
    }
    f.text(
        "phone_table",
        table(
            "| topology | MTU | driver | direction | Gbit/s | of baseline | engine CPU s/GB | wake-ups per GB | TUN packets per read | TUN packets per write |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
            rows,
        ),
    );
    f.text(
        "phone_failed",
        failed(v.runs.iter().map(|r| {
            let note = if r.counted { " (counted run)" } else { "" };
            (&r.shape, &r.run, note)
        })),
    );
    before_after(f, v);
    syscalls(f, v);
    targets(f, v);
}

/// The phone's own TUN: the android topology's profiles, each against the
/// baseline of its MTU, with the TUN's drops and the retransmissions; the
/// earlier engine's runs, when there are some, as rows of their own.
fn android(f: &mut Fill, v: &Tcp) {
    let keys: Vec<Key> = v
        .keys()
        .into_iter()
        .filter(|k| k.0 == Topo::Android)
        .collect();
    f.flag("android", !keys.is_empty())
        .text("android_uid", ANDROID_UID.to_string())
        .text("uid_table", UID_TABLE)
        .text(
            "android_txqueuelen",
            crate::phone::ANDROID_TXQUEUELEN.to_string(),
        );
    let mut queues: Vec<u32> = v
        .runs
        .iter()
        .chain(&v.before)
        .filter(|r| r.shape.topology == Topo::Android)
        .filter_map(|r| r.run.tun_txqueuelen)
        .collect();
    queues.sort_unstable();
    queues.dedup();
    f.text(
        "android_queues",
        if queues.is_empty() {
            "not recorded".to_string()
        } else {
            slashed(&queues)
        },
    );
    let streams = v.streams(|t| t == Topo::Android);
    f.text("android_streams", slashed(&streams));
    let mut rows = Vec::new();
    for &k in &keys {
        // The engine under test, then the earlier ones on the same profile.
        let mut engines = vec![(v.runs.clone(), None)];
        for label in v.labels(Some(k)).into_iter().filter(|_| k.2.is_some()) {
            engines.push((v.before_of(label), Some(label)));
        }
        for (runs, label) in &engines {
            let runs = runs.as_slice();
            for dir in Direction::BOTH {
                let engine = |f: &dyn Fn(&PhoneRun) -> Option<String>| {
                    engine_only(k, || Tcp::cells(runs, &streams, k, dir, f))
                };
                let [gbit, of_baseline, cpu, wakeups] = v.common_cells(runs, &streams, k, dir);
                rows.push(format!(
                    "| {} | {}{} | {} | {gbit} | {of_baseline} | {cpu} | {wakeups} | {} | {} | {} |",
                    k.1,
                    driver_name(k.2),
                    label.map(|l| format!("@{l}")).unwrap_or_default(),
                    dir.as_str(),
                    engine(&|r| r.run.tun_tx_dropped.map(|d| d.to_string())),
                    engine(&|r| {
                        r.run
                            .tun_drop_share()
                            .map(|x| format!("{:.2} %", 100.0 * x))
                    }),
                    Tcp::cells(runs, &streams, k, dir, &|r| {
                        r.run.tcp_retrans_segs.map(|n| n.to_string())
                    }),
                ));
            }
        }
    }
    f.text(
        "android_table",
        table(
            "| MTU | driver | direction | Gbit/s | of baseline | engine CPU s/GB | wake-ups per GB | TUN TX drops | of TUN packets | TCP segments retransmitted |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
            rows,
        ),
    );
}

/// The earlier engine's runs beside the current one's, profile by
/// profile: fraction of the baseline, engine CPU per GB, TUN writes per
/// packet read (each pair from consecutive runs, same streams and
/// direction).
fn before_after(f: &mut Fill, v: &Tcp) {
    let labels = v.labels(None);
    let named: Vec<String> = labels.iter().map(|l| format!("`{l}`")).collect();
    f.text("before", named.join(" and "))
        .flag("before_one", named.len() == 1);
    let streams = v.streams(|_| true);
    let pair = |a: Option<String>, b: Option<String>| {
        format!(
            "{} → {}",
            a.unwrap_or_else(|| "–".into()),
            b.unwrap_or_else(|| "–".into())
        )
    };
    let mut rows = Vec::new();
    for (k, label) in v
        .keys()
        .into_iter()
        .filter(|k| k.2.is_some())
        .flat_map(|k| v.labels(Some(k)).into_iter().map(move |l| (k, l)))
    {
        let runs = v.before_of(label);
        let before = |s: u32, dir: Direction| Tcp::find_ok(&runs, k, s, dir);
        if !streams
            .iter()
            .any(|&s| Direction::BOTH.iter().any(|&d| before(s, d).is_some()))
        {
            continue;
        }
        for dir in Direction::BOTH {
            let cells = |f: &dyn Fn(&PhoneRun, Option<f64>) -> Option<String>| {
                streams
                    .iter()
                    .map(|&s| {
                        let base = v.gbit((k.0, k.1, None), s, dir);
                        pair(
                            before(s, dir).and_then(|r| f(r, base)),
                            v.measured(k, s, dir).and_then(|r| f(r, base)),
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(" / ")
            };
            rows.push(format!(
                "| {} | {} | {}{} | {} | {} | {} | {} |",
                k.0.as_str(),
                k.1,
                driver_name(k.2),
                if labels.len() > 1 {
                    format!("@{label}")
                } else {
                    String::new()
                },
                dir.as_str(),
                cells(&|r, base| {
                    let (g, b) = (r.run.gbit_per_s?, base?);
                    (b > 0.0).then(|| percent(Some(g / b)))
                }),
                cells(&|r, _| r.run.cpu_s_per_gb.map(|c| format!("{c:.2}"))),
                cells(&|r, _| r.writes_per_read().map(|x| format!("{x:.2}"))),
            ));
        }
    }
    f.text(
        "before_table",
        table(
            "| topology | MTU | driver | direction | of baseline | engine CPU s/GB | TUN writes per packet read |",
            "|---|---:|---|---|---|---|---|",
            rows,
        ),
    );
}

fn syscalls(f: &mut Fill, v: &Tcp) {
    let counted: Vec<&&PhoneRun> = v
        .runs
        .iter()
        .filter(|r| r.counted && r.run.ok() && r.syscalls.is_some())
        .collect();
    let why = v
        .metas
        .iter()
        .find_map(|m| m.syscalls_error.clone())
        .unwrap_or_else(|| "no counted runs in this data".into());
    f.text("syscalls_why", why.replace('\n', " "));
    if counted.is_empty() {
        f.text("syscalls", "");
        return;
    }
    let rows = counted.iter().filter_map(|r| {
        let sc = r.syscalls?;
        let run = &r.run;
        Some(format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.shape.topology.as_str(),
            r.shape.mtu,
            driver_name(r.shape.driver.as_deref()),
            run.streams,
            run.direction.as_str(),
            fixed(r.packets_per_read()),
            fixed(r.packets_per_write()),
            count(run.per_gb(sc.tun_read)),
            count(run.per_gb(sc.tun_write)),
            count(run.per_gb(sc.splice)),
            count(run.per_gb(sc.epoll_wait)),
            count(run.per_gb(sc.all)),
            count(run.wakeups_per_gb()),
            fixed(run.cpu_s_per_gb),
        ))
    });
    f.text(
        "syscalls",
        table(
            "| topology | MTU | driver | streams | direction | TUN packets per read | TUN packets per write | TUN reads per GB | TUN writes per GB | splice per GB | epoll waits per GB | all system calls per GB | wake-ups per GB | CPU s/GB (counted run) |",
            "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            rows,
        ),
    );
}

/// The per-packet path's targets, checked against the router profile.
fn targets(f: &mut Fill, v: &Tcp) {
    let want = [(1, 0.35), (16, 0.30), (64, 0.25)];
    let mut lines = Vec::new();
    for dir in Direction::BOTH {
        let got: Vec<String> = want
            .iter()
            .filter_map(|&(s, t)| {
                let x = v.fraction(TARGET_KEY, s, dir)?;
                Some(format!(
                    "{s} streams {} (≥ {:.0} %: {})",
                    percent(Some(x)),
                    100.0 * t,
                    verdict(x >= t)
                ))
            })
            .collect();
        if !got.is_empty() {
            lines.push(format!("- {}: {}.", dir.as_str(), got.join(", ")));
        }
    }
    if let Some((_, hi)) = range(&v.cpu(TARGET_KEY)) {
        lines.push(format!(
            "- engine CPU: at most {hi:.2} s/GB over {} runs (≤ 2.0: {}).",
            v.cpu(TARGET_KEY).len(),
            verdict(hi <= 2.0)
        ));
    }
    let jumbo = (Topo::Router, 9000, Some("per-packet"));
    let j: Vec<String> = Direction::BOTH
        .iter()
        .filter_map(|&d| {
            let x = v.fraction(jumbo, 1, d)?;
            Some(format!(
                "{} {} (≥ 50 %: {})",
                d.as_str(),
                percent(Some(x)),
                verdict(x >= 0.5)
            ))
        })
        .collect();
    if !j.is_empty() {
        lines.push(format!("- MTU 9000, 1 stream: {}.", j.join(", ")));
    }
    f.text("targets", lines.join("\n"));
}

// ---------------------------------------------------------------------------
// UDP.

struct Udp<'a> {
    meta: Option<&'a PhoneUdpMeta>,
    runs: Vec<&'a PhoneUdpRun>,
}

/// A UDP row: (topology, MTU, the driver as shown: `per-packet@<rev>` for
/// an earlier engine).
type UdpKey = (Topo, u16, Option<String>);

fn udp_key(r: &PhoneUdpRun) -> UdpKey {
    let driver = r.shape.driver.as_deref().map(|d| match &r.run.engine {
        Some(e) => format!("{d}@{e}"),
        None => d.to_owned(),
    });
    (r.shape.topology, r.shape.mtu, driver)
}

impl<'a> Udp<'a> {
    fn new(records: &'a [Record]) -> Self {
        let mut v = Udp {
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

    fn datagram(&self) -> u32 {
        self.meta.map_or(crate::phone::DATAGRAM, |m| m.datagram)
    }

    /// (key, streams) in the order measured, the baseline first within
    /// each (topology, MTU, streams).
    fn rows(&self) -> Vec<(UdpKey, u32)> {
        let mut out = Vec::new();
        for r in &self.runs {
            let k = (udp_key(r), r.run.streams);
            if !out.contains(&k) {
                out.push(k);
            }
        }
        out.sort_by_key(|((t, m, d), s)| (*t, *m, *s, d.is_some()));
        out
    }

    /// Whether `r` is the run of row `k` at `streams` in direction `dir`.
    fn is_run(r: &PhoneUdpRun, k: &UdpKey, streams: u32, dir: Direction) -> bool {
        udp_key(r) == *k && r.run.streams == streams && r.run.direction == dir
    }

    fn find(&self, k: &UdpKey, streams: u32, dir: Direction) -> Option<&'a PhoneUdpRun> {
        self.runs
            .iter()
            .copied()
            .find(|r| Self::is_run(r, k, streams, dir))
    }

    fn measured(&self, k: &UdpKey, streams: u32, dir: Direction) -> Option<&'a PhoneUdpRun> {
        self.runs
            .iter()
            .copied()
            .find(|r| r.run.ok() && Self::is_run(r, k, streams, dir))
    }

    fn fraction(&self, k: &UdpKey, streams: u32, dir: Direction) -> Option<f64> {
        let g = self.measured(k, streams, dir)?.run.gbit_per_s?;
        let b = self
            .measured(&(k.0, k.1, None), streams, dir)?
            .run
            .gbit_per_s?;
        (b > 0.0).then_some(g / b)
    }

    /// The target line for the per-packet driver, router, MTU 1500, at the
    /// lowest stream count measured.
    fn target_line(&self) -> Option<String> {
        let k: UdpKey = (Topo::Router, 1500, Some("per-packet".into()));
        let streams = self
            .runs
            .iter()
            .filter(|r| udp_key(r) == k)
            .map(|r| r.run.streams)
            .min()?;
        let mut parts = Vec::new();
        for dir in Direction::BOTH {
            let f = self.fraction(&k, streams, dir);
            parts.push(format!(
                "{} {} (≥ {:.0} %: {})",
                dir.as_str(),
                percent(f),
                100.0 * UDP_TARGET_FRACTION,
                match f {
                    Some(f) => verdict(f >= UDP_TARGET_FRACTION),
                    None => "not measured",
                }
            ));
        }
        let cpu = Direction::BOTH
            .iter()
            .filter_map(|&d| self.measured(&k, streams, d)?.run.cpu_s_per_gb)
            .reduce(f64::max);
        if let Some(c) = cpu {
            parts.push(format!(
                "engine at most {c:.2} CPU s/GB (≤ {UDP_TARGET_CPU_S_PER_GB}: {})",
                verdict(c <= UDP_TARGET_CPU_S_PER_GB)
            ));
        }
        Some(format!(
            "router topology, MTU 1500, per-packet driver, {streams} stream{}: {}",
            if streams == 1 { "" } else { "s" },
            parts.join(", ")
        ))
    }
}

fn udp_part(f: &mut Fill, v: &Udp) {
    f.item("udp_meta", v.meta.map(|m| measured_by(&m.run)))
        .text("datagram", v.datagram().to_string())
        .text(
            "udp_target_fraction",
            format!("{:.0}", 100.0 * UDP_TARGET_FRACTION),
        )
        .text("udp_target_cpu", UDP_TARGET_CPU_S_PER_GB.to_string())
        .text("udp_target", v.target_line().unwrap_or_default());
    let mut rows = Vec::new();
    for (k, s) in v.rows() {
        for dir in Direction::BOTH {
            let Some(r) = v.find(&k, s, dir) else {
                continue;
            };
            let engine = k.2.is_some();
            let ok = r.run.ok();
            let dash = || "–".to_string();
            let both = |x: String| if engine && ok { x } else { dash() };
            rows.push(format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                k.0.as_str(),
                k.1,
                driver_name(k.2.as_deref()),
                s,
                dir.as_str(),
                if ok {
                    fixed(r.run.gbit_per_s)
                } else {
                    "failed".into()
                },
                both(percent(v.fraction(&k, s, dir))),
                if ok { percent(r.loss()) } else { dash() },
                if ok {
                    fixed(r.offered_gbit_per_s())
                } else {
                    dash()
                },
                both(fixed(r.run.cpu_s_per_gb)),
                both(
                    r.run
                        .wakeups_per_gb()
                        .map_or_else(dash, |w| format!("{:.0}k", w / 1e3))
                ),
                both(fixed(r.packets_per_call().map(|x| x.0))),
                both(fixed(r.packets_per_call().map(|x| x.1))),
            ));
        }
    }
    f.text(
        "udp_table",
        table(
            "| topology | MTU | driver | streams | direction | Gbit/s | of baseline | loss | offered Gbit/s | engine CPU s/GB | wake-ups per GB | TUN packets per read | TUN packets per write |",
            "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            rows,
        ),
    );
    f.text(
        "udp_failed",
        failed(v.runs.iter().map(|r| (&r.shape, &r.run, ""))),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::phone::{DATAGRAM, PhoneProfile};
    use crate::procfs::ProcCounts;
    use crate::record::{Meta, PhoneMeta};
    use crate::report::assert_contains;
    use crate::syscalls::Syscalls;

    fn render(records: &[Record]) -> String {
        super::super::render(records, "c.png").expect("render")
    }

    /// The part of the page from "## Phone profiles" to the next section.
    fn section(records: &[Record]) -> String {
        let page = render(records);
        let Some(start) = page.find("## Phone profiles") else {
            return String::new();
        };
        let end = page.find("## Scenarios").unwrap_or(page.len());
        page[start..end].to_string()
    }

    fn shape(topo: Topo, mtu: u16, driver: Option<&str>, udp: bool) -> PhoneShape {
        PhoneShape {
            driver: driver.map(Into::into),
            ..PhoneProfile {
                topo,
                mtu,
                driver: None,
                udp,
            }
            .shape()
        }
    }

    fn run(
        topo: Topo,
        mtu: u16,
        driver: Option<&str>,
        streams: u32,
        dir: Direction,
        g: f64,
    ) -> PhoneRun {
        let mut shape = shape(topo, mtu, driver, false);
        shape.profile = format!("{}-{mtu}-{}", topo.as_str(), driver.unwrap_or("baseline"));
        PhoneRun {
            shape,
            counted: false,
            syscalls: None,
            run: Run {
                gbit_per_s: Some(g),
                bytes: 2_000_000_000,
                secs: 5.0,
                retransmits: Some(0),
                engine_cpu_s: driver.map(|_| 3.0),
                cpu_s_per_gb: driver.map(|_| 1.5),
                tun_tx_dropped: Some(0),
                proc_counts: driver.map(|_| ProcCounts {
                    read_calls: 1_400_000,
                    write_calls: 350_000,
                    voluntary_switches: 300_000,
                    ..ProcCounts::default()
                }),
                engine_stats: driver.map(|_| {
                    serde_json::json!({
                        "tun_read_packets": 1_400_000u64,
                        "tun_writes": 700_000u64,
                        "tcp_bytes_up": 2_000_000_000u64,
                        "tcp_bytes_down": 0u64,
                    })
                }),
                load1: Some(1.0),
                ..Run::new(streams, dir)
            },
        }
    }

    /// A phone run's record of its command (on two cores, 5 s per run) and
    /// the topologies it measured.
    fn meta(command: &str, topologies: &[Topo]) -> Record {
        Record::PhoneMeta(PhoneMeta {
            run: Meta {
                command: command.into(),
                cores: 2,
                duration_s: 5,
                ..Meta::default()
            },
            topologies: topologies.to_vec(),
            ..PhoneMeta::default()
        })
    }

    /// The earlier engine's runs are kept out of the main table and shown
    /// beside the current ones, each against the same baseline.
    #[test]
    fn before_runs_render_beside_the_current_ones() {
        let up = Direction::Upload;
        let mut old = run(Topo::Router, 1500, Some("per-packet"), 1, up, 1.0);
        old.run.engine = Some("24b3908".into());
        old.run.cpu_s_per_gb = Some(4.25);
        let records = vec![
            Record::Phone(run(Topo::Router, 1500, None, 1, up, 8.0)),
            Record::Phone(run(Topo::Router, 1500, Some("per-packet"), 1, up, 2.0)),
            Record::Phone(old),
        ];
        let page = section(&records);
        assert_contains(
            &page,
            &[
                "### Before and after",
                "`24b3908`",
                "| router | 1500 | per-packet | upload | 12 % → 25 % | 4.25 → 1.50 | 0.50 → 0.50 |",
            ],
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
        counted.run.cpu_s_per_gb = Some(1.9);
        counted.syscalls = Some(Syscalls {
            all: 5_000_000,
            tun_read: 1_400_000,
            tun_write: 700_000,
            splice: 40_000,
            epoll_wait: 9_000,
        });
        let mut failed = run(Topo::Router, 1500, Some("per-packet"), 16, up, 0.0);
        failed.run.gbit_per_s = None;
        failed.run.error = Some("iperf3: unable to connect".into());
        let records = vec![
            meta("bash scripts/bench.sh --phone", &[Topo::Router]),
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
        assert_contains(
            &page,
            &[
                "Measured by:\n\n```sh\nbash scripts/bench.sh --phone\n```",
                "| router | 1500 | none (baseline) | upload | 8.00 / 6.00 | – | – | – | – | – |",
                // 2.0 of 8.0 at 1 stream; the 16-stream run failed.
                "| router | 1500 | per-packet | upload | 2.00 / failed | 25 % / – | 1.50 / failed | 150k / failed | 1.00 / failed | 2.00 / failed |",
                // The counted run: /proc saw 350k writes where perf saw 700k on the TUN.
                "within 50.0 % of perf's counts",
                "iperf3: unable to connect",
                // 1.4M packets in 1.4M reads, 700k packets in 700k writes, per 2 GB.
                "| router | 1500 | per-packet | 16 | upload | 1.00 | 1.00 | 700k | 350k | 20k | 4.5k | 2.50M | 150k | 1.90 |",
                "1 streams 25 % (≥ 35 %: not met)",
                "at most 1.50 s/GB over 1 runs (≤ 2.0: met)",
                "| `router-1500-per-packet` | 64 MiB | identical |",
            ],
        );
        assert!(!page.contains("The phone's own TUN"), "no android runs");
        let lines = tcp_summary(&Tcp::new(&records));
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("per-packet driver: upload 25 % / –, download – / –"),
            "{lines:?}"
        );
        assert!(lines[0].contains("engine 1.50–1.50 CPU s/GB"), "{lines:?}");
        // No phone records: no section (the rest of the page renders as before).
        assert_eq!(section(&records[..0]), "");
    }

    /// The phone's own TUN leads the phone part and the summary: drops as
    /// a count and a share of what the TUN carried, retransmissions, the
    /// queue length the device had, and the earlier engine's rows.
    #[test]
    fn the_phones_own_tun_comes_first_with_drops_and_retransmissions() {
        let (up, down) = (Direction::Upload, Direction::Download);
        let android = |driver: Option<&str>, dir: Direction, g: f64| {
            let mut r = run(Topo::Android, 1500, driver, 1, dir, g);
            r.run.tcp_retrans_segs = Some(if driver.is_some() { 120 } else { 3 });
            if driver.is_some() {
                r.run.tun_tx_packets = Some(900_000);
                r.run.tun_rx_packets = Some(100_000);
                r.run.tun_tx_dropped = Some(2_500);
                r.run.tun_txqueuelen = Some(500);
            }
            r
        };
        let mut old = android(Some("per-packet"), up, 1.0);
        old.run.engine = Some("abc1234".into());
        old.run.tun_tx_dropped = Some(10_000);
        // An earlier run's comparison, of another revision, on the router.
        let mut router_before = run(Topo::Router, 1500, Some("per-packet"), 1, up, 0.5);
        router_before.run.engine = Some("24b3908".into());
        let records = vec![
            meta(
                "bash scripts/bench.sh --phone --phone-topologies android",
                &[Topo::Android],
            ),
            meta("bash scripts/bench.sh --phone", &[Topo::Router]),
            Record::Phone(android(None, up, 8.0)),
            Record::Phone(android(Some("per-packet"), up, 2.0)),
            Record::Phone(old),
            Record::Phone(android(Some("batch"), up, 4.0)),
            Record::Phone(android(None, down, 8.0)),
            Record::Phone(run(Topo::Router, 1500, None, 1, up, 8.0)),
            Record::Phone(run(Topo::Router, 1500, Some("per-packet"), 1, up, 1.0)),
            Record::Phone(router_before),
        ];
        let page = section(&records);
        let own = page.find("### The phone's own TUN").expect("android part");
        assert!(own < page.find("### Throughput and engine cost").expect("main"));
        // Two runs measured two sets of topologies: each says which.
        assert_contains(
            &page,
            &[
                "Measured by (android):",
                "Measured by (router):",
                "`ip rule add uidrange 10123-10123 lookup 234`",
                "transmit queue length as read from the device in these runs: 500.",
                // 2.5k of 1M packets dropped; 120 retransmitted segments.
                "| 1500 | per-packet | upload | 2.00 | 25 % | 1.50 | 150k | 2500 | 0.25 % | 120 |",
                "| 1500 | per-packet@abc1234 | upload | 1.00 | 12 % | 1.50 | 150k | 10000 | 1.00 % | 120 |",
                "| 1500 | none (baseline) | upload | 8.00 | – | – | – | – | – | 3 |",
            ],
        );
        assert!(
            page.contains("| 1500 | batch | download | – | – | – | – | – | – | – |"),
            "not measured: {page}"
        );
        // Its rows stay out of the other topologies' table; the earlier
        // engine's are also in the before-and-after table, as every
        // topology's.
        let (main, after) = page
            .split_once("### Before and after")
            .expect("before and after");
        let main = &main[main.find("### Throughput and engine cost").expect("main")..];
        assert!(!main.contains("| android |"), "{main}");
        assert_contains(
            after,
            &[
                "| android | 1500 | per-packet@abc1234 | upload | 12 % → 25 % |",
                "| router | 1500 | per-packet@24b3908 | upload | 6 % → 12 % |",
                "The earlier engines, `abc1234` and `24b3908` (before; the driver column names \
                 which), ran right after",
            ],
        );
        // Each stream list is its own topology's.
        assert!(page.contains("The android topology at 1 streams"), "{page}");
        let lines = tcp_summary(&Tcp::new(&records));
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(
            lines[0].starts_with("- Phone's own TUN (android topology), MTU 1500, per-packet driver: upload 25 %, download –"),
            "{lines:?}"
        );
        assert!(
            lines[0].contains("TUN TX drops 0.25–0.25 % of its packets, 120–120 TCP segments retransmitted (\"The phone's own TUN\")"),
            "{lines:?}"
        );
        assert!(
            lines[1].contains("android topology), MTU 1500, batch driver"),
            "{lines:?}"
        );
        assert!(
            lines[2].starts_with("- Phone profile, router topology"),
            "{lines:?}"
        );
    }

    fn udp(driver: Option<&str>, dir: Direction, g: f64, cpu: f64) -> PhoneUdpRun {
        PhoneUdpRun {
            shape: shape(Topo::Router, 1500, driver, true),
            datagram: DATAGRAM,
            sent_bytes: 4_000_000_000,
            lost_packets: 2_500_000,
            packets: 3_333_333,
            run: Run {
                gbit_per_s: Some(g),
                bytes: 1_000_000_000,
                secs: 4.0,
                engine_cpu_s: driver.map(|_| cpu),
                cpu_s_per_gb: driver.map(|_| cpu),
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
                ..Run::new(1, dir)
            },
        }
    }

    #[test]
    fn udp_subsection_shows_fraction_loss_cost_and_the_target() {
        let (up, down) = (Direction::Upload, Direction::Download);
        let mut failed = udp(Some("batch"), down, 0.0, 0.0);
        failed.run.gbit_per_s = None;
        failed.run.error = Some("iperf3 did not finish".into());
        let mut before = udp(Some("per-packet"), up, 2.0, 3.0);
        before.run.engine = Some("24b3908".into());
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
            Record::PhoneUdp(udp(None, up, 4.0, 0.0)),
            Record::PhoneUdp(udp(Some("per-packet"), up, 2.4, 2.0)),
            Record::PhoneUdp(udp(Some("batch"), up, 3.0, 1.0)),
            Record::PhoneUdp(before),
            Record::PhoneUdp(udp(None, down, 4.0, 0.0)),
            Record::PhoneUdp(udp(Some("per-packet"), down, 1.0, 5.5)),
            Record::PhoneUdp(failed),
        ];
        let page = section(&records);
        assert!(
            page.starts_with("## Phone profiles\n\n### UDP, QUIC-shaped\n"),
            "{page}"
        );
        assert_contains(
            &page,
            &[
                "```sh\nbash scripts/bench.sh --phone-udp-only\n```",
                // 2.4 of 4.0; 2.5M of 3.33M lost; 4 GB in 4 s offered; 1M packets
                // in 1M reads; 800k reply datagrams in 400k writes.
                "| router | 1500 | per-packet | 1 | upload | 2.40 | 60 % | 75 % | 8.00 | 2.00 | 20k | 1.00 | 2.00 |",
                // The earlier engine: a row of its own, named by its label.
                "| router | 1500 | per-packet@24b3908 | 1 | upload | 2.00 | 50 % |",
                "| router | 1500 | none (baseline) | 1 | download | 4.00 | – | 75 % | 8.00 | – | – | – | – |",
                "| router | 1500 | batch | 1 | download | failed | – |",
                "iperf3 did not finish",
                "Measured: router topology, MTU 1500, per-packet driver, 1 stream: upload 60 % \
                 (≥ 50 %: met), download 25 % (≥ 50 %: not met), engine at most 5.50 CPU s/GB \
                 (≤ 2.5: not met).",
            ],
        );
        let v = Udp::new(&records);
        assert!(
            v.target_line().is_some_and(|l| l.contains("upload 60 %")),
            "{:?}",
            v.target_line()
        );
        // The records survive JSON lines, and no UDP records: no subsection.
        let text = crate::record::to_lines(&records);
        assert_eq!(crate::record::parse_lines(&text).expect("parse"), records);
        assert_eq!(section(&records[..0]), "");
        assert!(Udp::new(&records[..0]).target_line().is_none());
    }
}
