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

#define MOE(s, T) \
extern "C" __global__ void moe_route_##s(const T* logits, float* probs, u32* experts, long e, long k, int pre, float scale) { \
    long r = blockIdx.x; const T* x = logits + r * e; u32* ix = experts + r * k; int lane = threadIdx.x; \
    for (long j = 0; j < k; j++) { \
        float v = -INFINITY; int best = -1; \
        for (long c = lane; c < e; c += 32) { \
            bool taken = false; for (long q = 0; q < j; q++) taken |= ix[q] == (u32)c; \
            float xv = ld(x, c); \
            if (!taken && (best < 0 || xv > v)) { v = xv; best = (int)c; } } \
        moe_warp_argmax(v, best); \
        if (lane == 0) ix[j] = (u32)(best < 0 ? 0 : best); \
        __syncwarp(); } \
    if (pre) { \
        float m = -INFINITY; for (long c = lane; c < e; c += 32) m = fmaxf(m, ld(x, c)); m = moe_warp_max(m); \
        float z = 0.f; for (long c = lane; c < e; c += 32) z += expf(ld(x, c) - m); z = warp_sum(z); \
        for (long j = lane; j < k; j += 32) probs[r * k + j] = scale * expf(ld(x, ix[j]) - m) / z; \
    } else { \
        float m = ld(x, ix[0]), z = 0.f; for (long j = 0; j < k; j++) z += expf(ld(x, ix[j]) - m); \
        for (long j = lane; j < k; j += 32) probs[r * k + j] = scale * expf(ld(x, ix[j]) - m) / z; } } \
extern "C" __global__ void moe_route_bwd_##s(const T* logits, const u32* experts, const float* dprobs, T* dlogits, long e, long k, int pre, float scale) { \
    long r = blockIdx.x; const T* x = logits + r * e; const u32* ix = experts + r * k; const float* dp = dprobs + r * k; int lane = threadIdx.x; \
    if (pre) { \
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
extern "C" __global__ void moe_router_loss_##s(const T* logits, const float* counts, float* dlogits, float* values, long e, long n, float w, float aux, float zc, float gs) { \
    long r = blockIdx.x; const T* x = logits + r * e; int lane = threadIdx.x; \
    float m = -INFINITY; for (long c = lane; c < e; c += 32) m = fmaxf(m, ld(x, c)); m = moe_warp_max(m); \
    float z = 0.f; for (long c = lane; c < e; c += 32) z += expf(ld(x, c) - m); z = warp_sum(z); \
    float sc = 0.f; for (long c = lane; c < e; c += 32) sc += expf(ld(x, c) - m) / z * counts[c]; sc = warp_sum(sc); \
    float lse = m + logf(z), dz = zc * 2.f * lse / (float)n; \
    for (long c = lane; c < e; c += 32) { float sm = expf(ld(x, c) - m) / z; \
        dlogits[r * e + c] = gs * (aux * sm * (w * counts[c] - w * sc) + dz * sm); } \
    if (lane == 0) { atomicAdd(values, w * sc); atomicAdd(values + 1, lse * lse / (float)n); } } \
extern "C" __global__ void moe_unpermute_##s(const T* yp, const u32* slot, const float* probs, T* y, long n, long k, long c) { \
    GRID_STRIDE(i, n * c) { long t = i / c, col = i % c; float a = 0.f; \
        for (long j = 0; j < k; j++) { u32 row = slot[t * k + j]; if (row < (u32)(n * k)) a += probs[t * k + j] * ld(yp, (long)row * c + col); } \
        st(y, i, a); } } \
extern "C" __global__ void moe_unpermute_bwd_dyp_##s(const T* dy, const u32* slot, const float* probs, T* dyp, long n, long k, long c) { \
    GRID_STRIDE(i, n * k * c) { long tj = i / c, col = i % c, t = tj / k; u32 row = slot[tj]; \
        if (row < (u32)(n * k)) st(dyp, (long)row * c + col, probs[tj] * ld(dy, t * c + col)); } } \
extern "C" __global__ void moe_unpermute_bwd_dp_##s(const T* yp, const u32* slot, const T* dy, float* dprobs, long n, long k, long c) { \
    long tj = blockIdx.x, t = tj / k; u32 row = slot[tj]; int lane = threadIdx.x; float a = 0.f; \
    if (row < (u32)(n * k)) for (long col = lane; col < c; col += 32) a += ld(yp, (long)row * c + col) * ld(dy, t * c + col); \
    a = warp_sum(a); if (lane == 0) dprobs[tj] = a; }
FOR_TYPES(MOE)
