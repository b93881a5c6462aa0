// Straightforward fused attention (correct, not fast; flash tiling is the next issue's work).
// One block per (batch, query head, query row); the row's scores live in dynamic shared memory
// (S floats). Layouts: q/o/do [B,T,Hq,D], k/v [B,S,Hkv,D], lse [B,Hq,T]. Backward adds dk/dv with
// fp32 atomics into [B,S,Hkv,D] buffers that the host casts afterwards.

__device__ __forceinline__ bool allowed(long i, long j, long causal, long window) {
    if (causal && j > i) return false;
    if (window > 0) { long d = i > j ? i - j : j - i; if (d >= window) return false; }
    return true;
}

#define ATTN(s, T) \
extern "C" __global__ void attn_fwd_##s(const T* q, const T* k, const T* v, T* o, float* lse, long t, long sl, long hq, long hkv, long d, \
                                         float scale, long causal, long window) { \
    extern __shared__ float sc[]; \
    long i = blockIdx.x % t, h = (blockIdx.x / t) % hq, b = blockIdx.x / (t * hq), kvh = h / (hq / hkv); \
    const T* qi = q + ((b * t + i) * hq + h) * d; \
    float m = -INFINITY; \
    for (long j = threadIdx.x; j < sl; j += blockDim.x) { float a = -INFINITY; \
        if (allowed(i, j, causal, window)) { const T* kj = k + ((b * sl + j) * hkv + kvh) * d; a = 0.f; \
            for (long e = 0; e < d; e++) a += ld(qi, e) * ld(kj, e); a *= scale; } \
        sc[j] = a; m = fmaxf(m, a); } \
    m = block_max(m); float z = 0.f; \
    for (long j = threadIdx.x; j < sl; j += blockDim.x) { float p = sc[j] == -INFINITY ? 0.f : expf(sc[j] - m); sc[j] = p; z += p; } \
    z = block_sum(z); \
    for (long e = threadIdx.x; e < d; e += blockDim.x) { float acc = 0.f; \
        for (long j = 0; j < sl; j++) if (sc[j] != 0.f) acc += sc[j] * ld(v, ((b * sl + j) * hkv + kvh) * d + e); \
        st(o, ((b * t + i) * hq + h) * d + e, acc / z); } \
    if (threadIdx.x == 0) lse[(b * hq + h) * t + i] = m + logf(z); } \
extern "C" __global__ void attn_bwd_##s(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, \
                                         float* dq, float* dk, float* dv, long t, long sl, long hq, long hkv, long d, \
                                         float scale, long causal, long window) { \
    extern __shared__ float sc[]; \
    long i = blockIdx.x % t, h = (blockIdx.x / t) % hq, b = blockIdx.x / (t * hq), kvh = h / (hq / hkv); \
    long qo = ((b * t + i) * hq + h) * d; float l = lse[(b * hq + h) * t + i]; \
    float di = 0.f; \
    for (long e = threadIdx.x; e < d; e += blockDim.x) di += ld(dout, qo + e) * ld(o, qo + e); \
    di = block_sum(di); \
    for (long j = threadIdx.x; j < sl; j += blockDim.x) { float ds = 0.f; \
        if (allowed(i, j, causal, window)) { long ko = ((b * sl + j) * hkv + kvh) * d; float a = 0.f, dp = 0.f; \
            for (long e = 0; e < d; e++) { a += ld(q, qo + e) * ld(k, ko + e); dp += ld(dout, qo + e) * ld(v, ko + e); } \
            float p = expf(a * scale - l); ds = p * (dp - di); \
            for (long e = 0; e < d; e++) { atomicAdd(dv + ko + e, p * ld(dout, qo + e)); atomicAdd(dk + ko + e, scale * ds * ld(q, qo + e)); } } \
        sc[j] = ds; } \
    __syncthreads(); \
    for (long e = threadIdx.x; e < d; e += blockDim.x) { float acc = 0.f; \
        for (long j = 0; j < sl; j++) if (sc[j] != 0.f) acc += sc[j] * ld(k, ((b * sl + j) * hkv + kvh) * d + e); \
        dq[qo + e] = scale * acc; } }
FOR_TYPES(ATTN)
