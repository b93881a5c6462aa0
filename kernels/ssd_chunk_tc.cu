// The chunked scan's output and backward (ssd_chunk.cu has the math) with the products on tensor
// cores: mma.sync m16n8k8 in TF32 with f32 accumulation, for bf16 inputs and outputs (a bf16 value
// is exact in TF32; the f32 intermediates M, P rounded to TF32 stay well inside the bf16 outputs'
// rounding). f32 runs keep ssd_chunk.cu's f32 FMAs. Needs P and N multiples of 32 (Mamba-2's
// 64 and 128): the host picks these kernels only then.
//
// Eight warps; each product's output is cut into 32 × 16 warp tiles (2 × 2 m16n8 tiles) taken in
// turn by the warps. Shared arrays have row strides of width + 4 floats (≡ 4 mod 32 banks), so a
// fragment's eight rows × four columns meet no bank twice, and its four rows × eight columns at
// most twice.

#define SSD_LD (SSD_Q + 4)

__device__ __forceinline__ u32 ssd_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void ssd_mma8(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc += A[wr0 … wr0+32, k0 … k1) · B[k0 … k1, wc0 … wc0+16) for this warp's 32 × 16 tile, A(r, k) =
// a[r·ars + k·acs], B(k, c) = b[k·brs + c·bcs] (in bounds and zero past the data: k1 − k0 a
// multiple of 8). acc[mi][ni][e]: row wr0 + 16·mi + g + 8·(e / 2), column wc0 + 8·ni + 2·t + e % 2.
__device__ __forceinline__ void ssd_mma_tile(float acc[2][2][4], const float* a, int ars, int acs, const float* b, int brs,
                                             int bcs, int k0, int k1, int wr0, int wc0) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int k = k0; k < k1; k += 8) {
        u32 af[2][4], bf[2][2];
        for (int mi = 0; mi < 2; mi++) {
            int r = wr0 + 16 * mi + g;
            af[mi][0] = ssd_tf32(a[r * ars + (k + t) * acs]);
            af[mi][1] = ssd_tf32(a[(r + 8) * ars + (k + t) * acs]);
            af[mi][2] = ssd_tf32(a[r * ars + (k + t + 4) * acs]);
            af[mi][3] = ssd_tf32(a[(r + 8) * ars + (k + t + 4) * acs]);
        }
        for (int ni = 0; ni < 2; ni++) {
            int cc = wc0 + 8 * ni + g;
            bf[ni][0] = ssd_tf32(b[(k + t) * brs + cc * bcs]);
            bf[ni][1] = ssd_tf32(b[(k + t + 4) * brs + cc * bcs]);
        }
        for (int mi = 0; mi < 2; mi++)
            for (int ni = 0; ni < 2; ni++) ssd_mma8(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
}

__device__ __forceinline__ void ssd_tc_zero(float acc[2][2][4]) {
    for (int mi = 0; mi < 2; mi++)
        for (int ni = 0; ni < 2; ni++)
            for (int e = 0; e < 4; e++) acc[mi][ni][e] = 0.f;
}

// Row and column of accumulator element (mi, ni, e) of the tile at (wr0, wc0).
__device__ __forceinline__ int ssd_tc_row(int wr0, int mi, int e) { return wr0 + 16 * mi + ((threadIdx.x & 31) >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int ssd_tc_col(int wc0, int ni, int e) { return wc0 + 8 * ni + 2 * (threadIdx.x & 3) + (e & 1); }

// Rows t0 … t0 + Q − 1 of `width` columns into dst [Q, ld] (zero past the end), or transposed into
// dst [width, ld] (consecutive threads take consecutive rows).
template <typename T>
__device__ void ssd_tc_load(float* dst, int lds, bool transpose, const T* src, long row_stride, long col0, int width, long b,
                            long seq, long t0) {
    auto put = [&](int i, int j, const float* v) {
        if (transpose) {
#pragma unroll
            for (int k = 0; k < 8; k++) dst[(j + k) * lds + i] = v[k];
        } else {
            ssd_put_row(dst + i * lds + j, v, 1.f);
        }
    };
    if (ssd_load8(src, row_stride, col0, width, b, seq, t0, transpose, put)) return;
    const int total = SSD_Q * width;
    for (int e0 = threadIdx.x; e0 < total; e0 += SSD_AHEAD * blockDim.x) {
        float v[SSD_AHEAD];
#pragma unroll
        for (int u = 0; u < SSD_AHEAD; u++) {
            int e = e0 + u * blockDim.x, i = transpose ? e % SSD_Q : e / width, j = transpose ? e / SSD_Q : e % width;
            long t = t0 + i;
            v[u] = (e < total && t < seq) ? ld(src, (b * seq + t) * row_stride + col0 + j) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < SSD_AHEAD; u++) {
            int e = e0 + u * blockDim.x, i = transpose ? e % SSD_Q : e / width, j = transpose ? e / SSD_Q : e % width;
            if (e < total) dst[transpose ? j * lds + i : i * lds + j] = v[u];
        }
    }
}

// Σ over the warp tile's rows of v[mi][ni][e] for each of its columns, into red[col·nred + slot]
// (slot: the tile's row block). Lanes of one t hold the same columns: summed across g by shuffles.
__device__ __forceinline__ void ssd_tc_colsum(float v[2][2][4], int wc0, float* red, int nred, int slot) {
    int lane = threadIdx.x & 31;
    for (int ni = 0; ni < 2; ni++)
        for (int h = 0; h < 2; h++) {
            float s = v[0][ni][h] + v[0][ni][h + 2] + v[1][ni][h] + v[1][ni][h + 2];
            for (int o = 4; o < 32; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane < 4) red[ssd_tc_col(wc0, ni, h) * nred + slot] = s;
        }
}

// ssd_chunk_state on tensor cores: out [N, P] = Uᵀ · (w·V), U [Q, N + 4] and w·V [Q, P + 4] in
// shared memory (ssd_state_operands), K = the chunk's Q steps. Shared: 4·Q + Q·(N + 4) + Q·(P + 4)
// floats.
template <typename T>
__device__ void ssd_chunk_state_tc(const T* xbc, const T* dy, const T* dt_raw, const float* dt_bias, const float* a_log,
                                   float* out, float* decay, long seq, long hh, long p, long g, long n, int mode) {
    extern __shared__ float smem[];
    const int N = (int)n, P = (int)p, ldn = N + 4, ldp = P + 4, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float *su = smem + 4 * SSD_Q, *sv = su + SSD_Q * ldn;
    ssd_state_operands(xbc, dy, dt_raw, dt_bias, a_log, decay, seq, hh, p, g, n, mode, smem, su, ldn, sv, ldp);
    float* o = out + blockIdx.x * n * p;
    const int tc = P / 16;
    for (int tile = warp; tile < (N / 32) * tc; tile += nw) {
        int wr0 = (tile / tc) * 32, wc0 = (tile % tc) * 16;
        float acc[2][2][4];
        ssd_tc_zero(acc);
        ssd_mma_tile(acc, su, 1, ldn, sv, ldp, 1, 0, SSD_Q, wr0, wc0);
        for (int mi = 0; mi < 2; mi++)
            for (int ni = 0; ni < 2; ni++)
                for (int e = 0; e < 4; e++) o[ssd_tc_row(wr0, mi, e) * P + ssd_tc_col(wc0, ni, e)] = acc[mi][ni][e];
    }
}

// ssd_chunk_out on tensor cores. Shared: 3·Q + Q·(N + 4) + N·(Q + 4) + Q·(P + 4) + Q·(Q + 4) floats.
template <typename T>
__device__ void ssd_chunk_out_tc(const T* xbc, const T* dt_raw, const float* dt_bias, const float* a_log, const float* dd,
                                 const float* states, T* y, long seq, long hh, long p, long g, long n) {
    extern __shared__ float smem[];
    long nch = (seq + SSD_Q - 1) / SSD_Q, blk = blockIdx.x, c = blk % nch, bh = blk / nch, b = bh / hh, h = bh % hh;
    long gi = h / (hh / g), cd = hh * p + 2 * g * n, t0 = c * SSD_Q;
    const int Q = SSD_Q, N = (int)n, P = (int)p, ldn = N + 4, ldp = P + 4, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float *sdt = smem, *scum = sdt + Q, *sraw = scum + Q, *sC = sraw + Q, *sBt = sC + Q * ldn;
    float *sx = sBt + N * SSD_LD, *sM = sx + Q * ldp;
    float a_h = -expf(a_log[h]);
    ssd_dt_cum(dt_raw, dt_bias, a_h, b, h, hh, seq, t0, sdt, scum, sraw);
    ssd_tc_load(sC, ldn, false, xbc, cd, hh * p + g * n + gi * n, N, b, seq, t0);
    ssd_tc_load(sBt, SSD_LD, true, xbc, cd, hh * p + gi * n, N, b, seq, t0);
    ssd_tc_load(sx, ldp, false, xbc, cd, h * p, P, b, seq, t0);
    __syncthreads();
    // M = mask ∘ e^{cum_i − cum_j} dt_j ∘ C Bᵀ [Q, Q]
    for (int w = warp; w < (Q / 32) * (Q / 16); w += nw) {
        int wr0 = (w / (Q / 16)) * 32, wc0 = (w % (Q / 16)) * 16;
        float acc[2][2][4];
        ssd_tc_zero(acc);
        if (wc0 <= wr0 + 31) ssd_mma_tile(acc, sC, ldn, 1, sBt, SSD_LD, 1, 0, N, wr0, wc0);
        for (int mi = 0; mi < 2; mi++)
            for (int ni = 0; ni < 2; ni++)
                for (int e = 0; e < 4; e++) {
                    int i = ssd_tc_row(wr0, mi, e), j = ssd_tc_col(wc0, ni, e);
                    sM[i * SSD_LD + j] = j <= i ? expf(scum[i] - scum[j]) * sdt[j] * acc[mi][ni][e] : 0.f;
                }
    }
    __syncthreads();
    const float* s0 = states + blk * n * p;
    float dh = dd[h];
    for (int w = warp; w < (Q / 32) * (P / 16); w += nw) {
        int wr0 = (w / (P / 16)) * 32, wc0 = (w % (P / 16)) * 16;
        float acc[2][2][4], off[2][2][4];
        ssd_tc_zero(acc);
        ssd_tc_zero(off);
        ssd_mma_tile(acc, sM, SSD_LD, 1, sx, ldp, 1, 0, wr0 + 32, wr0, wc0);
        ssd_mma_tile(off, sC, ldn, 1, s0, P, 1, 0, N, wr0, wc0);
        for (int mi = 0; mi < 2; mi++)
            for (int ni = 0; ni < 2; ni++)
                for (int e = 0; e < 4; e++) {
                    int i = ssd_tc_row(wr0, mi, e), q = ssd_tc_col(wc0, ni, e);
                    long t = t0 + i;
                    if (t < seq)
                        st(y, (b * seq + t) * hh * p + h * p + q, acc[mi][ni][e] + expf(scum[i]) * off[mi][ni][e] + dh * sx[i * ldp + q]);
                }
    }
}

// ssd_chunk_bwd on tensor cores: dx, dB, dC formed transposed as there. G and S0 are read from
// global memory (L1): staged in shared memory they cost more than they saved (benches/NOTES.md,
// session 43). Shared: 7·Q + 2·P·(Q + 4) + N·(Q + 4) + Q·(N + 4) + 4·Q·(Q + 4) + Q·N/32 floats.
template <typename T>
__device__ void ssd_chunk_bwd_tc(const T* xbc, const T* dt_raw, const float* dt_bias, const float* a_log, const float* dd,
                                 const float* states, const float* gstates, const T* dy, T* dxbc, T* ddt, float* dbh,
                                 float* dch, float* prm, long seq, long hh, long p, long g, long n) {
    extern __shared__ float smem[];
    long nch = (seq + SSD_Q - 1) / SSD_Q, blk = blockIdx.x, c = blk % nch, bh = blk / nch, b = bh / hh, h = bh % hh;
    long gi = h / (hh / g), cd = hh * p + 2 * g * n, t0 = c * SSD_Q;
    const int Q = SSD_Q, L = SSD_LD, N = (int)n, P = (int)p, ldn = N + 4, nred = N / 32;
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float *sdt = smem, *scum = sdt + Q, *sraw = scum + Q;
    float *rowR = sraw + Q, *colZ = rowR + Q, *sO = colZ + Q, *sE = sO + Q;
    float *sxt = sE + Q, *sdyt = sxt + P * L, *sBt = sdyt + P * L, *sC = sBt + N * L;
    float *sM = sC + Q * ldn, *sP = sM + Q * L, *sPt = sP + Q * L, *sZ = sPt + Q * L, *sred = sZ + Q * L;
    float a_h = -expf(a_log[h]), dh = dd[h];
    const float* s0 = states + blk * n * p;
    const float* gs = gstates + blk * n * p;
    ssd_dt_cum(dt_raw, dt_bias, a_h, b, h, hh, seq, t0, sdt, scum, sraw);
    ssd_tc_load(sxt, L, true, xbc, cd, h * p, P, b, seq, t0);
    ssd_tc_load(sdyt, L, true, dy, hh * p, h * p, P, b, seq, t0);
    ssd_tc_load(sBt, L, true, xbc, cd, hh * p + gi * n, N, b, seq, t0);
    ssd_tc_load(sC, ldn, false, xbc, cd, hh * p + g * n + gi * n, N, b, seq, t0);
    __syncthreads();
    float part = 0.f;
    for (int e = threadIdx.x; e < Q * P; e += blockDim.x) part += sxt[(e / Q) * L + e % Q] * sdyt[(e / Q) * L + e % Q];
    float d_d = block_sum(part);
    float clast = scum[Q - 1], e0 = ssd_dot(gs, s0, n * p) * expf(clast);

    // M, P, Pᵀ and Z from C Bᵀ and dy xᵀ (ssd_chunk_bwd's).
    for (int w = warp; w < (Q / 32) * (Q / 16); w += nw) {
        int wr0 = (w / (Q / 16)) * 32, wc0 = (w % (Q / 16)) * 16;
        float cb[2][2][4], dx[2][2][4];
        ssd_tc_zero(cb);
        ssd_tc_zero(dx);
        if (wc0 <= wr0 + 31) {
            ssd_mma_tile(cb, sC, ldn, 1, sBt, L, 1, 0, N, wr0, wc0);
            ssd_mma_tile(dx, sdyt, 1, L, sxt, L, 1, 0, P, wr0, wc0);
        }
        for (int mi = 0; mi < 2; mi++)
            for (int ni = 0; ni < 2; ni++)
                for (int e = 0; e < 4; e++) {
                    int i = ssd_tc_row(wr0, mi, e), j = ssd_tc_col(wc0, ni, e), o = i * L + j;
                    float dec = j <= i ? expf(scum[i] - scum[j]) : 0.f, cv = cb[mi][ni][e], xv = dx[mi][ni][e];
                    sM[o] = dec * sdt[j] * cv;
                    sP[o] = dec * sdt[j] * xv;
                    sPt[j * L + i] = dec * sdt[j] * xv;
                    sZ[o] = dec * cv * xv;
                }
    }
    __syncthreads();
    ssd_rz_sums(sZ, L, sdt, rowR, colZ);
    // dxᵀ = dyᵀ M + (B G)ᵀ diag(w) + D·dyᵀ
    for (int w = warp; w < (P / 32) * (Q / 16); w += nw) {
        int wr0 = (w / (Q / 16)) * 32, wc0 = (w % (Q / 16)) * 16;
        float acc[2][2][4], bg[2][2][4];
        ssd_tc_zero(acc);
        ssd_tc_zero(bg);
        ssd_mma_tile(acc, sdyt, L, 1, sM, L, 1, wc0, Q, wr0, wc0);
        ssd_mma_tile(bg, gs, 1, P, sBt, L, 1, 0, N, wr0, wc0);
        for (int mi = 0; mi < 2; mi++)
            for (int ni = 0; ni < 2; ni++)
                for (int e = 0; e < 4; e++) {
                    int q = ssd_tc_row(wr0, mi, e), i = ssd_tc_col(wc0, ni, e);
                    long t = t0 + i;
                    if (t >= seq) continue;
                    float wi = expf(clast - scum[i]) * sdt[i];
                    st(dxbc, (b * seq + t) * cd + h * p + q, acc[mi][ni][e] + wi * bg[mi][ni][e] + dh * sdyt[q * L + i]);
                }
    }
    // dBᵀ = Cᵀ P + Uᵀ diag(w), Uᵀ = G xᵀ; red: each column's Σ over the tile's rows of Bᵀ ∘ Uᵀ.
    for (int w = warp; w < (N / 32) * (Q / 16); w += nw) {
        int wr0 = (w / (Q / 16)) * 32, wc0 = (w % (Q / 16)) * 16;
        float acc[2][2][4], uu[2][2][4], bu[2][2][4];
        ssd_tc_zero(acc);
        ssd_tc_zero(uu);
        ssd_mma_tile(acc, sC, 1, ldn, sP, L, 1, wc0, Q, wr0, wc0);
        ssd_mma_tile(uu, gs, P, 1, sxt, L, 1, 0, P, wr0, wc0);
        for (int mi = 0; mi < 2; mi++)
            for (int ni = 0; ni < 2; ni++)
                for (int e = 0; e < 4; e++) {
                    int nn = ssd_tc_row(wr0, mi, e), j = ssd_tc_col(wc0, ni, e);
                    bu[mi][ni][e] = sBt[nn * L + j] * uu[mi][ni][e];
                    long t = t0 + j;
                    if (t < seq) dbh[((b * seq + t) * hh + h) * n + nn] = acc[mi][ni][e] + expf(clast - scum[j]) * sdt[j] * uu[mi][ni][e];
                }
        ssd_tc_colsum(bu, wc0, sred, nred, wr0 / 32);
    }
    __syncthreads();
    if (threadIdx.x < Q)  // E'_j: the S_end term's ∂/∂dt_j
        sE[threadIdx.x] = expf(clast - scum[threadIdx.x]) * ssd_red_row(sred, nred, threadIdx.x);
    __syncthreads();
    // dCᵀ = Bᵀ Pᵀ + Vᵀ diag(e^{cum}), Vᵀ = S0 dyᵀ; red: each column's Σ of Cᵀ ∘ Vᵀ.
    for (int w = warp; w < (N / 32) * (Q / 16); w += nw) {
        int wr0 = (w / (Q / 16)) * 32, wc0 = (w % (Q / 16)) * 16;
        float acc[2][2][4], vv[2][2][4], cv[2][2][4];
        ssd_tc_zero(acc);
        ssd_tc_zero(vv);
        ssd_mma_tile(acc, sBt, L, 1, sPt, L, 1, 0, wc0 + 16, wr0, wc0);
        ssd_mma_tile(vv, s0, P, 1, sdyt, L, 1, 0, P, wr0, wc0);
        for (int mi = 0; mi < 2; mi++)
            for (int ni = 0; ni < 2; ni++)
                for (int e = 0; e < 4; e++) {
                    int nn = ssd_tc_row(wr0, mi, e), i = ssd_tc_col(wc0, ni, e);
                    cv[mi][ni][e] = sC[i * ldn + nn] * vv[mi][ni][e];
                    long t = t0 + i;
                    if (t < seq) dch[((b * seq + t) * hh + h) * n + nn] = acc[mi][ni][e] + expf(scum[i]) * vv[mi][ni][e];
                }
        ssd_tc_colsum(cv, wc0, sred, nred, wr0 / 32);
    }
    __syncthreads();
    if (threadIdx.x < Q) sO[threadIdx.x] = expf(scum[threadIdx.x]) * ssd_red_row(sred, nred, threadIdx.x);
    __syncthreads();
    ssd_dt_walk(sdt, sraw, rowR, colZ, sO, sE, e0, a_h, d_d, b, h, hh, seq, t0, blk, ddt, prm);
}

extern "C" __global__ void ssd_chunk_state_tc_bf16(const bf16_t* xbc, const bf16_t* dy, const bf16_t* dt_raw, const float* dt_bias,
        const float* a_log, float* out, float* decay, long seq, long hh, long p, long g, long n, long mode) {
    ssd_chunk_state_tc(xbc, dy, dt_raw, dt_bias, a_log, out, decay, seq, hh, p, g, n, (int)mode);
}
extern "C" __global__ void ssd_chunk_out_tc_bf16(const bf16_t* xbc, const bf16_t* dt_raw, const float* dt_bias, const float* a_log,
        const float* dd, const float* states, bf16_t* y, long seq, long hh, long p, long g, long n) {
    ssd_chunk_out_tc(xbc, dt_raw, dt_bias, a_log, dd, states, y, seq, hh, p, g, n);
}
extern "C" __global__ void ssd_chunk_bwd_tc_bf16(const bf16_t* xbc, const bf16_t* dt_raw, const float* dt_bias, const float* a_log,
        const float* dd, const float* states, const float* gstates, const bf16_t* dy, bf16_t* dxbc, bf16_t* ddt, float* dbh,
        float* dch, float* prm, long seq, long hh, long p, long g, long n) {
    ssd_chunk_bwd_tc(xbc, dt_raw, dt_bias, a_log, dd, states, gstates, dy, dxbc, ddt, dbh, dch, prm, seq, hh, p, g, n);
}
