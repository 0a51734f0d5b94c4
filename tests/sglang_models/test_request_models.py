"""Every body the sglang adapter sends, validated by SGLang 0.5.23's own pydantic request models
(``sglang.srt.entrypoints.openai.protocol``, in .venv-sglang; see validate.py).

SGLang's request models ignore unknown fields (pydantic's default ``extra="ignore"``): a field of ours
that SGLang does not know would be dropped without a word. So each body must validate, every field
we add must be a model field, and its value must survive validation with its JSON type.

What this does not prove: that two SGLang engines move the KV (no SGLang P/D pair runs on CPU here).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from extproc.adapters.base import PlanInput
from extproc.adapters.sglang import BOOTSTRAP_FIELDS, RID, SglangAdapter
from extproc.protocol.openai_request import parse_client_request
from extproc.protocol.prefill_target import parse_prefill_target
from tests.harness import REPO

pytestmark = pytest.mark.sglang_models

PYTHON = Path(os.environ.get("PD_SGLANG_PYTHON", REPO / ".venv-sglang" / "bin" / "python"))
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
OURS = (*BOOTSTRAP_FIELDS, RID, "stream")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
CLIENT_BODIES = [
    (CHAT, {"model": "m", "messages": MESSAGES, "max_completion_tokens": 8}),
    (CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}),
    (CHAT, {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "stream": False}),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    (COMPLETIONS, {"model": "m", "prompt": "The KV cache is", "max_tokens": 8}),
    (COMPLETIONS, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "stream": True}),
    (COMPLETIONS, {"model": "m", "prompt": ["one prompt"], "stream": True, "stream_options": {"include_usage": True}}),
    (GENERATE, {"text": "The KV cache is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}),
    (GENERATE, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "n": 1}, "stream": True}),
    (GENERATE, {"text": "The KV cache is", "return_logprob": True, "stream": False}),
    (GENERATE, {"text": "The KV cache is", "sampling_params": {"max_new_tokens": 8}, "bootstrap_room": None}),
]
TARGETS = [parse_prefill_target(["10.0.0.7:30000"]), parse_prefill_target(["[fd00::7]:30000"])]


def sglang_validate(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not PYTHON.exists():
        pytest.fail(f"SGLang's request models are not installed: {PYTHON} is missing (run `make sglang-models`)")
    done = subprocess.run([str(PYTHON), str(Path(__file__).with_name("validate.py"))], input=json.dumps(items),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


def adapter_bodies() -> list[tuple[str, str, str, dict[str, Any]]]:
    """(leg, path, case, body) for every client body, both legs, IPv4 and IPv6 prefill targets."""
    adapter = SglangAdapter(bootstrap_port=8998)
    found = []
    for case, (path, client) in enumerate(CLIENT_BODIES):
        for target in TARGETS:
            request = parse_client_request(path, "application/json", json.dumps(client).encode(), 1 << 20,
                                           served=SglangAdapter.endpoints)
            plan = adapter.plan(request, PlanInput(target, nonce=(case + 1) * 7919))
            found.append(("prefill", path, f"{case}-{target.host}", json.loads(plan.prefill_body)))
            found.append(("decode", path, f"{case}-{target.host}", json.loads(plan.decode.body)))
    return found


BODIES = adapter_bodies()


@pytest.fixture(scope="module")
def verdicts() -> list[dict[str, Any]]:
    return sglang_validate([{"path": path, "body": body} for _, path, _, body in BODIES])


@pytest.mark.parametrize("index", range(len(BODIES)), ids=[f"{leg}-{path.rsplit('/', 1)[1]}-{case}"
                                                          for leg, path, case, _ in BODIES])
def test_sglang_accepts_every_body_we_send_and_keeps_every_field_we_add(
        verdicts: list[dict[str, Any]], index: int) -> None:
    leg, _, _, body = BODIES[index]
    verdict = verdicts[index]
    assert verdict["ok"], verdict["error"]
    added = [name for name in OURS if name in body]
    assert set(added) <= set(verdict["fields"]), "a field we add is not in SGLang's model: it would be dropped"
    assert not set(added) & set(verdict["dropped"])
    for name in added:
        assert verdict["values"][name] == body[name], f"{name} changed in validation"
    assert isinstance(body["bootstrap_room"], int) and isinstance(body["bootstrap_port"], int)
    if leg == "prefill":
        assert body["stream"] is False and "stream_options" not in body


def test_the_models_refuse_what_we_never_send() -> None:
    """The check can fail: SGLang's models refuse a float room and an integer rid."""
    bad = [{"path": CHAT, "body": {"messages": MESSAGES, "bootstrap_room": 1.5}},
           {"path": COMPLETIONS, "body": {"prompt": "p", "rid": 5}},
           {"path": GENERATE, "body": {"text": "p", "bootstrap_room": "7"}},
           {"path": GENERATE, "body": {"text": "p", "sampling_params": {"max_tokens": 8}}}]
    assert [verdict["ok"] for verdict in sglang_validate(bad)] == [False, False, False, False]
