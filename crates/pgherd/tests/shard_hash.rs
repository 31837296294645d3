//! pgherd's hash shards agree with PostgreSQL's `PARTITION BY HASH`: for keys of each type
//! pgherd shards by, over several shard counts, the partition a real PostgreSQL 15 puts a row
//! in is the shard `pgherd_route::shard_hash` computes.

use pgherd_route::shard_hash::{shard_of, shard_of_text, KeyType};
use pgherd_testkit::TestCluster;

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
