//! ComfyUI's HTTP API and WebSocket messages, as recorded from a real server
//! (`comfyui-sim/transcripts/`): the client the saga posts, cancels, reconciles and downloads
//! with, and the closed set of WebSocket messages it reacts to.
//!
//! The WebSocket is a hint and `/queue` + `/history` are the truth: nothing is buffered across
//! reconnects, and a deleted prompt leaves no event at all.

use std::time::Duration;

use anyhow::Context;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::labels::image_content_type;

/// Bytes of one downloaded image, at most: a 768x768 PNG is a few MB; this bounds a broken server.
pub const IMAGE_BYTES_MAX: usize = 64 * 1024 * 1024;

/// A message of ComfyUI's WebSocket, parsed; anything else (previews, `progress_state`, unknown
/// types of newer versions) is `Other` and ignored.
#[derive(Debug, Clone, PartialEq)]
pub enum ComfyMessage {
    Status {
        queue_remaining: u64,
    },
    ExecutionStart {
        prompt_id: Uuid,
    },
    /// `node: None` is the last message of a prompt, sent after its history entry is written.
    /// A reconnect mid-run gets one without a prompt id.
    Executing {
        prompt_id: Option<Uuid>,
        node: Option<String>,
    },
    Progress {
        prompt_id: Uuid,
        value: f64,
        max: f64,
    },
    ExecutionSuccess {
        prompt_id: Uuid,
    },
    ExecutionError {
        prompt_id: Uuid,
        node_type: String,
        exception_message: String,
    },
    ExecutionInterrupted {
        prompt_id: Uuid,
    },
    Other,
}

fn prompt_id_of(data: &Value) -> Option<Uuid> {
    data.get("prompt_id")
        .and_then(Value::as_str)
        .and_then(|text| Uuid::parse_str(text).ok())
}

impl ComfyMessage {
    /// Parse one text frame. Prompt ids that are not UUIDs are not ours: those messages are
    /// `Other`.
    pub fn parse(text: &str) -> ComfyMessage {
        let Ok(frame) = serde_json::from_str::<Value>(text) else {
            return ComfyMessage::Other;
        };
        let data = &frame["data"];
        let prompt_id = prompt_id_of(data);
        match (frame["type"].as_str(), prompt_id) {
            (Some("status"), _) => ComfyMessage::Status {
                queue_remaining: data["status"]["exec_info"]["queue_remaining"]
                    .as_u64()
                    .unwrap_or(0),
            },
            (Some("execution_start"), Some(prompt_id)) => {
                ComfyMessage::ExecutionStart { prompt_id }
            }
            (Some("executing"), prompt_id) => ComfyMessage::Executing {
                prompt_id,
                node: data["node"].as_str().map(str::to_owned),
            },
            (Some("progress"), Some(prompt_id)) => ComfyMessage::Progress {
                prompt_id,
                value: data["value"].as_f64().unwrap_or(0.0),
                max: data["max"].as_f64().unwrap_or(0.0),
            },
            (Some("execution_success"), Some(prompt_id)) => {
                ComfyMessage::ExecutionSuccess { prompt_id }
            }
            (Some("execution_error"), Some(prompt_id)) => ComfyMessage::ExecutionError {
                prompt_id,
                node_type: data["node_type"].as_str().unwrap_or("").to_owned(),
                exception_message: data["exception_message"].as_str().unwrap_or("").to_owned(),
            },
            (Some("execution_interrupted"), Some(prompt_id)) => {
                ComfyMessage::ExecutionInterrupted { prompt_id }
            }
            _ => ComfyMessage::Other,
        }
    }

    /// The prompt this message is about, when it says.
    pub fn prompt_id(&self) -> Option<Uuid> {
        match self {
            ComfyMessage::ExecutionStart { prompt_id }
            | ComfyMessage::Progress { prompt_id, .. }
            | ComfyMessage::ExecutionSuccess { prompt_id }
            | ComfyMessage::ExecutionError { prompt_id, .. }
            | ComfyMessage::ExecutionInterrupted { prompt_id } => Some(*prompt_id),
            ComfyMessage::Executing { prompt_id, .. } => *prompt_id,
            ComfyMessage::Status { .. } | ComfyMessage::Other => None,
        }
    }
}

/// What became of a `POST /prompt`.
#[derive(Debug)]
pub enum PostOutcome {
    Accepted,
    /// A 400: the workflow is refused for good. The reason is for the user.
    Rejected(String),
    /// Refused connection, timeout, 5xx: the prompt may or may not be queued there; reconcile by
    /// its id before posting again.
    Unreachable(anyhow::Error),
}

/// An output file of a finished prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputImage {
    pub filename: String,
    pub subfolder: String,
    pub kind: String,
}

/// How a prompt ended, from its history entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HistoryOutcome {
    Success { images: Vec<OutputImage> },
    Error { node_type: String, message: String },
    Interrupted,
}

/// Where a prompt is on its server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptWhereabouts {
    Running,
    Pending,
    Finished(HistoryOutcome),
    /// In neither the queue nor the history: never accepted, deleted, or lost to a restart.
    Unknown,
}

/// A user-facing reason for a 400 of `POST /prompt`.
pub fn rejection_reason(body: &Value) -> String {
    let mut reasons = Vec::new();
    if let Some(nodes) = body["node_errors"].as_object() {
        for node in nodes.values() {
            for error in node["errors"].as_array().into_iter().flatten() {
                let input = error["extra_info"]["input_name"].as_str().unwrap_or("");
                let received = &error["extra_info"]["received_value"];
                let reason = match error["type"].as_str() {
                    Some("value_not_in_list") if input == "ckpt_name" => {
                        format!("the model {received} is not installed on the image server")
                    }
                    _ => error["details"]
                        .as_str()
                        .filter(|details| !details.is_empty())
                        .or_else(|| error["message"].as_str())
                        .unwrap_or("invalid value")
                        .to_owned(),
                };
                reasons.push(reason);
            }
        }
    }
    if reasons.is_empty() {
        reasons.push(
            body["error"]["message"]
                .as_str()
                .unwrap_or("unknown error")
                .to_owned(),
        );
    }
    format!(
        "the image server refused the workflow: {}",
        reasons.join("; ")
    )
}

/// The `ckpt_name` choices of an `/object_info` answer: `[[names...], {options}]` (ComfyUI up to
/// 0.3) or `["COMBO", {"options": [names...]}]` (the newer combo form).
pub fn checkpoints_of(object_info: &Value) -> anyhow::Result<Vec<String>> {
    let choices = &object_info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"];
    let names = match &choices[0] {
        Value::Array(names) => names,
        Value::String(kind) if kind == "COMBO" => choices[1]["options"]
            .as_array()
            .context("CheckpointLoaderSimple.ckpt_name: a COMBO without options")?,
        _ => anyhow::bail!("the server has no CheckpointLoaderSimple.ckpt_name choices"),
    };
    Ok(names
        .iter()
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect())
}

/// The HTTP side of one ComfyUI server.
#[derive(Debug, Clone)]
pub struct ComfyClient {
    base_url: String,
    http: reqwest::Client,
    /// Posts only: its connections are opened by the dispatch lane's posts and so driven by that
    /// lane's thread, never queued behind downloads on the shared runtime.
    post_http: reqwest::Client,
}

impl ComfyClient {
    /// `timeout` bounds every request (a hung server must not hang the saga).
    pub fn new(base_url: &str, timeout: Duration) -> anyhow::Result<ComfyClient> {
        let build = || {
            reqwest::Client::builder()
                .timeout(timeout)
                .connect_timeout(timeout)
                .build()
                .context("building the ComfyUI HTTP client")
        };
        Ok(ComfyClient {
            base_url: base_url.trim_end_matches('/').to_owned(),
            http: build()?,
            post_http: build()?,
        })
    }

    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// `ws://…/ws?clientId=<client_id>`.
    pub fn socket_url(&self, client_id: &str) -> String {
        let base = self
            .base_url
            .replacen("https://", "wss://", 1)
            .replacen("http://", "ws://", 1);
        format!("{base}/ws?clientId={client_id}")
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url)
    }

    /// Post a workflow under our own prompt id, routed to the socket `client_id`.
    pub async fn post_prompt(
        &self,
        prompt_id: Uuid,
        client_id: &str,
        workflow: &Value,
    ) -> PostOutcome {
        let body = json!({"prompt": workflow, "client_id": client_id, "prompt_id": prompt_id});
        let response = match self
            .post_http
            .post(self.url("/prompt"))
            .json(&body)
            .send()
            .await
        {
            Ok(response) => response,
            Err(error) => return PostOutcome::Unreachable(error.into()),
        };
        let status = response.status();
        let answer: Value = match response.json().await {
            Ok(answer) => answer,
            Err(error) if status.is_success() || status.as_u16() == 400 => {
                return PostOutcome::Unreachable(
                    anyhow::Error::new(error).context("reading the answer to POST /prompt"),
                );
            }
            Err(_) => Value::Null,
        };
        if status.as_u16() == 400 {
            return PostOutcome::Rejected(rejection_reason(&answer));
        }
        if !status.is_success() {
            return PostOutcome::Unreachable(anyhow::anyhow!("POST /prompt answered {status}"));
        }
        if answer["node_errors"]
            .as_object()
            .is_some_and(|errors| !errors.is_empty())
        {
            // Queued with only its valid outputs. Ours has one output, so this means a server
            // that validates differently; the run's outcome will tell.
            tracing::warn!(%prompt_id, node_errors = %answer["node_errors"], "prompt accepted with node errors");
        }
        PostOutcome::Accepted
    }

    async fn get_json(&self, path_and_query: &str) -> anyhow::Result<Value> {
        let response = self
            .http
            .get(self.url(path_and_query))
            .send()
            .await
            .with_context(|| format!("GET {path_and_query}"))?;
        let status = response.status();
        anyhow::ensure!(
            status.is_success(),
            "GET {path_and_query} answered {status}"
        );
        response
            .json()
            .await
            .with_context(|| format!("reading the answer to GET {path_and_query}"))
    }

    /// Prompt ids running and pending on the server.
    pub async fn queue(&self) -> anyhow::Result<(Vec<String>, Vec<String>)> {
        let answer = self.get_json("/queue").await?;
        let ids = |key: &str| -> Vec<String> {
            answer[key]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|item| item.get(1).and_then(Value::as_str).map(str::to_owned))
                .collect()
        };
        Ok((ids("queue_running"), ids("queue_pending")))
    }

    /// The history entry of a prompt, `None` while unknown, queued or running.
    pub async fn history(&self, prompt_id: Uuid) -> anyhow::Result<Option<HistoryOutcome>> {
        let answer = self.get_json(&format!("/history/{prompt_id}")).await?;
        let Some(entry) = answer.get(prompt_id.to_string()) else {
            return Ok(None);
        };
        Ok(Some(history_outcome(entry)))
    }

    /// Where the prompt is: `/queue` first, then `/history` (a prompt leaves the queue only once
    /// its history is written, so this order cannot miss one that finishes in between).
    pub async fn whereabouts(&self, prompt_id: Uuid) -> anyhow::Result<PromptWhereabouts> {
        let (running, pending) = self.queue().await?;
        let id = prompt_id.to_string();
        if running.contains(&id) {
            return Ok(PromptWhereabouts::Running);
        }
        if pending.contains(&id) {
            return Ok(PromptWhereabouts::Pending);
        }
        Ok(match self.history(prompt_id).await? {
            Some(outcome) => PromptWhereabouts::Finished(outcome),
            None => PromptWhereabouts::Unknown,
        })
    }

    /// Take a pending prompt out of the server's queue (no effect on a running one).
    pub async fn delete_pending(&self, prompt_id: Uuid) -> anyhow::Result<()> {
        self.post_empty("/queue", &json!({"delete": [prompt_id]}))
            .await
    }

    /// Interrupt the prompt if it is the one running (a no-op otherwise, by the server's rule).
    pub async fn interrupt(&self, prompt_id: Uuid) -> anyhow::Result<()> {
        self.post_empty("/interrupt", &json!({"prompt_id": prompt_id}))
            .await
    }

    async fn post_empty(&self, path: &str, body: &Value) -> anyhow::Result<()> {
        let response = self
            .http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .with_context(|| format!("POST {path}"))?;
        let status = response.status();
        anyhow::ensure!(status.is_success(), "POST {path} answered {status}");
        Ok(())
    }

    /// The checkpoints it offers: `CheckpointLoaderSimple`'s `ckpt_name` choices in
    /// `/object_info` (how SwarmUI lists a ComfyUI's models), one class only, not the whole
    /// catalogue of nodes.
    pub async fn checkpoints(&self) -> anyhow::Result<Vec<String>> {
        let answer = self.get_json("/object_info/CheckpointLoaderSimple").await?;
        checkpoints_of(&answer)
    }

    /// Liveness and version.
    pub async fn system_stats(&self) -> anyhow::Result<String> {
        let answer = self.get_json("/system_stats").await?;
        Ok(answer["system"]["comfyui_version"]
            .as_str()
            .unwrap_or("unknown")
            .to_owned())
    }

    /// Download one output file, at most `limit` bytes (counted while reading: a server that
    /// sends more is cut off, not buffered). The content type is the file's own (magic bytes),
    /// never the server's header: PNG, JPEG or WebP, anything else is refused.
    pub async fn view(
        &self,
        image: &OutputImage,
        limit: usize,
    ) -> anyhow::Result<(Vec<u8>, &'static str)> {
        let mut response = self
            .http
            .get(self.url("/view"))
            .query(&[
                ("filename", image.filename.as_str()),
                ("subfolder", image.subfolder.as_str()),
                ("type", image.kind.as_str()),
            ])
            .send()
            .await
            .context("GET /view")?;
        let status = response.status();
        anyhow::ensure!(
            status.is_success(),
            "GET /view of {} answered {status}",
            image.filename
        );
        if let Some(length) = response.content_length() {
            anyhow::ensure!(
                length <= limit as u64,
                "image {} is {length} bytes, over {limit}",
                image.filename
            );
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.context("reading an image")? {
            anyhow::ensure!(
                bytes.len() + chunk.len() <= limit,
                "image {} is over {limit} bytes",
                image.filename
            );
            bytes.extend_from_slice(&chunk);
        }
        let content_type = image_content_type(&bytes)
            .with_context(|| format!("image {} is not a PNG, JPEG or WebP file", image.filename))?;
        Ok((bytes, content_type))
    }
}

/// Check a finished prompt's outputs before anything is downloaded: at most the images the task
/// asked for (`expected`, when the workflow says), each under the task's own prefix (the folder
/// `zhihui`, a file name starting with the task id, no path separators): a server that names
/// other files is refused, never followed.
pub fn check_outputs(
    task_id: zhihui_domain::task::TaskId,
    outputs: &[OutputImage],
    expected: Option<usize>,
) -> Result<(), String> {
    if let Some(expected) = expected
        && outputs.len() > expected
    {
        return Err(format!(
            "the image server returned {} images where {expected} were asked for",
            outputs.len()
        ));
    }
    let prefix = crate::tasks::workflow::filename_prefix(task_id);
    let (folder, stem) = prefix.rsplit_once('/').unwrap_or(("", prefix.as_str()));
    for output in outputs {
        let plain =
            |text: &str| !text.contains('/') && !text.contains('\\') && !text.contains("..");
        if output.subfolder != folder
            || !output.filename.starts_with(&format!("{stem}_"))
            || !plain(&output.filename)
        {
            return Err("the image server named an output outside the task's own files".into());
        }
    }
    Ok(())
}

/// The images a rendered workflow asks for (its `batch_size`), when it says.
pub fn expected_images(workflow: &Value) -> Option<usize> {
    workflow
        .as_object()?
        .values()
        .find_map(|node| node["inputs"]["batch_size"].as_u64())
        .and_then(|count| usize::try_from(count).ok())
}

/// A history entry's outcome: interrupts and errors are both `status_str: "error"`; the messages
/// tell them apart.
pub fn history_outcome(entry: &Value) -> HistoryOutcome {
    let messages = entry["status"]["messages"].as_array();
    for message in messages.into_iter().flatten() {
        match message.get(0).and_then(Value::as_str) {
            Some("execution_interrupted") => return HistoryOutcome::Interrupted,
            Some("execution_error") => {
                let data = &message[1];
                return HistoryOutcome::Error {
                    node_type: data["node_type"].as_str().unwrap_or("").to_owned(),
                    message: data["exception_message"].as_str().unwrap_or("").to_owned(),
                };
            }
            _ => {}
        }
    }
    if entry["status"]["status_str"].as_str() == Some("error") {
        return HistoryOutcome::Error {
            node_type: String::new(),
            message: "the image server reported an error".into(),
        };
    }
    let mut images = Vec::new();
    if let Some(outputs) = entry["outputs"].as_object() {
        for output in outputs.values() {
            for image in output["images"].as_array().into_iter().flatten() {
                // Previews (`temp`) are not results, and vanish at a restart.
                let (Some(filename), Some(kind)) =
                    (image["filename"].as_str(), image["type"].as_str())
                else {
                    continue;
                };
                if kind != "output" {
                    continue;
                }
                images.push(OutputImage {
                    filename: filename.to_owned(),
                    subfolder: image["subfolder"].as_str().unwrap_or("").to_owned(),
                    kind: kind.to_owned(),
                });
            }
        }
    }
    HistoryOutcome::Success { images }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const PROMPT: &str = "9db1a8ee-86a3-4418-9128-426012dd7b9f";

    #[test]
    fn checkpoints_are_read_in_both_combo_forms() {
        let old = serde_json::json!({"CheckpointLoaderSimple": {"input": {"required": {
            "ckpt_name": [["a.safetensors", "b.ckpt"], {"tooltip": "The name"}]}}}});
        assert_eq!(
            checkpoints_of(&old).unwrap(),
            vec!["a.safetensors".to_owned(), "b.ckpt".to_owned()]
        );
        let new = serde_json::json!({"CheckpointLoaderSimple": {"input": {"required": {
            "ckpt_name": ["COMBO", {"options": ["c.safetensors"]}]}}}});
        assert_eq!(
            checkpoints_of(&new).unwrap(),
            vec!["c.safetensors".to_owned()]
        );
        assert!(checkpoints_of(&serde_json::json!({})).is_err());
    }

    #[test]
    fn outputs_must_be_the_tasks_own_and_no_more_than_asked() {
        let task = Uuid::parse_str(PROMPT).unwrap();
        let output = |subfolder: &str, filename: &str| OutputImage {
            filename: filename.into(),
            subfolder: subfolder.into(),
            kind: "output".into(),
        };
        let own = output("zhihui", &format!("{task}_00001_.png"));
        assert_eq!(
            check_outputs(task, std::slice::from_ref(&own), Some(1)),
            Ok(())
        );
        assert!(check_outputs(task, &[own.clone(), own.clone()], Some(1)).is_err());
        for hostile in [
            output("", &format!("{task}_00001_.png")),
            output("zhihui", "other_00001_.png"),
            output("zhihui/../../etc", &format!("{task}_00001_.png")),
            output("zhihui", &format!("{task}_/../../passwd")),
            output("zhihui", &format!("{task}_..\\x.png")),
        ] {
            let refused = check_outputs(task, std::slice::from_ref(&hostile), Some(4)).unwrap_err();
            assert!(!refused.contains("etc"), "{refused}");
        }
        let workflow = serde_json::json!({"5": {"class_type": "EmptyLatentImage", "inputs": {"batch_size": 3}}});
        assert_eq!(expected_images(&workflow), Some(3));
        assert_eq!(expected_images(&serde_json::json!({})), None);
    }

    #[test]
    fn recorded_frames_parse() {
        let id = Uuid::parse_str(PROMPT).unwrap();
        assert_eq!(
            ComfyMessage::parse(
                r#"{"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 1}}}}"#
            ),
            ComfyMessage::Status { queue_remaining: 1 }
        );
        assert_eq!(
            ComfyMessage::parse(&format!(
                r#"{{"type": "executing", "data": {{"node": null, "prompt_id": "{PROMPT}"}}}}"#
            )),
            ComfyMessage::Executing {
                prompt_id: Some(id),
                node: None
            }
        );
        // The reconnect frame has no prompt id.
        assert_eq!(
            ComfyMessage::parse(r#"{"type": "executing", "data": {"node": "3"}}"#),
            ComfyMessage::Executing {
                prompt_id: None,
                node: Some("3".into())
            }
        );
        assert_eq!(
            ComfyMessage::parse(&format!(
                r#"{{"type": "progress", "data": {{"value": 2, "max": 20, "prompt_id": "{PROMPT}", "node": "3"}}}}"#
            )),
            ComfyMessage::Progress {
                prompt_id: id,
                value: 2.0,
                max: 20.0
            }
        );
        assert_eq!(
            ComfyMessage::parse(r#"{"type": "progress_state", "data": {}}"#),
            ComfyMessage::Other
        );
        assert_eq!(ComfyMessage::parse("not json"), ComfyMessage::Other);
    }

    #[test]
    fn history_tells_success_error_and_interrupt_apart() {
        let success = json!({"outputs": {"9": {"images": [
            {"filename": "a_00001_.png", "subfolder": "zhihui/x", "type": "output"},
            {"filename": "p.png", "subfolder": "", "type": "temp"}]}},
            "status": {"status_str": "success", "completed": true, "messages": []}});
        assert_eq!(
            history_outcome(&success),
            HistoryOutcome::Success {
                images: vec![OutputImage {
                    filename: "a_00001_.png".into(),
                    subfolder: "zhihui/x".into(),
                    kind: "output".into()
                }]
            }
        );
        let interrupted = json!({"outputs": {}, "status": {"status_str": "error", "completed": false,
            "messages": [["execution_start", {}], ["execution_interrupted", {"prompt_id": PROMPT}]]}});
        assert_eq!(history_outcome(&interrupted), HistoryOutcome::Interrupted);
        let error = json!({"outputs": {}, "status": {"status_str": "error", "completed": false,
            "messages": [["execution_error", {"node_type": "KSampler", "exception_message": "out of memory"}]]}});
        assert_eq!(
            history_outcome(&error),
            HistoryOutcome::Error {
                node_type: "KSampler".into(),
                message: "out of memory".into()
            }
        );
    }

    #[test]
    fn a_missing_model_is_named_to_the_user() {
        let body = json!({"error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation"},
            "node_errors": {"4": {"errors": [{"type": "value_not_in_list", "message": "Value not in list",
            "details": "ckpt_name: 'x.safetensors' not in []", "extra_info": {"input_name": "ckpt_name", "received_value": "x.safetensors"}}],
            "class_type": "CheckpointLoaderSimple"}}});
        assert_eq!(
            rejection_reason(&body),
            "the image server refused the workflow: the model \"x.safetensors\" is not installed on the image server"
        );
    }
}
