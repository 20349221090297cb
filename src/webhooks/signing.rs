//! Signatures as the Standard Webhooks specification makes them: HMAC-SHA256 with the
//! endpoint's secret over `{webhook-id}.{webhook-timestamp}.{body}`, sent as
//! `webhook-signature: v1,<base64>` (several, space-separated, while a rotated secret's
//! predecessor still signs). Secrets are `whsec_` + base64 of 32 bytes, derived from the server's
//! signing key, the endpoint and the generation: never stored, recomputed to sign.
//!
//! [`verify`] is our own receiver's check (the README's Rust receiver): it refuses the known
//! pitfalls (an empty or bare `v1,` signature, a truncated or lengthened one, a stale or future
//! timestamp) and compares in constant time.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use uuid::Uuid;

/// How far a timestamp may be from the receiver's clock (the specification's five minutes).
pub const TOLERANCE_SECONDS: i64 = 300;
/// What a secret starts with, as the specification writes it.
pub const SECRET_PREFIX: &str = "whsec_";

/// An endpoint's secret bytes for `generation`.
pub fn secret_bytes(signing_key: &[u8], endpoint_id: Uuid, generation: u32) -> [u8; 32] {
    let mut mac = Hmac::<Sha256>::new_from_slice(signing_key)
        .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
    mac.update(format!("zhihui webhook secret:{endpoint_id}:{generation}").as_bytes());
    mac.finalize().into_bytes().into()
}

/// The secret as its owner is shown it (once) and as receivers load it.
pub fn secret_text(secret: &[u8; 32]) -> String {
    format!("{SECRET_PREFIX}{}", STANDARD.encode(secret))
}

/// One `v1,<base64>` signature.
pub fn sign(secret: &[u8], message_id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
    mac.update(message_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

/// Why a delivery does not check out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unverified {
    #[error("the secret is not whsec_ and base64")]
    Secret,
    #[error("the timestamp is not a number")]
    Timestamp,
    #[error("the timestamp is more than {TOLERANCE_SECONDS} s away from now")]
    Stale,
    #[error("no signature matches")]
    NoMatch,
}

/// Check a delivery as a receiver must: the timestamp within [`TOLERANCE_SECONDS`] of `now`,
/// and one of the header's `v1` signatures equal (in constant time) to ours.
pub fn verify(
    secret: &str,
    message_id: &str,
    timestamp: &str,
    signatures: &str,
    body: &[u8],
    now: i64,
) -> Result<(), Unverified> {
    let secret = STANDARD
        .decode(secret.strip_prefix(SECRET_PREFIX).unwrap_or(secret))
        .map_err(|_| Unverified::Secret)?;
    let at: i64 = timestamp
        .trim()
        .parse()
        .map_err(|_| Unverified::Timestamp)?;
    if (now - at).abs() > TOLERANCE_SECONDS {
        return Err(Unverified::Stale);
    }
    let mut mac = Hmac::<Sha256>::new_from_slice(&secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
    mac.update(message_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.trim().as_bytes());
    mac.update(b".");
    mac.update(body);
    for signature in signatures.split(' ') {
        let Some(encoded) = signature.strip_prefix("v1,") else {
            continue;
        };
        // An empty or mis-sized signature is no signature (never a prefix match).
        let Ok(decoded) = STANDARD.decode(encoded) else {
            continue;
        };
        if decoded.len() == 32 && mac.clone().verify_slice(&decoded).is_ok() {
            return Ok(());
        }
    }
    Err(Unverified::NoMatch)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000;

    fn fixture() -> (String, String, Vec<u8>) {
        let secret = secret_text(&secret_bytes(
            b"a signing key of 32 bytes or more!",
            Uuid::from_u128(7),
            1,
        ));
        let bytes = STANDARD
            .decode(secret.trim_start_matches(SECRET_PREFIX))
            .unwrap_or_default();
        let body = br#"{"type":"task.succeeded"}"#.to_vec();
        let signature = sign(&bytes, "msg_1", NOW, &body);
        (secret, signature, body)
    }

    #[test]
    fn a_good_signature_checks_out_among_others() {
        let (secret, signature, body) = fixture();
        assert_eq!(
            verify(&secret, "msg_1", &NOW.to_string(), &signature, &body, NOW),
            Ok(())
        );
        let several = format!("v1,AAAA {signature} v2,whatever");
        assert_eq!(
            verify(
                &secret,
                "msg_1",
                &NOW.to_string(),
                &several,
                &body,
                NOW + 10
            ),
            Ok(())
        );
    }

    #[test]
    fn the_known_pitfalls_are_refused() {
        let (secret, signature, body) = fixture();
        let at = NOW.to_string();
        let refuse = |signatures: &str, timestamp: &str, now: i64, body: &[u8]| {
            verify(&secret, "msg_1", timestamp, signatures, body, now).is_err()
        };
        // Empty, bare prefix, truncated, lengthened, another version, another message.
        assert!(refuse("", &at, NOW, &body));
        assert!(refuse("v1,", &at, NOW, &body));
        assert!(refuse(&signature[..signature.len() - 4], &at, NOW, &body));
        assert!(refuse(&format!("{signature}AAAA"), &at, NOW, &body));
        assert!(refuse(
            &signature.replacen("v1,", "v2,", 1),
            &at,
            NOW,
            &body
        ));
        assert!(refuse(&signature, &at, NOW, b"{\"type\":\"task.failed\"}"));
        assert!(verify(&secret, "msg_2", &at, &signature, &body, NOW).is_err());
        // Old and future timestamps; a timestamp that is not a number.
        assert_eq!(
            verify(&secret, "msg_1", &at, &signature, &body, NOW + 301),
            Err(Unverified::Stale)
        );
        assert_eq!(
            verify(&secret, "msg_1", &at, &signature, &body, NOW - 301),
            Err(Unverified::Stale)
        );
        assert_eq!(
            verify(&secret, "msg_1", "soon", &signature, &body, NOW),
            Err(Unverified::Timestamp)
        );
    }

    #[test]
    fn each_endpoint_and_generation_has_its_own_secret() {
        let key = b"a signing key of 32 bytes or more!";
        let one = secret_bytes(key, Uuid::from_u128(1), 1);
        assert_ne!(one, secret_bytes(key, Uuid::from_u128(2), 1));
        assert_ne!(one, secret_bytes(key, Uuid::from_u128(1), 2));
        assert_eq!(one, secret_bytes(key, Uuid::from_u128(1), 1));
        assert!(secret_text(&one).starts_with("whsec_"));
    }
}
