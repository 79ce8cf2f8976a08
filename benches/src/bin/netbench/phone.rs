//! The phone profiles' runs ([`kerntun_benches::phone`] says what they
//! are), TCP and UDP alike: per (topology, MTU) every veth and the TUN take
//! the MTU, and the profiles of the group run interleaved per (streams,
//! direction), baseline first, each through the one runner; the veths go
//! back to 1500 afterwards. The router topology's app namespace and the
//! android topology's uid rule exist for this part only.

use std::path::PathBuf;
use std::time::Instant;

use kerntun_benches::phone::{
    self as ph, ANDROID_UID, DATAGRAM, PhoneProfile, only_drivers, udp_profiles,
};
use kerntun_benches::procfs;
use kerntun_benches::record::{
    Direction, PhoneMeta, PhoneRun, PhoneUdpMeta, PhoneUdpRun, Record, Run, Topo,
};
use kerntun_testkit::CLIENT_VETH;
use kerntun_testkit::router::Router;
use kerntun_testkit::uid_route::UidRoute;

use super::desktop::report_integrity;
use super::engine::{EngineSpec, Route};
use super::procs::{forget_ns, register_ns};
use super::runner::{
    self, Attach, Client, Load, Measured, Plan, Profile, TCP_RELAYED, Traffic, UDP_RELAYED,
};
use super::{Ctx, finish_meta, machine_meta};

/// The namespaces and rules the phone topologies need beyond the
/// harness's two namespaces.
struct Nets {
    router: Option<Router>,
    uid: Option<UidRoute>,
}

impl Nets {
    /// Build what `topos` need; a topology that cannot be built is left
    /// out of `topos` (and said why).
    fn attach(ctx: &Ctx, topos: &mut Vec<Topo>) -> Nets {
        let mut nets = Nets {
            router: None,
            uid: None,
        };
        if topos.contains(&Topo::Router) {
            match Router::attach(&ctx.topo) {
                Ok(r) => {
                    register_ns(r.app.name());
                    nets.router = Some(r);
                }
                Err(e) => {
                    eprintln!("phone: the router topology: {e}; measuring the others");
                    topos.retain(|&t| t != Topo::Router);
                }
            }
        }
        if topos.contains(&Topo::Android) {
            match UidRoute::attach(&ctx.topo, ANDROID_UID) {
                Ok(u) => nets.uid = Some(u),
                Err(e) => {
                    eprintln!("phone: the android topology's uid rule: {e}; measuring the others");
                    topos.retain(|&t| t != Topo::Android);
                }
            }
        }
        nets
    }

    /// Where a topology's client runs.
    fn client(&self, ctx: &Ctx, topo: Topo) -> Option<Client<'_>> {
        match topo {
            Topo::Local => Some(Client::local(ctx)),
            Topo::Router => self.router.as_ref().map(|r| Client {
                ns: r.app.name().to_owned(),
                uid: None,
                route: Route::Router(r),
            }),
            Topo::Android => self.uid.as_ref().map(|u| Client {
                ns: ctx.topo.client.name().to_owned(),
                uid: Some(u.uid()),
                route: Route::Uid(u),
            }),
        }
    }

    /// Every veth of the topology (the router's app pair included) and the
    /// engine's TUN at `mtu`.
    fn set_mtu(&self, ctx: &Ctx, mtu: u16) -> std::io::Result<()> {
        match &self.router {
            Some(r) => r.set_mtu(&ctx.topo, mtu),
            None => {
                let m = mtu.to_string();
                ctx.topo
                    .client
                    .ip(&["link", "set", CLIENT_VETH, "mtu", &m])?;
                ctx.topo.server.ip(&["link", "set", "kts", "mtu", &m])
            }
        }
    }

    /// Back to MTU 1500, the router's namespace and the uid rule removed.
    fn close(self, ctx: &Ctx) {
        if let Err(e) = self.set_mtu(ctx, 1500) {
            eprintln!("phone: MTU back to 1500: {e}");
        }
        if let Some(r) = self.router {
            let name = r.app.name().to_owned();
            drop(r);
            forget_ns(&name);
        }
    }
}

/// One phone profile run from its client, by the engine under test or the
/// earlier one of a before/after comparison.
struct PhoneBench<'a> {
    p: PhoneProfile,
    client: &'a Client<'a>,
    binary: PathBuf,
    /// The earlier engine's label; `None` for the engine under test.
    label: Option<String>,
    /// With `perf stat` counting the engine's system calls.
    counted: bool,
}

impl<'a> PhoneBench<'a> {
    fn new(ctx: &Ctx, p: PhoneProfile, client: &'a Client<'a>) -> PhoneBench<'a> {
        PhoneBench {
            p,
            client,
            binary: ctx.engine.clone(),
            label: None,
            counted: false,
        }
    }

    /// The same run with the `--phone-before` engine, for the profiles
    /// whose driver reads one packet at a time (the phone path).
    fn before(&self, ctx: &Ctx) -> Option<PhoneBench<'a>> {
        let binary = ctx.args.phone_before.clone()?;
        if self.p.driver.is_none_or(|d| d == "batch") {
            return None;
        }
        Some(PhoneBench {
            binary: std::fs::canonicalize(&binary).unwrap_or(binary),
            label: Some(ctx.args.phone_before_label.clone()),
            ..PhoneBench::new(ctx, self.p, self.client)
        })
    }
}

impl Profile for PhoneBench<'_> {
    type Record = Record;

    fn plan<'s>(&'s self, _: &Ctx) -> Plan<'s> {
        let p = &self.p;
        Plan {
            engine: p.scenario().map(|scenario| EngineSpec {
                scenario,
                mtu: p.mtu,
                tx_queue_len: p.tx_queue_len(),
                workers: p.workers(),
                binary: self.binary.clone(),
                stats_interval: 0,
            }),
            client: self.client.clone(),
            load: if p.udp {
                Load::Udp { datagram: DATAGRAM }
            } else {
                Load::Tcp
            },
            relayed: Some(if p.udp { UDP_RELAYED } else { TCP_RELAYED }),
            via_ss: false,
        }
    }

    fn record(&self, m: Measured) -> Record {
        let run = Run {
            engine: self.label.clone(),
            ..m.run
        };
        let shape = self.p.shape();
        if !self.p.udp {
            return Record::Phone(PhoneRun {
                shape,
                counted: self.counted,
                syscalls: m.syscalls,
                run,
            });
        }
        let (sent_bytes, lost_packets, packets) = match &m.traffic {
            Some(Traffic::Udp(u)) => (u.sent_bytes, u.lost_packets, u.packets),
            _ => (0, 0, 0),
        };
        Record::PhoneUdp(PhoneUdpRun {
            shape,
            datagram: DATAGRAM,
            sent_bytes,
            lost_packets,
            packets,
            run,
        })
    }
}

/// The TCP phone profiles of every topology asked for; the meta record
/// first.
pub(super) fn run(ctx: &mut Ctx) -> Vec<Record> {
    let started = Instant::now();
    let mut meta = PhoneMeta {
        run: machine_meta(&ctx.args),
        topologies: ctx.args.phone_topologies.clone(),
        mtus: Vec::new(),
        syscall_streams: ctx
            .args
            .phone_syscall_streams
            .iter()
            .copied()
            .filter(|&s| s > 0)
            .collect(),
        syscalls_error: None,
    };
    meta.run.load_start = procfs::load1();
    meta.run.duration_s = ctx.args.duration;
    meta.run.integrity_bytes = ctx.args.integrity_mib << 20;
    let nets = Nets::attach(ctx, &mut meta.topologies);
    if meta.syscall_streams.is_empty() {
        meta.syscalls_error = Some("not asked for (`--phone-syscall-streams 0`)".into());
    } else if let Err(e) = runner::perf_stat_works() {
        eprintln!("phone: system calls not counted: {e}");
        meta.syscalls_error = Some(e);
    }
    let groups: Vec<(Topo, Vec<u16>)> = meta
        .topologies
        .iter()
        .map(|&t| {
            let mtus = match t {
                Topo::Android => &ctx.args.phone_android_mtus,
                Topo::Router | Topo::Local => &ctx.args.phone_mtus,
            };
            (t, mtus.clone())
        })
        .collect();
    meta.mtus = groups.iter().flat_map(|g| g.1.iter().copied()).collect();
    meta.mtus.sort_unstable();
    meta.mtus.dedup();
    let profiles = only_drivers(ph::profiles(&groups), &ctx.args.phone_drivers);
    let streams = ctx.args.streams.clone();
    let mut out = Vec::new();
    for (topo, mtus) in &groups {
        let Some(client) = nets.client(ctx, *topo) else {
            continue;
        };
        for &mtu in mtus {
            let group: Vec<PhoneProfile> = profiles
                .iter()
                .copied()
                .filter(|p| p.topo == *topo && p.mtu == mtu)
                .collect();
            if let Err(e) = nets.set_mtu(ctx, mtu) {
                eprintln!("phone: MTU {mtu}: {e}");
                continue;
            }
            out.extend(measure_group(ctx, &group, &client, &streams));
            if meta.syscalls_error.is_none() {
                for &s in &meta.syscall_streams {
                    for dir in Direction::BOTH {
                        for &p in group.iter().filter(|p| p.driver.is_some()) {
                            let bench = PhoneBench {
                                counted: true,
                                ..PhoneBench::new(ctx, p, &client)
                            };
                            let r = runner::run(ctx, &bench, s, dir, Attach::Syscalls);
                            eprintln!("phone counted {}", describe(&r, None));
                            out.push(r);
                        }
                    }
                }
            }
            for &p in group.iter().filter(|p| p.driver.is_some()) {
                let bench = PhoneBench::new(ctx, p, &client);
                let i = runner::integrity(ctx, &bench, p.id(), ctx.args.integrity_mib << 20);
                report_integrity(&i);
                out.push(Record::PhoneIntegrity(i));
            }
        }
    }
    nets.close(ctx);
    finish_meta(&mut meta.run, started);
    out.insert(0, Record::PhoneMeta(meta));
    out
}

/// The UDP profiles (router topology); the meta record first.
pub(super) fn run_udp(ctx: &mut Ctx) -> Vec<Record> {
    let started = Instant::now();
    let mut meta = PhoneUdpMeta {
        run: machine_meta(&ctx.args),
        topology: Some(Topo::Router),
        mtus: ctx.args.phone_udp_mtus.clone(),
        drivers: ctx.args.phone_udp_drivers.clone(),
        streams: ctx.args.phone_udp_streams.clone(),
        datagram: DATAGRAM,
    };
    meta.run.load_start = procfs::load1();
    meta.run.duration_s = ctx.args.duration;
    let profiles = match udp_profiles(&meta.mtus, &meta.drivers) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("phone udp: {e}; no UDP profiles");
            meta.topology = None;
            return vec![Record::PhoneUdpMeta(meta)];
        }
    };
    let mut topos = vec![Topo::Router];
    let nets = Nets::attach(ctx, &mut topos);
    let Some(client) = nets.client(ctx, Topo::Router) else {
        meta.topology = None;
        return vec![Record::PhoneUdpMeta(meta)];
    };
    let mut out = Vec::new();
    for &mtu in &meta.mtus {
        let group: Vec<PhoneProfile> = profiles.iter().copied().filter(|p| p.mtu == mtu).collect();
        if let Err(e) = nets.set_mtu(ctx, mtu) {
            eprintln!("phone udp: MTU {mtu}: {e}");
            continue;
        }
        out.extend(measure_group(ctx, &group, &client, &meta.streams));
    }
    drop(client);
    nets.close(ctx);
    finish_meta(&mut meta.run, started);
    out.insert(0, Record::PhoneUdpMeta(meta));
    out
}

/// The profiles of one (topology, MTU), interleaved per (streams,
/// direction) so a change in background load hits them alike, the
/// baseline first; the earlier engine, when asked for, right after the
/// engine under test, so both meet the same load.
fn measure_group(
    ctx: &mut Ctx,
    group: &[PhoneProfile],
    client: &Client,
    streams: &[u32],
) -> Vec<Record> {
    let mut out = Vec::new();
    for &s in streams {
        for dir in Direction::BOTH {
            let mut baseline = None;
            for &p in group {
                let bench = PhoneBench::new(ctx, p, client);
                let r = runner::run(ctx, &bench, s, dir, Attach::None);
                if p.driver.is_none() {
                    baseline = shared(&r).and_then(|x| x.gbit_per_s);
                }
                eprintln!("phone {}", describe(&r, baseline));
                out.push(r);
                if let Some(before) = bench.before(ctx) {
                    let r = runner::run(ctx, &before, s, dir, Attach::None);
                    eprintln!("phone {}", describe(&r, baseline));
                    out.push(r);
                }
            }
        }
    }
    out
}

/// The shared figures of a phone record.
fn shared(r: &Record) -> Option<&Run> {
    match r {
        Record::Phone(x) => Some(&x.run),
        Record::PhoneUdp(x) => Some(&x.run),
        _ => None,
    }
}

fn describe(r: &Record, baseline: Option<f64>) -> String {
    let (profile, run) = match r {
        Record::Phone(x) => (&x.shape.profile, &x.run),
        Record::PhoneUdp(x) => (&x.shape.profile, &x.run),
        _ => return String::new(),
    };
    let head = format!(
        "{:<28} {:>2} streams {:<8}{}",
        profile,
        run.streams,
        run.direction.as_str(),
        run.engine
            .as_deref()
            .map(|l| format!(" ({l})"))
            .unwrap_or_default()
    );
    let (Some(g), None) = (run.gbit_per_s, &run.error) else {
        return match &run.error {
            Some(e) => format!("{head} FAILED: {e}"),
            None => format!("{head} no result"),
        };
    };
    let mut s = format!("{head} {g:6.2} Gbit/s");
    let engine = run.engine_stats.is_some();
    if let Some(b) = baseline.filter(|_| engine) {
        s.push_str(&format!(" ({:.0} % of baseline)", 100.0 * g / b));
    }
    if let Some(c) = run.cpu_s_per_gb {
        s.push_str(&format!(", {c:.2} CPU s/GB"));
    }
    if let Some(w) = run.wakeups_per_gb() {
        s.push_str(&format!(", {:.0}k wake-ups/GB", w / 1e3));
    }
    if let (Some(d), Some(n)) = (run.tun_tx_dropped, run.tun_packets()) {
        s.push_str(&format!(", {d} of {n} TUN packets dropped"));
    }
    match r {
        Record::Phone(x) => {
            if let Some(n) = run.tcp_retrans_segs {
                s.push_str(&format!(", {n} TCP retransmits"));
            }
            if let (Some(a), Some(b)) = (x.packets_per_read(), x.packets_per_write()) {
                s.push_str(&format!(", {a:.2} packets/read, {b:.2} packets/write"));
            }
        }
        Record::PhoneUdp(x) => {
            if let Some(l) = x.loss() {
                s.push_str(&format!(", loss {:.0} %", 100.0 * l));
            }
            if let Some(o) = x.offered_gbit_per_s() {
                s.push_str(&format!(", offered {o:.2}"));
            }
        }
        _ => {}
    }
    s
}
