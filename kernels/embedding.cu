// Embedding lookup and its scatter-add backward (fp32 atomics into main_grad, or under
// deterministic mode `embedding_bwd_rows`: every row's additions in position order; into a bf16
// main_grad through a persistent f32 scratch, `embedding_bwd_flag` then `embedding_flush`); on a
// vocabulary shard (rows vstart..vstart+vrows) other ids give zero rows and no gradient. And the
// QKV split/merge between Megatron's grouped layout and per-head tensors.

// QKV: the fused tensor is [rows][group][slot][d] with slots 0..g-1 the group's query heads, g its
// key, g + 1 its value. One warp per (row, group, slot) segment of d elements: the index
// arithmetic (64-bit divisions) happens once per segment, and lanes copy consecutive elements.
#define QKV_SEGMENTS(n, hkv, g) \
    long lane = threadIdx.x & 31, segs = (n) * (hkv) * ((g) + 2); \
    for (long w = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < segs; w += ((long)gridDim.x * blockDim.x) >> 5)

// The per-head tensor segment `w` of the fused layout belongs to (q [rows, hkv·g, d], k/v [rows, hkv, d]).
template <typename P>
__device__ __forceinline__ P* qkv_head(P* q, P* k, P* v, long w, long g, long d) {
    long slot = w % (g + 2), rg = w / (g + 2);  // rg = row · hkv + group
    return slot < g ? q + (rg * g + slot) * d : (slot == g ? k : v) + rg * d;
}

// The deterministic scatter-add: block b owns rows [64b, 64b + 64) of the shard and scans all n
// ids in order, 256 at a time; the positions whose id falls in its rows are compacted in order
// (warp ballots, then the warps' counts added up), and the block adds their dout rows one after
// another. Each row thus sums its positions in increasing order, as the CPU's loop does: the same
// bits every run, and the CPU's for an f32 dout. (Reading all ids per block costs 64 KB of L2
// reads a block at 16k positions.)
#define EMB_ROWS 64
template <typename T>
__device__ __forceinline__ void embedding_bwd_rows_impl(const u32* ids, const T* dout, float* dtable, long n, long c,
                                                        long vstart, long vrows) {
    __shared__ int hits[256];
    __shared__ int warp_base[9];
    const long r0 = (long)blockIdx.x * EMB_ROWS, r1 = r0 + EMB_ROWS < vrows ? r0 + EMB_ROWS : vrows;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (long base = 0; base < n; base += 256) {
        long i = base + threadIdx.x, row = i < n ? (long)ids[i] - vstart : -1;
        bool hit = row >= r0 && row < r1;
        unsigned ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_base[warp + 1] = __popc(ballot);
        __syncthreads();
        if (threadIdx.x == 0) {
            warp_base[0] = 0;
            for (int w = 1; w <= 8; w++) warp_base[w] += warp_base[w - 1];
        }
        __syncthreads();
        if (hit) hits[warp_base[warp] + __popc(ballot & ((1u << lane) - 1u))] = (int)(i - base);
        __syncthreads();
        for (int h = 0; h < warp_base[8]; h++) {
            long p = base + hits[h], dst = ((long)ids[p] - vstart) * c;
            for (long j = threadIdx.x; j < c; j += 256) dtable[dst + j] += ld(dout, p * c + j);
        }
        __syncthreads();
    }
}

// Learned position embeddings' backward: row start + t of the table gets Σ_b dout[b, t, :], one
// thread per (t, column), no atomics. embedding_bwd's sums for the ids start..start + l of every
// batch row, in its CPU loop's order (b = 0, 1, …): into an f32 table from the table's value;
// into bf16 (`--grad-reduce-in-bf16`), the f32 sum from zero added and rounded once, as the
// scratch path of embedding_bwd does.
template <typename T, typename U>
__device__ __forceinline__ void pos_emb_bwd(const T* dout, U* table, long b, long l, long c, long start) {
    constexpr bool WIDE = sizeof(U) == 4;
    GRID_STRIDE(i, l * c) {
        const long t = i / c, j = i - t * c, at = (start + t) * c + j;
        float s = WIDE ? ld(table, at) : 0.f;
        for (long bb = 0; bb < b; bb++) s += ld(dout, (bb * l + t) * c + j);
        st(table, at, WIDE ? s : ld(table, at) + s);
    }
}
#define POS_EMB(s, T) \
extern "C" __global__ void pos_emb_bwd_##s##_f32(const T* dout, float* table, long b, long l, long c, long start) { \
    pos_emb_bwd(dout, table, b, l, c, start); } \
extern "C" __global__ void pos_emb_bwd_##s##_bf16(const T* dout, bf16_t* table, long b, long l, long c, long start) { \
    pos_emb_bwd(dout, table, b, l, c, start); }
FOR_TYPES(POS_EMB)

#define EMB(s, T) \
extern "C" __global__ void __launch_bounds__(256) embedding_bwd_rows_##s(const u32* ids, const T* dout, float* dtable, long n, long c, long vstart, long vrows) { \
    embedding_bwd_rows_impl(ids, dout, dtable, n, c, vstart, vrows); } \
extern "C" __global__ void embedding_fwd_##s(const u32* ids, const T* table, T* out, long n, long c, long vstart, long vrows) { \
    GRID_STRIDE(i, n * c) { long r = i / c, j = i % c, row = (long)ids[r] - vstart; \
        st(out, i, (row >= 0 && row < vrows) ? ld(table, row * c + j) : 0.f); } } \
extern "C" __global__ void embedding_bwd_##s(const u32* ids, const T* dout, float* dtable, long n, long c, long vstart, long vrows) { \
    GRID_STRIDE(i, n * c) { long r = i / c, j = i % c, row = (long)ids[r] - vstart; \
        if (row >= 0 && row < vrows) atomicAdd(dtable + row * c + j, ld(dout, i)); } } \
/* A bf16 main_grad: the scatter-add into a zeroed f32 scratch `sums` (as embedding_bwd), each \
   touched row marked in `flags` (then `embedding_flush_bf16`, below). */ \
extern "C" __global__ void embedding_bwd_flag_##s(const u32* ids, const T* dout, float* sums, u32* flags, long n, long c, long vstart, long vrows) { \
    GRID_STRIDE(i, n * c) { long r = i / c, j = i % c, row = (long)ids[r] - vstart; \
        if (row >= 0 && row < vrows) { atomicAdd(sums + row * c + j, ld(dout, i)); if (j == 0) flags[row] = 1u; } } } \
/* The same with c % 4 == 0: four columns a thread, one vector reduction (`red_add4`), a quarter \
   of the reduction operations and index divisions. */ \
extern "C" __global__ void embedding_bwd_flag4_##s(const u32* ids, const T* dout, float* sums, u32* flags, long n, long c, long vstart, long vrows) { \
    long q = c / 4; GRID_STRIDE(i, n * q) { long r = i / q, j = (i - r * q) * 4, row = (long)ids[r] - vstart; \
        if (row >= 0 && row < vrows) { long e = r * c + j; \
            red_add4(sums + row * c + j, ld(dout, e), ld(dout, e + 1), ld(dout, e + 2), ld(dout, e + 3)); \
            if (j == 0) flags[row] = 1u; } } } \
extern "C" __global__ void qkv_split_##s(const T* x, T* q, T* k, T* v, long n, long hkv, long g, long d) { \
    QKV_SEGMENTS(n, hkv, g) { const T* src = x + w * d; T* dst = qkv_head(q, k, v, w, g, d); \
        for (long e = lane; e < d; e += 32) st(dst, e, ld(src, e)); } } \
extern "C" __global__ void qkv_merge_##s(const T* q, const T* k, const T* v, T* x, long n, long hkv, long g, long d) { \
    QKV_SEGMENTS(n, hkv, g) { const T* src = qkv_head(q, k, v, w, g, d); T* dst = x + w * d; \
        for (long e = lane; e < d; e += 32) st(dst, e, ld(src, e)); } } \
/* d % 8 == 0, 16-byte aligned: one thread per group of eight of a segment (a warp per segment \
   left 24 of 32 lanes idle at d = 64 and moved 2 bytes per load). */ \
extern "C" __global__ void qkv_split_##s##_v8(const T* x, T* q, T* k, T* v, long n, long hkv, long g, long d) { \
    long per = d / 8; GRID_STRIDE(i, n * hkv * (g + 2) * per) { long w = i / per, e = (i - w * per) * 8; float a[8]; \
        ld8(x, w * d + e, a); st8(qkv_head(q, k, v, w, g, d), e, a); } } \
extern "C" __global__ void qkv_merge_##s##_v8(const T* q, const T* k, const T* v, T* x, long n, long hkv, long g, long d) { \
    long per = d / 8; GRID_STRIDE(i, n * hkv * (g + 2) * per) { long w = i / per, e = (i - w * per) * 8; float a[8]; \
        ld8(qkv_head(q, k, v, w, g, d), e, a); st8(x, w * d + e, a); } } \
/* c % 8 == 0, 16-byte aligned: eight columns per thread (the one-element kernel moved 2 bytes \
   per load and ran at ≈ 0.4 TB/s). */ \
extern "C" __global__ void embedding_fwd_##s##_v8(const u32* ids, const T* table, T* out, long n, long c, long vstart, long vrows) { \
    GRID_STRIDE8(i, n * c) { long r = i / c, j = i - r * c, row = (long)ids[r] - vstart; float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}; \
        if (row >= 0 && row < vrows) ld8(table, row * c + j, a); st8(out, i, a); } }
FOR_TYPES(EMB)

// The bf16 scratch path's second pass (after `embedding_bwd_flag`): a warp per position, the
// first warp to claim a marked row adds its f32 sums into the bf16 table (rounded once, as
// `acc`) and clears them and the flag: the scratch is left zeroed for the next call, and the
// bytes moved are the touched rows', not the whole table's. (Only a bf16 table takes this path,
// so only that build exists.)
extern "C" __global__ void embedding_flush_bf16(const u32* ids, float* sums, u32* flags, bf16_t* table, long n, long c, long vstart, long vrows) {
    int lane = threadIdx.x & 31;
    for (long p = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < n; p += ((long)gridDim.x * blockDim.x) >> 5) {
        long row = (long)ids[p] - vstart;
        if (row < 0 || row >= vrows) continue;
        u32 mine = lane == 0 ? atomicExch(flags + row, 0u) : 0u;
        if (!__shfl_sync(0xffffffffu, mine, 0)) continue;
        for (long j = lane; j < c; j += 32) { long e = row * c + j; st(table, e, ld(table, e) + sums[e]); sums[e] = 0.f; }
    }
}
