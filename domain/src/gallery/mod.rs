//! The creators' gallery: works published from tasks that succeeded, the likes they get and the
//! creators people follow.
//!
//! Streams:
//! - `work-<work id>`: one work's life ([`work`]): published, unpublished, published again,
//!   hidden by an admin. A work's id derives from its task's, so a publish sent twice names one
//!   work and a task is one work at most.
//! - `like-<work id>-<user id>`: one user's like of one work ([`like`]).
//! - `follow-<follower id>-<creator id>`: one user following one creator ([`follow`]).
//! - `block-<user id>-<creator id>`: one user blocking one creator ([`block`]).
//!
//! A like and a follow are once per pair. The pair's own stream makes that so under any race:
//! two likes of one user at once (a double click reaching two processes) append at the same
//! expected version, the store lets one through, and the other, decided again, finds the like
//! there and adds nothing. Pairs of distinct users never touch one stream, so a hot work's likes
//! never wait on each other, and counts, like sets and follower lists are folds of these events
//! that Redis and the read models can be rebuilt from.

pub mod block;
pub mod follow;
pub mod like;
pub mod work;

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

/// Controls of the writing direction (embeddings, overrides, isolates): a title could show text
/// in another order than it was written in.
fn turns_direction(c: char) -> bool {
    matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// `raw` trimmed, `min..=max` characters long (nothing to see is empty), without control characters or direction controls (line breaks, U+2028/U+2029 included, and
/// tabs allowed only where `multiline`).
pub(crate) fn checked_text(
    raw: &str,
    min: usize,
    max: usize,
    multiline: bool,
) -> Result<String, InvalidText> {
    let text = raw.trim();
    let length = text.chars().count();
    if text.chars().all(|c| c.is_whitespace() || draws_nothing(c)) {
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
    let allowed = |c: char| multiline && matches!(c, '\n' | '\t' | '\r' | '\u{2028}' | '\u{2029}');
    let breaks_rule = |c: char| {
        (c.is_control() || matches!(c, '\u{2028}' | '\u{2029}') || turns_direction(c))
            && !allowed(c)
    };
    if text.chars().any(breaks_rule) {
        return Err(InvalidText(Broken::new(if multiline {
            Rule::NoControlCharacters
        } else {
            Rule::OneLine
        })));
    }
    Ok(text.to_owned())
}
