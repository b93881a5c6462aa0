use crate::device_test;
use crate::util::*;
use ferrotron_core::Device;
use ferrotron_kernels as k;

device_test!(split_follows_megatron_group_layout_and_merge_inverts, |dev: &Device| {
    let (b, t, hkv, g, d) = (2, 3, 2, 3, 4);
    let w = hkv * (g + 2) * d;
    let x: Vec<f64> = (0..b * t * w).map(|i| i as f64).collect();
    let (q, kk, v) = k::qkv_split(&t32(dev, &x, &[b, t, w]), hkv, g, d).unwrap();
    let (q, kk, v) = (host(&q), host(&kk), host(&v));
    // Token n, kv group 1: q heads start at 1·(g+2)·d, then k, then v.
    let n = 4;
    let row = &x[n * w..(n + 1) * w];
    assert_eq!(&q[(n * hkv * g + g) * d..][..d], &row[(g + 2) * d..][..d]);
    assert_eq!(&kk[(n * hkv + 1) * d..][..d], &row[(g + 2) * d + g * d..][..d]);
    assert_eq!(&v[(n * hkv + 1) * d..][..d], &row[(g + 2) * d + (g + 1) * d..][..d]);
    let merged = k::qkv_merge(
        &t32(dev, &q, &[b, t, hkv * g, d]),
        &t32(dev, &kk, &[b, t, hkv, d]),
        &t32(dev, &v, &[b, t, hkv, d]),
    )
    .unwrap();
    assert_eq!(host(&merged), x);
});
