//! `edl-runtime distill`: synthetic batches through the DistillReader, from
//! fixed teachers or discovered ones; reports throughput.

use super::flags::{TeacherAccessArgs, TeacherCallArgs, TeacherIoArgs, TeachersArg};
use anyhow::{Result, bail};
use clap::Args;
use edl_runtime::distill::{DistillConfig, DistillReader, Teachers};
use std::{process::ExitCode, sync::Arc, time::Duration};

#[derive(Args)]
pub struct DistillArgs {
    /// Teacher endpoints, comma separated: `host:port`, `host:port/model[/version]`,
    /// `grpcs://` for gRPC over TLS, `http(s)://` for KServe v2 over REST, `@probs`
    /// or `@logits` after one that says what it returns.
    #[arg(long, value_name = "ENDPOINTS", value_parser = super::flags::parse_teachers, help_heading = "Distillation")]
    teachers: Option<TeachersArg>,
    /// Store to discover teachers in (with --service), e.g. redis://127.0.0.1:6379.
    #[arg(long, value_name = "URL", help_heading = "Distillation")]
    store: Option<String>,
    /// Service name the teachers registered under (with --store).
    #[arg(long, value_name = "NAME", default_value = "teachers", help_heading = "Distillation")]
    service: String,
    /// The key the teachers sealed their registrations with (with --store;
    /// see `edl-runtime teacher --registration-key-file`): registrations
    /// that do not verify are ignored.
    #[arg(long, value_name = "FILE", requires = "store", help_heading = "Distillation")]
    registration_key_file: Option<std::path::PathBuf>,
    /// Model name asked of every teacher.
    #[arg(long, value_name = "NAME", default_value = "teacher", help_heading = "Distillation")]
    model_name: String,
    /// Seconds to wait for a teacher to answer before failing.
    #[arg(
        long,
        value_name = "SECS",
        alias = "wait-secs",
        default_value_t = 30,
        help_heading = "Distillation"
    )]
    teacher_wait_secs: u64,
    #[command(flatten)]
    teacher_calls: TeacherCallArgs,
    #[command(flatten)]
    teacher_io: TeacherIoArgs,
    #[command(flatten)]
    teacher_access: TeacherAccessArgs,
    /// Features per sample the teachers take.
    #[arg(long, value_name = "N", default_value_t = 784, help_heading = "Synthetic batches")]
    features: usize,
    /// Synthetic batches to read through the teachers.
    #[arg(long, value_name = "N", default_value_t = 20, help_heading = "Synthetic batches")]
    batches: usize,
    /// Samples per batch.
    #[arg(
        long,
        value_name = "N",
        alias = "batch-size",
        default_value_t = 256,
        help_heading = "Synthetic batches"
    )]
    batch: usize,
}

/// The teachers' registration key, from `--registration-key-file`.
fn registration_key(file: Option<&std::path::Path>) -> Result<edl_runtime::leader::seal::RecordKey> {
    let Some(f) = file else {
        edl_runtime::refuse!("--store needs --registration-key-file: the key the teachers registered with")
    };
    let text = std::fs::read_to_string(f)
        .map_err(|e| anyhow::anyhow!("--registration-key-file {}: {e}", f.display()))?;
    edl_runtime::leader::seal::RecordKey::from_hex(&text)
        .ok_or_else(|| anyhow::anyhow!("--registration-key-file {}: not a registration key", f.display()))
}

/// Reads the batches in order and prints each one's soft labels.
pub fn run(args: DistillArgs) -> Result<ExitCode> {
    let teachers = match (&args.teachers, &args.store) {
        (Some(t), None) => Some(t.endpoints("distill")?),
        (None, Some(_)) => None,
        _ => bail!("give either --teachers host:port,... or --store URL (with --service)"),
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let teachers = match (teachers, &args.store) {
            (Some(list), _) => Teachers::Fixed(list),
            (None, Some(url)) => Teachers::Discovered {
                store: Arc::new(edl_runtime::store::AnyStore::open(url)?),
                service: args.service.clone(),
                key: registration_key(args.registration_key_file.as_deref())?,
            },
            (None, None) => unreachable!("checked above"),
        };
        let access = args.teacher_access.read()?;
        if let Teachers::Fixed(list) = &teachers {
            for addr in list {
                if let Some(why) = access.refusal(addr) {
                    bail!(why);
                }
            }
        }
        let cfg = args.teacher_calls.calls().apply(DistillConfig {
            model_name: args.model_name.clone(),
            wait_for_teachers: Duration::from_secs(args.teacher_wait_secs),
            access,
            io: args.teacher_io.io(),
            ..Default::default()
        });
        let rows = args.batch;
        let mut reader =
            DistillReader::start(batches(args.batches, rows, args.features), None, teachers, cfg);
        let start = std::time::Instant::now();
        let (mut samples, mut next_id, mut classes) = (0usize, 0u64, 0usize);
        while let Some(b) = reader.next().await {
            let b = b?;
            for &id in &b.batch.ids {
                if id != next_id {
                    bail!("sample {next_id} expected, {id} received");
                }
                next_id += 1;
            }
            samples += b.batch.len();
            classes = b.classes;
            println!(
                "batch {:>4}: {} samples, {} soft labels each",
                b.batch.ids[0] / rows as u64,
                b.batch.len(),
                b.classes
            );
        }
        println!(
            "done: {samples} samples in order with {classes}-class soft labels, {:.0} samples/s",
            samples as f64 / start.elapsed().as_secs_f64()
        );
        Ok(ExitCode::SUCCESS)
    })
}

/// `n` batches of `rows` samples of `dim` deterministic features.
fn batches(
    n: usize,
    rows: usize,
    dim: usize,
) -> impl Iterator<Item = edl_plugin_sdk::Batch> + Send + 'static {
    (0..n).map(move |b| {
        let ids: Vec<u64> = (0..rows as u64).map(|i| (b * rows) as u64 + i).collect();
        let feats: Vec<f32> = ids
            .iter()
            .flat_map(|&id| (0..dim).map(move |k| ((id as usize * 31 + k) % 255) as f32 / 255.0))
            .collect();
        edl_plugin_sdk::Batch {
            data: edl_runtime::distill::oip::f32_bytes(&feats),
            shape: vec![rows as u32, dim as u32],
            dtype: edl_plugin_sdk::Dtype::Float32,
            labels: vec![0; rows],
            ids,
            seed: 0,
        }
    })
}
