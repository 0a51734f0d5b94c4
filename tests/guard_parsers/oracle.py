"""The engines' real HTTP stacks as an oracle for the guard's differential test; runs in .venv-guard
(tests/guard_parsers/requirements.txt), driven over stdin/stdout by test_differential.py, one JSON line each way.

Each request goes through real ASGI apps built from the engines' web frameworks at their pins, and the oracle
reports what each app's endpoint received and which steering paths are set in it:
- ``vllm``: FastAPI 0.136.3 / Starlette 1.10.0 (strict content-type, its default), Starlette's Request.json
  (CPython json); a JSON route, and a form route like vLLM's transcription endpoint
  (speech_to_text/transcription/api_router.py, ``Annotated[TranscriptionRequest, Form()]``), whose model
  decodes the ``vllm_xargs`` string with json.loads (TranscriptionRequest's model_validator).
- ``trtllm``: the same framework with ``strict_content_type=False``: a body without content-type is JSON, as
  in FastAPI 0.121 (TensorRT-LLM pins fastapi>=0.120.1,<=0.121.3).
- ``sglang``: the JSON route read with orjson (SGLang 0.5.23 http_server.py ORJSONRequest / ORJSONRoute), behind
  SGLang's own RequestDecompressionMiddleware (http_request_decompression.py, loaded from the installed sglang).
A request may ask for its body to be zstd-compressed first ("zstd": true); the answer carries the body sent.
The first line in is the steering list: {"paths": [[key, ...], ...], "empty_ok": [dotted path, ...]}.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import orjson
import zstandard
from fastapi import Body, FastAPI, Form, Request, UploadFile
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, model_validator

# By file: importing the sglang package pulls in torch.
_DECOMPRESSION = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
                  / "site-packages" / "sglang" / "srt" / "entrypoints" / "http_request_decompression.py")


def _decompression_middleware() -> Any:
    spec = importlib.util.spec_from_file_location("sglang_request_decompression", _DECOMPRESSION)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RequestDecompressionMiddleware


class XargsForm(BaseModel):
    """The part of vLLM's TranscriptionRequest that matters here: vllm_xargs, json-decoded from its form
    string; the file is optional so that every form reaches the decoding step."""

    model_config = ConfigDict(extra="allow")
    file: UploadFile | None = None
    vllm_xargs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _decode_xargs(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("vllm_xargs"), str):
            data = {**data, "vllm_xargs": json.loads(data["vllm_xargs"])}
        return data


class OrjsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class OrjsonRoute(APIRoute):
    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def with_orjson(request: Request) -> Any:
            return await handler(OrjsonRequest(request.scope, request.receive))

        return with_orjson


RECEIVED: dict[str, Any] = {}


def _app(strict: bool, orjson_route: bool) -> FastAPI:
    app = FastAPI(strict_content_type=strict)
    if orjson_route:
        app.router.route_class = OrjsonRoute

    @app.post("/json")
    async def json_route(body: Annotated[Any, Body()]) -> dict[str, str]:
        RECEIVED["json"] = body
        return {}

    @app.post("/form")
    async def form_route(form: Annotated[XargsForm, Form()]) -> dict[str, str]:
        RECEIVED["form"] = form.model_dump(exclude={"file"})
        return {}

    return app


def _stacks() -> dict[str, Any]:
    return {
        "vllm": _app(strict=True, orjson_route=False),
        "trtllm": _app(strict=False, orjson_route=False),
        "sglang": _decompression_middleware()(_app(strict=True, orjson_route=True)),
    }


async def _call(app: Any, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int, Any]:
    RECEIVED.clear()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent = False
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    kind = "json" if path == "/json" else "form"
    return status, RECEIVED.get(kind)


def _set_paths(body: Any, paths: list[list[str]], empty_ok: set[str]) -> list[str]:
    found = []
    for path in paths:
        node = body
        for key in path:
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            dotted = ".".join(path)
            if node is not None and not (node == {} and dotted in empty_ok):
                found.append(dotted)
    return found


def main() -> None:
    config = json.loads(sys.stdin.readline())
    paths, empty_ok = config["paths"], set(config["empty_ok"])
    stacks = _stacks()
    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        request = json.loads(line)
        headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in request["headers"]]
        body = base64.b64decode(request["body"])
        if request.get("zstd"):
            body = zstandard.ZstdCompressor().compress(body)
        report: dict[str, Any] = {"body": base64.b64encode(body).decode()}
        for name, app in stacks.items():
            for route in ("/json", "/form"):
                status, received = loop.run_until_complete(_call(app, route, headers, body))
                report[f"{name}{route}"] = {"status": status, "received": received is not None,
                                            "steering": [] if received is None
                                            else _set_paths(received, paths, empty_ok)}
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
