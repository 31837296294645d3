//! What the set commands (`set move`, `execute-script`, `shard move`, `check-consistency
//! --set`) share about a set's nodes: its user tables on the origin, the subscribers the
//! origin recorded matched with those a command was given, the set's marker raised on the
//! origin and awaited on a subscriber, and a slot dropped once its sender let it go.

use std::time::{Duration, Instant};

use pgherd_proxy::server::ServerConn;
use pgherd_replication::consistency::{quote_literal, TableShape};
use pgherd_replication::sets as set;

use crate::sets::{connect_subscriber, set_tables, subscriber_at, tables_of};
use crate::sql_session::{first, QueryFailure, SqlSession};

/// A subscriber a command was given (`--to`), matched with the subscription the origin
/// recorded for it.
pub(crate) struct Subscriber {
    /// Where it is, as shown and recorded (never its password).
    pub(crate) shown: String,
    /// As given: how the others reach it (a set's new origin).
    pub(crate) conninfo: String,
    pub(crate) subscription: String,
    pub(crate) client: tokio_postgres::Client,
}

/// Where a set command starts: the config, the set's origin and a session on it, and the set's
/// user tables there.
pub(crate) struct OpenSet {
    pub(crate) config: pgherd_config::Config,
    pub(crate) origin: pgherd_config::NodeConfig,
    pub(crate) conn: ServerConn,
    pub(crate) tables: Vec<TableShape>,
}

/// The set `name` on its origin (`--origin`, or the primary): its name checked, the config
/// loaded; refused if the origin has no such set.
pub(crate) async fn open_set(name: &str, on: &crate::sets::Origin) -> Result<OpenSet, String> {
    set::check_name(name).map_err(|e| e.to_string())?;
    let config = pgherd_config::Config::load(&on.at.config_path()?).map_err(|e| e.to_string())?;
    let (origin, mut conn) = crate::sets::origin_session(&config, on).await?;
    let tables = set_user_tables(&mut conn, name)
        .await
        .map_err(|e| format!("origin {}: {e}", origin.name))?
        .ok_or_else(|| {
            format!(
                "origin {}: no set named {name} in {}",
                origin.name, on.database
            )
        })?;
    Ok(OpenSet {
        config,
        origin,
        conn,
        tables,
    })
}

/// The set's user tables on the origin (its marker table left out), each with its row filter,
/// or `None` if the origin has no such set.
pub(crate) async fn set_user_tables(
    origin: &mut impl SqlSession,
    set_name: &str,
) -> Result<Option<Vec<TableShape>>, String> {
    let Some(members) = set_tables(origin, set_name).await? else {
        return Ok(None);
    };
    let filters = row_filters(origin, set_name).await?;
    Ok(Some(
        tables_of(origin)
            .await?
            .into_iter()
            .filter(|t| members.contains(&t.name) && !t.name.starts_with("pgherd."))
            .map(|t| TableShape {
                row_filter: filters.get(&t.name).cloned(),
                ..t
            })
            .collect(),
    ))
}

/// The row filters of the set's publication, by table (read through `to_jsonb`, so that a
/// server before PostgreSQL 15, without row filters, answers none).
async fn row_filters(
    origin: &mut impl SqlSession,
    set_name: &str,
) -> Result<std::collections::BTreeMap<String, String>, String> {
    let sql = format!(
        "SELECT coalesce(json_object_agg(schemaname || '.' || tablename, to_jsonb(t)->>'rowfilter') \
                FILTER (WHERE to_jsonb(t)->>'rowfilter' IS NOT NULL), '{{}}')::text \
           FROM pg_publication_tables t WHERE pubname = {}",
        quote_literal(&set::publication(set_name))
    );
    let rows = origin.rows(&sql).await.map_err(|e| e.to_string())?;
    Ok(first(&rows)
        .and_then(|json| serde_json::from_str(&json).ok())
        .unwrap_or_default())
}

/// What the origin keeps of a set besides its publication.
#[derive(Debug, Default)]
pub(crate) struct SetPatterns {
    pub(crate) tables: Vec<String>,
    pub(crate) sequences: Vec<String>,
    /// Tables taken out (`set drop-tables`): a scan does not add them back.
    pub(crate) excluded: Vec<String>,
}

/// The set's patterns as the origin keeps them (empty if it has no such set).
pub(crate) async fn set_patterns(
    origin: &mut impl SqlSession,
    set_name: &str,
) -> Result<SetPatterns, String> {
    let rows = origin
        .rows(&set::patterns_sql(set_name))
        .await
        .map_err(|e| e.to_string())?;
    let array = |i: usize| -> Vec<String> {
        rows.first()
            .and_then(|row| row.get(i).cloned().flatten())
            .and_then(|a| serde_json::from_str(&a).ok())
            .unwrap_or_default()
    };
    Ok(SetPatterns {
        tables: array(0),
        sequences: array(1),
        excluded: array(2),
    })
}

/// The set's subscribers as the origin recorded them: (subscription, subscriber).
pub(crate) async fn recorded_subscribers(
    origin: &mut ServerConn,
    set_name: &str,
) -> Result<Vec<(String, String)>, String> {
    let rows = origin
        .simple_query(&format!(
            "SELECT subscription, subscriber FROM pgherd.set_subscribers WHERE set_name = {} ORDER BY 1",
            quote_literal(set_name)
        ))
        .await
        .map_err(|e| e.to_string())?;
    Ok(rows
        .iter()
        .map(|r| {
            let field = |i: usize| r.get(i).cloned().flatten().unwrap_or_default();
            (field(0), field(1))
        })
        .collect())
}

/// Each `--to` connected and matched with its recorded subscription, in the order given. Every
/// subscriber the set has must be among them (one left out would miss what the command does)
/// and each given one must be the set's (one it does not have would get it alone).
pub(crate) async fn given_subscribers(
    origin: &mut ServerConn,
    set_name: &str,
    (to, tls): (&[String], &pgherd_config::ServerTls),
) -> Result<Vec<Subscriber>, String> {
    let recorded = recorded_subscribers(origin, set_name).await?;
    let mut given = Vec::new();
    for conninfo in to {
        let (shown, config) = subscriber_at(conninfo)?;
        let Some((subscription, _)) = recorded.iter().find(|(_, s)| *s == shown) else {
            return Err(format!("set {set_name}: {shown} does not subscribe to it"));
        };
        let client = connect_subscriber(&shown, &config, tls).await?;
        given.push(Subscriber {
            shown,
            conninfo: conninfo.clone(),
            subscription: subscription.clone(),
            client,
        });
    }
    let missing: Vec<&str> = recorded
        .iter()
        .filter(|(_, s)| !given.iter().any(|g| g.shown == *s))
        .map(|(_, s)| s.as_str())
        .collect();
    match missing.as_slice() {
        [] => Ok(given),
        [one] => Err(format!(
            "set {set_name}: its subscriber {one} was not given with --to"
        )),
        many => Err(format!(
            "set {set_name}: its subscribers {} were not given with --to",
            many.join(", ")
        )),
    }
}

/// Raises the set's marker on the origin (committed at once, unless the session is in a
/// transaction); its new number. A subscriber that shows it has applied everything the origin
/// committed before.
pub(crate) async fn raise_mark(
    origin: &mut impl SqlSession,
    set_name: &str,
) -> Result<i64, QueryFailure> {
    let rows = origin.rows(&set::raise_mark_sql(set_name)).await?;
    first(&rows)
        .and_then(|m| m.parse().ok())
        .ok_or_else(|| QueryFailure::new(format!("set {set_name} has no marker row")))
}

/// Why a subscriber did not show a set's marker.
#[derive(Debug)]
pub(crate) enum MarkWait {
    Failed(QueryFailure),
    Behind {
        set: String,
        mark: i64,
        seen: Option<i64>,
        wait_ms: u128,
    },
}

impl std::fmt::Display for MarkWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MarkWait::Failed(e) => write!(f, "{e}"),
            MarkWait::Behind {
                set,
                mark,
                seen,
                wait_ms,
            } => write!(
                f,
                "it did not apply set {set}'s changes up to mark {mark} within {wait_ms} ms (applied {}): is its subscription running?",
                seen.map_or("none".to_owned(), |s| s.to_string())
            ),
        }
    }
}

/// Waits (at most `wait`) until the subscriber shows the set's marker `mark`.
pub(crate) async fn wait_applied(
    subscriber: &mut impl SqlSession,
    set_name: &str,
    mark: i64,
    wait: Duration,
) -> Result<(), MarkWait> {
    let started = Instant::now();
    loop {
        let rows = subscriber
            .rows(&set::applied_mark_sql(set_name))
            .await
            .map_err(MarkWait::Failed)?;
        let seen: Option<i64> = first(&rows).and_then(|m| m.parse().ok());
        if seen >= Some(mark) {
            return Ok(());
        }
        if started.elapsed() >= wait {
            return Err(MarkWait::Behind {
                set: set_name.to_owned(),
                mark,
                seen,
                wait_ms: wait.as_millis(),
            });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Why a slot was not dropped.
#[derive(Debug)]
pub(crate) enum SlotDrop {
    Failed(QueryFailure),
    /// A sender still streams from it after the wait.
    StillActive {
        waited_s: u64,
    },
}

/// Drops the replication slot `slot` if there is one, waiting (at most `wait`) for a sender
/// that has not yet noticed its receiver went; whether there was one.
pub(crate) async fn drop_slot_when_released(
    node: &mut impl SqlSession,
    slot: &str,
    wait: Duration,
) -> Result<bool, SlotDrop> {
    let slot = quote_literal(slot);
    let started = Instant::now();
    loop {
        let rows = node
            .rows(&format!(
                "SELECT active::text FROM pg_replication_slots WHERE slot_name = {slot}"
            ))
            .await
            .map_err(SlotDrop::Failed)?;
        match first(&rows).as_deref() {
            None => return Ok(false),
            Some("false") => {
                node.rows(&format!("SELECT pg_drop_replication_slot({slot})"))
                    .await
                    .map_err(SlotDrop::Failed)?;
                return Ok(true);
            }
            _ if started.elapsed() < wait => tokio::time::sleep(Duration::from_millis(20)).await,
            _ => {
                return Err(SlotDrop::StillActive {
                    waited_s: wait.as_secs(),
                })
            }
        }
    }
}
