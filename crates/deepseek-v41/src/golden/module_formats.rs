//! Module goldens of the number formats: QAT fake-quant (`fq.<format>.*`) and weight
//! dequantization (`dq.fp8.*`, `dq.mxfp4.*`, `dq.engram.L{l}.*`), all bit for bit.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Result, Tensor};

use super::compare::{Report, Tolerance};
use crate::loader::{dequant_fp8_block32, dequant_mxfp4, ReleaseCheckpoint};
use crate::quant::fake_quant::{fake_quant, quantize_block, QatFormat};
use crate::quant::packed::pack_row;

type Golden = HashMap<String, Tensor>;

fn bytes(t: &Tensor) -> Result<Vec<u8>> {
    t.to_dtype(DType::U8)?.flatten_all()?.to_vec1::<u8>()
}

/// `fq.<format>.{in, out, scale, codes_e4m3 | packed_e2m1}`: one row = one block.
pub fn check_fake_quant(g: &Golden, report: &mut Report) -> Result<Vec<String>> {
    let mut done = Vec::new();
    for fmt in [QatFormat::Fp8Ue8m0B32, QatFormat::Fp4E4m3B16, QatFormat::Fp4Ue8m0B32] {
        let p = format!("fq.{}", fmt.name());
        let Some(input) = g.get(&format!("{p}.in")) else { continue };
        let dev = input.device();
        if let Some(out) = g.get(&format!("{p}.out")) {
            report.check(&format!("modules/{p}.out"), &fake_quant(input, fmt)?, out, Tolerance::Exact)?;
        }
        let rows = input.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        if let Some(scale) = g.get(&format!("{p}.scale")) {
            let s: Vec<f32> = rows.iter().map(|r| quantize_block(fmt, r).scale).collect();
            report.check(&format!("modules/{p}.scale"), &Tensor::from_vec(s, scale.shape(), dev)?, scale, Tolerance::Exact)?;
        }
        let codes_name = if fmt.is_fp4() { "packed_e2m1" } else { "codes_e4m3" };
        if let Some(codes) = g.get(&format!("{p}.{codes_name}")) {
            let mut data = Vec::new();
            for r in &rows {
                data.extend(pack_row(fmt, r)?.0);
            }
            let ours = Tensor::from_vec(data, codes.shape(), dev)?;
            report.check(&format!("modules/{p}.{codes_name}"), &ours, codes, Tolerance::Exact)?;
        }
        done.push(format!("{p}."));
    }
    Ok(done)
}

/// `dq.fp8.<name>.*`, `dq.mxfp4.<name>.*` (weight bytes → `out`) and `dq.engram.L{l}.*` (rows of
/// the set's checkpoint looked up by id).
pub fn check_dequant(g: &Golden, checkpoint: &Path, report: &mut Report) -> Result<Vec<String>> {
    let mut done = Vec::new();
    let mut names: Vec<&String> = g.keys().filter(|k| k.starts_with("dq.") && k.ends_with(".out")).collect();
    names.sort();
    for out_name in names {
        let p = out_name.trim_end_matches(".out");
        let out = &g[out_name];
        let (o, i) = out.dims2()?;
        let scale = bytes(&g[&format!("{p}.scale_e8m0")])?;
        let ours = if p.starts_with("dq.fp8.") {
            dequant_fp8_block32(&bytes(&g[&format!("{p}.weight_e4m3")])?, &scale, o, i)?
        } else if p.starts_with("dq.mxfp4.") {
            dequant_mxfp4(&bytes(&g[&format!("{p}.weight_packed")])?, &scale, o, i)?
        } else {
            continue;
        };
        let ours = Tensor::from_vec(ours, (o, i), out.device())?;
        report.check(&format!("modules/{p}.out"), &ours, out, Tolerance::Exact)?;
        done.push(format!("{p}."));
    }
    let mut engram: Vec<&String> = g.keys().filter(|k| k.starts_with("dq.engram.") && k.ends_with(".ids")).collect();
    engram.sort();
    if !engram.is_empty() {
        let ckpt = ReleaseCheckpoint::open(&[checkpoint])?;
        for ids_name in engram {
            let p = ids_name.trim_end_matches(".ids");
            let layer = p.trim_start_matches("dq.engram.L");
            let ids: Vec<usize> = g[ids_name].to_dtype(DType::I64)?.to_vec1::<i64>()?.into_iter().map(|v| v as usize).collect();
            let rows = ckpt.get_raw_rows(&format!("layers.{layer}.engram.embed.weight"), &ids, DType::BF16, &Device::Cpu)?;
            report.check(&format!("modules/{p}.rows"), &rows, &g[&format!("{p}.rows")], Tolerance::Exact)?;
            done.push(format!("{p}."));
        }
    }
    Ok(done)
}
