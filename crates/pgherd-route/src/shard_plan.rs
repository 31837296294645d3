//! Which shards a statement needs, from its tree and the sharding map, without IO: the key
//! routing of sharding. A statement on one sharded table whose `WHERE` pins the key (`=`,
//! `IN`, `AND`, `OR` of those, with literals or bind parameters) runs on the shards those keys
//! live on; without such a predicate it runs on all of them (a fan-out, merged elsewhere).
//! An `INSERT ... VALUES` gives each row's key, so the rows can be split per shard. Bind
//! parameters stay symbolic in the plan ([`KeySource::Param`]) and are resolved when their
//! values are known ([`Restriction::shards`], [`ShardPlan::row_shards`]), so a prepared
//! statement is planned once.
//!
//! What cannot be planned exactly is refused ([`Unsupported`], SQLSTATE `0A000`) naming the
//! construct: never a statement sent to too few shards.

use std::collections::{BTreeMap, BTreeSet};

use pg_query::protobuf::{
    a_const, node::Node as NodeEnum, AExprKind, BoolExprType, JoinType, RangeVar,
};
use pgherd_wire::SqlState;

use crate::shard_hash::{self, KeyError, KeyType};
use crate::tree;

/// How a sharded table's rows are spread over the shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Method {
    /// As `PARTITION BY HASH` with one partition per shard ([`shard_hash`]).
    Hash,
    /// Shard `i` holds integer keys from `starts[i]` up to `starts[i + 1]` (excluded); the last
    /// shard has no upper end, and keys below `starts[0]` have no shard.
    Range { starts: Vec<i64> },
    /// Shard `i` holds the keys listed in `values[i]` (in their text form).
    List { values: Vec<Vec<String>> },
}

impl Method {
    /// As the config names it.
    pub fn name(&self) -> &'static str {
        match self {
            Method::Hash => "hash",
            Method::Range { .. } => "range",
            Method::List { .. } => "list",
        }
    }
}

/// A table whose rows are spread over the shards by one key column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedTable {
    pub key_column: String,
    pub key_type: KeyType,
    pub method: Method,
    /// The key column's position among the table's columns (from the catalog), for an
    /// `INSERT` without a column list; `None` until known.
    pub key_ordinal: Option<usize>,
}

/// Why a key has no shard.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("no value was bound for parameter ${0}")]
    Unbound(usize),
    #[error("no shard of table {table} holds key {key}")]
    NoShard { table: String, key: String },
    /// A key bound as a parameter whose type is not the key's own (or, in binary, unknown):
    /// pgherd cannot tell which key the server will compare it as.
    #[error("not supported on sharded tables: a key of type {key_type} bound as parameter ${param} of type {}", type_name(*.type_oid))]
    ParamType {
        param: usize,
        key_type: &'static str,
        type_oid: u32,
    },
}

/// A parameter type's name, for errors (its OID when pgherd does not know it).
fn type_name(oid: u32) -> String {
    match oid {
        0 => "unknown (in binary)".to_owned(),
        16 => "boolean".to_owned(),
        700 => "real".to_owned(),
        701 => "double precision".to_owned(),
        1042 => "character".to_owned(),
        1700 => "numeric".to_owned(),
        _ => format!("OID {oid}"),
    }
}

impl ResolveError {
    pub fn sqlstate(&self) -> SqlState {
        match self {
            ResolveError::Key(e) => e.sqlstate(),
            ResolveError::Unbound(_) => SqlState::PROTOCOL_VIOLATION,
            ResolveError::ParamType { .. } => SqlState::FEATURE_NOT_SUPPORTED,
            // As PostgreSQL says when no partition takes a row.
            ResolveError::NoShard { .. } => SqlState::CHECK_VIOLATION,
        }
    }
}

impl ShardedTable {
    /// The shard holding `key` (its text form); `None` when no shard does (outside the ranges
    /// or lists).
    pub fn shard_of(&self, shards: u32, key: &str) -> Result<Option<u32>, KeyError> {
        match &self.method {
            Method::Hash => shard_hash::shard_of_text(self.key_type, key, shards).map(Some),
            Method::Range { starts } => {
                let key = shard_hash::parse_int(self.key_type, key)?;
                let holding = starts.iter().take_while(|&&start| start <= key).count();
                Ok(holding.checked_sub(1).map(|i| i as u32))
            }
            Method::List { values } => {
                let key = self.canonical(key)?;
                Ok(values
                    .iter()
                    .position(|listed| {
                        listed
                            .iter()
                            .any(|v| self.canonical(v).as_ref() == Ok(&key))
                    })
                    .map(|i| i as u32))
            }
        }
    }

    /// A key in the form equal keys share (`007` and `7` are one integer).
    fn canonical(&self, key: &str) -> Result<String, KeyError> {
        Ok(match self.key_type {
            KeyType::Int2 | KeyType::Int4 | KeyType::Int8 => {
                shard_hash::parse_int(self.key_type, key)?.to_string()
            }
            KeyType::Uuid => shard_hash::parse_uuid(key)?
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            KeyType::Text => key.to_owned(),
        })
    }
}

/// The sharded tables, by name (as written in statements, optionally schema-qualified).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardMap {
    pub shards: u32,
    pub tables: BTreeMap<String, ShardedTable>,
}

impl ShardMap {
    /// The sharded table a relation in a statement names, if any.
    pub(crate) fn table(&self, relation: &RangeVar) -> Option<(&str, &ShardedTable)> {
        self.lookup(&relation.schemaname, &relation.relname)
    }

    /// A table named `name` in `schema` (empty: as the search path finds it) is the sharded
    /// table configured as `schema.name`, or as bare `name` for schema `public`.
    fn lookup(&self, schema: &str, name: &str) -> Option<(&str, &ShardedTable)> {
        self.tables
            .iter()
            .find(|(configured, _)| {
                let (configured_schema, bare) = configured
                    .rsplit_once('.')
                    .unwrap_or(("public", configured));
                bare == name && (schema.is_empty() || schema == configured_schema)
            })
            .map(|(configured, table)| (configured.as_str(), table))
    }
}

/// Where a key value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A literal, in its text form.
    Literal(String),
    /// Bind parameter `$n`.
    Param(usize),
    /// A NULL literal: no row has a NULL key equal to anything.
    Null,
}

/// The keys a statement's rows may have, as its `WHERE` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restriction {
    /// Any key: every shard.
    All,
    AnyOf(Vec<KeySource>),
    And(Vec<Restriction>),
    Or(Vec<Restriction>),
}

impl Restriction {
    /// The shards the rows may be on, with the bind parameters' values (text form; `None`
    /// for NULL). Empty: no row can match (any one shard answers that).
    pub fn shards(
        &self,
        table: &ShardedTable,
        shards: u32,
        params: &[BoundParam],
    ) -> Result<BTreeSet<u32>, ResolveError> {
        Ok(match self {
            Restriction::All => (0..shards).collect(),
            Restriction::AnyOf(keys) => {
                let mut set = BTreeSet::new();
                for key in keys {
                    let text = match key_text(key, params, table.key_type) {
                        Ok(Some(text)) => text,
                        Ok(None) => continue,
                        Err(ResolveError::ParamType { .. }) => return Ok((0..shards).collect()),
                        Err(e) => return Err(e),
                    };
                    match table.shard_of(shards, &text) {
                        Ok(shard) => set.extend(shard),
                        // A parameter of another type may equal any key: every shard.
                        // A literal beyond the key type's range equals no key (PostgreSQL
                        // compares it in the wider type); a parameter takes the key's type,
                        // and PostgreSQL refuses it as this does.
                        Err(KeyError::OutOfRange(..)) if matches!(key, KeySource::Literal(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                set
            }
            Restriction::And(parts) => {
                let mut set: BTreeSet<u32> = (0..shards).collect();
                for part in parts {
                    let allowed = part.shards(table, shards, params)?;
                    set.retain(|shard| allowed.contains(shard));
                }
                set
            }
            Restriction::Or(parts) => {
                let mut set = BTreeSet::new();
                for part in parts {
                    set.extend(part.shards(table, shards, params)?);
                }
                set
            }
        })
    }
}

/// A bind parameter's value as the client sent it (`value` `None`: NULL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundParam<'a> {
    pub value: Option<&'a [u8]>,
    /// Binary format (else text).
    pub binary: bool,
    /// Its type, as the client declared it or a shard described it (0: unknown, which the
    /// server infers: for a key compared or inserted as is, the key's type).
    pub type_oid: u32,
}

impl<'a> BoundParam<'a> {
    /// A parameter in text format, its type left to the server.
    pub fn text(value: Option<&'a str>) -> BoundParam<'a> {
        BoundParam {
            value: value.map(str::as_bytes),
            binary: false,
            type_oid: 0,
        }
    }
}

/// The parameter types a key of `key_type` is read as itself: values of other types compare
/// across types (`int = numeric`, `text = bpchar`), which the key's hash does not follow.
fn same_type_family(key_type: KeyType, type_oid: u32) -> bool {
    const INT2: u32 = 21;
    const INT4: u32 = 23;
    const INT8: u32 = 20;
    const TEXT: u32 = 25;
    const VARCHAR: u32 = 1043;
    const UUID: u32 = 2950;
    match key_type {
        KeyType::Int2 | KeyType::Int4 | KeyType::Int8 => matches!(type_oid, INT2 | INT4 | INT8),
        KeyType::Text => matches!(type_oid, TEXT | VARCHAR),
        KeyType::Uuid => type_oid == UUID,
    }
}

/// A key's text form (`None`: NULL), a parameter's read as the key type reads it.
fn key_text(
    key: &KeySource,
    params: &[BoundParam],
    key_type: KeyType,
) -> Result<Option<String>, ResolveError> {
    match key {
        KeySource::Literal(text) => Ok(Some(text.clone())),
        KeySource::Null => Ok(None),
        KeySource::Param(n) => {
            let param = params
                .get(n.wrapping_sub(1))
                .ok_or(ResolveError::Unbound(*n))?;
            // Text of an unknown type is read as the key's type, as the server reads it; binary
            // bytes only mean something in their own type.
            let known = param.type_oid != 0 || !param.binary;
            if !known || (param.type_oid != 0 && !same_type_family(key_type, param.type_oid)) {
                return Err(ResolveError::ParamType {
                    param: *n,
                    key_type: key_type.name(),
                    type_oid: param.type_oid,
                });
            }
            let Some(bytes) = param.value else {
                return Ok(None);
            };
            let text = if param.binary {
                shard_hash::binary_key_text(key_type, bytes)?
            } else {
                std::str::from_utf8(bytes)
                    .map_err(|_| {
                        KeyError::Syntax(
                            key_type.name(),
                            String::from_utf8_lossy(bytes).into_owned(),
                        )
                    })?
                    .to_owned()
            };
            Ok(Some(text))
        }
    }
}

/// Where a statement runs, as far as sharding goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardPlan {
    /// It touches no sharded table (reference tables, or none): a read runs on any one
    /// shard, a write on every shard.
    Unsharded,
    /// It reads or writes rows of one sharded table, on the shards its restriction allows.
    Table {
        table: String,
        restriction: Restriction,
    },
    /// `INSERT ... VALUES` into a sharded table: each row's key, in order.
    InsertRows { table: String, keys: Vec<KeySource> },
}

impl ShardPlan {
    /// Each row's shard, for an `INSERT`.
    pub fn row_shards(
        &self,
        map: &ShardMap,
        params: &[BoundParam],
    ) -> Result<Vec<u32>, ResolveError> {
        let ShardPlan::InsertRows { table, keys } = self else {
            return Ok(Vec::new());
        };
        let Some(sharded) = map.tables.get(table) else {
            return Ok(Vec::new());
        };
        keys.iter()
            .map(|key| {
                let text = key_text(key, params, sharded.key_type)?;
                map.shard_of_value(table, text.as_deref())
            })
            .collect()
    }
}

impl ShardMap {
    /// The shard of a row of sharded table `table` whose key is `key` (`None`: NULL).
    pub fn shard_of_value(&self, table: &str, key: Option<&str>) -> Result<u32, ResolveError> {
        let no_shard = |key: &str| ResolveError::NoShard {
            table: table.to_owned(),
            key: key.to_owned(),
        };
        let Some(sharded) = self.tables.get(table) else {
            return Err(no_shard(key.unwrap_or("NULL")));
        };
        let Some(text) = key else {
            // PostgreSQL hashes a row of NULL keys to 0: the partition of remainder 0. A
            // range or list has no place for it (PostgreSQL would need a default partition).
            return match sharded.method {
                Method::Hash => Ok(0),
                _ => Err(no_shard("NULL")),
            };
        };
        sharded
            .shard_of(self.shards, text)?
            .ok_or_else(|| no_shard(text))
    }
}

/// A statement shape sharding cannot run exactly (SQLSTATE `0A000`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not supported on sharded tables: {0}")]
pub struct Unsupported(pub String);

impl Unsupported {
    pub fn sqlstate(&self) -> SqlState {
        SqlState::FEATURE_NOT_SUPPORTED
    }
}

/// Plans one statement.
pub fn plan(statement: &NodeEnum, map: &ShardMap) -> Result<ShardPlan, Unsupported> {
    let mentions = sharded_mentions(statement, map);
    if mentions.is_empty() {
        return Ok(ShardPlan::Unsharded);
    }
    if writes_in_with(statement) {
        // Its write would run on the chosen shards only.
        return Err(unsupported(
            "a data-modifying WITH (INSERT, UPDATE or DELETE in a CTE) beside a sharded table",
        ));
    }
    let plan = match statement {
        NodeEnum::SelectStmt(select) => plan_select(select, map)?,
        NodeEnum::UpdateStmt(update) => {
            let (table, sharded_table) = target(update.relation.as_ref(), map, "UPDATE")?;
            if !update.from_clause.is_empty() {
                return Err(unsupported("UPDATE ... FROM"));
            }
            if sets_column(&update.target_list, &sharded_table.key_column) {
                return Err(unsupported(&format!(
                    "UPDATE of the shard key column {} of {table} (rows would move between shards)",
                    sharded_table.key_column
                )));
            }
            table_plan(
                table,
                sharded_table,
                update.relation.as_ref(),
                update.where_clause.as_deref(),
            )
        }
        NodeEnum::DeleteStmt(delete) => {
            let (table, sharded_table) = target(delete.relation.as_ref(), map, "DELETE")?;
            if !delete.using_clause.is_empty() {
                return Err(unsupported("DELETE ... USING"));
            }
            table_plan(
                table,
                sharded_table,
                delete.relation.as_ref(),
                delete.where_clause.as_deref(),
            )
        }
        NodeEnum::InsertStmt(insert) => plan_insert(insert, map)?,
        _ => return Err(unsupported("this statement")),
    };
    // The planned table must be the only mention of a sharded table: another (a second
    // table, the same one again in a subquery or CTE) would be read on the planned shards
    // only.
    if mentions.len() > 1 {
        return Err(unsupported(&format!(
            "a statement naming sharded tables more than once ({}: a join, subquery or CTE across shards)",
            mentions.join(", ")
        )));
    }
    Ok(plan)
}

fn unsupported(what: &str) -> Unsupported {
    Unsupported(what.to_owned())
}

/// Whether the statement's WITH holds a CTE that writes (PostgreSQL allows them at the top
/// level only).
fn writes_in_with(statement: &NodeEnum) -> bool {
    let with = match statement {
        NodeEnum::SelectStmt(s) => s.with_clause.as_ref(),
        NodeEnum::InsertStmt(s) => s.with_clause.as_ref(),
        NodeEnum::UpdateStmt(s) => s.with_clause.as_ref(),
        NodeEnum::DeleteStmt(s) => s.with_clause.as_ref(),
        _ => None,
    };
    with.is_some_and(|with| {
        with.ctes.iter().any(|cte| match &cte.node {
            Some(NodeEnum::CommonTableExpr(cte)) => !matches!(
                cte.ctequery.as_ref().and_then(|q| q.node.as_ref()),
                Some(NodeEnum::SelectStmt(_))
            ),
            _ => true,
        })
    })
}

fn target<'m>(
    relation: Option<&RangeVar>,
    map: &'m ShardMap,
    verb: &str,
) -> Result<(&'m str, &'m ShardedTable), Unsupported> {
    relation
        .and_then(|r| map.table(r))
        .ok_or_else(|| unsupported(&format!("{verb} of another table reading a sharded one")))
}

/// The rows of `table` an UPDATE or DELETE of `relation` touches, by its WHERE.
fn table_plan(
    table: &str,
    sharded: &ShardedTable,
    relation: Option<&RangeVar>,
    where_clause: Option<&pg_query::protobuf::Node>,
) -> ShardPlan {
    ShardPlan::Table {
        table: table.to_owned(),
        restriction: restriction(where_clause, sharded, table, alias_of(relation)),
    }
}

fn sets_column(targets: &[pg_query::protobuf::Node], column: &str) -> bool {
    targets
        .iter()
        .any(|t| matches!(&t.node, Some(NodeEnum::ResTarget(r)) if r.name == column))
}

fn alias_of(relation: Option<&RangeVar>) -> Option<&str> {
    relation
        .and_then(|r| r.alias.as_ref())
        .map(|a| a.aliasname.as_str())
}

fn plan_select(
    select: &pg_query::protobuf::SelectStmt,
    map: &ShardMap,
) -> Result<ShardPlan, Unsupported> {
    if select.larg.is_some() || select.rarg.is_some() {
        return Err(unsupported(
            "UNION, INTERSECT or EXCEPT over a sharded table",
        ));
    }
    if select.into_clause.is_some() {
        return Err(unsupported("SELECT INTO from a sharded table"));
    }
    // The one sharded table among the FROM items; joins with reference tables keep the
    // sharded table's restriction from WHERE.
    let mut found = None;
    let mut relations = Vec::new();
    for item in &select.from_clause {
        from_relations(item.node.as_ref(), false, false, &mut relations);
    }
    for (relation, outer, renamed) in relations {
        if outer && map.table(relation).is_some() {
            // Every shard would return the other side's unmatched rows: duplicates.
            return Err(unsupported(&format!(
                "an outer join of sharded table {}",
                relation.relname
            )));
        }
        if let Some((name, table)) = map.table(relation) {
            if found.is_some() {
                return Err(unsupported(&format!(
                    "a join of sharded table {name} with itself or another sharded table"
                )));
            }
            found = Some((name, table, alias_of(Some(relation)), renamed));
        }
    }
    let Some((name, table, alias, renamed)) = found else {
        return Err(unsupported(
            "a sharded table outside the FROM list (a subquery or CTE)",
        ));
    };
    // Columns renamed by an alias list: the key's name may mean another column.
    let restriction = if renamed {
        Restriction::All
    } else {
        restriction(select.where_clause.as_deref(), table, name, alias)
    };
    Ok(ShardPlan::Table {
        table: name.to_owned(),
        restriction,
    })
}

/// The relations of a FROM item (a table, or the tables of a join), each with whether it is
/// under an outer join and whether an alias list renames its columns (its own, or a join's).
fn from_relations<'a>(
    item: Option<&'a NodeEnum>,
    outer: bool,
    renamed: bool,
    out: &mut Vec<(&'a RangeVar, bool, bool)>,
) {
    let renames =
        |alias: Option<&pg_query::protobuf::Alias>| alias.is_some_and(|a| !a.colnames.is_empty());
    match item {
        Some(NodeEnum::RangeVar(relation)) => {
            out.push((relation, outer, renamed || renames(relation.alias.as_ref())))
        }
        Some(NodeEnum::JoinExpr(join)) => {
            let outer = outer || join.jointype != JoinType::JoinInner as i32;
            let renamed = renamed || renames(join.alias.as_ref());
            for side in [&join.larg, &join.rarg] {
                from_relations(
                    side.as_ref().and_then(|n| n.node.as_ref()),
                    outer,
                    renamed,
                    out,
                );
            }
        }
        _ => {}
    }
}

fn plan_insert(
    insert: &pg_query::protobuf::InsertStmt,
    map: &ShardMap,
) -> Result<ShardPlan, Unsupported> {
    let (table, sharded) = target(insert.relation.as_ref(), map, "INSERT")?;
    let key_position = if insert.cols.is_empty() {
        sharded.key_ordinal.ok_or_else(|| {
            unsupported(&format!(
                "INSERT into {table} without a column list (name the columns)"
            ))
        })?
    } else {
        insert
            .cols
            .iter()
            .position(
                |c| matches!(&c.node, Some(NodeEnum::ResTarget(r)) if r.name == sharded.key_column),
            )
            .ok_or_else(|| {
                unsupported(&format!(
                    "INSERT into {table} without its shard key column {}",
                    sharded.key_column
                ))
            })?
    };
    if let Some(conflict) = &insert.on_conflict_clause {
        if sets_column(&conflict.target_list, &sharded.key_column) {
            return Err(unsupported(&format!(
                "ON CONFLICT DO UPDATE of the shard key column {} of {table}",
                sharded.key_column
            )));
        }
    }
    let rows = match insert.select_stmt.as_ref().and_then(|s| s.node.as_ref()) {
        Some(NodeEnum::SelectStmt(values)) if !values.values_lists.is_empty() => {
            // Split per shard, VALUES with these would insert other rows.
            if values.limit_count.is_some()
                || values.limit_offset.is_some()
                || !values.sort_clause.is_empty()
                || values.with_clause.is_some()
            {
                return Err(unsupported(&format!(
                    "INSERT into {table} from VALUES with ORDER BY, LIMIT, OFFSET or WITH"
                )));
            }
            &values.values_lists
        }
        _ => return Err(unsupported(&format!("INSERT into {table} from a query"))),
    };
    let keys = rows
        .iter()
        .map(|row| {
            let Some(NodeEnum::List(items)) = &row.node else {
                return Err(unsupported("a VALUES row that is not a list"));
            };
            items
                .items
                .get(key_position)
                .and_then(|item| key_source(item.node.as_ref(), sharded.key_type))
                .ok_or_else(|| {
                    unsupported(&format!(
                        "a shard key of {table} given by an expression (give the value, or a parameter)"
                    ))
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ShardPlan::InsertRows {
        table: table.to_owned(),
        keys,
    })
}

/// The restriction a WHERE clause puts on the key. Anything it cannot read restricts nothing
/// (all shards), which is always right.
fn restriction(
    clause: Option<&pg_query::protobuf::Node>,
    table: &ShardedTable,
    table_name: &str,
    alias: Option<&str>,
) -> Restriction {
    let Some(node) = clause.and_then(|c| c.node.as_ref()) else {
        return Restriction::All;
    };
    let is_key = |n: Option<&NodeEnum>| is_key_column(n, table, table_name, alias);
    match node {
        NodeEnum::BoolExpr(b) => {
            let parts = b
                .args
                .iter()
                .map(|arg| restriction(Some(arg), table, table_name, alias));
            if b.boolop == BoolExprType::AndExpr as i32 {
                let parts: Vec<_> = parts.filter(|p| *p != Restriction::All).collect();
                match parts.len() {
                    0 => Restriction::All,
                    1 => parts.into_iter().next().unwrap_or(Restriction::All),
                    _ => Restriction::And(parts),
                }
            } else if b.boolop == BoolExprType::OrExpr as i32 {
                let parts: Vec<_> = parts.collect();
                if parts.contains(&Restriction::All) {
                    Restriction::All
                } else {
                    Restriction::Or(parts)
                }
            } else {
                // NOT: the complement of a set of keys is every other key.
                Restriction::All
            }
        }
        NodeEnum::AExpr(e) if is_equals(&e.name) => {
            let (l, r) = (
                e.lexpr.as_ref().and_then(|n| n.node.as_ref()),
                e.rexpr.as_ref().and_then(|n| n.node.as_ref()),
            );
            if e.kind == AExprKind::AexprOp as i32 {
                let value = if is_key(l) {
                    key_source(r, table.key_type)
                } else if is_key(r) {
                    key_source(l, table.key_type)
                } else {
                    None
                };
                value.map_or(Restriction::All, |v| Restriction::AnyOf(vec![v]))
            } else if e.kind == AExprKind::AexprIn as i32 && is_key(l) {
                let Some(NodeEnum::List(list)) = r else {
                    return Restriction::All;
                };
                list.items
                    .iter()
                    .map(|item| key_source(item.node.as_ref(), table.key_type))
                    .collect::<Option<Vec<_>>>()
                    .map_or(Restriction::All, Restriction::AnyOf)
            } else {
                Restriction::All
            }
        }
        _ => Restriction::All,
    }
}

fn is_equals(name: &[pg_query::protobuf::Node]) -> bool {
    matches!(name, [n] if tree::string(n) == Some("="))
}

/// Whether an expression is the key column (bare, or qualified by the table or its alias).
fn is_key_column(
    node: Option<&NodeEnum>,
    table: &ShardedTable,
    table_name: &str,
    alias: Option<&str>,
) -> bool {
    let Some(NodeEnum::ColumnRef(column)) = node else {
        return false;
    };
    let names: Vec<&str> = column.fields.iter().filter_map(tree::string).collect();
    let bare_table = table_name.rsplit('.').next().unwrap_or(table_name);
    match names.as_slice() {
        [column] => *column == table.key_column,
        [qualifier, column] => {
            *column == table.key_column
                && match alias {
                    Some(alias) => *qualifier == alias,
                    None => *qualifier == bare_table,
                }
        }
        _ => false,
    }
}

/// A key given as a literal or a bind parameter, possibly cast to a type that keeps its value
/// as the key's type reads it.
fn key_source(node: Option<&NodeEnum>, key_type: KeyType) -> Option<KeySource> {
    match node? {
        NodeEnum::AConst(c) if c.isnull => Some(KeySource::Null),
        NodeEnum::AConst(c) => {
            let text = tree::literal_text(c)?;
            // Integers beyond 32 bits come as "floats"; a real fraction (`5.0`) compares as
            // numeric in PostgreSQL, and pins no key here.
            let fraction = matches!(c.val, Some(a_const::Val::Fval(_)))
                && !text.bytes().all(|b| b.is_ascii_digit() || b == b'-');
            (!fraction).then_some(KeySource::Literal(text))
        }
        NodeEnum::ParamRef(p) => usize::try_from(p.number).ok().map(KeySource::Param),
        NodeEnum::TypeCast(cast) if cast_keeps_value(cast.type_name.as_ref(), key_type) => {
            key_source(cast.arg.as_ref().and_then(|n| n.node.as_ref()), key_type)
        }
        _ => None,
    }
}

/// Whether a cast leaves a key's value as the key's own type reads it: to that type (or,
/// for integers, another integer type), without a length or array bounds. `'ukraine'::
/// varchar(2)`, `'uk '::char(3)` or `::citext` change what is compared.
fn cast_keeps_value(type_name: Option<&pg_query::protobuf::TypeName>, key_type: KeyType) -> bool {
    let Some(type_name) = type_name else {
        return false;
    };
    if !type_name.typmods.is_empty() || !type_name.array_bounds.is_empty() {
        return false;
    }
    let name = match type_name.names.as_slice() {
        [n] => n,
        [schema, n] if matches!(&schema.node, Some(NodeEnum::String(s)) if s.sval == "pg_catalog") => {
            n
        }
        _ => return false,
    };
    let Some(NodeEnum::String(name)) = &name.node else {
        return false;
    };
    match key_type {
        KeyType::Int2 | KeyType::Int4 | KeyType::Int8 => {
            matches!(name.sval.as_str(), "int2" | "int4" | "int8")
        }
        KeyType::Text => matches!(name.sval.as_str(), "text" | "varchar"),
        KeyType::Uuid => name.sval == "uuid",
    }
}

/// Every mention of a sharded table anywhere in the statement (FROM lists, joins,
/// subqueries in any clause, CTEs, targets of writes). The tree is walked through its
/// serialized form, which has every field: the parser library's own walk skips some places.
pub(crate) fn sharded_mentions<'m>(statement: &NodeEnum, map: &'m ShardMap) -> Vec<&'m str> {
    let Ok(tree) = serde_json::to_value(statement) else {
        // Cannot be read whole: taken as naming sharded tables twice, so it is refused.
        let any = map.tables.keys().map(String::as_str).take(1);
        return any.clone().chain(any).collect();
    };
    let mut out = Vec::new();
    tree::objects(&tree, &mut |fields| {
        // A RangeVar, by its fields: inside a node it is tagged, as a statement's own field
        // (the target of a write) it is not.
        let text = |key: &str| fields.get(key).and_then(|v| v.as_str());
        if let (Some(schema), Some(name), Some(_)) =
            (text("schemaname"), text("relname"), text("relpersistence"))
        {
            out.extend(map.lookup(schema, name).map(|(name, _)| name));
        }
    });
    out
}

#[cfg(test)]
#[path = "shard_plan_tests.rs"]
mod tests;
