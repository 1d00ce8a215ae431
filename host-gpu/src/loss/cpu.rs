//! CPU soft-label loss: one streaming pass per row for the normalisers and
//! the loss, one more for the gradient, rows spread over threads.

use super::{Batch, LossError, SoftLabelLoss, Teacher};
use rayon::prelude::*;

/// Online-softmax state of one row: running maxima and rescaled sums.
struct RowStats {
    /// max over the student logits
    m_z: f32,
    /// sum exp((z - m_z) / T)
    s_zt: f64,
    /// sum exp(z - m_z)
    s_z1: f64,
    /// max over the teacher logits (log-probabilities for a probability teacher)
    m_t: f32,
    /// sum exp((t - m_t) / T)
    s_t: f64,
    /// sum exp((t - m_t) / T) (t - z) / T
    acc: f64,
}

/// The teacher's value at `i` as a logit (a probability becomes its log;
/// zero becomes -inf and drops out of every sum).
#[inline(always)]
fn teacher_logit(teacher: &Teacher<'_>, row: &[f32], i: usize) -> f32 {
    match teacher {
        Teacher::Logits(_) => row[i],
        Teacher::Probs(_) => row[i].ln(),
    }
}

fn check_row(
    student: &[f32],
    teacher_row: &[f32],
    teacher: &Teacher<'_>,
    row: usize,
) -> Result<(), LossError> {
    if let Some((class, &value)) = student.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(LossError::NonFinite { what: "student logits", row, class, value });
    }
    match teacher {
        Teacher::Logits(_) => {
            if let Some((class, &value)) = teacher_row.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(LossError::NonFinite { what: "teacher logits", row, class, value });
            }
        }
        Teacher::Probs(_) => {
            if let Some((class, &value)) =
                teacher_row.iter().enumerate().find(|(_, v)| !(**v >= 0.0 && **v <= 1.0))
            {
                return Err(LossError::BadProbability { row, class, value });
            }
            if teacher_row.iter().all(|&p| p == 0.0) {
                return Err(LossError::BadProbability { row, class: 0, value: 0.0 });
            }
        }
    }
    Ok(())
}

fn row_stats(z: &[f32], t_row: &[f32], teacher: &Teacher<'_>, inv_t: f32) -> RowStats {
    let mut s =
        RowStats { m_z: f32::NEG_INFINITY, s_zt: 0.0, s_z1: 0.0, m_t: f32::NEG_INFINITY, s_t: 0.0, acc: 0.0 };
    for i in 0..z.len() {
        let zi = z[i];
        if zi > s.m_z {
            // A new maximum: rescale what was summed against the old one.
            if s.m_z > f32::NEG_INFINITY {
                s.s_zt *= (((s.m_z - zi) * inv_t).exp()) as f64;
                s.s_z1 *= ((s.m_z - zi).exp()) as f64;
            }
            s.m_z = zi;
            s.s_zt += 1.0;
            s.s_z1 += 1.0;
        } else {
            s.s_zt += (((zi - s.m_z) * inv_t).exp()) as f64;
            s.s_z1 += ((zi - s.m_z).exp()) as f64;
        }
        let ti = teacher_logit(teacher, t_row, i);
        if ti == f32::NEG_INFINITY {
            continue;
        }
        let diff = (ti as f64 - zi as f64) * inv_t as f64;
        if ti > s.m_t {
            if s.m_t > f32::NEG_INFINITY {
                let scale = (((s.m_t - ti) * inv_t).exp()) as f64;
                s.s_t *= scale;
                s.acc *= scale;
            }
            s.m_t = ti;
            s.s_t += 1.0;
            s.acc += diff;
        } else {
            let w = (((ti - s.m_t) * inv_t).exp()) as f64;
            s.s_t += w;
            s.acc += w * diff;
        }
    }
    s
}

/// Loss of one row and its gradient (scaled by `scale` = 1 / rows).
#[allow(clippy::too_many_arguments)]
fn row(
    p: &SoftLabelLoss,
    z: &[f32],
    t_row: &[f32],
    teacher: &Teacher<'_>,
    label: Option<u32>,
    row_index: usize,
    grad: &mut [f32],
    scale: f32,
) -> Result<f64, LossError> {
    check_row(z, t_row, teacher, row_index)?;
    let (temp, alpha) = (p.temperature, p.alpha);
    let inv_t = 1.0 / temp;
    let s = row_stats(z, t_row, teacher, inv_t);

    // KL(p_T || q_T) = sum p (t - z) / T - (m_t / T + ln s_t) + (m_z / T + ln s_zt)
    let log_zt = s.m_z as f64 / temp as f64 + s.s_zt.ln();
    let log_t = s.m_t as f64 / temp as f64 + s.s_t.ln();
    let kl = (s.acc / s.s_t - log_t + log_zt).max(0.0);
    let mut loss = (alpha * temp * temp) as f64 * kl;
    let hard_weight = if label.is_some() { 1.0 - alpha } else { 0.0 };
    if let Some(y) = label {
        let log_q1_y = (z[y as usize] - s.m_z) as f64 - s.s_z1.ln();
        loss -= hard_weight as f64 * log_q1_y;
    }

    let (inv_zt, inv_z1, inv_st) = ((1.0 / s.s_zt) as f32, (1.0 / s.s_z1) as f32, (1.0 / s.s_t) as f32);
    let soft = alpha * temp * scale;
    let hard = hard_weight * scale;
    for i in 0..z.len() {
        let q_t = ((z[i] - s.m_z) * inv_t).exp() * inv_zt;
        let ti = teacher_logit(teacher, t_row, i);
        let p_t = if ti == f32::NEG_INFINITY { 0.0 } else { ((ti - s.m_t) * inv_t).exp() * inv_st };
        let mut g = soft * (q_t - p_t);
        if hard != 0.0 {
            let q_1 = if temp == 1.0 { q_t } else { (z[i] - s.m_z).exp() * inv_z1 };
            g += hard * q_1;
        }
        grad[i] = g;
    }
    if let Some(y) = label {
        grad[y as usize] -= hard;
    }
    Ok(loss)
}

/// Rows per parallel task: enough work to be worth a task.
fn min_rows(classes: usize) -> usize {
    (16 * 1024 / classes.max(1)).max(1)
}

pub(super) fn fused(p: &SoftLabelLoss, b: &Batch<'_>, grad: &mut [f32]) -> Result<f32, LossError> {
    if b.rows == 0 {
        return Ok(0.0);
    }
    let c = b.classes;
    let scale = 1.0 / b.rows as f32;
    let teacher = b.teacher;
    let total: f64 = grad
        .par_chunks_mut(c)
        .enumerate()
        .with_min_len(min_rows(c))
        .map(|(r, g)| {
            let z = &b.student[r * c..(r + 1) * c];
            let t = &teacher.values()[r * c..(r + 1) * c];
            row(p, z, t, &teacher, b.labels.map(|l| l[r]), r, g, scale)
        })
        .try_reduce(|| 0.0, |a, b| Ok(a + b))?;
    Ok((total / b.rows as f64) as f32)
}

fn softmax_into(x: &[f32], inv_t: f32, out: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = if v == f32::NEG_INFINITY { 0.0 } else { ((v - m) * inv_t).exp() };
        sum += *o as f64;
    }
    let inv = (1.0 / sum) as f32;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// The same loss computed the textbook way, for comparison: three softmaxes
/// into temporary buffers (three passes each), then a loss pass and a
/// gradient pass. Rows are spread over threads as in the fused version.
pub fn naive_three_pass(p: &SoftLabelLoss, b: &Batch<'_>, grad: &mut [f32]) -> Result<f32, LossError> {
    p.validate(b, grad.len())?;
    if b.rows == 0 {
        return Ok(0.0);
    }
    let c = b.classes;
    let n = b.rows * c;
    let inv_t = 1.0 / p.temperature;
    let teacher_logits: Vec<f32> = match b.teacher {
        Teacher::Logits(t) => t.to_vec(),
        Teacher::Probs(t) => t.iter().map(|v| v.ln()).collect(),
    };
    let (mut p_t, mut q_t, mut q_1) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    p_t.par_chunks_mut(c).zip(teacher_logits.par_chunks(c)).for_each(|(o, x)| softmax_into(x, inv_t, o));
    q_t.par_chunks_mut(c).zip(b.student.par_chunks(c)).for_each(|(o, x)| softmax_into(x, inv_t, o));
    q_1.par_chunks_mut(c).zip(b.student.par_chunks(c)).for_each(|(o, x)| softmax_into(x, 1.0, o));
    let hard_weight = if b.labels.is_some() { 1.0 - p.alpha } else { 0.0 };
    let t2 = (p.temperature * p.temperature) as f64;
    let total: f64 = (0..b.rows)
        .into_par_iter()
        .map(|r| {
            let rows = r * c..(r + 1) * c;
            let kl: f64 = p_t[rows.clone()]
                .iter()
                .zip(&q_t[rows.clone()])
                .filter(|(pv, _)| **pv > 0.0)
                .map(|(&pv, &qv)| pv as f64 * ((pv as f64).ln() - (qv as f64).ln()))
                .sum();
            let ce = b.labels.map_or(0.0, |l| -(q_1[r * c + l[r] as usize] as f64).ln());
            p.alpha as f64 * t2 * kl + hard_weight as f64 * ce
        })
        .sum();
    let scale = 1.0 / b.rows as f32;
    grad.par_chunks_mut(c).enumerate().for_each(|(r, g)| {
        for i in 0..c {
            let k = r * c + i;
            let y = b.labels.map_or(0.0, |l| if l[r] as usize == i { 1.0 } else { 0.0 });
            g[i] = (p.alpha * p.temperature * (q_t[k] - p_t[k]) + hard_weight * (q_1[k] - y)) * scale;
        }
    });
    Ok((total / b.rows as f64) as f32)
}
