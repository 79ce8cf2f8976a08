//! `kerntun run --auto-route` end to end, in namespaces the tests create:
//!
//! ```text
//!  lan ns                 host ns (kerntun runs here)            server ns
//!  lan1 10.233.2.2 ──── lan0 10.233.2.1     up0 10.233.1.1 ──── up1 10.233.1.2
//!  default via .2.1      TUN ktar0 198.18.0.1/16, fd00:18::1/64   lo 10.233.99.1
//!                        default via 10.233.1.2 (the "internet")     fd00:233:99::1
//! ```
//!
//! The server's addresses are reached from the host only by its default
//! route, which auto-route replaces for everything but the engine's marked
//! sockets; the server namespace has no route back to the LAN, so a LAN
//! client can only reach it through the engine. The engine's final
//! statistics count every connection the tests make. Routing state (rules
//! and routes of both families in all tables, the sysctls auto-route may
//! change, the namespace's resolv.conf) must be byte-for-byte what it was
//! after a stop, and after a SIGKILLed run once the next run has stopped.
//!
//! Needs root; otherwise each test prints why it skipped.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use common::{Running, stats_lines};
use kerntun_testkit::dns::{DnsServer, Zone};
use kerntun_testkit::servers::{self, Mode};
use kerntun_testkit::{Netns, client, require_root, tokio_servers, within};
use nix::sys::signal::Signal;

const SERVER4: &str = "10.233.99.1";
const SERVER6: &str = "fd00:233:99::1";
/// The Shadowsocks server, also reached only by the host's default route.
const SS_SERVER: &str = "10.233.99.2";
const NAME: &str = "server.kt.test";
const TUN: &str = "ktar0";

/// The three namespaces, the servers, the namespace's resolv.conf and the
/// engine's config file; all removed on drop.
struct Net {
    host: Netns,
    server: Netns,
    lan: Netns,
    tcp4: servers::Server,
    tcp6: servers::Server,
    udp4: servers::Server,
    dns: DnsServer,
    etc: PathBuf,
    config: PathBuf,
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.etc);
        let _ = std::fs::remove_file(&self.config);
    }
}

fn veth(a: &Netns, a_dev: &str, b: &Netns, b_dev: &str) {
    a.ip(&[
        "link",
        "add",
        a_dev,
        "type",
        "veth",
        "peer",
        "name",
        b_dev,
        "netns",
        b.name(),
    ])
    .expect("veth");
    a.ip(&["link", "set", a_dev, "up"]).expect("link up");
    b.ip(&["link", "set", b_dev, "up"]).expect("link up");
}

fn addr(ns: &Netns, dev: &str, a4: &str, a6: &str) {
    ns.ip(&["addr", "add", a4, "dev", dev]).expect("addr");
    ns.ip(&["-6", "addr", "add", a6, "dev", dev, "nodad"])
        .expect("addr6");
}

impl Net {
    fn new(tag: &str) -> Net {
        kerntun_testkit::sweep_stale();
        let host = Netns::new(&format!("{tag}h")).expect("host ns");
        let server = Netns::new(&format!("{tag}s")).expect("server ns");
        let lan = Netns::new(&format!("{tag}l")).expect("lan ns");
        // The engine's TUN addresses would otherwise stay tentative (DAD).
        for k in ["default", "all"] {
            host.exec(
                "sysctl",
                &["-qw", &format!("net.ipv6.conf.{k}.accept_dad=0")],
            )
            .expect("sysctl");
        }
        veth(&host, "up0", &server, "up1");
        addr(&host, "up0", "10.233.1.1/24", "fd00:233:1::1/64");
        addr(&server, "up1", "10.233.1.2/24", "fd00:233:1::2/64");
        server
            .ip(&["addr", "add", &format!("{SERVER4}/32"), "dev", "lo"])
            .expect("server addr");
        server
            .ip(&["-6", "addr", "add", &format!("{SERVER6}/128"), "dev", "lo"])
            .expect("server addr6");
        server
            .ip(&["addr", "add", &format!("{SS_SERVER}/32"), "dev", "lo"])
            .expect("ss server addr");
        host.ip(&["route", "add", "default", "via", "10.233.1.2"])
            .expect("default");
        host.ip(&["-6", "route", "add", "default", "via", "fd00:233:1::2"])
            .expect("default6");
        veth(&host, "lan0", &lan, "lan1");
        addr(&host, "lan0", "10.233.2.1/24", "fd00:233:2::1/64");
        addr(&lan, "lan1", "10.233.2.2/24", "fd00:233:2::2/64");
        lan.ip(&["route", "add", "default", "via", "10.233.2.1"])
            .expect("lan default");
        lan.ip(&["-6", "route", "add", "default", "via", "fd00:233:2::1"])
            .expect("lan default6");
        // Strict reverse-path filtering, as some distributions ship: the
        // engine's replies must still get through, and the setting must be
        // back afterwards.
        host.exec("sysctl", &["-qw", "net.ipv4.conf.all.rp_filter=1"])
            .expect("rp_filter");

        let ip4: SocketAddr = format!("{SERVER4}:5201").parse().expect("addr");
        let ip6: SocketAddr = format!("[{SERVER6}]:5201").parse().expect("addr");
        let tcp4 = servers::tcp(&server, ip4, Mode::Echo).expect("tcp4 server");
        let tcp6 = servers::tcp(&server, ip6, Mode::Echo).expect("tcp6 server");
        let udp4 = servers::udp_echo(&server, format!("{SERVER4}:5353").parse().expect("addr"))
            .expect("udp server");
        let zone = Zone::new(60).with(NAME, SERVER4.parse::<IpAddr>().expect("ip"));
        let dns = DnsServer::start(
            &server,
            format!("{SERVER4}:53").parse().expect("addr"),
            zone,
        )
        .expect("dns server");

        // `ip netns exec` bind-mounts /etc/netns/NAME/resolv.conf over
        // /etc/resolv.conf: the engine edits this file, never the machine's.
        let etc = PathBuf::from("/etc/netns").join(host.name());
        std::fs::create_dir_all(&etc).expect("mkdir /etc/netns/NAME");
        std::fs::write(etc.join("resolv.conf"), "nameserver 10.233.1.2\n").expect("resolv.conf");
        let config = std::env::temp_dir().join(format!("{}.toml", host.name()));
        std::fs::write(
            &config,
            format!("[dns]\nenabled = true\nupstreams = [\"udp://{SERVER4}:53\"]\n"),
        )
        .expect("config");
        Net {
            host,
            server,
            lan,
            tcp4,
            tcp6,
            udp4,
            dns,
            etc,
            config,
        }
    }

    fn resolv_conf(&self) -> String {
        std::fs::read_to_string(self.etc.join("resolv.conf")).expect("read resolv.conf")
    }

    /// Everything auto-route may touch in the host namespace.
    fn snapshot(&self) -> String {
        let mut s = String::new();
        for args in [
            &["rule", "show"][..],
            &["-6", "rule", "show"],
            &["route", "show", "table", "all"],
            &["-6", "route", "show", "table", "all"],
        ] {
            s += &format!("## ip {}\n", args.join(" "));
            s += &self.host.exec("ip", args).expect("ip show");
        }
        s += "## sysctls\n";
        s += &self
            .host
            .exec(
                "sh",
                &[
                    "-c",
                    "grep -r . /proc/sys/net/ipv4/ip_forward /proc/sys/net/ipv6/conf/all/forwarding \
                     /proc/sys/net/ipv4/conf/*/rp_filter",
                ],
            )
            .expect("sysctls");
        s += "## resolv.conf\n";
        s += &self.resolv_conf();
        s
    }

    /// Start `kerntun run --auto-route` in the host namespace and wait until
    /// its last setup step (the resolv.conf naming the engine) is done.
    fn start(&self, route_from: bool) -> Running {
        self.start_with(route_from, &[])
    }

    /// The flags of every run here; `extra` adds to them.
    fn args(&self, route_from: bool, extra: &[&str]) -> Vec<String> {
        let config = self.config.to_string_lossy().into_owned();
        let mut args = vec![
            "run",
            "--config",
            &config,
            "--tun-name",
            TUN,
            "--ipv6",
            "fd00:18::1/64",
            "--mtu",
            "1500",
            "--stats-interval",
            "0",
            "--auto-route",
        ];
        if route_from {
            args.extend_from_slice(&["--route-from", "lan0"]);
        }
        args.extend_from_slice(extra);
        args.into_iter().map(str::to_owned).collect()
    }

    /// `kerntun run` with `extra` flags in the host namespace.
    fn spawn(&self, route_from: bool, extra: &[&str], env: &[(&str, String)]) -> Running {
        let args = self.args(route_from, extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Running::in_netns_env(self.host.name(), &args, env)
    }

    /// Start with `extra` flags and wait until its last setup step (the
    /// resolv.conf naming the engine) is done.
    fn start_with(&self, route_from: bool, extra: &[&str]) -> Running {
        let mut extra = extra.to_vec();
        extra.extend_from_slice(&["--dns-setup", "resolv-conf"]);
        let mut run = self.spawn(route_from, &extra, &[]);
        let mark = format!("pid {}", run.pid());
        let ready = within(Duration::from_secs(15), || {
            self.resolv_conf().contains(&mark) || run.exited().is_some()
        })
        .is_some();
        run.assert_alive("while setting up");
        assert!(ready, "auto-route not in place within 15 s");
        assert!(
            self.resolv_conf()
                .contains("nameserver 198.18.0.3\nnameserver fd00:18::3\n"),
            "resolv.conf names the engine's resolvers:\n{}",
            self.resolv_conf()
        );
        run
    }

    fn tcp_from(&self, ns: &Netns, v6: bool, seed: u64) {
        let to = if v6 { self.tcp6.addr } else { self.tcp4.addr };
        let who = ns.name().to_owned();
        ns.spawn(move || client::echo_transfer(to, seed, 256 * 1024, false))
            .expect("spawn")
            .join()
            .expect("client thread")
            .unwrap_or_else(|e| panic!("TCP from {who} to {to}: {e}"));
    }
}

fn stop(run: Running) -> (serde_json::Value, String) {
    run.signal(Signal::SIGTERM);
    let (status, out, err) = run.wait(Duration::from_secs(15));
    assert_eq!(
        status.code(),
        Some(0),
        "exit: {status}\nstdout:\n{out}\nstderr:\n{err}"
    );
    let last = stats_lines(&out)
        .pop()
        .unwrap_or_else(|| panic!("no final statistics in:\n{out}\nstderr:\n{err}"));
    (last, err)
}

#[test]
fn host_and_forwarded_traffic_go_through_smoltcp_and_routing_is_restored() {
    host_and_forwarded_traffic("ar1", "smoltcp");
}

#[test]
fn host_and_forwarded_traffic_go_through_the_system_stack_and_routing_is_restored() {
    host_and_forwarded_traffic("ar3", "system");
}

fn host_and_forwarded_traffic(tag: &str, stack: &str) {
    require_root!();
    let net = Net::new(tag);
    let before = net.snapshot();
    let run = net.start_with(true, &["--stack", stack]);
    let during = net.snapshot();
    for want in [
        "7460:\tfrom all fwmark 0x6b74 lookup main proto 107",
        "7462:\tfrom all lookup main suppress_prefixlength 0 proto 107",
        "7463:\tfrom all iif lo lookup 27508 proto 107",
        "7464:\tfrom all iif lan0 lookup 27508 proto 107",
    ] {
        assert_eq!(
            during.matches(want).count(),
            2,
            "{want:?} once per family while running:\n{during}"
        );
    }
    for fam in ["-4", "-6"] {
        let table = net
            .host
            .exec("ip", &[fam, "route", "show", "table", "27508"])
            .expect("our table");
        assert!(
            table.starts_with("default dev ktar0 proto 107"),
            "ip {fam}: table 27508 sends everything into the TUN: {table:?}"
        );
    }

    // The host itself: TCP over both families, UDP, and a name looked up
    // through the resolv.conf auto-route wrote (glibc -> the engine's
    // resolver on the TUN -> the upstream, reached by a marked socket).
    net.tcp_from(&net.host, false, 1);
    net.tcp_from(&net.host, true, 2);
    let udp = net.udp4.addr;
    let ok = net
        .host
        .spawn(move || client::udp_round_trips(udp, 20, 200))
        .expect("spawn")
        .join()
        .expect("udp thread")
        .expect("udp");
    assert_eq!(ok, 20, "UDP round trips from the host");
    let looked_up = net
        .host
        .exec("getent", &["ahostsv4", NAME])
        .expect("getent through the engine's resolver");
    assert!(looked_up.contains(SERVER4), "getent answered {looked_up:?}");
    assert!(net.dns.queries() >= 1, "the upstream saw the query");

    // The LAN behind the host: the server has no route back to it, so
    // these only work through the engine.
    net.tcp_from(&net.lan, false, 3);
    net.tcp_from(&net.lan, true, 4);
    let (stats, err) = stop(run);
    assert_eq!(
        stats["tcp_sessions_total"], 4,
        "every TCP connection (2 from the host, 2 forwarded) went through the engine: {stats}"
    );
    assert!(
        stats["udp_flows_total"].as_u64().is_some_and(|n| n >= 1),
        "UDP through the engine: {stats}"
    );
    assert!(
        stats["dns"]["queries"].as_u64().is_some_and(|n| n >= 1),
        "the lookup was answered by the engine: {stats}"
    );
    assert!(err.contains("routing restored"), "stderr:\n{err}");
    assert_eq!(
        net.snapshot(),
        before,
        "routing, sysctls and resolv.conf are back"
    );
    // And the host reaches the server directly again, without an engine.
    net.tcp_from(&net.host, false, 5);
}

#[test]
fn a_killed_run_is_cleaned_up_by_the_next_start() {
    require_root!();
    let net = Net::new("ar2");
    let before = net.snapshot();
    let run = net.start(true);
    let crashed_pid = run.pid();
    run.kill_hard();
    let left = net.snapshot();
    assert!(
        left.contains("proto 107") && left.contains("ip_forward:1"),
        "a SIGKILLed run leaves its rules and sysctls behind:\n{left}"
    );
    assert_ne!(left, before);

    let run = net.start(true);
    net.tcp_from(&net.host, false, 6);
    net.tcp_from(&net.lan, false, 7);
    let (stats, err) = stop(run);
    assert!(
        err.contains(&format!("cleaning up after kerntun pid {crashed_pid}")),
        "the second run found the first one's state:\n{err}"
    );
    assert_eq!(stats["tcp_sessions_total"], 2, "{stats}");
    assert_eq!(net.snapshot(), before, "nothing of either run is left");
}

#[test]
fn a_second_run_is_refused_while_the_first_routes() {
    require_root!();
    let net = Net::new("ar4");
    let before = net.snapshot();
    let first = net.start(false);
    let during = net.snapshot();
    // The same TUN name: were the routing state not checked before the
    // engine starts, the error would be about the busy device instead.
    let second = net.spawn(false, &["--dns-setup", "off"], &[]);
    let (status, _, err) = second.wait(Duration::from_secs(15));
    assert_eq!(status.code(), Some(1), "second run refused: {err}");
    assert!(
        err.contains(&format!(
            "kerntun pid {} already routes this network namespace",
            first.pid()
        )),
        "the refusal names the running one:\n{err}"
    );
    assert_eq!(net.snapshot(), during, "the refused run changed nothing");
    net.tcp_from(&net.host, false, 8);
    let (stats, _) = stop(first);
    assert_eq!(stats["tcp_sessions_total"], 1, "{stats}");
    assert_eq!(net.snapshot(), before);
}

#[test]
fn a_failed_setup_step_undoes_the_steps_before_it() {
    require_root!();
    let net = Net::new("ar5");
    let before = net.snapshot();
    // A resolvectl that fails, found first on PATH for this run only: the
    // DNS step comes last, after the rules, routes and sysctls.
    let bin = net.etc.join("bin");
    std::fs::create_dir_all(&bin).expect("mkdir");
    let fake = bin.join("resolvectl");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'Failed to set DNS configuration: test' >&2\nexit 1\n",
    )
    .expect("write fake resolvectl");
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = net.spawn(true, &["--dns-setup", "resolvectl"], &[("PATH", path)]);
    let (status, out, err) = run.wait(Duration::from_secs(15));
    assert_eq!(status.code(), Some(1), "setup failed: {err}");
    assert!(
        err.contains("`resolvectl dns ktar0 198.18.0.3 fd00:18::3` failed: Failed to set DNS configuration: test"),
        "the error names the command and its message:\n{err}"
    );
    assert!(
        stats_lines(&out).is_empty(),
        "no engine run to report:\n{out}"
    );
    assert_eq!(
        net.snapshot(),
        before,
        "rules, routes and sysctls removed again"
    );
}

#[test]
fn host_and_forwarded_traffic_go_through_shadowsocks() {
    require_root!();
    let net = Net::new("ar6");
    let ss_addr: SocketAddr = format!("{SS_SERVER}:8388").parse().expect("addr");
    let ss = tokio_servers::shadowsocks(&net.server, ss_addr, "aes-256-gcm", "kerntun-auto-route");
    // What a user gets: a share link, here made by shadowsocks-rust's own
    // encoder, handed to `--proxy` (no outbound in the config file).
    let link = tokio_servers::shadowsocks_url(ss_addr, "aes-256-gcm", "kerntun-auto-route");
    assert!(link.starts_with("ss://"), "{link}");
    let before = net.snapshot();
    let run = net.start_with(true, &["--proxy", &link]);
    net.tcp_from(&net.host, false, 11);
    net.tcp_from(&net.lan, false, 12);
    let (stats, _) = stop(run);
    let ss_stats = &stats["outbounds"][0];
    assert_eq!(ss_stats["name"], "proxy", "{stats}");
    assert_eq!(
        ss_stats["tcp_connects"], 2,
        "the host's and the LAN's connection went to the Shadowsocks server: {stats}"
    );
    assert!(
        ss.relayed.load(Relaxed) >= 2 * 256 * 1024,
        "the server relayed both transfers"
    );
    assert_eq!(net.snapshot(), before);
}
