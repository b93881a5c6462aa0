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

// Attention dropout (the rule is the host's cpu/attention.rs `AttnDropout`): probability (i, j)
// of head H = hoff + h of batch row b takes word ((i mod 16) div 8) · 2 + (j mod 16) div 8 of
// Philox block base + b · bstride + ((H · ⌈t/16⌉ + ⌊i/16⌋) · ⌈sl/16⌉ + ⌊j/16⌋) · 64 + (i mod 8) · 8
// + j mod 8, and is kept, times `scale` (1 / (1 − p)), where that word's top 24 bits are at least
// `thr` (⌈p · 2²⁴⌉). thr = 0: no dropout (the reference and SIMT kernels take a key always and
// test it; the tensor-core kernels have `_drop` builds). Passed by value, as the host's
// `AttnDropArgs` lays it out.
struct AttnDrop {
    unsigned long long seed, stream, base, bstride, hoff;
    u32 thr;
    float scale;
};
// Block of cell 0 of the 16 × 16 tile (ti, tj) of local head h of batch row b.
__device__ __forceinline__ unsigned long long drop_tile(const AttnDrop& d, long b, long h, long ti, long tj, long t,
                                                        long sl) {
    const unsigned long long tt = (t + 15) / 16, st = (sl + 15) / 16;
    return d.base + (unsigned long long)b * d.bstride + ((d.hoff + h) * tt + ti) * st * 64 + (unsigned long long)tj * 64;
}
__device__ __forceinline__ float drop_mul(const AttnDrop& d, u32 w) { return (w >> 8) >= d.thr ? d.scale : 0.f; }
// One probability's multiplier: a Philox call each (the reference and SIMT kernels).
__device__ __forceinline__ float drop_at(const AttnDrop& d, long b, long h, long i, long j, long t, long sl) {
    const uint4 w = philox4(d.seed, d.stream, drop_tile(d, b, h, i >> 4, j >> 4, t, sl) + (i & 7) * 8 + (j & 7));
    return drop_mul(d, lane_of(w, (int)(((i >> 3) & 1) * 2 + ((j >> 3) & 1))));
}
// The tensor-core kernels' accumulator fragments (mma.sync m16n8k16 and wgmma alike): a thread
// holds rows g and g + 8 of a 16-row tile (g = lane / 4) and columns 8·nb + 2·tg + {0, 1} (tg =
// lane % 4), so of 16 columns (nb = 2ks, 2ks + 1) it holds, for c = 0 and 1, the cell {g, g + 8}
// × {2tg + c, 2tg + c + 8}: one Philox block, used whole. Calls f(nb, e, multiplier) for the NB
// blocks of 8 columns of `frag[nb][e]`. TR: the rows are keys and the columns queries (the dK/dV
// kernels' Sᵀ), else rows are queries. `tile0`: drop_tile of the first 16 columns; `step`: blocks
// from one 16-column tile to the next (64 for key columns, ⌈sl/16⌉ · 64 for query columns).
template <bool TR, int NB, class F>
__device__ __forceinline__ void drop_frag(const AttnDrop& d, unsigned long long tile0, unsigned long long step, int g,
                                          int tg, F f) {
#pragma unroll
    for (int ks = 0; ks < NB / 2; ks++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const unsigned long long cell = TR ? (2 * tg + c) * 8 + g : g * 8 + 2 * tg + c;
            const uint4 w = philox4(d.seed, d.stream, tile0 + ks * step + cell);
#pragma unroll
            for (int x = 0; x < 2; x++)
#pragma unroll
                for (int y = 0; y < 2; y++) f(2 * ks + x, 2 * y + c, drop_mul(d, lane_of(w, TR ? x * 2 + y : y * 2 + x)));
        }
}

#define ATTN(s, T) \
extern "C" __global__ void attn_fwd_##s(const T* q, const T* k, const T* v, T* o, float* lse, long t, long sl, long hq, long hkv, long d, \
                                         float scale, long causal, long window, AttnDrop dr) { \
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
    if (dr.thr) { for (long j = threadIdx.x; j < sl; j += blockDim.x) sc[j] *= drop_at(dr, b, h, i, j, t, sl); __syncthreads(); } \
    for (long e = threadIdx.x; e < d; e += blockDim.x) { float acc = 0.f; \
        for (long j = 0; j < sl; j++) if (sc[j] != 0.f) acc += sc[j] * ld(v, ((b * sl + j) * hkv + kvh) * d + e); \
        st(o, ((b * t + i) * hq + h) * d + e, acc / z); } \
    if (threadIdx.x == 0) lse[(b * hq + h) * t + i] = m + logf(z); } \
extern "C" __global__ void attn_bwd_##s(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, \
                                         float* dq, float* dk, float* dv, long t, long sl, long hq, long hkv, long d, \
                                         float scale, long causal, long window, long atomics, AttnDrop dr) { \
    extern __shared__ float sc[]; \
    long i = blockIdx.x % t, h = (blockIdx.x / t) % hq, b = blockIdx.x / (t * hq), kvh = h / (hq / hkv); \
    long qo = ((b * t + i) * hq + h) * d; float l = lse[(b * hq + h) * t + i]; \
    float di = 0.f; \
    for (long e = threadIdx.x; e < d; e += blockDim.x) di += ld(dout, qo + e) * ld(o, qo + e); \
    di = block_sum(di); \
    for (long j = threadIdx.x; j < sl; j += blockDim.x) { float ds = 0.f; \
        if (allowed(i, j, causal, window)) { long ko = ((b * sl + j) * hkv + kvh) * d; float a = 0.f, dp = 0.f; \
            for (long e = 0; e < d; e++) { a += ld(q, qo + e) * ld(k, ko + e); dp += ld(dout, qo + e) * ld(v, ko + e); } \
            float p = expf(a * scale - l), mul = dr.thr ? drop_at(dr, b, h, i, j, t, sl) : 1.f; ds = p * (dp * mul - di); \
            if (atomics) for (long e = 0; e < d; e++) { atomicAdd(dv + ko + e, p * mul * ld(dout, qo + e)); atomicAdd(dk + ko + e, scale * ds * ld(q, qo + e)); } } \
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
                                            long d, float scale, long causal, long window, AttnDrop dr) { \
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
                const float mul = dr.thr ? drop_at(dr, b, h, i, j, t, sl) : 1.f; \
                p = expf(a * scale - lse[(b * hq + h) * t + i]); ds = p * (dp * mul - di); p *= mul; } \
            __syncthreads(); /* the last chunk's terms are read */ \
            ps[threadIdx.x] = p; dss[threadIdx.x] = ds; \
            __syncthreads(); \
            for (long e = threadIdx.x; e < d; e += n) { float sv = av[e], sk = ak[e]; \
                for (long c = 0; c < n && i0 + c < t; c++) if (ps[c] != 0.f || dss[c] != 0.f) { long qo = ((b * t + i0 + c) * hq + h) * d; \
                    sv += ps[c] * ld(dout, qo + e); sk += scale * dss[c] * ld(q, qo + e); } \
                av[e] = sv; ak[e] = sk; } } \
    for (long e = threadIdx.x; e < d; e += n) { dk[ko + e] = ak[e]; dv[ko + e] = av[e]; } }
FOR_TYPES(ATTN)
