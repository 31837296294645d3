//! `pgherd clone NEW --from NODE`: a new streaming replica on this machine, copied with
//! `pg_basebackup` (a progress bar while it copies) from any node of the cluster: from the
//! primary, or from a replica, which it then streams from (cascading). A replication slot is
//! made for it on the node it streams from, it is added to the config as a node, and the
//! running pgherd is told to reload, so it routes reads to it once it has caught up.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pgherd_cluster::{CloneSource, LocalNode};
use pgherd_config::{Config, NodeConfig};
use pgherd_proxy::nodes::{CheckThresholds, Nodes};
use pgherd_proxy::server::ServerConn;

use crate::config_file::{edit_nodes, reload_running};
use crate::local::Where;

#[derive(clap::Args, Debug)]
pub struct CloneOptions {
    /// The new node's name (letters, digits, `-` and `_`).
    name: String,
    /// The node to copy and stream from: the primary, or a replica (cascading replication).
    #[arg(long)]
    from: String,
    /// Its port [default: a free one].
    #[arg(long)]
    port: Option<u16>,
    /// Its data directory [default: named after it, beside the data directories of the
    /// nodes pgherd manages].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    #[command(flatten)]
    at: Where,
}

pub fn run(options: CloneOptions) -> Result<(), String> {
    let path = options.at.config_path()?;
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    let name = &options.name;
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(format!(
            "{name:?} cannot name a node: letters, digits, '-' and '_' only"
        ));
    }
    if config.node_of_any_shard(name).is_some() {
        return Err(format!(
            "{} has a node named {name} already",
            path.display()
        ));
    }
    let from = config.node_of_any_shard(&options.from).ok_or_else(|| {
        format!(
            "no node \"{}\" in {} (its nodes: {})",
            options.from,
            path.display(),
            config.node_names()
        )
    })?;
    // A node of another shard's cluster: the clone joins that shard.
    let shard = config.shard_of(&from.name).unwrap_or(0);
    let data_dir = match &options.data_dir {
        Some(dir) => dir.clone(),
        None => beside_managed_nodes(&config, name, shard)?,
    };
    let port = match options.port {
        Some(port) => port,
        None => pgherd_cluster::free_port().map_err(|e| e.to_string())?,
    };
    let node = LocalNode::managed(
        name,
        ("127.0.0.1", port),
        None,
        &data_dir,
        &config.cluster.user,
    )
    .map_err(|e| e.to_string())?;
    let slot = pgherd_cluster::slot_name(name);
    let from_is_replica = crate::runtime(1)?.block_on(create_slot(&config, from, &slot))?;
    let (user, password) = config.replication.standby_login(&config.cluster);
    let source = CloneSource {
        name: &from.name,
        host: &from.host,
        port: from.port,
        user,
        password,
        slot: &slot,
    };
    eprintln!(
        "copying {} into {} (port {port}) ...",
        from.name,
        data_dir.display()
    );
    let bar = indicatif::ProgressBar::new(0);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:40} {bytes}/{total_bytes} ({bytes_per_sec}, {eta} left)",
    ) {
        bar.set_style(style);
    }
    let cloned = node.clone_from(&source, &mut |done_kb, total_kb| {
        bar.set_length(total_kb * 1024);
        bar.set_position(done_kb * 1024);
    });
    bar.finish_and_clear();
    cloned.map_err(|e| e.to_string())?;
    add_to_config(&path, (name, shard), port, &data_dir)?;
    let streaming = crate::runtime(1)?.block_on(wait_streaming(&config, from, name));
    reload_running(&options.at, &config, "to route to the new node");
    streaming?;
    let how = if from_is_replica {
        "cascading from a replica"
    } else {
        "from the primary"
    };
    println!(
        "{name} streams from {} ({how}) on port {port}; data directory {}",
        from.name,
        data_dir.display()
    );
    Ok(())
}

/// `NAME` beside the data directory of the first node pgherd manages, of `shard` first.
fn beside_managed_nodes(config: &Config, name: &str, shard: u32) -> Result<PathBuf, String> {
    let of_shard = config
        .sharding
        .as_ref()
        .and_then(|s| s.shard_nodes.get(shard as usize))
        .map_or(config.nodes.as_slice(), Vec::as_slice);
    of_shard
        .iter()
        .chain(&config.nodes)
        .find_map(|n| n.data_dir.as_deref()?.parent().map(|p| p.join(name)))
        .ok_or_else(|| {
            "no node of the config has a data_dir to put the new one beside: name its directory with --data-dir".to_owned()
        })
}

/// The config's nodes as a registry of their own (not the running pgherd's), for commands
/// that open sessions to them.
pub(crate) fn registry(config: &Config) -> Nodes {
    registry_of(&config.nodes)
}

/// A registry of `nodes` alone (of any shard), for one-off management sessions.
pub(crate) fn registry_of(nodes: &[NodeConfig]) -> Nodes {
    Nodes::new(
        nodes,
        CheckThresholds {
            rejoin_after_checks: 1,
            failures_before_down: 1,
        },
    )
}

pub(crate) async fn session_on(config: &Config, node: &NodeConfig) -> Result<ServerConn, String> {
    session_in(config, node, "postgres").await
}

/// A session to `node`'s `database` as the `[cluster]` user (TLS as `[server_tls]` says).
pub(crate) async fn session_in(
    config: &Config,
    node: &NodeConfig,
    database: &str,
) -> Result<ServerConn, String> {
    // Any shard's node: the registry is made of this one.
    let registry = registry_of(std::slice::from_ref(node));
    let state = registry
        .get(&node.name)
        .ok_or_else(|| format!("no node {}", node.name))?;
    let ctx = pgherd_proxy::app::connect_context(config, Default::default())?;
    pgherd_proxy::monitor::management_connection(&state, &config.cluster, &ctx, database)
        .await
        .map_err(|e| format!("node {}: {e}", node.name))
}

/// The clone's physical slot on the node it streams from (a replica can hold one too), so
/// that node keeps the WAL the clone has not received; whether that node is a replica (the
/// clone then cascades).
async fn create_slot(config: &Config, from: &NodeConfig, slot: &str) -> Result<bool, String> {
    let mut conn = session_on(config, from).await?;
    let quoted = pgherd_replication::consistency::quote_literal(slot);
    conn.simple_query(&format!(
        "SELECT pg_create_physical_replication_slot({quoted}) \
         WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = {quoted})"
    ))
    .await
    .map_err(|e| {
        format!(
            "cannot make the replication slot {slot} on {}: {e}",
            from.name
        )
    })?;
    let rows = conn
        .simple_query("SELECT pg_is_in_recovery()::text")
        .await
        .map_err(|e| format!("node {}: {e}", from.name))?;
    Ok(rows
        .first()
        .and_then(|r| r.first())
        .cloned()
        .flatten()
        .as_deref()
        == Some("true"))
}

/// Waits until `from` reports the clone streaming from it.
async fn wait_streaming(config: &Config, from: &NodeConfig, name: &str) -> Result<(), String> {
    let mut conn = session_on(config, from).await?;
    let question = format!(
        "SELECT count(*)::text FROM pg_stat_replication WHERE application_name = {} AND state = 'streaming'",
        pgherd_replication::consistency::quote_literal(name)
    );
    let started = Instant::now();
    loop {
        let rows = conn
            .simple_query(&question)
            .await
            .map_err(|e| format!("node {}: {e}", from.name))?;
        if rows.first().and_then(|r| r.first()).cloned().flatten() == Some("1".into()) {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "{name} was started but does not stream from {} after 60 s: see its log",
                from.name
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Appends the clone's `[[nodes]]` entry to the config file (put back as it was if the
/// result does not load).
fn add_to_config(
    path: &Path,
    (name, shard): (&str, u32),
    port: u16,
    data_dir: &Path,
) -> Result<(), String> {
    edit_nodes(path, &format!("with {name} added"), |nodes| {
        let mut entry = toml_edit::Table::new();
        entry.insert("name", toml_edit::value(name));
        entry.insert("host", toml_edit::value("127.0.0.1"));
        entry.insert("port", toml_edit::value(i64::from(port)));
        entry.insert("data_dir", toml_edit::value(data_dir.display().to_string()));
        if shard > 0 {
            entry.insert("shard", toml_edit::value(i64::from(shard)));
        }
        nodes.push(entry);
        Ok(())
    })
    .map_err(|e| format!("{e}; {name} runs on port {port}"))
}
