//! What the GPU tests of the grouped MXFP4 experts share (`tests/cuda_moe_experts.rs`: the
//! streaming kernels, `tests/cuda_moe_experts_gemm.rs`: the tensor-core GEMM): the case runner
//! [`run_case`] that checks one routing of random data against the CPU reference, and its helpers
//! (device copies, poisoned memory, host reads, the CPU SwiGLU of `model::Expert`, the element-wise
//! comparison).

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::cuda::{moe_experts_device_with, moe_route_device, GroupedExperts, MoeExpertsKernel};
use deepseek_v41::quant::{mxfp4_linear_ref, Mxfp4Weight};

use crate::rng::Rng;

/// `w` copied to `dev`.
pub fn to_dev(w: &Mxfp4Weight, dev: &Device) -> Result<Mxfp4Weight> {
    Ok(Mxfp4Weight::new(w.codes().to_device(dev)?, w.scales().to_device(dev)?)?)
}

/// Frees `n` f32 of NaN on `dev` so that the next allocations likely reuse poisoned memory.
fn poison(dev: &Device, n: usize) -> Result<()> {
    drop(Tensor::full(f32::NAN, n.max(1), dev)?);
    Ok(())
}

/// `t` as f32 values on the host.
pub fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// The CPU SwiGLU of `model::Expert` on bf16 gate / up `[n, inter]` with weights `[n, 1]`.
fn swiglu_cpu(gate: &Tensor, up: &Tensor, w: &Tensor, limit: Option<f64>) -> Result<Tensor> {
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
fn compare(what: &str, got: &[f32], want: &[f32], width: usize, ulps: f32) -> Result<(usize, f32)> {
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

/// The shape, routing and kernels of one case.
#[derive(Debug, Clone, Copy)]
pub struct MoeCase {
    /// Experts.
    pub e: usize,
    /// Experts per token.
    pub k: usize,
    /// Hidden width D (`w1` / `w3` `[inter, D]`, `w2` `[D, inter]`).
    pub d: usize,
    /// Expert intermediate width.
    pub inter: usize,
    /// Tokens.
    pub t: usize,
    /// Every token on experts `0..k` (the rest empty) instead of random logits.
    pub skew: bool,
    /// The kernels of the two projections.
    pub kernel: MoeExpertsKernel,
}

impl MoeCase {
    /// E experts, top-k, hidden D, inter, T tokens: random routing, `MoeExpertsKernel::Auto`.
    pub fn new(e: usize, k: usize, d: usize, inter: usize, t: usize) -> Self {
        MoeCase { e, k, d, inter, t, skew: false, kernel: MoeExpertsKernel::Auto }
    }

    /// With `skew`, every token on experts `0..k` (the rest empty).
    pub fn skewed(self, skew: bool) -> Self {
        MoeCase { skew, ..self }
    }

    /// On `kernel`.
    pub fn on(self, kernel: MoeExpertsKernel) -> Self {
        MoeCase { kernel, ..self }
    }
}

/// Runs `c` on `dev` with random data from `Rng(seed)`: the experts from `weight(rng, expert, n,
/// k)` (`[n, k]` on the CPU; `w1`, `w3`, `w2` of each expert in turn), then x, the shared expert's
/// output and the router logits; over NaN-poisoned memory. Checks against the CPU path: each slot's
/// SwiGLU activation (times its routing weight) against `quant::mxfp4_linear_ref` for `w1` / `w3`
/// and the SwiGLU ops of `model::Expert`, each slot's expert output against `mxfp4_linear_ref` of
/// the device's activations (only the f32 summation order differs: bit-equal or within 2 bf16 ulp
/// or a cancellation, at most 5 % inexact), the combine bit for bit against the CPU's f32 sum in
/// expert-id order plus the shared output, and the end-to-end output against the all-CPU pipeline
/// (relative Frobenius error). `label` is added to the case's name in messages.
pub fn run_case(
    dev: &Device,
    c: &MoeCase,
    label: &str,
    seed: u64,
    mut weight: impl FnMut(&mut Rng, usize, usize, usize) -> Result<Mxfp4Weight>,
) -> Result<()> {
    let mut rng = Rng(seed);
    let host: Vec<[Mxfp4Weight; 3]> = (0..c.e)
        .map(|e| -> Result<[Mxfp4Weight; 3]> {
            Ok([weight(&mut rng, e, c.inter, c.d)?, weight(&mut rng, e, c.inter, c.d)?, weight(&mut rng, e, c.d, c.inter)?])
        })
        .collect::<Result<_>>()?;
    let rng = &mut rng;
    let name = format!("{:?} E {} k {} D {} inter {} T {} skew {} {label}", c.kernel, c.e, c.k, c.d, c.inter, c.t, c.skew);
    let limit = Some(10.0f64);
    let grouped = GroupedExperts::new(host.iter().map(|[a, b, w]| Ok([to_dev(a, dev)?, to_dev(b, dev)?, to_dev(w, dev)?])).collect::<Result<_>>()?)?;
    let x_h: Vec<f32> = (0..c.t * c.d).map(|_| rng.normal()).collect();
    let x_cpu = Tensor::from_vec(x_h, (c.t, c.d), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let shared_cpu = Tensor::from_vec((0..c.t * c.d).map(|_| rng.normal()).collect::<Vec<f32>>(), (c.t, c.d), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let (x, shared) = (x_cpu.to_device(dev)?, shared_cpu.to_device(dev)?);
    // Routing on the device: random logits, or every token on experts 0..k (the rest empty).
    let logits: Vec<f32> = (0..c.t * c.e).map(|_| rng.normal()).collect();
    let bias: Vec<f32> = (0..c.e).map(|i| if c.skew && i < c.k { 100.0 } else { 0.0 }).collect();
    let routing = moe_route_device(&Tensor::from_vec(logits, (c.t, c.e), dev)?, &Tensor::from_vec(bias, c.e, dev)?, c.k, 1.0, 1.5)?;
    poison(dev, c.t * c.k * (c.d + c.inter) + c.t * c.d)?;
    let got = moe_experts_device_with(&x, &routing, &grouped, limit.map(|l| l as f32), Some(&shared), c.kernel)?;
    let (act, y, out) = (host_f32(&got.act)?, host_f32(&got.y)?, host_f32(&got.out)?);

    let ids = routing.ids.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u32>()?;
    let weights = routing.weights.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    let order = routing.order.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
    let offsets = routing.offsets.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
    let act_dev_cpu = got.act.to_device(&Device::Cpu)?;
    let mut pos = vec![0usize; c.t * c.k];
    let (mut act_ref, mut y_ref, mut y_full) = (vec![0f32; act.len()], vec![0f32; y.len()], vec![0f32; y.len()]);
    for e in 0..c.e {
        let (p0, p1) = (offsets[e] as usize, offsets[e + 1] as usize);
        if p0 == p1 {
            continue;
        }
        let slots: Vec<usize> = order[p0..p1].iter().map(|&s| s as usize).collect();
        for (i, &s) in slots.iter().enumerate() {
            pos[s] = p0 + i;
        }
        let rows = Tensor::from_vec(slots.iter().map(|&s| (s / c.k) as u32).collect::<Vec<_>>(), slots.len(), &Device::Cpu)?;
        let w = Tensor::from_vec(slots.iter().map(|&s| weights[s]).collect::<Vec<_>>(), (slots.len(), 1), &Device::Cpu)?;
        let xr = x_cpu.index_select(&rows, 0)?;
        let [w1, w3, w2] = &host[e];
        let a = swiglu_cpu(&mxfp4_linear_ref(&xr, w1, true)?, &mxfp4_linear_ref(&xr, w3, true)?, &w, limit)?;
        act_ref[p0 * c.inter..p1 * c.inter].copy_from_slice(&host_f32(&a)?);
        let yd = mxfp4_linear_ref(&act_dev_cpu.narrow(0, p0, p1 - p0)?, w2, true)?;
        y_ref[p0 * c.d..p1 * c.d].copy_from_slice(&host_f32(&yd)?);
        y_full[p0 * c.d..p1 * c.d].copy_from_slice(&host_f32(&mxfp4_linear_ref(&a, w2, true)?)?);
    }
    let (act_diff, act_worst) = compare(&format!("{name}: act"), &act, &act_ref, c.inter, 2.0)?;
    let (y_diff, y_worst) = compare(&format!("{name}: y"), &y, &y_ref, c.d, 2.0)?;
    ensure!(act_diff * 20 <= act.len() && y_diff * 20 <= y.len(), "{name}: too many inexact elements: act {act_diff} / {}, y {y_diff} / {}", act.len(), y.len());
    // The combine: the CPU's f32 sum in expert-id order of the device's y, plus shared; exact.
    let sh = host_f32(&shared_cpu)?;
    let combine = |ys: &[f32]| -> Vec<f32> {
        let mut o = vec![0f32; c.t * c.d];
        for t in 0..c.t {
            let mut sel: Vec<(u32, usize)> = (0..c.k).map(|j| (ids[t * c.k + j], pos[t * c.k + j])).collect();
            sel.sort();
            for col in 0..c.d {
                let mut acc = 0f32;
                for &(_, p) in &sel {
                    acc += ys[p * c.d + col];
                }
                acc += sh[t * c.d + col];
                o[t * c.d + col] = half::bf16::from_f32(acc).to_f32();
            }
        }
        o
    };
    let out_ref = combine(&y);
    let bad = out.iter().zip(&out_ref).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    ensure!(bad == 0, "{name}: combine differs from the CPU sum in {bad} of {} elements", out.len());
    // End to end against the all-CPU pipeline.
    let full = combine(&y_full);
    let (num, den) = out.iter().zip(&full).fold((0f64, 0f64), |(n, d), (&a, &b)| (n + ((a - b) as f64).powi(2), d + (b as f64).powi(2)));
    let rel = (num / den.max(1e-30)).sqrt();
    ensure!(rel <= 1e-2, "{name}: end to end rel_fro {rel:e}");
    println!("{name}: act {act_diff}/{} inexact (worst {act_worst} ulp), y {y_diff}/{} (worst {y_worst}), end to end rel_fro {rel:.2e}", act.len(), y.len());
    Ok(())
}
