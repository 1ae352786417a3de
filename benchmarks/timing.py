"""The one timing method of every benchmark script (JAX and torch alike).

``sustained(fn, sync)``: after warm-up, N back-to-back calls of ``fn`` synchronised once
(``sync(last result)``: ``jax.block_until_ready`` for JAX, ``torch.cuda.synchronize()``
for torch), host clock around them; the time per call is the median over ``repeats`` of
such loops. N is chosen so one loop lasts at least ``min_repeat_s`` (0.5 s by default):
long enough for the card to settle at its power-capped steady clock, which short bursts
(CUDA-event timings of a few hundred ms) do not reach, so they read faster than a
training step runs. One unmeasured loop of N calls precedes the measured ones for the
same reason. Each measured loop's wall-clock window is appended to ``windows`` (the
clock sampler's medians are taken over them, see ``clocks.py``).

>>> import time
>>> w = []
>>> t = sustained(lambda: time.sleep(0.001), lambda out: None, min_repeat_s=0.01,
...               repeats=3, windows=w)
>>> 0.0009 < t < 0.05 and len(w) == 3
True
"""
from __future__ import annotations

import math
import statistics
import time

MIN_REPEAT_S = 0.5
MAX_ITERS = 100_000


def sustained(fn, sync, *, warmup: int = 2, repeats: int = 5,
              min_repeat_s: float = MIN_REPEAT_S, iters: int | None = None,
              windows: list | None = None) -> float:
    """Seconds per call of ``fn`` (module doc). ``iters`` fixes N instead of calibrating."""
    out = None
    for _ in range(warmup):                 # compile / autotune, outside every loop
        out = fn()
    sync(out)
    if iters is None:
        k, elapsed = 1, 0.0
        while True:                         # calibrate: double until ~1/5 of a loop
            t0 = time.perf_counter()
            for _ in range(k):
                out = fn()
            sync(out)
            elapsed = time.perf_counter() - t0
            if elapsed >= min_repeat_s / 5 or k >= MAX_ITERS:
                break
            k *= 2
        iters = _iters_for(min_repeat_s, elapsed / k)
        t0 = time.perf_counter()
        for _ in range(iters):              # bring the card to its steady clock ...
            out = fn()
        sync(out)
        # ... and re-size N from this longer loop (the clock, so the speed, moved).
        iters = _iters_for(min_repeat_s, (time.perf_counter() - t0) / iters)
    times = []
    for _ in range(repeats):
        w0 = time.time()
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
        sync(out)
        times.append((time.perf_counter() - t0) / iters)
        if windows is not None:
            windows.append((w0, time.time()))
    return statistics.median(times)


def _iters_for(seconds, per_call):
    return int(min(MAX_ITERS, max(1, math.ceil(seconds / max(per_call, 1e-9)))))


def jax_sync(out):
    import jax
    jax.block_until_ready(out)


def torch_sync(_out):
    import torch
    torch.cuda.synchronize()


def jax_time(fn, **kw) -> float:
    return sustained(fn, jax_sync, **kw)


def torch_time(fn, **kw) -> float:
    return sustained(fn, torch_sync, **kw)
