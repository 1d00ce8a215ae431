//! What crosses the network of a job across hosts: a capture (tcpdump, on a
//! worker host's interface in a network namespace) of a whole job shows none
//! of what the job's channels carry in clear: not the teacher token, not the
//! reader transform's bytes, not the control messages, not the gradients.

use crate::support::{
    capture::{Capture, contains, tcpdump_or_skip},
    hosts::Hosts,
    job::{finish, job, lines, report},
};
use edl_plugin_artifacts as art;
use std::process::Stdio;

/// Pearson's chi-square of `bytes`' histogram against the uniform one: about
/// 255 (within a few times 22.6) for random bytes, thousands and more for
/// text or numbers.
fn chi_square(bytes: &[u8]) -> f64 {
    let mut counts = [0u64; 256];
    for &b in bytes {
        counts[b as usize] += 1;
    }
    let expected = bytes.len() as f64 / 256.0;
    counts.iter().map(|&c| (c as f64 - expected).powi(2) / expected).sum()
}

#[test]
fn a_capture_of_a_job_across_hosts_shows_no_token_no_plugin_bytes_no_control_message_and_no_gradient() {
    // The check on gradients can fail: values a model's gradients look
    // like are far from uniform bytes.
    let plain: Vec<f32> = (0..50_000).map(|i| ((i as f32) * 0.37).sin() * 1e-3).collect();
    let plain: Vec<u8> = plain.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert!(chi_square(&plain) > 10_000.0);

    let Some(tcpdump) = tcpdump_or_skip() else { return };
    let Some(hosts) = Hosts::build_or_skip(&["coord", "w1", "w2"]) else { return };
    let (control, ring, everything, token) = capture_a_job(&hosts, tcpdump, &[]);
    // The capture holds the job: the plugin shipped to w1 alone is larger.
    let plugin = std::fs::read(art::AUGMENT_WASM).unwrap();
    assert!(control.len() > plugin.len(), "{} bytes to and from the coordinator", control.len());
    assert!(ring.len() > 1 << 20, "{} bytes of ring traffic", ring.len());

    assert!(!contains(&everything, token.as_bytes()), "the teacher token crossed in clear");
    // The plugin's bytes as they are and as the control JSON's base64 (a
    // piece starting at a multiple of 3 bytes keeps its base64 form).
    let piece = &plugin[plugin.len() / 2 / 3 * 3..][..48];
    assert!(!contains(&everything, piece), "plugin bytes crossed in clear");
    let b64 = base64_of(piece);
    assert!(!contains(&everything, b64.as_bytes()), "plugin bytes crossed in clear, as base64");
    // Words every job's control messages hold (the job's description, the
    // welcome, a generation's rendezvous, each window of steps).
    for marker in ["allow_native", "\"welcome\"", "rendezvous_key", "\"steps\""] {
        assert!(!contains(&everything, marker.as_bytes()), "{marker:?} crossed in clear");
    }
    // What the channels carry looks like random bytes, gradients included
    // (the control channel's many small frames have 2-byte lengths of
    // mostly zero high bytes: a little further from uniform, but nowhere
    // near text, which is millions).
    for (what, bytes, most) in [("control", &control, 5_000.0), ("ring", &ring, 600.0)] {
        let x2 = chi_square(bytes);
        assert!(x2 < most, "{what}: chi-square {x2:.0} over {} bytes: not uniform", bytes.len());
    }

    // Asked to, the ring sends its data in clear (authenticated only): the
    // check above sees it; the control channel stays sealed.
    let (control, ring, _, _) = capture_a_job(&hosts, tcpdump, &["--gradients-in-clear"]);
    assert!(chi_square(&control) < 5_000.0);
    let x2 = chi_square(&ring);
    assert!(x2 > 10_000.0, "the ring in clear: chi-square {x2:.0} over {} bytes", ring.len());
}

/// Runs a job of two workers (w1, w2) with a teacher token and a reader
/// transform, `extra` added to its command line, while tcpdump captures on
/// w1; returns the TCP payloads between w1 and the coordinator, between w1
/// and w2 (the ring), all of them, and the token.
fn capture_a_job(hosts: &Hosts, tcpdump: &str, extra: &[&str]) -> (Vec<u8>, Vec<u8>, Vec<u8>, &'static str) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let coord = hosts.ip("coord");
    let token = "edl-test-bearer-token-7f3a9c";
    std::fs::write(d.join("token"), token).unwrap();

    // Everything w1 sends and receives: its control connection, the
    // rendezvous and store, and its ring links to w2.
    let dump = Capture::start(hosts, "w1", tcpdump, d);

    let secret = d.join("job.secret");
    let template = format!("ip netns exec {}-{{host}} {{program}}", hosts.prefix);
    let cmd = job(d, &["--teachers", "0", "--no-distill"]);
    let mut coordinator = hosts.on("coord", cmd.get_program().to_str().unwrap());
    coordinator.args(cmd.get_args()).current_dir(d);
    coordinator.arg("--teacher-token-file").arg(d.join("token"));
    coordinator.args(["--transform", art::AUGMENT_WASM, "--plugin-deadline-ms", "30000"]);
    coordinator.args(["--scaler", "command", "--worker-command", &template, "--hosts", "w1:1,w2:1"]);
    coordinator.args(["--listen", &format!("{coord}:7070"), "--min-workers", "2", "--max-workers", "2"]);
    coordinator.args(["--epochs", "2", "--secret-file"]).arg(&secret).args(extra);
    coordinator.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = coordinator.spawn().unwrap();
    let rx = lines(&mut child);
    let mut seen = Vec::new();
    let status = finish(child, rx, &mut seen);
    assert!(status.success(), "{}", seen.join("\n"));
    assert_eq!(report(d)["final_world_size"], 2);

    let flows = dump.stop();
    let (w1, w2) = (hosts.ip("w1"), hosts.ip("w2"));
    let between = |a: &str, b: &str| -> Vec<u8> {
        let mut all = Vec::new();
        for ((from, to), bytes) in &flows {
            let (f, t) = (from.split(':').next().unwrap(), to.split(':').next().unwrap());
            if (f == a && t == b) || (f == b && t == a) {
                all.extend_from_slice(bytes);
            }
        }
        all
    };
    let control = between(&w1, &coord);
    let ring = between(&w1, &w2);
    let everything: Vec<u8> = flows.values().flatten().copied().collect();

    (control, ring, everything, token)
}

/// Standard base64 (what the plugin's bytes travel as in JSON).
fn base64_of(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}
