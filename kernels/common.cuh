// Shared helpers for every Ferrotron CUDA kernel. Compiled by NVRTC with no system headers:
// bf16 is carried as its 16 raw bits and converted here (round to nearest even, as the CPU does).
typedef unsigned short bf16_t;
typedef unsigned int u32;
// f16 is a distinct struct so that overloads can tell it from bf16; converted with PTX cvt.
struct f16_t { unsigned short bits; };

// Programmatic dependent launch (Hopper): a kernel the host launches with
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda/mod.rs `waits_on_predecessor`
// lists them) may be scheduled while the kernel before it drains; it waits here, before touching
// memory, until that kernel has finished and its writes are visible. Elsewhere a no-op.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// p[0..4] += v[0..4] as relaxed atomics (p 16-byte aligned, global memory): one vector reduction
// on Hopper (`red.global.add.v4.f32`, sm_90), four atomicAdds before it.
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
    atomicAdd(p, a); atomicAdd(p + 1, b); atomicAdd(p + 2, c); atomicAdd(p + 3, d);
#endif
}

__device__ __forceinline__ float ld(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, long i) { return __uint_as_float(((u32)p[i]) << 16); }
__device__ __forceinline__ void st(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t* p, long i, float v) {
    u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) { p[i] = 0x7fc0; return; }  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (bf16_t)(u >> 16);
}

__device__ __forceinline__ float ld(const f16_t* p, long i) {
    float f; unsigned short h = p[i].bits; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ void st(f16_t* p, long i, float v) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); p[i].bits = h;
}

// Two floats as a bf16x2 word: `lo` in the low half (the smaller column). Round to nearest even,
// as `st`.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

struct __align__(16) u128 { u32 x, y, z, w; };

// `v` as a store into `T` would leave it (kernels that write a value and go on computing with it
// use this, so that what they compute matches what a later kernel reads back).
__device__ __forceinline__ float as_stored(const float*, float v) { return v; }
__device__ __forceinline__ float as_stored(const bf16_t*, float v) { return __uint_as_float(pack_bf16(v, 0.f) << 16); }

// Eight elements at a time: one 16-byte access for bf16/f16, two for f32. The `_v8` kernels use
// them; the host picks a `_v8` kernel only when the count divides by 8 and every pointer is
// 16-byte aligned (else the one-element kernel of the same name runs).
__device__ __forceinline__ void ld8(const float* p, long i, float* v) {
    u128 a = *(const u128*)(p + i), b = *(const u128*)(p + i + 4);
    u32 w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = __uint_as_float(w[j]);
}
__device__ __forceinline__ void st8(float* p, long i, const float* v) {
    *(u128*)(p + i) = u128{__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3])};
    *(u128*)(p + i + 4) = u128{__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]), __float_as_uint(v[7])};
}
__device__ __forceinline__ void ld8(const bf16_t* p, long i, float* v) {
    u128 a = *(const u128*)(p + i);
    u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; j++) { v[2 * j] = __uint_as_float(w[j] << 16); v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u); }
}
__device__ __forceinline__ void st8(bf16_t* p, long i, const float* v) {
    *(u128*)(p + i) = u128{pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7])};
}
__device__ __forceinline__ void ld8(const f16_t* p, long i, float* v) {
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = ld(p, i + j);
}
__device__ __forceinline__ void st8(f16_t* p, long i, const float* v) {
#pragma unroll
    for (int j = 0; j < 8; j++) st(p, i + j, v[j]);
}

// 2^x on the special-function unit (relative error about 2^-22; 2^-inf = 0). The attention
// softmaxes and the eight-wide cross-entropy work in base 2 with log2(e) folded into a scale: one
// multiply-add and one ex2 per element.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define GRID_STRIDE(i, n) for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < (long)(n); i += (long)gridDim.x * blockDim.x)
// The same over groups of eight: i is the first element of the group.
#define GRID_STRIDE8(i, n) for (long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < (long)(n); i += (long)gridDim.x * blockDim.x * 8)

// Sum over a warp (butterfly: every lane gets the result).
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    __shared__ float total;
    v = warp_sum(v);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = warp_sum(lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0.f);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

__device__ float block_max(float v) {
    __shared__ float warp_max[32];
    __shared__ float total;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? warp_max[lane] : -INFINITY;
        for (int o = 16; o > 0; o >>= 1) s = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, o));
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// Column sums over many rows (bias and norm parameter gradients) run in two passes: partial sums
// of COL_CHUNK rows each (one thread per chunk and column, reads coalesced along the row), then
// col_sum adds a column's partials in a fixed order: a block of 8 warps per 32 columns, warp w
// summing chunks w, w + 8, ..., then warp 0 the 8 results. Same bits every run. With `acc` the sum
// is added to y (a main_grad view: no separate add pass), else y is overwritten. y is f32 or, for
// a bf16 main_grad (`--grad-reduce-in-bf16`), bf16: the add happens in f32 and rounds once.
#define COL_CHUNK 64
// One block's 32 columns from column block `cb` on: the second pass both kernels below run.
template <typename Y>
__device__ __forceinline__ void col_sum_block(const float* p, Y* y, long chunks, long c, bool add, long cb) {
    __shared__ float part[8][33];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    long j = cb * 32 + lane;
    float s = 0.f;
    if (j < c) for (long k = w; k < chunks; k += 8) s += p[k * c + j];
    part[w][lane] = s;
    __syncthreads();
    if (w == 0 && j < c) {
        float total = 0.f;
        for (int x = 0; x < 8; x++) total += part[x][lane];
        st(y, j, add ? ld(y, j) + total : total);
    }
}

// Up to three column sums' second passes in one launch (a norm backward's weight, bias and
// residual sums: one launch instead of three): block b takes sum b / cb, columns (b % cb) · 32 on,
// cb = ceil(c / 32), each exactly as col_sum (same order, same bits); bit i of `acc` says
// whether sum i adds into its y.
#define COL_SUMS(s, Y) \
extern "C" __global__ void __launch_bounds__(256) col_sum_##s(const float* p, Y* y, long chunks, long c, long acc) { \
    pdl_wait(); \
    col_sum_block(p, y, chunks, c, acc != 0, blockIdx.x); } \
extern "C" __global__ void __launch_bounds__(256) col_sums3_##s(const float* p0, Y* y0, const float* p1, Y* y1, \
                                                               const float* p2, Y* y2, long chunks, long c, long acc) { \
    pdl_wait(); \
    const long cb = (c + 31) / 32, which = blockIdx.x / cb; \
    const float* p = which == 0 ? p0 : which == 1 ? p1 : p2; \
    Y* y = which == 0 ? y0 : which == 1 ? y1 : y2; \
    col_sum_block(p, y, chunks, c, (acc >> which) & 1, blockIdx.x % cb); }
COL_SUMS(f32, float)
COL_SUMS(bf16, bf16_t)

// The first pass of a column sum, eight columns per thread: a block is 8 warps over 256
// columns (32 groups of eight) of one chunk; warp w adds rows r0 + w, r0 + w + 8, … (each load a
// warp issues is one 512-byte run of a row, and a thread's loads are independent, so the whole
// chunk is in flight at once), then warp 0 adds the eight warps' sums in warp order. Grid: chunks
// · ceil(c / 256), chunk-major. Per element, `f(r, j, acc_w, acc_b)` adds row r's eight values at
// column j (c % 8 == 0). (A thread per chunk and column group summing all COL_CHUNK rows in turn
// had 25k threads at c = 768: too few loads in flight to reach the memory's rate.)
template <bool TWO, typename F>
__device__ __forceinline__ void col_partials8(float* pa, float* pb, long rows, long c, F f) {
    __shared__ float sa[8][8][32], sb[TWO ? 8 : 1][8][32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    long groups = (c / 8 + 31) / 32, ch = blockIdx.x / groups, j = ((blockIdx.x % groups) * 32 + lane) * 8;
    long r0 = ch * COL_CHUNK, r1 = r0 + COL_CHUNK < rows ? r0 + COL_CHUNK : rows;
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, b[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (j < c) {
#pragma unroll
        for (int k = 0; k < COL_CHUNK / 8; k++)
            if (long r = r0 + w + 8 * k; r < r1) f(r, j, a, b);
    }
#pragma unroll
    for (int e = 0; e < 8; e++) { sa[w][e][lane] = a[e]; if constexpr (TWO) sb[w][e][lane] = b[e]; }
    __syncthreads();
    if (w != 0 || j >= c) return;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        a[e] = 0.f; b[e] = 0.f;
        for (int x = 0; x < 8; x++) { a[e] += sa[x][e][lane]; if constexpr (TWO) b[e] += sb[x][e][lane]; }
    }
    st8(pa, ch * c + j, a);
    if (pb) st8(pb, ch * c + j, b);
}

// One column's partial over a chunk of COL_CHUNK (64) rows, `v(r)` being row r's value, added in
// col_partials8's order (eight runs r = w, w + 8, …, each from 0, then the runs in order): a
// kernel that already holds the rows (the flash backward's dQ, dK, dV tiles) writes the partial
// the first pass would have, to the bit, so col_sum_f32 finishes it alone.
template <typename F>
__device__ __forceinline__ float col_chunk_sum(F v) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < 8; w++) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < COL_CHUNK / 8; k++) s += v(w + 8 * k);
        total += s;
    }
    return total;
}

// Philox-4x32-R block `blk` of key `seed` and stream `stream`: the four words of counter
// (blk, stream), the rounds and word order of ferrotron_core::rng::Philox::block_rounds, so a mask
// drawn here is the CPU's, bit for bit (dropout: elementwise.cu, 10 rounds; attention's:
// attention.cu `AttnDrop`, 7).
template <int R = 10>
__device__ __forceinline__ uint4 philox4(unsigned long long seed, unsigned long long stream, unsigned long long blk) {
    u32 c0 = (u32)blk, c1 = (u32)(blk >> 32), c2 = (u32)stream, c3 = (u32)(stream >> 32);
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
    for (int round = 0; round < R; round++) {
        if (round > 0) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const u32 h0 = __umulhi(0xD2511F53u, c0), l0 = 0xD2511F53u * c0;
        const u32 h1 = __umulhi(0xCD9E8D57u, c2), l1 = 0xCD9E8D57u * c2;
        const u32 n0 = h1 ^ c1 ^ k0, n2 = h0 ^ c3 ^ k1;
        c0 = n0; c1 = l1; c2 = n2; c3 = l0;
    }
    return make_uint4(c0, c1, c2, c3);
}
__device__ __forceinline__ u32 lane_of(uint4 w, int i) { return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w; }

// Instantiates macro M once per storage type: M(suffix, type).
#define FOR_TYPES(M) M(f32, float) M(bf16, bf16_t)

// The shared-memory address of a generic pointer into shared memory (for ldmatrix, cp.async).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
