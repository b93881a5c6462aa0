//! Takes the memsets of scratch memory off a captured graph's chain (feature `cuda`).
//!
//! Why: cuBLASLt's Hopper kernels come with a memset of a few bytes of their workspace, queued
//! just before the kernel. A captured step is one chain, so each product waits for its memset,
//! which waits for whatever kernel ran before: ≈ 2–3 µs of idle a product (benches/NOTES.md,
//! session 33: 0.3 ms of a 124M step's 0.44 ms idle sat beside those memsets). The memset only
//! needs the previous user of the same scratch to be done, so it can run beside the kernels
//! queued since.
//!
//! The rule (`hoist`): scratch ranges belong to lanes (`CudaDevice::register_scratch`); work that
//! uses a lane's scratch marks the capture after it is queued (`CudaDevice::mark_capture`). A
//! memset node whose whole target lies in lane k's range, with exactly one dependency P, gets as
//! its one dependency the nearest mark of lane k before it (none: the graph's start) instead of
//! P; each node that depended on the memset now depends on P too, so it still follows everything
//! before it. With two lanes used in turn, a product's memset then runs beside the product before.
//! A memset is left in place where the chain behind it branches (a walk back that meets a node of
//! several dependencies) or where the mark is P itself.
//!
//! Architecture invariant: only memsets inside a registered range lose a dependency; every other
//! node keeps the ones it was captured with (a moved memset's successors gain its predecessor),
//! so no order among them is lost.

use cudarc::driver::sys::{self, CUgraph, CUgraphNode, CUresult};
use std::collections::HashMap;

/// What `hoist` did: memsets moved off the chain, and memsets found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hoisted {
    pub moved: usize,
    pub memsets: usize,
}

fn check(what: &str, r: CUresult) -> crate::Result<()> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(crate::Error::Cuda(format!("editing the captured graph ({what}): {e:?}"))),
    }
}

/// A node list filled by a driver call that takes (buffer, count in/out): asked once for the
/// count, then for the nodes.
unsafe fn nodes(what: &str, f: impl Fn(*mut CUgraphNode, *mut usize) -> CUresult) -> crate::Result<Vec<CUgraphNode>> {
    let mut n = 0usize;
    check(what, f(std::ptr::null_mut(), &mut n))?;
    let mut v = vec![std::ptr::null_mut(); n];
    if n > 0 {
        check(what, f(v.as_mut_ptr(), &mut n))?;
        v.truncate(n);
    }
    Ok(v)
}

unsafe fn deps(node: CUgraphNode) -> crate::Result<Vec<CUgraphNode>> {
    // SAFETY (caller): `node` is a live node of the graph being edited.
    unsafe { nodes("dependencies", |p, n| sys::cuGraphNodeGetDependencies_v2(node, p, std::ptr::null_mut(), n)) }
}

unsafe fn dependents(node: CUgraphNode) -> crate::Result<Vec<CUgraphNode>> {
    // SAFETY (caller): as `deps`.
    unsafe { nodes("dependents", |p, n| sys::cuGraphNodeGetDependentNodes_v2(node, p, std::ptr::null_mut(), n)) }
}

/// The lane whose range holds a memset node's whole target, if any.
unsafe fn memset_lane(node: CUgraphNode, ranges: &[(u64, u64, u32)]) -> crate::Result<Option<u32>> {
    let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY (caller): a live node; the out-pointers are valid.
    unsafe { check("node type", sys::cuGraphNodeGetType(node, &mut t))? };
    if t != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET {
        return Ok(None);
    }
    // SAFETY: a plain C struct of integers and a pointer, for the driver to fill.
    let mut p: sys::CUDA_MEMSET_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: a memset node (checked above).
    unsafe { check("memset parameters", sys::cuGraphMemsetNodeGetParams(node, &mut p))? };
    let rows = p.height.max(1) as u64;
    let row_bytes = p.width as u64 * p.elementSize as u64;
    let end = p.dst + (rows - 1) * p.pitch as u64 + row_bytes;
    Ok(ranges.iter().find(|&&(s, e, _)| p.dst >= s && end <= e).map(|&(_, _, lane)| lane))
}

/// Moves the scratch memsets of `graph` (captured, not instantiated) off its chain (the module's
/// rule). `marks`: (lane, node) in capture order; `ranges`: [start, end) and lane.
///
/// # Safety
/// `graph` is a live graph no executable has been instantiated from yet, and the marks are its
/// nodes.
pub(crate) unsafe fn hoist(
    graph: CUgraph,
    marks: &[(u32, usize)],
    ranges: &[(u64, u64, u32)],
) -> crate::Result<Hoisted> {
    let mut done = Hoisted::default();
    if ranges.is_empty() {
        return Ok(done);
    }
    let mark_of: HashMap<usize, u32> = marks.iter().map(|&(lane, n)| (n, lane)).collect();
    // SAFETY: the caller's graph.
    let all = unsafe { nodes("nodes", |p, n| sys::cuGraphGetNodes(graph, p, n))? };
    // Every move is decided on the graph as captured, then applied.
    let mut moves = Vec::new();
    for &m in &all {
        // SAFETY: nodes of the caller's graph, here and below.
        let Some(lane) = (unsafe { memset_lane(m, ranges)? }) else { continue };
        done.memsets += 1;
        let before = unsafe { deps(m)? };
        let [p] = before[..] else { continue };
        // Back along the chain to lane's last mark.
        let (mut cur, mut target) = (p, None);
        loop {
            if mark_of.get(&(cur as usize)) == Some(&lane) {
                target = Some(Some(cur));
                break;
            }
            match unsafe { deps(cur)? }[..] {
                [d] => cur = d,
                [] => {
                    target = Some(None);
                    break;
                }
                _ => break,
            }
        }
        match target {
            Some(Some(x)) if x == p => {}
            Some(x) => moves.push((m, p, x, unsafe { dependents(m)? })),
            None => {}
        }
    }
    let edge = |what: &str, from: CUgraphNode, to: CUgraphNode, add: bool| {
        // SAFETY: both nodes belong to the caller's graph; no edge data (the default edge).
        let r = unsafe {
            if add {
                sys::cuGraphAddDependencies_v2(graph, &from, &to, std::ptr::null(), 1)
            } else {
                sys::cuGraphRemoveDependencies_v2(graph, &from, &to, std::ptr::null(), 1)
            }
        };
        check(what, r)
    };
    for (m, p, x, after) in moves {
        for k in after {
            // SAFETY: a node of the caller's graph.
            if !unsafe { deps(k)? }.contains(&p) {
                edge("adding the memset's predecessor to its successor", p, k, true)?;
            }
        }
        edge("removing the memset's dependency", p, m, false)?;
        if let Some(x) = x {
            edge("adding the lane's last mark", x, m, true)?;
        }
        done.moved += 1;
    }
    Ok(done)
}
