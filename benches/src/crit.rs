//! Criterion results as the harness summarises them: every
//! `<criterion dir>/**/new/{benchmark,estimates}.json` pair written since
//! the harness started the benches (older directories are leftovers of
//! benches that no longer exist and are skipped).

use std::path::Path;
use std::time::SystemTime;

use serde_json::Value;

use crate::record::CriterionFigure;

/// Collect figures under `dir` whose estimates were written at or after
/// `since`, sorted by bench id.
pub fn collect(dir: &Path, since: SystemTime) -> Vec<CriterionFigure> {
    let mut out = Vec::new();
    walk(dir, since, &mut out, 0);
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

fn walk(dir: &Path, since: SystemTime, out: &mut Vec<CriterionFigure>, depth: usize) {
    // Criterion nests group/function/value/new: 6 levels is plenty.
    if depth > 6 {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if !path.is_dir() {
            continue;
        }
        if e.file_name() == "new" {
            let est = path.join("estimates.json");
            let fresh = std::fs::metadata(&est)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= since);
            if !fresh {
                continue;
            }
            let (Ok(b), Ok(s)) = (
                std::fs::read_to_string(path.join("benchmark.json")),
                std::fs::read_to_string(&est),
            ) else {
                continue;
            };
            if let Some(f) = parse(&b, &s) {
                out.push(f);
            }
        } else if e.file_name() != "base" && e.file_name() != "report" {
            walk(&path, since, out, depth + 1);
        }
    }
}

/// One bench from criterion's `benchmark.json` and `estimates.json`.
pub fn parse(benchmark: &str, estimates: &str) -> Option<CriterionFigure> {
    let b: Value = serde_json::from_str(benchmark).ok()?;
    let e: Value = serde_json::from_str(estimates).ok()?;
    let mean = e.get("mean")?;
    let ci = mean.get("confidence_interval")?;
    let elements = b
        .get("throughput")
        .and_then(|t| t.get("Elements"))
        .and_then(Value::as_u64);
    Some(CriterionFigure {
        id: b.get("full_id")?.as_str()?.to_owned(),
        mean_ns: mean.get("point_estimate")?.as_f64()?,
        low_ns: ci.get("lower_bound")?.as_f64()?,
        high_ns: ci.get("upper_bound")?.as_f64()?,
        elements,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BENCH: &str = r#"{"group_id":"batch","function_id":"1024_flows_lifecycle","value_str":null,
        "throughput":{"Elements":1024},"full_id":"batch/1024_flows_lifecycle",
        "directory_name":"batch/1024_flows_lifecycle","title":"batch/1024_flows_lifecycle"}"#;
    const EST: &str = r#"{"mean":{"confidence_interval":{"confidence_level":0.95,
        "lower_bound":322996.9,"upper_bound":337696.5},"point_estimate":330417.3,
        "standard_error":3750.9}}"#;

    #[test]
    fn parses_one_bench() {
        let f = parse(BENCH, EST).expect("figure");
        assert_eq!(f.id, "batch/1024_flows_lifecycle");
        assert_eq!(f.elements, Some(1024));
        assert!((f.mean_ns - 330417.3).abs() < 1e-6);
        assert!(f.low_ns < f.mean_ns && f.mean_ns < f.high_ns);
        assert!(parse(BENCH, "{}").is_none());
    }

    #[test]
    fn collects_only_fresh_results() {
        let dir = std::env::temp_dir().join(format!("kt-crit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let new = dir.join("batch/1024_flows_lifecycle/new");
        std::fs::create_dir_all(&new).expect("mkdir");
        std::fs::write(new.join("benchmark.json"), BENCH).expect("write");
        std::fs::write(new.join("estimates.json"), EST).expect("write");
        // A `base` copy must not be counted twice.
        let base = dir.join("batch/1024_flows_lifecycle/base");
        std::fs::create_dir_all(&base).expect("mkdir");
        std::fs::write(base.join("benchmark.json"), BENCH).expect("write");
        std::fs::write(base.join("estimates.json"), EST).expect("write");
        let past = SystemTime::now() - std::time::Duration::from_secs(3600);
        let found = collect(&dir, past);
        assert_eq!(found.len(), 1, "{found:?}");
        let future = SystemTime::now() + std::time::Duration::from_secs(3600);
        assert!(collect(&dir, future).is_empty(), "stale results skipped");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
