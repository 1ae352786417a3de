"""Compile the CuTe kernels a benchmark run will need, on a machine without a GPU.

A device call is short, and each CuTe kernel it meets first costs a compile (~4-7 s of
one core per kernel here, more for masks with many intervals or residual predicates).
``--compile-only`` (``bench_head_dims.py``, ``bench_total.py``, ``bench_forward.py``) runs
the benchmark's own loops over its N, configurations, masks and ``--jcm-variants``, and
``pytest -p compile_only`` the selected GPU tests, with three things changed, so that every
kernel the device run would compile lands in the disk cache (``$JCOMPILEMASK_CACHE_DIR``):

- the cute backend is taken as available (an SM90 GPU is assumed; compiling needs
  ``CUTE_DSL_ARCH=sm_90a``), and registering a kernel compiles (or loads) it and registers
  its target for the CPU with a no-op XLA FFI handler, so a program runs to its end
  (results unset) and every kernel after the first is reached too;
- ``timing.jax_time`` calls its function once instead of timing it;
- ``jax.random.normal`` gives zeros (a kernel's key depends on shapes and static
  configuration, never on values; 32K-token inputs would take minutes of CPU RNG).

``scripts/kernel_cache.sh`` runs it in the device's Python twin (``scripts/device_env.sh``,
whose package versions the cache key names) and packs the cache for ``h200.sh``, which
unpacks it before a stage. Peers (FA4, cuDNN, FlexAttention) still compile on the device.
"""
from __future__ import annotations

import os

_KEYS: list = []      # the ForwardKey / BackwardKey / BackwardPrepKey / BackwardPostKey of every kernel compiled or loaded
_ACTIVE = False


def activate() -> None:
    """Patch this process into compile-only mode (module doc). Idempotent."""
    global _ACTIVE
    if _ACTIVE:
        return
    if not os.environ.get("CUTE_DSL_ARCH"):
        raise SystemExit("--compile-only needs CUTE_DSL_ARCH=sm_90a (there is no GPU to ask)")
    import jax
    import jax.numpy as jnp

    import timing
    from jcompilemask import backends
    from jcompilemask.kernels.cute import api

    backends._sm90_reason = lambda: None
    has = backends.missing        # jax-tvm-ffi only registers kernels, which this mode skips
    backends.missing = lambda *mods: has(*(m for m in mods if m != "jax_tvm_ffi"))

    noop = _noop_handler()

    def ensure_registered(key) -> str:
        if key not in _KEYS:
            api.kernel_function(key)       # compiled and saved, or loaded from the cache
            jax.ffi.register_ffi_target(key.target_name, noop, platform="cpu")
            _KEYS.append(key)
            print(f"compile-only: {type(key).__name__} {key.target_name}", flush=True)
        return key.target_name

    api._ensure_registered = ensure_registered

    def call_once(fn, **_kw) -> float:
        jax.block_until_ready(fn())
        return float("nan")           # no time: records of this mode are never saved

    timing.jax_time = call_once

    def zeros(key, shape=(), dtype=jnp.float32, *args, **kwargs):
        del key, args, kwargs
        return jnp.zeros(shape, dtype)

    jax.random.normal = zeros
    _ACTIVE = True


_NOOP_SOURCE = r"""
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;
static ffi::Error Noop(ffi::RemainingArgs, ffi::RemainingRets) { return ffi::Error::Success(); }
XLA_FFI_DEFINE_HANDLER_SYMBOL(jcm_compile_only_noop, Noop,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
"""


def _noop_handler():
    """An XLA FFI handler (a PyCapsule) that takes any buffers and does nothing: each kernel's
    target is registered with it for the CPU, so a program that calls the kernels runs to
    its end here (results unset) and every kernel after the first is reached too, in tests
    as in benchmarks. Built once with g++ against jaxlib's FFI headers (~1 s)."""
    import ctypes
    import hashlib
    import subprocess
    import tempfile

    import jax
    inc = jax.ffi.include_dir()
    tag = hashlib.sha256((_NOOP_SOURCE + inc).encode()).hexdigest()[:12]
    lib = os.path.join(tempfile.gettempdir(), f"jcm-compile-only-noop-{tag}.so")
    if not os.path.exists(lib):
        src = lib[:-3] + ".cc"
        with open(src, "w") as f:
            f.write(_NOOP_SOURCE)
        tmp = f"{lib}.{os.getpid()}"
        subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{inc}", src,
                        "-o", tmp], check=True)
        os.replace(tmp, lib)
    return jax.ffi.pycapsule(ctypes.CDLL(lib).jcm_compile_only_noop)


def summary() -> str:
    kinds = [type(k).__name__ for k in _KEYS]
    fwd, glue = kinds.count("ForwardKey"), kinds.count("BackwardPrepKey") + kinds.count("BackwardPostKey")
    return (f"compile-only: {fwd} forward and {len(_KEYS) - fwd - glue} backward kernels in the "
            f"cache" + (f" (and {glue} backward pre- / postprocess)" if glue else ""))


# -- as a pytest plugin: `pytest -p compile_only ...` with benchmarks/ on PYTHONPATH ----------
def pytest_configure(config):
    """Compile-only mode before the GPU test modules are imported (their ``needs_gpu`` marks
    ask the cute backend at import): each selected test runs on the CPU against the no-op
    kernels, so it fails, but every kernel it would launch lands in the disk cache."""
    import sys
    activate()
    # The GPU tests' own check (gpu_cases.sm90_gpu_reason, imported by name by the test
    # modules, so patched before they are collected).
    gpu_tests = os.path.join(str(config.rootpath), "tests", "gpu")
    if os.path.isdir(gpu_tests):
        sys.path.insert(0, gpu_tests)
        import gpu_cases
        gpu_cases.sm90_gpu_reason = lambda: None


def pytest_sessionfinish(session, exitstatus):
    del exitstatus
    print("\n" + summary(), flush=True)
    session.exitstatus = 0          # the tests' failures are expected: no kernel ran
