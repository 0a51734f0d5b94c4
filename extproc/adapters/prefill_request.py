"""What every adapter's derived prefill request shares: it is one JSON response (never streamed)
that generates one token. Pure; the engine-specific members are each adapter's own."""

from __future__ import annotations

from collections.abc import Iterable

JSON_ONE = b"1"
JSON_FALSE = b"false"


def one_token_unstreamed(token_caps: Iterable[str] = (), *,
                         drop_stream_options: bool = True) -> dict[str, bytes | None]:
    """The members (for ``fields.set_members``) that make a prefill leg one JSON response: ``stream``
    false, ``stream_options`` dropped (the OpenAI APIs refuse it without streaming), and each of the
    API's token caps set to 1, in that order."""
    members: dict[str, bytes | None] = {"stream": JSON_FALSE}
    if drop_stream_options:
        members["stream_options"] = None
    members.update((cap, JSON_ONE) for cap in token_caps)
    return members
