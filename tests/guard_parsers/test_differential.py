"""The client guard against the engines' real parsers: for each generated request, the guard (guard.lua, run
by lua5.1 with a shim of Envoy's handle API: run_guard.lua) refuses it iff the body a real framework would hand
an engine carries a steering field (oracle.py, in .venv-guard: FastAPI, Starlette, python-multipart, orjson
and SGLang's decompression middleware at the engines' pins).

Where the guard cannot read what the engine would, it refuses with a documented code instead (fail closed):
a body SGLang would decompress, a form that may carry vllm_xargs, a body that is not UTF-8 JSON. So:
- a request whose delivered body carries a steering field is always refused;
- a refusal names what it refused: reserved_request_field only when some framework delivers that field,
  uninspectable_request_body / unsupported_media_type / invalid_request_body only for their documented cases;
- a request in none of those cases and carrying no steering field passes.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import subprocess
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from extproc.envoy.guard import FORM_JSON_FIELDS, lua_source
from extproc.protocol.steering import EMPTY_OBJECT_TOLERATED, STEERING_FIELDS
from tests.harness import REPO

pytestmark = pytest.mark.guard_parsers

HERE = Path(__file__).parent
PYTHON = Path(os.environ.get("PD_GUARD_PYTHON", REPO / ".venv-guard" / "bin" / "python"))
LUA = shutil.which("lua5.1") or "lua5.1"
EXAMPLES = int(os.environ.get("PD_GUARD_EXAMPLES", "1000"))
PATHS = [list(field.path) for field in STEERING_FIELDS]


@dataclass(frozen=True)
class Verdict:
    status: int | None  # None: passed
    code: str | None = None
    param: str | None = None


class Guard:
    """guard.lua in a long-lived lua5.1 process."""

    def __init__(self, tmp: Path, **flags: bool) -> None:
        source = tmp / "guard.lua"
        source.write_text(lua_source(**flags), encoding="utf-8")
        self.process = subprocess.Popen([LUA, str(HERE / "run_guard.lua"), str(source)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def decide(self, headers: list[tuple[bytes, bytes]], body: bytes) -> Verdict:
        assert self.process.stdin is not None and self.process.stdout is not None
        frame = [f"{len(headers)}\n".encode()]
        for name, value in headers:
            frame += [f"{len(name)} {len(value)}\n".encode(), name, value]
        frame += [f"{len(body)}\n".encode(), body]
        self.process.stdin.write(b"".join(frame))
        self.process.stdin.flush()
        line = self.process.stdout.readline().decode()
        if line == "PASS\n":
            return Verdict(None)
        status, size = line.split()
        error = json.loads(self.process.stdout.read(int(size)))["error"]
        return Verdict(int(status), error["code"], error["param"])

    def close(self) -> None:
        self.process.kill()
        self.process.communicate()


class Oracle:
    def __init__(self) -> None:
        self.process = subprocess.Popen([str(PYTHON), str(HERE / "oracle.py")], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self._send({"paths": PATHS, "empty_ok": sorted(EMPTY_OBJECT_TOLERATED)}, answer=False)

    def _send(self, message: dict[str, Any], answer: bool = True) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline()) if answer else {}

    def read(self, headers: list[tuple[bytes, bytes]], body: bytes, zstd: bool) -> tuple[bytes, dict[str, Any]]:
        report = self._send({"headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in headers],
                             "body": base64.b64encode(body).decode(), "zstd": zstd})
        return base64.b64decode(report.pop("body")), report

    def close(self) -> None:
        self.process.kill()
        self.process.communicate()


@pytest.fixture(scope="module")
def oracle() -> Iterator[Oracle]:
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: run make guard-parsers")
    running = Oracle()
    yield running
    running.close()


@pytest.fixture(scope="module")
def guard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guard]:
    running = Guard(tmp_path_factory.mktemp("guard"))
    yield running
    running.close()


# --- request variants --------------------------------------------------------------------------------------

SPACES = ["", " ", "\t", "\xa0", "\x85", "\x1c", "\x1f", "\x0b", "\xe2\x80\x80"]
MEDIA = ["application/json", "application/vnd.api+json", "application/json-seq", "text/plain", "text/json",
         "application/x-ndjson", "application /json", "application/json/x", "json", "multipart/form-data",
         "application/x-www-form-urlencoded", "application/octet-stream"]
PARAMS = ["", "; charset=utf-8", ";charset=UTF-16", "; boundary=x", '; a="b;c"', ";", "; charset=cp500"]
VALUES = [None, {}, {"remote_host": "10.0.0.9", "remote_port": 5600}, 1, "x", [], {"do_remote_decode": True}]


@st.composite
def case_mixed(draw: st.DrawFn, text: str) -> str:
    return "".join(c.upper() if draw(st.booleans()) else c for c in text)


@st.composite
def content_types(draw: st.DrawFn) -> str | None:
    if draw(st.integers(0, 7)) == 0:
        return None
    read_as_json = st.sampled_from(["application/json", "application/vnd.api+json"])
    media = draw(case_mixed(draw(st.one_of(read_as_json, read_as_json, st.sampled_from(MEDIA)))))
    return draw(st.sampled_from(SPACES)) + media + draw(st.sampled_from(SPACES)) + draw(st.sampled_from(PARAMS))


def escape_key(key: str, mask: list[bool]) -> str:
    return "".join(f"\\u{ord(c):04x}" if flip else c for c, flip in zip(key, mask, strict=False))


@st.composite
def json_members(draw: st.DrawFn, path: list[str]) -> str:
    """One member spelling a steering path (maybe partly, maybe escaped), as JSON text."""
    *parents, last = path
    mask = draw(st.lists(st.booleans(), min_size=len(last), max_size=len(last)))
    value = json.dumps(draw(st.sampled_from(VALUES)))
    member = f'"{escape_key(last, mask)}": {value}'
    for parent in reversed(parents):
        filler = draw(st.sampled_from(["", '"a": 1, ', '"b": [{}], ']))
        member = f'"{parent}": {{{filler}{member}}}'
    return member


@st.composite
def json_bodies(draw: st.DrawFn) -> bytes:
    members = ['"model": "m"', '"prompt": "hi"']
    paths = draw(st.lists(st.sampled_from(PATHS), max_size=3))
    if paths and draw(st.integers(0, 3)) > 0:  # a repeated key: the same path again, its value drawn anew
        paths.insert(draw(st.integers(0, len(paths))), draw(st.sampled_from(paths)))
    if not draw(st.integers(0, 3)):
        paths = draw(st.permutations(paths))
    members += [draw(json_members(path)) for path in paths]
    if draw(st.integers(0, 5)) == 0:  # a steering name under a member no engine reads it from
        members.append(f'"metadata": {{{draw(json_members(draw(st.sampled_from(PATHS))))}}}')
    space = draw(st.sampled_from(["", " ", "\n\t"]))
    text = "{" + space + ("," + space).join(members) + space + "}"
    if draw(st.integers(0, 7)) == 0:
        text = '{"nest": [' + text + "]}"
    encoding = draw(st.sampled_from(["utf-8"] * 6 + ["utf-8-sig", "utf-16-le", "utf-16", "utf-32-be"]))
    return text.encode(encoding)


@st.composite
def forms(draw: st.DrawFn, multipart: bool) -> tuple[str, bytes]:
    fields: list[tuple[str, str]] = [("model", "m")]
    if draw(st.booleans()):
        xargs = {"temperature_x": 1}
        if draw(st.booleans()):
            xargs["kv_transfer_params"] = draw(st.sampled_from(VALUES))
        fields.append((draw(st.sampled_from(["vllm_xargs", "vllm_xargs", "VLLM_XARGS", "vllm_xargs "])),
                       json.dumps(xargs)))
    if not multipart:
        quote = draw(st.sampled_from([urllib.parse.quote_plus,
                                      lambda s: "".join(f"%{b:02X}" for b in s.encode())]))
        return "application/x-www-form-urlencoded", "&".join(f"{quote(n)}={quote(v)}" for n, v in fields).encode()
    boundary = "b0und4ry"
    params = draw(st.sampled_from(["", "; charset=utf-8", '; CHARSET = "UTF-8"', "; charset=cp500", "; charset=utf-16",
                                   "; charset=utf-8; charset=cp500"]))
    parts = []
    for name, value in fields:
        spelled = draw(st.sampled_from([f'name="{name}"', f"name={name}", f"name*=utf-8''{name}; name=\"{name}\"",
                                        f"name*=utf-8''{name}; name=\"x{name}\"", f'NAME="{name}"']))
        parts.append(f"--{boundary}\r\nContent-Disposition: form-data; {spelled}\r\n\r\n{value}\r\n")
    parts.append(f"--{boundary}--\r\n")
    return f"multipart/form-data; boundary={boundary}{params}", "".join(parts).encode()


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[tuple[bytes, bytes]], bytes, bool]:
    kind = draw(st.sampled_from(["json", "json", "json", "multipart", "urlencoded"]))
    if kind == "json":
        content_type, body = draw(content_types()), draw(json_bodies())
    else:
        content_type, body = draw(forms(kind == "multipart"))
    headers = [] if content_type is None else [(b"content-type", content_type.encode("latin-1"))]
    compression = draw(st.sampled_from(["", "", "", "zstd", "gzip"]))
    if compression == "gzip":  # no engine decodes content-encoding: both read the raw bytes
        headers.append((b"content-encoding", b"gzip"))
        body = gzip.compress(body)
    if compression == "zstd":
        headers.append((b"x-body-compressed", b"zstd"))
    return headers, body, compression == "zstd"


# --- the property --------------------------------------------------------------------------------------------

def delivered_steering(report: dict[str, Any]) -> set[str]:
    return {path for stack in report.values() for path in stack["steering"]}


def clean_utf8_json(body: bytes) -> bool:
    try:
        json.loads(body.decode("utf-8"))
    except ValueError:
        return False
    return not body.startswith(b"\xef\xbb\xbf")


def documented_refusal(verdict: Verdict, headers: dict[bytes, bytes], body: bytes) -> bool:
    content_type = headers.get(b"content-type", b"").decode("latin-1")
    if verdict.code == "uninspectable_request_body":
        if verdict.param == "x-body-compressed":
            return b"x-body-compressed" in headers
        if verdict.param == "content-type":  # a charset other than an ASCII-compatible one
            return any(charset not in ("utf-8", '"utf-8"') for charset in re.findall(
                r"charset\s*=\s*([^;\s]*)", content_type.lower()))
        text = urllib.parse.unquote_plus(body.decode("latin-1")) if "urlencoded" in content_type.lower() else body
        return verdict.param in FORM_JSON_FIELDS and verdict.param in str(text)
    if verdict.code == "unsupported_media_type":
        return "," in content_type
    if verdict.code == "invalid_request_body":
        return not clean_utf8_json(body)
    return False


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests())
@example(request=([(b"content-type", b"application/json")],
                  b'{"kv_transfer_params": {"do_remote_decode": true}, "kv_transfer_params": null}', False))
@example(request=([(b"content-type", b"application/json")],
                  b'{"bootstrap_host": null, "bootstrap_host": "10.0.0.9"}', False))
def test_the_guard_refuses_iff_a_real_framework_delivers_a_steering_field(
        guard: Guard, oracle: Oracle, request: tuple[list[tuple[bytes, bytes]], bytes, bool]) -> None:
    headers, body, zstd = request
    body, report = oracle.read(headers, body, zstd)
    verdict = guard.decide(headers, body)
    steering = delivered_steering(report)
    if steering:
        assert verdict.status is not None, (steering, report)
    if verdict.code == "reserved_request_field":
        assert verdict.param in steering, (verdict, report)
    elif verdict.status is not None:
        assert documented_refusal(verdict, dict(headers), body), (verdict, report)


def test_the_loosenings_let_their_class_through_and_nothing_else(tmp_path: Path, oracle: Oracle) -> None:
    (tmp_path / "strict").mkdir()
    (tmp_path / "loose").mkdir()
    strict = Guard(tmp_path / "strict")
    loose = Guard(tmp_path / "loose", allow_compressed=True, allow_form_json=True)
    try:
        steering = b'{"kv_transfer_params": {"remote_host": "10.0.0.9"}}'
        compressed_headers = [(b"content-type", b"application/json"), (b"x-body-compressed", b"zstd")]
        compressed, report = oracle.read(compressed_headers, steering, True)
        assert delivered_steering(report) == {"kv_transfer_params"}
        assert strict.decide(compressed_headers, compressed).code == "uninspectable_request_body"
        assert loose.decide(compressed_headers, compressed).status is None
        form = b"vllm_xargs=" + urllib.parse.quote_plus('{"kv_transfer_params": 1}').encode()
        form_headers = [(b"content-type", b"application/x-www-form-urlencoded")]
        assert strict.decide(form_headers, form).param == "vllm_xargs"
        assert loose.decide(form_headers, form).status is None
        json_headers = [(b"content-type", b"application/json")]
        assert loose.decide(json_headers, steering).code == "reserved_request_field"
    finally:
        strict.close()
        loose.close()
