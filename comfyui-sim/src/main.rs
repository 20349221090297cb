//! The `comfyui-sim` binary: a stand-alone simulated ComfyUI for manual and end-to-end runs,
//! with ComfyUI's flag names. A crash is a real process kill here; faults switch at run time via
//! `GET/POST /sim/faults` (not a ComfyUI route).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::Parser;
use comfyui_sim::{Faults, SimConfig, Simulator};

#[derive(Debug, Parser)]
#[command(name = "comfyui-sim", about = "A simulated ComfyUI 0.3.64 server")]
struct Args {
    /// Address to listen on (ComfyUI's --listen).
    #[arg(long, default_value = "127.0.0.1")]
    listen: IpAddr,
    #[arg(long, default_value_t = 8188)]
    port: u16,
    /// Where SaveImage writes (ComfyUI's --output-directory).
    #[arg(long, default_value = "output")]
    output_directory: PathBuf,
    /// Checkpoint names offered by CheckpointLoaderSimple, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "sd_xl_base_1.0.safetensors"
    )]
    models: Vec<String>,
    /// Milliseconds per sampler step (fault `step_delay_ms`).
    #[arg(long, default_value_t = 0)]
    step_delay_ms: u64,
    /// Milliseconds a prompt of another checkpoint than the one before spends loading it
    /// (fault `model_load_ms`).
    #[arg(long, default_value_t = 0)]
    model_load_ms: u64,
    /// Save PNGs with the fastest compression (fault `fast_png`; for benchmarks).
    #[arg(long)]
    fast_png: bool,
    /// Refuse WebSockets (503) this long after start while HTTP answers, as a starting ComfyUI
    /// does (fault `socket_start_delay_ms`).
    #[arg(long, default_value_t = 0)]
    socket_start_delay_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    comfyui_sim::install_default_tracing();
    let args = Args::parse();
    let sim = Simulator::start(SimConfig {
        bind: SocketAddr::new(args.listen, args.port),
        output_dir: args.output_directory,
        models: args.models,
        faults: Faults {
            step_delay_ms: args.step_delay_ms,
            model_load_ms: args.model_load_ms,
            fast_png: args.fast_png,
            socket_start_delay_ms: args.socket_start_delay_ms,
            ..Faults::default()
        },
    })
    .await?;
    tracing::info!(url = %sim.base_url(), "To see the GUI go to: {} (there is no GUI: this is comfyui-sim)", sim.base_url());
    tokio::signal::ctrl_c().await?;
    sim.stop().await;
    Ok(())
}
