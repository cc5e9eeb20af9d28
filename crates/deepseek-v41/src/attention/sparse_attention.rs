//! Sparse attention with a per-head sink over gathered KV rows (spec §4.7, §0.1b.6).
//!
//! For query token t, head h and the valid indices `s` of `indices[t]` (−1 = none, duplicates
//! count twice, no dedupe):
//!
//! ```text
//! ℓ_s = scale · q[t,h]·kv[s]          (f32)
//! m   = max_s ℓ_s                      (valid s only; −1e30 floor for an empty row)
//! out = Σ_s e^{ℓ_s−m}·kv[s] / (Σ_s e^{ℓ_s−m} + e^{sink[h]−m})
//! ```
//!
//! K = V = the same row. The sink is a logit in the denominator only (not scaled); a row with no
//! valid index yields zeros. Like the reference kernel, the probabilities multiplying V are
//! rounded to bf16 per block of 64 indices relative to the running max, while the denominator
//! sums the f32 probabilities; the output is rounded to bf16 (returned in `q`'s dtype).

use candle_core::{DType, Device, Result, Tensor};

/// Index block over which the reference kernel keeps one running max.
pub const SOFTMAX_BLOCK: usize = 64;

/// Checked entry point. `q`: `[T, H, d]`; `kv`: `[N, d]`; `indices`: `[T, K]` i64 (−1 = none,
/// otherwise `< N`); `sink`: `[H]` f32 (−inf = no sink). Returns `[T, H, d]` in `q`'s dtype.
pub fn sparse_attention(q: &Tensor, kv: &Tensor, indices: &Tensor, sink: &Tensor, scale: f32) -> Result<Tensor> {
    let (t, h, d) = q.dims3()?;
    let (n, kd) = kv.dims2()?;
    let (ti, _k) = indices.dims2()?;
    if kd != d || ti != t || sink.dims1()? != h {
        candle_core::bail!(
            "sparse_attention: q {:?}, kv {:?}, indices {:?}, sink {:?} disagree (want q [T,H,d], kv [N,d], indices [T,K], sink [H])",
            q.shape(),
            kv.shape(),
            indices.shape(),
            sink.shape()
        )
    }
    if indices.dtype() != DType::I64 {
        candle_core::bail!("sparse_attention: indices must be i64, got {:?}", indices.dtype())
    }
    let idx = indices.to_vec2::<i64>()?;
    if let Some((r, &bad)) =
        idx.iter().enumerate().find_map(|(r, row)| row.iter().find(|&&i| i < -1 || i >= n as i64).map(|b| (r, b)))
    {
        candle_core::bail!("sparse_attention: indices[{r}] holds {bad}, outside -1..{n}")
    }
    sparse_attention_ref(q, kv, &idx, sink, scale)
}

/// CPU reference (plain host loops in f32); inputs as [`sparse_attention`], indices already on
/// the host and validated.
pub fn sparse_attention_ref(q: &Tensor, kv: &Tensor, indices: &[Vec<i64>], sink: &Tensor, scale: f32) -> Result<Tensor> {
    let (t, h, d) = q.dims3()?;
    let qv = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let kvv = kv.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let sinkv = sink.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let mut out = vec![0f32; t * h * d];
    let mut logits = Vec::new();
    for (ti, row) in indices.iter().enumerate() {
        let valid: Vec<usize> = row.iter().filter(|&&i| i >= 0).map(|&i| i as usize).collect();
        for hi in 0..h {
            let qrow = &qv[(ti * h + hi) * d..][..d];
            logits.clear();
            logits.extend(valid.iter().map(|&s| scale * dot(qrow, &kvv[s * d..][..d])));
            let o = &mut out[(ti * h + hi) * d..][..d];
            attend_one(&logits, &valid, &kvv, d, sinkv[hi], o);
        }
    }
    Tensor::from_vec(out, (t, h, d), &Device::Cpu)?.to_dtype(DType::BF16)?.to_dtype(q.dtype())?.to_device(q.device())
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Online softmax over blocks of [`SOFTMAX_BLOCK`] logits, bf16-rounded probabilities for P·V.
fn attend_one(logits: &[f32], rows: &[usize], kv: &[f32], d: usize, sink: f32, out: &mut [f32]) {
    let mut m = -1e30f32;
    let mut den = 0f32;
    out.iter_mut().for_each(|o| *o = 0.0);
    for (lb, rb) in logits.chunks(SOFTMAX_BLOCK).zip(rows.chunks(SOFTMAX_BLOCK)) {
        let m_new = lb.iter().fold(m, |a, &b| a.max(b));
        let alpha = (m - m_new).exp();
        den *= alpha;
        out.iter_mut().for_each(|o| *o *= alpha);
        for (&l, &s) in lb.iter().zip(rb) {
            let p = (l - m_new).exp();
            den += p;
            let pb = half::bf16::from_f32(p).to_f32();
            for (o, &v) in out.iter_mut().zip(&kv[s * d..][..d]) {
                *o += pb * v;
            }
        }
        m = m_new;
    }
    let den = den + (sink - m).exp();
    if den > 0.0 && den.is_finite() {
        out.iter_mut().for_each(|o| *o /= den);
    } else {
        out.iter_mut().for_each(|o| *o = 0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dense softmax over [sink, valid rows] with a zero value for the sink column.
    fn dense(q: &[f32], rows: &[Vec<f32>], sink: f32, scale: f32) -> Vec<f32> {
        let d = q.len();
        let mut l: Vec<f32> = rows.iter().map(|r| scale * dot(q, r)).collect();
        l.push(sink);
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = l.iter().map(|x| (x - m).exp()).collect();
        let z: f32 = e.iter().sum();
        (0..d).map(|c| rows.iter().zip(&e).map(|(r, p)| r[c] * p).sum::<f32>() / z).collect()
    }

    #[test]
    fn matches_dense_softmax_with_sink_column_and_handles_empty_rows() -> Result<()> {
        let dev = Device::Cpu;
        let (t, h, d, n) = (3, 2, 8, 5);
        let q = Tensor::randn(0f32, 1.0, (t, h, d), &dev)?;
        let kv = Tensor::randn(0f32, 1.0, (n, d), &dev)?;
        let idx = Tensor::new(&[[0i64, 3, 3, -1], [-1, -1, -1, -1], [4, 1, 2, 0]], &dev)?;
        let sink = Tensor::new(&[0.5f32, f32::NEG_INFINITY], &dev)?;
        let out = sparse_attention(&q, &kv, &idx, &sink, 0.3)?.to_vec3::<f32>()?;
        let qv = q.to_vec3::<f32>()?;
        let kvv = kv.to_vec2::<f32>()?;
        let sinks = [0.5f32, f32::NEG_INFINITY];
        for (ti, row) in [[0usize, 3, 3].as_slice(), &[], &[4, 1, 2, 0]].iter().enumerate() {
            let rows: Vec<Vec<f32>> = row.iter().map(|&i| kvv[i].clone()).collect();
            for hi in 0..h {
                let want = if rows.is_empty() { vec![0.0; d] } else { dense(&qv[ti][hi], &rows, sinks[hi], 0.3) };
                for (a, b) in out[ti][hi].iter().zip(&want) {
                    // bf16 probabilities and output: errors of ~2^-8 of the value scale (|v| ~ 1).
                    assert!((a - b).abs() <= 1e-2 + 1e-2 * b.abs(), "t{ti} h{hi}: {a} vs {b}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn rejects_out_of_range_indices() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 1, 4), DType::F32, &dev)?;
        let kv = Tensor::zeros((2, 4), DType::F32, &dev)?;
        let sink = Tensor::zeros(1, DType::F32, &dev)?;
        let err = sparse_attention(&q, &kv, &Tensor::new(&[[2i64]], &dev)?, &sink, 1.0).unwrap_err();
        assert!(err.to_string().contains("indices[0] holds 2"), "{err}");
        Ok(())
    }
}
