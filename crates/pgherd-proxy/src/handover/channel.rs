//! The two processes' line during an upgrade: a Unix `SOCK_SEQPACKET` pair, each datagram a
//! piece of one JSON message, a message's file descriptors (listening sockets, a client's
//! connection) attached to its first piece with `SCM_RIGHTS`.
//!
//! Datagrams keep their boundaries and their order, so a message too large for one is sent
//! as consecutive pieces; a lock keeps the pieces of two messages from interleaving.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use tokio::io::unix::AsyncFd;
use tokio::sync::Mutex;

/// Payload per datagram (under the default socket buffer of about 208 KiB).
const PIECE_BYTES: usize = 60 << 10;
/// Descriptors one message may carry (listeners, or one client's connection).
const MAX_FDS: usize = 64;
/// A piece's first byte: more pieces of the same message follow, or this is its last.
const MORE: u8 = 1;
const LAST: u8 = 0;

/// One end of the line.
pub struct Channel {
    fd: AsyncFd<OwnedFd>,
    sending: Mutex<()>,
    receiving: Mutex<()>,
}

/// A message as it arrived: its JSON and the descriptors that came with it.
pub struct Received {
    pub json: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

impl Channel {
    /// A connected pair: this process's end, and the one a child inherits (not closed on
    /// exec; the child wraps it with [`Channel::adopt`]).
    pub fn pair() -> io::Result<(Channel, OwnedFd)> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: `fds` has room for the two descriptors socketpair writes.
        let made = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        if made != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: socketpair succeeded: both are open descriptors owned by nobody else.
        let (ours, theirs) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        set_flag(
            &theirs,
            libc::F_GETFD,
            libc::F_SETFD,
            libc::FD_CLOEXEC,
            false,
        )?;
        Ok((Channel::adopt(ours)?, theirs))
    }

    /// Wraps an end of a pair (the child's, inherited as a descriptor number).
    pub fn adopt(fd: OwnedFd) -> io::Result<Channel> {
        set_flag(&fd, libc::F_GETFL, libc::F_SETFL, libc::O_NONBLOCK, true)?;
        set_flag(&fd, libc::F_GETFD, libc::F_SETFD, libc::FD_CLOEXEC, true)?;
        // SAFETY: an `OwnedFd` is open, owned by the `AsyncFd` from here on, and always
        // answers the same descriptor.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?;
        Ok(Channel {
            fd,
            sending: Mutex::new(()),
            receiving: Mutex::new(()),
        })
    }

    /// Sends `json` with `fds` (duplicates of them go to the other process; the caller keeps
    /// its own).
    pub async fn send(&self, json: &[u8], fds: &[RawFd]) -> io::Result<()> {
        if fds.len() > MAX_FDS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "too many descriptors for one message",
            ));
        }
        let _turn = self.sending.lock().await;
        let pieces: Vec<&[u8]> = if json.is_empty() {
            vec![&[]]
        } else {
            json.chunks(PIECE_BYTES).collect()
        };
        let mut datagram = Vec::with_capacity(PIECE_BYTES + 1);
        for (i, piece) in pieces.iter().enumerate() {
            datagram.clear();
            datagram.push(if i + 1 == pieces.len() { LAST } else { MORE });
            datagram.extend_from_slice(piece);
            let attached = if i == 0 { fds } else { &[] };
            loop {
                let mut ready = self.fd.writable().await?;
                match ready.try_io(|fd| send_datagram(fd.as_raw_fd(), &datagram, attached)) {
                    Ok(sent) => {
                        sent?;
                        break;
                    }
                    Err(_would_block) => continue,
                }
            }
        }
        Ok(())
    }

    /// The next message; `Ok(None)` once the other end closed.
    pub async fn recv(&self) -> io::Result<Option<Received>> {
        let _turn = self.receiving.lock().await;
        let mut message = Received {
            json: Vec::new(),
            fds: Vec::new(),
        };
        let mut buf = vec![0u8; PIECE_BYTES + 1];
        loop {
            let got = loop {
                let mut ready = self.fd.readable().await?;
                match ready
                    .try_io(|fd| receive_datagram(fd.as_raw_fd(), &mut buf, &mut message.fds))
                {
                    Ok(got) => break got?,
                    Err(_would_block) => continue,
                }
            };
            let Some((&flag, piece)) = buf[..got].split_first() else {
                // A zero-length read: the other end is gone.
                return Ok(None);
            };
            message.json.extend_from_slice(piece);
            if flag == LAST {
                return Ok(Some(message));
            }
        }
    }
}

fn set_flag(fd: &OwnedFd, get: i32, set: i32, flag: i32, on: bool) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor this function borrows open; no pointers involved.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), get);
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        let flags = if on { flags | flag } else { flags & !flag };
        if libc::fcntl(fd.as_raw_fd(), set, flags) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Room for `MAX_FDS` descriptors in a control message, aligned as `cmsghdr` needs.
fn control_buffer(fds: usize) -> Vec<u64> {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<RawFd>()) as u32) } as usize;
    vec![0u64; space.div_ceil(8)]
}

fn send_datagram(socket: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: a zeroed msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let mut control = control_buffer(fds.len());
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = (control.len() * 8) as _;
        // SAFETY: the control buffer has room for one header with `fds.len()` descriptors
        // (CMSG_SPACE above), is aligned for it, and `msg` points at it.
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&msg);
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(header).cast::<RawFd>(),
                fds.len(),
            );
        }
    }
    // SAFETY: `msg` and everything it points at live through the call.
    let sent = unsafe { libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    if sent as usize != data.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "a datagram went out short",
        ));
    }
    Ok(())
}

fn receive_datagram(socket: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a zeroed msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let mut control = control_buffer(MAX_FDS);
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = (control.len() * 8) as _;
    // SAFETY: `msg` points at `buf` and `control`, which live through the call.
    let got = unsafe { libc::recvmsg(socket, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: recvmsg filled the control buffer; the macros walk only what it wrote.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&msg);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(header).cast::<RawFd>();
                let bytes = (*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    // Each received descriptor is new in this process and owned here.
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            header = libc::CMSG_NXTHDR(&msg, header);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a datagram or its descriptors did not fit",
        ));
    }
    Ok(got as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[tokio::test]
    async fn messages_and_descriptors_cross_whole_and_in_order() {
        let (ours, theirs) = Channel::pair().unwrap();
        let theirs = Channel::adopt(theirs).unwrap();
        let (mut kept, mut sent) = std::os::unix::net::UnixStream::pair().unwrap();
        let big: Vec<u8> = (0..500_000u32).map(|i| (i % 251) as u8).collect();
        // More than the socket buffer holds: the sender waits for the reader.
        let sender = {
            let big = big.clone();
            let fd = sent.as_raw_fd();
            tokio::spawn(async move {
                ours.send(b"first", &[fd]).await.unwrap();
                ours.send(&big, &[]).await.unwrap();
                ours.send(b"", &[]).await.unwrap();
                ours
            })
        };
        let first = theirs.recv().await.unwrap().unwrap();
        assert_eq!(first.json, b"first");
        assert_eq!(first.fds.len(), 1);
        // The descriptor that arrived is the same socket.
        let mut arrived =
            std::os::unix::net::UnixStream::from(first.fds.into_iter().next().unwrap());
        arrived.write_all(b"ping").unwrap();
        let mut four = [0u8; 4];
        kept.read_exact(&mut four).unwrap();
        assert_eq!(&four, b"ping");
        sent.write_all(b"x").unwrap();
        let second = theirs.recv().await.unwrap().unwrap();
        assert_eq!(second.json, big);
        assert!(second.fds.is_empty());
        assert_eq!(theirs.recv().await.unwrap().unwrap().json, b"");
        drop(sender.await.unwrap());
        assert!(theirs.recv().await.unwrap().is_none());
    }
}
