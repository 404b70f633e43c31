#!/usr/bin/env python3
"""llama.cpp anchor of `granary bench engine`.

Reads one JSON object on stdin:

    {"model": "/path/model.gguf", "prompt": [token ids], "gen_tokens": 64,
     "concurrency": [1, 4, 16], "threads": 2, "batch": 512}

and prints one JSON object on stdout with, per concurrency level, the
prefill and decode throughput of llama.cpp (through llama-cpp-python's
low-level bindings) on the same GGUF and the same prompt ids, greedy.

Every level gets its own context with `n_seq_max = concurrency` and one KV
stream per sequence (`kv_unified = false`, llama-server's default: with a
unified cache every sequence's attention spans all sequences' cells, and
prefill at 16 sequences ran at a fifth of its single-sequence speed). Prefill: each sequence's prompt is evaluated in chunks of
at most `batch` tokens (one `llama_decode` per chunk, sequences one after
the other), and the first token of each is sampled; the prefill time runs
from the first chunk to the last first token. Decode: every step is one
`llama_decode` over one token per sequence (the multi-sequence batch API),
`gen_tokens - 1` steps; the decode time covers those steps. End-of-text
tokens do not stop a sequence, so every level generates exactly
`gen_tokens` per sequence. A short warm-up (its own context) runs first so
page faults on the mapped weights are not timed.

Exit status 0 with `{"error": ...}` when the level cannot run; 2 when
llama_cpp cannot be imported (the caller reports the anchor unavailable).
"""

import ctypes
import json
import sys
import time


def fail(msg, code=1):
    print(json.dumps({"error": msg}))
    sys.exit(code)


try:
    import llama_cpp
    import numpy as np
except Exception as e:  # noqa: BLE001 - any import failure means no anchor
    fail(f"cannot import llama_cpp: {e}", 2)


def quiet_logs():
    """llama.cpp logs every load to stderr; keep only errors."""

    @llama_cpp.llama_log_callback
    def cb(level, text, _user):
        if level == 2 and text:  # GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    return cb  # keep a reference alive


class Context:
    def __init__(self, model, n_seq, n_ctx, threads, batch):
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = batch
        p.n_ubatch = batch
        p.n_seq_max = n_seq
        p.n_threads = threads
        p.n_threads_batch = threads
        p.kv_unified = False
        p.no_perf = False
        self.ctx = llama_cpp.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {n_ctx}, n_seq_max {n_seq})")
        self.batch_cap = max(batch, n_seq)
        self.batch = llama_cpp.llama_batch_init(self.batch_cap, 0, n_seq)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)

    def decode(self, items, top2=None):
        """items: (token, pos, seq, wants_logits); returns argmax per item that wants logits.
        With `top2` (a list), the two highest (id, logit) of the first such item are appended to it."""
        b = self.batch
        assert len(items) <= self.batch_cap
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits else 0
        b.n_tokens = len(items)
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = []
        for i, (_, _, _, logits) in enumerate(items):
            if logits:
                ptr = llama_cpp.llama_get_logits_ith(self.ctx, i)
                row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
                out.append(int(row.argmax()))
                if top2 is not None and len(out) == 1:
                    best = np.argpartition(row, -2)[-2:]
                    best = best[np.argsort(-row[best])]
                    top2.append([[int(t), float(row[t])] for t in best])
        return out

    def perf(self):
        d = llama_cpp.llama_perf_context(self.ctx)
        return {
            "t_p_eval_ms": d.t_p_eval_ms,
            "n_p_eval": d.n_p_eval,
            "t_eval_ms": d.t_eval_ms,
            "n_eval": d.n_eval,
        }


def run_level(model, prompt, gen, n_seq, threads, batch):
    need = n_seq * (len(prompt) + gen + 8)
    n_ctx = -(-need // 256) * 256
    c = Context(model, n_seq, n_ctx, threads, batch)
    try:
        tokens = [[] for _ in range(n_seq)]
        # The first sequence's two best logits at each step (concurrency 1
        # only), so a disagreement with granary shows whether it is a tie.
        top2 = [] if n_seq == 1 else None
        t0 = time.perf_counter()
        for s in range(n_seq):
            for start in range(0, len(prompt), batch):
                chunk = prompt[start : start + batch]
                last = start + len(chunk) == len(prompt)
                items = [(t, start + j, s, last and j == len(chunk) - 1) for j, t in enumerate(chunk)]
                got = c.decode(items, top2 if last else None)
                if last:
                    tokens[s].append(got[0])
        t1 = time.perf_counter()
        for step in range(gen - 1):
            pos = len(prompt) + step
            items = [(tokens[s][-1], pos, s, True) for s in range(n_seq)]
            for s, t in enumerate(c.decode(items, top2)):
                tokens[s].append(t)
        t2 = time.perf_counter()
        prefill_s = t1 - t0
        decode_s = t2 - t1
        decoded = n_seq * (gen - 1)
        return {
            "concurrency": n_seq,
            "prompt_tokens": len(prompt),
            "gen_tokens": gen,
            "n_ctx": n_ctx,
            "prefill_s": prefill_s,
            "prefill_tok_s": n_seq * len(prompt) / prefill_s,
            "decode_tokens": decoded,
            "decode_s": decode_s,
            "decode_tok_s": decoded / decode_s if decode_s > 0 else None,
            "tokens": tokens,
            "top2": top2 or [],
            "perf": c.perf(),
        }
    finally:
        c.close()


def main():
    req = json.load(sys.stdin)
    prompt = [int(t) for t in req["prompt"]]
    gen = int(req.get("gen_tokens", 64))
    threads = int(req.get("threads", 2))
    batch = int(req.get("batch", 512))
    levels = [int(c) for c in req.get("concurrency", [1])]
    if gen < 1 or not prompt:
        fail("need a prompt and gen_tokens >= 1")
    _keep = quiet_logs()
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.use_mmap = True
    model = llama_cpp.llama_model_load_from_file(req["model"].encode(), mp)
    if not model:
        fail(f"llama.cpp could not load {req['model']}")
    out = {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
        "threads": threads,
        "batch": batch,
        "results": [],
        "errors": [],
    }
    try:
        run_level(model, prompt[: min(len(prompt), 32)], 4, 1, threads, batch)  # warm-up
        for n_seq in levels:
            try:
                out["results"].append(run_level(model, prompt, gen, n_seq, threads, batch))
            except Exception as e:  # noqa: BLE001 - reported per level
                out["errors"].append({"concurrency": n_seq, "error": str(e)})
            print(f"llama.cpp: concurrency {n_seq} done", file=sys.stderr, flush=True)
    finally:
        llama_cpp.llama_model_free(model)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
