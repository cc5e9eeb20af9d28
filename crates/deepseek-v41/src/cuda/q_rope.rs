//! Query RoPE (spec §4.2): GPT-J rotation of the last R dims of every head of `q [T, H, D]` at
//! its token's position, out of place or in place, with an optional weightless per-head RMSNorm
//! before it (V4.0's q norm; V4.1 has none, pass `None`).
//!
//! On CUDA one kernel (`kernels/q_rope.cu`): in place without norm it touches only the rotated
//! tail of each head (1/8 of the bytes for D = 512, R = 64); otherwise one warp per head row.
//! On the CPU the crate's reference: [`rms_normalize_f32`] (then bf16) and [`apply_rope_tail`].
//! Both agree bit for bit (the norm: on x86-64 hosts with AVX2, see
//! [`super::index_key_insert`]).
//!
//! In place, `q` is written through candle's [`Tensor::inplace_op3`] (write lock on `q`'s
//! storage; `cos`/`sin` are f32 and cannot alias the bf16 `q`); every element the kernel writes
//! is an element of the `q` view.

use candle_core::{CpuStorage, CudaStorage, CustomOp3, DType, Device, InplaceOp3, Layout, Result, Shape, Tensor};
use half::bf16;

use super::device::{raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi;
use super::row_inputs::{gather, layout_offsets, CUDA_HEAD_DIMS};
use crate::nn::rms_norm::rms_normalize_f32;
use crate::nn::rope::apply_rope_tail;

/// Returns `RoPE(norm?(q))` as a new `[T, H, D]` bf16 tensor.
///
/// * `q`: `[T, H, D]` bf16 (any strides; D ∈ {64, 128, 256, 512} on CUDA).
/// * `cos`, `sin`: `[T, R/2]` f32 angles of each token's position
///   ([`crate::nn::RopeTable::cos_sin`]); RoPE rotates dims `[D - R, D)`.
/// * `norm_eps`: `Some(eps)` applies the weightless per-head RMSNorm `q / sqrt(mean(q²) + eps)`
///   (f32, rounded to bf16) before RoPE; `None` for V4.1.
pub fn q_rope(q: &Tensor, cos: &Tensor, sin: &Tensor, norm_eps: Option<f64>) -> Result<Tensor> {
    check(q, cos, sin, "q_rope")?;
    let mut q = q.clone();
    if q.device().is_cuda() && !aligned_rows(&q) {
        q = q.contiguous()?;
        if !aligned_rows(&q) {
            q = q.copy()?;
        }
    }
    q.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &QRope { norm_eps })
}

/// Rotates `q` in place: `q = RoPE(norm?(q))`; same arguments as [`q_rope`]. On CUDA the
/// `q` view's rows must start on 16-byte boundaries (true for tensors produced by candle ops
/// and their reshapes / head narrows).
pub fn q_rope_inplace(q: &Tensor, cos: &Tensor, sin: &Tensor, norm_eps: Option<f64>) -> Result<()> {
    check(q, cos, sin, "q_rope_inplace")?;
    q.inplace_op3(&cos.contiguous()?, &sin.contiguous()?, &QRope { norm_eps })
}

fn check(q: &Tensor, cos: &Tensor, sin: &Tensor, op: &str) -> Result<()> {
    if q.dtype() != DType::BF16 || q.rank() != 3 {
        candle_core::bail!("{op}: q must be [T, H, D] bf16, got {:?} {:?}", q.dtype(), q.shape())
    }
    let (t, _, d) = q.dims3()?;
    for (name, x) in [("cos", cos), ("sin", sin)] {
        if x.dtype() != DType::F32 || x.rank() != 2 || x.dim(0)? != t {
            candle_core::bail!("{op}: {name} must be [T={t}, rope_dim/2] f32, got {:?} {:?}", x.dtype(), x.shape())
        }
        if !x.device().same_device(q.device()) {
            candle_core::bail!("{op}: {name} is on {:?} but q is on {:?}", x.device(), q.device())
        }
    }
    if cos.dims() != sin.dims() {
        candle_core::bail!("{op}: cos {:?} and sin {:?} differ", cos.shape(), sin.shape())
    }
    let r = 2 * cos.dim(1)?;
    if r == 0 || r > d {
        candle_core::bail!("{op}: rope_dim {r} (from cos {:?}) must be in 2..={d}", cos.shape())
    }
    if q.stride()[2] != 1 {
        candle_core::bail!("{op}: q's last dim must be contiguous, got strides {:?}", q.stride())
    }
    if q.device().is_cuda() && !CUDA_HEAD_DIMS.contains(&d) {
        candle_core::bail!("{op}: the CUDA kernel supports head_dim 64, 128, 256 or 512, got {d}")
    }
    if t > i32::MAX as usize || q.dim(1)? > i32::MAX as usize {
        candle_core::bail!("{op}: q {:?} exceeds the kernel's i32 counts", q.shape())
    }
    Ok(())
}

/// Whether the rows of `q` meet the full-row kernel's vector alignment.
fn aligned_rows(q: &Tensor) -> bool {
    let v = (q.dim(2).unwrap_or(0) / 32).clamp(1, 8);
    let s = q.stride();
    s[2] == 1 && q.layout().start_offset().is_multiple_of(v) && s[0].is_multiple_of(v) && s[1].is_multiple_of(v)
}

/// The op: `norm_eps` selects the optional weightless RMSNorm.
struct QRope {
    norm_eps: Option<f64>,
}

impl QRope {
    /// The CPU reference on `[T, H, D]` bf16 (CPU tensors).
    fn reference(&self, q: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = match self.norm_eps {
            Some(eps) => rms_normalize_f32(q, eps)?.to_dtype(q.dtype())?,
            None => q.clone(),
        };
        apply_rope_tail(&x, cos, sin)
    }

    fn cpu_reference(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        cos: &CpuStorage,
        cl: &Layout,
        sin: &CpuStorage,
        sl: &Layout,
    ) -> Result<Vec<bf16>> {
        let q = Tensor::from_vec(gather::<bf16>(q, ql, "q")?, ql.shape(), &Device::Cpu)?;
        let cos = Tensor::from_vec(gather::<f32>(cos, cl, "cos")?, cl.shape(), &Device::Cpu)?;
        let sin = Tensor::from_vec(gather::<f32>(sin, sl, "sin")?, sl.shape(), &Device::Cpu)?;
        self.reference(&q, &cos, &sin)?.flatten_all()?.to_vec1::<bf16>()
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        q: *const bf16,
        ql: &Layout,
        out: *mut bf16,
        out_strides: (usize, usize),
        cos: *const f32,
        sin: *const f32,
        rope_half: usize,
        stream: &candle_core::cuda_backend::cudarc::driver::CudaStream,
    ) -> Result<()> {
        let (t, h, d) = ql.shape().dims3()?;
        let params = ffi::QRopeParams {
            q: q.cast(),
            out: out.cast(),
            cos,
            sin,
            q_token_stride: ql.stride()[0] as i64,
            q_head_stride: ql.stride()[1] as i64,
            out_token_stride: out_strides.0 as i64,
            out_head_stride: out_strides.1 as i64,
            num_tokens: t as i32,
            num_heads: h as i32,
            head_dim: d as i32,
            rope_dim: 2 * rope_half as i32,
            apply_norm: self.norm_eps.is_some() as i32,
            norm_eps: self.norm_eps.unwrap_or(0.0) as f32,
            norm_inv_dim: (1.0 / d as f64) as f32,
            _pad: 0,
        };
        // SAFETY: pointers come from storages locked for this call; `check` and the launcher
        // validate shapes, strides and alignment; the kernel writes only elements of `out`'s
        // [T, H, D] view.
        let code = unsafe { ffi::dsv41_q_rope(&params, std::mem::size_of::<ffi::QRopeParams>(), raw_stream(stream)) };
        ffi::check_status("q_rope", code)
    }
}

impl CustomOp3 for QRope {
    fn name(&self) -> &'static str {
        "q_rope"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        cos: &CpuStorage,
        cl: &Layout,
        sin: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = self.cpu_reference(q, ql, cos, cl, sin, sl)?;
        Ok((CpuStorage::BF16(out), ql.shape().clone()))
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        cos: &CudaStorage,
        cl: &Layout,
        sin: &CudaStorage,
        sl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let stream = stream_for(q)?;
        let (t, h, d) = ql.shape().dims3()?;
        // SAFETY: uninitialized memory is fine: the full-row kernel writes every element.
        let out_slice = unsafe { q.device.alloc::<bf16>(t * h * d)? };
        let mut out = CudaStorage::wrap_cuda_slice(out_slice, q.device.clone());
        {
            let (cos_p, _c) = read_ptr::<f32>(cos, cl, &stream)?;
            let (sin_p, _s) = read_ptr::<f32>(sin, sl, &stream)?;
            let (q_p, _q) = read_ptr::<bf16>(q, ql, &stream)?;
            let out_layout = Layout::contiguous(ql.shape());
            let (out_p, _o) = write_ptr::<bf16>(&mut out, &out_layout, &stream)?;
            self.launch(q_p, ql, out_p, (h * d, d), cos_p, sin_p, cl.dims()[1], &stream)?;
        }
        Ok((out, ql.shape().clone()))
    }
}

impl InplaceOp3 for QRope {
    fn name(&self) -> &'static str {
        "q_rope_inplace"
    }

    fn cpu_fwd(
        &self,
        q: &mut CpuStorage,
        ql: &Layout,
        cos: &CpuStorage,
        cl: &Layout,
        sin: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let out = self.cpu_reference(q, ql, cos, cl, sin, sl)?;
        let CpuStorage::BF16(v) = q else { candle_core::bail!("q_rope_inplace: expected bf16 storage for q") };
        for (i, idx) in layout_offsets(ql).into_iter().enumerate() {
            v[idx] = out[i];
        }
        Ok(())
    }

    fn cuda_fwd(
        &self,
        q: &mut CudaStorage,
        ql: &Layout,
        cos: &CudaStorage,
        cl: &Layout,
        sin: &CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        let stream = stream_for(cos)?;
        let (cos_p, _c) = read_ptr::<f32>(cos, cl, &stream)?;
        let (sin_p, _s) = read_ptr::<f32>(sin, sl, &stream)?;
        let (q_p, _q) = write_ptr::<bf16>(q, ql, &stream)?;
        let strides = (ql.stride()[0], ql.stride()[1]);
        self.launch(q_p, ql, q_p, strides, cos_p, sin_p, cl.dims()[1], &stream)
    }
}
