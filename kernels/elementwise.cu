// Elementwise kernels: casts, scale, add, accumulate, bias, activations. Math in f32; storage f32
// or bf16 (casts and accumulation f16 too). Each kernel comes twice: one element per thread
// (grid-stride, any count and alignment) and `_v8`, eight elements per thread through 16-byte
// accesses (a bf16 one-element kernel moves 2 bytes per load and stays far below the memory's
// bandwidth). Same math per element, so both give the same bits.

#define SQRT_2_OVER_PI 0.7978845608028654f

__device__ __forceinline__ float gelu_f(float x) { return 0.5f * x * (1.f + tanhf(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x))); }
__device__ __forceinline__ float gelu_g(float x) {
    float t = tanhf(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x));
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * SQRT_2_OVER_PI * (1.f + 3.f * 0.044715f * x * x);
}
__device__ __forceinline__ float sigm(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x * sigm(x); }
// Squared ReLU (Primer's, Megatron's --squared-relu): max(x, 0)², gradient 2·max(x, 0).
__device__ __forceinline__ float relu2_f(float x) { float r = fmaxf(x, 0.f); return r * r; }
__device__ __forceinline__ float relu2_g(float x) { return 2.f * fmaxf(x, 0.f); }
// Exact GeLU: x·Φ(x), gradient Φ(x) + x·φ(x).
__device__ __forceinline__ float gelux_f(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678f)); }
__device__ __forceinline__ float gelux_g(float x) {
    return 0.5f * (1.f + erff(x * 0.70710678f)) + x * 0.39894228f * expf(-0.5f * x * x); }
// CLIP's quick GeLU: x·σ(1.702·x), gradient s + 1.702·x·s·(1 − s) with s = σ(1.702·x).
__device__ __forceinline__ float qgelu_f(float x) { return x * sigm(1.702f * x); }
__device__ __forceinline__ float qgelu_g(float x) { float s = sigm(1.702f * x); return s + 1.702f * x * s * (1.f - s); }
__device__ __forceinline__ float silu_g(float x) { float s = sigm(x); return s * (1.f + x * (1.f - s)); }
// gpt-oss's gated quick GeLU (Megatron's --quick-geglu, --glu-linear-offset o,
// --activation-func-clamp-value c; c = ∞ for none): qgelu(min(g, c))·(clamp(v, −c, c) + o), and
// its gradients, none through a clamped input (as torch's clamp).
__device__ __forceinline__ float qgeglu_f(float g, float v, float o, float c) {
    return qgelu_f(fminf(g, c)) * (fminf(fmaxf(v, -c), c) + o); }
__device__ __forceinline__ void qgeglu_b(float g, float v, float d, float o, float c, float& dg, float& dv) {
    float gc = fminf(g, c), vc = fminf(fmaxf(v, -c), c);
    dg = g <= c ? d * qgelu_g(gc) * (vc + o) : 0.f;
    dv = (v <= c && v >= -c) ? d * qgelu_f(gc) : 0.f; }

// y[i..i+8] = f(x[i..i+8]) and y = f(a, b) over groups of eight.
template <typename TX, typename TY, typename F> __device__ __forceinline__ void map8(const TX* x, TY* y, long n, F f) {
    GRID_STRIDE8(i, n) { float a[8]; ld8(x, i, a);
#pragma unroll
        for (int j = 0; j < 8; j++) a[j] = f(a[j]);
        st8(y, i, a); }
}
template <typename TA, typename TB, typename TY, typename F>
__device__ __forceinline__ void zip8(const TA* a, const TB* b, TY* y, long n, F f) {
    GRID_STRIDE8(i, n) { float u[8], v[8]; ld8(a, i, u); ld8(b, i, v);
#pragma unroll
        for (int j = 0; j < 8; j++) u[j] = f(u[j], v[j]);
        st8(y, i, u); }
}
__device__ __forceinline__ float plus(float a, float b) { return a + b; }

#define CAST(sa, ta, sb, tb) \
extern "C" __global__ void cast_##sa##_##sb(const ta* x, tb* y, long n) { GRID_STRIDE(i, n) st(y, i, ld(x, i)); } \
extern "C" __global__ void acc_##sa##_##sb(tb* dst, const ta* src, long n) { GRID_STRIDE(i, n) st(dst, i, ld(dst, i) + ld(src, i)); } \
extern "C" __global__ void cast_##sa##_##sb##_v8(const ta* x, tb* y, long n) { map8(x, y, n, [](float v) { return v; }); } \
extern "C" __global__ void acc_##sa##_##sb##_v8(tb* dst, const ta* src, long n) { zip8(dst, src, dst, n, plus); }
CAST(f32, float, f32, float) CAST(f32, float, bf16, bf16_t) CAST(bf16, bf16_t, f32, float) CAST(bf16, bf16_t, bf16, bf16_t)
CAST(f32, float, f16, f16_t) CAST(f16, f16_t, f32, float) CAST(f16, f16_t, f16, f16_t) CAST(bf16, bf16_t, f16, f16_t) CAST(f16, f16_t, bf16, bf16_t)

#define ELEMENTWISE(s, T) \
extern "C" __global__ void fill_##s(T* y, float v, long n) { GRID_STRIDE(i, n) st(y, i, v); } \
extern "C" __global__ void scale_##s(const T* x, T* y, float a, long n) { GRID_STRIDE(i, n) st(y, i, a * ld(x, i)); } \
extern "C" __global__ void add_##s(const T* a, const T* b, T* y, long n) { GRID_STRIDE(i, n) st(y, i, ld(a, i) + ld(b, i)); } \
extern "C" __global__ void bias_add_##s(const T* x, const T* b, T* y, long n, long c) { GRID_STRIDE(i, n) st(y, i, ld(x, i) + ld(b, i % c)); } \
extern "C" __global__ void bias_grad_##s(const T* dy, float* db, long rows, long c) { \
    GRID_STRIDE(i, (rows + COL_CHUNK - 1) / COL_CHUNK * c) { long j = i % c, r0 = i / c * COL_CHUNK, r1 = r0 + COL_CHUNK < rows ? r0 + COL_CHUNK : rows; \
        float s = 0.f; for (long r = r0; r < r1; r++) s += ld(dy, r * c + j); db[i] = s; } } \
extern "C" __global__ void gelu_fwd_##s(const T* x, T* y, long n) { GRID_STRIDE(i, n) st(y, i, gelu_f(ld(x, i))); } \
extern "C" __global__ void gelu_bwd_##s(const T* x, const T* dy, T* dx, long n) { GRID_STRIDE(i, n) st(dx, i, ld(dy, i) * gelu_g(ld(x, i))); } \
extern "C" __global__ void silu_fwd_##s(const T* x, T* y, long n) { GRID_STRIDE(i, n) st(y, i, silu_f(ld(x, i))); } \
extern "C" __global__ void silu_bwd_##s(const T* x, const T* dy, T* dx, long n) { GRID_STRIDE(i, n) st(dx, i, ld(dy, i) * silu_g(ld(x, i))); } \
extern "C" __global__ void relu2_fwd_##s(const T* x, T* y, long n) { GRID_STRIDE(i, n) st(y, i, relu2_f(ld(x, i))); } \
extern "C" __global__ void relu2_bwd_##s(const T* x, const T* dy, T* dx, long n) { GRID_STRIDE(i, n) st(dx, i, ld(dy, i) * relu2_g(ld(x, i))); } \
extern "C" __global__ void gelu_exact_fwd_##s(const T* x, T* y, long n) { GRID_STRIDE(i, n) st(y, i, gelux_f(ld(x, i))); } \
extern "C" __global__ void gelu_exact_bwd_##s(const T* x, const T* dy, T* dx, long n) { GRID_STRIDE(i, n) st(dx, i, ld(dy, i) * gelux_g(ld(x, i))); } \
extern "C" __global__ void quick_gelu_fwd_##s(const T* x, T* y, long n) { GRID_STRIDE(i, n) st(y, i, qgelu_f(ld(x, i))); } \
extern "C" __global__ void quick_gelu_bwd_##s(const T* x, const T* dy, T* dx, long n) { GRID_STRIDE(i, n) st(dx, i, ld(dy, i) * qgelu_g(ld(x, i))); } \
extern "C" __global__ void sigmoid_gate_fwd_##s(const T* x, const T* g, T* y, long n) { \
    GRID_STRIDE(i, n) st(y, i, ld(x, i) * sigm(ld(g, i))); } \
extern "C" __global__ void sigmoid_gate_bwd_##s(const T* x, const T* g, const T* dy, T* dx, T* dg, long n) { \
    GRID_STRIDE(i, n) { float s = sigm(ld(g, i)), d = ld(dy, i); st(dx, i, d * s); st(dg, i, d * ld(x, i) * s * (1.f - s)); } } \
extern "C" __global__ void swiglu_fwd_##s(const T* x, T* y, long n, long f) { \
    GRID_STRIDE(i, n) { long r = i / f, j = i % f; st(y, i, silu_f(ld(x, r * 2 * f + j)) * ld(x, r * 2 * f + f + j)); } } \
extern "C" __global__ void swiglu_bwd_##s(const T* x, const T* dy, T* dx, long n, long f) { \
    GRID_STRIDE(i, n) { long r = i / f, j = i % f; float g = ld(x, r * 2 * f + j), v = ld(x, r * 2 * f + f + j), d = ld(dy, i); \
        st(dx, r * 2 * f + j, d * v * silu_g(g)); st(dx, r * 2 * f + f + j, d * silu_f(g)); } } \
extern "C" __global__ void quick_geglu_fwd_##s(const T* x, T* y, long n, long f, float o, float c) { \
    GRID_STRIDE(i, n) { long r = i / f, j = i % f; \
        st(y, i, qgeglu_f(ld(x, r * 2 * f + j), ld(x, r * 2 * f + f + j), o, c)); } } \
extern "C" __global__ void quick_geglu_bwd_##s(const T* x, const T* dy, T* dx, long n, long f, float o, float c) { \
    GRID_STRIDE(i, n) { long r = i / f, j = i % f; float dg, dv; \
        qgeglu_b(ld(x, r * 2 * f + j), ld(x, r * 2 * f + f + j), ld(dy, i), o, c, dg, dv); \
        st(dx, r * 2 * f + j, dg); st(dx, r * 2 * f + f + j, dv); } }
FOR_TYPES(ELEMENTWISE)

#define ELEMENTWISE_V8(s, T) \
extern "C" __global__ void scale_##s##_v8(const T* x, T* y, float a, long n) { map8(x, y, n, [a](float v) { return a * v; }); } \
extern "C" __global__ void add_##s##_v8(const T* a, const T* b, T* y, long n) { zip8(a, b, y, n, plus); } \
extern "C" __global__ void gelu_fwd_##s##_v8(const T* x, T* y, long n) { map8(x, y, n, gelu_f); } \
extern "C" __global__ void gelu_bwd_##s##_v8(const T* x, const T* dy, T* dx, long n) { \
    zip8(x, dy, dx, n, [](float x, float d) { return d * gelu_g(x); }); } \
extern "C" __global__ void silu_fwd_##s##_v8(const T* x, T* y, long n) { map8(x, y, n, silu_f); } \
extern "C" __global__ void silu_bwd_##s##_v8(const T* x, const T* dy, T* dx, long n) { \
    zip8(x, dy, dx, n, [](float x, float d) { return d * silu_g(x); }); } \
extern "C" __global__ void relu2_fwd_##s##_v8(const T* x, T* y, long n) { map8(x, y, n, relu2_f); } \
extern "C" __global__ void relu2_bwd_##s##_v8(const T* x, const T* dy, T* dx, long n) { \
    zip8(x, dy, dx, n, [](float x, float d) { return d * relu2_g(x); }); } \
extern "C" __global__ void gelu_exact_fwd_##s##_v8(const T* x, T* y, long n) { map8(x, y, n, gelux_f); } \
extern "C" __global__ void gelu_exact_bwd_##s##_v8(const T* x, const T* dy, T* dx, long n) { \
    zip8(x, dy, dx, n, [](float x, float d) { return d * gelux_g(x); }); } \
extern "C" __global__ void quick_gelu_fwd_##s##_v8(const T* x, T* y, long n) { map8(x, y, n, qgelu_f); } \
extern "C" __global__ void sigmoid_gate_fwd_##s##_v8(const T* x, const T* g, T* y, long n) { \
    zip8(x, g, y, n, [](float x, float g) { return x * sigm(g); }); } \
extern "C" __global__ void sigmoid_gate_bwd_##s##_v8(const T* x, const T* g, const T* dy, T* dx, T* dg, long n) { \
    GRID_STRIDE8(i, n) { float u[8], v[8], d[8]; ld8(x, i, u); ld8(g, i, v); ld8(dy, i, d); \
        _Pragma("unroll") for (int j = 0; j < 8; j++) { float s = sigm(v[j]); v[j] = d[j] * u[j] * s * (1.f - s); u[j] = d[j] * s; } \
        st8(dx, i, u); st8(dg, i, v); } } \
extern "C" __global__ void quick_gelu_bwd_##s##_v8(const T* x, const T* dy, T* dx, long n) { \
    zip8(x, dy, dx, n, [](float x, float d) { return d * qgelu_g(x); }); } \
/* c % 8 == 0: a group never crosses a row, so its bias is the group at i % c. */ \
extern "C" __global__ void bias_add_##s##_v8(const T* x, const T* b, T* y, long n, long c) { \
    GRID_STRIDE8(i, n) { float u[8], v[8]; ld8(x, i, u); ld8(b, i % c, v); \
        _Pragma("unroll") for (int j = 0; j < 8; j++) u[j] += v[j]; st8(y, i, u); } } \
/* f % 8 == 0: the gate and value groups of output group i sit at the same column of their halves. */ \
extern "C" __global__ void swiglu_fwd_##s##_v8(const T* x, T* y, long n, long f) { \
    GRID_STRIDE8(i, n) { long r = i / f, j0 = i % f; float g[8], v[8]; ld8(x, r * 2 * f + j0, g); ld8(x, r * 2 * f + f + j0, v); \
        _Pragma("unroll") for (int j = 0; j < 8; j++) g[j] = silu_f(g[j]) * v[j]; st8(y, i, g); } } \
extern "C" __global__ void swiglu_bwd_##s##_v8(const T* x, const T* dy, T* dx, long n, long f) { \
    GRID_STRIDE8(i, n) { long r = i / f, j0 = i % f; float g[8], v[8], d[8], dg[8]; \
        ld8(x, r * 2 * f + j0, g); ld8(x, r * 2 * f + f + j0, v); ld8(dy, i, d); \
        _Pragma("unroll") for (int j = 0; j < 8; j++) { dg[j] = d[j] * v[j] * silu_g(g[j]); v[j] = d[j] * silu_f(g[j]); } \
        st8(dx, r * 2 * f + j0, dg); st8(dx, r * 2 * f + f + j0, v); } } \
extern "C" __global__ void quick_geglu_fwd_##s##_v8(const T* x, T* y, long n, long f, float o, float c) { \
    GRID_STRIDE8(i, n) { long r = i / f, j0 = i % f; float g[8], v[8]; ld8(x, r * 2 * f + j0, g); ld8(x, r * 2 * f + f + j0, v); \
        _Pragma("unroll") for (int j = 0; j < 8; j++) g[j] = qgeglu_f(g[j], v[j], o, c); st8(y, i, g); } } \
extern "C" __global__ void quick_geglu_bwd_##s##_v8(const T* x, const T* dy, T* dx, long n, long f, float o, float c) { \
    GRID_STRIDE8(i, n) { long r = i / f, j0 = i % f; float g[8], v[8], d[8]; \
        ld8(x, r * 2 * f + j0, g); ld8(x, r * 2 * f + f + j0, v); ld8(dy, i, d); \
        _Pragma("unroll") for (int j = 0; j < 8; j++) { float dg, dv; qgeglu_b(g[j], v[j], d[j], o, c, dg, dv); g[j] = dg; v[j] = dv; } \
        st8(dx, r * 2 * f + j0, g); st8(dx, r * 2 * f + f + j0, v); } } \
/* Column-sum partials (col_partials8: c % 8 == 0, grid chunks · ceil(c / 256), 256 threads). */ \
extern "C" __global__ void __launch_bounds__(256) bias_grad_##s##_v8(const T* dy, float* db, long rows, long c) { \
    pdl_wait(); \
    col_partials8<false>(db, nullptr, rows, c, [&](long r, long j, float (&a)[8], float (&)[8]) { \
        float g[8]; ld8(dy, r * c + j, g); _Pragma("unroll") for (int e = 0; e < 8; e++) a[e] += g[e]; }); }
FOR_TYPES(ELEMENTWISE_V8)

// Dropout (the host's dropout.rs has the rule): element j of batch row b keeps v / (1 − p) unless
// the top 24 bits of Philox-4x32-10 word base + b · bstride + off + j (from j = at on: off2 + j −
// at, a context-parallel rank's second chunk) of (seed, stream) are below
// `thr` (⌈p · 2²⁴⌉); `shift` (or null) as attention.cu `AttnDrop`'s: samples added to the first. The same rounds and word order as ferrotron_core::rng::Philox, so the mask is
// the CPU's, bit for bit.
__device__ __forceinline__ u32 philox_word(unsigned long long seed, unsigned long long stream, unsigned long long w) {
    return lane_of(philox4(seed, stream, w >> 2), (int)(w & 3));
}
#define DROPOUT(s, T) \
extern "C" __global__ void dropout_##s(const T* x, T* y, long n, long row, unsigned long long seed, \
        unsigned long long stream, unsigned long long base, unsigned long long bstride, unsigned long long off, \
        long thr, float scale, const unsigned long long* shift, long at, unsigned long long off2) { \
    if (shift) base += *shift * bstride; \
    GRID_STRIDE(i, n) { const long b = i / row, j = i - b * row; \
        const unsigned long long within = j < at ? off + (unsigned long long)j : off2 + (unsigned long long)(j - at); \
        const u32 u = philox_word(seed, stream, base + (unsigned long long)b * bstride + within); \
        st(y, i, (long)(u >> 8) >= thr ? ld(x, i) * scale : 0.f); } }
FOR_TYPES(DROPOUT)

// Standard normal values keyed as dropout's words (the host's dropout.rs `normal`): element j of
// batch row b is Box–Muller, in double as ferrotron_core::rng::Philox::normal_at, on the first two
// words of Philox-4x32-10 block base + b · bstride + off + j (the same split and shift).
__device__ __forceinline__ float box_muller(unsigned long long seed, unsigned long long stream, unsigned long long blk) {
    const uint4 w = philox4(seed, stream, blk);
    const double u1 = 1.0 - (double)((float)(w.x >> 8) * (1.f / 16777216.f));
    const double u2 = (double)((float)(w.y >> 8) * (1.f / 16777216.f));
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}
#define NORMAL(s, T) \
extern "C" __global__ void normal_##s(T* y, long n, long row, unsigned long long seed, unsigned long long stream, \
        unsigned long long base, unsigned long long bstride, unsigned long long off, \
        const unsigned long long* shift, long at, unsigned long long off2) { \
    if (shift) base += *shift * bstride; \
    GRID_STRIDE(i, n) { const long b = i / row, j = i - b * row; \
        const unsigned long long within = j < at ? off + (unsigned long long)j : off2 + (unsigned long long)(j - at); \
        st(y, i, box_muller(seed, stream, base + (unsigned long long)b * bstride + within)); } }
FOR_TYPES(NORMAL)
