//! Where an Engram table lives (spec §9.5; storage spec §2.4): resident on the model's device,
//! dequantized to bf16 at load, or in host memory — the checkpoint's memory map, from which each
//! call gathers its rows in their stored form ([`super::engram_host::HostRows`]).
//!
//! A released table (`engram_num_embeddings` ≈ 384M rows × `engram_head_dim` 256, FP8 with 1×32
//! e8m0 scales) is ~101 GB as stored and ~197 GB as bf16: it can only be read by rows. The small
//! models' tables (the embedded Shakespeare model: ~16K rows × 32) take a megabyte and stay
//! resident. [`EngramPlacement::Auto`] chooses by size ([`AUTO_DEVICE_MAX_BYTES`]).

use std::fmt;
use std::str::FromStr;

use candle_core::Result;

use crate::loader::ReleaseCheckpoint;

/// Largest Engram table, in bytes as bf16 (`rows · head_dim · 2`), that
/// [`EngramPlacement::Auto`] keeps resident on the model's device: 1 GiB. The small models'
/// tables are far below it (a few MB), the released ones far above (~197 GB).
pub const AUTO_DEVICE_MAX_BYTES: u64 = 1 << 30;

/// Where the Engram tables of a model are kept (the loading choice; [`EngramLocation`] is where
/// one table ended up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngramPlacement {
    /// Per table: [`EngramLocation::Device`] when it takes at most [`AUTO_DEVICE_MAX_BYTES`] as
    /// bf16 or when there is no checkpoint to read rows from ([`EngramOptions::checkpoint`]),
    /// else [`EngramLocation::Host`].
    #[default]
    Auto,
    /// Every table dequantized at load and held as bf16 on the model's device (the checkpoint's
    /// dense limit applies: a released table stops the load with `LoadError::TooLarge`).
    Device,
    /// Every table left in the memory-mapped checkpoint: each call gathers the rows it needs in
    /// their stored form into a host staging buffer, copies that to the device in one copy and
    /// decodes it there, bit for bit the resident table's rows. Needs the checkpoint.
    Host,
}

impl EngramPlacement {
    /// `"auto"`, `"device"` or `"host"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Device => "device",
            Self::Host => "host",
        }
    }

    /// Where a table of `rows × width` goes under this choice; `host_rows` says whether the rows
    /// can be read from a checkpoint. Errors for [`EngramPlacement::Host`] without one.
    pub fn resolve(self, rows: usize, width: usize, host_rows: bool) -> Result<EngramLocation> {
        match self {
            _ if host_rows => Ok(self.with_checkpoint(rows, width)),
            Self::Device | Self::Auto => Ok(EngramLocation::Device),
            Self::Host => candle_core::bail!(
                "Engram placement `host` reads the table rows from a release checkpoint, and none was given: \
                 build the model with Model::with_engram and EngramOptions::checkpoint (Pretrained does), or use `device`"
            ),
        }
    }

    /// Where a table of `rows × width` goes under this choice when its rows can be read from a
    /// checkpoint (every `Pretrained` load): [`EngramPlacement::Auto`] leaves it in host memory
    /// when it takes more than [`AUTO_DEVICE_MAX_BYTES`] as bf16. The rule
    /// [`crate::loader::LoadPlan`] plans with.
    pub fn with_checkpoint(self, rows: usize, width: usize) -> EngramLocation {
        match self {
            Self::Device => EngramLocation::Device,
            Self::Host => EngramLocation::Host,
            Self::Auto if resident_bytes(rows, width) > AUTO_DEVICE_MAX_BYTES => EngramLocation::Host,
            Self::Auto => EngramLocation::Device,
        }
    }
}

impl fmt::Display for EngramPlacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EngramPlacement {
    type Err = String;

    /// Parses `auto`, `device` or `host` (command lines).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        [Self::Auto, Self::Device, Self::Host]
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown Engram placement `{s}`: expected auto, device or host"))
    }
}

/// The bytes of a `rows × width` table as bf16 (saturating).
pub fn resident_bytes(rows: usize, width: usize) -> u64 {
    (rows as u64).saturating_mul(width as u64).saturating_mul(2)
}

/// Where one Engram table is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngramLocation {
    /// Dequantized, bf16, on the model's device.
    Device,
    /// In the memory-mapped checkpoint (host memory, paged in by the rows read).
    Host,
}

impl EngramLocation {
    /// `"device"` or `"host"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Device => "device",
            Self::Host => "host",
        }
    }
}

impl fmt::Display for EngramLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One Engram layer's table: its size and where it lives (`Model::engram_placements`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngramTableInfo {
    /// The backbone layer (`layers.N.engram`).
    pub layer: usize,
    /// Table rows.
    pub rows: usize,
    /// Row width (`engram_head_dim`).
    pub width: usize,
    /// Where the table is.
    pub location: EngramLocation,
    /// The table's bytes where it is: [`EngramLocation::Device`]: the bf16 table on the device
    /// (`rows · width · 2`); [`EngramLocation::Host`]: the stored table (codes and scales) in the
    /// memory-mapped checkpoint, of which only the pages of rows read become resident.
    pub bytes: u64,
    /// Device bytes besides a resident table: for a host table the 128 KiB decode table
    /// (bf16 `[65536]`); 0 for a resident one. The per-call
    /// staging buffer (`rows per call · (width + width / 32)` bytes) is not counted.
    pub device_extra_bytes: u64,
}

/// How `Model::with_engram` loads the Engram tables.
#[derive(Clone, Default)]
pub struct EngramOptions {
    /// Where the tables go.
    pub placement: EngramPlacement,
    /// The checkpoint the model's `VarBuilder` reads (`loader::var_builder`), from which host
    /// tables are read by rows (`ReleaseCheckpoint::row_table`). Without it every table is
    /// resident ([`EngramPlacement::Auto`]) or the load fails ([`EngramPlacement::Host`]).
    pub checkpoint: Option<ReleaseCheckpoint>,
}

impl EngramOptions {
    /// `placement`, with host rows read from `checkpoint`.
    pub fn new(placement: EngramPlacement, checkpoint: &ReleaseCheckpoint) -> Self {
        Self { placement, checkpoint: Some(checkpoint.clone()) }
    }
}

impl fmt::Debug for EngramOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let files = self.checkpoint.as_ref().map(|c| c.files());
        f.debug_struct("EngramOptions").field("placement", &self.placement).field("checkpoint", &files).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The released table goes to the host, the embedded model's stays resident, the limit is
    /// inclusive, and `host` needs a checkpoint.
    #[test]
    fn auto_by_size() {
        let auto = EngramPlacement::Auto;
        assert_eq!(auto.resolve(384_006_168, 256, true).unwrap(), EngramLocation::Host);
        assert_eq!(auto.resolve(384_006_168, 256, false).unwrap(), EngramLocation::Device);
        assert_eq!(auto.resolve(16_024, 32, true).unwrap(), EngramLocation::Device);
        assert_eq!(auto.resolve(1 << 21, 256, true).unwrap(), EngramLocation::Device);
        assert_eq!(auto.resolve((1 << 21) + 1, 256, true).unwrap(), EngramLocation::Host);
        assert_eq!(EngramPlacement::Device.resolve(384_006_168, 256, true).unwrap(), EngramLocation::Device);
        assert_eq!(EngramPlacement::Host.resolve(4, 32, true).unwrap(), EngramLocation::Host);
        for p in [EngramPlacement::Auto, EngramPlacement::Device, EngramPlacement::Host] {
            for (rows, width) in [(384_006_168, 256), (16_024, 32), (1 << 21, 256), ((1 << 21) + 1, 256)] {
                assert_eq!(p.resolve(rows, width, true).unwrap(), p.with_checkpoint(rows, width), "{p} {rows} x {width}");
            }
        }
        let e = EngramPlacement::Host.resolve(4, 32, false).unwrap_err().to_string();
        assert!(e.contains("host") && e.contains("checkpoint"), "{e}");
        for p in [EngramPlacement::Auto, EngramPlacement::Device, EngramPlacement::Host] {
            assert_eq!(p.name().parse::<EngramPlacement>().unwrap(), p);
        }
        assert!("gpu".parse::<EngramPlacement>().unwrap_err().contains("auto, device or host"));
    }
}
