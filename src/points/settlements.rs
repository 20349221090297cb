//! The settlement reconciler: the process manager that makes sure every finished task's hold is
//! settled or released and every abandoned prioritise's fee refunded, whatever died on the way.
//!
//! The normal paths (a cancel, the dispatcher recording an end, the intent sweeper) settle within
//! moments. The reconciler is the net under them: it reads the `open_settlements` read model
//! (projection `settlements`) for holds still open `tasks.settlement_after_ms` after their task
//! ended, and fees still charged that long after their prioritise was abandoned, and runs
//! [`TaskService::reconcile_reporting`] on each: the task stream decides what is owed, the account
//! decides on its latest version, every command is idempotent, so racing the normal path is
//! harmless. What it appended itself is a repair: logged with the task id, counted, and kept in
//! `settlement_repairs` (`zhihui audit repairs`). A row it cannot repair (a hold settled the wrong
//! way, an account that refuses) is logged and left for `audit verify` to report.
//!
//! It also credits redeemed codes whose credit never came (the request died between the code's
//! stream and the account): `redeem_codes` rows redeemed `tasks.settlement_after_ms` ago and not
//! credited are credited from the code's stream (idempotent by the serial's operation id), and
//! recorded as `code_credited` repairs. Likewise check-in bonuses: `checkins` rows not credited
//! that long after the check-in are credited from the check-in stream (idempotent by the user and
//! day), as `bonus_credited` repairs.
//!
//! One leader across processes (`src/platform/leader.rs`); a second reconciler that slipped past the lock
//! would only repeat idempotent commands.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use serde::Serialize;
use uuid::Uuid;
use zhihui_domain::user::UserId;

use crate::platform::clock::Clock;
use crate::points::checkins::CheckInService;
use crate::points::codes::CodeService;
use crate::points::promotions::PromotionService;
use crate::tasks::service::TaskService;

/// Owed settlements handled per pass: bounds one pass's work (the rest come next pass).
pub const SETTLEMENTS_PER_PASS_MAX: i64 = 200;
/// The actor written into the metadata of the reconciler's account events.
pub const RECONCILER_ACTOR: &str = "system:settlement-reconciler";
/// Name of the leader lock.
const LEADER_NAME: &str = "settlement-reconciler";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RepairKind {
    HoldSettled,
    HoldReleased,
    FeeRefunded,
    CodeCredited,
    BonusCredited,
    ClaimSettled,
}

impl RepairKind {
    pub const ALL: [RepairKind; 6] = [
        RepairKind::HoldSettled,
        RepairKind::HoldReleased,
        RepairKind::FeeRefunded,
        RepairKind::CodeCredited,
        RepairKind::BonusCredited,
        RepairKind::ClaimSettled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RepairKind::HoldSettled => "hold_settled",
            RepairKind::HoldReleased => "hold_released",
            RepairKind::FeeRefunded => "fee_refunded",
            RepairKind::CodeCredited => "code_credited",
            RepairKind::BonusCredited => "bonus_credited",
            RepairKind::ClaimSettled => "claim_settled",
        }
    }

    fn parse(text: &str) -> anyhow::Result<RepairKind> {
        [
            RepairKind::HoldSettled,
            RepairKind::HoldReleased,
            RepairKind::FeeRefunded,
            RepairKind::CodeCredited,
            RepairKind::BonusCredited,
            RepairKind::ClaimSettled,
        ]
        .into_iter()
        .find(|kind| kind.as_str() == text)
        .with_context(|| format!("unknown repair kind {text}"))
    }
}

/// One account movement the reconciler made itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Repair {
    pub kind: RepairKind,
    /// The task, for a hold or a fee.
    pub task_id: Option<Uuid>,
    /// The prioritise, for a refunded fee.
    pub operation_id: Option<Uuid>,
    /// The code's serial, for a code credit.
    pub code_serial: Option<u32>,
    /// The day checked in, for a check-in bonus.
    pub checkin_day: Option<chrono::NaiveDate>,
    /// The claim, for a promotion claim finished.
    pub claim_id: Option<Uuid>,
    pub user_id: Uuid,
    /// When the settlement became owed (the task's end, the prioritise's abandonment, the
    /// code's redemption).
    pub due_since: DateTime<Utc>,
    pub repaired_at: DateTime<Utc>,
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Owed rows looked at.
    pub examined: usize,
    pub repairs: Vec<Repair>,
    /// Rows whose reconcile failed (logged; tried again next pass).
    pub failures: usize,
}

#[derive(Debug, Clone)]
pub struct SettlementReconciler {
    tasks: TaskService,
    codes: CodeService,
    checkins: CheckInService,
    promotions: PromotionService,
    pool: Pool,
    clock: Clock,
    after: Duration,
    interval: Duration,
    /// Repairs made by this process since it started (a metric once metrics exist).
    repairs_total: Arc<AtomicU64>,
}

impl SettlementReconciler {
    pub fn new(
        tasks: TaskService,
        codes: CodeService,
        checkins: CheckInService,
        promotions: PromotionService,
        pool: Pool,
        clock: Clock,
    ) -> SettlementReconciler {
        let settings = tasks.settings();
        SettlementReconciler {
            codes,
            checkins,
            promotions,
            after: Duration::from_millis(settings.settlement_after_ms),
            interval: Duration::from_millis(settings.settlement_interval_ms),
            tasks,
            pool,
            clock,
            repairs_total: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn repairs_total(&self) -> u64 {
        self.repairs_total.load(Ordering::Relaxed)
    }

    /// One pass: every settlement owed for longer than `settlement_after_ms` (as far as the
    /// `settlements` projection has seen), reconciled from the streams.
    pub async fn reconcile_once(&self) -> anyhow::Result<PassReport> {
        let cutoff = self.clock.now()
            - chrono::Duration::from_std(self.after).context("tasks.settlement_after_ms")?;
        let rows = {
            let client = self.pool.get().await.context("getting a connection")?;
            client
                .query(
                    "SELECT kind, id, task_id, user_id, due_since FROM open_settlements
                      WHERE opened AND due_since IS NOT NULL AND due_since <= $1
                      ORDER BY due_since LIMIT $2",
                    &[&cutoff, &SETTLEMENTS_PER_PASS_MAX],
                )
                .await
                .context("reading owed settlements")?
        };
        let mut report = PassReport {
            examined: rows.len(),
            ..PassReport::default()
        };
        for row in rows {
            let kind: String = row.get(0);
            let id: Uuid = row.get(1);
            let task_id: Uuid = row.get(2);
            let user_id: Uuid = row.get(3);
            let due_since: DateTime<Utc> = row.get(4);
            let operation_id = (kind == "fee").then_some(id);
            let reconciled = self
                .tasks
                .reconcile_reporting(
                    task_id,
                    UserId::from_uuid(user_id),
                    operation_id,
                    Uuid::now_v7(),
                    RECONCILER_ACTOR,
                )
                .await;
            let moves = match reconciled {
                Ok((_state, moves)) => moves,
                Err(error) => {
                    tracing::warn!(%task_id, ?operation_id, error = %crate::platform::telemetry::error_chain(&error), "settlement reconciler could not repair");
                    report.failures += 1;
                    continue;
                }
            };
            let made = [
                (moves.hold_settled, RepairKind::HoldSettled),
                (moves.hold_released, RepairKind::HoldReleased),
                (moves.fee_refunded, RepairKind::FeeRefunded),
            ];
            for (happened, repair_kind) in made {
                if !happened {
                    continue;
                }
                let repair = Repair {
                    kind: repair_kind,
                    task_id: Some(task_id),
                    operation_id: (repair_kind == RepairKind::FeeRefunded)
                        .then_some(operation_id)
                        .flatten(),
                    code_serial: None,
                    checkin_day: None,
                    claim_id: None,
                    user_id,
                    due_since,
                    repaired_at: self.clock.now(),
                };
                self.record(&repair).await?;
                self.repairs_total.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("zhihui_settlement_repairs_total", "kind" => repair_kind.as_str())
                    .increment(1);
                tracing::warn!(%task_id, kind = repair_kind.as_str(), %user_id, %due_since, "settlement reconciler repaired a settlement");
                report.repairs.push(repair);
            }
        }
        self.repair_credits(&mut report).await?;
        Ok(report)
    }

    /// Credits that a request died before making: redeemed codes, then check-in bonuses. Each
    /// source's failure is counted and left for the next pass; the other still runs.
    async fn repair_credits(&self, report: &mut PassReport) -> anyhow::Result<()> {
        let metadata = crate::platform::event_store::EventMetadata {
            correlation_id: Uuid::now_v7(),
            causation_id: None,
            actor: RECONCILER_ACTOR.into(),
        };
        let after = chrono::Duration::from_std(self.after).context("tasks.settlement_after_ms")?;
        let now = self.clock.now();
        let codes = self
            .codes
            .repair_credits_once(after, SETTLEMENTS_PER_PASS_MAX, &metadata)
            .await
            .map(|credited| {
                credited
                    .into_iter()
                    .map(|(serial, user_id, redeemed_at)| Repair {
                        kind: RepairKind::CodeCredited,
                        task_id: None,
                        operation_id: Some(zhihui_domain::redeem::credit_operation_id(serial)),
                        code_serial: Some(serial),
                        checkin_day: None,
                        claim_id: None,
                        user_id,
                        due_since: redeemed_at,
                        repaired_at: now,
                    })
                    .collect::<Vec<_>>()
            });
        let bonuses = self
            .checkins
            .repair_credits_once(after, SETTLEMENTS_PER_PASS_MAX, &metadata)
            .await
            .map(|credited| {
                credited
                    .into_iter()
                    .map(|(user_id, day, checked_in_at)| Repair {
                        kind: RepairKind::BonusCredited,
                        task_id: None,
                        operation_id: Some(zhihui_domain::checkin::bonus_operation_id(
                            UserId::from_uuid(user_id),
                            day,
                        )),
                        code_serial: None,
                        checkin_day: Some(day),
                        claim_id: None,
                        user_id,
                        due_since: checked_in_at,
                        repaired_at: now,
                    })
                    .collect::<Vec<_>>()
            });
        let claims = self
            .promotions
            .repair_once(after, SETTLEMENTS_PER_PASS_MAX)
            .await
            .map(|finished| {
                finished
                    .into_iter()
                    .map(|(claim_id, user_id, accepted_at)| Repair {
                        kind: RepairKind::ClaimSettled,
                        task_id: None,
                        operation_id: None,
                        code_serial: None,
                        checkin_day: None,
                        claim_id: Some(claim_id),
                        user_id,
                        due_since: accepted_at,
                        repaired_at: now,
                    })
                    .collect::<Vec<_>>()
            });
        for made in [codes, bonuses, claims] {
            let repairs = match made {
                Ok(repairs) => repairs,
                Err(error) => {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "settlement reconciler could not repair credits");
                    report.failures += 1;
                    continue;
                }
            };
            for repair in repairs {
                self.record(&repair).await?;
                self.repairs_total.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("zhihui_settlement_repairs_total", "kind" => repair.kind.as_str())
                    .increment(1);
                tracing::warn!(kind = repair.kind.as_str(), user_id = %repair.user_id, due_since = %repair.due_since, code_serial = ?repair.code_serial, checkin_day = ?repair.checkin_day, "settlement reconciler made a lost credit");
                report.repairs.push(repair);
            }
        }
        Ok(())
    }

    async fn record(&self, repair: &Repair) -> anyhow::Result<()> {
        let client = self.pool.get().await.context("getting a connection")?;
        client
            .execute(
                "INSERT INTO settlement_repairs
                    (repair_id, kind, task_id, operation_id, user_id, due_since, repaired_at,
                     code_serial, checkin_day, claim_id)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
                &[
                    &Uuid::now_v7(),
                    &repair.kind.as_str(),
                    &repair.task_id,
                    &repair.operation_id,
                    &repair.user_id,
                    &repair.due_since,
                    &repair.repaired_at,
                    &repair.code_serial.map(i32::try_from).transpose()?,
                    &repair.checkin_day,
                    &repair.claim_id,
                ],
            )
            .await
            .context("recording a repair")?;
        Ok(())
    }

    /// Run forever: lead when no other process does, one pass every `settlement_interval_ms`.
    pub async fn run(self) {
        loop {
            match crate::platform::leader::try_lead(&self.pool, LEADER_NAME).await {
                Ok(Some(lock)) => {
                    if let Err(error) = self.lead(&lock).await {
                        tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "settlement reconciler stopped leading");
                    }
                    crate::platform::leader::resign(lock);
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "settlement reconciler could not try the lock");
                }
            }
            tokio::time::sleep(self.interval).await;
        }
    }

    async fn lead(&self, lock: &crate::platform::leader::LeaderLock) -> anyhow::Result<()> {
        loop {
            crate::platform::leader::still_leading(lock).await?;
            match self.reconcile_once().await {
                Ok(report) if report.failures > 0 => {
                    tracing::warn!(
                        failures = report.failures,
                        "settlement reconciler pass left settlements it could not repair"
                    );
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "settlement reconciler pass failed");
                }
            }
            tokio::time::sleep(self.interval).await;
        }
    }
}

/// Every repair recorded, oldest first (`zhihui audit repairs`).
pub async fn repairs(pool: &Pool, since: Option<DateTime<Utc>>) -> anyhow::Result<Vec<Repair>> {
    let client = pool.get().await.context("getting a connection")?;
    let since = since.unwrap_or(DateTime::<Utc>::UNIX_EPOCH);
    let rows = client
        .query(
            "SELECT kind, task_id, operation_id, user_id, due_since, repaired_at, code_serial,
                    checkin_day, claim_id
               FROM settlement_repairs WHERE repaired_at >= $1 ORDER BY repaired_at, repair_id",
            &[&since],
        )
        .await
        .context("reading repairs")?;
    rows.iter()
        .map(|row| {
            Ok(Repair {
                kind: RepairKind::parse(row.get(0))?,
                task_id: row.get(1),
                operation_id: row.get(2),
                user_id: row.get(3),
                due_since: row.get(4),
                repaired_at: row.get(5),
                code_serial: row
                    .get::<_, Option<i32>>(6)
                    .map(u32::try_from)
                    .transpose()?,
                checkin_day: row.get(7),
                claim_id: row.get(8),
            })
        })
        .collect()
}
