//! `pgherd up --shards N`: shard 0 is the cluster `up` always makes; every other shard is a
//! cluster of its own in `shard<k>/` (a primary and the same number of replicas), with the same
//! roles and passwords, behind the one endpoint. `--shard-key TABLE.COLUMN[:TYPE]` names the
//! sharded tables; every other table is on every shard.

use std::path::{Path, PathBuf};

use pgherd_cluster::LocalCluster;
use pgherd_config::Config;
use pgherd_route::shard_hash::KeyType;

/// A sharded table as `--shard-key` gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardKey {
    pub table: String,
    pub column: String,
    pub key_type: KeyType,
}

/// `TABLE.COLUMN` or `TABLE.COLUMN:TYPE` (`schema.table.column` too); the type defaults to
/// bigint, which routes any integer key.
pub fn parse_shard_key(text: &str) -> Result<ShardKey, String> {
    let (name, key_type) = match text.split_once(':') {
        Some((name, type_name)) => (
            name,
            KeyType::from_type_name(&type_name.to_lowercase()).ok_or_else(|| {
                format!("--shard-key {text}: type {type_name} is not one of smallint, integer, bigint, text, uuid")
            })?,
        ),
        None => (text, KeyType::Int8),
    };
    let (table, column) = name
        .rsplit_once('.')
        .filter(|(t, c)| !t.is_empty() && !c.is_empty())
        .ok_or_else(|| format!("--shard-key {text}: give it as TABLE.COLUMN[:TYPE]"))?;
    Ok(ShardKey {
        table: table.to_lowercase(),
        column: column.to_lowercase(),
        key_type,
    })
}

/// Before the names of shard `shard`'s nodes (`shard<k>-pg<i>`): node names are unique over
/// the shards, and a standby streams under its node's name (its synchronous standby name).
pub fn node_prefix(shard: usize) -> String {
    format!("shard{shard}-")
}

/// The `[[nodes]]` of shard `shard` (made with [`node_prefix`], their data under `shard<k>/`);
/// `[sharding]` comes from [`sharding_section`].
pub fn nodes_section(shard: usize, cluster: &LocalCluster) -> String {
    cluster
        .nodes
        .iter()
        .map(|node| {
            format!(
                "[[nodes]]\nname = \"{name}\"\nhost = \"127.0.0.1\"\nport = {port}\n\
                 data_dir = \"shard{shard}/{name}\"\nshard = {shard}\n\n",
                name = node.name,
                port = node.port
            )
        })
        .collect()
}

pub fn sharding_section(keys: &[ShardKey]) -> String {
    let mut text = String::from(
        "# Tables spread over the shards by their key; every other table is on every shard.\n\
         [sharding]\n",
    );
    for key in keys {
        text.push_str(&format!(
            "[[sharding.tables]]\ntable = \"{}\"\ncolumn = \"{}\"\ntype = \"{}\"\n",
            key.table,
            key.column,
            key.key_type.name()
        ));
    }
    text.push('\n');
    text
}

/// The directory of shard `shard`'s cluster.
pub fn shard_dir(dir: &Path, shard: usize) -> PathBuf {
    dir.join(format!("shard{shard}"))
}

/// Every local cluster a config written by `up` names: its nodes grouped by the directory
/// their data is in (shard 0's is `dir`, the others' `shard<k>/`).
pub fn open_clusters(config: &Config) -> Result<Vec<LocalCluster>, String> {
    let nodes: Vec<&pgherd_config::NodeConfig> = match &config.sharding {
        Some(sharding) => sharding.shard_nodes.iter().flatten().collect(),
        None => config.nodes.iter().collect(),
    };
    let mut groups: Vec<(PathBuf, Vec<(String, u16)>)> = Vec::new();
    for node in nodes {
        let Some(data_dir) = &node.data_dir else {
            continue;
        };
        let (Some(parent), Some(name)) = (data_dir.parent(), data_dir.file_name()) else {
            continue;
        };
        let entry = (name.to_string_lossy().into_owned(), node.port);
        match groups.iter_mut().find(|(dir, _)| dir == parent) {
            Some((_, members)) => members.push(entry),
            None => groups.push((parent.to_owned(), vec![entry])),
        }
    }
    if groups.is_empty() {
        return Err(format!(
            "{} names no node with a data_dir that pgherd could start",
            config.source.display()
        ));
    }
    let password = config.cluster.password.clone().unwrap_or_default();
    groups
        .iter()
        .map(|(dir, nodes)| {
            LocalCluster::open(dir, nodes, &config.cluster.user, &password)
                .map_err(|e| e.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_keys_read_with_their_type() {
        assert_eq!(
            parse_shard_key("pgbench_accounts.aid"),
            Ok(ShardKey {
                table: "pgbench_accounts".into(),
                column: "aid".into(),
                key_type: KeyType::Int8
            })
        );
        assert_eq!(
            parse_shard_key("app.Orders.id:integer").map(|k| (k.table, k.key_type)),
            Ok(("app.orders".into(), KeyType::Int4))
        );
        for bad in ["aid", ".aid", "t.", "t.c:float"] {
            assert!(parse_shard_key(bad).is_err(), "{bad}");
        }
    }
}
