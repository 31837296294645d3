//! Several pgherd instances in front of one cluster, agreeing through a real etcd: one leader
//! acts (fails over once), the others route by its view and refuse operator actions; the
//! leader killed, another takes over and acts; etcd gone, writes go on through the lease and
//! the failsafe and wait beyond, nobody fails over, and with etcd back the cluster recovers.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pgherd_testkit::{
    Pgherd, PgherdConfig, TestCerts, TestCluster, TestEtcd, SUPERUSER, SUPERUSER_PASSWORD,
};
use tokio_postgres::Client;

const LEASE_TTL_S: u64 = 3;
/// `[dcs] failsafe_s`: how long past its lease an instance cut off from etcd goes on routing
/// writes.
const FAILSAFE_S: u64 = 4;

fn instance_config(
    roles: &std::path::Path,
    etcd: &TestEtcd,
    name: &str,
    app: &pgherd_wire::scram::ScramVerifier,
) -> PgherdConfig {
    PgherdConfig::new()
        .user(APP, app, "")
        .superuser()
        .proxy("admin_users = [\"postgres\"]")
        .cluster("primary_wait_ms = 500")
        .section("[failover]\nenabled = true")
        .section(&format!(
            "[api]\nlisten = [\"127.0.0.1:{}\"]",
            pgherd_cluster::free_port().expect("a free port")
        ))
        .section(&format!(
            "[dcs]\nendpoints = [\"{}\"]\nscope = \"test\"\ninstance = \"{name}\"\n\
             lease_ttl_s = {LEASE_TTL_S}\nrequest_timeout_ms = 500\nfailsafe_s = {FAILSAFE_S}\n\
             on_role_change = \"echo \\\"$PGHERD_INSTANCE $PGHERD_ROLE\\\" >> {}\"",
            etcd.endpoint(),
            roles.display()
        ))
}

struct Instances {
    a: Pgherd,
    b: Pgherd,
    cluster: TestCluster,
}

fn start(replicas: usize, etcd: &TestEtcd) -> Instances {
    let cluster = TestCluster::start(replicas);
    let app = cluster.create_user(APP, APP_PASSWORD);
    cluster.sql(&format!("CREATE DATABASE {APP} OWNER {APP}"));
    cluster.sql_on("pg1", APP, "CREATE TABLE t (id int PRIMARY KEY, via text)");
    cluster.sql(&format!("ALTER DATABASE {APP} OWNER TO {APP}"));
    cluster.sql_on("pg1", APP, &format!("ALTER TABLE t OWNER TO {APP}"));
    let roles = cluster.dir().join("roles");
    let a = Pgherd::start(BIN, &cluster, &instance_config(&roles, etcd, "a", &app));
    let b = Pgherd::start(BIN, &cluster, &instance_config(&roles, etcd, "b", &app));
    Instances { a, b, cluster }
}

async fn admin(pgherd: &Pgherd) -> Client {
    connect(&pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await
}

/// SHOW CLUSTER's leader column as this instance sees it.
async fn leader_seen_by(pgherd: &Pgherd) -> String {
    let Ok(c) = try_connect(&pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await else {
        return String::new();
    };
    match rows(&c, "SHOW CLUSTER").await {
        Ok(rows) => field(&rows[0], "leader").to_owned(),
        Err(_) => String::new(),
    }
}

async fn wait_for(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `instance`'s `on_role_change` hook has written that it leads: the hook runs in
/// a process of its own, after the lease is taken.
async fn wait_for_leader_hook(cluster: &TestCluster, instance: &str) {
    let roles = cluster.dir().join("roles");
    let line = format!("{instance} leader");
    wait_for(
        &format!("{instance}'s on_role_change hook ran"),
        Duration::from_secs(5),
        async || std::fs::read_to_string(&roles).is_ok_and(|r| r.contains(&line)),
    )
    .await;
}

/// SHOW CLUSTER's write gate as this instance sees it.
async fn gate_seen_by(pgherd: &Pgherd) -> String {
    let Ok(c) = try_connect(&pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await else {
        return String::new();
    };
    match rows(&c, "SHOW CLUSTER").await {
        Ok(rows) => field(&rows[0], "write_gate").to_owned(),
        Err(_) => String::new(),
    }
}

/// Both instances name one leader and route writes (the follower adopted the leader's view).
async fn agreed(a: &Pgherd, b: &Pgherd) {
    wait_for(
        "both instances name one leader and let writes through",
        Duration::from_secs(20),
        async || {
            let (la, lb) = (leader_seen_by(a).await, leader_seen_by(b).await);
            !la.is_empty()
                && la == lb
                && gate_seen_by(a).await == "open"
                && gate_seen_by(b).await == "open"
        },
    )
    .await;
}

/// Inserts one row through `pgherd`; the error's SQLSTATE if it fails.
async fn insert(pgherd: &Pgherd, id: i32, via: &str) -> Result<(), String> {
    let c = try_connect(&pgherd.conninfo(APP, APP_PASSWORD, APP))
        .await
        .map_err(|e| code(&e))?;
    // Retried until it succeeds: a retry of a write that went through must not fail.
    c.batch_execute(&format!(
        "INSERT INTO t VALUES ({id}, '{via}') ON CONFLICT (id) DO NOTHING"
    ))
    .await
    .map_err(|e| {
        let message = e.as_db_error().map(|d| d.message().to_owned());
        format!("{}: {}", code(&e), message.unwrap_or_else(|| e.to_string()))
    })
}

/// Waits until `replica` has replayed everything `primary` has written so far.
async fn replayed(cluster: &TestCluster, primary: &str, replica: &str) {
    let lsn = cluster.sql_on(primary, "postgres", "SELECT pg_current_wal_lsn()");
    let query = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'");
    wait_for(
        "the replica replayed the primary's WAL",
        Duration::from_secs(30),
        async || {
            cluster
                .node(replica)
                .psql("postgres", &query)
                .is_ok_and(|r| r.trim() == "t")
        },
    )
    .await;
}

/// The nodes that accept writes now, asked directly.
fn primaries(cluster: &TestCluster, among: &[&str]) -> Vec<String> {
    among
        .iter()
        .filter(|n| {
            cluster
                .node(n)
                .psql("postgres", "SELECT pg_is_in_recovery()")
                .is_ok_and(|r| r.trim() == "f")
        })
        .map(|n| n.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_fails_over_the_others_follow_and_a_new_leader_takes_over() {
    let etcd = TestEtcd::start();
    let mut instances = start(2, &etcd);
    let Instances { a, b, cluster } = &mut instances;

    agreed(a, b).await;
    let leader_name = leader_seen_by(a).await;
    assert!(leader_name == "a" || leader_name == "b", "{leader_name}");
    let (leader, follower) = if leader_name == "a" {
        (&mut *a, &mut *b)
    } else {
        (&mut *b, &mut *a)
    };

    // Every instance lists both (read from etcd at each campaign), and which leads.
    for pgherd in [&*leader, &*follower] {
        let leads = |n: &str| if n == leader_name { "yes" } else { "no" }.to_owned();
        let expected = vec![("a".to_owned(), leads("a")), ("b".to_owned(), leads("b"))];
        let mut listed = Vec::new();
        wait_for(
            "both instances listed with the leader",
            Duration::from_secs(5),
            async || {
                listed = rows(&admin(pgherd).await, "SHOW INSTANCES").await.unwrap();
                let mut names: Vec<(String, String)> = listed
                    .iter()
                    .map(|r| {
                        (
                            field(r, "instance").to_owned(),
                            field(r, "leads").to_owned(),
                        )
                    })
                    .collect();
                names.sort();
                names == expected
            },
        )
        .await;
        let this: Vec<&str> = listed
            .iter()
            .filter(|r| field(r, "this") == "yes")
            .map(|r| field(r, "pid"))
            .collect();
        assert_eq!(this, vec![pgherd.pid().to_string()], "{listed:?}");
    }
    // `pgherd status --json` lists them too, from the running pgherd's API.
    let out = std::process::Command::new(BIN)
        .args(["status", "--json", "--config"])
        .arg(&follower.config_path)
        .output()
        .unwrap();
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let mut listed: Vec<(String, bool)> = status["instances"]
        .as_array()
        .unwrap_or_else(|| panic!("no instances in {status}"))
        .iter()
        .map(|i| {
            (
                i["instance"].as_str().unwrap_or("").to_owned(),
                i["leads"] == true,
            )
        })
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        vec![
            ("a".to_owned(), leader_name == "a"),
            ("b".to_owned(), leader_name == "b")
        ],
        "{status}"
    );

    // The role-change hook ran on the leader.
    wait_for_leader_hook(cluster, &leader_name).await;

    // Both route writes to the primary.
    insert(leader, 1, "leader")
        .await
        .expect("write through the leader");
    insert(follower, 2, "follower")
        .await
        .expect("write through the follower");

    // An operator action on the follower would be overwritten by the leader's view: refused.
    let console = admin(follower).await;
    let err = rows(&console, "DETACH pg2").await.unwrap_err();
    assert_eq!(code(&err), "55000", "{err:?}");
    let message = err
        .as_db_error()
        .map(|e| e.message().to_owned())
        .unwrap_or_default();
    assert!(
        message.contains(&format!("run it on the leader, {leader_name}")),
        "{message}"
    );

    // The primary dies: the leader promotes one replica; both instances send writes there.
    cluster.wait_replayed();
    cluster
        .node("pg1")
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg1");
    wait_for(
        "writes through the follower reach a new primary",
        Duration::from_secs(30),
        async || insert(follower, 3, "follower after failover").await.is_ok(),
    )
    .await;
    insert(leader, 4, "leader after failover")
        .await
        .expect("write through the leader");
    let promoted = primaries(cluster, &["pg2", "pg3"]);
    assert_eq!(
        promoted.len(),
        1,
        "exactly one replica promoted: {promoted:?}"
    );
    let new_primary = promoted[0].clone();
    let rows_there = cluster.sql_on(
        &new_primary,
        APP,
        "SELECT count(*) FROM t WHERE id IN (1, 2, 3, 4)",
    );
    assert_eq!(
        rows_there.trim(),
        "4",
        "every acknowledged write is on {new_primary}"
    );
    // Only the leader acted.
    assert!(leader.log().contains("promoted; writes go to it now"));
    assert!(
        !follower.log().contains("promoted; writes go to it now"),
        "the follower acted too:\n{}",
        follower.log()
    );
    assert!(follower.log().contains("the leader's view adopted"));

    // The leader instance dies; the other takes the lease over and acts: the new primary
    // fails too, and the last replica is promoted by the new leader.
    leader.signal(libc::SIGKILL);
    let follower_name = if leader_name == "a" { "b" } else { "a" };
    wait_for(
        "the other instance leads",
        Duration::from_secs(4 * LEASE_TTL_S + 10),
        async || leader_seen_by(follower).await == follower_name,
    )
    .await;
    wait_for_leader_hook(cluster, follower_name).await;
    // The dead leader's member key outlives its lease: the new leader knows it may have been
    // routing writes in failsafe, waits that out before it promotes, then removes the key.
    assert!(
        member_session(&etcd, &leader_name).await.is_some(),
        "no member key for {leader_name}"
    );
    replayed(
        cluster,
        &new_primary,
        if new_primary == "pg2" { "pg3" } else { "pg2" },
    )
    .await;
    cluster
        .node(&new_primary)
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill the second primary");
    wait_for(
        "writes reach the last replica, promoted by the new leader",
        Duration::from_secs(30),
        async || {
            insert(follower, 5, "new leader after second failover")
                .await
                .is_ok()
        },
    )
    .await;
    let last = if new_primary == "pg2" { "pg3" } else { "pg2" };
    assert_eq!(primaries(cluster, &[last]), vec![last.to_owned()]);
    assert!(
        follower.log().contains("waiting out the failsafe"),
        "{}",
        follower.log()
    );
    wait_for(
        "the new leader removes the dead leader's member key",
        Duration::from_secs(FAILSAFE_S + 10),
        async || member_session(&etcd, &leader_name).await.is_none(),
    )
    .await;
    assert_eq!(
        cluster.sql_on(last, APP, "SELECT count(*) FROM t").trim(),
        "5",
        "every acknowledged write is on {last}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_etcd_writes_go_on_through_the_lease_and_failsafe_and_nobody_fails_over() {
    let mut etcd = TestEtcd::start();
    let mut instances = start(1, &etcd);
    let Instances { a, b, cluster } = &mut instances;
    agreed(a, b).await;
    let leader_before = leader_seen_by(a).await;
    let lease_of = async |pgherd: &Pgherd| {
        let rows = rows(&admin(pgherd).await, "SHOW CLUSTER").await.unwrap();
        field(&rows[0], "lease").to_owned()
    };
    let leases_before = (lease_of(a).await, lease_of(b).await);

    etcd.kill();
    // Routing goes on while the primary answers, through both instances.
    for (i, pgherd) in [&*a, &*b].into_iter().enumerate() {
        insert(pgherd, 10 + i as i32, "etcd down")
            .await
            .expect("write with etcd down");
    }
    // Beyond the lease, in failsafe: writes still go on, and the console says until when.
    tokio::time::sleep(Duration::from_secs(LEASE_TTL_S + 1)).await;
    for (i, pgherd) in [&*a, &*b].into_iter().enumerate() {
        let row = rows(&admin(pgherd).await, "SHOW CLUSTER").await.unwrap();
        assert_eq!(field(&row[0], "write_gate"), "open", "{row:?}");
        let dcs = field(&row[0], "dcs");
        assert!(
            dcs.starts_with("unreachable, writes go on in failsafe for"),
            "{dcs}"
        );
        insert(pgherd, 12 + i as i32, "failsafe")
            .await
            .expect("write in failsafe");
    }
    // Beyond the failsafe, nobody may act, and writes are refused (a client of several
    // instances moves on to one with a lease): another instance, cut off from these two but
    // not from etcd, could be replacing the primary.
    tokio::time::sleep(Duration::from_secs(FAILSAFE_S)).await;
    for pgherd in [&*a, &*b] {
        let row = rows(&admin(pgherd).await, "SHOW CLUSTER").await.unwrap();
        assert_eq!(field(&row[0], "write_gate"), "refused", "{row:?}");
        assert_eq!(field(&row[0], "gate_reason"), "no_lease", "{row:?}");
        let refused = insert(pgherd, 14, "no lease").await.unwrap_err();
        assert!(refused.starts_with("25006"), "{refused}");
    }
    cluster.wait_replayed();
    cluster
        .node("pg1")
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg1");
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        primaries(cluster, &["pg2"]).is_empty(),
        "pg2 was promoted without a lease"
    );
    // Still without a lease: refused as such, before anything is said about the primary.
    let refused = insert(a, 20, "no primary").await.unwrap_err();
    assert!(refused.starts_with("25006"), "{refused}");

    // etcd is back: an instance leads again and fails over.
    etcd.restart();
    wait_for(
        "writes through both instances reach pg2",
        Duration::from_secs(40),
        async || {
            insert(a, 21, "etcd back").await.is_ok() && insert(b, 22, "etcd back").await.is_ok()
        },
    )
    .await;
    assert_eq!(primaries(cluster, &["pg2"]), vec!["pg2".to_owned()]);
    // etcd kept the leases through its restart, and each instance kept using its own: the
    // leadership did not change hands for an outage of etcd alone.
    assert_eq!((lease_of(a).await, lease_of(b).await), leases_before);
    assert_eq!(leader_seen_by(a).await, leader_before);
    assert_eq!(leader_seen_by(b).await, leader_before);
    // Settled, the view stays as it is: nothing is changed again and again.
    let version = |rows: Vec<Vec<(String, String)>>| field(&rows[0], "version").to_owned();
    let console = admin(a).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = version(rows(&console, "SHOW CLUSTER").await.unwrap());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = version(rows(&console, "SHOW CLUSTER").await.unwrap());
    assert_eq!(before, after, "the view keeps changing:\n{}", a.log());
    assert_eq!(
        cluster
            .sql_on(
                "pg2",
                APP,
                "SELECT count(*) FROM t WHERE id IN (10, 11, 12, 13, 21, 22)"
            )
            .trim(),
        "6"
    );
}

/// An instance that starts while etcd is down has no view: it holds writes and says why,
/// rather than elect a primary on its own; once etcd answers it leads (alone) and writes flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_never_read_a_view_holds_writes_and_says_why() {
    let mut etcd = TestEtcd::start();
    etcd.kill();
    let cluster = TestCluster::start(1);
    let app = cluster.create_user(APP, APP_PASSWORD);
    cluster.sql(&format!("CREATE DATABASE {APP} OWNER {APP}"));
    cluster.sql_on("pg1", APP, "CREATE TABLE t (id int PRIMARY KEY, via text)");
    cluster.sql_on("pg1", APP, &format!("ALTER TABLE t OWNER TO {APP}"));
    let roles = cluster.dir().join("roles");
    let a = Pgherd::start(BIN, &cluster, &instance_config(&roles, &etcd, "a", &app));

    let console = admin(&a).await;
    let cluster_row = rows(&console, "SHOW CLUSTER").await.unwrap();
    assert_eq!(
        field(&cluster_row[0], "write_gate"),
        "held",
        "{cluster_row:?}"
    );
    assert_eq!(
        field(&cluster_row[0], "gate_reason"),
        "no_view",
        "{cluster_row:?}"
    );
    assert_eq!(
        field(&cluster_row[0], "gate_detail"),
        "this instance has not read the cluster view from etcd yet"
    );
    let refused = insert(&a, 1, "no view").await.unwrap_err();
    assert!(refused.starts_with("08006"), "{refused}");

    etcd.restart();
    let deadline = Instant::now() + Duration::from_secs(30);
    while insert(&a, 2, "leading").await.is_err() {
        assert!(
            Instant::now() < deadline,
            "writes did not flow within 30 s of etcd's restart; etcd's log:\n{}",
            etcd.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(leader_seen_by(&a).await, "a");
}

/// The lease of an instance's latest session, as its member key in etcd names it.
async fn member_session(etcd: &TestEtcd, instance: &str) -> Option<i64> {
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .expect("connect to etcd");
    let answer = client
        .get(format!("/test/members/{instance}"), None)
        .await
        .expect("read a member key");
    // "<lease> <view lease> <view version> <failsafe ms>"
    let kv = answer.kvs().first()?;
    kv.value_str().ok()?.split(' ').next()?.parse().ok()
}

/// Turns authentication on in an etcd that takes clients over TLS with a certificate: users
/// `root` and `pgherd` (password `password`), both with the role `root`.
async fn enable_etcd_auth(etcd: &TestEtcd, certs: &TestCerts, password: &str) {
    use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
    let (cert, key) = certs.client("root");
    let read = |path: &std::path::Path| std::fs::read(path).expect("certificate file");
    let tls = TlsOptions::new()
        .ca_certificate(Certificate::from_pem(read(&certs.ca_file)))
        .identity(Identity::from_pem(read(&cert), read(&key)));
    let mut client = Client::connect([etcd.endpoint()], Some(ConnectOptions::new().with_tls(tls)))
        .await
        .expect("connect to etcd over TLS");
    for user in ["root", "pgherd"] {
        client
            .user_add(user, password, None)
            .await
            .expect("add user");
        client
            .user_grant_role(user, "root")
            .await
            .expect("grant role");
    }
    client.auth_enable().await.expect("enable authentication");
}

/// etcd over TLS only, client certificates required (`--client-cert-auth`) and authentication
/// on: an instance given etcd's CA, its own certificate and an etcd user leads and lets writes
/// through; one with a wrong password reaches nothing, says why, and holds writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_reaches_etcd_over_tls_as_an_etcd_user() {
    let cluster = TestCluster::start(1);
    let app = cluster.create_user(APP, APP_PASSWORD);
    cluster.sql(&format!("CREATE DATABASE {APP} OWNER {APP}"));
    cluster.sql_on("pg1", APP, "CREATE TABLE t (id int PRIMARY KEY, via text)");
    cluster.sql_on("pg1", APP, &format!("ALTER TABLE t OWNER TO {APP}"));
    let certs = TestCerts::create(&cluster.dir().join("etcd-certs"));
    let etcd = TestEtcd::start_tls(&certs);
    enable_etcd_auth(&etcd, &certs, "etcd-password").await;
    let (cert, key) = certs.client("pgherd");
    let config = |name: &str, password: &str| {
        PgherdConfig::new()
            .user(APP, &app, "")
            .superuser()
            .proxy("admin_users = [\"postgres\"]")
            .section("[failover]\nenabled = true")
            .section(&format!(
                "[dcs]\nendpoints = [\"{}\"]\nscope = \"tls\"\ninstance = \"{name}\"\n\
                 lease_ttl_s = {LEASE_TTL_S}\nrequest_timeout_ms = 500\n\
                 ca_file = \"{}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n\
                 username = \"pgherd\"\npassword = \"{password}\"",
                etcd.endpoint(),
                certs.ca_file.display(),
                cert.display(),
                key.display()
            ))
    };
    assert!(etcd.endpoint().starts_with("https://"));
    let a = Pgherd::start(BIN, &cluster, &config("a", "etcd-password"));
    wait_for(
        "the instance leads over TLS",
        Duration::from_secs(20),
        async || leader_seen_by(&a).await == "a" && gate_seen_by(&a).await == "open",
    )
    .await;
    insert(&a, 1, "over tls")
        .await
        .expect("write through the leader");

    let b = Pgherd::start(BIN, &cluster, &config("b", "wrong"));
    let mut seen = Vec::new();
    wait_for(
        "the instance with a wrong password says etcd refused it",
        Duration::from_secs(20),
        async || {
            let Ok(c) = try_connect(&b.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await
            else {
                return false;
            };
            seen = rows(&c, "SHOW CLUSTER").await.unwrap_or_default();
            seen.first().is_some_and(|r| {
                field(r, "dcs").starts_with("unreachable")
                    && field(r, "dcs").contains("authentication")
            })
        },
    )
    .await;
    assert_eq!(field(&seen[0], "gate_reason"), "no_view", "{seen:?}");
    let refused = insert(&b, 2, "wrong password").await.unwrap_err();
    assert!(refused.starts_with("08006"), "{refused}");
}

/// Issue 12 with several instances: each decodes the WAL itself through a slot of its own
/// (named after the instance), a write through one instance is never served stale by that
/// instance, and no instance serves an answer a commit changed once it has decoded that
/// commit, whether the commit came through it, through the other instance or directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_instance_decodes_the_wal_and_serves_nothing_a_decoded_commit_changed() {
    use common::cache::{cache_row, decoded_lsn, read_until_served};
    let etcd = TestEtcd::start();
    let instances = start(0, &etcd);
    let Instances { a, b, cluster } = &instances;
    agreed(a, b).await;
    cluster.sql_on("pg1", APP, "INSERT INTO t VALUES (1, 'v0')");
    let sql = "/* pgherd:cache */ SELECT via FROM t WHERE id = 1";
    let app = |p: &Pgherd| p.conninfo(APP, APP_PASSWORD, APP);
    let (reader_a, reader_b) = (connect(&app(a)).await, connect(&app(b)).await);
    let (writer_a, writer_b) = (connect(&app(a)).await, connect(&app(b)).await);
    let (console_a, console_b) = (admin(a).await, admin(b).await);
    assert_eq!(read_until_served(&reader_a, &console_a, sql).await, "v0");
    assert_eq!(read_until_served(&reader_b, &console_b, sql).await, "v0");
    for name in ["a", "b"] {
        let slots = cluster.sql_on(
            "pg1",
            "postgres",
            &format!(
                "SELECT count(*) FROM pg_replication_slots \
                 WHERE slot_name LIKE 'pgherd\\_cache\\_{name}\\_%' AND active"
            ),
        );
        assert_eq!(slots.trim(), "1", "instance {name}'s stream");
    }

    let mut stale_before_decoded = [0; 2];
    for round in 1..=30 {
        let value = format!("v{round}");
        let update = format!("UPDATE t SET via = '{value}' WHERE id = 1");
        // Through A, through B, and directly on the primary, in turn.
        let through = match round % 3 {
            0 => {
                writer_a.batch_execute(&update).await.unwrap();
                Some(0)
            }
            1 => {
                writer_b.batch_execute(&update).await.unwrap();
                Some(1)
            }
            _ => {
                cluster.sql_on("pg1", APP, &update);
                None
            }
        };
        let committed = cluster.sql_on("pg1", "postgres", "SELECT pg_current_wal_lsn()");
        let committed = pgherd_route::balance::parse_lsn(committed.trim()).unwrap();
        for (i, (reader, console)) in [(&reader_a, &console_a), (&reader_b, &console_b)]
            .into_iter()
            .enumerate()
        {
            let decoded_before = decoded_lsn(console).await;
            let got = first_value(reader, sql).await.unwrap();
            if got == value {
                continue;
            }
            assert!(
                decoded_before < committed && through != Some(i),
                "round {round}: instance {} answered {got} after the commit of {value} \
                 (at {committed:X}) was decoded (at {decoded_before:X}) or went through it: {:?}",
                ["a", "b"][i],
                cache_row(console).await
            );
            stale_before_decoded[i] += 1;
        }
        // Once each instance has decoded the commit, each answers the new value.
        for (reader, console) in [(&reader_a, &console_a), (&reader_b, &console_b)] {
            let started = Instant::now();
            while decoded_lsn(console).await < committed {
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "round {round}: the commit was never decoded: {:?}",
                    cache_row(console).await
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(first_value(reader, sql).await.unwrap(), value);
        }
    }
    // The cache still serves on both (not every read went to the server).
    assert_eq!(read_until_served(&reader_a, &console_a, sql).await, "v30");
    assert_eq!(read_until_served(&reader_b, &console_b, sql).await, "v30");
    eprintln!(
        "answers older than a commit not yet decoded by the instance that served them: a {}, b {}",
        stale_before_decoded[0], stale_before_decoded[1]
    );
}

/// Writes rows `base + n` through `url` until `stop`, on one connection while it lasts;
/// returns the acknowledged ones.
async fn write_until(
    url: String,
    base: i64,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<i64> {
    let mut acked = Vec::new();
    let mut client = None;
    let mut n = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if client.is_none() {
            client = try_connect(&url).await.ok();
        }
        let Some(c) = &client else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let id = base + n;
        n += 1;
        match c
            .batch_execute(&format!("INSERT INTO t VALUES ({id}, 'writer')"))
            .await
        {
            Ok(()) => acked.push(id),
            // Cut by the failover: unacknowledged, allowed to be lost.
            Err(e) if e.is_closed() => client = None,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    acked
}

/// The leading instance is upgraded (its new binary takes its clients, its etcd lease and so
/// its leadership: no election, nobody else acts meanwhile, writes through both instances go
/// on), and the new process then fails the primary over, once, losing no acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_leader_leads_on_with_its_lease_and_fails_over_once() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let etcd = TestEtcd::start();
    let mut instances = start(2, &etcd);
    let Instances { a, b, cluster } = &mut instances;
    agreed(a, b).await;
    let leader_name = leader_seen_by(a).await;
    let (leader, follower) = if leader_name == "a" {
        (&mut *a, &mut *b)
    } else {
        (&mut *b, &mut *a)
    };
    let follower_name = if leader_name == "a" { "b" } else { "a" };
    wait_for(
        "the leader's on_role_change hook ran",
        Duration::from_secs(5),
        async || {
            std::fs::read_to_string(cluster.dir().join("roles"))
                .is_ok_and(|r| r.contains(&format!("{leader_name} leader")))
        },
    )
    .await;
    let lease_before = member_session(&etcd, &leader_name).await;
    assert!(lease_before.is_some(), "the leader has a member key");

    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = [(&*leader, 1_000_000), (&*follower, 2_000_000)]
        .into_iter()
        .map(|(pgherd, base)| {
            tokio::spawn(write_until(
                pgherd.conninfo(APP, APP_PASSWORD, APP),
                base,
                stop.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;

    let answer = first_value(&admin(leader).await, "UPGRADE")
        .await
        .expect("UPGRADE on the leading instance");
    let new_pid = upgrade_pid(&answer);
    leader.successor(new_pid);
    assert!(
        leader.wait_exit(Duration::from_secs(30)).is_some(),
        "the old process exits:\n{}",
        leader.log()
    );
    // The new process leads on the same lease: no election, the follower never led.
    wait_for(
        "the new process names itself leader, as the follower does",
        Duration::from_secs(10),
        async || {
            leader_seen_by(leader).await == leader_name
                && leader_seen_by(follower).await == leader_name
        },
    )
    .await;
    assert_eq!(member_session(&etcd, &leader_name).await, lease_before);
    let roles = std::fs::read_to_string(cluster.dir().join("roles")).unwrap_or_default();
    assert!(
        !roles.contains(&format!("{follower_name} leader"))
            && !roles.contains(&format!("{leader_name} follower")),
        "the leadership moved during the upgrade:\n{roles}"
    );
    // The instance's record names the new process.
    wait_for(
        "the instance's record names the new process",
        Duration::from_secs(5),
        async || {
            let listed = rows(&admin(leader).await, "SHOW INSTANCES").await.unwrap();
            listed
                .iter()
                .any(|r| field(r, "this") == "yes" && field(r, "pid") == new_pid.to_string())
        },
    )
    .await;

    // The primary dies: the upgraded leader promotes one replica, and only it acts.
    cluster.wait_replayed();
    cluster
        .node("pg1")
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg1");
    wait_for(
        "writes through the follower reach a new primary",
        Duration::from_secs(30),
        async || insert(follower, 3, "after failover").await.is_ok(),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let mut acked = Vec::new();
    for w in writers {
        acked.extend(w.await.expect("a writer"));
    }
    let promoted = primaries(cluster, &["pg2", "pg3"]);
    assert_eq!(promoted.len(), 1, "one replica promoted: {promoted:?}");
    let log = leader.log();
    assert_eq!(
        log.matches("promoted; writes go to it now").count(),
        1,
        "the upgraded leader promoted once:\n{log}"
    );
    assert!(
        !follower.log().contains("promoted; writes go to it now"),
        "the follower acted:\n{}",
        follower.log()
    );
    assert!(acked.len() > 20, "only {} writes acknowledged", acked.len());
    let present = rows_present(cluster, &promoted[0], "t", &acked);
    assert_eq!(present, acked.len(), "acknowledged writes lost");
}
