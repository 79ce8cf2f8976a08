//! The router topology: a third namespace whose traffic the client
//! namespace forwards, as a phone forwards its apps' traffic into a VPN
//! app's TUN. The TUN then sees segments of the link's MTU, built by a
//! kernel other than the one that receives them, instead of the 64 KiB
//! packets a client local to a large-MTU TUN hands it.
//!
//! ```text
//!  app ns                   client ns (engine)                        server ns
//!  client ── veth "kta" ─── "kte" ── ip rule iif kte ─► table 233:
//!            10.233.N.2/24  10.233.N.1/24               server/32 dev <TUN>
//!            default via .1  ip_forward = 1                  │ direct out
//!                           veth "ktc" 198.19.N.1 ──────────── "kts" 198.19.N.2
//!                                                     route 10.233.N.0/24 via 198.19.N.1
//! ```
//!
//! With no route in table 233 (no engine running) the rule's lookup falls
//! through to the main table and the client namespace forwards the app's
//! packets straight to the server: the no-TUN baseline of the same
//! topology. IPv4 only.

use std::io;
use std::net::Ipv4Addr;

use crate::{CLIENT_VETH, Netns, Topology};

/// The app namespace's side of its veth pair.
pub const APP_VETH: &str = "kta";
/// The client (engine) namespace's side of the app's veth pair.
pub const GATEWAY_VETH: &str = "kte";
/// The routing table the policy rule sends the app's packets to.
pub const APP_TABLE: &str = "233";
/// The server namespace's side of the topology's veth pair.
const SERVER_VETH: &str = "kts";

/// An app namespace attached to a [`Topology`]; deleted on drop, its veth
/// pair first.
#[derive(Debug)]
pub struct Router {
    pub app: Netns,
    /// The topology's subnet index N (10.233.N.0/24).
    id: u32,
    /// The topology's client namespace, which holds the gateway's veth.
    client: String,
}

impl Router {
    /// Create the app namespace, its veth pair into `topo.client`, the
    /// forwarding and the routes both ways, and the policy rule.
    pub fn attach(topo: &Topology) -> io::Result<Router> {
        let id = topo.id;
        let app = Netns::new(&format!("a{id}"))?;
        let r = Router {
            app,
            id,
            client: topo.client.name().to_owned(),
        };
        let (amac, gmac) = (
            format!("02:6b:74:01:{id:02x}:02"),
            format!("02:6b:74:01:{id:02x}:01"),
        );
        let (a4, g4) = (r.app_v4().to_string(), r.gateway_v4().to_string());
        topo.client.ip(&[
            "link",
            "add",
            GATEWAY_VETH,
            "address",
            &gmac,
            "type",
            "veth",
            "peer",
            "name",
            APP_VETH,
            "address",
            &amac,
            "netns",
            r.app.name(),
        ])?;
        topo.client.addr_up(GATEWAY_VETH, &format!("{g4}/24"))?;
        r.app.addr_up(APP_VETH, &format!("{a4}/24"))?;
        r.app.ip(&["route", "add", "default", "via", &g4])?;
        // Packets the engine writes back carry the server as source and
        // arrive on the TUN, whose routes do not cover it: strict reverse
        // path filtering would drop them ("all" and the device's value
        // combine with max, and the TUN takes "default" when created).
        for key in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
            "net.ipv4.conf.kte.rp_filter=0",
        ] {
            topo.client.exec("sysctl", &["-qw", key])?;
        }
        // `replace`: a router attached to the same topology before left
        // this route behind (it lives in the server's namespace).
        topo.server.ip(&[
            "route",
            "replace",
            &format!("10.233.{id}.0/24"),
            "via",
            &topo.client_v4().to_string(),
        ])?;
        // Static neighbours, as in `Topology::new`: no resolution delay on
        // the first packets.
        r.pin_neighbours(topo, "-4", (&a4, &amac), (&g4, &gmac))?;
        r.add_rule(topo, "-4")?;
        Ok(r)
    }

    /// Static neighbours both ways on the app's link, for the family
    /// `family` (`-4` or `-6`): the app's address and MAC, the gateway's.
    pub(crate) fn pin_neighbours(
        &self,
        topo: &Topology,
        family: &str,
        (app, app_mac): (&str, &str),
        (gateway, gateway_mac): (&str, &str),
    ) -> io::Result<()> {
        self.app
            .pin_neighbour(family, gateway, gateway_mac, APP_VETH)?;
        topo.client
            .pin_neighbour(family, app, app_mac, GATEWAY_VETH)
    }

    /// The policy rule `iif kte lookup 233` for the family `family` (`-4`
    /// or `-6`). `del` first: a router attached to the same topology before
    /// left its rule behind (the rule lives in the client namespace), and a
    /// second one would fail with EEXIST.
    pub(crate) fn add_rule(&self, topo: &Topology, family: &str) -> io::Result<()> {
        let rule = ["iif", GATEWAY_VETH, "lookup", APP_TABLE, "pref", "1000"];
        let _ = topo
            .client
            .ip(&[&[family, "rule", "del"][..], &rule].concat());
        topo.client
            .ip(&[&[family, "rule", "add"][..], &rule].concat())
    }

    /// The app's address (the client of the router topology).
    pub fn app_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 233, self.id as u8, 2)
    }

    /// The client namespace's address on the app's link (the app's gateway).
    pub fn gateway_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 233, self.id as u8, 1)
    }

    /// Send what the app sends to the server into `tun` (call once the
    /// engine created it; the route goes when the device does).
    pub fn route_via_tun(&self, topo: &Topology, tun: &str) -> io::Result<()> {
        topo.client
            .route_host(topo.server(false), tun, Some(APP_TABLE))
    }

    /// Set the MTU of every veth of the topology, the app's pair included.
    pub fn set_mtu(&self, topo: &Topology, mtu: u16) -> io::Result<()> {
        let m = mtu.to_string();
        self.app.ip(&["link", "set", APP_VETH, "mtu", &m])?;
        topo.client.ip(&["link", "set", GATEWAY_VETH, "mtu", &m])?;
        topo.client.ip(&["link", "set", CLIENT_VETH, "mtu", &m])?;
        topo.server.ip(&["link", "set", SERVER_VETH, "mtu", &m])
    }
}

impl Drop for Router {
    /// The veth pair goes now: deleting a namespace destroys its devices
    /// only later (the kernel cleans namespaces up in the background), and
    /// a router attached again right away would find the gateway's end
    /// still there.
    fn drop(&mut self) {
        let _ = crate::sh("ip", &["-n", &self.client, "link", "del", GATEWAY_VETH]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{client, servers};
    use std::net::SocketAddr;

    /// Without an engine the client namespace forwards the app's
    /// connection to the server (the baseline path), at the MTU asked for.
    #[test]
    fn app_reaches_the_server_through_the_forwarding_namespace() {
        let topo = crate::root_topology!();
        let r = Router::attach(&topo).expect("router");
        r.set_mtu(&topo, 9000).expect("mtu");
        let echo = servers::tcp(
            &topo.server,
            SocketAddr::new(topo.server(false), 0),
            servers::Mode::Echo,
        )
        .expect("echo server");
        let to = echo.addr;
        let t = r
            .app
            .spawn(move || client::echo_transfer(to, 7, 4 << 20, false))
            .expect("thread")
            .join()
            .expect("join")
            .expect("echo through the forwarding namespace");
        assert_eq!(t.bytes, 4 << 20);
        let mtu = topo
            .client
            .exec("cat", &[&format!("/sys/class/net/{GATEWAY_VETH}/mtu")])
            .expect("mtu");
        assert_eq!(mtu.trim(), "9000");
        // Attached again to the same topology (the benchmark's phone TCP
        // part, then its UDP part): one rule, and the path still works.
        drop(r);
        let r = Router::attach(&topo).expect("router again");
        let rules = topo.client.exec("ip", &["rule", "show"]).expect("rules");
        assert_eq!(rules.matches("iif kte lookup 233").count(), 1, "{rules}");
        r.app
            .spawn(move || client::echo_transfer(to, 8, 1 << 20, false))
            .expect("thread")
            .join()
            .expect("join")
            .expect("echo through the second router");
    }
}
