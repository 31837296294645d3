//! A session's routing state: how its database and user route (`RoutingSetup`), what the
//! planner is told of the session, where its writes end (the LSN probes and the count that
//! makes them lazy), the request at the front of its input, and what a replica was sent and
//! may have to be sent elsewhere (`Replay`).

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use pgherd_config::{Balance, Consistency, Route};
use pgherd_route::balance::Lsn;
use pgherd_route::plan::{ReadNeeds, SessionRouting};
use pgherd_route::SessionEffect;

use super::params;
use super::HIGH_WATER_BYTES;
use crate::routing::{Routed, Router};

/// How a session's statements are routed, as configured for its database and user.
pub struct RoutingSetup {
    pub route: Route,
    pub consistency: Consistency,
    pub balance: Balance,
    pub primary_reads: bool,
    /// `None` in session mode: the client keeps one server, so nothing moves.
    pub router: Option<Arc<Router>>,
    /// The database's result cache, where the session may use it (not in session mode, nor
    /// on a sharded endpoint, nor with `[cache] enabled = false`).
    pub cache: Option<crate::result_cache::CacheUse>,
}

/// What a read asks of its node ([`ReadNeeds`]) under `config`'s lag limits and wait: the
/// session's balance policy and primary reads, the WAL position its last committed write
/// reached (read-your-writes; `None` under other consistency) and whether a write's end is
/// still unknown.
pub(crate) fn read_needs(
    config: &pgherd_config::Config,
    (balance, primary_reads): (Balance, bool),
    min_lsn: Option<Lsn>,
    write_unconfirmed: bool,
) -> ReadNeeds {
    ReadNeeds {
        balance,
        primary_reads,
        max_lag_bytes: config.routing.max_lag_bytes,
        max_lag_ms: config.routing.max_lag_ms,
        min_lsn,
        write_unconfirmed,
        may_wait: config.routing.read_your_writes_wait_ms > 0,
    }
}

/// What pgherd asks the primary after a session's write transaction: the position the
/// replicas must reach before that session reads from them.
pub(super) const LSN_PROBE_SQL: &[u8] = b"SELECT pg_catalog.pg_current_wal_insert_lsn()";
/// Writes without a read that could go to a replica after which a session's writes are no
/// longer probed (see `Routing::writes_since_replica_read`).
pub(super) const LAZY_PROBES_AFTER_WRITES: u32 = 8;
/// How often a read waiting for a replica to replay the session's write asks it, after its
/// first `REPLAY_QUICK_ASKS` questions (asked back to back).
pub(super) const REPLAY_POLL_INTERVAL: Duration = Duration::from_millis(1);
pub(super) const REPLAY_QUICK_ASKS: u32 = 4;
/// Times one request is moved to another node after the replica it was sent to failed.
pub(super) const MAX_REPLAYS: u8 = 3;

/// Client messages sent to a replica and not answered yet, kept so they can be sent elsewhere
/// if the replica fails, or refuses them as a standby must, before answering anything.
#[derive(Default)]
pub(super) struct Replay {
    pub(super) bytes: BytesMut,
    /// False once a message that cannot be repeated (closing a named statement, streamed
    /// COPY data) went out.
    pub(super) repeatable: bool,
    /// Named statements the request defined: forgotten before it is sent again, which
    /// defines them anew.
    pub(super) defined: Vec<Box<[u8]>>,
    /// A result of the request already reached the client (rows, a completion).
    pub(super) answered: bool,
    /// Answers that only acknowledge (ParseComplete, BindComplete, descriptions) already
    /// forwarded: the primary sends them again, and they are dropped there.
    pub(super) preliminaries: u32,
    /// The replica refused the request as a standby (an unlogged table, a write, a WAL
    /// function), or lacks what it names (not replayed yet): the rest of its answers are
    /// dropped and it runs on the primary.
    pub(super) refused: bool,
    pub(super) attempts: u8,
    /// A notice (or another message that answers nothing) of the server's already reached
    /// the client: the server was working on the request.
    pub(super) heard: bool,
}

impl Replay {
    /// Nothing sent is outstanding any more: start collecting afresh (a large buffer from a
    /// big request is not kept).
    pub(super) fn restart(&mut self) {
        self.bytes.clear();
        if self.bytes.capacity() > HIGH_WATER_BYTES {
            self.bytes = BytesMut::new();
        }
        self.repeatable = true;
        self.defined.clear();
        self.answered = false;
        self.preliminaries = 0;
        self.refused = false;
        self.heard = false;
    }
}

/// A session's routing state: what lasts between its requests, and the request under way's.
pub(super) struct Routing {
    /// All a parked session keeps of it.
    pub(super) lasting: LastingRouting,
    /// Statements that may write sent to the primary, counted; and the count the last LSN
    /// probe answered for. Reads must wait for a probe while `write_seq > probed_seq`
    /// ([`Self::write_unconfirmed`]).
    pub(super) write_seq: u64,
    pub(super) probed_seq: u64,
    /// What the probe in flight returned.
    pub(super) probe_lsn: Option<Lsn>,
    /// The decision for the statement at the front of the client's input, made to choose its
    /// node and reused when it is relayed.
    pub(super) front: Option<Routed>,
    /// The next client message starts a new request (after a Query or Sync).
    pub(super) at_unit_start: bool,
    pub(super) unit_begins: bool,
    pub(super) unit_ends: bool,
    pub(super) unit_copies_in: bool,
    /// The next request needs the primary but the lease is a replica: it waits until the
    /// replica owes nothing, then the session moves.
    pub(super) held: bool,
    /// The lease was just taken for the request at the front of the client's input, on the
    /// node its own routing chose: whether it must wait for another node has been answered.
    pub(super) lease_for_front: bool,
    pub(super) replay: Option<Box<Replay>>,
    /// A standby refused the request that is about to be sent again: it runs on the primary.
    pub(super) retry_on_primary: bool,
    /// The request runs on a replica because the client asked (`route = "replica"`, a hint):
    /// what the standby refuses is the client's error to see.
    pub(super) replica_asked: bool,
    /// Tables the transaction's statements show they write, dropped from the result cache
    /// when it ends.
    pub(super) tables_written: Vec<String>,
}

/// What lasts of a session's routing state between its requests: all a parked session keeps
/// of it (with whether a write's end is unknown). The rest of [`Routing`] is the request
/// under way's, and starts afresh from this.
pub(super) struct LastingRouting {
    pub(super) setup: RoutingSetup,
    /// What the planner is told of this session: the configured route and consistency,
    /// `SET pgherd.route`, and `default_transaction_read_only` as the session has it (from
    /// the startup packet, then as servers report it: a rolled-back SET is reported back).
    pub(super) session: SessionRouting,
    /// Session state (a temporary table, a session lock...) ties the client to its server.
    pub(super) pinned: Option<pgherd_route::Pin>,
    /// `standard_conforming_strings` as the session has it, followed as
    /// `default_transaction_read_only` is.
    pub(super) standard_conforming_strings: bool,
    /// What the statements run on the current server since its session state was last
    /// known may have done to it; an unknown effect is probed before the server goes back.
    pub(super) effect: SessionEffect,
    /// A statement that changes the schema ran: the catalog is read again when the
    /// transaction ends.
    pub(super) catalog_changed: bool,
    /// The transaction that changed the schema is ending: every session's reads go to the
    /// primary until the LSN probe says where it ends.
    pub(super) schema_change: Option<crate::schema_changes::SchemaChangeEnding>,
    /// The WAL position of the session's last write known to be committed.
    pub(super) min_lsn: Lsn,
    /// Statements that may write since the session last sent a read that could go to a
    /// replica. From `LAZY_PROBES_AFTER_WRITES` on, its writes are not followed by an LSN probe
    /// (TPC-B, a loader: nothing would use the answer); the next such read runs on the primary,
    /// takes the probe along and starts the count again. A session routed to the primary
    /// starts there: its reads go to a replica only by a hint.
    pub(super) writes_since_replica_read: u32,
    /// The session asked for the result cache: its writes are followed to their end (as
    /// read-your-writes does), so that it is served only once they are decoded.
    pub(super) cache_active: bool,
}

impl Routing {
    pub(super) fn new(setup: RoutingSetup, flags: params::StartupFlags) -> Self {
        let configured_route = setup.route;
        let lasting = LastingRouting {
            session: SessionRouting {
                splitting: setup.router.is_some(),
                configured: setup.route,
                override_route: None,
                consistency: setup.consistency,
                default_read_only: flags.default_transaction_read_only,
            },
            setup,
            pinned: None,
            standard_conforming_strings: flags.standard_conforming_strings,
            effect: SessionEffect::None,
            catalog_changed: false,
            schema_change: None,
            min_lsn: 0,
            writes_since_replica_read: match configured_route {
                Route::Primary => LAZY_PROBES_AFTER_WRITES,
                _ => 0,
            },
            cache_active: false,
        };
        Routing::from_lasting(lasting, false)
    }

    /// The routing state as it is between requests, from what lasts of it and whether a
    /// write's end was still unknown (the counts themselves matter only while a probe is in
    /// flight).
    pub(super) fn from_lasting(lasting: LastingRouting, write_unconfirmed: bool) -> Self {
        let mut routing = Routing {
            lasting,
            write_seq: 0,
            probed_seq: 0,
            probe_lsn: None,
            front: None,
            at_unit_start: true,
            unit_begins: false,
            unit_ends: false,
            unit_copies_in: false,
            held: false,
            lease_for_front: false,
            replay: None,
            retry_on_primary: false,
            replica_asked: false,
            tables_written: Vec::new(),
        };
        if write_unconfirmed {
            routing.mark_write_unconfirmed();
        }
        routing
    }

    /// A write was sent that no LSN probe has answered for: reads must not use a replica on
    /// the strength of what the session last knew.
    pub(super) fn write_unconfirmed(&self) -> bool {
        self.write_seq > self.probed_seq
    }

    /// Marks a write whose end this session never saw (it moved or parked with one
    /// unanswered): the primary serves reads until the next write is probed.
    pub(super) fn mark_write_unconfirmed(&mut self) {
        self.write_seq = self.probed_seq + 1;
    }

    /// Whether nothing of a request is under way in the routing state: what [`Self::lasting`]
    /// drops then is only the last request's scratch.
    pub(super) fn at_rest(&self) -> bool {
        self.at_unit_start
            && !self.unit_copies_in
            && !self.held
            && !self.retry_on_primary
            && self.probe_lsn.is_none()
            && self.tables_written.is_empty()
    }

    /// What lasts of the routing state (see [`Self::at_rest`]), and whether a write's end is
    /// still unknown.
    pub(super) fn into_lasting(self) -> (LastingRouting, bool) {
        let write_unconfirmed = self.write_unconfirmed();
        (self.lasting, write_unconfirmed)
    }

    pub(super) fn read_your_writes(&self) -> bool {
        self.lasting.session.read_your_writes()
    }

    /// The session's reads follow its writes closely enough that each write's end is asked
    /// for at once, in the same round trip, so that the next read may use a replica.
    pub(super) fn probes_writes(&self) -> bool {
        self.lasting.writes_since_replica_read < LAZY_PROBES_AFTER_WRITES
    }
}
