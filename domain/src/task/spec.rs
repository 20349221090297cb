//! What a task asks for: the prompt as a user typed it (`PromptText`, valid by construction),
//! the generation parameters (`TaskSpec`) and the images it made (`TaskImage`).

use super::*;
use crate::rule::{Broken, Rule};

/// A prompt as a user typed it: trimmed, not empty unless allowed, within a length, without
/// control characters other than line breaks and tabs. Valid by construction after `parse`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PromptText(String);

/// Why a prompt was refused; the message names the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidPrompt(pub Broken);

impl PromptText {
    pub fn parse(
        text: &str,
        length_max: usize,
        may_be_empty: bool,
    ) -> Result<PromptText, InvalidPrompt> {
        let text = text.trim();
        // A prompt of zero-width characters alone draws nothing: it is as empty as none.
        if crate::text::is_blank(text) && !may_be_empty {
            return Err(InvalidPrompt(Broken::new(Rule::NotEmpty)));
        }
        let length = text.chars().count();
        if length > length_max {
            return Err(InvalidPrompt(
                Broken::new(Rule::LengthAtMostGot)
                    .with("max", length_max)
                    .with("length", length),
            ));
        }
        if let Some(bad) = text.chars().find(|&c| {
            (c.is_control() && !matches!(c, '\n' | '\r' | '\t')) || crate::text::turns_direction(c)
        }) {
            return Err(InvalidPrompt(
                Broken::new(Rule::NoControlCharacter)
                    .with("character", format!("U+{:04X}", u32::from(bad))),
            ));
        }
        Ok(PromptText(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The generation parameters, checked against the catalog by the application before they get
/// here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub model: String,
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    /// Classifier-free guidance, a decimal (e.g. `7.5`) so that equality and storage are exact.
    pub cfg: Decimal,
    pub sampler: String,
    pub scheduler: String,
    pub seed: u64,
    pub images: u32,
}

/// An image a task produced, in zhihui's image store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskImage {
    pub image_id: String,
    pub content_type: String,
}
