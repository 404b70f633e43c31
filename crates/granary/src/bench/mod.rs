//! `granary bench ...`: benchmarks that measure Granary next to its anchors
//! in the same run and print the ratio.

use anyhow::Result;
use clap::Subcommand;

mod child;
mod coldstart;
mod engine;
mod gateway;
mod llm;
mod load;
mod plot;
mod replay;
mod routing;
mod sim;
mod soak;
mod ttft;
mod warehouse;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// The warehouse against Redis, fio, a plain map and the trace's hit-ratio ceiling.
    Warehouse(warehouse::Args),
    /// Time to first token: computed, from engine memory, from disk and from
    /// the remote tier after a restart, next to raw reads of the same bytes.
    Ttft(ttft::Args),
    /// Prefill and decode tok/s at several concurrencies against llama.cpp.
    Engine(engine::Args),
    /// Latency and throughput the gateway adds, against a direct call and nginx proxy_pass.
    Gateway(gateway::Args),
    /// Routing policies replayed over the Mooncake trace on simulated engines: hit rate and TTFT.
    Routing(routing::Args),
    /// Weight load GB/s of the engine's parallel loader against the raw disk and the naive path.
    Load(load::Args),
    /// Request to first token for an unloaded model whose weights are in the registry, on disk or in RAM.
    Coldstart(coldstart::Args),
    /// A long conversation replay (Mooncake trace as real prompts) against `granary serve` or
    /// a cluster: errors, TTFT, RSS and open files, warehouse bytes over time.
    Soak(soak::Args),
}

pub async fn run(which: BenchCmd) -> Result<()> {
    // Every bench draws charts: say what is missing before measuring.
    plot::check_fonts()?;
    match which {
        BenchCmd::Warehouse(args) => warehouse::run(args).await,
        BenchCmd::Ttft(args) => ttft::run(args).await,
        BenchCmd::Engine(args) => engine::run(args).await,
        BenchCmd::Gateway(args) => gateway::run(args).await,
        BenchCmd::Routing(args) => routing::run(args).await,
        BenchCmd::Load(args) => load::run(args).await,
        BenchCmd::Coldstart(args) => coldstart::run(args).await,
        BenchCmd::Soak(args) => soak::run(args).await,
    }
}
