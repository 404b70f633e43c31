//! Prefill in one chunk vs token by token: the last logits must agree.
use granary_engine::model::{Chunk, LoadOptions, Model};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let opts = LoadOptions { quantized_decode: false, ..Default::default() };
    let model = Model::load(args[1].as_ref(), &opts)?;
    let ids: Vec<u32> = args[2].split(',').map(|s| s.parse().unwrap()).collect();
    let mut kv = model.new_kv(256);
    let a =
        model.forward(&mut [Chunk { tokens: &ids, kv: &mut kv, logits: true }])?.unwrap().to_vec2::<f32>()?.remove(0);
    let mut kv2 = model.new_kv(256);
    let mut b = vec![];
    for t in &ids {
        b = model
            .forward(&mut [Chunk { tokens: std::slice::from_ref(t), kv: &mut kv2, logits: true }])?
            .unwrap()
            .to_vec2::<f32>()?
            .remove(0);
    }
    let mut kv3 = model.new_kv(256);
    let half = ids.len() / 2;
    model.forward(&mut [Chunk { tokens: &ids[..half], kv: &mut kv3, logits: false }])?;
    let c = model
        .forward(&mut [Chunk { tokens: &ids[half..], kv: &mut kv3, logits: true }])?
        .unwrap()
        .to_vec2::<f32>()?
        .remove(0);
    let d = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
    println!("one chunk vs token by token: {}; vs two chunks: {}", d(&a, &b), d(&a, &c));
    Ok(())
}
