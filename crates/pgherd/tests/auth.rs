//! Authentication and TLS through pgherd: each method succeeding and failing, host-based
//! rules, auth_query, TLS to clients and to servers.

mod common;

use common::*;
use pgherd_testkit::{Pgherd, PgherdConfig, TestCerts, TestCluster};
use pgherd_wire::md5::md5_password_hash;

/// psql with a connection URL; returns stdout or stderr.
fn psql_url(url: &str, sql: &str) -> Result<String, String> {
    psql(url, &["-c", sql])
}

fn refused(
    result: Result<tokio_postgres::Client, tokio_postgres::Error>,
    what: &str,
) -> tokio_postgres::Error {
    match result {
        Ok(_) => panic!("{what}"),
        Err(e) => e,
    }
}

fn expect_refused(result: Result<String, String>, needle: &str) {
    let err = result.expect_err("connection should be refused");
    assert!(err.contains(needle), "expected {needle:?} in:\n{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_accepts_the_right_password_only() {
    let env = env(0, |c| c);
    let client = env.app().await;
    assert_eq!(
        client
            .query_one("SELECT current_user::text", &[])
            .await
            .unwrap()
            .get::<_, String>(0),
        "app"
    );
    let err = refused(
        try_connect(&env.pgherd.conninfo(APP, "wrong", APP)).await,
        "wrong password accepted",
    );
    assert_eq!(code(&err), "28P01");
    assert_eq!(
        err.as_db_error().unwrap().message(),
        "password authentication failed for user \"app\""
    );
    // An unknown user gets the same answer: no hint that the name does not exist.
    let err = refused(
        try_connect(&env.pgherd.conninfo("nobody", "x", APP)).await,
        "unknown user accepted",
    );
    assert_eq!(code(&err), "28P01");
    assert_eq!(
        err.as_db_error().unwrap().message(),
        "password authentication failed for user \"nobody\""
    );
    // A database the server does not have is reported as the server reports it.
    let err = refused(
        try_connect(&env.pgherd.conninfo(APP, APP_PASSWORD, "missing_db")).await,
        "login accepted",
    );
    assert_eq!(code(&err), "3D000");
}

#[test]
fn md5_trust_and_reject_rules() {
    let cluster = TestCluster::start(0);
    let app = cluster.create_user(APP, APP_PASSWORD);
    cluster.sql("CREATE ROLE md5user LOGIN PASSWORD 'md5-pw'");
    cluster.sql("CREATE ROLE trusted LOGIN PASSWORD 'trusted-pw'");
    cluster.sql("CREATE ROLE blocked LOGIN PASSWORD 'blocked-pw'");
    let config = PgherdConfig::new()
        .user(APP, &app, "")
        .user_raw(
            "md5user",
            &format!(
                "md5 = \"{}\"\nserver_password = \"md5-pw\"",
                md5_password_hash("md5user", "md5-pw")
            ),
        )
        .user_raw("trusted", "server_password = \"trusted-pw\"")
        .user_raw("blocked", "server_password = \"blocked-pw\"")
        .hba("users = [\"blocked\"]\nmethod = \"reject\"")
        .hba("users = [\"trusted\"]\naddress = \"127.0.0.1/32\"\nmethod = \"trust\"")
        .hba("users = [\"md5user\", \"app\"]\nmethod = \"md5\"")
        .hba("databases = [\"elsewhere\"]\naddress = \"10.0.0.0/8\"\nmethod = \"trust\"");
    let pgherd = Pgherd::start(BIN, &cluster, &config);
    let url = |user: &str, pw: &str| pgherd.url(user, pw, "postgres");

    assert_eq!(
        psql_url(&url("md5user", "md5-pw"), "SELECT current_user").unwrap(),
        "md5user"
    );
    expect_refused(
        psql_url(&url("md5user", "nope"), "SELECT 1"),
        "password authentication failed for user \"md5user\"",
    );
    // A user with only a SCRAM verifier under an md5 rule gets SCRAM, as in PostgreSQL.
    assert_eq!(
        psql_url(&url(APP, APP_PASSWORD), "SELECT current_user").unwrap(),
        "app"
    );
    assert_eq!(
        psql_url(
            &format!("postgres://trusted@127.0.0.1:{}/postgres", pgherd.port),
            "SELECT current_user"
        )
        .unwrap(),
        "trusted"
    );
    expect_refused(
        psql_url(&url("blocked", "blocked-pw"), "SELECT 1"),
        "pgherd hba rules reject connection for host \"127.0.0.1\", user \"blocked\"",
    );
    // No rule matches a user the rules do not name.
    cluster.sql("CREATE ROLE stranger LOGIN PASSWORD 's'");
    expect_refused(
        psql_url(&url("stranger", "s"), "SELECT 1"),
        "pgherd hba rules reject connection",
    );
}

#[test]
fn auth_query_looks_up_users_in_postgresql() {
    let cluster = TestCluster::start(0);
    cluster.create_user("dynamic", "dyn-pw");
    let config = PgherdConfig::new()
        .section("[auth]\nquery = \"SELECT usename, passwd FROM pg_shadow WHERE usename = $1\"");
    let pgherd = Pgherd::start(BIN, &cluster, &config);
    let url = |user: &str, pw: &str| pgherd.url(user, pw, "postgres");
    // The verifier comes from the server, so the client's proof is passed through to it.
    assert_eq!(
        psql_url(&url("dynamic", "dyn-pw"), "SELECT current_user").unwrap(),
        "dynamic"
    );
    expect_refused(
        psql_url(&url("dynamic", "wrong"), "SELECT 1"),
        "password authentication failed for user \"dynamic\"",
    );
    expect_refused(
        psql_url(&url("ghost", "x"), "SELECT 1"),
        "password authentication failed for user \"ghost\"",
    );
    // A password changed in PostgreSQL applies at the next login.
    cluster.sql("ALTER ROLE dynamic PASSWORD 'new-pw'");
    assert_eq!(
        psql_url(&url("dynamic", "new-pw"), "SELECT current_user").unwrap(),
        "dynamic"
    );
}

fn tls_config(certs: &TestCerts, mode: &str) -> PgherdConfig {
    PgherdConfig::new().section(&format!(
        "[tls]\nmode = \"{mode}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_ca_file = \"{}\"",
        certs.server_cert.display(),
        certs.server_key.display(),
        certs.ca_file.display()
    ))
}

#[test]
fn tls_to_clients_and_certificate_auth() {
    let cluster = TestCluster::start(0);
    let app = cluster.create_user(APP, APP_PASSWORD);
    cluster.sql("CREATE ROLE certuser LOGIN PASSWORD 'cert-pw'");
    let certs = TestCerts::create(&cluster.dir().join("certs"));
    let config = tls_config(&certs, "require")
        .user(APP, &app, "")
        .user_raw("certuser", "server_password = \"cert-pw\"")
        .hba("type = \"hostssl\"\nusers = [\"certuser\"]\nmethod = \"cert\"")
        .hba("method = \"scram-sha-256\"");
    let pgherd = Pgherd::start(BIN, &cluster, &config);
    let ca = certs.ca_file.display().to_string();
    let base = |user: &str, pw: &str, extra: &str| {
        format!("postgres://{user}:{pw}@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={ca}{extra}", pgherd.port)
    };
    let ssl = psql_url(&base(APP, APP_PASSWORD, ""), "SELECT 'tls ok'").unwrap();
    assert_eq!(ssl, "tls ok");
    // tls.mode = require refuses plain connections.
    expect_refused(
        psql_url(
            &format!(
                "postgres://{APP}:{APP_PASSWORD}@127.0.0.1:{}/postgres?sslmode=disable",
                pgherd.port
            ),
            "SELECT 1",
        ),
        "pgherd accepts TLS connections only",
    );
    let (cert, key) = certs.client("certuser");
    let with_cert = format!("&sslcert={}&sslkey={}", cert.display(), key.display());
    assert_eq!(
        psql_url(&base("certuser", "", &with_cert), "SELECT current_user").unwrap(),
        "certuser"
    );
    let (other_cert, other_key) = certs.client("someone-else");
    let wrong_cert = format!(
        "&sslcert={}&sslkey={}",
        other_cert.display(),
        other_key.display()
    );
    expect_refused(
        psql_url(&base("certuser", "", &wrong_cert), "SELECT 1"),
        "certificate authentication failed for user \"certuser\"",
    );
    expect_refused(
        psql_url(&base("certuser", "", ""), "SELECT 1"),
        "connection requires a valid client certificate",
    );
}

#[test]
fn tls_to_servers() {
    let (cluster, certs, probe) = tls_only_cluster();
    let app = cluster.create_user(APP, APP_PASSWORD);
    let config = PgherdConfig::new().user(APP, &app, "").section(&format!(
        "[server_tls]\nmode = \"verify-full\"\nca_file = \"{}\"",
        certs.ca_file.display()
    ));
    let pgherd = Pgherd::start(BIN, &cluster, &config);
    let out = psql_url(
        &pgherd.url(APP, APP_PASSWORD, "postgres"),
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .unwrap();
    assert_eq!(out, "t", "pgherd's server connection must use TLS");
    let _ = std::fs::remove_dir_all(&probe);
}
