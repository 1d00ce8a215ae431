//! The soft-label loss against a plain f64 reference, finite differences,
//! limiting cases, stability and bad input; CUDA against CPU where a GPU is.

use crate::Rng;
use edl_host_gpu::loss::{Batch, CudaSoftLabel, LossError, SoftLabelLoss, Teacher, naive_three_pass};

/// The loss and gradient straight from the formulas, in f64.
fn reference(
    p: &SoftLabelLoss,
    z: &[f32],
    t: &[f32],
    probs: bool,
    labels: Option<&[u32]>,
    c: usize,
) -> (f64, Vec<f64>) {
    let rows = z.len() / c;
    let temp = p.temperature as f64;
    let alpha = p.alpha as f64;
    let softmax = |x: &[f64]| {
        let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|v| v / s).collect::<Vec<f64>>()
    };
    let mut loss = 0.0;
    let mut grad = vec![0.0; z.len()];
    for r in 0..rows {
        let zr: Vec<f64> = z[r * c..(r + 1) * c].iter().map(|&v| v as f64).collect();
        let tr: Vec<f64> =
            t[r * c..(r + 1) * c].iter().map(|&v| if probs { (v as f64).ln() } else { v as f64 }).collect();
        let pt = softmax(&tr.iter().map(|v| v / temp).collect::<Vec<_>>());
        let qt = softmax(&zr.iter().map(|v| v / temp).collect::<Vec<_>>());
        let q1 = softmax(&zr);
        let kl: f64 = pt.iter().zip(&qt).filter(|(p, _)| **p > 0.0).map(|(p, q)| p * (p.ln() - q.ln())).sum();
        let mut l = alpha * temp * temp * kl;
        let hard = if labels.is_some() { 1.0 - alpha } else { 0.0 };
        if let Some(y) = labels {
            l -= hard * q1[y[r] as usize].ln();
        }
        loss += l;
        for i in 0..c {
            let y = labels.map_or(0.0, |y| if y[r] as usize == i { 1.0 } else { 0.0 });
            grad[r * c + i] = (alpha * temp * (qt[i] - pt[i]) + hard * (q1[i] - y)) / rows as f64;
        }
    }
    (loss / rows as f64, grad)
}

fn batch<'a>(z: &'a [f32], t: &'a [f32], probs: bool, labels: Option<&'a [u32]>, c: usize) -> Batch<'a> {
    Batch {
        student: z,
        teacher: if probs { Teacher::Probs(t) } else { Teacher::Logits(t) },
        labels,
        rows: z.len() / c,
        classes: c,
    }
}

fn to_probs(logits: &[f32], c: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(logits.len());
    for row in logits.chunks(c) {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let s: f64 = row.iter().map(|&v| ((v - m) as f64).exp()).sum();
        out.extend(row.iter().map(|&v| (((v - m) as f64).exp() / s) as f32));
    }
    out
}

fn assert_close(what: &str, got: f32, want: f64, rtol: f64) {
    // f32 terms of a few units cancel to the loss: allow their rounding.
    let tol = rtol * want.abs() + 1e-6;
    assert!((got as f64 - want).abs() <= tol, "{what}: got {got}, want {want} (tolerance {tol})");
}

fn assert_grad_close(what: &str, got: &[f32], want: &[f64], rtol: f64) {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-12);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= rtol * scale + 1e-9,
            "{what}: grad[{i}] = {g}, want {w} (scale {scale})"
        );
    }
}

#[test]
fn matches_the_f64_reference_for_every_class_count() {
    for &c in &[1usize, 2, 10, 1000, 50_000] {
        let rows = if c >= 50_000 { 4 } else { 16 };
        let mut rng = Rng::new(c as u64);
        let z = rng.vec(rows * c, -8.0, 8.0);
        let t_logits = rng.vec(rows * c, -8.0, 8.0);
        let labels: Vec<u32> = (0..rows).map(|r| (r * 7 % c) as u32).collect();
        for (probs, t) in [(false, t_logits.clone()), (true, to_probs(&t_logits, c))] {
            for labels in [None, Some(&labels[..])] {
                let p = SoftLabelLoss { temperature: 3.0, alpha: 0.7 };
                let b = batch(&z, &t, probs, labels, c);
                let mut grad = vec![0f32; z.len()];
                let loss = p.forward_backward(&b, &mut grad).unwrap();
                let (want, want_grad) = reference(&p, &z, &t, probs, labels, c);
                let what = format!("C={c} probs={probs} labels={}", labels.is_some());
                assert_close(&what, loss, want, 1e-4);
                assert_grad_close(&what, &grad, &want_grad, 1e-4);

                let mut naive = vec![0f32; z.len()];
                let naive_loss = naive_three_pass(&p, &b, &mut naive).unwrap();
                assert_close(&format!("naive {what}"), naive_loss, want, 1e-4);
                assert_grad_close(&format!("naive {what}"), &naive, &want_grad, 1e-4);
            }
        }
    }
}

#[test]
fn gradient_matches_finite_differences() {
    let c = 7;
    let mut rng = Rng::new(3);
    let z = rng.vec(3 * c, -2.0, 2.0);
    let t = rng.vec(3 * c, -2.0, 2.0);
    let labels = [1u32, 6, 0];
    let p = SoftLabelLoss { temperature: 2.0, alpha: 0.6 };
    let mut grad = vec![0f32; z.len()];
    p.forward_backward(&batch(&z, &t, false, Some(&labels), c), &mut grad).unwrap();
    let h = 1e-3f32;
    for i in 0..z.len() {
        let (mut up, mut down) = (z.clone(), z.clone());
        up[i] += h;
        down[i] -= h;
        let lu = reference(&p, &up, &t, false, Some(&labels), c).0;
        let ld = reference(&p, &down, &t, false, Some(&labels), c).0;
        let fd = (lu - ld) / (2.0 * h as f64);
        assert!((grad[i] as f64 - fd).abs() < 2e-4, "grad[{i}] = {}, finite difference {fd}", grad[i]);
    }
}

#[test]
fn alpha_zero_is_plain_cross_entropy() {
    let c = 10;
    let mut rng = Rng::new(5);
    let z = rng.vec(8 * c, -5.0, 5.0);
    let t = rng.vec(8 * c, -5.0, 5.0);
    let labels: Vec<u32> = (0..8).collect();
    let p = SoftLabelLoss { temperature: 4.0, alpha: 0.0 };
    let mut grad = vec![0f32; z.len()];
    let loss = p.forward_backward(&batch(&z, &t, false, Some(&labels), c), &mut grad).unwrap();
    let mut ce = 0.0f64;
    for (r, row) in z.chunks(c).enumerate() {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
        ce += lse - row[labels[r] as usize] as f64;
        for i in 0..c {
            let q = (row[i] as f64 - lse).exp();
            let want = (q - if i == labels[r] as usize { 1.0 } else { 0.0 }) / 8.0;
            assert!((grad[r * c + i] as f64 - want).abs() < 1e-6);
        }
    }
    assert_close("cross-entropy", loss, ce / 8.0, 1e-5);
}

#[test]
fn identical_student_and_teacher_give_zero_kl_and_zero_gradient() {
    let c = 1000;
    let z = Rng::new(9).vec(4 * c, -10.0, 10.0);
    for temperature in [0.5, 1.0, 20.0] {
        let p = SoftLabelLoss { temperature, alpha: 1.0 };
        let mut grad = vec![1f32; z.len()];
        let loss = p.forward_backward(&batch(&z, &z, false, None, c), &mut grad).unwrap();
        assert!(loss.abs() < 1e-6, "T={temperature}: {loss}");
        assert!(grad.iter().all(|g| g.abs() < 1e-8), "T={temperature}");
    }
}

#[test]
fn stable_for_huge_logits_and_extreme_temperatures() {
    let c = 100;
    let mut rng = Rng::new(11);
    let z = rng.vec(4 * c, -1e4, 1e4);
    let t = rng.vec(4 * c, -1e4, 1e4);
    let labels = [0u32, 1, 2, 3];
    for temperature in [0.5f32, 1.0, 10.0, 50.0] {
        let p = SoftLabelLoss { temperature, alpha: 0.5 };
        let mut grad = vec![0f32; z.len()];
        let loss = p.forward_backward(&batch(&z, &t, false, Some(&labels), c), &mut grad).unwrap();
        assert!(loss.is_finite(), "T={temperature}: {loss}");
        assert!(grad.iter().all(|g| g.is_finite()), "T={temperature}");
        let (want, want_grad) = reference(&p, &z, &t, false, Some(&labels), c);
        assert_close(&format!("T={temperature}"), loss, want, 1e-4);
        assert_grad_close(&format!("T={temperature}"), &grad, &want_grad, 1e-3);
    }
}

#[test]
fn bad_input_is_an_error_not_a_nan() {
    let p = SoftLabelLoss::default();
    let c = 4;
    let mut z = vec![0.5f32; 2 * c];
    let t = vec![0.25f32; 2 * c];
    let mut grad = vec![0f32; 2 * c];
    z[5] = f32::NAN;
    let err = p.forward_backward(&batch(&z, &t, false, None, c), &mut grad).unwrap_err();
    assert!(matches!(err, LossError::NonFinite { what: "student logits", row: 1, class: 1, .. }), "{err}");
    z[5] = 0.0;
    let mut t_bad = t.clone();
    t_bad[2] = f32::INFINITY;
    let err = p.forward_backward(&batch(&z, &t_bad, false, None, c), &mut grad).unwrap_err();
    assert!(matches!(err, LossError::NonFinite { what: "teacher logits", row: 0, class: 2, .. }), "{err}");
    t_bad[2] = 1.5;
    let err = p.forward_backward(&batch(&z, &t_bad, true, None, c), &mut grad).unwrap_err();
    assert!(matches!(err, LossError::BadProbability { row: 0, class: 2, .. }), "{err}");

    let err = p.forward_backward(&batch(&z, &t[..7], false, None, c), &mut grad).unwrap_err();
    assert!(matches!(err, LossError::Shape(_)), "{err}");
    let err = p.forward_backward(&batch(&z, &t, false, None, c), &mut grad[..3]).unwrap_err();
    assert!(err.to_string().contains("gradient buffer"), "{err}");
    let err = p.forward_backward(&batch(&z, &t, false, Some(&[0, 9]), c), &mut grad).unwrap_err();
    assert!(matches!(err, LossError::BadLabel { row: 1, label: 9, .. }), "{err}");
    let err = SoftLabelLoss { temperature: 0.0, alpha: 0.5 }
        .forward_backward(&batch(&z, &t, false, None, c), &mut grad)
        .unwrap_err();
    assert!(matches!(err, LossError::Parameter(_)), "{err}");
}

#[test]
fn cuda_kernel_matches_the_cpu() {
    if !crate::cuda_or_skip("cuda_kernel_matches_the_cpu") {
        return;
    }
    let cuda = CudaSoftLabel::new(0).expect("a usable GPU was detected");
    for &c in &[1usize, 2, 10, 1000, 50_000] {
        let rows = if c >= 50_000 { 64 } else { 256 };
        let mut rng = Rng::new(100 + c as u64);
        let z = rng.vec(rows * c, -8.0, 8.0);
        let t = rng.vec(rows * c, -8.0, 8.0);
        let labels: Vec<u32> = (0..rows).map(|r| (r % c) as u32).collect();
        for probs in [false, true] {
            let t = if probs { to_probs(&t, c) } else { t.clone() };
            let p = SoftLabelLoss { temperature: 2.0, alpha: 0.8 };
            let b = batch(&z, &t, probs, Some(&labels), c);
            let (mut g_cpu, mut g_gpu) = (vec![0f32; z.len()], vec![0f32; z.len()]);
            let l_cpu = p.forward_backward(&b, &mut g_cpu).unwrap();
            let l_gpu = cuda.forward_backward(&p, &b, &mut g_gpu).unwrap();
            assert!((l_cpu - l_gpu).abs() <= 1e-5 * l_cpu.abs().max(1.0), "C={c}: cpu {l_cpu} gpu {l_gpu}");
            let scale = g_cpu.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in g_cpu.iter().zip(&g_gpu) {
                assert!((a - b).abs() <= 1e-5 * scale.max(1e-6), "C={c}: {a} vs {b}");
            }
        }
        let mut bad = z.clone();
        bad[3] = f32::NAN;
        let mut g = vec![0f32; z.len()];
        let err = cuda
            .forward_backward(&SoftLabelLoss::default(), &batch(&bad, &t, false, None, c), &mut g)
            .unwrap_err();
        assert!(matches!(err, LossError::NonFinite { .. }), "{err}");
    }
}
