//! What a server session holds after a transaction that may have changed it in ways pgherd
//! does not follow (a function, a `DO` block, `set_config`): the query that asks, and what
//! its answer means. Pure: no IO.
//!
//! Objects that live in the session (temporary tables and functions, session advisory locks,
//! LISTEN, cursors WITH HOLD, SQL prepared statements, temporary replication slots) tie the
//! client to its server connection from then on. Settings (everything `pg_settings` lists as
//! set in the session, the custom settings pgherd knows of, the role and session user) become
//! the client's, so they follow it to other servers, and the server is reset before anyone
//! uses it again.

use super::params::{quote_literal, Change};

/// One row of the answer: `(kind, name, value)`.
pub type Row = (String, Option<String>, Option<String>);

/// The kinds of rows.
pub const KIND_OBJECTS: &str = "o";
pub const KIND_SETTING: &str = "s";
pub const KIND_CUSTOM: &str = "c";
pub const KIND_ROLE: &str = "r";
pub const KIND_SESSION_USER: &str = "a";

/// The probe for a session whose client may have set the given custom settings. It runs with
/// the client's `search_path`, which the client controls: every function, operator and type
/// in it is schema-qualified, so nothing the client defines can answer in its place.
pub fn sql(custom_settings: &[String]) -> String {
    let count = |from: &str| format!("(SELECT pg_catalog.count(*) FROM pg_catalog.{from})");
    // Every kind of object the session's temporary schema can hold: types and operators
    // there shadow the permanent ones for whoever uses the server next.
    let temporary = [
        ("pg_class", "relnamespace"),
        ("pg_proc", "pronamespace"),
        ("pg_type", "typnamespace"),
        ("pg_operator", "oprnamespace"),
        ("pg_collation", "collnamespace"),
        ("pg_conversion", "connamespace"),
        ("pg_opclass", "opcnamespace"),
        ("pg_opfamily", "opfnamespace"),
        ("pg_ts_config", "cfgnamespace"),
        ("pg_ts_dict", "dictnamespace"),
        ("pg_ts_parser", "prsnamespace"),
        ("pg_ts_template", "tmplnamespace"),
        ("pg_statistic_ext", "stxnamespace"),
    ]
    .map(|(catalog, namespace)| {
        count(&format!(
            "{catalog} WHERE {namespace} OPERATOR(pg_catalog.=) pg_catalog.pg_my_temp_schema()"
        ))
    });
    let objects = [
        temporary.join(" OPERATOR(pg_catalog.+) "),
        count(
            "pg_locks WHERE locktype OPERATOR(pg_catalog.=) 'advisory' \
             AND pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()",
        ),
        count("pg_listening_channels()"),
        count("pg_cursors WHERE is_holdable"),
        count("pg_prepared_statements WHERE from_sql"),
        count(
            "pg_replication_slots WHERE temporary \
             AND active_pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()",
        ),
    ];
    let mut sql = format!(
        "SELECT 'o', NULL, ({})::pg_catalog.text \
         UNION ALL SELECT 'r', NULL, current_user::pg_catalog.text \
           WHERE current_user OPERATOR(pg_catalog.<>) session_user \
         UNION ALL SELECT 'a', NULL, session_user::pg_catalog.text \
         UNION ALL SELECT 's', name, setting FROM pg_catalog.pg_settings \
           WHERE source OPERATOR(pg_catalog.=) 'session'",
        objects.join(" OPERATOR(pg_catalog.+) ")
    );
    if !custom_settings.is_empty() {
        let names: Vec<String> = custom_settings
            .iter()
            .map(|n| format!("({})", quote_literal(n)))
            .collect();
        sql.push_str(&format!(
            " UNION ALL SELECT 'c', n, pg_catalog.current_setting(n, true) FROM (VALUES {}) v(n)",
            names.join(", ")
        ));
    }
    sql
}

/// What the probe found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Findings {
    /// Objects that live in the session.
    pub objects: u64,
    /// The statements that recreate the session's settings, by setting name, sorted.
    pub settings: Vec<(String, String)>,
}

/// Reads the probe's rows. `login_user` is the user the server connection logged in as.
pub fn read(rows: &[Row], login_user: &str) -> Findings {
    let mut findings = Findings::default();
    for (kind, name, value) in rows {
        match (kind.as_str(), name, value) {
            (KIND_OBJECTS, _, Some(count)) => findings.objects = count.parse().unwrap_or(1),
            (KIND_ROLE, _, Some(role)) => findings
                .settings
                .push(("role".into(), format!("SET ROLE {}", quote_ident(role)))),
            (KIND_SESSION_USER, _, Some(user)) if user != login_user => findings.settings.push((
                "session_authorization".into(),
                format!("SET SESSION AUTHORIZATION {}", quote_ident(user)),
            )),
            (KIND_SETTING | KIND_CUSTOM, Some(name), Some(value)) => findings
                .settings
                .push((name.to_lowercase(), set_config_sql(name, value))),
            _ => {}
        }
    }
    findings.settings.sort();
    findings.settings.dedup_by(|a, b| a.0 == b.0);
    findings
}

impl Findings {
    /// The client's settings as the server now has them: they replace what pgherd had
    /// recorded, which no longer holds after what ran.
    pub fn as_changes(&self) -> Vec<Change> {
        let mut changes = vec![Change::ResetAll];
        changes.extend(self.settings.iter().map(|(name, sql)| Change::Set {
            name: name.clone(),
            sql: sql.clone(),
        }));
        changes
    }
}

/// `set_config` reads a value as the server's configuration file would (a list for
/// `search_path`), which `SET name TO 'value'` does not.
pub fn set_config_sql(name: &str, value: &str) -> String {
    [
        "SELECT pg_catalog.set_config(",
        &quote_literal(name),
        ", ",
        &quote_literal(value),
        ", false)",
    ]
    .concat()
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(kind: &str, name: Option<&str>, value: Option<&str>) -> Row {
        (kind.into(), name.map(Into::into), value.map(Into::into))
    }

    #[test]
    fn findings_from_rows() {
        let rows = [
            row("o", None, Some("2")),
            row("a", None, Some("app")),
            row("s", Some("search_path"), Some("tenant_7, public")),
            row("s", Some("statement_timeout"), Some("1234")),
            row("c", Some("app.tenant_id"), Some("42")),
            row("c", Some("app.unset"), None),
        ];
        let f = read(&rows, "app");
        assert_eq!(f.objects, 2);
        assert_eq!(
            f.settings,
            [
                (
                    "app.tenant_id".into(),
                    "SELECT pg_catalog.set_config('app.tenant_id', '42', false)".into()
                ),
                (
                    "search_path".into(),
                    "SELECT pg_catalog.set_config('search_path', 'tenant_7, public', false)".into()
                ),
                (
                    "statement_timeout".into(),
                    "SELECT pg_catalog.set_config('statement_timeout', '1234', false)".into()
                ),
            ]
        );
        assert_eq!(f.as_changes().first(), Some(&Change::ResetAll));
    }

    #[test]
    fn roles_become_settings() {
        let f = read(
            &[
                row("r", None, Some("reader")),
                row("a", None, Some("boss\"x")),
            ],
            "app",
        );
        assert_eq!(
            f.settings,
            [
                ("role".into(), "SET ROLE \"reader\"".into()),
                (
                    "session_authorization".into(),
                    "SET SESSION AUTHORIZATION \"boss\"\"x\"".into()
                ),
            ]
        );
    }

    /// The client controls the probe's search_path: nothing in it may resolve through it.
    #[test]
    fn probe_names_every_function_and_operator_with_its_schema() {
        let sql = sql(&["app.x".into()]);
        for unqualified in [
            " count(",
            "(count(",
            " = ",
            " + ",
            " <> ",
            "::text",
            " current_setting(",
        ] {
            assert!(!sql.contains(unqualified), "{unqualified:?} in {sql}");
        }
        let words: Vec<&str> = sql
            .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.'))
            .filter(|w| w.starts_with("pg_") && !w.starts_with("pg_catalog"))
            .collect();
        assert!(words.is_empty(), "unqualified catalog names: {words:?}");
    }

    #[test]
    fn probe_asks_for_custom_settings_quoted() {
        let sql = sql(&["app.x".into(), "it's.y".into()]);
        assert!(sql.contains("(VALUES ('app.x'), ('it''s.y'))"), "{sql}");
        assert!(!super::sql(&[]).contains("VALUES"));
    }
}
