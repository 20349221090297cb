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

/// `raw` trimmed, `min..=max` characters long, without control characters (line breaks and tabs
/// allowed only where `multiline`).
pub(crate) fn checked_text(
    raw: &str,
    min: usize,
    max: usize,
    multiline: bool,
) -> Result<String, InvalidText> {
    let text = raw.trim();
    let length = text.chars().count();
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
    let allowed = |c: char| multiline && (c == '\n' || c == '\t' || c == '\r');
    if text.chars().any(|c| c.is_control() && !allowed(c)) {
        return Err(InvalidText(Broken::new(if multiline {
            Rule::NoControlCharacters
        } else {
            Rule::OneLine
        })));
    }
    Ok(text.to_owned())
}
