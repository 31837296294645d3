//! `pgherd check-consistency`: whether the primary and its streaming replicas hold the same
//! rows, table by table, compared at the same point on every node while writes go on.
//!
//! The same point, per chunk: the primary's session takes a SHARE lock on the table (writers
//! to that one table wait; readers and other tables do not), reads its WAL insert position,
//! which every write to the table that finished is behind, and computes the chunk's sum; each
//! replica waits until it has replayed that position, computes the same sum, and only then is
//! the lock released. Nothing can change the table's rows between the two, on any node. The
//! lock is held for one chunk at a time (`--chunk-rows`), and `--max-rows-per-s` spreads the
//! reads out. What is asked and how answers compare is `pgherd_replication::consistency`.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use pgherd_config::Config;
use pgherd_proxy::nodes::{CheckThresholds, NodeState, Nodes};
use pgherd_proxy::pool::ConnectContext;
use pgherd_proxy::server::{QueryError, ServerConn};
use pgherd_replication::consistency::{
    pause_before_next_ms, render, table_selected, Chunk, ChunkSum, TableReport, TableShape,
    SESSION_SETTINGS_SQL, TABLES_SQL,
};

use crate::local::Where;

#[derive(clap::Args, Debug)]
pub struct CheckOptions {
    #[command(flatten)]
    at: Where,
    /// The nodes to compare (config names, comma-separated); one must be the primary [default:
    /// every node of the config].
    #[arg(long, value_delimiter = ',')]
    nodes: Vec<String>,
    /// The database to check [default: the only one under [databases]].
    #[arg(long)]
    database: Option<String>,
    /// Tables to check: `schema.table` or `table` patterns, `*` and `?` as in a shell
    /// (repeatable) [default: every table].
    #[arg(long = "tables", value_delimiter = ',')]
    tables: Vec<String>,
    /// Rows per chunk: the table's writers wait for one chunk's check at a time.
    #[arg(long, default_value_t = 10_000)]
    chunk_rows: u64,
    /// Read at most this many rows per second on average (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_rows_per_s: u64,
    /// How long a chunk waits for its table's lock before it tries again (a long write
    /// transaction on the table holds it back).
    #[arg(long, default_value_t = 2_000)]
    lock_timeout_ms: u64,
    /// How long a replica may take to replay up to a chunk's point.
    #[arg(long, default_value_t = 30_000)]
    replay_timeout_ms: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Why a check could not be completed (differences are not errors: they are its answer).
#[derive(Debug)]
enum CheckError {
    Config(String),
    Node {
        node: String,
        error: String,
    },
    LockNotGranted {
        table: String,
        tries: u32,
    },
    NotReplaying {
        node: String,
        lsn: String,
        waited_ms: u64,
    },
}

impl std::fmt::Display for CheckError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckError::Config(message) => f.write_str(message),
            CheckError::Node { node, error } => write!(f, "node {node}: {error}"),
            CheckError::LockNotGranted { table, tries } => write!(
                f,
                "table {table}: its lock was not granted in {tries} tries (a long transaction writes it?); nothing was left locked"
            ),
            CheckError::NotReplaying { node, lsn, waited_ms } => write!(
                f,
                "node {node} did not replay up to {lsn} within {waited_ms} ms (is its replay paused, or does it stream from another primary?)"
            ),
        }
    }
}

/// How many times a chunk tries for its table's lock, and for a replica's sum that recovery
/// cancelled, before the check gives up.
const TRIES: u32 = 5;

/// A node being compared, with its session.
struct Checked {
    name: String,
    conn: ServerConn,
}

impl Checked {
    async fn query(&mut self, sql: &str) -> Result<Vec<Vec<Option<String>>>, QueryError> {
        self.conn.simple_query(sql).await
    }

    fn failed(&self, e: impl std::fmt::Display) -> CheckError {
        CheckError::Node {
            node: self.name.clone(),
            error: e.to_string(),
        }
    }
}

pub fn run(options: CheckOptions) -> Result<(), String> {
    let path = options.at.config_path()?;
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    let outcome = crate::runtime(1)?.block_on(check(&config, &options));
    match outcome {
        Ok(reports) => {
            let differing = reports.iter().filter(|r| !r.is_same()).count();
            if differing > 0 {
                return Err(format!(
                    "{differing} table(s) differ between the nodes (the ranges are listed above)"
                ));
            }
            Ok(())
        }
        Err(e) => Err(format!("consistency check stopped: {e}")),
    }
}

async fn check(config: &Config, options: &CheckOptions) -> Result<Vec<TableReport>, CheckError> {
    let database = database_of(config, options.database.as_deref())?;
    let mut nodes = connect_all(config, &options.nodes, &database).await?;
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let reference = &mut nodes[0];
    let tables: Vec<TableShape> = reference
        .query(TABLES_SQL)
        .await
        .map_err(|e| reference.failed(e))?
        .iter()
        .map(|row| TableShape::from_row(row).map_err(|e| reference.failed(e)))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|t| table_selected(&t.name, &options.tables))
        .collect();
    let progress = progress_bar(tables.iter().map(|t| t.estimated_rows).sum());
    let started = Instant::now();
    let mut rows_read = 0u64;
    let mut reports = Vec::new();
    for table in &tables {
        progress.set_message(table.name.clone());
        let mut report = TableReport::new(table, nodes.len());
        let mut chunk = Some(Chunk::default());
        while let Some(next) = chunk {
            let (checked, sums) = check_chunk(&mut nodes, table, next, options).await?;
            report.add_chunk(&checked, &sums, &names);
            let rows = sums.first().map_or(0, |s| s.rows);
            rows_read += rows;
            progress.inc(rows);
            let pause_ms = pause_before_next_ms(
                rows_read,
                started.elapsed().as_millis() as u64,
                options.max_rows_per_s,
            );
            if pause_ms > 0 {
                tokio::time::sleep(Duration::from_millis(pause_ms)).await;
            }
            chunk = checked.next();
        }
        reports.push(report);
    }
    progress.finish_and_clear();
    let elapsed = started.elapsed();
    if options.json {
        let answer = serde_json::json!({
            "database": database,
            "nodes": names,
            "tables": reports,
            "rows_read": rows_read,
            "elapsed_ms": elapsed.as_millis() as u64,
        });
        println!("{answer:#}");
    } else {
        print!("{}", render(&reports, &names));
        println!(
            "{rows_read} rows per node in {:.1} s ({:.0} rows/s)",
            elapsed.as_secs_f64(),
            rows_read as f64 / elapsed.as_secs_f64().max(1e-3)
        );
    }
    Ok(reports)
}

/// `--database`, or the one database the config serves.
fn database_of(config: &Config, asked: Option<&str>) -> Result<String, CheckError> {
    let name = match asked {
        Some(name) => name.to_owned(),
        None => {
            let mut names = config.databases.keys();
            match (names.next(), names.next()) {
                (Some(only), None) => only.clone(),
                _ => {
                    return Err(CheckError::Config(
                        "name the database to check with --database".to_owned(),
                    ))
                }
            }
        }
    };
    // A name clients use may stand for another on the servers.
    Ok(config
        .databases
        .get(&name)
        .and_then(|d| d.dbname.clone())
        .unwrap_or(name))
}

/// Sessions to the nodes asked for (or all), the primary first; every one must answer.
async fn connect_all(
    config: &Config,
    asked: &[String],
    database: &str,
) -> Result<Vec<Checked>, CheckError> {
    let registry = Nodes::new(
        &config.nodes,
        CheckThresholds {
            rejoin_after_checks: 1,
            failures_before_down: 1,
        },
    );
    let chosen: Vec<std::sync::Arc<NodeState>> = if asked.is_empty() {
        registry.all().iter().cloned().collect()
    } else {
        asked
            .iter()
            .map(|name| {
                registry.get(name).ok_or_else(|| {
                    CheckError::Config(format!(
                        "no node \"{name}\" in the config (its nodes: {})",
                        config
                            .nodes
                            .iter()
                            .map(|n| n.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })
            })
            .collect::<Result<_, _>>()?
    };
    if chosen.len() < 2 {
        return Err(CheckError::Config(
            "a check compares at least two nodes".to_owned(),
        ));
    }
    let ctx = ConnectContext {
        tls_mode: config.server_tls.mode,
        tls: pgherd_proxy::tls::server_connector(&config.server_tls).map_err(CheckError::Config)?,
        next_server_id: Default::default(),
    };
    let mut checked = Vec::new();
    let mut primary = None;
    for node in &chosen {
        let name = node.config.name.clone();
        let failed = |e: &dyn std::fmt::Display| CheckError::Node {
            node: name.clone(),
            error: e.to_string(),
        };
        let conn =
            pgherd_proxy::monitor::management_connection(node, &config.cluster, &ctx, database)
                .await
                .map_err(|e| failed(&e))?;
        let mut node = Checked {
            name: name.clone(),
            conn,
        };
        node.query(SESSION_SETTINGS_SQL)
            .await
            .map_err(|e| failed(&e))?;
        let in_recovery = node
            .query("SELECT pg_is_in_recovery()::text")
            .await
            .map_err(|e| failed(&e))?;
        if in_recovery
            .first()
            .and_then(|r| r.first())
            .cloned()
            .flatten()
            == Some("false".into())
        {
            if let Some(other) = &primary {
                return Err(CheckError::Config(format!(
                    "{other} and {name} both take writes: they are not one cluster's copies"
                )));
            }
            primary = Some(name.clone());
            checked.insert(0, node);
        } else {
            checked.push(node);
        }
    }
    if primary.is_none() {
        return Err(CheckError::Config(
            "none of the nodes is the primary: it must be among them (its lock on each chunk is what makes the nodes' answers comparable)".to_owned(),
        ));
    }
    Ok(checked)
}

/// One chunk on every node at the same point: the chunk as cut (its last key found under the
/// lock), and each node's sum, the primary's first.
async fn check_chunk(
    nodes: &mut [Checked],
    table: &TableShape,
    chunk: Chunk,
    options: &CheckOptions,
) -> Result<(Chunk, Vec<ChunkSum>), CheckError> {
    let mut tries = 0;
    loop {
        tries += 1;
        let (primary, replicas) = nodes
            .split_first_mut()
            .ok_or_else(|| CheckError::Config("no nodes".to_owned()))?;
        let Some(lsn) = lock_table(primary, table, options.lock_timeout_ms).await? else {
            if tries >= TRIES {
                return Err(CheckError::LockNotGranted {
                    table: table.name.clone(),
                    tries,
                });
            }
            tokio::time::sleep(Duration::from_millis(500 * u64::from(tries))).await;
            continue;
        };
        let outcome = sums_under_lock(primary, replicas, table, &chunk, &lsn, options).await;
        primary
            .query("COMMIT")
            .await
            .map_err(|e| primary.failed(e))?;
        match outcome? {
            Some(done) => return Ok(done),
            // Recovery on a replica cancelled its query: the whole chunk again.
            None if tries < TRIES => continue,
            None => {
                return Err(CheckError::Config(format!(
                    "table {}: a replica's recovery cancelled its reads {tries} times",
                    table.name
                )))
            }
        }
    }
}

/// Begins the primary's transaction holding `table`'s SHARE lock; the WAL position every
/// finished write to it is behind, or `None` if the lock was not granted in time (the
/// transaction is then ended).
async fn lock_table(
    primary: &mut Checked,
    table: &TableShape,
    lock_timeout_ms: u64,
) -> Result<Option<String>, CheckError> {
    let sql = format!(
        "BEGIN; SET LOCAL lock_timeout = {lock_timeout_ms}; \
         SET LOCAL idle_in_transaction_session_timeout = 60000; \
         LOCK TABLE {} IN SHARE MODE; SELECT pg_current_wal_insert_lsn()::text",
        table.sql_name
    );
    match primary.query(&sql).await {
        Ok(rows) => Ok(rows.first().and_then(|r| r.first()).cloned().flatten()),
        Err(QueryError::Sql(e)) if e.code.code() == "55P03" => {
            primary
                .query("ROLLBACK")
                .await
                .map_err(|e| primary.failed(e))?;
            Ok(None)
        }
        Err(e) => Err(primary.failed(e)),
    }
}

/// Under the primary's lock: the chunk's last key, the primary's sum, and each replica's once
/// it replayed up to `lsn`. `None` when recovery cancelled a replica's query.
async fn sums_under_lock(
    primary: &mut Checked,
    replicas: &mut [Checked],
    table: &TableShape,
    chunk: &Chunk,
    lsn: &str,
    options: &CheckOptions,
) -> Result<Option<(Chunk, Vec<ChunkSum>)>, CheckError> {
    let mut chunk = chunk.clone();
    if !table.key.is_empty() {
        let boundary = table.boundary_sql(chunk.after.as_deref(), options.chunk_rows);
        let rows = primary
            .query(&boundary)
            .await
            .map_err(|e| primary.failed(e))?;
        chunk.through = rows
            .first()
            .map(|r| r.iter().map(|v| v.clone().unwrap_or_default()).collect());
    }
    let sql = table.checksum_sql(&chunk);
    let wait = Duration::from_millis(options.replay_timeout_ms);
    let (on_primary, on_replicas) = tokio::join!(
        sum_on(primary, &sql),
        join_all(
            replicas
                .iter_mut()
                .map(|replica| replay_then_sum(replica, lsn, &sql, wait))
        )
    );
    let mut sums = vec![on_primary?.ok_or_else(|| primary_cancelled(table))?];
    for sum in on_replicas {
        match sum? {
            Some(sum) => sums.push(sum),
            None => return Ok(None),
        }
    }
    Ok(Some((chunk, sums)))
}

fn primary_cancelled(table: &TableShape) -> CheckError {
    CheckError::Config(format!(
        "table {}: the primary's read was cancelled",
        table.name
    ))
}

/// A node's sum for the chunk; `None` if recovery cancelled the query (a replica's).
async fn sum_on(node: &mut Checked, sql: &str) -> Result<Option<ChunkSum>, CheckError> {
    match node.query(sql).await {
        Ok(rows) => rows
            .first()
            .and_then(|r| ChunkSum::from_row(r))
            .map(Some)
            .ok_or_else(|| node.failed("an unreadable checksum")),
        Err(QueryError::Sql(e)) if e.code.code() == "40001" => Ok(None),
        Err(e) => Err(node.failed(e)),
    }
}

async fn replay_then_sum(
    replica: &mut Checked,
    lsn: &str,
    sql: &str,
    wait: Duration,
) -> Result<Option<ChunkSum>, CheckError> {
    let started = Instant::now();
    let question = format!(
        "SELECT coalesce(pg_last_wal_replay_lsn() >= {}::pg_lsn, false)::text",
        pgherd_replication::consistency::quote_literal(lsn)
    );
    loop {
        let rows = replica
            .query(&question)
            .await
            .map_err(|e| replica.failed(e))?;
        if rows.first().and_then(|r| r.first()).cloned().flatten() == Some("true".into()) {
            break;
        }
        if started.elapsed() >= wait {
            return Err(CheckError::NotReplaying {
                node: replica.name.clone(),
                lsn: lsn.to_owned(),
                waited_ms: wait.as_millis() as u64,
            });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    sum_on(replica, sql).await
}

fn progress_bar(estimated_rows: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(estimated_rows.max(1)),
        indicatif::ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} rows ({per_sec}, {eta} left) {msg}",
    ) {
        bar.set_style(style);
    }
    bar
}
