//! Times the forward pass: `batch_decode MODEL [BATCH...]`.
//!
//! Prefills `PLEN` tokens (default 512) per sequence in chunks of `CHUNK`
//! (default 512) and prints the prefill rate, then times decode steps over
//! `BATCH` sequences at once.
use std::time::Instant;

use granary_engine::model::{Chunk, LoadOptions, Model};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// CPU seconds this process has used (user + system), all threads.
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let model = Model::load(args[1].as_ref(), &LoadOptions::default())?;
    let plen = env("PLEN", 512);
    let chunk = env("CHUNK", 512);
    for n in args[2..].iter().map(|s| s.parse::<usize>().unwrap()) {
        let mut kvs: Vec<_> = (0..n).map(|_| model.new_kv(256)).collect();
        let t = Instant::now();
        let c0 = cpu_seconds();
        for (i, kv) in kvs.iter_mut().enumerate() {
            let ids: Vec<u32> = (0..plen).map(|t| 100 + ((t * 7 + i) % 5000) as u32).collect();
            for c in ids.chunks(chunk) {
                model.forward(&mut [Chunk { tokens: c, kv, logits: false }])?;
            }
        }
        let pre = t.elapsed().as_secs_f64();
        let pre_cpu = cpu_seconds() - c0;
        let steps = env("STEPS", 8);
        let t = Instant::now();
        let c0 = cpu_seconds();
        for s in 0..steps {
            let toks: Vec<[u32; 1]> = (0..n).map(|i| [200 + (s + i) as u32]).collect();
            let mut chunks: Vec<Chunk> =
                kvs.iter_mut().zip(&toks).map(|(kv, t)| Chunk { tokens: t, kv, logits: true }).collect();
            model.forward(&mut chunks)?;
        }
        let dt = t.elapsed().as_secs_f64();
        let dt_cpu = cpu_seconds() - c0;
        println!(
            "batch {n}: prefill {:.0} tok/s ({plen} tokens, chunks of {chunk}; {:.2} ms CPU/token); \
             decode {:.1} ms/step, {:.1} tok/s ({:.1} ms CPU/step)",
            (n * plen) as f64 / pre,
            pre_cpu * 1e3 / (n * plen) as f64,
            dt * 1e3 / steps as f64,
            (n * steps) as f64 / dt,
            dt_cpu * 1e3 / steps as f64,
        );
    }
    Ok(())
}
