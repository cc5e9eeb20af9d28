//! The golden checker on the vendored public set: every tensor of every case is compared and
//! passes; nothing is skipped.

use std::path::PathBuf;

use candle_core::Device;
use deepseek_v41::golden::check_set;

#[test]
fn vendored_golden_set_passes_without_skips() -> anyhow::Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/v41-tiny");
    let report = check_set(&root, &Device::Cpu)?;
    let failed: Vec<String> = report.outcomes.iter().filter(|o| !o.pass).map(|o| o.to_string()).collect();
    assert!(failed.is_empty(), "failures:\n{}", failed.join("\n"));
    assert!(report.skipped.is_empty(), "skipped: {:?}", report.skipped);
    // 6 cases x ~70 tensors + module goldens: a count far below means tensors went unchecked.
    assert!(report.passed() >= 400, "only {} comparisons", report.passed());
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
