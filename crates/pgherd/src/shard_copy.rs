//! What `shard move` and `shard split` share: copies of a shard's rows on other clusters that
//! follow the shard's primary as replication sets (`pgherd_replication::sets`, a row filter
//! per table where a copy takes only some keys), compared with it at one point, then handed
//! the shard under one PAUSE of the running pgherd ([`Handover`]): the old copy refuses
//! writes, each copy applies everything committed before, sequences are put in step, the
//! shard's two-phase decisions go to its first successor, the copies stop following and take
//! writes, the config names them (and, for a split, the new layout), pgherd reloads and, once
//! it sees each take writes, resumes. Nothing is dropped: the old copy stays, refusing writes.

use std::time::{Duration, Instant};

use pgherd_config::{Config, NodeConfig};
use pgherd_proxy::server::ServerConn;
use pgherd_replication::consistency::{quote_literal, TableShape, TABLES_SQL};
use pgherd_replication::sets::{self as set, RowFilters};
use pgherd_route::reshard::SplitPlan;

use crate::local::Where;
use crate::set_nodes::{raise_mark, set_user_tables, wait_applied};
use crate::sets::{connect_subscriber, subscriber_at, sync_sequences, Origin};
use crate::sql_session::{client_rows, first, pg_error, QueryFailure, SqlSession};

/// How long a copy may take to apply what the old copy committed, while pgherd holds new
/// transactions.
const CATCH_UP_WAIT: Duration = Duration::from_secs(30);

/// A copy to make: the set that carries it, where it goes and which rows it takes.
pub(crate) struct CopyOrder<'a> {
    pub(crate) set: String,
    /// The cluster, as a libpq connection string.
    pub(crate) to: &'a str,
    pub(crate) database: &'a str,
    pub(crate) wait: Duration,
    pub(crate) at: &'a Where,
    pub(crate) row_filters: RowFilters,
}

/// The shard's primary and a copy that follows it.
pub(crate) struct Copy {
    pub(crate) set: String,
    pub(crate) shown: String,
    pub(crate) client: tokio_postgres::Client,
    /// The set's tables, quoted for statements.
    pub(crate) tables: Vec<String>,
}

/// The copy: schema, set, subscription with its initial copy, then the comparison.
pub(crate) async fn make_copy(
    config: &Config,
    (origin, conn): (&NodeConfig, &mut ServerConn),
    order: CopyOrder<'_>,
) -> Result<Copy, String> {
    let (shown, parsed) = subscriber_at(order.to)?;
    let client = connect_subscriber(&shown, &parsed, &config.server_tls).await?;
    let theirs = client_rows(&client, TABLES_SQL)
        .await
        .map_err(|e| format!("{shown}: {}", pg_error(&e)))?;
    let has_tables = theirs
        .iter()
        .filter_map(|row| TableShape::from_row(row).ok())
        .any(|t| !t.name.starts_with("pgherd."));
    if !has_tables {
        copy_schema(config, origin, order.database, &client)
            .await
            .map_err(|e| format!("{shown}: the shard's schema could not be made there: {e}"))?;
    }
    let set = order.set;
    let on = Origin {
        database: order.database.to_owned(),
        origin: Some(origin.name.clone()),
        at: order.at.clone(),
    };
    // `choose_sequences` refuses patterns that choose none: asked only when there are some.
    let no_sequences = conn
        .simple_query(set::SEQUENCES_SQL)
        .await
        .map(|rows| rows.is_empty())
        .map_err(|e| format!("{}: {e}", origin.name))?;
    let sequence_patterns = match no_sequences {
        true => Vec::new(),
        false => vec!["*".to_owned()],
    };
    let patterns = (&["*".to_owned()][..], &sequence_patterns[..]);
    crate::sets::create(&set, patterns, &order.row_filters, &on).await?;
    let how = crate::sets::Subscribing {
        wait: order.wait,
        again: false,
    };
    crate::sets::subscribe(&set, order.to, how, &on).await?;
    let check = crate::consistency::CheckOptions::of_set(
        order.at.clone(),
        order.database,
        (&set, &origin.name),
        order.to,
    )?;
    crate::consistency::check_all(config, &check)
        .await
        .map_err(|e| {
            format!("{e}; nothing was cut over: {shown} follows the shard as set {set}")
        })?;
    let tables = set_user_tables(conn, &set)
        .await?
        .ok_or_else(|| format!("set {set} vanished from {}", origin.name))?
        .into_iter()
        .map(|t| t.sql_name)
        .collect();
    Ok(Copy {
        set,
        shown,
        client,
        tables,
    })
}

/// A copy that takes over shard `shard` as the config's node `name` at `address`.
pub(crate) struct Successor {
    pub(crate) copy: Copy,
    pub(crate) shard: u32,
    pub(crate) name: String,
    pub(crate) address: (String, u16),
}

/// A shard handed to its successors under one PAUSE of the running pgherd.
pub(crate) struct Handover<'a> {
    /// The shard whose nodes leave the config.
    pub(crate) shard: u32,
    pub(crate) origin: &'a NodeConfig,
    pub(crate) database: &'a str,
    /// The first takes the shard's number and its two-phase decisions; every copy's set holds
    /// every table of the origin.
    pub(crate) successors: &'a [Successor],
    /// A split: the layout it writes into the config.
    pub(crate) split: Option<&'a SplitPlan>,
}

impl Handover<'_> {
    /// New transactions held at pgherd while the copies take over; RESUME whatever happens.
    /// Returns how long they were held.
    pub(crate) async fn run(
        &self,
        config: &Config,
        console: &tokio_postgres::Client,
    ) -> Result<u128, String> {
        let held = Instant::now();
        console.simple_query("PAUSE").await.map_err(|e| {
            format!(
                "pgherd did not pause: {}; nothing was cut over",
                pg_error(&e)
            )
        })?;
        let outcome = self.switch(config, console).await;
        let resumed = console.simple_query("RESUME").await;
        let held_ms = held.elapsed().as_millis();
        outcome?;
        resumed.map_err(|e| {
            format!(
                "shard {} has its new nodes, but RESUME failed: {}; resume pgherd by hand (pgherd resume)",
                self.shard,
                pg_error(&e)
            )
        })?;
        Ok(held_ms)
    }

    /// Under PAUSE: the old copy refuses writes first (a transaction that began just as
    /// PAUSE came is refused there rather than committed after the marker and lost), the
    /// copies catch up and take writes, the config names them, pgherd reloads and sees them
    /// take writes. If a copy cannot take over, the old copy takes writes again.
    async fn switch(
        &self,
        config: &Config,
        console: &tokio_postgres::Client,
    ) -> Result<(), String> {
        let [first_successor, ..] = self.successors else {
            return Err("no copy to hand the shard to".to_owned());
        };
        let guard = &first_successor.copy;
        let mut conn = crate::clone::session_in(config, self.origin, self.database).await?;
        let on_origin = |e: String| format!("{}: {e}; nothing was cut over", self.origin.name);
        let pending = first(
            &conn
                .simple_query(
                    "SELECT count(*)::text FROM pg_prepared_xacts WHERE database = current_database()",
                )
                .await
                .map_err(|e| on_origin(e.to_string()))?,
        );
        if pending.as_deref() != Some("0") {
            return Err(on_origin(format!(
                "{} prepared transaction(s) wait there (pgherd's recovery ends them): try again",
                pending.unwrap_or_default()
            )));
        }
        let tables: Vec<&str> = guard.tables.iter().map(String::as_str).collect();
        let names: Vec<&str> = self.successors.iter().map(|s| s.name.as_str()).collect();
        conn.simple_query(&set::deny_writes_sql(
            &guard.set,
            &names.join(" and "),
            &tables,
        ))
        .await
        .map_err(|e| on_origin(e.to_string()))?;
        if let Err(e) = self.take_over(&mut conn).await {
            let undone = conn
                .simple_query(&set::allow_writes_sql(&guard.set, &tables))
                .await
                .map_or_else(
                    |u| format!("and its writes are still refused ({u}): drop the pgherd_deny_{} triggers there", guard.set),
                    |_| "and takes writes again".to_owned(),
                );
            return Err(format!(
                "{e}; nothing was cut over: shard {} stays on {} {undone}",
                self.shard, self.origin.name
            ));
        }
        for successor in self.successors {
            conn.simple_query(&set::release_sql(&successor.copy.set))
                .await
                .map_err(|e| {
                    format!(
                        "{}: {e} (its publication of set {} stays)",
                        self.origin.name, successor.copy.set
                    )
                })?;
        }
        self.name_successors(config)?;
        console
            .simple_query("RELOAD")
            .await
            .map_err(|e| format!("pgherd did not reload: {}", pg_error(&e)))?;
        for successor in self.successors {
            wait_for_writer(console, successor).await?;
        }
        Ok(())
    }

    /// Each copy applies everything the old copy committed (its set's marker), its sequences
    /// are put in step, it stops following and its tables take writes; the first also gets
    /// the shard's two-phase decisions.
    async fn take_over(&self, conn: &mut ServerConn) -> Result<(), String> {
        for successor in self.successors {
            let copy = &successor.copy;
            let mark = raise_mark(conn, &copy.set)
                .await
                .map_err(|e| format!("{}: {e}", self.origin.name))?;
            wait_applied(&mut &copy.client, &copy.set, mark, CATCH_UP_WAIT)
                .await
                .map_err(|e| format!("{}: {e}", copy.shown))?;
            sync_sequences(
                conn,
                &self.origin.name,
                &copy.set,
                &[(&copy.shown, &copy.client)],
            )
            .await?;
        }
        if let Some(first_successor) = self.successors.first() {
            carry_decisions(conn, self.origin, &first_successor.copy).await?;
        }
        for successor in self.successors {
            let copy = &successor.copy;
            let on_copy = |e: tokio_postgres::Error| format!("{}: {}", copy.shown, pg_error(&e));
            let subscription = set::subscription(&copy.set, &copy.shown);
            copy.client
                .batch_execute(&set::drop_subscription_sql(&subscription, false))
                .await
                .map_err(on_copy)?;
            let tables: Vec<&str> = copy.tables.iter().map(String::as_str).collect();
            copy.client
                .batch_execute(&set::allow_writes_sql(&copy.set, &tables))
                .await
                .map_err(on_copy)?;
        }
        Ok(())
    }

    /// The config's entries of the shard are replaced by the successors'; a split's layout
    /// gains the new shard (its range's start, an empty list).
    fn name_successors(&self, config: &Config) -> Result<(), String> {
        let shard = i64::from(self.shard);
        let names: Vec<&str> = self.successors.iter().map(|s| s.name.as_str()).collect();
        let change = format!("with {}", names.join(" and "));
        crate::config_file::edit_document(&config.source, &change, |document| {
            let nodes = crate::config_file::nodes_of(document)?;
            let of_shard = |n: &toml_edit::Table| {
                n.get("shard")
                    .and_then(toml_edit::Item::as_integer)
                    .unwrap_or(0)
                    == shard
            };
            nodes.retain(|n| !of_shard(n));
            for successor in self.successors {
                let (host, port) = &successor.address;
                let mut entry = toml_edit::Table::new();
                entry.insert("name", toml_edit::value(successor.name.as_str()));
                entry.insert("host", toml_edit::value(host.as_str()));
                entry.insert("port", toml_edit::value(i64::from(*port)));
                entry.insert("shard", toml_edit::value(i64::from(successor.shard)));
                nodes.push(entry);
            }
            match self.split {
                Some(plan) => write_split_layout(document, plan),
                None => Ok(()),
            }
        })
        .map_err(|e| format!("{e}; the copies take writes but pgherd still routes to the old one"))
    }
}

/// The split's new shard in `[[sharding.tables]]`: each range table's `starts` gains its cut,
/// each list table's `values` an empty list.
fn write_split_layout(
    document: &mut toml_edit::DocumentMut,
    plan: &SplitPlan,
) -> Result<(), String> {
    let tables = document
        .get_mut("sharding")
        .and_then(|s| s.get_mut("tables"))
        .and_then(toml_edit::Item::as_array_of_tables_mut)
        .ok_or("the config has no [[sharding.tables]]")?;
    for entry in tables.iter_mut() {
        let name = entry.get("table").and_then(toml_edit::Item::as_str);
        let Some(split) = plan.tables.iter().find(|t| Some(t.table.as_str()) == name) else {
            continue;
        };
        let (field, value) = match split.at {
            Some(at) => ("starts", toml_edit::Value::from(at)),
            None => ("values", toml_edit::Value::Array(toml_edit::Array::new())),
        };
        entry
            .get_mut(field)
            .and_then(toml_edit::Item::as_array_mut)
            .ok_or_else(|| format!("[[sharding.tables]] {}: no {field} array", split.table))?
            .push(value);
    }
    Ok(())
}

/// Waits until pgherd's view has the successor taking its shard's writes (its monitor's
/// first check and the shard's election).
async fn wait_for_writer(
    console: &tokio_postgres::Client,
    successor: &Successor,
) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let rows = client_rows(console, "SHOW SHARDS")
            .await
            .map_err(|e| format!("SHOW SHARDS: {}", pg_error(&e)))?;
        let writes = rows.iter().any(|row| {
            row.first().cloned().flatten() == Some(successor.shard.to_string())
                && row.get(1).cloned().flatten().as_deref() == Some(successor.name.as_str())
                && matches!(row.get(6).cloned().flatten().as_deref(), Some("yes"))
        });
        if writes {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(10) {
            return Err(format!(
                "pgherd does not see {} take shard {}'s writes after 10 s (SHOW SHARDS: {rows:?})",
                successor.name, successor.shard
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The two-phase decisions this shard recorded as a decider (`pgherd.decisions`, which is not
/// in the set: pgherd's own schema never is): a transaction prepared on another shard and not
/// yet finished is finished by asking its decider, from now on the copy. Under PAUSE no
/// decision is being recorded. Returns how many were carried.
async fn carry_decisions(
    conn: &mut ServerConn,
    origin: &NodeConfig,
    copy: &Copy,
) -> Result<usize, String> {
    let on_origin = |e: QueryFailure| format!("{}: {e}", origin.name);
    if !has_decisions(conn).await.map_err(on_origin)? {
        return Ok(0);
    }
    let rows = conn
        .rows("SELECT gid, committed::text, decided_at::text FROM pgherd.decisions")
        .await
        .map_err(on_origin)?;
    let values: Vec<String> = rows
        .iter()
        .filter_map(|row| match row.as_slice() {
            [Some(gid), Some(committed), Some(at)] => Some(format!(
                "({}, {committed}, {}::timestamptz)",
                quote_literal(gid),
                quote_literal(at)
            )),
            _ => None,
        })
        .collect();
    if values.is_empty() {
        return Ok(0);
    }
    let on_copy = |e: QueryFailure| {
        format!(
            "{}: the shard's two-phase decisions could not be carried: {e}",
            copy.shown
        )
    };
    let mut target = &copy.client;
    if !has_decisions(&mut target).await.map_err(on_copy)? {
        target
            .rows(pgherd_route::two_phase::DECISIONS_DDL)
            .await
            .map_err(on_copy)?;
    }
    target
        .rows(&format!(
            "INSERT INTO pgherd.decisions (gid, committed, decided_at) VALUES {} \
             ON CONFLICT (gid) DO NOTHING",
            values.join(", ")
        ))
        .await
        .map_err(on_copy)?;
    Ok(values.len())
}

/// Whether the node's database has pgherd's decisions table.
async fn has_decisions(node: &mut impl SqlSession) -> Result<bool, QueryFailure> {
    let rows = node
        .rows("SELECT (to_regclass('pgherd.decisions') IS NOT NULL)::text")
        .await?;
    Ok(first(&rows).as_deref() == Some("true"))
}

/// Tables whose changes logical replication could not carry to a copy get `REPLICA IDENTITY
/// FULL` (each change then carries the whole row): a table without a primary key, and one
/// whose row filter names a column outside its key (`filter_columns`, by `schema.table`:
/// PostgreSQL refuses updates and deletes of it otherwise). It stays so on the old copy,
/// which takes no writes after the cut-over.
pub(crate) async fn full_identity_where_needed(
    conn: &mut ServerConn,
    origin: &str,
    filter_columns: &std::collections::BTreeMap<String, String>,
) -> Result<(), String> {
    let needs_full = |t: &TableShape| {
        let filter_outside_key = filter_columns.get(&t.name).is_some_and(|column| {
            !t.key
                .iter()
                .any(|k| k.sql_name == *column || k.sql_name == set::quote_ident(column))
        });
        !t.full_identity && (!t.replicable() || filter_outside_key)
    };
    let changed: Vec<TableShape> = crate::sets::tables_of(conn)
        .await
        .map_err(|e| format!("{origin}: {e}"))?
        .into_iter()
        .filter(|t| !t.name.starts_with("pgherd.") && needs_full(t))
        .collect();
    for table in &changed {
        conn.simple_query(&format!(
            "SET lock_timeout = '10s'; ALTER TABLE {} REPLICA IDENTITY FULL; RESET lock_timeout",
            table.sql_name
        ))
        .await
        .map_err(|e| format!("{origin}: {e}; nothing was copied"))?;
    }
    for table in &changed {
        let why = match table.key.is_empty() {
            true => "has no primary key",
            false => "is split by a column outside its primary key",
        };
        eprintln!(
            "{} {why}: published with REPLICA IDENTITY FULL for the copy (each change carries the whole row)",
            table.name
        );
    }
    Ok(())
}

/// Where a connection string points: a new node's `host` and `port` in the config.
pub(crate) fn address_of(conninfo: &str) -> Result<(String, u16), String> {
    let parsed: tokio_postgres::Config = conninfo
        .parse()
        .map_err(|e| format!("not a connection string: {e}"))?;
    let host = match parsed.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => return Err("name the new node's host (host=...)".to_owned()),
    };
    Ok((host, parsed.get_ports().first().copied().unwrap_or(5432)))
}

/// A session on the running pgherd's admin console, as the `[cluster]` user.
pub(crate) async fn console(config: &Config) -> Result<tokio_postgres::Client, String> {
    let listen = config
        .proxy
        .listen
        .first()
        .ok_or("the config has no listen address")?;
    let address = crate::operate::connectable(*listen);
    let mut console = tokio_postgres::Config::new();
    console
        .host(address.ip().to_string())
        .port(address.port())
        .user(&config.cluster.user)
        .dbname("pgherd")
        .connect_timeout(Duration::from_secs(5));
    if let Some(password) = &config.cluster.password {
        console.password(password);
    }
    let (client, connection) = console.connect(tokio_postgres::NoTls).await.map_err(|e| {
        format!(
            "pgherd's admin console at {address}: {} (pgherd must be running: it holds new transactions during the cut-over)",
            pg_error(&e)
        )
    })?;
    tokio::spawn(connection);
    Ok(client)
}

/// The shard's schema (every schema's tables, sequences, functions; no data, publications
/// or subscriptions) made on the new copy, as `pg_dump --schema-only` writes it.
async fn copy_schema(
    config: &Config,
    origin: &NodeConfig,
    database: &str,
    target: &tokio_postgres::Client,
) -> Result<(), String> {
    let (command, _pass_file) = crate::operate::cluster_tool(config, "pg_dump")?;
    let out = tokio::process::Command::from(command)
        .args([
            "--schema-only",
            "--no-publications",
            "--no-subscriptions",
            "-h",
        ])
        .arg(&origin.host)
        .arg("-p")
        .arg(origin.port.to_string())
        .arg("-U")
        .arg(&config.cluster.user)
        .arg("-d")
        .arg(database)
        .output()
        .await
        .map_err(|e| format!("cannot run pg_dump: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "pg_dump: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let statements = schema_statements(&String::from_utf8_lossy(&out.stdout))?;
    target
        .batch_execute(&statements)
        .await
        .map_err(|e| pg_error(&e))
}

/// A plain dump's SQL without the psql meta-commands recent pg_dump releases put around it
/// (`\restrict KEY`, `\unrestrict KEY`: a guard for psql, which this does not go through);
/// any other meta-command is refused, since only psql could run it.
fn schema_statements(dump: &str) -> Result<String, String> {
    let mut sql = String::with_capacity(dump.len());
    for line in dump.lines() {
        if line.starts_with("\\restrict ") || line.starts_with("\\unrestrict ") {
            continue;
        }
        if line.starts_with('\\') {
            return Err(format!(
                "pg_dump wrote a psql meta-command this cannot run: {line}"
            ));
        }
        sql.push_str(line);
        sql.push('\n');
    }
    Ok(sql)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgherd_route::reshard::{SplitPlan, TableSplit};

    #[test]
    fn a_dump_loses_its_psql_guard_and_nothing_else() {
        let dump = "\\restrict abc\nCREATE TABLE t (v text DEFAULT '\\x');\n\\unrestrict abc\n";
        assert_eq!(
            schema_statements(dump).unwrap(),
            "CREATE TABLE t (v text DEFAULT '\\x');\n"
        );
        assert!(schema_statements("\\connect other\n").is_err());
    }

    #[test]
    fn a_split_appends_the_new_shard_to_the_layout_and_keeps_comments() {
        let text = "[sharding]\n\
                    [[sharding.tables]]\ntable = \"accounts\"  # by id\ncolumn = \"id\"\ntype = \"integer\"\n\
                    method = \"range\"\nstarts = [0, 1000]\n\n\
                    [[sharding.tables]]\ntable = \"regions\"\ncolumn = \"id\"\ntype = \"integer\"\n\
                    method = \"list\"\nvalues = [[\"1\"], [\"2\"]]\n";
        let mut document: toml_edit::DocumentMut = text.parse().unwrap();
        let plan = SplitPlan {
            shard: 1,
            new_shard: 2,
            tables: vec![
                TableSplit {
                    table: "accounts".into(),
                    column: "id".into(),
                    at: Some(1500),
                },
                TableSplit {
                    table: "regions".into(),
                    column: "id".into(),
                    at: None,
                },
            ],
        };
        write_split_layout(&mut document, &plan).unwrap();
        let written = document.to_string();
        assert!(written.contains("starts = [0, 1000, 1500]"), "{written}");
        assert!(
            written.contains("values = [[\"1\"], [\"2\"], []]"),
            "{written}"
        );
        assert!(written.contains("# by id"), "{written}");
    }
}
