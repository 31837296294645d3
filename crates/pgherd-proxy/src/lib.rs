//! pgherd's IO shell: everything that touches a socket.
//!
//! The path of a query: [`lifecycle`] accepts the connection; [`client`] negotiates TLS, reads
//! the startup packet, applies the hba rules and authenticates; [`relay::Session`] then waits
//! for the client's request, borrows a server connection from a [`pool::Pool`] (opened by
//! [`server`]), and pumps bytes both ways while [`relay::queue`] tracks what the server still
//! owes, until the server can go back to the pool. Before it borrows, [`routing`] says which
//! node the request may run on.
//!
//! Architecture invariants: this is the only crate that does network IO; protocol parsing
//! lives in `pgherd-wire`, configuration in `pgherd-config`. No lock is held across an await.
//! Every client disconnect has a [`error::Disconnect`] reason, which is logged.

pub mod admin;
pub mod app;
mod auth_query;
mod buffers;
pub mod cache_feed;
pub mod client;
pub mod clients;
pub mod collation;
pub mod control;
pub mod counters;
pub mod cut_off_sessions;
pub mod dcs;
pub mod decisions;
pub mod error;
pub mod events;
pub mod exec;
pub mod failover;
mod failpoint;
pub mod handover;
pub mod http;
mod kept;
pub mod lifecycle;
pub mod memory;
pub mod metrics;
pub mod monitor;
mod msgio;
mod node_ops;
mod node_state;
pub mod nodes;
pub mod pool;
pub mod rejoin;
pub mod relay;
pub mod result_cache;
pub mod routing;
pub mod schema_changes;
pub mod server;
pub mod sets_watch;
pub mod shards;
mod shared_swap;
mod snapshot;
mod startup_settings;
pub mod stream;
pub mod switchover;
mod systemd;
mod throttle;
pub mod tls;
mod two_phase_recovery;
pub mod unix_socket;
pub mod views;

pub use lifecycle::{serve, serve_taking_over};
