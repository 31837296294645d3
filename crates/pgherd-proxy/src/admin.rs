//! The admin console: SQL-ish commands on the virtual database `pgherd`
//! (`psql -p 6432 -U admin pgherd`), named as in PgBouncer where they mean the same thing.
//! Admin users may change things; stats users may only look.

use std::sync::Arc;

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
use crate::views::{self, Table};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

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
        // A command read after an upgrade went through belongs to the new process.
        if app.handover.given() && tag != ftag::TERMINATE {
            return Disconnect::CannotMove("the admin console's sessions stay with their process");
        }
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
        if app.handover.given() {
            return Disconnect::CannotMove("the admin console's sessions stay with their process");
        }
    }
}

/// The console's answer to a query string from a user who may only read: its parsing, the
/// `SHOW` views, the refusals; nothing acts. The entry of the console's fuzz target.
pub async fn answer_reader(
    app: &Arc<App>,
    shared: &Arc<ClientShared>,
    text: &str,
) -> Result<BytesMut, WireError> {
    let mut out = BytesMut::new();
    run_script(app, shared, text, false, &mut out).await?;
    Ok(out)
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
            Some(op) => op
                .run(app)
                .await
                .map(|steps| Outcome::Rows(Table::lines(&["step"], steps))),
            None => run_command(app, shared, command, can_modify),
        };
        match outcome {
            Ok(Outcome::Rows(table)) => {
                backend::encode_text_row_description(out, table.columns)?;
                for row in &table.rows {
                    let texts: Vec<Option<String>> = row.iter().map(views::Cell::text).collect();
                    backend::encode_data_row(
                        out,
                        texts.iter().map(|v| v.as_deref().map(str::as_bytes)),
                    )?;
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

/// The right form of each command, for the error when one is misspelt.
const USAGE: &[(&str, &str)] = &[
    (
        "SHOW",
        "SHOW HELP|VERSION|NODES|CLUSTER|INSTANCES|SHARDS|DATABASES|USERS|POOLS|STATS|LISTS|CLIENTS|SERVERS|CONFIG|EVENTS|CACHE|SETS",
    ),
    ("SWITCHOVER", "SWITCHOVER [TO node]"),
    ("PROMOTE", "PROMOTE node [FORCE safeguard[,...]]"),
    ("REJOIN", "REJOIN node"),
    ("DETACH", "DETACH node"),
    ("ATTACH", "ATTACH node"),
    ("PAUSE", "PAUSE [db]"),
    ("RESUME", "RESUME [db]"),
    ("KILL", "KILL db"),
    ("RECONNECT", "RECONNECT [db]"),
    ("WAIT_CLOSE", "WAIT_CLOSE [db]"),
    ("CACHE", "CACHE CLEAR [table]"),
    ("RELOAD", "RELOAD"),
    ("UPGRADE", "UPGRADE"),
    ("SHUTDOWN", "SHUTDOWN"),
];

/// Every command's form, for SHOW HELP and the hint for an unknown command.
fn commands() -> impl Iterator<Item = &'static str> {
    USAGE.iter().map(|(_, usage)| *usage)
}

/// Admin commands that act on nodes or sessions; they answer with the steps taken.
enum Operation<'a> {
    /// `SWITCHOVER [TO node]`
    Switchover(Option<&'a str>),
    /// `REJOIN node`
    Rejoin(&'a str),
    /// `PROMOTE node [FORCE safeguard, ...]`
    Promote(&'a str, Vec<&'a str>),
    Detach(&'a str),
    Attach(&'a str),
    Pause(Option<&'a str>),
    Resume(Option<&'a str>),
    Kill(&'a str),
    Reconnect(Option<&'a str>),
    WaitClose(Option<&'a str>),
    /// `UPGRADE`: the binary now at this process's path takes over (`crate::handover`).
    Upgrade,
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
            [w, n] if is(w, "PROMOTE") => Some(Operation::Promote(node(n), Vec::new())),
            [w, n, force, safeguards @ ..]
                if is(w, "PROMOTE") && is(force, "FORCE") && !safeguards.is_empty() =>
            {
                Some(Operation::Promote(node(n), safeguards.to_vec()))
            }
            [w, n] if is(w, "DETACH") => Some(Operation::Detach(node(n))),
            [w, n] if is(w, "ATTACH") => Some(Operation::Attach(node(n))),
            [w] if is(w, "PAUSE") => Some(Operation::Pause(None)),
            [w, d] if is(w, "PAUSE") => Some(Operation::Pause(Some(node(d)))),
            [w] if is(w, "RESUME") => Some(Operation::Resume(None)),
            [w, d] if is(w, "RESUME") => Some(Operation::Resume(Some(node(d)))),
            [w, d] if is(w, "KILL") => Some(Operation::Kill(node(d))),
            [w] if is(w, "RECONNECT") => Some(Operation::Reconnect(None)),
            [w, d] if is(w, "RECONNECT") => Some(Operation::Reconnect(Some(node(d)))),
            [w] if is(w, "WAIT_CLOSE") => Some(Operation::WaitClose(None)),
            [w, d] if is(w, "WAIT_CLOSE") => Some(Operation::WaitClose(Some(node(d)))),
            [w] if is(w, "UPGRADE") => Some(Operation::Upgrade),
            _ => None,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Operation::Switchover(_) => "SWITCHOVER",
            Operation::Rejoin(_) => "REJOIN",
            Operation::Promote(..) => "PROMOTE",
            Operation::Detach(_) => "DETACH",
            Operation::Attach(_) => "ATTACH",
            Operation::Pause(_) => "PAUSE",
            Operation::Resume(_) => "RESUME",
            Operation::Kill(_) => "KILL",
            Operation::Reconnect(_) => "RECONNECT",
            Operation::WaitClose(_) => "WAIT_CLOSE",
            Operation::Upgrade => "UPGRADE",
        }
    }

    async fn run(self, app: &Arc<App>) -> Result<Vec<String>, PgError> {
        use crate::control;
        match self {
            Operation::Switchover(to) => crate::switchover::switchover(app, to).await,
            Operation::Rejoin(node) => crate::rejoin::rejoin(app, node).await,
            Operation::Promote(node, force) => {
                let forced = control::parse_safeguards(&force)?;
                control::promote(app, node, &forced).await
            }
            Operation::Detach(node) => control::detach(app, node),
            Operation::Attach(node) => control::attach(app, node),
            Operation::Pause(db) => control::pause(app, db).await,
            Operation::Resume(db) => control::resume(app, db),
            Operation::Kill(db) => control::kill(app, db),
            Operation::Reconnect(db) => control::reconnect(app, db),
            Operation::WaitClose(db) => control::wait_close(app, db).await,
            Operation::Upgrade => crate::handover::upgrade(app)
                .await
                .map(|done| vec![done])
                .map_err(|e| PgError::error(SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE, e)),
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
        ["SHOW", "HELP"] => Ok(Outcome::Rows(Table::lines(
            &["command"],
            commands().map(str::to_owned).collect(),
        ))),
        ["SHOW", "VERSION"] => Ok(Outcome::Rows(Table::lines(
            &["version"],
            vec![format!("pgherd {VERSION} (pid {})", std::process::id())],
        ))),
        ["SHOW", "NODES"] => Ok(Outcome::Rows(views::nodes(app))),
        ["SHOW", "CLUSTER"] => Ok(Outcome::Rows(views::cluster(app))),
        ["SHOW", "INSTANCES"] => Ok(Outcome::Rows(views::instances(app))),
        ["SHOW", "SHARDS"] => Ok(Outcome::Rows(views::shards(app))),
        ["SHOW", "DATABASES"] => Ok(Outcome::Rows(views::databases(app))),
        ["SHOW", "USERS"] => Ok(Outcome::Rows(views::users(app))),
        ["SHOW", "EVENTS"] => Ok(Outcome::Rows(views::events(app))),
        ["SHOW", "POOLS"] => Ok(Outcome::Rows(views::pools(app))),
        ["SHOW", "STATS"] => Ok(Outcome::Rows(views::stats(app))),
        ["SHOW", "LISTS"] => Ok(Outcome::Rows(views::lists(app))),
        ["SHOW", "CLIENTS"] => Ok(Outcome::Rows(views::clients(app))),
        ["SHOW", "SERVERS"] => Ok(Outcome::Rows(views::servers(app))),
        ["SHOW", "CONFIG"] => Ok(Outcome::Rows(views::config(app))),
        ["SHOW", "CACHE"] => Ok(Outcome::Rows(crate::result_cache::view(app))),
        ["SHOW", "SETS"] => Ok(Outcome::Rows(crate::sets_watch::view(app))),
        ["CACHE", "CLEAR", ..] if words.len() <= 3 || command.trim_end().ends_with('"') => {
            needs_admin("CACHE CLEAR")?;
            // The name as typed (case and quotes count), after the two command words.
            let table = (0..2)
                .try_fold(command.trim(), |rest, _| {
                    rest.split_once(char::is_whitespace)
                        .map(|(_, after)| after.trim_start())
                })
                .filter(|name| !name.is_empty())
                .map(crate::result_cache::table_name);
            let dropped = crate::result_cache::clear(app, table.as_deref());
            Ok(Outcome::Done(
                "CACHE CLEAR",
                vec![format!("{dropped} entries dropped")],
            ))
        }
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
        [first, ..] => match USAGE.iter().find(|(word, _)| word == first) {
            Some((_, usage)) => Err(PgError::error(
                SqlState::SYNTAX_ERROR,
                format!("syntax error in admin command \"{command}\""),
            )
            .with_hint(format!("write it as: {usage}"))),
            None => Err(PgError::error(
                SqlState::SYNTAX_ERROR,
                format!("unknown admin command \"{command}\""),
            )
            .with_hint(format!(
                "commands: {}",
                commands().collect::<Vec<_>>().join(", ")
            ))),
        },
        [] => Err(PgError::error(
            SqlState::SYNTAX_ERROR,
            "empty admin command",
        )),
    }
}
