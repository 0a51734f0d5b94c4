"""The completions prompt shapes the P/D route takes (one prompt), and those it refuses."""

from __future__ import annotations

import orjson
import pytest

from extproc.protocol.errors import Code, PdError
from extproc.protocol.openai_request import parse_client_request

COMPLETIONS = "/v1/completions"


def parse(prompt: object) -> None:
    parse_client_request(COMPLETIONS, "application/json", orjson.dumps({"model": "m", "prompt": prompt}), 1 << 20)


@pytest.mark.parametrize("prompt", ["text", [1, 2, 3], [*range(30000)], [[1, 2]], ["text"], [[]]],
                         ids=["string", "token-ids", "30k-token-ids", "one-token-list", "one-string", "one-empty"])
def test_one_prompt_is_taken(prompt: object) -> None:
    parse(prompt)


@pytest.mark.parametrize("prompt,code", [
    ([True, 2], Code.UNSUPPORTED_PD_VARIANT),  # true is not a token id
    ([*range(30000), 1.0], Code.UNSUPPORTED_PD_VARIANT),
    ([[1, False]], Code.UNSUPPORTED_PD_VARIANT),
    (["a", "b"], Code.UNSUPPORTED_PD_VARIANT),  # a batch
    ([[1], [2]], Code.UNSUPPORTED_PD_VARIANT),
    ([], Code.INVALID_REQUEST_FIELD),
    (None, Code.INVALID_REQUEST_FIELD),
])
def test_anything_else_is_refused(prompt: object, code: Code) -> None:
    with pytest.raises(PdError) as refused:
        parse(prompt)
    assert refused.value.code is code and refused.value.field == "prompt"
