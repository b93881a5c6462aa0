//! Splitting the fused QKV projection into heads, in Megatron's grouped layout.
//!
//! Shapes: x, dx [N, Hkv·(G+2)·D] where each query group holds its G query heads, then its key head,
//! then its value head; q, dq [N, Hkv·G, D]; k, v, dk, dv [N, Hkv, D]. Merge is the exact inverse.

pub fn qkv_split<T: Copy>(x: &[T], hkv: usize, g: usize, d: usize, q: &mut [T], k: &mut [T], v: &mut [T]) {
    let w = hkv * (g + 2) * d;
    for (n, row) in x.chunks(w).enumerate() {
        for kv in 0..hkv {
            let grp = &row[kv * (g + 2) * d..(kv + 1) * (g + 2) * d];
            q[(n * hkv + kv) * g * d..(n * hkv + kv + 1) * g * d].copy_from_slice(&grp[..g * d]);
            k[(n * hkv + kv) * d..(n * hkv + kv + 1) * d].copy_from_slice(&grp[g * d..(g + 1) * d]);
            v[(n * hkv + kv) * d..(n * hkv + kv + 1) * d].copy_from_slice(&grp[(g + 1) * d..]);
        }
    }
}

pub fn qkv_merge<T: Copy>(q: &[T], k: &[T], v: &[T], hkv: usize, g: usize, d: usize, x: &mut [T]) {
    let w = hkv * (g + 2) * d;
    for (n, row) in x.chunks_mut(w).enumerate() {
        for kv in 0..hkv {
            let grp = &mut row[kv * (g + 2) * d..(kv + 1) * (g + 2) * d];
            grp[..g * d].copy_from_slice(&q[(n * hkv + kv) * g * d..(n * hkv + kv + 1) * g * d]);
            grp[g * d..(g + 1) * d].copy_from_slice(&k[(n * hkv + kv) * d..(n * hkv + kv + 1) * d]);
            grp[(g + 1) * d..].copy_from_slice(&v[(n * hkv + kv) * d..(n * hkv + kv + 1) * d]);
        }
    }
}
