//! Comparing a `loader::LoadPlan` with what a load placed (`ReleaseCheckpoint::placed_bytes`)
//! and what the model's linears hold (`LinearWeight::bytes`), to the byte; and the checkpoint the
//! host-memory tests place (include with `#[path = "support/plan_check.rs"] mod plan_check;`).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use deepseek_v41::loader::plan::Place;
use deepseek_v41::loader::{LoadPlan, ReleaseCheckpoint};
use deepseek_v41::model::Pretrained;
use safetensors::Dtype;

use crate::release_writer::{bytes, raw, scales, write_st};

/// The linears' bytes by weight name (`<prefix>.weight`).
pub fn linear_bytes(p: &Pretrained) -> BTreeMap<String, u64> {
    p.model.linears().into_iter().map(|(n, l)| (format!("{n}.weight"), l.weight().bytes() as u64)).collect()
}

/// Every planned device tensor was placed with exactly its planned bytes, nothing else was, each
/// linear holds its planned bytes, and the totals agree; returns a description of every
/// difference (empty: the plan is the placement to the byte).
pub fn differences(plan: &LoadPlan, placed: &BTreeMap<String, u64>, linears: &BTreeMap<String, u64>) -> Vec<String> {
    let mut out = Vec::new();
    let planned: BTreeMap<&str, u64> = plan.tensors.iter().filter(|t| t.place == Place::Device).map(|t| (t.name.as_str(), t.held_bytes)).collect();
    for (name, &bytes) in &planned {
        match placed.get(*name) {
            Some(&b) if b == bytes => {}
            got => out.push(format!("{name}: planned {bytes} B, placed {got:?}")),
        }
    }
    for name in placed.keys().filter(|n| !planned.contains_key(n.as_str())) {
        out.push(format!("{name}: placed but not planned on the device"));
    }
    for (name, &bytes) in linears {
        if planned.get(name.as_str()) != Some(&bytes) {
            out.push(format!("linear {name}: holds {bytes} B, planned {:?}", planned.get(name.as_str())));
        }
    }
    let total: u64 = placed.values().sum();
    let by_linears = linears.values().sum::<u64>() + placed.iter().filter(|(n, _)| !linears.contains_key(*n)).map(|(_, b)| b).sum::<u64>();
    if plan.device_bytes() != total || total != by_linears {
        out.push(format!("totals: planned {}, placed {total}, linears + other tensors {by_linears}", plan.device_bytes()));
    }
    out
}

/// Rows of the FP8-rows table of [`staging_checkpoint`].
pub const TABLE_ROWS: usize = 262_144;

/// A checkpoint in `dir` with a bf16 matrix `big.weight` `[4096, 8192]` (64 MiB), an FP8-rows
/// table `table.weight` `[262144, 256]` (64 MiB + scales, an Engram table's format), an FP8 32x32
/// weight `lin.weight` `[4096, 4096]` and an MXFP4 weight `experts.weight` `[4096, 4096]`.
pub fn staging_checkpoint(dir: &Path) -> Result<ReleaseCheckpoint> {
    let path = dir.join("model.safetensors");
    let (rows, cols) = (TABLE_ROWS, 256);
    write_st(
        &path,
        &[
            raw("big.weight", Dtype::BF16, &[4096, 8192], bytes(4096 * 8192 * 2, 1, true)),
            raw("table.weight", Dtype::F8_E4M3, &[rows, cols], bytes(rows * cols, 2, true)),
            raw("table.scale", Dtype::F8_E8M0, &[rows, cols / 32], scales(rows * cols / 32, 3)),
            raw("lin.weight", Dtype::F8_E4M3, &[4096, 4096], bytes(4096 * 4096, 4, true)),
            raw("lin.scale", Dtype::F8_E8M0, &[128, 128], scales(128 * 128, 5)),
            raw("experts.weight", Dtype::I8, &[4096, 2048], bytes(4096 * 2048, 6, false)),
            raw("experts.scale", Dtype::F8_E8M0, &[4096, 128], scales(4096 * 128, 7)),
        ],
    )?;
    Ok(ReleaseCheckpoint::open(&[path])?)
}
