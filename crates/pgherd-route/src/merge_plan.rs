//! How a SELECT that runs on every shard (a fan-out) gives the answer one server holding all
//! the rows would give: the statement each shard runs, and how their rows are merged. Pure:
//! the statement tree in, SQL and a [`Merge`] out.
//!
//! The rewrite, and why:
//! - `avg(x)` becomes `sum(x)` with a hidden `count(x)` after the visible columns: an average
//!   of averages is not the average.
//! - `count`, `sum`, `min`, `max` stay; the merge adds counts and sums and takes the least or
//!   greatest. `count(DISTINCT key)` on the shard key adds up too (the shards hold disjoint
//!   keys); other DISTINCT aggregates do not.
//! - GROUP BY and ORDER BY items not in the select list come back as hidden columns, so the
//!   merge can group and sort by them.
//! - Each sort key and each `min`/`max` brings the name of its collation as a hidden column
//!   (`pg_collation_for`): text orders by a collation only the server knows.
//! - `LIMIT n OFFSET m` becomes `LIMIT n + m` on each shard (the first n + m rows overall are
//!   among the first n + m of some shard), and the merge skips m and keeps n. With grouping or
//!   DISTINCT no limit reaches the shards: a group or a duplicate spans them.
//!
//! - HAVING leaves the shards' statement (every group's part comes back) and applies to the
//!   merged groups: AND, OR, NOT of comparisons between select-list columns or aggregates and
//!   literals (an aggregate the select list does not have comes back as a hidden column).
//!
//! What has no exact merge is refused ([`Unsupported`], `0A000`) naming it: window functions,
//! other aggregates, expressions over aggregates, other HAVING conditions, DISTINCT ON,
//! grouping sets, ORDER BY with USING, FETCH ... WITH TIES, limits given as parameters.
//! Whether text can be ordered is the merge's to say, once the shards named its collation.

use pg_query::protobuf::{
    a_const, node::Node as NodeEnum, FuncCall, LimitOption, Node, ResTarget, SelectStmt, SortByDir,
    SortByNulls, TypeCast, TypeName,
};

use crate::shard_plan::Unsupported;
use crate::tree::{any_node, literal_text, same_expression, string};

/// A column of the shards' rows: one the client sees (by position), or one of the hidden ones
/// after them (by position among those).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    Visible(usize),
    Hidden(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SortKey {
    pub column: Column,
    pub descending: bool,
    pub nulls_first: bool,
}

/// How one aggregate's values from the shards combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combine {
    /// Counts and sums add up.
    Add,
    Min,
    Max,
    /// The visible column holds the sum; divided by the added counts of this column.
    Average {
        count: Column,
    },
}

/// Rows with equal keys become one; each aggregate combines as it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grouping {
    pub keys: Vec<Column>,
    /// (column, how it combines): the select list's aggregates, and hidden ones only HAVING
    /// reads.
    pub aggregates: Vec<(Column, Combine)>,
}

/// How the shards' rows become the client's: group, drop duplicates, sort, skip and keep.
/// The default passes rows through as they come.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Merge {
    /// Columns after the visible ones, dropped before the client sees the rows.
    pub hidden_columns: usize,
    pub grouping: Option<Grouping>,
    pub distinct: bool,
    pub order_by: Vec<SortKey>,
    pub offset: u64,
    pub limit: Option<u64>,
    /// HAVING, on the merged groups (the shards return every group's part).
    pub having: Option<Condition>,
    /// (a column the merge orders by or takes the least or greatest of, the hidden column
    /// naming its collation): text orders by a collation only the server knows.
    pub collations: Vec<(Column, Column)>,
}

/// A HAVING condition, on select-list columns and constants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    And(Vec<Condition>),
    Or(Vec<Condition>),
    Not(Box<Condition>),
    Compare {
        left: Operand,
        op: CompareOp,
        right: Operand,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operand {
    Column(Column),
    /// A literal, in its text form, read as the type of what it is compared with.
    Constant(String),
    Null,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompareOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FanOut {
    /// What every shard runs.
    pub shard_sql: String,
    pub merge: Merge,
}

/// Aggregates PostgreSQL has built in that no merge here combines exactly.
const OTHER_AGGREGATES: &[&str] = &[
    "array_agg",
    "string_agg",
    "json_agg",
    "jsonb_agg",
    "json_object_agg",
    "jsonb_object_agg",
    "xmlagg",
    "bool_and",
    "bool_or",
    "every",
    "bit_and",
    "bit_or",
    "bit_xor",
    "stddev",
    "stddev_pop",
    "stddev_samp",
    "variance",
    "var_pop",
    "var_samp",
    "corr",
    "covar_pop",
    "covar_samp",
    "regr_avgx",
    "regr_avgy",
    "regr_count",
    "regr_intercept",
    "regr_r2",
    "regr_slope",
    "regr_sxx",
    "regr_sxy",
    "regr_syy",
    "percentile_cont",
    "percentile_disc",
    "mode",
    "range_agg",
    "range_intersect_agg",
    "grouping",
    // Hypothetical-set aggregates (with WITHIN GROUP).
    "rank",
    "dense_rank",
    "percent_rank",
    "cume_dist",
];

const MERGEABLE: &[&str] = &["count", "sum", "min", "max", "avg"];

/// Plans a fan-out of `select` over a table sharded by `shard_key`. `is_user_aggregate` says
/// whether a function name is an aggregate the database defines (from its catalog).
pub fn plan_fan_out(
    select: &SelectStmt,
    shard_key: &str,
    is_user_aggregate: &dyn Fn(&str) -> bool,
) -> Result<FanOut, Unsupported> {
    refuse_unmergeable_shapes(select)?;
    let mut shard = select.clone();
    let mut hidden: Vec<Node> = Vec::new();
    let distinct = !select.distinct_clause.is_empty();
    // `count(DISTINCT key)` adds up only if `key` surely is the shard key column.
    let key_for_distinct = single_table_unrenamed(select).then_some(shard_key);

    let mut aggregates = Vec::new();
    for (i, target) in shard.target_list.iter_mut().enumerate() {
        let Some(NodeEnum::ResTarget(target)) = target.node.as_mut() else {
            continue;
        };
        let rewritten =
            rewrite_aggregate(target, key_for_distinct, &mut hidden, is_user_aggregate)?;
        if let Some(combine) = rewritten {
            aggregates.push((Column::Visible(i), combine));
        } else if contains_aggregate(target.val.as_deref(), is_user_aggregate) {
            return Err(refused("an expression over an aggregate in a fan-out"));
        }
    }
    let visible: Vec<ResTarget> = select
        .target_list
        .iter()
        .filter_map(|t| match &t.node {
            Some(NodeEnum::ResTarget(r)) => Some((**r).clone()),
            _ => None,
        })
        .collect();

    let grouped = !aggregates.is_empty() || !select.group_clause.is_empty();
    let having = match select.having_clause.as_deref() {
        None => None,
        Some(_) if !grouped => {
            return Err(refused(
                "HAVING without aggregates or GROUP BY in a fan-out",
            ))
        }
        Some(condition) => {
            let mut reads = HavingReads {
                visible: &visible,
                hidden: &mut hidden,
                aggregates: &mut aggregates,
                shard_key: key_for_distinct,
                is_user_aggregate,
            };
            Some(reads.condition(condition)?)
        }
    };
    let grouping = if !grouped {
        if select
            .sort_clause
            .iter()
            .any(|s| contains_aggregate(Some(s), is_user_aggregate))
        {
            return Err(refused(
                "ORDER BY an aggregate the select list does not have",
            ));
        }
        None
    } else {
        let mut keys = Vec::new();
        for item in &select.group_clause {
            keys.push(column_for(
                item,
                Clause::GroupBy,
                &visible,
                &mut hidden,
                true,
            )?);
        }
        Some(Grouping { keys, aggregates })
    };
    // Every group's part comes back; HAVING applies to the merged groups.
    shard.having_clause = None;
    // With grouping or DISTINCT a hidden sort column would change the groups or rows.
    let may_hide = grouping.is_none() && !distinct;
    let order_by = sort_keys(select, &visible, &mut hidden, may_hide)?;
    let collations = collation_columns(&visible, &order_by, grouping.as_ref(), &mut hidden);
    // A `*` stands for columns this cannot count: positions after it are unknown.
    let positional = grouping.is_some()
        || order_by
            .iter()
            .any(|k| matches!(k.column, Column::Visible(_)));
    if positional && select.target_list.iter().any(has_star) {
        return Err(refused(
            "* in the select list with GROUP BY, aggregates or ORDER BY a select-list column, in a fan-out",
        ));
    }

    let limit = constant_count(select.limit_count.as_deref(), "LIMIT")?;
    let offset = constant_count(select.limit_offset.as_deref(), "OFFSET")?.unwrap_or(0);
    shard.limit_offset = None;
    shard.limit_count = match limit {
        Some(limit) if grouping.is_none() && !distinct => {
            let rows = limit.saturating_add(offset).min(i64::MAX as u64);
            Some(Box::new(integer(rows)))
        }
        _ => None,
    };
    if shard.limit_count.is_none() {
        shard.limit_option = LimitOption::Default as i32;
    }
    let hidden_columns = hidden.len();
    shard
        .target_list
        .extend(hidden.into_iter().enumerate().map(|(i, val)| Node {
            node: Some(NodeEnum::ResTarget(Box::new(ResTarget {
                // Named apart, so no ORDER BY name of the statement means them.
                name: format!("pgherd_hidden_{}", i + 1),
                val: Some(Box::new(val)),
                ..ResTarget::default()
            }))),
        }));
    let shard_sql = NodeEnum::SelectStmt(Box::new(shard))
        .deparse()
        .map_err(|e| refused(&format!("a statement pgherd cannot rewrite ({e})")))?;
    Ok(FanOut {
        shard_sql,
        merge: Merge {
            hidden_columns,
            grouping,
            distinct,
            order_by,
            offset,
            limit,
            having,
            collations,
        },
    })
}

/// Text orders by its collation: a column's own, one the statement names, or the
/// database's; only the server knows which an expression has. So each sort key, and each
/// min or max, brings the name of its collation as a hidden column:
/// `pg_collation_for(expression::text)` (the cast keeps a text's collation, and gives other
/// types one, which the merge ignores for them: `pg_collation_for` itself refuses a type
/// without a collation). It is the same in every row, so it changes no group and no
/// DISTINCT. Counts, sums and averages are never text.
fn collation_columns(
    visible: &[ResTarget],
    order_by: &[SortKey],
    grouping: Option<&Grouping>,
    hidden: &mut Vec<Node>,
) -> Vec<(Column, Column)> {
    let least_or_greatest = grouping
        .into_iter()
        .flat_map(|g| &g.aggregates)
        .filter(|(_, combine)| matches!(combine, Combine::Min | Combine::Max))
        .map(|&(column, _)| column);
    let mut collations: Vec<(Column, Column)> = Vec::new();
    for column in order_by.iter().map(|k| k.column).chain(least_or_greatest) {
        if collations.iter().any(|&(c, _)| c == column) {
            continue;
        }
        let expression = match column {
            Column::Visible(i) => visible.get(i).and_then(|t| t.val.as_deref()).cloned(),
            Column::Hidden(i) => hidden.get(i).cloned(),
        };
        let Some(expression) = expression.filter(|e| !is_count_sum_or_average(e)) else {
            continue;
        };
        let as_text = Node {
            node: Some(NodeEnum::TypeCast(Box::new(TypeCast {
                arg: Some(Box::new(expression)),
                type_name: Some(TypeName {
                    names: vec![sval("pg_catalog"), sval("text")],
                    typemod: -1,
                    location: -1,
                    ..TypeName::default()
                }),
                location: -1,
            }))),
        };
        hidden.push(Node {
            node: Some(NodeEnum::FuncCall(Box::new(FuncCall {
                funcname: vec![sval("pg_catalog"), sval("pg_collation_for")],
                args: vec![as_text],
                funcformat: pg_query::protobuf::CoercionForm::CoerceExplicitCall as i32,
                location: -1,
                ..FuncCall::default()
            }))),
        });
        collations.push((column, Column::Hidden(hidden.len() - 1)));
    }
    collations
}

/// What a HAVING condition reads: select-list columns, and aggregates the select list does not
/// have, which come back as hidden columns.
struct HavingReads<'a> {
    visible: &'a [ResTarget],
    hidden: &'a mut Vec<Node>,
    aggregates: &'a mut Vec<(Column, Combine)>,
    shard_key: Option<&'a str>,
    is_user_aggregate: &'a dyn Fn(&str) -> bool,
}

impl HavingReads<'_> {
    /// A HAVING condition the merge can evaluate: AND, OR, NOT of comparisons between
    /// select-list columns or aggregates and literals.
    fn condition(&mut self, node: &Node) -> Result<Condition, Unsupported> {
        let unsupported = || {
            refused(
                "this HAVING condition in a fan-out (compare select-list columns or aggregates with literals)",
            )
        };
        match &node.node {
            Some(NodeEnum::BoolExpr(b)) => {
                let parts = b
                    .args
                    .iter()
                    .map(|arg| self.condition(arg))
                    .collect::<Result<Vec<_>, _>>()?;
                match pg_query::protobuf::BoolExprType::try_from(b.boolop) {
                    Ok(pg_query::protobuf::BoolExprType::AndExpr) => Ok(Condition::And(parts)),
                    Ok(pg_query::protobuf::BoolExprType::OrExpr) => Ok(Condition::Or(parts)),
                    Ok(pg_query::protobuf::BoolExprType::NotExpr) => parts
                        .into_iter()
                        .next()
                        .map(|p| Condition::Not(Box::new(p)))
                        .ok_or_else(unsupported),
                    _ => Err(unsupported()),
                }
            }
            Some(NodeEnum::AExpr(e)) if e.kind == pg_query::protobuf::AExprKind::AexprOp as i32 => {
                let op = match e.name.as_slice() {
                    [name] => match string(name) {
                        Some("=") => CompareOp::Eq,
                        Some("<>") => CompareOp::Ne,
                        Some("<") => CompareOp::Lt,
                        Some("<=") => CompareOp::Le,
                        Some(">") => CompareOp::Gt,
                        Some(">=") => CompareOp::Ge,
                        _ => return Err(unsupported()),
                    },
                    _ => return Err(unsupported()),
                };
                let left = self.operand(e.lexpr.as_deref())?.ok_or_else(unsupported)?;
                let right = self.operand(e.rexpr.as_deref())?.ok_or_else(unsupported)?;
                if !matches!(left, Operand::Column(_)) && !matches!(right, Operand::Column(_)) {
                    return Err(unsupported());
                }
                Ok(Condition::Compare { left, op, right })
            }
            _ => Err(unsupported()),
        }
    }

    /// A literal, a select-list column, or an aggregate made a hidden column; `None`: none of
    /// those.
    fn operand(&mut self, side: Option<&Node>) -> Result<Option<Operand>, Unsupported> {
        let Some(side) = side else {
            return Ok(None);
        };
        match &side.node {
            Some(NodeEnum::AConst(c)) if c.isnull => return Ok(Some(Operand::Null)),
            Some(NodeEnum::AConst(c)) => return Ok(literal_text(c).map(Operand::Constant)),
            _ => {}
        }
        let listed = self
            .visible
            .iter()
            .position(|t| t.val.as_deref().is_some_and(|v| same_expression(v, side)));
        if let Some(i) = listed {
            return Ok(Some(Operand::Column(Column::Visible(i))));
        }
        let mut target = ResTarget {
            val: Some(Box::new(side.clone())),
            ..ResTarget::default()
        };
        let Some(combine) = rewrite_aggregate(
            &mut target,
            self.shard_key,
            self.hidden,
            self.is_user_aggregate,
        )?
        else {
            return Ok(None);
        };
        let Some(val) = target.val else {
            return Ok(None);
        };
        self.hidden.push(*val);
        let column = Column::Hidden(self.hidden.len() - 1);
        self.aggregates.push((column, combine));
        Ok(Some(Operand::Column(column)))
    }
}

fn sort_keys(
    select: &SelectStmt,
    visible: &[ResTarget],
    hidden: &mut Vec<Node>,
    may_hide: bool,
) -> Result<Vec<SortKey>, Unsupported> {
    let mut order_by = Vec::new();
    for item in &select.sort_clause {
        let Some(NodeEnum::SortBy(sort)) = &item.node else {
            return Err(refused("this ORDER BY item"));
        };
        if !sort.use_op.is_empty() || sort.sortby_dir == SortByDir::SortbyUsing as i32 {
            return Err(refused("ORDER BY ... USING in a fan-out"));
        }
        let key = sort
            .node
            .as_deref()
            .ok_or_else(|| refused("an empty ORDER BY item"))?;
        let column = column_for(key, Clause::OrderBy, visible, hidden, may_hide)?;
        let descending = sort.sortby_dir == SortByDir::SortbyDesc as i32;
        let nulls_first = match SortByNulls::try_from(sort.sortby_nulls) {
            Ok(SortByNulls::SortbyNullsFirst) => true,
            Ok(SortByNulls::SortbyNullsLast) => false,
            // PostgreSQL's default: NULLs sort as larger than any value.
            _ => descending,
        };
        order_by.push(SortKey {
            column,
            descending,
            nulls_first,
        });
    }
    Ok(order_by)
}

fn is_count_sum_or_average(expression: &Node) -> bool {
    matches!(&expression.node, Some(NodeEnum::FuncCall(call))
        if call.over.is_none()
            && matches!(function_name(call), Some("count" | "sum" | "avg")))
}

fn refused(what: &str) -> Unsupported {
    Unsupported(what.to_owned())
}

fn refuse_unmergeable_shapes(select: &SelectStmt) -> Result<(), Unsupported> {
    if select.larg.is_some() || select.rarg.is_some() {
        return Err(refused("UNION, INTERSECT or EXCEPT in a fan-out"));
    }
    if select.distinct_clause.iter().any(|d| d.node.is_some()) {
        return Err(refused("DISTINCT ON in a fan-out"));
    }
    let clauses = || {
        select
            .target_list
            .iter()
            .chain(&select.sort_clause)
            .chain(&select.group_clause)
    };
    if !select.window_clause.is_empty() || clauses().any(|n| any_node(n, is_window_call)) {
        return Err(refused("a window function in a fan-out"));
    }
    if select.group_distinct
        || select
            .group_clause
            .iter()
            .any(|g| matches!(g.node, Some(NodeEnum::GroupingSet(_))))
    {
        return Err(refused("grouping sets, ROLLUP or CUBE in a fan-out"));
    }
    if select.limit_option == LimitOption::WithTies as i32 {
        return Err(refused("FETCH ... WITH TIES in a fan-out"));
    }
    Ok(())
}

/// The FROM list is one table whose columns keep their names.
fn single_table_unrenamed(select: &SelectStmt) -> bool {
    matches!(select.from_clause.as_slice(), [item] if matches!(
        &item.node,
        Some(NodeEnum::RangeVar(r)) if r.alias.as_ref().is_none_or(|a| a.colnames.is_empty())
    ))
}

fn has_star(target: &Node) -> bool {
    any_node(target, |key, _| key == "AStar")
}

fn is_window_call(key: &str, value: &serde_json::Value) -> bool {
    key == "FuncCall" && value.get("over").is_some_and(|o| !o.is_null())
}

fn function_name(call: &FuncCall) -> Option<&str> {
    match call.funcname.as_slice() {
        [name] => string(name),
        [schema, name] if string(schema) == Some("pg_catalog") => string(name),
        _ => None,
    }
}

/// A select-list item that is one mergeable aggregate: how it combines, after rewriting it for
/// the shards (`avg` into `sum` and a hidden `count`). `None`: not an aggregate call.
fn rewrite_aggregate(
    target: &mut ResTarget,
    shard_key: Option<&str>,
    hidden: &mut Vec<Node>,
    is_user_aggregate: &dyn Fn(&str) -> bool,
) -> Result<Option<Combine>, Unsupported> {
    let Some(NodeEnum::FuncCall(call)) = target.val.as_deref_mut().and_then(|v| v.node.as_mut())
    else {
        return Ok(None);
    };
    if call.over.is_some() {
        return Err(refused("a window function in a fan-out"));
    }
    let Some(name) = function_name(call).map(str::to_owned) else {
        return Ok(None);
    };
    if !MERGEABLE.contains(&name.as_str()) {
        if OTHER_AGGREGATES.contains(&name.as_str()) || is_user_aggregate(&name) {
            return Err(refused(&format!("the aggregate {name} in a fan-out")));
        }
        return Ok(None);
    }
    if call.agg_filter.is_some() || !call.agg_order.is_empty() || call.agg_within_group {
        return Err(refused(&format!(
            "{name} with FILTER or ORDER BY in a fan-out"
        )));
    }
    if call
        .args
        .iter()
        .any(|a| contains_aggregate(Some(a), is_user_aggregate))
    {
        return Err(refused("an aggregate of an aggregate"));
    }
    if call.agg_distinct {
        let on_key =
            matches!((call.args.as_slice(), shard_key), ([arg], Some(key)) if is_column(arg, key));
        match name.as_str() {
            "min" | "max" => {}
            // The shards hold disjoint keys: their distinct counts add up.
            "count" if on_key => {}
            _ => return Err(refused(&format!("{name}(DISTINCT ...) in a fan-out"))),
        }
    }
    Ok(Some(match name.as_str() {
        "count" | "sum" => Combine::Add,
        "min" => Combine::Min,
        "max" => Combine::Max,
        _ => {
            let mut count = call.clone();
            count.funcname = vec![sval("count")];
            call.funcname = vec![sval("sum")];
            hidden.push(Node {
                node: Some(NodeEnum::FuncCall(count)),
            });
            Combine::Average {
                count: Column::Hidden(hidden.len() - 1),
            }
        }
    }))
}

fn sval(s: &str) -> Node {
    Node {
        node: Some(NodeEnum::String(pg_query::protobuf::String {
            sval: s.to_owned(),
        })),
    }
}

/// The bare column `name` (one table in FROM: it is that table's).
fn is_column(node: &Node, name: &str) -> bool {
    match &node.node {
        Some(NodeEnum::ColumnRef(c)) => {
            matches!(c.fields.as_slice(), [field] if string(field) == Some(name))
        }
        _ => false,
    }
}

/// Whether an expression calls an aggregate anywhere, subqueries included (an aggregate
/// there may belong to this query): by name, or by syntax only aggregates have.
fn contains_aggregate(node: Option<&Node>, is_user_aggregate: &dyn Fn(&str) -> bool) -> bool {
    let Some(node) = node else {
        return false;
    };
    let is_aggregate = |key: &str, call: &serde_json::Value| {
        if key != "FuncCall" || call.get("over").is_some_and(|o| !o.is_null()) {
            return false;
        }
        let flag = |field: &str| call.get(field).and_then(|v| v.as_bool()) == Some(true);
        let listed = |field: &str| {
            call.get(field)
                .is_some_and(|v| v.as_array().is_some_and(|a| !a.is_empty()))
        };
        let syntax = flag("agg_star")
            || flag("agg_distinct")
            || flag("agg_within_group")
            || listed("agg_order")
            || call.get("agg_filter").is_some_and(|f| !f.is_null());
        let name = call
            .get("funcname")
            .and_then(crate::tree::last_name)
            .unwrap_or_default();
        let name = name.as_str();
        syntax
            || MERGEABLE.contains(&name)
            || OTHER_AGGREGATES.contains(&name)
            || is_user_aggregate(name)
    };
    any_node(node, is_aggregate)
}

/// Which clause names a column: GROUP BY reads a bare name as a table column before an
/// output name, ORDER BY the other way round.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Clause {
    GroupBy,
    OrderBy,
}

/// The name PostgreSQL gives an output column written without AS (`FigureColname`), where
/// it is a column's, or `None`.
fn implicit_name(val: Option<&Node>) -> Option<&str> {
    match &val?.node {
        Some(NodeEnum::ColumnRef(c)) => c.fields.last().and_then(string),
        Some(NodeEnum::TypeCast(cast)) => implicit_name(cast.arg.as_deref()),
        Some(NodeEnum::FuncCall(call)) => call.funcname.last().and_then(string),
        _ => None,
    }
}

fn output_name(target: &ResTarget) -> Option<&str> {
    if target.name.is_empty() {
        implicit_name(target.val.as_deref())
    } else {
        Some(target.name.as_str())
    }
}

/// The column a GROUP BY or ORDER BY item names: a select-list position (`ORDER BY 2`), an
/// output name, or an expression of the select list; otherwise, if `may_hide`, a hidden
/// column computing it.
fn column_for(
    item: &Node,
    clause: Clause,
    visible: &[ResTarget],
    hidden: &mut Vec<Node>,
    may_hide: bool,
) -> Result<Column, Unsupported> {
    if let Some(NodeEnum::AConst(c)) = &item.node {
        if let Some(a_const::Val::Ival(i)) = &c.val {
            let position = usize::try_from(i.ival)
                .ok()
                .filter(|&p| p >= 1 && p <= visible.len());
            return position
                .map(|p| Column::Visible(p - 1))
                .ok_or_else(|| refused("a position outside the select list"));
        }
    }
    if let Some(NodeEnum::ColumnRef(c)) = &item.node {
        if let [name] = c.fields.as_slice() {
            let named = visible
                .iter()
                .position(|t| output_name(t).is_some_and(|n| Some(n) == string(name)));
            match (clause, named) {
                (Clause::OrderBy, Some(i)) => return Ok(Column::Visible(i)),
                // GROUP BY takes a table column of that name first; an output column named
                // alike for something else is ambiguous without the catalog.
                (Clause::GroupBy, Some(i))
                    if !visible[i].val.as_deref().is_some_and(|v| same_expression(v, item)) =>
                {
                    return Err(refused(
                        "GROUP BY a name that is also the name of another select-list column, in a fan-out",
                    ))
                }
                _ => {}
            }
        }
    }
    if let Some(i) = visible
        .iter()
        .position(|t| t.val.as_deref().is_some_and(|v| same_expression(v, item)))
    {
        return Ok(Column::Visible(i));
    }
    if !may_hide {
        return Err(refused(
            "ORDER BY an expression outside the select list, with GROUP BY, aggregates or DISTINCT, in a fan-out",
        ));
    }
    hidden.push(item.clone());
    Ok(Column::Hidden(hidden.len() - 1))
}

/// A LIMIT or OFFSET given as a constant (NULL: none).
fn constant_count(node: Option<&Node>, clause: &str) -> Result<Option<u64>, Unsupported> {
    let Some(node) = node else {
        return Ok(None);
    };
    match &node.node {
        Some(NodeEnum::AConst(c)) if c.isnull => Ok(None),
        Some(NodeEnum::AConst(c)) => {
            let value = match &c.val {
                Some(a_const::Val::Ival(i)) => i64::from(i.ival),
                Some(a_const::Val::Fval(f)) => f
                    .fval
                    .parse()
                    .map_err(|_| refused(&format!("{clause} {} in a fan-out", f.fval)))?,
                _ => return Err(refused(&format!("this {clause} in a fan-out"))),
            };
            u64::try_from(value)
                .map(Some)
                .map_err(|_| refused(&format!("a negative {clause}")))
        }
        _ => Err(refused(&format!(
            "{clause} given by a parameter or an expression in a fan-out"
        ))),
    }
}

fn integer(value: u64) -> Node {
    let val = match i32::try_from(value) {
        Ok(ival) => a_const::Val::Ival(pg_query::protobuf::Integer { ival }),
        Err(_) => a_const::Val::Fval(pg_query::protobuf::Float {
            fval: value.to_string(),
        }),
    };
    Node {
        node: Some(NodeEnum::AConst(pg_query::protobuf::AConst {
            isnull: false,
            location: -1,
            val: Some(val),
        })),
    }
}

#[cfg(test)]
#[path = "merge_plan_tests.rs"]
mod tests;
