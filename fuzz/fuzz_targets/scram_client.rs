#![no_main]
//! Both server messages of a SCRAM exchange as pgherd's client side reads them (pgherd logs in
//! to servers), split from one input at the first 0xff.
use libfuzzer_sys::fuzz_target;
use pgherd_wire::scram::{ScramClient, ScramCredential};

fuzz_target!(|data: &[u8]| {
    let (first, last) = match data.iter().position(|&b| b == 0xff) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let (client, _) = ScramClient::new(ScramCredential::Password("pw".into()), b"client-nonce");
    if let Ok((waiting, _)) = client.server_first(first) {
        let _ = waiting.server_final(last);
    }
});
