//! `spawn_app()`: a zhihui instance on a free port, with its own freshly migrated database and
//! Redis key prefix, sharing the PostgreSQL and Redis started by `scripts/services.sh`.
//!
//! `DATABASE_URL` names a database the tests may connect to in order to CREATE DATABASE;
//! `REDIS_URL` the Redis. Both default to the local services' ports.

#![allow(clippy::unwrap_used)]

use secrecy::{ExposeSecret, SecretString};
use zhihui::configuration::Settings;
use zhihui::startup::Application;

pub const DEFAULT_DATABASE_URL: &str = "postgres://zhihui@127.0.0.1:55432/zhihui";
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:56379/0";

#[derive(Debug)]
pub struct TestApp {
    pub address: String,
    pub settings: Settings,
    pub http: reqwest::Client,
}

impl TestApp {
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.http
            .get(format!("{}{path}", self.address))
            .send()
            .await
            .expect("request reaches the app")
    }
}

/// Settings for one test: a new database (created and migrated by the caller) and key prefix.
pub fn test_settings(database_name: &str) -> Settings {
    let mut settings = Settings::load(None).expect("default settings load");
    let admin_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
    settings.database.url = SecretString::from(url_with_database(&admin_url, database_name));
    settings.database.pool_max_size = 8;
    settings.redis.url =
        SecretString::from(std::env::var("REDIS_URL").unwrap_or_else(|_| DEFAULT_REDIS_URL.into()));
    settings.redis.key_prefix = format!("test:{database_name}");
    settings.http.port = 0;
    settings.http.workers = Some(1);
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
    let mut settings = test_settings(&database_name);
    customise(&mut settings);
    let application = Application::build(&settings)
        .await
        .expect("application builds");
    let port = application.port();
    tokio::spawn(application.run_until_stopped());
    TestApp {
        address: format!("http://127.0.0.1:{port}"),
        settings,
        http: reqwest::Client::new(),
    }
}

/// A loopback port on which nothing listens (bound, then released).
pub fn dead_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
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
