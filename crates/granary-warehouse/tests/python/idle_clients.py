"""Holds many idle connections to a server and reports when it closes them.

Usage: idle_clients.py PORT COUNT WAIT_SECONDS

Opens COUNT TCP connections to 127.0.0.1:PORT and sends nothing on them,
prints "open COUNT SECONDS" (the time the opening took), then waits up to WAIT_SECONDS for the server to close
them and prints "closed N SECONDS" (N connections closed by the server,
SECONDS since "open"). A connection answered with bytes before it closed
counts in "answered N". Runs in its own process so that its descriptors
do not count against the test process's limit.
"""

import resource
import selectors
import socket
import sys
import time


def main() -> None:
    port, count, wait = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = count + 64
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    conns = []
    t0 = time.monotonic()
    for i in range(count):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError as e:
            sys.exit(f"connection {i + 1} of {count} failed: {e}")
        s.setblocking(False)
        conns.append(s)
    print(f"open {len(conns)} {time.monotonic() - t0:.2f}", flush=True)
    start = time.monotonic()
    sel = selectors.DefaultSelector()
    for s in conns:
        sel.register(s, selectors.EVENT_READ)
    closed = answered = 0
    open_left = len(conns)
    while open_left and time.monotonic() - start < wait:
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            try:
                data = s.recv(4096)
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            except BlockingIOError:
                continue
            if data:
                answered += 1
                continue
            sel.unregister(s)
            s.close()
            closed += 1
            open_left -= 1
    print(f"answered {answered}", flush=True)
    print(f"closed {closed} {time.monotonic() - start:.2f}", flush=True)


if __name__ == "__main__":
    main()
