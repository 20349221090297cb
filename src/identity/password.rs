//! Passwords: the rules a new password must meet, argon2id hashing and verification.
//!
//! Hashing is deliberately slow and memory-hungry (that is its point), so it runs on the blocking
//! pool and at most `HASHES_IN_FLIGHT_MAX` at once: a flood of logins queues instead of
//! allocating gigabytes. The queue is bounded too (`auth.password_queue_max` waiting): beyond
//! it a check fails at once with [`HasherBusy`] (429 with `Retry-After`), so a flood of logins to
//! random names costs its senders refusals instead of making every real login wait behind it.
//! A login for an unknown user verifies against a dummy hash, so the answer
//! takes as long as for a known user and does not reveal which names exist.
//!
//! The argon2 memory (19 MiB per hash by default) is ours and reused: letting the crate allocate
//! and free it per hash left each blocking thread's glibc arena holding its own copy (a burst of
//! logins grew the server from 20 to over 300 MB resident, for good). Now the process holds at
//! most `HASHES_IN_FLIGHT_MAX` such blocks.

use std::sync::{Arc, Mutex};
use zhihui_domain::rule::{Broken, Rule};

use anyhow::Context;
use argon2::password_hash::phc::PasswordHash as Phc;
use argon2::password_hash::phc::{Output, ParamsString, Salt};
use argon2::{Algorithm, Argon2, Block, Params, Version};
use rand::Rng as _;
use secrecy::{ExposeSecret, SecretString};
use tokio::sync::Semaphore;
use zhihui_domain::user::PasswordHash;

use crate::platform::configuration::AuthSettings;

/// Shortest password: NIST SP 800-63B's minimum for user-chosen secrets.
pub const PASSWORD_LENGTH_MIN: usize = 8;
/// Longest password: long passphrases are welcome; megabyte "passwords" are a denial of service.
pub const PASSWORD_LENGTH_MAX: usize = 128;
/// Hashes computed at once. Each takes `argon2_memory_kib` of memory (kept for reuse) and a core
/// for tens of ms: more than the cores only queues inside the kernel and costs memory.
pub const HASHES_IN_FLIGHT_MAX: usize = 2;
/// Salt bytes of a new hash (the PHC format's recommendation).
const SALT_LENGTH: usize = 16;

/// A password as typed, valid by construction. Never printed.
#[derive(Debug)]
pub struct PlainPassword(SecretString);

impl PlainPassword {
    pub fn parse(raw: &str) -> Result<PlainPassword, Broken> {
        let length = raw.chars().count();
        if length < PASSWORD_LENGTH_MIN {
            return Err(Broken::new(Rule::LengthAtLeast).with("min", PASSWORD_LENGTH_MIN));
        }
        if length > PASSWORD_LENGTH_MAX {
            return Err(Broken::new(Rule::LengthAtMost).with("max", PASSWORD_LENGTH_MAX));
        }
        if raw.trim().is_empty() {
            return Err(Broken::new(Rule::NotOnlySpaces));
        }
        Ok(PlainPassword(SecretString::from(raw)))
    }
}

/// Every hashing permit is taken and the queue is full: try again in a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("too many password checks are waiting")]
pub struct HasherBusy;

#[derive(Debug, Clone)]
pub struct Passwords {
    argon2_params: Params,
    /// Verified against when the user does not exist (see the module comment).
    dummy_hash: Arc<str>,
    in_flight: Arc<Semaphore>,
    /// Checks waiting for a permit, and the most that may.
    waiting: Arc<std::sync::atomic::AtomicUsize>,
    queue_max: usize,
    memory: ArgonMemory,
}

/// A place in the hashing queue, given back when dropped.
struct Waiting(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Argon2 memory blocks, reused across hashes (see the module comment).
#[derive(Debug, Clone, Default)]
struct ArgonMemory(Arc<Mutex<Vec<Vec<Block>>>>);

impl ArgonMemory {
    /// Run argon2 (`algorithm`, `version`, `params`) over `password` and `salt` into an output
    /// of `output_length` bytes, on blocks taken from the pool and given back.
    fn compute(
        &self,
        argon2: &Argon2<'_>,
        params: &Params,
        password: &[u8],
        salt: &[u8],
        output_length: usize,
    ) -> anyhow::Result<Output> {
        let mut blocks = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop()
            .unwrap_or_default();
        if blocks.len() < params.block_count() {
            blocks.resize(params.block_count(), Block::new());
        }
        let mut output = [0u8; Output::MAX_LENGTH];
        let output = output
            .get_mut(..output_length)
            .context("argon2 output length out of range")?;
        let result = argon2
            .hash_password_into_with_memory(password, salt, output, &mut blocks[..])
            .map_err(|error| anyhow::anyhow!("argon2id failed: {error}"));
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(blocks);
        result?;
        Output::new(output).map_err(|error| anyhow::anyhow!("argon2 output: {error}"))
    }

    /// A new PHC string (`$argon2id$v=19$m=…,t=…,p=…$salt$hash`) for `password`.
    fn hash(&self, params: &Params, password: &[u8]) -> anyhow::Result<String> {
        let mut salt = [0u8; SALT_LENGTH];
        rand::rng().fill(&mut salt);
        let salt = Salt::new(&salt).map_err(|error| anyhow::anyhow!("salt: {error}"))?;
        let argon2 = Argon2::new(Algorithm::Argon2id, Version::V0x13, params.clone());
        let output_length = params.output_len().unwrap_or(Params::DEFAULT_OUTPUT_LEN);
        let output = self.compute(&argon2, params, password, &salt, output_length)?;
        let phc = Phc {
            algorithm: Algorithm::Argon2id.ident(),
            version: Some(Version::V0x13.into()),
            params: ParamsString::try_from(params)
                .map_err(|error| anyhow::anyhow!("argon2 parameters: {error}"))?,
            salt: Some(salt),
            hash: Some(output),
        };
        Ok(phc.to_string())
    }

    /// Whether `password` matches the PHC string `phc`, with the parameters `phc` names (hashes
    /// made with older settings keep verifying after the settings change).
    fn verify(&self, password: &[u8], phc: &str) -> bool {
        let check = || -> anyhow::Result<bool> {
            let parsed = Phc::new(phc).map_err(|error| anyhow::anyhow!("{error}"))?;
            let (Some(salt), Some(expected)) = (&parsed.salt, &parsed.hash) else {
                return Ok(false);
            };
            let params = Params::try_from(&parsed).map_err(|error| anyhow::anyhow!("{error}"))?;
            let algorithm = Algorithm::try_from(parsed.algorithm.as_str())
                .map_err(|error| anyhow::anyhow!("{error}"))?;
            let version = parsed
                .version
                .map(Version::try_from)
                .transpose()
                .map_err(|error| anyhow::anyhow!("{error}"))?
                .unwrap_or_default();
            let argon2 = Argon2::new(algorithm, version, params.clone());
            let computed = self.compute(&argon2, &params, password, salt, expected.len())?;
            // `Output`'s equality is constant-time.
            Ok(computed == *expected)
        };
        check().unwrap_or(false)
    }
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
        let memory = ArgonMemory::default();
        let dummy_hash = memory
            .hash(&argon2_params, b"zhihui dummy password, never a real one")
            .context("hashing the dummy password")?;
        Ok(Passwords {
            argon2_params,
            dummy_hash: dummy_hash.into(),
            in_flight: Arc::new(Semaphore::new(HASHES_IN_FLIGHT_MAX)),
            waiting: Arc::default(),
            queue_max: settings.password_queue_max,
            memory,
        })
    }

    /// A hashing permit: at once when one is free, after a wait when fewer than `queue_max`
    /// wait already, else [`HasherBusy`].
    async fn permit(&self) -> anyhow::Result<tokio::sync::SemaphorePermit<'_>> {
        if let Ok(permit) = self.in_flight.try_acquire() {
            return Ok(permit);
        }
        let place = self
            .waiting
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _waiting = Waiting(self.waiting.clone());
        if place >= self.queue_max {
            return Err(HasherBusy.into());
        }
        self.in_flight
            .acquire()
            .await
            .context("password hasher closed")
    }

    pub async fn hash(&self, password: &PlainPassword) -> anyhow::Result<PasswordHash> {
        let _permit = self.permit().await?;
        let params = self.argon2_params.clone();
        let secret = password.0.clone();
        let memory = self.memory.clone();
        let phc = tokio::task::spawn_blocking(move || {
            memory.hash(&params, secret.expose_secret().as_bytes())
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
        let _permit = self.permit().await?;
        let known = hash.is_some();
        let phc: String = match hash {
            Some(hash) => hash.expose_phc().to_owned(),
            None => self.dummy_hash.to_string(),
        };
        let secret = SecretString::from(password);
        let memory = self.memory.clone();
        let matches = tokio::task::spawn_blocking(move || {
            memory.verify(secret.expose_secret().as_bytes(), &phc)
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
                .to_string()
                .contains("at least 8")
        );
        assert!(
            PlainPassword::parse(&"x".repeat(129))
                .unwrap_err()
                .to_string()
                .contains("at most 128")
        );
        assert!(PlainPassword::parse("         ").is_err());
        assert!(PlainPassword::parse("correct horse").is_ok());
    }

    #[tokio::test]
    async fn past_the_queue_bound_a_check_is_refused_at_once_not_queued() {
        let mut settings = crate::platform::configuration::Settings::load(None)
            .unwrap()
            .auth;
        settings.argon2_memory_kib = 1024;
        settings.argon2_iterations = 1;
        settings.password_queue_max = 1;
        let passwords = Passwords::new(&settings).unwrap();
        // Both permits busy (as two long hashes would hold them).
        let held = passwords
            .in_flight
            .acquire_many(u32::try_from(HASHES_IN_FLIGHT_MAX).unwrap())
            .await
            .unwrap();
        let waiter = {
            let passwords = passwords.clone();
            tokio::spawn(async move { passwords.verify("correct horse", None).await })
        };
        while passwords.waiting.load(std::sync::atomic::Ordering::SeqCst) < 1 {
            tokio::task::yield_now().await;
        }
        // The queue holds one: the next is refused without waiting.
        let refused = passwords.verify("correct horse", None).await.unwrap_err();
        assert!(
            refused.downcast_ref::<HasherBusy>().is_some(),
            "{refused:#}"
        );
        assert_eq!(
            passwords.waiting.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "a refused check leaves no place taken"
        );
        drop(held);
        assert!(
            !waiter.await.unwrap().unwrap(),
            "the waiting one ran once a permit came back"
        );
        assert_eq!(
            passwords.waiting.load(std::sync::atomic::Ordering::SeqCst),
            0
        );
        // Free permits: no queue at all.
        assert!(!passwords.verify("correct horse", None).await.unwrap());
    }

    #[tokio::test]
    async fn a_hash_verifies_its_password_only_and_unknown_users_never_verify() {
        let settings = crate::platform::configuration::Settings::load(None)
            .unwrap()
            .auth;
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

    #[tokio::test]
    async fn hashes_interoperate_with_the_argon2_crates_own_hasher_and_older_parameters() {
        use argon2::password_hash::{PasswordHasher as _, PasswordVerifier as _};
        let settings = crate::platform::configuration::Settings::load(None)
            .unwrap()
            .auth;
        let passwords = Passwords::new(&settings).unwrap();
        // A hash stored before (the crate allocating its own memory), with other parameters.
        let older = Params::new(4_096, 3, 1, None).unwrap();
        let stored = Argon2::new(Algorithm::Argon2id, Version::V0x13, older)
            .hash_password(b"an older password")
            .unwrap()
            .to_string();
        let stored = zhihui_domain::user::PasswordHash::parse(&stored).unwrap();
        assert!(
            passwords
                .verify("an older password", Some(&stored))
                .await
                .unwrap()
        );
        assert!(
            !passwords
                .verify("an older passwore", Some(&stored))
                .await
                .unwrap()
        );
        // A hash of ours verifies with the crate's verifier.
        let ours = passwords
            .hash(&PlainPassword::parse("a newer password").unwrap())
            .await
            .unwrap();
        assert!(
            Argon2::default()
                .verify_password(b"a newer password", ours.expose_phc())
                .is_ok()
        );
    }
}
