//! Where each request runs: the per-database [`Router`] turns a statement into a routing
//! decision (with `pgherd-route`'s lexer and classifier, a cache keyed by the statement's text
//! with literals blanked, and what the database's catalog says about its functions and
//! relations).
//!
//! Invariant: a statement pgherd cannot prove to be a read runs on the primary, and one it
//! cannot prove harmless to the session gets its session checked. A cache hit is only ever
//! the decision for the same token stream up to literal values: the key is the whole
//! normalised text, compared exactly, from a lexer that reads strings as the server does.

use std::cell::RefCell;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use pgherd_route::catalog::{Persistence, RelationRow, Snapshot, SnapshotBuilder};
use pgherd_route::{
    classify, lex, lex_with_spans, Decision, HintError, Lexed, Route, ShapeMemo, ShardSetting,
    Target, SHARD_SETTING,
};
use pgherd_wire::{PgError, SqlState};
use tokio::sync::Notify;

use crate::app::App;
use crate::decisions::{remember, Decisions, KeyMap};

pub use pgherd_route::Routed;

/// The catalog is read again at least this often, for changes made outside pgherd.
const CATALOG_REFRESH_INTERVAL: Duration = Duration::from_secs(60);
/// And at most this often when statements name what it does not know (temporary tables do,
/// all the time)...
const CATALOG_RELOAD_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// ... or this often after schema changes committed: on a sharded endpoint the statement after
/// a session's schema change waits for the next reading (a migration pays it for each).
const SCHEMA_CHANGE_RELOAD_MIN_INTERVAL: Duration = Duration::from_millis(50);

/// Functions and whether they are user code: written in SQL or a procedural language, or an
/// aggregate (its support functions may be), and not PostgreSQL's own.
const FUNCTIONS_SQL: &str = "\
SELECT lower(p.proname), bool_or(p.provolatile = 'v'), \
       bool_or(p.oid >= 16384 AND (l.lanname NOT IN ('internal', 'c') OR p.prokind = 'a')) \
FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang GROUP BY 1";

/// User code that runs without a function call in the text: casts and domain checks of
/// types, operators.
const CODE_TYPES_SQL: &str = "\
WITH user_fn AS ( \
  SELECT p.oid FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang \
  WHERE p.oid >= 16384 AND (l.lanname NOT IN ('internal', 'c') OR p.prokind = 'a')) \
SELECT 't', t.typname FROM pg_catalog.pg_type t WHERE t.typtype = 'd' AND EXISTS ( \
  SELECT 1 FROM pg_catalog.pg_constraint c JOIN pg_catalog.pg_depend d \
    ON d.classid = 'pg_catalog.pg_constraint'::regclass AND d.objid = c.oid \
    AND d.refclassid = 'pg_catalog.pg_proc'::regclass \
  WHERE c.contypid = t.oid AND d.refobjid IN (SELECT oid FROM user_fn)) \
UNION SELECT 't', t.typname FROM pg_catalog.pg_cast c JOIN pg_catalog.pg_type t \
  ON t.oid IN (c.castsource, c.casttarget) WHERE c.castfunc IN (SELECT oid FROM user_fn) \
UNION SELECT 'o', o.oprname FROM pg_catalog.pg_operator o WHERE o.oprcode::oid IN (SELECT oid FROM user_fn)";

/// Bodies of user functions that may set custom settings, and definitions of views that
/// call `set_config` (found by the function's id in the view's stored query tree).
const FUNCTION_SOURCES_SQL: &str = "\
SELECT p.prosrc FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang \
WHERE p.oid >= 16384 AND l.lanname NOT IN ('internal', 'c') AND p.prosrc ~* 'set_config|\\mset\\M' \
UNION ALL SELECT pg_catalog.pg_get_viewdef(r.ev_class) FROM pg_catalog.pg_rewrite r \
WHERE r.rulename = '_RETURN' AND pg_catalog.strpos(r.ev_action::text, \
  ':funcid ' || 'pg_catalog.set_config(text,text,boolean)'::pg_catalog.regprocedure::oid || ' ') > 0";

/// Relations with their own facts: which run user code when touched (user triggers, rules
/// other than a view's, and policies, defaults, checks and index expressions that call user
/// functions; views that call a built-in function leaving session state behind, whose calls
/// PostgreSQL records in no dependency but in the view's stored query tree), which draw from
/// sequences (defaults on a sequence, identity columns).
static RELATIONS_SQL: LazyLock<String> = LazyLock::new(|| {
    let session_functions: Vec<String> = pgherd_route::leaving_session_state()
        .map(|name| format!("'{name}'"))
        .collect();
    RELATIONS_SQL_TEMPLATE.replace("SESSION_FUNCTIONS", &session_functions.join(", "))
});

const RELATIONS_SQL_TEMPLATE: &str = "\
WITH user_fn AS ( \
  SELECT p.oid FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang \
  WHERE p.oid >= 16384 AND (l.lanname NOT IN ('internal', 'c') OR p.prokind = 'a')), \
session_fn AS ( \
  SELECT ':funcid ' || p.oid || ' ' AS node FROM pg_catalog.pg_proc p \
  WHERE p.proname IN (SESSION_FUNCTIONS)), \
uses_fn AS ( \
  SELECT d.classid, d.objid FROM pg_catalog.pg_depend d \
  WHERE d.refclassid = 'pg_catalog.pg_proc'::regclass AND d.refobjid IN (SELECT oid FROM user_fn)), \
code AS ( \
  SELECT t.tgrelid AS rel FROM pg_catalog.pg_trigger t \
    WHERE NOT t.tgisinternal AND t.tgfoid IN (SELECT oid FROM user_fn) \
  UNION SELECT r.ev_class FROM pg_catalog.pg_rewrite r WHERE r.rulename <> '_RETURN' \
  UNION SELECT r.ev_class FROM pg_catalog.pg_rewrite r JOIN session_fn f \
    ON pg_catalog.strpos(r.ev_action::text, f.node) > 0 \
  UNION SELECT r.ev_class FROM pg_catalog.pg_rewrite r JOIN uses_fn u \
    ON u.classid = 'pg_catalog.pg_rewrite'::regclass AND u.objid = r.oid \
  UNION SELECT p.polrelid FROM pg_catalog.pg_policy p JOIN uses_fn u \
    ON u.classid = 'pg_catalog.pg_policy'::regclass AND u.objid = p.oid \
  UNION SELECT a.adrelid FROM pg_catalog.pg_attrdef a JOIN uses_fn u \
    ON u.classid = 'pg_catalog.pg_attrdef'::regclass AND u.objid = a.oid \
  UNION SELECT c.conrelid FROM pg_catalog.pg_constraint c JOIN uses_fn u \
    ON u.classid = 'pg_catalog.pg_constraint'::regclass AND u.objid = c.oid WHERE c.conrelid <> 0 \
  UNION SELECT i.indrelid FROM pg_catalog.pg_index i JOIN uses_fn u \
    ON u.classid = 'pg_catalog.pg_class'::regclass AND u.objid = i.indexrelid \
  UNION SELECT a.attrelid FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_constraint c \
    ON c.contypid = a.atttypid JOIN uses_fn u \
    ON u.classid = 'pg_catalog.pg_constraint'::regclass AND u.objid = c.oid \
    WHERE NOT a.attisdropped), \
seq AS ( \
  SELECT a.adrelid AS rel FROM pg_catalog.pg_attrdef a JOIN pg_catalog.pg_depend d \
    ON d.classid = 'pg_catalog.pg_attrdef'::regclass AND d.objid = a.oid \
    AND d.refclassid = 'pg_catalog.pg_class'::regclass \
    JOIN pg_catalog.pg_class s ON s.oid = d.refobjid AND s.relkind = 'S' \
  UNION SELECT attrelid FROM pg_catalog.pg_attribute WHERE attidentity <> '' AND NOT attisdropped) \
SELECT c.oid, c.relname, c.relpersistence, c.oid IN (SELECT rel FROM code), \
       c.oid IN (SELECT rel FROM seq), \
       c.relkind IN ('r', 'p') AND NOT c.relrowsecurity \
         AND n.nspname NOT IN ('pg_catalog', 'information_schema') \
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f')";

/// Every column default and identity column of the database's tables (for writing all
/// copies of a table every shard holds alike): relation, column, default expression (NULL for
/// an identity).
const DEFAULTS_SQL: &str = "\
SELECT c.relname, a.attname, pg_catalog.pg_get_expr(d.adbin, d.adrelid) \
FROM pg_catalog.pg_attrdef d JOIN pg_catalog.pg_attribute a \
  ON a.attrelid = d.adrelid AND a.attnum = d.adnum AND NOT a.attisdropped AND a.attgenerated = '' \
JOIN pg_catalog.pg_class c ON c.oid = d.adrelid \
UNION ALL SELECT c.relname, a.attname, NULL FROM pg_catalog.pg_attribute a \
JOIN pg_catalog.pg_class c ON c.oid = a.attrelid WHERE a.attidentity <> '' AND NOT a.attisdropped \
UNION ALL SELECT c.relname, a.attname, \
  CASE WHEN b.typtype = 'd' THEN NULL ELSE pg_catalog.pg_get_expr(t.typdefaultbin, 0) END \
FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_class c ON c.oid = a.attrelid \
JOIN pg_catalog.pg_type t ON t.oid = a.atttypid AND t.typtype = 'd' \
JOIN pg_catalog.pg_type b ON b.oid = t.typbasetype \
WHERE NOT a.atthasdef AND NOT a.attisdropped AND a.attnum > 0 \
  AND (t.typdefaultbin IS NOT NULL OR b.typtype = 'd')";

/// Relations that are not tables a write reaches alike on every shard.
const NOT_TABLES_SQL: &str =
    "SELECT relname FROM pg_catalog.pg_class WHERE relkind IN ('v', 'm', 'f')";

/// What touching one relation may touch too: a view and what it reads (`v`), a partitioned
/// table and its partitions or a parent and its inheritance children (`i`), a referenced
/// table and the tables its deletes and updates cascade to (`f`).
const REACHES_SQL: &str = "\
SELECT r.ev_class, d.refobjid, 'v' FROM pg_catalog.pg_rewrite r JOIN pg_catalog.pg_depend d \
  ON d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.objid = r.oid \
  AND d.refclassid = 'pg_catalog.pg_class'::regclass WHERE d.refobjid <> r.ev_class \
UNION SELECT inhparent, inhrelid, 'i' FROM pg_catalog.pg_inherits \
UNION SELECT confrelid, conrelid, 'f' FROM pg_catalog.pg_constraint WHERE contype = 'f'";

pub struct Router {
    server_dbname: String,
    catalog: ArcSwap<Snapshot>,
    /// Normalised statement text → decision. Cleared when full or when the catalog changes.
    decisions: Decisions,
    /// Entries the decision cache and the result cache's memos hold at most.
    capacity: usize,
    max_parse_bytes: usize,
    /// Wakes the catalog task to read the catalog again (a statement named something it
    /// does not know, or a schema change committed).
    reload: Notify,
    /// Counts what changes decisions: catalog loads, statements a standby refused. A decision
    /// kept outside the cache (a prepared statement's) is made again when it moved.
    generation: std::sync::atomic::AtomicU64,
    /// Catalog readings begun, and the number of the last one finished: a reading that began
    /// after a schema change committed sees it.
    readings_begun: std::sync::atomic::AtomicU64,
    last_reading: std::sync::atomic::AtomicU64,
    /// A schema change asked for the next reading (sooner than other requests get one).
    schema_changed: std::sync::atomic::AtomicBool,
    /// Catalog readings finished, and those that found facts decisions depend on changed
    /// (the others keep every decision made).
    readings: std::sync::atomic::AtomicU64,
    catalog_changes: std::sync::atomic::AtomicU64,
    /// A sharded endpoint's shards: their count now is what `pgherd:shard` and
    /// `pgherd.shard` may name.
    shards: Option<Arc<crate::shards::Shards>>,
    /// What the result cache asked of statements, for the catalog generation it was found
    /// under.
    cache_memo: Mutex<CacheMemo>,
}

/// The result cache's verdicts and the tables writes show they write, remembered.
#[derive(Default)]
struct CacheMemo {
    generation: u64,
    /// Verdicts a literal value could change: by exact text.
    by_text: KeyMap<CacheVerdict>,
    /// Verdicts that hold for every text of a shape (literals blanked).
    by_shape: KeyMap<CacheVerdict>,
    /// Tables written, by shape (table names are no literals).
    writes_by_shape: KeyMap<Arc<[String]>>,
}

impl CacheMemo {
    /// The memo for catalog `generation`: emptied when the catalog was read again.
    fn of(&mut self, generation: u64) -> &mut CacheMemo {
        if self.generation != generation {
            *self = CacheMemo {
                generation,
                ..CacheMemo::default()
            };
        }
        self
    }
}

/// What [`Router::cache_verdict`] found.
pub type CacheVerdict = Result<Arc<[String]>, pgherd_route::cacheable::NotCacheable>;

thread_local! {
    /// The key being built, reused: the lookup allocates nothing on a hit.
    static KEY: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// A statement's shape for the result cache's memo, reused likewise.
    static SHAPE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// Statement shapes this worker lexed: a text seen before up to its literals' values is
    /// not lexed again. Per thread, so a hit takes no lock and writes nothing shared. Each
    /// shape keeps the decision last made or found for its key.
    static SHAPES: RefCell<ShapeMemo<Option<ShapeDecision>>> =
        RefCell::new(ShapeMemo::default());
}

/// A decision kept in a statement shape's slot: found there, it spares the lookup by key.
/// Valid for the router that made it, under the generation it was made under, as a copy in
/// [`Decisions`] is.
struct ShapeDecision {
    decisions_id: u64,
    generation: u64,
    decision: Arc<Decision>,
}

/// [`lex`] through this thread's shape memo.
fn lex_remembered(sql: &[u8], standard_conforming_strings: bool, key: &mut Vec<u8>) -> Lexed {
    SHAPES.with(|memo| match memo.try_borrow_mut() {
        Ok(mut memo) => memo.lex(sql, standard_conforming_strings, key, None),
        Err(_) => lex(sql, standard_conforming_strings, key),
    })
}

/// The lexer itself, where the shape memo is in use (not reached: nothing routes or lexes
/// while a decision is being made, which holds the memo), and always right.
fn lex_unremembered(
    sql: &[u8],
    standard_conforming_strings: bool,
    key: &mut Vec<u8>,
    spans: Option<&mut Vec<(usize, usize)>>,
) -> Lexed {
    match spans {
        Some(spans) => lex_with_spans(sql, standard_conforming_strings, key, spans),
        None => lex(sql, standard_conforming_strings, key),
    }
}

impl Router {
    /// Whether the result cache may keep the answer of `sql` (one whole simple query), and
    /// the tables it reads: parsed once per shape (the text with its literals blanked) and
    /// catalog reading, or once per exact text when a literal value could change the verdict.
    pub fn cache_verdict(&self, sql: &[u8], standard_conforming_strings: bool) -> CacheVerdict {
        let generation = self.generation();
        if let Some(verdict) = self.cache_memo.lock().of(generation).by_text.get(sql) {
            return verdict.clone();
        }
        SHAPE.with(|shape| {
            let mut shape = shape.borrow_mut();
            shape.clear();
            let lexed = lex_remembered(sql, standard_conforming_strings, &mut shape);
            if !shape.is_empty() {
                let mut memo = self.cache_memo.lock();
                if let Some(verdict) = memo.of(generation).by_shape.get(shape.as_slice()) {
                    return verdict.clone();
                }
            }
            let found = pgherd_route::cacheable::cacheable(
                &String::from_utf8_lossy(sql),
                &lexed,
                &self.catalog.load(),
                self.max_parse_bytes,
            );
            let verdict = found.outcome.map(Arc::from);
            if matches!(
                verdict,
                Err(pgherd_route::cacheable::NotCacheable::UnknownRelation(_)
                    | pgherd_route::cacheable::NotCacheable::UnknownFunction(_))
            ) {
                // Perhaps made since the catalog was read: not remembered, and read again.
                self.reload.notify_one();
                return verdict;
            }
            let mut memo = self.cache_memo.lock();
            let memo = memo.of(generation);
            match found.any_literals && !shape.is_empty() {
                true => remember(&mut memo.by_shape, self.capacity, &shape, verdict.clone()),
                false => remember(&mut memo.by_text, self.capacity, sql, verdict.clone()),
            }
            verdict
        })
    }

    /// The tables `sql`, sent to the primary, shows it writes
    /// ([`pgherd_route::cacheable::written_tables`]): found once per shape and catalog
    /// reading.
    pub fn written_tables(&self, sql: &[u8], standard_conforming_strings: bool) -> Arc<[String]> {
        let generation = self.generation();
        SHAPE.with(|shape| {
            let mut shape = shape.borrow_mut();
            shape.clear();
            let lexed = lex_remembered(sql, standard_conforming_strings, &mut shape);
            // A text too long to parse shows nothing, which another of its shape might.
            let by_shape = !shape.is_empty() && sql.len() <= self.max_parse_bytes;
            if by_shape {
                let mut memo = self.cache_memo.lock();
                if let Some(tables) = memo.of(generation).writes_by_shape.get(shape.as_slice()) {
                    return tables.clone();
                }
            }
            let tables: Arc<[String]> = pgherd_route::cacheable::written_tables(
                &String::from_utf8_lossy(sql),
                &lexed,
                &self.catalog.load(),
                self.max_parse_bytes,
            )
            .into();
            if by_shape {
                let mut memo = self.cache_memo.lock();
                let memo = memo.of(generation);
                remember(
                    &mut memo.writes_by_shape,
                    self.capacity,
                    &shape,
                    tables.clone(),
                );
            }
            tables
        })
    }

    /// (decisions found in the cache, statements classified with the parser) since start.
    pub fn cache_counts(&self) -> (u64, u64) {
        self.decisions.counts()
    }

    /// (catalog readings finished, readings that changed what decisions depend on) since
    /// start.
    pub fn catalog_counts(&self) -> (u64, u64) {
        let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
        (load(&self.readings), load(&self.catalog_changes))
    }

    /// A router whose catalog a task of its own loads now, and again when asked or every
    /// minute.
    pub fn start(app: &Arc<App>, server_dbname: String) -> Arc<Router> {
        let config = app.config();
        let router = Arc::new(Router::new(
            server_dbname,
            config.routing.decision_cache_entries,
            config.routing.max_parse_bytes,
            app.shards.clone(),
        ));
        tokio::spawn(keep_catalog(app.clone(), Arc::downgrade(&router)));
        router
    }

    /// A router with an empty catalog and no task reading it.
    fn new(
        server_dbname: String,
        capacity: usize,
        max_parse_bytes: usize,
        shards: Option<Arc<crate::shards::Shards>>,
    ) -> Router {
        Router {
            server_dbname,
            catalog: ArcSwap::from_pointee(Snapshot::default()),
            decisions: Decisions::new(capacity),
            capacity,
            cache_memo: Mutex::default(),
            max_parse_bytes,
            reload: Notify::new(),
            generation: std::sync::atomic::AtomicU64::new(0),
            readings_begun: std::sync::atomic::AtomicU64::new(0),
            last_reading: std::sync::atomic::AtomicU64::new(0),
            schema_changed: std::sync::atomic::AtomicBool::new(false),
            readings: std::sync::atomic::AtomicU64::new(0),
            catalog_changes: std::sync::atomic::AtomicU64::new(0),
            shards,
        }
    }

    /// The catalog as last read, for the session-state probe's custom settings.
    pub fn catalog(&self) -> arc_swap::Guard<Arc<Snapshot>> {
        self.catalog.load()
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Asks for the catalog to be read again soon (a schema change committed).
    pub fn catalog_changed(&self) {
        self.schema_changed
            .store(true, std::sync::atomic::Ordering::Release);
        self.reload.notify_one();
    }

    /// The catalog reading under way or last begun, for [`Self::read_after`].
    pub fn reading_ticket(&self) -> u64 {
        self.readings_begun
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// A reading begun after `ticket` was taken has finished.
    pub fn read_after(&self, ticket: u64) -> bool {
        self.last_reading.load(std::sync::atomic::Ordering::Acquire) > ticket
    }

    /// Decides for `sql`, as read by a session whose `standard_conforming_strings` is as
    /// given; an invalid hint is the client's error.
    pub fn route(&self, sql: &[u8], standard_conforming_strings: bool) -> Result<Routed, PgError> {
        KEY.with(|key| {
            self.route_keyed(
                sql,
                standard_conforming_strings,
                &mut key.borrow_mut(),
                None,
            )
        })
    }

    /// [`Self::route`], leaving in `key` the statement's literal-blind shape (empty when it
    /// has none to trust: too long, not lexed as the server would, strings read by settings)
    /// and, with `spans`, its literals' byte ranges: a sharded endpoint places statements by
    /// them without lexing them again.
    pub fn route_keyed(
        &self,
        sql: &[u8],
        standard_conforming_strings: bool,
        key: &mut Vec<u8>,
        mut spans: Option<&mut Vec<(usize, usize)>>,
    ) -> Result<Routed, PgError> {
        key.clear();
        let long = sql.len() > self.max_parse_bytes;
        // A text too long to parse gets no key: it would only fill the cache.
        let text = if long { &[][..] } else { sql };
        if let Some(spans) = spans.as_deref_mut() {
            spans.clear();
        }
        SHAPES.with(|memo| {
            let mut memo = memo.try_borrow_mut();
            let (lexed, slot) = match memo.as_deref_mut() {
                Ok(memo) => memo.lex_with_slot(text, standard_conforming_strings, key, spans),
                Err(_) => (
                    lex_unremembered(text, standard_conforming_strings, key, spans),
                    None,
                ),
            };
            let routed = self.decide(sql, long, &lexed, key, slot);
            if !lexed.cacheable || long || lexed.strings_depend_on_settings {
                key.clear();
            }
            routed
        })
    }

    /// The decision for a statement lexed as `lexed` with `key`: from `slot` (its shape's),
    /// from the decision cache, or made with the parser, and kept in both.
    fn decide(
        &self,
        sql: &[u8],
        long: bool,
        lexed: &pgherd_route::Lexed,
        key: &[u8],
        mut slot: Option<&mut Option<ShapeDecision>>,
    ) -> Result<Routed, PgError> {
        let hint = lexed.hint.clone().map_err(|e| hint_error(&e))?;
        let shard = lexed.shard.clone().map_err(|e| hint_error(&e))?;
        // A text too long to lex was lexed as an empty one.
        let may_change_session = if long {
            pgherd_route::may_change_session(sql)
        } else {
            lexed.may_change_session
        };
        if let Some(shard) = shard {
            self.check_shard(shard, "pgherd:shard")?;
        }
        // Read before the lookup: a decision found or made is kept only as long as nothing
        // that changes decisions happened since.
        let generation = self.generation();
        let keyed = lexed.cacheable && !long;
        let decisions_id = self.decisions.id();
        let keep_in_slot = |slot: Option<&mut Option<ShapeDecision>>, decision: &Arc<Decision>| {
            if let Some(slot) = slot {
                *slot = Some(ShapeDecision {
                    decisions_id,
                    generation,
                    decision: decision.clone(),
                });
            }
        };
        if keyed {
            let in_slot = slot
                .as_deref()
                .and_then(Option::as_ref)
                .filter(|kept| kept.decisions_id == decisions_id && kept.generation == generation);
            let found = match in_slot {
                Some(kept) => {
                    self.decisions.count_hit();
                    Some(kept.decision.clone())
                }
                None => self
                    .decisions
                    .get(key, generation)
                    .inspect(|decision| keep_in_slot(slot.as_deref_mut(), decision)),
            };
            if let Some(decision) = found {
                return Ok(Routed {
                    decision,
                    hint,
                    shard,
                    cache: lexed.cache,
                    may_change_session,
                });
            }
        }
        let text = String::from_utf8_lossy(sql);
        let decision = Arc::new(classify(
            &text,
            lexed,
            &**self.catalog.load(),
            self.max_parse_bytes,
        ));
        if decision.needs_catalog {
            self.reload.notify_one();
        }
        if keyed && decision.cacheable && !decision.needs_catalog {
            self.decisions.insert(key, generation, decision.clone());
            keep_in_slot(slot, &decision);
        }
        if let Some(value) = &decision.route_setting {
            if Route::parse(value).is_none() {
                return Err(route_setting_error(value));
            }
        }
        match &decision.shard_setting {
            Some(ShardSetting::To(value)) => {
                self.shard_setting(value)?;
            }
            Some(ShardSetting::Local) => {
                return Err(PgError::error(
                    SqlState::FEATURE_NOT_SUPPORTED,
                    "SET LOCAL pgherd.shard is not supported",
                )
                .with_hint("use SET pgherd.shard and RESET it, or a /* pgherd:shard=N */ hint"))
            }
            Some(ShardSetting::Reset) | None => {}
        }
        Ok(Routed {
            decision,
            hint,
            shard,
            cache: lexed.cache,
            may_change_session,
        })
    }

    /// The shard `pgherd.shard` names with `value`.
    pub fn shard_setting(&self, value: &str) -> Result<u32, PgError> {
        let shard = value.trim().parse().map_err(|_| {
            PgError::error(
                SqlState::INVALID_PARAMETER_VALUE,
                format!("invalid value for parameter \"{SHARD_SETTING}\": \"{value}\""),
            )
            .with_hint("a shard's number, from 0")
        })?;
        self.check_shard(shard, SHARD_SETTING)?;
        Ok(shard)
    }

    /// `shard` is one this endpoint has (`by`: the hint or setting that names it).
    fn check_shard(&self, shard: u32, by: &str) -> Result<(), PgError> {
        match self.shards.as_ref().map(|s| s.count()) {
            None => Err(PgError::error(
                SqlState::FEATURE_NOT_SUPPORTED,
                format!("{by} names a shard, but this endpoint has no shards"),
            )
            .with_hint("shards are configured in [sharding]")),
            Some(count) if shard >= count => Err(PgError::error(
                SqlState::INVALID_PARAMETER_VALUE,
                format!(
                    "{by} names shard {shard}, but this endpoint's shards are 0 to {}",
                    count - 1
                ),
            )),
            Some(_) => Ok(()),
        }
    }

    /// A standby refused `sql` (an unlogged table the catalog did not know yet, a write
    /// pgherd took for a read): statements like it run on the primary from now on.
    pub fn remember_primary(&self, sql: &[u8], standard_conforming_strings: bool) {
        let Ok(routed) = self.route(sql, standard_conforming_strings) else {
            return;
        };
        if routed.decision.target == Target::Primary {
            return;
        }
        let mut decision = (*routed.decision).clone();
        decision.target = Target::Primary;
        decision.reason = format!("{}, but a standby refused it", decision.reason);
        KEY.with(|key| {
            let mut key = key.borrow_mut();
            key.clear();
            let lexed = lex(sql, standard_conforming_strings, &mut key);
            if lexed.cacheable && sql.len() <= self.max_parse_bytes {
                self.decisions.insert_shared(&key, Arc::new(decision));
            }
        });
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// What the databases of shards 1 and up say about their collations (shard 0's is read
    /// with the rest of the catalog), asked at once, each within a few seconds: a shard that
    /// does not answer holds no catalog reading up.
    async fn other_shards_collations(
        &self,
        app: &Arc<App>,
    ) -> Vec<Result<crate::collation::DatabaseCollation, String>> {
        let Some(shards) = &app.shards else {
            return Vec::new();
        };
        let config = app.config();
        let context = app.connect_context();
        let ask = |cluster: &Arc<crate::nodes::Nodes>| {
            let (config, context) = (&config, &context);
            let writer = cluster.writer();
            async move {
                let node = writer.ok_or_else(|| "no primary is up".to_owned())?;
                let asked = tokio::time::timeout(COLLATION_TIMEOUT, async {
                    let mut conn = crate::monitor::management_connection(
                        &node,
                        &config.cluster,
                        context,
                        &self.server_dbname,
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                    crate::collation::read(&mut conn).await
                })
                .await;
                asked.unwrap_or_else(|_| Err("no answer in time".to_owned()))
            }
        };
        futures_util::future::join_all(shards.clusters().iter().skip(1).map(ask)).await
    }

    async fn load_catalog(&self, app: &Arc<App>) -> Result<(usize, usize), String> {
        let reading = self
            .readings_begun
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel)
            + 1;
        let node = app
            .nodes
            .writer()
            .ok_or_else(|| "no primary is up".to_owned())?;
        let config = app.config();
        let mut conn = crate::monitor::management_connection(
            &node,
            &config.cluster,
            &app.connect_context(),
            &self.server_dbname,
        )
        .await
        .map_err(|e| e.to_string())?;
        let mut builder = SnapshotBuilder::default();
        for row in conn
            .simple_query(FUNCTIONS_SQL)
            .await
            .map_err(|e| e.to_string())?
        {
            if let [Some(name), Some(volatile), Some(user)] = row.as_slice() {
                builder.function(name, volatile == "t", user == "t");
            }
        }
        for row in conn
            .simple_query(FUNCTION_SOURCES_SQL)
            .await
            .map_err(|e| e.to_string())?
        {
            if let Some(Some(source)) = row.first() {
                builder.function_source(source);
            }
        }
        for row in conn
            .simple_query(&RELATIONS_SQL)
            .await
            .map_err(|e| e.to_string())?
        {
            if let [Some(oid), Some(name), Some(persistence), Some(code), Some(seq), Some(cache_safe)] =
                row.as_slice()
            {
                builder.relation(RelationRow {
                    oid: oid.parse().map_err(|_| format!("relation oid {oid:?}"))?,
                    name: name.clone(),
                    persistence: Persistence::from_code(persistence),
                    runs_user_code: code == "t",
                    draws_sequences: seq == "t",
                    cache_safe: cache_safe == "t",
                });
            }
        }
        for row in conn
            .simple_query(CODE_TYPES_SQL)
            .await
            .map_err(|e| e.to_string())?
        {
            match row.as_slice() {
                [Some(kind), Some(name)] if kind == "t" => builder.code_type(name),
                [Some(kind), Some(name)] if kind == "o" => builder.code_operator(name),
                _ => {}
            }
        }
        for row in conn
            .simple_query(REACHES_SQL)
            .await
            .map_err(|e| e.to_string())?
        {
            if let [Some(from), Some(to), Some(kind)] = row.as_slice() {
                if let (Ok(from), Ok(to)) = (from.parse(), to.parse()) {
                    builder.reaches(from, to);
                    if kind == "i" {
                        builder.child(from, to);
                    }
                }
            }
        }
        // What writes to tables every shard holds must know: a sharded endpoint's only.
        if app.shards.is_some() {
            for row in conn
                .simple_query(DEFAULTS_SQL)
                .await
                .map_err(|e| e.to_string())?
            {
                if let [Some(relation), Some(column), expression] = row.as_slice() {
                    builder.column_default(relation, column, expression.as_deref());
                }
            }
            for row in conn
                .simple_query(NOT_TABLES_SQL)
                .await
                .map_err(|e| e.to_string())?
            {
                if let [Some(name)] = row.as_slice() {
                    builder.not_a_table(name);
                }
            }
            let mut shards = vec![crate::collation::read(&mut conn).await];
            shards.extend(self.other_shards_collations(app).await);
            builder.text_rules(crate::collation::text_rules(
                &shards,
                &crate::collation::open_libc,
                crate::collation::local_version().as_deref(),
            ));
        }
        let snapshot = builder.build();
        let counts = (snapshot.function_count(), snapshot.relation_count());
        let first = self.readings.load(std::sync::atomic::Ordering::Acquire) == 0;
        let changed = first || !snapshot.decides_as(&self.catalog.load());
        self.catalog.store(Arc::new(snapshot));
        if changed {
            self.decisions.clear();
            self.generation
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            self.catalog_changes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.readings
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.last_reading
            .store(reading, std::sync::atomic::Ordering::Release);
        Ok(counts)
    }
}

/// How long a shard may take to say what its database's collation is.
const COLLATION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// Reads the catalog, then again whenever asked (at most once a second, or every 50 ms after
/// schema changes) or every minute, for as long as the router exists.
async fn keep_catalog(app: Arc<App>, router: std::sync::Weak<Router>) {
    loop {
        let Some(r) = router.upgrade() else {
            return;
        };
        let began = tokio::time::Instant::now();
        r.schema_changed
            .store(false, std::sync::atomic::Ordering::Release);
        match r.load_catalog(&app).await {
            Ok((functions, relations)) => {
                tracing::debug!(database = %r.server_dbname, functions, relations, "catalog loaded");
            }
            Err(error) => {
                tracing::warn!(database = %r.server_dbname, %error, "cannot load the catalog; statements calling functions go to the primary and sessions are checked after unknown statements");
            }
        }
        let _ = tokio::time::timeout(CATALOG_REFRESH_INTERVAL, r.reload.notified()).await;
        let floor = if r.schema_changed.load(std::sync::atomic::Ordering::Acquire) {
            SCHEMA_CHANGE_RELOAD_MIN_INTERVAL
        } else {
            CATALOG_RELOAD_MIN_INTERVAL
        };
        drop(r);
        tokio::time::sleep_until(began + floor).await;
    }
}

fn hint_error(e: &HintError) -> PgError {
    PgError::error(SqlState::INVALID_PARAMETER_VALUE, e.to_string())
        .with_hint("write /* pgherd:primary */, /* pgherd:replica */ or /* pgherd:shard=N */")
}

fn route_setting_error(value: &str) -> PgError {
    PgError::error(
        SqlState::INVALID_PARAMETER_VALUE,
        format!("invalid value for parameter \"pgherd.route\": \"{value}\""),
    )
    .with_hint("Available values: auto, primary, replica.")
}

#[cfg(test)]
#[path = "routing_tests.rs"]
mod tests;
