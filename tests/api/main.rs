//! The one integration-test binary: every test here runs against a real PostgreSQL (a fresh
//! database per test) and a real Redis (a fresh key prefix per test). See `helpers.rs`.

mod audit;
mod auth;
mod checkins;
mod cluster_edges;
mod dispatch;
mod edges;
mod event_store;
mod failover;
mod fake_ollama;
mod gallery;
mod health;
mod helpers;
mod instances;
mod keys;
mod labels;
mod languages;
mod ledger;
mod metrics;
mod migrations;
mod pages;
mod pool;
mod processes;
mod promotions;
mod readme;
mod redeem;
mod replay;
mod reports;
mod revenue;
mod settlements;
mod sockets;
mod tasks;
mod webhooks;
mod worker_local;
