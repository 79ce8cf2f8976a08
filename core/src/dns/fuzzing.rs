//! An entry point for the `dns` fuzz target (not part of the API): the
//! message handling a hijacked packet or an upstream's reply goes through,
//! with the cache and the fake-ip pool behind it.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;

use super::cache::Cache;
use super::fakeip::FakePool;
use super::msg::{self, Incoming};
use crate::stats::DnsCounters;

/// Treat `data` as a hijacked query and as an upstream's reply to it; check
/// the invariants every answer must hold (the query's ID, a decodable
/// message) and that cache and pool stay within their bounds.
pub fn run(data: &[u8]) {
    let counters = DnsCounters::default();
    let pool = FakePool::new(
        "198.18.0.0/29".parse().expect("static prefix"),
        Some("fd00:fa::/125".parse().expect("static prefix")),
        4,
    );
    // Room for any one reply (at most 64 KiB): an entry is always kept.
    const LIMIT: usize = 1 << 20;
    let cache = Cache::new(2);
    let now = Instant::now();
    let Some(incoming) = msg::parse_query(data) else {
        // Not a query: may still be a reply, which goes through the cache.
        if let Ok(m) = hickory_proto::op::Message::from_vec(data) {
            let _ = msg::truncate(data);
            if let Some(qq) = msg::question(&m) {
                cache_round_trip(&cache, &m, &m, qq, data, now, LIMIT);
            }
        }
        return;
    };
    let q = match incoming {
        Incoming::Refuse(r) => {
            assert_eq!(r.len(), 12, "a refusal is a header, nothing of the query");
            assert_eq!(r[..2], data[..2], "the refusal keeps the ID");
            return;
        }
        Incoming::Query(q) => q,
    };
    assert!(data.len() <= msg::MAX_QUERY, "taken within the cap");
    assert!(
        q.answers.is_empty() && q.authorities.is_empty() && q.additionals.is_empty(),
        "a question and an OPT only"
    );
    let qq = msg::question(&q).expect("a validated query has one question");
    let id = q.metadata.id;
    let sf = msg::servfail(&q);
    assert_eq!(u16::from_be_bytes([sf[0], sf[1]]), id);
    let name = msg::key_name(&qq.name);
    let domain = name.trim_end_matches('.');
    if let Some(v6) = msg::is_address_query(qq) {
        let (a4, a6) = pool
            .assign(domain, now, LIMIT, &counters)
            .expect("room in the pool");
        assert_eq!(pool.domain(IpAddr::V4(a4), now).as_deref(), Some(domain));
        assert!(pool.bytes() <= LIMIT);
        let addr = if v6 {
            a6.map(IpAddr::V6)
        } else {
            Some(IpAddr::V4(a4))
        };
        let f = msg::fake_answer(&q, addr, 1);
        let m = hickory_proto::op::Message::from_vec(&f).expect("our answers decode");
        assert_eq!(m.metadata.id, id);
    }
    // The query itself as a "reply": exercise check_reply and the cache.
    let _ = msg::check_reply(data, id, qq);
    let reply = msg::reply_to(&q, ResponseCode::NoError);
    let wire = msg::encode(&reply);
    cache_round_trip(&cache, &reply, &q, qq, &wire, now, LIMIT);
    assert!(
        counters
            .fakeip_active
            .load(std::sync::atomic::Ordering::Relaxed)
            <= 4
    );
}

/// Store `reply` (its wire form `wire`) for `qq` if it is cacheable, read it
/// back a moment later and answer `q` from it: the answer carries `q`'s ID.
fn cache_round_trip(
    cache: &Cache,
    reply: &hickory_proto::op::Message,
    q: &hickory_proto::op::Message,
    qq: &hickory_proto::op::Query,
    wire: &[u8],
    now: Instant,
    limit: usize,
) {
    let Some(ttl) = msg::cache_ttl(reply) else {
        return;
    };
    assert!(ttl <= msg::MAX_TTL);
    let name = msg::key_name(&qq.name);
    let key = (name.into_boxed_str(), u16::from(qq.query_type), 1);
    cache.insert(key.clone(), wire, ttl, now, limit);
    let (w, age) = cache
        .get(&key, now + Duration::from_millis(999))
        .expect("live");
    assert!(cache.bytes() <= limit);
    if let Ok(m) = hickory_proto::op::Message::from_vec(&w) {
        let out = msg::from_cache(&m, q, age);
        assert_eq!(out[..2], q.metadata.id.to_be_bytes());
    }
}
