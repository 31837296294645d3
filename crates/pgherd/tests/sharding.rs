//! The pure pieces of sharding checked against a real PostgreSQL 15: hash shards agree with
//! `PARTITION BY HASH` (for keys of each type pgherd shards by, over several shard counts, the
//! partition PostgreSQL puts a row in is the shard `pgherd_route::shard_hash` computes), and
//! aggregates merged from per-shard results (`pgherd_route::merge_rows`) are what PostgreSQL
//! computes over all the rows.

use pgherd_route::merge_plan::{Column, Combine, Grouping, Merge};
use pgherd_route::merge_rows::{ColumnType, Format, Merger};
use pgherd_route::shard_hash::{shard_of, shard_of_text, KeyType};
use pgherd_testkit::TestCluster;
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
                        (0, Combine::Add),
                        (1, Combine::Add),
                        (2, Combine::Min),
                        (3, Combine::Max),
                        (
                            4,
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
            false,
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
