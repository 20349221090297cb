//! A user's points account: one stream per user (`account-<user id>`).
//!
//! Movements: grant (admin), freeze (available -> frozen, under a hold id: the task id), settle
//! (frozen -> the revenue account), release (frozen -> available), charge (available -> revenue,
//! e.g. the prioritise fee), refund (revenue -> available, of an earlier charge) and credits
//! (redeem code, check-in bonus, promotion).
//!
//! Rules: available and frozen never go negative (refused with `InsufficientPoints`); a hold is
//! settled or released at most once; every command is idempotent by its hold or operation id: a
//! repeat produces no event (and the caller answers as it did the first time), while the same id
//! with a different command is refused.
//!
//! Settled holds and charges leave the account for the revenue account, which is its own stream
//! (see [`crate::revenue`]): a process manager follows these events and records them there, so
//! that "points in accounts + revenue = grants + credits" can be checked.
//!
//! Every event carries the balances after it (`available_after`, `frozen_after`): the ledger shows
//! them, and `audit verify` checks them against a fresh fold.

use chrono::{DateTime, Utc};
use imbl::HashMap;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::points::{Amount, Points};
use crate::user::UserId;

/// The account stream of a user.
pub fn account_stream(user_id: UserId) -> String {
    format!("account-{user_id}")
}

/// Hold ids are task ids: a task's hold is found by its id.
pub type HoldId = Uuid;
/// Idempotency handle of a grant, charge, refund or credit.
pub type OperationId = Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CreditKind {
    RedeemCode,
    CheckInBonus,
    Promotion,
}

/// Balances after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Balance {
    pub available: Points,
    pub frozen: Points,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldStatus {
    Open,
    Settled,
    Released,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub amount: Amount,
    pub status: HoldStatus,
}

/// What an operation id was used for, to tell a repeat from a reuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operation {
    Grant { amount: Amount },
    Charge { amount: Amount, refunded: bool },
    Refund { charge: OperationId },
    Credit { kind: CreditKind, amount: Amount },
}

/// The holds and operations are persistent maps (`imbl`): a clone shares them and costs the same
/// however long the account's history. The batching actor (`src/aggregate.rs`) clones a hot
/// stream's state for every batch and every reply; with `std` maps that copied every hold the
/// user ever had, per request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AccountState {
    pub balance: Balance,
    pub holds: HashMap<HoldId, Hold>,
    pub operations: HashMap<OperationId, Operation>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccountCommand {
    Grant {
        operation_id: OperationId,
        amount: Amount,
        reason: String,
        at: DateTime<Utc>,
    },
    Freeze {
        hold_id: HoldId,
        amount: Amount,
        at: DateTime<Utc>,
    },
    SettleHold {
        hold_id: HoldId,
        at: DateTime<Utc>,
    },
    ReleaseHold {
        hold_id: HoldId,
        reason: String,
        at: DateTime<Utc>,
    },
    Charge {
        operation_id: OperationId,
        amount: Amount,
        reason: String,
        at: DateTime<Utc>,
    },
    Refund {
        operation_id: OperationId,
        /// The charge being refunded, in full.
        charge_operation_id: OperationId,
        reason: String,
        at: DateTime<Utc>,
    },
    Credit {
        operation_id: OperationId,
        kind: CreditKind,
        amount: Amount,
        /// The code, bonus day or promotion this credit belongs to.
        reference: String,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PointsGranted {
    pub operation_id: OperationId,
    pub amount: Amount,
    pub reason: String,
    pub at: DateTime<Utc>,
    pub balance_after: Balance,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PointsFrozen {
    pub hold_id: HoldId,
    pub amount: Amount,
    pub at: DateTime<Utc>,
    pub balance_after: Balance,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldSettled {
    pub hold_id: HoldId,
    pub amount: Amount,
    pub at: DateTime<Utc>,
    pub balance_after: Balance,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldReleased {
    pub hold_id: HoldId,
    pub amount: Amount,
    pub reason: String,
    pub at: DateTime<Utc>,
    pub balance_after: Balance,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PointsCharged {
    pub operation_id: OperationId,
    pub amount: Amount,
    pub reason: String,
    pub at: DateTime<Utc>,
    pub balance_after: Balance,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PointsRefunded {
    pub operation_id: OperationId,
    pub charge_operation_id: OperationId,
    pub amount: Amount,
    pub reason: String,
    pub at: DateTime<Utc>,
    pub balance_after: Balance,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PointsCredited {
    pub operation_id: OperationId,
    pub kind: CreditKind,
    pub amount: Amount,
    pub reference: String,
    pub at: DateTime<Utc>,
    pub balance_after: Balance,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccountEvent {
    Granted(PointsGranted),
    Frozen(PointsFrozen),
    HoldSettled(HoldSettled),
    HoldReleased(HoldReleased),
    Charged(PointsCharged),
    Refunded(PointsRefunded),
    Credited(PointsCredited),
}

impl AccountEvent {
    pub fn balance_after(&self) -> Balance {
        match self {
            AccountEvent::Granted(e) => e.balance_after,
            AccountEvent::Frozen(e) => e.balance_after,
            AccountEvent::HoldSettled(e) => e.balance_after,
            AccountEvent::HoldReleased(e) => e.balance_after,
            AccountEvent::Charged(e) => e.balance_after,
            AccountEvent::Refunded(e) => e.balance_after,
            AccountEvent::Credited(e) => e.balance_after,
        }
    }

    pub fn at(&self) -> DateTime<Utc> {
        match self {
            AccountEvent::Granted(e) => e.at,
            AccountEvent::Frozen(e) => e.at,
            AccountEvent::HoldSettled(e) => e.at,
            AccountEvent::HoldReleased(e) => e.at,
            AccountEvent::Charged(e) => e.at,
            AccountEvent::Refunded(e) => e.at,
            AccountEvent::Credited(e) => e.at,
        }
    }

    pub fn amount(&self) -> Amount {
        match self {
            AccountEvent::Granted(e) => e.amount,
            AccountEvent::Frozen(e) => e.amount,
            AccountEvent::HoldSettled(e) => e.amount,
            AccountEvent::HoldReleased(e) => e.amount,
            AccountEvent::Charged(e) => e.amount,
            AccountEvent::Refunded(e) => e.amount,
            AccountEvent::Credited(e) => e.amount,
        }
    }

    /// The hold or operation the movement belongs to.
    pub fn reference_id(&self) -> Uuid {
        match self {
            AccountEvent::Granted(e) => e.operation_id,
            AccountEvent::Frozen(e) => e.hold_id,
            AccountEvent::HoldSettled(e) => e.hold_id,
            AccountEvent::HoldReleased(e) => e.hold_id,
            AccountEvent::Charged(e) => e.operation_id,
            AccountEvent::Refunded(e) => e.operation_id,
            AccountEvent::Credited(e) => e.operation_id,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccountError {
    #[error("insufficient points: {available} available, {required} required")]
    InsufficientPoints { available: Points, required: Amount },
    #[error("no hold {0} on this account")]
    UnknownHold(HoldId),
    #[error("hold {0} is already settled")]
    HoldAlreadySettled(HoldId),
    #[error("hold {0} is already released")]
    HoldAlreadyReleased(HoldId),
    #[error("hold {0} already exists with another amount")]
    HoldIdReused(HoldId),
    #[error("operation {0} was already used for a different operation")]
    OperationIdReused(OperationId),
    #[error("no charge {0} on this account")]
    UnknownCharge(OperationId),
    #[error("charge {0} is already refunded")]
    ChargeAlreadyRefunded(OperationId),
}

#[derive(Debug)]
pub struct Account;

impl Account {
    /// Refuse an operation id already used for something else; `Ok(true)` if it is a repeat.
    fn repeat_of(
        state: &AccountState,
        operation_id: OperationId,
        same: &Operation,
    ) -> Result<bool, AccountError> {
        match state.operations.get(&operation_id) {
            None => Ok(false),
            Some(Operation::Charge { amount, .. }) => match same {
                Operation::Charge {
                    amount: requested, ..
                } if requested == amount => Ok(true),
                _ => Err(AccountError::OperationIdReused(operation_id)),
            },
            Some(existing) if existing == same => Ok(true),
            Some(_) => Err(AccountError::OperationIdReused(operation_id)),
        }
    }
}

impl Decider for Account {
    type State = AccountState;
    type Command = AccountCommand;
    type Event = AccountEvent;
    type Error = AccountError;

    fn initial_state() -> AccountState {
        AccountState::default()
    }

    fn decide(
        state: &AccountState,
        command: &AccountCommand,
    ) -> Result<Vec<AccountEvent>, AccountError> {
        let balance = state.balance;
        match command {
            AccountCommand::Grant {
                operation_id,
                amount,
                reason,
                at,
            } => {
                if Account::repeat_of(state, *operation_id, &Operation::Grant { amount: *amount })?
                {
                    return Ok(vec![]);
                }
                Ok(vec![AccountEvent::Granted(PointsGranted {
                    operation_id: *operation_id,
                    amount: *amount,
                    reason: reason.clone(),
                    at: *at,
                    balance_after: Balance {
                        available: balance.available + *amount,
                        frozen: balance.frozen,
                    },
                })])
            }
            AccountCommand::Freeze {
                hold_id,
                amount,
                at,
            } => {
                if let Some(hold) = state.holds.get(hold_id) {
                    return if hold.amount == *amount {
                        Ok(vec![])
                    } else {
                        Err(AccountError::HoldIdReused(*hold_id))
                    };
                }
                let available =
                    (balance.available - *amount).ok_or(AccountError::InsufficientPoints {
                        available: balance.available,
                        required: *amount,
                    })?;
                Ok(vec![AccountEvent::Frozen(PointsFrozen {
                    hold_id: *hold_id,
                    amount: *amount,
                    at: *at,
                    balance_after: Balance {
                        available,
                        frozen: balance.frozen + *amount,
                    },
                })])
            }
            AccountCommand::SettleHold { hold_id, at } => {
                let hold = state
                    .holds
                    .get(hold_id)
                    .ok_or(AccountError::UnknownHold(*hold_id))?;
                match hold.status {
                    HoldStatus::Settled => Ok(vec![]),
                    HoldStatus::Released => Err(AccountError::HoldAlreadyReleased(*hold_id)),
                    HoldStatus::Open => {
                        let frozen = (balance.frozen - hold.amount)
                            .unwrap_or_else(|| unreachable!("an open hold is always frozen"));
                        Ok(vec![AccountEvent::HoldSettled(HoldSettled {
                            hold_id: *hold_id,
                            amount: hold.amount,
                            at: *at,
                            balance_after: Balance {
                                available: balance.available,
                                frozen,
                            },
                        })])
                    }
                }
            }
            AccountCommand::ReleaseHold {
                hold_id,
                reason,
                at,
            } => {
                let hold = state
                    .holds
                    .get(hold_id)
                    .ok_or(AccountError::UnknownHold(*hold_id))?;
                match hold.status {
                    HoldStatus::Released => Ok(vec![]),
                    HoldStatus::Settled => Err(AccountError::HoldAlreadySettled(*hold_id)),
                    HoldStatus::Open => {
                        let frozen = (balance.frozen - hold.amount)
                            .unwrap_or_else(|| unreachable!("an open hold is always frozen"));
                        Ok(vec![AccountEvent::HoldReleased(HoldReleased {
                            hold_id: *hold_id,
                            amount: hold.amount,
                            reason: reason.clone(),
                            at: *at,
                            balance_after: Balance {
                                available: balance.available + hold.amount,
                                frozen,
                            },
                        })])
                    }
                }
            }
            AccountCommand::Charge {
                operation_id,
                amount,
                reason,
                at,
            } => {
                let operation = Operation::Charge {
                    amount: *amount,
                    refunded: false,
                };
                if Account::repeat_of(state, *operation_id, &operation)? {
                    return Ok(vec![]);
                }
                let available =
                    (balance.available - *amount).ok_or(AccountError::InsufficientPoints {
                        available: balance.available,
                        required: *amount,
                    })?;
                Ok(vec![AccountEvent::Charged(PointsCharged {
                    operation_id: *operation_id,
                    amount: *amount,
                    reason: reason.clone(),
                    at: *at,
                    balance_after: Balance {
                        available,
                        frozen: balance.frozen,
                    },
                })])
            }
            AccountCommand::Refund {
                operation_id,
                charge_operation_id,
                reason,
                at,
            } => {
                let operation = Operation::Refund {
                    charge: *charge_operation_id,
                };
                if Account::repeat_of(state, *operation_id, &operation)? {
                    return Ok(vec![]);
                }
                let amount = match state.operations.get(charge_operation_id) {
                    Some(Operation::Charge {
                        refunded: false,
                        amount,
                    }) => *amount,
                    Some(Operation::Charge { refunded: true, .. }) => {
                        return Err(AccountError::ChargeAlreadyRefunded(*charge_operation_id));
                    }
                    _ => return Err(AccountError::UnknownCharge(*charge_operation_id)),
                };
                Ok(vec![AccountEvent::Refunded(PointsRefunded {
                    operation_id: *operation_id,
                    charge_operation_id: *charge_operation_id,
                    amount,
                    reason: reason.clone(),
                    at: *at,
                    balance_after: Balance {
                        available: balance.available + amount,
                        frozen: balance.frozen,
                    },
                })])
            }
            AccountCommand::Credit {
                operation_id,
                kind,
                amount,
                reference,
                at,
            } => {
                let operation = Operation::Credit {
                    kind: *kind,
                    amount: *amount,
                };
                if Account::repeat_of(state, *operation_id, &operation)? {
                    return Ok(vec![]);
                }
                Ok(vec![AccountEvent::Credited(PointsCredited {
                    operation_id: *operation_id,
                    kind: *kind,
                    amount: *amount,
                    reference: reference.clone(),
                    at: *at,
                    balance_after: Balance {
                        available: balance.available + *amount,
                        frozen: balance.frozen,
                    },
                })])
            }
        }
    }

    fn evolve(mut state: AccountState, event: &AccountEvent) -> AccountState {
        // Balances come from the amounts, not from `balance_after`: the fold is the truth and
        // `audit verify` compares the two.
        let balance = state.balance;
        match event {
            AccountEvent::Granted(e) => {
                state.balance.available = balance.available + e.amount;
                state
                    .operations
                    .insert(e.operation_id, Operation::Grant { amount: e.amount });
            }
            AccountEvent::Frozen(e) => {
                state.balance.available = (balance.available - e.amount).unwrap_or(Points::ZERO);
                state.balance.frozen = balance.frozen + e.amount;
                state.holds.insert(
                    e.hold_id,
                    Hold {
                        amount: e.amount,
                        status: HoldStatus::Open,
                    },
                );
            }
            AccountEvent::HoldSettled(e) => {
                state.balance.frozen = (balance.frozen - e.amount).unwrap_or(Points::ZERO);
                if let Some(hold) = state.holds.get_mut(&e.hold_id) {
                    hold.status = HoldStatus::Settled;
                }
            }
            AccountEvent::HoldReleased(e) => {
                state.balance.frozen = (balance.frozen - e.amount).unwrap_or(Points::ZERO);
                state.balance.available = balance.available + e.amount;
                if let Some(hold) = state.holds.get_mut(&e.hold_id) {
                    hold.status = HoldStatus::Released;
                }
            }
            AccountEvent::Charged(e) => {
                state.balance.available = (balance.available - e.amount).unwrap_or(Points::ZERO);
                state.operations.insert(
                    e.operation_id,
                    Operation::Charge {
                        amount: e.amount,
                        refunded: false,
                    },
                );
            }
            AccountEvent::Refunded(e) => {
                state.balance.available = balance.available + e.amount;
                state.operations.insert(
                    e.operation_id,
                    Operation::Refund {
                        charge: e.charge_operation_id,
                    },
                );
                if let Some(Operation::Charge { refunded, .. }) =
                    state.operations.get_mut(&e.charge_operation_id)
                {
                    *refunded = true;
                }
            }
            AccountEvent::Credited(e) => {
                state.balance.available = balance.available + e.amount;
                state.operations.insert(
                    e.operation_id,
                    Operation::Credit {
                        kind: e.kind,
                        amount: e.amount,
                    },
                );
            }
        }
        state
    }
}

const ACCOUNT_EVENT_TYPES: [&str; 7] = [
    "PointsGranted",
    "PointsFrozen",
    "HoldSettled",
    "HoldReleased",
    "PointsCharged",
    "PointsRefunded",
    "PointsCredited",
];

impl DomainEvent for AccountEvent {
    fn event_type(&self) -> &'static str {
        match self {
            AccountEvent::Granted(_) => "PointsGranted",
            AccountEvent::Frozen(_) => "PointsFrozen",
            AccountEvent::HoldSettled(_) => "HoldSettled",
            AccountEvent::HoldReleased(_) => "HoldReleased",
            AccountEvent::Charged(_) => "PointsCharged",
            AccountEvent::Refunded(_) => "PointsRefunded",
            AccountEvent::Credited(_) => "PointsCredited",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            AccountEvent::Granted(e) => payload_of(e),
            AccountEvent::Frozen(e) => payload_of(e),
            AccountEvent::HoldSettled(e) => payload_of(e),
            AccountEvent::HoldReleased(e) => payload_of(e),
            AccountEvent::Charged(e) => payload_of(e),
            AccountEvent::Refunded(e) => payload_of(e),
            AccountEvent::Credited(e) => payload_of(e),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<AccountEvent, DecodeError> {
        if !ACCOUNT_EVENT_TYPES.contains(&event_type) {
            return Err(DecodeError::UnknownType {
                event_type: event_type.to_owned(),
            });
        }
        expect_version(event_type, schema_version, 1)?;
        Ok(match event_type {
            "PointsGranted" => AccountEvent::Granted(parse_payload(event_type, payload)?),
            "PointsFrozen" => AccountEvent::Frozen(parse_payload(event_type, payload)?),
            "HoldSettled" => AccountEvent::HoldSettled(parse_payload(event_type, payload)?),
            "HoldReleased" => AccountEvent::HoldReleased(parse_payload(event_type, payload)?),
            "PointsCharged" => AccountEvent::Charged(parse_payload(event_type, payload)?),
            "PointsRefunded" => AccountEvent::Refunded(parse_payload(event_type, payload)?),
            _ => AccountEvent::Credited(parse_payload(event_type, payload)?),
        })
    }
}

/// Every account event type name (for subscriptions filtering on types).
pub fn account_event_types() -> &'static [&'static str] {
    &ACCOUNT_EVENT_TYPES
}

#[cfg(test)]
mod tests {
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
}
