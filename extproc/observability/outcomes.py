"""The request outcomes that mean served, shared by the metrics and the traces (neither imports the other
for it)."""

from __future__ import annotations

# Outcomes that mean the request was served: by decode, whole by a TensorRT-LLM context phase, or whole
# by decode after a prefill failure with PD_EXTPROC_PREFILL_FALLBACK. With ``cancelled`` (the client
# left) these are the outcomes that are not errors; every other outcome is an error code from
# extproc/protocol/errors.py.
SERVED_OUTCOMES = frozenset({"ok", "answered_by_prefill", "prefill_fallback"})
