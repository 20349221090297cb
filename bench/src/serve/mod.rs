//! `zhihui serve` as a child process for the benchmarks that measure it from outside: the
//! release binary next to the benchmark, or `ZHIHUI_BIN` (an older build, for a "before").

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use secrecy::ExposeSecret;
use zhihui::platform::configuration::Settings;

/// The server under test, killed when dropped (not every benchmark reads every field).
#[allow(dead_code)]
pub struct Server {
    pub child: tokio::process::Child,
    pub pid: u32,
    pub base: String,
}

/// Start it on `settings`' database and Redis prefix, a free port, the dispatcher off, with
/// `extra_env` (`ZHIHUI_*` settings); return once `/ready` answers.
pub async fn start_server(
    settings: &Settings,
    extra_env: &[(&str, &str)],
) -> anyhow::Result<Server> {
    let binary = match std::env::var_os("ZHIHUI_BIN") {
        Some(path) => PathBuf::from(path),
        None => std::env::current_exe()?
            .parent()
            .context("this program has no directory")?
            .join("zhihui"),
    };
    anyhow::ensure!(
        binary.exists(),
        "{} not found: build it first (cargo build --release -p zhihui) or set ZHIHUI_BIN",
        binary.display()
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = tokio::process::Command::new(&binary)
        .arg("serve")
        .env(
            "ZHIHUI_DATABASE__URL",
            settings.database.url.expose_secret(),
        )
        .env("ZHIHUI_REDIS__URL", settings.redis.url.expose_secret())
        .env("ZHIHUI_REDIS__KEY_PREFIX", &settings.redis.key_prefix)
        .env("ZHIHUI_HTTP__PORT", port.to_string())
        .env("ZHIHUI_DISPATCH__ENABLED", "false")
        .env("ZHIHUI_LOG__FILTER", "warn")
        .envs(extra_env.iter().copied())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let pid = child.id().context("the server exited at once")?;
    let server = Server {
        child,
        pid,
        base: format!("http://127.0.0.1:{port}"),
    };
    let http = reqwest::Client::new();
    let started = Instant::now();
    loop {
        if let Ok(response) = http.get(format!("{}/ready", server.base)).send().await
            && response.status().is_success()
        {
            return Ok(server);
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(60),
            "the server was not ready within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
