//! Joining and splitting along the last dimension with rectangle copies (`Tensor::copy_from` of
//! strided views): no kernel of their own, the same on every device.

use ferrotron_core::{Result, Tensor, invalid};

/// [a | b | …] along the last dim; the other dims must agree.
pub fn cat_last(parts: &[&Tensor]) -> Result<Tensor> {
    let first = parts.first().ok_or_else(|| invalid("cat_last", "nothing to join"))?;
    let lead = &first.dims()[..first.dims().len() - 1];
    if parts.iter().any(|p| &p.dims()[..p.dims().len() - 1] != lead || p.dtype() != first.dtype()) {
        let shapes: Vec<_> = parts.iter().map(|p| p.dims().to_vec()).collect();
        return Err(invalid("cat_last", format!("parts {shapes:?} differ outside the last dim")));
    }
    let last = lead.len();
    let mut dims = lead.to_vec();
    dims.push(parts.iter().map(|p| p.shape().last()).sum());
    let out = Tensor::empty(dims, first.dtype(), first.device())?;
    let mut at = 0;
    for p in parts.iter().filter(|p| p.elem_count() > 0) {
        let w = p.shape().last();
        out.narrow(last, at..at + w)?.copy_from(p)?;
        at += w;
    }
    Ok(out)
}

/// The consecutive parts of the last dim of the given widths (summing to it), each contiguous.
pub fn split_last(x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
    let last = x.shape().rank() - 1;
    if widths.iter().sum::<usize>() != x.shape().last() {
        return Err(invalid("split_last", format!("widths {widths:?} do not add up to {:?}'s last dim", x.dims())));
    }
    let mut at = 0;
    let mut out = Vec::with_capacity(widths.len());
    for &w in widths {
        let mut dims = x.dims().to_vec();
        dims[last] = w;
        let t = Tensor::empty(dims, x.dtype(), x.device())?;
        t.copy_from(&x.narrow(last, at..at + w)?)?;
        out.push(t);
        at += w;
    }
    Ok(out)
}

/// x with `extra` zeros after the last dim's values (x itself for none).
pub fn pad_last(x: &Tensor, extra: usize) -> Result<Tensor> {
    if extra == 0 {
        return Ok(x.clone());
    }
    let mut dims = x.dims().to_vec();
    *dims.last_mut().unwrap_or(&mut 0) = extra;
    cat_last(&[x, &Tensor::zeros(dims, x.dtype(), x.device())?])
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_core::Device;

    #[test]
    fn joining_and_splitting_are_inverse() {
        let a = Tensor::from_vec((0..12).map(|v| v as f32).collect(), [2, 3, 2], &Device::Cpu).unwrap();
        let b = Tensor::from_vec((100..106).map(|v| v as f32).collect(), [2, 3, 1], &Device::Cpu).unwrap();
        let c = cat_last(&[&a, &b]).unwrap();
        assert_eq!(c.dims(), [2, 3, 3]);
        assert_eq!(&c.to_vec_f32().unwrap()[..6], [0.0, 1.0, 100.0, 2.0, 3.0, 101.0]);
        let parts = split_last(&c, &[2, 1]).unwrap();
        assert_eq!(parts[0].to_vec_f32().unwrap(), a.to_vec_f32().unwrap());
        assert_eq!(parts[1].to_vec_f32().unwrap(), b.to_vec_f32().unwrap());
        assert!(split_last(&c, &[2, 2]).is_err());
        assert!(cat_last(&[&a, &a.reshape([3, 2, 2]).unwrap()]).is_err());
        let p = pad_last(&b, 2).unwrap();
        assert_eq!(&p.to_vec_f32().unwrap()[..6], [100.0, 0.0, 0.0, 101.0, 0.0, 0.0]);
    }
}
