#!/usr/bin/env python3
"""Checks a running Granary engine's OpenAI API with the official `openai` client.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 GRANARY_MODEL_ID=<id> python3 test_openai_api.py

GRANARY_MODEL_ID defaults to the first model the server lists. Prints one
line per check and exits non-zero when any check fails. No test runner is
needed.
"""

import json
import os
import random
import sys
import traceback

import openai

BASE_URL = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
client = openai.OpenAI(
    base_url=BASE_URL,
    api_key=os.environ.get("OPENAI_API_KEY", "unused"),
    max_retries=0,
    timeout=float(os.environ.get("GRANARY_TEST_TIMEOUT", "300")),
)

_model_id = os.environ.get("GRANARY_MODEL_ID")

QUESTION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write two sentences about the sea."},
]
STORY = "Once upon a time, in a small village by the mountains, there lived"


def model_id():
    global _model_id
    if _model_id is None:
        models = client.models.list().data
        assert models, "the server lists no model"
        _model_id = models[0].id
    return _model_id


def context_len():
    """The model's context length, from the `max_model_len` the server adds to its model objects."""
    m = client.models.retrieve(model_id())
    n = (m.model_extra or {}).get("max_model_len")
    assert isinstance(n, int) and n > 0, f"model object has no max_model_len: {m}"
    return n


def check_usage(u, completion_tokens=None):
    assert u is not None, "no usage"
    assert u.prompt_tokens > 0, u
    assert u.completion_tokens > 0, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    assert u.prompt_tokens_details is not None, f"no prompt_tokens_details: {u}"
    cached = u.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= u.prompt_tokens, u
    if completion_tokens is not None:
        assert u.completion_tokens == completion_tokens, f"completion_tokens {u.completion_tokens} != {completion_tokens}"


def chat(**kw):
    args = {"model": model_id(), "messages": QUESTION, "max_tokens": 48, "temperature": 0}
    args.update(kw)
    return client.chat.completions.create(**args)


def chat_stream_text(**kw):
    """(joined text, finish_reason, chunks) of a streamed chat completion."""
    chunks = list(chat(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1, f"expected one finish_reason, got {finishes}"
    return text, finishes[0], chunks


def check_models_listed():
    ids = [m.id for m in client.models.list().data]
    assert model_id() in ids, ids
    assert client.models.retrieve(model_id()).id == model_id()
    assert context_len() > 0


def check_chat_non_stream():
    r = chat()
    assert r.object == "chat.completion", r.object
    assert r.id.startswith("chatcmpl-"), r.id
    assert r.model == model_id(), r.model
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0
    assert c.message.role == "assistant"
    assert c.message.content and c.message.content.strip(), f"empty content: {c.message.content!r}"
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    check_usage(r.usage)
    assert r.usage.completion_tokens <= 48


def check_chat_stream():
    text, finish, chunks = chat_stream_text(stream_options={"include_usage": True})
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1, "chunks of one answer share one id"
    first = chunks[0].choices[0].delta
    assert first.role == "assistant", first
    assert text.strip(), f"empty streamed text: {text!r}"
    assert finish in ("stop", "length"), finish
    last = chunks[-1]
    assert last.choices == [], f"the usage chunk has choices: {last.choices}"
    check_usage(last.usage)
    assert all(c.usage is None for c in chunks[:-1]), "usage before the last chunk"


def check_chat_stream_without_usage():
    text, _, chunks = chat_stream_text()
    assert text.strip()
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks), "a chunk without choices although no usage was asked for"


def check_completion_non_stream_length():
    r = client.completions.create(model=model_id(), prompt=STORY, max_tokens=8, temperature=0)
    assert r.object == "text_completion", r.object
    assert r.id.startswith("cmpl-"), r.id
    c = r.choices[0]
    assert c.text, "empty text"
    assert c.finish_reason == "length", c.finish_reason
    check_usage(r.usage, completion_tokens=8)


def check_completion_stream_length():
    chunks = list(
        client.completions.create(
            model=model_id(), prompt=STORY, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text, "empty streamed text"
    assert finishes == ["length"], finishes
    check_usage(chunks[-1].usage, completion_tokens=8)
    plain = client.completions.create(model=model_id(), prompt=STORY, max_tokens=8, temperature=0)
    assert plain.choices[0].text == text, f"greedy stream {text!r} != non-stream {plain.choices[0].text!r}"


def check_token_id_prompt():
    r = client.completions.create(model=model_id(), prompt=[1, 2, 3], max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == 3, r.usage


def pick_stop(text):
    """A stop string that occurs in `text` after its start: the first word past the first few characters."""
    words = [w for w in text[8:].split() if len(w) >= 3 and w.isalpha()]
    assert words, f"no word to stop at in {text!r}"
    return words[0]


def check_stop_strings():
    base = chat().choices[0].message.content
    stop = pick_stop(base)
    expected = base[: base.find(stop)]
    r = chat(stop=[stop, "@@never@@"])
    c = r.choices[0]
    assert c.finish_reason == "stop", c.finish_reason
    assert stop not in c.message.content, f"{stop!r} in {c.message.content!r}"
    assert c.message.content == expected, f"{c.message.content!r} != {expected!r} (stop {stop!r})"
    check_usage(r.usage)
    text, finish, _ = chat_stream_text(stop=stop)
    assert finish == "stop", finish
    assert text == expected, f"streamed {text!r} != {expected!r} (stop {stop!r})"


def check_seed_reproducible():
    def sample(seed):
        return chat(temperature=0.8, seed=seed, max_tokens=32).choices[0].message.content

    a, b = sample(1234), sample(1234)
    assert a == b, f"same seed, different text: {a!r} vs {b!r}"


def check_unknown_model():
    try:
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=4)
    except openai.NotFoundError as e:
        assert e.status_code == 404
        assert e.code == "model_not_found", e.code
        return
    raise AssertionError("expected NotFoundError")


def check_prompt_over_context():
    limit = context_len()
    prompt = "hello " * (limit * 2)
    try:
        client.completions.create(model=model_id(), prompt=prompt, max_tokens=4)
    except openai.BadRequestError as e:
        assert e.code == "context_length_exceeded", e.code
        assert str(limit) in e.message, f"the message does not state the limit {limit}: {e.message}"
        return
    raise AssertionError("expected BadRequestError")


def check_max_tokens_over_context():
    limit = context_len()
    try:
        chat(max_tokens=limit)
    except openai.BadRequestError as e:
        assert e.code == "context_length_exceeded", e.code
        assert e.param == "max_tokens", e.param
        assert str(limit) in e.message, e.message
        return
    raise AssertionError("expected BadRequestError")


def check_bad_field():
    try:
        chat(temperature=5)
    except openai.BadRequestError as e:
        assert e.param == "temperature", e.param
        assert "temperature" in e.message, e.message
        return
    raise AssertionError("expected BadRequestError")


def check_bad_content_part():
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    try:
        chat(messages=messages)
    except openai.BadRequestError as e:
        assert e.param == "messages[0].content[0].type", e.param
        return
    raise AssertionError("expected BadRequestError")


def check_logprobs():
    r = chat(max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, (len(content), r.usage.completion_tokens)
    for e in content:
        assert e.logprob <= 0, e
        assert len(e.top_logprobs) == 3, e
        # Greedy: the chosen token is the most likely one.
        assert e.top_logprobs[0].token == e.token, e
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5, e


def check_embeddings():
    texts = ["The cat sat on the mat.", "A cat was sitting on the mat.", "Quarterly revenue rose by four percent."]
    # The client asks for base64 unless told otherwise; both must decode.
    r = client.embeddings.create(model=model_id(), input=texts)
    f = client.embeddings.create(model=model_id(), input=texts, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens
    for a, b in zip(r.data, f.data):
        assert len(a.embedding) == len(b.embedding) > 0
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6
        norm = sum(x * x for x in a.embedding) ** 0.5
        assert abs(norm - 1.0) < 1e-3, norm
    v = [d.embedding for d in r.data]
    cos = lambda a, b: sum(x * y for x, y in zip(a, b))
    assert cos(v[0], v[1]) > cos(v[0], v[2]), (cos(v[0], v[1]), cos(v[0], v[2]))


def check_n_choices():
    r = chat(n=3, temperature=1.0, seed=7, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2], r.choices
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens <= 3 * 8


def check_unsupported_fields_are_refused():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    for kw, param in [
        ({"functions": [tool["function"]]}, "functions"),
        ({"extra_body": {"grammar": 'root ::= "a"'}}, "grammar"),
        ({"extra_body": {"spaces_between_special_tokens": False}}, "spaces_between_special_tokens"),
        ({"extra_body": {"min_tokens": 5}}, "min_tokens"),  # more than max_tokens
        ({"store": True}, "store"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [tool], "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
         "response_format.json_schema.schema"),
    ]:
        try:
            chat(max_tokens=4, **kw)
        except openai.BadRequestError as e:
            assert e.param == param, (e.param, param)
            continue
        raise AssertionError(f"{param} was accepted and ignored")
    # Fields that ask nothing of generation pass.
    r = chat(max_tokens=4, user="u-1", metadata={"team": "a"}, store=False)
    assert r.choices[0].message.content is not None


def check_n_choices_streamed():
    """n choices streamed interleave by index and match the same seeds not streamed."""
    kw = dict(messages=QUESTION, n=3, temperature=1.0, seed=11, max_tokens=10)
    whole = chat(**kw)
    stream = client.chat.completions.create(model=model_id(), stream=True, stream_options={"include_usage": True}, **kw)
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2] and sorted(finish) == [0, 1, 2], (texts, finish)
    for c in whole.choices:
        assert texts[c.index] == c.message.content, (c.index, texts[c.index], c.message.content)
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens, (usage, whole.usage)


def check_best_of():
    """best_of returns the candidate with the highest mean token log probability."""
    kw = dict(model=model_id(), prompt=STORY, max_tokens=8, temperature=1.0, seed=7)
    four = client.completions.create(n=4, logprobs=0, **kw)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in four.choices]
    best = client.completions.create(n=1, best_of=4, **kw)
    assert len(best.choices) == 1, best
    want = four.choices[means.index(max(means))].text
    assert best.choices[0].text == want, (best.choices[0].text, want, means)
    assert best.choices[0].logprobs is None, best.choices[0]
    # Every candidate's tokens are counted.
    assert best.usage.completion_tokens == four.usage.completion_tokens, (best.usage, four.usage)


def check_batched_prompts():
    """Several prompts in one completions request: each answered as alone, in order."""
    prompts = ["The capital of France is", "2 + 2 =", STORY]
    kw = dict(model=model_id(), max_tokens=6, temperature=0)
    batch = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in batch.choices] == list(range(6)), batch
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    for c in batch.choices:
        want = alone[c.index // 2].choices[0].text
        assert c.text == want, (c.index, c.text, want)
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone), (batch.usage, [a.usage for a in alone])
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone), batch.usage
    tokens = client.completions.create(prompt=[[1, 2, 3], [4, 5]], **kw)
    assert len(tokens.choices) == 2 and tokens.usage.prompt_tokens == 5, tokens


def check_echo_with_logprobs():
    """echo + logprobs scores the prompt: the scores of tokens the engine generated
    equal those it reports when generating them; max_tokens 0 scores without
    generating (what evaluation harnesses send, batched)."""
    kw = dict(model=model_id(), temperature=0)
    # A prompt no earlier request shares a block with, so that no score
    # comes from a cached block.
    story = f"Story {random.randrange(10**9)}. {STORY}"
    gen = client.completions.create(prompt=story, max_tokens=8, logprobs=2, **kw)
    text = gen.choices[0].text
    scored = client.completions.create(prompt=story + text, echo=True, logprobs=2, max_tokens=0, **kw)
    c = scored.choices[0]
    assert c.text == story + text and c.finish_reason == "length", c
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
    assert len(lp.tokens) == scored.usage.prompt_tokens and scored.usage.completion_tokens == 0, scored.usage
    want = gen.choices[0].logprobs
    assert lp.tokens[-8:] == want.tokens, (lp.tokens[-8:], want.tokens)
    # The same model scores them, in one pass over the sequence instead of
    # a token at a time: equal up to the engine's batching noise (the int8
    # kernels see other row counts; about 0.1 on the default model with
    # 16-token blocks, 1e-4 with the default blocks). A score one position
    # off would miss by far more.
    for got, exp in zip(lp.token_logprobs[-8:], want.token_logprobs):
        assert abs(got - exp) <= 0.25 * max(1.0, abs(exp)), (lp.token_logprobs[-8:], want.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:]), lp.top_logprobs
    # Alternatives come most likely first.
    for top in lp.top_logprobs[1:]:
        assert list(top.values()) == sorted(top.values(), reverse=True), top
    # With a completion, the answer's entries follow the prompt's.
    both = client.completions.create(prompt=story, echo=True, logprobs=1, max_tokens=3, **kw)
    b = both.choices[0].logprobs
    assert len(b.tokens) == both.usage.prompt_tokens + 3, (len(b.tokens), both.usage)
    assert b.text_offset[-3] == len(story), b.text_offset
    # Batched, as lm-evaluation-harness sends loglikelihood requests.
    batch = client.completions.create(prompt=[story, story + text], echo=True, logprobs=1, max_tokens=0, **kw)
    assert [len(x.logprobs.tokens) for x in batch.choices] == [len(lp.tokens) - 8, len(lp.tokens)], batch


def check_ignore_eos():
    """vLLM's ignore_eos (sent by serving benchmarks): the answer runs to max_tokens."""
    kw = dict(model=model_id(), messages=[{"role": "user", "content": "Say hi."}], max_tokens=48, temperature=0)
    short = client.chat.completions.create(**kw, extra_body={"ignore_eos": False})
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 48, short
    long = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 48, long
    # Streamed completions, as vllm bench serve sends them.
    chunks = list(client.completions.create(model=model_id(), prompt=STORY, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "best_of": 1}))
    assert chunks[-1].usage.completion_tokens == 8, chunks[-1]


def check_vllm_stopping_fields():
    """vLLM's min_tokens, stop_token_ids, include_stop_str_in_output and
    skip_special_tokens, as clients written for vLLM send them."""
    import urllib.request

    kw = dict(model=model_id(), messages=[{"role": "user", "content": "Say hi."}], max_tokens=48, temperature=0)
    short = client.chat.completions.create(**kw)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 40, short
    # min_tokens: the end of turn waits; the answer runs at least that far.
    held = client.chat.completions.create(**kw, extra_body={"min_tokens": n + 5})
    assert held.usage.completion_tokens >= n + 5, held
    # stop_token_ids: a token of the free answer (its id from /tokenize) ends it there.
    text = short.choices[0].message.content
    root = BASE_URL.rsplit("/v1", 1)[0]
    body = json.dumps({"model": model_id(), "prompt": text, "add_special_tokens": False}).encode()
    req = urllib.request.Request(f"{root}/tokenize", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        tok = json.loads(r.read())
    ids = tok["tokens"]
    assert len(ids) >= 3, tok
    # Every token of it but the first: the answer ends within it.
    stops = sorted(set(ids[1:]) - {ids[0]})
    cut = client.chat.completions.create(**kw, extra_body={"stop_token_ids": stops})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < n, (ids, cut)
    assert len(cut.choices[0].message.content) < len(text), (text, cut)
    # include_stop_str_in_output: the stop string stays, streamed too.
    base = chat().choices[0].message.content
    stop = pick_stop(base)
    expected = base[: base.find(stop) + len(stop)]
    kept = chat(stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].finish_reason == "stop" and kept.choices[0].message.content == expected, (stop, kept)
    streamed, finish, _ = chat_stream_text(stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert (streamed, finish) == (expected, "stop"), (stop, streamed)
    # skip_special_tokens: false writes the end-of-turn token out once
    # ignore_eos lets the answer run past it.
    past = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    shown = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert "<|im_end|>" not in past.choices[0].message.content, past
    assert "<|im_end|>" in shown.choices[0].message.content, shown

def check_continue_final_message():
    """vLLM's continue_final_message: the answer continues the assistant's
    last message instead of starting a turn of its own."""
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=model_id(), messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = r.choices[0].message.content
    assert "Paris" in text and "capital" not in text, text


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def check_structured_parse():
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]
        coastal: bool

    r = client.chat.completions.parse(
        model=model_id(),
        messages=[{"role": "user", "content": "Describe the city of Paris."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert isinstance(c.message.parsed, City), c.message
    print(f"    parsed: {c.message.parsed!r}")


def check_json_schema_always_parses():
    """100 samples at temperature 1 all parse and follow the schema."""
    import json

    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
            "reason": {"type": "string", "maxLength": 16},
        },
        "required": ["answer", "confidence", "reason"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    samples = []
    while len(samples) < 100:
        r = chat(
            messages=[{"role": "user", "content": "Is the sea salty? Answer in JSON."}],
            response_format=fmt,
            temperature=1.0,
            n=8,
            max_tokens=64,
        )
        for c in r.choices:
            assert c.finish_reason == "stop", c
            samples.append(c.message.content)
    for text in samples[:100]:
        v = json.loads(text)
        assert set(v) == {"answer", "confidence", "reason"}, text
        assert v["answer"] in ("yes", "no", "maybe"), text
        assert isinstance(v["confidence"], int) and 0 <= v["confidence"] <= 100, text
        assert isinstance(v["reason"], str) and len(v["reason"]) <= 16, text
    print(f"    {len(samples[:100])} samples parsed, e.g. {samples[0]}")


def check_json_schema_streamed():
    import json

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    stream = client.chat.completions.create(
        model=model_id(),
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}},
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop", (finish, text)
    v = json.loads(text)
    assert set(v) == {"city", "country"}, text


def check_json_object_mode():
    """JSON mode: the answer is a JSON object from its first character (an
    unconstrained greedy answer to this prompt starts with prose)."""
    import json

    r = chat(
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=40,
    )
    c = r.choices[0]
    assert c.message.content.startswith("{"), c.message.content
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict), c.message.content
    plain = chat(messages=[{"role": "user", "content": "Give the capital of France as JSON."}], temperature=0, max_tokens=8)
    assert not plain.choices[0].message.content.startswith("{"), "the check needs a prompt answered in prose unconstrained"


def check_guided_choice():
    r = chat(
        messages=[{"role": "user", "content": "Is water wet?"}],
        extra_body={"guided_choice": ["yes", "no"]},
        temperature=1.0,
        n=4,
        max_tokens=8,
    )
    assert all(c.message.content in ("yes", "no") for c in r.choices), [c.message.content for c in r.choices]


def check_tool_call_round_trip():
    import json

    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], tool_choice=forced, temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    calls = c.message.tool_calls
    assert calls and len(calls) == 1, c.message
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_"), call
    assert call.function.name == "get_weather", call
    args = json.loads(call.function.arguments)
    assert isinstance(args.get("city"), str) and args["city"], args
    print(f"    call: {call.function.name}({call.function.arguments})")
    # The result goes back as a `tool` message; the model answers in text.
    messages = WEATHER_QUESTION + [
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": args["city"], "weather": "sunny, 24 C"})},
    ]
    r2 = chat(messages=messages, tools=[WEATHER_TOOL], tool_choice="none", temperature=0, max_tokens=60)
    c2 = r2.choices[0]
    assert c2.message.content and not c2.message.tool_calls, c2.message
    assert c2.finish_reason in ("stop", "length"), c2
    print(f"    answer: {c2.message.content!r}")


def check_an_earlier_answer_goes_back_as_it_came():
    """The whole `message` of an answer (nulls included) is accepted as a turn."""
    r = chat(max_tokens=12)
    turn = r.choices[0].message.model_dump()
    assert "refusal" in turn and "function_call" in turn, turn
    messages = QUESTION + [turn, {"role": "user", "content": "Now one more."}]
    r2 = chat(messages=messages, max_tokens=12)
    assert r2.choices[0].message.content, r2
    try:
        chat(messages=QUESTION + [dict(turn, reasoning_content="hidden")], max_tokens=4)
    except openai.BadRequestError as e:
        assert e.param == "messages[2].reasoning_content", e.param
    else:
        raise AssertionError("an unknown message field was accepted and ignored")


def check_tool_call_streamed():
    import json

    stream = client.chat.completions.create(
        model=model_id(),
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    calls, finish, content = {}, None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                if d.function:
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls", (finish, content, calls)
    assert calls and all(v["name"] == "get_weather" and v["id"] for v in calls.values()), calls
    for v in calls.values():
        assert isinstance(json.loads(v["arguments"]).get("city"), str), v
    assert not content.strip(), content


CHECKS = [
    check_models_listed,
    check_chat_non_stream,
    check_chat_stream,
    check_chat_stream_without_usage,
    check_completion_non_stream_length,
    check_completion_stream_length,
    check_token_id_prompt,
    check_stop_strings,
    check_seed_reproducible,
    check_unknown_model,
    check_prompt_over_context,
    check_max_tokens_over_context,
    check_bad_field,
    check_bad_content_part,
    check_logprobs,
    check_embeddings,
    check_n_choices,
    check_n_choices_streamed,
    check_best_of,
    check_batched_prompts,
    check_echo_with_logprobs,
    check_ignore_eos,
    check_vllm_stopping_fields,
    check_continue_final_message,
    check_unsupported_fields_are_refused,
    check_structured_parse,
    check_json_schema_always_parses,
    check_json_schema_streamed,
    check_json_object_mode,
    check_guided_choice,
    check_tool_call_round_trip,
    check_tool_call_streamed,
    check_an_earlier_answer_goes_back_as_it_came,
]


def main():
    failed = 0
    for check in CHECKS:
        name = check.__name__.removeprefix("check_")
        try:
            check()
        except Exception as e:  # noqa: BLE001 - report every failure and go on
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            if os.environ.get("GRANARY_TEST_VERBOSE"):
                traceback.print_exc()
        else:
            print(f"ok   {name}")
        sys.stdout.flush()
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
