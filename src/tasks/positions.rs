//! Queue positions for the user sockets of one process. Each socket registers the queued tasks it
//! follows here; after a queue change (`QueueMoved` from any process) one reader fetches the
//! places of every followed task in one Redis call (`lua/queue_ranks.lua`, in chunks of
//! [`CHUNK`]) and hands the same snapshot to every socket. A queue change costs each process one
//! Redis call per [`CHUNK`] followed tasks, not one per socket and task; changes that arrive
//! while a read runs are answered together by the next read.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, OnceCell, broadcast};
use zhihui_domain::task::TaskId;

use crate::platform::notify::{Envelope, NotificationHub};
use crate::tasks::pool::{PoolService, WaitEstimate};
use crate::tasks::queue::TaskQueue;

/// Tasks per Redis call.
pub const CHUNK: usize = 1000;

/// A queued task's place: 1-based, with its wait estimate when the board makes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub position: u64,
    pub estimate: Option<WaitEstimate>,
}

/// Places read together: `None` for a task that left the queue. Only the tasks followed when the
/// read began are in it; a socket keeps what it does not find here.
pub type Snapshot = HashMap<TaskId, Option<Place>>;

#[derive(Debug, Clone)]
pub struct PositionBoard {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    queue: TaskQueue,
    /// Wait estimates with the places (`None`: places only).
    estimates: Option<PoolService>,
    /// Followed tasks, with how many sockets follow each.
    followed: Mutex<HashMap<TaskId, usize>>,
    snapshots: broadcast::Sender<Arc<Snapshot>>,
    dirty: Notify,
    started: OnceCell<()>,
}

impl PositionBoard {
    pub fn new(queue: TaskQueue, estimates: Option<PoolService>) -> PositionBoard {
        let (snapshots, _) = broadcast::channel(16);
        PositionBoard {
            inner: Arc::new(Inner {
                queue,
                estimates,
                followed: Mutex::new(HashMap::new()),
                snapshots,
                dirty: Notify::new(),
                started: OnceCell::new(),
            }),
        }
    }

    /// The snapshots from now on; the reader starts with the first socket.
    pub async fn subscribe(
        &self,
        hub: &NotificationHub,
    ) -> anyhow::Result<broadcast::Receiver<Arc<Snapshot>>> {
        let receiver = self.inner.snapshots.subscribe();
        self.inner
            .started
            .get_or_try_init(|| async {
                let notifications = hub.subscribe().await?;
                let board = self.clone();
                tokio::spawn(async move { board.read_on_changes(notifications).await });
                anyhow::Ok(())
            })
            .await?;
        Ok(receiver)
    }

    /// Follow `task_id` (until [`Following`] forgets it).
    pub fn follow(&self, task_id: TaskId) {
        let mut followed = self
            .inner
            .followed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *followed.entry(task_id).or_insert(0) += 1;
    }

    fn forget(&self, task_id: TaskId) {
        let mut followed = self
            .inner
            .followed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(count) = followed.get_mut(&task_id) {
            *count -= 1;
            if *count == 0 {
                followed.remove(&task_id);
            }
        }
    }

    /// Ask for a read soon (a socket follows a new task).
    pub fn refresh(&self) {
        self.inner.dirty.notify_one();
    }

    /// The places of `tasks` now (a socket's first message), in one call per chunk.
    pub async fn read(&self, tasks: &[TaskId]) -> anyhow::Result<Snapshot> {
        let mut snapshot: Snapshot = HashMap::with_capacity(tasks.len());
        for chunk in tasks.chunks(CHUNK) {
            let ranks = self.inner.queue.ranks(chunk).await?;
            for (&task_id, rank) in chunk.iter().zip(ranks) {
                snapshot.insert(
                    task_id,
                    rank.map(|rank| Place {
                        position: rank + 1,
                        estimate: None,
                    }),
                );
            }
        }
        // One replay of the queue's head for every followed task (bounded by the estimate's
        // own limit); the places stand without it if it cannot be made.
        let places: Vec<(TaskId, u64)> = snapshot
            .iter()
            .filter_map(|(task_id, place)| place.as_ref().map(|place| (*task_id, place.position)))
            .collect();
        if let (Some(pool), false) = (&self.inner.estimates, places.is_empty()) {
            match pool.estimates(&self.inner.queue, places).await {
                Ok(estimates) => {
                    for (task_id, place) in &mut snapshot {
                        if let Some(place) = place {
                            place.estimate = estimates.get(task_id).cloned();
                        }
                    }
                }
                Err(error) => {
                    tracing::debug!(error = %crate::platform::telemetry::error_chain(&error), "wait estimates unavailable");
                }
            }
        }
        Ok(snapshot)
    }

    async fn read_on_changes(self, mut notifications: broadcast::Receiver<Envelope>) {
        let board = self.clone();
        // Queue changes mark the board dirty; the loop below reads once per dirty spell.
        tokio::spawn(async move {
            loop {
                match notifications.recv().await {
                    Ok(Envelope::QueueMoved) | Err(broadcast::error::RecvError::Lagged(_)) => {
                        board.refresh();
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        loop {
            self.inner.dirty.notified().await;
            let tasks: Vec<TaskId> = {
                let followed = self
                    .inner
                    .followed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                followed.keys().copied().collect()
            };
            if tasks.is_empty() {
                continue;
            }
            match self.read(&tasks).await {
                // No receiver: no socket open now; nothing to do.
                Ok(snapshot) => drop(self.inner.snapshots.send(Arc::new(snapshot))),
                Err(error) => {
                    tracing::debug!(error = %crate::platform::telemetry::error_chain(&error), "queue positions unavailable");
                }
            }
        }
    }
}

/// The tasks one socket follows; forgotten on the board when dropped.
#[derive(Debug)]
pub struct Following {
    board: PositionBoard,
    /// Last place told per task (`None`: not told yet).
    told: HashMap<TaskId, Option<u64>>,
}

impl Following {
    pub fn new(board: PositionBoard) -> Following {
        Following {
            board,
            told: HashMap::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.told.len()
    }

    pub fn is_empty(&self) -> bool {
        self.told.is_empty()
    }

    pub fn tasks(&self) -> Vec<TaskId> {
        self.told.keys().copied().collect()
    }

    /// Follow a task (again: nothing changes). Whether it was not followed before.
    pub fn add(&mut self, task_id: TaskId) -> bool {
        if let std::collections::hash_map::Entry::Vacant(entry) = self.told.entry(task_id) {
            entry.insert(None);
            self.board.follow(task_id);
            return true;
        }
        false
    }

    pub fn remove(&mut self, task_id: TaskId) {
        if self.told.remove(&task_id).is_some() {
            self.board.forget(task_id);
        }
    }

    /// The places in `snapshot` that differ from what was told (now told), and the tasks it
    /// says left the queue (forgotten here: the page that shows one learns it left, even when
    /// the news of why came before it followed the task).
    pub fn changes(&mut self, snapshot: &Snapshot) -> (Vec<(TaskId, Place)>, Vec<TaskId>) {
        let mut changed = Vec::new();
        let mut left = Vec::new();
        for (task_id, told) in &mut self.told {
            match snapshot.get(task_id) {
                Some(Some(place)) if *told != Some(place.position) => {
                    *told = Some(place.position);
                    changed.push((*task_id, place.clone()));
                }
                Some(None) => left.push(*task_id),
                _ => {}
            }
        }
        for task_id in &left {
            self.remove(*task_id);
        }
        (changed, left)
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        for task_id in self.told.keys() {
            self.board.forget(*task_id);
        }
    }
}
