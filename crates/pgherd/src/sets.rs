//! `pgherd set create|subscribe|sync-sequences|list` (and `move`, in `set_move.rs`): replication sets in the style of Slony-I on
//! PostgreSQL's logical replication. A set is chosen tables of one database on its origin (the
//! cluster's primary unless `--origin` names a node), published; a subscriber is another
//! cluster or database, given by a connection string, which subscribes to it: its rows are
//! copied (a progress bar per table) and their changes stream from then on. The decisions and
//! statements are `pgherd_replication::sets`; this is the IO.

use std::time::{Duration, Instant};

use pgherd_config::{Config, NodeConfig};
use pgherd_proxy::server::ServerConn;
use pgherd_replication::consistency::{quote_literal, TableShape, TABLES_SQL};
use pgherd_replication::sets::{self as set, SetError};

use crate::clone::session_in;
use crate::local::Where;
use crate::sql_session::{client_rows, first, pg_error, SqlSession};

#[derive(clap::Subcommand, Debug)]
pub enum SetCommand {
    /// Create a set on its origin: the tables the patterns select (`*` and `?`; `schema.table`
    /// or a table name in any schema), each with a primary key, published.
    Create {
        name: String,
        /// Table patterns, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        tables: Vec<String>,
        /// Sequence patterns, comma-separated: kept in step on the subscribers (logical
        /// replication does not carry sequences) at subscription and by `sync-sequences`.
        #[arg(long, value_delimiter = ',')]
        sequences: Vec<String>,
        #[command(flatten)]
        on: Origin,
    },
    /// Subscribe another cluster or database to a set: its tables must exist there (with
    /// their primary keys); their rows are copied, then their changes stream.
    Subscribe {
        name: String,
        /// The subscriber, as a libpq connection string (a superuser there).
        #[arg(long)]
        to: String,
        /// How long the initial copy may take before the command stops waiting for it (it
        /// goes on in PostgreSQL).
        #[arg(long, default_value_t = 600)]
        wait_s: u64,
        /// Copy the set anew from its origin (after a failover of the origin's cluster, whose
        /// logical slots PostgreSQL 15 does not carry to the promoted standby): the
        /// subscription detached from its old slot, the subscriber's copies emptied, the
        /// subscription made again with a full copy.
        #[arg(long)]
        again: bool,
        #[command(flatten)]
        on: Origin,
    },
    /// Put each subscriber's copies of the set's sequences where the origin's are (run it
    /// from cron, and before a subscriber takes writes).
    SyncSequences {
        name: String,
        /// Each subscriber, as a libpq connection string.
        #[arg(long, required = true)]
        to: Vec<String>,
        #[command(flatten)]
        on: Origin,
    },
    /// Move the set's origin to one of its subscribers with no lost write (Slony-I's MOVE
    /// SET): writes to its tables held on the old origin while every subscriber catches up,
    /// sequences put in step, the new origin publishing, the others and the old origin
    /// following it; the old origin's tables then refuse local writes.
    Move {
        name: String,
        /// The subscriber to become the origin, as a libpq connection string (the others
        /// and the old origin will connect to it with it).
        #[arg(long)]
        new_origin: String,
        /// Every other subscriber of the set.
        #[arg(long)]
        to: Vec<String>,
        #[command(flatten)]
        on: Origin,
    },
    /// Take tables out of a set (Slony-I's SET DROP TABLE): they leave its publication and
    /// stay out of its scan; each subscriber (every one, with `--to`) stops applying them and
    /// keeps them as its own, writable tables. Nothing is dropped.
    DropTables {
        name: String,
        /// Patterns of the set's tables to take out, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        tables: Vec<String>,
        /// Every subscriber of the set, as a libpq connection string.
        #[arg(long)]
        to: Vec<String>,
        #[command(flatten)]
        on: Origin,
    },
    /// Add tables to a set (Slony-I's SET ADD TABLE): the patterns join the set's (a table
    /// taken out that they name comes back), then the scan: matching tables join its
    /// publication and each subscriber (every one, with `--to`) copies them.
    AddTables {
        name: String,
        /// Table patterns to add, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        tables: Vec<String>,
        /// Every subscriber of the set, as a libpq connection string.
        #[arg(long)]
        to: Vec<String>,
        #[command(flatten)]
        on: Origin,
    },
    /// The set's scan on its own (run it from cron, as the nightly job of Slony-I sites):
    /// tables made since that match its patterns join its publication and each subscriber
    /// (every one, with `--to`) copies them; tables without a primary key are named and left
    /// out.
    Scan {
        name: String,
        /// Every subscriber of the set, as a libpq connection string.
        #[arg(long)]
        to: Vec<String>,
        #[command(flatten)]
        on: Origin,
    },
    /// Keep more sequences in step (their patterns join the set's; a sequence taken out that
    /// they name comes back), put in step on each subscriber given now.
    AddSequences {
        name: String,
        /// Sequence patterns, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        sequences: Vec<String>,
        /// Subscribers to put them in step on now, as libpq connection strings.
        #[arg(long)]
        to: Vec<String>,
        #[command(flatten)]
        on: Origin,
    },
    /// Stop keeping sequences in step: they are recorded as taken out of the set; the
    /// subscribers keep their own.
    DropSequences {
        name: String,
        /// Patterns of the set's sequences to take out, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        sequences: Vec<String>,
        #[command(flatten)]
        on: Origin,
    },
    /// Drop a set (Slony-I's DROP SET): each subscriber (every one, with `--to`) stops
    /// following it and keeps its copies as its own tables; the origin's publication, slots
    /// and catalog rows go. No table or row is dropped.
    Drop {
        name: String,
        /// Every subscriber of the set, as a libpq connection string.
        #[arg(long)]
        to: Vec<String>,
        #[command(flatten)]
        on: Origin,
    },
    /// The origin's sets: their tables, subscribers and how far each is behind.
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        on: Origin,
    },
}

#[derive(clap::Args, Debug)]
pub struct Origin {
    /// The database the set's tables are in (on the origin and the subscribers).
    #[arg(long)]
    pub(crate) database: String,
    /// The set's origin [default: the cluster's primary].
    #[arg(long)]
    pub(crate) origin: Option<String>,
    #[command(flatten)]
    pub(crate) at: Where,
}

pub fn run(command: SetCommand) -> Result<(), String> {
    let runtime = crate::runtime(1)?;
    match command {
        SetCommand::Create {
            name,
            tables,
            sequences,
            on,
        } => runtime.block_on(create(
            &name,
            (&tables, &sequences),
            &set::RowFilters::new(),
            &on,
        )),
        SetCommand::SyncSequences { name, to, on } => {
            runtime.block_on(sync_sequences_to(&name, &to, &on))
        }
        SetCommand::Subscribe {
            name,
            to,
            wait_s,
            again,
            on,
        } => {
            let how = Subscribing {
                wait: Duration::from_secs(wait_s),
                again,
            };
            runtime.block_on(subscribe(&name, &to, how, &on))
        }
        SetCommand::List { json, on } => runtime.block_on(list(json, &on)),
        SetCommand::AddTables {
            name,
            tables,
            to,
            on,
        } => runtime.block_on(crate::script::scan_set(&name, Some(&tables), &to, &on)),
        SetCommand::AddSequences {
            name,
            sequences,
            to,
            on,
        } => runtime.block_on(crate::set_sequences::add_sequences(
            &name, &sequences, &to, &on,
        )),
        SetCommand::DropSequences {
            name,
            sequences,
            on,
        } => runtime.block_on(crate::set_sequences::drop_sequences(&name, &sequences, &on)),
        SetCommand::Drop { name, to, on } => {
            runtime.block_on(crate::set_drop::drop_set(&name, &to, &on))
        }
        SetCommand::Scan { name, to, on } => {
            runtime.block_on(crate::script::scan_set(&name, None, &to, &on))
        }
        SetCommand::DropTables {
            name,
            tables,
            to,
            on,
        } => runtime.block_on(crate::set_drop::drop_tables(&name, &tables, &to, &on)),
        SetCommand::Move {
            name,
            new_origin,
            to,
            on,
        } => runtime.block_on(crate::set_move::move_set(&name, &new_origin, &to, &on)),
    }
}

pub(crate) async fn create(
    name: &str,
    (patterns, sequence_patterns): (&[String], &[String]),
    row_filters: &set::RowFilters,
    on: &Origin,
) -> Result<(), String> {
    set::check_name(name).map_err(|e| e.to_string())?;
    let config = Config::load(&on.at.config_path()?).map_err(|e| e.to_string())?;
    let (origin, mut conn) = origin_session(&config, on).await?;
    let query = |e: String| format!("origin {}: {e}", origin.name);
    let wal_level = first(
        &conn
            .simple_query("SHOW wal_level")
            .await
            .map_err(|e| query(e.to_string()))?,
    );
    if wal_level.as_deref() != Some("logical") {
        return Err(format!(
            "origin {}: wal_level is {}; logical replication needs wal_level = logical (a restart)",
            origin.name,
            wal_level.unwrap_or_default()
        ));
    }
    let exists = format!(
        "SELECT 1 FROM pg_publication WHERE pubname = {}",
        quote_literal(&set::publication(name))
    );
    if !conn
        .simple_query(&exists)
        .await
        .map_err(|e| query(e.to_string()))?
        .is_empty()
    {
        return Err(format!(
            "origin {}: a set named {name} exists already (pgherd set drop {name} takes it away, with --to for each subscriber)",
            origin.name
        ));
    }
    let tables = tables_of(&mut conn)
        .await
        .map_err(|e| query(e.to_string()))?;
    let chosen = set::choose_tables(&tables, patterns).map_err(|e| refused(name, e))?;
    let sequences = sequences_of(
        &conn_rows(&mut conn, set::SEQUENCES_SQL)
            .await
            .map_err(query)?,
    );
    let chosen_sequences =
        set::choose_sequences(&sequences, sequence_patterns).map_err(|e| refused(name, e))?;
    conn.simple_query(&set::create_sql(
        name,
        (patterns, sequence_patterns),
        &chosen,
        row_filters,
    ))
    .await
    .map_err(|e| query(e.to_string()))?;
    let names: Vec<String> = chosen
        .iter()
        .map(|t| match row_filters.get(&t.name) {
            Some(filter) => format!("{} (rows where {filter})", t.name),
            None => t.name.clone(),
        })
        .collect();
    let sequences: Vec<&str> = chosen_sequences.iter().map(|(n, _)| n.as_str()).collect();
    println!(
        "set {name} created on {} ({}): {} table{}: {}{}",
        origin.name,
        on.database,
        names.len(),
        if names.len() == 1 { "" } else { "s" },
        names.join(", "),
        match sequences.as_slice() {
            [] => String::new(),
            s => format!("; sequences kept in step: {}", s.join(", ")),
        }
    );
    Ok(())
}

/// `sync-sequences`: the set's sequences on each subscriber put where the origin's are.
async fn sync_sequences_to(name: &str, to: &[String], on: &Origin) -> Result<(), String> {
    let config = Config::load(&on.at.config_path()?).map_err(|e| e.to_string())?;
    let (origin, mut conn) = origin_session(&config, on).await?;
    let mut subscribers = Vec::new();
    for conninfo in to {
        let (shown, parsed) = subscriber_at(conninfo)?;
        let client = connect_subscriber(&shown, &parsed, &config.server_tls).await?;
        subscribers.push((shown, client));
    }
    let subscribers: Vec<(&str, &tokio_postgres::Client)> =
        subscribers.iter().map(|(s, c)| (s.as_str(), c)).collect();
    let count = sync_sequences(&mut conn, &origin.name, name, &subscribers).await?;
    println!(
        "set {name}: {count} sequence{} in step on {}",
        if count == 1 { "" } else { "s" },
        subscribers
            .iter()
            .map(|(s, _)| *s)
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// Puts each subscriber's copy of the set's sequences where the origin's is; how many.
/// Checked first: a subscriber that lacks one changes nothing.
pub(crate) async fn sync_sequences(
    origin: &mut ServerConn,
    origin_name: &str,
    set_name: &str,
    subscribers: &[(&str, &tokio_postgres::Client)],
) -> Result<usize, String> {
    let on_origin = |e: String| format!("origin {origin_name}: {e}");
    let kept = set_sequences_on(origin, set_name)
        .await
        .map_err(on_origin)?;
    let chosen: Vec<&set::Sequence> = kept.iter().collect();
    for (shown, client) in subscribers {
        let theirs = client_rows(client, set::SEQUENCES_SQL)
            .await
            .map_err(|e| format!("subscriber {shown}: {}", pg_error(&e)))?;
        set::check_subscriber_sequences(&chosen, &sequences_of(&theirs))
            .map_err(|e| format!("subscriber {shown}: {e}; nothing was changed"))?;
    }
    for (_, sql_name) in &chosen {
        let rows = conn_rows(origin, &set::sequence_value_sql(sql_name))
            .await
            .map_err(on_origin)?;
        let row = rows
            .first()
            .ok_or_else(|| on_origin(format!("{sql_name} has no value")))?;
        let field = |i: usize| row.get(i).cloned().flatten().unwrap_or_default();
        let last_value: i64 = field(0)
            .parse()
            .map_err(|_| on_origin(format!("{sql_name}: an unreadable value")))?;
        let setval = set::setval_sql(sql_name, last_value, field(1) == "true");
        for (shown, client) in subscribers {
            client
                .batch_execute(&setval)
                .await
                .map_err(|e| format!("subscriber {shown}: {}", pg_error(&e)))?;
        }
    }
    Ok(chosen.len())
}

/// The sequences the set keeps in step (its patterns less those taken out).
pub(crate) async fn set_sequences_on(
    origin: &mut ServerConn,
    set_name: &str,
) -> Result<Vec<set::Sequence>, String> {
    if set_tables(origin, set_name).await?.is_none() {
        return Err(format!("no set named {set_name}"));
    }
    let patterns = crate::set_nodes::set_patterns(origin, set_name).await?;
    let all = sequences_of(&conn_rows(origin, set::SEQUENCES_SQL).await?);
    Ok(
        set::set_sequences(&all, &patterns.sequences, &patterns.excluded)
            .into_iter()
            .cloned()
            .collect(),
    )
}

/// The rows of [`set::SEQUENCES_SQL`] as sequences.
pub(crate) fn sequences_of(rows: &[Vec<Option<String>>]) -> Vec<set::Sequence> {
    rows.iter()
        .filter_map(|r| Some((r.first()?.clone()?, r.get(1)?.clone()?)))
        .collect()
}

/// A statement's rows on a cluster node's session, its error as text.
async fn conn_rows(conn: &mut ServerConn, sql: &str) -> Result<Vec<Vec<Option<String>>>, String> {
    conn.simple_query(sql).await.map_err(|e| e.to_string())
}

/// How `subscribe` goes about it.
pub(crate) struct Subscribing {
    /// How long the initial copy may take.
    pub(crate) wait: Duration,
    /// Copy anew: a subscription there is detached and the copies emptied first.
    pub(crate) again: bool,
}

pub(crate) async fn subscribe(
    name: &str,
    to: &str,
    Subscribing { wait, again }: Subscribing,
    on: &Origin,
) -> Result<(), String> {
    set::check_name(name).map_err(|e| e.to_string())?;
    let config = Config::load(&on.at.config_path()?).map_err(|e| e.to_string())?;
    let (shown, subscriber_config) = subscriber_at(to)?;
    let (origin, mut conn) = origin_session(&config, on).await?;
    let query = |e: String| format!("origin {}: {e}", origin.name);
    let origin_tables = crate::set_nodes::set_user_tables(&mut conn, name)
        .await
        .map_err(query)?;
    let Some(origin_tables) = origin_tables else {
        return Err(format!(
            "origin {}: no set named {name} in {}",
            origin.name, on.database
        ));
    };
    let subscriber = connect_subscriber(&shown, &subscriber_config, &config.server_tls).await?;
    let on_subscriber = |e: tokio_postgres::Error| format!("subscriber {shown}: {}", pg_error(&e));
    let subscriber_tables: Vec<TableShape> = client_rows(&subscriber, TABLES_SQL)
        .await
        .map_err(on_subscriber)?
        .iter()
        .filter_map(|row| TableShape::from_row(row).ok())
        .collect();
    let user_tables: Vec<String> = origin_tables.iter().map(|t| t.name.clone()).collect();
    set::check_subscriber(&origin_tables, &subscriber_tables).map_err(|e| refused(name, e))?;
    let subscription = set::subscription(name, &shown);
    let from = origin_conninfo(&config, &origin, &on.database);
    let following = client_rows(
        &subscriber,
        &format!(
            "SELECT subconninfo FROM pg_subscription WHERE subname = {}",
            quote_literal(&subscription)
        ),
    )
    .await
    .map_err(on_subscriber)?;
    let mut exists = !following.is_empty();
    if again {
        let copies: Vec<&str> = subscriber_tables
            .iter()
            .filter(|t| user_tables.contains(&t.name))
            .map(|t| t.sql_name.as_str())
            .collect();
        start_again(&subscriber, (name, &subscription), exists, &copies)
            .await
            .map_err(on_subscriber)?;
        eprintln!(
            "{shown}: {} its copies of the set's tables emptied; copying them anew from {}",
            if exists {
                "its subscription detached from its old slot (left where it is),"
            } else {
                "no subscription to detach;"
            },
            origin.name
        );
        exists = false;
    } else if exists && first(&following).as_deref() != Some(from.as_str()) {
        return Err(format!(
            "subscriber {shown}: its subscription {subscription} follows another node than the set's origin {} (after a failover of the origin's cluster: run this with --again, which copies the set anew)",
            origin.name
        ));
    }
    if !exists {
        // pgherd's own marker table is made on the subscriber; its row comes with the copy.
        subscriber
            .batch_execute(&set::marker_sql(name, false))
            .await
            .map_err(on_subscriber)?;
        // The set's sequences checked (and put in step) before the subscription is made.
        sync_sequences(&mut conn, &origin.name, name, &[(&shown, &subscriber)]).await?;
        let sql = set::subscribe_sql(name, &subscription, &from, set::Copy::Rows);
        subscriber.simple_query(&sql).await.map_err(on_subscriber)?;
    } else {
        // An earlier `subscribe` made it and stopped waiting for the copy: this one finishes.
        eprintln!("{shown} has the subscription {subscription} already: waiting for its copy");
    }
    // Recorded once the subscription exists; if it cannot be, the subscription goes again.
    if let Err(e) = conn
        .simple_query(&set::record_subscriber_sql(name, &subscription, &shown))
        .await
    {
        let undone = match subscriber
            .batch_execute(&set::drop_subscription_sql(&subscription, false))
            .await
        {
            Ok(()) => "the subscription was dropped again".to_owned(),
            Err(d) => format!(
                "and dropping the subscription failed too ({}): drop {subscription} there",
                pg_error(&d)
            ),
        };
        return Err(query(format!(
            "the subscriber was not recorded: {e}; {undone}"
        )));
    }
    eprintln!(
        "{shown} subscribes to {name} as {subscription}; copying {} table{} ...",
        user_tables.len(),
        if user_tables.len() == 1 { "" } else { "s" }
    );
    // The set's marker table is copied too.
    wait_for_copy(&subscriber, &subscription, user_tables.len() + 1, wait)
        .await
        .map_err(|e| {
            format!(
                "subscriber {shown}: {e}; the same `pgherd set subscribe` again waits for the rest and finishes (local writes refused, sequences in step)"
            )
        })?;
    // A write on the subscriber would be overwritten or stop the stream: its copies of the
    // set's tables refuse local ones (replication's apply worker is not refused).
    let copies: Vec<&str> = subscriber_tables
        .iter()
        .filter(|t| user_tables.contains(&t.name))
        .map(|t| t.sql_name.as_str())
        .collect();
    subscriber
        .batch_execute(&set::deny_writes_sql(name, &origin.name, &copies))
        .await
        .map_err(on_subscriber)?;
    sync_sequences(&mut conn, &origin.name, name, &[(&shown, &subscriber)]).await?;
    println!(
        "{shown} is subscribed to {name}: {} table{} copied; their changes stream from {} (slot {subscription})",
        user_tables.len(),
        if user_tables.len() == 1 { "" } else { "s" },
        origin.name
    );
    Ok(())
}

/// `subscribe --again` on the subscriber: its subscription (if any) detached from its slot,
/// its copies of the set's tables and its marker emptied (the deny-write triggers and foreign
/// keys between them do not stop it; one from another table does, and says so).
async fn start_again(
    subscriber: &tokio_postgres::Client,
    (set_name, subscription): (&str, &str),
    exists: bool,
    copies: &[&str],
) -> Result<(), tokio_postgres::Error> {
    if exists {
        subscriber
            .batch_execute(&set::drop_subscription_sql(subscription, true))
            .await?;
    }
    let mut tables: Vec<String> = copies.iter().map(|t| (*t).to_owned()).collect();
    tables.push(set::marker_table(set_name));
    subscriber
        .batch_execute(&format!(
            "{}; BEGIN; SET LOCAL session_replication_role = replica; TRUNCATE {}; COMMIT",
            set::marker_sql(set_name, false),
            tables.join(", ")
        ))
        .await
}

async fn list(json: bool, on: &Origin) -> Result<(), String> {
    let config = Config::load(&on.at.config_path()?).map_err(|e| e.to_string())?;
    let (origin, mut conn) = origin_session(&config, on).await?;
    let query = |e: String| format!("origin {}: {e}", origin.name);
    let has_catalog = first(
        &conn
            .simple_query(set::HAS_CATALOG_SQL)
            .await
            .map_err(|e| query(e.to_string()))?,
    );
    let rows = match has_catalog.as_deref() {
        Some("true") => conn
            .simple_query(set::LIST_SQL)
            .await
            .map_err(|e| query(e.to_string()))?,
        _ => Vec::new(),
    };
    let sets: Vec<serde_json::Value> = set::read_list(&rows)
        .into_iter()
        .map(|s| {
            let mut value = serde_json::json!(s);
            value["origin"] = serde_json::json!(origin.name);
            value
        })
        .collect();
    if json {
        println!("{}", serde_json::Value::Array(sets));
        return Ok(());
    }
    if sets.is_empty() {
        println!("no sets on {} ({})", origin.name, on.database);
    }
    for s in &sets {
        let tables: Vec<&str> = s["tables"]
            .as_array()
            .map(|a| a.iter().filter_map(|t| t.as_str()).collect())
            .unwrap_or_default();
        println!(
            "set {} on {}: {}",
            s["name"].as_str().unwrap_or_default(),
            origin.name,
            tables.join(", ")
        );
        for sub in s["subscribers"].as_array().into_iter().flatten() {
            let lag = sub["lag_bytes"]
                .as_i64()
                .map_or("lag unknown (no slot)".to_owned(), |b| {
                    format!("{b} bytes behind")
                });
            println!(
                "  {} ({}): {}, {lag}",
                sub["subscriber"].as_str().unwrap_or_default(),
                sub["subscription"].as_str().unwrap_or_default(),
                if sub["streaming"].as_bool() == Some(true) {
                    "streaming"
                } else {
                    "not streaming"
                }
            );
        }
    }
    Ok(())
}

/// How a subscriber reaches the origin node: as the `[cluster]` user, to the set's database.
pub(crate) fn origin_conninfo(config: &Config, origin: &NodeConfig, database: &str) -> String {
    let mut parts = vec![
        ("host", origin.host.clone()),
        ("port", origin.port.to_string()),
        ("dbname", database.to_owned()),
        ("user", config.cluster.user.clone()),
    ];
    if let Some(password) = &config.cluster.password {
        parts.push(("password", password.clone()));
    }
    let parts: Vec<(&str, &str)> = parts.iter().map(|(k, v)| (*k, v.as_str())).collect();
    set::conninfo(&parts)
}

/// The origin node (`--origin`, or the node that answers as the primary) and a session to its
/// database.
pub(crate) async fn origin_session(
    config: &Config,
    on: &Origin,
) -> Result<(NodeConfig, ServerConn), String> {
    find_origin(config, &on.database, on.origin.as_deref()).await
}

/// The node named `origin` (of any shard), or the one of shard 0 that answers as the primary,
/// and a session to its `database`.
pub(crate) async fn find_origin(
    config: &Config,
    database: &str,
    origin: Option<&str>,
) -> Result<(NodeConfig, ServerConn), String> {
    if let Some(name) = origin {
        let node = config.node_of_any_shard(name).ok_or_else(|| {
            format!(
                "no node \"{name}\" in the config (its nodes: {})",
                config.node_names()
            )
        })?;
        let conn = session_in(config, node, database).await?;
        return Ok((node.clone(), conn));
    }
    primary_among(config, &config.nodes, database)
        .await
        .map_err(|silent| {
            format!(
                "no node answers as the primary to be the set's origin (name one with --origin){silent}"
            )
        })
}

/// The node of `nodes` that answers as the primary, and a session to its `database`; if none
/// does, why the silent ones said nothing (`: ...`, or empty).
pub(crate) async fn primary_among(
    config: &Config,
    nodes: &[NodeConfig],
    database: &str,
) -> Result<(NodeConfig, ServerConn), String> {
    let mut silent = Vec::new();
    for node in nodes {
        let asked = tokio::time::timeout(Duration::from_secs(5), async {
            let mut conn = session_in(config, node, database).await?;
            let rows = conn
                .simple_query("SELECT (NOT pg_is_in_recovery())::text")
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((first(&rows).as_deref() == Some("true"), conn))
        })
        .await;
        match asked {
            Ok(Ok((true, conn))) => return Ok((node.clone(), conn)),
            Ok(Ok((false, _))) => {}
            Ok(Err(e)) => silent.push(e),
            Err(_) => silent.push(format!("node {}: no answer within 5 s", node.name)),
        }
    }
    Err(match silent.is_empty() {
        true => String::new(),
        false => format!(": {}", silent.join("; ")),
    })
}

pub(crate) async fn tables_of(conn: &mut impl SqlSession) -> Result<Vec<TableShape>, String> {
    let rows = conn.rows(TABLES_SQL).await.map_err(|e| e.to_string())?;
    rows.iter()
        .map(|row| TableShape::from_row(row).map_err(|e| e.to_string()))
        .collect()
}

/// The tables of `set` (from its publication), or `None` if the origin has no such set.
pub(crate) async fn set_tables(
    conn: &mut impl SqlSession,
    set: &str,
) -> Result<Option<Vec<String>>, String> {
    let sql = format!(
        "SELECT (SELECT json_agg(schemaname || '.' || tablename) FROM pg_publication_tables \
                  WHERE pubname = {})::text \
          WHERE to_regclass('pgherd.sets') IS NOT NULL \
            AND EXISTS (SELECT 1 FROM pgherd.sets WHERE name = {})",
        quote_literal(&set::publication(set)),
        quote_literal(set)
    );
    let rows = conn.rows(&sql).await.map_err(|e| e.to_string())?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    let tables = row.first().cloned().flatten().unwrap_or_default();
    Ok(Some(serde_json::from_str(&tables).unwrap_or_default()))
}

/// Waits until every table of the subscription is copied and streaming, with a bar per table.
async fn wait_for_copy(
    subscriber: &tokio_postgres::Client,
    subscription: &str,
    tables: usize,
    wait: Duration,
) -> Result<(), String> {
    let bar = indicatif::ProgressBar::new(tables as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} tables copied",
    ) {
        bar.set_style(style);
    }
    let started = Instant::now();
    let sql = set::sync_progress_sql(subscription);
    loop {
        let rows = client_rows(subscriber, &sql)
            .await
            .map_err(|e| pg_error(&e))?;
        let counts: Vec<u64> = rows
            .first()
            .map(|row| {
                row.iter()
                    .map(|v| v.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0))
                    .collect()
            })
            .unwrap_or_default();
        let (done, total) = (
            counts.first().copied().unwrap_or(0),
            counts.get(1).copied().unwrap_or(0),
        );
        bar.set_length(total.max(tables as u64));
        bar.set_position(done);
        if total > 0 && done == total {
            bar.finish_and_clear();
            return Ok(());
        }
        if started.elapsed() > wait {
            bar.finish_and_clear();
            return Err(format!(
                "{done} of {total} tables copied after {} s; the copy goes on in PostgreSQL (see the subscriber's log; pgherd set list shows the lag)",
                wait.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn refused(set: &str, e: SetError) -> String {
    format!("set {set}: {e}; nothing was changed")
}

/// A subscriber as its connection string names it: where it is, as shown and recorded (never
/// its password), and how to connect to it.
pub(crate) fn subscriber_at(conninfo: &str) -> Result<(String, tokio_postgres::Config), String> {
    let parsed: tokio_postgres::Config = conninfo
        .parse()
        .map_err(|e| format!("--to is not a connection string: {e}"))?;
    Ok((describe(&parsed), parsed))
}

/// A session to a subscriber, its connection driven in the background. Its `sslmode` says
/// whether TLS is used, as libpq's does (`prefer`, the default, tries it first); with
/// `require` its certificate is verified as `[server_tls]` verifies the nodes' (verify-ca,
/// verify-full), else accepted as libpq's `require` does.
pub(crate) async fn connect_subscriber(
    shown: &str,
    config: &tokio_postgres::Config,
    tls: &pgherd_config::ServerTls,
) -> Result<tokio_postgres::Client, String> {
    let failed = |e: tokio_postgres::Error| {
        format!("cannot connect to the subscriber {shown}: {}", pg_error(&e))
    };
    let verify = match config.get_ssl_mode() {
        tokio_postgres::config::SslMode::Disable => {
            let (client, connection) = config
                .connect(tokio_postgres::NoTls)
                .await
                .map_err(failed)?;
            tokio::spawn(connection);
            return Ok(client);
        }
        tokio_postgres::config::SslMode::Require => true,
        _ => false,
    };
    let rustls = pgherd_proxy::tls::postgres_client_config(tls, verify)
        .map_err(|e| format!("TLS to the subscriber {shown}: {e}"))?;
    let connector = tokio_postgres_rustls::MakeRustlsConnect::new(rustls);
    let (client, connection) = config.connect(connector).await.map_err(failed)?;
    tokio::spawn(connection);
    Ok(client)
}

/// The subscriber as shown and recorded: where it is and as whom, never its password.
pub(crate) fn describe(config: &tokio_postgres::Config) -> String {
    let host = config
        .get_hosts()
        .first()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .unwrap_or_else(|| "localhost".into());
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{host}:{port}/{}",
        config
            .get_dbname()
            .unwrap_or(config.get_user().unwrap_or("postgres"))
    )
}
