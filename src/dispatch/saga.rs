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
//! watchdog period every prompt in flight is located; a prompt the server lost is posted once
//! more with the same id, then failed. A new leader adopts every task in flight (`TaskAdopted`
//! fences the old leader out) and locates it; the queue is rebuilt from the events. What a dead
//! dispatcher leaves between two streams (a task whose end is recorded but whose hold is not
//! settled) is finished by the intent sweeper from the `dispatch` intent.

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
use zhihui_domain::task::{
    Canceller, TaskCommand, TaskError, TaskId, TaskImage, TaskStatus, task_id_of_stream,
};
use zhihui_domain::user::UserId;

use crate::clock::Clock;
use crate::command::CommandError;
use crate::configuration::{BackendSettings, DispatchSettings};
use crate::dispatch::comfy::{
    ComfyClient, ComfyMessage, HistoryOutcome, PostOutcome, PromptWhereabouts,
};
use crate::dispatch::images::{ImageStore, image_id};
use crate::dispatch::lease::{Claimed, Fill, Leases, ServerSlots, Term};
use crate::dispatch::socket::{self, SocketEvent, SocketTimings};
use crate::event_store::{
    AnyEventStore, EventFilter, EventMetadata, EventStore, SubscriptionMessage,
};
use crate::labels::{LabelError, Labeller};
use crate::notify::{Notifier, TaskNotice};
use crate::tasks::service::{IntentKind, TaskService};

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

struct Backend {
    settings: BackendSettings,
    client: ComfyClient,
}

/// What a dispatcher process needs; [`Dispatcher::lead`] turns it into a running [`Saga`].
#[derive(Clone)]
pub struct Dispatcher {
    tasks: TaskService,
    store: AnyEventStore,
    pool: Pool,
    leases: Leases,
    notifier: Notifier,
    images: ImageStore,
    labeller: Labeller,
    clock: Clock,
    settings: DispatchSettings,
    backends: Arc<Vec<Backend>>,
    instance: String,
    /// The dispatch path's own thread: the saga (in `serve`), its sockets and its posts.
    lane: Arc<Lane>,
    /// The shared runtime: everything the saga starts that is not on the dispatch path
    /// (recording, settling, preparing, fetching results, looking prompts up).
    work: tokio::runtime::Handle,
}

/// A current-thread runtime on an OS thread of its own. On the shared runtime a woken saga or a
/// post waits in line behind every ready task (downloads, appends, HTTP requests); here it runs
/// at once, and the kernel schedules a mostly idle thread promptly. Stops when dropped.
struct Lane {
    handle: tokio::runtime::Handle,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Lane {
    fn start() -> anyhow::Result<Lane> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("building the dispatch lane's runtime")?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("zhihui-dispatch".into())
            .spawn(move || {
                // Until the last dispatcher handle is dropped; then its tasks are dropped too.
                drop(runtime.block_on(stopped));
            })
            .context("starting the dispatch lane's thread")?;
        Ok(Lane {
            handle,
            _stop: stop,
        })
    }
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("instance", &self.instance)
            .field(
                "backends",
                &self
                    .backends
                    .iter()
                    .map(|b| &b.settings.name)
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Dispatcher {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        tasks: TaskService,
        store: AnyEventStore,
        pool: Pool,
        leases: Leases,
        notifier: Notifier,
        images: ImageStore,
        labeller: Labeller,
        clock: Clock,
        settings: DispatchSettings,
    ) -> anyhow::Result<Dispatcher> {
        let timeout = Duration::from_millis(settings.http_timeout_ms);
        let backends = settings
            .parsed_backends()?
            .into_iter()
            .map(|backend| {
                Ok(Backend {
                    client: ComfyClient::new(&backend.url, timeout)?,
                    settings: backend,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Dispatcher {
            tasks,
            store,
            pool,
            leases,
            notifier,
            images,
            labeller,
            clock,
            settings,
            backends: Arc::new(backends),
            instance: Uuid::now_v7().simple().to_string(),
            lane: Arc::new(Lane::start()?),
            work: tokio::runtime::Handle::try_current()
                .context("a dispatcher is built inside the runtime")?,
        })
    }

    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    pub fn backend_names(&self) -> Vec<String> {
        self.backends
            .iter()
            .map(|b| b.settings.name.clone())
            .collect()
    }

    /// Become the leader if nobody is, and start the saga: sockets, the task-event subscription,
    /// the queue rebuilt from the events, every task in flight adopted. `None` while another
    /// process leads.
    pub async fn lead(&self) -> anyhow::Result<Option<Saga>> {
        let Some(term) = self
            .leases
            .acquire(&self.instance, self.settings.leader_lease_ms)
            .await?
        else {
            return Ok(None);
        };
        tracing::info!(
            fencing_token = term.fencing_token,
            "dispatcher leader elected"
        );
        let mut saga = Saga::start(self.clone(), term.clone()).await?;
        // The rebuild reads the task events after the read model's checkpoint, which can take
        // longer than a lease: keep renewing meanwhile.
        let keep_lease = async {
            let renew = Duration::from_millis(self.settings.leader_renew_ms);
            loop {
                tokio::time::sleep(renew).await;
                if !self
                    .leases
                    .renew(&term, self.settings.leader_lease_ms)
                    .await?
                {
                    return anyhow::Ok(());
                }
            }
        };
        let startup = async {
            saga.dispatcher.tasks.rebuild_queue().await?;
            saga.adopt_orphans().await?;
            saga.adopt_leased().await
        };
        let started = tokio::select! {
            started = startup => started,
            lost = keep_lease => Err(lost.err().unwrap_or_else(|| LostLeadership.into())),
        };
        match started {
            Ok(()) => Ok(Some(saga)),
            Err(error) => {
                saga.resign().await;
                Err(error)
            }
        }
    }

    /// [`Dispatcher::run`] on the dispatch lane's thread.
    pub fn spawn_run(self) -> tokio::task::JoinHandle<()> {
        let lane = self.lane.handle.clone();
        lane.spawn(self.run())
    }

    /// Run `future` on the dispatch lane's thread, where `serve` runs the saga (benchmarks
    /// drive a saga there step by step).
    pub fn spawn_on_lane<F>(&self, future: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.lane.handle.spawn(future)
    }

    /// Lead whenever possible, forever: a lost lease ends the saga (its sockets close, its memory
    /// is dropped) and the process competes again; the next saga resumes from the events.
    pub async fn run(self) {
        let retry = Duration::from_millis(self.settings.leader_retry_ms);
        loop {
            match self.lead().await {
                Ok(Some(saga)) => saga.run().await,
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(error = %crate::telemetry::error_chain(&error), "dispatcher could not start")
                }
            }
            tokio::time::sleep(retry).await;
        }
    }
}

/// Inputs of the saga: a closed set.
#[derive(Debug)]
enum Input {
    Socket(usize, SocketEvent),
    /// A task's `TaskStarted` was recorded (or not).
    Started(anyhow::Result<()>),
    /// A task was queued (from the log): fill free slots.
    Queued,
    /// A user asked to cancel a task in flight (from the log).
    CancelRequested(TaskId),
    Posted {
        task_id: TaskId,
        prompt_id: Uuid,
        outcome: PostOutcome,
        gap: Option<GapSample>,
    },
    /// Where a prompt is (reconcile after a reconnect, the watchdog, after a stop).
    Located {
        task_id: TaskId,
        prompt_id: Uuid,
        result: anyhow::Result<PromptWhereabouts>,
    },
    Completed {
        task_id: TaskId,
        prompt_id: Uuid,
        result: anyhow::Result<Completion>,
    },
    /// The filler took a task off the queue for `backend`; its dispatch is being recorded.
    /// Sent before the recording starts, so it always comes before the task's `Prepared`.
    Claimed {
        backend: usize,
        task_id: TaskId,
    },
    /// The filler is done: what it could not release, and how it ended.
    Filled(FillOutcome),
    /// The leader lease renewed (`Ok(true)`), gone (`Ok(false)`), or not reachable.
    Renewed {
        at: Instant,
        result: anyhow::Result<bool>,
    },
    /// A staged dispatch was recorded (or not).
    Prepared {
        backend: usize,
        task_id: TaskId,
        result: anyhow::Result<Option<Prepared>>,
    },
    /// The end was recorded and the hold settled (or not: then `completion` is retried).
    Recorded {
        task_id: TaskId,
        completion: Completion,
        result: anyhow::Result<()>,
    },
    SubscriptionEnded(String),
}

/// How a prompt ended, once its results are stored.
#[derive(Debug, Clone)]
enum Completion {
    Succeeded(Vec<TaskImage>),
    Failed(String),
    Interrupted,
    /// The server does not know the prompt (deleted by our cancel, or lost to a restart).
    Vanished,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Recorded as dispatched to a busy server, not posted yet: the next task for that server,
    /// posted the moment it has room (no round trip to the store in between).
    Staged,
    /// Recorded as dispatched; the server has not (knowingly) accepted it.
    Posting,
    /// The server accepted it (`TaskStarted`).
    Accepted,
    /// It ended on the server; its slot is free; results are being fetched and recorded.
    Finishing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Cancel,
    Timeout,
}

#[derive(Debug)]
struct InFlight {
    owner: UserId,
    backend: usize,
    prompt_id: Uuid,
    workflow: Value,
    phase: Phase,
    deadline: Instant,
    stop: Option<Stop>,
    stop_attempts: u32,
    /// A post, locate or stop effect is outstanding: start no second one.
    effect_running: bool,
    resubmitted: bool,
    /// Posted again after the server lost it, not yet accepted: the resubmission is spent
    /// (`resubmitted`) only when the server accepts the post.
    reposting: bool,
    completion_attempts: u32,
    /// A completion that could not be recorded yet (the store was down): retried on ticks.
    unrecorded: Option<Completion>,
    last_progress: Option<Instant>,
    /// Claim order of a staged task: staged tasks are posted in the order they were claimed.
    claim_seq: u64,
    /// Posted into the server's own queue behind the prompts it runs: it starts when they end,
    /// without us (its `TaskStarted` waits for its `execution_start`).
    posted_ahead: bool,
    /// `TaskStarted` is recorded or being recorded (once per task).
    start_recorded: bool,
    /// `TaskStarted` being recorded: the end is recorded after it, so the log keeps the order.
    starting: Option<tokio::task::JoinHandle<()>>,
}

impl InFlight {
    fn new(
        owner: UserId,
        backend: usize,
        prompt_id: Uuid,
        workflow: Value,
        phase: Phase,
        time_left: Duration,
    ) -> InFlight {
        InFlight {
            owner,
            backend,
            prompt_id,
            workflow,
            phase,
            deadline: Instant::now() + time_left,
            stop: None,
            stop_attempts: 0,
            effect_running: false,
            resubmitted: false,
            reposting: false,
            completion_attempts: 0,
            unrecorded: None,
            last_progress: None,
            claim_seq: 0,
            posted_ahead: false,
            start_recorded: false,
            starting: None,
        }
    }
}

#[derive(Debug, Default)]
struct BackendState {
    /// The open socket's clientId; `None` while disconnected (then nothing new is posted there).
    client_id: Option<String>,
    /// When a slot last freed with nothing posted since (the start of a GPU idle gap).
    freed_at: Option<Instant>,
    /// A slot of it is being freed right now: a post now is a staged task that was ready.
    freeing: bool,
    /// Tasks whose staged dispatch is being recorded in the background, with their claim order.
    staging: HashMap<TaskId, u64>,
}

/// A running saga (the leader's). Dropping it closes its sockets and stops its subscription.
pub struct Saga {
    dispatcher: Dispatcher,
    term: Term,
    inputs: mpsc::UnboundedReceiver<Input>,
    inputs_sender: mpsc::UnboundedSender<Input>,
    sockets: mpsc::UnboundedReceiver<(usize, SocketEvent)>,
    tick: tokio::time::Interval,
    backends: Vec<BackendState>,
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
    }
}

fn is_lost(error: &anyhow::Error) -> bool {
    error.is::<LostLeadership>()
}

impl Saga {
    async fn start(dispatcher: Dispatcher, term: Term) -> anyhow::Result<Saga> {
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
        for (index, backend) in dispatcher.backends.iter().enumerate() {
            let client = backend.client.clone();
            let sender = socket_sender.clone();
            background.push(
                dispatcher
                    .lane
                    .handle
                    .spawn(socket::run(index, client, timings, sender))
                    .abort_handle(),
            );
        }
        // Task events from now on: queued tasks wake the saga at once, cancel requests reach it.
        let head = dispatcher
            .store
            .head()
            .await
            .context("reading the log head")?;
        let mut subscription = dispatcher.store.subscribe_all(
            head,
            EventFilter::EventTypes(vec!["TaskQueued".into(), "TaskCancelRequested".into()]),
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
        Ok(Saga {
            backends: dispatcher
                .backends
                .iter()
                .map(|_| BackendState::default())
                .collect(),
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
        })
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
                tracing::warn!(error = %crate::telemetry::error_chain(&error), "dispatch step failed");
            }
        }
    }

    /// Give the lease up now (a clean stop), so another process takes over at once.
    pub async fn resign(self) {
        if let Err(error) = self.dispatcher.leases.resign(&self.term).await {
            tracing::warn!(error = %crate::telemetry::error_chain(&error), "could not resign the leader lease");
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

    fn metadata(&self, task_id: TaskId) -> EventMetadata {
        dispatcher_metadata(self.term.fencing_token, task_id)
    }

    async fn handle(&mut self, input: Input) -> anyhow::Result<()> {
        match input {
            Input::Socket(backend, SocketEvent::Opened { client_id }) => {
                tracing::info!(backend = %self.dispatcher.backends[backend].settings.name, "server socket open");
                self.backends[backend].client_id = Some(client_id);
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
                tracing::warn!(backend = %self.dispatcher.backends[backend].settings.name, %reason, "server socket closed");
                self.backends[backend].client_id = None;
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
                        tracing::warn!(%task_id, attempt = flight.completion_attempts, error = %crate::telemetry::error_chain(&error), "fetching results failed");
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
            Input::SubscriptionEnded(reason) => {
                // Without it, cancels and new tasks still arrive through the ticks; start over to
                // get the prompt wake-ups back.
                tracing::warn!(%reason, "task event subscription ended; the saga restarts");
                Err(LostLeadership.into())
            }
        }
    }

    async fn on_tick(&mut self) -> anyhow::Result<()> {
        let settings = self.dispatcher.settings.clone();
        let now = Instant::now();
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

    /// The slot leases this saga holds, per server: every task in flight that has not ended.
    fn held_slots(&self) -> Vec<Vec<TaskId>> {
        (0..self.backends.len())
            .map(|index| {
                self.in_flight
                    .iter()
                    .filter(|(_, f)| f.backend == index && f.phase != Phase::Finishing)
                    .map(|(task_id, _)| *task_id)
                    .collect()
            })
            .collect()
    }

    /// Prompts posted (or being posted) to `backend`: its occupied slots.
    fn busy(&self, backend: usize) -> usize {
        self.in_flight
            .values()
            .filter(|f| f.backend == backend && matches!(f.phase, Phase::Posting | Phase::Accepted))
            .count()
    }

    /// `backend`'s staged task claimed first (it was first in the queue), unless a task claimed
    /// before it is still being recorded: dispatch records finish in any order, and a later
    /// claim must not overtake an earlier one (the earlier one's `Prepared` fills the slot).
    fn staged_on(&self, backend: usize) -> Option<TaskId> {
        let (task_id, first) = self
            .in_flight
            .iter()
            .filter(|(_, f)| f.backend == backend && f.phase == Phase::Staged)
            .min_by_key(|(_, f)| f.claim_seq)?;
        let earlier_being_recorded = self.backends[backend]
            .staging
            .values()
            .any(|&claim_seq| claim_seq < first.claim_seq);
        (!earlier_being_recorded).then_some(*task_id)
    }

    /// Tasks staged on `backend` or being staged there.
    fn staged_count(&self, backend: usize) -> usize {
        self.in_flight
            .values()
            .filter(|f| f.backend == backend && f.phase == Phase::Staged)
            .count()
            + self.backends[backend].staging.len()
    }

    /// Post staged tasks into every free slot now, then have the filler claim what more can be
    /// claimed. Never waits: the claims are the filler's round trips, not the saga's.
    fn fill_all(&mut self) {
        for backend in 0..self.backends.len() {
            while self.promote_staged(backend) {}
        }
        self.fill_wanted = true;
        self.spawn_filler();
    }

    /// Start the filler unless one is out (it runs again when that one is done).
    fn spawn_filler(&mut self) {
        if self.filling || !(self.fill_wanted || self.slot_renew_wanted) {
            return;
        }
        let renew_slots = std::mem::take(&mut self.slot_renew_wanted).then(|| self.held_slots());
        let claim = std::mem::take(&mut self.fill_wanted);
        let servers = (0..self.backends.len())
            .map(|backend| {
                (claim && self.backends[backend].client_id.is_some()).then(|| ServerSlots {
                    capacity: self.dispatcher.backends[backend].settings.capacity,
                    busy: self.busy(backend),
                    staged: self.staged_count(backend),
                })
            })
            .collect();
        let filler = Filler {
            tasks: self.dispatcher.tasks.clone(),
            leases: self.dispatcher.leases.clone(),
            clock: self.dispatcher.clock.clone(),
            work: self.dispatcher.work.clone(),
            term: self.term.clone(),
            names: self.dispatcher.backend_names(),
            slot_lease_ms: self.dispatcher.settings.slot_lease_ms,
            depth: self.dispatcher.settings.staged_per_backend,
            releases: std::mem::take(&mut self.releases),
            renew_slots,
            servers,
        };
        self.filling = true;
        let sender = self.inputs_sender.clone();
        self.dispatcher.work.spawn(filler.run(sender));
    }

    fn on_filled(&mut self, outcome: FillOutcome) -> anyhow::Result<()> {
        self.filling = false;
        let FillOutcome {
            mut unreleased,
            renew_failed,
            queue_empty,
            result,
        } = outcome;
        if !unreleased.is_empty() {
            // Released first next time, before anything else is claimed.
            unreleased.append(&mut self.releases);
            self.releases = unreleased;
        }
        if renew_failed {
            self.slot_renew_wanted = true;
        }
        if queue_empty {
            // Nothing waited: a slot that stays free is not a dispatch gap.
            for backend in 0..self.backends.len() {
                let capacity = self.dispatcher.backends[backend].settings.capacity as usize;
                if self.busy(backend) + self.staged_count(backend) < capacity {
                    self.backends[backend].freed_at = None;
                }
            }
        }
        result?;
        self.spawn_filler();
        Ok(())
    }

    /// Post `backend`'s staged task if it has a socket and room: a free slot, or a place in
    /// its own queue (`posted_ahead_per_backend`); whether it did.
    fn promote_staged(&mut self, backend: usize) -> bool {
        let capacity = self.dispatcher.backends[backend].settings.capacity as usize;
        let posted_max = capacity + self.dispatcher.settings.posted_ahead_per_backend as usize;
        if self.backends[backend].client_id.is_none()
            || self.busy(backend) >= posted_max
            || self.post_unanswered(backend)
        {
            return false;
        }
        let Some(task_id) = self.staged_on(backend) else {
            return false;
        };
        // Behind prompts the server runs, it may wait for each of them to end (or time out).
        let waits_behind = self.waits_behind(backend, task_id);
        let timeout = Duration::from_millis(self.dispatcher.settings.task_timeout_ms);
        if let Some(flight) = self.in_flight.get_mut(&task_id) {
            flight.phase = Phase::Posting;
            flight.deadline = Instant::now() + timeout * (1 + waits_behind);
        }
        self.post(task_id);
        true
    }

    /// A post to `backend` is not answered yet: the next waits for it. Two posts in flight to
    /// one server can arrive in either order, and the server runs its queue in arrival order.
    fn post_unanswered(&self, backend: usize) -> bool {
        self.in_flight
            .values()
            .any(|f| f.backend == backend && f.phase == Phase::Posting)
    }

    /// How many prompts a prompt posted to `backend` now would wait behind in its queue: 0 when
    /// a slot is free.
    fn waits_behind(&self, backend: usize, task_id: TaskId) -> u32 {
        let capacity = self.dispatcher.backends[backend].settings.capacity as usize;
        let others = self
            .in_flight
            .iter()
            .filter(|(other, f)| {
                **other != task_id
                    && f.backend == backend
                    && matches!(f.phase, Phase::Posting | Phase::Accepted)
            })
            .count();
        u32::try_from((others + 1).saturating_sub(capacity)).unwrap_or(u32::MAX)
    }

    /// Follow a task recorded as dispatched to `backend`: staged until a slot of it is free.
    fn admit(&mut self, backend: usize, task_id: TaskId, prepared: Option<Prepared>) {
        let Some(Prepared {
            owner,
            workflow,
            prompt_id,
        }) = prepared
        else {
            return;
        };
        if self.in_flight.contains_key(&task_id) {
            // Adopted meanwhile by the orphan scan: that entry stands.
            return;
        }
        let timeout = Duration::from_millis(self.dispatcher.settings.task_timeout_ms);
        let mut flight = InFlight::new(owner, backend, prompt_id, workflow, Phase::Staged, timeout);
        // A cancel that arrived while the dispatch was being recorded.
        if self.early_cancels.remove(&task_id) {
            flight.stop = Some(Stop::Cancel);
        }
        self.in_flight.insert(task_id, flight);
        self.by_prompt.insert(prompt_id, task_id);
        let notifier = self.dispatcher.notifier.clone();
        self.dispatcher.work.spawn(async move {
            notifier.tell(owner, task_id, TaskNotice::Dispatched).await;
            notifier.queue_moved().await;
        });
    }

    /// Spawn the post of a task's prompt to its server.
    fn post(&mut self, task_id: TaskId) {
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        let backend = flight.backend;
        let Some(client_id) = self.backends[backend].client_id.clone() else {
            // Posted when the socket opens (its reconcile finds the prompt unknown).
            return;
        };
        let posted_ahead = self.waits_behind(backend, task_id) > 0;
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        flight.posted_ahead = posted_ahead;
        flight.effect_running = true;
        let client = self.dispatcher.backends[backend].client.clone();
        let freed_at = self.backends[backend].freed_at.take();
        let staged_ready = self.backends[backend].freeing;
        let prompt_id = flight.prompt_id;
        let workflow = flight.workflow.clone();
        let sender = self.inputs_sender.clone();
        self.dispatcher.lane.handle.spawn(async move {
            let outcome = client.post_prompt(prompt_id, &client_id, &workflow).await;
            let gap = freed_at.map(|freed| GapSample {
                duration: freed.elapsed(),
                staged_ready,
            });
            drop(sender.send(Input::Posted {
                task_id,
                prompt_id,
                outcome,
                gap,
            }));
        });
    }

    /// Find out where a prompt is (or, for a task being stopped, stop it and then find out).
    fn check_on(&mut self, task_id: TaskId) {
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        // A staged task is not on any server yet: nothing to look up.
        if flight.effect_running || flight.phase == Phase::Staged {
            return;
        }
        let client = self.dispatcher.backends[flight.backend].client.clone();
        let prompt_id = flight.prompt_id;
        let sender = self.inputs_sender.clone();
        flight.effect_running = true;
        if flight.phase == Phase::Finishing {
            // Results not fetched yet (an earlier attempt failed): fetch again.
            self.complete(task_id, None);
            return;
        }
        let stopping = flight.stop.is_some();
        if stopping {
            flight.stop_attempts += 1;
        }
        self.dispatcher.work.spawn(async move {
            let result = async {
                if stopping {
                    // Pending: out of the queue. Running: interrupted, and only then: a targeted
                    // interrupt that races the prompt's end hits the next prompt (PROTOCOL.md
                    // 1.4), and the next prompt is often ours, posted ahead.
                    client.delete_pending(prompt_id).await?;
                    let whereabouts = client.whereabouts(prompt_id).await?;
                    if matches!(whereabouts, PromptWhereabouts::Running) {
                        client.interrupt(prompt_id).await?;
                    }
                    return Ok(whereabouts);
                }
                client.whereabouts(prompt_id).await
            }
            .await;
            drop(sender.send(Input::Located {
                task_id,
                prompt_id,
                result,
            }));
        });
    }

    fn on_posted(
        &mut self,
        task_id: TaskId,
        prompt_id: Uuid,
        outcome: PostOutcome,
        gap: Option<GapSample>,
    ) -> anyhow::Result<()> {
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return Ok(());
        };
        if flight.prompt_id != prompt_id || flight.phase == Phase::Finishing {
            return Ok(());
        }
        flight.effect_running = false;
        match outcome {
            PostOutcome::Accepted => {
                if flight.reposting {
                    flight.reposting = false;
                    flight.resubmitted = true;
                }
                if let Some(gap) = gap
                    && self.gaps.len() < GAP_SAMPLES_MAX
                {
                    self.gaps.push(gap);
                }
                self.accepted(task_id);
                if self
                    .in_flight
                    .get(&task_id)
                    .is_some_and(|f| f.stop.is_some())
                {
                    self.check_on(task_id);
                }
                Ok(())
            }
            PostOutcome::Rejected(reason) => {
                self.free_slot(task_id);
                self.record(task_id, Completion::Failed(reason))
            }
            PostOutcome::Unreachable(error) => {
                // Maybe queued there, maybe not: the next reconcile finds out before posting again.
                tracing::warn!(%task_id, error = %crate::telemetry::error_chain(&error), "posting failed");
                Ok(())
            }
        }
    }

    /// The server has the prompt. In a free slot it runs at once: recorded as started. Posted
    /// ahead, it waits in the server's queue until its `execution_start` ([`Saga::running`]).
    fn accepted(&mut self, task_id: TaskId) {
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        if flight.phase != Phase::Posting {
            return;
        }
        flight.phase = Phase::Accepted;
        let backend = flight.backend;
        if !flight.posted_ahead {
            self.record_start(task_id);
        }
        // The next staged task may follow it now.
        self.promote_staged(backend);
    }

    /// The prompt runs on its server now (its `execution_start`, or `/queue` says so).
    fn running(&mut self, task_id: TaskId) {
        self.accepted(task_id);
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        if flight.phase == Phase::Accepted && flight.posted_ahead {
            flight.posted_ahead = false;
            self.record_start(task_id);
        }
    }

    /// Record the task as started (once), off the saga's path (a slot that frees meanwhile must
    /// not wait for this append).
    fn record_start(&mut self, task_id: TaskId) {
        let metadata = self.metadata(task_id);
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        if flight.start_recorded {
            return;
        }
        flight.start_recorded = true;
        let command = TaskCommand::Start {
            fencing_token: self.term.fencing_token,
            at: self.dispatcher.clock.now(),
        };
        let tasks = self.dispatcher.tasks.clone();
        let sender = self.inputs_sender.clone();
        flight.starting = Some(self.dispatcher.work.spawn(async move {
            let result = match tasks.execute_task(task_id, &command, &metadata).await {
                // Already ended (recorded by an earlier leader): nothing to start.
                Ok(_) | Err(CommandError::Rejected(TaskError::InvalidTransition { .. })) => Ok(()),
                Err(CommandError::Rejected(TaskError::StaleDispatcher { .. })) => {
                    Err(LostLeadership.into())
                }
                Err(other) => Err(anyhow::Error::new(other).context("recording a start")),
            };
            drop(sender.send(Input::Started(result)));
        }));
    }

    fn on_located(
        &mut self,
        task_id: TaskId,
        prompt_id: Uuid,
        result: anyhow::Result<PromptWhereabouts>,
    ) -> anyhow::Result<()> {
        let settings = self.dispatcher.settings.clone();
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return Ok(());
        };
        if flight.prompt_id != prompt_id || flight.phase == Phase::Finishing {
            // Late: the task ended meanwhile and its completion owns it now.
            return Ok(());
        }
        flight.effect_running = false;
        let whereabouts = match result {
            Ok(whereabouts) => whereabouts,
            Err(error) => {
                tracing::debug!(%task_id, error = %crate::telemetry::error_chain(&error), "server unreachable");
                if flight.stop.is_some() && flight.stop_attempts >= settings.cancel_attempts_max {
                    // The server stays unreachable: record the stop without its confirmation.
                    self.free_slot(task_id);
                    return self.record(task_id, Completion::Interrupted);
                }
                return Ok(());
            }
        };
        match whereabouts {
            PromptWhereabouts::Running | PromptWhereabouts::Pending => {
                if matches!(whereabouts, PromptWhereabouts::Running) {
                    self.running(task_id);
                } else {
                    // In the server's queue behind other prompts (adopted, or posted ahead):
                    // started when it runs.
                    if let Some(flight) = self.in_flight.get_mut(&task_id)
                        && flight.phase == Phase::Posting
                    {
                        flight.posted_ahead = true;
                    }
                    self.accepted(task_id);
                }
                let exhausted = self.in_flight.get(&task_id).is_some_and(|f| {
                    f.stop.is_some() && f.stop_attempts >= settings.cancel_attempts_max
                });
                if exhausted {
                    // An interrupt that never lands (a node that reports no progress): give up
                    // on the confirmation; a late result is ignored.
                    self.free_slot(task_id);
                    return self.record(task_id, Completion::Interrupted);
                }
                Ok(())
            }
            PromptWhereabouts::Finished(outcome) => self.finishing(task_id, Some(outcome)),
            PromptWhereabouts::Unknown => {
                let (phase, stopping, resubmitted) =
                    (flight.phase, flight.stop.is_some(), flight.resubmitted);
                if stopping {
                    // Deleted by our stop before it ran (or lost): nothing will ever come.
                    self.free_slot(task_id);
                    return self.record(task_id, Completion::Vanished);
                }
                match phase {
                    // Never accepted: post it now.
                    Phase::Staged | Phase::Posting => {
                        self.post(task_id);
                        Ok(())
                    }
                    Phase::Accepted if !resubmitted => {
                        // Back to posting. A server back from a restart answers HTTP before its
                        // socket: no post can be made until the socket opens (then its reconcile
                        // finds the prompt unknown again and posts it), so only a post the
                        // server accepts spends the one resubmission (`on_posted`).
                        tracing::warn!(%task_id, %prompt_id, "the server lost the prompt; posting it once more");
                        if let Some(flight) = self.in_flight.get_mut(&task_id) {
                            flight.phase = Phase::Posting;
                            flight.reposting = true;
                        }
                        self.post(task_id);
                        Ok(())
                    }
                    Phase::Accepted | Phase::Finishing => {
                        self.free_slot(task_id);
                        self.record(task_id, Completion::Vanished)
                    }
                }
            }
        }
    }

    fn on_message(&mut self, backend: usize, message: ComfyMessage) -> anyhow::Result<()> {
        let Some(prompt_id) = message.prompt_id() else {
            return Ok(());
        };
        let Some(&task_id) = self.by_prompt.get(&prompt_id) else {
            return Ok(());
        };
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return Ok(());
        };
        if flight.backend != backend {
            return Ok(());
        }
        match message {
            ComfyMessage::ExecutionStart { .. } => {
                // A prompt posted ahead waited in the server's queue: its time limit counts
                // from now.
                if flight.posted_ahead {
                    flight.deadline = Instant::now()
                        + Duration::from_millis(self.dispatcher.settings.task_timeout_ms);
                }
                self.running(task_id);
                Ok(())
            }
            ComfyMessage::Progress { value, max, .. } => {
                let interval =
                    Duration::from_millis(self.dispatcher.settings.progress_notify_interval_ms);
                let due = flight
                    .last_progress
                    .is_none_or(|last| last.elapsed() >= interval)
                    || value >= max;
                if !due {
                    return Ok(());
                }
                flight.last_progress = Some(Instant::now());
                let owner = flight.owner;
                let ttl_ms = self.dispatcher.settings.task_timeout_ms;
                let queue = self.dispatcher.tasks.queue.clone();
                let notifier = self.dispatcher.notifier.clone();
                // Progress is a hint: written and told off the saga's path.
                self.dispatcher.work.spawn(async move {
                    // ComfyUI may send floats; users get whole steps.
                    let (whole, whole_max) =
                        (value.max(0.0).round() as u64, max.max(0.0).round() as u64);
                    if let Err(error) = queue.set_progress(task_id, whole, whole_max, ttl_ms).await
                    {
                        tracing::debug!(%task_id, error = %crate::telemetry::error_chain(&error), "progress not recorded");
                    }
                    notifier
                        .tell(owner, task_id, TaskNotice::Progress { value, max })
                        .await;
                });
                Ok(())
            }
            // The first terminal message: the GPU is free now.
            ComfyMessage::ExecutionSuccess { .. } => self.finishing(task_id, None),
            ComfyMessage::ExecutionError {
                node_type,
                exception_message,
                ..
            } => {
                let outcome = HistoryOutcome::Error {
                    node_type,
                    message: exception_message,
                };
                self.finishing(task_id, Some(outcome))
            }
            ComfyMessage::ExecutionInterrupted { .. } => {
                self.finishing(task_id, Some(HistoryOutcome::Interrupted))
            }
            // The end of a prompt whose terminal message we missed.
            ComfyMessage::Executing { node: None, .. } => self.finishing(task_id, None),
            ComfyMessage::Executing { .. } | ComfyMessage::Status { .. } | ComfyMessage::Other => {
                Ok(())
            }
        }
    }

    /// Free the task's slot (once) and fill it at once.
    fn free_slot(&mut self, task_id: TaskId) {
        let Some(flight) = self.in_flight.get_mut(&task_id) else {
            return;
        };
        if flight.phase == Phase::Finishing {
            return;
        }
        flight.phase = Phase::Finishing;
        let backend = flight.backend;
        // With a prompt posted ahead behind it, the server went on by itself: no idle GPU.
        let capacity = self.dispatcher.backends[backend].settings.capacity as usize;
        if self.busy(backend) < capacity {
            self.backends[backend].freed_at = Some(Instant::now());
        }
        // The staged task goes out first: its post needs nothing from Redis or the store.
        self.backends[backend].freeing = true;
        self.promote_staged(backend);
        self.backends[backend].freeing = false;
        self.releases.push((backend, task_id));
        self.fill_all();
    }

    /// A prompt ended on its server: free the slot, then fetch and record its results.
    fn finishing(&mut self, task_id: TaskId, known: Option<HistoryOutcome>) -> anyhow::Result<()> {
        let Some(flight) = self.in_flight.get(&task_id) else {
            return Ok(());
        };
        if flight.phase == Phase::Finishing {
            return Ok(());
        }
        // It ran: a prompt posted ahead whose end is known before its `execution_start` was
        // read (`/history` can answer before the socket's messages are handled) is recorded as
        // started first; the end waits for that append.
        self.record_start(task_id);
        self.free_slot(task_id);
        if let Some(flight) = self.in_flight.get_mut(&task_id) {
            flight.effect_running = true;
        }
        self.complete(task_id, known);
        Ok(())
    }

    /// Spawn the completion: the history entry (unless known), then the images into the store.
    fn complete(&mut self, task_id: TaskId, known: Option<HistoryOutcome>) {
        let Some(flight) = self.in_flight.get(&task_id) else {
            return;
        };
        let client = self.dispatcher.backends[flight.backend].client.clone();
        let images = self.dispatcher.images.clone();
        let labeller = self.dispatcher.labeller.clone();
        let owner = flight.owner;
        let prompt_id = flight.prompt_id;
        let expected = crate::dispatch::comfy::expected_images(&flight.workflow);
        let settings = self.dispatcher.settings.clone();
        let sender = self.inputs_sender.clone();
        self.dispatcher.work.spawn(async move {
            let result = async {
                let outcome = match known {
                    // An error or interrupt says all there is; a success needs the outputs.
                    Some(
                        outcome @ (HistoryOutcome::Error { .. } | HistoryOutcome::Interrupted),
                    ) => outcome,
                    Some(HistoryOutcome::Success { .. }) | None => {
                        let mut found = None;
                        for _attempt in 0..settings.history_attempts_max {
                            if let Some(outcome) = client.history(prompt_id).await? {
                                found = Some(outcome);
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(settings.history_retry_ms))
                                .await;
                        }
                        match found {
                            Some(outcome) => outcome,
                            None => return Ok(Completion::Vanished),
                        }
                    }
                };
                Ok(match outcome {
                    HistoryOutcome::Success { images: outputs } => {
                        if outputs.is_empty() {
                            return Ok(Completion::Failed(
                                "the image server finished without producing an image".into(),
                            ));
                        }
                        // A server is not trusted: more images than asked for, or files
                        // outside the task's own, fail the task (nothing is downloaded).
                        if let Err(reason) =
                            crate::dispatch::comfy::check_outputs(task_id, &outputs, expected)
                        {
                            return Ok(Completion::Failed(reason));
                        }
                        let mut stored = Vec::with_capacity(outputs.len());
                        for (index, output) in outputs.iter().enumerate() {
                            let (bytes, _) = client
                                .view(output, crate::dispatch::comfy::IMAGE_BYTES_MAX)
                                .await?;
                            let id = image_id(task_id, index);
                            // Both labels before the store: no unlabelled image ever has a URL.
                            let image = match labeller.label(bytes, task_id, index, id).await {
                                Ok(image) => image,
                                // The same bytes would come back: fail now, points released.
                                Err(error @ LabelError::Unreadable(_)) => {
                                    tracing::warn!(%task_id, %error, "an output could not be labelled");
                                    return Ok(Completion::Failed(
                                        "the image server returned an image that cannot be read"
                                            .into(),
                                    ));
                                }
                                Err(LabelError::Internal(error)) => return Err(error),
                            };
                            images.put(id, owner, task_id, &image).await?;
                            stored.push(TaskImage {
                                image_id: id.to_string(),
                                content_type: image.content_type().to_owned(),
                            });
                        }
                        Completion::Succeeded(stored)
                    }
                    HistoryOutcome::Error { node_type, message } => {
                        Completion::Failed(failure_reason(&node_type, &message))
                    }
                    HistoryOutcome::Interrupted => Completion::Interrupted,
                })
            }
            .await;
            drop(sender.send(Input::Completed {
                task_id,
                prompt_id,
                result,
            }));
        });
    }

    /// Record how the task ended, settle or release its hold, tell its owner, forget it.
    fn record(&mut self, task_id: TaskId, completion: Completion) -> anyhow::Result<()> {
        let Some(flight) = self.in_flight.get(&task_id) else {
            return Ok(());
        };
        let token = self.term.fencing_token;
        let at = self.dispatcher.clock.now();
        let timeout_s = self.dispatcher.settings.task_timeout_ms / 1000;
        let (command, notice) = match (&completion, flight.stop) {
            (Completion::Succeeded(images), _) => (
                TaskCommand::Succeed {
                    images: images.clone(),
                    fencing_token: token,
                    at,
                },
                TaskNotice::Succeeded {
                    images: images
                        .iter()
                        .filter_map(|image| Uuid::parse_str(&image.image_id).ok())
                        .collect(),
                },
            ),
            (Completion::Failed(reason), _) => failed(reason.clone(), token, at),
            (Completion::Interrupted | Completion::Vanished, Some(Stop::Cancel)) => (
                TaskCommand::Cancel {
                    by: Canceller::Dispatcher {
                        fencing_token: token,
                    },
                    at,
                },
                TaskNotice::Cancelled,
            ),
            (Completion::Interrupted | Completion::Vanished, Some(Stop::Timeout)) => failed(
                format!("the task ran longer than the limit of {timeout_s} s and was stopped"),
                token,
                at,
            ),
            (Completion::Interrupted, None) => {
                failed("the image server interrupted the task".into(), token, at)
            }
            (Completion::Vanished, None) => failed(
                "the image server lost the task (it restarted or dropped it)".into(),
                token,
                at,
            ),
        };
        let owner = flight.owner;
        // Recorded off the saga's path: the next dispatch must not wait for this one's writes.
        let starting = self.in_flight.get_mut(&task_id).and_then(|flight| {
            flight.effect_running = true;
            flight.starting.take()
        });
        let tasks = self.dispatcher.tasks.clone();
        let metadata = self.metadata(task_id);
        let notifier = self.dispatcher.notifier.clone();
        let sender = self.inputs_sender.clone();
        self.dispatcher.work.spawn(async move {
            let result = async {
                if let Some(starting) = starting {
                    // Its outcome reaches the saga on its own; only the order matters here.
                    drop(starting.await);
                }
                // Begun before the end is recorded: if this process dies between the end and the
                // settlement, the intent sweeper settles the hold (before the end, the task is
                // in flight, and the next leader adopts it).
                let intent = tasks
                    .begin_intent(IntentKind::Dispatch, task_id, owner, None)
                    .await?;
                let recorded = match tasks.execute_task(task_id, &command, &metadata).await {
                    // A repeat records nothing new and tells nobody twice.
                    Ok(executed) => !executed.new_events.is_empty(),
                    Err(CommandError::Rejected(TaskError::StaleDispatcher { .. })) => {
                        return Err(LostLeadership.into());
                    }
                    // Already ended otherwise (a repeat after a crash): settle by what is recorded.
                    Err(CommandError::Rejected(_)) => false,
                    Err(other) => {
                        return Err(anyhow::Error::new(other).context("recording a task's end"));
                    }
                };
                tasks
                    .reconcile(task_id, owner, None, metadata.correlation_id)
                    .await
                    .context("settling a task's hold")?;
                tasks.end_intent(intent).await?;
                drop(tasks.queue.clear_progress(task_id).await);
                if recorded {
                    notifier.tell(owner, task_id, notice).await;
                }
                anyhow::Ok(())
            }
            .await;
            drop(sender.send(Input::Recorded {
                task_id,
                completion,
                result,
            }));
        });
        Ok(())
    }

    /// Adopt tasks in flight that no saga of ours follows: another leader's, or ours from before
    /// a restart. The read model lists them; the task stream decides.
    async fn adopt_orphans(&mut self) -> anyhow::Result<()> {
        let rows = {
            let client = self
                .dispatcher
                .pool
                .get()
                .await
                .context("getting a connection")?;
            client
                .query(
                    "SELECT task_id FROM tasks WHERE status IN ('dispatched', 'running')
                      ORDER BY updated_at LIMIT $1",
                    &[&ADOPT_PER_SCAN_MAX],
                )
                .await
                .context("reading tasks in flight")?
        };
        for row in rows {
            let task_id: TaskId = row.get(0);
            if self.in_flight.contains_key(&task_id)
                || self
                    .backends
                    .iter()
                    .any(|b| b.staging.contains_key(&task_id))
            {
                continue;
            }
            self.adopt(task_id).await?;
        }
        Ok(())
    }

    /// At takeover, before this saga claims anything: each slot lease left behind belongs to a
    /// task in flight (adopted here when the read model did not list it yet) or to a claim the
    /// previous leader never recorded (its task is queued again by the rebuild). Such a lease is
    /// released now: until it ran out, its slot would stay taken with nothing running there.
    async fn adopt_leased(&mut self) -> anyhow::Result<()> {
        for name in self.dispatcher.backend_names() {
            for task_id in self.dispatcher.leases.busy_slots(&name).await? {
                if !self.in_flight.contains_key(&task_id) {
                    self.adopt(task_id).await?;
                }
                if !self.in_flight.contains_key(&task_id) {
                    tracing::info!(%task_id, backend = %name, "released a slot lease of a claim never recorded");
                    self.dispatcher.leases.release_slot(&name, task_id).await?;
                }
            }
        }
        Ok(())
    }

    async fn adopt(&mut self, task_id: TaskId) -> anyhow::Result<()> {
        let tasks = self.dispatcher.tasks.clone();
        let (loaded, workflow) = tasks.load_with_workflow(task_id).await?;
        let state = loaded.state;
        let (Some(owner), Some(workflow), Some(prompt_id), Some(backend_name)) = (
            state.owner,
            workflow,
            state.prompt_id,
            state.backend.clone(),
        ) else {
            return Ok(());
        };
        if !matches!(state.status, TaskStatus::Dispatched | TaskStatus::Running) {
            return Ok(());
        }
        let metadata = self.metadata(task_id);
        let token = self.term.fencing_token;
        let at = self.dispatcher.clock.now();
        let Some(backend) = self
            .dispatcher
            .backends
            .iter()
            .position(|b| b.settings.name == backend_name)
        else {
            // Its server left the configuration: nobody can finish it.
            let intent = tasks
                .begin_intent(IntentKind::Dispatch, task_id, owner, None)
                .await?;
            let command = TaskCommand::Fail {
                reason: "its image server was removed from service".into(),
                fencing_token: token,
                at,
            };
            match tasks.execute_task(task_id, &command, &metadata).await {
                Ok(_) | Err(CommandError::Rejected(TaskError::InvalidTransition { .. })) => {}
                Err(CommandError::Rejected(TaskError::StaleDispatcher { .. })) => {
                    return Err(LostLeadership.into());
                }
                Err(other) => return Err(anyhow::Error::new(other).context("failing a task")),
            }
            tasks.reconcile(task_id, owner, None, task_id).await?;
            tasks.end_intent(intent).await?;
            return Ok(());
        };
        let adopt = TaskCommand::Adopt {
            fencing_token: token,
            at,
        };
        match tasks.execute_task(task_id, &adopt, &metadata).await {
            Ok(_) => {}
            Err(CommandError::Rejected(TaskError::StaleDispatcher { .. })) => {
                return Err(LostLeadership.into());
            }
            // Ended meanwhile.
            Err(CommandError::Rejected(_)) => return Ok(()),
            Err(other) => return Err(anyhow::Error::new(other).context("adopting a task")),
        }
        let left = adopted_time_left(
            &state,
            Duration::from_millis(self.dispatcher.settings.task_timeout_ms),
            self.dispatcher.settings.posted_ahead_per_backend,
            at,
        );
        tracing::info!(%task_id, %prompt_id, backend = %backend_name, "adopted a task in flight");
        let phase = if state.status == TaskStatus::Running {
            Phase::Accepted
        } else {
            Phase::Posting
        };
        let mut flight = InFlight::new(owner, backend, prompt_id, workflow, phase, left);
        flight.start_recorded = state.status == TaskStatus::Running;
        flight.stop = state.cancel_requested.then_some(Stop::Cancel);
        self.in_flight.insert(task_id, flight);
        self.by_prompt.insert(prompt_id, task_id);
        if !self
            .dispatcher
            .leases
            .renew_slots(
                &self.term,
                &backend_name,
                &[task_id],
                self.dispatcher.settings.slot_lease_ms,
            )
            .await?
        {
            return Err(LostLeadership.into());
        }
        if self.backends[backend].client_id.is_some() {
            self.check_on(task_id);
        }
        Ok(())
    }
}

/// The time an adopted task has left. Running: its limit counts from its start. Not started: it
/// may wait in its server's queue behind the prompts posted before it (at most
/// `posted_ahead_per_backend`), each up to its own limit; its `execution_start` restarts the count.
fn adopted_time_left(
    state: &zhihui_domain::task::TaskState,
    timeout: Duration,
    posted_ahead_per_backend: u32,
    now: chrono::DateTime<chrono::Utc>,
) -> Duration {
    let limit = |waits: u32| {
        chrono::Duration::from_std(timeout.saturating_mul(waits)).unwrap_or(chrono::Duration::MAX)
    };
    let ends_at = match (state.started_at, state.dispatched_at) {
        (Some(started), _) => started.checked_add_signed(limit(1)),
        (None, Some(dispatched)) => {
            dispatched.checked_add_signed(limit(posted_ahead_per_backend.saturating_add(1)))
        }
        (None, None) => return timeout,
    };
    ends_at.map_or(timeout, |ends_at| {
        (ends_at - now).to_std().unwrap_or(Duration::ZERO)
    })
}

/// What a filler effect did not finish, and how it ended.
#[derive(Debug)]
struct FillOutcome {
    /// Releases not done (Redis failed): done first by the next filler.
    unreleased: Vec<(usize, TaskId)>,
    /// The slot renewal was due and did not happen: the next filler tries again.
    renew_failed: bool,
    /// The queue ran dry.
    queue_empty: bool,
    result: anyhow::Result<()>,
}

/// One pass of the saga's slot-lease work, off its path: release the leases of ended tasks,
/// renew the held ones when due, then claim queued tasks (free slots on every server first,
/// then one staged task per server per round, up to the staging depth) and start recording
/// each claimed task's dispatch at once. The saga runs one filler at a time.
struct Filler {
    tasks: TaskService,
    leases: Leases,
    clock: Clock,
    work: tokio::runtime::Handle,
    term: Term,
    names: Vec<String>,
    slot_lease_ms: u64,
    depth: u32,
    releases: Vec<(usize, TaskId)>,
    /// Per server, the tasks whose leases to renew (when due).
    renew_slots: Option<Vec<Vec<TaskId>>>,
    /// Per server; `None`: nothing is claimed for it (no socket, or only releasing/renewing).
    servers: Vec<Option<ServerSlots>>,
}

impl Filler {
    async fn run(mut self, sender: mpsc::UnboundedSender<Input>) {
        let outcome = self.work_through(&sender).await;
        drop(sender.send(Input::Filled(outcome)));
    }

    async fn work_through(&mut self, sender: &mpsc::UnboundedSender<Input>) -> FillOutcome {
        let releases = std::mem::take(&mut self.releases);
        if let Some(held) = self.renew_slots.take() {
            for (backend, tasks) in held.iter().enumerate() {
                let renewed = self
                    .leases
                    .renew_slots(&self.term, &self.names[backend], tasks, self.slot_lease_ms)
                    .await;
                let result = match renewed {
                    Ok(true) => continue,
                    Ok(false) => Err(LostLeadership.into()),
                    Err(error) => Err(error),
                };
                return FillOutcome {
                    unreleased: releases,
                    renew_failed: true,
                    queue_empty: false,
                    result,
                };
            }
        }
        let filled = self
            .leases
            .fill(
                &self.term,
                &self.names,
                &releases,
                &self.servers,
                self.depth,
                self.slot_lease_ms,
            )
            .await;
        let (claims, queue_empty) = match filled {
            Ok(Fill::Claimed {
                claims,
                queue_empty,
            }) => (claims, queue_empty),
            Ok(Fill::NotLeader) => {
                return FillOutcome {
                    unreleased: Vec::new(),
                    renew_failed: false,
                    queue_empty: false,
                    result: Err(LostLeadership.into()),
                };
            }
            Err(error) => {
                return FillOutcome {
                    unreleased: releases,
                    renew_failed: false,
                    queue_empty: false,
                    result: Err(error),
                };
            }
        };
        for Claimed {
            backend,
            task_id,
            score,
        } in claims
        {
            // Told first, so the saga knows of the task before its `Prepared` arrives. The
            // recording runs even if the saga is gone: the next leader adopts what it recorded.
            drop(sender.send(Input::Claimed { backend, task_id }));
            let preparation = Preparation {
                tasks: self.tasks.clone(),
                leases: self.leases.clone(),
                backend_name: self.names[backend].clone(),
                task_id,
                score,
                fencing_token: self.term.fencing_token,
                at: self.clock.now(),
                metadata: dispatcher_metadata(self.term.fencing_token, task_id),
            };
            let sender = sender.clone();
            self.work.spawn(async move {
                let result = preparation.run().await;
                drop(sender.send(Input::Prepared {
                    backend,
                    task_id,
                    result,
                }));
            });
        }
        FillOutcome {
            unreleased: Vec::new(),
            renew_failed: false,
            queue_empty,
            result: Ok(()),
        }
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

/// What a dispatch records before its post, with what it needs; runs off the saga.
struct Preparation {
    tasks: TaskService,
    leases: Leases,
    backend_name: String,
    task_id: TaskId,
    score: i64,
    fencing_token: u64,
    at: chrono::DateTime<chrono::Utc>,
    metadata: EventMetadata,
}

/// A task recorded as dispatched.
#[derive(Debug)]
struct Prepared {
    owner: UserId,
    workflow: Value,
    prompt_id: Uuid,
}

impl Preparation {
    /// `TaskDispatched` with a fresh prompt id, decided on one read of the task: two round
    /// trips. `None`: the queue entry was stale (the task was cancelled or dispatched
    /// meanwhile; its slot is freed). No intent row yet: until its end is recorded the task is
    /// in flight, and a leader that dies leaves it to the next one, which adopts it.
    async fn run(self) -> anyhow::Result<Option<Prepared>> {
        let Preparation {
            tasks,
            leases,
            backend_name,
            task_id,
            score,
            fencing_token,
            at,
            metadata,
        } = self;
        // A claimed task that could not be recorded goes back to the queue at its score.
        let give_back = || async {
            if let Err(error) = tasks.queue.enqueue(task_id, score).await {
                // The next leader's queue rebuild puts it back (the events say queued).
                tracing::warn!(%task_id, error = %crate::telemetry::error_chain(&error), "could not requeue a claimed task");
            }
            if let Err(error) = leases.release_slot(&backend_name, task_id).await {
                tracing::warn!(%task_id, error = %crate::telemetry::error_chain(&error), "could not free a slot");
            }
        };
        let (loaded, workflow) = match tasks.load_with_workflow(task_id).await {
            Ok(loaded) => loaded,
            Err(error) => {
                give_back().await;
                return Err(error);
            }
        };
        let (Some(owner), Some(workflow), TaskStatus::Queued) =
            (loaded.state.owner, workflow, loaded.state.status)
        else {
            leases.release_slot(&backend_name, task_id).await?;
            return Ok(None);
        };
        let prompt_id = Uuid::now_v7();
        let command = TaskCommand::Dispatch {
            backend: backend_name.clone(),
            prompt_id,
            fencing_token,
            at,
        };
        match tasks
            .execute_task_on(task_id, loaded, &command, &metadata)
            .await
        {
            Ok(_) => Ok(Some(Prepared {
                owner,
                workflow,
                prompt_id,
            })),
            Err(CommandError::Rejected(TaskError::StaleDispatcher { .. })) => {
                leases.release_slot(&backend_name, task_id).await?;
                Err(LostLeadership.into())
            }
            Err(CommandError::Rejected(_)) => {
                leases.release_slot(&backend_name, task_id).await?;
                Ok(None)
            }
            Err(other) => {
                give_back().await;
                Err(anyhow::Error::new(other).context("recording a dispatch"))
            }
        }
    }
}

fn failed(
    reason: String,
    fencing_token: u64,
    at: chrono::DateTime<chrono::Utc>,
) -> (TaskCommand, TaskNotice) {
    (
        TaskCommand::Fail {
            reason: reason.clone(),
            fencing_token,
            at,
        },
        TaskNotice::Failed { reason },
    )
}

/// A runtime error, said to a user: what failed, without tracebacks or server paths.
fn failure_reason(node_type: &str, message: &str) -> String {
    let first_line = message.lines().next().unwrap_or("").trim();
    // The server's own paths (its files, its Python) are not the user's business.
    let without_paths = first_line
        .split(' ')
        .map(|word| {
            if word.contains('/') || word.contains('\\') {
                "<path>"
            } else {
                word
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    let short: String = without_paths.chars().take(200).collect();
    let node_type: String = node_type.chars().take(60).collect();
    let node_type = node_type.as_str();
    match (node_type.is_empty(), short.is_empty()) {
        (true, true) => "generation failed on the image server".into(),
        (true, false) => format!("generation failed on the image server: {short}"),
        (false, true) => format!("generation failed on the image server at {node_type}"),
        (false, false) => format!("generation failed on the image server at {node_type}: {short}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_servers_error_text_is_cut_and_never_shows_its_paths() {
        let reason = failure_reason(
            "CheckpointLoaderSimple",
            "FileNotFoundError: /opt/ComfyUI/models/checkpoints/x.safetensors not found in C:\\models\nTraceback (most recent call last): ...",
        );
        assert_eq!(
            reason,
            "generation failed on the image server at CheckpointLoaderSimple: FileNotFoundError: <path> not found in <path>"
        );
        let long = failure_reason(&"N".repeat(500), &"word ".repeat(500));
        assert!(long.chars().count() < 320, "{}", long.len());
    }

    fn at(seconds: i64) -> chrono::DateTime<chrono::Utc> {
        chrono::DateTime::UNIX_EPOCH + chrono::Duration::seconds(seconds)
    }

    #[test]
    fn an_adopted_running_task_has_its_limit_from_its_start() {
        let state = zhihui_domain::task::TaskState {
            dispatched_at: Some(at(100)),
            started_at: Some(at(700)),
            ..Default::default()
        };
        // Dispatched 600 s before it started (it waited behind another prompt): the 600 s limit
        // counts from the start, so 100 s are left at 1,200.
        assert_eq!(
            adopted_time_left(&state, Duration::from_secs(600), 1, at(1_200)),
            Duration::from_secs(100)
        );
        assert_eq!(
            adopted_time_left(&state, Duration::from_secs(600), 1, at(1_400)),
            Duration::ZERO
        );
    }

    #[test]
    fn an_adopted_task_not_started_may_wait_behind_the_prompts_posted_before_it() {
        let state = zhihui_domain::task::TaskState {
            dispatched_at: Some(at(100)),
            ..Default::default()
        };
        assert_eq!(
            adopted_time_left(&state, Duration::from_secs(600), 1, at(200)),
            Duration::from_secs(1_100)
        );
        assert_eq!(
            adopted_time_left(&state, Duration::from_secs(600), 0, at(200)),
            Duration::from_secs(500)
        );
        assert_eq!(
            adopted_time_left(
                &zhihui_domain::task::TaskState::default(),
                Duration::from_secs(600),
                1,
                at(200)
            ),
            Duration::from_secs(600)
        );
    }
}
