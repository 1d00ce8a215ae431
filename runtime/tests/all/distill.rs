//! Teachers and the DistillReader: the OIP service answers a standard client
//! and rejects bad requests clearly; the reader delivers every sample exactly
//! once, in order, with the soft labels a healthy teacher gives, while
//! teachers die, join, stall or answer nonsense, and while Redis restarts.

use crate::support::{
    job::{finish, job, lines, report},
    python::venv_with,
    runtime,
    servers::RedisServer,
};
use edl_plugin_sdk::{Batch, Dtype};
use edl_runtime::{
    distill::{
        DistillConfig, DistillError, DistillReader, Teachers,
        oip::{self, GrpcInferenceService, GrpcInferenceServiceClient, pb},
        teacher::{Registration, Teacher, TeacherConfig, TeacherService},
    },
    leader::seal::RecordKey,
    store::AnyStore,
    trainer::model::Mlp,
};
use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::Duration,
};
use tonic::{Code, Request, Response, Status};

const DIM: usize = 16;
const CLASSES: usize = 10;

fn model() -> Mlp {
    Mlp::random(&[DIM, 32, CLASSES], 7)
}

/// `n` batches of `rows` samples; sample ids count up from 0.
fn batches(n: usize, rows: usize) -> Vec<Batch> {
    (0..n)
        .map(|b| {
            let ids: Vec<u64> = (0..rows as u64).map(|i| (b * rows) as u64 + i).collect();
            let feats: Vec<f32> = ids
                .iter()
                .flat_map(|&id| (0..DIM).map(move |k| ((id * 31 + k as u64) % 97) as f32 / 97.0))
                .collect();
            Batch {
                data: oip::f32_bytes(&feats),
                shape: vec![rows as u32, DIM as u32],
                dtype: Dtype::Float32,
                labels: ids.iter().map(|&i| (i % 10) as u32).collect(),
                ids,
                seed: 0,
            }
        })
        .collect()
}

/// Reads everything, checking order, completeness and soft labels; `between`
/// runs after each batch with its index.
/// Reads every batch of `expected` from `reader`, checking each; returns
/// the reader, drained.
async fn drain_and_check(
    mut reader: DistillReader,
    expected: &[Batch],
    mut between: impl FnMut(usize),
) -> DistillReader {
    let m = model();
    let mut next_id = 0u64;
    for (i, want) in expected.iter().enumerate() {
        let got = reader.next().await.expect("a batch").expect("no error");
        assert_eq!(got.batch.ids, want.ids, "batch {i} out of order or changed");
        for id in &got.batch.ids {
            assert_eq!(*id, next_id, "sample lost or repeated");
            next_id += 1;
        }
        assert_eq!(got.classes, CLASSES);
        let feats = want.to_f32().unwrap();
        let healthy = m.forward(&feats, want.len());
        assert_eq!(got.soft.len(), healthy.len());
        for (a, b) in got.soft.iter().zip(&healthy) {
            assert!((a - b).abs() < 1e-5, "batch {i}: soft labels differ from a healthy teacher's");
        }
        between(i);
    }
    assert!(reader.next().await.is_none(), "nothing after the last batch");
    reader
}

#[test]
fn the_teacher_speaks_oip_and_rejects_bad_requests() {
    runtime().block_on(async {
        let t = Teacher::start(
            "127.0.0.1:0".parse().unwrap(),
            TeacherService::new(model(), TeacherConfig { max_request_rows: 100, ..Default::default() }),
            None,
        )
        .await
        .unwrap();
        let mut c = GrpcInferenceServiceClient::connect(format!("http://{}", t.addr)).await.unwrap();
        assert!(c.server_live(pb::ServerLiveRequest {}).await.unwrap().get_ref().live);
        assert!(c.server_ready(pb::ServerReadyRequest {}).await.unwrap().get_ref().ready);
        let ready = |name: &str| pb::ModelReadyRequest { name: name.into(), version: String::new() };
        assert!(c.model_ready(ready("teacher")).await.unwrap().get_ref().ready);
        assert!(!c.model_ready(ready("other")).await.unwrap().get_ref().ready);
        let meta = c
            .model_metadata(pb::ModelMetadataRequest { name: "teacher".into(), version: String::new() })
            .await
            .unwrap();
        assert_eq!(meta.get_ref().inputs[0].shape, vec![-1, DIM as i64]);
        assert_eq!(meta.get_ref().outputs[0].shape, vec![-1, CLASSES as i64]);

        let x: Vec<f32> = (0..2 * DIM).map(|i| i as f32 / 10.0).collect();
        let input = |shape: Vec<i64>, datatype: &str, typed: Option<Vec<f32>>| {
            pb::model_infer_request::InferInputTensor {
                name: "input".into(),
                datatype: datatype.into(),
                shape,
                contents: typed.map(|v| pb::InferTensorContents { fp32_contents: v, ..Default::default() }),
                ..Default::default()
            }
        };
        let want = model().forward(&x, 2);
        // raw bytes, as tritonclient sends them
        let raw = pb::ModelInferRequest {
            model_name: "teacher".into(),
            inputs: vec![input(vec![2, DIM as i64], "FP32", None)],
            raw_input_contents: vec![oip::f32_bytes(&x)],
            ..Default::default()
        };
        let (got, rows, cols) = oip::output_f32(c.model_infer(raw.clone()).await.unwrap().get_ref()).unwrap();
        assert_eq!((rows, cols), (2, CLASSES));
        assert_eq!(got, want);
        // typed contents
        let typed = pb::ModelInferRequest {
            model_name: "teacher".into(),
            inputs: vec![input(vec![2, DIM as i64], "FP32", Some(x.clone()))],
            ..Default::default()
        };
        assert_eq!(oip::output_f32(c.model_infer(typed).await.unwrap().get_ref()).unwrap().0, want);

        let code = |r: Result<Response<pb::ModelInferResponse>, Status>| r.unwrap_err();
        let e = code(c.model_infer(pb::ModelInferRequest { model_name: "nope".into(), ..raw.clone() }).await);
        assert_eq!(e.code(), Code::NotFound, "{e}");
        let e = code(
            c.model_infer(pb::ModelInferRequest {
                inputs: vec![input(vec![2, 7], "FP32", None)],
                ..raw.clone()
            })
            .await,
        );
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        let e = code(
            c.model_infer(pb::ModelInferRequest {
                inputs: vec![input(vec![2, DIM as i64], "INT8", None)],
                ..raw.clone()
            })
            .await,
        );
        assert!(e.code() == Code::InvalidArgument && e.message().contains("FP32"), "{e}");
        let e = code(
            c.model_infer(pb::ModelInferRequest { raw_input_contents: vec![vec![0u8; 5]], ..raw.clone() })
                .await,
        );
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        let big = vec![0f32; 101 * DIM];
        let e = code(
            c.model_infer(pb::ModelInferRequest {
                inputs: vec![input(vec![101, DIM as i64], "FP32", None)],
                raw_input_contents: vec![oip::f32_bytes(&big)],
                ..raw.clone()
            })
            .await,
        );
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        // Names and versions are checked as Triton checks them, naming what is served.
        let e =
            code(c.model_infer(pb::ModelInferRequest { model_version: "99".into(), ..raw.clone() }).await);
        assert!(
            e.code() == Code::NotFound && e.message().contains("no version \"99\"; versions served: [\"1\"]"),
            "{e}"
        );
        assert!(
            c.model_infer(pb::ModelInferRequest { model_version: "1".into(), ..raw.clone() }).await.is_ok()
        );
        let ready = pb::ModelReadyRequest { name: "teacher".into(), version: "99".into() };
        assert!(!c.model_ready(ready).await.unwrap().get_ref().ready);
        let meta = pb::ModelMetadataRequest { name: "teacher".into(), version: "2".into() };
        assert_eq!(c.model_metadata(meta).await.unwrap_err().code(), Code::NotFound);
        let mut renamed = raw.clone();
        renamed.inputs[0].name = "INPUT0".into();
        let e = code(c.model_infer(renamed).await);
        assert!(
            e.code() == Code::InvalidArgument
                && e.message().contains("unexpected inference input \"INPUT0\""),
            "{e}"
        );
        assert!(e.message().contains("its input is \"input\""), "{e}");
        let asked = |name: &str| pb::model_infer_request::InferRequestedOutputTensor {
            name: name.into(),
            ..Default::default()
        };
        let e =
            code(c.model_infer(pb::ModelInferRequest { outputs: vec![asked("probs")], ..raw.clone() }).await);
        assert!(
            e.code() == Code::InvalidArgument
                && e.message().contains("unexpected inference output \"probs\""),
            "{e}"
        );
        assert!(
            c.model_infer(pb::ModelInferRequest { outputs: vec![asked("logits")], ..raw.clone() })
                .await
                .is_ok()
        );
        // The server is still fine.
        assert!(c.model_infer(raw).await.is_ok());

        // Triton's model configuration and statistics, which its tools read.
        let config = c
            .model_config(pb::ModelConfigRequest { name: "teacher".into(), version: String::new() })
            .await
            .unwrap()
            .into_inner()
            .config
            .unwrap();
        assert_eq!((config.name.as_str(), config.max_batch_size), ("teacher", 100));
        assert_eq!((config.input[0].name.as_str(), &config.input[0].dims[..]), ("input", &[DIM as i64][..]));
        assert_eq!(config.input[0].data_type, pb::DataType::TypeFp32 as i32);
        assert_eq!(
            (config.output[0].name.as_str(), &config.output[0].dims[..]),
            ("logits", &[CLASSES as i64][..])
        );
        let stats = c
            .model_statistics(pb::ModelStatisticsRequest { name: "teacher".into(), version: String::new() })
            .await
            .unwrap()
            .into_inner();
        let m = &stats.model_stats[0];
        let s = m.inference_stats.unwrap();
        // Answered: raw, typed, version 1, logits asked for, and the last one: 5 of 2 rows.
        assert_eq!(s.success.unwrap().count, 5, "{m:?}");
        // Failed after reaching the model: a wrong shape, datatype, byte count, the
        // row limit, an input and an output of other names.
        assert_eq!(s.fail.unwrap().count, 6, "{m:?}");
        assert_eq!(m.inference_count, 10, "{m:?}");
        assert!(m.execution_count >= 1 && m.execution_count <= 5, "{m:?}");
        assert_eq!(s.compute_infer.unwrap().count, 5, "{m:?}");
        assert!(m.batch_stats.iter().all(|b| b.batch_size % 2 == 0) && m.last_inference > 0, "{m:?}");
        let e = c
            .model_statistics(pb::ModelStatisticsRequest { name: "teacher".into(), version: "7".into() })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound);
        t.shutdown().await;
    });
}

/// A teacher that misbehaves on purpose.
#[derive(Clone)]
struct Faulty {
    inner: TeacherService,
    fault: Fault,
}

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// Never answers.
    Stall,
    /// Answers one class too many.
    WrongShape,
    /// Answers the right shape with NaN in it.
    NaN,
}

#[tonic::async_trait]
impl GrpcInferenceService for Faulty {
    async fn server_live(
        &self,
        r: Request<pb::ServerLiveRequest>,
    ) -> Result<Response<pb::ServerLiveResponse>, Status> {
        self.inner.server_live(r).await
    }
    async fn server_ready(
        &self,
        r: Request<pb::ServerReadyRequest>,
    ) -> Result<Response<pb::ServerReadyResponse>, Status> {
        self.inner.server_ready(r).await
    }
    async fn model_ready(
        &self,
        r: Request<pb::ModelReadyRequest>,
    ) -> Result<Response<pb::ModelReadyResponse>, Status> {
        self.inner.model_ready(r).await
    }
    async fn server_metadata(
        &self,
        r: Request<pb::ServerMetadataRequest>,
    ) -> Result<Response<pb::ServerMetadataResponse>, Status> {
        self.inner.server_metadata(r).await
    }
    async fn model_metadata(
        &self,
        r: Request<pb::ModelMetadataRequest>,
    ) -> Result<Response<pb::ModelMetadataResponse>, Status> {
        self.inner.model_metadata(r).await
    }
    async fn model_config(
        &self,
        r: Request<pb::ModelConfigRequest>,
    ) -> Result<Response<pb::ModelConfigResponse>, Status> {
        self.inner.model_config(r).await
    }
    async fn model_statistics(
        &self,
        r: Request<pb::ModelStatisticsRequest>,
    ) -> Result<Response<pb::ModelStatisticsResponse>, Status> {
        self.inner.model_statistics(r).await
    }
    async fn model_infer(
        &self,
        r: Request<pb::ModelInferRequest>,
    ) -> Result<Response<pb::ModelInferResponse>, Status> {
        if self.fault == Fault::Stall {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        let mut resp = self.inner.model_infer(r).await?;
        if self.fault == Fault::NaN {
            let (mut v, _, _) =
                oip::output_f32(resp.get_ref()).map_err(|e| Status::internal(e.to_string()))?;
            v[3] = f32::NAN;
            resp.get_mut().raw_output_contents = vec![oip::f32_bytes(&v)];
            return Ok(resp);
        }
        // One class too many.
        let out = &mut resp.get_mut().outputs[0];
        out.shape[1] += 1;
        let rows = out.shape[0] as usize;
        resp.get_mut().raw_output_contents = vec![oip::f32_bytes(&vec![0.5; rows * (CLASSES + 1)])];
        Ok(resp)
    }
}

#[test]
fn stalled_wrong_shape_and_nan_teachers_are_worked_around() {
    runtime().block_on(async {
        let any = "127.0.0.1:0".parse().unwrap();
        let good =
            Teacher::start(any, TeacherService::new(model(), TeacherConfig::default()), None).await.unwrap();
        let faulty = |fault| Faulty { inner: TeacherService::new(model(), TeacherConfig::default()), fault };
        let stalled = Teacher::start_with(any, faulty(Fault::Stall), None).await.unwrap();
        let wrong = Teacher::start_with(any, faulty(Fault::WrongShape), None).await.unwrap();
        let nan = Teacher::start_with(any, faulty(Fault::NaN), None).await.unwrap();
        let data = batches(20, 48);
        let cfg = DistillConfig {
            teacher_batch: 16,
            request_timeout: Duration::from_millis(300),
            cooldown: Duration::from_millis(200),
            classes: Some(CLASSES),
            ..Default::default()
        };
        // The good teacher is listed last: the bad ones get the first requests.
        let teachers =
            Teachers::Fixed([&stalled, &wrong, &nan, &good].iter().map(|t| t.addr.to_string()).collect());
        let reader = DistillReader::start(data.clone().into_iter(), None, teachers, cfg);
        let reader = drain_and_check(reader, &data, |_| {}).await;
        // What the teacher pool is told: each answered request's time, at
        // the teacher that answered it, and the teacher refused for good.
        let calls: std::collections::BTreeMap<String, _> =
            reader.take_calls().into_iter().map(|c| (c.addr.clone(), c)).collect();
        let of = |t: &Teacher| calls.get(&t.addr.to_string());
        let answered: usize = calls.values().map(|c| c.latency_us.len()).sum();
        assert_eq!(answered, 20 * 48 / 16, "one time for each piece, at the teacher that answered it");
        assert_eq!(of(&good).unwrap().latency_us.len(), answered, "only the good teacher answered");
        assert!(of(&good).unwrap().refused.is_none());
        let why =
            of(&wrong).and_then(|c| c.refused.clone()).expect("the wrong-shape teacher is told refused");
        assert!(why.contains(&format!("answered {} classes", CLASSES + 1)), "{why}");
        assert!(of(&nan).is_none_or(|c| c.refused.is_none()), "a NaN is worth a retry, not a refusal");
        assert!(of(&stalled).is_none_or(|c| c.latency_us.is_empty() && c.refused.is_none()));
        assert!(reader.take_calls().is_empty(), "taken once");
    });
}

#[test]
fn with_no_teacher_the_reader_waits_then_fails_clearly() {
    runtime().block_on(async {
        let cfg = DistillConfig { wait_for_teachers: Duration::from_millis(500), ..Default::default() };
        let store = Arc::new(AnyStore::open("memory").unwrap());
        let teachers = Teachers::Discovered { store, service: "empty".into(), key: registration_key() };
        let mut reader = DistillReader::start(batches(2, 8).into_iter(), None, teachers, cfg);
        let start = std::time::Instant::now();
        let err = reader.next().await.unwrap().unwrap_err();
        assert!(matches!(err, DistillError::NoTeachers { .. }), "{err}");
        assert!(err.to_string().contains("no teacher"));
        assert!(start.elapsed() < Duration::from_secs(5));
    });
}

/// A store writer without the job's registration key registers a teacher
/// of its own (soft labels of another model): students ignore it, with a
/// warning naming its key, and every batch gets the real teacher's labels.
#[test]
fn registrations_that_do_not_verify_are_ignored_and_cannot_poison_the_soft_labels() {
    runtime().block_on(async {
        use edl_runtime::store::Store;
        let store = Arc::new(AnyStore::open("memory").unwrap());
        let any = "127.0.0.1:0".parse().unwrap();
        let service = |m: Mlp| TeacherService::new(m, TeacherConfig::default());
        let registration = || Registration {
            store: store.clone(),
            service: "svc".into(),
            ttl: Duration::from_secs(30),
            key: registration_key(),
        };
        let good = Teacher::start(any, service(model()), Some(registration())).await.unwrap();
        let poison = Teacher::start(any, service(Mlp::random(&[DIM, 32, CLASSES], 99)), None).await.unwrap();
        // Planted in clear, and sealed with another key.
        let addr = poison.addr.to_string();
        let key = edl_runtime::store::keys::teacher("svc", &addr);
        store.put(&key, addr.as_bytes(), None).await.unwrap();
        let other = RecordKey::from_hex(&"01".repeat(32)).unwrap();
        let key2 = edl_runtime::store::keys::teacher("svc", "10.9.9.9:1");
        store.put(&key2, &other.seal(&key2, addr.as_bytes()), None).await.unwrap();
        let teachers =
            Teachers::Discovered { store: store.clone(), service: "svc".into(), key: registration_key() };
        let cfg = DistillConfig { teacher_batch: 8, classes: Some(CLASSES), ..Default::default() };
        let data = batches(12, 16);
        drain_and_check(DistillReader::start(data.clone().into_iter(), None, teachers, cfg), &data, |_| {})
            .await;
        drop(good);
    });
}

#[test]
fn when_every_listed_teacher_fails_the_reader_gives_up_after_one_wait_naming_them() {
    runtime().block_on(async {
        let any = "127.0.0.1:0".parse().unwrap();
        let nan = Teacher::start_with(
            any,
            Faulty { inner: TeacherService::new(model(), TeacherConfig::default()), fault: Fault::NaN },
            None,
        )
        .await
        .unwrap();
        // Nothing listens on the other: a teacher that died.
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let cfg = DistillConfig {
            wait_for_teachers: Duration::from_secs(2),
            cooldown: Duration::from_millis(50),
            classes: Some(CLASSES),
            ..Default::default()
        };
        let teachers = Teachers::Fixed(vec![nan.addr.to_string(), dead.to_string()]);
        let mut reader = DistillReader::start(batches(2, 8).into_iter(), None, teachers, cfg);
        // Without the bound this would retry between the two for ever.
        let err = reader.next().await.unwrap().unwrap_err();
        let DistillError::NoTeachers { last, .. } = &err else { panic!("{err}") };
        let text = err.to_string();
        assert!(
            text.contains(&format!("{} (model \"teacher\"): answered a non-finite value", nan.addr)),
            "{text}"
        );
        assert!(text.contains(&dead.to_string()), "{text}");
        assert_eq!(last.len(), 2, "{text}");
        assert!(reader.next().await.is_none());
    });
}

/// A teacher process (`edl-runtime teacher`) registered in Redis.
/// The key the tests' teachers register with (a job derives its own from its secret).
const REGISTRATION_KEY: &str = "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a";

fn registration_key() -> RecordKey {
    RecordKey::from_hex(REGISTRATION_KEY).unwrap()
}

fn teacher_process(model: &std::path::Path, redis: &str) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(["teacher", "--listen", "127.0.0.1:0", "--store", redis, "--service", "mnist"])
        .env("EDL_TEACHER_REGISTRATION_KEY", REGISTRATION_KEY)
        .arg("--model")
        .arg(model)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = serving_at(&mut child);
    (child, addr)
}

/// Where a teacher process says it serves (the first line it prints).
fn serving_at(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    line.split("serving on ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap_or_else(|| panic!("{line}"))
        .to_string()
}

#[test]
fn teachers_killed_added_and_a_redis_restart_lose_nothing() {
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let model_file = dir.path().join("teacher.safetensors");
    model().save(&model_file).unwrap();
    let (mut a, _) = teacher_process(&model_file, &redis.url());
    let (mut b, _) = teacher_process(&model_file, &redis.url());
    let mut c: Option<Child> = None;
    runtime().block_on(async {
        let store = Arc::new(AnyStore::open(&redis.url()).unwrap());
        let data = batches(40, 64);
        let cfg = DistillConfig {
            teacher_batch: 16,
            read_ahead: 4,
            request_timeout: Duration::from_secs(2),
            cooldown: Duration::from_millis(300),
            ..Default::default()
        };
        let teachers = Teachers::Discovered { store, service: "mnist".into(), key: registration_key() };
        // A slow source keeps the epoch going while teachers come and go.
        let slow = data.clone().into_iter().inspect(|_| std::thread::sleep(Duration::from_millis(40)));
        let reader = DistillReader::start(slow, None, teachers, cfg);
        drain_and_check(reader, &data, |i| match i {
            8 => {
                a.kill().unwrap(); // SIGKILL mid-epoch
                let _ = a.wait();
            }
            14 => c = Some(teacher_process(&model_file, &redis.url()).0),
            22 => redis.restart(),
            30 => {
                b.kill().unwrap();
                let _ = b.wait();
            }
            _ => {}
        })
        .await;
    });
    if let Some(mut c) = c {
        let _ = c.kill();
        let _ = c.wait();
    }
}

#[test]
fn teachers_see_the_transformed_samples() {
    use edl_runtime::plugin::{ArtifactCache, HostOptions, Limits, PluginHost};
    let cache = tempfile::tempdir().unwrap();
    // What is checked is which samples the teachers see, not the plugin's
    // speed: a deadline a loaded machine cannot miss.
    let limits = Limits { deadline: Duration::from_secs(30), ..Limits::default() };
    let host =
        PluginHost::new(HostOptions { cache: ArtifactCache::at(cache.path()), limits, ..Default::default() })
            .unwrap();
    let augment =
        || host.load_transform(std::path::Path::new(edl_plugin_artifacts::AUGMENT_WASM), &[]).unwrap();
    runtime().block_on(async {
        let mnist = Mlp::random(&[784, 32, CLASSES], 3);
        let t = Teacher::start(
            "127.0.0.1:0".parse().unwrap(),
            TeacherService::new(mnist.clone(), TeacherConfig::default()),
            None,
        )
        .await
        .unwrap();
        let raw: Vec<Batch> = (0..4)
            .map(|b| {
                let mut x = edl_plugin_sdk::testing::standard_batch();
                x.ids.iter_mut().for_each(|id| *id += b * 256);
                x
            })
            .collect();
        let cfg = DistillConfig { teacher_batch: 100, ..Default::default() };
        let mut reader = DistillReader::start(
            raw.clone().into_iter(),
            Some(augment()),
            Teachers::Fixed(vec![t.addr.to_string()]),
            cfg,
        );
        let mut direct = augment();
        for want in &raw {
            let got = reader.next().await.unwrap().unwrap();
            // What the student gets is the augmented batch, and the teacher saw the same.
            let augmented = direct.apply(want).unwrap();
            assert_eq!(got.batch, augmented);
            let feats = augmented.to_f32().unwrap();
            let soft = mnist.forward(&feats, augmented.len());
            assert!(got.soft.iter().zip(&soft).all(|(a, b)| (a - b).abs() < 1e-4));
        }
        assert!(reader.next().await.is_none());
    });
}

#[test]
fn a_teacher_deregisters_on_sigterm() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let model_file = dir.path().join("teacher.safetensors");
    model().save(&model_file).unwrap();
    let (mut child, addr) = teacher_process(&model_file, &redis.url());
    runtime().block_on(async {
        let store = AnyStore::open(&redis.url()).unwrap();
        let key = edl_runtime::store::keys::teacher("mnist", &addr);
        use edl_runtime::store::Store;
        let registered = store.get(&key).await.unwrap().unwrap().value;
        assert_eq!(registration_key().open(&key, &registered).unwrap(), addr.as_bytes());
        let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
        assert!(status.success());
        let exit = child.wait().unwrap();
        assert!(exit.success(), "a teacher stops cleanly on SIGTERM: {exit}");
        // Deregistered at once, not left to expire (the lease is 3 s).
        assert!(store.get(&key).await.unwrap().is_none());
    });
}

#[test]
fn the_distill_command_reads_from_fixed_teachers_and_from_discovery() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let model_file = dir.path().join("teacher.safetensors");
    model().save(&model_file).unwrap();
    let (mut child, addr) = teacher_process(&model_file, &redis.url());
    let dim = DIM.to_string();
    let key_file = dir.path().join("teacher-registration.key");
    std::fs::write(&key_file, REGISTRATION_KEY).unwrap();
    let key_file = key_file.to_str().unwrap();
    let url = redis.url();
    for how in [
        vec!["--teachers", addr.as_str()],
        vec!["--store", url.as_str(), "--service", "mnist", "--registration-key-file", key_file],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
            .arg("distill")
            .args(&how)
            .args(["--features", &dim, "--batches", "5", "--batch-size", "32", "--wait-secs", "5"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("done: 160 samples in order with 10-class soft labels"), "{text}");
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A CA and a certificate it signed for `127.0.0.1` and `localhost`: (CA
/// PEM, server certificate PEM, server key PEM).
pub(crate) fn certificates() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    (ca.pem(), server.pem(), key.serialize_pem())
}

#[test]
fn a_teacher_with_tls_and_a_token_answers_only_students_that_trust_it_and_carry_the_token() {
    use edl_runtime::{
        distill::TeacherAccess,
        distill::teacher::{Access, Serving},
    };
    runtime().block_on(async {
        let (ca, cert, key) = certificates();
        let store = Arc::new(AnyStore::open("memory").unwrap());
        let serving = Serving {
            access: Access { token: Some("s3cret-token".into()), tls: Some((cert.into(), key.into())) },
            ..Serving::on("127.0.0.1:0".parse().unwrap())
        };
        let service = TeacherService::new(model(), TeacherConfig::default());
        let registration = Registration {
            store: store.clone(),
            service: "tls".into(),
            ttl: Duration::from_secs(30),
            key: registration_key(),
        };
        let t = Teacher::serve(serving, service, Some(registration)).await.unwrap();
        // It registers as an https endpoint, and the key names host:port.
        assert_eq!(t.advertised, format!("grpcs://{}", t.addr));
        let key = edl_runtime::store::keys::teacher("tls", &t.addr.to_string());
        use edl_runtime::store::Store;
        let registered = store.get(&key).await.unwrap().unwrap().value;
        assert_eq!(registration_key().open(&key, &registered).unwrap(), t.advertised.as_bytes());

        let try_with = |access: TeacherAccess, addr: String| {
            let cfg = DistillConfig {
                wait_for_teachers: Duration::from_secs(1),
                cooldown: Duration::from_millis(50),
                classes: Some(CLASSES),
                access,
                ..Default::default()
            };
            DistillReader::start(batches(3, 8).into_iter(), None, Teachers::Fixed(vec![addr]), cfg)
        };
        let token = Some("s3cret-token".to_string());
        // Trusting the CA, with the token: every batch, with the right labels;
        // discovered through the store as an https endpoint.
        let trusted = TeacherAccess { token: token.clone(), ca_pem: Some(ca.clone()), ..Default::default() };
        let discovered =
            Teachers::Discovered { store: store.clone(), service: "tls".into(), key: registration_key() };
        let cfg = DistillConfig { classes: Some(CLASSES), access: trusted.clone(), ..Default::default() };
        drain_and_check(
            DistillReader::start(batches(3, 8).into_iter(), None, discovered, cfg),
            &batches(3, 8),
            |_| {},
        )
        .await;
        // The same, given as host:port: the CA means TLS.
        drain_and_check(try_with(trusted, t.addr.to_string()), &batches(3, 8), |_| {}).await;

        // No token, a wrong token, a CA that did not sign it, or no TLS at all: refused.
        let cases = [
            (
                TeacherAccess { token: None, ca_pem: Some(ca.clone()), ..Default::default() },
                "needs a bearer token",
            ),
            (
                TeacherAccess { token: Some("guess".into()), ca_pem: Some(ca.clone()), ..Default::default() },
                "wrong bearer token",
            ),
            (
                TeacherAccess { token: token.clone(), ca_pem: Some(certificates().0), ..Default::default() },
                "",
            ),
            (TeacherAccess { token: token.clone(), ca_pem: None, ..Default::default() }, ""),
        ];
        for (access, why) in cases {
            let shown = format!("{access:?}");
            assert!(!shown.contains("s3cret") && !shown.contains("guess"), "a token in {shown}");
            let err = try_with(access, t.addr.to_string()).next().await.unwrap().unwrap_err();
            let text = err.to_string();
            // A refused token is final; a connection that cannot be made is retried until the wait ends.
            assert!(matches!(err, DistillError::Refused { .. } | DistillError::NoTeachers { .. }), "{text}");
            assert!(text.contains(why), "{shown}: {text}");
        }

        // A client that shakes hands and then sends nothing (no HTTP/2
        // preface, which the server would wait for without a timer) is
        // closed within the time a connection's first bytes have (10 s).
        let mut quiet = tls_session(&ca, t.addr).await;
        let mut said = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(60), async {
            use tokio::io::AsyncReadExt;
            let _ = quiet.read_to_end(&mut said).await;
        })
        .await;
        assert!(closed.is_ok(), "a quiet TLS session still open after 60 s");
    });
}

/// A TLS session with `addr` trusting `ca` (HTTP/2 offered), nothing sent in it.
async fn tls_session(
    ca: &str,
    addr: std::net::SocketAddr,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    use tokio_rustls::rustls::{
        self,
        pki_types::{CertificateDer, ServerName, pem::PemObject},
    };
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap().to_owned();
    tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.unwrap()
}

#[test]
fn the_teacher_and_distill_commands_speak_tls_and_carry_the_token_from_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (ca, cert, key) = certificates();
    for (name, text) in
        [("ca.pem", &ca), ("cert.pem", &cert), ("key.pem", &key), ("token", &"tok-123\n".to_string())]
    {
        std::fs::write(d.join(name), text).unwrap();
    }
    model().save(&d.join("teacher.safetensors")).unwrap();
    let mut teacher = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(["teacher", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--model"])
        .arg(d.join("teacher.safetensors"))
        .arg("--token-file")
        .arg(d.join("token"))
        .arg("--tls-cert")
        .arg(d.join("cert.pem"))
        .arg("--tls-key")
        .arg(d.join("key.pem"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut said = BufReader::new(teacher.stdout.take().unwrap()).lines();
    let mut serving = || {
        let line = said.next().unwrap().unwrap();
        let at = line.split(" on ").nth(1).unwrap_or_else(|| panic!("{line}"));
        at.split(' ').next().unwrap().to_string()
    };
    let addr = serving();
    assert!(addr.starts_with("grpcs://127.0.0.1:"), "{addr}");
    // --http-listen with --tls-cert: KServe v2 REST over HTTPS, the same certificate.
    let rest = serving();
    assert!(rest.starts_with("https://127.0.0.1:"), "{rest}");
    let distill = |teacher: &str, with_token: bool, ca: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"));
        c.args(["distill", "--teachers", teacher, "--features", &DIM.to_string(), "--batches", "3"]);
        c.args(["--batch-size", "16", "--wait-secs", "2"]);
        if ca {
            c.arg("--teacher-ca").arg(d.join("ca.pem"));
        }
        if with_token {
            c.arg("--teacher-token-file").arg(d.join("token"));
        }
        c.output().unwrap()
    };
    for at in [&addr, &rest] {
        let out = distill(at, true, true);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{at}: {text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("done: 48 samples in order with 10-class soft labels"), "{text}");
    }
    let out = distill(&addr, false, true);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("needs a bearer token"), "{err}");
    // The token never goes in clear, unless asked to: a plain endpoint is
    // refused before anything is sent; with a CA, a plain endpoint is
    // refused too (the student expects TLS).
    let plain = addr.replace("grpcs://", "grpc://");
    let out = distill(&plain, true, false);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("the bearer token goes only over TLS"), "{err}");
    let out = distill(&rest.replace("https://", "http://"), false, true);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("reached without TLS"), "{err}");
    let _ = teacher.kill();
    let _ = teacher.wait();
}

#[test]
fn a_request_larger_than_the_largest_allowed_is_refused_before_it_is_read() {
    use edl_runtime::distill::teacher::Serving;
    runtime().block_on(async {
        let cfg = TeacherConfig { max_request_rows: 100, ..Default::default() };
        let serving = Serving::on("127.0.0.1:0".parse().unwrap()).max_rows(100, DIM);
        let t = Teacher::serve(serving, TeacherService::new(model(), cfg), None).await.unwrap();
        let mut c = GrpcInferenceServiceClient::connect(format!("http://{}", t.addr)).await.unwrap();
        let request = |rows: usize| pb::ModelInferRequest {
            model_name: "teacher".into(),
            inputs: vec![pb::model_infer_request::InferInputTensor {
                name: "input".into(),
                datatype: "FP32".into(),
                shape: vec![rows as i64, DIM as i64],
                ..Default::default()
            }],
            raw_input_contents: vec![oip::f32_bytes(&vec![0.5; rows * DIM])],
            ..Default::default()
        };
        // Just above the row limit: decoded, refused by the teacher.
        let e = c.model_infer(request(101)).await.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        // Far above: the transport refuses it by its size, naming the limit.
        let e = c.model_infer(request(10_000)).await.unwrap_err();
        let limit = (100 * DIM * 4 + (64 << 10)).to_string();
        assert!(e.message().contains(&limit), "{e}");
        assert!(c.model_infer(request(100)).await.is_ok());
    });
}

#[test]
fn a_teacher_that_refuses_for_good_gets_no_more_requests_and_the_error_names_it() {
    runtime().block_on(async {
        let any = "127.0.0.1:0".parse().unwrap();
        let other = TeacherConfig { model_name: "other".into(), ..Default::default() };
        let t = Teacher::start(any, TeacherService::new(model(), other), None).await.unwrap();
        let read = |teachers: Vec<String>, classes: Option<usize>| {
            // A wait far longer than the test: only a refusal ends these early.
            let cfg =
                DistillConfig { wait_for_teachers: Duration::from_secs(3600), classes, ..Default::default() };
            DistillReader::start(batches(3, 8).into_iter(), None, Teachers::Fixed(teachers), cfg)
        };
        let first = |mut r: DistillReader| async move {
            tokio::time::timeout(Duration::from_secs(120), r.next())
                .await
                .expect("an answer, not a wait")
                .unwrap()
        };
        // The wrong model (the reader's default, "teacher"): one clear error, at once.
        let err = first(read(vec![t.addr.to_string()], None)).await.unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, DistillError::Refused { .. }), "{text}");
        assert!(text.contains(&format!("{} (model \"teacher\")", t.addr)), "{text}");
        assert!(text.contains("NotFound") && text.contains("this server serves \"other\""), "{text}");
        // Named with the endpoint (and its version), the same teacher serves.
        drain_and_check(read(vec![format!("{}/other/1", t.addr)], None), &batches(3, 8), |_| {}).await;
        // A class count other than the student's is refused for good too.
        let err = first(read(vec![format!("{}/other", t.addr)], Some(CLASSES + 1))).await.unwrap_err();
        assert!(
            err.to_string().contains(&format!("answered {CLASSES} classes; the student has {}", CLASSES + 1)),
            "{err}"
        );
    });
}

#[test]
fn the_distill_command_gives_up_on_dead_teachers_after_the_wait_and_on_a_wrong_model_at_once() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let run = |teachers: &str, wait: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
            .args(["distill", "--teachers", teachers, "--features", &DIM.to_string(), "--batches", "2"])
            .args(["--wait-secs", wait, "--teacher-cooldown-ms", "100"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Bounded, so that a reader that never gives up fails the test instead of hanging it.
        let until = std::time::Instant::now() + Duration::from_secs(300);
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s;
            }
            assert!(std::time::Instant::now() < until, "distill --teachers {teachers} did not give up");
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut c.stderr.take().unwrap(), &mut err).unwrap();
        (status, err)
    };
    let (status, err) = run(&dead.to_string(), "2");
    assert!(
        !status.success() && err.contains("no teacher answered for 2s") && err.contains(&dead.to_string()),
        "{err}"
    );
    // A live teacher asked for a model it does not serve: refused at once
    // (the wait is an hour).
    let dir = tempfile::tempdir().unwrap();
    model().save(&dir.path().join("t.safetensors")).unwrap();
    let mut teacher = Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(["teacher", "--listen", "127.0.0.1:0", "--model"])
        .arg(dir.path().join("t.safetensors"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = serving_at(&mut teacher);
    let (status, err) = run(&format!("{addr}/resnet"), "3600");
    assert!(
        !status.success() && err.contains("every teacher refused") && err.contains("\"resnet\""),
        "{err}"
    );
    let _ = teacher.kill();
    let _ = teacher.wait();
}

/// A teacher as scikit-learn servers present one: FP64 input `features`, an
/// INT64 `label` output and FP64 `probabilities`; only the outputs asked
/// for are answered (all when none is).
#[derive(Clone)]
struct SklearnLike;

fn softmax_rows(v: &[f32], cols: usize) -> Vec<f32> {
    v.chunks(cols)
        .flat_map(|r| {
            let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = r.iter().map(|x| (x - m).exp()).collect();
            let s: f32 = e.iter().sum();
            e.into_iter().map(move |x| x / s)
        })
        .collect()
}

#[tonic::async_trait]
impl GrpcInferenceService for SklearnLike {
    async fn server_live(
        &self,
        _: Request<pb::ServerLiveRequest>,
    ) -> Result<Response<pb::ServerLiveResponse>, Status> {
        Ok(Response::new(pb::ServerLiveResponse { live: true }))
    }
    async fn server_ready(
        &self,
        _: Request<pb::ServerReadyRequest>,
    ) -> Result<Response<pb::ServerReadyResponse>, Status> {
        Ok(Response::new(pb::ServerReadyResponse { ready: true }))
    }
    async fn model_ready(
        &self,
        _: Request<pb::ModelReadyRequest>,
    ) -> Result<Response<pb::ModelReadyResponse>, Status> {
        Ok(Response::new(pb::ModelReadyResponse { ready: true }))
    }
    async fn server_metadata(
        &self,
        _: Request<pb::ServerMetadataRequest>,
    ) -> Result<Response<pb::ServerMetadataResponse>, Status> {
        Ok(Response::new(pb::ServerMetadataResponse::default()))
    }
    async fn model_metadata(
        &self,
        _: Request<pb::ModelMetadataRequest>,
    ) -> Result<Response<pb::ModelMetadataResponse>, Status> {
        let t = |name: &str, datatype: &str, cols: usize| pb::model_metadata_response::TensorMetadata {
            name: name.into(),
            datatype: datatype.into(),
            shape: vec![-1, cols as i64],
        };
        Ok(Response::new(pb::ModelMetadataResponse {
            name: "clf".into(),
            versions: vec!["1".into()],
            platform: "sklearn".into(),
            inputs: vec![t("features", "FP64", DIM)],
            outputs: vec![t("label", "INT64", 1), t("probabilities", "FP64", CLASSES)],
        }))
    }
    async fn model_config(
        &self,
        _: Request<pb::ModelConfigRequest>,
    ) -> Result<Response<pb::ModelConfigResponse>, Status> {
        Err(Status::unimplemented("no model configuration here"))
    }
    async fn model_statistics(
        &self,
        _: Request<pb::ModelStatisticsRequest>,
    ) -> Result<Response<pb::ModelStatisticsResponse>, Status> {
        Err(Status::unimplemented("no statistics here"))
    }
    async fn model_infer(
        &self,
        r: Request<pb::ModelInferRequest>,
    ) -> Result<Response<pb::ModelInferResponse>, Status> {
        let req = r.into_inner();
        let input = &req.inputs[0];
        if input.name != "features" || input.datatype != "FP64" {
            return Err(Status::invalid_argument(format!(
                "unexpected input {} {}",
                input.name, input.datatype
            )));
        }
        let rows = input.shape[0] as usize;
        let x: Vec<f32> = req.raw_input_contents[0]
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
            .collect();
        let probs = softmax_rows(&model().forward(&x, rows), CLASSES);
        let label = |name: &str, datatype: &str, cols: usize| pb::model_infer_response::InferOutputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape: vec![rows as i64, cols as i64],
            ..Default::default()
        };
        let mut outputs = Vec::new();
        let mut raw = Vec::new();
        let asked = |n: &str| req.outputs.is_empty() || req.outputs.iter().any(|o| o.name == n);
        if asked("label") {
            outputs.push(label("label", "INT64", 1));
            raw.push(vec![0u8; rows * 8]);
        }
        if asked("probabilities") {
            outputs.push(label("probabilities", "FP64", CLASSES));
            raw.push(probs.iter().flat_map(|&p| (p as f64).to_le_bytes()).collect());
        }
        Ok(Response::new(pb::ModelInferResponse { outputs, raw_output_contents: raw, ..Default::default() }))
    }
}

#[test]
fn teachers_with_other_names_datatypes_and_probabilities_are_read_from_their_metadata() {
    use edl_runtime::distill::TeacherIo;
    runtime().block_on(async {
        let any = "127.0.0.1:0".parse().unwrap();
        let sk = Teacher::start_with(any, SklearnLike, None).await.unwrap();
        let ours =
            Teacher::start(any, TeacherService::new(model(), TeacherConfig::default()), None).await.unwrap();
        let data = batches(6, 40);
        // A fleet that mixes logits (ours) and probabilities (the other, which
        // says so with @probs): every batch's soft labels mean the same.
        let teachers = Teachers::Fixed(vec![ours.addr.to_string(), format!("{}/clf@probs", sk.addr)]);
        let cfg = DistillConfig { teacher_batch: 8, classes: Some(CLASSES), ..Default::default() };
        let mut reader = DistillReader::start(data.clone().into_iter(), None, teachers, cfg);
        for want in &data {
            let got = reader.next().await.unwrap().unwrap();
            let healthy = softmax_rows(&model().forward(&want.to_f32().unwrap(), want.len()), CLASSES);
            let read = softmax_rows(&got.soft, CLASSES);
            for (a, b) in read.iter().zip(&healthy) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
        // Told to read the integer output: refused, saying why.
        let io = TeacherIo { output_name: Some("label".into()), ..Default::default() };
        let cfg = DistillConfig { io, wait_for_teachers: Duration::from_secs(3600), ..Default::default() };
        let teachers = Teachers::Fixed(vec![format!("{}/clf", sk.addr)]);
        let mut reader = DistillReader::start(batches(1, 8).into_iter(), None, teachers, cfg);
        let err = tokio::time::timeout(Duration::from_secs(120), reader.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("output \"label\" of model \"clf\" is INT64: soft labels need floating point"),
            "{text}"
        );
        // Probabilities read as if they were: values outside [0, 1] are refused, naming the teacher.
        let teachers = Teachers::Fixed(vec![format!("{}@probs", ours.addr)]);
        let cfg = DistillConfig { wait_for_teachers: Duration::from_secs(3600), ..Default::default() };
        let mut reader = DistillReader::start(batches(1, 8).into_iter(), None, teachers, cfg);
        let err = tokio::time::timeout(Duration::from_secs(120), reader.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap_err();
        assert!(err.to_string().contains("read as probabilities, answered"), "{err}");
    });
}

/// NVIDIA's own client (tritonclient, from the package registry into a
/// virtual environment under the target directory) against a teacher
/// process: `examples/oip-client/check_teacher.py`.
#[test]
fn tritonclient_reads_metadata_config_statistics_and_logits_and_gets_triton_s_refusals() {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_edl-runtime"));
    let venv = exe.parent().unwrap().parent().unwrap().join("tritonclient/venv");
    let python = venv.join("bin/python");
    let ready = || {
        Command::new(&python)
            .args(["-c", "import tritonclient.grpc, tritonclient.http, numpy"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !ready() {
        let made = Command::new("python3").args(["-m", "venv"]).arg(&venv).status().unwrap();
        assert!(made.success(), "python3 -m venv {}", venv.display());
        let pip =
            ["-m", "pip", "install", "--disable-pip-version-check", "-q", "tritonclient[grpc,http]", "numpy"];
        let out = Command::new(&python).args(pip).output().unwrap();
        assert!(out.status.success(), "installing tritonclient: {}", String::from_utf8_lossy(&out.stderr));
    }
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/oip-client/check_teacher.py");
    let dir = tempfile::tempdir().unwrap();
    let model_file = dir.path().join("m.safetensors");
    let out = Command::new(&python).arg(&script).arg("write").arg(&model_file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut teacher = Command::new(exe)
        .args(["teacher", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--model"])
        .arg(&model_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(teacher.stdout.take().unwrap());
    let mut line = |needle: &str| {
        let mut l = String::new();
        out.read_line(&mut l).unwrap();
        l.split(needle)
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("{l}"))
            .to_string()
    };
    let grpc = line("serving on ");
    let http = line("REST on http://");
    for (mode, addr) in [("check", &grpc), ("check-http", &http)] {
        let out = Command::new(&python).arg(&script).arg(mode).arg(addr).output().unwrap();
        let said =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && said.trim_end().ends_with("ok"), "{mode}: {said}");
    }
    let _ = teacher.kill();
    let _ = teacher.wait();
}

#[test]
fn the_reader_reads_teachers_that_speak_rest() {
    use edl_runtime::distill::TeacherAccess;
    runtime().block_on(async {
        let serve = |token: Option<String>| async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let service = TeacherService::new(model(), TeacherConfig::default());
            tokio::spawn(edl_runtime::distill::rest::serve(
                listener,
                edl_runtime::distill::rest::router(
                    service,
                    token,
                    edl_runtime::distill::rest::max_body(4096, DIM),
                    addr,
                ),
                "teacher REST endpoint",
            ));
            format!("http://{addr}")
        };
        let open = serve(None).await;
        let guarded = serve(Some("tok".into())).await;
        let cfg = |access: TeacherAccess| DistillConfig {
            teacher_batch: 8,
            classes: Some(CLASSES),
            wait_for_teachers: Duration::from_secs(3600),
            access,
            ..Default::default()
        };
        // Over REST, and beside a gRPC teacher: the same soft labels, every sample once.
        let grpc = Teacher::start(
            "127.0.0.1:0".parse().unwrap(),
            TeacherService::new(model(), TeacherConfig::default()),
            None,
        )
        .await
        .unwrap();
        let teachers = Teachers::Fixed(vec![open.clone(), format!("grpc://{}", grpc.addr)]);
        let data = batches(6, 24);
        drain_and_check(
            DistillReader::start(data.clone().into_iter(), None, teachers, cfg(Default::default())),
            &data,
            |_| {},
        )
        .await;
        // A plain http:// teacher gets the token only when asked to.
        let with_token =
            TeacherAccess { token: Some("tok".into()), ca_pem: None, allow_insecure_token: true };
        let teachers = Teachers::Fixed(vec![guarded.clone()]);
        drain_and_check(
            DistillReader::start(batches(2, 8).into_iter(), None, teachers, cfg(with_token)),
            &batches(2, 8),
            |_| {},
        )
        .await;
        // Refusals over REST end the read at once, naming the teacher and the answer.
        let first = |teachers: Vec<String>| async move {
            let mut r = DistillReader::start(
                batches(1, 8).into_iter(),
                None,
                Teachers::Fixed(teachers),
                cfg(Default::default()),
            );
            tokio::time::timeout(Duration::from_secs(120), r.next())
                .await
                .expect("an answer, not a wait")
                .unwrap()
        };
        let err = first(vec![guarded.clone()]).await.unwrap_err().to_string();
        assert!(err.contains("HTTP 401") && err.contains("needs a bearer token"), "{err}");
        let err = first(vec![format!("{open}/resnet")]).await.unwrap_err().to_string();
        assert!(err.contains("HTTP 404") && err.contains("this server serves"), "{err}");
    });
}

#[test]
fn the_teachers_a_job_starts_get_its_token_and_serve_tls_with_a_certificate_it_makes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("token"), "job-token-42\n").unwrap();
    let mut c = job(d, &["--epochs", "1", "--teacher-token-file"]);
    c.arg(d.join("token"));
    let mut child = c.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    let out = seen.join("\n");
    assert!(status.success(), "{out}");
    // Its teacher serves TLS (the token would otherwise cross in clear),
    // and the students, trusting the job's certificate and carrying its
    // token, distilled from it.
    assert!(out.contains("serving on grpcs://127.0.0.1:"), "{out}");
    let r = report(d);
    assert!(r["student_test_accuracy"].as_f64().unwrap() > 0.5, "{r}");
    let key = std::fs::metadata(d.join(".edl/mnist/teacher-tls/teachers.key")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(key.permissions().mode() & 0o777, 0o600, "the key is its owner's alone");
}

/// A model for MLServer (the KServe v2 reference server, from the package
/// registry): soft labels softmax(x W) with a W the test knows, declaring
/// no input or output (as custom MLServer models often do).
pub(crate) const MLSERVER_MODEL: &str = r#"
import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class Probs(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float64)
        w = np.array([[((i * 7 + j * 3) % 11 - 5) / 10.0 for j in range(10)] for i in range(x.shape[1])])
        z = x @ w
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        out = NumpyCodec.encode_output("probs", p.astype(np.float32))
        return InferenceResponse(model_name=self.name, outputs=[out])
"#;

/// The soft labels [`MLSERVER_MODEL`] gives for `features` rows of `dim`.
fn mlserver_probs(features: &[f32], dim: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for row in features.chunks(dim) {
        let z: Vec<f64> = (0..10)
            .map(|j| {
                (0..dim).map(|i| row[i] as f64 * (((i * 7 + j * 3) % 11) as f64 - 5.0) / 10.0).sum::<f64>()
            })
            .collect();
        let top = z.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = z.iter().map(|v| (v - top).exp()).collect();
        let sum: f64 = e.iter().sum();
        out.extend(e.iter().map(|v| (v / sum) as f32));
    }
    out
}

#[test]
fn mlserver_over_rest_in_json_tensors_and_over_grpc_gives_the_soft_labels_its_model_computes() {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_edl-runtime"));
    let venv = exe.parent().unwrap().parent().unwrap().join("mlserver/venv");
    let bin = venv_with(&venv, "import mlserver", &["mlserver>=1.7,<2"])
        .unwrap_or_else(|e| panic!("MLServer from the package registry: {e}"));
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("digits")).unwrap();
    std::fs::write(d.join("digits/model.py"), MLSERVER_MODEL).unwrap();
    std::fs::write(
        d.join("digits/model-settings.json"),
        r#"{"name": "digits", "implementation": "model.Probs"}"#,
    )
    .unwrap();
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (http, grpc) = (free(), free());
    let settings = format!(
        r#"{{"host": "127.0.0.1", "http_port": {http}, "grpc_port": {grpc}, "metrics_endpoint": null, "parallel_workers": 0}}"#
    );
    std::fs::write(d.join("settings.json"), settings).unwrap();
    let log = std::fs::File::create(d.join("mlserver.log")).unwrap();
    let mut server = Command::new(bin.join("mlserver"))
        .arg("start")
        .arg(d)
        .current_dir(d)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let said = || std::fs::read_to_string(d.join("mlserver.log")).unwrap_or_default();
    runtime().block_on(async {
        // Ready when its model is (it loads after the port opens).
        let ready = format!("http://127.0.0.1:{http}/v2/models/digits/ready");
        let client = reqwest::Client::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while !client.get(&ready).send().await.is_ok_and(|r| r.status().is_success()) {
            assert!(std::time::Instant::now() < deadline, "MLServer did not get ready:\n{}", said());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for teacher in
            [format!("http://127.0.0.1:{http}/digits@probs"), format!("grpc://127.0.0.1:{grpc}/digits@probs")]
        {
            let cfg = DistillConfig {
                classes: Some(CLASSES),
                wait_for_teachers: Duration::from_secs(10),
                ..Default::default()
            };
            let data = batches(3, 16);
            let mut reader = DistillReader::start(
                data.clone().into_iter(),
                None,
                Teachers::Fixed(vec![teacher.clone()]),
                cfg,
            );
            for b in &data {
                let got =
                    reader.next().await.unwrap().unwrap_or_else(|e| panic!("{teacher}: {e}\n{}", said()));
                // Probabilities reach the student as log-probabilities.
                let want: Vec<f32> =
                    mlserver_probs(&b.to_f32().unwrap(), DIM).iter().map(|p| p.ln()).collect();
                assert_eq!(got.soft.len(), want.len(), "{teacher}");
                let worst = got.soft.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst < 1e-4, "{teacher}: soft labels off by {worst}");
            }
        }
    });
    let _ = server.kill();
    let _ = server.wait();
}

/// A teacher's REST endpoint without a token on loopback answers only
/// requests that name a loopback host at its port: a web page whose name
/// was rebound to 127.0.0.1, open in a browser on this machine, sends its
/// own name and is refused. On all interfaces (where anyone may call it
/// anyway) no name is refused.
#[test]
fn a_rest_teacher_without_a_token_on_loopback_answers_only_loopback_names() {
    runtime().block_on(async {
        let start = |bind: &'static str| async move {
            let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
            let addr = listener.local_addr().unwrap();
            let service = TeacherService::new(model(), TeacherConfig::default());
            let max_body = edl_runtime::distill::rest::max_body(4096, DIM);
            let router = edl_runtime::distill::rest::router(service, None, max_body, addr);
            tokio::spawn(edl_runtime::distill::rest::serve(listener, router, "teacher REST endpoint"));
            addr.port()
        };
        let status = |port: u16, host: String| async move {
            let url = format!("http://127.0.0.1:{port}/v2/models/teacher");
            let c = reqwest::Client::new();
            c.get(url).header(reqwest::header::HOST, host).send().await.unwrap().status().as_u16()
        };
        let port = start("127.0.0.1:0").await;
        for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}"), "localhost".into()] {
            assert_eq!(status(port, host.clone()).await, 200, "{host}");
        }
        for host in [format!("attacker.example:{port}"), format!("127.0.0.1:{}", port.wrapping_add(1))] {
            assert_eq!(status(port, host.clone()).await, 403, "{host}");
        }
        // A request in absolute form names its host in its address, which
        // wins over the Host header (as HTTP/2's :authority does).
        let absolute = move |named: String, host: String| {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let head = format!(
                "GET http://{named}/v2/models/teacher HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            );
            s.write_all(head.as_bytes()).unwrap();
            let mut answer = String::new();
            let _ = s.read_to_string(&mut answer);
            answer.split_whitespace().nth(1).unwrap_or_default().to_string()
        };
        let here = format!("127.0.0.1:{port}");
        let rebound = format!("attacker.example:{port}");
        let (named_rebound, named_here) = tokio::task::spawn_blocking(move || {
            (absolute(rebound.clone(), here.clone()), absolute(here, rebound))
        })
        .await
        .unwrap();
        assert_eq!((named_rebound.as_str(), named_here.as_str()), ("403", "200"));
        // HTTP/2 (in clear, with prior knowledge) names the host in
        // :authority alone: a rebound name is refused there too.
        let h2 = |name: &'static str| async move {
            let at = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let c = reqwest::Client::builder().http2_prior_knowledge().resolve(name, at).build().unwrap();
            let r = c.get(format!("http://{name}:{port}/v2/models/teacher")).send().await.unwrap();
            (r.version(), r.status().as_u16())
        };
        assert_eq!(h2("localhost").await, (reqwest::Version::HTTP_2, 200));
        assert_eq!(h2("attacker.example").await, (reqwest::Version::HTTP_2, 403));
        let everywhere = start("0.0.0.0:0").await;
        assert_eq!(status(everywhere, format!("attacker.example:{everywhere}")).await, 200);
    });
}

#[test]
fn a_rest_request_without_the_token_is_refused_before_its_body_is_read() {
    use std::io::{Read, Write};
    runtime().block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = TeacherService::new(model(), TeacherConfig::default());
        let max_body = edl_runtime::distill::rest::max_body(4096, DIM);
        let router = edl_runtime::distill::rest::router(service, Some("tok".into()), max_body, addr);
        tokio::spawn(edl_runtime::distill::rest::serve(listener, router, "teacher REST endpoint"));
        let answer = tokio::task::spawn_blocking(move || {
            // A body of 50 MB announced and never sent: the teacher answers
            // at once, without waiting for it.
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let head = "POST /v2/models/teacher/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\n\r\n";
            s.write_all(head.as_bytes()).unwrap();
            let mut buf = [0u8; 512];
            let n = s.read(&mut buf).unwrap_or(0);
            String::from_utf8_lossy(&buf[..n]).into_owned()
        })
        .await
        .unwrap();
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer:?}");
        // Health probes carry no token and are answered.
        let ok = reqwest::get(format!("http://{addr}/v2/health/ready")).await.unwrap();
        assert!(ok.status().is_success());
    });
}
