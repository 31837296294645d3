//! Whole-message reads for the phases where throughput does not matter: startup, login, server
//! connection setup and management queries. The data path uses `relay` instead.

use std::io;

use bytes::{Buf, BytesMut};
use pgherd_wire::frame::{read_header, read_startup_len, Header, HEADER_BYTES};
use pgherd_wire::WireError;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Buffers grow by at most this much ahead of the bytes actually received, so a peer that
/// declares a huge message cannot make pgherd allocate it up front.
pub const GROW_STEP_BYTES: usize = 64 << 10;

#[derive(Debug)]
pub enum ReadError {
    /// The peer closed the connection at a message boundary.
    Eof,
    Io(io::Error),
    Wire(WireError),
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

impl From<WireError> for ReadError {
    fn from(e: WireError) -> Self {
        ReadError::Wire(e)
    }
}

async fn fill<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut BytesMut,
    want_total: usize,
) -> Result<(), ReadError> {
    let missing = want_total.saturating_sub(buf.len());
    buf.reserve(missing.clamp(1, GROW_STEP_BYTES));
    let n = stream.read_buf(buf).await?;
    if n == 0 {
        return Err(if buf.is_empty() {
            ReadError::Eof
        } else {
            ReadError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed in the middle of a message",
            ))
        });
    }
    Ok(())
}

/// Reads one tagged message; returns its tag and body. Bytes after it stay in `buf`.
pub async fn read_message<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut BytesMut,
    max_message_bytes: usize,
) -> Result<(u8, BytesMut), ReadError> {
    loop {
        let want = match read_header(buf, max_message_bytes)? {
            Some(header) if buf.len() >= header.total_len() => {
                return Ok(split_off_message(buf, header));
            }
            Some(header) => header.total_len(),
            None => HEADER_BYTES,
        };
        fill(stream, buf, want).await?;
    }
}

/// The next tagged message if the whole of it is in `buf` already (taken out of it), without
/// reading more.
pub fn take_buffered_message(
    buf: &mut BytesMut,
    max_message_bytes: usize,
) -> Result<Option<(u8, BytesMut)>, WireError> {
    Ok(match read_header(buf, max_message_bytes)? {
        Some(header) if buf.len() >= header.total_len() => Some(split_off_message(buf, header)),
        _ => None,
    })
}

fn split_off_message(buf: &mut BytesMut, header: Header) -> (u8, BytesMut) {
    let mut message = buf.split_to(header.total_len());
    message.advance(HEADER_BYTES);
    (header.tag, message)
}

/// Reads one untagged startup-phase packet, length included.
pub async fn read_startup_packet<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut BytesMut,
) -> Result<BytesMut, ReadError> {
    loop {
        let want = match read_startup_len(buf)? {
            Some(len) if buf.len() >= len => return Ok(buf.split_to(len)),
            Some(len) => len,
            None => 4,
        };
        fill(stream, buf, want).await?;
    }
}

pub async fn write_flush<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) -> io::Result<()> {
    stream.write_all(bytes).await?;
    stream.flush().await
}
