//! The command line as a user meets it: `pgherd up` / `status` / `down` on a fresh directory,
//! `check-config` on a broken file, and `up` without PostgreSQL installed.

mod common;

use std::process::Command;

use common::*;

fn pgherd(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().expect("run pgherd")
}

/// psql through pgherd on `port` as `user` (database of the same name), with the password file
/// `pgherd up` wrote.
fn psql_with_pgpass(
    cluster_dir: &std::path::Path,
    port: &str,
    user: &str,
    sql: &str,
) -> std::process::Output {
    Command::new(pgherd_cluster::PgBinaries::find().unwrap().tool("psql"))
        .env("PGPASSFILE", cluster_dir.join("pgpass"))
        .args([
            "-X",
            "-A",
            "-t",
            "-h",
            "127.0.0.1",
            "-p",
            port,
            "-U",
            user,
            "-d",
            user,
        ])
        .args(["-c", sql])
        .output()
        .expect("psql")
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A temporary directory (removed when the first value drops) and the local cluster's
/// directory in it, which `pgherd up` creates.
fn local_dir(prefix: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    let cluster_dir = dir.path().join("local");
    (dir, cluster_dir)
}

#[test]
fn up_status_down_on_a_fresh_directory() {
    let (_dir, cluster_dir) = local_dir("pgherd-up-");
    let dir_arg = cluster_dir.to_str().unwrap();
    let port = pgherd_cluster::free_port().unwrap().to_string();
    let api_port = pgherd_cluster::free_port().unwrap().to_string();
    let up = pgherd(&[
        "up",
        "--dir",
        dir_arg,
        "--replicas",
        "1",
        "--port",
        &port,
        "--api-port",
        &api_port,
        "--detach",
    ]);
    let up_text = text(&up);
    assert!(up.status.success(), "pgherd up failed:\n{up_text}");
    let guard = Down(dir_arg.to_owned());
    assert!(
        up_text.contains(&format!("127.0.0.1:{port}/app")),
        "{up_text}"
    );

    // status --json for scripts.
    let status = pgherd(&["status", "--dir", dir_arg, "--json"]);
    assert!(status.status.success(), "{}", text(&status));
    let json: serde_json::Value =
        serde_json::from_slice(&status.stdout).expect("status --json is JSON");
    assert_eq!(json["pgherd"]["listen"][0], format!("127.0.0.1:{port}"));
    assert_eq!(json["pgherd"]["running"], true);
    assert_eq!(
        json["pgherd"]["api"][0],
        format!("http://127.0.0.1:{api_port}")
    );
    assert_eq!(
        json["pgherd"]["console"],
        format!("postgres://postgres@127.0.0.1:{port}/pgherd")
    );
    // From the running pgherd (its HTTP API), not from the nodes directly.
    assert_eq!(json["source"], "pgherd", "{json}");
    let nodes = json["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    assert_eq!(nodes[0]["name"], "pg1");
    assert_eq!(nodes[0]["role"], "primary");
    assert_eq!(nodes[1]["role"], "replica");
    assert_eq!(nodes[0]["takes_writes"], true, "{json}");
    assert_eq!(nodes[1]["takes_writes"], false, "{json}");
    assert_eq!(nodes[1]["in_read_set"], true, "{json}");
    assert!(nodes[1]["lag_bytes"].is_u64(), "{json}");
    for node in nodes {
        assert_eq!(node["state"], "up");
        assert_eq!(node["host"], "127.0.0.1");
        assert!(node["port"].as_u64().unwrap() > 0);
        assert!(node["data_dir"].as_str().unwrap().starts_with(dir_arg));
    }
    // The replica streams as the replication role, which is no superuser.
    let ask = |sql: &str| {
        let out = psql_with_pgpass(&cluster_dir, &port, "postgres", sql);
        assert!(out.status.success(), "{sql}: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let streaming =
            ask("/* pgherd:primary */ SELECT string_agg(usename, ',') FROM pg_stat_replication");
        if streaming == "replicator" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "streaming as {streaming:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert_eq!(
        ask("/* pgherd:primary */ SELECT rolsuper::text || rolreplication::text FROM pg_roles WHERE rolname = 'replicator'"),
        "falsetrue"
    );
    let config = std::fs::read_to_string(cluster_dir.join("pgherd.toml")).unwrap();
    assert!(config.contains("user = \"replicator\""), "{config}");

    // Operator commands against the running pgherd.
    let detached = pgherd(&["detach", "pg2", "--dir", dir_arg]);
    assert!(detached.status.success(), "{}", text(&detached));
    assert!(
        text(&detached).contains("pg2 detached"),
        "{}",
        text(&detached)
    );
    let status = pgherd(&["status", "--dir", dir_arg, "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(json["nodes"][1]["state"], "detached", "{json}");
    let events = pgherd(&["events", "--dir", dir_arg, "--json"]);
    assert!(events.status.success(), "{}", text(&events));
    let events: serde_json::Value = serde_json::from_slice(&events.stdout).unwrap();
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "detached" && e["node"] == "pg2"),
        "{events}"
    );
    let human = text(&pgherd(&["events", "--dir", dir_arg]));
    assert!(human.contains("detached"), "{human}");
    let attached = pgherd(&["attach", "pg2", "--dir", dir_arg]);
    assert!(attached.status.success(), "{}", text(&attached));
    let unknown = pgherd(&["detach", "nosuch", "--dir", dir_arg]);
    assert!(!unknown.status.success());
    assert!(
        text(&unknown).contains("no node named"),
        "{}",
        text(&unknown)
    );

    // The human table.
    let table = text(&pgherd(&["status", "--dir", dir_arg]));
    assert!(
        table.contains("pg1") && table.contains("primary") && table.contains("replica"),
        "{table}"
    );

    // Secrets stay with their owner: the config holding the superuser's password and the
    // API token, the passwords file and the libpq password file are 0600, and `up` printed
    // no password, only where to read them.
    use std::os::unix::fs::PermissionsExt;
    let passwords = std::fs::read_to_string(cluster_dir.join("passwords")).unwrap();
    for file in ["pgherd.toml", "passwords", "pgpass"] {
        let mode = std::fs::metadata(cluster_dir.join(file))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{file} has mode {:o}", mode & 0o777);
    }
    for line in passwords.lines() {
        let secret = line.split_once('=').unwrap().1;
        assert!(
            !up_text.contains(secret),
            "`up` printed a password:\n{up_text}"
        );
    }
    assert!(up_text.contains("PGPASSFILE="), "{up_text}");
    let via_pgpass = Command::new("psql")
        .env("PGPASSFILE", cluster_dir.join("pgpass"))
        .args([
            &format!("postgres://app@127.0.0.1:{port}/app"),
            "-XAtc",
            "SELECT 'pgpass'",
        ])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&via_pgpass.stdout).trim(),
        "pgpass",
        "{}",
        text(&via_pgpass)
    );

    // The printed connection string works, and writes reach the replica.
    let password = passwords
        .lines()
        .find_map(|l| l.strip_prefix("app="))
        .unwrap()
        .to_owned();
    let url = format!("postgres://app:{password}@127.0.0.1:{port}/app");
    psql(
        &url,
        &[
            "-c",
            "CREATE TABLE hello (x int)",
            "-c",
            "INSERT INTO hello VALUES (1)",
        ],
    )
    .unwrap();
    let replica_port = nodes[1]["port"].as_u64().unwrap().to_string();
    let replica_url = format!("postgres://app:{password}@127.0.0.1:{replica_port}/app");
    let mut seen = String::new();
    for _ in 0..100 {
        seen = psql(&replica_url, &["-c", "SELECT count(*) FROM hello"]).unwrap_or_default();
        if seen == "1" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(seen, "1", "the replica should stream the primary's writes");

    // A switchover from the command line: the old primary comes back as a standby that
    // streams as the replication role too.
    let switched = pgherd(&["switchover", "--dir", dir_arg]);
    assert!(
        switched.status.success(),
        "{}\n{}",
        text(&switched),
        log_tails(&cluster_dir)
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let streaming = ask(
            "/* pgherd:primary */ SELECT current_setting('port') || ' ' || coalesce(string_agg(usename, ','), '') FROM pg_stat_replication",
        );
        if streaming == format!("{replica_port} replicator") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "after the switchover: {streaming:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }

    // A second `up` reuses the running cluster.
    let again = pgherd(&["up", "--dir", dir_arg, "--detach"]);
    assert!(again.status.success(), "{}", text(&again));
    assert!(text(&again).contains("already running"), "{}", text(&again));

    drop(guard);
    let after = pgherd(&["status", "--dir", dir_arg, "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&after.stdout).unwrap();
    assert_eq!(json["pgherd"]["running"], false);
    assert_eq!(json["source"], "nodes");
    assert!(json["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .all(|n| n["state"] == "down"));
}

/// The last lines of every log `pgherd up` keeps (nodes and pgherd), for a failure's message:
/// a failed step is often explained only there.
fn log_tails(cluster_dir: &std::path::Path) -> String {
    let mut out = String::new();
    let listed = |dir: std::path::PathBuf| std::fs::read_dir(dir).into_iter().flatten().flatten();
    let logs = listed(cluster_dir.join("logs")).chain(listed(cluster_dir.to_owned()));
    for entry in logs.filter(|e| e.path().extension().is_some_and(|x| x == "log")) {
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(40)..].join("\n");
        out.push_str(&format!("--- {}\n{tail}\n", entry.path().display()));
    }
    out
}

/// Stops what `up` started even when the test fails half way.
struct Down(String);

impl Drop for Down {
    fn drop(&mut self) {
        let out = pgherd(&["down", "--dir", &self.0]);
        assert!(
            out.status.success() || std::thread::panicking(),
            "pgherd down failed:\n{}",
            text(&out)
        );
    }
}

#[test]
fn check_config_names_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pgherd.toml");
    std::fs::write(
        &path,
        "[[nodes]]\nname = \"pg1\"\nport = 5432\n\n[pool]\nmax_size = 0\n",
    )
    .unwrap();
    let out = pgherd(&["check-config", path.to_str().unwrap()]);
    assert!(!out.status.success());
    let message = text(&out);
    assert!(
        message.contains(&format!(
            "{}:6:12: pool.max_size: must be at least 1",
            path.display()
        )),
        "{message}"
    );
    std::fs::write(&path, "[[nodes]]\nname = \"pg1\"\nport = 5432\n").unwrap();
    let out = pgherd(&["check-config", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    // `run` refuses the same broken file the same way.
    std::fs::write(&path, "[[nodes]]\nname = \"pg1\"\nport = 99999\n").unwrap();
    let out = pgherd(&["run", "--config", path.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(text(&out).contains("pgherd.toml:3:8"), "{}", text(&out));
    // A config holding a password that every local user can read is refused, by `run` too.
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(
        &path,
        "[[nodes]]\nname = \"pg1\"\nport = 5432\n[cluster]\npassword = \"s3cret-s3cret\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    for command in [&["check-config"][..], &["run", "--config"]] {
        let mut args = command.to_vec();
        args.push(path.to_str().unwrap());
        let out = pgherd(&args);
        assert!(
            !out.status.success(),
            "{command:?} accepted a world-readable secret"
        );
        assert!(
            text(&out).contains("pgherd.toml:5:12: cluster.password: holds a secret, but the file is readable by every user (mode 0644)"),
            "{}",
            text(&out)
        );
    }
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = pgherd(&["check-config", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
}

/// `pgherd up --shards 2 --shard-key ...` makes two clusters (a primary and a replica each)
/// behind one endpoint, and pgbench initializes and runs through it in two commands.
#[test]
fn up_with_two_shards_runs_pgbench() {
    let (_dir, cluster_dir) = local_dir("pgherd-up-shards-");
    let dir_arg = cluster_dir.to_str().unwrap();
    let port = pgherd_cluster::free_port().unwrap().to_string();
    let api_port = pgherd_cluster::free_port().unwrap().to_string();
    let up = pgherd(&[
        "up",
        "--dir",
        dir_arg,
        "--replicas",
        "1",
        "--shards",
        "2",
        "--shard-key",
        "pgbench_accounts.aid:integer",
        "--port",
        &port,
        "--api-port",
        &api_port,
        "--detach",
    ]);
    let up_text = text(&up);
    assert!(
        up.status.success(),
        "pgherd up --shards 2 failed:\n{up_text}"
    );
    let guard = Down(dir_arg.to_owned());
    assert!(up_text.contains("Creating 2 shards"), "{up_text}");
    assert!(cluster_dir.join("shard1").join("shard1-pg1").exists());
    let pgbench = |args: &[&str]| {
        Command::new(pgherd_cluster::PgBinaries::find().unwrap().tool("pgbench"))
            .env("PGPASSFILE", cluster_dir.join("pgpass"))
            .args(["-h", "127.0.0.1", "-p", &port, "-U", "app"])
            .args(args)
            .arg("app")
            .output()
            .expect("pgbench")
    };
    let init = pgbench(&["-i", "-s", "1", "-q"]);
    assert!(
        init.status.success(),
        "{}\n{}",
        text(&init),
        log_tails(&cluster_dir)
    );
    let run = pgbench(&["-t", "10", "-c", "2", "-n"]);
    assert!(
        run.status.success() && text(&run).contains("actually processed: 20/20"),
        "{}\n{}",
        text(&run),
        log_tails(&cluster_dir)
    );
    let accounts = psql_with_pgpass(
        &cluster_dir,
        &port,
        "app",
        "SELECT count(*) FROM pgbench_accounts",
    );
    assert_eq!(String::from_utf8_lossy(&accounts.stdout).trim(), "100000");
    // `pgherd status` shows each shard's node and what is sharded.
    let status = pgherd(&["status", "--dir", dir_arg, "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status --json");
    let shards = report["shards"].as_array().cloned().unwrap_or_default();
    let writers: Vec<u64> = shards
        .iter()
        .filter(|s| s["takes_writes"] == true && s["state"] == "up")
        .filter_map(|s| s["shard"].as_u64())
        .collect();
    assert_eq!(writers, vec![0, 1], "{report:#}");
    // Shard 1 is kept as shard 0 is: its primary's standby, streaming under its node name,
    // is synchronous.
    let shard1_primary = shards
        .iter()
        .find(|s| s["shard"] == 1 && s["takes_writes"] == true)
        .and_then(|s| s["port"].as_u64())
        .expect("shard 1's primary")
        .to_string();
    let passwords = std::fs::read_to_string(cluster_dir.join("passwords")).unwrap();
    let superuser_password = passwords
        .lines()
        .find_map(|l| l.strip_prefix("postgres="))
        .expect("the superuser's password");
    let sync = Command::new(pgherd_cluster::PgBinaries::find().unwrap().tool("psql"))
        .env("PGPASSWORD", superuser_password)
        .args(["-X", "-A", "-t", "-h", "127.0.0.1", "-p", &shard1_primary])
        .args(["-U", "postgres", "-d", "postgres"])
        .args(["-c", "SHOW synchronous_standby_names"])
        .output()
        .expect("psql");
    assert_eq!(
        String::from_utf8_lossy(&sync.stdout).trim(),
        "ANY 1 (\"shard1-pg2\")",
        "{}",
        text(&sync)
    );
    assert!(
        shards[0]["sharded_tables"]
            .as_str()
            .is_some_and(|t| t.contains("pgbench_accounts(aid hash)")),
        "{report:#}"
    );
    let table = text(&pgherd(&["status", "--dir", dir_arg]));
    assert!(table.contains("shards (sharded tables: "), "{table}");
    // A switchover to shard 1's replica moves shard 1's primary role, and only it.
    let switched = pgherd(&["switchover", "--dir", dir_arg, "--to", "shard1-pg2"]);
    assert!(
        switched.status.success()
            && text(&switched).contains("switched over from shard1-pg1 to shard1-pg2"),
        "{}\n{}",
        text(&switched),
        log_tails(&cluster_dir)
    );
    let status = pgherd(&["status", "--dir", dir_arg, "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status --json");
    let writers: Vec<(u64, String)> = report["shards"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|s| s["takes_writes"] == true)
        .filter_map(|s| Some((s["shard"].as_u64()?, s["node"].as_str()?.to_owned())))
        .collect();
    assert!(
        writers.contains(&(1, "shard1-pg2".to_owned())),
        "{report:#}"
    );
    assert!(
        writers
            .iter()
            .any(|(shard, node)| *shard == 0 && node == "pg1"),
        "{report:#}"
    );
    let after = pgbench(&["-t", "10", "-c", "2", "-n"]);
    assert!(
        after.status.success() && text(&after).contains("actually processed: 20/20"),
        "{}\n{}",
        text(&after),
        log_tails(&cluster_dir)
    );
    drop(guard);
    let down_again = pgherd(&["down", "--dir", dir_arg]);
    assert!(down_again.status.success(), "{}", text(&down_again));
}

#[test]
fn up_without_postgresql_says_what_to_install() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args([
            "up",
            "--dir",
            dir.path().join("x").to_str().unwrap(),
            "--detach",
        ])
        .env("PGHERD_PG_BIN", "/nonexistent/bin")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out).contains("apt-get install postgresql"),
        "{}",
        text(&out)
    );
}

#[test]
fn passwd_prints_a_verifier_pgherd_accepts() {
    use std::io::Write;
    let mut child = Command::new(BIN)
        .args(["passwd", "alice"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"s3cret\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let snippet = String::from_utf8_lossy(&out.stdout);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pgherd.toml");
    std::fs::write(
        &path,
        format!("[[nodes]]\nname = \"pg1\"\nport = 5432\n\n{snippet}"),
    )
    .unwrap();
    let check = pgherd(&["check-config", path.to_str().unwrap()]);
    assert!(check.status.success(), "{}\n{snippet}", text(&check));
}

/// `pgherd up --instances 2`: a local etcd and two instances in the background, one leading;
/// the printed connection string names both; writes go through either; `down` stops them all.
#[test]
fn up_with_two_instances_and_down() {
    let (_dir, cluster_dir) = local_dir("pgherd-up2-");
    let dir_arg = cluster_dir.to_str().unwrap();
    // Consecutive ports, two in a row, none handed out to another test.
    let consecutive = || pgherd_cluster::free_ports(2).unwrap();
    let (port, api_port) = (consecutive(), consecutive());
    let up = pgherd(&[
        "up",
        "--dir",
        dir_arg,
        "--replicas",
        "1",
        "--instances",
        "2",
        "--port",
        &port.to_string(),
        "--api-port",
        &api_port.to_string(),
    ]);
    let up_text = text(&up);
    assert!(
        up.status.success(),
        "pgherd up --instances 2 failed:\n{up_text}"
    );
    let guard = Down(dir_arg.to_owned());
    assert!(
        up_text.contains(&format!("127.0.0.1:{port},127.0.0.1:{}/app", port + 1)),
        "{up_text}"
    );
    for name in ["pgherd.pid", "pgherd-2.pid", "etcd.pid"] {
        assert!(cluster_dir.join(name).exists(), "no {name}");
    }

    // Both instances registered; one leads.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let json = loop {
        let status = pgherd(&["status", "--dir", dir_arg, "--json"]);
        let json: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap_or_default();
        let instances = json["instances"].as_array().cloned().unwrap_or_default();
        let leaders = instances.iter().filter(|i| i["leads"] == true).count();
        if instances.len() == 2 && leaders == 1 {
            break json;
        }
        assert!(std::time::Instant::now() < deadline, "{json}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let mut names: Vec<&str> = json["instances"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["instance"].as_str())
        .collect();
    names.sort();
    assert_eq!(names, ["pgherd-1", "pgherd-2"], "{json}");

    // Writes through each instance.
    for (i, p) in [port, port + 1].into_iter().enumerate() {
        let sql =
            format!("CREATE TABLE IF NOT EXISTS t{i} (id int); INSERT INTO t{i} VALUES ({i})");
        let out = psql_with_pgpass(&cluster_dir, &p.to_string(), "app", &sql);
        assert!(out.status.success(), "through port {p}: {}", text(&out));
    }

    drop(guard);
    for name in ["pgherd.pid", "pgherd-2.pid", "etcd.pid"] {
        assert!(!cluster_dir.join(name).exists(), "{name} left after down");
    }
}
