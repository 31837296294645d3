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
//! - `LIMIT n OFFSET m` becomes `LIMIT n + m` on each shard (the first n + m rows overall are
//!   among the first n + m of some shard), and the merge skips m and keeps n. With grouping or
//!   DISTINCT no limit reaches the shards: a group or a duplicate spans them.
//!
//! What has no exact merge is refused ([`Unsupported`], `0A000`) naming it: window functions,
//! other aggregates, expressions over aggregates, HAVING, DISTINCT ON, grouping sets, ORDER BY
//! with USING, FETCH ... WITH TIES, limits given as parameters.

use pg_query::protobuf::{
    a_const, node::Node as NodeEnum, FuncCall, LimitOption, Node, ResTarget, SelectStmt, SortByDir,
    SortByNulls,
};

use crate::shard_plan::Unsupported;

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
    /// (visible column, how it combines).
    pub aggregates: Vec<(usize, Combine)>,
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

    let mut aggregates = Vec::new();
    for (i, target) in shard.target_list.iter_mut().enumerate() {
        let Some(NodeEnum::ResTarget(target)) = target.node.as_mut() else {
            continue;
        };
        if let Some(combine) = rewrite_aggregate(target, shard_key, &mut hidden, is_user_aggregate)?
        {
            aggregates.push((i, combine));
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

    let grouping = if aggregates.is_empty() && select.group_clause.is_empty() {
        None
    } else {
        let mut keys = Vec::new();
        for item in &select.group_clause {
            keys.push(column_for(item, &visible, &mut hidden, true)?);
        }
        Some(Grouping { keys, aggregates })
    };

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
        // With grouping or DISTINCT a hidden sort column would change the groups or rows.
        let may_hide = grouping.is_none() && !distinct;
        let column = column_for(key, &visible, &mut hidden, may_hide)?;
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

    let limit = constant_count(select.limit_count.as_deref(), "LIMIT")?;
    let offset = constant_count(select.limit_offset.as_deref(), "OFFSET")?.unwrap_or(0);
    shard.limit_offset = None;
    shard.limit_count = match limit {
        Some(limit) if grouping.is_none() && !distinct => Some(Box::new(integer(limit + offset))),
        _ => None,
    };
    if shard.limit_count.is_none() {
        shard.limit_option = LimitOption::Default as i32;
    }
    let hidden_columns = hidden.len();
    shard.target_list.extend(hidden.into_iter().map(|val| Node {
        node: Some(NodeEnum::ResTarget(Box::new(ResTarget {
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
        },
    })
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
    if !select.window_clause.is_empty() {
        return Err(refused("a window in a fan-out"));
    }
    if select.having_clause.is_some() {
        return Err(refused("HAVING in a fan-out"));
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

fn function_name(call: &FuncCall) -> Option<&str> {
    match call.funcname.as_slice() {
        [name] => string(name),
        [schema, name] if string(schema) == Some("pg_catalog") => string(name),
        _ => None,
    }
}

fn string(node: &Node) -> Option<&str> {
    match &node.node {
        Some(NodeEnum::String(s)) => Some(s.sval.as_str()),
        _ => None,
    }
}

/// A select-list item that is one mergeable aggregate: how it combines, after rewriting it for
/// the shards (`avg` into `sum` and a hidden `count`). `None`: not an aggregate call.
fn rewrite_aggregate(
    target: &mut ResTarget,
    shard_key: &str,
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
        let on_key = matches!(call.args.as_slice(), [arg] if is_column(arg, shard_key));
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

fn is_column(node: &Node, name: &str) -> bool {
    match &node.node {
        Some(NodeEnum::ColumnRef(c)) => c.fields.last().and_then(string) == Some(name),
        _ => false,
    }
}

/// Whether an expression calls an aggregate anywhere (outside subqueries, which aggregate on
/// their own).
fn contains_aggregate(node: Option<&Node>, is_user_aggregate: &dyn Fn(&str) -> bool) -> bool {
    fn walk(value: &serde_json::Value, is_user_aggregate: &dyn Fn(&str) -> bool) -> bool {
        match value {
            serde_json::Value::Object(fields) => {
                if fields.contains_key("SubLink") {
                    return false;
                }
                if let Some(call) = fields.get("FuncCall") {
                    let names: Vec<&str> = call
                        .get("funcname")
                        .and_then(|f| f.as_array())
                        .map(|f| {
                            f.iter()
                                .filter_map(|n| n.pointer("/node/String/sval")?.as_str())
                                .collect()
                        })
                        .unwrap_or_default();
                    if names.last().is_some_and(|name| {
                        MERGEABLE.contains(name)
                            || OTHER_AGGREGATES.contains(name)
                            || is_user_aggregate(name)
                    }) && call.get("over").is_none_or(|o| o.is_null())
                    {
                        return true;
                    }
                }
                fields.values().any(|v| walk(v, is_user_aggregate))
            }
            serde_json::Value::Array(items) => items.iter().any(|v| walk(v, is_user_aggregate)),
            _ => false,
        }
    }
    node.and_then(|n| serde_json::to_value(n).ok())
        .is_some_and(|tree| walk(&tree, is_user_aggregate))
}

/// The column a GROUP BY or ORDER BY item names: a select-list position (`ORDER BY 2`), an
/// output name, or an expression of the select list; otherwise, if `may_hide`, a hidden
/// column computing it.
fn column_for(
    item: &Node,
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
            if let Some(i) = visible
                .iter()
                .position(|t| !t.name.is_empty() && Some(t.name.as_str()) == string(name))
            {
                return Ok(Column::Visible(i));
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

/// Two expressions alike but for where they were written.
fn same_expression(a: &Node, b: &Node) -> bool {
    fn strip(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(fields) => {
                fields.remove("location");
                fields.values_mut().for_each(strip);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let tree = |n: &Node| {
        let mut value = serde_json::to_value(n).ok()?;
        strip(&mut value);
        Some(value)
    };
    matches!((tree(a), tree(b)), (Some(a), Some(b)) if a == b)
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
