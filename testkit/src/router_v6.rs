//! IPv6 for the router topology ([`Router`]): the app namespace gets
//! fd00:233:N::2/64 behind the client namespace's fd00:233:N::1, which
//! forwards its packets for the server's IPv6 address into the TUN by the
//! same policy rule (`iif kte lookup 233`), and the server routes the app's
//! prefix back through the client namespace.
//!
//! ```text
//!  app ns                       client ns (engine)               server ns
//!  fd00:233:N::2/64 ── "kta"/"kte" ── fd00:233:N::1/64            fd00:19:N::2
//!  default via fd00:233:N::1      -6 rule iif kte lookup 233:     route fd00:233:N::/64
//!                                 server/128 dev <TUN>            via fd00:19:N::1
//! ```

use std::io;
use std::net::Ipv6Addr;

use crate::Topology;
use crate::router::{APP_TABLE, APP_VETH, GATEWAY_VETH, Router};

impl Router {
    /// The topology's subnet index N, as in the IPv4 addresses.
    fn index(&self) -> u16 {
        u16::from(self.app_v4().octets()[2])
    }

    /// The app's IPv6 address (after [`Router::add_v6`]).
    pub fn app_v6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x233, self.index(), 0, 0, 0, 0, 2)
    }

    /// The client namespace's IPv6 address on the app's link.
    pub fn gateway_v6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd00, 0x233, self.index(), 0, 0, 0, 0, 1)
    }

    /// Give the app's link IPv6 addresses, forwarding and routes both ways,
    /// and the IPv6 policy rule (call once, after [`Router::attach`]).
    pub fn add_v6(&self, topo: &Topology) -> io::Result<()> {
        let (a6, g6) = (self.app_v6().to_string(), self.gateway_v6().to_string());
        topo.client
            .exec("sysctl", &["-qw", "net.ipv6.conf.all.forwarding=1"])?;
        topo.client.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{g6}/64"),
            "dev",
            GATEWAY_VETH,
            "nodad",
        ])?;
        self.app.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{a6}/64"),
            "dev",
            APP_VETH,
            "nodad",
        ])?;
        self.app
            .ip(&["-6", "route", "add", "default", "via", &g6])?;
        // Static neighbours both ways (no resolution delay), from the MACs
        // the IPv4 side gave the pair.
        let mac = |ns: &crate::Netns, dev: &str| {
            ns.exec("cat", &[&format!("/sys/class/net/{dev}/address")])
                .map(|m| m.trim().to_owned())
        };
        let (amac, gmac) = (mac(&self.app, APP_VETH)?, mac(&topo.client, GATEWAY_VETH)?);
        self.pin_neighbours(topo, "-6", (&a6, &amac), (&g6, &gmac))?;
        topo.server.ip(&[
            "-6",
            "route",
            "replace",
            &format!("fd00:233:{:x}::/64", self.index()),
            "via",
            &topo.client_v6().to_string(),
        ])?;
        self.add_rule(topo, "-6")
    }

    /// Send what the app sends to the server's IPv6 address into `tun`.
    pub fn route_v6_via_tun(&self, topo: &Topology, tun: &str) -> io::Result<()> {
        topo.client
            .route_host(topo.server(true), tun, Some(APP_TABLE))
    }
}
