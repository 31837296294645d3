//! Message framing: header parsing with length checks done before any allocation, a bounds-checked
//! body reader, and a writer that reserves the length, writes the body and patches the length.

use bytes::{BufMut, BytesMut};

use crate::WireError;

/// A regular message starts with a one-byte tag and a four-byte big-endian length that counts
/// itself but not the tag.
pub const HEADER_BYTES: usize = 5;

/// PostgreSQL refuses startup packets longer than this (MAX_STARTUP_PACKET_LENGTH).
pub const MAX_STARTUP_PACKET_BYTES: usize = 10_000;

/// The largest message the protocol can describe: its length field is a signed 32-bit count.
pub const PROTOCOL_MAX_MESSAGE_BYTES: usize = i32::MAX as usize;

/// A parsed message header. `body_len` excludes the tag and the length field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub tag: u8,
    pub body_len: usize,
}

impl Header {
    /// Bytes the whole message occupies on the wire, header included.
    pub fn total_len(&self) -> usize {
        HEADER_BYTES + self.body_len
    }
}

/// Reads the header at the start of `buf`.
///
/// Returns `Ok(None)` when fewer than five bytes are buffered. The declared length is validated
/// against `max_message_bytes` here, so a caller never sizes a buffer from an unchecked peer value.
pub fn read_header(buf: &[u8], max_message_bytes: usize) -> Result<Option<Header>, WireError> {
    if buf.len() < HEADER_BYTES {
        return Ok(None);
    }
    let tag = buf[0];
    let declared = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    if declared < 4 || declared as usize > PROTOCOL_MAX_MESSAGE_BYTES {
        return Err(WireError::BadLength { tag, declared });
    }
    let body_len = declared as usize - 4;
    if body_len + HEADER_BYTES > max_message_bytes {
        return Err(WireError::TooLong {
            tag,
            declared,
            max_bytes: max_message_bytes,
        });
    }
    Ok(Some(Header { tag, body_len }))
}

/// Splits one complete message off the front of `buf`, if one is fully buffered.
pub fn split_message(
    buf: &[u8],
    max_message_bytes: usize,
) -> Result<Option<(Header, &[u8])>, WireError> {
    match read_header(buf, max_message_bytes)? {
        Some(header) if buf.len() >= header.total_len() => {
            Ok(Some((header, &buf[HEADER_BYTES..header.total_len()])))
        }
        _ => Ok(None),
    }
}

/// Reads the length prefix of an untagged startup-phase packet (startup, SSLRequest, cancel).
/// Returns the whole packet length including the four length bytes.
pub fn read_startup_len(buf: &[u8]) -> Result<Option<usize>, WireError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let declared = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    // Eight bytes is the smallest valid packet: the length and a protocol code.
    if declared < 8 || declared as usize > MAX_STARTUP_PACKET_BYTES {
        return Err(WireError::BadStartupLength { declared });
    }
    Ok(Some(declared as usize))
}

/// How many bytes [`BodyReader::short_cstr`] looks at one by one before it hands the rest to
/// memchr: room for pgbench's and the drivers' statement names and every command tag.
const SHORT_CSTR_BYTES: usize = 24;

/// A bounds-checked cursor over a message body. Every read names what it was reading so a
/// malformed message yields an error that says which field was wrong.
#[derive(Debug, Clone)]
pub struct BodyReader<'a> {
    message: &'static str,
    buf: &'a [u8],
}

impl<'a> BodyReader<'a> {
    pub fn new(message: &'static str, buf: &'a [u8]) -> Self {
        BodyReader { message, buf }
    }

    fn malformed(&self, reason: &'static str) -> WireError {
        WireError::Malformed {
            message: self.message,
            reason,
        }
    }

    pub fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        let (&first, rest) = self
            .buf
            .split_first()
            .ok_or_else(|| self.malformed(field))?;
        self.buf = rest;
        Ok(first)
    }

    pub fn i16(&mut self, field: &'static str) -> Result<i16, WireError> {
        let bytes = self.take(2, field)?;
        Ok(i16::from_be_bytes([bytes[0], bytes[1]]))
    }

    /// An unsigned 16-bit count, as PostgreSQL reads message counts (`pq_getmsgint(msg, 2)`).
    pub fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        let bytes = self.take(2, field)?;
        Ok(u16::from_be_bytes([bytes[0], bytes[1]]))
    }

    pub fn i32(&mut self, field: &'static str) -> Result<i32, WireError> {
        let bytes = self.take(4, field)?;
        Ok(i32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    pub fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        self.i32(field).map(|v| v as u32)
    }

    pub fn take(&mut self, len: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        if self.buf.len() < len {
            return Err(self.malformed(field));
        }
        let (head, rest) = self.buf.split_at(len);
        self.buf = rest;
        Ok(head)
    }

    /// A NUL-terminated string, returned without its terminator.
    #[inline]
    pub fn cstr(&mut self, field: &'static str) -> Result<&'a [u8], WireError> {
        // memchr: every query's text passes here.
        let end = memchr::memchr(0, self.buf).ok_or_else(|| self.malformed(field))?;
        Ok(self.take_cstr(end))
    }

    /// [`Self::cstr`] for a string that is usually short (a statement or portal name, a
    /// command tag): its first bytes are looked at one by one, which costs a few
    /// instructions where memchr's setup costs some forty, and memchr takes the rest of a long
    /// one.
    #[inline]
    pub fn short_cstr(&mut self, field: &'static str) -> Result<&'a [u8], WireError> {
        let head = self.buf.len().min(SHORT_CSTR_BYTES);
        let end = match self.buf[..head].iter().position(|b| *b == 0) {
            Some(end) => end,
            None => {
                let rest = memchr::memchr(0, &self.buf[head..]);
                head + rest.ok_or_else(|| self.malformed(field))?
            }
        };
        Ok(self.take_cstr(end))
    }

    /// The string before the NUL at `end`, the NUL passed over.
    #[inline]
    fn take_cstr(&mut self, end: usize) -> &'a [u8] {
        let s = &self.buf[..end];
        self.buf = &self.buf[end + 1..];
        s
    }

    /// A NUL-terminated string that must be valid UTF-8.
    pub fn cstr_utf8(&mut self, field: &'static str) -> Result<&'a str, WireError> {
        let raw = self.cstr(field)?;
        std::str::from_utf8(raw).map_err(|_| self.malformed(field))
    }

    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Fails if bytes are left over: a message longer than its fields is malformed too.
    pub fn finish(self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(self.malformed("trailing bytes after the last field"))
        }
    }
}

/// Writes one tagged message: reserves the length, lets `body` write the fields, then patches
/// the length in. Refuses (rather than truncates) a body the length field cannot describe.
pub fn write_message(
    buf: &mut BytesMut,
    tag: u8,
    body: impl FnOnce(&mut BytesMut),
) -> Result<(), WireError> {
    let start = buf.len();
    buf.put_u8(tag);
    write_length_prefixed(buf, start + 1, body)
}

/// Like [`write_message`] for the untagged startup-phase packets.
pub fn write_untagged(
    buf: &mut BytesMut,
    body: impl FnOnce(&mut BytesMut),
) -> Result<(), WireError> {
    let start = buf.len();
    write_length_prefixed(buf, start, body)
}

fn write_length_prefixed(
    buf: &mut BytesMut,
    len_at: usize,
    body: impl FnOnce(&mut BytesMut),
) -> Result<(), WireError> {
    buf.put_u32(0);
    body(buf);
    let len = buf.len() - len_at;
    if len > PROTOCOL_MAX_MESSAGE_BYTES {
        let tag = if len_at > 0 { buf[len_at - 1] } else { 0 };
        buf.truncate(if len_at > 0 { len_at - 1 } else { len_at });
        return Err(WireError::TooLong {
            tag,
            declared: u32::MAX,
            max_bytes: PROTOCOL_MAX_MESSAGE_BYTES,
        });
    }
    buf[len_at..len_at + 4].copy_from_slice(&(len as u32).to_be_bytes());
    Ok(())
}

/// Appends `s` and its NUL terminator.
pub fn put_cstr(buf: &mut BytesMut, s: &[u8]) {
    buf.put_slice(s);
    buf.put_u8(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A short string is read as `cstr` reads it, whatever its length around the bytes
    /// looked at one by one, and a missing NUL is the same error.
    #[test]
    fn short_strings_read_as_any_string() {
        for len in [
            0,
            1,
            3,
            SHORT_CSTR_BYTES - 1,
            SHORT_CSTR_BYTES,
            SHORT_CSTR_BYTES + 1,
            200,
        ] {
            let mut body = vec![b'n'; len];
            body.push(0);
            body.extend_from_slice(b"rest\0");
            let mut short = BodyReader::new("Bind", &body);
            let mut any = BodyReader::new("Bind", &body);
            assert_eq!(
                short.short_cstr("name").unwrap(),
                any.cstr("name").unwrap(),
                "{len}"
            );
            assert_eq!(short.short_cstr("next").unwrap(), b"rest");
            assert!(short.is_empty());
            let unterminated = vec![b'n'; len];
            assert_eq!(
                BodyReader::new("Bind", &unterminated).short_cstr("name"),
                BodyReader::new("Bind", &unterminated).cstr("name"),
                "{len}"
            );
            assert!(BodyReader::new("Bind", &unterminated)
                .short_cstr("name")
                .is_err());
        }
    }

    #[test]
    fn header_needs_five_bytes() {
        assert_eq!(read_header(b"Q\0\0\0", 100).unwrap(), None);
        assert_eq!(
            read_header(b"Q\0\0\0\x05x", 100).unwrap(),
            Some(Header {
                tag: b'Q',
                body_len: 1
            })
        );
    }

    #[test]
    fn lengths_are_checked_before_use() {
        assert_eq!(
            read_header(b"Q\0\0\0\x03", 100),
            Err(WireError::BadLength {
                tag: b'Q',
                declared: 3
            })
        );
        assert_eq!(
            read_header(b"Q\x7f\xff\xff\xff", 1024),
            Err(WireError::TooLong {
                tag: b'Q',
                declared: 0x7fff_ffff,
                max_bytes: 1024
            })
        );
        assert_eq!(
            read_header(b"Q\xff\xff\xff\xff", usize::MAX),
            Err(WireError::BadLength {
                tag: b'Q',
                declared: u32::MAX
            })
        );
    }

    #[test]
    fn split_waits_for_the_whole_body() {
        assert_eq!(split_message(b"Q\0\0\0\x06a", 100).unwrap(), None);
        let (h, body) = split_message(b"Q\0\0\0\x06ab+", 100).unwrap().unwrap();
        assert_eq!((h.tag, body), (b'Q', &b"ab"[..]));
    }

    #[test]
    fn startup_lengths_are_bounded() {
        assert_eq!(read_startup_len(&[0, 0, 0, 8]).unwrap(), Some(8));
        assert!(read_startup_len(&[0, 0, 0, 7]).is_err());
        assert!(read_startup_len(&[0, 1, 0, 0]).is_err());
    }

    #[test]
    fn reader_reports_the_field_that_ran_out() {
        let mut r = BodyReader::new("Bind", b"portal\0stmt");
        assert_eq!(r.cstr("portal name").unwrap(), b"portal");
        assert_eq!(
            r.cstr("statement name"),
            Err(WireError::Malformed {
                message: "Bind",
                reason: "statement name"
            })
        );
    }

    #[test]
    fn writer_patches_the_length() {
        let mut buf = BytesMut::new();
        write_message(&mut buf, b'Q', |b| put_cstr(b, b"select 1")).unwrap();
        assert_eq!(&buf[..], b"Q\0\0\0\x0dselect 1\0");
    }
}
