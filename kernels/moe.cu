// Mixture-of-experts routing (crates/kernels/src/cpu/moe.rs has the math and the shapes): one
// warp per token row for the router's kernels (a row is E logits, E small), grid-stride for the
// combine. Indices (experts, slot) are u32; an out-of-range slot or expert index is skipped, not
// followed (the host does not read them back to check them on a GPU).

__device__ __forceinline__ float moe_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The larger (value, index), ties to the lower index; index −1 is "none".
__device__ __forceinline__ void moe_warp_argmax(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        bool better = i2 >= 0 && (i < 0 || v2 > v || (v2 == v && i2 < i));
        if (better) { v = v2; i = i2; }
    }
}

// A per-expert score function's f(x) (score 1: sigmoid, 2: √softplus) and f'(x) from x and f.
__device__ __forceinline__ float moe_score(long score, float x) {
    return score == 2 ? sqrtf(x > 20.f ? x : log1pf(expf(x))) : 1.f / (1.f + expf(-x));
}
__device__ __forceinline__ float moe_dscore(long score, float x, float f) {
    if (score == 2) return f > 0.f ? 1.f / (1.f + expf(-x)) / (2.f * f) : 0.f;
    return f * (1.f - f);
}

// The best entry of v[0..n) that comes after (pv, pi) in the order (value descending, index
// ascending): repeated, the entries in that order without marking any taken. One thread.
__device__ __forceinline__ int moe_next_best(const float* v, long n, float pv, int pi) {
    int best = -1;
    for (long c = 0; c < n; c++) {
        float x = v[c];
        bool after = pi < 0 || x < pv || (x == pv && (int)c > pi);
        if (after && (best < 0 || x > v[best])) best = (int)c;
    }
    return best;
}

// Group-limited routing on the row's selection scores `sel` [e] in shared memory: each group
// of e / groups scored by the sum of its k / gtopk best, the gtopk best groups kept and the
// other experts set to −∞. `gs` [groups] is the groups' scores' shared scratch.
__device__ void moe_limit_groups(float* sel, float* gs, long e, long groups, long gtopk, long k, int lane) {
    long size = e / groups, per = k / gtopk;
    if (per < 1) per = 1;
    if (per > size) per = size;
    for (long g = lane; g < groups; g += 32) {
        const float* v = sel + g * size;
        float sum = 0.f, pv = 0.f; int pi = -1;
        for (long j = 0; j < per; j++) { pi = moe_next_best(v, size, pv, pi); if (pi < 0) break; pv = v[pi]; sum += pv; }
        gs[g] = sum;
    }
    __syncwarp();
    // Lane 0 marks the chosen groups (at most 256: their score set to +∞ after the scan, the
    // others' to −∞).
    if (lane == 0) {
        float pv = 0.f; int pi = -1; unsigned chosen[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (long j = 0; j < gtopk; j++) { pi = moe_next_best(gs, groups, pv, pi); if (pi < 0) break; pv = gs[pi]; chosen[pi >> 5] |= 1u << (pi & 31); }
        for (long g = 0; g < groups; g++) gs[g] = (chosen[g >> 5] >> (g & 31)) & 1u ? INFINITY : -INFINITY;
    }
    __syncwarp();
    for (long c = lane; c < e; c += 32) if (gs[c / size] < 0.f) sel[c] = -INFINITY;
    __syncwarp();
}

// Shared memory of moe_route: e selection scores and the groups' scores.
#define MOE(s, T) \
extern "C" __global__ void moe_route_##s(const T* logits, const float* bias, float* probs, u32* experts, long e, long k, long pre, float scale, long score, long groups, long gtopk) { \
    extern __shared__ float moe_sel[]; \
    long r = blockIdx.x; const T* x = logits + r * e; u32* ix = experts + r * k; int lane = threadIdx.x; \
    float m = -INFINITY, z = 1.f; \
    if (score == 0 && pre) { \
        for (long c = lane; c < e; c += 32) m = fmaxf(m, ld(x, c)); m = moe_warp_max(m); \
        z = 0.f; for (long c = lane; c < e; c += 32) z += expf(ld(x, c) - m); z = warp_sum(z); } \
    for (long c = lane; c < e; c += 32) { float xv = ld(x, c); \
        float v = score == 0 ? (pre ? expf(xv - m) / z : xv) : moe_score(score, xv); \
        moe_sel[c] = bias ? v + bias[c] : v; } \
    __syncwarp(); \
    if (groups > 0) moe_limit_groups(moe_sel, moe_sel + e, e, groups, gtopk, k, lane); \
    for (long j = 0; j < k; j++) { \
        float v = -INFINITY; int best = -1; \
        for (long c = lane; c < e; c += 32) { \
            bool taken = false; for (long q = 0; q < j; q++) taken |= ix[q] == (u32)c; \
            float sv = moe_sel[c]; \
            if (!taken && (best < 0 || sv > v)) { v = sv; best = (int)c; } } \
        moe_warp_argmax(v, best); \
        if (lane == 0) ix[j] = (u32)(best < 0 ? 0 : best); \
        __syncwarp(); } \
    if (score == 0 && pre) { \
        for (long j = lane; j < k; j += 32) probs[r * k + j] = scale * expf(ld(x, ix[j]) - m) / z; \
    } else if (score == 0) { \
        float m = ld(x, ix[0]), z = 0.f; for (long j = 0; j < k; j++) z += expf(ld(x, ix[j]) - m); \
        for (long j = lane; j < k; j += 32) probs[r * k + j] = scale * expf(ld(x, ix[j]) - m) / z; \
    } else { \
        float d = 0.f; for (long j = 0; j < k; j++) d += moe_score(score, ld(x, ix[j])); \
        d = k > 1 ? d + 1e-20f : 1.f; \
        for (long j = lane; j < k; j += 32) probs[r * k + j] = scale * moe_score(score, ld(x, ix[j])) / d; } } \
extern "C" __global__ void moe_route_bwd_##s(const T* logits, const u32* experts, const float* dprobs, T* dlogits, long e, long k, long pre, float scale, long score) { \
    long r = blockIdx.x; const T* x = logits + r * e; const u32* ix = experts + r * k; const float* dp = dprobs + r * k; int lane = threadIdx.x; \
    if (score != 0) { \
        /* p_j = scale · f_j / D (D = Σ f + ε) when k > 1, else scale · f_j. */ \
        float d = 0.f, dot = 0.f; \
        for (long j = 0; j < k; j++) if (ix[j] < (u32)e) { float f = moe_score(score, ld(x, ix[j])); d += f; dot += f * dp[j]; } \
        d += 1e-20f; \
        for (long c = lane; c < e; c += 32) { float v = 0.f; \
            for (long j = 0; j < k; j++) if (ix[j] == (u32)c) { float xv = ld(x, c), f = moe_score(score, xv); \
                float ds = k > 1 ? scale * (dp[j] / d - dot / (d * d)) : scale * dp[j]; v += ds * moe_dscore(score, xv, f); } \
            st(dlogits, r * e + c, v); } \
    } else if (pre) { \
        float m = -INFINITY; for (long c = lane; c < e; c += 32) m = fmaxf(m, ld(x, c)); m = moe_warp_max(m); \
        float z = 0.f; for (long c = lane; c < e; c += 32) z += expf(ld(x, c) - m); z = warp_sum(z); \
        float dot = 0.f; for (long j = 0; j < k; j++) if (ix[j] < (u32)e) dot += expf(ld(x, ix[j]) - m) / z * scale * dp[j]; \
        for (long c = lane; c < e; c += 32) { float g = 0.f; for (long j = 0; j < k; j++) if (ix[j] == (u32)c) g += scale * dp[j]; \
            st(dlogits, r * e + c, expf(ld(x, c) - m) / z * (g - dot)); } \
    } else { \
        float m = -INFINITY; for (long j = 0; j < k; j++) if (ix[j] < (u32)e) m = fmaxf(m, ld(x, ix[j])); \
        float z = 0.f; for (long j = 0; j < k; j++) if (ix[j] < (u32)e) z += expf(ld(x, ix[j]) - m); \
        float dot = 0.f; for (long j = 0; j < k; j++) if (ix[j] < (u32)e) dot += expf(ld(x, ix[j]) - m) / z * scale * dp[j]; \
        for (long c = lane; c < e; c += 32) { float v = 0.f; \
            for (long j = 0; j < k; j++) if (ix[j] == (u32)c) v = expf(ld(x, c) - m) / z * (scale * dp[j] - dot); \
            st(dlogits, r * e + c, v); } } } \
extern "C" __global__ void moe_router_loss_##s(const T* logits, const float* counts, float* dlogits, float* values, long e, long n, float w, float aux, float zc, float gs, long score, long rows_per_seq) { \
    long r = blockIdx.x; const T* x = logits + r * e; int lane = threadIdx.x; \
    counts += (r / rows_per_seq) * e; /* the row's sequence's counts (one sequence: all rows) */ \
    float m = -INFINITY; for (long c = lane; c < e; c += 32) m = fmaxf(m, ld(x, c)); m = moe_warp_max(m); \
    float z = 0.f; for (long c = lane; c < e; c += 32) z += expf(ld(x, c) - m); z = warp_sum(z); \
    /* The load-balancing probabilities: the softmax, or f(x) / D (D = Σ f + ε). */ \
    float d = 1.f; \
    if (score != 0) { d = 0.f; for (long c = lane; c < e; c += 32) d += moe_score(score, ld(x, c)); d = warp_sum(d) + 1e-20f; } \
    float sc = 0.f; for (long c = lane; c < e; c += 32) { float xv = ld(x, c); \
        sc += (score == 0 ? expf(xv - m) / z : moe_score(score, xv) / d) * counts[c]; } sc = warp_sum(sc); \
    float lse = m + logf(z), dz = zc * 2.f * lse / (float)n; \
    for (long c = lane; c < e; c += 32) { float xv = ld(x, c), sm = expf(xv - m) / z; \
        float daux = score == 0 ? sm * (w * counts[c] - w * sc) : moe_dscore(score, xv, moe_score(score, xv)) * (w * counts[c] - w * sc) / d; \
        dlogits[r * e + c] = gs * (aux * daux + dz * sm); } \
    if (lane == 0) { atomicAdd(values, w * sc); atomicAdd(values + 1, lse * lse / (float)n); } } \
/* rows: yp's (fewer than n·k when a capacity dropped copies); a slot at or past it (DROPPED) is a \
   dropped copy: it adds nothing, has no dyp row and a zero dprobs. */ \
extern "C" __global__ void moe_unpermute_##s(const T* yp, const u32* slot, const float* probs, T* y, long n, long k, long c, long rows) { \
    GRID_STRIDE(i, n * c) { long t = i / c, col = i % c; float a = 0.f; \
        for (long j = 0; j < k; j++) { long row = slot[t * k + j]; if (row < rows) a += probs[t * k + j] * ld(yp, row * c + col); } \
        st(y, i, a); } } \
extern "C" __global__ void moe_unpermute_bwd_dyp_##s(const T* dy, const u32* slot, const float* probs, T* dyp, long n, long k, long c, long rows) { \
    GRID_STRIDE(i, n * k * c) { long tj = i / c, col = i % c, t = tj / k; long row = slot[tj]; \
        if (row < rows) st(dyp, row * c + col, probs[tj] * ld(dy, t * c + col)); } } \
extern "C" __global__ void moe_unpermute_bwd_dp_##s(const T* yp, const u32* slot, const T* dy, float* dprobs, long n, long k, long c, long rows) { \
    long tj = blockIdx.x, t = tj / k; long row = slot[tj]; int lane = threadIdx.x; float a = 0.f; \
    if (row < rows) for (long col = lane; col < c; col += 32) a += ld(yp, row * c + col) * ld(dy, t * c + col); \
    a = warp_sum(a); if (lane == 0) dprobs[tj] = a; }
FOR_TYPES(MOE)
