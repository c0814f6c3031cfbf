"""glibc heap settings for processes that stream models: reuse freed memory instead of faulting it in again.

By default glibc serves any allocation above a (dynamic) threshold with its own mmap and unmaps it on
free, and it returns the top of the heap to the kernel after every large free. A model streams as 2 MiB
chunks, so each one was a fresh mapping: 512 page faults per chunk, 120-150 thousand per 400 MB upload,
about a fifth of its CPU (measured with perf on the aggregation service). With chunks served from the
heap and up to `trim_threshold` of freed memory kept, a process reuses the same pages upload after
upload. Only glibc has these knobs; elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_memory(*, mmap_threshold: int = 16 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Allocations below `mmap_threshold` come from the heap; `trim_threshold` of free heap is kept. True if set."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, trim_threshold)) and bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold))
