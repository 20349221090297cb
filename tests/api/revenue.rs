//! The revenue account: the recorder mirrors every settle, charge and refund exactly once, resumes
//! after a crash from the revenue stream itself, is fenced against a second instance, and
//! `audit verify` checks it against the account streams and checks conservation.

#![allow(clippy::unwrap_used)]

use uuid::Uuid;
use zhihui::platform::event_store::{EventMetadata, EventStore, ExpectedVersion, NewEvent};
use zhihui::points::revenue::RevenueRecorder;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::{AccountCommand, account_stream};
use zhihui_domain::points::{Amount, Points};
use zhihui_domain::revenue::{
    LogPosition, REVENUE_STREAM, RevenueEvent, RevenueMovement, RevenueRecorded,
};
use zhihui_domain::user::UserId;

use crate::helpers::{TestApp, spawn_app};

fn metadata() -> EventMetadata {
    EventMetadata {
        correlation_id: Uuid::now_v7(),
        causation_id: None,
        actor: "test".into(),
    }
}

/// Two users: grants, a settled and a released hold, a charge and its refund, another charge.
/// Revenue after all: 7 (settled) + 5 (charge) - 5 (refund) + 3 (charge) = 10.
async fn movements(app: &TestApp) -> [UserId; 2] {
    let services = app.services();
    let users = [
        UserId::from_uuid(Uuid::now_v7()),
        UserId::from_uuid(Uuid::now_v7()),
    ];
    let at = app.clock.now();
    let (hold_settled, hold_released, charge) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let commands = [
        (
            0,
            AccountCommand::Grant {
                operation_id: Uuid::now_v7(),
                amount: Amount::whole(50),
                reason: "welcome".into(),
                at,
            },
        ),
        (
            1,
            AccountCommand::Grant {
                operation_id: Uuid::now_v7(),
                amount: Amount::whole(20),
                reason: "welcome".into(),
                at,
            },
        ),
        (
            0,
            AccountCommand::Freeze {
                hold_id: hold_settled,
                amount: Amount::whole(7),
                at,
            },
        ),
        (
            0,
            AccountCommand::Freeze {
                hold_id: hold_released,
                amount: Amount::whole(4),
                at,
            },
        ),
        (
            0,
            AccountCommand::SettleHold {
                hold_id: hold_settled,
                at,
            },
        ),
        (
            0,
            AccountCommand::ReleaseHold {
                hold_id: hold_released,
                reason: "failed".into(),
                at,
            },
        ),
        (
            1,
            AccountCommand::Charge {
                operation_id: charge,
                amount: Amount::whole(5),
                reason: "prioritise".into(),
                at,
            },
        ),
        (
            1,
            AccountCommand::Refund {
                operation_id: Uuid::now_v7(),
                charge_operation_id: charge,
                reason: "goodwill".into(),
                at,
            },
        ),
        (
            1,
            AccountCommand::Charge {
                operation_id: Uuid::now_v7(),
                amount: Amount::whole(3),
                reason: "prioritise".into(),
                at,
            },
        ),
    ];
    for (user, command) in commands {
        services
            .accounts
            .execute(&account_stream(users[user]), command, metadata())
            .await
            .unwrap();
    }
    users
}

async fn revenue_events(app: &TestApp) -> Vec<RevenueRecorded> {
    let services = app.services();
    let events = services
        .event_store
        .read_stream(
            REVENUE_STREAM,
            zhihui::platform::event_store::Direction::Forwards,
            zhihui::platform::event_store::ReadFrom::Start,
            1_000,
        )
        .await
        .unwrap();
    events
        .iter()
        .map(|recorded| {
            let RevenueEvent::Recorded(event) = RevenueEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .unwrap();
            event
        })
        .collect()
}

async fn verify(app: &TestApp) -> Vec<String> {
    app.verify(None)
        .await
        .differences
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[tokio::test]
async fn every_settle_charge_and_refund_is_recorded_once_in_log_order() {
    let app = spawn_app().await;
    movements(&app).await;
    let recorder = app.revenue_recorder();
    assert_eq!(recorder.catch_up().await.unwrap(), 4);
    // Again, and by a fresh instance (a restart): nothing new.
    assert_eq!(recorder.catch_up().await.unwrap(), 0);
    assert_eq!(app.revenue_recorder().catch_up().await.unwrap(), 0);

    let events = revenue_events(&app).await;
    let kinds: Vec<_> = events.iter().map(|event| event.movement).collect();
    assert_eq!(
        kinds,
        [
            RevenueMovement::HoldSettled,
            RevenueMovement::Charged,
            RevenueMovement::Refunded,
            RevenueMovement::Charged
        ]
    );
    let totals: Vec<_> = events.iter().map(|event| event.total_after).collect();
    assert_eq!(
        totals,
        [7, 12, 7, 10].map(Points::whole),
        "total after each movement"
    );
    let (state, version) = RevenueRecorder::load_state(&app.services().event_store)
        .await
        .unwrap();
    assert_eq!((state.total, version), (Points::whole(10), Some(3)));
    app.project().await;
    assert_eq!(verify(&app).await, Vec::<String>::new());
}

#[tokio::test]
async fn a_recorder_that_crashed_after_appending_resumes_from_the_revenue_stream() {
    let app = spawn_app().await;
    movements(&app).await;
    app.revenue_recorder().catch_up().await.unwrap();
    // The crash: the hint row never got written (or was lost); a restart scans from the start.
    let client = crate::helpers::connect(&app.settings).await;
    client
        .execute(
            "DELETE FROM projection_checkpoints WHERE projection = 'process:revenue'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(app.revenue_recorder().catch_up().await.unwrap(), 0);
    assert_eq!(revenue_events(&app).await.len(), 4);
}

#[tokio::test]
async fn two_recorders_racing_record_each_movement_once() {
    let app = spawn_app().await;
    movements(&app).await;
    let (first, second) = (app.revenue_recorder(), app.revenue_recorder());
    let (a, b) = tokio::join!(first.catch_up(), second.catch_up());
    // Both may report 4: the loser's identical append is answered as a duplicate (same event ids,
    // derived from the account events), or conflicts and finds everything recorded.
    assert!(a.unwrap() <= 4 && b.unwrap() <= 4);
    assert_eq!(revenue_events(&app).await.len(), 4);
    app.project().await;
    assert_eq!(verify(&app).await, Vec::<String>::new());
}

#[tokio::test]
async fn audit_verify_counts_unrecorded_movements_as_pending_not_lost() {
    let app = spawn_app().await;
    let users = movements(&app).await;
    app.project().await;
    // A settlement after the recorder's position: pending, and conservation still holds.
    let services = app.services();
    let hold = Uuid::now_v7();
    for command in [
        AccountCommand::Freeze {
            hold_id: hold,
            amount: Amount::whole(2),
            at: app.clock.now(),
        },
        AccountCommand::SettleHold {
            hold_id: hold,
            at: app.clock.now(),
        },
    ] {
        services
            .accounts
            .execute(&account_stream(users[1]), command, metadata())
            .await
            .unwrap();
    }
    for projection in zhihui_projections::ProjectionName::ALL {
        app.projector(projection).catch_up().await.unwrap();
    }
    assert_eq!(verify(&app).await, Vec::<String>::new());
}

#[tokio::test]
async fn audit_verify_fails_on_a_forged_revenue_event() {
    let app = spawn_app().await;
    movements(&app).await;
    app.project().await;
    let (state, version) = RevenueRecorder::load_state(&app.services().event_store)
        .await
        .unwrap();
    let forged = RevenueEvent::Recorded(RevenueRecorded {
        source_event_id: Uuid::now_v7(),
        source_position: LogPosition {
            commit: u64::MAX / 2,
            prepare: u64::MAX / 2,
        },
        user_id: Uuid::now_v7(),
        movement: RevenueMovement::Charged,
        reference_id: Uuid::now_v7(),
        amount: Amount::whole(1),
        at: app.clock.now(),
        total_after: state.total + Amount::whole(1),
    });
    app.services()
        .event_store
        .append(
            REVENUE_STREAM,
            ExpectedVersion::Exact(version.unwrap()),
            vec![NewEvent {
                id: Uuid::now_v7(),
                event_type: forged.event_type().into(),
                schema_version: forged.schema_version(),
                payload: forged.to_payload(),
                metadata: metadata(),
            }],
        )
        .await
        .unwrap();
    let differences = verify(&app).await;
    assert!(
        differences
            .iter()
            .any(|difference| difference.contains("recorded without an account event")),
        "{differences:?}"
    );
    assert!(
        differences
            .iter()
            .any(|difference| difference.contains("conservation")),
        "{differences:?}"
    );
}
