// Rotary embedding, rotate-half: one thread per (token, head, pair). Angles in f64 so that long
// positions match the CPU reference.

#define ROPE(s, T) \
extern "C" __global__ void rope_##s(const T* x, T* y, long rows, long t, long h, long d, long rot, long pos0, double base, float sign) { \
    long half = rot / 2, pass = d - rot; \
    GRID_STRIDE(idx, rows * h * (half + pass)) { \
        long k = idx % (half + pass), hr = idx / (half + pass), row = hr / h; \
        long base_i = hr * d; \
        if (k < half) { \
            double ang = (double)(pos0 + row % t) * pow(base, -2.0 * (double)k / (double)rot); \
            float c = (float)cos(ang), sn = sign * (float)sin(ang); \
            float a = ld(x, base_i + k), b = ld(x, base_i + k + half); \
            st(y, base_i + k, a * c - b * sn); st(y, base_i + k + half, b * c + a * sn); \
        } else { long j = rot + (k - half); st(y, base_i + j, ld(x, base_i + j)); } } }
FOR_TYPES(ROPE)
