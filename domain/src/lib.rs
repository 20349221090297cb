//! The pure domain of zhihui.
//!
//! Every aggregate here is a *decider* (see [`Decider`]): given the state folded from past events
//! and a command, it decides which new events happen, or refuses with a precise error. Nothing in
//! this crate does IO, reads a clock or draws random numbers: the application puts the time and the
//! ids into the command, so a decision is a pure function and replay is a fold.
//!
//! The crate depends on no IO crate; `ARCHITECTURE.md` lists that as an invariant.

pub mod account;
pub mod api_key;
pub mod checkin;
pub mod claim;
pub mod decider;
pub mod event;
pub mod gallery;
pub mod identity;
pub mod points;
pub mod pool;
pub mod promotion;
pub mod redeem;
pub mod revenue;
pub mod rule;
pub mod task;
pub mod task_record;
pub mod text;
pub mod user;
pub mod webhook;
pub mod webhook_slots;

pub use decider::Decider;
pub use event::{DecodeError, DomainEvent};
