//! Shapes, strides and the layout of a tensor inside its storage.

use crate::{Error, Result};

/// Dimensions of a tensor, outermost first (row-major).
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn elem_count(&self) -> usize {
        self.0.iter().product()
    }

    /// Size of dimension `d`; negative values count from the end.
    pub fn dim(&self, d: isize) -> Result<usize> {
        let r = self.rank() as isize;
        let i = if d < 0 { r + d } else { d };
        if i < 0 || i >= r {
            return Err(Error::DimOutOfRange { dim: d, shape: self.clone() });
        }
        Ok(self.0[i as usize])
    }

    /// Last dimension (1 for a scalar).
    pub fn last(&self) -> usize {
        self.0.last().copied().unwrap_or(1)
    }

    /// Product of all dimensions but the last: the number of rows of a row-wise op.
    pub fn rows(&self) -> usize {
        let n = self.rank();
        if n == 0 { 1 } else { self.0[..n - 1].iter().product() }
    }

    /// Row-major strides in elements.
    pub fn contiguous_strides(&self) -> Vec<usize> {
        let mut s = vec![1; self.rank()];
        for i in (0..self.rank().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.0[i + 1];
        }
        s
    }
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape(d.to_vec())
    }
}
impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Self {
        Shape(d)
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Self {
        Shape(d.to_vec())
    }
}
impl From<usize> for Shape {
    fn from(d: usize) -> Self {
        Shape(vec![d])
    }
}
impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape(vec![])
    }
}

/// Where a tensor's elements sit inside its storage: shape, strides (in elements) and offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Shape,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout {
    pub fn contiguous(shape: Shape) -> Self {
        Self::contiguous_at(shape, 0)
    }

    pub fn contiguous_at(shape: Shape, offset: usize) -> Self {
        let strides = shape.contiguous_strides();
        Layout { shape, strides, offset }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// True when the elements are a dense row-major run starting at `offset`.
    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1;
        for (&d, &s) in self.shape.dims().iter().zip(&self.strides).rev() {
            if d != 1 && s != expect {
                return false;
            }
            expect *= d;
        }
        true
    }

    /// Range of storage elements covered, when contiguous.
    pub fn contiguous_range(&self) -> Option<std::ops::Range<usize>> {
        self.is_contiguous().then(|| self.offset..self.offset + self.shape.elem_count())
    }

    /// Swaps two dimensions without moving data.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Layout> {
        let r = self.shape.rank();
        if a >= r || b >= r {
            return Err(Error::DimOutOfRange { dim: a.max(b) as isize, shape: self.shape.clone() });
        }
        let mut dims = self.shape.dims().to_vec();
        let mut strides = self.strides.clone();
        dims.swap(a, b);
        strides.swap(a, b);
        Ok(Layout { shape: Shape(dims), strides, offset: self.offset })
    }

    /// Dimension `dim` cut to `range`, no data moved: a strided view (a matrix's columns).
    pub fn narrow(&self, dim: usize, range: std::ops::Range<usize>) -> Result<Layout> {
        let dims = self.shape.dims();
        if dim >= dims.len() {
            return Err(Error::DimOutOfRange { dim: dim as isize, shape: self.shape.clone() });
        }
        if range.start > range.end || range.end > dims[dim] {
            return Err(Error::IndexOutOfRange {
                op: "narrow",
                what: "the dimension's indices",
                index: range.end as u64,
                bound: dims[dim] as u64,
            });
        }
        let mut d = dims.to_vec();
        d[dim] = range.len();
        let offset = self.offset + range.start * self.strides[dim];
        Ok(Layout { shape: Shape(d), strides: self.strides.clone(), offset })
    }

    /// The elements as equal runs that are each contiguous in storage: (run length, each run's
    /// first storage index in row-major order). The run is the longest trailing block of
    /// dimensions laid out densely, so a transposed outer dimension gives few, long runs (a copy
    /// of them is a handful of device-to-device copies) and a transposed last dimension gives
    /// runs of one.
    pub fn runs(&self) -> (usize, Vec<usize>) {
        let dims = self.shape.dims();
        let (mut run, mut split) = (1usize, dims.len());
        for (i, (&d, &s)) in dims.iter().zip(&self.strides).enumerate().rev() {
            if d != 1 && s != run {
                break;
            }
            run *= d;
            split = i;
        }
        let outer = Layout {
            shape: Shape(dims[..split].to_vec()),
            strides: self.strides[..split].to_vec(),
            offset: self.offset,
        };
        (run, outer.storage_indices().collect())
    }

    /// Storage index of each element in row-major logical order.
    pub fn storage_indices(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.shape.elem_count();
        let dims = self.shape.dims();
        let mut idx = vec![0usize; dims.len()];
        let mut first = true;
        (0..n).map(move |_| {
            if first {
                first = false;
            } else {
                for d in (0..dims.len()).rev() {
                    idx[d] += 1;
                    if idx[d] < dims[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
            self.offset + idx.iter().zip(&self.strides).map(|(i, s)| i * s).sum::<usize>()
        })
    }
}

/// One rectangle of a strided copy (`copy_plan`), in elements: `rows` rows of `width`
/// consecutive elements, row i at `src + i·src_pitch` to `dst + i·dst_pitch` (a pitch is the
/// row's width where there is one row). On a GPU it is one `cuMemcpy2DAsync`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copy2d {
    pub dst: usize,
    pub src: usize,
    pub rows: usize,
    pub width: usize,
    pub dst_pitch: usize,
    pub src_pitch: usize,
}

/// The rectangles that copy every element of `src` to the same index of `dst` (same shape, any
/// strides). Dimensions that are dense together in both layouts merge first, so a block of
/// columns, or a chunk of the sequence of every sample, is one rectangle (or one a sample).
pub fn copy_plan(dst: &Layout, src: &Layout) -> Result<Vec<Copy2d>> {
    if dst.shape != src.shape {
        return Err(crate::shape_mismatch("copy_plan", &dst.shape, &src.shape));
    }
    // (size, dst stride, src stride), size-1 dimensions dropped, mergeable neighbours merged.
    let mut dims: Vec<(usize, usize, usize)> = Vec::new();
    for ((&n, &a), &b) in dst.shape.dims().iter().zip(&dst.strides).zip(&src.strides) {
        if n == 1 {
            continue;
        }
        match dims.last_mut() {
            Some(last) if last.1 == a * n && last.2 == b * n => *last = (last.0 * n, a, b),
            _ => dims.push((n, a, b)),
        }
    }
    if dst.shape.elem_count() == 0 {
        return Ok(Vec::new());
    }
    let width = match dims.last() {
        Some(&(n, 1, 1)) => {
            dims.pop();
            n
        }
        _ => 1,
    };
    let (rows, dp, sp) = dims.pop().unwrap_or((1, width, width));
    let (dp, sp) = if rows == 1 { (width, width) } else { (dp, sp) };
    let outer: usize = dims.iter().map(|d| d.0).product();
    let mut out = Vec::with_capacity(outer);
    let mut idx = vec![0usize; dims.len()];
    for _ in 0..outer {
        let (mut d, mut s) = (dst.offset, src.offset);
        for (i, &(_, a, b)) in idx.iter().zip(&dims) {
            d += i * a;
            s += i * b;
        }
        out.push(Copy2d { dst: d, src: s, rows, width, dst_pitch: dp, src_pitch: sp });
        for k in (0..dims.len()).rev() {
            idx[k] += 1;
            if idx[k] < dims[k].0 {
                break;
            }
            idx[k] = 0;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_and_counts() {
        let s = Shape::new([2, 3, 4]);
        assert_eq!(s.contiguous_strides(), vec![12, 4, 1]);
        assert_eq!(s.elem_count(), 24);
        assert_eq!(s.rows(), 6);
        assert_eq!(s.dim(-1).unwrap(), 4);
        assert!(s.dim(3).is_err());
        assert_eq!(Shape::from(()).elem_count(), 1);
    }

    #[test]
    fn transpose_is_strided_and_indices_follow() {
        let l = Layout::contiguous(Shape::new([2, 3]));
        assert!(l.is_contiguous());
        let t = l.transpose(0, 1).unwrap();
        assert!(!t.is_contiguous());
        assert_eq!(t.shape().dims(), &[3, 2]);
        let idx: Vec<usize> = t.storage_indices().collect();
        assert_eq!(idx, vec![0, 3, 1, 4, 2, 5]);
    }

    #[test]
    fn copy_plans_merge_what_is_dense_in_both() {
        let c = |d: Vec<usize>| Layout::contiguous(Shape::new(d));
        // Columns 2..5 of a [4, 8] matrix into a dense [4, 3]: one rectangle of 4 rows.
        let src = c(vec![4, 8]).narrow(1, 2..5).unwrap();
        let p = copy_plan(&c(vec![4, 3]), &src).unwrap();
        assert_eq!(p, vec![Copy2d { dst: 0, src: 2, rows: 4, width: 3, dst_pitch: 3, src_pitch: 8 }]);
        // A chunk of the sequence of every sample ([2, 6, 5] rows 3..6 into a dense [2, 3, 5]):
        // the chunk's rows and columns merge, one row a sample.
        let src = c(vec![2, 6, 5]).narrow(1, 3..6).unwrap();
        let p = copy_plan(&c(vec![2, 3, 5]), &src).unwrap();
        assert_eq!(p, vec![Copy2d { dst: 0, src: 15, rows: 2, width: 15, dst_pitch: 15, src_pitch: 30 }]);
        // Both strided, three dimensions left: one rectangle per outer index.
        let dst = c(vec![3, 4, 6]).narrow(2, 1..3).unwrap();
        let src = c(vec![3, 5, 2]).narrow(1, 1..5).unwrap();
        let p = copy_plan(&dst, &src).unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(p[2], Copy2d { dst: 49, src: 22, rows: 4, width: 2, dst_pitch: 6, src_pitch: 2 });
        // Dense both ways: one row of everything; a transposed last dimension: width 1.
        assert_eq!(copy_plan(&c(vec![2, 3]), &c(vec![2, 3])).unwrap().len(), 1);
        let t = c(vec![2, 3]).transpose(0, 1).unwrap();
        let p = copy_plan(&c(vec![3, 2]), &t).unwrap();
        let covered: Vec<(usize, usize)> = p
            .iter()
            .flat_map(|r| (0..r.rows).map(move |i| (r.dst + i * r.dst_pitch, r.src + i * r.src_pitch)))
            .collect();
        let want: Vec<(usize, usize)> = (0..6).zip(t.storage_indices()).collect();
        assert_eq!(covered, want);
        assert!(copy_plan(&c(vec![2, 3]), &c(vec![3, 2])).is_err());
    }

    #[test]
    fn runs_are_the_dense_trailing_blocks() {
        // [2, 3, 4] with its first two dims swapped: 6 runs of 4.
        let l = Layout::contiguous(Shape::new([2, 3, 4])).transpose(0, 1).unwrap();
        assert_eq!(l.runs(), (4, vec![0, 12, 4, 16, 8, 20]));
        // Contiguous: one run of everything (at the offset).
        assert_eq!(Layout::contiguous_at(Shape::new([2, 3]), 5).runs(), (6, vec![5]));
        // The last two dims swapped: runs of one element, in row-major order of the view.
        let t = Layout::contiguous(Shape::new([2, 3])).transpose(0, 1).unwrap();
        let (run, starts) = t.runs();
        assert_eq!((run, starts), (1, t.storage_indices().collect::<Vec<_>>()));
    }

    #[test]
    fn size_one_dims_do_not_break_contiguity() {
        let l = Layout::contiguous(Shape::new([1, 5, 1]));
        let t = l.transpose(0, 2).unwrap();
        assert!(t.is_contiguous());
    }
}
