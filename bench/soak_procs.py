"""The soak's processes, driven only through their command lines: ``python -m extproc emulate`` (the
emulated workers), ``python -m extproc serve`` (our server), ``python -m extproc envoy-config`` and
``python -m extproc envoy`` (Envoy under the drain wrapper). Nothing here imports the emulators or the
demo stack; each child's ports are fixed after its first start, so a restart comes back on the same
address (a prefill pod's restart, our server under the same Envoy). Every child writes to a log file
in the run directory.

Also what /proc says about a process: its open fds, RSS, and its TCP connections by peer port.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT = 60.0


class SoakProcessError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: a soak that is killed leaves no worker, server or Envoy behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def parse_ready(line: str) -> dict[str, str]:
    """``ready key=value ...`` (extproc/ready.py's format) as a dict."""
    words = line.split()
    if not words or words[0] != "ready":
        raise ValueError(line)
    return dict(word.split("=", 1) for word in words[1:])


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    ready_line: bool = True  # wait for a ``ready`` line on stdout
    process: asyncio.subprocess.Process | None = None
    ready: dict[str, str] = field(default_factory=dict)
    starts: int = 0
    _pump: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self) -> dict[str, str]:
        log = self.log_path.open("ab")
        log.write(f"--- start {self.starts + 1} at {time.time():.3f}\n".encode())
        log.flush()
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, env=self.env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if self.ready_line else log, stderr=log, start_new_session=True,
            preexec_fn=_die_with_parent)
        self.starts += 1
        if not self.ready_line:
            log.close()
            return {}
        assert self.process.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                raw = await asyncio.wait_for(self.process.stdout.readline(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                raise SoakProcessError(f"{self.name} not ready in {READY_TIMEOUT:.0f}s; see {self.log_path}") from None
            if not raw:
                raise SoakProcessError(f"{self.name} exited before it was ready; see {self.log_path}")
            log.write(raw)
            log.flush()
            line = raw.decode(errors="replace").strip()
            if line == "ready" or line.startswith("ready "):
                self.ready = parse_ready(line)
                break
        self._pump = asyncio.get_running_loop().create_task(self._copy(self.process.stdout, log))
        return self.ready

    @staticmethod
    async def _copy(stream: asyncio.StreamReader, log: object) -> None:
        try:
            while raw := await stream.readline():
                log.write(raw)  # type: ignore[attr-defined]
            log.flush()  # type: ignore[attr-defined]
        finally:
            log.close()  # type: ignore[attr-defined]

    def send(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                assert self.process is not None
                self.process.send_signal(sig)

    async def wait(self, within: float) -> int | None:
        """The exit status, or None if it is still running after ``within`` seconds."""
        assert self.process is not None
        try:
            code = await asyncio.wait_for(self.process.wait(), within)
        except TimeoutError:
            return None
        if self._pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._pump, 5)
        return code

    async def stop(self, sig: int = signal.SIGTERM, within: float = 15.0) -> int | None:
        if self.process is None:
            return None
        self.send(sig)
        code = await self.wait(within)
        if code is None:
            self.send(signal.SIGKILL)
            code = await self.wait(5)
        return code


def python_child(name: str, args: list[str], env: dict[str, str], run_dir: Path, ready: bool = True) -> Child:
    return Child(name, [sys.executable, "-m", "extproc", *args], env, run_dir / f"{name}.log", ready)


# --- what /proc says ------------------------------------------------------------------------------


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


_TCP_STATES = {"01": "established", "08": "close_wait", "06": "time_wait", "0A": "listen"}


def tcp_connections(pid: int) -> Counter[str]:
    """The process's TCP sockets as ``<state>:<peer port>`` (listeners as ``listen:<local port>``)."""
    mine = _socket_inodes(pid)
    found: Counter[str] = Counter()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                parts = line.split()
                if parts[9] not in mine:
                    continue
                state = _TCP_STATES.get(parts[3], parts[3])
                port = int((parts[1] if state == "listen" else parts[2]).rsplit(":", 1)[1], 16)
                found[f"{state}:{port}"] += 1
    return found


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def http_post(url: str, body: bytes, timeout: float = 5.0) -> bytes:
    request = urllib.request.Request(url, data=body, method="POST", headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return bytes(response.read())
