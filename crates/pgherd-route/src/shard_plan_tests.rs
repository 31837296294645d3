//! Data-driven tests of key routing: SQL and bind values → shards, or why not. Hash shards
//! are computed with `shard_hash`, which `crates/pgherd/tests/sharding.rs` checks against
//! PostgreSQL's own partitions.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

const SHARDS: u32 = 3;

fn map() -> ShardMap {
    let table = |key_column: &str, key_type, method| ShardedTable {
        key_column: key_column.into(),
        key_type,
        method,
        key_ordinal: None,
    };
    ShardMap {
        shards: SHARDS,
        tables: BTreeMap::from([
            (
                "accounts".to_owned(),
                table("aid", KeyType::Int8, Method::Hash),
            ),
            (
                "events".to_owned(),
                table(
                    "id",
                    KeyType::Int4,
                    Method::Range {
                        starts: vec![0, 1000, 2000],
                    },
                ),
            ),
            (
                "regions".to_owned(),
                table(
                    "code",
                    KeyType::Text,
                    Method::List {
                        values: vec![
                            vec!["eu".into(), "uk".into()],
                            vec!["us".into()],
                            vec!["apac".into()],
                        ],
                    },
                ),
            ),
            (
                "app.users".to_owned(),
                table("uid", KeyType::Uuid, Method::Hash),
            ),
        ]),
    }
}

fn statement(sql: &str) -> NodeEnum {
    let parsed = pg_query::parse(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    parsed.protobuf.stmts[0]
        .stmt
        .as_ref()
        .and_then(|s| s.node.clone())
        .expect("a statement")
}

/// The shards a statement reads or writes with these bind values, or why not.
fn shards(sql: &str, params: &[Option<&str>]) -> Result<BTreeSet<u32>, String> {
    let map = map();
    let params: Vec<BoundParam> = params.iter().map(|p| BoundParam::text(*p)).collect();
    match plan(&statement(sql), &map).map_err(|e| e.to_string())? {
        ShardPlan::Unsharded => Err("unsharded".into()),
        ShardPlan::Table { table, restriction } => restriction
            .shards(&map.tables[&table], SHARDS, &params)
            .map_err(|e| e.to_string()),
        plan @ ShardPlan::InsertRows { .. } => plan
            .row_shards(&map, &params)
            .map(|rows| rows.into_iter().collect())
            .map_err(|e| e.to_string()),
    }
}

fn hashed(key_type: KeyType, keys: &[&str]) -> BTreeSet<u32> {
    keys.iter()
        .map(|k| crate::shard_hash::shard_of_text(key_type, k, SHARDS).unwrap())
        .collect()
}

fn all() -> BTreeSet<u32> {
    (0..SHARDS).collect()
}

/// SQL, bind values, the shards expected.
type Case<'a> = (&'a str, &'a [Option<&'a str>], BTreeSet<u32>);

#[test]
fn equality_and_in_on_the_key_pick_the_shards_of_those_keys() {
    let int8 = |keys: &[&str]| hashed(KeyType::Int8, keys);
    let cases: &[Case] = &[
        ("SELECT * FROM accounts WHERE aid = 5", &[], int8(&["5"])),
        ("SELECT * FROM accounts WHERE 5 = aid", &[], int8(&["5"])),
        (
            "SELECT * FROM accounts WHERE aid = '5'::bigint",
            &[],
            int8(&["5"]),
        ),
        (
            "SELECT * FROM accounts WHERE aid = 5::int4",
            &[],
            int8(&["5"]),
        ),
        (
            "SELECT * FROM regions WHERE code = 'uk'::text",
            &[],
            BTreeSet::from([0]),
        ),
        (
            "SELECT * FROM accounts a WHERE a.aid = $1",
            &[Some("7")],
            int8(&["7"]),
        ),
        (
            "SELECT * FROM accounts WHERE accounts.aid = 8",
            &[],
            int8(&["8"]),
        ),
        (
            "SELECT * FROM public.accounts WHERE aid = 8",
            &[],
            int8(&["8"]),
        ),
        (
            "SELECT * FROM accounts WHERE aid IN (1, 2, 3)",
            &[],
            int8(&["1", "2", "3"]),
        ),
        (
            "SELECT * FROM accounts WHERE aid = 1 OR aid = 2",
            &[],
            int8(&["1", "2"]),
        ),
        (
            "SELECT * FROM accounts WHERE aid = 1 AND abalance > 0",
            &[],
            int8(&["1"]),
        ),
        (
            "SELECT * FROM accounts WHERE aid = 9223372036854775807",
            &[],
            int8(&["9223372036854775807"]),
        ),
        (
            "DELETE FROM accounts WHERE aid IN ($1, $2)",
            &[Some("4"), Some("9")],
            int8(&["4", "9"]),
        ),
        (
            "UPDATE accounts SET abalance = 0 WHERE aid = 5",
            &[],
            int8(&["5"]),
        ),
        (
            "SELECT abalance FROM accounts JOIN branches USING (bid) WHERE aid = 5",
            &[],
            int8(&["5"]),
        ),
        // No row has a NULL key equal to anything; a key no shard holds matches nothing.
        (
            "SELECT * FROM accounts WHERE aid = NULL",
            &[],
            BTreeSet::new(),
        ),
        (
            "SELECT * FROM accounts WHERE aid = $1",
            &[None],
            BTreeSet::new(),
        ),
        (
            "SELECT * FROM events WHERE id = 1500",
            &[],
            BTreeSet::from([1]),
        ),
        (
            "SELECT * FROM events WHERE id IN (5, 2500)",
            &[],
            BTreeSet::from([0, 2]),
        ),
        ("SELECT * FROM events WHERE id = -1", &[], BTreeSet::new()),
        // Beyond integer: PostgreSQL compares as bigint and finds nothing.
        (
            "SELECT * FROM events WHERE id = 99999999999",
            &[],
            BTreeSet::new(),
        ),
        (
            "SELECT * FROM regions WHERE code = 'uk'",
            &[],
            BTreeSet::from([0]),
        ),
        (
            "SELECT * FROM regions WHERE code = 'mars'",
            &[],
            BTreeSet::new(),
        ),
        (
            "SELECT * FROM app.users WHERE uid = 'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'",
            &[],
            hashed(KeyType::Uuid, &["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
        ),
        (
            "SELECT * FROM users WHERE uid = $1",
            &[Some("a0eebc999c0b4ef8bb6d6bb9bd380a11")],
            hashed(KeyType::Uuid, &["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
        ),
    ];
    for (sql, params, expected) in cases {
        assert_eq!(shards(sql, params).as_ref(), Ok(expected), "{sql}");
    }
}

#[test]
fn without_a_predicate_that_pins_the_key_every_shard_is_read() {
    for sql in [
        "SELECT count(*) FROM accounts",
        "SELECT * FROM accounts WHERE abalance > 0",
        "SELECT * FROM accounts WHERE aid = 1 OR abalance > 0",
        "SELECT * FROM accounts WHERE NOT aid = 1",
        "SELECT * FROM accounts WHERE aid > 5",
        "SELECT * FROM accounts WHERE aid = bid",
        "SELECT * FROM accounts a JOIN branches b USING (bid) WHERE b.aid = 5",
        "UPDATE accounts SET abalance = 0",
        "DELETE FROM accounts WHERE aid = abs(-5)",
        "SELECT * FROM accounts WHERE aid = 5.0",
        // Aliases that rename columns: the key's name may mean another one.
        "SELECT * FROM accounts AS a(x, aid) WHERE aid = 5",
        "SELECT * FROM (accounts JOIN branches USING (bid)) AS j(b, aid) WHERE aid = 5",
        // Casts that change what is compared.
        "SELECT * FROM regions WHERE code = 'ukraine'::varchar(2)",
        "SELECT * FROM regions WHERE code = 'uk '::char(3)",
        "SELECT * FROM regions WHERE code = 'UK'::citext",
        "SELECT * FROM accounts WHERE aid = '-1'::oid::int8",
        "SELECT * FROM accounts JOIN branches b ON b.bid = accounts.bid",
    ] {
        assert_eq!(shards(sql, &[]), Ok(all()), "{sql}");
    }
    // Two keys that cannot both hold: no shard.
    let one = hashed(KeyType::Int8, &["1"]);
    let two = hashed(KeyType::Int8, &["2"]);
    let expected: BTreeSet<u32> = one.intersection(&two).copied().collect();
    assert_eq!(
        shards("SELECT * FROM accounts WHERE aid = 1 AND aid = 2", &[]),
        Ok(expected)
    );
}

#[test]
fn insert_values_give_each_rows_shard() {
    let map = map();
    let insert = plan(
        &statement("INSERT INTO accounts (bid, aid) VALUES (1, 1), (1, 2), (2, $1)"),
        &map,
    )
    .unwrap();
    let rows = insert
        .row_shards(&map, &[BoundParam::text(Some("3"))])
        .unwrap();
    let expected: Vec<u32> = ["1", "2", "3"]
        .iter()
        .map(|k| crate::shard_hash::shard_of_text(KeyType::Int8, k, SHARDS).unwrap())
        .collect();
    assert_eq!(rows, expected);

    // Without a column list, the key's position comes from the catalog.
    let sql = "INSERT INTO accounts VALUES (4, 1)";
    assert_eq!(
        shards(sql, &[]),
        Err("not supported on sharded tables: INSERT into accounts without a column list (name the columns)".into())
    );
    let mut with_ordinal = map.clone();
    if let Some(table) = with_ordinal.tables.get_mut("accounts") {
        table.key_ordinal = Some(0);
    }
    let rows = plan_rows(sql, &with_ordinal);
    assert_eq!(
        rows,
        hashed(KeyType::Int8, &["4"])
            .into_iter()
            .collect::<Vec<_>>()
    );

    // Keys no shard takes are refused as PostgreSQL refuses a row no partition takes.
    let refused = |sql: &str| {
        let map = map.clone();
        let insert = plan(&statement(sql), &map).unwrap();
        let error = insert.row_shards(&map, &[]).unwrap_err();
        (error.sqlstate(), error.to_string())
    };
    assert_eq!(
        refused("INSERT INTO events (id) VALUES (-5)"),
        (
            SqlState::CHECK_VIOLATION,
            "no shard of table events holds key -5".into()
        )
    );
    assert_eq!(
        refused("INSERT INTO events (id) VALUES (NULL)"),
        (
            SqlState::CHECK_VIOLATION,
            "no shard of table events holds key NULL".into()
        )
    );
    // As PostgreSQL puts a NULL hash key in the partition of remainder 0.
    assert_eq!(
        plan_rows("INSERT INTO accounts (aid) VALUES (NULL)", &map),
        vec![0]
    );
    assert_eq!(
        refused("INSERT INTO events (id) VALUES (99999999999)").0,
        SqlState::NUMERIC_VALUE_OUT_OF_RANGE
    );
}

fn plan_rows(sql: &str, map: &ShardMap) -> Vec<u32> {
    plan(&statement(sql), map)
        .unwrap()
        .row_shards(map, &[])
        .unwrap()
}

#[test]
fn bind_values_are_read_as_the_key_type_reads_them() {
    assert_eq!(
        shards("SELECT * FROM events WHERE id = $1", &[Some("99999999999")]),
        Err("value \"99999999999\" is out of range for type integer".into())
    );
    assert_eq!(
        shards("SELECT * FROM accounts WHERE aid = $2", &[Some("1")]),
        Err("no value was bound for parameter $2".into())
    );
    assert_eq!(
        shards("SELECT * FROM accounts WHERE aid = $1", &[Some("x")]),
        Err("invalid input syntax for type bigint: \"x\"".into())
    );
}

#[test]
fn statements_that_cannot_be_split_exactly_are_refused_naming_the_construct() {
    let cases = [
        (
            "SELECT * FROM accounts WHERE aid IN (SELECT aid FROM accounts WHERE abalance > 0)",
            "naming sharded tables more than once (accounts, accounts",
        ),
        (
            "SELECT * FROM branches WHERE bid IN (SELECT bid FROM accounts)",
            "a sharded table outside the FROM list",
        ),
        (
            "WITH x AS (SELECT * FROM accounts) SELECT * FROM x",
            "a sharded table outside the FROM list",
        ),
        (
            "SELECT * FROM accounts JOIN events ON aid = id",
            "a join of sharded table",
        ),
        (
            "SELECT * FROM accounts a1, accounts a2 WHERE a1.aid = 1",
            "a join of sharded table",
        ),
        (
            "INSERT INTO accounts (aid, bid) VALUES (1, (SELECT max(bid) FROM accounts))",
            "naming sharded tables more than once",
        ),
        (
            "INSERT INTO accounts (aid) SELECT 1",
            "INSERT into accounts from a query",
        ),
        (
            "INSERT INTO accounts (aid) VALUES (nextval('s'))",
            "a shard key of accounts given by an expression",
        ),
        (
            "INSERT INTO accounts (bid) VALUES (1)",
            "without its shard key column aid",
        ),
        (
            "UPDATE accounts SET aid = 6 WHERE aid = 5",
            "UPDATE of the shard key column aid of accounts",
        ),
        (
            "UPDATE accounts SET abalance = 0 FROM branches WHERE aid = 1",
            "UPDATE ... FROM",
        ),
        (
            "DELETE FROM accounts USING branches WHERE aid = 1",
            "DELETE ... USING",
        ),
        (
            "SELECT aid FROM accounts UNION SELECT 1",
            "UNION, INTERSECT or EXCEPT",
        ),
        ("SELECT * INTO copy FROM accounts", "SELECT INTO"),
        (
            "SELECT * FROM branches LEFT JOIN accounts USING (bid) WHERE aid = 1",
            "an outer join of sharded table accounts",
        ),
        (
            "SELECT * FROM accounts FULL JOIN branches USING (bid)",
            "an outer join of sharded table accounts",
        ),
        (
            "INSERT INTO branches SELECT * FROM accounts",
            "INSERT of another table reading a sharded one",
        ),
        (
            "WITH moved AS (INSERT INTO audit VALUES (1) RETURNING 1) SELECT * FROM accounts WHERE aid = 5",
            "a data-modifying WITH",
        ),
        (
            "INSERT INTO accounts (aid, bid) VALUES (1, 1) ON CONFLICT (aid) DO UPDATE SET aid = 2",
            "ON CONFLICT DO UPDATE of the shard key column aid",
        ),
        (
            "INSERT INTO accounts (aid) VALUES (1), (2) LIMIT 1",
            "from VALUES with ORDER BY, LIMIT",
        ),
    ];
    for (sql, expected) in cases {
        let error = plan(&statement(sql), &map()).unwrap_err();
        assert_eq!(error.sqlstate(), SqlState::FEATURE_NOT_SUPPORTED);
        assert!(
            error.to_string().contains(expected),
            "{sql}: {error} (expected {expected})"
        );
    }
}

#[test]
fn statements_without_sharded_tables_are_left_alone() {
    for sql in [
        "SELECT 1",
        "SELECT * FROM branches WHERE bid = 1",
        "INSERT INTO history (aid) VALUES (1)",
        "SELECT * FROM other.accounts",
    ] {
        assert_eq!(
            plan(&statement(sql), &map()),
            Ok(ShardPlan::Unsharded),
            "{sql}"
        );
    }
}
