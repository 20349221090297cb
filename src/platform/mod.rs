//! The foundations every feature stands on: the event store and the command handling over it,
//! the projection runner, leadership of background workers, the PostgreSQL pool and Redis
//! connection, the Redis scripts' loader, notifications across processes, configuration,
//! telemetry and metrics, the clock and the allocator. Nothing here names a feature.

pub mod aggregate;
pub mod allocator;
pub mod clock;
pub mod command;
pub mod configuration;
pub mod event_store;
pub mod leader;
pub mod lua;
pub mod metrics;
pub mod notify;
pub mod pg_fencing;
pub mod postgres;
pub mod projector;
pub mod redis_store;
pub mod telemetry;
pub mod worker_local;
