//! Per-layer role resolution (spec §1.4, §6.5, §0.1b items 3-5) and role queries.
//!
//! A compressed layer `l` reads the compressed cache of the latest kv source `<= l` and the
//! top-k of the latest index source `<= l`; an index source scores against the index keys of the
//! latest kv source `<= l`. Both latest sources must have `l`'s own ratio. Candidate blocks are
//! published by the candidate source and consumed by every index source with a larger id.

use super::parse::Form;
use super::{AttentionRole, CandidateRole, Config, ConfigError, LayerRole, SourceKind, TopkRole};

/// The largest id in the ascending list `ids` that is `<= layer`.
pub(crate) fn latest_at_or_below(ids: &[usize], layer: usize) -> Option<usize> {
    ids.iter().copied().take_while(|&s| s <= layer).last()
}

/// The candidate role of index source `layer` (ratio `ratio`).
fn candidate_role(cfg: &Config, layer: usize, ratio: usize) -> Result<CandidateRole, ConfigError> {
    match cfg.candidate_source_layer_id {
        Some(c) if c == layer => Ok(CandidateRole::Publish),
        Some(c) if c < layer => {
            let source_ratio = cfg.compress_ratios.get(c).copied().unwrap_or(0);
            if source_ratio != ratio {
                return Err(ConfigError::CandidateRatioMismatch { layer, ratio, source_layer: c, source_ratio });
            }
            Ok(CandidateRole::Consume { source: c })
        }
        _ => Ok(CandidateRole::None),
    }
}

/// The latest source of `kind` at or below compressed layer `layer`, checked to have `ratio`.
fn latest_source(cfg: &Config, form: Form, kind: SourceKind, layer: usize, ratio: usize) -> Result<usize, ConfigError> {
    let (ids, key) = match kind {
        SourceKind::Kv => (&cfg.kv_source_layer_ids, "kv_source_layer_ids"),
        SourceKind::Index => (&cfg.index_source_layer_ids, "index_source_layer_ids"),
    };
    let source_layer = latest_at_or_below(ids, layer).ok_or_else(|| ConfigError::NoSource {
        layer,
        ratio,
        kind,
        field: form.name(key),
    })?;
    let source_ratio = cfg.compress_ratios.get(source_layer).copied().unwrap_or(0);
    if source_ratio != ratio {
        return Err(ConfigError::SourceRatioMismatch { layer, ratio, kind, source_layer, source_ratio });
    }
    Ok(source_layer)
}

/// Resolves the role of one backbone layer, checking the per-layer invariants on the way.
///
/// Expects the list-level checks of `validate` (ascending lists, ratios in {0, 1, 2}, enough
/// ratios) to have passed; never panics if they did not.
fn resolve_layer(cfg: &Config, form: Form, layer: usize) -> Result<LayerRole, ConfigError> {
    let ratio = cfg.compress_ratios.get(layer).copied().ok_or_else(|| ConfigError::InvalidValue {
        field: form.name("compress_ratios"),
        value: format!("a list of {} entries", cfg.compress_ratios.len()),
        requirement: format!("needs an entry for layer {layer}"),
    })?;
    let engram = cfg.is_engram_layer(layer);
    if ratio == 0 {
        return Ok(LayerRole { layer, attention: AttentionRole::WindowOnly, engram });
    }
    let kv_source = latest_source(cfg, form, SourceKind::Kv, layer, ratio)?;
    let index_source = latest_source(cfg, form, SourceKind::Index, layer, ratio)?;
    let topk = if index_source != layer {
        if kv_source == layer {
            return Err(ConfigError::KvSourceNotIndexSource {
                layer,
                kv_field: form.name("kv_source_layer_ids"),
                index_field: form.name("index_source_layer_ids"),
            });
        }
        TopkRole::Reuse { index_source }
    } else {
        let candidates = candidate_role(cfg, layer, ratio)?;
        if kv_source == layer {
            TopkRole::Full { candidates }
        } else {
            TopkRole::Reindex { key_owner: kv_source, candidates }
        }
    };
    Ok(LayerRole { layer, attention: AttentionRole::Compressed { ratio, kv_source, topk }, engram })
}

/// Resolves the roles of layers `0..num_hidden_layers`.
pub(crate) fn resolve(cfg: &Config, form: Form) -> Result<Vec<LayerRole>, ConfigError> {
    (0..cfg.num_hidden_layers).map(|l| resolve_layer(cfg, form, l)).collect()
}

impl TopkRole {
    /// The candidate role carried by a top-k computing layer ([`CandidateRole::None`] for Reuse).
    pub fn candidates(&self) -> CandidateRole {
        match self {
            TopkRole::Full { candidates } | TopkRole::Reindex { candidates, .. } => *candidates,
            TopkRole::Reuse { .. } => CandidateRole::None,
        }
    }
}

impl LayerRole {
    /// The compress ratio: 0 for window-only layers, else 1 or 2.
    pub fn ratio(&self) -> usize {
        match self.attention {
            AttentionRole::WindowOnly => 0,
            AttentionRole::Compressed { ratio, .. } => ratio,
        }
    }

    /// The top-k role, `None` for window-only layers.
    pub fn topk(&self) -> Option<TopkRole> {
        match self.attention {
            AttentionRole::WindowOnly => None,
            AttentionRole::Compressed { topk, .. } => Some(topk),
        }
    }

    /// The layer whose compressed cache this layer reads (`None` for window-only layers).
    pub fn kv_source(&self) -> Option<usize> {
        match self.attention {
            AttentionRole::WindowOnly => None,
            AttentionRole::Compressed { kv_source, .. } => Some(kv_source),
        }
    }

    /// Whether this layer owns a compressor, a compressed cache and an index-key cache
    /// (mode Full).
    pub fn is_kv_source(&self) -> bool {
        matches!(self.topk(), Some(TopkRole::Full { .. }))
    }

    /// Whether this layer computes its own top-k (modes Full and Reindex): it owns an indexer
    /// query path (`indexer.wq_b`, `indexer.weights_proj`).
    pub fn is_index_source(&self) -> bool {
        matches!(self.topk(), Some(TopkRole::Full { .. } | TopkRole::Reindex { .. }))
    }

    /// The layer whose index-key cache this layer scores against: itself for Full, the key
    /// owner for Reindex, `None` for Reuse and window-only layers.
    pub fn index_key_owner(&self) -> Option<usize> {
        match self.topk()? {
            TopkRole::Full { .. } => Some(self.layer),
            TopkRole::Reindex { key_owner, .. } => Some(key_owner),
            TopkRole::Reuse { .. } => None,
        }
    }

    /// The layer whose top-k this layer uses: itself for Full/Reindex, the index source for
    /// Reuse, `None` for window-only layers.
    pub fn topk_source(&self) -> Option<usize> {
        match self.topk()? {
            TopkRole::Full { .. } | TopkRole::Reindex { .. } => Some(self.layer),
            TopkRole::Reuse { index_source } => Some(index_source),
        }
    }

    /// The candidate role ([`CandidateRole::None`] unless this layer computes a top-k).
    pub fn candidates(&self) -> CandidateRole {
        self.topk().map_or(CandidateRole::None, |t| t.candidates())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_latest_at_or_below() {
        let ids = [2, 8, 14, 20];
        assert_eq!(latest_at_or_below(&ids, 0), None);
        assert_eq!(latest_at_or_below(&ids, 1), None);
        assert_eq!(latest_at_or_below(&ids, 2), Some(2));
        assert_eq!(latest_at_or_below(&ids, 7), Some(2));
        assert_eq!(latest_at_or_below(&ids, 8), Some(8));
        assert_eq!(latest_at_or_below(&ids, 39), Some(20));
        assert_eq!(latest_at_or_below(&[], 39), None);
    }

    #[test]
    fn config_layer_role_queries() {
        let reindex = LayerRole {
            layer: 24,
            attention: AttentionRole::Compressed {
                ratio: 1,
                kv_source: 20,
                topk: TopkRole::Reindex { key_owner: 20, candidates: CandidateRole::Consume { source: 20 } },
            },
            engram: false,
        };
        assert_eq!(reindex.ratio(), 1);
        assert!(reindex.is_index_source() && !reindex.is_kv_source());
        assert_eq!(reindex.index_key_owner(), Some(20));
        assert_eq!(reindex.topk_source(), Some(24));
        assert_eq!(reindex.candidates(), CandidateRole::Consume { source: 20 });
        let window = LayerRole { layer: 0, attention: AttentionRole::WindowOnly, engram: true };
        assert_eq!((window.ratio(), window.kv_source(), window.topk_source()), (0, None, None));
        assert!(!window.is_index_source() && window.candidates() == CandidateRole::None);
    }
}
