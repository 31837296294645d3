#![no_main]
use libfuzzer_sys::fuzz_target;
use pgherd_wire::{frame, startup};

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(len)) = frame::read_startup_len(data) {
        if data.len() >= len {
            let _ = startup::parse_startup_packet(&data[..len]);
        }
    }
});
