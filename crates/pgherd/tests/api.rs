//! The HTTP API against a real cluster: health endpoints in the style of Patroni's, JSON
//! views, Prometheus metrics (parsed, every documented metric present), and the token that
//! guards changes (a switchover over HTTP).

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;

const TOKEN: &str = "api-test-token-0123456789";

struct Api {
    base: String,
}

impl Api {
    /// (status, body as JSON or text).
    fn get(&self, path: &str) -> (u16, String) {
        answer(ureq::get(&format!("{}{path}", self.base)).call())
    }

    fn json(&self, path: &str) -> serde_json::Value {
        let (status, body) = self.get(path);
        assert_eq!(status, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: not JSON ({e}): {body}"))
    }

    fn post(&self, path: &str, token: Option<&str>, body: &str) -> (u16, String) {
        let mut request = ureq::post(&format!("{}{path}", self.base))
            .set("Content-Type", "application/json")
            .timeout(Duration::from_secs(120));
        if let Some(t) = token {
            request = request.set("Authorization", &format!("Bearer {t}"));
        }
        answer(request.send_string(body))
    }
}

fn answer(result: Result<ureq::Response, ureq::Error>) -> (u16, String) {
    match result {
        Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
        Err(e) => panic!("HTTP request failed: {e}"),
    }
}

/// A cluster of a primary and `replicas`, pgherd with its HTTP API, once pg1 was elected.
fn api_env(replicas: usize) -> (Env, Api) {
    let (env, base) = env_with_api(replicas, TOKEN);
    let api = Api { base };
    wait_until(&env, "pgherd elected pg1", Duration::from_secs(10), || {
        api.get("/node/pg1/primary").0 == 200
    });
    (env, api)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_endpoints_views_and_a_switchover_over_http() {
    let (env, api) = api_env(2);
    assert_eq!(api.get("/health").0, 200);
    assert_eq!(api.get("/ready").0, 200);
    assert_eq!(api.json("/primary")["primary"], "pg1");
    for replica in ["pg2", "pg3"] {
        assert_eq!(api.get(&format!("/node/{replica}/primary")).0, 503);
        let (status, body) = api.get(&format!("/node/{replica}/replica?lag=16MB"));
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(
        api.get("/node/pg1/replica").0,
        503,
        "the primary is no replica"
    );
    assert_eq!(api.get("/replica").0, 200);
    // Bad input gets a precise error.
    let (status, body) = api.get("/replica?lag=lots");
    assert_eq!(status, 400);
    assert!(body.contains("not a size"), "{body}");
    let (status, body) = api.get("/node/nosuch/primary");
    assert_eq!(status, 404);
    assert!(body.contains("nosuch"), "{body}");
    assert_eq!(api.get("/no/such/endpoint").0, 404);

    // JSON views keep numbers as numbers.
    let nodes = api.json("/api/nodes");
    let nodes = nodes.as_array().expect("an array of nodes");
    assert_eq!(nodes.len(), 3);
    assert_eq!(nodes[0]["name"], "pg1");
    assert_eq!(nodes[0]["role"], "primary");
    assert_eq!(nodes[0]["takes_writes"], true);
    assert!(nodes[1]["lag_bytes"].is_u64(), "{nodes:?}");
    assert!(nodes[1]["port"].is_u64(), "{nodes:?}");
    let client = env.app().await;
    first_value(&client, "SELECT 1").await.expect("a query");
    let pools = api.json("/api/pools");
    assert!(pools.as_array().is_some_and(|p| !p.is_empty()), "{pools}");
    let status = api.json("/api/status");
    assert_eq!(status["primary"], "pg1");
    for view in ["stats", "lists", "clients", "servers", "events", "config"] {
        assert!(api.json(&format!("/api/{view}")).is_array(), "{view}");
    }

    // A stopped replica fails its next check: the endpoint flips without waiting for pgherd
    // to declare the node down. The other replica first serves reads again: right after the
    // cluster is built it may not have replayed the app database's creation yet, and a login
    // it refused then keeps it out of the read set for a few checks.
    wait_until(
        &env,
        "/node/pg2/replica says 200",
        Duration::from_secs(10),
        || api.get("/node/pg2/replica").0 == 200,
    );
    env.cluster
        .node("pg3")
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("stop pg3");
    let stopped = Instant::now();
    wait_until(
        &env,
        "/node/pg3/replica says 503",
        Duration::from_secs(10),
        || api.get("/node/pg3/replica").0 == 503,
    );
    eprintln!(
        "/node/pg3/replica flipped {:?} after the stop",
        stopped.elapsed()
    );
    assert_eq!(api.get("/node/pg2/replica").0, 200);
    env.cluster
        .node("pg3")
        .start(Duration::from_secs(30))
        .expect("restart pg3");
    wait_until(
        &env,
        "/node/pg3/replica says 200 again",
        Duration::from_secs(30),
        || api.get("/node/pg3/replica").0 == 200,
    );

    // Changes need the token.
    let (status, body) = api.post("/api/reload", None, "");
    assert_eq!(status, 401, "{body}");
    let (status, _) = api.post("/api/reload", Some("wrong-token-0123456789"), "");
    assert_eq!(status, 401);
    let (status, body) = api.post("/api/reload", Some(TOKEN), "");
    assert_eq!(status, 200, "{body}");
    let (status, body) = api.post("/api/switchover", Some(TOKEN), r#"{"to": "nosuch"}"#);
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("nosuch"), "{body}");
    // PROMOTE over HTTP: refusals with their sentence, hint and SQLSTATE.
    let (status, body) = api.post("/api/promote/pg2", Some(TOKEN), "");
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("pg1 answers as the primary"), "{body}");
    assert!(body.contains("FORCE primary-answers"), "{body}");
    let (status, body) = api.post("/api/promote/pg2?force=nonsense", Some(TOKEN), "");
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("22023"), "{body}");
    let cluster = api.json("/api/cluster");
    assert_eq!(cluster[0]["write_gate"], "open", "{cluster}");
    assert_eq!(api.json("/ready")["write_gate"], "open");
    let (status, body) = api.post("/api/switchover", Some(TOKEN), r#"{"to": "pg2"}"#);
    assert_eq!(
        status,
        200,
        "switchover over HTTP: {body}\n{}",
        env.pgherd.log()
    );
    assert!(body.contains("steps"), "{body}");
    assert_eq!(api.json("/primary")["primary"], "pg2");
    assert_eq!(api.get("/node/pg2/primary").0, 200);
    wait_until(
        &env,
        "pg1 serves reads as a replica",
        Duration::from_secs(30),
        || api.get("/node/pg1/replica").0 == 200,
    );
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_every_documented_metric_is_there() {
    let (env, api) = api_env(1);
    // A client and some traffic, so every per-pool and per-client family has samples.
    let client = env.app().await;
    for _ in 0..5 {
        first_value(&client, "SELECT 1").await.expect("a query");
    }
    // An error from the server, and one pgherd answers itself (an unknown routing hint).
    first_value(&client, "SELECT 1/0")
        .await
        .expect_err("division by zero");
    first_value(&client, "/* pgherd:nowhere */ SELECT 1")
        .await
        .expect_err("an unknown hint");
    let (text, scrape) = api.scrape();
    // A histogram's `_sum` and `_count` samples belong to its family.
    let scraped: HashSet<&str> = scrape
        .samples
        .iter()
        .map(|s| {
            let name = s.metric.as_str();
            ["_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .filter(|base| base.ends_with("_seconds"))
                .unwrap_or(name)
        })
        .collect();

    let doc_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/metrics.md");
    let doc = std::fs::read_to_string(&doc_path).expect("docs/metrics.md");
    // Metrics of replication sets (`[sets]`) need a set and a subscriber: tests/sets.rs
    // scrapes them.
    let documented: HashSet<&str> = doc
        .lines()
        .filter(|l| !l.contains("(`[sets]`)"))
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|name| name.starts_with("pgherd_"))
        .collect();
    assert!(documented.len() > 10, "{documented:?}");
    for name in &documented {
        assert!(
            scraped.contains(name),
            "{name} is documented but not exported:\n{text}"
        );
    }
    for name in &scraped {
        assert!(
            documented.contains(name),
            "{name} is exported but not in docs/metrics.md"
        );
    }
    // Figures agree with what happened.
    let value = |metric: &str, label: (&str, &str)| sample_sum(&scrape, metric, label);
    assert!(
        value("pgherd_queries_total", ("database", APP)) >= 5.0,
        "{text}"
    );
    assert_eq!(value("pgherd_clients", ("database", APP)), 1.0, "{text}");
    assert_eq!(
        value("pgherd_node_takes_writes", ("node", "pg1")),
        1.0,
        "{text}"
    );
    assert_eq!(value("pgherd_node_up", ("node", "pg2")), 1.0, "{text}");
    assert!(
        value("pgherd_node_health_checks_total", ("result", "ok")) > 0.0,
        "{text}"
    );
    assert!(
        value("pgherd_events_total", ("kind", "elected")) >= 1.0,
        "{text}"
    );
    assert!(
        value("pgherd_server_errors_total", ("class", "22")) >= 1.0,
        "{text}"
    );
    assert!(
        value("pgherd_errors_total", ("class", "22")) >= 1.0,
        "{text}"
    );
    assert!(
        value("pgherd_route_cache_misses_total", ("database", APP)) >= 1.0,
        "{text}"
    );
    assert!(
        value("pgherd_route_cache_hits_total", ("database", APP)) >= 1.0,
        "{text}"
    );
    // Every pool of the app database (reads may have gone to either node).
    let transactions: f64 = scrape
        .samples
        .iter()
        .filter_map(|s| match &s.value {
            prometheus_parse::Value::Histogram(buckets)
                if s.metric == "pgherd_transaction_duration_seconds"
                    && s.labels.get("database") == Some(APP) =>
            {
                buckets.last().map(|b| b.count)
            }
            _ => None,
        })
        .sum();
    assert!(transactions >= 5.0, "{text}");
    drop(client);
}

impl Api {
    /// /metrics, as text and parsed.
    fn scrape(&self) -> (String, prometheus_parse::Scrape) {
        let (status, text) = self.get("/metrics");
        assert_eq!(status, 200, "{text}");
        let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
            .expect("the Prometheus text format");
        (text, scrape)
    }

    /// A counter's value for the app database, from a fresh scrape.
    fn app_counter(&self, metric: &str) -> f64 {
        sample_sum(&self.scrape().1, metric, ("database", APP))
    }
}

/// The sum of `metric`'s counter and gauge samples with `label`.
fn sample_sum(scrape: &prometheus_parse::Scrape, metric: &str, label: (&str, &str)) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && s.labels.get(label.0) == Some(label.1))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => f64::NAN,
        })
        .sum()
}

/// The catalog is read again after every schema change and once a minute; a reading that
/// finds what routing depends on unchanged (an index more) keeps every decision, so no
/// statement shape is parsed again on the data path. One that finds a new function does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalog_reading_that_finds_nothing_new_keeps_the_decisions() {
    let (env, api) = api_env(1);
    let client = env.app().await;
    // After a schema change, wait for the reading it asked for.
    let read_after = |before: f64| {
        wait_until(&env, "a catalog reading", Duration::from_secs(10), || {
            api.app_counter("pgherd_catalog_readings_total") > before
        })
    };
    // The reading at start first: one under way could finish after a change and miss it.
    read_after(0.0);
    assert_eq!(
        api.app_counter("pgherd_catalog_changes_total"),
        1.0,
        "the first reading counts as a change"
    );
    client
        .batch_execute("CREATE TABLE keep_decisions (id int)")
        .await
        .expect("create a table");
    wait_until(&env, "the new table read", Duration::from_secs(10), || {
        api.app_counter("pgherd_catalog_changes_total") == 2.0
    });
    let select = |id: i32| format!("SELECT id FROM keep_decisions WHERE id = {id}");
    first_value(&client, &select(1)).await.ok();
    let changes = api.app_counter("pgherd_catalog_changes_total");

    let readings = api.app_counter("pgherd_catalog_readings_total");
    client
        .batch_execute("CREATE INDEX keep_decisions_id ON keep_decisions (id)")
        .await
        .expect("create an index");
    read_after(readings);
    // (The CREATE INDEX itself was classified: counted from here.)
    let misses = api.app_counter("pgherd_route_cache_misses_total");
    first_value(&client, &select(2)).await.ok();
    assert_eq!(
        api.app_counter("pgherd_catalog_changes_total"),
        changes,
        "an index changes nothing routing reads"
    );
    assert_eq!(
        api.app_counter("pgherd_route_cache_misses_total"),
        misses,
        "the statement's shape was decided before the reading: found, not parsed again"
    );
    // Each request is routed once: the server taken for it is not questioned again.
    let lookups = || {
        api.app_counter("pgherd_route_cache_hits_total")
            + api.app_counter("pgherd_route_cache_misses_total")
    };
    let before = lookups();
    for id in 10..20 {
        first_value(&client, &select(id)).await.ok();
    }
    assert_eq!(
        lookups() - before,
        10.0,
        "decisions looked up for 10 requests"
    );

    client
        .batch_execute(
            "CREATE FUNCTION keep_decisions_f() RETURNS int LANGUAGE sql VOLATILE AS 'SELECT 1'",
        )
        .await
        .expect("create a function");
    wait_until(
        &env,
        "the new function read",
        Duration::from_secs(10),
        || api.app_counter("pgherd_catalog_changes_total") > changes,
    );
    let misses = api.app_counter("pgherd_route_cache_misses_total");
    first_value(&client, &select(3)).await.ok();
    assert_eq!(
        api.app_counter("pgherd_route_cache_misses_total"),
        misses + 1.0,
        "a new function may change any decision: the shape is classified again"
    );
}
