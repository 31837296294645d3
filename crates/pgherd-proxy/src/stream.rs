//! A TCP connection that may have been upgraded to TLS, on either side of the proxy, or a
//! server connection through a Unix-domain socket.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::TlsStream;

use crate::buffers;

pub enum Stream {
    Plain(TcpStream),
    /// A server connection through the node's Unix-domain socket (`socket_dir`).
    Unix(UnixStream),
    Tls(Box<TlsStream<TcpStream>>),
    /// The socket was handed to a TLS handshake that failed; nothing can be sent any more.
    Gone,
}

fn gone() -> io::Error {
    io::Error::new(
        io::ErrorKind::NotConnected,
        "the connection was lost in a TLS handshake",
    )
}

impl Stream {
    /// Upgrades a plain connection to TLS as the server side. On failure the stream is `Gone`.
    pub async fn accept_tls(&mut self, acceptor: &tokio_rustls::TlsAcceptor) -> io::Result<()> {
        match std::mem::replace(self, Stream::Gone) {
            Stream::Plain(tcp) => {
                let tls = acceptor.accept(tcp).await?;
                *self = Stream::Tls(Box::new(TlsStream::Server(tls)));
                Ok(())
            }
            other => {
                *self = other;
                Err(io::Error::other("TLS is already established"))
            }
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    /// The socket of a connection without TLS (TCP or Unix): what an upgrade hands over.
    pub fn plain_fd(&self) -> Option<BorrowedFd<'_>> {
        match self {
            Stream::Plain(s) => Some(s.as_fd()),
            Stream::Unix(s) => Some(s.as_fd()),
            Stream::Tls(_) | Stream::Gone => None,
        }
    }

    /// Reads what is there without waiting, on a connection without TLS (`None` with TLS,
    /// whose bytes are records, not messages).
    pub fn try_read_plain(&self, buf: &mut [u8]) -> Option<io::Result<usize>> {
        match self {
            Stream::Plain(s) => Some(s.try_read(buf)),
            Stream::Unix(s) => Some(s.try_read(buf)),
            Stream::Tls(_) | Stream::Gone => None,
        }
    }

    /// Ready when a read may make progress. For plain TCP this consults the reactor without a
    /// syscall, which lets an idle connection wait without holding a read buffer. TLS may hold
    /// decrypted bytes already, so it always reports ready.
    pub fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Stream::Plain(s) => s.poll_read_ready(cx),
            Stream::Unix(s) => s.poll_read_ready(cx),
            Stream::Tls(_) => Poll::Ready(Ok(())),
            Stream::Gone => Poll::Ready(Err(gone())),
        }
    }

    /// The DER certificate chain a TLS client presented, if any.
    pub fn peer_certificates(&self) -> Option<Vec<rustls_pki_types::CertificateDer<'static>>> {
        match self {
            Stream::Tls(tls) => match tls.as_ref() {
                TlsStream::Server(s) => s
                    .get_ref()
                    .1
                    .peer_certificates()
                    .map(|certs| certs.iter().map(|c| c.clone().into_owned()).collect()),
                TlsStream::Client(_) => None,
            },
            Stream::Plain(_) | Stream::Unix(_) | Stream::Gone => None,
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Stream::Gone => Poll::Ready(Err(gone())),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Stream::Gone => Poll::Ready(Err(gone())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Stream::Gone => Poll::Ready(Err(gone())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Stream::Gone => Poll::Ready(Err(gone())),
        }
    }
}

/// Reads once the socket is readable, holding a buffer only while bytes are there: readiness
/// can be stale, and an idle session must not park with a buffer taken for a read that would
/// have blocked.
pub fn poll_read_when_ready(
    stream: &mut Stream,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    ready!(stream.poll_read_ready(cx))?;
    buffers::ready_for_read(buf);
    let read = tokio_util::io::poll_read_buf(Pin::new(stream), cx, buf);
    if read.is_pending() {
        buffers::release_if_empty(buf);
    }
    read
}
