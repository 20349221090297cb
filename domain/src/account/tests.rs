#![allow(clippy::unwrap_used)]
use super::*;
use crate::decider::given;

fn at() -> DateTime<Utc> {
    DateTime::from_timestamp(1_800_000_000, 0).unwrap()
}

fn id(n: u128) -> Uuid {
    Uuid::from_u128(n)
}

fn balance(available: i64, frozen: i64) -> Balance {
    Balance {
        available: Points::whole(available),
        frozen: Points::whole(frozen),
    }
}

fn granted(amount: i64) -> AccountEvent {
    AccountEvent::Granted(PointsGranted {
        operation_id: id(1),
        amount: Amount::whole(amount),
        reason: "welcome".into(),
        at: at(),
        balance_after: balance(amount, 0),
    })
}

fn frozen(hold: u128, amount: i64, after: Balance) -> AccountEvent {
    AccountEvent::Frozen(PointsFrozen {
        hold_id: id(hold),
        amount: Amount::whole(amount),
        at: at(),
        balance_after: after,
    })
}

fn freeze(hold: u128, amount: i64) -> AccountCommand {
    AccountCommand::Freeze {
        hold_id: id(hold),
        amount: Amount::whole(amount),
        at: at(),
    }
}

fn settle(hold: u128) -> AccountCommand {
    AccountCommand::SettleHold {
        hold_id: id(hold),
        at: at(),
    }
}

fn release(hold: u128) -> AccountCommand {
    AccountCommand::ReleaseHold {
        hold_id: id(hold),
        reason: "task failed".into(),
        at: at(),
    }
}

fn charge(operation: u128, amount: i64) -> AccountCommand {
    AccountCommand::Charge {
        operation_id: id(operation),
        amount: Amount::whole(amount),
        reason: "prioritise".into(),
        at: at(),
    }
}

#[test]
fn given_nothing_when_grant_then_granted() {
    given::<Account>(&[])
        .when(AccountCommand::Grant {
            operation_id: id(1),
            amount: Amount::whole(100),
            reason: "welcome".into(),
            at: at(),
        })
        .then(&[granted(100)]);
}

#[test]
fn given_a_grant_when_the_same_grant_again_then_nothing_and_a_different_one_is_refused() {
    given::<Account>(&[granted(100)])
        .when(AccountCommand::Grant {
            operation_id: id(1),
            amount: Amount::whole(100),
            reason: "welcome".into(),
            at: at(),
        })
        .then(&[]);
    given::<Account>(&[granted(100)])
        .when(AccountCommand::Grant {
            operation_id: id(1),
            amount: Amount::whole(5),
            reason: "welcome".into(),
            at: at(),
        })
        .then_error(AccountError::OperationIdReused(id(1)));
    given::<Account>(&[granted(100)])
        .when(AccountCommand::Grant {
            operation_id: id(1),
            amount: Amount::whole(100),
            reason: "补偿服务器故障".into(),
            at: at(),
        })
        .then_error(AccountError::OperationIdReused(id(1)));
}

#[test]
fn given_100_when_freeze_10_then_available_90_frozen_10() {
    given::<Account>(&[granted(100)])
        .when(freeze(7, 10))
        .then(&[frozen(7, 10, balance(90, 10))]);
}

#[test]
fn given_5_when_freeze_10_then_insufficient_and_nothing_happens() {
    given::<Account>(&[granted(5)])
        .when(freeze(7, 10))
        .then_error(AccountError::InsufficientPoints {
            available: Points::whole(5),
            required: Amount::whole(10),
        });
}

#[test]
fn given_a_hold_when_frozen_again_with_its_id_then_nothing_or_refused() {
    let history = [granted(100), frozen(7, 10, balance(90, 10))];
    given::<Account>(&history).when(freeze(7, 10)).then(&[]);
    given::<Account>(&history)
        .when(freeze(7, 20))
        .then_error(AccountError::HoldIdReused(id(7)));
}

#[test]
fn given_a_hold_when_settled_then_frozen_leaves_and_a_repeat_is_nothing() {
    let settled = AccountEvent::HoldSettled(HoldSettled {
        hold_id: id(7),
        amount: Amount::whole(10),
        at: at(),
        balance_after: balance(90, 0),
    });
    let history = [granted(100), frozen(7, 10, balance(90, 10))];
    given::<Account>(&history)
        .when(settle(7))
        .then(std::slice::from_ref(&settled));
    let after = [granted(100), frozen(7, 10, balance(90, 10)), settled];
    given::<Account>(&after).when(settle(7)).then(&[]);
    given::<Account>(&after)
        .when(release(7))
        .then_error(AccountError::HoldAlreadySettled(id(7)));
}

#[test]
fn given_a_hold_when_released_then_points_return_and_it_cannot_be_settled() {
    let released = AccountEvent::HoldReleased(HoldReleased {
        hold_id: id(7),
        amount: Amount::whole(10),
        reason: "task failed".into(),
        at: at(),
        balance_after: balance(100, 0),
    });
    let history = [granted(100), frozen(7, 10, balance(90, 10))];
    given::<Account>(&history)
        .when(release(7))
        .then(std::slice::from_ref(&released));
    let after = [granted(100), frozen(7, 10, balance(90, 10)), released];
    given::<Account>(&after).when(release(7)).then(&[]);
    given::<Account>(&after)
        .when(settle(7))
        .then_error(AccountError::HoldAlreadyReleased(id(7)));
}

#[test]
fn given_no_hold_when_settle_or_release_then_unknown() {
    given::<Account>(&[granted(100)])
        .when(settle(9))
        .then_error(AccountError::UnknownHold(id(9)));
    given::<Account>(&[granted(100)])
        .when(release(9))
        .then_error(AccountError::UnknownHold(id(9)));
}

#[test]
fn given_points_when_charge_then_charged_once_and_refused_beyond_available() {
    let charged = AccountEvent::Charged(PointsCharged {
        operation_id: id(20),
        amount: Amount::whole(5),
        reason: "prioritise".into(),
        at: at(),
        balance_after: balance(95, 0),
    });
    given::<Account>(&[granted(100)])
        .when(charge(20, 5))
        .then(std::slice::from_ref(&charged));
    given::<Account>(&[granted(100), charged])
        .when(charge(20, 5))
        .then(&[]);
    given::<Account>(&[granted(3)])
        .when(charge(20, 5))
        .then_error(AccountError::InsufficientPoints {
            available: Points::whole(3),
            required: Amount::whole(5),
        });
}

#[test]
fn given_a_charge_when_refunded_then_once_only() {
    let charged = AccountEvent::Charged(PointsCharged {
        operation_id: id(20),
        amount: Amount::whole(5),
        reason: "prioritise".into(),
        at: at(),
        balance_after: balance(95, 0),
    });
    let refund = |operation: u128| AccountCommand::Refund {
        operation_id: id(operation),
        charge_operation_id: id(20),
        reason: "did not move".into(),
        at: at(),
    };
    let refunded = AccountEvent::Refunded(PointsRefunded {
        operation_id: id(21),
        charge_operation_id: id(20),
        amount: Amount::whole(5),
        reason: "did not move".into(),
        at: at(),
        balance_after: balance(100, 0),
    });
    given::<Account>(&[granted(100), charged.clone()])
        .when(refund(21))
        .then(std::slice::from_ref(&refunded));
    let after = [granted(100), charged, refunded];
    given::<Account>(&after).when(refund(21)).then(&[]);
    given::<Account>(&after)
        .when(refund(22))
        .then_error(AccountError::ChargeAlreadyRefunded(id(20)));
    given::<Account>(&[granted(100)])
        .when(refund(22))
        .then_error(AccountError::UnknownCharge(id(20)));
}

#[test]
fn given_nothing_when_credit_then_credited_with_its_kind() {
    given::<Account>(&[])
        .when(AccountCommand::Credit {
            operation_id: id(30),
            kind: CreditKind::RedeemCode,
            amount: Amount::whole(50),
            reference: "ABCDEFGHJK".into(),
            at: at(),
        })
        .then(&[AccountEvent::Credited(PointsCredited {
            operation_id: id(30),
            kind: CreditKind::RedeemCode,
            amount: Amount::whole(50),
            reference: "ABCDEFGHJK".into(),
            at: at(),
            balance_after: balance(50, 0),
        })]);
}

#[test]
fn every_event_round_trips_through_its_stored_form() {
    let events = [
        granted(100),
        frozen(7, 10, balance(90, 10)),
        AccountEvent::Credited(PointsCredited {
            operation_id: id(30),
            kind: CreditKind::Promotion,
            amount: Amount::whole(50),
            reference: "spring".into(),
            at: at(),
            balance_after: balance(140, 10),
        }),
    ];
    for event in events {
        let back = AccountEvent::from_stored(
            event.event_type(),
            event.schema_version(),
            &event.to_payload(),
        )
        .unwrap();
        assert_eq!(back, event);
    }
    assert_eq!(
        granted(100).to_payload().to_value()["amount"],
        serde_json::json!("100.00")
    );
}

mod properties {
    //! Random command sequences on one account keep every invariant and conserve points.
    use super::*;
    use proptest::prelude::*;

    fn command() -> impl Strategy<Value = AccountCommand> {
        // Small id pools so that repeats and reuses happen often.
        let ids = 0u128..6;
        let amount = (1i64..=40).prop_map(Amount::whole);
        prop_oneof![
            (ids.clone(), amount.clone()).prop_map(|(i, amount)| AccountCommand::Grant {
                operation_id: id(100 + i),
                amount,
                reason: "grant".into(),
                at: at(),
            }),
            (ids.clone(), amount.clone()).prop_map(|(i, amount)| AccountCommand::Freeze {
                hold_id: id(200 + i),
                amount,
                at: at(),
            }),
            ids.clone().prop_map(|i| settle(200 + i)),
            ids.clone().prop_map(|i| release(200 + i)),
            (ids.clone(), amount.clone()).prop_map(|(i, amount)| AccountCommand::Charge {
                operation_id: id(100 + i),
                amount,
                reason: "fee".into(),
                at: at(),
            }),
            (ids.clone(), ids.clone()).prop_map(|(i, j)| AccountCommand::Refund {
                operation_id: id(100 + i),
                charge_operation_id: id(100 + j),
                reason: "refund".into(),
                at: at(),
            }),
            (ids, amount).prop_map(|(i, amount)| AccountCommand::Credit {
                operation_id: id(100 + i),
                kind: CreditKind::CheckInBonus,
                amount,
                reference: "day".into(),
                at: at(),
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn random_commands_keep_every_invariant(commands in proptest::collection::vec(command(), 1..80)) {
            let mut state = Account::initial_state();
            let mut minted = Points::ZERO; // grants + credits
            let mut revenue = Points::ZERO; // settled + charged - refunded
            for command in &commands {
                let Ok(events) = Account::decide(&state, command) else { continue };
                for event in &events {
                    state = Account::evolve(state, event);
                    prop_assert_eq!(event.balance_after(), state.balance);
                    match event {
                        AccountEvent::Granted(e) => minted = minted + e.amount,
                        AccountEvent::Credited(e) => minted = minted + e.amount,
                        AccountEvent::HoldSettled(e) => revenue = revenue + e.amount,
                        AccountEvent::Charged(e) => revenue = revenue + e.amount,
                        AccountEvent::Refunded(e) => {
                            revenue = (revenue - e.amount).expect("a refund never exceeds revenue");
                        }
                        AccountEvent::Frozen(_) | AccountEvent::HoldReleased(_) => {}
                    }
                }
                // Idempotent: the same command right after its success changes nothing.
                if !events.is_empty() {
                    prop_assert_eq!(Account::decide(&state, command), Ok(vec![]));
                }
                let open: Points = state
                    .holds
                    .values()
                    .filter(|hold| hold.status == HoldStatus::Open)
                    .fold(Points::ZERO, |sum, hold| sum + hold.amount);
                prop_assert_eq!(open, state.balance.frozen);
                prop_assert!(state.balance.available >= Points::ZERO);
                prop_assert_eq!(state.balance.available + state.balance.frozen + revenue, minted);
            }
        }
    }
}
