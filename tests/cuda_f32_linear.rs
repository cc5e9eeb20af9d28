//! GPU tests of the f32-weight linear at decode sizes (`kernels/f32_linear.cu`,
//! `cuda::f32_linear_device`): bit for bit the kernel's summation order replayed on the host
//! (per lane an FMA chain over its k — float4 steps of 128 when k is a multiple of 4, else
//! steps of 32 —, then the xor butterfly), close to the reference `cuda::f32_linear_ref` on the
//! CPU, each row independent of the others; bf16 and f32 input, 1 … 16 rows, k below a warp, odd,
//! at the embedded model's 192 and at 4096, n from 1 to 4096; outputs over NaN-poisoned memory;
//! `nn::Linear` of kind F32 on CUDA runs it; the errors.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_f32_linear`.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use deepseek_v41::cuda::{f32_linear_device, f32_linear_ref, f32_linear_supported, F32_LINEAR_MAX_M};
use deepseek_v41::nn::{Linear, LinearKind};
use deepseek_v41::Numerics;

#[path = "support/rng.rs"]
#[allow(dead_code)]
mod rng;
use rng::Rng;

#[path = "support/warp_sum.rs"]
mod warp_sum;
use warp_sum::xor_butterfly;

fn gpu() -> Device {
    Device::new_cuda(0).expect("tests/cuda_f32_linear.rs needs a CUDA device (none found): these tests must run on a GPU")
}

fn poison(dev: &Device, n: usize) -> Result<()> {
    drop(Tensor::full(f32::NAN, n.max(1), dev)?);
    Ok(())
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// One output of the kernel: row `x` `[k]` times weight row `w` `[k]` in its order.
fn kernel_order_dot(x: &[f32], w: &[f32]) -> f32 {
    let k = x.len();
    let mut lanes = [0.0f32; 32];
    for (l, lane) in lanes.iter_mut().enumerate() {
        if k.is_multiple_of(4) {
            let mut i = 4 * l;
            while i < k {
                for e in 0..4 {
                    *lane = x[i + e].mul_add(w[i + e], *lane);
                }
                i += 128;
            }
        } else {
            let mut i = l;
            while i < k {
                *lane = x[i].mul_add(w[i], *lane);
                i += 32;
            }
        }
    }
    xor_butterfly(lanes)
}

#[test]
fn matches_its_order_and_the_reference() -> Result<()> {
    let dev = gpu();
    let cpu = Device::Cpu;
    let mut rng = Rng(0xf32);
    for (m, n, k) in [(1usize, 8usize, 192usize), (3, 8, 192), (16, 33, 192), (1, 1, 7), (5, 70, 31), (2, 9, 4), (1, 4096, 4096), (16, 257, 4096), (9, 100, 1000)] {
        for dtype in [DType::BF16, DType::F32] {
            let xv: Vec<f32> = (0..m * k).map(|_| rng.normal() * 2f32.powi((rng.below(9) as i32) - 4)).collect();
            let wv: Vec<f32> = (0..n * k).map(|_| rng.normal() * 0.03).collect();
            let x = Tensor::from_vec(xv, (m, k), &dev)?.to_dtype(dtype)?;
            let w = Tensor::from_vec(wv.clone(), (n, k), &dev)?;
            ensure!(f32_linear_supported(&x, &w), "m {m}, n {n}, k {k}: not supported");
            poison(&dev, m * n)?;
            let y = f32_linear_device(&x, &w)?;
            ensure!(y.dims() == [m, n] && y.dtype() == DType::F32, "{:?} {:?}", y.shape(), y.dtype());
            let got = host(&y)?;
            let xs = host(&x)?;
            // 1. Bit for bit the kernel's order.
            let mut differ = 0;
            for r in 0..m {
                for j in 0..n {
                    let want = kernel_order_dot(&xs[r * k..(r + 1) * k], &wv[j * k..(j + 1) * k]);
                    if want.to_bits() != got[r * n + j].to_bits() {
                        differ += 1;
                    }
                }
            }
            ensure!(differ == 0, "m {m}, n {n}, k {k}, {dtype:?}: {differ} of {} outputs differ from the kernel order", m * n);
            // 2. Close to the reference on the CPU: |Δ| ≤ 1e-5 · Σ|x·w| per output.
            let want = host(&f32_linear_ref(&x.to_device(&cpu)?, &w.to_device(&cpu)?)?)?;
            for r in 0..m {
                for j in 0..n {
                    let mag: f32 = (0..k).map(|i| (xs[r * k + i] * wv[j * k + i]).abs()).sum();
                    let d = (got[r * n + j] - want[r * n + j]).abs();
                    ensure!(d <= 1e-5 * mag.max(1e-30), "m {m}, n {n}, k {k}, {dtype:?}: y[{r}, {j}] {} vs reference {}", got[r * n + j], want[r * n + j]);
                }
            }
            // 3. A row alone gives the bits it gets among the others.
            if m > 1 {
                let alone = host(&f32_linear_device(&x.narrow(0, m - 1, 1)?, &w)?)?;
                ensure!(alone.iter().zip(&got[(m - 1) * n..]).all(|(a, b)| a.to_bits() == b.to_bits()), "m {m}, n {n}, k {k}: the last row alone differs");
            }
        }
    }
    Ok(())
}

#[test]
fn linear_of_kind_f32_runs_it() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng(0x11ea);
    let (n, k) = (24usize, 192usize);
    let wv: Vec<f32> = (0..n * k).map(|_| rng.normal() * 0.05).collect();
    let mut map = std::collections::HashMap::new();
    map.insert("weight".to_string(), Tensor::from_vec(wv, (n, k), &Device::Cpu)?);
    let vb = VarBuilder::from_tensors(map, DType::F32, &dev);
    let lin = Linear::new(k, n, LinearKind::F32, Numerics::PLAIN, vb)?;
    for m in [1usize, 4, 16] {
        let x = Tensor::from_vec((0..m * k).map(|_| rng.normal()).collect::<Vec<f32>>(), (m, k), &dev)?.to_dtype(DType::BF16)?;
        let y = lin.forward(&x)?;
        let direct = f32_linear_device(&x, &lin.weight().dense().expect("a dense weight").clone())?;
        ensure!(y.dtype() == DType::F32 && y.dims() == [m, n], "{:?} {:?}", y.dtype(), y.shape());
        ensure!(host(&y)?.iter().zip(host(&direct)?).all(|(a, b)| a.to_bits() == b.to_bits()), "m {m}: Linear differs from the kernel");
        // [1, m, k] input: the same rows.
        let y3 = lin.forward(&x.unsqueeze(0)?)?;
        ensure!(y3.dims() == [1, m, n] && host(&y3)? == host(&y)?, "rank-3 input differs");
    }
    Ok(())
}

#[test]
fn errors() -> Result<()> {
    let dev = gpu();
    let x = Tensor::ones((F32_LINEAR_MAX_M + 1, 8), DType::BF16, &dev)?;
    let w = Tensor::ones((4, 8), DType::F32, &dev)?;
    ensure!(f32_linear_device(&x, &w).is_err(), "17 rows accepted");
    ensure!(f32_linear_device(&x.narrow(0, 0, 2)?, &w.to_dtype(DType::BF16)?).is_err(), "a bf16 weight accepted");
    ensure!(f32_linear_device(&x.narrow(0, 0, 2)?, &Tensor::ones((4, 9), DType::F32, &dev)?).is_err(), "k mismatch accepted");
    ensure!(!f32_linear_supported(&x.narrow(0, 0, 2)?.to_device(&Device::Cpu)?, &w.to_device(&Device::Cpu)?), "CPU tensors supported");
    ensure!(f32_linear_device(&x.narrow(0, 0, 0)?, &w).is_err(), "0 rows accepted");
    Ok(())
}
