//! Fuzz target for the smoltcp stack: a byte program of raw packets,
//! well-formed segments of a few flows (SYN-first handshakes, data, FIN,
//! RST, options, stray sequence numbers), connect outcomes, session reads,
//! writes, closes, aborts and drops, clock jumps and a TUN that refuses
//! writes, all through the gate the engine's processor applies before
//! `Sockets::input`. The entry point (`kerntun::fuzzing::smol::run`)
//! asserts that nothing panics, that every emitted segment parses with a
//! valid checksum, that the socket books agree and stay within the budget,
//! and that no socket is left once every session ended and the linger time
//! passed.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kerntun::fuzzing::smol::run(data);
});
