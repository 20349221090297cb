//! The redeem code format: 10 characters of Crockford's Base32, 50 bits.
//!
//! ```text
//!  bit 49                                                         bit 0
//!  [ key slot: 3 ][ scrambled (serial: 25, signature: 17): 42 ][ check: 5 ]
//! ```
//!
//! - The *key slot* (0-7) picks one of the configured signing keys, so keys can rotate: new
//!   batches sign with the active slot, old codes keep verifying while their slot's key stays
//!   configured. It is the only field in clear (it must be read before any key is known).
//! - The *serial* (1 to 2^25 - 1) is unique across all batches; it identifies the code.
//! - The *signature* is the first 17 bits of HMAC-SHA256(key, "zhihui-code-v1" | slot | serial).
//! - Serial and signature are scrambled together by a 4-round Feistel network keyed by the same
//!   key, so a batch's codes do not share prefixes and reveal neither serials nor counts.
//! - The *check* symbol is a weighted sum, modulo 32, of the other nine symbols with odd weights:
//!   every single-character change is refused for sure (not only with the signature's
//!   probability), and a mistyped code is told from a forged one by nothing the user sees.
//!
//! A random string passes both checks with probability 2^-22 (1 in 4.2 million); someone who
//! knows this format and computes the check symbol still needs 2^17 guesses per success, which
//! the per-user attempt limit turns into years. Verification needs only the key: a forged or
//! mistyped code is refused without a lookup.
//!
//! Input is forgiving the way Crockford's alphabet intends: case-insensitive, `O` reads as `0`,
//! `I` and `L` as `1`, and hyphens and spaces are ignored (`ABCDE-FGHJK`).

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Characters of a code.
pub const CODE_LENGTH: usize = 10;
/// The shape of a code as [`CodeKeys::decode`] reads it (for the API document): ten symbols of
/// the alphabet in either case (`O`, `I` and `L` read as `0`, `1`, `1`; no `U`), with hyphens
/// and spaces anywhere. A code of this shape may still be refused (check symbol, signature).
pub const CODE_PATTERN: &str = "^[- ]*([0-9A-TV-Za-tv-z][- ]*){10}$";
/// Bits of the key slot field: 8 signing keys can be configured at once.
pub const KEY_SLOT_BITS: u32 = 3;
/// Key slots, 0 to `KEY_SLOTS - 1`.
pub const KEY_SLOTS: u8 = 1 << KEY_SLOT_BITS;
/// Bits of the serial.
pub const SERIAL_BITS: u32 = 25;
/// The largest serial (serials start at 1): 33,554,431 codes over the platform's life.
pub const SERIAL_MAX: u32 = (1 << SERIAL_BITS) - 1;
/// Bits of the truncated HMAC.
pub const SIGNATURE_BITS: u32 = 17;
const CHECK_BITS: u32 = 5;
const SCRAMBLED_BITS: u32 = SERIAL_BITS + SIGNATURE_BITS;
const HALF_BITS: u32 = SCRAMBLED_BITS / 2;
const HALF_MASK: u64 = (1 << HALF_BITS) - 1;
const FEISTEL_ROUNDS: u8 = 4;
/// Crockford's alphabet: digits and letters without I, L, O, U.
const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
/// Bytes that make the HMAC inputs of this format differ from any other use of the key.
const DOMAIN: &[u8] = b"zhihui-code-v1";

const _: () = assert!(KEY_SLOT_BITS + SCRAMBLED_BITS + CHECK_BITS == 50);
const _: () = assert!(SCRAMBLED_BITS.is_multiple_of(2));

type HmacSha256 = Hmac<Sha256>;

/// A signing key. Its bytes never reach a `Debug` output or a log.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningKey(Vec<u8>);

impl SigningKey {
    /// Keys shorter than this are refused: the HMAC is only as strong as its key.
    pub const LENGTH_MIN: usize = 32;

    pub fn new(bytes: &[u8]) -> Result<SigningKey, String> {
        if bytes.len() < Self::LENGTH_MIN {
            return Err(format!(
                "a code signing key needs at least {} bytes",
                Self::LENGTH_MIN
            ));
        }
        Ok(SigningKey(bytes.to_vec()))
    }

    fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        // `new_from_slice` takes any key length for HMAC; it cannot fail.
        let Ok(mut mac) = HmacSha256::new_from_slice(&self.0) else {
            unreachable!("HMAC accepts keys of any length")
        };
        mac.update(DOMAIN);
        for part in parts {
            mac.update(part);
        }
        mac.finalize().into_bytes().into()
    }
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SigningKey(redacted)")
    }
}

/// The signing keys by slot, and the slot new batches use.
#[derive(Debug, Clone)]
pub struct CodeKeys {
    slots: [Option<SigningKey>; KEY_SLOTS as usize],
    active: u8,
}

impl CodeKeys {
    /// `keys` by slot; `active` must be one of them.
    pub fn new(keys: Vec<(u8, SigningKey)>, active: u8) -> Result<CodeKeys, String> {
        let mut slots: [Option<SigningKey>; KEY_SLOTS as usize] = Default::default();
        for (slot, key) in keys {
            let place = slots
                .get_mut(usize::from(slot))
                .ok_or_else(|| format!("key slot {slot} is not 0 to {}", KEY_SLOTS - 1))?;
            *place = Some(key);
        }
        if slots.get(usize::from(active)).is_none_or(Option::is_none) {
            return Err(format!("the active key slot {active} has no key"));
        }
        Ok(CodeKeys { slots, active })
    }

    pub fn active_slot(&self) -> u8 {
        self.active
    }

    fn key(&self, slot: u8) -> Option<&SigningKey> {
        self.slots.get(usize::from(slot)).and_then(Option::as_ref)
    }

    /// The code of `serial` signed with the key of `slot`; `None` when the slot has no key or
    /// the serial is out of range.
    pub fn encode(&self, slot: u8, serial: u32) -> Option<RedeemCode> {
        let key = self.key(slot)?;
        if serial == 0 || serial > SERIAL_MAX {
            return None;
        }
        let signature = signature(key, slot, serial);
        let inner = (u64::from(serial) << SIGNATURE_BITS) | u64::from(signature);
        let scrambled = feistel(key, slot, inner, Direction::Forwards);
        let body = (u64::from(slot) << SCRAMBLED_BITS) | scrambled;
        let mut symbols = [0u8; CODE_LENGTH];
        for (index, symbol) in symbols.iter_mut().take(CODE_LENGTH - 1).enumerate() {
            let shift = 5 * (CODE_LENGTH - 2 - index);
            *symbol = ((body >> shift) & 31) as u8;
        }
        symbols[CODE_LENGTH - 1] = check_symbol(&symbols);
        Some(RedeemCode {
            slot,
            serial,
            symbols,
        })
    }

    /// Read a code a user typed. Every failure is the same error on purpose: a caller cannot
    /// learn which check failed.
    pub fn decode(&self, text: &str) -> Result<RedeemCode, InvalidCode> {
        let mut symbols = [0u8; CODE_LENGTH];
        let mut count = 0;
        for character in text.chars() {
            if character == '-' || character == ' ' {
                continue;
            }
            let value = symbol_value(character).ok_or(InvalidCode)?;
            let place = symbols.get_mut(count).ok_or(InvalidCode)?;
            *place = value;
            count += 1;
        }
        if count != CODE_LENGTH || symbols[CODE_LENGTH - 1] != check_symbol(&symbols) {
            return Err(InvalidCode);
        }
        let body = symbols
            .iter()
            .take(CODE_LENGTH - 1)
            .fold(0u64, |body, symbol| (body << 5) | u64::from(*symbol));
        let slot = (body >> SCRAMBLED_BITS) as u8;
        let key = self.key(slot).ok_or(InvalidCode)?;
        let inner = feistel(
            key,
            slot,
            body & ((1 << SCRAMBLED_BITS) - 1),
            Direction::Backwards,
        );
        let serial = (inner >> SIGNATURE_BITS) as u32;
        let given = (inner & ((1 << SIGNATURE_BITS) - 1)) as u32;
        if serial == 0 || given != signature(key, slot, serial) {
            return Err(InvalidCode);
        }
        Ok(RedeemCode {
            slot,
            serial,
            symbols,
        })
    }
}

/// A code that verified: its slot and serial, and its canonical text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedeemCode {
    slot: u8,
    serial: u32,
    symbols: [u8; CODE_LENGTH],
}

impl RedeemCode {
    pub fn slot(&self) -> u8 {
        self.slot
    }

    pub fn serial(&self) -> u32 {
        self.serial
    }
}

impl fmt::Display for RedeemCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for symbol in self.symbols {
            let character = ALPHABET.get(usize::from(symbol)).copied().unwrap_or(b'?');
            fmt::Write::write_char(f, char::from(character))?;
        }
        Ok(())
    }
}

/// Malformed, mistyped or forged: deliberately one error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("this is not a valid code")]
pub struct InvalidCode;

fn symbol_value(character: char) -> Option<u8> {
    let upper = match character.to_ascii_uppercase() {
        'O' => '0',
        'I' | 'L' => '1',
        other => other,
    };
    ALPHABET
        .iter()
        .position(|symbol| char::from(*symbol) == upper)
        .map(|position| position as u8)
}

/// Odd weights are invertible modulo 32: changing any one of the nine symbols changes the sum.
fn check_symbol(symbols: &[u8; CODE_LENGTH]) -> u8 {
    let sum: u32 = symbols
        .iter()
        .take(CODE_LENGTH - 1)
        .enumerate()
        .map(|(index, symbol)| (2 * index as u32 + 1) * u32::from(*symbol))
        .sum();
    (sum % 32) as u8
}

fn signature(key: &SigningKey, slot: u8, serial: u32) -> u32 {
    let digest = key.mac(&[b"sig", &[slot], &serial.to_be_bytes()]);
    u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]) >> (32 - SIGNATURE_BITS)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Forwards,
    Backwards,
}

/// A balanced Feistel network over 42 bits: a keyed permutation, so decoding inverts it exactly.
fn feistel(key: &SigningKey, slot: u8, value: u64, direction: Direction) -> u64 {
    let round_function = |round: u8, half: u64| -> u64 {
        let digest = key.mac(&[b"feistel", &[slot, round], &half.to_be_bytes()]);
        u64::from_be_bytes([
            digest[0], digest[1], digest[2], digest[3], digest[4], digest[5], digest[6], digest[7],
        ]) & HALF_MASK
    };
    let mut left = value >> HALF_BITS;
    let mut right = value & HALF_MASK;
    match direction {
        Direction::Forwards => {
            for round in 0..FEISTEL_ROUNDS {
                let next = left ^ round_function(round, right);
                left = right;
                right = next;
            }
        }
        Direction::Backwards => {
            for round in (0..FEISTEL_ROUNDS).rev() {
                let previous = right ^ round_function(round, left);
                right = left;
                left = previous;
            }
        }
    }
    (left << HALF_BITS) | right
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn key(byte: u8) -> SigningKey {
        SigningKey::new(&[byte; 32]).unwrap()
    }

    fn keys() -> CodeKeys {
        CodeKeys::new(vec![(0, key(1)), (5, key(2))], 5).unwrap()
    }

    #[test]
    fn the_documented_code_shape_names_exactly_the_symbols_a_code_is_read_from() {
        // CODE_PATTERN's class is 0-9, A-T, V-Z in either case.
        for character in ('0'..='9').chain('A'..='Z').chain('a'..='z') {
            let in_pattern = !matches!(character, 'U' | 'u');
            assert_eq!(symbol_value(character).is_some(), in_pattern, "{character}");
        }
        assert!(CODE_PATTERN.contains(&format!("{{{CODE_LENGTH}}}")));
    }

    #[test]
    fn a_code_is_ten_crockford_characters_and_decodes_to_its_serial() {
        let keys = keys();
        let code = keys.encode(5, 1).unwrap();
        let text = code.to_string();
        assert_eq!(text.len(), CODE_LENGTH);
        assert!(text.bytes().all(|b| ALPHABET.contains(&b)), "{text}");
        let decoded = keys.decode(&text).unwrap();
        assert_eq!((decoded.slot(), decoded.serial()), (5, 1));
    }

    #[test]
    fn consecutive_serials_do_not_look_consecutive() {
        let keys = keys();
        let a = keys.encode(5, 1000).unwrap().to_string();
        let b = keys.encode(5, 1001).unwrap().to_string();
        let shared = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        // The slot's bits sit in the first symbol; the scrambled rest differs early.
        assert!(shared < 4, "{a} and {b} share a prefix of {shared}");
    }

    #[test]
    fn input_is_read_as_crockford_intends() {
        let keys = keys();
        let text = keys.encode(0, 424_242).unwrap().to_string();
        let sloppy: String = text
            .to_ascii_lowercase()
            .chars()
            .enumerate()
            .flat_map(|(i, c)| {
                let c = match c {
                    '0' => 'o',
                    '1' if i % 2 == 0 => 'l',
                    '1' => 'I',
                    other => other,
                };
                if i == 5 { vec!['-', c] } else { vec![c] }
            })
            .collect();
        assert_eq!(keys.decode(&sloppy).unwrap().serial(), 424_242);
        assert_eq!(keys.decode(&format!(" {text} ")).unwrap().serial(), 424_242);
    }

    #[test]
    fn malformed_input_is_invalid() {
        let keys = keys();
        for text in [
            "",
            "ABC",
            "0123456789A",
            "012345678U",
            "01234567!9",
            "ÄÖÜ1234567",
        ] {
            assert_eq!(keys.decode(text), Err(InvalidCode), "{text:?}");
        }
    }

    #[test]
    fn a_slot_without_key_and_serials_out_of_range_encode_nothing() {
        let keys = keys();
        assert!(keys.encode(1, 1).is_none());
        assert!(keys.encode(0, 0).is_none());
        assert!(keys.encode(0, SERIAL_MAX + 1).is_none());
        assert!(keys.encode(0, SERIAL_MAX).is_some());
    }

    #[test]
    fn a_code_of_a_removed_key_no_longer_verifies() {
        let old = keys();
        let text = old.encode(0, 77).unwrap().to_string();
        let rotated = CodeKeys::new(vec![(5, key(2))], 5).unwrap();
        assert_eq!(rotated.decode(&text), Err(InvalidCode));
    }

    #[test]
    fn keys_are_checked() {
        assert!(SigningKey::new(&[0; 31]).is_err());
        assert!(CodeKeys::new(vec![(8, key(1))], 0).is_err());
        assert!(CodeKeys::new(vec![(0, key(1))], 1).is_err());
        assert_eq!(format!("{:?}", key(7)), "SigningKey(redacted)");
    }

    proptest! {
        #[test]
        fn encode_then_decode_round_trips(slot in prop::sample::select(vec![0u8, 5]), serial in 1..=SERIAL_MAX) {
            let keys = keys();
            let code = keys.encode(slot, serial).unwrap();
            let decoded = keys.decode(&code.to_string()).unwrap();
            prop_assert_eq!(decoded, code);
            prop_assert_eq!(decoded.serial(), serial);
        }

        #[test]
        fn every_single_character_change_is_refused(serial in 1..=SERIAL_MAX, position in 0..CODE_LENGTH, delta in 1u8..32) {
            let keys = keys();
            let text = keys.encode(5, serial).unwrap().to_string();
            let mut bytes = text.into_bytes();
            let value = symbol_value(char::from(bytes[position])).unwrap();
            bytes[position] = ALPHABET[usize::from((value + delta) % 32)];
            let changed = String::from_utf8(bytes).unwrap();
            prop_assert_eq!(keys.decode(&changed), Err(InvalidCode), "{}", changed);
        }

        #[test]
        fn signatures_depend_on_the_key(serial in 1..=SERIAL_MAX, a in any::<[u8; 32]>(), b in any::<[u8; 32]>()) {
            prop_assume!(a != b);
            let first = CodeKeys::new(vec![(0, SigningKey::new(&a).unwrap())], 0).unwrap();
            let second = CodeKeys::new(vec![(0, SigningKey::new(&b).unwrap())], 0).unwrap();
            let text = first.encode(0, serial).unwrap().to_string();
            // Another key reads it as another (serial, signature) pair: the same serial back
            // would take a 42-bit collision of the keyed permutation.
            let other = second.encode(0, serial).unwrap().to_string();
            prop_assert_ne!(&text, &other);
            if let Ok(code) = second.decode(&text) {
                prop_assert_ne!(code.serial(), serial);
            }
        }
    }
}
