//! Real drivers through transaction pooling with prepared statements: psycopg 3, asyncpg,
//! node-postgres, pgx and pgjdbc, many clients per server connection, statement names that
//! collide across clients; and what asyncpg, pgx and pgjdbc see through pgherd with replicas
//! behind it, in transaction and session mode (issue 16). The scripts live in tests/drivers;
//! `.ci/run` installs the drivers.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::*;

const CLIENTS: &str = "40";
const ITERATIONS: &str = "30";

fn drivers_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/drivers")
}

/// Where a driver connects, and as whom.
#[derive(Clone, Copy)]
struct Endpoint<'a> {
    port: u16,
    user: &'a str,
    password: &'a str,
    database: &'a str,
}

impl Env {
    fn endpoint(&self) -> Endpoint<'static> {
        Endpoint {
            port: self.pgherd.port,
            user: APP,
            password: APP_PASSWORD,
            database: APP,
        }
    }
}

fn run_driver(to: Endpoint, name: &str, mut cmd: Command) -> Result<(), String> {
    cmd.env("PGHERD_HOST", "127.0.0.1")
        .env("PGHERD_PORT", to.port.to_string())
        .env("PGHERD_USER", to.user)
        .env("PGHERD_PASSWORD", to.password)
        .env("PGHERD_DB", to.database)
        .env("CLIENTS", CLIENTS)
        .env("ITERATIONS", ITERATIONS);
    let log = std::env::temp_dir().join(format!("pgherd-driver-{}.log", rand::random::<u32>()));
    let file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
    let mut child = cmd
        .stdout(file.try_clone().map_err(|e| e.to_string())?)
        .stderr(file)
        .spawn()
        .map_err(|e| format!("{name}: cannot start {:?}: {e} (is the driver installed? see tests/drivers/README.md)", cmd.get_program()))?;
    // A driver stuck on a protocol error must fail the test, not hang it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            return Err(format!("{name} did not finish within 180 s:\n{text}"));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let _ = std::fs::remove_file(&log);
    if status.success() {
        println!("{}", text.trim());
        Ok(())
    } else {
        Err(format!("{name} failed ({status}):\n{text}"))
    }
}

#[test]
fn drivers_share_few_server_connections_with_prepared_statements() {
    let env = env(0, |c| c.mode("transaction").max_size(3));
    env.direct("CREATE TABLE kv (k int PRIMARY KEY, v text); INSERT INTO kv SELECT i, 'v' || i FROM generate_series(1, 1000) i");
    env.direct("CREATE TABLE driver_log (driver text, client int, i int)");
    env.direct("GRANT ALL ON kv, driver_log TO app");

    let runs = [
        ("psycopg 3", python("drivers.py", "psycopg")),
        ("asyncpg", python("drivers.py", "asyncpg")),
        ("node-postgres", node()),
        ("pgx", go(None)),
        ("pgjdbc", java("Drivers.java")),
    ];
    let failures = run_all(&env, runs);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    let backends: i64 = env
        .direct("SELECT count(*) FROM pg_stat_activity WHERE usename = 'app' AND backend_type = 'client backend'")
        .parse()
        .unwrap();
    assert!(
        backends <= 3,
        "{backends} server connections with max_size 3"
    );
}

/// Issue 16 through the drivers that exercise it: an unlogged table made in one session is
/// read in the next (a replica cannot read it), `transaction_read_only` is the primary's, the
/// ParameterStatus values are the server's, cached statements survive a type made again (and
/// a savepoint that rolls one back), `DEALLOCATE ALL`/`DISCARD ALL` clear what the driver
/// prepared, and the process id the driver knows is on its own notifications and, in session
/// mode, is its server's.
#[test]
fn drivers_see_what_postgresql_shows() {
    let env = env(1, |c| {
        c.mode("transaction")
            .database(APP, "")
            .database("app_session", "dbname = \"app\"\nmode = \"session\"")
    });
    env.direct("GRANT CREATE ON SCHEMA public TO app");
    env.cluster.wait_replayed();
    let session = |mut cmd: Command| {
        cmd.env("PGHERD_SESSION_DB", "app_session");
        cmd
    };
    let runs = [
        ("asyncpg", session(python("transparency.py", "asyncpg"))),
        ("pgx", session(go(Some("transparency")))),
        ("pgjdbc", session(java("Transparency.java"))),
    ];
    let failures = run_all(&env, runs);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// psycopg and pgjdbc through a sharded endpoint over two shards (issue 9): COPY, batches,
/// key-routed and fanned-out reads in prepared statements, transactions over both shards, a
/// portal read a few rows at a time. Each driver gets a database of its own.
#[test]
fn drivers_through_a_sharded_endpoint() {
    use pgherd_testkit::{Pgherd, SUPERUSER, SUPERUSER_PASSWORD};
    let shards = [shard_cluster(), shard_cluster()];
    for cluster in &shards {
        cluster.sql("CREATE DATABASE psycopg");
        cluster.sql("CREATE DATABASE pgjdbc");
    }
    let pgherd = Pgherd::start(
        BIN,
        &shards[0],
        &sharded_config(&shards, &[("accounts", "aid")]),
    );
    for database in ["psycopg", "pgjdbc"] {
        psql(
            &format!(
                "postgresql://{SUPERUSER}:{SUPERUSER_PASSWORD}@127.0.0.1:{}/{database}",
                pgherd.port
            ),
            &[
                "-c",
                "CREATE TABLE accounts (aid int PRIMARY KEY, abalance int NOT NULL, note text)",
            ],
        )
        .expect("the table, through pgherd");
    }
    let to = |database| Endpoint {
        port: pgherd.port,
        user: SUPERUSER,
        password: SUPERUSER_PASSWORD,
        database,
    };
    let failures: Vec<String> = std::thread::scope(|scope| {
        let psycopg =
            scope.spawn(|| run_driver(to("psycopg"), "psycopg 3", python("sharded.py", "psycopg")));
        let pgjdbc = scope.spawn(|| run_driver(to("pgjdbc"), "pgjdbc", java("Sharded.java")));
        [psycopg, pgjdbc]
            .into_iter()
            .filter_map(|h| h.join().unwrap().err())
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    // Each shard holds its own keys, and nothing is left prepared.
    for database in ["psycopg", "pgjdbc"] {
        let held: Vec<i64> = shards
            .iter()
            .map(|c| {
                c.sql_on("pg1", database, "SELECT count(*) FROM accounts")
                    .parse()
                    .unwrap()
            })
            .collect();
        assert_eq!(held.iter().sum::<i64>(), 300, "{database}: {held:?}");
        assert!(held.iter().all(|&n| n > 100), "{database}: {held:?}");
    }
    for cluster in &shards {
        assert_eq!(cluster.sql("SELECT count(*) FROM pg_prepared_xacts"), "0");
    }
}

fn python(script: &str, which: &str) -> Command {
    let mut c = Command::new("python3");
    c.arg(drivers_dir().join("python").join(script)).arg(which);
    c
}

fn node() -> Command {
    let mut c = Command::new("node");
    c.arg("drivers.js").current_dir(drivers_dir().join("node"));
    c
}

fn go(mode: Option<&str>) -> Command {
    let mut c = Command::new("go");
    c.args(["run", "."])
        .args(mode)
        .current_dir(drivers_dir().join("go"))
        .env("GOFLAGS", "-mod=mod");
    c
}

fn java(source: &str) -> Command {
    let dir = drivers_dir().join("java");
    let jars = std::fs::read_dir(dir.join("target/lib"))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path().display().to_string())
                .collect::<Vec<_>>()
                .join(":")
        })
        .unwrap_or_default();
    let mut c = Command::new("java");
    c.args(["-cp", &jars, source]).current_dir(dir);
    c
}

/// Runs every driver at once; the failures, each with the driver's output.
fn run_all<const N: usize>(env: &Env, runs: [(&str, Command); N]) -> Vec<String> {
    let to = env.endpoint();
    std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .into_iter()
            .map(|(name, cmd)| scope.spawn(move || run_driver(to, name, cmd)))
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().unwrap().err())
            .collect()
    })
}
