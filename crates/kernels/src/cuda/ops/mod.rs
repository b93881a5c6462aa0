//! CUDA implementations of the ops, called by the tensor-level functions after validation (so
//! shapes here are already checked). Same signatures and results as the CPU reference. One file per
//! op family (as kernels/*.cu); the launch helpers they share are here.

mod attention;
mod elementwise;
mod embedding;
mod fp8;
mod gemm;
pub(crate) mod gemm_ws;
mod loss;
mod moe;
mod norm;
mod optim;
mod ssm;

pub use attention::*;
pub use elementwise::*;
pub use embedding::*;
pub use fp8::*;
pub use gemm::*;
pub use loss::*;
pub use moe::*;
pub use norm::*;
pub use optim::*;
pub use ssm::*;

use super::{Arg, Backend, ptr};
use ferrotron_core::{DType, Device, Error, Result, Shape, Storage, Tensor};

type B = Backend;

fn sfx(op: &'static str, dt: DType) -> Result<&'static str> {
    match dt {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => Err(Error::NotImplemented { op, device: format!("cuda for {d}") }),
    }
}

/// A contiguous tensor's device address.
pub(crate) fn raw(op: &'static str, t: &Tensor) -> Result<u64> {
    match ptr(op, t)? {
        Arg::Ptr(p) => Ok(p),
        _ => Err(Error::NotContiguous { op }),
    }
}

/// A fresh output, not cleared (every kernel writing into one sets every element). With
/// poisoning on (tests), float outputs start as NaN so that a kernel that leaves an element
/// unwritten fails the comparison instead of passing on leftover memory.
pub(crate) fn new(be: &B, shape: impl Into<Shape>, dt: DType) -> Result<Tensor> {
    let t = Tensor::empty(shape, dt, &Device::Cuda(be.dev.clone()))?;
    if super::poisoning() && (dt == DType::F32 || dt == DType::BF16) {
        let name = format!("fill_{}", sfx("fill", dt)?);
        ew(be, &name, t.elem_count(), &[ptr("fill", &t)?, Arg::F32(f32::NAN), n(t.elem_count())])?;
    }
    Ok(t)
}

/// `t` as `dt`: itself when it is already, else a cast copy.
fn in_dtype(t: &Tensor, dt: DType) -> Result<Tensor> {
    if t.dtype() == dt { Ok(t.clone()) } else { crate::cast(t, dt) }
}

fn n(x: usize) -> Arg {
    Arg::I64(x as i64)
}

const NULL: Arg = Arg::Ptr(0);

/// A tensor's address, or a null pointer for an absent optional input (kernels test for null).
fn opt_ptr(op: &'static str, t: Option<&Tensor>) -> Result<Arg> {
    t.map_or(Ok(NULL), |t| ptr(op, t))
}

/// Elementwise launch over `len` elements.
fn ew(be: &B, name: &str, len: usize, args: &[Arg]) -> Result<()> {
    be.launch(name, Backend::grid_for(len), 256, 0, args)
}

/// Elementwise launch of a kernel with a `_v8` twin (eight elements per thread, 16-byte accesses):
/// the twin when `len` and `unit` (a span its groups of eight must not cross: a bias row, a SwiGLU
/// half; 8 when there is none) divide by 8 and every pointer is 16-byte aligned.
fn ew8(be: &B, name: &str, len: usize, unit: usize, args: &[Arg]) -> Result<()> {
    if len % 8 == 0 && unit % 8 == 0 && args_aligned16(args) {
        be.launch(&format!("{name}_v8"), Backend::grid_for(len / 8), 256, 0, args)
    } else {
        ew(be, name, len, args)
    }
}

/// Storage types the cast and accumulate kernels take (f16 too; the math kernels take f32/bf16).
fn sfx_storage(op: &'static str, dt: DType) -> Result<&'static str> {
    if dt == DType::F16 { Ok("f16") } else { sfx(op, dt) }
}

/// Rows per partial sum of the two-pass column sums (`COL_CHUNK` in kernels/common.cuh).
const COL_CHUNK: usize = 64;

/// The second pass of a column sum: `partials` [chunks, c] (chunk order) → `y` [c] (f32, or bf16
/// for a bf16 main_grad), added to y's values when `acc` (a main_grad view), else written.
fn col_sum_to(be: &B, partials: &Tensor, chunks: usize, c: usize, y: &Tensor, acc: bool) -> Result<()> {
    let args = [ptr("col_sum", partials)?, ptr("col_sum", y)?, n(chunks), n(c), Arg::I64(acc as i64)];
    be.launch(&format!("col_sum_{}", sfx("col_sum", y.dtype())?), c.div_ceil(32) as u32, 256, 0, &args)
}

/// The second passes of up to three column sums over the same chunks and width, in one launch
/// (kernels/common.cuh `col_sums3_*`, the same bits as one `col_sum_*` each): the tensors the
/// sums went to, in order. Destinations of different dtypes take a launch each.
fn col_sums(be: &B, sums: &[(&Tensor, SumTo)], chunks: usize, c: usize) -> Result<Vec<Tensor>> {
    if sums.is_empty() || sums.len() > 3 {
        return Err(Error::Cuda(format!("col_sums takes one to three sums, not {}", sums.len())));
    }
    let targets = sums.iter().map(|(_, to)| to.target(be, c)).collect::<Result<Vec<_>>>()?;
    let dtype = targets[0].0.dtype();
    if targets.iter().any(|(y, _)| y.dtype() != dtype) {
        for ((partials, _), (y, add)) in sums.iter().zip(&targets) {
            col_sum_to(be, partials, chunks, c, y, *add)?;
        }
        return Ok(targets.into_iter().map(|(y, _)| y).collect());
    }
    let mut args = Vec::with_capacity(9);
    let mut acc = 0i64;
    for (i, ((partials, _), (y, add))) in sums.iter().zip(&targets).enumerate() {
        acc |= (*add as i64) << i;
        args.extend([ptr("col_sums", partials)?, ptr("col_sums", y)?]);
    }
    // Unused slots repeat the first sum's pointers: no block reads them (the grid stops short).
    while args.len() < 6 {
        args.extend([args[0], args[1]]);
    }
    args.extend([n(chunks), n(c), Arg::I64(acc)]);
    let name = format!("col_sums3_{}", sfx("col_sums", dtype)?);
    be.launch(&name, (sums.len() * c.div_ceil(32)) as u32, 256, 0, &args)?;
    Ok(targets.into_iter().map(|(y, _)| y).collect())
}

/// Where a column sum goes: a new f32 tensor, added into an existing one, or stored over it.
#[derive(Clone, Copy)]
pub enum SumTo<'a> {
    New,
    Add(&'a Tensor),
    Write(&'a Tensor),
}

impl SumTo<'_> {
    /// The tensor the sums go to and whether they add into it.
    fn target(&self, be: &B, c: usize) -> Result<(Tensor, bool)> {
        Ok(match self {
            SumTo::New => (new(be, [c], DType::F32)?, false),
            SumTo::Add(y) => ((*y).clone(), true),
            SumTo::Write(y) => ((*y).clone(), false),
        })
    }

    /// The second pass into this destination; returns the tensor the sums went to.
    fn col_sum(&self, be: &B, partials: &Tensor, chunks: usize, c: usize) -> Result<Tensor> {
        let (y, acc) = self.target(be, c)?;
        col_sum_to(be, partials, chunks, c, &y, acc)?;
        Ok(y)
    }
}

/// The first pass of a column sum (`partials` [chunks, c]): the eight-wide kernel (a block of 8
/// warps per chunk and 256 columns, kernels/common.cuh `col_partials8`) when `c` divides by 8 and
/// every pointer is 16-byte aligned, else one thread per chunk and column.
fn col_partials(be: &B, name: &str, chunks: usize, c: usize, args: &[Arg]) -> Result<()> {
    if c % 8 == 0 && args_aligned16(args) {
        be.launch(&format!("{name}_v8"), (chunks * (c / 8).div_ceil(32)) as u32, 256, 0, args)
    } else {
        ew(be, name, chunks * c, args)
    }
}

fn rows_launch(be: &B, name: &str, rows: usize, args: &[Arg]) -> Result<()> {
    be.launch(name, rows as u32, 256, 0, args)
}

/// Whether every address among `args` is on a 16-byte boundary (null, for an absent input, is).
fn args_aligned16(args: &[Arg]) -> bool {
    args.iter().all(|a| !matches!(a, Arg::Ptr(p) if p % 16 != 0))
}

/// Whether every tensor in `ts` starts on a 16-byte boundary (the eight-wide kernels' accesses).
fn aligned16(ts: &[&Tensor]) -> Result<bool> {
    for t in ts {
        if !matches!(ptr("aligned16", t)?, Arg::Ptr(p) if p % 16 == 0) {
            return Ok(false);
        }
    }
    Ok(true)
}
