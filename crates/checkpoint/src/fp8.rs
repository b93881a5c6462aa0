//! Block-scaled FP8 weights as published by DeepSeek-V3, Kimi-K2 and Qwen3's `-FP8` models
//! (transformers' `quant_method: "fp8"`): a weight `name` is stored as `F8_E4M3` (the OCP "fn"
//! form: no infinities, 448 at most, 0x7F / 0xFF NaN) and `name_scale_inv` holds one f32 scale
//! per `[block_rows, block_cols]` tile of it (the last tiles may be partial), so that
//! `w[i, j] = q[i, j] · scale_inv[i / block_rows, j / block_cols]`.
//!
//! Only reading is here: the trainer imports such a folder as ordinary weights.

/// Why a block-scaled FP8 weight cannot be read.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Fp8Error {
    #[error("`{key}`: a block-scaled FP8 weight must be 2-D, not {shape:?}")]
    NotMatrix { key: String, shape: Vec<usize> },
    #[error("`{key}`: {found} FP8 bytes for shape {shape:?}")]
    Length { key: String, found: usize, shape: Vec<usize> },
    #[error(
        "`{key}`: its scales are {found:?} but a {shape:?} weight in blocks of {block:?} needs {want:?} (is weight_block_size in config.json the one of these weights?)"
    )]
    ScaleShape { key: String, found: Vec<usize>, shape: Vec<usize>, block: [usize; 2], want: Vec<usize> },
    #[error("weight_block_size {0:?} in config.json: both sides must be at least 1")]
    Block([usize; 2]),
}

/// One OCP E4M3 ("e4m3fn") byte as f32; exact (every value is an f32).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0x0f, b & 0x07);
    if e == 0x0f && m == 0x07 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m as f32 * (2f32).powi(-9) // subnormal: m/8 · 2^-6
    } else {
        (8 + m) as f32 * (2f32).powi(e as i32 - 10) // (1 + m/8) · 2^(e-7)
    };
    sign * mag
}

/// The scale tensor's shape for a `shape` weight in blocks of `block`.
pub fn scale_shape(shape: [usize; 2], block: [usize; 2]) -> Vec<usize> {
    vec![shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1])]
}

/// The f32 values of block-scaled FP8 weight `key`: `bytes` (row-major E4M3 of `shape`) times
/// its tile's entry of `scales` (of shape `scales_shape`).
pub fn dequantize_blocks(
    key: &str,
    bytes: &[u8],
    shape: &[usize],
    scales: &[f32],
    scales_shape: &[usize],
    block: [usize; 2],
) -> Result<Vec<f32>, Fp8Error> {
    if block[0] == 0 || block[1] == 0 {
        return Err(Fp8Error::Block(block));
    }
    let &[rows, cols] = shape else {
        return Err(Fp8Error::NotMatrix { key: key.into(), shape: shape.to_vec() });
    };
    if bytes.len() != rows * cols {
        return Err(Fp8Error::Length { key: key.into(), found: bytes.len(), shape: shape.to_vec() });
    }
    let want = scale_shape([rows, cols], block);
    if scales_shape != want.as_slice() || scales.len() != want[0] * want[1] {
        return Err(Fp8Error::ScaleShape {
            key: key.into(),
            found: scales_shape.to_vec(),
            shape: shape.to_vec(),
            block,
            want,
        });
    }
    // Table lookup: 256 entries, one multiply an element; rows on every core (a DeepSeek-V3
    // expert's 7168 × 2048 weights, thousands of them in a conversion).
    use rayon::prelude::*;
    let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    let mut out = vec![0f32; rows * cols];
    if cols > 0 {
        out.par_chunks_mut(cols).zip(bytes.par_chunks(cols)).enumerate().for_each(|(i, (o, row))| {
            let srow = &scales[(i / block[0]) * want[1]..][..want[1]];
            for (j, (o, &b)) in o.iter_mut().zip(row).enumerate() {
                *o = table[b as usize] * srow[j / block[1]];
            }
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_codes_are_the_ocp_fn_values() {
        // The float8 crate's E4M3 as an independent reading of the same format.
        for b in 0..=255u8 {
            let want = float8::F8E4M3::from_bits(b).to_f16().to_f32();
            let got = e4m3_to_f32(b);
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{b:#04x}: {got} vs {want}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    }

    #[test]
    fn each_tile_takes_its_own_scale_including_partial_ones() {
        // 5 × 7 in blocks of 2 × 3: scales 3 × 3, the last row and column of tiles partial.
        let (rows, cols, block) = (5, 7, [2, 3]);
        let bytes: Vec<u8> = (0..rows * cols).map(|k| [0x38u8, 0x40, 0xb8, 0x30][k % 4]).collect();
        let scales: Vec<f32> = (0..9).map(|k| (k + 1) as f32 * 0.5).collect();
        let w = dequantize_blocks("w", &bytes, &[rows, cols], &scales, &[3, 3], block).unwrap();
        for i in 0..rows {
            for j in 0..cols {
                let s = scales[(i / 2) * 3 + j / 3];
                assert_eq!(w[i * cols + j], e4m3_to_f32(bytes[i * cols + j]) * s, "({i}, {j})");
            }
        }
    }

    #[test]
    fn misshapen_inputs_are_named() {
        let e = dequantize_blocks("w", &[0; 12], &[3, 4], &[1.0; 2], &[1, 2], [2, 2]).unwrap_err();
        assert!(matches!(&e, Fp8Error::ScaleShape { want, .. } if want == &vec![2, 2]), "{e}");
        assert!(e.to_string().contains("weight_block_size"));
        let e = dequantize_blocks("w", &[0; 11], &[3, 4], &[1.0; 4], &[2, 2], [2, 2]).unwrap_err();
        assert!(matches!(e, Fp8Error::Length { found: 11, .. }));
        let e = dequantize_blocks("w", &[0; 12], &[12], &[1.0], &[1], [2, 2]).unwrap_err();
        assert!(matches!(e, Fp8Error::NotMatrix { .. }));
        assert_eq!(
            dequantize_blocks("w", &[0; 4], &[2, 2], &[1.0], &[1, 1], [0, 2]).unwrap_err(),
            Fp8Error::Block([0, 2])
        );
    }
}
