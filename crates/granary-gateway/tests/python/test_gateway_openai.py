#!/usr/bin/env python3
"""Checks a running Granary gateway with the official `openai` client.

    OPENAI_BASE_URL=http://127.0.0.1:8080/v1 OPENAI_API_KEY=<key> \
    GRANARY_LIMITED_KEY=<key allowed 1 request/min> python3 test_gateway_openai.py

Checks: a chat completion and a streamed one through the gateway (with
usage), the model list, a bad key (401, AuthenticationError) and a key over
its limit (429, RateLimitError, Retry-After). Prints one line per check and
exits non-zero when any fails.
"""

import os
import sys
import traceback

import openai

BASE_URL = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8080/v1")
KEY = os.environ["OPENAI_API_KEY"]
LIMITED = os.environ.get("GRANARY_LIMITED_KEY")
TIMEOUT = float(os.environ.get("GRANARY_TEST_TIMEOUT", "300"))


def client(key):
    return openai.OpenAI(base_url=BASE_URL, api_key=key, max_retries=0, timeout=TIMEOUT)


def model_id():
    models = client(KEY).models.list().data
    assert models, "the gateway lists no model"
    return models[0].id


MESSAGES = [{"role": "user", "content": "Name a colour."}]


def check_chat():
    r = client(KEY).chat.completions.create(model=model_id(), messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.choices[0].message.content, r
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage
    assert r.choices[0].finish_reason in ("stop", "length"), r


def check_stream():
    stream = client(KEY).chat.completions.create(
        model=model_id(),
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, chunks = "", None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert chunks >= 2 and text, (chunks, text)
    assert usage is not None and usage.completion_tokens > 0, usage


def check_stream_without_usage():
    stream = client(KEY).completions.create(model=model_id(), prompt="One, two,", max_tokens=4, stream=True)
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks), "usage only when asked"


def check_bad_key():
    try:
        client("gk_bad_0000000000000000").chat.completions.create(model=model_id(), messages=MESSAGES, max_tokens=2)
    except openai.AuthenticationError as e:
        assert e.status_code == 401
        assert e.body and e.body.get("type") == "authentication_error", e.body
        return
    raise AssertionError("a bad key was accepted")


def check_rate_limit():
    if not LIMITED:
        print("skip rate limit: GRANARY_LIMITED_KEY not set")
        return
    c = client(LIMITED)
    c.chat.completions.create(model=model_id(), messages=MESSAGES, max_tokens=2)
    try:
        c.chat.completions.create(model=model_id(), messages=MESSAGES, max_tokens=2)
    except openai.RateLimitError as e:
        assert e.status_code == 429
        assert int(e.response.headers["retry-after"]) >= 1
        assert e.body and e.body.get("type") == "rate_limit_error", e.body
        return
    raise AssertionError("the second request passed a 1 request/min limit")


def main():
    failed = 0
    for check in (check_chat, check_stream, check_stream_without_usage, check_bad_key, check_rate_limit):
        try:
            check()
            print(f"ok   {check.__name__}")
        except Exception:  # noqa: BLE001 - report every failure
            failed += 1
            print(f"FAIL {check.__name__}")
            traceback.print_exc()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
