"""One CuTe backward (causal 32K unless given) for Nsight Compute (bf16, 8 heads, D 128, 131072 tokens):

    ncu --kernel-name regex:FlashBackward --launch-skip 1 --launch-count 1 \\
        python3 tests/scripts/gpu_backward_profile.py [mask] [n]

JCM_PROF_SOFTCAP (e.g. 30) runs it with that logits soft cap. Runs the jitted gradient three times (the first compiles); nothing is timed here."""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jcompilemask as jcm  # noqa: E402
import workloads as W  # noqa: E402

mask = sys.argv[1] if len(sys.argv) > 1 else "causal"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
cap = float(os.environ.get("JCM_PROF_SOFTCAP", "0")) or None
b, L = W.batch_for(n), W.seq_len(mask, n)
spec, md = W.spec_for(mask, n), W.metadata_for(mask, n)
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (b, L, W.HEADS, W.HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
               for kk in ks)
loss = lambda a, c, e: jnp.sum(jcm.mask_attention(  # noqa: E731
    a, c, e, spec, metadata=md, implementation="cute", logits_soft_cap=cap).astype(jnp.float32) * do)
g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
for _ in range(3):
    jax.block_until_ready(g(q, k, v))
print("done", mask, n, b, "cap", cap)
