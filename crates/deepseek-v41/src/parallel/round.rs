//! Rounds: how the ranks of an expert-parallel group agree, call by call, on who forwards.
//!
//! Every call an expert-parallel model makes exchanges slots with every other rank in every
//! block, so the ranks must make the same calls in the same order even when only some have
//! sequences. Each call starts with a round: every rank says what it brings ([`Turn`]) in one
//! small all-to-all, and all learn the same [`Round`] — whether any rank forwards (then the others
//! join its blocks' exchanges with no tokens) and whether every rank is done (then all return).

use candle_core::Result;

use super::Collective;

/// What a rank brings to a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// Forwards tokens of its own sequences in this call.
    Forward,
    /// Has nothing to forward now but may later (it joins the others' exchanges).
    Idle,
    /// Has nothing more to forward (it joins the others' exchanges until every rank is done).
    Done,
}

impl Turn {
    fn byte(self) -> u8 {
        match self {
            Turn::Forward => 1,
            Turn::Idle => 2,
            Turn::Done => 3,
        }
    }
}

/// What the group does in a round (the same on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    /// Some rank forwards: every rank runs the call's exchanges.
    pub forward: bool,
    /// Every rank is [`Turn::Done`]: the group has finished.
    pub all_done: bool,
}

/// One round over `comm`: sends `turn` to every rank and returns what the group does. A
/// collective: every rank of `comm` calls it once per call of the model, in the same order.
/// Errors when a rank sends something that is not a turn (the ranks are out of step).
pub fn agree(comm: &dyn Collective, turn: Turn) -> Result<Round> {
    let got = comm.all_to_all(vec![vec![turn.byte()]; comm.world()])?;
    let mut round = Round { forward: false, all_done: true };
    for (src, b) in got.iter().enumerate() {
        match b.as_slice() {
            [1] => round = Round { forward: true, all_done: false },
            [2] => round.all_done = false,
            [3] => {}
            other => candle_core::bail!(
                "expert parallel: rank {src} sent {} bytes where a round's turn was expected (rank {}): the ranks' calls are out of step",
                other.len(),
                comm.rank()
            ),
        }
    }
    if round.forward {
        round.all_done = false;
    }
    Ok(round)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::run_local_ranks;

    /// Every rank learns the same round: forward if any rank forwards, done only if all are.
    #[test]
    fn every_rank_agrees() -> Result<()> {
        let cases: [(&[Turn], Round); 4] = [
            (&[Turn::Idle, Turn::Forward, Turn::Done], Round { forward: true, all_done: false }),
            (&[Turn::Idle, Turn::Done, Turn::Done], Round { forward: false, all_done: false }),
            (&[Turn::Done, Turn::Done, Turn::Done], Round { forward: false, all_done: true }),
            (&[Turn::Forward, Turn::Forward, Turn::Forward], Round { forward: true, all_done: false }),
        ];
        for (turns, want) in cases {
            let got = run_local_ranks(3, |c| agree(&c, turns[c.rank()]))?;
            assert!(got.iter().all(|r| *r == want), "{turns:?}: {got:?}");
        }
        Ok(())
    }

    /// A rank that sends a slot exchange where the others send turns makes the round an error.
    #[test]
    fn out_of_step_ranks_are_an_error() {
        let err = run_local_ranks(2, |c| match c.rank() {
            0 => agree(&c, Turn::Forward).map(|_| ()),
            _ => c.all_to_all(vec![vec![0; 20]; 2]).map(|_| ()),
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("out of step"), "{err}");
    }
}
