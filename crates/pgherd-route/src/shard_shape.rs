//! Key-routed statements planned once per shape. Statements that differ only in their
//! literals (pgbench's `... WHERE aid = 48213`) share the literal-blind shape the lexer
//! writes; the first one is planned in full (`shard_route::route_statement`), and when it ran
//! on one shard its shape's plan is kept: the statement with each literal as a parameter,
//! planned by `shard_plan` once. The next statement of the shape binds its own literals to
//! that plan and is placed without parsing. Whatever the kept plan cannot place on exactly
//! one shard (several shards, a key it cannot read, a literal of another form) goes back to
//! the full planner, so the kept plan never answers where the full one would answer
//! otherwise.
//!
//! Pure: text, the lexer's literal spans and the sharding map in; a shard or nothing out.

use pg_query::protobuf::node::Node as NodeEnum;

use crate::shard_plan::{self, BoundParam, Restriction, ShardMap, ShardPlan};

/// The plan of a statement shape whose key comes from its literals or parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapePlan {
    table: String,
    /// With the literals as parameters after the client's.
    restriction: Restriction,
    client_params: usize,
}

/// The values of a statement's literals (`spans`, from `lexer::lex_with_spans`), as text
/// parameters take them: numbers as written, standard strings unquoted. `None` if one is of
/// another form (an escape, bit or Unicode string), which the kept plan does not read.
pub fn literal_values<'s>(
    sql: &'s str,
    spans: &[(usize, usize)],
) -> Option<Vec<std::borrow::Cow<'s, str>>> {
    spans
        .iter()
        .map(|&(start, end)| {
            let text = sql.get(start..end)?;
            match text.as_bytes().first()? {
                b'\'' => {
                    let inner = text.strip_prefix('\'')?.strip_suffix('\'')?;
                    Some(if inner.contains('\'') {
                        std::borrow::Cow::Owned(inner.replace("''", "'"))
                    } else {
                        std::borrow::Cow::Borrowed(inner)
                    })
                }
                b'0'..=b'9' | b'.' => Some(std::borrow::Cow::Borrowed(text)),
                _ => None,
            }
        })
        .collect()
}

/// The plan of `sql`'s shape (its literals at `spans`; `client_params` parameters bound by the
/// client), if it is a read or write of one sharded table placed by its key: a SELECT, UPDATE
/// or DELETE, alone in the text.
pub fn shape_plan(
    sql: &str,
    spans: &[(usize, usize)],
    client_params: usize,
    map: &ShardMap,
) -> Option<ShapePlan> {
    literal_values(sql, spans)?;
    let mut text = String::with_capacity(sql.len() + spans.len() * 3);
    let mut copied_to = 0;
    for (i, &(start, end)) in spans.iter().enumerate() {
        text.push_str(sql.get(copied_to..start)?);
        text.push_str(&format!("${}", client_params + i + 1));
        copied_to = end;
    }
    text.push_str(sql.get(copied_to..)?);
    let parsed = pg_query::parse(&text).ok()?;
    let [statement] = parsed.protobuf.stmts.as_slice() else {
        return None;
    };
    let node = statement.stmt.as_ref()?.node.as_ref()?;
    if !matches!(
        node,
        NodeEnum::SelectStmt(_) | NodeEnum::UpdateStmt(_) | NodeEnum::DeleteStmt(_)
    ) {
        return None;
    }
    match shard_plan::plan(node, map).ok()? {
        ShardPlan::Table { table, restriction } => Some(ShapePlan {
            table,
            restriction,
            client_params,
        }),
        _ => None,
    }
}

/// The one shard a statement of `plan`'s shape runs on, with its literals (at `spans`) and
/// the client's `params`; `None` when the full planner must decide.
pub fn place(
    plan: &ShapePlan,
    sql: &str,
    spans: &[(usize, usize)],
    params: &[BoundParam],
    map: &ShardMap,
) -> Option<u32> {
    if params.len() != plan.client_params {
        return None;
    }
    let literals = literal_values(sql, spans)?;
    let mut all: Vec<BoundParam> = params.to_vec();
    all.extend(literals.iter().map(|l| BoundParam::text(Some(l))));
    let table = map.tables.get(&plan.table)?;
    let shards = plan.restriction.shards(table, map.shards, &all).ok()?;
    match shards.len() {
        // No row can match: any one shard says so, as the full planner has it.
        0 => Some(0),
        1 => shards.first().copied(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lexer::lex_with_spans;
    use crate::shard_route::tests::{map, route_bound};
    use crate::shard_route::Execution;

    fn spans(sql: &str) -> (Vec<u8>, Vec<(usize, usize)>) {
        let mut key = Vec::new();
        let mut spans = Vec::new();
        lex_with_spans(sql.as_bytes(), true, &mut key, &mut spans);
        (key, spans)
    }

    fn full(sql: &str) -> Option<u32> {
        match route_bound(sql, &[]) {
            Ok(Execution::OneShard(shard)) => Some(shard),
            _ => None,
        }
    }

    /// Whatever the kept plan places, the full planner places alike, for every statement of
    /// the shape, whichever statement the plan was kept from.
    #[test]
    fn a_kept_plan_places_statements_as_the_full_planner_does() {
        let shapes = [
            "SELECT abalance FROM accounts WHERE aid = {}",
            "UPDATE accounts SET abalance = abalance + 7 WHERE aid = {}",
            "DELETE FROM accounts WHERE aid = {} AND abalance > 3",
            "SELECT * FROM accounts WHERE aid IN ({}, 12) ORDER BY aid",
            "SELECT * FROM accounts WHERE aid = '{}'",
            "SELECT * FROM accounts WHERE aid = {} OR aid = 5",
        ];
        let values = [
            "1",
            "5",
            "12",
            "48213",
            "2147483647",
            "2147483648",
            "5.5",
            "0",
            "007",
        ];
        for shape in shapes {
            let first = shape.replace("{}", "5");
            let (_, first_spans) = spans(&first);
            let Some(plan) = shape_plan(&first, &first_spans, 0, &map()) else {
                panic!("{first}: no kept plan");
            };
            for value in values {
                let sql = shape.replace("{}", value);
                let (_, sql_spans) = spans(&sql);
                if let Some(shard) = place(&plan, &sql, &sql_spans, &[], &map()) {
                    assert_eq!(Some(shard), full(&sql), "{sql}");
                }
            }
        }
        // The shapes the kept plan must place, so the cache does its work.
        let sql = "SELECT abalance FROM accounts WHERE aid = 48213";
        let (_, s) = spans(sql);
        let plan = shape_plan(sql, &s, 0, &map()).unwrap();
        assert_eq!(place(&plan, sql, &s, &[], &map()), full(sql));
        assert!(full(sql).is_some());
    }

    #[test]
    fn only_single_table_reads_and_writes_of_plain_literals_are_kept() {
        for sql in [
            "INSERT INTO accounts (aid) VALUES (5)",
            "SELECT 1; SELECT * FROM accounts WHERE aid = 5",
            "SELECT * FROM branches WHERE bid = 5",
            "SELECT * FROM accounts WHERE aid = E'5'",
            "EXPLAIN SELECT * FROM accounts WHERE aid = 5",
        ] {
            let (_, s) = spans(sql);
            assert_eq!(shape_plan(sql, &s, 0, &map()), None, "{sql}");
        }
        let values = literal_values("x = 'it''s' AND y = 1.5", &[(4, 11), (20, 23)]).unwrap();
        assert_eq!(values, vec!["it's", "1.5"]);
    }
}
