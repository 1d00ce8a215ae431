//! The CUDA MLP trainer against a plain f64 reference of the same network.

use crate::{Rng, cuda_or_skip, nvrtc::nvrtc_or_skip};
use edl_host_gpu::device::{CudaUnavailable, driver_present};
use edl_host_gpu::loss::{LossError, SoftLabelLoss};
use edl_host_gpu::mlp::{CudaMlp, MlpError, param_count};

/// Forward and backward of the MLP in f64 with plain loops: the gradient of
/// the summed loss divided by `global_rows`, and the summed loss.
fn reference(
    sizes: &[usize],
    params: &[f32],
    x: &[f32],
    labels: &[u32],
    teacher: Option<&[f32]>,
    p: &SoftLabelLoss,
    global_rows: usize,
) -> (Vec<f64>, f64) {
    let rows = labels.len();
    let layers = sizes.len() - 1;
    let mut offsets = vec![0];
    for w in sizes.windows(2) {
        offsets.push(offsets.last().unwrap() + w[0] * w[1] + w[1]);
    }
    let weight = |l: usize, i: usize, o: usize| params[offsets[l] + i * sizes[l + 1] + o] as f64;
    let bias = |l: usize, o: usize| params[offsets[l] + sizes[l] * sizes[l + 1] + o] as f64;
    let mut acts: Vec<Vec<f64>> = vec![x.iter().map(|&v| v as f64).collect()];
    for l in 0..layers {
        let (n_in, n_out) = (sizes[l], sizes[l + 1]);
        let a = &acts[l];
        let mut z = vec![0f64; rows * n_out];
        for r in 0..rows {
            for o in 0..n_out {
                let s: f64 = (0..n_in).map(|i| a[r * n_in + i] * weight(l, i, o)).sum::<f64>() + bias(l, o);
                z[r * n_out + o] = if l + 1 < layers { s.max(0.0) } else { s };
            }
        }
        acts.push(z);
    }
    let c = sizes[layers];
    let (t, alpha) = (p.temperature as f64, if teacher.is_some() { p.alpha as f64 } else { 0.0 });
    let softmax = |z: &[f64], temp: f64| {
        let m = z.iter().fold(f64::MIN, |m, &v| m.max(v / temp));
        let e: Vec<f64> = z.iter().map(|&v| (v / temp - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|v| v / s).collect::<Vec<f64>>()
    };
    let mut g = vec![0f64; rows * c];
    let mut total = 0.0;
    for r in 0..rows {
        let z = &acts[layers][r * c..(r + 1) * c];
        let (q1, qt) = (softmax(z, 1.0), softmax(z, t));
        let y = labels[r] as usize;
        total += (1.0 - alpha) * -q1[y].ln();
        let pt = teacher
            .map(|tv| softmax(&tv[r * c..(r + 1) * c].iter().map(|&v| v as f64).collect::<Vec<_>>(), t));
        for k in 0..c {
            let hard = q1[k] - (k == y) as u8 as f64;
            let soft = pt.as_ref().map_or(0.0, |pt| t * (qt[k] - pt[k]));
            g[r * c + k] = (alpha * soft + (1.0 - alpha) * hard) / global_rows as f64;
        }
        if let Some(pt) = &pt {
            let kl: f64 =
                (0..c).map(|k| if pt[k] > 0.0 { pt[k] * (pt[k].ln() - qt[k].ln()) } else { 0.0 }).sum();
            total += alpha * t * t * kl;
        }
    }
    let mut grad = vec![0f64; params.len()];
    for l in (0..layers).rev() {
        let (n_in, n_out) = (sizes[l], sizes[l + 1]);
        let a = &acts[l];
        for r in 0..rows {
            for o in 0..n_out {
                let go = g[r * n_out + o];
                for i in 0..n_in {
                    grad[offsets[l] + i * n_out + o] += a[r * n_in + i] * go;
                }
                grad[offsets[l] + n_in * n_out + o] += go;
            }
        }
        if l > 0 {
            let mut prev = vec![0f64; rows * n_in];
            for r in 0..rows {
                for i in 0..n_in {
                    if a[r * n_in + i] > 0.0 {
                        prev[r * n_in + i] = (0..n_out).map(|o| g[r * n_out + o] * weight(l, i, o)).sum();
                    }
                }
            }
            g = prev;
        }
    }
    (grad, total)
}

fn assert_close(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - w).abs() <= 1e-4 * scale, "{what}[{i}]: cuda {g} reference {w} (scale {scale})");
    }
}

#[test]
fn shapes_are_checked_before_any_device_work() {
    let err = CudaMlp::new(0, &[4, 3], &[0.0; 5]).err().expect("5 parameters for a 4-3 layer");
    assert!(matches!(&err, MlpError::Shape(m) if m.contains("need 15")), "{err}");
    let err = CudaMlp::new(0, &[4], &[]).err().expect("one size is no network");
    assert!(matches!(err, MlpError::Shape(_)), "{err}");
    assert_eq!(param_count(&[784, 128, 10]), 784 * 128 + 128 + 128 * 10 + 10);
}

#[test]
fn without_a_driver_it_is_an_error_value() {
    if driver_present() {
        eprintln!("SKIPPED without_a_driver_it_is_an_error_value: this machine has a CUDA driver");
        return;
    }
    let err = CudaMlp::new(0, &[4, 3], &[0.0; 15]).err().expect("no driver here");
    assert!(matches!(err, MlpError::Unavailable(CudaUnavailable::NoDriver)), "{err}");
}

#[test]
fn cuda_gradient_and_update_match_the_reference() {
    if !cuda_or_skip("cuda_gradient_and_update_match_the_reference") {
        return;
    }
    let sizes = [13, 17, 9, 5];
    let mut rng = Rng::new(7);
    let params = rng.vec(param_count(&sizes), -0.5, 0.5);
    let mut mlp = CudaMlp::new(0, &sizes, &params).expect("a usable GPU was detected");
    assert_eq!(mlp.params().unwrap(), params);
    for (rows, global, distill) in [(6usize, 6usize, false), (6, 12, true), (1, 4, true), (33, 33, false)] {
        let x = rng.vec(rows * sizes[0], -1.0, 1.0);
        let labels: Vec<u32> = (0..rows).map(|r| (r * 3 % sizes[3]) as u32).collect();
        let teacher = rng.vec(rows * sizes[3], -3.0, 3.0);
        let teacher = distill.then_some(&teacher[..]);
        let p = SoftLabelLoss { temperature: 2.5, alpha: 0.7 };
        let (want, want_loss) = reference(&sizes, &params, &x, &labels, teacher, &p, global);
        let mut got = vec![0f32; params.len()];
        let loss = mlp.compute_gradient(&x, &labels, teacher, &p, global, &mut got).unwrap();
        let what = format!("rows {rows}, global {global}, distill {distill}");
        assert_close(&format!("gradient ({what})"), &got, &want);
        assert!(
            (loss - want_loss).abs() <= 1e-4 * want_loss.abs().max(1.0),
            "{what}: loss {loss} vs {want_loss}"
        );
        // The logits of a plain forward pass agree with the reference's loss input.
        assert_eq!(mlp.forward(&x, rows).unwrap().len(), rows * sizes[3]);
    }

    // Two momentum steps with a given gradient, against the formula.
    let g1 = rng.vec(params.len(), -1.0, 1.0);
    let g2 = rng.vec(params.len(), -1.0, 1.0);
    mlp.apply(Some(&g1), 0.1, 0.9).unwrap();
    mlp.apply(Some(&g2), 0.1, 0.9).unwrap();
    let v: Vec<f64> = g1.iter().zip(&g2).map(|(&a, &b)| 0.9 * a as f64 + b as f64).collect();
    let want: Vec<f64> = params
        .iter()
        .zip(g1.iter().zip(&v))
        .map(|(&p, (&a, &v))| p as f64 - 0.1 * a as f64 - 0.1 * v)
        .collect();
    assert_close("parameters after two steps", &mlp.params().unwrap(), &want);
    assert_close("momentum after two steps", &mlp.velocity().unwrap(), &v);

    // Loading state replaces it.
    mlp.load_params(&params).unwrap();
    mlp.load_velocity(&vec![0.0; params.len()]).unwrap();
    assert_eq!(mlp.params().unwrap(), params);
    assert!(mlp.velocity().unwrap().iter().all(|&v| v == 0.0));
}

#[test]
fn cuda_training_fits_a_separable_problem_and_rejects_bad_input() {
    if !cuda_or_skip("cuda_training_fits_a_separable_problem_and_rejects_bad_input") {
        return;
    }
    // Four classes, each a noisy blob around its own centre in 8 dimensions.
    let (dim, classes, rows) = (8, 4, 256);
    let mut rng = Rng::new(11);
    let centres = rng.vec(classes * dim, -2.0, 2.0);
    let labels: Vec<u32> = (0..rows).map(|r| (r % classes) as u32).collect();
    let x: Vec<f32> = labels
        .iter()
        .flat_map(|&y| (0..dim).map(|d| centres[y as usize * dim + d]).collect::<Vec<_>>())
        .map(|c| c + rng.uniform(-0.3, 0.3))
        .collect();
    let sizes = [dim, 32, classes];
    let mut mlp = CudaMlp::new(0, &sizes, &rng.vec(param_count(&sizes), -0.3, 0.3)).unwrap();
    let p = SoftLabelLoss { temperature: 1.0, alpha: 0.0 };
    let mut grad = vec![0f32; mlp.param_count()];
    let first = mlp.compute_gradient(&x, &labels, None, &p, rows, &mut grad).unwrap() / rows as f64;
    let mut last = first;
    for _ in 0..200 {
        last = mlp.compute_gradient(&x, &labels, None, &p, rows, &mut grad).unwrap() / rows as f64;
        mlp.apply(None, 0.1, 0.9).unwrap();
    }
    assert!(last < 0.05 * first, "mean loss {first} -> {last}");
    let logits = mlp.forward(&x, rows).unwrap();
    let correct = (0..rows)
        .filter(|&r| {
            let row = &logits[r * classes..(r + 1) * classes];
            let best = (0..classes).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
            best as u32 == labels[r]
        })
        .count();
    assert_eq!(correct, rows, "training accuracy");

    let bad_labels: Vec<u32> = labels.iter().map(|&y| y + 4).collect();
    let err = mlp.compute_gradient(&x, &bad_labels, None, &p, rows, &mut grad).unwrap_err();
    assert!(matches!(err, MlpError::Loss(LossError::BadLabel { row: 0, label: 4, classes: 4 })), "{err}");
    let err = mlp.compute_gradient(&x[1..], &labels[..1], None, &p, 1, &mut grad).unwrap_err();
    assert!(matches!(err, MlpError::Shape(_)), "{err}");
    let mut nan = x.clone();
    nan[5] = f32::NAN;
    let err = mlp.compute_gradient(&nan, &labels, None, &p, rows, &mut grad).unwrap_err();
    assert!(
        matches!(err, MlpError::Loss(LossError::NonFinite { what: "input features", row: 0, class: 5, .. })),
        "{err}"
    );
}

#[test]
fn every_kernel_compiles_with_nvrtc() {
    // NVRTC needs no GPU: every machine checks the CUDA C, CI included.
    if !nvrtc_or_skip("every_kernel_compiles_with_nvrtc") {
        return;
    }
    let compiled = edl_host_gpu::device::compile_kernels().unwrap_or_else(|log| panic!("{log}"));
    let ptx = |file: &str| &compiled.iter().find(|(name, _)| *name == file).expect(file).1;
    for (file, kernels) in [
        ("soft_label.cu", &["soft_label_block", "soft_label_warp"][..]),
        ("mlp.cu", &["bias_act", "relu_backward", "column_sum", "sgd_momentum"][..]),
    ] {
        for k in kernels {
            assert!(ptx(file).contains(&format!(".entry {k}(")), "{file}: no entry point {k} in the PTX");
        }
    }
}
