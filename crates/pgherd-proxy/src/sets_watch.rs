//! The replication sets of `[sets] databases` (made and moved by `pgherd set`), read from the
//! primary every `poll_ms`, for `SHOW SETS`, `/api/sets` and the metrics: each set's tables
//! and, per subscriber, whether it streams and how far behind it is. Reads nothing when no
//! database is named.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pgherd_replication::sets::{read_list, SetStatus, HAS_CATALOG_SQL, LIST_SQL};

use crate::app::App;
use crate::nodes::NodeState;
use crate::views::Table;

/// What the last reading found.
#[derive(Default)]
pub struct SetsWatch(Mutex<Seen>);

#[derive(Default, Clone)]
struct Seen {
    /// (database, origin node, set).
    sets: Vec<(String, String, SetStatus)>,
    /// (database, why it could not be read).
    errors: Vec<(String, String)>,
}

/// Reads the sets every `poll_ms` until pgherd stops.
pub async fn watch(app: Arc<App>) {
    let mut shutdown = app.shutdown_signal();
    loop {
        let settings = app.config().sets.clone();
        // With no databases named (also after a reload emptied the list) nothing is shown.
        let mut seen = Seen::default();
        match app.nodes.writer() {
            Some(writer) => {
                // A primary that does not answer leaves its database's sets unknown, not the
                // others' stale.
                let limit = Duration::from_millis(app.config().cluster.health_check_timeout_ms);
                for database in &settings.databases {
                    let answer = tokio::time::timeout(limit, read(&app, &writer, database)).await;
                    match answer.unwrap_or_else(|_| {
                        Err(format!("no answer within {} ms", limit.as_millis()))
                    }) {
                        Ok(sets) => seen.sets.extend(
                            sets.into_iter()
                                .map(|s| (database.clone(), writer.name().to_owned(), s)),
                        ),
                        Err(e) => seen.errors.push((database.clone(), e)),
                    }
                }
            }
            None => seen.errors.extend(
                settings
                    .databases
                    .iter()
                    .map(|d| (d.clone(), "no primary to read the sets from".to_owned())),
            ),
        }
        *app.sets.0.lock() = seen;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(settings.poll_ms)) => {}
            _ = shutdown.changed() => return,
        }
    }
}

async fn read(app: &App, node: &NodeState, database: &str) -> Result<Vec<SetStatus>, String> {
    let config = app.config();
    let mut conn = crate::monitor::management_connection(
        node,
        &config.cluster,
        &app.connect_context(),
        database,
    )
    .await
    .map_err(|e| e.to_string())?;
    let has = conn
        .simple_query(HAS_CATALOG_SQL)
        .await
        .map_err(|e| e.to_string())?;
    if has
        .first()
        .and_then(|r| r.first())
        .cloned()
        .flatten()
        .as_deref()
        != Some("true")
    {
        return Ok(Vec::new());
    }
    let rows = conn
        .simple_query(LIST_SQL)
        .await
        .map_err(|e| e.to_string())?;
    Ok(read_list(&rows))
}

/// One row per set and subscriber (a set without one: a row of its own), then one per
/// database that could not be read.
pub fn view(app: &App) -> Table {
    let columns = &[
        "database",
        "set",
        "origin",
        "tables",
        "subscriber",
        "subscription",
        "streaming",
        "lag_bytes",
        "error",
    ];
    let seen = app.sets.0.lock().clone();
    let mut rows = Vec::new();
    for (database, origin, set) in &seen.sets {
        let base = |subscriber: Option<&pgherd_replication::sets::SubscriberStatus>| {
            vec![
                database.clone().into(),
                set.name.clone().into(),
                origin.clone().into(),
                set.tables.join(", ").into(),
                subscriber.map(|s| s.subscriber.clone()).into(),
                subscriber.map(|s| s.subscription.clone()).into(),
                subscriber.map(|s| s.streaming).into(),
                subscriber
                    .and_then(|s| s.lag_bytes)
                    .map(|b| b.max(0) as u64)
                    .into(),
                crate::views::Cell::from(""),
            ]
        };
        match set.subscribers.as_slice() {
            [] => rows.push(base(None)),
            subscribers => rows.extend(subscribers.iter().map(|s| base(Some(s)))),
        }
    }
    for (database, error) in &seen.errors {
        let mut row: Vec<crate::views::Cell> = vec![database.clone().into()];
        row.extend((0..7).map(|_| crate::views::Cell::from(Option::<String>::None)));
        row.push(error.clone().into());
        rows.push(row);
    }
    Table { columns, rows }
}

/// One subscriber of a set, for the metrics.
pub struct SubscriberFigures {
    pub database: String,
    pub set: String,
    pub subscriber: String,
    /// Unknown while its slot has confirmed nothing.
    pub lag_bytes: Option<i64>,
    pub streaming: bool,
}

impl SubscriberFigures {
    /// The labels of its samples.
    pub fn labels(&self) -> [(&str, &str); 3] {
        [
            ("database", self.database.as_str()),
            ("set", self.set.as_str()),
            ("subscriber", self.subscriber.as_str()),
        ]
    }
}

/// Every subscriber of the sets followed.
pub fn subscriber_figures(app: &App) -> Vec<SubscriberFigures> {
    let seen = app.sets.0.lock();
    seen.sets
        .iter()
        .flat_map(|(database, _, set)| {
            set.subscribers.iter().map(move |s| SubscriberFigures {
                database: database.clone(),
                set: set.name.clone(),
                subscriber: s.subscriber.clone(),
                lag_bytes: s.lag_bytes,
                streaming: s.streaming,
            })
        })
        .collect()
}
