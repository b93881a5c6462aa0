// LayerNorm / RMSNorm / softmax over rows: one block per row (256 threads), block reductions.
// The norms scale by w + ws: ws 1 for zero-centred weights (Megatron's --apply-layernorm-1p), the
// 1 added in f32 (norm.rs `Gamma`), else 0.
// The residual stream's adds ride along (pre-norm layer: x1 = x + attn; h = norm(x1); and in the
// backward dx1 = dy + normᵀ(dh)): with `r`/`sum` non-null the forward normalises x + r and writes
// that sum (as stored, so the backward sees what the forward normalised); with `res` non-null
// the backward adds it to dx.
// Parameter gradients: column sums in two passes (common.cuh's COL_CHUNK rows per partial, then
// col_sum_f32 over the partials in order): deterministic, and enough threads for 16k-row batches.

#define NORMS(s, T) \
extern "C" __global__ void layernorm_fwd_##s(const T* x, const T* x2, T* xs, const T* w, const T* b, T* y, float* mean, float* rstd, long c, float eps, float ws) { \
    long r = blockIdx.x; const T* xr = x + r * c; float sum = 0.f; \
    if (x2) { for (long i = threadIdx.x; i < c; i += blockDim.x) st(xs, r * c + i, ld(xr, i) + ld(x2, r * c + i)); xr = xs + r * c; } \
    for (long i = threadIdx.x; i < c; i += blockDim.x) sum += ld(xr, i); \
    float mu = block_sum(sum) / c; float var = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) { float d = ld(xr, i) - mu; var += d * d; } \
    float rs = rsqrtf(block_sum(var) / c + eps); \
    for (long i = threadIdx.x; i < c; i += blockDim.x) st(y, r * c + i, (ld(xr, i) - mu) * rs * (ld(w, i) + ws) + (b ? ld(b, i) : 0.f)); \
    if (threadIdx.x == 0) { mean[r] = mu; rstd[r] = rs; } } \
extern "C" __global__ void layernorm_bwd_##s(const T* dy, const T* x, const T* w, const float* mean, const float* rstd, const T* res, T* dx, long c, float ws) { \
    long r = blockIdx.x; float mu = mean[r], rs = rstd[r], sg = 0.f, sgx = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) { float g = ld(dy, r * c + i) * (ld(w, i) + ws); sg += g; sgx += g * (ld(x, r * c + i) - mu) * rs; } \
    sg = block_sum(sg) / c; sgx = block_sum(sgx) / c; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) { float xh = (ld(x, r * c + i) - mu) * rs; \
        st(dx, r * c + i, rs * (ld(dy, r * c + i) * (ld(w, i) + ws) - sg - xh * sgx) + (res ? ld(res, r * c + i) : 0.f)); } } \
extern "C" __global__ void norm_param_grad_##s(const T* dy, const T* x, const float* mean, const float* rstd, float* dw, float* db, long rows, long c) { \
    GRID_STRIDE(i, (rows + COL_CHUNK - 1) / COL_CHUNK * c) { long j = i % c, r0 = i / c * COL_CHUNK, r1 = r0 + COL_CHUNK < rows ? r0 + COL_CHUNK : rows; \
        float a = 0.f, b = 0.f; for (long r = r0; r < r1; r++) { float g = ld(dy, r * c + j); \
        a += g * (ld(x, r * c + j) - (mean ? mean[r] : 0.f)) * rstd[r]; b += g; } dw[i] = a; if (db) db[i] = b; } } \
extern "C" __global__ void rmsnorm_fwd_##s(const T* x, const T* x2, T* xs, const T* w, T* y, float* rstd, long c, float eps, float ws) { \
    long r = blockIdx.x; const T* xr = x + r * c; float ss = 0.f; \
    if (x2) { for (long i = threadIdx.x; i < c; i += blockDim.x) st(xs, r * c + i, ld(xr, i) + ld(x2, r * c + i)); xr = xs + r * c; } \
    for (long i = threadIdx.x; i < c; i += blockDim.x) { float v = ld(xr, i); ss += v * v; } \
    float rs = rsqrtf(block_sum(ss) / c + eps); \
    for (long i = threadIdx.x; i < c; i += blockDim.x) st(y, r * c + i, ld(xr, i) * rs * (ld(w, i) + ws)); \
    if (threadIdx.x == 0) rstd[r] = rs; } \
extern "C" __global__ void rmsnorm_bwd_##s(const T* dy, const T* x, const T* w, const float* rstd, const T* res, T* dx, long c, float ws) { \
    long r = blockIdx.x; float rs = rstd[r], sgx = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) sgx += ld(dy, r * c + i) * (ld(w, i) + ws) * ld(x, r * c + i) * rs; \
    sgx = block_sum(sgx) / c; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) \
        st(dx, r * c + i, rs * (ld(dy, r * c + i) * (ld(w, i) + ws) - ld(x, r * c + i) * rs * sgx) + (res ? ld(res, r * c + i) : 0.f)); } \
extern "C" __global__ void softmax_fwd_##s(const T* x, T* y, long c) { \
    long r = blockIdx.x; float m = -INFINITY; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) m = fmaxf(m, ld(x, r * c + i)); \
    m = block_max(m); float z = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) z += expf(ld(x, r * c + i) - m); \
    z = block_sum(z); \
    for (long i = threadIdx.x; i < c; i += blockDim.x) st(y, r * c + i, expf(ld(x, r * c + i) - m) / z); } \
extern "C" __global__ void softmax_bwd_##s(const T* y, const T* dy, T* dx, long c) { \
    long r = blockIdx.x; float d = 0.f; \
    for (long i = threadIdx.x; i < c; i += blockDim.x) d += ld(y, r * c + i) * ld(dy, r * c + i); \
    d = block_sum(d); \
    for (long i = threadIdx.x; i < c; i += blockDim.x) st(dx, r * c + i, ld(y, r * c + i) * (ld(dy, r * c + i) - d)); }
FOR_TYPES(NORMS)

// Eight-wide row kernels (c % 8 == 0, 16-byte aligned rows, c ≤ 8 · NORM_V · blockDim): a thread
// holds up to NORM_V groups of eight of its row in registers, so the row is read from memory once
// (the kernels above re-read it for every pass). The host sizes the block to the row, at most
// NORM_THREADS (the backward's ≈ 90 registers per thread do not fit 1024 threads). Two builds:
// `_v8` with NORM_V 4, and `_v8n1` with NORM_V 1 for rows of at most 8 · NORM_THREADS (every
// hidden size up to 4096): a quarter of the registers, so more rows in flight per SM (the
// backward at NORM_V 4 held ≈ 7 rows of 768 per SM and ran at half the memory's rate).
#define NORM_V 4
#define NORM_THREADS 512
#define ROW_GROUPS(k, j) _Pragma("unroll") for (int k = 0; k < NORM_V; k++) if (long j = ((long)threadIdx.x + k * blockDim.x) * 8; j < c)

// Eight inputs of a row: x, or x + x2 written to xs and returned as stored.
template <typename T> __device__ __forceinline__ void load_sum8(const T* x, const T* x2, T* xs, long i, float* v) {
    ld8(x, i, v);
    if (!x2) return;
    float u[8]; ld8(x2, i, u);
#pragma unroll
    for (int e = 0; e < 8; e++) v[e] = as_stored(xs, v[e] + u[e]);
    st8(xs, i, v);
}
// A zero-centred norm's scale, 1 + w (ws 1; 0 for the weight itself), added in f32.
__device__ __forceinline__ void add_shift8(float* g, float ws) {
#pragma unroll
    for (int e = 0; e < 8; e++) g[e] += ws;
}
// The residual gradient's eight values at i, or zeros.
template <typename T> __device__ __forceinline__ void add_res8(const T* res, long i, float* a) {
#pragma unroll
    for (int e = 0; e < 8; e++) a[e] = 0.f;
    if (res) ld8(res, i, a);
}

#define NORMS_V8(s, T, SUF) \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) layernorm_fwd_##s##SUF(const T* x, const T* x2, T* xs, const T* w, const T* b, T* y, float* mean, float* rstd, long c, float eps, float ws) { \
    pdl_wait(); \
    long r = blockIdx.x; float v[NORM_V][8], sum = 0.f, var = 0.f; \
    ROW_GROUPS(k, j) { load_sum8(x, x2, xs, r * c + j, v[k]); for (int e = 0; e < 8; e++) sum += v[k][e]; } \
    float mu = block_sum(sum) / c; \
    ROW_GROUPS(k, j) for (int e = 0; e < 8; e++) { float d = v[k][e] - mu; var += d * d; } \
    float rs = rsqrtf(block_sum(var) / c + eps); \
    ROW_GROUPS(k, j) { float g[8], h[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}; ld8(w, j, g); add_shift8(g, ws); if (b) ld8(b, j, h); \
        for (int e = 0; e < 8; e++) v[k][e] = (v[k][e] - mu) * rs * g[e] + h[e]; st8(y, r * c + j, v[k]); } \
    if (threadIdx.x == 0) { mean[r] = mu; rstd[r] = rs; } } \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) layernorm_bwd_##s##SUF(const T* dy, const T* x, const T* w, const float* mean, const float* rstd, const T* res, T* dx, long c, float ws) { \
    pdl_wait(); \
    long r = blockIdx.x; float mu = mean[r], rs = rstd[r], sg = 0.f, sgx = 0.f, gw[NORM_V][8], xh[NORM_V][8]; \
    ROW_GROUPS(k, j) { float g[8]; ld8(dy, r * c + j, gw[k]); ld8(x, r * c + j, xh[k]); ld8(w, j, g); add_shift8(g, ws); \
        for (int e = 0; e < 8; e++) { gw[k][e] *= g[e]; xh[k][e] = (xh[k][e] - mu) * rs; sg += gw[k][e]; sgx += gw[k][e] * xh[k][e]; } } \
    sg = block_sum(sg) / c; sgx = block_sum(sgx) / c; \
    ROW_GROUPS(k, j) { float a[8]; add_res8(res, r * c + j, a); \
        for (int e = 0; e < 8; e++) gw[k][e] = rs * (gw[k][e] - sg - xh[k][e] * sgx) + a[e]; st8(dx, r * c + j, gw[k]); } } \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_fwd_##s##SUF(const T* x, const T* x2, T* xs, const T* w, T* y, float* rstd, long c, float eps, float ws) { \
    pdl_wait(); \
    long r = blockIdx.x; float v[NORM_V][8], ss = 0.f; \
    ROW_GROUPS(k, j) { load_sum8(x, x2, xs, r * c + j, v[k]); for (int e = 0; e < 8; e++) ss += v[k][e] * v[k][e]; } \
    float rs = rsqrtf(block_sum(ss) / c + eps); \
    ROW_GROUPS(k, j) { float g[8]; ld8(w, j, g); add_shift8(g, ws); for (int e = 0; e < 8; e++) v[k][e] = v[k][e] * rs * g[e]; st8(y, r * c + j, v[k]); } \
    if (threadIdx.x == 0) rstd[r] = rs; } \
extern "C" __global__ void __launch_bounds__(NORM_THREADS) rmsnorm_bwd_##s##SUF(const T* dy, const T* x, const T* w, const float* rstd, const T* res, T* dx, long c, float ws) { \
    pdl_wait(); \
    long r = blockIdx.x; float rs = rstd[r], sgx = 0.f, gw[NORM_V][8], xv[NORM_V][8]; \
    ROW_GROUPS(k, j) { float g[8]; ld8(dy, r * c + j, gw[k]); ld8(x, r * c + j, xv[k]); ld8(w, j, g); add_shift8(g, ws); \
        for (int e = 0; e < 8; e++) { gw[k][e] *= g[e]; sgx += gw[k][e] * xv[k][e] * rs; } } \
    sgx = block_sum(sgx) / c; \
    ROW_GROUPS(k, j) { float a[8]; add_res8(res, r * c + j, a); \
        for (int e = 0; e < 8; e++) gw[k][e] = rs * (gw[k][e] - xv[k][e] * rs * sgx) + a[e]; st8(dx, r * c + j, gw[k]); } }
#define NORMS_V8_N4(s, T) NORMS_V8(s, T, _v8)
FOR_TYPES(NORMS_V8_N4)
#undef NORM_V
#define NORM_V 1
#define NORMS_V8_N1(s, T) NORMS_V8(s, T, _v8n1)
FOR_TYPES(NORMS_V8_N1)
#undef NORM_V

#define NORM_PARAM_GRAD8(s, T) \
/* Parameter-gradient partials (col_partials8: c % 8 == 0, grid chunks · ceil(c / 256), 256 threads). */ \
extern "C" __global__ void __launch_bounds__(256) norm_param_grad_##s##_v8(const T* dy, const T* x, const float* mean, const float* rstd, float* dw, float* db, long rows, long c) { \
    pdl_wait(); \
    col_partials8<true>(dw, db, rows, c, [&](long r, long j, float (&a)[8], float (&bs)[8]) { \
        float g[8], xv[8]; ld8(dy, r * c + j, g); ld8(x, r * c + j, xv); float mu = mean ? mean[r] : 0.f, rs = rstd[r]; \
        _Pragma("unroll") for (int e = 0; e < 8; e++) { a[e] += g[e] * (xv[e] - mu) * rs; bs[e] += g[e]; } }); }
FOR_TYPES(NORM_PARAM_GRAD8)

// A hint to bring the 128-byte line holding p into L1 (or L2): no register waits for it.
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Norm backward with its parameter gradients' first pass in the same launch (c % 256 == 0,
// c ≤ 4096, 16-byte aligned; the host's `bwd_cols_block`): norm_param_grad read dy and x a
// second time (2 · 67 MB a 1.3B LayerNorm, 48 of them a step). A block takes one COL_CHUNK-row
// chunk (64 registers a thread: two 512-thread blocks an SM, so 16k rows are one wave) with
// `teams` teams of c / 8 threads (whole warps), team u taking rows u, u + teams, …; a thread
// holds eight columns. Per row: dy and x once, the two row sums by warp shuffles and one
// barrier of the team (two slots, alternating by row, so a slot is rewritten only after every
// reader of its last use has reached the next barrier), dx stored, and the thread's running dw
// (and db) sums over its rows updated. Then the teams' sums are added in team order and stored as
// the chunk's partials, which col_sum_f32 finishes as before. The order of the adds differs from
// norm_param_grad's (deterministic either way). `pr` (or null): partials of Σ rows of `res` too,
// the bias gradient of the linear layer whose output gradient the residual stream's is (fc2's
// before the MLP's norm, the attention projection's before the input norm), from the values this
// pass reads anyway instead of a bias_grad pass over them, kept in shared memory past the other
// sums' region. Dynamic shared memory: max(2 · teams · warps a team · 2, teams · c · (1 + LN +
// (pr != null))) floats, the last term also with one team when pr is given.
// Adds v[0..8] into a thread's two float4 column sums at p[0] and p[stride] in shared memory
// (the residual's and, in the v6 builds, a LayerNorm's bias sums): a 32-bit shared address and one
// half at a time, so fewer registers are live.
__device__ __forceinline__ void smem_add8(float4* p, int stride, const float* v) {
    const unsigned at = (unsigned)__cvta_generic_to_shared(p), step = 16u * stride;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float4 s;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(s.x), "=f"(s.y), "=f"(s.z), "=f"(s.w) : "r"(at + h * step) : "memory");
        s.x += v[4 * h]; s.y += v[4 * h + 1]; s.z += v[4 * h + 2]; s.w += v[4 * h + 3];
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(at + h * step), "f"(s.x), "f"(s.y), "f"(s.z), "f"(s.w) : "memory");
    }
}
__device__ __forceinline__ void team_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// V (lab builds, `FERROTRON_NORM_BWD`): 0 the v5 kernel; 1 LayerNorm's bias sums in shared memory
// as the residual's (eight registers fewer across the row loop: v5 spilled); 2 that without the
// next row's L2 prefetch (Nsight Compute had v5's L2 at 81% busy, each line requested twice).
template <bool LN, int V, typename T>
__device__ __forceinline__ void norm_bwd_cols(const T* dy, const T* x, const T* w, const float* mean,
                                              const float* rstd, const T* res, T* dx, float* pw, float* pb,
                                              float* pr, long rows, long c, float ws) {
    extern __shared__ float nb_smem[];
    const int tthreads = (int)(c / 8), teams = blockDim.x / tthreads, wpt = tthreads / 32;
    const int team = threadIdx.x / tthreads, tt = threadIdx.x % tthreads, lane = threadIdx.x & 31, wit = tt >> 5;
    const long j = (long)tt * 8, r0 = (long)blockIdx.x * COL_CHUNK, r1 = r0 + COL_CHUNK < rows ? r0 + COL_CHUNK : rows;
    constexpr bool SB = LN && V > 0;  // the bias sums in shared memory (sb's region, as sr's layout)
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float4* bmine = reinterpret_cast<float4*>(nb_smem + (long)teams * c) + (long)team * 2 * tthreads + tt;
    if (SB) {
        bmine[0] = make_float4(0.f, 0.f, 0.f, 0.f);
        bmine[tthreads] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    // The residual's sums run in shared memory (in registers they spilled under 64): this
    // thread's eight columns as two float4s, at (team · 2 + half) · tthreads + tt, so a warp's
    // accesses are consecutive 16-byte pieces (no bank conflicts; eight floats a thread apart
    // were 8-way conflicted and made the kernel 1.7× slower). No other thread touches them until
    // the end.
    const bool rs_on = pr != nullptr && res != nullptr;
    float4* sr = reinterpret_cast<float4*>(nb_smem + (long)teams * c * (LN ? 2 : 1));
    float4* mine = sr + (long)team * 2 * tthreads + tt;
    if (rs_on) {
        mine[0] = make_float4(0.f, 0.f, 0.f, 0.f);
        mine[tthreads] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    int k = 0;
    for (long r = r0 + team; r < r1; r += teams, k++) {
        float g[8], gw[8], xh[8], sg = 0.f, sgx = 0.f;
        // The row's residual is read after the row sums' barrier, and the team's next row only
        // after this one's store: prefetches start them now, with no registers held (loads
        // issued here and held over the barrier spilled under 64 registers).
        if (res) prefetch_l1(res + r * c + j);
        // One thread per 128-byte line of the next row.
        if (const long nr = r + teams; V < 2 && nr < r1 && tt % (128 / (8 * (int)sizeof(T))) == 0) {
            prefetch_l2(dy + nr * c + j);
            prefetch_l2(x + nr * c + j);
            if (res) prefetch_l2(res + nr * c + j);
        }
        ld8(w, j, g);  // from L1 each row: held across the loop it cost spills under 64 registers
        add_shift8(g, ws);
        ld8(dy, r * c + j, gw);
        ld8(x, r * c + j, xh);
        const float mu = LN ? mean[r] : 0.f, rs = rstd[r];
        if (SB) smem_add8(bmine, tthreads, gw);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            xh[e] = (xh[e] - mu) * rs;
            a[e] += gw[e] * xh[e];
            if (LN && !SB) b[e] += gw[e];
            gw[e] *= g[e];
            sg += gw[e];
            sgx += gw[e] * xh[e];
        }
        for (int o = 16; o > 0; o >>= 1) {
            sg += __shfl_xor_sync(0xffffffffu, sg, o);
            sgx += __shfl_xor_sync(0xffffffffu, sgx, o);
        }
        float* slot = nb_smem + ((k & 1) * teams + team) * wpt * 2;
        if (lane == 0) { slot[2 * wit] = sg; slot[2 * wit + 1] = sgx; }
        team_sync(1 + team, tthreads);
        sg = 0.f; sgx = 0.f;
        for (int u = 0; u < wpt; u++) { sg += slot[2 * u]; sgx += slot[2 * u + 1]; }
        sg /= c; sgx /= c;
        float rr[8];
        add_res8(res, r * c + j, rr);
#pragma unroll
        for (int e = 0; e < 8; e++) gw[e] = rs * (gw[e] - (LN ? sg : 0.f) - xh[e] * sgx) + rr[e];
        if (rs_on) smem_add8(mine, tthreads, rr);
        st8(dx, r * c + j, gw);
    }
    const long out = (long)blockIdx.x * c + j;
    if (SB) {
        // Each thread's own sums: read back in the order they were added, as v5's registers.
        const float4 lo = bmine[0], hi = bmine[tthreads];
        b[0] = lo.x; b[1] = lo.y; b[2] = lo.z; b[3] = lo.w;
        b[4] = hi.x; b[5] = hi.y; b[6] = hi.z; b[7] = hi.w;
    }
    if (teams == 1) {
        st8(pw, out, a);
        if (LN) st8(pb, out, b);
        if (rs_on) {
            const float4 lo = mine[0], hi = mine[tthreads];
            const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            st8(pr, out, v);
        }
        return;
    }
    __syncthreads();  // every team past its last row (and its bias sums read): the slots' memory takes the sums
    float* sa = nb_smem;
    float* sb = nb_smem + (long)teams * c;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        sa[team * c + j + e] = a[e];
        if (LN) sb[team * c + j + e] = b[e];
    }
    __syncthreads();
    if (team != 0) return;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        a[e] = 0.f; b[e] = 0.f;
        for (int u = 0; u < teams; u++) {
            a[e] += sa[u * c + j + e];
            if (LN) b[e] += sb[u * c + j + e];
        }
    }
    st8(pw, out, a);
    if (LN) st8(pb, out, b);
    if (rs_on) {
        // Reusing a (its sums are stored) for the residual's, added in team order.
#pragma unroll
        for (int e = 0; e < 8; e++) a[e] = 0.f;
        for (int u = 0; u < teams; u++) {
            const float4 lo = sr[(long)u * 2 * tthreads + tt], hi = sr[((long)u * 2 + 1) * tthreads + tt];
            a[0] += lo.x; a[1] += lo.y; a[2] += lo.z; a[3] += lo.w;
            a[4] += hi.x; a[5] += hi.y; a[6] += hi.z; a[7] += hi.w;
        }
        st8(pr, out, a);
    }
}
#define NORM_BWD_COLS(s, T, V, SUF) \
extern "C" __global__ void __launch_bounds__(512, 2) layernorm_bwd_cols##SUF##_##s(const T* dy, const T* x, const T* w, const float* mean, const float* rstd, const T* res, T* dx, float* pw, float* pb, float* pr, long rows, long c, float ws) { \
    pdl_wait(); norm_bwd_cols<true, V>(dy, x, w, mean, rstd, res, dx, pw, pb, pr, rows, c, ws); } \
extern "C" __global__ void __launch_bounds__(512, 2) rmsnorm_bwd_cols##SUF##_##s(const T* dy, const T* x, const T* w, const float* rstd, const T* res, T* dx, float* pw, float* pr, long rows, long c, float ws) { \
    pdl_wait(); norm_bwd_cols<false, V>(dy, x, w, nullptr, rstd, res, dx, pw, nullptr, pr, rows, c, ws); }
#define NORM_BWD_COLS_ALL(s, T) NORM_BWD_COLS(s, T, 0, ) NORM_BWD_COLS(s, T, 1, _v6) NORM_BWD_COLS(s, T, 2, _v6np)
FOR_TYPES(NORM_BWD_COLS_ALL)
