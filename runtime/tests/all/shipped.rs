//! The shipped plugins' algorithms, run through the real hosts: the
//! sandboxed component and the native library give the same answers.

use crate::support::{host, pairs, path};
use edl_plugin_artifacts as art;
use edl_plugin_sdk::{
    Action, Batch, Dtype, Hyperparams, ResizeEvent, TeacherPlan,
    testing::{SimCluster, SimTeacherPool, standard_teacher_trace},
};
use edl_runtime::plugin::{Backend, PolicyPlugin};

fn run(policy: &mut dyn PolicyPlugin, sim: &mut SimCluster, rounds: usize) -> Vec<(u32, Vec<Action>)> {
    (0..rounds)
        .map(|_| {
            let view = sim.view();
            let actions = policy.decide(&view).unwrap();
            sim.apply(&actions);
            sim.advance();
            (sim.world_size(), actions)
        })
        .collect()
}

#[test]
fn autoscale_settles_at_four_on_a_curve_that_saturates_at_four() {
    let (host, _d) = host();
    for file in [art::AUTOSCALE_WASM, art::AUTOSCALE_SO] {
        let mut p = host.load_policy(path(file), &[]).unwrap();
        let mut sim = SimCluster::saturating(4, 1, 8);
        let history = run(p.as_mut(), &mut sim, 80);
        let sizes: Vec<u32> = history.iter().map(|h| h.0).collect();
        assert_eq!(sizes.iter().max(), Some(&5), "{file}: {sizes:?}");
        assert!(sizes[60..].iter().all(|&s| s == 4), "{file}: {sizes:?}");
    }
}

#[test]
fn autoscale_replaces_a_worker_at_half_speed() {
    let (host, _d) = host();
    for file in [art::AUTOSCALE_WASM, art::AUTOSCALE_SO] {
        let mut p = host.load_policy(path(file), &[]).unwrap();
        let mut sim = SimCluster::saturating(8, 4, 4);
        sim.set_speed(1, 0.5);
        let slow = sim.worker_ids()[1];
        let replaced: Vec<Action> = run(p.as_mut(), &mut sim, 12)
            .into_iter()
            .flat_map(|h| h.1)
            .filter(|a| matches!(a, Action::Replace(_)))
            .collect();
        assert_eq!(replaced, vec![Action::Replace(slow)], "{file}");
    }
}

#[test]
fn schedule_steps_by_n_every_k_steps() {
    let (host, _d) = host();
    for file in [art::SCHEDULE_WASM, art::SCHEDULE_SO] {
        let mut p = host.load_policy(path(file), &pairs(&[("every", "40"), ("by", "2")])).unwrap();
        let mut sim = SimCluster::saturating(8, 1, 6);
        let sizes: Vec<u32> = run(p.as_mut(), &mut sim, 14).iter().map(|h| h.0).collect();
        assert_eq!(sizes, vec![1, 1, 3, 3, 5, 5, 6, 6, 4, 4, 2, 2, 1, 1], "{file}");
    }
}

#[test]
fn schedule_sizes_the_servers_sandboxed_or_native_and_autoscale_leaves_them_be() {
    let (host, _d) = host();
    let view = |step| edl_plugin_sdk::ServerView {
        step,
        servers: vec![edl_plugin_sdk::ServerStats { id: 1, rows: 10, ..Default::default() }; 2],
        min_servers: 1,
        max_servers: 4,
        replicas: 1,
        secs_since_change: 1.0,
    };
    for file in [art::SCHEDULE_WASM, art::SCHEDULE_SO] {
        let mut p = host.load_policy(path(file), &pairs(&[("servers", "100:3,200:2")])).unwrap();
        let asked: Vec<Option<u32>> =
            [50, 100, 150, 250].iter().map(|&s| p.decide_servers(&view(s)).unwrap()).collect();
        assert_eq!(asked, [None, Some(3), Some(3), Some(2)], "{file}");
    }
    for file in [art::AUTOSCALE_WASM, art::AUTOSCALE_SO] {
        let mut p = host.load_policy(path(file), &[]).unwrap();
        assert_eq!(p.decide_servers(&view(500)).unwrap(), None, "{file}");
    }
}

#[test]
fn the_spares_are_sized_by_schedule_or_by_autoscale_s_price_rule_sandboxed_or_native() {
    let (host, _d) = host();
    let view = |step, ready_secs| edl_plugin_sdk::SpareView {
        step,
        world_size: 4,
        min_workers: 4,
        max_workers: 6,
        price_per_spare_hour: 2.0,
        ready_secs,
        hours: 1.0,
        ..Default::default()
    };
    for file in [art::SCHEDULE_WASM, art::SCHEDULE_SO] {
        let mut p = host.load_policy(path(file), &pairs(&[("spares", "10:2,20:0")])).unwrap();
        let asked: Vec<Option<u32>> =
            [5, 10, 19, 20].iter().map(|&s| p.decide_spares(&view(s, 1.0)).unwrap()).collect();
        assert_eq!(asked, [None, Some(2), Some(2), Some(0)], "{file}");
    }
    for file in [art::AUTOSCALE_WASM, art::AUTOSCALE_SO] {
        let mut off = host.load_policy(path(file), &[]).unwrap();
        assert_eq!(off.decide_spares(&view(5, 30.0)).unwrap(), None, "{file}: off unless configured");
        // At its minimum a loss stops the job (worth 1e6 an hour): one a
        // day, at 30 s to ready, saves ~347 an hour; one a year ~0.95.
        let mut daily = host.load_policy(path(file), &pairs(&[("spare-losses-per-hour", "0.0417")])).unwrap();
        assert_eq!(daily.decide_spares(&view(5, 30.0)).unwrap(), Some(1), "{file}");
        let mut yearly =
            host.load_policy(path(file), &pairs(&[("spare-losses-per-hour", "0.000114")])).unwrap();
        assert_eq!(yearly.decide_spares(&view(5, 30.0)).unwrap(), Some(0), "{file}");
    }
}

#[test]
fn dynamic_batch_ramps_lr_when_going_from_two_to_four_workers() {
    let (host, _d) = host();
    for file in [art::DYNAMIC_BATCH_WASM, art::DYNAMIC_BATCH_SO] {
        let mut a = host.load_adapter(path(file), &[]).unwrap();
        let start = Hyperparams { global_batch: 128, local_batch: 64, lr: 0.1, momentum: 0.9 };
        let mut hp = start;
        let mut lrs = Vec::new();
        for step in 96..112u64 {
            if step == 100 {
                let ev = ResizeEvent { step, old_world_size: 2, new_world_size: 4 };
                hp = a.on_resize(&ev, &hp).unwrap();
                assert_eq!((hp.global_batch, hp.local_batch), (256, 64));
            }
            hp = a.on_step(step, &hp).unwrap();
            lrs.push(hp.lr);
        }
        // Four steps at 0.1, then gamma_t = 1 + t/8 over eight steps, then 0.2.
        let want: Vec<f32> = (96..112u64)
            .map(|s| if s < 100 { 0.1 } else { 0.1 * (1.0 + (s - 100).min(8) as f32 / 8.0) })
            .collect();
        for (g, w) in lrs.iter().zip(&want) {
            assert!((g - w).abs() < 1e-6, "{file}: {lrs:?} vs {want:?}");
        }
        assert!((lrs[4 + 8] - 0.2).abs() < 1e-6);
    }
}

#[test]
fn teacher_autoscale_decides_alike_in_the_sandbox_and_natively() {
    let (host, _d) = host();
    let mut runs = Vec::new();
    for file in [art::TEACHER_AUTOSCALE_WASM, art::TEACHER_AUTOSCALE_SO] {
        let mut p = host.load_teacher_policy(path(file), &[]).unwrap();
        // Six students need three teachers.
        let mut pool = SimTeacherPool::new(6, 1, 1, 8);
        let sizes: Vec<u32> = pool.run(20, |v| p.decide(v).unwrap()).iter().map(|r| r.teachers).collect();
        assert_eq!(sizes[..3], [2, 3, 3], "{file}: {sizes:?}");
        assert!(sizes.iter().skip(2).all(|&s| s == 3), "{file}: {sizes:?}");
        let plans: Vec<TeacherPlan> = standard_teacher_trace().iter().map(|v| p.decide(v).unwrap()).collect();
        // Its memory goes over to a new instance, whichever way it was built.
        let saved = p.save_state().unwrap().expect("teacher-autoscale keeps a memory");
        let mut q = host.load_teacher_policy(path(file), &[]).unwrap();
        assert!(q.load_state(&saved).unwrap());
        runs.push((plans, saved));
    }
    assert_eq!(runs[0], runs[1], "the component and the library answer alike");
}

#[test]
fn a_teacher_plan_out_of_bounds_is_clamped_by_the_host() {
    let (host, _d) = host();
    for file in [art::TEACHER_AUTOSCALE_WASM, art::TEACHER_AUTOSCALE_SO] {
        let mut p = host.load_teacher_policy(path(file), &[]).unwrap();
        // Planned students far past the pool's maximum: the answer stops at it.
        let mut view = SimTeacherPool::new(2, 2, 1, 3).view();
        view.student_world_planned = 40;
        assert_eq!(p.decide(&view).unwrap().teachers, 3, "{file}");
        // The policy keeps the in-flight count it is shown (100, no student
        // waits); the host brings it within 1..=64.
        view.in_flight_per_teacher = 100;
        assert_eq!(p.decide(&view).unwrap().in_flight_per_teacher, 64, "{file}");
    }
    // A wrong world is refused by name.
    let e = host.load_policy(path(art::TEACHER_AUTOSCALE_WASM), &[]).err().unwrap().to_string();
    assert!(e.contains("teacher-pool-policy"), "{e}");
}

fn mnist_like_batch(n: usize, seed: u64) -> Batch {
    let mut x = seed | 1;
    let data = (0..n * 784)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect();
    Batch {
        data,
        shape: vec![n as u32, 28, 28],
        dtype: Dtype::Uint8,
        labels: (0..n as u32).map(|i| i % 10).collect(),
        ids: (0..n as u64).map(|i| 1000 + i).collect(),
        seed,
    }
}

#[test]
fn augment_gives_the_same_pixels_in_the_sandbox_and_natively() {
    let (host, _d) = host();
    let input = mnist_like_batch(64, 7);
    let mut wasm = host.load_transform(path(art::AUGMENT_WASM), &[]).unwrap();
    let mut native = host.load_transform(path(art::AUGMENT_SO), &[]).unwrap();
    assert!(matches!(wasm.backend(), Backend::Wasm { .. }));
    assert_eq!(native.backend(), Backend::Native);
    let a = wasm.apply(&input).unwrap();
    let b = native.apply(&input).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.dtype, Dtype::Float32);
    assert_eq!(a.shape, input.shape);
    assert_eq!((a.labels.clone(), a.ids.clone()), (input.labels.clone(), input.ids.clone()));
    assert_eq!(a.data.len(), input.data.len() * 4);
    // Normalised MNIST pixels: (0 - 0.1307) / 0.3081 is the smallest value.
    let px = a.to_f32().unwrap();
    let min = px.iter().cloned().fold(f32::INFINITY, f32::min);
    assert!((min + 0.1307 / 0.3081).abs() < 1e-5, "{min}");
    // Different seeds shift differently.
    let mut other = input.clone();
    other.seed = 8;
    assert_ne!(wasm.apply(&other).unwrap().data, a.data);
}

#[test]
fn info_comes_from_the_plugin_crate() {
    let (host, _d) = host();
    for (name, wasm, so) in art::SHIPPED {
        // Inspecting a native library runs none of its code, so its info is
        // read by loading it (the test host allows native plugins).
        let from_wasm = host.inspect(path(wasm)).unwrap().info;
        let from_so = host.load(path(so), &[], None).unwrap().info().clone();
        for (file, info) in [(wasm, from_wasm), (so, from_so)] {
            assert_eq!(info.name, format!("edl-plugin-{name}"), "{file}");
            assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
            assert!(!info.description.is_empty());
        }
    }
}
