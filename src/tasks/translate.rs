//! Translation of prompts to English through Ollama's chat API (`POST /api/chat`), with a Redis
//! cache. Translation never fails a task: text that is already English is not sent, and on a
//! timeout, an error or an answer that does not look like a translation the original is used.

use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::platform::configuration::TranslationSettings;
use crate::platform::redis_store::RedisStore;

/// A translation longer than this many times its source (plus a margin) is not a translation but
/// a model rambling; the original is used instead.
pub const TRANSLATION_GROWTH_MAX: usize = 4;
const TRANSLATION_GROWTH_MARGIN_CHARS: usize = 200;

/// What the system prompt asks of the model.
const INSTRUCTION: &str = "You translate prompts for an image generator into English. Answer \
with the English translation only: no quotes, no notes, no explanations. Keep the meaning, the \
order, the punctuation and any weights such as (word:1.2).";

/// Where a prompt's English text came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Already English (or empty): not sent.
    Original,
    Cached,
    Translated,
    /// Translation failed; the original is used. The reason is logged.
    Fallback(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Translation {
    pub text: String,
    pub source: Source,
}

/// Text is taken as English when it has no letter outside ASCII. Accented Latin letters are sent
/// (French, German... need translating too); digits, punctuation and weights are ASCII.
pub fn is_english(text: &str) -> bool {
    text.chars().all(|c| c.is_ascii() || !c.is_alphabetic())
}

#[derive(Debug, Deserialize)]
struct ChatResponse {
    message: ChatMessage,
}

#[derive(Debug, Deserialize)]
struct ChatMessage {
    content: String,
}

#[derive(Debug, Clone)]
pub struct Translator {
    http: reqwest::Client,
    settings: TranslationSettings,
    redis: RedisStore,
}

impl Translator {
    pub fn new(settings: TranslationSettings, redis: RedisStore) -> anyhow::Result<Translator> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(settings.timeout_ms))
            .connect_timeout(Duration::from_millis(settings.timeout_ms))
            .build()?;
        Ok(Translator {
            http,
            settings,
            redis,
        })
    }

    fn cache_key(&self, text: &str) -> String {
        let digest = Sha256::new()
            .chain_update(self.settings.model.as_bytes())
            .chain_update([0u8])
            .chain_update(text.as_bytes())
            .finalize();
        let hex: String = digest.iter().map(|byte| format!("{byte:02x}")).collect();
        self.redis.key(&format!("translation:{hex}"))
    }

    /// English text for `text` (see the module comment); never fails.
    pub async fn to_english(&self, text: &str) -> Translation {
        if !self.settings.enabled || text.trim().is_empty() || is_english(text) {
            return Translation {
                text: text.to_owned(),
                source: Source::Original,
            };
        }
        let key = self.cache_key(text);
        match self.cached(&key).await {
            Ok(Some(cached)) => {
                return Translation {
                    text: cached,
                    source: Source::Cached,
                };
            }
            Ok(None) => {}
            // The cache is an optimisation: without Redis, ask Ollama.
            Err(error) => {
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "translation cache unavailable")
            }
        }
        match self.ask_ollama(text).await {
            Ok(translated) => {
                if let Err(error) = self.remember(&key, &translated).await {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "translation not cached");
                }
                Translation {
                    text: translated,
                    source: Source::Translated,
                }
            }
            Err(error) => {
                let reason = crate::platform::telemetry::error_chain(&error);
                tracing::warn!(error = %reason, "translation failed; using the original text");
                Translation {
                    text: text.to_owned(),
                    source: Source::Fallback(reason),
                }
            }
        }
    }

    async fn cached(&self, key: &str) -> anyhow::Result<Option<String>> {
        let mut connection = self.redis.connection().await?;
        let value: Option<String> = redis::cmd("GET")
            .arg(key)
            .query_async(&mut connection)
            .await?;
        Ok(value)
    }

    async fn remember(&self, key: &str, translated: &str) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let () = redis::cmd("SET")
            .arg(key)
            .arg(translated)
            .arg("PX")
            .arg(self.settings.cache_ttl_ms)
            .query_async(&mut connection)
            .await?;
        Ok(())
    }

    async fn ask_ollama(&self, text: &str) -> anyhow::Result<String> {
        use anyhow::Context;
        let url = format!(
            "{}/api/chat",
            self.settings.ollama_url.trim_end_matches('/')
        );
        let response = self
            .http
            .post(&url)
            .json(&json!({
                "model": self.settings.model,
                "stream": false,
                "options": {"temperature": 0},
                "messages": [
                    {"role": "system", "content": INSTRUCTION},
                    {"role": "user", "content": text},
                ],
            }))
            .send()
            .await
            .context("calling Ollama")?
            .error_for_status()
            .context("Ollama answered an error")?;
        let answer: ChatResponse = response
            .json()
            .await
            .context("Ollama's answer is not a chat response")?;
        let translated = answer.message.content.trim();
        let limit = text.chars().count() * TRANSLATION_GROWTH_MAX + TRANSLATION_GROWTH_MARGIN_CHARS;
        anyhow::ensure!(
            !translated.is_empty(),
            "Ollama answered an empty translation"
        );
        anyhow::ensure!(
            translated.chars().count() <= limit,
            "Ollama's translation is longer than {limit} characters"
        );
        anyhow::ensure!(
            !translated
                .chars()
                .any(|c| c.is_control() && !matches!(c, '\n' | '\r' | '\t')),
            "Ollama's translation contains control characters"
        );
        Ok(translated.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn english_is_ascii_letters_whatever_the_punctuation() {
        assert!(is_english("a cat, (masterpiece:1.2), 8k"));
        assert!(is_english("猫".trim_start_matches('猫')));
        assert!(!is_english("一只猫"));
        assert!(!is_english("café au lait"));
        assert!(is_english("emoji 🐱 are not letters"));
    }
}
