//! Which statements the result cache may keep, and which tables each one reads.
//!
//! A cached answer is only right while every table it read is unchanged, and while what
//! else the statement depends on cannot change without a change pgherd decodes from the
//! WAL. So a statement is cacheable only if it is one `SELECT` that:
//! - reads only permanent, ordinary or partitioned tables of the user's without row-level
//!   security (their changes are all decoded, and their rows are the same for every session
//!   of a user): not views (their definitions may call functions too; not yet followed),
//!   materialized views (a refresh is not decoded), foreign, unlogged or temporary tables,
//!   or system catalogs (DDL is not decoded);
//! - locks no rows, writes nothing (no `SELECT INTO`, no data-modifying `WITH`), samples
//!   nothing (`TABLESAMPLE`) and reads no system column (`ctid` moves in a `VACUUM FULL`,
//!   `tableoid` changes when a table is made again, neither decoded);
//! - calls only built-in functions that are immutable or stable, but none that reads the
//!   clock, the session or the server's state (`now()`, `current_setting`, `pg_*`,
//!   `has_*_privilege`, `to_reg*`, `inet_*`, ...), no `CURRENT_TIMESTAMP`-style values, no
//!   `'now'`-style date literals and no casts to `reg*` types (they read the catalog): a
//!   function written in SQL or a procedural language may read tables pgherd cannot see.
//!
//! Tables are named unqualified, as the catalog and the decoder name them.

use pg_query::protobuf::node::Node as NodeEnum;
use serde_json::Value;

use crate::catalog::{Catalog, Snapshot};
use crate::lexer::Lexed;
use crate::parse::{self, NotParsed};
use crate::tree;

/// Why a statement is not cached.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotCacheable {
    #[error("its strings may be read otherwise by the server (a backslash in a standard string)")]
    SettingDependentStrings,
    #[error("it {0}")]
    NotParsed(NotParsed),
    #[error("it is not one SELECT")]
    NotOneSelect,
    #[error("it locks rows (FOR UPDATE/SHARE)")]
    Locks,
    #[error("it writes (SELECT INTO or a data-modifying WITH)")]
    Writes,
    #[error("it samples rows (TABLESAMPLE)")]
    Samples,
    #[error("it reads system column {0}, which changes without a change pgherd decodes")]
    SystemColumn(String),
    #[error("it calls {0}, which is volatile")]
    Volatile(String),
    #[error("it calls {0}, written in SQL or a procedural language: its body may read tables pgherd cannot see")]
    UserCode(String),
    #[error("it calls {0}, which reads the clock, the session, the catalog or the server's state")]
    ReadsState(String),
    #[error("it calls {0}, which pgherd does not know")]
    UnknownFunction(String),
    #[error("it reads {0}, which pgherd does not know")]
    UnknownRelation(String),
    #[error("it reads {0}, which is not a permanent table without row-level security (views, materialized views, foreign, unlogged, temporary and system tables are not cached)")]
    UnsafeRelation(String),
}

/// Built-in functions, immutable or stable, whose answer changes without a change to a
/// table: by name or by prefix (`*` at the end).
const STATE_READING_FUNCTIONS: &[&str] = &[
    "now",
    "transaction_timestamp",
    "statement_timestamp",
    "age",
    "pg_*",
    "has_*",
    "to_reg*",
    "current_*",
    "inet_*",
    "txid_*",
    "obj_description",
    "col_description",
    "shobj_description",
    "format_type",
    "row_security_active",
];

/// What [`cacheable`] found, and whether it holds for the statement whatever its literal
/// values are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The tables the statement reads if the cache may keep its answer (sorted, without
    /// repeats), or why not.
    pub outcome: Result<Vec<String>, NotCacheable>,
    /// The same verdict holds for every statement of the same shape (the text with its
    /// literals blanked): it has no string or bit-string constant (a `'now'` may stand where
    /// a date stood), and it was parsed.
    pub any_literals: bool,
}

/// Whether the cache may keep the answer of `sql` and which tables it reads.
pub fn cacheable(sql: &str, lexed: &Lexed, catalog: &Snapshot, max_parse_bytes: usize) -> Verdict {
    if lexed.strings_depend_on_settings {
        return Verdict {
            outcome: Err(NotCacheable::SettingDependentStrings),
            any_literals: false,
        };
    }
    let parsed = match parse::parse(sql, lexed, max_parse_bytes) {
        Ok(parsed) => parsed,
        Err(e) => {
            return Verdict {
                outcome: Err(NotCacheable::NotParsed(e)),
                any_literals: false,
            }
        }
    };
    let any_literals = !tree::any_node(&parsed.tree.protobuf, |key, value| {
        key == "AConst"
            && value
                .get("val")
                .is_some_and(|v| v.get("Sval").is_some() || v.get("Bsval").is_some())
    });
    Verdict {
        outcome: cacheable_parsed(sql, &parsed, catalog),
        any_literals,
    }
}

fn cacheable_parsed(
    sql: &str,
    parsed: &parse::Parsed,
    catalog: &Snapshot,
) -> Result<Vec<String>, NotCacheable> {
    let [raw] = parsed.tree.protobuf.stmts.as_slice() else {
        return Err(NotCacheable::NotOneSelect);
    };
    let Some(stmt) = raw.stmt.as_deref() else {
        return Err(NotCacheable::NotOneSelect);
    };
    if !matches!(stmt.node, Some(NodeEnum::SelectStmt(_))) {
        return Err(NotCacheable::NotOneSelect);
    }
    // A tree that cannot be read whole is taken to write.
    if let Some(why) = tree::first_node(stmt, NotCacheable::Writes, forbidden_node) {
        return Err(why);
    }
    for function in &parsed.summary.functions {
        let name = function.function_name.to_lowercase();
        if reads_state(&name) {
            return Err(NotCacheable::ReadsState(name));
        }
        match catalog.function(&name) {
            None => return Err(NotCacheable::UnknownFunction(name)),
            Some(f) if f.user_defined => return Err(NotCacheable::UserCode(name)),
            Some(f) if f.volatile => return Err(NotCacheable::Volatile(name)),
            Some(_) => {}
        }
    }
    if catalog.mentions_user_code(sql) {
        return Err(NotCacheable::UserCode(
            "a cast, domain check or operator".into(),
        ));
    }
    let mut tables = Vec::new();
    for table in &parsed.summary.tables {
        let name = table.table_name.as_str();
        if table.schema_name.is_empty() && parsed.summary.cte_names.iter().any(|c| c == name) {
            continue;
        }
        match catalog.cache_sources(name) {
            None => return Err(NotCacheable::UnknownRelation(name.to_owned())),
            Some(None) => return Err(NotCacheable::UnsafeRelation(name.to_owned())),
            Some(Some(sources)) => tables.extend_from_slice(sources),
        }
    }
    tables.sort();
    tables.dedup();
    Ok(tables)
}

/// The tables a statement sent to the primary writes, as far as its text shows: the
/// targets of `INSERT`, `UPDATE`, `DELETE` and `MERGE` (data-modifying `WITH` included),
/// `TRUNCATE` and `COPY ... FROM`, each with the tables under it by partitioning. Writes the
/// text does not show (a trigger's, a function's) are left to the WAL; so is a text that
/// cannot be parsed. Used to drop cached answers as soon as a write through pgherd ends,
/// before its commit is decoded.
pub fn written_tables(
    sql: &str,
    lexed: &Lexed,
    catalog: &Snapshot,
    max_parse_bytes: usize,
) -> Vec<String> {
    let Ok(parsed) = parse::parse(sql, lexed, max_parse_bytes) else {
        return Vec::new();
    };
    let mut names: Vec<String> = parsed
        .summary
        .tables
        .iter()
        .filter(|t| t.context == pg_query::protobuf::summary_result::Context::Dml)
        .map(|t| t.table_name.clone())
        .collect();
    for raw in &parsed.tree.protobuf.stmts {
        match raw.stmt.as_deref().and_then(|s| s.node.as_ref()) {
            Some(NodeEnum::TruncateStmt(truncate)) => {
                for relation in &truncate.relations {
                    if let Some(NodeEnum::RangeVar(r)) = relation.node.as_ref() {
                        names.push(r.relname.clone());
                    }
                }
            }
            Some(NodeEnum::CopyStmt(copy)) if copy.is_from => {
                if let Some(r) = copy.relation.as_ref() {
                    names.push(r.relname.clone());
                }
            }
            _ => {}
        }
    }
    let mut tables = Vec::new();
    for name in names {
        if let Some(Some(sources)) = catalog.cache_sources(&name) {
            tables.extend_from_slice(sources);
        }
        tables.push(name);
    }
    tables.sort();
    tables.dedup();
    tables
}

fn reads_state(name: &str) -> bool {
    STATE_READING_FUNCTIONS
        .iter()
        .any(|f| match f.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == *f,
        })
}

/// What in a tree keeps its statement out of the cache, by the node's key and fields.
fn forbidden_node(key: &str, value: &Value) -> Option<NotCacheable> {
    let non_empty = |v: &Value| match v {
        Value::Array(items) => !items.is_empty(),
        Value::Null => false,
        _ => true,
    };
    match key {
        "locking_clause" if non_empty(value) => Some(NotCacheable::Locks),
        "into_clause" if non_empty(value) => Some(NotCacheable::Writes),
        "InsertStmt" | "UpdateStmt" | "DeleteStmt" | "MergeStmt" => Some(NotCacheable::Writes),
        "RangeTableSample" => Some(NotCacheable::Samples),
        "SqlvalueFunction" => Some(NotCacheable::ReadsState(
            "an SQL value function such as CURRENT_TIMESTAMP".into(),
        )),
        "AConst" => {
            let text = tree::last_name(value)?;
            crate::shard_route::is_date_time_word(&text)
                .then(|| NotCacheable::ReadsState("a 'now'-style date literal".into()))
        }
        "TypeCast" => {
            let name = tree::last_name(value.get("type_name")?)?;
            name.starts_with("reg")
                .then(|| NotCacheable::ReadsState("a cast to a reg* type".into()))
        }
        "ColumnRef" => {
            let name = tree::last_name(value.get("fields")?)?;
            tree::SYSTEM_COLUMNS
                .contains(&name.as_str())
                .then_some(NotCacheable::SystemColumn(name))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{Persistence, RelationRow, SnapshotBuilder};
    use crate::lexer::lex;

    fn catalog() -> Snapshot {
        let mut b = SnapshotBuilder::default();
        for (name, volatile, user) in [
            ("count", false, false),
            ("sum", false, false),
            ("lower", false, false),
            ("to_char", false, false),
            ("random", true, false),
            ("now", false, false),
            ("pg_backend_pid", false, false),
            ("current_setting", false, false),
            ("my_lookup", false, true),
        ] {
            b.function(name, volatile, user);
        }
        let mut relation = |oid: u32, name: &str, persistence, cache_safe| {
            b.relation(RelationRow {
                oid,
                name: name.into(),
                persistence,
                runs_user_code: false,
                draws_sequences: false,
                cache_safe,
            })
        };
        relation(1, "accounts", Persistence::Permanent, true);
        relation(2, "branches", Persistence::Permanent, true);
        relation(3, "orders", Persistence::Permanent, true);
        relation(4, "orders_2026", Persistence::Permanent, true);
        relation(5, "staging", Persistence::Unlogged, true);
        relation(6, "a_view", Persistence::Permanent, false);
        relation(7, "pg_class", Persistence::Permanent, false);
        b.child(3, 4);
        b.reaches(3, 4);
        b.build()
    }

    fn verdict(sql: &str) -> Verdict {
        let mut key = Vec::new();
        let lexed = lex(sql.as_bytes(), true, &mut key);
        cacheable(sql, &lexed, &catalog(), parse::DEFAULT_MAX_PARSE_BYTES)
    }

    fn check(sql: &str) -> Result<Vec<String>, NotCacheable> {
        verdict(sql).outcome
    }

    #[test]
    fn verdicts_hold_for_any_literals_only_without_text_constants() {
        assert!(verdict("SELECT abalance FROM accounts WHERE aid = 7").any_literals);
        assert!(verdict("SELECT 1.5 * abalance FROM accounts WHERE aid IN (1, 2)").any_literals);
        assert!(verdict("SELECT * FROM nowhere WHERE x = 1").any_literals);
        for sql in [
            "SELECT 'now'::timestamptz",
            "SELECT '2020-01-01'::timestamptz FROM accounts",
            "SELECT * FROM accounts WHERE filler = $$x$$",
            "SELECT B'101' FROM accounts",
            "SELEC 1",
            r"SELECT 'a\b' FROM accounts",
        ] {
            assert!(!verdict(sql).any_literals, "{sql}");
        }
    }

    fn tables(names: &[&str]) -> Result<Vec<String>, NotCacheable> {
        Ok(names.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn plain_reads_are_cacheable_with_every_table_they_read() {
        assert_eq!(
            check("SELECT abalance FROM accounts WHERE aid = 7"),
            tables(&["accounts"])
        );
        assert_eq!(
            check("SELECT count(*), sum(a.abalance) FROM accounts a JOIN branches b USING (bid) WHERE lower(b.filler) = 'x'"),
            tables(&["accounts", "branches"])
        );
        assert_eq!(
            check("WITH recent AS (SELECT * FROM orders) SELECT * FROM recent, public.accounts"),
            tables(&["accounts", "orders", "orders_2026"])
        );
        assert_eq!(
            check("SELECT 1 WHERE EXISTS (SELECT 1 FROM branches)"),
            tables(&["branches"])
        );
        assert_eq!(check("SELECT 1 + 1"), tables(&[]));
        assert_eq!(check("SELECT to_char(1, '999')"), tables(&[]));
    }

    #[test]
    fn writes_name_their_targets_and_the_partitions_under_them() {
        let written = |sql: &str| {
            let mut key = Vec::new();
            let lexed = lex(sql.as_bytes(), true, &mut key);
            written_tables(sql, &lexed, &catalog(), parse::DEFAULT_MAX_PARSE_BYTES)
        };
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            written("UPDATE accounts SET abalance = b.bbalance FROM branches b WHERE b.bid = 1"),
            names(&["accounts"])
        );
        assert_eq!(
            written("INSERT INTO orders SELECT * FROM accounts"),
            names(&["orders", "orders_2026"])
        );
        assert_eq!(
            written("WITH d AS (DELETE FROM branches RETURNING *) INSERT INTO public.accounts SELECT * FROM d"),
            names(&["accounts", "branches"])
        );
        assert_eq!(
            written(
                "MERGE INTO accounts a USING branches b ON a.bid = b.bid WHEN MATCHED THEN DELETE"
            ),
            names(&["accounts"])
        );
        assert_eq!(
            written("TRUNCATE accounts, branches"),
            names(&["accounts", "branches"])
        );
        assert_eq!(written("COPY accounts FROM STDIN"), names(&["accounts"]));
        assert_eq!(written("COPY accounts TO STDOUT"), names(&[]));
        assert_eq!(written("SELECT * FROM accounts"), names(&[]));
        assert_eq!(written("SELEC 1"), names(&[]));
    }

    #[test]
    fn what_may_change_without_a_decoded_change_is_refused() {
        use NotCacheable::*;
        let cases: &[(&str, NotCacheable)] = &[
            ("SELECT * FROM accounts FOR UPDATE", Locks),
            ("SELECT * FROM accounts a, branches b FOR SHARE OF a", Locks),
            ("SELECT * INTO copy FROM accounts", Writes),
            (
                "WITH d AS (DELETE FROM accounts RETURNING *) SELECT * FROM d",
                Writes,
            ),
            ("SELECT * FROM accounts TABLESAMPLE SYSTEM (10)", Samples),
            ("SELECT ctid, * FROM accounts", SystemColumn("ctid".into())),
            ("SELECT a.xmin FROM accounts a", SystemColumn("xmin".into())),
            ("SELECT random() FROM accounts", Volatile("random".into())),
            ("SELECT now()", ReadsState("now".into())),
            (
                "SELECT pg_backend_pid()",
                ReadsState("pg_backend_pid".into()),
            ),
            (
                "SELECT current_setting('work_mem')",
                ReadsState("current_setting".into()),
            ),
            (
                "SELECT * FROM accounts WHERE CURRENT_TIMESTAMP > '2020-01-01'",
                ReadsState("an SQL value function such as CURRENT_TIMESTAMP".into()),
            ),
            (
                "SELECT 'now'::timestamptz",
                ReadsState("a 'now'-style date literal".into()),
            ),
            (
                "SELECT 'accounts'::regclass",
                ReadsState("a cast to a reg* type".into()),
            ),
            (
                "SELECT my_lookup(aid) FROM accounts",
                UserCode("my_lookup".into()),
            ),
            ("SELECT no_such_fn(1)", UnknownFunction("no_such_fn".into())),
            ("SELECT * FROM nowhere", UnknownRelation("nowhere".into())),
            ("SELECT * FROM staging", UnsafeRelation("staging".into())),
            ("SELECT * FROM a_view", UnsafeRelation("a_view".into())),
            (
                "SELECT relname FROM pg_catalog.pg_class",
                UnsafeRelation("pg_class".into()),
            ),
            ("SELECT 1; SELECT 2", NotOneSelect),
            ("UPDATE accounts SET abalance = 0", NotOneSelect),
            ("EXPLAIN SELECT * FROM accounts", NotOneSelect),
        ];
        for (sql, why) in cases {
            assert_eq!(check(sql).as_ref(), Err(why), "{sql}");
        }
        assert!(matches!(check("SELEC 1"), Err(NotParsed(_))));
        assert_eq!(
            check(r"SELECT 'a\b' FROM accounts"),
            Err(SettingDependentStrings)
        );
    }
}
