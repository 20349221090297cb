//! Passwords: the rules a new password must meet, argon2id hashing and verification.
//!
//! Hashing is deliberately slow and memory-hungry (that is its point), so it runs on the blocking
//! pool and at most `HASHES_IN_FLIGHT_MAX` at once: a flood of logins queues instead of
//! allocating gigabytes. A login for an unknown user verifies against a dummy hash, so the answer
//! takes as long as for a known user and does not reveal which names exist.

use std::sync::Arc;

use anyhow::Context;
use argon2::password_hash::{PasswordHasher as _, PasswordVerifier as _};
use argon2::{Algorithm, Argon2, Params, Version};
use secrecy::{ExposeSecret, SecretString};
use tokio::sync::Semaphore;
use zhihui_domain::user::PasswordHash;

use crate::configuration::AuthSettings;

/// Shortest password: NIST SP 800-63B's minimum for user-chosen secrets.
pub const PASSWORD_LENGTH_MIN: usize = 8;
/// Longest password: long passphrases are welcome; megabyte "passwords" are a denial of service.
pub const PASSWORD_LENGTH_MAX: usize = 128;
/// Hashes computed at once. Each takes `argon2_memory_kib` of memory and a core for tens of ms;
/// two per core keeps the cores busy without queuing memory.
pub const HASHES_IN_FLIGHT_MAX: usize = 4;

/// A password as typed, valid by construction. Never printed.
#[derive(Debug)]
pub struct PlainPassword(SecretString);

impl PlainPassword {
    pub fn parse(raw: &str) -> Result<PlainPassword, String> {
        let length = raw.chars().count();
        if length < PASSWORD_LENGTH_MIN {
            return Err(format!(
                "must be at least {PASSWORD_LENGTH_MIN} characters long"
            ));
        }
        if length > PASSWORD_LENGTH_MAX {
            return Err(format!(
                "must be at most {PASSWORD_LENGTH_MAX} characters long"
            ));
        }
        if raw.trim().is_empty() {
            return Err("must not be only spaces".into());
        }
        Ok(PlainPassword(SecretString::from(raw)))
    }
}

#[derive(Debug, Clone)]
pub struct Passwords {
    argon2_params: Params,
    /// Verified against when the user does not exist (see the module comment).
    dummy_hash: Arc<str>,
    in_flight: Arc<Semaphore>,
}

impl Passwords {
    pub fn new(settings: &AuthSettings) -> anyhow::Result<Passwords> {
        let argon2_params = Params::new(
            settings.argon2_memory_kib,
            settings.argon2_iterations,
            settings.argon2_parallelism,
            None,
        )
        .map_err(|error| anyhow::anyhow!("auth.argon2_* settings are invalid: {error}"))?;
        let hasher = Argon2::new(Algorithm::Argon2id, Version::V0x13, argon2_params.clone());
        let dummy_hash = hasher
            .hash_password(b"zhihui dummy password, never a real one")
            .map_err(|error| anyhow::anyhow!("hashing the dummy password: {error}"))?
            .to_string();
        Ok(Passwords {
            argon2_params,
            dummy_hash: dummy_hash.into(),
            in_flight: Arc::new(Semaphore::new(HASHES_IN_FLIGHT_MAX)),
        })
    }

    pub async fn hash(&self, password: &PlainPassword) -> anyhow::Result<PasswordHash> {
        let _permit = self
            .in_flight
            .acquire()
            .await
            .context("password hasher closed")?;
        let params = self.argon2_params.clone();
        let secret = password.0.clone();
        let phc = tokio::task::spawn_blocking(move || {
            Argon2::new(Algorithm::Argon2id, Version::V0x13, params)
                .hash_password(secret.expose_secret().as_bytes())
                .map(|hash| hash.to_string())
                .map_err(|error| anyhow::anyhow!("argon2id failed: {error}"))
        })
        .await
        .context("password hashing task")??;
        PasswordHash::parse(&phc).map_err(|error| anyhow::anyhow!("{error}"))
    }

    /// True when `password` matches `hash`. `None` (no such user) costs the same and is false.
    pub async fn verify(
        &self,
        password: &str,
        hash: Option<&PasswordHash>,
    ) -> anyhow::Result<bool> {
        let _permit = self
            .in_flight
            .acquire()
            .await
            .context("password hasher closed")?;
        let known = hash.is_some();
        let phc: String = match hash {
            Some(hash) => hash.expose_phc().to_owned(),
            None => self.dummy_hash.to_string(),
        };
        let secret = SecretString::from(password);
        let matches = tokio::task::spawn_blocking(move || {
            // The verifier takes its parameters from the PHC string, so hashes made with older
            // settings keep verifying after the settings change.
            Argon2::default()
                .verify_password(secret.expose_secret().as_bytes(), phc.as_str())
                .is_ok()
        })
        .await
        .context("password verification task")?;
        Ok(known && matches)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn password_rules_name_the_limit() {
        assert!(
            PlainPassword::parse("short")
                .unwrap_err()
                .contains("at least 8")
        );
        assert!(
            PlainPassword::parse(&"x".repeat(129))
                .unwrap_err()
                .contains("at most 128")
        );
        assert!(PlainPassword::parse("         ").is_err());
        assert!(PlainPassword::parse("correct horse").is_ok());
    }

    #[tokio::test]
    async fn a_hash_verifies_its_password_only_and_unknown_users_never_verify() {
        let settings = crate::configuration::Settings::load(None).unwrap().auth;
        let passwords = Passwords::new(&settings).unwrap();
        let hash = passwords
            .hash(&PlainPassword::parse("correct horse").unwrap())
            .await
            .unwrap();
        assert!(
            hash.expose_phc()
                .starts_with("$argon2id$v=19$m=19456,t=2,p=1$")
        );
        assert!(
            passwords
                .verify("correct horse", Some(&hash))
                .await
                .unwrap()
        );
        assert!(
            !passwords
                .verify("correct horsf", Some(&hash))
                .await
                .unwrap()
        );
        assert!(!passwords.verify("correct horse", None).await.unwrap());
    }
}
