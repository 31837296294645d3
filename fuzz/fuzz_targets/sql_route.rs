#![no_main]
//! A client's statement text as pgherd reads it: the lexer (both string settings), the
//! classifier, the result cache's verdict, the split of a query string, and the sharded
//! planner over a hash-sharded, a range-sharded and a list-sharded table.
use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use pgherd_route::catalog::Snapshot;
use pgherd_route::shard_hash::KeyType;
use pgherd_route::shard_plan::{BoundParam, Method, ShardMap, ShardedTable};
use pgherd_route::shard_route::{route_statement, CatalogFacts};

fn map() -> ShardMap {
    let table = |column: &str, key_type, method| ShardedTable {
        key_column: column.to_owned(),
        key_type,
        method,
        key_ordinal: Some(0),
    };
    let mut tables = BTreeMap::new();
    tables.insert(
        "accounts".to_owned(),
        table("aid", KeyType::Int4, Method::Hash),
    );
    tables.insert(
        "events".to_owned(),
        table(
            "id",
            KeyType::Int8,
            Method::Range {
                starts: vec![0, 1000],
            },
        ),
    );
    tables.insert(
        "regions".to_owned(),
        table(
            "code",
            KeyType::Text,
            Method::List {
                values: vec![vec!["eu".into()], vec!["us".into()]],
            },
        ),
    );
    ShardMap { shards: 2, tables }
}

fuzz_target!(|data: &[u8]| {
    let Ok(sql) = std::str::from_utf8(data) else {
        return;
    };
    let catalog = Snapshot::default();
    let mut key = Vec::new();
    let mut decision = None;
    for standard_strings in [true, false] {
        key.clear();
        let lexed = pgherd_route::lex(sql.as_bytes(), standard_strings, &mut key);
        decision = Some(pgherd_route::classify(sql, &lexed, &catalog, 64 << 10));
        let _ = pgherd_route::cacheable::cacheable(sql, &lexed, &catalog, 64 << 10);
    }
    let _ = pgherd_route::parse::split_query(sql);
    let Some(decision) = decision else {
        return;
    };
    let facts = CatalogFacts {
        is_user_aggregate: &|_| false,
        copy_facts: &|_| None,
        mentions_user_code: &|_| false,
    };
    let map = map();
    let _ = route_statement(sql, &map, &decision, &facts, &[]);
    let params = [BoundParam::text(Some("7")), BoundParam::text(None)];
    let _ = route_statement(sql, &map, &decision, &facts, &params);
});
