//! Text-to-image tasks: the catalog check of a submit (`catalog`), translation through Ollama
//! (`translate`), the ComfyUI workflow template (`workflow`), the Redis queue (`queue`) and the
//! service that ties them to the account and task streams (`service`).

pub mod catalog;
pub mod queue;
pub mod service;
pub mod translate;
pub mod workflow;
