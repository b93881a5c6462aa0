// Straightforward fused attention (correct, not fast; flash tiling is the next issue's work).
// One block per (batch, query head, query row); the row's scores live in dynamic shared memory
// (S floats). Layouts: q/o/do [B,T,Hq,D], k/v [B,S,Hkv,D], lse [B,Hq,T]. Backward adds dk/dv with
// fp32 atomics into [B,S,Hkv,D] buffers that the host casts afterwards; in deterministic mode
// (`atomics` 0) it leaves them to attn_bwd_kv, which sums each key row's terms in a fixed order.

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
                                         float scale, long causal, long window, long atomics) { \
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
            if (atomics) for (long e = 0; e < d; e++) { atomicAdd(dv + ko + e, p * ld(dout, qo + e)); atomicAdd(dk + ko + e, scale * ds * ld(q, qo + e)); } } \
        sc[j] = ds; } \
    __syncthreads(); \
    for (long e = threadIdx.x; e < d; e += blockDim.x) { float acc = 0.f; \
        for (long j = 0; j < sl; j++) if (sc[j] != 0.f) acc += sc[j] * ld(k, ((b * sl + j) * hkv + kvh) * d + e); \
        dq[qo + e] = scale * acc; } } \
/* One block per (batch, kv head, key row j), blockDim.x rows of queries at a time: each thread \
   recomputes p and ds of its query row (the group's heads in turn) into shared memory, then each \
   column e of dk/dv (accumulated in shared memory, 2·d floats after the 2·blockDim.x of p and ds) \
   adds them in query order: the same sum in the same order on every run. */ \
extern "C" __global__ void attn_bwd_kv_##s(const T* q, const T* k, const T* v, const T* o, const float* lse, \
                                            const T* dout, float* dk, float* dv, long t, long sl, long hq, long hkv, \
                                            long d, float scale, long causal, long window) { \
    extern __shared__ float sc[]; \
    const long n = blockDim.x; float *ps = sc, *dss = sc + n, *ak = sc + 2 * n, *av = ak + d; \
    long j = blockIdx.x % sl, kvh = (blockIdx.x / sl) % hkv, b = blockIdx.x / (sl * hkv), g = hq / hkv; \
    long ko = ((b * sl + j) * hkv + kvh) * d; \
    for (long e = threadIdx.x; e < d; e += n) { ak[e] = 0.f; av[e] = 0.f; } \
    for (long h = kvh * g; h < (kvh + 1) * g; h++) \
        for (long i0 = 0; i0 < t; i0 += n) { \
            long i = i0 + threadIdx.x; float p = 0.f, ds = 0.f; \
            if (i < t && allowed(i, j, causal, window)) { long qo = ((b * t + i) * hq + h) * d; \
                float a = 0.f, dp = 0.f, di = 0.f; \
                for (long e = 0; e < d; e++) { float g_ = ld(dout, qo + e); \
                    a += ld(q, qo + e) * ld(k, ko + e); dp += g_ * ld(v, ko + e); di += g_ * ld(o, qo + e); } \
                p = expf(a * scale - lse[(b * hq + h) * t + i]); ds = p * (dp - di); } \
            __syncthreads(); /* the last chunk's terms are read */ \
            ps[threadIdx.x] = p; dss[threadIdx.x] = ds; \
            __syncthreads(); \
            for (long e = threadIdx.x; e < d; e += n) { float sv = av[e], sk = ak[e]; \
                for (long c = 0; c < n && i0 + c < t; c++) if (ps[c] != 0.f) { long qo = ((b * t + i0 + c) * hq + h) * d; \
                    sv += ps[c] * ld(dout, qo + e); sk += scale * dss[c] * ld(q, qo + e); } \
                av[e] = sv; ak[e] = sk; } } \
    for (long e = threadIdx.x; e < d; e += n) { dk[ko + e] = ak[e]; dv[ko + e] = av[e]; } }
FOR_TYPES(ATTN)
