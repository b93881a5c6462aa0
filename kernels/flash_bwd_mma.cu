// Flash attention backward on tensor cores (bf16 in, fp32 accumulate): mma.sync m16n8k16 as in
// flash_mma.cu, FlashAttention-2's tiling, no atomics (same bits every run; the wgmma default
// below, flash_bwd_dkvq, is the exception). Three kernels:
//   flash_bwd_delta_bf16      delta = rowsum(dO ∘ O), d / 8 lanes (a power of two) per (token, head) row.
//   flash_bwd_dq_mma_bf16_D   4 warps × 16 query rows of one (batch, head), over key tiles:
//                             S = Q Kᵀ, P = exp(S·scale − lse), dP = dO Vᵀ, dS = P ∘ (dP − delta),
//                             dQ += dS K.
//   flash_bwd_dkv_mma_bf16_D  4 warps × 16 keys of one (batch, KV head), over the group's query
//                             heads and tiles: Sᵀ = K Qᵀ, Pᵀ, dPᵀ = V dOᵀ, dSᵀ, dV += Pᵀ dO,
//                             dK += dSᵀ Q (GQA without repeated K/V).
// Scores are recomputed in both (7 products where FlashAttention-2 does 5 and adds dQ with
// atomics). Computing the transposed scores in dkv puts keys in the M dimension, so Pᵀ and dSᵀ go
// from accumulator to A operand in registers (as P does in the forward). Operands read along the
// other axis of a [row][d] tile (K for dQ, Q and dO for dK/dV) come from ldmatrix.trans.
// Tiles live in shared memory as [row][d] rows padded by 8 elements (conflict-free ldmatrix
// reads). Scores in base 2 as in flash_mma.cu. Layouts as attention.cu; dq/dk/dv are bf16, each
// element written once.
// On sm_90 the same bodies run on wgmma (template flag WG, kernels `_wgNW_`): NW warpgroups of 64
// query rows (dQ) or 64 keys (dK/dV) per block share the streamed tiles, which are then stored in
// wgmma's 128-byte swizzled layout (wgmma.cuh); dK/dV's K and V rows are the A operand straight from shared memory,
// the operands read "transposed" above are MN-major B operands of wgmma. There the host runs, by
// default, `flash_bwd_dkvq_wgNW_bf16_D` instead of the two: the dK/dV body also adds dQ by bulk
// reductions (DQ below: 5 products), so only the deterministic mode pays for 7.

#define FB_ROWS 64  // query rows per tile
#define FB_KEYS 64  // keys per tile

// delta = rowsum(dO ∘ O) for rows of [B, T, Hq] (delta is [B, Hq, T]): eight elements per thread
// (16-byte loads, o and dout 16-byte aligned), `lanes` per row: d / 8 rounded up to a power of two
// (at most 32: head dims 64, 128, 192 take 8, 16, 32; lanes past d / 8 add nothing), so a row's
// lanes sit in one warp. With `zero` (the fused backward's fp32 dQ tiles, `zero_n` floats, 16-byte
// aligned) thread x also clears floats 8x to 8x + 7 of it, so the tiles need no memset launch of
// their own: the grid covers max(rows · lanes, zero_n / 8) threads.
extern "C" __global__ void flash_bwd_delta_bf16(const bf16_t* o, const bf16_t* dout, float* delta, long rows,
                                                long t, long hq, long d, long lanes, float* zero, long zero_n) {
    long x = (long)blockIdx.x * blockDim.x + threadIdx.x, w = x / lanes;
    if (zero && x * 8 < zero_n) {
        const float z[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        st8(zero, x * 8, z);
    }
    int c = x % lanes;
    float s = 0.f;
    if (w < rows && c * 8 < d) {
        float a[8], g[8];
        ld8(o, w * d + c * 8, a);
        ld8(dout, w * d + c * 8, g);
        #pragma unroll
        for (int j = 0; j < 8; j++) s += a[j] * g[j];
    }
    for (int m = lanes / 2; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
    if (w < rows && c == 0) {
        long h = w % hq, i = (w / hq) % t, b = w / (hq * t);
        delta[(b * hq + h) * t + i] = s;
    }
}

// DROP: attention dropout (`dr`; attention.cu `AttnDrop`): dS = P ∘ (dP̃ ∘ M / (1 − p) − delta).
// `docs`: document masks as in the forward (flash.cu `doc_key_range`), or null.
// QS (head dim 192): Q and dO stay in two shared-memory tiles of the block's rows after the K/V
// stages (2·ROWS·P·2 more bytes), read each step as A operands (ldmatrix fragments, or wgmma from
// shared memory): held in registers (96) beside dQ (96) and S, dP (64) they spilled.
template <int D, bool WG = false, int NW = 1, bool DROP = false>
__device__ void flash_bwd_dq_mma(const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* lse,
                                 const float* delta, const bf16_t* dout, bf16_t* dq, long t, long sl, long hq, long hkv,
                                 float scale, long causal, long window, long fused, const u32* docs,
                                 const AttnDrop& dr) {
    using Stages = KvStages<D, FB_KEYS, WG>;
    constexpr int KS = D / 16, NO = D / 8, P = Stages::TP, ROWS = FB_ROWS * NW;  // query rows per block
    constexpr bool QS = D > 128;
    // Two stages of (K tile, V tile): 4·FB_KEYS·P·2 bytes of dynamic shared memory (with QS the
    // Q and dO tiles after them).
    extern __shared__ __align__(1024) unsigned char fb_smem[];  // swizzled tiles: 1024-byte aligned
    bf16_t* stage = reinterpret_cast<bf16_t*>(fb_smem);
    long tiles = (t + ROWS - 1) / ROWS;
    // Within a head, the last query tiles (the most keys under a causal mask) start first.
    long qt = tiles - 1 - blockIdx.x % tiles, h = (blockIdx.x / tiles) % hq, b = blockIdx.x / (tiles * hq);
    long kvh = h / (hq / hkv);
    // Q (and dQ) where `fused` puts them; dO, O, lse and delta are always [B, T, hq, ·].
    const Place qp = q_place(h, hq, hkv, fused), kp = kv_place(kvh, hq, hkv, fused), op = {hq, h};
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    long r0 = qt * ROWS + warp * 16 + g, r1 = r0 + 8;  // this thread's two rows
    // A fragments of Q and dO for every k-step (registers for the whole kernel), or with QS their
    // tiles (waited for with the first K/V stage).
    u32 qa[QS ? 1 : KS][4], da[QS ? 1 : KS][4];
    bf16_t* qd = stage + 4 * FB_KEYS * P;
    if constexpr (QS && WG) {
        tile_async<D, ROWS, true>(qd, q, qt * ROWS, t, b, qp.heads, qp.head);
        tile_async<D, ROWS, true>(qd + ROWS * P, dout, qt * ROWS, t, b, op.heads, op.head);
        cp_commit();
    } else if constexpr (QS) {
        tile_in<D, ROWS>(qd, q, qt * ROWS, t, b, qp.heads, qp.head);
        tile_in<D, ROWS>(qd + ROWS * P, dout, qt * ROWS, t, b, op.heads, op.head);
    }
    auto frag = [&](const bf16_t* x, Place at, long row, int col) -> u32 {
        return row < t ? word(x + ((b * t + row) * at.heads + at.head) * D + col) : 0u;
    };
    #pragma unroll
    for (int kk = 0; kk < (QS ? 0 : KS); kk++) {
        int c = kk * 16 + tg * 2;
        qa[kk][0] = frag(q, qp, r0, c); qa[kk][1] = frag(q, qp, r1, c);
        qa[kk][2] = frag(q, qp, r0, c + 8); qa[kk][3] = frag(q, qp, r1, c + 8);
        da[kk][0] = frag(dout, op, r0, c); da[kk][1] = frag(dout, op, r1, c);
        da[kk][2] = frag(dout, op, r0, c + 8); da[kk][3] = frag(dout, op, r1, c + 8);
    }
    float lr[2], dl[2];
    #pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        long i = rr ? r1 : r0;
        lr[rr] = i < t ? lse[(b * hq + h) * t + i] * LOG2E : 0.f;
        dl[rr] = i < t ? delta[(b * hq + h) * t + i] : 0.f;
    }
    float acc[NO][4];
    #pragma unroll
    for (int n = 0; n < NO; n++) for (int e = 0; e < 4; e++) acc[n][e] = 0.f;
    const float scale2 = scale * LOG2E;
    long i0 = qt * ROWS, i1 = lmin(t, i0 + ROWS) - 1, jb, je;
    key_range(i0, i1, sl, causal, window, FB_KEYS, &jb, &je);
    doc_key_range(docs, b, t, i0, FB_KEYS, &jb);
    const Stages kv(stage, k, v, jb, je, sl, b, kp.heads, kp.head);
    if (kv.steps > 0) kv.fetch(0);
    for (long it = 0; it < kv.steps; it++) {
        long j0 = jb + it * FB_KEYS;
        const bf16_t* ks = kv.wait(it);
        const bf16_t* vs = ks + FB_KEYS * P;
        // S = Q Kᵀ and dP = dO Vᵀ: 16 rows × 64 keys each, 8 blocks of 8 keys.
        float s[8][4], dp[8][4];
        #pragma unroll
        for (int nb = 0; nb < 8; nb++) for (int e = 0; e < 4; e++) { s[nb][e] = 0.f; dp[nb][e] = 0.f; }
        if constexpr (WG && QS) {
            // A = this warpgroup's 64 rows of the Q and dO tiles, B = the K and V tiles (K-major).
            const u32 qb = smem_addr(qd) + (warp >> 2) * 64 * 128, ob = qb + ROWS * P * 2;
            const u32 kb = smem_addr(ks), vb = smem_addr(vs);
            wg_pin<32>(&dp[0][0]);
            wg_start<32>(&s[0][0]);
            #pragma unroll
            for (int kk = 0; kk < KS; kk++) {
                wgmma_m64n64k16_ss(&s[0][0], sw_kmajor(qb, ROWS, kk), sw_kmajor(kb, FB_KEYS, kk));
                wgmma_m64n64k16_ss(&dp[0][0], sw_kmajor(ob, ROWS, kk), sw_kmajor(vb, FB_KEYS, kk));
            }
            wg_finish<32>(&s[0][0]);
            wg_pin<32>(&dp[0][0]);
        } else if constexpr (WG) {
            wg_pin<32>(&dp[0][0]);
            wg_start<32>(&s[0][0]);
            wg_qk<D>(s, qa, ks);
            wg_qk<D>(dp, da, vs);
            wg_finish<32>(&s[0][0]);
            wg_pin<32>(&dp[0][0]);
        } else if constexpr (QS) {
            mma_cols_smem<D>(s, qd + warp * 16 * P, ks);
            mma_cols_smem<D>(dp, qd + (ROWS + warp * 16) * P, vs);
        } else {
            mma_cols<D>(s, qa, ks);
            mma_cols<D>(dp, da, vs);
        }
        // dS = P ∘ (dP − delta) in place of S; a tile inside the sequence below the diagonal
        // needs no mask.
        bool full = tile_full(i0, ROWS, j0, FB_KEYS, t, sl, causal, window);
        if (!full) {
            #pragma unroll
            for (int nb = 0; nb < 8; nb++)
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    long i = e < 2 ? r0 : r1, j = j0 + nb * 8 + tg * 2 + (e & 1);
                    if (!(i < t && j < sl && allowed(i, j, causal, window))) s[nb][e] = -INFINITY;  // p = 0
                }
        }
        if (doc_cuts(docs, b, t, i1, j0)) {
            const long r[1][2] = {{r0, r1}};
            doc_mask<1, 8>(reinterpret_cast<float (*)[8][4]>(s), r, docs, b, t, j0);
        }
        if constexpr (DROP)
            drop_frag<false, 8>(dr, drop_tile(dr, b, h, r0 >> 4, j0 >> 4, t, sl), 32, g, tg,
                                [&](int nb, int e, float mul) { dp[nb][e] *= mul; });
        #pragma unroll
        for (int nb = 0; nb < 8; nb++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = ex2(fmaf(s[nb][e], scale2, -lr[e >> 1]));
                s[nb][e] = p * (dp[nb][e] - dl[e >> 1]);
            }
        }
        // dQ += dS K: k-steps of 16 keys.
        if constexpr (WG) {
            u32 a[FB_KEYS / 16][4];
            #pragma unroll
            for (int kstep = 0; kstep < FB_KEYS / 16; kstep++) c_to_a(a[kstep], s, kstep);
            wg_start<D / 2>(&acc[0][0]);
            wg_pv<D, FB_KEYS>(acc, a, ks);
            wg_finish<D / 2>(&acc[0][0]);
            wg_keep<FB_KEYS / 4>(&a[0][0]);
        } else {
            #pragma unroll
            for (int kstep = 0; kstep < FB_KEYS / 16; kstep++) {
                u32 a[4];
                c_to_a(a, s, kstep);
                mma_rows_t<D>(acc, a, ks + kstep * 16 * P);
            }
        }
    }
    #pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        long i = rr ? r1 : r0;
        if (i >= t) continue;
        bf16_t* di = dq + ((b * t + i) * qp.heads + qp.head) * D;
        #pragma unroll
        for (int n = 0; n < NO; n++)
            *reinterpret_cast<u32*>(di + n * 8 + tg * 2) = pack_bf16(acc[n][2 * rr] * scale, acc[n][2 * rr + 1] * scale);
    }
}

// The dK/dV kernels' per-step pieces, shared by flash_bwd_dkv_mma and the warp-specialised
// flash_bwd_dkvq_ws (same fragments: this thread's keys jr0 and jr0 + 8, rows 8·nb + 2·tg + (e & 1)
// of the 64-row query tile).
// Sᵀ = K Qᵀ and dPᵀ = V dOᵀ by wgmma for one warpgroup's 64 keys: its K and V rows at kb, vb in
// swizzled tiles of `keys` rows, the Q and dO tiles at qb, ob; waited for. The first k-step
// overwrites st and dpt (no zeroing before: 64 moves a step).
// DP = false: Sᵀ alone (dpt left as it was).
template <int D, bool DP = true>
__device__ __forceinline__ void wg_scores_t(float (*st)[4], float (*dpt)[4], u32 kb, u32 vb, u32 qb, u32 ob,
                                            int keys) {
    wg_pin<32>(&dpt[0][0]);
    wg_start<32>(&st[0][0]);
    wgmma_m64n64k16_ss<0, 0, 0>(&st[0][0], sw_kmajor(kb, keys, 0), sw_kmajor(qb, FB_ROWS, 0));
    if constexpr (DP) wgmma_m64n64k16_ss<0, 0, 0>(&dpt[0][0], sw_kmajor(vb, keys, 0), sw_kmajor(ob, FB_ROWS, 0));
    #pragma unroll
    for (int kk = 1; kk < D / 16; kk++) {
        wgmma_m64n64k16_ss(&st[0][0], sw_kmajor(kb, keys, kk), sw_kmajor(qb, FB_ROWS, kk));
        if constexpr (DP) wgmma_m64n64k16_ss(&dpt[0][0], sw_kmajor(vb, keys, kk), sw_kmajor(ob, FB_ROWS, kk));
    }
    wg_finish<32>(&st[0][0]);
    wg_pin<32>(&dpt[0][0]);
}
// Sᵀ to −∞ (p = 0) where row i0 + 8·nb + 2·tg + (e & 1) may not see key jr0 (e < 2) or jr1.
// As the forward's `softmax_tile`: per key, the query rows that see it as a column range [lo, hi]
// of the tile (i < t; causal: i ≥ j; window w: |i − j| < w; none for a key ≥ sl), worked out once
// in 64 bits and clamped, so a score costs two 32-bit compares against its constant column (less
// 2·tg) and a select instead of `allowed` in 64-bit arithmetic. RANGE = false keeps `allowed` per
// score (the head dim 128 kernels: the ranges' registers made them spill more).
template <bool RANGE>
__device__ __forceinline__ void mask_t(float (*st)[4], long i0, long jr0, long jr1, int tg, long t, long sl,
                                       long causal, long window) {
    if constexpr (!RANGE) {
        #pragma unroll
        for (int nb = 0; nb < 8; nb++)
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                long j = e < 2 ? jr0 : jr1, i = i0 + nb * 8 + tg * 2 + (e & 1);
                if (!(i < t && j < sl && allowed(i, j, causal, window))) st[nb][e] = -INFINITY;
            }
        return;
    }
    #pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const long j = rr ? jr1 : jr0, dj = j - i0;
        long lo = causal ? dj : 0, hi = t - i0 - 1;
        if (window > 0) { lo = lmax(lo, dj - window + 1); hi = lmin(hi, dj + window - 1); }
        if (j >= sl) hi = -1;
        const int h32 = (int)lmax(-1, lmin(hi, 64)) - tg * 2;
        const int l32 = (int)lmax(0, lmin(lo, 65)) - tg * 2;
        #pragma unroll
        for (int nb = 0; nb < 8; nb++)
            #pragma unroll
            for (int e = rr * 2; e < rr * 2 + 2; e++) {
                const int c = nb * 8 + (e & 1);
                if (c > h32 || c < l32) st[nb][e] = -INFINITY;
            }
    }
}
// Document masks (flash.cu `doc_cuts`) on Sᵀ: −∞ where row i0 + 8·nb + 2·tg + (e & 1)'s document
// starts after key jr0 (e < 2) or jr1. Only on steps a document start crosses; the rows' starts are
// read here (L1).
__device__ __forceinline__ void doc_mask_t(float (*st)[4], const u32* docs, long b, long t, long i0, long jr0, long jr1,
                                           int tg) {
    #pragma unroll
    for (int nb = 0; nb < 8; nb++)
        #pragma unroll
        for (int c = 0; c < 2; c++) {
            const long i = i0 + nb * 8 + tg * 2 + c;
            if (i >= t) continue;
            const long s = docs[b * t + i];
            if (s > jr0) st[nb][c] = -INFINITY;
            if (s > jr1) st[nb][2 + c] = -INFINITY;
        }
}
// Pᵀ = exp2(Sᵀ·scale2 − lse·log2 e) into st and dSᵀ = Pᵀ ∘ (dPᵀ − delta) into dpt, from the rows'
// lse (`ls`: RAW as stored, else already times LOG2E) and delta (`dls`).
template <bool RAW>
__device__ __forceinline__ void p_ds_t(float (*st)[4], float (*dpt)[4], const float* ls, const float* dls, float scale2,
                                       int tg) {
    #pragma unroll
    for (int nb = 0; nb < 8; nb++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            int col = nb * 8 + tg * 2 + (e & 1);
            float p = ex2(fmaf(st[nb][e], scale2, RAW ? -(ls[col] * LOG2E) : -ls[col]));
            st[nb][e] = p;
            dpt[nb][e] = p * (dpt[nb][e] - dls[col]);
        }
    }
}
// Attention dropout on a dK/dV step (rows = keys; attention.cu `drop_frag`, TR): dPᵀ times the
// mask's multipliers of this thread's scores, whose first 16 × 16 tile is `tile` (drop_tile);
// returns the keep bits (bit nb · 4 + e) that carry the mask on to P̃ᵀ (`drop_keep`).
__device__ __forceinline__ u32 drop_dpt(const AttnDrop& dr, float (*dpt)[4], unsigned long long tile, long sl, int g,
                                        int tg) {
    u32 keep = 0;
    drop_frag<true, 8>(dr, tile, drop_key_tiles(dr, sl) * 32, g, tg, [&](int nb, int e, float mul) {
        dpt[nb][e] *= mul;
        keep |= (mul != 0.f ? 1u : 0u) << (nb * 4 + e);
    });
    return keep;
}
// P̃ᵀ = Pᵀ ∘ M / (1 − p) in st, M from `drop_dpt`'s keep bits.
__device__ __forceinline__ void drop_keep(float (*st)[4], u32 keep, float scale) {
    #pragma unroll
    for (int nb = 0; nb < 8; nb++)
        #pragma unroll
        for (int e = 0; e < 4; e++) st[nb][e] = (keep >> (nb * 4 + e)) & 1u ? st[nb][e] * scale : 0.f;
}
// dSᵀ (key jl, row il) to shared memory at byte ((jl/8)·8 + il/8)·128 + (jl%8)·16 + (il%8)·2: an
// MN-major A operand (rows contiguous); the words of a warp fill whole core matrices (no bank
// conflicts). `w`: the warp's 16 keys from key 16·w of `dss`.
__device__ __forceinline__ void store_dst(unsigned char* dss, const float (*dpt)[4], int w, int g, int tg) {
    #pragma unroll
    for (int nb = 0; nb < 8; nb++)
        #pragma unroll
        for (int rr = 0; rr < 2; rr++)
            *reinterpret_cast<u32*>(dss + ((w * 2 + rr) * 8 + nb) * 128 + g * 16 + tg * 4) =
                pack_bf16(dpt[nb][2 * rr], dpt[nb][2 * rr + 1]);
}
// A warpgroup's 64 × 64 dQ piece (not yet times the softmax scale: flash_dq_tiles_bf16 applies
// it once, saving 32 multiplies a step) to `buf` in fragment order: this thread's 32 values at
// ((w4·8 + nb)·32 + lane)·4 + e, 16-byte stores, consecutive lanes side by side (no bank
// conflicts).
__device__ __forceinline__ void stage_dq(float* buf, const float (*dqc)[4], int w4, int lane) {
    #pragma unroll
    for (int nb = 0; nb < 8; nb++)
        *reinterpret_cast<float4*>(buf + ((w4 * 8 + nb) * 32 + lane) * 4) =
            make_float4(dqc[nb][0], dqc[nb][1], dqc[nb][2], dqc[nb][3]);
}

// Dynamic shared memory of the dkv kernel (the host sizes it): the K and V tiles, two stages of
// (Q, dO) tiles, two stages of the rows' (lse, delta): (2·KEYS + 4·FB_ROWS)·P·2 +
// 4·FB_ROWS·4 bytes; with DQ also dSᵀ (KEYS·FB_ROWS·2) and 2·NW staging buffers of 4096 floats.

// dQ as well (DQ, wgmma only): dS (bf16, this step's 64 rows × the block's keys) goes through
// shared memory, each warpgroup multiplies it by its D / NW = 64 columns of the K tile, writes
// that 64 × 64 fp32 piece of dQ / scale to shared memory in fragment order and adds it to the fp32
// `dqa` (zeroed by the host) with one bulk reduction (cp.reduce.async.bulk .add.f32, 16 KB):
// five products per tile instead of seven, no dQ kernel, but the sums' order depends on
// scheduling. dqa holds those pieces whole, per (batch, head, 64-row tile, 64-column block);
// flash_dq_tiles_bf16 scales them into dQ. (Vector atomics straight into [B, T, Hq, D] measured
// 0–14% slower.)
// DROP: attention dropout (`dr`; attention.cu `AttnDrop`): dSᵀ from dPᵀ ∘ M / (1 − p), dV from
// P̃ᵀ; the step's 32 keep bits of this thread's scores carry the mask from one to the other.
// ROLE (64 keys a block, no fused dQ; mma.sync or wgmma): 0 computes dK and dV; 1 dV alone, 2 dK
// alone; 3 is both in one block of 256 threads, warps 0–3 role 1 and warps 4–7 role 2 for the
// same 64 keys (head dim 192: the two accumulators (192 registers) beside Sᵀ and dPᵀ spilled;
// split, role 1 skips dPᵀ and the block computes Sᵀ twice).
// `docs`: document masks (flash.cu `doc_row_range`, `doc_cuts`), or null; not with DQ.
template <int D, bool WG = false, int NW = 1, bool DQ = false, bool DROP = false, int ROLE = 0>
__device__ void flash_bwd_dkv_mma(const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* lse,
                                  const float* delta, const bf16_t* dout, bf16_t* dk, bf16_t* dv, float* dqa, long t,
                                  long sl, long hq, long hkv, float scale, long causal, long window, long fused,
                                  const u32* docs, const AttnDrop& dr) {
    constexpr int NO = D / 8, P = WG ? D : D + 8;  // tile row (padded for ldmatrix; swizzled for wgmma)
    constexpr int KEYS = FB_KEYS * NW;              // keys per block
    static_assert(!DQ || (WG && D / NW == 64), "fused dQ: wgmma, 64 dQ columns per warpgroup");
    static_assert(ROLE == 0 || (!DQ && NW == 1), "roles: 64 keys a block, no fused dQ");
    if constexpr (ROLE == 3) {  // both roles, 256 threads
        if (threadIdx.x < 128)
            flash_bwd_dkv_mma<D, WG, 1, false, DROP, 1>(q, k, v, lse, delta, dout, dk, dv, dqa, t, sl, hq, hkv, scale,
                                                        causal, window, fused, docs, dr);
        else
            flash_bwd_dkv_mma<D, WG, 1, false, DROP, 2>(q, k, v, lse, delta, dout, dk, dv, dqa, t, sl, hq, hkv, scale,
                                                        causal, window, fused, docs, dr);
        return;
    }
    constexpr bool DKA = ROLE != 1, DVA = ROLE != 2;  // which accumulators this thread holds
    extern __shared__ __align__(1024) unsigned char fb_smem[];  // swizzled tiles: 1024-byte aligned
    bf16_t* ks = reinterpret_cast<bf16_t*>(fb_smem);
    bf16_t* vs = ks + KEYS * P;
    bf16_t* qstage = vs + KEYS * P;                                           // 2 × (Q, dO) tiles
    float* lstage = reinterpret_cast<float*>(qstage + 4 * FB_ROWS * P);      // 2 × (lse, delta) rows
    // DQ: dSᵀ of this step, KEYS × FB_ROWS bf16 in core-matrix order (rows = keys), then two
    // staging buffers per warpgroup of its 64 × 64 fp32 dQ piece (alternate steps).
    unsigned char* dss = reinterpret_cast<unsigned char*>(lstage + 4 * FB_ROWS);
    float* dqs = reinterpret_cast<float*>(dss + KEYS * FB_ROWS * 2) + (threadIdx.x >> 7) * 2 * 4096;
    long tiles = (sl + KEYS - 1) / KEYS;
    long kt = blockIdx.x % tiles, kvh = (blockIdx.x / tiles) % hkv, b = blockIdx.x / (tiles * hkv);
    const Place kp = kv_place(kvh, hq, hkv, fused);  // K, V, dK, dV (dO stays [B, T, hq, D])
    int warp = ROLE ? (threadIdx.x >> 5) & 3 : threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    long j0 = kt * KEYS, jr0 = j0 + warp * 16 + g, jr1 = jr0 + 8;  // this thread's two keys
    if constexpr (WG) {
        // Waited for with the first (Q, dO) stage.
        tile_async<D, KEYS, true>(ks, k, j0, sl, b, kp.heads, kp.head);
        tile_async<D, KEYS, true>(vs, v, j0, sl, b, kp.heads, kp.head);
        cp_commit();
    } else {
        tile_in<D, KEYS>(ks, k, j0, sl, b, kp.heads, kp.head);
        tile_in<D, KEYS>(vs, v, j0, sl, b, kp.heads, kp.head);
    }
    float dka[DKA ? NO : 1][4], dva[DVA ? NO : 1][4];
    #pragma unroll
    for (int n = 0; n < NO; n++) for (int e = 0; e < 4; e++) {
        if constexpr (DKA) dka[n][e] = 0.f;
        if constexpr (DVA) dva[n][e] = 0.f;
    }
    // Query rows that can see keys [j0, j1].
    long j1 = lmin(sl, j0 + KEYS) - 1, ib, ie;
    row_range(j0, j1, t, causal, window, FB_ROWS, &ib, &ie);
    doc_row_range(docs, b, t, j1, &ie);
    long group = hq / hkv, qgs = fused ? group + 2 : group;  // heads per query group's run (Place)
    const float scale2 = scale * LOG2E;
    // Steps over (query head of the group, query tile), the next one's tiles loading meanwhile.
    long qtiles = ie > ib ? (ie - ib + FB_ROWS - 1) / FB_ROWS : 0, steps = group * qtiles;
    auto fetch = [&](long n) {
        long h = kvh * group + n / qtiles, i0 = ib + (n % qtiles) * FB_ROWS;
        bf16_t* qt = qstage + (n & 1) * 2 * FB_ROWS * P;
        // q_place(h) without its divisions: the group's query heads sit qgs apart per group.
        tile_async<D, FB_ROWS, WG>(qt, q, i0, t, b, hkv * qgs, kvh * qgs + n / qtiles);
        tile_async<D, FB_ROWS, WG>(qt + FB_ROWS * P, dout, i0, t, b, hq, h);
        cp_commit();
        float* lt = lstage + (n & 1) * 2 * FB_ROWS;
        if (threadIdx.x < FB_ROWS) {
            long i = i0 + threadIdx.x;
            lt[threadIdx.x] = i < t ? lse[(b * hq + h) * t + i] * LOG2E : 0.f;
            lt[FB_ROWS + threadIdx.x] = i < t ? delta[(b * hq + h) * t + i] : 0.f;
        }
    };
    if (steps > 0) fetch(0);
    for (long n = 0; n < steps; n++) {
        {
            long i0 = ib + (n % qtiles) * FB_ROWS;
            // One barrier per step (as KvStages): step n's tiles have landed and every warp is done
            // with step n − 1, whose stage the next copy refills.
            cp_wait<0>();
            if constexpr (WG) fence_async_smem();
            // The roles run this loop from two copies of the code: a barrier that need not be
            // the same instruction in every warp.
            if constexpr (ROLE) barrier_any(); else __syncthreads();
            if (n + 1 < steps) fetch(n + 1);
            const bf16_t* qs = qstage + (n & 1) * 2 * FB_ROWS * P;
            const bf16_t* dos = qs + FB_ROWS * P;
            const float* ls = lstage + (n & 1) * 2 * FB_ROWS;
            const float* dls = ls + FB_ROWS;
            // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: 16 keys × 64 rows each, 8 blocks of 8 rows.
            float st[8][4], dpt[8][4];
            #pragma unroll
            for (int nb = 0; nb < 8; nb++) for (int e = 0; e < 4; e++) { st[nb][e] = 0.f; dpt[nb][e] = 0.f; }
            if constexpr (WG) {
                // The warpgroup's 64 keys are its M: K and V rows straight from shared memory.
                int wg = warp >> 2;
                // (Rows 64·wg.. of the KEYS-row K and V tiles: 128 bytes a row in each column block.)
                u32 kb = smem_addr(ks) + wg * 64 * 128, vb = smem_addr(vs) + wg * 64 * 128;
                wg_scores_t<D, DKA>(st, dpt, kb, vb, smem_addr(qs), smem_addr(dos), KEYS);
            } else {
                mma_cols_smem<D>(st, ks + warp * 16 * P, qs);
                if constexpr (DKA) mma_cols_smem<D>(dpt, vs + warp * 16 * P, dos);
            }
            // Pᵀ into st, dSᵀ into dpt (no mask for a tile inside the sequence below the diagonal).
            if (!tile_full(i0, FB_ROWS, j0, KEYS, t, sl, causal, window))
                mask_t<D == 64>(st, i0, jr0, jr1, tg, t, sl, causal, window);
            if (doc_cuts(docs, b, t, lmin(t, i0 + FB_ROWS) - 1, j0)) doc_mask_t(st, docs, b, t, i0, jr0, jr1, tg);
            u32 keep = 0;
            if constexpr (DROP)
                keep = drop_dpt(dr, dpt, drop_tile(dr, b, kvh * group + n / qtiles, i0 >> 4, jr0 >> 4, t, sl), sl, g, tg);
            p_ds_t<false>(st, dpt, ls, dls, scale2, tg);
            if constexpr (DROP) drop_keep(st, keep, dr.scale);
            // dV += Pᵀ dO and dK += dSᵀ Q: k-steps of 16 rows.
            if constexpr (WG) {
                // A role packs only the operand its accumulator takes (the other is dead work).
                u32 pa[DVA ? FB_ROWS / 16 : 1][4], sa[DKA ? FB_ROWS / 16 : 1][4];
                #pragma unroll
                for (int kstep = 0; kstep < FB_ROWS / 16; kstep++) {
                    if constexpr (DVA) c_to_a(pa[kstep], st, kstep);
                    if constexpr (DKA) c_to_a(sa[kstep], dpt, kstep);
                }
                float dqc[8][4];  // DQ: this warpgroup's 64 columns of the step's dQ rows
                if constexpr (DQ) {
                    store_dst(dss, dpt, warp, g, tg);  // an MN-major A operand (store_dst)
                    #pragma unroll
                    for (int nb = 0; nb < 8; nb++) for (int e = 0; e < 4; e++) dqc[nb][e] = 0.f;
                    fence_async_smem();
                    __syncthreads();
                }
                if constexpr (DKA && DVA) {
                    wg_pin<D / 2>(&dka[0][0]);
                    if constexpr (DQ) wg_pin<32>(&dqc[0][0]);
                    wg_start<D / 2>(&dva[0][0]);
                    wg_pv<D, FB_ROWS>(dva, pa, dos);
                    wg_pv<D, FB_ROWS>(dka, sa, qs);
                } else if constexpr (DVA) {
                    wg_start<D / 2>(&dva[0][0]);
                    wg_pv<D, FB_ROWS>(dva, pa, dos);
                } else {
                    wg_start<D / 2>(&dka[0][0]);
                    wg_pv<D, FB_ROWS>(dka, sa, qs);
                }
                if constexpr (DQ) {
                    // dQ[:, 64w .. 64w + 64) += dS (A: dSᵀ MN-major) · K (B: the K tile's column
                    // block w, MN-major), k-steps of 16 keys over the block's keys.
                    u32 ab = smem_addr(dss), kb = smem_addr(ks) + (warp >> 2) * KEYS * 128;
                    #pragma unroll
                    for (int kk = 0; kk < KEYS / 16; kk++)
                        wgmma_m64n64k16_ss<1, 1>(&dqc[0][0], wg_step(wg_desc(ab, 16 * FB_ROWS, 128), kk * 32 * FB_ROWS),
                                                 sw_mnmajor(kb, KEYS, kk));
                }
                if constexpr (DVA) wg_finish<D / 2>(&dva[0][0]); else wg_finish<D / 2>(&dka[0][0]);
                if constexpr (DKA && DVA) wg_pin<D / 2>(&dka[0][0]);
                if constexpr (DVA) wg_keep<FB_ROWS / 4>(&pa[0][0]);
                if constexpr (DKA) wg_keep<FB_ROWS / 4>(&sa[0][0]);
                if constexpr (DQ) {
                    wg_pin<32>(&dqc[0][0]);
                    float* buf = dqs + (n & 1) * 4096;
                    stage_dq(buf, dqc, warp & 3, lane);
                    fence_async_smem();
                    named_sync(1 + (warp >> 2), 128);
                    if ((threadIdx.x & 127) == 0) {
                        long h = kvh * group + n / qtiles, tp = (t + 63) / 64;
                        float* dst = dqa + (((b * hq + h) * tp + i0 / 64) * (D / 64) + (warp >> 2)) * 4096;
                        bulk_reduce_add(dst, buf, 4096 * 4);
                        // The buffer of step n − 1 is read before step n + 1 refills it (the
                        // step's block barrier follows).
                        bulk_wait_read<1>();
                    }
                }
            } else {
                #pragma unroll
                for (int kstep = 0; kstep < FB_ROWS / 16; kstep++) {
                    u32 a[4];
                    if constexpr (DVA) {
                        c_to_a(a, st, kstep);
                        mma_rows_t<D>(dva, a, dos + kstep * 16 * P);
                    }
                    if constexpr (DKA) {
                        c_to_a(a, dpt, kstep);
                        mma_rows_t<D>(dka, a, qs + kstep * 16 * P);
                    }
                }
            }
        }
    }
    if constexpr (WG) cp_wait<0>();  // no (Q, dO) step: the K/V copies still land before exit
    if constexpr (DQ) {
        if ((threadIdx.x & 127) == 0) bulk_wait<0>();
    }
    #pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        long j = rr ? jr1 : jr0;
        if (j >= sl) continue;
        long off = ((b * sl + j) * kp.heads + kp.head) * D;
        #pragma unroll
        for (int n = 0; n < NO; n++) {
            if constexpr (DKA)
                *reinterpret_cast<u32*>(dk + off + n * 8 + tg * 2) = pack_bf16(dka[n][2 * rr] * scale, dka[n][2 * rr + 1] * scale);
            if constexpr (DVA) *reinterpret_cast<u32*>(dv + off + n * 8 + tg * 2) = pack_bf16(dva[n][2 * rr], dva[n][2 * rr + 1]);
        }
    }
}

// flash_bwd_{dq,dkv}_mma_bf16_D (mma.sync, 4 warps) and flash_bwd_{dq,dkv}_wgNW_bf16_D (wgmma,
// sm_90a; NW warpgroups, each 64 query rows (dq) or keys (dkv), sharing the streamed tiles). The
// one-warpgroup dK/dV kernel is held to 168 registers: three blocks per SM (175 would allow two).
// `docs` (document masks, or null) after `fused`: these split builds, the head dim 192 ones and the
// mma.sync dropout ones below take the masked calls the warp-specialised `_docs` build does not
// (dropout, deterministic mode, head dim 192, the warp-specialised kernels off).
#define FLASH_BWD_MMA(D, SFX, WG, NW) \
extern "C" __global__ void __launch_bounds__(128 * NW) flash_bwd_dq_##SFX##_bf16_##D(const bf16_t* q, const bf16_t* k, \
        const bf16_t* v, const float* lse, const float* delta, const bf16_t* dout, bf16_t* dq, long t, long sl, long hq, \
        long hkv, long d, float scale, long causal, long window, long fused, const u32* docs) { \
    flash_bwd_dq_mma<D, WG, NW>(q, k, v, lse, delta, dout, dq, t, sl, hq, hkv, scale, causal, window, fused, docs, \
                                AttnDrop{}); } \
extern "C" __global__ void __launch_bounds__(128 * NW, WG ? 3 / NW : 1) flash_bwd_dkv_##SFX##_bf16_##D(const bf16_t* q, const bf16_t* k, \
        const bf16_t* v, const float* lse, const float* delta, const bf16_t* dout, bf16_t* dk, bf16_t* dv, long t, \
        long sl, long hq, long hkv, long d, float scale, long causal, long window, long fused, const u32* docs) { \
    flash_bwd_dkv_mma<D, WG, NW>(q, k, v, lse, delta, dout, dk, dv, nullptr, t, sl, hq, hkv, scale, causal, window, \
                                 fused, docs, AttnDrop{}); }
FLASH_BWD_MMA(64, mma, false, 1)
FLASH_BWD_MMA(128, mma, false, 1)
// Measured on the H200 (lab notes in README.md): D 64 NW 1 (NW 2: 4–13% slower), D 128 NW 2
// (8–26% faster than 1).
FLASH_BWD_MMA(64, wg1, true, 1)
FLASH_BWD_MMA(128, wg2, true, 2)
// Head dim 192 (multi-latent attention): dQ with Q and dO in shared memory (QS; NWQ blocks of 64
// rows), dK/dV in two roles of 128 threads over 64 keys (ROLE 3), on mma.sync and on wgmma (no
// fused dQ: its pieces are 64 columns a warpgroup).
#define FLASH_BWD_WIDE(SFX, WG, NWQ) \
extern "C" __global__ void __launch_bounds__(128 * NWQ) flash_bwd_dq_##SFX##_bf16_192(const bf16_t* q, const bf16_t* k, \
        const bf16_t* v, const float* lse, const float* delta, const bf16_t* dout, bf16_t* dq, long t, long sl, long hq, \
        long hkv, long d, float scale, long causal, long window, long fused, const u32* docs) { \
    flash_bwd_dq_mma<192, WG, NWQ>(q, k, v, lse, delta, dout, dq, t, sl, hq, hkv, scale, causal, window, fused, \
                                   docs, AttnDrop{}); } \
extern "C" __global__ void __launch_bounds__(256) flash_bwd_dkv_##SFX##_bf16_192(const bf16_t* q, const bf16_t* k, \
        const bf16_t* v, const float* lse, const float* delta, const bf16_t* dout, bf16_t* dk, bf16_t* dv, long t, \
        long sl, long hq, long hkv, long d, float scale, long causal, long window, long fused, const u32* docs) { \
    flash_bwd_dkv_mma<192, WG, 1, false, false, 3>(q, k, v, lse, delta, dout, dk, dv, nullptr, t, sl, hq, hkv, scale, \
                                                   causal, window, fused, docs, AttnDrop{}); }
FLASH_BWD_WIDE(mma, false, 1)
FLASH_BWD_WIDE(wg2, true, 2)
// dK, dV and dQ in one pass (flash_bwd_dkvq_wgNW_bf16_D; fp32 dQ tiles by bulk reductions, see
// DQ above). D 64: two blocks per SM (at three it spilled).
#define FLASH_BWD_DKVQ(D, NW, MINB) \
extern "C" __global__ void __launch_bounds__(128 * NW, MINB) flash_bwd_dkvq_wg##NW##_bf16_##D(const bf16_t* q, \
        const bf16_t* k, const bf16_t* v, const float* lse, const float* delta, const bf16_t* dout, bf16_t* dk, \
        bf16_t* dv, float* dqa, long t, long sl, long hq, long hkv, long d, float scale, long causal, long window, \
        long fused) { \
    flash_bwd_dkv_mma<D, true, NW, true>(q, k, v, lse, delta, dout, dk, dv, dqa, t, sl, hq, hkv, scale, causal, window, \
                                         fused, nullptr, AttnDrop{}); }
FLASH_BWD_DKVQ(64, 1, 2)
FLASH_BWD_DKVQ(128, 2, 1)
// With attention dropout (`_drop`, the key last): the two mma.sync kernels (wgmma off, deterministic
// mode, head dim 192) and the fused kernel on wgmma.
#define FLASH_BWD_DROP_MMA(D, R) \
extern "C" __global__ void __launch_bounds__(128) flash_bwd_dq_mma_drop_bf16_##D(const bf16_t* q, const bf16_t* k, \
        const bf16_t* v, const float* lse, const float* delta, const bf16_t* dout, bf16_t* dq, long t, long sl, long hq, \
        long hkv, long d, float scale, long causal, long window, long fused, const u32* docs, AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    flash_bwd_dq_mma<D, false, 1, true>(q, k, v, lse, delta, dout, dq, t, sl, hq, hkv, scale, causal, window, fused, \
                                        docs, dr); } \
extern "C" __global__ void __launch_bounds__(128 * R) flash_bwd_dkv_mma_drop_bf16_##D(const bf16_t* q, const bf16_t* k, \
        const bf16_t* v, const float* lse, const float* delta, const bf16_t* dout, bf16_t* dk, bf16_t* dv, long t, \
        long sl, long hq, long hkv, long d, float scale, long causal, long window, long fused, const u32* docs, \
        AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    flash_bwd_dkv_mma<D, false, 1, false, true, R == 2 ? 3 : 0>(q, k, v, lse, delta, dout, dk, dv, nullptr, t, sl, hq, \
                                                                hkv, scale, causal, window, fused, docs, dr); }
#define FLASH_BWD_DROP(D, NW, MINB) \
extern "C" __global__ void __launch_bounds__(128 * NW, MINB) flash_bwd_dkvq_wg##NW##_drop_bf16_##D(const bf16_t* q, \
        const bf16_t* k, const bf16_t* v, const float* lse, const float* delta, const bf16_t* dout, bf16_t* dk, \
        bf16_t* dv, float* dqa, long t, long sl, long hq, long hkv, long d, float scale, long causal, long window, \
        long fused, AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    flash_bwd_dkv_mma<D, true, NW, true, true>(q, k, v, lse, delta, dout, dk, dv, dqa, t, sl, hq, hkv, scale, causal, \
                                               window, fused, nullptr, dr); } \
FLASH_BWD_DROP_MMA(D, 1)
FLASH_BWD_DROP(64, 1, 2)
FLASH_BWD_DROP(128, 2, 1)
FLASH_BWD_DROP_MMA(192, 2)

// A consumer's 64 keys of dK or dV (accumulator fragments times `mul`, bf16) into [B, sl, heads,
// D] by their `Place`, through shared memory as the forward's O (fwd_store_staged): the fragments
// into `tile` (64 × (D + 8), padded rows), then out in 16-byte pieces with D / 8 neighbouring
// threads per key, whole sectors (the fragment stores wrote 4 bytes a thread). `bar`: the
// consumer's 128-thread named barrier; `j0`: its first key.
// `part`: where this tile's 64 keys' column partials go (the bias-gradient partials of the
// fused gradient: col_chunk_sum of the bf16 values written), or null.
template <int D>
__device__ __forceinline__ void store_keys_staged(float (*acc)[4], float mul, bf16_t* tile, int bar, long j0,
                                                  bf16_t* out, long sl, long heads, long head, long b, float* part) {
    constexpr int NO = D / 8, TP = D + 8;
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3, wl = (threadIdx.x >> 5) & 3;
    #pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        bf16_t* row = tile + (wl * 16 + g + rr * 8) * TP + tg * 2;
        #pragma unroll
        for (int n = 0; n < NO; n++)
            *reinterpret_cast<u32*>(row + n * 8) = pack_bf16(acc[n][2 * rr] * mul, acc[n][2 * rr + 1] * mul);
    }
    named_sync(bar, 128);
    if (part && (threadIdx.x & 127) < D) {
        const int c = threadIdx.x & 127;
        part[c] = col_chunk_sum([&](int r) { return __uint_as_float((u32)tile[r * TP + c] << 16); });
    }
    for (int x = threadIdx.x & 127; x < 64 * NO; x += 128) {
        const int row = x / NO, c = x % NO;
        const long j = j0 + row;
        if (j < sl) *reinterpret_cast<u128*>(out + ((b * sl + j) * heads + head) * D + c * 8) =
            *reinterpret_cast<const u128*>(tile + row * TP + c * 8);
    }
}

// Warp-specialised dK, dV and dQ (sm_90a, head dims 64 and 128; the default there,
// `FERROTRON_FLASH_BWD=wg` selects the lockstep kernels instead): a producer warpgroup and two
// consumer warpgroups of 64 keys each, 128 keys per block. The producer copies the block's K and V
// once, then streams each step's (Q, dO) tiles and (lse, delta) rows into bw_stages(D) stages
// handed over by mbarriers (full: the copies landed; empty: both consumers are done with the
// stage), so after the first no block-wide barrier stalls a step: one consumer's products overlap
// the other's softmax and the next step's copies. Each consumer runs the DQ body of
// flash_bwd_dkv_mma on its own keys with its own dQ staging and bulk reductions (two 64 × 64 dQ
// pieces per step per block, the same count per key as before):
//   D 64:  consumer w: its own keys' dS times its K rows, all 64 columns (own dSᵀ buffer);
//   D 128: its keys × 128 columns would not fit beside dK and dV (64 registers each), so consumer w
//          computes column block w over all 128 keys from both consumers' dSᵀ (two buffers,
//          alternate steps; one 256-thread barrier per step between the stores and the product).
// Registers: the producer gives its registers to the consumers (setmaxnreg 40 / 232; the block
// launches with 384 · 168).
// Dynamic shared memory (bytes; the host's `bwd_plan` must agree): K, V 2·128·D·2; bw_stages ×
// (Q, dO) 2·64·D·2; dSᵀ 2·64·64·2 per buffer (D 64: one, 128: two); dQ staging 2 consumers × 2 ×
// 4096·4; bw_stages × (lse, delta) 2·64·4; 2·bw_stages + 6 mbarriers and DYN's two tile-index
// slots (8 bytes each). D 128: 230,496 of 232,448.
__host__ __device__ constexpr int bw_stages(int d) { return d == 64 ? 3 : 2; }
template <bool C, class T, class F>
struct Pick {
    using type = T;
};
template <class T, class F>
struct Pick<false, T, F> {
    using type = F;
};
// 4-byte asynchronous copy (zero-filled when `in` is false).
__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool in) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(in ? 4 : 0)
                 : "memory");
}
// TMA: the K/V, Q and dO tiles copied by one producer thread through the tensor maps km, vm, qm
// and dom (as [B, rows, heads, D] by their `Place`: boxes of 64 columns × 128 keys or 64 rows),
// instead of 128 threads' cp.async (the copy loop was 18% of the head dim 128 kernel's
// instructions, on the schedulers the consumers issue from); the (lse, delta) rows stay 4-byte
// cp.async from 128 threads (their rows need not be 16-byte aligned), so a stage's full barrier
// counts those 128 arrivals and the copying thread's expected bytes.
// DYN (TMA): persistent, one block per SM taking key tiles from a global counter (`sched`, as the
// forward's DYN: groups of `hg` K/V heads whose Q, dO, lse and delta share L2, in a group every
// head's heaviest key tile first). The stage ring and its phases run on across tiles; the copying
// thread loads the next tile's K and V once both consumers are done with this tile's (kvempty:
// after their last products), which its first stages' Q/dO copies do not wait for, so the copies
// overlap the consumers' dK/dV stores. The tile index goes to the other 383 threads through two
// shared slots (tfull / tempty).
// DROP: attention dropout (`dr`; attention.cu `AttnDrop`), as flash_bwd_dkv_mma's.
// DOCS: document masks (`docs`; flash.cu `doc_row_range`, `doc_cuts`): a key tile's query rows end
// at the last row of its keys' documents, and the steps a document start crosses are masked.
template <int D, bool TMA, bool DYN, bool DROP = false, bool DOCS = false>
__device__ void flash_bwd_dkvq_ws(const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* lse,
                                  const float* delta, const bf16_t* dout, bf16_t* dk, bf16_t* dv, float* dqa, long t,
                                  long sl, long hq, long hkv, float scale, long causal, long window, long fused,
                                  const TmaMap* km, const TmaMap* vm, const TmaMap* qm, const TmaMap* dom,
                                  float* bp, long bc, long bkv, long hg, u32* sched, const AttnDrop& dr,
                                  const u32* docs = nullptr) {
    static_assert(D == 64 || D == 128, "64-column dQ pieces");
    static_assert(!DYN || TMA, "the dynamic walk's K/V reloads are the copying thread's");
    // CK: keys per consumer; DSB: dSᵀ buffers (each both consumers' keys × 64 rows).
    constexpr int NO = D / 8, KEYS = 128, CK = 64, TILE = FB_ROWS * D, ST = bw_stages(D), DSB = D == 64 ? 1 : 2;
    constexpr int DSS = 2 * CK * FB_ROWS * 2;  // bytes of one dSᵀ buffer
    extern __shared__ __align__(1024) unsigned char fb_smem[];
    bf16_t* ks = reinterpret_cast<bf16_t*>(fb_smem);
    bf16_t* vs = ks + KEYS * D;
    bf16_t* qstage = vs + KEYS * D;                                               // (Q, dO) per stage
    unsigned char* dss_all = reinterpret_cast<unsigned char*>(qstage + ST * 2 * TILE);
    float* dqs_all = reinterpret_cast<float*>(dss_all + DSB * DSS);
    float* lstage = dqs_all + 2 * 2 * 4096;                                       // (lse, delta) per stage
    u64* full = reinterpret_cast<u64*>(lstage + ST * 2 * FB_ROWS);
    u64* empty = full + ST;
    u64* kvbar = empty + ST;
    u64* kvempty = kvbar + 1;  // DYN: both consumers are done with this tile's K and V
    u64* tfull = kvempty + 1;  // DYN: tile index written (2), the other threads have read it (2)
    u64* tempty = tfull + 2;
    volatile long* tix = reinterpret_cast<volatile long*>(tempty + 2);  // DYN: two index slots
    const long tiles = (sl + KEYS - 1) / KEYS, ntiles = tiles * bkv;
    const long group = hq / hkv, tp = (t + 63) / 64, qgs = fused ? group + 2 : group;  // qgs: as in flash_bwd_dkv_mma
    // The key tile of index u: (key tile, K/V head, batch), its keys j0.., the query rows [ib, ie)
    // that see them, in qtiles tiles, and the steps (group heads × qtiles).
    long kt, kvh, b, j0, ib, ie, qtiles, steps;
    auto decode = [&](long u) {
        if (DYN) {
            const long gt = hg * tiles, grp = u / gt, r = u - grp * gt, gsz = lmin(hg, bkv - grp * hg);
            const long hh = grp * hg + r % gsz;
            kt = r / gsz;  // key tile 0 is seen by the most query rows under a causal mask
            kvh = hh % hkv;
            b = hh / hkv;
        } else {
            kt = u % tiles;
            kvh = (u / tiles) % hkv;
            b = u / (tiles * hkv);
        }
        j0 = kt * KEYS;
        row_range(j0, lmin(sl, j0 + KEYS) - 1, t, causal, window, FB_ROWS, &ib, &ie);
        if constexpr (DOCS) doc_row_range(docs, b, t, lmin(sl, j0 + KEYS) - 1, &ie);
        qtiles = ie > ib ? (ie - ib + FB_ROWS - 1) / FB_ROWS : 0;
        steps = group * qtiles;
    };
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3, wg = warp >> 2;
    if (threadIdx.x == 0) {
        for (int st = 0; st < ST; st++) { mbar_init(&full[st], TMA ? 129 : 128); mbar_init(&empty[st], 256); }
        mbar_init(kvbar, TMA ? 1 : 128);
        mbar_init(kvempty, 256);
        for (int s = 0; s < 2; s++) { mbar_init(&tfull[s], 1); mbar_init(&tempty[s], 383); }
    }
    __syncthreads();  // the only block-wide barrier
    const bool copier = threadIdx.x == 256;  // the producer thread that issues the TMA copies
    // This block's tile in round j into the decode's variables; false past the last. DYN: the
    // copier (`takes`) takes the index from the counter and hands it over; the others wait for it
    // (the consumers pass a constant false: no copier code in their registers).
    auto next = [&](u32 j, bool takes) -> bool {
        if constexpr (DYN) {
            const int ts = (int)(j & 1);
            long u;
            if (takes) {
                u = (long)atomicAdd(sched, 1u);
                if (u >= ntiles) u = -1;
                if (j >= 2) mbar_wait(&tempty[ts], ((j >> 1) - 1) & 1);
                tix[ts] = u;
                mbar_arrive(&tfull[ts]);  // release: the waits below see the index
            } else {
                mbar_wait(&tfull[ts], (j >> 1) & 1);
                u = tix[ts];
                mbar_arrive(&tempty[ts]);
            }
            if (u < 0) return false;
            decode(u);
            return true;
        } else {
            if (j > 0) return false;
            decode(blockIdx.x);
            return true;
        }
    };
    if (wg == 2) {
        wg_reg_dealloc<40>();
        int tid = threadIdx.x & 127;
        long n = 0;  // steps over this block's tiles: the stage ring's position
        for (u32 j = 0; next(j, copier); j++) {
            const Place kp = kv_place(kvh, hq, hkv, fused);
            // K and V of this tile: DYN's tile j > 0 once the consumers released tile j − 1's,
            // after this tile's first stages are issued (their slots free up as the consumers
            // finish the last tile's steps, which they need no K/V of this tile for).
            auto load_kv = [&]() {
                if (j > 0) mbar_wait(kvempty, (j - 1) & 1);
                mbar_expect_tx(kvbar, 2 * KEYS * D * 2);
                #pragma unroll
                for (int cb = 0; cb < D / 64; cb++) {
                    tma_load_4d(ks + cb * KEYS * 64, km, cb * 64, (int)kp.head, (int)j0, (int)b, kvbar);
                    tma_load_4d(vs + cb * KEYS * 64, vm, cb * 64, (int)kp.head, (int)j0, (int)b, kvbar);
                }
            };
            const long early = DYN ? lmin(steps, ST) : 0;  // stages issued before the K/V copy
            if (!TMA) {
                tile_async_sw<D, KEYS, 128>(ks, k, j0, sl, b, kp.heads, kp.head, tid);
                tile_async_sw<D, KEYS, 128>(vs, v, j0, sl, b, kp.heads, kp.head, tid);
                cp_arrive(kvbar);
            } else if (copier && early == 0) {
                load_kv();
            }
            for (long s = 0; s < steps; s++, n++) {
                if (copier && DYN && s == early && early > 0) load_kv();
                int st = n % ST;
                if (n >= ST) mbar_wait(&empty[st], ((n / ST) - 1) & 1);
                long h = kvh * group + s / qtiles, i0 = ib + (s % qtiles) * FB_ROWS;
                bf16_t* qt = qstage + st * 2 * TILE;
                if (!TMA) {
                    tile_async_sw<D, FB_ROWS, 128>(qt, q, i0, t, b, hkv * qgs, kvh * qgs + s / qtiles, tid);
                    tile_async_sw<D, FB_ROWS, 128>(qt + TILE, dout, i0, t, b, hq, h, tid);
                } else if (tid == 0) {
                    mbar_expect_tx(&full[st], 2 * TILE * 2);
                    #pragma unroll
                    for (int cb = 0; cb < D / 64; cb++) {
                        tma_load_4d(qt + cb * FB_ROWS * 64, qm, cb * 64, (int)(kvh * qgs + s / qtiles), (int)i0, (int)b,
                                    &full[st]);
                        tma_load_4d(qt + TILE + cb * FB_ROWS * 64, dom, cb * 64, (int)h, (int)i0, (int)b, &full[st]);
                    }
                }
                long i = i0 + (tid & 63);
                const float* rows = (tid < FB_ROWS ? lse : delta) + (b * hq + h) * t;
                cp_async4(lstage + st * 2 * FB_ROWS + tid, rows + (i < t ? i : 0), i < t);
                cp_arrive(&full[st]);
            }
            if (copier && DYN && early > 0 && early == steps) load_kv();
        }
        cp_wait<0>();
        if (DYN && copier) {
            // Every block's last index has been taken before its count: the last one to count
            // clears both for the next launch (stream order makes the writes visible to it).
            __threadfence();
            if (atomicAdd(sched + 1, 1u) == gridDim.x - 1) {
                atomicExch(sched, 0u);
                atomicExch(sched + 1, 0u);
            }
        }
        return;
    }
    wg_reg_alloc<232>();
    // The stage ring's position and parity, and a step count for the alternating buffers (dSᵀ at
    // D 128 and the dQ staging), all running on across this block's tiles. With two stages the
    // stage index is that count's parity (a register fewer: the head dim 128 build spilled).
    int stg = 0;
    u32 phase = 0, sn = 0;
    for (u32 j = 0; next(j, false); j++) {
        const Place kp = kv_place(kvh, hq, hkv, fused);
        // Consumer wg: keys j0 + 64·wg .. (rows 64·wg.. of the K and V tiles); this thread's two keys.
        // Positions: 32-bit at D 128 (64-bit ones spilled its accumulators); 64-bit at D 64, whose
        // build with 32-bit ones (same hot-path length in the SASS) ran 7% slower on the H200.
        using Pos = typename Pick<D == 64, long, int>::type;
        Pos jc = (Pos)j0 + wg * CK, jr0 = jc + (warp & 3) * 16 + g, jr1 = jr0 + 8, nsteps = (Pos)steps, nq = (Pos)qtiles;
        // The steps whose tile needs no mask (`tile_full` of rows ib + 64·qi against this consumer's
        // keys) are those with qlo ≤ qi < qhi: two compares a step instead of the test.
        Pos qlo = 0, qhi = 0;
        if (window == 0 && (long)jc + CK <= sl) {
            long a = (long)jc + CK - 1 - ib, c = t - FB_ROWS - ib;
            qlo = (Pos)(!causal || a <= 0 ? 0 : (a + FB_ROWS - 1) / FB_ROWS);
            qhi = (Pos)(c < 0 ? 0 : c / FB_ROWS + 1);
        }
        float* dqs = dqs_all + wg * 2 * 4096;
        u32 kb = smem_addr(ks) + wg * CK * 128, vb = smem_addr(vs) + wg * CK * 128;
        const float scale2 = scale * LOG2E;
        float dka[NO][4], dva[NO][4];
        #pragma unroll
        for (int n = 0; n < NO; n++) for (int e = 0; e < 4; e++) { dka[n][e] = 0.f; dva[n][e] = 0.f; }
        mbar_wait(kvbar, j & 1);
        // Step n's stage (stg), its parity (phase), its query tile (n % nq) and the head of the group
        // it belongs to (n / nq), stepped on rather than divided each step.
        Pos qi = 0, qh = 0;
        for (Pos n = 0; n < nsteps; n++, sn++) {
            Pos i0 = (Pos)ib + qi * FB_ROWS;
            mbar_wait(&full[stg], phase);
            fence_async_smem();
            const bf16_t* qs = qstage + stg * 2 * TILE;
            const bf16_t* dos = qs + TILE;
            const float* ls = lstage + stg * 2 * FB_ROWS;
            const float* dls = ls + FB_ROWS;
            // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: this consumer's 64 keys × 64 rows each (overwritten).
            float st[8][4], dpt[8][4];
            wg_scores_t<D>(st, dpt, kb, vb, smem_addr(qs), smem_addr(dos), KEYS);
            // Pᵀ into st, dSᵀ into dpt (no mask for a tile inside the sequence below the diagonal).
            // DOCS: a step whose last row's document starts after this consumer's first key.
            const bool cuts = DOCS && doc_cuts(docs, b, t, lmin(t, (long)i0 + FB_ROWS) - 1, (long)jc);
            const bool unmasked = qi >= qlo && qi < qhi;
            if (cuts) doc_mask_t(st, docs, b, t, (long)i0, (long)jr0, (long)jr1, tg);
            if (D == 64 && !unmasked) {
                mask_t<true>(st, i0, jr0, jr1, tg, t, sl, causal, window);
            } else if (D == 128 && !unmasked) {
                // `mask_t`'s column ranges in 32-bit arithmetic (64-bit temporaries here spilled the
                // D 128 scores): row i0 + col against key jr0 (e < 2) or jr1 = jr0 + 8, i − j = dd +
                // col (− 8), so key k sees the columns [lo, hi] below, less this thread's 2·tg.
                const int left = (int)lmin(t - i0, FB_ROWS), win = (int)window;
                #pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const int dd = (int)(i0 - jr0) - rr * 8;
                    int lo = causal ? -dd : 0, hi = left - 1;
                    if (win > 0) { lo = max(lo, 1 - win - dd); hi = min(hi, win - 1 - dd); }
                    if ((rr ? jr1 : jr0) >= sl) hi = -1;
                    hi -= tg * 2;
                    lo -= tg * 2;
                    #pragma unroll
                    for (int nb = 0; nb < 8; nb++)
                        #pragma unroll
                        for (int e = rr * 2; e < rr * 2 + 2; e++) {
                            const int c = nb * 8 + (e & 1);
                            if (c > hi || c < lo) st[nb][e] = -INFINITY;  // p = 0
                        }
                }
            }
            u32 keep = 0;
            if constexpr (DROP)
                keep = drop_dpt(dr, dpt, drop_tile(dr, b, kvh * group + qh, i0 >> 4, jr0 >> 4, t, sl), sl, g, tg);
            p_ds_t<true>(st, dpt, ls, dls, scale2, tg);
            if constexpr (DROP) drop_keep(st, keep, dr.scale);
            u32 pa[FB_ROWS / 16][4], sa[FB_ROWS / 16][4];
            #pragma unroll
            for (int kstep = 0; kstep < FB_ROWS / 16; kstep++) { c_to_a(pa[kstep], st, kstep); c_to_a(sa[kstep], dpt, kstep); }
            // dSᵀ to shared memory as flash_bwd_dkv_mma's DQ body lays it out: this consumer's keys
            // from byte wg · DSS / 2 of the step's buffer.
            const int alt = ST == 2 ? stg : (int)(sn & 1);  // this step's buffer of each pair
            unsigned char* dsb = dss_all + (DSB == 1 ? 0 : alt * DSS);
            unsigned char* dss = dsb + wg * (DSS / 2);
            store_dst(dss, dpt, warp & 3, g, tg);
            float dqc[8][4];
            #pragma unroll
            for (int nb = 0; nb < 8; nb++) for (int e = 0; e < 4; e++) dqc[nb][e] = 0.f;
            fence_async_smem();
            // D 128: both consumers' dSᵀ are stored (a buffer is rewritten two steps on, after both
            // consumers passed the next step's barrier, so after their products that read it finished).
            if constexpr (D == 64) named_sync(1 + wg, 128); else named_sync(1, 256);
            // dV += Pᵀ dO, dK += dSᵀ Q, dQ's 64 columns += dS K (see above for which keys and columns).
            wg_pin<D / 2>(&dka[0][0]);
            wg_pin<32>(&dqc[0][0]);
            wg_start<D / 2>(&dva[0][0]);
            wg_pv<D, FB_ROWS>(dva, pa, dos);
            wg_pv<D, FB_ROWS>(dka, sa, qs);
            if constexpr (D == 64) {
                u32 ab = smem_addr(dss);
                #pragma unroll
                for (int kk = 0; kk < CK / 16; kk++)
                    wgmma_m64n64k16_ss<1, 1>(&dqc[0][0], wg_step(wg_desc(ab, 16 * FB_ROWS, 128), kk * 32 * FB_ROWS),
                                             sw_mnmajor(kb, KEYS, kk));
            } else {
                // A: dSᵀ of all 128 keys; B: column block wg of the K tile (all its rows).
                u32 ab = smem_addr(dsb), kc = smem_addr(ks) + wg * KEYS * 128;
                #pragma unroll
                for (int kk = 0; kk < KEYS / 16; kk++)
                    wgmma_m64n64k16_ss<1, 1>(&dqc[0][0], wg_step(wg_desc(ab, 16 * FB_ROWS, 128), kk * 32 * FB_ROWS),
                                             sw_mnmajor(kc, KEYS, kk));
            }
            wg_finish<D / 2>(&dva[0][0]);
            wg_pin<D / 2>(&dka[0][0]);
            wg_pin<32>(&dqc[0][0]);
            wg_keep<FB_ROWS / 4>(&pa[0][0]);
            wg_keep<FB_ROWS / 4>(&sa[0][0]);
            // Every product that read stage stg is complete: hand it back to the producer.
            mbar_arrive(&empty[stg]);
            float* buf = dqs + alt * 4096;
            stage_dq(buf, dqc, warp & 3, lane);
            fence_async_smem();
            named_sync(D == 64 ? 1 + wg : 2 + wg, 128);  // (D 128: barrier 1 is the consumers')
            if ((threadIdx.x & 127) == 0) {
                long h = kvh * group + qh, cb = D == 64 ? 0 : wg;  // the piece's head and column block
                bulk_reduce_add(dqa + (((b * hq + h) * tp + i0 / 64) * (D / 64) + cb) * 4096, buf, 4096 * 4);
                // The buffer of step n − 1 is read before step n + 1 refills it.
                bulk_wait_read<1>();
            }
            if (++stg == ST) { stg = 0; phase ^= 1; }
            if (++qi == nq) { qi = 0; qh++; }
        }
        if (DYN) mbar_arrive(kvempty);  // its products are done: the copier may load the next K and V
        // dK and dV out through this consumer's dQ staging buffers, once its bulk reductions have
        // read them (32 KB; a padded 64 × (D + 8) bf16 tile is 17 KB at D 128).
        const int bar = D == 64 ? 1 + wg : 2 + wg;
        if ((threadIdx.x & 127) == 0) bulk_wait<0>();
        named_sync(bar, 128);
        bf16_t* tile = reinterpret_cast<bf16_t*>(dqs);
        // Bias-gradient partials (`bp`: [B·sl / 64, bc], fused layout, sl % 64 == 0, or null): this
        // consumer's 64 keys are one chunk; dK's slot is column (kp.head + group)·D of a row, dV's next.
        float* pk = bp && (long)jc < sl ? bp + ((b * sl + (long)jc) / 64) * bc + (kp.head + group) * D : nullptr;
        store_keys_staged<D>(dka, scale, tile, bar, jc, dk, sl, kp.heads, kp.head, b, pk);
        named_sync(bar, 128);  // every row of dK read out before dV overwrites the tile
        store_keys_staged<D>(dva, 1.f, tile, bar, jc, dv, sl, kp.heads, kp.head, b, pk ? pk + D : nullptr);
        if (DYN) named_sync(bar, 128);  // the tile read out before the next tile's dQ staging
    }
}
// `bkv`: batch × K/V heads (the grid's tiles are bkv × key tiles); `hg` and `sched` (a zeroed
// pair of counters the kernel leaves zeroed) are read by the dynamic walk (`d`) only.
#define FLASH_BWD_DKVQ_WS(NAME, D, TMA, DYN) \
extern "C" __global__ void __launch_bounds__(384, 1) NAME(const bf16_t* q, const bf16_t* k, const bf16_t* v, \
        const float* lse, const float* delta, const bf16_t* dout, bf16_t* dk, bf16_t* dv, float* dqa, long t, \
        long sl, long hq, long hkv, long d, float scale, long causal, long window, long fused, \
        const __grid_constant__ TmaMap km, const __grid_constant__ TmaMap vm, const __grid_constant__ TmaMap qm, \
        const __grid_constant__ TmaMap dom, float* bp, long bc, long bkv, long hg, u32* sched) { \
    flash_bwd_dkvq_ws<D, TMA, DYN>(q, k, v, lse, delta, dout, dk, dv, dqa, t, sl, hq, hkv, scale, causal, window, \
                                   fused, &km, &vm, &qm, &dom, bp, bc, bkv, hg, sched, AttnDrop{}); }
FLASH_BWD_DKVQ_WS(flash_bwd_dkvq_ws2_bf16_64, 64, false, false)
FLASH_BWD_DKVQ_WS(flash_bwd_dkvq_ws2_bf16_128, 128, false, false)
FLASH_BWD_DKVQ_WS(flash_bwd_dkvq_ws2t_bf16_64, 64, true, false)
FLASH_BWD_DKVQ_WS(flash_bwd_dkvq_ws2t_bf16_128, 128, true, false)
FLASH_BWD_DKVQ_WS(flash_bwd_dkvq_ws2td_bf16_64, 64, true, true)
FLASH_BWD_DKVQ_WS(flash_bwd_dkvq_ws2td_bf16_128, 128, true, true)
// With attention dropout (`_drop`, the key last): TMA copies, the dynamic walk.
#define FLASH_BWD_DKVQ_WS_DROP(NAME, D) \
extern "C" __global__ void __launch_bounds__(384, 1) NAME(const bf16_t* q, const bf16_t* k, const bf16_t* v, \
        const float* lse, const float* delta, const bf16_t* dout, bf16_t* dk, bf16_t* dv, float* dqa, long t, \
        long sl, long hq, long hkv, long d, float scale, long causal, long window, long fused, \
        const __grid_constant__ TmaMap km, const __grid_constant__ TmaMap vm, const __grid_constant__ TmaMap qm, \
        const __grid_constant__ TmaMap dom, float* bp, long bc, long bkv, long hg, u32* sched, AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    flash_bwd_dkvq_ws<D, true, true, true>(q, k, v, lse, delta, dout, dk, dv, dqa, t, sl, hq, hkv, scale, causal, \
                                           window, fused, &km, &vm, &qm, &dom, bp, bc, bkv, hg, sched, dr); }
FLASH_BWD_DKVQ_WS_DROP(flash_bwd_dkvq_ws2td_drop_bf16_64, 64)
FLASH_BWD_DKVQ_WS_DROP(flash_bwd_dkvq_ws2td_drop_bf16_128, 128)
// With document masks (`_docs`, the starts last): TMA copies, the dynamic walk.
#define FLASH_BWD_DKVQ_WS_DOCS(NAME, D) \
extern "C" __global__ void __launch_bounds__(384, 1) NAME(const bf16_t* q, const bf16_t* k, const bf16_t* v, \
        const float* lse, const float* delta, const bf16_t* dout, bf16_t* dk, bf16_t* dv, float* dqa, long t, \
        long sl, long hq, long hkv, long d, float scale, long causal, long window, long fused, \
        const __grid_constant__ TmaMap km, const __grid_constant__ TmaMap vm, const __grid_constant__ TmaMap qm, \
        const __grid_constant__ TmaMap dom, float* bp, long bc, long bkv, long hg, u32* sched, const u32* docs) { \
    flash_bwd_dkvq_ws<D, true, true, false, true>(q, k, v, lse, delta, dout, dk, dv, dqa, t, sl, hq, hkv, scale, causal, \
                                                  window, fused, &km, &vm, &qm, &dom, bp, bc, bkv, hg, sched, AttnDrop{}, \
                                                  docs); }
FLASH_BWD_DKVQ_WS_DOCS(flash_bwd_dkvq_ws2td_docs_bf16_64, 64)
FLASH_BWD_DKVQ_WS_DOCS(flash_bwd_dkvq_ws2td_docs_bf16_128, 128)

// dQ (bf16, [B, T, Hq, D], or with `fused` the query slots of dQKV: Place) from the bulk-reduced
// fp32 tiles: per (batch, head, 64-row tile, 64-column block) 4096 floats in the dK/dV kernel's
// fragment order (row 16·w4 + 8·rr + g, column 8·nb + 2·tg + c at ((w4·8 + nb)·32 + 4g + tg)·4 +
// 2rr + c), times the softmax `scale` the tiles are summed without. One 256-thread block per tile:
// the tile read in 16-byte pieces in its own order (a float4 is rows r and r + 8 of two columns),
// put row-major into shared memory (row stride 72 floats: a half-warp's 8-byte stores land on 32
// different banks), then each thread writes eight columns of a row as one 16-byte store. (v1, one
// thread per eight columns gathering them from the fragment order, read each 32-byte sector half
// at a time: 92 µs a 1.3B layer, ≈ 2.2 TB/s.)
#define DQT_STRIDE 72
extern "C" __global__ void __launch_bounds__(256) flash_dq_tiles_bf16(const float* dqa, bf16_t* dq, long t, long hq,
                                                                      long d, long hkv, long fused, float scale,
                                                                      float* bp, long bc) {
    __shared__ __align__(16) float tile[64 * DQT_STRIDE];
    const long cbs = d / 64, tp = (t + 63) / 64;
    long id = blockIdx.x;  // ((b · hq + h) · tp + it) · cbs + cb
    const long cb = id % cbs, it = (id / cbs) % tp, h = (id / (cbs * tp)) % hq, b = id / (cbs * tp * hq);
    const float* src = dqa + id * 4096;
    #pragma unroll
    for (int k = 0; k < 4; k++) {
        int q = k * 256 + threadIdx.x;  // float4 q of the tile
        float4 v = reinterpret_cast<const float4*>(src)[q];
        int tg = q & 3, g = (q >> 2) & 7, nb = (q >> 5) & 7, w4 = q >> 8;
        int row = 16 * w4 + g, col = 8 * nb + 2 * tg;
        *reinterpret_cast<float2*>(&tile[row * DQT_STRIDE + col]) = make_float2(v.x * scale, v.y * scale);
        *reinterpret_cast<float2*>(&tile[(row + 8) * DQT_STRIDE + col]) = make_float2(v.z * scale, v.w * scale);
    }
    __syncthreads();
    const Place qp = q_place(h, hq, hkv, fused);
    if (bp && threadIdx.x < 64) {
        // Bias-gradient partials (as flash_bwd_dkvq_ws's `bp`; t % 64 == 0): the tile's 64 rows are
        // one chunk, of the bf16 values written below.
        const int c = threadIdx.x;
        bp[((b * t) / 64 + it) * bc + qp.head * d + cb * 64 + c] =
            col_chunk_sum([&](int r) { return as_stored(dq, tile[r * DQT_STRIDE + c]); });
    }
    #pragma unroll
    for (int k = 0; k < 2; k++) {
        int u = k * 256 + threadIdx.x, row = u >> 3, c8 = u & 7;
        long i = it * 64 + row;
        if (i >= t) continue;
        // Halves in an order that keeps a quarter-warp's 16-byte reads on distinct banks.
        int first = (c8 >> 2) & 1;
        const float* r = &tile[row * DQT_STRIDE + c8 * 8];
        float v[8];
        float4 a = *reinterpret_cast<const float4*>(r + 4 * first), z = *reinterpret_cast<const float4*>(r + 4 * (1 - first));
        float4 lo = first ? z : a, hi = first ? a : z;
        v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w; v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
        st8(dq, ((b * t + i) * qp.heads + qp.head) * d + cb * 64 + c8 * 8, v);
    }
}
