// Embedding lookup and its scatter-add backward (fp32 atomics into main_grad); on a vocabulary
// shard (rows vstart..vstart+vrows) other ids give zero rows and no gradient. And the QKV
// split/merge between Megatron's grouped layout and per-head tensors.

#define EMB(s, T) \
extern "C" __global__ void embedding_fwd_##s(const u32* ids, const T* table, T* out, long n, long c, long vstart, long vrows) { \
    GRID_STRIDE(i, n * c) { long r = i / c, j = i % c, row = (long)ids[r] - vstart; \
        st(out, i, (row >= 0 && row < vrows) ? ld(table, row * c + j) : 0.f); } } \
extern "C" __global__ void embedding_bwd_##s(const u32* ids, const T* dout, float* dtable, long n, long c, long vstart, long vrows) { \
    GRID_STRIDE(i, n * c) { long r = i / c, j = i % c, row = (long)ids[r] - vstart; \
        if (row >= 0 && row < vrows) atomicAdd(dtable + row * c + j, ld(dout, i)); } } \
extern "C" __global__ void qkv_split_##s(const T* x, T* q, T* k, T* v, long n, long hkv, long g, long d) { \
    long w = hkv * (g + 2) * d; \
    GRID_STRIDE(i, n * w) { long r = i / w, c = i % w, grp = c / ((g + 2) * d), o = c % ((g + 2) * d); float val = ld(x, i); \
        if (o < g * d) st(q, (r * hkv + grp) * g * d + o, val); \
        else if (o < (g + 1) * d) st(k, (r * hkv + grp) * d + (o - g * d), val); \
        else st(v, (r * hkv + grp) * d + (o - (g + 1) * d), val); } } \
extern "C" __global__ void qkv_merge_##s(const T* q, const T* k, const T* v, T* x, long n, long hkv, long g, long d) { \
    long w = hkv * (g + 2) * d; \
    GRID_STRIDE(i, n * w) { long r = i / w, c = i % w, grp = c / ((g + 2) * d), o = c % ((g + 2) * d); float val; \
        if (o < g * d) val = ld(q, (r * hkv + grp) * g * d + o); \
        else if (o < (g + 1) * d) val = ld(k, (r * hkv + grp) * d + (o - g * d)); \
        else val = ld(v, (r * hkv + grp) * d + (o - (g + 1) * d)); \
        st(x, i, val); } }
FOR_TYPES(EMB)
