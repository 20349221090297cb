//! Live delivery: what a commit announces (`Wake`), this process's subscriptions fed window by
//! window and woken by it, and the LISTEN connection that hears the other processes' commits and
//! sends this process's notifications (`listen`, `Announcer`).

use super::*;

/// The NOTIFY channel `zhihui_append` signals on commit.
pub const NOTIFY_CHANNEL: &str = "zhihui_events";

/// Wake-ups kept for a subscription that is busy reading: one that falls further behind wakes
/// for everything once (it reads anyway), so the bound costs a read, never an event.
pub(super) const WAKE_BACKLOG_MAX: usize = 1_024;

/// What a notification says was appended, for subscriptions to decide whether to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// Events of this type, in a stream whose name starts with `category` (the name up to its
    /// first `-`, inclusive; a name without `-` gets one added: `revenue` -> `revenue-`).
    Appended {
        category: String,
        event_type: String,
    },
    /// Anything may have been appended: a notification without a payload we know (an instance
    /// of an older version), or a (re)connect of the LISTEN connection.
    Anything,
}

impl Wake {
    /// Parse a notification's payload (`'<category> <event type>'`). Split at the last space:
    /// an event type is an identifier, while the category comes from a stream id, which the
    /// store does not forbid to hold a space.
    pub fn from_payload(payload: &str) -> Wake {
        match payload.rsplit_once(' ') {
            Some((category, event_type)) if !category.is_empty() && !event_type.is_empty() => {
                Wake::Appended {
                    category: category.to_owned(),
                    event_type: event_type.to_owned(),
                }
            }
            _ => Wake::Anything,
        }
    }

    /// Whether events this wake-up announces may pass `filter` (never `false` for one that does).
    pub fn may_concern(&self, filter: &EventFilter) -> bool {
        let Wake::Appended {
            category,
            event_type,
        } = self
        else {
            return true;
        };
        match filter {
            EventFilter::All => true,
            EventFilter::EventTypes(types) => types.iter().any(|wanted| wanted == event_type),
            // The stream's name starts with `category` (or is `category` without its last
            // '-'); a prefix may match it when either starts with the other ("user-" and
            // "user-name-"), or when the prefix is that name or part of it ("revenue").
            EventFilter::StreamPrefixes(prefixes) => prefixes.iter().any(|prefix| {
                prefix.starts_with(category.as_str()) || category.starts_with(prefix.as_str())
            }),
        }
    }
}

/// Feed one subscription until its consumer goes away.
pub(super) async fn run_subscription(
    store: PostgresEventStore,
    mut checkpoint: Option<Position>,
    filter: EventFilter,
    sender: mpsc::Sender<Result<SubscriptionMessage, EventStoreError>>,
) {
    const HELD_BACK_RECHECK_MIN_MS: u64 = 1;
    const READ_ERROR_BACKOFF_MAX_MS: u64 = 2_000;
    let batch_size = store.inner.options.subscription_batch_size;
    let held_back_max = store
        .inner
        .options
        .held_back_recheck_max_ms
        .max(HELD_BACK_RECHECK_MIN_MS);
    let idle_recheck = Duration::from_millis(store.inner.options.subscription_idle_recheck_ms);
    let mut wakes = store.inner.wakes.subscribe();
    let mut caught_up_sent = false;
    let mut held_back_backoff_ms = HELD_BACK_RECHECK_MIN_MS;
    let mut error_backoff_ms = 10;
    loop {
        // Take the wake-ups so far BEFORE reading (the read sees what they announce): one that
        // arrives during the read stays queued and is looked at after it, so no commit can slip
        // between read and wait.
        loop {
            match wakes.try_recv() {
                Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) => {}
                Err(broadcast::error::TryRecvError::Empty) => break,
                Err(broadcast::error::TryRecvError::Closed) => return,
            }
        }
        let (slice, held_back) = match store
            .read_for_subscription(checkpoint, batch_size, &filter)
            .await
        {
            Ok(read) => {
                error_backoff_ms = 10;
                read
            }
            Err(error) => {
                tracing::warn!(%error, retry_in_ms = error_backoff_ms, "subscription read failed");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(error_backoff_ms)) => {}
                    () = sender.closed() => return,
                }
                error_backoff_ms = (error_backoff_ms * 2).min(READ_ERROR_BACKOFF_MAX_MS);
                continue;
            }
        };
        let delivered_up_to = slice.events.last().map(|event| event.position);
        for event in slice.events {
            if sender
                .send(Ok(SubscriptionMessage::Event(Box::new(event))))
                .await
                .is_err()
            {
                return;
            }
        }
        if let Some(scanned_to) = slice.scanned_to {
            debug_assert!(checkpoint.is_none_or(|previous| scanned_to > previous));
            checkpoint = Some(scanned_to);
            if delivered_up_to != Some(scanned_to)
                && sender
                    .send(Ok(SubscriptionMessage::Checkpoint(scanned_to)))
                    .await
                    .is_err()
            {
                return;
            }
        }
        if !slice.end_of_log {
            continue;
        }
        if !caught_up_sent {
            caught_up_sent = true;
            if sender
                .send(Ok(SubscriptionMessage::CaughtUp))
                .await
                .is_err()
            {
                return;
            }
        }
        if held_back {
            tokio::select! {
                woken = concerning_wake(&mut wakes, &filter) => if !woken { return },
                () = tokio::time::sleep(Duration::from_millis(held_back_backoff_ms)) => {}
                () = sender.closed() => return,
            }
            held_back_backoff_ms = (held_back_backoff_ms * 2).min(held_back_max);
        } else {
            held_back_backoff_ms = HELD_BACK_RECHECK_MIN_MS;
            tokio::select! {
                woken = concerning_wake(&mut wakes, &filter) => if !woken { return },
                () = tokio::time::sleep(idle_recheck) => {}
                () = sender.closed() => return,
            }
        }
    }
}

/// Wait for a wake-up that may concern `filter`; `false` when the store is gone. Falling behind
/// the backlog counts as one (whatever was missed may have).
pub(super) async fn concerning_wake(
    wakes: &mut broadcast::Receiver<Wake>,
    filter: &EventFilter,
) -> bool {
    loop {
        match wakes.recv().await {
            Ok(wake) if wake.may_concern(filter) => return true,
            Ok(_) => {}
            Err(broadcast::error::RecvError::Lagged(_)) => return true,
            Err(broadcast::error::RecvError::Closed) => return false,
        }
    }
}

/// Commits to announce: wakes for this process's subscriptions at once, notifications for the
/// other processes through the notifier ([`listen`]).
#[derive(Clone)]
pub(super) struct Announcer {
    pub(super) wakes: broadcast::Sender<Wake>,
    pub(super) pending: Arc<PendingNotifications>,
}

/// Payloads waiting for the notifier, each once however many commits stored such events.
#[derive(Default)]
pub(super) struct PendingNotifications {
    pub(super) payloads: std::sync::Mutex<std::collections::BTreeSet<String>>,
    pub(super) ready: tokio::sync::Notify,
}

impl PendingNotifications {
    pub(super) fn take(&self) -> Vec<String> {
        let mut payloads = self
            .payloads
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        std::mem::take(&mut *payloads).into_iter().collect()
    }

    pub(super) fn put_back(&self, unsent: Vec<String>) {
        self.payloads
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .extend(unsent);
        self.ready.notify_one();
    }
}

impl Announcer {
    /// `events` were committed to `stream` (or had been: a duplicate append).
    pub(super) fn announce(&self, stream: &str, events: &[NewEvent]) {
        let category = format!("{}-", stream.split('-').next().unwrap_or_default());
        let mut payloads = self
            .pending
            .payloads
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        for event in events {
            let payload = format!("{category} {}", event.event_type);
            // No subscription yet is no error.
            drop(self.wakes.send(Wake::from_payload(&payload)));
            payloads.insert(payload);
        }
        drop(payloads);
        self.pending.ready.notify_one();
    }
}

/// Hold the LISTEN connection; pass on every notification, and wake everyone on every
/// (re)connect (a commit may have happened while we were not listening, so everyone re-reads).
/// The same connection is the notifier: it sends this process's pending notifications.
pub(super) async fn listen(
    config: tokio_postgres::Config,
    wakes: broadcast::Sender<Wake>,
    pending: Arc<PendingNotifications>,
) {
    const RECONNECT_BACKOFF_MAX_MS: u64 = 2_000;
    let mut backoff_ms = 50;
    loop {
        match listen_once(&config, &wakes, &pending).await {
            Ok(()) => backoff_ms = 50,
            Err(error) => {
                tracing::warn!(error = %format!("{error:#}"), retry_in_ms = backoff_ms, "event LISTEN connection lost");
            }
        }
        // No subscription yet is no error.
        drop(wakes.send(Wake::Anything));
        tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
        backoff_ms = (backoff_ms * 2).min(RECONNECT_BACKOFF_MAX_MS);
    }
}

pub(super) async fn listen_once(
    config: &tokio_postgres::Config,
    wakes: &broadcast::Sender<Wake>,
    pending: &PendingNotifications,
) -> anyhow::Result<()> {
    // On the server the pool writes to, never a fenced old primary (see `pg_fencing`).
    let config = crate::platform::pg_fencing::chosen_config(config)
        .await
        .context("choosing the server for the LISTEN connection")?;
    let (client, mut connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .context("opening the LISTEN connection")?;
    let (messages_sender, mut messages) = mpsc::unbounded_channel();
    let driver = tokio::spawn(async move {
        let mut stream = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = futures::StreamExt::next(&mut stream).await {
            if messages_sender.send(message).is_err() {
                break;
            }
        }
    });
    // A notification is no data: its transaction need not wait for the WAL to reach the disk
    // (what it announces already did).
    client
        .batch_execute(&format!(
            "LISTEN {NOTIFY_CHANNEL}; SET synchronous_commit = off"
        ))
        .await
        .context("LISTEN")?;
    let notify = client
        .prepare(&format!(
            "SELECT pg_notify('{NOTIFY_CHANNEL}', payload) FROM unnest($1::text[]) AS payload"
        ))
        .await
        .context("preparing NOTIFY")?;
    drop(wakes.send(Wake::Anything));
    loop {
        tokio::select! {
            message = messages.recv() => {
                let Some(message) = message else { break };
                // Notices and other messages carry nothing for us. Our own notifications come
                // back too, and are passed on again: the notifier's transaction may have held
                // the horizon back for a moment, and its end is what lets a subscription read
                // the commits behind it without waiting for its backoff.
                if let tokio_postgres::AsyncMessage::Notification(notification) =
                    message.context("LISTEN connection")?
                {
                    drop(wakes.send(Wake::from_payload(notification.payload())));
                }
            }
            () = pending.ready.notified() => {
                let payloads = pending.take();
                if payloads.is_empty() {
                    continue;
                }
                if let Err(error) = client.execute(&notify, &[&payloads]).await {
                    pending.put_back(payloads);
                    driver.abort();
                    return Err(error).context("NOTIFY");
                }
            }
        }
    }
    driver.abort();
    anyhow::bail!("LISTEN connection closed")
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn types(names: &[&str]) -> EventFilter {
        EventFilter::EventTypes(names.iter().map(|name| (*name).to_owned()).collect())
    }

    fn prefixes(names: &[&str]) -> EventFilter {
        EventFilter::StreamPrefixes(names.iter().map(|name| (*name).to_owned()).collect())
    }

    #[test]
    fn a_payload_names_the_category_and_type_and_anything_else_wakes_everyone() {
        assert_eq!(
            Wake::from_payload("task- TaskQueued"),
            Wake::Appended {
                category: "task-".into(),
                event_type: "TaskQueued".into()
            }
        );
        assert_eq!(
            Wake::from_payload("revenue- RevenueRecorded"),
            Wake::Appended {
                category: "revenue-".into(),
                event_type: "RevenueRecorded".into()
            }
        );
        assert_eq!(
            Wake::from_payload("odd name- Renamed"),
            Wake::Appended {
                category: "odd name-".into(),
                event_type: "Renamed".into()
            }
        );
        // V1's empty payload (an instance not yet upgraded), and anything unknown.
        for payload in ["", " ", "task-", " TaskQueued", "task- "] {
            assert_eq!(Wake::from_payload(payload), Wake::Anything, "{payload:?}");
        }
    }

    #[test]
    fn a_subscription_is_woken_for_whatever_may_pass_its_filter() {
        let queued = Wake::from_payload("task- TaskQueued");
        let frozen = Wake::from_payload("account- PointsFrozen");
        let claimed = Wake::from_payload("user- IdentifierClaimed");
        let revenue = Wake::from_payload("revenue- RevenueRecorded");
        assert!(queued.may_concern(&EventFilter::All));
        assert!(queued.may_concern(&types(&["TaskQueued", "TaskCancelRequested"])));
        assert!(!frozen.may_concern(&types(&["TaskQueued", "TaskCancelRequested"])));
        assert!(frozen.may_concern(&prefixes(&["account-"])));
        assert!(!queued.may_concern(&prefixes(&["account-", "revenue"])));
        assert!(revenue.may_concern(&prefixes(&["account-", "revenue"])));
        // "user-name-alice" and "user-<uuid>" share the category "user-": both prefixes may match.
        assert!(claimed.may_concern(&prefixes(&["user-name-"])));
        assert!(claimed.may_concern(&prefixes(&["user-"])));
        assert!(claimed.may_concern(&prefixes(&["us"])));
        assert!(!claimed.may_concern(&prefixes(&["task-"])));
        for filter in [EventFilter::All, types(&["X"]), prefixes(&["x-"])] {
            assert!(Wake::Anything.may_concern(&filter));
        }
    }
}
