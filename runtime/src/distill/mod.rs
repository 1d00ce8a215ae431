//! Service-based distillation: teachers run as inference services that
//! students find through the store, and students read soft labels from
//! whichever teachers are alive.
//!
//! - [`reader`]: the [`DistillReader`], the student's side: batches out to
//!   the teachers alive, soft labels back, failures retried elsewhere.
//! - [`assign`]: which teachers each student calls, weighted by capacity.
//! - [`teacher`]: the teacher service (KServe v2 gRPC) and its registration.
//! - [`rest`]: the teacher's KServe v2 HTTP/REST endpoint, next to gRPC.
//! - [`rest_client`]: the reader's calls to teachers that speak REST.
//! - [`stats`]: what a teacher has been doing, from its own statistics.
//! - [`oip`]: the Open Inference Protocol messages and tensor conversions
//!   that both ends share.
//!
//! The dependencies run one way: `reader` uses `assign`, `rest_client`, `stats` and `oip`;
//! `rest` uses `teacher` and `oip`; nothing here uses `reader`.

pub mod assign;
pub mod oip;
pub mod reader;
pub mod rest;
pub mod rest_client;
pub mod stats;
pub mod teacher;

pub use reader::{
    DistillConfig, DistillError, DistillReader, Distilled, OutputKind, TeacherAccess, TeacherCalls,
    TeacherIo, Teachers, endpoints, parse_endpoint,
};

/// `detail` followed by each cause below it that it does not already say
/// (each layer of a transport error often repeats the one below it).
pub(crate) fn with_causes(
    mut detail: String,
    mut source: Option<&(dyn std::error::Error + 'static)>,
) -> String {
    while let Some(e) = source {
        let said = e.to_string();
        if !detail.contains(&said) {
            detail = if detail.is_empty() { said } else { format!("{detail}: {said}") };
        }
        source = e.source();
    }
    detail
}
