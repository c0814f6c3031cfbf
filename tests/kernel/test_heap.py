"""The heap settings streaming processes use: freed chunk-sized memory is reused, not faulted in again."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import resource, sys
from fedbroker.app.glibc_malloc import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
def chunks_in_flight():  # 16 chunks of 2 MiB, as a stream queues them, then all freed
    blocks = [b"\\x01" * (2 << 20) for _ in range(16)]  # written, as received data is
    del blocks
chunks_in_flight()  # the first time faults every page in either way
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    chunks_in_flight()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""


def test_streamed_chunks_reuse_freed_heap_memory_instead_of_faulting_it_in_again():
    # In children, so this test process keeps glibc's defaults. With them, freed memory beyond glibc's
    # (dynamic) trim threshold goes back to the kernel and the next chunks fault it in again.
    faults = {mode: int(subprocess.run([sys.executable, "-c", SCRIPT, mode], check=True, capture_output=True,
                                       text=True).stdout) for mode in ("default", "kept")}
    assert faults["default"] > 1000 and faults["kept"] * 10 < faults["default"], faults
