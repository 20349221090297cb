//! Text-to-image tasks: the catalog check of a submit (`catalog`), translation through Ollama
//! (`translate`), the ComfyUI workflow template (`workflow`), the Redis queue (`queue`), the
//! service that ties them to the account and task streams (`service`) and the grouped deletes of
//! its intents (`intent_ends`).

pub mod catalog;
pub mod estimate;
pub mod intent_ends;
pub mod pool;
pub mod positions;
pub mod queue;
pub mod service;
pub mod translate;
pub mod view;
pub mod workflow;
