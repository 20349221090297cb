//! Projections: fold the global event log into PostgreSQL read models.
//!
//! A projection receives events in global order, in batches, and writes its rows inside a
//! transaction the runner (in the `zhihui` crate) opens and commits together with the checkpoint,
//! so a crash can never skip or double-apply an event. Projections never append events.
//!
//! Each projection writes to tables named by [`Tables`], so `zhihui replay` can build fresh copies
//! beside the live ones and swap them in when complete.
//!
//! The dependency direction is fixed: `zhihui` -> `zhihui-projections` -> `zhihui-domain`.

pub mod accounts;
pub mod checkins;
pub mod codes;
pub mod gallery;
pub mod promotions;
pub mod settlements;
pub mod tasks;
pub mod users;

pub use zhihui_domain as domain;

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// An event as a projection sees it (the runner converts the store's type into this).
#[derive(Debug, Clone)]
pub struct ProjectedEvent {
    pub id: Uuid,
    pub stream: String,
    pub stream_version: u64,
    pub event_type: String,
    pub schema_version: u32,
    pub payload: zhihui_domain::event::Payload,
    pub actor: String,
    pub correlation_id: Uuid,
    pub recorded_at: DateTime<Utc>,
}

/// The read models, by the name the runner and the CLI use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjectionName {
    /// `accounts` and `ledger_entries`.
    Ledger,
    /// `users`.
    Users,
    /// `tasks`.
    Tasks,
    /// `open_settlements` (what the settlement reconciler looks at).
    Settlements,
    /// `code_batches` and `redeem_codes`.
    Codes,
    /// `checkins`.
    Checkins,
    /// `promotions` and `promotion_claims`.
    Promotions,
    /// `works`, `work_likes`, `follows` and `work_reports`.
    Gallery,
}

/// Which events a projection reads: by stream prefix, or (when it needs a few events of streams
/// it otherwise ignores) by event type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reads {
    StreamPrefixes(Vec<String>),
    EventTypes(Vec<String>),
}

impl ProjectionName {
    pub const ALL: [ProjectionName; 8] = [
        ProjectionName::Ledger,
        ProjectionName::Users,
        ProjectionName::Tasks,
        ProjectionName::Settlements,
        ProjectionName::Codes,
        ProjectionName::Checkins,
        ProjectionName::Promotions,
        ProjectionName::Gallery,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            ProjectionName::Ledger => "ledger",
            ProjectionName::Users => "users",
            ProjectionName::Tasks => "tasks",
            ProjectionName::Settlements => "settlements",
            ProjectionName::Codes => "codes",
            ProjectionName::Checkins => "checkins",
            ProjectionName::Promotions => "promotions",
            ProjectionName::Gallery => "gallery",
        }
    }

    pub fn parse(name: &str) -> Option<ProjectionName> {
        ProjectionName::ALL
            .into_iter()
            .find(|projection| projection.as_str() == name)
    }

    /// The live tables it owns.
    pub fn tables(&self) -> &'static [&'static str] {
        match self {
            ProjectionName::Ledger => &["accounts", "ledger_entries"],
            ProjectionName::Users => &["users"],
            ProjectionName::Tasks => &["tasks", "tasks_waiting"],
            ProjectionName::Settlements => &["open_settlements"],
            ProjectionName::Codes => &["code_batches", "redeem_codes"],
            ProjectionName::Checkins => &["checkins"],
            ProjectionName::Promotions => &["promotions", "promotion_claims"],
            ProjectionName::Gallery => &["works", "work_likes", "follows", "work_reports"],
        }
    }

    /// Its tables whose rows are only ever inserted, one per event (never upserted): a rebuild
    /// loads them before building any of their keys.
    pub fn insert_only_tables(&self) -> &'static [&'static str] {
        match self {
            ProjectionName::Ledger => &["ledger_entries"],
            _ => &[],
        }
    }

    /// The events it reads.
    pub fn reads(&self) -> Reads {
        let prefixes = |prefixes: &[&str]| {
            Reads::StreamPrefixes(prefixes.iter().map(|p| (*p).to_owned()).collect())
        };
        match self {
            ProjectionName::Ledger => prefixes(&["account-"]),
            ProjectionName::Users => prefixes(&["user-"]),
            ProjectionName::Tasks => prefixes(&["task-"]),
            ProjectionName::Settlements => prefixes(&["account-", "task-"]),
            ProjectionName::Codes => {
                Reads::EventTypes(codes::EVENT_TYPES.iter().map(|t| (*t).to_owned()).collect())
            }
            ProjectionName::Checkins => Reads::EventTypes(
                checkins::EVENT_TYPES
                    .iter()
                    .map(|t| (*t).to_owned())
                    .collect(),
            ),
            ProjectionName::Promotions => Reads::EventTypes(promotions::event_types()),
            ProjectionName::Gallery => prefixes(gallery::STREAM_PREFIXES),
        }
    }

    /// Make a batch ready to write without IO: decoded and folded into rows where the
    /// projection splits its work so (the ledger), else kept as events. A replay prepares the
    /// next batch while the previous one is written.
    pub fn prepare(&self, events: Vec<ProjectedEvent>) -> anyhow::Result<Prepared> {
        Ok(match self {
            ProjectionName::Ledger => Prepared::Ledger(Box::new(accounts::fold(&events)?)),
            _ => Prepared::Events(events),
        })
    }

    /// Write a prepared batch inside the caller's transaction: what [`Self::apply`] does.
    pub async fn write_prepared(
        &self,
        transaction: &tokio_postgres::Transaction<'_>,
        tables: &Tables,
        prepared: &Prepared,
    ) -> anyhow::Result<()> {
        match prepared {
            Prepared::Ledger(rows) => accounts::write(transaction, tables, rows).await,
            Prepared::Events(events) => self.apply(transaction, tables, events).await,
        }
    }

    /// Apply one batch (in global order) inside the caller's transaction.
    pub async fn apply(
        &self,
        transaction: &tokio_postgres::Transaction<'_>,
        tables: &Tables,
        events: &[ProjectedEvent],
    ) -> anyhow::Result<()> {
        match self {
            ProjectionName::Ledger => accounts::apply(transaction, tables, events).await,
            ProjectionName::Users => users::apply(transaction, tables, events).await,
            ProjectionName::Tasks => tasks::apply(transaction, tables, events).await,
            ProjectionName::Settlements => settlements::apply(transaction, tables, events).await,
            ProjectionName::Codes => codes::apply(transaction, tables, events).await,
            ProjectionName::Checkins => checkins::apply(transaction, tables, events).await,
            ProjectionName::Promotions => promotions::apply(transaction, tables, events).await,
            ProjectionName::Gallery => gallery::apply(transaction, tables, events).await,
        }
    }
}

/// A batch ready to write ([`ProjectionName::prepare`]).
#[derive(Debug)]
pub enum Prepared {
    /// The ledger's rows, folded (boxed: a page holds one).
    Ledger(Box<accounts::LedgerRows>),
    /// Events of a projection that decodes them as it writes.
    Events(Vec<ProjectedEvent>),
}

/// Where a projection writes: the live tables, or `<table>__rebuild` during a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tables {
    suffix: &'static str,
}

impl Tables {
    pub const LIVE: Tables = Tables { suffix: "" };
    pub const REBUILD: Tables = Tables {
        suffix: "__rebuild",
    };

    /// Whether these are a replay's tables.
    pub fn is_rebuild(&self) -> bool {
        *self == Tables::REBUILD
    }

    /// The actual name of a live table under this choice. Table names are constants of this
    /// crate, never user input, so formatting them into SQL is safe.
    pub fn name(&self, table: &str) -> String {
        format!("{table}{}", self.suffix)
    }
}
