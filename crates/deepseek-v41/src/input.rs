//! Checks of caller-supplied inputs that run before any work starts: token ids against the
//! vocabulary, the context length against `max_position_embeddings`, the sampling settings.
//! Each failure is an [`InputError`] naming the value, the limit and what to change.

/// A caller-supplied input the model cannot take.
///
/// Converts into [`candle_core::Error`] (a wrapped error whose message is this `Display`), so
/// `candle_core::Result` code can use `?`; the checks below return it unwrapped, for callers
/// that validate before calling into the model.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InputError {
    /// A forward call or a generation was given no token.
    #[error("no tokens given: pass at least one token id (an encoded prompt holds at least BOS)")]
    NoTokens,
    /// A token id is not below the vocabulary size.
    #[error(
        "token id {id} (at index {index}) is outside the vocabulary: ids must be < vocab_size = {vocab_size}; \
         encode prompts with this model's tokenizer"
    )]
    TokenOutOfVocab {
        /// The id.
        id: u32,
        /// Its index in the token list.
        index: usize,
        /// The model's `vocab_size`.
        vocab_size: usize,
    },
    /// The prompt plus the new-token budget needs more positions than the model has.
    #[error(
        "context too long: {prompt} prompt tokens + {max_new} new tokens exceed the model's \
         max_position_embeddings = {max_positions}; {advice}"
    )]
    ContextTooLong {
        /// Prompt tokens (BOS and cached tokens included).
        prompt: usize,
        /// The requested new-token budget.
        max_new: usize,
        /// The config's `max_position_embeddings`.
        max_positions: usize,
        /// What to change.
        advice: String,
    },
    /// The sampling temperature is negative or not finite.
    #[error("temperature must be finite and >= 0 (0 = greedy), got {0}")]
    Temperature(f64),
    /// The nucleus mass is outside (0, 1].
    #[error("top_p must be in (0, 1] (1 = no truncation), got {0}")]
    TopP(f64),
}

impl From<InputError> for candle_core::Error {
    fn from(e: InputError) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// `tokens` is not empty and every id is `< vocab_size`.
pub fn check_tokens(tokens: &[u32], vocab_size: usize) -> Result<(), InputError> {
    if tokens.is_empty() {
        return Err(InputError::NoTokens);
    }
    match tokens.iter().enumerate().find(|(_, &id)| id as usize >= vocab_size) {
        Some((index, &id)) => Err(InputError::TokenOutOfVocab { id, index, vocab_size }),
        None => Ok(()),
    }
}

/// `prompt` tokens followed by up to `max_new` generated ones fit in `max_positions`
/// (`max_position_embeddings`): the last generated token is never fed back, so the last
/// position used is `prompt + max_new − 2`, i.e. `prompt + max_new − 1 <= max_positions`.
pub fn check_context(prompt: usize, max_new: usize, max_positions: usize) -> Result<(), InputError> {
    let needed = (prompt as u128 + max_new as u128).saturating_sub(1);
    if prompt <= max_positions && needed <= max_positions as u128 {
        return Ok(());
    }
    let advice = if prompt >= max_positions {
        format!("shorten the prompt to fewer than {max_positions} tokens")
    } else {
        format!("lower the new-token budget to at most {}", max_positions + 1 - prompt)
    };
    Err(InputError::ContextTooLong { prompt, max_new, max_positions, advice })
}

/// `temperature` is finite and ≥ 0, `top_p` in (0, 1].
pub fn check_sampling(temperature: f64, top_p: f64) -> Result<(), InputError> {
    if !(temperature >= 0.0 && temperature.is_finite()) {
        return Err(InputError::Temperature(temperature));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(InputError::TopP(top_p));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_context_and_sampling_limits() {
        assert_eq!(check_tokens(&[], 8), Err(InputError::NoTokens));
        assert_eq!(check_tokens(&[0, 7, 8], 8), Err(InputError::TokenOutOfVocab { id: 8, index: 2, vocab_size: 8 }));
        assert!(check_tokens(&[0, 7], 8).is_ok());
        // 10 positions: a 4-token prompt can get 7 new tokens (the 7th is never fed back).
        assert!(check_context(4, 7, 10).is_ok());
        assert!(check_context(10, 1, 10).is_ok());
        let e = check_context(4, 8, 10).unwrap_err().to_string();
        assert!(e.contains("at most 7") && e.contains("max_position_embeddings = 10"), "{e}");
        let e = check_context(11, 1, 10).unwrap_err().to_string();
        assert!(e.contains("shorten the prompt"), "{e}");
        let e = check_context(3, usize::MAX, 10).unwrap_err().to_string();
        assert!(e.contains(&usize::MAX.to_string()), "{e}");
        assert!(check_sampling(0.0, 1.0).is_ok());
        for (t, p) in [(-1.0, 1.0), (f64::NAN, 1.0), (f64::INFINITY, 1.0), (1.0, 0.0), (1.0, 1.5), (1.0, f64::NAN)] {
            assert!(check_sampling(t, p).is_err(), "{t} {p}");
        }
        let wrapped: candle_core::Error = InputError::TopP(2.0).into();
        assert!(wrapped.to_string().contains("top_p must be in (0, 1]"), "{wrapped}");
    }
}
