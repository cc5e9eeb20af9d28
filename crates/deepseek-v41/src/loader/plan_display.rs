//! [`LoadPlan`]'s `Display`: one aligned row per component, the totals, the caches.

use std::fmt;

use super::{Held, LoadPlan, Place, PlanDevice};
use crate::model::{EngramPlacement, AUTO_DEVICE_MAX_BYTES};

/// `bytes` in GB (10^9 bytes), three decimals.
fn gb(bytes: u64) -> String {
    format!("{:.3}", bytes as f64 / 1e9)
}

/// The forms of a component, joined: `FP8 + bf16 + f32`.
fn forms(held: &[Held]) -> String {
    held.iter().map(Held::to_string).collect::<Vec<_>>().join(" + ")
}

impl fmt::Display for LoadPlan {
    /// ```text
    /// load plan: 4 layers, 384 routed experts; bf16 activations on cuda, quantized weights native, Engram placement auto
    /// component               tensors  stored GB  device GB  host GB      device bytes  held as
    /// routed experts             4608     28.877     28.877    0.000    28 876 652 544  MXFP4
    /// ...
    /// total                      4837     32.660     34.430    0.000    34 430 ...
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        let dev = o.device.name();
        writeln!(
            f,
            "load plan: {} layers, {} routed experts; {} activations on {dev}, quantized weights {}{}, Engram placement {}",
            self.layers,
            self.experts,
            Held::Dense(o.dtype),
            o.quantized,
            if o.device == PlanDevice::Cuda && !o.native() { " (held dense: native needs bf16 on CUDA)" } else { "" },
            o.engram
        )?;
        let head = format!("{:<24} {:>8} {:>11} {:>11} {:>9} {:>18}  held as", "component", "tensors", "stored GB", format!("{dev} GB"), "host GB", format!("{dev} bytes"));
        writeln!(f, "{head}")?;
        let row = |f: &mut fmt::Formatter<'_>, name: &str, n: usize, stored: u64, device: u64, host: u64, held: &str| {
            writeln!(f, "{name:<24} {n:>8} {:>11} {:>11} {:>9} {:>18}  {held}", gb(stored), gb(device), gb(host), grouped(device))
        };
        for c in self.components() {
            row(f, &c.component.to_string(), c.tensors, c.stored_bytes, c.device_bytes, c.host_bytes, &forms(&c.held))?;
        }
        let host_note = if self.host_bytes() > 0 { "host: mapped checkpoint pages (page cache), read by rows" } else { "" };
        row(f, "total", self.tensors.len(), self.stored_bytes(), self.device_bytes(), self.host_bytes(), host_note)?;
        if o.device == PlanDevice::Cuda {
            writeln!(
                f,
                "host while loading: the mapped pages of the tensor being copied and at most one {} MiB staging chunk (loader::staging)",
                super::super::staging::STAGING_CHUNK_BYTES >> 20
            )?;
        }
        let c = &self.cache;
        let per_m = |per_token: f64| per_token * 1e6 / 1e9;
        writeln!(
            f,
            "cache per sequence on {dev}: window rings {} layers x {} rows = {} GB rows / {} GB packed; compressed entries + index keys \
             {:.1} B/token rows / {:.1} B/token packed ({:.3} / {:.3} GB per 1M tokens)",
            c.layers,
            c.window,
            gb(c.window_bytes_rows),
            gb(c.window_bytes_packed),
            c.per_token_rows,
            c.per_token_packed,
            per_m(c.per_token_rows),
            per_m(c.per_token_packed)
        )?;
        if self.tensors.iter().any(|t| t.place == Place::HostMapped) {
            let why = match o.engram {
                EngramPlacement::Auto => format!("auto: those above {} GiB as bf16", AUTO_DEVICE_MAX_BYTES >> 30),
                p => p.to_string(),
            };
            writeln!(f, "Engram tables in host memory, read by rows per call (Engram placement {why}; loader::plan::engram_table_place)")?;
        }
        Ok(())
    }
}

/// `n` with a space every three digits (`34 430 000 000`).
fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(ch);
    }
    out
}
