//! `kerntun run --auto-route` (Linux): policy routing that sends the host's
//! own traffic, and the traffic forwarded from `--route-from` interfaces,
//! into the TUN, while the engine's own sockets (marked with the direct
//! outbound's fwmark) keep using the main table. docs/linux-routing.md
//! explains the rules and their order; this file applies and removes them.
//!
//! Everything added is tagged so it can be found again without a record:
//! rules carry rtnetlink protocol [`PROTO`] at priorities from [`PRIORITY`],
//! routes live in table [`TABLE`] (ours alone) with the same protocol. What
//! cannot be tagged (sysctls, `/etc/resolv.conf`) is recorded, with its
//! previous value, in a state file under `/run/kerntun` named after the
//! network namespace, written before each change. Removal runs on a normal
//! exit, on a failed setup (the guard's `Drop`), and at the next start when
//! a killed run left its state behind.
//!
//! The changes are made with the `ip` command (iproute2) rather than
//! netlink: a handful of commands at start and stop, each error names the
//! command that failed, and a user can replay or undo any step by hand.

use std::fmt::Write as _;
use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use kerntun::config::Config;
use serde::{Deserialize, Serialize};

/// Routing table holding `default dev <tun>` ("kt" in ASCII). Ours alone:
/// cleanup flushes it whole.
pub const TABLE: u32 = 0x6b74;
/// rtnetlink protocol number on every rule and route we add (`proto 107`
/// in `ip rule` / `ip route`); unassigned in iproute2's `rt_protos`.
pub const PROTO: u8 = 107;
/// First of our rule priorities (`PRIORITY..=PRIORITY + 4`): after `local`
/// (0), before `main` (32766).
pub const PRIORITY: u32 = 7460;
/// fwmark given to the engine's outbound sockets when the configuration
/// sets none (`direct.fwmark`, `--fwmark`).
pub const DEFAULT_FWMARK: u32 = 0x6b74;

/// Where the host's DNS settings come from while auto-route runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DnsSetup {
    /// `resolvectl` when /etc/resolv.conf is systemd-resolved's, a rewritten
    /// /etc/resolv.conf when it is a plain file, else nothing (logged).
    Auto,
    /// Per-link DNS on the TUN through systemd-resolved.
    Resolvectl,
    /// Rewrite /etc/resolv.conf in place; the original is restored on exit.
    ResolvConf,
    /// Leave the host's DNS settings alone.
    Off,
}

/// What auto-route needs from the configuration and the flags.
#[derive(Debug, Clone)]
pub struct Plan {
    pub fwmark: u32,
    /// The TUN has an address of the family (else that family is blocked:
    /// `unreachable default` in our table, so it cannot bypass the engine).
    pub v4: bool,
    pub v6: bool,
    pub route_from: Vec<String>,
    /// The engine's DNS service addresses (empty when `[dns]` is off).
    pub resolvers: Vec<IpAddr>,
    /// `dns.hijack_all`: port 53 to any address goes into the TUN.
    pub hijack_all: bool,
    /// Resolver addresses outside the TUN's prefixes: routed into the TUN
    /// by rules ahead of the main table's specific routes.
    pub resolvers_outside: Vec<IpAddr>,
    pub dns: DnsSetup,
}

impl Plan {
    /// Check the flags against `cfg` and give the engine's sockets the mark
    /// the rules exclude (the configured one, else [`DEFAULT_FWMARK`]).
    pub fn new(cfg: &mut Config, route_from: &[String], dns: DnsSetup) -> Result<Plan, String> {
        let fwmark = *cfg.direct.fwmark.get_or_insert(DEFAULT_FWMARK);
        if fwmark == 0 {
            return Err("--auto-route: fwmark 0 cannot mark the engine's sockets; \
                 pick another direct.fwmark / --fwmark"
                .into());
        }
        for i in route_from {
            if i.is_empty() || i.contains('/') || !Path::new("/sys/class/net").join(i).exists() {
                return Err(format!("--route-from {i}: no such network interface"));
            }
        }
        let nets: Vec<ipnet::IpNet> = [
            cfg.tun.ipv4.map(ipnet::IpNet::V4),
            cfg.tun.ipv6.map(ipnet::IpNet::V6),
        ]
        .into_iter()
        .flatten()
        .collect();
        let resolvers: Vec<IpAddr> = if !cfg.dns.enabled {
            Vec::new()
        } else if !cfg.dns.hijack.is_empty() {
            cfg.dns.hijack.clone()
        } else {
            nets.iter()
                .filter_map(|n| kerntun::dns::default_resolver(*n))
                .collect()
        };
        let resolvers_outside = resolvers
            .iter()
            .copied()
            .filter(|a| !nets.iter().any(|n| n.contains(a)))
            .collect();
        Ok(Plan {
            fwmark,
            v4: cfg.tun.ipv4.is_some(),
            v6: cfg.tun.ipv6.is_some(),
            route_from: route_from.to_vec(),
            resolvers,
            hijack_all: cfg.dns.enabled && cfg.dns.hijack_all,
            resolvers_outside,
            dns: dns_effective(dns, cfg.dns.enabled),
        })
    }
}

fn dns_effective(dns: DnsSetup, enabled: bool) -> DnsSetup {
    if !enabled {
        return DnsSetup::Off;
    }
    if dns != DnsSetup::Auto {
        return dns;
    }
    match std::fs::read_link(RESOLV_CONF) {
        Ok(target) if target.to_string_lossy().contains("systemd/resolve") => DnsSetup::Resolvectl,
        Ok(target) => {
            tracing::warn!(
                "auto-route: {RESOLV_CONF} links to {} (managed elsewhere); DNS left \
                 alone, point it at the engine's resolver yourself or pass --dns-setup",
                target.display()
            );
            DnsSetup::Off
        }
        Err(_) => DnsSetup::ResolvConf,
    }
}

const RESOLV_CONF: &str = "/etc/resolv.conf";
const STATE_DIR: &str = "/run/kerntun";

/// What was changed that tags cannot find again, with the values to put back.
#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    pid: u32,
    tun: String,
    /// (path under /proc/sys, value before, value we wrote)
    sysctls: Vec<(String, String, String)>,
    /// (original content, content we wrote)
    resolv_conf: Option<(String, String)>,
    /// The TUN whose per-link DNS we set through resolvectl.
    resolvectl: Option<String>,
}

/// The state file of this network namespace: routing is per namespace, so
/// engines in different namespaces never see each other's state.
fn state_path() -> Result<PathBuf, String> {
    let ino = std::fs::metadata("/proc/self/ns/net")
        .map_err(|e| format!("auto-route: reading /proc/self/ns/net: {e}"))?
        .ino();
    Ok(Path::new(STATE_DIR).join(format!("auto-route-net{ino}.json")))
}

fn pid_is_kerntun(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "kerntun")
}

/// Run `ip ARGS`; an error names the command and carries its stderr.
fn ip(args: &[&str]) -> Result<String, String> {
    run_cmd("ip", args)
}

fn run_cmd(cmd: &str, args: &[&str]) -> Result<String, String> {
    let line = format!("{cmd} {}", args.join(" "));
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("auto-route: running `{line}`: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "auto-route: `{line}` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Remove every rule and route we tag, in both families. Returns how many
/// rules were removed. Errors are collected, not fatal: a cleanup removes
/// as much as it can.
fn remove_tagged(errors: &mut Vec<String>) -> usize {
    let mut removed = 0;
    let table = TABLE.to_string();
    let proto = PROTO.to_string();
    for fam in ["-4", "-6"] {
        // Deleting by priority and protocol removes one matching rule per
        // call; a rule list is short, and 64 passes bound a list that keeps
        // changing under us.
        for _ in 0..64 {
            let listing = match ip(&[fam, "-j", "rule", "show"]) {
                Ok(l) => l,
                Err(e) => {
                    errors.push(e);
                    break;
                }
            };
            let rules: Vec<serde_json::Value> = serde_json::from_str(&listing).unwrap_or_default();
            let Some(pref) = rules
                .iter()
                .find(|r| r["protocol"].as_str() == Some(proto.as_str()))
                .and_then(|r| r["priority"].as_u64())
            else {
                break;
            };
            match ip(&[
                fam,
                "rule",
                "del",
                "pref",
                &pref.to_string(),
                "protocol",
                &proto,
            ]) {
                Ok(_) => removed += 1,
                Err(e) => {
                    errors.push(e);
                    break;
                }
            }
        }
        // The kernel drops an emptied table: "does not exist" means
        // nothing of ours is left (flush would fail on it).
        match ip(&[fam, "route", "flush", "table", &table]) {
            Err(e) if e.contains("table does not exist") => {}
            Err(e) => errors.push(e),
            Ok(_) => {}
        }
    }
    removed
}

fn read_trimmed(path: &str) -> Result<String, String> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|e| format!("auto-route: reading {path}: {e}"))
}

fn write_file(path: &str, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("auto-route: writing {path}: {e}"))
}

/// Put back what `state` recorded, where it still holds the value we wrote
/// (someone else's later change wins).
fn restore(state: &State, errors: &mut Vec<String>) {
    if let Some(link) = &state.resolvectl {
        // The per-link settings also vanish with the TUN; revert is for a
        // TUN that outlives us (--tun-fd).
        if Path::new("/sys/class/net").join(link).exists()
            && let Err(e) = run_cmd("resolvectl", &["revert", link])
        {
            errors.push(e);
        }
    }
    if let Some((original, ours)) = &state.resolv_conf {
        match std::fs::read_to_string(RESOLV_CONF) {
            Ok(now) if now == *ours => {
                if let Err(e) = write_file(RESOLV_CONF, original) {
                    errors.push(e);
                }
            }
            Ok(_) => tracing::warn!(
                "auto-route: {RESOLV_CONF} changed since kerntun wrote it; left as it is"
            ),
            Err(e) => errors.push(format!("auto-route: reading {RESOLV_CONF}: {e}")),
        }
    }
    for (path, old, ours) in state.sysctls.iter().rev() {
        match read_trimmed(path) {
            Ok(now) if now == *ours => {
                if let Err(e) = write_file(path, old) {
                    errors.push(e);
                }
            }
            Ok(_) => {}
            // An interface that went away took its setting with it.
            Err(_) if !Path::new(path).exists() => {}
            Err(e) => errors.push(e),
        }
    }
}

/// Undo what a run that no longer exists left in this namespace: its state
/// file's records and every tagged rule and route. Refuses while another
/// live kerntun owns the state.
pub fn clean_stale() -> Result<(), String> {
    let path = state_path()?;
    let mut errors = Vec::new();
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let state: State = serde_json::from_str(&text)
                .map_err(|e| format!("auto-route: {}: {e}", path.display()))?;
            if state.pid != std::process::id() && pid_is_kerntun(state.pid) {
                return Err(format!(
                    "auto-route: kerntun pid {} already routes this network namespace \
                     (state in {}); stop it first",
                    state.pid,
                    path.display()
                ));
            }
            tracing::warn!(
                "auto-route: cleaning up after kerntun pid {} (tun {}), which did not exit cleanly",
                state.pid,
                state.tun
            );
            restore(&state, &mut errors);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("auto-route: reading {}: {e}", path.display())),
    }
    let removed = remove_tagged(&mut errors);
    if removed > 0 {
        tracing::warn!("auto-route: removed {removed} stale rule(s) (protocol {PROTO})");
    }
    if !errors.is_empty() {
        return Err(errors.join("; "));
    }
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("auto-route: removing {}: {e}", path.display())),
    }
}

/// The routing in place; removed by [`AutoRoute::remove`] or on drop.
#[derive(Debug)]
pub struct AutoRoute {
    state: State,
    path: PathBuf,
    active: bool,
}

impl AutoRoute {
    /// Apply `plan` for the TUN `tun`. On an error everything applied so
    /// far is removed again before the error is returned.
    pub fn install(plan: &Plan, tun: &str) -> Result<AutoRoute, String> {
        std::fs::create_dir_all(STATE_DIR)
            .map_err(|e| format!("auto-route: creating {STATE_DIR}: {e}"))?;
        let mut ar = AutoRoute {
            state: State {
                pid: std::process::id(),
                tun: tun.to_owned(),
                ..State::default()
            },
            path: state_path()?,
            active: true,
        };
        ar.save()?;
        ar.apply(plan, tun)?;
        Ok(ar)
    }

    fn save(&self) -> Result<(), String> {
        let text = serde_json::to_string(&self.state).map_err(|e| e.to_string())?;
        std::fs::write(&self.path, text)
            .map_err(|e| format!("auto-route: writing {}: {e}", self.path.display()))
    }

    fn sysctl(&mut self, path: &str, value: &str) -> Result<(), String> {
        let old = read_trimmed(path)?;
        if old == value {
            return Ok(());
        }
        // Recorded before the write: a crash between the two still restores.
        self.state
            .sysctls
            .push((path.to_owned(), old.clone(), value.to_owned()));
        self.save()?;
        write_file(path, value)?;
        tracing::info!("auto-route: {path} {old} -> {value} (restored on exit)");
        Ok(())
    }

    fn apply(&mut self, plan: &Plan, tun: &str) -> Result<(), String> {
        let (table, proto, mark) = (
            TABLE.to_string(),
            PROTO.to_string(),
            plan.fwmark.to_string(),
        );
        let pref = |i: u32| (PRIORITY + i).to_string();
        let mut sources = vec!["lo".to_owned()];
        sources.extend(plan.route_from.iter().cloned());
        for (fam, has_addr) in [("-4", plan.v4), ("-6", plan.v6)] {
            // Table: everything into the TUN, or nothing for a family the
            // TUN does not carry (it must not go around the engine).
            if has_addr {
                ip(&[
                    fam, "route", "add", "default", "dev", tun, "table", &table, "proto", &proto,
                ])?;
            } else {
                ip(&[
                    fam,
                    "route",
                    "add",
                    "unreachable",
                    "default",
                    "table",
                    &table,
                    "proto",
                    &proto,
                ])?;
            }
            let rule = |extra: &[&str], p: u32, lookup: &str| -> Result<String, String> {
                let p = pref(p);
                let mut a = vec![fam, "rule", "add", "pref", p.as_str()];
                a.extend_from_slice(extra);
                a.extend_from_slice(&["lookup", lookup, "protocol", &proto]);
                ip(&a)
            };
            // 0: the engine's own sockets use the main table, always.
            rule(&["fwmark", &mark], 0, "main")?;
            // 1: the engine's resolver, also where a more specific main
            // route would take its address elsewhere (hijack addresses on
            // the LAN, hijack_all).
            for src in &sources {
                for a in plan
                    .resolvers_outside
                    .iter()
                    .filter(|a| a.is_ipv6() == (fam == "-6"))
                {
                    rule(&["to", &a.to_string(), "iif", src], 1, &table)?;
                }
                if plan.hijack_all {
                    for p in ["udp", "tcp"] {
                        rule(&["iif", src, "ipproto", p, "dport", "53"], 1, &table)?;
                    }
                }
            }
            // 2: routes more specific than a default (connected LANs, the
            // TUN's own prefix, static routes) keep working.
            let p2 = pref(2);
            ip(&[
                fam,
                "rule",
                "add",
                "pref",
                &p2,
                "lookup",
                "main",
                "suppress_prefixlength",
                "0",
                "protocol",
                &proto,
            ])?;
            // 3: the host's own traffic (`iif lo` = locally generated);
            // 4: traffic forwarded from the --route-from interfaces.
            rule(&["iif", "lo"], 3, &table)?;
            for i in &plan.route_from {
                rule(&["iif", i], 4, &table)?;
            }
        }
        // Strict reverse-path filtering checks a reply to the engine's
        // sockets against the route back to its source, which now points
        // into the TUN: the reply would be dropped. Loose mode (2) only
        // asks that some route exists.
        let conf = "/proc/sys/net/ipv4/conf";
        let mut names: Vec<String> = std::fs::read_dir(conf)
            .map_err(|e| format!("auto-route: reading {conf}: {e}"))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != "default")
            .collect();
        names.sort();
        for n in names {
            let p = format!("{conf}/{n}/rp_filter");
            if read_trimmed(&p)? == "1" {
                self.sysctl(&p, "2")?;
            }
        }
        if !plan.route_from.is_empty() {
            if plan.v4 {
                self.sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
            }
            if plan.v6 {
                self.sysctl("/proc/sys/net/ipv6/conf/all/forwarding", "1")?;
            }
        }
        self.setup_dns(plan, tun)?;
        tracing::info!(
            "auto-route: host traffic{} goes into {tun} (table {TABLE}, rules {}-{}, fwmark {:#x} excluded)",
            if plan.route_from.is_empty() {
                String::new()
            } else {
                format!(" and traffic forwarded from {}", plan.route_from.join(", "))
            },
            PRIORITY,
            PRIORITY + 4,
            plan.fwmark
        );
        Ok(())
    }

    fn setup_dns(&mut self, plan: &Plan, tun: &str) -> Result<(), String> {
        let addrs: Vec<String> = plan.resolvers.iter().map(ToString::to_string).collect();
        match plan.dns {
            DnsSetup::Off | DnsSetup::Auto => {}
            DnsSetup::Resolvectl => {
                let mut a = vec!["dns", tun];
                a.extend(addrs.iter().map(String::as_str));
                run_cmd("resolvectl", &a)?;
                // Recorded once there is something to revert (the per-link
                // settings also go away with the TUN, so a crash right
                // here leaves nothing behind).
                self.state.resolvectl = Some(tun.to_owned());
                self.save()?;
                run_cmd("resolvectl", &["domain", tun, "~."])?;
                run_cmd("resolvectl", &["default-route", tun, "yes"])?;
                tracing::info!(
                    "auto-route: DNS of {tun} set to {} through resolvectl",
                    addrs.join(" ")
                );
            }
            DnsSetup::ResolvConf => {
                let original = std::fs::read_to_string(RESOLV_CONF)
                    .map_err(|e| format!("auto-route: reading {RESOLV_CONF}: {e}"))?;
                let mut ours = format!(
                    "# written by kerntun run --auto-route (pid {}); the previous\n\
                     # content is put back when it stops\n",
                    std::process::id()
                );
                // glibc reads at most three nameserver lines.
                for a in addrs.iter().take(3) {
                    let _ = writeln!(ours, "nameserver {a}");
                }
                self.state.resolv_conf = Some((original, ours.clone()));
                self.save()?;
                // In place, not by rename: the file may be a bind mount
                // (`ip netns exec` mounts /etc/netns/NAME/resolv.conf there).
                write_file(RESOLV_CONF, &ours)?;
                tracing::info!(
                    "auto-route: {RESOLV_CONF} names {} (restored on exit)",
                    addrs.join(" ")
                );
            }
        }
        Ok(())
    }

    /// Remove the rules and routes, put back sysctls and DNS, delete the
    /// state file. Errors name what could not be undone.
    pub fn remove(mut self) -> Result<(), String> {
        self.remove_inner()
    }

    fn remove_inner(&mut self) -> Result<(), String> {
        if !self.active {
            return Ok(());
        }
        self.active = false;
        let mut errors = Vec::new();
        restore(&self.state, &mut errors);
        remove_tagged(&mut errors);
        if errors.is_empty() {
            if let Err(e) = std::fs::remove_file(&self.path) {
                errors.push(format!("auto-route: removing {}: {e}", self.path.display()));
            }
            tracing::info!("auto-route: routing restored");
            Ok(())
        } else {
            // The state file stays: the next start retries.
            Err(errors.join("; "))
        }
    }
}

impl Drop for AutoRoute {
    fn drop(&mut self) {
        if let Err(e) = self.remove_inner() {
            eprintln!("kerntun: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(cfg: &mut Config, route_from: &[&str]) -> Result<Plan, String> {
        let from: Vec<String> = route_from.iter().map(|s| (*s).to_owned()).collect();
        Plan::new(cfg, &from, DnsSetup::Off)
    }

    #[test]
    fn the_engine_sockets_get_a_mark_when_none_is_configured() {
        let mut cfg = Config::default();
        assert_eq!(plan(&mut cfg, &[]).expect("plan").fwmark, DEFAULT_FWMARK);
        assert_eq!(
            cfg.direct.fwmark,
            Some(DEFAULT_FWMARK),
            "given to the engine"
        );
        let mut cfg = Config::default();
        cfg.direct.fwmark = Some(0x2a);
        assert_eq!(
            plan(&mut cfg, &[]).expect("plan").fwmark,
            0x2a,
            "the configured one wins"
        );
        cfg.direct.fwmark = Some(0);
        let e = plan(&mut cfg, &[]).expect_err("mark 0 marks nothing");
        assert!(e.contains("fwmark 0"), "{e}");
    }

    #[test]
    fn an_unknown_route_from_interface_is_named() {
        let mut cfg = Config::default();
        let e = plan(&mut cfg, &["no-such-if0"]).expect_err("refused");
        assert_eq!(e, "--route-from no-such-if0: no such network interface");
        let e = plan(&mut cfg, &["../lo"]).expect_err("not a path");
        assert!(e.contains("no such network interface"), "{e}");
    }

    #[test]
    fn resolvers_follow_the_dns_section() {
        let mut cfg = Config::default();
        cfg.tun.ipv6 = Some("fd00:18::1/64".parse().expect("net"));
        let p = plan(&mut cfg, &[]).expect("plan");
        assert!(p.resolvers.is_empty(), "dns off: no resolver to announce");
        assert!((p.v4, p.v6) == (true, true));

        cfg.dns.enabled = true;
        let p = plan(&mut cfg, &[]).expect("plan");
        let want: Vec<IpAddr> = vec![
            "198.18.0.3".parse().expect("ip"),
            "fd00:18::3".parse().expect("ip"),
        ];
        assert_eq!(p.resolvers, want, "gateway + 2 of each prefix");
        assert!(p.resolvers_outside.is_empty(), "inside the TUN's prefixes");

        cfg.dns.hijack = vec![
            "198.18.0.3".parse().expect("ip"),
            "10.0.0.53".parse().expect("ip"),
        ];
        cfg.dns.hijack_all = true;
        let p = plan(&mut cfg, &[]).expect("plan");
        assert_eq!(p.resolvers, cfg.dns.hijack);
        assert_eq!(
            p.resolvers_outside,
            vec!["10.0.0.53".parse::<IpAddr>().expect("ip")]
        );
        assert!(p.hijack_all);
    }
}
