//! Sparse attention with a per-head sink over two KV sources (spec §4.6–§4.7, §0.1b.6), like
//! FlashMLA's `k_cache` + `extra_k_cache`: token t attends to the valid rows of
//! `[kv_window[idx_window[t]] ; kv_extra[idx_extra[t]]]` in that order, without dedupe.
//!
//! Semantics are exactly [`sparse_attention_ref`] applied to that concatenation (f32 logits,
//! sink in the denominator only, bf16-rounded probabilities per block of 64 valid indices, empty
//! row → zeros, bf16 output), plus the log-sum-exp of the valid logits (sink excluded).
//!
//! On CUDA (sm_90a) Hopper warpgroup tensor-core (`wgmma`) products over 64-row tiles that a
//! producer warpgroup gathers with 16-byte `cp.async` ([`SparseAttentionKernel`]): the all-heads
//! kernel (`kernels/sparse_attention.cu`: all 64 heads of a token per CTA, split-KV over a
//! thread-block cluster, merged in the cluster's shared memory, when there are too few tokens to
//! fill the GPU) and the head-split kernel (32 heads per CTA over all of the token's rows, no
//! merge; for decode) in two forms: two consumer warpgroups on alternate tiles of a slot ring
//! (`kernels/sparse_attention_pingpong.cu`, bf16 rows) and one consumer over a two-stage ring
//! (`kernels/sparse_attention_heads.cu`). On the CPU the crate's reference. They agree within bf16 rounding (the
//! f32 summation orders differ; with splits each split rounds its probabilities relative to
//! its own running max).
//!
//! The CUDA path read-locks the inputs' storages for the launch; `kv_window` and `kv_extra` may
//! be views of one storage (two plain read locks on one thread, see `row_inputs`).

use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Result, Storage, Tensor};
use half::bf16;

use candle_core::cuda_backend::cudarc::driver::{CudaStream, SyncOnDrop};

use super::device::{aligned_rows, as_cuda, raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi;
use super::packed_insert::PackedLayout;
use crate::attention::sparse_attention::sparse_attention_ref;
use crate::quant::fake_quant::QatFormat;

/// Row width the CUDA kernel supports (V4's head dim).
pub const SPARSE_ATTENTION_HEAD_DIM: usize = 512;

/// Most index columns (`Kw + Kc`) per token the CUDA kernel takes.
pub const SPARSE_ATTENTION_MAX_INDICES: usize = 4096;

/// Most KV splits per token (the portable thread-block cluster size).
pub const SPARSE_ATTENTION_MAX_SPLITS: usize = 8;

/// Which CUDA kernel computes the sparse attention (same semantics; the f32 rounding differs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SparseAttentionKernel {
    /// The launcher picks: the dims-split pair ([`SparseAttentionKernel::DimSplitPair`]) for
    /// bf16 rows where the all-heads kernel would split the rows (decode batches up to about
    /// #SMs / 2 tokens at 64 heads, e.g. B = 1 and B = 64 on 132 SMs; the head-split ping-pong
    /// loop where its slots do not fit), else the all-heads kernel (larger batches, prefill, and
    /// packed rows). Forced splits select the all-heads kernel.
    #[default]
    Auto,
    /// All heads of a token per CTA (64-head blocks), split-KV over a thread-block cluster.
    AllHeads,
    /// 32 heads per CTA over all of the token's rows (rows as the tensor-core M dimension), no
    /// split and no merge, one consumer warpgroup over a two-stage ring of tiles; takes no
    /// `num_splits` above 1.
    HeadSplit,
    /// The head-split kernel with two consumer warpgroups on alternate tiles of a slot ring
    /// (`kernels/sparse_attention_pingpong.cu`): one's softmax runs under the other's products,
    /// and the producer gathers the first two window tiles while the indices are compacted. The
    /// numerics of one split (p rounded to bf16 relative to the running max after each 64-row
    /// block); only f32 summation orders differ from `HeadSplit` (each consumer sums its own
    /// tiles, merged once). bf16 rows (packed rows run `HeadSplit`'s loop); Auto's choice before the
    /// dims-split pair. Takes no `num_splits` above 1.
    HeadSplitPingPong,
    /// All 64 heads of a block per CTA with the 512 dims split over the two CTAs of a cluster
    /// (`kernels/sparse_attention_dimsplit.cu`): each CTA gathers only its 256 dims of every row,
    /// so a row crosses L2 -> SM once per token, and the two exchange their partial scores (each
    /// CTA runs the softmax of half of the heads) and P tiles through distributed shared memory.
    /// Two consumer warpgroups on alternate tiles as `HeadSplitPingPong`, whose numerics it has
    /// (p rounded to bf16 relative to the running max after each 64-row block); only f32
    /// summation orders differ. bf16 rows (packed rows run `HeadSplit`'s loop). Takes no
    /// `num_splits` above 1. Auto's choice for bf16 rows and few tokens: on an H200 at B = 64
    /// 19.0 µs (median) called alone and 18.8-19.1 µs right behind the indexer's top-k
    /// (`HeadSplitPingPong` 25.9-26.5 µs alone), at B = 1 17.8-17.9 µs (docs/perf.md, "Sparse
    /// attention").
    DimSplitPair,
}

/// Tuning knobs of [`sparse_attention_two_source_with`]; they change the CUDA work split (and
/// so the f32 rounding), never the semantics. The CPU path ignores them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SparseAttentionOptions {
    /// KV splits per token of the all-heads kernel (`1..=SPARSE_ATTENTION_MAX_SPLITS`); `None`
    /// lets the launcher pick from the token count and the number of SMs.
    pub num_splits: Option<usize>,
    /// The kernel ([`SparseAttentionKernel::Auto`] by default).
    pub kernel: SparseAttentionKernel,
}

/// How one KV source of the sparse attention stores its rows.
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    /// `[N, D]` bf16 rows.
    Bf16(&'a Tensor),
    /// A packed cache (spec §7.2) `[pages, layout.page_bytes()]` u8 in format A (528 B window
    /// rows, [`QatFormat::Fp8Ue8m0B32`]) or B (288 B compressed rows, [`QatFormat::Fp4E4m3B16`]),
    /// `D = layout.head_dim()`; its `N = pages · page_size` slots are the rows. The kernel
    /// dequantizes the gathered rows exactly, so the result equals that over the bf16 rows the
    /// bf16 inserts store.
    Packed(&'a Tensor, PackedLayout),
}

impl KvRows<'_> {
    /// Number of rows (slots) `N`.
    pub fn num_rows(&self) -> Result<usize> {
        match self {
            Self::Bf16(t) => t.dim(0),
            Self::Packed(t, l) => Ok(t.dim(0)? * l.page_size()),
        }
    }

    fn device(&self) -> &Device {
        match self {
            Self::Bf16(t) | Self::Packed(t, _) => t.device(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Bf16(t) => format!("{:?} {:?}", t.dtype(), t.shape()),
            Self::Packed(t, l) => format!("packed {:?} {:?} {l:?}", t.dtype(), t.shape()),
        }
    }

    /// Checks the storage for rows of `d` values; `name` (`"sparse_attention: window"` or
    /// `"…: extra"`) names the argument in errors.
    fn check(&self, name: &'static str, d: usize) -> Result<()> {
        match self {
            Self::Bf16(t) => {
                if t.rank() != 2 || t.dim(1)? != d || t.dtype() != DType::BF16 {
                    candle_core::bail!("{name} must be [N, {d}] bf16 rows, got {}", self.describe())
                }
            }
            Self::Packed(t, l) => {
                if !matches!(l.format(), QatFormat::Fp8Ue8m0B32 | QatFormat::Fp4E4m3B16) || l.head_dim() != d {
                    candle_core::bail!(
                        "{name} must be packed in format A (fp8_ue8m0_b32) or B (fp4_e4m3_b16) with head_dim {d}, got {l:?}"
                    )
                }
                l.check_cache(t, name)?;
            }
        }
        Ok(())
    }

    /// The rows as a bf16 `[N, D]` tensor on the source's device (packed: dequantized on the
    /// CPU with [`PackedLayout::unpack`], the reference; exact).
    pub fn to_bf16(self) -> Result<Tensor> {
        match self {
            Self::Bf16(t) => Ok(t.clone()),
            Self::Packed(t, l) => l.unpack_rows(t, 0..self.num_rows()?, DType::BF16),
        }
    }
}

/// The tensors of one sparse attention call: token t attends to the valid rows of
/// `[window[idx_window[t]] ; extra[idx_extra[t]]]` (K = V = the row). All tensors on one
/// device: CUDA runs the kernels (D = 512), the CPU the crate's reference.
///
/// ```no_run
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{DType, Device, Tensor};
/// use deepseek_v41::cuda::{KvRows, SparseAttentionInputs, SparseAttentionOptions};
///
/// let dev = Device::new_cuda(0)?; // `Device::Cpu` runs the reference instead
/// let (t, h, d) = (1, 64, 512);
/// let bf16 = |dims: &[usize]| Tensor::randn(0f32, 1.0, dims, &dev)?.to_dtype(DType::BF16);
/// let (q, window, extra) = (bf16(&[t, h, d])?, bf16(&[128, d])?, bf16(&[1024, d])?);
/// // Token 0 reads window rows 0..4 and compressed rows 10, 20, 30; −1 pads the list.
/// let idx_window = Tensor::new(&[[0i64, 1, 2, 3]], &dev)?;
/// let idx_extra = Tensor::new(&[[10i64, 20, 30, -1]], &dev)?;
/// let sink = Tensor::zeros(h, DType::F32, &dev)?;
/// let inputs = SparseAttentionInputs {
///     q: &q,
///     window: KvRows::Bf16(&window),
///     idx_window: &idx_window,
///     extra: KvRows::Bf16(&extra),
///     idx_extra: &idx_extra,
///     sink: &sink,
///     scale: (d as f32).powf(-0.5),
/// };
/// let (out, lse) = inputs.forward(SparseAttentionOptions::default())?;
/// assert_eq!((out.dims(), out.dtype()), (&[t, h, d][..], DType::BF16));
/// assert_eq!((lse.dims(), lse.dtype()), (&[t, h][..], DType::F32));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct SparseAttentionInputs<'a> {
    /// `[T, H, D]` bf16 queries (D = [`SPARSE_ATTENTION_HEAD_DIM`] on CUDA).
    pub q: &'a Tensor,
    /// The first source: the layer's window rows.
    pub window: KvRows<'a>,
    /// `[T, Kw]` i64 or i32 row ids into `window` per token, −1 = none.
    pub idx_window: &'a Tensor,
    /// The second source: the compressed rows (the selected top-k).
    pub extra: KvRows<'a>,
    /// `[T, Kc]` row ids into `extra` per token, the dtype of `idx_window`, −1 = none.
    pub idx_extra: &'a Tensor,
    /// `[H]` f32 sink logits, added to the softmax denominator only (−inf = no sink).
    pub sink: &'a Tensor,
    /// Multiplies `q·k` (not the sink), usually `D^-0.5`.
    pub scale: f32,
}

impl SparseAttentionInputs<'_> {
    /// Runs the attention; returns `out` `[T, H, D]` bf16 and `lse` `[T, H]` f32 =
    /// `ln Σ_s e^{ℓ_s}` over the valid rows (−inf for a row without any). Indices must lie in
    /// `[-1, N)` of their source: the CPU path rejects others; the CUDA path (which does not
    /// read indices back to the host) skips them. `options` change the CUDA work split (and
    /// so the f32 rounding), never the semantics.
    pub fn forward(&self, options: SparseAttentionOptions) -> Result<(Tensor, Tensor)> {
        self.check()?;
        if let Some(s) = options.num_splits {
            if s == 0 || s > SPARSE_ATTENTION_MAX_SPLITS {
                candle_core::bail!("sparse_attention: num_splits must be in 1..={SPARSE_ATTENTION_MAX_SPLITS}, got {s}")
            }
            // Every kernel but the all-heads one (Auto with splits forced runs the all-heads kernel).
            let head_split = !matches!(options.kernel, SparseAttentionKernel::Auto | SparseAttentionKernel::AllHeads);
            if s > 1 && head_split {
                candle_core::bail!("sparse_attention: the {:?} kernel does not split the rows, got num_splits {s}", options.kernel)
            }
        }
        if self.q.device().is_cuda() {
            cuda_forward(self, options)
        } else {
            cpu_forward(self)
        }
    }

    fn check(&self) -> Result<()> {
        const OP: &str = "sparse_attention";
        let (q, iw, ic, sink) = (self.q, self.idx_window, self.idx_extra, self.sink);
        let shapes = || {
            format!(
                "q {:?}, window {}, idx_window {:?}, extra {}, idx_extra {:?}, sink {:?}",
                q.shape(),
                self.window.describe(),
                iw.shape(),
                self.extra.describe(),
                ic.shape(),
                sink.shape()
            )
        };
        if q.rank() != 3 || iw.rank() != 2 || ic.rank() != 2 || sink.rank() != 1 {
            candle_core::bail!("{OP}: want q [T,H,D], idx_* [T,K], sink [H]; got {}", shapes())
        }
        let (t, h, d) = q.dims3()?;
        if iw.dim(0)? != t || ic.dim(0)? != t || sink.dim(0)? != h {
            candle_core::bail!("{OP}: shapes disagree (want q [T,H,D], idx_* [T,K], sink [H]): {}", shapes())
        }
        self.window.check("sparse_attention: window", d)?;
        self.extra.check("sparse_attention: extra", d)?;
        if q.dtype() != DType::BF16 {
            candle_core::bail!("{OP}: q must be bf16, got {:?}", q.dtype())
        }
        if sink.dtype() != DType::F32 {
            candle_core::bail!("{OP}: sink must be f32, got {:?}", sink.dtype())
        }
        if !matches!(iw.dtype(), DType::I64 | DType::I32) || iw.dtype() != ic.dtype() {
            candle_core::bail!(
                "{OP}: idx_window and idx_extra must both be i64 or both i32, got {:?} and {:?}",
                iw.dtype(),
                ic.dtype()
            )
        }
        let devices = [
            ("window", self.window.device()),
            ("idx_window", iw.device()),
            ("extra", self.extra.device()),
            ("idx_extra", ic.device()),
            ("sink", sink.device()),
        ];
        for (name, dev) in devices {
            if !dev.same_device(q.device()) {
                candle_core::bail!("{OP}: {name} is on {dev:?} but q is on {:?}", q.device())
            }
        }
        if q.device().is_cuda() {
            if d != SPARSE_ATTENTION_HEAD_DIM {
                candle_core::bail!("{OP}: the CUDA kernel supports head_dim {SPARSE_ATTENTION_HEAD_DIM}, got q {:?}", q.shape())
            }
            if t > i32::MAX as usize || iw.dim(1)? + ic.dim(1)? > SPARSE_ATTENTION_MAX_INDICES {
                candle_core::bail!(
                    "{OP}: the CUDA kernel takes at most {} tokens and {SPARSE_ATTENTION_MAX_INDICES} indices per token: {}",
                    i32::MAX,
                    shapes()
                )
            }
            if self.window.num_rows()? > i32::MAX as usize || self.extra.num_rows()? > i32::MAX as usize {
                candle_core::bail!("{OP}: the CUDA kernel takes sources of fewer than 2^31 rows: {}", shapes())
            }
        }
        Ok(())
    }
}

/// Sparse attention over `[kv_window rows ; kv_extra rows]` (bf16 rows); returns `(out, lse)`
/// as [`SparseAttentionInputs::forward`] with default options.
///
/// * `q`: `[T, H, D]` bf16 (D = 512 on CUDA).
/// * `kv_window`: `[Nw, D]` bf16 rows (K = V); `idx_window`: `[T, Kw]` i64 or i32, −1 = none.
/// * `kv_extra`: `[Nc, D]` bf16 rows; `idx_extra`: `[T, Kc]` same dtype as `idx_window`.
/// * `sink`: `[H]` f32 logit added to the denominator only (−inf = no sink).
/// * `scale`: multiplies `q·k` (not the sink), usually `D^-0.5`.
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention_two_source(
    q: &Tensor,
    kv_window: &Tensor,
    idx_window: &Tensor,
    kv_extra: &Tensor,
    idx_extra: &Tensor,
    sink: &Tensor,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    sparse_attention_two_source_with(q, kv_window, idx_window, kv_extra, idx_extra, sink, scale, SparseAttentionOptions::default())
}

/// [`sparse_attention_two_source`] with explicit [`SparseAttentionOptions`]; same tensors,
/// shapes, dtypes and results (up to f32 rounding for another split count).
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention_two_source_with(
    q: &Tensor,
    kv_window: &Tensor,
    idx_window: &Tensor,
    kv_extra: &Tensor,
    idx_extra: &Tensor,
    sink: &Tensor,
    scale: f32,
    options: SparseAttentionOptions,
) -> Result<(Tensor, Tensor)> {
    let window = KvRows::Bf16(kv_window);
    let extra = KvRows::Bf16(kv_extra);
    SparseAttentionInputs { q, window, idx_window, extra, idx_extra, sink, scale }.forward(options)
}

fn host_indices(idx: &Tensor) -> Result<Vec<Vec<i64>>> {
    idx.to_device(&Device::Cpu)?.to_dtype(DType::I64)?.to_vec2::<i64>()
}

/// Validated host copies of both index lists, the extra ones shifted past the window rows.
fn concat_indices(iw: &Tensor, nw: usize, ic: &Tensor, nc: usize) -> Result<Vec<Vec<i64>>> {
    let (w, c) = (host_indices(iw)?, host_indices(ic)?);
    for (name, rows, n) in [("idx_window", &w, nw), ("idx_extra", &c, nc)] {
        for (r, row) in rows.iter().enumerate() {
            if let Some(&bad) = row.iter().find(|&&i| i < -1 || i >= n as i64) {
                candle_core::bail!("sparse_attention_two_source: {name}[{r}] holds {bad}, outside -1..{n}")
            }
        }
    }
    Ok(w.into_iter()
        .zip(c)
        .map(|(mut a, b)| {
            a.extend(b.into_iter().map(|i| if i < 0 { -1 } else { i + nw as i64 }));
            a
        })
        .collect())
}

fn cpu_forward(x: &SparseAttentionInputs) -> Result<(Tensor, Tensor)> {
    let (kvw, kvc) = (x.window.to_bf16()?, x.extra.to_bf16()?);
    let idx = concat_indices(x.idx_window, kvw.dim(0)?, x.idx_extra, kvc.dim(0)?)?;
    let kv = Tensor::cat(&[&kvw, &kvc], 0)?;
    let out = sparse_attention_ref(x.q, &kv, &idx, x.sink, x.scale)?;
    let lse = log_sum_exp(x.q, &kv, &idx, x.scale)?;
    Ok((out, lse))
}

/// `[T, H]` f32: `ln Σ_s e^{ℓ_s}` over the valid rows (logits in f32 as the reference, the sum
/// in f64), −inf for an empty row.
fn log_sum_exp(q: &Tensor, kv: &Tensor, idx: &[Vec<i64>], scale: f32) -> Result<Tensor> {
    let (t, h, d) = q.dims3()?;
    let qv = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let kvv = kv.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut lse = vec![f32::NEG_INFINITY; t * h];
    for (ti, row) in idx.iter().enumerate() {
        for hi in 0..h {
            let qr = &qv[(ti * h + hi) * d..][..d];
            let l: Vec<f32> = row
                .iter()
                .filter(|&&s| s >= 0)
                .map(|&s| scale * qr.iter().zip(&kvv[s as usize * d..][..d]).map(|(a, b)| a * b).sum::<f32>())
                .collect();
            if let Some(m) = l.iter().cloned().reduce(f32::max) {
                let sum: f64 = l.iter().map(|&x| ((x - m) as f64).exp()).sum();
                lse[ti * h + hi] = (m as f64 + sum.ln()) as f32;
            }
        }
    }
    Tensor::from_vec(lse, (t, h), &Device::Cpu)?.to_device(q.device())
}


/// One source as the kernel reads it: the tensor (bf16 rows made 16-byte aligned), its
/// `DSV41_KV_*` format and its page size (packed).
fn kernel_source(rows: KvRows) -> Result<(Tensor, i32, i32)> {
    Ok(match rows {
        KvRows::Bf16(t) => (aligned_rows(t)?, ffi::KV_BF16, 0),
        KvRows::Packed(t, l) => {
            let format = if l.format() == QatFormat::Fp8Ue8m0B32 { ffi::KV_PACKED_A } else { ffi::KV_PACKED_B };
            (t.clone(), format, l.page_size() as i32)
        }
    })
}

/// Device pointer, row stride (elements, bf16 rows) and row count of a prepared source.
fn source_ptr<'a>(
    storage: &'a CudaStorage,
    layout: &candle_core::Layout,
    format: i32,
    page_size: i32,
    stream: &'a CudaStream,
) -> Result<(*const std::ffi::c_void, i64, i64, SyncOnDrop<'a>)> {
    if format == ffi::KV_BF16 {
        let d = SPARSE_ATTENTION_HEAD_DIM as i64;
        let stride = if layout.dims()[0] <= 1 { d } else { layout.stride()[0] as i64 };
        let (ptr, guard) = read_ptr::<bf16>(storage, layout, stream)?;
        Ok((ptr.cast(), stride, layout.dims()[0] as i64, guard))
    } else {
        let (ptr, guard) = read_ptr::<u8>(storage, layout, stream)?;
        Ok((ptr.cast(), 0, layout.dims()[0] as i64 * page_size as i64, guard))
    }
}

fn cuda_forward(x: &SparseAttentionInputs, options: SparseAttentionOptions) -> Result<(Tensor, Tensor)> {
    const OP: &str = "sparse_attention";
    let (t, h, d) = x.q.dims3()?;
    let q = aligned_rows(x.q)?;
    let ((kvw, w_fmt, w_page), (kvc, c_fmt, c_page)) = (kernel_source(x.window)?, kernel_source(x.extra)?);
    let (iw, ic, sink) = (x.idx_window.contiguous()?, x.idx_extra.contiguous()?, x.sink.contiguous()?);
    let index_bytes = iw.dtype().size_in_bytes() as i32;
    let (qs, ql) = q.storage_and_layout();
    let qc = as_cuda(&qs, "q")?;
    let stream = stream_for(qc)?;
    // SAFETY: uninitialized memory is fine: the kernel writes every element of both outputs.
    let out_slice = unsafe { qc.device.alloc::<bf16>(t * h * d)? };
    let lse_slice = unsafe { qc.device.alloc::<f32>(t * h)? };
    let mut out = CudaStorage::wrap_cuda_slice(out_slice, qc.device.clone());
    let mut lse = CudaStorage::wrap_cuda_slice(lse_slice, qc.device.clone());
    {
        let (ws, wl) = kvw.storage_and_layout();
        let (cs, cl) = kvc.storage_and_layout();
        let (iws, iwl) = iw.storage_and_layout();
        let (ics, icl) = ic.storage_and_layout();
        let (ss, sl) = sink.storage_and_layout();
        let (wc, cc) = (as_cuda(&ws, "window")?, as_cuda(&cs, "extra")?);
        let (iwc, icc, sc) = (as_cuda(&iws, "idx_window")?, as_cuda(&ics, "idx_extra")?, as_cuda(&ss, "sink")?);
        let (q_p, _g0) = read_ptr::<bf16>(qc, ql, &stream)?;
        let (w_p, w_stride, w_rows, _g1) = source_ptr(wc, wl, w_fmt, w_page, &stream)?;
        let (c_p, c_stride, c_rows, _g2) = source_ptr(cc, cl, c_fmt, c_page, &stream)?;
        let (iw_p, ic_p, _g3, _g4) = if index_bytes == 8 {
            let (a, ga) = read_ptr::<i64>(iwc, iwl, &stream)?;
            let (b, gb) = read_ptr::<i64>(icc, icl, &stream)?;
            (a.cast::<std::ffi::c_void>(), b.cast::<std::ffi::c_void>(), ga, gb)
        } else {
            let (a, ga) = read_ptr::<i32>(iwc, iwl, &stream)?;
            let (b, gb) = read_ptr::<i32>(icc, icl, &stream)?;
            (a.cast::<std::ffi::c_void>(), b.cast::<std::ffi::c_void>(), ga, gb)
        };
        let (s_p, _g5) = read_ptr::<f32>(sc, sl, &stream)?;
        let out_l = candle_core::Layout::contiguous((t, h, d));
        let lse_l = candle_core::Layout::contiguous((t, h));
        let (o_p, _g6) = write_ptr::<bf16>(&mut out, &out_l, &stream)?;
        let (l_p, _g7) = write_ptr::<f32>(&mut lse, &lse_l, &stream)?;
        let params = ffi::SparseAttentionParams {
            q: q_p.cast(),
            kv_window: w_p,
            kv_extra: c_p,
            idx_window: iw_p,
            idx_extra: ic_p,
            sink: s_p,
            out: o_p.cast(),
            lse: l_p,
            q_token_stride: if t <= 1 { (h * d) as i64 } else { ql.stride()[0] as i64 },
            q_head_stride: if h <= 1 { d as i64 } else { ql.stride()[1] as i64 },
            window_row_stride: w_stride,
            extra_row_stride: c_stride,
            num_window_rows: w_rows,
            num_extra_rows: c_rows,
            num_tokens: t as i32,
            num_heads: h as i32,
            head_dim: d as i32,
            kw: iwl.dims()[1] as i32,
            kc: icl.dims()[1] as i32,
            index_bytes,
            scale: x.scale,
            num_splits: options.num_splits.unwrap_or(0) as i32,
            window_format: w_fmt,
            extra_format: c_fmt,
            window_page_size: w_page,
            extra_page_size: c_page,
            kernel: match options.kernel {
                SparseAttentionKernel::Auto => ffi::SA_KERNEL_AUTO,
                SparseAttentionKernel::AllHeads => ffi::SA_KERNEL_ALL_HEADS,
                SparseAttentionKernel::HeadSplit => ffi::SA_KERNEL_HEAD_SPLIT,
                SparseAttentionKernel::HeadSplitPingPong => ffi::SA_KERNEL_HEAD_SPLIT_PINGPONG,
                SparseAttentionKernel::DimSplitPair => ffi::SA_KERNEL_DIM_SPLIT_PAIR,
            },
        };
        // SAFETY: every pointer comes from a storage read-locked (outputs: owned) for this call;
        // `check`, `aligned_rows` / `PackedLayout::check_cache` and the launcher validate shapes,
        // strides, formats and alignment; the kernel reads only rows with indices in [0, N) of
        // their source (packed: whole pages of the cache) and writes only the [T, H, D] / [T, H]
        // outputs.
        let code = unsafe {
            ffi::dsv41_sparse_attention(&params, std::mem::size_of::<ffi::SparseAttentionParams>(), raw_stream(&stream))
        };
        ffi::check_status(OP, code)?;
    }
    let out = Tensor::from_storage(Storage::Cuda(out), (t, h, d), BackpropOp::none(), false);
    let lse = Tensor::from_storage(Storage::Cuda(lse), (t, h), BackpropOp::none(), false);
    Ok((out, lse))
}
