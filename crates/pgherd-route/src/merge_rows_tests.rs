//! The merge of fan-out rows: what PostgreSQL would answer from all the rows at once.

use super::*;
use crate::merge_plan::{Grouping, SortKey};

fn text(values: &[Option<&str>]) -> Row {
    values
        .iter()
        .map(|v| v.map(|s| s.as_bytes().to_vec()))
        .collect()
}

fn columns(oids: &[u32]) -> Vec<ColumnType> {
    oids.iter()
        .map(|&oid| ColumnType {
            oid,
            format: Format::Text,
        })
        .collect()
}

fn spec() -> Merge {
    Merge::default()
}

fn shown(rows: &[Row]) -> Vec<Vec<Option<String>>> {
    rows.iter()
        .map(|r| {
            r.iter()
                .map(|v| v.as_ref().map(|b| String::from_utf8_lossy(b).into_owned()))
                .collect()
        })
        .collect()
}

fn strings(rows: &[&[Option<&str>]]) -> Vec<Vec<Option<String>>> {
    rows.iter()
        .map(|r| r.iter().map(|v| v.map(str::to_owned)).collect())
        .collect()
}

#[test]
fn sorted_shards_merge_into_one_order_with_nulls_where_the_key_puts_them() {
    let merger = Merger::new(
        Merge {
            order_by: vec![SortKey {
                column: Column::Visible(0),
                descending: true,
                nulls_first: true,
            }],
            offset: 1,
            limit: Some(4),
            ..spec()
        },
        &columns(&[INT4, TEXT]),
        &[],
        &TextRules::bytewise(),
    )
    .unwrap();
    let shard = |rows: &[(Option<&str>, &str)]| {
        rows.iter()
            .map(|(k, v)| text(&[*k, Some(v)]))
            .collect::<Vec<_>>()
            .into_iter()
    };
    // Each shard sorted as its ORDER BY says (DESC: NULLs first).
    let merged: Vec<Row> = merger
        .merge_sorted(vec![
            shard(&[(None, "a-null"), (Some("10"), "a10"), (Some("2"), "a2")]),
            shard(&[(Some("9"), "b9"), (Some("-1"), "b-1")]),
            shard(&[(Some("100"), "c100"), (Some("3"), "c3")]),
        ])
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        shown(&merger.finish(merged).unwrap()),
        strings(&[
            &[Some("100"), Some("c100")],
            &[Some("10"), Some("a10")],
            &[Some("9"), Some("b9")],
            &[Some("3"), Some("c3")],
        ]),
        "NULL first, then 100 > 10 > 9 > 3 as integers, not as text; one skipped, four kept"
    );
}

#[test]
fn groups_combine_across_shards_and_averages_come_out_as_postgresql_gives_them() {
    // SELECT bid, count(*), sum(x), min(x), max(x), avg(x) ... GROUP BY bid, with avg's count
    // hidden after the visible columns.
    let merger = Merger::new(
        Merge {
            hidden_columns: 1,
            grouping: Some(Grouping {
                keys: vec![Column::Visible(0)],
                aggregates: vec![
                    (Column::Visible(1), Combine::Add),
                    (Column::Visible(2), Combine::Add),
                    (Column::Visible(3), Combine::Min),
                    (Column::Visible(4), Combine::Max),
                    (
                        Column::Visible(5),
                        Combine::Average {
                            count: Column::Hidden(0),
                        },
                    ),
                ],
            }),
            order_by: vec![SortKey {
                column: Column::Visible(0),
                descending: false,
                nulls_first: false,
            }],
            ..spec()
        },
        &columns(&[INT4, INT8, INT8, INT4, INT4, INT8, INT8]),
        &[],
        &TextRules::bytewise(),
    )
    .unwrap();
    let rows = vec![
        // shard 1: bid 1 has x = 1, 2; bid 2 has x = 5
        text(&[
            Some("1"),
            Some("2"),
            Some("3"),
            Some("1"),
            Some("2"),
            Some("3"),
            Some("2"),
        ]),
        text(&[
            Some("2"),
            Some("1"),
            Some("5"),
            Some("5"),
            Some("5"),
            Some("5"),
            Some("1"),
        ]),
        // shard 2: bid 1 has x = 10; bid 3 only NULLs
        text(&[
            Some("1"),
            Some("1"),
            Some("10"),
            Some("10"),
            Some("10"),
            Some("10"),
            Some("1"),
        ]),
        text(&[Some("3"), Some("2"), None, None, None, None, Some("0")]),
    ];
    let combined = merger.combine(rows).unwrap();
    assert_eq!(
        shown(&merger.finish(combined).unwrap()),
        strings(&[
            // avg(1, 2, 10) = 13 / 3, to 16 places as numeric_div gives it.
            &[
                Some("1"),
                Some("3"),
                Some("13"),
                Some("1"),
                Some("10"),
                Some("4.3333333333333333")
            ],
            &[
                Some("2"),
                Some("1"),
                Some("5"),
                Some("5"),
                Some("5"),
                Some("5.0000000000000000")
            ],
            &[Some("3"), Some("2"), None, None, None, None],
        ])
    );
}

#[test]
fn averages_take_postgresqls_division_scale() {
    // As `SELECT avg(x)` prints them on PostgreSQL 15.
    let cases = [
        ((3, 0), 2, "1.5000000000000000"),
        ((10, 0), 4, "2.5000000000000000"),
        ((1, 0), 1, "1.00000000000000000000"),
        ((375, 2), 2, "1.8750000000000000"),
        ((123_456_789, 0), 10, "12345678.900000000000"),
        ((-2, 0), 3, "-0.66666666666666666667"),
        ((2, 0), 3, "0.66666666666666666667"),
    ];
    for ((digits, scale), count, expected) in cases {
        let (d, s) = average(digits, scale, count).unwrap();
        assert_eq!(
            format_numeric(d, s),
            expected,
            "{digits}e-{scale} / {count}"
        );
    }
}

#[test]
fn equal_values_are_one_whatever_their_text() {
    let merger = Merger::new(
        Merge {
            distinct: true,
            ..spec()
        },
        &columns(&[NUMERIC, FLOAT8]),
        &[],
        &TextRules::bytewise(),
    )
    .unwrap();
    let rows = vec![
        text(&[Some("1.0"), Some("0")]),
        text(&[Some("1.00"), Some("-0")]),
        text(&[Some("2"), Some("NaN")]),
        text(&[Some("2.000"), Some("NaN")]),
    ];
    assert_eq!(merger.finish(rows).unwrap().len(), 2);
}

#[test]
fn floats_order_with_nan_above_everything() {
    let merger = Merger::new(
        Merge {
            order_by: vec![SortKey {
                column: Column::Visible(0),
                descending: false,
                nulls_first: false,
            }],
            ..spec()
        },
        &columns(&[FLOAT8]),
        &[],
        &TextRules::bytewise(),
    )
    .unwrap();
    let rows = ["NaN", "Infinity", "-1.5", "1e300", "-Infinity"]
        .iter()
        .map(|v| text(&[Some(v)]))
        .collect::<Vec<_>>();
    let sorted = merger.combine(rows).unwrap();
    assert_eq!(
        shown(&sorted),
        strings(&[
            &[Some("-Infinity")],
            &[Some("-1.5")],
            &[Some("1e300")],
            &[Some("Infinity")],
            &[Some("NaN")],
        ])
    );
}

#[test]
fn binary_integers_and_timestamps_order_by_value() {
    let merger = Merger::new(
        Merge {
            order_by: vec![SortKey {
                column: Column::Visible(0),
                descending: false,
                nulls_first: false,
            }],
            ..spec()
        },
        &[ColumnType {
            oid: TIMESTAMPTZ,
            format: Format::Binary,
        }],
        &[],
        &TextRules::bytewise(),
    )
    .unwrap();
    let rows: Vec<Row> = [5i64, -7, 300]
        .iter()
        .map(|v| vec![Some(v.to_be_bytes().to_vec())])
        .collect();
    let sorted = merger.combine(rows).unwrap();
    let values: Vec<i64> = sorted
        .iter()
        .map(|r| i64::from_be_bytes(r[0].clone().unwrap().try_into().unwrap()))
        .collect();
    assert_eq!(values, [-7, 5, 300]);
}

#[test]
fn what_cannot_be_ordered_or_added_exactly_is_refused() {
    let sort_by_first = Merge {
        order_by: vec![SortKey {
            column: Column::Visible(0),
            descending: false,
            nulls_first: false,
        }],
        ..spec()
    };
    // Text orders by its collation, which only the shards can name (see below).
    let error = Merger::new(
        sort_by_first.clone(),
        &columns(&[TEXT]),
        &[],
        &TextRules::bytewise(),
    )
    .err()
    .unwrap();
    assert_eq!(error.sqlstate(), SqlState::FEATURE_NOT_SUPPORTED);
    // Timestamps in text depend on the session's settings.
    assert!(Merger::new(
        sort_by_first,
        &columns(&[TIMESTAMPTZ]),
        &[],
        &TextRules::bytewise()
    )
    .is_err());
    // A float sum depends on the order of its additions.
    let float_sum = Merge {
        grouping: Some(Grouping {
            keys: vec![],
            aggregates: vec![(Column::Visible(0), Combine::Add)],
        }),
        ..spec()
    };
    let error = Merger::new(float_sum, &columns(&[FLOAT8]), &[], &TextRules::bytewise())
        .err()
        .unwrap();
    assert!(error.to_string().contains("floating-point"), "{error}");
}

#[test]
fn least_and_greatest_keep_their_values_and_numerics_compare_exactly() {
    let merger = Merger::new(
        Merge {
            grouping: Some(Grouping {
                keys: vec![],
                aggregates: vec![
                    (Column::Visible(0), Combine::Min),
                    (Column::Visible(1), Combine::Max),
                    (Column::Visible(2), Combine::Max),
                ],
            }),
            ..spec()
        },
        &columns(&[FLOAT8, NUMERIC, BOOL]),
        &[],
        &TextRules::bytewise(),
    )
    .unwrap();
    let rows = vec![
        text(&[
            Some("2.5"),
            Some("99999999999999999999999999999999.1"),
            Some("f"),
        ]),
        text(&[
            Some("-0.5"),
            Some("99999999999999999999999999999999.09"),
            Some("t"),
        ]),
        text(&[None, Some("-100000000000000000000000000000000"), None]),
    ];
    let combined = merger.combine(rows).unwrap();
    assert_eq!(
        shown(&merger.finish(combined).unwrap()),
        strings(&[&[
            Some("-0.5"),
            Some("99999999999999999999999999999999.1"),
            Some("t")
        ]])
    );
}

#[test]
fn a_value_that_cannot_be_read_is_an_error_not_a_misplaced_row() {
    let merger = Merger::new(
        Merge {
            order_by: vec![SortKey {
                column: Column::Visible(0),
                descending: false,
                nulls_first: false,
            }],
            ..spec()
        },
        &columns(&[INT4]),
        &[],
        &TextRules::bytewise(),
    )
    .unwrap();
    let merged: Vec<_> = merger
        .merge_sorted(vec![
            vec![text(&[Some("1")])].into_iter(),
            vec![text(&[Some("one")])].into_iter(),
        ])
        .collect();
    assert!(merged.iter().any(|r| r.is_err()), "{merged:?}");
}

#[test]
fn averages_sort_and_describe_themselves_as_numeric() {
    // SELECT bid, avg(x) ... GROUP BY bid ORDER BY 2 DESC: the shards' sums are bigint, the
    // averages numeric.
    let merger = Merger::new(
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
            ..spec()
        },
        &columns(&[INT4, INT8, INT8]),
        &[],
        &TextRules::bytewise(),
    )
    .unwrap();
    assert_eq!(merger.output_types(), columns(&[INT4, NUMERIC]));
    let rows = vec![
        text(&[Some("1"), Some("3"), Some("2")]),
        text(&[Some("2"), Some("10"), Some("1")]),
        text(&[Some("3"), Some("1"), Some("3")]),
        text(&[Some("1"), Some("1"), Some("1")]),
    ];
    let merged = merger.finish(merger.combine(rows).unwrap()).unwrap();
    assert_eq!(
        shown(&merged),
        strings(&[
            &[Some("2"), Some("10.0000000000000000")],
            &[Some("1"), Some("1.3333333333333333")],
            &[Some("3"), Some("0.33333333333333333333")],
        ])
    );
}

#[test]
fn groups_and_duplicates_need_values_whose_equal_ones_print_alike() {
    let group_by_first = Merge {
        grouping: Some(Grouping {
            keys: vec![Column::Visible(0)],
            aggregates: vec![],
        }),
        ..spec()
    };
    // An interval's '1 day' and '24:00:00' are equal.
    assert!(Merger::new(
        group_by_first.clone(),
        &columns(&[1186]),
        &[],
        &TextRules::bytewise()
    )
    .is_err());
    assert!(Merger::new(
        group_by_first,
        &columns(&[TEXT]),
        &[],
        &TextRules::bytewise()
    )
    .is_ok());
    let distinct = Merge {
        distinct: true,
        ..spec()
    };
    let binary_interval = [ColumnType {
        oid: 1186,
        format: Format::Binary,
    }];
    assert!(Merger::new(distinct, &binary_interval, &[], &TextRules::bytewise()).is_err());
}

#[test]
fn binary_sums_and_averages_add_up_and_come_back_binary() {
    use crate::merge_numeric::{decode_binary, encode_binary};
    // SELECT sum(x), avg(x) FROM t, x bigint, every column in binary: the shards' sums are
    // numeric, avg's count bigint.
    let binary = |oid| ColumnType {
        oid,
        format: Format::Binary,
    };
    let merger = Merger::new(
        Merge {
            hidden_columns: 1,
            grouping: Some(Grouping {
                keys: vec![],
                aggregates: vec![
                    (Column::Visible(0), Combine::Add),
                    (
                        Column::Visible(1),
                        Combine::Average {
                            count: Column::Hidden(0),
                        },
                    ),
                ],
            }),
            ..spec()
        },
        &[binary(NUMERIC), binary(NUMERIC), binary(INT8)],
        &[],
        &TextRules::bytewise(),
    )
    .unwrap();
    assert_eq!(
        merger.output_types(),
        vec![binary(NUMERIC), binary(NUMERIC)]
    );
    let shard = |sum: i128, scale: u32, count: i64| -> Row {
        vec![
            Some(encode_binary((sum, scale)).unwrap()),
            Some(encode_binary((sum, scale)).unwrap()),
            Some(count.to_be_bytes().to_vec()),
        ]
    };
    let rows = vec![shard(10, 0, 4), shard(55, 1, 1)];
    let merged = merger.finish(merger.combine(rows).unwrap()).unwrap();
    let value = |i: usize| decode_binary(merged[0][i].as_deref().unwrap()).unwrap();
    // 10 + 5.5; 15.5 / 5 at avg's scale (16 significant digits).
    assert_eq!(value(0), (155, 1));
    assert_eq!(value(1), (31_000_000_000_000_000, 16));
}

#[test]
fn having_keeps_groups_whose_condition_is_true_not_unknown() {
    use crate::merge_plan::{CompareOp, Condition, Operand};
    // SELECT bid, count(*) ... GROUP BY bid HAVING NOT (bid = 3) AND count(*) > 1.5
    let merger = Merger::new(
        Merge {
            grouping: Some(Grouping {
                keys: vec![Column::Visible(0)],
                aggregates: vec![(Column::Visible(1), Combine::Add)],
            }),
            having: Some(Condition::And(vec![
                Condition::Not(Box::new(Condition::Compare {
                    left: Operand::Column(Column::Visible(0)),
                    op: CompareOp::Eq,
                    right: Operand::Constant("3".into()),
                })),
                Condition::Compare {
                    left: Operand::Column(Column::Visible(1)),
                    op: CompareOp::Gt,
                    right: Operand::Constant("1.5".into()),
                },
            ])),
            order_by: vec![SortKey {
                column: Column::Visible(0),
                descending: false,
                nulls_first: false,
            }],
            ..spec()
        },
        &columns(&[INT4, INT8]),
        &[],
        &TextRules::bytewise(),
    )
    .unwrap();
    let rows = vec![
        text(&[Some("1"), Some("1")]),
        text(&[Some("1"), Some("1")]),
        text(&[Some("2"), Some("1")]),
        text(&[Some("3"), Some("5")]),
        text(&[None, Some("9")]),
    ];
    let merged = merger.finish(merger.combine(rows).unwrap()).unwrap();
    // 1 has 2 > 1.5; 2 has 1; 3 is excluded; NULL = 3 is unknown, and so is its NOT.
    assert_eq!(shown(&merged), strings(&[&[Some("1"), Some("2")]]));
}

/// A stand-in for the C library's collation: ASCII letters without their case.
struct CaseBlind;

impl Collator for CaseBlind {
    fn compare(&self, a: &[u8], b: &[u8]) -> Ordering {
        a.to_ascii_lowercase().cmp(&b.to_ascii_lowercase())
    }
}

fn with_collator() -> TextRules {
    TextRules {
        default_order: Ok(Some(Arc::new(CaseBlind))),
        deterministic: true,
    }
}

/// `SELECT name FROM t ORDER BY name`, the name's collation in a hidden column.
fn sort_by_name() -> Merge {
    Merge {
        hidden_columns: 1,
        order_by: vec![SortKey {
            column: Column::Visible(0),
            descending: false,
            nulls_first: false,
        }],
        collations: vec![(Column::Visible(0), Column::Hidden(0))],
        ..spec()
    }
}

fn named(value: &str, collation: &str) -> Row {
    vec![Some(value.into()), Some(collation.into())]
}

fn sorted_names(merger: &Merger, shards: Vec<Vec<Row>>) -> Vec<String> {
    let merged: Vec<Row> = merger
        .merge_sorted(shards.into_iter().map(Vec::into_iter).collect())
        .collect::<Result<_, _>>()
        .expect("merge");
    merger
        .finish(merged)
        .expect("finish")
        .into_iter()
        .map(|row| String::from_utf8(row[0].clone().unwrap()).unwrap())
        .collect()
}

#[test]
fn text_orders_by_the_collation_the_shards_name() {
    let types = columns(&[TEXT, TEXT]);
    let shards = |collation: &str| {
        vec![
            vec![named("a", collation), named("b", collation)],
            vec![named("B", collation), named("c", collation)],
        ]
    };
    // The database's default collation, by the collator; its ties by bytes.
    let rows = shards("\"default\"");
    let first: Vec<&Row> = rows.iter().map(|r| &r[0]).collect();
    let merger = Merger::new(sort_by_name(), &types, &first, &with_collator()).unwrap();
    assert_eq!(sorted_names(&merger, rows), ["a", "B", "b", "c"]);
    // C (named in the statement, a column's, or the database's): bytes.
    for (collation, rules) in [
        ("\"C\"", with_collator()),
        ("\"POSIX\"", with_collator()),
        ("\"default\"", TextRules::bytewise()),
    ] {
        let rows = shards(collation);
        let first: Vec<&Row> = rows.iter().map(|r| &r[0]).collect();
        let merger = Merger::new(sort_by_name(), &types, &first, &rules).unwrap();
        assert_eq!(
            sorted_names(&merger, rows),
            ["B", "a", "b", "c"],
            "{collation}"
        );
    }
    // A collation pgherd cannot apply is refused, naming why.
    for (collation, rules, why) in [
        ("\"en_US\"", with_collator(), "\"en_US\""),
        (
            "\"default\"",
            TextRules::unknown("the database's collation xx_XX.UTF-8"),
            "xx_XX",
        ),
    ] {
        let rows = shards(collation);
        let first: Vec<&Row> = rows.iter().map(|r| &r[0]).collect();
        let error = Merger::new(sort_by_name(), &types, &first, &rules)
            .err()
            .unwrap();
        assert_eq!(error.sqlstate(), SqlState::FEATURE_NOT_SUPPORTED);
        assert!(error.to_string().contains(why), "{error}");
    }
    // A column of a type without a collation (NULL) orders by its type.
    let ints = columns(&[INT4, TEXT]);
    let row: Row = vec![Some(b"1".to_vec()), None];
    assert!(Merger::new(sort_by_name(), &ints, &[&row], &TextRules::unknown("x")).is_ok());
}

#[test]
fn least_and_greatest_text_follow_the_collation() {
    // SELECT min(name), max(name) FROM t, each with its collation.
    let spec = Merge {
        hidden_columns: 2,
        grouping: Some(Grouping {
            keys: vec![],
            aggregates: vec![
                (Column::Visible(0), Combine::Min),
                (Column::Visible(1), Combine::Max),
            ],
        }),
        collations: vec![
            (Column::Visible(0), Column::Hidden(0)),
            (Column::Visible(1), Column::Hidden(1)),
        ],
        ..spec()
    };
    let row = |min: &str, max: &str| -> Row {
        [min, max, "\"default\"", "\"default\""]
            .iter()
            .map(|v| Some(v.as_bytes().to_vec()))
            .collect()
    };
    let rows = vec![row("b", "Y"), row("A", "x")];
    let first: Vec<&Row> = rows.iter().collect();
    let merger = Merger::new(spec, &columns(&[TEXT; 4]), &first, &with_collator()).unwrap();
    let merged = merger.finish(merger.combine(rows).unwrap()).unwrap();
    assert_eq!(merged, vec![vec![Some(b"A".to_vec()), Some(b"Y".to_vec())]]);
}

#[test]
fn text_groups_by_bytes_only_if_every_collation_is_deterministic() {
    let distinct = Merge {
        distinct: true,
        ..spec()
    };
    assert!(Merger::new(
        distinct.clone(),
        &columns(&[TEXT]),
        &[],
        &TextRules::bytewise()
    )
    .is_ok());
    let nondeterministic = TextRules {
        default_order: Ok(None),
        deterministic: false,
    };
    assert!(Merger::new(distinct, &columns(&[TEXT]), &[], &nondeterministic).is_err());
}
