//! The verdict on one statement text: where it may run, why, and what it does to the
//! session and the transaction.

/// Where a statement may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Only the primary.
    Primary,
    /// Any replica (or the primary).
    Replica,
    /// Wherever the session is: transaction control, SHOW, SET, DEALLOCATE...
    Any,
}

/// Session state that ties a client to one server connection (serialized by name: a pinned
/// session moving to a new pgherd process in an upgrade takes it along).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Pin {
    TempTable,
    AdvisoryLock,
    SqlPrepare,
    Listen,
    HoldCursor,
    /// `LOAD`: a library stays loaded in the server process, which no reset undoes; the
    /// server connection is closed when the client leaves.
    LoadedLibrary,
    /// Something the statement ran (a function, a `DO` block) left state pgherd found on
    /// the server afterwards: temporary objects, session locks, cursors, listeners.
    FoundState,
    /// A `dblink` connection, which lives in the server process where pgherd cannot see it
    /// and no reset closes it: the server connection is closed when the client leaves.
    Dblink,
}

impl Pin {
    pub fn describe(&self) -> &'static str {
        match self {
            Pin::TempTable => "a temporary object",
            Pin::AdvisoryLock => "a session-level advisory lock",
            Pin::SqlPrepare => "an SQL-level PREPARE",
            Pin::Listen => "LISTEN",
            Pin::HoldCursor => "a cursor WITH HOLD",
            Pin::LoadedLibrary => "LOAD of a library",
            Pin::FoundState => "session state created by a function or DO block",
            Pin::Dblink => "a dblink connection",
        }
    }

    /// The server connection cannot be reset for another client after this.
    pub fn forbids_reuse(&self) -> bool {
        matches!(self, Pin::LoadedLibrary | Pin::Dblink)
    }
}

/// What a statement may do to session state that pgherd does not follow statement by
/// statement (`SET`s are followed; pins are separate). Ordered: a list of statements takes
/// the largest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum SessionEffect {
    /// Nothing that outlives the transaction.
    #[default]
    None,
    /// May draw from sequences, which sets the session's `currval`/`lastval`: the server is
    /// given `DISCARD SEQUENCES` before another client uses it.
    Sequences,
    /// May change anything (it runs user code, `DO`, `CALL`, `set_config`, DDL, or could
    /// not be read): pgherd looks at the server's session state when the transaction ends.
    Unknown,
}

/// What a statement does to the transaction state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TxEffect {
    None,
    /// BEGIN / START TRANSACTION: `Some(true)` READ ONLY, `Some(false)` READ WRITE, `None`
    /// as `default_transaction_read_only` says.
    Begin {
        read_only: Option<bool>,
    },
    /// SET TRANSACTION READ ONLY inside a transaction.
    SetReadOnly,
    /// SET TRANSACTION READ WRITE inside a transaction.
    SetReadWrite,
    /// SET [SESSION] default_transaction_read_only; `Some(true)` = on.
    DefaultReadOnly(Option<bool>),
    /// COMMIT, END, ROLLBACK, ABORT.
    End,
}

/// What a statement does to `pgherd.shard`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ShardSetting {
    /// `SET pgherd.shard = value` (the value as written).
    To(String),
    /// `RESET pgherd.shard`, `SET pgherd.shard TO DEFAULT`, `RESET ALL`, `DISCARD ALL`.
    Reset,
    /// `SET LOCAL pgherd.shard`, which pgherd does not follow.
    Local,
}

/// The verdict on one query string (which may hold several statements).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Decision {
    pub target: Target,
    /// Why, in a sentence fragment: "INSERT writes", "calls volatile function nextval".
    pub reason: String,
    pub pin: Option<Pin>,
    pub tx: TxEffect,
    /// False when the decision depends on literal values (SET statements), so it must not be
    /// reused for another query of the same shape.
    pub cacheable: bool,
    /// `SET pgherd.route = ...` (or RESET: "auto"): pgherd's own routing setting.
    pub route_setting: Option<String>,
    /// `SET pgherd.shard = ...` (or RESET): the shard a sharded endpoint runs the session's
    /// statements on.
    pub shard_setting: Option<ShardSetting>,
    /// A function's or relation's facts were unknown, so the verdict may change once the
    /// catalog is loaded; not to be cached.
    pub needs_catalog: bool,
    /// `COPY ... FROM STDIN`: the server will wait for the client's data, so nothing may be
    /// queued behind it.
    pub copy_in: bool,
    pub session: SessionEffect,
    /// Changes the schema (DDL): what pgherd knows of the database's functions and
    /// relations must be read again once it commits.
    pub changes_catalog: bool,
    /// ROLLBACK, ROLLBACK TO SAVEPOINT, ABORT: undoes what the transaction changed, schema
    /// changes included.
    pub rolls_back: bool,
    /// Custom settings (`app.tenant_id`) the statement sets for the session with
    /// `set_config`: a probe of the session's state asks for their values, as PostgreSQL
    /// lists no placeholder settings.
    pub custom_settings: Vec<String>,
    /// Bind parameters (`$n`) passed as the name of a setting `set_config` sets for the
    /// session: the proxy reads those names from each Bind, for the same probe.
    pub custom_setting_params: Vec<u16>,
}

impl Decision {
    pub fn new(target: Target, reason: impl Into<String>) -> Self {
        Decision {
            target,
            reason: reason.into(),
            pin: None,
            tx: TxEffect::None,
            cacheable: true,
            route_setting: None,
            shard_setting: None,
            needs_catalog: false,
            copy_in: false,
            session: SessionEffect::None,
            changes_catalog: false,
            rolls_back: false,
            custom_settings: Vec::new(),
            custom_setting_params: Vec::new(),
        }
    }

    /// A text pgherd did not read: the primary runs it, and it may change anything.
    pub fn unread(reason: impl Into<String>) -> Self {
        Decision {
            session: SessionEffect::Unknown,
            cacheable: false,
            ..Decision::new(Target::Primary, reason)
        }
    }

    /// A schema change: it may change anything, and the catalog must be read again.
    pub(crate) fn ddl(target: Target, reason: impl Into<String>) -> Self {
        Decision {
            changes_catalog: true,
            session: SessionEffect::Unknown,
            ..Decision::new(target, reason)
        }
    }

    pub(crate) fn with_session(mut self, effect: SessionEffect) -> Self {
        self.session = self.session.max(effect);
        self
    }

    /// Combines the verdicts of several statements in one query: the strictest wins.
    pub(crate) fn merge(self, other: Decision) -> Decision {
        let rank = |t: Target| match t {
            Target::Any => 0,
            Target::Replica => 1,
            Target::Primary => 2,
        };
        let (mut winner, loser) = if rank(other.target) > rank(self.target) {
            (other, self)
        } else {
            (self, other)
        };
        winner.pin = winner.pin.or(loser.pin);
        winner.cacheable &= loser.cacheable;
        winner.needs_catalog |= loser.needs_catalog;
        winner.copy_in |= loser.copy_in;
        winner.session = winner.session.max(loser.session);
        winner.changes_catalog |= loser.changes_catalog;
        winner.rolls_back |= loser.rolls_back;
        winner.custom_settings.extend(loser.custom_settings);
        winner
            .custom_setting_params
            .extend(loser.custom_setting_params);
        if winner.tx == TxEffect::None {
            winner.tx = loser.tx;
        }
        winner.route_setting = winner.route_setting.or(loser.route_setting);
        winner.shard_setting = winner.shard_setting.or(loser.shard_setting);
        winner
    }
}
