"""Loopback ports for processes that cannot bind port 0 and report what they got (an Envoy listener whose
port a config names, a container engine's published port, a worker restarted on the port it had).

A port bound then released is only free until someone takes it. The kernel hands out source ports for
outgoing connections from the ephemeral range (``ip_local_port_range``), and ``bind(0)`` picks from that
same range, so such a port can be given to any connection on the machine before the test's process binds
it. These come from below the range instead (10000 up to its start), where only an explicit bind can land.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

LOWEST = 10000


def ephemeral_start() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def candidate() -> int:
    """A random port below the ephemeral range (0, the kernel's choice, when the range leaves no room)."""
    low = ephemeral_start()
    return random.randint(LOWEST, low - 1) if low > LOWEST + 1000 else 0


def unused_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports nothing on 127.0.0.1 is bound to now, outside the ephemeral range."""
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        for _ in range(500):
            if len(ports) == count:
                return ports
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                probe.bind(("127.0.0.1", candidate()))
            except OSError:
                probe.close()
                continue
            held.append(probe)
            port = int(probe.getsockname()[1])
            if port not in ports:
                ports.append(port)
    finally:
        for probe in held:
            probe.close()
    if len(ports) == count:
        return ports
    raise OSError(f"no {count} unused TCP ports on 127.0.0.1 in 500 tries")


def unused_port() -> int:
    (port,) = unused_ports(1)
    return port
