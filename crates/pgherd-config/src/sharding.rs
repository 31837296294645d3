//! `[sharding]`: tables whose rows are spread over several clusters (shards), and which nodes
//! make each shard (`shard = N` on a `[[nodes]]` entry). Absent: one cluster, as before.
//!
//! ```toml
//! [sharding]
//! [[sharding.tables]]
//! table = "pgbench_accounts"   # or "schema.table"
//! column = "aid"
//! type = "integer"             # smallint, integer, bigint, text, uuid
//! method = "hash"              # hash (as PARTITION BY HASH), range (starts), list (values)
//! ```

use std::collections::BTreeMap;

use pgherd_route::shard_hash::KeyType;
use pgherd_route::shard_plan::{Method, ShardMap, ShardedTable};
use serde::Deserialize;

use crate::raw::RawConfig;
use crate::validate::{field_path, Checker, Seg};
use crate::{ConfigError, NodeConfig};

/// Several shards behind one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharding {
    /// The sharded tables and the number of shards.
    pub map: ShardMap,
    /// Each shard's nodes, shard 0 first (its nodes are also `Config::nodes`).
    pub shard_nodes: Vec<Vec<NodeConfig>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RawSharding {
    #[serde(default)]
    pub tables: Vec<RawShardedTable>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawShardedTable {
    pub table: String,
    pub column: String,
    #[serde(rename = "type", default = "default_key_type")]
    pub key_type: String,
    #[serde(default = "default_method")]
    pub method: String,
    pub starts: Option<Vec<i64>>,
    pub values: Option<Vec<Vec<String>>>,
}

fn default_key_type() -> String {
    "bigint".to_owned()
}

fn default_method() -> String {
    "hash".to_owned()
}

/// Splits the nodes by shard (the nodes of shard 0 first, as `Config::nodes`) and reads
/// `[sharding]`.
pub(crate) fn sharding(
    c: &Checker<'_>,
    raw: &RawConfig,
    nodes: Vec<NodeConfig>,
) -> Result<(Vec<NodeConfig>, Option<Sharding>), ConfigError> {
    let shard_of = |i: usize| raw.nodes.get(i).map_or(0, |n| n.shard);
    let Some(sharding) = raw.sharding.as_ref() else {
        if let Some(i) = (0..nodes.len()).find(|&i| shard_of(i) != 0) {
            return Err(c.error(
                &field_path!["nodes", i, "shard"],
                "nodes belong to shards only with a [sharding] section",
            ));
        }
        return Ok((nodes, None));
    };
    if raw.dcs.is_some() {
        return Err(c.error(
            &field_path!["sharding"],
            "[sharding] and [dcs] together are not supported yet: shards run behind one pgherd instance",
        ));
    }
    // A shard number beyond the node count leaves a gap: said before anything is sized by it.
    if let Some(i) = (0..nodes.len()).find(|&i| shard_of(i) as usize >= nodes.len()) {
        return Err(c.error(
            &field_path!["nodes", i, "shard"],
            format!(
                "shard {} but only {} nodes: shards are numbered from 0 without gaps",
                shard_of(i),
                nodes.len()
            ),
        ));
    }
    let shards = (0..nodes.len()).map(shard_of).max().unwrap_or(0) + 1;
    let mut shard_nodes: Vec<Vec<NodeConfig>> = vec![Vec::new(); shards as usize];
    for (i, node) in nodes.into_iter().enumerate() {
        shard_nodes[shard_of(i) as usize].push(node);
    }
    if let Some(empty) = shard_nodes.iter().position(Vec::is_empty) {
        let last = (0..raw.nodes.len())
            .rev()
            .find(|&i| shard_of(i) == shards - 1)
            .unwrap_or(0);
        return Err(c.error(
            &field_path!["nodes", last, "shard"],
            format!(
                "shard {} has nodes but shard {empty} has none: shards are numbered from 0 without gaps",
                shards - 1
            ),
        ));
    }
    let mut tables = BTreeMap::new();
    let mut qualified = std::collections::BTreeSet::new();
    for (i, t) in sharding.tables.iter().enumerate() {
        let (name, table) = table(c, i, t, shards)?;
        // `accounts` is `public.accounts`, as statements name it.
        let schema_qualified = if name.contains('.') {
            name.clone()
        } else {
            format!("public.{name}")
        };
        // `accounts` and `public.accounts` are one table: each name is listed once.
        if !qualified.insert(schema_qualified) {
            return Err(c.error(
                &field_path!["sharding", "tables", i, "table"],
                format!("table {name:?} is listed twice"),
            ));
        }
        tables.insert(name, table);
    }
    let shard0 = shard_nodes[0].clone();
    Ok((
        shard0,
        Some(Sharding {
            map: ShardMap { shards, tables },
            shard_nodes,
        }),
    ))
}

fn table(
    c: &Checker<'_>,
    i: usize,
    raw: &RawShardedTable,
    shards: u32,
) -> Result<(String, ShardedTable), ConfigError> {
    let at = |field: &str| field_path!["sharding", "tables", i, field];
    // As PostgreSQL folds unquoted names: what statements name is compared with these.
    let identifier = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.chars()
                .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '_' || ch == '$')
            && !s.starts_with(|ch: char| ch.is_ascii_digit() || ch == '$')
    };
    let parts: Vec<&str> = raw.table.split('.').collect();
    if parts.len() > 2 || !parts.iter().all(|p| identifier(p)) {
        return Err(c.error(
            &at("table"),
            "must be a table name or schema.table, in lower case without quotes",
        ));
    }
    if !identifier(&raw.column) {
        return Err(c.error(
            &at("column"),
            "must be a column name in lower case without quotes",
        ));
    }
    let key_type = KeyType::from_type_name(&raw.key_type).ok_or_else(|| {
        c.error(
            &at("type"),
            format!(
                "unknown key type {:?}: one of smallint, integer, bigint, text, uuid",
                raw.key_type
            ),
        )
    })?;
    let integer = matches!(key_type, KeyType::Int2 | KeyType::Int4 | KeyType::Int8);
    let method = match raw.method.as_str() {
        "hash" => {
            if raw.starts.is_some() || raw.values.is_some() {
                let field = if raw.starts.is_some() {
                    "starts"
                } else {
                    "values"
                };
                return Err(c.error(&at(field), "belongs to method \"range\" or \"list\""));
            }
            Method::Hash
        }
        "range" if raw.values.is_some() => {
            return Err(c.error(&at("values"), "belongs to method \"list\""));
        }
        "list" if raw.starts.is_some() => {
            return Err(c.error(&at("starts"), "belongs to method \"range\""));
        }
        "range" => {
            if !integer {
                return Err(c.error(&at("type"), "method \"range\" needs an integer key"));
            }
            let Some(starts) = raw.starts.clone() else {
                return Err(c.error(
                    &at("method"),
                    format!("method \"range\" needs starts: the lowest key of each of the {shards} shards"),
                ));
            };
            if starts.len() != shards as usize || !starts.windows(2).all(|w| w[0] < w[1]) {
                return Err(c.error(
                    &at("starts"),
                    format!("must give {shards} ascending starts, one per shard"),
                ));
            }
            Method::Range { starts }
        }
        "list" => {
            let Some(values) = raw.values.clone() else {
                return Err(c.error(
                    &at("method"),
                    format!(
                        "method \"list\" needs values: the keys of each of the {shards} shards"
                    ),
                ));
            };
            if values.len() != shards as usize {
                return Err(c.error(
                    &at("values"),
                    format!("must give {shards} lists of keys, one per shard"),
                ));
            }
            Method::List { values }
        }
        other => {
            return Err(c.error(
                &at("method"),
                format!("unknown method {other:?}: one of hash, range, list"),
            ))
        }
    };
    let table = ShardedTable {
        key_column: raw.column.clone(),
        key_type,
        method,
        key_ordinal: None,
    };
    // Each key must have one shard: a list key given twice would have two.
    if let Method::List { values } = &table.method {
        for (shard, listed) in values.iter().enumerate() {
            for value in listed {
                match table.shard_of(shards, value) {
                    Ok(Some(first)) if first as usize == shard => {}
                    Ok(_) => {
                        return Err(c.error(
                            &at("values"),
                            format!("key {value:?} is listed for more than one shard"),
                        ))
                    }
                    Err(e) => return Err(c.error(&at("values"), e.to_string())),
                }
            }
        }
    }
    Ok((raw.table.clone(), table))
}
