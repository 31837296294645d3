//! Replication management in the style of Slony-I, on PostgreSQL's own replication: the parts
//! that decide, with no sockets and no clocks, so they are tested on data alone. The IO shells
//! that run them against nodes live in the `pgherd` binary (`check-consistency`).

pub mod consistency;
pub mod script;
pub mod sets;
