//! Where a statement may run and what it may do to the session, decided without IO.
//!
//! [`lex`] reads a statement as PostgreSQL's scanner does and gives the key decisions are
//! cached under (literals blanked) and the routing hints in its comments; [`classify`] reads
//! it with PostgreSQL's own parser, within bounds ([`parse`]), and says whether a replica may
//! run it, what it does to the session, and why. The proxy supplies what only a server knows
//! (functions, relations) as a [`catalog::Snapshot`] built from catalog rows.
//!
//! Architecture invariant: no sockets, no clocks, no global state; the same input always gives
//! the same decision.

pub mod balance;
pub mod cacheable;
pub mod catalog;
mod classify;
pub mod copy_split;
mod decision;
mod lexer;
mod merge_numeric;
pub mod merge_plan;
pub mod merge_rows;
pub mod merge_stream;
pub mod parse;
pub mod pin;
pub mod plan;
pub mod reshard;
mod session_change;
mod shape_memo;
pub mod shard_hash;
pub mod shard_plan;
pub mod shard_route;
pub mod shard_shape;
mod tree;
pub mod two_phase;
pub mod tx_log;

pub use balance::Balance;
pub use catalog::Catalog;
pub use classify::{classify, leaving_session_state, setting_value, ROUTE_SETTING, SHARD_SETTING};
pub use decision::{Decision, Pin, SessionEffect, ShardSetting, Target, TxEffect};
pub use lexer::{lex, lex_with_spans, skip_blanks, HintError, Lexed};
pub use plan::{Role, Routed};
pub use session_change::may_change_session;
pub use shape_memo::ShapeMemo;

/// How fresh the data a session reads from replicas must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consistency {
    /// Any replica within the lag limits.
    Eventual,
    /// As `Eventual`, and never older than the session's own last committed write.
    ReadYourWrites,
    /// No replica reads at all.
    Primary,
}

impl Consistency {
    pub fn parse(s: &str) -> Option<Consistency> {
        Some(match s {
            "eventual" => Consistency::Eventual,
            "read_your_writes" => Consistency::ReadYourWrites,
            "primary" => Consistency::Primary,
            _ => return None,
        })
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Consistency::Eventual => "eventual",
            Consistency::ReadYourWrites => "read_your_writes",
            Consistency::Primary => "primary",
        }
    }
}

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

/// A seeded xorshift sequence for the randomized tests: the same inputs on every run.
#[cfg(test)]
fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

#[cfg(test)]
mod lexer_tests;
#[cfg(test)]
mod plan_tests;
#[cfg(test)]
mod shape_memo_tests;
#[cfg(test)]
mod tests;
