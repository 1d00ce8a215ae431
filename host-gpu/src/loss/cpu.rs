//! CPU soft-label loss: one streaming pass per row for the normalisers and
//! the loss, one more for the gradient, rows spread over threads.

use super::{Batch, LossError, SoftLabelLoss, Teacher};
use rayon::prelude::*;

/// exp(x) for x <= 0 (larger x is clamped at 88), accurate to about 2e-7
/// relative, written without branches or calls so that LLVM vectorises the
/// loops that use it (with the baseline SSE2 of any x86-64). -inf and very
/// negative x give about 1e-38 instead of 0, which no sum here can tell.
#[inline(always)]
fn fexp(x: f32) -> f32 {
    let x = x.clamp(-87.33, 88.0);
    let t = x * std::f32::consts::LOG2_E;
    // Round to nearest by the 1.5 * 2^23 trick (|t| < 2^22 here).
    let n = (t + 12_582_912.0) - 12_582_912.0;
    let f = t - n;
    // 2^f on [-0.5, 0.5]: Taylor series of exp(f ln 2) to degree 6.
    let p = 1.0
        + f * (std::f32::consts::LN_2
            + f * (0.240_226_5
                + f * (0.055_504_11 + f * (0.009_618_129 + f * (0.001_333_356 + f * 0.000_154_035_3)))));
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

const LANES: usize = 8;
const BLOCK: usize = 256;

/// max of `x`, in lanes so that it vectorises.
#[inline(always)]
fn lanes_max(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for k in 0..LANES {
            m[k] = m[k].max(c[k]);
        }
    }
    chunks.remainder().iter().chain(&m).fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// How a teacher's value becomes a logit: itself, or the log of a probability.
trait TeacherKind {
    /// The logit of one value (-inf for a zero probability).
    fn logit(v: f32) -> f32;
    /// The largest logit of a block.
    fn block_max(x: &[f32]) -> f32;
}

struct Logits;
struct Probs;

impl TeacherKind for Logits {
    #[inline(always)]
    fn logit(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    fn block_max(x: &[f32]) -> f32 {
        lanes_max(x)
    }
}

impl TeacherKind for Probs {
    #[inline(always)]
    fn logit(v: f32) -> f32 {
        v.ln()
    }
    #[inline(always)]
    fn block_max(x: &[f32]) -> f32 {
        // ln is increasing: the largest logit is the log of the largest probability.
        lanes_max(x).ln()
    }
}

/// Streaming state of one row: running maxima and sums rescaled to them.
struct RowStats {
    /// max over the student logits
    m_z: f32,
    /// sum exp((z - m_z) / T)
    s_zt: f64,
    /// sum exp(z - m_z)
    s_z1: f64,
    /// max over the teacher logits
    m_t: f32,
    /// sum exp((t - m_t) / T)
    s_t: f64,
    /// sum exp((t - m_t) / T) (t - z); times 1/T gives the cross term of the KL
    acc: f64,
}

fn check_row(student: &[f32], teacher_row: &[f32], probs: bool, row: usize) -> Result<(), LossError> {
    // Scans without early exit vectorise; the slow search runs only on failure.
    if !student.iter().fold(true, |ok, v| ok & v.is_finite()) {
        let (class, &value) = student.iter().enumerate().find(|(_, v)| !v.is_finite()).expect("found above");
        return Err(LossError::NonFinite { what: "student logits", row, class, value });
    }
    if !probs {
        if !teacher_row.iter().fold(true, |ok, v| ok & v.is_finite()) {
            let (class, &value) =
                teacher_row.iter().enumerate().find(|(_, v)| !v.is_finite()).expect("found");
            return Err(LossError::NonFinite { what: "teacher logits", row, class, value });
        }
    } else {
        if let Some((class, &value)) =
            teacher_row.iter().enumerate().find(|(_, v)| !(**v >= 0.0 && **v <= 1.0))
        {
            return Err(LossError::BadProbability { row, class, value });
        }
        if teacher_row.iter().all(|&p| p == 0.0) {
            return Err(LossError::BadProbability { row, class: 0, value: 0.0 });
        }
    }
    Ok(())
}

/// One pass over the row, a block at a time: each block's maxima update the
/// running maxima (rescaling what was summed), then the block's terms are
/// summed in lanes.
fn row_stats<K: TeacherKind>(z: &[f32], t: &[f32], inv_t: f32) -> RowStats {
    let mut s =
        RowStats { m_z: f32::NEG_INFINITY, s_zt: 0.0, s_z1: 0.0, m_t: f32::NEG_INFINITY, s_t: 0.0, acc: 0.0 };
    for (zb, tb) in z.chunks(BLOCK).zip(t.chunks(BLOCK)) {
        let bz = lanes_max(zb);
        if bz > s.m_z {
            if s.m_z > f32::NEG_INFINITY {
                s.s_zt *= fexp((s.m_z - bz) * inv_t) as f64;
                s.s_z1 *= fexp(s.m_z - bz) as f64;
            }
            s.m_z = bz;
        }
        let bt = K::block_max(tb);
        if bt > s.m_t {
            if s.m_t > f32::NEG_INFINITY {
                let f = fexp((s.m_t - bt) * inv_t) as f64;
                s.s_t *= f;
                s.acc *= f;
            }
            s.m_t = bt;
        }
        let (m_z, m_t) = (s.m_z, s.m_t);
        let (mut a, mut b, mut c, mut d) = ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES]);
        let term = |zk: f32, tv: f32| {
            let tk = K::logit(tv);
            let e_t = fexp((tk - m_t) * inv_t);
            let valid = tk > f32::NEG_INFINITY;
            (
                fexp((zk - m_z) * inv_t),
                fexp(zk - m_z),
                if valid { e_t } else { 0.0 },
                if valid { e_t * (tk - zk) } else { 0.0 },
            )
        };
        let (zc, tc) = (zb.chunks_exact(LANES), tb.chunks_exact(LANES));
        let (zr, tr) = (zc.remainder(), tc.remainder());
        for (zl, tl) in zc.zip(tc) {
            for k in 0..LANES {
                let (ea, eb, ec, ed) = term(zl[k], tl[k]);
                a[k] += ea;
                b[k] += eb;
                c[k] += ec;
                d[k] += ed;
            }
        }
        for (k, (&zk, &tv)) in zr.iter().zip(tr).enumerate() {
            let (ea, eb, ec, ed) = term(zk, tv);
            a[k] += ea;
            b[k] += eb;
            c[k] += ec;
            d[k] += ed;
        }
        let sum = |x: [f32; LANES]| x.iter().map(|&v| v as f64).sum::<f64>();
        s.s_zt += sum(a);
        s.s_z1 += sum(b);
        s.s_t += sum(c);
        s.acc += sum(d);
    }
    s
}

/// Loss of one row and its gradient (scaled by `scale` = 1 / rows).
#[allow(clippy::too_many_arguments)]
fn row<K: TeacherKind>(
    p: &SoftLabelLoss,
    z: &[f32],
    t: &[f32],
    label: Option<u32>,
    grad: &mut [f32],
    scale: f32,
) -> f64 {
    let (temp, alpha) = (p.temperature, p.alpha);
    let inv_t = 1.0 / temp;
    let s = row_stats::<K>(z, t, inv_t);

    // KL(p_T || q_T) = sum p (t - z) / T - (m_t / T + ln s_t) + (m_z / T + ln s_zt)
    let log_zt = s.m_z as f64 / temp as f64 + s.s_zt.ln();
    let log_t = s.m_t as f64 / temp as f64 + s.s_t.ln();
    let kl = (s.acc / s.s_t / temp as f64 - log_t + log_zt).max(0.0);
    let mut loss = (alpha * temp * temp) as f64 * kl;
    let hard_weight = if label.is_some() { 1.0 - alpha } else { 0.0 };
    if let Some(y) = label {
        let log_q1_y = (z[y as usize] - s.m_z) as f64 - s.s_z1.ln();
        loss -= hard_weight as f64 * log_q1_y;
    }

    let (m_z, m_t) = (s.m_z, s.m_t);
    let (inv_zt, inv_z1, inv_st) = ((1.0 / s.s_zt) as f32, (1.0 / s.s_z1) as f32, (1.0 / s.s_t) as f32);
    let soft = alpha * temp * scale;
    let hard = hard_weight * scale;
    for ((g, &zk), &tv) in grad.iter_mut().zip(z).zip(t) {
        let q_t = fexp((zk - m_z) * inv_t) * inv_zt;
        let tk = K::logit(tv);
        let p_t = if tk > f32::NEG_INFINITY { fexp((tk - m_t) * inv_t) * inv_st } else { 0.0 };
        let q_1 = fexp(zk - m_z) * inv_z1;
        *g = soft * (q_t - p_t) + hard * q_1;
    }
    if let Some(y) = label {
        grad[y as usize] -= hard;
    }
    loss
}

/// Longest row taken by [`short_row`]. Its three exponentials per element
/// are kept on the stack between the statistics and the gradient
/// (`3 x SHORT_ROW` f32), so a short row computes them once, where the
/// streaming path computes seven per element and spends most of its time on a
/// row of ten in block and lane bookkeeping.
pub(super) const SHORT_ROW: usize = 64;

/// Loss of one row of at most [`SHORT_ROW`] classes and its gradient (scaled
/// by `scale` = 1 / rows): the same quantities as [`row`], with each
/// exponential computed once and kept for the gradient.
fn short_row<K: TeacherKind>(
    p: &SoftLabelLoss,
    z: &[f32],
    t: &[f32],
    label: Option<u32>,
    grad: &mut [f32],
    scale: f32,
) -> f64 {
    let c = z.len();
    debug_assert!(c <= SHORT_ROW && t.len() == c && grad.len() == c);
    let (temp, alpha) = (p.temperature, p.alpha);
    let inv_t = 1.0 / temp;
    let (mut e_zt, mut e_z1, mut e_t) = ([0f32; SHORT_ROW], [0f32; SHORT_ROW], [0f32; SHORT_ROW]);
    let (e_zt, e_z1, e_t) = (&mut e_zt[..c], &mut e_z1[..c], &mut e_t[..c]);

    let m_z = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let m_t = K::block_max(t);
    let (mut s_zt, mut s_z1, mut s_t, mut acc) = (0f32, 0f32, 0f32, 0f32);
    for k in 0..c {
        let (zk, tk) = (z[k], K::logit(t[k]));
        let valid = tk > f32::NEG_INFINITY;
        let et = fexp((tk - m_t) * inv_t);
        let et = if valid { et } else { 0.0 };
        e_zt[k] = fexp((zk - m_z) * inv_t);
        e_z1[k] = fexp(zk - m_z);
        e_t[k] = et;
        s_zt += e_zt[k];
        s_z1 += e_z1[k];
        s_t += et;
        acc += if valid { et * (tk - zk) } else { 0.0 };
    }
    let (s_zt, s_z1, s_t, acc) = (s_zt as f64, s_z1 as f64, s_t as f64, acc as f64);

    let log_zt = m_z as f64 / temp as f64 + s_zt.ln();
    let log_t = m_t as f64 / temp as f64 + s_t.ln();
    let kl = (acc / s_t / temp as f64 - log_t + log_zt).max(0.0);
    let mut loss = (alpha * temp * temp) as f64 * kl;
    let hard_weight = if label.is_some() { 1.0 - alpha } else { 0.0 };
    if let Some(y) = label {
        let log_q1_y = (z[y as usize] - m_z) as f64 - s_z1.ln();
        loss -= hard_weight as f64 * log_q1_y;
    }

    let soft = alpha * temp * scale;
    let hard = hard_weight * scale;
    let (a_zt, a_t, a_z1) = (soft / s_zt as f32, soft / s_t as f32, hard / s_z1 as f32);
    for k in 0..c {
        grad[k] = a_zt * e_zt[k] - a_t * e_t[k] + a_z1 * e_z1[k];
    }
    if let Some(y) = label {
        grad[y as usize] -= hard;
    }
    loss
}

/// Rows per parallel task: enough work to be worth a task.
fn min_rows(classes: usize) -> usize {
    (4 * 1024 / classes.max(1)).max(1)
}

pub(super) fn fused(p: &SoftLabelLoss, b: &Batch<'_>, grad: &mut [f32]) -> Result<f32, LossError> {
    if b.rows == 0 {
        return Ok(0.0);
    }
    let c = b.classes;
    let scale = 1.0 / b.rows as f32;
    let probs = matches!(b.teacher, Teacher::Probs(_));
    let values = b.teacher.values();
    let total: f64 = grad
        .par_chunks_mut(c)
        .enumerate()
        .with_min_len(min_rows(c))
        .map(|(r, g)| {
            let z = &b.student[r * c..(r + 1) * c];
            let t = &values[r * c..(r + 1) * c];
            check_row(z, t, probs, r)?;
            let label = b.labels.map(|l| l[r]);
            Ok::<f64, LossError>(match (probs, c <= SHORT_ROW) {
                (true, true) => short_row::<Probs>(p, z, t, label, g, scale),
                (false, true) => short_row::<Logits>(p, z, t, label, g, scale),
                (true, false) => row::<Probs>(p, z, t, label, g, scale),
                (false, false) => row::<Logits>(p, z, t, label, g, scale),
            })
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
        for (i, gi) in g.iter_mut().enumerate() {
            let k = r * c + i;
            let y = b.labels.map_or(0.0, |l| if l[r] as usize == i { 1.0 } else { 0.0 });
            *gi = (p.alpha * p.temperature * (q_t[k] - p_t[k]) + hard_weight * (q_1[k] - y)) * scale;
        }
    });
    Ok((total / b.rows as f64) as f32)
}
