//! The settings' sections, one type per `[section]` of `default_settings.toml`, and the formats
//! of the values more than one floor reads (a resolution preset, the mark's corner).

use anyhow::Context;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

/// The development webhook signing key (refused outside development).
pub const DEVELOPMENT_WEBHOOK_KEY: &str =
    "development-only webhook signing key: never use it in production";

/// Webhooks (`src/webhooks/`): how deliveries are signed, retried and kept safe.
#[derive(Debug, Clone, Deserialize)]
pub struct WebhookSettings {
    /// Run the webhook router and sender (one leader across processes).
    pub enabled: bool,
    /// Every endpoint's secret is derived from this key (never stored): at least 32 bytes.
    pub signing_key: SecretString,
    /// Pauses before each retry, in order (Standard Webhooks' schedule, to about three days).
    pub retry_schedule_ms: Vec<u64>,
    /// Each pause varies by up to this share either way, so retries of many messages spread.
    pub retry_jitter_ratio: f64,
    /// A `Retry-After` longer than this is cut to it.
    pub retry_after_max_ms: u64,
    pub connect_timeout_ms: u64,
    /// The whole attempt: connect, send, answer.
    pub timeout_ms: u64,
    /// Bytes of an answer kept in the delivery log (and read at all).
    pub response_bytes_max: usize,
    /// Attempts in flight at once.
    pub concurrency: usize,
    /// Messages taken per round.
    pub batch: i64,
    /// Networks (CIDR) that may be delivered to although private or loopback (e.g. a receiver
    /// in the same data centre). Empty: only public addresses.
    pub allowed_networks: Vec<String>,
    /// An endpoint failing this many attempts in a row, for at least `disable_after_failing_ms`,
    /// is disabled (its owner sees why).
    pub disable_after_failures: u32,
    pub disable_after_failing_ms: u64,
    /// How long the previous secret keeps signing after a rotation.
    pub rotation_overlap_ms: u64,
    /// Endpoints one user may register.
    pub endpoints_per_user_max: i64,
    /// Where receivers reach zhihui: image links in payloads start with it.
    pub public_base_url: String,
}

/// API keys (`src/identity/api_keys.rs`).
#[derive(Debug, Clone, Deserialize)]
pub struct ApiKeySettings {
    /// Requests a minute of a key made without its own figure.
    pub requests_per_minute: u32,
    /// The most a key may be given.
    pub requests_per_minute_max: u32,
}

/// The web app for users and admins (`src/web/`).
#[derive(Debug, Clone, Deserialize)]
pub struct WebSettings {
    /// Serve the pages (the API is served either way).
    pub enabled: bool,
    /// A directory whose templates replace the built-in ones of the same name (an operator's
    /// own wording or layout); empty: the built-in ones only.
    pub templates_directory: String,
    /// The session cookie's `Secure` flag.
    pub cookie_secure: CookieSecure,
}

/// When the session cookie is `Secure` (sent over HTTPS only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CookieSecure {
    /// When the request came over HTTPS (directly, or as `X-Forwarded-Proto` says when
    /// `http.client_ip_from_forwarded` trusts the proxy).
    Auto,
    Always,
    Never,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Environment {
    Development,
    Production,
}

/// The creators' gallery: feeds, the hot ranking, the public pages' caches, the pace of likes.
#[derive(Debug, Clone, Deserialize)]
pub struct GallerySettings {
    /// Works an inbox keeps, newest first.
    pub inbox_max: u32,
    /// A creator with more followers than this is read from at feed time (pulled) instead of
    /// being pushed into every follower's inbox.
    pub push_followers_max: u32,
    /// An inbox nobody read for this long expires; pushes skip it, and it is rebuilt from the
    /// read models when its owner comes back.
    pub inbox_idle_days: u32,
    /// Works the hot ranking keeps.
    pub hot_max: u32,
    /// Works older than this are left out of the hot ranking's recomputation.
    pub hot_window_days: u32,
    /// How often the leader recomputes the hot ranking (ages move every score).
    pub hot_recompute_ms: u64,
    /// How long a cached work or list page is fresh, before a random spread of up to half of it.
    pub cache_ttl_ms: u64,
    /// Works a process keeps in its own cache.
    pub cache_capacity: u64,
    /// Likes and unlikes one user may send per minute.
    pub likes_per_minute: u32,
    /// Follows and unfollows one user may send per minute.
    pub follows_per_minute: u32,
    /// Reports one user may send per hour (of any works).
    pub reports_per_hour: u32,
    /// When Redis may have lost writes it had acknowledged (a master restarted, a replica took
    /// its place), the gallery worker applies the log again from where it stood this long
    /// before it noticed (from the log's beginning if it has not been leading that long).
    pub redis_loss_window_ms: u64,
}

/// Daily check-in: one bonus per user per day, with a streak. The day is `auth.day_utc_offset_minutes`'s.
#[derive(Debug, Clone, Deserialize)]
pub struct CheckInSettings {
    /// Points credited for a check-in (decimal, two places at most).
    pub bonus: rust_decimal::Decimal,
    /// Larger bonuses on every `every_days`-th consecutive day (the largest that falls applies).
    #[serde(default)]
    pub streak_rewards: Vec<StreakRewardSettings>,
    /// Redis keeps a month's bitmap this long after its last write (rebuilt from the events
    /// when read after that).
    pub redis_keep_days: u32,
}

#[derive(Debug, Clone, Deserialize)]
pub struct StreakRewardSettings {
    pub every_days: u32,
    pub bonus: rust_decimal::Decimal,
}

impl CheckInSettings {
    /// The rule as the domain uses it.
    pub fn rule(&self) -> anyhow::Result<zhihui_domain::checkin::BonusRule> {
        use zhihui_domain::checkin::{BonusRule, StreakReward};
        use zhihui_domain::points::Amount;
        let base = Amount::parse(self.bonus)
            .map_err(|error| anyhow::anyhow!("checkins.bonus: {error}"))?;
        let rewards = self
            .streak_rewards
            .iter()
            .enumerate()
            .map(|(index, reward)| {
                anyhow::ensure!(
                    reward.every_days >= 2,
                    "checkins.streak_rewards[{index}].every_days must be at least 2"
                );
                Ok(StreakReward {
                    every_days: reward.every_days,
                    bonus: Amount::parse(reward.bonus).map_err(|error| {
                        anyhow::anyhow!("checkins.streak_rewards[{index}].bonus: {error}")
                    })?,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(BonusRule { base, rewards })
    }
}

/// Flash-sale promotions: the gate in Redis, the claims persisted through a Redis Stream.
#[derive(Debug, Clone, Deserialize)]
pub struct PromotionSettings {
    /// Run a claims consumer in `serve` (every process runs one, in one consumer group).
    pub consumer_enabled: bool,
    /// Entries a consumer reads (and persists concurrently) at a time.
    pub consumer_batch: usize,
    /// How long a consumer's read waits for new entries.
    pub consumer_block_ms: u64,
    /// An entry read by a consumer that has not acknowledged it this long is taken over by
    /// another (the first died).
    pub takeover_idle_ms: u64,
    /// Deliveries of one entry before it is parked (kept with its reason for admins, never
    /// dropped).
    pub deliveries_max: u64,
    /// Entries the claims stream keeps, about (acknowledged ones are trimmed first).
    pub stream_length_max: u64,
    /// Redis keeps a promotion this long after its end.
    pub redis_keep_after_end_ms: u64,
}

/// Statistics for admins: daily active users.
#[derive(Debug, Clone, Deserialize)]
pub struct StatsSettings {
    /// Count every authenticated request's user in the day's HyperLogLog.
    pub active_users_enabled: bool,
    /// A day's key is kept this long.
    pub active_users_retention_days: u32,
    /// Keys per day, each counting the users whose id falls in it: the count's error shrinks
    /// with the square root (1: one HyperLogLog, 0.81 %; 16: about 0.2 %, 16 x 12 KB).
    pub active_users_shards: u32,
    /// Users one process remembers as counted today, at most (beyond it, it forgets them all
    /// and counts again: more PFADDs, never a wrong count).
    pub active_users_remembered_max: usize,
}

/// The development signing key of `default_settings.toml`: refused outside development.
pub const DEVELOPMENT_CODE_KEY: &str =
    "development-only code signing key: never use it in production";

/// The development label key of `default_settings.toml`: refused outside development.
pub const DEVELOPMENT_LABEL_KEY: &str =
    "development-only AIGC label key: never use it in production";

/// AI-generated content labels (GB 45438-2025): see `src/labels/` and README.md.
#[derive(Debug, Clone, Deserialize)]
pub struct LabelSettings {
    /// `ContentProducer`: the provider's name or code (its filing number, for instance).
    pub content_producer: String,
    /// `ContentPropagator`: empty unless zhihui also labels as the propagating platform; when
    /// set, `PropagateID` is the image's id.
    pub content_propagator: String,
    /// `ReservedCode2`, as configured (empty by default).
    pub reserved_code2: String,
    /// The key of `ReservedCode1`'s HMAC, at least 32 bytes. Secret.
    pub signing_key: SecretString,
    /// The visible mark's text, e.g. "AI生成" or "人工智能生成".
    pub text: String,
    pub corner: Corner,
    /// The text's ink height as a share of the image's shorter side (0.05 at least).
    pub height_ratio: f32,
    /// Keep ComfyUI's own PNG text chunks (`prompt`, `workflow`: the whole graph) in what users
    /// download. Off: they are removed.
    pub keep_comfy_metadata: bool,
    /// Keep the image as ComfyUI produced it, readable by admins only.
    pub keep_original: bool,
    /// Images labelled at once (each takes a blocking thread).
    pub workers: usize,
    /// How hard a labelled PNG is compressed: `fast`, `balanced` or `high` (CPU against bytes;
    /// BENCHMARKS.md, `bench_labels`, has the figures).
    pub png_compression: PngCompression,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PngCompression {
    Fast,
    Balanced,
    High,
}

/// Redeem codes: batches of signed codes, each redeemed once.
#[derive(Debug, Clone, Deserialize)]
pub struct CodeSettings {
    /// Signing keys by slot (`"0"` to `"7"`), at least 32 bytes each. Secret.
    pub keys: std::collections::BTreeMap<String, SecretString>,
    /// The slot new batches are signed with.
    pub active_key_slot: u8,
    /// Codes per generated page.
    pub page_size: u32,
    /// How often the generator looks for unfinished batches.
    pub issue_scan_interval_ms: u64,
    /// Failed redemptions per user per window before 429.
    pub failures_max: u32,
    pub failures_window_ms: u64,
    /// Redis keeps a batch and its redeemed markers this long past the batch's window.
    pub redis_keep_after_window_ms: u64,
}

impl CodeSettings {
    /// The keys as the domain uses them.
    pub fn code_keys(&self) -> anyhow::Result<zhihui_domain::redeem::CodeKeys> {
        use zhihui_domain::redeem::{CodeKeys, SigningKey};
        let mut keys = Vec::new();
        for (slot, secret) in &self.keys {
            let slot: u8 = slot
                .parse()
                .with_context(|| format!("codes.keys: slot {slot:?} is not a number 0 to 7"))?;
            let key = SigningKey::new(secret.expose_secret().as_bytes())
                .map_err(|message| anyhow::anyhow!("codes.keys.{slot}: {message}"))?;
            keys.push((slot, key));
        }
        CodeKeys::new(keys, self.active_key_slot)
            .map_err(|message| anyhow::anyhow!("codes: {message}"))
    }
}

/// The task catalog and its limits: models, samplers, schedulers, resolution presets and the bounds of every number. A submit is checked against every one
/// of these, and the error names the field.
#[derive(Debug, Clone, Deserialize)]
pub struct TaskSettings {
    /// Checkpoints the GPU servers have.
    pub models: Vec<String>,
    /// What people read for a checkpoint (its file name stays what requests send and the GPU
    /// servers load). A model without one reads as its file name without the extension.
    #[serde(default)]
    pub model_names: std::collections::BTreeMap<String, String>,
    /// What English pages read for a checkpoint, where its name differs (a Chinese name, say);
    /// a model without one reads as in `model_names`.
    #[serde(default)]
    pub model_names_en: std::collections::BTreeMap<String, String>,
    pub samplers: Vec<String>,
    pub schedulers: Vec<String>,
    pub default_sampler: String,
    pub default_scheduler: String,
    /// `<width>x<height>`; only these sizes (the models are trained for them, and the price is per
    /// image whatever its size).
    pub resolution_presets: Vec<String>,
    pub default_resolution: String,
    /// Images one task may ask for: one task holds one GPU slot for all of them.
    pub images_per_task_max: u32,
    /// Sampling steps: beyond 50 the images stop improving while the GPU time grows.
    pub steps_min: u32,
    pub steps_max: u32,
    pub default_steps: u32,
    /// Classifier-free guidance bounds: outside them images burn out or ignore the prompt.
    pub cfg_min: rust_decimal::Decimal,
    pub cfg_max: rust_decimal::Decimal,
    pub default_cfg: rust_decimal::Decimal,
    /// Characters of a prompt: CLIP reads about 77 tokens per chunk; 1000 characters is many
    /// chunks already, and bounds what translation and storage get.
    pub prompt_length_max: usize,
    pub negative_prompt_length_max: usize,
    /// Points per image (a decimal).
    pub price_per_image: rust_decimal::Decimal,
    /// Points charged for one successful prioritise.
    pub prioritise_fee: rust_decimal::Decimal,
    /// Places a prioritise moves a task ahead, at most.
    pub prioritise_jump_max: u32,
    /// Added before the prompt / after the negative prompt of every task.
    pub prompt_prefix: String,
    pub negative_prompt_suffix: String,
    /// Tasks one user may have waiting: one user cannot fill the queue for everyone.
    pub queued_per_user_max: u32,
    /// A claimed task must be dispatched (or its lease renewed) within this long, else it goes
    /// back to the queue.
    pub claim_lease_ms: u64,
    /// A request that crashed between two streams (e.g. after freezing points, before recording
    /// the task) is resolved by the intent sweeper once it is this old. Longer than any request
    /// takes (translation timeout included), so a request still running is never robbed.
    pub intent_resolve_after_ms: u64,
    /// How often the intent sweeper looks for such requests. Orphans are resolved within
    /// `intent_resolve_after_ms + intent_sweep_interval_ms`.
    pub intent_sweep_interval_ms: u64,
    /// The settlement reconciler repairs a hold still open this long after its task ended (or a
    /// fee not refunded this long after its prioritise was abandoned). The normal path settles
    /// within milliseconds; the margin keeps the reconciler from racing it needlessly (racing is
    /// harmless: every settlement is idempotent).
    pub settlement_after_ms: u64,
    /// How often the settlement reconciler looks.
    pub settlement_interval_ms: u64,
}

/// File extensions of checkpoints, dropped from a name shown to people.
const MODEL_FILE_EXTENSIONS: [&str; 6] = [".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".gguf"];

impl TaskSettings {
    /// The name people read for `model`: the configured one, else the file name without its
    /// extension and with underscores as spaces (`majicmixRealistic_v7.safetensors` reads
    /// `majicmixRealistic v7`).
    pub fn model_name(&self, model: &str) -> String {
        self.model_name_in(model, false)
    }

    /// [`TaskSettings::model_name`], for an English page when `english`.
    pub fn model_name_in(&self, model: &str, english: bool) -> String {
        let english_name = english.then(|| self.model_names_en.get(model)).flatten();
        if let Some(name) = english_name.or_else(|| self.model_names.get(model)) {
            return name.clone();
        }
        let stem = MODEL_FILE_EXTENSIONS
            .iter()
            .find_map(|extension| {
                model
                    .len()
                    .checked_sub(extension.len())
                    .filter(|&at| at > 0 && model.is_char_boundary(at))
                    .filter(|&at| model[at..].eq_ignore_ascii_case(extension))
                    .map(|at| &model[..at])
            })
            .unwrap_or(model);
        stem.replace('_', " ")
    }
}

/// One ComfyUI server of the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendSettings {
    /// Recorded in task events; stable across restarts.
    pub name: String,
    pub url: String,
    /// Prompts in flight on it at once: one runs, the others wait in ComfyUI's own queue (a
    /// second one keeps the GPU busy between two prompts, more only adds waiting there instead of
    /// in our queue, where it can still be prioritised or cancelled cheaply).
    pub capacity: u32,
}

/// Prompts in flight on one server, at most.
pub const BACKEND_CAPACITY_MAX: u32 = 8;

impl BackendSettings {
    /// `"<name> <url> [capacity]"`, e.g. `"gpu-1 http://10.0.0.5:8188 2"` (capacity 1 when absent).
    pub fn parse(spec: &str) -> anyhow::Result<BackendSettings> {
        let parts: Vec<&str> = spec.split_whitespace().collect();
        let (name, url, capacity) = match parts.as_slice() {
            [name, url] => (*name, *url, 1),
            [name, url, capacity] => (
                *name,
                *url,
                capacity.parse().with_context(|| {
                    format!("dispatch.backends: {spec:?}: capacity is not a number")
                })?,
            ),
            _ => anyhow::bail!("dispatch.backends: {spec:?} is not \"<name> <url> [capacity]\""),
        };
        anyhow::ensure!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                && !name.is_empty(),
            "dispatch.backends: the name {name:?} may only have letters, digits, - and _"
        );
        anyhow::ensure!(
            url.starts_with("http://") || url.starts_with("https://"),
            "dispatch.backends: {url:?} is not an http(s) URL"
        );
        anyhow::ensure!(
            (1..=BACKEND_CAPACITY_MAX).contains(&capacity),
            "dispatch.backends: capacity of {name} must be 1 to {BACKEND_CAPACITY_MAX}"
        );
        Ok(BackendSettings {
            name: name.to_owned(),
            url: url.trim_end_matches('/').to_owned(),
            capacity,
        })
    }
}

/// Queue entries one fill may look at: each costs the filler's script a little, and it runs on
/// every freed slot.
pub const QUEUE_SCAN_MAX: usize = 10_000;

/// Staged tasks are committed to one server; more would let a queue jump (prioritise) miss them.
pub const STAGED_PER_BACKEND_MAX: u32 = 8;

/// The dispatcher: the pool of ComfyUI servers and every timing of the saga.
#[derive(Debug, Clone, Deserialize)]
pub struct DispatchSettings {
    /// Run the dispatcher in `serve` (one leader across processes).
    pub enabled: bool,
    /// `"<name> <url> [capacity]"` per server (`ZHIHUI_DISPATCH__BACKENDS`: comma-separated).
    pub backends: Vec<String>,
    /// Where downloaded images are kept (content-addressed).
    pub images_directory: String,
    /// The leader lease: a killed leader is replaced within this plus `leader_retry_ms`.
    pub leader_lease_ms: u64,
    /// How often the leader renews its lease (well within `leader_lease_ms`).
    pub leader_renew_ms: u64,
    /// How often a follower tries to take the lease.
    pub leader_retry_ms: u64,
    /// A slot lease: a prompt's slot comes back this long after its dispatcher stopped renewing.
    pub slot_lease_ms: u64,
    pub slot_renew_ms: u64,
    /// Client pings on each server socket (ComfyUI sends none itself).
    pub socket_ping_interval_ms: u64,
    /// A socket that said nothing (not even a pong) this long is dead: reconnect.
    pub socket_silence_max_ms: u64,
    pub reconnect_backoff_min_ms: u64,
    pub reconnect_backoff_max_ms: u64,
    /// Watchdog: every in-flight prompt is checked through `/queue` and `/history` this often,
    /// so a socket that silently stopped delivering cannot hang a task.
    pub reconcile_interval_ms: u64,
    /// How often the leader looks for tasks in flight that no dispatcher follows (another
    /// leader's, after a takeover).
    pub orphan_scan_interval_ms: u64,
    /// A task running longer is interrupted and fails.
    pub task_timeout_ms: u64,
    /// Every HTTP request to a server.
    pub http_timeout_ms: u64,
    /// Progress notifications per task, at most one per this long.
    pub progress_notify_interval_ms: u64,
    /// `/history` answers `{}` for a moment after the last message: retries, and their spacing.
    pub history_attempts_max: u32,
    pub history_retry_ms: u64,
    /// Interrupt / delete attempts for a cancel or a timeout before it is recorded unconfirmed.
    pub cancel_attempts_max: u32,
    /// The saga's timer: timeouts, renewals, retries.
    pub tick_ms: u64,
    /// Tasks per server recorded as dispatched ahead of a free slot, posted the moment one
    /// frees: enough to hide the store's latency behind the server's work.
    pub staged_per_backend: u32,
    /// Of those, how many are posted at once into the server's own queue, behind the prompts
    /// it runs: when one ends, ComfyUI starts the next itself, with no round trip in between
    /// (the GPU idle gap is then the server's own). A posted task can still be cancelled (it
    /// is deleted from the server's queue) but is committed to that server.
    pub posted_ahead_per_backend: u32,
    /// How often the leader asks each connected server what it offers (`/object_info`) and
    /// which version it runs (also at every connect): new checkpoints are routed to within this.
    pub inspect_interval_ms: u64,
    /// Among the servers that could take a task, send it to the one that ran its model last (a
    /// model switch costs a real GPU seconds to minutes of loading).
    pub prefer_same_model: bool,
    /// With the preference, a server with room looks this many tasks it could run ahead for one
    /// of the model it ran last, and takes it first.
    pub model_affinity_window: u32,
    /// ... but never passes over a task queued this long: the bound on what the preference may
    /// add to anyone's wait.
    pub model_affinity_wait_max_ms: u64,
    /// How often the leader publishes its view of each server (up, prompts in flight, last error)
    /// for `GET /admin/backends`; a view older than 10 s reads as unknown.
    pub status_publish_interval_ms: u64,
    /// Queue entries the filler looks at per fill, at most: a task further back than this behind
    /// tasks no free server can take waits for the next fill.
    pub queue_scan_max: usize,
}

impl DispatchSettings {
    pub fn parsed_backends(&self) -> anyhow::Result<Vec<BackendSettings>> {
        let backends = self
            .backends
            .iter()
            .filter(|spec| !spec.trim().is_empty())
            .map(|spec| BackendSettings::parse(spec))
            .collect::<anyhow::Result<Vec<_>>>()?;
        for (index, backend) in backends.iter().enumerate() {
            anyhow::ensure!(
                !backends[..index]
                    .iter()
                    .any(|other| other.name == backend.name),
                "dispatch.backends: the name {} is used twice",
                backend.name
            );
        }
        Ok(backends)
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct TranslationSettings {
    /// Translate prompts that are not English through Ollama.
    pub enabled: bool,
    /// Base URL of Ollama (its `/api/chat`).
    pub ollama_url: String,
    pub model: String,
    /// Longest wait for a translation; then the original text is used.
    pub timeout_ms: u64,
    /// How long a translation stays cached in Redis.
    pub cache_ttl_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ProjectionSettings {
    /// Run the projection runners in `serve` (one leader per projection across processes).
    pub enabled: bool,
    /// Most events per read-model transaction: big enough to amortise the commit, small enough
    /// to keep the transaction short (it holds the checkpoint row lock).
    pub batch_size: usize,
    /// How often a follower checks whether the leader's lock is free, and the leader checks that
    /// its lock connection is alive. Bounds the takeover time after a leader dies.
    pub takeover_check_ms: u64,
    /// Attempts at a failing batch before looking for the poison event and stopping.
    pub poison_retries_max: u32,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ProcessManagerSettings {
    /// Run the process managers in `serve` (the revenue recorder; one leader each across
    /// processes). They use the `projections` batch size and takeover check.
    pub enabled: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct AccountSettings {
    /// An account's command actor (see `src/platform/aggregate.rs`) forgets its cached state after this
    /// long without commands.
    pub actor_idle_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct AuthSettings {
    /// `POST /api/v1/auth/register` answers 403 when false (invite-only deployments); admins
    /// are then created with `zhihui users create`.
    pub registration_enabled: bool,
    /// A bearer token dies after this long without use; each use renews it.
    pub session_idle_ttl_ms: u64,
    /// A phone login code is valid this long after it is sent.
    pub code_ttl_ms: u64,
    /// At most one code per phone per this interval (SMS costs money and annoys people).
    pub code_send_interval_ms: u64,
    /// At most this many codes per phone per calendar day.
    pub code_sends_per_day_max: u32,
    /// This many wrong codes in a row lock the phone.
    pub code_failures_max: u32,
    /// How long such a lock lasts.
    pub code_lockout_ms: u64,
    /// A socket ticket (`POST /api/v1/ws/ticket`) opens one socket within this long.
    pub ws_ticket_ttl_ms: u64,
    /// Logins from one client (IP address) per minute, at most (429 `too-many-logins`): a flood
    /// of logins to random names from one client is refused before any password is hashed.
    pub logins_per_client_per_minute: u32,
    /// Login-code requests from one client per hour, at most (429 `too-many-code-requests`):
    /// one client cannot send codes to any number of phones.
    pub code_requests_per_client_per_hour: u32,
    /// Login codes sent per minute overall, at most (429 `code-requests-busy`): a ceiling on
    /// what the SMS sender is asked to do, whoever asks.
    pub code_requests_per_minute_max: u32,
    /// Who delivers codes: `log` (development only: the code goes to the log) or `disabled`.
    pub code_sender: CodeSenderKind,
    /// Offset from UTC of the calendar day used by daily limits (480 = UTC+8).
    pub day_utc_offset_minutes: i32,
    /// This many wrong passwords in a row from one source (a client address, or a browser that
    /// logged in as the user before) lock that source out of the username.
    pub password_failures_max: u32,
    /// This many wrong passwords from every address together lock the username for browsers
    /// it was never logged in from (a guesser spread over many addresses).
    pub password_failures_max_all_sources: u32,
    /// How long such a lock lasts.
    pub password_lockout_ms: u64,
    /// A username or phone claim whose user was never recorded (a crash between the two appends)
    /// is released by the next registration once it is this old; long enough that a registration
    /// still in flight is never robbed.
    pub orphan_claim_release_ms: u64,
    /// argon2id memory cost (KiB). 19456 with 2 iterations is OWASP's recommended minimum.
    pub argon2_memory_kib: u32,
    pub argon2_iterations: u32,
    pub argon2_parallelism: u32,
    /// Password checks waiting for one of the hashing permits, at most; beyond, a login or
    /// registration is answered 429 with `Retry-After` at once instead of queueing (a flood of
    /// logins to random names must not delay every real one without bound).
    pub password_queue_max: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CodeSenderKind {
    /// Write the code to the log (development only: refused in any other environment).
    Log,
    /// Send no codes: phone login is off (`POST /auth/code` answers 503
    /// `phone-login-disabled`), until an SMS sender is configured.
    Disabled,
}

#[derive(Debug, Clone, Deserialize)]
pub struct EventStoreSettings {
    /// Empty: PostgreSQL (the database of `database.url`). `kurrentdb://...` or `esdb://...`:
    /// KurrentDB / EventStoreDB, e.g. `esdb://localhost:2113?tls=false` for a local dev server.
    /// Secret: may carry credentials.
    pub url: SecretString,
    /// PostgreSQL: let concurrent appends share one transaction (one fsync per batch).
    pub group_commit: bool,
    /// PostgreSQL: most appends per group-commit transaction; bounds lock hold time.
    pub group_commit_max_batch: usize,
    /// PostgreSQL: writer tasks committing batches in parallel (each holds a pooled connection).
    pub group_commit_writers: usize,
    /// PostgreSQL: a group-commit batch as one statement (`zhihui_append_batch`) rather than
    /// one `zhihui_append` per append.
    pub group_commit_one_statement: bool,
    /// PostgreSQL: re-queues of an append that met a newer transaction on its stream.
    pub append_retries_max: u32,
    /// Events per round trip when subscriptions read the log.
    pub subscription_batch_size: usize,
    /// PostgreSQL: the newest events of the log kept in memory for this process's
    /// subscriptions, read once for all of them (`event_store::tail`); 0 (the default): each
    /// reads alone. It takes reads off PostgreSQL and adds decoding to the process.
    pub subscription_tail_events: usize,
    /// PostgreSQL: ceiling of the re-check backoff while an unfinished transaction holds the
    /// global log's horizon back.
    pub held_back_recheck_max_ms: u64,
    /// PostgreSQL: a subscription with no wake-up for this long reads anyway, so an event whose
    /// process died between its commit and its notification is late by at most this.
    pub subscription_idle_recheck_ms: u64,
    /// PostgreSQL: longest `read_all` waits for older in-flight transactions to finish so that
    /// it includes the caller's own committed appends.
    pub read_all_settle_max_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct HttpSettings {
    /// Address to bind; `127.0.0.1` locally, `0.0.0.0` in a container.
    pub host: String,
    /// Port to bind; 0 lets the OS choose (tests).
    pub port: u16,
    /// actix-web worker threads. Defaults to the number of cores.
    pub workers: Option<usize>,
    /// Each worker's requests take PostgreSQL and Redis connections of the worker's own, driven
    /// on its thread (`worker_local`): less CPU per request and more reads per second. The task
    /// commands (submit, prioritise, cancel) then run on the main runtime with the shared
    /// connections, so that their CPU does not hold up the I/O of the cheap requests on the
    /// worker (BENCHMARKS.md, "Fourth pass"). Off: every request runs on its worker with the
    /// process's shared connections.
    pub worker_local_connections: bool,
    /// Serve `GET /metrics` on this port of `host` only (0: the OS chooses), not on `port`: the
    /// API can face users while the metrics stay on an internal port. Unset: on `port`.
    pub metrics_port: Option<u16>,
    /// How long in-flight requests may run after SIGINT/SIGTERM before being dropped.
    pub shutdown_timeout_ms: u64,
    /// A GET or HEAD not answered within this long is answered 503 with `Retry-After`: a store
    /// that stops answering without closing its connections (a paused server, a network
    /// partition) would otherwise hold the request for as long as it stays away.
    pub read_deadline_ms: u64,
    /// The same for every other method. Longer than `database.failover_wait_ms`, which a write
    /// whose outcome is unknown spends finding a new primary.
    pub write_deadline_ms: u64,
    /// A user socket is pinged this often, and its session checked (expired or revoked: the
    /// socket closes); a peer silent for two intervals is dropped.
    pub socket_ping_interval_ms: u64,
    /// Open sockets per user in one process, at most; beyond, 429 `too-many-sockets`.
    pub sockets_per_user_max: usize,
    /// Take the client's address from the first `X-Forwarded-For` entry (only behind a proxy
    /// that sets it: otherwise a client names any address and escapes the per-client limits).
    pub client_ip_from_forwarded: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct DatabaseSettings {
    /// `postgres://user:password@host:port/dbname`. Secret: may carry a password.
    pub url: SecretString,
    /// Connections in the pool. Bounded so many instances cannot exhaust `max_connections`.
    pub pool_max_size: usize,
    /// With `http.worker_local_connections`: connections in each HTTP worker's own pool (see
    /// `worker_local`). At most `http.workers` times this many beside `pool_max_size`, opened
    /// as the requests need them.
    pub worker_pool_max_size: usize,
    /// How long a request waits for a pooled connection before failing.
    pub pool_wait_timeout_ms: u64,
    /// How long opening one new connection may take.
    pub connect_timeout_ms: u64,
    /// Run pending migrations when `serve` starts.
    pub migrate_on_start: bool,
    /// How long an append whose outcome is unknown (the connection broke: the primary died) is
    /// tried again, while a multi-host `url` with `target_session_attrs=read-write` finds the
    /// new primary. Safe to repeat: the event ids decide, so it lands exactly once.
    pub failover_wait_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RedisSettings {
    /// `redis://[:password@]host:port[/db]`. Secret: may carry a password.
    pub url: SecretString,
    /// Redis Cluster: seed nodes, `redis://host:port` separated by commas (any few of the
    /// cluster's nodes; the rest are found from them). Empty: one Redis at `url`. Secret: the
    /// URLs may carry a password.
    pub cluster_nodes: SecretString,
    /// Prepended to every key, so several deployments (or tests) can share one Redis.
    pub key_prefix: String,
    /// How long opening the connection may take.
    pub connect_timeout_ms: u64,
    /// How long one command may take before it counts as failed.
    pub response_timeout_ms: u64,
    /// Replicas that must hold a revocation (a logout, a password or role change, a revoked API
    /// key) before it is answered as done (`WAIT`): replication is asynchronous, and a replica
    /// promoted without it would bring the revoked session back. 0: no wait (one node).
    pub revocation_replicas: u32,
    /// How long a revocation waits for those replicas before it fails (503, try again).
    pub revocation_wait_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines, for a terminal.
    Pretty,
    /// One JSON object per line, for log collectors.
    Json,
}

#[derive(Debug, Clone, Deserialize)]
pub struct LogSettings {
    pub format: LogFormat,
    /// An `EnvFilter` directive, e.g. `info,zhihui=debug`. `RUST_LOG` overrides it.
    pub filter: String,
}

impl DatabaseSettings {
    /// Parsed connection parameters (the URL stays secret; only this config object sees it).
    pub fn pg_config(&self) -> anyhow::Result<tokio_postgres::Config> {
        let mut pg_config: tokio_postgres::Config = self
            .url
            .expose_secret()
            .parse()
            .context("database.url is not a valid PostgreSQL URL")?;
        pg_config.connect_timeout(std::time::Duration::from_millis(self.connect_timeout_ms));
        Ok(pg_config)
    }
}

/// Where the mark sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Corner {
    TopLeft,
    TopRight,
    BottomLeft,
    BottomRight,
}

/// A server's published status older than this is not the dispatcher leader's current view (it
/// is gone, or stuck): the pool reads it as "unknown". `dispatch.status_publish_interval_ms` is
/// at most half of it, so a live leader's view never reads as stale.
pub const STATUS_STALE_MS: i64 = 10_000;

/// Resolution bounds of a preset: multiples of 8 (the latent is 1/8 of the image).
const SIDE_MIN: u32 = 64;
const SIDE_MAX: u32 = 2048;

/// `<width>x<height>`, both multiples of 8 within bounds.
pub fn parse_resolution(preset: &str) -> Option<(u32, u32)> {
    let (width, height) = preset.split_once('x')?;
    let width: u32 = width.parse().ok()?;
    let height: u32 = height.parse().ok()?;
    let fits = |side: u32| (SIDE_MIN..=SIDE_MAX).contains(&side) && side.is_multiple_of(8);
    (fits(width) && fits(height)).then_some((width, height))
}
