//! Which teachers each student calls: a share of the pool weighted by
//! measured capacity, the discovery-side balancing of service distillation.
//!
//! The students are laid side by side on `[0, 1)`, each `1/S` wide; the
//! teachers are laid on the same line, each as wide as its share of the
//! pool's capacity. A student calls the teachers whose stretch overlaps its
//! own, each weighted by the overlap. So every teacher is some student's,
//! each teacher's load is its share of the capacity, and S students with T
//! teachers hold at most S + T - 1 connections (not S x T). Every student
//! computes its own share from the same inputs (the teachers registered,
//! the capacities the pool publishes, its rank and the world size), so no
//! one hands shares out.

/// The least part of a student's requests worth a teacher of its own.
const SLIVER: f64 = 0.05;

/// One teacher of a share: its address and the part of the student's
/// requests it takes (a student's weights sum to 1).
#[derive(Clone, Debug, PartialEq)]
pub struct Assigned {
    pub addr: String,
    pub weight: f64,
}

/// The teachers student `rank` of `world` calls, from `teachers`
/// (address, capacity in rows per second; a capacity unknown, zero or not
/// finite counts as the mean of those known, or 1 when none is). The
/// teachers are ordered by address, so every student orders them alike.
/// Empty when there is no teacher or `rank` is not below `world`.
pub fn share(rank: usize, world: usize, teachers: &[(String, f64)]) -> Vec<Assigned> {
    if teachers.is_empty() || rank >= world {
        return Vec::new();
    }
    let mut sorted: Vec<(String, f64)> = teachers.to_vec();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    sorted.dedup_by(|a, b| a.0 == b.0);
    let usable = |c: f64| c.is_finite() && c > 0.0;
    let known: Vec<f64> = sorted.iter().map(|t| t.1).filter(|&c| usable(c)).collect();
    let fill = if known.is_empty() { 1.0 } else { known.iter().sum::<f64>() / known.len() as f64 };
    let capacity: Vec<f64> = sorted.iter().map(|t| if usable(t.1) { t.1 } else { fill }).collect();
    let total: f64 = capacity.iter().sum();
    let (lo, hi) = (rank as f64 / world as f64, (rank + 1) as f64 / world as f64);
    let mut out = Vec::new();
    let mut at = 0.0;
    for ((addr, _), c) in sorted.iter().zip(&capacity) {
        let (start, end) = (at, at + c / total);
        at = end;
        let overlap = end.min(hi) - start.max(lo);
        // A sliver (under 5% of the student's share, and the smaller part
        // of the teacher's) is not worth a connection: the student's other
        // teachers take it. Every teacher keeps its larger part (or a whole
        // student's), so none is left without students.
        let width = end - start;
        if overlap > 0.0 && (overlap * world as f64 >= SLIVER || overlap >= 0.5 * width) {
            out.push(Assigned { addr: addr.clone(), weight: overlap * world as f64 });
        }
    }
    let sum: f64 = out.iter().map(|a| a.weight).sum();
    for a in &mut out {
        a.weight /= sum;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(caps: &[f64]) -> Vec<(String, f64)> {
        caps.iter().enumerate().map(|(i, &c)| (format!("t{i}"), c)).collect()
    }

    fn shares(world: usize, teachers: &[(String, f64)]) -> Vec<Vec<Assigned>> {
        (0..world).map(|r| share(r, world, teachers)).collect()
    }

    /// Each teacher's load: the students' weights on it, each student
    /// sending an equal part of the work.
    fn load(all: &[Vec<Assigned>], addr: &str) -> f64 {
        all.iter().flatten().filter(|a| a.addr == addr).map(|a| a.weight).sum::<f64>() / all.len() as f64
    }

    #[test]
    fn four_students_and_two_teachers_pair_off() {
        let all = shares(4, &pool(&[0.0, 0.0]));
        let names: Vec<Vec<&str>> = all.iter().map(|s| s.iter().map(|a| a.addr.as_str()).collect()).collect();
        assert_eq!(names, [["t0"], ["t0"], ["t1"], ["t1"]]);
        assert!(all.iter().flatten().all(|a| (a.weight - 1.0).abs() < 1e-9));
    }

    #[test]
    fn loads_follow_capacity_and_connections_stay_below_students_plus_teachers() {
        for (world, caps) in [
            (3, vec![100.0, 100.0]),
            (2, vec![100.0, 300.0, 50.0]),
            (7, vec![10.0, 20.0, 30.0, 40.0]),
            (1, vec![5.0, 5.0, 5.0]),
            (5, vec![1.0]),
            (16, vec![3.0, 1.0, 2.0, 2.0, 9.0]),
            (3, vec![1.0; 40]),
            (4, vec![50.5, 49.5]),
        ] {
            let teachers = pool(&caps);
            let all = shares(world, &teachers);
            let total: f64 = caps.iter().sum();
            for (name, c) in &teachers {
                // As the capacity says, but for slivers of 5% of a student's share.
                let l = load(&all, name);
                assert!(
                    (l - c / total).abs() <= 0.1 / world as f64,
                    "{name} of {caps:?} over {world}: load {l}"
                );
            }
            for s in &all {
                let sum: f64 = s.iter().map(|a| a.weight).sum();
                assert!((sum - 1.0).abs() < 1e-9 && !s.is_empty(), "{s:?}");
            }
            for (name, _) in &teachers {
                assert!(all.iter().flatten().any(|a| &a.addr == name), "{name} has no student: {all:?}");
            }
            let connections: usize = all.iter().map(Vec::len).sum();
            assert!(connections < world + caps.len(), "{connections} for {world} x {}", caps.len());
        }
    }

    #[test]
    fn unknown_capacities_count_as_the_mean_and_order_is_by_address() {
        // Given in any order, the same shares.
        let a = vec![("b".to_string(), 300.0), ("a".to_string(), f64::NAN), ("c".to_string(), 100.0)];
        let mut b = a.clone();
        b.reverse();
        for r in 0..3 {
            assert_eq!(share(r, 3, &a), share(r, 3, &b));
        }
        // "a" counts as 200 of 600: the first student's whole share.
        assert_eq!(share(0, 3, &a), [Assigned { addr: "a".into(), weight: 1.0 }]);
    }

    #[test]
    fn a_sliver_of_a_teacher_is_left_to_the_student_s_other_teacher() {
        // Teacher a ends at 0.505: student 2 of 4 ([0.5, 0.75)) would send
        // it 2% of its requests; it sends them all to b.
        let s = share(2, 4, &[("a".into(), 50.5), ("b".into(), 49.5)]);
        assert_eq!(s, [Assigned { addr: "b".into(), weight: 1.0 }]);
        // Many small teachers and one student: it calls them all.
        let many = pool(&[1.0; 30]);
        assert_eq!(share(0, 1, &many).len(), 30);
    }

    #[test]
    fn no_teacher_or_a_rank_outside_the_world_is_no_share() {
        assert!(share(0, 2, &[]).is_empty());
        assert!(share(2, 2, &pool(&[1.0])).is_empty());
    }
}
