// Element-wise and reduction kernels of the MLP trainer (src/mlp.rs); the
// matrix products are cuBLAS's. Matrices are row-major, [rows, cols].
// Every kernel is a grid-stride loop, so any grid size covers any length.

// z[r, c] = z[r, c] + b[c], then max(., 0) when relu is set.
extern "C" __global__ void bias_act(float* __restrict__ z, const float* __restrict__ b, int rows, int cols,
                                    int relu) {
    size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = z[i] + b[i % cols];
        z[i] = relu ? fmaxf(v, 0.0f) : v;
    }
}

// The ReLU's backward: g = 0 where the layer's output was not positive.
extern "C" __global__ void relu_backward(float* __restrict__ g, const float* __restrict__ act, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        if (act[i] <= 0.0f) g[i] = 0.0f;
    }
}

// out[c] = sum over r of g[r, c]: the bias gradient. One thread per column;
// neighbouring threads read neighbouring addresses of each row.
extern "C" __global__ void column_sum(const float* __restrict__ g, int rows, int cols, float* __restrict__ out) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int r = 0; r < rows; ++r) s += g[(size_t)r * cols + c];
        out[c] = s;
    }
}

// SGD with momentum: v = momentum v + g; p -= lr v.
extern "C" __global__ void sgd_momentum(float* __restrict__ p, float* __restrict__ v, const float* __restrict__ g,
                                        size_t n, float lr, float momentum) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float vi = momentum * v[i] + g[i];
        v[i] = vi;
        p[i] -= lr * vi;
    }
}
