#!/usr/bin/env python3
"""Small random models of every architecture Granary's engine supports,
and llama.cpp's outputs on them: the reference for
crates/granary-engine/tests/architectures.rs.

For each architecture this writes, into --out:

- `<arch>.gguf`: random weights (seeded, F32) in the architecture's GGUF
  layout, written with `gguf` (llama.cpp's own Python writer), with a small
  byte-level BPE vocabulary; features the architecture has are switched on
  and set so that a short prompt exercises them (sliding windows narrower
  than the prompt, Llama 3 rotary frequency factors, Gemma 3's linear
  scaling of its global layers, soft-capping);
- `<arch>-hf/`: the same weights as a Hugging Face directory
  (`config.json`, `model.safetensors`) in transformers' layout: Q and K
  un-permuted for rotary halves (Llama), norm weights stored minus one
  (Gemma);
- for the `llama` architecture, the same model quantized by llama.cpp
  itself (`llama_model_quantize`) to each type in QUANT_TYPES;
- `reference.json`: for every GGUF, the prompt's token ids, llama.cpp's
  logits at every position (teacher forced, `logits_all`), and its greedy
  continuation.

Dependencies (in a virtualenv): `pip install llama-cpp-python==0.3.16 gguf==0.17.1 numpy`.

Usage: python scripts/reference/tiny_models.py --out DIR
"""

import argparse
import ctypes
import json
import os
import struct
import sys

import numpy as np
import gguf
import llama_cpp
from llama_cpp import Llama

PROMPT_LEN = 72
GREEDY_STEPS = 8
QUANT_TYPES = {
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1,
    "Q5_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0,
    "Q5_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_1,
    "Q2_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
    "Q3_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
}

# Hidden size 256 so that K-quants (blocks of 256) apply to every matrix.
HIDDEN = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
FF = 512
LAYERS = 3
CONTEXT = 512


def bytes_to_unicode():
    """GPT-2's byte to printable-character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def vocabulary():
    """A byte-level BPE vocabulary: the 256 bytes, a few merges, two specials."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n"), ("e", "r")]
    for a, b in merges:
        tokens.append(a + b)
    # llama.cpp's Phi-3 vocabulary loader looks up `<|end|>`.
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|end|>"]
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(specials)
    tokens += specials
    return tokens, types, [f"{a} {b}" for a, b in merges]


ARCHS = {
    # name: (feature switches)
    "llama": dict(rope_freqs=True),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True),
    "gemma2": dict(post_norms=True, window=24, softcap=(50.0, 30.0), gemma=True),
    # Six layers: Gemma 3's sixth layer is its first global one.
    "gemma3": dict(post_norms=True, qk_norm=True, window=24, gemma=True, linear_scale=8.0, layers=6),
    "phi3": dict(fused=True),
}


def rand(rng, *shape, scale=None):
    scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def weights(arch, feat, rng, vocab):
    """The model's tensors in Hugging Face terms (halves rotary, norms as
    `1 + w` for Gemma already applied)."""
    q_w, kv_w = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    t = {"embed": rand(rng, vocab, HIDDEN, scale=1.0 if not feat.get("gemma") else 0.1)}
    t["norm"] = (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    if not feat.get("gemma"):
        t["lm_head"] = rand(rng, vocab, HIDDEN)
    for i in range(feat.get("layers", LAYERS)):
        p = f"l{i}."
        t[p + "attn_norm"] = (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        t[p + "ffn_norm"] = (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        t[p + "q"] = rand(rng, q_w, HIDDEN)
        t[p + "k"] = rand(rng, kv_w, HIDDEN)
        t[p + "v"] = rand(rng, kv_w, HIDDEN)
        t[p + "o"] = rand(rng, HIDDEN, q_w)
        t[p + "gate"] = rand(rng, FF, HIDDEN)
        t[p + "up"] = rand(rng, FF, HIDDEN)
        t[p + "down"] = rand(rng, HIDDEN, FF)
        if feat.get("qkv_bias"):
            t[p + "q_bias"] = rand(rng, q_w, scale=0.1)
            t[p + "k_bias"] = rand(rng, kv_w, scale=0.1)
            t[p + "v_bias"] = rand(rng, kv_w, scale=0.1)
        if feat.get("qk_norm"):
            t[p + "q_norm"] = (1.0 + 0.1 * rng.standard_normal(HEAD_DIM)).astype(np.float32)
            t[p + "k_norm"] = (1.0 + 0.1 * rng.standard_normal(HEAD_DIM)).astype(np.float32)
        if feat.get("post_norms"):
            t[p + "attn_post_norm"] = (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
            t[p + "ffn_post_norm"] = (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    return t


def permute(w, n_head):
    """llama.cpp's converter: rotary halves -> interleaved pairs (Q and K of Llama)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors():
    """Frequency factors in Llama 3's shape, scaled to this small model."""
    theta, d, factor, low, high, old = 10000.0, HEAD_DIM, 8.0, 1.0, 4.0, 64.0
    out = []
    for i in range(d // 2):
        inv = 1.0 / theta ** (2 * i / d)
        wavelen = 2 * np.pi / inv
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32), dict(factor=factor, low_freq_factor=low, high_freq_factor=high,
                                                  original_max_position_embeddings=int(old), rope_type="llama3")


def spm_vocabulary():
    """A SentencePiece vocabulary (llama.cpp's `llama` tokenizer model):
    control tokens, the 256 byte tokens, and pieces with scores (earlier is
    higher), built so that merges reach whole words and some characters
    (Cyrillic, emoji) fall back to bytes."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    chars = list("▁etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789.,!?'\"-:;()\t\néüñàç日本語のテキスト")
    words = ["▁t", "he", "▁th", "▁the", "in", "er", "an", "▁a", "on", "re", "▁o", "▁of", "en", "at", "es", "▁de",
             "▁l", "▁la", "ll", "llo", "▁He", "▁Hello", "▁w", "or", "▁wor", "ld", "▁world", "▁c", "af", "▁caf",
             "▁café", "▁é", "té", "▁été", "ter", "▁theater", "ea", "▁tea", "▁m", "▁mer", "▁à", "日本", "日本語"]
    pieces = []
    for p in words + chars:
        if p not in pieces:
            pieces.append(p)
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    types += [gguf.TokenType.NORMAL] * len(pieces)
    return tokens + pieces, types, scores


TOKENIZE_TEXTS = [
    "Hello world",
    "Hello world, the theater of the world.",
    " the theater",
    "  leading spaces and trailing ",
    "l'été à la mer",
    "Ünïcödé café",
    "日本語のテキスト",
    "Привет, мир!",
    "emoji 🙂 here",
    "tabs\tand\nnew\n\nlines",
    "<s>special</s> inside text",
    "1234567890",
    "",
]


def write_gguf(path, arch, feat, t, tokens, types, merges, scores=None):
    w = gguf.GGUFWriter(path, arch)
    # Not the architecture's name: llama.cpp applies per-model token rules by name.
    w.add_name("tiny random model")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(feat.get("layers", LAYERS))
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0 if arch == "gemma3" else 10000.0)
    if feat.get("window"):
        w.add_sliding_window(feat["window"])
    if feat.get("softcap"):
        w.add_attn_logit_softcapping(feat["softcap"][0])
        w.add_final_logit_softcapping(feat["softcap"][1])
    if feat.get("linear_scale"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(feat["linear_scale"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if scores is None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|endoftext|>"))
        w.add_add_bos_token(False)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)

    interleaved = arch == "llama"
    w.add_tensor("token_embd.weight", t["embed"])
    w.add_tensor("output_norm.weight", t["norm"])
    if "lm_head" in t:
        w.add_tensor("output.weight", t["lm_head"])
    if feat.get("rope_freqs"):
        w.add_tensor("rope_freqs.weight", llama3_factors()[0])
    for i in range(feat.get("layers", LAYERS)):
        p, b = f"l{i}.", f"blk.{i}."
        q, k = t[p + "q"], t[p + "k"]
        if interleaved:
            q, k = permute(q, HEADS), permute(k, KV_HEADS)
        w.add_tensor(b + "attn_norm.weight", t[p + "attn_norm"])
        w.add_tensor(b + "ffn_norm.weight", t[p + "ffn_norm"])
        if feat.get("fused"):
            w.add_tensor(b + "attn_qkv.weight", np.concatenate([q, k, t[p + "v"]], axis=0))
            w.add_tensor(b + "ffn_up.weight", np.concatenate([t[p + "gate"], t[p + "up"]], axis=0))
        else:
            w.add_tensor(b + "attn_q.weight", q)
            w.add_tensor(b + "attn_k.weight", k)
            w.add_tensor(b + "attn_v.weight", t[p + "v"])
            w.add_tensor(b + "ffn_gate.weight", t[p + "gate"])
            w.add_tensor(b + "ffn_up.weight", t[p + "up"])
        w.add_tensor(b + "attn_output.weight", t[p + "o"])
        w.add_tensor(b + "ffn_down.weight", t[p + "down"])
        if feat.get("qkv_bias"):
            w.add_tensor(b + "attn_q.bias", t[p + "q_bias"])
            w.add_tensor(b + "attn_k.bias", t[p + "k_bias"])
            w.add_tensor(b + "attn_v.bias", t[p + "v_bias"])
        if feat.get("qk_norm"):
            w.add_tensor(b + "attn_q_norm.weight", t[p + "q_norm"])
            w.add_tensor(b + "attn_k_norm.weight", t[p + "k_norm"])
        if feat.get("post_norms"):
            w.add_tensor(b + "post_attention_norm.weight", t[p + "attn_post_norm"])
            w.add_tensor(b + "post_ffw_norm.weight", t[p + "ffn_post_norm"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        blobs.append(a.tobytes())
        offset += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for blob in blobs:
            f.write(blob)


# transformers' Gemma3TextConfig defaults: a multimodal Gemma 3 checkpoint
# writes its text_config as its differences from these.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
    sliding_window_pattern=6, rope_local_base_freq=10000.0, tie_word_embeddings=True,
)


def write_hf_multimodal(dir_, text, tensors):
    """A Gemma 3 model (the `config.json` and tensors `write_hf` wrote) in
    the layout of a multimodal Gemma 3 checkpoint (google/gemma-3-4b-it and
    up): `model_type` gemma3 with the text model's configuration nested as
    its differences from the defaults, tensors under `language_model.`, and
    a vision tower beside them."""
    os.makedirs(dir_, exist_ok=True)
    diff = {k: v for k, v in text.items() if GEMMA3_TEXT_DEFAULTS.get(k, object()) != v}
    cfg = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", text_config=diff,
               vision_config=dict(model_type="siglip_vision_model", hidden_size=8, num_hidden_layers=1))
    with open(os.path.join(dir_, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    s = {("language_model." + k): v for k, v in tensors.items()}
    rng = np.random.default_rng(3)
    s["vision_tower.vision_model.post_layernorm.weight"] = rng.standard_normal(8).astype(np.float32)
    s["multi_modal_projector.mm_input_projection_weight"] = rng.standard_normal((8, HIDDEN)).astype(np.float32)
    write_safetensors(os.path.join(dir_, "model.safetensors"), s)


def write_hf(dir_, arch, feat, t, vocab):
    os.makedirs(dir_, exist_ok=True)
    model_type = {"gemma3": "gemma3_text"}.get(arch, arch)
    cfg = dict(model_type=model_type, vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FF,
               num_hidden_layers=feat.get("layers", LAYERS), num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
               rms_norm_eps=1e-6, max_position_embeddings=CONTEXT,
               rope_theta=1_000_000.0 if arch == "gemma3" else 10000.0, tie_word_embeddings="lm_head" not in t)
    if feat.get("window"):
        cfg["sliding_window"] = feat["window"]
    if feat.get("softcap"):
        cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"] = feat["softcap"]
    if arch == "gemma3":
        cfg["rope_local_base_freq"] = 10000.0
        cfg["sliding_window_pattern"] = 6
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": feat["linear_scale"]}
    if feat.get("gemma"):
        cfg["query_pre_attn_scalar"] = HEAD_DIM
    if feat.get("rope_freqs"):
        cfg["rope_scaling"] = llama3_factors()[1]
    with open(os.path.join(dir_, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    off = 1.0 if feat.get("gemma") else 0.0
    s = {"model.embed_tokens.weight": t["embed"], "model.norm.weight": t["norm"] - off}
    if "lm_head" in t:
        s["lm_head.weight"] = t["lm_head"]
    for i in range(feat.get("layers", LAYERS)):
        p, b = f"l{i}.", f"model.layers.{i}."
        s[b + "input_layernorm.weight"] = t[p + "attn_norm"] - off
        if feat.get("post_norms"):
            s[b + "post_attention_layernorm.weight"] = t[p + "attn_post_norm"] - off
            s[b + "pre_feedforward_layernorm.weight"] = t[p + "ffn_norm"] - off
            s[b + "post_feedforward_layernorm.weight"] = t[p + "ffn_post_norm"] - off
        else:
            s[b + "post_attention_layernorm.weight"] = t[p + "ffn_norm"]
        if feat.get("fused"):
            s[b + "self_attn.qkv_proj.weight"] = np.concatenate([t[p + "q"], t[p + "k"], t[p + "v"]], axis=0)
            s[b + "mlp.gate_up_proj.weight"] = np.concatenate([t[p + "gate"], t[p + "up"]], axis=0)
        else:
            s[b + "self_attn.q_proj.weight"] = t[p + "q"]
            s[b + "self_attn.k_proj.weight"] = t[p + "k"]
            s[b + "self_attn.v_proj.weight"] = t[p + "v"]
            s[b + "mlp.gate_proj.weight"] = t[p + "gate"]
            s[b + "mlp.up_proj.weight"] = t[p + "up"]
        s[b + "self_attn.o_proj.weight"] = t[p + "o"]
        s[b + "mlp.down_proj.weight"] = t[p + "down"]
        if feat.get("qkv_bias"):
            s[b + "self_attn.q_proj.bias"] = t[p + "q_bias"]
            s[b + "self_attn.k_proj.bias"] = t[p + "k_bias"]
            s[b + "self_attn.v_proj.bias"] = t[p + "v_bias"]
        if feat.get("qk_norm"):
            s[b + "self_attn.q_norm.weight"] = t[p + "q_norm"] - off
            s[b + "self_attn.k_norm.weight"] = t[p + "k_norm"] - off
    write_safetensors(os.path.join(dir_, "model.safetensors"), s)
    return cfg, s


def quantize(src, dst, ftype):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize {dst} failed ({rc})")


def reference(path, prompt):
    """llama.cpp's logits at every prompt position and greedy continuation."""
    llm = Llama(model_path=path, n_ctx=CONTEXT, n_batch=CONTEXT, n_ubatch=CONTEXT, logits_all=True,
                n_threads=2, seed=0, verbose=False)
    llm.eval(prompt)
    n_vocab = llm.n_vocab()
    logits = np.array(llm.scores[: len(prompt)], dtype=np.float32).reshape(len(prompt), n_vocab)
    greedy = []
    last = logits[-1]
    for _ in range(GREEDY_STEPS):
        tok = int(np.argmax(last))
        greedy.append(tok)
        llm.eval([tok])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    del llm
    return {"logits": [[round(float(x), 5) for x in row] for row in logits], "greedy": greedy}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tokens, types, merges = vocabulary()
    rng = np.random.default_rng(20251125)
    # Token ids of ordinary tokens (no specials), the same prompt for every model.
    prompt = [int(x) for x in rng.integers(0, tokens.index("<|endoftext|>"), size=PROMPT_LEN)]
    out = {"generator": "llama-cpp-python " + llama_cpp.__version__, "prompt": prompt, "models": {}}
    for seed, (arch, feat) in enumerate(ARCHS.items()):
        t = weights(arch, feat, np.random.default_rng(1000 + seed), len(tokens))
        path = os.path.join(args.out, f"{arch}.gguf")
        write_gguf(path, arch, feat, t, tokens, types, merges)
        hf_cfg, hf_tensors = write_hf(os.path.join(args.out, f"{arch}-hf"), arch, feat, t, len(tokens))
        out["models"][f"{arch}.gguf"] = dict(arch=arch, hf=f"{arch}-hf", **reference(path, prompt))
        if arch == "gemma3":
            write_hf_multimodal(os.path.join(args.out, "gemma3-mm-hf"), hf_cfg, hf_tensors)
            out["models"][f"{arch}.gguf"]["hf_more"] = ["gemma3-mm-hf"]
        print(f"{arch}: written and run", file=sys.stderr)
        if arch == "llama":
            for name, ftype in QUANT_TYPES.items():
                q = os.path.join(args.out, f"llama-{name}.gguf")
                quantize(path, q, ftype)
                out["models"][f"llama-{name}.gguf"] = dict(arch=arch, quant=name, **reference(q, prompt))
                print(f"llama {name}: quantized and run", file=sys.stderr)
    # A SentencePiece vocabulary on the llama model, for the tokenizer.
    tokens, types, scores = spm_vocabulary()
    t = weights("llama", {}, np.random.default_rng(7), len(tokens))
    path = os.path.join(args.out, "llama-spm.gguf")
    write_gguf(path, "llama", {}, t, tokens, types, None, scores=scores)
    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    out["tokenize"] = {
        "file": "llama-spm.gguf",
        "cases": [[text, llm.tokenize(text.encode(), add_bos=False, special=True)] for text in TOKENIZE_TEXTS],
        "with_bos": llm.tokenize(b"Hello world", add_bos=True, special=True),
        "detokenize": llm.detokenize(llm.tokenize(b"Hello world, the theater", add_bos=False)).decode(),
    }
    del llm
    with open(os.path.join(args.out, "reference.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
