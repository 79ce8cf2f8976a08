//! The desktop scenarios' parts of the page: the machine, the scenarios'
//! throughput and cost, the stacks side by side, splice against the
//! userspace copy (and where the engine's CPU goes), integrity, idle
//! connections, criterion and the reference run's figures.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use super::template::Fill;
use super::{
    escape, fixed, integrity_table, measured_by, mib, opt, percent, range, slashed, table,
};
use crate::cpu_profile::{self, CpuProfile};
use crate::record::{
    CriterionFigure, Direction, Integrity, Meta, Record, Scale, ScenarioInfo, Throughput,
};

/// The reference run's measurements: Linux 6.18, i7-12650H, iperf3 over veth
/// between two namespaces, TUN txqueuelen 10000, veth without TUN about 66
/// Gbit/s. (streams, smoltcp, system) in Gbit/s.
pub const REFERENCE_GBIT: [(u32, f64, f64); 3] =
    [(1, 3.39, 4.82), (16, 4.36, 4.68), (64, 4.13, 4.09)];
pub const REFERENCE_VETH_GBIT: f64 = 66.0;

/// Per idle connection, system stack at 10k connections (the target the page checks).
pub const TARGET_PER_CONN_BYTES: f64 = 2048.0;

/// The relay pairs of the splice section: (outbound, splice id, copy id).
const SPLICE_PAIRS: [(&str, &str, &str); 2] = [
    ("direct", "system-batch", "system-copy"),
    ("Shadowsocks none", "ss-none-splice", "ss-none-copy"),
];

struct View<'a> {
    meta: Option<&'a Meta>,
    scenarios: Vec<&'a ScenarioInfo>,
    runs: Vec<&'a Throughput>,
    integrity: Vec<&'a Integrity>,
    scale: Vec<&'a Scale>,
    criterion: Vec<&'a CriterionFigure>,
    profiles: Vec<&'a CpuProfile>,
}

impl<'a> View<'a> {
    fn new(records: &'a [Record]) -> Self {
        let mut v = View {
            meta: None,
            scenarios: Vec::new(),
            runs: Vec::new(),
            integrity: Vec::new(),
            scale: Vec::new(),
            criterion: Vec::new(),
            profiles: Vec::new(),
        };
        for r in records {
            match r {
                Record::Meta(m) => v.meta = Some(m),
                Record::Scenario(s) => v.scenarios.push(s),
                Record::Throughput(t) => v.runs.push(t),
                Record::Integrity(i) => v.integrity.push(i),
                Record::Scale(s) => v.scale.push(s),
                Record::Criterion(c) => v.criterion.push(c),
                Record::Profile(x) => v.profiles.push(x),
                // The phone profiles' part (`super::phone`).
                Record::PhoneMeta(_)
                | Record::Phone(_)
                | Record::PhoneIntegrity(_)
                | Record::PhoneUdpMeta(_)
                | Record::PhoneUdp(_) => {}
            }
        }
        v
    }

    fn run(&self, scenario: &str, streams: u32, dir: Direction) -> Option<&'a Throughput> {
        self.runs
            .iter()
            .copied()
            .find(|t| t.scenario == scenario && t.run.streams == streams && t.run.direction == dir)
    }

    /// A run that succeeded.
    fn measured(&self, scenario: &str, streams: u32, dir: Direction) -> Option<&'a Throughput> {
        self.run(scenario, streams, dir).filter(|t| t.run.ok())
    }

    fn gbit(&self, scenario: &str, streams: u32, dir: Direction) -> Option<f64> {
        self.measured(scenario, streams, dir)?.run.gbit_per_s
    }

    fn cpu(&self, scenario: &str, streams: u32, dir: Direction) -> Option<f64> {
        self.measured(scenario, streams, dir)?.run.cpu_s_per_gb
    }

    /// Throughput as a fraction of the baseline's.
    fn fraction(&self, scenario: &str, streams: u32, dir: Direction) -> Option<f64> {
        let g = self.gbit(scenario, streams, dir)?;
        let b = self.gbit("baseline", streams, dir)?;
        Some(g / b)
    }

    fn streams(&self) -> Vec<u32> {
        let s: BTreeSet<u32> = self.runs.iter().map(|t| t.run.streams).collect();
        s.into_iter().collect()
    }

    fn available(&self) -> impl Iterator<Item = &'a ScenarioInfo> + '_ {
        self.scenarios.iter().copied().filter(|s| s.available)
    }

    fn profile(&self, scenario: &str, streams: u32, dir: Direction) -> Option<&'a CpuProfile> {
        self.profiles.iter().copied().find(|x| {
            x.scenario == scenario
                && x.streams == streams
                && x.direction == dir
                && x.error.is_none()
        })
    }

    fn is_available(&self, id: &str) -> bool {
        self.scenarios.iter().any(|s| s.id == id && s.available)
    }

    /// The runs of a scenario that succeeded.
    fn ok_runs(&self, id: &'a str) -> impl Iterator<Item = &'a Throughput> + '_ {
        self.runs
            .iter()
            .copied()
            .filter(move |t| t.scenario == id && t.run.ok())
    }
}

/// Fill the desktop parts of the page; returns their summary lines.
pub(super) fn fill(f: &mut Fill, records: &[Record]) -> Vec<String> {
    let v = View::new(records);
    machine(f, &v);
    scenarios(f, &v);
    throughput(f, &v);
    cost(f, &v);
    stacks(f, &v);
    splice(f, &v);
    if !v.integrity.is_empty() {
        f.text("integrity", integrity_table("scenario", &v.integrity));
    } else {
        f.text("integrity", "");
    }
    scale(f, &v);
    criterion(f, &v);
    references(f, &v);
    f.text("run_secs", v.meta.map_or(5, |m| m.duration_s).to_string());
    summary(&v)
}

fn machine(f: &mut Fill, v: &View) {
    let item = v.meta.map(|m| {
        // The names every "Measured by" has, then the machine's own and the
        // wall time with criterion's part of it.
        let mut x = measured_by(m);
        x.text(
            "cpu",
            format!(
                "{}, {} cores{}",
                m.cpu_model,
                m.cores,
                if m.virtualized {
                    " (virtual machine)"
                } else {
                    ""
                }
            ),
        )
        .text("memory", format!("{:.1}", m.mem_gib))
        .text("kernel", m.kernel.as_str())
        .text("iperf3", m.iperf3.as_str())
        .text("mtu", m.mtu.to_string())
        .text(
            "wall",
            format!(
                "{:.0} s{}",
                m.wall_s,
                m.criterion_s
                    .map(|s| format!(" (criterion {s:.0} s of it)"))
                    .unwrap_or_default()
            ),
        )
        .flag("few_cores", m.cores <= 4);
        x
    });
    f.item("machine", item);
}

/// The headline figures, each computed from the tables below.
fn summary(v: &View) -> Vec<String> {
    let mut out = Vec::new();
    let streams = v.streams();
    for (id, name) in [
        (
            "system-batch",
            "System stack (batch driver, direct, splice)",
        ),
        ("smoltcp-batch", "smoltcp stack (batch driver, direct)"),
    ] {
        if !v.is_available(id) || streams.is_empty() {
            continue;
        }
        for dir in Direction::BOTH {
            let fracs: Vec<String> = streams
                .iter()
                .map(|&s| percent(v.fraction(id, s, dir)))
                .collect();
            out.push(format!(
                "- {name}, {}: {} of the no-TUN baseline at {} streams.",
                dir.as_str(),
                fracs.join(" / "),
                slashed(&streams)
            ));
        }
    }
    let engine_runs = v
        .runs
        .iter()
        .filter(|t| t.scenario != "baseline" && t.run.ok())
        .count();
    for (id, name) in [
        ("system-batch", "system stack"),
        ("smoltcp-batch", "smoltcp"),
    ] {
        let cpu: Vec<f64> = v.ok_runs(id).filter_map(|t| t.run.cpu_s_per_gb).collect();
        let hwm = v.ok_runs(id).filter_map(|t| t.run.hwm_kib).max();
        if let Some((lo, hi)) = range(&cpu) {
            out.push(format!(
                "- Engine, {name} (`{id}`): {lo:.2}–{hi:.2} CPU s per GB moved; peak RSS up to {} MiB.",
                opt(hwm, mib)
            ));
        }
    }
    out.extend(splice_summary(v));
    if engine_runs > 0 {
        let drops: u64 = v
            .runs
            .iter()
            .filter(|t| t.scenario != "baseline" && t.run.ok())
            .filter_map(|t| t.run.tun_tx_dropped)
            .sum();
        out.push(format!(
            "- TUN TX drops over all {engine_runs} engine runs: {drops}."
        ));
    }
    for id in scale_ids(v) {
        if let Some(top) = largest_step(v, id) {
            out.push(format!(
                "- Idle connections, `{id}`: {:.0} B of engine RSS per connection at {} \
                 connections, {} engine descriptors per connection{}.",
                top.per_conn_bytes,
                top.connections,
                opt(top.fds_per_conn, |f| format!("{f:.1}")),
                if id != "system-batch" {
                    ""
                } else if top.per_conn_bytes < TARGET_PER_CONN_BYTES {
                    " (target under 2048 B: met)"
                } else {
                    " (target under 2048 B: not met)"
                }
            ));
        }
    }
    if !v.integrity.is_empty() {
        let bad = v.integrity.iter().filter(|i| !i.ok).count();
        out.push(format!(
            "- Integrity: {} of {} scenarios returned every byte intact.",
            v.integrity.len() - bad,
            v.integrity.len()
        ));
    }
    let missing: Vec<String> = v
        .scenarios
        .iter()
        .filter(|s| !s.available)
        .map(|s| format!("`{}`", s.id))
        .collect();
    if !missing.is_empty() {
        out.push(format!(
            "- Not available in this build (no number shown): {}.",
            missing.join(", ")
        ));
    }
    let loads: Vec<f64> = v.runs.iter().filter_map(|t| t.run.load1).collect();
    if let Some((_, hi)) = range(&loads) {
        let mean = loads.iter().sum::<f64>() / loads.len() as f64;
        out.push(format!(
            "- Load average (1 min) at the start of the runs: mean {mean:.1}, max {hi:.1}{}.",
            match v.meta {
                Some(m) if mean > m.cores as f64 * 0.75 => format!(
                    " on {} cores: other work shared the machine, so single runs are noisy",
                    m.cores
                ),
                _ => String::new(),
            }
        ));
    }
    out
}

fn scenarios(f: &mut Fill, v: &View) {
    let rows = v.scenarios.iter().map(|s| {
        format!(
            "| `{}` | {} | {} | {} | {} | {} | {} |",
            s.id,
            s.label,
            s.stack,
            s.driver,
            s.outbound,
            opt(s.splice, |b| if b { "on".into() } else { "off".into() }),
            if s.available {
                "measured".to_string()
            } else {
                format!(
                    "not available in this build: {}",
                    escape(s.reason.as_deref().unwrap_or("?"))
                )
            }
        )
    });
    f.text(
        "scenarios",
        table(
            "| id | what | stack | driver | outbound | splice | this build |",
            "|---|---|---|---|---|---|---|",
            rows,
        ),
    );
}

fn throughput(f: &mut Fill, v: &View) {
    let streams = v.streams();
    if streams.is_empty() {
        f.text("throughput", "").text("throughput_failed", "");
        return;
    }
    let mut head = "| scenario | direction |".to_string();
    let mut align = "|---|---|".to_string();
    for s in &streams {
        let _ = write!(head, " {s} stream{} |", if *s == 1 { "" } else { "s" });
        align.push_str("---:|");
    }
    let mut rows = Vec::new();
    for sc in v.available() {
        for dir in Direction::BOTH {
            let mut row = format!("| `{}` | {} |", sc.id, dir.as_str());
            for &s in &streams {
                let cell = match (v.run(&sc.id, s, dir), v.gbit(&sc.id, s, dir)) {
                    (_, Some(g)) => {
                        match v.gbit("baseline", s, dir).filter(|_| sc.id != "baseline") {
                            Some(b) => format!("{g:.2} ({:.0} %)", 100.0 * g / b),
                            None => format!("{g:.2}"),
                        }
                    }
                    (Some(_), None) => "failed".into(),
                    (None, None) => "–".into(),
                };
                let _ = write!(row, " {cell} |");
            }
            rows.push(row);
        }
    }
    f.text("throughput", table(&head, &align, rows));
    let failed: Vec<String> = v
        .runs
        .iter()
        .filter_map(|t| {
            let e = t.run.error.as_deref()?;
            Some(format!(
                "- `{}` {} streams {}: {}",
                t.scenario,
                t.run.streams,
                t.run.direction.as_str(),
                escape(e)
            ))
        })
        .collect();
    f.text("throughput_failed", failed.join("\n"));
}

fn cost(f: &mut Fill, v: &View) {
    let rows: Vec<String> = v
        .runs
        .iter()
        .filter(|t| t.scenario != "baseline")
        .map(|t| {
            let r = &t.run;
            format!(
                "| `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                t.scenario,
                r.streams,
                r.direction.as_str(),
                fixed(r.gbit_per_s.filter(|_| r.ok())),
                fixed(r.engine_cpu_s),
                opt(r.cpu_s_per_gb.filter(|_| r.ok()), |c| format!("{c:.3}")),
                match (r.rss_kib, r.hwm_kib) {
                    (Some(a), Some(h)) => format!("{} ({})", mib(a), mib(h)),
                    _ => "–".into(),
                },
                opt(r.tun_tx_dropped, |d| d.to_string()),
                opt(r.retransmits, |x| x.to_string()),
                percent(r.system_busy),
                opt(r.stat("tun_read_max_batch"), |b| b.to_string()),
                percent(t.spliced_share()),
            )
        })
        .collect();
    if rows.is_empty() {
        f.text("cost", "");
        return;
    }
    f.text(
        "cost",
        table(
            "| scenario | streams | direction | Gbit/s | engine CPU s | CPU s/GB | RSS MiB (peak) | TUN TX drops | retransmits | machine busy | max batch | spliced |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            rows,
        ),
    );
}

/// System stack next to smoltcp, side by side.
fn stacks(f: &mut Fill, v: &View) {
    let (sys, smol) = ("system-batch", "smoltcp-batch");
    let missing = (!v.is_available(smol)).then(|| {
        let why = v
            .scenarios
            .iter()
            .find(|s| s.id == smol)
            .and_then(|s| s.reason.as_deref())
            .unwrap_or("not part of this run");
        escape(why)
    });
    f.text("smoltcp_missing", missing.unwrap_or_default());
    let up = Direction::Upload;
    let rows = v.streams().into_iter().map(|s| {
        let frac = |id: &str| {
            let g = v.gbit(id, s, up)?;
            let b = v.gbit("baseline", s, up)?;
            Some(format!("{g:.2} Gbit/s ({:.0} %)", 100.0 * g / b))
        };
        let cpu = |id: &str| v.cpu(id, s, up).map(|c| format!("{c:.3}"));
        let rss = |id: &str| v.run(id, s, up).and_then(|t| t.run.hwm_kib).map(mib);
        let na = |id: &str, x: Option<String>| {
            x.unwrap_or_else(|| {
                if v.is_available(id) {
                    "failed".into()
                } else {
                    "n/a".into()
                }
            })
        };
        format!(
            "| {s} | {} | {} | {} | {} | {} | {} |",
            na(sys, frac(sys)),
            na(smol, frac(smol)),
            na(sys, cpu(sys)),
            na(smol, cpu(smol)),
            na(sys, rss(sys)),
            na(smol, rss(smol)),
        )
    });
    f.text(
        "stacks",
        table(
            "| streams | system | smoltcp | system CPU s/GB | smoltcp CPU s/GB | system peak RSS MiB | smoltcp peak RSS MiB |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            rows,
        ),
    );
    let mut targets = Vec::new();
    if v.is_available(smol) {
        for dir in Direction::BOTH {
            let (mut met, mut not) = (Vec::new(), Vec::new());
            for st in v.streams() {
                if let (Some(a), Some(b)) = (v.gbit(sys, st, dir), v.gbit(smol, st, dir)) {
                    if a >= b {
                        met.push(st.to_string());
                    } else {
                        not.push(st.to_string());
                    }
                }
            }
            let or_no = |x: Vec<String>| {
                if x.is_empty() {
                    "no".to_string()
                } else {
                    x.join(", ")
                }
            };
            let mut t = Fill::new();
            t.text("direction", dir.as_str())
                .text("met", or_no(met))
                .text("not_met", or_no(not));
            targets.push(t);
        }
    }
    f.list("stack_targets", targets);
}

/// CPU s/GB of a run and of each reported path in it: the profile's shares
/// applied to the unsampled run's CPU per GB.
struct Split {
    total: f64,
    relay: f64,
    relay_copy: f64,
    tun: f64,
    tun_copy: f64,
    user: f64,
    user_copy: f64,
    rest: f64,
}

fn split(v: &View, id: &str, s: u32, d: Direction) -> Option<Split> {
    let total = v.cpu(id, s, d)?;
    let x = v.profile(id, s, d)?;
    let at = |path| {
        let (a, c) = x.path_share(path);
        (a * total, c * total)
    };
    let (relay, relay_copy) = at(cpu_profile::Path::Relay);
    let (tun, tun_copy) = at(cpu_profile::Path::Tun);
    let (user, user_copy) = at(cpu_profile::Path::User);
    let (rest, _) = at(cpu_profile::Path::Rest);
    Some(Split {
        total,
        relay,
        relay_copy,
        tun,
        tun_copy,
        user,
        user_copy,
        rest,
    })
}

/// The profiled (splice, copy) pairs of one outbound: (streams, direction,
/// the spliced run's split, the copied one's).
fn split_pairs<'v>(
    v: &'v View,
    on: &'v str,
    off: &'v str,
) -> impl Iterator<Item = (u32, Direction, Split, Split)> + 'v {
    v.streams().into_iter().flat_map(move |s| {
        Direction::BOTH.into_iter().filter_map(move |d| {
            let (a, b) = (split(v, on, s, d)?, split(v, off, s, d)?);
            Some((s, d, a, b))
        })
    })
}

/// One line per outbound for the summary: the ratio's range and what the
/// relay itself costs on each path.
fn splice_summary(v: &View) -> Vec<String> {
    let mut out = Vec::new();
    for (name, on, off) in SPLICE_PAIRS {
        let mut ratios = Vec::new();
        for s in v.streams() {
            for d in Direction::BOTH {
                if let (Some(a), Some(b)) = (v.cpu(on, s, d), v.cpu(off, s, d))
                    && b > 0.0
                {
                    ratios.push(a / b);
                }
            }
        }
        let Some(r) = range(&ratios) else {
            continue;
        };
        let show = |(lo, hi): (f64, f64)| format!("{lo:.2}–{hi:.2}");
        let mut line = format!(
            "- Splice / copy engine CPU per GB, {name}: {} over {} runs (target at most 0.5: {})",
            show(r),
            ratios.len(),
            if ratios.iter().all(|&r| r <= 0.5) {
                "met"
            } else {
                "not met"
            }
        );
        let pairs: Vec<(Split, Split)> = split_pairs(v, on, off)
            .filter(|p| p.3.total > 0.0)
            .map(|p| (p.2, p.3))
            .collect();
        let spliced: Vec<f64> = pairs.iter().map(|p| p.0.relay).collect();
        let copied: Vec<f64> = pairs.iter().map(|p| p.1.relay).collect();
        let floor: Vec<f64> = pairs
            .iter()
            .map(|(a, b)| (a.total - a.relay) / b.total)
            .collect();
        if let (Some(rs), Some(rc), Some(fl)) = (range(&spliced), range(&copied), range(&floor)) {
            let _ = write!(
                line,
                "; the relay's own system calls cost {} CPU s/GB spliced against {} copied, and \
                 the work both paths share (TUN, driver, kernel receive) alone makes {} of the \
                 copy path's total (profiled runs, see below)",
                show(rs),
                show(rc),
                show(fl)
            );
        }
        out.push(format!("{line}."));
    }
    out
}

/// Splice against the userspace copy, direct and Shadowsocks `none`
/// (the splice benchmark: splice at most half the CPU per GB of the copy),
/// and where the engine's CPU goes on each path.
fn splice(f: &mut Fill, v: &View) {
    let missing: Vec<String> = SPLICE_PAIRS
        .iter()
        .flat_map(|(_, a, b)| [*a, *b])
        .filter(|id| !v.is_available(id))
        .map(|m| format!("`{m}`"))
        .collect();
    f.text("splice_missing", missing.join(", "));
    let cell = |id: &str, s: u32, d: Direction| {
        let t = v.measured(id, s, d)?;
        Some((t.run.cpu_s_per_gb?, t.run.gbit_per_s?))
    };
    let mut rows = Vec::new();
    for (name, on, off) in SPLICE_PAIRS {
        for s in v.streams() {
            for d in Direction::BOTH {
                let (a, b) = (cell(on, s, d), cell(off, s, d));
                if a.is_none() && b.is_none() {
                    continue;
                }
                let show = |x: Option<(f64, f64)>| {
                    x.map_or("–".to_string(), |(c, g)| format!("{c:.3} ({g:.2})"))
                };
                let ratio = match (a, b) {
                    (Some((x, _)), Some((y, _))) if y > 0.0 => format!("{:.2}", x / y),
                    _ => "–".into(),
                };
                rows.push(format!(
                    "| {name} | {s} | {} | {} | {} | {ratio} |",
                    d.as_str(),
                    show(a),
                    show(b)
                ));
            }
        }
    }
    f.text(
        "splice",
        table(
            "| outbound | streams | direction | splice CPU s/GB | copy CPU s/GB | splice / copy |",
            "|---|---:|---|---:|---:|---:|",
            rows,
        ),
    );
    cpu_paths(f, v);
}

/// Where the engine's CPU goes on each path, from the sampled runs.
fn cpu_paths(f: &mut Fill, v: &View) {
    f.flag("profiled", !v.profiles.is_empty());
    let failed: Vec<String> = v
        .profiles
        .iter()
        .filter_map(|x| {
            x.error.as_ref().map(|e| {
                format!(
                    "`{}` {} streams {}: {e}",
                    x.scenario,
                    x.streams,
                    x.direction.as_str()
                )
            })
        })
        .collect();
    f.text("profiles_failed", failed.join("; "));
    let cell = |x: f64, t: f64| {
        if t > 0.0 {
            format!("{x:.3} ({:.0} %)", 100.0 * x / t)
        } else {
            format!("{x:.3}")
        }
    };
    let mut rows = Vec::new();
    let mut verdicts = Vec::new();
    let mut floors = Vec::new();
    for (name, on, off) in SPLICE_PAIRS {
        for s in v.streams() {
            for d in Direction::BOTH {
                for (how, id) in [("splice", on), ("copy", off)] {
                    let Some(x) = split(v, id, s, d) else {
                        continue;
                    };
                    rows.push(format!(
                        "| {name} | {s} | {} | {how} | {:.3} | {} | {} | {} | {} | {} | {} | {} |",
                        d.as_str(),
                        x.total,
                        cell(x.relay, x.total),
                        cell(x.relay_copy, x.total),
                        cell(x.tun, x.total),
                        cell(x.tun_copy, x.total),
                        cell(x.user, x.total),
                        cell(x.user_copy, x.total),
                        cell(x.rest, x.total),
                    ));
                }
            }
        }
        for (s, d, a, b) in split_pairs(v, on, off) {
            if b.total > 0.0 && b.relay > 0.0 {
                floors.push((a.total - a.relay) / b.total);
                verdicts.push(format!(
                    "- {name}, {s} streams, {}: the relay costs {:.3} CPU s/GB spliced and \
                     {:.3} copied ({:.2}); the rest of the engine {:.3} and {:.3}. Were the \
                     spliced relay free, splice / copy would still be {:.2}.",
                    d.as_str(),
                    a.relay,
                    b.relay,
                    a.relay / b.relay,
                    a.total - a.relay,
                    b.total - b.relay,
                    (a.total - a.relay) / b.total,
                ));
            }
        }
    }
    f.text(
        "cpu_paths",
        table(
            "| outbound | streams | direction | relay path | CPU s/GB | relay | of which copies | TUN | of which copies | userspace | of which memcpy | rest |",
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            rows,
        ),
    );
    f.text("splice_pairs", verdicts.join("\n"));
    let floor = range(&floors).map(|(lowest, _)| {
        let mut x = Fill::new();
        x.text("lowest", format!("{lowest:.2}"))
            .flag("out_of_reach", lowest > 0.5);
        x
    });
    f.item("shared_floor", floor);
}

fn scale_ids<'a>(v: &View<'a>) -> Vec<&'a str> {
    let mut ids: Vec<&str> = v.scale.iter().map(|s| s.scenario.as_str()).collect();
    ids.dedup();
    ids
}

/// The largest step of a scenario that held every connection.
fn largest_step<'a>(v: &View<'a>, id: &str) -> Option<&'a Scale> {
    v.scale
        .iter()
        .copied()
        .filter(|s| s.scenario == id && s.error.is_none())
        .max_by_key(|s| s.connections)
}

fn scale(f: &mut Fill, v: &View) {
    f.flag("scale", !v.scale.is_empty())
        .flag("pinged", v.scale.iter().all(|s| s.pinged))
        .flag("smoltcp_batch", v.is_available("smoltcp-batch"));
    let rows = v.scale.iter().map(|s| {
        format!(
            "| `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} s |",
            s.scenario,
            s.connections,
            mib(s.rss_kib),
            mib(s.idle_rss_kib),
            if s.rss_kib > 0 {
                format!("{:.0} B", s.per_conn_bytes)
            } else {
                "–".into()
            },
            if s.anon_kib > 0 {
                format!("{:.0} B", s.per_conn_anon_bytes)
            } else {
                "–".into()
            },
            opt(s.fds_per_conn, |x| format!("{x:.1}")),
            opt(s.engine_sessions, |n| n.to_string()),
            s.failed,
            s.open_secs
        )
    });
    f.text(
        "scale_table",
        table(
            "| scenario | connections | engine RSS MiB | idle RSS MiB | per connection | per connection, anonymous memory only | engine descriptors per connection | engine sessions | failed | open time |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            rows,
        ),
    );
    let errors: Vec<String> = v
        .scale
        .iter()
        .filter_map(|s| {
            let e = s.error.as_deref()?;
            Some(format!(
                "- `{}` at {}: {}",
                s.scenario,
                s.connections,
                escape(e)
            ))
        })
        .collect();
    f.text("scale_errors", errors.join("\n"));
    let target = largest_step(v, "system-batch").map(|top| {
        let mut x = Fill::new();
        x.text("connections", top.connections.to_string())
            .text("per_conn", format!("{:.0}", top.per_conn_bytes))
            .text(
                "verdict",
                if top.per_conn_bytes < TARGET_PER_CONN_BYTES {
                    "met"
                } else {
                    "**not met**"
                },
            );
        x
    });
    f.item("scale_target", target);
    let short = v.meta.and_then(|m| {
        let asked = m.requested_connections.iter().copied().max().unwrap_or(0);
        let short: Vec<String> = scale_ids(v)
            .into_iter()
            .filter_map(|id| {
                let rows: Vec<&&Scale> = v.scale.iter().filter(|s| s.scenario == id).collect();
                let measured = rows.iter().map(|s| s.connections).max().unwrap_or(0);
                let per = rows.iter().filter_map(|s| s.fds_per_conn).next_back();
                (measured < asked && rows.iter().all(|s| s.error.is_none())).then(|| {
                    format!(
                        "`{id}` at {measured} ({} descriptors per connection)",
                        opt(per, |x| format!("{x:.1}"))
                    )
                })
            })
            .collect();
        (!short.is_empty()).then(|| {
            let mut x = Fill::new();
            x.text("asked", asked.to_string())
                .text("nofile", m.nofile.to_string())
                .text("short", short.join(", "));
            x
        })
    });
    f.item("scale_short", short);
}

fn criterion(f: &mut Fill, v: &View) {
    f.flag("criterion", !v.criterion.is_empty()).text(
        "criterion_error",
        v.meta
            .and_then(|m| m.criterion_error.as_deref())
            .map(escape)
            .unwrap_or_default(),
    );
    let load = v.meta.and_then(|m| m.criterion_load).map(|(a, b)| {
        let mut x = Fill::new();
        x.text("before", format!("{a:.2}"))
            .text("after", format!("{b:.2}"));
        x
    });
    f.item("criterion_load", load);
    let rows = v.criterion.iter().map(|c| {
        let per = match c.elements {
            Some(n) if n > 1 => fmt_ns(c.mean_ns / n as f64),
            _ => "–".into(),
        };
        format!(
            "| `{}` | {} | {} – {} | {} |",
            c.id,
            fmt_ns(c.mean_ns),
            fmt_ns(c.low_ns),
            fmt_ns(c.high_ns),
            per
        )
    });
    f.text(
        "criterion_table",
        table(
            "| bench | mean per iteration | 95 % interval | per element |",
            "|---|---:|---:|---:|",
            rows,
        ),
    );
}

fn fmt_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}

fn references(f: &mut Fill, v: &View) {
    f.text("ref_veth", format!("{REFERENCE_VETH_GBIT:.0}"));
    let rows = REFERENCE_GBIT.iter().map(|&(s, smol, sys)| {
        let here = |id: &str| {
            v.fraction(id, s, Direction::Upload)
                .map(|x| format!("{:.0} %", 100.0 * x))
        };
        format!(
            "| {s} | {sys:.2} Gbit/s | {smol:.2} Gbit/s | {:.1} % | {} | {} |",
            100.0 * sys / REFERENCE_VETH_GBIT,
            here("system-batch").unwrap_or_else(|| "–".into()),
            here("smoltcp-batch").unwrap_or_else(|| "n/a".into()),
        )
    });
    f.text(
        "references",
        table(
            "| streams | reference system | reference smoltcp | reference system / veth | here `system-batch` / baseline | here `smoltcp-batch` / baseline |",
            "|---:|---:|---:|---:|---:|---:|",
            rows,
        ),
    );
    let cpu: Vec<f64> = v
        .ok_runs("system-batch")
        .filter_map(|t| t.run.cpu_s_per_gb)
        .collect();
    f.text(
        "ref_cpu",
        range(&cpu)
            .map(|(lo, hi)| format!("{lo:.2}–{hi:.2}"))
            .unwrap_or_default(),
    );
    let rss = v
        .ok_runs("system-batch")
        .filter_map(|t| t.run.hwm_kib)
        .max();
    f.text("ref_rss", rss.map(mib).unwrap_or_default());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Run;
    use crate::report::assert_contains;

    fn render(recs: &[Record]) -> String {
        super::super::render(recs, "c.png").expect("render")
    }

    fn run(scenario: &str, streams: u32, dir: Direction, g: f64) -> Record {
        Record::Throughput(Throughput {
            scenario: scenario.into(),
            run: Run {
                gbit_per_s: Some(g),
                bytes: 1_000_000_000,
                secs: 5.0,
                retransmits: Some(0),
                engine_cpu_s: Some(1.5),
                cpu_s_per_gb: Some(1.5),
                rss_kib: Some(7060),
                hwm_kib: Some(10940),
                tun_tx_dropped: Some(0),
                tun_tx_packets: Some(10),
                system_busy: Some(0.9),
                load1: Some(1.0),
                engine_stats: Some(serde_json::json!({"tun_read_max_batch": 2})),
                ..Run::new(streams, dir)
            },
            iperf_cpu_client: None,
            iperf_cpu_server: None,
        })
    }

    fn info(id: &str, available: bool, reason: Option<&str>) -> Record {
        Record::Scenario(ScenarioInfo {
            id: id.into(),
            label: id.into(),
            stack: "system".into(),
            driver: "batch".into(),
            outbound: "direct".into(),
            splice: None,
            available,
            reason: reason.map(Into::into),
        })
    }

    /// A profile with `relay` of the samples on the relay (a third of them
    /// copies) and the rest on the TUN.
    fn prof(scenario: &str, relay: f64) -> Record {
        use crate::cpu_profile::{Bucket, RELAY_RECV, TUN_READ};
        Record::Profile(CpuProfile {
            scenario: scenario.into(),
            streams: 1,
            direction: Direction::Upload,
            samples: 1000,
            cpu_s_per_gb: Some(2.0),
            buckets: vec![
                Bucket {
                    name: TUN_READ.into(),
                    share: 1.0 - relay,
                    copy_share: 0.0,
                },
                Bucket {
                    name: RELAY_RECV.into(),
                    share: relay,
                    copy_share: relay / 3.0,
                },
            ],
            error: None,
        })
    }

    fn with_cpu(mut r: Record, cpu: f64) -> Record {
        if let Record::Throughput(t) = &mut r {
            t.run.cpu_s_per_gb = Some(cpu);
        }
        r
    }

    #[test]
    fn splice_section_splits_cpu_by_path_and_bounds_the_ratio() {
        let recs = vec![
            info("system-batch", true, None),
            info("system-copy", true, None),
            with_cpu(run("system-batch", 1, Direction::Upload, 8.0), 1.0),
            with_cpu(run("system-copy", 1, Direction::Upload, 8.0), 1.2),
            prof("system-batch", 0.2),
            prof("system-copy", 0.5),
        ];
        let page = render(&recs);
        // splice: 1.0 s/GB, relay 0.2; copy: 1.2 s/GB, relay 0.6 (0.2 of it copies).
        assert_contains(
            &page,
            &[
                "| direct | 1 | upload | copy | 1.200 | 0.600 (50 %) | 0.200 (17 %) | 0.600 (50 %) |",
                "the relay costs 0.200 CPU s/GB spliced and 0.600 copied (0.33)",
                // (1.0 - 0.2) / 1.2
                "splice / copy would still be 0.67",
                "out of reach of the relay on this design",
                "(lowest: 0.67)",
                "direct: 0.83–0.83 over 1 runs (target at most 0.5: not met)",
            ],
        );
        // Without profiles the section says so instead of inventing a split.
        let page = render(&recs[..4]);
        assert!(page.contains("Not profiled in this run"), "{page}");
        assert!(!page.contains("would still be"), "{page}");
    }

    #[test]
    fn page_shows_fractions_unavailable_slots_and_the_target() {
        let recs = vec![
            Record::Meta(Meta {
                cores: 2,
                command: "sudo scripts/bench.sh".into(),
                ..Meta::default()
            }),
            info("baseline", true, None),
            info("system-batch", true, None),
            info(
                "smoltcp-batch",
                false,
                Some("kerntun: stack: smoltcp is not built into this version"),
            ),
            run("baseline", 1, Direction::Upload, 16.0),
            run("system-batch", 1, Direction::Upload, 8.0),
            Record::Scale(Scale {
                scenario: "system-batch".into(),
                connections: 10000,
                failed: 0,
                pinged: true,
                engine_sessions: Some(10000),
                idle_rss_kib: 7000,
                rss_kib: 19000,
                hwm_kib: 20000,
                per_conn_bytes: 1228.8,
                idle_anon_kib: 2000,
                anon_kib: 13000,
                per_conn_anon_bytes: 1126.4,
                engine_fds: Some(20010),
                idle_fds: Some(10),
                fds_per_conn: Some(2.0),
                open_secs: 3.0,
                error: None,
            }),
        ];
        let page = render(&recs);
        assert_contains(
            &page,
            &[
                "```sh\nsudo scripts/bench.sh\n```",
                "| `system-batch` | upload | 8.00 (50 %) |",
                "| `baseline` | upload | 16.00 |",
                "not available in this build: kerntun: stack: smoltcp is not built",
                "1229 B per connection — met",
                "| 1 | 8.00 Gbit/s (50 %) | n/a |",
                "This machine has 2 cores",
                "splice), upload: 50 % of the no-TUN baseline at 1 streams",
                "(target under 2048 B: met)",
                "![Throughput",
            ],
        );
        // No number is invented for the missing stack anywhere.
        assert!(!page.contains("smoltcp-batch` | upload"), "{page}");
        assert!(!page.contains("{{"), "{page}");
    }

    #[test]
    fn failed_runs_show_no_number() {
        let mut r = run("system-batch", 16, Direction::Download, 3.0);
        if let Record::Throughput(t) = &mut r {
            t.run.error = Some("iperf3: unable to connect".into());
        }
        let recs = vec![
            info("baseline", true, None),
            info("system-batch", true, None),
            run("baseline", 16, Direction::Download, 10.0),
            r,
        ];
        let page = render(&recs);
        assert_contains(
            &page,
            &[
                "| `system-batch` | download | failed |",
                "iperf3: unable to connect",
            ],
        );
        assert!(!page.contains("3.00 (30 %)"), "{page}");
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(fmt_ns(20.04), "20.0 ns");
        assert_eq!(fmt_ns(335_000.0), "335.0 µs");
        assert_eq!(fmt_ns(2_500_000.0), "2.50 ms");
    }
}
