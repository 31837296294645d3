//! Replication sets, in the style of Slony-I, on PostgreSQL's logical replication: chosen
//! tables of one database, published from their origin and subscribed to by other clusters or
//! databases. What pgherd keeps about a set (its patterns and its subscribers) lives in the
//! origin database's `pgherd` schema, so it follows the origin through a failover of its own
//! cluster; the publication and subscriptions are PostgreSQL's. Here: the checks and the
//! statements, with no sockets.

use crate::consistency::{quote_literal, table_selected, TableShape};

/// What pgherd keeps in the origin database, created on the first set.
pub const CATALOG_SQL: &str = "\
CREATE SCHEMA IF NOT EXISTS pgherd; \
CREATE TABLE IF NOT EXISTS pgherd.sets (\
  name text PRIMARY KEY, patterns text[] NOT NULL, created_at timestamptz NOT NULL DEFAULT now()); \
ALTER TABLE pgherd.sets ADD COLUMN IF NOT EXISTS sequences text[] NOT NULL DEFAULT '{}'; \
ALTER TABLE pgherd.sets ADD COLUMN IF NOT EXISTS excluded text[] NOT NULL DEFAULT '{}'; \
CREATE TABLE IF NOT EXISTS pgherd.set_subscribers (\
  set_name text NOT NULL REFERENCES pgherd.sets ON DELETE CASCADE, \
  subscription text NOT NULL, subscriber text NOT NULL, \
  created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (set_name, subscription))";

/// The sets of the origin database, their tables (from their publications) and subscribers:
/// one row per set, arrays as JSON.
pub const LIST_SQL: &str = "\
SELECT s.name, \
       (SELECT coalesce(json_agg(t.schemaname || '.' || t.tablename \
                 ORDER BY t.schemaname, t.tablename), '[]') \
          FROM pg_publication_tables t WHERE t.pubname = 'pgherd_' || s.name \
           AND t.schemaname <> 'pgherd')::text, \
       (SELECT coalesce(json_agg(json_build_array(b.subscription, b.subscriber, \
                 pg_wal_lsn_diff(pg_current_wal_lsn(), r.confirmed_flush_lsn)::bigint, \
                 r.active) ORDER BY b.subscription), '[]') \
          FROM pgherd.set_subscribers b \
          LEFT JOIN pg_replication_slots r ON r.slot_name = b.subscription \
         WHERE b.set_name = s.name)::text \
  FROM pgherd.sets s ORDER BY s.name";

/// What [`LIST_SQL`] says of one set.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SetStatus {
    pub name: String,
    /// `schema.table`, pgherd's marker left out.
    pub tables: Vec<String>,
    pub subscribers: Vec<SubscriberStatus>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SubscriberStatus {
    pub subscription: String,
    /// Where it is (`host:port/database`), never its password.
    pub subscriber: String,
    /// WAL the origin wrote that the subscriber has not confirmed; `None` without a slot.
    pub lag_bytes: Option<i64>,
    /// Its slot is in use: the subscription streams.
    pub streaming: bool,
}

/// Reads [`LIST_SQL`]'s rows; a row that does not read is left out.
pub fn read_list(rows: &[Vec<Option<String>>]) -> Vec<SetStatus> {
    rows.iter()
        .filter_map(|row| {
            let field = |i: usize| row.get(i).cloned().flatten();
            let tables: Vec<String> = serde_json::from_str(&field(1)?).ok()?;
            let subscribers: Vec<(String, String, Option<i64>, Option<bool>)> =
                serde_json::from_str(&field(2)?).ok()?;
            Some(SetStatus {
                name: field(0)?,
                tables,
                subscribers: subscribers
                    .into_iter()
                    .map(
                        |(subscription, subscriber, lag_bytes, active)| SubscriberStatus {
                            subscription,
                            subscriber,
                            lag_bytes,
                            streaming: active.unwrap_or(false),
                        },
                    )
                    .collect(),
            })
        })
        .collect()
}

/// On the origin: whether the database holds pgherd's set catalog at all.
pub const HAS_CATALOG_SQL: &str = "SELECT (to_regclass('pgherd.sets') IS NOT NULL)::text";

/// Why a set cannot be made or subscribed to, in words an operator acts on.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SetError {
    #[error("{0:?} cannot name a set: lowercase letters, digits and '_', starting with a letter, at most 40")]
    BadName(String),
    #[error("a set needs at least one table pattern (--tables)")]
    NoPatterns,
    #[error("the patterns {0} match no table of the database: a set with no tables is refused")]
    NoTables(String),
    #[error("{} {} no primary key: a subscriber could not apply an UPDATE or DELETE of {}; add one (or make its REPLICA IDENTITY FULL), or leave {} out of the set", .0.join(", "), if .0.len() == 1 { "has" } else { "have" }, if .0.len() == 1 { "its rows" } else { "their rows" }, if .0.len() == 1 { "it" } else { "them" })]
    NoPrimaryKey(Vec<String>),
    #[error("the patterns {0} match no table of the set")]
    NotMembers(String),
    #[error("every table of the set would leave it: a set keeps at least one")]
    WouldBeEmpty,
    #[error("the sequence patterns {0} match no sequence of the database")]
    NoSequences(String),
    #[error("the subscriber has no sequence {}: create {} there first", .0.join(", "), if .0.len() == 1 { "it" } else { "them" })]
    SequenceMissingOnSubscriber(Vec<String>),
    #[error("the subscriber has no table {}: create {} there first (a subscription copies rows, not definitions)", .0.join(", "), if .0.len() == 1 { "it" } else { "them" })]
    MissingOnSubscriber(Vec<String>),
    #[error("on the subscriber, {} {} no primary key: it could not apply an UPDATE or DELETE; add one there", .0.join(", "), if .0.len() == 1 { "has" } else { "have" })]
    NoPrimaryKeyOnSubscriber(Vec<String>),
}

/// A set's name is part of the publication's and the subscriptions' names.
pub fn check_name(name: &str) -> Result<(), SetError> {
    let ok = name.len() <= 40
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    match ok {
        true => Ok(()),
        false => Err(SetError::BadName(name.to_owned())),
    }
}

/// The set's marker table, published with its tables: one row whose number the origin raises
/// and a subscriber, applying the origin's changes in commit order, shows once it has applied
/// everything the origin committed before (Slony-I's events, on logical replication).
pub fn marker_table(set: &str) -> String {
    format!("pgherd.mark_{set}")
}

/// Makes the marker table (on the origin with its row; on a subscriber empty, its row comes
/// with the copy).
pub fn marker_sql(set: &str, with_row: bool) -> String {
    let table = marker_table(set);
    let mut sql = format!(
        "CREATE SCHEMA IF NOT EXISTS pgherd; \
         CREATE TABLE IF NOT EXISTS {table} (one boolean PRIMARY KEY DEFAULT true CHECK (one), \
         mark bigint NOT NULL, at timestamptz NOT NULL DEFAULT now())"
    );
    if with_row {
        sql.push_str(&format!("; INSERT INTO {table} (mark) VALUES (0)"));
    }
    sql
}

/// On the origin: the next mark, whose number comes back.
pub fn raise_mark_sql(set: &str) -> String {
    format!(
        "UPDATE {} SET mark = mark + 1, at = now() RETURNING mark::text",
        marker_table(set)
    )
}

/// On a subscriber: the last mark it applied.
pub fn applied_mark_sql(set: &str) -> String {
    format!("SELECT mark::text FROM {}", marker_table(set))
}

/// A name as an SQL identifier, quoted: subscriptions are named by pgherd, but a name read
/// back from the origin's catalog must not be able to say more than a name.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Statements on a subscriber that end its subscription: `keep_slot` detaches it from its slot
/// first (the slot on the origin is then dropped by whoever moves the set), else the slot goes
/// with it.
pub fn drop_subscription_sql(subscription: &str, keep_slot: bool) -> String {
    let name = quote_ident(subscription);
    match keep_slot {
        true => format!(
            "ALTER SUBSCRIPTION {name} DISABLE; ALTER SUBSCRIPTION {name} SET (slot_name = NONE); \
             DROP SUBSCRIPTION {name}"
        ),
        false => format!("DROP SUBSCRIPTION {name}"),
    }
}

/// On a subscriber: the subscription copies the tables the set gained.
pub fn refresh_sql(subscription: &str) -> String {
    format!(
        "ALTER SUBSCRIPTION {} REFRESH PUBLICATION",
        quote_ident(subscription)
    )
}

/// The publication that carries a set.
pub fn publication(set: &str) -> String {
    format!("pgherd_{set}")
}

/// A subscription to `set` (also its replication slot's name on the origin): the set and a
/// tag of the subscriber, so several subscribers of one origin do not collide; at most 63
/// characters, PostgreSQL's limit for both.
pub fn subscription(set: &str, subscriber_tag: &str) -> String {
    let tag: String = subscriber_tag
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '_',
        })
        .collect();
    let mut name = format!("pgherd_{set}_{tag}");
    name.truncate(63);
    name
}

/// The origin's tables the patterns select; refused when none is, or when one has neither a
/// primary key nor `REPLICA IDENTITY FULL` (logical replication would then refuse its updates
/// and deletes on the origin).
pub fn choose_tables<'a>(
    tables: &'a [TableShape],
    patterns: &[String],
) -> Result<Vec<&'a TableShape>, SetError> {
    if patterns.is_empty() {
        return Err(SetError::NoPatterns);
    }
    let chosen: Vec<&TableShape> = tables
        .iter()
        .filter(|t| table_selected(&t.name, patterns) && !t.name.starts_with("pgherd."))
        .collect();
    if chosen.is_empty() {
        return Err(SetError::NoTables(patterns.join(", ")));
    }
    let keyless: Vec<String> = chosen
        .iter()
        .filter(|t| !t.replicable())
        .map(|t| t.name.clone())
        .collect();
    if !keyless.is_empty() {
        return Err(SetError::NoPrimaryKey(keyless));
    }
    Ok(chosen)
}

/// The database's sequences: `schema.name` (what patterns match) and quoted, for statements.
pub const SEQUENCES_SQL: &str = "\
SELECT n.nspname || '.' || c.relname, format('%I.%I', n.nspname, c.relname) \
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
 WHERE c.relkind = 'S' AND n.nspname NOT IN ('pg_catalog', 'information_schema') \
   AND n.nspname !~ '^pg_temp_' \
 ORDER BY 1";

/// A sequence of the database: (`schema.name`, quoted for statements).
pub type Sequence = (String, String);

/// The sequences `patterns` choose (none asked: none); refused when patterns choose none.
pub fn choose_sequences<'a>(
    sequences: &'a [Sequence],
    patterns: &[String],
) -> Result<Vec<&'a Sequence>, SetError> {
    if patterns.is_empty() {
        return Ok(Vec::new());
    }
    let chosen: Vec<&Sequence> = sequences
        .iter()
        .filter(|(name, _)| table_selected(name, patterns))
        .collect();
    if chosen.is_empty() {
        return Err(SetError::NoSequences(patterns.join(", ")));
    }
    Ok(chosen)
}

/// The sequences a set keeps in step: those its patterns choose, less those taken out.
pub fn set_sequences<'a>(
    sequences: &'a [Sequence],
    patterns: &[String],
    excluded: &[String],
) -> Vec<&'a Sequence> {
    sequences
        .iter()
        .filter(|(name, _)| table_selected(name, patterns) && !excluded.contains(name))
        .collect()
}

/// A sequence's state: its last value and whether that value was handed out.
pub fn sequence_value_sql(sql_name: &str) -> String {
    format!("SELECT last_value::text, is_called::text FROM {sql_name}")
}

/// On a subscriber: the sequence put where the origin's is, so that it hands out the values
/// the origin would next (after a set moves its origin there).
pub fn setval_sql(sql_name: &str, last_value: i64, is_called: bool) -> String {
    format!(
        "SELECT setval({}, {last_value}, {is_called})",
        quote_literal(sql_name)
    )
}

/// Which of the set's sequences a subscriber lacks.
pub fn check_subscriber_sequences(
    set: &[&Sequence],
    subscriber: &[Sequence],
) -> Result<(), SetError> {
    let missing: Vec<String> = set
        .iter()
        .filter(|(name, _)| !subscriber.iter().any(|(s, _)| s == name))
        .map(|(name, _)| name.clone())
        .collect();
    match missing.is_empty() {
        true => Ok(()),
        false => Err(SetError::SequenceMissingOnSubscriber(missing)),
    }
}

/// Row filters of a set's tables (by `schema.table`): the rows of each it publishes
/// (PostgreSQL 15's `WHERE` of a publication's table; its columns must be in the table's
/// replica identity). A table without one publishes all its rows.
pub type RowFilters = std::collections::BTreeMap<String, String>;

/// One transaction on the origin: the catalog, the set's marker table with its row, the set's
/// row, its publication.
pub fn create_sql(
    set: &str,
    patterns: (&[String], &[String]),
    tables: &[&TableShape],
    row_filters: &RowFilters,
) -> String {
    let tables: Vec<String> = tables
        .iter()
        .map(|t| match row_filters.get(&t.name) {
            Some(filter) => format!("{} WHERE ({filter})", t.sql_name),
            None => t.sql_name.clone(),
        })
        .collect();
    let tables: Vec<&str> = tables.iter().map(String::as_str).collect();
    publish_sql(set, (patterns, &[]), &tables, Some(&marker_sql(set, true)))
}

/// The catalog, `marker` (when the node has no marker table yet), the set's row (its table and
/// sequence patterns) and its publication, in one transaction.
fn publish_sql(
    set: &str,
    ((patterns, sequences), excluded): ((&[String], &[String]), &[String]),
    tables: &[&str],
    marker: Option<&str>,
) -> String {
    let list = |v: &[String]| {
        v.iter()
            .map(|p| quote_literal(p))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "BEGIN; {CATALOG_SQL}; {}\
         INSERT INTO pgherd.sets (name, patterns, sequences, excluded) \
         VALUES ({}, ARRAY[{}]::text[], ARRAY[{}]::text[], ARRAY[{}]::text[]); \
         CREATE PUBLICATION {} FOR TABLE {}, {}; COMMIT",
        marker.map_or(String::new(), |m| format!("{m}; ")),
        quote_literal(set),
        list(patterns),
        list(sequences),
        list(excluded),
        publication(set),
        tables.join(", "),
        marker_table(set)
    )
}

/// Whether the subscriber can take the set's tables (as the origin has them): each must exist
/// there, with a primary key unless the origin's has `REPLICA IDENTITY FULL` (its rows are
/// then found by every column).
pub fn check_subscriber(
    set_tables: &[TableShape],
    subscriber: &[TableShape],
) -> Result<(), SetError> {
    let missing: Vec<String> = set_tables
        .iter()
        .filter(|t| !subscriber.iter().any(|s| s.name == t.name))
        .map(|t| t.name.clone())
        .collect();
    if !missing.is_empty() {
        return Err(SetError::MissingOnSubscriber(missing));
    }
    let keyless: Vec<String> = subscriber
        .iter()
        .filter(|s| {
            s.key.is_empty()
                && set_tables
                    .iter()
                    .any(|t| t.name == s.name && !t.full_identity)
        })
        .map(|s| s.name.clone())
        .collect();
    if !keyless.is_empty() {
        return Err(SetError::NoPrimaryKeyOnSubscriber(keyless));
    }
    Ok(())
}

/// What a new subscription takes from the origin before it streams changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copy {
    /// The tables' rows (a new subscriber).
    Rows,
    /// Nothing: the rows are there already (a set's move, or its undoing: every node applied
    /// everything before it, and the set's tables take no writes meanwhile).
    Nothing,
}

/// On the subscriber: the subscription, which makes its slot on the origin and, as `copy`
/// says, copies the tables' rows before streaming their changes. (Not in a transaction block:
/// PostgreSQL refuses one that makes a slot.)
pub fn subscribe_sql(set: &str, subscription: &str, origin_conninfo: &str, copy: Copy) -> String {
    format!(
        "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {} \
         WITH (copy_data = {}, slot_name = {})",
        quote_ident(subscription),
        quote_literal(origin_conninfo),
        publication(set),
        copy == Copy::Rows,
        quote_literal(subscription)
    )
}

/// On a node that is not the set's origin (any more): its tables refuse local writes with
/// 25006, naming the origin, as Slony-I's deny-access triggers do. The subscription's apply
/// worker runs in the replica role, where such triggers do not fire.
pub fn deny_writes_sql(set: &str, origin: &str, tables: &[&str]) -> String {
    let mut sql = String::from(
        "CREATE SCHEMA IF NOT EXISTS pgherd; \
         CREATE OR REPLACE FUNCTION pgherd.deny_write() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN RAISE EXCEPTION 'table %.% is in replication set %, whose origin is %: write there', \
         TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_ARGV[0], TG_ARGV[1] USING ERRCODE = '25006'; END $$",
    );
    for table in tables {
        sql.push_str(&format!(
            "; DROP TRIGGER IF EXISTS pgherd_deny_{set} ON {table}; \
             CREATE TRIGGER pgherd_deny_{set} BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE \
             ON {table} FOR EACH STATEMENT EXECUTE FUNCTION pgherd.deny_write({}, {})",
            quote_literal(set),
            quote_literal(origin)
        ));
    }
    sql
}

/// On the set's new origin: its tables take writes again.
pub fn allow_writes_sql(set: &str, tables: &[&str]) -> String {
    tables
        .iter()
        .map(|t| format!("DROP TRIGGER IF EXISTS pgherd_deny_{set} ON {t}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// On the new origin: the set's catalog row (as the old origin had it: patterns, sequence
/// patterns, tables taken out) and its publication (its marker table came with the set).
pub fn adopt_sql(
    set: &str,
    patterns: ((&[String], &[String]), &[String]),
    tables: &[&str],
) -> String {
    publish_sql(set, patterns, tables, None)
}

/// The set's tables `patterns` choose, to be taken out of it; refused when none is, or when
/// none would be left.
pub fn choose_members<'a>(
    members: &'a [TableShape],
    patterns: &[String],
) -> Result<Vec<&'a TableShape>, SetError> {
    let chosen: Vec<&TableShape> = members
        .iter()
        .filter(|t| table_selected(&t.name, patterns))
        .collect();
    if chosen.is_empty() {
        return Err(SetError::NotMembers(patterns.join(", ")));
    }
    if chosen.len() == members.len() {
        return Err(SetError::WouldBeEmpty);
    }
    Ok(chosen)
}

/// On the origin, one transaction: the tables leave the set's publication and are recorded as
/// taken out, so that a scan does not add them back while they match its patterns.
pub fn drop_tables_sql(set: &str, tables: &[&TableShape]) -> String {
    let sql_names: Vec<&str> = tables.iter().map(|t| t.sql_name.as_str()).collect();
    let names: Vec<String> = tables.iter().map(|t| quote_literal(&t.name)).collect();
    format!(
        "BEGIN; ALTER PUBLICATION {} DROP TABLE {}; \
         UPDATE pgherd.sets SET excluded = ARRAY(SELECT DISTINCT unnest(excluded || ARRAY[{}]::text[])) \
         WHERE name = {}; COMMIT",
        publication(set),
        sql_names.join(", "),
        names.join(", "),
        quote_literal(set)
    )
}

/// A set's table patterns with `added` joined (each once), and the tables it took out that an
/// added pattern names: they stay out (their subscribers' copies are their own tables now,
/// with rows a new copy would collide with).
pub fn with_patterns(
    patterns: &[String],
    excluded: &[String],
    added: &[String],
) -> (Vec<String>, Vec<String>) {
    let mut all = patterns.to_vec();
    for pattern in added {
        if !all.contains(pattern) {
            all.push(pattern.clone());
        }
    }
    let staying_out = excluded
        .iter()
        .filter(|t| table_selected(t, added))
        .cloned()
        .collect();
    (all, staying_out)
}

/// The arrays of a set's catalog row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetArray {
    /// Table patterns.
    Patterns,
    /// Sequence patterns.
    Sequences,
    /// Tables and sequences taken out (a table and a sequence of one schema never share a
    /// name).
    Excluded,
}

/// On the origin: one array of the set's catalog row, as given.
pub fn set_array_sql(set: &str, array: SetArray, values: &[String]) -> String {
    let column = match array {
        SetArray::Patterns => "patterns",
        SetArray::Sequences => "sequences",
        SetArray::Excluded => "excluded",
    };
    let list: Vec<String> = values.iter().map(|p| quote_literal(p)).collect();
    format!(
        "UPDATE pgherd.sets SET {column} = ARRAY[{}]::text[] WHERE name = {}",
        list.join(", "),
        quote_literal(set)
    )
}

/// On a subscriber of a set being dropped (its subscription gone): the set's tables take
/// writes and its marker table goes.
pub fn leave_set_sql(set: &str, tables: &[&str]) -> String {
    let mut sql = allow_writes_sql(set, tables);
    if !sql.is_empty() {
        sql.push_str("; ");
    }
    sql.push_str(&format!("DROP TABLE IF EXISTS {}", marker_table(set)));
    sql
}

/// On the origin of a set being dropped: its publication, catalog rows (its subscribers'
/// with them) and marker table, in one transaction.
pub fn drop_set_sql(set: &str) -> String {
    format!(
        "BEGIN; {}; DROP TABLE IF EXISTS {}; COMMIT",
        release_sql(set),
        marker_table(set)
    )
}

/// On the old origin, after the move: its publication and catalog rows for the set go.
pub fn release_sql(set: &str) -> String {
    format!(
        "DROP PUBLICATION IF EXISTS {}; DELETE FROM pgherd.sets WHERE name = {}",
        publication(set),
        quote_literal(set)
    )
}

/// On the set's current origin: the set's patterns, sequence patterns and the tables taken out
/// of it, as JSON arrays.
pub fn patterns_sql(set: &str) -> String {
    format!(
        "SELECT array_to_json(patterns)::text, array_to_json(sequences)::text, \
                coalesce((to_jsonb(s) -> 'excluded')::text, '[]') \
           FROM pgherd.sets s WHERE name = {}",
        quote_literal(set)
    )
}

/// On the subscriber: (tables copied and streaming, tables in the subscription).
pub fn sync_progress_sql(subscription: &str) -> String {
    format!(
        "SELECT count(*) FILTER (WHERE r.srsubstate IN ('r', 's'))::text, count(*)::text \
           FROM pg_subscription_rel r JOIN pg_subscription s ON s.oid = r.srsubid \
          WHERE s.subname = {}",
        quote_literal(subscription)
    )
}

/// On the origin: the subscriber recorded with the set (once: a resumed subscribe records it
/// again).
pub fn record_subscriber_sql(set: &str, subscription: &str, subscriber: &str) -> String {
    format!(
        "INSERT INTO pgherd.set_subscribers (set_name, subscription, subscriber) VALUES ({}, {}, {}) \
         ON CONFLICT DO NOTHING",
        quote_literal(set),
        quote_literal(subscription),
        quote_literal(subscriber)
    )
}

/// A libpq connection string naming `host`, `port`, `dbname`, `user` and `password`, each value
/// quoted as libpq reads it.
pub fn conninfo(parts: &[(&str, &str)]) -> String {
    parts
        .iter()
        .map(|(key, value)| {
            let value = value.replace('\\', "\\\\").replace('\'', "\\'");
            format!("{key}='{value}'")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consistency::KeyColumn;

    fn table(name: &str, keyed: bool) -> TableShape {
        TableShape {
            name: name.into(),
            sql_name: name.into(),
            estimated_rows: 0,
            columns: vec!["id".into()],
            key: if keyed {
                vec![KeyColumn {
                    sql_name: "id".into(),
                    type_name: "integer".into(),
                }]
            } else {
                Vec::new()
            },
            full_identity: false,
            row_filter: None,
        }
    }

    #[test]
    fn names() {
        assert!(check_name("orders").is_ok());
        assert!(check_name("orders_2").is_ok());
        for bad in ["", "Orders", "2orders", "or-ders", &"x".repeat(41)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        assert_eq!(publication("orders"), "pgherd_orders");
        assert_eq!(
            subscription("orders", "Host-B:5433"),
            "pgherd_orders_host_b_5433"
        );
    }

    #[test]
    fn tables_are_chosen_by_pattern_and_need_a_key() {
        let tables = [
            table("public.orders", true),
            table("public.order_lines", true),
            table("public.log", false),
            table("pgherd.sets", true),
        ];
        let p = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let chosen = choose_tables(&tables, &p(&["order*"])).unwrap();
        let names: Vec<&str> = chosen.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["public.orders", "public.order_lines"]);
        // pgherd's own catalog is never in a set.
        let chosen = choose_tables(&tables, &p(&["pgherd.*", "orders"])).unwrap();
        assert_eq!(chosen.len(), 1);
        assert_eq!(
            choose_tables(&tables, &p(&["*"])).unwrap_err().to_string(),
            "public.log has no primary key: a subscriber could not apply an UPDATE or DELETE of its rows; add one (or make its REPLICA IDENTITY FULL), or leave it out of the set"
        );
        // REPLICA IDENTITY FULL carries a keyless table's updates and deletes.
        let mut full = tables.clone();
        full[2].full_identity = true;
        assert_eq!(choose_tables(&full, &p(&["*"])).unwrap().len(), 3);
        assert_eq!(
            choose_tables(&tables, &p(&["nothing*"])).unwrap_err(),
            SetError::NoTables("nothing*".into())
        );
        assert_eq!(
            choose_tables(&tables, &[]).unwrap_err(),
            SetError::NoPatterns
        );
    }

    #[test]
    fn sequences_are_chosen_by_pattern_and_needed_on_subscribers() {
        let seq = |n: &str| (n.to_owned(), n.to_owned());
        let all = [seq("public.order_ids"), seq("public.invoice_ids")];
        let p = |s: &str| vec![s.to_owned()];
        assert!(choose_sequences(&all, &[]).unwrap().is_empty());
        let chosen = choose_sequences(&all, &p("order*")).unwrap();
        assert_eq!(chosen, vec![&all[0]]);
        assert_eq!(
            choose_sequences(&all, &p("x*")).unwrap_err().to_string(),
            "the sequence patterns x* match no sequence of the database"
        );
        assert_eq!(
            check_subscriber_sequences(&chosen, &all[1..])
                .unwrap_err()
                .to_string(),
            "the subscriber has no sequence public.order_ids: create it there first"
        );
        assert_eq!(check_subscriber_sequences(&chosen, &all), Ok(()));
        let everything = p("*");
        assert_eq!(
            set_sequences(&all, &everything, &p("public.invoice_ids")),
            vec![&all[0]]
        );
        assert!(set_sequences(&all, &everything, &p("public.order_ids"))
            .iter()
            .all(|(name, _)| name != "public.order_ids"));
        assert_eq!(
            setval_sql("public.order_ids", 41, true),
            "SELECT setval('public.order_ids', 41, true)"
        );
    }

    #[test]
    fn a_move_denies_writes_where_the_origin_is_not() {
        let sql = deny_writes_sql(
            "shop",
            "10.0.0.9:5432/app",
            &["public.orders", "public.lines"],
        );
        assert!(sql.contains("USING ERRCODE = '25006'"), "{sql}");
        assert!(
            sql.contains(
                "CREATE TRIGGER pgherd_deny_shop BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE \
                 ON public.lines FOR EACH STATEMENT EXECUTE FUNCTION pgherd.deny_write('shop', '10.0.0.9:5432/app')"
            ),
            "{sql}"
        );
        assert_eq!(
            allow_writes_sql("shop", &["public.orders"]),
            "DROP TRIGGER IF EXISTS pgherd_deny_shop ON public.orders"
        );
        // A password that reads like an option changes nothing but the password.
        assert_eq!(
            subscribe_sql("shop", "s", "password='copy_data = true'", Copy::Nothing),
            "CREATE SUBSCRIPTION \"s\" CONNECTION 'password=''copy_data = true''' \
             PUBLICATION pgherd_shop WITH (copy_data = false, slot_name = 's')"
        );
        assert_eq!(
            adopt_sql(
                "shop",
                ((&["o*".to_owned()], &[]), &["public.old".to_owned()]),
                &["public.orders"]
            ),
            "BEGIN; ".to_owned()
                + CATALOG_SQL
                + "; INSERT INTO pgherd.sets (name, patterns, sequences, excluded) \
                   VALUES ('shop', ARRAY['o*']::text[], ARRAY[]::text[], ARRAY['public.old']::text[]); \
                   CREATE PUBLICATION pgherd_shop FOR TABLE public.orders, pgherd.mark_shop; COMMIT"
        );
        let members = [
            table("public.orders", true),
            table("public.order_lines", true),
        ];
        let p = |s: &str| vec![s.to_owned()];
        let chosen = choose_members(&members, &p("order_lines")).unwrap();
        assert_eq!(
            drop_tables_sql("shop", &chosen),
            "BEGIN; ALTER PUBLICATION pgherd_shop DROP TABLE public.order_lines; \
             UPDATE pgherd.sets SET excluded = ARRAY(SELECT DISTINCT unnest(excluded || ARRAY['public.order_lines']::text[])) \
             WHERE name = 'shop'; COMMIT"
        );
        assert_eq!(
            choose_members(&members, &p("nope")).unwrap_err(),
            SetError::NotMembers("nope".into())
        );
        assert_eq!(
            choose_members(&members, &p("order*")).unwrap_err(),
            SetError::WouldBeEmpty
        );
        assert_eq!(
            drop_subscription_sql("x\"; DROP TABLE t; --", false),
            "DROP SUBSCRIPTION \"x\"\"; DROP TABLE t; --\""
        );
    }

    #[test]
    fn the_list_reads() {
        let rows = vec![vec![
            Some("shop".to_owned()),
            Some(r#"["public.orders"]"#.to_owned()),
            Some(r#"[["pgherd_shop_b", "b:5432/app", 128, true], ["pgherd_shop_c", "c:5432/app", null, null]]"#.to_owned()),
        ]];
        let list = read_list(&rows);
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].tables, ["public.orders"]);
        assert_eq!(list[0].subscribers[0].lag_bytes, Some(128));
        assert!(list[0].subscribers[0].streaming);
        assert_eq!(list[0].subscribers[1].lag_bytes, None);
        assert!(!list[0].subscribers[1].streaming);
        assert!(read_list(&[vec![Some("x".to_owned())]]).is_empty());
    }

    #[test]
    fn a_subscriber_needs_the_tables_with_keys() {
        let mut set = vec![table("public.orders", true), table("public.lines", true)];
        let sub = [table("public.orders", true), table("public.lines", false)];
        assert_eq!(
            check_subscriber(&set, &sub).unwrap_err().to_string(),
            "on the subscriber, public.lines has no primary key: it could not apply an UPDATE or DELETE; add one there"
        );
        assert_eq!(
            check_subscriber(&set, &sub[..1]).unwrap_err().to_string(),
            "the subscriber has no table public.lines: create it there first (a subscription copies rows, not definitions)"
        );
        // Without a key on either side, an origin's REPLICA IDENTITY FULL finds the rows.
        set[1].key.clear();
        set[1].full_identity = true;
        assert_eq!(check_subscriber(&set, &sub), Ok(()));
        let sub = [table("public.orders", true), table("public.lines", true)];
        assert_eq!(check_subscriber(&set, &sub), Ok(()));
    }

    #[test]
    fn added_patterns_join_once_and_name_what_stays_out() {
        let owned = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let (patterns, staying_out) = with_patterns(
            &owned(&["order*"]),
            &owned(&["public.order_notes", "public.invoices_old"]),
            &owned(&["order*", "public.order_notes", "invoices"]),
        );
        assert_eq!(
            patterns,
            owned(&["order*", "public.order_notes", "invoices"])
        );
        assert_eq!(staying_out, owned(&["public.order_notes"]));
        assert_eq!(
            set_array_sql("shop", SetArray::Patterns, &owned(&["o'*"])),
            "UPDATE pgherd.sets SET patterns = ARRAY['o''*']::text[] WHERE name = 'shop'"
        );
    }

    #[test]
    fn a_row_filter_narrows_its_table_in_the_publication() {
        let (t, other) = (table("public.orders", true), table("public.lines", true));
        let filters: RowFilters = [("public.orders".to_owned(), "(id >= 5)".to_owned())]
            .into_iter()
            .collect();
        let sql = create_sql("orders", (&["*".to_owned()], &[]), &[&t, &other], &filters);
        assert!(
            sql.contains(
                "CREATE PUBLICATION pgherd_orders FOR TABLE public.orders WHERE ((id >= 5)), public.lines, pgherd.mark_orders;"
            ),
            "{sql}"
        );
    }

    #[test]
    fn statements() {
        let t = table("public.orders", true);
        let sql = create_sql(
            "orders",
            (&["order*".to_owned()], &[]),
            &[&t],
            &RowFilters::new(),
        );
        assert!(
            sql.starts_with("BEGIN; CREATE SCHEMA IF NOT EXISTS pgherd;"),
            "{sql}"
        );
        assert!(
            sql.ends_with(
                "INSERT INTO pgherd.sets (name, patterns, sequences, excluded) \
                 VALUES ('orders', ARRAY['order*']::text[], ARRAY[]::text[], ARRAY[]::text[]); \
                 CREATE PUBLICATION pgherd_orders FOR TABLE public.orders, pgherd.mark_orders; COMMIT"
            ),
            "{sql}"
        );
        assert!(
            sql.contains("INSERT INTO pgherd.mark_orders (mark) VALUES (0)"),
            "{sql}"
        );
        assert_eq!(
            subscribe_sql(
                "orders",
                "pgherd_orders_b",
                "host=a password='x''y'",
                Copy::Rows
            ),
            "CREATE SUBSCRIPTION \"pgherd_orders_b\" CONNECTION 'host=a password=''x''''y''' \
             PUBLICATION pgherd_orders WITH (copy_data = true, slot_name = 'pgherd_orders_b')"
        );
        assert_eq!(
            conninfo(&[("host", "127.0.0.1"), ("password", "it's \\ here")]),
            r"host='127.0.0.1' password='it\'s \\ here'"
        );
    }
}
