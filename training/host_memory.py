"""Give freed host memory back to the OS during CPU training.

glibc serves an allocation above its mmap threshold with its own mapping, which ``free`` unmaps at
once, but it raises that threshold to the size of each such block freed (up to 32 MiB). After the
first freed activation, a training step's tensors come from the heap, whose freed space glibc keeps
for reuse; the holes between live blocks never go back. In the ZeRO-3 SFT of SmolLM2
(``benchmarks/bench_memory.py``) that kept memory was the largest part of each rank's peak RSS.
A fixed threshold (which also stops the raising) puts every large tensor in its own mapping again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MAX_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
DEFAULT_THRESHOLD = 1 << 20  # 1 MiB: tensors of a training step above it; small objects stay on the heap


def return_freed_memory(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Serve allocations of ``threshold`` bytes and more with their own mappings, unmapped on
    free (glibc's ``mallopt(M_MMAP_THRESHOLD)``, the same as ``MALLOC_MMAP_THRESHOLD_`` in the
    environment). Returns False, changing nothing, where the C library is not glibc."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 0 < threshold <= MAX_THRESHOLD:
        raise ValueError(
            f"threshold must be an int of bytes in (0, {MAX_THRESHOLD}] (glibc's largest mmap "
            f"threshold, 32 MiB), got {threshold!r}"
        )
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # musl, macOS, Windows: no mallopt
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, int(threshold)))
    logger.debug("glibc mmap threshold fixed at %d bytes: %s", threshold, ok)
    return ok
