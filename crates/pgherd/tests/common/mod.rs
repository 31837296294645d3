//! Shared setup for the integration tests: a cluster, an application user and database, and
//! pgherd in front.
#![allow(dead_code)]

pub mod sets;

use std::time::{Duration, Instant};

use pgherd_testkit::{Pgherd, PgherdConfig, TestCluster};
use pgherd_wire::scram::ScramVerifier;
use tokio_postgres::{Client, NoTls};

pub mod cache;

pub const BIN: &str = env!("CARGO_BIN_EXE_pgherd");
pub const APP: &str = "app";
pub const APP_PASSWORD: &str = "app-secret-1";

pub struct Env {
    pub pgherd: Pgherd,
    pub app_verifier: ScramVerifier,
    // Dropped last: pgherd stops before its cluster.
    pub cluster: TestCluster,
}

/// A cluster with `replicas`, a user `app` owning database `app`, and pgherd configured by
/// `tweak` (which gets a config that already lists `app`).
pub fn env(replicas: usize, tweak: impl FnOnce(PgherdConfig) -> PgherdConfig) -> Env {
    env_on(TestCluster::start(replicas), tweak)
}

/// [`env`], with pgherd's connections to every node through the node's Unix-domain socket
/// (`socket_dir`).
pub fn env_on_sockets(replicas: usize, tweak: impl FnOnce(PgherdConfig) -> PgherdConfig) -> Env {
    let cluster = TestCluster::start(replicas);
    let sockets: Vec<(String, String)> = cluster
        .cluster
        .nodes
        .iter()
        .map(|n| {
            (
                n.name.clone(),
                format!("socket_dir = \"{}\"", n.socket_dir.display()),
            )
        })
        .collect();
    env_on(cluster, |config| {
        let config = sockets
            .iter()
            .fold(config, |config, (node, line)| config.node_line(node, line));
        tweak(config)
    })
}

pub fn env_on(cluster: TestCluster, tweak: impl FnOnce(PgherdConfig) -> PgherdConfig) -> Env {
    let app_verifier = cluster.create_user(APP, APP_PASSWORD);
    cluster.sql(&format!("CREATE DATABASE {APP} OWNER {APP}"));
    let config = tweak(PgherdConfig::new().user(APP, &app_verifier, ""));
    let pgherd = Pgherd::start(BIN, &cluster, &config);
    Env {
        pgherd,
        app_verifier,
        cluster,
    }
}

impl Env {
    pub async fn app(&self) -> Client {
        connect(&self.pgherd.conninfo(APP, APP_PASSWORD, APP)).await
    }

    pub fn app_url(&self) -> String {
        self.pgherd.url(APP, APP_PASSWORD, APP)
    }

    /// Runs SQL on the primary directly, as the superuser, in database `app`.
    pub fn direct(&self, sql: &str) -> String {
        self.cluster.sql_on("pg1", APP, sql)
    }
}

pub async fn connect(conninfo: &str) -> Client {
    try_connect(conninfo)
        .await
        .unwrap_or_else(|e| panic!("cannot connect through pgherd ({conninfo}): {e}"))
}

pub async fn try_connect(conninfo: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(conninfo, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// The first value of the first row of a simple query ("NULL" for a null, "" without rows).
pub async fn first_value(c: &Client, sql: &str) -> Result<String, tokio_postgres::Error> {
    let messages = c.simple_query(sql).await?;
    Ok(messages
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some(r.get(0).unwrap_or("NULL").to_owned())
            }
            _ => None,
        })
        .unwrap_or_default())
}

/// The SQLSTATE of a failed call.
pub fn code(e: &tokio_postgres::Error) -> String {
    e.code()
        .map(|c| c.code().to_owned())
        .unwrap_or_else(|| format!("no SQLSTATE: {e}"))
}

/// psql through pgherd; returns stdout, or stderr on failure.
pub fn psql(url: &str, args: &[&str]) -> Result<String, String> {
    let mut all = vec!["-q"];
    all.extend_from_slice(args);
    run_psql(url, &all, "")
}

/// psql running `sql` against `url` with `input` on its standard input (a COPY's data);
/// what it printed (`COPY n`), as an error if it failed.
pub fn psql_with_input(url: &str, sql: &str, input: &str) -> Result<String, String> {
    run_psql(url, &["-c", sql], input)
}

fn run_psql(url: &str, args: &[&str], input: &str) -> Result<String, String> {
    use std::io::Write;
    let mut child = std::process::Command::new(pgherd_testkit::pg_bin("psql"))
        .arg(url)
        .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
        .args(args)
        .env_remove("PGPASSWORD")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run psql");
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input.as_bytes()).expect("psql input");
    }
    let out = child.wait_with_output().expect("psql");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// pgbench with `args` against `url`; returns its output, as an error if it failed.
pub fn pgbench(url: &str, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(pgherd_testkit::pg_bin("pgbench"))
        .args(args)
        .arg(url)
        .output()
        .expect("run pgbench");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

/// Waits until `f` holds, or fails the test with `what` and pgherd's log.
pub fn wait_until(env: &Env, what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(
            Instant::now() < deadline,
            "{what} within {timeout:?}\n--- pgherd log ---\n{}",
            env.pgherd.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A cluster with `replicas` and pgherd managing its nodes with failover on, the superuser
/// on the admin console, and the HTTP API on a free port guarded by `token`; returns the
/// API's base URL too.
pub fn env_with_api(replicas: usize, token: &str) -> (Env, String) {
    let port = pgherd_cluster::free_port().expect("free port");
    let env = env(replicas, |c| {
        c.manage_nodes()
            .superuser()
            .proxy(&format!(
                "admin_users = [\"{}\"]",
                pgherd_testkit::SUPERUSER
            ))
            .section("[failover]\nenabled = true")
            .section(&format!(
                "[api]\nlisten = [\"127.0.0.1:{port}\"]\ntoken = \"{token}\""
            ))
    });
    (env, format!("http://127.0.0.1:{port}"))
}

/// An admin console command's rows as (column, value) pairs.
pub async fn rows(
    c: &Client,
    command: &str,
) -> Result<Vec<Vec<(String, String)>>, tokio_postgres::Error> {
    Ok(c.simple_query(command)
        .await?
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                r.columns()
                    .iter()
                    .enumerate()
                    .map(|(i, col)| (col.name().to_owned(), r.get(i).unwrap_or("").to_owned()))
                    .collect(),
            ),
            _ => None,
        })
        .collect())
}

/// A column of one of [`rows`]' rows.
pub fn field<'a>(row: &'a [(String, String)], name: &str) -> &'a str {
    row.iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no column {name} in {row:?}"))
}

/// A connection as the test clusters' superuser (directly, or through pgherd on `port`).
pub async fn connect_as_superuser(port: u16, database: &str) -> Client {
    use pgherd_testkit::{SUPERUSER, SUPERUSER_PASSWORD};
    connect(&format!(
        "host=127.0.0.1 port={port} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname={database}"
    ))
    .await
}

/// pgherd's config for a sharded endpoint over `shards` (shard 0 the cluster pgherd is started
/// with, each other one node of its own), sharding `tables` (table, integer key column).
pub fn sharded_config(shards: &[TestCluster], tables: &[(&str, &str)]) -> PgherdConfig {
    let mut sharding = String::from("[sharding]\n");
    for (table, column) in tables {
        sharding.push_str(&format!(
            "[[sharding.tables]]\ntable = \"{table}\"\ncolumn = \"{column}\"\ntype = \"integer\"\n"
        ));
    }
    let mut config = PgherdConfig::new().superuser().section(&sharding);
    for (shard, cluster) in shards.iter().enumerate().skip(1) {
        let nodes = &cluster.cluster.nodes;
        for node in nodes {
            // Names are unique over the shards: a one-node shard's is `shard<k>`; one with
            // replicas is made with a node prefix (a standby streams under its node's name).
            let name = if node.name.starts_with("pg") {
                assert_eq!(nodes.len(), 1, "a shard with replicas needs a node prefix");
                format!("shard{shard}")
            } else {
                node.name.clone()
            };
            config = config.section(&format!(
                "[[nodes]]\nname = \"{name}\"\nhost = \"{}\"\nport = {}\nshard = {shard}\n",
                node.host, node.port
            ));
        }
    }
    config
}

/// How many of `ids` are rows of `table` (by its `id` column) in the app database on `node`,
/// asked directly: acknowledged writes that must not have been lost.
pub fn rows_present(cluster: &TestCluster, node: &str, table: &str, ids: &[i64]) -> usize {
    let list: Vec<String> = ids.iter().map(i64::to_string).collect();
    cluster
        .sql_on(
            node,
            APP,
            &format!(
                "SELECT count(*) FROM {table} WHERE id IN ({})",
                list.join(",")
            ),
        )
        .trim()
        .parse()
        .expect("a count")
}

/// A one-node cluster to be a shard: prepared transactions on, for two-phase commit.
pub fn shard_cluster() -> TestCluster {
    shard_cluster_with(0, "")
}

/// A cluster to be a shard, with `replicas` and its nodes' names after `node_prefix`.
pub fn shard_cluster_with(replicas: usize, node_prefix: &str) -> TestCluster {
    TestCluster::start_with(pgherd_testkit::ClusterOptions {
        replicas,
        settings: vec![("max_prepared_transactions".into(), "20".into())],
        node_prefix: node_prefix.to_owned(),
        ..Default::default()
    })
}

/// A Bind of `statement` to the unnamed portal with text values (types left to the server)
/// and text rows.
pub fn bind_text(out: &mut bytes::BytesMut, statement: &[u8], values: &[Option<&str>]) {
    use pgherd_wire::frontend;
    let values: Vec<Option<&[u8]>> = values.iter().map(|v| v.map(str::as_bytes)).collect();
    let mut rest = bytes::BytesMut::new();
    frontend::BindValues {
        param_formats: Vec::new(),
        values,
        result_formats: Vec::new(),
    }
    .encode_rest(&mut rest);
    frontend::encode_bind(out, b"", statement, &rest).expect("bind");
}

/// A figure of `/proc/<pid>/status` in KiB (`field`: "VmRSS", "VmHWM", ...); 0 if unread.
pub fn proc_status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// `pause_sql` on the admin console `admin` while `holder` has a transaction open and `queued`
/// waits for a server connection (the pool is full): PAUSE waits for the transaction, ends once
/// `holder` commits, and the queued request has still not run (it waits for RESUME).
pub async fn pause_with_a_queued_request<T: Send + 'static>(
    admin: Client,
    pause_sql: &str,
    holder: &Client,
    queued: &tokio::task::JoinHandle<T>,
) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!queued.is_finished(), "the pool's connections are in use");
    let pause_sql = pause_sql.to_owned();
    let pausing = tokio::spawn(async move { admin.simple_query(&pause_sql).await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !pausing.is_finished(),
        "PAUSE waits for the running transaction"
    );
    holder.batch_execute("COMMIT").await.expect("commit");
    tokio::time::timeout(Duration::from_secs(10), pausing)
        .await
        .expect("PAUSE ends once the transaction ended")
        .expect("the PAUSE task")
        .expect("PAUSE");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !queued.is_finished(),
        "the queued request started a transaction while pgherd was paused"
    );
}

/// One phase of the dashboard's browser test (tests/dashboard/dashboard.mjs) against the API
/// at `api`; its output. Screenshots go to target/test-artifacts.
pub fn dashboard_phase(api: &str, token: &str, name: &str, vars: &[(&str, &str)]) -> String {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/dashboard");
    let shots =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-artifacts");
    std::fs::create_dir_all(&shots).expect("artifact dir");
    let mut cmd = std::process::Command::new("node");
    cmd.current_dir(&dir)
        .arg("dashboard.mjs")
        .arg(name)
        .env("PGHERD_API", api)
        .env("PGHERD_TOKEN", token)
        .env("SCREENSHOTS", &shots);
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run node (see tests/dashboard)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "dashboard phase {name} failed:\n{text}"
    );
    eprintln!("{}", text.trim());
    text
}

/// A one-node cluster that takes TCP connections over TLS only (`hostssl`), with its test
/// certificates and the directory they are in (remove it when done).
pub fn tls_only_cluster() -> (TestCluster, pgherd_testkit::TestCerts, std::path::PathBuf) {
    let probe = std::env::temp_dir().join(format!("pgherd-certs-{}", rand::random::<u32>()));
    std::fs::create_dir_all(&probe).expect("a certificate directory");
    let certs = pgherd_testkit::TestCerts::create(&probe.join("certs"));
    // PostgreSQL reads its key only if the postgres OS user owns it.
    let _ = std::process::Command::new("chown")
        .arg("-R")
        .arg("postgres:postgres")
        .arg(&certs.dir)
        .status();
    let cluster = TestCluster::start_with(pgherd_testkit::ClusterOptions {
        replicas: 0,
        settings: vec![
            ("ssl".into(), "on".into()),
            (
                "ssl_cert_file".into(),
                format!("'{}'", certs.server_cert.display()),
            ),
            (
                "ssl_key_file".into(),
                format!("'{}'", certs.server_key.display()),
            ),
        ],
        ..Default::default()
    });
    let hba = cluster.primary().data_dir.join("pg_hba.conf");
    let text = std::fs::read_to_string(&hba)
        .expect("pg_hba.conf")
        .replace("host    ", "hostssl ");
    std::fs::write(&hba, text).expect("pg_hba.conf written");
    cluster.sql("SELECT pg_reload_conf()");
    (cluster, certs, probe)
}

/// The new process's pid in the admin console's answer to `UPGRADE`.
pub fn upgrade_pid(answer: &str) -> u32 {
    answer
        .split("(pid ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {answer:?}"))
}

/// Starts a long sleep on `c`, cancels it through its cancel key and expects PostgreSQL's
/// "canceling statement" error (57014) within ten seconds.
pub async fn cancel_ends_a_sleep(c: Client) {
    let token = c.cancel_token();
    let sleeper = tokio::spawn(async move { c.simple_query("SELECT pg_sleep(30)").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    token.cancel_query(NoTls).await.expect("send cancel");
    let err = tokio::time::timeout(Duration::from_secs(10), sleeper)
        .await
        .expect("the cancel ended the sleep")
        .unwrap()
        .expect_err("canceled");
    assert_eq!(err.code().map(|c| c.code()), Some("57014"), "{err}");
}

/// The port of the server that ran `sql` (which must return `current_setting('port')`).
pub async fn served_by(c: &Client, sql: &str) -> u16 {
    first_value(c, sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .parse()
        .expect("a port")
}

pub const WHERE: &str = "SELECT current_setting('port')";

/// Waits until plain reads reach a replica: the function catalog is loaded and the replicas
/// are in the read set.
pub async fn wait_for_replica_reads(c: &Client, primary_port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if served_by(c, WHERE).await != primary_port {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "reads never reached a replica through pgherd"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The application user's server connections on the primary, counted there.
pub fn app_backends(env: &Env) -> i64 {
    env.direct("SELECT count(*) FROM pg_stat_activity WHERE usename = 'app' AND backend_type = 'client backend'")
        .parse()
        .unwrap()
}
