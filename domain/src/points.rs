//! Points, the platform's money: decimals with a fixed scale of two places, never floats.

use std::fmt;
use std::ops::{Add, Sub};

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::rule::{Broken, Rule};

/// Decimal places of every amount. A hundredth of a point is the smallest movement.
pub const POINTS_SCALE: u32 = 2;
/// Largest amount one command may move: far above any price or grant, far below overflow.
pub const AMOUNT_MAX: i64 = 1_000_000_000;

/// A non-negative number of points (a balance).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Points(Decimal);

/// Why an amount was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidAmount(pub Broken);

impl Points {
    pub const ZERO: Points = Points(Decimal::ZERO);

    /// Whole points.
    pub fn whole(points: i64) -> Points {
        Points::normalised(Decimal::from(points))
    }

    fn normalised(mut value: Decimal) -> Points {
        value.rescale(POINTS_SCALE);
        Points(value)
    }

    pub fn as_decimal(&self) -> Decimal {
        self.0
    }

    pub fn is_zero(&self) -> bool {
        self.0.is_zero()
    }

    /// `self - other` if it stays non-negative.
    pub fn checked_sub(self, other: Points) -> Option<Points> {
        (self.0 >= other.0).then(|| Points::normalised(self.0 - other.0))
    }
}

impl Add for Points {
    type Output = Points;
    fn add(self, other: Points) -> Points {
        Points::normalised(self.0 + other.0)
    }
}

impl fmt::Display for Points {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A strictly positive amount to move, at most two decimal places and at most [`AMOUNT_MAX`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "Decimal", into = "Decimal")]
pub struct Amount(Decimal);

impl Amount {
    pub fn parse(value: Decimal) -> Result<Amount, InvalidAmount> {
        if value <= Decimal::ZERO {
            return Err(InvalidAmount(Broken::new(Rule::GreaterThanZero)));
        }
        if value > Decimal::from(AMOUNT_MAX) {
            return Err(InvalidAmount(
                Broken::new(Rule::AtMost).with("max", AMOUNT_MAX),
            ));
        }
        if value.normalize().scale() > POINTS_SCALE {
            return Err(InvalidAmount(
                Broken::new(Rule::DecimalPlaces).with("places", POINTS_SCALE),
            ));
        }
        let mut value = value;
        value.rescale(POINTS_SCALE);
        Ok(Amount(value))
    }

    /// Whole points; panics on a non-positive value (for constants and tests).
    pub fn whole(points: i64) -> Amount {
        match Amount::parse(Decimal::from(points)) {
            Ok(amount) => amount,
            Err(error) => panic!("Amount::whole({points}): {error}"),
        }
    }

    pub fn points(&self) -> Points {
        Points(self.0)
    }

    pub fn as_decimal(&self) -> Decimal {
        self.0
    }
}

impl TryFrom<Decimal> for Amount {
    type Error = InvalidAmount;
    fn try_from(value: Decimal) -> Result<Amount, InvalidAmount> {
        Amount::parse(value)
    }
}

impl From<Amount> for Decimal {
    fn from(amount: Amount) -> Decimal {
        amount.0
    }
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Add<Amount> for Points {
    type Output = Points;
    fn add(self, amount: Amount) -> Points {
        self + amount.points()
    }
}

impl Sub<Amount> for Points {
    type Output = Option<Points>;
    fn sub(self, amount: Amount) -> Option<Points> {
        self.checked_sub(amount.points())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::str::FromStr;

    #[test]
    fn amounts_are_positive_bounded_and_have_two_places_at_most() {
        assert!(Amount::parse(Decimal::ZERO).is_err());
        assert!(Amount::parse(Decimal::from(-1)).is_err());
        assert!(Amount::parse(Decimal::from_str("0.001").unwrap()).is_err());
        assert!(Amount::parse(Decimal::from(AMOUNT_MAX + 1)).is_err());
        assert_eq!(
            Amount::parse(Decimal::from_str("1.5").unwrap())
                .unwrap()
                .to_string(),
            "1.50"
        );
        assert_eq!(
            Amount::parse(Decimal::from_str("2.000").unwrap())
                .unwrap()
                .to_string(),
            "2.00"
        );
    }

    #[test]
    fn balances_never_go_negative() {
        assert_eq!(Points::whole(5) - Amount::whole(6), None);
        assert_eq!(Points::whole(5) - Amount::whole(5), Some(Points::ZERO));
    }

    #[test]
    fn amounts_serialize_as_decimal_strings() {
        let json = serde_json::to_string(&Amount::whole(10)).unwrap();
        assert_eq!(json, "\"10.00\"");
        let back: Amount = serde_json::from_str("\"10.5\"").unwrap();
        assert_eq!(back.to_string(), "10.50");
        assert!(serde_json::from_str::<Amount>("\"-1\"").is_err());
    }
}
