"""A small CuTe backward run for compute-sanitizer (memcheck / racecheck) on the H200:

    compute-sanitizer --tool memcheck python3 tests/scripts/gpu_backward_small.py

Ragged lengths, fully masked rows, GQA, both head dims and a K = 6 / Kc = 7 mask; prints
the max |error| of each gradient against the xla backward (no tolerance decision here:
tests/gpu/test_cute_backward.py makes that)."""
import os
import sys

os.environ.setdefault("JCOMPILEMASK_CUTE_BACKWARD", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jcompilemask as jcm  # noqa: E402
from gpu_cases import SPECS, metadata  # noqa: E402

rng = np.random.default_rng(0)
CASES = (("causal", 128, 200), ("clear", 64, 260), ("hstu", 128, 333))
only = sys.argv[1:]                         # e.g. `gpu_backward_small.py hstu`: that case alone
for name, d, n in (c for c in CASES if not only or c[0] in only):
    spec, md = SPECS[name], metadata(name, 1, n, rng)
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, n, 4, d), jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, n, 2, d), jnp.float32).astype(jnp.bfloat16) for kk in ks[1:3])
    do = jax.random.normal(ks[3], (1, n, 4, d), jnp.float32).astype(jnp.bfloat16)

    def grads(impl):
        loss = lambda a, b, c: jnp.sum(jcm.mask_attention(  # noqa: E731
            a, b, c, spec, metadata=md, implementation=impl).astype(jnp.float32) * do)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    ours = grads("cute")
    if os.environ.get("JCM_SMALL_NO_REF"):    # under compute-sanitizer: the CuTe kernels alone
        print(name, d, n, "finite:", [bool(jnp.all(jnp.isfinite(g))) for g in ours], flush=True)
        continue
    os.environ["JCOMPILEMASK_CUTE_BACKWARD"] = "0"
    ref = grads("cute")                       # same forward, xla backward
    os.environ["JCOMPILEMASK_CUTE_BACKWARD"] = "1"
    errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(ours, ref)]
    print(name, d, n, "max |d(q,k,v) - xla|:", ["%.3g" % e for e in errs], flush=True)
print("done")
