//! The extended query protocol through a sharded endpoint against real shards: prepared
//! statements placed by keys bound as parameters (binary and text), fan-outs with bound values
//! and binary rows, split INSERTs with parameters, transactions begun and ended by prepared
//! statements, several Executes before one Sync committed or rolled back as one, portals read
//! a few rows at a time, and PostgreSQL's errors for what is missing.

mod common;

use bytes::BytesMut;
use common::{bind_text as bind, shard_cluster};
use common::{code, connect_as_superuser, BIN};
use pgherd_route::shard_hash::{shard_of_text, KeyType};
use pgherd_testkit::raw::{errors, first_column, Message, RawClient};
use pgherd_testkit::{Pgherd, PgherdConfig, TestCluster, SUPERUSER};
use pgherd_wire::backend::tag as btag;
use pgherd_wire::frontend;

const SHARDS: u32 = 2;

fn config(shards: &[TestCluster]) -> PgherdConfig {
    common::sharded_config(shards, &[("accounts", "aid")])
}

fn shard_of(aid: i32) -> usize {
    shard_of_text(KeyType::Int4, &aid.to_string(), SHARDS).unwrap() as usize
}

/// The first key from `from` on each shard.
fn keys_on_each_shard(from: i32) -> (i32, i32) {
    let on = |shard: usize| (from..).find(|k| shard_of(*k) == shard).unwrap();
    (on(0), on(1))
}

/// The keys shard `i` holds, read directly.
fn keys_on(shards: &[TestCluster], i: usize) -> String {
    shards[i].sql("SELECT coalesce(string_agg(aid::text, ',' ORDER BY aid), '') FROM accounts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_run_where_their_keys_are_and_fan_out_exactly() {
    let shards = [shard_cluster(), shard_cluster()];
    let pgherd = Pgherd::start(BIN, &shards[0], &config(&shards));
    let client = connect_as_superuser(pgherd.port, "postgres").await;
    client
        .batch_execute(
            "CREATE TABLE accounts (aid int PRIMARY KEY, abalance int NOT NULL, name text)",
        )
        .await
        .unwrap();
    // tokio-postgres prepares (Parse, Describe) and binds values and rows in binary.
    let insert = client
        .prepare("INSERT INTO accounts (aid, abalance, name) VALUES ($1, $2, $3)")
        .await
        .unwrap();
    for aid in 1..=40i32 {
        let name = format!("n{aid}");
        client
            .execute(&insert, &[&aid, &(aid * 10), &name])
            .await
            .unwrap();
    }
    for i in 0..2 {
        let expected: Vec<String> = (1..=40)
            .filter(|k| shard_of(*k) == i)
            .map(|k| k.to_string())
            .collect();
        assert_eq!(keys_on(&shards, i), expected.join(","), "shard {i}");
    }

    let select = client
        .prepare("SELECT abalance, name FROM accounts WHERE aid = $1")
        .await
        .unwrap();
    for aid in [1, 17, 40] {
        let row = client.query_one(&select, &[&aid]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), aid * 10);
        assert_eq!(row.get::<_, String>(1), format!("n{aid}"));
    }
    assert!(client.query(&select, &[&41i32]).await.unwrap().is_empty());

    // Keys on both shards, and key-less reads, fan out and merge, in binary.
    let (k0, k1) = keys_on_each_shard(1);
    let rows = client
        .query(
            "SELECT aid FROM accounts WHERE aid IN ($1, $2) ORDER BY aid",
            &[&k0, &k1],
        )
        .await
        .unwrap();
    let got: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(got, vec![k0.min(k1), k0.max(k1)]);
    let row = client
        .query_one(
            "SELECT count(*), sum(abalance), max(aid) FROM accounts WHERE abalance >= $1",
            &[&100i32],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 31);
    assert_eq!(
        row.get::<_, i64>(1),
        (10..=40).map(|k| i64::from(k) * 10).sum::<i64>()
    );
    assert_eq!(row.get::<_, i32>(2), 40);
    let rows = client
        .query(
            "SELECT aid FROM accounts WHERE abalance > $1 ORDER BY aid DESC LIMIT 3 OFFSET 2",
            &[&0i32],
        )
        .await
        .unwrap();
    let got: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(got, vec![38, 37, 36]);
    let rows = client
        .query(
            "SELECT abalance % 3 AS r, count(*) FROM accounts WHERE aid <= $1 GROUP BY 1 ORDER BY 1",
            &[&30i32],
        )
        .await
        .unwrap();
    let got: Vec<(i32, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(got, vec![(0, 10), (1, 10), (2, 10)]);
    // Numeric sums and averages merge in binary, byte for byte as one server sends them.
    let row = client
        .query_one(
            "SELECT sum(abalance::int8), avg(abalance), avg(abalance::numeric / 7) FROM accounts",
            &[],
        )
        .await
        .unwrap();
    let whole =
        "SELECT sum(v::int8), avg(v), avg(v::numeric / 7) FROM generate_series(10, 400, 10) v";
    for i in 0..3 {
        let expected = shards[0].sql(&format!(
            "SELECT numeric_send(s.v{}) FROM ({whole}) s(v1, v2, v3)",
            i + 1
        ));
        let got = row.get::<_, RawNumeric>(i).0;
        assert_eq!(format!("\\x{}", hex(&got)), expected, "column {i}");
    }
    // What has no exact merge is refused as on the simple protocol.
    let refused = client
        .query("SELECT stddev(abalance) FROM accounts", &[])
        .await
        .expect_err("no exact merge");
    assert_eq!(code(&refused), "0A000", "{refused:?}");

    // A multi-row INSERT with parameters is split, every shard told every parameter's type.
    let (a, b) = keys_on_each_shard(100);
    let rows = client
        .query(
            "INSERT INTO accounts (aid, abalance, name) VALUES ($1, $2, 'a'), ($3, $2, $4) RETURNING aid, name",
            &[&b, &5i32, &a, &"b"],
        )
        .await
        .unwrap();
    let got: Vec<(i32, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(got, vec![(b, "a".into()), (a, "b".into())]);
    assert!(keys_on(&shards, shard_of(a)).contains(&a.to_string()));
    assert!(keys_on(&shards, shard_of(b)).contains(&b.to_string()));

    // BEGIN and COMMIT as prepared statements: one transaction over both shards.
    let update = client
        .prepare("UPDATE accounts SET abalance = abalance + $2 WHERE aid = $1")
        .await
        .unwrap();
    client.execute("BEGIN", &[]).await.unwrap();
    client.execute(&update, &[&k0, &1000i32]).await.unwrap();
    client.execute(&update, &[&k1, &1000i32]).await.unwrap();
    client.execute("ROLLBACK", &[]).await.unwrap();
    client.execute("BEGIN", &[]).await.unwrap();
    client.execute(&update, &[&k0, &1i32]).await.unwrap();
    client.execute(&update, &[&k1, &1i32]).await.unwrap();
    client.execute("COMMIT", &[]).await.unwrap();
    for k in [k0, k1] {
        let balance =
            shards[shard_of(k)].sql(&format!("SELECT abalance FROM accounts WHERE aid = {k}"));
        assert_eq!(balance, (k * 10 + 1).to_string(), "key {k}");
    }

    // A key bound as another type compares across types: a read asks every shard (never the
    // shard the bytes would hash to as an integer), a write is refused.
    let as_double = client
        .prepare_typed(
            "SELECT abalance FROM accounts WHERE aid = $1",
            &[tokio_postgres::types::Type::FLOAT8],
        )
        .await
        .unwrap();
    let row = client.query_one(&as_double, &[&17.0f64]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 170);
    let insert_double = client
        .prepare_typed(
            "INSERT INTO accounts (aid, abalance) VALUES ($1, 0)",
            &[tokio_postgres::types::Type::FLOAT8],
        )
        .await
        .unwrap();
    let refused = client
        .execute(&insert_double, &[&1000.0f64])
        .await
        .expect_err("a key as a double");
    assert_eq!(code(&refused), "0A000", "{refused:?}");

    // A statement the shards refuse is refused as PostgreSQL refuses it; the session goes on.
    let missing = client
        .prepare("SELECT * FROM missing WHERE aid = $1")
        .await
        .expect_err("no such table");
    assert_eq!(code(&missing), "42P01", "{missing:?}");
    let bad_key = client
        .query(
            "SELECT * FROM accounts WHERE aid = $1::text::int",
            &[&"seven"],
        )
        .await
        .expect_err("not an integer");
    assert_eq!(code(&bad_key), "22P02", "{bad_key:?}");
    let row = client.query_one(&select, &[&k0]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), k0 * 10 + 1);

    // DEALLOCATE and DISCARD, answered by pgherd, which keeps the session's statements and
    // settings: what is deallocated is gone, DISCARD ALL forgets every statement and the
    // settings, and is refused inside a transaction block, as PostgreSQL does.
    client
        .batch_execute("DEALLOCATE ALL")
        .await
        .expect("DEALLOCATE ALL");
    let gone = client
        .query_one(&select, &[&k0])
        .await
        .expect_err("deallocated");
    assert_eq!(code(&gone), "26000", "{gone:?}");
    let missing = client
        .batch_execute("DEALLOCATE nosuch")
        .await
        .expect_err("no such statement");
    assert_eq!(code(&missing), "26000", "{missing:?}");
    let kept = client
        .prepare("SELECT abalance FROM accounts WHERE aid = $1")
        .await
        .unwrap();
    client
        .batch_execute("SET application_name = 'before-discard'")
        .await
        .unwrap();
    for tag in ["DISCARD PLANS", "DISCARD SEQUENCES", "DISCARD TEMP"] {
        client.batch_execute(tag).await.expect(tag);
    }
    client.batch_execute("BEGIN").await.unwrap();
    let in_block = client
        .batch_execute("DISCARD ALL")
        .await
        .expect_err("DISCARD ALL in a block");
    assert_eq!(code(&in_block), "25001", "{in_block:?}");
    client.batch_execute("ROLLBACK").await.unwrap();
    client
        .batch_execute("DISCARD ALL")
        .await
        .expect("DISCARD ALL");
    let name_now = client
        .query_one("SELECT current_setting('application_name')", &[])
        .await
        .unwrap();
    assert_eq!(name_now.get::<_, String>(0), "");
    let discarded = client
        .query_one(&kept, &[&k0])
        .await
        .expect_err("discarded");
    assert_eq!(code(&discarded), "26000", "{discarded:?}");
    client
        .batch_execute("DEALLOCATE ALL")
        .await
        .expect("DEALLOCATE ALL");
}

/// Parse (unnamed, types left to the server), then a Bind and Execute per value, then Sync.
fn batch(sql: &str, values: &[Option<&str>]) -> BytesMut {
    let mut out = BytesMut::new();
    frontend::encode_parse(&mut out, b"", sql.as_bytes(), &[0, 0]).unwrap();
    for value in values {
        bind(&mut out, b"", &[*value]);
        frontend::encode_execute(&mut out, b"", 0).unwrap();
    }
    frontend::encode_sync(&mut out);
    out
}

/// Parse, Bind, Execute and Sync of a statement without parameters.
fn unbound(sql: &str) -> BytesMut {
    let mut out = BytesMut::new();
    frontend::encode_parse(&mut out, b"", sql.as_bytes(), &[0, 0]).unwrap();
    bind(&mut out, b"", &[]);
    frontend::encode_execute(&mut out, b"", 0).unwrap();
    frontend::encode_sync(&mut out);
    out
}

fn tags(messages: &[Message]) -> String {
    messages.iter().map(|m| m.0 as char).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executes_before_one_sync_are_one_transaction_and_portals_suspend() {
    let shards = [shard_cluster(), shard_cluster()];
    let pgherd = Pgherd::start(BIN, &shards[0], &config(&shards));
    let port = pgherd.port;
    let client = connect_as_superuser(port, "postgres").await;
    client
        .batch_execute(
            "CREATE TABLE accounts (aid int PRIMARY KEY, abalance int NOT NULL DEFAULT 0)",
        )
        .await
        .unwrap();
    let (k0, k1) = keys_on_each_shard(1);
    let (k0, k1) = (k0.to_string(), k1.to_string());
    let password = pgherd_testkit::SUPERUSER_PASSWORD;
    tokio::task::spawn_blocking(move || {
        let mut raw = RawClient::login(port, SUPERUSER, "postgres", password).expect("login");
        let insert = "INSERT INTO accounts (aid) VALUES ($1)";
        // Rows for both shards, then a duplicate: nothing of the batch stays.
        raw.send(&batch(insert, &[Some(&k0), Some(&k1), Some(&k1)]));
        let answer = raw.recv_until_ready();
        assert_eq!(tags(&answer), "12C2C2EZ", "{answer:?}");
        assert_eq!(errors(&answer)[0].code.to_string(), "23505", "{answer:?}");
        assert_eq!(answer.last().unwrap().1, b"I");
        let count = raw.query("SELECT count(*) FROM accounts");
        assert_eq!(first_column(&count), vec!["0".to_owned()]);
        // Without the duplicate, both rows commit at the Sync.
        raw.send(&batch(insert, &[Some(&k0), Some(&k1)]));
        let answer = raw.recv_until_ready();
        assert_eq!(tags(&answer), "12C2CZ", "{answer:?}");
        let count = raw.query("SELECT count(*) FROM accounts");
        assert_eq!(first_column(&count), vec!["2".to_owned()]);
        // After an error, what comes before the Sync is ignored. (pgherd reads a statement at
        // its Execute, PostgreSQL at its Parse: the error comes before the Sync all the same.)
        let mut out = unbound("SELECT * FROM missing");
        out.extend_from_slice(&unbound("SELECT 1"));
        raw.send(&out);
        let failed = raw.recv_until_ready();
        assert_eq!(tags(&failed), "12EZ", "{failed:?}");
        let next = raw.recv_until_ready();
        assert_eq!(tags(&next), "12DCZ", "{next:?}");
        // A protocol-level statement is DEALLOCATEd by its name, as on PostgreSQL.
        let mut out = BytesMut::new();
        frontend::encode_parse(&mut out, b"byname", b"SELECT 1", &[0, 0]).unwrap();
        frontend::encode_sync(&mut out);
        raw.send(&out);
        assert_eq!(tags(&raw.recv_until_ready()), "1Z");
        assert_eq!(tags(&raw.query("DEALLOCATE byname")), "CZ");
        let mut out = BytesMut::new();
        bind(&mut out, b"byname", &[]);
        frontend::encode_sync(&mut out);
        raw.send(&out);
        let unbound = raw.recv_until_ready();
        assert_eq!(errors(&unbound)[0].code.to_string(), "26000", "{unbound:?}");
        // DISCARD ALL reports the parameters it resets, as a server does.
        raw.query("SET application_name = 'raw-app'");
        let discarded = raw.query("DISCARD ALL");
        let reported: Vec<String> = discarded
            .iter()
            .filter(|m| m.0 == b'S')
            .map(|m| String::from_utf8_lossy(&m.1).replace('\0', "="))
            .collect();
        let last_name = reported
            .iter()
            .rev()
            .find(|p| p.starts_with("application_name="));
        assert!(
            last_name.is_some_and(|p| !p.contains("raw-app")),
            "{reported:?}"
        );
        assert!(tags(&discarded).ends_with("CZ"), "{discarded:?}");
        (k0, k1)
    })
    .await
    .unwrap();
    for shard in &shards {
        assert_eq!(shard.sql("SELECT count(*) FROM accounts"), "1");
    }
    client
        .batch_execute(
            "INSERT INTO accounts (aid) VALUES (100), (101), (102), (103), (104), (105), (106), (107), (108), (109)",
        )
        .await
        .unwrap();
    tokio::task::spawn_blocking(move || {
        let mut raw = RawClient::login(port, SUPERUSER, "postgres", password).expect("login");
        // A named statement described: its parameters and columns, as a shard says.
        let mut out = BytesMut::new();
        let sql = "SELECT aid FROM accounts WHERE aid >= $1 ORDER BY aid";
        frontend::encode_parse(&mut out, b"ordered", sql.as_bytes(), &[0, 0]).unwrap();
        frontend::encode_describe(&mut out, frontend::Target::Statement, b"ordered").unwrap();
        frontend::encode_sync(&mut out);
        raw.send(&out);
        let described = raw.recv_until_ready();
        assert_eq!(tags(&described), "1tTZ", "{described:?}");
        // Read four rows at a time from a fan-out, in one transaction.
        let mut out = BytesMut::new();
        frontend::encode_query(&mut out, b"BEGIN").unwrap();
        raw.send(&out);
        raw.recv_until_ready();
        let mut out = BytesMut::new();
        bind(&mut out, b"ordered", &[Some("100")]);
        frontend::encode_describe(&mut out, frontend::Target::Portal, b"").unwrap();
        for _ in 0..3 {
            frontend::encode_execute(&mut out, b"", 4).unwrap();
        }
        frontend::encode_sync(&mut out);
        raw.send(&out);
        let answer = raw.recv_until_ready();
        assert_eq!(tags(&answer), "2TDDDDsDDDDsDDCZ", "{answer:?}");
        let rows: Vec<String> = answer
            .iter()
            .filter(|m| m.0 == btag::DATA_ROW)
            .collect::<Vec<_>>()
            .iter()
            .flat_map(|m| first_column(std::slice::from_ref(*m)))
            .collect();
        let expected: Vec<String> = (100..110).map(|k| k.to_string()).collect();
        assert_eq!(rows, expected);
        let last = answer
            .iter()
            .rfind(|m| m.0 == btag::COMMAND_COMPLETE)
            .unwrap();
        assert_eq!(last.1, b"SELECT 2\0");
        assert_eq!(answer.last().unwrap().1, b"T");
        // Statements and portals PostgreSQL would not know.
        let mut out = BytesMut::new();
        bind(&mut out, b"nameless", &[]);
        frontend::encode_sync(&mut out);
        raw.send(&out);
        let answer = raw.recv_until_ready();
        assert_eq!(errors(&answer)[0].code.to_string(), "26000", "{answer:?}");
        assert_eq!(answer.last().unwrap().1, b"E");
        raw.query("ROLLBACK");
        let mut out = BytesMut::new();
        frontend::encode_execute(&mut out, b"gone", 0).unwrap();
        frontend::encode_sync(&mut out);
        raw.send(&out);
        let answer = raw.recv_until_ready();
        assert_eq!(errors(&answer)[0].code.to_string(), "34000", "{answer:?}");
    })
    .await
    .unwrap();
}

/// A numeric's bytes as the server sent them in binary.
struct RawNumeric(Vec<u8>);

impl<'a> tokio_postgres::types::FromSql<'a> for RawNumeric {
    fn from_sql(
        _: &tokio_postgres::types::Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(RawNumeric(raw.to_vec()))
    }

    fn accepts(ty: &tokio_postgres::types::Type) -> bool {
        *ty == tokio_postgres::types::Type::NUMERIC
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
