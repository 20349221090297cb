//! The rules every piece of free text a person types obeys (titles, notes, reasons, names):
//! trimmed, a length in characters, and no characters that draw nothing, move the text around,
//! or cannot be stored at all.

use crate::rule::{Broken, Rule};

/// Why a piece of text was refused; the message names the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidText(pub Broken);

/// Code points that draw nothing (Unicode's `Default_Ignorable_Code_Point`): zero-width spaces
/// and joiners, soft hyphens, fillers, variation selectors, tags. Fine inside a text (an emoji
/// sequence joins with U+200D), but a text made only of them (and spaces) is empty.
fn draws_nothing(c: char) -> bool {
    matches!(
        c,
        '\u{00AD}'
            | '\u{034F}'
            | '\u{061C}'
            | '\u{115F}'..='\u{1160}'
            | '\u{17B4}'..='\u{17B5}'
            | '\u{180B}'..='\u{180F}'
            | '\u{200B}'..='\u{200F}'
            | '\u{202A}'..='\u{202E}'
            | '\u{2060}'..='\u{206F}'
            | '\u{3164}'
            | '\u{FE00}'..='\u{FE0F}'
            | '\u{FEFF}'
            | '\u{FFA0}'
            | '\u{FFF0}'..='\u{FFF8}'
            | '\u{1BCA0}'..='\u{1BCA3}'
            | '\u{1D173}'..='\u{1D17A}'
            | '\u{E0000}'..='\u{E0FFF}'
    )
}

/// Whether `text` shows nothing: only spaces and code points that draw nothing. Such a text is
/// empty wherever a field must not be.
pub fn is_blank(text: &str) -> bool {
    text.chars().all(|c| c.is_whitespace() || draws_nothing(c))
}

/// Controls of the writing direction (embeddings, overrides, isolates): a title could show text
/// in another order than it was written in.
pub fn turns_direction(c: char) -> bool {
    matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// `raw` trimmed, `min..=max` characters long (nothing to see is empty), without control characters or direction controls (line breaks, U+2028/U+2029 included, and
/// tabs allowed only where `multiline`).
pub fn checked_text(
    raw: &str,
    min: usize,
    max: usize,
    multiline: bool,
) -> Result<String, InvalidText> {
    let text = raw.trim();
    let length = text.chars().count();
    if is_blank(text) {
        if min >= 1 {
            return Err(InvalidText(Broken::new(Rule::NotEmpty)));
        }
        return Ok(String::new());
    }
    if length < min {
        return Err(InvalidText(if min == 1 {
            Broken::new(Rule::NotEmpty)
        } else {
            Broken::new(Rule::LengthAtLeast).with("min", min)
        }));
    }
    if length > max {
        return Err(InvalidText(
            Broken::new(Rule::LengthAtMost).with("max", max),
        ));
    }
    refuse_controls(text, multiline).map_err(InvalidText)?;
    Ok(text.to_owned())
}

/// Refuses what a person's text never holds: control characters (NUL among them, which
/// PostgreSQL cannot store in an event), line separators and direction controls; line breaks and
/// tabs only where `multiline`. The rule named is the one the field's form says: one line, or no
/// control characters.
pub fn refuse_controls(text: &str, multiline: bool) -> Result<(), Broken> {
    let allowed = |c: char| multiline && matches!(c, '\n' | '\t' | '\r' | '\u{2028}' | '\u{2029}');
    let breaks_rule = |c: char| {
        (c.is_control() || matches!(c, '\u{2028}' | '\u{2029}') || turns_direction(c))
            && !allowed(c)
    };
    if text.chars().any(breaks_rule) {
        return Err(Broken::new(if multiline {
            Rule::NoControlCharacters
        } else {
            Rule::OneLine
        }));
    }
    Ok(())
}

/// What a refusal says back of a value the caller sent: enough to recognise it, never all of a
/// long one (an answer is not a mirror for whatever was posted).
pub fn echoed(text: &str) -> String {
    const SHOWN: usize = 40;
    if text.chars().count() <= SHOWN {
        text.to_owned()
    } else {
        format!("{}…", text.chars().take(SHOWN).collect::<String>())
    }
}
