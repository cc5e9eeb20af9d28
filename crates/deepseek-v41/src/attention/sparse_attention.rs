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
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        if !crate::cuda::fused_kernels(q.device()) {
            return sparse_attention_candle(q, &[(kv, indices)], sink, scale);
        }
        // On the device: no index validation on the host (out-of-range indices are skipped).
        return sparse_attention_sources(q, kv, indices, kv, &indices.narrow(1, 0, 0)?, sink, scale);
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

/// Sparse attention over two KV sources on any device, without a host round trip on CUDA: token
/// t attends to the valid rows of `[kv_window[idx_window[t]] ; kv_extra[idx_extra[t]]]`.
///
/// * `q`: `[T, H, D]` bf16; `kv_window`: `[Nw, D]`, `kv_extra`: `[Nc, D]` bf16;
///   `idx_window`: `[T, Kw]`, `idx_extra`: `[T, Kc]` i64 (−1 = none); `sink`: `[H]` f32.
///
/// Returns `[T, H, D]` bf16: [`sparse_attention_kv_rows`] over bf16 rows.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention_sources(
    q: &Tensor,
    kv_window: &Tensor,
    idx_window: &Tensor,
    kv_extra: &Tensor,
    idx_extra: &Tensor,
    sink: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    use crate::cuda::KvRows;
    sparse_attention_kv_rows(q, KvRows::Bf16(kv_window), idx_window, KvRows::Bf16(kv_extra), idx_extra, sink, scale)
}

/// [`sparse_attention_sources`] over sources stored as bf16 rows or packed pages
/// ([`crate::cuda::KvRows`]; indices name rows / slots of their source).
///
/// Returns `[T, H, D]` bf16. On CUDA with `D` = [`crate::cuda::SPARSE_ATTENTION_HEAD_DIM`] the
/// fused kernel ([`crate::cuda::SparseAttentionInputs`], packed rows dequantized in the kernel);
/// on CUDA with another head dim (the tiny configs) or more indices per token than the kernel
/// takes ([`crate::cuda::SPARSE_ATTENTION_MAX_INDICES`]): over bf16 rows
/// [`crate::cuda::sparse_attention_small`] (one launch, the reference's order), else
/// [`sparse_attention_candle`] (packed sources first dequantized through the host, exactly); on
/// the CPU the reference. Packed
/// sources give bit for bit the result of their dequantized bf16 rows in the same kernel (the
/// launcher runs the all-heads kernel for packed sources; for bf16 rows of a few decode tokens it
/// picks the dims-split pair, whose f32 sums run in another order).
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention_kv_rows(
    q: &Tensor,
    window: crate::cuda::KvRows<'_>,
    idx_window: &Tensor,
    extra: crate::cuda::KvRows<'_>,
    idx_extra: &Tensor,
    sink: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    let indices = idx_window.dim(1)? + idx_extra.dim(1)?;
    if q.device().is_cuda() && (q.dim(2)? != crate::cuda::SPARSE_ATTENTION_HEAD_DIM || indices > crate::cuda::SPARSE_ATTENTION_MAX_INDICES) {
        use crate::cuda::KvRows;
        if let (KvRows::Bf16(w), KvRows::Bf16(e)) = (&window, &extra) {
            if crate::cuda::fused_kernels(q.device()) && !crate::cuda::unfused("sparse_small") && crate::cuda::sparse_attention_small_supported(q, w, e) {
                return crate::cuda::sparse_attention_small(q, w, idx_window, e, idx_extra, sink, scale);
            }
        }
        let (kv_window, kv_extra) = (window.to_bf16()?, extra.to_bf16()?);
        return sparse_attention_candle(q, &[(&kv_window, idx_window), (&kv_extra, idx_extra)], sink, scale);
    }
    let inputs = crate::cuda::SparseAttentionInputs { q, window, idx_window, extra, idx_extra, sink, scale };
    Ok(inputs.forward(Default::default())?.0)
}

/// The same attention written with plain Candle tensor ops (gather, masked softmax with the
/// sink in the denominator, bf16-rounded probabilities): runs on any device without a host
/// round trip. It is the fallback for head dims the CUDA kernel does not take, and the
/// plain-Candle baseline of the benchmarks.
///
/// `sources`: `(kv [N, D], indices [T, K] i64, −1 = none)` pairs, attended in order; `q`, `sink`
/// as [`sparse_attention`]. Probabilities are rounded to bf16 relative to the row's global max
/// (the reference rounds relative to a running max per block of 64), so results agree with the
/// reference to about one bf16 ulp. Returns `[T, H, D]` in `q`'s dtype.
pub fn sparse_attention_candle(q: &Tensor, sources: &[(&Tensor, &Tensor)], sink: &Tensor, scale: f32) -> Result<Tensor> {
    let (t, h, d) = q.dims3()?;
    let k_total: usize = sources.iter().map(|(_, i)| i.dim(1).unwrap_or(0)).sum();
    // Bound the gathered [chunk, K, D] f32 rows to 2^26 elements.
    let chunk = ((1usize << 26) / (k_total.max(1) * d)).clamp(1, t.max(1));
    let mut outs = Vec::new();
    for c0 in (0..t).step_by(chunk) {
        let c = chunk.min(t - c0);
        let srcs: Vec<(&Tensor, Tensor)> =
            sources.iter().map(|(kv, i)| Ok((*kv, i.narrow(0, c0, c)?))).collect::<Result<_>>()?;
        outs.push(candle_chunk(&q.narrow(0, c0, c)?, &srcs, sink, scale)?);
    }
    if outs.is_empty() {
        return Tensor::zeros((t, h, d), q.dtype(), q.device());
    }
    Tensor::cat(&outs, 0)
}

fn candle_chunk(q: &Tensor, sources: &[(&Tensor, Tensor)], sink: &Tensor, scale: f32) -> Result<Tensor> {
    let (t, h, d) = q.dims3()?;
    let (mut rows, mut valid) = (Vec::new(), Vec::new());
    for (kv, idx) in sources {
        let k = idx.dim(1)?;
        if k == 0 || kv.dim(0)? == 0 {
            continue; // no row can be valid
        }
        valid.push(idx.ge(0i64)?);
        let safe = idx.maximum(0i64)?.flatten_all()?;
        rows.push(kv.index_select(&safe, 0)?.reshape((t, k, d))?);
    }
    if rows.is_empty() {
        return Tensor::zeros((t, h, d), q.dtype(), q.device());
    }
    let rows = Tensor::cat(&rows, 1)?.to_dtype(DType::F32)?; // [T, K, D]
    let valid = Tensor::cat(&valid, 1)?; // [T, K] u8
    let logits = (q.to_dtype(DType::F32)?.matmul(&rows.transpose(1, 2)?)? * scale as f64)?; // [T, H, K]
    let mask = valid.unsqueeze(1)?.broadcast_as(logits.shape())?;
    let neg = Tensor::new(f32::NEG_INFINITY, q.device())?.broadcast_as(logits.shape())?;
    let logits = mask.where_cond(&logits, &neg)?;
    let m = logits.max_keepdim(2)?.maximum(-1e30f32)?; // [T, H, 1]
    let p = logits.broadcast_sub(&m)?.exp()?;
    let sink_term = sink.to_dtype(DType::F32)?.reshape((1, h, 1))?.broadcast_sub(&m)?.exp()?;
    let den = (p.sum_keepdim(2)? + sink_term)?;
    let num = p.to_dtype(DType::BF16)?.to_dtype(DType::F32)?.matmul(&rows)?; // [T, H, D]
    // A row without valid index and without sink has den = 0 (and num = 0): output zeros.
    let ones = Tensor::new(1f32, q.device())?.broadcast_as(den.shape())?;
    let den = den.gt(0f32)?.where_cond(&den, &ones)?;
    num.broadcast_div(&den)?.to_dtype(DType::BF16)?.to_dtype(q.dtype())
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
    fn candle_ops_version_matches_the_reference() -> Result<()> {
        let dev = Device::Cpu;
        let (t, h, d, nw, nc) = (4, 3, 16, 6, 9);
        let q = Tensor::randn(0f32, 1.0, (t, h, d), &dev)?.to_dtype(DType::BF16)?;
        let kvw = Tensor::randn(0f32, 1.0, (nw, d), &dev)?.to_dtype(DType::BF16)?;
        let kvc = Tensor::randn(0f32, 1.0, (nc, d), &dev)?.to_dtype(DType::BF16)?;
        let iw = Tensor::new(&[[0i64, 1, -1], [2, 2, 5], [-1, -1, -1], [-1, -1, -1]], &dev)?;
        let ic = Tensor::new(&[[8i64, -1], [0, 3], [4, -1], [-1, -1]], &dev)?;
        let sink = Tensor::new(&[0.3f32, -1.0, f32::NEG_INFINITY], &dev)?;
        let got = sparse_attention_candle(&q, &[(&kvw, &iw), (&kvc, &ic)], &sink, 0.25)?;
        let kv = Tensor::cat(&[&kvw, &kvc], 0)?;
        let idx: Vec<Vec<i64>> = iw
            .to_vec2::<i64>()?
            .into_iter()
            .zip(ic.to_vec2::<i64>()?)
            .map(|(mut a, b)| {
                a.extend(b.into_iter().map(|i| if i < 0 { -1 } else { i + nw as i64 }));
                a
            })
            .collect();
        let want = sparse_attention_ref(&q, &kv, &idx, &sink, 0.25)?;
        let (g, w) = (got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, want.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            assert!((a - b).abs() <= 2e-2 * (1.0 + b.abs()), "element {i}: {a} vs {b}");
        }
        // Token 3 has no valid index: zeros (head 2 also has no sink).
        assert!(g[3 * h * d..].iter().all(|&v| v == 0.0));
        // Negative control: dropping the extra source changes the output.
        let partial = sparse_attention_candle(&q, &[(&kvw, &iw)], &sink, 0.25)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(partial.iter().zip(&g).any(|(a, b)| (a - b).abs() > 1e-2));
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

    /// `kernels/sparse_attention_small.cu`'s schedule on the host — index chunks of 128 entries
    /// (one per thread), the valid rows compacted in order into a buffer, a block whenever 64 are
    /// buffered and the rest moved to the front, the last partial block, the running max, the
    /// denominator summed in order by one thread, each dim's products added in row order — with
    /// the reference's sequential dot products: then it must equal [`sparse_attention_ref`] bit
    /// for bit. Valid-row counts around 64 and 128, rows with none, one source empty.
    #[test]
    fn the_small_kernel_schedule_equals_the_reference() -> Result<()> {
        fn schedule(q: &[f32], kv: &[f32], d: usize, idx: &[i64], n: usize, sink: f32, scale: f32) -> Vec<f32> {
            let (mut acc, mut m, mut den) = (vec![0f32; d], -1e30f32, 0f32);
            let mut buf: Vec<usize> = Vec::new();
            let block = |rows: &[usize], acc: &mut Vec<f32>, m: &mut f32, den: &mut f32| {
                let logit: Vec<f32> = rows.iter().map(|&r| scale * dot(q, &kv[r * d..][..d])).collect();
                let m_new = logit.iter().fold(*m, |a, &b| a.max(b));
                let alpha = (*m - m_new).exp();
                let prob: Vec<f32> = logit.iter().map(|&l| (l - m_new).exp()).collect();
                *den *= alpha;
                for &p in &prob {
                    *den += p;
                }
                for (c, o) in acc.iter_mut().enumerate() {
                    *o *= alpha;
                    for (&r, &p) in rows.iter().zip(&prob) {
                        *o += half::bf16::from_f32(p).to_f32() * kv[r * d + c];
                    }
                }
                *m = m_new;
            };
            for chunk in idx.chunks(128) {
                buf.extend(chunk.iter().filter(|&&i| i >= 0 && (i as usize) < n).map(|&i| i as usize));
                while buf.len() >= SOFTMAX_BLOCK {
                    let rows: Vec<usize> = buf.drain(..SOFTMAX_BLOCK).collect();
                    block(&rows, &mut acc, &mut m, &mut den);
                }
            }
            if !buf.is_empty() {
                let rows = std::mem::take(&mut buf);
                block(&rows, &mut acc, &mut m, &mut den);
            }
            let den = den + (sink - m).exp();
            acc.iter().map(|&o| if den > 0.0 && den.is_finite() { o / den } else { 0.0 }).collect()
        }
        let dev = Device::Cpu;
        let (h, d, n) = (2usize, 24usize, 300usize);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut r = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let kv = Tensor::from_vec((0..n * d).map(|_| r() * 2.0).collect::<Vec<f32>>(), (n, d), &dev)?.to_dtype(DType::BF16)?;
        let kvv = kv.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for (t, k, valid_every) in [(3usize, 64usize, 1usize), (2, 130, 1), (2, 200, 3), (2, 129, 2), (2, 5, 100)] {
            let q = Tensor::from_vec((0..t * h * d).map(|_| r() * 4.0).collect::<Vec<f32>>(), (t, h, d), &dev)?.to_dtype(DType::BF16)?;
            let qv = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let idx: Vec<Vec<i64>> = (0..t)
                .map(|ti| (0..k).map(|j| if (j + ti) % valid_every == 0 { ((j * 37 + ti * 11) % n) as i64 } else { -1 }).collect())
                .collect();
            let sink = Tensor::new(&[0.5f32, f32::NEG_INFINITY], &dev)?;
            let want = sparse_attention_ref(&q, &kv, &idx, &sink, 0.3)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            for ti in 0..t {
                for (hi, s) in [0.5f32, f32::NEG_INFINITY].into_iter().enumerate() {
                    let got = schedule(&qv[(ti * h + hi) * d..][..d], &kvv, d, &idx[ti], n, s, 0.3);
                    let row = &want[(ti * h + hi) * d..][..d];
                    for (c, (g, w)) in got.iter().zip(row).enumerate() {
                        assert_eq!(half::bf16::from_f32(*g).to_f32(), *w, "t {t} k {k} token {ti} head {hi} dim {c}");
                    }
                }
            }
        }
        Ok(())
    }
}
