// Elementwise kernels: casts, scale, add, accumulate, bias, activations. One thread per element
// (grid-stride). Math in f32; storage f32 or bf16.

#define SQRT_2_OVER_PI 0.7978845608028654f

__device__ __forceinline__ float gelu_f(float x) { return 0.5f * x * (1.f + tanhf(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x))); }
__device__ __forceinline__ float gelu_g(float x) {
    float t = tanhf(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x));
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * SQRT_2_OVER_PI * (1.f + 3.f * 0.044715f * x * x);
}
__device__ __forceinline__ float sigm(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x * sigm(x); }
__device__ __forceinline__ float silu_g(float x) { float s = sigm(x); return s * (1.f + x * (1.f - s)); }

#define CAST(sa, ta, sb, tb) \
extern "C" __global__ void cast_##sa##_##sb(const ta* x, tb* y, long n) { GRID_STRIDE(i, n) st(y, i, ld(x, i)); } \
extern "C" __global__ void acc_##sa##_##sb(tb* dst, const ta* src, long n) { GRID_STRIDE(i, n) st(dst, i, ld(dst, i) + ld(src, i)); }
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
extern "C" __global__ void swiglu_fwd_##s(const T* x, T* y, long n, long f) { \
    GRID_STRIDE(i, n) { long r = i / f, j = i % f; st(y, i, silu_f(ld(x, r * 2 * f + j)) * ld(x, r * 2 * f + f + j)); } } \
extern "C" __global__ void swiglu_bwd_##s(const T* x, const T* dy, T* dx, long n, long f) { \
    GRID_STRIDE(i, n) { long r = i / f, j = i % f; float g = ld(x, r * 2 * f + j), v = ld(x, r * 2 * f + f + j), d = ld(dy, i); \
        st(dx, r * 2 * f + j, d * v * silu_g(g)); st(dx, r * 2 * f + f + j, d * silu_f(g)); } }
FOR_TYPES(ELEMENTWISE)
