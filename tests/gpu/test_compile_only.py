"""benchmarks/compile_only.py: a benchmark's and a GPU test's kernels compiled into the disk
cache on a machine without a GPU (what scripts/kernel_cache.sh packs for a device call).
Needs the CuTe DSL compiler (make test-kernels)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None,
                                reason="nvidia-cutlass-dsl is not installed")


def _run(args, cache):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", JCOMPILEMASK_CACHE_DIR=str(cache),
               PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}")
    env.pop("JCOMPILEMASK_CUTE_BWD_CONFIG", None)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _kernels(cache):
    return sorted(json.loads(p.read_text())["shape_class"][0]
                  for p in cache.glob("cute-*/*/key.json") if (p.parent / "kernel.o").exists())


def test_benchmark_compile_only_fills_the_cache(tmp_path):
    out = _run(["benchmarks/bench_head_dims.py", "--compile-only", "--ns", "256", "--configs",
                "d64", "--jcm-variants", "q64@d64=block_q=64"], tmp_path)
    names = _kernels(tmp_path)
    # The forward, the default backward (128 x 128 at D 64) and the 64-query variant's
    # backward (its config from the variable and the descriptor's 64 x 128 tiles together).
    assert len(names) == 3, names
    bwd = [n for n in names if "_bwd_" in n]
    assert len(bwd) == 2 and {"_t128x128_" in n for n in bwd} == {True, False}, names
    assert "compile-only: 1 forward and 2 backward kernels in the cache" in out
    assert '"error"' not in out, out
    # A second run loads every kernel: nothing new in the cache.
    _run(["benchmarks/bench_head_dims.py", "--compile-only", "--ns", "256", "--configs", "d64"],
         tmp_path)
    assert _kernels(tmp_path) == names


def test_gpu_test_compile_only_fills_the_cache(tmp_path):
    out = _run(["-m", "pytest", "-q", "-p", "compile_only", "-p", "no:cacheprovider",
                "tests/gpu/test_cute_backward.py", "-k",
                "q128_gradients_match_the_reference and causal and not deterministic and not chunked"],
               tmp_path)
    assert "compile-only: 1 forward and 1 backward kernels in the cache" in out, out[-2000:]
    assert len(_kernels(tmp_path)) == 2
