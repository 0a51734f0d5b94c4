"""Where our server's CPU goes under load: py-spy samples of ``pd-extproc serve``, summarised.

py-spy's raw output has one line per distinct stack: ``frame;frame;...;leaf COUNT``, each frame
``function (file:line)``. Only on-CPU samples are recorded (py-spy's default drops idle threads).
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_FRAME = re.compile(r"(?P<function>.*) \((?P<file>[^():]*)(?::\d+)?\)$")
# First matching rule names a stack's category; checked from the leaf towards the root.
_CATEGORIES: tuple[tuple[str, str], ...] = (
    # grpc.aio's poller thread (the floors' servers) runs the gRPC C-core (HTTP/2, completion queue);
    # py-spy sees only its Python entry point. Our own server runs on the event loop.
    ("gRPC C-core poller thread", "Thread.run (threading.py"),
    ("logging", "logging/"),
    ("logging", "extproc/observability/logs.py"),
    ("JSON parse/splice (orjson, jsonspan)", "extproc/protocol/jsonspan.py"),
    ("request/handoff checks (openai_request, adapter)", "extproc/protocol/openai_request.py"),
    ("request/handoff checks (openai_request, adapter)", "extproc/adapters/"),
    ("prefill HTTP client (upstream, http1)", "aiohttp/"),
    ("prefill HTTP client (upstream, http1)", "extproc/upstream/client.py"),
    ("prefill HTTP client (upstream, http1)", "extproc/upstream/http1.py"),
    ("protobuf messages (envoy_messages)", "extproc/envoy/messages.py"),
    ("protobuf messages (envoy_messages)", "google/protobuf/"),
    ("gRPC server (ours: HTTP/2 frames, HPACK)", "extproc/envoy/h2server.py"),
    ("gRPC server (ours: HTTP/2 frames, HPACK)", "extproc/envoy/h2wire.py"),
    ("gRPC server (ours: HTTP/2 frames, HPACK)", "hpack/"),
    ("gRPC (grpc.aio, Cython core; the floors only)", "grpc/"),
    ("gRPC (grpc.aio, Cython core; the floors only)", "src/python/grpcio/"),
    ("our servicer/processor", "extproc/"),
    ("asyncio event loop (incl. C task steps)", "asyncio/"),
    ("asyncio event loop (incl. C task steps)", "selectors.py"),
)
_ROOT_FRAMES = ("extproc/__main__.py", "extproc/cli.py")


@dataclass
class ProfileSummary:
    samples: int
    seconds: float
    self_top: list[tuple[str, float]] = field(default_factory=list)  # (function, share of samples)
    inclusive_top: list[tuple[str, float]] = field(default_factory=list)
    categories: list[tuple[str, float]] = field(default_factory=list)
    raw_path: str = ""


def record(py_spy: str, pid: int, seconds: float, output: Path, rate: int = 250) -> subprocess.Popen[bytes]:
    """Start py-spy in the background; wait for it, then call ``summarise(output)``."""
    return subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
         "--format", "raw", "--output", str(output), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _function(frame: str) -> str:
    match = _FRAME.match(frame)
    if match is None:
        return frame
    short = match["file"].split("site-packages/")[-1].split("python3.11/")[-1]
    return f"{match['function']} ({short})"


def _category(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, marker in _CATEGORIES:
            if marker in frame:
                return name
    return "other"


def summarise(raw_path: Path, seconds: float, top: int = 15) -> ProfileSummary:
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    categories: Counter[str] = Counter()
    total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        self_counts[_function(frames[-1])] += count
        for function in {_function(frame) for frame in frames if not any(r in frame for r in _ROOT_FRAMES)}:
            inclusive[function] += count
        categories[_category(frames)] += count
    if total == 0:
        return ProfileSummary(0, seconds, raw_path=str(raw_path))

    def shares(counter: Counter[str], limit: int) -> list[tuple[str, float]]:
        return [(name, count / total) for name, count in counter.most_common(limit)]

    return ProfileSummary(total, seconds, shares(self_counts, top), shares(inclusive, top + 10),
                          shares(categories, len(categories)), str(raw_path))
