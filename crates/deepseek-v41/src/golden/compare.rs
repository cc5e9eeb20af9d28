//! Comparisons of computed tensors with golden tensors, and the report lines they produce.
//!
//! Metrics, all over the compared elements: `max_abs = max|a − g|`, `max_rel = max_abs / max|g|`
//! (normalised by the tensor's largest golden magnitude, so zeros in `g` do not blow it up) and
//! `rel_fro = ‖a − g‖ / ‖g‖`. Non-finite golden values must be matched exactly (same infinity,
//! NaN where NaN).

use std::fmt;

use candle_core::{DType, Result, Tensor};

/// How a tensor must match.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tolerance {
    /// Bit for bit.
    Exact,
    /// Every element within `ulps` units in the last place of the golden value in a format with
    /// `mantissa_bits` explicit mantissa bits (23 for f32, 7 for bf16).
    Ulps {
        /// Allowed ulps.
        ulps: f32,
        /// Explicit mantissa bits of the format.
        mantissa_bits: i32,
    },
    /// Absolute error bound.
    Abs(f32),
    /// Relative Frobenius error bound, and optionally a max_abs bound.
    RelFro {
        /// Bound on ‖a − g‖ / ‖g‖.
        rel_fro: f32,
        /// Optional bound on every |a − g|.
        max_abs: Option<f32>,
    },
    /// Per row (first dim), the sets of non-negative ids agree (order and −1 padding ignored).
    IdSets,
}

/// One comparison.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Label of the compared tensor.
    pub name: String,
    /// max |a − g|.
    pub max_abs: f32,
    /// max |a − g| / max |g|.
    pub max_rel: f32,
    /// ‖a − g‖ / ‖g‖.
    pub rel_fro: f32,
    /// Elements (or rows, for [`Tolerance::IdSets`]) that disagree.
    pub mismatches: usize,
    /// Whether the tolerance holds.
    pub pass: bool,
    /// Extra detail (shape mismatch, first differing row).
    pub note: String,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} max_abs={:.3e} max_rel={:.3e} rel_fro={:.3e} mismatches={}{}",
            if self.pass { "PASS" } else { "FAIL" },
            self.name,
            self.max_abs,
            self.max_rel,
            self.rel_fro,
            self.mismatches,
            if self.note.is_empty() { String::new() } else { format!(" ({})", self.note) }
        )
    }
}

fn ulp(g: f32, mantissa_bits: i32) -> f32 {
    let e = if g == 0.0 { -126 } else { ((g.abs().to_bits() >> 23) as i32 - 127).max(-126) };
    2f32.powi(e - mantissa_bits)
}

/// Compares `actual` with `golden` (same element count; shapes are reported if they differ).
/// Both are read on the host (tensors on a device are copied there first).
pub fn compare(name: &str, actual: &Tensor, golden: &Tensor, tol: Tolerance) -> Result<Outcome> {
    let (actual, golden) = (&on_host(actual)?, &on_host(golden)?);
    if actual.elem_count() != golden.elem_count() {
        return Ok(Outcome {
            name: name.to_string(),
            max_abs: f32::INFINITY,
            max_rel: f32::INFINITY,
            rel_fro: f32::INFINITY,
            mismatches: golden.elem_count().max(1),
            pass: false,
            note: format!("shape {:?} vs golden {:?}", actual.dims(), golden.dims()),
        });
    }
    if tol == Tolerance::IdSets {
        return compare_id_sets(name, actual, golden);
    }
    let a = actual.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let g = golden.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let (mut max_abs, mut gmax, mut num, mut den, mut mism) = (0f32, 0f32, 0f64, 0f64, 0usize);
    for (&x, &y) in a.iter().zip(&g) {
        let ok_nonfinite = if !y.is_finite() || !x.is_finite() {
            Some((x.is_nan() && y.is_nan()) || x == y)
        } else {
            None
        };
        let diff = if ok_nonfinite.is_some() { 0.0 } else { (x - y).abs() };
        max_abs = max_abs.max(if ok_nonfinite == Some(false) { f32::INFINITY } else { diff });
        if y.is_finite() {
            gmax = gmax.max(y.abs());
            den += (y as f64).powi(2);
        }
        num += (diff as f64).powi(2);
        let bad = match (ok_nonfinite, tol) {
            (Some(ok), _) => !ok,
            (None, Tolerance::Exact) => x.to_bits() != y.to_bits() && !(x == 0.0 && y == 0.0 && x.is_sign_negative() == y.is_sign_negative()),
            (None, Tolerance::Ulps { ulps, mantissa_bits }) => diff > ulps * ulp(y, mantissa_bits),
            (None, Tolerance::Abs(t)) => diff > t,
            (None, Tolerance::RelFro { max_abs: Some(t), .. }) => diff > t,
            (None, _) => false,
        };
        mism += bad as usize;
    }
    let rel_fro = if den > 0.0 { (num / den).sqrt() as f32 } else if num > 0.0 { f32::INFINITY } else { 0.0 };
    let max_rel = if gmax > 0.0 { max_abs / gmax } else if max_abs > 0.0 { f32::INFINITY } else { 0.0 };
    let pass = match tol {
        Tolerance::RelFro { rel_fro: t, .. } => rel_fro <= t && mism == 0,
        _ => mism == 0,
    };
    Ok(Outcome { name: name.to_string(), max_abs, max_rel, rel_fro, mismatches: mism, pass, note: String::new() })
}

/// `t` on the host (empty tensors are rebuilt there rather than copied).
fn on_host(t: &Tensor) -> Result<Tensor> {
    let cpu = candle_core::Device::Cpu;
    if t.device().is_cpu() {
        Ok(t.clone())
    } else if t.elem_count() == 0 {
        Tensor::zeros(t.shape(), t.dtype(), &cpu)
    } else {
        t.to_device(&cpu)
    }
}

/// Per row (first dim, `rows` rows), the non-negative ids of `t` sorted ascending: the id sets
/// that [`Tolerance::IdSets`] compares.
pub(crate) fn id_set_rows(t: &Tensor, rows: usize) -> Result<Vec<Vec<i64>>> {
    let v = on_host(t)?.to_dtype(DType::I64)?.reshape((rows, ()))?.to_vec2::<i64>()?;
    Ok(v.into_iter()
        .map(|mut r| {
            r.retain(|&x| x >= 0);
            r.sort_unstable();
            r
        })
        .collect())
}

fn compare_id_sets(name: &str, actual: &Tensor, golden: &Tensor) -> Result<Outcome> {
    let rows = golden.dim(0)?;
    let (a, g) = (id_set_rows(actual, rows)?, id_set_rows(golden, rows)?);
    let bad: Vec<usize> = (0..rows).filter(|&r| a[r] != g[r]).collect();
    let note = bad.first().map(|&r| format!("first differing row {r}: {:?} vs golden {:?}", a[r], g[r])).unwrap_or_default();
    let m = if bad.is_empty() { 0.0 } else { f32::INFINITY };
    Ok(Outcome { name: name.to_string(), max_abs: m, max_rel: m, rel_fro: m, mismatches: bad.len(), pass: bad.is_empty(), note })
}

/// A run's report: outcomes and skips, printed one line each.
#[derive(Debug, Default)]
pub struct Report {
    /// Every comparison made.
    pub outcomes: Vec<Outcome>,
    /// `(name, reason)` of tensors not compared.
    pub skipped: Vec<(String, String)>,
    /// Rows in the causal cone of a differing end-to-end decision, compared apart from the
    /// tolerance checks (`decisions.rs`): neither passed nor failed.
    pub downstream: Vec<Outcome>,
    /// Differing end-to-end decisions explained by their margin or their teacher-forced decision.
    pub explained: usize,
    /// Differing end-to-end decisions downstream of another.
    pub downstream_decisions: usize,
}

impl Report {
    /// Records and prints an outcome.
    pub fn add(&mut self, o: Outcome) {
        println!("{o}");
        self.outcomes.push(o);
    }

    /// Compares and records.
    pub fn check(&mut self, name: &str, actual: &Tensor, golden: &Tensor, tol: Tolerance) -> Result<()> {
        let o = compare(name, actual, golden, tol)?;
        self.add(o);
        Ok(())
    }

    /// Records and prints the comparison of rows in a divergence cone (`rows` describes them).
    pub fn add_downstream(&mut self, mut o: Outcome, rows: &str) {
        o.note = if o.note.is_empty() { rows.to_string() } else { format!("{rows}; {}", o.note) };
        println!(
            "DOWNSTREAM {} max_abs={:.3e} max_rel={:.3e} rel_fro={:.3e} differing={} ({})",
            o.name, o.max_abs, o.max_rel, o.rel_fro, o.mismatches, o.note
        );
        self.downstream.push(o);
    }

    /// Records and prints a skipped tensor.
    pub fn skip(&mut self, name: &str, reason: &str) {
        println!("SKIP {name}: {reason}");
        self.skipped.push((name.to_string(), reason.to_string()));
    }

    /// Number of passing comparisons.
    pub fn passed(&self) -> usize {
        self.outcomes.iter().filter(|o| o.pass).count()
    }

    /// Number of failing comparisons.
    pub fn failed(&self) -> usize {
        self.outcomes.len() - self.passed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn tolerances_can_fail() -> Result<()> {
        let d = Device::Cpu;
        let g = Tensor::new(&[1.0f32, 2.0, -4.0], &d)?;
        let a = Tensor::new(&[1.0f32, 2.0 + 2f32.powi(-22), -4.0], &d)?;
        assert!(!compare("x", &a, &g, Tolerance::Exact)?.pass);
        assert!(compare("x", &a, &g, Tolerance::Ulps { ulps: 1.0, mantissa_bits: 23 })?.pass);
        assert!(!compare("x", &(&a * 1.01)?, &g, Tolerance::RelFro { rel_fro: 1e-3, max_abs: None })?.pass);
        let ids = Tensor::new(&[[3i64, 1, -1], [0, 2, 4]], &d)?;
        let gi = Tensor::new(&[[1i64, 3, -1], [0, 2, 5]], &d)?;
        let o = compare("ids", &ids, &gi, Tolerance::IdSets)?;
        assert_eq!((o.pass, o.mismatches), (false, 1));
        let inf = Tensor::new(&[f32::NEG_INFINITY, 1.0], &d)?;
        assert!(compare("inf", &inf, &inf, Tolerance::Exact)?.pass);
        assert!(!compare("shape", &g, &inf, Tolerance::Exact)?.pass);
        Ok(())
    }
}
