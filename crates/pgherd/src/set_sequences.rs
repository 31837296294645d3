//! `pgherd set add-sequences` and `set drop-sequences`: which sequences a replication set keeps
//! in step on its subscribers (logical replication does not carry them in PostgreSQL 15). Added
//! sequence patterns join the set's and the sequences are put in step on the subscribers given;
//! a sequence taken out is recorded as excluded (a table and a sequence of one schema never
//! share a name) and the subscribers keep their own, which nothing moves any more.

use pgherd_replication::sets::{self as set, SetArray};

use crate::set_nodes::{open_set, OpenSet};
use crate::sets::{
    connect_subscriber, sequences_of, set_sequences_on, subscriber_at, sync_sequences, Origin,
};
use crate::sql_session::SqlSession;

pub(crate) async fn add_sequences(
    name: &str,
    patterns: &[String],
    to: &[String],
    on: &Origin,
) -> Result<(), String> {
    let OpenSet {
        config,
        origin,
        mut conn,
        ..
    } = open_set(name, on).await?;
    let on_origin = |e: String| format!("origin {}: {e}", origin.name);
    let all = sequences_of(
        &conn
            .rows(set::SEQUENCES_SQL)
            .await
            .map_err(|e| on_origin(e.to_string()))?,
    );
    set::choose_sequences(&all, patterns)
        .map_err(|e| format!("set {name}: {e}; nothing was changed"))?;
    let mut subscribers = Vec::new();
    for conninfo in to {
        let (shown, parsed) = subscriber_at(conninfo)?;
        subscribers.push((
            shown.clone(),
            connect_subscriber(&shown, &parsed, &config.server_tls).await?,
        ));
    }
    let now = crate::set_nodes::set_patterns(&mut conn, name)
        .await
        .map_err(on_origin)?;
    let (sequences, mut taken_back) = set::with_patterns(&now.sequences, &now.excluded, patterns);
    // Only sequences come back: a table taken out stays out, whatever the patterns name.
    taken_back.retain(|e| all.iter().any(|(sequence, _)| sequence == e));
    let excluded: Vec<String> = now
        .excluded
        .into_iter()
        .filter(|e| !taken_back.contains(e))
        .collect();
    conn.simple_query(&format!(
        "BEGIN; {}; {}; COMMIT",
        set::set_array_sql(name, SetArray::Sequences, &sequences),
        set::set_array_sql(name, SetArray::Excluded, &excluded)
    ))
    .await
    .map_err(|e| on_origin(format!("{e}; nothing was changed")))?;
    let subscribers: Vec<(&str, &tokio_postgres::Client)> =
        subscribers.iter().map(|(s, c)| (s.as_str(), c)).collect();
    let count = sync_sequences(&mut conn, &origin.name, name, &subscribers)
        .await
        .map_err(|e| {
            format!("{e}; the set keeps the sequences in step from now on: create them there, then run set sync-sequences")
        })?;
    println!(
        "set {name}: its sequence patterns are {}; {count} sequence{} in step{}",
        sequences.join(", "),
        if count == 1 { "" } else { "s" },
        match subscribers.as_slice() {
            [] => String::new(),
            s => format!(
                " on {}",
                s.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        }
    );
    Ok(())
}

pub(crate) async fn drop_sequences(
    name: &str,
    patterns: &[String],
    on: &Origin,
) -> Result<(), String> {
    let OpenSet {
        origin, mut conn, ..
    } = open_set(name, on).await?;
    let on_origin = |e: String| format!("origin {}: {e}", origin.name);
    let kept = set_sequences_on(&mut conn, name).await.map_err(on_origin)?;
    let chosen: Vec<String> = kept
        .iter()
        .filter(|(sequence, _)| pgherd_replication::consistency::table_selected(sequence, patterns))
        .map(|(sequence, _)| sequence.clone())
        .collect();
    if chosen.is_empty() {
        return Err(format!(
            "set {name}: the patterns {} match no sequence it keeps in step; nothing was changed",
            patterns.join(", ")
        ));
    }
    let mut excluded = crate::set_nodes::set_patterns(&mut conn, name)
        .await
        .map_err(on_origin)?
        .excluded;
    excluded.extend(chosen.iter().cloned());
    // A catalog made before anything could leave a set gains the column that records it.
    conn.simple_query(set::CATALOG_SQL)
        .await
        .map_err(|e| on_origin(e.to_string()))?;
    conn.simple_query(&set::set_array_sql(name, SetArray::Excluded, &excluded))
        .await
        .map_err(|e| on_origin(format!("{e}; nothing was changed")))?;
    println!(
        "set {name}: {} no longer kept in step; the subscribers keep their own",
        chosen.join(", ")
    );
    Ok(())
}
