//! Dispatch to a pool of ComfyUI servers: `comfy.rs` (the HTTP client and the WebSocket message
//! set), `socket.rs` (one socket per server: fresh clientIds, pings, reconnects), `lease.rs` (the
//! leader lease with its fencing token, slot leases), `images.rs` (the image store), `estimate.rs` (wait estimates), and
//! `saga/` (the saga that drives every task from the queue to settled points, one file per step).

pub mod comfy;
pub mod images;
pub mod saga;
pub mod socket;

pub use saga::{Dispatcher, GapSample, LostLeadership, Saga};
