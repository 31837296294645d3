//! `pgherd set move NAME --new-origin CONNINFO [--to OTHER...]`: a replication set's origin
//! moves to one of its subscribers, as Slony-I's MOVE SET, with no lost write. Writes to the
//! set's tables are held on the old origin (an EXCLUSIVE lock: reads go on); every subscriber
//! applies everything before (the set's marker); sequences are put in step; the new origin
//! publishes the set, the other subscribers and the old origin subscribe to it from where they
//! are (no copy), the old origin's tables refuse local writes from then on (the writers held
//! back get 25006 naming the new origin, so no write is acknowledged and lost), and the new
//! origin's tables take writes.

use std::time::{Duration, Instant};

use pgherd_config::Config;
use pgherd_replication::consistency::quote_literal;
use pgherd_replication::sets as set;

use crate::clone::session_in;
use crate::sets::{
    client_rows, connect_subscriber, first, origin_session, pg_error, set_tables, subscriber_at,
    sync_sequences, tables_of, Origin,
};

/// A subscriber taking part in the move.
struct Node {
    shown: String,
    conninfo: String,
    subscription: String,
    client: tokio_postgres::Client,
}

pub(crate) async fn move_set(
    name: &str,
    new_origin: &str,
    others: &[String],
    on: &Origin,
) -> Result<(), String> {
    set::check_name(name).map_err(|e| e.to_string())?;
    let config = Config::load(&on.at.config_path()?).map_err(|e| e.to_string())?;
    let (origin, mut conn) = origin_session(&config, on).await?;
    let on_origin = |e: String| format!("origin {}: {e}", origin.name);
    let members = set_tables(&mut conn, name)
        .await
        .map_err(on_origin)?
        .ok_or_else(|| on_origin(format!("no set named {name} in {}", on.database)))?;
    let tables: Vec<String> = tables_of(&mut conn)
        .await
        .map_err(on_origin)?
        .into_iter()
        .filter(|t| members.contains(&t.name) && !t.name.starts_with("pgherd."))
        .map(|t| t.sql_name)
        .collect();
    let tables: Vec<&str> = tables.iter().map(String::as_str).collect();
    let rows = conn
        .simple_query(&set::patterns_sql(name))
        .await
        .map_err(|e| on_origin(e.to_string()))?;
    let row = rows
        .first()
        .ok_or_else(|| on_origin(format!("no set named {name}")))?;
    let array = |i: usize| -> Vec<String> {
        row.get(i)
            .cloned()
            .flatten()
            .and_then(|a| serde_json::from_str(&a).ok())
            .unwrap_or_default()
    };
    let (patterns, sequences) = (array(0), array(1));
    let recorded = recorded_subscribers(&mut conn, name)
        .await
        .map_err(on_origin)?;
    let target = connect(new_origin, &recorded).await?;
    let mut rest = Vec::new();
    for conninfo in others {
        rest.push(connect(conninfo, &recorded).await?);
    }
    let given: Vec<&str> = std::iter::once(target.shown.as_str())
        .chain(rest.iter().map(|n| n.shown.as_str()))
        .collect();
    let left_out: Vec<&str> = recorded
        .iter()
        .map(|(_, s)| s.as_str())
        .filter(|s| !given.contains(s))
        .collect();
    if !left_out.is_empty() {
        return Err(format!(
            "set {name}: its subscriber(s) {} were not given with --to: they would stop receiving the set; nothing was changed",
            left_out.join(", ")
        ));
    }

    // Writes to the set's tables wait on the old origin from here.
    let mut lock = session_in(&config, &origin, &on.database).await?;
    lock.simple_query(&format!(
        "BEGIN; SET LOCAL lock_timeout = '10s'; LOCK TABLE {} IN EXCLUSIVE MODE",
        tables.join(", ")
    ))
    .await
    .map_err(|e| {
        on_origin(format!(
            "the set's tables could not be locked: {e}; nothing was changed"
        ))
    })?;
    let held = Instant::now();
    let mark: i64 = first(
        &conn
            .simple_query(&set::raise_mark_sql(name))
            .await
            .map_err(|e| on_origin(e.to_string()))?,
    )
    .and_then(|m| m.parse().ok())
    .ok_or_else(|| on_origin(format!("set {name} has no marker row")))?;
    for node in std::iter::once(&target).chain(&rest) {
        applied(&node.client, name, mark).await.map_err(|e| {
            format!(
                "{}: {e}; the move was abandoned before anything changed (the lock goes with this session)",
                node.shown
            )
        })?;
    }
    let everyone: Vec<(&str, &tokio_postgres::Client)> = std::iter::once(&target)
        .chain(&rest)
        .map(|n| (n.shown.as_str(), &n.client))
        .collect();
    sync_sequences(&mut conn, &origin.name, name, &everyone).await?;

    // The new origin stops following and publishes the set.
    let at = |node: &Node, e: tokio_postgres::Error| format!("{}: {}", node.shown, pg_error(&e));
    target
        .client
        .batch_execute(&set::drop_subscription_sql(&target.subscription, false))
        .await
        .map_err(|e| at(&target, e))?;
    target
        .client
        .batch_execute(&set::adopt_sql(name, (&patterns, &sequences), &tables))
        .await
        .map_err(|e| at(&target, e))?;
    // The other subscribers follow it from where they are.
    for node in &rest {
        node.client
            .batch_execute(&set::drop_subscription_sql(&node.subscription, true))
            .await
            .map_err(|e| at(node, e))?;
        conn.simple_query(&format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = {}",
            quote_literal(&node.subscription)
        ))
        .await
        .map_err(|e| on_origin(e.to_string()))?;
        node.client
            .batch_execute(&set::follow_sql(name, &node.subscription, &target.conninfo))
            .await
            .map_err(|e| at(node, e))?;
    }
    // The old origin refuses local writes to the set's tables (the writers held back get the
    // refusal when the lock goes) and follows the new origin.
    let old_label = format!("{}:{}/{}", origin.host, origin.port, on.database);
    lock.simple_query(&set::deny_writes_sql(name, &target.shown, &tables))
        .await
        .map_err(|e| on_origin(e.to_string()))?;
    lock.simple_query(&set::release_sql(name))
        .await
        .map_err(|e| on_origin(e.to_string()))?;
    lock.simple_query("COMMIT")
        .await
        .map_err(|e| on_origin(e.to_string()))?;
    let old_subscription = set::subscription(name, &old_label);
    conn.simple_query(&set::follow_sql(name, &old_subscription, &target.conninfo))
        .await
        .map_err(|e| on_origin(e.to_string()))?;
    // Then the new origin takes writes, and knows its subscribers.
    target
        .client
        .batch_execute(&set::allow_writes_sql(name, &tables))
        .await
        .map_err(|e| at(&target, e))?;
    let paused_ms = held.elapsed().as_millis();
    let mut record = vec![set::record_subscriber_sql(
        name,
        &old_subscription,
        &old_label,
    )];
    record.extend(
        rest.iter()
            .map(|n| set::record_subscriber_sql(name, &n.subscription, &n.shown)),
    );
    target
        .client
        .batch_execute(&record.join("; "))
        .await
        .map_err(|e| at(&target, e))?;
    println!(
        "set {name} moved from {} to {}: writes to its tables were held {paused_ms} ms; {} follow{} {}; writes to the set's tables on {} are refused (25006)",
        origin.name,
        target.shown,
        std::iter::once(origin.name.as_str())
            .chain(rest.iter().map(|n| n.shown.as_str()))
            .collect::<Vec<_>>()
            .join(", "),
        if rest.is_empty() { "s" } else { "" },
        target.shown,
        origin.name
    );
    Ok(())
}

/// The set's subscribers as the origin recorded them: (subscription, subscriber).
async fn recorded_subscribers(
    conn: &mut pgherd_proxy::server::ServerConn,
    name: &str,
) -> Result<Vec<(String, String)>, String> {
    let rows = conn
        .simple_query(&format!(
            "SELECT subscription, subscriber FROM pgherd.set_subscribers WHERE set_name = {}",
            quote_literal(name)
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

async fn connect(conninfo: &str, recorded: &[(String, String)]) -> Result<Node, String> {
    let (shown, parsed) = subscriber_at(conninfo)?;
    let Some((subscription, _)) = recorded.iter().find(|(_, s)| *s == shown) else {
        return Err(format!(
            "{shown} does not subscribe to the set; nothing was changed"
        ));
    };
    let client = connect_subscriber(&shown, &parsed)
        .await
        .map_err(|e| format!("{e}; nothing was changed"))?;
    Ok(Node {
        shown,
        conninfo: conninfo.to_owned(),
        subscription: subscription.clone(),
        client,
    })
}

/// Waits until a subscriber (`client`) shows the set's marker `mark` (at most 30 s): it has
/// applied every change the origin committed before the marker was raised.
pub(crate) async fn applied(
    client: &tokio_postgres::Client,
    name: &str,
    mark: i64,
) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let rows = client_rows(client, &set::applied_mark_sql(name))
            .await
            .map_err(|e| pg_error(&e))?;
        if first(&rows).and_then(|m| m.parse::<i64>().ok()) >= Some(mark) {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(30) {
            return Err("it did not apply the set's changes within 30 s".to_owned());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
