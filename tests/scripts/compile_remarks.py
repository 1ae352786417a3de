"""Compile the registry's default CuTe kernels for sm_90a and print ptxas's output.

    python tests/scripts/compile_remarks.py [name-substring ...]

Sets ``$JCOMPILEMASK_CUTE_PTXAS_REMARKS=1`` (``remarks{ptx}`` in the compile options). Each
kernel is announced by a ``KERNEL <name>`` line before it is compiled; the CuTe DSL then prints
ptxas's output for it (registers, stack, spills, and remarks such as C7512, "wgmma.mma_async
instructions are serialized due to insufficient register resources", which costs a GEMM-bound
kernel its overlap without failing anything). The compile tests of the defaults fail on C7512
(``tests/gpu/gpu_cases.compile_checking_remarks``). No GPU needed.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["JCOMPILEMASK_CUTE_PTXAS_REMARKS"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from jcompilemask.kernels.cute import api  # noqa: E402


def kernels():
    """(name, compile thunk) of the defaults the registry runs on built-in masks."""
    fwd = lambda d, k, bb, bh: api.ForwardKey(
        "bfloat16", d, d, k, *api.preferred_forward_tiles(d), bb, bh, d ** -0.5, api.preferred_forward_stages(d),
        **api.forward_switches(d, d, *api.preferred_forward_tiles(d), api.preferred_forward_stages(d)))
    bwd = lambda dt, d, k, kc, bb, bh: api.BackwardKey(dt, d, k, kc, bb, bh, d ** -0.5,
                                                       api.preferred_backward_config(d, dt))
    yield "fwd d128 K1 (causal)", lambda: api.compile_forward(fwd(128, 1, True, True))
    yield "fwd d64 K2 (hstu-like)", lambda: api.compile_forward(fwd(64, 2, False, True))
    yield "bwd d128 K1 Kc1 (causal)", lambda: api.compile_backward(bwd("bfloat16", 128, 1, 1, True, True))
    yield "bwd d64 K2 Kc4 (hstu-like)", lambda: api.compile_backward(bwd("bfloat16", 64, 2, 4, False, True))
    yield "bwd d128 K6 Kc7 fp16 per head (clear-like)", lambda: api.compile_backward(
        bwd("float16", 128, 6, 7, False, False))


def main(argv):
    want = set(argv)
    for name, thunk in kernels():
        if want and not any(w in name for w in want):
            continue
        print(f"KERNEL {name}", flush=True)
        thunk()
        sys.stdout.flush()
        sys.stderr.flush()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
