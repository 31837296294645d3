#![no_main]
//! A byte stream framed as messages, each body given to every parser.
use libfuzzer_sys::fuzz_target;
use pgherd_wire::{backend, frame, frontend};

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    while let Ok(Some((header, body))) = frame::split_message(rest, 1 << 16) {
        let _ = frontend::Query::parse(body);
        let _ = frontend::Parse::parse(body);
        let _ = frontend::Bind::parse(body);
        let _ = frontend::Describe::parse(body);
        let _ = frontend::Close::parse(body);
        let _ = frontend::Execute::parse(body);
        let _ = frontend::SaslInitialResponse::parse(body);
        let _ = backend::Authentication::parse(body);
        let _ = backend::parse_data_row(body);
        let _ = backend::parse_row_description(body);
        let _ = pgherd_wire::PgError::parse(body);
        rest = &rest[header.total_len()..];
    }
});
