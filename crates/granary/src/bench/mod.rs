//! `granary bench ...`: benchmarks that measure Granary next to its anchors
//! in the same run and print the ratio.

use anyhow::Result;
use clap::Subcommand;

mod warehouse;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// The warehouse against Redis, fio, a plain map and the trace's hit-ratio ceiling.
    Warehouse(warehouse::Args),
}

pub async fn run(which: BenchCmd) -> Result<()> {
    match which {
        BenchCmd::Warehouse(args) => warehouse::run(args).await,
    }
}
