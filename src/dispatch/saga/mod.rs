//! The dispatch saga: queued tasks become prompts on ComfyUI servers, finished prompts become
//! images and settled points, whatever fails on the way.
//!
//! One leader at a time runs it ([`Dispatcher::lead`]: a Redis lease with a fencing token; every
//! task event the saga appends carries the token, and a task refuses tokens older than the last
//! one it saw). The saga is an actor: [`Saga::step`] takes one input of a closed set (a socket
//! event, a task event from the log, the result of a side effect, a timer tick) and reacts. It
//! never waits on Redis, PostgreSQL or a server while reacting: every round trip is a spawned
//! effect whose result comes back as an input, so a prompt's end is acted on the moment it
//! arrives, and a slow server never holds up the leader's renewals or the other servers.
//!
//! Per task: claimed by the filler (one Lua step: leader check, a free slot of a connected
//! server, pop the queue, lease the slot) -> `TaskDispatched` with a fresh prompt id (recorded
//! before the post, so a restart can look for it) -> staged until its server has room: a free
//! slot, or a place in the server's own queue behind the prompts it runs
//! (`posted_ahead_per_backend`; ComfyUI then starts it the moment the one before ends, with no
//! round trip at all) -> post -> `TaskStarted` (when it runs) -> follow the socket by prompt id,
//! forward progress -> on the first terminal message the next staged task is posted at once (no
//! polling period, no round trip) and the slot's lease is released by the next filler ->
//! history, images through `/view` into
//! the image store -> `dispatch` intent row -> `TaskSucceeded` / `TaskFailed` / `TaskCancelled`
//! -> settle or release the hold (`TaskService::reconcile`, idempotent) -> end the intent.
//!
//! Slot leases are released, renewed and claimed only by the filler, one filler at a time, so a
//! renewal never puts back a lease that a release just took away.
//!
//! Recovery: the socket is a hint, `/queue` + `/history` the truth. After a reconnect and on a
//! watchdog period every prompt in flight is located; a prompt the server lost goes back to
//! posting and is posted once more with the same id when the socket is open (only a post the
//! server accepts spends that one resubmission), then, lost again, failed. A new leader adopts every task in flight (`TaskAdopted`
//! fences the old leader out) and locates it; the queue is rebuilt from the events. What a dead
//! dispatcher leaves between two streams (a task whose end is recorded but whose hold is not
//! settled) is finished by the intent sweeper from the `dispatch` intent.
//!
//! Rooms, one step each: this file holds the actor (its inputs, its state, `step`, the reaction to
//! each input and the ticks); `leader.rs` the dispatcher and leadership; `claim.rs` the filler,
//! the recording of claims and staging; `submit.rs` posting and the server's answer; `watch.rs`
//! socket messages and locating prompts; `settle.rs` a prompt's end, its results and the
//! recorded end; `recover.rs` adopting what a dead leader left.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use deadpool_postgres::Pool;
use futures::StreamExt;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use uuid::Uuid;
use zhihui_domain::pool::{POOL_EVENT_TYPES, POOL_STREAM, PoolState};
use zhihui_domain::task::{
    Canceller, TaskCommand, TaskError, TaskId, TaskImage, TaskStatus, task_id_of_stream,
};
use zhihui_domain::user::UserId;

use crate::dispatch::comfy::{
    ComfyClient, ComfyMessage, HistoryOutcome, PostOutcome, PromptWhereabouts,
};
use crate::dispatch::images::{ImageStore, image_id};
use crate::dispatch::socket::{self, SocketEvent, SocketTimings};
use crate::labels::{LabelError, Labeller};
use crate::platform::clock::Clock;
use crate::platform::command::CommandError;
use crate::platform::configuration::{BackendSettings, DispatchSettings};
use crate::platform::event_store::{
    AnyEventStore, EventFilter, EventMetadata, EventStore, SubscriptionMessage,
};
use crate::platform::notify::{Notifier, TaskNotice};
use crate::tasks::estimate::StepTimes;
use crate::tasks::pool::PoolService;
use crate::tasks::queue::lease::{Claimed, Fill, FillPlan, Leases, ServerSlots, Term};
use crate::tasks::service::{IntentKind, TaskService};

mod claim;
mod leader;
mod pool;
mod recover;
mod settle;
mod submit;
mod watch;

use claim::{FillOutcome, Prepared};
pub use leader::Dispatcher;
use pool::Inspection;

mod state;
use state::*;

/// Orphans adopted per scan: bounds one tick's work (the rest come at the next scan).
pub const ADOPT_PER_SCAN_MAX: i64 = 256;
/// Attempts to fetch and store a finished prompt's images before the task fails.
pub const COMPLETION_ATTEMPTS_MAX: u32 = 3;
/// Gap samples kept for the benchmark (oldest dropped).
pub const GAP_SAMPLES_MAX: usize = 100_000;

/// One GPU idle gap as the saga sees it (benchmarks): from a prompt's end message to the next
/// `POST /prompt` answered on that server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GapSample {
    pub duration: Duration,
    /// A staged task was ready when the slot freed (the gap is the saga's reaction); otherwise
    /// the slot waited for the next dispatch to be recorded.
    pub staged_ready: bool,
}

/// The leader lease is gone: the saga stops; the process may try to lead again.
#[derive(Debug, thiserror::Error)]
#[error("the dispatcher lost its leadership")]
pub struct LostLeadership;

/// A running saga (the leader's). Dropping it closes its sockets and stops its subscription.
pub struct Saga {
    dispatcher: Dispatcher,
    term: Term,
    inputs: mpsc::UnboundedReceiver<Input>,
    inputs_sender: mpsc::UnboundedSender<Input>,
    sockets: mpsc::UnboundedReceiver<(usize, SocketEvent)>,
    tick: tokio::time::Interval,
    backends: Vec<BackendState>,
    /// Where each server's socket reports (a server added at run time gets its socket here).
    socket_sender: mpsc::UnboundedSender<(usize, SocketEvent)>,
    timings: SocketTimings,
    in_flight: HashMap<TaskId, InFlight>,
    by_prompt: HashMap<Uuid, TaskId>,
    /// Cancel requests for tasks whose dispatch was still being recorded.
    early_cancels: std::collections::HashSet<TaskId>,
    background: Vec<AbortHandle>,
    last_leader_renew: Instant,
    last_slot_renew: Instant,
    last_watchdog: Instant,
    last_orphan_scan: Instant,
    gaps: Vec<GapSample>,
    /// Counts claims (orders staged tasks).
    claims: u64,
    /// A filler effect is out: it alone releases, renews and claims slot leases, one after the
    /// other, so a renewal can never put back a lease that a release just took away.
    filling: bool,
    /// Something may be claimable (a slot freed, a task queued): run the filler (again).
    fill_wanted: bool,
    /// Slot leases to release, in the order their tasks ended (the next filler's first work).
    releases: Vec<(usize, TaskId)>,
    /// The slot leases are due for renewal: the next filler renews them.
    slot_renew_wanted: bool,
    /// A leader lease renewal is out.
    renewing: bool,
    /// After a failed renewal, not before this.
    renew_retry_at: Instant,
    /// When the servers' state was last published for `GET /admin/backends`.
    last_status_publish: Option<Instant>,
    /// The pool stream is being read (after a pool event).
    pool_loading: bool,
    /// Read the pool again (it changed while it was being read, or the read failed).
    pool_reload_wanted: bool,
    /// Seconds per step measured per server and model (the wait estimates').
    step_times: StepTimes,
}

impl std::fmt::Debug for Saga {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saga")
            .field("term", &self.term)
            .field("in_flight", &self.in_flight.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Saga {
    fn drop(&mut self) {
        for handle in &self.background {
            handle.abort();
        }
        // This process leads no more: its last readings of the servers would stay in its
        // `/metrics` and add to the next leader's under `sum`.
        for backend in &self.backends {
            let name = backend.settings.name.clone();
            metrics::gauge!("zhihui_backend_up", "backend" => name.clone()).set(0.0);
            metrics::gauge!("zhihui_backend_busy", "backend" => name.clone()).set(0.0);
            metrics::gauge!("zhihui_backend_capacity", "backend" => name).set(0.0);
        }
    }
}

fn is_lost(error: &anyhow::Error) -> bool {
    error.is::<LostLeadership>()
}

impl Saga {
    async fn start(dispatcher: Dispatcher, term: Term, pool: PoolState) -> anyhow::Result<Saga> {
        let settings = &dispatcher.settings;
        let (inputs_sender, inputs) = mpsc::unbounded_channel();
        let (socket_sender, sockets) = mpsc::unbounded_channel();
        let mut background = Vec::new();
        let timings = SocketTimings {
            ping_interval: Duration::from_millis(settings.socket_ping_interval_ms),
            silence_max: Duration::from_millis(settings.socket_silence_max_ms),
            backoff_min: Duration::from_millis(settings.reconnect_backoff_min_ms),
            backoff_max: Duration::from_millis(settings.reconnect_backoff_max_ms),
        };
        // Task events from now on: queued tasks wake the saga at once, cancel requests reach it.
        let head = dispatcher
            .store
            .head()
            .await
            .context("reading the log head")?;
        let mut subscription = dispatcher.store.subscribe_all(
            head,
            EventFilter::EventTypes(
                ["TaskQueued", "TaskCancelRequested"]
                    .into_iter()
                    .chain(POOL_EVENT_TYPES)
                    .map(String::from)
                    .collect(),
            ),
        );
        let sender = inputs_sender.clone();
        background.push(
            tokio::spawn(async move {
                while let Some(message) = subscription.next().await {
                    let input = match message {
                        Ok(SubscriptionMessage::Event(recorded)) => {
                            match (
                                recorded.event_type.as_str(),
                                task_id_of_stream(&recorded.stream),
                            ) {
                                ("TaskCancelRequested", Some(task_id)) => {
                                    Input::CancelRequested(task_id)
                                }
                                _ if recorded.stream == POOL_STREAM => Input::PoolChanged,
                                _ => Input::Queued,
                            }
                        }
                        Ok(_) => continue,
                        Err(error) => Input::SubscriptionEnded(error.to_string()),
                    };
                    if sender.send(input).is_err() {
                        return;
                    }
                }
                drop(sender.send(Input::SubscriptionEnded("ended".into())));
            })
            .abort_handle(),
        );
        let mut tick = tokio::time::interval(Duration::from_millis(settings.tick_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let now = Instant::now();
        let mut saga = Saga {
            backends: Vec::new(),
            socket_sender,
            timings,
            dispatcher,
            term,
            inputs,
            inputs_sender,
            sockets,
            tick,
            in_flight: HashMap::new(),
            by_prompt: HashMap::new(),
            early_cancels: std::collections::HashSet::new(),
            background,
            last_leader_renew: now,
            last_slot_renew: now,
            last_watchdog: now,
            last_orphan_scan: now,
            gaps: Vec::new(),
            claims: 0,
            filling: false,
            fill_wanted: false,
            releases: Vec::new(),
            slot_renew_wanted: false,
            renewing: false,
            renew_retry_at: now,
            last_status_publish: None,
            pool_loading: false,
            pool_reload_wanted: false,
            step_times: StepTimes::default(),
        };
        saga.follow_pool(&pool)?;
        Ok(saga)
    }

    pub fn fencing_token(&self) -> u64 {
        self.term.fencing_token
    }

    /// Tasks this saga follows (dispatched, running, or finishing).
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Servers with an open socket.
    pub fn connected_backends(&self) -> usize {
        self.backends
            .iter()
            .filter(|b| b.client_id.is_some())
            .count()
    }

    /// GPU idle gaps measured so far (slot freed with work waiting -> next prompt accepted), taken.
    pub fn take_gaps(&mut self) -> Vec<GapSample> {
        std::mem::take(&mut self.gaps)
    }

    /// Run until the leadership is lost, then give the lease up.
    pub async fn run(mut self) {
        // Failed steps in a row: each waits longer (to 500 ms), so a store that is away (a
        // PostgreSQL failover) is asked a few times a second, not hundreds.
        let mut failures: u32 = 0;
        loop {
            if let Err(error) = self.step().await {
                if is_lost(&error) {
                    tracing::warn!(
                        fencing_token = self.term.fencing_token,
                        "dispatcher lost its leadership"
                    );
                    // A no-op when the lease is gone; when the saga stopped for another reason
                    // (its subscription ended) the next leader need not wait for the lease.
                    self.resign().await;
                    return;
                }
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), failures_in_a_row = failures + 1, "dispatch step failed");
                let backoff_ms = (10_u64 << failures.min(6)).min(500);
                failures = failures.saturating_add(1);
                tokio::time::sleep(std::time::Duration::from_millis(backoff_ms)).await;
            } else {
                failures = 0;
            }
        }
    }

    /// Give the lease up now (a clean stop), so another process takes over at once.
    pub async fn resign(self) {
        if let Err(error) = self.dispatcher.leases.resign(&self.term).await {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "could not resign the leader lease");
        }
    }

    /// Wait for one input and react to it. `Err(LostLeadership)` ends the saga.
    pub async fn step(&mut self) -> anyhow::Result<()> {
        // Under a steady stream of inputs the timer must still get its turn: the lease renewal
        // cannot wait for a quiet moment.
        let renew = Duration::from_millis(self.dispatcher.settings.leader_renew_ms);
        if self.last_leader_renew.elapsed() >= renew
            && !self.renewing
            && Instant::now() >= self.renew_retry_at
        {
            return self.on_tick().await;
        }
        // Not biased: under a burst of socket messages the effects' results (a renewal among
        // them) must still get their turns.
        tokio::select! {
            Some((backend, event)) = self.sockets.recv() => self.handle(Input::Socket(backend, event)).await,
            Some(input) = self.inputs.recv() => self.handle(input).await,
            _ = self.tick.tick() => self.on_tick().await,
        }
    }

    /// Each server's capacity, prompts in flight and socket state, for `/metrics` (each tick:
    /// cheap, a few servers, and never on a slot's path).
    fn publish_pool_gauges(&self) {
        for (index, backend) in self.backends.iter().enumerate() {
            let name = backend.settings.name.clone();
            let (capacity, up) = if backend.removed {
                (0.0, 0.0)
            } else {
                (
                    f64::from(backend.settings.capacity),
                    if backend.client_id.is_some() {
                        1.0
                    } else {
                        0.0
                    },
                )
            };
            metrics::gauge!("zhihui_backend_capacity", "backend" => name.clone()).set(capacity);
            metrics::gauge!("zhihui_backend_busy", "backend" => name.clone())
                .set(self.busy(index) as f64);
            metrics::gauge!("zhihui_backend_up", "backend" => name).set(up);
        }
    }

    /// One ComfyUI error of a bounded `kind` on a server.
    pub(super) fn count_error(&mut self, backend: usize, kind: &'static str) {
        self.backends[backend].last_error = Some((kind.to_owned(), self.dispatcher.clock.now()));
        metrics::counter!(
            "zhihui_comfyui_errors_total",
            "backend" => self.backends[backend].settings.name.clone(),
            "kind" => kind
        )
        .increment(1);
    }

    fn metadata(&self, task_id: TaskId) -> EventMetadata {
        dispatcher_metadata(self.term.fencing_token, task_id)
    }

    async fn handle(&mut self, input: Input) -> anyhow::Result<()> {
        match input {
            Input::Socket(backend, SocketEvent::Opened { client_id }) => {
                tracing::info!(backend = %self.backends[backend].settings.name, "server socket open");
                self.backends[backend].client_id = Some(client_id);
                // What it offers may have changed while it was away (a restart with new models).
                self.inspect(backend);
                // `zhihui_backend_up` follows at the next tick (publish_pool_gauges).
                if std::mem::replace(&mut self.backends[backend].opened_before, true) {
                    metrics::counter!(
                        "zhihui_comfyui_socket_reconnects_total",
                        "backend" => self.backends[backend].settings.name.clone()
                    )
                    .increment(1);
                }
                // Whatever happened while we were away is only in /queue and /history.
                let tasks: Vec<TaskId> = self
                    .in_flight
                    .iter()
                    .filter(|(_, f)| f.backend == backend)
                    .map(|(task_id, _)| *task_id)
                    .collect();
                for task_id in tasks {
                    self.check_on(task_id);
                }
                self.fill_all();
                Ok(())
            }
            Input::Socket(backend, SocketEvent::Closed { reason }) => {
                tracing::warn!(backend = %self.backends[backend].settings.name, %reason, "server socket closed");
                self.backends[backend].client_id = None;
                self.count_error(backend, "socket_closed");
                self.backends[backend].last_error = Some((
                    format!("socket closed: {reason}"),
                    self.dispatcher.clock.now(),
                ));
                // Its owners are told it waits for the server, which may never come back.
                let lost: Vec<(UserId, TaskId)> = self
                    .in_flight
                    .iter()
                    .filter(|(_, flight)| flight.backend == backend)
                    .map(|(task_id, flight)| (flight.owner, *task_id))
                    .collect();
                if !lost.is_empty() {
                    let notifier = self.dispatcher.notifier.clone();
                    self.dispatcher.work.spawn(async move {
                        for (owner, task_id) in lost {
                            notifier.tell(owner, task_id, TaskNotice::ServerLost).await;
                        }
                    });
                }
                Ok(())
            }
            Input::Socket(backend, SocketEvent::Message(message)) => {
                self.on_message(backend, message)
            }
            Input::Queued => {
                self.fill_all();
                Ok(())
            }
            Input::Claimed { backend, task_id } => {
                self.claims += 1;
                self.backends[backend].staging.insert(task_id, self.claims);
                Ok(())
            }
            Input::Filled(outcome) => self.on_filled(outcome),
            Input::Renewed { at, result } => {
                self.renewing = false;
                match result {
                    Ok(true) => {
                        self.last_leader_renew = at;
                        Ok(())
                    }
                    Ok(false) => Err(LostLeadership.into()),
                    Err(error) => {
                        self.renew_retry_at = Instant::now()
                            + Duration::from_millis(self.dispatcher.settings.tick_ms);
                        Err(error)
                    }
                }
            }
            // A start that could not be recorded is not retried: the end is what matters, and
            // the end is recorded whatever happened to the start.
            Input::Started(result) => result,
            Input::CancelRequested(task_id) => {
                let Some(flight) = self.in_flight.get_mut(&task_id) else {
                    // Maybe being staged right now: remembered for `admit`.
                    if self
                        .backends
                        .iter()
                        .any(|b| b.staging.contains_key(&task_id))
                    {
                        self.early_cancels.insert(task_id);
                    }
                    return Ok(());
                };
                if flight.stop.is_some() {
                    return Ok(());
                }
                flight.stop = Some(Stop::Cancel);
                if flight.phase == Phase::Staged {
                    // Never posted: cancelled without asking any server.
                    self.free_slot(task_id);
                    return self.record(task_id, Completion::Vanished);
                }
                self.check_on(task_id);
                Ok(())
            }
            Input::Prepared {
                backend,
                task_id,
                result,
            } => {
                let claim_seq = self.backends[backend].staging.remove(&task_id).unwrap_or(0);
                let prepared = match result {
                    Ok(prepared) => prepared,
                    Err(error) => {
                        // Tasks claimed after it may have waited for it (`staged_on`).
                        self.fill_all();
                        return Err(error);
                    }
                };
                self.admit(backend, task_id, prepared);
                if let Some(flight) = self.in_flight.get_mut(&task_id)
                    && flight.phase == Phase::Staged
                {
                    flight.claim_seq = claim_seq;
                }
                // Cancelled while it was being recorded: never posted, cancelled here.
                if self
                    .in_flight
                    .get(&task_id)
                    .is_some_and(|f| f.phase == Phase::Staged && f.stop.is_some())
                {
                    self.free_slot(task_id);
                    return self.record(task_id, Completion::Vanished);
                }
                // A slot may have freed meanwhile: the staged task goes out now.
                self.fill_all();
                Ok(())
            }
            Input::Recorded {
                task_id,
                completion,
                result,
            } => match result {
                Ok(()) => {
                    if let Some(flight) = self.in_flight.remove(&task_id) {
                        self.by_prompt.remove(&flight.prompt_id);
                    }
                    Ok(())
                }
                Err(error) if is_lost(&error) => Err(error),
                Err(error) => {
                    if let Some(flight) = self.in_flight.get_mut(&task_id) {
                        flight.effect_running = false;
                        flight.unrecorded = Some(completion);
                    }
                    Err(error)
                }
            },
            Input::Posted {
                task_id,
                prompt_id,
                outcome,
                gap,
            } => self.on_posted(task_id, prompt_id, outcome, gap),
            Input::Located {
                task_id,
                prompt_id,
                result,
            } => self.on_located(task_id, prompt_id, result),
            Input::Completed {
                task_id,
                prompt_id,
                result,
            } => {
                let Some(flight) = self.in_flight.get_mut(&task_id) else {
                    return Ok(());
                };
                if flight.prompt_id != prompt_id {
                    return Ok(());
                }
                flight.effect_running = false;
                match result {
                    Ok(completion) => self.record(task_id, completion),
                    Err(error) => {
                        flight.completion_attempts += 1;
                        tracing::warn!(%task_id, attempt = flight.completion_attempts, error = %crate::platform::telemetry::error_chain(&error), "fetching results failed");
                        if flight.completion_attempts >= COMPLETION_ATTEMPTS_MAX {
                            let reason =
                                "the images could not be fetched from the image server".to_owned();
                            self.record(task_id, Completion::Failed(reason))
                        } else {
                            // Retried by the watchdog.
                            Ok(())
                        }
                    }
                }
            }
            Input::PoolChanged => {
                self.reload_pool();
                Ok(())
            }
            Input::PoolLoaded(result) => self.on_pool_loaded(result),
            Input::Inspected { backend, result } => self.on_inspected(backend, result),
            Input::SubscriptionEnded(reason) => {
                // Without it, cancels and new tasks still arrive through the ticks; start over to
                // get the prompt wake-ups back.
                tracing::warn!(%reason, "task event subscription ended; the saga restarts");
                Err(LostLeadership.into())
            }
        }
    }

    async fn on_tick(&mut self) -> anyhow::Result<()> {
        self.publish_pool_gauges();
        let settings = self.dispatcher.settings.clone();
        let now = Instant::now();
        self.pool_tick(now);
        if now - self.last_leader_renew >= Duration::from_millis(settings.leader_renew_ms)
            && !self.renewing
            && now >= self.renew_retry_at
        {
            // Off the saga's path: a renewal's round trip must not hold up a freed slot.
            self.renewing = true;
            let leases = self.dispatcher.leases.clone();
            let term = self.term.clone();
            let sender = self.inputs_sender.clone();
            self.dispatcher.work.spawn(async move {
                let result = leases.renew(&term, settings.leader_lease_ms).await;
                drop(sender.send(Input::Renewed { at: now, result }));
            });
        }
        if now - self.last_slot_renew >= Duration::from_millis(settings.slot_renew_ms) {
            // The filler renews them, in line with its releases.
            self.slot_renew_wanted = true;
            self.last_slot_renew = now;
        }
        // Timeouts.
        let expired: Vec<TaskId> = self
            .in_flight
            .iter()
            .filter(|(_, f)| {
                f.deadline <= now
                    && f.stop.is_none()
                    && matches!(f.phase, Phase::Posting | Phase::Accepted)
            })
            .map(|(task_id, _)| *task_id)
            .collect();
        for task_id in expired {
            if let Some(flight) = self.in_flight.get_mut(&task_id) {
                tracing::warn!(%task_id, "task timed out; interrupting it");
                flight.stop = Some(Stop::Timeout);
            }
            self.check_on(task_id);
        }
        // A staged task waits for a slot on its server; if the server is gone past the task's
        // deadline, it will never be posted: it fails (never having run).
        let stranded: Vec<TaskId> = self
            .in_flight
            .iter()
            .filter(|(_, f)| {
                f.phase == Phase::Staged
                    && f.deadline <= now
                    && self.backends[f.backend].client_id.is_none()
            })
            .map(|(task_id, _)| *task_id)
            .collect();
        for task_id in stranded {
            if let Some(flight) = self.in_flight.get_mut(&task_id) {
                flight.stop = Some(Stop::Timeout);
            }
            self.free_slot(task_id);
            self.record(task_id, Completion::Vanished)?;
        }
        // Completions not recorded yet (the store was down).
        let unrecorded: Vec<TaskId> = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.unrecorded.is_some())
            .map(|(task_id, _)| *task_id)
            .collect();
        for task_id in unrecorded {
            if let Some(completion) = self
                .in_flight
                .get_mut(&task_id)
                .and_then(|f| f.unrecorded.take())
            {
                self.record(task_id, completion)?;
            }
        }
        if now - self.last_watchdog >= Duration::from_millis(settings.reconcile_interval_ms) {
            self.last_watchdog = now;
            let tasks: Vec<TaskId> = self.in_flight.keys().copied().collect();
            for task_id in tasks {
                self.check_on(task_id);
            }
        }
        if now - self.last_orphan_scan >= Duration::from_millis(settings.orphan_scan_interval_ms) {
            self.last_orphan_scan = now;
            self.adopt_orphans().await?;
        }
        self.fill_all();
        Ok(())
    }
}

/// Who the saga's appends are by: the dispatcher of this term, for this task.
fn dispatcher_metadata(fencing_token: u64, task_id: TaskId) -> EventMetadata {
    EventMetadata {
        correlation_id: task_id,
        causation_id: None,
        actor: format!("system:dispatcher:{fencing_token}"),
    }
}

#[cfg(test)]
mod tests;
