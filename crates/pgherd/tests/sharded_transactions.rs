//! Transactions through a sharded endpoint against real shards: a transaction over two shards
//! commits on both or on neither (two-phase commit, whichever shard refuses), errors abort it
//! as PostgreSQL does, a write over several shards outside a block is one transaction, and a
//! pgherd killed between the phases leaves nothing in doubt once it runs again.

mod common;

use std::time::{Duration, Instant};

use common::shard_cluster;
use common::{code, connect_as_superuser, psql_with_input, BIN};
use pgherd_route::shard_hash::{shard_of_text, KeyType};
use pgherd_testkit::{Pgherd, PgherdConfig, TestCluster};
use tokio_postgres::{Client, SimpleQueryMessage};

const SHARDS: u32 = 2;

fn config(shards: &[TestCluster]) -> PgherdConfig {
    common::sharded_config(shards, &[("accounts", "aid"), ("deferred", "aid")])
}

/// The first keys above `from` that live on shard 0 and on shard 1.
fn keys_on_each_shard(from: i32) -> (i32, i32) {
    let on = |shard: u32| {
        (from..)
            .find(|k| shard_of_text(KeyType::Int4, &k.to_string(), SHARDS) == Ok(shard))
            .unwrap()
    };
    (on(0), on(1))
}

async fn run(client: &Client, sql: &str) -> Result<Vec<SimpleQueryMessage>, tokio_postgres::Error> {
    client.simple_query(sql).await
}

async fn ok(client: &Client, sql: &str) {
    if let Err(e) = run(client, sql).await {
        panic!("{sql}: {e:?}");
    }
}

async fn ok_all(client: &Client, statements: &[String]) {
    for sql in statements {
        ok(client, sql).await;
    }
}

/// The first column of every row answered (NULLs left out).
fn first_column(messages: &[SimpleQueryMessage]) -> Vec<String> {
    messages
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect()
}

/// The command tag's row count of the last statement.
fn count(messages: &[SimpleQueryMessage]) -> u64 {
    messages
        .iter()
        .rev()
        .find_map(|m| match m {
            SimpleQueryMessage::CommandComplete(n) => Some(*n),
            _ => None,
        })
        .unwrap_or(u64::MAX)
}

/// What shard `i` holds, read directly.
fn on_shard(shards: &[TestCluster], i: usize, sql: &str) -> String {
    shards[i].sql(sql)
}

fn prepared_left(shards: &[TestCluster]) -> Vec<String> {
    (0..shards.len())
        .map(|i| on_shard(shards, i, "SELECT count(*) FROM pg_prepared_xacts"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_over_shards_commit_on_all_of_them_or_none() {
    let shards = [shard_cluster(), shard_cluster()];
    let mut pgherd = Pgherd::start(BIN, &shards[0], &config(&shards));
    let through = connect_as_superuser(pgherd.port, "postgres").await;
    ok(
        &through,
        "CREATE TABLE accounts (aid int PRIMARY KEY, abalance int NOT NULL)",
    )
    .await;
    ok(
        &through,
        "CREATE TABLE branches (bid int PRIMARY KEY, bbalance int NOT NULL)",
    )
    .await;
    ok(
        &through,
        "CREATE TABLE deferred (aid int, v int, UNIQUE (v) DEFERRABLE INITIALLY DEFERRED)",
    )
    .await;
    // A table every shard holds takes rows on every shard (its catalog facts read right
    // after it was made); a column left to a default that is not a constant is refused.
    let inserted = run(
        &through,
        "INSERT INTO branches (bid, bbalance) VALUES (1, 0)",
    )
    .await
    .unwrap();
    assert_eq!(count(&inserted), 1);
    ok(
        &through,
        "CREATE TABLE notes (id serial PRIMARY KEY, body text)",
    )
    .await;
    let refused = run(&through, "INSERT INTO notes (body) VALUES ('x')")
        .await
        .expect_err("id is left to a sequence");
    assert_eq!(code(&refused), "0A000", "{refused:?}");
    ok(&through, "INSERT INTO notes (id, body) VALUES (1, 'x')").await;
    // A default that comes with the column's domain counts too.
    ok(&through, "CREATE DOMAIN stamp AS timestamptz DEFAULT now()").await;
    ok(&through, "CREATE TABLE logs (id int PRIMARY KEY, at stamp)").await;
    let refused = run(&through, "INSERT INTO logs (id) VALUES (1)")
        .await
        .expect_err("at is left to now()");
    assert!(
        format!("{refused:?}").contains("leaving column at of logs"),
        "{refused:?}"
    );
    for i in 0..2 {
        assert_eq!(on_shard(&shards, i, "SELECT bid FROM branches"), "1");
        assert_eq!(
            on_shard(&shards, i, "SELECT body FROM notes WHERE id = 1"),
            "x"
        );
    }
    // The transaction's time, written to a table every shard holds, is one value on every
    // copy: computed once and bound (simple and extended protocol, in a block and alone).
    ok(
        &through,
        "CREATE TABLE stamps (id int PRIMARY KEY, at timestamptz, d date, lt timestamp(2))",
    )
    .await;
    ok(
        &through,
        "INSERT INTO stamps VALUES (1, CURRENT_TIMESTAMP, current_date, LOCALTIMESTAMP(2))",
    )
    .await;
    ok_all(
        &through,
        &[
            "BEGIN".to_owned(),
            "SELECT pg_sleep(0.01)".to_owned(),
            "INSERT INTO stamps VALUES (2, now(), current_date, localtimestamp)".to_owned(),
            "UPDATE stamps SET at = transaction_timestamp() WHERE id = 1".to_owned(),
            "COMMIT".to_owned(),
        ],
    )
    .await;
    through
        .execute(
            "INSERT INTO stamps VALUES ($1, now(), CURRENT_DATE, LOCALTIMESTAMP)",
            &[&3i32],
        )
        .await
        .expect("a prepared insert with the transaction's time");
    let copy_of = |i: usize| {
        on_shard(&shards, i, "SELECT string_agg(id || ' ' || at || ' ' || d || ' ' || lt, '; ' ORDER BY id) FROM stamps")
    };
    assert_eq!(copy_of(0), copy_of(1));
    assert_eq!(
        on_shard(
            &shards,
            0,
            "SELECT count(DISTINCT at) FROM stamps WHERE id <= 2"
        ),
        "1",
        "one transaction, one time"
    );
    let (a, b) = keys_on_each_shard(1);
    let decisions = || on_shard(&shards, 0, "SELECT count(*) FROM pgherd.decisions");
    let decided_before: u32 = decisions().parse().unwrap();

    // One transaction over both shards and the table they both hold: on both, at once.
    ok_all(
        &through,
        &[
            "BEGIN ISOLATION LEVEL REPEATABLE READ".to_owned(),
            format!("INSERT INTO accounts (aid, abalance) VALUES ({a}, 10)"),
            format!("INSERT INTO accounts (aid, abalance) VALUES ({b}, 20)"),
            "UPDATE branches SET bbalance = bbalance + 30 WHERE bid = 1".to_owned(),
            "SELECT sum(abalance) FROM accounts".to_owned(),
            "COMMIT".to_owned(),
        ],
    )
    .await;
    assert_eq!(
        on_shard(
            &shards,
            0,
            &format!("SELECT abalance FROM accounts WHERE aid = {a}")
        ),
        "10"
    );
    assert_eq!(
        on_shard(
            &shards,
            1,
            &format!("SELECT abalance FROM accounts WHERE aid = {b}")
        ),
        "20"
    );
    for i in 0..2 {
        assert_eq!(
            on_shard(&shards, i, "SELECT bbalance FROM branches"),
            "30",
            "shard {i}"
        );
    }
    assert_eq!(prepared_left(&shards), ["0", "0"]);
    assert_eq!(
        decisions(),
        (decided_before + 1).to_string(),
        "the decision is the decider's (shard 0's) commit"
    );

    // ROLLBACK: nothing anywhere.
    let (a2, b2) = keys_on_each_shard(1000);
    ok_all(
        &through,
        &[
            "BEGIN".to_owned(),
            format!("INSERT INTO accounts (aid, abalance) VALUES ({a2}, 1)"),
            format!("INSERT INTO accounts (aid, abalance) VALUES ({b2}, 1)"),
            "ROLLBACK".to_owned(),
        ],
    )
    .await;
    let total = |i| on_shard(&shards, i, "SELECT count(*) FROM accounts");
    assert_eq!((total(0), total(1)), ("1".into(), "1".into()));

    // An error aborts the transaction: later statements are refused with 25P02 and COMMIT
    // rolls back, on every shard.
    ok(&through, "BEGIN").await;
    ok(
        &through,
        &format!("INSERT INTO accounts (aid, abalance) VALUES ({b2}, 1)"),
    )
    .await;
    let duplicate = run(
        &through,
        &format!("INSERT INTO accounts (aid, abalance) VALUES ({a}, 1)"),
    )
    .await;
    assert_eq!(code(&duplicate.unwrap_err()), "23505");
    let ignored = run(&through, "SELECT 1").await;
    assert_eq!(code(&ignored.unwrap_err()), "25P02");
    let tag = run(&through, "COMMIT")
        .await
        .expect("COMMIT of a failed transaction");
    assert!(tag.is_empty() || count(&tag) == 0);
    assert_eq!((total(0), total(1)), ("1".into(), "1".into()));

    // A shard refusing its part at PREPARE (shard 1), or at the deciding commit (shard 0):
    // nothing is committed anywhere, and the client hears the shard's error.
    for refusing in [1usize, 0] {
        let (x, y) = keys_on_each_shard(2000 + 1000 * refusing as i32);
        let duplicate_on = if refusing == 0 { x } else { y };
        ok(
            &through,
            &format!(
                "INSERT INTO deferred (aid, v) VALUES ({duplicate_on}, {})",
                7 + refusing
            ),
        )
        .await;
        ok(&through, "BEGIN").await;
        ok(
            &through,
            &format!("INSERT INTO deferred (aid, v) VALUES ({x}, {})", 100 + x),
        )
        .await;
        ok(
            &through,
            &format!("INSERT INTO deferred (aid, v) VALUES ({y}, {})", 100 + y),
        )
        .await;
        ok(
            &through,
            &format!(
                "INSERT INTO deferred (aid, v) VALUES ({duplicate_on}, {})",
                7 + refusing
            ),
        )
        .await;
        let refused = run(&through, "COMMIT")
            .await
            .expect_err("the deferred check fails");
        assert_eq!(code(&refused), "23505", "shard {refusing}: {refused:?}");
        for i in 0..2 {
            assert_eq!(
                on_shard(&shards, i, "SELECT count(*) FROM deferred WHERE v >= 100"),
                "0",
                "shard {refusing} refused: nothing may stay on shard {i}"
            );
        }
        assert_eq!(prepared_left(&shards), ["0", "0"]);
    }

    // A write over both shards outside a block is one transaction: the counts add up.
    let updated = run(&through, "UPDATE accounts SET abalance = abalance + 1")
        .await
        .unwrap();
    assert_eq!(count(&updated), 2);
    let returned = run(&through, "DELETE FROM deferred WHERE v < 100 RETURNING aid")
        .await
        .unwrap();
    let rows = returned
        .iter()
        .filter(|m| matches!(m, SimpleQueryMessage::Row(_)))
        .count();
    assert_eq!((rows, count(&returned)), (2, 2));
    assert_eq!(
        on_shard(&shards, 0, "SELECT sum(abalance) FROM accounts"),
        "11"
    );
    assert_eq!(
        on_shard(&shards, 1, "SELECT sum(abalance) FROM accounts"),
        "21"
    );

    // An INSERT of rows for both shards is split: each row on its shard, RETURNING in the
    // order written, and all or none.
    let keys: Vec<i32> = (7000..7010).collect();
    let values: Vec<String> = keys.iter().map(|k| format!("({k}, {k})")).collect();
    let inserted = run(
        &through,
        &format!(
            "INSERT INTO accounts (aid, abalance) VALUES {} RETURNING aid",
            values.join(", ")
        ),
    )
    .await
    .unwrap();
    let returned = first_column(&inserted);
    let written: Vec<String> = keys.iter().map(i32::to_string).collect();
    assert_eq!((returned, count(&inserted)), (written, 10));
    for (i, shard) in shards.iter().enumerate() {
        let mine = keys
            .iter()
            .filter(|k| shard_of_text(KeyType::Int4, &k.to_string(), SHARDS) == Ok(i as u32))
            .count();
        assert_eq!(
            shard.sql("SELECT count(*) FROM accounts WHERE aid >= 7000"),
            mine.to_string(),
            "shard {i}"
        );
    }
    // A new key on shard 0 beside a key shard 1 holds already.
    let fresh = keys_on_each_shard(7100).0;
    let taken = keys_on_each_shard(7000).1;
    let duplicate = run(
        &through,
        &format!("INSERT INTO accounts (aid, abalance) VALUES ({fresh}, 0), ({taken}, 0)"),
    )
    .await
    .expect_err("a key on the other shard is taken");
    assert_eq!(code(&duplicate), "23505");
    assert_eq!(
        on_shard(
            &shards,
            0,
            &format!("SELECT count(*) FROM accounts WHERE aid = {fresh}")
        ),
        "0",
        "nothing of a failed INSERT stays"
    );
    ok(&through, "DELETE FROM accounts WHERE aid >= 7000").await;

    // COPY FROM STDIN: each row to the shard of its key (text and CSV, with or without a
    // column list), every row of a table every shard holds to every shard; all or none.
    let url = pgherd.url(
        pgherd_testkit::SUPERUSER,
        pgherd_testkit::SUPERUSER_PASSWORD,
        "postgres",
    );
    let on_each_shard = |from: i32, to: i32| -> Vec<String> {
        (0..2u32)
            .map(|shard| {
                (from..to)
                    .filter(|k| shard_of_text(KeyType::Int4, &k.to_string(), SHARDS) == Ok(shard))
                    .count()
                    .to_string()
            })
            .collect()
    };
    let counted = |from: i32, to: i32| -> Vec<String> {
        (0..2)
            .map(|i| {
                on_shard(
                    &shards,
                    i,
                    &format!("SELECT count(*) FROM accounts WHERE aid >= {from} AND aid < {to}"),
                )
            })
            .collect()
    };
    let text_rows: String = (8000..8100).map(|k| format!("{k}\t{}\n", k % 7)).collect();
    assert_eq!(
        psql_with_input(&url, "COPY accounts (aid, abalance) FROM STDIN", &text_rows),
        Ok("COPY 100".into())
    );
    assert_eq!(counted(8000, 8100), on_each_shard(8000, 8100));
    let csv_rows: String = std::iter::once("abalance,aid\n".to_owned())
        .chain((8100..8150).map(|k| format!("\"{}\",\"{k}\"\n", k % 5)))
        .collect();
    assert_eq!(
        psql_with_input(
            &url,
            "COPY accounts (abalance, aid) FROM STDIN (FORMAT csv, HEADER)",
            &csv_rows
        ),
        Ok("COPY 50".into())
    );
    assert_eq!(counted(8100, 8150), on_each_shard(8100, 8150));
    // Without a column list the key's place comes from the catalog.
    let whole_rows: String = (8150..8160).map(|k| format!("{k}\t1\n")).collect();
    assert_eq!(
        psql_with_input(&url, "COPY accounts FROM STDIN", &whole_rows),
        Ok("COPY 10".into())
    );
    assert_eq!(counted(8150, 8160), on_each_shard(8150, 8160));
    // A row that fails on one shard undoes the rows of every shard.
    let (fresh, taken) = (keys_on_each_shard(8200).0, keys_on_each_shard(8000).1);
    let failing = psql_with_input(
        &url,
        "COPY accounts (aid, abalance) FROM STDIN",
        &format!("{fresh}\t0\n{taken}\t0\n"),
    );
    assert!(
        failing.as_ref().is_err_and(|e| e.contains("duplicate key")),
        "{failing:?}"
    );
    assert_eq!(counted(fresh, fresh + 1), ["0", "0"]);
    let bad_key = psql_with_input(&url, "COPY accounts (aid, abalance) FROM STDIN", "x\t0\n");
    assert!(
        bad_key.as_ref().is_err_and(|e| e.contains("invalid input")),
        "{bad_key:?}"
    );
    assert_eq!(
        psql_with_input(
            &url,
            "COPY notes (id, body) FROM STDIN",
            "10\tten\n11\televen\n"
        ),
        Ok("COPY 2".into())
    );
    for i in 0..2 {
        assert_eq!(
            on_shard(&shards, i, "SELECT count(*) FROM notes WHERE id >= 10"),
            "2"
        );
    }
    ok(&through, "DELETE FROM accounts WHERE aid >= 8000").await;

    // A table every shard holds answers as one table: its count once, and copies that
    // differ are an error that changes nothing.
    let updated = run(
        &through,
        "UPDATE branches SET bbalance = bbalance + 1 WHERE bid = 1",
    )
    .await
    .unwrap();
    assert_eq!(count(&updated), 1);
    shards[1].sql("INSERT INTO branches VALUES (2, 0)");
    let differ = run(&through, "UPDATE branches SET bbalance = 5 WHERE bid = 2")
        .await
        .expect_err("shard 0 has no branch 2");
    assert_eq!(code(&differ), "XX001", "{differ:?}");
    assert_eq!(
        on_shard(&shards, 1, "SELECT bbalance FROM branches WHERE bid = 2"),
        "0"
    );
    shards[1].sql("DELETE FROM branches WHERE bid = 2");

    // Settings a block changed for itself only are gone after it, on every shard.
    let setting = async |name: &str| {
        let rows = run(&through, &format!("SHOW {name}")).await.unwrap();
        first_column(&rows).swap_remove(0)
    };
    let (zone, style) = (setting("TimeZone").await, setting("DateStyle").await);
    ok_all(
        &through,
        &[
            "BEGIN".to_owned(),
            "SET LOCAL TimeZone = 'Asia/Tokyo'".to_owned(),
            format!("SELECT abalance FROM accounts WHERE aid = {b}"),
            "COMMIT".to_owned(),
            "BEGIN".to_owned(),
            format!("SELECT abalance FROM accounts WHERE aid = {a}"),
            "SET DateStyle = 'SQL, DMY'".to_owned(),
            "ROLLBACK".to_owned(),
        ],
    )
    .await;
    for _ in 0..2 {
        assert_eq!(setting("TimeZone").await, zone);
        assert_eq!(setting("DateStyle").await, style);
    }

    // A READ ONLY block calling a (volatile) function on two shards commits in one phase.
    ok(
        &through,
        "CREATE FUNCTION touch(int) RETURNS int LANGUAGE sql AS 'SELECT $1'",
    )
    .await;
    let decided_before = decisions();
    ok_all(
        &through,
        &[
            "BEGIN READ ONLY".to_owned(),
            format!("SELECT touch(aid) FROM accounts WHERE aid = {a}"),
            format!("SELECT touch(aid) FROM accounts WHERE aid = {b}"),
            "COMMIT".to_owned(),
        ],
    )
    .await;
    assert_eq!(decisions(), decided_before);

    // Only pgherd's user writes decisions; anyone else records only its own transaction's.
    shards[0].sql("CREATE ROLE mallory LOGIN");
    let forged = shards[0].node("pg1").psql(
        "postgres",
        "SET ROLE mallory; INSERT INTO pgherd.decisions (gid, committed) VALUES ('pgherd_0_0000000000000001_1_1', true)",
    );
    assert!(
        forged
            .as_ref()
            .is_err_and(|e| e.to_string().contains("permission denied")),
        "{forged:?}"
    );

    // What is not built is refused by name, and the session goes on.
    for (sql, refusal) in [
        ("PREPARE TRANSACTION 'x'", "PREPARE TRANSACTION"),
        ("UPDATE branches SET bbalance = random()", "calling random"),
    ] {
        let e = run(&through, sql).await.expect_err(sql);
        assert_eq!(code(&e), "0A000", "{sql}");
        assert!(
            e.to_string().contains(refusal) || format!("{e:?}").contains(refusal),
            "{sql}: {e:?}"
        );
    }
    ok(&through, "SELECT 1").await;

    // pgherd killed between the phases: after the prepares, the decision is not made and
    // recovery rolls back; after the decision, recovery commits what is left.
    for (failpoint, committed) in [("2pc-after-prepare", false), ("2pc-after-decision", true)] {
        let reached_before = pgherd_log_count(&pgherd, "failpoint reached");
        pgherd.set_env("PGHERD_FAILPOINTS", Some(failpoint));
        pgherd.restart();
        let client = connect_as_superuser(pgherd.port, "postgres").await;
        let (x, y) = keys_on_each_shard(if committed { 5000 } else { 6000 });
        ok(&client, "BEGIN").await;
        ok(
            &client,
            &format!("INSERT INTO accounts (aid, abalance) VALUES ({x}, 5)"),
        )
        .await;
        ok(
            &client,
            &format!("INSERT INTO accounts (aid, abalance) VALUES ({y}, 5)"),
        )
        .await;
        let commit = tokio::spawn(async move { client.simple_query("COMMIT").await });
        let deadline = Instant::now() + Duration::from_secs(30);
        while pgherd_log_count(&pgherd, "failpoint reached") == reached_before {
            assert!(Instant::now() < deadline, "{failpoint} not reached");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        pgherd.signal(libc::SIGKILL);
        assert!(
            commit.await.unwrap().is_err(),
            "the client's COMMIT has no answer"
        );
        assert_eq!(
            prepared_left(&shards)[1],
            "1",
            "{failpoint}: shard 1 holds its part prepared"
        );
        pgherd.set_env("PGHERD_FAILPOINTS", None);
        pgherd.restart();
        let deadline = Instant::now() + Duration::from_secs(60);
        while prepared_left(&shards) != ["0", "0"] {
            assert!(
                Instant::now() < deadline,
                "{failpoint}: recovery left {:?}",
                prepared_left(&shards)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let want = if committed { "1" } else { "0" };
        assert_eq!(
            on_shard(
                &shards,
                0,
                &format!("SELECT count(*) FROM accounts WHERE aid = {x}")
            ),
            want,
            "{failpoint}"
        );
        assert_eq!(
            on_shard(
                &shards,
                1,
                &format!("SELECT count(*) FROM accounts WHERE aid = {y}")
            ),
            want,
            "{failpoint}"
        );
    }
    let log = pgherd.log();
    assert!(
        log.contains("recovered a prepared transaction"),
        "recovery says what it did"
    );
}

fn pgherd_log_count(pgherd: &Pgherd, text: &str) -> usize {
    pgherd.log().matches(text).count()
}

/// pgbench's own tables through a sharded endpoint: `pgbench -i` (DDL, TRUNCATE, reference
/// rows, COPY of the accounts, all in one transaction) and its TPC-B transactions from several
/// clients (a key-routed account, the tellers and branches every shard holds, a sharded
/// history), after which TPC-B's invariant holds: the accounts, tellers and branches changed
/// by exactly the history's deltas, and every shard's copies are equal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_initializes_and_runs_through_a_sharded_endpoint() {
    let shards = [shard_cluster(), shard_cluster()];
    let config = common::sharded_config(
        &shards,
        &[("pgbench_accounts", "aid"), ("pgbench_history", "aid")],
    );
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let url = pgherd.url(
        pgherd_testkit::SUPERUSER,
        pgherd_testkit::SUPERUSER_PASSWORD,
        "postgres",
    );
    common::pgbench(&url, &["-i", "-s", "1", "-q"]).expect("pgbench -i through pgherd");
    let through = connect_as_superuser(pgherd.port, "postgres").await;
    let value = async |sql: &str| {
        let rows = run(&through, sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
        first_column(&rows).into_iter().next().unwrap_or_default()
    };
    assert_eq!(
        value("SELECT count(*) FROM pgbench_accounts").await,
        "100000"
    );
    for (i, shard) in shards.iter().enumerate() {
        let held: u32 = shard
            .sql("SELECT count(*) FROM pgbench_accounts")
            .parse()
            .unwrap();
        assert!(
            (40_000..60_000).contains(&held),
            "shard {i} holds {held} accounts"
        );
        assert_eq!(shard.sql("SELECT count(*) FROM pgbench_tellers"), "10");
    }
    let out = common::pgbench(&url, &["-c", "4", "-j", "2", "-t", "25", "-n"])
        .expect("pgbench through pgherd");
    assert!(
        out.contains("number of transactions actually processed: 100/100"),
        "{out}"
    );
    let deltas = value("SELECT sum(delta) FROM pgbench_history").await;
    assert_eq!(value("SELECT count(*) FROM pgbench_history").await, "100");
    assert_eq!(
        value("SELECT sum(abalance) FROM pgbench_accounts").await,
        deltas
    );
    assert_eq!(
        value("SELECT sum(tbalance) FROM pgbench_tellers").await,
        deltas
    );
    assert_eq!(
        value("SELECT sum(bbalance) FROM pgbench_branches").await,
        deltas
    );
    for table in ["pgbench_tellers", "pgbench_branches"] {
        let copy = |i: usize| {
            shards[i].sql(&format!(
                "SELECT string_agg(t::text, ';' ORDER BY t::text) FROM {table} t"
            ))
        };
        assert_eq!(copy(0), copy(1), "the copies of {table}");
    }
    assert_eq!(prepared_left(&shards), ["0", "0"]);
}
