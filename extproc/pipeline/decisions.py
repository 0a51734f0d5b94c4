"""What the processor decides for one ext_proc message, as plain values; extproc/envoy/messages.py turns
each into Envoy's reply (``reply``), so the pipeline builds and reads no protobuf. One small object per
reply, on the hot path: slotted and not frozen (a frozen dataclass's __init__ costs ~1 us, five times as
much); nothing changes one after it is made."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

JSON = b"application/json"


@dataclass(slots=True)
class SendToDecode:
    """The request goes on to decode with ``body`` (its Content-Length set to match), these request headers
    set and removed, and ``metadata`` for Envoy (the pd route turns it into response headers and log fields)."""

    body: bytes
    set_headers: Sequence[tuple[str, bytes]] = ()
    remove_headers: Sequence[str] = ()
    metadata: Mapping[str, str] | None = None


@dataclass(slots=True)
class LocalReply:
    """Envoy answers the client itself and the request goes no further. ``details`` becomes Envoy's
    %RESPONSE_CODE_DETAILS% (ours start with "pd_")."""

    status: int
    body: bytes
    details: str
    headers: Sequence[tuple[str, bytes]] = ()
    content_type: bytes = JSON
