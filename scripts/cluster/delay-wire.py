#!/usr/bin/env python3
"""A network wire with latency, for kernels built without the netem qdisc.

Joins two TAP devices (each a port of a bridge): every Ethernet frame read
from one is written to the other DELAY later, in both directions, in order.
Put between two bridges, it adds DELAY each way to all traffic crossing it,
as `tc qdisc add ... netem delay DELAY` on both ends of a link would.

    delay-wire.py --delay-ms 2 TAP_A TAP_B

Prints "delay-wire: ready" once both devices are attached, and on SIGTERM
or SIGINT the frames carried each way ("delay-wire: a->b N frames, b->a M
frames, dropped D"). Frames beyond --limit waiting in one direction are
dropped, as netem's queue limit does.
"""

import argparse
import collections
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every frame")
    p.add_argument("--limit", type=int, default=10000, help="frames waiting per direction before drops")
    p.add_argument("tap_a")
    p.add_argument("tap_b")
    args = p.parse_args()
    if args.delay_ms < 0:
        print("delay-wire: --delay-ms must be >= 0", file=sys.stderr)
        return 2
    delay = args.delay_ms / 1000.0
    try:
        a, b = open_tap(args.tap_a), open_tap(args.tap_b)
    except OSError as e:
        print(f"delay-wire: cannot attach {args.tap_a} and {args.tap_b}: {e}", file=sys.stderr)
        return 2
    peer = {a: b, b: a}
    # One FIFO per direction: the delay is constant, so frames leave in the
    # order they came, each at its arrival time plus the delay.
    queues = {a: collections.deque(), b: collections.deque()}  # keyed by destination
    carried = {a: 0, b: 0}
    dropped = 0
    stop = False

    def on_signal(_sig, _frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print("delay-wire: ready", flush=True)
    while not stop:
        now = time.monotonic()
        due = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(due) - now) if due else 0.5
        try:
            readable, _, _ = select.select([a, b], [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for src in readable:
            q = queues[peer[src]]
            while True:
                try:
                    frame = os.read(src, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if len(q) >= args.limit:
                    dropped += 1
                else:
                    q.append((now + delay, frame))
        now = time.monotonic()
        for dst, q in queues.items():
            while q and q[0][0] <= now:
                _, frame = q.popleft()
                try:
                    os.write(dst, frame)
                    carried[dst] += 1
                except OSError:
                    dropped += 1  # the device is down: the frame is lost, as on a wire
    print(f"delay-wire: a->b {carried[b]} frames, b->a {carried[a]} frames, dropped {dropped}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
