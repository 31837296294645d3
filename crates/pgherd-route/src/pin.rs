//! Values one server computes once for a whole transaction (its start time: `now()`,
//! `CURRENT_TIMESTAMP`, `CURRENT_DATE`, `LOCALTIMESTAMP`, ...), which shards would each compute
//! for themselves. A write to the copies of a table every shard holds has them computed once,
//! on its first shard, and bound as parameters on every shard, so the copies stay alike and
//! hold what one server would have written (pgbench's history rows, say).
//!
//! Pure: the statement's text and tree in, the text with parameters in their place out.

use pg_query::protobuf::node::Node as NodeEnum;
use serde_json::Value;

use crate::tree::objects;

/// The statement with the pinned values as parameters after the client's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pinned {
    pub sql: String,
    /// How many parameters the client's statement has (the first pinned one is the next).
    pub client_params: usize,
    /// What computes each pinned value, in parameter order.
    pub values: Vec<PinnedValue>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinnedValue {
    /// The expression as written (`CURRENT_TIMESTAMP(3)`, `now()`).
    pub expression: String,
    /// Its type, so the parameter is exactly what the expression was.
    pub type_oid: u32,
}

const DATE: u32 = 1082;
const TIME: u32 = 1083;
const TIMETZ: u32 = 1266;
const TIMESTAMP: u32 = 1114;
const TIMESTAMPTZ: u32 = 1184;

/// Functions whose value is the transaction's start time.
const TRANSACTION_TIME_FUNCTIONS: &[&str] = &["now", "transaction_timestamp"];

/// The type of a node of the serialized tree computing a transaction-stable time, if it is
/// one: a `SQLValueFunction` of the date/time kinds, or `now()`/`transaction_timestamp()`
/// (unqualified or in `pg_catalog`, no `*`, FILTER or window; a function of that name the
/// database defines is the caller's to rule out).
pub fn transaction_time(key: &str, value: &Value) -> Option<u32> {
    match key {
        // The op's number in PostgreSQL's SQLValueFunctionOp.
        "SqlvalueFunction" => match value.get("op")?.as_i64()? {
            1 => Some(DATE),
            2 | 3 => Some(TIMETZ),
            4 | 5 => Some(TIMESTAMPTZ),
            6 | 7 => Some(TIME),
            8 | 9 => Some(TIMESTAMP),
            _ => None,
        },
        "FuncCall" => {
            let mut names: Vec<&str> = Vec::new();
            objects(value.get("funcname")?, &mut |fields| {
                if let Some(Value::String(name)) = fields.get("sval") {
                    names.push(name);
                }
            });
            let name = match names.as_slice() {
                [name] | ["pg_catalog", name] => *name,
                _ => return None,
            };
            let absent = |field: &str| {
                value.get(field).is_none_or(|v| {
                    v.is_null() || v == false || v.as_array().is_some_and(Vec::is_empty)
                })
            };
            let plain = [
                "args",
                "over",
                "agg_star",
                "agg_filter",
                "agg_order",
                "agg_within_group",
                "agg_distinct",
                "func_variadic",
            ]
            .iter()
            .all(|field| absent(field));
            (TRANSACTION_TIME_FUNCTIONS.contains(&name) && plain).then_some(TIMESTAMPTZ)
        }
        _ => None,
    }
}

/// `sql` (whose tree is `statement`, bound to `bound_params` values) with its
/// transaction-stable times as parameters after the client's; `None` if it has none. `Err`
/// names what could not be placed in the text.
pub fn pin(sql: &str, statement: &NodeEnum, bound_params: usize) -> Result<Option<Pinned>, String> {
    let tree = serde_json::to_value(statement).map_err(|e| e.to_string())?;
    let mut found: Vec<(usize, u32)> = Vec::new();
    // A Parse may declare more parameters than the text uses; the client binds them all.
    let mut client_params = bound_params;
    objects(&tree, &mut |fields| {
        for (key, value) in fields {
            if key == "ParamRef" {
                let number = value.get("number").and_then(Value::as_u64).unwrap_or(0);
                client_params = client_params.max(number as usize);
            }
            if let Some(type_oid) = transaction_time(key, value) {
                let location = value.get("location").and_then(Value::as_i64).unwrap_or(-1);
                found.push((usize::try_from(location).unwrap_or(usize::MAX), type_oid));
            }
        }
    });
    if found.is_empty() {
        return Ok(None);
    }
    found.sort_unstable();
    // One expression the tree holds twice (`SET (a, b) = (now(), 1)`) is one parameter.
    found.dedup_by_key(|(location, _)| *location);
    let tokens = pg_query::scan(sql).map_err(|e| e.to_string())?.tokens;
    let text = |t: &pg_query::protobuf::ScanToken| {
        sql.get(t.start as usize..t.end as usize)
            .unwrap_or_default()
    };
    let mut out = String::with_capacity(sql.len());
    let mut copied_to = 0usize;
    let mut values = Vec::with_capacity(found.len());
    for (location, type_oid) in found {
        let first = tokens
            .iter()
            .position(|t| t.start as usize == location)
            .filter(|_| location >= copied_to)
            .ok_or_else(|| format!("a date/time function at byte {location}"))?;
        // A qualified name (`pg_catalog.now`), then its parenthesized arguments, if any.
        let mut last = first;
        while tokens.get(last + 1).is_some_and(|t| text(t) == ".") && last + 2 < tokens.len() {
            last += 2;
        }
        if tokens.get(last + 1).is_some_and(|t| text(t) == "(") {
            let mut depth = 0usize;
            for (i, token) in tokens.iter().enumerate().skip(last + 1) {
                match text(token) {
                    "(" => depth += 1,
                    ")" => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    last = i;
                    break;
                }
            }
        }
        let end = tokens[last].end as usize;
        let expression = sql
            .get(location..end)
            .ok_or_else(|| format!("a date/time function at byte {location}"))?;
        out.push_str(&sql[copied_to..location]);
        values.push(PinnedValue {
            expression: expression.to_owned(),
            type_oid,
        });
        out.push_str(&format!("${}", client_params + values.len()));
        copied_to = end;
    }
    out.push_str(&sql[copied_to..]);
    Ok(Some(Pinned {
        sql: out,
        client_params,
        values,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pinned(sql: &str) -> Option<Pinned> {
        let parsed = pg_query::parse(sql).unwrap();
        let statement = parsed.protobuf.stmts[0]
            .stmt
            .as_ref()
            .and_then(|s| s.node.clone())
            .unwrap();
        pin(sql, &statement, 0).unwrap()
    }

    #[test]
    fn transaction_times_become_parameters_after_the_clients() {
        let p = pinned("INSERT INTO h (tid, mtime) VALUES (3, CURRENT_TIMESTAMP)").unwrap();
        assert_eq!(p.sql, "INSERT INTO h (tid, mtime) VALUES (3, $1)");
        assert_eq!(
            p.values,
            vec![PinnedValue {
                expression: "CURRENT_TIMESTAMP".into(),
                type_oid: TIMESTAMPTZ
            }]
        );
        let p = pinned(
            "UPDATE t SET a = $2, d = current_date, t = LOCALTIME(2), n = pg_catalog.now ( ) WHERE id = $1",
        )
        .unwrap();
        assert_eq!(
            p.sql,
            "UPDATE t SET a = $2, d = $3, t = $4, n = $5 WHERE id = $1"
        );
        assert_eq!(p.client_params, 2);
        let listed: Vec<(&str, u32)> = p
            .values
            .iter()
            .map(|v| (v.expression.as_str(), v.type_oid))
            .collect();
        assert_eq!(
            listed,
            vec![
                ("current_date", DATE),
                ("LOCALTIME(2)", TIME),
                ("pg_catalog.now ( )", TIMESTAMPTZ)
            ]
        );
        // Nothing to pin; other functions are not this module's to judge.
        assert_eq!(pinned("INSERT INTO h VALUES (1, 'now')"), None);
        assert_eq!(pinned("INSERT INTO h VALUES (clock_timestamp())"), None);
        assert_eq!(pinned("INSERT INTO h VALUES (now(1))"), None);
        assert_eq!(pinned("INSERT INTO h VALUES (app.now())"), None);
        assert_eq!(pinned("SELECT count(*) FROM h"), None);
        let p = pinned("UPDATE h SET (a, b) = (now(), 1)").unwrap();
        assert_eq!(p.sql, "UPDATE h SET (a, b) = ($1, 1)");
        assert_eq!(p.values.len(), 1);
    }
}
