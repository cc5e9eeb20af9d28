//! Inserts into the PACKED cache formats of spec §7.2, the second storage choice next to bf16
//! rows: format A (window KV, Q1, 528 B per 512-wide row), B (compressed KV, Q2, 288 B) and E
//! (MXFP4 index keys, Q3, 68 B per 128-wide row), in pages of `page_size` tokens whose data and
//! scale regions are segregated (`[page_size × data][page_size × scales]`).
//!
//! The packed codes dequantize to exactly the values the bf16 inserts store, so a packed cache
//! holds the same numbers in about a quarter of the bytes. The CPU path (the reference) packs
//! the reference rows with [`crate::quant::packed::pack_row`]; the CUDA kernel
//! (`kernels/packed_insert.cu`) writes the same bytes. In-place safety as in
//! [`super::insert_op`]: the u8 cache is written through candle's `inplace_op2`, and the kernel
//! writes only the data and scale bytes of slots `[0, pages · page_size)`.

use candle_core::{CpuStorage, CudaStorage, DType, Device, InplaceOp2, Layout, Result, Tensor};
use half::bf16;

use super::device::{raw_stream, read_ptr, stream_for, write_ptr};
use super::ffi;
use super::insert_op::quant_code;
use super::row_inputs::{cpu_rows, row_stride, RowInputs};
use crate::quant::fake_quant::QatFormat;
use crate::quant::packed::{pack_row, unpack_row};

/// Geometry of a packed, paged cache: which format, row width and tokens per page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedLayout {
    format: QatFormat,
    head_dim: usize,
    page_size: usize,
}

impl PackedLayout {
    /// A layout for rows of `head_dim` values in `format` (A: `Fp8Ue8m0B32`, B: `Fp4E4m3B16`,
    /// E: `Fp4Ue8m0B32`), `page_size` tokens per page. `head_dim` must be a multiple of the
    /// format's block, and pages a multiple of 16 bytes (e.g. any page size for 528 B / 288 B
    /// rows, a multiple of 4 tokens for 68 B rows).
    pub fn new(format: QatFormat, head_dim: usize, page_size: usize) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(format.block()) || (format.is_fp4() && !head_dim.is_multiple_of(2))
        {
            candle_core::bail!(
                "PackedLayout: head_dim {head_dim} is not a multiple of the {format} block {}",
                format.block()
            )
        }
        let layout = Self { format, head_dim, page_size };
        if page_size == 0 || !layout.page_bytes().is_multiple_of(16) {
            candle_core::bail!(
                "PackedLayout: {page_size} tokens of {} B make a page of {} B, not a positive multiple of 16",
                layout.row_bytes(),
                layout.page_bytes()
            )
        }
        Ok(layout)
    }

    /// The quantization format.
    pub fn format(&self) -> QatFormat {
        self.format
    }

    /// Values per row.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Element bytes per row: `D` e4m3 bytes, or `D/2` bytes of e2m1 pairs.
    pub fn row_data_bytes(&self) -> usize {
        if self.format.is_fp4() {
            self.head_dim / 2
        } else {
            self.head_dim
        }
    }

    /// Scale bytes per row (one per block).
    pub fn row_scale_bytes(&self) -> usize {
        self.head_dim / self.format.block()
    }

    /// Bytes per row (528, 288 or 68 for the V4.1 caches).
    pub fn row_bytes(&self) -> usize {
        self.row_data_bytes() + self.row_scale_bytes()
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> usize {
        self.page_size * self.row_bytes()
    }

    /// A zeroed cache of `pages` pages: `[pages, page_bytes]` u8 (slots `0 .. pages·page_size`).
    pub fn zeros(&self, pages: usize, device: &Device) -> Result<Tensor> {
        Tensor::zeros((pages, self.page_bytes()), DType::U8, device)
    }

    /// Quantizes `row` (`head_dim` values) with [`pack_row`] and writes its codes and scale
    /// bytes at `slot` of `cache` (the cache's bytes, slot 0 at index 0).
    fn write_row(&self, cache: &mut [u8], slot: usize, row: &[f32]) -> Result<()> {
        let (data, scales) = pack_row(self.format, row)?;
        let (d, s) = self.offsets(slot);
        cache[d..d + data.len()].copy_from_slice(&data);
        cache[s..s + scales.len()].copy_from_slice(&scales);
        Ok(())
    }

    /// `(data, scales)` byte offsets of `slot` from the start of the cache.
    fn offsets(&self, slot: usize) -> (usize, usize) {
        let (page, row) = (slot / self.page_size, slot % self.page_size);
        let base = page * self.page_bytes();
        (
            base + row * self.row_data_bytes(),
            base + self.page_size * self.row_data_bytes() + row * self.row_scale_bytes(),
        )
    }

    /// Packs `rows` (`[N, D]`, any float dtype, any device) into a new cache of
    /// `ceil(N / page_size)` pages on `rows`' device, row i at slot i (the slots past N zeroed),
    /// with [`crate::quant::packed::pack_row`] on the CPU: the reference packing of whole rows
    /// (no RoPE or norm; [`packed_insert`] is the fused insert).
    pub fn pack(&self, rows: &Tensor) -> Result<Tensor> {
        let (n, d) = rows.dims2()?;
        if d != self.head_dim {
            candle_core::bail!("PackedLayout::pack: rows {:?} are not {} wide", rows.shape(), self.head_dim)
        }
        let pages = n.div_ceil(self.page_size);
        let mut bytes = vec![0u8; pages * self.page_bytes()];
        let values = rows.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (slot, row) in values.iter().enumerate() {
            self.write_row(&mut bytes, slot, row)?;
        }
        Tensor::from_vec(bytes, (pages, self.page_bytes()), &Device::Cpu)?.to_device(rows.device())
    }

    /// Dequantizes the rows at `slots` of a packed cache (`[pages, page_bytes]` u8, any device)
    /// into `[slots.len(), D]` f32 on the CPU, with [`crate::quant::packed::unpack_row`].
    pub fn unpack(&self, cache: &Tensor, slots: &[usize]) -> Result<Tensor> {
        self.check_cache(cache, "PackedLayout::unpack")?;
        let bytes = cache.flatten_all()?.to_vec1::<u8>()?;
        let pages = cache.dim(0)?;
        let mut out = Vec::with_capacity(slots.len() * self.head_dim);
        for &s in slots {
            if s >= pages * self.page_size {
                candle_core::bail!(
                    "PackedLayout::unpack: slot {s} outside the {pages} pages of {} tokens",
                    self.page_size
                )
            }
            let (d, sc) = self.offsets(s);
            out.extend(unpack_row(
                self.format,
                &bytes[d..d + self.row_data_bytes()],
                &bytes[sc..sc + self.row_scale_bytes()],
            )?);
        }
        Tensor::from_vec(out, (slots.len(), self.head_dim), &Device::Cpu)
    }

    /// Slots `slots` of `cache` as `[n, head_dim]` rows in `dtype` on the cache's device:
    /// [`PackedLayout::unpack`] (a host round trip, exact) for reading a packed cache back.
    pub fn unpack_rows(&self, cache: &Tensor, slots: std::ops::Range<usize>, dtype: DType) -> Result<Tensor> {
        self.unpack(cache, &slots.collect::<Vec<_>>())?.to_dtype(dtype)?.to_device(cache.device())
    }

    pub(crate) fn check_cache(&self, cache: &Tensor, op: &str) -> Result<usize> {
        if cache.dtype() != DType::U8
            || cache.rank() != 2
            || cache.dim(1)? != self.page_bytes()
            || !cache.is_contiguous()
        {
            candle_core::bail!(
                "{op}: cache must be a contiguous [pages, {}] u8 tensor for {self:?}, got {:?} {:?}",
                self.page_bytes(),
                cache.dtype(),
                cache.shape()
            )
        }
        Ok(cache.dim(0)? * self.page_size)
    }
}

/// Writes `T` rows into a packed cache, in place: for every token t with `slots[t]` in
/// `[0, pages · page_size)`, the row `quantize(RoPE([norm](rows[t])))` in `layout`'s format is
/// stored as its codes and scale bytes at slot `slots[t]`.
///
/// * `cache`: `[pages, layout.page_bytes()]` u8, contiguous (see [`PackedLayout::zeros`]).
/// * `rows`: `[T, D]` bf16 (window KV / compressor latent / `k_pre`).
/// * `cos`, `sin`: `[T, R/2]` f32 ([`crate::nn::RopeTable::cos_sin`] at `p` or `j·r`).
/// * `slots`: `[T]` i64; outside the cache: skipped; non-negative slots unique.
/// * `norm`: `Some((weight [D], eps))` applies the RMSNorm first (index keys' `k_norm`).
///
/// Decoded with [`PackedLayout::unpack`], the stored rows equal what [`super::window_insert`],
/// [`super::compressed_insert`] or [`super::index_key_insert`] (with `fake_quant`) store.
pub fn packed_insert(
    cache: &Tensor,
    layout: &PackedLayout,
    rows: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    slots: &Tensor,
    norm: Option<(&Tensor, f64)>,
) -> Result<()> {
    let op = "packed_insert";
    let num_slots = layout.check_cache(cache, op)?;
    let (inputs, rows) = RowInputs::check(op, layout.head_dim, cache.device(), rows, cos, sin, slots, norm)?;
    if cache.device().is_cuda() && !cache.layout().start_offset().is_multiple_of(16) {
        candle_core::bail!("{op}: the cache view must start on a 16-byte boundary")
    }
    if rows.dim(0)? == 0 {
        return Ok(());
    }
    cache.inplace_op2(&rows, &PackedInsert { layout: *layout, num_slots, inputs })
}

struct PackedInsert {
    layout: PackedLayout,
    num_slots: usize,
    inputs: RowInputs,
}

impl InplaceOp2 for PackedInsert {
    fn name(&self) -> &'static str {
        "packed_insert"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, src: &CpuStorage, sl: &Layout) -> Result<()> {
        let (op, l) = ("packed_insert", &self.layout);
        let rows = self.inputs.reference_rows(&cpu_rows(src, sl, op)?, None)?;
        let rows = rows.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let slots = self.inputs.host_slots(op, self.num_slots)?;
        let CpuStorage::U8(cache) = dst else { candle_core::bail!("{op}: expected a u8 cache storage") };
        let cache = &mut cache[dl.start_offset()..];
        for (t, &s) in slots.iter().enumerate() {
            if s >= 0 && (s as u64) < self.num_slots as u64 {
                l.write_row(cache, s as usize, &rows[t * l.head_dim..(t + 1) * l.head_dim])?;
            }
        }
        Ok(())
    }

    fn cuda_fwd(&self, dst: &mut CudaStorage, dl: &Layout, src: &CudaStorage, sl: &Layout) -> Result<()> {
        let stream = stream_for(src)?;
        let l = &self.layout;
        let locked = self.inputs.lock();
        let inp = locked.pointers(&stream)?;
        let (src_ptr, _src_sync) = read_ptr::<bf16>(src, sl, &stream)?;
        let (cache, _cache_sync) = write_ptr::<u8>(dst, dl, &stream)?;
        let params = ffi::PackedInsertParams {
            src: src_ptr.cast(),
            cos: inp.cos,
            sin: inp.sin,
            slots: inp.slots,
            norm_weight: inp.norm_weight,
            cache,
            src_row_stride: row_stride(sl, l.head_dim) as i64,
            page_stride: l.page_bytes() as i64,
            num_slots: self.num_slots as i64,
            num_tokens: sl.dims()[0] as i32,
            head_dim: l.head_dim as i32,
            rope_dim: self.inputs.rope_dim()? as i32,
            quant: quant_code(l.format),
            apply_norm: self.inputs.norm.is_some() as i32,
            page_size: l.page_size as i32,
            norm_eps: inp.norm_eps as f32,
            norm_inv_dim: (1.0 / l.head_dim as f64) as f32,
        };
        // SAFETY: pointers come from storages locked for this call (the cache with its write
        // lock); the cache is a contiguous [pages, page_bytes] u8 view starting 16-byte aligned
        // (checked), and the kernel writes only the bytes of slots [0, num_slots).
        let code = unsafe {
            ffi::dsv41_packed_insert(&params, std::mem::size_of::<ffi::PackedInsertParams>(), raw_stream(&stream))
        };
        ffi::check_status("packed_insert", code)
    }
}
