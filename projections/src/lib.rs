//! Projections: fold the global event log into PostgreSQL read models.
//!
//! A projection reads events in global order from its checkpoint, applies them with the domain's
//! `evolve` semantics, and writes its rows and its checkpoint in one PostgreSQL transaction, so a
//! crash can never skip or double-apply an event. Projections never append events.
//!
//! The runner and the first read models (accounts, ledger) arrive with the points ledger; this
//! crate exists from the walking skeleton on so that the dependency direction is fixed:
//! `zhihui` -> `zhihui-projections` -> `zhihui-domain`, never the other way.

pub use zhihui_domain as domain;
