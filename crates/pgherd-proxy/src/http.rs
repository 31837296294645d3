//! The HTTP API (`[api] listen`): JSON views, health checks for load balancers and
//! orchestrators (HAProxy `option httpchk`, Kubernetes probes), Prometheus metrics, and the
//! operations of the admin console behind a bearer token. It reads the same views as the
//! console and acts through the same functions; it never touches client sessions itself.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pgherd_wire::{PgError, SqlState};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use crate::app::App;
use crate::nodes::Role;
use crate::views;

/// Binds every `[api] listen` address (before pgherd reports ready, so a port in use is a
/// startup error) and serves them until shutdown.
pub async fn bind(addrs: &[SocketAddr]) -> Result<Vec<TcpListener>, String> {
    let mut listeners = Vec::new();
    for addr in addrs {
        listeners.push(TcpListener::bind(addr).await.map_err(|e| {
            format!("cannot listen for the HTTP API on {addr} ([api] listen): {e}")
        })?);
    }
    Ok(listeners)
}

/// HTTP connections served at once; beyond this new ones are closed at once, so idle HTTP
/// clients can never use up the descriptors PostgreSQL clients need.
const MAX_HTTP_CONNECTIONS: usize = 256;
/// A request's head must arrive within this; a kept-alive connection waiting for its next
/// request is closed after it too.
const HTTP_HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// No HTTP connection lives longer, whatever it does.
const HTTP_CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

pub fn spawn(app: &Arc<App>, listeners: Vec<TcpListener>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_HTTP_CONNECTIONS));
    for listener in listeners {
        let router = router(app.clone());
        let stop = app.shutdown_signal();
        let handed_over = app.handover.stop_accepting();
        if let Ok(addr) = listener.local_addr() {
            tracing::info!(%addr, "HTTP API listening");
        }
        tokio::spawn(serve(listener, router, stop, handed_over, permits.clone()));
    }
}

/// Accepts HTTP connections until shutdown, each bounded in time and all in number.
async fn serve(
    listener: TcpListener,
    router: Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
    mut handed_over: tokio::sync::watch::Receiver<bool>,
    permits: Arc<tokio::sync::Semaphore>,
) {
    let mut refused: u64 = 0;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stopping| *stopping) => return,
            // An upgrade's new process serves the API on the same socket from now on.
            _ = handed_over.wait_for(|stop| *stop) => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "HTTP API accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            refused += 1;
            if crate::throttle::worth_logging(u32::try_from(refused).unwrap_or(u32::MAX)) {
                tracing::warn!(%peer, refused, "HTTP API connection refused: {MAX_HTTP_CONNECTIONS} connections are open");
            }
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HTTP_HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(HTTP_CONNECTION_LIFETIME, connection).await;
            drop(permit);
        });
    }
}

pub fn router(app: Arc<App>) -> Router {
    let changes = Router::new()
        .route("/api/switchover", post(switchover))
        .route("/api/rejoin/{name}", post(rejoin))
        .route("/api/promote/{name}", post(promote))
        .route("/api/detach/{name}", post(detach))
        .route("/api/attach/{name}", post(attach))
        .route("/api/pause", post(pause))
        .route("/api/resume", post(resume))
        .route("/api/kill/{database}", post(kill))
        .route("/api/reconnect", post(reconnect))
        .route("/api/reload", post(reload))
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            require_token,
        ));
    Router::new()
        .route("/", get(dashboard))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/primary", get(cluster_primary))
        .route("/replica", get(cluster_replica))
        .route("/node/{name}/primary", get(node_primary))
        .route("/node/{name}/replica", get(node_replica))
        .route("/metrics", get(metrics))
        .route("/api/nodes", get(|s| view(s, views::nodes)))
        .route("/api/cluster", get(|s| view(s, views::cluster)))
        .route("/api/instances", get(|s| view(s, views::instances)))
        .route("/api/shards", get(|s| view(s, views::shards)))
        .route("/api/cache", get(|s| view(s, crate::result_cache::view)))
        .route("/api/sets", get(|s| view(s, crate::sets_watch::view)))
        .route("/api/databases", get(|s| view(s, views::databases)))
        .route("/api/users", get(|s| view(s, views::users)))
        .route("/api/pools", get(|s| view(s, views::pools)))
        .route("/api/stats", get(|s| view(s, views::stats)))
        .route("/api/lists", get(|s| view(s, views::lists)))
        .route("/api/clients", get(|s| view(s, views::clients)))
        .route("/api/servers", get(|s| view(s, views::servers)))
        .route("/api/events", get(|s| view(s, views::events)))
        .route("/api/config", get(|s| view(s, views::config)))
        .route("/api/status", get(status))
        .merge(changes)
        .fallback(not_found)
        .with_state(app)
}

type AppState = State<Arc<App>>;

async fn view(State(app): AppState, make: fn(&App) -> views::Table) -> Json<Value> {
    Json(make(&app).json())
}

/// Everything `pgherd status` prints, in one answer.
async fn status(State(app): AppState) -> Json<Value> {
    let writer = app.nodes.writer().map(|n| n.name().to_owned());
    Json(json!({
        "version": crate::admin::VERSION,
        "primary": writer,
        "cluster": views::cluster(&app).json().get(0).cloned().unwrap_or_default(),
        "nodes": views::nodes(&app).json(),
        "instances": views::instances(&app).json(),
        "shards": views::shards(&app).json(),
        "cache": crate::result_cache::view(&app).json(),
        "sets": crate::sets_watch::view(&app).json(),
        "pools": views::pools(&app).json(),
        "lists": views::lists(&app).json(),
    }))
}

/// 200 while pgherd runs, 503 once it drains.
async fn health(State(app): AppState) -> Response {
    if app.is_shutting_down() {
        answer(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"status": "stopping"}),
        )
    } else {
        answer(StatusCode::OK, json!({"status": "up"}))
    }
}

/// 200 when pgherd can serve writes now (a node takes them), 503 otherwise.
async fn ready(State(app): AppState) -> Response {
    cluster_primary(State(app)).await
}

/// A write-through check: a node takes writes, pgherd is not draining, and writes are not
/// refused (`strict` durability without a streaming standby). A switchover's moment of held
/// writes does not count against it: those writes wait, they do not fail.
async fn cluster_primary(State(app): AppState) -> Response {
    let gate = views::write_gate(&app);
    let reason = match (app.nodes.writer(), app.nodes.writes_refused()) {
        _ if app.is_shutting_down() => "pgherd is shutting down".to_owned(),
        (None, _) => "no node takes writes now".to_owned(),
        (Some(_), Some(refused)) => refused,
        (Some(n), None) => {
            return answer(
                StatusCode::OK,
                json!({"primary": n.name(), "write_gate": gate}),
            )
        }
    };
    answer(
        StatusCode::SERVICE_UNAVAILABLE,
        json!({"primary": null, "reason": reason, "write_gate": gate, "nodes": app.nodes.describe_all()}),
    )
}

/// The lag limits of `?lag=` (bytes, or with a kB/MB/GB unit as in Patroni) and `?lag_ms=`.
struct LagLimit {
    bytes: Option<u64>,
    ms: Option<u64>,
}

impl LagLimit {
    fn from_query(query: &HashMap<String, String>) -> Result<LagLimit, Refusal> {
        let bytes = match query.get("lag") {
            Some(text) => Some(parse_bytes(text).ok_or_else(|| {
                Refusal(
                    StatusCode::BAD_REQUEST,
                    json!({"error": format!("lag={text:?} is not a size; use bytes or a number with kB, MB or GB")}),
                )
            })?),
            None => None,
        };
        let ms = match query.get("lag_ms") {
            Some(text) => Some(text.parse().map_err(|_| {
                Refusal(
                    StatusCode::BAD_REQUEST,
                    json!({"error": format!("lag_ms={text:?} is not a number of milliseconds")}),
                )
            })?),
            None => None,
        };
        Ok(LagLimit { bytes, ms })
    }

    fn admits(&self, n: &crate::nodes::NodeState) -> bool {
        self.bytes.is_none_or(|b| n.lag_bytes() <= b) && self.ms.is_none_or(|m| n.lag_ms() <= m)
    }
}

fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: u64 = number.parse().ok()?;
    let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1 << 10,
        "mb" => 1 << 20,
        "gb" => 1 << 30,
        _ => return None,
    };
    number.checked_mul(factor)
}

/// Whether `n` serves reads now within `limit`.
fn serves_reads(app: &App, n: &crate::nodes::NodeState, limit: &LagLimit) -> bool {
    n.role() == Role::Replica
        && n.answers()
        && !app.nodes.view().is_excluded(n.id)
        && n.in_read_set()
        && limit.admits(n)
}

/// 200 if at least one replica serves reads within the lag limit.
async fn cluster_replica(
    State(app): AppState,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let limit = match LagLimit::from_query(&query) {
        Ok(l) => l,
        Err(r) => return r.into_response(),
    };
    let serving: Vec<String> = app
        .nodes
        .all()
        .iter()
        .filter(|n| serves_reads(&app, n, &limit))
        .map(|n| n.name().to_owned())
        .collect();
    if serving.is_empty() {
        answer(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"replicas": serving, "reason": "no replica serves reads within the limits"}),
        )
    } else {
        answer(StatusCode::OK, json!({"replicas": serving}))
    }
}

async fn node_primary(State(app): AppState, Path(name): Path<String>) -> Response {
    let Some(n) = app.nodes.get(&name) else {
        return unknown_node(&name);
    };
    let row = node_json(&app, &name);
    if views::takes_writes(&app, &n) && n.answers() {
        answer(StatusCode::OK, row)
    } else {
        answer(StatusCode::SERVICE_UNAVAILABLE, row)
    }
}

async fn node_replica(
    State(app): AppState,
    Path(name): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let limit = match LagLimit::from_query(&query) {
        Ok(l) => l,
        Err(r) => return r.into_response(),
    };
    let Some(n) = app.nodes.get(&name) else {
        return unknown_node(&name);
    };
    let row = node_json(&app, &name);
    if serves_reads(&app, &n, &limit) {
        answer(StatusCode::OK, row)
    } else {
        answer(StatusCode::SERVICE_UNAVAILABLE, row)
    }
}

/// SHOW NODES's row for one node, as JSON.
fn node_json(app: &App, name: &str) -> Value {
    match views::nodes(app).json() {
        Value::Array(rows) => rows
            .into_iter()
            .find(|r| r.get("name").and_then(Value::as_str) == Some(name))
            .unwrap_or(Value::Null),
        _ => Value::Null,
    }
}

fn unknown_node(name: &str) -> Response {
    answer(
        StatusCode::NOT_FOUND,
        json!({"error": format!("no node named {name:?} in the config")}),
    )
}

/// The dashboard: one page built into the binary (no CDN, works offline) that polls the JSON
/// endpoints and sends its actions with the token the operator types in.
async fn dashboard() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        include_str!("dashboard.html"),
    )
        .into_response()
}

async fn metrics(State(app): AppState) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::render(&app),
    )
        .into_response()
}

#[derive(serde::Deserialize, Default)]
struct SwitchoverRequest {
    to: Option<String>,
}

async fn switchover(State(app): AppState, body: Option<Json<SwitchoverRequest>>) -> Response {
    let to = body.and_then(|Json(b)| b.to);
    steps(crate::switchover::switchover(&app, to.as_deref()).await)
}

async fn rejoin(State(app): AppState, Path(name): Path<String>) -> Response {
    steps(crate::rejoin::rejoin(&app, &name).await)
}

/// `?force=safeguard,...` skips the named safeguards.
async fn promote(
    State(app): AppState,
    Path(name): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let force: Vec<&str> = query.get("force").map(String::as_str).into_iter().collect();
    let result = match crate::control::parse_safeguards(&force) {
        Ok(forced) => crate::control::promote(&app, &name, &forced).await,
        Err(e) => Err(e),
    };
    steps(result)
}

/// `?database=NAME`, or every database without it.
async fn reconnect(State(app): AppState, Query(query): Query<HashMap<String, String>>) -> Response {
    steps(crate::control::reconnect(
        &app,
        query.get("database").map(String::as_str),
    ))
}

async fn detach(State(app): AppState, Path(name): Path<String>) -> Response {
    steps(crate::control::detach(&app, &name))
}

async fn attach(State(app): AppState, Path(name): Path<String>) -> Response {
    steps(crate::control::attach(&app, &name))
}

/// `?database=NAME`, or every database without it.
async fn pause(State(app): AppState, Query(query): Query<HashMap<String, String>>) -> Response {
    steps(crate::control::pause(&app, query.get("database").map(String::as_str)).await)
}

async fn resume(State(app): AppState, Query(query): Query<HashMap<String, String>>) -> Response {
    steps(crate::control::resume(
        &app,
        query.get("database").map(String::as_str),
    ))
}

async fn kill(State(app): AppState, Path(database): Path<String>) -> Response {
    steps(crate::control::kill(&app, &database))
}

async fn reload(State(app): AppState) -> Response {
    match crate::lifecycle::reload(&app) {
        Ok(notes) => answer(StatusCode::OK, json!({"reloaded": true, "notes": notes})),
        Err(e) => answer(
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({"error": format!("reload failed, keeping the running config: {e}")}),
        ),
    }
}

fn steps(result: Result<Vec<String>, PgError>) -> Response {
    match result {
        Ok(steps) => answer(StatusCode::OK, json!({"steps": steps})),
        Err(e) => {
            let status = match e.code {
                SqlState::INSUFFICIENT_PRIVILEGE => StatusCode::FORBIDDEN,
                SqlState::UNDEFINED_OBJECT | SqlState::INVALID_CATALOG_NAME => {
                    StatusCode::NOT_FOUND
                }
                SqlState::INVALID_PARAMETER_VALUE => StatusCode::BAD_REQUEST,
                _ => StatusCode::CONFLICT,
            };
            let mut body = json!({"error": e.message, "sqlstate": e.code.code()});
            for (key, value) in [("detail", e.detail), ("hint", e.hint)] {
                if let Some(value) = value {
                    body[key] = json!(value);
                }
            }
            answer(status, body)
        }
    }
}

/// In front of every endpoint that changes something.
async fn require_token(
    State(app): AppState,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match authorize(&app, request.headers()) {
        Ok(()) => next.run(request).await,
        Err(refusal) => refusal.into_response(),
    }
}

/// Changing endpoints need `Authorization: Bearer <[api] token>`; without a configured token
/// they are refused outright.
fn authorize(app: &App, headers: &HeaderMap) -> Result<(), Refusal> {
    let config = app.config();
    let Some(token) = config.api.token.as_deref() else {
        return Err(Refusal(
            StatusCode::FORBIDDEN,
            json!({"error": "changes over HTTP are off: set [api] token"}),
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(given.as_bytes(), token.as_bytes()) {
        Ok(())
    } else {
        tracing::warn!("HTTP API request with a missing or wrong token refused");
        Err(Refusal(
            StatusCode::UNAUTHORIZED,
            json!({"error": "missing or wrong token (Authorization: Bearer <[api] token>)"}),
        ))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found() -> Response {
    answer(
        StatusCode::NOT_FOUND,
        json!({"error": "no such endpoint", "endpoints": [
            "GET / (the dashboard)", "GET /health", "GET /ready", "GET /primary", "GET /replica?lag=&lag_ms=",
            "GET /node/{name}/primary", "GET /node/{name}/replica?lag=&lag_ms=", "GET /metrics",
            "GET /api/status", "GET /api/nodes", "GET /api/cluster", "GET /api/instances", "GET /api/shards", "GET /api/cache", "GET /api/sets", "GET /api/databases", "GET /api/users", "GET /api/pools", "GET /api/stats",
            "GET /api/lists", "GET /api/clients", "GET /api/servers", "GET /api/events", "GET /api/config",
            "POST /api/switchover {\"to\": node}", "POST /api/rejoin/{name}", "POST /api/promote/{name}?force=",
            "POST /api/detach/{name}", "POST /api/attach/{name}", "POST /api/pause?database=",
            "POST /api/resume?database=", "POST /api/kill/{database}", "POST /api/reconnect?database=", "POST /api/reload",
        ]}),
    )
}

/// An answer that ends a request early (bad parameters, no token).
struct Refusal(StatusCode, Value);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        answer(self.0, self.1)
    }
}

fn answer(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_sizes_read_like_patroni() {
        assert_eq!(parse_bytes("0"), Some(0));
        assert_eq!(parse_bytes("1024"), Some(1024));
        assert_eq!(parse_bytes("16kB"), Some(16 << 10));
        assert_eq!(parse_bytes("10MB"), Some(10 << 20));
        assert_eq!(parse_bytes("1GB"), Some(1 << 30));
        assert_eq!(parse_bytes("ten"), None);
        assert_eq!(parse_bytes("5TB"), None);
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"abc"));
    }
}
