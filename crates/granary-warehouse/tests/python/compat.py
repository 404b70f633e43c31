"""redis-py features beyond plain commands: transactions (the default
`pipeline()`), KEYS, GETEX, EXPIREAT/PEXPIREAT and CLIENT LIST/SETNAME.

Usage: python3 compat.py PORT. Exits non-zero on the first behaviour that
differs from what Redis clients expect.
"""

import sys
import time

import redis


def expect_error(fn, text):
    try:
        fn()
    except redis.ResponseError as e:
        assert text in str(e), str(e)
        return e
    raise AssertionError(f"no error containing {text!r}")


def transactions(r):
    # redis-py's default pipeline wraps the batch in MULTI ... EXEC.
    p = r.pipeline()
    for i in range(200):
        p.set(f"tx:{i}", str(i))
    p.get("tx:7")
    res = p.execute()
    assert res[:200] == [True] * 200, res[:5]
    assert res[200] == b"7", res[200]
    with r.pipeline() as p:
        p.set("tx:a", b"1").expire("tx:a", 100).ttl("tx:a").get("tx:a").delete("tx:a").exists("tx:a")
        assert p.execute() == [True, True, 100, b"1", 1, 0]
    # An error at run time answers in its slot; the others still run.
    p = r.pipeline()
    p.set("tx:b", b"x").expire("tx:b", "nope").get("tx:b")
    res = p.execute(raise_on_error=False)
    assert res[0] is True and res[2] == b"x", res
    assert isinstance(res[1], redis.ResponseError), res
    # An error while queueing (unknown command) aborts the whole transaction.
    p = r.pipeline()
    p.set("tx:c", b"never")
    p.execute_command("NOSUCHCMD")
    try:
        p.execute()
        raise AssertionError("EXECABORT expected")
    except redis.ResponseError as e:
        assert "EXECABORT" in str(e) or "unknown command" in str(e), str(e)
    assert r.get("tx:c") is None, "an aborted transaction must run nothing"
    # Raw MULTI/EXEC/DISCARD replies.
    assert r.execute_command("MULTI") in (True, b"OK", "OK")
    r.execute_command("SET", "tx:d", "1")  # redis-py maps SET's "QUEUED" to False
    assert r.execute_command("ECHO", "x") in (b"QUEUED", "QUEUED")
    assert r.execute_command("DISCARD") in (True, b"OK", "OK")
    assert r.get("tx:d") is None
    expect_error(lambda: r.execute_command("EXEC"), "EXEC without MULTI")
    expect_error(lambda: r.execute_command("DISCARD"), "DISCARD without MULTI")
    expect_error(lambda: r.execute_command("WATCH", "tx:a"), "WATCH is not supported")
    # A watching pipeline is refused clearly, not silently unsafe.
    expect_error(lambda: r.pipeline().watch("tx:a"), "WATCH is not supported")


def keys(r):
    for i in range(30):
        r.set(f"keys:{i}", b"v")
    r.set("other", b"v")
    assert set(r.keys("keys:*")) == {f"keys:{i}".encode() for i in range(30)}
    assert set(r.keys("keys:1?")) == {f"keys:1{i}".encode() for i in range(10)}
    assert r.keys("nothing*") == []
    assert b"other" in r.keys()


def getex(r):
    r.set("gx", b"v")
    assert r.getex("gx") == b"v"
    assert r.ttl("gx") == -1
    assert r.getex("gx", ex=100) == b"v"
    assert 99 <= r.ttl("gx") <= 100
    assert r.getex("gx", px=50000) == b"v"
    assert 49000 <= r.pttl("gx") <= 50000
    assert r.getex("gx", exat=int(time.time()) + 200) == b"v"
    assert 198 <= r.ttl("gx") <= 200
    assert r.getex("gx", pxat=int(time.time() * 1000) + 300000) == b"v"
    assert 298 <= r.ttl("gx") <= 300
    assert r.getex("gx", persist=True) == b"v"
    assert r.ttl("gx") == -1
    assert r.getex("gx-missing", ex=5) is None
    expect_error(lambda: r.execute_command("GETEX", "gx", "EX", "0"), "invalid expire time in 'getex'")
    expect_error(lambda: r.execute_command("GETEX", "gx", "BOGUS"), "syntax error")
    # A time already past: the value is answered and the key is gone.
    assert r.getex("gx", pxat=1) == b"v"
    assert r.get("gx") is None


def expireat(r):
    r.set("ea", b"v")
    assert r.expireat("ea", int(time.time()) + 100) is True
    assert 98 <= r.ttl("ea") <= 100
    assert r.pexpireat("ea", int(time.time() * 1000) + 50000) is True
    assert 48 <= r.ttl("ea") <= 50
    # NX: only without an expiry; GT: only later.
    assert r.expireat("ea", int(time.time()) + 500, nx=True) is False
    assert r.expireat("ea", int(time.time()) + 500, gt=True) is True
    assert 498 <= r.ttl("ea") <= 500
    assert r.expireat("ea-missing", int(time.time()) + 100) is False
    assert r.expireat("ea", int(time.time()) - 10) is True
    assert r.get("ea") is None


def clients(port):
    a = redis.Redis(port=port)
    b = redis.Redis(port=port)
    assert a.client_setname("worker-a") is True
    assert b.client_setname("worker-b") is True
    assert a.client_getname() in ("worker-a", b"worker-a")
    names = {c["name"] for c in a.client_list()}
    assert {"worker-a", "worker-b"} <= names, names
    mine = a.client_list(client_id=[a.client_id()])
    assert [c["name"] for c in mine] == ["worker-a"], mine
    b.close()
    for _ in range(100):
        if "worker-b" not in {c["name"] for c in a.client_list()}:
            break
        time.sleep(0.02)
    assert "worker-b" not in {c["name"] for c in a.client_list()}, "a closed client stays listed"
    a.close()


def main():
    port = int(sys.argv[1])
    for proto in (2, 3):
        r = redis.Redis(port=port, protocol=proto)
        transactions(r)
        keys(r)
        getex(r)
        expireat(r)
        for k in r.keys():
            r.delete(k)
        r.close()
    clients(port)
    print("python compat: ok")


if __name__ == "__main__":
    main()
