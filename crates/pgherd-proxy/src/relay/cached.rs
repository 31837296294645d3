//! The result cache in a session: simple queries and extended-protocol requests
//! (`extended_request.rs`: one statement run on the unnamed portal, keyed with its parameter
//! values and formats) answered from the cache between transactions, and the answers of the
//! statements asked to be cached kept on their way to the client.
//!
//! An answer is served only between transactions, to a session holding no server and no
//! state pgherd could not follow, while the database's invalidation stream may serve
//! (`pgherd_cache::gate`) and has decoded the session's own last write. It is kept only if
//! it is whole and plain (a row description, rows, a completion: no error, notice or
//! setting change), it ends outside a transaction, and no table it read changed since it
//! was sent (`pgherd_cache::store`). A replica's answer is kept only if the replica had
//! replayed everything the stream had decoded when it was sent.

use pgherd_cache::FillTicket;

use super::client_input::statement;
use super::extended_request::extended_request;
use super::*;

/// What a statement's text carries when it asks for the cache (or `pgherd:nocache`, which
/// does not contain it).
const CACHE_HINT: &[u8] = b"pgherd:cache";

/// Whether [`CACHE_HINT`] is anywhere in `text` (a comment's, or a literal's: a request with
/// it is looked at further, one without it is not asked for unless the config asks for
/// every read or for statements by pattern).
pub(super) fn mentions_cache_hint(text: &[u8]) -> bool {
    static FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(CACHE_HINT));
    FINDER.find(text).is_some()
}

/// Whether the statement the request at the front of `input` runs mentions the cache hint,
/// read from the request's first message alone: a Parse's own text, the unnamed statement's
/// for a Bind of it, or what a named statement found once when it was prepared. A request
/// whose first message tells nothing is read whole (true). Without the hint, and without a
/// config asking for every read or for statements by pattern, a request is not asked for,
/// and the rest of it (Describe, Execute, Sync) need not be read at all.
fn front_statement_mentions_cache_hint(
    input: &[u8],
    statements: &Option<Box<ClientStatements>>,
    unnamed: Option<&UnnamedStatement>,
) -> bool {
    // Its size was checked against the limit when its header was first read.
    let Ok(Some((header, body))) = pgherd_wire::frame::split_message(input, usize::MAX) else {
        return true;
    };
    match header.tag {
        ftag::PARSE => frontend::Parse::parse(body).is_ok_and(|p| mentions_cache_hint(p.query)),
        ftag::BIND => match frontend::Bind::parse(body) {
            Ok(bind) if bind.statement.is_empty() => unnamed
                .filter(|u| u.present)
                .is_some_and(|u| mentions_cache_hint(&u.query)),
            Ok(bind) => statements
                .as_ref()
                .and_then(|s| s.find(bind.statement))
                .is_some_and(|def| def.mentions_cache_hint),
            Err(_) => true,
        },
        _ => true,
    }
}

/// An extended-protocol request asked to be cached that the cache did not answer: its key,
/// for its answer to be kept on its way. Its first message takes it, and only that message
/// (the same bytes): the key was made of the request's bytes, not of what follows it.
pub(super) struct CacheCandidate {
    key: Vec<u8>,
    text: Vec<u8>,
    first_message: Vec<u8>,
}

/// An answer on its way from the server that may be kept.
pub(super) struct Fill {
    key: Vec<u8>,
    tables: Arc<[String]>,
    ticket: FillTicket,
    answer: BytesMut,
    /// `[cache] max_entry_bytes` when it began: a larger answer is not kept.
    max_entry_bytes: usize,
    /// Something in it is not to be repeated to another client (or it grew too large).
    spoiled: bool,
}

impl Session {
    /// The key of a simple query's answer: who asks, with which result-changing settings
    /// ([`Session::cache_key_prefix`]), what exact text. (The database is the cache's own.)
    fn cache_key(&self, sql: &[u8]) -> Vec<u8> {
        let mut key = self.cache_key_prefix(sql.len() + 1);
        key.push(0);
        key.extend_from_slice(sql);
        key
    }

    /// Who asks, with which result-changing settings; room for `more` bytes after.
    fn cache_key_prefix(&self, more: usize) -> Vec<u8> {
        let mut key = Vec::with_capacity(more + 64);
        key.extend_from_slice(self.shared.user().as_bytes());
        key.push(0);
        self.params.write_cache_key(&mut key);
        key
    }

    /// The session may be served from the cache now: between transactions, holding
    /// nothing, with no state pgherd did not follow and every own write's end known.
    fn may_use_cache_now(&self) -> bool {
        self.client_tx == TxStatus::Idle
            && self.lease.is_none()
            && !self.untracked_change
            && self.routing.lasting.pinned.is_none()
            && !self.routing.write_unconfirmed()
            && self.queue.is_settled()
    }

    /// Answers the whole simple query at the front of the client's input from the cache, if
    /// it holds an answer it may serve; returns whether it did.
    pub(super) fn answer_from_cache(&mut self, total_len: usize) -> Result<bool, Disconnect> {
        let Some(cache) = self.routing.lasting.setup.cache.as_ref() else {
            return Ok(false);
        };
        if !cache.db.ever_stored.load(Ordering::Relaxed) || !self.may_use_cache_now() {
            return Ok(false);
        }
        let sql = frontend::Query::parse(&self.client_in[HEADER_BYTES..total_len])?.sql;
        let key = self.cache_key(sql);
        let min_lsn = self.routing.lasting.min_lsn;
        let Some(answer) = cached_answer(&self.app, &mut self.seen, cache, min_lsn, &key) else {
            return Ok(false);
        };
        self.client_in.advance(total_len);
        self.client_out.extend_from_slice(&answer);
        backend::encode_ready_for_query(&mut self.client_out, TxStatus::Idle);
        Ok(true)
    }

    /// Answers the extended-protocol request at the front of the client's input from the
    /// cache if it may (returns whether it did); otherwise, if the request may be asked to
    /// be cached, leaves its key for its answer to be kept.
    pub(super) fn answer_extended_from_cache(&mut self) -> Result<bool, Disconnect> {
        self.cache_candidate = None;
        let Some(cache) = self.routing.lasting.setup.cache.as_ref() else {
            return Ok(false);
        };
        if !self.may_use_cache_now() {
            return Ok(false);
        }
        // Most requests are not asked for: they leave here, before the rest is read.
        let may_be_asked = cache.every_read
            || cache.statement_patterns
            || front_statement_mentions_cache_hint(
                &self.client_in,
                &self.statements,
                self.unnamed.as_deref(),
            );
        if !may_be_asked {
            return Ok(false);
        }
        let Some(request) = extended_request(&self.client_in) else {
            return Ok(false);
        };
        let named;
        let (text, param_types): (&[u8], &[u8]) = match request.parse {
            Some(parsed) => parsed,
            None if request.statement.is_empty() => {
                match self.unnamed.as_ref().filter(|u| u.present) {
                    Some(u) => (&u.query, &u.param_types),
                    None => return Ok(false),
                }
            }
            None => match statement(&self.statements, request.statement) {
                Ok(def) => {
                    named = def;
                    (&named.query, &named.param_types)
                }
                Err(_) => return Ok(false),
            },
        };
        let key = request.key(&self.cache_key_prefix(0), text, param_types);
        let answer = if cache.db.ever_stored.load(Ordering::Relaxed) {
            let min_lsn = self.routing.lasting.min_lsn;
            cached_answer(&self.app, &mut self.seen, cache, min_lsn, &key)
        } else {
            None
        };
        let Some(answer) = answer else {
            let first_len = 1 + u32::from_be_bytes([
                self.client_in[1],
                self.client_in[2],
                self.client_in[3],
                self.client_in[4],
            ]) as usize;
            self.cache_candidate = Some(Box::new(CacheCandidate {
                key,
                text: text.to_vec(),
                first_message: self.client_in[..first_len].to_vec(),
            }));
            return Ok(false);
        };
        let parsed = request.parse.map(|(q, t)| (q.to_vec(), t.to_vec()));
        let len = request.len;
        self.client_in.advance(len);
        if let Some((query, param_types)) = parsed {
            // As the server would have it: the request's statement is the unnamed one now
            // (its route decided again when it is used).
            let unnamed = self.unnamed.get_or_insert_with(Default::default);
            unnamed.query = query;
            unnamed.param_types = param_types;
            unnamed.present = true;
            unnamed.routed = None;
        }
        self.client_out.extend_from_slice(&answer);
        backend::encode_ready_for_query(&mut self.client_out, TxStatus::Idle);
        Ok(true)
    }

    /// A Parse or Bind (`message`) is relayed: if it is the first message of the request the
    /// idle phase found may be asked to be cached and did not answer, the request's answer
    /// is kept on its way if it may be.
    pub(super) fn consider_candidate_fill(&mut self, message: &[u8], routed: &Routed) {
        let Some(candidate) = self.cache_candidate.take() else {
            return;
        };
        if candidate.first_message == message {
            self.consider_fill(&candidate.text, routed, Some(candidate.key));
        }
    }

    /// A simple query (or an extended-protocol request, with its `key`) is about to be sent:
    /// if it is asked to be cached and may be, its answer will be kept on its way to the
    /// client.
    pub(super) fn consider_fill(&mut self, sql: &[u8], routed: &Routed, key: Option<Vec<u8>>) {
        let Some(cache) = self.routing.lasting.setup.cache.as_ref() else {
            return;
        };
        // Most statements are not asked for: they leave before the config is loaded.
        if routed.cache == Some(false)
            || (routed.cache.is_none() && !cache.every_read && !cache.statement_patterns)
            || self.fill.is_some()
        {
            return;
        }
        let config = self.seen.config.load();
        let asked = routed.cache == Some(true)
            || cache.every_read
            || std::str::from_utf8(sql).is_ok_and(|text| config.cache.statement_asked_for(text));
        if !asked || !config.cache.enabled {
            return;
        }
        let max_entry_bytes = config.cache.max_entry_bytes as usize;
        // From now on the session's writes are followed to their end, as read-your-writes
        // does, so that its own writes are known to be decoded before it is served.
        self.routing.lasting.cache_active = true;
        let db = cache.db.clone();
        crate::result_cache::start_following(&self.app, &db);
        let Some(lease) = self.lease.as_ref() else {
            return;
        };
        let between_transactions = self.client_tx == TxStatus::Idle
            && lease.conn.tx_status == TxStatus::Idle
            && !self.queue.has_client_requests()
            && !self.untracked_change
            && self.routing.lasting.pinned.is_none();
        if !between_transactions {
            return;
        }
        let Some(router) = self.routing.lasting.setup.router.as_ref() else {
            return;
        };
        let tables =
            match router.cache_verdict(sql, self.routing.lasting.standard_conforming_strings) {
                Ok(tables) => tables,
                Err(why) => {
                    tracing::debug!(client = self.shared.id, reason = %why, "statement not cached");
                    return;
                }
            };
        let replica_lsn = lease.on_replica.then(|| lease.node.lsn());
        let ticket = {
            let mut state = db.state.lock();
            state.store.note_miss();
            // A replica that has not replayed every decoded commit could answer older
            // than an invalidation already done. (A commit is decoded at its record's end,
            // and a replica's replay position is the end of the last record it replayed.)
            if replica_lsn.is_some_and(|replayed| replayed < state.feed.decoded_lsn())
                || !state.feed.is_live()
            {
                return;
            }
            state.store.ticket()
        };
        self.fill = Some(Box::new(Fill {
            key: key.unwrap_or_else(|| self.cache_key(sql)),
            tables,
            ticket,
            answer: BytesMut::new(),
            max_entry_bytes,
            spoiled: false,
        }));
    }

    /// A statement that writes is sent to the primary: the tables its text shows it writes
    /// lose their cached answers as soon as its transaction ends, before the WAL says so.
    pub(super) fn note_written_tables(&mut self, sql: &[u8], routed: &Routed) {
        if !self.writes_matter_to_cache(routed) {
            return;
        }
        let Some(router) = self.routing.lasting.setup.router.as_ref() else {
            return;
        };
        for table in router
            .written_tables(sql, self.routing.lasting.standard_conforming_strings)
            .iter()
        {
            if !self.routing.tables_written.contains(table) {
                self.routing.tables_written.push(table.clone());
            }
        }
    }

    /// Whether a statement routed so may write tables whose cached answers a commit would
    /// leave stale. Until a statement of the database asked for the cache nothing is kept or
    /// on its way: most sessions never parse their writes.
    pub(super) fn writes_matter_to_cache(&self, routed: &Routed) -> bool {
        routed.decision.target == RouteTarget::Primary
            && self
                .routing
                .lasting
                .setup
                .cache
                .as_ref()
                .is_some_and(|cache| cache.db.following.started.load(Ordering::Relaxed))
    }

    /// The transaction ended (committed or not): what it wrote is dropped from the cache,
    /// and answers of those tables on their way now are not kept.
    pub(super) fn drop_written_tables(&mut self) {
        if self.routing.tables_written.is_empty() {
            return;
        }
        let tables = std::mem::take(&mut self.routing.tables_written);
        if let Some(cache) = self.routing.lasting.setup.cache.as_ref() {
            let mut state = cache.db.state.lock();
            for table in &tables {
                state.store.invalidate_table(table);
            }
        }
    }

    /// A whole server message forwarded to the client while an answer is being kept.
    pub(super) fn fill_message(&mut self, tag: u8, message: &[u8]) {
        let Some(fill) = self.fill.as_mut() else {
            return;
        };
        if fill.spoiled {
            return;
        }
        match tag {
            btag::PARSE_COMPLETE
            | btag::BIND_COMPLETE
            | btag::PARAMETER_DESCRIPTION
            | btag::ROW_DESCRIPTION
            | btag::DATA_ROW
            | btag::COMMAND_COMPLETE
                if fill.answer.len() + message.len() <= fill.max_entry_bytes =>
            {
                fill.answer.extend_from_slice(message)
            }
            _ => {
                fill.spoiled = true;
                fill.answer = BytesMut::new();
            }
        }
    }

    /// Part of a message streamed to the client (too large to keep whole): not kept.
    pub(super) fn spoil_fill(&mut self) {
        if let Some(fill) = self.fill.as_mut() {
            fill.spoiled = true;
            fill.answer = BytesMut::new();
        }
    }

    /// The kept answer's request ended with `status`: store it if it may be.
    pub(super) fn finish_fill(&mut self, status: TxStatus) {
        let Some(fill) = self.fill.take() else {
            return;
        };
        let Some(cache) = self.routing.lasting.setup.cache.as_ref() else {
            return;
        };
        if fill.spoiled || status != TxStatus::Idle || self.untracked_change {
            return;
        }
        let db = cache.db.clone();
        let now_ms = db.now_ms();
        let outcome = db.state.lock().store.insert(
            &fill.key,
            fill.answer.freeze(),
            &fill.tables,
            fill.ticket,
            now_ms,
        );
        if outcome == pgherd_cache::Stored::Stored {
            db.ever_stored.store(true, Ordering::Relaxed);
        }
        tracing::trace!(
            client = self.shared.id,
            ?outcome,
            "answer offered to the result cache"
        );
    }
}

/// The answer kept under `key`, if the cache may serve now a session whose reads must see
/// `min_lsn`. Takes the session's parts, not the session: its callers hold borrows of others
/// (the request's text).
fn cached_answer(
    app: &App,
    seen: &mut Seen,
    cache: &crate::result_cache::CacheUse,
    min_lsn: Lsn,
    key: &[u8],
) -> Option<Bytes> {
    let limits = crate::result_cache::gate_limits_of(&seen.config.load().cache);
    let writer = app.nodes.snapshot_from(&mut seen.nodes).writer();
    if !cache.db.follows(writer.as_deref()) {
        return None;
    }
    let primary_lsn = writer.map_or(0, |n| n.lsn());
    let now_ms = cache.db.now_ms();
    let mut state = cache.db.state.lock();
    let served = state.feed.may_serve(now_ms, min_lsn, primary_lsn, limits);
    match served {
        Ok(()) => state.store.get(key, now_ms),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{front_statement_mentions_cache_hint, mentions_cache_hint};
    use crate::relay::statements::{ClientStatements, StatementDef};
    use crate::relay::UnnamedStatement;
    use bytes::BytesMut;
    use pgherd_wire::frontend;

    #[test]
    fn the_cache_hint_is_found_anywhere_and_only_whole() {
        assert!(mentions_cache_hint(b"/* pgherd:cache */ SELECT 1"));
        assert!(mentions_cache_hint(b"SELECT 1 -- pgherd:cache"));
        assert!(mentions_cache_hint(b"pgherd:cache"));
        assert!(!mentions_cache_hint(b"/* pgherd:nocache */ SELECT 1"));
        assert!(!mentions_cache_hint(b"/* pgherd:cach */ SELECT 1"));
        assert!(!mentions_cache_hint(b""));
    }

    #[test]
    fn a_request_is_asked_for_only_if_its_statement_mentions_the_hint() {
        let mut statements = ClientStatements::default();
        let hinted = StatementDef::new(b"/* pgherd:cache */ SELECT $1", b"", None);
        let plain = StatementDef::new(b"SELECT $1", b"", None);
        statements.define(b"hinted", hinted).unwrap();
        statements.define(b"plain", plain).unwrap();
        let statements = Some(Box::new(statements));
        let request = |first: &dyn Fn(&mut BytesMut)| {
            let mut input = BytesMut::new();
            first(&mut input);
            frontend::encode_execute(&mut input, b"", 0).unwrap();
            frontend::encode_sync(&mut input);
            input
        };
        let bind = |name: &'static [u8]| {
            request(&move |b: &mut BytesMut| {
                frontend::encode_bind(b, b"", name, &[0, 0, 0, 0, 0, 0]).unwrap()
            })
        };
        let parse = |text: &'static [u8]| {
            request(&move |b: &mut BytesMut| frontend::encode_parse(b, b"", text, &[0, 0]).unwrap())
        };
        let unnamed = |text: &[u8]| UnnamedStatement {
            query: text.to_vec(),
            present: true,
            ..Default::default()
        };
        let asked = |input: &[u8], unnamed: Option<&UnnamedStatement>| {
            front_statement_mentions_cache_hint(input, &statements, unnamed)
        };
        // A named statement: as its text was found when it was prepared.
        assert!(asked(&bind(b"hinted"), None));
        assert!(!asked(&bind(b"plain"), None));
        assert!(!asked(&bind(b"unknown"), None));
        assert!(!front_statement_mentions_cache_hint(
            &bind(b"plain"),
            &None,
            None
        ));
        // The unnamed statement: its text now, if the client prepared one.
        let hinted_unnamed = unnamed(b"SELECT 1 -- pgherd:cache");
        assert!(asked(&bind(b""), Some(&hinted_unnamed)));
        assert!(!asked(&bind(b""), Some(&unnamed(b"SELECT 1"))));
        assert!(!asked(&bind(b""), None));
        // A Parse: its own text.
        assert!(asked(&parse(b"/* pgherd:cache */ SELECT 1"), None));
        assert!(!asked(&parse(b"SELECT 1"), None));
        // What the first message cannot tell is read whole.
        let whole = bind(b"plain");
        assert!(asked(&whole[..8], None), "a Bind not whole yet");
        assert!(asked(&[], None));
    }
}
