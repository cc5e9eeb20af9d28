//! Engram tables kept in host memory on a GPU (`model::engram_host`; the checks are in
//! `tests/support/engram_tables.rs`, which `tests/engram_host.rs` runs on the CPU):
//! * `HostRows` on CUDA: the rows staged in page-locked memory, copied once and decoded on the
//!   device, bit for bit `RowTable::lookup(.., BF16)` (every code and scale byte), the staging
//!   buffer reused across calls of different sizes; on a plain device and on `decode_device`
//!   (cudarc's per-buffer events off, so the staging buffer's own event must order the refills);
//! * the released table shape (`[384006168, 256]` FP8 + scales) in a sparse file: `Auto` keeps it
//!   on the host without reading it, rows decode right, the Engram module matches;
//! * the embedded model on the GPU with host tables gives the resident tables' logits bit for bit
//!   (prefill + 6 decode steps), on both devices, and in batched calls of three sequences.
//!
//! These tests need a CUDA device and FAIL without one.
//! Build: `cargo test --release --features cuda --test cuda_engram_host`.

use anyhow::{ensure, Result};
use candle_core::Device;
use deepseek_v41::cuda::decode_device;

#[path = "support/release_writer.rs"]
mod release_writer;
#[path = "support/rng.rs"]
mod rng;
#[path = "support/engram_tables.rs"]
mod engram_tables;

fn gpus() -> Result<[Device; 2]> {
    let plain = Device::new_cuda(0).map_err(|e| anyhow::anyhow!("tests/cuda_engram_host.rs needs a CUDA device (none found: {e})"))?;
    Ok([plain, decode_device(0)?])
}

#[test]
fn host_rows_equal_row_table_lookup() -> Result<()> {
    for dev in gpus()? {
        let pinned = engram_tables::check_host_rows(&dev)?;
        ensure!(pinned, "the staging buffer should be page-locked on CUDA");
    }
    Ok(())
}

#[test]
fn released_table_shape_stays_on_the_host() -> Result<()> {
    for dev in gpus()? {
        engram_tables::check_released_shape(&dev)?;
    }
    Ok(())
}

#[test]
fn model_with_host_tables_equals_resident() -> Result<()> {
    for dev in gpus()? {
        let pinned = engram_tables::check_model_host_equals_device(&dev)?;
        ensure!(pinned, "the model's host tables should stage in page-locked memory on CUDA");
    }
    Ok(())
}

#[test]
fn batched_model_with_host_tables_equals_resident() -> Result<()> {
    for dev in gpus()? {
        engram_tables::check_batch_host_equals_device(&dev)?;
    }
    Ok(())
}

#[test]
fn graphed_decode_with_host_tables_equals_resident() -> Result<()> {
    engram_tables::check_stepped_host_equals_device(&decode_device(0)?)
}
