use std::path::Path;

use super::*;

const NODE: &str = "[[nodes]]\nname = \"pg1\"\nport = 5432\n";

fn parse(src: &str) -> Result<Config, ConfigError> {
    Config::parse(src, Path::new("pgherd.toml"))
}

/// Asserts that `src` fails with exactly `expected` ("file:line:col: field: message" prefix).
fn check_err(src: &str, expected: &str) {
    let err = parse(src)
        .expect_err("config should be rejected")
        .to_string();
    assert!(
        err.starts_with(expected),
        "\n   got: {err}\nwanted: {expected}..."
    );
}

#[test]
fn minimal_config_gets_defaults() {
    let config = parse(NODE).unwrap();
    assert_eq!(config.proxy.listen, vec!["127.0.0.1:6432".parse().unwrap()]);
    assert_eq!(config.pool.mode, PoolMode::Transaction);
    assert_eq!(config.pool.max_size, 20);
    assert_eq!(config.nodes[0].host, "127.0.0.1");
    assert_eq!(config.hba.len(), 1);
    assert_eq!(config.hba[0].method, AuthMethod::ScramSha256);
    let resolved = config.resolve("anything", "anyone").unwrap();
    assert_eq!(resolved.server_dbname, "anything");
}

#[test]
fn resolution_order_is_user_then_database_then_pool() {
    let src = format!(
        "{NODE}[pool]\nmode = \"transaction\"\nmax_size = 7\n\
         [databases.app]\ndbname = \"app_prod\"\nmode = \"statement\"\nmax_size = 3\n\
         [users.bob]\nmode = \"session\"\n"
    );
    let config = parse(&src).unwrap();
    let alice = config.resolve("app", "alice").unwrap();
    assert_eq!(
        (
            alice.server_dbname.as_str(),
            alice.pool.mode,
            alice.pool.max_size
        ),
        ("app_prod", PoolMode::Statement, 3)
    );
    let bob = config.resolve("app", "bob").unwrap();
    assert_eq!(bob.pool.mode, PoolMode::Session);
    // Only "app" is listed, so other databases are not served.
    assert!(config.resolve("other", "alice").is_none());
}

#[test]
fn errors_name_file_line_and_field() {
    check_err(
        &format!("{NODE}[pgherd]\nlisten = [\"127.0.0.1:6432\", \"nonsense\"]\n"),
        "pgherd.toml:5:29: pgherd.listen[1]: \"nonsense\" is not an address",
    );
    check_err(
        &format!("{NODE}[[hba]]\nmethod = \"trust\"\n[[hba]]\naddress = \"10.0.0/8\"\nmethod = \"md5\"\n"),
        "pgherd.toml:7:11: hba[1].address: \"10.0.0/8\" is not an address or CIDR block",
    );
    check_err(
        &format!("{NODE}[pool]\nmode = \"txn\"\n"),
        "pgherd.toml:5:8: pool.mode: unknown pool mode \"txn\"",
    );
    check_err(
        &format!("{NODE}[users.alice]\nscram = \"SCRAM-SHA-256$x\"\n"),
        "pgherd.toml:5:9: users.alice.scram: invalid SCRAM verifier",
    );
    check_err(
        &format!("{NODE}[[nodes]]\nname = \"pg1\"\nport = 5433\n"),
        "pgherd.toml:5:8: nodes[1].name: duplicate node name \"pg1\"",
    );
    check_err(
        &format!("{NODE}[databases.\"*\"]\ndbname = \"x\"\n"),
        "pgherd.toml:5:10: databases.\"*\".dbname: the \"*\" entry",
    );
    check_err(
        &format!("{NODE}[pool]\nmax_size = 2\nmin_size = 3\n"),
        "pgherd.toml:6:12: pool.min_size: must not exceed max_size",
    );
}

#[test]
fn syntax_and_type_errors_are_placed() {
    check_err(
        &format!("{NODE}[pgherd]\nlisen = []\n"),
        "pgherd.toml:5:1: unknown field `lisen`",
    );
    check_err(
        &format!("{NODE}[pool]\nmax_size = \"big\"\n"),
        "pgherd.toml:5:12: invalid type: string \"big\", expected u32",
    );
    check_err("[[nodes]\n", "pgherd.toml:1:");
    check_err("", "pgherd.toml: nodes: at least one [[nodes]] entry");
}

#[test]
fn cert_auth_needs_a_client_ca() {
    check_err(
        &format!("{NODE}[[hba]]\ntype = \"hostssl\"\nmethod = \"cert\"\n"),
        "pgherd.toml:6:10: hba[0].method: cert authentication needs [tls] with client_ca_file",
    );
}

#[test]
fn relative_paths_are_relative_to_the_config_file() {
    let src = format!("{NODE}[tls]\ncert_file = \"server.crt\"\nkey_file = \"/abs/server.key\"\n");
    let config = Config::parse(&src, Path::new("/etc/pgherd/pgherd.toml")).unwrap();
    let tls = config.client_tls.unwrap();
    assert_eq!(tls.cert_file, Path::new("/etc/pgherd/server.crt"));
    assert_eq!(tls.key_file, Path::new("/abs/server.key"));
}

#[test]
fn a_nodes_socket_dir_is_a_path_that_fits_a_socket() {
    let src = format!("{NODE}socket_dir = \"run\"\n");
    let config = Config::parse(&src, Path::new("/srv/pgherd/pgherd.toml")).unwrap();
    assert_eq!(
        config.nodes[0].socket_dir.as_deref(),
        Some(Path::new("/srv/pgherd/run"))
    );
    assert_eq!(parse(NODE).unwrap().nodes[0].socket_dir, None);
    let long = format!("/{}", "d".repeat(100));
    check_err(
        &format!("{NODE}socket_dir = \"{long}\"\n"),
        &format!("pgherd.toml:4:14: nodes[0].socket_dir: {long} is too long for a Unix-domain socket's path"),
    );
}

#[test]
fn unreadable_file_is_reported_with_its_path() {
    let err = Config::load(Path::new("/nonexistent/pgherd.toml")).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("/nonexistent/pgherd.toml: cannot read"),
        "{err}"
    );
}

#[test]
fn replication_defaults_to_sync_and_rejects_unknown_levels() {
    let config = parse(NODE).unwrap();
    assert_eq!(config.replication.durability, Durability::Sync);
    assert_eq!(config.replication.sync_standbys, 1);
    assert_eq!(config.replication.synchronous_commit, SynchronousCommit::On);
    let config = parse(&format!(
        "{NODE}[replication]\ndurability = \"strict\"\nsync_standbys = 2\nsynchronous_commit = \"remote_apply\"\n"
    ))
    .unwrap();
    assert_eq!(config.replication.durability, Durability::Strict);
    assert_eq!(config.replication.sync_standbys, 2);
    check_err(
        &format!("{NODE}[replication]\ndurability = \"eager\"\n"),
        "pgherd.toml:5:14: replication.durability: unknown durability \"eager\"; expected async, sync or strict",
    );
    check_err(
        &format!("{NODE}[replication]\nsync_standbys = 0\n"),
        "pgherd.toml:5:17: replication.sync_standbys: must be at least 1",
    );
    check_err(
        &format!("{NODE}[replication]\nsynchronous_commit = \"local\"\n"),
        "pgherd.toml:5:22: replication.synchronous_commit: unknown synchronous_commit level \"local\"",
    );
}

#[test]
fn secrets_readable_by_everyone_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pgherd.toml");
    let set_mode = |mode: u32| {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    let with_secret =
        format!("{NODE}\n[cluster]\nuser = \"postgres\"\npassword = \"hunter2-hunter2\"\n");
    std::fs::write(&path, &with_secret).unwrap();
    set_mode(0o644);
    let err = Config::load(&path).unwrap_err().to_string();
    let expected = format!("{}:7:12: cluster.password: holds a secret, but the file is readable by every user (mode 0644)", path.display());
    assert!(
        err.starts_with(&expected),
        "\n   got: {err}\nwanted: {expected}"
    );
    set_mode(0o640);
    let config = Config::load(&path).unwrap();
    assert!(config
        .group_readable_secret()
        .unwrap()
        .contains("cluster.password"));
    set_mode(0o600);
    assert!(Config::load(&path)
        .unwrap()
        .group_readable_secret()
        .is_none());
    // Without secrets, any mode will do.
    std::fs::write(&path, NODE).unwrap();
    set_mode(0o644);
    assert!(Config::load(&path).unwrap().secret.is_none());
    // The writer used for generated configs leaves nobody else a way in, even over an
    // existing file.
    set_mode(0o666);
    write_private_file(&path, &with_secret).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert!(Config::load(&path).is_ok());
}

#[test]
fn secrets_come_from_files_or_the_environment() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("pgherd.toml");
    let secret = dir.path().join("cluster.password");
    std::fs::write(&secret, "from-a-file\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let token = dir.path().join("api.token");
    std::fs::write(&token, "a-token-of-sixteen-or-more\r\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o640)).unwrap();
    // Only this test reads this variable.
    std::env::set_var("PGHERD_TEST_SECRET_SERVER_PASSWORD", "from-the-environment");
    let source = format!(
        "{NODE}[cluster]\npassword_file = \"cluster.password\"\n\
         [api]\ntoken_file = \"{}\"\n\
         [users.app]\nserver_password_env = \"PGHERD_TEST_SECRET_SERVER_PASSWORD\"\n",
        token.display()
    );
    let config = Config::parse(&source, &config_path).unwrap();
    assert_eq!(config.cluster.password.as_deref(), Some("from-a-file"));
    assert_eq!(
        config.api.token.as_deref(),
        Some("a-token-of-sixteen-or-more")
    );
    assert_eq!(
        config.users["app"].server_password.as_deref(),
        Some("from-the-environment")
    );
    // No secret in the TOML itself: any mode will do for the config file.
    assert!(config.secret.is_none());

    // A password file every user can read is refused, naming the field and the fix.
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = Config::parse(&source, &config_path)
        .unwrap_err()
        .to_string();
    let expected = format!(
        "{}:5:17: cluster.password_file: {} is readable by every user (mode 0644); run `chmod 600 {}`",
        config_path.display(),
        secret.display(),
        secret.display()
    );
    assert!(
        err.starts_with(&expected),
        "\n   got: {err}\nwanted: {expected}"
    );
}

#[test]
fn a_secret_source_that_is_missing_or_doubled_is_an_error() {
    check_err(
        &format!("{NODE}[cluster]\npassword_env = \"PGHERD_TEST_NO_SUCH_VARIABLE\"\n"),
        "pgherd.toml:5:16: cluster.password_env: the environment variable PGHERD_TEST_NO_SUCH_VARIABLE is not set",
    );
    check_err(
        &format!("{NODE}[cluster]\npassword = \"x\"\npassword_file = \"pw\"\n"),
        "pgherd.toml:6:17: cluster.password_file: set only one of password, password_file and password_env",
    );
    check_err(
        &format!(
            "{NODE}[auth]\nquery = \"SELECT 1\"\npassword_file = \"/nonexistent/pgherd-pw\"\n"
        ),
        "pgherd.toml:6:17: auth.password_file: cannot read /nonexistent/pgherd-pw",
    );
}

#[test]
fn dcs_is_optional_and_checked() {
    let config = Config::parse(NODE, Path::new("pgherd.toml")).unwrap();
    assert_eq!(config.dcs, None);
    let config = Config::parse(
        &format!("{NODE}[dcs]\nendpoints = [\"127.0.0.1:2379\", \"http://10.0.0.2:2379\"]\ninstance = \"a\"\n"),
        Path::new("pgherd.toml"),
    )
    .unwrap();
    let dcs = config.dcs.unwrap();
    assert_eq!(
        dcs.endpoints,
        ["http://127.0.0.1:2379", "http://10.0.0.2:2379"]
    );
    assert_eq!((dcs.scope.as_str(), dcs.lease_ttl_s), ("pgherd", 10));
    assert_eq!(
        dcs.failsafe_s, 10,
        "failsafe as long as the lease unless set"
    );
    assert_eq!(dcs.instance.as_deref(), Some("a"));
    check_err(
        &format!("{NODE}[dcs]\nscope = \"x\"\n"),
        "pgherd.toml:4:1: dcs.endpoints: name at least one etcd endpoint",
    );
    check_err(
        &format!("{NODE}[dcs]\nendpoints = [\"https://e:2379\"]\n"),
        "pgherd.toml:5:14: dcs.endpoints[0]: \"https://e:2379\" is not an etcd client URL, e.g. \"http://127.0.0.1:2379\" (for https, set ca_file)",
    );
    // TLS and a user.
    let config = Config::parse(
        &format!("{NODE}[dcs]\nendpoints = [\"e:2379\", \"https://f:2379\"]\nca_file = \"ca.crt\"\ncert_file = \"/etc/c.crt\"\nkey_file = \"c.key\"\nusername = \"pgherd\"\npassword = \"secret\"\n"),
        Path::new("/etc/pgherd/pgherd.toml"),
    )
    .unwrap();
    let dcs = config.dcs.unwrap();
    assert_eq!(dcs.endpoints, ["https://e:2379", "https://f:2379"]);
    let tls = dcs.tls.unwrap();
    assert_eq!(tls.ca_file, Path::new("/etc/pgherd/ca.crt"));
    assert_eq!(
        tls.identity,
        Some((
            Path::new("/etc/c.crt").to_owned(),
            Path::new("/etc/pgherd/c.key").to_owned()
        ))
    );
    assert_eq!(dcs.user, Some(("pgherd".to_owned(), "secret".to_owned())));
    check_err(
        &format!("{NODE}[dcs]\nendpoints = [\"http://e:2379\"]\nca_file = \"ca.crt\"\n"),
        "pgherd.toml:5:14: dcs.endpoints[0]: \"http://e:2379\" is not an etcd client URL over TLS",
    );
    check_err(
        &format!(
            "{NODE}[dcs]\nendpoints = [\"e:2379\"]\ncert_file = \"c.crt\"\nkey_file = \"c.key\"\n"
        ),
        "pgherd.toml:6:13: dcs.cert_file: a client certificate needs TLS to etcd",
    );
    check_err(
        &format!(
            "{NODE}[dcs]\nendpoints = [\"e:2379\"]\nca_file = \"ca\"\ncert_file = \"c.crt\"\n"
        ),
        "pgherd.toml:7:13: dcs.cert_file: needs key_file",
    );
    check_err(
        &format!("{NODE}[dcs]\nendpoints = [\"e:2379\"]\nusername = \"u\"\n"),
        "pgherd.toml:6:12: dcs.username: needs a password",
    );
    check_err(
        &format!("{NODE}[dcs]\nendpoints = [\"e:2379\"]\nlease_ttl_s = 1\n"),
        "pgherd.toml:6:15: dcs.lease_ttl_s: between 2 and 300 seconds",
    );
    check_err(
        &format!("{NODE}[dcs]\nendpoints = [\"e:2379\"]\nfailsafe_s = 4000\n"),
        "pgherd.toml:6:14: dcs.failsafe_s: at most 3600 seconds",
    );
    let config = Config::parse(
        &format!("{NODE}[dcs]\nendpoints = [\"e:2379\"]\nfailsafe_s = 0\n"),
        Path::new("pgherd.toml"),
    )
    .unwrap();
    assert_eq!(config.dcs.unwrap().failsafe_s, 0);
    check_err(
        &format!("{NODE}[dcs]\nendpoints = [\"e:2379\"]\nscope = \"a/b\"\n"),
        "pgherd.toml:6:9: dcs.scope: letters, digits",
    );
}

const SHARDED: &str = "[[nodes]]\nname = \"a\"\nport = 5432\n\
[[nodes]]\nname = \"a2\"\nport = 5433\n\
[[nodes]]\nname = \"b\"\nport = 5434\nshard = 1\n\
[sharding]\n\
[[sharding.tables]]\ntable = \"accounts\"\ncolumn = \"aid\"\ntype = \"integer\"\n";

#[test]
fn nodes_split_by_shard_and_sharded_tables_are_read() {
    let config = parse(SHARDED).unwrap();
    assert_eq!(
        ["a2", "b", "c"].map(|n| config.shard_of(n)),
        [Some(0), Some(1), None]
    );
    let sharding = config.sharding.expect("sharding");
    assert_eq!(sharding.map.shards, 2);
    let names = |shard: usize| -> Vec<&str> {
        sharding.shard_nodes[shard]
            .iter()
            .map(|n| n.name.as_str())
            .collect()
    };
    assert_eq!(names(0), ["a", "a2"]);
    assert_eq!(names(1), ["b"]);
    assert_eq!(
        config.nodes.iter().map(|n| &n.name).collect::<Vec<_>>(),
        ["a", "a2"]
    );
    let accounts = &sharding.map.tables["accounts"];
    assert_eq!(accounts.key_column, "aid");
    assert_eq!(accounts.key_type, pgherd_route::shard_hash::KeyType::Int4);
    assert_eq!(accounts.method, pgherd_route::shard_plan::Method::Hash);
    assert!(parse(NODE).unwrap().sharding.is_none());
}

#[test]
fn broken_sharding_is_named_by_file_line_and_field() {
    check_err(
        "[[nodes]]\nname = \"a\"\nport = 5432\nshard = 1\n",
        "pgherd.toml:4:9: nodes[0].shard: nodes belong to shards only with a [sharding] section",
    );
    check_err(
        "[[nodes]]\nname = \"a\"\nport = 5432\n[[nodes]]\nname = \"b\"\nport = 5433\nshard = 2\n[[nodes]]\nname = \"c\"\nport = 5434\n[sharding]\n",
        "pgherd.toml:7:9: nodes[1].shard: shard 2 has nodes but shard 1 has none",
    );
    let with_table = |lines: &str| format!("{SHARDED}{lines}\n");
    check_err(
        &with_table("[[sharding.tables]]\ntable = \"t\"\ncolumn = \"k\"\ntype = \"float\""),
        "pgherd.toml:19:8: sharding.tables[1].type: unknown key type \"float\"",
    );
    check_err(
        &with_table("[[sharding.tables]]\ntable = \"t\"\ncolumn = \"k\"\nmethod = \"range\"\nstarts = [10, 5]"),
        "pgherd.toml:20:10: sharding.tables[1].starts: must give 2 ascending starts",
    );
    check_err(
        &with_table("[[sharding.tables]]\ntable = \"t\"\ncolumn = \"k\"\ntype = \"text\"\nmethod = \"list\"\nvalues = [[\"x\"], [\"y\", \"x\"]]"),
        "pgherd.toml:21:10: sharding.tables[1].values: key \"x\" is listed for more than one shard",
    );
    check_err(
        &with_table("[[sharding.tables]]\ntable = \"Accounts\"\ncolumn = \"k\""),
        "pgherd.toml:17:9: sharding.tables[1].table: must be a table name",
    );
    check_err(
        &with_table("[[sharding.tables]]\ntable = \"accounts\"\ncolumn = \"k\""),
        "pgherd.toml:17:9: sharding.tables[1].table: table \"accounts\" is listed twice",
    );
    check_err(
        &with_table("[[sharding.tables]]\ntable = \"public.accounts\"\ncolumn = \"k\""),
        "pgherd.toml:17:9: sharding.tables[1].table: table \"public.accounts\" is listed twice",
    );
    check_err(
        "[[nodes]]\nname = \"a\"\nport = 5432\nshard = 4294967295\n[sharding]\n",
        "pgherd.toml:4:9: nodes[0].shard: shard 4294967295 but only 1 nodes",
    );
}

#[test]
fn cache_settings_have_defaults_and_name_their_errors() {
    let config = parse(NODE).unwrap();
    assert!(config.cache.enabled);
    assert!(!config.cache.asked_for("app", "bob"));
    assert_eq!(config.cache.max_bytes, 64 << 20);
    let config = parse(&format!(
        "{NODE}[cache]\ndatabases = [\"app\"]\nstatements = [\"(?i)^select .* from products\"]\n"
    ))
    .unwrap();
    assert!(config.cache.asked_for("app", "bob"));
    assert!(!config.cache.asked_for("other", "bob"));
    assert!(config
        .cache
        .statement_asked_for("SELECT name FROM products"));
    assert!(!config.cache.statement_asked_for("SELECT 1"));
    let off = parse(&format!(
        "{NODE}[cache]\nenabled = false\ndatabases = [\"app\"]\n"
    ))
    .unwrap();
    assert!(!off.cache.asked_for("app", "bob"));
    check_err(
        &format!("{NODE}[cache]\nstatements = [\"ok\", \"(unclosed\"]\n"),
        "pgherd.toml:5:21: cache.statements[1]: is not a regular expression: unclosed group",
    );
    check_err(
        &format!("{NODE}[cache]\nmax_bytes = 100\nmax_entry_bytes = 200\n"),
        "pgherd.toml:6:19: cache.max_entry_bytes: must be between 1 and max_bytes (100), got 200",
    );
    check_err(
        &format!("{NODE}[cache]\nmax_silence_ms = 10\n"),
        "pgherd.toml:5:18: cache.max_silence_ms: must be at least 1000",
    );
    check_err(
        &format!("{NODE}[cache]\nsize = 1\n"),
        "pgherd.toml:5:1: unknown field `size`",
    );
}
