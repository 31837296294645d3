//! The sharded endpoint's session (`[sharding]`): the client's front end ([`front`]) and the
//! executor of each statement's plan (`pgherd_route::shard_route`) over backend links
//! ([`link`], taken on the node [`reads`] chooses), one per shard the plan needs. A statement on one shard is relayed as it streams back; a read over
//! several is merged ([`fan_out`]); a schema change runs on every shard.
//!
//! Transaction blocks span the shards their statements reach ([`tx`]) and commit on all of them
//! or on none ([`commit`], two-phase when several wrote); a write over several shards outside
//! a block runs in a transaction of its own. The extended protocol is [`extended`]'s, COPY
//! [`copy`]'s and [`copy_out`]'s, what pgherd keeps of the session [`session`]'s.

mod answer;
mod commit;
mod copy;
mod copy_out;
mod each;
mod extended;
mod fan_out;
mod front;
mod link;
mod moving;
mod pinned;
mod reads;
mod session;
mod tx;

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use pgherd_route::shard_plan::BoundParam;
use pgherd_route::shard_route::{
    on_named_shard, route_statement, CatalogFacts, CopyFacts, Execution, ShardError, SplitInsert,
    TxCommand,
};
use pgherd_route::shard_shape;
use pgherd_route::{Decision, SessionEffect, Target, TxEffect};
use pgherd_wire::backend::{self, tag as btag};
use pgherd_wire::{PgError, SqlState};

use crate::app::{App, PoolCache};
use crate::clients::ClientShared;
use crate::error::Disconnect;
use crate::relay::params::{session_changes, SessionParams};
use crate::relay::primary_may_answer;
use crate::routing::Router;
use crate::shards::{Layout, Shards};
use crate::stream::Stream;
use answer::Answer;
pub use commit::make_decision_table;
pub use extended::Extended;
use link::{encode_message, Link, Query};
pub use reads::ShardReads;

/// Answers are written to the client once this much is buffered.
const FLUSH_BYTES: usize = 64 << 10;

pub struct ShardedSession {
    pub app: Arc<App>,
    pub shared: Arc<ClientShared>,
    pub client: Stream,
    pub client_in: BytesMut,
    pub params: SessionParams,
    pub shards: Arc<Shards>,
    /// The layout this session plans by: the one in force when its transaction began.
    pub layout: Arc<Layout>,
    /// The database's catalog, for the aggregates it defines.
    pub router: Arc<Router>,
    /// Each shard's pools (see `App::pool_cached`).
    pub pools: Vec<PoolCache>,
    /// The database's name on the servers.
    pub server_database: String,
    /// The client's transaction, once it began one (or a write over several shards runs).
    pub tx: Option<tx::Tx>,
    /// The catalog reading under way or last begun when this session's last schema change
    /// committed: the next statement is planned on a catalog read that began after it.
    pub schema_changed_at: Option<u64>,
    /// The client's prepared statements and portals (extended query protocol).
    pub extended: Extended,
    /// This session waited once for a fresh pgherd's first catalog reading.
    pub catalog_awaited: bool,
    /// The statement that set `pgherd.shard` as last read, and the shard it names.
    pub session_shard: Option<(String, u32)>,
    /// Where reads run within a shard, and how far each shard's replicas must have replayed.
    pub reads: ShardReads,
}

/// A statement's literal-blind shape and its literals' byte ranges, as planning reads them.
type ShapeBuffers = (Vec<u8>, Vec<(usize, usize)>);

thread_local! {
    /// Kept per thread, so planning allocates nothing for them.
    static SHAPE: std::cell::RefCell<ShapeBuffers> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// How long a write to a table the catalog does not know waits for it to be read again.
const CATALOG_WAIT_MS: u64 = 2_000;

/// Why a statement could not be planned.
enum PlanError {
    Pg(PgError),
    Shard(ShardError),
}

impl From<ShardError> for PlanError {
    fn from(e: ShardError) -> Self {
        PlanError::Shard(e)
    }
}

impl PlanError {
    fn into_pg(self) -> PgError {
        match self {
            PlanError::Pg(e) => e,
            PlanError::Shard(e) => PgError::error(e.sqlstate(), e.to_string()),
        }
    }
}

/// How a statement's answer on one link ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Relayed {
    Answered,
    /// The server refused it; its error went to the client.
    Refused,
    /// A replica refused it in a way the primary may not; nothing went to the client.
    ReplicaRefused,
}

/// Why a statement ended without its answer: the client hears the error, or the session ends.
enum Failed {
    Statement(PgError),
    /// The server refused it, and its error went to the client already.
    Relayed,
    Client(Disconnect),
}

fn aborted_transaction() -> PgError {
    PgError::error(
        SqlState::IN_FAILED_SQL_TRANSACTION,
        "current transaction is aborted, commands ignored until end of transaction block",
    )
}

impl From<PgError> for Failed {
    fn from(e: PgError) -> Self {
        Failed::Statement(e)
    }
}

impl ShardedSession {
    /// Runs a simple query's string; its answer (without `ReadyForQuery`) goes to `out`.
    /// Several statements run one after the other, as PostgreSQL runs them: in an implicit
    /// transaction (a `BEGIN` among them makes it the client's block; after a `COMMIT` the
    /// next statement begins another), up to the first that fails. The caller ends the
    /// implicit transaction.
    async fn query_string(&mut self, sql: &str, out: &mut BytesMut) -> Result<(), Disconnect> {
        let Some(statements) = several_statements(sql) else {
            return self.simple_query(sql, out).await.map(|_| ());
        };
        for statement in statements {
            if self.tx.is_none() {
                let read_only = self.params.flags.default_transaction_read_only;
                self.tx = Some(tx::Tx::implicit(read_only));
            }
            if !self.simple_query(statement, out).await? {
                break;
            }
        }
        Ok(())
    }

    /// Plans and runs one statement; its answer (without `ReadyForQuery`) goes to `out`. Says
    /// whether it succeeded.
    async fn simple_query(&mut self, sql: &str, out: &mut BytesMut) -> Result<bool, Disconnect> {
        let outcome = match self.plan(sql, &[]).await {
            Err(e) => Err(Failed::Statement(e)),
            Ok((execution, ..)) if self.in_failed_transaction(&execution) => {
                Err(Failed::Statement(aborted_transaction()))
            }
            Ok((execution, decision, target)) => {
                self.execute(execution, &decision, target, Query::simple(sql), out)
                    .await
            }
        };
        let succeeded = outcome.is_ok();
        self.answer_failure(outcome, out)?;
        Ok(succeeded)
    }

    /// The transaction failed and the statement does not end it.
    fn in_failed_transaction(&self, execution: &Execution) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.failed)
            && !matches!(
                execution,
                Execution::Transaction(
                    TxCommand::Commit | TxCommand::Rollback | TxCommand::RollbackTo(_)
                )
            )
    }

    /// The statement's routing decision and its plan over the shards. A write to a table
    /// the catalog does not know yet (made a moment ago) waits for the catalog to be read
    /// again, up to [`CATALOG_WAIT_MS`].
    async fn plan(
        &mut self,
        sql: &str,
        params: &[BoundParam<'_>],
    ) -> Result<(Execution, Arc<Decision>, Target), PgError> {
        if self.tx.as_ref().is_none_or(|tx| tx.links.is_empty()) {
            self.begin_planning().await?;
        }
        let started = tokio::time::Instant::now();
        let wait = Duration::from_millis(CATALOG_WAIT_MS);
        // Until a fresh pgherd has read the catalog, every function might write or be an
        // aggregate: the session's first statement waits for the first reading rather than be
        // refused for what it would tell.
        if self.router.generation() == 0 && !std::mem::replace(&mut self.catalog_awaited, true) {
            self.router.catalog_changed();
            while self.router.generation() == 0 && started.elapsed() < wait {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // After this session's own schema change, the catalog is read again before planning.
        if let Some(changed_at) = self.schema_changed_at.take() {
            while !self.router.read_after(changed_at) && started.elapsed() < wait {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let failed = self.tx.as_ref().is_some_and(|tx| tx.failed);
        // An invalid value (from the startup packet) fails the statements it would place, not
        // the ones that set it again.
        let session_shard = self.session_shard();
        let mut asked = false;
        loop {
            match self.plan_once(sql, params, &session_shard) {
                Err(PlanError::Shard(ShardError::CatalogBehind(table)))
                    if !failed && started.elapsed() < wait =>
                {
                    if !std::mem::replace(&mut asked, true) {
                        tracing::debug!(table, "a write waits for the catalog to be read again");
                        self.router.catalog_changed();
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                planned => return planned.map_err(PlanError::into_pg),
            }
        }
    }

    /// Before a transaction's first statement is planned: `PAUSE` holds it here, so that no
    /// plan made before a layout change runs after it, and a layout a reload grew is taken up
    /// (its new shards' pools and read positions start empty).
    async fn begin_planning(&mut self) -> Result<(), PgError> {
        self.wait_while_paused().await?;
        if self.shards.generation() != self.layout.generation {
            let layout = self.shards.layout();
            self.pools
                .resize_with(layout.count() as usize, PoolCache::default);
            self.reads.grow(layout.count());
            self.layout = layout;
        }
        Ok(())
    }

    /// Holds a transaction that starts while its database is paused, until RESUME (or the
    /// client cancels); whether it waited.
    async fn wait_while_paused(&self) -> Result<bool, PgError> {
        let database = self.shared.database();
        if !self.app.nodes.is_paused(database) {
            return Ok(false);
        }
        let resumed = crate::control::wait_resumed(&self.app, database);
        cancellable(&self.shared, resumed).await?;
        Ok(true)
    }

    /// One plan of `sql`; `session_shard`: the shard `pgherd.shard` names, which a
    /// `pgherd:shard` hint overrides.
    fn plan_once(
        &self,
        sql: &str,
        params: &[BoundParam],
        session_shard: &Result<Option<u32>, PgError>,
    ) -> Result<(Execution, Arc<Decision>, Target), PlanError> {
        if !self.params.flags.standard_conforming_strings {
            // pgherd reads strings with it on: the server must read them alike.
            return Err(PlanError::Pg(PgError::error(
                SqlState::FEATURE_NOT_SUPPORTED,
                "not supported on sharded tables: standard_conforming_strings = off",
            )));
        }
        SHAPE.with(|shape| {
            let (key, spans) = &mut *shape.borrow_mut();
            let routed = self
                .router
                .route_keyed(sql.as_bytes(), true, key, Some(spans))
                .map_err(PlanError::Pg)?;
            let target = self.reads.target(&routed);
            let decision = routed.decision;
            let named = match routed.shard {
                Some(shard) => Some(shard),
                // Setting pgherd.shard (or resetting everything) works whatever it was.
                None if decision.shard_setting.is_some() => None,
                None => session_shard.clone().map_err(PlanError::Pg)?,
            };
            if let Some(shard) = named {
                let planned = self.plan_in_full(sql, &decision, params);
                let execution = on_named_shard(sql, planned, &decision, shard)?;
                return Ok((execution, decision, target));
            }
            // A shape planned before places the statement without parsing it (`shard_shape`).
            let keyed = !key.is_empty() && decision.pin.is_none();
            let kept = self.layout.shape(key).filter(|_| keyed);
            if let Some(shape) = &kept {
                if let Some(shard) = shard_shape::place(shape, sql, spans, params, &self.layout.map)
                {
                    return Ok((Execution::OneShard(shard), decision, target));
                }
            }
            let execution = self.plan_in_full(sql, &decision, params)?;
            if keyed && kept.is_none() && matches!(execution, Execution::OneShard(_)) {
                if let Some(plan) =
                    shard_shape::shape_plan(sql, spans, params.len(), &self.layout.map)
                {
                    self.layout.keep_shape(key, plan);
                }
            }
            Ok((execution, decision, target))
        })
    }

    /// `route_statement`, with what the catalog says.
    fn plan_in_full(
        &self,
        sql: &str,
        decision: &Decision,
        params: &[BoundParam],
    ) -> Result<Execution, ShardError> {
        let catalog = self.router.catalog();
        // Until the catalog is read, any function might be an aggregate the database defines.
        let unread = catalog.function_count() == 0;
        let is_user_aggregate = |name: &str| {
            unread
                || pgherd_route::Catalog::function(&**catalog, name).is_some_and(|f| f.user_defined)
        };
        let copy_facts = |name: &str| {
            let relation = pgherd_route::Catalog::relation(&**catalog, name).filter(|_| !unread)?;
            Some(CopyFacts {
                is_table: catalog.is_table(name),
                runs_user_code: relation.runs_user_code,
                varying_defaults: catalog.varying_defaults(name).to_vec(),
            })
        };
        let mentions_user_code =
            |text: &str| pgherd_route::Catalog::mentions_user_code(&**catalog, text);
        let facts = CatalogFacts {
            is_user_aggregate: &is_user_aggregate,
            copy_facts: &copy_facts,
            mentions_user_code: &mentions_user_code,
        };
        route_statement(sql, &self.layout.map, decision, &facts, params)
    }

    /// Runs a planned statement; `target`: where within a shard it may run.
    async fn execute(
        &mut self,
        execution: Execution,
        decision: &Decision,
        target: Target,
        query: Query<'_>,
        out: &mut BytesMut,
    ) -> Result<(), Failed> {
        // pgherd answers these itself: a described portal of one has no rows.
        let answered_here = matches!(execution, Execution::Transaction(_) | Execution::Session(_));
        if answered_here && query.bound.is_some_and(|b| b.describe) {
            backend::encode_empty(out, btag::NO_DATA);
        }
        if let Execution::Transaction(command) = execution {
            return self.transaction(command, decision, query.sql, out).await;
        }
        if let Execution::Session(command) = &execution {
            let tag = self
                .session_command(command, out)
                .await
                .map_err(Failed::Statement)?;
            backend::encode_command_complete(out, &tag).map_err(|e| {
                Failed::Statement(PgError::error(SqlState::INTERNAL_ERROR, e.to_string()))
            })?;
            return Ok(());
        }
        // A write over several shards is one transaction over them, as on one server.
        let implicit = self.tx.is_none()
            && matches!(execution, Execution::Write { .. } | Execution::CopyIn(_));
        if implicit {
            self.tx = Some(tx::Tx::new("BEGIN", false));
        }
        if !implicit {
            return self
                .run_planned(&execution, decision, target, query, out)
                .await;
        }
        // As PostgreSQL does, the statement's answer is sent only once its commit succeeded:
        // a client hears either the answer or the error.
        let mut answer = BytesMut::new();
        let ran = self
            .run_planned(&execution, decision, target, query, &mut answer)
            .await;
        let ended = self.end_transaction(ran.is_ok(), out).await;
        if ran.is_ok() && ended.is_ok() {
            out.extend_from_slice(&answer);
        }
        ran.and(ended)
    }

    /// The shards a statement runs on.
    fn shards_for(&self, execution: &Execution) -> Vec<u32> {
        let mut reached = self.tx.iter().flat_map(|tx| tx.links.keys().copied());
        match execution {
            // In a transaction, one it reached already (its writes are seen there).
            Execution::AnyShard => match reached.next() {
                Some(shard) => vec![shard],
                None => vec![(self.shared.id % u64::from(self.layout.count())) as u32],
            },
            Execution::OneShard(shard) => vec![*shard],
            // A setting in a transaction reaches every shard it reached.
            Execution::Setting => {
                let reached: Vec<u32> = reached.collect();
                if reached.is_empty() {
                    vec![0]
                } else {
                    reached
                }
            }
            Execution::EveryShard | Execution::Maintenance | Execution::CopyIn(_) => {
                (0..self.layout.count()).collect()
            }
            Execution::FanOut { shards, .. }
            | Execution::Write { shards, .. }
            | Execution::CopyOut { shards, .. } => shards.iter().copied().collect(),
            Execution::Transaction(_) | Execution::Session(_) => Vec::new(),
        }
    }

    async fn run_planned(
        &mut self,
        execution: &Execution,
        decision: &Decision,
        target: Target,
        query: Query<'_>,
        out: &mut BytesMut,
    ) -> Result<(), Failed> {
        if query.bound.is_some() && matches!(execution, Execution::CopyIn(_)) {
            return Err(Failed::Statement(PgError::error(
                SqlState::FEATURE_NOT_SUPPORTED,
                "not supported on sharded tables: COPY through the extended query protocol (send it as a simple query)",
            )));
        }
        let sql = query.sql;
        let shards = self.shards_for(execution);
        let in_tx = self.tx.is_some();
        let writes_copies = matches!(execution, Execution::Write { copies: true, .. })
            || matches!(execution, Execution::CopyIn(plan) if plan.key.is_none());
        if writes_copies && self.tx.as_ref().is_some_and(|tx| tx.changed_schema) {
            // What the guard of such writes reads in the catalog may have just changed, where
            // pgherd's catalog cannot see it yet.
            return Err(Failed::Statement(PgError::error(
                SqlState::FEATURE_NOT_SUPPORTED,
                "not supported on sharded tables: a write to a table every shard holds after a schema change in the same transaction",
            )));
        }
        let writes = decision.target == Target::Primary
            || matches!(
                execution,
                Execution::EveryShard
                    | Execution::Maintenance
                    | Execution::Write { .. }
                    | Execution::CopyIn(_)
            );
        // Outside a transaction block a read may run on a shard's replica.
        let reads_anywhere = !in_tx
            && target != Target::Primary
            && matches!(
                execution,
                Execution::AnyShard
                    | Execution::OneShard(_)
                    | Execution::FanOut { .. }
                    | Execution::CopyOut { .. }
            );
        let mut links = if in_tx {
            self.tx_links(&shards).await?
        } else if reads_anywhere {
            self.open_links_for(&shards, target).await?
        } else {
            self.open_links(&shards).await?
        };
        if writes && !in_tx {
            // (A transaction's writes are noted when it ends.)
            shards.iter().for_each(|&shard| self.reads.wrote(shard));
        }
        if decision.session != SessionEffect::None || *execution == Execution::Setting {
            links.iter_mut().for_each(Link::close_after_use);
        }
        self.watch_cancel(&links);
        // The server's own error was relayed to the client: the statement failed all the same.
        let mut server_refused = false;
        let mut retry_on_primary = None;
        let ran = match execution {
            Execution::AnyShard | Execution::OneShard(_) => match links.as_mut_slice() {
                [link] => {
                    let may_retry = reads_anywhere && link.on_replica();
                    match self.relay(link, query, out, may_retry).await {
                        Ok(Relayed::ReplicaRefused) => {
                            retry_on_primary = Some(link.shard);
                            Ok(())
                        }
                        Ok(relayed) => {
                            server_refused = relayed == Relayed::Refused;
                            Ok(())
                        }
                        Err(e) => Err(e),
                    }
                }
                _ => Ok(()),
            },
            Execution::Setting => self
                .setting(&mut links, query, out)
                .await
                .map(|refused| server_refused = refused),
            Execution::EveryShard | Execution::Maintenance => {
                each::schema_change(&mut links, query, !in_tx, out).await
            }
            Execution::Write {
                pinned: Some(pinned),
                ..
            } => {
                let first = self.tx.as_ref().and_then(|tx| tx.first_shard);
                pinned::write(&mut links, query, pinned, first, out).await
            }
            Execution::Write { copies, split, .. } => {
                self.write(&mut links, query, *copies, split.as_deref(), out)
                    .await
            }
            Execution::FanOut { plan, .. } => {
                let hold = self.extended.holds_answers();
                let catalog = self.router.catalog();
                let mut answer = Answer::new(&mut self.client, out, hold);
                fan_out::run(
                    &mut links,
                    plan,
                    catalog.text_rules(),
                    query.bound,
                    &mut answer,
                )
                .await
            }
            Execution::CopyIn(plan) => self.copy_in(plan, sql, &mut links, out).await,
            Execution::CopyOut { header, .. } => {
                let hold = self.extended.holds_answers();
                let mut answer = Answer::new(&mut self.client, out, hold);
                copy_out::run(&mut links, query, *header, &mut answer).await
            }
            Execution::Transaction(_) | Execution::Session(_) => Ok(()),
        };
        let ran = match retry_on_primary {
            // The replica refused as a standby, or lacks what the read names (not replayed
            // yet): the primary answers, as the relay does.
            Some(shard) => {
                links.clear();
                match self.open_link(shard, Target::Primary).await {
                    Ok(link) => {
                        links.push(link);
                        self.watch_cancel(&links);
                        match self.relay(&mut links[0], query, out, false).await {
                            Ok(relayed) => {
                                server_refused = relayed == Relayed::Refused;
                                Ok(())
                            }
                            Err(e) => Err(e),
                        }
                    }
                    Err(e) => Err(Failed::Statement(e)),
                }
            }
            None => ran,
        };
        self.unwatch_cancel().await;
        if ran.is_ok() && !server_refused {
            if let Some(value) = &decision.route_setting {
                self.reads.set_route(value);
            }
        }
        if !in_tx && writes {
            // Committed (or refused) on its own: where it ends is what the shard's replicas
            // must reach before this session reads there.
            for link in &mut links {
                if let Some(cluster) = self.layout.cluster(link.shard) {
                    self.reads.write_ended(link, cluster).await;
                }
            }
        }
        if in_tx {
            self.give_back(links, writes);
            if let Some(tx) = &mut self.tx {
                if ran.is_ok() && !server_refused {
                    match decision.tx {
                        TxEffect::SetReadOnly => tx.read_only = true,
                        TxEffect::SetReadWrite => tx.read_only = false,
                        _ => {}
                    }
                    if *execution == Execution::Setting {
                        tx.log.setting(sql);
                    }
                }
            }
        }
        if ran.is_ok() && decision.changes_catalog && *execution != Execution::Maintenance {
            if in_tx {
                if let Some(tx) = &mut self.tx {
                    tx.changed_schema = true;
                }
            } else {
                self.schema_changed_at = Some(self.router.reading_ticket());
            }
            self.router.catalog_changed();
        }
        if server_refused && ran.is_ok() {
            return Err(Failed::Relayed);
        }
        ran
    }

    /// A write over several shards; a split INSERT with parameters has each shard's own rows
    /// and every parameter, whose types the shards must be told where its rows do not say.
    async fn write(
        &mut self,
        links: &mut [Link],
        query: Query<'_>,
        copies: bool,
        split: Option<&SplitInsert>,
        out: &mut BytesMut,
    ) -> Result<(), Failed> {
        let typed = match (query.bound, split, links.first_mut()) {
            (Some(bound), Some(_), Some(link)) => {
                Some(extended::typed(link, query.sql, bound).await?)
            }
            _ => None,
        };
        let query = match &typed {
            Some(bound) => Query {
                bound: Some(bound),
                ..query
            },
            None => query,
        };
        each::write(links, query, copies, split, out).await
    }

    /// A cancel from the client reaches every link of the statement (once they are open: a
    /// cancel while they are being opened ends the wait, see [`cancellable`]).
    fn watch_cancel(&self, links: &[Link]) {
        self.shared
            .set_targets(links.iter().filter_map(Link::target));
    }

    async fn unwatch_cancel(&self) {
        if !self.shared.try_clear_target() {
            self.shared
                .clear_target(&self.app.clients.cancel_acknowledged)
                .await;
        }
    }

    /// Runs `sql` on one link, relaying its answer to the client as it comes; says whether the
    /// server answered with an error. With `may_retry` (a read on a replica), a refusal the
    /// primary may answer otherwise, before anything else of the answer, is not relayed.
    async fn relay(
        &mut self,
        link: &mut Link,
        query: Query<'_>,
        out: &mut BytesMut,
        may_retry: bool,
    ) -> Result<Relayed, Failed> {
        link.send_query(query).await?;
        let mut failed = false;
        let mut relayed_any = false;
        loop {
            let message = link.next().await?;
            match message.0 {
                btag::READY_FOR_QUERY if failed => return Ok(Relayed::Refused),
                btag::READY_FOR_QUERY => return Ok(Relayed::Answered),
                btag::ERROR_RESPONSE
                    if may_retry
                        && !relayed_any
                        && primary_may_answer(&link::server_error(link.shard, &message.1)) =>
                {
                    while link.next().await?.0 != btag::READY_FOR_QUERY {}
                    return Ok(Relayed::ReplicaRefused);
                }
                btag::ERROR_RESPONSE => failed = true,
                btag::PARAMETER_STATUS => {
                    if let Ok(p) = backend::ParameterStatus::parse(&message.1) {
                        self.params.record_reported(p.name, p.value);
                    }
                }
                _ => {}
            }
            relayed_any = true;
            encode_message(out, &message);
            Answer::new(&mut self.client, out, self.extended.holds_answers())
                .grown()
                .await?;
        }
    }

    /// `SET`/`RESET`: run on one shard (in a transaction, on every shard it reached), then
    /// kept as the session's, so every link carries it; in a transaction, once it commits.
    /// Says whether the server refused it (its error was relayed).
    async fn setting(
        &mut self,
        links: &mut [Link],
        query: Query<'_>,
        out: &mut BytesMut,
    ) -> Result<bool, Failed> {
        let sql = query.sql;
        let Some(changes) = session_changes(sql) else {
            return Err(Failed::Statement(PgError::error(
                SqlState::FEATURE_NOT_SUPPORTED,
                "not supported on sharded tables: this SET through a sharded endpoint",
            )));
        };
        let Some((first, others)) = links.split_first_mut() else {
            return Ok(false);
        };
        if self.relay(first, query, out, false).await? == Relayed::Refused {
            return Ok(true);
        }
        for link in others {
            if let Some(refused) = link.run_own(sql).await? {
                return Err(Failed::Statement(refused));
            }
        }
        self.params.record(changes);
        if self.tx.is_none() {
            self.params.end_transaction(true);
        }
        Ok(false)
    }
}

/// The statements of a query string that holds more than one; `None` for one (or none), and
/// for a text the parser cannot split, which planning refuses as a whole.
fn several_statements(sql: &str) -> Option<Vec<&str>> {
    // Most strings hold one statement, at most ended by a `;`: they are not parsed twice.
    let body = sql.trim_end_matches(|c: char| c == ';' || c.is_ascii_whitespace());
    if !body.contains(';') {
        return None;
    }
    let statements = pgherd_route::parse::split_query(sql).ok()?;
    (statements.len() > 1).then_some(statements)
}

fn encode_error(out: &mut BytesMut, error: &PgError) {
    if error.encode(out).is_err() {
        let _ = PgError::error(SqlState::INTERNAL_ERROR, "an error too large to send").encode(out);
    }
}

/// A wait for a statement's server connections (a full pool, a primary being elected, a
/// paused database) that a cancel from the client ends at once with 57014, as the relay's
/// waits do. Only waits that can be dropped at any point go through it (never I/O on a
/// connection: dropped half way, it would go back to its pool with an answer unread). Once it
/// ends, a cancel is for the statement running on the links (or for nothing).
async fn cancellable<T, E: From<PgError>>(
    shared: &ClientShared,
    wait: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, E> {
    let outcome = tokio::select! {
        biased;
        done = wait => done,
        _ = shared.wait_interrupted(false) => Err(PgError::error(
            SqlState::QUERY_CANCELED,
            "canceling statement due to user request",
        )
        .with_detail("the statement was still waiting for a server connection")
        .into()),
    };
    shared.end_wait();
    outcome
}
