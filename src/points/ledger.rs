//! An account's ledger as people read it: every movement of its points, folded from the
//! account's stream (never a read model), for `zhihui audit account` and the admin's user page.

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::{AccountEvent, account_stream};
use zhihui_domain::user::UserId;
use zhihui_projections::accounts::{kind_of, reason_of};

use crate::platform::event_store::{AnyEventStore, RecordedEvent, read_whole_stream};

/// One movement as `audit account` (and the admin pages' audit) shows it.
#[derive(Debug, Serialize)]
pub struct Movement {
    pub version: u64,
    pub at: DateTime<Utc>,
    pub kind: &'static str,
    pub amount: String,
    pub available_after: String,
    pub frozen_after: String,
    /// The hold (task) or operation the movement belongs to.
    pub reference: Uuid,
    pub reason: Option<String>,
    /// Who moved it (`admin:<id>`, `user:<id>`, `system:...`).
    pub actor: String,
    pub correlation_id: Uuid,
    pub event_id: Uuid,
}

/// Every movement of `user_id`'s account from its events, oldest first, filtered.
pub async fn account_movements(
    store: &AnyEventStore,
    user_id: UserId,
    since: Option<DateTime<Utc>>,
    kind: Option<&str>,
) -> anyhow::Result<Vec<Movement>> {
    let events = read_whole_stream(store, &account_stream(user_id)).await?;
    let mut movements = Vec::new();
    for recorded in &events {
        let movement = movement(recorded)?;
        if since.is_some_and(|since| movement.at < since)
            || kind.is_some_and(|k| movement.kind != k)
        {
            continue;
        }
        movements.push(movement);
    }
    Ok(movements)
}

fn movement(recorded: &RecordedEvent) -> anyhow::Result<Movement> {
    let event = AccountEvent::from_stored(
        &recorded.event_type,
        recorded.schema_version,
        &recorded.payload,
    )
    .with_context(|| format!("decoding event {}", recorded.id))?;
    let after = event.balance_after();
    Ok(Movement {
        version: recorded.stream_version,
        at: event.at(),
        kind: kind_of(&event),
        amount: event.amount().to_string(),
        available_after: after.available.to_string(),
        frozen_after: after.frozen.to_string(),
        reference: event.reference_id(),
        reason: reason_of(&event),
        actor: recorded.metadata.actor.clone(),
        correlation_id: recorded.metadata.correlation_id,
        event_id: recorded.id,
    })
}
