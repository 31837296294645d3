//! Data-driven tests of what a sharded endpoint does with a statement: SQL → execution, or
//! the construct it refuses.

use std::collections::BTreeMap;

use super::*;
use crate::shard_hash::{shard_of_text, KeyType};
use crate::shard_plan::{Method, ShardedTable};

const BEGIN: TxCommand = TxCommand::Begin {
    start: false,
    with_options: false,
};

pub(crate) fn map() -> ShardMap {
    ShardMap {
        shards: 3,
        tables: BTreeMap::from([(
            "accounts".to_owned(),
            ShardedTable {
                key_column: "aid".into(),
                key_type: KeyType::Int4,
                method: Method::Hash,
                key_ordinal: None,
            },
        )]),
    }
}

/// The catalog the tests plan with: `my_agg` is the database's own aggregate; of the
/// tables every shard holds, `branches` has a constant default and an identity `id`, `audit`
/// a trigger running user code, `unknown` is not read yet.
fn facts(name: &str) -> Option<CopyFacts> {
    match name {
        "branches" => Some(CopyFacts {
            is_table: true,
            runs_user_code: false,
            varying_defaults: vec!["id".into()],
        }),
        "audit" => Some(CopyFacts {
            is_table: true,
            runs_user_code: true,
            varying_defaults: Vec::new(),
        }),
        "remote" => Some(CopyFacts {
            is_table: false,
            ..CopyFacts::default()
        }),
        "unknown" => None,
        _ => Some(CopyFacts {
            is_table: true,
            ..CopyFacts::default()
        }),
    }
}

fn route_as(sql: &str, decision: &Decision) -> Result<Execution, ShardError> {
    let catalog = CatalogFacts {
        is_user_aggregate: &|name| name == "my_agg",
        copy_facts: &facts,
        mentions_user_code: &|sql| sql.contains("my_type"),
    };
    route_statement(sql, &map(), decision, &catalog, &[])
}

fn route_with_user_function(sql: &str, function: &str) -> Result<Execution, ShardError> {
    let catalog = CatalogFacts {
        is_user_aggregate: &|name| name == function,
        copy_facts: &facts,
        mentions_user_code: &|_| false,
    };
    route_statement(
        sql,
        &map(),
        &Decision::new(Target::Primary, "writes"),
        &catalog,
        &[],
    )
}

fn route(sql: &str) -> Result<Execution, ShardError> {
    route_as(sql, &Decision::new(Target::Replica, "reads"))
}

fn shard_of(key: i32) -> u32 {
    shard_of_text(KeyType::Int4, &key.to_string(), 3).unwrap()
}

#[test]
fn statements_run_where_their_rows_are() {
    let cases: &[(&str, Execution)] = &[
        ("SELECT 1", Execution::AnyShard),
        ("SELECT * FROM branches WHERE bid = 1", Execution::AnyShard),
        ("SHOW work_mem", Execution::AnyShard),
        ("", Execution::AnyShard),
        ("SET work_mem = '8MB'", Execution::Setting),
        ("RESET ALL", Execution::Setting),
        ("SET LOCAL work_mem = '8MB'", Execution::Setting),
        ("BEGIN", Execution::Transaction(BEGIN)),
        (
            "SAVEPOINT \"Sp 1\"",
            Execution::Transaction(TxCommand::Savepoint("Sp 1".into())),
        ),
        (
            "RELEASE sp",
            Execution::Transaction(TxCommand::Release("sp".into())),
        ),
        (
            "ROLLBACK TO SAVEPOINT SP",
            Execution::Transaction(TxCommand::RollbackTo("sp".into())),
        ),
        (
            "DISCARD ALL",
            Execution::Session(SessionCommand::DiscardAll),
        ),
        (
            "DISCARD TEMP",
            Execution::Session(SessionCommand::DiscardNothing("DISCARD TEMP")),
        ),
        (
            "DEALLOCATE ALL",
            Execution::Session(SessionCommand::Deallocate(None)),
        ),
        (
            "DEALLOCATE PREPARE s1",
            Execution::Session(SessionCommand::Deallocate(Some("s1".into()))),
        ),
        (
            "START TRANSACTION ISOLATION LEVEL REPEATABLE READ",
            Execution::Transaction(TxCommand::Begin {
                start: true,
                with_options: true,
            }),
        ),
        ("COMMIT", Execution::Transaction(TxCommand::Commit)),
        ("END", Execution::Transaction(TxCommand::Commit)),
        ("ROLLBACK", Execution::Transaction(TxCommand::Rollback)),
        ("ABORT", Execution::Transaction(TxCommand::Rollback)),
        (
            "INSERT INTO branches (id, bid, bbalance) VALUES (1, 1, 0), (2, 2, 0)",
            Execution::Write {
                shards: BTreeSet::from([0, 1, 2]),
                copies: true,
                split: None,
                pinned: None,
            },
        ),
        (
            "INSERT INTO tellers VALUES (1, 1, 0)",
            Execution::Write {
                shards: BTreeSet::from([0, 1, 2]),
                copies: true,
                split: None,
                pinned: None,
            },
        ),
        // Over several shards, a write runs in one transaction over them.
        (
            "UPDATE accounts SET abalance = 0",
            Execution::Write {
                shards: BTreeSet::from([0, 1, 2]),
                copies: false,
                split: None,
                pinned: None,
            },
        ),
        (
            "DELETE FROM accounts WHERE bid = 3 RETURNING aid",
            Execution::Write {
                shards: BTreeSet::from([0, 1, 2]),
                copies: false,
                split: None,
                pinned: None,
            },
        ),
        // A table every shard holds is written on all of them.
        (
            "UPDATE branches SET bbalance = bbalance + 5 WHERE bid = 1",
            Execution::Write {
                shards: BTreeSet::from([0, 1, 2]),
                copies: true,
                split: None,
                pinned: None,
            },
        ),
        (
            "DELETE FROM branches WHERE bid = 1",
            Execution::Write {
                shards: BTreeSet::from([0, 1, 2]),
                copies: true,
                split: None,
                pinned: None,
            },
        ),
        ("CREATE TABLE t (a int)", Execution::EveryShard),
        ("CREATE INDEX ON accounts (bid)", Execution::EveryShard),
        (
            "ALTER TABLE accounts ADD COLUMN x int",
            Execution::EveryShard,
        ),
        ("TRUNCATE accounts", Execution::Maintenance),
        ("VACUUM ANALYZE accounts", Execution::Maintenance),
        ("DROP TABLE IF EXISTS accounts", Execution::EveryShard),
        (
            "SELECT abalance FROM accounts WHERE aid = 7",
            Execution::OneShard(shard_of(7)),
        ),
        (
            "UPDATE accounts SET abalance = abalance + 1 WHERE aid = 8",
            Execution::OneShard(shard_of(8)),
        ),
        (
            "DELETE FROM accounts WHERE aid = 9",
            Execution::OneShard(shard_of(9)),
        ),
        (
            "INSERT INTO accounts (aid, abalance) VALUES (10, 0)",
            Execution::OneShard(shard_of(10)),
        ),
        (
            "EXPLAIN SELECT * FROM accounts WHERE aid = 7",
            Execution::OneShard(shard_of(7)),
        ),
        // No key can match both: no row, which any one shard says.
        (
            "SELECT * FROM accounts WHERE aid = 1 AND aid = 2",
            Execution::OneShard(if shard_of(1) == shard_of(2) {
                shard_of(1)
            } else {
                0
            }),
        ),
    ];
    for (sql, expected) in cases {
        assert_eq!(route(sql).as_ref(), Ok(expected), "{sql}");
    }
}

#[test]
fn key_less_reads_fan_out_with_their_merge() {
    let Ok(Execution::FanOut { shards, plan }) =
        route("SELECT bid, avg(abalance) FROM accounts GROUP BY bid ORDER BY bid")
    else {
        panic!("a fan-out");
    };
    assert_eq!(shards, BTreeSet::from([0, 1, 2]));
    assert!(
        plan.shard_sql.contains("sum(abalance)"),
        "{}",
        plan.shard_sql
    );
    // An IN list over two shards fans out to those two.
    let (a, b) = (1..100)
        .flat_map(|a| (1..100).map(move |b| (a, b)))
        .find(|&(a, b)| shard_of(a) != shard_of(b))
        .unwrap();
    let Ok(Execution::FanOut { shards, .. }) =
        route(&format!("SELECT * FROM accounts WHERE aid IN ({a}, {b})"))
    else {
        panic!("a fan-out");
    };
    assert_eq!(shards, BTreeSet::from([shard_of(a), shard_of(b)]));
}

#[test]
fn transaction_statements_are_read_from_their_text() {
    let cases: &[(&str, Option<TxCommand>)] = &[
        (
            "SAVEPOINT \"A b\"",
            Some(TxCommand::Savepoint("A b".into())),
        ),
        ("release savepoint X", Some(TxCommand::Release("x".into()))),
        (
            "ROLLBACK WORK TO s",
            Some(TxCommand::RollbackTo("s".into())),
        ),
        ("ABORT", Some(TxCommand::Rollback)),
        ("END", Some(TxCommand::Commit)),
        (
            "START TRANSACTION READ ONLY",
            Some(TxCommand::Begin {
                start: true,
                with_options: true,
            }),
        ),
        (
            "/* a comment */ start transaction -- and another",
            Some(TxCommand::Begin {
                start: true,
                with_options: false,
            }),
        ),
        (
            "BEGIN /* not an option */ WORK",
            Some(TxCommand::Begin {
                start: false,
                with_options: false,
            }),
        ),
        (
            "BEGIN ISOLATION LEVEL SERIALIZABLE",
            Some(TxCommand::Begin {
                start: false,
                with_options: true,
            }),
        ),
        ("PREPARE TRANSACTION 'x'", None),
        ("SET work_mem = '8MB'", None),
        ("COMMIT; COMMIT", None),
    ];
    for (sql, expected) in cases {
        assert_eq!(&tx_command_of(sql), expected, "{sql}");
    }
}

#[test]
fn several_statements_in_one_parse_are_refused_as_postgresql_refuses_them() {
    match route("SELECT 1; SELECT 2") {
        Err(e) => {
            assert_eq!(e.sqlstate(), SqlState::SYNTAX_ERROR);
            assert_eq!(
                e.to_string(),
                "cannot insert multiple commands into a prepared statement"
            );
        }
        Ok(other) => panic!("planned: {other:?}"),
    }
}

#[test]
fn what_cannot_run_exactly_is_refused_by_name() {
    let cases: &[(&str, &str)] = &[
        ("COMMIT AND CHAIN", "AND CHAIN"),
        ("PREPARE TRANSACTION 'x'", "PREPARE TRANSACTION"),
        ("COMMIT PREPARED 'x'", "PREPARE TRANSACTION"),
        (
            "UPDATE branches SET bbalance = random()",
            "calling random",
        ),
        (
            "UPDATE branches SET at = CURRENT_USER WHERE bid = 1",
            "calling CURRENT_USER",
        ),
        (
            "UPDATE branches SET at = clock_timestamp() WHERE bid = 1",
            "calling clock_timestamp",
        ),
        (
            "UPDATE branches SET at = DEFAULT WHERE bid = 1",
            "calling a column's DEFAULT",
        ),
        (
            "INSERT INTO accounts (aid) VALUES (1), (2), (3), (4), (5), (6) ON CONFLICT DO NOTHING RETURNING aid",
            "with RETURNING and an ON CONFLICT that may skip rows",
        ),
        (
            "INSERT INTO branches VALUES (1)",
            "leaving column id of branches to its default",
        ),
        (
            "INSERT INTO branches (bid) VALUES (1)",
            "leaving column id of branches to its default",
        ),
        (
            "INSERT INTO branches (id, bid) SELECT 1, 2",
            "from a query (INSERT ... SELECT)",
        ),
        (
            "UPDATE audit SET n = 1",
            "whose triggers, rules or defaults run user code",
        ),
        (
            "UPDATE branches SET bbalance = 1 FROM tellers WHERE tellers.bid = branches.bid",
            "reading other tables (FROM or USING)",
        ),
        (
            "UPDATE branches SET bbalance = (SELECT tbalance FROM tellers WHERE tid = 1)",
            "with a subquery",
        ),
        ("INSERT INTO unknown VALUES (1)", "catalog does not know"),
        (
            "WITH n AS (INSERT INTO notes (body) VALUES ('x')) UPDATE tellers SET t = 0",
            "with a WITH clause",
        ),
        (
            "INSERT INTO tellers (tid, at) VALUES (1, 'now')",
            "with the date/time word 'now'",
        ),
        ("DELETE FROM tellers WHERE ctid = '(0,1)'", "system column ctid"),
        (
            "INSERT INTO branches (id, bid) OVERRIDING USER VALUE VALUES (1, 2)",
            "OVERRIDING USER VALUE",
        ),
        ("DELETE FROM remote WHERE id = 1", "is a view or a foreign table"),
        ("UPDATE tellers SET t = '1'::my_type", "whose code is the database's own"),
        ("COPY accounts TO STDOUT (FORMAT binary)", "format other than text or CSV"),
        ("COPY accounts TO '/tmp/x'", "TO a file or program"),
        (
            "COPY (SELECT * FROM accounts ORDER BY aid) TO STDOUT",
            "rows must be merged",
        ),
        (
            "COPY (SELECT count(*) FROM accounts) TO STDOUT",
            "rows must be merged",
        ),
        (
            "COPY accounts (bid) FROM STDIN",
            "COPY into accounts without its shard key column aid",
        ),
        ("COPY branches (bid) FROM STDIN", "leaving column id of branches"),
        ("DO $$ BEGIN END $$", "DO through a sharded endpoint"),
        (
            "EXPLAIN SELECT count(*) FROM accounts",
            "EXPLAIN of a statement over several shards",
        ),
        (
            "SELECT my_agg(abalance) FROM accounts",
            "not supported on sharded tables",
        ),
        (
            "CREATE TABLE c AS SELECT * FROM accounts",
            "CREATE TABLE AS",
        ),
    ];
    for (sql, refusal) in cases {
        match route(sql) {
            Err(e) => {
                assert_eq!(e.sqlstate(), SqlState::FEATURE_NOT_SUPPORTED, "{sql}: {e}");
                assert!(e.to_string().contains(refusal), "{sql}: {e}");
            }
            Ok(other) => panic!("{sql}: {other:?}"),
        }
    }
    let syntax = route("SELEC 1");
    assert!(
        matches!(&syntax, Err(e) if e.sqlstate() == SqlState::SYNTAX_ERROR),
        "unread text is never sent: {syntax:?}"
    );
    let bad_key = route("SELECT * FROM accounts WHERE aid = 'x'");
    assert!(
        matches!(&bad_key, Err(e) if e.sqlstate() == SqlState::INVALID_TEXT_REPRESENTATION),
        "{bad_key:?}"
    );
}

/// The routing classification of the same text decides what may run on any one shard: a
/// write outside the sharded tables, or session state a connection keeps, is refused.
#[test]
fn writes_and_session_state_outside_sharded_tables_are_refused() {
    let writes = Decision::new(Target::Primary, "calls volatile function nextval");
    let refused = route_as("SELECT nextval('s')", &writes);
    assert!(
        matches!(&refused, Err(e) if e.to_string().contains("may write outside the sharded tables (calls volatile function nextval)")),
        "{refused:?}"
    );
    // On a sharded table the shard it runs on is the one its key names.
    assert_eq!(
        route_as("UPDATE accounts SET bid = 1 WHERE aid = 7", &writes),
        Ok(Execution::OneShard(shard_of(7)))
    );
    let pins = Decision {
        pin: Some(crate::decision::Pin::TempTable),
        ..Decision::new(Target::Primary, "creates a temporary table")
    };
    let refused = route_as("CREATE TEMP TABLE t (a int)", &pins);
    assert!(
        matches!(&refused, Err(e) if e.to_string().contains("session state that stays on one server connection")),
        "{refused:?}"
    );
}

/// A write to a table every shard holds that reads a sharded table would see only each
/// shard's part of it: refused, never run.
#[test]
fn a_shared_table_written_from_a_sharded_one_is_refused() {
    for sql in [
        "UPDATE branches SET bbalance = (SELECT sum(abalance) FROM accounts)",
        "DELETE FROM branches WHERE bid IN (SELECT bid FROM accounts)",
        "UPDATE branches b SET bbalance = a.abalance FROM accounts a WHERE a.aid = b.bid",
    ] {
        let routed = route(sql);
        assert!(
            matches!(&routed, Err(e) if e.sqlstate() == SqlState::FEATURE_NOT_SUPPORTED),
            "{sql}: {routed:?}"
        );
    }
}

/// An INSERT of rows for several shards is written once per shard with that shard's rows, in
/// their order, and remembers each row's shard.
#[test]
fn an_insert_of_rows_for_several_shards_is_split() {
    let keys = [1, 2, 3, 4, 5, 6];
    let sql = "INSERT INTO accounts (aid, filler) VALUES (1, 'a'), (2, 'b'), (3, 'c'), (4, 'd'), (5, 'e''s'), (6, NULL) RETURNING aid";
    let Ok(Execution::Write {
        shards,
        copies: false,
        split: Some(split),
        pinned: None,
    }) = route(sql)
    else {
        panic!("a split: {:?}", route(sql));
    };
    let expected: Vec<u32> = keys.iter().map(|&k| shard_of(k)).collect();
    assert_eq!(split.row_shards, expected);
    assert_eq!(shards, expected.iter().copied().collect::<BTreeSet<_>>());
    for (shard, statement) in &split.statements {
        let mine: Vec<String> = keys
            .iter()
            .filter(|&&k| shard_of(k) == *shard)
            .map(|k| format!("({k}, "))
            .collect();
        for key in keys {
            let listed = statement.contains(&format!("({key}, "));
            assert_eq!(listed, mine.contains(&format!("({key}, ")), "{statement}");
        }
        assert!(statement.ends_with("RETURNING aid"), "{statement}");
        // Each piece plans to its own shard.
        assert_eq!(
            route(statement),
            Ok(Execution::OneShard(*shard)),
            "{statement}"
        );
    }
}

#[test]
fn copy_in_knows_where_the_key_is() {
    let plan = |sql: &str| match route(sql) {
        Ok(Execution::CopyIn(plan)) => *plan,
        other => panic!("{sql}: {other:?}"),
    };
    let listed = plan("COPY accounts (abalance, aid) FROM STDIN (FORMAT csv)");
    assert_eq!(
        listed.key,
        Some(CopyKey {
            table: "accounts".into(),
            column: "aid".into(),
            index: Some(1)
        })
    );
    assert!(matches!(
        listed.copy.format,
        crate::copy_split::CopyFormat::Csv { .. }
    ));
    assert_eq!(
        plan("COPY accounts FROM STDIN").key.and_then(|k| k.index),
        None
    );
    // A table every shard holds: every row to every shard.
    assert_eq!(plan("COPY tellers FROM STDIN").key, None);
    assert_eq!(plan("COPY branches FROM STDIN").key, None);
}

/// Values computed anywhere in a write to a table every shard holds are seen, VALUES lists
/// included.
#[test]
fn computed_values_are_seen_wherever_they_are() {
    for (sql, what) in [
        (
            "INSERT INTO tellers (tid, at) VALUES (1, statement_timestamp())",
            "calling statement_timestamp",
        ),
        (
            "INSERT INTO tellers (tid, n) VALUES (1, (SELECT 1))",
            "subquery",
        ),
        (
            "INSERT INTO tellers (tid, at) VALUES (1, 'today'::date)",
            "'today'",
        ),
        ("UPDATE tellers SET note = xmin::text", "system column xmin"),
    ] {
        match route(sql) {
            Err(e) => assert!(e.to_string().contains(what), "{sql}: {e}"),
            Ok(other) => panic!("{sql}: {other:?}"),
        }
    }
}

/// The transaction's times in a write to a table every shard holds are computed once and
/// bound on every shard (`pin`); the rest of the guard still holds.
#[test]
fn transaction_times_of_copies_are_pinned() {
    let planned =
        route("INSERT INTO tellers (tid, at, d) VALUES ($1, CURRENT_TIMESTAMP, current_date)");
    let Ok(Execution::Write {
        copies: true,
        pinned: Some(pinned),
        ..
    }) = planned
    else {
        panic!("{planned:?}");
    };
    assert_eq!(
        pinned.sql,
        "INSERT INTO tellers (tid, at, d) VALUES ($1, $2, $3)"
    );
    assert_eq!(pinned.client_params, 1);
    assert_eq!(pinned.values.len(), 2);
    // A COPY's WHERE would be read by each shard at its own time; a function the database
    // defines under a built-in's name is not the transaction's time.
    let refused = route("COPY tellers FROM STDIN WHERE at > now()").unwrap_err();
    assert!(
        refused
            .to_string()
            .contains("reading the transaction's time"),
        "{refused}"
    );
    let refused =
        route_with_user_function("INSERT INTO tellers (tid, at) VALUES (1, now())", "now")
            .unwrap_err();
    assert!(refused.to_string().contains("calling now"), "{refused}");
    // A write to a sharded table's rows computes them on its own shard, as one server would.
    let planned = route("UPDATE accounts SET at = now() WHERE aid = 1");
    assert_eq!(planned, Ok(Execution::OneShard(shard_of(1))));
}

#[test]
fn only_literals_are_constant_defaults() {
    use crate::catalog::is_constant_default;
    for constant in [
        "0",
        "'x'::text",
        "'{}'::jsonb",
        "NULL::integer",
        "true",
        "'-1'::integer",
    ] {
        assert!(is_constant_default(constant), "{constant}");
    }
    for varying in [
        "now()",
        "CURRENT_TIMESTAMP",
        "nextval('s'::regclass)",
        "('now'::text)::timestamp with time zone",
        "'today'::date",
        "(1 + 1)",
    ] {
        assert!(!is_constant_default(varying), "{varying}");
    }
}

fn fan_out_plan(sql: &str) -> crate::merge_plan::FanOut {
    let parsed = pg_query::parse(sql).unwrap();
    let Some(NodeEnum::SelectStmt(select)) = parsed.protobuf.stmts[0]
        .stmt
        .as_ref()
        .and_then(|s| s.node.clone())
    else {
        panic!("{sql}: not a SELECT")
    };
    crate::merge_plan::plan_fan_out(&select, "aid", &|_| false).unwrap()
}

pub(crate) fn route_bound(sql: &str, params: &[BoundParam]) -> Result<Execution, ShardError> {
    let catalog = CatalogFacts {
        is_user_aggregate: &|_| false,
        copy_facts: &facts,
        mentions_user_code: &|_| false,
    };
    route_statement(
        sql,
        &map(),
        &Decision::new(Target::Replica, "reads"),
        &catalog,
        params,
    )
}

#[test]
fn bound_parameters_place_a_statement_as_literals_do() {
    let text = |v: &'static str| BoundParam::text(Some(v));
    let seven = 7i32.to_be_bytes();
    let binary = |v: &'static [u8]| BoundParam {
        value: Some(v),
        binary: true,
        type_oid: 0,
    };
    let seven_binary = BoundParam {
        type_oid: 23,
        ..binary(Box::leak(Box::new(seven)))
    };
    let bigint = |v: &'static [u8]| BoundParam {
        type_oid: 20,
        ..binary(v)
    };
    let all = Ok(Execution::FanOut {
        shards: BTreeSet::from([0, 1, 2]),
        plan: Box::new(fan_out_plan("SELECT * FROM accounts WHERE aid = $1")),
    });
    let cases: Vec<(&str, Vec<BoundParam>, Result<Execution, String>)> = vec![
        (
            "SELECT * FROM accounts WHERE aid = $1",
            vec![text("7")],
            Ok(Execution::OneShard(shard_of(7))),
        ),
        (
            "SELECT * FROM accounts WHERE aid = $1",
            vec![seven_binary],
            Ok(Execution::OneShard(shard_of(7))),
        ),
        // A bigint bound for an integer key: its value, if within the key's range.
        (
            "SELECT * FROM accounts WHERE aid = $1",
            vec![bigint(&[0, 0, 0, 0, 0, 0, 0, 7])],
            Ok(Execution::OneShard(shard_of(7))),
        ),
        (
            "SELECT * FROM accounts WHERE aid = $1",
            vec![bigint(&[0, 0, 0, 1, 0, 0, 0, 0])],
            Err("value \"4294967296\" is out of range for type integer".into()),
        ),
        (
            "SELECT * FROM accounts WHERE aid = $1",
            vec![bigint(&[1, 2, 3])],
            Err("invalid input syntax for type integer: \"a binary value of 3 bytes\"".into()),
        ),
        // Binary of a type pgherd does not know, or of another type (a double's 8 bytes are
        // no bigint): the key may be any, so a read goes to every shard, a write is refused.
        ("SELECT * FROM accounts WHERE aid = $1", vec![binary(&[0, 0, 0, 7])], all.clone()),
        (
            "SELECT * FROM accounts WHERE aid = $1",
            vec![BoundParam {
                type_oid: 701,
                ..binary(&[64, 69, 0, 0, 0, 0, 0, 0])
            }],
            all.clone(),
        ),
        (
            "SELECT * FROM accounts WHERE aid = $1",
            vec![BoundParam {
                type_oid: 1700,
                ..text("42.0")
            }],
            all,
        ),
        (
            "INSERT INTO accounts (aid) VALUES ($1)",
            vec![BoundParam {
                type_oid: 701,
                ..binary(&[64, 69, 0, 0, 0, 0, 0, 0])
            }],
            Err("not supported on sharded tables: a key of type integer bound as parameter $1 of type double precision".into()),
        ),
        (
            "SELECT * FROM accounts WHERE aid = $1",
            vec![],
            Err("no value was bound for parameter $1".into()),
        ),
        (
            "SELECT * FROM accounts WHERE aid = $1",
            vec![text("seven")],
            Err("invalid input syntax for type integer: \"seven\"".into()),
        ),
        // NULL equals no key: any one shard says there is no row.
        (
            "SELECT * FROM accounts WHERE aid = $1",
            vec![BoundParam::text(None)],
            Ok(Execution::OneShard(0)),
        ),
        (
            "UPDATE accounts SET abalance = abalance + $2 WHERE aid = $1",
            vec![text("7"), text("5")],
            Ok(Execution::OneShard(shard_of(7))),
        ),
        (
            "INSERT INTO accounts (aid, abalance) VALUES ($2, $1)",
            vec![text("0"), text("7")],
            Ok(Execution::OneShard(shard_of(7))),
        ),
    ];
    for (sql, params, expected) in cases {
        let got = route_bound(sql, &params).map_err(|e| e.to_string());
        assert_eq!(got, expected, "{sql} with {params:?}");
    }
}

#[test]
fn a_split_insert_keeps_its_parameters_on_every_shard() {
    let keys = (1..=30).find_map(|a| {
        let b = (a + 1..=30).find(|&b| shard_of(b) != shard_of(a))?;
        Some((a, b))
    });
    let (a, b) = keys.expect("two keys on two shards");
    let (a_text, b_text) = (a.to_string(), b.to_string());
    let params = [
        BoundParam::text(Some(&a_text)),
        BoundParam::text(Some(&b_text)),
    ];
    let planned = route_bound(
        "INSERT INTO accounts (aid, abalance) VALUES ($1, 0), ($2, 0)",
        &params,
    )
    .expect("planned");
    let Execution::Write {
        split: Some(split), ..
    } = planned
    else {
        panic!("a split insert: {planned:?}");
    };
    assert_eq!(split.row_shards, vec![shard_of(a), shard_of(b)]);
    assert_eq!(
        split.statements[&shard_of(a)],
        "INSERT INTO accounts (aid, abalance) VALUES ($1, 0)"
    );
    assert_eq!(
        split.statements[&shard_of(b)],
        "INSERT INTO accounts (aid, abalance) VALUES ($2, 0)"
    );
}

#[test]
fn a_named_shard_runs_reads_there_and_writes_only_if_their_rows_are_there() {
    let read = Decision::new(Target::Replica, "reads");
    let write = Decision::new(Target::Primary, "writes");
    let on_1 =
        |sql: &str, decision: &Decision| on_named_shard(sql, route_as(sql, decision), decision, 1);
    let (on_0, on_1_key) = (
        (0..).find(|&k| shard_of(k) == 0).unwrap(),
        (0..).find(|&k| shard_of(k) == 1).unwrap(),
    );
    let runs_on_1: &[(&str, &Decision)] = &[
        ("SELECT 1", &read),
        ("SELECT count(*) FROM accounts", &read),
        (&format!("SELECT * FROM accounts WHERE aid = {on_0}"), &read),
        // Not mergeable over the shards, but a read of one shard as sent.
        ("SELECT row_number() OVER () FROM accounts", &read),
        ("VACUUM accounts", &write),
        (
            &format!("UPDATE accounts SET abalance = 0 WHERE aid = {on_1_key}"),
            &write,
        ),
    ];
    for (sql, decision) in runs_on_1 {
        assert_eq!(on_1(sql, decision), Ok(Execution::OneShard(1)), "{sql}");
    }
    let unchanged: &[(&str, Execution)] = &[
        ("SET work_mem = '8MB'", Execution::Setting),
        ("BEGIN", Execution::Transaction(BEGIN)),
        (
            "ROLLBACK TO SAVEPOINT s",
            Execution::Transaction(TxCommand::RollbackTo("s".into())),
        ),
    ];
    for (sql, execution) in unchanged {
        assert_eq!(on_1(sql, &read).as_ref(), Ok(execution), "{sql}");
    }
    let refused: &[(&str, &str)] = &[
        (
            &format!("UPDATE accounts SET abalance = 0 WHERE aid = {on_0}"),
            "rows are on shard 0",
        ),
        (
            "UPDATE accounts SET abalance = 0",
            "rows are on several shards",
        ),
        (
            "INSERT INTO branches (id, bid, bbalance) VALUES (1, 1, 0)",
            "every shard holds",
        ),
        ("CREATE TABLE t (a int)", "schema change"),
        ("COPY accounts FROM STDIN", "COPY FROM"),
        (
            "SELECT nextval('s')",
            "may write outside the sharded tables",
        ),
    ];
    for (sql, why) in refused {
        match on_1(sql, &write) {
            Err(ShardError::Unsupported(e)) => assert!(e.0.contains(why), "{sql}: {e}"),
            other => panic!("{sql}: {other:?}"),
        }
    }
    // What is refused over the shards stays refused unless it is one plain SELECT: a
    // transaction or session command on one shard's link would split what pgherd keeps.
    let any = Decision::new(Target::Any, "marks the transaction");
    for sql in [
        "COMMIT AND CHAIN",
        "ROLLBACK AND CHAIN",
        "SET standard_conforming_strings = off",
        "SELECT 1; SELECT 2",
        "SET search_path = x; SELECT count(*) FROM accounts",
    ] {
        assert!(on_1(sql, &any).is_err(), "{sql}: {:?}", on_1(sql, &any));
    }
    match on_1("TRUNCATE branches", &write) {
        Err(ShardError::Unsupported(e)) => assert!(e.0.contains("TRUNCATE"), "{e}"),
        other => panic!("TRUNCATE: {other:?}"),
    }
    // Text pgherd cannot read is not sent anywhere.
    assert!(matches!(on_1("SELEC 1", &read), Err(ShardError::Syntax(_))));
}

#[test]
fn copy_to_stdout_reads_each_shard_in_turn_or_the_one_that_has_the_rows() {
    let every = BTreeSet::from([0, 1, 2]);
    let on = shard_of(7);
    let cases: &[(&str, Execution)] = &[
        (
            "COPY accounts TO STDOUT",
            Execution::CopyOut {
                shards: every.clone(),
                header: false,
            },
        ),
        (
            "COPY accounts (aid) TO STDOUT WITH (FORMAT csv, HEADER)",
            Execution::CopyOut {
                shards: every.clone(),
                header: true,
            },
        ),
        (
            "COPY (SELECT aid FROM accounts WHERE abalance > 0) TO STDOUT",
            Execution::CopyOut {
                shards: every,
                header: false,
            },
        ),
        (
            "COPY (SELECT * FROM accounts WHERE aid = 7) TO STDOUT",
            Execution::OneShard(on),
        ),
        ("COPY branches TO STDOUT", Execution::AnyShard),
        (
            "COPY branches TO STDOUT (FORMAT binary)",
            Execution::AnyShard,
        ),
        ("COPY (SELECT 1) TO STDOUT", Execution::AnyShard),
    ];
    for (sql, want) in cases {
        assert_eq!(route(sql).as_ref(), Ok(want), "{sql}");
    }
}
