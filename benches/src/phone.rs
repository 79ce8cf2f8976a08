//! The phone profiles: what the engine sees on a phone, measured side by
//! side in one run. A phone's VpnService descriptor has no offload, so one
//! read and one write move one packet; its apps send segments of the TUN's
//! MTU. Each profile is a topology, an MTU for every link and the TUN, and
//! a driver:
//!
//! * **android**, the phone's own TUN: the client runs as an app's uid in
//!   the engine's namespace, routed into the TUN by a rule on that uid
//!   (`kerntun_testkit::uid_route`), as Android routes the apps a VPN
//!   covers; the TUN at the transmit queue length Android's TUN has
//!   ([`ANDROID_TXQUEUELEN`], the kernel's default: no app can change it,
//!   unlike `tun.tx_queue_len` of a device kerntun creates, 10000 by
//!   default, `core/src/tun/mod.rs`), and the engine on one runtime thread
//!   as on a phone ([`ANDROID_WORKERS`]);
//! * **router**: the client sits in a namespace of its own, routed over a
//!   veth into the engine's namespace, which forwards it into the TUN
//!   (`kerntun_testkit::router`), the case of a Linux gateway; **local**:
//!   the client runs next to the engine, its route to the server through
//!   the TUN (the topology of the desktop scenarios);
//! * **per-packet** (the TUN opened without `IFF_VNET_HDR`, as Android's
//!   descriptor is) and **batch** (virtio-net offload) drivers, system
//!   stack, direct outbound, splice on; and the no-TUN **baseline** of the
//!   same topology and MTU.
//!
//! The same profiles carry UDP ([`udp_profiles`]): QUIC-shaped traffic,
//! [`DATAGRAM`]-byte datagrams at full rate, router topology.
//!
//! This module holds the profile lists and what a phone run does to
//! `results.jsonl`; the harness (`src/bin/netbench/phone.rs`) runs them and
//! `crate::report` renders them.

use crate::record::{PhoneShape, Record, Topo};
use crate::scenario::{Outbound, SCENARIOS, Scenario};

/// The engine side of the profiles: (driver, the scenario of
/// [`SCENARIOS`] that runs it).
pub const DRIVERS: [(&str, &str); 2] = [
    ("per-packet", "system-per-packet"),
    ("batch", "system-batch"),
];

/// The transmit queue length of the android topology's TUN: what the
/// kernel gives a TUN device (`tun.tx_queue_len` in `core/src/tun/mod.rs`
/// says why kerntun raises it on devices it creates itself).
pub const ANDROID_TXQUEUELEN: u32 = 500;

/// The engine's runtime threads in the android topology: what it runs
/// with on Android and iOS (`workers = 0` is 1 there, 2 on desktop:
/// `core/src/engine.rs`), so the engine's own tasks (the driver and every
/// relay) share one thread as on a phone.
pub const ANDROID_WORKERS: usize = 1;

/// The uid the android topology's client runs as (an app's uid: Android
/// gives apps 10000 and up).
pub const ANDROID_UID: u32 = 10_123;

/// The datagram payload of the UDP profiles: QUIC's usual packet size (RFC
/// 9000 requires paths to carry at least 1200 bytes; stacks send that or a
/// little more).
pub const DATAGRAM: u32 = 1200;

/// One phone profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhoneProfile {
    pub topo: Topo,
    /// MTU of the TUN and of every veth on the way.
    pub mtu: u16,
    /// `None` for the no-TUN baseline.
    pub driver: Option<&'static str>,
    /// UDP datagrams (`iperf3 -u`) rather than TCP.
    pub udp: bool,
}

impl PhoneProfile {
    /// `router-1500-per-packet`, `local-9000-baseline`,
    /// `router-1500-batch-udp`...
    pub fn id(&self) -> String {
        format!(
            "{}-{}-{}{}",
            self.topo.as_str(),
            self.mtu,
            self.driver.unwrap_or("baseline"),
            if self.udp { "-udp" } else { "" }
        )
    }

    /// What its records say it is.
    pub fn shape(&self) -> PhoneShape {
        PhoneShape {
            profile: self.id(),
            topology: self.topo,
            mtu: self.mtu,
            driver: self.driver.map(Into::into),
        }
    }

    /// The engine scenario (`None` for the baseline).
    pub fn scenario(&self) -> Option<&'static Scenario> {
        let driver = self.driver?;
        if driver == SMOLTCP_DRIVER {
            return Some(&SMOLTCP_PER_PACKET);
        }
        let (_, id) = DRIVERS.iter().find(|(d, _)| *d == driver)?;
        SCENARIOS.iter().find(|s| s.id == *id)
    }

    /// The TUN's transmit queue length, where the profile sets one (else
    /// the engine's default).
    pub fn tx_queue_len(&self) -> Option<u32> {
        (self.topo == Topo::Android).then_some(ANDROID_TXQUEUELEN)
    }

    /// The engine's runtime threads, where the profile sets them (else
    /// the engine's default).
    pub fn workers(&self) -> Option<usize> {
        (self.topo == Topo::Android).then_some(ANDROID_WORKERS)
    }
}

/// The TCP profiles of each (topology, MTUs) group, in that order, baseline
/// first in each (topology, MTU); the smoltcp profile last.
pub fn profiles(groups: &[(Topo, Vec<u16>)]) -> Vec<PhoneProfile> {
    let mut out = Vec::new();
    for (topo, mtus) in groups {
        for &mtu in mtus {
            out.push(PhoneProfile {
                topo: *topo,
                mtu,
                driver: None,
                udp: false,
            });
            for (driver, _) in DRIVERS {
                out.push(PhoneProfile {
                    topo: *topo,
                    mtu,
                    driver: Some(driver),
                    udp: false,
                });
            }
        }
    }
    // Last in the list; the harness runs each group's profiles together.
    for (topo, mtus) in groups {
        out.extend(mtus.iter().filter_map(|&mtu| smoltcp_profile(*topo, mtu)));
    }
    out
}

/// The UDP profiles: router topology, each MTU, the baseline and each of
/// `drivers` (per-packet, batch).
pub fn udp_profiles(mtus: &[u16], drivers: &[String]) -> Result<Vec<PhoneProfile>, String> {
    let mut out = Vec::new();
    for &mtu in mtus {
        out.push(PhoneProfile {
            topo: Topo::Router,
            mtu,
            driver: None,
            udp: true,
        });
        for d in drivers {
            let Some((driver, _)) = DRIVERS.iter().find(|(x, _)| x == d) else {
                return Err(format!("unknown UDP driver {d:?} (per-packet, batch)"));
            };
            out.push(PhoneProfile {
                topo: Topo::Router,
                mtu,
                driver: Some(driver),
                udp: true,
            });
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// The smoltcp stack on the Android path.

/// The driver name of the smoltcp profile in the records and the page.
pub const SMOLTCP_DRIVER: &str = "smoltcp-per-packet";

/// The smoltcp stack behind the per-packet driver (the stack iOS uses where
/// the kernel listener cannot work), direct outbound, under the iOS budget
/// it runs with there: 64 KiB rings and one runtime thread. With the
/// desktop budget's 512 KiB rings, 64 upload streams ran at 1.57 Gbit/s
/// and 5.26 CPU s/GB against 2.48 and 3.14 with the iOS one (one run
/// each; which of rings and threads made the difference was not measured
/// apart: docs/notes.md, "smoltcp on the iOS budget in the phone
/// profile"). Not in [`SCENARIOS`]: only the phone profiles run it.
pub const SMOLTCP_PER_PACKET: Scenario = Scenario {
    id: "smoltcp-per-packet",
    label: "smoltcp stack, per-packet driver, direct, iOS budget",
    stack: "smoltcp",
    driver: "per-packet",
    outbound: Outbound::Direct,
    splice: None,
    config: Some("stack = \"smoltcp\"\n[budget]\nplatform = \"ios\"\n"),
    scale: false,
};

/// The smoltcp profiles of a group: router topology at MTU 1500 (the path
/// the per-packet targets are about), and the phone's own TUN at MTU 4064
/// (the iOS glue's MTU; the app next to the engine, as an iOS app is).
fn smoltcp_profile(topo: Topo, mtu: u16) -> Option<PhoneProfile> {
    matches!((topo, mtu), (Topo::Router, 1500) | (Topo::Android, 4064)).then_some(PhoneProfile {
        topo,
        mtu,
        driver: Some(SMOLTCP_DRIVER),
        udp: false,
    })
}

/// Keep the profiles whose driver is in `drivers` (`per-packet`, `batch`,
/// `smoltcp-per-packet`), and every baseline; empty `drivers` keeps all.
pub fn only_drivers(profiles: Vec<PhoneProfile>, drivers: &[String]) -> Vec<PhoneProfile> {
    if drivers.is_empty() {
        return profiles;
    }
    profiles
        .into_iter()
        .filter(|p| p.driver.is_none_or(|d| drivers.iter().any(|x| x == d)))
        .collect()
}

// ---------------------------------------------------------------------------
// What a phone run does to `results.jsonl`.

/// Records a phone run writes (the UDP part's included).
pub fn is_phone(r: &Record) -> bool {
    matches!(
        r,
        Record::PhoneMeta(_)
            | Record::Phone(_)
            | Record::PhoneIntegrity(_)
            | Record::PhoneUdpMeta(_)
            | Record::PhoneUdp(_)
    )
}

/// The topology of a phone profile id (`router-1500-batch`).
fn topology_of(id: &str) -> Option<Topo> {
    id.split('-').next()?.parse().ok()
}

/// What a phone run does to `results.jsonl`: each fresh meta record says
/// what it measured, and replaces that. A TCP meta replaces the runs, echo
/// checks and meta of its topologies (an older meta keeps the topologies
/// it alone measured); a UDP meta replaces the UDP part. Every other record
/// (the last full run's, other topologies') is kept; the fresh phone
/// records are appended.
pub fn replace(data: &mut Vec<Record>, fresh: &[Record]) {
    let mut topos: Vec<Topo> = Vec::new();
    let mut udp = false;
    for r in fresh {
        match r {
            Record::PhoneMeta(m) => topos.extend(&m.topologies),
            Record::PhoneUdpMeta(_) => udp = true,
            _ => {}
        }
    }
    let measured = |t: Option<Topo>| t.is_some_and(|t| topos.contains(&t));
    data.retain_mut(|r| match r {
        Record::PhoneMeta(m) => {
            m.topologies.retain(|t| !topos.contains(t));
            !m.topologies.is_empty()
        }
        Record::Phone(p) => !measured(Some(p.shape.topology)),
        Record::PhoneIntegrity(i) => !measured(topology_of(&i.scenario)),
        Record::PhoneUdpMeta(_) | Record::PhoneUdp(_) => !udp,
        _ => true,
    });
    data.extend(fresh.iter().filter(|r| is_phone(r)).cloned());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Direction, Integrity, Meta, PhoneMeta, PhoneRun, PhoneUdpMeta, Run};

    #[test]
    fn profiles_group_by_topology_and_mtu_with_the_baseline_first() {
        let all = profiles(&[
            (Topo::Android, vec![1500, 4064, 9000]),
            (Topo::Router, vec![1500, 9000]),
            (Topo::Local, vec![1500, 9000]),
        ]);
        let ids: Vec<String> = all.iter().map(PhoneProfile::id).collect();
        assert_eq!(
            ids.len(),
            23,
            "21 system-stack profiles and the two smoltcp ones"
        );
        assert_eq!(
            ids[..5],
            [
                "android-1500-baseline",
                "android-1500-per-packet",
                "android-1500-batch",
                "android-4064-baseline",
                "android-4064-per-packet",
            ]
        );
        assert_eq!(ids[9], "router-1500-baseline");
        assert_eq!(ids[20], "local-9000-batch");
        for p in &all {
            assert_eq!(
                p.tx_queue_len(),
                (p.topo == Topo::Android).then_some(ANDROID_TXQUEUELEN)
            );
            assert_eq!(
                p.workers(),
                (p.topo == Topo::Android).then_some(ANDROID_WORKERS)
            );
            match p.driver {
                None => assert!(p.scenario().is_none()),
                Some(d) => {
                    let sc = p.scenario().expect("engine scenario");
                    assert_eq!(sc.driver, d.trim_start_matches("smoltcp-"));
                    assert_eq!(
                        sc.stack,
                        if d == SMOLTCP_DRIVER {
                            "smoltcp"
                        } else {
                            "system"
                        }
                    );
                }
            }
        }
    }

    #[test]
    fn the_smoltcp_profiles_are_router_1500_and_android_4064_and_can_run_alone() {
        let android = profiles(&[(Topo::Android, vec![1500, 4064, 9000])]);
        let smol: Vec<String> = android
            .iter()
            .filter(|p| p.driver == Some(SMOLTCP_DRIVER))
            .map(PhoneProfile::id)
            .collect();
        assert_eq!(smol, ["android-4064-smoltcp-per-packet"]);
        let all = profiles(&[
            (Topo::Router, vec![1500, 9000]),
            (Topo::Local, vec![1500, 9000]),
        ]);
        let smol: Vec<&PhoneProfile> = all
            .iter()
            .filter(|p| p.driver == Some(SMOLTCP_DRIVER))
            .collect();
        assert_eq!(smol.len(), 1);
        assert_eq!(smol[0].id(), "router-1500-smoltcp-per-packet");
        let sc = smol[0].scenario().expect("engine scenario");
        assert_eq!((sc.stack, sc.driver), ("smoltcp", "per-packet"));
        assert!(
            SCENARIOS.iter().all(|s| s.id != sc.id),
            "a phone-only scenario"
        );
        let only = only_drivers(all.clone(), &[SMOLTCP_DRIVER.to_string()]);
        let ids: Vec<String> = only.iter().map(PhoneProfile::id).collect();
        assert_eq!(
            ids,
            [
                "router-1500-baseline",
                "router-9000-baseline",
                "local-1500-baseline",
                "local-9000-baseline",
                "router-1500-smoltcp-per-packet"
            ]
        );
        assert_eq!(only_drivers(all.clone(), &[]), all);
    }

    #[test]
    fn udp_profiles_are_the_router_topologys_and_name_themselves() {
        let all =
            udp_profiles(&[1500], &["per-packet".into(), "batch".into()]).expect("known drivers");
        let ids: Vec<String> = all.iter().map(PhoneProfile::id).collect();
        assert_eq!(
            ids,
            [
                "router-1500-baseline-udp",
                "router-1500-per-packet-udp",
                "router-1500-batch-udp"
            ]
        );
        assert!(all.iter().all(|p| p.udp && p.topo == Topo::Router));
        let e = udp_profiles(&[1500], &["smoltcp-per-packet".into()]).expect_err("TCP only");
        assert!(e.contains("smoltcp-per-packet"), "{e}");
    }

    fn run(topo: Topo, driver: Option<&str>) -> Record {
        let p = PhoneProfile {
            topo,
            mtu: 1500,
            driver: None,
            udp: false,
        };
        Record::Phone(PhoneRun {
            shape: PhoneShape {
                driver: driver.map(Into::into),
                ..p.shape()
            },
            counted: false,
            syscalls: None,
            run: Run::new(1, Direction::Upload),
        })
    }

    fn integrity(id: &str) -> Record {
        Record::PhoneIntegrity(Integrity {
            scenario: id.into(),
            bytes: 1,
            ok: true,
            secs: 0.1,
            error: None,
        })
    }

    fn meta(topologies: &[Topo]) -> Record {
        Record::PhoneMeta(PhoneMeta {
            topologies: topologies.to_vec(),
            ..PhoneMeta::default()
        })
    }

    /// A phone run of some topologies replaces theirs and keeps the rest:
    /// the last full run's records, the other topologies' runs and the
    /// part of the older meta that covers them.
    #[test]
    fn a_phone_run_replaces_only_what_it_measured() {
        let mut data = vec![
            Record::Meta(Meta::default()),
            meta(&[Topo::Router, Topo::Local]),
            Record::Integrity(Integrity {
                scenario: "system-batch".into(),
                bytes: 1,
                ok: true,
                secs: 0.1,
                error: None,
            }),
            run(Topo::Router, Some("batch")),
            run(Topo::Local, None),
            integrity("local-1500-batch"),
            integrity("router-1500-batch"),
            Record::PhoneUdpMeta(PhoneUdpMeta::default()),
        ];
        let fresh = vec![
            meta(&[Topo::Local, Topo::Android]),
            run(Topo::Android, None),
        ];
        replace(&mut data, &fresh);
        assert_eq!(
            data,
            vec![
                Record::Meta(Meta::default()),
                meta(&[Topo::Router]),
                data[2].clone(),
                run(Topo::Router, Some("batch")),
                integrity("router-1500-batch"),
                Record::PhoneUdpMeta(PhoneUdpMeta::default()),
                fresh[0].clone(),
                fresh[1].clone(),
            ]
        );
        // The UDP part alone replaces only the UDP records.
        let udp = vec![Record::PhoneUdpMeta(PhoneUdpMeta {
            datagram: DATAGRAM,
            ..PhoneUdpMeta::default()
        })];
        let before = data.len();
        replace(&mut data, &udp);
        assert_eq!(data.len(), before);
        assert_eq!(data.last(), udp.last());
        assert!(
            !data.contains(&Record::PhoneUdpMeta(PhoneUdpMeta::default())),
            "{data:?}"
        );
    }
}
