//! A consistency check's decisions: which tables it reads, how it cuts each into chunks (ranges
//! of the primary key), what every node is asked for a chunk, and how the answers compare.
//!
//! A chunk's checksum is the sum, as numeric, of the first 64 bits of each row's md5 (of the
//! row's text, its columns in the reference node's order, under fixed output settings): it does
//! not depend on row order or physical layout, and a changed, missing or extra row changes it
//! (two rows' differences would have to cancel out in the sum: not by accident). The count
//! goes along, so a report says how many rows each node has in a range that differs.
//!
//! Where the chunks are cut and when each node computes its sums (the same point for all) is
//! the caller's: this module only builds the statements and reads their answers.

use serde::Serialize;

/// What every checking session sets first: a value's text must be the same on every node,
/// whatever each server or role has configured.
pub const SESSION_SETTINGS_SQL: &str = "SET DateStyle = 'ISO, YMD'; \
     SET IntervalStyle = 'postgres'; SET TimeZone = 'UTC'; SET extra_float_digits = 1; \
     SET bytea_output = 'hex'; SET standard_conforming_strings = on; SET lc_monetary = 'C'; \
     SET search_path = pg_catalog";

/// The tables a check reads, from the reference node: every permanent ordinary table (a
/// partitioned table's rows are read in its partitions) outside the system schemas, with its
/// columns and its primary key's columns and types, as quoted identifiers.
pub const TABLES_SQL: &str = "\
SELECT n.nspname || '.' || c.relname, format('%I.%I', n.nspname, c.relname), \
       greatest(c.reltuples, 0)::bigint::text, \
       (SELECT json_agg(format('%I', a.attname) ORDER BY a.attnum) \
          FROM pg_attribute a \
         WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)::text, \
       (SELECT json_agg(json_build_array(format('%I', a.attname), \
                                         format_type(a.atttypid, a.atttypmod)) ORDER BY k.ord) \
          FROM pg_index i \
          CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) \
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
         WHERE i.indrelid = c.oid AND i.indisprimary)::text, \
       (c.relreplident = 'f')::text \
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
 WHERE c.relkind = 'r' AND c.relpersistence = 'p' \
   AND n.nspname NOT IN ('pg_catalog', 'information_schema') \
   AND n.nspname !~ '^pg_(toast|temp_)' \
 ORDER BY 1";

/// A column of a table's primary key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyColumn {
    /// As a quoted identifier.
    pub sql_name: String,
    /// As `format_type` writes it (a literal is cast to it).
    pub type_name: String,
}

/// A table as the reference node describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableShape {
    /// `schema.table`, unquoted: what patterns match and reports show.
    pub name: String,
    /// Quoted and qualified, for statements.
    pub sql_name: String,
    /// The planner's estimate, for progress only.
    pub estimated_rows: u64,
    /// Quoted, in the table's order.
    pub columns: Vec<String>,
    /// Its primary key's columns in key order; empty without one (the table is then one
    /// chunk, and a difference cannot be narrowed to a key range).
    pub key: Vec<KeyColumn>,
    /// `REPLICA IDENTITY FULL`: logical replication finds its rows by every column, so it
    /// carries updates and deletes without a key.
    pub full_identity: bool,
    /// A set's row filter for the table on its origin (`pg_publication_tables.rowfilter`):
    /// the rows a subscriber holds. Applied on the origin only, so that a subscriber's row
    /// outside it shows as a difference.
    pub row_filter: Option<String>,
}

/// A row of [`TABLES_SQL`]'s answer that does not read as one.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unreadable table description from the reference node: {0}")]
pub struct ShapeError(String);

impl TableShape {
    /// Reads one row of [`TABLES_SQL`]'s answer.
    pub fn from_row(row: &[Option<String>]) -> Result<TableShape, ShapeError> {
        let field = |i: usize| row.get(i).and_then(|v| v.as_deref());
        let (Some(name), Some(sql_name), Some(estimate), Some(columns)) =
            (field(0), field(1), field(2), field(3))
        else {
            return Err(ShapeError(format!("{row:?}")));
        };
        let columns: Vec<String> =
            serde_json::from_str(columns).map_err(|e| ShapeError(format!("columns: {e}")))?;
        let key: Vec<(String, String)> = match field(4) {
            Some(key) => serde_json::from_str(key).map_err(|e| ShapeError(format!("key: {e}")))?,
            None => Vec::new(),
        };
        Ok(TableShape {
            name: name.to_owned(),
            sql_name: sql_name.to_owned(),
            estimated_rows: estimate.parse().unwrap_or(0),
            columns,
            key: key
                .into_iter()
                .map(|(sql_name, type_name)| KeyColumn {
                    sql_name,
                    type_name,
                })
                .collect(),
            full_identity: field(5) == Some("true"),
            row_filter: None,
        })
    }

    /// Logical replication can carry its updates and deletes: it has a primary key, or
    /// `REPLICA IDENTITY FULL`.
    pub fn replicable(&self) -> bool {
        !self.key.is_empty() || self.full_identity
    }

    fn key_list(&self) -> String {
        self.key
            .iter()
            .map(|k| k.sql_name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `(k1, k2) <op> ('v1'::t1, 'v2'::t2)`: row comparison, as the key's index orders.
    fn key_compared(&self, op: &str, values: &[String]) -> String {
        let literals: Vec<String> = self
            .key
            .iter()
            .zip(values)
            .map(|(k, v)| format!("{}::{}", quote_literal(v), k.type_name))
            .collect();
        format!("({}) {op} ({})", self.key_list(), literals.join(", "))
    }

    fn chunk_condition(&self, chunk: &Chunk, filtered: bool) -> String {
        let mut conditions = Vec::new();
        if let Some(filter) = self.row_filter.as_ref().filter(|_| filtered) {
            conditions.push(format!("({filter})"));
        }
        if let Some(after) = &chunk.after {
            conditions.push(self.key_compared(">", after));
        }
        if let Some(through) = &chunk.through {
            conditions.push(self.key_compared("<=", through));
        }
        if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        }
    }

    /// The last key of the chunk that starts after `after` and holds `chunk_rows` rows: one
    /// row of the key's columns as text, or none when fewer rows are left (the chunk then
    /// runs to the end of the table).
    pub fn boundary_sql(&self, after: Option<&[String]>, chunk_rows: u64) -> String {
        // Named apart: `ORDER BY id` would sort by an output column `id`, the text.
        let columns: Vec<String> = self
            .key
            .iter()
            .enumerate()
            .map(|(i, k)| format!("{}::text AS pgherd_key_{i}", k.sql_name))
            .collect();
        let chunk = Chunk {
            after: after.map(<[String]>::to_vec),
            through: None,
        };
        let condition = self.chunk_condition(&chunk, true);
        format!(
            "SELECT {} FROM {}{condition} ORDER BY {} OFFSET {} LIMIT 1",
            columns.join(", "),
            self.sql_name,
            self.key_list(),
            chunk_rows.max(1) - 1
        )
    }

    /// The chunk's row count and checksum, as text; `filtered` on the origin of a set with a
    /// row filter.
    pub fn checksum_sql(&self, chunk: &Chunk, filtered: bool) -> String {
        format!(
            "SELECT count(*)::text, \
             coalesce(sum(('x' || left(md5(ROW({})::text), 16))::bit(64)::bigint), 0)::text \
             FROM {}{}",
            self.columns.join(", "),
            self.sql_name,
            self.chunk_condition(chunk, filtered)
        )
    }
}

/// A string as an SQL literal (with `standard_conforming_strings` on, as every checking
/// session sets it).
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// A range of a table's key: after `after` (from the start if none) through `through` (to
/// the end if none). A table without a key is one chunk with neither.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Chunk {
    pub after: Option<Vec<String>>,
    pub through: Option<Vec<String>>,
}

impl Chunk {
    /// The chunk after this one, given the last key of this one.
    pub fn next(&self) -> Option<Chunk> {
        self.through.as_ref().map(|through| Chunk {
            after: Some(through.clone()),
            through: None,
        })
    }
}

/// One node's answer for a chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChunkSum {
    pub rows: u64,
    pub checksum: String,
}

impl ChunkSum {
    /// Reads the one row of [`TableShape::checksum_sql`]'s answer.
    pub fn from_row(row: &[Option<String>]) -> Option<ChunkSum> {
        let rows = row.first()?.as_deref()?.parse().ok()?;
        let checksum = row.get(1)?.as_deref()?.to_owned();
        Some(ChunkSum { rows, checksum })
    }
}

/// A key range whose rows are not the same on every node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DifferingRange {
    #[serde(flatten)]
    pub chunk: Chunk,
    /// Rows in the range, per node (in the check's node order).
    pub rows: Vec<u64>,
    /// The nodes whose rows there differ from the reference's (the first node).
    pub differing_nodes: Vec<String>,
}

/// One table's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TableReport {
    pub table: String,
    /// Rows per node, in the check's node order.
    pub rows: Vec<u64>,
    pub chunks: u64,
    pub differing: Vec<DifferingRange>,
    /// It has no primary key: it was compared whole, and a difference has no key range.
    pub no_key: bool,
}

impl TableReport {
    pub fn new(table: &TableShape, nodes: usize) -> TableReport {
        TableReport {
            table: table.name.clone(),
            rows: vec![0; nodes],
            chunks: 0,
            differing: Vec::new(),
            no_key: table.key.is_empty(),
        }
    }

    /// Adds one chunk's answers, the reference node's first, the others in node order.
    pub fn add_chunk(&mut self, chunk: &Chunk, sums: &[ChunkSum], nodes: &[String]) {
        self.chunks += 1;
        for (total, sum) in self.rows.iter_mut().zip(sums) {
            *total += sum.rows;
        }
        let Some(reference) = sums.first() else {
            return;
        };
        let differing_nodes: Vec<String> = sums
            .iter()
            .zip(nodes)
            .skip(1)
            .filter(|(sum, _)| *sum != reference)
            .map(|(_, node)| node.clone())
            .collect();
        if !differing_nodes.is_empty() {
            self.differing.push(DifferingRange {
                chunk: chunk.clone(),
                rows: sums.iter().map(|s| s.rows).collect(),
                differing_nodes,
            });
        }
    }

    pub fn is_same(&self) -> bool {
        self.differing.is_empty()
    }
}

/// Whether `name` (`schema.table`) matches one of `patterns` (`*` any run of characters, `?`
/// one; a pattern without a dot is matched against the table name alone). No patterns:
/// every table.
pub fn table_selected(name: &str, patterns: &[String]) -> bool {
    if patterns.is_empty() {
        return true;
    }
    let table_only = name.split_once('.').map_or(name, |(_, table)| table);
    patterns.iter().any(|p| {
        let subject = if p.contains('.') { name } else { table_only };
        glob_match(p.as_bytes(), subject.as_bytes())
    })
}

fn glob_match(pattern: &[u8], subject: &[u8]) -> bool {
    match (pattern.first(), subject.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            glob_match(&pattern[1..], subject)
                || (!subject.is_empty() && glob_match(pattern, &subject[1..]))
        }
        (Some(b'?'), Some(_)) => glob_match(&pattern[1..], &subject[1..]),
        (Some(p), Some(s)) if p == s => glob_match(&pattern[1..], &subject[1..]),
        _ => false,
    }
}

/// How long to wait before the next chunk so that no more than `max_rows_per_s` rows are read
/// per second on average (0: no limit).
pub fn pause_before_next_ms(rows_read: u64, elapsed_ms: u64, max_rows_per_s: u64) -> u64 {
    if max_rows_per_s == 0 {
        return 0;
    }
    let due_ms = rows_read.saturating_mul(1000) / max_rows_per_s;
    due_ms.saturating_sub(elapsed_ms)
}

/// The report as text: a line per table, and under a table that differs a line per range.
pub fn render(reports: &[TableReport], nodes: &[String]) -> String {
    let mut out = String::new();
    for report in reports {
        let rows: Vec<String> = report
            .rows
            .iter()
            .zip(nodes)
            .map(|(rows, node)| format!("{node} {rows}"))
            .collect();
        let verdict = if report.is_same() {
            format!("same in {} chunks", report.chunks)
        } else {
            format!(
                "DIFFERS in {} of {} chunks",
                report.differing.len(),
                report.chunks
            )
        };
        let note = if report.no_key {
            " (no primary key: compared whole)"
        } else {
            ""
        };
        out.push_str(&format!(
            "{}: {verdict}; rows: {}{note}\n",
            report.table,
            rows.join(", ")
        ));
        for range in &report.differing {
            let rows: Vec<String> = range
                .rows
                .iter()
                .zip(nodes)
                .map(|(rows, node)| format!("{node} {rows}"))
                .collect();
            out.push_str(&format!(
                "    key {}: rows {}; differs on {}\n",
                describe_range(&range.chunk),
                rows.join(", "),
                range.differing_nodes.join(", ")
            ));
        }
    }
    let differing = reports.iter().filter(|r| !r.is_same()).count();
    out.push_str(&format!(
        "{} tables checked on {}: {}\n",
        reports.len(),
        nodes.join(", "),
        match differing {
            0 => "no difference".to_owned(),
            n => format!("{n} differ"),
        }
    ));
    out
}

fn describe_range(chunk: &Chunk) -> String {
    let values = |v: &Vec<String>| format!("({})", v.join(", "));
    match (&chunk.after, &chunk.through) {
        (None, None) => "(whole table)".to_owned(),
        (Some(a), None) => format!("> {}", values(a)),
        (None, Some(t)) => format!("<= {}", values(t)),
        (Some(a), Some(t)) => format!("> {} and <= {}", values(a), values(t)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accounts() -> TableShape {
        TableShape::from_row(&[
            Some("public.accounts".into()),
            Some("public.accounts".into()),
            Some("1000".into()),
            Some(r#"["id", "region", "\"Balance\""]"#.into()),
            Some(r#"[["region", "text"], ["id", "integer"]]"#.into()),
        ])
        .unwrap()
    }

    fn sum(rows: u64, checksum: &str) -> ChunkSum {
        ChunkSum {
            rows,
            checksum: checksum.into(),
        }
    }

    #[test]
    fn a_table_description_reads_with_its_key_in_key_order() {
        let t = accounts();
        assert_eq!(t.columns, vec!["id", "region", "\"Balance\""]);
        assert_eq!(
            t.key,
            vec![
                KeyColumn {
                    sql_name: "region".into(),
                    type_name: "text".into()
                },
                KeyColumn {
                    sql_name: "id".into(),
                    type_name: "integer".into()
                }
            ]
        );
        let no_key = TableShape::from_row(&[
            Some("public.log".into()),
            Some("public.log".into()),
            Some("-1".into()),
            Some(r#"["line"]"#.into()),
            None,
        ])
        .unwrap();
        assert!(no_key.key.is_empty());
        assert!(TableShape::from_row(&[Some("x".into())]).is_err());
    }

    #[test]
    fn chunks_are_key_ranges_with_quoted_literals() {
        let t = accounts();
        assert_eq!(
            t.boundary_sql(None, 500),
            "SELECT region::text AS pgherd_key_0, id::text AS pgherd_key_1 FROM public.accounts ORDER BY region, id OFFSET 499 LIMIT 1"
        );
        let after = vec!["O'Brien".to_owned(), "7".to_owned()];
        assert_eq!(
            t.boundary_sql(Some(&after), 1),
            "SELECT region::text AS pgherd_key_0, id::text AS pgherd_key_1 FROM public.accounts WHERE (region, id) > ('O''Brien'::text, '7'::integer) ORDER BY region, id OFFSET 0 LIMIT 1"
        );
        let chunk = Chunk {
            after: Some(after),
            through: Some(vec!["z".into(), "1".into()]),
        };
        let sql = t.checksum_sql(&chunk, true);
        assert!(
            sql.contains("md5(ROW(id, region, \"Balance\")::text)"),
            "{sql}"
        );
        assert!(
            sql.ends_with("FROM public.accounts WHERE (region, id) > ('O''Brien'::text, '7'::integer) AND (region, id) <= ('z'::text, '1'::integer)"),
            "{sql}"
        );
        assert_eq!(
            chunk.next(),
            Some(Chunk {
                after: Some(vec!["z".into(), "1".into()]),
                through: None
            })
        );
        assert_eq!(Chunk::default().next(), None);
        assert!(t
            .checksum_sql(&Chunk::default(), true)
            .ends_with("FROM public.accounts"));
    }

    /// A set's row filter narrows the origin's rows (the chunks' cuts and sums); a
    /// subscriber's sum is of everything it holds in the chunk.
    #[test]
    fn a_row_filter_applies_on_the_origin_only() {
        let t = TableShape {
            row_filter: Some("(id >= 1500)".into()),
            ..accounts()
        };
        assert_eq!(
            t.boundary_sql(None, 10),
            "SELECT region::text AS pgherd_key_0, id::text AS pgherd_key_1 FROM public.accounts WHERE ((id >= 1500)) ORDER BY region, id OFFSET 9 LIMIT 1"
        );
        let chunk = Chunk {
            after: None,
            through: Some(vec!["z".into(), "1".into()]),
        };
        assert!(t
            .checksum_sql(&chunk, true)
            .ends_with("WHERE ((id >= 1500)) AND (region, id) <= ('z'::text, '1'::integer)"));
        assert!(t
            .checksum_sql(&chunk, false)
            .ends_with("FROM public.accounts WHERE (region, id) <= ('z'::text, '1'::integer)"));
    }

    #[test]
    fn a_chunk_differs_where_any_node_differs_from_the_reference() {
        let t = accounts();
        let nodes: Vec<String> = ["pg1", "pg2", "pg3"].map(String::from).to_vec();
        let mut report = TableReport::new(&t, 3);
        let first = Chunk {
            after: None,
            through: Some(vec!["a".into(), "10".into()]),
        };
        report.add_chunk(&first, &[sum(10, "5"), sum(10, "5"), sum(10, "5")], &nodes);
        assert!(report.is_same());
        let second = first.next().unwrap();
        // Same count, another checksum on pg3: a changed row.
        report.add_chunk(&second, &[sum(4, "9"), sum(4, "9"), sum(4, "8")], &nodes);
        assert_eq!(report.rows, vec![14, 14, 14]);
        assert_eq!(report.chunks, 2);
        assert_eq!(report.differing.len(), 1);
        assert_eq!(report.differing[0].differing_nodes, vec!["pg3"]);
        assert_eq!(report.differing[0].chunk, second);
        let text = render(&[report], &nodes);
        assert!(
            text.contains(
                "public.accounts: DIFFERS in 1 of 2 chunks; rows: pg1 14, pg2 14, pg3 14"
            ),
            "{text}"
        );
        assert!(
            text.contains("key > (a, 10): rows pg1 4, pg2 4, pg3 4; differs on pg3"),
            "{text}"
        );
        assert!(
            text.ends_with("1 tables checked on pg1, pg2, pg3: 1 differ\n"),
            "{text}"
        );
    }

    #[test]
    fn patterns_pick_tables() {
        let all: Vec<String> = Vec::new();
        assert!(table_selected("public.accounts", &all));
        let p = |s: &str| vec![s.to_owned()];
        assert!(table_selected("public.accounts", &p("acc*")));
        assert!(table_selected("public.accounts", &p("public.*")));
        assert!(!table_selected("audit.accounts", &p("public.*")));
        assert!(table_selected("public.a1", &p("a?")));
        assert!(!table_selected("public.a12", &p("a?")));
        assert!(table_selected("s.x", &p("*")));
    }

    #[test]
    fn the_rate_limit_spreads_reads_over_time() {
        assert_eq!(pause_before_next_ms(10_000, 0, 0), 0);
        assert_eq!(pause_before_next_ms(10_000, 400, 10_000), 600);
        assert_eq!(pause_before_next_ms(10_000, 1_500, 10_000), 0);
    }

    #[test]
    fn reading_a_sum() {
        assert_eq!(
            ChunkSum::from_row(&[Some("3".into()), Some("-12".into())]),
            Some(sum(3, "-12"))
        );
        assert_eq!(
            ChunkSum::from_row(&[Some("x".into()), Some("1".into())]),
            None
        );
    }
}
