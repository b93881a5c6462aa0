// Rotary embedding, rotate-half (pair k is features k and k + rot/2) or, with `il`, interleaved
// (features 2k and 2k + 1). Angles in f64 so that long positions match the CPU reference.
// One thread per (token, head, pair), each computing its angle; or, eight-wide (`_v8`, when the
// half and the pass-through part divide by 8 and the tensors are 16-byte aligned), one thread per
// eight pairs reading the angles from a table that `rope_table` fills once per call (the
// one-element kernel recomputes every angle for every head: f64 pow, sin and cos per pair).
// In place (x == y) with `period` > 0: the query and key heads of a fused QKV row rotate and its
// value heads (head % period == period − 1) are left alone; pass-through features are not copied.

// Whether head `hh` of a row is a value head to leave alone (only in place: see above).
__device__ __forceinline__ bool rope_skip(long hh, long period) { return period > 0 && hh % period == period - 1; }

// Pair k's frequency, base^(−2k/rot), with Llama 3.1's scaling when `factor` > 0 (cpu/rope.rs's
// RopeScaling: wavelengths past orig / low divided by factor, below orig / high kept, between
// blended), or YaRN's when `yf` > 0 (cpu/rope.rs's Yarn: f / yf · ramp + f · (1 − ramp), the ramp
// rising from pair ylow to pair yhigh, both computed on the host).
__device__ __forceinline__ double rope_freq(long k, long rot, double base, double factor, double low, double high, double orig,
                                            double yf, double ylow, double yhigh, double ym) {
    double f = pow(base, -2.0 * (double)k / (double)rot);
    if (yf > 0.0) {
        double ramp = fmin(fmax(((double)k - ylow) / (yhigh - ylow), 0.0), 1.0);
        return f / yf * ramp + f * (1.0 - ramp);
    }
    if (factor <= 0.0) return f;
    double wavelen = 2.0 * 3.141592653589793 / f;
    if (wavelen < orig / high) return f;
    if (wavelen > orig / low) return f / factor;
    double smooth = (orig / wavelen - low) / (high - low);
    return (1.0 - smooth) * f / factor + smooth * f;
}

// The scalings' numbers as kernel parameters: Llama 3.1's four (factor 0: none), YaRN's factor
// (0: none), ramp ends and the factor `ym` on cos and sin (1 without YaRN), and the linear
// interpolation's divisor of positions `interp` (1 without).
#define ROPE_SCALE_PARAMS double factor, double low, double high, double orig, double yf, double ylow, double yhigh, double ym, double interp
#define ROPE_SCALE factor, low, high, orig, yf, ylow, yhigh, ym, interp

// Position of row p (cpu/rope.rs `RopeCfg::position`): from row `at` on (context parallelism's
// second chunk) the positions restart at `spos`; at ≥ t leaves every row at pos0 + p.
__device__ __forceinline__ long rope_pos(long p, long pos0, long at, long spos) { return p < at ? pos0 + p : spos + (p - at); }

// (cos, sin) of the angle of position `pos` (divided by `interp`) and pair k, computed in f64,
// rounded to f32 (cpu/rope.rs `RopeCfg::angle`).
__device__ __forceinline__ float2 rope_cs(long pos, long k, long rot, double base, ROPE_SCALE_PARAMS) {
    double ang = ((double)pos / interp) * rope_freq(k, rot, base, factor, low, high, orig, yf, ylow, yhigh, ym);
    return make_float2((float)(ym * cos(ang)), (float)(ym * sin(ang)));
}

#define ROPE(s, T) \
extern "C" __global__ void rope_##s(const T* x, T* y, long rows, long t, long h, long d, long rot, long pos0, long at, long spos, double base, ROPE_SCALE_PARAMS, float sign, long period, long il) { \
    long half = rot / 2, pass = d - rot; \
    GRID_STRIDE(idx, rows * h * (half + pass)) { \
        long k = idx % (half + pass), hr = idx / (half + pass), row = hr / h; \
        long base_i = hr * d; \
        if (rope_skip(hr % h, period)) continue; \
        if (k < half) { \
            float2 cs = rope_cs(rope_pos(row % t, pos0, at, spos), k, rot, base, ROPE_SCALE); \
            float c = cs.x, sn = sign * cs.y; \
            long ia = base_i + (il ? 2 * k : k), ib = base_i + (il ? 2 * k + 1 : k + half); \
            float a = ld(x, ia), b = ld(x, ib); \
            st(y, ia, a * c - b * sn); st(y, ib, b * c + a * sn); \
        } else if (x != y) { long j = rot + (k - half); st(y, base_i + j, ld(x, base_i + j)); } } }
FOR_TYPES(ROPE)

// cs[p · half + k] = rope_cs of row p's position and pair k (the one-element kernel's values).
extern "C" __global__ void rope_table(float2* cs, long t, long rot, long pos0, long at, long spos, double base, ROPE_SCALE_PARAMS) {
    long half = rot / 2;
    GRID_STRIDE(i, t * half) cs[i] = rope_cs(rope_pos(i / half, pos0, at, spos), i % half, rot, base, ROPE_SCALE);
}

// Eight pairs of v [16] rotated into w by the angles e[0..8] (float2 (cos, sin), read four at a
// time): rotate-half pairs (v[j], v[8 + j]) (v = x[k0..k0+8] then x[k0+half..k0+half+8]), or
// interleaved (v[2j], v[2j + 1]) (v = x[2k0..2k0+16]). A template so the indices are constants
// after unrolling and v, w stay in registers.
template <bool IL> __device__ __forceinline__ void rope8_rotate(const float* v, float* w, const float2* e, float sign) {
    const float4* e4 = reinterpret_cast<const float4*>(e);
    _Pragma("unroll") for (int j = 0; j < 8; j++) {
        const int a = IL ? 2 * j : j, b = IL ? 2 * j + 1 : 8 + j;
        float4 q = e4[j / 2];
        float c = (j & 1) ? q.z : q.x, sn = sign * ((j & 1) ? q.w : q.y);
        w[a] = v[a] * c - v[b] * sn; w[b] = v[b] * c + v[a] * sn;
    }
}

// Per (token, head): half / 8 groups of eight pairs, then (d − rot) / 8 groups copied through.
#define ROPE8(s, T) \
extern "C" __global__ void rope_##s##_v8(const T* x, T* y, const float2* cs, long rows, long t, long h, long d, long rot, float sign, long period, long il) { \
    long half = rot / 2, hc = half / 8, nc = hc + (d - rot) / 8; \
    GRID_STRIDE(idx, rows * h * nc) { \
        long c = idx % nc, hr = idx / nc, base_i = hr * d; \
        if (rope_skip(hr % h, period)) continue; \
        if (c < hc) { \
            long k0 = c * 8, lo = il ? 2 * k0 : k0, hi = il ? 2 * k0 + 8 : k0 + half; \
            float v[16], w[16]; \
            ld8(x, base_i + lo, v); ld8(x, base_i + hi, v + 8); \
            const float2* e = cs + ((hr / h) % t) * half + k0; \
            if (il) rope8_rotate<true>(v, w, e, sign); else rope8_rotate<false>(v, w, e, sign); \
            st8(y, base_i + lo, w); st8(y, base_i + hi, w + 8); \
        } else if (x != y) { \
            float v[8]; long j = rot + (c - hc) * 8; \
            ld8(x, base_i + j, v); st8(y, base_i + j, v); \
        } } }
FOR_TYPES(ROPE8)
