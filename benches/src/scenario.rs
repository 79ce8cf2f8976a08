//! The scenarios measured side by side. Adding one is one entry here: the
//! harness probes every engine scenario first and reports the ones this build
//! refuses (an unknown config field, an unsupported stack) as "not available
//! in this build" with the engine's own words, never with a number.

/// Where the engine sends a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outbound {
    /// No engine at all (the baseline).
    None,
    /// Straight to the destination, bound to the client veth.
    Direct,
    /// Through a Shadowsocks server with method `none`, run by the harness in
    /// the server namespace (`kerntun-bench-helper ss-none`).
    ShadowsocksNone,
}

impl Outbound {
    pub fn as_str(self) -> &'static str {
        match self {
            Outbound::None => "none",
            Outbound::Direct => "direct",
            Outbound::ShadowsocksNone => "shadowsocks-none",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scenario {
    /// Short id used in the data and the chart.
    pub id: &'static str,
    pub label: &'static str,
    /// Config `stack` value (`none` for the baseline).
    pub stack: &'static str,
    /// `kerntun run --driver` value (`-` for the baseline).
    pub driver: &'static str,
    pub outbound: Outbound,
    /// `relay.splice` when the scenario sets it; `None` keeps the default.
    pub splice: Option<bool>,
    /// The engine's TOML config (`kerntun run --config`), or `None` for the
    /// no-TUN baseline. The harness passes tun name, address, MTU, driver and
    /// the outbound interface as flags; `{ss_server}` is replaced by the
    /// address of the Shadowsocks server in the server namespace.
    pub config: Option<&'static str>,
    /// Part of the idle-connection scale test.
    pub scale: bool,
}

/// Every connection through the Shadowsocks outbound with method `none`
/// (docs/configuration.md "Outbounds, rules and the relay").
macro_rules! ss_none {
    () => {
        "[[rules]]\naction = \"ss\"\n\n[outbounds.ss]\ntype = \"shadowsocks\"\nserver = \"{ss_server}\"\nmethod = \"none\"\n"
    };
}

/// A scenario of the system stack with the direct outbound.
const fn system(
    id: &'static str,
    label: &'static str,
    driver: &'static str,
    splice: bool,
    config: &'static str,
) -> Scenario {
    Scenario {
        id,
        label,
        stack: "system",
        driver,
        outbound: Outbound::Direct,
        splice: Some(splice),
        config: Some(config),
        scale: false,
    }
}

pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        id: "baseline",
        label: "no TUN: iperf3 straight over the veth (the ceiling)",
        stack: "none",
        driver: "-",
        outbound: Outbound::None,
        splice: None,
        config: None,
        scale: false,
    },
    Scenario {
        scale: true,
        ..system(
            "system-batch",
            "system stack, batch driver, direct, splice on",
            "batch",
            true,
            "stack = \"system\"\n[relay]\nsplice = true\n",
        )
    },
    system(
        "system-per-packet",
        "system stack, per-packet driver, direct, splice on",
        "per-packet",
        true,
        "stack = \"system\"\n[relay]\nsplice = true\n",
    ),
    Scenario {
        scale: true,
        ..system(
            "system-copy",
            "system stack, batch driver, direct, splice off (userspace copy)",
            "batch",
            false,
            "stack = \"system\"\n[relay]\nsplice = false\n",
        )
    },
    Scenario {
        id: "smoltcp-batch",
        label: "smoltcp stack, batch driver, direct",
        stack: "smoltcp",
        driver: "batch",
        outbound: Outbound::Direct,
        splice: None,
        config: Some("stack = \"smoltcp\"\n"),
        scale: true,
    },
    Scenario {
        id: "ss-none-splice",
        label: "system stack, batch driver, Shadowsocks none, splice on",
        stack: "system",
        driver: "batch",
        outbound: Outbound::ShadowsocksNone,
        splice: Some(true),
        config: Some(concat!(
            "stack = \"system\"\n",
            "[relay]\nsplice = true\n",
            ss_none!()
        )),
        scale: false,
    },
    Scenario {
        id: "ss-none-copy",
        label: "system stack, batch driver, Shadowsocks none, splice off",
        stack: "system",
        driver: "batch",
        outbound: Outbound::ShadowsocksNone,
        splice: Some(false),
        config: Some(concat!(
            "stack = \"system\"\n",
            "[relay]\nsplice = false\n",
            ss_none!()
        )),
        scale: false,
    },
];

/// Words in an engine's start-up failure that mean "this build does not have
/// the feature" rather than "the harness or the engine is broken": an
/// unsupported stack, or a config key/variant the engine does not know.
const UNAVAILABLE: [&str; 4] = ["unknown field", "unknown variant", "stack:", "not built"];

/// The line of the engine's stderr that says the scenario is unavailable,
/// trimmed to the point (no temporary path, no list of expected keys), or
/// `None` when the failure is something else.
pub fn unavailable_reason(stderr: &str) -> Option<String> {
    let line = stderr
        .lines()
        .find(|l| UNAVAILABLE.iter().any(|w| l.contains(w)))?;
    let start = UNAVAILABLE
        .iter()
        .filter_map(|w| line.find(w))
        .min()
        .unwrap_or(0);
    let line = &line[start..];
    let end = line.find(", expected").unwrap_or(line.len());
    Some(line[..end].trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_are_valid_toml_and_ids_unique() {
        let mut ids = std::collections::HashSet::new();
        for s in SCENARIOS {
            assert!(ids.insert(s.id), "duplicate id {}", s.id);
            assert_eq!(s.config.is_none(), s.outbound == Outbound::None, "{}", s.id);
            if let Some(c) = s.config {
                let text = c.replace("{ss_server}", "198.19.1.2:8388");
                let v: toml::Table = text.parse().expect("scenario TOML");
                assert_eq!(
                    v.get("stack").and_then(|x| x.as_str()),
                    Some(s.stack),
                    "{}",
                    s.id
                );
                let splice = v
                    .get("relay")
                    .and_then(|r| r.get("splice"))
                    .and_then(|x| x.as_bool());
                assert_eq!(splice, s.splice, "{}", s.id);
            }
        }
        assert_eq!(SCENARIOS[0].id, "baseline", "the baseline runs first");
    }

    #[test]
    fn the_engines_refusals_read_as_unavailable() {
        assert_eq!(
            unavailable_reason(
                "kerntun: invalid configuration: stack: smoltcp is not built into this version\n"
            )
            .as_deref(),
            Some("stack: smoltcp is not built into this version")
        );
        let toml_err = "kerntun: /tmp/x/008-a.toml: TOML parse error at line 2, column 2\n  |\n2 | [relay]\n  |  ^^^^^\nunknown field `relay`, expected one of `stack`, `driver`\n";
        assert_eq!(
            unavailable_reason(toml_err).as_deref(),
            Some("unknown field `relay`")
        );
        assert_eq!(
            unavailable_reason("kerntun: creating the TUN: Operation not permitted"),
            None
        );
    }
}
