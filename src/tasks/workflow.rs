//! Rendering of the text-to-image workflow (`workflows/t2i.json.j2`) with minijinja, and the
//! check of what came out.
//!
//! The template is auto-escaped as JSON (its name ends in `.json.j2`), so every user value is
//! written as a JSON value and cannot leave its string. The rendered text is still parsed and
//! checked before it is used: the nodes are exactly the template's (rendered once with neutral
//! values at start), every link points to an existing node, and the one `SaveImage` writes under
//! the task's own prefix. A failed check is a bug in the template, never the user's fault.

use std::collections::BTreeSet;

use anyhow::Context;
use minijinja::{Environment, UndefinedBehavior, context};
use serde_json::Value;
use zhihui_domain::task::{TaskId, TaskSpec};

const TEMPLATE_NAME: &str = "t2i.json.j2";
const TEMPLATE: &str = include_str!("../../workflows/t2i.json.j2");

/// What went wrong with a rendered workflow.
#[derive(Debug, thiserror::Error)]
pub enum WorkflowError {
    #[error("rendering the workflow template failed: {0}")]
    Render(#[from] minijinja::Error),
    #[error("the rendered workflow is not JSON: {0}")]
    NotJson(#[from] serde_json::Error),
    #[error("the rendered workflow breaks a rule: {0}")]
    Invalid(String),
}

/// The folder prefix of a task's images on the ComfyUI server.
pub fn filename_prefix(task_id: TaskId) -> String {
    format!("zhihui/{task_id}")
}

#[derive(Debug)]
pub struct Workflows {
    environment: Environment<'static>,
    /// Node ids of the template, from a render with neutral values.
    node_ids: BTreeSet<String>,
}

impl Workflows {
    pub fn new() -> anyhow::Result<Workflows> {
        let mut environment = Environment::new();
        environment.set_undefined_behavior(UndefinedBehavior::Strict);
        environment
            .add_template(TEMPLATE_NAME, TEMPLATE)
            .context("compiling workflows/t2i.json.j2")?;
        let mut workflows = Workflows {
            environment,
            node_ids: BTreeSet::new(),
        };
        let neutral = TaskSpec {
            model: "model".into(),
            width: 512,
            height: 512,
            steps: 1,
            cfg: rust_decimal::Decimal::ONE,
            sampler: "euler".into(),
            scheduler: "normal".into(),
            seed: 0,
            images: 1,
        };
        let text = workflows.render_text(TaskId::nil(), &neutral, "p", "n")?;
        let graph: Value = serde_json::from_str(&text).context("the template renders no JSON")?;
        workflows.node_ids = graph
            .as_object()
            .context("the template renders no JSON object")?
            .keys()
            .cloned()
            .collect();
        // The neutral render must pass its own check.
        workflows
            .check(&graph, TaskId::nil())
            .context("the template fails its own check")?;
        Ok(workflows)
    }

    fn render_text(
        &self,
        task_id: TaskId,
        spec: &TaskSpec,
        prompt: &str,
        negative_prompt: &str,
    ) -> Result<String, WorkflowError> {
        use rust_decimal::prelude::ToPrimitive;
        let template = self.environment.get_template(TEMPLATE_NAME)?;
        Ok(template.render(context! {
            model => spec.model.as_str(),
            width => spec.width,
            height => spec.height,
            images => spec.images,
            steps => spec.steps,
            // ComfyUI takes a float; the decimal has at most one place, so this is exact enough.
            cfg => spec.cfg.to_f64().unwrap_or(0.0),
            sampler => spec.sampler.as_str(),
            scheduler => spec.scheduler.as_str(),
            seed => spec.seed,
            prompt => prompt,
            negative_prompt => negative_prompt,
            filename_prefix => filename_prefix(task_id),
        })?)
    }

    /// Render the workflow of a task and check it.
    pub fn render(
        &self,
        task_id: TaskId,
        spec: &TaskSpec,
        prompt: &str,
        negative_prompt: &str,
    ) -> Result<Value, WorkflowError> {
        let text = self.render_text(task_id, spec, prompt, negative_prompt)?;
        let graph: Value = serde_json::from_str(&text)?;
        self.check(&graph, task_id)?;
        Ok(graph)
    }

    /// The rules every rendered workflow keeps (see the module comment).
    pub fn check(&self, graph: &Value, task_id: TaskId) -> Result<(), WorkflowError> {
        let invalid = |message: String| WorkflowError::Invalid(message);
        let nodes = graph
            .as_object()
            .ok_or_else(|| invalid("not a JSON object of nodes".into()))?;
        let ids: BTreeSet<String> = nodes.keys().cloned().collect();
        if !self.node_ids.is_empty() && ids != self.node_ids {
            return Err(invalid(format!(
                "nodes {ids:?} are not the template's {:?}",
                self.node_ids
            )));
        }
        let mut save_images = 0;
        for (id, node) in nodes {
            let class_type = node
                .get("class_type")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(format!("node {id} has no class_type")))?;
            let inputs = node
                .get("inputs")
                .and_then(Value::as_object)
                .ok_or_else(|| invalid(format!("node {id} has no inputs object")))?;
            for (name, value) in inputs {
                if let Some([Value::String(target), Value::Number(_)]) =
                    value.as_array().map(Vec::as_slice)
                    && !nodes.contains_key(target)
                {
                    return Err(invalid(format!(
                        "input {name} of node {id} links to node {target}, which does not exist"
                    )));
                }
            }
            if class_type == "SaveImage" {
                save_images += 1;
                let prefix = inputs.get("filename_prefix").and_then(Value::as_str);
                if prefix != Some(filename_prefix(task_id).as_str()) {
                    return Err(invalid(format!(
                        "SaveImage node {id} writes under {prefix:?}, not the task's prefix"
                    )));
                }
            }
        }
        if save_images != 1 {
            return Err(invalid(format!(
                "{save_images} SaveImage nodes, exactly one expected"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn spec() -> TaskSpec {
        TaskSpec {
            model: "majicmixRealistic_v7.safetensors".into(),
            width: 512,
            height: 768,
            steps: 20,
            cfg: rust_decimal::Decimal::new(75, 1),
            sampler: "dpmpp_2m".into(),
            scheduler: "karras".into(),
            seed: 9_007_199_254_740_991,
            images: 2,
        }
    }

    #[test]
    fn a_hostile_prompt_stays_inside_its_string() {
        let workflows = Workflows::new().unwrap();
        let task_id = TaskId::from_u128(5);
        let hostile = "a cat\", \"x\": 1}, \"99\": {\"class_type\": \"SaveImage\", \"inputs\": {}}, \"0\": {\"a\\\\\n\ttab \u{2028} {{ seed }} {% raw %}";
        let plain = workflows.render(task_id, &spec(), "a cat", "bad").unwrap();
        let graph = workflows
            .render(task_id, &spec(), hostile, hostile)
            .unwrap();
        // The same nodes as with a plain prompt; the text arrives intact inside its string.
        let keys = |graph: &Value| {
            graph
                .as_object()
                .unwrap()
                .keys()
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(keys(&graph), keys(&plain));
        assert_eq!(graph["6"]["inputs"]["text"], hostile);
        assert_eq!(graph["7"]["inputs"]["text"], hostile);
        assert!(graph.get("99").is_none());
        assert_eq!(graph["3"]["inputs"]["seed"], 9_007_199_254_740_991u64);
        assert_eq!(graph["3"]["inputs"]["cfg"], 7.5);
        assert_eq!(graph["5"]["inputs"]["batch_size"], 2);
        assert_eq!(
            graph["9"]["inputs"]["filename_prefix"],
            format!("zhihui/{task_id}")
        );
    }

    #[test]
    fn the_check_refuses_dangling_links_extra_nodes_and_foreign_prefixes() {
        let workflows = Workflows::new().unwrap();
        let task_id = TaskId::from_u128(5);
        let good = workflows.render(task_id, &spec(), "a", "b").unwrap();

        let mut dangling = good.clone();
        dangling["8"]["inputs"]["samples"] = serde_json::json!(["42", 0]);
        assert!(workflows.check(&dangling, task_id).is_err());

        let mut extra = good.clone();
        extra["99"] = serde_json::json!({"class_type": "SaveImage", "inputs": {}});
        assert!(workflows.check(&extra, task_id).is_err());

        assert!(workflows.check(&good, TaskId::from_u128(6)).is_err());
        assert!(workflows.check(&good, task_id).is_ok());
    }
}
