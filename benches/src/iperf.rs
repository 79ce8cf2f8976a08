//! The figures the harness takes from `iperf3 -J` (iperf 3.x JSON).

use serde_json::Value;

/// One iperf3 client run, as the receiver saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct IperfRun {
    /// Payload bytes that reached the receiving side.
    pub bytes: u64,
    /// Receiver-side duration.
    pub seconds: f64,
    pub bits_per_second: f64,
    /// TCP retransmits of the sending side (reported by the sender only).
    pub retransmits: Option<u64>,
    /// CPU utilisation (percent of one core) of the iperf3 client and server.
    pub cpu_host: Option<f64>,
    pub cpu_remote: Option<f64>,
}

/// Parse `iperf3 -J` output. A run that failed (iperf3 puts an `error`
/// member in its JSON) or moved nothing is an error carrying iperf3's words.
pub fn parse(json: &str) -> Result<IperfRun, String> {
    let v: Value = serde_json::from_str(json).map_err(|e| format!("iperf3 JSON: {e}"))?;
    if let Some(err) = v.get("error").and_then(Value::as_str) {
        return Err(format!("iperf3: {err}"));
    }
    let end = v.get("end").ok_or("iperf3 JSON: no `end`")?;
    let recv = end
        .get("sum_received")
        .ok_or("iperf3 JSON: no `end.sum_received` (not a TCP test?)")?;
    let num = |o: &Value, k: &str| o.get(k).and_then(Value::as_f64);
    let bytes = recv
        .get("bytes")
        .and_then(Value::as_u64)
        .ok_or("iperf3 JSON: no received bytes")?;
    let seconds = num(recv, "seconds").ok_or("iperf3 JSON: no duration")?;
    let bits_per_second = num(recv, "bits_per_second").ok_or("iperf3 JSON: no rate")?;
    if bytes == 0 || seconds <= 0.0 {
        return Err("iperf3 moved no data".into());
    }
    let cpu = end.get("cpu_utilization_percent");
    Ok(IperfRun {
        bytes,
        seconds,
        bits_per_second,
        retransmits: end
            .get("sum_sent")
            .and_then(|s| s.get("retransmits"))
            .and_then(Value::as_u64),
        cpu_host: cpu.and_then(|c| num(c, "host_total")),
        cpu_remote: cpu.and_then(|c| num(c, "remote_total")),
    })
}

/// `iperf 3.12` from the `start.version` member, if present.
pub fn version(json: &str) -> Option<String> {
    let v: Value = serde_json::from_str(json).ok()?;
    Some(v.get("start")?.get("version")?.as_str()?.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Trimmed from a real `iperf3 -c 127.0.0.1 -t 1 -P 2 -J` (iperf 3.12).
    const OK: &str = r#"{
        "start": {"version": "iperf 3.12", "connected": []},
        "intervals": [],
        "end": {
            "streams": [],
            "sum_sent": {"start": 0, "end": 1.0034, "seconds": 1.0034, "bytes": 1347420160,
                         "bits_per_second": 10742835638.827984, "retransmits": 4, "sender": true},
            "sum_received": {"start": 0, "end": 1.003463, "seconds": 1.003463, "bytes": 1347420160,
                             "bits_per_second": 10742161175.848038, "sender": true},
            "cpu_utilization_percent": {"host_total": 28.27, "remote_total": 36.44}
        }
    }"#;

    #[test]
    fn parses_the_receiver_side() {
        let r = parse(OK).expect("valid run");
        assert_eq!(r.bytes, 1_347_420_160);
        assert!((r.bits_per_second - 10_742_161_175.848).abs() < 1.0);
        assert_eq!(r.retransmits, Some(4));
        assert_eq!(r.cpu_host, Some(28.27));
        assert_eq!(r.cpu_remote, Some(36.44));
        assert_eq!(version(OK).as_deref(), Some("iperf 3.12"));
    }

    #[test]
    fn failures_carry_iperfs_words() {
        let refused = r#"{"start": {"connected": []}, "intervals": [], "end": {},
                          "error": "unable to connect to server: Connection refused"}"#;
        let e = parse(refused).expect_err("failed run");
        assert!(e.contains("Connection refused"), "{e}");
        assert!(parse("not json").is_err());
        let mut v: Value = serde_json::from_str(OK).expect("fixture");
        v["end"]["sum_received"]["bytes"] = 0.into();
        assert_eq!(
            parse(&v.to_string()).expect_err("no bytes"),
            "iperf3 moved no data"
        );
    }
}
