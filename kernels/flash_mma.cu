// Flash attention forward on tensor cores (bf16 in, fp32 accumulate): mma.sync m16n8k16, the
// FlashAttention-2 arrangement. A block of 4 warps takes 64·MT query rows (MT m-tiles of 16 per
// warp: 2 at head dim 64 from 2k tokens on, else 1) of one (batch, head); key tiles of 64 stream through shared memory in two stages (cp.async: the next
// K/V tile loads while this one is used), stored as [key][d] with rows padded by 8 elements so
// ldmatrix reads are conflict-free (K's B operand by ldmatrix, V's by ldmatrix.trans). S = QKᵀ
// stays in registers; its C-fragment layout for two adjacent 8-key blocks is exactly the
// A-fragment layout P needs for O += PV, so P never leaves registers. Online softmax in base 2
// per row across the 4 threads of a fragment row group (2 shuffles). Same layouts and outputs as
// flash.cu / attention.cu. Every helper before flash_fwd_mma is shared with flash_bwd_mma.cu.
// On sm_90 the same kernel body also runs with both products on wgmma (wgmma.cuh): one warpgroup
// of 64 rows per block, K/V tiles in the 128-byte swizzled layout, A operands (Q, P) from registers.

#define FM_ROWS 64
#define FM_KEYS 64

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8×8 bf16 matrices, transposed on the way in: lane l names row (l & 7) of matrix (l >> 3).
__device__ __forceinline__ void ldsm_x4_t(u32* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// Four 8×8 bf16 matrices as stored: lane l names row (l & 7) of matrix (l >> 3); the result is
// the A fragment of 16 rows × 16 columns, or the B fragments of two 8-column blocks.
__device__ __forceinline__ void ldsm_x4(u32* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}


// One k-step of S += A · Bᵀ for 8 blocks of 8 columns, Bᵀ rows read from a [col][d] tile (`tile`
// points at column 0) by ldmatrix: S = Q Kᵀ, dP = dO Vᵀ, Sᵀ = K Qᵀ, dPᵀ = V dOᵀ. For MT m-tiles of
// 16 rows at once (`frag(mt)`: m-tile mt's A fragment of this k-step): each B fragment loaded from
// shared memory feeds MT mma instructions (shared-memory reads per flop / MT).
template <int D, int MT, typename F>
__device__ __forceinline__ void mma_cols_step_mt(float (*s)[8][4], F frag, const bf16_t* tile, int kk) {
    int lane = threadIdx.x & 31, mi = lane >> 3, rr = lane & 7;
    #pragma unroll
    for (int nb = 0; nb < 8; nb += 2) {
        u32 bb[4];
        ldsm_x4(bb, tile + ((nb + (mi >> 1)) * 8 + rr) * (D + 8) + kk * 16 + (mi & 1) * 8);
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const u32* x = frag(mt);
            mma_bf16(s[mt][nb], x[0], x[1], x[2], x[3], bb[0], bb[1]);
            mma_bf16(s[mt][nb + 1], x[0], x[1], x[2], x[3], bb[2], bb[3]);
        }
    }
}

// The same for one m-tile (`a`: its A fragment).
template <int D>
__device__ __forceinline__ void mma_cols_step(float (*s)[4], const u32* a, const bf16_t* tile, int kk) {
    mma_cols_step_mt<D, 1>(reinterpret_cast<float (*)[8][4]>(s), [&](int) { return a; }, tile, kk);
}

// Every k-step, A fragments from registers (`a[kk]`: the warp's rows of Q or dO).
template <int D>
__device__ __forceinline__ void mma_cols(float (*s)[4], const u32 (*a)[4], const bf16_t* tile) {
    #pragma unroll
    for (int kk = 0; kk < D / 16; kk++) mma_cols_step<D>(s, a[kk], tile, kk);
}

// Every k-step of mma_cols_step_mt, the A fragments from registers (`a[mt][kk]`).
template <int D, int MT>
__device__ __forceinline__ void mma_cols_mt(float (*s)[8][4], const u32 (*a)[D / 16][4], const bf16_t* tile) {
    #pragma unroll
    for (int kk = 0; kk < D / 16; kk++) mma_cols_step_mt<D, MT>(s, [&](int mt) { return a[mt][kk]; }, tile, kk);
}

// Every k-step, A fragments by ldmatrix from the warp's 16 rows of a [row][d] tile (K or V).
template <int D>
__device__ __forceinline__ void mma_cols_smem(float (*s)[4], const bf16_t* rows, const bf16_t* tile) {
    int lane = threadIdx.x & 31;
    #pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        u32 a[4];
        ldsm_x4(a, rows + (lane & 15) * (D + 8) + kk * 16 + (lane >> 4) * 8);
        mma_cols_step<D>(s, a, tile, kk);
    }
}

__device__ __forceinline__ u32 word(const bf16_t* p) { return *reinterpret_cast<const u32*>(p); }

// Where a head's rows sit in a [B, T, ·, D] tensor: heads per row, and the head's index in a row.
// Separate tensors: [B, T, hq, D] for Q, [B, T, hkv, D] for K and V. `fused`: the QKV projection
// output read in place (Megatron's [B, T, hkv, g + 2, D]: each query group's g query heads, then
// its key head and its value head), with the q / k / v pointers offset by 0 / g / g + 1 heads, so
// a group's K and V share one index. The same for the gradients written into dQKV.
struct Place {
    long heads, head;
};
__device__ __forceinline__ Place q_place(long h, long hq, long hkv, long fused) {
    long g = hq / hkv;
    return fused ? Place{hkv * (g + 2), h / g * (g + 2) + h % g} : Place{hq, h};
}
__device__ __forceinline__ Place kv_place(long j, long hq, long hkv, long fused) {
    long g = hq / hkv;
    return fused ? Place{hkv * (g + 2), j * (g + 2)} : Place{hkv, j};
}

// Like tile_in, asynchronously (cp.async, 16 bytes a copy, zero-filled past the end): the tile for
// the next step loads while this one is computed. Commit with cp_commit, wait with cp_wait<N>
// (at most N groups still in flight), then __syncthreads before reading. CM: wgmma's 128-byte
// swizzled layout (wgmma.cuh) instead of padded rows. Either way copy x is chunk x % (D / 8) of
// row x / (D / 8): eight neighbouring threads read 128 contiguous bytes of one row.
// `tid` of `nt` threads share the copies (default: the whole block).
template <int D, int ROWS, bool CM = false>
__device__ __forceinline__ void tile_async(bf16_t* dst, const bf16_t* src, long row0, long rows, long b, long heads,
                                           long head, int tid = threadIdx.x, int nt = blockDim.x) {
    constexpr int V = D / 8;
    for (int x = tid; x < ROWS * V; x += nt) {
        int r = x / V, c = x % V;
        long row = row0 + r;
        bool in = row < rows;
        const bf16_t* g = src + ((b * rows + (in ? row : 0)) * heads + head) * D + c * 8;
        bf16_t* s = CM ? dst + sw_offset(r, c, ROWS) : dst + r * (D + 8) + c * 8;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(s)), "l"(g), "r"(in ? 16 : 0)
                     : "memory");
    }
}
// tile_async into the swizzled layout by NT threads, a compile-time count (the warp-specialised
// kernels' producer warpgroups): each thread's chunk column is fixed (c = tid % (D / 8)) and its
// rows step by NT / (D / 8), a multiple of 8, so its shared-memory offset steps by whole 1024-byte
// groups (the swizzle's XOR stays the same) and its global address by a fixed stride. The
// addresses are computed once a tile instead of once a copy: tile_async's 64-bit index arithmetic
// cost ≈ 29 instructions a copy (SASS), issued on the schedulers the consumers need.
template <int D, int ROWS, int NT>
__device__ __forceinline__ void tile_async_sw(bf16_t* dst, const bf16_t* src, long row0, long rows, long b,
                                              long heads, long head, int tid) {
    constexpr int V = D / 8, STEP = NT / V, N = ROWS * V / NT;
    static_assert(NT % V == 0 && STEP % 8 == 0 && (ROWS * V) % NT == 0, "tile_async_sw: rows per thread step");
    const int c = tid % V, r0 = tid / V;
    const long stride = STEP * heads * D;  // elements between one copy's row and the next one's
    const bf16_t* g = src + ((b * rows + row0 + r0) * heads + head) * D + c * 8;
    const u32 s = smem_addr(dst + sw_offset(r0, c, ROWS));
    const long left = rows - row0 - r0;  // rows from this thread's first that exist
    #pragma unroll
    for (int i = 0; i < N; i++) {
        const bool in = i * STEP < left;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s + i * STEP * 128),
                     "l"(in ? g + i * stride : src), "r"(in ? 16 : 0) : "memory");
    }
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// The K and V tiles of the keys [jb, je) that a block of query rows sees, KEYS at a time, through
// two shared-memory stages (`stage`: 4·KEYS·TP bf16): `wait(it)` returns step it's K tile (its V
// tile follows KEYS·TP later) once it has landed, and starts the next step's copy. One barrier per
// step: once every thread has passed it, every copy of tile it has landed and every warp is done
// with step it − 1, whose stage the next copy refills. The caller starts with `fetch(0)` (when
// `steps` > 0). CM: tiles in wgmma's swizzled layout, made visible to wgmma.
template <int D, int KEYS, bool CM = false>
struct KvStages {
    static constexpr int TP = CM ? D : D + 8;  // elements per tile row (padded rows for ldmatrix)
    bf16_t* stage;
    const bf16_t* k;
    const bf16_t* v;
    long jb, steps, sl, b, heads, head;  // (heads, head): the K/V head's Place
    __device__ __forceinline__ KvStages(bf16_t* stage, const bf16_t* k, const bf16_t* v, long jb, long je, long sl,
                                        long b, long heads, long head)
        : stage(stage), k(k), v(v), jb(jb), steps(je > jb ? (je - jb + KEYS - 1) / KEYS : 0), sl(sl), b(b),
          heads(heads), head(head) {}
    __device__ __forceinline__ void fetch(long it) const {
        bf16_t* kt = stage + (it & 1) * 2 * KEYS * TP;
        tile_async<D, KEYS, CM>(kt, k, jb + it * KEYS, sl, b, heads, head);
        tile_async<D, KEYS, CM>(kt + KEYS * TP, v, jb + it * KEYS, sl, b, heads, head);
        cp_commit();
    }
    __device__ __forceinline__ const bf16_t* wait(long it) const {
        cp_wait<0>();
        if constexpr (CM) fence_async_smem();
        __syncthreads();
        if (it + 1 < steps) fetch(it + 1);
        return stage + (it & 1) * 2 * KEYS * TP;
    }
};

// `ROWS` rows of one head from [B, rows, heads, D] into a padded [ROWS][D + 8] tile (zeros past
// the end), 16 bytes per copy.
template <int D, int ROWS>
__device__ __forceinline__ void tile_in(bf16_t* dst, const bf16_t* src, long row0, long rows, long b, long heads, long head) {
    constexpr int V = D / 8;
    for (int x = threadIdx.x; x < ROWS * V; x += blockDim.x) {
        int r = x / V, c = (x % V) * 8;
        long row = row0 + r;
        u128 w = {0u, 0u, 0u, 0u};
        if (row < rows) w = *reinterpret_cast<const u128*>(src + ((b * rows + row) * heads + head) * D + c);
        *reinterpret_cast<u128*>(dst + r * (D + 8) + c) = w;
    }
}

// acc[mt][n] += A · B for the D/8 output blocks of MT m-tiles (`a[mt]`: m-tile mt's A fragment),
// B from a [k][n] tile read transposed (`tile` points at the k-step's first row) and shared by the
// m-tiles: O += P V here, dQ += dS K, dV += Pᵀ dO, dK += dSᵀ Q in the backward.
template <int D, int MT>
__device__ __forceinline__ void mma_rows_t_mt(float (*acc)[D / 8][4], const u32 (*a)[4], const bf16_t* tile) {
    int lane = threadIdx.x & 31, mi = lane >> 3, rr = lane & 7;
    #pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
        u32 bb[4];
        ldsm_x4_t(bb, tile + ((mi & 1) * 8 + rr) * (D + 8) + (n + (mi >> 1)) * 8);
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            mma_bf16(acc[mt][n], a[mt][0], a[mt][1], a[mt][2], a[mt][3], bb[0], bb[1]);
            mma_bf16(acc[mt][n + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], bb[2], bb[3]);
        }
    }
}

// The same for one m-tile.
template <int D>
__device__ __forceinline__ void mma_rows_t(float (*acc)[4], const u32* a, const bf16_t* tile) {
    mma_rows_t_mt<D, 1>(reinterpret_cast<float (*)[D / 8][4]>(acc), reinterpret_cast<const u32 (*)[4]>(a), tile);
}

// The A fragment of k-step `ks` from accumulator blocks 2ks and 2ks + 1: an m16n8 accumulator
// block holds rows g, g + 8 × columns 2tg, 2tg + 1, which is half of the m16k16 A fragment.
__device__ __forceinline__ void c_to_a(u32* a, const float (*c)[4], int ks) {
    a[0] = pack_bf16(c[2 * ks][0], c[2 * ks][1]);
    a[1] = pack_bf16(c[2 * ks][2], c[2 * ks][3]);
    a[2] = pack_bf16(c[2 * ks + 1][0], c[2 * ks + 1][1]);
    a[3] = pack_bf16(c[2 * ks + 1][2], c[2 * ks + 1][3]);
}

// S (64 rows × N keys) += A Bᵀ by wgmma, issued (between wg_start and wg_finish): A's fragments
// from registers (`a[kk]`: Q or dO), B K-major from a swizzled tile of N rows (K or V).
// FRESH: the first k-step overwrites S (no zeroing before).
template <int D, int N = 64, bool FRESH = false>
__device__ __forceinline__ void wg_qk(float (*s)[4], const u32 (*a)[4], const bf16_t* tile) {
    u32 base = smem_addr(tile);
    if constexpr (FRESH) wgmma_rs<N, 0, 0>(&s[0][0], a[0], sw_kmajor(base, N, 0));
    #pragma unroll
    for (int kk = FRESH ? 1 : 0; kk < D / 16; kk++) wgmma_rs<N, 0>(&s[0][0], a[kk], sw_kmajor(base, N, kk));
}

// wg_qk with A from shared memory too: `qa`, the address of this warpgroup's first row of a
// K-major swizzled Q tile whose 64-column blocks are `rows` rows apart (sw_kmajor). 128 keys.
template <int D>
__device__ __forceinline__ void wg_qk_ss(float (*s)[4], u32 qa, int rows, const bf16_t* tile) {
    u32 base = smem_addr(tile);
    wgmma_m64n128k16_ss<0>(&s[0][0], sw_kmajor(qa, rows, 0), sw_kmajor(base, 128, 0));
    #pragma unroll
    for (int kk = 1; kk < D / 16; kk++) wgmma_m64n128k16_ss<1>(&s[0][0], sw_kmajor(qa, rows, kk), sw_kmajor(base, 128, kk));
}

// acc (64 rows × D) += A B by wgmma, issued: A's fragments from registers (`a[ks]`, 16 of the K
// dimension each: P, dS, Pᵀ, dSᵀ), B MN-major from a swizzled tile of KEYS rows (V, K, dO, Q).
// D 192: an n128 product over the first two column blocks and an n64 one over the third (its
// accumulator from block 16 of 8 columns on).
template <int D, int KEYS>
__device__ __forceinline__ void wg_pv(float (*acc)[4], const u32 (*a)[4], const bf16_t* tile) {
    u32 base = smem_addr(tile);
    #pragma unroll
    for (int ks = 0; ks < KEYS / 16; ks++) {
        if constexpr (D == 192) {
            wgmma_rs<128, 1>(&acc[0][0], a[ks], sw_mnmajor(base, KEYS, ks));
            wgmma_rs<64, 1>(&acc[16][0], a[ks], sw_mnmajor(base + 2 * KEYS * 128, KEYS, ks));
        } else {
            wgmma_rs<D, 1>(&acc[0][0], a[ks], sw_mnmajor(base, KEYS, ks));
        }
    }
}

// Whether the tile of query rows [i0, i0 + rows) × keys [j0, j0 + keys) needs no mask: inside
// the sequence, no window, and (causal) wholly on or below the diagonal.
__device__ __forceinline__ bool tile_full(long i0, long rows, long j0, long keys, long t, long sl, long causal,
                                          long window) {
    return window == 0 && i0 + rows <= t && j0 + keys <= sl && (!causal || j0 + keys - 1 <= i0);
}

// Document masks (flash.cu `doc_cuts`) on S's fragments for MT m-tiles (rows r[mt][0], r[mt][1]
// of this thread, keys from j0 as in softmax_tile): −∞ where a key lies before the row's document
// start. Applied before softmax_tile, only on tiles a document start crosses; the starts are read
// here (L1) rather than held in registers for the whole kernel.
template <int MT, int NB>
__device__ __forceinline__ void doc_mask(float (*s)[NB][4], const long (*r)[2], const u32* docs, long b, long t,
                                         long j0) {
    const int tg = threadIdx.x & 3;
    #pragma unroll
    for (int mt = 0; mt < MT; mt++)
        #pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            const long i = r[mt][rr];
            if (i < 0 || i >= t) continue;
            // Key j0 + c is seen iff c ≥ start − j0 (clamped to the tile, less this thread's 2·tg).
            const int lo = (int)lmax(-1, lmin((long)docs[b * t + i] - j0, NB * 8 + 1)) - tg * 2;
            #pragma unroll
            for (int nb = 0; nb < NB; nb++)
                #pragma unroll
                for (int e = rr * 2; e < rr * 2 + 2; e++)
                    if (nb * 8 + (e & 1) < lo) s[mt][nb][e] = -INFINITY;
        }
}

// One key tile's online softmax for MT m-tiles of S (NB blocks of 8 keys; this thread: rows
// r[mt][0] for elements 0, 1 and r[mt][1] for 2, 3 of each 8-key block; keys from j0): masks S
// unless the tile is `full` (inside the sequence, below the diagonal: a uniform branch), moves
// the running max m (base 2, scaled) and sum l on, returns in corr the factor each row's
// accumulator must be scaled by and P in pa as A fragments (k-steps of 16 keys). The scale is
// folded into one multiply-add per element: the max is taken over raw scores (the scale is
// positive), p = 2^(s·scale2 − m). PACK = false leaves P in s (fp32) for the caller to pack with
// c_to_a later. VOTE: returns whether some row of the warp moved its max (a warp-uniform answer:
// the accumulator's rescale can be skipped otherwise; true without VOTE).
template <int MT, int NB = FM_KEYS / 8, bool PACK = true, bool VOTE = false>
__device__ __forceinline__ bool softmax_tile(float (*s)[NB][4], float (*m)[2], float (*l)[2], float (*corr)[2],
                                             u32 (*pa)[NB / 2][4], bool full, const long (*r)[2], long j0,
                                             long t, long sl, long causal, long window, float scale2) {
    int tg = threadIdx.x & 3;
    if (!full && MT > 1) {
        // Two m-tiles (the mma.sync head dim 64 kernel): `allowed` per score; the column ranges
        // below took it past 255 registers.
        #pragma unroll
        for (int mt = 0; mt < MT; mt++)
            #pragma unroll
            for (int nb = 0; nb < NB; nb++)
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    long i = r[mt][e >> 1], j = j0 + nb * 8 + tg * 2 + (e & 1);
                    if (!(i < t && j < sl && allowed(i, j, causal, window))) s[mt][nb][e] = -INFINITY;
                }
    } else if (!full) {
        // `allowed` as a column range per row: key j0 + c is seen from row i iff lo ≤ c ≤ hi
        // (c < sl − j0; causal: c ≤ i − j0; window w: |i − j0 − c| < w; none from a row ≥ t),
        // worked out once per row in 64 bits and clamped to the tile, so each score costs two
        // 32-bit compares against its constant column (less this thread's 2·tg) and a select
        // instead of `allowed`'s 64-bit arithmetic (the masked turn took ≈ 2× an unmasked one).
        #pragma unroll
        for (int mt = 0; mt < MT; mt++)
            #pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                const long i = r[mt][rr], di = i - j0;
                long hi = sl - j0 - 1, lo = 0;
                if (causal) hi = lmin(hi, di);
                if (window > 0) { hi = lmin(hi, di + window - 1); lo = di - window + 1; }
                if (i >= t) hi = -1;
                const int h32 = (int)lmax(-1, lmin(hi, NB * 8)) - tg * 2;
                const int l32 = (int)lmax(0, lmin(lo, NB * 8 + 1)) - tg * 2;
                #pragma unroll
                for (int nb = 0; nb < NB; nb++)
                    #pragma unroll
                    for (int e = rr * 2; e < rr * 2 + 2; e++) {
                        const int c = nb * 8 + (e & 1);
                        if (c > h32 || c < l32) s[mt][nb][e] = -INFINITY;
                    }
            }
    }
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float mx[2] = {-INFINITY, -INFINITY};
        #pragma unroll
        for (int nb = 0; nb < NB; nb++)
            #pragma unroll
            for (int e = 0; e < 4; e++) mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][nb][e]);
        float mb[2];
        #pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
            mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
            float mn = fmaxf(m[mt][rr], mx[rr] * scale2);
            corr[mt][rr] = mn == -INFINITY ? 1.f : ex2(m[mt][rr] - mn);
            m[mt][rr] = mn;
            mb[rr] = mn == -INFINITY ? 0.f : mn;  // a row masked so far: its -inf scores give 0
        }
        float rs[2] = {0.f, 0.f};
        #pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = ex2(fmaf(s[mt][nb][e], scale2, -mb[e >> 1]));
                s[mt][nb][e] = p;
                rs[e >> 1] += p;
            }
        }
        #pragma unroll
        for (int rr = 0; rr < 2; rr++) l[mt][rr] = l[mt][rr] * corr[mt][rr] + rs[rr];  // row sums finish at the end
        if constexpr (PACK) {
            #pragma unroll
            for (int kstep = 0; kstep < NB / 2; kstep++) c_to_a(pa[mt][kstep], s[mt], kstep);
        }
    }
    if constexpr (!VOTE) return true;
    bool moved = false;
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) moved |= corr[mt][0] != 1.f || corr[mt][1] != 1.f;
    return __any_sync(0xffffffffu, moved);
}

// The forward's end for MT m-tiles: row sums over the 4 threads of each row group, then O / l
// (bf16) and lse (natural log) for this thread's rows r[mt][0], r[mt][1] below t.
template <int D, int MT>
__device__ __forceinline__ void fwd_store(float (*acc)[D / 8][4], float (*m)[2], float (*l)[2], const long (*r)[2],
                                          bf16_t* o, float* lse, long t, long hq, long b, long h) {
    constexpr int NO = D / 8;
    int tg = threadIdx.x & 3;
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        // Row sums over the 4 threads of each row group, then O / l and lse.
        #pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            l[mt][rr] += __shfl_xor_sync(0xffffffffu, l[mt][rr], 1);
            l[mt][rr] += __shfl_xor_sync(0xffffffffu, l[mt][rr], 2);
        }
        #pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            long i = r[mt][rr];
            if (i >= t) continue;
            float inv = 1.f / l[mt][rr];
            bf16_t* oi = o + ((b * t + i) * hq + h) * D;
            #pragma unroll
            for (int n = 0; n < NO; n++) {
                u32 w = pack_bf16(acc[mt][n][2 * rr] * inv, acc[mt][n][2 * rr + 1] * inv);
                *reinterpret_cast<u32*>(oi + n * 8 + tg * 2) = w;
            }
            if (tg == 0) lse[(b * hq + h) * t + i] = m[mt][rr] * LN2 + logf(l[mt][rr]);  // natural log
        }
    }
}

// fwd_store for one warpgroup of the warp-specialised forward, through shared memory: its 64 rows
// of O (normalised, bf16) go into `tile` (64 × (D + 8): padded rows, so the fragment writes are
// conflict-free), then out row by row in 16-byte pieces, D / 8 neighbouring threads per row:
// whole 32-byte sectors, 8 stores a thread at D 128. The fragment stores wrote 4 bytes a thread,
// half a sector an instruction: 32 stores a thread. `bar`: a named barrier of the warpgroup's 128
// threads; `row0`: its first query row.
template <int D>
__device__ __forceinline__ void fwd_store_staged(float (*acc)[D / 8][4], float (*m)[2], float (*l)[2],
                                                 const long (*r)[2], bf16_t* tile, int bar, long row0, bf16_t* o,
                                                 float* lse, long t, long hq, long b, long h) {
    constexpr int NO = D / 8, TP = D + 8;
    const int lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3, wl = (threadIdx.x >> 5) & 3;
    #pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        l[0][rr] += __shfl_xor_sync(0xffffffffu, l[0][rr], 1);
        l[0][rr] += __shfl_xor_sync(0xffffffffu, l[0][rr], 2);
    }
    #pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const float inv = 1.f / l[0][rr];
        bf16_t* row = tile + (wl * 16 + g + rr * 8) * TP + tg * 2;
        #pragma unroll
        for (int n = 0; n < NO; n++)
            *reinterpret_cast<u32*>(row + n * 8) = pack_bf16(acc[0][n][2 * rr] * inv, acc[0][n][2 * rr + 1] * inv);
        const long i = r[0][rr];
        if (tg == 0 && i >= 0 && i < t) lse[(b * hq + h) * t + i] = m[0][rr] * LN2 + logf(l[0][rr]);  // natural log
    }
    named_sync(bar, 128);
    for (int x = threadIdx.x & 127; x < 64 * NO; x += 128) {
        const int row = x / NO, c = x % NO;
        const long i = row0 + row;
        if (i >= 0 && i < t) *reinterpret_cast<u128*>(o + ((b * t + i) * hq + h) * D + c * 8) =
            *reinterpret_cast<const u128*>(tile + row * TP + c * 8);
    }
}

// MT m-tiles of 16 query rows per warp (a block: 4 warps × 16·MT rows). MT = 2 halves the K/V
// shared-memory reads per flop (FlashAttention-2's 128-row blocks); at D 128 the doubled
// accumulators do not fit the 255 registers, so MT = 1 there. WG: both products go through wgmma
// (K/V tiles swizzled; MT = 1) instead of mma.sync, NW warpgroups of 64 rows per block
// sharing each K/V tile (fewer L2 reads per flop: the single-warpgroup kernel was L2-bound).
// DROP: attention dropout (`dr`; attention.cu `AttnDrop`): P's row sums are taken before, P·V
// multiplies P̃ = P ∘ M / (1 − p). `docs`: document masks (flash.cu `doc_key_range`), or null.
template <int D, int MT, bool WG = false, int NW = 1, bool DROP = false>
__device__ void flash_fwd_mma(const bf16_t* q, const bf16_t* k, const bf16_t* v, bf16_t* o, float* lse, long t, long sl,
                              long hq, long hkv, float scale, long causal, long window, long fused, const u32* docs,
                              const AttnDrop& dr) {
    constexpr int KS = D / 16;        // k-steps over the head dim
    constexpr int NO = D / 8;         // 8-wide blocks of the output
    constexpr int ROWS = FM_ROWS * MT * NW;
    static_assert(WG ? MT == 1 : NW == 1, "wgmma: 64 rows per warpgroup; mma.sync: 4 warps per block");
    // Two stages of (K tile, V tile): 4·FM_KEYS·KP·2 bytes of dynamic shared memory.
    extern __shared__ __align__(1024) unsigned char fm_smem[];  // swizzled tiles: 1024-byte aligned
    bf16_t* stage = reinterpret_cast<bf16_t*>(fm_smem);
    long tiles = (t + ROWS - 1) / ROWS;
    // Within a head, the last query tiles (the most keys under a causal mask) start first.
    long qt = tiles - 1 - blockIdx.x % tiles, h = (blockIdx.x / tiles) % hq, b = blockIdx.x / (tiles * hq);
    long kvh = h / (hq / hkv);
    const Place qp = q_place(h, hq, hkv, fused), kp = kv_place(kvh, hq, hkv, fused);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    // This thread's rows: r[mt][0] and r[mt][1] = r[mt][0] + 8 of m-tile mt.
    long r[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) { r[mt][0] = qt * ROWS + (warp * MT + mt) * 16 + g; r[mt][1] = r[mt][0] + 8; }
    // Q fragments for every m-tile and k-step: columns kk*16 + tg*2 (+8).
    u32 qa[MT][KS][4];
    auto qword = [&](long row, int col) -> u32 {
        if (row >= t) return 0u;
        return *reinterpret_cast<const u32*>(q + ((b * t + row) * qp.heads + qp.head) * D + col);
    };
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        #pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            qa[mt][kk][0] = qword(r[mt][0], kk * 16 + tg * 2);
            qa[mt][kk][1] = qword(r[mt][1], kk * 16 + tg * 2);
            qa[mt][kk][2] = qword(r[mt][0], kk * 16 + 8 + tg * 2);
            qa[mt][kk][3] = qword(r[mt][1], kk * 16 + 8 + tg * 2);
        }
    }
    float acc[MT][NO][4];
    float m[MT][2], l[MT][2];  // running max (base 2) and sum per row
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        #pragma unroll
        for (int n = 0; n < NO; n++) for (int e = 0; e < 4; e++) acc[mt][n][e] = 0.f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }
    const float scale2 = scale * LOG2E;
    long i0 = qt * ROWS, i1 = lmin(t, i0 + ROWS) - 1, jb, je;
    key_range(i0, i1, sl, causal, window, FM_KEYS, &jb, &je);
    doc_key_range(docs, b, t, i0, FM_KEYS, &jb);
    using Stages = KvStages<D, FM_KEYS, WG>;
    constexpr int KP = Stages::TP;  // elements per K/V tile row
    const Stages kv(stage, k, v, jb, je, sl, b, kp.heads, kp.head);
    if (kv.steps > 0) kv.fetch(0);
    for (long it = 0; it < kv.steps; it++) {
        long j0 = jb + it * FM_KEYS;
        const bf16_t* ks = kv.wait(it);
        const bf16_t* vs = ks + FM_KEYS * KP;
        // S = Q Kᵀ for this warp's rows × 64 keys: 8 blocks of 8 keys per m-tile.
        float s[MT][8][4];
        #pragma unroll
        for (int mt = 0; mt < MT; mt++)
            for (int nb = 0; nb < 8; nb++) for (int e = 0; e < 4; e++) s[mt][nb][e] = 0.f;
        if constexpr (WG) {
            wg_start<32>(&s[0][0][0]);
            wg_qk<D>(s[0], qa[0], ks);
            wg_finish<32>(&s[0][0][0]);
        } else {
            mma_cols_mt<D, MT>(s, qa, ks);
        }
        bool full = tile_full(i0, ROWS, j0, FM_KEYS, t, sl, causal, window);
        if (doc_cuts(docs, b, t, i1, j0)) doc_mask<MT, FM_KEYS / 8>(s, r, docs, b, t, j0);
        u32 pa[MT][FM_KEYS / 16][4];  // P as A fragments, per m-tile and k-step of 16 keys
        float corr[MT][2];
        softmax_tile<MT, FM_KEYS / 8, !DROP>(s, m, l, corr, pa, full, r, j0, t, sl, causal, window, scale2);
        if constexpr (DROP) {
            #pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const unsigned long long tile = drop_tile(dr, b, h, r[mt][0] >> 4, j0 >> 4, t, sl);
                drop_frag<false, FM_KEYS / 8>(dr, tile, 32, g, tg, [&](int nb, int e, float mul) { s[mt][nb][e] *= mul; });
                #pragma unroll
                for (int kstep = 0; kstep < FM_KEYS / 16; kstep++) c_to_a(pa[mt][kstep], s[mt], kstep);
            }
        }
        #pragma unroll
        for (int mt = 0; mt < MT; mt++)
            #pragma unroll
            for (int n = 0; n < NO; n++) {
                acc[mt][n][0] *= corr[mt][0]; acc[mt][n][1] *= corr[mt][0];
                acc[mt][n][2] *= corr[mt][1]; acc[mt][n][3] *= corr[mt][1];
            }
        // O += P V: k-steps of 16 keys; P's A fragment comes from S blocks 2ks and 2ks+1.
        if constexpr (WG) {
            wg_start<D / 2>(&acc[0][0][0]);
            wg_pv<D, FM_KEYS>(acc[0], pa[0], vs);
            wg_finish<D / 2>(&acc[0][0][0]);
            wg_keep<FM_KEYS / 4>(&pa[0][0][0]);
        } else {
            #pragma unroll
            for (int kstep = 0; kstep < FM_KEYS / 16; kstep++) {
                u32 a[MT][4];
                #pragma unroll
                for (int mt = 0; mt < MT; mt++) for (int x = 0; x < 4; x++) a[mt][x] = pa[mt][kstep][x];
                mma_rows_t_mt<D, MT>(acc, a, vs + kstep * 16 * KP);
            }
        }
    }
    fwd_store<D, MT>(acc, m, l, r, o, lse, t, hq, b, h);
}

// The wgmma forward with its warps specialised (FlashAttention-3's arrangement): two consumer
// warpgroups of 64 query rows each and a producer warpgroup that streams K/V tiles through
// FW_STAGES shared-memory stages (swizzled; by TMA from one thread, or by cp.async from all 128,
// tile_async_sw). Stages hand over through mbarriers (full: the producer's copies landed; empty:
// both consumers are done with the tile), so no block-wide barrier ties the warpgroups together. A consumer's turn on the tensor
// cores issues S = Q·Kᵀ of tile it and O += P·V of tile it − 1 back to back as two commit groups
// and waits for S first; the warpgroups take turns (named barriers), so while one multiplies the
// other computes its softmax ("ping-pong"). The softmax of tile it is written to run while P·V
// of tile it − 1 still does (FlashAttention-3's intra-warpgroup overlap), but ptxas 13.0 places
// the wait for P·V about 18 instructions after the wait for S, part-way through the row maxima,
// whatever follows (SASS, 2026-11-30: at both head dims; the same with S kept live by a store
// never taken so that P went to other registers, with the stage's release moved to the turn's
// end or left out, with O's rescale moved to the next turn, with the exponentials replaced by
// multiplies, with a fence before each product), so only part of the row maxima overlaps. What
// the arrangement gains (kernels/README.md v21) comes from the two products issued together,
// one wait instead of two per turn, and no branch while a product runs: the mask's branch made
// ptxas wait at its join, so key tiles that need no mask run in a loop of their own.
// LATE (head dim 128): P stays in fp32 through the softmax and is packed to bf16 after the wait,
// and O's rescale is skipped when no row's max moved (a warp vote); at head dim 64 (128-key
// tiles) P is packed inside the softmax and O always rescaled (measured faster there). The
// consumers hold S, P, O and Q at once and take registers from the producer (setmaxnreg).
#define FW_STAGES 3

// PERSIST: one block per SM walks the query tiles (tile k, then 2G − 1 − k, 2G + k, …: heaviest
// first, a light tile after each heavy one) with the stage ring and its phases running on across
// tiles, so the producer copies the next tile's K/V while the consumers finish this one and store
// O; without it a block is one tile and the next block starts only once a block has left.
// TMA: the producer's copies by one thread through the tensor maps km and vm (K and V as
// [B, sl, heads, D] by their `Place`: box 64 columns × KEYS rows, D / 64 copies a tile), instead
// of 128 threads' cp.async (≈ 16 instructions a 16-byte copy in the SASS: 26% of the head dim 128
// forward's instructions, on the schedulers the consumers issue from).
// DYN (persistent, TMA): the query tiles are handed out by a global counter (`sched[0]`) instead
// of the static walk, in groups of `hg` heads (their K/V fit in L2 together: the static walk's
// heaviest-tile-first order over all heads streams every head's K/V from DRAM at once), within a
// group heaviest tile first over its heads. The producer thread takes the next index when it
// reaches that tile and passes it to the consumers through a ring of two shared slots (mbarriers
// tfull / tempty); a block whose index is past the end stops, and the last block to stop (count
// in `sched[1]`) sets both counters back to 0 for the next launch on the stream.
// NC = 3 (head dim 64, persistent, TMA, dynamic walk; FlashAttention-3's choice there): three
// consumer warpgroups, 192 query rows a tile, take turns on the tensor cores, so two of them
// have their softmax in flight while one multiplies (ncu at NC = 2: the tensor pipe 34% busy,
// issue slots 41%, the consumers waiting on each other's turns). 512 threads leave a consumer 160
// registers: S = Q·Kᵀ reads Q from its shared tile (QSS) instead of 16 registers of fragments,
// and P stays in S's registers until the last P·V is done (LATE). Under a causal mask the tiles
// are laid from the last row back, so the partial one (t is rarely a multiple of 192) is the
// first, the lightest: its rows before 0 see no keys and are not stored.
// DROP: attention dropout (`dr`; attention.cu `AttnDrop`) on P (fp32, LATE) right after the
// softmax; query tiles from multiples of 16 rows (two consumers), as the mask's tiles need.
template <int D, int KEYS, bool LATE, bool PERSIST, bool TMA, bool DYN, int S, int NC = 2, bool DROP = false,
          bool DOCS = false>
__device__ void flash_fwd_ws(const bf16_t* q, const bf16_t* k, const bf16_t* v, bf16_t* o, float* lse, long t, long sl,
                             long hq, long hkv, float scale, long causal, long window, long fused, long bh,
                             const TmaMap* km, const TmaMap* vm, const TmaMap* qm, long hg, u32* sched,
                             const AttnDrop& dr, const u32* docs = nullptr) {
    static_assert(!DYN || (PERSIST && TMA), "the dynamic walk is one producer thread's: persistent, TMA");
    static_assert(!DROP || (LATE && NC == 2), "dropout: P in fp32 after the softmax, 128-row tiles");
    static_assert(NC == 2 || (NC == 3 && D == 64 && KEYS == 128 && LATE && DYN), "three consumers: head dim 64, DYN");
    constexpr int NO = D / 8, NB = KEYS / 8, ROWS = FM_ROWS * NC, TILE = KEYS * D;  // bf16 per K or V tile
    // QT: the persistent TMA build also copies each query tile's Q by TMA, into one of two Q
    // buffers, when the producer reaches that tile (a few key tiles before the consumers do), so
    // the consumers load Q from shared memory instead of waiting on global loads at every tile.
    // At head dim 128 the three K/V stages and the O tiles leave no room for two Q tiles (v38 made
    // room with two stages and lost 3–23%: kernels/README.md).
    constexpr bool QT = TMA && PERSIST && D == 64;
    constexpr bool QSS = QT && NC == 3;  // Q·Kᵀ with Q from its shared tile (wg_qk_ss)
    extern __shared__ __align__(1024) unsigned char fm_smem[];  // swizzled tiles: 1024-byte aligned
    // S stages of (K, V), with QT two Q tiles (ROWS × D), then 16 slots of 8 bytes (the mbarriers
    // and DYN's tile indices), then the O tiles.
    bf16_t* stage = reinterpret_cast<bf16_t*>(fm_smem);
    bf16_t* qbuf = stage + S * 2 * TILE;
    u64* full = reinterpret_cast<u64*>(qbuf + (QT ? 2 * ROWS * D : 0));
    u64* empty = full + S;
    u64* qfull = empty + S;  // QT: Q buffer landed (2), consumers done with it (2)
    u64* qempty = qfull + 2;
    u64* tfull = qempty + 2;  // DYN: tile index written (2), consumers have read it (2)
    u64* tempty = tfull + 2;
    volatile long* tix = reinterpret_cast<volatile long*>(tempty + 2);  // DYN: the two index slots
    static_assert(2 * S + 10 <= 16, "the host reserves 16 slots");
    bf16_t* o_tiles = reinterpret_cast<bf16_t*>(full + 16);  // NC × 64 × (D + 8), for fwd_store_staged
    // PERSIST's grid: G blocks walking bh (batch × heads) × tiles query tiles; else one block per
    // query tile, tiles fastest.
    const long tiles = (t + ROWS - 1) / ROWS, ntiles = tiles * bh;
    const long G = gridDim.x, rounds = PERSIST ? (ntiles + G - 1) / G : 1;
    // The query tile of index u: (tile index, head, batch), keys [jb, je), steps.
    long qt, h, b, i0, jb, je, steps;
    auto decode = [&](long u) {
        if (DYN) {
            // Groups of hg heads (the last may be smaller); in a group, every head's last query
            // tile (the most keys under a causal mask) first.
            const long gt = hg * tiles, grp = u / gt, r = u - grp * gt, gsz = lmin(hg, bh - grp * hg);
            const long hh = grp * hg + r % gsz;
            qt = tiles - 1 - r / gsz;
            h = hh % hq;
            b = hh / hq;
        } else if (PERSIST) {
            qt = tiles - 1 - u / bh;  // all heads' last query tiles first
            h = (u % bh) % hq;
            b = (u % bh) / hq;
        } else {
            // Within a head, the last query tiles start first.
            qt = tiles - 1 - u % tiles;
            h = (u / tiles) % hq;
            b = u / (tiles * hq);
        }
        i0 = NC == 3 && causal ? t - (tiles - qt) * ROWS : qt * ROWS;
        key_range(i0, lmin(t, i0 + ROWS) - 1, sl, causal, window, KEYS, &jb, &je);
        if constexpr (DOCS) doc_key_range(docs, b, t, lmax(i0, 0), KEYS, &jb);
        steps = je > jb ? (je - jb + KEYS - 1) / KEYS : 0;
    };
    // The static walks: this block's tile in round j (persistent: k, 2G − 1 − k, 2G + k, …; else
    // its own), false past the last.
    auto pick = [&](long j) -> bool {
        const long u = PERSIST ? j * G + ((j & 1) ? G - 1 - blockIdx.x : blockIdx.x) : blockIdx.x;
        if (j >= rounds || u >= ntiles) return false;
        decode(u);
        return true;
    };
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3, wg = warp >> 2;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) { mbar_init(&full[s], TMA ? 1 : 128); mbar_init(&empty[s], NC * 128); }
        for (int s = 0; s < 2; s++) { mbar_init(&qfull[s], 1); mbar_init(&qempty[s], NC * 128); }
        for (int s = 0; s < 2; s++) { mbar_init(&tfull[s], 1); mbar_init(&tempty[s], NC * 128); }
    }
    __syncthreads();  // the only block-wide barrier
    // Registers: the pool is what the block was launched with, 384 · 168 = 64512 (168: 65536 / 384
    // rounded down to a multiple of 8), so 40 + 2 · 232 = 504 per thread slot; asking for more
    // than the pool (32 + 2 · 240 = 512) left the consumers waiting forever (H200, 2026-11-30).
    // NC = 3: 512 · 128 = 65536, so 32 + 3 · 160 = 512.
    if (wg == NC) {
        wg_reg_dealloc<NC == 2 ? 40 : 32>();
        // The producer warpgroup copies key tile n (counted over the block's query tiles) into
        // stage n % S once the consumers have released the tile that stage held.
        if (TMA && threadIdx.x != NC * 128) return;  // one thread copies
        u32 n = 0;
        for (long j = 0;; j++) {
            if constexpr (DYN) {
                const long u = (long)atomicAdd(sched, 1u);
                const int ts = (int)(j & 1);
                if (j >= 2) mbar_wait(&tempty[ts], ((j >> 1) - 1) & 1);
                tix[ts] = u < ntiles ? u : -1;
                mbar_arrive(&tfull[ts]);  // release: the consumers' wait sees the index
                if (u >= ntiles) break;
                decode(u);
            } else if (!pick(j)) {
                break;
            }
            const Place kp = kv_place(h / (hq / hkv), hq, hkv, fused);
            if constexpr (QT) {
                // Q of this tile into buffer j % 2, once the consumers have read tile j − 2's.
                const int qs = (int)(j & 1);
                if (j >= 2) mbar_wait(&qempty[qs], ((j >> 1) - 1) & 1);
                mbar_expect_tx(&qfull[qs], ROWS * D * 2);
                const Place qp = q_place(h, hq, hkv, fused);
                #pragma unroll
                for (int cb = 0; cb < D / 64; cb++)
                    tma_load_4d(qbuf + qs * ROWS * D + cb * ROWS * 64, qm, cb * 64, (int)qp.head, (int)i0, (int)b,
                                &qfull[qs]);
            }
            // Key tile it of this query tile into stage n % S.
            auto copy = [&](long it) {
                int st = n % S;
                if (n >= S) mbar_wait(&empty[st], ((n / S) - 1) & 1);
                bf16_t* kt = stage + st * 2 * TILE;
                if constexpr (TMA) {
                    mbar_expect_tx(&full[st], 2 * TILE * 2);
                    const int row = (int)(jb + it * KEYS);
                    #pragma unroll
                    for (int cb = 0; cb < D / 64; cb++) {
                        tma_load_4d(kt + cb * KEYS * 64, km, cb * 64, (int)kp.head, row, (int)b, &full[st]);
                        tma_load_4d(kt + TILE + cb * KEYS * 64, vm, cb * 64, (int)kp.head, row, (int)b, &full[st]);
                    }
                    return;
                }
                tile_async_sw<D, KEYS, 128>(kt, k, jb + it * KEYS, sl, b, kp.heads, kp.head, threadIdx.x & 127);
                tile_async_sw<D, KEYS, 128>(kt + TILE, v, jb + it * KEYS, sl, b, kp.heads, kp.head, threadIdx.x & 127);
                cp_arrive(&full[st]);
            };
            for (long it = 0; it < steps; it++, n++) copy(it);
        }
        if (!TMA) cp_wait<0>();
        if constexpr (DYN) {
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
    wg_reg_alloc<NC == 2 ? 232 : 160>();
    u32 base = 0;  // the stage ring's position at this tile's first key tile
    for (long j = 0;; j++) {
        if constexpr (DYN) {
            const int ts = (int)(j & 1);
            mbar_wait(&tfull[ts], (j >> 1) & 1);
            const long u = tix[ts];
            mbar_arrive(&tempty[ts]);
            if (u < 0) break;
            decode(u);
        } else if (!pick(j)) {
            break;
        }
        // A consumer warpgroup: rows r[0][0] and r[0][1] of this thread, Q as A fragments.
        long r[1][2];
        r[0][0] = i0 + warp * 16 + g;
        r[0][1] = r[0][0] + 8;
        u32 qa[QSS ? 1 : D / 16][4];
        u32 qaddr = 0;  // QSS: this warpgroup's first row of its Q tile
        if constexpr (QSS) {
            mbar_wait(&qfull[j & 1], (j >> 1) & 1);
            qaddr = smem_addr(qbuf + (j & 1) * ROWS * D) + wg * 64 * 128;
        } else if constexpr (QT) {
            // From the swizzled Q tile (rows past t zero-filled): lane l gives row (l & 7) of 8 × 8
            // matrix l >> 3 (rows +8 for matrices 1 and 3, columns +8 for 2 and 3), the A fragment.
            const int qs = (int)(j & 1), mi = lane >> 3;
            mbar_wait(&qfull[qs], (j >> 1) & 1);
            const int row = wg * 64 + (warp & 3) * 16 + (lane & 7) + (mi & 1) * 8;
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                ldsm_x4(qa[kk], qbuf + qs * ROWS * D + sw_offset(row, kk * 2 + (mi >> 1), ROWS));
            mbar_arrive(&qempty[qs]);
        } else {
            const Place qp = q_place(h, hq, hkv, fused);
            auto qword = [&](long row, int col) -> u32 {
                return row < t ? *reinterpret_cast<const u32*>(q + ((b * t + row) * qp.heads + qp.head) * D + col) : 0u;
            };
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                qa[kk][0] = qword(r[0][0], kk * 16 + tg * 2);
                qa[kk][1] = qword(r[0][1], kk * 16 + tg * 2);
                qa[kk][2] = qword(r[0][0], kk * 16 + 8 + tg * 2);
                qa[kk][3] = qword(r[0][1], kk * 16 + 8 + tg * 2);
            }
        }
        float acc[1][NO][4];
        float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.f, 0.f}};
        #pragma unroll
        for (int n = 0; n < NO; n++) for (int e = 0; e < 4; e++) acc[0][n][e] = 0.f;
        const float scale2 = scale * LOG2E;
        float s[1][NB][4];
        u32 pa[1][NB / 2][4];  // P as A fragments (bf16)
        u32 pn[1][NB / 2][4];
        // Turns: warpgroup w waits on named barrier 1 + w and passes the turn to the next one; the
        // last passes the first its first turn, and not after its last turn (every barrier then
        // sees as many arrivals as waits).
        const int mine = 1 + wg, next = 1 + (wg + 1) % NC;
        if (steps > 0 && wg == NC - 1) named_arrive(1, 256);
        // Turn bt: S = Q Kᵀ of tile bt (qk) and O += P V of tile bt − 1 (pv); `unmasked`: tile bt
        // needs no mask. The first turn has no P V, the last no Q Kᵀ; both are peeled off the loop
        // so that no wgmma sits on a branch (ptxas would serialise them all). Nor may a branch run
        // while P V is in flight (ptxas waits for it there), so the loop's turns get `unmasked` as
        // a constant: the tiles that need no mask in one loop, the rest in another. `dm` (DOCS): the
        // document masks too (`doc_mask`), likewise a constant in the loops.
        auto turn = [&](long bt, bool pv, bool qk, bool unmasked, bool dm) {
            const u32 ub = base + (u32)bt;  // stage arithmetic in 32 bits (a 64-bit % 3 is ~15 instructions)
            const bf16_t* kv_prev = stage + ((ub + S - 1) % S) * 2 * TILE;
            const bf16_t* kv_cur = stage + (ub % S) * 2 * TILE;
            if (qk) {
                mbar_wait(&full[ub % S], (ub / S) & 1);
                fence_async_smem();
            }
            named_sync(mine, 256);
            wg_pin<KEYS / 2>(&s[0][0][0]);
            wg_pin<D / 2>(&acc[0][0][0]);
            wg_fence();
            if (qk) {
                if constexpr (QSS) wg_qk_ss<D>(s[0], qaddr, ROWS, kv_cur); else wg_qk<D, KEYS, true>(s[0], qa, kv_cur);
                wg_commit();
            }
            if (pv) {
                wg_pv<D, KEYS>(acc[0], pa[0], kv_prev + TILE);
                wg_commit();
            }
            if (!(wg == NC - 1 && !qk)) named_arrive(next, 256);
            float corr[1][2];
            bool moved = true;
            if (qk) {
                if (pv) wg_wait<1>(); else wg_wait<0>();  // the groups finish in order: S first
                wg_pin<KEYS / 2>(&s[0][0][0]);
                long j0 = jb + bt * KEYS;
                if (DOCS && dm) doc_mask<1, NB>(s, r, docs, b, t, j0);
                // LATE: P stays in s (fp32) until the product that reads pa is done, then goes into
                // pa; else it is packed into pn here and copied.
                if constexpr (LATE) {
                    moved = softmax_tile<1, NB, false, true>(s, m, l, corr, pa, unmasked, r, j0, t, sl, causal, window, scale2);
                    if constexpr (DROP)
                        drop_frag<false, NB>(dr, drop_tile(dr, b, h, r[0][0] >> 4, j0 >> 4, t, sl), 32, g, tg,
                                             [&](int nb, int e, float mul) { s[0][nb][e] *= mul; });
                } else
                    moved = softmax_tile<1, NB>(s, m, l, corr, pn, unmasked, r, j0, t, sl, causal, window, scale2);
            }
            if (pv) {
                wg_wait<0>();
                wg_pin<D / 2>(&acc[0][0][0]);
                wg_keep<KEYS / 4>(&pa[0][0][0]);
                mbar_arrive(&empty[(ub + S - 1) % S]);  // tile bt − 1 done
            }
            if (qk) {
                if (moved) {
                    #pragma unroll
                    for (int n = 0; n < NO; n++) {
                        acc[0][n][0] *= corr[0][0]; acc[0][n][1] *= corr[0][0];
                        acc[0][n][2] *= corr[0][1]; acc[0][n][3] *= corr[0][1];
                    }
                }
                if constexpr (LATE) {
                    #pragma unroll
                    for (int kstep = 0; kstep < NB / 2; kstep++) c_to_a(pa[0][kstep], s[0], kstep);
                } else {
                    #pragma unroll
                    for (int x = 0; x < NB / 2; x++) for (int y = 0; y < 4; y++) pa[0][x][y] = pn[0][x][y];
                }
            }
        };
        if (steps > 0) {
            // DOCS: tiles [0, nc) hold keys before the block's last row's document start (flash.cu
            // `doc_cuts`: the starts never decrease), so they take the document masks.
            long nc = 0;
            if constexpr (DOCS) nc = lmax(0, lmin(steps, ((long)docs[b * t + lmin(t, i0 + ROWS) - 1] - jb + KEYS - 1) / KEYS));
            turn(0, false, true, nc == 0 && i0 >= 0 && tile_full(i0, ROWS, jb, KEYS, t, sl, causal, window), nc > 0);
            // Tiles [0, nf) need no mask: without a window, every key tile that ends inside the
            // sequence and (causal) at or before the block's first row.
            long nf = 0;
            if (window == 0 && i0 >= 0 && i0 + ROWS <= t) nf = lmin(steps, ((causal ? lmin(sl, i0 + 1) : sl) - jb) / KEYS);
            long bt = 1;
            if constexpr (DOCS) for (; bt < nc; bt++) turn(bt, true, true, false, true);
            for (; bt < nf; bt++) turn(bt, true, true, true, false);
            for (; bt < steps; bt++) turn(bt, true, true, false, false);
            turn(steps, true, false, false, false);  // waits for every product: Q is read
        }
        if constexpr (QSS) mbar_arrive(&qempty[j & 1]);
        fwd_store_staged<D>(acc, m, l, r, o_tiles + wg * 64 * (D + 8), NC + 1 + wg, i0 + wg * 64, o, lse, t, hq, b, h);
        if (PERSIST) named_sync(NC + 1 + wg, 128);  // the O tile read out before the next tile writes it
        base += (u32)steps;
    }
}

// Query rows per block: FM_ROWS · MT · NW, threads 128 · NW (the host's `fwd_kernel` must agree).
// `docs` (document masks, or null) after `fused`: these builds and the dropout ones below take
// the masked calls the warp-specialised `_docs` build below does not (dropout, head dim 192, the
// warp-specialised kernels off).
// At head dim 64 both: two m-tiles per warp win from 2k tokens on, one (more, smaller blocks, less
// work on the causal diagonal) below. The wgmma kernels (sm_90a), flash_fwd_wgNW_bf16_D, take 64
// rows per warpgroup; NW is bounded by the registers (NW · 128 threads share 64k).
#define FLASH_MMA(NAME, D, MT, WG, NW) \
extern "C" __global__ void __launch_bounds__(128 * NW) NAME(const bf16_t* q, const bf16_t* k, \
        const bf16_t* v, bf16_t* o, float* lse, long t, long sl, long hq, long hkv, long d, float scale, long causal, \
        long window, long fused, const u32* docs) { \
    flash_fwd_mma<D, MT, WG, NW>(q, k, v, o, lse, t, sl, hq, hkv, scale, causal, window, fused, docs, AttnDrop{}); }
// With attention dropout (`_drop`, the key last): one m-tile per warp, NW 2 with wgmma.
#define FLASH_MMA_DROP(NAME, D, WG, NW) \
extern "C" __global__ void __launch_bounds__(128 * NW) NAME(const bf16_t* q, const bf16_t* k, \
        const bf16_t* v, bf16_t* o, float* lse, long t, long sl, long hq, long hkv, long d, float scale, long causal, \
        long window, long fused, const u32* docs, AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    flash_fwd_mma<D, 1, WG, NW, true>(q, k, v, o, lse, t, sl, hq, hkv, scale, causal, window, fused, docs, dr); }
FLASH_MMA_DROP(flash_fwd_mma_drop_bf16_64, 64, false, 1)
FLASH_MMA_DROP(flash_fwd_mma_drop_bf16_128, 128, false, 1)
FLASH_MMA_DROP(flash_fwd_mma_drop_bf16_192, 192, false, 1)
FLASH_MMA_DROP(flash_fwd_wg2_drop_bf16_64, 64, true, 2)
FLASH_MMA_DROP(flash_fwd_wg2_drop_bf16_128, 128, true, 2)
FLASH_MMA_DROP(flash_fwd_wg2_drop_bf16_192, 192, true, 2)
FLASH_MMA(flash_fwd_mma_bf16_64, 64, 1, false, 1)
FLASH_MMA(flash_fwd_mma_bf16_64x2, 64, 2, false, 1)
FLASH_MMA(flash_fwd_mma_bf16_128, 128, 1, false, 1)
// Head dim 192 (multi-latent attention: DeepSeek-V2/V3's 128 + 64 rotary columns, V padded to
// them), one m-tile per warp (Q's fragments, 48 registers, and O, 96, leave no room for two), and
// on wgmma two warpgroups in lockstep (not the warp-specialised kernel: its consumers' registers).
FLASH_MMA(flash_fwd_mma_bf16_192, 192, 1, false, 1)
FLASH_MMA(flash_fwd_wg2_bf16_192, 192, 1, true, 2)
// Measured on the H200 (16k tokens per call, causal; lab notes in README.md): NW = 1 was L2-bound;
// D 64: NW 2 > 4 > 1; D 128: NW 3 from 2k rows on, NW 2 at 1k.
FLASH_MMA(flash_fwd_wg2_bf16_64, 64, 1, true, 2)
FLASH_MMA(flash_fwd_wg2_bf16_128, 128, 1, true, 2)
FLASH_MMA(flash_fwd_wg3_bf16_128, 128, 1, true, 3)
// The warp-specialised forward (flash_fwd_ws2[t][p[d]]k128_bf16_D; 64-key tiles without `k128`):
// two consumer warpgroups (128 rows) and a producer warpgroup; FW_STAGES · 2 · KEYS · D · 2 bytes
// of K/V tiles, the persistent TMA build's two Q tiles at head dim 64 (2 · 128 · D · 2), 16 slots
// of 8 bytes (mbarriers, tile indices), then the consumers' O tiles (2 · 64 · (D + 8) · 2 bytes;
// the host's `fwd_kernel` must agree). At head dim 128 with 128-key tiles a consumer holds S (64 registers), P in flight (32),
// O (64) and Q (32): LATE keeps the next P in S's registers until the product reading the last
// one is done (ptxas: no spill in 232).
// Grid: bh (batch × heads) × query tiles, or with PERSIST (the `p` kernels) at most one block
// per SM. `t`: K and V (and, persistent at head dim 64, Q) copied by TMA. `hg` and `sched` (a
// zeroed pair of counters the kernel leaves zeroed) are read by the dynamic walk only.
#define FLASH_WS(NAME, D, KEYS, LATE, PERSIST, TMA, DYN, S, NC) \
extern "C" __global__ void __launch_bounds__(128 * (NC + 1), 1) NAME(const bf16_t* q, \
        const bf16_t* k, const bf16_t* v, bf16_t* o, float* lse, long t, long sl, long hq, long hkv, long d, \
        float scale, long causal, long window, long fused, long bh, const __grid_constant__ TmaMap km, \
        const __grid_constant__ TmaMap vm, const __grid_constant__ TmaMap qm, long hg, u32* sched) { \
    flash_fwd_ws<D, KEYS, LATE, PERSIST, TMA, DYN, S, NC>(q, k, v, o, lse, t, sl, hq, hkv, scale, causal, window, \
                                                          fused, bh, &km, &vm, &qm, hg, sched, AttnDrop{}); }
// With attention dropout (`_drop`, the key last): two consumers, P kept in fp32 (LATE).
#define FLASH_WS_DROP(NAME, D) \
extern "C" __global__ void __launch_bounds__(384, 1) NAME(const bf16_t* q, \
        const bf16_t* k, const bf16_t* v, bf16_t* o, float* lse, long t, long sl, long hq, long hkv, long d, \
        float scale, long causal, long window, long fused, long bh, const __grid_constant__ TmaMap km, \
        const __grid_constant__ TmaMap vm, const __grid_constant__ TmaMap qm, long hg, u32* sched, AttnDrop dr0) { \
    const AttnDrop dr = drop_shifted(dr0); \
    flash_fwd_ws<D, 128, true, true, true, true, FW_STAGES, 2, true>(q, k, v, o, lse, t, sl, hq, hkv, scale, causal, \
                                                                     window, fused, bh, &km, &vm, &qm, hg, sched, dr); }
FLASH_WS(flash_fwd_ws2k128_bf16_128, 128, 128, true, false, false, false, FW_STAGES, 2)
FLASH_WS(flash_fwd_ws2k128_bf16_64, 64, 128, false, false, false, false, FW_STAGES, 2)
FLASH_WS(flash_fwd_ws2pk128_bf16_64, 64, 128, false, true, false, false, FW_STAGES, 2)
// The same with TMA copies (`t`), the default.
FLASH_WS(flash_fwd_ws2tk128_bf16_128, 128, 128, true, false, true, false, FW_STAGES, 2)
FLASH_WS(flash_fwd_ws2tk128_bf16_64, 64, 128, false, false, true, false, FW_STAGES, 2)
FLASH_WS(flash_fwd_ws2tpk128_bf16_64, 64, 128, false, true, true, false, FW_STAGES, 2)
// Persistent with the dynamic walk (`d`: tiles by a global counter, in head groups that share L2).
FLASH_WS(flash_fwd_ws2tpdk128_bf16_64, 64, 128, false, true, true, true, FW_STAGES, 2)
FLASH_WS(flash_fwd_ws2tpdk128_bf16_128, 128, 128, true, true, true, true, FW_STAGES, 2)
// Three consumer warpgroups, 192 query rows a tile (`ws3`; `FERROTRON_FLASH_FWD_WARPGROUPS=3`).
FLASH_WS(flash_fwd_ws3tpdk128_bf16_64, 64, 128, true, true, true, true, FW_STAGES, 3)
// The dynamic walk with attention dropout.
FLASH_WS_DROP(flash_fwd_ws2tpdk128_drop_bf16_64, 64)
FLASH_WS_DROP(flash_fwd_ws2tpdk128_drop_bf16_128, 128)
// The dynamic walk with document masks (`_docs`, the starts last; flash.cu `doc_key_range`):
// two consumers at both head dims.
#define FLASH_WS_DOCS(NAME, D, LATE) \
extern "C" __global__ void __launch_bounds__(384, 1) NAME(const bf16_t* q, \
        const bf16_t* k, const bf16_t* v, bf16_t* o, float* lse, long t, long sl, long hq, long hkv, long d, \
        float scale, long causal, long window, long fused, long bh, const __grid_constant__ TmaMap km, \
        const __grid_constant__ TmaMap vm, const __grid_constant__ TmaMap qm, long hg, u32* sched, const u32* docs) { \
    flash_fwd_ws<D, 128, LATE, true, true, true, FW_STAGES, 2, false, true>(q, k, v, o, lse, t, sl, hq, hkv, scale, \
                                                                         causal, window, fused, bh, &km, &vm, &qm, hg, \
                                                                         sched, AttnDrop{}, docs); }
FLASH_WS_DOCS(flash_fwd_ws2tpdk128_docs_bf16_64, 64, false)
FLASH_WS_DOCS(flash_fwd_ws2tpdk128_docs_bf16_128, 128, true)
// 64-key tiles (`FERROTRON_FLASH_FWD=ws64`, kept to measure against).
FLASH_WS(flash_fwd_ws2_bf16_128, 128, 64, true, false, false, false, FW_STAGES, 2)
FLASH_WS(flash_fwd_ws2t_bf16_128, 128, 64, true, false, true, false, FW_STAGES, 2)
FLASH_WS(flash_fwd_ws2_bf16_64, 64, 64, false, false, false, false, FW_STAGES, 2)
