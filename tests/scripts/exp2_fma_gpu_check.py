"""The kernel's FMA-pipe exp2 (``kernels/cute/exp2_fma.py``, ``BackwardConfig.exp2_emu``) on a
GPU against its numpy model, bit for bit, and against the MUFU's ``ex2.approx.ftz.f32``.

    python tests/scripts/exp2_fma_gpu_check.py          # needs cupy and a CUDA GPU

Runs ``EXP2_FMA_PTX`` as inline PTX in a CuPy RawKernel (no cutlass needed) over a dense
sweep of [-130, 1], every 61st float32 bit pattern and the special values, and compares
with ``exp2_fma_reference`` (tests/test_exp2_emulation.py): prints the mismatches (want 0)
and the largest relative difference from the MUFU where that is >= 2^-126.
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

from jcompilemask.kernels.cute.exp2_fma import EXP2_FMA_PTX  # noqa: E402
from test_exp2_emulation import exp2_fma_reference  # noqa: E402


def main():
    import cupy as cp
    ptx = EXP2_FMA_PTX.replace("$", "%").replace("\n", "\\n")
    src = r"""
extern "C" __global__ void run(const float* x, float* emu, float* mufu, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i], y, z;
    asm("%s" : "=f"(y) : "f"(v));
    asm("ex2.approx.ftz.f32 %%0, %%1;" : "=f"(z) : "f"(v));
    emu[i] = y;
    mufu[i] = z;
}
""" % ptx
    kern = cp.RawKernel(src, "run")
    specials = np.float32([-np.inf, np.inf, np.nan, -np.nan, 0.0, -0.0, -127.0, -126.5, -126.0,
                           -125.9999, 127.9999, 128.0, 1e30, -1e30, 3.4e38, -3.4e38, 1e-45, -1e-45])
    x = np.concatenate([specials, np.linspace(-130.0, 1.0, 50_000_001).astype(np.float32),
                        np.arange(0, 2 ** 32, 61, dtype=np.int64).astype(np.uint32).view(np.float32)])
    n = x.size
    dx = cp.asarray(x)
    emu, mufu = cp.empty_like(dx), cp.empty_like(dx)
    kern(((n + 255) // 256,), (256,), (dx, emu, mufu, cp.int64(n)))
    emu, mufu = cp.asnumpy(emu), cp.asnumpy(mufu)
    ref = np.concatenate([exp2_fma_reference(x[i:i + 10_000_000]) for i in range(0, n, 10_000_000)])
    same = (emu.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(emu) & np.isnan(ref))
    bad = np.flatnonzero(~same)
    print(f"{n} inputs: {bad.size} differ from the numpy model bit for bit")
    for i in bad[:10]:
        print(f"  x={x[i]!r} ({x[i].view(np.uint32):08x}): gpu {emu[i]!r} ({emu[i].view(np.uint32):08x}) "
              f"model {ref[i]!r} ({ref[i].view(np.uint32):08x})")
    for v, e, m in zip(specials, emu[:specials.size], mufu[:specials.size]):
        print(f"  x={v!r}: fma {e!r} mufu {m!r}")
    with np.errstate(invalid="ignore", divide="ignore"):
        live = np.isfinite(mufu) & (mufu >= 2.0 ** -126)
        rel = np.abs(emu[live].astype(np.float64) - mufu[live]) / mufu[live]
        exact = np.exp2(x[live].astype(np.float64))
        rel_exact = np.abs(emu[live].astype(np.float64) - exact) / exact
    print(f"max |fma - mufu| / mufu {rel.max():.3e} at x={x[live][rel.argmax()]!r}; "
          f"max relative error vs exact {rel_exact.max():.3e}")
    zero_mismatch = np.sum((mufu == 0) != (emu == 0))
    nan_mismatch = np.sum(np.isnan(mufu) != np.isnan(emu))
    print(f"zero where the MUFU gives zero: {zero_mismatch} mismatches; NaN: {nan_mismatch} mismatches")
    return 1 if bad.size else 0


if __name__ == "__main__":
    raise SystemExit(main())
