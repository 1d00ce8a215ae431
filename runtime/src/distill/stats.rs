//! What a teacher has been doing, from its own statistics: KServe v2's
//! statistics extension (`ModelStatistics`), which edl's teachers and
//! Triton both serve. Two readings a window apart give the window's
//! utilisation, queue, rows per second, latencies and errors: what a
//! teacher pool policy sees of each teacher
//! ([`edl_plugin_sdk::TeacherStats`]).

use super::oip::{GrpcInferenceServiceClient, pb};
use edl_plugin_sdk::TeacherStats;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// What one student's requests to one teacher did since they were last
/// told: each answered request's time, and why the student stopped asking
/// it, if it did (a wrong shape, class count or model: nothing retrying
/// fixes).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TeacherRequests {
    /// The teacher, as `host:port`.
    pub addr: String,
    /// Each answered request's time from sent to answered, µs (the newest:
    /// at most twice [`CALLS_KEPT`] of them).
    pub latency_us: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

impl TeacherRequests {
    /// Past twice [`CALLS_KEPT`] times, drops all but the newest
    /// `CALLS_KEPT` in one move (not one at a time: that is quadratic).
    fn keep_newest(&mut self) {
        let n = self.latency_us.len();
        if n > 2 * CALLS_KEPT {
            self.latency_us.drain(..n - CALLS_KEPT);
        }
    }
}

/// Request times kept per teacher between two tellings.
pub const CALLS_KEPT: usize = 4096;

impl TeacherRequests {
    /// Adds one answered request's time.
    pub fn answered(&mut self, took: Duration) {
        self.latency_us.push(took.as_micros().min(u32::MAX as u128) as u32);
        self.keep_newest();
    }

    /// Takes in what another telling of the same teacher says.
    pub fn merge(&mut self, other: TeacherRequests) {
        self.latency_us.extend(other.latency_us);
        self.keep_newest();
        if self.refused.is_none() {
            self.refused = other.refused;
        }
    }
}

/// The `q` quantile (0 to 1) of `us`, ms, by the nearest rank; 0 when empty.
pub fn quantile_ms(us: &mut [u32], q: f64) -> f64 {
    if us.is_empty() {
        return 0.0;
    }
    us.sort_unstable();
    let rank = ((q.clamp(0.0, 1.0) * us.len() as f64).ceil() as usize).clamp(1, us.len());
    us[rank - 1] as f64 / 1e3
}

/// A count and the nanoseconds it took in all.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Tally {
    count: u64,
    ns: u64,
}

impl Tally {
    fn of(d: Option<&pb::StatisticDuration>) -> Tally {
        d.map(|d| Tally { count: d.count, ns: d.ns }).unwrap_or_default()
    }

    fn since(self, before: Tally) -> Tally {
        Tally { count: self.count.saturating_sub(before.count), ns: self.ns.saturating_sub(before.ns) }
    }

    /// The mean, ms (0 with nothing counted).
    fn mean_ms(self) -> f64 {
        if self.count == 0 { 0.0 } else { self.ns as f64 / self.count as f64 / 1e6 }
    }
}

/// One reading of a teacher's statistics (all its models summed).
#[derive(Clone, Copy, Debug)]
pub struct Reading {
    at: Instant,
    rows: u64,
    success: Tally,
    fail: Tally,
    queue: Tally,
    /// Time its model executions took: the sum over its batch sizes
    /// (each execution once, however many requests it served).
    busy_ns: u64,
}

impl Reading {
    /// The reading of `stats` taken at `at`.
    pub fn of(stats: &[pb::ModelStatistics], at: Instant) -> Reading {
        let mut r = Reading {
            at,
            rows: 0,
            success: Tally::default(),
            fail: Tally::default(),
            queue: Tally::default(),
            busy_ns: 0,
        };
        for m in stats {
            r.rows = r.rows.saturating_add(m.inference_count);
            if let Some(s) = &m.inference_stats {
                let add = |t: &mut Tally, d: Option<&pb::StatisticDuration>| {
                    let d = Tally::of(d);
                    t.count = t.count.saturating_add(d.count);
                    t.ns = t.ns.saturating_add(d.ns);
                };
                add(&mut r.success, s.success.as_ref());
                add(&mut r.fail, s.fail.as_ref());
                add(&mut r.queue, s.queue.as_ref());
            }
            let busy = m.batch_stats.iter().map(|b| Tally::of(b.compute_infer.as_ref()).ns);
            r.busy_ns = busy.fold(r.busy_ns, u64::saturating_add);
        }
        r
    }

    /// Teacher `id` over the window from `before` to this reading; None
    /// when the window is empty (or the teacher restarted: its counts went
    /// down).
    pub fn since(&self, before: &Reading, id: u64) -> Option<TeacherStats> {
        let secs = self.at.checked_duration_since(before.at)?.as_secs_f64();
        if secs <= 0.0 || self.rows < before.rows || self.success.count < before.success.count {
            return None;
        }
        let (success, queue) = (self.success.since(before.success), self.queue.since(before.queue));
        Some(TeacherStats {
            id,
            utilisation: (self.busy_ns.saturating_sub(before.busy_ns) as f64 / 1e9 / secs).clamp(0.0, 1.0),
            // Little's law: the mean number waiting is the time waited per second.
            queue_depth: queue.ns as f64 / 1e9 / secs,
            rows_per_sec: (self.rows - before.rows) as f64 / secs,
            latency_ms: success.mean_ms(),
            queue_ms: queue.mean_ms(),
            errors: self.fail.since(before.fail).count,
            // The students measure these; the pool adds them.
            p50_ms: 0.0,
            p99_ms: 0.0,
        })
    }
}

/// Reads the statistics of the teacher `client` reaches, within `timeout`.
pub async fn read(
    client: &mut GrpcInferenceServiceClient<Channel>,
    token: Option<&str>,
    timeout: Duration,
) -> Result<Reading, String> {
    let mut req =
        tonic::Request::new(pb::ModelStatisticsRequest { name: String::new(), version: String::new() });
    if let Some(t) = token
        && let Ok(v) = format!("Bearer {t}").parse()
    {
        req.metadata_mut().insert("authorization", v);
    }
    req.set_timeout(timeout);
    let answer = tokio::time::timeout(timeout, client.model_statistics(req))
        .await
        .map_err(|_| format!("no statistics within {timeout:?}"))?
        .map_err(|s| format!("statistics: {}", s.message()))?;
    Ok(Reading::of(&answer.get_ref().model_stats, Instant::now()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distill::teacher::{TeacherConfig, TeacherService};
    use crate::trainer::model::Mlp;

    #[test]
    fn request_times_give_nearest_rank_quantiles_and_keep_the_newest() {
        assert_eq!(quantile_ms(&mut [], 0.5), 0.0);
        let mut us: Vec<u32> = (1..=100).rev().map(|i| i * 1000).collect();
        assert_eq!(quantile_ms(&mut us, 0.50), 50.0);
        assert_eq!(quantile_ms(&mut us, 0.99), 99.0);
        assert_eq!(quantile_ms(&mut us, 1.0), 100.0);
        assert_eq!(quantile_ms(&mut [7000], 0.99), 7.0);
        let mut a = TeacherRequests { addr: "t:1".into(), ..Default::default() };
        for i in 0..2 * CALLS_KEPT as u64 {
            a.answered(Duration::from_micros(i));
        }
        assert_eq!(a.latency_us.len(), 2 * CALLS_KEPT, "kept up to twice the bound");
        let b = TeacherRequests {
            addr: "t:1".into(),
            latency_us: vec![u32::MAX, 5],
            refused: Some("answered 3 classes".into()),
        };
        a.merge(b);
        assert_eq!(a.latency_us.len(), CALLS_KEPT, "then cut to the bound");
        assert_eq!(&a.latency_us[CALLS_KEPT - 2..], &[u32::MAX, 5], "the newest kept");
        assert_eq!(a.latency_us[0], CALLS_KEPT as u32 + 2, "the oldest dropped");
        assert_eq!(a.refused.as_deref(), Some("answered 3 classes"));
        let mut long = TeacherRequests::default();
        long.answered(Duration::from_secs(10_000));
        assert_eq!(long.latency_us, vec![u32::MAX], "clamped, not wrapped");
    }

    fn duration(count: u64, ns: u64) -> Option<pb::StatisticDuration> {
        Some(pb::StatisticDuration { count, ns })
    }

    /// A model's statistics: `rows` inferred in `requests` requests taking
    /// `latency` each (`queued` of it in the queue), `batches` executions of
    /// `busy` each, `failed` failures.
    fn stats(
        rows: u64,
        requests: u64,
        latency: u64,
        queued: u64,
        batches: u64,
        busy: u64,
        failed: u64,
    ) -> pb::ModelStatistics {
        pb::ModelStatistics {
            name: "teacher".into(),
            version: "1".into(),
            last_inference: 0,
            inference_count: rows,
            execution_count: batches,
            inference_stats: Some(pb::InferStatistics {
                success: duration(requests, requests * latency),
                fail: duration(failed, 0),
                queue: duration(requests, requests * queued),
                compute_input: duration(0, 0),
                compute_infer: duration(requests, requests * busy),
                compute_output: duration(0, 0),
            }),
            batch_stats: vec![pb::InferBatchStatistics {
                batch_size: 64,
                compute_input: duration(0, 0),
                compute_infer: duration(batches, batches * busy),
                compute_output: duration(0, 0),
            }],
        }
    }

    #[test]
    fn a_window_gives_utilisation_queue_rows_latency_and_errors() {
        let t0 = Instant::now();
        let before = Reading::of(&[stats(1000, 10, 4_000_000, 1_000_000, 5, 2_000_000, 0)], t0);
        // Two seconds later: 6400 more rows in 100 requests of 8 ms (2 ms
        // queued), 50 executions of 20 ms (1 s busy of 2), 3 failures.
        let after = Reading::of(
            &[stats(7400, 110, 8_000_000, 2_000_000, 55, 20_000_000, 3)],
            t0 + Duration::from_secs(2),
        );
        let w = after.since(&before, 4).unwrap();
        assert_eq!(w.id, 4);
        assert!((w.rows_per_sec - 3200.0).abs() < 1e-6, "{w:?}");
        // Busy: 55 x 20 ms - 5 x 2 ms = 1.09 s of 2.
        assert!((w.utilisation - 0.545).abs() < 1e-9, "{w:?}");
        // Queued: 110 x 2 ms - 10 x 1 ms = 0.21 s over 2 s.
        assert!((w.queue_depth - 0.105).abs() < 1e-9, "{w:?}");
        assert!((w.latency_ms - (110.0 * 8.0 - 10.0 * 4.0) / 100.0).abs() < 1e-9, "{w:?}");
        assert!((w.queue_ms - 2.1).abs() < 1e-9, "{w:?}");
        assert_eq!(w.errors, 3);
        // A teacher that restarted (its counts went down) gives no window.
        assert!(before.since(&after, 4).is_none());
        let restarted = Reading::of(&[stats(10, 1, 1, 1, 1, 1, 0)], t0 + Duration::from_secs(3));
        assert!(restarted.since(&after, 4).is_none());
    }

    /// A teacher serving a small model over gRPC on loopback (`emulate_row`
    /// per row of each batch, an emulated accelerator); sends it 20
    /// requests of 16 rows and returns its statistics before and after.
    fn serve_twenty_requests(emulate_row: Duration) -> (Reading, Reading) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let model = Mlp::random(&[4, 8, 3], 1);
            let service = TeacherService::new(model, TeacherConfig { emulate_row, ..Default::default() });
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let server = crate::distill::oip::GrpcInferenceServiceServer::new(service);
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(server)
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
            );
            let ch =
                tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect_lazy();
            let mut client = GrpcInferenceServiceClient::new(ch);
            let timeout = Duration::from_secs(10);
            let before = read(&mut client, None, timeout).await.unwrap();
            for _ in 0..20 {
                let input = pb::ModelInferRequest {
                    model_name: "teacher".into(),
                    inputs: vec![pb::model_infer_request::InferInputTensor {
                        name: "input".into(),
                        datatype: "FP32".into(),
                        shape: vec![16, 4],
                        ..Default::default()
                    }],
                    raw_input_contents: vec![crate::distill::oip::f32_bytes(&[0.5; 4 * 16])],
                    ..Default::default()
                };
                client.model_infer(input).await.unwrap();
            }
            let after = read(&mut client, None, timeout).await.unwrap();
            (before, after)
        })
    }

    #[test]
    fn a_real_teacher_s_statistics_read_over_grpc_show_the_work_it_did() {
        let (before, after) = serve_twenty_requests(Duration::ZERO);
        let w = after.since(&before, 0).unwrap();
        assert_eq!(after.rows - before.rows, 320);
        assert_eq!(after.success.count - before.success.count, 20);
        assert!(w.rows_per_sec > 0.0 && w.utilisation > 0.0 && w.utilisation <= 1.0, "{w:?}");
        assert!(w.latency_ms > 0.0 && w.errors == 0, "{w:?}");
    }

    #[test]
    fn an_emulated_accelerator_is_busy_for_each_row_it_serves() {
        // 1 ms a row: the 320 rows keep the device busy at least 320 ms.
        let (before, after) = serve_twenty_requests(Duration::from_millis(1));
        assert!(after.busy_ns - before.busy_ns >= 320_000_000, "{}", after.busy_ns - before.busy_ns);
        let w = after.since(&before, 0).unwrap();
        assert!(w.latency_ms >= 16.0, "each request of 16 rows takes 16 ms at least: {w:?}");
    }
}
