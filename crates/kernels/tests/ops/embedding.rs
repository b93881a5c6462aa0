use crate::device_test;
use crate::util::*;
use ferrotron_core::{Device, Error, Tensor};
use ferrotron_kernels as k;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn lookup_and_scatter_add_match_naive(n in 1usize..9, v in 1usize..6, c in 1usize..5, seed: u64) {
        let dev = Device::Cpu;
        let ids: Vec<u32> = randv(n, seed).iter().map(|x| ((x.abs() * 1000.0) as usize % v) as u32).collect();
        let (table, dout, g0) = (randv(v * c, seed ^ 1), randv(n * c, seed ^ 2), randv(v * c, seed ^ 3));
        let idt = Tensor::from_vec(ids.clone(), [n], &dev).unwrap();
        let out = k::embedding_fwd(&idt, &t32(&dev, &table, &[v, c])).unwrap();
        let want: Vec<f64> = ids.iter().flat_map(|&i| table[i as usize * c..(i as usize + 1) * c].to_vec()).collect();
        assert_close(&host(&out), &want, 0.0, 1e-7, "lookup");
        // Backward: the gradient of Σ out·dout w.r.t. the table, added onto g0.
        let g = t32(&dev, &g0, &[v, c]);
        k::embedding_bwd(&idt, &t32(&dev, &dout, &[n, c]), &g).unwrap();
        let mut want = g0.clone();
        for (row, &i) in ids.iter().enumerate() {
            for e in 0..c {
                want[i as usize * c + e] += dout[row * c + e];
            }
        }
        assert_close(&host(&g), &want, 1e-6, 1e-6, "scatter-add");
    }
}

device_test!(out_of_range_id_names_id_and_vocab, |dev: &Device| {
    let ids = Tensor::from_vec(vec![0u32, 7, 2], [3], dev).unwrap();
    let e = k::embedding_fwd(&ids, &t32(dev, &randv(10, 0), &[5, 2])).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { index: 7, bound: 5, .. }), "{e}");
    assert!(e.to_string().contains("embedding_fwd"), "{e}");
});
