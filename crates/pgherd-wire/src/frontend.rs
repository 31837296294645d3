//! Messages a client (frontend) sends after startup: parsers that borrow from the body and
//! encoders. Kept apart from [`crate::backend`] because tags mean different things per direction.

use bytes::{BufMut, BytesMut};

use crate::frame::{put_cstr, write_message, BodyReader};
use crate::WireError;

/// Frontend message tags.
pub mod tag {
    pub const BIND: u8 = b'B';
    pub const CLOSE: u8 = b'C';
    pub const COPY_DATA: u8 = b'd';
    pub const COPY_DONE: u8 = b'c';
    pub const COPY_FAIL: u8 = b'f';
    pub const DESCRIBE: u8 = b'D';
    pub const EXECUTE: u8 = b'E';
    pub const FLUSH: u8 = b'H';
    pub const FUNCTION_CALL: u8 = b'F';
    pub const PARSE: u8 = b'P';
    /// PasswordMessage, SASLInitialResponse and SASLResponse share this tag.
    pub const PASSWORD: u8 = b'p';
    pub const QUERY: u8 = b'Q';
    pub const SYNC: u8 = b'S';
    pub const TERMINATE: u8 = b'X';
}

/// True for tags a client may send once the session is established.
pub fn is_session_tag(t: u8) -> bool {
    matches!(
        t,
        tag::BIND
            | tag::CLOSE
            | tag::COPY_DATA
            | tag::COPY_DONE
            | tag::COPY_FAIL
            | tag::DESCRIBE
            | tag::EXECUTE
            | tag::FLUSH
            | tag::FUNCTION_CALL
            | tag::PARSE
            | tag::QUERY
            | tag::SYNC
            | tag::TERMINATE
    )
}

/// What a Describe or Close refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Statement,
    Portal,
}

impl Target {
    fn parse(reader: &mut BodyReader<'_>) -> Result<Target, WireError> {
        match reader.u8("target type")? {
            b'S' => Ok(Target::Statement),
            b'P' => Ok(Target::Portal),
            _ => Err(WireError::Malformed {
                message: "Describe/Close",
                reason: "target type (expected 'S' or 'P')",
            }),
        }
    }

    fn byte(self) -> u8 {
        match self {
            Target::Statement => b'S',
            Target::Portal => b'P',
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query<'a> {
    pub sql: &'a [u8],
}

impl<'a> Query<'a> {
    pub fn parse(body: &'a [u8]) -> Result<Self, WireError> {
        let mut r = BodyReader::new("Query", body);
        let sql = r.cstr("query string")?;
        r.finish()?;
        Ok(Query { sql })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parse<'a> {
    pub name: &'a [u8],
    pub query: &'a [u8],
    /// The parameter type section as sent: a 16-bit count followed by that many OIDs.
    pub param_types: &'a [u8],
}

impl<'a> Parse<'a> {
    // The protocol names the message Parse; every message type here has a `parse`.
    #[allow(clippy::self_named_constructors)]
    pub fn parse(body: &'a [u8]) -> Result<Self, WireError> {
        let mut r = BodyReader::new("Parse", body);
        let name = r.short_cstr("statement name")?;
        let query = r.cstr("query string")?;
        let param_types = r.rest();
        let mut types = BodyReader::new("Parse", param_types);
        // Unsigned, as the server reads it: up to 65,535 parameter types.
        let count = types.u16("parameter count")?;
        types.take(usize::from(count) * 4, "parameter types")?;
        types.finish()?;
        Ok(Parse {
            name,
            query,
            param_types,
        })
    }
}

/// Bind, parsed only as far as the names: the parameters stay opaque bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind<'a> {
    pub portal: &'a [u8],
    pub statement: &'a [u8],
    /// Format codes, parameter values and result formats, untouched.
    pub rest: &'a [u8],
}

impl<'a> Bind<'a> {
    pub fn parse(body: &'a [u8]) -> Result<Self, WireError> {
        let mut r = BodyReader::new("Bind", body);
        let portal = r.short_cstr("portal name")?;
        let statement = r.short_cstr("statement name")?;
        let rest = r.rest();
        if rest.len() < 6 {
            // At least three 16-bit counts follow the names.
            return Err(WireError::Malformed {
                message: "Bind",
                reason: "parameter section",
            });
        }
        Ok(Bind {
            portal,
            statement,
            rest,
        })
    }
}

/// The parameters and result formats of a Bind ([`Bind::rest`]), read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindValues<'a> {
    /// None: every parameter in text; one: that format for all; else one per parameter.
    pub param_formats: Vec<i16>,
    /// Each parameter's value (`None`: NULL).
    pub values: Vec<Option<&'a [u8]>>,
    /// As `param_formats`, for the result columns.
    pub result_formats: Vec<i16>,
}

impl<'a> BindValues<'a> {
    pub fn parse(rest: &'a [u8]) -> Result<Self, WireError> {
        let mut r = BodyReader::new("Bind", rest);
        let format_count = r.u16("parameter format count")?;
        let param_formats = (0..format_count)
            .map(|_| r.i16("parameter format"))
            .collect::<Result<Vec<_>, _>>()?;
        let value_count = r.u16("parameter count")?;
        let mut values = Vec::with_capacity(usize::from(value_count));
        for _ in 0..value_count {
            let len = r.i32("parameter length")?;
            values.push(match usize::try_from(len) {
                Ok(len) => Some(r.take(len, "parameter value")?),
                Err(_) if len == -1 => None,
                Err(_) => {
                    return Err(WireError::Malformed {
                        message: "Bind",
                        reason: "parameter length",
                    })
                }
            });
        }
        let result_count = r.u16("result format count")?;
        let result_formats = (0..result_count)
            .map(|_| r.i16("result format"))
            .collect::<Result<Vec<_>, _>>()?;
        r.finish()?;
        let formats_fit =
            |formats: &[i16], count: usize| formats.len() <= 1 || formats.len() == count;
        if !formats_fit(&param_formats, values.len()) {
            return Err(WireError::Malformed {
                message: "Bind",
                reason: "parameter format count (neither 0, 1 nor one per parameter)",
            });
        }
        Ok(BindValues {
            param_formats,
            values,
            result_formats,
        })
    }

    /// Parameter `index` (from 0) is in binary format.
    pub fn is_binary(&self, index: usize) -> bool {
        let format = match self.param_formats.as_slice() {
            [] => 0,
            [all] => *all,
            each => each.get(index).copied().unwrap_or(0),
        };
        format == 1
    }

    /// The Bind's body after the names, as the wire carries it.
    pub fn encode_rest(&self, buf: &mut BytesMut) {
        put_formats(buf, &self.param_formats);
        buf.put_u16(self.values.len() as u16);
        for value in &self.values {
            match value {
                Some(bytes) => {
                    buf.put_i32(bytes.len() as i32);
                    buf.put_slice(bytes);
                }
                None => buf.put_i32(-1),
            }
        }
        put_formats(buf, &self.result_formats);
    }
}

fn put_formats(buf: &mut BytesMut, formats: &[i16]) {
    buf.put_u16(formats.len() as u16);
    formats.iter().for_each(|f| buf.put_i16(*f));
}

/// The portal and statement names at the start of a Bind body that has not fully arrived
/// (its parameters can be large), and how many bytes they take; `None` until both are in.
pub fn bind_names(prefix: &[u8]) -> Option<(&[u8], &[u8], usize)> {
    let portal_end = prefix.iter().position(|&b| b == 0)?;
    let rest = &prefix[portal_end + 1..];
    let statement_end = rest.iter().position(|&b| b == 0)?;
    Some((
        &prefix[..portal_end],
        &rest[..statement_end],
        portal_end + statement_end + 2,
    ))
}

/// The start of a Bind whose statement name is `statement`, for a Bind body of
/// `rest_len` more bytes after the names, which follow separately.
pub fn encode_bind_head(
    buf: &mut BytesMut,
    portal: &[u8],
    statement: &[u8],
    rest_len: usize,
) -> Result<(), WireError> {
    let len = 4 + portal.len() + 1 + statement.len() + 1 + rest_len;
    let len = i32::try_from(len).map_err(|_| WireError::TooLong {
        tag: tag::BIND,
        declared: u32::try_from(len).unwrap_or(u32::MAX),
        max_bytes: i32::MAX as usize,
    })?;
    buf.put_u8(tag::BIND);
    buf.put_i32(len);
    put_cstr(buf, portal);
    put_cstr(buf, statement);
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Describe<'a> {
    pub target: Target,
    pub name: &'a [u8],
}

impl<'a> Describe<'a> {
    pub fn parse(body: &'a [u8]) -> Result<Self, WireError> {
        let mut r = BodyReader::new("Describe", body);
        let target = Target::parse(&mut r)?;
        let name = r.short_cstr("name")?;
        r.finish()?;
        Ok(Describe { target, name })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Close<'a> {
    pub target: Target,
    pub name: &'a [u8],
}

impl<'a> Close<'a> {
    pub fn parse(body: &'a [u8]) -> Result<Self, WireError> {
        let mut r = BodyReader::new("Close", body);
        let target = Target::parse(&mut r)?;
        let name = r.short_cstr("name")?;
        r.finish()?;
        Ok(Close { target, name })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Execute<'a> {
    pub portal: &'a [u8],
    pub max_rows: i32,
}

impl<'a> Execute<'a> {
    pub fn parse(body: &'a [u8]) -> Result<Self, WireError> {
        let mut r = BodyReader::new("Execute", body);
        let portal = r.short_cstr("portal name")?;
        let max_rows = r.i32("row limit")?;
        r.finish()?;
        Ok(Execute { portal, max_rows })
    }
}

/// A cleartext or md5 PasswordMessage.
pub fn parse_password(body: &[u8]) -> Result<&[u8], WireError> {
    let mut r = BodyReader::new("PasswordMessage", body);
    let password = r.cstr("password")?;
    r.finish()?;
    Ok(password)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaslInitialResponse<'a> {
    pub mechanism: &'a str,
    pub data: &'a [u8],
}

impl<'a> SaslInitialResponse<'a> {
    pub fn parse(body: &'a [u8]) -> Result<Self, WireError> {
        let mut r = BodyReader::new("SASLInitialResponse", body);
        let mechanism = r.cstr_utf8("mechanism")?;
        let len = r.i32("data length")?;
        let data = if len < 0 {
            &[][..]
        } else {
            r.take(len as usize, "data")?
        };
        r.finish()?;
        Ok(SaslInitialResponse { mechanism, data })
    }
}

pub fn encode_query(buf: &mut BytesMut, sql: &[u8]) -> Result<(), WireError> {
    write_message(buf, tag::QUERY, |b| put_cstr(b, sql))
}

pub fn encode_parse(
    buf: &mut BytesMut,
    name: &[u8],
    query: &[u8],
    param_types: &[u8],
) -> Result<(), WireError> {
    write_message(buf, tag::PARSE, |b| {
        put_cstr(b, name);
        put_cstr(b, query);
        b.put_slice(param_types);
    })
}

pub fn encode_bind(
    buf: &mut BytesMut,
    portal: &[u8],
    statement: &[u8],
    rest: &[u8],
) -> Result<(), WireError> {
    write_message(buf, tag::BIND, |b| {
        put_cstr(b, portal);
        put_cstr(b, statement);
        b.put_slice(rest);
    })
}

pub fn encode_describe(buf: &mut BytesMut, target: Target, name: &[u8]) -> Result<(), WireError> {
    write_message(buf, tag::DESCRIBE, |b| {
        b.put_u8(target.byte());
        put_cstr(b, name);
    })
}

pub fn encode_close(buf: &mut BytesMut, target: Target, name: &[u8]) -> Result<(), WireError> {
    write_message(buf, tag::CLOSE, |b| {
        b.put_u8(target.byte());
        put_cstr(b, name);
    })
}

pub fn encode_execute(buf: &mut BytesMut, portal: &[u8], max_rows: i32) -> Result<(), WireError> {
    write_message(buf, tag::EXECUTE, |b| {
        put_cstr(b, portal);
        b.put_i32(max_rows);
    })
}

pub fn encode_copy_fail(buf: &mut BytesMut, reason: &[u8]) -> Result<(), WireError> {
    write_message(buf, tag::COPY_FAIL, |b| put_cstr(b, reason))
}

pub fn encode_sync(buf: &mut BytesMut) {
    buf.put_slice(&[tag::SYNC, 0, 0, 0, 4]);
}

pub fn encode_flush(buf: &mut BytesMut) {
    buf.put_slice(&[tag::FLUSH, 0, 0, 0, 4]);
}

pub fn encode_terminate(buf: &mut BytesMut) {
    buf.put_slice(&[tag::TERMINATE, 0, 0, 0, 4]);
}

pub fn encode_password(buf: &mut BytesMut, password: &[u8]) -> Result<(), WireError> {
    write_message(buf, tag::PASSWORD, |b| put_cstr(b, password))
}

pub fn encode_sasl_initial_response(
    buf: &mut BytesMut,
    mechanism: &str,
    data: &[u8],
) -> Result<(), WireError> {
    write_message(buf, tag::PASSWORD, |b| {
        put_cstr(b, mechanism.as_bytes());
        b.put_i32(data.len() as i32);
        b.put_slice(data);
    })
}

pub fn encode_sasl_response(buf: &mut BytesMut, data: &[u8]) -> Result<(), WireError> {
    write_message(buf, tag::PASSWORD, |b| b.put_slice(data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::split_message;

    fn body(buf: &BytesMut) -> &[u8] {
        split_message(buf, 1 << 20).unwrap().unwrap().1
    }

    #[test]
    fn bind_values_read_and_write_back_alike() {
        let values = BindValues {
            param_formats: vec![0, 1],
            values: vec![Some(b"42"), None],
            result_formats: vec![1],
        };
        let mut rest = BytesMut::new();
        values.encode_rest(&mut rest);
        let read = BindValues::parse(&rest).unwrap();
        assert_eq!(read, values);
        assert!(!read.is_binary(0) && read.is_binary(1));
        // A format per parameter or one for all; nothing else.
        let mut bad = BytesMut::new();
        BindValues {
            param_formats: vec![0, 1, 0],
            ..values.clone()
        }
        .encode_rest(&mut bad);
        assert!(BindValues::parse(&bad).is_err());
        assert!(BindValues::parse(&rest[..rest.len() - 1]).is_err());
        let mut negative = BytesMut::new();
        negative.put_u16(0);
        negative.put_u16(1);
        negative.put_i32(-2);
        negative.put_u16(0);
        assert!(BindValues::parse(&negative).is_err());
    }

    #[test]
    fn parse_roundtrip_keeps_types() {
        let mut buf = BytesMut::new();
        encode_parse(&mut buf, b"S_1", b"select $1", &[0, 1, 0, 0, 0, 23]).unwrap();
        let p = Parse::parse(body(&buf)).unwrap();
        assert_eq!(
            (p.name, p.query, p.param_types),
            (&b"S_1"[..], &b"select $1"[..], &[0, 1, 0, 0, 0, 23][..])
        );
    }

    #[test]
    fn parse_takes_up_to_65535_parameter_types() {
        // The count is unsigned on the wire: 40,000 types is 0x9C40, negative as an i16.
        for count in [32_768u16, 40_000, u16::MAX] {
            let mut types = count.to_be_bytes().to_vec();
            types.resize(2 + usize::from(count) * 4, 0);
            let mut buf = BytesMut::new();
            encode_parse(&mut buf, b"", b"select $1", &types).unwrap();
            let p = Parse::parse(body(&buf)).unwrap();
            assert_eq!(p.param_types.len(), types.len(), "{count} types");
        }
    }

    #[test]
    fn parse_rejects_short_type_list() {
        let mut buf = BytesMut::new();
        encode_parse(&mut buf, b"", b"select $1", &[0, 2, 0, 0, 0, 23]).unwrap();
        assert!(Parse::parse(body(&buf)).is_err());
    }

    #[test]
    fn bind_rename_preserves_parameters() {
        let rest = [0u8, 0, 0, 1, 0, 0, 0, 1, b'7', 0, 0];
        let mut buf = BytesMut::new();
        encode_bind(&mut buf, b"", b"S_1", &rest).unwrap();
        let b = Bind::parse(body(&buf)).unwrap();
        let mut renamed = BytesMut::new();
        encode_bind(&mut renamed, b.portal, b"pgherd_9", b.rest).unwrap();
        let b2 = Bind::parse(body(&renamed)).unwrap();
        assert_eq!((b2.statement, b2.rest), (&b"pgherd_9"[..], &rest[..]));
    }

    #[test]
    fn a_bind_renamed_in_two_parts_equals_one_renamed_whole() {
        let rest = [0u8, 0, 0, 1, 0, 0, 0, 3, b'a', b'b', b'c', 0, 0];
        let mut whole = BytesMut::new();
        encode_bind(&mut whole, b"p", b"S_1", &rest).unwrap();
        let body = &whole[5..];
        let (portal, statement, used) = bind_names(&body[..8]).unwrap();
        assert_eq!((portal, statement, used), (&b"p"[..], &b"S_1"[..], 6));
        assert!(bind_names(&body[..3]).is_none());
        let mut renamed = BytesMut::new();
        encode_bind_head(&mut renamed, portal, b"pgherd_9", body.len() - used).unwrap();
        renamed.extend_from_slice(&body[used..]);
        let mut expected = BytesMut::new();
        encode_bind(&mut expected, b"p", b"pgherd_9", &rest).unwrap();
        assert_eq!(renamed, expected);
    }

    #[test]
    fn describe_and_close_targets() {
        let mut buf = BytesMut::new();
        encode_describe(&mut buf, Target::Portal, b"p").unwrap();
        assert_eq!(
            Describe::parse(body(&buf)).unwrap(),
            Describe {
                target: Target::Portal,
                name: b"p"
            }
        );
        buf.clear();
        encode_close(&mut buf, Target::Statement, b"s").unwrap();
        assert_eq!(
            Close::parse(body(&buf)).unwrap(),
            Close {
                target: Target::Statement,
                name: b"s"
            }
        );
        assert!(Close::parse(b"Xs\0").is_err());
    }

    #[test]
    fn sasl_initial_response() {
        let mut buf = BytesMut::new();
        encode_sasl_initial_response(&mut buf, "SCRAM-SHA-256", b"n,,n=,r=abc").unwrap();
        let m = SaslInitialResponse::parse(body(&buf)).unwrap();
        assert_eq!(
            (m.mechanism, m.data),
            ("SCRAM-SHA-256", &b"n,,n=,r=abc"[..])
        );
        // A data length longer than the message.
        assert!(SaslInitialResponse::parse(b"SCRAM-SHA-256\0\0\0\0\x10ab").is_err());
    }
}
