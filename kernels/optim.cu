// AdamW over flat fp32 buffers, and the sum of squares in fixed partials (summed on the host in
// order, so the global norm does not depend on scheduling).

// One element of AdamW, the arithmetic of every kernel here: the gradient scaled (clipping), the
// moments moved on, the weight decayed by `decay` (1 − lr·wd, or 1 without weight decay) and
// stepped. Every rounding is spelled out (the _rn intrinsics): left to the compiler, which
// products fuse into FMAs varied between instantiations, and a bf16 main_grad's update came out
// 1 ulp off an f32 one holding the same values.
struct AdamH {
    float b1, b2, eps, step_size, bc2_sqrt, decay, grad_scale;
};
// Where a run's step size and decay differ from the main ones: the decoupled learning rate's.
struct AdamLr {
    float step_size, decay;
};
__device__ __forceinline__ void adam_elem(float& p, float& m, float& v, float g, const AdamH& h, float decay,
                                          float step_size) {
    float gi = __fmul_rn(g, h.grad_scale);
    m = __fmaf_rn(h.b1, m, __fmul_rn(1.f - h.b1, gi));
    v = __fmaf_rn(h.b2, v, __fmul_rn(__fmul_rn(1.f - h.b2, gi), gi));
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), h.bc2_sqrt), h.eps);
    p = __fmaf_rn(p, decay, -__fdiv_rn(__fmul_rn(step_size, m), denom));
}

extern "C" __global__ void adamw(float* p, const float* g, float* m, float* v, long n, float b1, float b2, float eps,
                                 float step_size, float bc2_sqrt, float decay, float grad_scale) {
    const AdamH h{b1, b2, eps, step_size, bc2_sqrt, decay, grad_scale};
    GRID_STRIDE(i, n) adam_elem(p[i], m[i], v[i], g[i], h, decay, step_size);
}

// AdamW over the runs of one flat buffer in one launch (multi-tensor apply). Run k is eight
// u32s at runs + 8k: flat offset, state offset and length as (low, high) pairs, flags (1: weight
// decay, 2: the decoupled learning rate), and the index of its first ADAM_CHUNK-element chunk (chunks counted over the
// runs in order). Its `len` elements sit at `flat` in the gradient and parameter buffers and at
// `state` in the master weights and moments. Block b updates chunk b: it finds its run by binary
// search over the first-chunk indices. The arithmetic is `adamw`'s, and the new master weight is
// also stored into `param` rounded as `st` rounds (what a separate copy pass wrote). (Every block
// walking every run, grid-striding, cost more in the run loop than the update: 2 ms a step at
// 124M against 1.25 ms for the per-run launches.)
#define ADAM_CHUNK 2048
// The optimizer's step state on the device (crates/kernels/src/optim.rs `adam_state` names the
// same slots): written by adam_prepare, read by adamw_runs, read back by the host only when it
// logs or saves.
#define ADAM_GRAD_SCALE 0
#define ADAM_GRAD_NORM 1
#define ADAM_APPLIED 2
#define ADAM_STEP_SIZE 3
#define ADAM_BC2_SQRT 4
#define ADAM_STEPS 5
#define ADAM_LR 6
#define ADAM_WD 7
#define ADAM_LR_DECOUPLED 8
#define ADAM_DECAY 9
#define ADAM_STEP_SIZE_DECOUPLED 10
#define ADAM_DECAY_DECOUPLED 11
// Four consecutive gradients from a 4-element-aligned index (16 bytes of f32, 8 of bf16).
__device__ __forceinline__ void ld4(const float* g, long i, float* out) {
    float4 q = *(const float4*)(g + i);
    out[0] = q.x; out[1] = q.y; out[2] = q.z; out[3] = q.w;
}
__device__ __forceinline__ void ld4(const bf16_t* g, long i, float* out) {
    uint2 q = *(const uint2*)(g + i);
    out[0] = __uint_as_float(q.x << 16); out[1] = __uint_as_float(q.x & 0xffff0000u);
    out[2] = __uint_as_float(q.y << 16); out[3] = __uint_as_float(q.y & 0xffff0000u);
}
__device__ __forceinline__ void st4(float* x, long i, const float* in) {
    *(float4*)(x + i) = make_float4(in[0], in[1], in[2], in[3]);
}
__device__ __forceinline__ void st4(bf16_t* x, long i, const float* in) {
    *(uint2*)(x + i) = make_uint2(pack_bf16(in[0], in[1]), pack_bf16(in[2], in[3]));
}
// G is the gradient buffer's type: f32 main_grad, or bf16 under `--grad-reduce-in-bf16` (widened
// exactly, so the update is the one an f32 buffer holding the same values gives). M and V are the
// moments' types: f32, or bf16 under the precision-aware optimizer (--exp-avg-dtype /
// --exp-avg-sq-dtype bf16): widened, moved on and used for the step in f32, then stored rounded
// to nearest even (the update takes the unrounded moments, as the CPU's reference does).
template <typename T, typename G, typename M, typename V>
__device__ __forceinline__ void adamw_runs_impl(float* p, const G* g, M* m, V* v, T* param, const u32* runs,
                                                long nruns, AdamH h, const float* step_state) {
    // Without a state every run steps at h's rate.
    AdamLr dec{h.step_size, h.decay};
    if (step_state) {
        // The step as `adam_prepare` settled it on the device (no read back on the host).
        if (step_state[ADAM_APPLIED] == 0.f) return;
        h.grad_scale = step_state[ADAM_GRAD_SCALE];
        h.step_size = step_state[ADAM_STEP_SIZE];
        h.bc2_sqrt = step_state[ADAM_BC2_SQRT];
        h.decay = step_state[ADAM_DECAY];
        dec = AdamLr{step_state[ADAM_STEP_SIZE_DECOUPLED], step_state[ADAM_DECAY_DECOUPLED]};
    }
    u32 b = blockIdx.x;
    long lo = 0, hi = nruns - 1;
    while (lo < hi) {
        long mid = (lo + hi + 1) / 2;
        if (runs[8 * mid + 7] <= b) lo = mid; else hi = mid - 1;
    }
    const u32* d = runs + 8 * lo;
    long flat = (long)d[0] | ((long)d[1] << 32), state = (long)d[2] | ((long)d[3] << 32);
    long len = (long)d[4] | ((long)d[5] << 32);
    bool decoupled = d[6] & 2;
    float dk = d[6] & 1 ? (decoupled ? dec.decay : h.decay) : 1.f;
    float ss = decoupled ? dec.step_size : h.step_size;
    long e0 = (long)(b - d[7]) * ADAM_CHUNK, e1 = e0 + ADAM_CHUNK < len ? e0 + ADAM_CHUNK : len;
    auto one = [&](long i) {
        long s = state + i;
        float mi = ld(m, s), vi = ld(v, s);
        adam_elem(p[s], mi, vi, ld(g, flat + i), h, dk, ss);
        st(m, s, mi);
        st(v, s, vi);
        st(param, flat + i, p[s]);
    };
    auto off = [](const void* x, unsigned long align) { return (unsigned long)x % align != 0; };
    if (off(p + state, 16) || off(m + state, 4 * sizeof(M)) || off(v + state, 4 * sizeof(V)) ||
        off(g + flat, 4 * sizeof(G))) {
        for (long i = e0 + threadIdx.x; i < e1; i += blockDim.x) one(i);
        return;
    }
    // Runs starting on 16-byte boundaries (all of them in practice): four elements per thread,
    // 16-byte accesses to the f32 buffers; the same arithmetic per element.
    for (long i = e0 + 4 * threadIdx.x; i < e1; i += 4 * blockDim.x) {
        if (i + 4 > e1) { for (long x = i; x < e1; x++) one(x); break; }
        float gg[4], mm[4], vv[4];
        ld4(g, flat + i, gg);
        ld4(m, state + i, mm);
        ld4(v, state + i, vv);
        float4 p4 = *(const float4*)(p + state + i);
        float* pp = &p4.x;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            adam_elem(pp[e], mm[e], vv[e], gg[e], h, dk, ss);
            st(param, flat + i + e, pp[e]);
        }
        st4(m, state + i, mm); st4(v, state + i, vv); *(float4*)(p + state + i) = p4;
    }
}
// adamw_runs_<params>_g<grads>, with f32 moments; adamw_runs_<params>_g<grads>_m<exp_avg>_v<exp_avg_sq>
// with a bf16 moment (the f32 / f32 kernel keeps the short name).
#define ADAMW_RUNS_MV(s, T, gs, G, SUF, M, V) \
extern "C" __global__ void adamw_runs_##s##_g##gs##SUF(float* p, const G* g, M* m, V* v, T* param, \
        const u32* runs, long nruns, const float* step_state, float b1, float b2, float eps, float step_size, \
        float bc2_sqrt, float decay, float grad_scale) { \
    adamw_runs_impl(p, g, m, v, param, runs, nruns, AdamH{b1, b2, eps, step_size, bc2_sqrt, decay, grad_scale}, \
                    step_state); }
#define ADAMW_RUNS_G(s, T, gs, G) ADAMW_RUNS_MV(s, T, gs, G, , float, float)
#define ADAMW_RUNS(s, T) ADAMW_RUNS_G(s, T, f32, float) ADAMW_RUNS_G(s, T, bf16, bf16_t)
FOR_TYPES(ADAMW_RUNS)
ADAMW_RUNS(f16, f16_t)
#define ADAMW_RUNS_LOW_G(s, T, gs, G) ADAMW_RUNS_MV(s, T, gs, G, _mbf16_vbf16, bf16_t, bf16_t) \
    ADAMW_RUNS_MV(s, T, gs, G, _mbf16_vf32, bf16_t, float) ADAMW_RUNS_MV(s, T, gs, G, _mf32_vbf16, float, bf16_t)
#define ADAMW_RUNS_LOW(s, T) ADAMW_RUNS_LOW_G(s, T, f32, float) ADAMW_RUNS_LOW_G(s, T, bf16, bf16_t)
FOR_TYPES(ADAMW_RUNS_LOW)
ADAMW_RUNS_LOW(f16, f16_t)

// SGD with momentum over the same runs (Megatron's --optimizer sgd, PyTorch's SGD with dampening
// 0): g ← g·scale + wd·p (L2 weight decay where the run's flag says), buf ← μ·buf + g,
// p ← p − lr·buf, the new master weight stored into `param` too. Every rounding spelled out as the
// CPU's f32 arithmetic (crates/kernels/src/cpu/optim.rs `sgd_step`), so both give the same bits.
// With a step state its clip factor, learning rates, weight decay and skip flag (adam_prepare's
// slots) replace the arguments.
template <typename T, typename G>
__device__ __forceinline__ void sgd_runs_impl(float* p, const G* g, float* buf, T* param, const u32* runs, long nruns,
                                              float momentum, float lr, float wd, float grad_scale,
                                              const float* step_state) {
    float lr_dec = lr;
    if (step_state) {
        if (step_state[ADAM_APPLIED] == 0.f) return;
        grad_scale = step_state[ADAM_GRAD_SCALE];
        lr = step_state[ADAM_LR];
        wd = step_state[ADAM_WD];
        lr_dec = step_state[ADAM_LR_DECOUPLED];
    }
    u32 b = blockIdx.x;
    long lo = 0, hi = nruns - 1;
    while (lo < hi) {
        long mid = (lo + hi + 1) / 2;
        if (runs[8 * mid + 7] <= b) lo = mid; else hi = mid - 1;
    }
    const u32* d = runs + 8 * lo;
    long flat = (long)d[0] | ((long)d[1] << 32), state = (long)d[2] | ((long)d[3] << 32);
    long len = (long)d[4] | ((long)d[5] << 32);
    const float w = d[6] & 1 ? wd : 0.f, rate = d[6] & 2 ? lr_dec : lr;
    long e0 = (long)(b - d[7]) * ADAM_CHUNK, e1 = e0 + ADAM_CHUNK < len ? e0 + ADAM_CHUNK : len;
    for (long i = e0 + threadIdx.x; i < e1; i += blockDim.x) {
        const long s = state + i;
        const float gi = __fadd_rn(__fmul_rn(ld(g, flat + i), grad_scale), __fmul_rn(w, p[s]));
        const float nb = __fadd_rn(__fmul_rn(momentum, buf[s]), gi);
        buf[s] = nb;
        p[s] = __fsub_rn(p[s], __fmul_rn(rate, nb));
        st(param, flat + i, p[s]);
    }
}
// sgd_runs_<params>_g<grads>.
#define SGD_RUNS_G(s, T, gs, G) \
extern "C" __global__ void sgd_runs_##s##_g##gs(float* p, const G* g, float* buf, T* param, const u32* runs, \
        long nruns, const float* step_state, float momentum, float lr, float wd, float grad_scale) { \
    sgd_runs_impl(p, g, buf, param, runs, nruns, momentum, lr, wd, grad_scale, step_state); }
#define SGD_RUNS(s, T) SGD_RUNS_G(s, T, f32, float) SGD_RUNS_G(s, T, bf16, bf16_t)
FOR_TYPES(SGD_RUNS)
SGD_RUNS(f16, f16_t)

// Σ x² per block (256 threads) into partial[blockIdx.x], f64 throughout; ZEROS: the count of
// elements equal to zero instead (±0; NaN is not zero), exact in f64. V8: eight elements per
// 16-byte-aligned group (n % 8 == 0): the one-element loop ran at ≈ 2 TB/s over the 1.3B model's
// 5.2 GB of main_grad (2.6 ms a step).
template <bool V8, bool ZEROS, typename T>
__device__ __forceinline__ void sum_sq_impl(const T* x, double* partial, long n) {
    __shared__ double sh[256];
    double a = 0.0;
    if constexpr (V8) {
        GRID_STRIDE8(i, n) {
            float v[8];
            ld8(x, i, v);
#pragma unroll
            for (int e = 0; e < 8; e++) a += ZEROS ? (double)(v[e] == 0.f) : (double)v[e] * v[e];
        }
    } else {
        GRID_STRIDE(i, n) { double v = ld(x, i); a += ZEROS ? (double)(v == 0.0) : v * v; }
    }
    sh[threadIdx.x] = a;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}
#define SUMSQ(s, T) \
extern "C" __global__ void __launch_bounds__(256) sum_sq_##s(const T* x, double* partial, long n) { \
    sum_sq_impl<false, false>(x, partial, n); } \
extern "C" __global__ void __launch_bounds__(256) sum_sq_##s##_v8(const T* x, double* partial, long n) { \
    sum_sq_impl<true, false>(x, partial, n); } \
extern "C" __global__ void __launch_bounds__(256) count_zeros_##s(const T* x, double* partial, long n) { \
    sum_sq_impl<false, true>(x, partial, n); } \
extern "C" __global__ void __launch_bounds__(256) count_zeros_##s##_v8(const T* x, double* partial, long n) { \
    sum_sq_impl<true, true>(x, partial, n); }
FOR_TYPES(SUMSQ)

// Σ of n f64 partials into out[0] as f32 (one block of 256 threads: thread i adds partials i,
// i + 256, … in order, then a fixed tree; the same bits every run).
extern "C" __global__ void __launch_bounds__(256) sum_partials_f32(const double* partial, long n, float* out) {
    __shared__ double sh[256];
    double a = 0.0;
    for (long i = threadIdx.x; i < n; i += 256) a += partial[i];
    sh[threadIdx.x] = a;
    __syncthreads();
    for (int o = 128; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = (float)sh[0];
}

// One thread settles the step from Σ g² (sq[0], summed across ranks) and the learning rates and
// weight decay the host wrote into the state: the norm, the clip factor, whether the update applies (a finite
// norm), the step count moved on when it does, the bias-corrected step sizes and √(1 − β2ᵗ) for
// that count (f64, as the host computed them), and the decay factors 1 − lr·wd (rounded as the
// host's f32 arithmetic rounds them: no fused multiply-add), for the main and decoupled rates.
extern "C" __global__ void adam_prepare(const float* sq, float* state, float b1, float b2, float clip) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    float lr = state[ADAM_LR], wd = state[ADAM_WD], lr2 = state[ADAM_LR_DECOUPLED];
    double norm = sqrt((double)sq[0]);
    bool ok = isfinite(norm);
    double t = (double)state[ADAM_STEPS] + (ok ? 1.0 : 0.0);
    state[ADAM_GRAD_NORM] = (float)norm;
    state[ADAM_GRAD_SCALE] = clip > 0.f && norm > (double)clip ? (float)((double)clip / (norm + 1e-6)) : 1.f;
    state[ADAM_APPLIED] = ok ? 1.f : 0.f;
    state[ADAM_STEPS] = (float)t;
    double bc1 = 1.0 - pow((double)b1, t);
    state[ADAM_STEP_SIZE] = (float)((double)lr / bc1);
    state[ADAM_STEP_SIZE_DECOUPLED] = (float)((double)lr2 / bc1);
    state[ADAM_BC2_SQRT] = (float)sqrt(1.0 - pow((double)b2, t));
    state[ADAM_DECAY] = __fsub_rn(1.f, __fmul_rn(lr, wd));
    state[ADAM_DECAY_DECOUPLED] = __fsub_rn(1.f, __fmul_rn(lr2, wd));
}
