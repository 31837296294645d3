//! A client's session settings, so they can follow it from one server connection to the next
//! and never leak to another client.
//!
//! A client's settings are its startup parameters plus what it changed since: reported
//! parameters (TimeZone, DateStyle, application_name...) as the server reports them, and other
//! `SET`s as the statements that made them. Each set has a fingerprint; a server connection
//! remembers the fingerprint of the settings it carries. When a client gets a server whose
//! fingerprint differs, pgherd first resets the server and replays the client's settings, so
//! the server is exactly the client's session. The fingerprint of a fresh server is
//! [`BASELINE`]; one that ran something pgherd could not follow is [`UNKNOWN`] and is always
//! reset.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use pg_query::protobuf::{node::Node as NodeEnum, VariableSetKind};

mod interner;
pub use interner::Interner;

/// Fingerprint of a server connection that carries no settings beyond its startup packet.
pub const BASELINE: u64 = 0;
/// Fingerprint of a server connection whose settings pgherd does not know.
pub const UNKNOWN: u64 = u64::MAX;

/// Returns a server connection to its baseline, whatever the previous client set. `RESET ALL`
/// leaves the role alone, hence the first statement.
pub const RESET_SQL: &str = "SET SESSION AUTHORIZATION DEFAULT; RESET ALL";

/// What a client's transactions may leave on a server connection that its settings do not
/// cover, to clear before another client's transaction runs there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Residue {
    /// `currval`/`lastval` of sequences drawn from: `DISCARD SEQUENCES`.
    pub sequences: bool,
    /// The random seed (`setseed`), which nothing resets: a fresh one.
    pub seed: bool,
}

impl Residue {
    pub fn is_clear(&self) -> bool {
        !self.sequences && !self.seed
    }

    /// The statements that clear it; `fresh_seed` gives the new random seed, in [-1, 1]. It
    /// is asked only when the seed was set: every lease passes here, and a random draw costs
    /// more than the rest of the check.
    pub fn clear_sql(&self, fresh_seed: impl FnOnce() -> f64) -> Option<String> {
        let mut parts = Vec::new();
        if self.sequences {
            parts.push("DISCARD SEQUENCES".to_owned());
        }
        if self.seed {
            parts.push(format!("SELECT pg_catalog.setseed({:.17})", fresh_seed()));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// A random seed for [`Residue::clear_sql`], in [-1, 1] as `setseed` takes it.
pub fn fresh_seed() -> f64 {
    rand::random::<f64>() * 2.0 - 1.0
}

/// Startup parameters that are not session settings.
const NOT_SETTINGS: &[&str] = &["user", "database", "replication", "options"];

/// Settings that only exist inside a transaction and must not be replayed.
const TRANSACTION_SCOPED: &[&str] = &[
    "transaction",
    "transaction snapshot",
    "transaction_isolation",
    "transaction_read_only",
    "transaction_deferrable",
];

/// Name → statement pairs sorted by name. A client has a handful at most, and a B-tree's
/// first node alone would cost an idle client half a kilobyte.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Settings(Vec<(String, String)>);

impl Settings {
    /// From pairs in any order (the last of a name wins).
    fn sorted(pairs: Vec<(String, String)>) -> Settings {
        let mut settings = Settings::default();
        for (name, sql) in pairs {
            settings.insert(name, sql);
        }
        settings
    }

    fn get(&self, name: &str) -> Option<&String> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }

    fn insert(&mut self, name: String, sql: String) {
        match self.0.binary_search_by(|(k, _)| k.as_str().cmp(&name)) {
            Ok(i) => self.0[i].1 = sql,
            Err(i) => self.0.insert(i, (name, sql)),
        }
    }

    fn remove(&mut self, name: &str) {
        self.0.retain(|(k, _)| k != name);
    }

    fn clear(&mut self) {
        self.0.clear();
    }

    fn values(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(_, v)| v)
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A change to session state made by a client statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Replay `sql` to restore setting `name`.
    Set {
        name: String,
        sql: String,
    },
    Reset {
        name: String,
    },
    ResetAll,
}

/// Settings routing must know before any server reports them: from the startup packet, then
/// from what servers report (both are GUC_REPORT parameters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartupFlags {
    pub standard_conforming_strings: bool,
    pub default_transaction_read_only: bool,
}

impl Default for StartupFlags {
    fn default() -> Self {
        StartupFlags {
            standard_conforming_strings: true,
            default_transaction_read_only: false,
        }
    }
}

/// The settings a client asked for in its startup packet (`options=-c a=b` included), and
/// routing's view of two of them.
fn startup_settings(params: &[(String, String)]) -> (Settings, StartupFlags) {
    let mut startup = Settings::default();
    let mut flags = StartupFlags::default();
    let mut note = |name: &str, value: &str| match name.to_lowercase().as_str() {
        "standard_conforming_strings" => {
            flags.standard_conforming_strings =
                parse_bool(value).unwrap_or(flags.standard_conforming_strings)
        }
        "default_transaction_read_only" => {
            flags.default_transaction_read_only =
                parse_bool(value).unwrap_or(flags.default_transaction_read_only)
        }
        _ => {}
    };
    for (name, value) in params {
        if name == "options" {
            for (n, v) in parse_options(value) {
                note(&n, &v);
                startup.insert(n.to_lowercase(), set_sql(&n, &v));
            }
        } else if !NOT_SETTINGS.contains(&name.as_str()) && !name.starts_with("_pq_.") {
            note(name, value);
            startup.insert(name.to_lowercase(), set_sql(name, value));
        }
    }
    (startup, flags)
}

/// A boolean setting's value as PostgreSQL reads one (`on`, `true`, `yes`, `1`, prefixes).
pub fn parse_bool(value: &str) -> Option<bool> {
    let v = value.trim().to_ascii_lowercase();
    match v.as_str() {
        "on" | "true" | "yes" | "1" | "t" | "y" | "tr" | "tru" | "ye" => Some(true),
        "off" | "false" | "no" | "0" | "f" | "n" | "of" | "fa" | "fal" | "fals" => Some(false),
        _ => None,
    }
}

#[derive(Debug, Clone, Default)]
pub struct SessionParams {
    /// Routing's view of two settings at login.
    pub flags: StartupFlags,
    /// Lower-case setting name → the statement that restores it, from the startup packet.
    /// `RESET` goes back to these, as in PostgreSQL.
    /// Shared between clients that sent the same startup parameters (see [`Interner`]).
    startup: Arc<Settings>,
    /// Lower-case setting name → the statement that restores it, for changes made since.
    entries: Settings,
    fingerprint: u64,
    /// Changes made inside the current transaction; they count once it commits.
    pending: Vec<Change>,
}

impl SessionParams {
    /// The settings a client asked for in its startup packet (`options=-c a=b` included).
    pub fn from_startup(params: &[(String, String)], interner: &Interner) -> Self {
        let (startup, flags) = interner.settings_for_startup(params, startup_settings);
        let mut s = SessionParams {
            startup,
            flags,
            ..Default::default()
        };
        s.refresh_fingerprint();
        s
    }

    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// No transaction's changes are pending.
    pub fn is_settled(&self) -> bool {
        self.pending.is_empty()
    }

    /// The settings as plain pairs, for a session moving to a new pgherd process; `None`
    /// while a transaction's changes are pending.
    pub fn to_record(&self) -> Option<crate::handover::SettingsRecord> {
        self.pending
            .is_empty()
            .then(|| crate::handover::SettingsRecord {
                standard_conforming_strings: self.flags.standard_conforming_strings,
                default_transaction_read_only: self.flags.default_transaction_read_only,
                startup: self.startup.0.clone(),
                entries: self.entries.0.clone(),
            })
    }

    /// A moved session's settings, as [`Self::to_record`] gave them.
    pub fn from_record(record: crate::handover::SettingsRecord, interner: &Interner) -> Self {
        let mut s = SessionParams {
            flags: StartupFlags {
                standard_conforming_strings: record.standard_conforming_strings,
                default_transaction_read_only: record.default_transaction_read_only,
            },
            startup: interner.intern(Settings::sorted(record.startup)),
            entries: Settings::sorted(record.entries),
            ..Default::default()
        };
        s.refresh_fingerprint();
        s
    }

    /// The statements that apply these settings on a server at its baseline (see
    /// [`RESET_SQL`]), or `None` if there are none.
    pub fn apply_sql(&self) -> Option<String> {
        let statements: Vec<&str> = self
            .startup
            .values()
            .chain(self.entries.values())
            .map(String::as_str)
            .collect();
        (!statements.is_empty()).then(|| statements.join("; "))
    }

    /// The session's settings as a probe found them on the server after statements pgherd
    /// could not follow: they replace what was recorded, at once (the transaction is over).
    pub fn adopt(&mut self, changes: Vec<Change>) {
        self.apply(changes);
    }

    /// A reported parameter changed while the client's request ran.
    pub fn record_reported(&mut self, name: &str, value: &str) {
        let key = name.to_lowercase();
        let sql = set_sql(name, value);
        let current = self.entries.get(&key).or(self.startup.get(&key));
        if current != Some(&sql) {
            self.entries.insert(key, sql);
            self.refresh_fingerprint();
        }
    }

    /// Records statement changes. They count once the transaction they ran in (explicit or
    /// the implicit one of a single query) commits: see [`Self::end_transaction`].
    pub fn record(&mut self, changes: Vec<Change>) {
        self.pending.extend(changes);
    }

    /// How many changes the current transaction made so far (a savepoint's mark).
    pub fn changes_made(&self) -> usize {
        self.pending.len()
    }

    /// `ROLLBACK TO SAVEPOINT`: the changes made since the savepoint (`made` changes in) are
    /// undone, as the server undoes them.
    pub fn undo_changes_after(&mut self, made: usize) {
        self.pending.truncate(made);
    }

    /// The client's transaction ended; keep its changes only if it committed.
    pub fn end_transaction(&mut self, committed: bool) {
        // Most transactions set nothing: no list to take apart.
        if self.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        if committed {
            self.apply(pending);
        }
    }

    fn apply(&mut self, changes: Vec<Change>) {
        if changes.is_empty() {
            return;
        }
        for change in changes {
            match change {
                Change::Set { name, sql } => {
                    self.entries.insert(name, sql);
                }
                Change::Reset { name } => {
                    self.entries.remove(&name);
                }
                Change::ResetAll => self.entries.clear(),
            }
        }
        self.refresh_fingerprint();
    }

    fn refresh_fingerprint(&mut self) {
        if self.startup.is_empty() && self.entries.is_empty() {
            self.fingerprint = BASELINE;
            return;
        }
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.startup.hash(&mut hasher);
        self.entries.hash(&mut hasher);
        // Keep clear of the two reserved values.
        self.fingerprint = hasher.finish().clamp(1, UNKNOWN - 1);
    }

    /// The statement that gives setting `name` (lower case) its value now: the current
    /// transaction's last change of it, else the session's, else the startup packet's (which
    /// `RESET` goes back to). `None`: the server's default.
    pub fn current(&self, name: &str) -> Option<&str> {
        for change in self.pending.iter().rev() {
            match change {
                Change::Set { name: set, sql } if set == name => return Some(sql),
                Change::Reset { name: reset } if reset == name => {
                    return self.startup.get(name).map(String::as_str)
                }
                Change::ResetAll => return self.startup.get(name).map(String::as_str),
                _ => {}
            }
        }
        self.entries
            .get(name)
            .or_else(|| self.startup.get(name))
            .map(String::as_str)
    }

    /// Writes the session's settings, as far as they may change a statement's answer, into a
    /// result cache key: each current setting's statement, in name order (the startup
    /// packet's unless changed since). `application_name` changes no answer pgherd keeps.
    pub fn write_cache_key(&self, key: &mut Vec<u8>) {
        const NOT_IN_KEY: &str = "application_name";
        for (name, sql) in self.startup.0.iter() {
            if name != NOT_IN_KEY && self.entries.get(name).is_none() {
                key.extend_from_slice(sql.as_bytes());
                key.push(0);
            }
        }
        for (name, sql) in self.entries.0.iter() {
            if name != NOT_IN_KEY {
                key.extend_from_slice(sql.as_bytes());
                key.push(0);
            }
        }
    }

    /// The startup packet's statements for the settings `changes` reset: a server's `RESET`
    /// goes back to its own startup value, not the client's, so pgherd sets these again.
    pub fn startup_values_reset_by(&self, changes: &[Change]) -> Vec<&str> {
        let mut statements: Vec<&str> = Vec::new();
        for change in changes {
            match change {
                Change::Reset { name } => {
                    statements.extend(self.startup.get(name).map(String::as_str))
                }
                Change::ResetAll => statements.extend(self.startup.values().map(String::as_str)),
                Change::Set { .. } => {}
            }
        }
        statements.sort_unstable();
        statements.dedup();
        statements
    }

    /// Settings that differ from the server's defaults.
    pub fn len(&self) -> usize {
        self.startup.len() + self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.startup.is_empty() && self.entries.is_empty()
    }
}

/// What a server connection runs before it carries a client's request, each statement on its
/// own (a setting the server refuses must not roll back the reset and leave the previous
/// client's settings in place): the reset and the client's settings when the connection carries
/// others (`server_fp`), then whatever clears its residue. Empty, without allocating, on the
/// warm path (same settings, no residue). `fresh_seed` as for [`Residue::clear_sql`].
pub fn catch_up_sql(
    params: &SessionParams,
    server_fp: u64,
    residue: &Residue,
    fresh_seed: impl FnOnce() -> f64,
) -> Vec<String> {
    let mut statements = Vec::new();
    if server_fp != params.fingerprint() {
        if server_fp != BASELINE {
            statements.push(RESET_SQL.to_owned());
        }
        statements.extend(params.apply_sql());
    }
    statements.extend(residue.clear_sql(fresh_seed));
    statements
}

/// The statement that gives setting `name` the value `value`, read as a startup parameter or
/// the configuration file would read it (a list for `search_path`, which `SET name TO
/// 'a, b'` would take as one schema), quoted so that any name and value survive.
pub fn set_sql(name: &str, value: &str) -> String {
    super::probe::set_config_sql(name, value)
}

pub fn quote_literal(value: &str) -> String {
    // E'' is read the same whatever standard_conforming_strings says.
    let escaped = value.contains('\\');
    let mut quoted = String::with_capacity(value.len() + 4);
    if escaped {
        quoted.push('E');
    }
    quoted.push('\'');
    for c in value.chars() {
        match c {
            '\\' => quoted.push_str("\\\\"),
            '\'' if escaped => quoted.push_str("\\'"),
            '\'' => quoted.push_str("''"),
            c => quoted.push(c),
        }
    }
    quoted.push('\'');
    quoted
}

/// Parses the `options` startup parameter: `-c name=value` and `--name=value`, with `\ `
/// escaping spaces, as PostgreSQL reads it.
fn parse_options(options: &str) -> Vec<(String, String)> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = options.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    word.push(next);
                }
            }
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    let mut out = Vec::new();
    let mut iter = words.into_iter();
    while let Some(w) = iter.next() {
        let setting = if w == "-c" {
            iter.next()
        } else if let Some(rest) = w.strip_prefix("--") {
            Some(rest.to_owned())
        } else {
            w.strip_prefix("-c").map(str::to_owned)
        };
        if let Some((name, value)) = setting.as_deref().and_then(|s| s.split_once('=')) {
            out.push((name.replace('-', "_"), value.to_owned()));
        }
    }
    out
}

/// The session changes a statement text makes, as far as pgherd follows them: `SET`, `RESET`,
/// `RESET ALL`, `DISCARD ALL`, `SET ROLE`, `SET SESSION AUTHORIZATION`, `SET SESSION
/// CHARACTERISTICS`. `SET LOCAL` and transaction-scoped settings are left out. `None` if the
/// text does not parse.
pub fn session_changes(sql: &str) -> Option<Vec<Change>> {
    let parsed = pg_query::parse(sql).ok()?;
    let mut changes = Vec::new();
    for raw in &parsed.protobuf.stmts {
        let Some(node) = raw.stmt.as_ref().and_then(|s| s.node.as_ref()) else {
            continue;
        };
        match node {
            NodeEnum::VariableSetStmt(set) if !set.is_local => {
                let name = set.name.to_lowercase();
                if TRANSACTION_SCOPED.contains(&name.as_str()) {
                    continue;
                }
                let kind =
                    VariableSetKind::try_from(set.kind).unwrap_or(VariableSetKind::Undefined);
                match kind {
                    VariableSetKind::VarResetAll => changes.push(Change::ResetAll),
                    // `SET x TO DEFAULT` is `RESET x`: back to the startup value, if any.
                    VariableSetKind::VarReset | VariableSetKind::VarSetDefault => {
                        changes.push(Change::Reset { name })
                    }
                    VariableSetKind::Undefined => return None,
                    _ => {
                        let start = usize::try_from(raw.stmt_location).ok()?;
                        let len = usize::try_from(raw.stmt_len).ok()?;
                        let end = if len == 0 { sql.len() } else { start + len };
                        let text = sql.get(start..end)?.trim();
                        changes.push(Change::Set {
                            name,
                            sql: text.to_owned(),
                        });
                    }
                }
            }
            NodeEnum::DiscardStmt(discard) if discard.target == 1 => {
                // DISCARD_ALL
                changes.push(Change::ResetAll);
            }
            _ => {}
        }
    }
    Some(changes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(list: &[(&str, &str)]) -> SessionParams {
        let owned: Vec<(String, String)> = list
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        SessionParams::from_startup(&owned, &Interner::default())
    }

    #[test]
    fn a_residue_draws_a_seed_only_when_the_seed_was_set() {
        let p = params(&[]);
        let seedless = Residue {
            sequences: true,
            seed: false,
        };
        let never = || -> f64 { panic!("no seed was set: nothing to draw") };
        assert!(catch_up_sql(&p, p.fingerprint(), &Residue::default(), never).is_empty());
        assert_eq!(
            catch_up_sql(&p, p.fingerprint(), &seedless, never),
            ["DISCARD SEQUENCES"]
        );
        let seeded = Residue {
            sequences: true,
            seed: true,
        };
        assert_eq!(
            catch_up_sql(&p, p.fingerprint(), &seeded, || 0.25),
            ["DISCARD SEQUENCES; SELECT pg_catalog.setseed(0.25000000000000000)"]
        );
        assert!((-1.0..=1.0).contains(&fresh_seed()));
    }

    #[test]
    fn startup_parameters_become_settings() {
        let p = params(&[
            ("user", "u"),
            ("database", "d"),
            ("application_name", "app"),
            ("DateStyle", "ISO"),
            (
                "options",
                "-c search_path=s1 --work-mem=1MB -csynchronous_commit=off",
            ),
        ]);
        assert_eq!(
            p.apply_sql().unwrap(),
            "SELECT pg_catalog.set_config('application_name', 'app', false); \
             SELECT pg_catalog.set_config('DateStyle', 'ISO', false); \
             SELECT pg_catalog.set_config('search_path', 's1', false); \
             SELECT pg_catalog.set_config('synchronous_commit', 'off', false); \
             SELECT pg_catalog.set_config('work_mem', '1MB', false)"
        );
        assert_ne!(p.fingerprint(), BASELINE);
        assert_eq!(params(&[("user", "u")]).fingerprint(), BASELINE);
    }

    #[test]
    fn a_setting_s_current_statement_follows_the_transaction() {
        let mut p = params(&[("options", "-c pgherd.shard=1")]);
        let from_startup = "SELECT pg_catalog.set_config('pgherd.shard', '1', false)";
        assert_eq!(p.current("pgherd.shard"), Some(from_startup));
        assert_eq!(p.current("work_mem"), None);
        p.record(session_changes("SET pgherd.shard = 2").unwrap());
        assert_eq!(p.current("pgherd.shard"), Some("SET pgherd.shard = 2"));
        p.end_transaction(false);
        assert_eq!(p.current("pgherd.shard"), Some(from_startup));
        p.record(session_changes("SET pgherd.shard = 2").unwrap());
        p.end_transaction(true);
        p.record(session_changes("RESET pgherd.shard").unwrap());
        assert_eq!(p.current("pgherd.shard"), Some(from_startup));
        p.end_transaction(false);
        assert_eq!(p.current("pgherd.shard"), Some("SET pgherd.shard = 2"));
        p.record(session_changes("DISCARD ALL").unwrap());
        p.end_transaction(true);
        assert_eq!(p.current("pgherd.shard"), Some(from_startup));
        p.record(session_changes("SET pgherd.shard = 2").unwrap());
        p.record(session_changes("SET pgherd.shard TO DEFAULT").unwrap());
        assert_eq!(p.current("pgherd.shard"), Some(from_startup));
    }

    #[test]
    fn same_settings_same_fingerprint() {
        let a = params(&[("user", "a"), ("application_name", "x")]);
        let b = params(&[("user", "b"), ("application_name", "x")]);
        let c = params(&[("user", "b"), ("application_name", "y")]);
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), c.fingerprint());
    }

    #[test]
    fn literals_are_quoted() {
        assert_eq!(
            set_sql("a\"b", "it's"),
            "SELECT pg_catalog.set_config('a\"b', 'it''s', false)"
        );
        assert_eq!(
            set_sql("x", "C:\\dir'"),
            "SELECT pg_catalog.set_config('x', E'C:\\\\dir\\'', false)"
        );
    }

    #[test]
    fn changes_from_statements() {
        let check = |sql: &str, expected: &[Change]| {
            assert_eq!(session_changes(sql).unwrap(), expected, "{sql}")
        };
        check(
            "SET search_path TO a, b",
            &[Change::Set {
                name: "search_path".into(),
                sql: "SET search_path TO a, b".into(),
            }],
        );
        check("SET LOCAL work_mem = '1MB'", &[]);
        check("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", &[]);
        check(
            "select 1; SET TIME ZONE 'UTC'; RESET work_mem",
            &[
                Change::Set {
                    name: "timezone".into(),
                    sql: "SET TIME ZONE 'UTC'".into(),
                },
                Change::Reset {
                    name: "work_mem".into(),
                },
            ],
        );
        check("RESET ALL", &[Change::ResetAll]);
        check("DISCARD ALL", &[Change::ResetAll]);
        check(
            "SET ROLE alice",
            &[Change::Set {
                name: "role".into(),
                sql: "SET ROLE alice".into(),
            }],
        );
        assert!(session_changes("SET SET SET").is_none());
    }

    #[test]
    fn transactions_keep_changes_only_on_commit() {
        let mut p = SessionParams::default();
        let set = |v: &str| {
            vec![Change::Set {
                name: "work_mem".into(),
                sql: format!("SET work_mem = '{v}'"),
            }]
        };
        p.record(set("1MB"));
        assert_eq!(p.fingerprint(), BASELINE);
        p.end_transaction(false);
        assert_eq!(p.fingerprint(), BASELINE);
        p.record(set("2MB"));
        p.end_transaction(true);
        assert_ne!(p.fingerprint(), BASELINE);
        p.record(vec![Change::ResetAll]);
        p.end_transaction(true);
        assert_eq!(p.fingerprint(), BASELINE);
    }

    #[test]
    fn reset_all_returns_to_the_startup_settings() {
        let mut p = params(&[("user", "u"), ("application_name", "app")]);
        let at_start = p.fingerprint();
        p.record(vec![Change::Set {
            name: "work_mem".into(),
            sql: "SET work_mem = '2MB'".into(),
        }]);
        p.end_transaction(true);
        assert_ne!(p.fingerprint(), at_start);
        p.record(vec![Change::ResetAll]);
        p.end_transaction(true);
        assert_eq!(p.fingerprint(), at_start);
        assert_eq!(
            p.apply_sql().unwrap(),
            "SELECT pg_catalog.set_config('application_name', 'app', false)"
        );
        // The server reporting the startup value back changes nothing.
        p.record_reported("application_name", "app");
        assert_eq!(p.fingerprint(), at_start);
    }
}
