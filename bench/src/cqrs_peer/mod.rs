//! The peer of `bench_commands`: the same account workload through [cqrs-es] persisted by
//! [postgres-es], as a client of those crates would write it.
//!
//! - [`BankAccount`] is a cqrs-es `Aggregate` with the rules of our account decider for the
//!   commands the benchmark uses: grant (idempotent by operation id), freeze an amount into a hold
//!   (idempotent by hold id, refused when the available balance is short), release the hold
//!   (refused for an unknown hold, a repeat is a no-op). Its events carry the same payloads as
//!   ours (`PointsGranted`, `PointsFrozen`, `HoldReleased`, with the balances after them).
//! - The framework is `postgres_es::postgres_cqrs` (the crate's default: event store as the source
//!   of truth, no snapshots, no queries): every command loads the aggregate's events, handles the
//!   command, and appends its events in one transaction; a concurrent append to the same aggregate
//!   surfaces to the caller as `AggregateError::AggregateConflict`.
//! - postgres-es's `events` / `snapshots` tables live in their own schema ([`SCHEMA`]) of the
//!   benchmark database, since our event store has an `events` table too; the peer's pool has
//!   `search_path` set to it.
//!
//! [cqrs-es]: https://crates.io/crates/cqrs-es
//! [postgres-es]: https://crates.io/crates/postgres-es

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use cqrs_es::event_sink::EventSink;
use cqrs_es::{Aggregate, AggregateError, DomainEvent};
use postgres_es::PostgresCqrs;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{Pool, Postgres};
use uuid::Uuid;
use zhihui_domain::account::{
    AccountError, Balance, HoldId, HoldReleased, OperationId, PointsFrozen, PointsGranted,
};
use zhihui_domain::points::Amount;

/// The PostgreSQL schema of postgres-es's tables.
pub const SCHEMA: &str = "cqrs_peer";

/// postgres-es's tables, as in its `db/init.sql` (the view table left out: no queries here).
const TABLES: &str = "
CREATE SCHEMA cqrs_peer;
CREATE TABLE cqrs_peer.events
(
    aggregate_type text                         NOT NULL,
    aggregate_id   text                         NOT NULL,
    sequence       bigint CHECK (sequence >= 0) NOT NULL,
    event_type     text                         NOT NULL,
    event_version  text                         NOT NULL,
    payload        json                         NOT NULL,
    metadata       json                         NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id, sequence)
);
CREATE TABLE cqrs_peer.snapshots
(
    aggregate_type   text                                 NOT NULL,
    aggregate_id     text                                 NOT NULL,
    last_sequence    bigint CHECK (last_sequence >= 0)    NOT NULL,
    current_snapshot bigint CHECK (current_snapshot >= 0) NOT NULL,
    payload          json                                 NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id, last_sequence)
);
";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum HoldStatus {
    Open,
    Released,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct Hold {
    amount: Amount,
    status: HoldStatus,
}

/// A points account as a cqrs-es aggregate.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct BankAccount {
    balance: Balance,
    holds: HashMap<HoldId, Hold>,
    /// Grants by operation id, to tell a repeat from a reuse.
    grants: HashMap<OperationId, Amount>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BankAccountCommand {
    Grant {
        operation_id: OperationId,
        amount: Amount,
        reason: String,
        at: chrono::DateTime<chrono::Utc>,
    },
    Freeze {
        hold_id: HoldId,
        amount: Amount,
        at: chrono::DateTime<chrono::Utc>,
    },
    Release {
        hold_id: HoldId,
        reason: String,
        at: chrono::DateTime<chrono::Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BankAccountEvent {
    Granted(PointsGranted),
    Frozen(PointsFrozen),
    Released(HoldReleased),
}

impl DomainEvent for BankAccountEvent {
    fn event_type(&self) -> String {
        match self {
            BankAccountEvent::Granted(_) => "PointsGranted",
            BankAccountEvent::Frozen(_) => "PointsFrozen",
            BankAccountEvent::Released(_) => "HoldReleased",
        }
        .into()
    }

    fn event_version(&self) -> String {
        "1".into()
    }
}

impl Aggregate for BankAccount {
    const TYPE: &'static str = "account";
    type Command = BankAccountCommand;
    type Event = BankAccountEvent;
    type Error = AccountError;
    type Services = ();

    async fn handle(
        &mut self,
        command: BankAccountCommand,
        _services: &(),
        sink: &EventSink<Self>,
    ) -> Result<(), AccountError> {
        let balance = self.balance;
        let event = match command {
            BankAccountCommand::Grant {
                operation_id,
                amount,
                reason,
                at,
            } => match self.grants.get(&operation_id) {
                Some(granted) if *granted == amount => return Ok(()),
                Some(_) => return Err(AccountError::OperationIdReused(operation_id)),
                None => BankAccountEvent::Granted(PointsGranted {
                    operation_id,
                    amount,
                    reason,
                    at,
                    balance_after: Balance {
                        available: balance.available + amount,
                        frozen: balance.frozen,
                    },
                }),
            },
            BankAccountCommand::Freeze {
                hold_id,
                amount,
                at,
            } => {
                if let Some(hold) = self.holds.get(&hold_id) {
                    return if hold.amount == amount {
                        Ok(())
                    } else {
                        Err(AccountError::HoldIdReused(hold_id))
                    };
                }
                let available =
                    (balance.available - amount).ok_or(AccountError::InsufficientPoints {
                        available: balance.available,
                        required: amount,
                    })?;
                BankAccountEvent::Frozen(PointsFrozen {
                    hold_id,
                    amount,
                    at,
                    balance_after: Balance {
                        available,
                        frozen: balance.frozen + amount,
                    },
                })
            }
            BankAccountCommand::Release {
                hold_id,
                reason,
                at,
            } => {
                let hold = self
                    .holds
                    .get(&hold_id)
                    .ok_or(AccountError::UnknownHold(hold_id))?;
                if hold.status == HoldStatus::Released {
                    return Ok(());
                }
                let frozen = (balance.frozen - hold.amount)
                    .unwrap_or_else(|| unreachable!("an open hold is always frozen"));
                BankAccountEvent::Released(HoldReleased {
                    hold_id,
                    amount: hold.amount,
                    reason,
                    at,
                    balance_after: Balance {
                        available: balance.available + hold.amount,
                        frozen,
                    },
                })
            }
        };
        sink.write(event, self).await;
        Ok(())
    }

    fn apply(&mut self, event: BankAccountEvent) {
        match event {
            BankAccountEvent::Granted(e) => {
                self.grants.insert(e.operation_id, e.amount);
                self.balance = e.balance_after;
            }
            BankAccountEvent::Frozen(e) => {
                self.holds.insert(
                    e.hold_id,
                    Hold {
                        amount: e.amount,
                        status: HoldStatus::Open,
                    },
                );
                self.balance = e.balance_after;
            }
            BankAccountEvent::Released(e) => {
                if let Some(hold) = self.holds.get_mut(&e.hold_id) {
                    hold.status = HoldStatus::Released;
                }
                self.balance = e.balance_after;
            }
        }
    }
}

/// The peer's pool (`search_path` = [`SCHEMA`], no TLS like our pool, `max_connections` like
/// ours), with postgres-es's tables created in `database_url`'s database.
pub async fn connect(database_url: &str, max_connections: u32) -> anyhow::Result<Pool<Postgres>> {
    let options = PgConnectOptions::from_str(database_url)
        .context("parsing the database URL")?
        .ssl_mode(PgSslMode::Disable)
        .options([("search_path", SCHEMA)]);
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with(options)
        .await
        .context("connecting the cqrs-es peer's pool")?;
    sqlx::raw_sql(TABLES)
        .execute(&pool)
        .await
        .context("creating postgres-es's tables")?;
    Ok(pool)
}

/// Metadata of a command, like ours (correlation id, actor).
fn metadata() -> HashMap<String, String> {
    HashMap::from([
        ("correlation_id".to_string(), Uuid::now_v7().to_string()),
        ("actor".to_string(), "bench".to_string()),
    ])
}

/// What the clients of one case saw.
#[derive(Debug, Default)]
pub struct CaseOutcome {
    /// Latency of every successful command, in microseconds.
    pub latencies_us: Vec<u64>,
    /// Commands refused with `AggregateConflict` (not retried).
    pub conflicts: u64,
    /// Any other error.
    pub other_errors: u64,
    /// The first other error, to tell what it was.
    pub first_other_error: Option<String>,
    /// Freezes not followed by a release because the freeze failed.
    pub releases_skipped: u64,
    pub elapsed: Duration,
}

impl CaseOutcome {
    /// Count a command's result; whether it succeeded.
    fn record(&mut self, result: Result<(), AggregateError<AccountError>>, sent: Instant) -> bool {
        match result {
            Ok(()) => {
                self.latencies_us.push(sent.elapsed().as_micros() as u64);
                return true;
            }
            Err(AggregateError::AggregateConflict) => self.conflicts += 1,
            Err(error) => {
                self.other_errors += 1;
                self.first_other_error
                    .get_or_insert_with(|| error.to_string());
            }
        }
        false
    }
}

/// `clients` clients doing freeze/release pairs of 1 point for `seconds`, each on its own account
/// or all on one (`hot`), each account granted 1,000,000 points first.
///
/// A client does not retry a conflict, as the crate leaves that to its caller: a failed freeze
/// leaves no hold, so the client skips that pair's release and starts a new pair; a failed release
/// leaves its hold frozen.
pub async fn run_case(
    cqrs: &Arc<PostgresCqrs<BankAccount>>,
    hot: bool,
    clients: usize,
    seconds: u64,
) -> anyhow::Result<CaseOutcome> {
    let hot_account = format!("account-{}", Uuid::now_v7());
    let accounts: Vec<String> = (0..clients)
        .map(|_| {
            if hot {
                hot_account.clone()
            } else {
                format!("account-{}", Uuid::now_v7())
            }
        })
        .collect();
    for account in &accounts {
        cqrs.execute_with_metadata(
            account,
            BankAccountCommand::Grant {
                operation_id: Uuid::now_v7(),
                amount: Amount::whole(1_000_000),
                reason: "bench".into(),
                at: chrono::Utc::now(),
            },
            metadata(),
        )
        .await
        .map_err(|error| anyhow::anyhow!("granting {account}: {error}"))?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = accounts
        .into_iter()
        .map(|account| {
            let cqrs = cqrs.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut outcome = CaseOutcome::default();
                while !stop.load(Ordering::Relaxed) {
                    let hold_id = Uuid::now_v7();
                    let sent = Instant::now();
                    let frozen = cqrs
                        .execute_with_metadata(
                            &account,
                            BankAccountCommand::Freeze {
                                hold_id,
                                amount: Amount::whole(1),
                                at: chrono::Utc::now(),
                            },
                            metadata(),
                        )
                        .await;
                    if !outcome.record(frozen, sent) {
                        outcome.releases_skipped += 1;
                        continue;
                    }
                    let sent = Instant::now();
                    let released = cqrs
                        .execute_with_metadata(
                            &account,
                            BankAccountCommand::Release {
                                hold_id,
                                reason: "bench".into(),
                                at: chrono::Utc::now(),
                            },
                            metadata(),
                        )
                        .await;
                    outcome.record(released, sent);
                }
                outcome
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut total = CaseOutcome::default();
    for task in tasks {
        let outcome = task.await?;
        total.latencies_us.extend(outcome.latencies_us);
        total.conflicts += outcome.conflicts;
        total.other_errors += outcome.other_errors;
        total.releases_skipped += outcome.releases_skipped;
        if total.first_other_error.is_none() {
            total.first_other_error = outcome.first_other_error;
        }
    }
    total.elapsed = started.elapsed();
    Ok(total)
}
