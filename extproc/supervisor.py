"""``serve --workers N`` (N > 1): a supervisor that owns no gRPC listener and runs N worker processes.

Worker i is today's server (extproc/app.py) on its own gRPC endpoint (extproc/workers.py:
``<grpc_listen>-i`` or port + i; Envoy's ext_proc cluster lists them all), with its /metrics on a
private Unix socket. The supervisor

- starts the workers (a fresh interpreter each, ``python -c``; stdout and stderr inherited, so their
  log lines go where the supervisor's go) and restarts one that exits, after zeroing its in-flight
  slot (a dead worker holds nothing);
- serves the one ``/metrics`` (each worker's page, scraped at scrape time and merged:
  extproc/observability/merge.py), ``/healthz`` and ``/readyz`` on metrics_listen;
- on SIGTERM or SIGINT: ``/readyz`` answers 503, SIGTERM goes to every worker (each runs its own
  drain), and the supervisor exits 0 once all have exited; a second signal kills them at once.

Workers get SIGTERM when the supervisor dies (PR_SET_PDEATHSIG) and run in their own process group,
so a terminal's Ctrl-C reaches them once, through the supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extproc.config import Settings
from extproc.observability import logs
from extproc.observability.httpserver import HttpServer, Request, Response
from extproc.observability.merge import counters_only, merge_pages
from extproc.workers import SharedBlock, WorkerRole, worker_listen

log = logging.getLogger("extproc.supervisor")
_PR_SET_PDEATHSIG = 1
RESTART_BACKOFF = 1.0  # seconds before restarting a worker that ran less than STEADY_AFTER
STEADY_AFTER = 10.0
SCRAPE_TIMEOUT = 5.0
# After the workers' own drain (drain_timeout), how long before the supervisor kills what is left.
KILL_AFTER_DRAIN = 10.0
EXIT_WORKER_FAILED = 1
EXIT_CONFIG = 2  # as the CLI's


def worker_entry() -> None:
    """A worker process's body: ``python -c`` runs this with the write end of the ready pipe as its
    argument and (settings, role) pickled on stdin. It writes its address to the pipe once listening
    and keeps the pipe open until it exits: the supervisor sees the exit as the pipe's EOF."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    ready_fd, supervisor = int(sys.argv[1]), int(sys.argv[2])
    settings, role = pickle.load(sys.stdin.buffer)  # noqa: S301 (from our own supervisor, over a pipe)
    if os.getppid() != supervisor:  # it died before PR_SET_PDEATHSIG took effect
        sys.exit(EXIT_WORKER_FAILED)
    logs.configure(settings.log_level)
    import uvloop

    from extproc.app import ListenError, serve
    from extproc.config import ConfigError

    def announce(address: str, _metrics_port: int) -> None:
        os.write(ready_fd, address.encode() + b"\n")

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(settings, announce, role))
    except ListenError as exc:
        sys.stderr.write(f"pd-extproc serve: worker {role.index}: {exc}\n")
        sys.exit(EXIT_WORKER_FAILED)
    except ConfigError as exc:  # found only while building the server (a name that does not resolve)
        sys.stderr.write(f"pd-extproc: worker {role.index}: {exc}\n")
        sys.exit(EXIT_CONFIG)


_WORKER_COMMAND = "from extproc.supervisor import worker_entry; worker_entry()"


def _readable(fd: int) -> asyncio.Future[None]:
    """Resolves once ``fd`` is readable (data, or EOF: its writer closed or its process exited)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def done() -> None:
        loop.remove_reader(fd)
        if not future.done():
            future.set_result(None)

    loop.add_reader(fd, done)
    future.add_done_callback(lambda _: loop.remove_reader(fd))
    return future


async def scrape_unix(path: Path) -> str | None:
    """A worker's /metrics page over its private socket; None if it does not answer 200 in time."""
    try:
        async with asyncio.timeout(SCRAPE_TIMEOUT):
            reader, writer = await asyncio.open_unix_connection(str(path))
            try:
                writer.write(b"GET /metrics HTTP/1.0\r\nhost: worker\r\n\r\n")
                await writer.drain()
                raw = await reader.read()  # HTTP/1.0: the worker closes after the response
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return None
    head, _, body = raw.partition(b"\r\n\r\n")
    if head.split(b" ", 2)[1:2] != [b"200"]:
        return None
    return body.decode("utf-8", "replace")


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        count = settings.workers
        self.dir = Path(tempfile.mkdtemp(prefix="pd-extproc-workers-"))
        self.block = SharedBlock.create(self.dir / "block", count)
        self.roles = [WorkerRole(i, count, self.dir / "block", self.dir / f"metrics-{i}.sock") for i in range(count)]
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * count
        self.ready = [False] * count
        self.draining = False
        self.metrics_port = 0
        self._stop = asyncio.Event()
        self._signals = 0
        self.http = HttpServer(self._http)
        # The merged counters keep rising across worker restarts (extproc/observability/merge.py).
        self._last_pages: dict[int, str] = {}  # each worker's last scraped page
        self._retired = ""  # the counts of workers that exited, as of their last scrape
        # How many times each worker's counts went into _retired: a page scraped before its worker was
        # retired is in _retired already and must not be merged again.
        self._retirements = [0] * count
        self._high: dict[str, float] = {}

    def _spawn(self, index: int) -> tuple[subprocess.Popen[bytes], int]:
        """Start worker ``index``; its process and the read end of its ready pipe."""
        read_fd, write_fd = os.pipe()
        settings = dataclasses.replace(self.settings, grpc_listen=worker_listen(self.settings.grpc_listen, index))
        try:
            # Its own process group: a terminal's Ctrl-C reaches the workers once, through the supervisor.
            argv = [sys.executable, "-c", _WORKER_COMMAND, str(write_fd), str(os.getpid())]
            process = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=(write_fd,), process_group=0)
        finally:
            os.close(write_fd)
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            process.stdin.write(pickle.dumps((settings, self.roles[index])))
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
        self.processes[index] = process
        if self.draining:  # the signal was forwarded before this worker existed
            self._kill(process, signal.SIGTERM)
        return process, read_fd

    async def _keep(self, index: int, first: asyncio.Future[int]) -> None:
        """Run worker ``index`` until the supervisor stops; restart it whenever it exits. ``first`` gets
        0 once its first start is ready, or the exit status of a first start that never was (a bad
        setting or a taken port, which a restart would not cure: the supervisor stops)."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            process, ready = self._spawn(index)
            try:
                await _readable(ready)
                ok = bool(os.read(ready, 4096))  # EOF: it exited before it was ready
                self.ready[index] = ok
                if ok:
                    log.info("worker started", extra={"worker": index, "pid": process.pid})
                    if not first.done():
                        first.set_result(0)
                while ok:  # nothing more is written: readable again means EOF, the worker exited
                    await _readable(ready)
                    if not os.read(ready, 4096):
                        break
            finally:
                os.close(ready)
            await asyncio.to_thread(process.wait)
            self.ready[index] = False
            self.block.zero(index)
            self._retire(index)
            if not first.done():
                first.set_result(process.returncode if process.returncode > 0 else EXIT_WORKER_FAILED)
                return
            if self.draining:
                return
            log.warning("worker exited; restarting it", extra={"worker": index, "pid": process.pid,
                                                               "exitcode": process.returncode})
            if loop.time() - started < STEADY_AFTER:
                await asyncio.sleep(RESTART_BACKOFF)
            if self.draining:
                return

    def _retire(self, index: int) -> None:
        last = self._last_pages.pop(index, None)
        if last is not None:
            self._retired = counters_only(merge_pages([self._retired, last]))
        self._retirements[index] += 1

    async def _scrape(self, index: int) -> str | None:
        page = await scrape_unix(self.roles[index].metrics_socket)
        if page is not None and self.ready[index]:  # not a page from a worker that exited meanwhile
            self._last_pages[index] = page
        return page

    @staticmethod
    def _kill(process: subprocess.Popen[bytes] | None, sig: int) -> None:
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)

    def _on_signal(self) -> None:
        self._signals += 1
        if self._signals > 1:  # a second signal: at once
            for process in self.processes:
                self._kill(process, signal.SIGKILL)
        self._stop.set()

    def _begin_drain(self) -> None:
        self.draining = True
        for process in self.processes:
            self._kill(process, signal.SIGTERM)

    async def _http(self, request: Request) -> Response:
        if request.path == "/metrics":
            live = [index for index, ready in enumerate(self.ready) if ready]
            retirements = [self._retirements[index] for index in live]
            scraped = await asyncio.gather(*(self._scrape(index) for index in live))
            pages = [page for index, before, page in zip(live, retirements, scraped, strict=True)
                     if page is not None and self._retirements[index] == before]
            if not pages:
                return Response(503, b'{"status":"no worker answered"}')
            merged = merge_pages([*pages, self._retired], self._high)
            return Response(200, merged.encode(), content_type="text/plain; version=0.0.4; charset=utf-8")
        if request.path == "/healthz":
            return Response(200, b'{"status":"ok"}')
        if request.path == "/readyz":
            if self.draining:
                return Response(503, b'{"status":"draining"}')
            if not any(self.ready):
                return Response(503, b'{"status":"no worker ready"}')
            return Response(200, b'{"status":"ready"}')
        return Response(404, b'{"status":"not found"}')

    async def run(self, on_ready: Callable[[str, int], None] | None) -> int:
        from extproc.app import metrics_listen_error

        listen = self.settings.metrics_listen
        try:
            self.metrics_port = await self.http.start(listen.host, listen.port)
        except OSError as exc:
            raise metrics_listen_error(listen, exc) from None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        firsts: list[asyncio.Future[int]] = [loop.create_future() for _ in self.roles]
        keepers = [asyncio.create_task(self._keep(index, first)) for index, first in enumerate(firsts)]
        stop = asyncio.ensure_future(self._stop.wait())
        started = asyncio.gather(*firsts)
        waiters: list[asyncio.Future[Any]] = [stop, started]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        status = 0
        if not self._stop.is_set():
            failed = [first.result() for first in firsts if first.result() != 0]
            if not failed:
                log.info("workers listening", extra={"workers": len(self.roles), "metrics_port": self.metrics_port,
                                                     "grpc": str(self.settings.grpc_listen)})
                if on_ready is not None:
                    on_ready(str(self.settings.grpc_listen), self.metrics_port)
                await stop
            else:
                log.error("a worker exited before it was ready; stopping", extra={"exitcode": failed[0]})
                status = failed[0]
        stop.cancel()
        log.info("draining", extra={"grace_seconds": self.settings.drain_timeout, "inflight": self.block.total()})
        self._begin_drain()
        _, late = await asyncio.wait(keepers, timeout=self.settings.drain_timeout + KILL_AFTER_DRAIN)
        if late:
            log.error("workers still running after the drain; killing them", extra={"workers": len(late)})
            for process in self.processes:
                self._kill(process, signal.SIGKILL)
            await asyncio.wait(late)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await self.http.close()
        log.info("stopped")
        return status

    def close(self) -> None:
        self.block.close()
        shutil.rmtree(self.dir, ignore_errors=True)


async def supervise(settings: Settings, on_ready: Callable[[str, int], None] | None = None) -> int:
    """Run the workers until SIGTERM or SIGINT; the exit status (0, or a worker's that could not start)."""
    supervisor = Supervisor(settings)
    try:
        return await supervisor.run(on_ready)
    finally:
        supervisor.close()
