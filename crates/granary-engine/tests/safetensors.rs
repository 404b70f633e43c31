//! Hugging Face checkpoints (config.json + safetensors + tokenizer.json),
//! also found through a local Hugging Face cache as `hf:owner/name`: the
//! default model converted to that layout (dequantized weights, Q and K
//! rows in Hugging Face's rotary order) gives the GGUF's logits.

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use granary_engine::model::{Chunk, LoadOptions, Model};
use granary_engine::source::resolve_hf;
use granary_tokenizer::Tokenizer;

/// GGUF stores Q and K with each head's rows interleaved for rotary pairs
/// (i, i + 1); Hugging Face pairs (i, i + d/2). Undo the GGUF permutation.
fn unpermute(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    let d = rows / heads;
    w.reshape((heads, d / 2, 2, cols)).unwrap().transpose(1, 2).unwrap().reshape((rows, cols)).unwrap()
}

fn convert(gguf: &Path, out: &Path) {
    let mut f = std::fs::File::open(gguf).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let md = |k: &str| ct.metadata[k].to_u32().unwrap() as usize;
    let (heads, kv_heads) = (md("llama.attention.head_count"), md("llama.attention.head_count_kv"));
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let names: Vec<String> = ct.tensor_infos.keys().cloned().collect();
    for name in names {
        let t = ct.tensor(&mut f, &name, &Device::Cpu).unwrap().dequantize(&Device::Cpu).unwrap();
        let hf = if name == "token_embd.weight" {
            "model.embed_tokens.weight".to_string()
        } else if name == "output_norm.weight" {
            "model.norm.weight".to_string()
        } else if name == "output.weight" {
            "lm_head.weight".to_string()
        } else {
            let rest = name.strip_prefix("blk.").unwrap();
            let (i, part) = rest.split_once('.').unwrap();
            let part = match part {
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                other => panic!("unexpected tensor {other}"),
            };
            format!("model.layers.{i}.{part}")
        };
        let t = if name.ends_with("attn_q.weight") {
            unpermute(&t, heads)
        } else if name.ends_with("attn_k.weight") {
            unpermute(&t, kv_heads)
        } else {
            t
        };
        tensors.insert(hf, t);
    }
    std::fs::create_dir_all(out).unwrap();
    candle_core::safetensors::save(&tensors, out.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "model_type": "llama",
        "vocab_size": ct.metadata["tokenizer.ggml.tokens"].to_vec().unwrap().len(),
        "hidden_size": md("llama.embedding_length"),
        "intermediate_size": md("llama.feed_forward_length"),
        "num_hidden_layers": md("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rope_theta": ct.metadata["llama.rope.freq_base"].to_f32().unwrap(),
        "rms_norm_eps": ct.metadata["llama.attention.layer_norm_rms_epsilon"].to_f32().unwrap(),
        "max_position_embeddings": md("llama.context_length"),
        "tie_word_embeddings": true,
    });
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    Tokenizer::from_gguf_path(gguf).unwrap().save_pretrained(out).unwrap();
}

fn last_logits(model: &Model, ids: &[u32]) -> Vec<f32> {
    let mut kv = model.new_kv(256);
    model
        .forward(&mut [Chunk { tokens: ids, kv: &mut kv, logits: true }])
        .unwrap()
        .unwrap()
        .to_vec2()
        .unwrap()
        .remove(0)
}

#[test]
fn a_hugging_face_checkpoint_from_a_local_hub_mirror_matches_the_gguf() {
    let Some(gguf) = common::default_model() else { return };
    // A Hugging Face cache ("local mirror") holding the converted checkpoint.
    let hub = tempfile::tempdir().unwrap();
    let commit = "5d3f1ab5c0ffee0000000000000000000000cafe";
    let repo = hub.path().join("models--acme--smol-hf");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    let snapshot = repo.join("snapshots").join(commit);
    convert(&gguf, &snapshot);

    let cache = hf_hub::Cache::new(hub.path().to_path_buf());
    let resolved = resolve_hf(&cache, "acme/smol-hf", "main", None).unwrap();
    assert_eq!(resolved.path, snapshot);
    let opts = LoadOptions { quantized_decode: false, ..LoadOptions::default() };
    let hf = Model::load(&resolved.path, &opts).unwrap();
    assert_eq!(hf.config().rope_style, granary_engine::model::RopeStyle::Halves);
    let from_gguf = Model::load(&gguf, &opts).unwrap();

    let tok = Tokenizer::from_file(&resolved.path.join("tokenizer.json")).unwrap();
    let ids = tok.encode("The capital of France is Paris. The capital of Germany is", false).unwrap();
    assert_eq!(
        ids,
        Tokenizer::from_gguf_path(&gguf)
            .unwrap()
            .encode("The capital of France is Paris. The capital of Germany is", false)
            .unwrap()
    );
    let (a, b) = (last_logits(&hf, &ids), last_logits(&from_gguf, &ids));
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    eprintln!("safetensors vs GGUF: max |logit difference| {worst:.5}");
    assert!(worst < 1e-2, "safetensors and GGUF disagree by {worst}");
    let top = a.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).unwrap().0;
    assert_eq!(tok.decode(&[top as u32], true).unwrap(), " Berlin");
}
