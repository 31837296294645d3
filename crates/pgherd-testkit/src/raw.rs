//! A minimal blocking protocol client that can send anything, valid or not, and read raw
//! answers: for tests of malformed input, pipelining and cancel requests.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use bytes::BytesMut;
use pgherd_wire::backend::{self, tag, Authentication};
use pgherd_wire::frame::split_message;
use pgherd_wire::frontend;
use pgherd_wire::md5::{md5_password_hash, md5_salted_response};
use pgherd_wire::scram::{ScramClient, ScramCredential, SCRAM_SHA_256};
use pgherd_wire::startup::{encode_cancel_request, encode_startup, CancelKey};
use pgherd_wire::PgError;

/// One message received: its tag and body.
pub type Message = (u8, Vec<u8>);

pub struct RawClient {
    pub stream: TcpStream,
    buf: Vec<u8>,
    pub key: Option<CancelKey>,
    /// ParameterStatus values received at login.
    pub parameters: Vec<(String, String)>,
}

impl RawClient {
    pub fn connect(port: u16) -> RawClient {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to pgherd");
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        stream.set_nodelay(true).expect("nodelay");
        RawClient {
            stream,
            buf: Vec::new(),
            key: None,
            parameters: Vec::new(),
        }
    }

    /// Connects and logs in; the error is the server's ErrorResponse.
    pub fn login(
        port: u16,
        user: &str,
        database: &str,
        password: &str,
    ) -> Result<RawClient, PgError> {
        RawClient::login_with(port, &[("user", user), ("database", database)], password)
    }

    /// Connects and logs in with these startup parameters (`user` among them).
    pub fn login_with(
        port: u16,
        params: &[(&str, &str)],
        password: &str,
    ) -> Result<RawClient, PgError> {
        let user = params
            .iter()
            .find(|(k, _)| *k == "user")
            .map(|(_, v)| *v)
            .expect("a user parameter");
        let mut c = RawClient::connect(port);
        let mut out = BytesMut::new();
        encode_startup(&mut out, params.iter().copied()).expect("encode");
        c.send(&out);
        let mut scram: Option<ScramClient> = None;
        let mut scram_final = None;
        loop {
            let (t, body) = c.recv().expect("connection closed during login");
            out.clear();
            match t {
                tag::AUTHENTICATION => match Authentication::parse(&body).expect("auth message") {
                    Authentication::Ok => {}
                    Authentication::CleartextPassword => {
                        frontend::encode_password(&mut out, password.as_bytes()).expect("encode")
                    }
                    Authentication::Md5Password { salt } => {
                        let response =
                            md5_salted_response(&md5_password_hash(user, password), salt);
                        frontend::encode_password(&mut out, response.as_bytes()).expect("encode")
                    }
                    Authentication::Sasl { .. } => {
                        let (client, first) = ScramClient::new(
                            ScramCredential::Password(password.into()),
                            b"raw-client-nonce",
                        );
                        scram = Some(client);
                        frontend::encode_sasl_initial_response(&mut out, SCRAM_SHA_256, &first)
                            .expect("encode");
                    }
                    Authentication::SaslContinue { data } => {
                        let (next, reply) = scram
                            .take()
                            .expect("SCRAM started")
                            .server_first(data)
                            .expect("server-first");
                        scram_final = Some(next);
                        frontend::encode_sasl_response(&mut out, &reply).expect("encode");
                    }
                    Authentication::SaslFinal { data } => {
                        scram_final
                            .take()
                            .expect("SCRAM continued")
                            .server_final(data)
                            .expect("server signature");
                    }
                    other => panic!("unsupported authentication request {other:?}"),
                },
                tag::ERROR_RESPONSE => return Err(PgError::parse(&body).expect("error")),
                tag::BACKEND_KEY_DATA => {
                    c.key = Some(backend::parse_backend_key_data(&body).expect("key"))
                }
                tag::PARAMETER_STATUS => {
                    let p = backend::ParameterStatus::parse(&body).expect("parameter status");
                    c.parameters.push((p.name.to_owned(), p.value.to_owned()));
                }
                tag::READY_FOR_QUERY => return Ok(c),
                _ => {}
            }
            if !out.is_empty() {
                c.send(&out);
            }
        }
    }

    /// The value a ParameterStatus gave `name` at login.
    pub fn parameter(&self, name: &str) -> Option<String> {
        self.parameters
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send to pgherd");
    }

    /// Sends and ignores failures (the peer may have closed already).
    pub fn send_lossy(&mut self, bytes: &[u8]) {
        let _ = self.stream.write_all(bytes);
    }

    /// The next message, or `None` once the connection is closed.
    pub fn recv(&mut self) -> Option<Message> {
        loop {
            if let Some((header, body)) =
                split_message(&self.buf, usize::MAX).expect("valid framing from pgherd")
            {
                let message = (header.tag, body.to_vec());
                self.buf.drain(..header.total_len());
                return Some(message);
            }
            let mut chunk = [0u8; 16384];
            match self.stream.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Messages up to and including the next ReadyForQuery.
    pub fn recv_until_ready(&mut self) -> Vec<Message> {
        let mut out = Vec::new();
        while let Some(m) = self.recv() {
            let done = m.0 == tag::READY_FOR_QUERY;
            out.push(m);
            if done {
                break;
            }
        }
        out
    }

    pub fn query(&mut self, sql: &str) -> Vec<Message> {
        let mut out = BytesMut::new();
        frontend::encode_query(&mut out, sql.as_bytes()).expect("encode");
        self.send(&out);
        self.recv_until_ready()
    }

    /// Reads up to and including the next ReadyForQuery without keeping what it reads (the
    /// messages may be very large): each message's tag and length.
    pub fn skip_until_ready(&mut self) -> Vec<(u8, usize)> {
        let mut seen = Vec::new();
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            while self.buf.len() < 5 {
                match self.stream.read(&mut chunk) {
                    Ok(0) | Err(_) => return seen,
                    Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                }
            }
            let t = self.buf[0];
            let len =
                u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
            let mut left = len + 1;
            let take = left.min(self.buf.len());
            self.buf.drain(..take);
            left -= take;
            while left > 0 {
                let want = left.min(chunk.len());
                match self.stream.read(&mut chunk[..want]) {
                    Ok(0) | Err(_) => return seen,
                    Ok(n) => left -= n,
                }
            }
            seen.push((t, len + 1));
            if t == tag::READY_FOR_QUERY {
                return seen;
            }
        }
    }

    /// True once the peer has closed the connection (reads return EOF).
    pub fn is_closed(&mut self) -> bool {
        self.recv().is_none()
    }
}

/// The first text column of every DataRow.
pub fn first_column(messages: &[Message]) -> Vec<String> {
    messages
        .iter()
        .filter(|(t, _)| *t == tag::DATA_ROW)
        .filter_map(|(_, body)| {
            let values = backend::parse_data_row(body).ok()?;
            values
                .first()
                .copied()
                .flatten()
                .map(|v| String::from_utf8_lossy(v).into_owned())
        })
        .collect()
}

/// The ErrorResponses among `messages`.
pub fn errors(messages: &[Message]) -> Vec<PgError> {
    messages
        .iter()
        .filter(|(t, _)| *t == tag::ERROR_RESPONSE)
        .filter_map(|(_, body)| PgError::parse(body).ok())
        .collect()
}

/// Sends a CancelRequest and closes the socket at once.
pub fn send_cancel_and_close(port: u16, key: CancelKey) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect for cancel");
    let mut out = BytesMut::new();
    encode_cancel_request(&mut out, key);
    stream.write_all(&out).expect("send cancel");
    drop(stream);
}
