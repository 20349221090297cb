//! Serialised, batched command handling for hot streams (accounts).
//!
//! Many concurrent commands on one stream would mostly lose the optimistic-concurrency race and
//! retry. Instead, each stream that has work gets one actor task in this process: commands queue
//! to it, and it decides a whole batch of them in order on its cached state and appends all their
//! events in ONE append. Conflicts then only come from other processes; on one, the actor catches
//! up from the store (reading only the new events) and decides the batch again. No client ever
//! sees a concurrency error, and a hot account does one append per batch, not per command.
//!
//! The cached state also makes long streams cheap: a stream is folded once when its actor starts,
//! then only caught up. An actor with nothing to do for `idle` exits and forgets its state.
//!
//! The cache may make a decision faster, never decide a refusal: another process may have
//! appended since (a freeze through another instance, then a release here would be refused as an
//! unknown hold). An accepted command is safe, since its append checks the version; a refusal is
//! returned only when the batch's append succeeded (so the version it was decided on was the
//! latest) or, when nothing was appended, after a read of the stream shows nothing came after
//! the cached version. If something did, the batch is decided again on it.
//!
//! An event with a unique id (`DomainEvent::unique_id`: a code's credit) that the log already
//! holds in another stream makes the store refuse the whole append (`EventIdReused`). The actor
//! catches up first (the id may be in this very stream, appended by another process: the command
//! is then a repeat); if nothing came, only the command that made the event is refused, with that
//! store error, and the rest of the batch is decided and appended again without it. An append
//! the store answers as a duplicate while it carries such an id may be another process's append
//! of the same event (not a retry of ours): the actor catches up and decides again, so the
//! command answers as the repeat it is.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use zhihui_domain::{Decider, DomainEvent};

use crate::platform::command::{CommandError, RetryPolicy, storable, to_new_events};
use crate::platform::event_store::{
    AnyEventStore, EventMetadata, EventStore, EventStoreError, ExpectedVersion,
};

/// Commands one append may carry: bounds the append's size and each batch's latency.
pub const BATCH_COMMANDS_MAX: usize = 256;
/// Queued commands per stream before senders wait: back-pressure instead of unbounded memory.
pub const STREAM_QUEUE_MAX: usize = 4_096;

/// What a command did: its new events (empty for an idempotent repeat) and the state after the
/// whole batch it was part of.
#[derive(Debug)]
pub struct Handled<D: Decider> {
    pub new_events: Vec<D::Event>,
    pub state_after: D::State,
}

type Reply<D> = oneshot::Sender<Result<Handled<D>, CommandError<<D as Decider>::Error>>>;

struct Request<D: Decider> {
    command: D::Command,
    metadata: EventMetadata,
    reply: Reply<D>,
}

/// What a batch decided for one of its commands.
enum Decision<D: Decider> {
    Events(Vec<D::Event>),
    Rejected(D::Error),
    /// Its event's unique id is already stored in another stream.
    IdTaken(uuid::Uuid),
    /// Its events cannot be stored (see [`storable`]).
    Unstorable(String),
}

/// The actors of one aggregate type, by stream.
pub struct AggregateService<D: Decider> {
    store: AnyEventStore,
    retry: RetryPolicy,
    idle: Duration,
    actors: Arc<Mutex<HashMap<String, mpsc::Sender<Request<D>>>>>,
}

impl<D: Decider> Clone for AggregateService<D> {
    fn clone(&self) -> Self {
        AggregateService {
            store: self.store.clone(),
            retry: self.retry,
            idle: self.idle,
            actors: self.actors.clone(),
        }
    }
}

impl<D: Decider> std::fmt::Debug for AggregateService<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AggregateService")
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}

impl<D> AggregateService<D>
where
    D: Decider + Send + 'static,
    D::State: Clone + Send + Sync + 'static,
    D::Command: Send + Sync + 'static,
    D::Event: DomainEvent + Clone + Send + Sync + 'static,
    D::Error: Send + Sync + 'static,
{
    pub fn new(store: AnyEventStore, retry: RetryPolicy, idle: Duration) -> Self {
        AggregateService {
            store,
            retry,
            idle,
            actors: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Handle one command on `stream`.
    pub async fn execute(
        &self,
        stream: &str,
        command: D::Command,
        metadata: EventMetadata,
    ) -> Result<Handled<D>, CommandError<D::Error>> {
        let (reply, answer) = oneshot::channel();
        let mut request = Request {
            command,
            metadata,
            reply,
        };
        loop {
            let sender = self.actor(stream);
            match sender.send(request).await {
                Ok(()) => break,
                // The actor exited between lookup and send: start a new one.
                Err(mpsc::error::SendError(returned)) => {
                    self.forget(stream, &sender);
                    request = returned;
                }
            }
        }
        answer
            .await
            .map_err(|_| CommandError::Store(anyhow::anyhow!("the actor of {stream} stopped")))?
    }

    fn actor(&self, stream: &str) -> mpsc::Sender<Request<D>> {
        let mut actors = self
            .actors
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if let Some(sender) = actors.get(stream).filter(|sender| !sender.is_closed()) {
            return sender.clone();
        }
        let (sender, receiver) = mpsc::channel(STREAM_QUEUE_MAX);
        actors.insert(stream.to_owned(), sender.clone());
        let actor = Actor::<D> {
            stream: stream.to_owned(),
            store: self.store.clone(),
            retry: self.retry,
            idle: self.idle,
            receiver,
            own: sender.downgrade(),
            actors: self.actors.clone(),
            state: None,
        };
        tokio::spawn(actor.run());
        sender
    }

    fn forget(&self, stream: &str, dead: &mpsc::Sender<Request<D>>) {
        let mut actors = self
            .actors
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if actors
            .get(stream)
            .is_some_and(|sender| sender.same_channel(dead))
        {
            actors.remove(stream);
        }
    }
}

struct Actor<D: Decider> {
    stream: String,
    store: AnyEventStore,
    retry: RetryPolicy,
    idle: Duration,
    receiver: mpsc::Receiver<Request<D>>,
    /// Its own channel, weakly (a strong sender would keep it alive forever): on idle exit the
    /// actor removes the registry entry only if it is still its own.
    own: mpsc::WeakSender<Request<D>>,
    actors: Arc<Mutex<HashMap<String, mpsc::Sender<Request<D>>>>>,
    /// The folded state and the version of its last event (`None`: no event yet).
    state: Option<(D::State, Option<u64>)>,
}

impl<D> Actor<D>
where
    D: Decider + Send + 'static,
    D::State: Clone + Send + Sync + 'static,
    D::Command: Send + Sync + 'static,
    D::Event: DomainEvent + Clone + Send + Sync + 'static,
    D::Error: Send + Sync + 'static,
{
    async fn run(mut self) {
        loop {
            let first = match tokio::time::timeout(self.idle, self.receiver.recv()).await {
                Ok(Some(request)) => request,
                Ok(None) => return,
                Err(_idle) => {
                    // Leave the registry first, then drain what raced in, then stop.
                    {
                        let mut actors = self
                            .actors
                            .lock()
                            .unwrap_or_else(|poison| poison.into_inner());
                        let own = self.own.upgrade();
                        if actors.get(&self.stream).is_some_and(|sender| {
                            own.as_ref().is_some_and(|own| sender.same_channel(own))
                        }) {
                            actors.remove(&self.stream);
                        }
                    }
                    self.receiver.close();
                    let mut late = Vec::new();
                    while let Ok(request) = self.receiver.try_recv() {
                        late.push(request);
                    }
                    if !late.is_empty() {
                        self.handle_batch(late).await;
                    }
                    return;
                }
            };
            let mut batch = vec![first];
            while batch.len() < BATCH_COMMANDS_MAX {
                match self.receiver.try_recv() {
                    Ok(request) => batch.push(request),
                    Err(_) => break,
                }
            }
            self.handle_batch(batch).await;
        }
    }

    async fn handle_batch(&mut self, batch: Vec<Request<D>>) {
        // Hand every request its own answer.
        match self.decide_and_append(&batch).await {
            Ok(results) => {
                for (request, result) in batch.into_iter().zip(results) {
                    let _ = request.reply.send(result);
                }
            }
            Err(error) => {
                // anyhow errors are not Clone: each request gets the message, and, when the
                // store was away, says so as its type (a 503 to the caller, not a 500).
                let message = format!("{error:#}");
                let unavailable = error.chain().any(|cause| {
                    matches!(
                        cause.downcast_ref::<EventStoreError>(),
                        Some(EventStoreError::Unavailable(_))
                    )
                });
                for request in batch {
                    let said = anyhow::anyhow!("{message}");
                    let error = if unavailable {
                        anyhow::Error::new(EventStoreError::Unavailable(said))
                    } else {
                        said
                    };
                    let _ = request.reply.send(Err(CommandError::Store(error)));
                }
            }
        }
    }

    async fn decide_and_append(
        &mut self,
        batch: &[Request<D>],
    ) -> anyhow::Result<Vec<Result<Handled<D>, CommandError<D::Error>>>> {
        // Requests whose event the log already holds under its unique id in another stream (a
        // code credited to another account): refused, and the rest decided again without them.
        let mut id_taken: Vec<Option<uuid::Uuid>> = vec![None; batch.len()];
        let mut attempt = 0;
        while attempt < self.retry.attempts_max {
            let (mut state, version) = match self.state.take() {
                Some(cached) => cached,
                None => self.catch_up(D::initial_state(), None).await?,
            };
            let base = (state.clone(), version);
            let mut decisions: Vec<Decision<D>> = Vec::with_capacity(batch.len());
            let mut new_events = Vec::new();
            // Which request would append each event that carries a unique id.
            let mut unique_owners: Vec<(uuid::Uuid, usize)> = Vec::new();
            for (index, request) in batch.iter().enumerate() {
                if let Some(event_id) = id_taken[index] {
                    decisions.push(Decision::IdTaken(event_id));
                    continue;
                }
                match D::decide(&state, &request.command) {
                    Ok(events) => {
                        let encoded = to_new_events(&events, &request.metadata);
                        if let Err(error) = storable(&encoded) {
                            decisions.push(Decision::Unstorable(format!("{error:#}")));
                            continue;
                        }
                        for event in &events {
                            state = D::evolve(state, event);
                            if let Some(event_id) = event.unique_id() {
                                unique_owners.push((event_id, index));
                            }
                        }
                        new_events.extend(encoded);
                        decisions.push(Decision::Events(events));
                    }
                    Err(error) => decisions.push(Decision::Rejected(error)),
                }
            }
            let finish = |state: &D::State, decisions: Vec<Decision<D>>| {
                decisions
                    .into_iter()
                    .map(|decision| match decision {
                        Decision::Events(events) => Ok(Handled {
                            new_events: events,
                            state_after: state.clone(),
                        }),
                        Decision::Rejected(error) => Err(CommandError::Rejected(error)),
                        Decision::IdTaken(event_id) => Err(CommandError::Store(
                            anyhow::Error::new(EventStoreError::EventIdReused { event_id }),
                        )),
                        Decision::Unstorable(message) => {
                            Err(CommandError::Store(anyhow::anyhow!("{message}")))
                        }
                    })
                    .collect()
            };
            if new_events.is_empty() {
                if decisions
                    .iter()
                    .any(|decision| !matches!(decision, Decision::Events(_)))
                {
                    // A refusal counts only on the stream's latest version: the cache may miss
                    // what another process appended (a freeze, a grant), and nothing appended
                    // here could reveal the conflict. Read what came after the cached version;
                    // if anything did, decide the batch again on it.
                    if self.catch_up_from(base).await? {
                        attempt += 1;
                        continue;
                    }
                    return Ok(finish(&state, decisions));
                }
                // Only repeats: an idempotent repeat stays one at every later version.
                let results = finish(&state, decisions);
                self.state = Some((state, version));
                return Ok(results);
            }
            let expected = match version {
                None => ExpectedVersion::NoStream,
                Some(version) => ExpectedVersion::Exact(version),
            };
            match self.store.append(&self.stream, expected, new_events).await {
                Ok(outcome) if outcome.duplicate && !unique_owners.is_empty() => {
                    // The store held this batch's first event already: with a unique id, that
                    // may be another process's append of the same event (a double click through
                    // two instances), not ours. Decide again on what the stream holds: the
                    // command is then a repeat, and says so.
                    self.catch_up_from(base).await?;
                    attempt += 1;
                }
                Ok(outcome) => {
                    // The append checked `version` was the latest: every refusal of this batch
                    // was decided on the stream's latest state too.
                    let results = finish(&state, decisions);
                    self.state = Some((state, Some(outcome.stream_version)));
                    return Ok(results);
                }
                Err(EventStoreError::WrongExpectedVersion { .. }) => {
                    // Another process appended: catch up from our base and decide again.
                    self.catch_up_from(base).await?;
                    attempt += 1;
                    crate::platform::command::backoff(self.retry, attempt).await;
                }
                Err(EventStoreError::EventIdReused { event_id }) => {
                    // Stored in this stream by another process (the cache missed it: deciding
                    // again on the latest state makes the command a repeat), or in another
                    // stream: then the command that made it is refused.
                    if self.catch_up_from(base).await? {
                        attempt += 1;
                        continue;
                    }
                    let Some(&(_, owner)) =
                        unique_owners.iter().find(|(unique, _)| *unique == event_id)
                    else {
                        anyhow::bail!(
                            "appending to {}: event id {event_id} is stored elsewhere, and no command of this batch made it",
                            self.stream
                        );
                    };
                    id_taken[owner] = Some(event_id);
                }
                Err(error) => {
                    // Unknown whether it landed: forget the cache, the next batch reloads.
                    return Err(
                        anyhow::Error::new(error).context(format!("appending to {}", self.stream))
                    );
                }
            }
        }
        Ok(batch
            .iter()
            .map(|_| {
                Err(CommandError::Contended {
                    stream: self.stream.clone(),
                    attempts: self.retry.attempts_max,
                })
            })
            .collect())
    }

    /// Catch up from `base` (the state and version a decision was made on), keep what the
    /// stream holds now as the cache, and answer whether it moved past `base`.
    async fn catch_up_from(&mut self, base: (D::State, Option<u64>)) -> anyhow::Result<bool> {
        let (state, version) = self.catch_up(base.0, base.1).await?;
        let moved = version != base.1;
        self.state = Some((state, version));
        Ok(moved)
    }

    async fn catch_up(
        &self,
        state: D::State,
        version: Option<u64>,
    ) -> anyhow::Result<(D::State, Option<u64>)> {
        let loaded =
            crate::platform::command::catch_up::<D>(&self.store, &self.stream, state, version)
                .await?;
        Ok((loaded.state, loaded.version))
    }
}
