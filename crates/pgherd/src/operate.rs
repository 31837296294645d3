//! Operator commands against any pgherd config: `pgherd status` (from the running pgherd's
//! HTTP API, else from the nodes directly), `pgherd events`, and the commands that run on the
//! admin console (`switchover`, `rejoin`, `detach`, `attach`).

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use pgherd_config::Config;
use serde::Serialize;

use crate::local::{running_pid, Where};

#[derive(Serialize)]
struct StatusReport {
    config: String,
    /// `pgherd` when the running pgherd answered (its HTTP API), `nodes` when pgherd is not
    /// running or has no `[api]` and the nodes were asked directly.
    source: &'static str,
    pgherd: ProxyStatus,
    /// The pgherd instances of the cluster (`SHOW INSTANCES`): with `[dcs]`, every one
    /// registered in etcd and which leads; otherwise the one. Empty when pgherd did not answer.
    instances: Vec<serde_json::Value>,
    nodes: Vec<NodeStatus>,
    /// With `[sharding]`, each shard's nodes (`SHOW SHARDS`), as the running pgherd sees them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    shards: Vec<serde_json::Value>,
}

#[derive(Serialize)]
struct ProxyStatus {
    listen: Vec<String>,
    running: bool,
    pid: Option<i32>,
    /// The admin console, as a libpq URL for the `[cluster]` user (no password).
    console: Option<String>,
    /// The HTTP API's base URLs (`[api] listen`).
    api: Vec<String>,
}

#[derive(Serialize)]
struct NodeStatus {
    name: String,
    role: String,
    state: String,
    host: String,
    port: u16,
    data_dir: Option<String>,
    error: Option<String>,
    /// The primary's WAL insert position or a replica's replay position.
    lsn: Option<String>,
    /// How far a replica's replay is behind the primary's position, in bytes.
    lag_bytes: Option<u64>,
    /// The rest is known only from a running pgherd.
    lag_ms: Option<u64>,
    /// Writes go to this node now.
    takes_writes: Option<bool>,
    in_read_set: Option<bool>,
    /// Server connections pgherd holds to the node (in use and idle).
    server_connections: Option<u64>,
    /// The node a replica streams from (the primary, or another replica when it cascades).
    upstream: Option<String>,
}

/// PostgreSQL's client `tool` (psql, pg_dump) to run as the `[cluster]` user; its password
/// goes through a password file (never the command line or environment), which lives as long
/// as the second value.
pub(crate) fn cluster_tool(
    config: &Config,
    tool: &str,
) -> Result<(std::process::Command, Option<pgherd_cluster::PassFile>), String> {
    let path = pgherd_cluster::PgBinaries::find()
        .map_err(|e| e.to_string())?
        .tool(tool);
    let pass_file = config
        .cluster
        .password
        .as_deref()
        .map(|p| pgherd_cluster::PassFile::new(p, None))
        .transpose()
        .map_err(|e| e.to_string())?;
    let mut command = std::process::Command::new(&path);
    if let Some(file) = &pass_file {
        command.env("PGPASSFILE", file.path());
    }
    Ok((command, pass_file))
}

/// Runs `command` on the admin console of the pgherd configured by `dir` or `config_path`,
/// logging in as the `[cluster]` user (an admin user in configs `pgherd up` writes), and
/// prints its answer.
pub fn admin_command(at: &Where, console_command: &str) -> Result<(), String> {
    let path = at.config_path()?;
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    let listen = config
        .proxy
        .listen
        .first()
        .ok_or_else(|| format!("{} has no listen address", path.display()))?;
    let address = connectable(*listen);
    let (mut command, _pass_file) = cluster_tool(&config, "psql")?;
    let out = command
        .args([
            "-X",
            "-h",
            &address.ip().to_string(),
            "-p",
            &address.port().to_string(),
            "-U",
            &config.cluster.user,
            "-d",
            "pgherd",
            "-c",
            console_command,
        ])
        .output()
        .map_err(|e| format!("cannot run psql: {e}"))?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

pub fn status(at: &Where, json: bool) -> Result<(), String> {
    let path = at.config_path()?;
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    let pid_dir = path.parent().unwrap_or(Path::new("/")).to_owned();
    let pid = running_pid(&pid_dir);
    let listening =
        config.proxy.listen.iter().any(|a| {
            TcpStream::connect_timeout(&connectable(*a), Duration::from_millis(500)).is_ok()
        });
    let from_pgherd = match config.api.listen.first() {
        Some(api) if listening => fetch_status(connectable(*api))
            .map_err(|e| eprintln!("pgherd's HTTP API did not answer ({e}); asking the nodes"))
            .ok(),
        _ => None,
    };
    let listed = |name: &str| {
        from_pgherd
            .as_ref()
            .and_then(|answer| answer[name].as_array().cloned())
            .unwrap_or_default()
    };
    let (instances, shards) = (listed("instances"), listed("shards"));
    let (source, nodes) = match from_pgherd {
        Some(answer) => ("pgherd", nodes_from_pgherd(&config, &answer)),
        None => ("nodes", crate::runtime(1)?.block_on(check_nodes(&config))),
    };
    let report = StatusReport {
        config: path.display().to_string(),
        source,
        pgherd: ProxyStatus {
            listen: config.proxy.listen.iter().map(|a| a.to_string()).collect(),
            running: listening,
            pid,
            console: config.proxy.listen.first().map(|a| {
                format!(
                    "postgres://{}@{}/pgherd",
                    config.cluster.user,
                    connectable(*a)
                )
            }),
            api: config
                .api
                .listen
                .iter()
                .map(|a| format!("http://{}", connectable(*a)))
                .collect(),
        },
        instances,
        nodes,
        shards,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
    } else {
        print_status(&report);
    }
    Ok(())
}

/// `pgherd events`: the running pgherd's event log, from its HTTP API.
pub fn events(at: &Where, json: bool) -> Result<(), String> {
    let path = at.config_path()?;
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    let api = config.api.listen.first().ok_or_else(|| {
        format!(
            "{} has no [api] listen address; events are also on the admin console (SHOW EVENTS)",
            path.display()
        )
    })?;
    let events = fetch(connectable(*api), "/api/events")
        .map_err(|e| format!("pgherd's HTTP API at {api} did not answer: {e}"))?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&events).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    for e in events.as_array().into_iter().flatten() {
        let at_s = e["at_epoch_s"].as_f64().unwrap_or(0.0);
        let millis = (at_s.fract() * 1000.0) as u32;
        let secs = at_s as i64;
        let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
        println!(
            "{h:02}:{m:02}:{s:02}.{millis:03} UTC  {:<16} {:<6} {}",
            e["kind"].as_str().unwrap_or(""),
            e["node"].as_str().unwrap_or(""),
            e["detail"].as_str().unwrap_or("")
        );
    }
    Ok(())
}

/// `GET /api/status` from the running pgherd.
fn fetch_status(api: SocketAddr) -> Result<serde_json::Value, String> {
    fetch(api, "/api/status")
}

/// `GET path` from the running pgherd's HTTP API, as JSON.
fn fetch(api: SocketAddr, path: &str) -> Result<serde_json::Value, String> {
    ureq::get(&format!("http://{api}{path}"))
        .timeout(Duration::from_secs(3))
        .call()
        .map_err(|e| e.to_string())?
        .into_json()
        .map_err(|e| e.to_string())
}

/// The nodes as the running pgherd sees them.
fn nodes_from_pgherd(config: &Config, answer: &serde_json::Value) -> Vec<NodeStatus> {
    let rows = answer["nodes"].as_array().cloned().unwrap_or_default();
    let pools = answer["pools"].as_array().cloned().unwrap_or_default();
    rows.iter()
        .map(|n| {
            let name = n["name"].as_str().unwrap_or_default().to_owned();
            let connections = pools
                .iter()
                .filter(|p| p["node"].as_str() == Some(&name))
                .map(|p| p["sv_active"].as_u64().unwrap_or(0) + p["sv_idle"].as_u64().unwrap_or(0))
                .sum();
            let role = n["role"].as_str().unwrap_or("unknown").to_owned();
            NodeStatus {
                data_dir: config
                    .nodes
                    .iter()
                    .find(|c| c.name == name)
                    .and_then(|c| c.data_dir.as_ref())
                    .map(|d| d.display().to_string()),
                role: role.clone(),
                state: n["state"].as_str().unwrap_or("unknown").to_owned(),
                host: n["host"].as_str().unwrap_or_default().to_owned(),
                port: n["port"]
                    .as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .unwrap_or(0),
                error: n["last_error"].as_str().map(str::to_owned),
                lsn: n["lsn"].as_str().map(str::to_owned),
                lag_bytes: (role == "replica")
                    .then(|| n["lag_bytes"].as_u64())
                    .flatten(),
                lag_ms: (role == "replica").then(|| n["lag_ms"].as_u64()).flatten(),
                takes_writes: n["takes_writes"].as_bool(),
                in_read_set: n["in_read_set"].as_bool(),
                server_connections: Some(connections),
                upstream: n["upstream"].as_str().map(str::to_owned),
                name,
            }
        })
        .collect()
}

/// A wildcard listen address is reached through loopback.
pub(crate) fn connectable(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        let ip = if addr.is_ipv4() {
            std::net::IpAddr::from([127, 0, 0, 1])
        } else {
            std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
        };
        SocketAddr::new(ip, addr.port())
    } else {
        addr
    }
}

async fn check_nodes(config: &Config) -> Vec<NodeStatus> {
    let ctx = pgherd_proxy::pool::ConnectContext {
        tls_mode: config.server_tls.mode,
        tls: pgherd_proxy::tls::server_connector(&config.server_tls)
            .ok()
            .flatten(),
        next_server_id: Default::default(),
    };
    use pgherd_proxy::nodes::Role;
    use pgherd_route::balance::format_lsn;
    let registry = pgherd_proxy::nodes::Nodes::new(
        &config.nodes,
        pgherd_proxy::nodes::CheckThresholds {
            rejoin_after_checks: 1,
            failures_before_down: 1,
        },
    );
    let mut seen = Vec::new();
    for node in registry.all().iter() {
        let mut conn = None;
        seen.push(pgherd_proxy::monitor::check_once(node, &config.cluster, &ctx, &mut conn).await);
    }
    let primary_lsn = seen
        .iter()
        .filter_map(|s| s.as_ref().ok())
        .find(|s| s.role == Role::Primary)
        .map(|s| s.lsn);
    let mut out = Vec::new();
    for (node, outcome) in registry.all().iter().zip(seen) {
        let (role, state, error, lsn, lag_bytes) = match outcome {
            Ok(o) => (
                o.role.as_str().to_owned(),
                "up".to_owned(),
                None,
                Some(format_lsn(o.lsn)),
                match (o.role, primary_lsn) {
                    (Role::Replica, Some(p)) => Some(p.saturating_sub(o.lsn)),
                    _ => None,
                },
            ),
            Err(e) => (
                "unknown".to_owned(),
                "down".to_owned(),
                Some(format!("{} ({})", e.message, e.kind.as_str())),
                None,
                None,
            ),
        };
        out.push(NodeStatus {
            name: node.config.name.clone(),
            role,
            state,
            host: node.config.host.clone(),
            port: node.config.port,
            data_dir: node
                .config
                .data_dir
                .as_ref()
                .map(|d| d.display().to_string()),
            error,
            lsn,
            lag_bytes,
            lag_ms: None,
            takes_writes: None,
            in_read_set: None,
            server_connections: None,
            upstream: None,
        });
    }
    out
}

fn print_status(report: &StatusReport) {
    println!(
        "pgherd  {}  listen {}{}",
        if report.pgherd.running {
            "running"
        } else {
            "not running"
        },
        report.pgherd.listen.join(", "),
        report
            .pgherd
            .pid
            .map(|p| format!("  pid {p}"))
            .unwrap_or_default()
    );
    if let Some(console) = &report.pgherd.console {
        println!("console {console}");
    }
    if !report.pgherd.api.is_empty() {
        println!("api     {}", report.pgherd.api.join(", "));
    }
    if report.instances.len() > 1 || report.instances.iter().any(|i| !i["instance"].is_null()) {
        for i in &report.instances {
            println!(
                "instance {}{}{}  listen {}  pid {}",
                i["instance"].as_str().unwrap_or("?"),
                if i["leads"] == true { "  (leader)" } else { "" },
                if i["this"] == true {
                    "  (this one)"
                } else {
                    ""
                },
                i["listen"].as_str().unwrap_or(""),
                i["pid"]
            );
        }
    }
    println!(
        "{}",
        if report.source == "pgherd" {
            "as pgherd sees the nodes:"
        } else {
            "pgherd did not answer over HTTP ([api]); the nodes as they answer directly:"
        }
    );
    println!();
    const COLUMNS: usize = 9;
    let header: [&str; COLUMNS] = [
        "NODE",
        "ROLE",
        "STATE",
        "WRITES",
        "READS",
        "ADDRESS",
        "LSN",
        "LAG",
        "CONNS / DATA DIR / ERROR",
    ];
    let yes_no = |b: Option<bool>| match b {
        Some(true) => "yes".to_owned(),
        Some(false) => "no".to_owned(),
        None => "?".to_owned(),
    };
    let rows: Vec<[String; COLUMNS]> = report
        .nodes
        .iter()
        .map(|n| {
            let lag = match (n.lag_bytes, n.lag_ms) {
                (Some(b), Some(ms)) => format!("{b} B / {ms} ms"),
                (Some(b), None) => format!("{b} B"),
                _ => String::new(),
            };
            let last = match (&n.error, n.server_connections) {
                (Some(e), _) => e.clone(),
                (None, Some(c)) => format!("{c} conns  {}", n.data_dir.clone().unwrap_or_default()),
                (None, None) => n.data_dir.clone().unwrap_or_default(),
            };
            let role = match &n.upstream {
                Some(upstream) => format!("{} of {upstream}", n.role),
                None => n.role.clone(),
            };
            [
                n.name.clone(),
                role,
                n.state.clone(),
                yes_no(n.takes_writes),
                yes_no(n.in_read_set),
                format!("{}:{}", n.host, n.port),
                n.lsn.clone().unwrap_or_default(),
                lag,
                last.trim_end().to_owned(),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..COLUMNS)
        .map(|i| {
            rows.iter()
                .map(|r| r[i].len())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: [&str; COLUMNS]| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_owned()
    };
    println!("{}", line(header));
    for r in &rows {
        println!("{}", line(std::array::from_fn(|i| r[i].as_str())));
    }
    print_shards(&report.shards);
}

/// With `[sharding]`: each shard's nodes, and the sharded tables.
fn print_shards(shards: &[serde_json::Value]) {
    let Some(tables) = shards.first().and_then(|s| s["sharded_tables"].as_str()) else {
        return;
    };
    println!();
    println!("shards (sharded tables: {tables}):");
    for s in shards {
        println!(
            "  shard {}  {:<12} {:<8} {:<6} {}{}",
            s["shard"],
            s["node"].as_str().unwrap_or("?"),
            s["role"].as_str().unwrap_or("?"),
            s["state"].as_str().unwrap_or("?"),
            format_args!("{}:{}", s["host"].as_str().unwrap_or("?"), s["port"]),
            if s["takes_writes"] == true {
                "  takes writes"
            } else {
                ""
            }
        );
    }
}
