//! The coordinator's decisions, without I/O: each machine takes events and
//! the time as arguments and hands back what the shell around it must do, so
//! every rule (a join, a lost rank, a commit, a timeout) is tested without
//! sockets, processes or a clock.
//!
//! - [`membership`]: who is in the job, generations and their ranks.
//! - [`pipeline`]: the step barrier of one generation.
//! - [`phase`]: training, the final checkpoint, and when failures end the job.
//! - [`ledger`]: exactly-once accounting of the samples trained on.
//! - [`tally`]: the committed position (step, epoch, cursor) and throughput.
//! - [`timers`]: the periodic work, as a table of deadlines.

pub mod ledger;
pub mod membership;
pub mod noise;
pub mod phase;
pub mod pipeline;
pub mod steptimes;
pub mod tally;
pub mod timers;
