//! The pool of ComfyUI servers, as events: which servers exist, which are draining, and which
//! models each offers.
//!
//! One stream, `backend-pool` ([`BackendPool`]). Every process folds it, so every process agrees
//! on the pool: the leader routes by it, a new leader starts from it, and any process refuses a
//! submit for a model no server offers from it. The configuration seeds it at the first start
//! only (a [`PoolCommand::Seed`] on an empty stream); after that an admin changes it at run time.
//!
//! Whether a server is up, and what it runs now, is not here: that changes by the second and is
//! the leader's to see. The stream holds what an operator decided and what a server said it has.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::decider::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};

pub const POOL_STREAM: &str = "backend-pool";

/// Prompts in flight on one server, at most: one runs, the others wait in its own queue, where
/// they can no longer be prioritised or cancelled cheaply.
pub const BACKEND_CAPACITY_MAX: u32 = 8;
/// A server's name is a Redis key part and a metric label: short.
pub const BACKEND_NAME_LENGTH_MAX: usize = 32;
/// Servers in one pool: bounds the filler's keys and every listing.
pub const BACKENDS_MAX: usize = 64;
/// Models one server may offer (the rest of a longer list is not routed to).
pub const MODELS_PER_BACKEND_MAX: usize = 256;
/// A URL's length, at most.
pub const BACKEND_URL_LENGTH_MAX: usize = 512;

/// A server as the pool knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolBackend {
    pub name: String,
    pub url: String,
    pub capacity: u32,
    /// No new prompt goes there; what runs there finishes.
    pub draining: bool,
    /// The checkpoints it offers, as it last said (`None`: not read yet).
    pub models: Option<Vec<String>>,
    /// Its ComfyUI version, as it last said.
    pub version: Option<String>,
    pub added_at: DateTime<Utc>,
}

impl PoolBackend {
    /// Whether a task for `model` may go there: it said it offers it, or it has not said yet.
    pub fn may_offer(&self, model: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|models| models.iter().any(|offered| offered == model))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolState {
    /// In the order they were added.
    pub backends: Vec<PoolBackend>,
    /// Any event was recorded (the configuration seeds an empty stream only).
    pub seeded: bool,
    /// Events folded: which version of the pool this is (a later one has more).
    pub events: u64,
}

impl PoolState {
    pub fn backend(&self, name: &str) -> Option<&PoolBackend> {
        self.backends.iter().find(|backend| backend.name == name)
    }

    fn backend_mut(&mut self, name: &str) -> Option<&mut PoolBackend> {
        self.backends
            .iter_mut()
            .find(|backend| backend.name == name)
    }

    /// Whether some server of the pool offers `model` (or has not said what it offers yet, so it
    /// might): a submit for a model no server may offer is refused. An empty pool refuses
    /// nothing: it is not set up yet (or every server is out for maintenance), and tasks wait in
    /// the queue for servers, as they always did.
    pub fn may_run(&self, model: &str) -> bool {
        self.backends.is_empty() || self.backends.iter().any(|backend| backend.may_offer(model))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendAdded {
    pub name: String,
    pub url: String,
    pub capacity: u32,
    pub at: DateTime<Utc>,
}

/// A server's address or capacity changed in place (the configuration applied on purpose).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendReconfigured {
    pub name: String,
    pub url: String,
    pub capacity: u32,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendNamed {
    pub name: String,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendInspected {
    pub name: String,
    pub models: Vec<String>,
    pub version: String,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolEvent {
    Added(BackendAdded),
    Drained(BackendNamed),
    Resumed(BackendNamed),
    Removed(BackendNamed),
    Inspected(BackendInspected),
    Reconfigured(BackendReconfigured),
}

/// The event types of the pool stream (the leader subscribes to them).
pub const POOL_EVENT_TYPES: [&str; 6] = [
    "BackendAdded",
    "BackendDrained",
    "BackendResumed",
    "BackendRemoved",
    "BackendInspected",
    "BackendReconfigured",
];

/// A server to add, checked: [`NewBackend::parse`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewBackend {
    name: String,
    url: String,
    capacity: u32,
}

impl NewBackend {
    pub fn parse(name: &str, url: &str, capacity: u32) -> Result<NewBackend, PoolError> {
        let name_ok = !name.is_empty()
            && name.len() <= BACKEND_NAME_LENGTH_MAX
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !name_ok {
            return Err(PoolError::InvalidName(name.to_owned()));
        }
        let url = url.trim_end_matches('/');
        let host = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("https://"));
        let url_ok = host.is_some_and(|host| !host.is_empty())
            && url.len() <= BACKEND_URL_LENGTH_MAX
            && url.chars().all(|c| c.is_ascii_graphic());
        if !url_ok {
            return Err(PoolError::InvalidUrl(url.to_owned()));
        }
        if !(1..=BACKEND_CAPACITY_MAX).contains(&capacity) {
            return Err(PoolError::InvalidCapacity(capacity));
        }
        Ok(NewBackend {
            name: name.to_owned(),
            url: url.to_owned(),
            capacity,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolCommand {
    /// The configuration's servers, recorded only if the stream has no event yet.
    Seed {
        backends: Vec<NewBackend>,
        at: DateTime<Utc>,
    },
    Add {
        backend: NewBackend,
        at: DateTime<Utc>,
    },
    Drain {
        name: String,
        at: DateTime<Utc>,
    },
    Resume {
        name: String,
        at: DateTime<Utc>,
    },
    /// `prompts_in_flight`: what runs there now, as the slot leases say (the application reads
    /// them; a server is removed only when nothing runs there).
    Remove {
        name: String,
        prompts_in_flight: u32,
        at: DateTime<Utc>,
    },
    /// Give a server another address or capacity (the configuration applied on purpose):
    /// refused while prompts run there, like a removal, since the leader follows it as a new
    /// server.
    Reconfigure {
        backend: NewBackend,
        prompts_in_flight: u32,
        at: DateTime<Utc>,
    },
    /// What the server said it offers (`/object_info`) and its version (`/system_stats`).
    Inspect {
        name: String,
        models: Vec<String>,
        version: String,
        at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error(
        "name {0:?}: a server's name is 1 to {BACKEND_NAME_LENGTH_MAX} letters, digits, - and _"
    )]
    InvalidName(String),
    #[error("url {0:?} is not an http(s) URL of at most {BACKEND_URL_LENGTH_MAX} characters")]
    InvalidUrl(String),
    #[error("capacity {0} is not 1 to {BACKEND_CAPACITY_MAX}")]
    InvalidCapacity(u32),
    #[error("a server named {0} is already in the pool")]
    NameTaken(String),
    #[error("the pool has {BACKENDS_MAX} servers, its most")]
    PoolFull,
    #[error("no server named {0} in the pool")]
    NotFound(String),
    #[error(
        "server {name} has {prompts_in_flight} prompt(s) in flight: drain it and wait until they end"
    )]
    Busy {
        name: String,
        prompts_in_flight: u32,
    },
}

/// How the configuration's servers differ from the recorded pool. The configuration seeds the
/// pool once; after that the stream is the truth and a changed configuration is only reported,
/// until an operator applies it on purpose (`zhihui backends apply-config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolDifference {
    /// Configured, not in the pool: applying adds it.
    NotInPool(NewBackend),
    /// In the pool, not configured: applying removes it (refused while prompts run there).
    NotConfigured { name: String },
    /// Both have it, with another address or capacity: applying reconfigures it (refused while
    /// prompts run there).
    Differs {
        name: String,
        pool_url: String,
        pool_capacity: u32,
        configured: NewBackend,
    },
}

impl PoolDifference {
    /// The command that applies this one difference.
    pub fn command(&self) -> String {
        match self {
            PoolDifference::NotInPool(backend) => format!(
                "zhihui backends add {} {} --capacity {}",
                backend.name, backend.url, backend.capacity
            ),
            PoolDifference::NotConfigured { name } => format!("zhihui backends remove {name}"),
            PoolDifference::Differs {
                name, configured, ..
            } => format!(
                "zhihui backends reconfigure {name} {} --capacity {}",
                configured.url, configured.capacity
            ),
        }
    }
}

impl std::fmt::Display for PoolDifference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PoolDifference::NotInPool(backend) => write!(
                f,
                "{} ({}, capacity {}) is configured but not in the pool",
                backend.name, backend.url, backend.capacity
            ),
            PoolDifference::NotConfigured { name } => {
                write!(f, "{name} is in the pool but not configured")
            }
            PoolDifference::Differs {
                name,
                pool_url,
                pool_capacity,
                configured,
            } => write!(
                f,
                "{name} is {pool_url} with capacity {pool_capacity} in the pool, {} with capacity {} in the configuration",
                configured.url, configured.capacity
            ),
        }
    }
}

/// Every difference between the configured servers and `state`, configured ones first in their
/// order, then the pool's extra ones in theirs. Draining is not configuration: not compared.
pub fn differences(state: &PoolState, configured: &[NewBackend]) -> Vec<PoolDifference> {
    let mut found = Vec::new();
    for backend in configured {
        match state.backend(&backend.name) {
            None => found.push(PoolDifference::NotInPool(backend.clone())),
            Some(recorded)
                if recorded.url != backend.url || recorded.capacity != backend.capacity =>
            {
                found.push(PoolDifference::Differs {
                    name: backend.name.clone(),
                    pool_url: recorded.url.clone(),
                    pool_capacity: recorded.capacity,
                    configured: backend.clone(),
                });
            }
            Some(_) => {}
        }
    }
    for recorded in &state.backends {
        if !configured
            .iter()
            .any(|backend| backend.name == recorded.name)
        {
            found.push(PoolDifference::NotConfigured {
                name: recorded.name.clone(),
            });
        }
    }
    found
}

#[derive(Debug)]
pub struct BackendPool;

impl Decider for BackendPool {
    type State = PoolState;
    type Command = PoolCommand;
    type Event = PoolEvent;
    type Error = PoolError;

    fn initial_state() -> PoolState {
        PoolState::default()
    }

    fn decide(state: &PoolState, command: &PoolCommand) -> Result<Vec<PoolEvent>, PoolError> {
        match command {
            PoolCommand::Seed { backends, at } => {
                if state.seeded {
                    return Ok(vec![]);
                }
                if backends.len() > BACKENDS_MAX {
                    return Err(PoolError::PoolFull);
                }
                let mut events: Vec<PoolEvent> = Vec::new();
                for backend in backends {
                    let taken = events.iter().any(
                        |event| matches!(event, PoolEvent::Added(added) if added.name == backend.name),
                    );
                    if taken {
                        return Err(PoolError::NameTaken(backend.name.clone()));
                    }
                    events.push(added(backend, *at));
                }
                Ok(events)
            }
            PoolCommand::Add { backend, at } => {
                if let Some(existing) = state.backend(&backend.name) {
                    // The same server added again (a retried request) is done already.
                    if existing.url == backend.url && existing.capacity == backend.capacity {
                        return Ok(vec![]);
                    }
                    return Err(PoolError::NameTaken(backend.name.clone()));
                }
                if state.backends.len() >= BACKENDS_MAX {
                    return Err(PoolError::PoolFull);
                }
                Ok(vec![added(backend, *at)])
            }
            PoolCommand::Drain { name, at } => {
                let backend = found(state, name)?;
                if backend.draining {
                    return Ok(vec![]);
                }
                Ok(vec![PoolEvent::Drained(named(name, *at))])
            }
            PoolCommand::Resume { name, at } => {
                let backend = found(state, name)?;
                if !backend.draining {
                    return Ok(vec![]);
                }
                Ok(vec![PoolEvent::Resumed(named(name, *at))])
            }
            PoolCommand::Remove {
                name,
                prompts_in_flight,
                at,
            } => {
                found(state, name)?;
                if *prompts_in_flight > 0 {
                    return Err(PoolError::Busy {
                        name: name.clone(),
                        prompts_in_flight: *prompts_in_flight,
                    });
                }
                Ok(vec![PoolEvent::Removed(named(name, *at))])
            }
            PoolCommand::Reconfigure {
                backend,
                prompts_in_flight,
                at,
            } => {
                let existing = found(state, &backend.name)?;
                if existing.url == backend.url && existing.capacity == backend.capacity {
                    return Ok(vec![]);
                }
                if *prompts_in_flight > 0 {
                    return Err(PoolError::Busy {
                        name: backend.name.clone(),
                        prompts_in_flight: *prompts_in_flight,
                    });
                }
                Ok(vec![PoolEvent::Reconfigured(BackendReconfigured {
                    name: backend.name.clone(),
                    url: backend.url.clone(),
                    capacity: backend.capacity,
                    at: *at,
                })])
            }
            PoolCommand::Inspect {
                name,
                models,
                version,
                at,
            } => {
                let backend = found(state, name)?;
                let mut models = models.clone();
                models.sort();
                models.dedup();
                models.truncate(MODELS_PER_BACKEND_MAX);
                if backend.models.as_ref() == Some(&models)
                    && backend.version.as_ref() == Some(version)
                {
                    return Ok(vec![]);
                }
                Ok(vec![PoolEvent::Inspected(BackendInspected {
                    name: name.clone(),
                    models,
                    version: version.clone(),
                    at: *at,
                })])
            }
        }
    }

    fn evolve(mut state: PoolState, event: &PoolEvent) -> PoolState {
        state.seeded = true;
        state.events += 1;
        match event {
            PoolEvent::Added(e) => {
                state.backends.retain(|backend| backend.name != e.name);
                state.backends.push(PoolBackend {
                    name: e.name.clone(),
                    url: e.url.clone(),
                    capacity: e.capacity,
                    draining: false,
                    models: None,
                    version: None,
                    added_at: e.at,
                });
            }
            PoolEvent::Drained(e) => {
                if let Some(backend) = state.backend_mut(&e.name) {
                    backend.draining = true;
                }
            }
            PoolEvent::Resumed(e) => {
                if let Some(backend) = state.backend_mut(&e.name) {
                    backend.draining = false;
                }
            }
            PoolEvent::Removed(e) => state.backends.retain(|backend| backend.name != e.name),
            PoolEvent::Inspected(e) => {
                if let Some(backend) = state.backend_mut(&e.name) {
                    backend.models = Some(e.models.clone());
                    backend.version = Some(e.version.clone());
                }
            }
            PoolEvent::Reconfigured(e) => {
                if let Some(backend) = state.backend_mut(&e.name) {
                    if backend.url != e.url {
                        // Another address may be another server: what it offers is unknown
                        // until it is inspected again.
                        backend.models = None;
                        backend.version = None;
                    }
                    backend.url.clone_from(&e.url);
                    backend.capacity = e.capacity;
                }
            }
        }
        state
    }
}

fn found<'a>(state: &'a PoolState, name: &str) -> Result<&'a PoolBackend, PoolError> {
    state
        .backend(name)
        .ok_or_else(|| PoolError::NotFound(name.to_owned()))
}

fn added(backend: &NewBackend, at: DateTime<Utc>) -> PoolEvent {
    PoolEvent::Added(BackendAdded {
        name: backend.name.clone(),
        url: backend.url.clone(),
        capacity: backend.capacity,
        at,
    })
}

fn named(name: &str, at: DateTime<Utc>) -> BackendNamed {
    BackendNamed {
        name: name.to_owned(),
        at,
    }
}

impl DomainEvent for PoolEvent {
    fn event_type(&self) -> &'static str {
        match self {
            PoolEvent::Added(_) => "BackendAdded",
            PoolEvent::Drained(_) => "BackendDrained",
            PoolEvent::Resumed(_) => "BackendResumed",
            PoolEvent::Removed(_) => "BackendRemoved",
            PoolEvent::Inspected(_) => "BackendInspected",
            PoolEvent::Reconfigured(_) => "BackendReconfigured",
        }
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        match self {
            PoolEvent::Added(e) => payload_of(e),
            PoolEvent::Drained(e) | PoolEvent::Resumed(e) | PoolEvent::Removed(e) => payload_of(e),
            PoolEvent::Inspected(e) => payload_of(e),
            PoolEvent::Reconfigured(e) => payload_of(e),
        }
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<PoolEvent, DecodeError> {
        expect_version(event_type, schema_version, 1)?;
        match event_type {
            "BackendAdded" => Ok(PoolEvent::Added(parse_payload(event_type, payload)?)),
            "BackendDrained" => Ok(PoolEvent::Drained(parse_payload(event_type, payload)?)),
            "BackendResumed" => Ok(PoolEvent::Resumed(parse_payload(event_type, payload)?)),
            "BackendRemoved" => Ok(PoolEvent::Removed(parse_payload(event_type, payload)?)),
            "BackendInspected" => Ok(PoolEvent::Inspected(parse_payload(event_type, payload)?)),
            "BackendReconfigured" => {
                Ok(PoolEvent::Reconfigured(parse_payload(event_type, payload)?))
            }
            other => Err(DecodeError::UnknownType {
                event_type: other.to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests;
