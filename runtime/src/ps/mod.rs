//! Parameter servers for sparse models (Fleet's PS): tables too large to
//! replicate on every worker, split into shards that servers own by
//! rendezvous hashing, rows made on first touch and updated on the server
//! by a per-row optimiser, each step's pushes applied exactly once.
//!
//! - `table.rs`: a table's spec, its rows, initialisers and optimisers;
//! - `placement.rs`: which server owns which shard;
//! - `server.rs`: a server's state and the exactly-once rule, without I/O;
//! - `wire.rs`: the frames on a connection;
//! - `service.rs`: the server on the network, and the workers' client;
//! - `control.rs`: the job's side: which servers hold which shards, and
//!   what a generation boundary changes (servers lost or added);
//! - `tables.rs`: a worker's tables: defined once, declared at first use,
//!   every table pushed by every rank every step.

pub mod control;
pub mod placement;
pub mod server;
pub mod service;
pub mod table;
pub mod tables;
pub mod wire;

pub use server::{Mark, PsError, PushTag, Pushed, Server, Stats};
pub use service::{Client, Service};
pub use table::{Init, Optimizer, SHARDS, SavedTable, TableSpec};
pub use tables::Tables;
