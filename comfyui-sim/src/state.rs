//! The in-memory state of one simulated ComfyUI process: the priority queue (a port of Python's
//! `heapq`, because `/queue` shows the raw heap order), the running item, history, the `number`
//! counter, the node cache and the WebSocket registry. A crash throws the whole `State` away,
//! exactly what ComfyUI loses on SIGKILL.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::CacheEntry;
use crate::ojson::{OMap, OValue, py_float};

/// ComfyUI keeps at most this many history entries (execution.py `MAXIMUM_HISTORY_SIZE`).
pub const MAXIMUM_HISTORY_SIZE: usize = 10_000;

/// A queue priority: the server counter (int) or a client-supplied `number` (`float()`-ed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Number {
    Int(i64),
    Float(f64),
}

impl Number {
    fn as_f64(self) -> f64 {
        match self {
            Number::Int(i) => i as f64,
            Number::Float(f) => f,
        }
    }
    fn cmp(self, other: Number) -> Ordering {
        match (self, other) {
            (Number::Int(a), Number::Int(b)) => a.cmp(&b),
            (a, b) => a
                .as_f64()
                .partial_cmp(&b.as_f64())
                .unwrap_or(Ordering::Equal),
        }
    }
    pub fn to_value(self) -> OValue {
        match self {
            Number::Int(i) => i.into(),
            Number::Float(f) => f.into(),
        }
    }
}

impl Serialize for Number {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(s)
    }
}

impl std::fmt::Display for Number {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Number::Int(i) => write!(f, "{i}"),
            Number::Float(x) => f.write_str(&py_float(*x)),
        }
    }
}

/// `(number, prompt_id, prompt, extra_data, outputs_to_execute)`, ComfyUI's queue tuple.
#[derive(Clone, Debug)]
pub struct QueueItem {
    pub number: Number,
    pub prompt_id: String,
    pub prompt: Arc<OMap<OValue>>,
    pub extra_data: Arc<OMap<OValue>>,
    pub outputs: Vec<String>,
    /// Tie-breaker in place of Python comparing the prompt dicts.
    pub seq: u64,
}

impl QueueItem {
    fn lt(&self, other: &QueueItem) -> bool {
        match self.number.cmp(other.number) {
            Ordering::Less => true,
            Ordering::Greater => false,
            Ordering::Equal => (&self.prompt_id, self.seq) < (&other.prompt_id, other.seq),
        }
    }
    pub fn to_value(&self) -> OValue {
        OValue::Array(vec![
            self.number.to_value(),
            self.prompt_id.as_str().into(),
            OValue::Object((*self.prompt).clone()),
            OValue::Object((*self.extra_data).clone()),
            OValue::from(self.outputs.clone()),
        ])
    }
}

/// Python's `heapq` on a list, so `queue_pending` comes out in the same raw order.
#[derive(Debug, Default)]
pub struct Heap(pub Vec<QueueItem>);

impl Heap {
    pub fn push(&mut self, item: QueueItem) {
        self.0.push(item);
        let last = self.0.len() - 1;
        self.sift_down(0, last);
    }
    pub fn pop(&mut self) -> Option<QueueItem> {
        let last = self.0.pop()?;
        if self.0.is_empty() {
            return Some(last);
        }
        let top = std::mem::replace(&mut self.0[0], last);
        self.sift_up(0);
        Some(top)
    }
    pub fn heapify(&mut self) {
        for i in (0..self.0.len() / 2).rev() {
            self.sift_up(i);
        }
    }
    // heapq._siftdown: move the new leaf at `pos` up towards `start`.
    fn sift_down(&mut self, start: usize, mut pos: usize) {
        while pos > start {
            let parent = (pos - 1) >> 1;
            if self.0[pos].lt(&self.0[parent]) {
                self.0.swap(pos, parent);
                pos = parent;
            } else {
                break;
            }
        }
    }
    // heapq._siftup: bubble the smaller child up until a leaf, then _siftdown.
    fn sift_up(&mut self, mut pos: usize) {
        let end = self.0.len();
        let start = pos;
        let mut child = 2 * pos + 1;
        while child < end {
            let right = child + 1;
            if right < end && !self.0[child].lt(&self.0[right]) {
                child = right;
            }
            self.0.swap(pos, child);
            pos = child;
            child = 2 * pos + 1;
        }
        self.sift_down(start, pos);
    }
}

/// One history entry, serialised as `{prompt, outputs, status, meta}`.
#[derive(Clone, Debug, Serialize)]
pub struct HistoryEntry {
    pub prompt: OValue,
    pub outputs: OMap<OValue>,
    pub status: HistoryStatus,
    pub meta: OMap<OValue>,
}

#[derive(Clone, Debug, Serialize)]
pub struct HistoryStatus {
    pub status_str: &'static str,
    pub completed: bool,
    pub messages: Vec<(String, OValue)>,
}

/// What goes down one WebSocket connection.
#[derive(Debug)]
pub enum Outgoing {
    Text(String),
    /// Drop the connection without a close frame (a crash).
    Kill,
}

#[derive(Debug)]
pub struct Socket {
    pub tx: UnboundedSender<Outgoing>,
}

#[derive(Debug, Default)]
pub struct State {
    pub number: i64,
    pub seq: u64,
    pub queue: Heap,
    pub task_counter: u64,
    pub running: Vec<(u64, QueueItem)>,
    pub history: OMap<Arc<HistoryEntry>>,
    /// clientId → socket. Keyed like ComfyUI's `self.sockets`, duplicate-clientId bug included.
    pub sockets: HashMap<String, Socket>,
    /// Every live connection (also those that lost their registration), for crash.
    pub connections: HashMap<u64, UnboundedSender<Outgoing>>,
    pub next_conn: u64,
    /// `server.client_id` and `server.last_node_id` of the executor.
    pub client_id: Option<String>,
    pub last_node_id: Option<String>,
    /// Node outputs keyed by input signature (ComfyUI's classic cache).
    pub cache: HashMap<String, Arc<CacheEntry>>,
}

impl State {
    pub fn queue_remaining(&self) -> usize {
        self.queue.0.len() + self.running.len()
    }

    pub fn status_data(&self) -> OValue {
        crate::obj![(
            "status",
            crate::obj![(
                "exec_info",
                crate::obj![("queue_remaining", self.queue_remaining() as u64)]
            )]
        )]
    }

    /// `PromptServer.send_sync`: to one registered clientId, or to every registered socket.
    pub fn send(&self, event: &str, data: &OValue, sid: Option<&str>) {
        let text = message(event, data);
        match sid {
            Some(sid) => {
                if let Some(socket) = self.sockets.get(sid) {
                    let _ = socket.tx.send(Outgoing::Text(text));
                }
            }
            None => {
                for socket in self.sockets.values() {
                    let _ = socket.tx.send(Outgoing::Text(text.clone()));
                }
            }
        }
    }

    /// `PromptServer.queue_updated`: broadcast the queue size.
    pub fn queue_updated(&self) {
        self.send("status", &self.status_data(), None);
    }

    pub fn put(&mut self, item: QueueItem) {
        self.queue.push(item);
        self.queue_updated();
    }

    /// `PromptQueue.task_done`: write history (replacing a duplicate id in place) and broadcast.
    pub fn task_done(
        &mut self,
        task_id: u64,
        outputs: OMap<OValue>,
        meta: OMap<OValue>,
        status: HistoryStatus,
    ) {
        let Some(at) = self.running.iter().position(|(id, _)| *id == task_id) else {
            return;
        };
        let (_, item) = self.running.remove(at);
        if self.history.len() > MAXIMUM_HISTORY_SIZE {
            self.history.0.remove(0);
        }
        let entry = HistoryEntry {
            prompt: item.to_value(),
            outputs,
            status,
            meta,
        };
        self.history.insert(item.prompt_id.clone(), Arc::new(entry));
        self.queue_updated();
    }

    /// `PromptQueue.delete_queue_item`: the first pending item with this id; status if found.
    pub fn delete_pending(&mut self, prompt_id: &str) {
        if let Some(at) = self.queue.0.iter().position(|i| i.prompt_id == prompt_id) {
            if self.queue.0.len() == 1 {
                self.queue.0.clear();
            } else {
                self.queue.0.remove(at);
                self.queue.heapify();
            }
            self.queue_updated();
        }
    }

    pub fn wipe_queue(&mut self) {
        self.queue.0.clear();
        self.queue_updated();
    }
}

/// A WebSocket text frame: `{"type": event, "data": data}`.
pub fn message(event: &str, data: &OValue) -> String {
    crate::ojson::to_string(&crate::obj![("type", event), ("data", data.clone())])
}
