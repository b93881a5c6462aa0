//! `GptModel::set_context_parallel_by_layer`: each decoder layer's attention gets its own entry
//! of the per-layer --cp-comm-type list (numerically the two exchanges agree, so this is checked
//! on the modules, not on losses), and a sliding window is refused unless every layer with
//! attention trades heads.

mod common;

use common::config;
use ferrotron_comm::{all_ok, run_ranks};
use ferrotron_core::{DType, Device};
use ferrotron_parallel::{ContextParallel, CpCommType};
use ferrotron_transformer::GptModel;
use std::time::Duration;

#[test]
fn each_layer_takes_its_own_exchange() {
    use CpCommType::{AllGather, AllToAll};
    let got = all_ok(run_ranks(2, Duration::from_secs(10), |_, comm| {
        let cp = ContextParallel::new(comm);
        let mut kinds = vec![];
        for list in [[AllToAll, AllGather], [AllGather, AllToAll]] {
            let (mut m, _) = GptModel::build(config(true), &Device::Cpu, DType::F32, 1).unwrap();
            m.set_context_parallel_by_layer(cp.clone(), &list).unwrap();
            let layers = m.chunks.iter_mut().flat_map(|b| b.layers.iter_mut());
            kinds.push(layers.map(|l| l.attention_mut().unwrap().cp.as_ref().unwrap().kind).collect::<Vec<_>>());
        }
        let mut windowed = config(true);
        windowed.layer.attention.window = Some(3);
        let mixed = GptModel::build(windowed.clone(), &Device::Cpu, DType::F32, 1)
            .unwrap()
            .0
            .set_context_parallel_by_layer(cp.clone(), &[AllToAll, AllGather])
            .unwrap_err()
            .to_string();
        let ok = GptModel::build(windowed, &Device::Cpu, DType::F32, 1)
            .unwrap()
            .0
            .set_context_parallel_by_layer(cp.clone(), &[AllToAll, AllToAll])
            .is_ok();
        let short = GptModel::build(config(true), &Device::Cpu, DType::F32, 1)
            .unwrap()
            .0
            .set_context_parallel_by_layer(cp, &[AllToAll])
            .unwrap_err()
            .to_string();
        Ok::<_, ferrotron_core::Error>((kinds, mixed, ok, short))
    }))
    .unwrap();
    let (kinds, mixed, ok, short) = &got[0];
    assert_eq!(kinds, &[vec![AllToAll, AllGather], vec![AllGather, AllToAll]]);
    assert!(mixed.contains("--window-size") && mixed.contains("--cp-comm-type a2a"), "{mixed}");
    assert!(ok, "a window with the all-to-all in every layer");
    assert!(short.contains("1 types for 2 layers"), "{short}");
}
