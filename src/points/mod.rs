//! The points economy beyond a task's own hold: redeem codes, flash-sale promotions, daily
//! check-ins, the system revenue account that mirrors every settled point, and the settlement
//! reconciler that finishes whatever a crashed request left owed.

pub mod checkins;
pub mod codes;
pub mod ledger;
pub mod promotions;
pub mod revenue;
pub mod settlements;
