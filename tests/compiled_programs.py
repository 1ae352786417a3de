"""Keep a test process's compiled XLA programs below the kernel's memory-map limit.

Every XLA:CPU executable maps its JIT-compiled code into the process; JAX keeps the
executables it compiled in its caches. A test worker that compiles thousands of distinct
programs (the fuzz stages: a new mask and shapes per case, each descriptor one jitted
program) reached Linux's ``vm.max_map_count`` (65530) and LLVM aborted inside XLA's
compiler (``Fatal Python error: Aborted`` in ``backend_compile_and_load``; the most likely
cause: the two fuzz tests of one run alone leave 28600 maps in their process, and a CI
worker runs half the suite). ``release_if_needed`` drops JAX's caches once
the process holds more than ``LIMIT`` maps (the programs are recompiled if needed again).
"""
from __future__ import annotations

import gc

LIMIT = 20000


def map_count() -> int | None:
    """Memory maps of this process (None where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def release_if_needed(limit: int = LIMIT) -> bool:
    """``jax.clear_caches()`` when the process holds more than `limit` maps; True if it did."""
    n = map_count()
    if n is None or n <= limit:
        return False
    import jax
    jax.clear_caches()
    gc.collect()
    return True
