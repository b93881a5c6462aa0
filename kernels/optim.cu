// AdamW over flat fp32 buffers, and the sum of squares in fixed partials (summed on the host in
// order, so the global norm does not depend on scheduling).

extern "C" __global__ void adamw(float* p, const float* g, float* m, float* v, long n, float b1, float b2, float eps,
                                 float step_size, float bc2_sqrt, float decay, float grad_scale) {
    GRID_STRIDE(i, n) {
        float gi = g[i] * grad_scale;
        float mi = b1 * m[i] + (1.f - b1) * gi, vi = b2 * v[i] + (1.f - b2) * gi * gi;
        m[i] = mi; v[i] = vi;
        p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
}

#define SUMSQ(s, T) \
extern "C" __global__ void sum_sq_##s(const T* x, double* partial, long n) { \
    __shared__ double sh[256]; double a = 0.0; \
    GRID_STRIDE(i, n) { double v = ld(x, i); a += v * v; } \
    sh[threadIdx.x] = a; __syncthreads(); \
    for (int o = blockDim.x / 2; o > 0; o >>= 1) { if ((int)threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o]; __syncthreads(); } \
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0]; }
FOR_TYPES(SUMSQ)
