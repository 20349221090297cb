//! Promotions ("flash sales"): a points pack with a stock, a price in points (0: free), a time
//! window and one claim per user.
//!
//! One stream per promotion, `promotion-<id>` ([`Promotion`]). Besides the promotion's own life
//! (created, ended early, stock raised) it records every claim that the Redis gate accepted and a
//! consumer persisted: `ClaimReserved` takes a unit of the stock for one user (the store's final
//! guard: never more reserved than the stock, never a user twice, decided on the latest version),
//! then `ClaimGranted` once its price is paid, or `ClaimRefused` when it cannot be (its unit goes
//! back to the stock and the user may claim again). A claim the gate let through that the store
//! cannot reserve (the promotion ended or sold out meanwhile: the gate's cache was a moment
//! behind) is recorded as `ClaimTurnedAway` with its reason, so that its user learns the outcome
//! instead of waiting on a claim nobody will decide. The points are credited on the account with
//! an operation id made from the claim ([`credit_operation_id`]), the price charged with another
//! ([`charge_operation_id`]): every step is idempotent, so a claim persisted twice (a consumer
//! that died before acknowledging it) moves points once.

use chrono::{DateTime, Utc};
use imbl::HashMap;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::decider::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::points::Amount;
use crate::rule::{Broken, Rule};
use crate::user::UserId;

pub type PromotionId = Uuid;
/// Globally unique and time-ordered (UUIDv7, drawn by the gate's caller).
pub type ClaimId = Uuid;

const STREAM_PREFIX: &str = "promotion-";
/// Largest stock of one promotion (and of one raise).
pub const STOCK_MAX: u32 = 1_000_000;
/// Longest title, in characters (after trimming).
pub const TITLE_LENGTH_MAX: usize = 100;

const CREDIT_NAMESPACE: Uuid = Uuid::from_u128(0x7a1c_55d0_93e4_4c0e_8f2b_1d6a_40c9_e311);
const CHARGE_NAMESPACE: Uuid = Uuid::from_u128(0x2b8e_04f7_6c31_4a59_b7d2_9e15_c3a8_0f64);

pub fn promotion_stream(promotion_id: PromotionId) -> String {
    format!("{STREAM_PREFIX}{promotion_id}")
}

pub fn promotion_of_stream(stream: &str) -> Option<PromotionId> {
    Uuid::parse_str(stream.strip_prefix(STREAM_PREFIX)?).ok()
}

/// The operation id of a claim's credit on the claimer's account.
pub fn credit_operation_id(claim_id: ClaimId) -> Uuid {
    Uuid::new_v5(&CREDIT_NAMESPACE, claim_id.as_bytes())
}

/// The operation id of a claim's price, charged on the claimer's account.
pub fn charge_operation_id(claim_id: ClaimId) -> Uuid {
    Uuid::new_v5(&CHARGE_NAMESPACE, claim_id.as_bytes())
}

/// The `reference` of a claim's credit (and the `reason` of its charge):
/// `promotion:<promotion id>:<claim id>`.
pub fn claim_reference(promotion_id: PromotionId, claim_id: ClaimId) -> String {
    format!("promotion:{promotion_id}:{claim_id}")
}

/// The promotion and claim a credit's reference names.
pub fn parse_claim_reference(reference: &str) -> Option<(PromotionId, ClaimId)> {
    let (promotion, claim) = reference.strip_prefix("promotion:")?.split_once(':')?;
    Some((
        Uuid::parse_str(promotion).ok()?,
        Uuid::parse_str(claim).ok()?,
    ))
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromotionSpec {
    pub title: String,
    /// Points credited per claim.
    pub points: Amount,
    /// Points charged per claim; `None` when free.
    pub price: Option<Amount>,
    pub stock: u32,
    pub starts_at: DateTime<Utc>,
    /// Excluded.
    pub ends_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromotionCreated {
    pub promotion_id: PromotionId,
    pub spec: PromotionSpec,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromotionEnded {
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StockRaised {
    pub by: u32,
    pub stock_after: u32,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimReserved {
    pub claim_id: ClaimId,
    pub user_id: UserId,
    /// When the gate accepted it (the window is checked at this time).
    pub accepted_at: DateTime<Utc>,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimGranted {
    pub claim_id: ClaimId,
    pub user_id: UserId,
    pub points: Amount,
    pub price: Option<Amount>,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRefused {
    pub claim_id: ClaimId,
    pub user_id: UserId,
    /// `insufficient-points`.
    pub reason: String,
    pub at: DateTime<Utc>,
}

/// A claim the gate accepted and the store could not reserve: `not-open` (ended or outside the
/// window when the gate accepted it) or `sold-out`. It never held a unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimTurnedAway {
    pub claim_id: ClaimId,
    pub user_id: UserId,
    pub accepted_at: DateTime<Utc>,
    pub reason: String,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromotionEvent {
    Created(PromotionCreated),
    Ended(PromotionEnded),
    StockRaised(StockRaised),
    Reserved(ClaimReserved),
    Granted(ClaimGranted),
    Refused(ClaimRefused),
    TurnedAway(ClaimTurnedAway),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromotionCommand {
    Create {
        promotion_id: PromotionId,
        spec: PromotionSpec,
        at: DateTime<Utc>,
    },
    End {
        at: DateTime<Utc>,
    },
    RaiseStock {
        by: u32,
        at: DateTime<Utc>,
    },
    Reserve {
        claim_id: ClaimId,
        user_id: UserId,
        accepted_at: DateTime<Utc>,
        at: DateTime<Utc>,
    },
    Grant {
        claim_id: ClaimId,
        user_id: UserId,
        at: DateTime<Utc>,
    },
    Refuse {
        claim_id: ClaimId,
        user_id: UserId,
        reason: String,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromotionError {
    #[error("no such promotion")]
    Unknown,
    #[error("the promotion exists already")]
    AlreadyCreated,
    #[error("{field}: {broken}")]
    Invalid { field: &'static str, broken: Broken },
    #[error("the promotion has ended")]
    Ended,
    #[error("this user has claimed this promotion already")]
    AlreadyClaimed,
    #[error("claim {0} is not pending")]
    NotPending(ClaimId),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimStatus {
    Reserved,
    Granted,
    Refused,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub claim_id: ClaimId,
    pub status: ClaimStatus,
    pub accepted_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromotionState {
    pub promotion_id: PromotionId,
    pub spec: PromotionSpec,
    pub ended_at: Option<DateTime<Utc>>,
    /// Each user's live claim (reserved or granted), or the last refused one. A persistent map
    /// (`imbl`), as the account's: the batching actor clones the state per batch and per reply,
    /// which must not copy every claim of a sale of tens of thousands.
    pub claims: HashMap<UserId, Claim>,
    /// Units taken: claims reserved or granted.
    pub taken: u32,
    pub granted: u32,
}

impl PromotionState {
    /// Open at `at`: inside the window and not ended.
    pub fn open_at(&self, at: DateTime<Utc>) -> bool {
        self.spec.starts_at <= at
            && at < self.spec.ends_at
            && self.ended_at.is_none_or(|ended| at < ended)
    }

    pub fn left(&self) -> u32 {
        self.spec.stock.saturating_sub(self.taken)
    }
}

impl PromotionSpec {
    pub fn check(&self) -> Result<(), PromotionError> {
        let title = self.title.trim();
        if crate::text::is_blank(title) || title.chars().count() > TITLE_LENGTH_MAX {
            return Err(PromotionError::Invalid {
                field: "title",
                broken: Broken::new(Rule::LengthBetween)
                    .with("min", 1)
                    .with("max", TITLE_LENGTH_MAX),
            });
        }
        crate::text::refuse_controls(title, false).map_err(|broken| PromotionError::Invalid {
            field: "title",
            broken,
        })?;
        if !(1..=STOCK_MAX).contains(&self.stock) {
            return Err(PromotionError::Invalid {
                field: "stock",
                broken: Broken::new(Rule::Between)
                    .with("min", 1)
                    .with("max", STOCK_MAX),
            });
        }
        if self.ends_at <= self.starts_at {
            return Err(PromotionError::Invalid {
                field: "ends_at",
                broken: Broken::new(Rule::After).with("other", "starts_at"),
            });
        }
        Ok(())
    }
}

#[derive(Debug)]
pub struct Promotion;

impl Decider for Promotion {
    type State = Option<PromotionState>;
    type Command = PromotionCommand;
    type Event = PromotionEvent;
    type Error = PromotionError;

    fn initial_state() -> Option<PromotionState> {
        None
    }

    fn decide(
        state: &Option<PromotionState>,
        command: &PromotionCommand,
    ) -> Result<Vec<PromotionEvent>, PromotionError> {
        let promotion = match (state, command) {
            (
                None,
                PromotionCommand::Create {
                    promotion_id,
                    spec,
                    at,
                },
            ) => {
                spec.check()?;
                // A sale over before it is made could never be claimed.
                if spec.ends_at <= *at {
                    return Err(PromotionError::Invalid {
                        field: "ends_at",
                        broken: Broken::new(Rule::InFuture),
                    });
                }
                return Ok(vec![PromotionEvent::Created(PromotionCreated {
                    promotion_id: *promotion_id,
                    spec: spec.clone(),
                    at: *at,
                })]);
            }
            (Some(existing), PromotionCommand::Create { spec, .. }) => {
                return if existing.spec == *spec {
                    Ok(vec![])
                } else {
                    Err(PromotionError::AlreadyCreated)
                };
            }
            (None, _) => return Err(PromotionError::Unknown),
            (Some(promotion), _) => promotion,
        };
        match command {
            PromotionCommand::Create { .. } => Ok(vec![]),
            PromotionCommand::End { at } => {
                if promotion.ended_at.is_some() {
                    Ok(vec![])
                } else {
                    Ok(vec![PromotionEvent::Ended(PromotionEnded { at: *at })])
                }
            }
            PromotionCommand::RaiseStock { by, at } => {
                if promotion.ended_at.is_some() || *at >= promotion.spec.ends_at {
                    return Err(PromotionError::Ended);
                }
                let stock_after = promotion.spec.stock.saturating_add(*by);
                if *by == 0 || stock_after > STOCK_MAX {
                    return Err(PromotionError::Invalid {
                        field: "add",
                        broken: Broken::new(Rule::StockAfter)
                            .with("max", STOCK_MAX - promotion.spec.stock)
                            .with("stock_max", STOCK_MAX),
                    });
                }
                Ok(vec![PromotionEvent::StockRaised(StockRaised {
                    by: *by,
                    stock_after,
                    at: *at,
                })])
            }
            PromotionCommand::Reserve {
                claim_id,
                user_id,
                accepted_at,
                at,
            } => {
                if let Some(claim) = promotion.claims.get(user_id) {
                    if claim.claim_id == *claim_id {
                        return match claim.status {
                            ClaimStatus::Refused => Err(PromotionError::NotPending(*claim_id)),
                            _ => Ok(vec![]),
                        };
                    }
                    if claim.status != ClaimStatus::Refused {
                        return Err(PromotionError::AlreadyClaimed);
                    }
                }
                // The gate accepted it on a cache a moment behind: a fact to record, not an
                // error to drop (its user is waiting for the outcome).
                let turned_away = |reason: &str| {
                    Ok(vec![PromotionEvent::TurnedAway(ClaimTurnedAway {
                        claim_id: *claim_id,
                        user_id: *user_id,
                        accepted_at: *accepted_at,
                        reason: reason.to_owned(),
                        at: *at,
                    })])
                };
                if !promotion.open_at(*accepted_at) {
                    return turned_away("not-open");
                }
                if promotion.left() == 0 {
                    return turned_away("sold-out");
                }
                let reserved = PromotionEvent::Reserved(ClaimReserved {
                    claim_id: *claim_id,
                    user_id: *user_id,
                    accepted_at: *accepted_at,
                    at: *at,
                });
                // A free claim has nothing to pay: granted in the same decision (one append).
                Ok(match promotion.spec.price {
                    Some(_) => vec![reserved],
                    None => vec![
                        reserved,
                        PromotionEvent::Granted(ClaimGranted {
                            claim_id: *claim_id,
                            user_id: *user_id,
                            points: promotion.spec.points,
                            price: None,
                            at: *at,
                        }),
                    ],
                })
            }
            PromotionCommand::Grant {
                claim_id,
                user_id,
                at,
            } => match promotion.claims.get(user_id) {
                Some(claim) if claim.claim_id == *claim_id => match claim.status {
                    ClaimStatus::Granted => Ok(vec![]),
                    ClaimStatus::Refused => Err(PromotionError::NotPending(*claim_id)),
                    ClaimStatus::Reserved => Ok(vec![PromotionEvent::Granted(ClaimGranted {
                        claim_id: *claim_id,
                        user_id: *user_id,
                        points: promotion.spec.points,
                        price: promotion.spec.price,
                        at: *at,
                    })]),
                },
                _ => Err(PromotionError::NotPending(*claim_id)),
            },
            PromotionCommand::Refuse {
                claim_id,
                user_id,
                reason,
                at,
            } => match promotion.claims.get(user_id) {
                Some(claim) if claim.claim_id == *claim_id => match claim.status {
                    ClaimStatus::Refused => Ok(vec![]),
                    ClaimStatus::Granted => Err(PromotionError::NotPending(*claim_id)),
                    ClaimStatus::Reserved => Ok(vec![PromotionEvent::Refused(ClaimRefused {
                        claim_id: *claim_id,
                        user_id: *user_id,
                        reason: reason.clone(),
                        at: *at,
                    })]),
                },
                _ => Err(PromotionError::NotPending(*claim_id)),
            },
        }
    }

    fn evolve(state: Option<PromotionState>, event: &PromotionEvent) -> Option<PromotionState> {
        match (state, event) {
            (None, PromotionEvent::Created(e)) => Some(PromotionState {
                promotion_id: e.promotion_id,
                spec: e.spec.clone(),
                ended_at: None,
                claims: HashMap::new(),
                taken: 0,
                granted: 0,
            }),
            (Some(mut promotion), event) => {
                match event {
                    PromotionEvent::Created(_) => {}
                    PromotionEvent::Ended(e) => {
                        promotion.ended_at.get_or_insert(e.at);
                    }
                    PromotionEvent::StockRaised(e) => promotion.spec.stock = e.stock_after,
                    PromotionEvent::Reserved(e) => {
                        promotion.taken += 1;
                        promotion.claims.insert(
                            e.user_id,
                            Claim {
                                claim_id: e.claim_id,
                                status: ClaimStatus::Reserved,
                                accepted_at: e.accepted_at,
                            },
                        );
                    }
                    PromotionEvent::Granted(e) => {
                        if let Some(claim) = promotion.claims.get_mut(&e.user_id) {
                            claim.status = ClaimStatus::Granted;
                        }
                        promotion.granted += 1;
                    }
                    PromotionEvent::Refused(e) => {
                        if let Some(claim) = promotion.claims.get_mut(&e.user_id) {
                            claim.status = ClaimStatus::Refused;
                        }
                        promotion.taken = promotion.taken.saturating_sub(1);
                    }
                    // Decided only where the user held no live claim: it took no unit.
                    PromotionEvent::TurnedAway(e) => {
                        promotion.claims.insert(
                            e.user_id,
                            Claim {
                                claim_id: e.claim_id,
                                status: ClaimStatus::Refused,
                                accepted_at: e.accepted_at,
                            },
                        );
                    }
                }
                Some(promotion)
            }
            // Events are facts: nothing is stored before creation.
            (None, _) => None,
        }
    }
}

impl DomainEvent for PromotionEvent {
    fn event_type(&self) -> &'static str {
        match self {
            PromotionEvent::Created(_) => "PromotionCreated",
            PromotionEvent::Ended(_) => "PromotionEnded",
            PromotionEvent::StockRaised(_) => "PromotionStockRaised",
            PromotionEvent::Reserved(_) => "ClaimReserved",
            PromotionEvent::Granted(_) => "ClaimGranted",
            PromotionEvent::Refused(_) => "ClaimRefused",
            PromotionEvent::TurnedAway(_) => "ClaimTurnedAway",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            PromotionEvent::Created(e) => payload_of(e),
            PromotionEvent::Ended(e) => payload_of(e),
            PromotionEvent::StockRaised(e) => payload_of(e),
            PromotionEvent::Reserved(e) => payload_of(e),
            PromotionEvent::Granted(e) => payload_of(e),
            PromotionEvent::Refused(e) => payload_of(e),
            PromotionEvent::TurnedAway(e) => payload_of(e),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<PromotionEvent, DecodeError> {
        expect_version(event_type, schema_version, 1)?;
        Ok(match event_type {
            "PromotionCreated" => PromotionEvent::Created(parse_payload(event_type, payload)?),
            "PromotionEnded" => PromotionEvent::Ended(parse_payload(event_type, payload)?),
            "PromotionStockRaised" => {
                PromotionEvent::StockRaised(parse_payload(event_type, payload)?)
            }
            "ClaimReserved" => PromotionEvent::Reserved(parse_payload(event_type, payload)?),
            "ClaimGranted" => PromotionEvent::Granted(parse_payload(event_type, payload)?),
            "ClaimRefused" => PromotionEvent::Refused(parse_payload(event_type, payload)?),
            "ClaimTurnedAway" => PromotionEvent::TurnedAway(parse_payload(event_type, payload)?),
            other => {
                return Err(DecodeError::UnknownType {
                    event_type: other.to_owned(),
                });
            }
        })
    }
}

/// The event types of a promotion stream (the projection reads them by type).
pub const EVENT_TYPES: &[&str] = &[
    "PromotionCreated",
    "PromotionEnded",
    "PromotionStockRaised",
    "ClaimReserved",
    "ClaimGranted",
    "ClaimRefused",
    "ClaimTurnedAway",
];

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::decider::given;
    use chrono::TimeZone;

    fn at(hour: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2027, 1, 15, hour, 0, 0).unwrap()
    }

    fn user(n: u128) -> UserId {
        UserId::from_uuid(Uuid::from_u128(n))
    }

    fn claim(n: u128) -> ClaimId {
        Uuid::from_u128(1000 + n)
    }

    fn spec(stock: u32) -> PromotionSpec {
        PromotionSpec {
            title: "Spring pack".into(),
            points: Amount::whole(100),
            price: Some(Amount::whole(10)),
            stock,
            starts_at: at(1),
            ends_at: at(3),
        }
    }

    fn created(stock: u32) -> PromotionEvent {
        PromotionEvent::Created(PromotionCreated {
            promotion_id: Uuid::from_u128(1),
            spec: spec(stock),
            at: at(0),
        })
    }

    fn reserved(n: u128) -> PromotionEvent {
        PromotionEvent::Reserved(ClaimReserved {
            claim_id: claim(n),
            user_id: user(n),
            accepted_at: at(2),
            at: at(2),
        })
    }

    fn reserve(n: u128) -> PromotionCommand {
        PromotionCommand::Reserve {
            claim_id: claim(n),
            user_id: user(n),
            accepted_at: at(2),
            at: at(2),
        }
    }

    #[test]
    fn a_promotion_over_before_it_is_made_or_titled_with_a_control_character_is_refused() {
        let create = |spec: PromotionSpec, at: DateTime<Utc>| PromotionCommand::Create {
            promotion_id: Uuid::from_u128(1),
            spec,
            at,
        };
        given::<Promotion>(&[])
            .when(create(spec(5), at(3)))
            .then_error(PromotionError::Invalid {
                field: "ends_at",
                broken: Broken::new(Rule::InFuture),
            });
        let mut titled = spec(5);
        titled.title = "春季\u{0}礼包".into();
        given::<Promotion>(&[])
            .when(create(titled, at(0)))
            .then_error(PromotionError::Invalid {
                field: "title",
                broken: Broken::new(Rule::OneLine),
            });
    }

    #[test]
    fn a_claim_takes_a_unit_while_stock_is_left() {
        given::<Promotion>(&[created(2), reserved(1)])
            .when(reserve(2))
            .then(&[reserved(2)]);
        given::<Promotion>(&[created(2), reserved(1), reserved(2)])
            .when(reserve(3))
            .then(&[turned_away(3, at(2), "sold-out")]);
    }

    fn turned_away(n: u128, accepted_at: DateTime<Utc>, reason: &str) -> PromotionEvent {
        PromotionEvent::TurnedAway(ClaimTurnedAway {
            claim_id: claim(n),
            user_id: user(n),
            accepted_at,
            reason: reason.into(),
            at: accepted_at,
        })
    }

    #[test]
    fn a_claim_turned_away_took_no_unit_its_repeat_is_refused_and_its_user_may_claim_again() {
        let history = [created(1), reserved(1), turned_away(2, at(2), "sold-out")];
        let state = Promotion::fold(&history).unwrap();
        assert_eq!((state.taken, state.left()), (1, 0));
        assert_eq!(state.claims[&user(2)].status, ClaimStatus::Refused);
        given::<Promotion>(&history)
            .when(reserve(2))
            .then_error(PromotionError::NotPending(claim(2)));
        let raised = PromotionEvent::StockRaised(StockRaised {
            by: 1,
            stock_after: 2,
            at: at(2),
        });
        given::<Promotion>(&[
            created(1),
            reserved(1),
            turned_away(2, at(2), "sold-out"),
            raised,
        ])
        .when(PromotionCommand::Reserve {
            claim_id: claim(8),
            user_id: user(2),
            accepted_at: at(2),
            at: at(2),
        })
        .then(&[PromotionEvent::Reserved(ClaimReserved {
            claim_id: claim(8),
            user_id: user(2),
            accepted_at: at(2),
            at: at(2),
        })]);
        // A user holding a live claim is never turned away over a second one the gate let by.
        given::<Promotion>(&[created(1), reserved(1)])
            .when(PromotionCommand::Reserve {
                claim_id: claim(9),
                user_id: user(1),
                accepted_at: at(2),
                at: at(2),
            })
            .then_error(PromotionError::AlreadyClaimed);
    }

    #[test]
    fn a_user_claims_once_and_a_repeat_of_the_same_claim_is_nothing() {
        given::<Promotion>(&[created(5), reserved(1)])
            .when(reserve(1))
            .then(&[]);
        given::<Promotion>(&[created(5), reserved(1)])
            .when(PromotionCommand::Reserve {
                claim_id: claim(9),
                user_id: user(1),
                accepted_at: at(2),
                at: at(2),
            })
            .then_error(PromotionError::AlreadyClaimed);
    }

    #[test]
    fn a_claim_accepted_outside_the_window_or_after_the_end_is_turned_away() {
        let outside = PromotionCommand::Reserve {
            claim_id: claim(1),
            user_id: user(1),
            accepted_at: at(3),
            at: at(3),
        };
        given::<Promotion>(&[created(5)])
            .when(outside)
            .then(&[turned_away(1, at(3), "not-open")]);
        let ended = PromotionEvent::Ended(PromotionEnded {
            at: at(2) - chrono::Duration::minutes(1),
        });
        given::<Promotion>(&[created(5), ended])
            .when(reserve(1))
            .then(&[turned_away(1, at(2), "not-open")]);
    }

    #[test]
    fn a_refused_claim_gives_its_unit_back_and_its_user_may_claim_again() {
        let refused = PromotionEvent::Refused(ClaimRefused {
            claim_id: claim(1),
            user_id: user(1),
            reason: "insufficient-points".into(),
            at: at(2),
        });
        let state = Promotion::fold(&[created(1), reserved(1), refused.clone()]).unwrap();
        assert_eq!((state.taken, state.left()), (0, 1));
        given::<Promotion>(&[created(1), reserved(1), refused])
            .when(PromotionCommand::Reserve {
                claim_id: claim(7),
                user_id: user(1),
                accepted_at: at(2),
                at: at(2),
            })
            .then(&[PromotionEvent::Reserved(ClaimReserved {
                claim_id: claim(7),
                user_id: user(1),
                accepted_at: at(2),
                at: at(2),
            })]);
    }

    #[test]
    fn a_reserved_claim_is_granted_once_with_the_promotions_points_and_price() {
        let grant = PromotionCommand::Grant {
            claim_id: claim(1),
            user_id: user(1),
            at: at(2),
        };
        let granted = PromotionEvent::Granted(ClaimGranted {
            claim_id: claim(1),
            user_id: user(1),
            points: Amount::whole(100),
            price: Some(Amount::whole(10)),
            at: at(2),
        });
        given::<Promotion>(&[created(1), reserved(1)])
            .when(grant.clone())
            .then(std::slice::from_ref(&granted));
        given::<Promotion>(&[created(1), reserved(1), granted.clone()])
            .when(grant)
            .then(&[]);
        given::<Promotion>(&[created(1), reserved(1), granted])
            .when(PromotionCommand::Refuse {
                claim_id: claim(1),
                user_id: user(1),
                reason: "insufficient-points".into(),
                at: at(2),
            })
            .then_error(PromotionError::NotPending(claim(1)));
        given::<Promotion>(&[created(1)])
            .when(PromotionCommand::Grant {
                claim_id: claim(1),
                user_id: user(1),
                at: at(2),
            })
            .then_error(PromotionError::NotPending(claim(1)));
    }

    #[test]
    fn the_stock_can_be_raised_until_the_end_and_the_end_is_recorded_once() {
        let state = Promotion::fold(&[
            created(1),
            reserved(1),
            PromotionEvent::StockRaised(StockRaised {
                by: 2,
                stock_after: 3,
                at: at(2),
            }),
        ])
        .unwrap();
        assert_eq!(state.left(), 2);
        let ended = PromotionEvent::Ended(PromotionEnded { at: at(2) });
        given::<Promotion>(&[created(1), ended.clone()])
            .when(PromotionCommand::End { at: at(2) })
            .then(&[]);
        given::<Promotion>(&[created(1), ended])
            .when(PromotionCommand::RaiseStock { by: 1, at: at(2) })
            .then_error(PromotionError::Ended);
    }

    #[test]
    fn a_free_claim_is_reserved_and_granted_in_one_decision() {
        let free = PromotionEvent::Created(PromotionCreated {
            promotion_id: Uuid::from_u128(1),
            spec: PromotionSpec {
                price: None,
                ..spec(1)
            },
            at: at(0),
        });
        given::<Promotion>(std::slice::from_ref(&free))
            .when(reserve(1))
            .then(&[
                reserved(1),
                PromotionEvent::Granted(ClaimGranted {
                    claim_id: claim(1),
                    user_id: user(1),
                    points: Amount::whole(100),
                    price: None,
                    at: at(2),
                }),
            ]);
    }

    #[test]
    fn references_name_the_promotion_and_the_claim() {
        let reference = claim_reference(Uuid::from_u128(1), claim(1));
        assert_eq!(
            parse_claim_reference(&reference),
            Some((Uuid::from_u128(1), claim(1)))
        );
        assert_ne!(credit_operation_id(claim(1)), charge_operation_id(claim(1)));
    }
}
