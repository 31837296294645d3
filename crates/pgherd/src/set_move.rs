//! `pgherd set move NAME --new-origin CONNINFO [--to OTHER...]`: a replication set's origin
//! moves to one of its subscribers, as Slony-I's MOVE SET, with no lost write. Writes to the
//! set's tables are held on the old origin (an EXCLUSIVE lock: reads go on); every subscriber
//! applies everything before (the set's marker); sequences are put in step; the new origin
//! publishes the set, the other subscribers and the old origin subscribe to it from where they
//! are (no copy), the old origin's tables refuse local writes from then on (the writers held
//! back get 25006 naming the new origin, so no write is acknowledged and lost), and the new
//! origin's tables take writes.
//!
//! Until the old origin commits its refusal, every step is undone on failure (the lock still
//! holds every writer back, so a subscription made again from where it is misses nothing):
//! replication is left as it was. After it, the move goes on and names what is left to do.

use std::time::{Duration, Instant};

use pgherd_config::{Config, NodeConfig};
use pgherd_proxy::server::ServerConn;
use pgherd_replication::sets::{self as set, Copy};

use crate::clone::session_in;
use crate::set_nodes::{
    drop_slot_when_released, given_subscribers, raise_mark, set_patterns, set_user_tables,
    wait_applied, SetPatterns, SlotDrop, Subscriber,
};
use crate::sets::{origin_conninfo, origin_session, sync_sequences, Origin};
use crate::sql_session::pg_error;

/// How long a subscriber may take to apply what the old origin committed before the move,
/// while its writers wait.
const CATCH_UP_WAIT: Duration = Duration::from_secs(30);
/// How long a slot's sender may take to notice its subscription went.
const SLOT_RELEASE_WAIT: Duration = Duration::from_secs(10);

/// A set's move: the old origin, its sessions, and the subscribers (the new origin first).
struct Move<'a> {
    name: &'a str,
    database: &'a str,
    origin: NodeConfig,
    /// How subscribers reach the old origin (to follow it again, if the move is undone).
    origin_conninfo: String,
    conn: ServerConn,
    tables: Vec<String>,
    patterns: SetPatterns,
    target: Subscriber,
    rest: Vec<Subscriber>,
}

/// How far the set's subscriptions were changed: what an undo puts back.
#[derive(Default)]
struct Repointed {
    /// The new origin dropped its subscription (and slot) to the old one.
    target_left: bool,
    /// The new origin publishes the set.
    target_publishes: bool,
    /// Per other subscriber: dropped its subscription to the old origin; follows the new.
    rest: Vec<(bool, bool)>,
}

pub(crate) async fn move_set(
    name: &str,
    new_origin: &str,
    others: &[String],
    on: &Origin,
) -> Result<(), String> {
    set::check_name(name).map_err(|e| e.to_string())?;
    let config = Config::load(&on.at.config_path()?).map_err(|e| e.to_string())?;
    let mut moving = Move::prepare(&config, name, new_origin, others, on).await?;
    let on_origin = |e: String| format!("origin {}: {e}", moving.origin.name);

    // Writes to the set's tables wait on the old origin from here.
    let mut lock = session_in(&config, &moving.origin, &on.database).await?;
    lock.simple_query(&format!(
        "BEGIN; SET LOCAL lock_timeout = '10s'; LOCK TABLE {} IN EXCLUSIVE MODE",
        moving.tables.join(", ")
    ))
    .await
    .map_err(|e| {
        on_origin(format!(
            "the set's tables could not be locked: {e}; nothing was changed"
        ))
    })?;
    let held = Instant::now();
    moving.catch_up().await?;

    let mut done = Repointed::default();
    if let Err(e) = moving.repoint(&mut lock, &mut done).await {
        let undone = moving.undo(&done).await;
        let _ = lock.simple_query("ROLLBACK").await;
        return Err(match undone {
            Ok(()) => format!(
                "{e}; the move was undone: {} is the set's origin and every subscriber follows it as before",
                moving.origin.name
            ),
            Err(left) => format!(
                "{e}; undoing the move failed too ({left}): {} is the set's origin, but not every subscriber follows it",
                moving.origin.name
            ),
        });
    }
    let left = moving.finish().await;
    println!(
        "set {name} moved from {} to {}: writes to its tables were held {} ms; {} follow{} {}; writes to the set's tables on {} are refused (25006)",
        moving.origin.name,
        moving.target.shown,
        held.elapsed().as_millis(),
        std::iter::once(moving.origin.name.as_str())
            .chain(moving.rest.iter().map(|n| n.shown.as_str()))
            .collect::<Vec<_>>()
            .join(", "),
        if moving.rest.is_empty() { "s" } else { "" },
        moving.target.shown,
        moving.origin.name
    );
    match left.as_slice() {
        [] => Ok(()),
        left => Err(format!(
            "set {name} moved, but not all of it: {}",
            left.join("; ")
        )),
    }
}

impl<'a> Move<'a> {
    /// Reads the set on its origin and connects to its subscribers; nothing is changed.
    async fn prepare(
        config: &Config,
        name: &'a str,
        new_origin: &str,
        others: &[String],
        on: &'a Origin,
    ) -> Result<Move<'a>, String> {
        let (origin, mut conn) = origin_session(config, on).await?;
        let on_origin = |e: String| format!("origin {}: {e}", origin.name);
        let tables: Vec<String> = set_user_tables(&mut conn, name)
            .await
            .map_err(on_origin)?
            .ok_or_else(|| on_origin(format!("no set named {name} in {}", on.database)))?
            .into_iter()
            .map(|t| t.sql_name)
            .collect();
        let patterns = set_patterns(&mut conn, name).await.map_err(on_origin)?;
        let to: Vec<String> = std::iter::once(new_origin.to_owned())
            .chain(others.iter().cloned())
            .collect();
        let mut subscribers = given_subscribers(&mut conn, name, (&to, &config.server_tls))
            .await
            .map_err(|e| format!("{e}; nothing was changed"))?;
        let target = subscribers.remove(0);
        Ok(Move {
            name,
            database: &on.database,
            origin_conninfo: origin_conninfo(config, &origin, &on.database),
            origin,
            conn,
            tables,
            patterns,
            target,
            rest: subscribers,
        })
    }

    fn subscribers(&self) -> impl Iterator<Item = &Subscriber> {
        std::iter::once(&self.target).chain(&self.rest)
    }

    /// Under the lock: every subscriber applies what the origin committed before (the set's
    /// marker), and their sequences are put where the origin's are.
    async fn catch_up(&mut self) -> Result<(), String> {
        let origin = self.origin.name.clone();
        let mark = raise_mark(&mut self.conn, self.name)
            .await
            .map_err(|e| format!("origin {origin}: {e}; nothing was changed"))?;
        for node in self.subscribers() {
            wait_applied(&mut &node.client, self.name, mark, CATCH_UP_WAIT)
                .await
                .map_err(|e| {
                    format!(
                        "{}: {e}; the move was abandoned before anything changed (the lock goes with this session)",
                        node.shown
                    )
                })?;
        }
        let everyone: Vec<(&str, &tokio_postgres::Client)> = std::iter::once(&self.target)
            .chain(&self.rest)
            .map(|n| (n.shown.as_str(), &n.client))
            .collect();
        sync_sequences(&mut self.conn, &origin, self.name, &everyone).await?;
        Ok(())
    }

    /// The new origin publishes the set and the others follow it; the old origin's refusal of
    /// writes and the end of its publication wait in the lock's transaction. `done` says how
    /// far it got.
    async fn repoint(&mut self, lock: &mut ServerConn, done: &mut Repointed) -> Result<(), String> {
        let at = |node: &Subscriber, e: tokio_postgres::Error| {
            format!("{}: {}", node.shown, pg_error(&e))
        };
        let target = &self.target;
        target
            .client
            .batch_execute(&set::drop_subscription_sql(&target.subscription, false))
            .await
            .map_err(|e| at(target, e))?;
        done.target_left = true;
        // One transaction: if it fails, the new origin publishes nothing of the set.
        target
            .client
            .batch_execute(&set::adopt_sql(
                self.name,
                (
                    (&self.patterns.tables, &self.patterns.sequences),
                    &self.patterns.excluded,
                ),
                &self.table_names(),
            ))
            .await
            .map_err(|e| at(target, e))?;
        done.target_publishes = true;
        for node in &self.rest {
            done.rest.push((false, false));
            let last = done.rest.len() - 1;
            node.client
                .batch_execute(&set::drop_subscription_sql(&node.subscription, true))
                .await
                .map_err(|e| at(node, e))?;
            done.rest[last].0 = true;
            drop_old_slot(&mut self.conn, &self.origin.name, &node.subscription).await?;
            self.follow(node, &target.conninfo).await?;
            done.rest[last].1 = true;
        }
        let on_origin =
            |e: pgherd_proxy::server::QueryError| format!("origin {}: {e}", self.origin.name);
        lock.simple_query(&set::deny_writes_sql(
            self.name,
            &target.shown,
            &self.table_names(),
        ))
        .await
        .map_err(on_origin)?;
        lock.simple_query(&set::release_sql(self.name))
            .await
            .map_err(on_origin)?;
        lock.simple_query("COMMIT").await.map_err(on_origin)?;
        Ok(())
    }

    /// Puts back what [`Self::repoint`] did, the lock still held: each subscriber follows the
    /// old origin again from where it is, and the new origin publishes nothing.
    async fn undo(&mut self, done: &Repointed) -> Result<(), String> {
        let mut failed = Vec::new();
        // A step that failed inside its transaction left it open and aborted.
        for node in self.subscribers() {
            let _ = node.client.batch_execute("ROLLBACK").await;
        }
        for (node, (left, follows_new)) in self.rest.iter().zip(&done.rest) {
            if *follows_new {
                if let Err(e) = node
                    .client
                    .batch_execute(&set::drop_subscription_sql(&node.subscription, false))
                    .await
                {
                    failed.push(format!("{}: {}", node.shown, pg_error(&e)));
                    continue;
                }
            }
            if *left {
                // A slot left on the old origin (its drop failed) would refuse the name.
                let followed = match drop_old_slot(
                    &mut self.conn,
                    &self.origin.name,
                    &node.subscription,
                )
                .await
                {
                    Ok(()) => self.follow(node, &self.origin_conninfo).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = followed {
                    failed.push(e);
                }
            }
        }
        if done.target_publishes {
            if let Err(e) = self
                .target
                .client
                .batch_execute(&set::release_sql(self.name))
                .await
            {
                failed.push(format!("{}: {}", self.target.shown, pg_error(&e)));
            }
        }
        if done.target_left {
            if let Err(e) = self.follow(&self.target, &self.origin_conninfo).await {
                failed.push(e);
            }
        }
        match failed.is_empty() {
            true => Ok(()),
            false => Err(failed.join("; ")),
        }
    }

    /// `node` follows the origin `conninfo` reaches from where it is (no copy).
    async fn follow(&self, node: &Subscriber, conninfo: &str) -> Result<(), String> {
        node.client
            .batch_execute(&set::subscribe_sql(
                self.name,
                &node.subscription,
                conninfo,
                Copy::Nothing,
            ))
            .await
            .map_err(|e| format!("{}: {}", node.shown, pg_error(&e)))
    }

    /// After the old origin's refusal is committed: it follows the new origin, whose tables
    /// then take writes, and which records its subscribers. What could not be done, said.
    async fn finish(&mut self) -> Vec<String> {
        let mut left = Vec::new();
        let old_label = format!(
            "{}:{}/{}",
            self.origin.host, self.origin.port, self.database
        );
        let old_subscription = set::subscription(self.name, &old_label);
        // Before the new origin takes writes: a subscription starts from where the origin is.
        let follows = self
            .conn
            .simple_query(&set::subscribe_sql(
                self.name,
                &old_subscription,
                &self.target.conninfo,
                Copy::Nothing,
            ))
            .await;
        if let Err(e) = &follows {
            left.push(format!(
                "{} does not follow the new origin ({e}): its copies of the set's tables stay as they were at the move and refuse writes",
                self.origin.name
            ));
        }
        if let Err(e) = self
            .target
            .client
            .batch_execute(&set::allow_writes_sql(self.name, &self.table_names()))
            .await
        {
            left.push(format!(
                "{} still refuses writes to the set's tables ({}): drop its pgherd_deny_{} triggers",
                self.target.shown,
                pg_error(&e),
                self.name
            ));
        }
        let mut record: Vec<String> = self
            .rest
            .iter()
            .map(|n| set::record_subscriber_sql(self.name, &n.subscription, &n.shown))
            .collect();
        if follows.is_ok() {
            record.push(set::record_subscriber_sql(
                self.name,
                &old_subscription,
                &old_label,
            ));
        }
        if let Err(e) = self.target.client.batch_execute(&record.join("; ")).await {
            left.push(format!(
                "{} did not record the set's subscribers ({}): set list there does not show them",
                self.target.shown,
                pg_error(&e)
            ));
        }
        left
    }

    fn table_names(&self) -> Vec<&str> {
        self.tables.iter().map(String::as_str).collect()
    }
}

/// A subscriber's slot on the old origin, once its sender let it go.
pub(crate) async fn drop_old_slot(
    conn: &mut ServerConn,
    origin: &str,
    slot: &str,
) -> Result<(), String> {
    match drop_slot_when_released(conn, slot, SLOT_RELEASE_WAIT).await {
        Ok(_) => Ok(()),
        Err(SlotDrop::Failed(e)) => Err(format!("origin {origin}: slot {slot} was not dropped: {e}")),
        Err(SlotDrop::StillActive { waited_s }) => Err(format!(
            "origin {origin}: slot {slot} is still in use {waited_s} s after its subscription was detached"
        )),
    }
}
