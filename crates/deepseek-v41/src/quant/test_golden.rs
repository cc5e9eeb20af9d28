//! Test access to the module-level golden set (`tests/fixtures/v41-tiny/modules`).

use std::collections::HashMap;

use candle_core::{Device, Tensor};

/// Path of the module goldens inside the repository.
pub const MODULES: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/v41-tiny/modules/golden.safetensors");

/// Loads every tensor of the module golden file on the CPU.
pub fn modules() -> anyhow::Result<HashMap<String, Tensor>> {
    Ok(candle_core::safetensors::load(MODULES, &Device::Cpu)?)
}

/// The named tensor, or an error listing the name.
pub fn get<'a>(g: &'a HashMap<String, Tensor>, name: &str) -> anyhow::Result<&'a Tensor> {
    g.get(name).ok_or_else(|| anyhow::anyhow!("golden tensor {name} missing from {MODULES}"))
}

/// A rank-2 tensor's rows as f32 vectors.
pub fn f32_rows(g: &HashMap<String, Tensor>, name: &str) -> anyhow::Result<Vec<Vec<f32>>> {
    Ok(get(g, name)?.to_vec2::<f32>()?)
}

/// A rank-2 U8 tensor's rows.
pub fn u8_rows(g: &HashMap<String, Tensor>, name: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    Ok(get(g, name)?.to_vec2::<u8>()?)
}
