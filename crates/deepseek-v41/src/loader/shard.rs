//! One memory-mapped safetensors file: header parsing and validation, raw byte access.
//!
//! The header is parsed by hand (8-byte little-endian length, JSON object) so that every
//! inconsistency is reported with the file, the tensor and the numbers involved.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::Deserialize;

use super::error::LoadError;

/// Largest header accepted (the safetensors format's own limit is 100 MB).
const MAX_HEADER: u64 = 100_000_000;

/// Element types a release shard may store (safetensors spelling in [`StoredDtype::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDtype {
    /// `BOOL`
    Bool,
    /// `U8`
    U8,
    /// `I8` (MXFP4 packed experts in the release)
    I8,
    /// `U16`
    U16,
    /// `I16`
    I16,
    /// `F16`
    F16,
    /// `BF16`
    BF16,
    /// `U32`
    U32,
    /// `I32`
    I32,
    /// `F32`
    F32,
    /// `U64`
    U64,
    /// `I64`
    I64,
    /// `F64`
    F64,
    /// `F8_E4M3` (e4m3fn)
    F8E4M3,
    /// `F8_E5M2`
    F8E5M2,
    /// `F8_E8M0` (power-of-two scales)
    F8E8M0,
}

impl StoredDtype {
    /// Parses the safetensors dtype string.
    pub fn parse(s: &str) -> Option<Self> {
        use StoredDtype::*;
        Some(match s {
            "BOOL" => Bool,
            "U8" => U8,
            "I8" => I8,
            "U16" => U16,
            "I16" => I16,
            "F16" => F16,
            "BF16" => BF16,
            "U32" => U32,
            "I32" => I32,
            "F32" => F32,
            "U64" => U64,
            "I64" => I64,
            "F64" => F64,
            "F8_E4M3" => F8E4M3,
            "F8_E5M2" => F8E5M2,
            "F8_E8M0" => F8E8M0,
            _ => return None,
        })
    }

    /// The safetensors spelling.
    pub fn name(self) -> &'static str {
        use StoredDtype::*;
        match self {
            Bool => "BOOL",
            U8 => "U8",
            I8 => "I8",
            U16 => "U16",
            I16 => "I16",
            F16 => "F16",
            BF16 => "BF16",
            U32 => "U32",
            I32 => "I32",
            F32 => "F32",
            U64 => "U64",
            I64 => "I64",
            F64 => "F64",
            F8E4M3 => "F8_E4M3",
            F8E5M2 => "F8_E5M2",
            F8E8M0 => "F8_E8M0",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        use StoredDtype::*;
        match self {
            Bool | U8 | I8 | F8E4M3 | F8E5M2 | F8E8M0 => 1,
            U16 | I16 | F16 | BF16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
        }
    }

    /// The candle dtype holding these values unchanged, for the unquantized dtypes candle has.
    pub fn candle(self) -> Option<candle_core::DType> {
        use candle_core::DType;
        Some(match self {
            StoredDtype::U8 => DType::U8,
            StoredDtype::I16 => DType::I16,
            StoredDtype::F16 => DType::F16,
            StoredDtype::BF16 => DType::BF16,
            StoredDtype::U32 => DType::U32,
            StoredDtype::I32 => DType::I32,
            StoredDtype::F32 => DType::F32,
            StoredDtype::I64 => DType::I64,
            StoredDtype::F64 => DType::F64,
            _ => return None,
        })
    }
}

impl std::fmt::Display for StoredDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor of a shard, as its header describes it (offsets absolute in the file).
#[derive(Debug, Clone)]
pub struct RawEntry {
    /// Tensor name.
    pub name: String,
    /// Stored element type.
    pub dtype: StoredDtype,
    /// Stored shape.
    pub shape: Vec<usize>,
    /// Byte range in the file (header included in the offset).
    pub range: std::ops::Range<usize>,
}

/// A memory-mapped safetensors file.
pub struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

#[derive(Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

impl Shard {
    /// Maps `path` and validates its header: every tensor's byte range must lie inside the file
    /// and match its shape × dtype size. Returns the shard and its entries (sorted by name).
    pub fn open(path: &Path) -> Result<(Self, Vec<RawEntry>), LoadError> {
        let io = |source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let truncated = |detail: String| LoadError::Truncated {
            path: path.to_path_buf(),
            detail,
        };
        let corrupt = |detail: String| LoadError::CorruptHeader {
            path: path.to_path_buf(),
            detail,
        };
        if file_len < 8 {
            return Err(truncated(format!(
                "{file_len} bytes, shorter than the 8-byte header length"
            )));
        }
        // SAFETY: the map is read-only; like every mmap-based loader we assume the file is not
        // modified while the checkpoint is open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header_len = u64::from_le_bytes(mmap[..8].try_into().expect("8 bytes checked above"));
        if header_len > MAX_HEADER {
            return Err(corrupt(format!(
                "header length {header_len} exceeds the {MAX_HEADER}-byte limit"
            )));
        }
        if 8 + header_len > file_len {
            return Err(truncated(format!(
                "header declares {header_len} bytes but only {} bytes follow the length prefix",
                file_len - 8
            )));
        }
        let data_start = 8 + header_len as usize;
        let data_len = mmap.len() - data_start;
        let text =
            std::str::from_utf8(&mmap[8..data_start]).map_err(|e| corrupt(format!("header is not UTF-8: {e}")))?;
        let json: BTreeMap<String, serde_json::Value> =
            serde_json::from_str(text).map_err(|e| corrupt(format!("header is not a JSON object: {e}")))?;
        let mut entries = Vec::with_capacity(json.len());
        for (name, value) in json {
            if name == "__metadata__" {
                continue;
            }
            let h: HeaderEntry = serde_json::from_value(value)
                .map_err(|e| corrupt(format!("entry for tensor `{name}` is malformed: {e}")))?;
            let dtype = StoredDtype::parse(&h.dtype)
                .ok_or_else(|| corrupt(format!("tensor `{name}` has unsupported dtype `{}`", h.dtype)))?;
            let (s, e) = h.data_offsets;
            let numel = h.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let expected = numel.and_then(|n| n.checked_mul(dtype.size()));
            let Some(expected) = expected else {
                return Err(corrupt(format!("tensor `{name}` shape {:?} overflows", h.shape)));
            };
            if e < s {
                return Err(corrupt(format!(
                    "tensor `{name}` has data_offsets [{s}, {e}) with end before start"
                )));
            }
            if e - s != expected {
                return Err(LoadError::LengthMismatch {
                    path: path.to_path_buf(),
                    name,
                    dtype: dtype.name().to_string(),
                    shape: h.shape,
                    expected,
                    found: e - s,
                });
            }
            if e > data_len {
                return Err(truncated(format!(
                    "tensor `{name}` data ends at byte {e} of the data section, which has only {data_len} bytes"
                )));
            }
            entries.push(RawEntry {
                name,
                dtype,
                shape: h.shape,
                range: data_start + s..data_start + e,
            });
        }
        Ok((
            Self {
                path: path.to_path_buf(),
                mmap,
            },
            entries,
        ))
    }

    /// The file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The bytes of `range` (validated at open time).
    pub fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.mmap[range]
    }

    /// Drops this process's mapped pages of `range` (best effort, Unix only): the resident set
    /// no longer counts them, the data stays in the OS page cache, and the next access reads the
    /// same bytes back. Called once a tensor has been copied out, so that loading does not leave
    /// the whole checkpoint resident (`RssFile`) next to the dequantized weights.
    pub fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        {
            // SAFETY: the map is a read-only shared mapping of a file assumed unmodified (see
            // `open`): after MADV_DONTNEED a later access faults in the same file contents, so
            // any slice still borrowed from the map keeps reading the same bytes.
            let advice = memmap2::UncheckedAdvice::DontNeed;
            let _ = unsafe { self.mmap.unchecked_advise_range(advice, range.start, range.len()) };
        }
        #[cfg(not(unix))]
        let _ = range;
    }

    /// Tells the OS that `range` is read at random (best effort, Unix only): a page fault there
    /// reads that page, not the read-ahead window around it. For tables read a few rows at a time
    /// (the Engram tables, [`super::RowTable::advise_random`]), where read-ahead would read
    /// ~32 pages of unrelated rows per row looked up.
    pub fn advise_random(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        {
            // The range lies in the map (validated at open time); a refusal only costs read-ahead.
            let _ = self.mmap.advise_range(memmap2::Advice::Random, range.start, range.len());
        }
        #[cfg(not(unix))]
        let _ = range;
    }
}
