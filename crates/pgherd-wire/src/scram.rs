//! SCRAM-SHA-256 (RFC 5802, RFC 7677) as PostgreSQL uses it, server side and client side.
//!
//! Both sides are state machines taken by value, so calling them in the wrong order does not
//! compile. Nonces are passed in, which keeps this module free of randomness and turns recorded
//! exchanges into test vectors. Channel binding (`-PLUS`) is not offered.
//!
//! The client side remembers the salted passwords it derived (`SALTED`): the same password
//! and salt give the same key, and deriving it costs PBKDF2's rounds (about 8 ms of a worker
//! thread at PostgreSQL's 4,096) on every server login, which a pool that grows, a failover
//! that reconnects every pool, or the minute's catalog reading would otherwise pay again each
//! time.
//!
//! The server side hands back the client's `ClientKey` after a successful proof. With it and the
//! verifier's `ServerKey`, pgherd can log in to a PostgreSQL server holding the same verifier
//! without ever knowing the password ("passthrough").

use std::fmt;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::SqlState;

pub const SCRAM_SHA_256: &str = "SCRAM-SHA-256";
/// PostgreSQL's default `scram_iterations`.
pub const DEFAULT_ITERATIONS: u32 = 4096;
const KEY_BYTES: usize = 32;
/// Refuse absurd iteration counts from a server so a hostile one cannot pin a CPU.
const MAX_ITERATIONS: u32 = 10_000_000;

type Key = [u8; KEY_BYTES];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScramError {
    #[error("malformed SCRAM message: {0}")]
    Malformed(&'static str),
    #[error("invalid SCRAM verifier: {0}")]
    BadVerifier(&'static str),
    #[error("SCRAM channel binding is not supported by pgherd")]
    ChannelBindingUnsupported,
    #[error("SCRAM nonce does not match")]
    NonceMismatch,
    #[error("password authentication failed")]
    ProofMismatch,
    #[error("server's SCRAM signature is invalid")]
    ServerSignatureMismatch,
    #[error("server rejected SCRAM authentication: {0}")]
    ServerError(String),
    #[error(
        "the server's SCRAM salt or iteration count differs from the verifier pgherd holds, so \
         the client's proof cannot be passed through"
    )]
    PassthroughMismatch,
}

impl ScramError {
    pub fn sqlstate(&self) -> SqlState {
        match self {
            ScramError::ProofMismatch => SqlState::INVALID_PASSWORD,
            ScramError::ServerError(_)
            | ScramError::ServerSignatureMismatch
            | ScramError::PassthroughMismatch
            | ScramError::BadVerifier(_) => SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
            _ => SqlState::PROTOCOL_VIOLATION,
        }
    }
}

fn hmac(key: &[u8], data: &[u8]) -> Key {
    // HMAC accepts keys of any length, so construction cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    mac.update(data);
    mac.finalize().into_bytes().into()
}

fn sha256(data: &[u8]) -> Key {
    Sha256::digest(data).into()
}

fn xor(a: &Key, b: &Key) -> Key {
    let mut out = [0u8; KEY_BYTES];
    for (o, (x, y)) in out.iter_mut().zip(a.iter().zip(b.iter())) {
        *o = x ^ y;
    }
    out
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// SASLprep the password as PostgreSQL does: if it cannot be normalized, use the raw bytes.
fn prepare_password(password: &str) -> Vec<u8> {
    match stringprep::saslprep(password) {
        Ok(p) => p.into_owned().into_bytes(),
        Err(_) => password.as_bytes().to_vec(),
    }
}

fn salted_password(password: &str, salt: &[u8], iterations: u32) -> Key {
    let mut out = [0u8; KEY_BYTES];
    pbkdf2::pbkdf2_hmac::<Sha256>(&prepare_password(password), salt, iterations, &mut out);
    out
}

/// Salted passwords derived for server logins, under a digest of (password, salt,
/// iterations) so the password is not kept a second time; the oldest goes first when full (a
/// hostile server sending a new salt each time only churns it).
static SALTED: std::sync::Mutex<Vec<(Key, Key)>> = std::sync::Mutex::new(Vec::new());
const MAX_SALTED: usize = 64;

/// [`salted_password`], from `SALTED` when this password and salt were seen before.
fn remembered_salted_password(password: &str, salt: &[u8], iterations: u32) -> Key {
    let mut digest = Sha256::new();
    digest.update((password.len() as u64).to_le_bytes());
    digest.update(password.as_bytes());
    digest.update(iterations.to_le_bytes());
    digest.update(salt);
    let id: Key = digest.finalize().into();
    let memo = || {
        SALTED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    if let Some((_, key)) = memo().iter().find(|(seen, _)| *seen == id) {
        return *key;
    }
    // Derived outside the lock: another login meanwhile only derives it too.
    let key = salted_password(password, salt, iterations);
    let mut memo = memo();
    if !memo.iter().any(|(seen, _)| *seen == id) {
        if memo.len() >= MAX_SALTED {
            memo.remove(0);
        }
        memo.push((id, key));
    }
    key
}

/// What a server stores instead of a password: `SCRAM-SHA-256$iter:salt$StoredKey:ServerKey`.
#[derive(Clone, PartialEq, Eq)]
pub struct ScramVerifier {
    pub iterations: u32,
    pub salt: Vec<u8>,
    pub stored_key: Key,
    pub server_key: Key,
}

impl fmt::Debug for ScramVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScramVerifier")
            .field("iterations", &self.iterations)
            .finish_non_exhaustive()
    }
}

impl ScramVerifier {
    pub fn from_password(password: &str, salt: &[u8], iterations: u32) -> Self {
        let salted = salted_password(password, salt, iterations);
        let client_key = hmac(&salted, b"Client Key");
        ScramVerifier {
            iterations,
            salt: salt.to_vec(),
            stored_key: sha256(&client_key),
            server_key: hmac(&salted, b"Server Key"),
        }
    }

    pub fn parse(text: &str) -> Result<Self, ScramError> {
        let bad = ScramError::BadVerifier;
        let rest = text
            .strip_prefix("SCRAM-SHA-256$")
            .ok_or(bad("must start with SCRAM-SHA-256$"))?;
        let (params, keys) = rest
            .split_once('$')
            .ok_or(bad("missing '$' before the keys"))?;
        let (iterations, salt) = params
            .split_once(':')
            .ok_or(bad("missing ':' between iterations and salt"))?;
        let (stored, server) = keys
            .split_once(':')
            .ok_or(bad("missing ':' between StoredKey and ServerKey"))?;
        let iterations: u32 = iterations
            .parse()
            .ok()
            .filter(|i| (1..=MAX_ITERATIONS).contains(i))
            .ok_or(bad("iteration count"))?;
        let salt = B64.decode(salt).map_err(|_| bad("salt is not base64"))?;
        let key = |s: &str, what| -> Result<Key, ScramError> {
            B64.decode(s)
                .ok()
                .and_then(|k| k.try_into().ok())
                .ok_or(bad(what))
        };
        Ok(ScramVerifier {
            iterations,
            salt,
            stored_key: key(stored, "StoredKey is not 32 bytes of base64")?,
            server_key: key(server, "ServerKey is not 32 bytes of base64")?,
        })
    }
}

impl fmt::Display for ScramVerifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SCRAM-SHA-256${}:{}${}:{}",
            self.iterations,
            B64.encode(&self.salt),
            B64.encode(self.stored_key),
            B64.encode(self.server_key)
        )
    }
}

fn printable_nonce(raw: &[u8]) -> String {
    B64.encode(raw)
}

fn is_valid_nonce(nonce: &str) -> bool {
    !nonce.is_empty()
        && nonce
            .bytes()
            .all(|b| (0x21..=0x7e).contains(&b) && b != b',')
}

/// Splits `key=value` attributes of a SCRAM message.
fn attribute<'a>(
    part: Option<&'a str>,
    key: char,
    what: &'static str,
) -> Result<&'a str, ScramError> {
    part.and_then(|p| p.strip_prefix(key))
        .and_then(|p| p.strip_prefix('='))
        .ok_or(ScramError::Malformed(what))
}

/// The server side, before the client's first message.
pub struct ScramServer {
    verifier: ScramVerifier,
    /// A mock exchange for an unknown user runs to the end and then fails, so a client cannot
    /// learn which user names exist.
    mock: bool,
    server_nonce: String,
}

/// The server side after sending server-first-message.
pub struct ScramServerAwaitingFinal {
    verifier: ScramVerifier,
    mock: bool,
    gs2_header: String,
    nonce: String,
    client_first_bare: String,
    server_first: String,
}

/// A successful exchange: the message to send and the client's recovered key.
pub struct ScramServerSuccess {
    pub server_final: Vec<u8>,
    pub client_key: Key,
}

/// Keys and salted state never appear in logs.
macro_rules! opaque_debug {
    ($($t:ty),*) => {$(
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(concat!(stringify!($t), " { .. }"))
            }
        }
    )*};
}
opaque_debug!(
    ScramServer,
    ScramServerAwaitingFinal,
    ScramServerSuccess,
    ScramClient,
    ScramClientAwaitingFinal
);

impl ScramServer {
    pub fn new(verifier: ScramVerifier, server_nonce_raw: &[u8]) -> Self {
        ScramServer {
            verifier,
            mock: false,
            server_nonce: printable_nonce(server_nonce_raw),
        }
    }

    /// A mock exchange for a user that does not exist: a stable fake salt per user name
    /// (derived from `mock_secret`) and keys nobody can match.
    pub fn mock(user: &str, mock_secret: &[u8], server_nonce_raw: &[u8]) -> Self {
        let seed = hmac(mock_secret, user.as_bytes());
        let verifier = ScramVerifier {
            iterations: DEFAULT_ITERATIONS,
            salt: seed[..16].to_vec(),
            stored_key: hmac(&seed, b"stored"),
            server_key: hmac(&seed, b"server"),
        };
        ScramServer {
            verifier,
            mock: true,
            server_nonce: printable_nonce(server_nonce_raw),
        }
    }

    pub fn client_first(
        self,
        message: &[u8],
    ) -> Result<(ScramServerAwaitingFinal, Vec<u8>), ScramError> {
        let message = std::str::from_utf8(message)
            .map_err(|_| ScramError::Malformed("client-first-message is not UTF-8"))?;
        let (gs2_header, bare) = split_gs2_header(message)?;
        let mut parts = bare.split(',');
        // PostgreSQL takes the user from the startup packet and ignores this one.
        attribute(parts.next(), 'n', "user name attribute")?;
        let client_nonce = attribute(parts.next(), 'r', "nonce attribute")?;
        if !is_valid_nonce(client_nonce) {
            return Err(ScramError::Malformed("client nonce"));
        }
        if parts.any(|p| p.starts_with("m=")) {
            return Err(ScramError::Malformed(
                "mandatory extensions are not supported",
            ));
        }
        // Built by hand rather than by `format!`: once per login, and the formatting
        // machinery cost more than the rest of this step.
        let nonce = [client_nonce, self.server_nonce.as_str()].concat();
        let mut server_first = String::with_capacity(nonce.len() + 64);
        server_first.push_str("r=");
        server_first.push_str(&nonce);
        server_first.push_str(",s=");
        B64.encode_string(&self.verifier.salt, &mut server_first);
        server_first.push_str(",i=");
        server_first.push_str(&self.verifier.iterations.to_string());
        let reply = server_first.clone().into_bytes();
        Ok((
            ScramServerAwaitingFinal {
                verifier: self.verifier,
                mock: self.mock,
                gs2_header: gs2_header.to_owned(),
                nonce,
                client_first_bare: bare.to_owned(),
                server_first,
            },
            reply,
        ))
    }
}

/// Returns the GS2 header (with its trailing comma) and the bare message after it.
fn split_gs2_header(message: &str) -> Result<(&str, &str), ScramError> {
    let header_len = match message.as_bytes().first() {
        Some(b'n') | Some(b'y') => {
            if message.as_bytes().get(1) != Some(&b',') {
                return Err(ScramError::Malformed("channel binding flag"));
            }
            // Authorization identity must be empty: PostgreSQL does not support it either.
            if message.as_bytes().get(2) != Some(&b',') {
                return Err(ScramError::Malformed(
                    "authorization identity is not supported",
                ));
            }
            3
        }
        Some(b'p') => return Err(ScramError::ChannelBindingUnsupported),
        _ => return Err(ScramError::Malformed("channel binding flag")),
    };
    Ok(message.split_at(header_len))
}

impl ScramServerAwaitingFinal {
    pub fn client_final(self, message: &[u8]) -> Result<ScramServerSuccess, ScramError> {
        let message = std::str::from_utf8(message)
            .map_err(|_| ScramError::Malformed("client-final-message is not UTF-8"))?;
        let (without_proof, proof) = message
            .rsplit_once(",p=")
            .ok_or(ScramError::Malformed("proof attribute"))?;
        let mut parts = without_proof.split(',');
        let binding = attribute(parts.next(), 'c', "channel binding attribute")?;
        let binding = B64
            .decode(binding)
            .map_err(|_| ScramError::Malformed("channel binding is not base64"))?;
        if binding != self.gs2_header.as_bytes() {
            return Err(ScramError::Malformed("channel binding does not match"));
        }
        let nonce = attribute(parts.next(), 'r', "nonce attribute")?;
        if nonce != self.nonce {
            return Err(ScramError::NonceMismatch);
        }
        let proof: Key = B64
            .decode(proof)
            .ok()
            .and_then(|p| p.try_into().ok())
            .ok_or(ScramError::Malformed("proof is not 32 bytes of base64"))?;
        let auth_message = [
            self.client_first_bare.as_str(),
            ",",
            &self.server_first,
            ",",
            without_proof,
        ]
        .concat();
        let client_signature = hmac(&self.verifier.stored_key, auth_message.as_bytes());
        let client_key = xor(&proof, &client_signature);
        if self.mock || !constant_time_eq(&sha256(&client_key), &self.verifier.stored_key) {
            return Err(ScramError::ProofMismatch);
        }
        let server_signature = hmac(&self.verifier.server_key, auth_message.as_bytes());
        Ok(ScramServerSuccess {
            server_final: {
                let mut server_final = String::from("v=");
                B64.encode_string(server_signature, &mut server_final);
                server_final.into_bytes()
            },
            client_key,
        })
    }
}

/// What the client side proves it knows.
#[derive(Clone)]
pub enum ScramCredential {
    Password(String),
    /// Keys recovered from a client's proof, valid only against a server whose verifier has
    /// this salt and iteration count.
    Keys {
        client_key: Key,
        server_key: Key,
        salt: Vec<u8>,
        iterations: u32,
    },
}

impl fmt::Debug for ScramCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScramCredential::Password(_) => f.write_str("ScramCredential::Password(..)"),
            ScramCredential::Keys { iterations, .. } => {
                write!(
                    f,
                    "ScramCredential::Keys {{ iterations: {iterations}, .. }}"
                )
            }
        }
    }
}

/// The client side, after sending client-first-message.
pub struct ScramClient {
    credential: ScramCredential,
    client_nonce: String,
    client_first_bare: String,
}

/// The client side after sending client-final-message.
pub struct ScramClientAwaitingFinal {
    expected_server_signature: Key,
}

impl ScramClient {
    /// Starts an exchange; returns the state and the client-first-message to send.
    pub fn new(credential: ScramCredential, client_nonce_raw: &[u8]) -> (Self, Vec<u8>) {
        let client_nonce = printable_nonce(client_nonce_raw);
        // Like libpq: the user name comes from the startup packet, so send none here.
        let client_first_bare = format!("n=,r={client_nonce}");
        let message = format!("n,,{client_first_bare}").into_bytes();
        (
            ScramClient {
                credential,
                client_nonce,
                client_first_bare,
            },
            message,
        )
    }

    pub fn server_first(
        self,
        message: &[u8],
    ) -> Result<(ScramClientAwaitingFinal, Vec<u8>), ScramError> {
        let server_first = std::str::from_utf8(message)
            .map_err(|_| ScramError::Malformed("server-first-message is not UTF-8"))?;
        if let Some(err) = server_first.strip_prefix("e=") {
            return Err(ScramError::ServerError(err.to_owned()));
        }
        let mut parts = server_first.split(',');
        let nonce = attribute(parts.next(), 'r', "nonce attribute")?;
        let salt = attribute(parts.next(), 's', "salt attribute")?;
        let iterations = attribute(parts.next(), 'i', "iteration attribute")?;
        if !nonce.starts_with(&self.client_nonce) || nonce.len() == self.client_nonce.len() {
            return Err(ScramError::NonceMismatch);
        }
        if !is_valid_nonce(nonce) {
            return Err(ScramError::Malformed("server nonce"));
        }
        let salt = B64
            .decode(salt)
            .map_err(|_| ScramError::Malformed("salt is not base64"))?;
        let iterations: u32 = iterations
            .parse()
            .ok()
            .filter(|i| (1..=MAX_ITERATIONS).contains(i))
            .ok_or(ScramError::Malformed("iteration count"))?;
        let (client_key, server_key) = match &self.credential {
            ScramCredential::Password(password) => {
                let salted = remembered_salted_password(password, &salt, iterations);
                (hmac(&salted, b"Client Key"), hmac(&salted, b"Server Key"))
            }
            ScramCredential::Keys {
                client_key,
                server_key,
                salt: expected_salt,
                iterations: expected_iterations,
            } => {
                if *expected_salt != salt || *expected_iterations != iterations {
                    return Err(ScramError::PassthroughMismatch);
                }
                (*client_key, *server_key)
            }
        };
        let without_proof = format!("c=biws,r={nonce}");
        let auth_message = format!("{},{server_first},{without_proof}", self.client_first_bare);
        let stored_key = sha256(&client_key);
        let proof = xor(&client_key, &hmac(&stored_key, auth_message.as_bytes()));
        let reply = format!("{without_proof},p={}", B64.encode(proof)).into_bytes();
        Ok((
            ScramClientAwaitingFinal {
                expected_server_signature: hmac(&server_key, auth_message.as_bytes()),
            },
            reply,
        ))
    }
}

impl ScramClientAwaitingFinal {
    pub fn server_final(self, message: &[u8]) -> Result<(), ScramError> {
        let text = std::str::from_utf8(message)
            .map_err(|_| ScramError::Malformed("server-final-message is not UTF-8"))?;
        if let Some(err) = text.strip_prefix("e=") {
            return Err(ScramError::ServerError(err.to_owned()));
        }
        let signature = text
            .split(',')
            .next()
            .and_then(|v| v.strip_prefix("v="))
            .ok_or(ScramError::Malformed("verifier attribute"))?;
        let signature = B64
            .decode(signature)
            .map_err(|_| ScramError::Malformed("server signature is not base64"))?;
        if constant_time_eq(&signature, &self.expected_server_signature) {
            Ok(())
        } else {
            Err(ScramError::ServerSignatureMismatch)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exchange(verifier: ScramVerifier, credential: ScramCredential) -> Result<Key, ScramError> {
        let server = ScramServer::new(verifier, b"server-nonce-bytes");
        let (client, first) = ScramClient::new(credential, b"client-nonce-bytes");
        let (server, server_first) = server.client_first(&first)?;
        let (client, client_final) = client.server_first(&server_first)?;
        let success = server.client_final(&client_final)?;
        client.server_final(&success.server_final)?;
        Ok(success.client_key)
    }

    #[test]
    fn rfc7677_test_vector() {
        // RFC 7677 section 3: user "user", password "pencil".
        let client_first = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO";
        let verifier = ScramVerifier::from_password(
            "pencil",
            &B64.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap(),
            4096,
        );
        let server = ScramServer {
            verifier,
            mock: false,
            server_nonce: "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0".to_owned(),
        };
        let (server, server_first) = server.client_first(client_first).unwrap();
        assert_eq!(
            server_first,
            b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
        );
        let success = server
            .client_final(b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
            .unwrap();
        assert_eq!(
            success.server_final,
            b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
        );
    }

    #[test]
    fn a_salted_password_is_derived_once_per_password_and_salt() {
        let derived = |password: &str, salt: &[u8]| {
            let fresh = salted_password(password, salt, 4096);
            let remembered = remembered_salted_password(password, salt, 4096);
            assert_eq!(remembered, fresh, "{password} {salt:?}");
            remembered
        };
        let first = derived("memo-pw", b"memo-salt-1");
        assert_eq!(derived("memo-pw", b"memo-salt-1"), first);
        assert_ne!(derived("memo-pw", b"memo-salt-2"), first);
        assert_ne!(derived("memo-pw2", b"memo-salt-1"), first);
        let held = |password: &str, salt: &[u8]| {
            let expected = salted_password(password, salt, 4096);
            SALTED
                .lock()
                .unwrap()
                .iter()
                .any(|(_, key)| *key == expected)
        };
        assert!(held("memo-pw", b"memo-salt-1"));
        // Bounded: the oldest give way.
        for i in 0..MAX_SALTED {
            remembered_salted_password("memo-churn", &i.to_le_bytes(), 1);
        }
        assert!(SALTED.lock().unwrap().len() <= MAX_SALTED);
        assert!(!held("memo-pw", b"memo-salt-1"));
        // A login through the exchange derives the same keys either way.
        let verifier = ScramVerifier::from_password("memo-login", b"memo-login-salt", 4096);
        for _ in 0..2 {
            exchange(
                verifier.clone(),
                ScramCredential::Password("memo-login".into()),
            )
            .unwrap();
        }
    }

    #[test]
    fn password_exchange_and_passthrough() {
        let verifier = ScramVerifier::from_password("s3cret", b"0123456789abcdef", 4096);
        let client_key =
            exchange(verifier.clone(), ScramCredential::Password("s3cret".into())).unwrap();
        // The recovered key logs in to a server holding the same verifier.
        let keys = ScramCredential::Keys {
            client_key,
            server_key: verifier.server_key,
            salt: verifier.salt.clone(),
            iterations: verifier.iterations,
        };
        assert!(exchange(verifier.clone(), keys.clone()).is_ok());
        // But not to one with another salt.
        let other = ScramVerifier::from_password("s3cret", b"another-salt....", 4096);
        assert_eq!(
            exchange(other, keys).unwrap_err(),
            ScramError::PassthroughMismatch
        );
    }

    #[test]
    fn wrong_password_is_invalid_password() {
        let verifier = ScramVerifier::from_password("right", b"salt", 4096);
        let err = exchange(verifier, ScramCredential::Password("wrong".into())).unwrap_err();
        assert_eq!(err, ScramError::ProofMismatch);
        assert_eq!(err.sqlstate(), SqlState::INVALID_PASSWORD);
    }

    #[test]
    fn mock_exchange_always_fails_late() {
        let server = ScramServer::mock("nobody", b"secret", b"nonce");
        let (client, first) = ScramClient::new(ScramCredential::Password("x".into()), b"c");
        let (server, server_first) = server.client_first(&first).unwrap();
        let (_, client_final) = client.server_first(&server_first).unwrap();
        assert_eq!(
            server.client_final(&client_final).unwrap_err(),
            ScramError::ProofMismatch
        );
    }

    #[test]
    fn verifier_text_roundtrip() {
        let v = ScramVerifier::from_password("pw", b"salty", 4096);
        assert_eq!(ScramVerifier::parse(&v.to_string()).unwrap(), v);
        assert!(ScramVerifier::parse("md5abc").is_err());
        assert!(ScramVerifier::parse("SCRAM-SHA-256$0:AAAA$AAAA:AAAA").is_err());
    }

    #[test]
    fn malformed_client_messages() {
        let server = || ScramServer::new(ScramVerifier::from_password("p", b"s", 1), b"n");
        for bad in [
            &b""[..],
            b"x,,n=,r=a",
            b"n,a=u,n=,r=a",
            b"p=tls-server-end-point,,n=,r=a",
            b"n,,n=",
            b"n,,n=,r=",
            b"n,,n=,r=a,m=ext",
        ] {
            assert!(
                server().client_first(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let (s, _) = server().client_first(b"n,,n=,r=abc").unwrap();
        assert_eq!(
            s.client_final(b"c=biws,r=abcWRONG,p=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")
                .unwrap_err(),
            ScramError::NonceMismatch
        );
    }
}
