//! The datagram path: each (client, server) pair ([`FlowKey`], the key of
//! the system stack's TCP flows too) has an entry in the TUN driver's flow
//! table (no locks on the uplink). A direct one sends from its client's
//! [`Mapping`] (one unconnected socket per app source for every
//! destination, whose reply task passes on replies from any peer:
//! endpoint-independent mapping and filtering, `direct.udp_nat`'s default),
//! or, with `udp_nat = "connected"`, from a connected socket of its own
//! with a reply task of its own; reply tasks turn received datagrams back
//! into IP packets.
//!
//! Bounds: at most `budget.udp_flows` flows (a mapping counts as one, with
//! at most [`MAPPING_PEERS`] destination entries), idle flows closed after
//! `timeouts.udp_idle_s`, and uplink datagrams are handed to the kernel with
//! a non-blocking send, so the socket's own send buffer is the only queue: a
//! full one is a counted drop, never unbounded memory. A flow that never
//! saw a reply closes sooner, after `timeouts.udp_unreplied_s` (30 s against
//! 120-180 s: a request that got no answer in 30 s went to a dead peer or
//! was a probe, and its flow only holds a socket), and past the
//! flow budget the oldest unreplied flow is evicted first (counted): a
//! one-way flood (a port scan, datagrams to dead peers) recycles its own
//! flows and never evicts a flow that was answered while an unanswered one
//! is left.
//!
//! Flows the rules send through a proxy (SOCKS5 UDP ASSOCIATE, Shadowsocks
//! UDP) need a handshake and framing before a datagram can leave, which the
//! driver must not wait for. They take a queued path: the driver copies the
//! payload into one of the flow's recycled buffers (at most
//! [`QUEUE_DEPTH`](proxied::QUEUE_DEPTH)) and hands it to the flow's task
//! over a bounded channel; a full queue is a counted drop. A flow's first buffer always exists; each further one is charged
//! one MTU against the proxied-queue byte budget (`budget.memory`), and a
//! buffer carrying a datagram longer than the MTU (one the app sent as
//! fragments, up to 65,507 bytes) its excess too until it is shrunk back
//! before the next datagram, so all flows together hold at most
//! `udp_flows` x MTU plus that budget, and a buffer or an excess the budget
//! refuses is a counted drop too. The task opens the
//! association, frames and sends, and turns the proxy's replies back into
//! IP packets.
//!
//! What a new flow is, is decided by the plan TCP connections get
//! (`Dispatcher::plan`, with `Network::Udp`): DNS to a hijacked address,
//! a route by address or by the domain behind a fake-ip address, a route
//! by the server name in its QUIC Initials or by the app that owns the flow
//! (both wait with the flow's first datagrams held, `sniff.rs`), or a refusal,
//! counted there (`udp_rejected`, `udp_outbound_refused`,
//! `fake_ip_unknown`); a refusal by a rule or by a proxy with `udp = false`
//! is answered with an ICMP port unreachable (`reject.rs`).
//!
//! DNS (when `[dns]` is on): a datagram to a hijacked address's port 53 opens
//! no flow. Its payload is copied to a task that asks the DNS service and
//! writes the answer to the TUN from the address the app asked; each query
//! is charged against the DNS in-flight byte budget while it is answered,
//! past that a query is a counted drop (the app's resolver retries), so the
//! driver never waits for DNS.
//! A flow to a fake-ip address is routed by the domain behind it: a proxy
//! gets the domain in its UDP header, a direct flow resolves it once (in the
//! flow's task, on the queued path) and sends to the real address; replies
//! always come from the fake address. A fake address no domain holds is a
//! counted drop.
//!
//! The files: this one holds the flow table (the driver's side: lookup,
//! plan, open); `flow.rs` a flow's record, the state it shares with its
//! reply task and an app source's mapping; `send.rs` how one uplink
//! datagram is sent on a flow; `evict.rs` how flows leave the table
//! (eviction, expiry, closed by the host, stranded by a network change);
//! `gather/` the uplink gathering for one GSO send
//! per run of a flow (Linux/Android; Darwin sends each datagram on its
//! own); `reply/` the reply loops (batched with `recvmmsg` on
//! Linux/Android, one `recvmsg` per datagram on Darwin) and the one
//! function that writes a reply to the TUN, fragmented when it must be;
//! `proxied.rs` the flows that do not send from the driver (through a
//! proxy, or direct to a domain resolved first); `hijack.rs` the DNS
//! queries answered by the engine.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use crate::budget::ByteBudget;
use crate::conns::Registered;
use crate::dispatch::{Dispatcher, Network, Plan, Refusal, Routing};
use crate::nat::FlowKey;
use crate::outbound::config::UdpNat;
use crate::outbound::{Address, Route, SocketFactory, Why};
use crate::packet::{self, IpInfo};
use crate::stats::{EngineDrop, LocalCounters};
use crate::tun::Tun;

// Where the platforms differ: gathering for GSO sends (`UDP_SEGMENT` on
// Linux/Android) and how replies are received (`reply/`).
mod evict;
mod flow;
#[cfg_attr(linux_like, path = "gather/linux.rs")]
#[cfg_attr(apple, path = "gather/darwin.rs")]
mod gather;
mod hijack;
mod listed;
mod proxied;
mod reject;
mod reply;
mod send;
mod sniff;

use flow::{Flow, FlowIo, MAPPING_PEERS, Mapping, ReplyState};
use gather::Gso;
use proxied::Queue;
use send::send_on;

/// What the datagram path and its flow tasks need.
#[derive(Debug)]
pub(crate) struct UdpEnv {
    /// Rules, outbounds, DNS, statistics.
    pub d: Arc<Dispatcher>,
    /// Where replies are written.
    pub tun: Arc<Tun>,
    /// Direct flows' sockets (bound, marked or protected off the TUN).
    pub factory: SocketFactory,
    pub mtu: u16,
    /// `budget.udp_flows`: the least recently used flow is evicted past it.
    pub max_flows: usize,
    /// `timeouts.udp_idle_s`.
    pub idle: Duration,
    /// `timeouts.udp_unreplied_s`: the idle timeout of a flow that never
    /// saw a reply (at most `idle`).
    pub unreplied: Duration,
    /// Bytes the proxied flows' queues may hold beyond one buffer each,
    /// and the copies of replies longer than a reply slot while written.
    pub queues: Arc<ByteBudget>,
    /// `direct.udp_nat`.
    pub nat: UdpNat,
    /// Told when the owner lookup of a held flow answered, so the driver
    /// routes it then instead of at its next datagram or cleanup tick
    /// (`sniff.rs`, `driver::Head`).
    pub held_answered: Arc<tokio::sync::Notify>,
}

/// Flow table, owned by the TUN driver task.
#[derive(Debug)]
pub(crate) struct UdpTable {
    flows: HashMap<FlowKey, Flow>,
    /// Endpoint-independent mappings by app source.
    mappings: HashMap<SocketAddr, Mapping>,
    /// Entries of `flows` with a task of their own (not mapped): with
    /// `mappings`, what the flow budget counts.
    owned: usize,
    shared: Arc<UdpEnv>,
    epoch: Instant,
    /// Flows evicted since the driver last yielded: their reply tasks are
    /// aborted, and each one's socket closes only when the runtime drops
    /// that task ([`UdpTable::take_evicted`]).
    evicted: usize,
    /// Uplink datagrams of one direct flow waiting for one GSO send.
    gso: Gso,
    /// The ICMP answer to datagrams a rule refuses, rate limited.
    unreachable: reject::Unreachable,
    /// New flows to a sniffed port whose QUIC Initials are being read, and
    /// flows refused by the name they sent.
    sniffing: HashMap<FlowKey, sniff::Sniffing>,
}

impl UdpTable {
    pub fn new(shared: Arc<UdpEnv>, now: Instant) -> Self {
        Self {
            flows: HashMap::new(),
            mappings: HashMap::new(),
            owned: 0,
            shared,
            epoch: now,
            evicted: 0,
            gso: Gso::new(),
            unreachable: reject::Unreachable::new(),
            sniffing: HashMap::new(),
        }
    }

    /// Send what the uplink gathered (the driver calls this at the end of
    /// every drain, so a datagram waits at most one drain).
    pub fn flush(&mut self, local: &mut LocalCounters) {
        if let Some(refused) = self.gso.flush(local)
            && let Some(f) = self.flows.get_mut(&refused)
        {
            f.gso = false;
        }
    }

    /// Flows as the budget counts them: mappings, and flows with a socket
    /// of their own.
    pub fn len(&self) -> usize {
        self.owned + self.mappings.len()
    }

    /// Whether the cleanup tick has anything to do here.
    pub fn has_state(&self) -> bool {
        self.len() > 0 || !self.sniffing.is_empty()
    }

    /// Whether flows were evicted since the last call. Their sockets are
    /// still open until the runtime drops their aborted tasks, which it
    /// does only once the driver yields: a driver that reads on through a
    /// flood without yielding (the device stays readable, so its awaits
    /// return at once until tokio's cooperative budget runs out) would hold
    /// thousands of evicted sockets over a `udp_flows` of a few hundred.
    pub fn take_evicted(&mut self) -> bool {
        std::mem::take(&mut self.evicted) > 0
    }

    /// Send one uplink datagram (`buf` holds the whole IP packet).
    pub fn handle(&mut self, buf: &[u8], ip: &IpInfo, now: Instant, local: &mut LocalCounters) {
        self.datagram(buf, ip, None, now, local);
    }

    /// Send one uplink datagram the app sent as IP fragments, reassembled
    /// into `buf`; its longest fragment was `longest` bytes, which bounds
    /// the flow's reply packets from now on ([`ReplyState::lower_mtu`]).
    pub fn handle_reassembled(
        &mut self,
        buf: &[u8],
        ip: &IpInfo,
        longest: usize,
        now: Instant,
        local: &mut LocalCounters,
    ) {
        self.datagram(buf, ip, Some(longest), now, local);
    }

    fn datagram(
        &mut self,
        buf: &[u8],
        ip: &IpInfo,
        longest: Option<usize>,
        now: Instant,
        local: &mut LocalCounters,
    ) {
        let udp = match packet::parse_udp(buf, ip) {
            Ok(u) => u,
            Err(r) => return local.reject(r),
        };
        // A bad checksum opens no flow and reaches no outbound.
        if let Err(r) = packet::check_datagram(buf, ip, &udp) {
            return local.reject(r);
        }
        let key = FlowKey::new(
            SocketAddr::new(ip.src, udp.src_port),
            SocketAddr::new(ip.dst, udp.dst_port),
        );
        let payload = &buf[udp.payload_offset..udp.payload_offset + udp.payload_len];
        // One lookup per datagram; a second only when the flow is new.
        if self.forward(key, payload, longest, now, local) {
            return;
        }
        // The plan TCP connections get too (`Dispatcher::plan`). DNS to a
        // hijacked address and refused datagrams open no flow, so each of
        // them is planned again; a flow being held is decided by what it
        // waits for (its QUIC Initials, its owner: `sniff.rs`).
        let planned = match self.sniffing.contains_key(&key) {
            true => Ok(Plan::Sniff),
            false => self.shared.d.plan_or_refusal(key.server, Network::Udp),
        };
        let decided = match planned {
            Ok(Plan::Connect {
                route,
                dst,
                on,
                why,
            }) => sniff::Decided {
                route,
                why,
                on,
                dst,
                sniffed: None,
                owner: None,
                asked: false,
                held: Vec::new(),
            },
            Ok(Plan::Dns) => return self.hijack(key, payload, now, local),
            Ok(p @ (Plan::Sniff | Plan::Owner)) => {
                let quic = matches!(p, Plan::Sniff);
                match self.sniff(key, buf, ip, payload, quic, now, local) {
                    Some(decided) => decided,
                    None => return,
                }
            }
            // Refused by a rule or by a proxy that refuses UDP, and
            // counted by the plan: the app hears it at once (`reject.rs`).
            Err(Refusal::Rule | Refusal::NoUdp) => {
                let tun = &self.shared.tun;
                return self.unreachable.answer(buf, ip, tun, now, local);
            }
            // Refused, and counted, by the plan (DNS over TLS is TCP's
            // only).
            Err(Refusal::UnknownFake | Refusal::DnsOverTls) => return,
        };
        if self.open_decided(key, decided, now, local) {
            self.forward(key, payload, longest, now, local);
        }
    }

    /// Open the flow `key` as decided, send what was held for it first,
    /// in order, and give its record its owner: the one learned while it
    /// was held, else asked for now in a task (for the list only; the flow
    /// is routed already). False if it could not be opened (counted).
    fn open_decided(
        &mut self,
        key: FlowKey,
        decided: sniff::Decided,
        now: Instant,
        local: &mut LocalCounters,
    ) -> bool {
        let sniff::Decided {
            route,
            why,
            on,
            dst,
            sniffed,
            owner,
            asked,
            held,
        } = decided;
        if !self.open_planned(key, route, dst, &on, why, sniffed.as_deref(), now, local) {
            return false;
        }
        if let Some(f) = self.flows.get(&key) {
            let record = &f.listed.record;
            match owner {
                Some(o) => record.set_owner(o),
                None if !asked => {
                    self.shared
                        .d
                        .record_owner(record, Network::Udp, key.client, key.server);
                }
                None => {}
            }
        }
        for p in held {
            self.forward(key, &p, None, now, local);
        }
        true
    }

    /// Send `payload` on the flow `key` has: every datagram's one lookup,
    /// and a second one for a flow just opened (with what its sniffer
    /// held). False if there is no such flow.
    fn forward(
        &mut self,
        key: FlowKey,
        payload: &[u8],
        longest: Option<usize>,
        now: Instant,
        local: &mut LocalCounters,
    ) -> bool {
        let Some(flow) = self.flows.get_mut(&key) else {
            return false;
        };
        // A queued flow whose task a network change ended (already
        // counted by it): closed, so this datagram opens one on the new
        // network.
        if flow.state.stranded() {
            self.flows.remove(&key);
            self.owned -= 1;
            self.shared.d.stats.udp_flows_active.fetch_sub(1, Relaxed);
            return false;
        }
        // Closed by the host: this datagram opens a new flow.
        if listed::closing(&flow.listed) {
            self.close_listed(&[key]);
            return false;
        }
        let refused = send_on(
            flow,
            key,
            &mut self.gso,
            self.shared.mtu,
            payload,
            longest,
            now,
            local,
        );
        self.gso_refused(refused);
        true
    }

    /// A flow whose path refused a GSO send sends one datagram at a time.
    fn gso_refused(&mut self, refused: Option<FlowKey>) {
        if let Some(refused) = refused
            && let Some(f) = self.flows.get_mut(&refused)
        {
            f.gso = false;
        }
    }

    /// Open the flow `key` along its planned route: under its app source's
    /// mapping (direct to an address, endpoint-independent), or a flow of
    /// its own. False if it could not be opened (counted).
    #[allow(clippy::too_many_arguments)]
    fn open_planned(
        &mut self,
        key: FlowKey,
        route: Route,
        dst: Address,
        on: &Arc<Routing>,
        why: Why,
        sniffed: Option<&str>,
        now: Instant,
        local: &mut LocalCounters,
    ) -> bool {
        let why = on.outbounds.explain(&why);
        let outbound = on.outbounds.name(route);
        let listed = |env: &UdpEnv, state: &ReplyState| {
            listed::register(env, key, outbound, why, &dst, sniffed, &state.tally)
        };
        // An IPv4 destination reached through the network's NAT64 prefix
        // takes a connected socket of its own: its replies then come from
        // the flow's IPv4 server as the app expects, where a mapping's
        // IPv4 socket could not send at all (`outbound/nat64.rs`).
        let mapped = self.shared.nat == UdpNat::EndpointIndependent
            && matches!(dst, Address::Ip(_))
            && !on.outbounds.udp_proxied(route)
            && !self.shared.factory.nat64().applies_to(key.server.ip());
        if mapped {
            self.map(key, now, listed, local)
        } else {
            self.open(key, route, dst.clone(), on, now, listed, local)
        }
    }

    /// Open the flow `key` along the route its plan chose, to `dst` (a
    /// fake address's domain, or the address the app used). False if its
    /// socket could not be opened (counted).
    #[allow(clippy::too_many_arguments)]
    fn open(
        &mut self,
        key: FlowKey,
        route: Route,
        dst: Address,
        on: &Arc<Routing>,
        now: Instant,
        listed: impl FnOnce(&UdpEnv, &ReplyState) -> Registered,
        local: &mut LocalCounters,
    ) -> bool {
        // What is gathered goes out before the table changes (an eviction
        // below may close the flow it belongs to).
        self.flush(local);
        let server = key.server;
        let shared = self.shared.clone();
        if self.len() >= self.shared.max_flows {
            self.evict_oldest();
        }
        let state = Arc::new(ReplyState::new(self.epoch, shared.mtu));
        let (io, task) = match (route, dst) {
            (Route::Proxy(i), target) if on.outbounds.udp_proxied(route) => {
                let (queue, inbox) = Queue::new(shared.queues.clone(), shared.mtu);
                let task = tokio::spawn(proxied::proxy_flow(
                    self.shared.clone(),
                    on.outbounds.clone(),
                    i,
                    key,
                    target,
                    inbox,
                    state.clone(),
                ))
                .abort_handle();
                (FlowIo::Queued(queue), task)
            }
            // Direct to a domain: resolved in the flow's task, so the flow
            // takes the queued path while that happens.
            (_, Address::Domain(domain, _)) => {
                // The plan names a domain only with the DNS service on.
                let Some(dns) = on.dns.clone() else {
                    local.drop(EngineDrop::UdpOpenFailed);
                    return false;
                };
                let (queue, inbox) = Queue::new(shared.queues.clone(), shared.mtu);
                let task = tokio::spawn(proxied::resolved_flow(
                    self.shared.clone(),
                    dns,
                    domain,
                    key,
                    inbox,
                    state.clone(),
                ))
                .abort_handle();
                (FlowIo::Queued(queue), task)
            }
            // Direct (a proxy with `udp = "direct"` planned as direct).
            _ => {
                let sock = match shared.factory.udp_connected(server) {
                    Ok(s) => Arc::new(s),
                    Err(e) => {
                        local.drop(EngineDrop::UdpOpenFailed);
                        self.shared
                            .d
                            .warn
                            .warn(format_args!("udp flow to {server}: {e}"));
                        return false;
                    }
                };
                let task = tokio::spawn(reply::reply_loop(
                    sock.clone(),
                    self.shared.clone(),
                    key.client,
                    Some(key.server),
                    state.clone(),
                ))
                .abort_handle();
                (FlowIo::Direct(sock), task)
            }
        };
        let listed = listed(&shared, &state);
        self.flows.insert(
            key,
            Flow {
                gso: matches!(io, FlowIo::Direct(_)) && gather::supported(),
                io,
                last_up: now,
                state,
                task: Some(task),
                listed,
            },
        );
        self.owned += 1;
        self.shared.d.stats.udp_flows_total.fetch_add(1, Relaxed);
        self.shared.d.stats.udp_flows_active.fetch_add(1, Relaxed);
        true
    }

    /// Enter the direct flow `key` under its app source's [`Mapping`],
    /// opening that (its socket and reply task) first if there is none.
    /// False if the socket could not be opened (counted).
    fn map(
        &mut self,
        key: FlowKey,
        now: Instant,
        listed: impl FnOnce(&UdpEnv, &ReplyState) -> Registered,
        local: &mut LocalCounters,
    ) -> bool {
        // What is gathered goes out before the table changes.
        self.flush(local);
        if !self.mappings.contains_key(&key.client) {
            if self.len() >= self.shared.max_flows {
                self.evict_oldest();
            }
            let sock = match self.shared.factory.udp_unconnected(key.client.is_ipv6()) {
                Ok(s) => Arc::new(s),
                Err(e) => {
                    local.drop(EngineDrop::UdpOpenFailed);
                    self.shared
                        .d
                        .warn
                        .warn(format_args!("udp mapping for {}: {e}", key.client));
                    return false;
                }
            };
            let state = Arc::new(ReplyState::new(self.epoch, self.shared.mtu));
            let task = tokio::spawn(reply::reply_loop(
                sock.clone(),
                self.shared.clone(),
                key.client,
                None,
                state.clone(),
            ))
            .abort_handle();
            self.mappings.insert(
                key.client,
                Mapping {
                    sock,
                    state,
                    task,
                    peers: VecDeque::new(),
                },
            );
            self.shared.d.stats.udp_flows_total.fetch_add(1, Relaxed);
            self.shared.d.stats.udp_flows_active.fetch_add(1, Relaxed);
        }
        let Some(m) = self.mappings.get_mut(&key.client) else {
            return false;
        };
        let flow = Flow {
            io: FlowIo::Mapped(m.sock.clone()),
            gso: gather::supported(),
            last_up: now,
            state: m.state.clone(),
            task: None,
            listed: listed(&self.shared, &m.state),
        };
        m.peers.push_back(key.server);
        if m.peers.len() > MAPPING_PEERS
            && let Some(old) = m.peers.pop_front()
        {
            self.flows.remove(&FlowKey::new(key.client, old));
            m.state.tally.remove(old);
        }
        self.flows.insert(key, flow);
        true
    }
}

impl Drop for UdpTable {
    fn drop(&mut self) {
        let n = self.len() as u64;
        self.shared.d.stats.udp_flows_active.fetch_sub(n, Relaxed);
    }
}
