//! Where each request runs: the per-database [`Router`] turns a statement into a routing
//! decision (with `pgherd-route`'s classifier, a cache keyed by statement shape, and the
//! database's function volatilities loaded from `pg_proc`).
//!
//! Invariant: a statement pgherd cannot prove to be a read runs on the primary. The catalog
//! only ever moves functions from "unknown" (primary) to what `pg_proc` says.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    decisions: Mutex<HashMap<(u64, usize), Arc<Decision>>>,
    capacity: usize,
    loading: AtomicBool,
    last_load: Mutex<Option<Instant>>,
    /// Decisions found in the cache, and statements classified with the parser.
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
}

impl Router {
    pub fn new(server_dbname: String, capacity: usize) -> Router {
        Router {
            server_dbname,
            catalog: ArcSwap::from_pointee(Catalog::default()),
            decisions: Mutex::new(HashMap::new()),
            capacity,
            loading: AtomicBool::new(false),
            last_load: Mutex::new(None),
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
        }
    }

    /// Decides for `sql`; an invalid hint is the client's error.
    pub fn route(self: &Arc<Self>, app: &Arc<App>, sql: &[u8]) -> Result<Routed, PgError> {
        let shape = shape(sql);
        let hint = shape.hint.map_err(|e| hint_error(&e))?;
        let key = (shape.hash, sql.len());
        if let Some(decision) = self.decisions.lock().get(&key) {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(Routed {
                decision: decision.clone(),
                hint,
            });
        }
        self.cache_misses.fetch_add(1, Ordering::Relaxed);
        let text = String::from_utf8_lossy(sql);
        let catalog = self.catalog.load();
        let decision = Arc::new(classify(&text, &**catalog));
        if decision.needs_catalog {
            self.reload_catalog_soon(app);
        }
        if decision.cacheable && !decision.needs_catalog {
            let mut decisions = self.decisions.lock();
            if decisions.len() >= self.capacity {
                decisions.clear();
            }
            decisions.insert(key, decision.clone());
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
        self.decisions.lock().clear();
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
