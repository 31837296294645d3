//! A shard split, decided without IO: which keys of each sharded table leave the split shard,
//! the row filters that tell its two successors' copies apart, and the layout after it.
//!
//! Only the last shard splits: range starts ascend with the shard number, so its upper part
//! becomes the next shard number and no other shard is renumbered (sessions, recovery and
//! the two-phase decisions know shards by number). A hash-sharded table cannot follow: a new
//! modulus would place nearly every row anew.

use crate::shard_hash::{self, KeyType};
use crate::shard_plan::{Method, ShardMap};

/// Where a split cuts, as given on the command line: one key for every range table, or one
/// table's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SplitAt {
    /// `KEY`: every range-sharded table is cut at this key.
    Every(i64),
    /// `TABLE=KEY`: the table (named as in the config) is cut at this key.
    Table(String, i64),
}

impl std::str::FromStr for SplitAt {
    type Err = String;

    fn from_str(text: &str) -> Result<SplitAt, String> {
        let key = |k: &str| {
            k.trim()
                .parse::<i64>()
                .map_err(|_| format!("{k:?} is not an integer key"))
        };
        match text.split_once('=') {
            Some((table, k)) => Ok(SplitAt::Table(table.trim().to_owned(), key(k)?)),
            None => Ok(SplitAt::Every(key(text)?)),
        }
    }
}

/// What becomes of one sharded table's rows of the split shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSplit {
    /// As named in the config.
    pub table: String,
    pub column: String,
    /// `Some(key)`: range-sharded, keys from `key` up go to the new shard. `None`:
    /// list-sharded, every row stays (the new shard lists no key).
    pub at: Option<i64>,
}

impl TableSplit {
    /// The rows the split shard keeps, as a publication's row filter (`None`: all). A row
    /// without a key stays, as it was: the planner never places one, so it is not lost.
    pub fn kept_filter(&self) -> Option<String> {
        self.at
            .map(|at| format!("(\"{0}\" < {at} OR \"{0}\" IS NULL)", self.column))
    }

    /// The rows the new shard takes, as a publication's row filter.
    pub fn moved_filter(&self) -> String {
        match self.at {
            Some(at) => format!("(\"{}\" >= {at})", self.column),
            None => "(false)".to_owned(),
        }
    }
}

/// A split of the last shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitPlan {
    /// The shard that splits (the last one).
    pub shard: u32,
    /// The shard its upper part becomes.
    pub new_shard: u32,
    pub tables: Vec<TableSplit>,
}

/// Why a split cannot be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error("no shard {shard} (there are {shards})")]
    NoShard { shard: u32, shards: u32 },
    #[error("only the last shard ({last}) can split: its upper part becomes shard {next}, and no other shard is renumbered")]
    NotLast { last: u32, next: u32 },
    #[error("{0} is sharded by hash: a split would change the modulus, which places nearly every row anew")]
    Hash(String),
    #[error("no table is sharded by range: nothing to cut")]
    NoRange,
    #[error("{0} is sharded by range and needs a key to cut at (--at KEY or --at {0}=KEY)")]
    NoKey(String),
    #[error("{0} is given a key to cut at twice")]
    Twice(String),
    #[error("--at names {0}, which is not a range-sharded table of the config")]
    NotRangeTable(String),
    #[error("{table}: the cut at {at} must lie above the shard's first key, {start}")]
    BelowStart { table: String, at: i64, start: i64 },
    #[error("{table}: {at} is not a key of its type: {why}")]
    BadKey { table: String, at: i64, why: String },
}

/// Checks a split of `shard` at `at` against the layout and says what each table does.
pub fn plan_split(map: &ShardMap, shard: u32, at: &[SplitAt]) -> Result<SplitPlan, SplitError> {
    if shard >= map.shards {
        return Err(SplitError::NoShard {
            shard,
            shards: map.shards,
        });
    }
    if shard + 1 != map.shards {
        return Err(SplitError::NotLast {
            last: map.shards - 1,
            next: map.shards,
        });
    }
    for given in at {
        if let SplitAt::Table(name, _) = given {
            let range = map
                .tables
                .get(name)
                .is_some_and(|t| matches!(t.method, Method::Range { .. }));
            if !range {
                return Err(SplitError::NotRangeTable(name.clone()));
            }
        }
    }
    let mut tables = Vec::new();
    for (name, table) in &map.tables {
        let split_at = match &table.method {
            Method::Hash => return Err(SplitError::Hash(name.clone())),
            Method::List { .. } => None,
            Method::Range { starts } => {
                let key = key_for(name, at)?;
                check_key(name, table.key_type, key, starts[shard as usize])?;
                Some(key)
            }
        };
        tables.push(TableSplit {
            table: name.clone(),
            column: table.key_column.clone(),
            at: split_at,
        });
    }
    if tables.iter().all(|t| t.at.is_none()) {
        return Err(SplitError::NoRange);
    }
    Ok(SplitPlan {
        shard,
        new_shard: map.shards,
        tables,
    })
}

/// The key `table` is cut at: its own, else the one for every table.
fn key_for(table: &str, at: &[SplitAt]) -> Result<i64, SplitError> {
    let own: Vec<i64> = at
        .iter()
        .filter_map(|a| match a {
            SplitAt::Table(name, key) if name == table => Some(*key),
            _ => None,
        })
        .collect();
    let every: Vec<i64> = at
        .iter()
        .filter_map(|a| match a {
            SplitAt::Every(key) => Some(*key),
            _ => None,
        })
        .collect();
    match (own.as_slice(), every.as_slice()) {
        ([key], _) => Ok(*key),
        ([], [key]) => Ok(*key),
        ([], []) => Err(SplitError::NoKey(table.to_owned())),
        _ => Err(SplitError::Twice(table.to_owned())),
    }
}

fn check_key(table: &str, key_type: KeyType, at: i64, start: i64) -> Result<(), SplitError> {
    shard_hash::parse_int(key_type, &at.to_string()).map_err(|e| SplitError::BadKey {
        table: table.to_owned(),
        at,
        why: e.to_string(),
    })?;
    if at <= start {
        return Err(SplitError::BelowStart {
            table: table.to_owned(),
            at,
            start,
        });
    }
    Ok(())
}

/// The layout after the split: one shard more, each range table starting the new shard at
/// its cut, each list table listing no key for it.
pub fn split_map(map: &ShardMap, plan: &SplitPlan) -> ShardMap {
    let mut after = map.clone();
    after.shards = plan.new_shard + 1;
    for split in &plan.tables {
        let Some(table) = after.tables.get_mut(&split.table) else {
            continue;
        };
        match (&mut table.method, split.at) {
            (Method::Range { starts }, Some(at)) => starts.push(at),
            (Method::List { values }, _) => values.push(Vec::new()),
            _ => {}
        }
    }
    after
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard_plan::ShardedTable;

    fn map(tables: &[(&str, Method)], shards: u32) -> ShardMap {
        ShardMap {
            shards,
            tables: tables
                .iter()
                .map(|(name, method)| {
                    (
                        (*name).to_owned(),
                        ShardedTable {
                            key_column: "id".into(),
                            key_type: KeyType::Int4,
                            method: method.clone(),
                            key_ordinal: None,
                        },
                    )
                })
                .collect(),
        }
    }

    fn range(starts: &[i64]) -> Method {
        Method::Range {
            starts: starts.to_vec(),
        }
    }

    #[test]
    fn the_last_range_shard_splits_at_a_key_inside_it() {
        let before = map(
            &[
                ("accounts", range(&[0, 1000])),
                (
                    "regions",
                    Method::List {
                        values: vec![vec!["1".into()], vec!["2".into()]],
                    },
                ),
            ],
            2,
        );
        let plan = plan_split(&before, 1, &[SplitAt::Every(1500)]).unwrap();
        assert_eq!(plan.new_shard, 2);
        let accounts = &plan.tables[0];
        assert_eq!(
            accounts.kept_filter().as_deref(),
            Some("(\"id\" < 1500 OR \"id\" IS NULL)")
        );
        assert_eq!(accounts.moved_filter(), "(\"id\" >= 1500)");
        assert_eq!(plan.tables[1].kept_filter(), None);
        assert_eq!(plan.tables[1].moved_filter(), "(false)");
        let after = split_map(&before, &plan);
        assert_eq!(after.shards, 3);
        assert_eq!(after.tables["accounts"].method, range(&[0, 1000, 1500]));
        // Keys keep their shard below the cut and take the new one from it.
        let accounts = &after.tables["accounts"];
        assert_eq!(accounts.shard_of(3, "1499"), Ok(Some(1)));
        assert_eq!(accounts.shard_of(3, "1500"), Ok(Some(2)));
        assert_eq!(after.tables["regions"].shard_of(3, "2"), Ok(Some(1)));
    }

    #[test]
    fn a_split_is_refused_where_rows_would_move_otherwise() {
        let two = map(&[("accounts", range(&[0, 1000]))], 2);
        assert_eq!(
            plan_split(&two, 0, &[SplitAt::Every(500)]),
            Err(SplitError::NotLast { last: 1, next: 2 })
        );
        assert_eq!(
            plan_split(&two, 2, &[SplitAt::Every(500)]),
            Err(SplitError::NoShard {
                shard: 2,
                shards: 2
            })
        );
        assert!(matches!(
            plan_split(&two, 1, &[SplitAt::Every(1000)]),
            Err(SplitError::BelowStart { .. })
        ));
        assert_eq!(
            plan_split(&two, 1, &[]),
            Err(SplitError::NoKey("accounts".into()))
        );
        assert_eq!(
            plan_split(&two, 1, &[SplitAt::Table("orders".into(), 5)]),
            Err(SplitError::NotRangeTable("orders".into()))
        );
        assert!(matches!(
            plan_split(&two, 1, &[SplitAt::Every(5_000_000_000)]),
            Err(SplitError::BadKey { .. })
        ));
        assert_eq!(
            plan_split(
                &two,
                1,
                &[
                    SplitAt::Table("accounts".into(), 2000),
                    SplitAt::Table("accounts".into(), 3000)
                ]
            ),
            Err(SplitError::Twice("accounts".into()))
        );
        // A table's own key wins over the one for every table.
        let own = plan_split(
            &two,
            1,
            &[
                SplitAt::Every(2000),
                SplitAt::Table("accounts".into(), 3000),
            ],
        )
        .unwrap();
        assert_eq!(own.tables[0].at, Some(3000));
        let hashed = map(
            &[("accounts", range(&[0, 1000])), ("orders", Method::Hash)],
            2,
        );
        assert_eq!(
            plan_split(&hashed, 1, &[SplitAt::Every(1500)]),
            Err(SplitError::Hash("orders".into()))
        );
        let listed = map(
            &[(
                "regions",
                Method::List {
                    values: vec![vec![], vec![]],
                },
            )],
            2,
        );
        assert_eq!(
            plan_split(&listed, 1, &[SplitAt::Every(1)]),
            Err(SplitError::NoRange)
        );
    }

    #[test]
    fn a_cut_reads_as_a_key_or_a_tables_key() {
        assert_eq!("1500".parse(), Ok(SplitAt::Every(1500)));
        assert_eq!(
            "accounts=-7".parse(),
            Ok(SplitAt::Table("accounts".into(), -7))
        );
        assert!("accounts=x".parse::<SplitAt>().is_err());
    }
}
