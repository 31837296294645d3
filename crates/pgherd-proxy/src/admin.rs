//! The admin console: SQL-ish commands on the virtual database `pgherd`
//! (`psql -p 6432 -U admin pgherd`), named as in PgBouncer where they mean the same thing.
//! Admin users may change things; stats users may only look.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use bytes::BytesMut;
use pgherd_wire::backend::{self, TxStatus};
use pgherd_wire::frontend::{self, tag as ftag};
use pgherd_wire::startup::CancelKey;
use pgherd_wire::{PgError, Severity, SqlState, WireError};

use crate::app::App;
use crate::clients::ClientShared;
use crate::error::{client_io, Disconnect};
use crate::msgio::{read_message, write_flush, ReadError};
use crate::stream::Stream;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A result set of text columns.
struct Table {
    columns: &'static [&'static str],
    rows: Vec<Vec<String>>,
}

enum Outcome {
    Rows(Table),
    Done(&'static str, Vec<String>),
}

pub fn write_login(out: &mut BytesMut, key: CancelKey) -> Result<(), WireError> {
    for (name, value) in [
        ("server_version", format!("15.0 (pgherd {VERSION})")),
        ("server_encoding", "UTF8".into()),
        ("client_encoding", "UTF8".into()),
        ("DateStyle", "ISO, MDY".into()),
        ("integer_datetimes", "on".into()),
        ("standard_conforming_strings", "on".into()),
        ("application_name", "pgherd".into()),
    ] {
        backend::encode_parameter_status(out, name, &value)?;
    }
    backend::encode_backend_key_data(out, key)?;
    backend::encode_ready_for_query(out, TxStatus::Idle);
    Ok(())
}

/// Serves admin commands until the client leaves.
pub async fn serve(
    app: &Arc<App>,
    shared: &Arc<ClientShared>,
    stream: &mut Stream,
    mut buf: BytesMut,
    can_modify: bool,
) -> Disconnect {
    let mut out = BytesMut::new();
    let mut skipping_to_sync = false;
    loop {
        let (tag, body) = match read_message(stream, &mut buf, 1 << 20).await {
            Ok(m) => m,
            Err(ReadError::Eof) => return Disconnect::ClientClosed,
            Err(ReadError::Io(e)) => return client_io(e),
            Err(ReadError::Wire(e)) => return Disconnect::Protocol(e),
        };
        out.clear();
        let result = match tag {
            ftag::TERMINATE => return Disconnect::Terminated,
            ftag::QUERY => match frontend::Query::parse(&body) {
                Ok(q) => {
                    let text = String::from_utf8_lossy(q.sql).into_owned();
                    run_script(app, shared, &text, can_modify, &mut out).await
                }
                Err(e) => return Disconnect::Protocol(e),
            },
            ftag::SYNC => {
                skipping_to_sync = false;
                backend::encode_ready_for_query(&mut out, TxStatus::Idle);
                Ok(())
            }
            _ if skipping_to_sync => Ok(()),
            ftag::PARSE
            | ftag::BIND
            | ftag::DESCRIBE
            | ftag::EXECUTE
            | ftag::CLOSE
            | ftag::FLUSH => {
                skipping_to_sync = true;
                PgError::error(
                    SqlState::FEATURE_NOT_SUPPORTED,
                    "the pgherd admin console speaks the simple query protocol only",
                )
                .encode(&mut out)
            }
            other => {
                return Disconnect::Protocol(WireError::UnexpectedTag {
                    tag: other,
                    context: "on the admin console",
                })
            }
        };
        if let Err(e) = result {
            return Disconnect::Protocol(e);
        }
        if let Err(e) = write_flush(stream, &out).await {
            return client_io(e);
        }
        if app.is_shutting_down() {
            return Disconnect::Shutdown;
        }
    }
}

async fn run_script(
    app: &Arc<App>,
    shared: &Arc<ClientShared>,
    text: &str,
    can_modify: bool,
    out: &mut BytesMut,
) -> Result<(), WireError> {
    let commands: Vec<&str> = text
        .split(';')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    if commands.is_empty() {
        backend::encode_empty(out, pgherd_wire::backend::tag::EMPTY_QUERY_RESPONSE);
    }
    for command in commands {
        let outcome = match Operation::parse(command) {
            Some(op) if !can_modify => Err(permission_denied(op.name())),
            Some(op) => op.run(app).await.map(|steps| {
                Outcome::Rows(Table {
                    columns: &["step"],
                    rows: steps.into_iter().map(|s| vec![s]).collect(),
                })
            }),
            None => run_command(app, shared, command, can_modify),
        };
        match outcome {
            Ok(Outcome::Rows(table)) => {
                backend::encode_text_row_description(out, table.columns)?;
                for row in &table.rows {
                    backend::encode_data_row(out, row.iter().map(|v| Some(v.as_bytes())))?;
                }
                backend::encode_command_complete(out, &format!("SHOW {}", table.rows.len()))?;
            }
            Ok(Outcome::Done(tag, notes)) => {
                for note in notes {
                    PgError::new(Severity::Notice, SqlState::SUCCESSFUL_COMPLETION, note)
                        .encode_notice(out)?;
                }
                backend::encode_command_complete(out, tag)?;
            }
            Err(e) => {
                e.encode(out)?;
                break;
            }
        }
    }
    backend::encode_ready_for_query(out, TxStatus::Idle);
    Ok(())
}

const COMMANDS: &str = "SHOW HELP|VERSION|NODES|POOLS|CLIENTS|CONFIG|EVENTS, SWITCHOVER [TO node], REJOIN node, RELOAD, SHUTDOWN";

/// Admin commands that act on nodes and take time; they answer with the steps taken.
enum Operation<'a> {
    /// `SWITCHOVER [TO node]`
    Switchover(Option<&'a str>),
    /// `REJOIN node`
    Rejoin(&'a str),
}

impl<'a> Operation<'a> {
    /// Node names keep their case (and lose double quotes).
    fn parse(command: &'a str) -> Option<Operation<'a>> {
        let words: Vec<&str> = command.split_whitespace().collect();
        let is = |w: &str, keyword: &str| w.eq_ignore_ascii_case(keyword);
        let node = |w: &'a str| w.trim_matches('"');
        match words.as_slice() {
            [w] if is(w, "SWITCHOVER") => Some(Operation::Switchover(None)),
            [w, to, n] if is(w, "SWITCHOVER") && is(to, "TO") => {
                Some(Operation::Switchover(Some(node(n))))
            }
            [w, n] if is(w, "REJOIN") => Some(Operation::Rejoin(node(n))),
            _ => None,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Operation::Switchover(_) => "SWITCHOVER",
            Operation::Rejoin(_) => "REJOIN",
        }
    }

    async fn run(self, app: &Arc<App>) -> Result<Vec<String>, PgError> {
        match self {
            Operation::Switchover(to) => crate::switchover::switchover(app, to).await,
            Operation::Rejoin(node) => crate::rejoin::rejoin(app, node).await,
        }
    }
}

fn permission_denied(name: &str) -> PgError {
    PgError::error(
        SqlState::INSUFFICIENT_PRIVILEGE,
        format!("permission denied: {name} needs a user listed in pgherd.admin_users"),
    )
}

fn run_command(
    app: &Arc<App>,
    shared: &Arc<ClientShared>,
    command: &str,
    can_modify: bool,
) -> Result<Outcome, PgError> {
    let words: Vec<String> = command
        .split_whitespace()
        .map(|w| w.to_ascii_uppercase())
        .collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let needs_admin = |name: &str| -> Result<(), PgError> {
        if can_modify {
            Ok(())
        } else {
            Err(permission_denied(name))
        }
    };
    match words.as_slice() {
        ["SHOW", "HELP"] => Ok(Outcome::Rows(Table {
            columns: &["command"],
            rows: COMMANDS.split(", ").map(|c| vec![c.to_owned()]).collect(),
        })),
        ["SHOW", "VERSION"] => Ok(Outcome::Rows(Table {
            columns: &["version"],
            rows: vec![vec![format!("pgherd {VERSION}")]],
        })),
        ["SHOW", "NODES"] => Ok(Outcome::Rows(show_nodes(app))),
        ["SHOW", "EVENTS"] => Ok(Outcome::Rows(show_events(app))),
        ["SHOW", "POOLS"] => Ok(Outcome::Rows(show_pools(app))),
        ["SHOW", "CLIENTS"] => Ok(Outcome::Rows(show_clients(app))),
        ["SHOW", "CONFIG"] => Ok(Outcome::Rows(show_config(app))),
        ["RELOAD"] => {
            needs_admin("RELOAD")?;
            match crate::lifecycle::reload(app) {
                Ok(notes) => Ok(Outcome::Done("RELOAD", notes)),
                Err(e) => Err(PgError::error(
                    SqlState::CONFIGURATION_LIMIT_EXCEEDED,
                    format!("reload failed, keeping the running config: {e}"),
                )),
            }
        }
        ["SHUTDOWN"] => {
            needs_admin("SHUTDOWN")?;
            tracing::info!(
                client = shared.id,
                "SHUTDOWN requested on the admin console"
            );
            app.begin_shutdown();
            Ok(Outcome::Done("SHUTDOWN", Vec::new()))
        }
        _ => Err(PgError::error(
            SqlState::SYNTAX_ERROR,
            format!("unknown admin command \"{command}\""),
        )
        .with_hint(format!("commands: {COMMANDS}"))),
    }
}

fn show_nodes(app: &Arc<App>) -> Table {
    let rows = app
        .nodes
        .all()
        .iter()
        .map(|n| {
            let health = n.health();
            vec![
                n.config.name.clone(),
                n.config.host.clone(),
                n.config.port.to_string(),
                n.role().as_str().to_owned(),
                if n.is_fenced() {
                    "fenced".into()
                } else if n.is_up() {
                    "up".into()
                } else {
                    "down".into()
                },
                pgherd_route::balance::format_lsn(n.lsn()),
                n.lag_bytes().to_string(),
                n.lag_ms().to_string(),
                if n.in_read_set() { "yes" } else { "no" }.into(),
                health.checks_ok.to_string(),
                health.checks_failed.to_string(),
                health.times_down.to_string(),
                health.last_error.unwrap_or_default(),
            ]
        })
        .collect();
    Table {
        columns: &[
            "name",
            "host",
            "port",
            "role",
            "state",
            "lsn",
            "lag_bytes",
            "lag_ms",
            "in_read_set",
            "checks_ok",
            "checks_failed",
            "times_down",
            "last_error",
        ],
        rows,
    }
}

fn show_events(app: &Arc<App>) -> Table {
    let rows = app
        .events
        .list()
        .into_iter()
        .map(|e| {
            let at =
                e.at.duration_since(std::time::UNIX_EPOCH)
                    .map(|d| format!("{:.3}", d.as_secs_f64()))
                    .unwrap_or_default();
            vec![at, e.kind.to_owned(), e.node, e.detail]
        })
        .collect();
    Table {
        columns: &["at_epoch_s", "kind", "node", "detail"],
        rows,
    }
}

fn show_pools(app: &Arc<App>) -> Table {
    let rows = app
        .pools()
        .iter()
        .map(|p| {
            let s = p.snapshot();
            let transactions = p.stats.transactions.load(Ordering::Relaxed);
            vec![
                p.database.clone(),
                p.user.clone(),
                p.node.name.clone(),
                s.mode.as_str().to_owned(),
                s.waiting.to_string(),
                s.lent.to_string(),
                s.idle.to_string(),
                s.connecting.to_string(),
                s.max_size.to_string(),
                transactions.to_string(),
                p.stats.queries.load(Ordering::Relaxed).to_string(),
                p.stats.wait_us_max.load(Ordering::Relaxed).to_string(),
                p.stats.wait_timeouts.load(Ordering::Relaxed).to_string(),
            ]
        })
        .collect();
    Table {
        columns: &[
            "database",
            "user",
            "node",
            "pool_mode",
            "cl_waiting",
            "sv_active",
            "sv_idle",
            "sv_connecting",
            "max_size",
            "transactions",
            "queries",
            "max_wait_us",
            "wait_timeouts",
        ],
        rows,
    }
}

fn show_clients(app: &Arc<App>) -> Table {
    let rows = app
        .clients
        .all()
        .iter()
        .map(|c| {
            vec![
                c.id.to_string(),
                c.user.clone(),
                c.database.clone(),
                c.addr.to_string(),
                c.tls.to_string(),
                c.connected_at
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs().to_string())
                    .unwrap_or_default(),
                c.target()
                    .map(|t| t.server_id.to_string())
                    .unwrap_or_default(),
            ]
        })
        .collect();
    Table {
        columns: &[
            "id",
            "user",
            "database",
            "addr",
            "tls",
            "connected_at",
            "server",
        ],
        rows,
    }
}

fn show_config(app: &Arc<App>) -> Table {
    let c = app.config();
    let p = &c.pool;
    let rows = [
        ("config_file", c.source.display().to_string()),
        (
            "listen",
            c.proxy
                .listen
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        ),
        ("workers", c.proxy.workers.to_string()),
        (
            "max_client_connections",
            c.proxy.max_client_connections.to_string(),
        ),
        ("max_message_bytes", c.proxy.max_message_bytes.to_string()),
        ("pool.mode", p.mode.as_str().to_owned()),
        ("pool.max_size", p.max_size.to_string()),
        ("pool.min_size", p.min_size.to_string()),
        ("pool.wait_timeout_ms", p.wait_timeout_ms.to_string()),
        (
            "pool.server_idle_timeout_ms",
            p.server_idle_timeout_ms.to_string(),
        ),
        ("pool.server_lifetime_ms", p.server_lifetime_ms.to_string()),
        (
            "pool.prepared_statements_per_server",
            p.prepared_statements_per_server.to_string(),
        ),
        (
            "cluster.health_check_period_ms",
            c.cluster.health_check_period_ms.to_string(),
        ),
        ("reloads", app.reloads.load(Ordering::Relaxed).to_string()),
    ]
    .into_iter()
    .map(|(k, v)| vec![k.to_owned(), v])
    .collect();
    Table {
        columns: &["key", "value"],
        rows,
    }
}
