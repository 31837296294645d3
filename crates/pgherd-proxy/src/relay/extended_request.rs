//! The extended-protocol requests the result cache answers: one statement run to its end on
//! the unnamed portal, `[Parse] Bind [Describe] Execute Sync` (the portal's description, or
//! the bound statement's), whole in the client's
//! input (drivers send it in one write). The Parse, if any, is of the unnamed statement; a
//! named one is prepared once and then only bound, which is the request kept. Pure: bytes in,
//! a description out.

use pgherd_wire::frame::HEADER_BYTES;
use pgherd_wire::frontend::{self, tag as ftag, Target};

/// One such request, borrowed from the client's input.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct ExtendedRequest<'a> {
    /// The unnamed statement the request parses: its text and parameter-type section.
    pub parse: Option<(&'a [u8], &'a [u8])>,
    /// The statement the Bind names (`""`: the unnamed one).
    pub statement: &'a [u8],
    /// The Bind's parameter formats, values and result formats.
    pub bind_rest: &'a [u8],
    /// What the Describe asks for: the portal's row description, or the bound statement's
    /// parameter and row descriptions.
    pub describe: Option<Target>,
    /// Bytes of the request, its Sync included.
    pub len: usize,
}

/// The request at the front of `input`, if it has that shape and is whole.
pub(super) fn extended_request(input: &[u8]) -> Option<ExtendedRequest<'_>> {
    let mut at = 0;
    let mut next = || -> Option<(u8, &[u8])> {
        let header = input.get(at..at + HEADER_BYTES)?;
        let len = i32::from_be_bytes([header[1], header[2], header[3], header[4]]);
        let len = usize::try_from(len).ok().filter(|&n| n >= 4)?;
        let body = input.get(at + HEADER_BYTES..at + 1 + len)?;
        at += 1 + len;
        Some((header[0], body))
    };
    let (mut tag, mut body) = next()?;
    let mut parse = None;
    if tag == ftag::PARSE {
        let p = frontend::Parse::parse(body).ok()?;
        if !p.name.is_empty() {
            return None;
        }
        parse = Some((p.query, p.param_types));
        (tag, body) = next()?;
    }
    if tag != ftag::BIND {
        return None;
    }
    let bind = frontend::Bind::parse(body).ok()?;
    if !bind.portal.is_empty() || (parse.is_some() && !bind.statement.is_empty()) {
        return None;
    }
    (tag, body) = next()?;
    let mut describe = None;
    if tag == ftag::DESCRIBE {
        let d = frontend::Describe::parse(body).ok()?;
        let described = match d.target {
            Target::Portal => d.name.is_empty(),
            Target::Statement => d.name == bind.statement,
        };
        if !described {
            return None;
        }
        describe = Some(d.target);
        (tag, body) = next()?;
    }
    let execute = (tag == ftag::EXECUTE)
        .then(|| frontend::Execute::parse(body).ok())
        .flatten()?;
    if !execute.portal.is_empty() || execute.max_rows != 0 {
        return None;
    }
    let (tag, _) = next()?;
    if tag != ftag::SYNC {
        return None;
    }
    Some(ExtendedRequest {
        parse,
        statement: bind.statement,
        bind_rest: bind.rest,
        describe,
        len: at,
    })
}

impl ExtendedRequest<'_> {
    /// The cache key of this request of statement `text` with `param_types`, after `prefix`
    /// (who asks, with which settings, as for a simple query). A simple query's key ends with
    /// its text, which holds no NUL byte, so a NUL here keeps the two apart.
    pub fn key(&self, prefix: &[u8], text: &[u8], param_types: &[u8]) -> Vec<u8> {
        let mut key = Vec::with_capacity(
            prefix.len() + text.len() + param_types.len() + self.bind_rest.len() + 16,
        );
        key.extend_from_slice(prefix);
        let describe = match self.describe {
            None => b'-',
            Some(Target::Portal) => b'P',
            Some(Target::Statement) => b'S',
        };
        key.extend_from_slice(&[0, b'E', u8::from(self.parse.is_some()), describe]);
        for part in [text, param_types] {
            key.extend_from_slice(&(part.len() as u64).to_be_bytes());
            key.extend_from_slice(part);
        }
        key.extend_from_slice(self.bind_rest);
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;

    fn bind_rest(value: &str) -> Vec<u8> {
        let mut rest = Vec::new();
        rest.extend_from_slice(&0i16.to_be_bytes());
        rest.extend_from_slice(&1i16.to_be_bytes());
        rest.extend_from_slice(&(value.len() as i32).to_be_bytes());
        rest.extend_from_slice(value.as_bytes());
        rest.extend_from_slice(&0i16.to_be_bytes());
        rest
    }

    fn request(
        parse: Option<&str>,
        statement: &str,
        describe: Option<Target>,
        value: &str,
    ) -> BytesMut {
        let mut out = BytesMut::new();
        if let Some(sql) = parse {
            frontend::encode_parse(&mut out, b"", sql.as_bytes(), &[0, 0]).unwrap();
        }
        frontend::encode_bind(&mut out, b"", statement.as_bytes(), &bind_rest(value)).unwrap();
        match describe {
            Some(Target::Portal) => frontend::encode_describe(&mut out, Target::Portal, b""),
            Some(Target::Statement) => {
                frontend::encode_describe(&mut out, Target::Statement, statement.as_bytes())
            }
            None => Ok(()),
        }
        .unwrap();
        frontend::encode_execute(&mut out, b"", 0).unwrap();
        frontend::encode_sync(&mut out);
        out
    }

    #[test]
    fn drivers_requests_are_recognised_whole() {
        let portal = Some(Target::Portal);
        let bytes = request(Some("SELECT $1"), "", portal, "7");
        let r = extended_request(&bytes).unwrap();
        assert_eq!(r.parse, Some((&b"SELECT $1"[..], &[0u8, 0][..])));
        assert_eq!(
            (r.statement, r.describe, r.len),
            (&b""[..], portal, bytes.len())
        );
        assert_eq!(r.bind_rest, &bind_rest("7")[..]);

        let mut bytes = request(None, "s1", None, "7");
        let len = bytes.len();
        frontend::encode_sync(&mut bytes);
        let r = extended_request(&bytes).unwrap();
        assert_eq!(
            (r.parse, r.statement, r.describe, r.len),
            (None, &b"s1"[..], None, len)
        );

        let statement = Some(Target::Statement);
        let bytes = request(Some("SELECT $1"), "", statement, "7");
        assert_eq!(extended_request(&bytes).unwrap().describe, statement);
    }

    #[test]
    fn other_shapes_and_partial_requests_are_not() {
        let whole = request(Some("SELECT $1"), "", Some(Target::Portal), "7");
        for cut in 0..whole.len() {
            assert_eq!(extended_request(&whole[..cut]), None, "cut at {cut}");
        }
        // A named Parse, a named portal, a row limit, a statement description, no Sync.
        let mut named = BytesMut::new();
        frontend::encode_parse(&mut named, b"s", b"SELECT 1", &[0, 0]).unwrap();
        named.extend_from_slice(&request(None, "s", Some(Target::Portal), "7"));
        assert_eq!(extended_request(&named), None);
        let mut portal = BytesMut::new();
        frontend::encode_bind(&mut portal, b"p", b"s", &bind_rest("7")).unwrap();
        frontend::encode_execute(&mut portal, b"p", 0).unwrap();
        frontend::encode_sync(&mut portal);
        assert_eq!(extended_request(&portal), None);
        let mut limited = BytesMut::new();
        frontend::encode_bind(&mut limited, b"", b"s", &bind_rest("7")).unwrap();
        frontend::encode_execute(&mut limited, b"", 10).unwrap();
        frontend::encode_sync(&mut limited);
        assert_eq!(extended_request(&limited), None);
        let mut statement = BytesMut::new();
        frontend::encode_bind(&mut statement, b"", b"s", &bind_rest("7")).unwrap();
        frontend::encode_describe(&mut statement, Target::Statement, b"other").unwrap();
        frontend::encode_execute(&mut statement, b"", 0).unwrap();
        frontend::encode_sync(&mut statement);
        assert_eq!(extended_request(&statement), None);
        let mut no_sync = BytesMut::new();
        frontend::encode_bind(&mut no_sync, b"", b"s", &bind_rest("7")).unwrap();
        frontend::encode_execute(&mut no_sync, b"", 0).unwrap();
        frontend::encode_flush(&mut no_sync);
        assert_eq!(extended_request(&no_sync), None);
    }

    #[test]
    fn keys_tell_values_formats_and_shapes_apart() {
        let (portal, none) = (Some(Target::Portal), None);
        let key = |parse, describe, value: &str| {
            let bytes = request(parse, "", describe, value);
            let r = extended_request(&bytes).unwrap();
            r.key(b"user\0settings", b"SELECT $1", &[0, 0])
        };
        let base = key(Some("SELECT $1"), portal, "7");
        assert_ne!(base, key(Some("SELECT $1"), portal, "8"));
        assert_ne!(base, key(Some("SELECT $1"), none, "7"));
        assert_ne!(base, key(Some("SELECT $1"), Some(Target::Statement), "7"));
        assert_ne!(base, key(None, portal, "7"));
        assert_eq!(base, key(Some("SELECT $1"), portal, "7"));
        // Never a simple query's key (user, settings, text).
        assert!(!base.starts_with(b"user\0settings\0SELECT"));
    }
}
