//! Adversarial plugins and broken files: each gives its clear error; the host
//! neither crashes nor hangs, and keeps serving the next call.

use crate::support::{host, host_with, pairs, path, view};
use edl_plugin_artifacts as art;
use edl_plugin_sdk::Action;
use edl_runtime::plugin::{Error, Limits, World};
use std::time::{Duration, Instant};

#[test]
fn an_infinite_loop_hits_the_deadline_and_the_next_call_works() {
    let limits = Limits { deadline: Duration::from_millis(50), ..Limits::default() };
    let (host, _d) = host_with(limits);
    let mut p = host.load_policy(path(art::SPIN_WASM), &[]).unwrap();
    let start = Instant::now();
    let err = p.decide(&view(0)).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5), "deadline not enforced: {:?}", start.elapsed());
    assert!(matches!(err, Error::Deadline { deadline_ms: 50, call: "decide", .. }), "{err}");
    assert!(err.to_string().contains("spin.wasm"), "{err}");
    assert_eq!(p.decide(&view(1)).unwrap(), vec![Action::Hold]);
    // And again: the rebuilt instance is as guarded as the first.
    assert!(matches!(p.decide(&view(2)), Err(Error::Deadline { .. })));
}

#[test]
fn a_memory_bomb_hits_the_limit_and_the_next_call_works() {
    // The memory limit is what is checked: a deadline a loaded machine cannot reach first.
    let limits =
        Limits { memory_bytes: 16 << 20, deadline: std::time::Duration::from_secs(30), ..Limits::default() };
    let (host, _d) = host_with(limits);
    let mut p = host.load_policy(path(art::MEMBOMB_WASM), &[]).unwrap();
    let err = p.decide(&view(1)).unwrap_err();
    assert!(matches!(err, Error::MemoryLimit { limit_mib: 16, .. }), "{err}");
    assert!(err.to_string().contains("membomb.wasm"), "{err}");
    assert_eq!(p.decide(&view(2)).unwrap(), vec![Action::Hold]);
}

#[test]
fn a_panic_surfaces_its_message_and_the_instance_is_rebuilt() {
    let (host, _d) = host();
    let mut p = host.load_policy(path(art::PANICKY_WASM), &[]).unwrap();
    assert_eq!(p.decide(&view(1)).unwrap(), vec![Action::ScaleOut(1)]);
    assert_eq!(p.decide(&view(2)).unwrap(), vec![Action::ScaleOut(2)]);
    let err = p.decide(&view(13)).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::Trap { .. }), "{text}");
    assert!(text.contains("unlucky step 13"), "{text}");
    assert!(text.contains("about to fail on step 13"), "{text}");
    // A fresh instance: its call counter starts again.
    assert_eq!(p.decide(&view(3)).unwrap(), vec![Action::ScaleOut(1)]);
    rebuilt_with_the_memory_last_saved(p.as_mut());
}

/// `p` (the panicky policy, having counted one call) saved at its second
/// call, counts a third, traps: the instance made again goes on from the
/// second (what it counted since the save is lost, the rest is back).
fn rebuilt_with_the_memory_last_saved(p: &mut dyn edl_runtime::plugin::PolicyPlugin) {
    assert_eq!(p.decide(&view(4)).unwrap(), vec![Action::ScaleOut(2)]);
    assert_eq!(p.save_state().unwrap(), Some(2u32.to_le_bytes().to_vec()));
    assert_eq!(p.decide(&view(5)).unwrap(), vec![Action::ScaleOut(3)]);
    assert!(p.decide(&view(13)).is_err());
    assert_eq!(p.decide(&view(6)).unwrap(), vec![Action::ScaleOut(3)]);
    // Memory given from outside (a resume) is what a rebuild goes back to too.
    assert!(p.load_state(&7u32.to_le_bytes()).unwrap());
    assert!(p.decide(&view(13)).is_err());
    assert_eq!(p.decide(&view(7)).unwrap(), vec![Action::ScaleOut(8)]);
    // An instance that traps on the memory it was given back, before any
    // call of its own went through, is not given it again: the next one
    // starts from `init`, not trap after trap.
    assert!(p.decide(&view(13)).is_err());
    assert!(p.decide(&view(13)).is_err(), "the rebuilt instance, given its memory, traps too");
    assert_eq!(p.decide(&view(8)).unwrap(), vec![Action::ScaleOut(1)]);
}

#[test]
fn a_native_panic_is_caught_and_the_instance_recreated() {
    let (host, _d) = host();
    let mut p = host.load_policy(path(art::PANICKY_SO), &[]).unwrap();
    assert_eq!(p.decide(&view(1)).unwrap(), vec![Action::ScaleOut(1)]);
    let err = p.decide(&view(13)).unwrap_err();
    assert!(
        matches!(&err, Error::NativePanic { message, .. } if message.contains("unlucky step 13")),
        "{err}"
    );
    assert_eq!(p.decide(&view(2)).unwrap(), vec![Action::ScaleOut(1)]);
    rebuilt_with_the_memory_last_saved(p.as_mut());
}

#[test]
fn a_component_of_another_world_is_named() {
    let (host, _d) = host();
    let err = host.load_policy(path(art::AUGMENT_WASM), &[]).err().unwrap();
    assert!(
        matches!(
            err,
            Error::WrongWorld { found: World::ReaderTransform, expected: World::ScalingPolicy, .. }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains("reader-transform") && text.contains("scaling-policy"), "{text}");
    let err = host.load_adapter(path(art::AUTOSCALE_SO), &[]).err().unwrap();
    assert!(matches!(err, Error::WrongWorld { found: World::ScalingPolicy, .. }), "{err}");
}

#[test]
fn broken_files_give_typed_errors() {
    let (host, _d) = host();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let component = std::fs::read(art::AUTOSCALE_WASM).unwrap();

    let core = write("core.wasm", b"\0asm\x01\0\0\0");
    assert!(matches!(host.load_policy(&core, &[]), Err(Error::CoreModule { .. })));

    let truncated = write("truncated.wasm", &component[..component.len() / 2]);
    let err = host.load_policy(&truncated, &[]).err().unwrap();
    assert!(matches!(err, Error::InvalidComponent { .. }), "{err}");
    assert!(err.to_string().contains("truncated.wasm"));

    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let noise: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let random = write("random.bin", &noise);
    assert!(matches!(host.load_policy(&random, &[]), Err(Error::NotAPlugin { .. })));

    let mut framed = component[..8].to_vec();
    framed.extend_from_slice(&noise);
    let garbage = write("garbage.wasm", &framed);
    assert!(matches!(host.load_policy(&garbage, &[]), Err(Error::InvalidComponent { .. })));

    let empty = write("empty.wasm", b"");
    assert!(matches!(host.load_policy(&empty, &[]), Err(Error::NotAPlugin { .. })));

    let missing = dir.path().join("missing.wasm");
    let err = host.load_policy(&missing, &[]).err().unwrap();
    assert!(matches!(err, Error::Read { .. }) && err.to_string().contains("missing.wasm"), "{err}");

    let not_a_plugin_so = write("libnot.so", b"\x7fELF\x02\x01\x01\0garbage");
    assert!(matches!(host.load_policy(&not_a_plugin_so, &[]), Err(Error::NotAPlugin { .. })));
}

#[test]
fn a_component_of_another_interface_version_is_refused() {
    let (host, _d) = host();
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(art::SCHEDULE_WASM).unwrap();
    let (from, to) = (b"edl:plugins/policy@0.1.0", b"edl:plugins/policy@1.0.0");
    let mut patched = 0;
    let mut i = 0;
    while i + from.len() <= bytes.len() {
        if &bytes[i..i + from.len()] == from {
            bytes[i..i + from.len()].copy_from_slice(to);
            patched += 1;
        }
        i += 1;
    }
    assert!(patched > 0);
    let file = dir.path().join("future.wasm");
    std::fs::write(&file, &bytes).unwrap();
    let err = host.load_policy(&file, &[]).err().unwrap();
    assert!(matches!(&err, Error::IncompatibleVersion { found, .. } if found == "1.0.0"), "{err}");
    assert!(err.to_string().contains("edl:plugins@0.1.0"), "{err}");
}

#[test]
fn init_rejecting_the_config_is_an_init_error() {
    let (host, _d) = host();
    for file in [art::AUTOSCALE_WASM, art::AUTOSCALE_SO] {
        let err = host.load_policy(path(file), &pairs(&[("window", "0")])).err().unwrap();
        assert!(matches!(&err, Error::Init { error, .. } if error.to_string().contains("window")), "{err}");
        let err = host.load_policy(path(file), &pairs(&[("no-such-key", "1")])).err().unwrap();
        assert!(err.to_string().contains("no-such-key"), "{err}");
    }
}

#[test]
fn a_guest_error_is_not_a_trap() {
    let (host, _d) = host();
    let mut t = host.load_transform(path(art::AUGMENT_WASM), &[]).unwrap();
    let bad = edl_plugin_sdk::Batch { data: vec![0; 10], shape: vec![1, 10], ..Default::default() };
    let err = t.apply(&bad).unwrap_err();
    assert!(matches!(err, Error::Guest { call: "apply", .. }), "{err}");
    assert!(!err.is_trap());
}
