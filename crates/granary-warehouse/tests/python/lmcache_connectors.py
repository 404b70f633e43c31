"""LMCache's own remote connectors against a running `granary warehouse`.

Usage: python lmcache_connectors.py RESP_PORT LM_PORT

Runs in an environment with the `lmcache` package from PyPI (0.5.6) and
its dependencies; torch is PyPI's build, which imports and runs on a
machine without a GPU (`torch.cuda.is_available()` is false), so LMCache
runs on its CPU platform: nothing below is replaced or stubbed. Each
connector is built by LMCache's own factory (`CreateConnector`) from a
`remote_url`, exactly as LMCache's remote backend builds it:

- `redis://`  `RedisConnector` (redis-py; `<key>kv_bytes` + `<key>metadata`)
- `resp://`   `RESPConnector`, LMCache's native C++ RESP client
              (`lmcache.lmcache_redis`), one fixed-size value per key
- `valkey://` `ValkeyConnector` on valkey-glide's sync client (valkey-glide-sync)
- `lm://`     `LMCServerConnector`, LMCache's own server protocol

Memory objects come from LMCache's `LocalCPUBackend` allocator, filled
with random KV-shaped tensors; each is stored through the connector, read
back through it, and compared byte for byte. A chunk stored through
`lm://` is then read through `redis://` and the other way round (both use
LMCache's two-key layout). Exits non-zero on the first difference.
"""

import asyncio
import os
import sys
import threading

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

CHUNK = 256
# (layers, K/V, tokens, kv heads, head dim), LMCache's KV_2LTD layout.
KV_SHAPE = (4, 2, CHUNK, 4, 64)
DTYPE = torch.bfloat16


def run(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)


def memory_obj(backend, seed):
    shape = torch.Size([KV_SHAPE[1], KV_SHAPE[0], KV_SHAPE[2], KV_SHAPE[3] * KV_SHAPE[4]])
    obj = backend.allocate(shape, DTYPE, MemoryFormat.KV_2LTD)
    assert obj is not None, "LocalCPUBackend could not allocate"
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(shape, generator=g).to(DTYPE))
    return obj


def key(model, chunk_hash):
    return CacheEngineKey(model, 1, 0, chunk_hash, DTYPE)


def check_roundtrip(name, loop, conn, backend, model, n=4, get_missing=True):
    keys = [key(model, 1000 + i) for i in range(n)]
    assert not run(loop, conn.exists(keys[0])), f"{name}: a fresh key exists"
    sent = []
    for i, k in enumerate(keys):
        obj = memory_obj(backend, seed=hash((name, i)) & 0xFFFF)
        sent.append(bytes(obj.byte_array))
        run(loop, conn.put(k, obj))
    for k, want in zip(keys, sent):
        assert run(loop, conn.exists(k)), f"{name}: {k.to_string()} missing after put"
        got = run(loop, conn.get(k))
        assert got is not None, f"{name}: get returned nothing for {k.to_string()}"
        assert bytes(got.byte_array) == want, f"{name}: {k.to_string()} differs after the round trip"
        assert got.get_shape() == torch.Size([KV_SHAPE[1], KV_SHAPE[0], KV_SHAPE[2], KV_SHAPE[3] * KV_SHAPE[4]])
        assert got.get_dtype() == DTYPE, (name, got.get_dtype())
    assert not run(loop, conn.exists(key(model, 999_999))), f"{name}: a missing key exists"
    if get_missing:
        assert run(loop, conn.get(key(model, 999_999))) is None, f"{name}: a missing key read back something"
    print(f"{name}: {n} chunks of {len(sent[0])} bytes stored and read back byte for byte")
    return keys, sent


def main():
    resp_port, lm_port = int(sys.argv[1]), int(sys.argv[2])
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def connector(url, **extra):
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=False,
            max_local_cpu_size=0.25,
            remote_url=url,
            remote_serde="naive",
            extra_config=extra or None,
        )
        metadata = LMCacheMetadata(
            model_name="granary-test",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=DTYPE,
            kv_shape=KV_SHAPE,
            chunk_size=CHUNK,
        )
        backend = LocalCPUBackend(config, metadata)
        return CreateConnector(url, loop, backend, config, metadata), backend

    redis_conn, redis_backend = connector(f"redis://127.0.0.1:{resp_port}")
    redis_keys, redis_sent = check_roundtrip("redis://", loop, redis_conn, redis_backend, "via-redis")

    lm_conn, lm_backend = connector(f"lm://127.0.0.1:{lm_port}")
    lm_keys, lm_sent = check_roundtrip("lm://", loop, lm_conn, lm_backend, "via-lm")

    # One layout under both protocols.
    for k, want in zip(lm_keys, lm_sent):
        got = run(loop, redis_conn.get(k))
        assert got is not None and bytes(got.byte_array) == want, f"lm:// chunk {k.to_string()} unread by redis://"
    for k, want in zip(redis_keys, redis_sent):
        got = run(loop, lm_conn.get(k))
        assert got is not None and bytes(got.byte_array) == want, f"redis:// chunk {k.to_string()} unread by lm://"
    print("lm:// and redis:// read each other's chunks")

    resp_conn, resp_backend = connector(f"resp://127.0.0.1:{resp_port}", resp_num_threads=2)
    # LMCache's native client never returns from `get` of a missing key
    # (against Redis 7 too); its backend asks `exists` first, and so do we.
    check_roundtrip("resp://", loop, resp_conn, resp_backend, "via-resp", get_missing=False)

    valkey_conn, valkey_backend = connector(f"valkey://127.0.0.1:{resp_port}")
    check_roundtrip("valkey://", loop, valkey_conn, valkey_backend, "via-valkey")

    print("all LMCache connectors passed", flush=True)
    # Not closed one by one: some of LMCache's close() calls wait on worker
    # threads for a minute, and closing is not what is under test.
    os._exit(0)


if __name__ == "__main__":
    main()
