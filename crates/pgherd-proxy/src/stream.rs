//! A TCP connection that may have been upgraded to TLS, on either side of the proxy, or a
//! server connection through a Unix-domain socket.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsStream;

use crate::buffers;
use crate::unix_socket::UnixSocket;

pub enum Stream {
    Plain(TcpStream),
    /// A server connection through the node's Unix-domain socket (`socket_dir`).
    Unix(UnixSocket),
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

    /// The TCP socket under the connection, with TLS or without (`None` through a Unix-domain
    /// socket).
    pub fn tcp_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        match self {
            Stream::Plain(s) => Some(s.as_raw_fd()),
            Stream::Tls(tls) => Some(tls.get_ref().0.as_raw_fd()),
            Stream::Unix(_) | Stream::Gone => None,
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

    /// Reads into `buf`'s spare capacity, as `tokio_util::io::poll_read_buf` does. Without
    /// TLS the read is first tried as the reactor last saw the socket (a readiness load where
    /// the poll also goes through the waker's path), under a unit of the cooperative budget
    /// like every read; a socket that would block is then polled, which registers `cx`'s
    /// waker.
    pub fn poll_read_buf(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        match self {
            Stream::Plain(s) => read_trying_first(s, cx, buf),
            Stream::Unix(s) => read_trying_first(s, cx, buf),
            Stream::Tls(_) | Stream::Gone => tokio_util::io::poll_read_buf(Pin::new(self), cx, buf),
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

/// A socket without TLS, read and written without polling. Clearing readiness after a short
/// read or write, as tokio does on Linux's edge-triggered epoll (pgherd's only platform), is
/// right only where the reactor reports a new event for bytes or room that come later.
trait PlainSocket: AsyncRead + AsyncWrite + Unpin {
    /// Writes what fits if the reactor last saw the socket writable. A write that took less
    /// than all of `buf` filled the socket: the readiness seen before it is cleared then, as
    /// tokio's own write does, so the next write waits for room instead of costing a syscall
    /// that would block.
    fn try_write_filling(&self, buf: &[u8]) -> io::Result<usize>;

    /// Reads what is there if the reactor last saw the socket readable. A read that leaves
    /// room in `buf` drained the socket: the readiness seen before it is cleared then, as
    /// tokio's own read does, so the next read waits for an event instead of costing a
    /// syscall that would block (an event that came since is not lost: readiness is cleared
    /// only if none did).
    fn try_read_draining(&self, buf: &mut BytesMut) -> io::Result<usize>;
}

/// What a read or write inside `try_io` did: `moved_bytes`, and `WouldBlock` when it moved
/// fewer than `room_bytes` (nothing more can move now), which makes `try_io` clear the
/// readiness it saw before the call.
fn short_is_blocked(moved_bytes: usize, room_bytes: usize) -> io::Result<()> {
    if moved_bytes > 0 && moved_bytes < room_bytes {
        Err(io::ErrorKind::WouldBlock.into())
    } else {
        Ok(())
    }
}

/// The bytes moved inside `try_io`, whether or not it was told to clear readiness after.
fn moved(outcome: io::Result<()>, moved_bytes: usize) -> io::Result<usize> {
    match outcome {
        Err(_) if moved_bytes > 0 => Ok(moved_bytes),
        outcome => outcome.map(|()| moved_bytes),
    }
}

/// `write` and `read_buf` are the socket's own write and read, which `try_io` runs as the
/// reactor last saw the socket.
macro_rules! plain_socket {
    ($socket:ty, $write:ident, $read_buf:ident) => {
        impl PlainSocket for $socket {
            fn try_write_filling(&self, buf: &[u8]) -> io::Result<usize> {
                let mut written_bytes = 0;
                let outcome = self.try_io(tokio::io::Interest::WRITABLE, || {
                    written_bytes = self.$write(buf)?;
                    short_is_blocked(written_bytes, buf.len())
                });
                moved(outcome, written_bytes)
            }

            fn try_read_draining(&self, buf: &mut BytesMut) -> io::Result<usize> {
                let room_bytes = buf.capacity() - buf.len();
                let mut read_bytes = 0;
                let outcome = self.try_io(tokio::io::Interest::READABLE, || {
                    read_bytes = self.$read_buf(buf)?;
                    short_is_blocked(read_bytes, room_bytes)
                });
                moved(outcome, read_bytes)
            }
        }
    };
}

plain_socket!(TcpStream, try_write, try_read_buf);
plain_socket!(UnixSocket, send_now, recv_now);

/// [`Stream::poll_read_buf`] on a socket without TLS.
fn read_trying_first<S: PlainSocket>(
    socket: &mut S,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    let budget = ready!(tokio::task::coop::poll_proceed(cx));
    match socket.try_read_draining(buf) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            drop(budget);
            tokio_util::io::poll_read_buf(Pin::new(socket), cx, buf)
        }
        read => {
            budget.made_progress();
            Poll::Ready(read)
        }
    }
}

/// A write on a socket without TLS: tried as the reactor last saw the socket, which costs a
/// readiness load; only a socket that would block goes through `poll_write` (the cooperative
/// budget, the waker). A write that succeeds takes no unit of the budget; reads still do, so
/// a session that keeps finding bytes still yields to the others.
fn write_trying_first<S: PlainSocket>(
    socket: &mut S,
    cx: &mut Context<'_>,
    buf: &[u8],
) -> Poll<io::Result<usize>> {
    match socket.try_write_filling(buf) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Pin::new(socket).poll_write(cx, buf),
        written => Poll::Ready(written),
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
            Stream::Plain(s) => write_trying_first(s, cx, buf),
            Stream::Unix(s) => write_trying_first(s, cx, buf),
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
    let read = stream.poll_read_buf(cx, buf);
    if read.is_pending() {
        buffers::release_if_empty(buf);
    }
    read
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};
    use tokio::io::AsyncReadExt;

    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    const PATTERN_BYTES: usize = 64 * 1024;

    fn pattern(at: usize) -> u8 {
        (at % PATTERN_BYTES % 251) as u8
    }

    /// A write tried before readiness is polled must still leave the waker registered when
    /// the socket is full, and every byte written must arrive once, in order.
    #[tokio::test(flavor = "current_thread")]
    async fn a_write_that_would_block_is_woken_when_the_peer_reads() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(address), listener.accept());
        let mut writer = Stream::Plain(client.unwrap());
        let mut reader = accepted.unwrap().0;
        let woken = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let waker = Waker::from(woken.clone());
        let mut cx = Context::from_waker(&waker);
        let chunk: Vec<u8> = (0..PATTERN_BYTES).map(pattern).collect();
        let (mut sent, mut received, mut blocked) = (0usize, 0usize, 0);
        let mut drained = vec![0u8; 64 * 1024];
        while blocked < 3 {
            let offered = &chunk[sent % PATTERN_BYTES..];
            match Pin::new(&mut writer).poll_write(&mut cx, offered) {
                Poll::Ready(Ok(n)) => {
                    sent += n;
                    if n < offered.len() {
                        // Filled: the reactor no longer takes the socket for writable, so the
                        // next write waits for room instead of costing a syscall.
                        assert!(
                            !taken_for(&writer, tokio::io::Interest::WRITABLE),
                            "still taken for writable after a short write"
                        );
                    }
                }
                Poll::Ready(Err(e)) => panic!("write failed: {e}"),
                Poll::Pending => {
                    blocked += 1;
                    let before = woken.0.load(Ordering::SeqCst);
                    // The peer drains what was sent: the reactor must wake the blocked writer.
                    while received < sent {
                        let n = reader.read(&mut drained).await.unwrap();
                        assert!(n > 0, "the writer's connection closed");
                        for (i, byte) in drained[..n].iter().enumerate() {
                            assert_eq!(*byte, pattern(received + i), "byte {}", received + i);
                        }
                        received += n;
                    }
                    woken_after(&woken, before).await;
                }
            }
        }
        assert_eq!(received, sent);
        assert!(
            sent > 3 * 64 * 1024,
            "the socket filled up: {sent} bytes sent"
        );
    }

    async fn connected_pair() -> (Stream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(address), listener.accept());
        (Stream::Plain(accepted.unwrap().0), client.unwrap())
    }

    async fn connected_unix_pair() -> (Stream, tokio::net::UnixStream) {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        theirs.set_nonblocking(true).unwrap();
        let theirs = tokio::net::UnixStream::from_std(theirs).unwrap();
        (Stream::Unix(UnixSocket::from_std(ours).unwrap()), theirs)
    }

    /// Whether the reactor takes the plain socket as ready for `interest`: `try_io` calls its
    /// closure only then (a Unix socket never found full is written to at once).
    fn taken_for(stream: &Stream, interest: tokio::io::Interest) -> bool {
        let mut tried = false;
        let try_it = || {
            tried = true;
            Err::<(), _>(io::ErrorKind::WouldBlock.into())
        };
        let _ = match stream {
            Stream::Plain(socket) => socket.try_io(interest, try_it),
            Stream::Unix(socket) => socket.try_io(interest, try_it),
            _ => unreachable!("a plain socket"),
        };
        tried
    }

    /// Polls until the waker fires or 10 s pass.
    async fn woken_after(woken: &CountingWaker, before: usize) {
        tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while woken.0.load(Ordering::SeqCst) == before {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("woken");
    }

    /// A read that drains the socket leaves it waiting for the next event (not re-read at
    /// once), with the waker registered; a read that fills the buffer leaves the rest to the
    /// next read; the peer's close reads as 0.
    #[tokio::test(flavor = "current_thread")]
    async fn reads_take_what_is_there_and_wait_for_the_next_bytes() {
        let (reader, peer) = connected_pair().await;
        reads_take_what_is_there(reader, peer).await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn reads_over_a_unix_socket_take_what_is_there_and_wait_for_the_next_bytes() {
        let (reader, peer) = connected_unix_pair().await;
        reads_take_what_is_there(reader, peer).await;
    }

    async fn reads_take_what_is_there(
        mut reader: Stream,
        mut peer: impl tokio::io::AsyncWrite + Unpin,
    ) {
        use tokio::io::AsyncWriteExt;
        let woken = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let waker = Waker::from(woken.clone());
        let mut cx = Context::from_waker(&waker);
        let mut buf = BytesMut::with_capacity(1024);
        let mut poll = |reader: &mut Stream, buf: &mut BytesMut| reader.poll_read_buf(&mut cx, buf);
        assert!(poll(&mut reader, &mut buf).is_pending(), "nothing sent yet");
        for round in 0..3u8 {
            let before = woken.0.load(Ordering::SeqCst);
            peer.write_all(&[round; 100]).await.unwrap();
            woken_after(&woken, before).await;
            buf.clear();
            match poll(&mut reader, &mut buf) {
                Poll::Ready(Ok(100)) => assert_eq!(&buf[..], &[round; 100][..]),
                other => panic!("round {round}: {other:?}"),
            }
            // Drained: the reactor no longer takes the socket for readable, so the next
            // read costs no syscall.
            assert!(
                !taken_for(&reader, tokio::io::Interest::READABLE),
                "round {round}: still taken for readable"
            );
            assert!(poll(&mut reader, &mut buf).is_pending(), "drained");
        }
        // More than the buffer's room: two reads, nothing lost.
        let before = woken.0.load(Ordering::SeqCst);
        let sent: Vec<u8> = (0..3000u32).map(|i| (i % 253) as u8).collect();
        peer.write_all(&sent).await.unwrap();
        woken_after(&woken, before).await;
        let mut got = Vec::new();
        while got.len() < sent.len() {
            let mut buf = BytesMut::with_capacity(1024);
            match poll(&mut reader, &mut buf) {
                Poll::Ready(Ok(n)) => {
                    assert!(n > 0);
                    got.extend_from_slice(&buf[..n]);
                }
                Poll::Ready(Err(e)) => panic!("{e}"),
                Poll::Pending => {
                    let before = woken.0.load(Ordering::SeqCst);
                    woken_after(&woken, before).await;
                }
            }
        }
        assert_eq!(got, sent);
        let mut buf = BytesMut::with_capacity(1024);
        assert!(poll(&mut reader, &mut buf).is_pending(), "drained");
        let before = woken.0.load(Ordering::SeqCst);
        drop(peer);
        woken_after(&woken, before).await;
        let mut buf = BytesMut::with_capacity(1024);
        assert!(matches!(poll(&mut reader, &mut buf), Poll::Ready(Ok(0))));
    }
}
