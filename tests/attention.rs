//! The attention stack against the vendored golden set, teacher forced (every layer fed the
//! golden `attn_in`), and the equivalence of full prefill, chunked prefill and prefill + decode.

use std::path::PathBuf;

use anyhow::Result;
use candle_core::{DType, Device};
use deepseek_v41::attention::{Attention, SequenceCache};
use deepseek_v41::golden::runner::{
    compare_produced, run_attention_teacher_forced, Produced, Regime, RunOptions,
};
use deepseek_v41::golden::{compare, Call, GoldenSet, Report, Tolerance};
use deepseek_v41::loader;
use deepseek_v41::Numerics;

fn set() -> Result<GoldenSet> {
    Ok(GoldenSet::open(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/v41-tiny"))?)
}

/// Runs every layer's attention on `prefill_full`'s golden inputs with the given chunking.
fn run_chunked(calls: &[Call]) -> Result<Produced> {
    let set = set()?;
    let case = set.load_case(&set.root.join("prefill_full"), &Device::Cpu)?;
    Ok(run_attention_teacher_forced(&case, calls, &Device::Cpu, RunOptions::default())?)
}

#[test]
fn teacher_forced_attention_matches_the_reference() -> Result<()> {
    let set = set()?;
    let case = set.load_case(&set.root.join("prefill_full"), &Device::Cpu)?;
    let produced = run_attention_teacher_forced(&case, &case.inputs.calls, &Device::Cpu, RunOptions::default())?;
    let mut report = Report::default();
    let names = compare_produced(&case, &produced, Regime::TeacherForced, &mut report)?;
    // Every attention-level golden of the case must have been produced.
    for l in 0..case.config.num_hidden_layers {
        for n in ["attn_out", "window_kv"] {
            assert!(names.contains(&format!("L{l}.{n}")), "L{l}.{n} not compared");
        }
    }
    for n in ["L1.topk", "L4.cand_mask", "L4.cand_blocks", "L6.topk", "L7.topk", "L1.compressed_kv", "L4.index_k", "final.L3.carry_kv"] {
        assert!(names.contains(n), "{n} not compared");
    }
    assert_eq!(report.failed(), 0, "{} of {} comparisons failed", report.failed(), report.outcomes.len());
    Ok(())
}

#[test]
fn full_chunked_and_decode_agree() -> Result<()> {
    let full = run_chunked(&[Call { start_pos: 0, length: 40 }])?;
    let chunked = run_chunked(&[Call { start_pos: 0, length: 23 }, Call { start_pos: 23, length: 17 }])?;
    let mut calls = vec![Call { start_pos: 0, length: 23 }];
    calls.extend((23..40).map(|p| Call { start_pos: p, length: 1 }));
    let decode = run_chunked(&calls)?;
    let mut n = 0;
    for (name, t) in &full {
        for (what, other) in [("chunked", &chunked), ("decode", &decode)] {
            let tol = if name.ends_with("topk") || name.ends_with("cand_blocks") {
                Tolerance::IdSets
            } else {
                Tolerance::RelFro { rel_fro: 1e-3, max_abs: None }
            };
            let o = compare(&format!("{what}/{name}"), &other[name], t, tol)?;
            assert!(o.pass, "{o}");
            n += 1;
        }
    }
    assert!(n >= 2 * 9, "too few tensors compared: {n}");
    Ok(())
}

#[test]
fn reuse_layers_read_the_published_topk() -> Result<()> {
    // Layer 2 reuses layer 1's top-k: it matches the reference when run after layer 1, and a
    // cache where layer 1 never ran is refused with an error naming the missing source.
    let full = run_chunked(&[Call { start_pos: 0, length: 40 }])?;
    let set = set()?;
    let case = set.load_case(&set.root.join("prefill_full"), &Device::Cpu)?;
    let o = compare("L2.attn_out", &full["L2.attn_out"], &case.golden["L2.attn_out"], Tolerance::RelFro { rel_fro: 2e-3, max_abs: None })?;
    assert!(o.pass, "{o}");
    let cfg = &case.config;
    let vb = loader::var_builder(loader::ReleaseCheckpoint::open(&[&case.weights])?, DType::BF16, &Device::Cpu);
    let l2 = Attention::new(cfg, 2, Numerics::REFERENCE, vb.pp("layers.2.attn"))?;
    let mut cache = SequenceCache::new(cfg, DType::BF16, &Device::Cpu)?;
    let x = case.golden["L2.attn_in"].to_dtype(DType::BF16)?;
    let err = l2.forward(&x, 0, &mut cache).unwrap_err().to_string();
    assert!(err.contains("no top-k published by index source 1"), "{err}");
    Ok(())
}
