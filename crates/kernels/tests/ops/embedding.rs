use crate::device_test;
use crate::util::*;
use ferrotron_core::{DType, Device, Error, Tensor};
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

// Vocabulary shards of a table: the shards' lookups sum to the whole lookup; each shard's gradient
// is its rows of the whole gradient.
device_test!(vocab_shards_sum_to_the_whole, |dev: &Device| {
    let (v, c, parts) = (9usize, 4usize, 3usize);
    let table: Vec<f32> = randv(v * c, 5).iter().map(|&x| x as f32).collect();
    let ids = Tensor::from_vec(vec![0u32, 8, 3, 3, 5, 2], [2, 3], dev).unwrap();
    let dout =
        Tensor::from_f32(&randv(6 * c, 6).iter().map(|&x| x as f32).collect::<Vec<_>>(), [2, 3, c], DType::F32, dev)
            .unwrap();
    let whole = Tensor::from_f32(&table, [v, c], DType::F32, dev).unwrap();
    let want = k::embedding_fwd(&ids, &whole).unwrap().to_vec_f32().unwrap();
    let gwhole = Tensor::zeros([v, c], DType::F32, dev).unwrap();
    k::embedding_bwd(&ids, &dout, &gwhole).unwrap();
    let gwhole = gwhole.to_vec_f32().unwrap();
    let mut sum = vec![0f32; want.len()];
    let w = v / parts;
    for p in 0..parts {
        let shard = Tensor::from_f32(&table[p * w * c..(p + 1) * w * c], [w, c], DType::F32, dev).unwrap();
        let out = k::embedding_fwd_shard(&ids, &shard, p * w, v).unwrap().to_vec_f32().unwrap();
        sum.iter_mut().zip(&out).for_each(|(s, o)| *s += o);
        let g = Tensor::zeros([w, c], DType::F32, dev).unwrap();
        k::embedding_bwd_shard(&ids, &dout, &g, p * w, v).unwrap();
        assert_eq!(g.to_vec_f32().unwrap(), gwhole[p * w * c..(p + 1) * w * c].to_vec(), "shard {p}");
    }
    assert_eq!(sum, want);
    let too_big = Tensor::from_vec(vec![9u32], [1], dev).unwrap();
    let shard = Tensor::zeros([w, c], DType::F32, dev).unwrap();
    let e = k::embedding_fwd_shard(&too_big, &shard, 0, v).unwrap_err();
    assert!(e.to_string().contains('9'), "{e}");
});

// Deterministic mode on a GPU (`cuda::set_deterministic`): the scatter-add sums every row's
// positions in order, so the gradient equals the CPU's bit for bit, run after run, with many
// repeated ids, more positions than one 256-id chunk, and a shard of rows spanning several
// 64-row blocks.
#[cfg(feature = "cuda")]
#[test]
fn deterministic_scatter_add_equals_the_cpu_bit_for_bit() {
    let gpu = Device::cuda(0).expect("a CUDA device for the cuda tests");
    let (n, v, c, start) = (700usize, 150usize, 96usize, 20usize);
    let ids: Vec<u32> = (0..n).map(|i| ((i * 7919) % 23 + (i % 5) * 31) as u32 % v as u32).collect();
    let dout: Vec<f32> = randv(n * c, 3).iter().map(|&x| x as f32).collect();
    let g0: Vec<f32> = randv((v - start) * c, 4).iter().map(|&x| x as f32).collect();
    let run = |dev: &Device| {
        let g = Tensor::from_f32(&g0, [v - start, c], DType::F32, dev).unwrap();
        let idt = Tensor::from_vec(ids.clone(), [n], dev).unwrap();
        let d = Tensor::from_f32(&dout, [n, c], DType::F32, dev).unwrap();
        k::embedding_bwd_shard(&idt, &d, &g, start, v).unwrap();
        g.to_vec_f32().unwrap()
    };
    let cpu = run(&Device::Cpu);
    ferrotron_kernels::cuda::set_deterministic(true);
    let (a, b) = (run(&gpu), run(&gpu));
    ferrotron_kernels::cuda::set_deterministic(false);
    assert!(cpu.iter().zip(&g0).any(|(x, y)| x != y), "the gradient moved");
    assert_eq!(a, cpu, "deterministic CUDA scatter-add against the CPU");
    assert_eq!(a, b, "two deterministic runs");
}

// Learned position embeddings' backward (ids start..start + L in every batch row): each row of
// the table takes its batch's rows from its own value in batch order, the CPU's scatter-add loop
// to the bit (the whole table compared, so rows outside start..start + L must be untouched); a
// range past the table is an error naming the flag to raise.
device_test!(position_embedding_bwd_sums_the_batch_in_order, |dev: &Device| {
    let (b, l, c, p, start) = (3usize, 5usize, 24usize, 9usize, 2usize);
    let (dout, t0) = (randv(b * l * c, 11), randv(p * c, 12));
    let table = t32(dev, &t0, &[p, c]);
    k::position_embedding_bwd(&t32(dev, &dout, &[b, l, c]), &table, start).unwrap();
    let mut want: Vec<f32> = t0.iter().map(|&x| x as f32).collect();
    for bb in 0..b {
        for t in 0..l {
            for j in 0..c {
                want[(start + t) * c + j] += dout[(bb * l + t) * c + j] as f32;
            }
        }
    }
    let got = table.to_vec_f32().unwrap();
    assert_eq!(
        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    let e = k::position_embedding_bwd(&t32(dev, &dout, &[b, l, c]), &table, 5).unwrap_err();
    assert!(e.to_string().contains("--max-position-embeddings"), "{e}");
});
