//! Redeem codes: signed codes issued in batches, each redeemed once.
//!
//! Three kinds of stream, each the consistency boundary of one rule:
//! - `codeserials`: the serial allocator ([`SerialAllocator`]). A batch reserves a contiguous
//!   range of serials there, so serials are unique across all batches and a serial finds its
//!   batch by range.
//! - `codebatch-<batch id>`: one batch ([`CodeBatch`]): created with its range, points and
//!   validity window; issued page by page (each page continues exactly where the last ended, so a
//!   resumed generator can neither repeat nor skip a serial); revoked.
//! - `code-<serial>`: one code's redemption ([`CodeRedemption`]), where the store cannot hold an
//!   event id once across the whole log (KurrentDB checks ids per stream): the first user to
//!   append wins, every other is refused; the same user again is a repeat.
//!
//! The credit is an account event (`PointsCredited`, kind `redeem_code`) whose operation id is
//! derived from the serial ([`credit_operation_id`]), whose reference names the batch and serial
//! ([`credit_reference`]), and whose event id is derived from the serial too
//! ([`credit_event_id`]). On PostgreSQL, where an event id is unique across the log, that credit
//! alone is the redemption: one append, and a second account's credit of the same code is the
//! store's "id reused" refusal. Codes redeemed before (or on KurrentDB) also have their
//! `code-<serial>` stream; every reader takes both.

pub mod format;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::points::Amount;
use crate::rule::{Broken, Rule};
use crate::user::UserId;

pub use format::{CodeKeys, InvalidCode, RedeemCode, SERIAL_MAX, SigningKey};

/// Codes one batch may have.
pub const BATCH_COUNT_MAX: u32 = 1_000_000;
/// Longest batch note.
pub const BATCH_NOTE_LENGTH_MAX: usize = 200;
/// The allocator's stream.
pub const SERIALS_STREAM: &str = "codeserials";

pub type BatchId = Uuid;

pub fn batch_stream(batch_id: BatchId) -> String {
    format!("codebatch-{batch_id}")
}

pub fn batch_id_of_stream(stream: &str) -> Option<BatchId> {
    stream
        .strip_prefix("codebatch-")
        .and_then(|id| Uuid::parse_str(id).ok())
}

pub fn code_stream(serial: u32) -> String {
    format!("code-{serial}")
}

pub fn serial_of_stream(stream: &str) -> Option<u32> {
    stream.strip_prefix("code-").and_then(|s| s.parse().ok())
}

/// Namespace of the operation ids of code credits.
const CREDIT_NAMESPACE: Uuid = Uuid::from_u128(0x7a68_6968_7569_4000_8000_636f_6465_7321);

/// The operation id of the credit of `serial`: the same on every account, so a retry, a repair
/// and a second process all credit it at most once per account (and the code stream lets only
/// one account redeem it).
pub fn credit_operation_id(serial: u32) -> Uuid {
    Uuid::new_v5(&CREDIT_NAMESPACE, &serial.to_be_bytes())
}

/// Namespace of the event ids of code credits (distinct from the operation ids').
const CREDIT_EVENT_NAMESPACE: Uuid = Uuid::from_u128(0x7a68_6968_7569_4000_8000_6372_6564_6974);

/// The event id of the credit of `serial`: one per code across the whole log, so a store that
/// keeps event ids unique lets exactly one account be credited with it.
pub fn credit_event_id(serial: u32) -> Uuid {
    credit_event_id_of_operation(credit_operation_id(serial))
}

/// [`credit_event_id`] from the credit's operation id (what the account event carries).
pub fn credit_event_id_of_operation(operation_id: Uuid) -> Uuid {
    Uuid::new_v5(&CREDIT_EVENT_NAMESPACE, operation_id.as_bytes())
}

/// The `reference` of a code credit: `code:<batch id>:<serial>`.
pub fn credit_reference(batch_id: BatchId, serial: u32) -> String {
    format!("code:{batch_id}:{serial}")
}

/// The batch and serial a credit's reference names.
pub fn parse_credit_reference(reference: &str) -> Option<(BatchId, u32)> {
    let rest = reference.strip_prefix("code:")?;
    let (batch, serial) = rest.split_once(':')?;
    Some((Uuid::parse_str(batch).ok()?, serial.parse().ok()?))
}

// ---------------------------------------------------------------------------------------------
// The serial allocator.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SerialsState {
    /// The next free serial.
    pub next: u32,
    /// Every reservation: batch -> (first, count).
    pub reserved: std::collections::HashMap<BatchId, (u32, u32)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialsCommand {
    Reserve {
        batch_id: BatchId,
        count: u32,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialsReserved {
    pub batch_id: BatchId,
    pub first_serial: u32,
    pub count: u32,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialsEvent {
    Reserved(SerialsReserved),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SerialsError {
    #[error("only {left} serials are left; ask for fewer codes or rotate to a new format")]
    Exhausted { left: u32 },
    #[error("batch {0} already reserved another number of serials")]
    BatchReused(BatchId),
}

#[derive(Debug)]
pub struct SerialAllocator;

impl Decider for SerialAllocator {
    type State = SerialsState;
    type Command = SerialsCommand;
    type Event = SerialsEvent;
    type Error = SerialsError;

    fn initial_state() -> SerialsState {
        SerialsState {
            next: 1,
            reserved: Default::default(),
        }
    }

    fn decide(
        state: &SerialsState,
        command: &SerialsCommand,
    ) -> Result<Vec<SerialsEvent>, SerialsError> {
        let SerialsCommand::Reserve {
            batch_id,
            count,
            at,
        } = command;
        if let Some((_, reserved)) = state.reserved.get(batch_id) {
            return if reserved == count {
                Ok(vec![])
            } else {
                Err(SerialsError::BatchReused(*batch_id))
            };
        }
        let left = SERIAL_MAX.saturating_sub(state.next) + 1;
        if *count > left {
            return Err(SerialsError::Exhausted { left });
        }
        Ok(vec![SerialsEvent::Reserved(SerialsReserved {
            batch_id: *batch_id,
            first_serial: state.next,
            count: *count,
            at: *at,
        })])
    }

    fn evolve(mut state: SerialsState, event: &SerialsEvent) -> SerialsState {
        let SerialsEvent::Reserved(e) = event;
        state.next = state.next.max(e.first_serial.saturating_add(e.count));
        state.reserved.insert(e.batch_id, (e.first_serial, e.count));
        state
    }
}

impl DomainEvent for SerialsEvent {
    fn event_type(&self) -> &'static str {
        "CodeSerialsReserved"
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        let SerialsEvent::Reserved(e) = self;
        payload_of(e)
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<SerialsEvent, DecodeError> {
        match event_type {
            "CodeSerialsReserved" => {
                expect_version(event_type, schema_version, 1)?;
                Ok(SerialsEvent::Reserved(parse_payload(event_type, payload)?))
            }
            other => Err(DecodeError::UnknownType {
                event_type: other.to_owned(),
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A batch.

/// What an admin asks for; checked by [`BatchSpec::check`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchSpec {
    pub count: u32,
    pub points: Amount,
    pub valid_from: DateTime<Utc>,
    pub valid_until: DateTime<Utc>,
    pub note: String,
}

/// A batch request that breaks a rule, naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {broken}")]
pub struct BatchSpecError {
    pub field: &'static str,
    pub broken: Broken,
}

impl BatchSpec {
    pub fn check(&self) -> Result<(), BatchSpecError> {
        if !(1..=BATCH_COUNT_MAX).contains(&self.count) {
            return Err(BatchSpecError {
                field: "count",
                broken: Broken::new(Rule::Between)
                    .with("min", 1)
                    .with("max", BATCH_COUNT_MAX),
            });
        }
        if self.valid_until <= self.valid_from {
            return Err(BatchSpecError {
                field: "valid_until",
                broken: Broken::new(Rule::After).with("other", "valid_from"),
            });
        }
        if self.note.chars().count() > BATCH_NOTE_LENGTH_MAX {
            return Err(BatchSpecError {
                field: "note",
                broken: Broken::new(Rule::LengthAtMost).with("max", BATCH_NOTE_LENGTH_MAX),
            });
        }
        crate::text::refuse_controls(&self.note, false).map_err(|broken| BatchSpecError {
            field: "note",
            broken,
        })?;
        Ok(())
    }

    /// Whether a redemption at `at` is inside the window (`valid_from` included, `valid_until`
    /// excluded).
    pub fn valid_at(&self, at: DateTime<Utc>) -> bool {
        self.valid_from <= at && at < self.valid_until
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub batch_id: BatchId,
    pub spec: BatchSpec,
    pub key_slot: u8,
    pub first_serial: u32,
    /// Codes issued so far: serials `first_serial .. first_serial + issued`.
    pub issued: u32,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}

impl Batch {
    pub fn is_complete(&self) -> bool {
        self.issued == self.spec.count
    }

    /// Whether `serial` belongs to this batch and its page is issued.
    pub fn has_issued(&self, serial: u32) -> bool {
        serial >= self.first_serial && serial - self.first_serial < self.issued
    }

    pub fn contains(&self, serial: u32) -> bool {
        serial >= self.first_serial && serial - self.first_serial < self.spec.count
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchCommand {
    Create {
        batch_id: BatchId,
        spec: BatchSpec,
        key_slot: u8,
        first_serial: u32,
        at: DateTime<Utc>,
    },
    /// Issue the next page: at most `page_max` codes from `from_serial`, which must be where the
    /// last page ended (a generator that resumes from a stale view is refused, never doubles).
    IssuePage {
        from_serial: u32,
        page_max: u32,
        at: DateTime<Utc>,
    },
    Revoke {
        reason: String,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodeBatchCreated {
    pub batch_id: BatchId,
    pub count: u32,
    pub points: Amount,
    pub valid_from: DateTime<Utc>,
    pub valid_until: DateTime<Utc>,
    pub note: String,
    pub key_slot: u8,
    pub first_serial: u32,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodesIssued {
    pub batch_id: BatchId,
    pub from_serial: u32,
    pub count: u32,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodeBatchRevoked {
    pub batch_id: BatchId,
    pub reason: String,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchEvent {
    Created(CodeBatchCreated),
    Issued(CodesIssued),
    Revoked(CodeBatchRevoked),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error(transparent)]
    Spec(#[from] BatchSpecError),
    #[error("no such batch")]
    NotFound,
    #[error("batch {0} exists with other settings")]
    AlreadyExists(BatchId),
    #[error("the batch is revoked")]
    Revoked,
    #[error("the next page starts at serial {expected}, not {given}")]
    PageOutOfOrder { expected: u32, given: u32 },
}

#[derive(Debug)]
pub struct CodeBatch;

impl Decider for CodeBatch {
    type State = Option<Batch>;
    type Command = BatchCommand;
    type Event = BatchEvent;
    type Error = BatchError;

    fn initial_state() -> Option<Batch> {
        None
    }

    fn decide(
        state: &Option<Batch>,
        command: &BatchCommand,
    ) -> Result<Vec<BatchEvent>, BatchError> {
        match (state, command) {
            (
                None,
                BatchCommand::Create {
                    batch_id,
                    spec,
                    key_slot,
                    first_serial,
                    at,
                },
            ) => {
                spec.check()?;
                // Codes expired before they exist could never be redeemed.
                if spec.valid_until <= *at {
                    return Err(BatchSpecError {
                        field: "valid_until",
                        broken: Broken::new(Rule::InFuture),
                    }
                    .into());
                }
                Ok(vec![BatchEvent::Created(CodeBatchCreated {
                    batch_id: *batch_id,
                    count: spec.count,
                    points: spec.points,
                    valid_from: spec.valid_from,
                    valid_until: spec.valid_until,
                    note: spec.note.clone(),
                    key_slot: *key_slot,
                    first_serial: *first_serial,
                    at: *at,
                })])
            }
            (
                Some(batch),
                BatchCommand::Create {
                    batch_id,
                    spec,
                    key_slot,
                    first_serial,
                    ..
                },
            ) => {
                if batch.spec == *spec
                    && batch.key_slot == *key_slot
                    && batch.first_serial == *first_serial
                {
                    Ok(vec![])
                } else {
                    Err(BatchError::AlreadyExists(*batch_id))
                }
            }
            (None, _) => Err(BatchError::NotFound),
            (
                Some(batch),
                BatchCommand::IssuePage {
                    from_serial,
                    page_max,
                    at,
                },
            ) => {
                if batch.revoked_at.is_some() {
                    return Err(BatchError::Revoked);
                }
                let expected = batch.first_serial + batch.issued;
                if *from_serial != expected {
                    return Err(BatchError::PageOutOfOrder {
                        expected,
                        given: *from_serial,
                    });
                }
                let count = (batch.spec.count - batch.issued).min(*page_max);
                if count == 0 {
                    return Ok(vec![]);
                }
                Ok(vec![BatchEvent::Issued(CodesIssued {
                    batch_id: batch.batch_id,
                    from_serial: *from_serial,
                    count,
                    at: *at,
                })])
            }
            (Some(batch), BatchCommand::Revoke { reason, at }) => {
                if batch.revoked_at.is_some() {
                    return Ok(vec![]);
                }
                Ok(vec![BatchEvent::Revoked(CodeBatchRevoked {
                    batch_id: batch.batch_id,
                    reason: reason.clone(),
                    at: *at,
                })])
            }
        }
    }

    fn evolve(state: Option<Batch>, event: &BatchEvent) -> Option<Batch> {
        match (state, event) {
            (_, BatchEvent::Created(e)) => Some(Batch {
                batch_id: e.batch_id,
                spec: BatchSpec {
                    count: e.count,
                    points: e.points,
                    valid_from: e.valid_from,
                    valid_until: e.valid_until,
                    note: e.note.clone(),
                },
                key_slot: e.key_slot,
                first_serial: e.first_serial,
                issued: 0,
                created_at: e.at,
                revoked_at: None,
            }),
            (Some(mut batch), BatchEvent::Issued(e)) => {
                batch.issued = (e.from_serial + e.count).saturating_sub(batch.first_serial);
                Some(batch)
            }
            (Some(mut batch), BatchEvent::Revoked(e)) => {
                batch.revoked_at = Some(e.at);
                Some(batch)
            }
            // Events are facts: a page or revocation before creation cannot be stored.
            (None, _) => None,
        }
    }
}

impl DomainEvent for BatchEvent {
    fn event_type(&self) -> &'static str {
        match self {
            BatchEvent::Created(_) => "CodeBatchCreated",
            BatchEvent::Issued(_) => "CodesIssued",
            BatchEvent::Revoked(_) => "CodeBatchRevoked",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            BatchEvent::Created(e) => payload_of(e),
            BatchEvent::Issued(e) => payload_of(e),
            BatchEvent::Revoked(e) => payload_of(e),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<BatchEvent, DecodeError> {
        expect_version(event_type, schema_version, 1)?;
        match event_type {
            "CodeBatchCreated" => Ok(BatchEvent::Created(parse_payload(event_type, payload)?)),
            "CodesIssued" => Ok(BatchEvent::Issued(parse_payload(event_type, payload)?)),
            "CodeBatchRevoked" => Ok(BatchEvent::Revoked(parse_payload(event_type, payload)?)),
            other => Err(DecodeError::UnknownType {
                event_type: other.to_owned(),
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One code's redemption.

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodeRedeemed {
    pub serial: u32,
    pub batch_id: BatchId,
    pub user_id: UserId,
    pub points: Amount,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedemptionEvent {
    Redeemed(CodeRedeemed),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedemptionCommand {
    /// The caller checked the batch (issued, inside its window, not revoked) on its latest version.
    Redeem {
        serial: u32,
        batch_id: BatchId,
        user_id: UserId,
        points: Amount,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedemptionError {
    #[error("the code was redeemed by another user")]
    RedeemedByAnother { at: DateTime<Utc> },
}

#[derive(Debug)]
pub struct CodeRedemption;

impl Decider for CodeRedemption {
    type State = Option<CodeRedeemed>;
    type Command = RedemptionCommand;
    type Event = RedemptionEvent;
    type Error = RedemptionError;

    fn initial_state() -> Option<CodeRedeemed> {
        None
    }

    fn decide(
        state: &Option<CodeRedeemed>,
        command: &RedemptionCommand,
    ) -> Result<Vec<RedemptionEvent>, RedemptionError> {
        let RedemptionCommand::Redeem {
            serial,
            batch_id,
            user_id,
            points,
            at,
        } = command;
        match state {
            None => Ok(vec![RedemptionEvent::Redeemed(CodeRedeemed {
                serial: *serial,
                batch_id: *batch_id,
                user_id: *user_id,
                points: *points,
                at: *at,
            })]),
            Some(redeemed) if redeemed.user_id == *user_id => Ok(vec![]),
            Some(redeemed) => Err(RedemptionError::RedeemedByAnother { at: redeemed.at }),
        }
    }

    fn evolve(state: Option<CodeRedeemed>, event: &RedemptionEvent) -> Option<CodeRedeemed> {
        let RedemptionEvent::Redeemed(e) = event;
        // The first redemption is the one that counts; the decider never lets a second through.
        state.or_else(|| Some(e.clone()))
    }
}

impl DomainEvent for RedemptionEvent {
    fn event_type(&self) -> &'static str {
        "CodeRedeemed"
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        let RedemptionEvent::Redeemed(e) = self;
        payload_of(e)
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<RedemptionEvent, DecodeError> {
        match event_type {
            "CodeRedeemed" => {
                expect_version(event_type, schema_version, 1)?;
                Ok(RedemptionEvent::Redeemed(parse_payload(
                    event_type, payload,
                )?))
            }
            other => Err(DecodeError::UnknownType {
                event_type: other.to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests;
