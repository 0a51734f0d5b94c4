"""The C allocator's thresholds for a server that handles bodies of megabytes: large blocks reused, not
mapped and faulted in again on every request.

glibc serves a block over its mmap threshold (128 KiB at start, raised as large blocks are freed) with a
fresh mapping, and gives back the top of its heap once more than the trim threshold is free there. A P/D
request makes and frees several blocks of its body's size (the gRPC message, the bodies for prefill and
decode, the reply), so each request faulted fresh pages in again: per 1 MiB request about 1,050 minor
faults and 2.5 ms of server CPU, per 8 MiB request about 7,000 and 30 ms, measured through the whole
stack (docs/decisions.md). With the mmap threshold at 32 MiB (glibc's largest on 64-bit) and the trim
threshold at four bodies of the largest size allowed, the same requests fault in almost nothing. The
price: that much freed heap (128 MiB by default) may stay with each of the process's allocator arenas
(the main one, and one per thread that made large blocks, such as gRPC's) for the next requests instead
of going back to the system at once; blocks up to 32 MiB come from those arenas, not from their own
mappings.

The operator's own ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or glibc.malloc tunables win:
then nothing is changed here. Elsewhere than glibc (musl) nothing is changed either.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

MMAP_THRESHOLD_BYTES = 32 << 20
KEPT_BODIES = 4  # the large blocks of one request's body (see above), freed heap kept for the next
# mallopt's parameter numbers, from glibc's malloc/malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
OPERATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
OPERATOR_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def trim_threshold(max_request_bytes: int) -> int:
    return max(MMAP_THRESHOLD_BYTES, KEPT_BODIES * max_request_bytes)


def keep_large_blocks(max_request_bytes: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Set both thresholds in this process; False when left as they were (the operator's settings, or
    not glibc)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(name in environ for name in OPERATOR_VARIABLES) or any(name in tunables for name in OPERATOR_TUNABLES):
        return False
    try:
        libc = ctypes.CDLL(None)  # this process's own symbols: the C library it runs on, no ldconfig lookup
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  # glibc only: musl has mallopt as a stub
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim = min(trim_threshold(max_request_bytes), 2**31 - 1)  # mallopt takes an int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, trim))
