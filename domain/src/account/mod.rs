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

/// The user whose account stream this is (`account-<uuid>`).
pub fn user_of_account_stream(stream: &str) -> Option<UserId> {
    stream
        .strip_prefix("account-")
        .and_then(|id| Uuid::parse_str(id).ok())
        .map(UserId::from_uuid)
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
    /// The reason too: the same key sent again with another reason is another request.
    Grant {
        amount: Amount,
        reason: String,
    },
    Charge {
        amount: Amount,
        refunded: bool,
    },
    Refund {
        charge: OperationId,
    },
    Credit {
        kind: CreditKind,
        amount: Amount,
    },
}

/// The holds and operations are persistent maps (`imbl`): a clone shares them and costs the same
/// however long the account's history. The batching actor (`src/platform/aggregate.rs`) clones a hot
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
                let same = Operation::Grant {
                    amount: *amount,
                    reason: reason.clone(),
                };
                if Account::repeat_of(state, *operation_id, &same)? {
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
                state.operations.insert(
                    e.operation_id,
                    Operation::Grant {
                        amount: e.amount,
                        reason: e.reason.clone(),
                    },
                );
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

    /// A code's credit is stored under an id derived from its code: the log holds it once.
    fn unique_id(&self) -> Option<Uuid> {
        match self {
            AccountEvent::Credited(e) if e.kind == CreditKind::RedeemCode => {
                Some(crate::redeem::credit_event_id_of_operation(e.operation_id))
            }
            _ => None,
        }
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
mod tests;
