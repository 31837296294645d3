//! Seeded fuzz smoke test on stable Rust: valid messages of every kind are encoded, mutated
//! (bit flips, truncation, splices, forged lengths) and fed to every parser. Nothing may panic,
//! and unmutated messages must parse back to what was encoded. A failing seed is printed and
//! replays exactly with `PGHERD_FUZZ_SEED=<seed>`. The cargo-fuzz targets in `fuzz/` run the
//! same parsers coverage-guided for longer.

use bytes::BytesMut;
use pgherd_wire::backend::{self, Authentication, ParameterStatus, TxStatus};
use pgherd_wire::error::ErrorFields;
use pgherd_wire::frame::{read_header, read_startup_len, split_message};
use pgherd_wire::frontend::{
    self, Bind, Close, Describe, Execute, Parse, Query, SaslInitialResponse, Target,
};
use pgherd_wire::scram::{ScramServer, ScramVerifier};
use pgherd_wire::startup::{
    encode_cancel_request, encode_startup, parse_startup_packet, CancelKey,
};
use pgherd_wire::{PgError, SqlState};

/// xorshift64*: tiny, deterministic, and good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn bytes(&mut self, max: usize) -> Vec<u8> {
        let len = self.below(max + 1);
        (0..len).map(|_| self.next() as u8).collect()
    }
    fn text(&mut self, max: usize) -> Vec<u8> {
        let len = self.below(max + 1);
        (0..len)
            .map(|_| b"abcSELECT $1;'\\\" \xc3\xa9"[self.below(19)])
            .collect()
    }
}

fn valid_message(rng: &mut Rng) -> BytesMut {
    let mut b = BytesMut::new();
    let name = rng.text(12);
    let sql = rng.text(60);
    match rng.below(14) {
        0 => frontend::encode_query(&mut b, &sql).unwrap(),
        1 => {
            let n = rng.below(4) as u16;
            let mut types = n.to_be_bytes().to_vec();
            for _ in 0..n {
                types.extend_from_slice(&(rng.next() as u32).to_be_bytes());
            }
            frontend::encode_parse(&mut b, &name, &sql, &types).unwrap()
        }
        2 => frontend::encode_bind(
            &mut b,
            &rng.text(5),
            &name,
            &[0, 0, 0, 1, 0, 0, 0, 1, b'7', 0, 0],
        )
        .unwrap(),
        3 => frontend::encode_describe(
            &mut b,
            if rng.below(2) == 0 {
                Target::Statement
            } else {
                Target::Portal
            },
            &name,
        )
        .unwrap(),
        4 => frontend::encode_close(&mut b, Target::Statement, &name).unwrap(),
        5 => frontend::encode_execute(&mut b, &name, rng.next() as i32).unwrap(),
        6 => frontend::encode_sync(&mut b),
        7 => {
            frontend::encode_sasl_initial_response(&mut b, "SCRAM-SHA-256", &rng.bytes(40)).unwrap()
        }
        8 => PgError::error(SqlState::SYNTAX_ERROR, String::from_utf8_lossy(&sql))
            .encode(&mut b)
            .unwrap(),
        9 => backend::encode_parameter_status(&mut b, "TimeZone", "UTC").unwrap(),
        10 => backend::encode_ready_for_query(&mut b, TxStatus::InTransaction),
        11 => backend::encode_auth_sasl(&mut b, &["SCRAM-SHA-256"]).unwrap(),
        12 => backend::encode_data_row(&mut b, [Some(&sql[..]), None].into_iter()).unwrap(),
        _ => backend::encode_auth_md5(&mut b, [1, 2, 3, 4]).unwrap(),
    }
    b
}

fn mutate(rng: &mut Rng, mut m: Vec<u8>) -> Vec<u8> {
    for _ in 0..=rng.below(3) {
        match rng.below(5) {
            0 if !m.is_empty() => {
                let i = rng.below(m.len());
                m[i] ^= 1 << rng.below(8);
            }
            1 => m.truncate(rng.below(m.len() + 1)),
            2 if m.len() >= 5 => {
                // Forge the length field.
                let forged = match rng.below(4) {
                    0 => 0u32,
                    1 => 3,
                    2 => u32::MAX,
                    _ => rng.next() as u32,
                };
                m[1..5].copy_from_slice(&forged.to_be_bytes());
            }
            3 => {
                let at = rng.below(m.len() + 1);
                let junk = rng.bytes(8);
                m.splice(at..at, junk);
            }
            _ => m.push(rng.next() as u8),
        }
    }
    m
}

/// Every body parser on `body`, as if it carried `tag`.
fn parse_everything(tag: u8, body: &[u8]) {
    let _ = (
        tag,
        Query::parse(body),
        Parse::parse(body),
        Bind::parse(body),
        Describe::parse(body),
    );
    let _ = (
        Close::parse(body),
        Execute::parse(body),
        SaslInitialResponse::parse(body),
        frontend::parse_password(body),
    );
    let _ = (
        Authentication::parse(body),
        ParameterStatus::parse(body),
        backend::parse_ready_for_query(body),
    );
    let _ = (
        backend::parse_backend_key_data(body),
        backend::parse_command_complete(body),
    );
    let _ = (
        backend::parse_row_description(body),
        backend::parse_data_row(body),
        ErrorFields::parse(body),
        PgError::parse(body),
    );
}

fn run_seed(seed: u64) {
    let mut rng = Rng(seed | 1);
    for _ in 0..2_000 {
        let valid = valid_message(&mut rng);
        // Unmutated messages frame and parse back.
        let (header, body) = split_message(&valid, 1 << 20)
            .unwrap()
            .expect("a whole message");
        assert_eq!(header.total_len(), valid.len());
        parse_everything(header.tag, body);

        let mutated = mutate(&mut rng, valid.to_vec());
        let max = [64, 1 << 10, 1 << 20][rng.below(3)];
        let mut rest = &mutated[..];
        // Frame as a stream; never read past the buffer, never loop forever.
        for _ in 0..64 {
            match split_message(rest, max) {
                Ok(Some((h, body))) => {
                    assert!(h.total_len() <= rest.len() && h.total_len() <= max);
                    parse_everything(h.tag, body);
                    rest = &rest[h.total_len()..];
                }
                Ok(None) => {
                    if let Ok(Some(h)) = read_header(rest, max) {
                        assert!(h.total_len() <= max, "a header over the limit was accepted");
                    }
                    break;
                }
                Err(_) => break,
            }
        }
        parse_everything(rng.next() as u8, &mutated);

        // Startup-phase packets.
        let mut packet = BytesMut::new();
        if rng.below(2) == 0 {
            encode_startup(&mut packet, [("user", "u"), ("database", "d")]).unwrap();
        } else {
            encode_cancel_request(
                &mut packet,
                CancelKey {
                    process_id: rng.next() as i32,
                    secret_key: 7,
                },
            );
        }
        let packet = mutate(&mut rng, packet.to_vec());
        if let Ok(Some(len)) = read_startup_len(&packet) {
            if packet.len() >= len {
                let _ = parse_startup_packet(&packet[..len]);
            }
        }

        // SCRAM messages and verifiers.
        let server = ScramServer::new(ScramVerifier::from_password("pw", b"salt", 1), b"nonce");
        let client_first = mutate(&mut rng, b"n,,n=,r=clientnonce".to_vec());
        if let Ok((waiting, _)) = server.client_first(&client_first) {
            let _ =
                waiting.client_final(&mutate(&mut rng, b"c=biws,r=clientnonceXX,p=AAAA".to_vec()));
        }
        let _ = ScramVerifier::parse(&String::from_utf8_lossy(&rng.text(80)));
    }
}

#[test]
fn codec_survives_mutated_input() {
    let seeds: Vec<u64> = match std::env::var("PGHERD_FUZZ_SEED") {
        Ok(s) => vec![s.parse().expect("PGHERD_FUZZ_SEED must be a number")],
        Err(_) => (1..=25u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect(),
    };
    for seed in seeds {
        if std::panic::catch_unwind(|| run_seed(seed)).is_err() {
            panic!("fuzz smoke failed; replay with PGHERD_FUZZ_SEED={seed}");
        }
    }
}
