//! README's first flow, run exactly as written: the block between
//! `<!-- first-flow:begin -->` and `<!-- first-flow:end -->` is handed to bash against a started
//! `zhihui serve` (the real binary, translation on and no Ollama listening, as on a new machine)
//! dispatching to a ComfyUI simulator. Only `BASE`, `ZHIHUI` and the process's settings come
//! from the test's environment. The same block with one documented command changed must fail.

#![allow(clippy::unwrap_used)]

use comfyui_sim::{Faults, SimConfig, Simulator};
use secrecy::ExposeSecret;
use uuid::Uuid;

use crate::dispatch::TempDirectory;
use crate::helpers::{dead_port, spawn_app};
use crate::processes::serve_capturing;

/// The README's first-flow block, without its fences.
fn first_flow() -> String {
    let readme = include_str!("../../README.md");
    let begin = readme.find("<!-- first-flow:begin -->").unwrap();
    let end = readme.find("<!-- first-flow:end -->").unwrap();
    let block = &readme[begin..end];
    let code = block
        .split_once("```sh\n")
        .unwrap()
        .1
        .rsplit_once("```")
        .unwrap()
        .0;
    code.to_owned()
}

struct FlowRun {
    succeeded: bool,
    output: String,
    directory: TempDirectory,
}

/// Start a server on a fresh database and run `script` against it with bash, in a directory of
/// its own.
async fn run_flow(script: &str) -> FlowRun {
    let app = spawn_app().await;
    let directory =
        TempDirectory(std::env::temp_dir().join(format!("zhihui-readme-{}", Uuid::now_v7())));
    std::fs::create_dir_all(directory.0.join("work")).unwrap();
    let sim = Simulator::start(SimConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        output_dir: directory.0.join("sim"),
        models: crate::dispatch::catalog_models(),
        faults: Faults::default(),
    })
    .await
    .unwrap();
    let no_ollama = format!("http://127.0.0.1:{}", dead_port());
    let server = serve_capturing(
        &app,
        &format!("gpu-1 {} 1", sim.base_url()),
        &directory.0.join("images"),
        &[
            ("ZHIHUI_TRANSLATION__ENABLED", "true"),
            ("ZHIHUI_TRANSLATION__OLLAMA_URL", no_ollama.as_str()),
        ],
        false,
    )
    .await;
    let settings = &app.settings;
    let output = tokio::process::Command::new("bash")
        .arg("-c")
        .arg(script)
        .current_dir(directory.0.join("work"))
        .env("BASE", &server.address)
        .env("ZHIHUI", env!("CARGO_BIN_EXE_zhihui"))
        .env(
            "ZHIHUI_DATABASE__URL",
            settings.database.url.expose_secret(),
        )
        .env("ZHIHUI_DATABASE__MIGRATE_ON_START", "false")
        .env("ZHIHUI_REDIS__URL", settings.redis.url.expose_secret())
        .env(
            "ZHIHUI_REDIS__CLUSTER_NODES",
            settings.redis.cluster_nodes.expose_secret(),
        )
        .env("ZHIHUI_REDIS__KEY_PREFIX", &settings.redis.key_prefix)
        .env("ZHIHUI_LOG__FILTER", "warn")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(std::time::Duration::from_secs(120), output)
        .await
        .expect("the flow ended within two minutes")
        .unwrap();
    drop(server);
    FlowRun {
        succeeded: output.status.success(),
        output: format!(
            "{}\n--- stderr ---\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
        directory,
    }
}

#[tokio::test]
async fn the_readme_first_flow_runs_as_written_and_breaks_when_a_command_changes() {
    let flow = first_flow();
    // What the flow promises a reader.
    for step in [
        "users create boss --admin",
        "/api/v1/auth/register",
        "/api/v1/admin/accounts/$USER_ID/grants",
        "/api/v1/ws/ticket",
        "ws?ticket=",
        "一只在雪地里奔跑的红狐狸",
        "images inspect fox.png",
        "/api/v1/account",
    ] {
        assert!(flow.contains(step), "the flow lost {step}");
    }
    assert!(!flow.contains("?token="), "no token in a URL");

    let run = run_flow(&flow).await;
    assert!(run.succeeded, "the README flow failed:\n{}", run.output);
    let output = &run.output;
    // The grant, the labels checked, the balance: 10 granted, 1 charged.
    assert!(output.contains("\"granted_now\":true"), "{output}");
    assert!(
        output.contains("PNG tEXt AIGC: ReservedCode1 checks out"),
        "{output}"
    );
    assert!(
        output.contains("\"available\":\"9.00\",\"frozen\":\"0.00\""),
        "{output}"
    );
    // The socket client heard the task through: its place, progress, its end with the image.
    let notices: Vec<serde_json::Value> =
        std::fs::read_to_string(run.directory.0.join("work/notices.jsonl"))
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
    let kinds: Vec<&str> = notices
        .iter()
        .map(|n| n["type"].as_str().unwrap())
        .collect();
    // A place is told only while the task waits: one dispatched before the socket's board read
    // the queue has none to tell (a busy machine), so `position` may be absent, never late.
    if let Some(told) = kinds.iter().position(|kind| *kind == "position") {
        let dispatched = kinds.iter().position(|kind| *kind == "dispatched").unwrap();
        assert!(told < dispatched, "{kinds:?}");
    }
    assert!(kinds.contains(&"dispatched"), "{kinds:?}");
    assert!(kinds.contains(&"progress"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"succeeded"), "{kinds:?}");
    let image = std::fs::read(run.directory.0.join("work/fox.png")).unwrap();
    assert_eq!(&image[..4], b"\x89PNG");

    // One documented command changed (the ticket's path): the flow fails, and says where.
    let broken = flow.replace("/api/v1/ws/ticket", "/api/v1/ws/tickets");
    assert_ne!(broken, flow);
    let run = run_flow(&broken).await;
    assert!(
        !run.succeeded,
        "a changed command went unnoticed:\n{}",
        run.output
    );
    assert!(
        !run.output.contains("\"available\":\"9.00\""),
        "{}",
        run.output
    );
}
