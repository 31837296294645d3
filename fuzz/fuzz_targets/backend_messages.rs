#![no_main]
//! A byte stream framed as server messages, each body given to every backend parser (what
//! pgherd reads from a server, or a fake one).
use libfuzzer_sys::fuzz_target;
use pgherd_wire::{backend, frame};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((header, body))) = frame::split_message(rest, 1 << 16) {
        let _ = backend::parse_ready_for_query(body);
        let _ = backend::Authentication::parse(body);
        let _ = backend::parse_backend_key_data(body);
        let _ = backend::ParameterStatus::parse(body);
        let _ = backend::parse_command_complete(body);
        let _ = backend::parse_row_description(body);
        let _ = backend::parse_row_fields(body);
        let _ = backend::parse_data_row(body);
        let _ = pgherd_wire::PgError::parse(body);
        rest = &rest[header.total_len()..];
    }
});
