// Our own bf16 GEMM for the two MLP products whose epilogue cuBLASLt runs slowly (sm_90a: wgmma,
// TMA; the host launches these only where the wgmma kernels run, and only when asked:
// `FERROTRON_OWN_GEMM=1`). cuBLASLt's GELU_AUX_BIAS kernel for fc1 and its DGELU kernel (an older
// xmma one) for fc2's input gradient take up to 1.33× the time of the same product without the
// epilogue (kernels/README.md, "own GEMM"): their warps stop multiplying while they store. Here
// one tile's epilogue runs while the tensor cores multiply another. So far the main loop is what
// loses: 0.88–0.90× cuBLASLt's plain product (≈ 5% more cycles alone, more energy a product at
// the power cap), so the fused kernels stand at 0.76–0.97× cuBLASLt's. The cooperative builds
// (below) fix the main loop (the 128 × 256 one runs level with cuBLASLt's plain product at
// 124M), but no placement of their epilogue has hidden it yet (kernels/README.md).
//
//   C [M, N] = A [M, K] · op(B), fp32 accumulation, then per element (r, c):
//     EPI_GELU   h = bf16(C + bias[c]) → aux[r, c], out[r, c] = bf16(gelu(h))   (B = w [N, K])
//     EPI_DGELU  out[r, c] = bf16(C · gelu'(aux[r, c]))                         (B = w [K, N])
//     EPI_PLAIN  out[r, c] = bf16(C (+ bias[c]))                                 (either layout)
//   GeLU is the tanh form of elementwise.cu, written with a sigmoid (0.5 (1 + tanh u) =
//   1 / (1 + e^(−2u))), and taken of h as stored: `out` is gelu of the h a later kernel reads.
//
// Block: three warpgroups, "ping-pong". Warpgroups 0 and 1 each take whole 128 × 128 output
// tiles, alternately (round j of the block's walk goes to warpgroup j % 2): two m64n128k16
// wgmmas a k-step, 128 accumulator registers a thread. A named-barrier handoff keeps their
// products in turn, so one warpgroup's epilogue runs while the other multiplies. The epilogue
// writes each 64-column half of its tile into a staging buffer in shared memory (the 128-byte
// swizzle a TMA box has there) and one thread stores it by TMA; the GeLU gradient's h arrives
// the same way, copied when the tile starts. Warpgroup 2 produces: one thread issues the TMA
// copies of A (128 × 64) and B (128 × 64, K-major: one box; MN-major: two 64 × 64 boxes) into
// GM_S stages of 32 KiB in the 128-byte swizzle (wgmma.cuh), in the order the rounds consume
// them. With CL = 2 (`_c2`, launched in clusters of two blocks) the two blocks take adjacent
// m-tiles of one n-tile and each copies half of B into both (TMA multicast); a stage is then
// free once both blocks' consumers are done with it. The cooperative builds (`_m256`, `_n256`)
// put both consumers on one tile instead (below).
// Accumulation: every k-step adds into the fp32 registers in k order (the first overwrites them),
// so each output's sum has one fixed order: the same bits on every run.

#define GM_BM 128
#define GM_BN 128
#define GM_BK 64
#define GM_S 5
#define GM_GROUP 16
#define EPI_GELU 0
#define EPI_DGELU 1
#define EPI_PLAIN 2

// sigmoid(2u) for GeLU's u = √(2/π) (x + 0.044715 x³): 0.5 (1 + tanh u).
__device__ __forceinline__ float gelu_sig(float x) {
    const float u = SQRT_2_OVER_PI * (x + 0.044715f * x * x * x);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + ex2(-2.f * LOG2E * u)));  // 1 / inf = 0
    return r;
}
__device__ __forceinline__ float gelu_fs(float x) { return x * gelu_sig(x); }
// d/dx: 0.5 (1 + t) + 0.5 x (1 − t²) u'(x) with 0.5 (1 + t) = s and 1 − t² = 4 s (1 − s).
__device__ __forceinline__ float gelu_gs(float x) {
    const float s = gelu_sig(x);
    return s + 2.f * x * s * (1.f - s) * SQRT_2_OVER_PI * (1.f + 3.f * 0.044715f * x * x);
}

// A WG's staging buffer: 128 rows × 64 columns of bf16 in the 128-byte swizzle, the layout a
// TMA box of 64 × 128 has in shared memory: the 4-byte pair at (row, col) of the buffer, col
// even. Within a warp's store of one 8-column block the 8 rows g land in 8 different 16-byte
// chunks (chunk ^ g), the 4 lanes tg in its 4 words: no bank conflict.
__device__ __forceinline__ u32* stage_word(unsigned char* buf, int row, int col) {
    return reinterpret_cast<u32*>(buf + row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2);
}

// The cooperative shapes (SH ≠ GM_PP): both consumer warpgroups work on one tile, sharing each
// B stage, so A and B cross L2 a quarter less often per product: GM_M256, 256 × 128 (a
// warpgroup's 128 rows by two m64n128k16 wgmmas a k16, as the ping-pong build) and GM_N256,
// 128 × 256 (a warpgroup's 64 rows by one m64n256k16: B read from shared memory once a k16
// instead of twice, a sixth less shared-memory traffic a product). 3 stages of 48 KiB.
// The epilogue's arithmetic runs in the slots the consumer warps have free while their wgmmas
// run: at a tile's end a consumer writes bf16(C (+ bias)) into its staging buffers (32 KiB: two
// of 128 rows × 64 columns, or four of 64 × 64) and stores them by TMA (GeLU: as h); during the
// next tile's k-steps it turns them, a slice of chunks a k-step, into gelu(h) in place and stores
// that after the last slice. dGeLU turns this round: during the tile's own k-steps the buffers
// receive its h by TMA and become gelu'(h) in fp16 (relative error 2⁻¹¹; bf16's 2⁻⁸ would add a
// rounding the fused product does not have), and at the end the consumer writes bf16(C ·
// gelu'(h)) there. (A fourth warpgroup for the epilogue leaves 128 registers a thread at launch,
// fewer than an m64n256 wgmma needs; in the producer warpgroup's three idle warps it ran 124M's
// fc1 + GeLU at 299 µs against the plain product's 112: kernels/README.md.)
#define GM_PP 0
#define GM_M256 1
#define GM_N256 2

__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float f16_half(u32 w, int hi) {
    float f;
    const unsigned short b = (unsigned short)(hi ? w >> 16 : w);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
}

// gelu of a bf16x2 word of h, in f16x2 arithmetic (a quarter of the fp32 form's MUFU operations,
// half its instructions): 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))), the constants rounded
// to fp16 (√(2/π) → 0x3a62, √(2/π) · 0.044715 → 0x2891). Relative error ≈ 2⁻¹¹ for x > 0;
// for x < 0, where 1 + tanh cancels, ≈ 2⁻¹² |x| absolute: below the bf16 rounding of the result
// and of h itself. |h| past fp16's 65504 becomes ±inf (gelu: inf or 0).
__device__ __forceinline__ u32 gelu_bf16x2(u32 w) {
    const u32 x = pack_f16(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    u32 g;
    asm("{\n.reg .b32 xx, p, u, t, hx;\n"
        "mul.rn.f16x2 xx, %1, %1;\n"
        "fma.rn.f16x2 p, xx, %2, %3;\n"
        "mul.rn.f16x2 u, %1, p;\n"
        "tanh.approx.f16x2 t, u;\n"
        "mul.rn.f16x2 hx, %1, %4;\n"
        "fma.rn.f16x2 %0, hx, t, hx;\n}"
        : "=r"(g)
        : "r"(x), "r"(0x28912891u), "r"(0x3a623a62u), "r"(0x38003800u));
    return pack_bf16(f16_half(g, 0), f16_half(g, 1));
}

// A consumer's staged epilogue work on its chunks [i0, i1) of 16 (thread t's chunk i is chunk
// q = t + 128 i of the consumer's 32 KiB: buffer q / (RB · 8), row (q % (RB · 8)) / 8, 16-byte
// column chunk q % 8; eight threads a 128-byte row, so each quarter-warp reads one whole row,
// conflict-free), in place: EPI_GELU h → gelu(h) (gelu_bf16x2), EPI_DGELU h → gelu'(h) as fp16
// pairs (fp32 arithmetic: in fp16, 1 − tanh² would lose the digits that x u'(x) multiplies).
template <int EPI, int RB>
__device__ __forceinline__ void gemm_epi_chunks(unsigned char* cbuf, int t, int i0, int i1) {
    // Two chunks at a time (the second predicated): a slice is one or two chunks, and their
    // dependency chains run side by side.
    #pragma unroll 1
    for (int i = i0; i < i1; i += 2) {
        u128* p[2];
        u128 v[2];
        #pragma unroll
        for (int c = 0; c < 2; c++) {
            const int q = t + 128 * (i + c), qq = q % (RB * 8), row = qq >> 3, c8 = qq & 7;
            p[c] = reinterpret_cast<u128*>(cbuf + (q / (RB * 8)) * (RB * 128) + row * 128 + (((c8 ^ row) & 7) << 4));
            if (c == 0 || i + 1 < i1) v[c] = *p[c];
        }
        #pragma unroll
        for (int c = 0; c < 2; c++) {
            u32* w = &v[c].x;
            #pragma unroll
            for (int k = 0; k < 4; k++) {
                const float lo = __uint_as_float(w[k] << 16), hi = __uint_as_float(w[k] & 0xffff0000u);
                w[k] = EPI == EPI_GELU ? gelu_bf16x2(w[k]) : pack_f16(gelu_gs(lo), gelu_gs(hi));
            }
        }
        *p[0] = v[0];
        if (i + 1 < i1) *p[1] = v[1];
    }
}
// bias[c] and bias[c + 1] (c even), or zeros without a bias or past N (a multiple of 8).
__device__ __forceinline__ void bias_pair(const bf16_t* bias, long c, long N, float& b0, float& b1) {
    b0 = b1 = 0.f;
    if (bias && c < N) {
        const u32 bv = *reinterpret_cast<const u32*>(bias + c);
        b0 = __uint_as_float(bv << 16);
        b1 = __uint_as_float(bv & 0xffff0000u);
    }
}

// The first of thread chunks 0..16 that slot s of `slots` takes (s = slots: 16).
__device__ __forceinline__ int gemm_slice(int s, int slots) { return (s * 16 + slots - 1) / slots; }

template <int EPI, bool BMN, int CL, int SH>
__device__ void gemm_ws(const TmaMap* am, const TmaMap* bm, const TmaMap* om, const TmaMap* xm, const bf16_t* bias,
                        long M, long N, long K) {
    extern __shared__ __align__(1024) unsigned char gm_smem[];  // swizzled tiles: 1024-byte aligned
    constexpr bool CO = SH != GM_PP;
    constexpr int BM = SH == GM_M256 ? 2 * GM_BM : GM_BM, BN = SH == GM_N256 ? 2 * GM_BN : GM_BN, S = CO ? 3 : GM_S;
    // A consumer's rows of the tile, and its staging buffers: NB of RB rows × 64 columns.
    constexpr int WR = CO ? BM / 2 : GM_BM, NB = CO ? BN / 64 : 2, RB = CO ? WR : GM_BM;
    constexpr u32 A_BYTES = BM * GM_BK * 2, B_BYTES = BN * GM_BK * 2, C_BYTES = RB * 64 * 2;
    unsigned char* sa = gm_smem;              // S × A tile
    unsigned char* sb = sa + S * A_BYTES;     // S × B tile
    unsigned char* sc = sb + S * B_BYTES;     // 64 KiB of staging buffers (32 KiB a consumer)
    u64* full = reinterpret_cast<u64*>(sc + 65536);
    u64* empty = full + S;
    u64* hfull = empty + S;  // EPI_DGELU: a consumer's h tile landed in its buffers
    // The walk: units of CL m-tiles (one a block of the cluster) by one n-tile, unit u = cluster,
    // cluster + clusters, …; in groups of GM_GROUP units down the rows, m fastest, so the tiles
    // running together cover a compact block of rows and columns whose A and B stay in L2.
    const long tn = (N + BN - 1) / BN, tmu = ((M + BM - 1) / BM + CL - 1) / CL, units = tmu * tn;
    const long nk = (K + GM_BK - 1) / GM_BK, C = gridDim.x / CL, cid = blockIdx.x / CL;
    const u32 rank = CL > 1 ? cluster_rank() : 0;
    auto tile_of = [&](long u, int& m0, int& n0) {
        const long per = GM_GROUP * tn, grp = u / per, first = grp * GM_GROUP, r = u - grp * per;
        const long gs = lmin(tmu - first, GM_GROUP);
        m0 = (int)(((first + r % gs) * CL + rank) * BM);  // past M when the last unit is short
        n0 = (int)((r / gs) * BN);
    };
    const int wg = threadIdx.x >> 7, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        // A stage is free once every consumer warp of every block it was copied into is done.
        for (int s = 0; s < S; s++) { mbar_init(&full[s], 1); mbar_init(&empty[s], (CO ? 8 : 4) * CL); }
        for (int w = 0; w < 2; w++) mbar_init(&hfull[w], 1);
    }
    if (CL > 1) cluster_sync(); else __syncthreads();  // the peers' barriers exist before any copy
    // A consumer warp's release of k-step x's stage, in its own block and (clusters) the peer's.
    auto release = [&](u32 x) {
        if (lane != 0) return;
        mbar_arrive(&empty[x % S]);
        if (CL > 1) mbar_arrive_peer(&empty[x % S], rank ^ 1);
    };
    // Registers: 384 · 168 = 64512 launched; 40 + 2 · 232 = 504 a thread slot (as flash_mma.cu).
    if (wg == 2) {
        wg_reg_dealloc<40>();
        if (threadIdx.x != 256) return;  // one thread copies
        u32 n = 0;  // k-steps over the block's rounds: stage n % S
        for (long u = cid; u < units; u += C) {
            int m0, n0;
            tile_of(u, m0, n0);
            for (long kb = 0; kb < nk; kb++, n++) {
                const int st = n % S, k0 = (int)(kb * GM_BK);
                if (n >= S) mbar_wait(&empty[st], ((n / S) - 1) & 1);
                // Boxes past the matrix's edge are zero-filled and still count their full bytes.
                mbar_expect_tx(&full[st], A_BYTES + B_BYTES);
                tma_load_2d(sa + st * A_BYTES, am, k0, m0, &full[st]);
                if constexpr (CL == 2) {
                    // Both blocks share the n-tile: each copies its half of B (BN / 2 rows of N
                    // K-major, or BN / 128 64-column blocks MN-major: BN · 64 bytes at the same
                    // offset) into both.
                    unsigned char* half = sb + st * B_BYTES + rank * (BN / 2) * GM_BK * 2;
                    if constexpr (BMN) {
                        #pragma unroll
                        for (int cb = 0; cb < BN / 128; cb++)
                            tma_load_2d_mc(half + cb * 64 * GM_BK * 2, bm, n0 + rank * (BN / 2) + cb * 64, k0,
                                           &full[st], 3);
                    } else {
                        tma_load_2d_mc(half, bm, k0, n0 + rank * (BN / 2), &full[st], 3);
                    }
                } else if constexpr (BMN) {
                    #pragma unroll
                    for (int cb = 0; cb < BN / 64; cb++)
                        tma_load_2d(sb + st * B_BYTES + cb * 64 * GM_BK * 2, bm, n0 + cb * 64, k0, &full[st]);
                } else {
                    tma_load_2d(sb + st * B_BYTES, bm, k0, n0, &full[st]);
                }
            }
        }
        if constexpr (CL > 1) {
            // Stay until the last S stages are released by both blocks' consumers: the peer's
            // arrivals on these barriers must find this block's shared memory still there.
            for (u32 q = n; q < n + S; q++)
                if (q >= S) mbar_wait(&empty[q % S], ((q / S) - 1) & 1);
        }
        return;
    }
    wg_reg_alloc<232>();
    const int warp = (threadIdx.x >> 5) & 3, g = lane >> 2, tg = lane & 3;
    const bool leader = (threadIdx.x & 127) == 0;
    // Barrier 1: warpgroup 1 may multiply; 2: warpgroup 0 may (after the other's round); 3 + wg:
    // this warpgroup's own.
    const int mine = wg == 0 ? 2 : 1, other = wg == 0 ? 1 : 2, own = 3 + wg;
    unsigned char* buf[2] = {sc + (2 * wg) * C_BYTES, sc + (2 * wg + 1) * C_BYTES};  // ping-pong's
    unsigned char* cbuf = sc + wg * 32768;  // cooperative: this consumer's NB buffers
    const int t = threadIdx.x & 127;
    // This warpgroup's rows of the stage's A tile (cooperative: its half).
    const u32 a_base = smem_addr(sa) + (CO ? wg * WR * 128 : 0), b_base = smem_addr(sb);
    // Ping-pong and GM_M256: rows 0–63 in d[0..64), 64–127 in d[64..128); GM_N256: 64 rows × 256.
    float d[128];
    // Cooperative GeLU: the last tile's h waits in the staging buffers for its slices (at pm0, pn0).
    bool pend = false;
    int pm0 = 0, pn0 = 0;
    // The k-steps that carry slices. GeLU: from g0 (a k-step after the h stores) for gslots,
    // ending a k-step or more before the tile's end (which waits for the gelu stores). dGeLU: the
    // h copy at k-step d0 (a k-step after the last tile's stores), then dslots slices from two
    // k-steps later to the end; with fewer k-steps, the copy at the first and the whole of
    // gelu' at the end.
    const int g0 = nk >= 3 ? 1 : 0, gslots = nk >= 3 ? (int)nk - 2 : 1;
    const int d0 = nk >= 4 ? 1 : 0, dslots = nk >= 4 ? (int)nk - 3 : 0;
    // All NB buffers of this consumer out by TMA at (r0, c0): h (GeLU's first) or out.
    auto store_all = [&](const TmaMap* map, int r0, int c0) {
        if (leader)
            for (int i = 0; i < NB; i++) tma_store_2d(map, cbuf + i * C_BYTES, c0 + i * 64, r0);
    };
    for (long j = CO ? 0 : wg;; j += CO ? 1 : 2) {
        const long u = cid + j * C;
        if (u >= units) break;
        int m0, n0;
        tile_of(u, m0, n0);
        if (CO) m0 += wg * WR;
        if (!CO && j > 0) named_sync(mine, 256);
        if (!CO && EPI == EPI_DGELU && leader) {
            // h's two 64-column halves into the buffers, once the last tile's stores have read them.
            bulk_wait_read<0>();
            mbar_expect_tx(&hfull[wg], 2 * C_BYTES);
            tma_load_2d(buf[0], xm, n0, m0, &hfull[wg]);
            tma_load_2d(buf[1], xm, n0 + 64, m0, &hfull[wg]);
        }
        u32 n = (u32)(j * nk);
        for (long kb = 0; kb < nk; kb++, n++) {
            const int st = n % S;
            mbar_wait(&full[st], (n / S) & 1);
            wg_fence();
            const u32 ab = a_base + st * A_BYTES, bb = b_base + st * B_BYTES;
            #pragma unroll
            for (int kk = 0; kk < GM_BK / 16; kk++) {
                const u64 db = BMN ? sw_mnmajor(bb, GM_BK, kk) : sw_kmajor(bb, BN, kk);
                const int acc = kb > 0 || kk > 0;
                if constexpr (SH == GM_N256) {
                    wgmma_m64n256k16_ss_acc<BMN ? 1 : 0>(d, sw_kmajor(ab, 64, kk), db, acc);
                } else {
                    wgmma_m64n128k16_ss_acc<BMN ? 1 : 0>(d, sw_kmajor(ab, 64, kk), db, acc);
                    wgmma_m64n128k16_ss_acc<BMN ? 1 : 0>(d + 64, sw_kmajor(ab + 64 * 128, 64, kk), db, acc);
                }
            }
            wg_commit();
            // One k-step's products stay in flight; the one before has finished reading its stage.
            if (kb > 0) {
                wg_wait<1>();
                release(n - 1);
            }
            // Cooperative epilogue slices while this k-step's products run (after the release, so
            // the producer's refill of that stage is not held up). No wait here on a bulk copy
            // issued less than a k-step before: a waiting leader holds its whole warpgroup's next
            // wgmma.
            if constexpr (CO && EPI == EPI_GELU) {
                // A slice of the last tile's gelu, from the k-step after its h stores were issued.
                if (pend && kb >= g0 && kb < g0 + gslots) {
                    if (kb == g0) {
                        if (leader) bulk_wait_read<0>();  // h's stores have read the buffers
                        named_sync(own, 128);
                    }
                    const int sl = (int)kb - g0;
                    gemm_epi_chunks<EPI_GELU, RB>(cbuf, t, gemm_slice(sl, gslots), gemm_slice(sl + 1, gslots));
                    if (sl == gslots - 1) {
                        fence_async_smem();
                        named_sync(own, 128);
                        store_all(om, pm0, pn0);
                        pend = false;
                    }
                }
            }
            if constexpr (CO && EPI == EPI_DGELU) {
                if (kb == d0 && leader) {
                    // This tile's h into the buffers, once the last tile's stores have read them.
                    bulk_wait_read<0>();
                    mbar_expect_tx(&hfull[wg], NB * C_BYTES);
                    for (int i = 0; i < NB; i++) tma_load_2d(cbuf + i * C_BYTES, xm, n0 + i * 64, m0, &hfull[wg]);
                }
                if (dslots > 0 && kb >= d0 + 2) {
                    if (kb == d0 + 2) mbar_wait(&hfull[wg], (u32)j & 1);
                    const int sl = (int)kb - d0 - 2;
                    gemm_epi_chunks<EPI_DGELU, RB>(cbuf, t, gemm_slice(sl, dslots), gemm_slice(sl + 1, dslots));
                }
            }
        }
        // Every product of this round is issued: the other warpgroup's round may queue its own.
        if (!CO && u + C < units) named_arrive(other, 256);
        wg_wait<0>();
        wg_pin<128>(d);
        release(n - 1);
        if constexpr (CO) {
            // Into this consumer's staging buffers: thread (warp, g, tg) holds row 16·warp + g (+ 8)
            // and columns 8·nb + 2·tg (+ 1) of each 64-row block (d[4·nb + e], mma.sync's C-fragment
            // layout). GeLU and plain: once the last stores from them have read them; dGeLU: once
            // every thread's slices of gelu' are in (with a one-k-step tile, all of them here).
            if constexpr (EPI == EPI_DGELU) {
                if (dslots == 0) {
                    mbar_wait(&hfull[wg], (u32)j & 1);
                    gemm_epi_chunks<EPI_DGELU, RB>(cbuf, t, 0, 16);
                }
            } else if (leader) {
                bulk_wait_read<0>();
            }
            named_sync(own, 128);
            #pragma unroll
            for (int i = 0; i < 32; i++) {
                // GM_M256: block i / 16 of rows, columns 8 · (i % 16); GM_N256: columns 8 · i.
                const int nb = SH == GM_M256 ? i & 15 : i, r0 = SH == GM_M256 ? (i >> 4) * 64 : 0;
                unsigned char* bf = cbuf + (nb >> 3) * C_BYTES;
                const int col = (nb & 7) * 8 + 2 * tg;
                float b0, b1;
                bias_pair(EPI == EPI_DGELU ? nullptr : bias, n0 + nb * 8 + 2 * tg, N, b0, b1);
                #pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    u32* p = stage_word(bf, r0 + warp * 16 + g + 4 * e, col);
                    const float x0 = d[4 * i + e], x1 = d[4 * i + e + 1];
                    if constexpr (EPI == EPI_DGELU) {
                        const u32 gv = *p;
                        *p = pack_bf16(x0 * f16_half(gv, 0), x1 * f16_half(gv, 1));
                    } else {
                        *p = pack_bf16(x0 + b0, x1 + b1);
                    }
                }
            }
            fence_async_smem();
            named_sync(own, 128);
            // GeLU: h now; gelu(h) after the next tile's slices (or the drain below).
            store_all(EPI == EPI_GELU ? xm : om, m0, n0);
            if (EPI == EPI_GELU) {
                pend = true;
                pm0 = m0;
                pn0 = n0;
            }
        } else {
            // Epilogue: thread (warp, g, tg) holds rows 16·warp + g (+ 8) of each 64-row half hm and
            // columns 8·nb + 2·tg (+ 1) (d[64·hm + 4·nb + e], mma.sync's C-fragment layout); column
            // half cb = nb / 8 goes through buf[cb] (GeLU: h through buf[0] and a through buf[1], one
            // half after the other) and out by TMA, which leaves what lies past M and N unwritten.
            if constexpr (EPI == EPI_DGELU) mbar_wait(&hfull[wg], (u32)(j >> 1) & 1);  // its rounds so far
            #pragma unroll
            for (int cb = 0; cb < 2; cb++) {
                if (EPI == EPI_GELU || (EPI == EPI_PLAIN && cb == 0)) {
                    if (leader) bulk_wait_read<0>();  // the buffers' last stores have read them
                    named_sync(own, 128);
                }
                #pragma unroll
                for (int nq = 0; nq < 8; nq++) {
                    const int nb = cb * 8 + nq, col = nq * 8 + 2 * tg;
                    float b0, b1;
                    bias_pair(EPI == EPI_DGELU ? nullptr : bias, n0 + nb * 8 + 2 * tg, N, b0, b1);
                    #pragma unroll
                    for (int e = 0; e < 4; e += 2) {
                        #pragma unroll
                        for (int hm = 0; hm < 2; hm++) {
                            const int row = hm * 64 + warp * 16 + g + 4 * e;
                            const float x0 = d[64 * hm + 4 * nb + e], x1 = d[64 * hm + 4 * nb + e + 1];
                            if constexpr (EPI == EPI_GELU) {
                                const u32 hv = pack_bf16(x0 + b0, x1 + b1);
                                *stage_word(buf[0], row, col) = hv;
                                *stage_word(buf[1], row, col) = pack_bf16(gelu_fs(__uint_as_float(hv << 16)),
                                                                          gelu_fs(__uint_as_float(hv & 0xffff0000u)));
                            } else if constexpr (EPI == EPI_DGELU) {
                                u32* p = stage_word(buf[cb], row, col);
                                const u32 hv = *p;
                                *p = pack_bf16(x0 * gelu_gs(__uint_as_float(hv << 16)),
                                               x1 * gelu_gs(__uint_as_float(hv & 0xffff0000u)));
                            } else {
                                *stage_word(buf[cb], row, col) = pack_bf16(x0 + b0, x1 + b1);
                            }
                        }
                    }
                }
                if (EPI == EPI_GELU || cb == 1) {
                    fence_async_smem();
                    named_sync(own, 128);
                    if (leader) {
                        if constexpr (EPI == EPI_GELU) {
                            tma_store_2d(xm, buf[0], n0 + cb * 64, m0);
                            tma_store_2d(om, buf[1], n0 + cb * 64, m0);
                        } else {
                            tma_store_2d(om, buf[0], n0, m0);
                            tma_store_2d(om, buf[1], n0 + 64, m0);
                        }
                    }
                }
            }
        }
    }
    if (CO && EPI == EPI_GELU && pend) {
        // The last tile's gelu, with no products left to hide it.
        if (leader) bulk_wait_read<0>();
        named_sync(own, 128);
        gemm_epi_chunks<EPI_GELU, RB>(cbuf, t, 0, 16);
        fence_async_smem();
        named_sync(own, 128);
        store_all(om, pm0, pn0);
    }
    if (leader) bulk_wait<0>();  // the last stores done before the block's shared memory goes
}

// am: the tensor map of A [M, K] (boxes 64 × BM); bm: of w [N, K] (boxes 64 × BN, `_tn`) or of
// w [K, N] (64 × 64, `_nn`); om and xm: of out and aux [M, N] (64 × RB; xm unused by the plain
// kernels); bias [N] or null. N and K multiples of 8 (rows of 16-byte multiples for TMA). Grid:
// at most one block per SM; 384 threads; shared memory S stages of A and B
// tiles + 64 KiB of staging buffers + (2 · S + 2) · 8 bytes of mbarriers (the host's `smem`).
#define GEMM_WS(NAME, EPI, BMN, CL, SH) \
extern "C" __global__ void __launch_bounds__(384, 1) NAME(const __grid_constant__ TmaMap am, \
        const __grid_constant__ TmaMap bm, const __grid_constant__ TmaMap om, const __grid_constant__ TmaMap xm, \
        const bf16_t* bias, long M, long N, long K) { \
    gemm_ws<EPI, BMN, CL, SH>(&am, &bm, &om, &xm, bias, M, N, K); }
GEMM_WS(gemm_gelu_tn_bf16, EPI_GELU, false, 1, GM_PP)
GEMM_WS(gemm_dgelu_nn_bf16, EPI_DGELU, true, 1, GM_PP)
GEMM_WS(gemm_plain_tn_bf16, EPI_PLAIN, false, 1, GM_PP)
GEMM_WS(gemm_plain_nn_bf16, EPI_PLAIN, true, 1, GM_PP)
// Launched in clusters of two blocks (`_c2`, `FERROTRON_OWN_GEMM_BUILD=c2`) that take adjacent
// m-tiles of one n-tile and copy B once for both (TMA multicast), meant to cut the L2 traffic
// that holds the one-block kernel's clock down (H200, session 29: L2 busy 86% and 1.52 GHz
// against cuBLASLt's 58% and 1.64 GHz at the same cycles); so far no faster. bm's boxes are then
// 64 × 64 in either layout.
GEMM_WS(gemm_gelu_tn_c2_bf16, EPI_GELU, false, 2, GM_PP)
GEMM_WS(gemm_dgelu_nn_c2_bf16, EPI_DGELU, true, 2, GM_PP)
GEMM_WS(gemm_plain_tn_c2_bf16, EPI_PLAIN, false, 2, GM_PP)
GEMM_WS(gemm_plain_nn_c2_bf16, EPI_PLAIN, true, 2, GM_PP)
// Cooperative 256 × 128 tiles (`_m256`, `FERROTRON_OWN_GEMM_BUILD=m256`) and 128 × 256 tiles
// (`_n256`, `=n256`), the epilogue sliced over the consumers' next tile.
GEMM_WS(gemm_gelu_tn_m256_bf16, EPI_GELU, false, 1, GM_M256)
GEMM_WS(gemm_dgelu_nn_m256_bf16, EPI_DGELU, true, 1, GM_M256)
GEMM_WS(gemm_plain_tn_m256_bf16, EPI_PLAIN, false, 1, GM_M256)
GEMM_WS(gemm_plain_nn_m256_bf16, EPI_PLAIN, true, 1, GM_M256)
GEMM_WS(gemm_gelu_tn_n256_bf16, EPI_GELU, false, 1, GM_N256)
GEMM_WS(gemm_dgelu_nn_n256_bf16, EPI_DGELU, true, 1, GM_N256)
GEMM_WS(gemm_plain_tn_n256_bf16, EPI_PLAIN, false, 1, GM_N256)
GEMM_WS(gemm_plain_nn_n256_bf16, EPI_PLAIN, true, 1, GM_N256)
// 128 × 256 tiles in clusters of two blocks on adjacent m-tiles of one n-tile, each copying half
// of the B tile into both (`_n256c2`, `=n256c2`): B crosses L2 once a pair of tiles, as in
// cuBLASLt's 1 × 2 and 2 × 1 cluster kernels. Sustained at the power cap it runs no faster than
// `_n256` on the LM head's products (kernels/README.md).
GEMM_WS(gemm_gelu_tn_n256c2_bf16, EPI_GELU, false, 2, GM_N256)
GEMM_WS(gemm_dgelu_nn_n256c2_bf16, EPI_DGELU, true, 2, GM_N256)
GEMM_WS(gemm_plain_tn_n256c2_bf16, EPI_PLAIN, false, 2, GM_N256)
GEMM_WS(gemm_plain_nn_n256c2_bf16, EPI_PLAIN, true, 2, GM_N256)
