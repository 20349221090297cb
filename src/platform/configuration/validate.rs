//! The checks a loaded [`Settings`] passes before anything uses it: bounds, relations between
//! settings, development keys refused outside development. A feature's own checks that need more
//! than the settings (the mark's glyphs, the webhook networks) run in `startup::check_settings`.

use secrecy::ExposeSecret;

use super::*;

impl Settings {
    pub(super) fn validate(&self) -> anyhow::Result<()> {
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
        anyhow::ensure!(
            self.http.read_deadline_ms >= 1000
                && self.http.write_deadline_ms > self.database.failover_wait_ms,
            "http.read_deadline_ms must be at least 1000, and http.write_deadline_ms longer than database.failover_wait_ms (a write may spend that long finding a new primary)"
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
        let gallery = &self.gallery;
        anyhow::ensure!(
            gallery.inbox_max >= 10
                && gallery.hot_max >= 10
                && gallery.inbox_idle_days >= 1
                && gallery.hot_window_days >= 1
                && gallery.hot_recompute_ms >= 100
                && gallery.cache_ttl_ms >= 10
                && gallery.cache_capacity >= 1
                && gallery.likes_per_minute >= 1
                && gallery.follows_per_minute >= 1
                && gallery.reports_per_hour >= 1
                && gallery.redis_loss_window_ms >= 1,
            "gallery: inbox_max and hot_max must be at least 10, hot_recompute_ms at least 100, cache_ttl_ms at least 10, the rest at least 1"
        );
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
        Ok(())
    }

    fn validate_labels(&self) -> anyhow::Result<()> {
        let labels = &self.labels;
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
            (1..=STATUS_STALE_MS as u64 / 2).contains(&dispatch.status_publish_interval_ms),
            "dispatch.status_publish_interval_ms must be 1 to {}: a view older than {} ms reads as unknown",
            STATUS_STALE_MS / 2,
            STATUS_STALE_MS
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
        for (setting, names) in [
            ("model_names", &tasks.model_names),
            ("model_names_en", &tasks.model_names_en),
        ] {
            for (model, name) in names {
                anyhow::ensure!(
                    tasks.models.contains(model),
                    "tasks.{setting}: {model:?} is not in tasks.models"
                );
                anyhow::ensure!(
                    zhihui_domain::text::checked_text(name, 1, 60, false).is_ok(),
                    "tasks.{setting}.{model:?}: a name is one line of 1 to 60 characters"
                );
            }
        }
        for preset in &tasks.resolution_presets {
            anyhow::ensure!(
                parse_resolution(preset).is_some(),
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
