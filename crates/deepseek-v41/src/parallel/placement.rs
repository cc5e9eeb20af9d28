//! [`ExpertPlacement`]: which routed experts a rank of an expert-parallel group holds.

use candle_core::Result;

/// Rank `rank` of `world` holds the experts `range()`: contiguous, the first `E mod N` ranks one
/// more than the others (so every expert has exactly one rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertPlacement {
    experts: usize,
    world: usize,
    rank: usize,
}

impl ExpertPlacement {
    /// The placement of `experts` routed experts over `world` ranks, seen from `rank`. Errors for
    /// `world` = 0, `rank` ≥ `world`, or more ranks than experts (a rank would hold none).
    pub fn new(experts: usize, world: usize, rank: usize) -> Result<Self> {
        if world == 0 || rank >= world {
            candle_core::bail!("expert placement: rank {rank} of {world} ranks (need 0 <= rank < world, world >= 1)")
        }
        if world > experts {
            candle_core::bail!("expert placement: {world} ranks for {experts} experts (at most one rank per expert)")
        }
        Ok(Self { experts, world, rank })
    }

    /// One rank holding every expert (the single-GPU layout).
    pub fn single(experts: usize) -> Self {
        Self { experts, world: 1, rank: 0 }
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Routed experts of the layer.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Whether the checkpoint tensor `name` is a routed expert's that another rank holds
    /// (`layers.L.ffn.experts.E.…` with `E` outside [`ExpertPlacement::range`]): the tensors this
    /// rank does not read.
    pub fn held_elsewhere(&self, name: &str) -> bool {
        let mut parts = name.split('.');
        let expert = match (parts.next(), parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some("layers"), Some(_), Some("ffn"), Some("experts"), Some(e)) => e.parse::<usize>().ok(),
            _ => None,
        };
        expert.is_some_and(|e| e < self.experts && !self.range().contains(&e))
    }

    /// The first expert of rank `r`.
    fn start(&self, r: usize) -> usize {
        let (base, extra) = (self.experts / self.world, self.experts % self.world);
        r * base + r.min(extra)
    }

    /// The experts rank `r` holds.
    pub fn range_of(&self, r: usize) -> std::ops::Range<usize> {
        self.start(r)..self.start(r + 1)
    }

    /// The experts this rank holds.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.range_of(self.rank)
    }

    /// The rank holding expert `e` (< `experts`).
    pub fn owner(&self, e: usize) -> usize {
        let (base, extra) = (self.experts / self.world, self.experts % self.world);
        let cut = extra * (base + 1);
        if e < cut {
            e / (base + 1)
        } else {
            extra + (e - cut) / base
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every expert has exactly one rank, the ranges tile 0..E in order, and `owner` agrees.
    #[test]
    fn ranges_tile_the_experts() {
        for (e, n) in [(384, 8), (384, 5), (10, 3), (7, 7), (1, 1), (16, 1)] {
            let mut next = 0;
            for r in 0..n {
                let p = ExpertPlacement::new(e, n, r).unwrap();
                let range = p.range();
                assert_eq!(range.start, next, "E {e} N {n} rank {r}");
                assert!(range.len() == e / n || range.len() == e / n + 1, "E {e} N {n} rank {r}: {range:?}");
                for x in range.clone() {
                    assert_eq!(p.owner(x), r, "E {e} N {n} expert {x}");
                }
                next = range.end;
            }
            assert_eq!(next, e);
        }
        assert!(ExpertPlacement::new(4, 5, 0).is_err());
        assert!(ExpertPlacement::new(4, 2, 2).is_err());
        assert!(ExpertPlacement::new(4, 0, 0).is_err());
    }

    /// Only the routed experts of other ranks are held elsewhere; the router, the shared expert
    /// and everything else are every rank's.
    #[test]
    fn names_held_elsewhere() {
        let p = ExpertPlacement::new(8, 4, 1).unwrap(); // experts 2, 3
        for (name, elsewhere) in [
            ("layers.0.ffn.experts.1.w1.weight", true),
            ("layers.5.ffn.experts.4.w2.scale", true),
            ("layers.0.ffn.experts.2.w1.weight", false),
            ("layers.3.ffn.experts.3.w3.weight", false),
            ("layers.0.ffn.gate.weight", false),
            ("layers.0.ffn.shared_experts.w1.weight", false),
            ("layers.0.attn.wq_a.weight", false),
            ("layers.0.ffn.experts.9.w1.weight", false),
            ("layers.0.ffn.experts.x.w1.weight", false),
            ("embed.weight", false),
        ] {
            assert_eq!(p.held_elsewhere(name), elsewhere, "{name}");
        }
    }
}
