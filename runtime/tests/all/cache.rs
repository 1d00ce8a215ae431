//! The precompiled-artifact cache.

use crate::support::{host, path};
use edl_plugin_artifacts as art;
use edl_runtime::plugin::{ArtifactCache, Backend, CacheStatus, HostOptions, PluginHost};

#[test]
fn the_second_load_does_not_compile() {
    let (host, dir) = host();
    let first = host.load_policy(path(art::AUTOSCALE_WASM), &[]).unwrap();
    assert_eq!(first.backend(), Backend::Wasm { cache: CacheStatus::Miss });
    let second = host.load_policy(path(art::AUTOSCALE_WASM), &[]).unwrap();
    assert_eq!(second.backend(), Backend::Wasm { cache: CacheStatus::Hit });
    // A second host (another process, in effect) finds it too.
    let other =
        PluginHost::new(HostOptions { cache: ArtifactCache::at(dir.path()), ..Default::default() }).unwrap();
    let third = other.load_policy(path(art::AUTOSCALE_WASM), &[]).unwrap();
    assert_eq!(third.backend(), Backend::Wasm { cache: CacheStatus::Hit });
}

#[test]
fn a_corrupt_cache_entry_is_recompiled() {
    let (host, _dir) = host();
    let bytes = std::fs::read(art::SCHEDULE_WASM).unwrap();
    host.load_policy(path(art::SCHEDULE_WASM), &[]).unwrap();
    let entry = host.cache_entry(&bytes).expect("cache enabled");
    std::fs::write(&entry, b"not a compiled component").unwrap();
    let p = host.load_policy(path(art::SCHEDULE_WASM), &[]).unwrap();
    assert_eq!(p.backend(), Backend::Wasm { cache: CacheStatus::Miss });
    let p = host.load_policy(path(art::SCHEDULE_WASM), &[]).unwrap();
    assert_eq!(p.backend(), Backend::Wasm { cache: CacheStatus::Hit });
}

#[test]
fn a_disabled_cache_always_compiles() {
    let host =
        PluginHost::new(HostOptions { cache: ArtifactCache::disabled(), ..Default::default() }).unwrap();
    let p = host.load_policy(path(art::SCHEDULE_WASM), &[]).unwrap();
    assert_eq!(p.backend(), Backend::Wasm { cache: CacheStatus::Disabled });
}
