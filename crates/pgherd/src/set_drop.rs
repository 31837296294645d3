//! `pgherd set drop-tables NAME --tables PATTERN... --to SUBSCRIBER...`: tables leave a
//! replication set, as Slony-I's SET DROP TABLE. On the origin they leave the set's
//! publication and are recorded as taken out (a scan does not add them back while they match
//! the set's patterns); each subscriber refreshes its subscription, which stops applying them,
//! and its copies stop refusing local writes: they are its own tables from then on. Nothing is
//! dropped and no row is removed anywhere.
//!
//! `pgherd set drop NAME --to SUBSCRIBER...`: the whole set goes, as Slony-I's DROP SET: each
//! subscriber's subscription and its slot on the origin, the copies' deny-write triggers and
//! marker table, then the origin's publication, catalog rows and marker table. No table and
//! no row is dropped: the subscribers' copies are their own tables from then on.

use pgherd_replication::sets as set;

use crate::set_move::drop_old_slot;
use crate::set_nodes::{given_subscribers, open_set, OpenSet};
use crate::sets::Origin;
use crate::sql_session::pg_error;

pub(crate) async fn drop_tables(
    name: &str,
    patterns: &[String],
    to: &[String],
    on: &Origin,
) -> Result<(), String> {
    let OpenSet {
        config,
        origin,
        mut conn,
        tables: members,
    } = open_set(name, on).await?;
    let on_origin = |e: String| format!("origin {}: {e}", origin.name);
    let chosen = set::choose_members(&members, patterns)
        .map_err(|e| format!("set {name}: {e}; nothing was changed"))?;
    let subscribers = given_subscribers(&mut conn, name, (to, &config.server_tls))
        .await
        .map_err(|e| format!("{e}; nothing was changed"))?;
    // A catalog made before tables could leave a set gains the column that records them.
    conn.simple_query(set::CATALOG_SQL)
        .await
        .map_err(|e| on_origin(e.to_string()))?;
    conn.simple_query(&set::drop_tables_sql(name, &chosen))
        .await
        .map_err(|e| on_origin(format!("{e}; nothing was changed")))?;
    let tables: Vec<&str> = chosen.iter().map(|t| t.sql_name.as_str()).collect();
    for s in &subscribers {
        let left = |e: tokio_postgres::Error| {
            format!(
                "subscriber {}: {}; the tables left the set on the origin: there, run ALTER SUBSCRIPTION {} REFRESH PUBLICATION and drop their pgherd_deny_{name} triggers",
                s.shown,
                pg_error(&e),
                set::quote_ident(&s.subscription)
            )
        };
        s.client
            .batch_execute(&set::refresh_sql(&s.subscription))
            .await
            .map_err(left)?;
        s.client
            .batch_execute(&set::allow_writes_sql(name, &tables))
            .await
            .map_err(left)?;
    }
    let names: Vec<&str> = chosen.iter().map(|t| t.name.as_str()).collect();
    println!(
        "set {name}: {} left it on {}{}",
        names.join(", "),
        origin.name,
        match subscribers.len() {
            0 => String::new(),
            _ => format!(
                "; {} keep{} {} as {} own (writable, no longer replicated)",
                subscribers
                    .iter()
                    .map(|s| s.shown.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                if subscribers.len() == 1 { "s" } else { "" },
                if names.len() == 1 { "it" } else { "them" },
                if subscribers.len() == 1 {
                    "its"
                } else {
                    "their"
                }
            ),
        }
    );
    Ok(())
}

pub(crate) async fn drop_set(name: &str, to: &[String], on: &Origin) -> Result<(), String> {
    let OpenSet {
        config,
        origin,
        mut conn,
        tables: members,
    } = open_set(name, on).await?;
    let on_origin = |e: String| format!("origin {}: {e}", origin.name);
    let subscribers = given_subscribers(&mut conn, name, (to, &config.server_tls))
        .await
        .map_err(|e| format!("{e}; nothing was changed"))?;
    let tables: Vec<&str> = members.iter().map(|t| t.sql_name.as_str()).collect();
    for s in &subscribers {
        let on_subscriber = |e: tokio_postgres::Error| {
            format!(
                "subscriber {}: {}; set {name} is still on {} (run this again)",
                s.shown,
                pg_error(&e),
                origin.name
            )
        };
        s.client
            .batch_execute(&set::drop_subscription_sql(&s.subscription, true))
            .await
            .map_err(on_subscriber)?;
        s.client
            .batch_execute(&set::leave_set_sql(name, &tables))
            .await
            .map_err(on_subscriber)?;
        drop_old_slot(&mut conn, &origin.name, &s.subscription).await?;
    }
    conn.simple_query(&set::drop_set_sql(name))
        .await
        .map_err(|e| on_origin(e.to_string()))?;
    let shown: Vec<&str> = subscribers.iter().map(|s| s.shown.as_str()).collect();
    println!(
        "set {name} dropped on {}{}; no table was dropped",
        origin.name,
        match shown.as_slice() {
            [] => String::new(),
            s => format!(
                "; {} keep{} the copies as {} own",
                s.join(", "),
                if s.len() == 1 { "s" } else { "" },
                if s.len() == 1 { "its" } else { "their" }
            ),
        }
    );
    Ok(())
}
