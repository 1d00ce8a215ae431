//! Who leads a job and what every party reads about it: the job's lease in
//! the store (one coordinator at a time, fencing tokens that only grow) and
//! the job's record (its progress at every commit), kept off the step's path.

pub mod keeper;
pub mod record;
pub mod seal;
