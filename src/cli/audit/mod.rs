//! `zhihui audit verify`: fold every stream again, with the domain's own `evolve`, and compare
//! the result with every read model row. Any difference is printed; the command fails if there is
//! one. The revenue stream is checked against the account streams (each settle, charge and refund
//! recorded exactly once) and conservation is checked: points in accounts + revenue + movements
//! the recorder has not reached yet = grants + credits. It reads the whole log through the
//! `EventStore` trait, so it works on either store. The task streams are checked against the
//! `tasks` read model and against the holds and fees on their owners' accounts (`tasks.rs`).

mod checkins;
mod codes;
mod gallery;
mod promotions;
mod tasks;

use std::collections::{BTreeMap, HashMap};

use anyhow::Context;
use rust_decimal::Decimal;
use uuid::Uuid;
use zhihui_domain::account::{Account, AccountEvent, AccountState};
use zhihui_domain::revenue::{LogPosition, REVENUE_STREAM, RevenueEvent, RevenueMovement};
use zhihui_domain::user::{User, UserEvent, UserState};
use zhihui_domain::{Decider, DomainEvent};
use zhihui_projections::accounts::account_user_id;

use crate::platform::event_store::{AnyEventStore, EventFilter, EventStore, RecordedEvent};

/// Events per read of the log during verification.
pub const VERIFY_READ_PAGE_MAX: usize = 5_000;

/// One disagreement between the events and a read model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub read_model: &'static str,
    pub key: String,
    pub detail: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.read_model, self.key, self.detail)
    }
}

#[derive(Default)]
struct FoldedAccount {
    state: AccountState,
    version: u64,
    /// (stream version -> available after, frozen after) as the events say.
    entries: BTreeMap<u64, (Decimal, Decimal)>,
}

/// What a movement does to the revenue total.
fn signed(movement: RevenueMovement, amount: Decimal) -> Decimal {
    match movement {
        RevenueMovement::Refunded => -amount,
        RevenueMovement::HoldSettled | RevenueMovement::Charged => amount,
    }
}

/// The revenue account against the account streams.
#[derive(Default)]
struct RevenueFold {
    /// Grants and credits: the only ways points enter.
    inflow: Decimal,
    /// Settles, charges and refunds of the account streams, by event id.
    movements: HashMap<Uuid, (RevenueMovement, Decimal, LogPosition)>,
    /// What the revenue stream recorded, by source event id.
    recorded: HashMap<Uuid, (RevenueMovement, Decimal)>,
    /// The revenue total folded from its amounts, and what its events claim after each.
    total: Decimal,
    claimed_totals_wrong: Vec<(Uuid, Decimal, Decimal)>,
    recorded_through: Option<LogPosition>,
    recorded_twice: Vec<Uuid>,
}

impl RevenueFold {
    fn account_event(&mut self, recorded: &RecordedEvent, event: &AccountEvent) {
        if matches!(event, AccountEvent::Granted(_) | AccountEvent::Credited(_)) {
            self.inflow += event.amount().as_decimal();
        }
        let Some(movement) = crate::points::revenue::revenue_movement(event) else {
            return;
        };
        self.movements.insert(
            recorded.id,
            (
                movement,
                event.amount().as_decimal(),
                crate::points::revenue::to_log_position(recorded.position),
            ),
        );
    }

    fn revenue_event(&mut self, event: RevenueEvent) {
        let RevenueEvent::Recorded(recorded) = event;
        let amount = recorded.amount.as_decimal();
        self.total += signed(recorded.movement, amount);
        if recorded.total_after.as_decimal() != self.total {
            self.claimed_totals_wrong.push((
                recorded.source_event_id,
                recorded.total_after.as_decimal(),
                self.total,
            ));
        }
        self.recorded_through = Some(recorded.source_position);
        if self
            .recorded
            .insert(recorded.source_event_id, (recorded.movement, amount))
            .is_some()
        {
            self.recorded_twice.push(recorded.source_event_id);
        }
    }

    /// Every movement up to the recorder's position is recorded once and as it happened; the
    /// points in accounts, the revenue and the movements not yet recorded add up to the inflow.
    fn compare(&self, in_accounts: Decimal, differences: &mut Vec<Difference>) {
        let mut pending = Decimal::ZERO;
        for (event_id, (movement, amount, position)) in &self.movements {
            match self.recorded.get(event_id) {
                Some(recorded) if *recorded == (*movement, *amount) => {}
                Some(recorded) => differences.push(Difference {
                    read_model: "revenue",
                    key: event_id.to_string(),
                    detail: format!(
                        "recorded as {recorded:?}; the account event is {movement:?} of {amount}"
                    ),
                }),
                None if self
                    .recorded_through
                    .is_some_and(|through| *position <= through) =>
                {
                    differences.push(Difference {
                        read_model: "revenue",
                        key: event_id.to_string(),
                        detail: format!("{movement:?} of {amount} was never recorded"),
                    })
                }
                None => {
                    // Not reached by the recorder yet.
                    pending += signed(*movement, *amount);
                }
            }
        }
        for event_id in self.recorded.keys() {
            if !self.movements.contains_key(event_id) {
                differences.push(Difference {
                    read_model: "revenue",
                    key: event_id.to_string(),
                    detail: "recorded without an account event".into(),
                });
            }
        }
        for event_id in &self.recorded_twice {
            differences.push(Difference {
                read_model: "revenue",
                key: event_id.to_string(),
                detail: "recorded more than once".into(),
            });
        }
        for (event_id, claimed, folded) in &self.claimed_totals_wrong {
            differences.push(Difference {
                read_model: "revenue",
                key: event_id.to_string(),
                detail: format!("total_after says {claimed}; the amounts add up to {folded}"),
            });
        }
        if in_accounts + self.total + pending != self.inflow {
            differences.push(Difference {
                read_model: "revenue",
                key: "conservation".into(),
                detail: format!(
                    "accounts hold {in_accounts}, revenue {}, not yet recorded {pending}: \
                     together they differ from the {} granted and credited",
                    self.total, self.inflow
                ),
            });
        }
    }
}

/// What `verify` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub events_read: u64,
    pub differences: Vec<Difference>,
    /// Tasks, holds and fees whose settlement is due but still within the bound (a request or a
    /// dispatcher between two streams right now, or one that died and awaits the sweeper).
    pub pending_settlements: usize,
}

/// How long a settlement may take before its absence is a difference: the intent sweeper
/// resolves a request that died between two streams within `intent_resolve_after_ms +
/// intent_sweep_interval_ms`.
pub fn settlement_bound(
    settings: &crate::platform::configuration::TaskSettings,
) -> chrono::Duration {
    let bound_ms = settings
        .intent_resolve_after_ms
        .saturating_add(settings.intent_sweep_interval_ms);
    chrono::Duration::milliseconds(i64::try_from(bound_ms).unwrap_or(i64::MAX))
}

/// Fold the log and compare with `accounts`, `ledger_entries`, `users`, `tasks` (and its per-user
/// waiting counts), and every
/// task with its hold and fees; a settlement missing for longer than `settle_within` is a
/// difference.
pub async fn verify(
    store: &AnyEventStore,
    client: &tokio_postgres::Client,
    settle_within: chrono::Duration,
) -> anyhow::Result<Verified> {
    let mut accounts: HashMap<Uuid, FoldedAccount> = HashMap::new();
    let mut users: HashMap<Uuid, (UserState, u64)> = HashMap::new();
    let mut revenue = RevenueFold::default();
    let mut task_fold = tasks::TaskFold::default();
    let mut code_fold = codes::CodeFold::default();
    let mut checkin_fold = checkins::CheckInFold::default();
    let mut promotion_fold = promotions::PromotionFold::default();
    let mut gallery_fold = gallery::GalleryFold::default();
    let filter = EventFilter::StreamPrefixes(vec![
        "account-".into(),
        "user-".into(),
        "task-".into(),
        REVENUE_STREAM.into(),
        "codebatch-".into(),
        "code-".into(),
        "checkin-".into(),
        "promotion-".into(),
        "work-".into(),
        "like-".into(),
        "follow-".into(),
        "block-".into(),
        "report-".into(),
    ]);
    let mut after = None;
    let mut events_read = 0u64;
    loop {
        let slice = store
            .read_all(after, VERIFY_READ_PAGE_MAX, &filter)
            .await
            .context("reading the log")?;
        for recorded in &slice.events {
            events_read += 1;
            if gallery_fold
                .event(recorded)
                .with_context(|| format!("decoding event {}", recorded.id))?
            {
                continue;
            }
            if let Some(user_id) = account_user_id(&recorded.stream) {
                let event = AccountEvent::from_stored(
                    &recorded.event_type,
                    recorded.schema_version,
                    &recorded.payload,
                )
                .with_context(|| format!("decoding event {}", recorded.id))?;
                revenue.account_event(recorded, &event);
                task_fold.account_event(user_id, recorded, &event);
                code_fold.account_event(user_id, recorded.id, &event);
                checkin_fold.account_event(user_id, &event);
                promotion_fold.account_event(user_id, &event);
                let folded = accounts.entry(user_id).or_default();
                let state = std::mem::take(&mut folded.state);
                folded.state = Account::evolve(state, &event);
                folded.version = recorded.stream_version;
                // The ledger must show what a fresh fold gives, whatever the event claims.
                folded.entries.insert(
                    recorded.stream_version,
                    (
                        folded.state.balance.available.as_decimal(),
                        folded.state.balance.frozen.as_decimal(),
                    ),
                );
            } else if let Some(task_id) = zhihui_domain::task::task_id_of_stream(&recorded.stream) {
                task_fold.task_event(task_id, recorded, &tasks::decode(recorded)?);
            } else if let Some(batch_id) =
                zhihui_domain::redeem::batch_id_of_stream(&recorded.stream)
            {
                code_fold
                    .batch_event(batch_id, recorded)
                    .with_context(|| format!("decoding event {}", recorded.id))?;
            } else if zhihui_domain::redeem::serial_of_stream(&recorded.stream).is_some() {
                code_fold
                    .code_event(recorded)
                    .with_context(|| format!("decoding event {}", recorded.id))?;
            } else if let Some(user_id) =
                zhihui_domain::checkin::user_of_checkin_stream(&recorded.stream)
            {
                checkin_fold
                    .checkin_event(user_id.as_uuid(), recorded)
                    .with_context(|| format!("decoding event {}", recorded.id))?;
            } else if let Some(promotion_id) =
                zhihui_domain::promotion::promotion_of_stream(&recorded.stream)
            {
                promotion_fold
                    .promotion_event(promotion_id, recorded)
                    .with_context(|| format!("decoding event {}", recorded.id))?;
            } else if recorded.stream == REVENUE_STREAM {
                let event = RevenueEvent::from_stored(
                    &recorded.event_type,
                    recorded.schema_version,
                    &recorded.payload,
                )
                .with_context(|| format!("decoding event {}", recorded.id))?;
                revenue.revenue_event(event);
            } else if let Some(user_id) = recorded
                .stream
                .strip_prefix("user-")
                .and_then(|id| Uuid::parse_str(id).ok())
            {
                let event = UserEvent::from_stored(
                    &recorded.event_type,
                    recorded.schema_version,
                    &recorded.payload,
                )
                .with_context(|| format!("decoding event {}", recorded.id))?;
                let entry = users
                    .entry(user_id)
                    .or_insert_with(|| (User::initial_state(), 0));
                let state = std::mem::replace(&mut entry.0, UserState::Unregistered);
                entry.0 = User::evolve(state, &event);
                entry.1 = recorded.stream_version;
            }
        }
        after = slice.scanned_to.or(after);
        if slice.end_of_log {
            break;
        }
    }

    let mut differences = Vec::new();
    let rows = client
        .query(
            "SELECT user_id, available, frozen, stream_version FROM accounts",
            &[],
        )
        .await
        .context("reading accounts")?;
    let mut seen = std::collections::HashSet::new();
    for row in rows {
        let user_id: Uuid = row.get(0);
        seen.insert(user_id);
        let (available, frozen, version): (Decimal, Decimal, i64) =
            (row.get(1), row.get(2), row.get(3));
        match accounts.get(&user_id) {
            None => differences.push(Difference {
                read_model: "accounts",
                key: user_id.to_string(),
                detail: "row without any event".into(),
            }),
            Some(folded) => {
                let expected = (
                    folded.state.balance.available.as_decimal(),
                    folded.state.balance.frozen.as_decimal(),
                    i64::try_from(folded.version)?,
                );
                if (available, frozen, version) != expected {
                    differences.push(Difference {
                        read_model: "accounts",
                        key: user_id.to_string(),
                        detail: format!(
                            "row says available {available}, frozen {frozen} at version {version}; \
                             the events say available {}, frozen {} at version {}",
                            expected.0, expected.1, expected.2
                        ),
                    });
                }
            }
        }
    }
    for user_id in accounts.keys().filter(|id| !seen.contains(id)) {
        differences.push(Difference {
            read_model: "accounts",
            key: user_id.to_string(),
            detail: "events without a row".into(),
        });
    }

    let rows = client
        .query(
            "SELECT user_id, stream_version, available_after, frozen_after FROM ledger_entries",
            &[],
        )
        .await
        .context("reading ledger entries")?;
    let mut ledger_seen = std::collections::HashSet::new();
    for row in rows {
        let user_id: Uuid = row.get(0);
        let version = u64::try_from(row.get::<_, i64>(1))?;
        ledger_seen.insert((user_id, version));
        let shown: (Decimal, Decimal) = (row.get(2), row.get(3));
        match accounts
            .get(&user_id)
            .and_then(|folded| folded.entries.get(&version))
        {
            None => differences.push(Difference {
                read_model: "ledger_entries",
                key: format!("{user_id} #{version}"),
                detail: "entry without an event".into(),
            }),
            Some(expected) if *expected != shown => differences.push(Difference {
                read_model: "ledger_entries",
                key: format!("{user_id} #{version}"),
                detail: format!(
                    "entry says available {} frozen {} after; the events say {} and {}",
                    shown.0, shown.1, expected.0, expected.1
                ),
            }),
            Some(_) => {}
        }
    }
    for (user_id, folded) in &accounts {
        for version in folded.entries.keys() {
            if !ledger_seen.contains(&(*user_id, *version)) {
                differences.push(Difference {
                    read_model: "ledger_entries",
                    key: format!("{user_id} #{version}"),
                    detail: "event without an entry".into(),
                });
            }
        }
    }

    let rows = client
        .query("SELECT user_id, username, phone, role FROM users", &[])
        .await
        .context("reading users")?;
    let mut users_seen = std::collections::HashSet::new();
    for row in rows {
        let user_id: Uuid = row.get(0);
        users_seen.insert(user_id);
        let shown: (Option<String>, Option<String>, String) = (row.get(1), row.get(2), row.get(3));
        let expected = match users.get(&user_id) {
            Some((UserState::Registered(user), _)) => Some((
                user.username.as_ref().map(|name| name.as_str().to_owned()),
                user.phone.as_ref().map(|phone| phone.as_str().to_owned()),
                user.role.as_str().to_owned(),
            )),
            _ => None,
        };
        if expected.as_ref() != Some(&shown) {
            differences.push(Difference {
                read_model: "users",
                key: user_id.to_string(),
                detail: format!("row says {shown:?}; the events say {expected:?}"),
            });
        }
    }
    for (user_id, (state, _)) in &users {
        if matches!(state, UserState::Registered(_)) && !users_seen.contains(user_id) {
            differences.push(Difference {
                read_model: "users",
                key: user_id.to_string(),
                detail: "registered in the events, missing from the table".into(),
            });
        }
    }
    let in_accounts = accounts.values().fold(Decimal::ZERO, |sum, folded| {
        sum + folded.state.balance.available.as_decimal() + folded.state.balance.frozen.as_decimal()
    });
    revenue.compare(in_accounts, &mut differences);

    let rows = client
        .query(
            &format!("SELECT {} FROM tasks", tasks::TaskRow::COLUMNS),
            &[],
        )
        .await
        .context("reading tasks")?;
    let task_rows = rows
        .iter()
        .map(tasks::TaskRow::from_row)
        .collect::<anyhow::Result<HashMap<_, _>>>()
        .context("reading a task row")?;
    let counted = client
        .query("SELECT user_id, waiting FROM tasks_waiting", &[])
        .await
        .context("reading tasks_waiting")?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect::<HashMap<Uuid, i32>>();
    task_fold.compare_waiting(&counted, &mut differences);
    // The database's clock: the one `recorded_at` was taken with.
    let now: chrono::DateTime<chrono::Utc> = client
        .query_one("SELECT now()", &[])
        .await
        .context("reading the database's clock")?
        .get(0);
    let pending_credits = code_fold
        .compare(client, now, settle_within, &mut differences)
        .await?;
    let pending_bonuses = checkin_fold
        .compare(client, now, settle_within, &mut differences)
        .await?;
    let pending_claims = promotion_fold
        .compare(client, now, settle_within, &mut differences)
        .await?;
    gallery_fold.compare(client, &mut differences).await?;
    let pending_settlements = pending_credits
        + pending_bonuses
        + pending_claims
        + task_fold.compare(
            &task_rows,
            accounts
                .iter()
                .map(|(user_id, folded)| (*user_id, &folded.state)),
            now,
            settle_within,
            &mut differences,
        );
    differences.sort_by(|a, b| (a.read_model, &a.key).cmp(&(b.read_model, &b.key)));
    Ok(Verified {
        events_read,
        differences,
        pending_settlements,
    })
}
