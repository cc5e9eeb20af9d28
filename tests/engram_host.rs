//! Engram tables kept in host memory, on the CPU (`tests/cuda_engram_host.rs` runs the same
//! checks on a GPU; the checks are in `tests/support/engram_tables.rs`):
//! * `HostRows` gathers rows in their stored form and decodes them bit for bit as
//!   `RowTable::lookup` in bf16, reusing its staging buffer;
//! * the released table shape (`[384006168, 256]` FP8 + scales) in a sparse file: `Auto` keeps it
//!   on the host without reading it, and its rows decode right;
//! * the embedded model with host tables gives the resident tables' logits bit for bit, one
//!   sequence and in batched calls of three (`Model::forward_batch`).

use anyhow::Result;
use candle_core::Device;

#[path = "support/release_writer.rs"]
mod release_writer;
#[path = "support/rng.rs"]
mod rng;
#[path = "support/engram_tables.rs"]
mod engram_tables;

#[test]
fn host_rows_equal_row_table_lookup() -> Result<()> {
    let pinned = engram_tables::check_host_rows(&Device::Cpu)?;
    anyhow::ensure!(!pinned, "no page-locked memory on the CPU");
    Ok(())
}

#[test]
fn released_table_shape_stays_on_the_host() -> Result<()> {
    let t = std::time::Instant::now();
    engram_tables::check_released_shape(&Device::Cpu)?;
    println!("released-shape check: {:.2} s", t.elapsed().as_secs_f64());
    Ok(())
}

#[test]
fn model_with_host_tables_equals_resident() -> Result<()> {
    engram_tables::check_model_host_equals_device(&Device::Cpu)?;
    Ok(())
}

#[test]
fn batched_model_with_host_tables_equals_resident() -> Result<()> {
    engram_tables::check_batch_host_equals_device(&Device::Cpu)?;
    Ok(())
}

#[test]
fn stepped_decode_with_host_tables_equals_resident() -> Result<()> {
    engram_tables::check_stepped_host_equals_device(&Device::Cpu)
}
