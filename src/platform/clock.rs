//! The application's clock. The domain never reads time: handlers read it here and put it into
//! commands. Time-based rules that live in Redis (session expiry, code expiry, send limits,
//! lockouts) are given this clock's time too, so tests move time forward instead of sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};

#[derive(Debug, Clone, Default)]
pub enum Clock {
    /// The machine's clock.
    #[default]
    System,
    /// A clock that only moves when told to (tests).
    Manual(ManualClock),
}

impl Clock {
    pub fn now(&self) -> DateTime<Utc> {
        match self {
            Clock::System => Utc::now(),
            Clock::Manual(manual) => manual.now(),
        }
    }

    /// Milliseconds since the Unix epoch, the unit of every time given to a Redis script.
    pub fn now_ms(&self) -> i64 {
        self.now().timestamp_millis()
    }
}

/// A Unix-epoch millisecond count as a time: how Redis scripts answer (the epoch if out of range).
pub fn from_unix_ms(unix_ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(unix_ms).unwrap_or_default()
}

/// A duration in whole milliseconds, saturating: how Redis scripts take durations.
pub fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Shared by every clone: advancing one advances all.
#[derive(Debug, Clone)]
pub struct ManualClock {
    unix_ms: Arc<AtomicI64>,
}

impl ManualClock {
    pub fn starting_at(start: DateTime<Utc>) -> ManualClock {
        ManualClock {
            unix_ms: Arc::new(AtomicI64::new(start.timestamp_millis())),
        }
    }

    pub fn now(&self) -> DateTime<Utc> {
        from_unix_ms(self.unix_ms.load(Ordering::SeqCst))
    }

    pub fn advance(&self, by: Duration) {
        let by_ms = i64::try_from(millis(by)).unwrap_or(i64::MAX);
        self.unix_ms.fetch_add(by_ms, Ordering::SeqCst);
    }
}
