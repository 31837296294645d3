//! Real drivers through transaction pooling with prepared statements: psycopg 3, asyncpg,
//! node-postgres, pgx and pgjdbc, many clients per server connection, statement names that
//! collide across clients. The scripts live in tests/drivers; `.ci/run` installs the drivers.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::*;

const CLIENTS: &str = "40";
const ITERATIONS: &str = "30";

fn drivers_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/drivers")
}

fn run_driver(env: &Env, name: &str, mut cmd: Command) -> Result<(), String> {
    cmd.env("PGHERD_HOST", "127.0.0.1")
        .env("PGHERD_PORT", env.pgherd.port.to_string())
        .env("PGHERD_USER", APP)
        .env("PGHERD_PASSWORD", APP_PASSWORD)
        .env("PGHERD_DB", APP)
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
    let dir = drivers_dir();

    let python = |which: &str| {
        let mut c = Command::new("python3");
        c.arg(dir.join("python/drivers.py")).arg(which);
        c
    };
    let mut node = Command::new("node");
    node.arg("drivers.js").current_dir(dir.join("node"));
    let mut go = Command::new("go");
    go.args(["run", "."])
        .current_dir(dir.join("go"))
        .env("GOFLAGS", "-mod=mod");
    let jars = std::fs::read_dir(dir.join("java/target/lib"))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path().display().to_string())
                .collect::<Vec<_>>()
                .join(":")
        })
        .unwrap_or_default();
    let mut java = Command::new("java");
    java.args(["-cp", &jars, "Drivers.java"])
        .current_dir(dir.join("java"));

    let runs = [
        ("psycopg 3", python("psycopg")),
        ("asyncpg", python("asyncpg")),
        ("node-postgres", node),
        ("pgx", go),
        ("pgjdbc", java),
    ];
    let failures: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .into_iter()
            .map(|(name, cmd)| {
                let env = &env;
                scope.spawn(move || run_driver(env, name, cmd))
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().unwrap().err())
            .collect()
    });
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
