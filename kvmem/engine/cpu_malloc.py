"""glibc's malloc told to keep the memory a CPU engine frees between steps.

A step's activations come and go in blocks of megabytes (a 2,048-token MLP's gate/up output
is 25 MB in fp32). glibc serves such blocks with mmap, raises its mmap threshold as they
are freed, and hands the top of its heap back to the kernel whenever more than twice that
threshold lies free there, so the next step faults the same pages in again. On the
offline SmolLM2 workload of ``benchmarks/vs_vllm.py`` a run could take 814,556 minor page
faults and 1.5 s of system time (of 31.6 s); with fixed thresholds it took 3. vLLM's CPU
workers avoid the same by preloading tcmalloc. ``keep_freed_memory`` sets the thresholds
with ``mallopt(3)``, once per process, where the C library is glibc;
``KVMEM_CPU_MALLOC=default`` leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks above it still get their own mmap
TRIM_THRESHOLD = 1 << 30  # free heap kept for the next steps before any goes back


@functools.cache
def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; whether they were set."""
    if os.environ.get("KVMEM_CPU_MALLOC", "").lower() == "default" \
            or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
        and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if done:
        logger.debug("malloc keeps freed memory (mmap threshold %d MiB, trim threshold "
                     "%d MiB)", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return done
