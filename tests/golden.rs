//! The golden checker on the vendored sets: every tensor of every case is compared and passes;
//! nothing is skipped; end-to-end decision differences are explained, and a real error beside
//! explained ones still fails.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use deepseek_v41::golden::{check_set, runner, GoldenSet, Report};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
}

fn assert_clean(report: &Report, min_passed: usize) {
    let failed: Vec<String> = report.outcomes.iter().filter(|o| !o.pass).map(|o| o.to_string()).collect();
    assert!(failed.is_empty(), "failures:\n{}", failed.join("\n"));
    assert!(report.skipped.is_empty(), "skipped: {:?}", report.skipped);
    // A count far below means tensors went unchecked.
    assert!(report.passed() >= min_passed, "only {} comparisons", report.passed());
}

#[test]
fn vendored_golden_set_passes_without_skips() -> anyhow::Result<()> {
    let report = check_set(fixture("v41-tiny"), &Device::Cpu)?;
    // 6 cases x ~70 tensors + module goldens + the teacher-forced MoE of prefill_full.
    assert_clean(&report, 480);
    // The tie-free set: every end-to-end decision equals the reference's.
    assert_eq!((report.explained, report.downstream_decisions, report.downstream.len()), (0, 0, 0));
    Ok(())
}

#[test]
fn embedded_model_set_passes_with_every_divergence_explained() -> anyhow::Result<()> {
    let report = check_set(fixture("v41-shakespeare"), &Device::Cpu)?;
    assert_clean(&report, 440);
    // The untrained indexer's small scores flip end to end (explained by the teacher-forced
    // decisions); what lies downstream is reported apart, never passed silently.
    assert!(report.explained > 0 && !report.downstream.is_empty());
    Ok(())
}

/// Case `case` of the embedded model's set checked as it is (`wrong = None`) or with its golden
/// `L{layer}.moe_ids` changed at `row` (`wrong = Some((layer, row))`, the row clamped to the
/// case's last) to another expert pair: a routing error the teacher-forced run does not share.
fn check_with_wrong_routing(case: usize, wrong: Option<(usize, usize)>) -> anyhow::Result<Report> {
    let set = GoldenSet::open(fixture("v41-shakespeare"))?;
    let mut case = set.load_case(&set.cases[case], &Device::Cpu)?;
    let Some((layer, row)) = wrong else {
        let token_map = set.token_map(&case)?;
        let mut report = Report::default();
        runner::check_case(&case, token_map.as_ref(), &Device::Cpu, runner::RunOptions::default(), &mut report)?;
        return Ok(report);
    };
    let name = format!("L{layer}.moe_ids");
    let ids = case.golden[&name].to_dtype(DType::I64)?.to_vec2::<i64>()?;
    let row = row.min(ids.len() - 1);
    let n_experts = case.config.n_routed_experts as i64;
    let mut changed = ids.clone();
    changed[row] = changed[row].iter().map(|&e| (e + 1) % n_experts).collect();
    if changed[row].iter().collect::<std::collections::HashSet<_>>() == ids[row].iter().collect() {
        changed[row] = changed[row].iter().map(|&e| (e + 2) % n_experts).collect();
    }
    case.golden.insert(name, Tensor::new(changed, &Device::Cpu)?.to_dtype(DType::I32)?);
    let token_map = set.token_map(&case)?;
    let mut report = Report::default();
    runner::check_case(&case, token_map.as_ref(), &Device::Cpu, runner::RunOptions::default(), &mut report)?;
    Ok(report)
}

#[test]
fn a_real_error_beside_explained_divergences_still_fails() -> anyhow::Result<()> {
    // A wrong routing at layer 0, row 5 of prompt0 (before any divergence) fails end to end as an
    // unexplained divergence, and in the teacher-forced check.
    let report = check_with_wrong_routing(0, Some((0, 5)))?;
    let failed: Vec<&str> = report.outcomes.iter().filter(|o| !o.pass).map(|o| o.name.as_str()).collect();
    assert!(failed.contains(&"prompt0/L0.moe_ids"), "end-to-end L0.moe_ids must fail, failed: {failed:?}");
    assert!(failed.contains(&"prompt0/teacher_forced/L0.moe_ids"), "teacher-forced L0.moe_ids must fail, failed: {failed:?}");
    // Which prompts flip end to end depends on the CPU's f32 summation kernels (the gemm crate
    // picks AVX-512 or AVX2 paths): take the first case that has explained divergences here. A
    // wrong routing at its last layer, row 60 (inside or beside their cone): the teacher-forced
    // check still fails, and the other divergences stay explained.
    let mut flipped = None;
    for case in 0..3 {
        if check_with_wrong_routing(case, None)?.explained > 0 {
            flipped = Some(case);
            break;
        }
    }
    let case = flipped.expect("some prompt of the embedded set has explained divergences");
    let report = check_with_wrong_routing(case, Some((5, 60)))?;
    let failed: Vec<&str> = report.outcomes.iter().filter(|o| !o.pass).map(|o| o.name.as_str()).collect();
    let want = format!("prompt{case}/teacher_forced/L5.moe_ids");
    assert!(failed.contains(&want.as_str()), "{want} must fail, failed: {failed:?}");
    assert!(report.explained > 0, "the other divergences of prompt{case} stay explained");
    Ok(())
}

#[test]
fn a_set_without_cases_is_an_error() {
    let dir = std::env::temp_dir().join(format!("dsv41-empty-set-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = check_set(&dir, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("holds no golden case"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
