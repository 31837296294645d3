//! `pgherd shard move SHARD --to CONNINFO --name NODE --database DB`: a shard's rows go to
//! another cluster while clients keep writing, with the replication-set machinery
//! (`pgherd_replication::sets`): the shard's primary publishes every table of the database as
//! the set `shard<N>_move`, the new cluster subscribes (its schema copied first with
//! `pg_dump --schema-only` when it has no tables), its copy is compared with the shard's at
//! one point (`check-consistency --set`), and only then is it cut over: the running pgherd
//! holds new transactions (`PAUSE`), the old copy refuses writes (25006), the copy applies
//! everything committed before, sequences are put in step, the copy stops following and takes
//! writes, the config's shard entry names the new node, pgherd reloads and, once it sees the
//! new node take writes, resumes. Nothing is dropped: the old copy stays, read-only, until its
//! owner drops it.

use std::time::{Duration, Instant};

use pgherd_config::{Config, NodeConfig};
use pgherd_proxy::server::ServerConn;
use pgherd_replication::consistency::{quote_literal, TableShape, TABLES_SQL};
use pgherd_replication::sets as set;

use crate::local::Where;
use crate::set_nodes::{raise_mark, set_user_tables, wait_applied};
use crate::sets::{connect_subscriber, primary_among, subscriber_at, sync_sequences, Origin};
use crate::sql_session::{client_rows, first, pg_error, QueryFailure, SqlSession};

/// How long the copy may take to apply what the old copy committed, while pgherd holds new
/// transactions.
const CATCH_UP_WAIT: Duration = Duration::from_secs(30);

#[derive(clap::Subcommand, Debug)]
pub enum ShardCommand {
    /// Move a shard to another cluster while clients write: its rows copied and streamed,
    /// compared, then cut over with new transactions held at pgherd for the moment it takes;
    /// the old copy is kept, refusing writes.
    Move {
        /// The shard to move (its number, as `shard = N` in the config).
        shard: u32,
        /// The cluster to move it to, as a libpq connection string (a superuser there, its
        /// database made; its tables are made from the shard's schema if it has none).
        #[arg(long)]
        to: String,
        /// The name of the shard's node in the config from then on.
        #[arg(long)]
        name: String,
        /// The database the shard's tables are in.
        #[arg(long)]
        database: String,
        /// How long the initial copy may take.
        #[arg(long, default_value_t = 600)]
        wait_s: u64,
        #[command(flatten)]
        at: Where,
    },
}

pub fn run(command: ShardCommand) -> Result<(), String> {
    let ShardCommand::Move {
        shard,
        to,
        name,
        database,
        wait_s,
        at,
    } = command;
    let moving = Move {
        shard,
        to,
        name,
        database,
        wait: Duration::from_secs(wait_s),
        at,
    };
    crate::runtime(1)?.block_on(moving.run())
}

struct Move {
    shard: u32,
    to: String,
    name: String,
    database: String,
    wait: Duration,
    at: Where,
}

/// The shard's primary and the new copy, once it follows the shard.
struct Copy {
    set: String,
    origin: NodeConfig,
    shown: String,
    client: tokio_postgres::Client,
    /// The set's tables, quoted for statements.
    tables: Vec<String>,
}

impl Move {
    async fn run(&self) -> Result<(), String> {
        let config = Config::load(&self.at.config_path()?).map_err(|e| e.to_string())?;
        let nodes = self.shard_nodes(&config)?;
        let (target_host, target_port) = address_of(&self.to)?;
        // The cut-over needs the running pgherd: asked before anything is made.
        let console = console(&config).await?;
        let (origin, conn) = primary_among(&config, &nodes, &self.database)
            .await
            .map_err(|silent| {
                format!(
                    "shard {}: no node answers as the primary{silent}",
                    self.shard
                )
            })?;
        let copy = self.copy(&config, origin, conn).await?;
        let held_ms = self
            .cut_over(&config, &console, &copy, (&target_host, target_port))
            .await?;
        let old: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
        println!(
            "shard {} moved to {} ({}): new transactions were held {held_ms} ms; {} left the config; the old copy on {} refuses writes (25006) and is kept until you drop it",
            self.shard,
            self.name,
            copy.shown,
            old.join(", "),
            copy.origin.name
        );
        Ok(())
    }

    fn shard_nodes(&self, config: &Config) -> Result<Vec<NodeConfig>, String> {
        let sharding = config
            .sharding
            .as_ref()
            .ok_or("the config has no [sharding] section: there are no shards to move")?;
        let nodes = sharding
            .shard_nodes
            .get(self.shard as usize)
            .ok_or_else(|| {
                format!(
                    "no shard {} (the config has {})",
                    self.shard,
                    sharding.shard_nodes.len()
                )
            })?;
        if config.node_of_any_shard(&self.name).is_some() {
            return Err(format!(
                "a node named {} is in the config already: name the new one otherwise",
                self.name
            ));
        }
        Ok(nodes.clone())
    }

    /// The copy: schema, set, subscription with its initial copy, then the comparison.
    async fn copy(
        &self,
        config: &Config,
        origin: NodeConfig,
        mut conn: ServerConn,
    ) -> Result<Copy, String> {
        let (shown, parsed) = subscriber_at(&self.to)?;
        let client = connect_subscriber(&shown, &parsed).await?;
        let theirs = client_rows(&client, TABLES_SQL)
            .await
            .map_err(|e| format!("{shown}: {}", pg_error(&e)))?;
        let has_tables = theirs
            .iter()
            .filter_map(|row| TableShape::from_row(row).ok())
            .any(|t| !t.name.starts_with("pgherd."));
        if !has_tables {
            copy_schema(config, &origin, &self.database, &client)
                .await
                .map_err(|e| format!("{shown}: the shard's schema could not be made there: {e}"))?;
        }
        full_identity_for_keyless(&mut conn, &origin.name).await?;
        let set = format!("shard{}_move", self.shard);
        let on = Origin {
            database: self.database.clone(),
            origin: Some(origin.name.clone()),
            at: self.at.clone(),
        };
        let no_sequences = conn
            .simple_query(set::SEQUENCES_SQL)
            .await
            .map(|rows| rows.is_empty())
            .map_err(|e| format!("{}: {e}", origin.name))?;
        let sequence_patterns = match no_sequences {
            true => Vec::new(),
            false => vec!["*".to_owned()],
        };
        crate::sets::create(&set, (&["*".to_owned()], &sequence_patterns), &on).await?;
        crate::sets::subscribe(&set, &self.to, self.wait, &on).await?;
        let check = crate::consistency::CheckOptions::of_set(
            self.at.clone(),
            &self.database,
            (&set, &origin.name),
            &self.to,
        )?;
        crate::consistency::check_all(config, &check)
            .await
            .map_err(|e| {
                format!(
                    "{e}; nothing was cut over: {shown} follows shard {} as set {set}",
                    self.shard
                )
            })?;
        let tables = set_user_tables(&mut conn, &set)
            .await?
            .ok_or_else(|| format!("set {set} vanished from {}", origin.name))?
            .into_iter()
            .map(|t| t.sql_name)
            .collect();
        Ok(Copy {
            set,
            origin,
            shown,
            client,
            tables,
        })
    }

    /// New transactions held at pgherd while the copy takes over; RESUME whatever happens.
    /// Returns how long they were held.
    async fn cut_over(
        &self,
        config: &Config,
        console: &tokio_postgres::Client,
        copy: &Copy,
        target: (&str, u16),
    ) -> Result<u128, String> {
        let held = Instant::now();
        console.simple_query("PAUSE").await.map_err(|e| {
            format!(
                "pgherd did not pause: {}; nothing was cut over",
                pg_error(&e)
            )
        })?;
        let outcome = self.switch(config, console, copy, target).await;
        let resumed = console.simple_query("RESUME").await;
        let held_ms = held.elapsed().as_millis();
        outcome?;
        resumed.map_err(|e| {
            format!(
                "shard {} is on {}, but RESUME failed: {}; resume pgherd by hand (pgherd resume)",
                self.shard,
                self.name,
                pg_error(&e)
            )
        })?;
        Ok(held_ms)
    }

    /// Under PAUSE: the old copy refuses writes first (a transaction that began just as
    /// PAUSE came is refused there rather than committed after the marker and lost), the copy
    /// catches up and takes writes, the config names the new node, pgherd reloads and sees it
    /// take writes. If the copy cannot take over, the old copy takes writes again.
    async fn switch(
        &self,
        config: &Config,
        console: &tokio_postgres::Client,
        copy: &Copy,
        target: (&str, u16),
    ) -> Result<(), String> {
        let mut conn = crate::clone::session_in(config, &copy.origin, &self.database).await?;
        let on_origin = |e: String| format!("{}: {e}; nothing was cut over", copy.origin.name);
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
        let tables: Vec<&str> = copy.tables.iter().map(String::as_str).collect();
        conn.simple_query(&set::deny_writes_sql(&copy.set, &self.name, &tables))
            .await
            .map_err(|e| on_origin(e.to_string()))?;
        if let Err(e) = self.take_over(&mut conn, copy, &tables).await {
            let undone = conn
                .simple_query(&set::allow_writes_sql(&copy.set, &tables))
                .await
                .map_or_else(
                    |u| format!("and its writes are still refused ({u}): drop the pgherd_deny_{} triggers there", copy.set),
                    |_| "and takes writes again".to_owned(),
                );
            return Err(format!(
                "{e}; nothing was cut over: shard {} stays on {} {undone}",
                self.shard, copy.origin.name
            ));
        }
        conn.simple_query(&set::release_sql(&copy.set))
            .await
            .map_err(|e| {
                format!(
                    "{}: {e} (its publication of the set stays)",
                    copy.origin.name
                )
            })?;
        self.name_new_node(config, target)?;
        console
            .simple_query("RELOAD")
            .await
            .map_err(|e| format!("pgherd did not reload: {}", pg_error(&e)))?;
        self.wait_for_writer(console).await
    }

    /// The copy applies everything the old copy committed (the set's marker), its sequences
    /// are put in step, it stops following and its tables take writes.
    async fn take_over(
        &self,
        conn: &mut ServerConn,
        copy: &Copy,
        tables: &[&str],
    ) -> Result<(), String> {
        let on_copy = |e: tokio_postgres::Error| format!("{}: {}", copy.shown, pg_error(&e));
        let mark = raise_mark(conn, &copy.set)
            .await
            .map_err(|e| format!("{}: {e}", copy.origin.name))?;
        wait_applied(&mut &copy.client, &copy.set, mark, CATCH_UP_WAIT)
            .await
            .map_err(|e| format!("{}: {e}", copy.shown))?;
        sync_sequences(
            conn,
            &copy.origin.name,
            &copy.set,
            &[(&copy.shown, &copy.client)],
        )
        .await?;
        carry_decisions(conn, copy).await?;
        let subscription = set::subscription(&copy.set, &copy.shown);
        copy.client
            .batch_execute(&set::drop_subscription_sql(&subscription, false))
            .await
            .map_err(on_copy)?;
        copy.client
            .batch_execute(&set::allow_writes_sql(&copy.set, tables))
            .await
            .map_err(on_copy)
    }

    /// The config's entries of the shard are replaced by the new node's.
    fn name_new_node(&self, config: &Config, (host, port): (&str, u16)) -> Result<(), String> {
        let shard = i64::from(self.shard);
        crate::config_file::edit_nodes(&config.source, &format!("with {}", self.name), |nodes| {
            let of_shard = |n: &toml_edit::Table| {
                n.get("shard")
                    .and_then(toml_edit::Item::as_integer)
                    .unwrap_or(0)
                    == shard
            };
            nodes.retain(|n| !of_shard(n));
            let mut entry = toml_edit::Table::new();
            entry.insert("name", toml_edit::value(self.name.as_str()));
            entry.insert("host", toml_edit::value(host));
            entry.insert("port", toml_edit::value(i64::from(port)));
            entry.insert("shard", toml_edit::value(shard));
            nodes.push(entry);
            Ok(())
        })
        .map_err(|e| format!("{e}; the copy takes writes but pgherd still routes to the old one"))
    }

    /// Waits until pgherd's view has the new node taking the shard's writes (its monitor's
    /// first check and the shard's election).
    async fn wait_for_writer(&self, console: &tokio_postgres::Client) -> Result<(), String> {
        let started = Instant::now();
        loop {
            let rows = client_rows(console, "SHOW SHARDS")
                .await
                .map_err(|e| format!("SHOW SHARDS: {}", pg_error(&e)))?;
            let writes = rows.iter().any(|row| {
                row.first().cloned().flatten() == Some(self.shard.to_string())
                    && row.get(1).cloned().flatten().as_deref() == Some(self.name.as_str())
                    && matches!(row.get(6).cloned().flatten().as_deref(), Some("yes"))
            });
            if writes {
                return Ok(());
            }
            if started.elapsed() > Duration::from_secs(10) {
                return Err(format!(
                    "pgherd does not see {} take shard {}'s writes after 10 s (SHOW SHARDS: {rows:?})",
                    self.name, self.shard
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The two-phase decisions this shard recorded as a decider (`pgherd.decisions`, which is not
/// in the set: pgherd's own schema never is): a transaction prepared on another shard and not
/// yet finished is finished by asking its decider, from now on the copy. Under PAUSE no
/// decision is being recorded. Returns how many were carried.
async fn carry_decisions(conn: &mut ServerConn, copy: &Copy) -> Result<usize, String> {
    let on_origin = |e: QueryFailure| format!("{}: {e}", copy.origin.name);
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

/// A table without a primary key moves too: its changes are published with every column
/// (`REPLICA IDENTITY FULL`), by which the copy finds the rows an update or delete touches.
/// It stays so on the old copy, which takes no writes after the move.
async fn full_identity_for_keyless(conn: &mut ServerConn, origin: &str) -> Result<(), String> {
    let keyless: Vec<TableShape> = crate::sets::tables_of(conn)
        .await
        .map_err(|e| format!("{origin}: {e}"))?
        .into_iter()
        .filter(|t| !t.name.starts_with("pgherd.") && !t.replicable())
        .collect();
    for table in &keyless {
        conn.simple_query(&format!(
            "SET lock_timeout = '10s'; ALTER TABLE {} REPLICA IDENTITY FULL; RESET lock_timeout",
            table.sql_name
        ))
        .await
        .map_err(|e| format!("{origin}: {e}; nothing was moved"))?;
    }
    if !keyless.is_empty() {
        let names: Vec<&str> = keyless.iter().map(|t| t.name.as_str()).collect();
        eprintln!(
            "{} {} no primary key: published with REPLICA IDENTITY FULL for the move (each change carries the whole row)",
            names.join(", "),
            if names.len() == 1 { "has" } else { "have" }
        );
    }
    Ok(())
}

/// Where the connection string points: the new node's `host` and `port` in the config.
fn address_of(conninfo: &str) -> Result<(String, u16), String> {
    let parsed: tokio_postgres::Config = conninfo
        .parse()
        .map_err(|e| format!("--to: not a connection string: {e}"))?;
    let host = match parsed.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => return Err("--to: name the new node's host (host=...)".to_owned()),
    };
    Ok((host, parsed.get_ports().first().copied().unwrap_or(5432)))
}

/// A session on the running pgherd's admin console, as the `[cluster]` user.
async fn console(config: &Config) -> Result<tokio_postgres::Client, String> {
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

    #[test]
    fn a_dump_loses_its_psql_guard_and_nothing_else() {
        let dump = "\\restrict abc\nCREATE TABLE t (v text DEFAULT '\\x');\n\\unrestrict abc\n";
        assert_eq!(
            schema_statements(dump).unwrap(),
            "CREATE TABLE t (v text DEFAULT '\\x');\n"
        );
        assert!(schema_statements("\\connect other\n").is_err());
    }
}
