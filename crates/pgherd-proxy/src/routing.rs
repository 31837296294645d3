//! Where each request runs: the per-database [`Router`] turns a statement into a routing
//! decision (with `pgherd-route`'s classifier, a cache keyed by statement shape, and the
//! database's function volatilities loaded from `pg_proc`).
//!
//! Invariant: a statement pgherd cannot prove to be a read runs on the primary. The catalog
//! only ever moves functions from "unknown" (primary) to what `pg_proc` says.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use pgherd_route::{classify, shape, Decision, FunctionCatalog, HintError, Route, Target};
use pgherd_wire::{PgError, SqlState};

use crate::app::App;
use crate::nodes;

/// A routing decision for one statement text, with the hint its comments carry.
#[derive(Debug, Clone)]
pub struct Routed {
    pub decision: Arc<Decision>,
    pub hint: Option<Route>,
}

impl Routed {
    /// A request pgherd cannot inspect, which therefore runs on the primary.
    pub fn primary(reason: &str) -> Routed {
        Routed {
            decision: Arc::new(Decision::new(Target::Primary, reason)),
            hint: None,
        }
    }

    /// Where the statement must run for a session whose route is `route`.
    pub fn target(&self, route: Route) -> Target {
        let route = self.hint.unwrap_or(route);
        match route {
            Route::Primary => Target::Primary,
            Route::Replica => match self.decision.target {
                Target::Any => Target::Any,
                _ => Target::Replica,
            },
            Route::Auto if self.decision.pin.is_some() => Target::Primary,
            Route::Auto => self.decision.target,
        }
    }
}

/// Function name → "some overload is VOLATILE".
#[derive(Default)]
struct Catalog {
    volatile: HashMap<String, bool>,
}

impl FunctionCatalog for Catalog {
    fn volatile(&self, name: &str) -> Option<bool> {
        self.volatile.get(name).copied()
    }
}

/// How often an unknown function may trigger a catalog reload.
const CATALOG_RELOAD_MIN_INTERVAL: Duration = Duration::from_secs(5);

const CATALOG_SQL: &str =
    "SELECT lower(proname), bool_or(provolatile = 'v') FROM pg_catalog.pg_proc GROUP BY 1";

pub struct Router {
    server_dbname: String,
    catalog: ArcSwap<Catalog>,
    /// (shape hash, text length) → decision. Cleared when full or when the catalog changes.
    decisions: Mutex<DecisionCache>,
    capacity: usize,
    loading: AtomicBool,
    last_load: Mutex<Option<Instant>>,
}

/// The decisions by statement shape, and how often a lookup found one (counted under the
/// lock the lookup takes anyway).
#[derive(Default)]
struct DecisionCache {
    map: HashMap<(u64, usize), Arc<Decision>>,
    hits: u64,
    misses: u64,
}

impl Router {
    /// (decisions found in the cache, statements classified with the parser) since start.
    pub fn cache_counts(&self) -> (u64, u64) {
        let cache = self.decisions.lock();
        (cache.hits, cache.misses)
    }

    pub fn new(server_dbname: String, capacity: usize) -> Router {
        Router {
            server_dbname,
            catalog: ArcSwap::from_pointee(Catalog::default()),
            decisions: Mutex::default(),
            capacity,
            loading: AtomicBool::new(false),
            last_load: Mutex::new(None),
        }
    }

    /// Decides for `sql`; an invalid hint is the client's error.
    pub fn route(self: &Arc<Self>, app: &Arc<App>, sql: &[u8]) -> Result<Routed, PgError> {
        let shape = shape(sql);
        let hint = shape.hint.map_err(|e| hint_error(&e))?;
        let key = (shape.hash, sql.len());
        {
            let mut cache = self.decisions.lock();
            if let Some(decision) = cache.map.get(&key).cloned() {
                cache.hits += 1;
                return Ok(Routed { decision, hint });
            }
            cache.misses += 1;
        }
        let text = String::from_utf8_lossy(sql);
        let catalog = self.catalog.load();
        let decision = Arc::new(classify(&text, &**catalog));
        if decision.needs_catalog {
            self.reload_catalog_soon(app);
        }
        if decision.cacheable && !decision.needs_catalog {
            let mut cache = self.decisions.lock();
            if cache.map.len() >= self.capacity {
                cache.map.clear();
            }
            cache.map.insert(key, decision.clone());
        }
        if let Some(value) = &decision.route_setting {
            if Route::parse(value).is_none() {
                return Err(route_setting_error(value));
            }
        }
        Ok(Routed { decision, hint })
    }

    fn reload_catalog_soon(self: &Arc<Self>, app: &Arc<App>) {
        let recent = self
            .last_load
            .lock()
            .is_some_and(|at| at.elapsed() < CATALOG_RELOAD_MIN_INTERVAL);
        if !recent {
            self.refresh_catalog(app.clone());
        }
    }

    /// Loads the database's function volatilities from the primary, in the background.
    pub fn refresh_catalog(self: &Arc<Self>, app: Arc<App>) {
        if self.loading.swap(true, Ordering::AcqRel) {
            return;
        }
        *self.last_load.lock() = Some(Instant::now());
        let router = self.clone();
        tokio::spawn(async move {
            match router.load_catalog(&app).await {
                Ok(functions) => {
                    tracing::debug!(database = %router.server_dbname, functions, "function catalog loaded");
                }
                Err(error) => {
                    tracing::warn!(database = %router.server_dbname, %error, "cannot load the function catalog; statements calling functions go to the primary");
                }
            }
            router.loading.store(false, Ordering::Release);
        });
    }

    async fn load_catalog(&self, app: &Arc<App>) -> Result<usize, String> {
        let node = app
            .nodes
            .writer()
            .ok_or_else(|| "no primary is up".to_owned())?;
        let config = app.config();
        let mut conn = nodes::management_connection(
            &node,
            &config.cluster,
            &app.connect_context(),
            &self.server_dbname,
        )
        .await
        .map_err(|e| e.to_string())?;
        let rows = conn
            .simple_query(CATALOG_SQL)
            .await
            .map_err(|e| e.to_string())?;
        let mut catalog = Catalog::default();
        for row in rows {
            if let (Some(Some(name)), Some(Some(volatile))) = (row.first(), row.get(1)) {
                catalog.volatile.insert(name.clone(), volatile == "t");
            }
        }
        let count = catalog.volatile.len();
        self.catalog.store(Arc::new(catalog));
        self.decisions.lock().map.clear();
        Ok(count)
    }
}

fn hint_error(e: &HintError) -> PgError {
    PgError::error(SqlState::INVALID_PARAMETER_VALUE, e.to_string())
        .with_hint("write /* pgherd:primary */ or /* pgherd:replica */")
}

fn route_setting_error(value: &str) -> PgError {
    PgError::error(
        SqlState::INVALID_PARAMETER_VALUE,
        format!("invalid value for parameter \"pgherd.route\": \"{value}\""),
    )
    .with_hint("Available values: auto, primary, replica.")
}
