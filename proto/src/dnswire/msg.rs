//! DNS messages (sans-I/O): validate a hijacked query, build the answers
//! kerntun gives itself (SERVFAIL, FORMERR, fake-ip), check an upstream's
//! reply against the question it answers, and derive a reply's cache
//! lifetime. Everything here takes bytes from the network, so every failure
//! is a value, never a panic.
//!
//! A hijacked query is judged by its fixed header before hickory decodes
//! anything: only a standard query of at most [`MAX_QUERY`] bytes with one
//! question and at most one additional record (its OPT) is decoded, so what
//! a query holds decoded is bounded by its size, whatever its header
//! claims (hickory's records hold 15 to 25 times their wire size).

use std::net::IpAddr;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};

/// Longest cache lifetime given to any answer (a day): an upstream's
/// week-long TTL should not pin a stale address for the engine's life.
pub const MAX_TTL: u32 = 86_400;
/// Longest lifetime of a negative answer (RFC 2308 section 5 suggests one to
/// three hours as a cap; five minutes keeps a freshly created name from
/// staying invisible for long on a phone).
pub const MAX_NEG_TTL: u32 = 300;
/// EDNS payload size kerntun advertises in its own answers (the DNS Flag Day
/// 2020 value, fits every path MTU in practice).
pub const EDNS_PAYLOAD: u16 = 1232;
/// Plain DNS over UDP without EDNS (RFC 1035 section 4.2.1).
pub const UDP_PLAIN_MAX: usize = 512;
/// The longest hijacked query taken, over UDP or TCP. A query is one
/// question (a name of at most 255 bytes, RFC 1035 section 3.1, its type
/// and class) and at most one OPT record, whose options a stub resolver
/// fills with a cookie, a client subnet, keepalive or padding (RFC 8467
/// pads a query to a multiple of 128 bytes): well under 1 KiB. 4 KiB
/// leaves room for options not named here.
pub const MAX_QUERY: usize = 4096;
/// EDNS options a hijacked query may carry. hickory holds each as a 40-byte
/// entry beside its data, so options without data (4 bytes on the wire)
/// would decode to ten times their size, 1000 of them in [`MAX_QUERY`]; a
/// stub resolver sends a handful (the cookie, client subnet, padding and
/// keepalive options named above).
pub const MAX_QUERY_OPTIONS: usize = 16;

/// A hijacked packet, looked at.
#[derive(Debug)]
pub enum Incoming {
    /// A standard query with exactly one question, and at most an OPT
    /// record (with at most [`MAX_QUERY_OPTIONS`] options) beside it.
    Query(Box<Message>),
    /// A query kerntun answers without asking anyone, from its header alone
    /// (its ID, opcode and RD bit): FORMERR for a query longer than
    /// [`MAX_QUERY`], with other than one question, with answer or
    /// authority records, with additional records other than one OPT, or
    /// with more options than [`MAX_QUERY_OPTIONS`]; NOTIMP for other
    /// opcodes.
    Refuse(Vec<u8>),
}

/// The fixed header of a DNS message (RFC 1035 section 4.1.1), read
/// without decoding anything after it.
#[derive(Debug, Clone, Copy)]
struct Header {
    id: u16,
    /// QR, opcode, AA, TC, RD, RA, Z, AD, CD, RCODE.
    flags: u16,
    /// Questions, answers, authority and additional records.
    counts: [u16; 4],
}

/// Length of the fixed header.
const HEADER_LEN: usize = 12;
/// The least a question takes on the wire: the root name (one byte), type
/// and class.
const MIN_QUESTION: usize = 5;
/// The least a record takes: the root name, type, class, TTL and RDLENGTH.
const MIN_RECORD: usize = 11;

impl Header {
    fn read(buf: &[u8]) -> Option<Header> {
        let h = buf.first_chunk::<HEADER_LEN>()?;
        let word = |i: usize| u16::from_be_bytes([h[i], h[i + 1]]);
        Some(Header {
            id: word(0),
            flags: word(2),
            counts: [word(4), word(6), word(8), word(10)],
        })
    }

    fn is_response(self) -> bool {
        self.flags & 0x8000 != 0
    }

    fn op_code(self) -> OpCode {
        OpCode::from_u8(((self.flags >> 11) & 0x0f) as u8)
    }

    fn recursion_desired(self) -> bool {
        self.flags & 0x0100 != 0
    }

    /// Whether a message of `len` bytes can hold the sections the counts
    /// announce, each at its smallest. Counts it cannot hold say the bytes
    /// are not a DNS message at all.
    fn counts_fit(self, len: usize) -> bool {
        let [qd, an, ns, ar] = self.counts.map(usize::from);
        HEADER_LEN + qd * MIN_QUESTION + (an + ns + ar) * MIN_RECORD <= len
    }

    /// An answer with this header's ID, opcode and RD bit, `code` and no
    /// sections: whatever made the query unusable stays out.
    fn refusal(self, code: ResponseCode) -> Vec<u8> {
        let mut r = Message::error_msg(self.id, self.op_code(), code);
        r.metadata.recursion_desired = self.recursion_desired();
        r.to_vec().unwrap_or_default()
    }
}

/// Look at a hijacked packet. `None`: not a DNS query at all (shorter than
/// a header, a response, counts its bytes cannot hold, or a standard query
/// hickory cannot decode), which the caller counts as malformed and drops.
/// Everything [`Incoming::Refuse`] lists is decided from the header and
/// the length, before any of the message is decoded, except what the one
/// additional record is and how many options it holds (decoded, that
/// record is bounded by [`MAX_QUERY`]).
pub fn parse_query(buf: &[u8]) -> Option<Incoming> {
    let h = Header::read(buf)?;
    if h.is_response() || !h.counts_fit(buf.len()) {
        return None;
    }
    if h.op_code() != OpCode::Query {
        return Some(Incoming::Refuse(h.refusal(ResponseCode::NotImp)));
    }
    let [qd, an, ns, ar] = h.counts;
    if buf.len() > MAX_QUERY || qd != 1 || an != 0 || ns != 0 || ar > 1 {
        return Some(Incoming::Refuse(h.refusal(ResponseCode::FormErr)));
    }
    let msg = Message::from_vec(buf).ok()?;
    let options = msg.edns.as_ref().map_or(0, |e| e.options().options.len());
    if !msg.additionals.is_empty() || msg.signature.is_some() || options > MAX_QUERY_OPTIONS {
        return Some(Incoming::Refuse(h.refusal(ResponseCode::FormErr)));
    }
    Some(Incoming::Query(Box::new(msg)))
}

/// The one question of a validated query.
pub fn question(q: &Message) -> Option<&Query> {
    q.queries.first()
}

/// A reply skeleton for `q`: its ID, question and RD bit; EDNS when the
/// query spoke EDNS (RFC 6891 section 6.1.1: a responder answers an OPT
/// with an OPT).
pub fn reply_to(q: &Message, code: ResponseCode) -> Message {
    let mut r = Message::response(q.metadata.id, OpCode::Query);
    r.metadata.recursion_desired = q.metadata.recursion_desired;
    r.metadata.recursion_available = true;
    r.metadata.response_code = code;
    r.queries = q.queries.clone();
    if q.edns.is_some() {
        let mut e = Edns::new();
        e.set_max_payload(EDNS_PAYLOAD);
        r.edns = Some(e);
    }
    r
}

/// SERVFAIL for `q`.
pub fn servfail(q: &Message) -> Vec<u8> {
    encode(&reply_to(q, ResponseCode::ServFail))
}

/// Encode, falling back to a header-only SERVFAIL if the message cannot be
/// written (a name hickory refuses to emit), so a client never hears nothing.
pub fn encode(m: &Message) -> Vec<u8> {
    match m.to_vec() {
        Ok(v) => v,
        Err(_) => {
            let mut r = Message::error_msg(m.metadata.id, OpCode::Query, ResponseCode::ServFail);
            r.metadata.recursion_desired = m.metadata.recursion_desired;
            r.to_vec().unwrap_or_default()
        }
    }
}

/// NOERROR without records for `q` (RFC 2308 section 2.2, NODATA: the
/// name exists, without records of the type asked for). No SOA goes with
/// it, so resolvers do not cache it (RFC 2308 section 5) and ask again;
/// the engine answers that from memory.
pub fn no_records(q: &Message) -> Vec<u8> {
    encode(&reply_to(q, ResponseCode::NoError))
}

/// A fake-ip answer: one A/AAAA record with `ttl`, or an empty NOERROR
/// (`addr` = `None`, e.g. AAAA without an IPv6 pool).
pub fn fake_answer(q: &Message, addr: Option<IpAddr>, ttl: u32) -> Vec<u8> {
    let mut r = reply_to(q, ResponseCode::NoError);
    if let (Some(a), Some(qq)) = (addr, question(q)) {
        let data = match a {
            IpAddr::V4(v4) => RData::A(A(v4)),
            IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
        };
        r.answers
            .push(Record::from_rdata(qq.name.clone(), ttl, data));
    }
    encode(&r)
}

/// The lower-cased, dot-terminated text of a query name (cache key and
/// fake-ip domain).
pub fn key_name(n: &Name) -> String {
    let mut s = n.to_lowercase().to_ascii();
    if !s.ends_with('.') {
        s.push('.');
    }
    s
}

/// Whether `raw` looks like the reply to query ID `id` (cheap check before a
/// full decode; stray or spoofed datagrams fail it).
pub fn id_matches(raw: &[u8], id: u16) -> bool {
    raw.len() >= 12 && u16::from_be_bytes([raw[0], raw[1]]) == id && raw[2] & 0x80 != 0
}

/// Why an upstream's reply is not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadReply {
    /// Not decodable, or not a response to our question.
    Mismatch,
    /// SERVFAIL or REFUSED: the next upstream may do better.
    Failed,
    /// TC set: ask again over TCP.
    Truncated,
}

/// Decode an upstream's reply and check it answers `q`.
pub fn check_reply(raw: &[u8], id: u16, q: &Query) -> Result<Message, BadReply> {
    let m = Message::from_vec(raw).map_err(|_| BadReply::Mismatch)?;
    if m.metadata.id != id || m.metadata.message_type != MessageType::Response {
        return Err(BadReply::Mismatch);
    }
    match m.queries.as_slice() {
        [rq] if rq.query_type == q.query_type
            && rq.query_class == q.query_class
            && rq.name == q.name => {}
        _ => return Err(BadReply::Mismatch),
    }
    if m.metadata.truncation {
        return Err(BadReply::Truncated);
    }
    if matches!(
        m.metadata.response_code,
        ResponseCode::ServFail | ResponseCode::Refused
    ) {
        return Err(BadReply::Failed);
    }
    Ok(m)
}

/// How long a reply may be cached: the smallest TTL of its answer records,
/// or for a negative answer (NXDOMAIN, or NOERROR without answers) the SOA's
/// negative TTL (RFC 2308 section 5: min of the SOA record's TTL and its
/// MINIMUM field). `None`: not cacheable (other codes, a TTL of 0, a
/// negative answer without SOA).
pub fn cache_ttl(m: &Message) -> Option<u32> {
    let code = m.metadata.response_code;
    if code != ResponseCode::NoError && code != ResponseCode::NXDomain {
        return None;
    }
    let ttl = if code == ResponseCode::NoError && !m.answers.is_empty() {
        m.answers.iter().map(|r| r.ttl).min()?.min(MAX_TTL)
    } else {
        m.authorities
            .iter()
            .find_map(|r| match &r.data {
                RData::SOA(soa) => Some(r.ttl.min(soa.minimum)),
                _ => None,
            })?
            .min(MAX_NEG_TTL)
    };
    (ttl > 0).then_some(ttl)
}

/// A cached reply made into the answer to `q`: the query's ID and question
/// (its letter case, which some stub resolvers check), TTLs reduced by the
/// seconds the entry has spent in the cache.
pub fn from_cache(cached: &Message, q: &Message, elapsed: u32) -> Vec<u8> {
    let mut r = cached.clone();
    r.metadata.id = q.metadata.id;
    r.metadata.recursion_desired = q.metadata.recursion_desired;
    r.queries = q.queries.clone();
    for rec in r
        .answers
        .iter_mut()
        .chain(r.authorities.iter_mut())
        .chain(r.additionals.iter_mut())
    {
        rec.ttl = rec.ttl.saturating_sub(elapsed);
    }
    encode(&r)
}

/// The addresses in a reply's answer section of the family asked for.
pub fn addresses(m: &Message, v6: bool) -> impl Iterator<Item = IpAddr> + '_ {
    m.answers.iter().filter_map(move |r| match &r.data {
        RData::A(a) if !v6 => Some(IpAddr::V4(a.0)),
        RData::AAAA(a) if v6 => Some(IpAddr::V6(a.0)),
        _ => None,
    })
}

/// A standard recursive query for `name` (A or AAAA) with a random ID.
pub fn build_query(name: &str, v6: bool) -> Option<Message> {
    let name = Name::from_ascii(name).ok()?;
    let mut name = name;
    name.set_fqdn(true);
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    let mut q = Query::query(name, if v6 { RecordType::AAAA } else { RecordType::A });
    q.query_class = DNSClass::IN;
    m.queries.push(q);
    Some(m)
}

/// The largest reply a UDP client can take: its EDNS payload size, else 512
/// bytes.
pub fn udp_limit(q: &Message) -> usize {
    match &q.edns {
        Some(e) => usize::from(e.max_payload()).max(UDP_PLAIN_MAX),
        None => UDP_PLAIN_MAX,
    }
}

/// A reply too long for the client's UDP limit, cut to its header, question
/// and OPT with TC set (RFC 1035 section 4.2.1; RFC 7766: the client then
/// asks over TCP).
pub fn truncate(raw: &[u8]) -> Option<Vec<u8>> {
    let m = Message::from_vec(raw).ok()?;
    m.truncate().to_vec().ok()
}

/// Whether a query type is answered from the fake-ip pool.
pub fn is_address_query(q: &Query) -> Option<bool> {
    if q.query_class != DNSClass::IN {
        return None;
    }
    match q.query_type {
        RecordType::A => Some(false),
        RecordType::AAAA => Some(true),
        _ => None,
    }
}

/// Test-only message builders, for this crate's tests and the engine's.
#[cfg(any(test, feature = "testutil"))]
#[doc(hidden)]
#[allow(clippy::unwrap_used)]
pub mod testutil {
    use super::*;

    pub fn query(name: &str, t: RecordType, id: u16) -> Vec<u8> {
        let mut m = Message::new(id, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = true;
        m.queries
            .push(Query::query(Name::from_ascii(name).expect("name"), t));
        m.to_vec().expect("encode")
    }

    pub fn answer_a(q: &[u8], addr: [u8; 4], ttl: u32) -> Message {
        let Some(Incoming::Query(q)) = parse_query(q) else {
            panic!("query")
        };
        let mut r = reply_to(&q, ResponseCode::NoError);
        r.answers.push(Record::from_rdata(
            q.queries[0].name.clone(),
            ttl,
            RData::A(A(addr.into())),
        ));
        r
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;
    use hickory_proto::rr::rdata::SOA;
    use hickory_proto::rr::rdata::opt::EdnsOption;

    #[test]
    fn queries_and_non_queries() {
        let q = query("Example.COM.", RecordType::A, 7);
        let Some(Incoming::Query(m)) = parse_query(&q) else {
            panic!("a query")
        };
        assert_eq!(key_name(&m.queries[0].name), "example.com.");
        // A response is not a query.
        let r = encode(&answer_a(&q, [1, 2, 3, 4], 5));
        assert!(parse_query(&r).is_none());
        // Garbage and truncations never panic.
        assert!(parse_query(b"").is_none());
        assert!(parse_query(&[0xff; 11]).is_none());
        for n in 0..q.len() {
            let _ = parse_query(&q[..n]);
        }
        // Two questions: FORMERR with the ID.
        let mut two = Message::from_vec(&q).expect("decode");
        two.queries.push(two.queries[0].clone());
        let Some(Incoming::Refuse(f)) = parse_query(&two.to_vec().expect("enc")) else {
            panic!("refused")
        };
        let f = Message::from_vec(&f).expect("decode");
        assert_eq!(f.metadata.id, 7);
        assert_eq!(f.metadata.response_code, ResponseCode::FormErr);
    }

    /// `query` with its counts patched: (answers, authority, additional).
    fn with_counts(q: &[u8], an: u16, ns: u16, ar: u16) -> Vec<u8> {
        let mut q = q.to_vec();
        q[6..8].copy_from_slice(&an.to_be_bytes());
        q[8..10].copy_from_slice(&ns.to_be_bytes());
        q[10..12].copy_from_slice(&ar.to_be_bytes());
        q
    }

    /// An A query with an OPT record holding `n` options of `data` bytes each.
    fn with_options(n: u16, data: usize) -> Vec<u8> {
        let mut m = Message::from_vec(&query("a.test.", RecordType::A, 4)).expect("decode");
        let mut e = Edns::new();
        e.set_max_payload(1232);
        for i in 0..n {
            e.options_mut()
                .insert(EdnsOption::Unknown(20_000 + i, vec![0; data]));
        }
        m.set_edns(e);
        m.to_vec().expect("encode")
    }

    fn code_and_id(r: &[u8]) -> (ResponseCode, u16) {
        let m = Message::from_vec(r).expect("our refusal decodes");
        assert!(m.queries.is_empty() && m.answers.is_empty() && m.edns.is_none());
        (m.metadata.response_code, m.metadata.id)
    }

    fn refused(q: &[u8]) -> (ResponseCode, u16) {
        match parse_query(q) {
            Some(Incoming::Refuse(r)) => code_and_id(&r),
            other => panic!("refused, not {other:?}"),
        }
    }

    /// Records in the answer or authority section, more than one
    /// additional record, or one that is not an OPT: FORMERR with the
    /// query's ID. The section counts are judged before anything is
    /// decoded: records that hickory could not decode (labels of 0xff)
    /// still get FORMERR, not a malformed drop.
    #[test]
    fn only_a_question_and_an_opt_are_taken() {
        let q = query("a.test.", RecordType::A, 9);
        let junk = [0xff; 3 * MIN_RECORD];
        for (an, ns, ar) in [(1, 0, 0), (0, 1, 0), (0, 0, 2), (1, 1, 1)] {
            let mut m = with_counts(&q, an, ns, ar);
            m.extend_from_slice(&junk);
            assert_eq!(
                refused(&m),
                (ResponseCode::FormErr, 9),
                "{an} {ns} {ar}, undecodable"
            );
        }
        // Decodable: an A record as the one additional record.
        let mut a = Message::from_vec(&q).expect("decode");
        a.additionals.push(Record::from_rdata(
            a.queries[0].name.clone(),
            5,
            RData::A(A::new(1, 2, 3, 4)),
        ));
        assert_eq!(
            refused(&a.to_vec().expect("encode")),
            (ResponseCode::FormErr, 9)
        );
        // Counts the bytes cannot hold: not DNS, dropped.
        assert!(parse_query(&with_counts(&q, 65_535, 0, 0)).is_none());
        assert!(parse_query(&with_counts(&q, 0, 0, 3)).is_none());
        assert!(parse_query(b"definitely not dns").is_none());
        // One OPT is fine.
        assert!(matches!(
            parse_query(&with_options(0, 0)),
            Some(Incoming::Query(_))
        ));
    }

    #[test]
    fn options_and_length_are_capped() {
        let Some(Incoming::Query(m)) = parse_query(&with_options(MAX_QUERY_OPTIONS as u16, 0))
        else {
            panic!("the most options taken")
        };
        assert_eq!(
            m.edns.as_ref().map(|e| e.options().options.len()),
            Some(MAX_QUERY_OPTIONS)
        );
        assert_eq!(
            refused(&with_options(MAX_QUERY_OPTIONS as u16 + 1, 0)),
            (ResponseCode::FormErr, 4)
        );
        assert_eq!(refused(&with_options(1_000, 0)), (ResponseCode::FormErr, 4));
        // One option's data fills the query to the cap, then one byte past.
        let base = with_options(1, 0).len();
        let full = with_options(1, MAX_QUERY - base);
        assert_eq!(full.len(), MAX_QUERY);
        assert!(matches!(parse_query(&full), Some(Incoming::Query(_))));
        let over = with_options(1, MAX_QUERY - base + 1);
        assert_eq!(refused(&over), (ResponseCode::FormErr, 4));
        // The 40-byte entry MAX_QUERY_OPTIONS is sized by.
        assert!(std::mem::size_of::<(hickory_proto::rr::rdata::opt::EdnsCode, EdnsOption)>() <= 40);
    }

    /// Another opcode: NOTIMP from the header, its opcode and RD bit kept,
    /// whatever follows the header.
    #[test]
    fn other_opcodes_are_not_implemented() {
        let mut q = query("a.test.", RecordType::A, 0x77);
        q[2] = (q[2] & !0x78) | (4 << 3);
        let tail = q.len() - 3;
        q[tail] = 0xff;
        let Some(Incoming::Refuse(r)) = parse_query(&q) else {
            panic!("refused")
        };
        let m = Message::from_vec(&r).expect("decode");
        assert_eq!(m.metadata.response_code, ResponseCode::NotImp);
        assert_eq!(m.metadata.op_code, OpCode::Notify);
        assert!(m.metadata.recursion_desired);
        assert_eq!(m.metadata.id, 0x77);
    }

    #[test]
    fn servfail_and_fake_keep_id_and_question() {
        let q = query("a.test.", RecordType::AAAA, 0xbeef);
        let Some(Incoming::Query(m)) = parse_query(&q) else {
            panic!()
        };
        let s = Message::from_vec(&servfail(&m)).expect("decode");
        assert_eq!(s.metadata.id, 0xbeef);
        assert_eq!(s.metadata.response_code, ResponseCode::ServFail);
        assert_eq!(s.queries, m.queries);
        let f = Message::from_vec(&fake_answer(&m, Some("fd00::5".parse().expect("ip")), 1))
            .expect("decode");
        assert_eq!(f.answers.len(), 1);
        assert_eq!(f.answers[0].ttl, 1);
        let e = Message::from_vec(&fake_answer(&m, None, 1)).expect("decode");
        assert!(e.answers.is_empty());
        assert_eq!(e.metadata.response_code, ResponseCode::NoError);
    }

    #[test]
    fn ttl_rules() {
        let q = query("a.test.", RecordType::A, 1);
        let mut r = answer_a(&q, [1, 1, 1, 1], 60);
        r.answers[0].ttl = 60;
        let mut second = r.answers[0].clone();
        second.ttl = 30;
        r.answers.push(second);
        assert_eq!(cache_ttl(&r), Some(30));
        r.answers[1].ttl = 0;
        assert_eq!(cache_ttl(&r), None);
        // Negative: SOA min(ttl, minimum), capped.
        let Some(Incoming::Query(m)) = parse_query(&q) else {
            panic!()
        };
        let mut n = reply_to(&m, ResponseCode::NXDomain);
        assert_eq!(cache_ttl(&n), None, "no SOA, not cacheable");
        let soa = SOA::new(
            Name::from_ascii("ns.test.").expect("n"),
            Name::from_ascii("h.test.").expect("n"),
            1,
            2,
            3,
            4,
            45,
        );
        n.authorities.push(Record::from_rdata(
            Name::from_ascii("test.").expect("n"),
            3600,
            RData::SOA(soa),
        ));
        assert_eq!(cache_ttl(&n), Some(45));
        n.authorities[0].ttl = 10;
        assert_eq!(cache_ttl(&n), Some(10));
        if let RData::SOA(s) = &mut n.authorities[0].data {
            s.minimum = 100_000;
        }
        n.authorities[0].ttl = 100_000;
        assert_eq!(cache_ttl(&n), Some(MAX_NEG_TTL));
        n.metadata.response_code = ResponseCode::ServFail;
        assert_eq!(cache_ttl(&n), None);
    }

    #[test]
    fn cached_reply_takes_the_new_id_and_decrements() {
        let q1 = query("a.test.", RecordType::A, 1);
        let r = answer_a(&q1, [9, 9, 9, 9], 100);
        let q2 = query("A.Test.", RecordType::A, 2);
        let Some(Incoming::Query(m2)) = parse_query(&q2) else {
            panic!()
        };
        let out = Message::from_vec(&from_cache(&r, &m2, 40)).expect("decode");
        assert_eq!(out.metadata.id, 2);
        assert_eq!(out.answers[0].ttl, 60);
        assert!(out.queries[0].name.eq_case(&m2.queries[0].name));
        let out = Message::from_vec(&from_cache(&r, &m2, 500)).expect("decode");
        assert_eq!(out.answers[0].ttl, 0);
    }

    #[test]
    fn reply_checks() {
        let q = query("a.test.", RecordType::A, 5);
        let qq = Message::from_vec(&q).expect("d").queries[0].clone();
        let r = encode(&answer_a(&q, [1, 2, 3, 4], 9));
        assert!(id_matches(&r, 5));
        assert!(!id_matches(&r, 6));
        assert!(!id_matches(&q, 5), "a query is not a reply");
        assert!(check_reply(&r, 5, &qq).is_ok());
        assert_eq!(check_reply(&r, 6, &qq).err(), Some(BadReply::Mismatch));
        let other = Message::from_vec(&query("b.test.", RecordType::A, 5))
            .expect("d")
            .queries[0]
            .clone();
        assert_eq!(check_reply(&r, 5, &other).err(), Some(BadReply::Mismatch));
        let mut t = answer_a(&q, [1, 2, 3, 4], 9);
        t.metadata.truncation = true;
        assert_eq!(
            check_reply(&encode(&t), 5, &qq).err(),
            Some(BadReply::Truncated)
        );
        t.metadata.truncation = false;
        t.metadata.response_code = ResponseCode::ServFail;
        assert_eq!(
            check_reply(&encode(&t), 5, &qq).err(),
            Some(BadReply::Failed)
        );
        let tr = Message::from_vec(&truncate(&r).expect("t")).expect("d");
        assert!(tr.metadata.truncation && tr.answers.is_empty());
        let b = build_query("example.org", true).expect("q");
        assert_eq!(b.queries[0].query_type, RecordType::AAAA);
        assert_eq!(addresses(&answer_a(&q, [1, 2, 3, 4], 9), false).count(), 1);
    }
}
