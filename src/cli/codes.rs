//! `zhihui codes issue|export|show|revoke` and `zhihui audit code`.

use std::io::Write;

use anyhow::Context;
use futures::StreamExt;
use uuid::Uuid;
use zhihui_domain::points::Amount;
use zhihui_domain::redeem::{Batch, BatchSpec};

use crate::cli::CodesCommand;
use crate::platform::configuration::Settings;
use crate::platform::event_store::EventMetadata;
use crate::state::AppState;

fn state(settings: &Settings) -> anyhow::Result<AppState> {
    let pool = crate::platform::postgres::build_pool(&settings.database)?;
    AppState::build(settings, pool, crate::state::Overrides::default())
}

fn metadata(command: &str) -> EventMetadata {
    EventMetadata {
        correlation_id: Uuid::now_v7(),
        causation_id: None,
        actor: format!("cli:codes-{command}"),
    }
}

fn describe(out: &mut impl Write, batch: &Batch, redeemed: i64) -> anyhow::Result<()> {
    let status = if batch.revoked_at.is_some() {
        "revoked"
    } else if batch.is_complete() {
        "issued"
    } else {
        "issuing"
    };
    writeln!(out, "batch        {}", batch.batch_id)?;
    writeln!(out, "status       {status}")?;
    writeln!(
        out,
        "codes        {} issued of {}, {redeemed} redeemed",
        batch.issued, batch.spec.count
    )?;
    writeln!(out, "points       {} each", batch.spec.points)?;
    writeln!(
        out,
        "valid        {} .. {}",
        batch.spec.valid_from, batch.spec.valid_until
    )?;
    writeln!(
        out,
        "serials      {} .. {}",
        batch.first_serial,
        batch.first_serial + batch.spec.count - 1
    )?;
    writeln!(out, "key slot     {}", batch.key_slot)?;
    writeln!(out, "note         {}", batch.spec.note)?;
    if let Some(at) = batch.revoked_at {
        writeln!(out, "revoked at   {at}")?;
    }
    Ok(())
}

pub async fn run(settings: &Settings, command: CodesCommand) -> anyhow::Result<()> {
    let state = state(settings)?;
    let codes = &state.codes;
    let mut out = std::io::stdout().lock();
    match command {
        CodesCommand::Issue {
            count,
            points,
            valid_from,
            valid_until,
            note,
        } => {
            let points =
                Amount::parse(points).map_err(|error| anyhow::anyhow!("points: {error}"))?;
            let spec = BatchSpec {
                count,
                points,
                valid_from: valid_from.unwrap_or_else(|| state.clock.now()),
                valid_until,
                note,
            };
            let batch = codes
                .create_batch(Uuid::now_v7(), spec, &metadata("issue"))
                .await
                .map_err(|error| anyhow::anyhow!("{error}"))?;
            let issuer = crate::points::codes::issuer::CodeIssuer::new(codes.clone());
            let pages = issuer.issue_batch(batch.batch_id, None).await?;
            let (batch, _) = codes
                .batch(batch.batch_id)
                .await?
                .context("the batch just created")?;
            writeln!(out, "issued in {pages} page(s) here")?;
            describe(&mut out, &batch, 0)?;
        }
        CodesCommand::Show { batch } => {
            let (batch, _) = codes.batch(batch).await?.context("no such batch")?;
            let redeemed = codes.redeemed_count(batch.batch_id).await?;
            describe(&mut out, &batch, redeemed)?;
        }
        CodesCommand::Revoke { batch, reason } => {
            let batch = codes
                .revoke(batch, reason, &metadata("revoke"))
                .await
                .map_err(|error| anyhow::anyhow!("{error}"))?;
            let redeemed = codes.redeemed_count(batch.batch_id).await?;
            describe(&mut out, &batch, redeemed)?;
        }
        CodesCommand::Export { batch, output } => {
            let (batch, _) = codes.batch(batch).await?.context("no such batch")?;
            let mut sink: Box<dyn Write> = match &output {
                Some(path) => Box::new(std::io::BufWriter::new(
                    std::fs::File::create(path)
                        .with_context(|| format!("creating {}", path.display()))?,
                )),
                None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
            };
            drop(out);
            let mut chunks = std::pin::pin!(codes.export(batch));
            while let Some(chunk) = chunks.next().await {
                sink.write_all(&chunk?).context("writing the export")?;
            }
            sink.flush().context("writing the export")?;
            return Ok(());
        }
    }
    Ok(())
}

/// `zhihui audit code <code>`.
pub async fn audit_code(settings: &Settings, text: &str) -> anyhow::Result<()> {
    let state = state(settings)?;
    let life = state
        .codes
        .life(text)
        .await?
        .with_context(|| format!("{text:?} is not a valid code (malformed or forged)"))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "code         {}", life.code)?;
    writeln!(
        out,
        "serial       {} (key slot {})",
        life.serial, life.key_slot
    )?;
    match &life.batch {
        None => writeln!(out, "batch        none: no batch holds this serial")?,
        Some(batch) => {
            let issued = if batch.has_issued(life.serial) {
                "issued"
            } else {
                "not issued yet"
            };
            writeln!(out, "batch        {} ({issued})", batch.batch_id)?;
            writeln!(
                out,
                "             {} points, valid {} .. {}{}",
                batch.spec.points,
                batch.spec.valid_from,
                batch.spec.valid_until,
                batch
                    .revoked_at
                    .map(|at| format!(", revoked at {at}"))
                    .unwrap_or_default()
            )?;
        }
    }
    match &life.redemption {
        None => writeln!(out, "redeemed     no")?,
        Some(redeemed) => writeln!(
            out,
            "redeemed     by {} at {} for {} points",
            redeemed.user_id, redeemed.at, redeemed.points
        )?,
    }
    match (&life.redemption, &life.credit) {
        (_, Some(credit)) => writeln!(
            out,
            "credited     {} points at {} (operation {}, balance after {})",
            credit.amount, credit.at, credit.operation_id, credit.balance_after.available
        )?,
        (Some(_), None) => writeln!(
            out,
            "credited     NOT YET: the settlement reconciler credits it once it is owed"
        )?,
        (None, None) => {}
    }
    Ok(())
}
