//! Row lookups: dequantize only the rows asked for (the Engram tables, spec §2.4, §9).
//!
//! A release Engram table is `F8_E4M3 [rows, 256]` with `F8_E8M0 [rows, 8]` scales (one per row
//! per 32 columns), about 100 GB in a single-tensor shard: it cannot be materialized, and the
//! model only ever needs the rows its n-gram hashes select. [`RowTable`] reads those rows from the
//! memory map and dequantizes them (e4m3 × 2^(s − 127) in f32, then cast; the reference casts to
//! bf16). Any 2-D logical tensor works: a 32×32-block FP8 row uses its block row's scales, an
//! MXFP4 row its own scales, an unquantized row is copied.

use candle_core::{DType, Device, Tensor};

use super::checkpoint::{missing_scale, with_name, ReleaseCheckpoint};
use super::dequant::{blocks, dequant_fp8_block32, dequant_fp8_rows, dequant_mxfp4};
use super::error::LoadError;
use super::layout::{TensorInfo, WeightFormat};

/// A handle on one 2-D tensor of a checkpoint, read by rows. Cheap to clone (shares the
/// checkpoint); keep one per Engram layer.
#[derive(Clone)]
pub struct RowTable {
    ckpt: ReleaseCheckpoint,
    info: TensorInfo,
    rows: usize,
    cols: usize,
}

impl ReleaseCheckpoint {
    /// A row reader for the 2-D logical tensor `name` (validated now; errors if it is missing,
    /// not 2-D or badly stored). Records `name` as used.
    pub fn row_table(&self, name: &str) -> Result<RowTable, LoadError> {
        let info = self.info(name)?;
        let &[rows, cols] = info.shape.as_slice() else {
            return Err(LoadError::BadFormat {
                name: name.to_string(),
                detail: format!("row lookup needs a 2-D tensor, found shape {:?}", info.shape),
            });
        };
        if info.format == WeightFormat::Plain && info.stored.dtype.candle().is_none() {
            return Err(LoadError::BadFormat {
                name: name.to_string(),
                detail: format!("dtype {} is not supported", info.stored.dtype),
            });
        }
        self.mark_used(name);
        Ok(RowTable {
            ckpt: self.clone(),
            info,
            rows,
            cols,
        })
    }

    /// Rows `row_ids` of the 2-D logical tensor `name`: `[row_ids.len(), cols]` as `dtype` on
    /// `device` (see [`RowTable::rows`]).
    pub fn get_raw_rows(
        &self,
        name: &str,
        row_ids: &[usize],
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        self.row_table(name)?.rows(row_ids, dtype, device)
    }

    /// Rows selected by an integer tensor of any rank: returns `ids.dims() ++ [cols]` as `dtype`
    /// on `ids`' device (see [`RowTable::lookup`]).
    pub fn lookup_rows(&self, name: &str, ids: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        self.row_table(name)?.lookup(ids, dtype)
    }
}

impl RowTable {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// Number of rows.
    pub fn num_rows(&self) -> usize {
        self.rows
    }

    /// Row width (logical columns).
    pub fn width(&self) -> usize {
        self.cols
    }

    /// How the table is stored.
    pub fn format(&self) -> WeightFormat {
        self.info.format
    }

    /// The bytes the table takes in the checkpoint (weight and scales), read by rows from the
    /// memory map rather than held.
    pub fn stored_bytes(&self) -> u64 {
        (self.info.stored.byte_range.len() + self.info.scale.as_ref().map_or(0, |s| s.byte_range.len())) as u64
    }

    /// Bytes of one row in its stored form when the table is FP8 rows with 1×32 scales (the
    /// release's Engram tables, [`WeightFormat::Fp8Rows`]): `width` e4m3 codes plus
    /// `ceil(width / 32)` e8m0 scales (256 + 8 for the release). `None` for any other format.
    pub fn stored_row_bytes(&self) -> Option<usize> {
        (self.info.format == WeightFormat::Fp8Rows).then(|| self.cols + blocks(self.cols))
    }

    /// Tells the OS that the table is read a few rows at a time (no read-ahead around each row;
    /// best effort, Unix only). Worth it for a table much larger than the page cache.
    pub fn advise_random(&self) {
        self.ckpt.advise_random(&self.info.stored);
        if let Some(scale) = &self.info.scale {
            self.ckpt.advise_random(scale);
        }
    }

    /// Copies rows `row_ids` (may repeat, any order) in their stored form into `out`, which
    /// must be `row_ids.len() ·` [`stored_row_bytes`](Self::stored_row_bytes) long: first the
    /// e4m3 codes of every row (`[n, width]`, row-major), then their e8m0 scales
    /// (`[n, ceil(width/32)]`). No dequantization: [`super::dequant_fp8_rows`] of the two parts
    /// gives [`rows`](Self::rows)' values. Errors (naming the table) unless the table is FP8 rows
    /// with 1×32 scales, on a row id ≥ [`num_rows`](Self::num_rows) or a wrong `out` length.
    pub fn gather_stored(&self, row_ids: &[u32], out: &mut [u8]) -> Result<(), LoadError> {
        let name = self.name();
        let Some(row_bytes) = self.stored_row_bytes() else {
            return Err(LoadError::BadFormat {
                name: name.to_string(),
                detail: format!("stored rows are gathered for FP8 rows with 1x32 scales only, the table is {:?}", self.info.format),
            });
        };
        let (n, cols, sc) = (row_ids.len(), self.cols, blocks(self.cols));
        if out.len() != n * row_bytes {
            return Err(LoadError::BufferLength {
                what: "stored Engram rows (e4m3 codes, then e8m0 scales)",
                dims: format!("{n} rows of {cols} + {sc} bytes"),
                expected: n * row_bytes,
                found: out.len(),
            });
        }
        if let Some(&row) = row_ids.iter().find(|&&r| r as usize >= self.rows) {
            return Err(LoadError::RowOutOfRange { name: name.to_string(), row: row as i64, rows: self.rows });
        }
        if n == 0 || cols == 0 {
            return Ok(());
        }
        let w = self.ckpt.bytes_of(&self.info.stored)?;
        let s = self.ckpt.bytes_of(self.info.scale.as_ref().ok_or_else(|| missing_scale(name))?)?;
        let (codes, scales) = out.split_at_mut(n * cols);
        for ((&r, c), sd) in row_ids.iter().zip(codes.chunks_exact_mut(cols)).zip(scales.chunks_exact_mut(sc)) {
            let r = r as usize;
            c.copy_from_slice(&w[r * cols..(r + 1) * cols]);
            sd.copy_from_slice(&s[r * sc..(r + 1) * sc]);
        }
        Ok(())
    }

    /// Rows `row_ids` (may repeat, any order), dequantized: `[row_ids.len(), width]` as `dtype`
    /// on `device`. Errors on a row id ≥ [`num_rows`](Self::num_rows), naming the table.
    pub fn rows(&self, row_ids: &[usize], dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        let (name, cols) = (self.name(), self.cols);
        if let Some(&row) = row_ids.iter().find(|&&r| r >= self.rows) {
            return Err(LoadError::RowOutOfRange {
                name: name.to_string(),
                row: row as i64,
                rows: self.rows,
            }
            .into());
        }
        let w = self.ckpt.bytes_of(&self.info.stored)?;
        let n = row_ids.len();
        let t = match (self.info.format, self.info.stored.dtype.candle()) {
            (WeightFormat::Plain, Some(sd)) => {
                let row_bytes = cols * self.info.stored.dtype.size();
                let mut buf = Vec::with_capacity(n * row_bytes);
                for &r in row_ids {
                    buf.extend_from_slice(&w[r * row_bytes..(r + 1) * row_bytes]);
                }
                Tensor::from_raw_buffer(&buf, sd, &[n, cols], &Device::Cpu)?
            }
            (format, _) => {
                let s = self
                    .ckpt
                    .bytes_of(self.info.scale.as_ref().ok_or_else(|| missing_scale(name))?)?;
                let sc = blocks(cols);
                let mut v = Vec::with_capacity(n * cols);
                for &r in row_ids {
                    let row = match format {
                        WeightFormat::Fp8Rows => {
                            dequant_fp8_rows(&w[r * cols..(r + 1) * cols], &s[r * sc..(r + 1) * sc], 1, cols)
                        }
                        WeightFormat::Fp8Block32 => {
                            let b = r / 32;
                            dequant_fp8_block32(&w[r * cols..(r + 1) * cols], &s[b * sc..(b + 1) * sc], 1, cols)
                        }
                        WeightFormat::Mxfp4 => {
                            dequant_mxfp4(&w[r * cols / 2..(r + 1) * cols / 2], &s[r * sc..(r + 1) * sc], 1, cols)
                        }
                        WeightFormat::Plain => Err(LoadError::BadFormat {
                            name: name.to_string(),
                            detail: format!("dtype {} is not supported", self.info.stored.dtype),
                        }),
                    }
                    .map_err(|e| with_name(name, e))?;
                    v.extend_from_slice(&row);
                }
                Tensor::from_vec(v, (n, cols), &Device::Cpu)?
            }
        };
        t.to_dtype(dtype)?.to_device(device)
    }

    /// Rows selected by `ids`, an integer tensor (U8/U32/I16/I32/I64) of any rank: returns
    /// `ids.dims() ++ [width]` as `dtype` on `ids`' device. Negative or too large ids are errors.
    pub fn lookup(&self, ids: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        let flat: Vec<i64> = ids.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
        let mut rows = Vec::with_capacity(flat.len());
        for id in flat {
            let r = usize::try_from(id).map_err(|_| LoadError::RowOutOfRange {
                name: self.name().to_string(),
                row: id,
                rows: self.rows,
            })?;
            rows.push(r);
        }
        let t = self.rows(&rows, dtype, ids.device())?;
        let mut dims = ids.dims().to_vec();
        dims.push(self.cols);
        t.reshape(dims)
    }
}
