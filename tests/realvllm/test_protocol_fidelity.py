"""The handoff a real vLLM producer returns, against the fixture PROTOCOL.md pins for its version.

The adapter's rule table (extproc/adapters/vllm_nixl.py) and the emulator are written from that
fixture; a field the real engine adds, drops or retypes means the pin is stale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.realvllm.stage import RealPd
from tests.realvllm.wire import PATHS, request_body, shape, shape_diff, type_signature

pytestmark = pytest.mark.realvllm

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "PROTOCOL.md"
FIXTURE_MARKER = "<!-- fixture: vllm-0.32-prefill-response -->"
PINNED_VERSION = "0.32"
CHECKLIST = "PROTOCOL.md §8 'Upgrading vLLM (a new protocol pin)'"


def pinned_prefill_response() -> dict[str, Any]:
    """The fenced json block that follows the fixture marker in PROTOCOL.md."""
    text = PROTOCOL_MD.read_text()
    assert FIXTURE_MARKER in text, f"PROTOCOL.md lost its fixture marker {FIXTURE_MARKER}"
    after = text.split(FIXTURE_MARKER, 1)[1]
    block = re.match(r"\s*```json\n(.*?)\n```", after, re.DOTALL)
    assert block is not None, f"no ```json block right after {FIXTURE_MARKER} in PROTOCOL.md"
    fixture: dict[str, Any] = json.loads(block.group(1))
    return fixture


def field_types(params: dict[str, Any]) -> dict[str, str]:
    return {name: type_signature(value) for name, value in params.items()}


def compare_handoff(real: dict[str, Any], pinned: dict[str, Any]) -> list[str]:
    """Every way the real kv_transfer_params differ from the pinned one, as sentences."""
    real_types, pinned_types = field_types(real), field_types(pinned)
    problems = []
    added = sorted(set(real_types) - set(pinned_types))
    if added:
        problems.append(f"new field(s) {added} ({', '.join(real_types[a] for a in added)}): the engine speaks a "
                        f"newer handoff than the pin. Follow the upgrade checklist, {CHECKLIST}")
    missing = sorted(set(pinned_types) - set(real_types))
    if missing:
        problems.append(f"field(s) {missing} pinned but not sent by the engine; see {CHECKLIST}")
    for name in sorted(set(real_types) & set(pinned_types)):
        if real_types[name] != pinned_types[name]:
            problems.append(f"{name}: pinned as {pinned_types[name]}, the engine sent {real_types[name]}; "
                            f"see {CHECKLIST}")
    return problems


def test_the_fixture_block_is_a_producer_response() -> None:
    """The parser finds the pinned block and it is what the real-engine check needs."""
    pinned = pinned_prefill_response()
    assert pinned["kv_transfer_params"]["do_remote_prefill"] is True
    assert compare_handoff(pinned["kv_transfer_params"], pinned["kv_transfer_params"]) == []


def test_a_new_field_fails_with_a_pointer_to_the_upgrade_checklist() -> None:
    """What a newer engine would trigger: the message names the field and the checklist."""
    pinned = pinned_prefill_response()["kv_transfer_params"]
    newer = {**pinned, "remote_registration_generation": 3, "remote_port": "5600"}
    problems = compare_handoff(newer, pinned)
    assert any("remote_registration_generation" in p and CHECKLIST in p for p in problems), problems
    assert any(p.startswith("remote_port: pinned as integer, the engine sent string") for p in problems), problems


def test_engine_runs_the_pinned_vllm_version(real_pd: RealPd) -> None:
    version = real_pd.prefill.http.get("/version").json()["version"]
    assert str(version).startswith(PINNED_VERSION + "."), \
        f"the workers run vLLM {version}, the fixture pins {PINNED_VERSION}: follow {CHECKLIST}"


@pytest.mark.parametrize("path", PATHS, ids=["chat", "completions"])
def test_real_kv_transfer_params_match_the_pinned_fixture(real_pd: RealPd, path: str) -> None:
    """Item 3: field set and JSON types of the real producer's kv_transfer_params equal PROTOCOL.md's."""
    prefill, decode = real_pd.direct_pd(path, request_body(path, real_pd.model, f"fidelity of the handoff on {path}"))
    assert decode.status == 200, decode.body[:300]
    real = prefill.json()["kv_transfer_params"]
    problems = compare_handoff(real, pinned_prefill_response()["kv_transfer_params"])
    assert not problems, "real vLLM handoff differs from PROTOCOL.md §4.2 fixture:\n  " + "\n  ".join(problems) + \
        "\nreal kv_transfer_params: " + json.dumps(real)


def test_real_completions_prefill_response_has_the_pinned_shape(real_pd: RealPd) -> None:
    """The whole pinned response (a completions producer response) has the real response's keys and types."""
    path = "/v1/completions"
    prefill, _ = real_pd.direct_pd(path, request_body(path, real_pd.model, "fidelity of the whole prefill response"))
    real, pinned = prefill.json(), pinned_prefill_response()
    assert shape(real) == shape(pinned), shape_diff(shape(pinned), shape(real), "PROTOCOL.md fixture", "real vLLM")
