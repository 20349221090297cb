//! What the saga reacts to and what it holds: the closed set of its inputs (`Input`), a prompt's
//! end (`Completion`), and its state per prompt in flight (`InFlight`, `Phase`) and per server
//! (`BackendState`).

use super::*;

/// Inputs of the saga: a closed set.
#[derive(Debug)]
pub(super) enum Input {
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
    /// An admin changed the pool (from the log): read it again.
    PoolChanged,
    /// The pool as its stream says now.
    PoolLoaded(anyhow::Result<PoolState>),
    /// What a server said it offers and which version it runs.
    Inspected {
        backend: usize,
        result: anyhow::Result<Inspection>,
    },
}

/// How a prompt ended, once its results are stored.
#[derive(Debug, Clone)]
pub(super) enum Completion {
    Succeeded(Vec<TaskImage>),
    Failed(String),
    Interrupted,
    /// The server does not know the prompt (deleted by our cancel, or lost to a restart).
    Vanished,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
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
pub(super) enum Stop {
    Cancel,
    Timeout,
}

#[derive(Debug)]
pub(super) struct InFlight {
    pub(super) owner: UserId,
    pub(super) backend: usize,
    pub(super) prompt_id: Uuid,
    pub(super) workflow: Value,
    pub(super) phase: Phase,
    pub(super) deadline: Instant,
    pub(super) stop: Option<Stop>,
    pub(super) stop_attempts: u32,
    /// A post, locate or stop effect is outstanding: start no second one.
    pub(super) effect_running: bool,
    pub(super) resubmitted: bool,
    /// Posted again after the server lost it, not yet accepted: the resubmission is spent
    /// (`resubmitted`) only when the server accepts the post.
    pub(super) reposting: bool,
    pub(super) completion_attempts: u32,
    /// A completion that could not be recorded yet (the store was down): retried on ticks.
    pub(super) unrecorded: Option<Completion>,
    pub(super) last_progress: Option<Instant>,
    /// Claim order of a staged task: staged tasks are posted in the order they were claimed.
    pub(super) claim_seq: u64,
    /// Posted into the server's own queue behind the prompts it runs: it starts when they end,
    /// without us (its `TaskStarted` waits for its `execution_start`).
    pub(super) posted_ahead: bool,
    /// `TaskStarted` is recorded or being recorded (once per task).
    pub(super) start_recorded: bool,
    /// `TaskStarted` being recorded: the end is recorded after it, so the log keeps the order.
    pub(super) starting: Option<tokio::task::JoinHandle<()>>,
    /// When its start was recorded here (for `zhihui_task_duration_seconds`).
    pub(super) ran_at: Option<Instant>,
    /// Its end was counted in the metrics (a retried recording counts once).
    pub(super) end_counted: bool,
    /// Posted after a prompt of another model (or of one unknown): its run loads its model first.
    pub(super) loads_model: bool,
}

impl InFlight {
    pub(super) fn new(
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
            ran_at: None,
            end_counted: false,
            loads_model: false,
        }
    }
}

/// One server of the pool as the saga follows it. Entries are never taken out while the saga
/// runs (an index names a server in socket events and claims): a removed server's entry stays,
/// marked, and nothing more goes there.
#[derive(Debug)]
pub(super) struct BackendState {
    pub(super) settings: BackendSettings,
    pub(super) client: ComfyClient,
    /// Its socket's task (closed when the server is removed and nothing runs there any more).
    pub(super) socket: Option<AbortHandle>,
    /// Draining: no new task goes there; what runs there finishes.
    pub(super) draining: bool,
    /// Removed from the pool: nothing new goes there, its socket closes once it is idle.
    pub(super) removed: bool,
    /// The checkpoints it offers (`/object_info`), as last read or recorded; `None`: not known
    /// yet, and nothing is claimed for it until it is.
    pub(super) models: Option<Vec<String>>,
    /// Its ComfyUI version (`/system_stats`).
    pub(super) version: Option<String>,
    /// An inspection (`/object_info` + `/system_stats`) is out; when the last one ended.
    pub(super) inspecting: bool,
    pub(super) inspected_at: Option<Instant>,
    /// The model of the task claimed for it last (the filler prefers to send it the same).
    pub(super) last_claimed_model: Option<String>,
    /// The model of the prompt posted to it last, and how often the posted model changed.
    pub(super) last_posted_model: Option<String>,
    pub(super) model_switches: u64,
    /// The last thing that went wrong with it, and when.
    pub(super) last_error: Option<(String, chrono::DateTime<chrono::Utc>)>,
    /// The open socket's clientId; `None` while disconnected (then nothing new is posted there).
    pub(super) client_id: Option<String>,
    /// When a slot last freed with nothing posted since (the start of a GPU idle gap).
    pub(super) freed_at: Option<Instant>,
    /// A slot of it is being freed right now: a post now is a staged task that was ready.
    pub(super) freeing: bool,
    /// Tasks whose staged dispatch is being recorded in the background, with their claim order.
    pub(super) staging: HashMap<TaskId, u64>,
    /// Its socket opened once already: the next opening is a reconnect.
    pub(super) opened_before: bool,
}

impl BackendState {
    pub(super) fn new(settings: BackendSettings, client: ComfyClient) -> BackendState {
        BackendState {
            settings,
            client,
            socket: None,
            draining: false,
            removed: false,
            models: None,
            version: None,
            inspecting: false,
            inspected_at: None,
            last_claimed_model: None,
            last_posted_model: None,
            model_switches: 0,
            last_error: None,
            client_id: None,
            freed_at: None,
            freeing: false,
            staging: HashMap::new(),
            opened_before: false,
        }
    }

    /// New tasks may be claimed for it: connected, in service, and its models known.
    pub(super) fn claimable(&self) -> bool {
        self.client_id.is_some() && !self.draining && !self.removed && self.models.is_some()
    }
}
