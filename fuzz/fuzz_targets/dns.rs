//! Fuzz target for the DNS service's message handling.
//!
//! The input is a packet that reached the hijacked port 53 (and, for the
//! reply checks, an upstream's reply): kerntun::dns::fuzzing::run validates
//! it as a query, builds SERVFAIL, refusal and fake-ip answers, stores a
//! reply in a two-entry cache and serves it back, and assigns fake
//! addresses from a four-slot pool.
//!
//! Invariants: nothing panics; every answer kerntun builds decodes and
//! carries the query's ID; the pool and cache stay within their bounds.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kerntun::dns::fuzzing::run(data);
});
