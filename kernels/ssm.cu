// Mamba-2's mixer ops (crates/kernels/src/cpu/ssm.rs has the math and the shapes): the causal
// depthwise convolution with SiLU, the selective scan and the gated grouped RMSNorm.
//
// The step-by-step scan (where ssd_chunk.cu's chunked form does not fit in shared memory, or
// with FERROTRON_SSD_SCAN=steps) walks the steps in order: one block per (sequence, head), one
// thread per head channel p holding its column S[:, p] of the state (N ≤ SSM_MAX_STATE floats),
// so the forward needs no exchange between threads. The backward runs each chunk's steps again
// from the saved state into a scratch buffer only its own thread reads, walks back with
// G = ∂L/∂S, and sums dB and dC over p through shared memory (per head; the heads of a group are
// summed after, in order). Parameter gradients are per-(sequence, head) partials summed over
// sequences in order: no atomics, the same bits every run. Small parameters (conv weight and
// bias, dt_bias, A_log, D, the norm weight) arrive as f32. SiLU and its gradient are
// elementwise.cu's (`silu_f`, `silu_g`: one module).

#define SSM_MAX_STATE 256
// The convolution: a thread takes V adjacent channels (4 where the channels divide by 4, one
// 8- or 16-byte access a step) and walks a run of CONV_RUN steps of one sequence, the last K inputs
// (and in the backward the next K − 1 pre-activation gradients) in registers, so each element of
// x, dy, y and dx crosses memory once (plus K − 1 steps of halo a run). K (4 or 8, the taps padded
// with zero weights) and V are template arguments so the windows stay in registers.
#define CONV_RUN 64

__device__ __forceinline__ float ssm_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float ssm_softplus_grad(float x) { return x > 20.f ? 1.f : 1.f / (1.f + expf(-x)); }

// V adjacent elements in one access (the host checks the alignment).
__device__ __forceinline__ void ldv(const float* p, long i, float (&v)[1]) { v[0] = p[i]; }
__device__ __forceinline__ void ldv(const bf16_t* p, long i, float (&v)[1]) { v[0] = ld(p, i); }
__device__ __forceinline__ void ldv(const float* p, long i, float (&v)[4]) {
    float4 a = *(const float4*)(p + i); v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
}
__device__ __forceinline__ void ldv(const bf16_t* p, long i, float (&v)[4]) {
    uint2 a = *(const uint2*)(p + i);
    v[0] = __uint_as_float(a.x << 16); v[1] = __uint_as_float(a.x & 0xffff0000u);
    v[2] = __uint_as_float(a.y << 16); v[3] = __uint_as_float(a.y & 0xffff0000u);
}
__device__ __forceinline__ void stv(float* p, long i, const float (&v)[1]) { p[i] = v[0]; }
__device__ __forceinline__ void stv(bf16_t* p, long i, const float (&v)[1]) { st(p, i, v[0]); }
__device__ __forceinline__ void stv(float* p, long i, const float (&v)[4]) { *(float4*)(p + i) = make_float4(v[0], v[1], v[2], v[3]); }
__device__ __forceinline__ void stv(bf16_t* p, long i, const float (&v)[4]) { *(uint2*)(p + i) = make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3])); }

// The window's oldest value leaves, v enters at K − 1.
template <int K, int V>
__device__ __forceinline__ void conv_push(float (&win)[K][V], const float (&v)[V]) {
#pragma unroll
    for (int d = 0; d + 1 < K; d++)
#pragma unroll
        for (int e = 0; e < V; e++) win[d][e] = win[d + 1][e];
#pragma unroll
    for (int e = 0; e < V; e++) win[K - 1][e] = v[e];
}

// A thread's first channel and run: blocks are (run, channel tile) pairs; runs never cross sequences.
struct ConvRun { long ch, run, off, t0, t1; };
template <int V>
__device__ __forceinline__ ConvRun conv_run(long seq, long c) {
    long tiles = (c / V + blockDim.x - 1) / blockDim.x, runs = (seq + CONV_RUN - 1) / CONV_RUN, rt = blockIdx.x / tiles;
    long t0 = (rt % runs) * CONV_RUN;
    return {((long)(blockIdx.x % tiles) * blockDim.x + threadIdx.x) * V, rt, (rt / runs) * seq * c, t0, min(t0 + CONV_RUN, seq)};
}

// wr[d] = w[k − 1 − d] (the tap on x[t − d]), zero past k; win = x[t0 − K .. t0 − 1], zero before 0.
template <typename T, int K, int V>
__device__ __forceinline__ void conv_start(const T* xs, const float* w, long ch, long c, long k, long t0, float (&wr)[K][V], float (&win)[K][V]) {
#pragma unroll
    for (int d = 0; d < K; d++) {
        long s = t0 - K + d;
#pragma unroll
        for (int e = 0; e < V; e++) { wr[d][e] = d < k ? w[(ch + e) * k + k - 1 - d] : 0.f; win[d][e] = 0.f; }
        if (s >= 0) ldv(xs, s * c, win[d]);
    }
}

// conv(x)[t] + bias of channel e with win[K − 1 − d] = x[t − d], the taps in the CPU's order
// (j = k − 1 − d up).
template <int K, int V>
__device__ __forceinline__ float conv_dot(const float (&wr)[K][V], const float (&win)[K][V], float bias, int e) {
    float v = bias;
#pragma unroll
    for (int d = K - 1; d >= 0; d--) v += wr[d][e] * win[K - 1 - d][e];
    return v;
}

// y[t] = silu(conv(x)[t] + bias) over the thread's run.
template <typename T, int K, int V>
__device__ __forceinline__ void conv_fwd_run(const T* x, const float* w, const float* bias, T* y, long seq, long c, long k) {
    constexpr int A = 8 / V;  // steps loaded before they are used
    ConvRun q = conv_run<V>(seq, c);
    if (q.ch >= c) return;
    const T* xs = x + q.off + q.ch;
    T* ys = y + q.off + q.ch;
    float wr[K][V], win[K][V], bv[V];
    conv_start<T, K, V>(xs, w, q.ch, c, k, q.t0, wr, win);
#pragma unroll
    for (int e = 0; e < V; e++) bv[e] = bias[q.ch + e];
    for (long t = q.t0; t < q.t1; t += A) {
        float xv[A][V];
#pragma unroll
        for (int a = 0; a < A; a++) {
#pragma unroll
            for (int e = 0; e < V; e++) xv[a][e] = 0.f;
            if (t + a < q.t1) ldv(xs, (t + a) * c, xv[a]);
        }
#pragma unroll
        for (int a = 0; a < A; a++) {
            conv_push<K, V>(win, xv[a]);
            float o[V];
#pragma unroll
            for (int e = 0; e < V; e++) o[e] = silu_f(conv_dot<K, V>(wr, win, bv[e], e));
            if (t + a < q.t1) stv(ys, (t + a) * c, o);
        }
    }
}

// The backward over the thread's run: g[u] = dy[u] · silu'(pre[u]) for u up to t1 + K − 2 (zero
// past the sequence), dx[s] = Σ_d g[s + d] · wr[d] once g[s + K − 1] is known, and the run's
// partials of dw and dbias (its own g only) into part[run, k + 1, c]: conv1d_dw_sum adds the runs.
template <typename T, int K, int V>
__device__ __forceinline__ void conv_bwd_run(const T* x, const float* w, const float* bias, const T* dy, T* dx, float* part, long seq, long c, long k) {
    constexpr int A = 8 / V;
    ConvRun q = conv_run<V>(seq, c);
    if (q.ch >= c) return;
    const T* xs = x + q.off + q.ch;
    const T* gs = dy + q.off + q.ch;
    T* dxs = dx + q.off + q.ch;
    float wr[K][V], win[K][V], gwin[K][V], dwr[K][V], db[V], bv[V];
    conv_start<T, K, V>(xs, w, q.ch, c, k, q.t0, wr, win);
#pragma unroll
    for (int e = 0; e < V; e++) {
        bv[e] = bias[q.ch + e];
        db[e] = 0.f;
#pragma unroll
        for (int d = 0; d < K; d++) { gwin[d][e] = 0.f; dwr[d][e] = 0.f; }
    }
    long u1 = min(q.t1 + K - 1, seq);
    for (long u = q.t0; u < q.t1 + K - 1; u += A) {
        float xv[A][V], dv[A][V];
#pragma unroll
        for (int a = 0; a < A; a++) {
#pragma unroll
            for (int e = 0; e < V; e++) { xv[a][e] = 0.f; dv[a][e] = 0.f; }
            if (u + a < u1) { ldv(xs, (u + a) * c, xv[a]); ldv(gs, (u + a) * c, dv[a]); }
        }
#pragma unroll
        for (int a = 0; a < A; a++) {
            long v = u + a, s = v - (K - 1);
            conv_push<K, V>(win, xv[a]);
            float g[V];
#pragma unroll
            for (int e = 0; e < V; e++) g[e] = dv[a][e] * silu_g(conv_dot<K, V>(wr, win, bv[e], e));
            conv_push<K, V>(gwin, g);
            if (v < q.t1) {
#pragma unroll
                for (int e = 0; e < V; e++) {
                    db[e] += g[e];
#pragma unroll
                    for (int d = 0; d < K; d++) dwr[d][e] += g[e] * win[K - 1 - d][e];
                }
            }
            if (s >= q.t0 && s < q.t1) {
                float o[V];
#pragma unroll
                for (int e = 0; e < V; e++) {
                    o[e] = 0.f;
#pragma unroll
                    for (int d = K - 1; d >= 0; d--) o[e] += gwin[d][e] * wr[d][e];
                }
                stv(dxs, s * c, o);
            }
        }
    }
    float* pr = part + q.run * (k + 1) * c + q.ch;
#pragma unroll
    for (int d = 0; d < K; d++)
        if (d < k) stv(pr + (k - 1 - d) * c, 0, dwr[d]);
    stv(pr + k * c, 0, db);
}

#define CONV(s, T, K, V) \
extern "C" __global__ void conv1d_silu_k##K##v##V##_##s(const T* x, const float* w, const float* bias, T* y, long seq, long c, long k) { \
    conv_fwd_run<T, K, V>(x, w, bias, y, seq, c, k); } \
extern "C" __global__ void conv1d_silu_bwd_k##K##v##V##_##s(const T* x, const float* w, const float* bias, const T* dy, T* dx, float* part, long seq, long c, long k) { \
    conv_bwd_run<T, K, V>(x, w, bias, dy, dx, part, seq, c, k); }
#define CONV_TYPES(s, T) CONV(s, T, 4, 1) CONV(s, T, 4, 4) CONV(s, T, 8, 1) CONV(s, T, 8, 4)
FOR_TYPES(CONV_TYPES)

#define SSM(s, T) \
extern "C" __global__ void ssd_scan_fwd_##s(const T* xbc, const T* dt_raw, const float* dt_bias, const float* a_log, const float* dd, T* y, float* states, long seq, long hh, long p, long g, long n, long chunk) { \
    long bh = blockIdx.x, b = bh / hh, h = bh % hh, q = threadIdx.x, gi = h / (hh / g), cd = hh * p + 2 * g * n, nch = (seq + chunk - 1) / chunk; \
    float sv[SSM_MAX_STATE]; for (long j = 0; j < n; j++) sv[j] = 0.f; \
    float a_h = -expf(a_log[h]); \
    for (long t = 0; t < seq; t++) { \
        if (t % chunk == 0) for (long j = 0; j < n; j++) states[((bh * nch + t / chunk) * n + j) * p + q] = sv[j]; \
        long row = (b * seq + t) * cd; float xp = ld(xbc, row + h * p + q); \
        float dt = ssm_softplus(ld(dt_raw, (b * seq + t) * hh + h) + dt_bias[h]), decay = expf(dt * a_h); \
        float acc = dd[h] * xp; \
        for (long j = 0; j < n; j++) { float bj = ld(xbc, row + hh * p + gi * n + j), cj = ld(xbc, row + hh * p + g * n + gi * n + j); \
            sv[j] = decay * sv[j] + dt * bj * xp; acc += cj * sv[j]; } \
        st(y, (b * seq + t) * hh * p + h * p + q, acc); } } \
/* shared: shC, shU [n][p], shDa [p], shBu [n]. scratch [B·H, chunk + 1, n, p]; chunk: the host's SCAN_CHUNK. */ \
extern "C" __global__ void ssd_scan_bwd_##s(const T* xbc, const T* dt_raw, const float* dt_bias, const float* a_log, const float* dd, const float* states, const T* dy, \
        T* dxbc, T* ddt, float* dbh, float* dch, float* prm, float* scratch, long seq, long hh, long p, long g, long n, long chunk) { \
    extern __shared__ float smem[]; float* shC = smem; float* shU = shC + n * p; float* shDa = shU + n * p; float* shBu = shDa + p; \
    long bh = blockIdx.x, b = bh / hh, h = bh % hh, q = threadIdx.x, gi = h / (hh / g), cd = hh * p + 2 * g * n, nch = (seq + chunk - 1) / chunk; \
    float* sc = scratch + bh * (chunk + 1) * n * p; \
    float gs[SSM_MAX_STATE]; for (long j = 0; j < n; j++) gs[j] = 0.f; \
    float a_h = -expf(a_log[h]), d_bias = 0.f, d_a = 0.f, d_d = 0.f; \
    for (long ck = nch - 1; ck >= 0; ck--) { \
        long t0 = ck * chunk, t1 = min(t0 + chunk, seq); \
        for (long j = 0; j < n; j++) sc[j * p + q] = states[((bh * nch + ck) * n + j) * p + q]; \
        for (long t = t0; t < t1; t++) { long row = (b * seq + t) * cd, i = t - t0; float xp = ld(xbc, row + h * p + q); \
            float dt = ssm_softplus(ld(dt_raw, (b * seq + t) * hh + h) + dt_bias[h]), decay = expf(dt * a_h); \
            for (long j = 0; j < n; j++) sc[((i + 1) * n + j) * p + q] = decay * sc[(i * n + j) * p + q] + dt * ld(xbc, row + hh * p + gi * n + j) * xp; } \
        for (long t = t1 - 1; t >= t0; t--) { long row = (b * seq + t) * cd, i = t - t0; \
            float raw = ld(dt_raw, (b * seq + t) * hh + h) + dt_bias[h], dt = ssm_softplus(raw), decay = expf(dt * a_h); \
            float xp = ld(xbc, row + h * p + q), dyp = ld(dy, (b * seq + t) * hh * p + h * p + q); \
            float dxp = dd[h] * dyp, da = 0.f; d_d += dyp * xp; \
            for (long j = 0; j < n; j++) { float bj = ld(xbc, row + hh * p + gi * n + j), cj = ld(xbc, row + hh * p + g * n + gi * n + j); \
                shC[j * p + q] = sc[((i + 1) * n + j) * p + q] * dyp; \
                gs[j] += cj * dyp; \
                shU[j * p + q] = gs[j] * xp; \
                da += gs[j] * sc[(i * n + j) * p + q]; \
                dxp += dt * bj * gs[j]; \
                gs[j] *= decay; } \
            shDa[q] = da; \
            st(dxbc, row + h * p + q, dxp); \
            __syncthreads(); \
            for (long j = q; j < n; j += p) { float dc = 0.f, u = 0.f; for (long r = 0; r < p; r++) { dc += shC[j * p + r]; u += shU[j * p + r]; } \
                long o = ((b * seq + t) * hh + h) * n + j; dch[o] = dc; dbh[o] = dt * u; shBu[j] = ld(xbc, row + hh * p + gi * n + j) * u; } \
            __syncthreads(); \
            if (q == 0) { float d_dt = 0.f, dsum = 0.f; for (long j = 0; j < n; j++) d_dt += shBu[j]; for (long r = 0; r < p; r++) dsum += shDa[r]; \
                d_dt += dsum * decay * a_h; d_a += dsum * decay * dt; float d_raw = d_dt * ssm_softplus_grad(raw); \
                st(ddt, (b * seq + t) * hh + h, d_raw); d_bias += d_raw; } \
            __syncthreads(); } } \
    shDa[q] = d_d; __syncthreads(); \
    if (q == 0) { float v = 0.f; for (long r = 0; r < p; r++) v += shDa[r]; prm[bh * 3] = d_bias; prm[bh * 3 + 1] = d_a * a_h; prm[bh * 3 + 2] = v; } } \
/* dB, dC of each group: its heads' per-head sums, in head order, into xbc's B and C columns. */ \
extern "C" __global__ void ssd_bc_sum_##s(const float* dbh, const float* dch, T* dxbc, long rows, long hh, long p, long g, long n) { \
    long cd = hh * p + 2 * g * n, hpg = hh / g; \
    GRID_STRIDE(i, rows * g * n) { long r = i / (g * n), gi = (i / n) % g, j = i % n; float vb = 0.f, vc = 0.f; \
        for (long hl = 0; hl < hpg; hl++) { long o = (r * hh + gi * hpg + hl) * n + j; vb += dbh[o]; vc += dch[o]; } \
        st(dxbc, r * cd + hh * p + gi * n + j, vb); st(dxbc, r * cd + hh * p + g * n + gi * n + j, vc); } } \
/* the same eight state channels a thread (the host: n and H·P divide by 8, pointers aligned). */ \
extern "C" __global__ void ssd_bc_sum_##s##_v8(const float* dbh, const float* dch, T* dxbc, long rows, long hh, long p, long g, long n) { \
    long cd = hh * p + 2 * g * n, hpg = hh / g; \
    GRID_STRIDE8(i, rows * g * n) { long r = i / (g * n), gi = (i / n) % g, j = i % n; float vb[8], vc[8]; \
        _Pragma("unroll") for (int e = 0; e < 8; e++) { vb[e] = 0.f; vc[e] = 0.f; } \
        for (long hl = 0; hl < hpg; hl++) { long o = (r * hh + gi * hpg + hl) * n + j; float a[8], b[8]; ld8(dbh, o, a); ld8(dch, o, b); \
            _Pragma("unroll") for (int e = 0; e < 8; e++) { vb[e] += a[e]; vc[e] += b[e]; } } \
        st8(dxbc, r * cd + hh * p + gi * n + j, vb); st8(dxbc, r * cd + hh * p + g * n + gi * n + j, vc); } } \
/* one block of 128 threads per (row, group) */ \
extern "C" __global__ void gated_rmsnorm_fwd_##s(const T* y, const T* z, const float* w, T* out, float* rstd, long c, long groups, float eps) { \
    long blk = blockIdx.x, r = blk / groups, gi = blk % groups, gsz = c / groups, base = r * c + gi * gsz; float ss = 0.f; \
    for (long i = threadIdx.x; i < gsz; i += blockDim.x) { float v = ld(y, base + i) * silu_f(ld(z, base + i)); ss += v * v; } \
    float rs = rsqrtf(block_sum(ss) / (float)gsz + eps); \
    for (long i = threadIdx.x; i < gsz; i += blockDim.x) st(out, base + i, ld(y, base + i) * silu_f(ld(z, base + i)) * rs * w[gi * gsz + i]); \
    if (threadIdx.x == 0) rstd[blk] = rs; } \
/* also writes wterm[r, c] = dout · v · rstd, whose column sums are dw */ \
extern "C" __global__ void gated_rmsnorm_bwd_##s(const T* dout, const T* y, const T* z, const float* w, const float* rstd, T* dy, T* dz, float* wterm, long c, long groups) { \
    long blk = blockIdx.x, gi = blk % groups, gsz = c / groups, base = (blk / groups) * c + gi * gsz; float rs = rstd[blk], m = 0.f; \
    for (long i = threadIdx.x; i < gsz; i += blockDim.x) { float vh = ld(y, base + i) * silu_f(ld(z, base + i)) * rs, gr = ld(dout, base + i); \
        m += gr * w[gi * gsz + i] * vh; wterm[base + i] = gr * vh; } \
    m = block_sum(m) / (float)gsz; \
    for (long i = threadIdx.x; i < gsz; i += blockDim.x) { float yv = ld(y, base + i), zv = ld(z, base + i), sz = silu_f(zv); \
        float dv = rs * (ld(dout, base + i) * w[gi * gsz + i] - yv * sz * rs * m); \
        st(dy, base + i, dv * sz); st(dz, base + i, dv * yv * silu_g(zv)); } }
FOR_TYPES(SSM)

// The gated norm eight channels a lane: one warp per (row, group), GN_CHUNKS chunks of 256 channels
// at most (groups of up to 1024 channels whose size divides by 8; else the kernels above). The
// backward's blocks take GN_ROWS rows of one group, their warps every eighth row, and sum the
// weight gradient's terms over those rows in registers: part[row block, c] replaces the per-element
// f32 term of the kernel above, and its column sums are dw.
#define GN_CHUNKS 4
#define GN_ROWS 64
#define GATED_V8(s, T) \
extern "C" __global__ void gated_rmsnorm_fwd_v8_##s(const T* y, const T* z, const float* w, T* out, float* rstd, long rows, long c, long groups, float eps) { \
    long blk = (long)blockIdx.x * 8 + threadIdx.x / 32; int lane = threadIdx.x % 32; \
    if (blk >= rows * groups) return; \
    long gi = blk % groups, gsz = c / groups, base = (blk / groups) * c + gi * gsz; \
    float v[GN_CHUNKS][8], ss = 0.f; \
    _Pragma("unroll") for (int q = 0; q < GN_CHUNKS; q++) { long i = q * 256 + lane * 8; \
        if (i < gsz) { float a[8], b[8]; ld8(y, base + i, a); ld8(z, base + i, b); \
            _Pragma("unroll") for (int e = 0; e < 8; e++) { v[q][e] = a[e] * silu_f(b[e]); ss += v[q][e] * v[q][e]; } } } \
    float rs = rsqrtf(warp_sum(ss) / (float)gsz + eps); \
    _Pragma("unroll") for (int q = 0; q < GN_CHUNKS; q++) { long i = q * 256 + lane * 8; \
        if (i < gsz) { float wv[8], o[8]; ld8(w, gi * gsz + i, wv); \
            _Pragma("unroll") for (int e = 0; e < 8; e++) o[e] = v[q][e] * rs * wv[e]; \
            st8(out, base + i, o); } } \
    if (lane == 0) rstd[blk] = rs; } \
extern "C" __global__ void gated_rmsnorm_bwd_v8_##s(const T* dout, const T* y, const T* z, const float* w, const float* rstd, T* dy, T* dz, float* part, long rows, long c, long groups) { \
    __shared__ float sh[8][GN_CHUNKS * 256]; \
    long gi = blockIdx.x % groups, rb = blockIdx.x / groups, gsz = c / groups, r1 = min((rb + 1) * GN_ROWS, rows); \
    int wp = threadIdx.x / 32, lane = threadIdx.x % 32; \
    float acc[GN_CHUNKS][8]; \
    _Pragma("unroll") for (int q = 0; q < GN_CHUNKS; q++) _Pragma("unroll") for (int e = 0; e < 8; e++) acc[q][e] = 0.f; \
    for (long r = rb * GN_ROWS + wp; r < r1; r += 8) { \
        long base = r * c + gi * gsz; float rs = rstd[r * groups + gi], m = 0.f; \
        _Pragma("unroll") for (int q = 0; q < GN_CHUNKS; q++) { long i = q * 256 + lane * 8; \
            if (i < gsz) { float a[8], b[8], g[8], wv[8]; ld8(y, base + i, a); ld8(z, base + i, b); ld8(dout, base + i, g); ld8(w, gi * gsz + i, wv); \
                _Pragma("unroll") for (int e = 0; e < 8; e++) m += g[e] * wv[e] * (a[e] * silu_f(b[e]) * rs); } } \
        m = warp_sum(m) / (float)gsz; \
        _Pragma("unroll") for (int q = 0; q < GN_CHUNKS; q++) { long i = q * 256 + lane * 8; \
            if (i < gsz) { float a[8], b[8], g[8], wv[8], oy[8], oz[8]; ld8(y, base + i, a); ld8(z, base + i, b); ld8(dout, base + i, g); ld8(w, gi * gsz + i, wv); \
                _Pragma("unroll") for (int e = 0; e < 8; e++) { float sz = silu_f(b[e]), vh = a[e] * sz * rs; acc[q][e] += g[e] * vh; \
                    float dv = rs * (g[e] * wv[e] - a[e] * sz * rs * m); oy[e] = dv * sz; oz[e] = dv * a[e] * silu_g(b[e]); } \
                st8(dy, base + i, oy); st8(dz, base + i, oz); } } } \
    _Pragma("unroll") for (int q = 0; q < GN_CHUNKS; q++) _Pragma("unroll") for (int e = 0; e < 8; e++) sh[wp][q * 256 + lane * 8 + e] = acc[q][e]; \
    __syncthreads(); \
    for (long i = threadIdx.x; i < gsz; i += blockDim.x) { float v = 0.f; for (int q = 0; q < 8; q++) v += sh[q][i]; part[rb * c + gi * gsz + i] = v; } }
FOR_TYPES(GATED_V8)

// The convolution weight gradient's run partials [runs, k + 1, c] summed in order: dw [c, k], dbias [c].
extern "C" __global__ void conv1d_dw_sum(const float* part, float* dw, float* dbias, long c, long k, long runs) {
    GRID_STRIDE(i, c * (k + 1)) { long j = i / c, ch = i % c; float v = 0.f;
        for (long r = 0; r < runs; r++) v += part[(r * (k + 1) + j) * c + ch];
        if (j < k) dw[ch * k + j] = v; else dbias[ch] = v; } }

// The scan's parameter partials [B, H, per, 3] (per: 1 step by step, the chunks chunked) summed
// over sequences and chunks in a fixed order: a warp per head, lane l adding partials l, l + 32, …
// of the (sequence, chunk) list, then the warp's butterfly (one thread per head walking all of
// them took 25 µs a call in the 68M model).
extern "C" __global__ void ssd_prm_sum(const float* prm, float* d_bias, float* d_alog, float* d_d, long batch, long hh, long per) {
    long h = blockIdx.x; int lane = threadIdx.x; float a = 0.f, b = 0.f, c = 0.f;
    for (long e = lane; e < batch * per; e += 32) { long o = (((e / per) * hh + h) * per + e % per) * 3;
        a += prm[o]; b += prm[o + 1]; c += prm[o + 2]; }
    a = warp_sum(a); b = warp_sum(b); c = warp_sum(c);
    if (lane == 0) { d_bias[h] = a; d_alog[h] = b; d_d[h] = c; } }
