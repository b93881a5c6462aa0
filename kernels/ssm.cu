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
// Rows per partial sum of the convolution's weight gradient, and the most taps it takes.
#define CONV_ROW_BLOCKS 64
#define CONV_MAX_TAPS 8

__device__ __forceinline__ float ssm_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float ssm_softplus_grad(float x) { return x > 20.f ? 1.f : 1.f / (1.f + expf(-x)); }

// conv(x)[r, ch] + bias: row r = b·seq + t reads rows r − k + 1 + j of the same sequence.
template <typename T>
__device__ __forceinline__ float conv_pre(const T* x, const float* w, const float* bias, long r, long t, long ch, long c, long k) {
    float v = bias[ch];
    for (long j = 0; j < k; j++) { long s = t + j - (k - 1); if (s >= 0) v += w[ch * k + j] * ld(x, (r - t + s) * c + ch); }
    return v;
}

// The convolution's elementwise kernels: blocks take rows (grid-stride), threads a row's channels,
// so no index is divided per element.
#define CONV_ROWS(r, t, rows, seq) for (long r = blockIdx.x, t = r % seq; r < rows; r += gridDim.x, t = r % seq)
#define CONV_CHANNELS(ch, c) for (long ch = threadIdx.x; ch < c; ch += blockDim.x)

#define SSM(s, T) \
extern "C" __global__ void conv1d_silu_##s(const T* x, const float* w, const float* bias, T* y, long rows, long seq, long c, long k) { \
    CONV_ROWS(r, t, rows, seq) CONV_CHANNELS(ch, c) st(y, r * c + ch, silu_f(conv_pre(x, w, bias, r, t, ch, c, k))); } \
extern "C" __global__ void conv1d_silu_dpre_##s(const T* x, const float* w, const float* bias, const T* dy, float* dpre, long rows, long seq, long c, long k) { \
    CONV_ROWS(r, t, rows, seq) CONV_CHANNELS(ch, c) dpre[r * c + ch] = ld(dy, r * c + ch) * silu_g(conv_pre(x, w, bias, r, t, ch, c, k)); } \
extern "C" __global__ void conv1d_dx_##s(const float* dpre, const float* w, T* dx, long rows, long seq, long c, long k) { \
    CONV_ROWS(r, t, rows, seq) CONV_CHANNELS(ch, c) { float v = 0.f; \
        for (long j = 0; j < k; j++) { long t2 = t + (k - 1) - j; if (t2 < seq) v += dpre[(r + (k - 1) - j) * c + ch] * w[ch * k + j]; } \
        st(dx, r * c + ch, v); } } \
/* block (32 channels × 8 row lanes) of row block yb: part[yb, ch, j] = Σ its rows' dpre · x shifted by j (j = k: dbias). */ \
extern "C" __global__ void conv1d_dw_part_##s(const T* x, const float* dpre, float* part, long rows, long seq, long c, long k) { \
    __shared__ float sh[8][32][CONV_MAX_TAPS + 1]; \
    long tiles = (c + 31) / 32, yb = blockIdx.x / tiles, ch = (blockIdx.x % tiles) * 32 + threadIdx.x % 32; int ly = threadIdx.x / 32; \
    float acc[CONV_MAX_TAPS + 1]; for (int j = 0; j <= CONV_MAX_TAPS; j++) acc[j] = 0.f; \
    if (ch < c) for (long r = yb * 8 + ly; r < rows; r += 8 * CONV_ROW_BLOCKS) { long t = r % seq; float d = dpre[r * c + ch]; acc[k] += d; \
        for (long j = 0; j < k; j++) { long s2 = t + j - (k - 1); if (s2 >= 0) acc[j] += d * ld(x, (r - t + s2) * c + ch); } } \
    for (int j = 0; j <= k; j++) sh[ly][threadIdx.x % 32][j] = acc[j]; \
    __syncthreads(); \
    if (ly == 0 && ch < c) for (int j = 0; j <= k; j++) { float v = 0.f; for (int q = 0; q < 8; q++) v += sh[q][threadIdx.x][j]; \
        part[(yb * c + ch) * (k + 1) + j] = v; } } \
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

// The weight gradient's partials summed over row blocks, in order: dw [c, k], dbias [c].
extern "C" __global__ void conv1d_dw_sum(const float* part, float* dw, float* dbias, long c, long k) {
    GRID_STRIDE(i, c * (k + 1)) { long ch = i / (k + 1), j = i % (k + 1); float v = 0.f;
        for (long yb = 0; yb < CONV_ROW_BLOCKS; yb++) v += part[(yb * c + ch) * (k + 1) + j];
        if (j < k) dw[ch * k + j] = v; else dbias[ch] = v; } }

// The scan's parameter partials [B, H, per, 3] (per: 1 step by step, the chunks chunked) summed
// over sequences and chunks in order.
extern "C" __global__ void ssd_prm_sum(const float* prm, float* d_bias, float* d_alog, float* d_d, long batch, long hh, long per) {
    GRID_STRIDE(h, hh) { float a = 0.f, b = 0.f, c = 0.f;
        for (long s = 0; s < batch; s++) for (long k = 0; k < per; k++) { long o = ((s * hh + h) * per + k) * 3;
            a += prm[o]; b += prm[o + 1]; c += prm[o + 2]; }
        d_bias[h] = a; d_alog[h] = b; d_d[h] = c; } }
