//! `zhihui audit verify`: fold every stream again, with the domain's own `evolve`, and compare
//! the result with every read model row. Any difference is printed; the command fails if there is
//! one. It reads the whole log through the `EventStore` trait, so it works on either store.

use std::collections::{BTreeMap, HashMap};

use anyhow::Context;
use rust_decimal::Decimal;
use uuid::Uuid;
use zhihui_domain::account::{Account, AccountEvent, AccountState};
use zhihui_domain::user::{User, UserEvent, UserState};
use zhihui_domain::{Decider, DomainEvent};
use zhihui_projections::accounts::account_user_id;

use crate::event_store::{AnyEventStore, EventFilter, EventStore};

/// Events per read of the log during verification.
pub const VERIFY_READ_PAGE_MAX: usize = 5_000;

/// One disagreement between the events and a read model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub read_model: &'static str,
    pub key: String,
    pub detail: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.read_model, self.key, self.detail)
    }
}

#[derive(Default)]
struct FoldedAccount {
    state: AccountState,
    version: u64,
    /// (stream version -> available after, frozen after) as the events say.
    entries: BTreeMap<u64, (Decimal, Decimal)>,
}

/// Fold the log and compare with `accounts`, `ledger_entries` and `users`.
pub async fn verify(
    store: &AnyEventStore,
    client: &tokio_postgres::Client,
) -> anyhow::Result<(u64, Vec<Difference>)> {
    let mut accounts: HashMap<Uuid, FoldedAccount> = HashMap::new();
    let mut users: HashMap<Uuid, (UserState, u64)> = HashMap::new();
    let filter = EventFilter::StreamPrefixes(vec!["account-".into(), "user-".into()]);
    let mut after = None;
    let mut events_read = 0u64;
    loop {
        let slice = store
            .read_all(after, VERIFY_READ_PAGE_MAX, &filter)
            .await
            .context("reading the log")?;
        for recorded in &slice.events {
            events_read += 1;
            if let Some(user_id) = account_user_id(&recorded.stream) {
                let event = AccountEvent::from_stored(
                    &recorded.event_type,
                    recorded.schema_version,
                    &recorded.payload,
                )
                .with_context(|| format!("decoding event {}", recorded.id))?;
                let folded = accounts.entry(user_id).or_default();
                let state = std::mem::take(&mut folded.state);
                folded.state = Account::evolve(state, &event);
                folded.version = recorded.stream_version;
                // The ledger must show what a fresh fold gives, whatever the event claims.
                folded.entries.insert(
                    recorded.stream_version,
                    (
                        folded.state.balance.available.as_decimal(),
                        folded.state.balance.frozen.as_decimal(),
                    ),
                );
            } else if let Some(user_id) = recorded
                .stream
                .strip_prefix("user-")
                .and_then(|id| Uuid::parse_str(id).ok())
            {
                let event = UserEvent::from_stored(
                    &recorded.event_type,
                    recorded.schema_version,
                    &recorded.payload,
                )
                .with_context(|| format!("decoding event {}", recorded.id))?;
                let entry = users
                    .entry(user_id)
                    .or_insert_with(|| (User::initial_state(), 0));
                let state = std::mem::replace(&mut entry.0, UserState::Unregistered);
                entry.0 = User::evolve(state, &event);
                entry.1 = recorded.stream_version;
            }
        }
        after = slice.scanned_to.or(after);
        if slice.end_of_log {
            break;
        }
    }

    let mut differences = Vec::new();
    let rows = client
        .query(
            "SELECT user_id, available, frozen, stream_version FROM accounts",
            &[],
        )
        .await
        .context("reading accounts")?;
    let mut seen = std::collections::HashSet::new();
    for row in rows {
        let user_id: Uuid = row.get(0);
        seen.insert(user_id);
        let (available, frozen, version): (Decimal, Decimal, i64) =
            (row.get(1), row.get(2), row.get(3));
        match accounts.get(&user_id) {
            None => differences.push(Difference {
                read_model: "accounts",
                key: user_id.to_string(),
                detail: "row without any event".into(),
            }),
            Some(folded) => {
                let expected = (
                    folded.state.balance.available.as_decimal(),
                    folded.state.balance.frozen.as_decimal(),
                    i64::try_from(folded.version)?,
                );
                if (available, frozen, version) != expected {
                    differences.push(Difference {
                        read_model: "accounts",
                        key: user_id.to_string(),
                        detail: format!(
                            "row says available {available}, frozen {frozen} at version {version}; \
                             the events say available {}, frozen {} at version {}",
                            expected.0, expected.1, expected.2
                        ),
                    });
                }
            }
        }
    }
    for user_id in accounts.keys().filter(|id| !seen.contains(id)) {
        differences.push(Difference {
            read_model: "accounts",
            key: user_id.to_string(),
            detail: "events without a row".into(),
        });
    }

    let rows = client
        .query(
            "SELECT user_id, stream_version, available_after, frozen_after FROM ledger_entries",
            &[],
        )
        .await
        .context("reading ledger entries")?;
    let mut ledger_seen = std::collections::HashSet::new();
    for row in rows {
        let user_id: Uuid = row.get(0);
        let version = u64::try_from(row.get::<_, i64>(1))?;
        ledger_seen.insert((user_id, version));
        let shown: (Decimal, Decimal) = (row.get(2), row.get(3));
        match accounts
            .get(&user_id)
            .and_then(|folded| folded.entries.get(&version))
        {
            None => differences.push(Difference {
                read_model: "ledger_entries",
                key: format!("{user_id} #{version}"),
                detail: "entry without an event".into(),
            }),
            Some(expected) if *expected != shown => differences.push(Difference {
                read_model: "ledger_entries",
                key: format!("{user_id} #{version}"),
                detail: format!(
                    "entry says available {} frozen {} after; the events say {} and {}",
                    shown.0, shown.1, expected.0, expected.1
                ),
            }),
            Some(_) => {}
        }
    }
    for (user_id, folded) in &accounts {
        for version in folded.entries.keys() {
            if !ledger_seen.contains(&(*user_id, *version)) {
                differences.push(Difference {
                    read_model: "ledger_entries",
                    key: format!("{user_id} #{version}"),
                    detail: "event without an entry".into(),
                });
            }
        }
    }

    let rows = client
        .query("SELECT user_id, username, phone, role FROM users", &[])
        .await
        .context("reading users")?;
    let mut users_seen = std::collections::HashSet::new();
    for row in rows {
        let user_id: Uuid = row.get(0);
        users_seen.insert(user_id);
        let shown: (Option<String>, Option<String>, String) = (row.get(1), row.get(2), row.get(3));
        let expected = match users.get(&user_id) {
            Some((UserState::Registered(user), _)) => Some((
                user.username.as_ref().map(|name| name.as_str().to_owned()),
                user.phone.as_ref().map(|phone| phone.as_str().to_owned()),
                user.role.as_str().to_owned(),
            )),
            _ => None,
        };
        if expected.as_ref() != Some(&shown) {
            differences.push(Difference {
                read_model: "users",
                key: user_id.to_string(),
                detail: format!("row says {shown:?}; the events say {expected:?}"),
            });
        }
    }
    for (user_id, (state, _)) in &users {
        if matches!(state, UserState::Registered(_)) && !users_seen.contains(user_id) {
            differences.push(Difference {
                read_model: "users",
                key: user_id.to_string(),
                detail: "registered in the events, missing from the table".into(),
            });
        }
    }
    differences.sort_by(|a, b| (a.read_model, &a.key).cmp(&(b.read_model, &b.key)));
    Ok((events_read, differences))
}
