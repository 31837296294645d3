//! What pgherd knows of one database's functions and relations, built from rows the proxy
//! reads from the primary's catalog: which functions are volatile or user-defined, which
//! relations a standby cannot read (unlogged, temporary), which may run user code when
//! touched (triggers, rules, row-level security, defaults, checks or index expressions that
//! call user functions, and what reaches such relations through views, partitions or
//! cascading foreign keys), and which draw from sequences when written.
//!
//! Pure: rows in, a snapshot out. The closure over views, partitions and foreign keys is
//! computed here so it can be tested with data.

use std::collections::{HashMap, HashSet};

use crate::merge_rows::TextRules;

/// What the classifier asks of a database.
pub trait Catalog {
    /// A function by its lower-case, unqualified name (all overloads, all schemas); `None`
    /// when no function of that name is known.
    fn function(&self, name: &str) -> Option<FunctionInfo>;
    /// A relation by its unqualified name (all schemas); `None` when none is known.
    fn relation(&self, name: &str) -> Option<RelationInfo>;
    /// The text names a type whose cast or domain check runs user code, or uses an operator
    /// implemented by user code (an over-approximation: words in strings and comments count).
    fn mentions_user_code(&self, _text: &str) -> bool {
        false
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FunctionInfo {
    /// Some overload is VOLATILE.
    pub volatile: bool,
    /// Some overload is user code: written in SQL or a procedural language, not built in
    /// (C functions of extensions count as built in, but for a known list of those that
    /// change session state).
    pub user_defined: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RelationInfo {
    /// Some relation of that name is unlogged or temporary: a hot standby refuses to read it.
    pub standby_unreadable: bool,
    /// Touching it may run user code, which may change session state.
    pub runs_user_code: bool,
    /// Writing it may draw from a sequence (serial or identity columns, `nextval` defaults),
    /// which sets the session's `currval` and `lastval`.
    pub draws_sequences: bool,
}

/// One relation row: its oid, name and own facts, before the closure.
#[derive(Debug, Clone)]
pub struct RelationRow {
    pub oid: u32,
    pub name: String,
    pub persistence: Persistence,
    pub runs_user_code: bool,
    pub draws_sequences: bool,
    /// An ordinary or partitioned table of the user's (not a system catalog, view, foreign
    /// table or materialized view), permanent, without row-level security: every change to
    /// it is decoded from the WAL and its rows are the same for every session.
    pub cache_safe: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Persistence {
    Permanent,
    Unlogged,
    Temporary,
}

impl Persistence {
    /// `pg_class.relpersistence`.
    pub fn from_code(code: &str) -> Persistence {
        match code {
            "u" => Persistence::Unlogged,
            "t" => Persistence::Temporary,
            _ => Persistence::Permanent,
        }
    }
}

/// A loaded catalog.
#[derive(Debug, Default)]
pub struct Snapshot {
    functions: HashMap<String, FunctionInfo>,
    relations: HashMap<String, RelationInfo>,
    /// Custom settings (`app.tenant_id`) user functions set: the ones a session-state probe
    /// asks about, as PostgreSQL lists no placeholder settings.
    custom_settings: Vec<String>,
    /// Lower-case names of types whose casts or domain checks run user code.
    code_types: HashSet<String>,
    /// Operators implemented by user code.
    code_operators: Vec<String>,
    /// Relation name → its columns whose default may differ from one evaluation to the next
    /// (anything but a constant: `now()`, a sequence, an identity).
    varying_defaults: HashMap<String, Vec<String>>,
    /// Names of views, materialized views and foreign tables.
    not_tables: HashSet<String>,
    /// Relation name → the tables whose changes change what reading it returns (itself and
    /// its partitions or inheritance children), or `None` when some relation of that name,
    /// or one of those tables, is not `cache_safe`.
    cache_sources: HashMap<String, Option<Vec<String>>>,
    /// How a fan-out's merge orders and groups text (a sharded endpoint's only).
    text_rules: TextRules,
}

impl Catalog for Snapshot {
    fn function(&self, name: &str) -> Option<FunctionInfo> {
        self.functions.get(name).copied()
    }

    fn relation(&self, name: &str) -> Option<RelationInfo> {
        self.relations.get(name).copied()
    }

    fn mentions_user_code(&self, text: &str) -> bool {
        if !self.code_types.is_empty() {
            let lower = text.to_ascii_lowercase();
            let mut words = lower
                .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$'))
                .filter(|w| !w.is_empty());
            if words.any(|w| self.code_types.contains(w)) {
                return true;
            }
        }
        self.code_operators
            .iter()
            .any(|op| text.contains(op.as_str()))
    }
}

impl Snapshot {
    /// Whether every decision made under `earlier` holds under this snapshot too: the same
    /// facts about functions, relations, settings, user code and defaults. Most catalog
    /// readings find nothing new, and forgetting every decision then would parse every
    /// statement shape again on the data path, once a minute. How text orders
    /// (`text_rules`) is left out: no decision depends on it, a fan-out reads it from the
    /// snapshot each time.
    pub fn decides_as(&self, earlier: &Snapshot) -> bool {
        self.functions == earlier.functions
            && self.relations == earlier.relations
            && self.custom_settings == earlier.custom_settings
            && self.code_types == earlier.code_types
            && self.code_operators == earlier.code_operators
            && self.varying_defaults == earlier.varying_defaults
            && self.not_tables == earlier.not_tables
            && self.cache_sources == earlier.cache_sources
    }

    /// How a fan-out's merge orders and groups text.
    pub fn text_rules(&self) -> &TextRules {
        &self.text_rules
    }

    pub fn function_count(&self) -> usize {
        self.functions.len()
    }

    pub fn relation_count(&self) -> usize {
        self.relations.len()
    }

    pub fn custom_settings(&self) -> &[String] {
        &self.custom_settings
    }

    /// Whether some relation named `name` is not an ordinary or partitioned table (a view,
    /// a materialized view, a foreign table).
    pub fn is_table(&self, name: &str) -> bool {
        !self.not_tables.contains(name)
    }

    /// What reading relation `name` depends on for the result cache: `None` if no relation
    /// of that name is known, `Some(None)` if it may not be cached, else the tables whose
    /// changes must drop an answer that read it.
    pub fn cache_sources(&self, name: &str) -> Option<Option<&[String]>> {
        self.cache_sources.get(name).map(Option::as_deref)
    }

    /// The columns of relation `name` whose default is not a constant.
    pub fn varying_defaults(&self, name: &str) -> &[String] {
        self.varying_defaults.get(name).map_or(&[], Vec::as_slice)
    }
}

/// Whether a column default (as `pg_get_expr` writes it) is a constant: literals and casts
/// only. Anything else (a function, `CURRENT_TIMESTAMP`, an operator, a subquery) may give
/// another value each time, or on another server.
pub fn is_constant_default(expression: &str) -> bool {
    let Ok(parsed) = pg_query::parse(&format!("SELECT {expression}")) else {
        return false;
    };
    let nodes = parsed.protobuf.nodes();
    // A cast of a cast (`('now'::text)::timestamptz`) is evaluated at each use.
    let casts = nodes
        .iter()
        .filter(|(n, ..)| matches!(n, pg_query::NodeRef::TypeCast(_)))
        .count();
    let time_word = nodes.iter().any(|(n, ..)| match n {
        pg_query::NodeRef::AConst(c) => matches!(&c.val,
            Some(pg_query::protobuf::a_const::Val::Sval(s))
                if crate::shard_route::is_date_time_word(&s.sval)),
        _ => false,
    });
    // The library's walk skips some places: the serialized tree is searched as well.
    let computes = parsed.protobuf.stmts.iter().any(|raw| {
        raw.stmt.as_deref().is_none_or(|stmt| {
            crate::tree::any_node(stmt, |key, _| {
                matches!(
                    key,
                    "FuncCall"
                        | "SqlvalueFunction"
                        | "ColumnRef"
                        | "SubLink"
                        | "AExpr"
                        | "BoolExpr"
                        | "CaseExpr"
                        | "CoalesceExpr"
                        | "MinMaxExpr"
                        | "RowExpr"
                        | "AArrayExpr"
                        | "ParamRef"
                        | "NextValueExpr"
                        | "XmlExpr"
                )
            })
        })
    });
    if casts > 1 || time_word || computes {
        return false;
    }
    nodes.into_iter().all(|(node, ..)| {
        matches!(
            node,
            pg_query::NodeRef::SelectStmt(_)
                | pg_query::NodeRef::ResTarget(_)
                | pg_query::NodeRef::AConst(_)
                | pg_query::NodeRef::TypeCast(_)
                | pg_query::NodeRef::TypeName(_)
                | pg_query::NodeRef::String(_)
                | pg_query::NodeRef::Integer(_)
                | pg_query::NodeRef::Float(_)
                | pg_query::NodeRef::Boolean(_)
                | pg_query::NodeRef::BitString(_)
                | pg_query::NodeRef::List(_)
        )
    })
}

/// Builds a [`Snapshot`] from catalog rows.
#[derive(Debug, Default)]
pub struct SnapshotBuilder {
    functions: HashMap<String, FunctionInfo>,
    relations: Vec<RelationRow>,
    /// (from, to): touching `from` may touch `to` (a view and what it reads, a partitioned
    /// table and its partitions, a referenced table and the tables its deletes cascade to).
    reaches: Vec<(u32, u32)>,
    /// (parent, child) of partitioning or inheritance: reading the parent reads the child.
    children: Vec<(u32, u32)>,
    custom_settings: HashSet<String>,
    code_types: HashSet<String>,
    code_operators: Vec<String>,
    varying_defaults: HashMap<String, Vec<String>>,
    not_tables: HashSet<String>,
    text_rules: TextRules,
}

impl SnapshotBuilder {
    /// How the database's text orders and groups, for a fan-out's merge.
    pub fn text_rules(&mut self, rules: TextRules) {
        self.text_rules = rules;
    }

    /// A view, materialized view or foreign table.
    pub fn not_a_table(&mut self, name: &str) {
        self.not_tables.insert(name.to_owned());
    }

    /// A column with a default (`expression` as `pg_get_expr` writes it; `None`: an identity
    /// column).
    pub fn column_default(&mut self, relation: &str, column: &str, expression: Option<&str>) {
        if !expression.is_some_and(is_constant_default) {
            self.varying_defaults
                .entry(relation.to_owned())
                .or_default()
                .push(column.to_owned());
        }
    }

    /// One function row: name, volatility, whether it is user code. Overloads of a name
    /// are combined.
    pub fn function(&mut self, name: &str, volatile: bool, user_defined: bool) {
        let info = self.functions.entry(name.to_lowercase()).or_default();
        info.volatile |= volatile;
        info.user_defined |= user_defined;
    }

    /// A user function's body, searched for the custom settings it sets.
    pub fn function_source(&mut self, source: &str) {
        self.custom_settings.extend(custom_settings_set_in(source));
    }

    pub fn relation(&mut self, row: RelationRow) {
        self.relations.push(row);
    }

    pub fn reaches(&mut self, from: u32, to: u32) {
        self.reaches.push((from, to));
    }

    /// A partition or inheritance child (which [`Self::reaches`] must be told of too).
    pub fn child(&mut self, parent: u32, child: u32) {
        self.children.push((parent, child));
    }

    /// A type whose cast or domain check runs user code.
    pub fn code_type(&mut self, name: &str) {
        self.code_types.insert(name.to_lowercase());
    }

    /// An operator implemented by user code.
    pub fn code_operator(&mut self, name: &str) {
        if !self.code_operators.iter().any(|o| o == name) {
            self.code_operators.push(name.to_owned());
        }
    }

    pub fn build(self) -> Snapshot {
        let mut code: HashSet<u32> = self
            .relations
            .iter()
            .filter(|r| r.runs_user_code)
            .map(|r| r.oid)
            .collect();
        let mut sequences: HashSet<u32> = self
            .relations
            .iter()
            .filter(|r| r.draws_sequences)
            .map(|r| r.oid)
            .collect();
        // Fixed point: whatever reaches a relation with a property has it too.
        loop {
            let mut changed = false;
            for &(from, to) in &self.reaches {
                if code.contains(&to) && code.insert(from) {
                    changed = true;
                }
                if sequences.contains(&to) && sequences.insert(from) {
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        let mut relations: HashMap<String, RelationInfo> = HashMap::new();
        for row in &self.relations {
            let info = relations.entry(row.name.clone()).or_default();
            info.standby_unreadable |= row.persistence != Persistence::Permanent;
            info.runs_user_code |= code.contains(&row.oid);
            info.draws_sequences |= sequences.contains(&row.oid);
        }
        let cache_sources = self.cache_sources();
        let mut custom_settings: Vec<String> = self.custom_settings.into_iter().collect();
        custom_settings.sort();
        // In a fixed order, as the lists below: two readings of the same catalog compare equal.
        let mut code_operators = self.code_operators;
        code_operators.sort();
        let mut varying_defaults = self.varying_defaults;
        for columns in varying_defaults.values_mut() {
            columns.sort();
        }
        Snapshot {
            functions: self.functions,
            relations,
            custom_settings,
            code_types: self.code_types,
            code_operators,
            varying_defaults,
            not_tables: self.not_tables,
            cache_sources,
            text_rules: self.text_rules,
        }
    }

    /// Each name's tables for the result cache: the relations of that name and everything
    /// under them by partitioning or inheritance, all of which must be `cache_safe`.
    fn cache_sources(&self) -> HashMap<String, Option<Vec<String>>> {
        let by_oid: HashMap<u32, &RelationRow> =
            self.relations.iter().map(|r| (r.oid, r)).collect();
        let mut children_of: HashMap<u32, Vec<u32>> = HashMap::new();
        for &(parent, child) in &self.children {
            children_of.entry(parent).or_default().push(child);
        }
        let mut sources: HashMap<String, Option<Vec<String>>> = HashMap::new();
        for row in &self.relations {
            let mut tables = Vec::new();
            let mut safe = true;
            let mut stack = vec![row.oid];
            let mut seen = HashSet::new();
            while let Some(oid) = stack.pop() {
                if !seen.insert(oid) {
                    continue;
                }
                match by_oid.get(&oid) {
                    Some(r) if r.cache_safe && r.persistence == Persistence::Permanent => {
                        tables.push(r.name.clone())
                    }
                    _ => safe = false,
                }
                stack.extend(children_of.get(&oid).into_iter().flatten());
            }
            let entry = sources.entry(row.name.clone()).or_insert(Some(Vec::new()));
            match (entry.as_mut(), safe) {
                (Some(all), true) => {
                    all.extend(tables);
                    all.sort();
                    all.dedup();
                }
                _ => *entry = None,
            }
        }
        sources
    }
}

/// The custom setting names (with a dot) a function body sets with `set_config('name', ...)`
/// or `SET [SESSION] name`: an over-approximation is harmless, it only makes a probe ask
/// about one more setting.
pub fn custom_settings_set_in(source: &str) -> Vec<String> {
    let lower = source.to_ascii_lowercase();
    let mut names: Vec<String> = literal_first_arguments(&lower, "set_config")
        .into_iter()
        .flatten()
        .filter(|name| is_custom_setting(name))
        .collect();
    for line in lower.split([';', '\n']) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let name = match words.as_slice() {
            ["set", "session", name, ..] | ["set", name, ..] => *name,
            _ => continue,
        };
        let name = name.split(['=', ' ']).next().unwrap_or_default();
        if is_custom_setting(name) {
            names.push(name.to_owned());
        }
    }
    names
}

/// For every place `function` followed by `(` appears in `text` (lower-case), its first
/// argument if that is a plain string literal, else `None`. Text search, so it may find more
/// places than there are calls (in comments, in longer names), never fewer.
pub fn literal_first_arguments(text: &str, function: &str) -> Vec<Option<String>> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(function) {
        rest = &rest[i + function.len()..];
        let Some(after) = rest.trim_start().strip_prefix('(') else {
            continue;
        };
        let literal = after
            .trim_start()
            .strip_prefix('\'')
            .and_then(|a| a.split_once('\''))
            .map(|(name, _)| name.to_owned());
        found.push(literal);
    }
    found
}

/// `prefix.name`, as PostgreSQL accepts placeholder settings.
pub fn is_custom_setting(name: &str) -> bool {
    let mut parts = name.split('.');
    let (Some(a), Some(b)) = (parts.next(), parts.next()) else {
        return false;
    };
    let word = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'$')
    };
    word(a) && word(b) && parts.all(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(oid: u32, name: &str) -> RelationRow {
        RelationRow {
            oid,
            name: name.into(),
            persistence: Persistence::Permanent,
            runs_user_code: false,
            draws_sequences: false,
            cache_safe: true,
        }
    }

    /// One catalog's rows, in the order given: what two readings of it may return.
    fn reading(order: &[usize], volatile_now: bool, rules: TextRules) -> Snapshot {
        let mut b = SnapshotBuilder::default();
        let rows: [&dyn Fn(&mut SnapshotBuilder); 5] = [
            &|b| b.function("now", volatile_now, false),
            &|b| b.code_operator("===="),
            &|b| b.code_operator("@@@"),
            &|b| b.column_default("orders", "id", None),
            &|b| b.column_default("orders", "placed_at", Some("now()")),
        ];
        for &i in order {
            rows[i](&mut b);
        }
        b.relation(row(1, "orders"));
        b.text_rules(rules);
        b.build()
    }

    #[test]
    fn a_reading_that_finds_the_same_facts_keeps_decisions() {
        let first = reading(&[0, 1, 2, 3, 4], true, TextRules::bytewise());
        // The same rows in another order, and another collation rule (no decision reads it).
        let again = reading(&[4, 3, 2, 1, 0], true, TextRules::unknown("not asked"));
        assert!(again.decides_as(&first));
        // A function that became stable changes where statements calling it may run.
        assert!(!reading(&[0, 1, 2, 3, 4], false, TextRules::bytewise()).decides_as(&first));
        // The functions, operators and defaults gone; one operator gone.
        let mut b = SnapshotBuilder::default();
        b.relation(row(1, "orders"));
        assert!(!b.build().decides_as(&first));
        assert!(!reading(&[0, 1, 3, 4], true, TextRules::bytewise()).decides_as(&first));
    }

    #[test]
    fn user_code_and_sequences_reach_through_views_partitions_and_cascades() {
        let mut b = SnapshotBuilder::default();
        b.relation(RelationRow {
            runs_user_code: true,
            ..row(1, "audited")
        });
        b.relation(row(2, "audited_view"));
        b.relation(row(3, "view_of_view"));
        b.relation(RelationRow {
            draws_sequences: true,
            ..row(4, "orders_2026")
        });
        b.relation(row(5, "orders"));
        b.relation(row(6, "plain"));
        b.relation(RelationRow {
            persistence: Persistence::Unlogged,
            ..row(7, "staging")
        });
        b.relation(row(8, "customers"));
        b.reaches(2, 1);
        b.reaches(3, 2);
        b.reaches(5, 4);
        // Deleting a customer cascades to the audited table.
        b.reaches(8, 1);
        let s = b.build();
        let r = |n: &str| s.relation(n).unwrap();
        assert!(r("audited").runs_user_code);
        assert!(r("audited_view").runs_user_code);
        assert!(r("view_of_view").runs_user_code);
        assert!(r("customers").runs_user_code);
        assert!(r("orders").draws_sequences && !r("orders").runs_user_code);
        assert_eq!(r("plain"), RelationInfo::default());
        assert!(r("staging").standby_unreadable);
        assert!(s.relation("nosuch").is_none());
    }

    #[test]
    fn cache_sources_take_in_partitions_and_refuse_anything_unsafe_under_a_name() {
        let mut b = SnapshotBuilder::default();
        b.relation(row(1, "orders"));
        b.relation(row(2, "orders_2025"));
        b.relation(row(3, "orders_2026"));
        b.relation(row(4, "orders_2026_q1"));
        b.child(1, 2);
        b.child(1, 3);
        b.child(3, 4);
        b.relation(row(5, "logs"));
        b.relation(RelationRow {
            persistence: Persistence::Unlogged,
            ..row(6, "logs_hot")
        });
        b.child(5, 6);
        b.relation(RelationRow {
            cache_safe: false,
            ..row(7, "v")
        });
        b.relation(row(8, "t"));
        b.relation(RelationRow {
            cache_safe: false,
            ..row(9, "t")
        });
        b.relation(row(10, "plain"));
        let s = b.build();
        let names = |n: &str| s.cache_sources(n).map(|o| o.map(|v| v.join(",")));
        assert_eq!(
            names("orders"),
            Some(Some("orders,orders_2025,orders_2026,orders_2026_q1".into()))
        );
        assert_eq!(
            names("orders_2026"),
            Some(Some("orders_2026,orders_2026_q1".into()))
        );
        assert_eq!(names("plain"), Some(Some("plain".into())));
        assert_eq!(
            names("logs"),
            Some(None),
            "reading it reads an unsafe partition"
        );
        assert_eq!(names("v"), Some(None));
        assert_eq!(
            names("t"),
            Some(None),
            "one of the two relations named t is unsafe"
        );
        assert_eq!(names("nosuch"), None);
    }

    #[test]
    fn same_name_in_two_schemas_takes_the_stricter_facts() {
        let mut b = SnapshotBuilder::default();
        b.relation(row(1, "t"));
        b.relation(RelationRow {
            persistence: Persistence::Temporary,
            runs_user_code: true,
            ..row(2, "t")
        });
        let s = b.build();
        assert!(s.relation("t").unwrap().runs_user_code);
        assert!(s.relation("t").unwrap().standby_unreadable);
    }

    #[test]
    fn functions_combine_overloads() {
        let mut b = SnapshotBuilder::default();
        b.function("Lower", false, false);
        b.function("bump", false, true);
        b.function("bump", true, false);
        let s = b.build();
        assert_eq!(
            s.function("lower"),
            Some(FunctionInfo {
                volatile: false,
                user_defined: false
            })
        );
        assert_eq!(
            s.function("bump"),
            Some(FunctionInfo {
                volatile: true,
                user_defined: true
            })
        );
    }

    #[test]
    fn types_and_operators_that_run_user_code_are_noticed() {
        let mut b = SnapshotBuilder::default();
        b.code_type("Checked_Domain");
        b.code_operator("===");
        let s = b.build();
        assert!(s.mentions_user_code("SELECT 'x'::checked_domain"));
        assert!(s.mentions_user_code("SELECT '1'::\"Checked_Domain\""));
        assert!(s.mentions_user_code("SELECT a === b FROM t"));
        assert!(s.mentions_user_code("SELECT a OPERATOR(public.===) b"));
        assert!(!s.mentions_user_code("SELECT checked, domain, a == b FROM t"));
    }

    #[test]
    fn custom_settings_found_in_function_bodies() {
        let body = "BEGIN PERFORM set_config('app.tenant_id', t::text, false);\n\
                    PERFORM SET_CONFIG( 'App.Role' , 'x', true);\n\
                    SET app.mode = 'strict';\n SET SESSION my.flag TO on;\n\
                    PERFORM set_config(name, 'x', false); SET work_mem = '1MB'; END";
        let mut names = custom_settings_set_in(body);
        names.sort();
        assert_eq!(names, ["app.mode", "app.role", "app.tenant_id", "my.flag"]);
        assert!(is_custom_setting("a.b.c"));
        assert!(!is_custom_setting("work_mem"));
        assert!(!is_custom_setting("a."));
    }
}
