//! Greedy continuation of token ids: `greedy MODEL ID,ID,... STEPS`
//! (`DENSE=1`: f32 weights only; `NATIVE=1`: the GGUF's tensors as stored;
//! `TOPS=1`: print each step's top three logits).
use std::time::Instant;

use granary_engine::model::{Chunk, LoadOptions, Model};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let t = Instant::now();
    let opts = LoadOptions {
        quantized_decode: std::env::var_os("DENSE").is_none(),
        native_quant: std::env::var_os("NATIVE").is_some(),
        ..Default::default()
    };
    let model = Model::load(args[1].as_ref(), &opts)?;
    eprintln!("loaded in {:?}", t.elapsed());
    let ids: Vec<u32> = args[2].split(',').map(|s| s.parse().unwrap()).collect();
    let steps: usize = args.get(3).map_or(16, |s| s.parse().unwrap());
    let mut kv = model.new_kv(256);
    let t = Instant::now();
    let logits = model.forward(&mut [Chunk { tokens: &ids, kv: &mut kv, logits: true }])?.unwrap();
    eprintln!("prefill {} tokens in {:?}", ids.len(), t.elapsed());
    let row = logits.to_vec2::<f32>()?.remove(0);
    let mut top: Vec<(usize, f32)> = row.iter().copied().enumerate().collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    eprintln!("top5 {:?}", &top[..5]);
    let mut next = Model::argmax(&logits)?[0];
    let mut out = vec![next];
    let t = Instant::now();
    for _ in 1..steps {
        let l = model.forward(&mut [Chunk { tokens: &[next], kv: &mut kv, logits: true }])?.unwrap();
        next = Model::argmax(&l)?[0];
        if std::env::var_os("TOPS").is_some() {
            let row = l.to_vec2::<f32>()?.remove(0);
            let mut top: Vec<(usize, f32)> = row.iter().copied().enumerate().collect();
            top.sort_by(|a, b| b.1.total_cmp(&a.1));
            eprintln!("step top3 {:?}", &top[..3]);
        }
        out.push(next);
    }
    eprintln!("decode {} tokens in {:?}", steps - 1, t.elapsed());
    println!("{out:?}");
    Ok(())
}
