//! zhihui: the backend of an AI text-to-image cloud platform. See `ARCHITECTURE.md` for the map.

pub mod aggregate;
pub mod audit;
pub mod auth;
pub mod bench_support;
pub mod cli;
pub mod clock;
pub mod codes;
pub mod command;
pub mod configuration;
pub mod dispatch;
pub mod event_store;
pub mod http;
pub mod inspect;
pub mod leader;
pub mod lua;
pub mod notify;
pub mod postgres;
pub mod projector;
pub mod redis_store;
pub mod replay;
pub mod revenue;
pub mod settlements;
pub mod startup;
pub mod tasks;
pub mod telemetry;
pub mod users;
