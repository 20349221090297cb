//! The creators' gallery: works published from tasks that succeeded, likes, follows, the hot and
//! new lists, each user's feed, and the public pages' caches.
//!
//! The truth is the events (`work-`, `like-`, `follow-` streams, decided in
//! `zhihui_domain::gallery`). Redis holds what the pages read fast (`keys`), every key derived
//! from those events: the request that appended an event applies it at once (so its author sees
//! it), and [`worker::GalleryWorker`] applies every event again in the log's order (so a request
//! that died between its append and Redis, or a flushed Redis, is made whole), pushes new works
//! into followers' inboxes and recomputes the hot ranking. Both apply a pair's event only over an
//! older one (the pair stream's version decides), so their order does not matter.
//!
//! Who may see a work is decided on its stream, never by a cache: a cached card exists only for
//! a visible work and is dropped everywhere when that changes (`cache`).

pub mod cache;
pub mod keys;
pub mod reads;
pub mod reports;
pub mod worker;

use std::sync::Arc;
use std::time::Duration;
use zhihui_domain::rule::Broken;

use anyhow::Context;
use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use uuid::Uuid;
use zhihui_domain::gallery::block::{Block, BlockCommand, BlockError, block_stream};
use zhihui_domain::gallery::follow::{Follow, FollowCommand, FollowError, follow_stream};
use zhihui_domain::gallery::like::{Like, LikeCommand, LikeError, like_stream};
use zhihui_domain::gallery::work::{
    HideReason, SourceTask, Work, WorkCommand, WorkDescription, WorkError, WorkId, WorkState,
    WorkStatus, WorkTitle, work_id_of_task, work_stream,
};
use zhihui_domain::task::TaskStatus;
use zhihui_domain::user::UserId;

use crate::platform::clock::Clock;
use crate::platform::command::{self, CommandError, RetryPolicy};
use crate::platform::configuration::GallerySettings;
use crate::platform::event_store::{AnyEventStore, EventMetadata, EventStore};
use crate::platform::notify::{Envelope, NotificationHub, Notifier};
use crate::platform::redis_store::RedisStore;

use cache::Layered;
use keys::Keys;

/// A work as anyone may see it (only visible works have one). The prompt is here only when its
/// creator chose to show it: a hidden prompt never leaves the server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkCard {
    pub work_id: WorkId,
    pub creator: Uuid,
    pub creator_name: String,
    pub title: String,
    pub description: Option<String>,
    /// Image ids, in the order the creator chose.
    pub images: Vec<String>,
    pub prompt: Option<String>,
    pub negative_prompt: Option<String>,
    pub settings: WorkSettings,
    pub published_at: DateTime<Utc>,
}

/// How a work was made, for "make one like this" (the prompt apart).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkSettings {
    pub model: String,
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    pub cfg: String,
    pub sampler: String,
    pub scheduler: String,
}

/// A card with its likes, read fresh from Redis.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkView {
    pub card: Arc<WorkCard>,
    pub likes: u64,
    /// The earliest likers' display names, first first (at most five).
    pub first_likers: Vec<String>,
    /// Whether the viewer likes it (`None` for a visitor).
    pub liked_by_viewer: Option<bool>,
}

/// What a publish asks for.
#[derive(Debug, Clone)]
pub struct PublishRequest {
    pub task_id: Uuid,
    /// Images to show, in order; all of the task's when empty.
    pub images: Vec<String>,
    pub title: String,
    pub description: String,
    pub prompt_shown: bool,
}

/// A refusal a user can act on; each names its rule.
#[derive(Debug, thiserror::Error)]
pub enum GalleryError {
    #[error("{field}: {broken}")]
    Invalid { field: &'static str, broken: Broken },
    #[error("no such task")]
    NoSuchTask,
    #[error(transparent)]
    Work(#[from] WorkError),
    #[error(transparent)]
    Like(#[from] LikeError),
    #[error(transparent)]
    Follow(#[from] FollowError),
    #[error(transparent)]
    Block(#[from] BlockError),
    #[error(transparent)]
    Report(#[from] zhihui_domain::gallery::report::ReportError),
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

fn from_command<E>(error: CommandError<E>) -> GalleryError
where
    GalleryError: From<E>,
{
    match error {
        CommandError::Rejected(rule) => GalleryError::from(rule),
        CommandError::Contended { stream, attempts } => {
            GalleryError::Unexpected(anyhow::Error::new(command::StreamContended {
                stream,
                attempts,
            }))
        }
        CommandError::Store(error) => GalleryError::Unexpected(error),
    }
}

/// What a like or unlike answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LikeOutcome {
    pub liked: bool,
    pub likes: u64,
}

/// What a follow or unfollow answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FollowOutcome {
    pub following: bool,
    pub followers: u64,
}

/// How long a visitor's view of a work or of a list's first page is served from this
/// process's memory without asking Redis: a like reaches other visitors' pages at most this
/// late (the liker's own answer has the new count at once). A work taken down is dropped from
/// it at once, like every cached copy.
pub const PUBLIC_FRESH: Duration = Duration::from_secs(1);

/// The hot score: likes weighed down by age, so that an old work does not stay on top.
pub fn hot_score(likes: u64, published_at: DateTime<Utc>, now: DateTime<Utc>) -> f64 {
    let hours = ((now - published_at).num_seconds().max(0) as f64) / 3600.0;
    likes as f64 / (hours + 2.0).powf(1.5)
}

/// A user's (display name, handle): see [`GalleryService::name_of`] and `handle_of`.
type Names = (Arc<str>, Arc<str>);

#[derive(Debug, Clone)]
pub struct GalleryService {
    store: AnyEventStore,
    pool: Pool,
    redis: RedisStore,
    keys: Keys,
    clock: Clock,
    notifier: Notifier,
    settings: GallerySettings,
    cards: Layered<WorkCard>,
    /// Each user's (display name, handle), dropped on every process when the name changes.
    names: moka::future::Cache<Uuid, Arc<Names>>,
    /// Moves whenever a name is dropped: a load that saw it move is not kept (it may have read
    /// the name before the change).
    names_forgotten: Arc<std::sync::atomic::AtomicU64>,
    /// What a visitor sees, for [`PUBLIC_FRESH`]: a work with its likes, the first pages.
    public_views: moka::future::Cache<WorkId, Arc<Option<WorkView>>>,
    public_pages: moka::future::Cache<String, Arc<reads::WorkPage>>,
    /// Moves whenever the public copies are dropped: a load that saw it move is not kept (`moka`
    /// keeps what a load returns even when its key was invalidated meanwhile).
    public_forgotten: Arc<std::sync::atomic::AtomicU64>,
    policy: RetryPolicy,
}

impl GalleryService {
    pub fn new(
        store: AnyEventStore,
        pool: Pool,
        redis: RedisStore,
        clock: Clock,
        notifier: Notifier,
        settings: GallerySettings,
    ) -> GalleryService {
        let cards = Layered::new(
            redis.clone(),
            clock.clone(),
            Duration::from_millis(settings.cache_ttl_ms),
            settings.cache_capacity,
        );
        GalleryService {
            store,
            pool,
            keys: Keys::new(redis.clone()),
            redis,
            clock,
            notifier,
            cards,
            // Dropped when a name changes (`forget_name`); the hour is a backstop only.
            names: moka::future::Cache::builder()
                .max_capacity(settings.cache_capacity)
                .time_to_live(Duration::from_secs(3600))
                .build(),
            names_forgotten: Arc::default(),
            public_views: moka::future::Cache::builder()
                .max_capacity(settings.cache_capacity)
                .time_to_live(PUBLIC_FRESH)
                .build(),
            public_pages: moka::future::Cache::builder()
                .max_capacity(64)
                .time_to_live(PUBLIC_FRESH)
                .build(),
            public_forgotten: Arc::default(),
            settings,
            policy: RetryPolicy::default(),
        }
    }

    pub fn settings(&self) -> &GallerySettings {
        &self.settings
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// How often this process read a card from its source (tests and benchmarks).
    pub fn card_source_loads(&self) -> u64 {
        self.cards
            .counts()
            .source_loads
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Drop this process's cached cards when another process says so. Runs until the hub
    /// closes; a receiver that fell behind drops everything (it may have missed a hide).
    pub async fn follow_changes(self, hub: NotificationHub) {
        let mut deaf = false;
        loop {
            let mut receiver = match hub.subscribe().await {
                Ok(receiver) => {
                    if std::mem::take(&mut deaf) {
                        // Changes made while nothing listened went unheard.
                        self.forget_all_cached();
                    }
                    receiver
                }
                Err(error) => {
                    deaf = true;
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "gallery cannot hear changes; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            loop {
                match receiver.recv().await {
                    Ok(Envelope::GalleryChanged {
                        work_id: Some(work_id),
                    }) => {
                        self.cards.forget_local(&self.keys.view(work_id)).await;
                        self.forget_public(Some(work_id)).await;
                    }
                    Ok(Envelope::GalleryChanged { work_id: None }) => {
                        self.forget_public(None).await;
                    }
                    Ok(Envelope::UserRenamed { user_id }) => {
                        self.forget_name_local(user_id).await;
                    }
                    // Fallen behind, or the subscription was opened again: a change may have
                    // gone unheard.
                    Ok(Envelope::Resubscribed)
                    | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        self.forget_all_cached();
                    }
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        }
    }

    /// Drop this process's public copies: of one work's view (and every list's first page), or
    /// of the lists only.
    async fn forget_public(&self, work_id: Option<WorkId>) {
        self.public_forgotten
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        if let Some(work_id) = work_id {
            self.public_views.invalidate(&work_id).await;
        }
        self.public_pages.invalidate_all();
    }

    /// Drop everything this process keeps of the gallery.
    fn forget_all_cached(&self) {
        self.public_forgotten
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.names_forgotten
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.names.invalidate_all();
        self.cards.forget_all_local();
        self.public_views.invalidate_all();
        self.public_pages.invalidate_all();
    }

    /// Drop every copy of a work's card, here and in every process.
    pub async fn forget_card(&self, work_id: WorkId) {
        self.forget_public(Some(work_id)).await;
        if let Err(error) = self.cards.forget(&self.keys.view(work_id)).await {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), %work_id, "a cached work could not be dropped from Redis");
        }
        let envelope = Envelope::GalleryChanged {
            work_id: Some(work_id),
        };
        if let Err(error) = self.notifier.publish(&envelope).await {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), %work_id, "a gallery change was not announced");
        }
    }

    /// A user's name as others see it: the display name they chose, else their handle.
    pub async fn name_of(&self, user: Uuid) -> anyhow::Result<Arc<str>> {
        Ok(self.names_of(user).await?.0.clone())
    }

    /// A user's handle: the username, or a short form of the id for a user without one (a
    /// phone number is never shown). Shown beside a display name, which anyone may choose
    /// alike; it changes once at most, when a user who signed up by phone sets a username.
    pub async fn handle_of(&self, user: Uuid) -> anyhow::Result<Arc<str>> {
        Ok(self.names_of(user).await?.1.clone())
    }

    /// (display name, handle), read from the user's stream (the read model may lag a new user)
    /// and kept until the name changes.
    async fn names_of(&self, user: Uuid) -> anyhow::Result<Arc<Names>> {
        if let Some(names) = self.names.get(&user).await {
            return Ok(names);
        }
        metrics::counter!("zhihui_gallery_cache_loads_total").increment(1);
        let seen = self
            .names_forgotten
            .load(std::sync::atomic::Ordering::Acquire);
        let loaded = command::load::<zhihui_domain::user::User>(
            &self.store,
            &UserId::from_uuid(user).stream(),
        )
        .await?;
        let (handle, chosen): (Arc<str>, _) = match loaded.state {
            zhihui_domain::user::UserState::Registered(registered) => (
                Arc::from(
                    registered
                        .username
                        .map(|name| name.as_str().to_owned())
                        .unwrap_or_else(|| short_name(user)),
                ),
                registered.display_name,
            ),
            zhihui_domain::user::UserState::Unregistered => (Arc::from(short_name(user)), None),
        };
        let name = chosen.map_or_else(|| handle.clone(), |name| Arc::from(name.as_str()));
        let names = Arc::new((name, handle));
        // Read before a change was announced, it may be the old name: used, not kept.
        if self
            .names_forgotten
            .load(std::sync::atomic::Ordering::Acquire)
            == seen
        {
            self.names.insert(user, names.clone()).await;
        }
        Ok(names)
    }

    /// A user changed their display name: every process drops it and every public copy that
    /// shows it.
    pub async fn forget_name(&self, user: UserId) {
        self.forget_name_local(user.as_uuid()).await;
        let envelope = Envelope::UserRenamed {
            user_id: user.as_uuid(),
        };
        if let Err(error) = self.notifier.publish(&envelope).await {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), %user, "a new display name was not announced");
        }
    }

    async fn forget_name_local(&self, user: Uuid) {
        self.names_forgotten
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.names.invalidate(&user).await;
        // A work's view and the first pages show names (creators, first likers).
        self.public_forgotten
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.public_views.invalidate_all();
        self.public_pages.invalidate_all();
    }

    /// The user's registration, if they are registered.
    async fn registration(
        &self,
        user: UserId,
    ) -> anyhow::Result<Option<zhihui_domain::user::UserRegistered>> {
        use zhihui_domain::DomainEvent;
        let events = self
            .store
            .read_stream(
                &user.stream(),
                crate::platform::event_store::Direction::Forwards,
                crate::platform::event_store::ReadFrom::Start,
                1,
            )
            .await
            .context("reading a user's registration")?;
        let Some(first) = events.first() else {
            return Ok(None);
        };
        let event = zhihui_domain::user::UserEvent::from_stored(
            &first.event_type,
            first.schema_version,
            &first.payload,
        )
        .context("decoding a user's registration")?;
        Ok(match event {
            zhihui_domain::user::UserEvent::Registered(registered) => Some(registered),
            _ => None,
        })
    }

    /// Publish images of one of the caller's tasks that succeeded.
    pub async fn publish(
        &self,
        creator: UserId,
        request: PublishRequest,
        metadata: &EventMetadata,
    ) -> Result<WorkId, GalleryError> {
        let title = WorkTitle::parse(&request.title).map_err(|error| GalleryError::Invalid {
            field: "title",
            broken: error.0,
        })?;
        let description = WorkDescription::parse(&request.description).map_err(|error| {
            GalleryError::Invalid {
                field: "description",
                broken: error.0,
            }
        })?;
        let record = crate::tasks::view::record_at(&self.store, request.task_id, None)
            .await?
            .filter(|record| record.user_id == creator)
            .ok_or(GalleryError::NoSuchTask)?;
        let task_images: Vec<String> = record
            .images
            .iter()
            .map(|image| image.image_id.clone())
            .collect();
        let images = if request.images.is_empty() {
            task_images.clone()
        } else {
            request.images
        };
        let now = self.clock.now();
        let command = WorkCommand::Publish {
            creator,
            source: SourceTask {
                task_id: record.task_id,
                owner: record.user_id,
                succeeded: record.status == TaskStatus::Succeeded,
                images: task_images,
            },
            images,
            title,
            description,
            prompt_shown: request.prompt_shown,
            at: now,
        };
        let work_id = work_id_of_task(record.task_id);
        let executed = self
            .execute::<Work>(&work_stream(work_id), &command, metadata)
            .await?;
        self.after_work_change(work_id, &executed.state).await?;
        Ok(work_id)
    }

    /// The creator takes a work down (anyone else: no such work).
    pub async fn unpublish(
        &self,
        by: UserId,
        work_id: WorkId,
        metadata: &EventMetadata,
    ) -> Result<(), GalleryError> {
        let command = WorkCommand::Unpublish {
            by,
            at: self.clock.now(),
        };
        let executed = self
            .execute::<Work>(&work_stream(work_id), &command, metadata)
            .await?;
        self.after_work_change(work_id, &executed.state).await?;
        Ok(())
    }

    /// A work of `creator`'s as its stream has it (the read models may not have it yet): where
    /// it stands and its last publication. `None` for a work that is not theirs, or was never
    /// published.
    pub async fn own_work(
        &self,
        creator: UserId,
        work_id: WorkId,
    ) -> anyhow::Result<Option<WorkState>> {
        let state = command::load::<Work>(&self.store, &work_stream(work_id))
            .await?
            .state;
        Ok((state.last.as_ref().map(|last| last.creator) == Some(creator)).then_some(state))
    }

    /// [`Gallery::own_work`]'s status (`published`, `unpublished` or `hidden`) and why it was
    /// hidden.
    pub async fn own_work_status(
        &self,
        creator: UserId,
        work_id: WorkId,
    ) -> anyhow::Result<Option<(&'static str, Option<String>)>> {
        let Some(state) = self.own_work(creator, work_id).await? else {
            return Ok(None);
        };
        let status = match state.status {
            WorkStatus::NotPublished => return Ok(None),
            WorkStatus::Published => "published",
            WorkStatus::Unpublished => "unpublished",
            WorkStatus::Hidden => "hidden",
        };
        Ok(Some((
            status,
            state.hidden_reason.map(|reason| reason.as_str().to_owned()),
        )))
    }

    /// An admin hides a work, with a reason its creator sees.
    pub async fn hide(
        &self,
        admin: UserId,
        work_id: WorkId,
        reason: &str,
        metadata: &EventMetadata,
    ) -> Result<(), GalleryError> {
        let reason = HideReason::parse(reason).map_err(|error| GalleryError::Invalid {
            field: "reason",
            broken: error.0,
        })?;
        let command = WorkCommand::Hide {
            admin,
            reason,
            at: self.clock.now(),
        };
        let executed = self
            .execute::<Work>(&work_stream(work_id), &command, metadata)
            .await?;
        self.after_work_change(work_id, &executed.state).await?;
        Ok(())
    }

    /// A command on one stream of the gallery, a refusal in the gallery's words.
    async fn execute<D>(
        &self,
        stream: &str,
        command: &D::Command,
        metadata: &EventMetadata,
    ) -> Result<command::Executed<D>, GalleryError>
    where
        D: zhihui_domain::Decider,
        D::Event: zhihui_domain::DomainEvent,
        GalleryError: From<D::Error>,
    {
        command::execute::<D>(&self.store, stream, command, metadata, self.policy)
            .await
            .map_err(from_command)
    }

    /// Redis after a work's event: in the lists or out of them, and every cached card dropped.
    async fn after_work_change(&self, work_id: WorkId, state: &WorkState) -> anyhow::Result<()> {
        let Some(last) = &state.last else {
            return Ok(());
        };
        let mut connection = self.redis.connection().await?;
        apply_work_lists(
            &self.keys,
            &mut connection,
            work_id,
            last.creator,
            state.status,
            last.published_at,
            self.settings.hot_max,
        )
        .await?;
        self.forget_card(work_id).await;
        Ok(())
    }

    /// The caller likes a work: once, whatever the retries and races.
    pub async fn like(
        &self,
        user: UserId,
        work_id: WorkId,
        metadata: &EventMetadata,
    ) -> Result<LikeOutcome, GalleryError> {
        // A cached card says the work is visible (a hide drops it everywhere at once); without
        // one, the work's own stream decides: a cache never refuses a like.
        let published_at = match self.card(work_id).await? {
            Some(card) => Some(card.published_at),
            None => {
                let work = command::load::<Work>(&self.store, &work_stream(work_id)).await?;
                work.state
                    .last
                    .filter(|_| work.state.status.is_visible())
                    .map(|last| last.published_at)
            }
        };
        let command = LikeCommand::Like {
            work_id,
            user_id: user,
            work_visible: published_at.is_some(),
            at: self.clock.now(),
        };
        // A first like of the pair is the common case: append expecting no stream, without
        // reading it (a conflict reads it and decides again).
        let executed = command::execute_on::<Like>(
            &self.store,
            &like_stream(work_id, user),
            command::unwritten::<Like>(),
            &command,
            metadata,
            self.policy,
        )
        .await
        .map_err(from_command)?;
        let likes = self
            .apply_like(work_id, user, executed.version, executed.state)
            .await?;
        if let Some(published_at) = published_at {
            self.rank(work_id, likes, published_at).await?;
        }
        Ok(LikeOutcome { liked: true, likes })
    }

    /// The caller takes a like back (always allowed, also on a hidden work they liked).
    pub async fn unlike(
        &self,
        user: UserId,
        work_id: WorkId,
        metadata: &EventMetadata,
    ) -> Result<LikeOutcome, GalleryError> {
        let command = LikeCommand::Unlike {
            work_id,
            user_id: user,
            at: self.clock.now(),
        };
        let executed = self
            .execute::<Like>(&like_stream(work_id, user), &command, metadata)
            .await?;
        // No card: not visible (or not cached, and then read from its stream).
        let card = self.card(work_id).await?;
        // Nothing taken back from a work the caller may not see is answered as for a work that
        // never was: the answer tells neither its count nor that it exists.
        if executed.new_events.is_empty() && card.is_none() {
            return Err(LikeError::NoSuchWork.into());
        }
        let likes = self
            .apply_like(work_id, user, executed.version, executed.state)
            .await?;
        // Ranked again only while visible.
        if let Some(card) = card {
            self.rank(work_id, likes, card.published_at).await?;
        }
        Ok(LikeOutcome {
            liked: false,
            likes,
        })
    }

    async fn apply_like(
        &self,
        work_id: WorkId,
        user: UserId,
        version: Option<u64>,
        state: Option<DateTime<Utc>>,
    ) -> anyhow::Result<u64> {
        let mut connection = self.redis.connection().await?;
        apply_pair(
            &mut connection,
            &self.keys.likes(work_id),
            &self.keys.like_versions(work_id),
            &user.to_string(),
            version,
            state,
        )
        .await
    }

    /// Move a work in the hot ranking after its like count changed.
    async fn rank(
        &self,
        work_id: WorkId,
        likes: u64,
        published_at: DateTime<Utc>,
    ) -> anyhow::Result<()> {
        let score = hot_score(likes, published_at, self.clock.now());
        let mut connection = self.redis.connection().await?;
        redis::pipe()
            .zadd(self.keys.hot(), work_id.to_string(), score)
            .ignore()
            .zremrangebyrank(self.keys.hot(), 0, -(self.settings.hot_max as isize + 1))
            .ignore()
            .query_async::<()>(&mut connection)
            .await
            .context("ranking a work")?;
        Ok(())
    }

    /// The caller follows a creator.
    pub async fn follow(
        &self,
        follower: UserId,
        creator: UserId,
        metadata: &EventMetadata,
    ) -> Result<FollowOutcome, GalleryError> {
        let (creator_exists, creator_blocked) = if follower == creator {
            (true, false)
        } else {
            // The block's own stream decides (the blocked set in Redis is only a copy).
            let block =
                command::load::<Block>(&self.store, &block_stream(follower, creator)).await?;
            (self.user_exists(creator).await?, block.state.is_some())
        };
        let command = FollowCommand::Follow {
            follower,
            creator,
            creator_exists,
            creator_blocked,
            at: self.clock.now(),
        };
        let executed = self
            .execute::<Follow>(&follow_stream(follower, creator), &command, metadata)
            .await?;
        let followers = self
            .apply_follow(follower, creator, executed.version, executed.state)
            .await?;
        Ok(FollowOutcome {
            following: true,
            followers,
        })
    }

    /// The caller blocks a creator: their works leave the caller's lists and feed, and the
    /// caller stops following them.
    pub async fn block(
        &self,
        user: UserId,
        creator: UserId,
        metadata: &EventMetadata,
    ) -> Result<(), GalleryError> {
        let creator_exists = user == creator || self.user_exists(creator).await?;
        let command = BlockCommand::Block {
            user,
            creator,
            creator_exists,
            at: self.clock.now(),
        };
        let executed = self
            .execute::<Block>(&block_stream(user, creator), &command, metadata)
            .await?;
        self.apply_block(user, creator, executed.version, executed.state)
            .await?;
        self.unfollow(user, creator, metadata).await?;
        Ok(())
    }

    /// The caller takes a block back.
    pub async fn unblock(
        &self,
        user: UserId,
        creator: UserId,
        metadata: &EventMetadata,
    ) -> Result<(), GalleryError> {
        let command = BlockCommand::Unblock {
            user,
            creator,
            at: self.clock.now(),
        };
        let executed = self
            .execute::<Block>(&block_stream(user, creator), &command, metadata)
            .await?;
        self.apply_block(user, creator, executed.version, executed.state)
            .await?;
        Ok(())
    }

    async fn apply_block(
        &self,
        user: UserId,
        creator: UserId,
        version: Option<u64>,
        state: Option<DateTime<Utc>>,
    ) -> anyhow::Result<u64> {
        let mut connection = self.redis.connection().await?;
        apply_pair(
            &mut connection,
            &self.keys.blocked(user),
            &self.keys.blocked_versions(user),
            &creator.to_string(),
            version,
            state,
        )
        .await
    }

    /// The creators `user` blocked.
    pub async fn blocked_by(
        &self,
        user: UserId,
    ) -> anyhow::Result<std::collections::HashSet<Uuid>> {
        let mut connection = self.redis.connection().await?;
        let blocked: Vec<String> = connection
            .zrange(self.keys.blocked(user), 0, -1)
            .await
            .context("reading whom a user blocked")?;
        Ok(blocked
            .iter()
            .filter_map(|id| Uuid::parse_str(id).ok())
            .collect())
    }

    /// The caller stops following a creator.
    pub async fn unfollow(
        &self,
        follower: UserId,
        creator: UserId,
        metadata: &EventMetadata,
    ) -> Result<FollowOutcome, GalleryError> {
        let command = FollowCommand::Unfollow {
            follower,
            creator,
            at: self.clock.now(),
        };
        let executed = self
            .execute::<Follow>(&follow_stream(follower, creator), &command, metadata)
            .await?;
        let followers = self
            .apply_follow(follower, creator, executed.version, executed.state)
            .await?;
        Ok(FollowOutcome {
            following: false,
            followers,
        })
    }

    async fn apply_follow(
        &self,
        follower: UserId,
        creator: UserId,
        version: Option<u64>,
        state: Option<DateTime<Utc>>,
    ) -> anyhow::Result<u64> {
        let mut connection = self.redis.connection().await?;
        apply_follow_pair(
            &self.keys,
            &mut connection,
            follower,
            creator,
            version,
            state,
            self.settings.push_followers_max,
        )
        .await
    }

    /// Whether a user is registered (on its stream: the read model may lag a new user).
    pub async fn user_exists(&self, user: UserId) -> anyhow::Result<bool> {
        Ok(self.registration(user).await?.is_some())
    }

    /// A visible work's card, from the caches (`None`: no such work, or not visible).
    pub async fn card(&self, work_id: WorkId) -> anyhow::Result<Option<Arc<WorkCard>>> {
        let loaded = self
            .cards
            .get(
                &self.keys.view(work_id),
                &self.keys.view_lock(work_id),
                || self.load_card(work_id),
            )
            .await?;
        let Some(mut card) = loaded.as_ref().clone() else {
            return Ok(None);
        };
        card.creator_name = self.name_of(card.creator).await?.to_string();
        Ok(Some(Arc::new(card)))
    }

    /// A card from the truth: the work's stream, its task's stream, the creator's name.
    async fn load_card(&self, work_id: WorkId) -> anyhow::Result<Option<WorkCard>> {
        let work = command::load::<Work>(&self.store, &work_stream(work_id)).await?;
        let Some(last) = work
            .state
            .last
            .filter(|_| work.state.status == WorkStatus::Published)
        else {
            return Ok(None);
        };
        let Some(record) = crate::tasks::view::record_at(&self.store, last.task_id, None).await?
        else {
            return Ok(None);
        };
        let spec = &record.spec;
        Ok(Some(WorkCard {
            work_id,
            creator: last.creator.as_uuid(),
            // Named as it is read (`card`): the name may change while the card is kept.
            creator_name: String::new(),
            title: last.title.as_str().to_owned(),
            description: last.description.map(|d| d.as_str().to_owned()),
            images: last.images,
            prompt: last.prompt_shown.then(|| record.prompt.clone()),
            negative_prompt: last.prompt_shown.then(|| record.negative_prompt.clone()),
            settings: WorkSettings {
                model: spec.model.clone(),
                width: spec.width,
                height: spec.height,
                steps: spec.steps,
                cfg: spec.cfg.to_string(),
                sampler: spec.sampler.clone(),
                scheduler: spec.scheduler.clone(),
            },
            published_at: last.published_at,
        }))
    }

    /// A visible work with its likes, as `viewer` (if any) sees it. A visitor's view is the
    /// same for every visitor: kept in memory for [`PUBLIC_FRESH`].
    pub async fn view(
        &self,
        work_id: WorkId,
        viewer: Option<UserId>,
    ) -> anyhow::Result<Option<WorkView>> {
        if viewer.is_some() {
            return self.fresh_view(work_id, viewer).await;
        }
        let view = Box::pin(cache::kept_unless_forgotten(
            &self.public_views,
            &self.public_forgotten,
            work_id,
            async { Box::pin(self.fresh_view(work_id, None)).await.map(Arc::new) },
        ))
        .await?;
        Ok(view.as_ref().clone())
    }

    async fn fresh_view(
        &self,
        work_id: WorkId,
        viewer: Option<UserId>,
    ) -> anyhow::Result<Option<WorkView>> {
        let Some(card) = self.card(work_id).await? else {
            return Ok(None);
        };
        let mut connection = self.redis.connection().await?;
        let likes_key = self.keys.likes(work_id);
        let mut pipe = redis::pipe();
        pipe.zcard(&likes_key).zrange(&likes_key, 0, 4);
        if let Some(viewer) = viewer {
            pipe.zscore(&likes_key, viewer.to_string());
        }
        let (likes, first, mine): (u64, Vec<String>, Option<f64>) = if viewer.is_some() {
            pipe.query_async(&mut connection)
                .await
                .context("reading a work's likes")?
        } else {
            let (likes, first): (u64, Vec<String>) = pipe
                .query_async(&mut connection)
                .await
                .context("reading a work's likes")?;
            (likes, first, None)
        };
        let mut first_likers = Vec::with_capacity(first.len());
        for liker in first {
            if let Ok(id) = Uuid::parse_str(&liker) {
                first_likers.push(self.name_of(id).await?.to_string());
            }
        }
        Ok(Some(WorkView {
            card,
            likes,
            first_likers,
            liked_by_viewer: viewer.map(|_| mine.is_some()),
        }))
    }

    /// The like counts of several works (list pages).
    pub async fn like_counts(&self, works: &[WorkId]) -> anyhow::Result<Vec<u64>> {
        let connection = self.redis.connection().await?;
        each(
            &connection,
            works.iter().map(|work_id| {
                let mut command = redis::cmd("ZCARD");
                command.arg(self.keys.likes(*work_id));
                command
            }),
        )
        .await
        .context("reading like counts")
    }

    /// Which of `works` the viewer likes.
    pub async fn liked_among(&self, viewer: UserId, works: &[WorkId]) -> anyhow::Result<Vec<bool>> {
        if works.is_empty() {
            return Ok(Vec::new());
        }
        let connection = self.redis.connection().await?;
        let scores: Vec<Option<f64>> = each(
            &connection,
            works.iter().map(|work_id| {
                let mut command = redis::cmd("ZSCORE");
                command
                    .arg(self.keys.likes(*work_id))
                    .arg(viewer.to_string());
                command
            }),
        )
        .await
        .context("reading the viewer's likes")?;
        Ok(scores.into_iter().map(|score| score.is_some()).collect())
    }

    /// A list's first page as visitors see it, kept in memory for [`PUBLIC_FRESH`].
    pub(crate) async fn public_page<F, Fut>(
        &self,
        key: String,
        load: F,
    ) -> anyhow::Result<reads::WorkPage>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<reads::WorkPage>>,
    {
        let page = Box::pin(cache::kept_unless_forgotten(
            &self.public_pages,
            &self.public_forgotten,
            key,
            async { Box::pin(load()).await.map(Arc::new) },
        ))
        .await?;
        Ok(page.as_ref().clone())
    }

    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    pub(crate) fn redis(&self) -> &RedisStore {
        &self.redis
    }

    pub(crate) fn clock(&self) -> &Clock {
        &self.clock
    }

    pub(crate) fn store(&self) -> &AnyEventStore {
        &self.store
    }
}

/// Commands on keys of different tags, answered in order. On one Redis they go as one
/// pipeline (one round trip); on a Redis Cluster, where a pipeline may touch only one slot, as
/// separate commands sent at once, each to its own node.
pub(crate) async fn each<T: redis::FromRedisValue>(
    connection: &crate::platform::redis_store::RedisConnection,
    commands: impl Iterator<Item = redis::Cmd>,
) -> anyhow::Result<Vec<T>> {
    use crate::platform::redis_store::RedisConnection;
    if let RedisConnection::Cluster(_) = connection {
        let sent = commands.map(|command| {
            let mut connection = connection.clone();
            async move { command.query_async::<T>(&mut connection).await }
        });
        return Ok(futures::future::try_join_all(sent).await?);
    }
    let mut pipe = redis::pipe();
    let mut count = 0;
    for command in commands {
        pipe.add_command(command);
        count += 1;
    }
    if count == 0 {
        return Ok(Vec::new());
    }
    let mut connection = connection.clone();
    Ok(pipe.query_async(&mut connection).await?)
}

/// The public name of a user without a username (signed up by phone): the id's last ten hex
/// digits, its random part (the first ones are its creation time, shared by everyone who signed
/// up in the same minute, and would tell when). The `#` no username may hold, so nobody can
/// register a name that passes for another user's.
fn short_name(user: Uuid) -> String {
    let simple = user.simple().to_string();
    format!("user#{}", &simple[simple.len() - 10..])
}

/// A pair's membership (a like, a follow side) applied over any older one: see
/// `lua/gallery_pair.lua`. `since` is the pair's state after its event (`None`: not a member).
pub(crate) async fn apply_pair(
    connection: &mut crate::platform::redis_store::RedisConnection,
    set: &str,
    versions: &str,
    member: &str,
    version: Option<u64>,
    since: Option<DateTime<Utc>>,
) -> anyhow::Result<u64> {
    let Some(version) = version else {
        // Nothing was ever recorded for the pair: nothing to apply, only the count to read.
        let count: u64 = connection.zcard(set).await.context("counting a set")?;
        return Ok(count);
    };
    let (op, score) = match since {
        Some(at) => ("add", at.timestamp_millis()),
        None => ("rem", 0),
    };
    keys::PAIR_APPLY
        .key(set)
        .key(versions)
        .arg(member)
        .arg(version)
        .arg(op)
        .arg(score)
        .invoke_async(connection)
        .await
        .context("applying a pair to its set")
}

/// Both sides of a follow: the follower's following set, the creator's followers set; and
/// whether the creator is now one to pull (more followers than are pushed to; pushed again
/// only a tenth below that, see [`push_again_at`]).
pub(crate) async fn apply_follow_pair(
    keys: &Keys,
    connection: &mut crate::platform::redis_store::RedisConnection,
    follower: UserId,
    creator: UserId,
    version: Option<u64>,
    since: Option<DateTime<Utc>>,
    push_followers_max: u32,
) -> anyhow::Result<u64> {
    // A follow applied for the first time (the request and the worker both apply it, in either
    // order): the creator's earlier works were never pushed into this follower's inbox, which is
    // rebuilt at its next read from the works of everyone followed then.
    let new_follow = match (version, since) {
        (Some(version), Some(_)) => {
            let seen: Option<u64> = connection
                .hget(keys.following_versions(follower), creator.to_string())
                .await
                .context("reading a follow's version")?;
            seen.is_none_or(|seen| version > seen)
        }
        _ => false,
    };
    apply_pair(
        connection,
        &keys.following(follower),
        &keys.following_versions(follower),
        &creator.to_string(),
        version,
        since,
    )
    .await?;
    let followers = apply_pair(
        connection,
        &keys.followers(creator),
        &keys.follower_versions(creator),
        &follower.to_string(),
        version,
        since,
    )
    .await?;
    if new_follow {
        let _: i64 = connection
            .del(keys.inbox_live(follower))
            .await
            .context("marking an inbox for a rebuild")?;
    }
    if followers > u64::from(push_followers_max) {
        let _: i64 = connection
            .sadd(keys.famous(), creator.to_string())
            .await
            .context("marking a creator as pulled")?;
    } else if followers <= push_again_at(push_followers_max) {
        let pulled: bool = connection
            .sismember(keys.famous(), creator.to_string())
            .await
            .context("reading whether a creator is pulled")?;
        if pulled {
            // The inboxes first, then the set: a failure in between leaves the creator pulled,
            // and applying the event again (the gallery worker applies every one) does both.
            forget_followers_inboxes(keys, connection, creator).await?;
            let _: i64 = connection
                .srem(keys.famous(), creator.to_string())
                .await
                .context("marking a creator as pushed")?;
            // And again: an inbox rebuilt in between read the creator as pulled and left their
            // works out. (One rebuilt across both passes still can: rare, and not closed here.)
            forget_followers_inboxes(keys, connection, creator).await?;
        }
    }
    Ok(followers)
}

/// How few followers a pulled creator must fall to before being pushed again: a tenth below the
/// push limit, so that one account following and unfollowing a creator at the limit cannot
/// switch them back and forth (each switch back marks every follower's inbox for a rebuild).
/// Between the two, a creator stays as they were; a work both pushed and pulled lists once.
fn push_again_at(push_followers_max: u32) -> u64 {
    u64::from(push_followers_max - push_followers_max / 10)
}

/// A creator pulled at read time until now is pushed from now on, but their works so far were
/// never pushed: without this, their followers' live inboxes would lack them, and the feed, no
/// longer pulling them, would show none for as long as its owner kept reading it (reading keeps
/// an inbox live). Each follower's inbox is
/// marked as not live instead, so that their next read rebuilds it from the creators' own lists
/// (this creator's included). A creator who stays pushed costs nothing here.
async fn forget_followers_inboxes(
    keys: &Keys,
    connection: &mut crate::platform::redis_store::RedisConnection,
    creator: UserId,
) -> anyhow::Result<()> {
    let followers: Vec<String> = connection
        .zrange(keys.followers(creator), 0, -1)
        .await
        .context("reading the followers of a creator pushed from now on")?;
    let markers = followers
        .iter()
        .filter_map(|follower| Uuid::parse_str(follower).ok())
        .map(|follower| {
            let mut command = redis::cmd("DEL");
            command.arg(keys.inbox_live(UserId::from_uuid(follower)));
            command
        });
    // Each follower's marker is under their own tag: one command each, sent at once.
    let _: Vec<i64> = each(connection, markers)
        .await
        .context("marking followers' inboxes for a rebuild")?;
    Ok(())
}

/// A work in the new list, the hot ranking and its creator's works, or out of all of them.
pub(crate) async fn apply_work_lists(
    keys: &Keys,
    connection: &mut crate::platform::redis_store::RedisConnection,
    work_id: WorkId,
    creator: UserId,
    status: WorkStatus,
    published_at: DateTime<Utc>,
    list_max: u32,
) -> anyhow::Result<()> {
    let member = work_id.to_string();
    let bound = -(list_max as isize + 1);
    let new = keys.newest();
    if status.is_visible() {
        let published_ms = published_at.timestamp_millis();
        redis::pipe()
            .zadd(&new, &member, published_ms)
            .ignore()
            .zremrangebyrank(&new, 0, bound)
            .ignore()
            .query_async::<()>(connection)
            .await
            .context("listing a new work")?;
        // A new work enters the ranking at the bottom (no likes yet) unless it is there.
        let _: i64 = redis::cmd("ZADD")
            .arg(keys.hot())
            .arg("NX")
            .arg(0)
            .arg(&member)
            .query_async(connection)
            .await
            .context("ranking a new work")?;
        let _: i64 = connection
            .zadd(keys.creator_works(creator), &member, published_ms)
            .await
            .context("listing a creator's work")?;
    } else {
        let _: i64 = connection
            .zrem(&new, &member)
            .await
            .context("unlisting a work")?;
        let _: i64 = connection
            .zrem(keys.hot(), &member)
            .await
            .context("unranking a work")?;
        let _: i64 = connection
            .zrem(keys.creator_works(creator), &member)
            .await
            .context("unlisting a creator's work")?;
    }
    Ok(())
}

#[cfg(test)]
mod push_again_tests {
    use super::push_again_at;

    #[test]
    fn a_pulled_creator_is_pushed_again_a_tenth_below_the_push_limit() {
        assert_eq!(push_again_at(10_000), 9_000);
        assert_eq!(push_again_at(2), 2, "below ten, the limit itself");
        assert_eq!(push_again_at(0), 0);
    }
}

#[cfg(test)]
mod short_name_tests {
    use super::short_name;

    #[test]
    fn users_signed_up_in_the_same_minute_get_names_apart_that_no_username_can_take() {
        let names: std::collections::HashSet<String> = (0..1_000)
            .map(|_| short_name(uuid::Uuid::now_v7()))
            .collect();
        assert_eq!(names.len(), 1_000);
        for name in &names {
            assert!(
                zhihui_domain::identity::Username::parse(name).is_err(),
                "{name}"
            );
        }
    }
}
