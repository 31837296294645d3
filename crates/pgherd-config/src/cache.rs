//! `[cache]`: the result cache. Off for every statement unless asked for: by a
//! `/* pgherd:cache */` hint (honoured unless `enabled = false`), or for every cacheable read of
//! the databases, users or statement patterns named here.

use serde::Deserialize;

use crate::validate::{field_path, Checker, Seg};
use crate::ConfigError;

#[derive(Debug, Clone)]
pub struct CacheSettings {
    /// False: nothing is cached, hints included.
    pub enabled: bool,
    /// Databases (as clients name them) whose every cacheable read is cached.
    pub databases: Vec<String>,
    /// Users whose every cacheable read is cached.
    pub users: Vec<String>,
    /// Statements cached without a hint: their text matches one of these.
    pub statements: Vec<regex::Regex>,
    /// Bytes one database's entries may take (keys, answers and bookkeeping); the least
    /// recently used go first.
    pub max_bytes: u64,
    /// Answers larger than this are not kept.
    pub max_entry_bytes: u64,
    /// Entries older than this are not served, whatever the stream says (a second guard).
    /// 0: no limit.
    pub ttl_ms: u64,
    /// The cache does not serve while its invalidation stream is further behind the
    /// primary's WAL than this...
    pub max_lag_bytes: u64,
    /// ... or has not been heard from for this long.
    pub max_silence_ms: u64,
}

impl CacheSettings {
    /// Whether every cacheable read of this database and user, or this statement, is
    /// cached without a hint.
    pub fn asked_for(&self, database: &str, user: &str) -> bool {
        self.enabled
            && (self.databases.iter().any(|d| d == database)
                || self.users.iter().any(|u| u == user))
    }

    pub fn statement_asked_for(&self, sql: &str) -> bool {
        self.enabled && self.statements.iter().any(|p| p.is_match(sql))
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCache {
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default)]
    pub databases: Vec<String>,
    #[serde(default)]
    pub users: Vec<String>,
    #[serde(default)]
    pub statements: Vec<String>,
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
    #[serde(default = "default_max_entry_bytes")]
    pub max_entry_bytes: u64,
    #[serde(default = "default_ttl_ms")]
    pub ttl_ms: u64,
    #[serde(default = "default_max_lag_bytes")]
    pub max_lag_bytes: u64,
    #[serde(default = "default_max_silence_ms")]
    pub max_silence_ms: u64,
}

impl Default for RawCache {
    fn default() -> Self {
        RawCache {
            enabled: true,
            databases: Vec::new(),
            users: Vec::new(),
            statements: Vec::new(),
            max_bytes: default_max_bytes(),
            max_entry_bytes: default_max_entry_bytes(),
            ttl_ms: default_ttl_ms(),
            max_lag_bytes: default_max_lag_bytes(),
            max_silence_ms: default_max_silence_ms(),
        }
    }
}

fn yes() -> bool {
    true
}
fn default_max_bytes() -> u64 {
    64 << 20
}
fn default_max_entry_bytes() -> u64 {
    1 << 20
}
fn default_ttl_ms() -> u64 {
    300_000
}
fn default_max_lag_bytes() -> u64 {
    16 << 20
}
fn default_max_silence_ms() -> u64 {
    3_000
}

/// The stream is asked for a reply every half second: a silence limit below this would turn
/// the cache off between replies.
const MIN_SILENCE_MS: u64 = 1_000;

pub(crate) fn cache(c: &Checker<'_>, raw: &RawCache) -> Result<CacheSettings, ConfigError> {
    let mut statements = Vec::new();
    for (i, pattern) in raw.statements.iter().enumerate() {
        let compiled = regex::Regex::new(pattern).map_err(|e| {
            // The library's message draws the pattern over several lines; its last says why.
            let text = e.to_string();
            let why = text.lines().last().unwrap_or_default();
            let why = why.strip_prefix("error: ").unwrap_or(why);
            c.error(
                &field_path!["cache", "statements", i],
                format!("is not a regular expression: {why}"),
            )
        })?;
        statements.push(compiled);
    }
    if raw.max_bytes == 0 {
        return Err(c.error(
            &field_path!["cache", "max_bytes"],
            "must be more than 0 (to turn the cache off, set enabled = false)",
        ));
    }
    if raw.max_entry_bytes == 0 || raw.max_entry_bytes > raw.max_bytes {
        return Err(c.error(
            &field_path!["cache", "max_entry_bytes"],
            format!(
                "must be between 1 and max_bytes ({}), got {}",
                raw.max_bytes, raw.max_entry_bytes
            ),
        ));
    }
    if raw.max_silence_ms < MIN_SILENCE_MS {
        return Err(c.error(
            &field_path!["cache", "max_silence_ms"],
            format!(
                "must be at least {MIN_SILENCE_MS} (the stream is asked for a reply every 500 ms)"
            ),
        ));
    }
    Ok(CacheSettings {
        enabled: raw.enabled,
        databases: raw.databases.clone(),
        users: raw.users.clone(),
        statements,
        max_bytes: raw.max_bytes,
        max_entry_bytes: raw.max_entry_bytes,
        ttl_ms: raw.ttl_ms,
        max_lag_bytes: raw.max_lag_bytes,
        max_silence_ms: raw.max_silence_ms,
    })
}
