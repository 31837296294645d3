#![no_main]
//! Both client messages of a SCRAM exchange, split from one input at the first 0xff.
use libfuzzer_sys::fuzz_target;
use pgherd_wire::scram::{ScramServer, ScramVerifier};

fuzz_target!(|data: &[u8]| {
    let (first, last) = match data.iter().position(|&b| b == 0xff) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let server = ScramServer::new(ScramVerifier::from_password("pw", b"salt", 1), b"nonce");
    if let Ok((waiting, _)) = server.client_first(first) {
        let _ = waiting.client_final(last);
    }
});
