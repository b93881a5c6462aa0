//! Takes the memsets of scratch memory off a captured graph's chain (feature `cuda`).
//!
//! Why: cuBLASLt's Hopper kernels come with a memset of a few bytes of their workspace, queued
//! just before the kernel. A captured step is one chain, so each product waits for its memset,
//! which waits for whatever kernel ran before: ≈ 2–3 µs of idle a product (benches/NOTES.md,
//! session 33: 0.3 ms of a 124M step's 0.44 ms idle sat beside those memsets). The memset only
//! needs the previous user of the same scratch to be done, so it can run beside the kernels
//! queued since.
//!
//! How (`begin` / `finish`, around each product: `CudaDevice::in_lane`): scratch ranges belong
//! to lanes (`CudaDevice::register_scratch`; the kernels give cuBLASLt two workspaces, one lane
//! each, taken in turn). While a step is captured, a product of lane k is queued with the
//! capture's dependencies set to the nodes of lane k's previous product (none before it: no
//! dependencies) instead of the node before it, P. Once queued, every node of the product but the
//! memsets of lane k's scratch gets an edge from P. So the product still follows everything before
//! it, and its memset only the previous user of the same workspace: with two lanes in turn it runs
//! beside the product before. (The edit happens during the capture, which allows adding edges:
//! the step's graph holds memory allocation nodes, and a graph that does refuses to remove any.)
//! The memset waits for each node of the lane's previous product, not only its last: cuBLASLt's
//! split-K reduction may be launched to overlap the product before it (programmatic dependent
//! launch). Where the capture has more than one node before the product, or one joined by an edge
//! of another kind, the product is queued as it comes.
//!
//! Architecture invariant: only memsets of registered scratch lose a dependency; every other node
//! keeps the ones it would have been captured with (P, directly), so no order among them is lost.

use cudarc::driver::sys::{self, CUgraph, CUgraphNode, CUresult};
use std::collections::{HashMap, HashSet};

/// What a capture's `in_lane` calls did: scratch memsets queued behind their lane's previous work
/// instead of the node before, and scratch memsets found.
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
/// A capture's graph and its current dependencies (with their edges).
type Capture = (CUgraph, Vec<(CUgraphNode, Edge)>);

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

/// The lanes' scratch and what the capture under way has queued in them.
#[derive(Default)]
pub(crate) struct Lanes {
    /// [start, end) and lane.
    pub ranges: Vec<(u64, u64, u32)>,
    /// Each lane's last product in this capture: its nodes (as addresses).
    prev: HashMap<u32, Vec<usize>>,
    pub done: Hoisted,
}

impl Lanes {
    /// A new capture: no product queued yet.
    pub fn start(&mut self) {
        self.prev.clear();
        self.done = Hoisted::default();
    }
}

/// What `begin` found: the graph, the capture's dependencies before the product, and P where the
/// product is queued behind its lane's previous one instead.
pub(crate) struct Pending {
    graph: CUgraph,
    before: Vec<(CUgraphNode, Edge)>,
    p: Option<CUgraphNode>,
}

/// The stream's capture: its graph and current dependencies (None when not capturing).
unsafe fn capture(stream: sys::CUstream) -> crate::Result<Option<Capture>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut graph: CUgraph = std::ptr::null_mut();
    let (mut deps, mut data, mut n): (*const CUgraphNode, *const Edge, usize) = (std::ptr::null(), std::ptr::null(), 0);
    // SAFETY (caller): a live stream; the out-pointers are valid.
    let r = unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            std::ptr::null_mut(),
            &mut graph,
            &mut deps,
            &mut data,
            &mut n,
        )
    };
    check("the capture's state", r)?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
        return Ok(None);
    }
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: the driver's arrays of n nodes (and n edges, or none: all plain).
        let e = if data.is_null() { unsafe { std::mem::zeroed() } } else { unsafe { *data.add(i) } };
        v.push((unsafe { *deps.add(i) }, e));
    }
    Ok(Some((graph, v)))
}

unsafe fn set_capture_deps(stream: sys::CUstream, deps: &[(CUgraphNode, Edge)]) -> crate::Result<()> {
    let (mut nodes, data): (Vec<CUgraphNode>, Vec<Edge>) = deps.iter().copied().unzip();
    let set = sys::CUstreamUpdateCaptureDependencies_flags::CU_STREAM_SET_CAPTURE_DEPENDENCIES as u32;
    // SAFETY (caller): a stream under capture; the nodes are its graph's.
    let r = unsafe {
        sys::cuStreamUpdateCaptureDependencies_v2(stream, nodes.as_mut_ptr(), data.as_ptr(), nodes.len(), set)
    };
    check("setting the capture's dependencies", r)
}

/// Before a product of `lane` is queued on `stream` under capture: sets the capture's dependencies
/// to the lane's previous product where the module's rule applies. None when not capturing.
///
/// # Safety
/// `stream` is live; `finish` follows once the product is queued (or failed).
pub(crate) unsafe fn begin(stream: sys::CUstream, lanes: &Lanes, lane: u32) -> crate::Result<Option<Pending>> {
    // SAFETY: the caller's stream.
    let Some((graph, before)) = (unsafe { capture(stream)? }) else { return Ok(None) };
    let p = match before[..] {
        [(p, e)] if plain(&e) => Some(p),
        _ => None,
    };
    if p.is_some() {
        let zero: Edge = unsafe { std::mem::zeroed() };
        let prev = lanes.prev.get(&lane).map_or(&[][..], |v| &v[..]);
        let to: Vec<_> = prev.iter().map(|&n| (n as CUgraphNode, zero)).collect();
        // SAFETY: the capture's stream; the nodes are its graph's (this capture's).
        unsafe { set_capture_deps(stream, &to)? };
    }
    Ok(Some(Pending { graph, before, p }))
}

/// After the product: its nodes (back from the capture's dependencies to those `begin` set),
/// an edge from P to each but the lane's scratch memsets, and the lane's last product noted.
///
/// # Safety
/// As `begin`, with its `Pending`.
pub(crate) unsafe fn finish(
    stream: sys::CUstream,
    lanes: &mut Lanes,
    lane: u32,
    pending: Pending,
) -> crate::Result<()> {
    let Pending { graph, before, p } = pending;
    // SAFETY: the caller's stream, still under capture.
    let Some((_, leaf)) = (unsafe { capture(stream)? }) else { return Ok(()) };
    let stop: HashSet<usize> = match p {
        Some(_) => lanes.prev.get(&lane).map_or_else(HashSet::new, |v| v.iter().copied().collect()),
        None => before.iter().map(|&(n, _)| n as usize).collect(),
    };
    // The product's nodes: back from the leaf to the nodes it was queued behind.
    let (mut piece, mut seen, mut todo) = (Vec::new(), HashSet::new(), Vec::new());
    todo.extend(leaf.iter().map(|&(n, _)| n).filter(|n| !stop.contains(&(*n as usize))));
    while let Some(n) = todo.pop() {
        if !seen.insert(n as usize) {
            continue;
        }
        piece.push(n);
        // SAFETY: a node of the graph under capture (reading it is allowed).
        for (d, _) in unsafe { deps(n)? } {
            if !stop.contains(&(d as usize)) {
                todo.push(d);
            }
        }
    }
    let Some(p) = p else {
        for &n in &piece {
            // SAFETY: nodes of the graph under capture.
            if unsafe { memset_lane(n, &lanes.ranges)? } == Some(lane) {
                lanes.done.memsets += 1;
            }
        }
        lanes.prev.insert(lane, piece.iter().map(|&n| n as usize).collect());
        return Ok(());
    };
    if piece.is_empty() {
        // Nothing queued: the capture goes on behind P, as before.
        // SAFETY: the capture's stream and its own nodes.
        return unsafe { set_capture_deps(stream, &before) };
    }
    for &n in &piece {
        // SAFETY: nodes of the graph under capture, which allows adding edges.
        if unsafe { memset_lane(n, &lanes.ranges)? } == Some(lane) {
            lanes.done.moved += 1;
            lanes.done.memsets += 1;
            continue;
        }
        if !unsafe { deps(n)? }.iter().any(|&(d, _)| d == p) {
            // SAFETY: as above; a plain edge.
            let r = unsafe { sys::cuGraphAddDependencies_v2(graph, &p, &n, std::ptr::null(), 1) };
            check("an edge from the node before the product", r)?;
        }
    }
    lanes.prev.insert(lane, piece.iter().map(|&n| n as usize).collect());
    Ok(())
}
