//! The end-to-end comparison of a case, margin-aware (`decisions.rs`): the differing discrete
//! decisions are found and classified first; then every golden tensor is compared under its
//! tolerance on the rows outside the causal cone of a divergence, and the rows inside it are
//! compared and reported separately as downstream.

use std::collections::HashSet;

use candle_core::{DType, Device, Result, Tensor};

use super::compare::{id_set_rows, Report};
use super::decisions::{snapshot_layer, tensor_position, Analysis, Decision, DecisionKind, Mismatch};
use super::runner::{comparable, sorted, tolerance_of, Produced, Regime};
use super::Case;

/// Finds the decisions of `e2e` that differ from the case's goldens and classifies them, with the
/// teacher-forced run's decisions `tf` (from the attention and MoE teacher-forced runs) and the
/// set's recorded margins.
pub fn analyze(case: &Case, e2e: &Produced, tf: &Produced) -> Result<Analysis> {
    let mut mismatches = Vec::new();
    for l in 0..case.config.num_hidden_layers {
        for kind in [DecisionKind::Index, DecisionKind::Candidate, DecisionKind::Moe] {
            let name = format!("L{l}.{}", kind.tensor());
            let (Some(golden), Some(ours)) = (case.golden.get(&name), e2e.get(&name)) else { continue };
            let rows = golden.dim(0)?;
            if ours.dim(0)? != rows {
                continue; // a shape difference fails in the tensor comparison
            }
            let (g, o) = (id_set_rows(golden, rows)?, id_set_rows(ours, rows)?);
            let t = tf.get(&name).filter(|t| t.dim(0).ok() == Some(rows)).map(|t| id_set_rows(t, rows)).transpose()?;
            let margins = case.golden.get(&format!("L{l}.{}", kind.margin_tensor())).map(|m| m.to_dtype(DType::F32)?.to_vec1::<f32>()).transpose()?;
            for r in (0..rows).filter(|&r| g[r] != o[r]) {
                mismatches.push(Mismatch {
                    decision: Decision { layer: l, row: r, kind },
                    margin: margins.as_ref().and_then(|m| m.get(r).copied()),
                    teacher_forced_agrees: t.as_ref().map(|t| t[r] == g[r]),
                });
            }
        }
    }
    Ok(Analysis::classify(mismatches))
}

/// Prints the case's divergences (the first one, each root, the number downstream) and records
/// the counts in `report`.
pub fn report_divergences(case: &Case, analysis: &Analysis, report: &mut Report) {
    match analysis.first() {
        None => println!("DECISIONS {}: every end-to-end discrete decision equals the reference's", case.name),
        Some(first) => println!("DECISIONS {}: first differing decision {first}", case.name),
    }
    let downstream = analysis.divergences.len() - analysis.roots().count();
    for root in analysis.roots() {
        let tag = if root.verdict.explained() { "EXPLAINED" } else { "UNEXPLAINED" };
        println!("{tag} {}/{root}", case.name);
    }
    if downstream > 0 {
        println!("DOWNSTREAM {}: {downstream} more differing decisions in the cones of those above", case.name);
    }
    report.explained += analysis.roots().filter(|d| d.verdict.explained()).count();
    report.downstream_decisions += downstream;
}

/// Compares every golden tensor `produced` holds (end to end): rows outside the cones of
/// `analysis`'s divergences under the tensor's tolerance, rows inside (and explained root rows)
/// separately as downstream. Returns the names compared.
pub fn compare_end_to_end(case: &Case, produced: &Produced, analysis: &Analysis, report: &mut Report) -> Result<HashSet<String>> {
    let n_layers = case.config.num_hidden_layers;
    let tokens = case.inputs.input_ids.len();
    let mut compared = HashSet::new();
    for (name, golden) in sorted(&case.golden) {
        let Some(ours) = produced.get(name) else { continue };
        compared.insert(name.clone());
        let full = format!("{}/{name}", case.name);
        let (ours, golden) = comparable(case, produced, name, ours, golden)?;
        let tol = tolerance_of(name, Regime::EndToEnd, &golden)?;
        let rows = golden.dim(0).unwrap_or(0);
        let excluded = excluded_rows(name, rows, tokens, n_layers, analysis);
        if !excluded.iter().any(|&x| x) || golden.dims() != ours.dims() {
            report.check(&full, &ours, &golden, tol)?;
            continue;
        }
        let (ours, golden) = (ours.to_device(&Device::Cpu)?, golden.to_device(&Device::Cpu)?);
        let pick = |keep: bool| -> Vec<u32> { (0..rows).filter(|&r| excluded[r] != keep).map(|r| r as u32).collect() };
        let (clean, cone) = (pick(true), pick(false));
        if !clean.is_empty() {
            let idx = Tensor::new(clean.as_slice(), &Device::Cpu)?;
            report.check(&format!("{full} (rows outside divergence cones)"), &ours.index_select(&idx, 0)?, &golden.index_select(&idx, 0)?, tol)?;
        }
        let idx = Tensor::new(cone.as_slice(), &Device::Cpu)?;
        let o = super::compare(&full, &ours.index_select(&idx, 0)?, &golden.index_select(&idx, 0)?, tol)?;
        report.add_downstream(o, &describe_rows(&cone));
    }
    Ok(compared)
}

/// Rows of golden tensor `name` (`rows` rows; the case has `tokens` tokens) not compared under
/// its tolerance: those in a divergence cone and, for a decision tensor, its explained root rows.
fn excluded_rows(name: &str, rows: usize, tokens: usize, n_layers: usize, analysis: &Analysis) -> Vec<bool> {
    if analysis.divergences.is_empty() || rows == 0 {
        return vec![false; rows];
    }
    if let Some(l) = snapshot_layer(name) {
        // A cache snapshot is compared whole: excluded when its layer's input is tainted.
        return vec![analysis.layer_input_tainted(l); rows];
    }
    let Some((layer, stage)) = tensor_position(name, n_layers) else { return vec![false; rows] };
    // Per-token tensors have one row per position; compressed entries one per `ratio` tokens.
    let tokens_per_row = if rows < tokens { tokens / rows } else { 1 };
    let mut out = analysis.tainted_rows(layer, stage, rows, tokens_per_row);
    let leaf = name.rsplit('.').next().unwrap_or(name);
    if let Some(kind) = DecisionKind::of_tensor(leaf) {
        for (o, e) in out.iter_mut().zip(analysis.explained_rows(layer, kind, rows)) {
            *o |= e;
        }
    }
    out
}

/// `"rows 45, 47..68"` for a sorted list of rows.
fn describe_rows(rows: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < rows.len() {
        let mut j = i;
        while j + 1 < rows.len() && rows[j + 1] == rows[j] + 1 {
            j += 1;
        }
        parts.push(if i == j { rows[i].to_string() } else { format!("{}..{}", rows[i], rows[j]) });
        i = j + 1;
    }
    format!("rows {}", parts.join(", "))
}
