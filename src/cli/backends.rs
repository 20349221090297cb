//! `zhihui backends`: the pool of ComfyUI servers from the command line (list, add, drain,
//! resume, remove, reconfigure, inspect), through the same `PoolService` the admin routes use.

use super::*;

/// `zhihui backends ...`.
pub(super) async fn backends(settings: &Settings, command: BackendsCommand) -> anyhow::Result<()> {
    use std::io::Write;

    let state = app_state(settings)?;
    let pool = state.dispatcher.backend_pool();
    let actor = "cli:backends";
    let configured = settings.dispatch.parsed_backends()?;
    let changed = match command {
        BackendsCommand::List { json } => {
            let views = pool.list().await?;
            let differences = pool.differences(&configured).await?;
            let mut out = std::io::stdout().lock();
            if json {
                let differences: Vec<serde_json::Value> = differences
                    .iter()
                    .map(|difference| {
                        serde_json::json!({
                            "difference": difference.to_string(),
                            "apply": difference.command(),
                        })
                    })
                    .collect();
                let listing = serde_json::json!({
                    "backends": views,
                    "configuration_differences": differences,
                });
                serde_json::to_writer_pretty(&mut out, &listing).context("writing JSON")?;
                writeln!(out).context("writing to standard output")?;
                return Ok(());
            }
            writeln!(
                out,
                "{:<16} {:<9} {:>8} {:>9} {:>9} {:>7} {:<10} {:<28} last error",
                "name",
                "state",
                "capacity",
                "in flight",
                "succeeded",
                "failed",
                "version",
                "models"
            )
            .context("writing to standard output")?;
            for view in views {
                let status = view.status.as_ref();
                writeln!(
                    out,
                    "{:<16} {:<9} {:>8} {:>9} {:>9} {:>7} {:<10} {:<28} {}",
                    view.backend.name,
                    view.state,
                    view.backend.capacity,
                    status.map_or("-".to_owned(), |s| s.prompts_in_flight.to_string()),
                    view.tasks_succeeded,
                    view.tasks_failed,
                    view.backend.version.as_deref().unwrap_or("-"),
                    view.backend
                        .models
                        .as_ref()
                        .map_or("-".to_owned(), |models| models.join(",")),
                    status.and_then(|s| s.last_error.as_deref()).unwrap_or("-"),
                )
                .context("writing to standard output")?;
            }
            if !differences.is_empty() {
                writeln!(
                    out,
                    "\ndispatch.backends differs from the pool (the pool is used; `zhihui backends apply-config` applies them all):"
                )
                .context("writing to standard output")?;
                for difference in &differences {
                    writeln!(out, "  {difference}\n    apply: {}", difference.command())
                        .context("writing to standard output")?;
                }
            }
            return Ok(());
        }
        BackendsCommand::ApplyConfig => {
            let applied = pool.apply_configuration(&configured, actor).await?;
            let mut out = std::io::stdout().lock();
            if applied.is_empty() {
                writeln!(
                    out,
                    "the pool is what dispatch.backends says: nothing to apply"
                )
                .context("writing to standard output")?;
                return Ok(());
            }
            let mut refused = 0;
            for (difference, outcome) in &applied {
                match outcome {
                    Ok(()) => writeln!(out, "applied: {difference}"),
                    Err(error) => {
                        refused += 1;
                        writeln!(out, "not applied: {difference}: {error}")
                    }
                }
                .context("writing to standard output")?;
            }
            if refused > 0 {
                anyhow::bail!(
                    "{refused} difference(s) not applied: a server configured away is drained meanwhile; apply again once its prompts have ended"
                );
            }
            return Ok(());
        }
        BackendsCommand::Reconfigure {
            name,
            url,
            capacity,
        } => {
            let backend = zhihui_domain::pool::NewBackend::parse(&name, &url, capacity)?;
            pool.reconfigure(backend, actor)
                .await
                .map(|_| format!("{name} is now {url} with capacity {capacity}"))
        }
        BackendsCommand::Add {
            name,
            url,
            capacity,
        } => {
            let backend = zhihui_domain::pool::NewBackend::parse(&name, &url, capacity)?;
            pool.add(backend, actor)
                .await
                .map(|_| format!("added {name}"))
        }
        BackendsCommand::Drain { name } => pool
            .drain(&name, actor)
            .await
            .map(|_| format!("draining {name}: no new prompt goes there")),
        BackendsCommand::Resume { name } => pool
            .resume(&name, actor)
            .await
            .map(|_| format!("{name} is back in service")),
        BackendsCommand::Remove { name } => pool
            .remove(&name, actor)
            .await
            .map(|_| format!("removed {name}")),
    };
    let message = changed.map_err(|error| anyhow::anyhow!("{error}"))?;
    writeln!(std::io::stdout().lock(), "{message}").context("writing to standard output")?;
    Ok(())
}
