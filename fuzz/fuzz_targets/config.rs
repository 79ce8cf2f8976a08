//! Fuzz target for the configuration parser: TOML from a file or an app.
//!
//! Invariants: nothing panics; an accepted configuration also passes
//! `validate`, and serialising it and parsing it again gives the same value.
#![no_main]

use kerntun::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = Config::from_toml(text) else {
        return;
    };
    assert!(cfg.validate().is_ok(), "from_toml returned an invalid config");
    if let Ok(again) = toml::to_string(&cfg) {
        let back = Config::from_toml(&again).expect("a serialised config parses");
        assert_eq!(back, cfg, "round trip");
    }
});
