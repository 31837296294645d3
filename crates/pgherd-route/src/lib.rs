//! Where a statement may run, decided without IO.
//!
//! [`classify`] reads a query with PostgreSQL's own parser and says whether a replica may run
//! it, and why; [`shape`] gives the literal-blind key decisions are cached under and the routing
//! hints found in comments. The proxy supplies what only a server knows (which functions are
//! volatile) through [`FunctionCatalog`].
//!
//! Architecture invariant: no sockets, no clocks, no global state; the same input always gives
//! the same decision.

pub mod balance;
mod classify;
mod shape;

pub use classify::{classify, Decision, FunctionCatalog, Pin, Target, TxEffect, ROUTE_SETTING};
pub use shape::{shape, HintError, Shape};

/// Where a session's statements go: from a hint, the `pgherd.route` setting or the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// Everything on the primary.
    Primary,
    /// Reads on replicas even when pgherd would have sent them to the primary (writes still
    /// fail there, as PostgreSQL refuses them).
    Replica,
    /// pgherd decides per statement.
    Auto,
}

impl Route {
    pub fn parse(s: &str) -> Option<Route> {
        Some(match s {
            "primary" => Route::Primary,
            "replica" => Route::Replica,
            "auto" => Route::Auto,
            _ => return None,
        })
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Route::Primary => "primary",
            Route::Replica => "replica",
            Route::Auto => "auto",
        }
    }
}

#[cfg(test)]
mod tests;
