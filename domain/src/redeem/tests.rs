#![allow(clippy::unwrap_used)]
use super::*;
use crate::decider::given;

fn at(seconds: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
}

fn batch_id() -> BatchId {
    Uuid::from_u128(7)
}

fn spec(count: u32) -> BatchSpec {
    BatchSpec {
        count,
        points: Amount::whole(50),
        valid_from: at(0),
        valid_until: at(3600),
        note: "launch".into(),
    }
}

fn created(count: u32, first_serial: u32) -> BatchEvent {
    BatchEvent::Created(CodeBatchCreated {
        batch_id: batch_id(),
        count,
        points: Amount::whole(50),
        valid_from: at(0),
        valid_until: at(3600),
        note: "launch".into(),
        key_slot: 0,
        first_serial,
        at: at(-10),
    })
}

fn issued(from_serial: u32, count: u32) -> BatchEvent {
    BatchEvent::Issued(CodesIssued {
        batch_id: batch_id(),
        from_serial,
        count,
        at: at(-5),
    })
}

#[test]
fn serials_are_reserved_one_range_after_another() {
    let first = SerialsEvent::Reserved(SerialsReserved {
        batch_id: Uuid::from_u128(1),
        first_serial: 1,
        count: 100,
        at: at(0),
    });
    given::<SerialAllocator>(std::slice::from_ref(&first))
        .when(SerialsCommand::Reserve {
            batch_id: Uuid::from_u128(2),
            count: 5,
            at: at(1),
        })
        .then(&[SerialsEvent::Reserved(SerialsReserved {
            batch_id: Uuid::from_u128(2),
            first_serial: 101,
            count: 5,
            at: at(1),
        })]);
    // A retry of the same batch reserves nothing more; another count is a reuse.
    given::<SerialAllocator>(std::slice::from_ref(&first))
        .when(SerialsCommand::Reserve {
            batch_id: Uuid::from_u128(1),
            count: 100,
            at: at(1),
        })
        .then(&[]);
    given::<SerialAllocator>(&[first])
        .when(SerialsCommand::Reserve {
            batch_id: Uuid::from_u128(1),
            count: 99,
            at: at(1),
        })
        .then_error(SerialsError::BatchReused(Uuid::from_u128(1)));
}

#[test]
fn serials_run_out_at_the_format_limit() {
    let almost_all = SerialsEvent::Reserved(SerialsReserved {
        batch_id: Uuid::from_u128(1),
        first_serial: 1,
        count: SERIAL_MAX - 3,
        at: at(0),
    });
    given::<SerialAllocator>(&[almost_all])
        .when(SerialsCommand::Reserve {
            batch_id: Uuid::from_u128(2),
            count: 4,
            at: at(1),
        })
        .then_error(SerialsError::Exhausted { left: 3 });
}

#[test]
fn a_batch_checks_its_fields() {
    let mut bad = spec(0);
    given::<CodeBatch>(&[])
        .when(BatchCommand::Create {
            batch_id: batch_id(),
            spec: bad.clone(),
            key_slot: 0,
            first_serial: 1,
            at: at(0),
        })
        .then_error(BatchError::Spec(BatchSpecError {
            field: "count",
            broken: crate::rule::Broken::new(crate::rule::Rule::Between)
                .with("min", 1)
                .with("max", 1_000_000),
        }));
    bad = spec(10);
    bad.valid_until = bad.valid_from;
    assert_eq!(bad.check().unwrap_err().field, "valid_until");
    bad = spec(10);
    bad.note = "x".repeat(201);
    assert_eq!(bad.check().unwrap_err().field, "note");
    bad = spec(10);
    bad.note = "春节\u{0}活动".into();
    assert_eq!(bad.check().unwrap_err().field, "note");
    // A window over before the batch is made.
    given::<CodeBatch>(&[])
        .when(BatchCommand::Create {
            batch_id: batch_id(),
            spec: spec(10),
            key_slot: 0,
            first_serial: 1,
            at: at(3600),
        })
        .then_error(BatchError::Spec(BatchSpecError {
            field: "valid_until",
            broken: crate::rule::Broken::new(crate::rule::Rule::InFuture),
        }));
}

#[test]
fn pages_continue_where_the_last_ended_and_stop_at_the_count() {
    given::<CodeBatch>(&[created(25, 101), issued(101, 10)])
        .when(BatchCommand::IssuePage {
            from_serial: 111,
            page_max: 10,
            at: at(1),
        })
        .then(&[issued(111, 10).clone_at(at(1))]);
    given::<CodeBatch>(&[created(25, 101), issued(101, 10), issued(111, 10)])
        .when(BatchCommand::IssuePage {
            from_serial: 121,
            page_max: 10,
            at: at(1),
        })
        .then(&[issued(121, 5).clone_at(at(1))]);
    given::<CodeBatch>(&[
        created(25, 101),
        issued(101, 10),
        issued(111, 10),
        issued(121, 5),
    ])
    .when(BatchCommand::IssuePage {
        from_serial: 126,
        page_max: 10,
        at: at(1),
    })
    .then(&[]);
}

#[test]
fn a_stale_generator_can_neither_repeat_nor_skip_a_page() {
    for from_serial in [101, 121] {
        given::<CodeBatch>(&[created(25, 101), issued(101, 10)])
            .when(BatchCommand::IssuePage {
                from_serial,
                page_max: 10,
                at: at(1),
            })
            .then_error(BatchError::PageOutOfOrder {
                expected: 111,
                given: from_serial,
            });
    }
}

#[test]
fn a_revoked_batch_issues_nothing_more_and_revoking_again_is_a_repeat() {
    let revoked = BatchEvent::Revoked(CodeBatchRevoked {
        batch_id: batch_id(),
        reason: "leaked".into(),
        at: at(2),
    });
    given::<CodeBatch>(&[created(25, 101), revoked.clone()])
        .when(BatchCommand::IssuePage {
            from_serial: 101,
            page_max: 10,
            at: at(3),
        })
        .then_error(BatchError::Revoked);
    given::<CodeBatch>(&[created(25, 101), revoked])
        .when(BatchCommand::Revoke {
            reason: "again".into(),
            at: at(3),
        })
        .then(&[]);
    given::<CodeBatch>(&[])
        .when(BatchCommand::Revoke {
            reason: "x".into(),
            at: at(3),
        })
        .then_error(BatchError::NotFound);
}

#[test]
fn issued_serials_are_known_by_range() {
    let batch = CodeBatch::fold(&[created(25, 101), issued(101, 10)]).unwrap();
    assert!(batch.has_issued(101) && batch.has_issued(110));
    assert!(!batch.has_issued(111) && !batch.has_issued(100));
    assert!(batch.contains(125) && !batch.contains(126));
    assert!(spec(1).valid_at(at(0)) && !spec(1).valid_at(at(3600)));
}

fn redeemed(user: u128) -> RedemptionEvent {
    RedemptionEvent::Redeemed(CodeRedeemed {
        serial: 105,
        batch_id: batch_id(),
        user_id: UserId::from_uuid(Uuid::from_u128(user)),
        points: Amount::whole(50),
        at: at(10),
    })
}

fn redeem(user: u128) -> RedemptionCommand {
    RedemptionCommand::Redeem {
        serial: 105,
        batch_id: batch_id(),
        user_id: UserId::from_uuid(Uuid::from_u128(user)),
        points: Amount::whole(50),
        at: at(10),
    }
}

#[test]
fn a_code_is_redeemed_once_and_the_same_user_again_is_a_repeat() {
    given::<CodeRedemption>(&[])
        .when(redeem(1))
        .then(&[redeemed(1)]);
    given::<CodeRedemption>(&[redeemed(1)])
        .when(redeem(1))
        .then(&[]);
    given::<CodeRedemption>(&[redeemed(1)])
        .when(redeem(2))
        .then_error(RedemptionError::RedeemedByAnother { at: at(10) });
}

#[test]
fn credit_ids_and_references_name_the_code() {
    assert_eq!(credit_operation_id(5), credit_operation_id(5));
    assert_ne!(credit_operation_id(5), credit_operation_id(6));
    let reference = credit_reference(batch_id(), 105);
    assert_eq!(parse_credit_reference(&reference), Some((batch_id(), 105)));
    assert_eq!(parse_credit_reference("day:2027-01-01"), None);
    assert_eq!(serial_of_stream(&code_stream(105)), Some(105));
    assert_eq!(
        batch_id_of_stream(&batch_stream(batch_id())),
        Some(batch_id())
    );
    assert_eq!(serial_of_stream(&batch_stream(batch_id())), None);
}

#[test]
fn a_codes_credit_is_stored_under_one_id_per_code_and_no_other_credit_is() {
    use crate::account::{Account, AccountCommand, AccountEvent, CreditKind};
    let credit = |at_seconds: i64, serial: u32, kind: CreditKind| {
        let events = Account::decide(
            &Account::initial_state(),
            &AccountCommand::Credit {
                operation_id: credit_operation_id(serial),
                kind,
                amount: Amount::whole(50),
                reference: credit_reference(batch_id(), serial),
                at: at(at_seconds),
            },
        )
        .unwrap();
        assert_eq!(events.len(), 1);
        events.into_iter().next().unwrap()
    };
    // Whenever and on whatever account, a code's credit has the code's id: the log holds one.
    let first = credit(10, 105, CreditKind::RedeemCode);
    let second = credit(20, 105, CreditKind::RedeemCode);
    assert_ne!(first, second);
    assert_eq!(first.unique_id(), Some(credit_event_id(105)));
    assert_eq!(second.unique_id(), Some(credit_event_id(105)));
    assert_ne!(credit_event_id(105), credit_event_id(106));
    assert_ne!(credit_event_id(105), credit_operation_id(105));
    assert!(matches!(first, AccountEvent::Credited(_)));
    // Other credits (a check-in bonus with the same operation id, say) take fresh ids.
    assert_eq!(credit(10, 105, CreditKind::CheckInBonus).unique_id(), None);
    assert_eq!(redeemed(1).unique_id(), None);
}

#[test]
fn events_survive_storage() {
    for event in [created(3, 1), issued(1, 3)] {
        let back = BatchEvent::from_stored(event.event_type(), 1, &event.to_payload()).unwrap();
        assert_eq!(back, event);
    }
    let event = redeemed(3);
    let back = RedemptionEvent::from_stored("CodeRedeemed", 1, &event.to_payload()).unwrap();
    assert_eq!(back, event);
}

impl BatchEvent {
    fn clone_at(&self, at: DateTime<Utc>) -> BatchEvent {
        match self.clone() {
            BatchEvent::Issued(mut e) => {
                e.at = at;
                BatchEvent::Issued(e)
            }
            other => other,
        }
    }
}
