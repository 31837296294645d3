//! The untagged packets a connection may open with: StartupMessage, SSLRequest, GSSENCRequest and
//! CancelRequest.

use bytes::{BufMut, BytesMut};

use crate::frame::{put_cstr, write_untagged, BodyReader};
use crate::WireError;

pub const PROTOCOL_MAJOR: u16 = 3;
pub const PROTOCOL_3_0: u32 = 3 << 16;
pub const SSL_REQUEST_CODE: u32 = 80_877_103;
pub const GSSENC_REQUEST_CODE: u32 = 80_877_104;
pub const CANCEL_REQUEST_CODE: u32 = 80_877_102;

/// The key a client presents in a CancelRequest, as announced in BackendKeyData.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CancelKey {
    pub process_id: i32,
    pub secret_key: i32,
}

/// Parameters of a StartupMessage, in the order the client sent them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StartupParams {
    /// The minor protocol version the client asked for (3.x).
    pub minor_version: u16,
    pub params: Vec<(String, String)>,
}

impl StartupParams {
    pub fn get(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn user(&self) -> Option<&str> {
        self.get("user").filter(|u| !u.is_empty())
    }

    /// The database, which defaults to the user name as in PostgreSQL.
    pub fn database(&self) -> Option<&str> {
        self.get("database")
            .filter(|d| !d.is_empty())
            .or(self.user())
    }

    /// Protocol options (`_pq_.*`) the client asked for; pgherd supports none of them.
    pub fn protocol_options(&self) -> impl Iterator<Item = &str> {
        self.params
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| k.starts_with("_pq_."))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupPacket {
    Startup(StartupParams),
    SslRequest,
    GssEncRequest,
    Cancel(CancelKey),
}

/// Parses a whole startup-phase packet, length prefix included.
pub fn parse_startup_packet(packet: &[u8]) -> Result<StartupPacket, WireError> {
    let mut reader = BodyReader::new("startup packet", packet);
    reader.u32("length")?;
    let code = reader.u32("protocol version")?;
    match code {
        SSL_REQUEST_CODE => {
            reader.finish()?;
            Ok(StartupPacket::SslRequest)
        }
        GSSENC_REQUEST_CODE => {
            reader.finish()?;
            Ok(StartupPacket::GssEncRequest)
        }
        CANCEL_REQUEST_CODE => {
            let process_id = reader.i32("process id")?;
            let secret_key = reader.i32("secret key")?;
            reader.finish()?;
            Ok(StartupPacket::Cancel(CancelKey {
                process_id,
                secret_key,
            }))
        }
        _ => {
            let major = (code >> 16) as u16;
            let minor = (code & 0xffff) as u16;
            if major != PROTOCOL_MAJOR {
                return Err(WireError::UnsupportedProtocol { major, minor });
            }
            let mut params = Vec::new();
            loop {
                let name = reader.cstr_utf8("parameter name")?;
                if name.is_empty() {
                    break;
                }
                let value = reader.cstr_utf8("parameter value")?;
                params.push((name.to_owned(), value.to_owned()));
            }
            reader.finish()?;
            Ok(StartupPacket::Startup(StartupParams {
                minor_version: minor,
                params,
            }))
        }
    }
}

pub fn encode_startup<'a>(
    buf: &mut BytesMut,
    params: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<(), WireError> {
    write_untagged(buf, |b| {
        b.put_u32(PROTOCOL_3_0);
        for (name, value) in params {
            put_cstr(b, name.as_bytes());
            put_cstr(b, value.as_bytes());
        }
        b.put_u8(0);
    })
}

pub fn encode_ssl_request(buf: &mut BytesMut) {
    buf.put_u32(8);
    buf.put_u32(SSL_REQUEST_CODE);
}

pub fn encode_cancel_request(buf: &mut BytesMut, key: CancelKey) {
    buf.put_u32(16);
    buf.put_u32(CANCEL_REQUEST_CODE);
    buf.put_i32(key.process_id);
    buf.put_i32(key.secret_key);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn startup_roundtrip() {
        let mut buf = BytesMut::new();
        encode_startup(&mut buf, [("user", "alice"), ("database", "app")]).unwrap();
        let StartupPacket::Startup(p) = parse_startup_packet(&buf).unwrap() else {
            panic!("not a startup packet")
        };
        assert_eq!(p.user(), Some("alice"));
        assert_eq!(p.database(), Some("app"));
        assert_eq!(p.minor_version, 0);
    }

    #[test]
    fn database_defaults_to_user() {
        let mut buf = BytesMut::new();
        encode_startup(&mut buf, [("user", "alice")]).unwrap();
        let StartupPacket::Startup(p) = parse_startup_packet(&buf).unwrap() else {
            panic!("not a startup packet")
        };
        assert_eq!(p.database(), Some("alice"));
    }

    #[test]
    fn special_requests() {
        let mut buf = BytesMut::new();
        encode_ssl_request(&mut buf);
        assert_eq!(
            parse_startup_packet(&buf).unwrap(),
            StartupPacket::SslRequest
        );
        buf.clear();
        let key = CancelKey {
            process_id: 7,
            secret_key: -3,
        };
        encode_cancel_request(&mut buf, key);
        assert_eq!(
            parse_startup_packet(&buf).unwrap(),
            StartupPacket::Cancel(key)
        );
    }

    #[test]
    fn malformed_packets_are_rejected() {
        // Missing the final terminator.
        assert!(parse_startup_packet(b"\0\0\0\x0f\0\x03\0\0user\0bob\0").is_err());
        // Wrong major version.
        assert_eq!(
            parse_startup_packet(b"\0\0\0\x09\0\x02\0\0\0"),
            Err(WireError::UnsupportedProtocol { major: 2, minor: 0 })
        );
        // Cancel request with trailing garbage.
        assert!(
            parse_startup_packet(b"\0\0\0\x11\x04\xd2\x16\x2e\0\0\0\x01\0\0\0\x02\x09").is_err()
        );
        // Invalid UTF-8 in a parameter.
        assert!(parse_startup_packet(b"\0\0\0\x11\0\x03\0\0user\0\xff\0\0").is_err());
    }
}
