//! The responses a server connection still owes, in order, and who gets each of them.
//!
//! Every message pgherd sends a server pushes what it will answer with; every server message
//! pops or advances the front. This tells the relay three things it cannot learn otherwise:
//! whether a response belongs to the client or to pgherd itself (an injected Parse, a parameter
//! sync), where pgherd must insert responses it produces itself (a Parse it skipped because the
//! server already had the statement), and when the connection owes nothing more and can go back
//! to the pool. Pure: no IO, no clock.

use std::collections::VecDeque;

use bytes::Bytes;
use pgherd_wire::backend::tag;
use pgherd_wire::PgError;

use super::statements::StatementHash;

/// A request whose answer is pending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Simple query (or FunctionCall): everything up to and including ReadyForQuery. `sql` is
    /// kept only for statements that may change session settings.
    Query {
        sql: Option<Bytes>,
    },
    /// ParseComplete. `cached` is the server-side statement this Parse creates, to forget
    /// again if the Parse fails or is skipped.
    Parse {
        cached: Option<StatementHash>,
    },
    Bind,
    /// Optional ParameterDescription, then RowDescription or NoData.
    Describe,
    /// DataRows (or a COPY), then CommandComplete, EmptyQueryResponse or PortalSuspended.
    /// `sql` as for `Query`.
    Execute {
        sql: Option<Bytes>,
    },
    Close,
    /// ReadyForQuery.
    Sync,
    /// A simple query of pgherd's whose rows pgherd reads.
    Probe(Probe),
    /// pgherd's simple query giving back settings the client's `RESET` took from the startup
    /// packet's values to the server's: the parameters it reports are the client's.
    Restore,
}

/// What pgherd asks a server about the session it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// `SELECT pg_current_wal_insert_lsn()` after the session's writes numbered up to
    /// `write_seq`: one row, the WAL position.
    Lsn { write_seq: u64 },
    /// The session state left by a transaction that may have changed it (`relay::probe`).
    State,
}

impl Request {
    fn ends_with_ready_for_query(&self) -> bool {
        matches!(
            self,
            Request::Query { .. } | Request::Sync | Request::Probe(_) | Request::Restore
        )
    }

    fn is_query(&self) -> bool {
        matches!(
            self,
            Request::Query { .. } | Request::Probe(_) | Request::Restore
        )
    }
}

/// A response pgherd writes to the client itself when its turn comes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Synthetic {
    ParseComplete,
    CloseComplete,
    /// A simple query pgherd answers itself: its CommandComplete, then ReadyForQuery with
    /// the transaction status at the time it is written.
    Answered(&'static str),
    /// An error pgherd raises in the middle of a pipeline (e.g. an unknown statement name); the
    /// client's messages up to its next Sync are then skipped, as a server would. Boxed: rare,
    /// and inline it would make every queue entry 88 bytes instead of 48.
    Error(Box<PgError>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// Forward the responses to the client.
    Client(Request),
    /// pgherd's own request: drop the responses.
    Internal(Request),
    Synthetic(Synthetic),
    /// Where the client ended COPY data (CopyDone or CopyFail) it sent before the server
    /// answered the COPY: the Syncs before it arrive in copy mode and go unanswered, those
    /// after it are answered. No response of its own; dropped once it reaches the front.
    CopyEnd,
}

/// See [`ResponseQueue::front_passes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassingResults {
    None,
    Rows,
    RowsAndDescription,
}

impl PassingResults {
    pub fn includes(self, message_tag: u8) -> bool {
        match self {
            PassingResults::None => false,
            PassingResults::Rows => message_tag == tag::DATA_ROW,
            PassingResults::RowsAndDescription => {
                matches!(message_tag, tag::DATA_ROW | tag::ROW_DESCRIPTION)
            }
        }
    }
}

/// What to do with one server message.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Disposition {
    pub to_client: bool,
    /// The message is an ErrorResponse answering one of pgherd's own requests.
    pub internal_error: bool,
    /// Set when the message was the ReadyForQuery answering a client request.
    pub client_ready: bool,
    /// Server-side statements that will not exist after all (their Parse failed or was skipped).
    pub uncached: Vec<StatementHash>,
    /// For a CommandComplete answering the client: the statement text, if it was kept.
    pub sql: Option<Bytes>,
    /// The message answers one of pgherd's probes.
    pub probe: Option<Probe>,
    /// An ErrorResponse no request asked for: a server's last words (FATAL) as it ends the
    /// connection (shut down, terminated by an administrator).
    pub unsolicited: bool,
    /// The message answers pgherd's restore of startup settings (`Request::Restore`).
    pub restores: bool,
}

#[derive(Debug, Default)]
pub struct ResponseQueue {
    entries: VecDeque<Entry>,
    /// After an error in an extended-protocol batch, the server ignores everything up to the
    /// next Sync. While this is set the client has not sent that Sync yet, and the relay must
    /// drop the client's messages up to it too, or their answers would never come.
    skipping_to_sync: bool,
    /// The server is in COPY FROM STDIN and waits for the client's data.
    copy_in: bool,
    /// The client has not ended its COPY data yet. The server ignores Sync and Flush until
    /// then, so no answer may be expected for them.
    client_copy_open: bool,
}

impl ResponseQueue {
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn skipping_to_sync(&self) -> bool {
        self.skipping_to_sync
    }

    pub fn in_copy_in(&self) -> bool {
        self.copy_in
    }

    /// True when nothing is owed and no partial exchange is open: the connection is between
    /// requests as far as the protocol goes.
    pub fn is_settled(&self) -> bool {
        self.entries.is_empty() && !self.skipping_to_sync && !self.copy_in
    }

    pub fn push_client(&mut self, request: Request) {
        if matches!(request, Request::Sync) {
            if self.client_copy_open {
                // Ignored by a server in COPY FROM STDIN.
                return;
            }
            self.skipping_to_sync = false;
        }
        self.entries.push_back(Entry::Client(request));
    }

    /// The client sent CopyDone or CopyFail: from now on its Syncs count again. Sent before
    /// the server answered its COPY (drivers send the statement, the data and its end at
    /// once), where it falls among the requests is kept until that answer comes.
    pub fn client_copy_finished(&mut self) {
        if self.copy_in {
            self.client_copy_open = false;
        } else if self.entries.iter().any(|e| {
            matches!(
                e,
                Entry::Client(Request::Query { .. } | Request::Execute { .. })
            )
        }) {
            self.entries.push_back(Entry::CopyEnd);
        }
    }

    pub fn push_internal(&mut self, request: Request) {
        self.entries.push_back(Entry::Internal(request));
    }

    pub fn push_synthetic(&mut self, response: Synthetic) {
        if matches!(response, Synthetic::Error(_)) {
            self.skipping_to_sync = true;
        }
        self.entries.push_back(Entry::Synthetic(response));
    }

    /// Takes the synthetic responses now at the front: everything before them is answered.
    /// Inlined: called three times per server message, and almost always finds nothing.
    #[inline]
    pub fn take_ready_synthetics(&mut self, out: &mut Vec<Synthetic>) {
        while let Some(Entry::Synthetic(_) | Entry::CopyEnd) = self.entries.front() {
            // A CopyEnd at the front followed a request that did not start a COPY.
            if let Some(Entry::Synthetic(s)) = self.entries.pop_front() {
                out.push(s);
            }
        }
    }

    /// Classifies one server message and advances the queue. Synthetic responses that become
    /// due are appended to `synthetics`: those queued before this message's request come first
    /// in `synthetics_before`, the rest after.
    pub fn on_server_message(
        &mut self,
        message_tag: u8,
        synthetics_before: &mut Vec<Synthetic>,
        synthetics_after: &mut Vec<Synthetic>,
    ) -> Result<Disposition, String> {
        self.take_ready_synthetics(synthetics_before);
        let mut d = Disposition::default();
        let Some(front) = self.entries.front() else {
            // Nothing is owed: only asynchronous messages may arrive.
            return match message_tag {
                tag::NOTICE_RESPONSE | tag::NOTIFICATION_RESPONSE | tag::PARAMETER_STATUS => {
                    d.to_client = true;
                    Ok(d)
                }
                tag::ERROR_RESPONSE => {
                    d.unsolicited = true;
                    Ok(d)
                }
                other => Err(format!(
                    "message {} arrived when no response was pending",
                    pgherd_wire::error::tag_name(other)
                )),
            };
        };
        // Borrowed, not cloned: the request is looked at until the queue moves past it.
        let (is_client, request) = match front {
            Entry::Client(r) => (true, r),
            Entry::Internal(r) => (false, r),
            Entry::Synthetic(_) | Entry::CopyEnd => unreachable_synthetic(),
        };
        d.to_client = is_client;
        if let Request::Probe(probe) = request {
            d.probe = Some(*probe);
        }
        d.restores = matches!(request, Request::Restore);
        let completes = match message_tag {
            tag::NOTICE_RESPONSE | tag::NOTIFICATION_RESPONSE | tag::PARAMETER_STATUS => false,
            tag::READY_FOR_QUERY => {
                if !request.ends_with_ready_for_query() {
                    return Err(format!(
                        "ReadyForQuery arrived while waiting for {request:?}"
                    ));
                }
                d.client_ready = is_client;
                self.copy_in = false;
                true
            }
            tag::ERROR_RESPONSE => {
                // pgherd prepares only the client's own statements (again, on this server):
                // their failure is the failure of the Bind or Describe that needed them, and
                // the client must see it, or its request would end without an answer.
                if matches!(request, Request::Parse { .. }) {
                    d.to_client = true;
                }
                d.internal_error = !d.to_client;
                self.copy_in = false;
                if request.is_query() {
                    // The ReadyForQuery that follows ends the query.
                    false
                } else {
                    if let Request::Parse { cached: Some(h) } = request {
                        d.uncached.push(*h);
                    }
                    self.entries.pop_front();
                    self.skip_to_sync(&mut d);
                    self.take_ready_synthetics(synthetics_after);
                    return Ok(d);
                }
            }
            tag::PARSE_COMPLETE => expect(
                request,
                matches!(request, Request::Parse { .. }),
                message_tag,
            )?,
            tag::BIND_COMPLETE => expect(request, matches!(request, Request::Bind), message_tag)?,
            tag::CLOSE_COMPLETE => expect(request, matches!(request, Request::Close), message_tag)?,
            tag::PARAMETER_DESCRIPTION => {
                expect(request, matches!(request, Request::Describe), message_tag)?;
                false
            }
            tag::ROW_DESCRIPTION | tag::NO_DATA => match request {
                Request::Describe => true,
                // A simple query describes its rows too; an Execute never does.
                Request::Query { .. } | Request::Probe(_) | Request::Restore => false,
                _ => {
                    return Err(format!(
                        "row description arrived while waiting for {request:?}"
                    ))
                }
            },
            tag::COMMAND_COMPLETE | tag::EMPTY_QUERY_RESPONSE | tag::PORTAL_SUSPENDED => {
                if message_tag == tag::COMMAND_COMPLETE && is_client {
                    if let Request::Query { sql } | Request::Execute { sql } = request {
                        d.sql = sql.clone();
                    }
                }
                match request {
                    Request::Execute { .. } => true,
                    Request::Query { .. } | Request::Probe(_) | Request::Restore => false,
                    _ => {
                        return Err(format!(
                            "command completion arrived while waiting for {request:?}"
                        ))
                    }
                }
            }
            tag::COPY_IN_RESPONSE | tag::COPY_BOTH_RESPONSE => {
                self.copy_in = true;
                // Syncs the client pipelined behind the COPY, up to where it ended its data,
                // arrived in copy mode, where the server ignores them (drivers do send them).
                // They will not be answered.
                let copy_end = self.entries.iter().position(|e| *e == Entry::CopyEnd);
                self.client_copy_open = copy_end.is_none();
                let before_end = copy_end.unwrap_or(self.entries.len());
                let mut kept = VecDeque::with_capacity(self.entries.len());
                kept.extend(self.entries.drain(..).enumerate().filter_map(|(i, e)| {
                    let ignored = i > 0
                        && i <= before_end
                        && matches!(e, Entry::Client(Request::Sync) | Entry::CopyEnd);
                    (!ignored).then_some(e)
                }));
                self.entries = kept;
                false
            }
            tag::DATA_ROW
            | tag::COPY_OUT_RESPONSE
            | tag::COPY_DATA
            | tag::COPY_DONE
            | tag::FUNCTION_CALL_RESPONSE => false,
            other => {
                return Err(format!(
                    "unexpected message {} while waiting for {request:?}",
                    pgherd_wire::error::tag_name(other)
                ))
            }
        };
        if completes {
            self.entries.pop_front();
            self.take_ready_synthetics(synthetics_after);
        }
        Ok(d)
    }

    /// After an extended-protocol error the server skips to the next Sync; so do we.
    fn skip_to_sync(&mut self, d: &mut Disposition) {
        while let Some(entry) = self.entries.front() {
            match entry {
                Entry::Client(Request::Sync) | Entry::Internal(Request::Sync) => return,
                Entry::Client(Request::Parse { cached: Some(h) })
                | Entry::Internal(Request::Parse { cached: Some(h) }) => d.uncached.push(*h),
                _ => {}
            }
            self.entries.pop_front();
        }
        self.skipping_to_sync = true;
    }

    /// Forgets everything owed: the server connection is gone.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.skipping_to_sync = false;
        self.copy_in = false;
        self.client_copy_open = false;
    }

    /// How many ReadyForQuery messages the client still expects for requests already sent.
    pub fn client_ready_owed(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| match e {
                Entry::Client(r) => r.ends_with_ready_for_query(),
                Entry::Synthetic(Synthetic::Answered(_)) => true,
                _ => false,
            })
            .count()
    }

    /// Which result messages, by tag, answer the client's own request at the front with no
    /// more to do than forwarding them: [`on_server_message`](Self::on_server_message) would
    /// leave the queue as it is and ask nothing of them but to go to the client. Rows answer
    /// a simple query or an Execute; a row description, only a simple query (it completes a
    /// Describe and is an error after an Execute).
    pub fn front_passes(&self) -> PassingResults {
        match self.entries.front() {
            Some(Entry::Client(Request::Query { .. })) => PassingResults::RowsAndDescription,
            Some(Entry::Client(Request::Execute { .. })) => PassingResults::Rows,
            _ => PassingResults::None,
        }
    }

    /// True if the next answer is a probe's.
    pub fn front_is_probe(&self) -> bool {
        matches!(
            self.entries.front(),
            Some(Entry::Internal(Request::Probe(_)))
        )
    }

    /// True if an LSN probe is in flight.
    pub fn has_lsn_probe(&self) -> bool {
        self.entries
            .iter()
            .any(|e| matches!(e, Entry::Internal(Request::Probe(Probe::Lsn { .. }))))
    }

    /// True if any request in flight is the client's (as opposed to pgherd's own).
    pub fn has_client_requests(&self) -> bool {
        self.entries.iter().any(|e| matches!(e, Entry::Client(_)))
    }
}

fn expect(request: &Request, ok: bool, message_tag: u8) -> Result<bool, String> {
    if ok {
        Ok(true)
    } else {
        Err(format!(
            "message {} arrived while waiting for {request:?}",
            pgherd_wire::error::tag_name(message_tag)
        ))
    }
}

fn unreachable_synthetic() -> ! {
    // take_ready_synthetics ran just before, so a synthetic entry cannot be at the front.
    unreachable!("synthetic response at the queue front after draining")
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgherd_wire::SqlState;

    struct Run {
        q: ResponseQueue,
    }

    impl Run {
        fn new() -> Self {
            Run {
                q: ResponseQueue::default(),
            }
        }

        /// Feeds `tags`; returns what the client sees, synthetics as lower-case names.
        fn feed(&mut self, tags: &[u8]) -> Vec<String> {
            let mut seen = Vec::new();
            for &t in tags {
                let (mut before, mut after) = (Vec::new(), Vec::new());
                let d = self
                    .q
                    .on_server_message(t, &mut before, &mut after)
                    .unwrap();
                seen.extend(before.iter().map(name));
                if d.to_client {
                    seen.push((t as char).to_string());
                }
                seen.extend(after.iter().map(name));
            }
            seen
        }
    }

    fn name(s: &Synthetic) -> String {
        match s {
            Synthetic::ParseComplete => "parse".into(),
            Synthetic::CloseComplete => "close".into(),
            Synthetic::Answered(tag) => format!("answered {tag}"),
            Synthetic::Error(_) => "error".into(),
        }
    }

    #[test]
    fn a_query_pgherd_answers_itself_counts_as_owing_a_ready() {
        let mut r = Run::new();
        r.q.push_client(Request::Query { sql: None });
        r.q.push_synthetic(Synthetic::Answered("DEALLOCATE"));
        assert_eq!(r.q.client_ready_owed(), 2);
        assert_eq!(r.feed(b"CZ"), ["C", "Z", "answered DEALLOCATE"]);
        assert!(r.q.is_settled());
    }

    #[test]
    fn skipped_parse_is_answered_in_order() {
        let mut r = Run::new();
        // Client: Parse(cached, skipped) Bind Execute Sync.
        r.q.push_synthetic(Synthetic::ParseComplete);
        r.q.push_client(Request::Bind);
        r.q.push_client(Request::Execute { sql: None });
        r.q.push_client(Request::Sync);
        assert_eq!(r.feed(b"2DCZ"), ["parse", "2", "D", "C", "Z"]);
        assert!(r.q.is_settled());
    }

    #[test]
    fn injected_parse_answer_is_dropped() {
        let mut r = Run::new();
        let h = StatementHash([7; 16]);
        r.q.push_internal(Request::Parse { cached: Some(h) });
        r.q.push_client(Request::Bind);
        r.q.push_client(Request::Execute { sql: None });
        r.q.push_client(Request::Sync);
        assert_eq!(r.feed(b"12CZ"), ["2", "C", "Z"]);
    }

    #[test]
    fn error_skips_to_sync_and_uncaches() {
        let mut q = ResponseQueue::default();
        let h = StatementHash([1; 16]);
        q.push_client(Request::Parse { cached: Some(h) });
        q.push_client(Request::Bind);
        q.push_synthetic(Synthetic::CloseComplete);
        q.push_client(Request::Execute { sql: None });
        q.push_client(Request::Sync);
        let (mut b, mut a) = (Vec::new(), Vec::new());
        let d = q.on_server_message(b'E', &mut b, &mut a).unwrap();
        assert!(d.to_client);
        assert_eq!(d.uncached, vec![h]);
        assert!(
            b.is_empty() && a.is_empty(),
            "a dropped synthetic must not be sent"
        );
        let d = q.on_server_message(b'Z', &mut b, &mut a).unwrap();
        assert!(d.client_ready);
        assert!(q.is_settled());
    }

    #[test]
    fn error_before_the_clients_sync_arrives_skips_until_it_does() {
        let mut q = ResponseQueue::default();
        q.push_client(Request::Parse { cached: None });
        let (mut b, mut a) = (Vec::new(), Vec::new());
        q.on_server_message(b'E', &mut b, &mut a).unwrap();
        assert!(q.skipping_to_sync());
        assert!(!q.is_settled());
        q.push_client(Request::Sync);
        assert!(!q.skipping_to_sync());
        q.on_server_message(b'Z', &mut b, &mut a).unwrap();
        assert!(q.is_settled());
    }

    #[test]
    fn simple_query_with_error_ends_at_ready_for_query() {
        let mut r = Run::new();
        r.q.push_client(Request::Query { sql: None });
        assert_eq!(r.feed(b"TDCEZ"), ["T", "D", "C", "E", "Z"]);
        assert!(r.q.is_settled());
    }

    #[test]
    fn internal_query_is_invisible_and_its_error_is_flagged() {
        let mut q = ResponseQueue::default();
        q.push_internal(Request::Query { sql: None });
        q.push_client(Request::Query { sql: None });
        let (mut b, mut a) = (Vec::new(), Vec::new());
        let d = q.on_server_message(b'E', &mut b, &mut a).unwrap();
        assert!(!d.to_client && d.internal_error);
        let d = q.on_server_message(b'Z', &mut b, &mut a).unwrap();
        assert!(!d.to_client && !d.client_ready);
        let d = q.on_server_message(b'Z', &mut b, &mut a).unwrap();
        assert!(d.to_client && d.client_ready);
    }

    #[test]
    fn a_failed_parse_of_the_clients_statement_is_the_clients_error() {
        let mut q = ResponseQueue::default();
        q.push_internal(Request::Parse { cached: None });
        q.push_client(Request::Bind);
        q.push_client(Request::Execute { sql: None });
        q.push_client(Request::Sync);
        let (mut b, mut a) = (Vec::new(), Vec::new());
        let d = q.on_server_message(b'E', &mut b, &mut a).unwrap();
        assert!(d.to_client && !d.internal_error);
        assert!(!q.skipping_to_sync());
        let d = q.on_server_message(b'Z', &mut b, &mut a).unwrap();
        assert!(d.to_client && d.client_ready);
        assert!(q.is_settled());
    }

    #[test]
    fn copy_in_holds_the_connection() {
        let mut r = Run::new();
        r.q.push_client(Request::Query { sql: None });
        assert_eq!(r.feed(b"G"), ["G"]);
        assert!(r.q.in_copy_in() && !r.q.is_settled());
        assert_eq!(r.feed(b"CZ"), ["C", "Z"]);
        assert!(r.q.is_settled());
    }

    #[test]
    fn syncs_sent_into_a_copy_are_not_answered() {
        // tokio-postgres: Bind Execute Sync, then the data, then CopyDone Sync.
        let mut r = Run::new();
        r.q.push_client(Request::Bind);
        r.q.push_client(Request::Execute { sql: None });
        r.q.push_client(Request::Sync);
        assert_eq!(r.feed(b"2G"), ["2", "G"]);
        r.q.push_client(Request::Sync); // a Sync inside the data: ignored by the server
        r.q.client_copy_finished();
        r.q.push_client(Request::Sync);
        assert_eq!(r.feed(b"CZ"), ["C", "Z"]);
        assert!(r.q.is_settled());
    }

    #[test]
    fn copy_data_sent_before_the_servers_answer_ends_where_the_client_ended_it() {
        // asyncpg, pgx: the COPY, its data and CopyDone at once.
        let mut r = Run::new();
        r.q.push_client(Request::Query { sql: None });
        r.q.client_copy_finished();
        assert_eq!(r.feed(b"G"), ["G"]);
        assert!(!r.q.is_settled());
        r.q.push_client(Request::Query { sql: None });
        assert_eq!(r.feed(b"CZ"), ["C", "Z"]);
        assert_eq!(
            r.feed(b"TDCZ"),
            ["T", "D", "C", "Z"],
            "the next query is answered"
        );
        assert!(r.q.is_settled());

        // The extended protocol, everything pipelined: the Sync before CopyDone arrives in
        // copy mode, the one after it is answered.
        let mut r = Run::new();
        r.q.push_client(Request::Bind);
        r.q.push_client(Request::Execute { sql: None });
        r.q.push_client(Request::Sync);
        r.q.client_copy_finished();
        r.q.push_client(Request::Sync);
        assert_eq!(r.feed(b"2GCZ"), ["2", "G", "C", "Z"]);
        assert!(r.q.is_settled());
        assert_eq!(r.q.client_ready_owed(), 0);
    }

    #[test]
    fn copy_data_for_a_copy_that_failed_is_forgotten() {
        let mut r = Run::new();
        r.q.push_client(Request::Query { sql: None });
        r.q.client_copy_finished();
        assert_eq!(r.feed(b"EZ"), ["E", "Z"]);
        assert!(r.q.is_settled());
        // CopyDone with nothing in flight: the server ignores it, nothing is owed.
        r.q.client_copy_finished();
        assert!(r.q.is_settled());
    }

    #[test]
    fn describe_statement_takes_two_messages() {
        let mut r = Run::new();
        r.q.push_client(Request::Describe);
        r.q.push_client(Request::Sync);
        assert_eq!(r.feed(b"tTZ"), ["t", "T", "Z"]);
    }

    #[test]
    fn out_of_place_messages_are_errors() {
        let mut q = ResponseQueue::default();
        let (mut b, mut a) = (Vec::new(), Vec::new());
        assert!(q.on_server_message(b'D', &mut b, &mut a).is_err());
        assert!(q.on_server_message(b'A', &mut b, &mut a).unwrap().to_client);
        q.push_client(Request::Bind);
        assert!(q.on_server_message(b'1', &mut b, &mut a).is_err());
        assert!(q.on_server_message(b'Z', &mut b, &mut a).is_err());
    }

    #[test]
    fn synthetic_error_skips_client_messages() {
        let mut q = ResponseQueue::default();
        q.push_synthetic(Synthetic::Error(Box::new(PgError::error(
            SqlState::SYNTAX_ERROR,
            "x",
        ))));
        assert!(q.skipping_to_sync());
        let mut out = Vec::new();
        q.take_ready_synthetics(&mut out);
        assert_eq!(out.len(), 1);
        q.push_client(Request::Sync);
        assert_eq!(q.client_ready_owed(), 1);
    }

    /// The relay forwards what `front_passes` names without asking `on_server_message`: that
    /// is only right where `on_server_message` would leave the queue as it is and say nothing
    /// but "to the client", for every request that can be at the front.
    #[test]
    fn what_passes_without_classifying_is_what_classifying_would_only_forward() {
        let hash = StatementHash::of(b"SELECT 1", &[], None);
        let requests = [
            Request::Query { sql: None },
            Request::Query {
                sql: Some(Bytes::from_static(b"SET x = 1")),
            },
            Request::Execute { sql: None },
            Request::Parse { cached: None },
            Request::Parse { cached: Some(hash) },
            Request::Bind,
            Request::Describe,
            Request::Close,
            Request::Sync,
            Request::Probe(Probe::State),
            Request::Probe(Probe::Lsn { write_seq: 1 }),
            Request::Restore,
        ];
        let only_forward = Disposition {
            to_client: true,
            ..Disposition::default()
        };
        let mut passed = Vec::new();
        for request in requests {
            for internal in [false, true] {
                for message_tag in [tag::DATA_ROW, tag::ROW_DESCRIPTION] {
                    let mut q = ResponseQueue::default();
                    match internal {
                        true => q.push_internal(request.clone()),
                        false => q.push_client(request.clone()),
                    }
                    q.push_client(Request::Sync);
                    if !q.front_passes().includes(message_tag) {
                        continue;
                    }
                    passed.push((request.clone(), internal, message_tag as char));
                    let entries_before = q.entries.clone();
                    let (mut before, mut after) = (Vec::new(), Vec::new());
                    let d = q.on_server_message(message_tag, &mut before, &mut after);
                    assert_eq!(d, Ok(only_forward.clone()), "{request:?} {message_tag}");
                    assert!(before.is_empty() && after.is_empty());
                    assert_eq!(q.entries, entries_before, "{request:?} {message_tag}");
                }
            }
        }
        // And it does pass something: rows of a query or an Execute, a query's description.
        assert_eq!(passed.len(), 5, "{passed:?}");
    }
}
