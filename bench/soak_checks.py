"""The soak's pure checks: which answers a fault excuses, the handoff ledger, counter agreement and
resource slopes. No I/O here; bench/soak.py feeds them what it read."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.soak_load import ENVOY_CODES, REFUSALS, Outcome
from extproc.protocol.errors import Code

# What each fault may turn an answer into, while it lasts and for SETTLE seconds after it is cleared.
EXCUSED: dict[str, frozenset[str]] = {
    "prefill_kill": frozenset({"prefill_upstream_unavailable", "prefill_upstream_timeout", "prefill_response_truncated",
                               "engine_500", "engine_stream_error"}),
    "prefill_hang": frozenset({"prefill_upstream_timeout"}),
    "prefill_5xx": frozenset({"prefill_upstream_error"}),
    "decode_5xx": frozenset({"engine_500", "engine_stream_error"}),
    "decode_reset": frozenset({"decode_upstream_unavailable", "cut_after_head"}),
    "decode_queue": frozenset({"pd_overloaded"}),
    # Envoy keeps each request's ext_proc stream open until the request ends; when our server dies under a
    # response decode has started, Envoy resets the client's stream (PROTOCOL.md §2, failure_mode_allow).
    "extproc_kill": frozenset({"pd_extproc_unavailable", "pd_extproc_timeout", "cut_after_head"}),
    "extproc_drain": frozenset({"pd_shutting_down", "pd_extproc_unavailable"}),
    "envoy_drain": frozenset({"no_response", "cut_after_head"}),
}
SETTLE = 3.0  # seconds after a fault is cleared during which its answers are still excused
FAULTS = tuple(EXCUSED)
_TAG = re.compile(r"soak (soak-\d+|probe-\d+)")


@dataclass
class Window:
    fault: str
    start: float
    end: float = 0.0  # when the fault was cleared (monotonic)
    recovery: float | None = None  # seconds from ``end`` to the first good P/D answer
    note: str = ""


def expected_label(outcome: Outcome, passthrough: str = "ok") -> str:
    """What the answer must be when nothing is failing."""
    if outcome.kind in REFUSALS:
        return REFUSALS[outcome.kind].value
    if outcome.kind == "passthrough":
        return passthrough
    return "ok"


# With a concurrent engine (SGLang) both legs run at once, so a fault of one shows on the other: decode's
# own error (its handshake or transfer failed) may reach the client first when the prefill fails, and
# when decode fails our server waits a moment for the prefill, which then fails too (it waited for
# decode's claim) and the client gets the prefill's code (processor.on_decode_answer).
DECODE_SEES_PREFILL_FAULTS = frozenset({"engine_500", "engine_stream_error"})
PREFILL_SEES_DECODE_FAULTS = frozenset({"prefill_upstream_error", "prefill_upstream_timeout"})


def verdict(outcome: Outcome, windows: Sequence[Window], concurrent: bool = False, passthrough: str = "ok") -> str:
    """Empty if the answer is documented and expected (or excused by a fault it overlapped), else why not."""
    if outcome.problem and outcome.status is not None and outcome.label != "engine_stream_error":
        return f"{outcome.label}: {outcome.problem}"
    if outcome.disconnected:
        return ""
    expected = expected_label(outcome, passthrough)
    if outcome.label == expected:
        return ""
    excused = set()
    for window in windows:
        if outcome.started <= window.end + SETTLE and outcome.ended >= window.start:
            excused |= EXCUSED[window.fault]
            if concurrent and window.fault.startswith("prefill_"):
                excused |= DECODE_SEES_PREFILL_FAULTS
            if concurrent and window.fault.startswith("decode_"):
                excused |= PREFILL_SEES_DECODE_FAULTS
    refused_kind = outcome.kind in REFUSALS
    if outcome.label in excused:
        # A refusal is decided before any leg runs: only the faults that stop our server or Envoy excuse it,
        # and the decode queue's shed, which our server checks on the head, before the body is read.
        if refused_kind and outcome.label not in {"pd_extproc_unavailable", "pd_extproc_timeout", "pd_shutting_down",
                                                  "no_response", "pd_overloaded"}:
            return f"{outcome.kind} got {outcome.label}"
        if not outcome.pd and outcome.label.startswith(("prefill_", "pd_")):
            return f"passthrough got {outcome.label}"
        return ""
    return f"{outcome.kind} got {outcome.label} (expected {expected}"\
           f"{', or ' + '/'.join(sorted(excused)) if excused else ''})"


def tag_of(record: dict[str, Any]) -> str | None:
    """The soak tag a worker's record carries: in its prompt, else in the x-request-id Envoy forwarded
    (a TensorRT-LLM generation request carries token ids, not the text)."""
    body = record.get("json")
    headers = record.get("headers") or []
    pairs = headers.items() if isinstance(headers, dict) else headers
    from_header = next((str(v) for k, v in pairs if str(k).lower() == "x-request-id"), None)
    if not isinstance(body, dict):
        return from_header
    text = body.get("prompt")
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        text = messages[0].get("content")
    if not isinstance(text, str):
        return from_header
    found = _TAG.match(text)
    return found.group(1) if found else from_header


@dataclass
class Ledger:
    granted: int = 0
    pulled: int = 0
    unpulled_by_label: Counter[str] = field(default_factory=Counter)
    crossed: list[str] = field(default_factory=list)  # a decode request carrying another request's handoff
    orphaned: list[str] = field(default_factory=list)  # granted, not pulled, and nothing explains why
    double_grants: list[str] = field(default_factory=list)
    unverifiable: int = 0  # decode used a handoff from records lost with a killed prefill worker


def ledger(granted: Iterable[tuple[str, str]], used: Iterable[tuple[str, str, bool]],
           outcomes: dict[str, Outcome], prefill_lost: bool) -> Ledger:
    """``granted``: (tag, handoff id) per prefill record that granted one; ``used``: (tag, handoff id, KV
    loaded) per decode record that carried one; ``outcomes`` by tag."""
    result = Ledger()
    by_tag: dict[str, str] = {}
    by_id: dict[str, str] = {}
    for tag, handoff in granted:
        result.granted += 1
        if tag in by_tag:
            result.double_grants.append(tag)
        by_tag[tag] = handoff
        by_id[handoff] = tag
    pulled_ids = set()
    for tag, handoff, loaded in used:
        owner = by_id.get(handoff)
        if owner is None:
            if prefill_lost:
                result.unverifiable += 1
            else:
                result.crossed.append(f"{tag} carried {handoff}, which no prefill record granted")
            continue
        if owner != tag:
            result.crossed.append(f"{tag} carried {owner}'s handoff {handoff}")
        if loaded:
            pulled_ids.add(handoff)
            result.pulled += 1
    for tag, handoff in by_tag.items():
        if handoff in pulled_ids:
            continue
        outcome = outcomes.get(tag)
        label = "unknown" if outcome is None else ("disconnected" if outcome.disconnected else outcome.label)
        result.unpulled_by_label[label] += 1
        if outcome is None or label == "ok":
            result.orphaned.append(f"{tag}: granted {handoff}, not pulled, client outcome {label}")
    return result


def client_tally(outcomes: Iterable[Outcome]) -> dict[str, Counter[str]]:
    """The client's view for the counter comparisons."""
    ours: Counter[str] = Counter()  # P/D-route answers by our server's codes
    envoy_classes: Counter[str] = Counter()
    reached_decode = 0
    pd_disconnects = 0
    for outcome in outcomes:
        if outcome.status is not None:
            envoy_classes[f"{outcome.status // 100}xx"] += 1
        if not outcome.pd:
            continue
        if outcome.disconnected:
            pd_disconnects += 1
            continue
        if outcome.label in {"ok", "engine_stream_error", "decode_upstream_unavailable", "cut_after_head"} \
                or outcome.label.startswith("engine_"):
            reached_decode += 1
        elif outcome.label in {code.value for code in Code} and Code(outcome.label) not in ENVOY_CODES:
            ours[outcome.label] += 1
    return {"ours": ours, "envoy": envoy_classes,
            "counts": Counter({"reached_decode": reached_decode, "pd_disconnects": pd_disconnects})}


def compare_server(delta: dict[str, float], tally: dict[str, Counter[str]]) -> list[str]:
    """Our pd_extproc_requests_total deltas (by outcome) against the client's tally of one segment.

    A client that left just as our answer was decided is counted by us under that answer (ok or an
    error code) or as cancelled: each disconnect may sit in any one of those. With a concurrent engine
    a prefill that fails after decode's answer went to the client is counted under that answer
    (processor.on_decode_answer), so the comparison is the same for every engine."""
    problems = []
    ours = tally["ours"]
    reached, disconnects = tally["counts"]["reached_decode"], tally["counts"]["pd_disconnects"]
    spare = disconnects - int(delta.get("cancelled", 0))
    if spare < 0:
        problems.append(f"server counted {int(delta.get('cancelled', 0))} cancelled, more than the {disconnects} "
                        "client disconnects")
    for code in sorted(set(ours) | {k for k in delta if k not in ("ok", "cancelled")}):
        counted, seen = int(delta.get(code, 0)), ours.get(code, 0)
        if seen < counted <= seen + spare:
            spare -= counted - seen
            continue
        if counted != seen:
            problems.append(f"server counted {counted} {code}, the client saw {seen}")
    ok = int(delta.get("ok", 0))
    if not reached <= ok <= reached + max(spare, 0):
        problems.append(f"server counted {ok} ok, the client saw {reached} reach decode (+{max(spare, 0)} "
                        "disconnects unaccounted)")
    return problems


def compare_envoy(delta: dict[str, int], tally: dict[str, Counter[str]], disconnects: int) -> list[str]:
    problems = []
    for klass in ("2xx", "4xx", "5xx"):
        seen = tally["envoy"].get(klass, 0)
        counted = delta.get(klass, 0)
        if not seen <= counted <= seen + disconnects:
            problems.append(f"envoy counted {counted} {klass}, the client saw {seen} (+{disconnects} disconnects)")
    return problems


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value), per hour; None with fewer than 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var * 3600.0
