#!/usr/bin/env python3
"""Publishes KV events the way vLLM does, for the gateway's routing tests.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", ...}'``) sends each batch of KV cache events on a ZeroMQ PUB socket as
three frames: the topic, a sequence number (8 bytes, big endian, from 0) and
a MessagePack payload. The payload is a msgspec ``KVEventBatch`` encoded
``array_like``: ``[ts, events, data_parallel_rank]``, each event a tagged
array:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Block hashes are chained over the blocks' tokens (each depends on its
parent) and published as bytes, or as integers (the last 8 bytes, big
endian) when vLLM runs with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.

This publisher binds an XPUB socket (a PUB that also sees subscriptions, so
the test knows when the gateway listens), prints ``port N``, then
``subscribed`` once a subscriber joins, then reads one JSON command a line
from stdin and prints ``sent SEQ`` after each:

    {"store": [token ids], "block_size": 16}    blocks of the prompt, in two events
    {"remove": [token ids], "block_size": 16, "from_block": 1}
    {"clear": true}
    {"restart": true}                           the sequence starts again at 0

Run with: python vllm_kv_publisher.py [--topic T] [--int-hashes]
"""

import argparse
import hashlib
import json
import sys
import time

import msgpack
import zmq


def block_hashes(tokens, block_size, as_int):
    out, parent = [], b""
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        block = tokens[i : i + block_size]
        digest = hashlib.sha256(parent + msgpack.packb(block)).digest()
        parent = digest
        out.append(int.from_bytes(digest[-8:], "big") if as_int else digest)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--topic", default="")
    ap.add_argument("--int-hashes", action="store_true")
    args = ap.parse_args()

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    print(f"port {port}", flush=True)
    sub = pub.recv()
    assert sub[:1] == b"\x01", sub
    print("subscribed", flush=True)

    topic = args.topic.encode()
    seq = 0

    def send(events):
        nonlocal seq
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        print(f"sent {seq}", flush=True)
        seq += 1

    for line in sys.stdin:
        cmd = json.loads(line)
        if "store" in cmd:
            tokens, size = cmd["store"], cmd["block_size"]
            hashes = block_hashes(tokens, size, args.int_hashes)
            # The first block alone, then the rest chained to it: the
            # gateway must follow parent_block_hash across events.
            send(
                [
                    ["BlockStored", hashes[:1], None, tokens[:size], size, None, "GPU"],
                    ["BlockStored", hashes[1:], hashes[0], tokens[size : size * len(hashes)], size, None, "GPU"],
                ]
            )
        elif "remove" in cmd:
            hashes = block_hashes(cmd["remove"], cmd["block_size"], args.int_hashes)
            send([["BlockRemoved", hashes[cmd.get("from_block", 0) :], "GPU"]])
        elif cmd.get("clear"):
            send([["AllBlocksCleared"]])
        elif cmd.get("restart"):
            seq = 0
            print("restarted", flush=True)
        else:
            raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main()
