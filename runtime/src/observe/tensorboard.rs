//! TensorBoard event files (`--tensorboard DIR`): the job's curves as
//! scalar summaries, one event per committed step, in the TFRecord file
//! TensorBoard reads (`events.out.tfevents.*`): each record its length, a
//! masked CRC-32C of the length, the serialised `Event`, and a masked
//! CRC-32C of it.

use crate::coordinator::Progress;
use std::{
    fs::File,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

/// TensorFlow's `Event` (tensorflow/core/util/event.proto), the fields
/// written here.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5, 6")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    #[prost(message, tag = "6")]
    SessionLog(SessionLog),
}

/// TensorFlow's `SessionLog`: a `START` at a step tells TensorBoard that
/// the run went back there (its later points are dropped from the curves).
#[derive(Clone, PartialEq, prost::Message)]
struct SessionLog {
    /// `SessionLog.SessionStatus`: 1 is `START`.
    #[prost(int32, tag = "1")]
    status: i32,
}

/// TensorFlow's `Summary` (tensorflow/core/framework/summary.proto).
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// A `Summary.Value` holding a `simple_value` (a scalar).
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// How often buffered events reach the file at the latest.
const FLUSH_EVERY: Duration = Duration::from_secs(2);

/// An event file being written. A write that fails is said once, and the
/// job goes on without its curves (they are not worth the job).
pub struct TensorBoard {
    out: Option<BufWriter<File>>,
    path: PathBuf,
    flushed: Instant,
}

impl TensorBoard {
    /// A new event file in `dir` (made if need be), its first event the
    /// file's version.
    pub fn create(dir: &Path) -> std::io::Result<TensorBoard> {
        std::fs::create_dir_all(dir)?;
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let host = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok());
        let name = format!(
            "events.out.tfevents.{}.{}.{}.edl",
            now.as_secs(),
            host.unwrap_or_else(|| "localhost".into()),
            std::process::id()
        );
        let path = dir.join(name);
        let file = File::options().create_new(true).write(true).open(&path)?;
        let mut board = TensorBoard { out: Some(BufWriter::new(file)), path, flushed: Instant::now() };
        board.write(Event {
            wall_time: now.as_secs_f64(),
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        });
        board.flush();
        Ok(board)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records one event of the job.
    pub fn record(&mut self, p: &Progress) {
        match p {
            Progress::Step(s) => {
                let mut values = vec![
                    ("train/loss".to_string(), s.loss as f32),
                    ("train/samples_per_sec".to_string(), s.samples_per_sec as f32),
                    ("train/global_batch".to_string(), s.batch as f32),
                    ("train/learning_rate".to_string(), s.lr),
                    ("cluster/workers".to_string(), s.world as f32),
                ];
                let measured = [
                    ("train/gradient_noise_scale", s.noise_scale),
                    ("train/statistical_efficiency", s.efficiency),
                    ("train/goodput", s.goodput),
                ];
                for (tag, v) in measured {
                    values.extend(v.map(|v| (tag.to_string(), v as f32)));
                }
                values.extend(s.metrics.iter().map(|(k, v)| (format!("program/{k}"), *v as f32)));
                self.scalars(s.step, values);
            }
            Progress::Scale(e) => {
                self.scalars(e.step, vec![("cluster/resize_pause_ms".into(), e.pause_ms as f32)])
            }
            Progress::Teachers(e) => self.scalars(e.step, vec![("cluster/teachers".into(), e.to as f32)]),
            Progress::Epoch(_) => self.flush(),
            Progress::Checkpoint { step, secs, .. } => {
                self.scalars(*step, vec![("cluster/checkpoint_write_secs".into(), *secs as f32)])
            }
            Progress::TeacherView(v) => {
                self.scalars(v.step, vec![("teachers/wait_share".into(), v.wait_share as f32)])
            }
            Progress::Redone { step, .. } => {
                // The curves go back to `step`: their later points are dropped.
                let wall_time =
                    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64();
                let start = What::SessionLog(SessionLog { status: 1 });
                self.write(Event { wall_time, step: *step as i64, what: Some(start) });
            }
            Progress::Note(_)
            | Progress::Decision { .. }
            | Progress::Workers(_)
            | Progress::ParameterServers(_)
            | Progress::WorkerReady { .. } => {}
        }
        if self.flushed.elapsed() >= FLUSH_EVERY {
            self.flush();
        }
    }

    fn scalars(&mut self, step: u64, values: Vec<(String, f32)>) {
        let wall_time = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64();
        let value = values.into_iter().map(|(tag, v)| SummaryValue { tag, simple_value: Some(v) }).collect();
        self.write(Event { wall_time, step: step as i64, what: Some(What::Summary(Summary { value })) });
    }

    fn write(&mut self, event: Event) {
        let Some(out) = self.out.as_mut() else { return };
        if let Err(e) = write_record(out, &prost::Message::encode_to_vec(&event)) {
            self.fail(e);
        }
    }

    /// Writes what is buffered to the file.
    pub fn flush(&mut self) {
        self.flushed = Instant::now();
        if let Some(Err(e)) = self.out.as_mut().map(|o| o.flush()) {
            self.fail(e);
        }
    }

    fn fail(&mut self, e: std::io::Error) {
        tracing::warn!(
            "{}: {e}; the job goes on without writing its TensorBoard events",
            self.path.display()
        );
        self.out = None;
    }
}

impl Drop for TensorBoard {
    fn drop(&mut self) {
        self.flush();
    }
}

/// A CRC-32C as TFRecord stores it (rotated and offset, so that a sum of
/// data holding sums is not itself a sum).
fn masked_crc(data: &[u8]) -> u32 {
    crc32c::crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its sum, the data, its sum (little-endian).
fn write_record(out: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    out.write_all(&len)?;
    out.write_all(&masked_crc(&len).to_le_bytes())?;
    out.write_all(data)?;
    out.write_all(&masked_crc(data).to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_carries_its_length_and_the_masked_sums_tensorflow_computes() {
        // CRC-32C (Castagnoli, not the zlib CRC-32: 0xcbf43926) of the
        // check string, and TensorFlow's mask of a sum of 0.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc(b""), 0xa282_ead8);
        let mut out = Vec::new();
        write_record(&mut out, b"hello").unwrap();
        assert_eq!(out.len(), 8 + 4 + 5 + 4);
        assert_eq!(u64::from_le_bytes(out[..8].try_into().unwrap()), 5);
        assert_eq!(&out[12..17], b"hello");
        assert_eq!(u32::from_le_bytes(out[17..].try_into().unwrap()), masked_crc(b"hello"));
    }

    #[test]
    fn a_step_is_one_event_of_scalars_that_decodes_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut board = TensorBoard::create(dir.path()).unwrap();
        let rec = crate::coordinator::StepRecord {
            step: 7,
            epoch: 0,
            world: 3,
            secs: 1.0,
            loss: 0.25,
            samples_per_sec: 900.0,
            cursor: 64,
            batch: 64,
            lr: 0.05,
            noise_scale: None,
            grad_var: None,
            grad_sqr: None,
            efficiency: None,
            goodput: None,
            metrics: [("accuracy".to_string(), 0.5)].into(),
            ps_servers: None,
        };
        board.record(&Progress::Step(&rec));
        board.flush();
        let events = events_of(board.path());
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].what, Some(What::FileVersion("brain.Event:2".into())));
        assert_eq!(events[1].step, 7);
        let Some(What::Summary(s)) = &events[1].what else { panic!("{:?}", events[1]) };
        let tags: Vec<(&str, f32)> =
            s.value.iter().map(|v| (v.tag.as_str(), v.simple_value.unwrap())).collect();
        assert!(tags.contains(&("train/loss", 0.25)), "{tags:?}");
        assert!(tags.contains(&("cluster/workers", 3.0)), "{tags:?}");
        assert!(tags.contains(&("program/accuracy", 0.5)), "{tags:?}");
    }

    /// The events of an event file, each record's sums checked.
    fn events_of(path: &Path) -> Vec<Event> {
        let bytes = std::fs::read(path).unwrap();
        let (mut events, mut at) = (Vec::new(), 0);
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            assert_eq!(
                u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()),
                masked_crc(&bytes[at..at + 8])
            );
            let data = &bytes[at + 12..at + 12 + len];
            assert_eq!(
                u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap()),
                masked_crc(data)
            );
            events.push(<Event as prost::Message>::decode(data).unwrap());
            at += 16 + len;
        }
        events
    }

    #[test]
    fn steps_done_again_start_the_curves_over_from_where_the_job_went_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut board = TensorBoard::create(dir.path()).unwrap();
        board.record(&Progress::Redone { step: 40, redone: 3, failed: true });
        board.flush();
        let events = events_of(board.path());
        assert_eq!(events.len(), 2);
        assert_eq!(events[1].step, 40);
        assert_eq!(events[1].what, Some(What::SessionLog(SessionLog { status: 1 })));
    }
}
