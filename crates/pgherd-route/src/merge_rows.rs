//! The merge of a fan-out's rows ([`crate::merge_plan::Merge`]), pure: rows from every shard
//! in, the client's rows out. Values are compared and combined as PostgreSQL would for their
//! type, read from the wire format the shards used (text, or binary for integers, floats and
//! timestamps); a type this cannot order or add exactly is refused rather than guessed.
//!
//! Sorted shard streams merge lazily ([`Merger::merge_sorted`], the k-way merge of
//! [`crate::merge_stream`], which keeps one row per shard); grouping needs every row first
//! ([`Merger::combine`]).

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

use pgherd_wire::SqlState;

use crate::merge_numeric::{
    add_numeric, average, compare_numeric, decode_binary, encode_binary, format_numeric,
    parse_numeric,
};
use crate::merge_plan::{Column, Combine, CompareOp, Condition, Merge, Operand};
use crate::merge_stream::{Finisher, MergeSorted, Taken};

/// One value of a row, as the server sent it (`None`: NULL).
pub type Value = Option<Vec<u8>>;
pub type Row = Vec<Value>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Binary,
}

/// A column of the shards' rows, from their RowDescription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColumnType {
    pub oid: u32,
    pub format: Format,
}

const BOOL: u32 = 16;
const NAME: u32 = 19;
const INT8: u32 = 20;
const INT2: u32 = 21;
const INT4: u32 = 23;
const TEXT: u32 = 25;
const OID: u32 = 26;
const FLOAT4: u32 = 700;
const FLOAT8: u32 = 701;
const VARCHAR: u32 = 1043;
const TIMESTAMP: u32 = 1114;
const TIMESTAMPTZ: u32 = 1184;
const NUMERIC: u32 = 1700;
const UUID: u32 = 2950;

/// The order of one collation's text, as the proxy can apply it (the C library's, for the
/// database's default collation, once it checked the servers use the very same).
pub trait Collator: Send + Sync {
    /// The collation's order of two strings; the merge breaks its ties by their bytes, as
    /// PostgreSQL does for a deterministic collation.
    fn compare(&self, a: &[u8], b: &[u8]) -> Ordering;
}

/// What the database says about its text, as far as merging it needs.
#[derive(Clone)]
pub struct TextRules {
    /// How text of the database's default collation orders: `Ok(None)` by its bytes (C,
    /// POSIX), `Err` why pgherd cannot order it as the servers do.
    pub default_order: Result<Option<Arc<dyn Collator>>, String>,
    /// Every collation the database has is deterministic: equal text has equal bytes, so
    /// grouping and DISTINCT may compare bytes.
    pub deterministic: bool,
}

impl TextRules {
    /// A database whose default collation is C.
    pub fn bytewise() -> TextRules {
        TextRules {
            default_order: Ok(None),
            deterministic: true,
        }
    }

    /// Nothing known: text is neither ordered nor grouped.
    pub fn unknown(why: &str) -> TextRules {
        TextRules {
            default_order: Err(why.to_owned()),
            deterministic: false,
        }
    }
}

impl Default for TextRules {
    fn default() -> TextRules {
        TextRules::unknown("a collation pgherd has not learnt yet (the catalog is being read)")
    }
}

impl std::fmt::Debug for TextRules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let order = match &self.default_order {
            Ok(None) => "bytes".to_owned(),
            Ok(Some(_)) => "a collator".to_owned(),
            Err(why) => format!("unknown ({why})"),
        };
        f.debug_struct("TextRules")
            .field("default_order", &order)
            .field("deterministic", &self.deterministic)
            .finish()
    }
}

/// Why rows cannot be merged exactly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MergeError {
    #[error("not supported on sharded tables: {0}")]
    Unsupported(String),
    #[error("a shard sent a value pgherd cannot read as {0}")]
    BadValue(&'static str),
    #[error("{0} out of the range pgherd merges exactly")]
    OutOfRange(&'static str),
    #[error("{what} of this statement exceed the {} MiB pgherd keeps for a merge", max_bytes >> 20)]
    TooLarge {
        what: &'static str,
        max_bytes: usize,
    },
}

impl MergeError {
    pub fn sqlstate(&self) -> SqlState {
        match self {
            MergeError::Unsupported(_) => SqlState::FEATURE_NOT_SUPPORTED,
            MergeError::BadValue(_) => SqlState::PROTOCOL_VIOLATION,
            MergeError::OutOfRange(_) => SqlState::NUMERIC_VALUE_OUT_OF_RANGE,
            MergeError::TooLarge { .. } => SqlState::PROGRAM_LIMIT_EXCEEDED,
        }
    }
}

/// A value read for ordering and arithmetic.
#[derive(Debug, Clone, PartialEq)]
enum Typed {
    Int(i64),
    /// Unscaled digits and the scale (digits after the point).
    Numeric(i128, u32),
    Float(f64),
    /// Compared byte by byte.
    Bytes(Vec<u8>),
    /// Text of the database's default collation, compared by its collator.
    Text(Vec<u8>),
    Bool(bool),
}

/// How a text column orders: by its collation, which the shards named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TextOrder {
    /// Not known: not ordered.
    Unknown,
    Bytes,
    /// The database's default collation, by the merge's collator.
    Collated,
}

/// How a column's values order: by their type, or bytewise where that is PostgreSQL's order.
#[derive(Debug, Clone, Copy)]
struct Reader {
    column: ColumnType,
    text: TextOrder,
}

impl Reader {
    fn supported(&self) -> Result<(), MergeError> {
        let ColumnType { oid, format } = self.column;
        let ok = match (oid, format) {
            (INT2 | INT4 | INT8 | OID | FLOAT4 | FLOAT8 | BOOL | UUID, _) => true,
            (NUMERIC, _) => true,
            (TIMESTAMP | TIMESTAMPTZ, Format::Binary) => true,
            (NAME, _) => true,
            (TEXT | VARCHAR, _) => self.text != TextOrder::Unknown,
            _ => false,
        };
        if ok {
            Ok(())
        } else {
            Err(MergeError::Unsupported(format!(
                "ordering or combining values of type {oid} ({format:?} format) across shards"
            )))
        }
    }

    fn read(&self, bytes: &[u8]) -> Result<Typed, MergeError> {
        let ColumnType { oid, format } = self.column;
        let text = || std::str::from_utf8(bytes).map_err(|_| MergeError::BadValue("text"));
        Ok(match (oid, format) {
            (INT2 | INT4 | INT8 | OID, Format::Text) => Typed::Int(
                text()?
                    .parse()
                    .map_err(|_| MergeError::BadValue("an integer"))?,
            ),
            (INT2, Format::Binary) => Typed::Int(i64::from(i16::from_be_bytes(array(bytes)?))),
            (INT4, Format::Binary) => Typed::Int(i64::from(i32::from_be_bytes(array(bytes)?))),
            (OID, Format::Binary) => Typed::Int(i64::from(u32::from_be_bytes(array(bytes)?))),
            (INT8 | TIMESTAMP | TIMESTAMPTZ, Format::Binary) => {
                Typed::Int(i64::from_be_bytes(array(bytes)?))
            }
            (FLOAT4 | FLOAT8, Format::Text) => Typed::Float(match text()? {
                "NaN" => f64::NAN,
                "Infinity" => f64::INFINITY,
                "-Infinity" => f64::NEG_INFINITY,
                t => t.parse().map_err(|_| MergeError::BadValue("a float"))?,
            }),
            (FLOAT4, Format::Binary) => Typed::Float(f64::from(f32::from_be_bytes(array(bytes)?))),
            (FLOAT8, Format::Binary) => Typed::Float(f64::from_be_bytes(array(bytes)?)),
            (NUMERIC, Format::Text) => {
                let (digits, scale) = parse_numeric(text()?)?;
                Typed::Numeric(digits, scale)
            }
            (NUMERIC, Format::Binary) => {
                let (digits, scale) = decode_binary(bytes)?;
                Typed::Numeric(digits, scale)
            }
            (BOOL, Format::Text) => Typed::Bool(bytes == b"t"),
            (BOOL, Format::Binary) => Typed::Bool(bytes == [1]),
            (TEXT | VARCHAR, _) if self.text == TextOrder::Collated => Typed::Text(bytes.to_vec()),
            // A uuid's text is lower-case hex: its order is its bytes' order.
            _ => Typed::Bytes(bytes.to_vec()),
        })
    }

    fn write(&self, value: &Typed) -> Result<Vec<u8>, MergeError> {
        let ColumnType { oid, format } = self.column;
        Ok(match (value, format) {
            (Typed::Int(v), Format::Text) => v.to_string().into_bytes(),
            (Typed::Int(v), Format::Binary) => match oid {
                INT2 => i16::try_from(*v)
                    .map_err(|_| MergeError::OutOfRange("smallint"))?
                    .to_be_bytes()
                    .to_vec(),
                INT4 => i32::try_from(*v)
                    .map_err(|_| MergeError::OutOfRange("integer"))?
                    .to_be_bytes()
                    .to_vec(),
                _ => v.to_be_bytes().to_vec(),
            },
            (Typed::Numeric(digits, scale), Format::Text) => {
                format_numeric(*digits, *scale).into_bytes()
            }
            (Typed::Numeric(digits, scale), Format::Binary) => encode_binary((*digits, *scale))?,
            _ => {
                return Err(MergeError::Unsupported(format!(
                    "combining values of type {oid} across shards"
                )))
            }
        })
    }
}

fn array<const N: usize>(bytes: &[u8]) -> Result<[u8; N], MergeError> {
    bytes
        .try_into()
        .map_err(|_| MergeError::BadValue("a fixed-size binary value"))
}

/// PostgreSQL's order of two values of one type: NULLs aside, NaN above every other float,
/// text by `collator` (its ties by bytes).
fn compare(a: &Typed, b: &Typed, collator: Option<&dyn Collator>) -> Ordering {
    match (a, b) {
        (Typed::Text(a), Typed::Text(b)) => collator
            .map_or(Ordering::Equal, |c| c.compare(a, b))
            .then_with(|| a.cmp(b)),
        (Typed::Int(a), Typed::Int(b)) => a.cmp(b),
        (Typed::Numeric(a, sa), Typed::Numeric(b, sb)) => compare_numeric((*a, *sa), (*b, *sb)),
        (Typed::Float(a), Typed::Float(b)) => match (a.is_nan(), b.is_nan()) {
            (true, true) => Ordering::Equal,
            (true, false) => Ordering::Greater,
            (false, true) => Ordering::Less,
            // -0 equals 0.
            _ => a.partial_cmp(b).unwrap_or(Ordering::Equal),
        },
        (Typed::Bool(a), Typed::Bool(b)) => a.cmp(b),
        (Typed::Bytes(a), Typed::Bytes(b)) => a.cmp(b),
        _ => Ordering::Equal,
    }
}

/// A form equal values share (`1.0` and `1.00`, `-0` and `0`), for grouping and DISTINCT.
fn canonical(value: &Typed) -> Vec<u8> {
    match value {
        Typed::Int(v) => v.to_be_bytes().to_vec(),
        Typed::Numeric(digits, scale) => {
            let (mut digits, mut scale) = (*digits, *scale);
            while scale > 0 && digits % 10 == 0 {
                digits /= 10;
                scale -= 1;
            }
            let mut out = digits.to_be_bytes().to_vec();
            out.extend(scale.to_be_bytes());
            out
        }
        Typed::Float(v) if v.is_nan() => b"NaN".to_vec(),
        Typed::Float(v) => (if *v == 0.0 { 0.0f64 } else { *v }).to_be_bytes().to_vec(),
        // Equal text of a deterministic collation has equal bytes.
        Typed::Bytes(b) | Typed::Text(b) => b.clone(),
        Typed::Bool(b) => vec![u8::from(*b)],
    }
}

/// Merges the rows of a fan-out as its [`Merge`] says.
pub struct Merger {
    spec: Merge,
    /// How the shards' values read.
    input: Vec<Reader>,
    /// How merged values read: an average is numeric text whatever its sum was.
    output: Vec<Reader>,
    visible: usize,
    /// The order of the database's default collation, for text that has it.
    collator: Option<Arc<dyn Collator>>,
    /// Equal text has equal bytes (every collation of the database is deterministic).
    deterministic: bool,
}

/// Types whose equal values print alike (in either format), so their bytes group and
/// deduplicate them even where this does not read them: text (if every collation is
/// deterministic), dates and times under the one session's settings, uuids, bytes.
fn equal_when_bytes_equal(oid: u32, deterministic: bool) -> bool {
    match oid {
        TEXT | VARCHAR | NAME | 1042 => deterministic,
        _ => matches!(
            oid,
            BOOL | UUID | 17 | 18 | 1082 | 1083 | 1114 | 1184 | 1266
        ),
    }
}

/// How text of the collation a shard named (`pg_collation_for`'s answer, `None` for a type
/// without one) orders: `Err` why pgherd cannot.
fn text_order_of(named: Option<&[u8]>, rules: &TextRules) -> Result<TextOrder, String> {
    let Some(name) = named else {
        return Ok(TextOrder::Bytes);
    };
    let name = String::from_utf8_lossy(name);
    let name = name.strip_prefix("pg_catalog.").unwrap_or(&name);
    match name {
        "\"C\"" | "\"POSIX\"" | "ucs_basic" => Ok(TextOrder::Bytes),
        "\"default\"" => match &rules.default_order {
            Ok(None) => Ok(TextOrder::Bytes),
            Ok(Some(_)) => Ok(TextOrder::Collated),
            Err(why) => Err(why.clone()),
        },
        other => Err(format!(
            "the collation {other} (pgherd orders text by the database's default collation, C or POSIX)"
        )),
    }
}

impl Merger {
    /// For the shards' columns (visible then hidden, as their RowDescription gives them);
    /// `first_rows`, a row of each shard that has one, name the collations of what is ordered
    /// (`Merge::collations`), which `text` says how to apply.
    pub fn new(
        spec: Merge,
        columns: &[ColumnType],
        first_rows: &[&Row],
        text: &TextRules,
    ) -> Result<Merger, MergeError> {
        let visible =
            columns
                .len()
                .checked_sub(spec.hidden_columns)
                .ok_or(MergeError::BadValue(
                    "a row description with the hidden columns",
                ))?;
        let reader = |column| Reader {
            column,
            text: TextOrder::Unknown,
        };
        let mut input: Vec<Reader> = columns.iter().map(|&c| reader(c)).collect();
        for &(column, collation) in &spec.collations {
            let (column, collation) = (position(visible, column), position(visible, collation));
            let mut names = first_rows
                .iter()
                .filter_map(|row| row.get(collation).and_then(Option::as_deref));
            let named = names.next();
            if names.any(|other| Some(other) != named) {
                return Err(MergeError::Unsupported(
                    "ordering text whose collation differs between shards".to_owned(),
                ));
            }
            let Some(reader) = input.get_mut(column) else {
                return Err(MergeError::BadValue("a row with every planned column"));
            };
            match text_order_of(named, text) {
                Ok(order) => reader.text = order,
                Err(why) if matches!(reader.column.oid, TEXT | VARCHAR) => {
                    return Err(MergeError::Unsupported(format!(
                        "ordering text across shards by {why}"
                    )))
                }
                Err(_) => {}
            }
        }
        let mut output = input.clone();
        for &(column, combine) in spec.grouping.iter().flat_map(|g| &g.aggregates) {
            let column = position(visible, column);
            let Some(shard_column) = input.get(column) else {
                return Err(MergeError::BadValue("a row with every planned column"));
            };
            shard_column.supported()?;
            let float = matches!(shard_column.column.oid, FLOAT4 | FLOAT8);
            if float && matches!(combine, Combine::Add | Combine::Average { .. }) {
                // A float sum depends on the order it is added in.
                return Err(MergeError::Unsupported(
                    "sum or avg of floating-point values across shards".to_owned(),
                ));
            }
            if let Combine::Average { .. } = combine {
                // The format the client asked for that column.
                output[column] = reader(ColumnType {
                    oid: NUMERIC,
                    format: shard_column.column.format,
                });
            }
        }
        let merger = Merger {
            spec,
            input,
            output,
            visible,
            collator: text.default_order.clone().ok().flatten(),
            deterministic: text.deterministic,
        };
        for key in &merger.spec.order_by {
            merger.reader_of(&merger.output, key.column)?.supported()?;
        }
        if let Some(having) = &merger.spec.having {
            merger.check_condition(having)?;
        }
        let grouping_keys = merger
            .spec
            .grouping
            .iter()
            .flat_map(|g| g.keys.iter().copied());
        let distinct_columns = (0..merger.visible)
            .filter(|_| merger.spec.distinct)
            .map(Column::Visible);
        for column in grouping_keys.chain(distinct_columns) {
            let reader = merger.reader_of(&merger.output, column)?;
            if reader.supported().is_err()
                && !equal_when_bytes_equal(reader.column.oid, merger.deterministic)
            {
                return Err(MergeError::Unsupported(format!(
                    "grouping or DISTINCT on values of type {} ({:?} format) across shards",
                    reader.column.oid, reader.column.format
                )));
            }
        }
        Ok(merger)
    }

    /// The types of the client's columns: an average is numeric, in text.
    pub fn output_types(&self) -> Vec<ColumnType> {
        self.output[..self.visible]
            .iter()
            .map(|r| r.column)
            .collect()
    }

    fn index(&self, column: Column) -> usize {
        position(self.visible, column)
    }

    fn compare(&self, a: &Typed, b: &Typed) -> Ordering {
        compare(a, b, self.collator.as_deref())
    }

    fn reader_of(&self, readers: &[Reader], column: Column) -> Result<Reader, MergeError> {
        readers
            .get(self.index(column))
            .copied()
            .ok_or(MergeError::BadValue("a row with every planned column"))
    }

    fn reader(&self, column: Column) -> Result<Reader, MergeError> {
        self.reader_of(&self.input, column)
    }

    fn typed_with(
        &self,
        readers: &[Reader],
        column: Column,
        row: &Row,
    ) -> Result<Option<Typed>, MergeError> {
        match row.get(self.index(column)).and_then(Option::as_ref) {
            None => Ok(None),
            Some(bytes) => self.reader_of(readers, column)?.read(bytes).map(Some),
        }
    }

    fn typed(&self, column: Column, row: &Row) -> Result<Option<Typed>, MergeError> {
        self.typed_with(&self.input, column, row)
    }

    /// A column's value in the form equal values share (bytes, for types whose equal values
    /// print alike), as the shards sent it or as merged.
    pub(crate) fn key_of(
        &self,
        column: Column,
        row: &Row,
        merged: bool,
    ) -> Result<Option<Vec<u8>>, MergeError> {
        let Some(bytes) = row.get(self.index(column)).and_then(Option::as_ref) else {
            return Ok(None);
        };
        let readers = if merged { &self.output } else { &self.input };
        let reader = self.reader_of(readers, column)?;
        if reader.supported().is_err() {
            return Ok(Some(bytes.clone()));
        }
        Ok(Some(canonical(&reader.read(bytes)?)))
    }

    /// Reads every value the merge orders or combines, so a value the server sent that cannot
    /// be read is an error, not a misplaced row.
    pub fn check_row(&self, row: &Row) -> Result<(), MergeError> {
        let keys = self.spec.order_by.iter().map(|k| k.column);
        let aggregates = self.spec.grouping.iter().flat_map(|g| {
            g.aggregates.iter().flat_map(|&(column, combine)| {
                let count = match combine {
                    Combine::Average { count } => Some(count),
                    _ => None,
                };
                std::iter::once(column).chain(count)
            })
        });
        for column in keys.chain(aggregates) {
            self.typed(column, row)?;
        }
        Ok(())
    }

    /// The order of two rows by the ORDER BY keys (NULLs where each key puts them).
    pub fn compare_rows(&self, a: &Row, b: &Row) -> Ordering {
        for key in &self.spec.order_by {
            // Rows were read when they came in (`check_row`); merged ones are this merge's.
            let (x, y) = (
                self.typed_with(&self.output, key.column, a).ok().flatten(),
                self.typed_with(&self.output, key.column, b).ok().flatten(),
            );
            let order = match (&x, &y) {
                (None, None) => Ordering::Equal,
                (None, Some(_)) => nulls(key.nulls_first),
                (Some(_), None) => nulls(key.nulls_first).reverse(),
                (Some(x), Some(y)) if key.descending => self.compare(y, x),
                (Some(x), Some(y)) => self.compare(x, y),
            };
            if order != Ordering::Equal {
                return order;
            }
        }
        Ordering::Equal
    }

    /// Sorted streams from the shards as one sorted stream, holding one row per shard; a row
    /// that cannot be read ends it with the error.
    pub fn merge_sorted<I: Iterator<Item = Row>>(&self, shards: Vec<I>) -> MergeSorted<'_, I> {
        MergeSorted::new(self, shards)
    }

    pub(crate) fn spec(&self) -> &Merge {
        &self.spec
    }

    /// How many columns the client sees (the shards' rows carry hidden ones after them).
    pub(crate) fn visible(&self) -> usize {
        self.visible
    }

    /// Rows with equal group keys as one, their aggregates combined (averages from sums and
    /// counts), then sorted.
    pub fn combine(&self, rows: impl IntoIterator<Item = Row>) -> Result<Vec<Row>, MergeError> {
        let Some(grouping) = &self.spec.grouping else {
            let mut rows: Vec<Row> = rows.into_iter().collect();
            for row in &rows {
                self.check_row(row)?;
            }
            rows.sort_by(|a, b| self.compare_rows(a, b));
            return Ok(rows);
        };
        let mut groups: Vec<Row> = Vec::new();
        let rows = rows.into_iter();
        let mut by_key: HashMap<Vec<Option<Vec<u8>>>, usize> = HashMap::new();
        for row in rows {
            self.check_row(&row)?;
            let key = grouping
                .keys
                .iter()
                .map(|&k| self.key_of(k, &row, false))
                .collect::<Result<Vec<_>, _>>()?;
            match by_key.get(&key) {
                None => {
                    by_key.insert(key, groups.len());
                    groups.push(row);
                }
                Some(&at) => {
                    for &(column, combine) in &grouping.aggregates {
                        self.combine_one(&mut groups[at], &row, column, combine)?;
                    }
                }
            }
        }
        for group in &mut groups {
            for &(column, combine) in &grouping.aggregates {
                if let Combine::Average { count } = combine {
                    self.finish_average(group, column, count)?;
                }
            }
        }
        if let Some(having) = &self.spec.having {
            let mut kept = Vec::with_capacity(groups.len());
            for group in groups {
                if self.holds(having, &group)? == Some(true) {
                    kept.push(group);
                }
            }
            groups = kept;
        }
        groups.sort_by(|a, b| self.compare_rows(a, b));
        Ok(groups)
    }

    /// A HAVING condition compares only values this orders (or, for = and <>, whose equal
    /// values print alike).
    fn check_condition(&self, condition: &Condition) -> Result<(), MergeError> {
        match condition {
            Condition::Not(inner) => self.check_condition(inner),
            Condition::And(parts) | Condition::Or(parts) => {
                parts.iter().try_for_each(|p| self.check_condition(p))
            }
            Condition::Compare { left, op, right } => {
                for operand in [left, right] {
                    let Operand::Column(column) = operand else {
                        continue;
                    };
                    let reader = self.reader_of(&self.output, *column)?;
                    let equality = matches!(op, CompareOp::Eq | CompareOp::Ne);
                    if reader.supported().is_err()
                        && !(equality
                            && equal_when_bytes_equal(reader.column.oid, self.deterministic))
                    {
                        return Err(MergeError::Unsupported(format!(
                            "HAVING on values of type {} across shards",
                            reader.column.oid
                        )));
                    }
                }
                Ok(())
            }
        }
    }

    /// AND (`decisive` false) or OR (`decisive` true) in SQL's three values: a part with the
    /// decisive value decides, else any unknown part makes it unknown.
    fn junction(
        &self,
        parts: &[Condition],
        group: &Row,
        decisive: bool,
    ) -> Result<Option<bool>, MergeError> {
        let mut result = Some(!decisive);
        for part in parts {
            match self.holds(part, group)? {
                Some(value) if value == decisive => return Ok(Some(decisive)),
                None => result = None,
                Some(_) => {}
            }
        }
        Ok(result)
    }

    /// A HAVING condition on a merged group, with SQL's three values (`None`: unknown).
    fn holds(&self, condition: &Condition, group: &Row) -> Result<Option<bool>, MergeError> {
        Ok(match condition {
            Condition::Not(inner) => self.holds(inner, group)?.map(|b| !b),
            Condition::And(parts) => self.junction(parts, group, false)?,
            Condition::Or(parts) => self.junction(parts, group, true)?,
            Condition::Compare { left, op, right } => {
                // A literal reads as the type of the column it is compared with.
                let column = match (left, right) {
                    (Operand::Column(c), _) | (_, Operand::Column(c)) => *c,
                    _ => return Ok(None),
                };
                let as_text = Reader {
                    column: ColumnType {
                        oid: self.reader_of(&self.output, column)?.column.oid,
                        format: Format::Text,
                    },
                    text: self.reader_of(&self.output, column)?.text,
                };
                let value = |operand: &Operand| -> Result<Option<Typed>, MergeError> {
                    match operand {
                        Operand::Null => Ok(None),
                        Operand::Column(c) => self.typed_with(&self.output, *c, group),
                        Operand::Constant(text) => match as_text.read(text.as_bytes()) {
                            Ok(value) => Ok(Some(value)),
                            // An integer compared with a fraction compares as numeric.
                            Err(_) => {
                                let (digits, scale) = parse_numeric(text)?;
                                Ok(Some(Typed::Numeric(digits, scale)))
                            }
                        },
                    }
                };
                let (Some(a), Some(b)) = (value(left)?, value(right)?) else {
                    return Ok(None);
                };
                let as_numeric = |v: Typed| match v {
                    Typed::Int(i) => Typed::Numeric(i128::from(i), 0),
                    other => other,
                };
                let (a, b) = match (&a, &b) {
                    (Typed::Int(_), Typed::Numeric(..)) | (Typed::Numeric(..), Typed::Int(_)) => {
                        (as_numeric(a), as_numeric(b))
                    }
                    _ => (a, b),
                };
                let order = self.compare(&a, &b);
                Some(match op {
                    CompareOp::Eq => order.is_eq(),
                    CompareOp::Ne => order.is_ne(),
                    CompareOp::Lt => order.is_lt(),
                    CompareOp::Le => order.is_le(),
                    CompareOp::Gt => order.is_gt(),
                    CompareOp::Ge => order.is_ge(),
                })
            }
        })
    }

    fn combine_one(
        &self,
        group: &mut Row,
        row: &Row,
        at: Column,
        combine: Combine,
    ) -> Result<(), MergeError> {
        let column = self.index(at);
        let (mine, theirs) = (self.typed(at, group)?, self.typed(at, row)?);
        match (combine, mine, theirs) {
            (_, _, None) => {}
            (_, None, Some(_)) => group[column] = row[column].clone(),
            // The least or greatest keeps the bytes its shard sent.
            (Combine::Min, Some(a), Some(b)) if self.compare(&b, &a).is_lt() => {
                group[column] = row[column].clone()
            }
            (Combine::Max, Some(a), Some(b)) if self.compare(&b, &a).is_gt() => {
                group[column] = row[column].clone()
            }
            (Combine::Min | Combine::Max, _, _) => {}
            (Combine::Add | Combine::Average { .. }, Some(a), Some(b)) => {
                group[column] = Some(self.reader(at)?.write(&add(&a, &b)?)?)
            }
        }
        if let Combine::Average { count } = combine {
            let (mine, theirs) = (self.typed(count, group)?, self.typed(count, row)?);
            if let (Some(a), Some(b)) = (mine, theirs) {
                let total = add(&a, &b)?;
                group[self.index(count)] = Some(self.reader(count)?.write(&total)?);
            }
        }
        Ok(())
    }

    fn finish_average(&self, group: &mut Row, at: Column, count: Column) -> Result<(), MergeError> {
        let sum = self.typed(at, group)?;
        let column = self.index(at);
        let count = match self.typed(count, group)? {
            Some(Typed::Int(n)) => n,
            _ => 0,
        };
        let quotient = match sum {
            None => None,
            Some(_) if count == 0 => None,
            Some(Typed::Int(sum)) => Some(average(i128::from(sum), 0, count)?),
            Some(Typed::Numeric(digits, scale)) => Some(average(digits, scale, count)?),
            Some(_) => return Err(MergeError::Unsupported("this avg across shards".to_owned())),
        };
        let writer = self.reader_of(&self.output, at)?;
        group[column] = match quotient {
            Some((digits, scale)) => Some(writer.write(&Typed::Numeric(digits, scale))?),
            None => None,
        };
        Ok(())
    }

    /// The client's rows from merged ones: duplicates dropped (DISTINCT), OFFSET skipped,
    /// LIMIT kept, hidden columns cut off ([`Finisher`], all at once).
    pub fn finish(&self, rows: impl IntoIterator<Item = Row>) -> Result<Vec<Row>, MergeError> {
        let mut finisher = Finisher::new(self, usize::MAX);
        let mut out = Vec::new();
        for row in rows {
            match finisher.take(row)? {
                Taken::Row(row) => out.push(row),
                Taken::Skipped => {}
                Taken::Done => break,
            }
        }
        Ok(out)
    }
}

/// Where a column is in the shards' rows.
fn position(visible: usize, column: Column) -> usize {
    match column {
        Column::Visible(i) => i,
        Column::Hidden(i) => visible + i,
    }
}

fn nulls(first: bool) -> Ordering {
    if first {
        Ordering::Less
    } else {
        Ordering::Greater
    }
}

fn add(a: &Typed, b: &Typed) -> Result<Typed, MergeError> {
    match (a, b) {
        (Typed::Int(a), Typed::Int(b)) => a
            .checked_add(*b)
            .map(Typed::Int)
            .ok_or(MergeError::OutOfRange("bigint")),
        (Typed::Numeric(a, sa), Typed::Numeric(b, sb)) => {
            let (sum, scale) = add_numeric((*a, *sa), (*b, *sb))?;
            Ok(Typed::Numeric(sum, scale))
        }
        _ => Err(MergeError::Unsupported(
            "adding these values across shards".to_owned(),
        )),
    }
}

#[cfg(test)]
#[path = "merge_rows_tests.rs"]
mod tests;
