//! The figures the harness takes from `iperf3 -J` (iperf 3.x JSON).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Which way an iperf3 run sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// The client (behind the TUN) sends to the server.
    Upload,
    /// `iperf3 -R`: the server sends to the client.
    Download,
}

impl Direction {
    pub const BOTH: [Direction; 2] = [Direction::Upload, Direction::Download];

    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Upload => "upload",
            Direction::Download => "download",
        }
    }
}

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
    let end = end_of(json)?;
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
    moved_data(bytes, seconds)?;
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

/// The `end` member of `iperf3 -J` output; a run that failed (an `error`
/// member) is an error with iperf3's words.
fn end_of(json: &str) -> Result<Value, String> {
    let mut v: Value = serde_json::from_str(json).map_err(|e| format!("iperf3 JSON: {e}"))?;
    if let Some(err) = v.get("error").and_then(Value::as_str) {
        return Err(format!("iperf3: {err}"));
    }
    v.get_mut("end")
        .map(Value::take)
        .ok_or_else(|| "iperf3 JSON: no `end`".into())
}

/// A run that delivered nothing is an error.
fn moved_data(bytes: u64, seconds: f64) -> Result<(), String> {
    if bytes == 0 || seconds <= 0.0 {
        return Err("iperf3 moved no data".into());
    }
    Ok(())
}

/// One iperf3 UDP run (`-u`): what the receiver got, and what the sender
/// offered.
#[derive(Debug, Clone, PartialEq)]
pub struct IperfUdp {
    /// Payload bytes that reached the receiver, its duration and rate.
    pub bytes: u64,
    pub seconds: f64,
    pub bits_per_second: f64,
    /// Payload bytes the sender sent.
    pub sent_bytes: u64,
    /// Datagrams the receiver found missing (gaps in iperf3's sequence
    /// numbers) and the datagrams it accounted for (received + lost).
    pub lost_packets: u64,
    pub packets: u64,
}

impl IperfUdp {
    /// Lost datagrams over all datagrams, 0..=1.
    pub fn loss(&self) -> Option<f64> {
        (self.packets > 0).then(|| self.lost_packets as f64 / self.packets as f64)
    }
}

/// Parse `iperf3 -u -J` output (iperf 3.12 and later: `end.sum_received`
/// and `end.sum_sent`). A failed run or one that delivered nothing is an
/// error with iperf3's words.
pub fn parse_udp(json: &str) -> Result<IperfUdp, String> {
    let end = end_of(json)?;
    let side = |k: &str| {
        end.get(k)
            .ok_or_else(|| format!("iperf3 JSON: no `end.{k}` (iperf3 older than 3.12?)"))
    };
    let (recv, sent) = (side("sum_received")?, side("sum_sent")?);
    let int = |o: &Value, k: &str| {
        o.get(k)
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("iperf3 JSON: no `{k}`"))
    };
    let num = |o: &Value, k: &str| {
        o.get(k)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("iperf3 JSON: no `{k}`"))
    };
    let r = IperfUdp {
        bytes: int(recv, "bytes")?,
        seconds: num(recv, "seconds")?,
        bits_per_second: num(recv, "bits_per_second")?,
        sent_bytes: int(sent, "bytes")?,
        lost_packets: int(recv, "lost_packets")?,
        packets: int(recv, "packets")?,
    };
    moved_data(r.bytes, r.seconds)?;
    Ok(r)
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

    /// Trimmed from a real `iperf3 -c 127.0.0.1 -u -b 0 -l 1200 -t 1 -J` (iperf 3.12).
    const UDP: &str = r#"{
        "start": {"version": "iperf 3.12"},
        "end": {
            "sum": {"seconds": 1.000053, "bytes": 336528000, "bits_per_second": 2692170156.5968685,
                    "lost_packets": 26673, "packets": 280440, "lost_percent": 9.51, "sender": true},
            "sum_sent": {"seconds": 1.00002, "bytes": 336528000, "bits_per_second": 2692170156.5968685,
                         "lost_packets": 0, "packets": 280440, "lost_percent": 0, "sender": true},
            "sum_received": {"seconds": 1.000053, "bytes": 304508400, "bits_per_second": 2435938095.28095,
                             "lost_packets": 26673, "packets": 280430, "lost_percent": 9.51, "sender": false}
        }
    }"#;

    #[test]
    fn udp_runs_take_the_receiver_and_its_losses() {
        let r = parse_udp(UDP).expect("valid run");
        assert_eq!(r.bytes, 304_508_400, "received, not sent");
        assert_eq!(r.sent_bytes, 336_528_000);
        assert!((r.bits_per_second - 2_435_938_095.28).abs() < 1.0);
        assert_eq!((r.lost_packets, r.packets), (26_673, 280_430));
        assert!((r.loss().expect("packets") - 0.0951).abs() < 1e-3);
        // A TCP run has no UDP loss figures.
        assert!(parse_udp(OK).expect_err("tcp").contains("lost_packets"));
        let mut v: Value = serde_json::from_str(UDP).expect("fixture");
        v["end"]["sum_received"]["bytes"] = 0.into();
        assert_eq!(
            parse_udp(&v.to_string()).expect_err("nothing arrived"),
            "iperf3 moved no data"
        );
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
