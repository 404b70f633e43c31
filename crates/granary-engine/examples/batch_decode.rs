//! Times batched decode steps: `batch_decode MODEL [BATCH...]`.
use std::time::Instant;

use granary_engine::model::{Chunk, LoadOptions, Model};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let model = Model::load(args[1].as_ref(), &LoadOptions::default())?;
    for n in args[2..].iter().map(|s| s.parse::<usize>().unwrap()) {
        let mut kvs: Vec<_> = (0..n).map(|_| model.new_kv(256)).collect();
        for (i, kv) in kvs.iter_mut().enumerate() {
            let plen: usize = std::env::var("PLEN").map_or(512, |v| v.parse().unwrap());
            let ids: Vec<u32> = (0..plen).map(|t| 100 + ((t * 7 + i) % 5000) as u32).collect();
            model.forward(&mut [Chunk { tokens: &ids, kv, logits: false }])?;
        }
        let steps = 8;
        let t = Instant::now();
        for s in 0..steps {
            let toks: Vec<[u32; 1]> = (0..n).map(|i| [200 + (s + i) as u32]).collect();
            let mut chunks: Vec<Chunk> =
                kvs.iter_mut().zip(&toks).map(|(kv, t)| Chunk { tokens: t, kv, logits: true }).collect();
            model.forward(&mut chunks)?;
        }
        let dt = t.elapsed().as_secs_f64();
        println!("batch {n}: {:.1} ms/step, {:.1} tok/s", dt * 1e3 / steps as f64, (n * steps) as f64 / dt);
    }
    Ok(())
}
