"""Drives the warehouse's RESP server with redis-py on an open server.

Usage: python3 basic.py PORT. Exits non-zero (an AssertionError) on the
first behaviour that differs from what Redis clients expect.
"""

import sys
import time

import redis


def basic(r):
    assert r.ping() is True
    assert r.echo(b"hi") == b"hi"
    assert r.set("k1", b"v1") is True
    assert r.get("k1") == b"v1"
    assert r.get("missing") is None
    assert r.exists("k1", "k1", "missing") == 2
    assert r.strlen("k1") == 2
    assert r.delete("k1", "missing") == 1
    assert r.get("k1") is None
    assert r.unlink("k1") == 0
    binary = bytes(range(256)) * 10
    r.set(b"\xffbin\x00key", binary)
    assert r.get(b"\xffbin\x00key") == binary
    big = b"x" * (3 * 1024 * 1024 + 7)
    r.set("big", big)
    assert r.get("big") == big
    try:
        r.execute_command("NOSUCHCMD", "a")
        raise AssertionError("unknown command accepted")
    except redis.ResponseError as e:
        assert "unknown command 'NOSUCHCMD'" in str(e), str(e)
    try:
        r.execute_command("GET")
        raise AssertionError("wrong arity accepted")
    except redis.ResponseError as e:
        assert "wrong number of arguments for 'get' command" in str(e), str(e)
    info = r.info()
    assert info["redis_version"] == "7.2.0", info
    assert "granary_version" in info
    assert r.dbsize() >= 2
    assert r.config_get("maxmemory")["maxmemory"] == str(256 * 1024 * 1024)
    assert r.config_get("appendonly") == {"appendonly": "no"}
    assert r.client_setname("worker-1") is True
    assert r.client_getname() in ("worker-1", b"worker-1")
    assert r.execute_command("SELECT", 0) in (True, b"OK")


def set_options(r):
    assert r.set("nx", b"1", nx=True) is True
    assert r.set("nx", b"2", nx=True) is None
    assert r.get("nx") == b"1"
    assert r.set("xx", b"1", xx=True) is None
    assert r.get("xx") is None
    assert r.set("nx", b"3", xx=True) is True
    assert r.get("nx") == b"3"
    assert r.set("ex", b"v", ex=100) is True
    assert 99 <= r.ttl("ex") <= 100
    assert r.set("px", b"v", px=250) is True
    assert 0 < r.pttl("px") <= 250
    time.sleep(0.4)
    assert r.get("px") is None, "PX key must expire"
    assert r.ttl("px") == -2
    assert r.ttl("nx") == -1
    assert r.expire("nx", 50) is True
    assert 49 <= r.ttl("nx") <= 50
    assert r.pexpire("nx", 100000) is True
    assert r.persist("nx") is True
    assert r.ttl("nx") == -1
    assert r.expire("missing", 5) is False
    assert r.set("nx", b"4", get=True) == b"3"
    try:
        r.set("bad", b"v", ex=0)
        raise AssertionError("EX 0 accepted")
    except redis.ResponseError as e:
        assert "invalid expire time" in str(e), str(e)
    try:
        r.execute_command("SET", "bad", "v", "NX", "XX")
        raise AssertionError("NX XX accepted")
    except redis.ResponseError as e:
        assert "syntax error" in str(e), str(e)


def multi(r):
    assert r.mset({"m1": b"a", "m2": b"b", "m3": b""}) is True
    assert r.mget(["m1", "nope", "m2", "m3"]) == [b"a", None, b"b", b""]


def pipelines(r):
    p = r.pipeline(transaction=False)
    for i in range(500):
        p.set(f"p:{i}", str(i))
    for i in range(500):
        p.get(f"p:{i}")
    res = p.execute()
    assert res[:500] == [True] * 500
    assert res[500:] == [str(i).encode() for i in range(500)]


def scan(r):
    for i in range(1000):
        r.set(f"scan:{i}", b"v")
    for i in range(100):
        r.set(f"other:{i}", b"v")
    seen = set()
    cursor = 0
    rounds = 0
    while True:
        cursor, keys = r.scan(cursor=cursor, match="scan:*", count=50)
        seen.update(keys)
        rounds += 1
        if cursor == 0:
            break
    assert rounds > 1, "SCAN must page"
    assert seen == {f"scan:{i}".encode() for i in range(1000)}, len(seen)
    assert set(r.scan_iter(match="other:[0-4]")) == {f"other:{i}".encode() for i in range(5)}
    assert set(r.scan_iter(match="other:?", _type="string")) == {f"other:{i}".encode() for i in range(10)}
    assert list(r.scan_iter(match="other:*", _type="hash")) == []


def lmcache(r):
    # LMCache's redis connector: <key>kv_bytes and <key>metadata per chunk.
    k = "vllm@/models/llama@1@0@" + "3f" * 32
    kv = bytes((i * 7) % 256 for i in range(256 * 1024))
    meta = b'{"shape":[2,32,256,8,128],"dtype":"bfloat16"}'
    assert r.exists(k + "metadata") == 0
    r.set(k + "kv_bytes", kv)
    r.set(k + "metadata", meta)
    assert r.exists(k + "metadata") == 1
    assert r.get(k + "kv_bytes") == kv
    assert r.get(k + "metadata") == meta
    assert r.delete(k + "kv_bytes", k + "metadata") == 2
    assert r.exists(k + "metadata") == 0


def resp3(port):
    r3 = redis.Redis(port=port, protocol=3)
    assert r3.set("r3", b"v") is True
    assert r3.get("r3") == b"v"
    assert r3.get("r3-missing") is None
    assert r3.mget(["r3", "r3-missing"]) == [b"v", None]
    r3.close()


def clear(r):
    for k in list(r.scan_iter(count=1000)):
        r.delete(k)
    assert r.dbsize() == 0


def main():
    port = int(sys.argv[1])
    # redis-py 5+ may default to either protocol: run everything under both.
    for proto in (2, 3):
        r = redis.Redis(port=port, protocol=proto)
        basic(r)
        set_options(r)
        multi(r)
        pipelines(r)
        scan(r)
        lmcache(r)
        clear(r)
        r.close()
    resp3(port)
    print("python basic: ok")


if __name__ == "__main__":
    main()
