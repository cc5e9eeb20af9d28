//! The host memory `ReleaseCheckpoint::get` allocates while it places a tensor (`loader::staging`,
//! `docs/perf.md` "Loading"), counted by a counting global allocator: at most the tensor it
//! returns plus one staging chunk on the CPU, against the whole-tensor staging it replaced (a
//! stored-dtype copy next to the f32 copy of a bf16 tensor: 1.5x; the f32 dequantization next to
//! the bf16 copy of an Engram table: 3x). `tests/cuda_load_plan.rs` measures the CUDA side.
//! Prints the figures (`cargo test --release --test load_host_peak -- --nocapture`).

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use deepseek_v41::loader::staging::STAGING_CHUNK_BYTES;
use deepseek_v41::loader::dequant_fp8_rows;

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

#[path = "support/release_writer.rs"]
mod release_writer;
use release_writer::TempDir;

#[path = "support/plan_check.rs"]
mod plan_check;
use plan_check::{staging_checkpoint, TABLE_ROWS};

#[global_allocator]
static ALLOC: counting_alloc::Counting = counting_alloc::Counting;

const MIB: f64 = (1 << 20) as f64;

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// CPU: each tensor's peak is at most what `get` returns plus 1.5 staging chunks (an f32 chunk
/// and its cast) and 1 MiB; the whole-tensor staging it replaced peaks at 1.5x and 3x; the values
/// are the same bit for bit.
#[test]
fn cpu_placement_peaks_at_the_tensor_plus_one_chunk() -> Result<()> {
    let dir = TempDir::new("host-peak")?;
    let ckpt = staging_checkpoint(&dir.0)?;
    let cpu = Device::Cpu;
    let bar = |held: usize| held + STAGING_CHUNK_BYTES * 3 / 2 + (1 << 20);
    for (name, dtype) in [("big.weight", DType::F32), ("table.weight", DType::BF16), ("lin.weight", DType::F32), ("big.weight", DType::BF16)] {
        let (t, peak, kept) = counting_alloc::measure(|| ckpt.get(name, dtype, &cpu));
        let t = t?;
        let held = t.elem_count() * dtype.size_in_bytes();
        println!(
            "{name} as {dtype:?} on the CPU: held {:.1} MiB, peak {:.1} MiB = {:.3} x held (kept {:.1} MiB)",
            held as f64 / MIB,
            peak as f64 / MIB,
            peak as f64 / held as f64,
            kept as f64 / MIB
        );
        ensure!(peak <= bar(held), "{name} {dtype:?}: peak {peak} B above the tensor {held} B + 1.5 chunks + 1 MiB");
        ensure!(kept <= held + (1 << 20), "{name}: {kept} B kept for a {held} B tensor");
    }

    // The whole-tensor staging the loader did before, measured the same way: the bar catches it.
    let w = ckpt.raw_bytes("big.weight")?;
    let (old, peak, _) = counting_alloc::measure(|| Tensor::from_raw_buffer(w, DType::BF16, &[4096, 8192], &cpu)?.to_dtype(DType::F32));
    let old = old?;
    let held = old.elem_count() * 4;
    println!("big.weight as F32, whole-tensor staging: peak {:.1} MiB = {:.3} x held", peak as f64 / MIB, peak as f64 / held as f64);
    ensure!(peak > bar(held), "the old path's {peak} B must fail the bar");
    ensure!(bits(&old)? == bits(&ckpt.get("big.weight", DType::F32, &cpu)?)?);
    let (w, s) = (ckpt.raw_bytes("table.weight")?, ckpt.raw_bytes("table.scale")?);
    let (old, peak, _) = counting_alloc::measure(|| -> Result<Tensor> {
        let v = dequant_fp8_rows(w, s, TABLE_ROWS, 256)?;
        Ok(Tensor::from_vec(v, (TABLE_ROWS, 256), &cpu)?.to_dtype(DType::BF16)?)
    });
    let old = old?;
    let held = old.elem_count() * 2;
    println!("table.weight as BF16, whole-tensor staging: peak {:.1} MiB = {:.3} x held", peak as f64 / MIB, peak as f64 / held as f64);
    ensure!(peak > bar(held), "the old path's {peak} B must fail the bar");
    ensure!(bits(&old)? == bits(&ckpt.get("table.weight", DType::BF16, &cpu)?)?);
    Ok(())
}
