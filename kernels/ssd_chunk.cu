// Mamba-2's scan in its chunked form (SSD), the same math as ssm.cu's step-by-step kernels
// (crates/kernels/src/cpu/ssm.rs has it) with the steps of a chunk taken at once, as small
// matrix products in shared memory, so a layer is B·H·chunks blocks of work instead of B·H
// threads' walks of T steps.
//
// Per chunk of Q = SSD_Q steps (= SCAN_CHUNK; the last one padded with dt = 0 and zero rows, which
// changes no sum) of sequence b and head h, with a_i = dt_i·A and cum_i = Σ_{k ≤ i} a_k:
//   y_i   = e^{cum_i} · S0ᵀ C_i + Σ_{j ≤ i} M_ij x_j + D·x_i,     M_ij = e^{cum_i − cum_j} dt_j ⟨C_i, B_j⟩
//   S_end = e^{cum_last} · S0 + Σ_j w_j B_j ⊗ x_j,                 w_j = e^{cum_last − cum_j} dt_j
// S0 is the state the chunk starts from ([N, P], what the forward saves per chunk for the
// backward). Forward: `ssd_chunk_state` (mode 0) writes each chunk's own Σ_j w_j B_j ⊗ x_j,
// `ssd_state_pass` turns those into every chunk's S0 in place (S0_{c+1} = e^{cum_last,c} S0_c + own_c),
// `ssd_chunk_out` forms y. Backward, with G = ∂L/∂S_end: `ssd_chunk_state` (mode 1) writes each
// chunk's Σ_i e^{cum_i} C_i ⊗ dy_i, `ssd_state_pass` walks the chunks backwards into every chunk's
// G (G_{c−1} = e^{cum_last,c} G_c + own_c), and `ssd_chunk_bwd` forms, with P_ij = e^{cum_i − cum_j}
// dt_j ⟨dy_i, x_j⟩ (j ≤ i):
//   dx = Mᵀ dy + diag(w) B G + D·dy;  dB = Pᵀ C + diag(w) x Gᵀ;  dC = P B + diag(e^{cum}) dy S0ᵀ
// and dt through both its direct uses and cum (∂cum_k summed from step k on). dB and dC are per
// head, summed over a group's heads after (ssm.cu's `ssd_bc_sum`); the parameters' partials are
// per (sequence, head, chunk), summed in order after (`ssd_prm_sum`). No atomics: the same bits
// every run. Every product accumulates in f32 from f32 copies in shared memory (the states S0 and
// G read from global memory); the block's threads (any multiple of 32 from 128) own 4 × 4 patches
// of an output. bf16 runs of Mamba-2's usual sizes take ssd_chunk_tc.cu's chunk state, output and
// backward instead (tensor cores).

#define SSD_Q 64

// acc[u][v] += Σ_{k0 ≤ k < k1} A(r0 + u, k) · B(k, c0 + v), A(r, k) = a[min(r, rmax)·ars + k·acs],
// B(k, c) = b[k·brs + min(c, cmax)·bcs]. AV: A's four rows side by side (ars = 1), read as one
// float4; BV: B's four columns side by side (bcs = 1), one float4 (16-byte aligned and padded:
// shared memory, or a global [N, P] state with P a multiple of 4). Otherwise four loads, clamped:
// the global states have no padding (what clamped rows and columns produce is not stored).
template <bool AV, bool BV>
__device__ __forceinline__ void ssd_mm(float acc[4][4], const float* a, int ars, int acs, const float* b, int brs, int bcs,
                                       int k0, int k1, int r0, int c0, int rmax, int cmax) {
    int ro[4], co[4];
    for (int u = 0; u < 4; u++) { ro[u] = min(r0 + u, rmax) * ars; co[u] = min(c0 + u, cmax) * bcs; }
    for (int k = k0; k < k1; k++) {
        float av[4], bv[4];
        if (AV) { float4 t = *(const float4*)(a + r0 + k * acs); av[0] = t.x; av[1] = t.y; av[2] = t.z; av[3] = t.w; }
        else for (int u = 0; u < 4; u++) av[u] = a[ro[u] + k * acs];
        if (BV) { float4 t = *(const float4*)(b + k * brs + c0); bv[0] = t.x; bv[1] = t.y; bv[2] = t.z; bv[3] = t.w; }
        else for (int v = 0; v < 4; v++) bv[v] = b[k * brs + co[v]];
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < 4; v++) acc[u][v] = fmaf(av[u], bv[v], acc[u][v]);
    }
}

__device__ __forceinline__ void ssd_zero(float acc[4][4]) {
    for (int u = 0; u < 4; u++)
        for (int v = 0; v < 4; v++) acc[u][v] = 0.f;
}

// Loads in batches of SSD_AHEAD a thread, every load of a batch issued before its first use: a
// block of these kernels is alone or nearly so on its SM (their shared memory), so without that
// each thread would wait out one memory latency per element.
#define SSD_AHEAD 8

// Eight columns a load (16 bytes of bf16, 32 of f32) where the columns, their start and the row
// stride divide by 8 and the source is 16-byte aligned; returns false otherwise (the callers then
// load element by element). put(i, j, v) stores row i's columns j … j + 7 (zero past the
// sequence). rows_fast: consecutive threads take consecutive rows (for transposed stores, which
// then meet no bank twice), else consecutive column groups of a row (coalesced reads).
#define SSD_AHEAD8 4
template <typename T, typename Put>
__device__ __forceinline__ bool ssd_load8(const T* src, long row_stride, long col0, int width, long b, long seq, long t0,
                                          bool rows_fast, Put put) {
    if ((width | col0 | row_stride) % 8 != 0 || ((unsigned long long)src & 15) != 0) return false;
    const int w8 = width / 8, total = SSD_Q * w8;
    for (int e0 = threadIdx.x; e0 < total; e0 += SSD_AHEAD8 * blockDim.x) {
        float v[SSD_AHEAD8][8];
#pragma unroll
        for (int u = 0; u < SSD_AHEAD8; u++) {
            int e = e0 + u * blockDim.x, i = rows_fast ? e % SSD_Q : e / w8, j = (rows_fast ? e / SSD_Q : e % w8) * 8;
            long t = t0 + i;
            if (e < total && t < seq) ld8(src, (b * seq + t) * row_stride + col0 + j, v[u]);
            else
#pragma unroll
                for (int k = 0; k < 8; k++) v[u][k] = 0.f;
        }
#pragma unroll
        for (int u = 0; u < SSD_AHEAD8; u++) {
            int e = e0 + u * blockDim.x, i = rows_fast ? e % SSD_Q : e / w8, j = (rows_fast ? e / SSD_Q : e % w8) * 8;
            if (e < total) put(i, j, v[u]);
        }
    }
    return true;
}

// Eight floats into row-major shared memory at p (two 16-byte stores where p is aligned).
__device__ __forceinline__ void ssd_put_row(float* p, const float* v, float s) {
    if (((unsigned long long)p & 15) == 0) {
        *(float4*)p = make_float4(v[0] * s, v[1] * s, v[2] * s, v[3] * s);
        *(float4*)(p + 4) = make_float4(v[4] * s, v[5] * s, v[6] * s, v[7] * s);
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) p[k] = v[k] * s;
    }
}

// Rows t0 … t0 + Q − 1 of `width` columns from col0 of a row-major source into dst [Q, wpad]
// (zero past the sequence's end and past `width`), each row times w[i] when w is given.
template <typename T>
__device__ void ssd_load(float* dst, int wpad, const T* src, long row_stride, long col0, int width, long b, long seq,
                         long t0, const float* w) {
    auto put = [&](int i, int j, const float* v) { ssd_put_row(dst + i * wpad + j, v, w ? w[i] : 1.f); };
    if (ssd_load8(src, row_stride, col0, width, b, seq, t0, false, put)) {
        for (int e = threadIdx.x; e < SSD_Q * (wpad - width); e += blockDim.x)
            dst[(e / (wpad - width)) * wpad + width + e % (wpad - width)] = 0.f;
        return;
    }
    const int total = SSD_Q * wpad;
    for (int e0 = threadIdx.x; e0 < total; e0 += SSD_AHEAD * blockDim.x) {
        float v[SSD_AHEAD];
#pragma unroll
        for (int u = 0; u < SSD_AHEAD; u++) {
            int e = e0 + u * blockDim.x, i = e / wpad, j = e % wpad;
            long t = t0 + i;
            v[u] = (e < total && t < seq && j < width) ? ld(src, (b * seq + t) * row_stride + col0 + j) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < SSD_AHEAD; u++) {
            int e = e0 + u * blockDim.x;
            if (e < total) dst[e] = w ? v[u] * w[e / wpad] : v[u];
        }
    }
}

// The same rows transposed: dst [wpad, Q], dst[j·Q + i] = row i's column j (consecutive threads
// take consecutive rows, so the stores meet no bank twice; the rows' reads after the first hit L1).
template <typename T>
__device__ void ssd_load_t(float* dst, int wpad, const T* src, long row_stride, long col0, int width, long b, long seq,
                           long t0) {
    auto put = [&](int i, int j, const float* v) {
#pragma unroll
        for (int k = 0; k < 8; k++) dst[(j + k) * SSD_Q + i] = v[k];
    };
    if (ssd_load8(src, row_stride, col0, width, b, seq, t0, true, put)) {
        for (int e = threadIdx.x; e < SSD_Q * (wpad - width); e += blockDim.x) dst[width * SSD_Q + e] = 0.f;
        return;
    }
    const int total = SSD_Q * wpad;
    for (int e0 = threadIdx.x; e0 < total; e0 += SSD_AHEAD * blockDim.x) {
        float v[SSD_AHEAD];
#pragma unroll
        for (int u = 0; u < SSD_AHEAD; u++) {
            int e = e0 + u * blockDim.x, i = e % SSD_Q, j = e / SSD_Q;
            long t = t0 + i;
            v[u] = (e < total && t < seq && j < width) ? ld(src, (b * seq + t) * row_stride + col0 + j) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < SSD_AHEAD; u++) {
            int e = e0 + u * blockDim.x;
            if (e < total) dst[e] = v[u];
        }
    }
}

// Σ a[e] · b[e] over e < len (global), SSD_AHEAD pairs in flight a thread; the block's total.
__device__ float ssd_dot(const float* a, const float* b, long len) {
    float part = 0.f;
    for (long e0 = threadIdx.x; e0 < len; e0 += SSD_AHEAD * blockDim.x) {
        float x[SSD_AHEAD], y[SSD_AHEAD];
#pragma unroll
        for (int u = 0; u < SSD_AHEAD; u++) {
            long e = e0 + u * blockDim.x;
            x[u] = e < len ? a[e] : 0.f;
            y[u] = e < len ? b[e] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < SSD_AHEAD; u++) part += x[u] * y[u];
    }
    return block_sum(part);
}

// dt (0 past the end), dt_raw + dt_bias, and cum of a chunk; every thread sees them on return.
template <typename T>
__device__ void ssd_dt_cum(const T* dt_raw, const float* dt_bias, float a_h, long b, long h, long hh, long seq, long t0,
                           float* sdt, float* scum, float* sraw) {
    if (threadIdx.x < SSD_Q) {
        long t = t0 + threadIdx.x;
        float raw = 0.f, dt = 0.f;
        if (t < seq) { raw = ld(dt_raw, (b * seq + t) * hh + h) + dt_bias[h]; dt = ssm_softplus(raw); }
        sdt[threadIdx.x] = dt;
        sraw[threadIdx.x] = raw;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (int i = 0; i < SSD_Q; i++) { s += sdt[i] * a_h; scum[i] = s; }
    }
    __syncthreads();
}

// Block (bh·chunks + c): out[bh, c] [N, P] = Σ_i U_i ⊗ (w_i V_i). Mode 0: U = B, V = x,
// w = e^{cum_last − cum_i} dt_i; mode 1: U = C, V = dy, w = e^{cum_i}. decay[bh, c] = e^{cum_last}.
// This part: U into su [Q, ldu] and w·V into sv [Q, ldv] (zero past the data), after dt, cum, raw
// and w in smem's first 4·Q floats; every thread sees them on return. ssd_chunk_state multiplies
// them on f32 FMAs, ssd_chunk_state_tc (ssd_chunk_tc.cu) on tensor cores.
template <typename T>
__device__ void ssd_state_operands(const T* xbc, const T* dy, const T* dt_raw, const float* dt_bias, const float* a_log,
                                   float* decay, long seq, long hh, long p, long g, long n, int mode, float* smem, float* su,
                                   int ldu, float* sv, int ldv) {
    long nch = (seq + SSD_Q - 1) / SSD_Q, blk = blockIdx.x, c = blk % nch, bh = blk / nch, b = bh / hh, h = bh % hh;
    long gi = h / (hh / g), cd = hh * p + 2 * g * n, t0 = c * SSD_Q;
    float *sdt = smem, *scum = sdt + SSD_Q, *sraw = scum + SSD_Q, *sw = sraw + SSD_Q;
    float a_h = -expf(a_log[h]);
    ssd_dt_cum(dt_raw, dt_bias, a_h, b, h, hh, seq, t0, sdt, scum, sraw);
    if (threadIdx.x < SSD_Q) {
        int i = threadIdx.x;
        sw[i] = mode == 0 ? expf(scum[SSD_Q - 1] - scum[i]) * sdt[i] : expf(scum[i]);
    }
    if (threadIdx.x == 0) decay[blk] = expf(scum[SSD_Q - 1]);
    __syncthreads();
    if (mode == 0) {
        ssd_load(su, ldu, xbc, cd, hh * p + gi * n, (int)n, b, seq, t0, (const float*)0);
        ssd_load(sv, ldv, xbc, cd, h * p, (int)p, b, seq, t0, sw);
    } else {
        ssd_load(su, ldu, xbc, cd, hh * p + g * n + gi * n, (int)n, b, seq, t0, (const float*)0);
        ssd_load(sv, ldv, dy, hh * p, h * p, (int)p, b, seq, t0, sw);
    }
    __syncthreads();
}

// Shared: 4·Q + Q·(N + P) floats, N and P rounded up to 4.
template <typename T>
__device__ void ssd_chunk_state(const T* xbc, const T* dy, const T* dt_raw, const float* dt_bias, const float* a_log,
                                float* out, float* decay, long seq, long hh, long p, long g, long n, int mode) {
    extern __shared__ float smem[];
    int np4 = (int)((n + 3) & ~3L), pp4 = (int)((p + 3) & ~3L);
    float *su = smem + 4 * SSD_Q, *sv = su + SSD_Q * np4;
    ssd_state_operands(xbc, dy, dt_raw, dt_bias, a_log, decay, seq, hh, p, g, n, mode, smem, su, np4, sv, pp4);
    int pc = pp4 / 4;
    float* o = out + blockIdx.x * n * p;
    for (int e = threadIdx.x; e < (np4 / 4) * pc; e += blockDim.x) {
        int r0 = (e / pc) * 4, c0 = (e % pc) * 4;
        float acc[4][4];
        ssd_zero(acc);
        ssd_mm<true, true>(acc, su, 1, np4, sv, pp4, 1, 0, SSD_Q, r0, c0, np4 - 1, pp4 - 1);
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < 4; v++)
                if (r0 + u < n && c0 + v < p) o[(r0 + u) * p + c0 + v] = acc[u][v];
    }
}

// Block (bh·chunks + c): y of the chunk from its S0 (states[bh, c]). Shared: 3·Q + Q·(2N + P) + Q² floats.
template <typename T>
__device__ void ssd_chunk_out(const T* xbc, const T* dt_raw, const float* dt_bias, const float* a_log, const float* dd,
                              const float* states, T* y, long seq, long hh, long p, long g, long n) {
    extern __shared__ float smem[];
    long nch = (seq + SSD_Q - 1) / SSD_Q, blk = blockIdx.x, c = blk % nch, bh = blk / nch, b = bh / hh, h = bh % hh;
    long gi = h / (hh / g), cd = hh * p + 2 * g * n, t0 = c * SSD_Q;
    int np4 = (int)((n + 3) & ~3L), pp4 = (int)((p + 3) & ~3L);
    float *sdt = smem, *scum = sdt + SSD_Q, *sraw = scum + SSD_Q, *sC = sraw + SSD_Q, *sBt = sC + SSD_Q * np4;
    float *sx = sBt + SSD_Q * np4, *sM = sx + SSD_Q * pp4;
    float a_h = -expf(a_log[h]);
    ssd_dt_cum(dt_raw, dt_bias, a_h, b, h, hh, seq, t0, sdt, scum, sraw);
    ssd_load(sC, np4, xbc, cd, hh * p + g * n + gi * n, (int)n, b, seq, t0, (const float*)0);
    ssd_load_t(sBt, np4, xbc, cd, hh * p + gi * n, (int)n, b, seq, t0);
    ssd_load(sx, pp4, xbc, cd, h * p, (int)p, b, seq, t0, (const float*)0);
    __syncthreads();
    const int qc = SSD_Q / 4;
    for (int e = threadIdx.x; e < qc * qc; e += blockDim.x) {
        int r0 = (e / qc) * 4, c0 = (e % qc) * 4;
        float acc[4][4];
        ssd_zero(acc);
        if (c0 <= r0) ssd_mm<false, true>(acc, sC, np4, 1, sBt, SSD_Q, 1, 0, np4, r0, c0, SSD_Q - 1, SSD_Q - 1);
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < 4; v++) {
                int i = r0 + u, j = c0 + v;
                sM[i * SSD_Q + j] = j <= i ? expf(scum[i] - scum[j]) * sdt[j] * acc[u][v] : 0.f;
            }
    }
    __syncthreads();
    const float* s0 = states + blk * n * p;
    int pc = pp4 / 4;
    float dh = dd[h];
    for (int e = threadIdx.x; e < qc * pc; e += blockDim.x) {
        int r0 = (e / pc) * 4, c0 = (e % pc) * 4;
        float acc[4][4], off[4][4];
        ssd_zero(acc);
        ssd_zero(off);
        ssd_mm<false, true>(acc, sM, SSD_Q, 1, sx, pp4, 1, 0, r0 + 4, r0, c0, SSD_Q - 1, pp4 - 1);
        if (p % 4 == 0) ssd_mm<false, true>(off, sC, np4, 1, s0, (int)p, 1, 0, (int)n, r0, c0, SSD_Q - 1, (int)p - 1);
        else ssd_mm<false, false>(off, sC, np4, 1, s0, (int)p, 1, 0, (int)n, r0, c0, SSD_Q - 1, (int)p - 1);
        for (int u = 0; u < 4; u++) {
            int i = r0 + u;
            long t = t0 + i;
            if (t >= seq) continue;
            float ec = expf(scum[i]);
            for (int v = 0; v < 4; v++)
                if (c0 + v < p) st(y, (b * seq + t) * hh * p + h * p + c0 + v, acc[u][v] + ec * off[u][v] + dh * sx[i * pp4 + c0 + v]);
        }
    }
}

// Row sums of R (R_kj = dt_j · Z_kj) into rowR and column sums of Z into colZ, for Z [Q, ld] in
// shared memory: the first Q threads take the rows, the next Q the columns.
__device__ __forceinline__ void ssd_rz_sums(const float* sZ, int ld, const float* sdt, float* rowR, float* colZ) {
    if (threadIdx.x < 2 * SSD_Q) {
        int k = threadIdx.x % SSD_Q;
        float r = 0.f;
        if (threadIdx.x < SSD_Q) {
            for (int j = 0; j < SSD_Q; j++) r += sdt[j] * sZ[k * ld + j];
            rowR[k] = r;
        } else {
            for (int i = 0; i < SSD_Q; i++) r += sZ[i * ld + k];
            colZ[k] = r;
        }
    }
}

// Σ of row i's partials red[i·nred …], in order.
__device__ __forceinline__ float ssd_red_row(const float* red, int nred, int i) {
    float s = 0.f;
    for (int q = 0; q < nred; q++) s += red[i * nred + q];
    return s;
}

// The chunk's dt walk, by thread 0: ∂cum_k = Σ_j R_kj − Σ_i R_ik + O_k − dt_k E'_k (+ e0 +
// Σ_j dt_j E'_j at the last step); ∂a_j = Σ_{k ≥ j} ∂cum_k; ddt_j = Σ_i Z_ij + E'_j + ∂a_j · A,
// through softplus into ddt; the parameters' partials (dt_bias, a_log, D) into prm[blk].
template <typename T>
__device__ void ssd_dt_walk(const float* sdt, const float* sraw, const float* rowR, const float* colZ, const float* sO,
                            const float* sE, float e0, float a_h, float d_d, long b, long h, long hh, long seq, long t0,
                            long blk, T* ddt, float* prm) {
    if (threadIdx.x != 0) return;
    float etot = 0.f;
    for (int j = 0; j < SSD_Q; j++) etot += sdt[j] * sE[j];
    float da = 0.f, d_a = 0.f, d_bias = 0.f;
    for (int j = SSD_Q - 1; j >= 0; j--) {
        da += rowR[j] - sdt[j] * colZ[j] + sO[j] - sdt[j] * sE[j] + (j == SSD_Q - 1 ? e0 + etot : 0.f);
        long t = t0 + j;
        if (t >= seq) continue;
        float d_raw = (colZ[j] + sE[j] + da * a_h) * ssm_softplus_grad(sraw[j]);
        d_a += da * sdt[j];
        st(ddt, (b * seq + t) * hh + h, d_raw);
        d_bias += d_raw;
    }
    prm[blk * 3] = d_bias;
    prm[blk * 3 + 1] = d_a * a_h;
    prm[blk * 3 + 2] = d_d;
}

// Block (bh·chunks + c): the chunk's gradients from its S0 (states) and G (gstates). Writes dxbc's
// x columns, ddt_raw, dB and dC per head (dbh, dch [B·T, H, N]) and the parameters' partials
// prm[blk] = (dt_bias, a_log, D). x, dy and B sit transposed in shared memory and dx, dB, dC
// are formed transposed, so every product reads its B operand as rows of four (float4) and its A
// operand at no more than two addresses a warp. Shared: 7·Q + Q·(2P + 2N) + 4·Q² + Q·N/4 floats.
template <typename T>
__device__ void ssd_chunk_bwd(const T* xbc, const T* dt_raw, const float* dt_bias, const float* a_log, const float* dd,
                              const float* states, const float* gstates, const T* dy, T* dxbc, T* ddt, float* dbh, float* dch,
                              float* prm, long seq, long hh, long p, long g, long n) {
    extern __shared__ float smem[];
    long nch = (seq + SSD_Q - 1) / SSD_Q, blk = blockIdx.x, c = blk % nch, bh = blk / nch, b = bh / hh, h = bh % hh;
    long gi = h / (hh / g), cd = hh * p + 2 * g * n, t0 = c * SSD_Q;
    int np4 = (int)((n + 3) & ~3L), pp4 = (int)((p + 3) & ~3L), nred = np4 / 4;
    const int Q = SSD_Q;
    float *sdt = smem, *scum = sdt + Q, *sraw = scum + Q;
    float *rowR = sraw + Q, *colZ = rowR + Q, *sO = colZ + Q, *sE = sO + Q;
    float *sxt = sE + Q, *sdyt = sxt + Q * pp4, *sBt = sdyt + Q * pp4, *sC = sBt + Q * np4;
    float *sM = sC + Q * np4, *sP = sM + Q * Q, *sPt = sP + Q * Q, *sZ = sPt + Q * Q, *sred = sZ + Q * Q;
    float a_h = -expf(a_log[h]), dh = dd[h];
    const float* s0 = states + blk * n * p;
    const float* gs = gstates + blk * n * p;
    ssd_dt_cum(dt_raw, dt_bias, a_h, b, h, hh, seq, t0, sdt, scum, sraw);
    ssd_load_t(sxt, pp4, xbc, cd, h * p, (int)p, b, seq, t0);
    ssd_load_t(sdyt, pp4, dy, hh * p, h * p, (int)p, b, seq, t0);
    ssd_load_t(sBt, np4, xbc, cd, hh * p + gi * n, (int)n, b, seq, t0);
    ssd_load(sC, np4, xbc, cd, hh * p + g * n + gi * n, (int)n, b, seq, t0, (const float*)0);
    __syncthreads();
    float part = 0.f;
    for (int e = threadIdx.x; e < Q * pp4; e += blockDim.x) part += sxt[e] * sdyt[e];
    float d_d = block_sum(part);
    float clast = scum[Q - 1], e0 = ssd_dot(gs, s0, n * p) * expf(clast);

    // M, P (and Pᵀ) and Z_ij = e^{cum_i − cum_j} ⟨C_i, B_j⟩ ⟨dy_i, x_j⟩ (j ≤ i; R = Z · dt_j is the
    // pair's term of the loss).
    const int qc = Q / 4;
    for (int e = threadIdx.x; e < qc * qc; e += blockDim.x) {
        int r0 = (e / qc) * 4, c0 = (e % qc) * 4;
        float cb[4][4], dx[4][4];
        ssd_zero(cb);
        ssd_zero(dx);
        if (c0 <= r0) {
            ssd_mm<false, true>(cb, sC, np4, 1, sBt, Q, 1, 0, np4, r0, c0, Q - 1, Q - 1);
            ssd_mm<true, true>(dx, sdyt, 1, Q, sxt, Q, 1, 0, pp4, r0, c0, Q - 1, Q - 1);
        }
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < 4; v++) {
                int i = r0 + u, j = c0 + v, o = i * Q + j;
                float dec = j <= i ? expf(scum[i] - scum[j]) : 0.f;
                sM[o] = dec * sdt[j] * cb[u][v];
                sP[o] = dec * sdt[j] * dx[u][v];
                sPt[j * Q + i] = sP[o];
                sZ[o] = dec * cb[u][v] * dx[u][v];
            }
    }
    __syncthreads();
    ssd_rz_sums(sZ, Q, sdt, rowR, colZ);

    // dxᵀ = dyᵀ M + (B G)ᵀ diag(w) + D·dyᵀ: rows q, columns i.
    int pc = pp4 / 4, nc = np4 / 4;
    for (int e = threadIdx.x; e < pc * qc; e += blockDim.x) {
        int r0 = (e / qc) * 4, c0 = (e % qc) * 4;
        float acc[4][4], bg[4][4];
        ssd_zero(acc);
        ssd_zero(bg);
        ssd_mm<false, true>(acc, sdyt, Q, 1, sM, Q, 1, c0, Q, r0, c0, pp4 - 1, Q - 1);
        if (p % 4 == 0) ssd_mm<true, true>(bg, gs, 1, (int)p, sBt, Q, 1, 0, (int)n, r0, c0, (int)p - 1, Q - 1);
        else ssd_mm<false, true>(bg, gs, 1, (int)p, sBt, Q, 1, 0, (int)n, r0, c0, (int)p - 1, Q - 1);
        for (int v = 0; v < 4; v++) {
            int i = c0 + v;
            long t = t0 + i;
            if (t >= seq) continue;
            float w = expf(clast - scum[i]) * sdt[i];
            for (int u = 0; u < 4; u++)
                if (r0 + u < p) st(dxbc, (b * seq + t) * cd + h * p + r0 + u, acc[u][v] + w * bg[u][v] + dh * sdyt[(r0 + u) * Q + i]);
        }
    }
    // dBᵀ = Cᵀ P + Uᵀ diag(w), Uᵀ = G xᵀ: rows of state channels, columns j; sred holds each
    // column's Σ over the patch's rows of Bᵀ ∘ Uᵀ.
    for (int e = threadIdx.x; e < nc * qc; e += blockDim.x) {
        int r0 = (e / qc) * 4, c0 = (e % qc) * 4;
        float acc[4][4], uu[4][4];
        ssd_zero(acc);
        ssd_zero(uu);
        ssd_mm<true, true>(acc, sC, 1, np4, sP, Q, 1, c0, Q, r0, c0, np4 - 1, Q - 1);
        ssd_mm<false, true>(uu, gs, (int)p, 1, sxt, Q, 1, 0, (int)p, r0, c0, (int)n - 1, Q - 1);
        for (int v = 0; v < 4; v++) {
            int j = c0 + v;
            float w = expf(clast - scum[j]) * sdt[j], bu = 0.f;
            for (int u = 0; u < 4; u++)
                if (r0 + u < n) bu += sBt[(r0 + u) * Q + j] * uu[u][v];
            sred[j * nred + r0 / 4] = bu;
            long t = t0 + j;
            if (t >= seq) continue;
            for (int u = 0; u < 4; u++)
                if (r0 + u < n) dbh[((b * seq + t) * hh + h) * n + r0 + u] = acc[u][v] + w * uu[u][v];
        }
    }
    __syncthreads();
    if (threadIdx.x < Q)  // E'_j: the S_end term's ∂/∂dt_j
        sE[threadIdx.x] = expf(clast - scum[threadIdx.x]) * ssd_red_row(sred, nred, threadIdx.x);
    __syncthreads();
    // dCᵀ = Bᵀ Pᵀ + Vᵀ diag(e^{cum}), Vᵀ = S0 dyᵀ: rows of state channels, columns i; sred holds
    // each column's Σ over the patch's rows of Cᵀ ∘ Vᵀ.
    for (int e = threadIdx.x; e < nc * qc; e += blockDim.x) {
        int r0 = (e / qc) * 4, c0 = (e % qc) * 4;
        float acc[4][4], vv[4][4];
        ssd_zero(acc);
        ssd_zero(vv);
        ssd_mm<false, true>(acc, sBt, Q, 1, sPt, Q, 1, 0, c0 + 4, r0, c0, np4 - 1, Q - 1);
        ssd_mm<false, true>(vv, s0, (int)p, 1, sdyt, Q, 1, 0, (int)p, r0, c0, (int)n - 1, Q - 1);
        for (int v = 0; v < 4; v++) {
            int i = c0 + v;
            float ec = expf(scum[i]), cv = 0.f;
            for (int u = 0; u < 4; u++)
                if (r0 + u < n) cv += sC[i * np4 + r0 + u] * vv[u][v];
            sred[i * nred + r0 / 4] = cv;
            long t = t0 + i;
            if (t >= seq) continue;
            for (int u = 0; u < 4; u++)
                if (r0 + u < n) dch[((b * seq + t) * hh + h) * n + r0 + u] = acc[u][v] + ec * vv[u][v];
        }
    }
    __syncthreads();
    if (threadIdx.x < Q) sO[threadIdx.x] = expf(scum[threadIdx.x]) * ssd_red_row(sred, nred, threadIdx.x);
    __syncthreads();
    ssd_dt_walk(sdt, sraw, rowR, colZ, sO, sE, e0, a_h, d_d, b, h, hh, seq, t0, blk, ddt, prm);
}

#define SSD_CHUNK(s, T) \
extern "C" __global__ void ssd_chunk_state_##s(const T* xbc, const T* dy, const T* dt_raw, const float* dt_bias, const float* a_log, \
        float* out, float* decay, long seq, long hh, long p, long g, long n, long mode) { \
    ssd_chunk_state(xbc, dy, dt_raw, dt_bias, a_log, out, decay, seq, hh, p, g, n, (int)mode); } \
extern "C" __global__ void ssd_chunk_out_##s(const T* xbc, const T* dt_raw, const float* dt_bias, const float* a_log, const float* dd, \
        const float* states, T* y, long seq, long hh, long p, long g, long n) { \
    ssd_chunk_out(xbc, dt_raw, dt_bias, a_log, dd, states, y, seq, hh, p, g, n); } \
extern "C" __global__ void ssd_chunk_bwd_##s(const T* xbc, const T* dt_raw, const float* dt_bias, const float* a_log, const float* dd, \
        const float* states, const float* gstates, const T* dy, T* dxbc, T* ddt, float* dbh, float* dch, float* prm, \
        long seq, long hh, long p, long g, long n) { \
    ssd_chunk_bwd(xbc, dt_raw, dt_bias, a_log, dd, states, gstates, dy, dxbc, ddt, dbh, dch, prm, seq, hh, p, g, n); }
FOR_TYPES(SSD_CHUNK)

// The chunks' states in order, in place, one thread per (sequence·head, state element):
// forward, st[c] = own_c becomes S0_c (S0_0 = 0, S0_{c+1} = decay_c · S0_c + own_c); reverse,
// st[c] = own_c becomes G_c (G_last = 0, G_{c−1} = decay_c · G_c + own_c). 32 chunks' values
// are read before any is written, so 32 loads are in flight instead of one (8: 200 µs a call in
// the 68M model, 16: 112 µs).
#define SSD_PASS_AHEAD 32
extern "C" __global__ void ssd_state_pass(float* st, const float* decay, long bhs, long nch, long np_, long reverse) {
    GRID_STRIDE(e, bhs * np_) {
        long bh = e / np_, k = e % np_;
        float s = 0.f;
        for (long i0 = 0; i0 < nch; i0 += SSD_PASS_AHEAD) {
            float own[SSD_PASS_AHEAD], dec[SSD_PASS_AHEAD];
#pragma unroll
            for (int j = 0; j < SSD_PASS_AHEAD; j++) {
                long i = i0 + j, c = reverse ? nch - 1 - i : i;
                own[j] = i < nch ? st[(bh * nch + c) * np_ + k] : 0.f;
                dec[j] = i < nch ? decay[bh * nch + c] : 0.f;
            }
#pragma unroll
            for (int j = 0; j < SSD_PASS_AHEAD; j++) {
                long i = i0 + j, c = reverse ? nch - 1 - i : i;
                if (i >= nch) break;
                st[(bh * nch + c) * np_ + k] = s;
                s = dec[j] * s + own[j];
            }
        }
    }
}
