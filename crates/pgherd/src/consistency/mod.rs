//! `pgherd check-consistency`: whether the primary and its streaming replicas hold the same
//! rows, table by table, compared at the same point on every node while writes go on.
//!
//! The same point: a second session on the primary takes a SHARE lock on the table (its
//! writers wait; readers and other tables do not), which waits for every write to it under
//! way to end; the primary's reading session then opens a repeatable-read transaction and
//! reads its WAL insert position, which every write to the table is behind; each replica
//! waits until it has replayed that far and opens its own repeatable-read transaction; then
//! the lock goes. Every node's snapshot now holds exactly the table's rows at that point, and
//! the chunks (`--chunk-rows` rows of the key) are read from those snapshots with no lock.
//! A point is kept for `--point-ms` at most, then a new one is taken (a long snapshot holds
//! back vacuum, and on a replica it can delay replay or be cancelled by it; a cancelled read is
//! read again at a new point). `--max-rows-per-s` spreads the reads out. What is asked and how
//! answers compare is `pgherd_replication::consistency`.
//!
//! With `--set NAME --to CONNINFO...` the nodes are a replication set's origin and its
//! subscribers, and the tables the set's: under the lock the origin raises the set's marker
//! (`pgherd_replication::sets`), and a subscriber that shows it has applied every change to
//! the table committed before the lock, since logical replication applies in commit order.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use pgherd_config::Config;
use pgherd_replication::consistency::{
    pause_before_next_ms, render, table_selected, Chunk, ChunkSum, TableReport, TableShape,
    TABLES_SQL,
};

use crate::local::Where;
use crate::set_nodes::{raise_mark, set_user_tables, wait_applied};
use crate::sql_session::first;

mod nodes;
use nodes::{connect_all, connect_set, Checked};

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
    /// Rows per chunk: the unit of reading and of a difference's key range.
    #[arg(long, default_value_t = 10_000)]
    chunk_rows: u64,
    /// Read at most this many rows per second on average (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_rows_per_s: u64,
    /// How long taking a point waits for its table's lock before it tries again (a long write
    /// transaction on the table holds it back).
    #[arg(long, default_value_t = 2_000)]
    lock_timeout_ms: u64,
    /// How long a replica may take to replay up to a point.
    #[arg(long, default_value_t = 30_000)]
    replay_timeout_ms: u64,
    /// How long one point's snapshots serve before the next point is taken.
    #[arg(long, default_value_t = 2_000)]
    point_ms: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Compare a replication set's origin with its subscribers (`--to`), on the set's tables.
    #[arg(long, conflicts_with = "nodes", requires = "to")]
    set: Option<String>,
    /// With `--set`: a subscriber to compare, as a libpq connection string (repeatable).
    #[arg(long = "to")]
    to: Vec<String>,
    /// With `--set`: the set's origin, a node of any shard [default: the node of the
    /// config's nodes that answers as the primary].
    #[arg(long, requires = "set")]
    origin: Option<String>,
}

/// The options alone, as a command line reads them: what [`CheckOptions::of_set`] builds
/// with.
#[derive(clap::Parser)]
struct Standalone {
    #[command(flatten)]
    options: CheckOptions,
}

impl CheckOptions {
    /// The check of a set's copy on `to` against its `origin`, with the command line's
    /// defaults (read by its own parser, so they are written once).
    pub(crate) fn of_set(
        at: Where,
        database: &str,
        (set, origin): (&str, &str),
        to: &str,
    ) -> Result<Self, String> {
        use clap::Parser;
        let args = [
            "check-consistency",
            "--database",
            database,
            "--set",
            set,
            "--origin",
            origin,
            "--to",
            to,
        ];
        let mut options = Standalone::try_parse_from(args)
            .map_err(|e| format!("the set's check: {e}"))?
            .options;
        options.at = at;
        Ok(options)
    }
}

/// How the other nodes reach a point the origin's lock fixes.
enum Follow {
    /// Streaming replicas: they replay the primary's WAL up to its position.
    Replay,
    /// A set's subscribers: they apply the origin's changes up to the set's raised marker.
    Mark(String),
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

/// How many times a point is tried for when its table's lock is not granted, and a chunk is
/// read again after recovery cancelled a replica's read, before the check gives up.
const TRIES: u32 = 5;

pub fn run(options: CheckOptions) -> Result<(), String> {
    let path = options.at.config_path()?;
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    crate::runtime(1)?.block_on(check_all(&config, &options))
}

/// Runs the check and prints its report; an error if a table differs or the check stopped.
pub(crate) async fn check_all(config: &Config, options: &CheckOptions) -> Result<(), String> {
    match check(config, options).await {
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
    let (follow, (mut locker, mut nodes)) = match &options.set {
        None => (
            Follow::Replay,
            connect_all(config, &options.nodes, &database).await?,
        ),
        Some(set) => (
            Follow::Mark(set.clone()),
            connect_set(config, &database, options.origin.as_deref(), &options.to).await?,
        ),
    };
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let reference = &mut nodes[0];
    let in_set = match &follow {
        Follow::Replay => None,
        Follow::Mark(set) => Some(
            set_user_tables(reference, set)
                .await
                .map_err(|e| reference.failed(e))?
                .filter(|tables| !tables.is_empty())
                .ok_or_else(|| {
                    CheckError::Config(format!(
                        "no set named {set} with tables on {}",
                        reference.name
                    ))
                })?,
        ),
    };
    let tables: Vec<TableShape> = reference
        .query(TABLES_SQL)
        .await
        .map_err(|e| reference.failed(e))?
        .iter()
        .map(|row| TableShape::from_row(row).map_err(|e| reference.failed(e)))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|t| table_selected(&t.name, &options.tables))
        .filter_map(|t| match &in_set {
            None => Some(t),
            // The set's row filter says which of the origin's rows its subscribers hold.
            Some(set) => set.iter().find(|s| s.name == t.name).map(|s| TableShape {
                row_filter: s.row_filter.clone(),
                ..t
            }),
        })
        .collect();
    let progress = progress_bar(tables.iter().map(|t| t.estimated_rows).sum());
    let started = Instant::now();
    let mut rows_read = 0u64;
    let mut reports = Vec::new();
    for table in &tables {
        progress.set_message(table.name.clone());
        let point = (&mut locker, &follow);
        let report = check_table(point, &mut nodes, table, options, &mut |rows| {
            rows_read += rows;
            progress.inc(rows);
            pause_before_next_ms(
                rows_read,
                started.elapsed().as_millis() as u64,
                options.max_rows_per_s,
            )
        })
        .await?;
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

/// One table, chunk by chunk, each read at the current point (a new one taken when the last
/// is too old or a replica's read was cancelled). `read` is told each chunk's rows and says
/// how long to pause before the next (the rate limit).
async fn check_table(
    (locker, follow): (&mut Checked, &Follow),
    nodes: &mut [Checked],
    table: &TableShape,
    options: &CheckOptions,
    read: &mut dyn FnMut(u64) -> u64,
) -> Result<TableReport, CheckError> {
    let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let mut report = TableReport::new(table, nodes.len());
    let mut chunk = Some(Chunk::default());
    let mut point: Option<Instant> = None;
    let mut cancelled = 0;
    while let Some(next) = chunk.take() {
        if point.is_none_or(|taken| taken.elapsed() >= Duration::from_millis(options.point_ms)) {
            if point.is_some() {
                end_point(nodes).await?;
            }
            take_point(locker, follow, nodes, table, options).await?;
            point = Some(Instant::now());
        }
        let Some((checked, sums)) = read_chunk(nodes, table, &next, options).await? else {
            cancelled += 1;
            if cancelled >= TRIES {
                return Err(CheckError::Config(format!(
                    "table {}: recovery on a replica cancelled its reads {cancelled} times (raise max_standby_streaming_delay, or lower --point-ms)",
                    table.name
                )));
            }
            end_point(nodes).await?;
            point = None;
            chunk = Some(next);
            continue;
        };
        report.add_chunk(&checked, &sums, &names);
        let pause_ms = read(sums.first().map_or(0, |s| s.rows));
        if pause_ms > 0 {
            tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        }
        chunk = checked.next();
    }
    if point.is_some() {
        end_point(nodes).await?;
    }
    Ok(report)
}

/// Opens every node's repeatable-read transaction at the same point of `table` (see the
/// module's doc); tries again a few times when its lock is not granted in time.
async fn take_point(
    locker: &mut Checked,
    follow: &Follow,
    nodes: &mut [Checked],
    table: &TableShape,
    options: &CheckOptions,
) -> Result<(), CheckError> {
    catch_up(locker, follow, nodes, options).await?;
    let lock = format!(
        "BEGIN; SET LOCAL lock_timeout = {};          SET LOCAL idle_in_transaction_session_timeout = 60000;          LOCK TABLE {} IN SHARE MODE",
        options.lock_timeout_ms, table.sql_name
    );
    let mut tries = 0;
    loop {
        tries += 1;
        match locker.query(&lock).await {
            Ok(_) => break,
            Err(e) if e.is("55P03") && tries < TRIES => {
                locker
                    .query("ROLLBACK")
                    .await
                    .map_err(|e| locker.failed(e))?;
                tokio::time::sleep(Duration::from_millis(500 * u64::from(tries))).await;
            }
            Err(e) if e.is("55P03") => {
                locker
                    .query("ROLLBACK")
                    .await
                    .map_err(|e| locker.failed(e))?;
                return Err(CheckError::LockNotGranted {
                    table: table.name.clone(),
                    tries,
                });
            }
            Err(e) => return Err(locker.failed(e)),
        }
    }
    let snapshots = snapshots_under_lock(nodes, follow, options).await;
    // The lock goes whatever happened: nothing is left waiting on it.
    locker.query("COMMIT").await.map_err(|e| locker.failed(e))?;
    snapshots
}

const BEGIN_SNAPSHOT: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;      SET LOCAL idle_in_transaction_session_timeout = 60000";

async fn snapshots_under_lock(
    nodes: &mut [Checked],
    follow: &Follow,
    options: &CheckOptions,
) -> Result<(), CheckError> {
    let (primary, replicas) = nodes
        .split_first_mut()
        .ok_or_else(|| CheckError::Config("no nodes".to_owned()))?;
    let point = follow.point(primary, true).await?;
    primary
        .query(&format!("{BEGIN_SNAPSHOT}; SELECT 1"))
        .await
        .map_err(|e| primary.failed(e))?;
    let wait = Duration::from_millis(options.replay_timeout_ms);
    let snapshots = replicas
        .iter_mut()
        .map(|replica| reach_then_snapshot(replica, &point, wait));
    join_all(snapshots).await.into_iter().collect()
}

/// Where the other nodes must get to for a point: a replayed WAL position (replicas), or an
/// applied marker (a set's subscribers).
enum Point<'a> {
    Lsn(String),
    Mark { set: &'a str, mark: i64 },
}

impl Follow {
    /// A point after every write committed on the origin so far. Under the table's lock its
    /// writers are held back and nothing else may flush the WAL soon: the WAL position is
    /// then that of a transaction of its own (an xid, so a commit record after it), and a
    /// set's marker is committed at once.
    async fn point(&self, origin: &mut Checked, under_lock: bool) -> Result<Point<'_>, CheckError> {
        if let Follow::Mark(set) = self {
            return raise_mark(origin, set)
                .await
                .map(|mark| Point::Mark { set, mark })
                .map_err(|e| origin.failed(e));
        }
        let sql = match under_lock {
            true => "SELECT pg_current_wal_insert_lsn()::text, txid_current()::text",
            false => "SELECT pg_current_wal_flush_lsn()::text",
        };
        let rows = origin.query(sql).await.map_err(|e| origin.failed(e))?;
        let lsn = first(&rows).ok_or_else(|| origin.failed("no WAL position"))?;
        Ok(Point::Lsn(lsn))
    }
}

/// Waits, holding nothing, until every other node reached what the origin has committed now:
/// the wait under the lock that follows is then only for what is written meanwhile (replay
/// falls behind while a point's snapshot holds it back).
async fn catch_up(
    locker: &mut Checked,
    follow: &Follow,
    nodes: &mut [Checked],
    options: &CheckOptions,
) -> Result<(), CheckError> {
    let point = follow.point(locker, false).await?;
    let wait = Duration::from_millis(options.replay_timeout_ms);
    let reached = nodes
        .iter_mut()
        .skip(1)
        .map(|node| reach(node, &point, wait));
    join_all(reached).await.into_iter().collect()
}

/// Ends every node's transaction of the current point.
async fn end_point(nodes: &mut [Checked]) -> Result<(), CheckError> {
    for node in nodes.iter_mut() {
        node.query("ROLLBACK").await.map_err(|e| node.failed(e))?;
    }
    Ok(())
}

/// One chunk read on every node at the current point: the chunk as cut (its last key, found
/// on the primary's snapshot), and each node's sum, the primary's first; `None` when recovery
/// cancelled a replica's read.
async fn read_chunk(
    nodes: &mut [Checked],
    table: &TableShape,
    chunk: &Chunk,
    options: &CheckOptions,
) -> Result<Option<(Chunk, Vec<ChunkSum>)>, CheckError> {
    let mut chunk = chunk.clone();
    let (primary, replicas) = nodes
        .split_first_mut()
        .ok_or_else(|| CheckError::Config("no nodes".to_owned()))?;
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
    let (on_origin, elsewhere) = (
        table.checksum_sql(&chunk, true),
        table.checksum_sql(&chunk, false),
    );
    let (on_primary, on_replicas) = tokio::join!(
        sum_on(primary, &on_origin),
        join_all(
            replicas
                .iter_mut()
                .map(|replica| sum_on(replica, &elsewhere))
        )
    );
    let mut sums = Vec::with_capacity(on_replicas.len() + 1);
    for sum in std::iter::once(on_primary).chain(on_replicas) {
        match sum? {
            Some(sum) => sums.push(sum),
            None => return Ok(None),
        }
    }
    Ok(Some((chunk, sums)))
}

/// A node's sum for the chunk; `None` if recovery cancelled the query (a replica's).
async fn sum_on(node: &mut Checked, sql: &str) -> Result<Option<ChunkSum>, CheckError> {
    match node.query(sql).await {
        Ok(rows) => rows
            .first()
            .and_then(|r| ChunkSum::from_row(r))
            .map(Some)
            .ok_or_else(|| node.failed("an unreadable checksum")),
        Err(e) if e.is("40001") => Ok(None),
        Err(e) => Err(node.failed(e)),
    }
}

async fn reach_then_snapshot(
    node: &mut Checked,
    point: &Point<'_>,
    wait: Duration,
) -> Result<(), CheckError> {
    reach(node, point, wait).await?;
    // The snapshot is taken by the transaction's first query, while the lock still holds.
    node.query(&format!("{BEGIN_SNAPSHOT}; SELECT 1"))
        .await
        .map_err(|e| node.failed(e))?;
    Ok(())
}

async fn reach(node: &mut Checked, point: &Point<'_>, wait: Duration) -> Result<(), CheckError> {
    match point {
        Point::Lsn(lsn) => replayed(node, lsn, wait).await,
        Point::Mark { set, mark } => wait_applied(node, set, *mark, wait)
            .await
            .map_err(|e| node.failed(e)),
    }
}

/// Waits until `replica` replayed up to `lsn`.
async fn replayed(replica: &mut Checked, lsn: &str, wait: Duration) -> Result<(), CheckError> {
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
        if first(&rows).as_deref() == Some("true") {
            break;
        }
        if started.elapsed() >= wait {
            return Err(CheckError::NotReplaying {
                node: replica.name.clone(),
                lsn: lsn.to_owned(),
                waited_ms: wait.as_millis() as u64,
            });
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn a_sets_check_takes_the_command_lines_defaults() {
        let at = Standalone::parse_from(["check-consistency", "--config", "/etc/x.toml"])
            .options
            .at;
        let options = CheckOptions::of_set(at, "app", ("shop", "pg1"), "host=b").unwrap();
        let plain = Standalone::parse_from(["check-consistency"]).options;
        assert_eq!(options.chunk_rows, plain.chunk_rows);
        assert_eq!(options.replay_timeout_ms, plain.replay_timeout_ms);
        assert_eq!(options.point_ms, plain.point_ms);
        assert_eq!(options.set.as_deref(), Some("shop"));
        assert_eq!(options.origin.as_deref(), Some("pg1"));
        assert_eq!(options.to, ["host=b"]);
        assert_eq!(options.database.as_deref(), Some("app"));
        assert_eq!(
            options.at.config_path().unwrap(),
            std::path::PathBuf::from("/etc/x.toml")
        );
    }
}
