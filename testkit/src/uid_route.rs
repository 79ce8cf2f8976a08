//! An app's uid routed into the TUN, as Android routes the apps a VPN
//! covers into its VpnService TUN: a policy rule on the uid in the engine's
//! namespace (`ip rule add uidrange U-U lookup T`), and table T sending the
//! server into the TUN. Sockets of every other uid, the engine's own
//! included, keep the main table.
//!
//! ```text
//!  client ns (engine)                                            server ns
//!  app, uid U ── ip rule uidrange U-U ─► table 234: server/32 dev <TUN>
//!                                                  │ direct out
//!  veth "ktc" 198.19.N.1 ────────────────────────────── "kts" 198.19.N.2
//! ```
//!
//! With no route in table 234 (no engine running) the rule's lookup falls
//! through to the main table and the app reaches the server over the veth:
//! the no-TUN baseline of the same topology. IPv4 only.

use std::io;
use std::net::Ipv4Addr;

use crate::{Topology, sh};

/// The routing table the uid rule sends the app's packets to.
pub const UID_TABLE: &str = "234";
/// The rule's preference (before the main table's 32766).
const PREF: &str = "1001";

/// A uid rule in a [`Topology`]'s client namespace; removed on drop.
#[derive(Debug)]
pub struct UidRoute {
    /// The client namespace.
    ns: String,
    uid: u32,
    server: Ipv4Addr,
}

impl UidRoute {
    /// Add the rule for `uid`. Reverse-path filtering is turned off in the
    /// namespace: the packets the engine writes back arrive on the TUN
    /// with the server as source, which the main table routes over the
    /// veth.
    pub fn attach(topo: &Topology, uid: u32) -> io::Result<UidRoute> {
        for key in [
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ] {
            topo.client.exec("sysctl", &["-qw", key])?;
        }
        let range = format!("{uid}-{uid}");
        // `del` first: a rule left by an earlier attach would match first.
        let _ = topo
            .client
            .ip(&["rule", "del", "uidrange", &range, "lookup", UID_TABLE]);
        topo.client.ip(&[
            "rule", "add", "uidrange", &range, "lookup", UID_TABLE, "pref", PREF,
        ])?;
        Ok(UidRoute {
            ns: topo.client.name().to_owned(),
            uid,
            server: topo.server_v4(),
        })
    }

    pub fn uid(&self) -> u32 {
        self.uid
    }

    /// Send what the uid sends to the server into `tun` (call once the
    /// engine created it; the route goes when the device does).
    pub fn route_via_tun(&self, tun: &str) -> io::Result<()> {
        crate::route_host(&self.ns, self.server.into(), tun, Some(UID_TABLE))
    }
}

impl Drop for UidRoute {
    fn drop(&mut self) {
        let range = format!("{0}-{0}", self.uid);
        let _ = sh(
            "ip",
            &[
                "-n", &self.ns, "rule", "del", "uidrange", &range, "lookup", UID_TABLE,
            ],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's own answer (`ip route get ... uid U`): the uid's
    /// packets to the server take the device of table 234, everyone else's
    /// the veth; without the rule, the uid's take the veth too.
    #[test]
    fn only_the_uid_is_routed_into_the_device() {
        let topo = crate::root_topology!();
        // A stand-in for the engine's TUN: any device up in the namespace.
        topo.client
            .ip(&[
                "link", "add", "ktdum", "type", "veth", "peer", "name", "ktdum2",
            ])
            .expect("veth");
        for dev in ["ktdum", "ktdum2"] {
            topo.client.ip(&["link", "set", dev, "up"]).expect("up");
        }
        let server = topo.server_v4().to_string();
        let via = |uid: u32| {
            topo.client
                .exec("ip", &["route", "get", &server, "uid", &uid.to_string()])
                .expect("route get")
        };
        {
            let r = UidRoute::attach(&topo, 10_123).expect("rule");
            r.route_via_tun("ktdum").expect("route");
            assert!(via(10_123).contains("dev ktdum"), "{}", via(10_123));
            assert!(via(0).contains("dev ktc"), "{}", via(0));
            assert!(via(10_124).contains("dev ktc"), "{}", via(10_124));
            // Attached again (a harness that restarted): still one rule.
            drop(r);
            let r = UidRoute::attach(&topo, 10_123).expect("rule again");
            assert_eq!(r.uid(), 10_123);
            let rules = topo.client.exec("ip", &["rule", "show"]).expect("rules");
            assert_eq!(rules.matches("uidrange 10123-10123").count(), 1, "{rules}");
        }
        let rules = topo.client.exec("ip", &["rule", "show"]).expect("rules");
        assert!(!rules.contains("uidrange"), "removed on drop: {rules}");
        assert!(via(10_123).contains("dev ktc"), "{}", via(10_123));
    }
}
