// Fused soft-label loss and gradient (Hinton et al. 2015), compiled at run
// time by NVRTC. One block per row (many classes) or one warp per row (few
// classes). Each thread keeps an online-softmax state over its strided share
// of the row; the states are merged by warp shuffles (and shared memory
// across warps); a second pass over the row writes the gradient.
//
// Non-finite inputs (or probabilities outside [0, 1]) are reported through
// `bad`: the smallest flat index of an offending value (atomicMin).

#define NEG_INF __int_as_float(0xff800000)

struct Stats {
    float m_z;   // max student logit
    float s_zt;  // sum exp((z - m_z) / T)
    float s_z1;  // sum exp(z - m_z)
    float m_t;   // max teacher logit
    float s_t;   // sum exp((t - m_t) / T)
    float acc;   // sum exp((t - m_t) / T) (t - z) / T
};

__device__ __forceinline__ Stats empty_stats() {
    Stats s;
    s.m_z = NEG_INF; s.s_zt = 0.f; s.s_z1 = 0.f;
    s.m_t = NEG_INF; s.s_t = 0.f; s.acc = 0.f;
    return s;
}

__device__ __forceinline__ Stats merge(Stats a, Stats b, float inv_t) {
    Stats r;
    if (a.m_z == NEG_INF) { r.m_z = b.m_z; r.s_zt = b.s_zt; r.s_z1 = b.s_z1; }
    else if (b.m_z == NEG_INF) { r.m_z = a.m_z; r.s_zt = a.s_zt; r.s_z1 = a.s_z1; }
    else {
        r.m_z = fmaxf(a.m_z, b.m_z);
        r.s_zt = a.s_zt * expf((a.m_z - r.m_z) * inv_t) + b.s_zt * expf((b.m_z - r.m_z) * inv_t);
        r.s_z1 = a.s_z1 * expf(a.m_z - r.m_z) + b.s_z1 * expf(b.m_z - r.m_z);
    }
    if (a.m_t == NEG_INF) { r.m_t = b.m_t; r.s_t = b.s_t; r.acc = b.acc; }
    else if (b.m_t == NEG_INF) { r.m_t = a.m_t; r.s_t = a.s_t; r.acc = a.acc; }
    else {
        r.m_t = fmaxf(a.m_t, b.m_t);
        float fa = expf((a.m_t - r.m_t) * inv_t), fb = expf((b.m_t - r.m_t) * inv_t);
        r.s_t = a.s_t * fa + b.s_t * fb;
        r.acc = a.acc * fa + b.acc * fb;
    }
    return r;
}

__device__ __forceinline__ Stats shfl_down(Stats s, int offset) {
    Stats o;
    o.m_z = __shfl_down_sync(0xffffffff, s.m_z, offset);
    o.s_zt = __shfl_down_sync(0xffffffff, s.s_zt, offset);
    o.s_z1 = __shfl_down_sync(0xffffffff, s.s_z1, offset);
    o.m_t = __shfl_down_sync(0xffffffff, s.m_t, offset);
    o.s_t = __shfl_down_sync(0xffffffff, s.s_t, offset);
    o.acc = __shfl_down_sync(0xffffffff, s.acc, offset);
    return o;
}

__device__ __forceinline__ Stats warp_reduce(Stats s, float inv_t) {
    for (int offset = 16; offset > 0; offset >>= 1) s = merge(s, shfl_down(s, offset), inv_t);
    return s;
}

__device__ __forceinline__ float teacher_logit(float v, int probs) {
    return probs ? (v > 0.f ? logf(v) : NEG_INF) : v;
}

__device__ __forceinline__ bool bad_value(float z, float t, int probs) {
    return !isfinite(z) || !isfinite(t) || (probs && (t < 0.f || t > 1.f));
}

// Accumulates this thread's share [lane, C) stepping by `stride`.
__device__ __forceinline__ Stats accumulate(const float* z, const float* t, int C, int lane, int stride,
                                            int probs, float inv_t, unsigned long long base,
                                            unsigned long long* bad) {
    Stats s = empty_stats();
    for (int i = lane; i < C; i += stride) {
        float zi = z[i], raw = t[i];
        if (bad_value(zi, raw, probs)) { atomicMin(bad, base + (unsigned long long)i); continue; }
        if (zi > s.m_z) {
            if (s.m_z != NEG_INF) { s.s_zt *= expf((s.m_z - zi) * inv_t); s.s_z1 *= expf(s.m_z - zi); }
            s.m_z = zi; s.s_zt += 1.f; s.s_z1 += 1.f;
        } else {
            s.s_zt += expf((zi - s.m_z) * inv_t); s.s_z1 += expf(zi - s.m_z);
        }
        float ti = teacher_logit(raw, probs);
        if (ti == NEG_INF) continue;
        float diff = (ti - zi) * inv_t;
        if (ti > s.m_t) {
            if (s.m_t != NEG_INF) { float f = expf((s.m_t - ti) * inv_t); s.s_t *= f; s.acc *= f; }
            s.m_t = ti; s.s_t += 1.f; s.acc += diff;
        } else {
            float w = expf((ti - s.m_t) * inv_t);
            s.s_t += w; s.acc += w * diff;
        }
    }
    return s;
}

__device__ __forceinline__ float row_loss_of(Stats s, const float* z, int label, float temp, float inv_t,
                                             float alpha, float hard) {
    float kl = s.acc / s.s_t - (s.m_t * inv_t + logf(s.s_t)) + (s.m_z * inv_t + logf(s.s_zt));
    float loss = alpha * temp * temp * fmaxf(kl, 0.f);
    if (label >= 0) loss -= hard * ((z[label] - s.m_z) - logf(s.s_z1));
    return loss;
}

__device__ __forceinline__ void write_grad(Stats s, const float* z, const float* t, float* g, int C, int lane,
                                           int stride, int label, int probs, float temp, float inv_t,
                                           float alpha, float hard, float scale) {
    float inv_zt = 1.f / s.s_zt, inv_z1 = 1.f / s.s_z1, inv_st = 1.f / s.s_t;
    float soft = alpha * temp * scale, h = hard * scale;
    for (int i = lane; i < C; i += stride) {
        float zi = z[i];
        float q_t = expf((zi - s.m_z) * inv_t) * inv_zt;
        float ti = teacher_logit(t[i], probs);
        float p_t = ti == NEG_INF ? 0.f : expf((ti - s.m_t) * inv_t) * inv_st;
        float grad = soft * (q_t - p_t);
        if (h != 0.f) {
            float q_1 = expf(zi - s.m_z) * inv_z1;
            grad += h * (q_1 - (i == label ? 1.f : 0.f));
        }
        g[i] = grad;
    }
}

// One block per row; blockDim.x a multiple of 32, at most 1024.
extern "C" __global__ void soft_label_block(const float* __restrict__ student, const float* __restrict__ teacher,
                                            const unsigned* __restrict__ labels, int has_labels, int rows, int C,
                                            int probs, float temp, float alpha, float scale,
                                            float* __restrict__ grad, float* __restrict__ row_loss,
                                            unsigned long long* __restrict__ bad) {
    __shared__ Stats warp_stats[32];
    __shared__ Stats total;
    int row = blockIdx.x;
    if (row >= rows) return;
    float inv_t = 1.f / temp;
    const float* z = student + (size_t)row * C;
    const float* t = teacher + (size_t)row * C;
    unsigned long long base = (unsigned long long)row * C;
    Stats s = accumulate(z, t, C, threadIdx.x, blockDim.x, probs, inv_t, base, bad);
    s = warp_reduce(s, inv_t);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_stats[warp] = s;
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x / 32;
        s = lane < warps ? warp_stats[lane] : empty_stats();
        s = warp_reduce(s, inv_t);
        if (lane == 0) total = s;
    }
    __syncthreads();
    s = total;
    int label = has_labels ? (int)labels[row] : -1;
    float hard = has_labels ? 1.f - alpha : 0.f;
    if (threadIdx.x == 0) row_loss[row] = row_loss_of(s, z, label, temp, inv_t, alpha, hard);
    write_grad(s, z, t, grad + (size_t)row * C, C, threadIdx.x, blockDim.x, label, probs, temp, inv_t, alpha,
               hard, scale);
}

// One warp per row: for few classes, where a block per row would idle.
extern "C" __global__ void soft_label_warp(const float* __restrict__ student, const float* __restrict__ teacher,
                                           const unsigned* __restrict__ labels, int has_labels, int rows, int C,
                                           int probs, float temp, float alpha, float scale,
                                           float* __restrict__ grad, float* __restrict__ row_loss,
                                           unsigned long long* __restrict__ bad) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;  // whole warps leave together
    int lane = threadIdx.x % 32;
    float inv_t = 1.f / temp;
    const float* z = student + (size_t)row * C;
    const float* t = teacher + (size_t)row * C;
    Stats s = accumulate(z, t, C, lane, 32, probs, inv_t, (unsigned long long)row * C, bad);
    s = warp_reduce(s, inv_t);
    Stats total;
    total.m_z = __shfl_sync(0xffffffff, s.m_z, 0);
    total.s_zt = __shfl_sync(0xffffffff, s.s_zt, 0);
    total.s_z1 = __shfl_sync(0xffffffff, s.s_z1, 0);
    total.m_t = __shfl_sync(0xffffffff, s.m_t, 0);
    total.s_t = __shfl_sync(0xffffffff, s.s_t, 0);
    total.acc = __shfl_sync(0xffffffff, s.acc, 0);
    int label = has_labels ? (int)labels[row] : -1;
    float hard = has_labels ? 1.f - alpha : 0.f;
    if (lane == 0) row_loss[row] = row_loss_of(total, z, label, temp, inv_t, alpha, hard);
    write_grad(total, z, t, grad + (size_t)row * C, C, lane, 32, label, probs, temp, inv_t, alpha, hard, scale);
}
