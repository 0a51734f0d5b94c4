"""Child processes: start one, wait for its ``ready`` line (extproc/ready.py) or, for Envoy, its admin
endpoint, stop it. Children die with their parent (PR_SET_PDEATHSIG), so a killed ``up`` never leaves
a stray Envoy behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import orjson

from extproc import ready
from extproc.envoy import runner
from extproc.protocol.units import Address

_PR_SET_PDEATHSIG = 1


class StackError(RuntimeError):
    """A child could not start; the message says which and why, for the operator."""


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# util-linux's setpriv sets PR_SET_PDEATHSIG and then execs the command, so the child starts without a
# preexec_fn. A preexec_fn makes subprocess fork() instead of vfork(), and a fork of a process that runs
# gRPC (the test process does) runs gRPC's fork handlers in the child before its exec: they killed an
# emulated worker at start a few times in the full test run ("(event_engine) Epoll1Poller ... epoll_wait
# error: Bad file descriptor" in its log, a process that never imports grpc). One difference: setpriv sets
# the signal after Popen returns, so a parent that dies within that moment leaves the child behind.
_SETPRIV = shutil.which("setpriv")


def launch(argv: Sequence[str], setpriv: str | None = _SETPRIV) -> tuple[list[str], Callable[[], None] | None]:
    """The argv to start and the preexec_fn it needs, for a child that gets SIGTERM when we exit."""
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "TERM", "--", *argv], None
    return list(argv), _die_with_parent


class Child:
    """A child process whose stdout is scanned for a ``ready`` line, then copied to a log file."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path,
                 scan_stdout: bool = True) -> None:
        """``scan_stdout=False``: stdout goes straight to the log file (Envoy's access log), with no
        Python thread copying it line by line; wait_ready is then unavailable."""
        self.name = name
        self.scan_stdout = scan_stdout
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._log: IO[bytes] | None = None
        self.ready_line = ""
        self._pump_thread: threading.Thread | None = None

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        argv, preexec = launch(self.argv)
        self.process = subprocess.Popen(
            argv, env=self.env, stdout=subprocess.PIPE if self.scan_stdout else self._log, stderr=self._log,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec,
        )
        if not self.scan_stdout:
            return
        self._pump_thread = threading.Thread(target=self._pump, name=f"{self.name}-stdout", daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None and self._log is not None
        for raw in self.process.stdout:
            self._lines.put(raw.decode(errors="replace").rstrip("\n"))
            with contextlib.suppress(ValueError):
                self._log.write(raw)
                self._log.flush()
        self._lines.put(None)

    def wait_ready(self, timeout: float) -> str:
        """The child's ``ready ...`` line; raises StackError if it exits or stays silent."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StackError(f"{self.name} did not become ready within {timeout:.0f}s: {self.tail()}")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise StackError(f"{self.name} exited before it was ready: {self.tail()}")
            if ready.is_ready(line):
                self.ready_line = line
                return line

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tail(self, lines: int = 5) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace").strip().splitlines()
            return " | ".join(text[-lines:]) or "(no output)"
        return "(no output)"

    def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._pump_thread is not None:
            self._pump_thread.join(timeout=5)
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self._log is not None:
            self._log.close()
        return self.process.returncode


def python_child(name: str, args: Sequence[str], env: Mapping[str, str], log_dir: Path) -> Child:
    return Child(name, [sys.executable, "-m", "extproc", *args], env, log_dir)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (for tools that cannot bind port 0 and report it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def port_in_use(address: Address) -> bool:
    """True if something already listens on a TCP address (port 0 is never in use)."""
    if address.is_unix or address.port == 0:
        return False
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address.host, address.port))
        except OSError:
            return True
    return False


def find_envoy(envoy_bin: str) -> str:
    try:
        return runner.find_envoy(envoy_bin)
    except runner.EnvoyNotFound as exc:
        raise StackError(str(exc)) from None


@dataclasses.dataclass
class EnvoyProcess:
    child: Child
    admin_path_file: Path
    admin: str = ""

    @classmethod
    def launch(cls, envoy_bin: str, config_path: Path, log_dir: Path, concurrency: int = 2) -> EnvoyProcess:
        admin_file = log_dir / "envoy-admin-address"
        admin_file.unlink(missing_ok=True)
        child = Child("envoy", [
            find_envoy(envoy_bin), "-c", str(config_path), "--disable-hot-restart",
            "--log-level", "warning", "--admin-address-path", str(admin_file),
            "--concurrency", str(concurrency),
        ], os.environ, log_dir, scan_stdout=False)
        child.start()
        return cls(child, admin_file)

    def admin_get(self, path: str, timeout: float = 2.0) -> bytes:
        with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=timeout) as response:
            return bytes(response.read())


    def wait_ready(self, timeout: float) -> str:
        """Wait until Envoy is LIVE; return its listener address ``host:port``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.child.alive():
                raise StackError(f"envoy exited: {self.child.tail()}")
            if not self.admin and self.admin_path_file.exists():
                self.admin = self.admin_path_file.read_text().strip()
            if self.admin:
                with contextlib.suppress(OSError):
                    if self.admin_get("/ready").strip() == b"LIVE":
                        return self.listener_address()
            time.sleep(0.05)
        raise StackError(f"envoy did not become ready within {timeout:.0f}s: {self.child.tail()}")

    def listener_address(self) -> str:
        listeners: Any = orjson.loads(self.admin_get("/listeners?format=json"))
        socket_address = listeners["listener_statuses"][0]["local_address"]["socket_address"]
        host = socket_address["address"]
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{socket_address['port_value']}"

