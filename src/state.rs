//! The services every edge shares: [`AppState`], built once per process from the settings, and
//! taken by the HTTP handlers, the web pages, the CLI and the benchmarks. It stands apart from
//! the composition root (`startup`), which imports the handlers, so that the handlers never
//! import the composition root.

use crate::dispatch::Dispatcher;
use crate::dispatch::images::ImageStore;
use crate::identity::PasswordGuard;
use crate::identity::password::Passwords;
use crate::identity::phone_codes::{CodeSender, LogCodeSender, PhoneCodes};
use crate::identity::sessions::Sessions;
use crate::identity::users::Users;
use crate::platform::aggregate::AggregateService;
use crate::platform::clock::Clock;
use crate::platform::command::RetryPolicy;
use crate::platform::configuration::{AuthSettings, CodeSenderKind, Settings};
use crate::platform::event_store::AnyEventStore;
use crate::platform::notify::{NotificationHub, Notifier};
use crate::platform::projector::Statuses;
use crate::platform::redis_store::RedisStore;
use crate::points::codes::CodeService;
use crate::tasks::pool::PoolService;
use crate::tasks::queue::TaskQueue;
use crate::tasks::queue::lease::Leases;
use crate::tasks::service::TaskService;
use crate::tasks::translate::Translator;
use deadpool_postgres::Pool;
use std::sync::Arc;
use std::time::Duration;
use zhihui_domain::account::Account;

/// What every request handler (and every CLI command) may use: the services, built once.
#[derive(Debug, Clone)]
pub struct AppState {
    pub pg_pool: Pool,
    pub redis: RedisStore,
    pub event_store: AnyEventStore,
    pub clock: Clock,
    pub users: Users,
    /// API keys: made, listed, revoked, checked on every request that carries one.
    pub api_keys: crate::identity::api_keys::ApiKeys,
    /// Webhook endpoints and their deliveries.
    pub webhooks: crate::webhooks::WebhookService,
    pub passwords: Passwords,
    pub password_guard: PasswordGuard,
    pub sessions: Sessions,
    pub phone_codes: PhoneCodes,
    pub auth_settings: AuthSettings,
    /// Points accounts: batched, serialised command handling per account stream.
    pub accounts: AggregateService<Account>,
    /// Statuses of this process's projection runners.
    pub projection_statuses: Statuses,
    /// Tasks: submit, prioritise, cancel, claim, the queue and the intent sweeper.
    pub tasks: TaskService,
    /// Publishes notifications to users (any process's sockets).
    pub notifier: Notifier,
    /// This process's end of the notification channel (user WebSockets listen here).
    pub hub: NotificationHub,
    /// Downloaded images.
    pub images: ImageStore,
    /// The dispatcher of this process (runs only while it holds the leader lease).
    pub dispatcher: Dispatcher,
    /// Redeem codes: batches and redemption.
    pub codes: CodeService,
    /// Daily check-in: bonus, month view, streak.
    pub checkins: crate::points::checkins::CheckInService,
    /// The creators' gallery: works, likes, follows, lists, feeds and their caches.
    pub gallery: crate::gallery::GalleryService,
    /// Daily active users (counted by the authentication extractors).
    pub active_users: crate::identity::active_users::ActiveUsers,
    /// Flash-sale promotions: the gate and the claims consumer.
    pub promotions: crate::points::promotions::PromotionService,
    pub http_settings: crate::platform::configuration::HttpSettings,
    /// The user sockets open in this process, per user (capped).
    pub user_sockets: crate::platform::notify::UserSockets,
    /// Queue positions for this process's sockets: one Redis read per queue change.
    pub positions: crate::tasks::positions::PositionBoard,
    /// Admission limits per client and overall (logins, code requests).
    pub limits: crate::identity::admission::Limits,
}

/// What tests (and only tests) replace: the clock and the code sender.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub clock: Clock,
    pub code_sender: Option<Arc<dyn CodeSender>>,
}

impl AppState {
    /// End one session (logout) and close its sockets, in every process.
    pub async fn end_session(
        &self,
        session: &crate::identity::sessions::Session,
    ) -> anyhow::Result<()> {
        self.sessions.revoke(session).await?;
        self.announce_sessions_ended(session.user_id, Some(session.token_digest.clone()))
            .await;
        Ok(())
    }

    /// End every session of a user (a password or role change) and close their sockets.
    pub async fn end_sessions(&self, user_id: zhihui_domain::user::UserId) -> anyhow::Result<u64> {
        let ended = self.sessions.revoke_all(user_id).await?;
        self.announce_sessions_ended(user_id, None).await;
        Ok(ended)
    }

    /// A hint: a socket that misses it finds its session gone at its next ping.
    async fn announce_sessions_ended(
        &self,
        user_id: zhihui_domain::user::UserId,
        token_digest: Option<String>,
    ) {
        let envelope = crate::platform::notify::Envelope::SessionsEnded {
            user_id: user_id.as_uuid(),
            token_digest,
        };
        if let Err(error) = self.notifier.publish(&envelope).await {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "session end not announced");
        }
    }

    /// Build every service from the settings. Connects lazily: nothing here needs the network.
    pub fn build(
        settings: &Settings,
        pg_pool: Pool,
        overrides: Overrides,
    ) -> anyhow::Result<AppState> {
        let redis = RedisStore::new(&settings.redis)?;
        let event_store = crate::platform::event_store::from_settings(settings, pg_pool.clone())?;
        let clock = overrides.clock;
        let auth = &settings.auth;
        let code_sender = overrides
            .code_sender
            .unwrap_or_else(|| match auth.code_sender {
                // Disabled: `POST /auth/code` refuses before any code is made; the log sender
                // stands in and is never reached.
                CodeSenderKind::Log | CodeSenderKind::Disabled => Arc::new(LogCodeSender),
            });
        let accounts = AggregateService::new(
            event_store.clone(),
            RetryPolicy::default(),
            Duration::from_millis(settings.accounts.actor_idle_ms),
        );
        let leases = Leases::new(redis.clone(), pg_pool.clone());
        let pool = PoolService::new(
            event_store.clone(),
            redis.clone(),
            pg_pool.clone(),
            leases.clone(),
            clock.clone(),
        );
        let tasks = TaskService::new(
            event_store.clone(),
            accounts.clone(),
            pg_pool.clone(),
            TaskQueue::new(redis.clone(), clock.clone()),
            settings.tasks.clone(),
            Translator::new(settings.translation.clone(), redis.clone())?,
            clock.clone(),
        )?
        .with_backend_pool(pool.clone());
        let notifier = Notifier::new(redis.clone());
        let images = ImageStore::new(&settings.dispatch.images_directory);
        let dispatcher = Dispatcher::new(
            tasks.clone(),
            event_store.clone(),
            pg_pool.clone(),
            leases,
            notifier.clone(),
            images.clone(),
            crate::labels::Labeller::new(&settings.labels)?,
            clock.clone(),
            settings.dispatch.clone(),
            pool.clone(),
        )?;
        let codes = CodeService::new(
            event_store.clone(),
            accounts.clone(),
            pg_pool.clone(),
            redis.clone(),
            clock.clone(),
            settings.codes.clone(),
        )?;
        let checkins = crate::points::checkins::CheckInService::new(
            event_store.clone(),
            accounts.clone(),
            pg_pool.clone(),
            redis.clone(),
            clock.clone(),
            &settings.checkins,
            auth.day_utc_offset_minutes,
        )?;
        let active_users = crate::identity::active_users::ActiveUsers::new(
            redis.clone(),
            clock.clone(),
            settings.stats.clone(),
            auth.day_utc_offset_minutes,
        );
        let promotions = crate::points::promotions::PromotionService::new(
            event_store.clone(),
            AggregateService::new(
                event_store.clone(),
                RetryPolicy::default(),
                Duration::from_millis(settings.accounts.actor_idle_ms),
            ),
            accounts.clone(),
            pg_pool.clone(),
            redis.clone(),
            clock.clone(),
            notifier.clone(),
            settings.promotions.clone(),
        );
        let users = Users::new(
            event_store.clone(),
            clock.clone(),
            RetryPolicy::default(),
            Duration::from_millis(auth.orphan_claim_release_ms),
        );
        let api_keys = crate::identity::api_keys::ApiKeys::new(
            redis.clone(),
            users.clone(),
            clock.clone(),
            settings.api_keys.requests_per_minute,
            settings.api_keys.requests_per_minute_max,
        );
        let webhooks = crate::webhooks::WebhookService::new(
            event_store.clone(),
            pg_pool.clone(),
            clock.clone(),
            settings.webhooks.clone(),
        )?;
        let positions = crate::tasks::positions::PositionBoard::new(
            tasks.queue.clone(),
            Some(dispatcher.backend_pool().clone()),
        );
        let gallery = crate::gallery::GalleryService::new(
            event_store.clone(),
            pg_pool.clone(),
            redis.clone(),
            clock.clone(),
            notifier.clone(),
            settings.gallery.clone(),
        );
        Ok(AppState {
            gallery,
            positions,
            limits: crate::identity::admission::Limits::new(redis.clone(), clock.clone()),
            codes,
            checkins,
            active_users,
            promotions,
            notifier,
            hub: NotificationHub::new(redis.clone()),
            images,
            dispatcher,
            users,
            api_keys,
            webhooks,
            passwords: Passwords::new(auth)?,
            password_guard: PasswordGuard::new(
                redis.clone(),
                clock.clone(),
                auth.password_failures_max,
                auth.password_failures_max_all_sources,
                Duration::from_millis(auth.password_lockout_ms),
            ),
            sessions: Sessions::new(
                redis.clone(),
                clock.clone(),
                Duration::from_millis(auth.session_idle_ttl_ms),
            ),
            phone_codes: PhoneCodes::new(redis.clone(), clock.clone(), code_sender, auth),
            auth_settings: auth.clone(),
            http_settings: settings.http.clone(),
            user_sockets: crate::platform::notify::UserSockets::new(
                settings.http.sockets_per_user_max,
            ),
            accounts,
            tasks,
            projection_statuses: Statuses::default(),
            pg_pool,
            redis,
            event_store,
            clock,
        })
    }
}
