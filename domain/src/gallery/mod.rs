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
//! - `report-<work id>-<user id>`: one user's report of one work to the admins ([`report`]).
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
pub mod report;
pub mod work;

pub(crate) use crate::text::{InvalidText, checked_text};
