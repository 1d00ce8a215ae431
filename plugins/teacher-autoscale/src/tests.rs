use super::*;
use edl_plugin_sdk::testing::{self, SimTeacherPool, teacher_view};

fn policy(config: &[(&str, &str)]) -> TeacherAutoscale {
    testing::teacher_policy::<TeacherAutoscale>(config).unwrap()
}

fn plan(teachers: u32, in_flight_per_teacher: u32) -> TeacherPlan {
    TeacherPlan { teachers, in_flight_per_teacher }
}

#[test]
fn grows_in_proportion_to_the_wait_while_teachers_are_busy() {
    let mut p = policy(&[]);
    // 50% of the step spent waiting on 4 busy teachers: 6.
    let v = teacher_view(4, 1, 16).wait_share(0.5).utilisation(0.9).build();
    assert_eq!(p.decide(&v), plan(6, 4));
    // A small wait still adds one.
    let v = teacher_view(4, 1, 16).wait_share(0.06).utilisation(0.9).build();
    assert_eq!(p.decide(&v), plan(5, 4));
    // At or below `grow-wait`: no growth.
    let v = teacher_view(4, 1, 16).wait_share(0.05).utilisation(0.9).build();
    assert_eq!(p.decide(&v), plan(4, 4));
}

#[test]
fn growth_stops_at_the_maximum() {
    let mut p = policy(&[]);
    let v = teacher_view(4, 1, 5).wait_share(0.9).utilisation(1.0).build();
    assert_eq!(p.decide(&v).teachers, 5);
    let v = teacher_view(5, 1, 5).wait_share(0.9).utilisation(1.0).build();
    assert_eq!(p.decide(&v).teachers, 5);
}

#[test]
fn a_latency_bound_pool_gets_more_requests_in_flight_not_more_teachers() {
    let mut p = policy(&[]);
    let v = teacher_view(2, 1, 8).wait_share(0.3).utilisation(0.2).in_flight(2).build();
    assert_eq!(p.decide(&v), plan(2, 4));
    let v = teacher_view(2, 1, 8).wait_share(0.3).utilisation(0.2).in_flight(12).build();
    assert_eq!(p.decide(&v), plan(2, 16));
    let v = teacher_view(2, 1, 8).wait_share(0.3).utilisation(0.2).in_flight(16).build();
    assert_eq!(p.decide(&v), plan(2, 16));
    // Asked for more than 16 by someone else: kept, not lowered.
    let v = teacher_view(2, 1, 8).wait_share(0.3).utilisation(0.2).in_flight(32).build();
    assert_eq!(p.decide(&v), plan(2, 32));
}

#[test]
fn the_pool_grows_ahead_of_a_planned_student_scale_out() {
    let mut p = policy(&[]);
    // 4 students now, 6 planned: 3 teachers become ceil(3 x 6 / 4) = 5,
    // before anyone waits.
    let v = teacher_view(3, 1, 16).students(4, 6).build();
    assert_eq!(p.decide(&v), plan(5, 4));
    let v = teacher_view(2, 1, 16).students(4, 8).build();
    assert_eq!(policy(&[]).decide(&v).teachers, 4);
    // A planned scale-in changes nothing by itself.
    let v = teacher_view(3, 1, 16).students(4, 2).build();
    assert_eq!(policy(&[]).decide(&v).teachers, 3);
    // Ahead and waiting on busy teachers: the larger of the two.
    let v = teacher_view(4, 1, 16).students(4, 5).wait_share(0.5).utilisation(0.9).build();
    assert_eq!(p.decide(&v).teachers, 6);
}

#[test]
fn students_that_joined_unseen_are_grown_for_once_in_proportion() {
    let mut p = policy(&[]);
    // Sized for 2 students; the next decision sees 4, never told they were planned.
    assert_eq!(p.decide(&teacher_view(2, 1, 16).students(2, 2).build()).teachers, 2);
    assert_eq!(p.decide(&teacher_view(2, 1, 16).students(4, 4).build()).teachers, 4);
    // Once: the pool is sized for 4 now.
    assert_eq!(p.decide(&teacher_view(4, 1, 16).students(4, 4).build()).teachers, 4);
    // Grown ahead of a planned scale-out, the join itself adds nothing more.
    assert_eq!(p.decide(&teacher_view(4, 1, 16).students(4, 6).build()).teachers, 6);
    assert_eq!(p.decide(&teacher_view(6, 1, 16).students(6, 6).build()).teachers, 6);
    // Students that leave and come back are not grown for: 6 -> 3 -> 6 -> 3 -> 6 keeps 6.
    for world in [3, 6, 3, 6] {
        assert_eq!(p.decide(&teacher_view(6, 1, 16).students(world, world).build()).teachers, 6);
    }
    // Nor when their return is planned: 6 teachers for 6 students, 3 left, 5 planned.
    let mut q = policy(&[]);
    assert_eq!(q.decide(&teacher_view(6, 1, 16).students(6, 6).build()).teachers, 6);
    assert_eq!(q.decide(&teacher_view(6, 1, 16).students(3, 3).build()).teachers, 6);
    assert_eq!(q.decide(&teacher_view(6, 1, 16).students(3, 5).build()).teachers, 6);
    // Planned beyond it: grown for what is beyond, 6 x 8 / 6.
    assert_eq!(q.decide(&teacher_view(6, 1, 16).students(3, 8).build()).teachers, 8);
    // Once the pool has shrunk for fewer students, their return is grown for.
    let mut s = policy(&[("settle-secs", "0"), ("shrink-after", "1")]);
    assert_eq!(s.decide(&teacher_view(4, 1, 16).students(4, 4).build()).teachers, 4);
    let idle = teacher_view(4, 1, 16).students(2, 2).utilisation(0.1).build();
    assert_eq!(s.decide(&idle).teachers, 3);
    assert_eq!(s.decide(&teacher_view(3, 1, 16).students(4, 4).build()).teachers, 6);
    // What it was sized for is part of its memory.
    let mut q = policy(&[]);
    q.load_state(&p.save_state()).unwrap();
    assert_eq!(q.decide(&teacher_view(6, 1, 16).students(6, 6).build()).teachers, 6);
    // A memory from before the field existed reads as none yet.
    let mut old = policy(&[]);
    old.load_state(br#"{"idle_streak":1}"#).unwrap();
    assert_eq!(old.decide(&teacher_view(2, 1, 16).students(8, 8).build()).teachers, 2);
}

#[test]
fn an_idle_pool_shrinks_by_one_after_the_streak_and_the_settling_time() {
    let mut p = policy(&[]);
    let idle = teacher_view(4, 1, 8).utilisation(0.1).secs_since_change(60.0).build();
    assert_eq!(p.decide(&idle).teachers, 4);
    assert_eq!(p.decide(&idle).teachers, 4);
    assert_eq!(p.decide(&idle).teachers, 3, "third idle decision in a row");
    // The streak starts again after a shrink.
    let idle3 = teacher_view(3, 1, 8).utilisation(0.1).secs_since_change(60.0).build();
    assert_eq!(p.decide(&idle3).teachers, 3);
    assert_eq!(p.decide(&idle3).teachers, 3);
    assert_eq!(p.decide(&idle3).teachers, 2);
}

#[test]
fn no_shrink_within_the_settling_time() {
    let mut p = policy(&[("settle-secs", "30")]);
    let fresh = teacher_view(4, 1, 8).utilisation(0.1).secs_since_change(5.0).build();
    for _ in 0..10 {
        assert_eq!(p.decide(&fresh).teachers, 4);
    }
    // The streak was counted meanwhile: once settled, it shrinks at once.
    let settled = teacher_view(4, 1, 8).utilisation(0.1).secs_since_change(30.0).build();
    assert_eq!(p.decide(&settled).teachers, 3);
}

#[test]
fn alternating_views_do_not_make_the_pool_flap() {
    let mut p = policy(&[]);
    let idle = teacher_view(4, 1, 8).utilisation(0.1).secs_since_change(600.0).build();
    let middling = teacher_view(4, 1, 8).utilisation(0.4).secs_since_change(600.0).build();
    let waiting = teacher_view(4, 1, 8).utilisation(0.1).wait_share(0.2).secs_since_change(600.0).build();
    for round in 0..20 {
        let other = if round % 2 == 0 { &middling } else { &waiting };
        assert_eq!(p.decide(&idle).teachers, 4, "round {round}");
        assert_eq!(p.decide(&idle).teachers, 4, "round {round}");
        assert_eq!(p.decide(other).teachers, 4, "round {round}");
    }
}

#[test]
fn never_below_the_minimum_nor_above_the_maximum() {
    let mut p = policy(&[("shrink-after", "1")]);
    let idle_at_min = teacher_view(2, 2, 8).utilisation(0.0).secs_since_change(600.0).build();
    for _ in 0..5 {
        assert_eq!(p.decide(&idle_at_min).teachers, 2);
    }
    // Below the minimum or above the maximum (bounds moved): brought back.
    assert_eq!(p.decide(&teacher_view(1, 3, 8).build()).teachers, 3);
    assert_eq!(p.decide(&teacher_view(9, 1, 6).build()).teachers, 6);
    let ahead = teacher_view(4, 1, 6).students(1, 64).build();
    assert_eq!(p.decide(&ahead).teachers, 6);
    // Bounds the wrong way round: the maximum wins.
    assert_eq!(p.decide(&teacher_view(4, 5, 3).build()).teachers, 3);
}

#[test]
fn an_unstarted_pool_starts_with_the_minimum_and_at_least_one() {
    let mut p = policy(&[]);
    let none = teacher_view(0, 0, 8).wait_share(1.0).build();
    assert_eq!(p.decide(&none).teachers, 1);
    let none = teacher_view(0, 3, 8).build();
    assert_eq!(p.decide(&none).teachers, 3);
    assert_eq!(p.decide(&teacher_view(0, 0, 8).in_flight(0).build()).in_flight_per_teacher, 1);
}

#[test]
fn the_idle_streak_survives_a_new_instance() {
    let mut first = policy(&[]);
    let idle = teacher_view(4, 1, 8).utilisation(0.1).secs_since_change(60.0).build();
    first.decide(&idle);
    first.decide(&idle);
    let mut second = policy(&[]);
    second.load_state(&first.save_state()).unwrap();
    let mut fresh = policy(&[]);
    assert_eq!(first.decide(&idle).teachers, 3);
    assert_eq!(second.decide(&idle).teachers, 3, "the memory went over");
    assert_eq!(fresh.decide(&idle).teachers, 4, "without it the count starts again");
    assert!(
        matches!(second.load_state(b"{"), Err(PluginError::InvalidInput(m)) if m.contains("teacher-autoscale"))
    );
}

#[test]
fn settles_a_simulated_pool_where_students_stop_waiting() {
    let mut p = policy(&[]);
    // Six students of 1000 rows/s, teachers of 2000 rows/s: 3 are enough.
    let mut pool = SimTeacherPool::new(6, 1, 1, 8);
    let history = pool.run(40, |v| p.decide(v));
    let sizes: Vec<u32> = history.iter().map(|r| r.teachers).collect();
    assert!(sizes[..5].contains(&3), "{sizes:?}");
    assert!(sizes[10..].iter().all(|&s| s == 3), "{sizes:?}");
    assert_eq!(pool.view().wait_share, 0.0);
    // Five students leave: the teachers idle at a sixth of their time. The
    // pool shrinks one teacher at a time to 2, where they work a quarter of
    // it (not idle), and no further.
    pool.set_students(1, 1);
    let sizes: Vec<u32> = pool.run(60, |v| p.decide(v)).iter().map(|r| r.teachers).collect();
    assert_eq!(sizes.last(), Some(&2), "{sizes:?}");
    assert!(sizes.windows(2).all(|w| w[1] <= w[0]), "no flapping: {sizes:?}");
}

#[test]
fn the_configuration_is_validated() {
    let p = policy(&[("grow-wait", "0.1"), ("busy", "0.8"), ("idle", "0.3"), ("settle-secs", "0")]);
    assert_eq!((p.grow_wait, p.busy, p.idle, p.settle_secs, p.shrink_after), (0.1, 0.8, 0.3, 0.0, 3));
    for (bad, key) in [
        (("grow-wait", "1"), "grow-wait"),
        (("grow-wait", "-0.1"), "grow-wait"),
        (("busy", "0"), "busy"),
        (("busy", "1.5"), "busy"),
        (("idle", "0.7"), "idle"),
        (("settle-secs", "-1"), "settle-secs"),
        (("settle-secs", "inf"), "settle-secs"),
        (("shrink-after", "0"), "shrink-after"),
        (("shrink-after", "x"), "shrink-after"),
        (("grow", "0.1"), "unknown key `grow`"),
    ] {
        match testing::teacher_policy::<TeacherAutoscale>(&[bad]) {
            Err(PluginError::InvalidConfig(m)) => assert!(m.contains(key), "{m:?} should name {key}"),
            other => panic!("{bad:?} was accepted: {other:?}"),
        }
    }
}

#[test]
fn teachers_whose_use_is_unknown_are_not_shrunk() {
    let mut p = policy(&[("shrink-after", "1"), ("settle-secs", "0")]);
    let mut view = TeacherView {
        teacher_count: 3,
        min_teachers: 1,
        max_teachers: 4,
        in_flight_per_teacher: 4,
        student_world_size: 1,
        student_world_planned: 1,
        secs_since_change: 100.0,
        ..Default::default()
    };
    for _ in 0..5 {
        assert_eq!(p.decide(&view).teachers, 3, "no statistics: no shrink");
    }
    view.teachers = vec![edl_plugin_sdk::TeacherStats { id: 0, utilisation: 0.01, ..Default::default() }];
    assert_eq!(p.decide(&view).teachers, 2, "idle teachers, known so: shrink");
}

#[test]
fn a_teacher_without_a_whole_window_yet_is_waited_for_before_growing_again() {
    let mut p = policy(&[]);
    // Three teachers, one just started (no statistics yet), students waiting
    // on the two that are busy: no growth, no more in flight.
    let mut v = teacher_view(3, 1, 8).wait_share(0.4).utilisation(0.95).build();
    v.teachers.truncate(2);
    assert_eq!(p.decide(&v), plan(3, 4));
    // A look later, all three have a window: busy and waited on, it grows.
    let v = teacher_view(3, 1, 8).wait_share(0.4).utilisation(0.95).build();
    assert_eq!(p.decide(&v).teachers, 5);
}
