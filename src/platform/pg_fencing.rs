//! A primary that was failed over never takes another write: the fence between zhihui and an old
//! PostgreSQL primary restarted by mistake.
//!
//! After a failover the promoted standby writes on a new timeline (1 → 2). If the old primary is
//! then started again as it was, it is a primary too, still on the old timeline, and a
//! multi-host URL with `target_session_attrs=read-write` takes the first host that says
//! read-write: the old one, listed first. Appends landing there would be a split brain (lost to
//! the new primary, invisible to every reader on it).
//!
//! So every connection zhihui opens goes host by host (the URL's order) through
//! [`FencedConnect`]: a read-write server answers its system identifier (shared by a primary and
//! every standby copied from it) and its current timeline (from its WAL insert position); one
//! whose timeline is below the highest this process has seen for that system is fenced and the
//! next host is tried. A process that has seen nothing yet for a system (its first connection)
//! asks every host and takes the highest timeline among the read-write ones. What this cannot
//! catch: a process whose first connection finds only the old primary up (the new one down),
//! which no client-side rule can tell from a cluster that never failed over.
//!
//! The way back for the old primary is `pg_rewind` (or a fresh `pg_basebackup`) from the new
//! primary and a start as its standby: `scripts/services.sh rejoin-old-primary`.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use deadpool_postgres::Connect;
use futures::future::BoxFuture;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Config, NoTls};

/// The highest timeline seen per database system (its `system_identifier`), in this process.
static HIGHEST: LazyLock<Mutex<HashMap<i64, i32>>> = LazyLock::new(Default::default);

/// The SQLSTATE a fenced server's refusal carries (`cannot_connect_now`): an unavailable
/// server, answered 503 with `Retry-After` at the HTTP edge, retried by the event store.
const FENCED_STATE: &str = "57P03";

/// The fenced servers already reported (system, host, timeline): each is logged as an error
/// once, then counted only (every new connection meets it again while it runs).
static REPORTED: LazyLock<Mutex<std::collections::HashSet<(i64, String, i32)>>> =
    LazyLock::new(Default::default);

/// What one host answered.
struct Reached {
    /// `host:port`, for the log.
    host: String,
    client: Client,
    driver: JoinHandle<()>,
    system: i64,
    /// `None` for a server in recovery (a standby, allowed only by `target_session_attrs=any`).
    timeline: Option<i32>,
}

/// A deadpool connector that goes host by host and skips fenced primaries.
#[derive(Debug, Clone, Copy, Default)]
pub struct FencedConnect;

impl Connect for FencedConnect {
    fn connect(
        &self,
        pg_config: &Config,
    ) -> BoxFuture<'_, Result<(Client, JoinHandle<()>), tokio_postgres::Error>> {
        let pg_config = pg_config.clone();
        Box::pin(async move {
            if pg_config.get_hosts().is_empty() {
                // Nothing to choose from: the configuration's own connect says what is missing.
                let (client, connection) = pg_config.connect(NoTls).await?;
                return Ok((client, tokio::spawn(drive(connection))));
            }
            let (_, reached) = choose(&pg_config).await?;
            Ok((reached.client, reached.driver))
        })
    }
}

/// The one-host configuration of the server a new connection should go to now (for a
/// connection that must own its socket, e.g. LISTEN's).
pub async fn chosen_config(config: &Config) -> Result<Config, tokio_postgres::Error> {
    if config.get_hosts().is_empty() {
        return Ok(config.clone());
    }
    let (index, reached) = choose(config).await?;
    drop(reached.client);
    reached.driver.abort();
    Ok(single_host(config, index))
}

/// `config` with only its `index`-th host (and port, and address when given).
fn single_host(config: &Config, index: usize) -> Config {
    let mut one = Config::new();
    if let Some(user) = config.get_user() {
        one.user(user);
    }
    if let Some(password) = config.get_password() {
        one.password(password);
    }
    if let Some(dbname) = config.get_dbname() {
        one.dbname(dbname);
    }
    if let Some(options) = config.get_options() {
        one.options(options);
    }
    if let Some(name) = config.get_application_name() {
        one.application_name(name);
    }
    if let Some(timeout) = config.get_connect_timeout() {
        one.connect_timeout(*timeout);
    }
    if let Some(timeout) = config.get_tcp_user_timeout() {
        one.tcp_user_timeout(*timeout);
    }
    one.keepalives(config.get_keepalives())
        .keepalives_idle(config.get_keepalives_idle())
        .target_session_attrs(config.get_target_session_attrs())
        .ssl_mode(config.get_ssl_mode());
    match &config.get_hosts()[index] {
        tokio_postgres::config::Host::Tcp(host) => one.host(host),
        tokio_postgres::config::Host::Unix(path) => one.host_path(path),
    };
    if let Some(address) = config.get_hostaddrs().get(index) {
        one.hostaddr(*address);
    }
    // One port for every host, or one per host (as libpq reads them).
    let ports = config.get_ports();
    match ports.len() {
        0 => {}
        1 => {
            one.port(ports[0]);
        }
        _ => {
            one.port(ports[index.min(ports.len() - 1)]);
        }
    }
    one
}

async fn drive<S, T>(connection: tokio_postgres::Connection<S, T>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    if let Err(error) = connection.await {
        tracing::debug!(%error, "a PostgreSQL connection ended");
    }
}

/// Connect to the host at `index` and ask it who it is.
async fn reach(config: &Config, index: usize) -> Result<Reached, tokio_postgres::Error> {
    let one = single_host(config, index);
    let host = format!(
        "{}:{}",
        match one.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
            Some(tokio_postgres::config::Host::Unix(path)) => path.display().to_string(),
            None => String::new(),
        },
        one.get_ports().first().copied().unwrap_or(5432)
    );
    let (client, connection) = one.connect(NoTls).await?;
    let driver = tokio::spawn(drive(connection));
    let row = client
        .query_one(
            "SELECT system_identifier, pg_is_in_recovery(), \
                    CASE WHEN pg_is_in_recovery() THEN NULL ELSE \
                      ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int \
                    END \
               FROM pg_control_system()",
            &[],
        )
        .await;
    match row {
        Ok(row) => Ok(Reached {
            host,
            client,
            driver,
            system: row.get(0),
            timeline: row.get(2),
        }),
        Err(error) => {
            driver.abort();
            Err(error)
        }
    }
}

/// The host to use, and its open connection (`config` names at least one host). See the
/// module's documentation.
async fn choose(config: &Config) -> Result<(usize, Reached), tokio_postgres::Error> {
    let hosts = config.get_hosts().len();
    let mut last_error = None;
    let mut unknown: Vec<(usize, Reached)> = Vec::new();
    for index in 0..hosts {
        let reached = match reach(config, index).await {
            Ok(reached) => reached,
            Err(error) => {
                last_error = Some(error);
                continue;
            }
        };
        let Some(timeline) = reached.timeline else {
            // A standby, accepted by `target_session_attrs`: it takes no write.
            return Ok((index, reached));
        };
        let highest = highest(reached.system);
        match highest {
            Some(highest) if timeline < highest => {
                last_error = Some(fence(&reached, timeline, highest).await);
            }
            Some(_) => {
                raise(reached.system, timeline);
                return Ok((index, reached));
            }
            // Nothing known of this system yet: ask every host before choosing.
            None => unknown.push((index, reached)),
        }
    }
    let best = unknown
        .iter()
        .map(|(_, reached)| reached.timeline.unwrap_or(0))
        .max();
    let mut chosen = None;
    for (index, reached) in unknown {
        let timeline = reached.timeline.unwrap_or(0);
        if chosen.is_none() && Some(timeline) == best {
            raise(reached.system, timeline);
            chosen = Some((index, reached));
        } else {
            last_error = Some(fence(&reached, timeline, best.unwrap_or(timeline)).await);
        }
    }
    match (chosen, last_error) {
        (Some(chosen), _) => Ok(chosen),
        (None, Some(error)) => Err(error),
        // Each of the (one or more) hosts either failed, was fenced (both leave an error) or was
        // among the unknown, one of which is chosen.
        (None, None) => unreachable!("no host chosen and no error"),
    }
}

fn highest(system: i64) -> Option<i32> {
    HIGHEST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&system)
        .copied()
}

fn raise(system: i64, timeline: i32) {
    let mut highest = HIGHEST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let entry = highest.entry(system).or_insert(timeline);
    if timeline > *entry {
        tracing::info!(
            system,
            timeline,
            "PostgreSQL's primary is on a new timeline"
        );
        *entry = timeline;
    }
}

/// Refuse a server on an old timeline: the error is its own answer to a statement that raises
/// (an error of the server, with an unavailable server's SQLSTATE), and the connection closes.
async fn fence(reached: &Reached, timeline: i32, highest: i32) -> tokio_postgres::Error {
    let first_time = REPORTED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert((reached.system, reached.host.clone(), timeline));
    if first_time {
        tracing::error!(
            host = %reached.host,
            system = reached.system,
            timeline,
            highest,
            "a PostgreSQL primary on an old timeline answered (an old primary started again after a failover?): fenced, no write goes to it; bring it back as a standby (pg_rewind)"
        );
    }
    metrics::counter!("zhihui_postgres_fenced_total").increment(1);
    let raise = format!(
        "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '{FENCED_STATE}', \
         MESSAGE = 'zhihui fenced this primary: it is on timeline {timeline}, a newer primary is on timeline {highest}'; END $$"
    );
    // The raise answers an error; were it not to, the connection is closed and the next try
    // answers that instead.
    loop {
        let refused = reached.client.batch_execute(&raise).await;
        reached.driver.abort();
        if let Err(error) = refused {
            return error;
        }
    }
}
