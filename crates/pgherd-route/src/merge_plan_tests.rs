//! Data-driven tests of the fan-out rewrite: SQL → what each shard runs and how the rows
//! merge, or why not.

use super::*;

fn fan_out(sql: &str) -> Result<FanOut, String> {
    let parsed = pg_query::parse(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
    let Some(NodeEnum::SelectStmt(select)) = parsed.protobuf.stmts[0]
        .stmt
        .as_ref()
        .and_then(|s| s.node.clone())
    else {
        panic!("{sql}: not a SELECT");
    };
    plan_fan_out(&select, "aid", &|name| name == "my_agg").map_err(|e| e.to_string())
}

fn merge() -> Merge {
    Merge::default()
}

/// Each SQL gives this shard statement and merge.
fn check(cases: Vec<(&str, &str, Merge)>) {
    for (sql, shard_sql, expected) in cases {
        let plan = fan_out(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
        assert_eq!(plan.shard_sql, shard_sql, "{sql}");
        assert_eq!(plan.merge, expected, "{sql}");
    }
}

fn asc(column: Column) -> SortKey {
    SortKey {
        column,
        descending: false,
        nulls_first: false,
    }
}

#[test]
fn rows_are_sorted_skipped_and_limited_after_the_shards() {
    let cases: Vec<(&str, &str, Merge)> = vec![
        (
            "SELECT aid, abalance FROM accounts",
            "SELECT aid, abalance FROM accounts",
            merge(),
        ),
        (
            "SELECT aid, abalance FROM accounts ORDER BY abalance DESC, 1 LIMIT 10 OFFSET 5",
            "SELECT aid, abalance, pg_catalog.pg_collation_for(abalance::pg_catalog.text) AS pgherd_hidden_1, pg_catalog.pg_collation_for(aid::pg_catalog.text) AS pgherd_hidden_2 FROM accounts ORDER BY abalance DESC, 1 LIMIT 15",
            Merge {
                hidden_columns: 2,
                collations: vec![
                    (Column::Visible(1), Column::Hidden(0)),
                    (Column::Visible(0), Column::Hidden(1)),
                ],
                order_by: vec![
                    SortKey {
                        column: Column::Visible(1),
                        descending: true,
                        nulls_first: true,
                    },
                    asc(Column::Visible(0)),
                ],
                offset: 5,
                limit: Some(10),
                ..merge()
            },
        ),
        (
            "SELECT aid AS id FROM accounts ORDER BY id NULLS FIRST",
            "SELECT aid AS id, pg_catalog.pg_collation_for(aid::pg_catalog.text) AS pgherd_hidden_1 FROM accounts ORDER BY id NULLS FIRST",
            Merge {
                hidden_columns: 1,
                collations: vec![(Column::Visible(0), Column::Hidden(0))],
                order_by: vec![SortKey {
                    column: Column::Visible(0),
                    descending: false,
                    nulls_first: true,
                }],
                ..merge()
            },
        ),
        // A sort key outside the select list comes back hidden.
        (
            "SELECT * FROM accounts ORDER BY bid, aid LIMIT 3",
            "SELECT *, bid AS pgherd_hidden_1, aid AS pgherd_hidden_2, pg_catalog.pg_collation_for(bid::pg_catalog.text) AS pgherd_hidden_3, pg_catalog.pg_collation_for(aid::pg_catalog.text) AS pgherd_hidden_4 FROM accounts ORDER BY bid, aid LIMIT 3",
            Merge {
                hidden_columns: 4,
                collations: vec![
                    (Column::Hidden(0), Column::Hidden(2)),
                    (Column::Hidden(1), Column::Hidden(3)),
                ],
                order_by: vec![asc(Column::Hidden(0)), asc(Column::Hidden(1))],
                limit: Some(3),
                ..merge()
            },
        ),
        // ORDER BY a name means the output column first, written with AS or not (a cast of a
        // column is named after it): here the text, as PostgreSQL sorts it.
        (
            "SELECT abalance::text FROM accounts ORDER BY abalance",
            "SELECT abalance::text, pg_catalog.pg_collation_for(abalance::text::pg_catalog.text) AS pgherd_hidden_1 FROM accounts ORDER BY abalance",
            Merge {
                hidden_columns: 1,
                collations: vec![(Column::Visible(0), Column::Hidden(0))],
                order_by: vec![asc(Column::Visible(0))],
                ..merge()
            },
        ),
        // An expression is cast whole.
        (
            "SELECT aid FROM accounts ORDER BY abalance + 1 DESC",
            "SELECT aid, abalance + 1 AS pgherd_hidden_1, pg_catalog.pg_collation_for((abalance + 1)::pg_catalog.text) AS pgherd_hidden_2 FROM accounts ORDER BY abalance + 1 DESC",
            Merge {
                hidden_columns: 2,
                order_by: vec![SortKey {
                    column: Column::Hidden(0),
                    descending: true,
                    nulls_first: true,
                }],
                collations: vec![(Column::Hidden(0), Column::Hidden(1))],
                ..merge()
            },
        ),
        // A collation the statement names is the one the shards name for the key.
        (
            "SELECT filler FROM accounts ORDER BY filler COLLATE \"C\"",
            "SELECT filler, filler COLLATE \"C\" AS pgherd_hidden_1, pg_catalog.pg_collation_for(filler COLLATE \"C\"::pg_catalog.text) AS pgherd_hidden_2 FROM accounts ORDER BY filler COLLATE \"C\"",
            Merge {
                hidden_columns: 2,
                order_by: vec![asc(Column::Hidden(0))],
                collations: vec![(Column::Hidden(0), Column::Hidden(1))],
                ..merge()
            },
        ),
        (
            "SELECT DISTINCT bid FROM accounts ORDER BY bid LIMIT 2",
            "SELECT DISTINCT bid, pg_catalog.pg_collation_for(bid::pg_catalog.text) AS pgherd_hidden_1 FROM accounts ORDER BY bid",
            Merge {
                hidden_columns: 1,
                collations: vec![(Column::Visible(0), Column::Hidden(0))],
                distinct: true,
                order_by: vec![asc(Column::Visible(0))],
                limit: Some(2),
                ..merge()
            },
        ),
    ];
    check(cases);
}

#[test]
fn aggregates_combine_and_averages_come_from_sums_and_counts() {
    let cases: Vec<(&str, &str, Merge)> = vec![
        (
            "SELECT count(*), sum(abalance), min(abalance), max(abalance) FROM accounts",
            "SELECT count(*), sum(abalance), min(abalance), max(abalance), pg_catalog.pg_collation_for(min(abalance)::pg_catalog.text) AS pgherd_hidden_1, pg_catalog.pg_collation_for(max(abalance)::pg_catalog.text) AS pgherd_hidden_2 FROM accounts",
            Merge {
                hidden_columns: 2,
                collations: vec![
                    (Column::Visible(2), Column::Hidden(0)),
                    (Column::Visible(3), Column::Hidden(1)),
                ],
                grouping: Some(Grouping {
                    keys: vec![],
                    aggregates: vec![
                        (Column::Visible(0), Combine::Add),
                        (Column::Visible(1), Combine::Add),
                        (Column::Visible(2), Combine::Min),
                        (Column::Visible(3), Combine::Max),
                    ],
                }),
                ..merge()
            },
        ),
        (
            "SELECT bid, avg(abalance) FROM accounts GROUP BY bid ORDER BY 2 DESC LIMIT 5",
            "SELECT bid, sum(abalance), count(abalance) AS pgherd_hidden_1 FROM accounts GROUP BY bid ORDER BY 2 DESC",
            Merge {
                hidden_columns: 1,
                grouping: Some(Grouping {
                    keys: vec![Column::Visible(0)],
                    aggregates: vec![(
                        Column::Visible(1),
                        Combine::Average {
                            count: Column::Hidden(0),
                        },
                    )],
                }),
                order_by: vec![SortKey {
                    column: Column::Visible(1),
                    descending: true,
                    nulls_first: true,
                }],
                limit: Some(5),
                ..merge()
            },
        ),
        // A group key outside the select list comes back hidden.
        (
            "SELECT count(*) FROM accounts GROUP BY bid",
            "SELECT count(*), bid AS pgherd_hidden_1 FROM accounts GROUP BY bid",
            Merge {
                hidden_columns: 1,
                grouping: Some(Grouping {
                    keys: vec![Column::Hidden(0)],
                    aggregates: vec![(Column::Visible(0), Combine::Add)],
                }),
                ..merge()
            },
        ),
        // HAVING applies to the merged groups: the shards return every group's part.
        (
            "SELECT bid, count(*) FROM accounts GROUP BY bid HAVING count(*) > 1 AND NOT bid = 3",
            "SELECT bid, count(*) FROM accounts GROUP BY bid",
            Merge {
                grouping: Some(Grouping {
                    keys: vec![Column::Visible(0)],
                    aggregates: vec![(Column::Visible(1), Combine::Add)],
                }),
                having: Some(Condition::And(vec![
                    Condition::Compare {
                        left: Operand::Column(Column::Visible(1)),
                        op: CompareOp::Gt,
                        right: Operand::Constant("1".into()),
                    },
                    Condition::Not(Box::new(Condition::Compare {
                        left: Operand::Column(Column::Visible(0)),
                        op: CompareOp::Eq,
                        right: Operand::Constant("3".into()),
                    })),
                ])),
                ..merge()
            },
        ),
        // An aggregate only HAVING reads comes back hidden; an average as its sum and count.
        (
            "SELECT bid FROM accounts GROUP BY bid HAVING avg(abalance) > 2.5 OR count(*) < 3",
            "SELECT bid, count(abalance) AS pgherd_hidden_1, sum(abalance) AS pgherd_hidden_2, count(*) AS pgherd_hidden_3 FROM accounts GROUP BY bid",
            Merge {
                hidden_columns: 3,
                grouping: Some(Grouping {
                    keys: vec![Column::Visible(0)],
                    aggregates: vec![
                        (
                            Column::Hidden(1),
                            Combine::Average {
                                count: Column::Hidden(0),
                            },
                        ),
                        (Column::Hidden(2), Combine::Add),
                    ],
                }),
                having: Some(Condition::Or(vec![
                    Condition::Compare {
                        left: Operand::Column(Column::Hidden(1)),
                        op: CompareOp::Gt,
                        right: Operand::Constant("2.5".into()),
                    },
                    Condition::Compare {
                        left: Operand::Column(Column::Hidden(2)),
                        op: CompareOp::Lt,
                        right: Operand::Constant("3".into()),
                    },
                ])),
                ..merge()
            },
        ),
        // The shards hold disjoint keys: distinct counts of the key add up.
        (
            "SELECT count(DISTINCT aid), max(DISTINCT bid) FROM accounts",
            "SELECT count(DISTINCT aid), max(DISTINCT bid), pg_catalog.pg_collation_for(max(DISTINCT bid)::pg_catalog.text) AS pgherd_hidden_1 FROM accounts",
            Merge {
                hidden_columns: 1,
                collations: vec![(Column::Visible(1), Column::Hidden(0))],
                grouping: Some(Grouping {
                    keys: vec![],
                    aggregates: vec![(Column::Visible(0), Combine::Add), (Column::Visible(1), Combine::Max)],
                }),
                ..merge()
            },
        ),
    ];
    check(cases);
}

#[test]
fn what_has_no_exact_merge_is_refused_naming_it() {
    let cases = [
        (
            "SELECT count(DISTINCT bid) FROM accounts",
            "count(DISTINCT ...)",
        ),
        (
            "SELECT sum(DISTINCT abalance) FROM accounts",
            "sum(DISTINCT ...)",
        ),
        (
            "SELECT string_agg(filler, ',') FROM accounts",
            "the aggregate string_agg",
        ),
        (
            "SELECT my_agg(abalance) FROM accounts",
            "the aggregate my_agg",
        ),
        (
            "SELECT sum(abalance) + 1 FROM accounts",
            "an expression over an aggregate",
        ),
        (
            "SELECT coalesce(max(abalance), 0) FROM accounts",
            "an expression over an aggregate",
        ),
        (
            "SELECT count(*) FILTER (WHERE abalance > 0) FROM accounts",
            "with FILTER or ORDER BY",
        ),
        (
            "SELECT aid, rank() OVER (ORDER BY abalance) FROM accounts",
            "a window function",
        ),
        (
            "SELECT bid, count(*) FROM accounts GROUP BY bid HAVING sum(abalance) + 1 > 1",
            "this HAVING condition",
        ),
        (
            "SELECT 1 FROM accounts HAVING count(*) > 1",
            "HAVING without aggregates or GROUP BY",
        ),
        (
            "SELECT DISTINCT ON (bid) bid, aid FROM accounts",
            "DISTINCT ON",
        ),
        (
            "SELECT bid, count(*) FROM accounts GROUP BY ROLLUP (bid)",
            "grouping sets",
        ),
        ("SELECT aid FROM accounts ORDER BY aid USING <", "USING"),
        (
            "SELECT aid FROM accounts ORDER BY aid FETCH FIRST 3 ROWS WITH TIES",
            "WITH TIES",
        ),
        (
            "SELECT aid FROM accounts LIMIT $1",
            "LIMIT given by a parameter",
        ),
        (
            "SELECT bid, count(*) FROM accounts GROUP BY bid ORDER BY sum(abalance)",
            "ORDER BY an expression outside the select list",
        ),
        (
            "SELECT DISTINCT bid FROM accounts ORDER BY aid",
            "ORDER BY an expression outside the select list",
        ),
        (
            "SELECT aid FROM accounts ORDER BY 3",
            "a position outside the select list",
        ),
        (
            "SELECT aid, (rank() OVER (ORDER BY abalance DESC))::int FROM accounts",
            "a window function",
        ),
        (
            "SELECT aid FROM accounts ORDER BY row_number() OVER (ORDER BY abalance) LIMIT 5",
            "a window function",
        ),
        (
            "SELECT *, abalance * 2 AS x FROM accounts ORDER BY x LIMIT 3",
            "* in the select list",
        ),
        (
            "SELECT sum(abalance) AS bid FROM accounts GROUP BY bid",
            "GROUP BY a name that is also the name of another select-list column",
        ),
        (
            "SELECT max(abalance) > ALL (SELECT bbalance FROM branches) FROM accounts",
            "an expression over an aggregate",
        ),
        (
            "SELECT aid, (SELECT max(bbalance) FROM branches) FROM accounts",
            "an expression over an aggregate",
        ),
        (
            "SELECT 'x' FROM accounts ORDER BY sum(abalance)",
            "ORDER BY an aggregate the select list does not have",
        ),
        (
            "SELECT rank(1000) WITHIN GROUP (ORDER BY abalance) FROM accounts",
            "the aggregate rank",
        ),
        (
            "SELECT count(DISTINCT aid) FROM accounts AS a(x, aid)",
            "count(DISTINCT ...)",
        ),
    ];
    for (sql, expected) in cases {
        let error = fan_out(sql).unwrap_err();
        assert!(
            error.contains(expected),
            "{sql}: {error} (expected {expected})"
        );
    }
}
