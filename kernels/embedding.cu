// Embedding lookup and its scatter-add backward (fp32 atomics into main_grad); on a vocabulary
// shard (rows vstart..vstart+vrows) other ids give zero rows and no gradient. And the QKV
// split/merge between Megatron's grouped layout and per-head tensors.

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

#define EMB(s, T) \
extern "C" __global__ void embedding_fwd_##s(const u32* ids, const T* table, T* out, long n, long c, long vstart, long vrows) { \
    GRID_STRIDE(i, n * c) { long r = i / c, j = i % c, row = (long)ids[r] - vstart; \
        st(out, i, (row >= 0 && row < vrows) ? ld(table, row * c + j) : 0.f); } } \
extern "C" __global__ void embedding_bwd_##s(const u32* ids, const T* dout, float* dtable, long n, long c, long vstart, long vrows) { \
    GRID_STRIDE(i, n * c) { long r = i / c, j = i % c, row = (long)ids[r] - vstart; \
        if (row >= 0 && row < vrows) atomicAdd(dtable + row * c + j, ld(dout, i)); } } \
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
