//! `[sets]`: the databases whose replication sets (`pgherd set`) the running pgherd follows on
//! the primary, for `SHOW SETS`, `/api/sets` and the metrics.

use serde::Deserialize;

use crate::validate::{field_path, Checker, Seg};
use crate::ConfigError;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetsSettings {
    /// Databases (as the servers name them) whose sets are followed; none: no set is.
    pub databases: Vec<String>,
    /// How often the sets' state is read from the primary.
    pub poll_ms: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSets {
    #[serde(default)]
    pub databases: Vec<String>,
    #[serde(default = "default_poll_ms")]
    pub poll_ms: u64,
}

impl Default for RawSets {
    fn default() -> Self {
        RawSets {
            databases: Vec::new(),
            poll_ms: default_poll_ms(),
        }
    }
}

fn default_poll_ms() -> u64 {
    5_000
}

pub(crate) fn sets(c: &Checker<'_>, raw: &RawSets) -> Result<SetsSettings, ConfigError> {
    if raw.poll_ms < 100 {
        return Err(c.error(
            &field_path!["sets", "poll_ms"],
            format!("must be at least 100, got {}", raw.poll_ms),
        ));
    }
    if let Some(i) = raw.databases.iter().position(String::is_empty) {
        return Err(c.error(&field_path!["sets", "databases", i], "must name a database"));
    }
    Ok(SetsSettings {
        databases: raw.databases.clone(),
        poll_ms: raw.poll_ms,
    })
}
