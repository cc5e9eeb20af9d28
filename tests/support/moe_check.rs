//! Helpers shared by the GPU tests of the grouped MXFP4 experts (`tests/cuda_moe_experts.rs`,
//! `tests/cuda_moe_experts_gemm.rs`): device copies, poisoned memory, host reads, the CPU SwiGLU
//! of `model::Expert`, and the element-wise comparison with the CPU reference.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::quant::Mxfp4Weight;

/// `w` copied to `dev`.
pub fn to_dev(w: &Mxfp4Weight, dev: &Device) -> Result<Mxfp4Weight> {
    Ok(Mxfp4Weight::new(w.codes().to_device(dev)?, w.scales().to_device(dev)?)?)
}

/// Frees `n` f32 of NaN on `dev` so that the next allocations likely reuse poisoned memory.
pub fn poison(dev: &Device, n: usize) -> Result<()> {
    drop(Tensor::full(f32::NAN, n.max(1), dev)?);
    Ok(())
}

/// `t` as f32 values on the host.
pub fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// The CPU SwiGLU of `model::Expert` on bf16 gate / up `[n, inter]` with weights `[n, 1]`.
pub fn swiglu_cpu(gate: &Tensor, up: &Tensor, w: &Tensor, limit: Option<f64>) -> Result<Tensor> {
    let mut gate = gate.to_dtype(DType::F32)?;
    let mut up = up.to_dtype(DType::F32)?;
    if let Some(l) = limit {
        gate = gate.minimum(l)?;
        up = up.clamp(-l, l)?;
    }
    Ok(((gate.silu()? * up)?.broadcast_mul(w)?).to_dtype(DType::BF16)?)
}

/// Element-wise over rows of `width`: bit-equal, or within `ulps` bf16 ulps of the reference, or
/// (cancellation: a sum of large terms that nearly vanishes, where the f32 summation order shows)
/// within 2^-10 of the row's largest reference magnitude. Returns the mismatch count and the
/// largest distance in ulps.
pub fn compare(what: &str, got: &[f32], want: &[f32], width: usize, ulps: f32) -> Result<(usize, f32)> {
    ensure!(got.len() == want.len(), "{what}: {} vs {} elements", got.len(), want.len());
    let (mut diff, mut worst) = (0usize, 0f32);
    for (r, (gr, wr)) in got.chunks(width).zip(want.chunks(width)).enumerate() {
        let floor = wr.iter().fold(0f32, |m, v| m.max(v.abs())) * 2f32.powi(-10);
        for (c, (&g, &w)) in gr.iter().zip(wr).enumerate() {
            if g.to_bits() == w.to_bits() {
                continue;
            }
            diff += 1;
            ensure!(g.is_finite() && w.is_finite(), "{what}: row {r} col {c}: {g:e} vs {w:e}");
            let ulp = if w == 0.0 { f32::MIN_POSITIVE } else { 2f32.powi(w.abs().log2().floor() as i32 - 7) };
            let d = (g - w).abs() / ulp;
            if (g - w).abs() <= floor {
                continue;
            }
            worst = worst.max(d);
            ensure!(d <= ulps, "{what}: row {r} col {c}: {g:e} vs {w:e} ({d} bf16 ulps; row max {:e})", floor * 1024.0);
        }
    }
    Ok((diff, worst))
}
