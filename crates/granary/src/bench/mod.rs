//! `granary bench ...`: benchmarks that measure Granary next to its anchors
//! in the same run and print the ratio.

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCmd {}

pub async fn run(which: BenchCmd) -> Result<()> {
    match which {}
}
