//! Typed, layered settings: built-in defaults, then an optional TOML file, then `ZHIHUI_`
//! environment variables (`ZHIHUI_DATABASE__URL`, `ZHIHUI_REDIS__KEY_PREFIX`, ...; a double
//! underscore separates levels).
//!
//! Every timeout and pool size is a named setting with its unit in the name. Secrets (the database
//! and Redis URLs may carry passwords) are [`SecretString`]s: their `Debug` output is redacted, so
//! logging the settings never leaks them.

use std::path::Path;

use anyhow::Context;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

/// Environment variable prefix for every setting.
pub const ENV_PREFIX: &str = "ZHIHUI";

#[derive(Debug, Clone, Deserialize)]
pub struct Settings {
    pub environment: Environment,
    pub http: HttpSettings,
    pub database: DatabaseSettings,
    pub redis: RedisSettings,
    pub event_store: EventStoreSettings,
    pub auth: AuthSettings,
    pub projections: ProjectionSettings,
    pub process_managers: ProcessManagerSettings,
    pub accounts: AccountSettings,
    pub tasks: TaskSettings,
    pub translation: TranslationSettings,
    pub dispatch: DispatchSettings,
    pub codes: CodeSettings,
    pub checkins: CheckInSettings,
    pub stats: StatsSettings,
    pub promotions: PromotionSettings,
    pub labels: LabelSettings,
    pub web: WebSettings,
    pub api_keys: ApiKeySettings,
    pub webhooks: WebhookSettings,
    pub log: LogSettings,
}

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

/// API keys (`src/api_keys.rs`).
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

/// Daily check-in (PRODUCT.md section 4). The day is `auth.day_utc_offset_minutes`'s.
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
    pub corner: crate::labels::mark::Corner,
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

/// Redeem codes (PRODUCT.md section 4).
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

/// The task catalog and its limits (PRODUCT.md section 2). A submit is checked against every one
/// of these, and the error names the field.
#[derive(Debug, Clone, Deserialize)]
pub struct TaskSettings {
    /// Checkpoints the GPU servers have.
    pub models: Vec<String>,
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
    /// An account's command actor (see `src/aggregate.rs`) forgets its cached state after this
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
    /// This many wrong passwords in a row lock a username.
    pub password_failures_max: u32,
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

/// The defaults, as TOML, so that the file format and the defaults can never disagree.
const DEFAULTS_TOML: &str = include_str!("default_settings.toml");

impl Settings {
    /// Load defaults, then `file` if given, then `ZHIHUI_*` environment variables.
    /// The built-in defaults alone (no file, no environment): tests and benchmarks.
    pub fn defaults() -> anyhow::Result<Settings> {
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from_str(
                DEFAULTS_TOML,
                config::FileFormat::Toml,
            ))
            .build()
            .context("reading the default settings")?
            .try_deserialize()
            .context("the default settings do not match the expected shape")?;
        settings.validate()?;
        Ok(settings)
    }

    pub fn load(file: Option<&Path>) -> anyhow::Result<Settings> {
        let mut builder = config::Config::builder().add_source(config::File::from_str(
            DEFAULTS_TOML,
            config::FileFormat::Toml,
        ));
        if let Some(path) = file {
            builder = builder.add_source(config::File::from(path).required(true));
        }
        builder = builder.add_source(
            config::Environment::with_prefix(ENV_PREFIX)
                .prefix_separator("_")
                .separator("__")
                .try_parsing(true)
                .list_separator(",")
                .with_list_parse_key("dispatch.backends")
                .with_list_parse_key("webhooks.allowed_networks")
                .with_list_parse_key("webhooks.retry_schedule_ms"),
        );
        let settings: Settings = builder
            .build()
            .context("reading settings")?
            .try_deserialize()
            .context("settings do not match the expected shape")?;
        settings.validate()?;
        Ok(settings)
    }

    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.database.pool_max_size >= 1 && self.database.worker_pool_max_size >= 1,
            "database.pool_max_size and database.worker_pool_max_size must be at least 1"
        );
        anyhow::ensure!(
            self.event_store.subscription_tail_events == 0
                || self.event_store.subscription_tail_events
                    >= self.event_store.subscription_batch_size,
            "event_store.subscription_tail_events must be 0 (off) or at least subscription_batch_size"
        );
        anyhow::ensure!(
            self.event_store.group_commit_max_batch >= 1
                && self.event_store.group_commit_writers >= 1
                && self.event_store.subscription_batch_size >= 1
                && self.event_store.subscription_idle_recheck_ms >= 1,
            "event_store.group_commit_max_batch, group_commit_writers, subscription_batch_size and subscription_idle_recheck_ms must be at least 1"
        );
        anyhow::ensure!(
            self.event_store.group_commit_writers < self.database.pool_max_size,
            "event_store.group_commit_writers must be below database.pool_max_size, or writers starve every other query"
        );
        anyhow::ensure!(
            self.auth.session_idle_ttl_ms >= 1_000
                && self.auth.ws_ticket_ttl_ms >= 1_000
                && self.auth.logins_per_client_per_minute >= 1
                && self.auth.code_requests_per_client_per_hour >= 1
                && self.auth.code_requests_per_minute_max >= 1
                && self.auth.code_ttl_ms >= 1_000
                && self.auth.code_failures_max >= 1
                && self.auth.password_failures_max >= 1
                && self.auth.code_sends_per_day_max >= 1,
            "auth: ttls must be at least 1000 ms and every *_max at least 1"
        );
        anyhow::ensure!(
            self.projections.batch_size >= 1 && self.projections.poison_retries_max >= 1,
            "projections.batch_size and projections.poison_retries_max must be at least 1"
        );
        anyhow::ensure!(
            self.auth.day_utc_offset_minutes.abs() <= 14 * 60,
            "auth.day_utc_offset_minutes must be within -840..=840"
        );
        anyhow::ensure!(
            !self.redis.key_prefix.is_empty(),
            "redis.key_prefix must not be empty: every key needs a namespace"
        );
        anyhow::ensure!(
            !self.redis.key_prefix.contains(['{', '}']),
            "redis.key_prefix must not contain '{{' or '}}': Redis Cluster would take it for a key's hash tag"
        );
        anyhow::ensure!(
            self.http.socket_ping_interval_ms >= 10 && self.http.sockets_per_user_max >= 1,
            "http.socket_ping_interval_ms must be at least 10 and http.sockets_per_user_max at least 1"
        );
        self.validate_tasks()?;
        self.validate_dispatch()?;
        self.validate_codes()?;
        self.validate_labels()?;
        self.validate_webhooks()?;
        anyhow::ensure!(
            self.environment == Environment::Development
                || self.auth.code_sender != CodeSenderKind::Log,
            "auth.code_sender = \"log\" writes login codes to the log: development only; set ZHIHUI_AUTH__CODE_SENDER=disabled (phone login off) outside development"
        );
        self.checkins.rule()?;
        anyhow::ensure!(
            self.checkins.redis_keep_days >= 62,
            "checkins.redis_keep_days must be at least 62 (a streak reads this month and the last)"
        );
        anyhow::ensure!(
            self.stats.active_users_retention_days >= 1
                && self.stats.active_users_remembered_max >= 1
                && (1..=256).contains(&self.stats.active_users_shards),
            "stats: active_users_retention_days and active_users_remembered_max must be at least 1, active_users_shards 1 to 256"
        );
        Ok(())
    }

    fn validate_codes(&self) -> anyhow::Result<()> {
        let codes = &self.codes;
        codes.code_keys()?;
        if self.environment != Environment::Development {
            for (slot, secret) in &codes.keys {
                anyhow::ensure!(
                    secret.expose_secret() != DEVELOPMENT_CODE_KEY,
                    "codes.keys.{slot} is the development key, refused outside development: set ZHIHUI_CODES__KEYS__{slot} to a secret of at least 32 bytes"
                );
            }
        }
        anyhow::ensure!(
            codes.page_size >= 1
                && codes.failures_max >= 1
                && codes.failures_window_ms >= 1_000
                && codes.issue_scan_interval_ms >= 1,
            "codes: page_size, failures_max and issue_scan_interval_ms must be at least 1, failures_window_ms at least 1000"
        );
        Ok(())
    }

    fn validate_webhooks(&self) -> anyhow::Result<()> {
        let webhooks = &self.webhooks;
        anyhow::ensure!(
            webhooks.signing_key.expose_secret().len() >= 32,
            "webhooks.signing_key must have at least 32 bytes"
        );
        anyhow::ensure!(
            self.environment == Environment::Development
                || webhooks.signing_key.expose_secret() != DEVELOPMENT_WEBHOOK_KEY,
            "webhooks.signing_key is the development key, refused outside development: set ZHIHUI_WEBHOOKS__SIGNING_KEY to a secret of at least 32 bytes"
        );
        anyhow::ensure!(
            !webhooks.retry_schedule_ms.is_empty() && webhooks.retry_schedule_ms.len() <= 32,
            "webhooks.retry_schedule_ms needs 1 to 32 pauses"
        );
        anyhow::ensure!(
            (0.0..1.0).contains(&webhooks.retry_jitter_ratio),
            "webhooks.retry_jitter_ratio must be 0 or more and below 1"
        );
        anyhow::ensure!(
            (1..=256).contains(&webhooks.concurrency) && webhooks.batch >= 1,
            "webhooks.concurrency must be 1 to 256 and webhooks.batch at least 1"
        );
        for network in &webhooks.allowed_networks {
            crate::webhooks::safety::Network::parse(network)
                .with_context(|| format!("webhooks.allowed_networks: {network:?}"))?;
        }
        Ok(())
    }

    fn validate_labels(&self) -> anyhow::Result<()> {
        let labels = &self.labels;
        // Builds the mark: the text's glyphs and the height ratio are checked here, at start.
        crate::labels::mark::Mark::new(&labels.text, labels.corner, labels.height_ratio)?;
        anyhow::ensure!(
            labels.signing_key.expose_secret().len() >= 32,
            "labels.signing_key must have at least 32 bytes"
        );
        anyhow::ensure!(
            self.environment == Environment::Development
                || labels.signing_key.expose_secret() != DEVELOPMENT_LABEL_KEY,
            "labels.signing_key is the development key, refused outside development: set ZHIHUI_LABELS__SIGNING_KEY to a secret of at least 32 bytes"
        );
        for (name, value) in [
            ("labels.content_producer", &labels.content_producer),
            ("labels.content_propagator", &labels.content_propagator),
            ("labels.reserved_code2", &labels.reserved_code2),
        ] {
            anyhow::ensure!(
                value.chars().count() <= 256 && !value.chars().any(char::is_control),
                "{name} must have at most 256 characters and no control characters"
            );
        }
        anyhow::ensure!(
            !labels.content_producer.trim().is_empty(),
            "labels.content_producer must name the provider (its name or code)"
        );
        anyhow::ensure!(
            (1..=64).contains(&labels.workers),
            "labels.workers must be 1 to 64"
        );
        Ok(())
    }

    fn validate_dispatch(&self) -> anyhow::Result<()> {
        let dispatch = &self.dispatch;
        dispatch.parsed_backends()?;
        anyhow::ensure!(
            dispatch.leader_renew_ms * 2 <= dispatch.leader_lease_ms
                && dispatch.slot_renew_ms * 2 <= dispatch.slot_lease_ms,
            "dispatch: renew the leader and slot leases at least twice per lease (*_renew_ms <= *_lease_ms / 2)"
        );
        anyhow::ensure!(
            dispatch.socket_ping_interval_ms < dispatch.socket_silence_max_ms,
            "dispatch.socket_silence_max_ms must exceed socket_ping_interval_ms"
        );
        anyhow::ensure!(
            dispatch.reconnect_backoff_min_ms >= 1
                && dispatch.reconnect_backoff_min_ms <= dispatch.reconnect_backoff_max_ms,
            "dispatch: reconnect_backoff_min_ms must be at least 1 and at most reconnect_backoff_max_ms"
        );
        anyhow::ensure!(
            dispatch.tick_ms >= 1
                && dispatch.tick_ms <= dispatch.leader_renew_ms
                && dispatch.history_attempts_max >= 1
                && dispatch.cancel_attempts_max >= 1
                && dispatch.task_timeout_ms >= 1_000,
            "dispatch: tick_ms must be 1..=leader_renew_ms, *_attempts_max at least 1, task_timeout_ms at least 1000"
        );
        anyhow::ensure!(
            dispatch.staged_per_backend <= STAGED_PER_BACKEND_MAX,
            "dispatch.staged_per_backend must be 0 to {STAGED_PER_BACKEND_MAX}"
        );
        anyhow::ensure!(
            dispatch.posted_ahead_per_backend <= dispatch.staged_per_backend,
            "dispatch.posted_ahead_per_backend must be 0 to staged_per_backend ({}): only staged tasks are posted ahead",
            dispatch.staged_per_backend
        );
        anyhow::ensure!(
            dispatch.model_affinity_window as usize <= dispatch.queue_scan_max,
            "dispatch.model_affinity_window must be at most queue_scan_max ({})",
            dispatch.queue_scan_max
        );
        anyhow::ensure!(
            (1..=QUEUE_SCAN_MAX).contains(&dispatch.queue_scan_max),
            "dispatch.queue_scan_max must be 1 to {QUEUE_SCAN_MAX}"
        );
        anyhow::ensure!(
            (1..=crate::tasks::pool::STATUS_STALE_MS as u64 / 2)
                .contains(&dispatch.status_publish_interval_ms),
            "dispatch.status_publish_interval_ms must be 1 to {}: a view older than {} ms reads as unknown",
            crate::tasks::pool::STATUS_STALE_MS / 2,
            crate::tasks::pool::STATUS_STALE_MS
        );
        anyhow::ensure!(
            dispatch.inspect_interval_ms >= 1_000,
            "dispatch.inspect_interval_ms must be at least 1000: every server is asked its models that often"
        );
        Ok(())
    }

    fn validate_tasks(&self) -> anyhow::Result<()> {
        let tasks = &self.tasks;
        anyhow::ensure!(
            !tasks.models.is_empty() && !tasks.samplers.is_empty() && !tasks.schedulers.is_empty(),
            "tasks.models, tasks.samplers and tasks.schedulers must not be empty"
        );
        anyhow::ensure!(
            tasks.samplers.contains(&tasks.default_sampler)
                && tasks.schedulers.contains(&tasks.default_scheduler)
                && tasks.resolution_presets.contains(&tasks.default_resolution),
            "tasks.default_sampler, default_scheduler and default_resolution must be in their lists"
        );
        for preset in &tasks.resolution_presets {
            anyhow::ensure!(
                crate::tasks::catalog::parse_resolution(preset).is_some(),
                "tasks.resolution_presets: {preset:?} is not <width>x<height> (multiples of 8, 64 to 2048)"
            );
        }
        anyhow::ensure!(
            tasks.images_per_task_max >= 1
                && tasks.steps_min >= 1
                && tasks.steps_min <= tasks.default_steps
                && tasks.default_steps <= tasks.steps_max
                && tasks.cfg_min <= tasks.default_cfg
                && tasks.default_cfg <= tasks.cfg_max
                && tasks.prompt_length_max >= 1
                && tasks.queued_per_user_max >= 1
                && tasks.prioritise_jump_max >= 1,
            "tasks: every *_max must be at least 1 and every default within its bounds"
        );
        anyhow::ensure!(
            zhihui_domain::points::Amount::parse(tasks.price_per_image).is_ok()
                && zhihui_domain::points::Amount::parse(tasks.prioritise_fee).is_ok(),
            "tasks.price_per_image and tasks.prioritise_fee must be positive with at most two decimals"
        );
        anyhow::ensure!(
            tasks.intent_resolve_after_ms > 2 * self.translation.timeout_ms + 10_000,
            "tasks.intent_resolve_after_ms must exceed two translation timeouts plus 10 s: a submit still running must never be taken for a crashed one"
        );
        anyhow::ensure!(
            tasks.settlement_interval_ms >= 1,
            "tasks.settlement_interval_ms must be at least 1"
        );
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_and_are_valid() {
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from_str(
                DEFAULTS_TOML,
                config::FileFormat::Toml,
            ))
            .build()
            .and_then(|c| c.try_deserialize())
            .expect("defaults deserialize");
        settings.validate().expect("defaults are valid");
        assert_eq!(settings.log.format, LogFormat::Pretty);
    }

    #[test]
    fn production_refuses_the_development_code_key_and_keys_never_print() {
        let mut settings = Settings::load(None).expect("defaults load");
        settings.environment = Environment::Production;
        let refused = settings
            .validate()
            .expect_err("the development key is refused");
        assert!(refused.to_string().contains("codes.keys.0"), "{refused}");
        settings.codes.keys.insert(
            "0".into(),
            SecretString::from("a production secret of at least thirty-two bytes"),
        );
        // The development label key is refused too, naming its setting.
        let refused = settings
            .validate()
            .expect_err("the development label key is refused");
        assert!(
            refused.to_string().contains("labels.signing_key"),
            "{refused}"
        );
        settings.labels.signing_key =
            SecretString::from("a production label key of at least thirty-two bytes");
        // The development webhook key (every endpoint's secret derives from it) is refused too.
        let refused = settings
            .validate()
            .expect_err("the development webhook key is refused");
        assert!(
            refused.to_string().contains("webhooks.signing_key"),
            "{refused}"
        );
        settings.webhooks.signing_key =
            SecretString::from("a production webhook key of at least thirty-two bytes");
        // The log code sender is refused outside development, naming its setting.
        let refused = settings
            .validate()
            .expect_err("the log code sender is refused");
        assert!(
            refused.to_string().contains("auth.code_sender"),
            "{refused}"
        );
        settings.auth.code_sender = CodeSenderKind::Disabled;
        settings.validate().expect("real keys are accepted");
        assert!(!format!("{:?}", settings.codes).contains("production secret"));
        assert!(!format!("{:?}", settings.labels).contains("production label key"));
        assert!(!format!("{:?}", settings.webhooks).contains("production webhook key"));
        settings
            .codes
            .keys
            .insert("1".into(), SecretString::from("too short"));
        assert!(settings.validate().is_err());
    }

    #[test]
    fn debug_output_never_shows_the_database_password() {
        let settings = DatabaseSettings {
            url: SecretString::from("postgres://u:hunter2@localhost/db"),
            pool_max_size: 1,
            worker_pool_max_size: 1,
            pool_wait_timeout_ms: 1,
            connect_timeout_ms: 1,
            migrate_on_start: true,
            failover_wait_ms: 1,
        };
        let printed = format!("{settings:?}");
        assert!(!printed.contains("hunter2"), "{printed}");
    }
}
