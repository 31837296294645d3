//! `pgherd shard move` and `pgherd shard split`: a shard's rows go to other clusters while
//! clients keep writing, with the replication-set machinery (`shard_copy.rs`).
//!
//! A move: the shard's primary publishes every table of the database as the set
//! `shard<N>_move`, the new cluster subscribes (its schema copied first with `pg_dump
//! --schema-only` when it has no tables), its copy is compared with the shard's at one point,
//! and only then is it cut over under PAUSE.
//!
//! A split of the last shard at a key: two new clusters follow it, each through its own set
//! with a row filter per sharded table (`shard<N>_low`: keys below the cut, and every row of
//! the other tables; `shard<N>_high`: keys from the cut on, and the reference tables), each
//! compared with the rows of the shard it holds, and both cut over under one PAUSE: the lower
//! copy keeps the shard's number, the upper one becomes the next, and the config's layout
//! gains it. The old copy is not cut in place (its moved rows would be deleted while fan-outs
//! read them, or under a pause as long as the delete): it stays whole, refusing writes, until
//! its owner drops it.

use std::collections::BTreeMap;
use std::time::Duration;

use pgherd_config::{Config, NodeConfig};
use pgherd_replication::sets::RowFilters;
use pgherd_route::reshard::{plan_split, SplitAt, SplitPlan};

use crate::local::Where;
use crate::sets::primary_among;
use crate::shard_copy::{
    address_of, console, full_identity_where_needed, make_copy, CopyOrder, Handover, Successor,
};

#[derive(clap::Subcommand, Debug)]
pub enum ShardCommand {
    /// Move a shard to another cluster while clients write: its rows copied and streamed,
    /// compared, then cut over with new transactions held at pgherd for the moment it takes;
    /// the old copy is kept, refusing writes.
    Move {
        /// The shard to move (its number, as `shard = N` in the config).
        shard: u32,
        /// The cluster to move it to, as a libpq connection string (a superuser there, its
        /// database made; its tables are made from the shard's schema if it has none).
        #[arg(long)]
        to: String,
        /// The name of the shard's node in the config from then on.
        #[arg(long)]
        name: String,
        /// The database the shard's tables are in.
        #[arg(long)]
        database: String,
        /// How long the initial copy may take.
        #[arg(long, default_value_t = 600)]
        wait_s: u64,
        #[command(flatten)]
        at: Where,
    },
    /// Split the last shard of a range layout at a key while clients write: its rows below
    /// the key go to one new cluster (which keeps the shard's number), those from the key on
    /// to another (the next shard number), each copied, streamed and compared, then both cut
    /// over under one pause; the config gains the new shard. The old copy is kept whole,
    /// refusing writes.
    Split {
        /// The shard to split: the last one.
        shard: u32,
        /// Where to cut: `KEY` for every range-sharded table, or `TABLE=KEY` (repeatable);
        /// keys from it on go to the new shard.
        #[arg(long = "at", required = true)]
        cut: Vec<SplitAt>,
        /// The cluster for the keys below the cut (and every row of the other tables), as a
        /// libpq connection string.
        #[arg(long)]
        lower: String,
        /// Its node's name in the config.
        #[arg(long)]
        lower_name: String,
        /// The cluster for the keys from the cut on.
        #[arg(long)]
        upper: String,
        /// Its node's name in the config.
        #[arg(long)]
        upper_name: String,
        /// The database the shard's tables are in.
        #[arg(long)]
        database: String,
        /// How long each initial copy may take.
        #[arg(long, default_value_t = 600)]
        wait_s: u64,
        #[command(flatten)]
        at: Where,
    },
}

pub fn run(command: ShardCommand) -> Result<(), String> {
    let runtime = crate::runtime(1)?;
    match command {
        ShardCommand::Move {
            shard,
            to,
            name,
            database,
            wait_s,
            at,
        } => {
            let moving = Move {
                shard,
                to,
                name,
                database,
                wait: Duration::from_secs(wait_s),
                at,
            };
            runtime.block_on(moving.run())
        }
        ShardCommand::Split {
            shard,
            cut,
            lower,
            lower_name,
            upper,
            upper_name,
            database,
            wait_s,
            at,
        } => {
            let split = Split {
                shard,
                cut,
                lower: (lower, lower_name),
                upper: (upper, upper_name),
                database,
                wait: Duration::from_secs(wait_s),
                at,
            };
            runtime.block_on(split.run())
        }
    }
}

struct Move {
    shard: u32,
    to: String,
    name: String,
    database: String,
    wait: Duration,
    at: Where,
}

impl Move {
    async fn run(&self) -> Result<(), String> {
        let config = Config::load(&self.at.config_path()?).map_err(|e| e.to_string())?;
        let nodes = shard_nodes(&config, self.shard, &[&self.name])?;
        let address = address_of(&self.to).map_err(|e| format!("--to: {e}"))?;
        // The cut-over needs the running pgherd: asked before anything is made.
        let console = console(&config).await?;
        let (origin, mut conn) = shard_primary(&config, self.shard, &nodes, &self.database).await?;
        full_identity_where_needed(&mut conn, &origin.name, &BTreeMap::new()).await?;
        let order = CopyOrder {
            set: format!("shard{}_move", self.shard),
            to: &self.to,
            database: &self.database,
            wait: self.wait,
            at: &self.at,
            row_filters: RowFilters::new(),
        };
        let copy = make_copy(&config, (&origin, &mut conn), order).await?;
        let shown = copy.shown.clone();
        let successors = [Successor {
            copy,
            shard: self.shard,
            name: self.name.clone(),
            address,
        }];
        let handover = Handover {
            shard: self.shard,
            origin: &origin,
            database: &self.database,
            successors: &successors,
            split: None,
        };
        let held_ms = handover.run(&config, &console).await?;
        let old: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
        println!(
            "shard {} moved to {} ({shown}): new transactions were held {held_ms} ms; {} left the config; the old copy on {} refuses writes (25006) and is kept until you drop it",
            self.shard,
            self.name,
            old.join(", "),
            origin.name
        );
        Ok(())
    }
}

struct Split {
    shard: u32,
    cut: Vec<SplitAt>,
    /// Connection string and node name of each side.
    lower: (String, String),
    upper: (String, String),
    database: String,
    wait: Duration,
    at: Where,
}

impl Split {
    async fn run(&self) -> Result<(), String> {
        let config = Config::load(&self.at.config_path()?).map_err(|e| e.to_string())?;
        let sharding = config
            .sharding
            .as_ref()
            .ok_or("the config has no [sharding] section: there are no shards to split")?;
        let plan = plan_split(&sharding.map, self.shard, &self.cut)
            .map_err(|e| format!("shard {} cannot split: {e}", self.shard))?;
        if self.lower.1 == self.upper.1 {
            return Err("--lower-name and --upper-name must differ".to_owned());
        }
        let nodes = shard_nodes(&config, self.shard, &[&self.lower.1, &self.upper.1])?;
        let lower_address = address_of(&self.lower.0).map_err(|e| format!("--lower: {e}"))?;
        let upper_address = address_of(&self.upper.0).map_err(|e| format!("--upper: {e}"))?;
        let console = console(&config).await?;
        let (origin, mut conn) = shard_primary(&config, self.shard, &nodes, &self.database).await?;
        // A list table's filters name no column (all rows, or none).
        let filter_columns: BTreeMap<String, String> = plan
            .tables
            .iter()
            .filter(|t| t.at.is_some())
            .map(|t| (qualified(&t.table), t.column.clone()))
            .collect();
        full_identity_where_needed(&mut conn, &origin.name, &filter_columns).await?;
        let (kept, moved) = row_filters(&plan);
        let lower = self.copy_to(&config, (&origin, &mut conn), "low", &self.lower.0, kept);
        let lower = lower.await?;
        let upper = self.copy_to(&config, (&origin, &mut conn), "high", &self.upper.0, moved);
        let upper = upper.await?;
        let shown = [lower.shown.clone(), upper.shown.clone()];
        let successors = [
            Successor {
                copy: lower,
                shard: self.shard,
                name: self.lower.1.clone(),
                address: lower_address,
            },
            Successor {
                copy: upper,
                shard: plan.new_shard,
                name: self.upper.1.clone(),
                address: upper_address,
            },
        ];
        let handover = Handover {
            shard: self.shard,
            origin: &origin,
            database: &self.database,
            successors: &successors,
            split: Some(&plan),
        };
        let held_ms = handover.run(&config, &console).await?;
        println!(
            "shard {} split at {}: shard {} is {} ({}), shard {} is {} ({}); new transactions were held {held_ms} ms; the old copy on {} refuses writes (25006) and is kept until you drop it",
            self.shard,
            describe_cut(&plan),
            self.shard,
            self.lower.1,
            shown[0],
            plan.new_shard,
            self.upper.1,
            shown[1],
            origin.name
        );
        Ok(())
    }

    async fn copy_to(
        &self,
        config: &Config,
        origin: (&NodeConfig, &mut pgherd_proxy::server::ServerConn),
        side: &str,
        to: &str,
        row_filters: RowFilters,
    ) -> Result<crate::shard_copy::Copy, String> {
        let order = CopyOrder {
            set: format!("shard{}_{side}", self.shard),
            to,
            database: &self.database,
            wait: self.wait,
            at: &self.at,
            row_filters,
        };
        make_copy(config, origin, order).await
    }
}

/// The row filters of the split's two copies: (kept below the cut, moved from it on), by
/// `schema.table`.
fn row_filters(plan: &SplitPlan) -> (RowFilters, RowFilters) {
    let kept = plan
        .tables
        .iter()
        .filter_map(|t| Some((qualified(&t.table), t.kept_filter()?)))
        .collect();
    let moved = plan
        .tables
        .iter()
        .map(|t| (qualified(&t.table), t.moved_filter()))
        .collect();
    (kept, moved)
}

/// A config table name as the catalog's `schema.table` (`accounts` is `public.accounts`).
fn qualified(table: &str) -> String {
    match table.contains('.') {
        true => table.to_owned(),
        false => format!("public.{table}"),
    }
}

fn describe_cut(plan: &SplitPlan) -> String {
    plan.tables
        .iter()
        .filter_map(|t| Some(format!("{}.{} = {}", t.table, t.column, t.at?)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The shard's nodes; refused if a new node's name is taken.
fn shard_nodes(config: &Config, shard: u32, new_names: &[&str]) -> Result<Vec<NodeConfig>, String> {
    let sharding = config
        .sharding
        .as_ref()
        .ok_or("the config has no [sharding] section: there are no shards")?;
    let nodes = sharding.shard_nodes.get(shard as usize).ok_or_else(|| {
        format!(
            "no shard {shard} (the config has {})",
            sharding.shard_nodes.len()
        )
    })?;
    if let Some(taken) = new_names
        .iter()
        .find(|name| config.node_of_any_shard(name).is_some())
    {
        return Err(format!(
            "a node named {taken} is in the config already: name the new one otherwise"
        ));
    }
    Ok(nodes.clone())
}

async fn shard_primary(
    config: &Config,
    shard: u32,
    nodes: &[NodeConfig],
    database: &str,
) -> Result<(NodeConfig, pgherd_proxy::server::ServerConn), String> {
    primary_among(config, nodes, database)
        .await
        .map_err(|silent| format!("shard {shard}: no node answers as the primary{silent}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgherd_route::reshard::TableSplit;

    #[test]
    fn each_side_of_a_split_gets_its_rows_filter() {
        let plan = SplitPlan {
            shard: 1,
            new_shard: 2,
            tables: vec![
                TableSplit {
                    table: "accounts".into(),
                    column: "id".into(),
                    at: Some(1500),
                },
                TableSplit {
                    table: "crm.regions".into(),
                    column: "id".into(),
                    at: None,
                },
            ],
        };
        let (kept, moved) = row_filters(&plan);
        assert_eq!(
            kept.into_iter().collect::<Vec<_>>(),
            vec![(
                "public.accounts".to_owned(),
                "(\"id\" < 1500 OR \"id\" IS NULL)".to_owned()
            )]
        );
        assert_eq!(moved["crm.regions"], "(false)");
        assert_eq!(moved["public.accounts"], "(\"id\" >= 1500)");
        assert_eq!(describe_cut(&plan), "accounts.id = 1500");
    }
}
