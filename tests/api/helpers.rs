//! `spawn_app()`: a zhihui instance on a free port, with its own freshly migrated database and
//! Redis key prefix, sharing the PostgreSQL and Redis started by `scripts/services.sh`.
//!
//! `DATABASE_URL` names a database the tests may connect to in order to CREATE DATABASE;
//! `REDIS_URL` the Redis; `REDIS_CLUSTER_NODES`, when set (comma-separated seed URLs), a Redis
//! Cluster instead (the gate runs the Redis tests both ways). Both default to the local services' ports.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Value, json};
use zhihui::identity::phone_codes::CodeSender;
use zhihui::platform::clock::{Clock, ManualClock};
use zhihui::platform::configuration::Settings;
use zhihui::startup::Application;
use zhihui::state::Overrides;
use zhihui_domain::user::PhoneNumber;

pub const DEFAULT_DATABASE_URL: &str = "postgres://zhihui@127.0.0.1:55432/zhihui";
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:56379/0";

/// Where every test app's clock starts: 09:00 in UTC+8 (the default day offset), so a test
/// that needs "the same day" has fifteen hours of it.
pub fn test_epoch() -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::parse_from_rfc3339("2027-01-15T01:00:00Z")
        .unwrap()
        .into()
}

/// The code sender of tests: remembers every code it was asked to send.
#[derive(Debug, Default)]
pub struct CapturedCodes {
    codes: Mutex<HashMap<String, Vec<String>>>,
}

impl CapturedCodes {
    /// The last code sent to `phone` (normalised form, e.g. `+8613800138000`).
    pub fn last(&self, phone: &str) -> Option<String> {
        self.codes
            .lock()
            .unwrap()
            .get(phone)
            .and_then(|codes| codes.last().cloned())
    }

    pub fn count(&self, phone: &str) -> usize {
        self.codes.lock().unwrap().get(phone).map_or(0, Vec::len)
    }
}

impl CodeSender for CapturedCodes {
    fn send<'a>(
        &'a self,
        phone: &'a PhoneNumber,
        code: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<()>> {
        self.codes
            .lock()
            .unwrap()
            .entry(phone.to_string())
            .or_default()
            .push(code.to_owned());
        Box::pin(async { Ok(()) })
    }
}

#[derive(Debug)]
pub struct TestApp {
    pub address: String,
    pub settings: Settings,
    pub http: reqwest::Client,
    /// The app's clock: tests move time with `clock.advance(..)` instead of sleeping.
    pub clock: ManualClock,
    pub codes: Arc<CapturedCodes>,
    pub ollama: crate::fake_ollama::FakeOllama,
}

/// A user socket of the API.
pub type Socket = async_tungstenite::WebSocketStream<async_tungstenite::tokio::ConnectStream>;

impl TestApp {
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.http
            .get(format!("{}{path}", self.address))
            .send()
            .await
            .expect("request reaches the app")
    }

    /// GET with a bearer token.
    pub async fn get_as(&self, token: &str, path: &str) -> reqwest::Response {
        self.http
            .get(format!("{}{path}", self.address))
            .bearer_auth(token)
            .send()
            .await
            .expect("request reaches the app")
    }

    /// GET with a bearer token, its answer's JSON body.
    pub async fn get_json(&self, token: &str, path: &str) -> Value {
        self.get_as(token, path)
            .await
            .json()
            .await
            .expect("a JSON answer")
    }

    /// POST a JSON body, with a bearer token when given.
    pub async fn post(&self, path: &str, token: Option<&str>, body: &Value) -> reqwest::Response {
        self.send(reqwest::Method::POST, path, token, body).await
    }

    pub async fn put(&self, path: &str, token: Option<&str>, body: &Value) -> reqwest::Response {
        self.send(reqwest::Method::PUT, path, token, body).await
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: &Value,
    ) -> reqwest::Response {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.address))
            .json(body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send().await.expect("request reaches the app")
    }

    /// Register a user over HTTP and return its id.
    pub async fn register(&self, username: &str, password: &str) -> String {
        let response = self
            .post(
                "/api/v1/auth/register",
                None,
                &json!({"username": username, "password": password}),
            )
            .await;
        assert_eq!(response.status(), 201, "registering {username}");
        let body: Value = response.json().await.unwrap();
        body["id"].as_str().unwrap().to_owned()
    }

    /// Log in with a password and return the token.
    pub async fn login(&self, username: &str, password: &str) -> String {
        let response = self
            .post(
                "/api/v1/auth/login",
                None,
                &json!({"username": username, "password": password}),
            )
            .await;
        assert_eq!(response.status(), 200, "logging in {username}");
        let body: Value = response.json().await.unwrap();
        body["token"].as_str().unwrap().to_owned()
    }

    /// Another zhihui instance over HTTP, as another `zhihui serve` process would be: the same
    /// database, Redis prefix, clock and settings, but its own services and caches (account
    /// actors) and its own port. It never dispatches: tests that need a dispatcher drive one.
    pub async fn another_instance(&self) -> TestApp {
        self.another_instance_with(|_| {}).await
    }

    /// [`TestApp::another_instance`] with some settings of its own (another Redis URL, e.g.).
    pub async fn another_instance_with(&self, customise: impl FnOnce(&mut Settings)) -> TestApp {
        let mut settings = self.settings.clone();
        customise(&mut settings);
        settings.database.migrate_on_start = false;
        settings.dispatch.enabled = false;
        start_instance(
            settings,
            self.clock.clone(),
            self.codes.clone(),
            self.ollama.clone(),
        )
        .await
    }

    /// A second set of services on the same database and Redis, as another zhihui process would
    /// have (no HTTP).
    pub fn services(&self) -> zhihui::state::AppState {
        let pool = zhihui::platform::postgres::build_pool(&self.settings.database).unwrap();
        zhihui::state::AppState::build(&self.settings, pool, Overrides::default()).unwrap()
    }

    /// The services of another process on the same database and Redis, with the app's clock
    /// (so that tests can age intents and leases by moving it).
    pub fn services_on_app_clock(&self) -> zhihui::state::AppState {
        self.services_with(&self.settings)
    }

    /// The services of a process with `settings` (e.g. a store of it away), on the app's clock.
    pub fn services_with(&self, settings: &Settings) -> zhihui::state::AppState {
        let pool = zhihui::platform::postgres::build_pool(&settings.database).unwrap();
        let overrides = Overrides {
            clock: Clock::Manual(self.clock.clone()),
            code_sender: None,
        };
        zhihui::state::AppState::build(settings, pool, overrides).unwrap()
    }

    /// A projector of `projection` on this app's database.
    pub fn projector(
        &self,
        projection: zhihui_projections::ProjectionName,
    ) -> zhihui::platform::projector::Projector {
        let services = self.services();
        zhihui::platform::projector::Projector::live(
            projection,
            services.pg_pool,
            services.event_store,
            self.settings.projections.clone(),
        )
    }

    /// Run the real `zhihui` binary against this app's database.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        self.cli_with(args, &[])
    }

    /// [`Self::cli`] with more settings (`ZHIHUI_...` variables).
    pub fn cli_with(&self, args: &[&str], settings: &[(&str, &str)]) -> std::process::Output {
        std::process::Command::new(env!("CARGO_BIN_EXE_zhihui"))
            .args(args)
            .env(
                "ZHIHUI_DATABASE__URL",
                self.settings.database.url.expose_secret(),
            )
            .env("ZHIHUI_DATABASE__MIGRATE_ON_START", "false")
            .env("ZHIHUI_REDIS__URL", self.settings.redis.url.expose_secret())
            .env(
                "ZHIHUI_REDIS__CLUSTER_NODES",
                self.settings.redis.cluster_nodes.expose_secret(),
            )
            .env("ZHIHUI_REDIS__KEY_PREFIX", &self.settings.redis.key_prefix)
            .env("ZHIHUI_LOG__FILTER", "warn")
            .envs(settings.iter().copied())
            .output()
            .expect("running the zhihui binary")
    }

    /// A revenue recorder (process manager) on this app's database.
    pub fn revenue_recorder(&self) -> zhihui::points::revenue::RevenueRecorder {
        let services = self.services();
        zhihui::points::revenue::RevenueRecorder::new(
            services.event_store,
            services.pg_pool,
            self.settings.projections.clone(),
        )
    }

    /// Run the revenue recorder, then every projection, until each has handled everything
    /// committed so far.
    pub async fn project(&self) {
        self.revenue_recorder().catch_up().await.unwrap();
        for projection in zhihui_projections::ProjectionName::ALL {
            // A `zhihui serve` the test started runs its projections live beside this catch-up:
            // when it applies a batch first, its fence stops this runner (the checkpoint moved
            // under it; nothing was applied twice), which then goes on from where that one left.
            let mut fenced = 0;
            loop {
                match self.projector(projection).catch_up().await {
                    Ok(_) => break,
                    Err(error)
                        if fenced < 100
                            && matches!(
                                zhihui::platform::projector::Halt::of(&error),
                                Some(zhihui::platform::projector::Halt::CheckpointMoved { .. })
                            ) =>
                    {
                        fenced += 1;
                    }
                    Err(error) => panic!("projecting {projection:?}: {error:?}"),
                }
            }
        }
    }

    /// `audit verify` in this process; a settlement missing for longer than `settle_within`
    /// (default: the app's settlement bound) is a difference.
    pub async fn verify(
        &self,
        settle_within: Option<chrono::Duration>,
    ) -> zhihui::cli::audit::Verified {
        let client = connect(&self.settings).await;
        zhihui::cli::audit::verify(
            &self.services().event_store,
            &client,
            settle_within
                .unwrap_or_else(|| zhihui::cli::audit::settlement_bound(&self.settings.tasks)),
        )
        .await
        .unwrap()
    }

    /// A user socket opened with `token` in its URL (the fallback for clients that can send
    /// neither a ticket nor a header).
    pub async fn socket(&self, token: &str) -> Socket {
        let url = format!(
            "{}/api/v1/ws?token={token}",
            self.address.replace("http://", "ws://")
        );
        async_tungstenite::tokio::connect_async(url.as_str())
            .await
            .expect("the socket opens")
            .0
    }

    /// Create an admin through the users service (as `zhihui users create --admin` does) and
    /// return its token.
    pub async fn admin_token(&self, username: &str) -> String {
        let state = self.services();
        let metadata = zhihui::platform::event_store::EventMetadata {
            correlation_id: uuid::Uuid::now_v7(),
            causation_id: None,
            actor: "test:admin".into(),
        };
        let password = zhihui::identity::password::PlainPassword::parse("admin password").unwrap();
        state
            .users
            .register_with_password(
                zhihui_domain::user::Username::parse(username).unwrap(),
                &password,
                &state.passwords,
                zhihui_domain::user::Role::Admin,
                &metadata,
            )
            .await
            .unwrap();
        self.login(username, "admin password").await
    }
}

/// Settings for one test: a new database (created and migrated by the caller) and key prefix.
pub fn test_settings(database_name: &str) -> Settings {
    let mut settings = Settings::load(None).expect("default settings load");
    let admin_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    settings.database.url = SecretString::from(url_with_database(&admin_url, database_name));
    settings.database.pool_max_size = 8;
    settings.database.worker_pool_max_size = 4;
    settings.redis.url =
        SecretString::from(std::env::var("REDIS_URL").unwrap_or_else(|_| DEFAULT_REDIS_URL.into()));
    settings.redis.cluster_nodes =
        SecretString::from(std::env::var("REDIS_CLUSTER_NODES").unwrap_or_default());
    settings.redis.key_prefix = format!("test:{database_name}");
    settings.http.port = 0;
    // Every test comes from 127.0.0.1 on a clock that rarely moves: the per-client limits are
    // tested where they are switched back on (edges.rs).
    settings.auth.logins_per_client_per_minute = 1_000_000;
    settings.auth.code_requests_per_client_per_hour = 1_000_000;
    settings.auth.code_requests_per_minute_max = 1_000_000;
    settings.http.workers = Some(1);
    // Tests drive projections step by step (`TestApp::project`); a test may switch them on.
    settings.projections.enabled = false;
    settings.process_managers.enabled = false;
    // Tests lead the dispatcher by hand (`Harness::lead`), or run real processes that do.
    settings.dispatch.enabled = false;
    settings
}

/// Replace the database name (the path) of a PostgreSQL URL.
fn url_with_database(url: &str, database_name: &str) -> String {
    let (without_query, query) = match url.split_once('?') {
        Some((head, query)) => (head, Some(query)),
        None => (url, None),
    };
    let scheme_end = without_query.find("://").map_or(0, |i| i + 3);
    let base = match without_query[scheme_end..].find('/') {
        Some(slash) => &without_query[..scheme_end + slash],
        None => without_query,
    };
    match query {
        Some(query) => format!("{base}/{database_name}?{query}"),
        None => format!("{base}/{database_name}"),
    }
}

/// Create an empty database with a unique name and return its name.
pub async fn create_database() -> String {
    let admin_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    let name = format!("zhihui_test_{}", uuid::Uuid::new_v4().simple());
    let (client, connection) = tokio_postgres::connect(&admin_url, tokio_postgres::NoTls)
        .await
        .expect("connect to the test PostgreSQL (run scripts/services.sh start)");
    tokio::spawn(connection);
    client
        .simple_query(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create test database");
    name
}

/// A running app on its own database and Redis prefix.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// Like [`spawn_app`], with a chance to change the settings (sabotage tests point a dependency
/// at a dead port).
pub async fn spawn_app_with(customise: impl FnOnce(&mut Settings)) -> TestApp {
    let database_name = create_database().await;
    spawn_app_on(test_settings(&database_name), customise).await
}

/// A running app on a database the test made elsewhere (`database_url`: its own server, e.g. a
/// primary with a standby), with a fresh Redis prefix.
pub async fn spawn_app_at(database_url: &str, customise: impl FnOnce(&mut Settings)) -> TestApp {
    let mut settings = test_settings(&format!("zhihui_test_{}", uuid::Uuid::new_v4().simple()));
    settings.database.url = SecretString::from(database_url.to_owned());
    spawn_app_on(settings, customise).await
}

async fn spawn_app_on(mut settings: Settings, customise: impl FnOnce(&mut Settings)) -> TestApp {
    let ollama = crate::fake_ollama::FakeOllama::start().await;
    settings.translation.ollama_url = ollama.url.clone();
    // Short, so the "slow Ollama" test waits little.
    settings.translation.timeout_ms = 500;
    customise(&mut settings);
    let clock = ManualClock::starting_at(test_epoch());
    let codes = Arc::new(CapturedCodes::default());
    start_instance(settings, clock, codes, ollama).await
}

/// Build and serve one instance with the test's clock and code sender.
async fn start_instance(
    settings: Settings,
    clock: ManualClock,
    codes: Arc<CapturedCodes>,
    ollama: crate::fake_ollama::FakeOllama,
) -> TestApp {
    let overrides = Overrides {
        clock: Clock::Manual(clock.clone()),
        code_sender: Some(codes.clone()),
    };
    let application = Application::build_with(&settings, overrides)
        .await
        .expect("application builds");
    let port = application.port();
    tokio::spawn(application.run_until_stopped());
    TestApp {
        address: format!("http://127.0.0.1:{port}"),
        settings,
        // An idle connection is dropped after 2 s, before actix's keep-alive (5 s) closes it:
        // reusing one the server is closing that moment fails the request (IncompleteMessage),
        // which a test that drives workers for a few seconds between requests once met.
        http: reqwest::Client::builder()
            .pool_idle_timeout(std::time::Duration::from_secs(2))
            .build()
            .unwrap(),
        clock,
        codes,
        ollama,
    }
}

/// A loopback port on which nothing listens, now or later in the test.
pub fn dead_port() -> u16 {
    // Bound without listening: a connection to it is refused. Held until the test's process
    // ends, so no listener another test opens meanwhile can take the port and answer in a
    // protocol the caller does not speak (a Redis client reading an HTTP answer is a 500, not
    // the 503 of a store that is away).
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = socket.local_addr().unwrap().port();
    std::mem::forget(socket);
    port
}

/// A loopback port free now, for a server the test starts on it itself.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The PostgreSQL address (host, port) of `settings`, for a test's proxy to stand in front of.
pub fn postgres_address(settings: &Settings) -> (String, u16) {
    let config = settings.database.pg_config().unwrap();
    match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(host) => (host.clone(), config.get_ports()[0]),
        other => panic!("a TCP host expected: {other:?}"),
    }
}

/// The database URL of `settings` pointed at a proxy on loopback `port` instead.
pub fn postgres_url_via(settings: &Settings, port: u16) -> String {
    let (host, upstream_port) = postgres_address(settings);
    settings.database.url.expose_secret().replace(
        &format!("{host}:{upstream_port}"),
        &format!("127.0.0.1:{port}"),
    )
}

/// Why `projection` stopped, as its checkpoint row says (`None`: it did not).
pub async fn stopped_reason(client: &tokio_postgres::Client, projection: &str) -> Option<String> {
    client
        .query_one(
            "SELECT stopped_reason FROM projection_checkpoints WHERE projection = $1",
            &[&projection],
        )
        .await
        .unwrap()
        .get(0)
}

/// A plain connection to the test's database, for assertions on stored rows.
pub async fn connect(settings: &Settings) -> tokio_postgres::Client {
    let (client, connection) =
        tokio_postgres::connect(settings.database.url.expose_secret(), tokio_postgres::NoTls)
            .await
            .expect("connect to the test database");
    tokio::spawn(connection);
    client
}

#[test]
fn url_with_database_replaces_only_the_path() {
    assert_eq!(
        url_with_database("postgres://u:p@h:1/db?sslmode=disable", "x"),
        "postgres://u:p@h:1/x?sslmode=disable"
    );
    assert_eq!(url_with_database("postgres://h:1", "x"), "postgres://h:1/x");
}

/// Delete every Redis key of this app but its sessions (as a flush would, without logging the
/// test's users out; other tests share the server).
pub async fn flush_redis(app: &TestApp) {
    let services = app.services();
    let mut connection = services.redis.connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}*", services.redis.key_prefix()))
        .query_async(&mut connection)
        .await
        .unwrap();
    for key in keys.iter().filter(|key| !key.contains("session")) {
        let _: i64 = redis::cmd("DEL")
            .arg(key)
            .query_async(&mut connection)
            .await
            .unwrap();
    }
}

/// Point `settings` at one Redis at `url` (a dead port, a test's own server), cluster or not.
pub fn one_redis_at(settings: &mut Settings, url: String) {
    settings.redis.url = SecretString::from(url);
    settings.redis.cluster_nodes = SecretString::from(String::new());
}

/// A connection to the Redis (or cluster) of `settings`, apart from any process's own.
pub async fn redis_of(settings: &Settings) -> zhihui::platform::redis_store::RedisConnection {
    zhihui::platform::redis_store::RedisStore::new(&settings.redis)
        .unwrap()
        .connection()
        .await
        .unwrap()
}
