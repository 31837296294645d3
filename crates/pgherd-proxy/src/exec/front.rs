//! The sharded session's front end: the client's messages read in order (no read buffer held
//! between statements), each handed to the executor, its answers written back; the session
//! ended, with the client told why, when it leaves, is killed, idles too long or pgherd shuts
//! down; or sent to the new process between statements when pgherd is upgraded.

use std::future::poll_fn;
use std::task::Poll;
use std::time::Duration;

use bytes::BytesMut;
use pgherd_wire::backend;
use pgherd_wire::frontend::tag as ftag;
use pgherd_wire::WireError;

use super::{encode_error, extended, Failed, ShardedSession, FLUSH_BYTES};
use crate::buffers;
use crate::clients::{ClientShared, SIGNAL_HANDOVER, SIGNAL_KILL, SIGNAL_SHUTDOWN};
use crate::error::{client_io, Disconnect};
use crate::msgio::{take_buffered_message, write_flush};
use crate::relay::Movable;
use crate::stream::poll_read_when_ready;

impl ShardedSession {
    /// Serves the client until it leaves or is sent away, and tells it why when it should
    /// hear (an idle timeout, a shutdown, a protocol error, ...).
    pub async fn run(&mut self) -> Disconnect {
        let end = self.serve().await;
        // The servers' part of an open transaction ends now, not after the farewell.
        drop(self.tx.take());
        if let Some(error) = end.client_error() {
            crate::client::send_error(&mut self.client, &error).await;
        }
        end
    }

    async fn serve(&mut self) -> Disconnect {
        let (max_message_bytes, idle_timeout_ms) = {
            let proxy = &self.app.config().proxy;
            (proxy.max_message_bytes, proxy.client_idle_timeout_ms)
        };
        // Its own handle, to watch for a kill while `self` runs a statement.
        let shared = self.shared.clone();
        loop {
            let first = match self
                .next_client_message(max_message_bytes, idle_timeout_ms)
                .await
            {
                Ok(message) => message,
                Err(end) => return end,
            };
            // The extended messages the client sent with it, up to a simple query (which may
            // start a COPY whose data must stay unread): an Execute looks ahead for its Sync.
            let mut queued = extended::Queued::from([first]);
            while queued.back().is_some_and(|(tag, _)| *tag != ftag::QUERY) {
                match take_buffered_message(&mut self.client_in, max_message_bytes) {
                    Ok(Some(message)) => queued.push_back(message),
                    Ok(None) => break,
                    Err(e) => return Disconnect::Protocol(e),
                }
            }
            let mut out = buffers::take();
            while let Some((tag, body)) = queued.pop_front() {
                // A kill ends a statement waiting on its servers too (a shard cut off the
                // network never answers): dropped half way, its links are closed, not pooled,
                // and a two-phase commit it leaves prepared is finished by the recovery.
                let handled = tokio::select! {
                    biased;
                    handled = self.message(tag, &body, &queued, &mut out) => handled,
                    end = signalled(&shared, false, &Movable::Later) => Err(end),
                };
                if let Err(end) = handled {
                    return end;
                }
                // A Flush asks for the answers so far (a pipelining client reads them while it
                // sends more).
                if tag == ftag::FLUSH || out.len() >= FLUSH_BYTES {
                    if let Err(e) = write_flush(&mut self.client, &out).await {
                        return client_io(e);
                    }
                    out.clear();
                }
            }
            if let Err(e) = write_flush(&mut self.client, &out).await {
                return client_io(e);
            }
            buffers::give(out);
        }
    }

    /// The client's next message. Between statements the session holds no read buffer, and
    /// ends when the client is killed, pgherd shuts down, or it stays idle past
    /// `client_idle_timeout_ms` (the last two only outside a transaction block, which may
    /// still end).
    async fn next_client_message(
        &mut self,
        max_message_bytes: usize,
        idle_timeout_ms: u64,
    ) -> Result<(u8, BytesMut), Disconnect> {
        let may_stop = self.tx.is_none();
        let idle_timeout_ms = if may_stop { idle_timeout_ms } else { 0 };
        // Between statements nothing changes it until the next message is handled.
        let movable = self.movable();
        loop {
            // Checked before each message, however many the client sent at once.
            if let Some(end) = signal_now(&self.shared, may_stop, &movable) {
                return Err(end);
            }
            match take_buffered_message(&mut self.client_in, max_message_bytes) {
                Ok(Some(message)) => return Ok(message),
                Ok(None) => {}
                Err(e) => return Err(Disconnect::Protocol(e)),
            }
            buffers::release_if_empty(&mut self.client_in);
            let (client, client_in, shared) = (&mut self.client, &mut self.client_in, &self.shared);
            let read = poll_fn(|cx| {
                let read = poll_read_when_ready(client, cx, client_in);
                if read.is_pending() && client_in.is_empty() {
                    // Nothing in hand: a cancel now (it wakes this task) is for nothing, and
                    // must not end the next statement's wait for its links; PostgreSQL
                    // ignores one for an idle backend.
                    shared.forget_cancel();
                }
                read
            });
            // (Each part of a message that arrives starts the idle time anew.)
            let idle = async {
                match idle_timeout_ms {
                    0 => std::future::pending().await,
                    ms => tokio::time::sleep(Duration::from_millis(ms)).await,
                }
            };
            let read = tokio::select! {
                biased;
                end = signalled(&self.shared, may_stop, &movable) => return Err(end),
                () = idle => return Err(Disconnect::IdleTimeout),
                read = read => read,
            };
            match read {
                Ok(0) if self.client_in.is_empty() => return Err(Disconnect::ClientClosed),
                Ok(0) => {
                    return Err(client_io(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "connection closed in the middle of a message",
                    )))
                }
                Ok(_) => {}
                Err(e) => return Err(client_io(e)),
            }
        }
    }

    /// One message from the client; its answer goes to `out`.
    async fn message(
        &mut self,
        tag: u8,
        body: &[u8],
        queued: &extended::Queued,
        out: &mut BytesMut,
    ) -> Result<(), Disconnect> {
        // After an error in the extended protocol, PostgreSQL ignores what comes up to Sync.
        let skipped = self.extended.skip_to_sync && !matches!(tag, ftag::SYNC | ftag::TERMINATE);
        match tag {
            _ if skipped => {}
            ftag::QUERY => {
                let sql = match body.strip_suffix(&[0]).map(std::str::from_utf8) {
                    Some(Ok(sql)) => sql,
                    _ => {
                        return Err(Disconnect::Protocol(WireError::Malformed {
                            message: "Query",
                            reason: "text (not UTF-8 ending in a zero byte)",
                        }))
                    }
                };
                self.query_string(sql, out).await?;
                // A simple query ends the implicit transaction of extended messages before it.
                let ended = self.end_implicit_block(out).await;
                self.answer_failure(ended, out)?;
                backend::encode_ready_for_query(out, self.tx_status());
            }
            ftag::TERMINATE => return Err(Disconnect::Terminated),
            ftag::SYNC => {
                let synced = self.sync(out).await;
                self.answer_failure(synced, out)?;
                backend::encode_ready_for_query(out, self.tx_status());
            }
            ftag::FLUSH | ftag::COPY_DATA | ftag::COPY_DONE | ftag::COPY_FAIL => {}
            ftag::PARSE | ftag::BIND | ftag::DESCRIBE | ftag::EXECUTE | ftag::CLOSE => {
                let done = self.extended_message(tag, body, queued, out).await;
                if done.is_err() {
                    self.extended.skip_to_sync = true;
                }
                self.answer_failure(done, out)?;
            }
            _ => {
                return Err(Disconnect::Protocol(WireError::Malformed {
                    message: "message",
                    reason: "type (not one a client sends)",
                }))
            }
        }
        Ok(())
    }

    /// A statement's failure: the client hears the error (unless the server's own was
    /// relayed already), the transaction it happened in is aborted, as in PostgreSQL.
    pub(super) fn answer_failure(
        &mut self,
        done: Result<(), Failed>,
        out: &mut BytesMut,
    ) -> Result<(), Disconnect> {
        let error = match done {
            Ok(()) => return Ok(()),
            Err(Failed::Client(end)) => return Err(end),
            Err(Failed::Relayed) => None,
            Err(Failed::Statement(e)) => Some(e),
        };
        if let Some(tx) = &mut self.tx {
            tx.failed = true;
        }
        if let Some(error) = error {
            encode_error(out, &error);
        }
        Ok(())
    }
}

/// Ready when the client is killed, or pgherd shuts down or is upgraded and `may_stop`
/// (between statements outside a transaction block, the session may end or move).
async fn signalled(shared: &ClientShared, may_stop: bool, movable: &Movable) -> Disconnect {
    poll_fn(|cx| {
        shared.register_waker(cx.waker());
        signal_now(shared, may_stop, movable).map_or(Poll::Pending, Poll::Ready)
    })
    .await
}

/// [`signalled`], as things stand now.
fn signal_now(shared: &ClientShared, may_stop: bool, movable: &Movable) -> Option<Disconnect> {
    let signals = shared.signals();
    if signals & SIGNAL_KILL != 0 {
        return Some(Disconnect::Killed(shared.kill_reason().unwrap_or_default()));
    }
    if may_stop && signals & SIGNAL_HANDOVER != 0 {
        match movable {
            Movable::Now => return Some(Disconnect::Moved),
            Movable::Never(why) => return Some(Disconnect::CannotMove(why)),
            Movable::Later => {}
        }
    }
    (may_stop && signals & SIGNAL_SHUTDOWN != 0).then_some(Disconnect::Shutdown)
}
