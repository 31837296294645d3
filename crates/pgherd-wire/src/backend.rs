//! Messages a server (backend) sends: parsers that borrow from the body, and the encoders pgherd
//! uses when it answers a client itself.

use bytes::{BufMut, BytesMut};

use crate::frame::{put_cstr, write_message, BodyReader};
use crate::startup::CancelKey;
use crate::WireError;

/// Backend message tags.
pub mod tag {
    pub const AUTHENTICATION: u8 = b'R';
    pub const BACKEND_KEY_DATA: u8 = b'K';
    pub const BIND_COMPLETE: u8 = b'2';
    pub const CLOSE_COMPLETE: u8 = b'3';
    pub const COMMAND_COMPLETE: u8 = b'C';
    pub const COPY_BOTH_RESPONSE: u8 = b'W';
    pub const COPY_DATA: u8 = b'd';
    pub const COPY_DONE: u8 = b'c';
    pub const COPY_IN_RESPONSE: u8 = b'G';
    pub const COPY_OUT_RESPONSE: u8 = b'H';
    pub const DATA_ROW: u8 = b'D';
    pub const EMPTY_QUERY_RESPONSE: u8 = b'I';
    pub const ERROR_RESPONSE: u8 = b'E';
    pub const FUNCTION_CALL_RESPONSE: u8 = b'V';
    pub const NEGOTIATE_PROTOCOL_VERSION: u8 = b'v';
    pub const NO_DATA: u8 = b'n';
    pub const NOTICE_RESPONSE: u8 = b'N';
    pub const NOTIFICATION_RESPONSE: u8 = b'A';
    pub const PARAMETER_DESCRIPTION: u8 = b't';
    pub const PARAMETER_STATUS: u8 = b'S';
    pub const PARSE_COMPLETE: u8 = b'1';
    pub const PORTAL_SUSPENDED: u8 = b's';
    pub const READY_FOR_QUERY: u8 = b'Z';
    pub const ROW_DESCRIPTION: u8 = b'T';
}

/// The transaction status carried by ReadyForQuery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxStatus {
    Idle,
    InTransaction,
    Failed,
}

impl TxStatus {
    pub fn from_byte(b: u8) -> Option<TxStatus> {
        match b {
            b'I' => Some(TxStatus::Idle),
            b'T' => Some(TxStatus::InTransaction),
            b'E' => Some(TxStatus::Failed),
            _ => None,
        }
    }

    pub fn byte(self) -> u8 {
        match self {
            TxStatus::Idle => b'I',
            TxStatus::InTransaction => b'T',
            TxStatus::Failed => b'E',
        }
    }
}

pub fn parse_ready_for_query(body: &[u8]) -> Result<TxStatus, WireError> {
    let mut r = BodyReader::new("ReadyForQuery", body);
    let status = r.u8("transaction status")?;
    r.finish()?;
    TxStatus::from_byte(status).ok_or(WireError::Malformed {
        message: "ReadyForQuery",
        reason: "transaction status",
    })
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authentication<'a> {
    Ok,
    CleartextPassword,
    Md5Password {
        salt: [u8; 4],
    },
    Sasl {
        mechanisms: Vec<&'a str>,
    },
    SaslContinue {
        data: &'a [u8],
    },
    SaslFinal {
        data: &'a [u8],
    },
    /// Kerberos, GSS, SSPI and anything newer: pgherd cannot answer these.
    Unsupported {
        code: i32,
    },
}

impl<'a> Authentication<'a> {
    pub fn parse(body: &'a [u8]) -> Result<Self, WireError> {
        let mut r = BodyReader::new("Authentication", body);
        let auth = match r.i32("request code")? {
            0 => Authentication::Ok,
            3 => Authentication::CleartextPassword,
            5 => {
                let salt = r.take(4, "md5 salt")?;
                Authentication::Md5Password {
                    salt: [salt[0], salt[1], salt[2], salt[3]],
                }
            }
            10 => {
                let mut mechanisms = Vec::new();
                loop {
                    let m = r.cstr_utf8("SASL mechanism")?;
                    if m.is_empty() {
                        break;
                    }
                    mechanisms.push(m);
                }
                Authentication::Sasl { mechanisms }
            }
            11 => Authentication::SaslContinue { data: r.rest() },
            12 => Authentication::SaslFinal { data: r.rest() },
            code => {
                r.rest();
                Authentication::Unsupported { code }
            }
        };
        r.finish()?;
        Ok(auth)
    }
}

pub fn parse_backend_key_data(body: &[u8]) -> Result<CancelKey, WireError> {
    let mut r = BodyReader::new("BackendKeyData", body);
    let process_id = r.i32("process id")?;
    let secret_key = r.i32("secret key")?;
    r.finish()?;
    Ok(CancelKey {
        process_id,
        secret_key,
    })
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParameterStatus<'a> {
    pub name: &'a str,
    pub value: &'a str,
}

impl<'a> ParameterStatus<'a> {
    pub fn parse(body: &'a [u8]) -> Result<Self, WireError> {
        let mut r = BodyReader::new("ParameterStatus", body);
        let name = r.cstr_utf8("parameter name")?;
        let value = r.cstr_utf8("parameter value")?;
        r.finish()?;
        Ok(ParameterStatus { name, value })
    }
}

/// The command tag of a CommandComplete, e.g. `SELECT 1` or `SET`.
pub fn parse_command_complete(body: &[u8]) -> Result<&[u8], WireError> {
    let mut r = BodyReader::new("CommandComplete", body);
    let tag = r.short_cstr("command tag")?;
    r.finish()?;
    Ok(tag)
}

/// Column names of a RowDescription (the rest of each field descriptor is skipped).
pub fn parse_row_description(body: &[u8]) -> Result<Vec<&str>, WireError> {
    let mut r = BodyReader::new("RowDescription", body);
    let count = r.u16("field count")?;
    let mut names = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        names.push(r.cstr_utf8("field name")?);
        r.take(18, "field descriptor")?;
    }
    r.finish()?;
    Ok(names)
}

/// One column of a RowDescription, whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldDescription {
    pub name: Vec<u8>,
    /// The table the column comes from (0: none), and its attribute number there.
    pub table_oid: u32,
    pub column: i16,
    pub type_oid: u32,
    pub type_len: i16,
    pub type_modifier: i32,
    /// 0 text, 1 binary.
    pub format: i16,
}

/// Every field of a RowDescription.
pub fn parse_row_fields(body: &[u8]) -> Result<Vec<FieldDescription>, WireError> {
    let mut r = BodyReader::new("RowDescription", body);
    let count = r.u16("field count")?;
    let mut fields = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        fields.push(FieldDescription {
            name: r.cstr("field name")?.to_vec(),
            table_oid: r.u32("table OID")?,
            column: r.i16("column number")?,
            type_oid: r.u32("type OID")?,
            type_len: r.i16("type length")?,
            type_modifier: r.i32("type modifier")?,
            format: r.i16("format code")?,
        });
    }
    r.finish()?;
    Ok(fields)
}

pub fn encode_row_description(
    buf: &mut BytesMut,
    fields: &[FieldDescription],
) -> Result<(), WireError> {
    write_message(buf, tag::ROW_DESCRIPTION, |b| {
        b.put_i16(fields.len() as i16);
        for field in fields {
            put_cstr(b, &field.name);
            b.put_u32(field.table_oid);
            b.put_i16(field.column);
            b.put_u32(field.type_oid);
            b.put_i16(field.type_len);
            b.put_i32(field.type_modifier);
            b.put_i16(field.format);
        }
    })
}

/// Column values of a DataRow; `None` is SQL NULL.
pub fn parse_data_row(body: &[u8]) -> Result<Vec<Option<&[u8]>>, WireError> {
    let mut r = BodyReader::new("DataRow", body);
    let count = r.u16("column count")?;
    let mut values = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let len = r.i32("value length")?;
        values.push(if len < 0 {
            None
        } else {
            Some(r.take(len as usize, "value")?)
        });
    }
    r.finish()?;
    Ok(values)
}

fn auth_request(buf: &mut BytesMut, code: i32, extra: &[u8]) -> Result<(), WireError> {
    write_message(buf, tag::AUTHENTICATION, |b| {
        b.put_i32(code);
        b.put_slice(extra);
    })
}

pub fn encode_auth_ok(buf: &mut BytesMut) -> Result<(), WireError> {
    auth_request(buf, 0, &[])
}

pub fn encode_auth_cleartext(buf: &mut BytesMut) -> Result<(), WireError> {
    auth_request(buf, 3, &[])
}

pub fn encode_auth_md5(buf: &mut BytesMut, salt: [u8; 4]) -> Result<(), WireError> {
    auth_request(buf, 5, &salt)
}

pub fn encode_auth_sasl(buf: &mut BytesMut, mechanisms: &[&str]) -> Result<(), WireError> {
    write_message(buf, tag::AUTHENTICATION, |b| {
        b.put_i32(10);
        for m in mechanisms {
            put_cstr(b, m.as_bytes());
        }
        b.put_u8(0);
    })
}

pub fn encode_auth_sasl_continue(buf: &mut BytesMut, data: &[u8]) -> Result<(), WireError> {
    auth_request(buf, 11, data)
}

pub fn encode_auth_sasl_final(buf: &mut BytesMut, data: &[u8]) -> Result<(), WireError> {
    auth_request(buf, 12, data)
}

pub fn encode_backend_key_data(buf: &mut BytesMut, key: CancelKey) -> Result<(), WireError> {
    write_message(buf, tag::BACKEND_KEY_DATA, |b| {
        b.put_i32(key.process_id);
        b.put_i32(key.secret_key);
    })
}

pub fn encode_parameter_status(
    buf: &mut BytesMut,
    name: &str,
    value: &str,
) -> Result<(), WireError> {
    write_message(buf, tag::PARAMETER_STATUS, |b| {
        put_cstr(b, name.as_bytes());
        put_cstr(b, value.as_bytes());
    })
}

pub fn encode_ready_for_query(buf: &mut BytesMut, status: TxStatus) {
    buf.put_slice(&[tag::READY_FOR_QUERY, 0, 0, 0, 5, status.byte()]);
}

/// ParseComplete, BindComplete, CloseComplete, NoData and EmptyQueryResponse carry no body.
pub fn encode_empty(buf: &mut BytesMut, tag: u8) {
    buf.put_slice(&[tag, 0, 0, 0, 4]);
}

pub fn encode_command_complete(buf: &mut BytesMut, command_tag: &str) -> Result<(), WireError> {
    write_message(buf, tag::COMMAND_COMPLETE, |b| {
        put_cstr(b, command_tag.as_bytes())
    })
}

/// A RowDescription of text columns (type `text`, OID 25), as the admin console answers.
pub fn encode_text_row_description(buf: &mut BytesMut, columns: &[&str]) -> Result<(), WireError> {
    const TEXT_OID: u32 = 25;
    write_message(buf, tag::ROW_DESCRIPTION, |b| {
        b.put_i16(columns.len() as i16);
        for name in columns {
            put_cstr(b, name.as_bytes());
            b.put_u32(0); // table OID
            b.put_i16(0); // column number
            b.put_u32(TEXT_OID);
            b.put_i16(-1); // variable length
            b.put_i32(-1); // no type modifier
            b.put_i16(0); // text format
        }
    })
}

pub fn encode_data_row<'a>(
    buf: &mut BytesMut,
    values: impl ExactSizeIterator<Item = Option<&'a [u8]>>,
) -> Result<(), WireError> {
    write_message(buf, tag::DATA_ROW, |b| {
        b.put_i16(values.len() as i16);
        for value in values {
            match value {
                Some(v) => {
                    b.put_i32(v.len() as i32);
                    b.put_slice(v);
                }
                None => b.put_i32(-1),
            }
        }
    })
}

/// Tells a client that asked for protocol 3.`requested_minor` or for `_pq_` options that the
/// session runs 3.0 without them.
pub fn encode_negotiate_protocol_version(
    buf: &mut BytesMut,
    newest_minor: i32,
    unsupported_options: &[&str],
) -> Result<(), WireError> {
    write_message(buf, tag::NEGOTIATE_PROTOCOL_VERSION, |b| {
        b.put_i32(newest_minor);
        b.put_i32(unsupported_options.len() as i32);
        for option in unsupported_options {
            put_cstr(b, option.as_bytes());
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::split_message;

    fn body(buf: &BytesMut) -> &[u8] {
        split_message(buf, 1 << 20).unwrap().unwrap().1
    }

    #[test]
    fn authentication_requests_roundtrip() {
        let mut buf = BytesMut::new();
        encode_auth_md5(&mut buf, [1, 2, 3, 4]).unwrap();
        assert_eq!(
            Authentication::parse(body(&buf)).unwrap(),
            Authentication::Md5Password { salt: [1, 2, 3, 4] }
        );
        buf.clear();
        encode_auth_sasl(&mut buf, &["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"]).unwrap();
        assert_eq!(
            Authentication::parse(body(&buf)).unwrap(),
            Authentication::Sasl {
                mechanisms: vec!["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"]
            }
        );
        assert!(Authentication::parse(&[0, 0, 0, 5, 1]).is_err());
    }

    #[test]
    fn ready_for_query_status() {
        let mut buf = BytesMut::new();
        encode_ready_for_query(&mut buf, TxStatus::Failed);
        assert_eq!(parse_ready_for_query(body(&buf)).unwrap(), TxStatus::Failed);
        assert!(parse_ready_for_query(b"Q").is_err());
    }

    #[test]
    fn rows_roundtrip() {
        let mut buf = BytesMut::new();
        encode_text_row_description(&mut buf, &["name", "role"]).unwrap();
        assert_eq!(
            parse_row_description(body(&buf)).unwrap(),
            vec!["name", "role"]
        );
        buf.clear();
        encode_data_row(&mut buf, [Some(&b"pg1"[..]), None].into_iter()).unwrap();
        assert_eq!(
            parse_data_row(body(&buf)).unwrap(),
            vec![Some(&b"pg1"[..]), None]
        );
        assert!(parse_data_row(&[0, 1, 0, 0, 0, 9, b'x']).is_err());
    }

    #[test]
    fn row_fields_roundtrip_whole() {
        let fields = vec![
            FieldDescription {
                name: b"aid".to_vec(),
                table_oid: 16_384,
                column: 1,
                type_oid: 23,
                type_len: 4,
                type_modifier: -1,
                format: 1,
            },
            FieldDescription {
                name: "é".as_bytes().to_vec(),
                table_oid: 0,
                column: 0,
                type_oid: 1700,
                type_len: -1,
                type_modifier: 655_366,
                format: 0,
            },
        ];
        let mut buf = BytesMut::new();
        encode_row_description(&mut buf, &fields).unwrap();
        assert_eq!(parse_row_fields(body(&buf)).unwrap(), fields);
        assert_eq!(parse_row_description(body(&buf)).unwrap(), vec!["aid", "é"]);
        assert!(parse_row_fields(&body(&buf)[..20]).is_err());
    }
}
