//! Who a user is, apart from what they may do: the id every stream and account is keyed by
//! ([`UserId`]), the names they log in with ([`Username`], [`PhoneNumber`], each valid by
//! construction) and the opaque [`PasswordHash`]. The user aggregate (`crate::user`) and the
//! programs' keys (`crate::api_key`) both stand on it, so neither imports the other's names.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::rule::{Broken, Rule};

/// Shortest username. Two-letter names are too easy to confuse and to squat.
pub const USERNAME_LENGTH_MIN: usize = 3;
/// Longest username: fits a UI line and an audit table column.
pub const USERNAME_LENGTH_MAX: usize = 32;
/// E.164 allows at most 15 digits after the country code's `+`.
pub const PHONE_DIGITS_MAX: usize = 15;
/// Shorter numbers than this are service numbers, not phones that receive codes.
pub const PHONE_DIGITS_MIN: usize = 8;

/// A user's id: a UUIDv7 chosen by the application (time-ordered, not guessable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct UserId(Uuid);

impl UserId {
    pub fn from_uuid(id: Uuid) -> UserId {
        UserId(id)
    }

    pub fn as_uuid(&self) -> Uuid {
        self.0
    }

    /// The user's event stream.
    pub fn stream(&self) -> String {
        format!("user-{}", self.0)
    }
}

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Why a username or phone number was refused. The message names the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidIdentifier(pub Broken);

/// A username: 3 to 32 characters, ASCII letters, digits, `_`, `-` or `.`, starting with a letter.
/// Stored lowercase, so `Alice` and `alice` are one name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Username(String);

impl Username {
    pub fn parse(raw: &str) -> Result<Username, InvalidIdentifier> {
        let name = raw.trim().to_ascii_lowercase();
        let length = name.chars().count();
        // Said first for a name in Chinese (two characters are too short as well): what it
        // lacks is Latin letters.
        if length > 0 && !name.starts_with(|c: char| c.is_ascii_lowercase()) {
            return Err(InvalidIdentifier(Broken::new(
                Rule::UsernameStartsWithLetter,
            )));
        }
        if !(USERNAME_LENGTH_MIN..=USERNAME_LENGTH_MAX).contains(&length) {
            return Err(InvalidIdentifier(
                Broken::new(Rule::LengthBetween)
                    .with("min", USERNAME_LENGTH_MIN)
                    .with("max", USERNAME_LENGTH_MAX),
            ));
        }
        if let Some(bad) = name
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || "_-.".contains(*c)))
        {
            return Err(InvalidIdentifier(
                Broken::new(Rule::UsernameCharacters).with("character", format!("{bad:?}")),
            ));
        }
        Ok(Username(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Username {
    type Error = InvalidIdentifier;
    fn try_from(raw: String) -> Result<Username, InvalidIdentifier> {
        Username::parse(&raw)
    }
}

impl From<Username> for String {
    fn from(name: Username) -> String {
        name.0
    }
}

impl fmt::Display for Username {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A phone number in E.164 form (`+` and 8 to 15 digits). Spaces and dashes are dropped; an
/// 11-digit mainland China mobile number without a country code (`13800138000`) becomes `+86...`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PhoneNumber(String);

impl PhoneNumber {
    pub fn parse(raw: &str) -> Result<PhoneNumber, InvalidIdentifier> {
        let compact: String = raw
            .chars()
            .filter(|c| !matches!(c, ' ' | '-' | '(' | ')'))
            .collect();
        let (digits, national_cn) = match compact.strip_prefix('+') {
            Some(digits) => (digits.to_owned(), false),
            None => (compact.clone(), true),
        };
        if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
            return Err(InvalidIdentifier(Broken::new(Rule::PhoneDigits)));
        }
        if national_cn {
            return if digits.len() == 11 && digits.starts_with('1') {
                Ok(PhoneNumber(format!("+86{digits}")))
            } else {
                Err(InvalidIdentifier(Broken::new(Rule::PhoneCountryCode)))
            };
        }
        if !(PHONE_DIGITS_MIN..=PHONE_DIGITS_MAX).contains(&digits.len()) || digits.starts_with('0')
        {
            return Err(InvalidIdentifier(
                Broken::new(Rule::PhoneLength)
                    .with("min", PHONE_DIGITS_MIN)
                    .with("max", PHONE_DIGITS_MAX),
            ));
        }
        Ok(PhoneNumber(format!("+{digits}")))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for PhoneNumber {
    type Error = InvalidIdentifier;
    fn try_from(raw: String) -> Result<PhoneNumber, InvalidIdentifier> {
        PhoneNumber::parse(&raw)
    }
}

impl From<PhoneNumber> for String {
    fn from(phone: PhoneNumber) -> String {
        phone.0
    }
}

impl fmt::Display for PhoneNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An argon2id hash in PHC string form (`$argon2id$v=19$m=...`). Opaque here; its `Debug` and
/// `Display` are redacted so that it never reaches a log line.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct PasswordHash(String);

impl PasswordHash {
    pub fn parse(phc: &str) -> Result<PasswordHash, InvalidIdentifier> {
        if phc.starts_with("$argon2id$") {
            Ok(PasswordHash(phc.to_owned()))
        } else {
            Err(InvalidIdentifier(Broken::new(Rule::PasswordHash)))
        }
    }

    /// The PHC string, for the password verifier only.
    pub fn expose_phc(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for PasswordHash {
    type Error = InvalidIdentifier;
    fn try_from(raw: String) -> Result<PasswordHash, InvalidIdentifier> {
        PasswordHash::parse(&raw)
    }
}

impl From<PasswordHash> for String {
    fn from(hash: PasswordHash) -> String {
        hash.0
    }
}

impl fmt::Debug for PasswordHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PasswordHash(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::Username;
    use crate::rule::Rule;

    fn refused(raw: &str) -> Rule {
        Username::parse(raw).expect_err(raw).0.rule
    }

    #[test]
    fn a_name_in_chinese_is_told_it_needs_latin_letters_before_its_length() {
        assert_eq!(refused("小红"), Rule::UsernameStartsWithLetter);
        assert_eq!(refused("小红帽"), Rule::UsernameStartsWithLetter);
        assert_eq!(refused("1abc"), Rule::UsernameStartsWithLetter);
        assert_eq!(refused("ab"), Rule::LengthBetween);
        assert_eq!(refused("   "), Rule::LengthBetween);
        assert_eq!(refused("xiao红"), Rule::UsernameCharacters);
        let name = Username::parse(" XiaoHong ").expect("a Latin name");
        assert_eq!(name.as_str(), "xiaohong");
    }
}
