//! What pgherd shows about itself, computed once and rendered by every surface: the admin
//! console (text columns), the HTTP API (JSON) and the metrics. A view never changes state.

use std::sync::atomic::Ordering;
use std::time::UNIX_EPOCH;

use pgherd_failover::NodeId;

use crate::app::App;
use crate::nodes::{NodeState, Role};

/// One value of a view, typed so JSON keeps numbers as numbers.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    Text(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Null,
}

impl Cell {
    /// The admin console's text: what PgBouncer-style tools print.
    pub fn text(&self) -> Option<String> {
        match self {
            Cell::Text(s) => Some(s.clone()),
            Cell::Int(i) => Some(i.to_string()),
            Cell::Float(f) => Some(format!("{f:.3}")),
            Cell::Bool(b) => Some(if *b { "yes" } else { "no" }.to_owned()),
            Cell::Null => None,
        }
    }

    pub fn json(&self) -> serde_json::Value {
        match self {
            Cell::Text(s) => serde_json::Value::String(s.clone()),
            Cell::Int(i) => serde_json::Value::from(*i),
            Cell::Float(f) => serde_json::Value::from(*f),
            Cell::Bool(b) => serde_json::Value::Bool(*b),
            Cell::Null => serde_json::Value::Null,
        }
    }
}

impl From<String> for Cell {
    fn from(s: String) -> Self {
        Cell::Text(s)
    }
}

impl From<&str> for Cell {
    fn from(s: &str) -> Self {
        Cell::Text(s.to_owned())
    }
}

/// Unsigned counters and sizes; anything past i64 (never, in practice) shows as its maximum.
macro_rules! int_cells {
    ($($t:ty),*) => {$(
        impl From<$t> for Cell {
            fn from(n: $t) -> Self {
                Cell::Int(i64::try_from(n).unwrap_or(i64::MAX))
            }
        }
    )*};
}
int_cells!(u64, u32, u16, usize);

impl From<bool> for Cell {
    fn from(b: bool) -> Self {
        Cell::Bool(b)
    }
}

impl<T: Into<Cell>> From<Option<T>> for Cell {
    fn from(v: Option<T>) -> Self {
        v.map_or(Cell::Null, Into::into)
    }
}

/// A result set: named columns and typed rows.
#[derive(Debug, Clone)]
pub struct Table {
    pub columns: &'static [&'static str],
    pub rows: Vec<Vec<Cell>>,
}

impl Table {
    /// One line of text per value: the console's single-column answers.
    pub fn lines(column: &'static [&'static str], lines: Vec<String>) -> Table {
        Table {
            columns: column,
            rows: lines.into_iter().map(|l| vec![Cell::Text(l)]).collect(),
        }
    }

    /// An array of objects keyed by column name.
    pub fn json(&self) -> serde_json::Value {
        serde_json::Value::Array(
            self.rows
                .iter()
                .map(|row| {
                    serde_json::Value::Object(
                        self.columns
                            .iter()
                            .zip(row)
                            .map(|(c, v)| ((*c).to_owned(), v.json()))
                            .collect(),
                    )
                })
                .collect(),
        )
    }
}

/// `up`, `down`, `fenced` or `detached`.
pub fn node_state(app: &App, n: &NodeState) -> &'static str {
    let view = app.nodes.view();
    if view.is_fenced(n.id) {
        "fenced"
    } else if view.is_detached(n.id) {
        "detached"
    } else if n.is_up() {
        "up"
    } else {
        "down"
    }
}

/// Whether `n` is the node writes go to (the elected primary; writes may be held for a
/// moment during a switchover or while its synchronous standbys are set).
pub fn takes_writes(app: &App, n: &NodeState) -> bool {
    app.nodes.writer().is_some_and(|p| p.name() == n.name())
}

/// The write gate as one phrase: `open`, `held: <reason>` or `refused: <reason>`.
pub fn write_gate(app: &App) -> String {
    let gate = app.nodes.view().gate();
    match gate.reason() {
        None => gate.state().to_owned(),
        Some(why) => format!("{}: {}", gate.state(), app.nodes.gate_sentence(why)),
    }
}

/// Why a node serves no reads, or `None` if it does.
fn read_set_reason(app: &App, n: &NodeState) -> Option<String> {
    let view = app.nodes.view();
    if view.is_fenced(n.id) {
        return Some("fenced".to_owned());
    }
    if view.is_detached(n.id) {
        return Some("detached by the operator".to_owned());
    }
    if n.in_read_set() {
        return None;
    }
    let health = n.health();
    Some(if !n.is_up() {
        format!(
            "down: {}",
            health
                .last_error
                .map_or_else(|| "not checked yet".to_owned(), |e| e.message)
        )
    } else if n.role() == Role::Replica {
        "recovering from a failure (needs healthy checks in a row)".to_owned()
    } else {
        "not a replica".to_owned()
    })
}

/// The cluster view (`SHOW CLUSTER`, `/api/cluster`): one row.
pub fn cluster(app: &App) -> Table {
    let view = app.nodes.view();
    let name = |id: Option<NodeId>| id.map(|id| app.nodes.name_of(id));
    let names = |ids: &std::collections::BTreeSet<NodeId>| {
        ids.iter()
            .map(|&id| app.nodes.name_of(id))
            .collect::<Vec<_>>()
            .join(",")
    };
    let gate = view.gate();
    let reason = gate.reason();
    let dcs = app.dcs.as_ref().map(|d| d.status());
    let failsafe_left_ms = app.dcs.as_ref().and_then(|d| match d.write_lease() {
        pgherd_failover::agreement::WriteLease::Failsafe { left_ms } => Some(left_ms),
        _ => None,
    });
    let paused = if view.paused_all {
        "*".to_owned()
    } else {
        view.paused.iter().cloned().collect::<Vec<_>>().join(",")
    };
    Table {
        columns: &[
            "version",
            "epoch",
            "elected",
            "writer",
            "write_gate",
            "gate_reason",
            "gate_detail",
            "promoting",
            "fenced",
            "detached",
            "synchronous_standby_names",
            "paused",
            "instance",
            "leader",
            "dcs",
            "lease",
        ],
        rows: vec![vec![
            view.version.into(),
            view.epoch.into(),
            name(view.elected).into(),
            app.nodes.writer().map(|n| n.name().to_owned()).into(),
            gate.state().into(),
            reason.map(|r| r.kind()).into(),
            reason.map(|r| app.nodes.gate_sentence(r)).into(),
            name(view.promoting).into(),
            names(&view.fenced).into(),
            names(&view.detached).into(),
            view.sync.as_ref().map(|s| s.set.setting()).into(),
            paused.into(),
            app.dcs.as_ref().map(|d| d.instance.clone()).into(),
            dcs.as_ref().and_then(|s| s.leader.clone()).into(),
            dcs.as_ref()
                .map(|s| match &s.last_error {
                    Some(e) if !s.reachable => match failsafe_left_ms {
                        Some(ms) => format!(
                            "unreachable, writes go on in failsafe for {} s: {e}",
                            ms.div_ceil(1000)
                        ),
                        None => format!("unreachable: {e}"),
                    },
                    _ if s.reachable => "reachable".to_owned(),
                    _ => "connecting".to_owned(),
                })
                .into(),
            // Hexadecimal, as etcdctl shows leases.
            dcs.and_then(|s| s.lease).map(|l| format!("{l:x}")).into(),
        ]],
    }
}

/// With `[sharding]`: one row per node of each shard, with the shard's sharded tables on its
/// first row; without, no rows.
pub fn shards(app: &App) -> Table {
    let columns = &[
        "shard",
        "node",
        "host",
        "port",
        "role",
        "state",
        "takes_writes",
        "lag_bytes",
        "sharded_tables",
    ];
    let Some(shards) = &app.shards else {
        return Table {
            columns,
            rows: Vec::new(),
        };
    };
    let layout = shards.layout();
    let tables = layout
        .map
        .tables
        .iter()
        .map(|(name, t)| format!("{name}({} {})", t.key_column, t.method.name()))
        .collect::<Vec<_>>()
        .join(", ");
    let mut rows = Vec::new();
    for (shard, cluster) in layout.clusters().iter().enumerate() {
        let writer = cluster.primary();
        for node in cluster.all().iter() {
            let state = if node.is_up() { "up" } else { "down" };
            let state = if shard == 0 {
                node_state(app, node)
            } else {
                state
            };
            rows.push(vec![
                (shard as u64).into(),
                node.config.name.clone().into(),
                node.config.host.clone().into(),
                node.config.port.into(),
                node.role().as_str().into(),
                state.into(),
                writer.as_ref().is_some_and(|w| w.id == node.id).into(),
                node.lag_bytes().into(),
                tables.clone().into(),
            ]);
        }
    }
    Table { columns, rows }
}

/// The pgherd instances agreeing through etcd (`[dcs]`), as last read there; this instance
/// alone without `[dcs]`.
pub fn instances(app: &App) -> Table {
    let columns = &[
        "instance",
        "leads",
        "this",
        "listen",
        "api",
        "pid",
        "view_version",
    ];
    let Some(dcs) = &app.dcs else {
        let config = app.config();
        let addresses = |a: &[std::net::SocketAddr]| {
            a.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        return Table {
            columns,
            rows: vec![vec![
                Cell::Null,
                true.into(),
                true.into(),
                addresses(&config.proxy.listen).into(),
                addresses(&config.api.listen).into(),
                std::process::id().into(),
                Cell::Null,
            ]],
        };
    };
    let status = dcs.status();
    let rows = status
        .instances
        .iter()
        .map(|i| {
            vec![
                i.instance.clone().into(),
                (status.leader.as_deref() == Some(i.instance.as_str())).into(),
                (i.instance == dcs.instance).into(),
                i.listen.join(",").into(),
                i.api.join(",").into(),
                i.pid.into(),
                i.version.into(),
            ]
        })
        .collect();
    Table { columns, rows }
}

pub fn nodes(app: &App) -> Table {
    let all = app.nodes.all();
    let rows = all
        .iter()
        .map(|n| {
            let upstream = n.upstream_among(&all);
            let health = n.health();
            let timeline = health.last_seen.as_ref().map(|s| s.timeline);
            let writes = takes_writes(app, n);
            vec![
                n.config.name.clone().into(),
                n.config.host.clone().into(),
                n.config.port.into(),
                n.config.zone.clone().into(),
                if n.config.sync { "sync" } else { "async" }.into(),
                n.role().as_str().into(),
                node_state(app, n).into(),
                writes.into(),
                writes.then(|| write_gate(app)).into(),
                pgherd_route::balance::format_lsn(n.lsn()).into(),
                timeline.into(),
                n.lag_bytes().into(),
                n.lag_ms().into(),
                n.in_read_set().into(),
                read_set_reason(app, n).into(),
                health.checks_ok.into(),
                health.checks_failed.into(),
                health.times_down.into(),
                health.last_error.as_ref().map(|e| e.kind.as_str()).into(),
                health.last_error.map(|e| e.message).into(),
                upstream.into(),
            ]
        })
        .collect();
    Table {
        columns: &[
            "name",
            "host",
            "port",
            "zone",
            "standby",
            "role",
            "state",
            "takes_writes",
            "write_gate",
            "lsn",
            "timeline",
            "lag_bytes",
            "lag_ms",
            "in_read_set",
            "out_of_read_set_because",
            "checks_ok",
            "checks_failed",
            "times_down",
            "last_error_kind",
            "last_error",
            "upstream",
        ],
        rows,
    }
}

pub fn events(app: &App) -> Table {
    let rows = app
        .events
        .list()
        .into_iter()
        .map(|e| {
            let at =
                e.at.duration_since(UNIX_EPOCH)
                    .map_or(Cell::Null, |d| Cell::Float(d.as_secs_f64()));
            vec![at, e.kind.into(), e.node.into(), e.detail.into()]
        })
        .collect();
    Table {
        columns: &["at_epoch_s", "kind", "node", "detail"],
        rows,
    }
}

pub fn pools(app: &App) -> Table {
    let rows = app
        .pools()
        .iter()
        .map(|p| {
            let s = p.snapshot();
            vec![
                p.database.clone().into(),
                p.user.clone().into(),
                p.node.name.clone().into(),
                s.mode.as_str().into(),
                s.waiting.into(),
                s.lent.into(),
                s.idle.into(),
                s.connecting.into(),
                s.max_size.into(),
                p.stats.transactions.sum().into(),
                p.stats.queries.sum().into(),
                p.stats.wait_us_max.load(Ordering::Relaxed).into(),
                p.stats.wait_timeouts.load(Ordering::Relaxed).into(),
            ]
        })
        .collect();
    Table {
        columns: &[
            "database",
            "user",
            "node",
            "pool_mode",
            "cl_waiting",
            "sv_active",
            "sv_idle",
            "sv_connecting",
            "max_size",
            "transactions",
            "queries",
            "max_wait_us",
            "wait_timeouts",
        ],
        rows,
    }
}

/// Totals per pool since start, like PgBouncer's SHOW STATS.
pub fn stats(app: &App) -> Table {
    let rows = app
        .pools()
        .iter()
        .map(|p| {
            let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
            let transactions = p.stats.transactions.sum();
            let wait_us = p.stats.wait_time.sum_us();
            vec![
                p.database.clone().into(),
                p.user.clone().into(),
                p.node.name.clone().into(),
                transactions.into(),
                p.stats.queries.sum().into(),
                wait_us.into(),
                load(&p.stats.wait_us_max).into(),
                load(&p.stats.wait_timeouts).into(),
                load(&p.stats.connects).into(),
                load(&p.stats.connect_failures).into(),
                p.stats.bytes_to_servers.sum().into(),
                p.stats.bytes_to_clients.sum().into(),
                p.stats.transaction_time.quantile_us(0.50).into(),
                p.stats.transaction_time.quantile_us(0.95).into(),
                p.stats.transaction_time.quantile_us(0.99).into(),
            ]
        })
        .collect();
    Table {
        columns: &[
            "database",
            "user",
            "node",
            "total_xact_count",
            "total_query_count",
            "total_wait_time_us",
            "max_wait_time_us",
            "wait_timeouts",
            "server_connects",
            "server_connect_failures",
            "bytes_to_servers",
            "bytes_to_clients",
            "xact_p50_us",
            "xact_p95_us",
            "xact_p99_us",
        ],
        rows,
    }
}

/// How many of each thing pgherd holds, like PgBouncer's SHOW LISTS.
pub fn lists(app: &App) -> Table {
    let config = app.config();
    let pools = app.pools();
    let (mut lent, mut idle, mut connecting, mut waiting) = (0u64, 0u64, 0u64, 0u64);
    for p in &pools {
        let s = p.snapshot();
        lent += u64::from(s.lent);
        idle += s.idle as u64;
        connecting += u64::from(s.connecting);
        waiting += s.waiting as u64;
    }
    let rows = [
        ("databases", config.databases.len() as u64),
        ("users", config.users.len() as u64),
        ("nodes", app.nodes.all().len() as u64),
        ("pools", pools.len() as u64),
        ("clients", app.clients.all().len() as u64),
        ("clients_waiting", waiting),
        ("servers_active", lent),
        ("servers_idle", idle),
        ("servers_connecting", connecting),
        ("events", app.events.kept_count() as u64),
    ]
    .into_iter()
    .map(|(k, v)| vec![Cell::from(k), Cell::from(v)])
    .collect();
    Table {
        columns: &["list", "items"],
        rows,
    }
}

/// Server connections: those lent to a client now (from the clients' cancel targets) and the
/// idle ones in the pools, like PgBouncer's SHOW SERVERS. Connections being opened are not
/// listed (SHOW POOLS counts them).
pub fn servers(app: &App) -> Table {
    let nodes = app.nodes.all();
    let node_of = |target: &crate::clients::ServerTarget| {
        nodes
            .iter()
            .find(|n| target.is_on(n))
            .map_or_else(|| target.peer.to_string(), |n| n.name().to_owned())
    };
    let mut rows: Vec<Vec<Cell>> = Vec::new();
    for c in app.clients.all() {
        if let Some(t) = c.target() {
            rows.push(vec![
                t.server_id.into(),
                c.database().to_string().into(),
                c.user().to_string().into(),
                node_of(&t).into(),
                "active".into(),
                t.key.process_id.to_string().into(),
                c.id.into(),
                Cell::Null,
                Cell::Null,
            ]);
        }
    }
    for p in app.pools() {
        for (id, pid, age, idle) in p.idle_servers() {
            rows.push(vec![
                id.into(),
                p.database.clone().into(),
                p.user.clone().into(),
                p.node.name.clone().into(),
                "idle".into(),
                pid.to_string().into(),
                Cell::Null,
                age.as_secs().into(),
                idle.as_secs().into(),
            ]);
        }
    }
    Table {
        columns: &[
            "id",
            "database",
            "user",
            "node",
            "state",
            "backend_pid",
            "client",
            "age_s",
            "idle_s",
        ],
        rows,
    }
}

pub fn clients(app: &App) -> Table {
    let rows = app
        .clients
        .all()
        .iter()
        .map(|c| {
            vec![
                c.id.into(),
                c.user().to_string().into(),
                c.database().to_string().into(),
                c.addr.to_string().into(),
                c.tls.into(),
                c.connected_at_unix_s.into(),
                c.target().map(|t| t.server_id).into(),
                c.is_parked().into(),
            ]
        })
        .collect();
    Table {
        columns: &[
            "id",
            "user",
            "database",
            "addr",
            "tls",
            "connected_at",
            "server",
            "parked",
        ],
        rows,
    }
}

pub fn config(app: &App) -> Table {
    let c = app.config();
    let p = &c.pool;
    let join = |addrs: &[std::net::SocketAddr]| {
        addrs
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let rows: Vec<(&str, Cell)> = vec![
        ("config_file", c.source.display().to_string().into()),
        ("listen", join(&c.proxy.listen).into()),
        ("api.listen", join(&c.api.listen).into()),
        ("workers", c.proxy.workers.into()),
        (
            "max_client_connections",
            c.proxy.max_client_connections.into(),
        ),
        ("max_message_bytes", c.proxy.max_message_bytes.into()),
        ("pool.mode", p.mode.as_str().into()),
        ("pool.max_size", p.max_size.into()),
        ("pool.min_size", p.min_size.into()),
        ("pool.wait_timeout_ms", p.wait_timeout_ms.into()),
        (
            "pool.server_idle_timeout_ms",
            p.server_idle_timeout_ms.into(),
        ),
        ("pool.server_lifetime_ms", p.server_lifetime_ms.into()),
        (
            "pool.prepared_statements_per_server",
            p.prepared_statements_per_server.into(),
        ),
        (
            "cluster.health_check_period_ms",
            c.cluster.health_check_period_ms.into(),
        ),
        ("cluster.primary_wait_ms", c.cluster.primary_wait_ms.into()),
        ("failover.enabled", c.failover.enabled.into()),
        ("failover.auto_rejoin", c.failover.auto_rejoin.into()),
        (
            "replication.durability",
            c.replication.durability.as_str().into(),
        ),
        ("reloads", app.reloads.load(Ordering::Relaxed).into()),
    ];
    Table {
        columns: &["key", "value"],
        rows: rows.into_iter().map(|(k, v)| vec![k.into(), v]).collect(),
    }
}

/// `SHOW DATABASES`: the databases the config serves (`*`: any other name), with the pool
/// settings they resolve to and what they hold now.
pub fn databases(app: &App) -> Table {
    let config = app.config();
    let view = app.nodes.view();
    let pools = app.pools();
    let clients = app.clients.all();
    let rows = config
        .databases
        .iter()
        .map(|(name, d)| {
            // The wildcard entry serves every database no other entry names.
            let served = |database: &str| {
                database == name
                    || (name == pgherd_config::WILDCARD_DATABASE
                        && !config.databases.contains_key(database))
            };
            let mine = || pools.iter().filter(|p| served(&p.database));
            let server_connections: u32 = mine().map(|p| p.total()).sum();
            let clients = clients.iter().filter(|c| served(c.database())).count();
            vec![
                name.clone().into(),
                d.dbname.clone().into(),
                d.mode.unwrap_or(config.pool.mode).as_str().into(),
                d.max_size.unwrap_or(config.pool.max_size).into(),
                d.min_size.unwrap_or(config.pool.min_size).into(),
                d.route.as_str().into(),
                d.consistency.as_str().into(),
                d.balance.as_str().into(),
                d.primary_reads.into(),
                clients.into(),
                server_connections.into(),
                mine().count().into(),
                if name == pgherd_config::WILDCARD_DATABASE {
                    view.paused_all
                } else {
                    view.is_paused(name)
                }
                .into(),
            ]
        })
        .collect();
    Table {
        columns: &[
            "name",
            "server_dbname",
            "pool_mode",
            "max_size",
            "min_size",
            "route",
            "consistency",
            "balance",
            "primary_reads",
            "clients",
            "server_connections",
            "pools",
            "paused",
        ],
        rows,
    }
}

/// `SHOW USERS`: the users the config names, how they log in (never the secret) and what they
/// override.
pub fn users(app: &App) -> Table {
    let config = app.config();
    let rows = config
        .users
        .iter()
        .map(|(name, u)| {
            let auth = match (&u.scram, &u.md5) {
                (Some(_), _) => "scram-sha-256",
                (None, Some(_)) => "md5",
                (None, None) => "none",
            };
            vec![
                name.clone().into(),
                auth.into(),
                u.server_password.is_some().into(),
                u.mode.map(|m| m.as_str()).into(),
                u.route.map(|r| r.as_str()).into(),
                u.consistency.map(|c| c.as_str()).into(),
            ]
        })
        .collect();
    Table {
        columns: &[
            "name",
            "verifier",
            "has_server_password",
            "pool_mode",
            "route",
            "consistency",
        ],
        rows,
    }
}
