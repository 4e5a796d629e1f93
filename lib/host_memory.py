"""Keep freed host memory for reuse instead of handing it back to the OS after every step.

XLA:CPU allocates a step's scratch space (327 MB for the bench's issue shape) with `malloc`
at the start of every execution and frees it at the end. glibc serves a block that large with
a fresh `mmap` from a worker thread's arena, so every step page-faults and zero-fills all of it,
and a thread then spends ~20 ms in `munmap` after the step, on a 2-core host exactly when the
loop wants to start its checkpoint save. With one arena, no `mmap` for large blocks and no
trimming, the same pages serve every step. Host RSS then stays at its high-water mark, which
is what a training process reaches on its first step anyway.

It only acts on glibc, and only on threads that take an arena after the call, so it must run
before JAX starts its backend (the recipes call it first thing).
"""

from __future__ import annotations

import ctypes
import ctypes.util

# From glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Tell glibc malloc to keep and reuse freed memory; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # only glibc has it: elsewhere mallopt may mean something else
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))
    return all(mallopt(option, value) == 1 for option, value in settings)
