"""The soak's stack: emulated prefill and decode workers, our server and Envoy, each a child process
started through the CLI (bench/soak_procs.py), with every port fixed at first start so restarts come
back where the others expect them. The emulators are scripted only through their HTTP control API
(/_emulator/script, /_emulator/gauges, /_emulator/requests, /_emulator/reset).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.soak_procs import Child, SoakProcessError, free_port, http_get, http_post, python_child


@dataclass(frozen=True)
class EngineProfile:
    """What the soak needs to know of one engine: its adapter, emulator options, the decode queue gauge,
    and how to read the handoff a prefill record granted and a decode record used."""

    engine: str
    adapter: str
    queue_gauge: str
    emulator_args: tuple[str, ...] = ()
    slow_decode: tuple[tuple[str, float], ...] = ()  # a decode behaviour that slows a stream, if the emulator has one
    lease_flag: str = "--lease"  # the emulator option for how long unclaimed KV is held
    server_env: tuple[tuple[str, str], ...] = ()
    shared_key: tuple[str, str] = ("", "")  # (our setting, the emulators' flag) of a key both sides read
    held_metric: str = ""  # the prefill emulator's gauge of KV it still holds ("" = not exposed)
    concurrent: bool = False  # decode starts before the prefill answers (SGLang)
    passthrough: str = "ok"  # what the decode worker answers a request without a handoff

    def granted(self, record: dict[str, Any]) -> str | None:
        """The handoff id a prefill record granted (None: no handoff)."""
        notes = record.get("notes") or {}
        if self.engine == "vllm":
            value = notes.get("remote_request_id")
        elif self.engine == "trtllm":
            value = notes.get("ctx_request_id")
        else:  # SGLang: the room our server chose, registered by the prefill request
            value = (record.get("json") or {}).get("bootstrap_room")
        return None if value is None else str(value)

    def used(self, record: dict[str, Any]) -> tuple[str | None, bool]:
        """The handoff id a decode record carried, and whether its KV load succeeded."""
        body = record.get("json") or {}
        notes = record.get("notes") or {}
        if self.engine == "vllm":
            params = body.get("kv_transfer_params")
            if not isinstance(params, dict):
                return None, False
            return str(params.get("remote_request_id")), notes.get("load") == "ok"
        if self.engine == "trtllm":
            params = body.get("disaggregated_params")
            if not isinstance(params, dict):
                return None, False
            return str(params.get("ctx_request_id")), notes.get("kv") == "ok"
        room = body.get("bootstrap_room")
        return (None if room is None else str(room)), notes.get("transfer") == "ok"


PROFILES = {
    "vllm": EngineProfile("vllm", "vllm_nixl", "vllm:num_requests_waiting", slow_decode=(("token_interval", 0.05),),
                          held_metric="emulator_kv_leases_outstanding"),
    "sglang": EngineProfile("sglang", "sglang", "sglang:num_queue_reqs", lease_flag="--kv-timeout",
                            server_env=(("PD_EXTPROC_SGLANG_BOOTSTRAP_PORT", "discover"),
                                        ("PD_EXTPROC_SGLANG_PREFILL_DEADLINE", "10s")),
                            held_metric="emulator_rooms_open", concurrent=True,
                            # scheduler.py, _handle_generate_request: a decode-mode engine refuses a request
                            # without a bootstrap room (400)
                            passthrough="engine_400"),
    "trtllm": EngineProfile("trtllm", "trtllm", "trtllm_num_requests_waiting",
                            shared_key=("PD_EXTPROC_TRTLLM_AUTH_KEY_FILE", "--auth-key-file")),
}


@dataclass
class Worker:
    role: str
    child: Child
    port: int = 0
    side_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    async def control(self, path: str, body: Any = None) -> Any:
        url = f"{self.url}/_emulator/{path}"
        raw = await asyncio.to_thread(http_get, url) if body is None else \
            await asyncio.to_thread(http_post, url, orjson.dumps(body))
        return orjson.loads(raw) if raw else None

    async def metrics(self) -> str:
        return (await asyncio.to_thread(http_get, f"{self.url}/metrics")).decode()


class SoakStack:
    def __init__(self, profile: EngineProfile, run_dir: Path, settings: dict[str, str], lease_seconds: float,
                 envoy_bin: str) -> None:
        self.profile = profile
        self.run_dir = run_dir
        self.lease_seconds = lease_seconds
        self.envoy_bin = envoy_bin
        base = {k: v for k, v in os.environ.items() if not k.startswith("PD_EXTPROC_")}
        self.base_env = base
        self.listen_port = free_port()
        self.admin_port = free_port()
        self.settings = {
            "PD_EXTPROC_ADAPTER": profile.adapter,
            "PD_EXTPROC_GRPC_LISTEN": f"unix:{run_dir}/extproc.sock",
            "PD_EXTPROC_LISTEN": f"127.0.0.1:{self.listen_port}",
            "PD_EXTPROC_ENVOY_ADMIN": f"127.0.0.1:{self.admin_port}",
            "PD_EXTPROC_METRICS_LISTEN": f"127.0.0.1:{free_port()}",
            "PD_EXTPROC_PREFILL_ALLOW": "127.0.0.0/8:*",
            "PD_EXTPROC_ENVOY_BIN": envoy_bin,
            "PD_EXTPROC_LOG_LEVEL": "warning",
            **dict(profile.server_env),
            **settings,
        }
        self.key_args: tuple[str, ...] = ()
        if profile.shared_key[0]:
            key_file = run_dir / "shared.key"
            key_file.write_text(secrets.token_hex(32) + "\n")
            key_file.chmod(0o600)
            self.settings[profile.shared_key[0]] = str(key_file)
            self.key_args = (profile.shared_key[1], str(key_file))
        self.prefill: Worker | None = None
        self.decode: Worker | None = None
        self.server: Child | None = None
        self.envoy: Child | None = None
        self.envoy_starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def metrics_url(self) -> str:
        return "http://" + self.settings["PD_EXTPROC_METRICS_LISTEN"]

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def _worker(self, role: str, port: int = 0, side_port: int = 0) -> Child:
        args = ["emulate", "--engine", self.profile.engine, "--role", role, "--listen", f"127.0.0.1:{port}",
                "--side-channel", f"127.0.0.1:{side_port}", "--worker-id", role, self.profile.lease_flag,
                f"{self.lease_seconds}s", *self.key_args, *self.profile.emulator_args]
        return python_child(f"{role}-worker", args, self.base_env, self.run_dir)

    async def start_worker(self, role: str) -> Worker:
        existing = self.prefill if role == "prefill" else self.decode
        child = self._worker(role, existing.port if existing else 0, existing.side_port if existing else 0)
        ready = await child.start()
        port = int(ready["url"].rsplit(":", 1)[1])
        worker = Worker(role, child, port, int(ready.get("side_channel", "0")))
        if existing is not None:
            child.starts = existing.child.starts + 1
        if role == "prefill":
            self.prefill = worker
        else:
            self.decode = worker
        return worker

    async def start_server(self) -> None:
        self.server = python_child("pd-extproc-serve", ["serve"], {**self.base_env, **self.settings}, self.run_dir)
        await self.server.start()

    async def start_envoy(self) -> None:
        config = self.run_dir / "envoy.yaml"
        rendered = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "extproc", "envoy-config"], env={**self.base_env, **self.settings},
            capture_output=True, check=True)
        config.write_bytes(rendered.stdout)
        self.envoy = python_child("envoy", ["envoy", "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
                                            "--log-level", "warning"], {**self.base_env, **self.settings},
                                  self.run_dir, ready=False)
        await self.envoy.start()
        self.envoy_starts += 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if (await asyncio.to_thread(http_get, f"{self.admin_url}/ready", 1.0)).strip() == b"LIVE":
                    return
            except OSError:
                pass
            if not self.envoy.alive():
                raise SoakProcessError(f"envoy exited; see {self.envoy.log_path}")
            await asyncio.sleep(0.1)
        raise SoakProcessError("envoy did not become ready")

    async def start(self) -> None:
        await self.start_worker("prefill")
        decode = await self.start_worker("decode")
        self.settings["PD_EXTPROC_DECODE"] = decode.address
        await self.start_server()
        await self.start_envoy()

    async def stop(self) -> None:
        for child in (self.envoy, self.server, self.decode and self.decode.child, self.prefill and self.prefill.child):
            if child is not None:
                await child.stop(signal.SIGTERM, within=20)

    async def envoy_stats(self) -> dict[str, int]:
        raw = (await asyncio.to_thread(http_get, f"{self.admin_url}/stats?format=json")).decode()
        stats = orjson.loads(raw)["stats"]
        return {entry["name"]: int(entry["value"]) for entry in stats if "value" in entry}
