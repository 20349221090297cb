//! API keys: what a program holds instead of a person's password (GitHub's token format, Stripe's
//! restricted keys). A key says what it is in its prefix (`zhk_`), names its user, carries 190
//! random bits, and ends with a checksum, so a typo (or a scanner finding one in a repository)
//! is told apart offline, without asking any store:
//!
//! `zhk_` + the user id (22 base62 characters) + the secret (32 base62 characters) + CRC32 of
//! everything before it (6 base62 characters): 64 characters.
//!
//! Only a key's SHA-256 digest is stored (a key is random and long: a slow hash adds nothing).
//! The key itself is shown once, when it is made. Its id (a UUID) is what logs and lists show.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::identity::UserId;

/// What every key starts with.
pub const KEY_PREFIX: &str = "zhk_";
/// Base62 characters of the user id (a u128 needs 22).
const USER_CHARS: usize = 22;
/// Base62 characters of the secret: 32 of them carry 190 bits.
pub const SECRET_CHARS: usize = 32;
/// Base62 characters of the CRC32 checksum (2^32 < 62^6).
const CHECKSUM_CHARS: usize = 6;
/// A key's whole length.
pub const KEY_LENGTH: usize = KEY_PREFIX.len() + USER_CHARS + SECRET_CHARS + CHECKSUM_CHARS;
/// Longest key name: a label in a list.
pub const KEY_NAME_LENGTH_MAX: usize = 64;
/// Keys one user may hold at once (not revoked, not expired): bounds every list and cache.
pub const ACTIVE_KEYS_MAX: usize = 20;

const BASE62: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// What a key may do. Closed: a scope the server does not know cannot be granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Scope {
    /// Submit, prioritise and cancel tasks.
    #[serde(rename = "tasks:write")]
    TasksWrite,
    /// Read tasks and their images, follow them on a socket.
    #[serde(rename = "tasks:read")]
    TasksRead,
    /// Read the account: balance, ledger, profile, check-ins, promotions.
    #[serde(rename = "account:read")]
    AccountRead,
    /// Redeem codes.
    #[serde(rename = "codes:redeem")]
    CodesRedeem,
    /// Register, change and read webhook endpoints and their deliveries.
    #[serde(rename = "webhooks")]
    Webhooks,
    /// Publish and unpublish works, like, follow, block, report; read one's feed and likes.
    #[serde(rename = "gallery:write")]
    GalleryWrite,
    /// Every admin endpoint (only an admin's key may hold it).
    #[serde(rename = "admin")]
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 7] = [
        Scope::TasksWrite,
        Scope::TasksRead,
        Scope::AccountRead,
        Scope::CodesRedeem,
        Scope::Webhooks,
        Scope::GalleryWrite,
        Scope::Admin,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::TasksWrite => "tasks:write",
            Scope::TasksRead => "tasks:read",
            Scope::AccountRead => "account:read",
            Scope::CodesRedeem => "codes:redeem",
            Scope::Webhooks => "webhooks",
            Scope::GalleryWrite => "gallery:write",
            Scope::Admin => "admin",
        }
    }

    pub fn parse(text: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|scope| scope.as_str() == text)
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a text is not a key of ours (found without any store).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MalformedKey {
    #[error("it does not start with {KEY_PREFIX}")]
    Prefix,
    #[error("it is not {KEY_LENGTH} characters long")]
    Length,
    #[error("it has a character that is not a letter or a digit")]
    Character,
    #[error("its checksum does not match (a typo, or not a key of ours)")]
    Checksum,
}

/// A well-formed key: its user and its digest. Parsing checks everything a key carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedKey {
    user_id: UserId,
    digest: String,
}

impl ParsedKey {
    pub fn parse(text: &str) -> Result<ParsedKey, MalformedKey> {
        let text = text.trim();
        let rest = text.strip_prefix(KEY_PREFIX).ok_or(MalformedKey::Prefix)?;
        if text.len() != KEY_LENGTH {
            return Err(MalformedKey::Length);
        }
        if !rest.bytes().all(|byte| byte.is_ascii_alphanumeric()) {
            return Err(MalformedKey::Character);
        }
        let (signed, checksum) = text.split_at(KEY_LENGTH - CHECKSUM_CHARS);
        if encode_fixed(
            u128::from(crc32fast::hash(signed.as_bytes())),
            CHECKSUM_CHARS,
        ) != checksum
        {
            return Err(MalformedKey::Checksum);
        }
        let user = decode(&rest[..USER_CHARS]).ok_or(MalformedKey::Character)?;
        Ok(ParsedKey {
            user_id: UserId::from_uuid(Uuid::from_u128(user)),
            digest: digest_of(text),
        })
    }

    pub fn user_id(&self) -> UserId {
        self.user_id
    }

    /// SHA-256 of the key, hex: what the user's stream stores.
    pub fn digest(&self) -> &str {
        &self.digest
    }
}

/// A new key for `user_id` from `random` (the application's randomness: 32 bytes or more; the
/// domain draws none). Returns the key (to show once) and its digest (to store).
pub fn new_key(user_id: UserId, random: &[u8]) -> (String, String) {
    assert!(
        random.len() >= SECRET_CHARS,
        "a key needs {SECRET_CHARS} random bytes"
    );
    let mut key = String::with_capacity(KEY_LENGTH);
    key.push_str(KEY_PREFIX);
    key.push_str(&encode_fixed(user_id.as_uuid().as_u128(), USER_CHARS));
    // 62 does not divide 256: rejection would need more bytes than we have, and a byte mod 62
    // leaves each character at least 4/256 likely, still 5.9 bits a character, 190 in all.
    for byte in &random[..SECRET_CHARS] {
        key.push(char::from(BASE62[usize::from(*byte) % 62]));
    }
    let checksum = encode_fixed(u128::from(crc32fast::hash(key.as_bytes())), CHECKSUM_CHARS);
    key.push_str(&checksum);
    debug_assert_eq!(key.len(), KEY_LENGTH);
    let digest = digest_of(&key);
    (key, digest)
}

fn digest_of(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// `value` in base62, most significant first, padded to `width` characters.
fn encode_fixed(mut value: u128, width: usize) -> String {
    let mut digits = vec![b'0'; width];
    for slot in digits.iter_mut().rev() {
        *slot = BASE62[(value % 62) as usize];
        value /= 62;
    }
    String::from_utf8(digits).unwrap_or_default()
}

fn decode(text: &str) -> Option<u128> {
    text.bytes().try_fold(0u128, |value, byte| {
        let digit = BASE62.iter().position(|known| *known == byte)? as u128;
        value.checked_mul(62)?.checked_add(digit)
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn user() -> UserId {
        UserId::from_uuid(Uuid::from_u128(0x0192_3456_789a_7bcd_8ef0_1234_5678_9abc))
    }

    #[test]
    fn a_key_names_its_user_and_checks_out() {
        let (key, digest) = new_key(user(), &[7u8; 32]);
        assert_eq!(key.len(), KEY_LENGTH);
        assert!(key.starts_with("zhk_"));
        let parsed = ParsedKey::parse(&key).unwrap();
        assert_eq!(parsed.user_id(), user());
        assert_eq!(parsed.digest(), digest);
        assert_eq!(ParsedKey::parse(&format!("  {key}\n")).unwrap(), parsed);
    }

    #[test]
    fn a_typo_anywhere_is_caught_by_the_checksum_without_a_store() {
        let (key, _) = new_key(user(), &[200u8; 32]);
        for at in KEY_PREFIX.len()..key.len() {
            let mut bytes = key.clone().into_bytes();
            bytes[at] = if bytes[at] == b'a' { b'b' } else { b'a' };
            let typo = String::from_utf8(bytes).unwrap();
            assert!(ParsedKey::parse(&typo).is_err(), "typo at {at} passed");
        }
        assert_eq!(ParsedKey::parse("ghp_abc"), Err(MalformedKey::Prefix));
        assert_eq!(ParsedKey::parse(&key[..40]), Err(MalformedKey::Length));
        let mut bad = key.clone();
        bad.replace_range(10..11, "-");
        assert_eq!(ParsedKey::parse(&bad), Err(MalformedKey::Character));
    }

    #[test]
    fn scopes_have_their_names() {
        for scope in Scope::ALL {
            assert_eq!(Scope::parse(scope.as_str()), Some(scope));
            assert_eq!(
                serde_json::to_value(scope).unwrap(),
                serde_json::json!(scope.as_str())
            );
        }
        assert_eq!(Scope::parse("tasks:delete"), None);
    }
}
