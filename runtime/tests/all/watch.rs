//! Watching a job as it runs (`--metrics-listen`): its Prometheus metrics
//! read by the reference client's OpenMetrics parser, its live page drawn
//! by a real headless browser (Debian's chromium), its token.

use crate::support::{
    KillOnDrop,
    job::{job, lines},
    python::py,
    wait::wait_for,
};
use edl_plugin_artifacts as art;
use std::{collections::BTreeMap, io::Write, path::Path, process::Stdio, sync::mpsc, time::Duration};

/// A long built-in job under the schedule policy (1 -> 2 workers after a
/// few steps), watched on a free loopback port.
const WATCHED: [&str; 15] = [
    "--no-distill",
    "--policy",
    art::SCHEDULE_WASM,
    "--policy-config",
    "every=4",
    "--decide-every-steps",
    "4",
    "--max-workers",
    "2",
    "--epochs",
    "400",
    "--step-delay-ms",
    "20",
    "--metrics-listen",
    "127.0.0.1:0",
];

/// A [`WATCHED`] job with `extra` flags: its process, output and page address.
fn watched(dir: &Path, extra: &[&str]) -> (KillOnDrop, mpsc::Receiver<String>, String, Vec<String>) {
    let flags = [&WATCHED[..], extra].concat();
    let mut child = job(dir, &flags).spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    wait_for(&rx, "watch     http://", &mut seen, Duration::from_secs(120));
    let line = seen.iter().find(|l| l.starts_with("watch     http://")).unwrap();
    let url = line["watch     ".len()..].split_whitespace().next().unwrap().to_string();
    (KillOnDrop(child), rx, url, seen)
}

/// A GET of `url`: its status and body.
fn get(url: &str, bearer: Option<&str>) -> (u16, String) {
    get_with(reqwest::Client::new(), url, bearer, None)
}

/// A GET of `url` by `client`, with a bearer token and a `Host` of its own.
fn get_with(client: reqwest::Client, url: &str, bearer: Option<&str>, host: Option<&str>) -> (u16, String) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut req = client.get(url).timeout(Duration::from_secs(30));
        if let Some(t) = bearer {
            req = req.bearer_auth(t);
        }
        if let Some(h) = host {
            req = req.header(reqwest::header::HOST, h);
        }
        let resp = req.send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    })
}

/// The samples of an OpenMetrics text, as read by the reference Python
/// client's parser (which refuses text that breaks the format): each
/// sample's name with its labels, and its value.
fn parsed(text: &str) -> BTreeMap<String, f64> {
    const PARSE: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
        out[s.name + ("{" + labels + "}" if labels else "")] = repr(float(s.value))
print(json.dumps(out))
"#;
    let mut c =
        py().python().args(["-c", PARSE]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = c.wait_with_output().unwrap();
    assert!(out.status.success(), "the parser refused the metrics:\n{text}");
    // Values travel as Python's repr: JSON has no NaN, and a gauge not yet
    // measured is NaN.
    let values: BTreeMap<String, String> = serde_json::from_slice(&out.stdout).unwrap();
    values
        .into_iter()
        .map(|(k, v)| {
            let x = v.parse().unwrap_or_else(|e| panic!("{k} = {v}: {e}"));
            (k, x)
        })
        .collect()
}

#[test]
fn the_metrics_parse_as_openmetrics_and_move_while_the_job_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (_job, rx, url, mut seen) = watched(dir.path(), &[]);
    let (status, first) = get(&format!("{url}metrics"), None);
    assert_eq!(status, 200, "{first}");
    let first = parsed(&first);
    wait_for(&rx, "1 -> 2 workers", &mut seen, Duration::from_secs(120));
    wait_for(&rx, "progress", &mut seen, Duration::from_secs(60));
    let (_, second) = get(&format!("{url}metrics"), None);
    let second = parsed(&second);
    let at = |m: &BTreeMap<String, f64>, k: &str| *m.get(k).unwrap_or_else(|| panic!("no {k} in {m:?}"));
    assert_eq!(at(&second, "edl_job_info{name=\"mnist\",policy=\"edl-plugin-schedule 0.1.0\"}"), 1.0);
    for counter in ["edl_steps_total", "edl_samples_total"] {
        assert!(at(&second, counter) > first.get(counter).copied().unwrap_or(0.0), "{counter}: {second:?}");
    }
    assert!(at(&second, "edl_committed_step") >= at(&second, "edl_steps_total"), "{second:?}");
    assert!(at(&second, "edl_resizes_total{direction=\"grow\"}") >= 2.0, "0 -> 1 and 1 -> 2: {second:?}");
    assert!(at(&second, "edl_resize_pause_seconds_count") >= 2.0, "{second:?}");
    assert!(at(&second, "edl_resize_pause_seconds_sum") > 0.0, "{second:?}");
    assert!(at(&second, "edl_samples_per_second") > 0.0, "{second:?}");
    assert!(at(&second, "edl_generation") >= 2.0, "{second:?}");
    assert!(at(&second, "edl_workers{stage=\"training\"}") >= 1.0, "{second:?}");
    // Two workers started, connected and loaded the job: each phase timed.
    for phase in ["edl_worker_start_seconds", "edl_worker_load_seconds"] {
        assert!(at(&second, &format!("{phase}_count")) >= 2.0, "{phase}: {second:?}");
        assert!(at(&second, &format!("{phase}_sum")) > 0.0, "{phase}: {second:?}");
    }
    // The policy's decisions, holds and growth, and its calls' times.
    assert!(at(&second, "edl_policy_decisions_total{action=\"scale-out\"}") >= 1.0, "{second:?}");
    let calls = at(&second, "edl_plugin_call_seconds_count{plugin=\"scaling-policy\"}");
    assert!(calls >= at(&second, "edl_policy_decisions_total{action=\"scale-out\"}"), "{second:?}");
    // Served from the start (NaN until two workers share a step and the
    // smoothed estimate is positive; its values are checked with the report's).
    assert!(second.contains_key("edl_gradient_noise_scale"), "{second:?}");
}

/// What headless chromium shows of `url` once its scripts ran.
fn browser_dom(url: &str) -> String {
    let out = std::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=3000",
            "--dump-dom",
            url,
        ])
        .stderr(Stdio::null())
        .output()
        .expect("chromium (Debian's package; .ci/run installs it)");
    assert!(out.status.success(), "chromium failed on {url}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The points the page's chart `id` draws.
fn drawn_points(dom: &str, id: &str) -> usize {
    let at = dom.find(&format!("id=\"{id}\"")).unwrap_or_else(|| panic!("no chart {id} in\n{dom}"));
    let rest = &dom[at..];
    let n = rest.find("data-points=\"").unwrap() + "data-points=\"".len();
    rest[n..].split('"').next().unwrap().parse().unwrap()
}

#[test]
fn the_live_page_draws_the_job_as_it_runs_in_a_real_browser() {
    let dir = tempfile::tempdir().unwrap();
    let (_job, rx, url, mut seen) = watched(dir.path(), &[]);
    wait_for(&rx, "progress", &mut seen, Duration::from_secs(60));
    let before = browser_dom(&url);
    let loss_before = drawn_points(&before, "chart-loss");
    assert!(loss_before > 0, "{before}");
    wait_for(&rx, "1 -> 2 workers", &mut seen, Duration::from_secs(120));
    wait_for(&rx, "progress", &mut seen, Duration::from_secs(60));
    let after = browser_dom(&url);
    assert!(drawn_points(&after, "chart-loss") > loss_before, "the curve did not grow:\n{after}");
    assert!(drawn_points(&after, "chart-world") > 0, "{after}");
    assert!(after.contains("<td>1 -&gt; 2</td>"), "no scale event 1 -> 2 on the page:\n{after}");
    assert!(after.contains("policy: add 1 worker") || after.contains("schedule"), "{after}");
    assert!(after.contains("running"), "{after}");
    // The workers, each with its stage.
    assert!(after.contains("<tr class=\"worker\"><td>1</td><td>0</td><td>training</td>"), "{after}");
}

#[test]
fn the_watch_takes_its_token_and_beyond_loopback_only_tls() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("watch.token");
    std::fs::write(&token_file, "s3cret-watch-token\n").unwrap();
    let (_job, _rx, url, _) = watched(dir.path(), &["--metrics-token-file", token_file.to_str().unwrap()]);
    let (status, body) = get(&format!("{url}metrics"), None);
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("needs its token"), "{body}");
    assert_eq!(get(&format!("{url}metrics"), Some("wrong")).0, 401);
    let (status, body) = get(&format!("{url}metrics"), Some("s3cret-watch-token"));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("edl_steps_total"), "{body}");
    // Never in a request's address, which proxies and servers log.
    let (status, body) = get(&format!("{url}api/state?token=s3cret-watch-token&since=0"), None);
    assert_eq!(status, 401, "{body}");
    let (status, body) = get(&format!("{url}api/state?since=0"), Some("s3cret-watch-token"));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"job\":\"mnist\""), "{body}");
    assert_eq!(get(&format!("{url}healthz"), None).0, 200, "probes need no token");
    // A query the page does not make is not a reason to refuse the token.
    let (status, _) = get(&format!("{url}metrics?since=x"), Some("s3cret-watch-token"));
    assert_eq!(status, 200);

    // Beyond loopback, in clear: refused before anything starts.
    let other = tempfile::tempdir().unwrap();
    let out = job(other.path(), &["--no-distill", "--metrics-listen", "0.0.0.0:0"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("beyond loopback the page and metrics are served only over TLS"), "{err}");
}

/// The page holds nothing of the job: with a token it is served without
/// it, the job's state is not. Given the token after the `#` of its
/// address (which a browser never sends), the page reads the job with it
/// in a header and draws the curves.
#[test]
fn the_page_takes_its_token_after_the_hash_and_sends_it_in_a_header() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("watch.token");
    std::fs::write(&token_file, "hash-watch-token\n").unwrap();
    let (_job, rx, url, mut seen) =
        watched(dir.path(), &["--metrics-token-file", token_file.to_str().unwrap()]);
    let (status, page) = get(&url, None);
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("<script>") && !page.contains("mnist"), "{page}");
    let (status, body) = get(&format!("{url}api/state"), None);
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("#token=TOKEN"), "{body}");
    wait_for(&rx, "progress", &mut seen, Duration::from_secs(60));
    let dom = browser_dom(&format!("{url}#token=hash-watch-token"));
    assert!(drawn_points(&dom, "chart-loss") > 0, "{dom}");
    // Without the token, the page draws nothing of the job.
    let dom = browser_dom(&url);
    let drawn = dom.contains("id=\"chart-loss\"") && drawn_points(&dom, "chart-loss") > 0;
    assert!(!drawn, "{dom}");
}

#[test]
fn without_a_token_the_watch_answers_only_loopback_names() {
    let dir = tempfile::tempdir().unwrap();
    let (_job, _rx, url, _) = watched(dir.path(), &[]);
    let port = url.trim_end_matches('/').rsplit(':').next().unwrap().to_string();
    for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}"), format!("[::1]:{port}")] {
        let (status, body) = get_with(reqwest::Client::new(), &format!("{url}api/state"), None, Some(&host));
        assert_eq!(status, 200, "{host}: {body}");
    }
    // A page of another site whose name now points at 127.0.0.1 (DNS
    // rebinding) reads nothing.
    let rebound = format!("evil.example:{port}");
    let (status, body) = get_with(reqwest::Client::new(), &format!("{url}api/state"), None, Some(&rebound));
    assert_eq!(status, 403, "{body}");
    assert!(!body.contains("mnist"), "{body}");
}

#[test]
fn over_tls_the_watch_serves_clients_that_trust_its_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (ca, cert, key) = crate::distill::certificates();
    std::fs::write(d.join("cert.pem"), cert).unwrap();
    std::fs::write(d.join("key.pem"), key).unwrap();
    std::fs::write(d.join("token"), "tls-watch-token\n").unwrap();
    let (c, k, t) = (d.join("cert.pem"), d.join("key.pem"), d.join("token"));
    let flags = [
        "--metrics-tls-cert",
        c.to_str().unwrap(),
        "--metrics-tls-key",
        k.to_str().unwrap(),
        "--metrics-token-file",
        t.to_str().unwrap(),
    ];
    let mut child = job(d, &[&WATCHED[..], &flags].concat()).spawn().unwrap();
    let rx = lines(&mut child);
    let _job = KillOnDrop(child);
    let mut seen = Vec::new();
    wait_for(&rx, "watch     https://", &mut seen, Duration::from_secs(120));
    let line = seen.iter().find(|l| l.starts_with("watch     https://")).unwrap();
    let url = line["watch     ".len()..].split_whitespace().next().unwrap().to_string();
    let trusting = || {
        let ca = reqwest::Certificate::from_pem(ca.as_bytes()).unwrap();
        reqwest::Client::builder().add_root_certificate(ca).build().unwrap()
    };
    let (status, body) = get_with(trusting(), &format!("{url}metrics"), Some("tls-watch-token"), None);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("edl_steps_total"), "{body}");
    assert_eq!(get_with(trusting(), &format!("{url}metrics"), None, None).0, 401);
    // A client that does not trust the certificate gets nothing.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let refused = rt.block_on(reqwest::Client::new().get(format!("{url}metrics")).send());
    assert!(refused.is_err(), "{refused:?}");
}

/// The job's curves in TensorBoard event files, read back by TensorBoard's
/// own `EventAccumulator` (from PyPI, in the PyTorch environment).
#[test]
fn tensorboard_reads_the_job_s_curves_from_its_event_files() {
    const READ: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}))
"#;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let flags = [&crate::support::job::GROWING[..], &["--no-distill", "--tensorboard", "tb"]].concat();
    let out = job(d, &flags).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("tensorboard "),
        "no line says where the events go"
    );
    let read =
        crate::support::python::torch_py().python().args(["-c", READ]).arg(d.join("tb")).output().unwrap();
    assert!(read.status.success(), "{}", String::from_utf8_lossy(&read.stderr));
    let scalars: BTreeMap<String, Vec<(u64, f64)>> = serde_json::from_slice(&read.stdout).unwrap();
    for tag in [
        "train/loss",
        "train/samples_per_sec",
        "train/global_batch",
        "train/learning_rate",
        "cluster/workers",
    ] {
        assert!(scalars.contains_key(tag), "{tag} missing from {:?}", scalars.keys());
    }
    // Every committed step's loss, as the report has it.
    let r = crate::support::job::report(d);
    let timeline = r["timeline"].as_array().unwrap();
    let loss = &scalars["train/loss"];
    assert_eq!(loss.len(), timeline.len());
    for (got, want) in loss.iter().zip(timeline) {
        assert_eq!(got.0, want["step"].as_u64().unwrap());
        let l = want["loss"].as_f64().unwrap();
        assert!((got.1 - l).abs() <= 1e-6 * l.abs().max(1.0), "step {}: {} != {l}", got.0, got.1);
    }
    // The workers at every step, as the report has them.
    let workers: Vec<f64> = scalars["cluster/workers"].iter().map(|w| w.1).collect();
    let world: Vec<f64> = timeline.iter().map(|s| s["world"].as_f64().unwrap()).collect();
    assert_eq!(workers, world);
    assert_eq!(scalars["cluster/resize_pause_ms"].len(), r["scale_events"].as_array().unwrap().len());
    // The noise scale of every step that measured it.
    let measured = timeline.iter().filter(|s| s.get("noise_scale").is_some()).count();
    assert_eq!(scalars.get("train/gradient_noise_scale").map_or(0, |v| v.len()), measured);
}
