//! Hot reload: a changed file is used at the next call; a broken one is not.

use crate::{host, pairs};
use edl_plugin_artifacts as art;
use edl_plugin_sdk::{Action, ClusterView};
use edl_runtime::plugin::{Plugin, PolicyPlugin, Reloading};
use std::time::Duration;

fn replace_file(from: &str, to: &std::path::Path) {
    // Write next to the target and rename, as a deployment would.
    let tmp = to.with_extension("tmp");
    std::fs::copy(from, &tmp).unwrap();
    std::fs::rename(&tmp, to).unwrap();
}

#[test]
fn a_new_version_is_used_at_the_next_call_and_a_broken_one_is_not() {
    let (host, _d) = host();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.wasm");
    std::fs::copy(art::SCHEDULE_WASM, &file).unwrap();
    let mut p = Reloading::policy(host, &file, &pairs(&[])).unwrap().with_poll_interval(Duration::ZERO);
    let view = ClusterView {
        step: 0,
        world_size: 1,
        min_workers: 1,
        max_workers: 4,
        free_slots: 3,
        ..Default::default()
    };
    assert_eq!(p.info().name, "edl-plugin-schedule");
    assert_eq!(p.decide(&view).unwrap(), vec![Action::Hold]);

    replace_file(art::PANICKY_WASM, &file);
    assert_eq!(p.decide(&view).unwrap(), vec![Action::ScaleOut(1)]);
    assert_eq!(p.info().name, "edl-test-plugin-panicky");
    assert_eq!(p.reloads(), 1);

    // A truncated upload: the running version stays, the reason is kept.
    let bytes = std::fs::read(art::SCHEDULE_WASM).unwrap();
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, &bytes[..bytes.len() / 3]).unwrap();
    std::fs::rename(&tmp, &file).unwrap();
    assert_eq!(p.decide(&view).unwrap(), vec![Action::ScaleOut(2)]);
    assert_eq!(p.reloads(), 1);
    assert!(p.last_error().unwrap().contains("policy.wasm"), "{:?}", p.last_error());

    // The wrong world is refused the same way.
    replace_file(art::AUGMENT_WASM, &file);
    assert_eq!(p.decide(&view).unwrap(), vec![Action::ScaleOut(3)]);
    assert!(p.last_error().unwrap().contains("reader-transform"));

    // A good file again is picked up.
    replace_file(art::SCHEDULE_WASM, &file);
    assert_eq!(p.decide(&view).unwrap(), vec![Action::Hold]);
    assert_eq!(p.reloads(), 2);
    assert!(p.last_error().is_none());
}
