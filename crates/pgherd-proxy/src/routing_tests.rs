//! The router's decisions as kept in statement shapes' slots: whatever a slot holds, a
//! statement gets the decision the classifier would make for it under the router's catalog
//! now.

use std::sync::Arc;

use pgherd_route::catalog::{Persistence, RelationRow, SnapshotBuilder};
use pgherd_route::Target;

use super::Router;

const READ: &str = "SELECT abalance FROM accounts WHERE aid = ";

/// A router whose catalog has `accounts` with `persistence`.
fn router(persistence: Persistence, max_parse_bytes: usize) -> Router {
    let router = Router::new("db".into(), 64, max_parse_bytes, None);
    let mut catalog = SnapshotBuilder::default();
    catalog.relation(RelationRow {
        oid: 16384,
        name: "accounts".into(),
        persistence,
        runs_user_code: false,
        draws_sequences: false,
        cache_safe: persistence == Persistence::Permanent,
    });
    router.catalog.store(Arc::new(catalog.build()));
    router
}

fn target(router: &Router, sql: &str) -> Target {
    router
        .route(sql.as_bytes(), true)
        .expect("routes")
        .decision
        .target
}

#[test]
fn a_standby_refusal_reaches_texts_of_a_shape_already_decided() {
    let router = router(Persistence::Permanent, 10_000);
    for aid in 0..10 {
        assert_ne!(target(&router, &format!("{READ}{aid}")), Target::Primary);
    }
    let (hits, misses) = router.cache_counts();
    assert_eq!((hits, misses), (9, 1), "one decision made, then found");
    router.remember_primary(format!("{READ}77").as_bytes(), true);
    for aid in 10..20 {
        assert_eq!(target(&router, &format!("{READ}{aid}")), Target::Primary);
    }
}

#[test]
fn routers_on_one_thread_do_not_take_each_others_decisions() {
    // Standbys cannot read an unlogged table: the same text goes to the primary there.
    let logged = router(Persistence::Permanent, 10_000);
    let unlogged = router(Persistence::Unlogged, 10_000);
    for aid in 0..10 {
        let sql = format!("{READ}{aid}");
        assert_ne!(target(&logged, &sql), Target::Primary, "{sql}");
        assert_eq!(target(&unlogged, &sql), Target::Primary, "{sql}");
    }
}

#[test]
fn a_text_too_long_to_parse_is_not_given_its_shapes_decision() {
    let short = format!("{READ}1");
    let router = router(Persistence::Permanent, short.len() + 5);
    for aid in 0..5 {
        assert_ne!(target(&router, &format!("{READ}{aid}")), Target::Primary);
    }
    // A text over the limit is lexed as if empty: the empty text's shape must not answer.
    for _ in 0..3 {
        assert_ne!(target(&router, " "), Target::Primary);
        assert_ne!(target(&router, ""), Target::Primary);
    }
    // Of the same shape, but over the limit: not parsed, so it runs on the primary.
    let long = format!("{READ}{}", "9".repeat(20));
    assert_eq!(target(&router, &long), Target::Primary);
    assert_ne!(target(&router, &format!("{READ}3")), Target::Primary);
}
