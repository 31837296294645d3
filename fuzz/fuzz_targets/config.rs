#![no_main]
//! A config file's text: validated or refused with a placed error, never a panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = pgherd_config::Config::parse(text, std::path::Path::new("fuzz.toml"));
    }
});
