//! A Unix-domain stream socket watched by the reactor for reads only, until a write would block.
//!
//! Tokio registers every socket for reads and writes at once, edge-triggered. Over TCP a
//! socket reports room to write again only after a write found it full; a Unix-domain socket
//! reports it each time the peer reads anything from it. So with tokio's own `UnixStream`,
//! every statement pgherd sent a server through its socket woke pgherd's thread once more
//! when the backend read it, with nothing to do: half a wake-up per transaction at one
//! client (`strace` showed the thread leave `epoll_wait` for a lone `EPOLLOUT` on the server
//! socket between sending the query and reading the answer), and a readiness event to take
//! apart per statement under load. PgBouncer asks for write readiness only while it has
//! bytes waiting.
//!
//! Here the socket is registered for reads alone, and written to directly. The first write
//! that would block registers a duplicate of the descriptor for writes (epoll keeps the two
//! apart: a registration is per descriptor number) and keeps it for the connection's life: a
//! connection that once filled its socket (a large COPY, a long pipeline) is watched for
//! writes as before, the others never are.

use std::io::{self, Read};
use std::mem::MaybeUninit;
use std::net::Shutdown;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

pub struct UnixSocket {
    reads: AsyncFd<StdUnixStream>,
    /// A duplicate of the socket registered for writes, from its first write that would
    /// block on.
    writes: Option<AsyncFd<OwnedFd>>,
}

impl UnixSocket {
    /// Takes over a connected socket (tokio's registration of it ends).
    pub fn from_tokio(stream: tokio::net::UnixStream) -> io::Result<UnixSocket> {
        UnixSocket::from_std(stream.into_std()?)
    }

    pub fn from_std(stream: StdUnixStream) -> io::Result<UnixSocket> {
        stream.set_nonblocking(true)?;
        // SAFETY: the stream is open, owned by the `AsyncFd` from here on (which deregisters
        // it before closing it), and always answers the same descriptor.
        let reads = unsafe { AsyncFd::register_with_interest(stream, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(UnixSocket {
            reads,
            writes: None,
        })
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.reads.get_ref().as_fd()
    }

    pub fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.reads.poll_read_ready(cx).map_ok(drop)
    }

    /// Reads what is there if the reactor last saw the socket readable; readiness is
    /// cleared when the socket would block.
    pub fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.try_io(Interest::READABLE, || self.reads.get_ref().read(buf))
    }

    /// Runs `io` as tokio's `try_io` does: a read if the reactor last saw the socket
    /// readable, clearing that readiness if it reports `WouldBlock`. A write runs at once
    /// while the socket was never found full (the reactor does not follow its room then),
    /// through the write registration's readiness after.
    pub fn try_io<R>(
        &self,
        interest: Interest,
        io: impl FnOnce() -> io::Result<R>,
    ) -> io::Result<R> {
        if interest.is_readable() {
            return self.reads.try_io(Interest::READABLE, |_| io());
        }
        match &self.writes {
            None => io(),
            Some(writes) => writes.try_io(Interest::WRITABLE, |_| io()),
        }
    }

    /// Writes what fits of `buf` now, whatever the reactor saw: the bytes written. A closed
    /// peer is an error (`EPIPE`), not a signal, as with tokio's own sockets.
    pub fn send_now(&self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for reads of its length.
        let n = unsafe {
            libc::send(
                self.reads.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        byte_count(n)
    }

    /// Reads into `buf`'s spare capacity now, whatever the reactor saw: the bytes read.
    pub fn recv_now(&self, buf: &mut BytesMut) -> io::Result<usize> {
        let read_bytes = recv_into(self.reads.get_ref(), buf.spare_capacity_mut())?;
        // SAFETY: `recv` initialised the first `read_bytes` bytes of the spare capacity.
        unsafe { buf.set_len(buf.len() + read_bytes) };
        Ok(read_bytes)
    }

    /// Waits for room once a write would block, registering for writes the first time.
    fn poll_write_inner(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            let Some(writes) = &self.writes else {
                match self.send_now(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.writes = Some(self.register_writes()?);
                        continue;
                    }
                    written => return Poll::Ready(written),
                }
            };
            let mut ready = ready!(writes.poll_write_ready(cx))?;
            if let Ok(written) = ready.try_io(|_| self.send_now(buf)) {
                return Poll::Ready(written);
            }
        }
    }

    /// A duplicate of the socket, registered for writes. Registered while the socket may
    /// already have room again: epoll reports a descriptor ready when it is added, so the
    /// room that came in between is not missed.
    fn register_writes(&self) -> io::Result<AsyncFd<OwnedFd>> {
        let duplicate = self.as_fd().try_clone_to_owned()?;
        // SAFETY: as in `from_std`: the duplicate is open and owned by the `AsyncFd`.
        unsafe { AsyncFd::register_with_interest(duplicate, Interest::WRITABLE) }
            .map_err(|e| e.into_parts().1)
    }
}

/// A `send` or `recv` result: the bytes moved, or the error `errno` names.
fn byte_count(n: isize) -> io::Result<usize> {
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// `recv` into possibly uninitialised memory: the bytes read, which it initialised.
fn recv_into(stream: &StdUnixStream, spare: &mut [MaybeUninit<u8>]) -> io::Result<usize> {
    // SAFETY: `spare` is valid for writes of its length; `recv` writes at most that many
    // bytes and initialises exactly the count it returns.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            spare.as_mut_ptr().cast(),
            spare.len(),
            0,
        )
    };
    byte_count(n)
}

impl AsyncRead for UnixSocket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut ready = ready!(self.reads.poll_read_ready(cx))?;
            // SAFETY: only initialised bytes are marked filled, as `recv_into` reports them.
            let unfilled = unsafe { buf.unfilled_mut() };
            if let Ok(read) = ready.try_io(|fd| recv_into(fd.get_ref(), unfilled)) {
                let read_bytes = read?;
                // SAFETY: `recv` initialised these bytes.
                unsafe { buf.assume_init(read_bytes) };
                buf.advance(read_bytes);
                return Poll::Ready(Ok(()));
            }
        }
    }
}

impl AsyncWrite for UnixSocket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_inner(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.reads.get_ref().shutdown(Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn pair() -> (UnixSocket, StdUnixStream) {
        let (ours, theirs) = StdUnixStream::pair().unwrap();
        (UnixSocket::from_std(ours).unwrap(), theirs)
    }

    /// Writes go out at once; one that finds the socket full waits (the write registration
    /// is made then) and is woken by the peer's reads; every byte arrives once, in order.
    #[tokio::test(flavor = "current_thread")]
    async fn a_write_that_would_block_waits_for_room_and_loses_nothing() {
        let (mut ours, theirs) = pair();
        let reader = std::thread::spawn(move || {
            let mut theirs = theirs;
            // Let the writer fill the socket first.
            std::thread::sleep(Duration::from_millis(200));
            let mut got = Vec::new();
            theirs.read_to_end(&mut got).unwrap();
            got
        });
        let sent: Vec<u8> = (0..4_000_000u32).map(|i| (i % 251) as u8).collect();
        assert!(
            ours.writes.is_none(),
            "registered for writes before any blocked"
        );
        ours.write_all(&sent).await.unwrap();
        assert!(
            ours.writes.is_some(),
            "4 MB went out without the socket filling"
        );
        ours.shutdown().await.unwrap();
        assert!(reader.join().unwrap() == sent, "the bytes arrived altered");
    }

    /// Reads see the peer's bytes and its close.
    #[tokio::test(flavor = "current_thread")]
    async fn reads_see_the_bytes_and_the_close() {
        let (mut ours, mut theirs) = pair();
        theirs.write_all(b"hello").unwrap();
        let mut buf = [0u8; 16];
        let n = ours.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"hello");
        drop(theirs);
        assert_eq!(ours.read(&mut buf).await.unwrap(), 0);
    }

    /// The thread's voluntary context switches so far (Linux).
    fn thread_switches() -> u64 {
        let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// The point of this socket: the peer reading what was sent does not wake the thread.
    /// A peer that reads each request 20 ms after it came and answers 20 ms later leaves the
    /// thread asleep once per exchange (waiting for the answer); registered for writes too,
    /// as tokio's own `UnixStream` is, the peer's read wakes it a second time, for nothing.
    #[test]
    fn the_peers_reads_do_not_wake_the_thread() {
        const EXCHANGES: u64 = 20;
        let (ours, theirs) = StdUnixStream::pair().unwrap();
        let peer = std::thread::spawn(move || {
            let mut theirs = theirs;
            let mut request = [0u8; 64];
            for _ in 0..EXCHANGES {
                std::thread::sleep(Duration::from_millis(20));
                theirs.read_exact(&mut request).unwrap();
                std::thread::sleep(Duration::from_millis(20));
                theirs.write_all(&request).unwrap();
            }
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let switches = runtime.block_on(async {
            let mut ours = UnixSocket::from_std(ours).unwrap();
            let mut answer = [0u8; 64];
            let before = thread_switches();
            for round in 0..EXCHANGES {
                ours.write_all(&[round as u8; 64]).await.unwrap();
                ours.read_exact(&mut answer).await.unwrap();
                assert_eq!(answer, [round as u8; 64]);
            }
            thread_switches() - before
        });
        peer.join().unwrap();
        assert!(
            switches < EXCHANGES * 3 / 2,
            "{switches} sleeps in {EXCHANGES} exchanges: the peer's reads woke the thread"
        );
    }
}
