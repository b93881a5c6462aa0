// Flash attention, SIMT version (fp32 math on CUDA cores; the tensor-core version is the next
// step). Tiles of 32 query rows × 32 keys in shared memory with an online softmax, so the score
// matrix is never stored; key tiles a causal or windowed block cannot see are skipped; GQA reads
// the shared K/V head in place. A quad of 4 threads owns one row; thread `sub` holds elements
// sub, sub + 4, ... (D/4 of them) and dot products finish with two shuffles.
// Layouts as attention.cu: q/o/do [B,T,Hq,D], k/v [B,S,Hkv,D], lse and delta [B,Hq,T].
// Backward without atomics: one kernel for dQ (which also stores delta = rowsum(dO∘O)), one for
// dK and dV (a block per key tile of one KV head loops over every query head of its group).
// Attention dropout by the key `dr` (attention.cu `AttnDrop`; thr 0: none), a Philox call per
// probability: these kernels are the fallback, the tensor-core ones spend one per eight.

#define FA_ROWS 32
#define FA_KEYS 32

__device__ __forceinline__ long lmin(long a, long b) { return a < b ? a : b; }
__device__ __forceinline__ long lmax(long a, long b) { return a > b ? a : b; }

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v;
}

// Keys [*j_begin, *j_end) that query rows [i0, i1] may see, the start rounded down to a tile of
// `tile` keys (shared with the tensor-core kernels).
__device__ __forceinline__ void key_range(long i0, long i1, long sl, long causal, long window, long tile, long* jb,
                                          long* je) {
    long b = 0, e = sl;
    if (causal) e = lmin(e, i1 + 1);
    if (window > 0) { b = lmax(0L, i0 - window + 1); if (!causal) e = lmin(e, i1 + window); }
    *jb = (b / tile) * tile; *je = e;
}

// Query rows [*i_begin, *i_end) that may see keys [j0, j1] of `t` rows, the start rounded down to
// a tile of `tile` rows (the mirror of key_range, for the dK/dV kernels).
__device__ __forceinline__ void row_range(long j0, long j1, long t, long causal, long window, long tile, long* ib,
                                          long* ie) {
    long b = 0, e = t;
    if (causal) b = j0;
    if (window > 0) { e = lmin(e, j1 + window); if (!causal) b = lmax(0L, j0 - window + 1); }
    *ib = (b / tile) * tile; *ie = e;
}

// Document masks (`AttnCfg::docs`, or null) in the tensor-core kernels: u32 [B, T], query i of
// batch row b sees keys j ≥ docs[b·T + i]. The starts never decrease along a row (a packed row's
// documents follow each other; the host checks this where it builds them), so a tile of rows
// [i0, i1] sees nothing before its first row's start, and its last row's start says whether any
// of its keys from j0 on is hidden (`doc_cuts`).
// Raises *jb past whole key tiles of `tile` keys that no row from i0 on sees (on *jb's grid:
// dropout's 16 × 16 tiles and the swizzled copies stay aligned).
__device__ __forceinline__ void doc_key_range(const u32* docs, long b, long t, long i0, long tile, long* jb) {
    if (!docs) return;
    const long s = docs[b * t + i0];
    if (s > *jb) *jb += (s - *jb) / tile * tile;
}
// Lowers the end *ie of the query rows that may see keys up to j1 to the last row whose document
// starts at or before j1, plus one (a binary search: row j1's own start is at most j1).
__device__ __forceinline__ void doc_row_range(const u32* docs, long b, long t, long j1, long* ie) {
    if (!docs || j1 >= t) return;
    const u32* row = docs + b * t;
    long lo = j1, hi = t - 1;
    while (lo < hi) {
        const long mid = (lo + hi + 1) / 2;
        if ((long)row[mid] <= j1) lo = mid; else hi = mid - 1;
    }
    *ie = lmin(*ie, lo + 1);
}
// Whether rows up to i1 (< t) hide some key from j0 on: the last row's document starts after j0.
__device__ __forceinline__ bool doc_cuts(const u32* docs, long b, long t, long i1, long j0) {
    return docs && (long)docs[b * t + i1] > j0;
}

template <typename T, int D>
__device__ void load_tile(float (*dst)[D], const T* src, long row0, long rows, long b, long heads, long head) {
    for (int x = threadIdx.x; x < FA_KEYS * D; x += blockDim.x) {
        int r = x / D, e = x % D; long row = row0 + r;
        dst[r][e] = row < rows ? ld(src, ((b * rows + row) * heads + head) * D + e) : 0.f;
    }
}

template <typename T, int D>
__device__ void flash_fwd(const T* q, const T* k, const T* v, T* o, float* lse, long t, long sl, long hq, long hkv,
                          float scale, long causal, long window, const AttnDrop& dr) {
    constexpr int C = D / 4;
    __shared__ float ks[FA_KEYS][D];
    __shared__ float vs[FA_KEYS][D];
    long tiles = (t + FA_ROWS - 1) / FA_ROWS;
    long qt = blockIdx.x % tiles, h = (blockIdx.x / tiles) % hq, b = blockIdx.x / (tiles * hq), kvh = h / (hq / hkv);
    int r = threadIdx.x >> 2, sub = threadIdx.x & 3;
    long i = qt * FA_ROWS + r;
    bool live = i < t;
    const T* qi = q + ((b * t + (live ? i : 0)) * hq + h) * D;
    float qr[C], acc[C];
    for (int c = 0; c < C; c++) { qr[c] = live ? ld(qi, sub + 4 * c) : 0.f; acc[c] = 0.f; }
    float m = -INFINITY, l = 0.f;
    long jb, je;
    key_range(qt * FA_ROWS, lmin(t, qt * FA_ROWS + FA_ROWS) - 1, sl, causal, window, FA_KEYS, &jb, &je);
    for (long j0 = jb; j0 < je; j0 += FA_KEYS) {
        __syncthreads();
        load_tile<T, D>(ks, k, j0, sl, b, hkv, kvh);
        load_tile<T, D>(vs, v, j0, sl, b, hkv, kvh);
        __syncthreads();
        float s[FA_KEYS];
        float tmax = -INFINITY;
        for (int jj = 0; jj < FA_KEYS; jj++) {
            float a = 0.f;
            for (int c = 0; c < C; c++) a += qr[c] * ks[jj][sub + 4 * c];
            a = quad_sum(a) * scale;
            long j = j0 + jj;
            s[jj] = (live && j < sl && allowed(i, j, causal, window)) ? a : -INFINITY;
            tmax = fmaxf(tmax, s[jj]);
        }
        if (tmax == -INFINITY) continue;
        float mn = fmaxf(m, tmax), corr = expf(m - mn);
        l *= corr;
        for (int c = 0; c < C; c++) acc[c] *= corr;
        for (int jj = 0; jj < FA_KEYS; jj++) {
            if (s[jj] == -INFINITY) continue;
            float p = expf(s[jj] - mn);
            l += p;
            if (dr.thr) p *= drop_at(dr, b, h, i, j0 + jj, t, sl);  // P̃ = P ∘ M / (1 − p); l stays P's
            for (int c = 0; c < C; c++) acc[c] += p * vs[jj][sub + 4 * c];
        }
        m = mn;
    }
    if (live) {
        T* oi = o + ((b * t + i) * hq + h) * D;
        float inv = 1.f / l;
        for (int c = 0; c < C; c++) st(oi, sub + 4 * c, acc[c] * inv);
        if (sub == 0) lse[(b * hq + h) * t + i] = m + logf(l);
    }
}

template <typename T, int D>
__device__ void flash_bwd_dq(const T* q, const T* k, const T* v, const T* o, const float* lse, const T* dout, float* dq,
                             float* delta, long t, long sl, long hq, long hkv, float scale, long causal, long window,
                             const AttnDrop& dr) {
    constexpr int C = D / 4;
    __shared__ float ks[FA_KEYS][D];
    __shared__ float vs[FA_KEYS][D];
    long tiles = (t + FA_ROWS - 1) / FA_ROWS;
    long qt = blockIdx.x % tiles, h = (blockIdx.x / tiles) % hq, b = blockIdx.x / (tiles * hq), kvh = h / (hq / hkv);
    int r = threadIdx.x >> 2, sub = threadIdx.x & 3;
    long i = qt * FA_ROWS + r;
    bool live = i < t;
    long qo = ((b * t + (live ? i : 0)) * hq + h) * D;
    float qr[C], dor[C], dqa[C];
    float di = 0.f;
    for (int c = 0; c < C; c++) {
        qr[c] = live ? ld(q, qo + sub + 4 * c) : 0.f;
        dor[c] = live ? ld(dout, qo + sub + 4 * c) : 0.f;
        di += live ? dor[c] * ld(o, qo + sub + 4 * c) : 0.f;
        dqa[c] = 0.f;
    }
    di = quad_sum(di);
    long row = (b * hq + h) * t + (live ? i : 0);
    float lr = live ? lse[row] : 0.f;
    if (live && sub == 0) delta[row] = di;
    long jb, je;
    key_range(qt * FA_ROWS, lmin(t, qt * FA_ROWS + FA_ROWS) - 1, sl, causal, window, FA_KEYS, &jb, &je);
    for (long j0 = jb; j0 < je; j0 += FA_KEYS) {
        __syncthreads();
        load_tile<T, D>(ks, k, j0, sl, b, hkv, kvh);
        load_tile<T, D>(vs, v, j0, sl, b, hkv, kvh);
        __syncthreads();
        for (int jj = 0; jj < FA_KEYS; jj++) {
            float a = 0.f, dp = 0.f;
            for (int c = 0; c < C; c++) { a += qr[c] * ks[jj][sub + 4 * c]; dp += dor[c] * vs[jj][sub + 4 * c]; }
            a = quad_sum(a) * scale;
            dp = quad_sum(dp);
            long j = j0 + jj;
            if (!(live && j < sl && allowed(i, j, causal, window))) continue;
            if (dr.thr) dp *= drop_at(dr, b, h, i, j, t, sl);  // dP = dP̃ ∘ M / (1 − p)
            float ds = expf(a - lr) * (dp - di);
            for (int c = 0; c < C; c++) dqa[c] += ds * ks[jj][sub + 4 * c];
        }
    }
    if (live) for (int c = 0; c < C; c++) dq[qo + sub + 4 * c] = dqa[c] * scale;
}

template <typename T, int D>
__device__ void flash_bwd_dkv(const T* q, const T* k, const T* v, const float* lse, const float* delta, const T* dout,
                              float* dk, float* dv, long t, long sl, long hq, long hkv, float scale, long causal,
                              long window, const AttnDrop& dr) {
    constexpr int C = D / 4;
    __shared__ float qs[FA_ROWS][D];
    __shared__ float dos[FA_ROWS][D];
    __shared__ float ls[FA_ROWS], dl[FA_ROWS];
    long tiles = (sl + FA_KEYS - 1) / FA_KEYS;
    long kt = blockIdx.x % tiles, kvh = (blockIdx.x / tiles) % hkv, b = blockIdx.x / (tiles * hkv);
    int r = threadIdx.x >> 2, sub = threadIdx.x & 3;
    long j = kt * FA_KEYS + r;
    bool live = j < sl;
    long ko = ((b * sl + (live ? j : 0)) * hkv + kvh) * D;
    float kr[C], vr[C], dka[C], dva[C];
    for (int c = 0; c < C; c++) {
        kr[c] = live ? ld(k, ko + sub + 4 * c) : 0.f;
        vr[c] = live ? ld(v, ko + sub + 4 * c) : 0.f;
        dka[c] = 0.f; dva[c] = 0.f;
    }
    // Query rows that can see keys [j0, j1].
    long j0 = kt * FA_KEYS, j1 = lmin(sl, j0 + FA_KEYS) - 1, ib, ie;
    row_range(j0, j1, t, causal, window, FA_ROWS, &ib, &ie);
    long group = hq / hkv;
    for (long hh = 0; hh < group; hh++) {
        long h = kvh * group + hh;
        for (long i0 = ib; i0 < ie; i0 += FA_ROWS) {
            __syncthreads();
            load_tile<T, D>(qs, q, i0, t, b, hq, h);
            load_tile<T, D>(dos, dout, i0, t, b, hq, h);
            if (threadIdx.x < FA_ROWS) {
                long i = i0 + threadIdx.x;
                ls[threadIdx.x] = i < t ? lse[(b * hq + h) * t + i] : 0.f;
                dl[threadIdx.x] = i < t ? delta[(b * hq + h) * t + i] : 0.f;
            }
            __syncthreads();
            for (int ii = 0; ii < FA_ROWS; ii++) {
                float a = 0.f, dp = 0.f;
                for (int c = 0; c < C; c++) { a += qs[ii][sub + 4 * c] * kr[c]; dp += dos[ii][sub + 4 * c] * vr[c]; }
                a = quad_sum(a) * scale;
                dp = quad_sum(dp);
                long i = i0 + ii;
                if (!(live && i < t && allowed(i, j, causal, window))) continue;
                const float mul = dr.thr ? drop_at(dr, b, h, i, j, t, sl) : 1.f;
                float p = expf(a - ls[ii]), ds = p * (dp * mul - dl[ii]);
                p *= mul;  // dV = P̃ᵀ dO
                for (int c = 0; c < C; c++) { dva[c] += p * dos[ii][sub + 4 * c]; dka[c] += ds * qs[ii][sub + 4 * c]; }
            }
        }
    }
    if (live) for (int c = 0; c < C; c++) { dk[ko + sub + 4 * c] = dka[c] * scale; dv[ko + sub + 4 * c] = dva[c]; }
}

#define FLASH(s, T, D) \
extern "C" __global__ void __launch_bounds__(128) flash_fwd_##s##_##D(const T* q, const T* k, const T* v, T* o, float* lse, \
        long t, long sl, long hq, long hkv, long d, float scale, long causal, long window, AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    flash_fwd<T, D>(q, k, v, o, lse, t, sl, hq, hkv, scale, causal, window, dr); } \
extern "C" __global__ void __launch_bounds__(128) flash_bwd_dq_##s##_##D(const T* q, const T* k, const T* v, const T* o, \
        const float* lse, const T* dout, float* dq, float* delta, long t, long sl, long hq, long hkv, long d, float scale, \
        long causal, long window, AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    flash_bwd_dq<T, D>(q, k, v, o, lse, dout, dq, delta, t, sl, hq, hkv, scale, causal, window, dr); } \
extern "C" __global__ void __launch_bounds__(128) flash_bwd_dkv_##s##_##D(const T* q, const T* k, const T* v, \
        const float* lse, const float* delta, const T* dout, float* dk, float* dv, long t, long sl, long hq, long hkv, \
        long d, float scale, long causal, long window, AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    flash_bwd_dkv<T, D>(q, k, v, lse, delta, dout, dk, dv, t, sl, hq, hkv, scale, causal, window, dr); }
#define FLASH_DIMS(s, T) FLASH(s, T, 32) FLASH(s, T, 64) FLASH(s, T, 128)
FOR_TYPES(FLASH_DIMS)
