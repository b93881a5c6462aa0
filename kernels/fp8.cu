// FP8 quantization with one scale per tensor (Transformer Engine's current scaling, Megatron's
// `--fp8-recipe tensorwise`): amax = max |x| (NaN when any x is NaN), scale = fp8_max / amax (1
// where amax is 0 or inf, FLT_MAX where the quotient overflows), q = satfinite_rn(x · scale),
// scale_inv = 1 / scale. Every step is one IEEE-rounded f32 operation, as the CPU reference
// (kernels/src/fp8.rs) does them, so both give the same bytes.
//
// Two launches: `fp8_amax_*` into a zeroed u32 (|x|'s bits: non-negative floats order as their
// bit patterns and NaN above +inf, so an integer max keeps NaN), then `fp8_cast_*` over 32×32
// tiles writing q [rows, cols] and qᵀ [cols, rows], each where its pointer is not null (the operand layout
// FP8 GEMMs need for the backward's products: cuBLASLt takes FP8 only as TN).
//
// Delayed scaling (Megatron's `--fp8-recipe delayed`) passes the scale (`given`) instead: one
// launch of `fp8_cast_*`, which also maxes |x|'s bits into `amax` (an amax history's row-0 slot,
// where not null) and writes the scale beside scale_inv ([1 / scale, scale]) for the backward.
// `fp8_delayed_update` then moves each slot's history on after a pass (Transformer Engine's
// rule: the scale from the history's max or its newest amax, kept where that is 0 or not
// finite; the history rolled one place, row 0 cleared for the next pass).

__device__ __forceinline__ u32 abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }
__device__ __forceinline__ u32 umax32(u32 a, u32 b) { return a > b ? a : b; }

// A warp's largest |x| bits maxed into `amax` by its first lane (every kernel here ends its
// amax this way: one atomic a warp, none where the warp saw only zeros).
__device__ __forceinline__ void warp_amax_into(u32* amax, u32 m) {
    for (int o = 16; o > 0; o >>= 1) m = umax32(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0 && m) atomicMax(amax, m);
}

// The cast's scale handles, written once a launch: [1 / scale], or [1 / scale, scale] where the
// scale was given (delayed scaling keeps it for the backward).
__device__ __forceinline__ void store_scale_inv(float* scale_inv, float sc, bool given) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        scale_inv[0] = __frcp_rn(sc);
        if (given) scale_inv[1] = sc;
    }
}

#define FP8_AMAX(s, T)                                                                          \
extern "C" __global__ void fp8_amax_##s(const T* x, u32* amax, long n) {                        \
    u32 m = 0;                                                                                  \
    GRID_STRIDE(i, n) m = umax32(m, abs_bits(ld(x, i)));                                           \
    warp_amax_into(amax, m);                                                                    \
}
FP8_AMAX(f32, float)
FP8_AMAX(bf16, bf16_t)

__device__ __forceinline__ float fp8_scale(const u32* amax, float fmax) {
    float a = __uint_as_float(*amax);
    if (a == 0.f || a == INFINITY) return 1.f;
    float s = __fdiv_rn(fmax, a);  // NaN for a NaN amax
    return s == INFINITY ? 3.4028234663852886e38f : s;
}

// One value to FP8 by the hardware's round-to-nearest-even with saturation to the largest finite
// value (NaN stays NaN): sm_89 and later; the host refuses FP8 on older devices.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define TO_FP8(f)                                                                                  \
__device__ __forceinline__ unsigned char to_##f(float v) {                                         \
    unsigned short r;                                                                             \
    asm("cvt.rn.satfinite." #f "x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(v));                 \
    return (unsigned char)(r & 0xff);                                                             \
}
#else
#define TO_FP8(f)                                                                                  \
__device__ __forceinline__ unsigned char to_##f(float) { __trap(); return 0; }
#endif
TO_FP8(e4m3)
TO_FP8(e5m2)

// Blocks of 256 threads (8 warps), one 32×32 tile each, the tiles in row-major order.
#define FP8_CAST(s, T, f, FMAX)                                                                           \
extern "C" __global__ void fp8_cast_##s##_##f(const T* x, u32* amax, const float* given, unsigned char* q,  \
                                              unsigned char* qt, float* scale_inv, long rows, long cols) { \
    __shared__ unsigned char tile[32][33];                                                                \
    float sc = given ? *given : fp8_scale(amax, FMAX);                                                    \
    long tiles_c = (cols + 31) / 32;                                                                      \
    long r0 = (long)blockIdx.x / tiles_c * 32, c0 = (long)blockIdx.x % tiles_c * 32;                      \
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;                                                     \
    u32 m = 0;                                                                                            \
    for (int j = ty; j < 32; j += 8) {                                                                    \
        long r = r0 + j, c = c0 + tx;                                                                     \
        if (r < rows && c < cols) {                                                                       \
            float xv = ld(x, r * cols + c);                                                               \
            m = umax32(m, abs_bits(xv));                                                                  \
            unsigned char v = to_##f(__fmul_rn(xv, sc));                                                  \
            if (q) q[r * cols + c] = v;                                                                   \
            tile[j][tx] = v;                                                                              \
        }                                                                                                 \
    }                                                                                                     \
    if (given && amax) warp_amax_into(amax, m);                                                           \
    store_scale_inv(scale_inv, sc, given);                                                                \
    if (!qt) return;                                                                                      \
    __syncthreads();                                                                                      \
    for (int j = ty; j < 32; j += 8) {                                                                    \
        long c = c0 + j, r = r0 + tx;                                                                     \
        if (r < rows && c < cols) qt[c * rows + r] = tile[tx][j];                                         \
    }                                                                                                     \
}
FP8_CAST(f32, float, e4m3, 448.f)
FP8_CAST(bf16, bf16_t, e4m3, 448.f)
FP8_CAST(f32, float, e5m2, 57344.f)
FP8_CAST(bf16, bf16_t, e5m2, 57344.f)

// Two values to FP8 in one instruction: lo in the low byte, as two `to_*` calls would give.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define TO_FP8X2(f)                                                                                \
__device__ __forceinline__ u32 to2_##f(float lo, float hi) {                                       \
    unsigned short r;                                                                             \
    asm("cvt.rn.satfinite." #f "x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));                 \
    return r;                                                                                     \
}
#else
#define TO_FP8X2(f)                                                                                \
__device__ __forceinline__ u32 to2_##f(float, float) { __trap(); return 0; }
#endif
TO_FP8X2(e4m3)
TO_FP8X2(e5m2)

// `fp8_cast_*` with wide accesses (the host's choice where cols % 8 == 0, rows % 16 == 0 and x,
// q, qt sit on 16-byte boundaries): 64 × 64 tiles, each thread two groups of eight columns
// (16-byte loads of bf16, 8-byte stores of q) and one 16-row run of a column of qᵀ (a 16-byte
// store; four threads write a column's 64 contiguous bytes). Why: the 32 × 32 kernel moves one
// or two bytes an access. The tile sits in shared memory column by column (68 bytes apart: the
// byte stores of a warp's eight column groups fall in four banks, the 16-byte reads in whole
// words). Same values, same scale rule, same amax as `fp8_cast_*`.
//
// The activation's builds (M) spare the bf16 round trips beside an MLP's FP8 products. `_gelu`
// (M 1) takes a GeLU's input h as x and quantizes gelu(h) as `gelu_fwd_*` stores it (rounded to
// T first): fc2's input, never written. `_dgelu` (M 2) takes fc2's input gradient as x and h
// and quantizes dh = x · gelu'(h) as `gelu_bwd_*` stores it: fc1's output gradient, never
// written either; where `part` is not null it also stores dh's column sums over the tile's 64
// rows as `part` [ceil(rows / 64), cols] (fc1's bias gradient's first pass, the chunks of
// `col_sum_f32`): each warp's rows by shuffles, then the eight warps' in order. `_swiglu` (M 3)
// takes a SwiGLU's input as x, rows of 2 · cols (gate half, then value half), and quantizes
// silu(gate) · value as `swiglu_fwd_*` stores it.
#define FP8_CAST64(s, T, f, FMAX, SUF, M)                                                                   \
extern "C" __global__ void __launch_bounds__(256) fp8_cast64##SUF##_##s##_##f(const T* x, const T* h, u32* amax, \
        const float* given, unsigned char* q, unsigned char* qt, float* scale_inv, float* part, long rows, long cols) { \
    __shared__ __align__(16) unsigned char tile[64 * 68];                                                    \
    __shared__ float wsum[M == 2 ? 8 * 64 : 1];                                                              \
    const float sc = given ? *given : fp8_scale(amax, FMAX);                                                 \
    const long tiles_c = (cols + 63) / 64;                                                                   \
    const long r0 = (long)blockIdx.x / tiles_c * 64, c0 = (long)blockIdx.x % tiles_c * 64;                   \
    const int cg = threadIdx.x & 7, rr = threadIdx.x >> 3;                                                   \
    u32 m = 0;                                                                                               \
    float cs[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};                                                  \
    _Pragma("unroll") for (int i = 0; i < 2; i++) {                                                          \
        const int lr = rr + 32 * i;                                                                          \
        const long r = r0 + lr, c = c0 + cg * 8;                                                             \
        if (r < rows && c < cols) {                                                                          \
            float v[8];                                                                                      \
            if (M == 3) {                                                                                    \
                float g[8];                                                                                  \
                ld8(x, r * 2 * cols + c, g);                                                                 \
                ld8(x, r * 2 * cols + cols + c, v);                                                          \
                _Pragma("unroll") for (int e = 0; e < 8; e++) v[e] = as_stored(x, silu_f(g[e]) * v[e]);      \
            } else {                                                                                         \
                ld8(x, r * cols + c, v);                                                                     \
            }                                                                                                \
            if (M == 1) _Pragma("unroll") for (int e = 0; e < 8; e++) v[e] = as_stored(x, gelu_f(v[e]));     \
            if (M == 2) {                                                                                    \
                float g[8];                                                                                  \
                ld8(h, r * cols + c, g);                                                                     \
                _Pragma("unroll") for (int e = 0; e < 8; e++) {                                              \
                    v[e] = as_stored(x, v[e] * gelu_g(g[e]));                                                \
                    cs[e] += v[e];                                                                           \
                }                                                                                            \
            }                                                                                                \
            u32 w[4];                                                                                        \
            _Pragma("unroll") for (int e = 0; e < 8; e += 2) {                                               \
                m = umax32(m, umax32(abs_bits(v[e]), abs_bits(v[e + 1])));                                   \
                const u32 p = to2_##f(__fmul_rn(v[e], sc), __fmul_rn(v[e + 1], sc));                         \
                w[e / 2] = p;                                                                                \
                tile[(cg * 8 + e) * 68 + lr] = (unsigned char)(p & 0xff);                                    \
                tile[(cg * 8 + e + 1) * 68 + lr] = (unsigned char)(p >> 8);                                  \
            }                                                                                                \
            if (q) *(uint2*)(q + r * cols + c) = make_uint2(w[0] | w[1] << 16, w[2] | w[3] << 16);           \
        }                                                                                                    \
    }                                                                                                        \
    if (given && amax) warp_amax_into(amax, m);                                                              \
    store_scale_inv(scale_inv, sc, given);                                                                   \
    if (M == 2 && part) {                                                                                    \
        /* A warp's lanes with one column group (lane & 7) hold its four row pairs. */                       \
        _Pragma("unroll") for (int e = 0; e < 8; e++) {                                                      \
            cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], 8);                                                 \
            cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], 16);                                                \
        }                                                                                                    \
        if ((threadIdx.x & 31) < 8)                                                                          \
            _Pragma("unroll") for (int e = 0; e < 8; e++) wsum[(threadIdx.x >> 5) * 64 + cg * 8 + e] = cs[e]; \
        __syncthreads();                                                                                     \
        if (threadIdx.x < 64 && c0 + threadIdx.x < cols) {                                                   \
            float t = 0.f;                                                                                   \
            for (int u = 0; u < 8; u++) t += wsum[u * 64 + threadIdx.x];                                     \
            part[r0 / 64 * cols + c0 + threadIdx.x] = t;                                                     \
        }                                                                                                    \
    }                                                                                                        \
    if (!qt) return;                                                                                         \
    __syncthreads();                                                                                         \
    const int col = threadIdx.x >> 2, rg = threadIdx.x & 3;                                                  \
    const long c = c0 + col, r = r0 + rg * 16;                                                               \
    if (c < cols && r < rows) {                                                                              \
        const u32* sm = reinterpret_cast<const u32*>(tile + col * 68 + rg * 16);                             \
        *(uint4*)(qt + c * rows + r) = make_uint4(sm[0], sm[1], sm[2], sm[3]);                               \
    }                                                                                                        \
}
#define FP8_CAST64_ALL(s, T, f, FMAX) \
    FP8_CAST64(s, T, f, FMAX, , 0) FP8_CAST64(s, T, f, FMAX, _gelu, 1) FP8_CAST64(s, T, f, FMAX, _dgelu, 2) \
    FP8_CAST64(s, T, f, FMAX, _swiglu, 3)
FP8_CAST64_ALL(f32, float, e4m3, 448.f)
FP8_CAST64_ALL(bf16, bf16_t, e4m3, 448.f)
FP8_CAST64_ALL(f32, float, e5m2, 57344.f)
FP8_CAST64_ALL(bf16, bf16_t, e5m2, 57344.f)

// `fp8_amax_*` eight elements a thread (16-byte loads; the host's choice, as for every `_v8`
// twin, where n % 8 == 0 and x is 16-byte aligned).
#define FP8_AMAX8(s, T)                                                                         \
extern "C" __global__ void fp8_amax_##s##_v8(const T* x, u32* amax, long n) {                   \
    u32 m = 0;                                                                                  \
    GRID_STRIDE8(i, n) {                                                                        \
        float v[8];                                                                             \
        ld8(x, i, v);                                                                           \
        _Pragma("unroll") for (int e = 0; e < 8; e++) m = umax32(m, abs_bits(v[e]));            \
    }                                                                                           \
    warp_amax_into(amax, m);                                                                    \
}
FP8_AMAX8(f32, float)
FP8_AMAX8(bf16, bf16_t)

// One thread per history column c in [c0, c1) of hist [len, n] and scale [n]: the header's
// update with scaled_max = fp8_max · 2^-margin, from the history's max (`algo_max`) or row 0.
extern "C" __global__ void fp8_delayed_update(float* hist, float* scale, long len, long n, long c0, long c1,
                                              float scaled_max, long algo_max) {
    long c = c0 + (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= c1) return;
    float cur = hist[c], a = cur;
    if (algo_max)
        for (long i = 1; i < len; i++) a = fmaxf(a, hist[i * n + c]);
    if (isfinite(a) && a > 0.f) {
        float sc = __fdiv_rn(scaled_max, a);
        scale[c] = sc == INFINITY ? 3.4028234663852886e38f : sc;
    }
    if (len > 1) {
        for (long i = 1; i + 1 < len; i++) hist[i * n + c] = hist[(i + 1) * n + c];
        hist[(len - 1) * n + c] = cur;
    }
    hist[c] = 0.f;
}
