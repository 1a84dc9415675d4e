"""A free loopback port for a server a test starts, from outside the kernel's ephemeral range.

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the same range every outgoing connection's
source port and every other port-0 bind draws from. Between a test picking such a port and
``kvray serve`` binding it, the Ray cluster that ``kvray serve`` starts opens dozens of
those; once in a while one took the test's port ("Failed to bind to address"). Ports
between Ray's worker range (10002-19999 by default) and the ephemeral range are handed out
by nobody on their own.
"""

from __future__ import annotations

import random
import socket

LOW = 20000  # above Ray's default worker ports (10002-19999)


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now and that no port-0 bind will be given: random in
    [20000, the ephemeral range's start), checked by binding it; a port-0 one if the gap
    is too small or every try is taken."""
    high = ephemeral_low()
    if high - LOW >= 100:
        for _ in range(50):
            port = random.randrange(LOW, high)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
