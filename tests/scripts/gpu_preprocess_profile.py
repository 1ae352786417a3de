"""The jnp preprocess of one workload on the GPU, for Nsight Compute's per-kernel listing:

    ncu --section SpeedOfLight --launch-skip K --launch-count M -o /tmp/pre \\
        python3 tests/scripts/gpu_preprocess_profile.py [mask] [n]

Builds the descriptor of ``benchmarks/workloads.py``'s metadata with the jitted jnp
preprocess (``cm.instantiate(..., preprocess="jnp")``, as ``bench_total.py`` times it) and
prints the kernel count of one call and its wall time. Runs it four times (the first
compiles, the rest are what ncu should see); nothing else runs on the GPU."""
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jcompilemask as jcm  # noqa: E402
import workloads as W  # noqa: E402

mask = sys.argv[1] if len(sys.argv) > 1 else "shared_prompt"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
L = W.seq_len(mask, n)
cm = jcm.compile(W.spec_for(mask, n))
md = W.metadata_for(mask, n)
md = None if md is None else {k: jnp.asarray(v) for k, v in md.items()}
inst = jax.jit(lambda m: cm.instantiate(m, L, L, preprocess="jnp"))
compiled = inst.lower(md).compile()
text = compiled.as_text()
print("fusions / scatters / sorts / custom calls in the GPU program:", text.count(" fusion("),
      text.count(" scatter("), text.count(" sort("), text.count(" custom-call("), flush=True)
for i in range(4):
    t = time.perf_counter()
    jax.block_until_ready(inst(md))
    print(f"call {i}: {(time.perf_counter() - t) * 1e3:.3f} ms", flush=True)
print("done", mask, n, W.batch_for(n))
