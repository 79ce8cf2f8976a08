//! `docs/benchmarks.md`, rendered from the records of the harness's runs
//! (and nothing else, except the reference run's figures of `desktop::REFERENCE_GBIT`), so
//! the page always matches `results.jsonl`.
//!
//! The page's prose is the template `benches/page.md`; this module fills its
//! names (`template`) with the tables, lists and figures the records give:
//! the desktop scenarios' parts in `desktop`, the phone profiles' in
//! `phone`.

mod desktop;
mod phone;
mod template;

use std::fmt::Write as _;

use crate::record::{Integrity, Meta, Record};
use template::Fill;

/// The page's text, with the names the renderer fills.
pub const PAGE: &str = include_str!("../../page.md");

/// Render the page. `chart` is the chart's path relative to the page.
pub fn render(records: &[Record], chart: &str) -> Result<String, String> {
    let mut fill = Fill::new();
    let command = records.iter().find_map(|r| match r {
        Record::Meta(m) => Some(m.command.as_str()),
        _ => None,
    });
    fill.text("command", command.unwrap_or("bash scripts/bench.sh"))
        .text("chart", chart);
    let mut summary = phone::fill(&mut fill, records);
    summary.extend(desktop::fill(&mut fill, records));
    fill.text("summary", summary.join("\n"));
    template::render(PAGE, &fill)
}

/// "Measured by": a run's command, date, revision, machine and load.
fn measured_by(m: &Meta) -> Fill {
    let mut f = Fill::new();
    f.text("command", m.command.as_str())
        .text("date", m.date.as_str())
        .text("git_rev", m.git_rev.as_str())
        .text("cores", m.cores.to_string())
        .text("duration", m.duration_s.to_string())
        .text("load_start", opt(m.load_start, |l| format!("{l:.2}")))
        .text("load_end", opt(m.load_end, |l| format!("{l:.2}")))
        .text("wall", format!("{:.0}", m.wall_s));
    f
}

/// The table of echo checks, one row per `what` (scenario or profile).
fn integrity_table(what: &str, rows: &[&Integrity]) -> String {
    let mut p = format!("| {what} | bytes each way | result | time |\n|---|---:|---|---:|");
    for i in rows {
        let _ = write!(
            p,
            "\n| `{}` | {} MiB | {} | {:.2} s |",
            i.scenario,
            i.bytes >> 20,
            if i.ok {
                "identical".to_string()
            } else {
                format!("FAILED: {}", escape(i.error.as_deref().unwrap_or("?")))
            },
            i.secs
        );
    }
    p
}

/// A Markdown table: a header row, its alignment row, then the rows.
fn table(head: &str, align: &str, rows: impl IntoIterator<Item = String>) -> String {
    let mut t = format!("{head}\n{align}");
    for r in rows {
        t.push('\n');
        t.push_str(&r);
    }
    t
}

fn opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map_or("–".into(), f)
}

fn percent(x: Option<f64>) -> String {
    opt(x, |f| format!("{:.0} %", 100.0 * f))
}

fn fixed(x: Option<f64>) -> String {
    opt(x, |f| format!("{f:.2}"))
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
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

/// Keep a free-text cell inside its table cell.
fn escape(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// `1 / 16 / 64`.
fn slashed<T: ToString>(xs: &[T]) -> String {
    xs.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" / ")
}

/// The lowest and highest of some figures.
fn range(xs: &[f64]) -> Option<(f64, f64)> {
    let lo = xs.iter().copied().reduce(f64::min)?;
    let hi = xs.iter().copied().reduce(f64::max)?;
    Some((lo, hi))
}

/// Test helper: `page` holds each of `wants` (a failure names the one
/// missing).
#[cfg(test)]
pub(crate) fn assert_contains(page: &str, wants: &[&str]) {
    for want in wants {
        assert!(page.contains(want), "missing {want:?} in:\n{page}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name the page uses is filled, with and without data: the
    /// template and the renderer agree.
    #[test]
    fn the_template_renders_with_no_records() {
        let page = render(&[], "c.png").expect("render");
        assert!(page.starts_with("# Benchmarks\n"), "{page}");
        assert!(page.contains("No run metadata in the data."), "{page}");
        assert!(!page.contains("{{"), "{page}");
        assert!(!page.contains("Phone profiles"), "{page}");
    }

    #[test]
    fn short_counts_and_ranges() {
        assert_eq!(count(Some(999.4)), "999");
        assert_eq!(count(Some(4_500.0)), "4.5k");
        assert_eq!(count(Some(1_240_000.0)), "1.24M");
        assert_eq!(range(&[2.0, 1.0, 3.0]), Some((1.0, 3.0)));
        assert_eq!(range(&[]), None);
        assert_eq!(slashed(&[1, 16, 64]), "1 / 16 / 64");
    }
}
