//! The pure pieces of sharding checked against a real PostgreSQL 15: hash shards agree with
//! `PARTITION BY HASH` (for keys of each type pgherd shards by, over several shard counts, the
//! partition PostgreSQL puts a row in is the shard `pgherd_route::shard_hash` computes), and
//! aggregates merged from per-shard results (`pgherd_route::merge_rows`) are what PostgreSQL
//! computes over all the rows.

use pgherd_route::merge_plan::{Column, Combine, Grouping, Merge};
use pgherd_route::merge_rows::{ColumnType, Format, Merger, TextRules};
use pgherd_route::shard_hash::{shard_of, shard_of_text, KeyType};
use pgherd_testkit::TestCluster;

mod common;
use common::{code, connect_as_superuser, first_value, BIN};
use rand::{Rng, SeedableRng};

/// Key values, as SQL producing `k` rows of the type.
const KEYS: &[(KeyType, &str, &str)] = &[
    (
        KeyType::Int4,
        "integer",
        "SELECT g FROM generate_series(-1000, 1000) g \
         UNION ALL VALUES (2147483647), (-2147483648), (65536), (-65537)",
    ),
    (
        KeyType::Int8,
        "bigint",
        "SELECT g * 7919 FROM generate_series(-500, 500) g \
         UNION ALL VALUES (9223372036854775807), (-9223372036854775808), (4294967296), \
         (-4294967297), (4294967295), (-1)",
    ),
    (
        KeyType::Int2,
        "smallint",
        "SELECT g::smallint FROM generate_series(-300, 300) g \
         UNION ALL VALUES (32767::smallint), ((-32768)::smallint)",
    ),
    (
        KeyType::Text,
        "text",
        // Every tail length of the hash, multi-byte characters, the empty string.
        "SELECT md5(g::text) || repeat('x', g % 29) FROM generate_series(1, 400) g \
         UNION ALL SELECT repeat('é', g) FROM generate_series(0, 20) g \
         UNION ALL VALUES ('a'), ('pgherd'), ('Ünïcödé ☃')",
    ),
    (
        KeyType::Uuid,
        "uuid",
        "SELECT md5(g::text)::uuid FROM generate_series(1, 400) g",
    ),
];

#[test]
fn hash_shards_are_the_partitions_postgresql_chooses() {
    let cluster = TestCluster::start(0);
    let mut checked = 0;
    for &(key_type, sql_type, keys) in KEYS {
        for shards in [2u32, 3, 4, 7] {
            let table = format!("h_{}_{shards}", key_type.name());
            cluster.sql(&format!(
                "CREATE TABLE {table} (k {sql_type}) PARTITION BY HASH (k)"
            ));
            for remainder in 0..shards {
                cluster.sql(&format!(
                    "CREATE TABLE {table}_p{remainder} PARTITION OF {table} \
                     FOR VALUES WITH (MODULUS {shards}, REMAINDER {remainder})"
                ));
            }
            cluster.sql(&format!("INSERT INTO {table} {keys}"));
            // A NULL key hashes to 0: the partition of remainder 0, as pgherd's shard 0.
            cluster.sql(&format!("INSERT INTO {table} VALUES (NULL)"));
            let null_partition = cluster.sql(&format!(
                "SELECT tableoid::regclass::text FROM {table} WHERE k IS NULL"
            ));
            assert_eq!(
                null_partition,
                format!("{table}_p{}", shard_of([], shards)),
                "NULL key"
            );
            let rows = cluster.sql(&format!(
                "SELECT tableoid::regclass::text, k::text FROM {table} WHERE k IS NOT NULL"
            ));
            for row in rows.lines() {
                let (partition, key) = row.split_once('|').expect("partition|key");
                let remainder: u32 = partition
                    .rsplit_once("_p")
                    .and_then(|(_, r)| r.parse().ok())
                    .unwrap_or_else(|| panic!("partition name {partition}"));
                let shard = shard_of_text(key_type, key, shards)
                    .unwrap_or_else(|e| panic!("{sql_type} {key:?}: {e}"));
                assert_eq!(
                    shard, remainder,
                    "{sql_type} key {key:?} over {shards}: PostgreSQL put it in partition {remainder}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 10_000, "only {checked} keys checked");
}

/// Random columns of integers or numerics split over three shards: `sum`, `count`, `min`,
/// `max` and `avg` merged from each shard's own answers equal PostgreSQL's over all the rows,
/// text for text (so the average's scale too).
#[test]
fn aggregates_merged_from_shards_are_postgresqls_over_all_rows() {
    let cluster = TestCluster::start(0);
    let seed: u64 = std::env::var("PGHERD_MERGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for case in 0..60 {
        let numeric = rng.gen_bool(0.5);
        let sql_type = if numeric { "numeric" } else { "integer" };
        let count = rng.gen_range(1..40);
        let values: Vec<String> = (0..count)
            .map(|_| {
                let whole = rng.gen_range(-1_000_000i64..1_000_000);
                match (numeric, rng.gen_range(0..4)) {
                    (false, _) | (true, 0) => whole.to_string(),
                    (true, places) => format!(
                        "{whole}.{:0places$}",
                        rng.gen_range(0..10u32.pow(places as u32)),
                        places = places
                    ),
                }
            })
            .collect();
        let shards: Vec<Vec<&String>> = {
            let mut shards = vec![Vec::new(), Vec::new(), Vec::new()];
            for v in &values {
                shards[rng.gen_range(0..3)].push(v);
            }
            shards
        };
        let aggregates = |rows: &[&String]| {
            let list = if rows.is_empty() {
                format!("SELECT NULL::{sql_type} WHERE false")
            } else {
                format!(
                    "VALUES {}",
                    rows.iter()
                        .map(|v| format!("({v}::{sql_type})"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            cluster.sql(&format!(
                "SELECT count(x), sum(x), min(x), max(x), avg(x) FROM ({list}) v(x)"
            ))
        };
        // What each shard answers to the rewritten statement: avg as sum, and its count.
        let sum_type = if numeric { 1700 } else { 20 };
        let min_type = if numeric { 1700 } else { 23 };
        let merger = Merger::new(
            Merge {
                hidden_columns: 1,
                grouping: Some(Grouping {
                    keys: vec![],
                    aggregates: vec![
                        (Column::Visible(0), Combine::Add),
                        (Column::Visible(1), Combine::Add),
                        (Column::Visible(2), Combine::Min),
                        (Column::Visible(3), Combine::Max),
                        (
                            Column::Visible(4),
                            Combine::Average {
                                count: Column::Hidden(0),
                            },
                        ),
                    ],
                }),
                ..Merge::default()
            },
            &[20, sum_type, min_type, min_type, sum_type, 20].map(|oid| ColumnType {
                oid,
                format: Format::Text,
            }),
            &[],
            &TextRules::bytewise(),
        )
        .expect("a merger");
        let field = |text: &str| (!text.is_empty()).then(|| text.as_bytes().to_vec());
        let rows: Vec<Vec<Option<Vec<u8>>>> = shards
            .iter()
            .map(|rows| {
                let answer = aggregates(rows);
                let f: Vec<&str> = answer.split('|').collect();
                // count, sum, min, max, sum (for avg), count (hidden)
                vec![
                    field(f[0]),
                    field(f[1]),
                    field(f[2]),
                    field(f[3]),
                    field(f[1]),
                    field(f[0]),
                ]
            })
            .collect();
        let merged = merger
            .finish(merger.combine(rows).expect("combined"))
            .expect("finished");
        let ours: Vec<String> = merged[0]
            .iter()
            .map(|v| {
                v.as_ref()
                    .map_or(String::new(), |b| String::from_utf8_lossy(b).into_owned())
            })
            .collect();
        let all: Vec<&String> = values.iter().collect();
        let theirs = aggregates(&all);
        assert_eq!(
            ours.join("|"),
            theirs,
            "case {case} ({sql_type} {values:?}); replay: PGHERD_MERGE_SEED={seed} cargo test -p pgherd --test sharding"
        );
    }
}

/// The test clusters' superuser, on `port` (a server or pgherd), in `database`.
/// A small differential test of the fan-out: rows hash-sharded over three databases and whole
/// in a fourth; each query planned by `merge_plan`, its shard statement run on the three, the
/// rows merged by `merge_rows`, equal to the query's answer over the whole table (in order,
/// where it has one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_queries_merge_to_the_single_node_answer() {
    use pgherd_route::merge_plan::plan_fan_out;
    use pgherd_route::merge_rows::Row;

    let cluster = TestCluster::start(0);
    let port = cluster.node("pg1").port;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut whole = Vec::new();
    let mut shards = [Vec::new(), Vec::new(), Vec::new()];
    for aid in 1..=300i64 {
        let bid = if aid % 23 == 0 {
            "NULL".to_owned()
        } else {
            (aid % 7).to_string()
        };
        let balance = if aid % 31 == 0 {
            "NULL".to_owned()
        } else {
            rng.gen_range(-5_000..5_000).to_string()
        };
        let row = format!("({aid}, {bid}, {balance}, 'f{}')", aid % 5);
        let shard = shard_of_text(KeyType::Int4, &aid.to_string(), 3).expect("a shard");
        shards[shard as usize].push(row.clone());
        whole.push(row);
    }
    let connect = async |database: &str| connect_as_superuser(port, database).await;
    let mut clients = Vec::new();
    for (name, rows) in [
        ("whole", &whole),
        ("s0", &shards[0]),
        ("s1", &shards[1]),
        ("s2", &shards[2]),
    ] {
        cluster.sql(&format!("CREATE DATABASE {name}"));
        let client = connect(name).await;
        client
            .batch_execute(&format!(
                "CREATE TABLE accounts (aid int PRIMARY KEY, bid int, abalance int, filler text);
                 INSERT INTO accounts VALUES {}",
                rows.join(", ")
            ))
            .await
            .expect("load");
        clients.push(client);
    }
    // Text rows and column types, as a fan-out reads them from a server.
    let run = async |client: &tokio_postgres::Client, sql: &str| -> (Vec<ColumnType>, Vec<Row>) {
        let statement = client.prepare(sql).await.expect("prepare");
        let types = statement
            .columns()
            .iter()
            .map(|c| ColumnType {
                oid: c.type_().oid(),
                format: Format::Text,
            })
            .collect();
        let rows = client
            .simple_query(sql)
            .await
            .expect("query")
            .into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                    (0..r.len())
                        .map(|i| r.get(i).map(|v| v.as_bytes().to_vec()))
                        .collect(),
                ),
                _ => None,
            })
            .collect();
        (types, rows)
    };
    let queries = [
        "SELECT aid, abalance FROM accounts ORDER BY abalance DESC, aid LIMIT 7 OFFSET 3",
        "SELECT bid, count(*), sum(abalance), min(abalance), max(abalance), avg(abalance) FROM accounts GROUP BY bid ORDER BY bid",
        "SELECT bid, avg(abalance) FROM accounts GROUP BY bid ORDER BY 2 DESC, 1 LIMIT 3",
        "SELECT count(*) FROM accounts GROUP BY bid ORDER BY 1",
        "SELECT DISTINCT bid FROM accounts ORDER BY bid",
        "SELECT count(DISTINCT aid), max(abalance), avg(abalance) FROM accounts",
        "SELECT * FROM accounts ORDER BY aid LIMIT 5",
        "SELECT aid FROM accounts WHERE abalance > 0 ORDER BY aid DESC LIMIT 4",
        "SELECT sum(abalance) AS total, bid FROM accounts GROUP BY bid ORDER BY total DESC NULLS LAST, bid",
        "SELECT abalance FROM accounts ORDER BY abalance NULLS FIRST, aid OFFSET 295",
        "SELECT bid, count(*), avg(abalance) FROM accounts GROUP BY bid HAVING count(*) > 42 AND avg(abalance) < 100 ORDER BY bid",
        "SELECT bid, sum(abalance) FROM accounts GROUP BY bid HAVING NOT (bid = 3) OR sum(abalance) > 1000.5 ORDER BY bid",
        // The shards must return LIMIT + OFFSET rows each.
        "SELECT aid FROM accounts ORDER BY aid LIMIT 2 OFFSET 20",
    ];
    for sql in queries {
        let parsed = pg_query::parse(sql).expect("parse");
        let Some(pg_query::NodeEnum::SelectStmt(select)) = parsed.protobuf.stmts[0]
            .stmt
            .as_ref()
            .and_then(|s| s.node.clone())
        else {
            panic!("{sql}: not a SELECT");
        };
        let plan =
            plan_fan_out(&select, "aid", &|_| false).unwrap_or_else(|e| panic!("{sql}: {e}"));
        let mut answers = Vec::new();
        for client in &clients[1..] {
            answers.push(run(client, &plan.shard_sql).await);
        }
        let first_rows: Vec<&Row> = answers
            .iter()
            .filter_map(|(_, rows)| rows.first())
            .collect();
        let merger = Merger::new(
            plan.merge.clone(),
            &answers[0].0,
            &first_rows,
            &TextRules::bytewise(),
        )
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
        let rows: Vec<Row> = if plan.merge.grouping.is_some() {
            merger
                .combine(answers.into_iter().flat_map(|(_, rows)| rows))
                .expect("combine")
        } else {
            merger
                .merge_sorted(
                    answers
                        .into_iter()
                        .map(|(_, rows)| rows.into_iter())
                        .collect(),
                )
                .collect::<Result<_, _>>()
                .expect("merge")
        };
        let merged = merger.finish(rows).expect("finish");
        let (_, expected) = run(&clients[0], sql).await;
        assert_eq!(merged, expected, "{sql}\nshards ran: {}", plan.shard_sql);
    }
}

/// Through a sharded endpoint (three one-node shards): schema changes reach every shard, rows
/// inserted through pgherd land on the shard their key hashes to, key-routed and fan-out
/// queries answer exactly what one node holding every row answers, settings follow the
/// session to each shard, and what cannot run exactly yet is refused with 0A000 while the
/// session goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_endpoint_answers_as_one_node_holding_every_row() {
    use pgherd_testkit::Pgherd;
    use tokio_postgres::SimpleQueryMessage;

    let shards = [
        TestCluster::start(0),
        TestCluster::start(0),
        TestCluster::start(0),
    ];
    let config = common::sharded_config(&shards, &[("accounts", "aid")]).proxy(&format!(
        "admin_users = [\"{}\"]",
        pgherd_testkit::SUPERUSER
    ));
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let connect = connect_as_superuser;
    let through = connect(pgherd.port, "postgres").await;
    shards[0].sql("CREATE DATABASE whole");
    let whole = connect(shards[0].node("pg1").port, "whole").await;
    let rows = async |client: &tokio_postgres::Client, sql: &str| {
        client.simple_query(sql).await.map(|messages| {
            messages
                .into_iter()
                .filter_map(|m| match m {
                    SimpleQueryMessage::Row(r) => Some(
                        (0..r.len())
                            .map(|i| r.get(i).map(str::to_owned))
                            .collect::<Vec<_>>(),
                    ),
                    _ => None,
                })
                .collect::<Vec<_>>()
        })
    };

    let schema = "CREATE TABLE accounts (aid int PRIMARY KEY, bid int, abalance int, filler text)";
    through
        .batch_execute(schema)
        .await
        .expect("DDL through pgherd");
    whole.batch_execute(schema).await.expect("DDL on the whole");
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut expected_per_shard = [0u32; 3];
    let mut values = Vec::new();
    for aid in 1..=240i32 {
        let bid = if aid % 19 == 0 {
            "NULL".to_owned()
        } else {
            (aid % 6).to_string()
        };
        let row = format!(
            "({aid}, {bid}, {}, 'f{}')",
            rng.gen_range(-3_000..3_000),
            aid % 4
        );
        through
            .batch_execute(&format!(
                "INSERT INTO accounts (aid, bid, abalance, filler) VALUES {row}"
            ))
            .await
            .unwrap_or_else(|e| panic!("insert {aid}: {e:?}"));
        expected_per_shard[shard_of_text(KeyType::Int4, &aid.to_string(), 3).unwrap() as usize] +=
            1;
        values.push(row);
    }
    whole
        .batch_execute(&format!(
            "INSERT INTO accounts VALUES {}",
            values.join(", ")
        ))
        .await
        .expect("load the whole");
    for (shard, cluster) in shards.iter().enumerate() {
        let count = cluster.sql("SELECT count(*) FROM accounts");
        assert_eq!(
            count,
            expected_per_shard[shard].to_string(),
            "rows on shard {shard}"
        );
    }

    // PGHERD_TEST_SEED replays a failing run's queries.
    let seed: u64 = std::env::var("PGHERD_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("generated queries from seed {seed} (PGHERD_TEST_SEED replays them)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut queries: Vec<(String, bool)> = [
        "SELECT aid, abalance FROM accounts ORDER BY abalance DESC, aid LIMIT 7 OFFSET 3",
        "SELECT bid, count(*), sum(abalance), min(abalance), max(abalance), avg(abalance) FROM accounts GROUP BY bid ORDER BY bid",
        "SELECT DISTINCT bid FROM accounts ORDER BY bid",
        "SELECT count(DISTINCT aid), max(abalance), avg(abalance) FROM accounts",
        "SELECT * FROM accounts ORDER BY aid LIMIT 5",
        "SELECT bid, count(*), avg(abalance) FROM accounts GROUP BY bid HAVING count(*) > 38 ORDER BY bid",
        "SELECT count(*) FROM accounts WHERE aid = 1 AND aid = 2",
        "SELECT 1 AS one, 'x' AS letter",
    ]
    .iter()
    .map(|q| (q.to_string(), true))
    .collect();
    for _ in 0..150 {
        let k = rng.gen_range(-5..250);
        let x = rng.gen_range(-3_000..3_000);
        let query = match rng.gen_range(0..7) {
            0 => (format!("SELECT aid, bid, abalance, filler FROM accounts WHERE aid = {k}"), true),
            1 => (
                format!(
                    "SELECT aid, abalance FROM accounts WHERE aid IN ({k}, {}, {}) ORDER BY aid",
                    k + 1,
                    rng.gen_range(1..240)
                ),
                true,
            ),
            2 => (
                format!("SELECT bid, count(*), sum(abalance), min(aid), max(abalance), avg(abalance) FROM accounts WHERE abalance > {x} GROUP BY bid ORDER BY bid NULLS FIRST"),
                true,
            ),
            3 => (
                format!(
                    "SELECT aid FROM accounts WHERE abalance < {x} ORDER BY abalance DESC, aid LIMIT {} OFFSET {}",
                    rng.gen_range(0..20),
                    rng.gen_range(0..10)
                ),
                true,
            ),
            4 => (format!("SELECT DISTINCT bid FROM accounts WHERE aid > {k}"), false),
            5 => (
                format!("SELECT count(*), sum(abalance) FROM accounts WHERE aid > {k} AND abalance < {x}"),
                true,
            ),
            _ => (format!("SELECT aid, filler FROM accounts WHERE abalance BETWEEN {x} AND {}", x + 200), false),
        };
        queries.push(query);
    }
    for (sql, ordered) in &queries {
        let mut got = rows(&through, sql)
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: {sql}: {e}"));
        let mut want = rows(&whole, sql).await.expect("the whole answers");
        if !ordered {
            got.sort();
            want.sort();
        }
        assert_eq!(got, want, "seed {seed}: {sql}");
    }

    // A key-routed write, read back; a setting carried to every shard's connection.
    through
        .batch_execute("UPDATE accounts SET abalance = 424242 WHERE aid = 77")
        .await
        .expect("key-routed UPDATE");
    let read = rows(&through, "SELECT abalance FROM accounts WHERE aid = 77").await;
    assert_eq!(read.unwrap(), vec![vec![Some("424242".to_owned())]]);
    through
        .batch_execute("SET application_name = 'sharded-test'")
        .await
        .expect("SET");
    for _ in 0..3 {
        let name = rows(&through, "SELECT current_setting('application_name')").await;
        assert_eq!(name.unwrap(), vec![vec![Some("sharded-test".to_owned())]]);
    }

    through
        .batch_execute("CREATE SEQUENCE order_ids")
        .await
        .expect("a sequence on every shard");
    for (sql, what) in [
        (
            "SELECT nextval('order_ids')",
            "may write outside the sharded tables",
        ),
        (
            "CREATE TEMP TABLE scratch (a int)",
            "stays on one server connection",
        ),
        (
            "COPY accounts TO STDOUT (FORMAT binary)",
            "format other than text or CSV",
        ),
        ("SELECT string_agg(filler, ',') FROM accounts", "string_agg"),
    ] {
        let e = through.batch_execute(sql).await.expect_err(sql);
        assert_eq!(code(&e), "0A000", "{sql}: {e}");
        let message = e
            .as_db_error()
            .map(|d| d.message().to_owned())
            .unwrap_or_default();
        assert!(message.contains(what), "{sql}: {message}");
    }
    // A write over several shards commits with two-phase commit, which these shards
    // (max_prepared_transactions = 0) refuse: PostgreSQL's own error, and no shard changed.
    let before = rows(&through, "SELECT sum(abalance) FROM accounts")
        .await
        .unwrap();
    let e = through
        .batch_execute("UPDATE accounts SET abalance = 0")
        .await
        .expect_err("no prepared transactions on these shards");
    assert_eq!(code(&e), "55000", "{e:?}");
    let after = rows(&through, "SELECT sum(abalance) FROM accounts")
        .await
        .unwrap();
    assert_eq!(before, after, "rolled back on every shard");
    // The extended protocol reaches the same rows.
    let by_key = through
        .query_one("SELECT abalance FROM accounts WHERE aid = $1", &[&5i32])
        .await
        .expect("a prepared statement through the sharded endpoint");
    let simple = first_value(&through, "SELECT abalance FROM accounts WHERE aid = 5")
        .await
        .unwrap();
    assert_eq!(by_key.get::<_, i32>(0).to_string(), simple);

    // A schema change some shard refuses says which shards applied it.
    shards[1].sql("CREATE TABLE only_here (a int)");
    let e = through
        .batch_execute("CREATE TABLE only_here (a int)")
        .await
        .expect_err("shard 1 has the table");
    assert_eq!(code(&e), "42P07", "{e}");
    let detail = e.as_db_error().and_then(|d| d.detail().map(str::to_owned));
    assert_eq!(detail.as_deref(), Some("on shard 1; shard 0 applied it"));
    // Shards run it in turn: the one after the failure was spared it.
    assert_eq!(
        shards[2].sql("SELECT to_regclass('only_here') IS NULL"),
        "t"
    );

    // COPY TO STDOUT reads every shard in turn as one COPY; a header line comes once.
    whole
        .batch_execute("UPDATE accounts SET abalance = 424242 WHERE aid = 77")
        .await
        .expect("the key-routed write above, on the whole");
    let copied = async |client: &tokio_postgres::Client, sql: &str| {
        use futures_util::TryStreamExt;
        let stream = client
            .copy_out(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
        let chunks: Vec<bytes::Bytes> = stream.try_collect().await.expect(sql);
        String::from_utf8(chunks.concat()).expect("text")
    };
    let mut sharded: Vec<String> = copied(&through, "COPY accounts TO STDOUT")
        .await
        .lines()
        .map(str::to_owned)
        .collect();
    let mut single: Vec<String> = copied(&whole, "COPY accounts TO STDOUT")
        .await
        .lines()
        .map(str::to_owned)
        .collect();
    sharded.sort();
    single.sort();
    assert_eq!(sharded.len(), 240);
    assert_eq!(sharded, single);
    let csv = copied(
        &through,
        "COPY (SELECT aid, filler FROM accounts WHERE abalance > 0) TO STDOUT WITH (FORMAT csv, HEADER)",
    )
    .await;
    let positive = first_value(&whole, "SELECT count(*) FROM accounts WHERE abalance > 0")
        .await
        .unwrap();
    assert_eq!(
        csv.lines().filter(|l| *l == "aid,filler").count(),
        1,
        "{csv}"
    );
    assert_eq!(csv.lines().next(), Some("aid,filler"));
    assert_eq!(
        csv.lines().count().to_string(),
        (positive.parse::<usize>().unwrap() + 1).to_string()
    );
    let one = copied(
        &through,
        "COPY (SELECT aid FROM accounts WHERE aid = 5) TO STDOUT",
    )
    .await;
    assert_eq!(one, "5\n");

    // One shard named by a hint or by pgherd.shard: reads see that shard's rows, as sent
    // (what could not be merged over the shards included); writes must have their rows there.
    let one = |shard: usize| vec![vec![Some(expected_per_shard[shard].to_string())]];
    let hinted = rows(
        &through,
        "/* pgherd:shard=2 */ SELECT count(*) FROM accounts",
    )
    .await;
    assert_eq!(hinted.unwrap(), one(2));
    let ranked = rows(
        &through,
        "/* pgherd:shard=1 */ SELECT max(r) FROM (SELECT row_number() OVER () AS r FROM accounts) s",
    )
    .await;
    assert_eq!(ranked.unwrap(), one(1));
    let on_2 = (1..=240)
        .find(|k: &i32| shard_of_text(KeyType::Int4, &k.to_string(), 3) == Ok(2))
        .unwrap();
    let on_0 = (1..=240)
        .find(|k: &i32| shard_of_text(KeyType::Int4, &k.to_string(), 3) == Ok(0))
        .unwrap();
    through
        .batch_execute("SET pgherd.shard = 2")
        .await
        .expect("SET pgherd.shard");
    assert_eq!(
        rows(&through, "SELECT count(*) FROM accounts")
            .await
            .unwrap(),
        one(2)
    );
    through
        .batch_execute(&format!(
            "UPDATE accounts SET filler = 'two' WHERE aid = {on_2}"
        ))
        .await
        .expect("a write whose row is on the named shard");
    let e = through
        .batch_execute(&format!(
            "UPDATE accounts SET filler = 'zero' WHERE aid = {on_0}"
        ))
        .await
        .expect_err("the row is on shard 0");
    assert_eq!(code(&e), "0A000", "{e}");
    assert!(format!("{e:?}").contains("rows are on shard 0"), "{e:?}");
    // A hint wins over the setting; a rolled back SET leaves the setting as it was.
    let hinted = rows(
        &through,
        "/* pgherd:shard=0 */ SELECT count(*) FROM accounts",
    )
    .await;
    assert_eq!(hinted.unwrap(), one(0));
    for sql in ["BEGIN", "SET pgherd.shard = 1", "ROLLBACK"] {
        through.batch_execute(sql).await.expect(sql);
    }
    assert_eq!(
        rows(&through, "SELECT count(*) FROM accounts")
            .await
            .unwrap(),
        one(2)
    );
    let shown = rows(&through, "SHOW pgherd.shard").await.unwrap();
    assert_eq!(shown, vec![vec![Some("2".to_owned())]]);
    for (sql, sqlstate) in [
        ("SET pgherd.shard = 3", "22023"),
        ("SET pgherd.shard = 'one'", "22023"),
        ("SET LOCAL pgherd.shard = 1", "0A000"),
        ("/* pgherd:shard=7 */ SELECT 1", "22023"),
        ("/* pgherd:shard=x */ SELECT 1", "22023"),
    ] {
        let e = through.batch_execute(sql).await.expect_err(sql);
        assert_eq!(code(&e), sqlstate, "{sql}: {e}");
    }
    through
        .batch_execute("RESET pgherd.shard")
        .await
        .expect("RESET pgherd.shard");
    // A shard that does not exist, from the startup packet: the statements it would place
    // fail, setting it again does not.
    let startup_named = common::connect(&format!(
        "host=127.0.0.1 port={} user={} password={} dbname=postgres options='-c pgherd.shard=9'",
        pgherd.port,
        pgherd_testkit::SUPERUSER,
        pgherd_testkit::SUPERUSER_PASSWORD
    ))
    .await;
    let e = startup_named
        .batch_execute("SELECT 1")
        .await
        .expect_err("shard 9");
    assert_eq!(code(&e), "22023", "{e:?}");
    startup_named
        .batch_execute("SET pgherd.shard = 1")
        .await
        .expect("set it again");
    let named = rows(&startup_named, "SELECT count(*) FROM accounts").await;
    assert_eq!(named.unwrap(), one(1));

    // The session carried on through all of it.
    let count = rows(&through, "SELECT count(*) FROM accounts")
        .await
        .unwrap();
    assert_eq!(count, vec![vec![Some("240".to_owned())]]);
}

/// A fan-out streams its rows: an ordered read of more rows than pgherd would hold for a
/// statement (its grouping bound, 64 MiB) is merged shard by shard as the client takes it,
/// and pgherd's peak memory grows by a fraction of what went through; a LIMIT ends the
/// stream early and the links still serve the next statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_streams_rows_it_does_not_hold() {
    use pgherd_testkit::Pgherd;
    use tokio_postgres::SimpleQueryMessage;

    let shards = [TestCluster::start(0), TestCluster::start(0)];
    let config = common::sharded_config(&shards, &[("big", "k")]);
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let through = connect_as_superuser(pgherd.port, "postgres").await;
    through
        .batch_execute("CREATE TABLE big (k int PRIMARY KEY, pad text)")
        .await
        .expect("create big");
    // 72 MB of rows, loaded on the shards directly (the merge does not read where keys hash).
    const ROWS: i32 = 60_000;
    for (shard, cluster) in shards.iter().enumerate() {
        cluster.sql(&format!(
            "INSERT INTO big SELECT g, repeat(chr(97 + g % 26), 1200) \
             FROM generate_series(1, {ROWS}) g WHERE g % 2 = {shard}"
        ));
    }
    let pid = pgherd.pid();
    let peak_before = common::proc_status_kib(pid, "VmHWM");
    let messages = through
        .simple_query("SELECT k, pad FROM big ORDER BY k DESC")
        .await
        .expect("an ordered fan-out of 72 MB");
    let peak_after = common::proc_status_kib(pid, "VmHWM");
    let keys: Vec<i32> = messages
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).and_then(|k| k.parse().ok()),
            _ => None,
        })
        .collect();
    assert_eq!(keys.len(), ROWS as usize);
    assert!(keys.windows(2).all(|w| w[0] == w[1] + 1), "merged in order");
    let grown_mib = peak_after.saturating_sub(peak_before) / 1024;
    eprintln!("peak memory grew by {grown_mib} MiB ({peak_before} -> {peak_after} KiB)");
    assert!(
        grown_mib < 24,
        "pgherd's peak memory grew by {grown_mib} MiB for 72 MB of rows"
    );

    for (sql, want) in [
        (
            "SELECT k FROM big ORDER BY k LIMIT 3 OFFSET 2",
            vec![3, 4, 5],
        ),
        (
            "SELECT DISTINCT k % 3 AS r FROM big ORDER BY r",
            vec![0, 1, 2],
        ),
    ] {
        let got: Vec<i32> = through
            .simple_query(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
            .iter()
            .filter_map(|m| match m {
                SimpleQueryMessage::Row(r) => r.get(0).and_then(|k| k.parse().ok()),
                _ => None,
            })
            .collect();
        assert_eq!(got, want, "{sql}");
    }
    let unordered = through
        .simple_query("SELECT k FROM big WHERE k % 1000 = 0")
        .await
        .expect("an unordered fan-out");
    let rows = unordered
        .iter()
        .filter(|m| matches!(m, SimpleQueryMessage::Row(_)))
        .count();
    assert_eq!(rows, (ROWS / 1000) as usize);
    // A shard's error ends the stream with it; the session carries on.
    let e = through
        .simple_query("SELECT k, 1 / (k - 59999) FROM big ORDER BY k")
        .await
        .expect_err("division by zero on shard 1");
    assert_eq!(code(&e), "22012", "{e:?}");
    assert_eq!(first_value(&through, "SELECT 1").await.unwrap(), "1");

    // A cancel reaches every shard of the statement: each sleeps on its one row until then.
    let token = through.cancel_token();
    let sleeping = tokio::spawn(async move {
        through
            .simple_query("SELECT k FROM big WHERE k < 3 AND pg_sleep(600) IS NOT NULL ORDER BY k")
            .await
            .map(|_| through)
    });
    let asleep = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%pg_sleep(600)%' AND pid <> pg_backend_pid()";
    for cluster in &shards {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while cluster.sql(asleep) != "1" {
            assert!(
                std::time::Instant::now() < deadline,
                "the shard never ran it"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    token
        .cancel_query(tokio_postgres::NoTls)
        .await
        .expect("cancel");
    let cancelled = tokio::time::timeout(std::time::Duration::from_secs(60), sleeping)
        .await
        .expect("every shard's statement ended (a shard not cancelled sleeps 600 s)")
        .unwrap();
    let e = cancelled.expect_err("cancelled");
    assert_eq!(code(&e), "57014", "{e:?}");
}
