// Rotary embedding, rotate-half. Angles in f64 so that long positions match the CPU reference.
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
extern "C" __global__ void rope_##s(const T* x, T* y, long rows, long t, long h, long d, long rot, long pos0, long at, long spos, double base, ROPE_SCALE_PARAMS, float sign, long period) { \
    long half = rot / 2, pass = d - rot; \
    GRID_STRIDE(idx, rows * h * (half + pass)) { \
        long k = idx % (half + pass), hr = idx / (half + pass), row = hr / h; \
        long base_i = hr * d; \
        if (rope_skip(hr % h, period)) continue; \
        if (k < half) { \
            float2 cs = rope_cs(rope_pos(row % t, pos0, at, spos), k, rot, base, ROPE_SCALE); \
            float c = cs.x, sn = sign * cs.y; \
            float a = ld(x, base_i + k), b = ld(x, base_i + k + half); \
            st(y, base_i + k, a * c - b * sn); st(y, base_i + k + half, b * c + a * sn); \
        } else if (x != y) { long j = rot + (k - half); st(y, base_i + j, ld(x, base_i + j)); } } }
FOR_TYPES(ROPE)

// cs[p · half + k] = rope_cs of row p's position and pair k (the one-element kernel's values).
extern "C" __global__ void rope_table(float2* cs, long t, long rot, long pos0, long at, long spos, double base, ROPE_SCALE_PARAMS) {
    long half = rot / 2;
    GRID_STRIDE(i, t * half) cs[i] = rope_cs(rope_pos(i / half, pos0, at, spos), i % half, rot, base, ROPE_SCALE);
}

// Per (token, head): half / 8 groups of eight pairs, then (d − rot) / 8 groups copied through.
#define ROPE8(s, T) \
extern "C" __global__ void rope_##s##_v8(const T* x, T* y, const float2* cs, long rows, long t, long h, long d, long rot, float sign, long period) { \
    long half = rot / 2, hc = half / 8, nc = hc + (d - rot) / 8; \
    GRID_STRIDE(idx, rows * h * nc) { \
        long c = idx % nc, hr = idx / nc, base_i = hr * d; \
        if (rope_skip(hr % h, period)) continue; \
        if (c < hc) { \
            long k0 = c * 8; \
            float a[8], b[8], ya[8], yb[8]; \
            ld8(x, base_i + k0, a); ld8(x, base_i + k0 + half, b); \
            const float4* e = reinterpret_cast<const float4*>(cs + ((hr / h) % t) * half + k0); \
            _Pragma("unroll") for (int j = 0; j < 4; j++) { \
                float4 w = e[j]; \
                float c0 = w.x, s0 = sign * w.y, c1 = w.z, s1 = sign * w.w; \
                ya[2 * j] = a[2 * j] * c0 - b[2 * j] * s0; yb[2 * j] = b[2 * j] * c0 + a[2 * j] * s0; \
                ya[2 * j + 1] = a[2 * j + 1] * c1 - b[2 * j + 1] * s1; yb[2 * j + 1] = b[2 * j + 1] * c1 + a[2 * j + 1] * s1; \
            } \
            st8(y, base_i + k0, ya); st8(y, base_i + k0 + half, yb); \
        } else if (x != y) { \
            float v[8]; long j = rot + (c - hc) * 8; \
            ld8(x, base_i + j, v); st8(y, base_i + j, v); \
        } } }
FOR_TYPES(ROPE8)
