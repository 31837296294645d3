//! Raw file → validated [`Config`]. Every semantic error is located in the source by the path of
//! the field it is about.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::path::{Path, PathBuf};

use ipnet::IpNet;
use pgherd_wire::md5::is_md5_hash;
use pgherd_wire::scram::ScramVerifier;
use toml_edit::{ImDocument, Item, Value};

use crate::hba::{AuthMethod, ConnectionType, HbaRule, NameMatch};
use crate::raw::{RawConfig, RawHba};
use crate::secrets::secret_field;
use crate::{
    ApiSettings, AuthQuery, Balance, ClientTls, ClientTlsMode, ClusterSettings, Config,
    ConfigError, Consistency, DatabaseConfig, Durability, FailoverSettings, LogFormat, NodeConfig,
    PoolMode, PoolSettings, ProxySettings, ReplicationSettings, Route, RoutingSettings, ServerTls,
    ServerTlsMode, SynchronousCommit, UserConfig, WILDCARD_DATABASE,
};

/// One step of a field path: a table key or an array index.
#[derive(Debug, Clone)]
pub(crate) enum Seg {
    Key(String),
    Index(usize),
}

impl From<&str> for Seg {
    fn from(s: &str) -> Self {
        Seg::Key(s.to_owned())
    }
}

impl From<usize> for Seg {
    fn from(i: usize) -> Self {
        Seg::Index(i)
    }
}

fn render(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                let bare = !k.is_empty()
                    && k.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                if bare {
                    out.push_str(k);
                } else {
                    out.push_str(&format!("{k:?}"));
                }
            }
            Seg::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    out
}

macro_rules! field_path {
    ($($seg:expr),* $(,)?) => { [$(Seg::from($seg)),*] };
}
pub(crate) use field_path;

pub(crate) struct Checker<'a> {
    file: &'a Path,
    source: &'a str,
    doc: Option<ImDocument<&'a str>>,
}

impl Checker<'_> {
    fn span(&self, path: &[Seg]) -> Option<Range<usize>> {
        enum Cursor<'d> {
            Item(&'d Item),
            Table(&'d toml_edit::Table),
        }
        let doc = self.doc.as_ref()?;
        let mut cursor = Cursor::Item(doc.as_item());
        let mut best = None;
        for seg in path {
            let next = match (seg, &cursor) {
                (Seg::Key(k), Cursor::Table(t)) => t.get(k).map(Cursor::Item),
                (Seg::Key(k), Cursor::Item(Item::Table(t))) => t.get(k).map(Cursor::Item),
                (Seg::Key(k), Cursor::Item(Item::Value(Value::InlineTable(t)))) => {
                    best = t.get(k).and_then(|v| v.span()).or(best);
                    return best;
                }
                (Seg::Index(i), Cursor::Item(Item::ArrayOfTables(a))) => {
                    a.get(*i).map(Cursor::Table)
                }
                (Seg::Index(i), Cursor::Item(Item::Value(Value::Array(a)))) => {
                    best = a.get(*i).and_then(|v| v.span()).or(best);
                    return best;
                }
                _ => None,
            };
            match next {
                Some(next) => {
                    let span = match &next {
                        Cursor::Item(item) => item.span(),
                        Cursor::Table(table) => table.span(),
                    };
                    best = span.or(best);
                    cursor = next;
                }
                None => break,
            }
        }
        best
    }

    pub(crate) fn error(&self, path: &[Seg], message: impl Into<String>) -> ConfigError {
        ConfigError::at(
            self.file,
            self.source,
            self.span(path),
            render(path),
            message,
        )
    }

    /// Resolves a path relative to the config file's directory.
    pub(crate) fn file_path(&self, value: &str) -> PathBuf {
        let p = Path::new(value);
        if p.is_absolute() {
            p.to_owned()
        } else {
            self.file
                .parent()
                .map_or_else(|| p.to_owned(), |dir| dir.join(p))
        }
    }
}

pub fn validate(source: &str, file: &Path) -> Result<Config, ConfigError> {
    let raw: RawConfig = toml::from_str(source).map_err(|e| {
        ConfigError::at(
            file,
            source,
            e.span(),
            "",
            e.message().trim_end().to_owned(),
        )
    })?;
    let c = Checker {
        file,
        source,
        doc: ImDocument::parse(source).ok(),
    };
    let proxy = proxy(&c, &raw)?;
    let client_tls = client_tls(&c, &raw)?;
    let server_tls = server_tls(&c, &raw)?;
    let cluster = cluster(&c, &raw)?;
    let (nodes, sharding) = crate::sharding::sharding(&c, &raw, nodes(&c, &raw)?)?;
    let pool = pool(&c, &raw)?;
    let databases = databases(&c, &raw, &pool)?;
    let users = users(&c, &raw)?;
    let auth_query = auth_query(&c, &raw, &cluster)?;
    let hba = hba(&c, &raw.hba)?;
    let routing = routing(&c, &raw)?;
    if hba.iter().any(|r| r.method == AuthMethod::Cert)
        && client_tls
            .as_ref()
            .and_then(|t| t.client_ca_file.as_ref())
            .is_none()
    {
        let index = hba
            .iter()
            .position(|r| r.method == AuthMethod::Cert)
            .unwrap_or(0);
        return Err(c.error(
            &field_path!["hba", index, "method"],
            "cert authentication needs [tls] with client_ca_file to check client certificates",
        ));
    }
    let secret = secret_field(&raw).map(|path| c.error(&path, "holds a secret"));
    Ok(Config {
        source: file.to_owned(),
        secret,
        proxy,
        client_tls,
        server_tls,
        cluster,
        nodes,
        pool,
        databases,
        users,
        auth_query,
        hba,
        routing,
        failover: FailoverSettings {
            enabled: raw.failover.enabled,
            max_lag_on_failover_bytes: raw.failover.max_lag_on_failover_bytes,
            notify_command: raw.failover.notify_command.clone(),
            switchover_drain_ms: raw.failover.switchover_drain_ms,
            auto_rejoin: raw.failover.auto_rejoin,
            fence_command: raw.failover.fence_command.clone(),
        },
        replication: replication(&c, &raw)?,
        api: api(&c, &raw)?,
        dcs: crate::dcs::dcs(&c, raw.dcs.as_ref())?,
        sharding,
        cache: crate::cache::cache(&c, &raw.cache)?,
        sets: crate::sets::sets(&c, &raw.sets)?,
    })
}

fn api(c: &Checker<'_>, raw: &RawConfig) -> Result<ApiSettings, ConfigError> {
    let listen = addresses(c, "api", &raw.api.listen)?;
    let a = &raw.api;
    let token = c.secret(
        &field_path!["api"],
        "token",
        [&a.token, &a.token_file, &a.token_env],
    )?;
    if token.as_deref().is_some_and(|t| t.len() < 16) {
        return Err(c.error(
            &field_path!["api", "token"],
            "must be at least 16 characters (it guards switchover and the like)",
        ));
    }
    Ok(ApiSettings { listen, token })
}

/// `section.listen` as socket addresses.
fn addresses(
    c: &Checker<'_>,
    section: &'static str,
    listen: &[String],
) -> Result<Vec<SocketAddr>, ConfigError> {
    listen
        .iter()
        .enumerate()
        .map(|(i, a)| {
            a.parse::<SocketAddr>().map_err(|_| {
                c.error(
                    &field_path![section, "listen", i],
                    format!("{a:?} is not an address with a port, e.g. \"127.0.0.1:6432\""),
                )
            })
        })
        .collect()
}

fn replication(c: &Checker<'_>, raw: &RawConfig) -> Result<ReplicationSettings, ConfigError> {
    let r = &raw.replication;
    if r.sync_standbys == 0 {
        return Err(c.error(
            &field_path!["replication", "sync_standbys"],
            "must be at least 1 (use durability = \"async\" for no synchronous standby)",
        ));
    }
    Ok(ReplicationSettings {
        durability: choice(
            c,
            &field_path!["replication", "durability"],
            &r.durability,
            Durability::parse,
            "durability",
            "async, sync or strict",
        )?,
        sync_standbys: r.sync_standbys,
        synchronous_commit: choice(
            c,
            &field_path!["replication", "synchronous_commit"],
            &r.synchronous_commit,
            SynchronousCommit::parse,
            "synchronous_commit level",
            "on, remote_write or remote_apply",
        )?,
        user: r.user.clone().filter(|u| !u.is_empty()),
        password: c.secret(
            &field_path!["replication"],
            "password",
            [&r.password, &r.password_file, &r.password_env],
        )?,
    })
}

fn proxy(c: &Checker<'_>, raw: &RawConfig) -> Result<ProxySettings, ConfigError> {
    let p = &raw.pgherd;
    if p.listen.is_empty() {
        return Err(c.error(
            &field_path!["pgherd", "listen"],
            "needs at least one address",
        ));
    }
    let listen = addresses(c, "pgherd", &p.listen)?;
    if p.workers > 1024 {
        return Err(c.error(
            &field_path!["pgherd", "workers"],
            "must be between 0 (a quarter of the CPUs) and 1024",
        ));
    }
    if p.max_client_connections == 0 {
        return Err(c.error(
            &field_path!["pgherd", "max_client_connections"],
            "must be at least 1",
        ));
    }
    if !(8 << 10..=(1 << 30) + (1 << 20)).contains(&p.max_message_bytes) {
        return Err(c.error(
            &field_path!["pgherd", "max_message_bytes"],
            "must be between 8192 and 1074790400 (1 GiB plus headroom)",
        ));
    }
    let log_format = match p.log_format.as_str() {
        "human" => LogFormat::Human,
        "json" => LogFormat::Json,
        other => {
            return Err(c.error(
                &field_path!["pgherd", "log_format"],
                format!("unknown format {other:?}; expected \"human\" or \"json\""),
            ))
        }
    };
    if !["error", "warn", "info", "debug", "trace"].contains(&p.log_level.as_str()) {
        return Err(c.error(
            &field_path!["pgherd", "log_level"],
            format!(
                "unknown level {:?}; expected error, warn, info, debug or trace",
                p.log_level
            ),
        ));
    }
    if p.auth_failure_delay_ms > 10_000 {
        return Err(c.error(
            &field_path!["pgherd", "auth_failure_delay_ms"],
            "must be at most 10000 (it doubles per recent failure, up to 16 times)",
        ));
    }
    if p.client_login_timeout_ms == 0 || p.shutdown_timeout_ms == 0 {
        let field = if p.client_login_timeout_ms == 0 {
            "client_login_timeout_ms"
        } else {
            "shutdown_timeout_ms"
        };
        return Err(c.error(&field_path!["pgherd", field], "must be greater than 0"));
    }
    Ok(ProxySettings {
        listen,
        workers: p.workers,
        max_client_connections: p.max_client_connections,
        admin_reserved_connections: p.admin_reserved_connections,
        auth_failure_delay_ms: p.auth_failure_delay_ms,
        max_message_bytes: p.max_message_bytes,
        client_login_timeout_ms: p.client_login_timeout_ms,
        client_idle_timeout_ms: p.client_idle_timeout_ms,
        client_park_after_ms: p.client_park_after_ms,
        shutdown_timeout_ms: p.shutdown_timeout_ms,
        admin_users: p.admin_users.clone(),
        stats_users: p.stats_users.clone(),
        log_format,
        log_level: p.log_level.clone(),
        state_file: c.file_path(p.state_file.as_deref().unwrap_or(crate::DEFAULT_STATE_FILE)),
        zone: p.zone.clone().filter(|z| !z.is_empty()),
    })
}

fn client_tls(c: &Checker<'_>, raw: &RawConfig) -> Result<Option<ClientTls>, ConfigError> {
    let Some(t) = &raw.tls else { return Ok(None) };
    let mode = match t.mode.as_str() {
        "allow" => ClientTlsMode::Allow,
        "require" => ClientTlsMode::Require,
        other => {
            return Err(c.error(
                &field_path!["tls", "mode"],
                format!("unknown mode {other:?}; expected \"allow\" or \"require\""),
            ))
        }
    };
    Ok(Some(ClientTls {
        mode,
        cert_file: c.file_path(&t.cert_file),
        key_file: c.file_path(&t.key_file),
        client_ca_file: t.client_ca_file.as_deref().map(|f| c.file_path(f)),
    }))
}

fn server_tls(c: &Checker<'_>, raw: &RawConfig) -> Result<ServerTls, ConfigError> {
    let t = &raw.server_tls;
    let mode = match t.mode.as_str() {
        "disable" => ServerTlsMode::Disable,
        "prefer" => ServerTlsMode::Prefer,
        "require" => ServerTlsMode::Require,
        "verify-ca" => ServerTlsMode::VerifyCa,
        "verify-full" => ServerTlsMode::VerifyFull,
        other => {
            return Err(c.error(
                &field_path!["server_tls", "mode"],
                format!(
                    "unknown mode {other:?}; expected disable, prefer, require, verify-ca or verify-full"
                ),
            ))
        }
    };
    if matches!(mode, ServerTlsMode::VerifyCa | ServerTlsMode::VerifyFull) && t.ca_file.is_none() {
        return Err(c.error(
            &field_path!["server_tls", "mode"],
            format!("{} needs ca_file", t.mode),
        ));
    }
    Ok(ServerTls {
        mode,
        ca_file: t.ca_file.as_deref().map(|f| c.file_path(f)),
    })
}

fn cluster(c: &Checker<'_>, raw: &RawConfig) -> Result<ClusterSettings, ConfigError> {
    let k = &raw.cluster;
    for (field, value) in [
        ("health_check_period_ms", k.health_check_period_ms),
        ("health_check_timeout_ms", k.health_check_timeout_ms),
    ] {
        if value < 10 {
            return Err(c.error(&field_path!["cluster", field], "must be at least 10"));
        }
    }
    if k.health_check_failures_before_down == 0 {
        return Err(c.error(
            &field_path!["cluster", "health_check_failures_before_down"],
            "must be at least 1",
        ));
    }
    if k.user.is_empty() {
        return Err(c.error(&field_path!["cluster", "user"], "must not be empty"));
    }
    Ok(ClusterSettings {
        user: k.user.clone(),
        password: c.secret(
            &field_path!["cluster"],
            "password",
            [&k.password, &k.password_file, &k.password_env],
        )?,
        database: k.database.clone(),
        health_check_period_ms: k.health_check_period_ms,
        health_check_timeout_ms: k.health_check_timeout_ms,
        health_check_failures_before_down: k.health_check_failures_before_down,
        primary_wait_ms: k.primary_wait_ms,
    })
}

fn nodes(c: &Checker<'_>, raw: &RawConfig) -> Result<Vec<NodeConfig>, ConfigError> {
    if raw.nodes.is_empty() {
        return Err(ConfigError::unplaced(
            c.file,
            "nodes",
            "at least one [[nodes]] entry (name, host, port) is required",
        ));
    }
    let mut seen = BTreeSet::new();
    let mut nodes = Vec::new();
    for (i, n) in raw.nodes.iter().enumerate() {
        let valid_name = !n.name.is_empty()
            && n.name.len() <= 63
            && n.name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-');
        if !valid_name {
            return Err(c.error(
                &field_path!["nodes", i, "name"],
                "must be 1 to 63 letters, digits, '_' or '-'",
            ));
        }
        if !seen.insert(n.name.as_str()) {
            return Err(c.error(
                &field_path!["nodes", i, "name"],
                format!("duplicate node name {:?}", n.name),
            ));
        }
        if n.host.is_empty() {
            return Err(c.error(&field_path!["nodes", i, "host"], "must not be empty"));
        }
        if n.port == 0 {
            return Err(c.error(
                &field_path!["nodes", i, "port"],
                "must be between 1 and 65535",
            ));
        }
        let socket_dir = n.socket_dir.as_deref().map(|d| c.file_path(d));
        if let Some(dir) = socket_dir.as_deref().filter(|d| !crate::socket_dir_fits(d)) {
            return Err(c.error(
                &field_path!["nodes", i, "socket_dir"],
                format!(
                    "{} is too long for a Unix-domain socket's path (at most {} bytes with the socket's name)",
                    dir.display(),
                    crate::MAX_SOCKET_PATH_BYTES
                ),
            ));
        }
        nodes.push(NodeConfig {
            name: n.name.clone(),
            host: n.host.clone(),
            port: n.port,
            socket_dir,
            data_dir: n.data_dir.as_deref().map(|d| c.file_path(d)),
            netns: n.netns.clone(),
            weight: n.weight,
            priority: n.priority,
            zone: n.zone.clone().filter(|z| !z.is_empty()),
            sync: n.sync,
        });
    }
    Ok(nodes)
}

/// One of a setting's allowed words, or an error naming them.
fn choice<T>(
    c: &Checker<'_>,
    path: &[Seg],
    value: &str,
    parse: fn(&str) -> Option<T>,
    what: &str,
    expected: &str,
) -> Result<T, ConfigError> {
    parse(value).ok_or_else(|| {
        c.error(
            path,
            format!("unknown {what} {value:?}; expected {expected}"),
        )
    })
}

fn route(c: &Checker<'_>, path: &[Seg], value: &str) -> Result<Route, ConfigError> {
    choice(
        c,
        path,
        value,
        Route::parse,
        "route",
        "auto, primary or replica",
    )
}

fn consistency(c: &Checker<'_>, path: &[Seg], value: &str) -> Result<Consistency, ConfigError> {
    choice(
        c,
        path,
        value,
        Consistency::parse,
        "consistency",
        "read_your_writes, eventual or primary",
    )
}

fn routing(c: &Checker<'_>, raw: &RawConfig) -> Result<RoutingSettings, ConfigError> {
    let r = &raw.routing;
    if r.rejoin_after_checks == 0 {
        return Err(c.error(
            &field_path!["routing", "rejoin_after_checks"],
            "must be at least 1",
        ));
    }
    if r.decision_cache_entries == 0 {
        return Err(c.error(
            &field_path!["routing", "decision_cache_entries"],
            "must be at least 1",
        ));
    }
    Ok(RoutingSettings {
        max_lag_bytes: r.max_lag_bytes,
        max_lag_ms: r.max_lag_ms,
        read_your_writes_wait_ms: r.read_your_writes_wait_ms,
        rejoin_after_checks: r.rejoin_after_checks,
        decision_cache_entries: r.decision_cache_entries,
        max_parse_bytes: r.max_parse_bytes,
    })
}

fn pool_mode(c: &Checker<'_>, path: &[Seg], value: &str) -> Result<PoolMode, ConfigError> {
    choice(
        c,
        path,
        value,
        PoolMode::parse,
        "pool mode",
        "session, transaction or statement",
    )
}

fn pool(c: &Checker<'_>, raw: &RawConfig) -> Result<PoolSettings, ConfigError> {
    let p = &raw.pool;
    let mode = pool_mode(c, &field_path!["pool", "mode"], &p.mode)?;
    if p.max_size == 0 {
        return Err(c.error(&field_path!["pool", "max_size"], "must be at least 1"));
    }
    if p.min_size > p.max_size {
        return Err(c.error(&field_path!["pool", "min_size"], "must not exceed max_size"));
    }
    if p.prepared_statements_per_server == 0 {
        return Err(c.error(
            &field_path!["pool", "prepared_statements_per_server"],
            "must be at least 1",
        ));
    }
    for (field, value) in [
        ("wait_timeout_ms", p.wait_timeout_ms),
        ("server_connect_timeout_ms", p.server_connect_timeout_ms),
    ] {
        if value == 0 {
            return Err(c.error(&field_path!["pool", field], "must be greater than 0"));
        }
    }
    Ok(PoolSettings {
        mode,
        max_size: p.max_size,
        min_size: p.min_size,
        wait_timeout_ms: p.wait_timeout_ms,
        server_idle_timeout_ms: p.server_idle_timeout_ms,
        server_lifetime_ms: p.server_lifetime_ms,
        server_connect_timeout_ms: p.server_connect_timeout_ms,
        server_reset_query: p.server_reset_query.clone(),
        prepared_statements_per_server: p.prepared_statements_per_server,
    })
}

fn databases(
    c: &Checker<'_>,
    raw: &RawConfig,
    pool: &PoolSettings,
) -> Result<BTreeMap<String, DatabaseConfig>, ConfigError> {
    let mut out = BTreeMap::new();
    for (name, d) in &raw.databases {
        if name.is_empty() {
            return Err(c.error(
                &field_path!["databases", name.as_str()],
                "database name must not be empty",
            ));
        }
        let mode = d
            .mode
            .as_deref()
            .map(|m| pool_mode(c, &field_path!["databases", name.as_str(), "mode"], m))
            .transpose()?;
        let route = d
            .route
            .as_deref()
            .map(|r| route(c, &field_path!["databases", name.as_str(), "route"], r))
            .transpose()?
            .unwrap_or(Route::Auto);
        let consistency = d
            .consistency
            .as_deref()
            .map(|v| {
                consistency(
                    c,
                    &field_path!["databases", name.as_str(), "consistency"],
                    v,
                )
            })
            .transpose()?
            .unwrap_or(Consistency::ReadYourWrites);
        let balance = match d.balance.as_deref() {
            None => Balance::RoundRobin,
            Some(v) => choice(
                c,
                &field_path!["databases", name.as_str(), "balance"],
                v,
                Balance::parse,
                "balance policy",
                "round_robin, least_outstanding, weighted or random",
            )?,
        };
        if d.max_size == Some(0) {
            return Err(c.error(
                &field_path!["databases", name.as_str(), "max_size"],
                "must be at least 1",
            ));
        }
        if d.min_size.unwrap_or(pool.min_size) > d.max_size.unwrap_or(pool.max_size) {
            return Err(c.error(
                &field_path!["databases", name.as_str(), "min_size"],
                "must not exceed max_size",
            ));
        }
        let dbname =
            match (&d.dbname, name.as_str()) {
                (Some(_), WILDCARD_DATABASE) => return Err(c.error(
                    &field_path!["databases", name.as_str(), "dbname"],
                    "the \"*\" entry serves every database under its own name and takes no dbname",
                )),
                (Some(db), _) => Some(db.clone()),
                (None, WILDCARD_DATABASE) => None,
                (None, _) => Some(name.clone()),
            };
        out.insert(
            name.clone(),
            DatabaseConfig {
                dbname,
                mode,
                max_size: d.max_size,
                min_size: d.min_size,
                route,
                consistency,
                balance,
                primary_reads: d.primary_reads,
            },
        );
    }
    if out.is_empty() {
        out.insert(
            WILDCARD_DATABASE.to_owned(),
            DatabaseConfig {
                dbname: None,
                mode: None,
                max_size: None,
                min_size: None,
                route: Route::Auto,
                consistency: Consistency::ReadYourWrites,
                balance: Balance::RoundRobin,
                primary_reads: false,
            },
        );
    }
    Ok(out)
}

fn users(c: &Checker<'_>, raw: &RawConfig) -> Result<BTreeMap<String, UserConfig>, ConfigError> {
    let mut out = BTreeMap::new();
    for (name, u) in &raw.users {
        let scram = u
            .scram
            .as_deref()
            .map(|v| {
                ScramVerifier::parse(v).map_err(|e| {
                    c.error(
                        &field_path!["users", name.as_str(), "scram"],
                        format!("{e} (generate one with `pgherd passwd {name}`)"),
                    )
                })
            })
            .transpose()?;
        if let Some(md5) = &u.md5 {
            if !is_md5_hash(md5) {
                return Err(c.error(
                    &field_path!["users", name.as_str(), "md5"],
                    "must be \"md5\" followed by 32 hex digits, as in pg_authid",
                ));
            }
        }
        let mode = u
            .mode
            .as_deref()
            .map(|m| pool_mode(c, &field_path!["users", name.as_str(), "mode"], m))
            .transpose()?;
        let route = u
            .route
            .as_deref()
            .map(|r| route(c, &field_path!["users", name.as_str(), "route"], r))
            .transpose()?;
        let consistency = u
            .consistency
            .as_deref()
            .map(|v| consistency(c, &field_path!["users", name.as_str(), "consistency"], v))
            .transpose()?;
        out.insert(
            name.clone(),
            UserConfig {
                scram,
                md5: u.md5.clone(),
                server_password: c.secret(
                    &field_path!["users", name.as_str()],
                    "server_password",
                    [
                        &u.server_password,
                        &u.server_password_file,
                        &u.server_password_env,
                    ],
                )?,
                mode,
                route,
                consistency,
            },
        );
    }
    Ok(out)
}

fn auth_query(
    c: &Checker<'_>,
    raw: &RawConfig,
    cluster: &ClusterSettings,
) -> Result<Option<AuthQuery>, ConfigError> {
    let a = &raw.auth;
    let password = c.secret(
        &field_path!["auth"],
        "password",
        [&a.password, &a.password_file, &a.password_env],
    )?;
    Ok(a.query.as_ref().map(|query| AuthQuery {
        query: query.clone(),
        user: a.user.clone().unwrap_or_else(|| cluster.user.clone()),
        password: password.or_else(|| cluster.password.clone()),
        database: a
            .database
            .clone()
            .unwrap_or_else(|| cluster.database.clone()),
    }))
}

fn names(c: &Checker<'_>, path: &[Seg], list: &[String]) -> Result<NameMatch, ConfigError> {
    if list.is_empty() {
        return Err(c.error(path, "must list at least one name, or \"all\""));
    }
    if list.iter().any(|n| n == "all") {
        return Ok(NameMatch::All);
    }
    Ok(NameMatch::Names(list.to_vec()))
}

fn hba(c: &Checker<'_>, raw: &[RawHba]) -> Result<Vec<HbaRule>, ConfigError> {
    if raw.is_empty() {
        return Ok(vec![HbaRule {
            connection: ConnectionType::Any,
            databases: NameMatch::All,
            users: NameMatch::All,
            address: None,
            method: AuthMethod::ScramSha256,
        }]);
    }
    raw.iter()
        .enumerate()
        .map(|(i, r)| {
            let connection = match r.conn_type.as_str() {
                "host" => ConnectionType::Any,
                "hostssl" => ConnectionType::Tls,
                "hostnossl" => ConnectionType::Plain,
                other => {
                    return Err(c.error(
                        &field_path!["hba", i, "type"],
                        format!("unknown type {other:?}; expected host, hostssl or hostnossl"),
                    ))
                }
            };
            let method = AuthMethod::parse(&r.method).ok_or_else(|| {
                c.error(
                    &field_path!["hba", i, "method"],
                    format!(
                        "unknown method {:?}; expected scram-sha-256, md5, trust, cert or reject",
                        r.method
                    ),
                )
            })?;
            let address = match r.address.as_str() {
                "all" => None,
                text => Some(parse_address(text).ok_or_else(|| {
                    c.error(
                        &field_path!["hba", i, "address"],
                        format!("{text:?} is not an address or CIDR block, e.g. \"10.0.0.0/8\""),
                    )
                })?),
            };
            Ok(HbaRule {
                connection,
                databases: names(c, &field_path!["hba", i, "databases"], &r.databases)?,
                users: names(c, &field_path!["hba", i, "users"], &r.users)?,
                address,
                method,
            })
        })
        .collect()
}

fn parse_address(text: &str) -> Option<IpNet> {
    text.parse::<IpNet>()
        .ok()
        .or_else(|| text.parse::<IpAddr>().ok().map(IpNet::from))
}
