//! `pgherd remove NODE`: takes a replica out of the cluster without restarting pgherd. The
//! node is stopped (when pgherd manages it on this machine), its replication slots on the
//! other nodes are dropped (they would hold WAL for it forever), its entry leaves the config
//! and the running pgherd reloads: it stops routing to it and leaves it out of the
//! synchronous standbys. Its data directory stays unless `--delete-data` says otherwise.
//!
//! Refused, with nothing changed: the primary, a replica others stream from (cascading), and
//! a node that does not answer while no other node answers as the primary (it may be the
//! primary).

use std::path::Path;
use std::time::Duration;

use pgherd_cluster::{LocalNode, StopMode};
use pgherd_config::{Config, NodeConfig};

use crate::clone::session_on;
use crate::config_file::{edit_nodes, reload_running};
use crate::local::Where;
use crate::set_nodes::{drop_slot_when_released, SlotDrop};

#[derive(clap::Args, Debug)]
pub struct RemoveOptions {
    /// The node to remove: a replica no other node streams from.
    name: String,
    /// Delete its data directory too (a node pgherd manages on this machine).
    #[arg(long)]
    delete_data: bool,
    #[command(flatten)]
    at: Where,
}

/// What a survey of the cluster found out about one node.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NodeSeen {
    name: String,
    answers: bool,
    primary: bool,
    /// The application names of the standbys streaming from it.
    children: Vec<String>,
}

/// How long a node may take to answer the survey.
const SURVEY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a stopped node's slots may stay active while its senders notice it left.
const SLOT_RELEASE_WAIT: Duration = Duration::from_secs(10);

pub fn run(options: RemoveOptions) -> Result<(), String> {
    let path = options.at.config_path()?;
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    let name = options.name.as_str();
    let node = match config.node(name) {
        Some(node) => node,
        None if config.node_of_any_shard(name).is_some() => {
            return Err(format!(
            "{name} is a node of a shard other than the first; removing those is not supported yet"
        ))
        }
        None => {
            return Err(format!(
                "no node \"{name}\" in {} (its nodes: {})",
                path.display(),
                config.node_names()
            ))
        }
    };
    let runtime = crate::runtime(1)?;
    let seen = runtime.block_on(survey(&config));
    if let Some(why) = refusal(name, &seen) {
        return Err(format!("{name} is not removed: {why}"));
    }
    let answers = seen.iter().any(|n| n.name == name && n.answers);
    let local = managed(&config, node)?;
    match (&local, answers) {
        (Some(local), _) if local.is_running() => {
            eprintln!("stopping {name} ...");
            local.stop(StopMode::Fast).map_err(|e| e.to_string())?;
        }
        (None, true) => {
            return Err(format!(
                "{name} is not removed: it still runs and pgherd does not manage it (no data_dir in its entry): stop it, then remove it"
            ))
        }
        _ => {}
    }
    let others: Vec<&NodeConfig> = config
        .nodes
        .iter()
        .filter(|n| n.name != name && seen.iter().any(|s| s.name == n.name && s.answers))
        .collect();
    let dropped = runtime.block_on(drop_slots(&config, &others, name))?;
    remove_from_config(&path, name)?;
    reload_running(&options.at, &config, &format!("to stop routing to {name}"));
    let data = match (&local, options.delete_data) {
        (Some(local), true) => {
            std::fs::remove_dir_all(&local.data_dir)
                .map_err(|e| format!("{}: {e}", local.data_dir.display()))?;
            format!("its data directory {} is deleted", local.data_dir.display())
        }
        (Some(local), false) => format!(
            "its data directory {} is kept (--delete-data deletes it)",
            local.data_dir.display()
        ),
        (None, _) => "its data is wherever it runs; pgherd does not manage it".to_owned(),
    };
    let slots = match dropped.as_slice() {
        [] => "no replication slot held WAL for it".to_owned(),
        on => format!("its replication slot is dropped on {}", on.join(", ")),
    };
    println!("{name} is removed from the cluster; {slots}; {data}");
    Ok(())
}

/// Why `name` may not be removed, judged on what the survey saw; `None` when it may.
fn refusal(name: &str, seen: &[NodeSeen]) -> Option<String> {
    let node = seen.iter().find(|n| n.name == name)?;
    let others: Vec<&NodeSeen> = seen.iter().filter(|n| n.name != name).collect();
    if others.is_empty() {
        return Some("it is the cluster's only node".to_owned());
    }
    if node.primary {
        return Some("it is the primary: switch over to another node first".to_owned());
    }
    let children: Vec<&str> = node
        .children
        .iter()
        .filter(|child| others.iter().any(|n| &n.name == *child))
        .map(String::as_str)
        .collect();
    if !children.is_empty() {
        return Some(format!(
            "{} stream{} from it: remove {} or clone {} from another node first",
            children.join(", "),
            if children.len() == 1 { "s" } else { "" },
            if children.len() == 1 { "it" } else { "them" },
            if children.len() == 1 { "it" } else { "them" },
        ));
    }
    if !node.answers && !others.iter().any(|n| n.primary) {
        return Some(
            "it does not answer and no other node answers as the primary: it may be the primary"
                .to_owned(),
        );
    }
    None
}

/// Asks every node of the first shard, at once, whether it is the primary and which standbys
/// stream from it; a node that does not answer in time is seen as not answering.
async fn survey(config: &Config) -> Vec<NodeSeen> {
    let asks = config.nodes.iter().map(|node| async move {
        let asked = tokio::time::timeout(SURVEY_TIMEOUT, ask(config, node)).await;
        match asked {
            Ok(Ok(seen)) => seen,
            _ => NodeSeen {
                name: node.name.clone(),
                answers: false,
                primary: false,
                children: Vec::new(),
            },
        }
    });
    futures_util::future::join_all(asks).await
}

async fn ask(config: &Config, node: &NodeConfig) -> Result<NodeSeen, String> {
    let mut conn = session_on(config, node).await?;
    let rows = conn
        .simple_query(
            "SELECT (NOT pg_is_in_recovery())::text, \
             coalesce((SELECT string_agg(application_name, ',') FROM pg_stat_replication), '')",
        )
        .await
        .map_err(|e| format!("node {}: {e}", node.name))?;
    let row = rows.first().ok_or("no answer")?;
    let primary = row.first().cloned().flatten().as_deref() == Some("true");
    let children = row
        .get(1)
        .cloned()
        .flatten()
        .unwrap_or_default()
        .split(',')
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect();
    Ok(NodeSeen {
        name: node.name.clone(),
        answers: true,
        primary,
        children,
    })
}

/// The node as pgherd manages it on this machine, if its entry has a data directory that
/// exists here.
fn managed(config: &Config, node: &NodeConfig) -> Result<Option<LocalNode>, String> {
    let Some(data_dir) = node.data_dir.as_deref().filter(|d| d.is_dir()) else {
        return Ok(None);
    };
    LocalNode::managed(
        &node.name,
        (&node.host, node.port),
        node.netns.as_deref(),
        data_dir,
        &config.cluster.user,
    )
    .map(Some)
    .map_err(|e| e.to_string())
}

/// Drops the removed node's slot (`pgherd_cluster::slot_name`) wherever one is held, waiting a
/// little for a sender that has not noticed the node stopped; the nodes it was dropped on.
async fn drop_slots(
    config: &Config,
    nodes: &[&NodeConfig],
    name: &str,
) -> Result<Vec<String>, String> {
    let slot = pgherd_cluster::slot_name(name);
    let mut dropped = Vec::new();
    for node in nodes {
        let mut conn = session_on(config, node).await?;
        match drop_slot_when_released(&mut conn, &slot, SLOT_RELEASE_WAIT).await {
            Ok(true) => dropped.push(node.name.clone()),
            Ok(false) => {}
            Err(SlotDrop::Failed(e)) => {
                return Err(format!("cannot drop {name}'s slot on {}: {e}", node.name))
            }
            Err(SlotDrop::StillActive { waited_s }) => {
                return Err(format!(
                    "{name}'s replication slot on {} is still in use after {waited_s} s: is {name} still running?",
                    node.name
                ))
            }
        }
    }
    Ok(dropped)
}

/// Takes the node's `[[nodes]]` entry out of the config file, the rest of its text (comments
/// included) kept; checks the result loads, and puts the file back as it was if not.
fn remove_from_config(path: &Path, name: &str) -> Result<(), String> {
    edit_nodes(path, &format!("without {name}"), |nodes| {
        let at = nodes
            .iter()
            .position(|n| n.get("name").and_then(toml_edit::Item::as_str) == Some(name))
            .ok_or_else(|| format!("{} has no [[nodes]] entry named {name}", path.display()))?;
        nodes.remove(at);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, answers: bool, primary: bool, children: &[&str]) -> NodeSeen {
        NodeSeen {
            name: name.into(),
            answers,
            primary,
            children: children.iter().map(|c| c.to_string()).collect(),
        }
    }

    #[test]
    fn a_replica_without_standbys_may_go() {
        let seen = [
            node("pg1", true, true, &["pg2", "pg3"]),
            node("pg2", true, false, &[]),
            node("pg3", true, false, &[]),
        ];
        assert_eq!(refusal("pg3", &seen), None);
        // A dead replica too, while the primary answers.
        let seen = [
            node("pg1", true, true, &["pg2"]),
            node("pg3", false, false, &[]),
        ];
        assert_eq!(refusal("pg3", &seen), None);
    }

    #[test]
    fn the_primary_an_upstream_and_a_silent_node_are_kept() {
        let seen = [
            node("pg1", true, true, &["pg2", "pg3"]),
            node("pg2", true, false, &["pg4", "pg5", "someone-else"]),
            node("pg3", false, false, &[]),
            node("pg4", true, false, &[]),
            node("pg5", true, false, &[]),
        ];
        assert_eq!(
            refusal("pg1", &seen).as_deref(),
            Some("it is the primary: switch over to another node first")
        );
        assert_eq!(
            refusal("pg2", &seen).as_deref(),
            Some("pg4, pg5 stream from it: remove them or clone them from another node first")
        );
        let seen = [
            node("pg1", false, false, &[]),
            node("pg2", true, false, &[]),
        ];
        assert_eq!(
            refusal("pg1", &seen).as_deref(),
            Some("it does not answer and no other node answers as the primary: it may be the primary")
        );
        assert_eq!(
            refusal("pg1", &[node("pg1", true, false, &[])]).as_deref(),
            Some("it is the cluster's only node")
        );
    }

    #[test]
    fn the_entry_leaves_the_config_and_the_rest_stays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pgherd.toml");
        let text = "# my cluster\n[pgherd]\nlisten = [\"127.0.0.1:6432\"]\n\n\
                    [[nodes]]\nname = \"pg1\"\nhost = \"127.0.0.1\"\nport = 5432\n\n\
                    # the clone\n[[nodes]]\nname = \"pg2\"\nhost = \"127.0.0.1\"\nport = 5433\n\n\
                    [[nodes]]\nname = \"pg3\"\nhost = \"127.0.0.1\"\nport = 5434\n";
        pgherd_config::write_private_file(&path, text).unwrap();
        remove_from_config(&path, "pg2").unwrap();
        let after = std::fs::read_to_string(&path).unwrap();
        assert!(after.starts_with("# my cluster\n"), "{after}");
        assert!(!after.contains("pg2"), "{after}");
        let config = Config::load(&path).unwrap();
        assert_eq!(config.node_names(), "pg1, pg3");
        assert!(remove_from_config(&path, "pg9")
            .unwrap_err()
            .contains("no [[nodes]] entry named pg9"));
    }
}
