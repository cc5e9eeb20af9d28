//! How a logical tensor goes from the memory-mapped checkpoint to its device with a bounded
//! host footprint (`materialize`, behind [`super::ReleaseCheckpoint::get`]; `docs/perf.md`
//! "Loading").
//!
//! | stored as | requested on | path | host memory beyond the mapped pages |
//! |---|---|---|---|
//! | plain (bf16, f32, ...) | CUDA | the mapped bytes copied to the device in their stored dtype, then cast there | none (a copy of the stored bytes only if the map is misaligned for the dtype) |
//! | plain | CPU, stored dtype | one copy into the tensor's buffer | the tensor itself |
//! | plain | CPU, another dtype | converted in chunks into the tensor's buffer | the tensor + one chunk |
//! | FP8 32×32, MXFP4 | CUDA, f32 / bf16 | the stored bytes copied to the device as u8, dequantized there (`Fp8Weight::dequantize`, `Mxfp4Weight::dequantize`: bit for bit the host's) | none |
//! | FP8 rows (Engram tables), other quantized cases | CUDA | dequantized on the host in chunks of rows, each cast and copied into the device tensor | one chunk |
//! | quantized | CPU, f32 | dequantized into the tensor's buffer | the tensor itself |
//! | quantized | CPU, another dtype | dequantized in chunks of rows, each cast into the tensor's buffer | the tensor + one chunk |
//!
//! A chunk holds at most [`STAGING_CHUNK_BYTES`] of f32 values (at least one row; for FP8 32×32
//! weights a multiple of 32 rows). Every value is the one the whole-tensor host path computes:
//! the same dequantization functions and the same casts, applied piecewise.

use candle_core::{DType, Device, Result, Tensor};

use super::checkpoint::{missing_scale, with_name, ReleaseCheckpoint};
use super::dequant::{blocks, dequant_fp8_block32, dequant_fp8_rows, dequant_mxfp4, BLOCK};
use super::error::LoadError;
use super::layout::{TensorInfo, WeightFormat};

/// Largest staging chunk, in bytes of f32 values (16 MiB): the host memory a conversion or
/// dequantization done on the host adds next to the tensor it fills.
pub const STAGING_CHUNK_BYTES: usize = 16 << 20;

/// The logical tensor of `info` as `dtype` on `device`, from the mapped bytes (see the module
/// docs for the path taken and its host memory).
pub(super) fn materialize(ckpt: &ReleaseCheckpoint, info: &TensorInfo, dtype: DType, device: &Device) -> Result<Tensor> {
    let w = ckpt.bytes_of(&info.stored)?;
    let s = match &info.scale {
        Some(scale) => Some(ckpt.bytes_of(scale)?),
        None => None,
    };
    stage(info, w, s, dtype, device, STAGING_CHUNK_BYTES)
}

/// [`materialize`] from the weight bytes `w` and scale bytes `s`, with chunks of at most `chunk`
/// bytes of f32 values.
fn stage(info: &TensorInfo, w: &[u8], s: Option<&[u8]>, dtype: DType, device: &Device, chunk: usize) -> Result<Tensor> {
    let name = info.name.as_str();
    if info.format == WeightFormat::Plain {
        let sd = info.stored.dtype.candle().ok_or_else(|| LoadError::BadFormat {
            name: name.to_string(),
            detail: format!("dtype {} is not supported", info.stored.dtype),
        })?;
        if device.is_cpu() && sd != dtype {
            return plain_in_chunks(w, sd, &info.shape, dtype, chunk);
        }
        // CUDA: the stored dtype goes over, any cast runs on the device.
        return Tensor::from_raw_buffer(w, sd, &info.shape, device)?.to_dtype(dtype);
    }
    let (out, inp) = match info.shape[..] {
        [out, inp] => (out, inp),
        ref shape => {
            return Err(LoadError::BadFormat { name: name.to_string(), detail: format!("quantized tensor of shape {shape:?}") }.into())
        }
    };
    let s = s.ok_or_else(|| missing_scale(name))?;
    #[cfg(feature = "cuda")]
    if let Some(t) = dequantize_on_device(info, w, s, (out, inp), dtype, device)? {
        return Ok(t);
    }
    if device.is_cpu() && dtype == DType::F32 {
        let v = decode(info.format, w, s, out, inp).map_err(|e| with_name(name, e))?;
        return Tensor::from_vec(v, (out, inp), device);
    }
    quantized_in_chunks(info, w, s, (out, inp), dtype, device, chunk)
}

/// A plain tensor of stored dtype `sd` cast to `dtype` on the CPU, chunk by chunk into the
/// result's buffer (no whole-tensor copy in the stored dtype next to it).
fn plain_in_chunks(w: &[u8], sd: DType, shape: &[usize], dtype: DType, chunk: usize) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let size = sd.size_in_bytes();
    let dst = Tensor::zeros(n, dtype, &Device::Cpu)?;
    let step = (chunk / 4).max(1);
    let mut start = 0;
    while start < n {
        let len = step.min(n - start);
        let bytes = w.get(start * size..(start + len) * size).ok_or_else(|| {
            candle_core::Error::Msg(format!("plain tensor {shape:?}: elements {start}..{} lie past its {} stored bytes", start + len, w.len()))
        })?;
        let piece = Tensor::from_raw_buffer(bytes, sd, &[len], &Device::Cpu)?.to_dtype(dtype)?;
        dst.slice_set(&piece, 0, start)?;
        start += len;
    }
    dst.reshape(shape)
}

/// The f32 values of rows `[out, inp]` of a quantized format from their weight and scale bytes.
fn decode(format: WeightFormat, w: &[u8], s: &[u8], out: usize, inp: usize) -> std::result::Result<Vec<f32>, LoadError> {
    match format {
        WeightFormat::Fp8Block32 => dequant_fp8_block32(w, s, out, inp),
        WeightFormat::Fp8Rows => dequant_fp8_rows(w, s, out, inp),
        WeightFormat::Mxfp4 => dequant_mxfp4(w, s, out, inp),
        WeightFormat::Plain => Err(LoadError::BadFormat { name: String::new(), detail: "a plain tensor has no dequantization".into() }),
    }
}

/// The byte ranges (weight, scale) of rows `r0 .. r1` of a quantized `[out, inp]` weight; for
/// FP8 32×32 weights `r0` is a multiple of 32.
fn row_ranges(format: WeightFormat, inp: usize, r0: usize, r1: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let sc = blocks(inp);
    match format {
        WeightFormat::Fp8Block32 => (r0 * inp..r1 * inp, (r0 / BLOCK) * sc..blocks(r1) * sc),
        WeightFormat::Mxfp4 => (r0 * inp / 2..r1 * inp / 2, r0 * sc..r1 * sc),
        _ => (r0 * inp..r1 * inp, r0 * sc..r1 * sc),
    }
}

/// A quantized weight dequantized on the host in chunks of rows, each cast to `dtype` and copied
/// into the result on `device`.
fn quantized_in_chunks(info: &TensorInfo, w: &[u8], s: &[u8], (out, inp): (usize, usize), dtype: DType, device: &Device, chunk: usize) -> Result<Tensor> {
    let name = info.name.as_str();
    let mut step = (chunk / (4 * inp.max(1))).max(1);
    if info.format == WeightFormat::Fp8Block32 {
        step = step.div_ceil(BLOCK) * BLOCK;
    }
    let dst = Tensor::zeros((out, inp), dtype, device)?;
    let mut r0 = 0;
    while r0 < out {
        let r1 = (r0 + step).min(out);
        let (wr, sr) = row_ranges(info.format, inp, r0, r1);
        let short = || LoadError::BadFormat { name: name.to_string(), detail: format!("rows {r0}..{r1} lie past the stored bytes") };
        let (wc, sc) = (w.get(wr).ok_or_else(short)?, s.get(sr).ok_or_else(short)?);
        let v = decode(info.format, wc, sc, r1 - r0, inp).map_err(|e| with_name(name, e))?;
        let piece = Tensor::from_vec(v, (r1 - r0, inp), &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?;
        dst.slice_set(&piece, 0, r0)?;
        r0 = r1;
    }
    Ok(dst)
}

/// On CUDA, an FP8 32×32 or MXFP4 weight (`inp` a multiple of 32) requested as f32 or bf16: its
/// stored bytes copied to the device as they are and dequantized there. `None` when the case is
/// not one of those.
#[cfg(feature = "cuda")]
fn dequantize_on_device(info: &TensorInfo, w: &[u8], s: &[u8], (out, inp): (usize, usize), dtype: DType, device: &Device) -> Result<Option<Tensor>> {
    use crate::quant::{Fp8Weight, Mxfp4Weight};
    if !device.is_cuda() || !matches!(dtype, DType::F32 | DType::BF16) {
        return Ok(None);
    }
    let Some(scale) = info.scale.as_ref() else { return Ok(None) };
    let upload = |bytes: &[u8], shape: &[usize]| Tensor::from_raw_buffer(bytes, DType::U8, shape, device);
    match info.format {
        WeightFormat::Fp8Block32 => {
            let wt = Fp8Weight::new(upload(w, &[out, inp])?, upload(s, &scale.shape)?)?;
            Ok(Some(wt.dequantize(dtype)?))
        }
        WeightFormat::Mxfp4 if inp.is_multiple_of(BLOCK) => {
            let wt = Mxfp4Weight::new(upload(w, &info.stored.shape)?, upload(s, &scale.shape)?)?;
            Ok(Some(wt.dequantize(dtype)?))
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::layout::StoredTensor;
    use crate::loader::StoredDtype;

    /// Deterministic bytes (xorshift); scale bytes kept in 100..140, no NaN e4m3 codes.
    fn bytes(seed: u64, n: usize, scale: bool) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let b = (x >> 24) as u8;
                if scale {
                    100 + b % 40
                } else if b & 0x7f == 0x7f {
                    b & 0xf0
                } else {
                    b
                }
            })
            .collect()
    }

    fn stored(name: &str, dtype: StoredDtype, shape: &[usize]) -> StoredTensor {
        StoredTensor { name: name.into(), file: "mem".into(), dtype, shape: shape.to_vec(), byte_range: 0..0 }
    }

    fn info(format: WeightFormat, shape: [usize; 2], w: StoredTensor, s: Option<StoredTensor>) -> TensorInfo {
        TensorInfo { name: w.name.clone(), format, shape: shape.to_vec(), stored: w, scale: s }
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
    }

    /// Every chunked path gives the whole-tensor host path's values bit for bit (the f32
    /// dequantization or the stored values, cast to the dtype), over many chunks with a partial
    /// last one, for every format, bf16 and f32 results on the CPU.
    #[test]
    fn chunks_give_the_whole_tensor_values() -> anyhow::Result<()> {
        let cpu = Device::Cpu;
        let (o, i) = (70, 96);
        let fp8 = info(
            WeightFormat::Fp8Block32,
            [o, i],
            stored("a.weight", StoredDtype::F8E4M3, &[o, i]),
            Some(stored("a.scale", StoredDtype::F8E8M0, &[blocks(o), blocks(i)])),
        );
        let (fw, fs) = (bytes(1, o * i, false), bytes(2, blocks(o) * blocks(i), true));
        let rows = info(WeightFormat::Fp8Rows, [37, 40], stored("b.weight", StoredDtype::F8E4M3, &[37, 40]), Some(stored("b.scale", StoredDtype::F8E8M0, &[37, 2])));
        let (rw, rs) = (bytes(3, 37 * 40, false), bytes(4, 37 * 2, true));
        let fp4 = info(WeightFormat::Mxfp4, [33, 64], stored("c.weight", StoredDtype::I8, &[33, 32]), Some(stored("c.scale", StoredDtype::F8E8M0, &[33, 2])));
        let (mw, ms) = (bytes(5, 33 * 32, false), bytes(6, 33 * 2, true));
        for dtype in [DType::F32, DType::BF16] {
            for (t, w, s) in [(&fp8, &fw, &fs), (&rows, &rw, &rs), (&fp4, &mw, &ms)] {
                let (out, inp) = (t.shape[0], t.shape[1]);
                let want = Tensor::from_vec(decode(t.format, w, s, out, inp)?, (out, inp), &cpu)?.to_dtype(dtype)?;
                // One row of f32 per chunk (FP8 32x32: 32 rows), and the default chunk.
                for chunk in [4 * inp, 3 * 4 * inp + 5, STAGING_CHUNK_BYTES] {
                    let got = stage(t, w, Some(s), dtype, &cpu, chunk)?;
                    assert_eq!((got.dims(), got.dtype()), (&[out, inp][..], dtype));
                    assert_eq!(bits(&got), bits(&want), "{:?} {dtype:?} chunk {chunk}", t.format);
                }
                let got = quantized_in_chunks(t, w, s, (out, inp), dtype, &cpu, 4 * inp)?;
                assert_eq!(bits(&got), bits(&want), "{:?} {dtype:?} forced chunks", t.format);
            }
        }
        // Plain tensors: bf16 stored, f32 wanted and the reverse, 1 to 3 elements per chunk.
        let v: Vec<f32> = (0..35).map(|k| (k as f32 - 17.3) * 0.37).collect();
        for (sd, want_dtype) in [(DType::BF16, DType::F32), (DType::F32, DType::BF16), (DType::BF16, DType::BF16)] {
            let src = Tensor::from_vec(v.clone(), (5, 7), &cpu)?.to_dtype(sd)?;
            let raw: Vec<u8> = match sd {
                DType::BF16 => src.flatten_all()?.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
                _ => src.flatten_all()?.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            let st = if sd == DType::BF16 { StoredDtype::BF16 } else { StoredDtype::F32 };
            let t = TensorInfo { name: "p".into(), format: WeightFormat::Plain, shape: vec![5, 7], stored: stored("p", st, &[5, 7]), scale: None };
            for chunk in [4, 12, 1 << 20] {
                let got = stage(&t, &raw, None, want_dtype, &cpu, chunk)?;
                assert_eq!((got.dims(), got.dtype()), (&[5, 7][..], want_dtype));
                assert_eq!(bits(&got), bits(&src.to_dtype(want_dtype)?), "{sd:?} -> {want_dtype:?} chunk {chunk}");
            }
        }
        Ok(())
    }

    /// Missing scales and bytes shorter than the shape are errors naming the tensor, not panics.
    #[test]
    fn short_buffers_are_errors() {
        let t = info(WeightFormat::Fp8Rows, [4, 32], stored("d.weight", StoredDtype::F8E4M3, &[4, 32]), None);
        let e = stage(&t, &[0; 128], None, DType::BF16, &Device::Cpu, 64).unwrap_err().to_string();
        assert!(e.contains("d.weight"), "{e}");
        let t = info(WeightFormat::Fp8Rows, [4, 32], stored("d.weight", StoredDtype::F8E4M3, &[4, 32]), Some(stored("d.scale", StoredDtype::F8E8M0, &[4, 1])));
        let e = stage(&t, &[0; 100], Some(&[127; 4]), DType::BF16, &Device::Cpu, 128).unwrap_err().to_string();
        assert!(e.contains("d.weight"), "{e}");
        let p = TensorInfo { name: "p".into(), format: WeightFormat::Plain, shape: vec![8], stored: stored("p", StoredDtype::BF16, &[8]), scale: None };
        assert!(stage(&p, &[0; 10], None, DType::F32, &Device::Cpu, 8).is_err());
    }
}
