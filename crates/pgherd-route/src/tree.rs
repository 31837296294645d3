//! Reading PostgreSQL's statement trees (`pg_query`) where the planners of sharding need more
//! than the library gives: every node at any depth (through the serialized form, which has
//! every field; the library's own walk skips some places), expressions compared whatever
//! their position in the text, and the text of names and literals.

use pg_query::protobuf::{a_const, node::Node as NodeEnum, AConst, Node};
use serde::Serialize;
use serde_json::{Map, Value};

/// The text of a name node (`String`).
pub(crate) fn string(node: &Node) -> Option<&str> {
    match &node.node {
        Some(NodeEnum::String(s)) => Some(s.sval.as_str()),
        _ => None,
    }
}

/// A literal's text: an integer, a number (integers beyond 32 bits come as these), a string.
pub(crate) fn literal_text(constant: &AConst) -> Option<String> {
    match constant.val.as_ref()? {
        a_const::Val::Ival(i) => Some(i.ival.to_string()),
        a_const::Val::Fval(f) => Some(f.fval.clone()),
        a_const::Val::Sval(s) => Some(s.sval.clone()),
        _ => None,
    }
}

/// Calls `visit` with the fields of every object of a serialized tree.
pub(crate) fn objects<'v>(value: &'v Value, visit: &mut impl FnMut(&'v Map<String, Value>)) {
    match value {
        Value::Object(fields) => {
            visit(fields);
            fields.values().for_each(|v| objects(v, visit));
        }
        Value::Array(items) => items.iter().for_each(|v| objects(v, visit)),
        _ => {}
    }
}

/// Whether any node of the tree (any depth, subqueries included) matches: by its node type
/// (the key it is tagged with) and its fields. A tree that cannot be serialized is taken to
/// match, so what this guards is refused.
pub(crate) fn any_node(node: &impl Serialize, test: impl Fn(&str, &Value) -> bool) -> bool {
    first_node(node, (), |key, value| test(key, value).then_some(())).is_some()
}

/// The first answer `test` gives for a node of the tree (any depth, as [`any_node`] walks
/// it); a tree that cannot be serialized answers `unreadable`.
pub(crate) fn first_node<T>(
    node: &impl Serialize,
    unreadable: T,
    test: impl Fn(&str, &Value) -> Option<T>,
) -> Option<T> {
    let Ok(tree) = serde_json::to_value(node) else {
        return Some(unreadable);
    };
    let mut found = None;
    objects(&tree, &mut |fields| {
        if found.is_none() {
            found = fields.iter().find_map(|(key, value)| test(key, value));
        }
    });
    found
}

/// The columns every row has besides its own (`tableoid` included): their values belong to
/// where and how the row is stored, not to the data.
pub(crate) const SYSTEM_COLUMNS: &[&str] = &["ctid", "xmin", "xmax", "cmin", "cmax", "tableoid"];

/// The last name (`sval`) in a serialized part of a tree: a function's or column's own name.
pub(crate) fn last_name(value: &Value) -> Option<String> {
    let mut last = None;
    objects(value, &mut |fields| {
        if let Some(Value::String(name)) = fields.get("sval") {
            last = Some(name.clone());
        }
    });
    last
}

/// Two expressions alike but for where they were written.
pub(crate) fn same_expression(a: &Node, b: &Node) -> bool {
    fn strip(value: &mut Value) {
        match value {
            Value::Object(fields) => {
                fields.remove("location");
                fields.values_mut().for_each(strip);
            }
            Value::Array(items) => items.iter_mut().for_each(strip),
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
