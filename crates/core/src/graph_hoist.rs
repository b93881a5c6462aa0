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
//! uses a lane's scratch marks the capture before and after it is queued (`CudaDevice::
//! mark_capture`), so its nodes are those between the two marks. A memset node whose whole target
//! lies in lane k's range, with exactly one dependency P by a plain edge, then depends on every
//! node of lane k's previous piece of work instead of P (none before it: on nothing); each node
//! that depended on the memset depends on P too, so it still follows everything before it. With
//! two lanes used in turn, a product's memset runs beside the product before. Depending on each of
//! the piece's nodes, not only its last, keeps this right where the last was launched to overlap
//! the one before it (programmatic dependent launch: cuBLASLt's split-K reduction). A memset is
//! left in place where the chain behind it branches (a walk back that meets a node of several
//! dependencies) or where P is itself a node of that piece.
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

type Edge = sys::CUgraphEdgeData;

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

/// Where a mark sits: before a lane's work is queued, or after (`CudaDevice::mark_capture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    Before,
    After,
}

/// A node's neighbours on one side, with their edges' data (asked for with it: a captured graph
/// has edges of other kinds, which a query without it refuses as lossy).
unsafe fn edges(
    what: &str,
    f: impl Fn(*mut CUgraphNode, *mut Edge, *mut usize) -> CUresult,
) -> crate::Result<Vec<(CUgraphNode, Edge)>> {
    let mut n = 0usize;
    check(what, f(std::ptr::null_mut(), std::ptr::null_mut(), &mut n))?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    // SAFETY: plain C structs of bytes.
    let mut data: Vec<Edge> = (0..n).map(|_| unsafe { std::mem::zeroed() }).collect();
    if n > 0 {
        check(what, f(nodes.as_mut_ptr(), data.as_mut_ptr(), &mut n))?;
    }
    Ok(nodes.into_iter().zip(data).take(n).collect())
}

unsafe fn deps(node: CUgraphNode) -> crate::Result<Vec<(CUgraphNode, Edge)>> {
    // SAFETY (caller): `node` is a live node of the graph being edited.
    unsafe { edges("dependencies", |p, e, n| sys::cuGraphNodeGetDependencies_v2(node, p, e, n)) }
}

unsafe fn dependents(node: CUgraphNode) -> crate::Result<Vec<(CUgraphNode, Edge)>> {
    // SAFETY (caller): as `deps`.
    unsafe { edges("dependents", |p, e, n| sys::cuGraphNodeGetDependentNodes_v2(node, p, e, n)) }
}

fn plain(e: &Edge) -> bool {
    e.from_port == 0 && e.to_port == 0 && e.type_ == 0
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

/// The nodes of lane `lane`'s last piece of work before `p` (inclusive), walking back along the
/// chain: Some(nodes) (empty where no piece of that lane comes before), or None where the chain
/// branches first or `p` is itself inside that piece.
unsafe fn previous_piece(
    p: CUgraphNode,
    lane: u32,
    marks: &HashMap<usize, Vec<(u32, Mark)>>,
) -> crate::Result<Option<Vec<CUgraphNode>>> {
    let has = |n: CUgraphNode, m: Mark| marks.get(&(n as usize)).is_some_and(|v| v.contains(&(lane, m)));
    let (mut cur, mut piece, mut inside) = (Some(p), Vec::new(), false);
    // Outside the piece until its After mark; inside until its Before mark (or the start). The
    // Before mark on p itself is the memset's own piece's.
    while let Some(n) = cur {
        let before = n != p && has(n, Mark::Before);
        if inside && before {
            break;
        }
        if !inside && has(n, Mark::After) {
            inside = true;
        } else if !inside && before {
            return Ok(None); // p lies inside a piece of this lane
        }
        if inside {
            piece.push(n);
        }
        // SAFETY (caller): nodes of the graph being edited.
        cur = match unsafe { deps(n)? }[..] {
            [(d, _)] => Some(d),
            [] => None,
            _ => return Ok(None),
        };
    }
    Ok(Some(piece))
}

/// Moves the scratch memsets of `graph` (captured, not instantiated) off its chain (the module's
/// rule). `marks`: (lane, before or after, node) in capture order; `ranges`: [start, end) and lane.
///
/// # Safety
/// `graph` is a live graph no executable has been instantiated from yet, and the marks are its
/// nodes.
pub(crate) unsafe fn hoist(
    graph: CUgraph,
    marks: &[(u32, Mark, usize)],
    ranges: &[(u64, u64, u32)],
) -> crate::Result<Hoisted> {
    let mut done = Hoisted::default();
    if ranges.is_empty() {
        return Ok(done);
    }
    let mut by_node: HashMap<usize, Vec<(u32, Mark)>> = HashMap::new();
    for &(lane, m, n) in marks {
        by_node.entry(n).or_default().push((lane, m));
    }
    // SAFETY: the caller's graph; all nodes below are its own.
    let all = unsafe { nodes("nodes", |p, n| sys::cuGraphGetNodes(graph, p, n))? };
    // Every move is decided on the graph as captured, then applied.
    let mut moves = Vec::new();
    for &m in &all {
        let Some(lane) = (unsafe { memset_lane(m, ranges)? }) else { continue };
        done.memsets += 1;
        let before = unsafe { deps(m)? };
        let [(p, e)] = before[..] else { continue };
        if !plain(&e) {
            continue;
        }
        if let Some(piece) = unsafe { previous_piece(p, lane, &by_node)? }
            && !piece.contains(&p)
        {
            moves.push((m, p, piece, unsafe { dependents(m)? }));
        }
    }
    let edge = |what: &str, from: CUgraphNode, to: CUgraphNode, add: bool| {
        // SAFETY: both nodes belong to the caller's graph; a plain edge (no edge data).
        let r = unsafe {
            if add {
                sys::cuGraphAddDependencies_v2(graph, &from, &to, std::ptr::null(), 1)
            } else {
                sys::cuGraphRemoveDependencies_v2(graph, &from, &to, std::ptr::null(), 1)
            }
        };
        check(what, r)
    };
    for (m, p, piece, after) in moves {
        for (k, _) in after {
            if !unsafe { deps(k)? }.iter().any(|&(d, _)| d == p) {
                edge("adding the memset's predecessor to its successor", p, k, true)?;
            }
        }
        edge("removing the memset's dependency", p, m, false)?;
        for x in piece {
            edge("adding the lane's previous work", x, m, true)?;
        }
        done.moved += 1;
    }
    Ok(done)
}
