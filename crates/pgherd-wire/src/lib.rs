//! The PostgreSQL v3 wire protocol for pgherd, without IO.
//!
//! Bytes in, typed messages out: framing with lengths checked before anything is allocated
//! ([`frame`]), the startup-phase packets ([`startup`]), messages per direction ([`frontend`] for
//! what clients send, [`backend`] for what servers send), errors with their SQLSTATE ([`error`],
//! [`SqlState`]) and authentication ([`scram`], [`md5`]).
//!
//! Architecture invariant: this crate never touches a socket, a clock, a thread or a random
//! number generator. Everything it needs from the outside world (nonces, salts) is passed in,
//! so every function is deterministic and can be fuzzed and replayed.

pub mod backend;
pub mod error;
pub mod frame;
pub mod frontend;
pub mod md5;
pub mod scram;
mod sqlstate;
pub mod startup;

pub use error::{PgError, Severity, WireError};
pub use sqlstate::SqlState;
