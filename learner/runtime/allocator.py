"""The worker process's memory allocator: one glibc malloc arena (issue #24, session 13).

glibc gives each thread that allocates its own arena (up to 8 per core). The runtime runs
a block's program, its filled receives and the replica's update on kept pool threads
(``comm.POOL``), and which pool thread takes which call changes from step to step; the
memory a step's tensors free goes back to the arena of the thread that allocated it, so
the next step, on another thread, allocates fresh pages from the kernel instead. Measured
with eager FRC (whose forward graphs live across the step boundary): 1,600-2,100 minor
page faults per step and worker with per-thread arenas, about 220 with one arena
(benchmarks/RESULTS.md, session 13), each ~1.5 us of kernel time on the worker's core.

With one arena every thread reuses the memory any thread freed. The threads that allocate
are few (the step loop, a block's thread, the updater, receives) and their allocations
are large tensors, so the arena's lock is not contended. Set before the process starts
its threads (``train`` does it first); threads that already allocated keep their arena.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt(3) parameter number (glibc's malloc.h)
M_ARENA_MAX = -8


def one_malloc_arena() -> bool:
    """Limit glibc's malloc to one arena for the rest of the process; False where the C
    library has no ``mallopt`` (not glibc) or refused it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, 1))
