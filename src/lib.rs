//! zhihui: the backend of an AI text-to-image cloud platform. See `ARCHITECTURE.md` for the map.
//!
//! The crate is built in floors, and its modules only ever import from their own floor or one
//! below: the edges (`http`, `web`, `cli`, `startup`, and `state`, the services they share) use
//! the features (`identity`, `tasks`, `dispatch`, `labels`, `points`, `webhooks`), which use the
//! foundations (`platform`), which use the pure domain (`zhihui-domain`).

pub mod platform;

pub mod dispatch;
pub mod identity;
pub mod labels;
pub mod points;
pub mod tasks;
pub mod webhooks;

pub mod cli;
pub mod http;
pub mod startup;
pub mod state;
pub mod web;
