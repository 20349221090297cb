//! A flood of logins to random names, and what a real user sees meanwhile.
//!
//! Starts `zhihui serve` (a child process, dispatcher off) twice on a fresh database, each time
//! with its own Redis prefix: first as before admission control (the password-hashing queue
//! unbounded in effect, no per-client login limit), then with the defaults (a bounded hashing
//! queue answering 429 `password-checks-busy` at once, 60 logins per client and minute). Both
//! believe `X-Forwarded-For` so that the flood and the real user are different clients.
//!
//! In each: FLOOD concurrent clients from one address keep logging in to random names for
//! SECONDS; a real user, from another address, logs in and reads `GET /api/v1/account` in turn
//! for the same time. Reported: the real user's login and account p50/p99 (a login counted only
//! when it signed the user in: a refusal is fast and would flatter the figure), the real user's
//! refused logins by answer, and what the flood got (401 wrong credentials, 429 refused at once,
//! errors).
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo build --release -p zhihui -p zhihui-bench && \
//!         target/release/bench_login_flood [FLOOD (1000)] [SECONDS (10)]

#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "../serve/mod.rs"]
mod serve;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use secrecy::SecretString;
use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::cli::bench_support::{Figure, arg, ms, percentile};
use zhihui::platform::configuration::Settings;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let flood: usize = arg(1)?.unwrap_or(1000);
    let seconds: u64 = arg(2)?.unwrap_or(10) as u64;
    zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.redis.url = SecretString::from(
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into()),
            );
        },
        |settings| run(settings, flood, seconds),
    )
    .await
}

struct Outcome {
    /// The real user's logins that signed them in.
    login: Vec<Duration>,
    /// The real user's logins that did not, by answer.
    refused: BTreeMap<String, u64>,
    account: Vec<Duration>,
    flood: BTreeMap<String, u64>,
}

async fn run(settings: Settings, flood: usize, seconds: u64) -> anyhow::Result<Vec<Figure>> {
    let cases: [(&str, &[(&str, &str)]); 2] = [
        (
            "before (unbounded hashing queue, no per-client limit)",
            &[
                ("ZHIHUI_AUTH__PASSWORD_QUEUE_MAX", "1000000"),
                ("ZHIHUI_AUTH__LOGINS_PER_CLIENT_PER_MINUTE", "1000000"),
            ],
        ),
        ("after (defaults)", &[]),
    ];
    let mut figures = Vec::new();
    for (index, (name, env)) in cases.into_iter().enumerate() {
        let mut settings = settings.clone();
        settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
        let mut env = env.to_vec();
        env.push(("ZHIHUI_HTTP__CLIENT_IP_FROM_FORWARDED", "true"));
        env.push(("ZHIHUI_HTTP__WORKERS", "2"));
        let server = serve::start_server(&settings, &env).await?;
        let outcome = case(&server.base, index, flood, seconds).await?;
        drop(server);
        let mut login = outcome.login;
        let mut account = outcome.account;
        login.sort();
        account.sort();
        let p = |samples: &[Duration], q: f64| percentile(samples, q).map_or(0.0, ms);
        println!("{name}:");
        println!(
            "  real user's login:   {} in {seconds} s, p50 {:.1} ms, p99 {:.1} ms",
            login.len(),
            p(&login, 0.5),
            p(&login, 0.99)
        );
        println!(
            "  real user's account: {} in {seconds} s, p50 {:.1} ms, p99 {:.1} ms",
            account.len(),
            p(&account, 0.5),
            p(&account, 0.99)
        );
        let refused: u64 = outcome.refused.values().sum();
        println!(
            "  real user's refused logins: {refused} {:?}",
            outcome.refused
        );
        println!("  the flood got: {:?}", outcome.flood);
        let tag = if index == 0 { "before" } else { "after" };
        figures.push((
            format!("login_flood_{tag}_login_p99"),
            p(&login, 0.99),
            "ms",
        ));
        figures.push((
            format!("login_flood_{tag}_real_user_refused"),
            refused as f64,
            "logins",
        ));
        figures.push((
            format!("login_flood_{tag}_account_p99"),
            p(&account, 0.99),
            "ms",
        ));
    }
    Ok(figures)
}

async fn case(base: &str, index: usize, flood: usize, seconds: u64) -> anyhow::Result<Outcome> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(flood + 4)
        .timeout(Duration::from_secs(120))
        .build()?;
    let name = format!("real{index}");
    let credentials = json!({"username": name, "password": "correct horse battery staple"});
    let user = "198.51.100.10";
    http.post(format!("{base}/api/v1/auth/register"))
        .header("x-forwarded-for", user)
        .json(&credentials)
        .send()
        .await?
        .error_for_status()
        .context("registering the real user")?;
    let until = Instant::now() + Duration::from_secs(seconds);
    let outcomes = Arc::new(std::sync::Mutex::new(BTreeMap::<String, u64>::new()));
    let mut flooders = Vec::with_capacity(flood);
    for _ in 0..flood {
        let http = http.clone();
        let base = base.to_owned();
        let outcomes = outcomes.clone();
        flooders.push(tokio::spawn(async move {
            while Instant::now() < until {
                let mut name = Uuid::new_v4().simple().to_string();
                name.truncate(12);
                let body =
                    json!({"username": format!("x{name}"), "password": "a guessed password"});
                let answer = http
                    .post(format!("{base}/api/v1/auth/login"))
                    .header("x-forwarded-for", "203.0.113.66")
                    .json(&body)
                    .send()
                    .await;
                let key = match answer {
                    Ok(response) => {
                        let status = response.status().as_u16();
                        let problem: Value = response.json().await.unwrap_or(Value::Null);
                        format!(
                            "{status} {}",
                            problem["type"]
                                .as_str()
                                .unwrap_or_default()
                                .trim_start_matches("/problems/")
                        )
                    }
                    Err(error) => format!("error {}", error.without_url()),
                };
                *outcomes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(key)
                    .or_insert(0) += 1;
            }
        }));
    }
    let mut login = Vec::new();
    let mut refused = BTreeMap::<String, u64>::new();
    let mut account = Vec::new();
    while Instant::now() < until {
        let started = Instant::now();
        let response = http
            .post(format!("{base}/api/v1/auth/login"))
            .header("x-forwarded-for", user)
            .json(&credentials)
            .send()
            .await?;
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        let took = started.elapsed();
        let Some(token) = body["token"].as_str() else {
            let problem = body["type"].as_str().unwrap_or_default();
            *refused
                .entry(format!(
                    "{} {}",
                    status.as_u16(),
                    problem.trim_start_matches("/problems/")
                ))
                .or_insert(0) += 1;
            continue;
        };
        login.push(took);
        let started = Instant::now();
        http.get(format!("{base}/api/v1/account"))
            .header("x-forwarded-for", user)
            .bearer_auth(token)
            .send()
            .await?
            .error_for_status()?;
        account.push(started.elapsed());
    }
    for flooder in flooders {
        flooder.await?;
    }
    let flood = outcomes.lock().unwrap_or_else(|e| e.into_inner()).clone();
    Ok(Outcome {
        login,
        refused,
        account,
        flood,
    })
}
