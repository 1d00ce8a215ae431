//! The worker's side of a job, for any training program: the built-in MLP
//! worker ([`crate::trainer::worker`]) and the Python package both drive a
//! [`session::Session`].

pub mod session;
