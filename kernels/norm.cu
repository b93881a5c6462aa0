// LayerNorm / RMSNorm / softmax over rows: one block per row (256 threads), block reductions.
// Parameter gradients: column sums in two passes (common.cuh's COL_CHUNK rows per partial, then
// col_sum_f32 over the partials in order): deterministic, and enough threads for 16k-row batches.

#define NORMS(s, T) \
extern "C" __global__ void layernorm_fwd_##s(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, long c, float eps) { \
    long r = blockIdx.x; const T* xr = x + r * c; float sum = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) sum += ld(xr, i); \
    float mu = block_sum(sum) / c; float var = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) { float d = ld(xr, i) - mu; var += d * d; } \
    float rs = rsqrtf(block_sum(var) / c + eps); \
    for (long i = threadIdx.x; i < c; i += blockDim.x) st(y, r * c + i, (ld(xr, i) - mu) * rs * ld(w, i) + (b ? ld(b, i) : 0.f)); \
    if (threadIdx.x == 0) { mean[r] = mu; rstd[r] = rs; } } \
extern "C" __global__ void layernorm_bwd_##s(const T* dy, const T* x, const T* w, const float* mean, const float* rstd, T* dx, long c) { \
    long r = blockIdx.x; float mu = mean[r], rs = rstd[r], sg = 0.f, sgx = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) { float g = ld(dy, r * c + i) * ld(w, i); sg += g; sgx += g * (ld(x, r * c + i) - mu) * rs; } \
    sg = block_sum(sg) / c; sgx = block_sum(sgx) / c; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) { float xh = (ld(x, r * c + i) - mu) * rs; \
        st(dx, r * c + i, rs * (ld(dy, r * c + i) * ld(w, i) - sg - xh * sgx)); } } \
extern "C" __global__ void norm_param_grad_##s(const T* dy, const T* x, const float* mean, const float* rstd, float* dw, float* db, long rows, long c) { \
    GRID_STRIDE(i, (rows + COL_CHUNK - 1) / COL_CHUNK * c) { long j = i % c, r0 = i / c * COL_CHUNK, r1 = r0 + COL_CHUNK < rows ? r0 + COL_CHUNK : rows; \
        float a = 0.f, b = 0.f; for (long r = r0; r < r1; r++) { float g = ld(dy, r * c + j); \
        a += g * (ld(x, r * c + j) - (mean ? mean[r] : 0.f)) * rstd[r]; b += g; } dw[i] = a; if (db) db[i] = b; } } \
extern "C" __global__ void rmsnorm_fwd_##s(const T* x, const T* w, T* y, float* rstd, long c, float eps) { \
    long r = blockIdx.x; const T* xr = x + r * c; float ss = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) { float v = ld(xr, i); ss += v * v; } \
    float rs = rsqrtf(block_sum(ss) / c + eps); \
    for (long i = threadIdx.x; i < c; i += blockDim.x) st(y, r * c + i, ld(xr, i) * rs * ld(w, i)); \
    if (threadIdx.x == 0) rstd[r] = rs; } \
extern "C" __global__ void rmsnorm_bwd_##s(const T* dy, const T* x, const T* w, const float* rstd, T* dx, long c) { \
    long r = blockIdx.x; float rs = rstd[r], sgx = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) sgx += ld(dy, r * c + i) * ld(w, i) * ld(x, r * c + i) * rs; \
    sgx = block_sum(sgx) / c; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) st(dx, r * c + i, rs * (ld(dy, r * c + i) * ld(w, i) - ld(x, r * c + i) * rs * sgx)); } \
extern "C" __global__ void softmax_fwd_##s(const T* x, T* y, long c) { \
    long r = blockIdx.x; float m = -INFINITY; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) m = fmaxf(m, ld(x, r * c + i)); \
    m = block_max(m); float z = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) z += expf(ld(x, r * c + i) - m); \
    z = block_sum(z); \
    for (long i = threadIdx.x; i < c; i += blockDim.x) st(y, r * c + i, expf(ld(x, r * c + i) - m) / z); } \
extern "C" __global__ void softmax_bwd_##s(const T* y, const T* dy, T* dx, long c) { \
    long r = blockIdx.x; float d = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) d += ld(y, r * c + i) * ld(dy, r * c + i); \
    d = block_sum(d); \
    for (long i = threadIdx.x; i < c; i += blockDim.x) st(dx, r * c + i, ld(y, r * c + i) * (ld(dy, r * c + i) - d)); }
FOR_TYPES(NORMS)
