//! `accounts` (one row per account: available, frozen) and `ledger_entries` (one row per movement)
//! from the account streams.
//!
//! A batch is written with two statements whatever its size: every ledger row in one `unnest`
//! insert, and the last balance of each account in one `unnest` upsert. That is what lets replay
//! run far above one round trip per event.

use std::collections::HashMap;

use anyhow::Context;
use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::AccountEvent;

use crate::{ProjectedEvent, Tables};

/// The user id of an account stream (`account-<uuid>`).
pub fn account_user_id(stream: &str) -> Option<Uuid> {
    zhihui_domain::account::user_of_account_stream(stream).map(|user| user.as_uuid())
}

/// The ledger's name for each movement.
pub fn kind_of(event: &AccountEvent) -> &'static str {
    match event {
        AccountEvent::Granted(_) => "grant",
        AccountEvent::Frozen(_) => "freeze",
        AccountEvent::HoldSettled(_) => "deduct",
        AccountEvent::HoldReleased(_) => "return",
        AccountEvent::Charged(_) => "charge",
        AccountEvent::Refunded(_) => "refund",
        AccountEvent::Credited(e) => match e.kind {
            zhihui_domain::account::CreditKind::RedeemCode => "redeem_code",
            zhihui_domain::account::CreditKind::CheckInBonus => "check_in_bonus",
            zhihui_domain::account::CreditKind::Promotion => "promotion",
        },
    }
}

/// Whether a movement belongs to a hold (its reference is a task id) or to an operation.
pub fn is_hold(event: &AccountEvent) -> bool {
    matches!(
        event,
        AccountEvent::Frozen(_) | AccountEvent::HoldSettled(_) | AccountEvent::HoldReleased(_)
    )
}

/// The reason or reference a movement carries, as the ledger shows it.
pub fn reason_of(event: &AccountEvent) -> Option<String> {
    match event {
        AccountEvent::Granted(e) => Some(e.reason.clone()),
        AccountEvent::HoldReleased(e) => Some(e.reason.clone()),
        AccountEvent::Charged(e) => Some(e.reason.clone()),
        AccountEvent::Refunded(e) => Some(e.reason.clone()),
        AccountEvent::Credited(e) => Some(e.reference.clone()),
        AccountEvent::Frozen(_) | AccountEvent::HoldSettled(_) => None,
    }
}

#[derive(Debug, Default)]
struct LedgerColumns {
    user_id: Vec<Uuid>,
    stream_version: Vec<i64>,
    event_id: Vec<Uuid>,
    occurred_at: Vec<DateTime<Utc>>,
    kind: Vec<&'static str>,
    amount: Vec<Decimal>,
    available_after: Vec<Decimal>,
    frozen_after: Vec<Decimal>,
    task_id: Vec<Option<Uuid>>,
    operation_id: Vec<Option<Uuid>>,
    reason: Vec<Option<String>>,
    actor: Vec<String>,
    correlation_id: Vec<Uuid>,
}

#[derive(Debug)]
struct LastBalance {
    available: Decimal,
    frozen: Decimal,
    stream_version: i64,
    updated_at: DateTime<Utc>,
}

/// A batch folded into rows: one ledger row per movement, each account's last balance.
#[derive(Debug, Default)]
pub struct LedgerRows {
    ledger: LedgerColumns,
    balances: HashMap<Uuid, LastBalance>,
}

impl LedgerRows {
    /// Ledger rows folded.
    pub fn len(&self) -> usize {
        self.ledger.user_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ledger.user_id.is_empty()
    }
}

pub async fn apply(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    events: &[ProjectedEvent],
) -> anyhow::Result<()> {
    let rows = fold(events)?;
    write(transaction, tables, &rows).await
}

/// Decode a batch and fold it into rows (no IO: a replay runs it beside the previous batch's
/// write).
pub fn fold(events: &[ProjectedEvent]) -> anyhow::Result<LedgerRows> {
    let mut ledger = LedgerColumns::default();
    let mut balances: HashMap<Uuid, LastBalance> = HashMap::new();
    for recorded in events {
        let Some(user_id) = account_user_id(&recorded.stream) else {
            continue;
        };
        let event = AccountEvent::from_stored(
            &recorded.event_type,
            recorded.schema_version,
            &recorded.payload,
        )
        .with_context(|| {
            format!(
                "event {} ({} #{} of {})",
                recorded.id, recorded.event_type, recorded.stream_version, recorded.stream
            )
        })?;
        let stream_version = i64::try_from(recorded.stream_version)?;
        let after = event.balance_after();
        let is_hold = is_hold(&event);
        ledger.user_id.push(user_id);
        ledger.stream_version.push(stream_version);
        ledger.event_id.push(recorded.id);
        ledger.occurred_at.push(event.at());
        ledger.kind.push(kind_of(&event));
        ledger.amount.push(event.amount().as_decimal());
        ledger.available_after.push(after.available.as_decimal());
        ledger.frozen_after.push(after.frozen.as_decimal());
        ledger.task_id.push(is_hold.then(|| event.reference_id()));
        ledger
            .operation_id
            .push((!is_hold).then(|| event.reference_id()));
        ledger.reason.push(reason_of(&event));
        ledger.actor.push(recorded.actor.clone());
        ledger.correlation_id.push(recorded.correlation_id);
        balances.insert(
            user_id,
            LastBalance {
                available: after.available.as_decimal(),
                frozen: after.frozen.as_decimal(),
                stream_version,
                updated_at: recorded.recorded_at,
            },
        );
    }
    Ok(LedgerRows { ledger, balances })
}

/// Write folded rows: two statements, pipelined.
pub async fn write(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    rows: &LedgerRows,
) -> anyhow::Result<()> {
    let LedgerRows { ledger, balances } = rows;
    if ledger.user_id.is_empty() {
        return Ok(());
    }
    // ON CONFLICT DO NOTHING: a row already there is this very event (the event id is unique).
    let insert_ledger = format!(
        "INSERT INTO {ledger} (user_id, stream_version, event_id, occurred_at, kind, amount,
                               available_after, frozen_after, task_id, operation_id, reason, actor,
                               correlation_id)
         SELECT * FROM unnest($1::uuid[], $2::bigint[], $3::uuid[], $4::timestamptz[], $5::text[],
                              $6::numeric[], $7::numeric[], $8::numeric[], $9::uuid[], $10::uuid[],
                              $11::text[], $12::text[], $13::uuid[])
         ON CONFLICT DO NOTHING",
        ledger = tables.name("ledger_entries")
    );
    let ledger_params: [&(dyn tokio_postgres::types::ToSql + Sync); 13] = [
        &ledger.user_id,
        &ledger.stream_version,
        &ledger.event_id,
        &ledger.occurred_at,
        &ledger.kind,
        &ledger.amount,
        &ledger.available_after,
        &ledger.frozen_after,
        &ledger.task_id,
        &ledger.operation_id,
        &ledger.reason,
        &ledger.actor,
        &ledger.correlation_id,
    ];
    let insert_ledger = transaction.execute(&insert_ledger, &ledger_params);

    let mut user_ids = Vec::with_capacity(balances.len());
    let mut available = Vec::with_capacity(balances.len());
    let mut frozen = Vec::with_capacity(balances.len());
    let mut versions = Vec::with_capacity(balances.len());
    let mut updated = Vec::with_capacity(balances.len());
    for (user_id, balance) in balances {
        user_ids.push(*user_id);
        available.push(balance.available);
        frozen.push(balance.frozen);
        versions.push(balance.stream_version);
        updated.push(balance.updated_at);
    }
    let upsert_accounts = format!(
        "INSERT INTO {accounts} AS a (user_id, available, frozen, stream_version, updated_at)
         SELECT * FROM unnest($1::uuid[], $2::numeric[], $3::numeric[], $4::bigint[],
                              $5::timestamptz[])
         ON CONFLICT (user_id) DO UPDATE
            SET available = EXCLUDED.available, frozen = EXCLUDED.frozen,
                stream_version = EXCLUDED.stream_version, updated_at = EXCLUDED.updated_at
          WHERE a.stream_version < EXCLUDED.stream_version",
        accounts = tables.name("accounts")
    );
    let account_params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
        [&user_ids, &available, &frozen, &versions, &updated];
    let upsert_accounts = transaction.execute(&upsert_accounts, &account_params);
    if tables.is_rebuild() {
        // A rebuild applies each event once (its rows and checkpoint commit together) into a
        // table loaded before its keys are built: a binary COPY, the cheapest way in.
        drop(insert_ledger);
        copy_ledger(transaction, &tables.name("ledger_entries"), ledger).await?;
        upsert_accounts
            .await
            .context("upserting account balances")?;
        return Ok(());
    }
    // Issued together, tokio-postgres pipelines the two statements (each prepared, then run)
    // instead of waiting for one before sending the other.
    let (inserted, upserted) = futures::join!(insert_ledger, upsert_accounts);
    inserted.context("inserting ledger entries")?;
    upserted.context("upserting account balances")?;
    Ok(())
}

/// The ledger's rows into `table` by `COPY ... FROM STDIN BINARY`.
async fn copy_ledger(
    transaction: &tokio_postgres::Transaction<'_>,
    table: &str,
    ledger: &LedgerColumns,
) -> anyhow::Result<()> {
    use tokio_postgres::binary_copy::BinaryCopyInWriter;
    use tokio_postgres::types::Type;
    let sink = transaction
        .copy_in(&format!(
            "COPY {table} (user_id, stream_version, event_id, occurred_at, kind, amount,
                           available_after, frozen_after, task_id, operation_id, reason, actor,
                           correlation_id) FROM STDIN BINARY"
        ))
        .await
        .context("starting the ledger's COPY")?;
    let writer = BinaryCopyInWriter::new(
        sink,
        &[
            Type::UUID,
            Type::INT8,
            Type::UUID,
            Type::TIMESTAMPTZ,
            Type::TEXT,
            Type::NUMERIC,
            Type::NUMERIC,
            Type::NUMERIC,
            Type::UUID,
            Type::UUID,
            Type::TEXT,
            Type::TEXT,
            Type::UUID,
        ],
    );
    futures::pin_mut!(writer);
    for row in 0..ledger.user_id.len() {
        writer
            .as_mut()
            .write(&[
                &ledger.user_id[row],
                &ledger.stream_version[row],
                &ledger.event_id[row],
                &ledger.occurred_at[row],
                &ledger.kind[row],
                &ledger.amount[row],
                &ledger.available_after[row],
                &ledger.frozen_after[row],
                &ledger.task_id[row],
                &ledger.operation_id[row],
                &ledger.reason[row],
                &ledger.actor[row],
                &ledger.correlation_id[row],
            ])
            .await
            .context("copying a ledger row")?;
    }
    writer
        .finish()
        .await
        .context("finishing the ledger's COPY")?;
    Ok(())
}
