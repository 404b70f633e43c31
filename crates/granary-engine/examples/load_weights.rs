//! Reads weights with the parallel loader and the naive path and prints
//! where the time went: `load_weights PATH [THREADS]` (a GGUF file, or a
//! directory of safetensors). The page cache is left as it is.
use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use granary_engine::model::load::{self, ReadOptions};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = PathBuf::from(args.get(1).expect("usage: load_weights PATH [THREADS]"));
    let threads = args.get(2).map_or(ReadOptions::default().threads, |t| t.parse().expect("THREADS"));
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        v.sort();
        v
    } else {
        vec![path.clone()]
    };
    let gguf = !path.is_dir();
    for fingerprint in [false, true] {
        let opts = ReadOptions { threads, fingerprint, ..Default::default() };
        let t = Instant::now();
        let stats = if gguf {
            load::read_gguf(&path, &Device::Cpu, &opts)?.stats
        } else {
            load::read_safetensors(&files, b"", &Device::Cpu, &opts)?.stats
        };
        let all = t.elapsed();
        println!(
            "parallel (fingerprint {fingerprint}): header {:.1} ms, read {:.1} ms, {:.2} GB/s; {:.1} ms with dropping the tensors",
            stats.header.as_secs_f64() * 1e3,
            stats.read.as_secs_f64() * 1e3,
            stats.gbps(),
            all.as_secs_f64() * 1e3
        );
    }
    let t = Instant::now();
    let stats = if gguf {
        load::naive_gguf(&path, &Device::Cpu, false)?.stats
    } else {
        load::naive_safetensors(&files, b"", &Device::Cpu, false)?.stats
    };
    println!(
        "naive: {:.1} ms ({:.2} GB/s); {:.1} ms with dropping the tensors",
        stats.read.as_secs_f64() * 1e3,
        stats.gbps(),
        t.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
