//! Errors: [`WireError`] for what the codec rejects, and [`PgError`], the ErrorResponse /
//! NoticeResponse a peer sees, with its SQLSTATE.

use std::fmt;

use bytes::{BufMut, BytesMut};

use crate::frame::{put_cstr, write_message, BodyReader};
use crate::SqlState;

/// Something the codec refused. Every variant is a protocol violation (SQLSTATE 08P01) from the
/// peer's point of view; the text names the message and field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("invalid message length {declared} in message of type {}", tag_name(*tag))]
    BadLength { tag: u8, declared: u32 },
    #[error(
        "message of type {} is {declared} bytes long, over the limit of {max_bytes} bytes",
        tag_name(*tag)
    )]
    TooLong {
        tag: u8,
        declared: u32,
        max_bytes: usize,
    },
    #[error("invalid startup packet length {declared}")]
    BadStartupLength { declared: u32 },
    #[error("invalid {message} message: bad or missing {reason}")]
    Malformed {
        message: &'static str,
        reason: &'static str,
    },
    #[error("unexpected message type {} {context}", tag_name(*tag))]
    UnexpectedTag { tag: u8, context: &'static str },
    #[error("unsupported frontend protocol {major}.{minor}: server supports 3.0")]
    UnsupportedProtocol { major: u16, minor: u16 },
}

impl WireError {
    pub fn sqlstate(&self) -> SqlState {
        match self {
            WireError::UnsupportedProtocol { .. } => SqlState::FEATURE_NOT_SUPPORTED,
            _ => SqlState::PROTOCOL_VIOLATION,
        }
    }
}

/// Renders a message tag the way people read it: the character if printable, else hex.
pub fn tag_name(tag: u8) -> String {
    if tag.is_ascii_graphic() {
        format!("'{}'", tag as char)
    } else {
        format!("0x{tag:02x}")
    }
}

/// Severity of an ErrorResponse or NoticeResponse, as sent in the non-localized `V` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Error,
    Fatal,
    Panic,
    Warning,
    Notice,
    Debug,
    Info,
    Log,
}

impl Severity {
    pub fn as_str(&self) -> &'static str {
        match self {
            Severity::Error => "ERROR",
            Severity::Fatal => "FATAL",
            Severity::Panic => "PANIC",
            Severity::Warning => "WARNING",
            Severity::Notice => "NOTICE",
            Severity::Debug => "DEBUG",
            Severity::Info => "INFO",
            Severity::Log => "LOG",
        }
    }

    pub fn parse(s: &[u8]) -> Option<Severity> {
        Some(match s {
            b"ERROR" => Severity::Error,
            b"FATAL" => Severity::Fatal,
            b"PANIC" => Severity::Panic,
            b"WARNING" => Severity::Warning,
            b"NOTICE" => Severity::Notice,
            b"DEBUG" => Severity::Debug,
            b"INFO" => Severity::Info,
            b"LOG" => Severity::Log,
            _ => return None,
        })
    }
}

/// An error or notice as PostgreSQL reports it. pgherd builds these for its own errors so a
/// client cannot tell from the format whether pgherd or the server answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgError {
    pub severity: Severity,
    pub code: SqlState,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl PgError {
    pub fn new(severity: Severity, code: SqlState, message: impl Into<String>) -> Self {
        PgError {
            severity,
            code,
            message: message.into(),
            detail: None,
            hint: None,
        }
    }

    pub fn error(code: SqlState, message: impl Into<String>) -> Self {
        Self::new(Severity::Error, code, message)
    }

    pub fn fatal(code: SqlState, message: impl Into<String>) -> Self {
        Self::new(Severity::Fatal, code, message)
    }

    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// Writes this as an ErrorResponse (`E`).
    pub fn encode(&self, buf: &mut BytesMut) -> Result<(), WireError> {
        self.encode_with_tag(buf, b'E')
    }

    /// Writes this as a NoticeResponse (`N`).
    pub fn encode_notice(&self, buf: &mut BytesMut) -> Result<(), WireError> {
        self.encode_with_tag(buf, b'N')
    }

    fn encode_with_tag(&self, buf: &mut BytesMut, tag: u8) -> Result<(), WireError> {
        write_message(buf, tag, |b| {
            let severity = self.severity.as_str().as_bytes();
            field(b, b'S', severity);
            field(b, b'V', severity);
            field(b, b'C', self.code.code().as_bytes());
            field(b, b'M', self.message.as_bytes());
            if let Some(detail) = &self.detail {
                field(b, b'D', detail.as_bytes());
            }
            if let Some(hint) = &self.hint {
                field(b, b'H', hint.as_bytes());
            }
            b.put_u8(0);
        })
    }

    /// Parses an ErrorResponse or NoticeResponse body, keeping the fields pgherd acts on.
    pub fn parse(body: &[u8]) -> Result<PgError, WireError> {
        Ok(PgError::from_fields(&ErrorFields::parse(body)?))
    }

    /// What the first bytes of an ErrorResponse or NoticeResponse body say, for a message
    /// too large to hold whole: the complete fields among them, and the message cut where the
    /// bytes end (PostgreSQL sends severity and code first).
    pub fn parse_prefix(prefix: &[u8]) -> PgError {
        let mut fields = Vec::new();
        let mut rest = prefix;
        while let Some((&code, after)) = rest.split_first() {
            if code == 0 {
                break;
            }
            match after.iter().position(|&b| b == 0) {
                Some(end) => {
                    fields.push((code, &after[..end]));
                    rest = &after[end + 1..];
                }
                None => {
                    if code == b'M' {
                        fields.push((code, after));
                    }
                    break;
                }
            }
        }
        PgError::from_fields(&ErrorFields { fields })
    }

    fn from_fields(fields: &ErrorFields<'_>) -> PgError {
        let text = |raw: Option<&[u8]>| raw.map(|v| String::from_utf8_lossy(v).into_owned());
        let severity = fields
            .get(b'V')
            .or(fields.get(b'S'))
            .and_then(Severity::parse)
            .unwrap_or(Severity::Error);
        let code = fields
            .get(b'C')
            .and_then(|c| std::str::from_utf8(c).ok())
            .and_then(SqlState::from_code)
            .unwrap_or(SqlState::INTERNAL_ERROR);
        PgError {
            severity,
            code,
            message: text(fields.get(b'M')).unwrap_or_default(),
            detail: text(fields.get(b'D')),
            hint: text(fields.get(b'H')),
        }
    }
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} (SQLSTATE {})",
            self.severity.as_str(),
            self.message,
            self.code
        )?;
        if let Some(detail) = &self.detail {
            write!(f, " DETAIL: {detail}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PgError {}

impl From<WireError> for PgError {
    fn from(e: WireError) -> Self {
        PgError::fatal(e.sqlstate(), e.to_string())
    }
}

fn field(buf: &mut BytesMut, code: u8, value: &[u8]) {
    buf.put_u8(code);
    // A NUL inside a field would end it early on the reader's side.
    let clean: &[u8] = match value.iter().position(|&b| b == 0) {
        Some(end) => &value[..end],
        None => value,
    };
    put_cstr(buf, clean);
}

/// The raw fields of an ErrorResponse or NoticeResponse body, borrowed.
#[derive(Debug, Clone, Default)]
pub struct ErrorFields<'a> {
    fields: Vec<(u8, &'a [u8])>,
}

impl<'a> ErrorFields<'a> {
    pub fn parse(body: &'a [u8]) -> Result<Self, WireError> {
        let mut reader = BodyReader::new("ErrorResponse", body);
        let mut fields = Vec::new();
        loop {
            let code = reader.u8("field type")?;
            if code == 0 {
                break;
            }
            fields.push((code, reader.cstr("field value")?));
        }
        reader.finish()?;
        Ok(ErrorFields { fields })
    }

    pub fn get(&self, code: u8) -> Option<&'a [u8]> {
        self.fields
            .iter()
            .find(|(c, _)| *c == code)
            .map(|(_, v)| *v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::split_message;

    #[test]
    fn a_prefix_gives_severity_code_and_the_start_of_the_message() {
        let err = PgError::new(Severity::Notice, SqlState::ADMIN_SHUTDOWN, "x".repeat(1000));
        let mut buf = BytesMut::new();
        err.encode_notice(&mut buf).unwrap();
        let body = &buf[5..];
        let seen = PgError::parse_prefix(&body[..40]);
        assert_eq!(
            (seen.severity, seen.code),
            (Severity::Notice, SqlState::ADMIN_SHUTDOWN)
        );
        assert!(seen.message.starts_with("xxx") && seen.message.len() < 40);
        assert_eq!(PgError::parse_prefix(body), err);
        assert_eq!(PgError::parse_prefix(b"").code, SqlState::INTERNAL_ERROR);
    }

    #[test]
    fn error_roundtrips_through_the_wire_format() {
        let err = PgError::fatal(
            SqlState::INVALID_PASSWORD,
            "password authentication failed for user \"bob\"",
        )
        .with_detail("d")
        .with_hint("h");
        let mut buf = BytesMut::new();
        err.encode(&mut buf).unwrap();
        let (header, body) = split_message(&buf, 1 << 20).unwrap().unwrap();
        assert_eq!(header.tag, b'E');
        assert_eq!(PgError::parse(body).unwrap(), err);
    }

    #[test]
    fn nul_in_a_message_is_cut_not_smuggled() {
        let err = PgError::error(SqlState::SYNTAX_ERROR, "bad\0C99999");
        let mut buf = BytesMut::new();
        err.encode(&mut buf).unwrap();
        let (_, body) = split_message(&buf, 1 << 20).unwrap().unwrap();
        let parsed = PgError::parse(body).unwrap();
        assert_eq!(parsed.message, "bad");
        assert_eq!(parsed.code, SqlState::SYNTAX_ERROR);
    }

    #[test]
    fn truncated_error_is_malformed() {
        assert!(ErrorFields::parse(b"SERROR\0CXX").is_err());
        assert!(ErrorFields::parse(b"").is_err());
    }
}
