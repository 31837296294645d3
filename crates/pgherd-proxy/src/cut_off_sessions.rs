//! Sessions waiting on a server the network has cut off. A request sent to a node whose link
//! went down stays unanswered while TCP retransmits it, about fifteen minutes on Linux's
//! defaults; a failover ends such sessions when it fences the node, but while pgherd may not
//! promote (failover off, no survivor sure to hold every commit, or only pgherd's own path is
//! cut) nothing else would. Once the node fails its health checks, the kernel is asked about
//! each such session's server connection, and a session whose data has gone unacknowledged
//! through several retransmissions is ended with the reason, as a fenced node's are.
//!
//! A connection whose request was acknowledged before the cut (a long statement) has nothing
//! to retransmit: while its node is down, it is given keepalive probes a second apart, which
//! a live server's kernel answers however busy the server is, and the kernel fails it once
//! five go unanswered (rather than after the usual idle minute and nine probes).
//!
//! Not `TCP_USER_TIMEOUT`: Linux applies it to a zero window too, so a server that stops
//! reading (a COPY waiting for a lock) would lose its connection; a window probe is answered
//! and is no retransmission, so this check leaves that server alone.

use std::os::fd::RawFd;
use std::sync::Arc;

use crate::app::App;
use crate::clients::ClientShared;
use crate::nodes::NodeState;

/// Retransmissions of the same unacknowledged data, with no acknowledgement since, after
/// which the server counts as cut off: at Linux's minimum retransmission timeout (200 ms,
/// doubling) the fifth goes out about 6 s after the data, where a live server's kernel
/// acknowledges within milliseconds however busy the server is.
pub const UNANSWERED_RETRANSMISSIONS: u8 = 5;

/// Keepalive for a connection to a node that is down: probes from a second of silence on, a
/// second apart, five unanswered and the connection fails.
const DOWN_KEEPALIVE_S: u64 = 1;
const DOWN_KEEPALIVE_PROBES: u32 = 5;

/// What the kernel says of a TCP connection, as far as the decision needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpProgress {
    /// Segments sent and not acknowledged yet.
    pub unacked_segments: u32,
    /// Retransmission timeouts in a row since the last acknowledgement of new data.
    pub unanswered_retransmissions: u8,
}

/// Whether a session waiting on a connection to a node is cut off from it: the node fails its
/// health checks and what pgherd sent has gone unacknowledged through
/// [`UNANSWERED_RETRANSMISSIONS`]. A server busy with a long statement has acknowledged its
/// request, and one that stopped reading answers window probes, so neither is ended.
pub fn is_cut_off(node_down: bool, tcp: TcpProgress) -> bool {
    node_down
        && tcp.unacked_segments > 0
        && tcp.unanswered_retransmissions >= UNANSWERED_RETRANSMISSIONS
}

/// Ends the sessions whose requests wait on a node that is down and cut off from pgherd's
/// side of the network. Runs at every failover turn, on every instance (each ends its own
/// sessions), and costs nothing while every node is up.
pub(crate) fn end_cut_off_sessions(app: &App, nodes: &[Arc<NodeState>]) {
    let down: Vec<&Arc<NodeState>> = nodes.iter().filter(|n| !n.is_up()).collect();
    if down.is_empty() {
        return;
    }
    for client in app.clients.all() {
        if client.signals() & crate::clients::SIGNAL_KILL != 0 {
            // Ended already, by this or an operator; it goes at its next step.
            continue;
        }
        // A sharded statement runs on several servers: any one cut off holds the session.
        for (target, fd) in client.target_sockets() {
            let Some(node) = down.iter().find(|n| target.is_on(n)) else {
                continue;
            };
            let Some(tcp) = tcp_progress(fd) else {
                continue;
            };
            if tcp.unacked_segments == 0 {
                probe_closely(fd);
            }
            // The session may have let the connection go while the kernel was asked, and its
            // descriptor may be another socket's by now: the answer counts only for the same
            // connection.
            let same = client
                .target_sockets()
                .iter()
                .any(|(t, _)| t.server_id == target.server_id);
            if same && is_cut_off(true, tcp) {
                end(&client, node, tcp);
                break;
            }
        }
    }
}

fn end(client: &ClientShared, node: &NodeState, tcp: TcpProgress) {
    let why = format!(
        "node {} is down and has acknowledged nothing pgherd sent it through {} \
         retransmissions: it is cut off from this host",
        node.name(),
        tcp.unanswered_retransmissions
    );
    tracing::warn!(
        node = node.name(),
        client = client.id,
        unacked_segments = tcp.unacked_segments,
        "a session's server is cut off; the session ends"
    );
    client.kill(why);
}

/// Gives a connection [`DOWN_KEEPALIVE_S`] keepalive. A descriptor the session let go of
/// meanwhile may be another socket's: a closer watch on it is harmless.
fn probe_closely(fd: RawFd) {
    // SAFETY: the descriptor is only borrowed for the calls below; one closed meanwhile makes
    // them fail, which is ignored.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let every = std::time::Duration::from_secs(DOWN_KEEPALIVE_S);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(every)
        .with_interval(every)
        .with_retries(DOWN_KEEPALIVE_PROBES);
    let _ = socket2::SockRef::from(&fd).set_tcp_keepalive(&keepalive);
}

/// The kernel's `TCP_INFO` for a socket; `None` if it is not a TCP socket any more.
fn tcp_progress(fd: RawFd) -> Option<TcpProgress> {
    // SAFETY: tcp_info is plain data; getsockopt writes at most `len` bytes into it and fails
    // on a descriptor that is closed or not a TCP socket, which is answered with None.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let asked = libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        );
        (asked == 0).then_some(TcpProgress {
            unacked_segments: info.tcpi_unacked,
            unanswered_retransmissions: info.tcpi_retransmits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(unacked_segments: u32, unanswered_retransmissions: u8) -> TcpProgress {
        TcpProgress {
            unacked_segments,
            unanswered_retransmissions,
        }
    }

    #[test]
    fn only_a_down_node_that_acknowledges_nothing_is_cut_off() {
        assert!(is_cut_off(true, progress(1, UNANSWERED_RETRANSMISSIONS)));
        assert!(is_cut_off(true, progress(3, 15)));
        // Health checks still pass: a slow network, not a lost node.
        assert!(!is_cut_off(false, progress(1, 15)));
        // Everything acknowledged: a long statement, or a server that stopped reading.
        assert!(!is_cut_off(true, progress(0, 0)));
        assert!(!is_cut_off(true, progress(0, 9)));
        // Retransmitting, but not long enough to tell a lost node from a lost packet.
        assert!(!is_cut_off(
            true,
            progress(2, UNANSWERED_RETRANSMISSIONS - 1)
        ));
    }

    /// The kernel's view of a live loopback connection: nothing unacknowledged once the peer
    /// has the bytes, so a busy peer is never taken for a lost one.
    #[test]
    fn a_connection_whose_peer_has_the_bytes_is_not_cut_off() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut sender =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (_receiver, _) = listener.accept().expect("accept");
        sender.write_all(b"a request nobody reads").expect("write");
        let mut tcp = tcp_progress(sender.as_raw_fd()).expect("a TCP socket");
        for _ in 0..100 {
            if tcp.unacked_segments == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            tcp = tcp_progress(sender.as_raw_fd()).expect("a TCP socket");
        }
        assert_eq!(tcp, progress(0, 0));
        assert!(!is_cut_off(true, tcp));
        assert_eq!(tcp_progress(-1), None);
    }
}
