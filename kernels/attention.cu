// Straightforward fused attention (correct, not fast; flash tiling is the next issue's work).
// One block per (batch, query head, query row); the row's scores live in dynamic shared memory
// (S floats). Layouts: q/o/do [B,T,Hq,D], k/v [B,S,Hkv,D], lse [B,Hq,T]. Backward adds dk/dv with
// fp32 atomics into [B,S,Hkv,D] buffers that the host casts afterwards; in deterministic mode
// (`atomics` 0) it leaves them to attn_bwd_kv, which sums each key row's terms in a fixed order.
// `docs` (or null): document-wise masks, [B,T] u32, query i of row b sees keys j ≥ docs[b·T + i]
// (cpu/attention.rs `AttnMask::docs`); the tensor-core flash kernels take them too (flash.cu `doc_key_range`).

__device__ __forceinline__ bool allowed(long i, long j, long causal, long window) {
    if (causal && j > i) return false;
    if (window > 0) { long d = i > j ? i - j : j - i; if (d >= window) return false; }
    return true;
}
// `allowed` and the document mask of query i of batch row b (of t queries).
__device__ __forceinline__ bool allowed_doc(long b, long t, long i, long j, long causal, long window, const u32* docs) {
    return allowed(i, j, causal, window) && (!docs || j >= (long)docs[b * t + i]);
}

// Attention dropout (the rule is the host's cpu/attention.rs `AttnDropout`): probability (i, j)
// of head H = hoff + h of batch row b is half j mod 2 (low 16 bits first) of word
// ((i mod 16) div 8) · 2 + (j mod 16) div 8 of Philox block base + b · bstride + ((H · ⌈t/16⌉ +
// ⌊i/16⌋) · ⌈sl/16⌉ + ⌊j/16⌋) · 32 + (i mod 8) · 4 + (j mod 8) div 2 (Philox-4x32-7: ATTN_ROUNDS),
// and is kept, times `scale` (1 / (1 − p)), where that half is at least `thr` (⌈p · 2¹⁶⌉). thr =
// 0: no dropout (the reference and SIMT kernels take a key always and test it; the tensor-core
// kernels have `_drop` builds). Passed by value, as the host's `AttnDropArgs` lays it out;
// `shift` (or null) points at samples to add to the first sample `base` was worked out for (a
// replayed CUDA graph's step), applied by `drop_shifted` at each kernel's entry.
#define ATTN_ROUNDS 7  // cpu/attention.rs `AttnDropout::PHILOX_ROUNDS`
struct AttnDrop {
    unsigned long long seed, stream, base, bstride, hoff;
    u32 thr;
    float scale;
    const unsigned long long* shift;
    // The whole mask's query and key tile counts when the call is one block of it (context
    // parallelism; cpu/attention.rs `AttnDropout::tiles`), else 0: the call's ⌈t/16⌉, ⌈sl/16⌉.
    unsigned long long tiles_t, tiles_s;
};
// Key tiles a row of the mask spans (the stride from one query tile row to the next).
__device__ __forceinline__ unsigned long long drop_key_tiles(const AttnDrop& d, long sl) {
    return d.tiles_s ? d.tiles_s : (unsigned long long)(sl + 15) / 16;
}
__device__ __forceinline__ AttnDrop drop_shifted(AttnDrop d) {
    if (d.shift) d.base += *d.shift * d.bstride;
    return d;
}
// Block of the first probabilities of the 16 × 16 tile (ti, tj) of local head h of batch row b.
__device__ __forceinline__ unsigned long long drop_tile(const AttnDrop& d, long b, long h, long ti, long tj, long t,
                                                        long sl) {
    const unsigned long long tt = d.tiles_t ? d.tiles_t : (t + 15) / 16, st = drop_key_tiles(d, sl);
    return d.base + (unsigned long long)b * d.bstride + ((d.hoff + h) * tt + ti) * st * 32 + (unsigned long long)tj * 32;
}
// The multiplier of half `hi` (0 or 1) of word w.
__device__ __forceinline__ float drop_mul(const AttnDrop& d, u32 w, int hi) {
    return ((hi ? w >> 16 : w & 0xffffu) >= d.thr) ? d.scale : 0.f;
}
// One probability's multiplier: a Philox call each (the reference and SIMT kernels).
__device__ __forceinline__ float drop_at(const AttnDrop& d, long b, long h, long i, long j, long t, long sl) {
    const uint4 w = philox4<ATTN_ROUNDS>(d.seed, d.stream, drop_tile(d, b, h, i >> 4, j >> 4, t, sl) + (i & 7) * 4 + ((j & 7) >> 1));
    return drop_mul(d, lane_of(w, (int)(((i >> 3) & 1) * 2 + ((j >> 3) & 1))), (int)(j & 1));
}
// The tensor-core kernels' accumulator fragments (mma.sync m16n8k16 and wgmma alike): a thread
// holds rows g and g + 8 of a 16-row tile (g = lane / 4) and, of each 16 columns (nb = 2ks,
// 2ks + 1), columns {2tg, 2tg + 1} + {0, 8} (tg = lane % 4): element frag[2ks + x][2y + c] is row
// g + 8y, column 16ks + 8x + 2tg + c. Calls f(nb, e, multiplier) for the NB blocks of 8 columns.
// Rows = queries (TR false: the forward, dQ): the thread's eight probabilities of 16 columns are
// one Philox block. Rows = keys (TR: the dK/dV kernels' Sᵀ): a block holds two keys (g, g ^ 1)
// × two queries, so the threads g and g ^ 1 (lanes 4 apart) each compute one, queries 2tg + (g &
// 1), and swap the halves the other needs (two shuffles). `tile0`: drop_tile of the first 16
// columns; `step`: blocks from one 16-column tile to the next (32 for key columns, ⌈sl/16⌉ · 32
// for query columns).
template <bool TR, int NB, class F>
__device__ __forceinline__ void drop_frag(const AttnDrop& d, unsigned long long tile0, unsigned long long step, int g,
                                          int tg, F f) {
#pragma unroll
    for (int ks = 0; ks < NB / 2; ks++) {
        if constexpr (!TR) {
            const uint4 w4 = philox4<ATTN_ROUNDS>(d.seed, d.stream, tile0 + ks * step + g * 4 + tg);
            const u32 w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
            for (int x = 0; x < 2; x++)
#pragma unroll
                for (int y = 0; y < 2; y++)
#pragma unroll
                    for (int c = 0; c < 2; c++) f(2 * ks + x, 2 * y + c, drop_mul(d, w[y * 2 + x], c));
        } else {
            // Element (x, y, c): query 16ks + 8x + 2tg + c, key g + 8y: block (2tg + c) · 4 + g / 2,
            // word x · 2 + y, half g & 1. This thread computes c = g & 1; its neighbour g ^ 1 the
            // other, whose halves g & 1 it sends over (and receives this thread's in turn).
            const int own = g & 1;
            const uint4 w4 = philox4<ATTN_ROUNDS>(d.seed, d.stream, tile0 + ks * step + (2 * tg + own) * 4 + (g >> 1));
            // The halves the neighbour needs (1 − own), two to a word: words 0 and 1, then 2 and 3.
            const u32 sel = own ? 0x5410u : 0x7632u;
            const u32 r01 = __shfl_xor_sync(0xffffffffu, __byte_perm(w4.x, w4.y, sel), 4);
            const u32 r23 = __shfl_xor_sync(0xffffffffu, __byte_perm(w4.z, w4.w, sel), 4);
            const u32 mine[4] = {w4.x, w4.y, w4.z, w4.w};
            // Received: the neighbour's words 0 / 1 (2 / 3) in the low / high half of r01 (r23).
            const u32 theirs[4] = {r01, r01 >> 16, r23, r23 >> 16};
            // Elements c = 0 and 1 by selects, so every fragment index stays a constant (an index
            // depending on `own` would put the fragment in local memory).
#pragma unroll
            for (int x = 0; x < 2; x++)
#pragma unroll
                for (int y = 0; y < 2; y++) {
                    const u32 m = (mine[x * 2 + y] >> (16 * own)) & 0xffffu, o = theirs[x * 2 + y] & 0xffffu;
                    f(2 * ks + x, 2 * y, drop_mul(d, own ? o : m, 0));
                    f(2 * ks + x, 2 * y + 1, drop_mul(d, own ? m : o, 0));
                }
        }
    }
}

#define ATTN(s, T) \
extern "C" __global__ void attn_fwd_##s(const T* q, const T* k, const T* v, T* o, float* lse, long t, long sl, long hq, long hkv, long d, \
                                         float scale, long causal, long window, const u32* docs, AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    extern __shared__ float sc[]; \
    long i = blockIdx.x % t, h = (blockIdx.x / t) % hq, b = blockIdx.x / (t * hq), kvh = h / (hq / hkv); \
    const T* qi = q + ((b * t + i) * hq + h) * d; \
    float m = -INFINITY; \
    for (long j = threadIdx.x; j < sl; j += blockDim.x) { float a = -INFINITY; \
        if (allowed_doc(b, t, i, j, causal, window, docs)) { const T* kj = k + ((b * sl + j) * hkv + kvh) * d; a = 0.f; \
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
                                         float scale, long causal, long window, long atomics, const u32* docs, \
                                         AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    extern __shared__ float sc[]; \
    long i = blockIdx.x % t, h = (blockIdx.x / t) % hq, b = blockIdx.x / (t * hq), kvh = h / (hq / hkv); \
    long qo = ((b * t + i) * hq + h) * d; float l = lse[(b * hq + h) * t + i]; \
    float di = 0.f; \
    for (long e = threadIdx.x; e < d; e += blockDim.x) di += ld(dout, qo + e) * ld(o, qo + e); \
    di = block_sum(di); \
    for (long j = threadIdx.x; j < sl; j += blockDim.x) { float ds = 0.f; \
        if (allowed_doc(b, t, i, j, causal, window, docs)) { long ko = ((b * sl + j) * hkv + kvh) * d; float a = 0.f, dp = 0.f; \
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
                                            long d, float scale, long causal, long window, const u32* docs, \
                                            AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    extern __shared__ float sc[]; \
    const long n = blockDim.x; float *ps = sc, *dss = sc + n, *ak = sc + 2 * n, *av = ak + d; \
    long j = blockIdx.x % sl, kvh = (blockIdx.x / sl) % hkv, b = blockIdx.x / (sl * hkv), g = hq / hkv; \
    long ko = ((b * sl + j) * hkv + kvh) * d; \
    for (long e = threadIdx.x; e < d; e += n) { ak[e] = 0.f; av[e] = 0.f; } \
    for (long h = kvh * g; h < (kvh + 1) * g; h++) \
        for (long i0 = 0; i0 < t; i0 += n) { \
            long i = i0 + threadIdx.x; float p = 0.f, ds = 0.f; \
            if (i < t && allowed_doc(b, t, i, j, causal, window, docs)) { long qo = ((b * t + i) * hq + h) * d; \
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

// Context parallelism's combine (cpu/attn_merge.rs): (o, lse), f32, over some keys merged in
// place with (op, lsep) over disjoint ones. One block per (batch, query row, head), its threads
// along the head dim; o/op [B,T,H,D], lse/lsep [B,H,T]. Every thread reads the row's old lse
// before the barrier; thread 0 writes the new one after it.
#define ATTN_MERGE(s, T) \
extern "C" __global__ void attn_merge_##s(float* o, float* lse, const T* op, const float* lsep, long t, long h, long d) { \
    long row = blockIdx.x, hh = row % h, tt = (row / h) % t, bb = row / (h * t); \
    long li = (bb * h + hh) * t + tt; \
    float la = lse[li], lp = lsep[li], m = fmaxf(la, lp); \
    __syncthreads(); \
    if (m == -INFINITY) return; \
    float wa = __expf(la - m), wb = __expf(lp - m), s = wa + wb; \
    for (long i = threadIdx.x; i < d; i += blockDim.x) { \
        long j = row * d + i; \
        o[j] = (wa * o[j] + wb * ld(op, j)) / s; } \
    if (threadIdx.x == 0) lse[li] = m + logf(s); }
FOR_TYPES(ATTN_MERGE)

// The sink softmax (cpu/attn_sink.rs): one more logit sink[h] a head, a key with no value, on a
// finished (o, lse). One warp per (batch, row, head) row, its lanes along the head dim; o/do
// [B,T,H,D], sink [H] f32, lse f32 [n,B,H,T/n] (n = 1: [B,H,T]). Every lane reads the row's old
// lse before the warp's barrier; lane 0 writes the new one after it.
__device__ __forceinline__ long sink_lse_at(long row, long b, long t, long h, long n) {
    long hh = row % h, tt = (row / h) % t, bb = row / (h * t), c = t / n;
    return ((tt / c * b + bb) * h + hh) * c + tt % c;
}
__device__ __forceinline__ float log_add(float a, float b) {
    float m = fmaxf(a, b);
    return m == -INFINITY ? m : m + logf(expf(a - m) + expf(b - m));
}
#define ATTN_SINK(s, T) \
extern "C" __global__ void attn_sink_##s(T* o, float* lse, const float* sink, long b, long t, long h, long d, long n) { \
    long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32; \
    if (row >= b * t * h) return; \
    long li = sink_lse_at(row, b, t, h, n); \
    float l = lse[li], nl = log_add(l, sink[row % h]), f = expf(l - nl); \
    __syncwarp(); \
    for (long i = lane; i < d; i += 32) st(o, row * d + i, ld(o, row * d + i) * f); \
    if (lane == 0) lse[li] = nl; } \
extern "C" __global__ void attn_sink_bwd_##s(const T* o, const float* lse, const T* dout, const float* sink, \
                                             float* term, long b, long t, long h, long d, long n) { \
    long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32; \
    if (row >= b * t * h) return; \
    float dot = 0.f; \
    for (long i = lane; i < d; i += 32) dot += ld(o, row * d + i) * ld(dout, row * d + i); \
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off); \
    if (lane == 0) term[row] = -expf(sink[row % h] - lse[sink_lse_at(row, b, t, h, n)]) * dot; }
FOR_TYPES(ATTN_SINK)
