//! The prompt worker: ComfyUI's `prompt_worker` + `PromptExecutor.execute_async` + the node
//! functions, reduced to what a dispatcher can observe: the order and targeting of WebSocket
//! events, the classic node cache, checkpoint-based interrupts, runtime errors, history entries
//! and real PNG files on disk. One worker per simulated process, one prompt at a time.

use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

use crate::Faults;
use crate::nodes::{Catalog, NodeDef};
use crate::obj;
use crate::ojson::{OMap, OValue, PyNum};
use crate::png::{RgbImage, seed_colour};
use crate::state::{HistoryStatus, QueueItem, State};

/// Everything that survives a crash: configuration, the fault switches, test counters.
#[derive(Debug)]
pub struct Shared {
    pub output_dir: PathBuf,
    pub temp_dir: PathBuf,
    pub input_dir: PathBuf,
    pub catalog: Catalog,
    pub faults: Mutex<Faults>,
    pub prompts_received: AtomicU64,
    /// `GET /history/{id}` answered (a client looking a prompt up), over all lifetimes.
    pub history_lookups: AtomicU64,
    pub idle: Mutex<IdleClock>,
}

/// When the simulated GPU went idle, and how long each idle spell lasted until the next prompt
/// started: the gap a dispatcher should keep small, seen from the server.
#[derive(Debug, Default)]
pub struct IdleClock {
    pub since: Option<std::time::Instant>,
    pub gaps: Vec<std::time::Duration>,
}

/// Idle gaps kept until taken (a benchmark's worth).
const IDLE_GAPS_MAX: usize = 1_000_000;

impl Shared {
    pub fn idle_clock(&self) -> MutexGuard<'_, IdleClock> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn faults(&self) -> Faults {
        self.faults
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// One simulated ComfyUI process lifetime (from start or restart until crash).
#[derive(Debug)]
pub struct Instance {
    pub shared: Arc<Shared>,
    pub state: Mutex<State>,
    /// Wakes the worker when something is queued.
    pub wake: Notify,
    /// `nodes.interrupt_processing()`: one global flag, checked only at checkpoints.
    pub interrupt: AtomicBool,
    /// Wakes a sleeping node promptly so the next checkpoint sees the flag.
    pub interrupt_notify: Notify,
    /// PreviewImage's `"_temp_" + 5 random letters`, new per process like ComfyUI's.
    pub temp_append: String,
    /// When this process lifetime began (`Faults::socket_start_delay_ms` counts from here).
    pub started: std::time::Instant,
}

impl Instance {
    pub fn new(shared: Arc<Shared>) -> Instance {
        use rand::Rng;
        let mut rng = rand::rng();
        let letters: String = (0..5)
            .map(|_| char::from(b"abcdefghijklmnopqrstupvxyz"[rng.random_range(0..26)]))
            .collect();
        Instance {
            shared,
            state: Mutex::new(State::default()),
            wake: Notify::new(),
            interrupt: AtomicBool::new(false),
            interrupt_notify: Notify::new(),
            temp_append: format!("_temp_{letters}"),
            started: std::time::Instant::now(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_interrupt(&self) {
        self.interrupt.store(true, Ordering::SeqCst);
        self.interrupt_notify.notify_waiters();
    }
}

/// A value flowing along a link (the simulator's stand-in for tensors and model objects).
#[derive(Clone, Debug)]
pub enum Data {
    Literal(OValue),
    Model(String),
    Clip(String),
    Vae(String),
    Conditioning(String),
    Latent(Arc<Latent>),
    Image(Arc<Vec<RgbImage>>),
    Mask { width: u32, height: u32, value: f64 },
}

#[derive(Debug)]
pub struct Latent {
    pub width: u32,
    pub height: u32,
    pub batch: u32,
    /// Set by KSampler: the seed and the positive text decide the picture.
    pub sampled: Option<(u64, String)>,
}

impl Data {
    /// execution.py `format_value`: primitives as they are, everything else `str()`-ed.
    fn format(&self) -> OValue {
        match self {
            Data::Literal(
                v @ (OValue::Null | OValue::Bool(_) | OValue::Number(_) | OValue::String(_)),
            ) => v.clone(),
            Data::Literal(other) => other.py_repr().into(),
            Data::Image(images) => {
                let (w, h) = images
                    .first()
                    .map(|i| (i.width, i.height))
                    .unwrap_or((0, 0));
                format!(
                    "tensor(<simulated IMAGE batch={} height={h} width={w} channels=3>)",
                    images.len()
                )
                .into()
            }
            Data::Latent(l) => format!(
                "{{'samples': tensor(<simulated LATENT batch={} {}x{}>)}}",
                l.batch,
                l.width / 8,
                l.height / 8
            )
            .into(),
            Data::Mask { width, height, .. } => {
                format!("tensor(<simulated MASK {width}x{height}>)").into()
            }
            Data::Model(n) => format!("<comfy.model_patcher.ModelPatcher object ({n})>").into(),
            Data::Clip(n) => format!("<comfy.sd.CLIP object ({n})>").into(),
            Data::Vae(n) => format!("<comfy.sd.VAE object ({n})>").into(),
            Data::Conditioning(t) => format!(
                "[[tensor(<simulated CONDITIONING {t:?}>), {{'pooled_output': tensor(...)}}]]"
            )
            .into(),
        }
    }
}

/// A cached node result: its outputs and its UI output (for `executed` and history).
#[derive(Debug)]
pub struct CacheEntry {
    pub outputs: Arc<Vec<Data>>,
    pub ui: Option<OValue>,
}

/// Why a node stopped.
#[derive(Debug)]
enum Failure {
    Interrupted,
    Error {
        exception_type: String,
        message: String,
        traceback: Vec<String>,
    },
}

fn runtime_error(exception_type: &str, message: impl Into<String>, frame: &str) -> Failure {
    Failure::Error {
        exception_type: exception_type.to_owned(),
        message: message.into(),
        traceback: vec![
            "  File \"/opt/ComfyUI/execution.py\", line 496, in execute\n    output_data, output_ui, has_subgraph, has_pending_tasks = await get_output_data(prompt_id, unique_id, obj, input_data_all, execution_block_cb=execution_block_cb, pre_execute_cb=pre_execute_cb, hidden_inputs=hidden_inputs)\n".to_owned(),
            "  File \"/opt/ComfyUI/execution.py\", line 315, in get_output_data\n    return_values = await _async_map_node_over_list(prompt_id, unique_id, obj, input_data_all, obj.FUNCTION, allow_interrupt=True, execution_block_cb=execution_block_cb, pre_execute_cb=pre_execute_cb, hidden_inputs=hidden_inputs)\n".to_owned(),
            "  File \"/opt/ComfyUI/execution.py\", line 289, in _async_map_node_over_list\n    await process_inputs(input_dict, i)\n".to_owned(),
            "  File \"/opt/ComfyUI/execution.py\", line 277, in process_inputs\n    result = f(**inputs)\n             ^^^^^^^^^^^\n".to_owned(),
            frame.to_owned(),
        ],
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The worker loop (main.py `prompt_worker`). Runs until its task is aborted by a crash.
pub async fn run_worker(inst: Arc<Instance>) {
    loop {
        let (task_id, item) = next_item(&inst).await;
        let outcome = execute(&inst, &item).await;
        let mut st = inst.lock();
        let status = HistoryStatus {
            status_str: if outcome.success { "success" } else { "error" },
            completed: outcome.success,
            messages: outcome.messages,
        };
        st.task_done(task_id, outcome.outputs, outcome.meta, status);
        // Also when the next prompt is queued already: that gap is the server's own, near zero.
        inst.shared.idle_clock().since = Some(std::time::Instant::now());
        if let Some(client) = &outcome.client_id {
            st.send(
                "executing",
                &obj![
                    ("node", OValue::Null),
                    ("prompt_id", item.prompt_id.as_str())
                ],
                Some(client),
            );
        }
    }
}

async fn next_item(inst: &Instance) -> (u64, QueueItem) {
    loop {
        {
            let mut st = inst.lock();
            if let Some(item) = st.queue.pop() {
                let id = st.task_counter;
                st.task_counter += 1;
                st.running.push((id, item.clone()));
                st.queue_updated();
                let mut idle = inst.shared.idle_clock();
                if let Some(since) = idle.since.take()
                    && idle.gaps.len() < IDLE_GAPS_MAX
                {
                    idle.gaps.push(since.elapsed());
                }
                return (id, item);
            }
        }
        // `notify_one` stores a permit, so a put between the check and here is not lost.
        inst.wake.notified().await;
    }
}

struct Outcome {
    success: bool,
    messages: Vec<(String, OValue)>,
    outputs: OMap<OValue>,
    meta: OMap<OValue>,
    client_id: Option<String>,
}

#[derive(Clone, Copy)]
struct Progress {
    value: PyNum,
    max: PyNum,
    finished: bool,
}

/// Per-prompt execution context (`PromptExecutor` fields + the progress registry).
struct Run<'a> {
    inst: &'a Instance,
    prompt_id: String,
    prompt: &'a OMap<OValue>,
    extra_data: &'a OMap<OValue>,
    client_id: Option<String>,
    messages: Vec<(String, OValue)>,
    progress: OMap<Progress>,
    executed: Vec<String>,
}

impl Run<'_> {
    /// `PromptExecutor.add_message`: recorded for history; sent if targeted or broadcast.
    fn add_message(&mut self, event: &str, data: OValue, broadcast: bool) {
        let mut data = match data {
            OValue::Object(m) => m,
            _ => OMap::new(),
        };
        data.insert("timestamp", OValue::from(now_ms()));
        let data = OValue::Object(data);
        if self.client_id.is_some() || broadcast {
            self.inst
                .lock()
                .send(event, &data, self.client_id.as_deref());
        }
        self.messages.push((event.to_owned(), data));
    }

    fn send(&self, event: &str, data: &OValue) {
        if let Some(client) = &self.client_id {
            self.inst.lock().send(event, data, Some(client));
        }
    }

    /// comfy_execution/progress.py: every change re-sends all non-pending nodes.
    fn send_progress_state(&self) {
        let mut nodes = OMap::new();
        for (id, p) in self.progress.iter() {
            nodes.insert(
                id.clone(),
                obj![
                    ("value", p.value.to_value()),
                    ("max", p.max.to_value()),
                    ("state", if p.finished { "finished" } else { "running" }),
                    ("node_id", id.as_str()),
                    ("prompt_id", self.prompt_id.as_str()),
                    ("display_node_id", id.as_str()),
                    ("parent_node_id", OValue::Null),
                    ("real_node_id", id.as_str())
                ],
            );
        }
        let data = obj![
            ("prompt_id", self.prompt_id.as_str()),
            ("nodes", OValue::Object(nodes))
        ];
        self.inst
            .lock()
            .send("progress_state", &data, self.client_id.as_deref());
    }

    fn start_progress(&mut self, node: &str) {
        self.progress.insert(
            node,
            Progress {
                value: PyNum::Float(0.0),
                max: PyNum::Float(1.0),
                finished: false,
            },
        );
        self.send_progress_state();
    }

    fn finish_progress(&mut self, node: &str) {
        let p = self.progress.get(node).copied().unwrap_or(Progress {
            value: PyNum::Int(1),
            max: PyNum::Int(1),
            finished: true,
        });
        self.progress.insert(
            node,
            Progress {
                value: p.max,
                max: p.max,
                finished: true,
            },
        );
        self.send_progress_state();
    }

    fn interrupted(&self) -> bool {
        self.inst.interrupt.load(Ordering::SeqCst)
    }

    /// The progress hook (main.py `hook`): interrupt checkpoint, then progress_state + progress.
    fn tick(&mut self, node: &str, value: PyNum, max: PyNum) -> Result<(), Failure> {
        if self.interrupted() {
            return Err(Failure::Interrupted);
        }
        self.progress.insert(
            node,
            Progress {
                value,
                max,
                finished: false,
            },
        );
        self.send_progress_state();
        let data = obj![
            ("value", value.to_value()),
            ("max", max.to_value()),
            ("prompt_id", self.prompt_id.as_str()),
            ("node", node)
        ];
        self.inst
            .lock()
            .send("progress", &data, self.client_id.as_deref());
        Ok(())
    }

    /// Sleep that an interrupt cuts short (the following checkpoint then raises).
    async fn sleep(&self, duration: Duration) {
        if duration.is_zero() {
            tokio::task::yield_now().await;
            return;
        }
        let notified = self.inst.interrupt_notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.interrupted() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(duration) => {}
            _ = notified => {}
        }
    }
}

/// The classic cache key: class, node id for `UNIQUE_ID` nodes, inputs with links replaced by
/// the linked node's key. Structurally identical sub-graphs share results, like ComfyUI.
fn signatures(catalog: &Catalog, prompt: &OMap<OValue>) -> HashMap<String, String> {
    fn sig(
        id: &str,
        catalog: &Catalog,
        prompt: &OMap<OValue>,
        memo: &mut HashMap<String, String>,
        visiting: &mut HashSet<String>,
    ) -> String {
        if let Some(s) = memo.get(id) {
            return s.clone();
        }
        let Some(node) = prompt.get(id) else {
            return format!("<missing {id}>");
        };
        if !visiting.insert(id.to_owned()) {
            return format!("<cycle {id}>");
        }
        let class = node
            .get("class_type")
            .and_then(OValue::as_str)
            .unwrap_or_default();
        let mut s = String::from(class);
        if catalog.get(class).is_some_and(NodeDef::uses_unique_id) {
            s.push_str(&format!("#{id}"));
        }
        let mut inputs: Vec<(&String, &OValue)> = node
            .get("inputs")
            .and_then(OValue::as_object)
            .map(|m| m.iter().collect())
            .unwrap_or_default();
        inputs.sort_by(|a, b| a.0.cmp(b.0));
        for (k, v) in inputs {
            match link_of(v) {
                Some((src, slot)) => {
                    let inner = sig(&src, catalog, prompt, memo, visiting);
                    s.push_str(&format!("|{k}=({inner})[{slot}]"));
                }
                None => s.push_str(&format!("|{k}={}", crate::ojson::to_string(v))),
            }
        }
        visiting.remove(id);
        memo.insert(id.to_owned(), s.clone());
        s
    }
    let mut memo = HashMap::new();
    let mut visiting = HashSet::new();
    for id in prompt.keys() {
        sig(id, catalog, prompt, &mut memo, &mut visiting);
    }
    memo
}

fn link_of(v: &OValue) -> Option<(String, usize)> {
    let a = v.as_array()?;
    if a.len() != 2 {
        return None;
    }
    let src = a[0].as_str()?.to_owned();
    match a[1].as_num()? {
        PyNum::Int(i) if i >= 0 => Some((src, i as usize)),
        _ => None,
    }
}

/// comfy_execution/graph.py `ExecutionList`, enough of it to pick nodes in ComfyUI's order.
struct ExecutionList {
    pending: Vec<String>,
    block_count: HashMap<String, usize>,
    blocking: HashMap<String, Vec<String>>,
}

impl ExecutionList {
    fn new() -> ExecutionList {
        ExecutionList {
            pending: Vec::new(),
            block_count: HashMap::new(),
            blocking: HashMap::new(),
        }
    }

    fn add_node(&mut self, root: &str, prompt: &OMap<OValue>, is_cached: &dyn Fn(&str) -> bool) {
        let mut stack = vec![root.to_owned()];
        let mut links = Vec::new();
        while let Some(id) = stack.pop() {
            if self.pending.contains(&id) {
                continue;
            }
            self.pending.push(id.clone());
            self.block_count.insert(id.clone(), 0);
            self.blocking.insert(id.clone(), Vec::new());
            let inputs = prompt
                .get(&id)
                .and_then(|n| n.get("inputs"))
                .and_then(OValue::as_object);
            for (_, v) in inputs.into_iter().flat_map(|m| m.iter()) {
                if let Some((src, _)) = link_of(v) {
                    if !is_cached(&src) {
                        stack.push(src.clone());
                    }
                    links.push((src, id.clone()));
                }
            }
        }
        for (from, to) in links {
            if is_cached(&from) {
                continue;
            }
            self.add_node(&from, prompt, is_cached);
            let blocked = self.blocking.entry(from).or_default();
            if !blocked.contains(&to) {
                blocked.push(to.clone());
                *self.block_count.entry(to).or_default() += 1;
            }
        }
    }

    /// `ux_friendly_pick_node`: output nodes first, then their direct and second-level inputs.
    fn stage(&self, is_output: &dyn Fn(&str) -> bool) -> Option<String> {
        let ready: Vec<&String> = self
            .pending
            .iter()
            .filter(|id| self.block_count.get(*id) == Some(&0))
            .collect();
        if let Some(id) = ready.iter().find(|id| is_output(id)) {
            return Some((*id).clone());
        }
        let blocks = |id: &str| self.blocking.get(id).cloned().unwrap_or_default();
        if let Some(id) = ready
            .iter()
            .find(|id| blocks(id).iter().any(|b| is_output(b)))
        {
            return Some((*id).clone());
        }
        if let Some(id) = ready.iter().find(|id| {
            blocks(id)
                .iter()
                .any(|b| blocks(b).iter().any(|c| is_output(c)))
        }) {
            return Some((*id).clone());
        }
        ready.first().map(|id| (*id).clone())
    }

    fn complete(&mut self, id: &str) {
        self.pending.retain(|p| p != id);
        for to in self.blocking.remove(id).unwrap_or_default() {
            if let Some(c) = self.block_count.get_mut(&to) {
                *c = c.saturating_sub(1);
            }
        }
    }
}

/// `PromptExecutor.execute_async`.
async fn execute(inst: &Instance, item: &QueueItem) -> Outcome {
    let prompt = &*item.prompt;
    let client_id = item.extra_data.get("client_id").map(OValue::py_str);
    inst.interrupt.store(false, Ordering::SeqCst);
    inst.lock().client_id = client_id.clone();
    let mut run = Run {
        inst,
        prompt_id: item.prompt_id.clone(),
        prompt,
        extra_data: &item.extra_data,
        client_id: client_id.clone(),
        messages: Vec::new(),
        progress: OMap::new(),
        executed: Vec::new(),
    };
    run.add_message(
        "execution_start",
        obj![("prompt_id", item.prompt_id.as_str())],
        false,
    );

    let catalog = &inst.shared.catalog;
    let sigs = signatures(catalog, prompt);
    let cached: HashMap<String, Arc<CacheEntry>> = {
        let mut st = inst.lock();
        // The classic cache only keeps what the new prompt could reuse (`clean_unused`).
        let keep: HashSet<&String> = sigs.values().collect();
        st.cache.retain(|k, _| keep.contains(k));
        prompt
            .keys()
            .filter_map(|id| {
                let entry = st.cache.get(sigs.get(id)?)?;
                Some((id.clone(), entry.clone()))
            })
            .collect()
    };
    let cached_nodes: Vec<OValue> = prompt
        .keys()
        .filter(|id| cached.contains_key(*id))
        .map(|id| id.as_str().into())
        .collect();
    run.add_message(
        "execution_cached",
        obj![
            ("nodes", OValue::Array(cached_nodes)),
            ("prompt_id", item.prompt_id.as_str())
        ],
        false,
    );

    let class_of = |id: &str| {
        prompt
            .get(id)
            .and_then(|n| n.get("class_type"))
            .and_then(OValue::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let is_output = |id: &str| catalog.get(&class_of(id)).is_some_and(|d| d.output_node);
    let is_cached = |id: &str| cached.contains_key(id);
    let mut list = ExecutionList::new();
    for o in &item.outputs {
        list.add_node(o, prompt, &is_cached);
    }

    let mut values: HashMap<String, Arc<Vec<Data>>> = cached
        .iter()
        .map(|(k, v)| (k.clone(), v.outputs.clone()))
        .collect();
    let mut ui_outputs: OMap<OValue> = OMap::new();
    let mut success = true;
    while !list.pending.is_empty() {
        let Some(node_id) = list.stage(&is_output) else {
            let node_id = list.pending[0].clone();
            let failure = Failure::Error {
                exception_type: "comfy_execution.graph.DependencyCycleError".into(),
                message: "Dependency cycle detected".into(),
                traceback: vec![],
            };
            handle_error(
                &mut run,
                &node_id,
                &class_of(&node_id),
                failure,
                OMap::new(),
            );
            success = false;
            break;
        };
        let class_type = class_of(&node_id);
        if let Some(entry) = cached.get(&node_id) {
            // A cached output node still reports its (old) UI output.
            run.send(
                "executed",
                &obj![
                    ("node", node_id.as_str()),
                    ("display_node", node_id.as_str()),
                    ("output", entry.ui.clone().unwrap_or(OValue::Null)),
                    ("prompt_id", item.prompt_id.as_str())
                ],
            );
            if let Some(ui) = &entry.ui {
                ui_outputs.insert(node_id.clone(), ui.clone());
            }
            run.finish_progress(&node_id);
            list.complete(&node_id);
            continue;
        }
        run.start_progress(&node_id);
        if let Some(client) = &run.client_id {
            let mut st = inst.lock();
            st.last_node_id = Some(node_id.clone());
            st.send(
                "executing",
                &obj![
                    ("node", node_id.as_str()),
                    ("display_node", node_id.as_str()),
                    ("prompt_id", item.prompt_id.as_str())
                ],
                Some(client),
            );
        }
        let Some(def) = catalog.get(&class_type) else {
            handle_error(
                &mut run,
                &node_id,
                &class_type,
                runtime_error("KeyError", format!("'{class_type}'"), ""),
                OMap::new(),
            );
            success = false;
            break;
        };
        let inputs = resolve_inputs(prompt, &node_id, &values);
        let mut current_inputs = OMap::new();
        for (k, v) in inputs.iter() {
            current_inputs.insert(k.clone(), OValue::Array(vec![v.format()]));
        }
        if def.hidden.iter().any(|(k, _)| *k == "prompt") {
            current_inputs.insert(
                "prompt",
                OValue::Array(vec![OValue::Object(prompt.clone()).py_repr().into()]),
            );
            current_inputs.insert(
                "extra_pnginfo",
                OValue::Array(vec![
                    run.extra_data
                        .get("extra_pnginfo")
                        .cloned()
                        .unwrap_or(OValue::Null),
                ]),
            );
        }
        // `before_node_execution`: the interrupt checkpoint between nodes.
        let result = if run.interrupted() {
            Err(Failure::Interrupted)
        } else if inst.shared.faults().fail_node_class.as_deref() == Some(class_type.as_str()) {
            Err(runtime_error(
                "RuntimeError",
                format!("comfyui-sim: simulated failure of {class_type} (fault fail_node_class)"),
                "  File \"/opt/ComfyUI/comfyui_sim_faults.py\", line 1, in fail_node_class\n    raise RuntimeError(message)\n",
            ))
        } else {
            run_node(&mut run, &node_id, def, &inputs).await
        };
        match result {
            Ok((outputs, ui)) => {
                let outputs = Arc::new(outputs);
                if let Some(ui) = &ui {
                    ui_outputs.insert(node_id.clone(), ui.clone());
                    run.send(
                        "executed",
                        &obj![
                            ("node", node_id.as_str()),
                            ("display_node", node_id.as_str()),
                            ("output", ui.clone()),
                            ("prompt_id", item.prompt_id.as_str())
                        ],
                    );
                }
                if let Some(sig) = sigs.get(&node_id) {
                    inst.lock().cache.insert(
                        sig.clone(),
                        Arc::new(CacheEntry {
                            outputs: outputs.clone(),
                            ui,
                        }),
                    );
                }
                values.insert(node_id.clone(), outputs);
                run.finish_progress(&node_id);
                run.executed.push(node_id.clone());
                list.complete(&node_id);
            }
            Err(failure) => {
                handle_error(&mut run, &node_id, &class_type, failure, current_inputs);
                success = false;
                break;
            }
        }
    }
    if success {
        run.add_message(
            "execution_success",
            obj![("prompt_id", item.prompt_id.as_str())],
            false,
        );
    }
    let mut meta = OMap::new();
    for id in ui_outputs.keys() {
        meta.insert(
            id.clone(),
            obj![
                ("node_id", id.as_str()),
                ("display_node", id.as_str()),
                ("parent_node", OValue::Null),
                ("real_node_id", id.as_str())
            ],
        );
    }
    inst.lock().last_node_id = None;
    Outcome {
        success,
        messages: run.messages,
        outputs: ui_outputs,
        meta,
        client_id,
    }
}

/// `PromptExecutor.handle_execution_error`.
fn handle_error(
    run: &mut Run,
    node_id: &str,
    class_type: &str,
    failure: Failure,
    current_inputs: OMap<OValue>,
) {
    let executed = OValue::from(run.executed.clone());
    match failure {
        Failure::Interrupted => {
            let data = obj![
                ("prompt_id", run.prompt_id.as_str()),
                ("node_id", node_id),
                ("node_type", class_type),
                ("executed", executed)
            ];
            run.add_message("execution_interrupted", data, true);
        }
        Failure::Error {
            exception_type,
            message,
            traceback,
        } => {
            tracing::warn!(node_id, class_type, %message, "node raised");
            let current_outputs: Vec<OValue> =
                run.prompt.keys().map(|k| k.as_str().into()).collect();
            let data = obj![
                ("prompt_id", run.prompt_id.as_str()),
                ("node_id", node_id),
                ("node_type", class_type),
                ("executed", executed),
                ("exception_message", format!("{message}\n")),
                ("exception_type", exception_type),
                ("traceback", traceback),
                ("current_inputs", OValue::Object(current_inputs)),
                ("current_outputs", OValue::Array(current_outputs))
            ];
            run.add_message("execution_error", data, false);
        }
    }
}

fn resolve_inputs(
    prompt: &OMap<OValue>,
    node_id: &str,
    values: &HashMap<String, Arc<Vec<Data>>>,
) -> OMap<Data> {
    let mut out = OMap::new();
    let inputs = prompt
        .get(node_id)
        .and_then(|n| n.get("inputs"))
        .and_then(OValue::as_object);
    for (k, v) in inputs.into_iter().flat_map(|m| m.iter()) {
        let data = match link_of(v) {
            Some((src, slot)) => values
                .get(&src)
                .and_then(|o| o.get(slot))
                .cloned()
                .unwrap_or(Data::Literal(OValue::Null)),
            None => Data::Literal(v.clone()),
        };
        out.insert(k.clone(), data);
    }
    out
}

fn type_error(node: &NodeDef, input: &str, wanted: &str) -> Failure {
    runtime_error(
        "AttributeError",
        format!("{}: input '{input}' is not a {wanted}", node.name),
        "  File \"/opt/ComfyUI/nodes.py\", line 1, in <simulated>\n",
    )
}

fn int_of(inputs: &OMap<Data>, def: &NodeDef, name: &str) -> Result<i128, Failure> {
    match inputs.get(name) {
        Some(Data::Literal(v)) => match v.as_num() {
            Some(PyNum::Int(i)) => Ok(i),
            Some(PyNum::Float(f)) => Ok(f as i128),
            None => Err(type_error(def, name, "number")),
        },
        _ => Err(type_error(def, name, "number")),
    }
}

fn float_of(inputs: &OMap<Data>, def: &NodeDef, name: &str) -> Result<f64, Failure> {
    match inputs.get(name) {
        Some(Data::Literal(v)) => v
            .as_num()
            .map(PyNum::as_f64)
            .ok_or_else(|| type_error(def, name, "number")),
        _ => Err(type_error(def, name, "number")),
    }
}

fn string_of(inputs: &OMap<Data>, def: &NodeDef, name: &str) -> Result<String, Failure> {
    match inputs.get(name) {
        Some(Data::Literal(v)) => Ok(v.py_str()),
        Some(Data::Conditioning(t)) => Ok(t.clone()),
        _ => Err(type_error(def, name, "STRING")),
    }
}

fn images_of(
    inputs: &OMap<Data>,
    def: &NodeDef,
    name: &str,
) -> Result<Arc<Vec<RgbImage>>, Failure> {
    match inputs.get(name) {
        Some(Data::Image(i)) => Ok(i.clone()),
        Some(Data::Mask {
            width,
            height,
            value,
        }) => {
            let v = (value.clamp(0.0, 1.0) * 255.0) as u8;
            Ok(Arc::new(vec![RgbImage::solid(*width, *height, [v, v, v])]))
        }
        _ => Err(type_error(def, name, "IMAGE")),
    }
}

fn dim(v: i128) -> u32 {
    v.clamp(1, 16384) as u32
}

/// What each node class does when it runs (not cached).
async fn run_node(
    run: &mut Run<'_>,
    node_id: &str,
    def: &NodeDef,
    inputs: &OMap<Data>,
) -> Result<(Vec<Data>, Option<OValue>), Failure> {
    let step_delay = Duration::from_millis(run.inst.shared.faults().step_delay_ms);
    match def.name {
        "CheckpointLoaderSimple" => {
            let name = string_of(inputs, def, "ckpt_name")?;
            let load = run.inst.shared.faults().model_load_ms;
            if load > 0 {
                run.sleep(Duration::from_millis(load)).await;
            }
            Ok((
                vec![
                    Data::Model(name.clone()),
                    Data::Clip(name.clone()),
                    Data::Vae(name),
                ],
                None,
            ))
        }
        "CLIPTextEncode" => Ok((
            vec![Data::Conditioning(string_of(inputs, def, "text")?)],
            None,
        )),
        "EmptyLatentImage" => {
            let latent = Latent {
                width: dim(int_of(inputs, def, "width")?),
                height: dim(int_of(inputs, def, "height")?),
                batch: int_of(inputs, def, "batch_size")?.clamp(1, 4096) as u32,
                sampled: None,
            };
            Ok((vec![Data::Latent(Arc::new(latent))], None))
        }
        "KSampler" => {
            let steps = int_of(inputs, def, "steps")?.clamp(1, 10_000) as i64;
            let seed = int_of(inputs, def, "seed")?.clamp(0, i128::from(u64::MAX)) as u64;
            let text = match inputs.get("positive") {
                Some(Data::Conditioning(t)) => t.clone(),
                _ => String::new(),
            };
            let Some(Data::Latent(latent)) = inputs.get("latent_image") else {
                return Err(type_error(def, "latent_image", "LATENT"));
            };
            for step in 1..=steps {
                run.sleep(step_delay).await;
                run.tick(node_id, PyNum::Int(step.into()), PyNum::Int(steps.into()))?;
            }
            let out = Latent {
                width: latent.width,
                height: latent.height,
                batch: latent.batch,
                sampled: Some((seed, text)),
            };
            Ok((vec![Data::Latent(Arc::new(out))], None))
        }
        "VAEDecode" => {
            let Some(Data::Latent(latent)) = inputs.get("samples") else {
                return Err(type_error(def, "samples", "LATENT"));
            };
            let images = (0..latent.batch)
                .map(|i| match &latent.sampled {
                    Some((seed, text)) => RgbImage::gradient(
                        latent.width,
                        latent.height,
                        seed_colour(seed.wrapping_add(u64::from(i)), text),
                    ),
                    None => RgbImage::solid(latent.width, latent.height, [128, 128, 128]),
                })
                .collect();
            Ok((vec![Data::Image(Arc::new(images))], None))
        }
        "EmptyImage" => {
            let (w, h) = (
                dim(int_of(inputs, def, "width")?),
                dim(int_of(inputs, def, "height")?),
            );
            let batch = int_of(inputs, def, "batch_size")?.clamp(1, 4096) as usize;
            let c = int_of(inputs, def, "color")?.clamp(0, 0xff_ffff) as u32;
            let rgb = [(c >> 16) as u8, (c >> 8) as u8, c as u8];
            Ok((
                vec![Data::Image(Arc::new(vec![
                    RgbImage::solid(w, h, rgb);
                    batch
                ]))],
                None,
            ))
        }
        "ImageScale" => {
            let images = images_of(inputs, def, "image")?;
            let (mut w, mut h) = (
                int_of(inputs, def, "width")?,
                int_of(inputs, def, "height")?,
            );
            let (sw, sh) = images
                .first()
                .map(|i| (i128::from(i.width), i128::from(i.height)))
                .unwrap_or((1, 1));
            if w == 0 && h == 0 {
                (w, h) = (sw, sh);
            } else if w == 0 {
                w = (sw * h / sh.max(1)).max(1);
            } else if h == 0 {
                h = (sh * w / sw.max(1)).max(1);
            }
            let scaled = images.iter().map(|i| i.resized(dim(w), dim(h))).collect();
            Ok((vec![Data::Image(Arc::new(scaled))], None))
        }
        "SolidMask" => Ok((
            vec![Data::Mask {
                width: dim(int_of(inputs, def, "width")?),
                height: dim(int_of(inputs, def, "height")?),
                value: float_of(inputs, def, "value")?,
            }],
            None,
        )),
        "TestSleep" => {
            // testing-pack TestSleep: a progress tick with the elapsed seconds every 10 ms.
            let seconds = float_of(inputs, def, "seconds")?;
            let start = Instant::now();
            loop {
                let elapsed = start.elapsed().as_secs_f64();
                run.tick(node_id, PyNum::Float(elapsed), PyNum::Float(seconds))?;
                if elapsed >= seconds {
                    break;
                }
                run.sleep(Duration::from_millis(10)).await;
            }
            Ok((
                vec![
                    inputs
                        .get("value")
                        .cloned()
                        .unwrap_or(Data::Literal(OValue::Null)),
                ],
                None,
            ))
        }
        "TestSyncError" => Err(runtime_error(
            "RuntimeError",
            "Intentional sync execution error for testing",
            "  File \"/opt/ComfyUI/tests/execution/testing_nodes/testing-pack/async_test_nodes.py\", line 135, in sync_error\n    raise RuntimeError(\"Intentional sync execution error for testing\")\n",
        )),
        "SaveImage" | "PreviewImage" => {
            let images = images_of(inputs, def, "images")?;
            let (base, kind, prefix, fast) = if def.name == "SaveImage" {
                (
                    run.inst.shared.output_dir.clone(),
                    "output",
                    string_of(inputs, def, "filename_prefix")?,
                    run.inst.shared.faults().fast_png,
                )
            } else {
                (
                    run.inst.shared.temp_dir.clone(),
                    "temp",
                    format!("ComfyUI{}", run.inst.temp_append),
                    true,
                )
            };
            // SaveImage's metadata (nodes.py `save_images`): `prompt` and each `extra_pnginfo`
            // entry as `json.dumps(...)`, which is ASCII whatever language the prompt is in.
            let mut texts = vec![(
                "prompt".to_owned(),
                crate::ojson::py_json_dumps(&OValue::Object(run.prompt.clone())),
            )];
            if let Some(extra) = run
                .extra_data
                .get("extra_pnginfo")
                .and_then(OValue::as_object)
            {
                for (key, value) in extra.iter() {
                    texts.push((key.clone(), crate::ojson::py_json_dumps(value)));
                }
            }
            let mut results = save_images(&images, &prefix, &base, kind, &texts, fast)?;
            if def.name == "SaveImage" && run.inst.shared.faults().hostile_outputs {
                // A compromised or buggy server: one output more than asked for, outside the
                // prompt's own prefix.
                results.push(obj![
                    ("filename", "passwd"),
                    ("subfolder", "../../../etc"),
                    ("type", "output")
                ]);
            }
            Ok((vec![], Some(obj![("images", OValue::Array(results))])))
        }
        other => Err(runtime_error(
            "NotImplementedError",
            format!("comfyui-sim cannot run {other}"),
            "",
        )),
    }
}

/// Python `os.path.normpath` for `/`-separated paths.
pub(crate) fn normpath(p: &str) -> String {
    let absolute = p.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for part in p.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if parts.last().is_some_and(|l| *l != "..") {
                    parts.pop();
                } else if !absolute {
                    parts.push("..");
                }
            }
            other => parts.push(other),
        }
    }
    let joined = parts.join("/");
    match (absolute, joined.is_empty()) {
        (true, _) => format!("/{joined}"),
        (false, true) => ".".to_owned(),
        (false, false) => joined,
    }
}

fn components(p: &Path) -> Vec<String> {
    p.components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            Component::RootDir => Some("/".to_owned()),
            _ => None,
        })
        .collect()
}

/// folder_paths.py `get_save_image_path` + `SaveImage.save_images`.
fn save_images(
    images: &[RgbImage],
    prefix: &str,
    output_dir: &Path,
    kind: &str,
    texts: &[(String, String)],
    fast: bool,
) -> Result<Vec<OValue>, Failure> {
    let (w, h) = images
        .first()
        .map(|i| (i.width, i.height))
        .unwrap_or((0, 0));
    let prefix = prefix
        .replace("%width%", &w.to_string())
        .replace("%height%", &h.to_string());
    let norm = normpath(&prefix);
    let (subfolder, filename) = match norm.rsplit_once('/') {
        Some((dir, file)) => (
            if dir.is_empty() {
                "/".to_owned()
            } else {
                dir.to_owned()
            },
            file.to_owned(),
        ),
        None => (String::new(), norm.clone()),
    };
    let joined = if subfolder.starts_with('/') {
        PathBuf::from(&subfolder)
    } else {
        output_dir.join(&subfolder)
    };
    let full = PathBuf::from(normpath(&joined.to_string_lossy()));
    let out_parts = components(output_dir);
    let full_parts = components(&full);
    let common: Vec<String> = out_parts
        .iter()
        .zip(&full_parts)
        .take_while(|(a, b)| a == b)
        .map(|(a, _)| a.clone())
        .collect();
    if common != out_parts {
        let common_path = if common.is_empty() {
            String::new()
        } else {
            normpath(&common.join("/"))
        };
        let err = format!(
            "**** ERROR: Saving image outside the output folder is not allowed.\n full_output_folder: {}\n         output_dir: {}\n         commonpath: {}",
            full.display(),
            output_dir.display(),
            common_path
        );
        tracing::error!("{err}");
        return Err(runtime_error(
            "Exception",
            err,
            "  File \"/opt/ComfyUI/folder_paths.py\", line 397, in get_save_image_path\n    raise Exception(err)\n",
        ));
    }
    let io_error = |e: std::io::Error| {
        runtime_error(
            "OSError",
            e.to_string(),
            "  File \"/opt/ComfyUI/nodes.py\", line 1611, in save_images\n",
        )
    };
    let counter = match std::fs::read_dir(&full) {
        Ok(entries) => {
            let prefix_len = filename.chars().count();
            entries
                .filter_map(Result::ok)
                .filter_map(|e| {
                    let name: Vec<char> = e.file_name().to_string_lossy().chars().collect();
                    let head: String = name.iter().take(prefix_len + 1).collect();
                    let rest: String = name.iter().skip(prefix_len + 1).collect();
                    let digits = rest
                        .split('_')
                        .next()
                        .and_then(|d| d.parse::<u64>().ok())
                        .unwrap_or(0);
                    (head.len() > 1 && head.ends_with('_') && head[..head.len() - 1] == filename)
                        .then_some(digits)
                })
                .max()
                .map_or(1, |m| m + 1)
        }
        Err(_) => {
            std::fs::create_dir_all(&full).map_err(io_error)?;
            1
        }
    };
    let subfolder = if subfolder == "/" {
        String::new()
    } else {
        subfolder
    };
    let mut results = Vec::new();
    for (batch_number, (image, counter)) in images.iter().zip(counter..).enumerate() {
        let name = format!(
            "{}_{counter:05}_.png",
            filename.replace("%batch_num%", &batch_number.to_string())
        );
        image
            .save_png(&full.join(&name), texts, fast)
            .map_err(|e| {
                runtime_error(
                    "OSError",
                    e.to_string(),
                    "  File \"/opt/ComfyUI/nodes.py\", line 1611, in save_images\n",
                )
            })?;
        results.push(obj![
            ("filename", name),
            ("subfolder", subfolder.as_str()),
            ("type", kind)
        ]);
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normpath_like_python() {
        assert_eq!(normpath("../escape_attempt"), "../escape_attempt");
        assert_eq!(normpath("zhihui/abc"), "zhihui/abc");
        assert_eq!(normpath("a/./b/../c/"), "a/c");
        assert_eq!(normpath("/out/.."), "/");
    }
}
