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
// with one 16-byte access; vocabulary padding (columns vreal..) is skipped element by element.
// The forward's running max moves once per group (no per-element branch), in base 2 (ex2).
#define LOSS_V8(s, T) \
extern "C" __global__ void ce_fwd_##s##_v8(const T* logits, const u32* tgt, const float* mask, long long ignore, long vstart, long vreal, float* loss, float* lse, long v) { \
    long r = blockIdx.x; const T* row = logits + r * v; float m = -INFINITY, z = 0.f; /* base 2 */ \
    for (long i = threadIdx.x * 8L; i < vreal; i += blockDim.x * 8L) { float g[8], gm = -INFINITY; ld8(row, i, g); \
        _Pragma("unroll") for (int e = 0; e < 8; e++) { g[e] = i + e < vreal ? g[e] * LOG2E : -INFINITY; gm = fmaxf(gm, g[e]); } \
        if (gm > -INFINITY) { float mn = fmaxf(m, gm); z *= ex2(m - mn); m = mn; \
            _Pragma("unroll") for (int e = 0; e < 8; e++) z += ex2(g[e] - mn); } } \
    float mb = block_max(m); z = block_sum(m == -INFINITY ? 0.f : z * ex2(m - mb)); m = mb; \
    if (threadIdx.x == 0) { float l = m * LN2 + logf(z); lse[r] = l; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f; \
        long c = (long)t - vstart; float x = (c >= 0 && c < vreal) ? ld(row, c) : 0.f; \
        loss[r] = ((long long)t == ignore || mk == 0.f) ? 0.f : mk * (l - x); } } \
extern "C" __global__ void ce_bwd_##s##_v8(const T* logits, const u32* tgt, const float* mask, long long ignore, long vstart, long vreal, const float* lse, const float* dloss, T* dlogits, long v) { \
    long r = blockIdx.x; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f, l = lse[r]; \
    bool off = (long long)t == ignore || mk == 0.f; float g = off ? 0.f : dloss[r] * mk; long tc = (long)t - vstart; \
    for (long i = threadIdx.x * 8L; i < v; i += blockDim.x * 8L) { float x[8]; ld8(logits, r * v + i, x); \
        _Pragma("unroll") for (int e = 0; e < 8; e++) \
            x[e] = (off || i + e >= vreal) ? 0.f : (ex2((x[e] - l) * LOG2E) - (i + e == tc ? 1.f : 0.f)) * g; \
        st8(dlogits, r * v + i, x); } }
FOR_TYPES(LOSS_V8)

// Forward and backward in one launch, in place (one whole-vocabulary shard: vstart 0): the
// forward's pass over the row, then the gradient written over the logits with dloss = dscale on
// every row: the same arithmetic as ce_fwd then ce_bwd, one DRAM read of the row instead of two
// (the second pass finds the block's row in L2) and no separate dlogits buffer. The target's logit
// is read before the block's reductions (barriers), so before any thread overwrites it.
#define LOSS_FB(s, T) \
extern "C" __global__ void ce_fwdbwd_##s(T* logits, const u32* tgt, const float* mask, long long ignore, long vreal, float* loss, float* lse, float dscale, long v) { \
    long r = blockIdx.x; T* row = logits + r * v; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f; \
    float xt = (threadIdx.x == 0 && (long)t < vreal) ? ld(row, (long)t) : 0.f, m = -INFINITY, z = 0.f; \
    for (long i = threadIdx.x; i < vreal; i += blockDim.x) { float x = ld(row, i); \
        if (x > m) { z = z * expf(m - x) + 1.f; m = x; } else if (x > -INFINITY) z += expf(x - m); } \
    float mb = block_max(m); z = block_sum(m == -INFINITY ? 0.f : z * expf(m - mb)); m = mb; \
    float l = m + logf(z); bool off = (long long)t == ignore || mk == 0.f; \
    if (threadIdx.x == 0) { lse[r] = l; loss[r] = off ? 0.f : mk * (l - xt); } \
    float g = off ? 0.f : dscale * mk; \
    for (long i = threadIdx.x; i < v; i += blockDim.x) { \
        float p = expf(ld(row, i) - l); st(row, i, (off || i >= vreal) ? 0.f : (p - (i == (long)t ? 1.f : 0.f)) * g); } }
FOR_TYPES(LOSS_FB)

#define LOSS_FB_V8(s, T) \
extern "C" __global__ void ce_fwdbwd_##s##_v8(T* logits, const u32* tgt, const float* mask, long long ignore, long vreal, float* loss, float* lse, float dscale, long v) { \
    long r = blockIdx.x; T* row = logits + r * v; u32 t = tgt[r]; float mk = mask ? mask[r] : 1.f; \
    float xt = (threadIdx.x == 0 && (long)t < vreal) ? ld(row, (long)t) : 0.f, m = -INFINITY, z = 0.f; /* base 2 */ \
    for (long i = threadIdx.x * 8L; i < vreal; i += blockDim.x * 8L) { float g[8], gm = -INFINITY; ld8(row, i, g); \
        _Pragma("unroll") for (int e = 0; e < 8; e++) { g[e] = i + e < vreal ? g[e] * LOG2E : -INFINITY; gm = fmaxf(gm, g[e]); } \
        if (gm > -INFINITY) { float mn = fmaxf(m, gm); z *= ex2(m - mn); m = mn; \
            _Pragma("unroll") for (int e = 0; e < 8; e++) z += ex2(g[e] - mn); } } \
    float mb = block_max(m); z = block_sum(m == -INFINITY ? 0.f : z * ex2(m - mb)); m = mb; \
    float l = m * LN2 + logf(z); bool off = (long long)t == ignore || mk == 0.f; \
    if (threadIdx.x == 0) { lse[r] = l; loss[r] = off ? 0.f : mk * (l - xt); } \
    float gs = off ? 0.f : dscale * mk; long tc = (long)t; \
    for (long i = threadIdx.x * 8L; i < v; i += blockDim.x * 8L) { float x[8]; ld8(row, i, x); \
        _Pragma("unroll") for (int e = 0; e < 8; e++) \
            x[e] = (off || i + e >= vreal) ? 0.f : (ex2((x[e] - l) * LOG2E) - (i + e == tc ? 1.f : 0.f)) * gs; \
        st8(row, i, x); } }
FOR_TYPES(LOSS_FB_V8)

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
