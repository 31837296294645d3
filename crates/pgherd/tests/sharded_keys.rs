//! Range and list sharding against real shards: rows go where their keys' ranges and lists
//! say (read on each shard directly), reads by key run there, key-less ones merge; a key no
//! shard takes is PostgreSQL's 23514; and the shards as the admin console and the HTTP API
//! show them.

mod common;

use common::{code, connect_as_superuser, field, first_value, rows, shard_cluster, BIN};
use pgherd_testkit::{Pgherd, SUPERUSER};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn range_and_list_keys_place_rows_on_their_shards() {
    let shards = [shard_cluster(), shard_cluster()];
    let api_port = pgherd_cluster::free_port().expect("free port");
    let config = common::sharded_config(&shards, &[])
        .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
        .section(
            "[[sharding.tables]]\ntable = \"events\"\ncolumn = \"id\"\ntype = \"bigint\"\n\
             method = \"range\"\nstarts = [0, 1000]\n\
             [[sharding.tables]]\ntable = \"regions\"\ncolumn = \"code\"\ntype = \"text\"\n\
             method = \"list\"\nvalues = [[\"eu\", \"uk\"], [\"us\", \"ca\"]]\n",
        )
        .section(&format!("[api]\nlisten = [\"127.0.0.1:{api_port}\"]"));
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let client = connect_as_superuser(pgherd.port, "postgres").await;
    client
        .batch_execute(
            "CREATE TABLE events (id bigint PRIMARY KEY, v int);
             CREATE TABLE regions (code text PRIMARY KEY, name text)",
        )
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO events (id, v) VALUES (0, 1), (999, 2), (1000, 3), (123456789012, 4);
             INSERT INTO regions (code, name) VALUES ('eu', 'Europe'), ('us', 'States'), ('uk', 'Kingdom'), ('ca', 'Canada')",
        )
        .await
        .unwrap();
    let on = |shard: usize, sql: &str| shards[shard].sql(sql);
    assert_eq!(
        on(
            0,
            "SELECT string_agg(id::text, ',' ORDER BY id) FROM events"
        ),
        "0,999"
    );
    assert_eq!(
        on(
            1,
            "SELECT string_agg(id::text, ',' ORDER BY id) FROM events"
        ),
        "1000,123456789012"
    );
    assert_eq!(
        on(0, "SELECT string_agg(code, ',' ORDER BY code) FROM regions"),
        "eu,uk"
    );
    assert_eq!(
        on(1, "SELECT string_agg(code, ',' ORDER BY code) FROM regions"),
        "ca,us"
    );

    // Reads by key run on the key's shard: a row written behind pgherd's back on the other
    // shard is not seen.
    on(0, "INSERT INTO events VALUES (5000, 99)");
    assert_eq!(
        first_value(&client, "SELECT count(*) FROM events WHERE id = 5000")
            .await
            .unwrap(),
        "0"
    );
    assert_eq!(
        first_value(&client, "SELECT v FROM events WHERE id = 1000")
            .await
            .unwrap(),
        "3"
    );
    assert_eq!(
        first_value(&client, "SELECT name FROM regions WHERE code = 'ca'")
            .await
            .unwrap(),
        "Canada"
    );
    on(0, "DELETE FROM events WHERE id = 5000");
    // Key-less reads merge, in order.
    assert_eq!(
        first_value(
            &client,
            "SELECT string_agg(code, ',') FROM (SELECT code FROM regions ORDER BY name) s"
        )
        .await
        .map_err(|e| code(&e)),
        Err("0A000".to_owned()),
        "a subquery over a sharded table is refused, not merged wrongly"
    );
    let listed = client
        .simple_query("SELECT code FROM regions ORDER BY name DESC")
        .await
        .unwrap();
    let codes: Vec<String> = listed
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect();
    assert_eq!(codes, ["us", "uk", "eu", "ca"]);
    assert_eq!(
        first_value(&client, "SELECT sum(v) FROM events")
            .await
            .unwrap(),
        "10"
    );
    // A key no shard takes: PostgreSQL's "no partition" error, nothing written.
    for (sql, what) in [
        (
            "INSERT INTO events (id, v) VALUES (-1, 0)",
            "below the first range",
        ),
        (
            "INSERT INTO regions (code, name) VALUES ('fr', 'France')",
            "in no list",
        ),
    ] {
        let refused = client.simple_query(sql).await.expect_err(what);
        assert_eq!(code(&refused), "23514", "{what}: {refused:?}");
    }
    assert_eq!(
        first_value(&client, "SELECT count(*) FROM regions")
            .await
            .unwrap(),
        "4"
    );

    // The shards on the console and the HTTP API.
    let console = connect_as_superuser(pgherd.port, "pgherd").await;
    let shown = rows(&console, "SHOW SHARDS").await.unwrap();
    assert_eq!(shown.len(), 2, "{shown:?}");
    for (i, row) in shown.iter().enumerate() {
        assert_eq!(field(row, "shard"), i.to_string());
        assert_eq!(field(row, "port"), shards[i].primary().port.to_string());
        assert_eq!(field(row, "takes_writes"), "yes");
        let tables = field(row, "sharded_tables");
        assert!(
            tables.contains("events(id range)") && tables.contains("regions(code list)"),
            "{tables}"
        );
    }
    let body = ureq::get(&format!("http://127.0.0.1:{api_port}/api/shards"))
        .call()
        .expect("GET /api/shards")
        .into_string()
        .unwrap();
    let json: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let listed: Vec<(u64, u64)> = json
        .as_array()
        .expect("an array")
        .iter()
        .map(|row| {
            (
                row["shard"].as_u64().expect("shard"),
                row["port"].as_u64().expect("port"),
            )
        })
        .collect();
    let expected: Vec<(u64, u64)> = (0..2)
        .map(|i| (i as u64, u64::from(shards[i].primary().port)))
        .collect();
    assert_eq!(listed, expected, "{body}");
}
