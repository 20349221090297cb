//! The recent end of the global log, read once for all of a process's subscriptions.
//!
//! Each subscription used to read its own window of the log after every wake-up: ten
//! subscriptions (the projections, the dispatcher's saga, webhooks, revenue) woken by one commit
//! ran ten statements over the same rows, and PostgreSQL decoded the same payloads for each
//! (`pg_stat_statements`: about 170 µs of the server's time per submission, BENCHMARKS.md "Fourth
//! pass"). The tail keeps the newest events of the log in memory, every event in order with
//! nothing missing between its start and its end, and one read (a *fill*) extends it for every
//! subscription waiting at that moment; each then takes what passes its filter.
//!
//! **Fresh enough.** A subscription reads after taking its wake-ups, and must see every commit
//! they announce: so it is served only from a fill that *began after it asked* (`fills_begun`
//! is read before waiting for the tail; a fill done since carries a higher number). Asking
//! while a fill is under way means waiting for it and then for the next one, which the first of
//! those waiting runs for all of them.
//!
//! **Another server.** Every fill also says when the server that answered was started. After a
//! failover to an asynchronous standby the newest events the tail holds may not exist on the new
//! primary, whose next events may even take positions the tail has passed: so a fill answered by
//! another server than the tail's events came from discards the tail (the subscription that asked
//! reads alone, the next one anchors it afresh). Because every answer comes from a fill begun
//! after its question, no answer is served from a tail the current server has not confirmed.
//!
//! **Nothing skipped.** A fill reads after the tail's end with the store's gap-safe window (only
//! finished transactions, below the horizon), so the tail is exactly the log between its start
//! and its end; a subscription is served the events after its position up to its batch size, or
//! reads for itself when its position is outside the tail (behind its start: catching up, or
//! left behind by the capacity). A position past the tail's end moves the tail there.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{DateTime, Utc};
use tokio::sync::Mutex;

use super::{AllSlice, EventFilter, EventStoreError, Position, RecordedEvent};

/// The start of the log, as a position (what `read_window` reads after for `None`).
const ORIGIN: Position = Position {
    commit: 0,
    prepare: 0,
};

pub(super) struct LogTail {
    /// Events kept at most (the oldest are dropped beyond).
    capacity: usize,
    /// Events read per fill.
    fill_max: usize,
    /// Fills begun so far; a fill's number is its place in this count.
    fills_begun: AtomicU64,
    tail: Mutex<Tail>,
}

struct Tail {
    /// Every event of the log after `start` up to `end`, in order. `None` until the first fill.
    span: Option<(Position, Position)>,
    events: VecDeque<RecordedEvent>,
    /// The number of the last fill that succeeded.
    last_fill: u64,
    /// Whether the last fill reached the horizon (it read fewer than `fill_max` events).
    at_horizon: bool,
    /// Whether, at the last fill, an unfinished transaction held newer events back.
    held_back: bool,
    /// When the server the events came from was started (`None`: no events yet).
    server: Option<DateTime<Utc>>,
}

/// What a fill reads: the window after a position, at most that many events, every event; with
/// whether newer events are held back and when the server that answered was started.
pub(super) trait Window {
    fn window(
        &self,
        after: Position,
        max_count: usize,
    ) -> impl Future<Output = Result<(AllSlice, bool, DateTime<Utc>), EventStoreError>> + Send;
}

impl LogTail {
    pub(super) fn new(capacity: usize, fill_max: usize) -> LogTail {
        assert!(fill_max >= 1 && capacity >= fill_max);
        LogTail {
            capacity,
            fill_max,
            fills_begun: AtomicU64::new(0),
            tail: Mutex::new(Tail {
                span: None,
                events: VecDeque::new(),
                last_fill: 0,
                at_horizon: false,
                held_back: false,
                server: None,
            }),
        }
    }

    /// The window after `after` (at most `max_count` events, those passing `filter` returned)
    /// from a fill begun after this call, with whether newer events are held back; `None` when
    /// `after` lies behind the tail or the fill found another server (the caller reads alone).
    pub(super) async fn read(
        &self,
        window: &impl Window,
        after: Option<Position>,
        max_count: usize,
        filter: &EventFilter,
    ) -> Result<Option<(AllSlice, bool)>, EventStoreError> {
        let after = after.unwrap_or(ORIGIN);
        let asked_after = self.fills_begun.load(Ordering::SeqCst);
        let mut tail = self.tail.lock().await;
        match tail.span {
            Some((start, _)) if after < start => return Ok(None),
            Some((_, end)) if after <= end => {
                if tail.last_fill <= asked_after && !self.fill(&mut tail, window).await? {
                    return Ok(None);
                }
            }
            // Not started, or ahead of its end: the tail moves to `after`.
            _ => {
                tail.span = Some((after, after));
                tail.events.clear();
                tail.server = None;
                if !self.fill(&mut tail, window).await? {
                    return Ok(None);
                }
            }
        }
        let Some((start, _)) = tail.span else {
            unreachable!("filled above")
        };
        if after < start {
            // The fill itself pushed `after` out (more new events than the capacity holds).
            return Ok(None);
        }
        let first = tail.events.partition_point(|event| event.position <= after);
        let past_last = first.saturating_add(max_count).min(tail.events.len());
        let scanned = past_last - first;
        let scanned_to = past_last
            .checked_sub(1)
            .filter(|_| scanned > 0)
            .map(|last| tail.events[last].position);
        let events = tail
            .events
            .range(first..past_last)
            .filter(|event| filter.matches(&event.stream, &event.event_type))
            .cloned()
            .collect();
        Ok(Some((
            AllSlice {
                events,
                scanned_to,
                end_of_log: scanned < max_count && tail.at_horizon,
            },
            tail.held_back,
        )))
    }

    /// Extend the tail; `false` when another server answered than the one its events came from
    /// (the tail is then discarded).
    async fn fill(&self, tail: &mut Tail, window: &impl Window) -> Result<bool, EventStoreError> {
        let number = self.fills_begun.fetch_add(1, Ordering::SeqCst) + 1;
        let Some((mut start, end)) = tail.span else {
            unreachable!("a fill extends a started tail")
        };
        let (slice, held_back, server) = window.window(end, self.fill_max).await?;
        if tail.server.is_some_and(|known| known != server) {
            tracing::info!("the event store's server changed: the shared tail starts afresh");
            tail.span = None;
            tail.events.clear();
            tail.server = None;
            return Ok(false);
        }
        tail.server = Some(server);
        let end = slice.scanned_to.unwrap_or(end);
        // With `EventFilter::All` every scanned event comes back, so the tail has no gaps.
        tail.events.extend(slice.events);
        while tail.events.len() > self.capacity {
            if let Some(dropped) = tail.events.pop_front() {
                start = dropped.position;
            }
        }
        tail.span = Some((start, end));
        tail.last_fill = number;
        tail.at_horizon = slice.end_of_log;
        tail.held_back = held_back;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Mutex as StdMutex;
    use std::sync::atomic::AtomicUsize;

    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::platform::event_store::EventMetadata;

    /// A log in memory with a horizon: events at or past it belong to unfinished transactions.
    /// Like PostgreSQL's, the horizon only moves forward: while `holding`, new events wait
    /// behind it.
    #[derive(Default)]
    struct FakeLog {
        events: StdMutex<Vec<RecordedEvent>>,
        horizon: AtomicUsize,
        holding: std::sync::atomic::AtomicBool,
        reads: AtomicUsize,
        /// When the server answering was started (seconds): a failover changes it.
        server: AtomicUsize,
    }

    impl FakeLog {
        fn append(&self, stream: &str, event_type: &str) {
            let mut events = self.events.lock().unwrap();
            let n = events.len() as u64 + 1;
            events.push(RecordedEvent {
                id: uuid::Uuid::now_v7(),
                stream: stream.into(),
                event_type: event_type.into(),
                schema_version: 1,
                payload: serde_json::json!({"n": n, "说明": "第几个事件"}).into(),
                metadata: EventMetadata {
                    correlation_id: uuid::Uuid::nil(),
                    causation_id: None,
                    actor: "test".into(),
                },
                recorded_at: chrono::DateTime::UNIX_EPOCH,
                stream_version: 0,
                position: Position {
                    commit: n / 3 + 1,
                    prepare: n,
                },
            });
            if !self.holding.load(Ordering::SeqCst) {
                self.horizon.store(events.len(), Ordering::SeqCst);
            }
        }

        /// A failover to an asynchronous standby: the newest events are lost (the log keeps its
        /// first `kept`), and the new server's next events take the positions they had.
        fn fail_over(&self, kept: usize) {
            self.events.lock().unwrap().truncate(kept);
            self.horizon.store(kept, Ordering::SeqCst);
            self.server.fetch_add(1, Ordering::SeqCst);
        }

        /// An unfinished transaction holds what comes next back, or finishes.
        fn hold(&self, holding: bool) {
            self.holding.store(holding, Ordering::SeqCst);
            if !holding {
                let len = self.events.lock().unwrap().len();
                self.horizon.store(len, Ordering::SeqCst);
            }
        }

        /// What a subscription's own read returns (the store's `read_window`).
        fn direct(
            &self,
            after: Option<Position>,
            max_count: usize,
            filter: &EventFilter,
        ) -> (AllSlice, bool) {
            let events = self.events.lock().unwrap();
            let horizon = self.horizon.load(Ordering::SeqCst);
            let after = after.unwrap_or(ORIGIN);
            let scanned: Vec<&RecordedEvent> = events[..horizon]
                .iter()
                .filter(|event| event.position > after)
                .take(max_count)
                .collect();
            (
                AllSlice {
                    events: scanned
                        .iter()
                        .filter(|event| filter.matches(&event.stream, &event.event_type))
                        .map(|event| (*event).clone())
                        .collect(),
                    scanned_to: scanned.last().map(|event| event.position),
                    end_of_log: scanned.len() < max_count,
                },
                horizon < events.len(),
            )
        }
    }

    impl Window for FakeLog {
        async fn window(
            &self,
            after: Position,
            max_count: usize,
        ) -> Result<(AllSlice, bool, DateTime<Utc>), EventStoreError> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            tokio::task::yield_now().await;
            let (slice, held_back) = self.direct(Some(after), max_count, &EventFilter::All);
            let started = self.server.load(Ordering::SeqCst);
            Ok((
                slice,
                held_back,
                DateTime::UNIX_EPOCH + chrono::Duration::seconds(i64::try_from(started).unwrap()),
            ))
        }
    }

    fn filters() -> Vec<EventFilter> {
        vec![
            EventFilter::All,
            EventFilter::StreamPrefixes(vec!["account-".into()]),
            EventFilter::StreamPrefixes(vec!["task-".into(), "code-".into()]),
            EventFilter::EventTypes(vec!["TaskSubmitted".into(), "Granted".into()]),
        ]
    }

    fn append_random(log: &FakeLog, rng: &mut impl Rng, count: usize) {
        const KINDS: [(&str, &str); 4] = [
            ("account-1", "Granted"),
            ("account-2", "Frozen"),
            ("task-1", "TaskSubmitted"),
            ("code-9", "CodeRedeemed"),
        ];
        for _ in 0..count {
            let (stream, event_type) = KINDS[rng.random_range(0..KINDS.len())];
            log.append(stream, event_type);
        }
    }

    #[tokio::test]
    async fn every_read_from_the_tail_is_what_a_read_of_its_own_would_give() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(39);
        let log = FakeLog::default();
        let tail = LogTail::new(64, 16);
        // Subscriptions, each with a filter and a position, follow a log that grows, sometimes
        // with its newest events held back by an unfinished transaction.
        let mut positions: Vec<(EventFilter, Option<Position>)> = filters()
            .into_iter()
            .flat_map(|filter| [(filter.clone(), None), (filter, None)])
            .collect();
        let (mut served_by_tail, mut read_alone) = (0, 0);
        for round in 0..400 {
            let count = rng.random_range(0..3);
            append_random(&log, &mut rng, count);
            if round % 7 == 0 {
                log.hold(round % 2 == 0);
            }
            let which = rng.random_range(0..positions.len());
            let (filter, after) = positions[which].clone();
            let max_count = rng.random_range(1..=24);
            let expected = log.direct(after, max_count, &filter);
            match tail.read(&log, after, max_count, &filter).await.unwrap() {
                Some(read) => {
                    served_by_tail += 1;
                    assert_eq!(read.0, expected.0, "round {round}");
                    if read.0.end_of_log {
                        assert_eq!(read.1, expected.1, "round {round}: held back");
                    }
                }
                None => read_alone += 1,
            }
            if let Some(scanned_to) = expected.0.scanned_to {
                positions[which].1 = Some(scanned_to);
            }
            // Now and then a subscription is left far behind (restarted from the start).
            if rng.random_range(0..50) == 0 {
                positions[which].1 = None;
            }
        }
        assert!(
            served_by_tail > 200,
            "{served_by_tail} served by the tail, {read_alone} alone"
        );
        assert!(read_alone > 0, "some reads were behind the tail");
    }

    #[tokio::test]
    async fn a_read_sees_every_event_committed_before_it_asked() {
        let log = FakeLog::default();
        let tail = LogTail::new(64, 16);
        log.append("account-1", "Granted");
        let first = tail.read(&log, None, 16, &EventFilter::All).await.unwrap();
        let (first, _) = first.unwrap();
        assert_eq!(first.events.len(), 1);
        // Committed after the last fill: a read asked now must see it, not the tail as it was.
        log.append("account-1", "Frozen");
        let (second, _) = tail
            .read(&log, first.scanned_to, 16, &EventFilter::All)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(second.events.len(), 1);
        assert_eq!(second.events[0].event_type, "Frozen");
        assert!(second.end_of_log);
    }

    #[tokio::test]
    async fn subscriptions_asking_together_share_one_read() {
        let log = FakeLog::default();
        let tail = LogTail::new(64, 16);
        append_random(&log, &mut rand::rngs::StdRng::seed_from_u64(1), 10);
        tail.read(&log, None, 16, &EventFilter::All).await.unwrap();
        log.append("task-1", "TaskSubmitted");
        let reads_before = log.reads.load(Ordering::SeqCst);
        let filters: Vec<EventFilter> = filters().into_iter().cycle().take(10).collect();
        let asked = filters
            .iter()
            .map(|filter| tail.read(&log, None, 16, filter));
        let answers = futures::future::join_all(asked).await;
        for (filter, answer) in filters.iter().zip(answers) {
            let (slice, _) = answer.unwrap().unwrap();
            assert_eq!(slice, log.direct(None, 16, filter).0);
        }
        // The first to ask begins a read; the others asked while it was under way, so it may
        // not hold what woke them: they share the next one.
        assert_eq!(
            log.reads.load(Ordering::SeqCst) - reads_before,
            2,
            "ten subscriptions woken by one commit: two reads of the log"
        );
    }

    #[tokio::test]
    async fn a_position_behind_the_tail_reads_alone_and_one_ahead_moves_it() {
        let log = FakeLog::default();
        let tail = LogTail::new(16, 8);
        append_random(&log, &mut rand::rngs::StdRng::seed_from_u64(2), 40);
        // The first read anchors the tail at its position; fills keep at most 16 events.
        let mut after = None;
        for _ in 0..5 {
            let (slice, _) = tail
                .read(&log, after, 8, &EventFilter::All)
                .await
                .unwrap()
                .unwrap();
            after = slice.scanned_to;
        }
        assert_eq!(after.unwrap().prepare, 40);
        assert!(
            tail.read(&log, None, 8, &EventFilter::All)
                .await
                .unwrap()
                .is_none(),
            "the start of the log is no longer in the tail"
        );
        // A subscription that read ahead on its own moves the tail to where it is.
        append_random(&log, &mut rand::rngs::StdRng::seed_from_u64(3), 30);
        let ahead = log.direct(after, 20, &EventFilter::All).0.scanned_to;
        let (slice, _) = tail
            .read(&log, ahead, 8, &EventFilter::All)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(slice, log.direct(ahead, 8, &EventFilter::All).0);
    }

    #[tokio::test]
    async fn after_a_failover_nothing_lost_with_the_old_server_is_served() {
        let log = FakeLog::default();
        let tail = LogTail::new(64, 16);
        append_random(&log, &mut rand::rngs::StdRng::seed_from_u64(4), 30);
        let mut after = None;
        while let Some((slice, _)) = tail
            .read(&log, after, 16, &EventFilter::All)
            .await
            .unwrap()
            .filter(|(slice, _)| slice.scanned_to.is_some())
        {
            after = slice.scanned_to;
        }
        assert_eq!(after.unwrap().prepare, 30, "the tail holds all 30");
        // The standby had 25 of them; a restarted subscription goes on from its checkpoint on
        // the new primary, where new events follow.
        log.fail_over(25);
        append_random(&log, &mut rand::rngs::StdRng::seed_from_u64(5), 10);
        let restarted_at = log.direct(None, 25, &EventFilter::All).0.scanned_to;
        let mut after = restarted_at;
        for _ in 0..4 {
            let expected = log.direct(after, 16, &EventFilter::All).0;
            if let Some((slice, _)) = tail.read(&log, after, 16, &EventFilter::All).await.unwrap() {
                assert_eq!(slice, expected);
            }
            after = expected.scanned_to.or(after);
        }
        assert_eq!(after.unwrap().prepare, 35);
    }
}
