//! How a [`super::SequenceCache`] stores its rows (spec §7.1 / §7.2): plain rows in the
//! activation dtype, or the packed V4.1 formats in pages.
//!
//! | cache kind | bf16 rows | packed | format |
//! |---|---|---|---|
//! | window ring ([`CacheKind::Window`]) | 2·D B | D + D/32 B (528 B for D = 512) | A: e4m3 + UE8M0 per 32 (Q1) |
//! | compressed entries ([`CacheKind::Compressed`]) | 2·D B | D/2 + D/16 B (288 B for D = 512) | B: e2m1 + e4m3 per 16 (Q2) |
//! | index keys ([`CacheKind::IndexKeys`]) | 2·D B | D/2 + D/32 B (68 B for D = 128) | E: MXFP4, e2m1 + UE8M0 per 32 (Q3) |
//!
//! The packed rows hold exactly the values the bf16 caches hold under
//! `Numerics::cache_fake_quant` (the formats ARE the Q1/Q2/Q3 quantization), so a layer gives
//! bit for bit the same results with either storage; packed storage with the fake quant off is
//! an error. Packed caches are pages of [`PACKED_PAGE_TOKENS`] slots (`[pages, page_bytes]` u8,
//! data and scale regions segregated per page, `cuda::PackedLayout`); the compressed
//! entries and index keys grow by whole pages (doubling), the window ring takes
//! `ceil(W / PACKED_PAGE_TOKENS)` pages.
//!
//! Packed storage needs the crate's `cuda` feature: its inserts and its attention and indexer
//! sources are the ops of the `cuda` module (which also run on the CPU, through their references).
//! Layers on a packed cache always run `Attention::forward_fused`.

use candle_core::Result;

use crate::quant::fake_quant::QatFormat;

/// Tokens (slots) per page of every packed cache (a multiple of 4, so pages of all three formats
/// are whole multiples of 16 bytes for any row width the formats take).
pub const PACKED_PAGE_TOKENS: usize = 64;

/// The storage of a sequence's caches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum CacheStorage {
    /// Rows in the activation dtype (bf16): `[W, D]` ring, `[N, D]` entries, `[N, d_I]` keys.
    #[default]
    Bf16,
    /// The packed V4.1 formats A (window ring), B (compressed entries) and E (index keys) in
    /// pages of [`PACKED_PAGE_TOKENS`]; needs the `cuda` feature and
    /// `Numerics::cache_fake_quant`.
    Packed,
}

/// The three row caches of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheKind {
    /// The sliding-window ring (every layer).
    Window,
    /// The compressed entries of a kv source.
    Compressed,
    /// The index keys of a kv source.
    IndexKeys,
}

impl CacheKind {
    /// The packed format of this cache: A = [`QatFormat::Fp8Ue8m0B32`], B =
    /// [`QatFormat::Fp4E4m3B16`], E = [`QatFormat::Fp4Ue8m0B32`] (the cache's QAT format).
    pub fn packed_format(self) -> QatFormat {
        match self {
            Self::Window => QatFormat::Fp8Ue8m0B32,
            Self::Compressed => QatFormat::Fp4E4m3B16,
            Self::IndexKeys => QatFormat::Fp4Ue8m0B32,
        }
    }
}

impl CacheStorage {
    /// Whether this is [`CacheStorage::Packed`].
    pub fn is_packed(self) -> bool {
        self == Self::Packed
    }

    /// Bytes one row of `width` values of `kind` takes (bf16: 2 per value; packed: the format's
    /// codes plus one scale byte per block, e.g. 528 / 288 / 68 B for the V4.1 widths).
    pub fn row_bytes(self, kind: CacheKind, width: usize) -> usize {
        match self {
            Self::Bf16 => 2 * width,
            Self::Packed => {
                let fmt = kind.packed_format();
                let data = if fmt.is_fp4() { width / 2 } else { width };
                data + width / fmt.block()
            }
        }
    }

    /// The storage a cache with this packing has (`None`: bf16 rows).
    pub(crate) fn of(packing: Option<&Packing>) -> Self {
        if packing.is_some() {
            Self::Packed
        } else {
            Self::Bf16
        }
    }

    /// The packing of a cache of `kind` with rows of `width` values: `None` for bf16 rows.
    /// Errors for packed storage without the `cuda` feature, or when `width` does not fit the
    /// format's block.
    pub(crate) fn packing(self, kind: CacheKind, width: usize) -> Result<Option<Packing>> {
        match self {
            Self::Bf16 => Ok(None),
            Self::Packed => new_packing(kind.packed_format(), width).map(Some),
        }
    }
}

/// The geometry of a packed cache: [`crate::cuda::PackedLayout`].
#[cfg(feature = "cuda")]
pub(crate) type Packing = crate::cuda::PackedLayout;

#[cfg(feature = "cuda")]
fn new_packing(format: QatFormat, width: usize) -> Result<Packing> {
    crate::cuda::PackedLayout::new(format, width, PACKED_PAGE_TOKENS)
}

/// Without the `cuda` feature no packed cache exists (this type has no value).
#[cfg(not(feature = "cuda"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Packing {}

#[cfg(not(feature = "cuda"))]
fn new_packing(format: QatFormat, width: usize) -> Result<Packing> {
    candle_core::bail!(
        "packed cache storage ({format} rows of {width}) needs the crate's `cuda` feature (the packed inserts, attention and indexer sources are its ops)"
    )
}

#[cfg(not(feature = "cuda"))]
impl Packing {
    pub(crate) fn page_size(&self) -> usize {
        match *self {}
    }

    pub(crate) fn zeros(&self, _pages: usize, _device: &candle_core::Device) -> Result<candle_core::Tensor> {
        match *self {}
    }

    pub(crate) fn unpack_rows(
        &self,
        _cache: &candle_core::Tensor,
        _slots: std::ops::Range<usize>,
        _dtype: candle_core::DType,
    ) -> Result<candle_core::Tensor> {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_are_the_spec_budget() {
        let p = CacheStorage::Packed;
        assert_eq!(p.row_bytes(CacheKind::Window, 512), 528);
        assert_eq!(p.row_bytes(CacheKind::Compressed, 512), 288);
        assert_eq!(p.row_bytes(CacheKind::IndexKeys, 128), 68);
        assert_eq!(CacheStorage::Bf16.row_bytes(CacheKind::Compressed, 512), 1024);
        // Spec §7.4: 3 ratio-2 sources × (288 + 68) / 2 + 1 ratio-1 source × (288 + 68) = 890 B.
        let per = p.row_bytes(CacheKind::Compressed, 512) + p.row_bytes(CacheKind::IndexKeys, 128);
        assert_eq!(3 * per / 2 + per, 890);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn packed_storage_needs_the_cuda_feature() {
        let err = CacheStorage::Packed.packing(CacheKind::Window, 512).unwrap_err().to_string();
        assert!(err.contains("`cuda` feature"), "{err}");
    }
}
