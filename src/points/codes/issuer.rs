//! The batch generator: one leader across processes issues every unfinished batch page by page.
//!
//! Each page is one `CodesIssued` event appended on the batch's latest version and continuing
//! exactly where the last page ended (the decider refuses anything else), so a generator that
//! dies mid-batch is resumed by the next leader from the batch's stream without a repeated or a
//! skipped serial, and a stale generator racing a new one only loses appends. Work comes from
//! this process's own new batches at once ([`Wake`]) and from the `code_batches` read model
//! every `codes.issue_scan_interval_ms` (batches created elsewhere or left by a dead leader).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use tokio::sync::Notify;
use uuid::Uuid;
use zhihui_domain::redeem::BatchId;

use crate::platform::event_store::EventMetadata;
use crate::points::codes::CodeService;

/// Name of the leader lock.
const LEADER_NAME: &str = "code-issuer";
/// The actor of the generator's events.
pub const ISSUER_ACTOR: &str = "system:code-issuer";

/// Batches created in this process, waiting for its generator.
#[derive(Debug, Clone, Default)]
pub struct Wake {
    pending: Arc<Mutex<BTreeSet<BatchId>>>,
    notify: Arc<Notify>,
}

impl Wake {
    pub fn push(&self, batch_id: BatchId) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(batch_id);
        self.notify.notify_one();
    }

    fn take(&self) -> Vec<BatchId> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()))
            .into_iter()
            .collect()
    }
}

#[derive(Debug, Clone)]
pub struct CodeIssuer {
    codes: CodeService,
}

impl CodeIssuer {
    pub fn new(codes: CodeService) -> CodeIssuer {
        CodeIssuer { codes }
    }

    fn metadata() -> EventMetadata {
        EventMetadata {
            correlation_id: Uuid::now_v7(),
            causation_id: None,
            actor: ISSUER_ACTOR.into(),
        }
    }

    /// Issue up to `pages_max` pages of one batch (all that is left when `None`). Returns the
    /// pages issued.
    pub async fn issue_batch(
        &self,
        batch_id: BatchId,
        pages_max: Option<u32>,
    ) -> anyhow::Result<u32> {
        let metadata = Self::metadata();
        let mut pages = 0;
        while pages_max.is_none_or(|max| pages < max) {
            match self.codes.issue_page(batch_id, &metadata).await? {
                Some(batch) => {
                    pages += 1;
                    if batch.is_complete() {
                        tracing::info!(%batch_id, codes = batch.issued, "code batch issued");
                        break;
                    }
                }
                None => break,
            }
        }
        Ok(pages)
    }

    /// Every unfinished batch the read model knows, plus this process's new ones, issued to the
    /// end. Returns the pages issued.
    pub async fn issue_pending_once(&self) -> anyhow::Result<u32> {
        let mut batches: BTreeSet<BatchId> = self.codes.created.take().into_iter().collect();
        let client = self
            .codes
            .pool()
            .get()
            .await
            .context("getting a connection")?;
        for row in client
            .query(
                "SELECT batch_id FROM code_batches WHERE issued < count AND revoked_at IS NULL
                  ORDER BY created_at",
                &[],
            )
            .await
            .context("reading unfinished batches")?
        {
            batches.insert(row.get(0));
        }
        drop(client);
        let mut pages = 0;
        for batch_id in batches {
            pages += self.issue_batch(batch_id, None).await?;
        }
        Ok(pages)
    }

    /// Run forever: lead when no other process does.
    pub async fn run(self) {
        let interval = Duration::from_millis(self.codes.settings().issue_scan_interval_ms);
        loop {
            match crate::platform::leader::try_lead(self.codes.pool(), LEADER_NAME).await {
                Ok(Some(lock)) => {
                    if let Err(error) = self.lead(&lock, interval).await {
                        tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "code issuer stopped leading");
                    }
                    crate::platform::leader::resign(lock);
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "code issuer could not try the lock");
                }
            }
            // Not leading: new batches of this process stay pending for whoever leads (they
            // reach the leader through the read model).
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = self.codes.created.notify.notified() => {}
            }
        }
    }

    async fn lead(
        &self,
        lock: &crate::platform::leader::LeaderLock,
        interval: Duration,
    ) -> anyhow::Result<()> {
        loop {
            crate::platform::leader::still_leading(lock).await?;
            if let Err(error) = self.issue_pending_once().await {
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "code issuer pass failed");
            }
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = self.codes.created.notify.notified() => {}
            }
        }
    }
}
