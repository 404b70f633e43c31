"""Namespace isolation and authentication through redis-py.

Usage: python3 auth.py PORT. The server has namespaces t1 (token s1) and
t2 (token s2) and the admin token "root".
"""

import sys

import redis


def expect_error(fn, kind, text):
    try:
        fn()
    except kind as e:
        assert text in str(e), f"{text!r} not in {e!r}"
        return
    raise AssertionError(f"expected {kind.__name__} containing {text!r}")


def main():
    port = int(sys.argv[1])

    anon = redis.Redis(port=port, protocol=2)
    expect_error(lambda: anon.get("k"), redis.AuthenticationError, "Authentication required")
    expect_error(lambda: anon.set("k", "v"), redis.AuthenticationError, "Authentication required")
    # RESP3 clients open with HELLO 3, which is refused before authentication.
    expect_error(lambda: redis.Redis(port=port, protocol=3).get("k"), redis.AuthenticationError, "")
    expect_error(lambda: anon.execute_command("AUTH", "wrong"), redis.AuthenticationError, "invalid username-password")
    expect_error(lambda: redis.Redis(port=port, password="wrong").ping(), redis.AuthenticationError, "invalid")
    expect_error(
        lambda: redis.Redis(port=port, username="t2", password="s1").ping(), redis.AuthenticationError, "invalid"
    )

    a = redis.Redis(port=port, password="s1")
    b = redis.Redis(port=port, username="t2", password="s2")
    assert a.ping() and b.ping()
    assert a.set("shared-name", b"from-t1") is True
    assert b.get("shared-name") is None, "t2 read t1's key"
    assert b.exists("shared-name") == 0
    assert b.delete("shared-name") == 0, "t2 deleted t1's key"
    assert a.get("shared-name") == b"from-t1"
    b.set("shared-name", b"from-t2")
    assert a.get("shared-name") == b"from-t1"
    assert b.get("shared-name") == b"from-t2"
    assert list(b.scan_iter()) == [b"shared-name"]
    assert a.dbsize() == 1
    expect_error(lambda: a.flushdb(), redis.ResponseError, "no permissions")
    expect_error(lambda: a.execute_command("NAMESPACE", "t2"), redis.ResponseError, "no permissions")
    assert a.get("shared-name") == b"from-t1"

    # RESP3 with HELLO AUTH.
    r3 = redis.Redis(port=port, protocol=3, username="t2", password="s2")
    assert r3.get("shared-name") == b"from-t2"

    admin = redis.Redis(port=port, password="root")
    assert admin.execute_command("NAMESPACE") == b"default"
    admin.set("admin-key", b"x")
    assert a.get("admin-key") is None
    assert admin.execute_command("NAMESPACE", "t1") == b"OK"
    assert admin.get("shared-name") == b"from-t1"
    assert admin.flushdb() is True
    assert a.get("shared-name") is None, "admin FLUSHDB must empty t1"
    assert b.get("shared-name") == b"from-t2", "FLUSHDB of t1 touched t2"
    print("python auth: ok")


if __name__ == "__main__":
    main()
