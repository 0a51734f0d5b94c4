"""README's Docker Compose walk-through, as data: the compose stage runs exactly these steps, and
test_readme checks that README shows exactly these (rendered with ``docker compose`` and the
compose file's default host ports).

A step is either a compose command (its arguments after ``docker compose``) or an HTTP request
that README writes as a ``curl`` line and the test sends with httpx to the same path.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

COMPOSE_FILE = "envoy/docker-compose.yaml"
README_COMPOSE = ("docker", "compose")
README_BEGIN = "<!-- compose-stage: the commands tests/compose runs (tests/compose/commands.py) -->"
README_END = "<!-- /compose-stage -->"

# Host ports the compose file publishes, by the variable that moves each and its default.
PORT_VARIABLES = {"http": "PD_HTTP_PORT", "metrics": "PD_METRICS_PORT", "prefill": "PD_PREFILL_PORT"}
DEFAULT_PORTS = {"http": 8000, "metrics": 9190, "prefill": 8100}
PREFILL_TARGET = "172.28.0.10:8000"  # the prefill service's address in the compose network


@dataclass(frozen=True, slots=True)
class Compose:
    """``docker compose -f envoy/docker-compose.yaml ARGS``."""

    args: tuple[str, ...]
    comment: str = ""

    @property
    def argv(self) -> tuple[str, ...]:
        return ("-f", COMPOSE_FILE, *self.args)

    def readme(self) -> str:
        return shlex.join((*README_COMPOSE, *self.argv))


@dataclass(frozen=True, slots=True)
class Http:
    """``curl -sS [-i] http://127.0.0.1:PORT/PATH [-H ...] [-d BODY] [| grep GREP]``: POST when it has a body;
    ``-i`` (show_headers) prints the status line and the response headers before the body."""

    port: str  # a key of PORT_VARIABLES
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    body: str | None = None
    grep: str | None = None
    comment: str = ""
    show_headers: bool = False

    @property
    def method(self) -> str:
        return "GET" if self.body is None else "POST"

    def readme(self) -> str:
        flags = "-sS -i" if self.show_headers else "-sS"
        parts = [f"curl {flags} http://127.0.0.1:{DEFAULT_PORTS[self.port]}{self.path}"]
        parts += [f"-H {shlex.quote(f'{name}: {value}')}" for name, value in self.headers]
        if self.body is not None:
            parts.append(f"-d {shlex.quote(self.body)}")
        text = " \\\n  ".join(parts)
        return text + (f" | grep {shlex.quote(self.grep)}" if self.grep else "")


Step = Compose | Http

BUILD = Compose(("build",), "the image, from our Dockerfile")
UP = Compose(("up", "-d", "--wait"), "until healthy (podman 4.3 ignores --wait)")
READY = Http("metrics", "/readyz", comment='{"status":"ready"} once pd-extproc serves')
PD_REQUEST = Http("http", "/v1/chat/completions",
                  (("content-type", "application/json"), ("x-prefiller-host-port", PREFILL_TARGET)),
                  '{"model":"emulated","messages":[{"role":"user","content":"Hello"}],"max_tokens":8}',
                  show_headers=True)
# pd-extproc's own counters, the same for every engine: the prefill legs it ran, and the P/D requests by
# outcome (ok: the prefill leg answered, its handoff was valid and decode served the request with it).
PREFILL_LEGS = Http("metrics", "/metrics", grep="pd_extproc_prefill_seconds_count",
                    comment="prefill legs pd-extproc ran")
PD_OUTCOMES = Http("metrics", "/metrics", grep="pd_extproc_requests_total", comment="pd-extproc's outcomes")
# The engine's own proof that KV moved, per engine, which the page names after the block (vLLM's decode
# worker counts its NIXL transfers; its /metrics is read through Envoy's passthrough route).
VLLM_DECODE_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
STOP_ENVOY = Compose(("stop", "envoy"), "Envoy drains: requests in flight finish first")
DOWN = Compose(("down", "--volumes"))

README_STEPS: tuple[Step, ...] = (BUILD, UP, READY, PD_REQUEST, PREFILL_LEGS, PD_OUTCOMES, STOP_ENVOY, DOWN)

# Steps the stage runs beyond README's (each service's own drain).
STOP_SERVER = Compose(("stop", "pd-extproc"))
START_SERVER = Compose(("start", "pd-extproc"))
ENVOY_LOGS = Compose(("logs", "--no-color", "envoy"))


def readme_block(steps: tuple[Step, ...] = README_STEPS) -> str:
    """The fenced block README shows between README_BEGIN and README_END."""
    lines = []
    for step in steps:
        text = step.readme()
        lines.append(f"{text}  # {step.comment}" if step.comment else text)
    return "```sh\n" + "\n".join(lines) + "\n```"
