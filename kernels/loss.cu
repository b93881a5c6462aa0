// Fused softmax cross-entropy: one block per row of logits, one read of the row (each thread keeps
// a running max and its rescaled sum, merged across the block); the gradient recomputes the softmax
// from the logits and the saved lse. `ignore` < 0 means no ignore index; `mask` may be null.
// On a vocabulary shard the logits are columns vstart.. of the vocabulary; a target elsewhere has
// no one-hot term here. Columns from vreal on are vocabulary padding: out of the softmax, zero grad.

#define LOSS(s, T) \
extern "C" __global__ void ce_fwd_##s(const T* logits, const u32* tgt, const float* mask, long long ignore, long vstart, long vreal, float* loss, float* lse, long v) { \
    long r = blockIdx.x; const T* row = logits + r * v; float m = -INFINITY, z = 0.f; \
    for (long i = threadIdx.x; i < vreal; i += blockDim.x) { float x = ld(row, i); \
        if (x > m) { z = z * expf(m - x) + 1.f; m = x; } else if (x > -INFINITY) z += expf(x - m); } \
    float mb = block_max(m); z = block_sum(m == -INFINITY ? 0.f : z * expf(m - mb)); m = mb; \
    if (threadIdx.x == 0) { float l = m + logf(z); lse[r] = l; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f; \
        long c = (long)t - vstart; float x = (c >= 0 && c < vreal) ? ld(row, c) : 0.f; \
        loss[r] = ((long long)t == ignore || mk == 0.f) ? 0.f : mk * (l - x); } } \
extern "C" __global__ void ce_bwd_##s(const T* logits, const u32* tgt, const float* mask, long long ignore, long vstart, long vreal, const float* lse, const float* dloss, T* dlogits, long v) { \
    long r = blockIdx.x; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f; \
    bool off = (long long)t == ignore || mk == 0.f; float g = off ? 0.f : dloss[r] * mk; \
    for (long i = threadIdx.x; i < v; i += blockDim.x) { \
        float p = expf(ld(logits, r * v + i) - lse[r]); st(dlogits, r * v + i, (off || i >= vreal) ? 0.f : (p - (i == (long)t - vstart ? 1.f : 0.f)) * g); } }
FOR_TYPES(LOSS)

// Eight-wide twins (v % 8 == 0, 16-byte aligned rows): each thread reads groups of eight logits
// with one 16-byte access. The softmax runs in base 2 with log2(e) folded into one multiply-add per
// logit (x·log2e − max·log2e, then ex2); the running max moves only when a group exceeds it, and
// only the group reaching past the real vocabulary checks columns one by one. The three kernels
// share the two helpers below, so the fused one equals the forward then the backward to the bit.

// One thread's running max (natural units) and its sum of 2^((x − max)·log2e) over its groups of
// the real vocabulary (columns ..vreal).
// With `keep` (shared memory), each group read before column `kcap` (a multiple of 8) is kept
// there too, for the gradient pass.
template <typename T>
__device__ __forceinline__ void ce_partial8(const T* row, long vreal, float& m, float& z, T* keep = nullptr,
                                            long kcap = 0) {
    m = -INFINITY; z = 0.f;
    for (long i = threadIdx.x * 8L; i < vreal; i += blockDim.x * 8L) {
        float g[8]; ld8(row, i, g);
        if (keep && i < kcap) st8(keep, i, g);
        if (i + 8 > vreal) {
#pragma unroll
            for (int e = 0; e < 8; e++) if (i + e >= vreal) g[e] = -INFINITY;
        }
        float gm = g[0];
#pragma unroll
        for (int e = 1; e < 8; e++) gm = fmaxf(gm, g[e]);
        if (gm > -INFINITY) {
            if (gm > m) { z *= ex2((m - gm) * LOG2E); m = gm; }
            float ml = m * LOG2E;
#pragma unroll
            for (int e = 0; e < 8; e++) z += ex2(fmaf(g[e], LOG2E, -ml));
        }
    }
}

// The row's log-sum-exp from every thread's partial (block-wide: all threads call it).
__device__ __forceinline__ float ce_lse8(float m, float z) {
    float mb = block_max(m);
    z = block_sum(m == -INFINITY ? 0.f : z * ex2((m - mb) * LOG2E));
    return mb + logf(z);
}

// The gradient over eight logits x at shard columns i..: softmax·g, minus g at the target's column
// tc, 0 on padding (columns vreal..) and on a row that is off (ignored or masked out).
__device__ __forceinline__ void ce_grad8(float* x, long i, long vreal, float ll, float g, long tc, bool off) {
    if (off) {
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = 0.f;
        return;
    }
#pragma unroll
    for (int e = 0; e < 8; e++) x[e] = ex2(fmaf(x[e], LOG2E, -ll)) * g;
    if (i + 8 > vreal) {
#pragma unroll
        for (int e = 0; e < 8; e++) if (i + e >= vreal) x[e] = 0.f;
    }
    if (tc >= i && tc < i + 8) {
#pragma unroll
        for (int e = 0; e < 8; e++) if (i + e == tc) x[e] -= g;
    }
}

// The eight-wide forward kernels run 1024 threads a row, as the kept-row kernel does: each thread
// then sums the same groups in all three, so their bits agree.
#define LOSS_V8(s, T) \
extern "C" __global__ void __launch_bounds__(1024) ce_fwd_##s##_v8(const T* logits, const u32* tgt, const float* mask, long long ignore, long vstart, long vreal, float* loss, float* lse, long v) { \
    long r = blockIdx.x; const T* row = logits + r * v; float m, z; ce_partial8(row, vreal, m, z); \
    float l = ce_lse8(m, z); \
    if (threadIdx.x == 0) { lse[r] = l; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f; \
        long c = (long)t - vstart; float x = (c >= 0 && c < vreal) ? ld(row, c) : 0.f; \
        loss[r] = ((long long)t == ignore || mk == 0.f) ? 0.f : mk * (l - x); } } \
extern "C" __global__ void ce_bwd_##s##_v8(const T* logits, const u32* tgt, const float* mask, long long ignore, long vstart, long vreal, const float* lse, const float* dloss, T* dlogits, long v) { \
    long r = blockIdx.x; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f, ll = lse[r] * LOG2E; \
    bool off = (long long)t == ignore || mk == 0.f; float g = off ? 0.f : dloss[r] * mk; long tc = (long)t - vstart; \
    for (long i = threadIdx.x * 8L; i < v; i += blockDim.x * 8L) { float x[8]; ld8(logits, r * v + i, x); \
        ce_grad8(x, i, vreal, ll, g, tc, off); st8(dlogits, r * v + i, x); } }
FOR_TYPES(LOSS_V8)

// Forward and backward in one launch, in place (one whole-vocabulary shard: vstart 0): the
// forward's pass over the row, then the gradient written over the logits with dloss = dscale on
// every row (or *dscale_p where given: read when the kernel runs, so a replayed CUDA graph takes
// the value written there since its capture): the same arithmetic as ce_fwd then ce_bwd, no
// separate dlogits buffer, and the second pass meant to find the block's row in L2 (H200, 16k ×
// 50304 bf16: 1.21 ms with 256 threads a row in session 21, 1.01–1.03 ms with 1024 in session 26,
// level with `ce_fwdbwd_bf16_keep` below, which keeps the row in shared memory and is 10% faster
// at 128,256 columns). The target's logit is read before the block's reductions (barriers), so
// before any thread overwrites it.
#define LOSS_FB(s, T) \
extern "C" __global__ void ce_fwdbwd_##s(T* logits, const u32* tgt, const float* mask, long long ignore, long vreal, float* loss, float* lse, float dscale, const float* dscale_p, long v) { \
    long r = blockIdx.x; T* row = logits + r * v; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f; \
    float xt = (threadIdx.x == 0 && (long)t < vreal) ? ld(row, (long)t) : 0.f, m = -INFINITY, z = 0.f; \
    for (long i = threadIdx.x; i < vreal; i += blockDim.x) { float x = ld(row, i); \
        if (x > m) { z = z * expf(m - x) + 1.f; m = x; } else if (x > -INFINITY) z += expf(x - m); } \
    float mb = block_max(m); z = block_sum(m == -INFINITY ? 0.f : z * expf(m - mb)); m = mb; \
    float l = m + logf(z); bool off = (long long)t == ignore || mk == 0.f; \
    if (threadIdx.x == 0) { lse[r] = l; loss[r] = off ? 0.f : mk * (l - xt); } \
    float g = off ? 0.f : (dscale_p ? *dscale_p : dscale) * mk; \
    for (long i = threadIdx.x; i < v; i += blockDim.x) { \
        float p = expf(ld(row, i) - l); st(row, i, (off || i >= vreal) ? 0.f : (p - (i == (long)t ? 1.f : 0.f)) * g); } }
FOR_TYPES(LOSS_FB)

#define LOSS_FB_V8(s, T) \
extern "C" __global__ void __launch_bounds__(1024) ce_fwdbwd_##s##_v8(T* logits, const u32* tgt, const float* mask, long long ignore, long vreal, float* loss, float* lse, float dscale, const float* dscale_p, long v) { \
    long r = blockIdx.x; T* row = logits + r * v; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f; \
    float xt = (threadIdx.x == 0 && (long)t < vreal) ? ld(row, (long)t) : 0.f, m, z; ce_partial8(row, vreal, m, z); \
    float l = ce_lse8(m, z); bool off = (long long)t == ignore || mk == 0.f; \
    if (threadIdx.x == 0) { lse[r] = l; loss[r] = off ? 0.f : mk * (l - xt); } \
    float g = off ? 0.f : (dscale_p ? *dscale_p : dscale) * mk, ll = l * LOG2E; \
    for (long i = threadIdx.x * 8L; i < v; i += blockDim.x * 8L) { float x[8]; ld8(row, i, x); \
        ce_grad8(x, i, vreal, ll, g, (long)t, off); st8(row, i, x); } }
FOR_TYPES(LOSS_FB_V8)

// The same with the row's first `kcap` columns (a multiple of 8; all of a row up to 110 KB: two
// blocks of 1024 threads an SM) kept in shared memory, so the gradient pass reads them there
// instead of hoping to find them in L2; the rest of a longer row (a 128k vocabulary) and the
// columns from vreal on, which the forward never reads, come from the row again.
extern "C" __global__ void __launch_bounds__(1024, 2) ce_fwdbwd_bf16_keep(bf16_t* logits, const u32* tgt, const float* mask, long long ignore, long vreal, float* loss, float* lse, float dscale, const float* dscale_p, long v, long kcap) {
    extern __shared__ u128 keep_raw[];
    bf16_t* keep = (bf16_t*)keep_raw;
    long r = blockIdx.x; bf16_t* row = logits + r * v; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f;
    float xt = (threadIdx.x == 0 && (long)t < vreal) ? ld(row, (long)t) : 0.f, m, z; ce_partial8(row, vreal, m, z, keep, kcap);
    float l = ce_lse8(m, z); bool off = (long long)t == ignore || mk == 0.f;
    if (threadIdx.x == 0) { lse[r] = l; loss[r] = off ? 0.f : mk * (l - xt); }
    float g = off ? 0.f : (dscale_p ? *dscale_p : dscale) * mk, ll = l * LOG2E;
    const long kept = kcap < vreal ? kcap : vreal;
    for (long i = threadIdx.x * 8L; i < v; i += blockDim.x * 8L) { float x[8]; ld8(i < kept ? (const bf16_t*)keep : (const bf16_t*)row, i, x);
        ce_grad8(x, i, vreal, ll, g, (long)t, off); st8(row, i, x); }
}

// Vocabulary-parallel cross-entropy: the whole vocabulary's lse and loss per row from the tensor-
// parallel shards' (`all` [n, 2, rows]: each shard's lse row, then its loss row, in rank order),
// in f64 as the CPU reference: lse = log Σ_r exp(lse_r), loss = m·lse − Σ_r (m·lse_r − loss_r)
// over the shards with a finite lse (m·lse_r − loss_r is m·logit[target] on the shard holding the
// target, 0 elsewhere); 0 where the mask is 0.
extern "C" __global__ void ce_combine_f32(const float* all, const float* mask, float* loss, float* lse, long n, long rows) {
    GRID_STRIDE(i, rows) {
        double top = -INFINITY;
        for (long r = 0; r < n; r++) top = fmax(top, (double)all[r * 2 * rows + i]);
        double m = mask ? (double)mask[i] : 1.0, z = 0.0, mx = 0.0;
        for (long r = 0; r < n; r++) {
            double l = all[r * 2 * rows + i], lo = all[r * 2 * rows + rows + i];
            if (isfinite(l)) { z += exp(l - top); mx += m * l - lo; }
        }
        double whole = top + log(z);
        lse[i] = (float)whole;
        loss[i] = m == 0.0 ? 0.f : (float)(m * whole - mx);
    }
}
