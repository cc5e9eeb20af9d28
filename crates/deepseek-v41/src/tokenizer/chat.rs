//! The chat and thinking prompt formats of DeepSeek V4.1 (spec §11).

use std::str::FromStr;

use super::{
    Result, Tokenizer, TokenizerError, ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, THINK_END_TOKEN,
    THINK_START_TOKEN, USER_TOKEN,
};

/// How thorough the reasoning of a thinking-mode answer should be: an integer in 1..=100, or
/// one of the names `low` (50), `high` (75, the default) and `max` (100).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningEffort {
    /// 50.
    Low,
    /// 75, the default.
    #[default]
    High,
    /// 100.
    Max,
    /// An explicit value in 1..=100 (checked by [`ReasoningEffort::new`]).
    Value(u8),
}

impl ReasoningEffort {
    /// An explicit effort; fails outside 1..=100.
    pub fn new(value: u32) -> Result<Self> {
        match u8::try_from(value) {
            Ok(v @ 1..=100) => Ok(Self::Value(v)),
            _ => Err(TokenizerError::InvalidEffort(value.to_string())),
        }
    }

    /// The number written into the prompt.
    pub fn value(self) -> u8 {
        match self {
            Self::Low => 50,
            Self::High => 75,
            Self::Max => 100,
            Self::Value(v) => v,
        }
    }
}

impl FromStr for ReasoningEffort {
    type Err = TokenizerError;

    /// Parses `low`, `high`, `max` or an integer in 1..=100.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "low" => Ok(Self::Low),
            "high" => Ok(Self::High),
            "max" => Ok(Self::Max),
            _ => s.parse::<u32>().map_err(|_| TokenizerError::InvalidEffort(s.to_string())).and_then(Self::new),
        }
    }
}

/// A chat prompt: optional system message, earlier completed turns, and the user message the
/// model answers next, in chat (non-thinking) or thinking mode.
///
/// Rendered (no separators between the pieces):
/// * chat: `BOS [<｜System｜>system] {<｜User｜>u <｜Assistant｜></think>a EOS}* <｜User｜>user <｜Assistant｜></think>`
/// * thinking: `BOS <｜System｜>Reasoning Effort: N (range 1-100, the higher the value, the more
///   thorough the reasoning)\n\n[system] {…}* <｜User｜>user <｜Assistant｜><think>`
///
/// The effort line belongs to message index 0 and so appears once, even without a system
/// message. Earlier assistant turns keep only their answer: their reasoning is dropped, as the
/// reference encoder does without tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatPrompt {
    system: Option<String>,
    history: Vec<(String, String)>,
    user: String,
    thinking: bool,
    effort: ReasoningEffort,
}

impl ChatPrompt {
    /// A chat-mode prompt asking the model to answer `user`.
    pub fn new(user: impl Into<String>) -> Self {
        Self {
            system: None,
            history: Vec::new(),
            user: user.into(),
            thinking: false,
            effort: ReasoningEffort::default(),
        }
    }

    /// Sets the system message.
    pub fn system(mut self, system: impl Into<String>) -> Self {
        self.system = Some(system.into());
        self
    }

    /// Appends an earlier completed turn (`user` message, the assistant's final `answer`),
    /// placed before the current user message.
    pub fn turn(mut self, user: impl Into<String>, answer: impl Into<String>) -> Self {
        self.history.push((user.into(), answer.into()));
        self
    }

    /// Thinking mode (the model reasons inside `<think>…</think>` first) or chat mode.
    pub fn thinking(mut self, on: bool) -> Self {
        self.thinking = on;
        self
    }

    /// The reasoning effort (thinking mode only; default `high` = 75).
    pub fn reasoning_effort(mut self, effort: ReasoningEffort) -> Self {
        self.effort = effort;
        self
    }

    /// The prompt text, BOS included as its spelling.
    pub fn render(&self) -> String {
        let mut p = String::from(BOS_TOKEN);
        if self.thinking {
            p.push_str(SYSTEM_TOKEN);
            p.push_str(&format!(
                "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n",
                self.effort.value()
            ));
            p.push_str(self.system.as_deref().unwrap_or(""));
        } else if let Some(system) = &self.system {
            p.push_str(SYSTEM_TOKEN);
            p.push_str(system);
        }
        for (user, answer) in &self.history {
            for piece in [USER_TOKEN, user, ASSISTANT_TOKEN, THINK_END_TOKEN, answer, EOS_TOKEN] {
                p.push_str(piece);
            }
        }
        p.push_str(USER_TOKEN);
        p.push_str(&self.user);
        p.push_str(ASSISTANT_TOKEN);
        p.push_str(if self.thinking { THINK_START_TOKEN } else { THINK_END_TOKEN });
        p
    }

    /// The special tokens this prompt uses.
    fn required_tokens(&self) -> Vec<&'static str> {
        let mut t = vec![BOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, THINK_END_TOKEN];
        if self.thinking {
            t.push(THINK_START_TOKEN);
        }
        if self.thinking || self.system.is_some() {
            t.push(SYSTEM_TOKEN);
        }
        if !self.history.is_empty() {
            t.push(EOS_TOKEN);
        }
        t
    }

    /// Token ids of [`ChatPrompt::render`] (starting with BOS). Fails, naming the token, if the
    /// tokenizer lacks one of the special tokens the prompt uses as an added token (the V4
    /// tokenizer, for instance, has no `<｜System｜>`; the Shakespeare one has no roles at all).
    pub fn encode(&self, tok: &Tokenizer) -> Result<Vec<u32>> {
        for token in self.required_tokens() {
            tok.added_token_id(token, "the chat template")?;
        }
        tok.encode(&self.render(), false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_tokenizers::{deepseek_v4, shakespeare};

    const BOS: &str = "<｜begin▁of▁sentence｜>";
    const EFFORT_75: &str =
        "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n";

    #[test]
    fn chat_mode_without_system() {
        assert_eq!(ChatPrompt::new("Hello").render(), format!("{BOS}<｜User｜>Hello<｜Assistant｜></think>"));
    }

    #[test]
    fn chat_mode_with_system() {
        assert_eq!(
            ChatPrompt::new("Hello").system("Be exact.").render(),
            format!("{BOS}<｜System｜>Be exact.<｜User｜>Hello<｜Assistant｜></think>")
        );
    }

    #[test]
    fn chat_mode_ignores_reasoning_effort() {
        let p = ChatPrompt::new("Hi").reasoning_effort(ReasoningEffort::Max).render();
        assert_eq!(p, format!("{BOS}<｜User｜>Hi<｜Assistant｜></think>"));
    }

    #[test]
    fn thinking_mode_default_effort_with_system() {
        assert_eq!(
            ChatPrompt::new("Hello").system("Be exact.").thinking(true).render(),
            format!("{BOS}<｜System｜>{EFFORT_75}Be exact.<｜User｜>Hello<｜Assistant｜><think>")
        );
    }

    #[test]
    fn thinking_mode_without_system_still_opens_the_system_message() {
        assert_eq!(
            ChatPrompt::new("Hello").thinking(true).render(),
            format!("{BOS}<｜System｜>{EFFORT_75}<｜User｜>Hello<｜Assistant｜><think>")
        );
    }

    #[test]
    fn thinking_mode_effort_values() {
        let line = |e: ReasoningEffort| {
            let p = ChatPrompt::new("q").thinking(true).reasoning_effort(e).render();
            let start = p.find("Reasoning Effort: ").unwrap() + "Reasoning Effort: ".len();
            p[start..].split(' ').next().unwrap().to_string()
        };
        assert_eq!(line(ReasoningEffort::Low), "50");
        assert_eq!(line(ReasoningEffort::High), "75");
        assert_eq!(line(ReasoningEffort::Max), "100");
        assert_eq!(line(ReasoningEffort::new(1).unwrap()), "1");
        assert_eq!(line(ReasoningEffort::new(33).unwrap()), "33");
        assert_eq!(
            ChatPrompt::new("q").thinking(true).reasoning_effort(ReasoningEffort::new(33).unwrap()).render(),
            format!(
                "{BOS}<｜System｜>Reasoning Effort: 33 (range 1-100, the higher the value, the more thorough the \
                 reasoning)\n\n<｜User｜>q<｜Assistant｜><think>"
            )
        );
    }

    #[test]
    fn earlier_turns_drop_reasoning_and_end_with_eos() {
        let eos = "<｜end▁of▁sentence｜>";
        let chat = ChatPrompt::new("And 3+3?").turn("2+2?", "4").render();
        assert_eq!(
            chat,
            format!("{BOS}<｜User｜>2+2?<｜Assistant｜></think>4{eos}<｜User｜>And 3+3?<｜Assistant｜></think>")
        );
        let think = ChatPrompt::new("And 3+3?").turn("2+2?", "4").thinking(true).render();
        assert_eq!(
            think,
            format!(
                "{BOS}<｜System｜>{EFFORT_75}<｜User｜>2+2?<｜Assistant｜></think>4{eos}<｜User｜>And 3+3?<｜Assistant｜><think>"
            )
        );
    }

    #[test]
    fn effort_parsing_and_range() {
        assert_eq!("low".parse::<ReasoningEffort>().unwrap().value(), 50);
        assert_eq!("high".parse::<ReasoningEffort>().unwrap().value(), 75);
        assert_eq!("max".parse::<ReasoningEffort>().unwrap().value(), 100);
        assert_eq!("100".parse::<ReasoningEffort>().unwrap().value(), 100);
        assert_eq!(ReasoningEffort::default().value(), 75);
        for bad in ["0", "101", "-3", "medium", "", "7.5"] {
            let err = bad.parse::<ReasoningEffort>().unwrap_err().to_string();
            assert!(err.contains("1..=100"), "{bad}: {err}");
        }
        assert!(ReasoningEffort::new(0).is_err());
        assert!(ReasoningEffort::new(300).is_err());
    }

    #[test]
    fn chat_prompt_encodes_role_tokens_to_their_ids() {
        let tok = deepseek_v4();
        let ids = ChatPrompt::new("Hello").encode(tok).unwrap();
        let hello = tok.encode("Hello", false).unwrap();
        let mut want = vec![0, 128803];
        want.extend(&hello);
        want.extend([128804, 128822]);
        assert_eq!(ids, want);
        // Decoding gives the rendered text back.
        assert_eq!(tok.decode(&ids, false).unwrap(), ChatPrompt::new("Hello").render());
    }

    #[test]
    fn missing_role_tokens_are_named() {
        // The V4 tokenizer predates V4.1's <｜System｜>.
        let err = ChatPrompt::new("Hi").thinking(true).encode(deepseek_v4()).unwrap_err().to_string();
        assert!(err.contains("<｜System｜>"), "{err}");
        // The Shakespeare tokenizer has no roles at all.
        let err = ChatPrompt::new("Hi").encode(shakespeare()).unwrap_err().to_string();
        assert!(err.contains("<｜User｜>") && err.contains("chat template"), "{err}");
    }
}
