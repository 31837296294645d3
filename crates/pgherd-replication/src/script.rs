//! `execute-script`'s plan: a DDL script for a replication set, cut into statements with the
//! PostgreSQL parser, each with the order that keeps logical replication applying while the
//! nodes differ, and the locks it takes. Parsed whole before anything runs, so a syntax error
//! changes nothing.
//!
//! Logical replication maps columns by name and lets a subscriber hold columns the origin does
//! not send. So what adds (a table, a column, a wider type) goes to the subscribers first: the
//! origin's new rows then always find their columns. What takes away (a dropped column or
//! table) goes to the origin first, and to the subscribers once they have applied everything
//! the origin wrote before it. A rename breaks the stream in either order and is refused; so
//! are data changes (replication carries them) and transaction control (each statement runs
//! in its own transaction on each node).

use pg_query::protobuf::node::Node;
use pg_query::protobuf::AlterTableType;
use pgherd_route::parse::{parse_text_tree, split_text, NotParsed};

/// A script is the operator's, not a client's: it may be longer than a client's query, but
/// the parser's stack and memory still grow with the text, so it is bounded too.
const MAX_SCRIPT_BYTES: usize = 1 << 20;

/// Which nodes run a statement first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// It adds what the origin's rows may soon carry.
    SubscribersFirst,
    /// It takes away, or is neutral: the origin first; subscribers once caught up.
    OriginFirst,
}

/// One statement of a script, as it will run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub sql: String,
    /// 1-based, where the statement starts in the file.
    pub line: usize,
    pub order: Order,
    /// What it locks, in words ("ACCESS EXCLUSIVE on public.orders"); empty when it locks no
    /// existing table.
    pub locks: Vec<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScriptError {
    #[error("the script holds no statement")]
    Empty,
    #[error("statement {number} (line {line}) does not parse: {message}; nothing was run")]
    Syntax {
        number: usize,
        line: usize,
        message: String,
    },
    #[error("statement {number} (line {line}) is refused: {why}; nothing was run")]
    Refused {
        number: usize,
        line: usize,
        why: String,
    },
}

/// The script's statements in order, each with its order and locks; refused whole if one does
/// not parse or is not a schema change pgherd can order.
pub fn plan_script(script: &str) -> Result<Vec<Step>, ScriptError> {
    let pieces = statements(script)?;
    let mut steps = Vec::new();
    let mut searched_from = 0;
    for (i, piece) in pieces.iter().enumerate() {
        let sql = without_leading_comments(piece);
        if sql.is_empty() {
            continue;
        }
        let at = script[searched_from..]
            .find(sql)
            .map_or(searched_from, |offset| searched_from + offset);
        searched_from = at + sql.len();
        let line = script[..at].matches('\n').count() + 1;
        let number = i + 1;
        let parsed = parse_text_tree(sql, MAX_SCRIPT_BYTES).map_err(|e| ScriptError::Syntax {
            number,
            line,
            message: match e {
                NotParsed::Syntax(message) => message,
                other => format!("it {other}"),
            },
        })?;
        let node = parsed
            .protobuf
            .stmts
            .first()
            .and_then(|raw| raw.stmt.as_ref())
            .and_then(|stmt| stmt.node.as_ref());
        let Some(node) = node else {
            continue;
        };
        let tables: Vec<String> = parsed.tables().into_iter().map(qualified).collect();
        let (order, lock) =
            classify(node).map_err(|why| ScriptError::Refused { number, line, why })?;
        let locks = match lock {
            Some(mode) => tables.iter().map(|t| format!("{mode} on {t}")).collect(),
            None => Vec::new(),
        };
        steps.push(Step {
            sql: sql.to_owned(),
            line,
            order,
            locks,
        });
    }
    if steps.is_empty() {
        return Err(ScriptError::Empty);
    }
    Ok(steps)
}

/// The script's statements, cut by the parser as the server would (a `BEGIN ATOMIC` body stays
/// whole). A script that does not parse is cut by the scanner instead: each piece is then
/// parsed alone, so the one that fails is named with its line.
fn statements(script: &str) -> Result<Vec<&str>, ScriptError> {
    match split_text(script, MAX_SCRIPT_BYTES) {
        Err(NotParsed::Syntax(_)) => {
            pg_query::split_with_scanner(script).map_err(|e| ScriptError::Syntax {
                number: 1,
                line: 1,
                message: e.to_string(),
            })
        }
        Err(e) => Err(ScriptError::Syntax {
            number: 1,
            line: 1,
            message: format!("the script {e}"),
        }),
        Ok(pieces) => Ok(pieces),
    }
}

/// The statement without the blank lines and comments before it, so that its line is its own.
fn without_leading_comments(piece: &str) -> &str {
    let mut rest = piece.trim();
    loop {
        if let Some(after) = rest.strip_prefix("--") {
            rest = after
                .split_once('\n')
                .map_or("", |(_, next)| next)
                .trim_start();
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after
                .split_once("*/")
                .map_or("", |(_, next)| next)
                .trim_start();
        } else {
            return rest.trim_end();
        }
    }
}

/// A table name as the parser gives it, with `public.` when it names no schema.
fn qualified(name: String) -> String {
    if name.contains('.') {
        name
    } else {
        format!("public.{name}")
    }
}

/// The order a statement needs and the lock it takes on the tables it names (`None`: none
/// on an existing table); why it is refused otherwise.
fn classify(node: &Node) -> Result<(Order, Option<&'static str>), String> {
    Ok(match node {
        Node::CreateStmt(_) | Node::CreateTableAsStmt(_) => (Order::SubscribersFirst, None),
        Node::AlterTableStmt(alter) => {
            let kinds: Vec<AlterTableType> = alter
                .cmds
                .iter()
                .filter_map(|cmd| match &cmd.node {
                    Some(Node::AlterTableCmd(cmd)) => AlterTableType::try_from(cmd.subtype).ok(),
                    _ => None,
                })
                .collect();
            let adds = kinds
                .iter()
                .any(|k| matches!(k, AlterTableType::AtAddColumn | AlterTableType::AtAlterColumnType));
            let drops = kinds.iter().any(|k| matches!(k, AlterTableType::AtDropColumn));
            if adds && drops {
                return Err(
                    "it both adds and drops columns: adding must reach the subscribers first and dropping the origin first; make them two statements"
                        .to_owned(),
                );
            }
            let lock = if kinds.iter().all(|k| {
                matches!(
                    k,
                    AlterTableType::AtSetStatistics
                        | AlterTableType::AtValidateConstraint
                        | AlterTableType::AtSetOptions
                        | AlterTableType::AtResetOptions
                        | AlterTableType::AtClusterOn
                        | AlterTableType::AtDropCluster
                )
            }) {
                "SHARE UPDATE EXCLUSIVE"
            } else {
                "ACCESS EXCLUSIVE"
            };
            let order = if adds {
                Order::SubscribersFirst
            } else {
                Order::OriginFirst
            };
            (order, Some(lock))
        }
        Node::IndexStmt(index) if index.concurrent => {
            (Order::OriginFirst, Some("SHARE UPDATE EXCLUSIVE"))
        }
        Node::IndexStmt(_) => (Order::OriginFirst, Some("SHARE")),
        Node::DropStmt(_) => (Order::OriginFirst, Some("ACCESS EXCLUSIVE")),
        Node::RenameStmt(_) => {
            return Err(
                "a rename breaks logical replication in either order (columns and tables are matched by name); pause the writes to it and rename on every node by hand"
                    .to_owned(),
            )
        }
        Node::InsertStmt(_)
        | Node::UpdateStmt(_)
        | Node::DeleteStmt(_)
        | Node::MergeStmt(_)
        | Node::CopyStmt(_)
        | Node::TruncateStmt(_) => {
            return Err(
                "it changes data, which replication carries to the subscribers itself; run it on the origin"
                    .to_owned(),
            )
        }
        Node::TransactionStmt(_) => {
            return Err(
                "transaction control: each statement runs in its own transaction on each node"
                    .to_owned(),
            )
        }
        Node::SelectStmt(_) | Node::VariableSetStmt(_) => {
            return Err("it is not a schema change".to_owned())
        }
        // Functions, views, types, comments, grants and other DDL: no order matters.
        _ => (Order::OriginFirst, None),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_ordered_and_their_locks_named() {
        let steps = plan_script(
            "-- add a note\nALTER TABLE orders ADD COLUMN note text;\n\
             CREATE TABLE order_notes (id int PRIMARY KEY);\n\
             CREATE INDEX ON audit.events (at);\n\
             CREATE INDEX CONCURRENTLY orders_note ON orders (note);\n\
             ALTER TABLE orders DROP COLUMN legacy;\n\
             ALTER TABLE orders ALTER COLUMN qty SET STATISTICS 500;\n\
             CREATE FUNCTION f() RETURNS int LANGUAGE sql AS $$ SELECT 1; $$;",
        )
        .unwrap();
        let seen: Vec<(usize, Order, Vec<&str>)> = steps
            .iter()
            .map(|s| {
                (
                    s.line,
                    s.order,
                    s.locks.iter().map(String::as_str).collect(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            vec![
                (
                    2,
                    Order::SubscribersFirst,
                    vec!["ACCESS EXCLUSIVE on public.orders"]
                ),
                (3, Order::SubscribersFirst, vec![]),
                (4, Order::OriginFirst, vec!["SHARE on audit.events"]),
                (
                    5,
                    Order::OriginFirst,
                    vec!["SHARE UPDATE EXCLUSIVE on public.orders"]
                ),
                (
                    6,
                    Order::OriginFirst,
                    vec!["ACCESS EXCLUSIVE on public.orders"]
                ),
                (
                    7,
                    Order::OriginFirst,
                    vec!["SHARE UPDATE EXCLUSIVE on public.orders"]
                ),
                (8, Order::OriginFirst, vec![]),
            ]
        );
        assert_eq!(
            steps[6].sql,
            "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS $$ SELECT 1; $$"
        );
    }

    #[test]
    fn what_cannot_be_ordered_is_refused_before_anything_runs() {
        let refused = |script: &str| plan_script(script).unwrap_err().to_string();
        assert_eq!(
            refused("ALTER TABLE t ADD COLUMN a int;\nALTER TABEL t ADD COLUMN b int;"),
            "statement 2 (line 2) does not parse: syntax error at or near \"TABEL\"; nothing was run"
        );
        assert!(refused("ALTER TABLE t RENAME COLUMN a TO b").contains("a rename breaks"));
        assert!(refused("CREATE TABLE x (a int); INSERT INTO t VALUES (1)")
            .starts_with("statement 2 (line 1) is refused: it changes data"));
        assert!(refused("BEGIN; ALTER TABLE t ADD COLUMN a int; COMMIT")
            .contains("transaction control"));
        assert!(refused("ALTER TABLE t ADD COLUMN a int, DROP COLUMN b")
            .contains("make them two statements"));
        assert_eq!(refused("-- nothing\n"), "the script holds no statement");
    }

    #[test]
    fn a_function_body_stays_one_statement() {
        let steps = plan_script(
            "CREATE FUNCTION total(a int, b int) RETURNS int LANGUAGE sql\n\
             BEGIN ATOMIC SELECT a + b; END;\nALTER TABLE t ADD COLUMN c int;",
        )
        .unwrap();
        assert_eq!(steps.len(), 2, "{steps:?}");
        assert!(
            steps[0].sql.ends_with("BEGIN ATOMIC SELECT a + b; END"),
            "{steps:?}"
        );
        assert_eq!(steps[1].line, 3);
        let long = format!("COMMENT ON TABLE t IS '{}'", "x".repeat(MAX_SCRIPT_BYTES));
        assert!(plan_script(&long)
            .unwrap_err()
            .to_string()
            .contains("more than the 1048576 pgherd parses"));
    }
}
