"""benchmarks/kernel_times.py on the GPU: the jax.profiler trace of a CuTe training step is
read from the GPU plane's stream lines and names our kernels (its CPU twin,
tests/test_benchmarks.py, reads the host plane of an xla step)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from jcompilemask import backends

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_why = backends.get("cute").available()
needs_gpu = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")


def _kernel_times():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "kernel_times", os.path.join(ROOT, "benchmarks", "kernel_times.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_gpu
def test_kernel_times_lists_the_cute_kernels_of_a_step():
    """Causal 2K (64 sequences, 8 heads, D 128): the step's kernels come from the GPU
    plane, the CuTe forward and backward among them, once per step each, and the kernel
    time per step is below the host's wall time per step plus slack (no double count)."""
    kt = _kernel_times()
    rec = kt.measure("causal", 2048, "jcm", steps=3)
    assert rec["impl"] == "jcm-cute", rec["impl"]
    assert rec["lines"] and all(x.startswith("/device:GPU") for x in rec["lines"]), rec["lines"]
    names = [r["name"] for r in rec["kernels"]]
    fwd = [r for r in rec["kernels"] if "FlashForward" in r["name"]]
    bwd = [r for r in rec["kernels"] if "FlashBackward" in r["name"]]
    assert fwd and bwd, names[:10]
    assert fwd[0]["calls"] == 1 and bwd[0]["calls"] == 1, (fwd[0], bwd[0])
    assert 0 < rec["gpu_ms"] <= rec["wall_ms"] * 1.1 + 0.1, (rec["gpu_ms"], rec["wall_ms"])
