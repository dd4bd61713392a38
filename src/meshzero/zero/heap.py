"""Give the free memory of glibc's heaps back to the system.

glibc serves allocations below its (dynamic, up to 32 MiB) mmap threshold from its heaps and
keeps what is freed there resident for reuse. Building a model unit by unit frees a unit's
worth of memory at a time between long-lived shards; without a trim the process would keep
growing by about a unit each time (zero/materialize.py, zero/draws.py).
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (musl, macOS, Windows: nothing to trim that way)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
        return trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Give the free memory of glibc's heaps back to the system (pages inside the heap too,
    not only its top): the freed values of a built unit would otherwise stay resident."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
