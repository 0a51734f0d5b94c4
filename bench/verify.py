"""Proof that each system did the work it claims: both legs and a pulled KV handoff for P/D systems.

A router that skipped the handoff would look fast, so every measured point is checked against the
workers' own counters, and one request per system is inspected field by field before the run.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from bench.systems import System
from bench.workers import CheapWorker, LegCounters, Worker
from bench.workload import CHAT_PATH, chat_body
from extproc.protocol.prefill_target import HEADER as PREFILL_TARGET_HEADER
from pd_extproc_lab.emulator.worker import EmulatedWorker


def check_point(system: System, legs: LegCounters, completed: int, errors: int, concurrency: int) -> list[str]:
    """Problems with one measured point, judged from the workers' counter deltas; [] when all is well.
    wrk abandons up to ``concurrency`` requests at the end of a run, so counts may exceed ``completed`` by that."""
    problems = [] if errors == 0 else [f"{errors} failed requests"]
    if system.pd:
        problems += _check_pd(legs, completed, concurrency)
    elif system.handoff:
        problems += _expect(completed <= legs.decode_transfers <= completed + concurrency,
                            f"{legs.decode_transfers:.0f} consumer legs at decode for {completed} completed requests")
        problems += _expect(legs.decode_recomputed == 0, f"{legs.decode_recomputed:.0f} decode requests had no handoff")
        problems += _expect(legs.prefill_leases_granted == 0 and legs.prefill_recomputed == 0, "prefill was called")
    elif system.name == "direct-prefill":
        problems += _expect(legs.prefill_recomputed >= completed, "prefill saw fewer requests than completed")
        problems += _expect(legs.decode_transfers == 0 and legs.decode_recomputed == 0, "decode was called")
    else:
        problems += _expect(legs.decode_transfers == 0, "decode pulled KV on a non-P/D path")
        problems += _expect(legs.prefill_leases_granted == 0 and legs.prefill_recomputed == 0, "prefill was called")
        problems += _expect(legs.decode_recomputed >= completed, "decode saw fewer requests than completed")
    return problems


def _check_pd(legs: LegCounters, completed: int, concurrency: int) -> list[str]:
    return [
        *_expect(legs.decode_failed_transfers == 0, f"{legs.decode_failed_transfers:.0f} KV pulls failed"),
        *_expect(legs.decode_recomputed == 0, f"{legs.decode_recomputed:.0f} decode requests had no handoff"),
        *_expect(legs.prefill_recomputed == 0, f"{legs.prefill_recomputed:.0f} prefill requests were not producers"),
        *_expect(completed <= legs.decode_transfers <= completed + concurrency,
                 f"{legs.decode_transfers:.0f} KV pulls for {completed} completed requests"),
        *_expect(legs.decode_transfers <= legs.prefill_leases_granted <= legs.decode_transfers + concurrency,
                 f"{legs.prefill_leases_granted:.0f} prefill legs for {legs.decode_transfers:.0f} KV pulls"),
        *_expect(legs.distinct_handoffs < 0 or legs.distinct_handoffs == legs.decode_transfers,
                 f"{legs.decode_transfers:.0f} decode legs, {legs.distinct_handoffs:.0f} distinct handoffs"),
    ]


def _expect(condition: bool, problem: str) -> list[str]:
    return [] if condition else [problem]


@dataclass
class Inspection:
    """What one request through a system looked like at the workers."""

    system: str
    status: int
    prefill_requests: int
    decode_requests: int
    problems: list[str] = field(default_factory=list)
    prefill_body_changes: list[str] = field(default_factory=list)
    decode_body_changes: list[str] = field(default_factory=list)
    routing_header_reached_worker: bool = False


def inspect_one_request(system: System, prefill: Worker, decode: Worker) -> Inspection:
    """Send one non-streaming request and read back what each worker received (a cheap worker keeps no
    request records: its counters only)."""
    for worker in (prefill, decode):
        worker.reset()
    client_body = chat_body(stream=False)
    status = _post(system.url + CHAT_PATH, client_body, system.headers)
    if isinstance(prefill, CheapWorker) and isinstance(decode, CheapWorker):
        return _inspect_cheap(system, status, prefill, decode)
    assert isinstance(prefill, EmulatedWorker) and isinstance(decode, EmulatedWorker)
    prefill_records, decode_records = _generation_requests(prefill), _generation_requests(decode)
    inspection = Inspection(system.name, status, len(prefill_records), len(decode_records))
    inspection.routing_header_reached_worker = any(
        name == PREFILL_TARGET_HEADER for record in prefill_records + decode_records for name, _ in record["headers"])
    client = orjson.loads(client_body)
    if prefill_records:
        inspection.prefill_body_changes = _changes(client, prefill_records[0]["json"])
    if decode_records:
        inspection.decode_body_changes = _changes(client, decode_records[0]["json"])
    inspection.problems = _inspection_problems(system, inspection, prefill_records, decode_records)
    return inspection


def _inspection_problems(system: System, inspection: Inspection, prefill_records: list[dict[str, Any]],
                         decode_records: list[dict[str, Any]]) -> list[str]:
    problems = _expect(inspection.status == 200, f"status {inspection.status}")
    problems += _expect(not inspection.routing_header_reached_worker, f"{PREFILL_TARGET_HEADER} reached a worker")
    if not system.pd:
        expected_prefill = 1 if system.name == "direct-prefill" else 0
        return problems + _expect(inspection.prefill_requests == expected_prefill
                                  and inspection.decode_requests == 1 - expected_prefill, "unexpected legs")
    if inspection.prefill_requests != 1 or inspection.decode_requests != 1:
        return [*problems, f"{inspection.prefill_requests} prefill and {inspection.decode_requests} decode requests"]
    producer = prefill_records[0]["json"]
    lease = prefill_records[0]["notes"].get("remote_request_id")
    handoff = decode_records[0]["json"].get("kv_transfer_params") or {}
    problems += _expect(producer.get("max_tokens") == 1 and producer.get("stream") is not True,
                        "prefill leg was not max_tokens=1, non-streaming")
    problems += _expect((producer.get("kv_transfer_params") or {}).get("do_remote_decode") is True,
                        "prefill leg did not ask for a KV producer handoff")
    problems += _expect(lease is not None and handoff.get("remote_request_id") == lease,
                        "decode did not receive the prefill worker's handoff")
    problems += _expect(decode_records[0]["notes"].get("load") == "ok", "decode did not pull the KV blocks")
    return problems


def _inspect_cheap(system: System, status: int, prefill: CheapWorker, decode: CheapWorker) -> Inspection:
    p, d = prefill.counters(), decode.counters()
    inspection = Inspection(system.name, status, p["requests"], d["requests"])
    problems = _expect(status == 200, f"status {status}")
    if system.pd:
        problems += _expect(p["producer"] == 1 and d["consumer"] == 1 and p["plain"] == 0 and d["plain"] == 0,
                            f"prefill {p}, decode {d}: expected one producer and one consumer leg")
    else:
        expected_prefill = 1 if system.name == "direct-prefill" else 0
        problems += _expect(p["requests"] == expected_prefill and d["requests"] == 1 - expected_prefill,
                            "unexpected legs")
        if system.handoff:
            problems += _expect(d["consumer"] == 1, f"decode {d}: expected one consumer leg (the spliced handoff)")
    inspection.problems = problems
    return inspection


def _changes(client: dict[str, Any], received: dict[str, Any] | None) -> list[str]:
    """Top-level members a worker saw added, removed or changed compared with the client's body."""
    if received is None:
        return ["(body not JSON)"]
    changes = [f"+{k}" for k in received if k not in client]
    changes += [f"-{k}" for k in client if k not in received]
    changes += [f"~{k}" for k in client if k in received and received[k] != client[k]]
    return changes


def _generation_requests(worker: EmulatedWorker) -> list[dict[str, Any]]:
    return [r for r in worker.requests() if r["target"].startswith("/v1/")]


def _post(url: str, body: bytes, headers: Mapping[str, str]) -> int:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"content-type": "application/json", **dict(headers)})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
