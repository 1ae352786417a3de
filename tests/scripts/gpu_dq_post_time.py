"""The XLA work around the CuTe backward's kernel, timed alone on the GPU (issue 12: what the
bwd_ms figure holds besides the kernel, where FA4 runs its own small kernels):

    python3 tests/scripts/gpu_dq_post_time.py [n]        # default 8192; 131072 tokens per batch

Each line is a JSON record (``run``, ``sm_clock_mhz``, ``ms``) for one piece, timed with the
benchmarks' sustained loop at the benchmark shape (bf16, 8 heads, D 128):

- ``dq_post``: the dQ accumulator's un-permute (``api.dq_fragment_unpermute``, the slot
  order the kernel writes), the scale and the cast — as ``cute_backward`` runs it;
- ``dq_post_blocked``: the same from a slot order of (column block of 8, row, 8 floats)
  (a candidate kernel layout: 32-byte runs on both sides of the transpose);
- ``dq_cast``: the scale and cast alone (no permutation): the bytes' floor;
- ``delta``: rowsum(dO * O) (``softmax_delta``); ``dq_zeros``: the zeroed accumulator.
"""
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import clocks  # noqa: E402
import timing  # noqa: E402
import workloads as W  # noqa: E402
from jcompilemask.attention.xla import softmax_delta  # noqa: E402
from jcompilemask.kernels.cute.api import dq_fragment_unpermute  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
b, h, d, bq = int(os.environ.get("JCM_POST_B", W.batch_for(n))), W.HEADS, W.HEAD_DIM, 64
tq = n // bq
acc = jax.random.normal(jax.random.key(0), (b, h, tq, bq * d), jnp.float32)
o, do = (jax.random.normal(jax.random.key(i), (b, n, h, d), jnp.float32).astype(jnp.bfloat16)
         for i in (1, 2))
lse = jnp.zeros((b, h, n), jnp.float32)
s = np.float32(0.088)



pieces = {
    "dq_post": (jax.jit(lambda x: (dq_fragment_unpermute(x, n, d) * s).astype(jnp.bfloat16)), (acc,)),
    "dq_post_blocked": (jax.jit(lambda x: (dq_fragment_unpermute(x, n, d, blocked=True) * s)
                                .astype(jnp.bfloat16)), (acc,)),
    "dq_cast": (jax.jit(lambda x: (x * s).astype(jnp.bfloat16)), (acc,)),
    "delta": (jax.jit(lambda a, c, l: softmax_delta(a, c, l)), (o, do, lse)),
    "dq_zeros": (jax.jit(lambda: jnp.zeros((b, h, tq, bq * d), jnp.float32)), ()),
}
clocks.start()
for name, (fn, args) in pieces.items():
    windows = []
    ms = 1e3 * timing.jax_time(lambda: fn(*args), min_repeat_s=0.25, windows=windows)
    rec = {"run": clocks.run_id(), "piece": name, "n": n, "batch": b, "ms": round(ms, 4),
           "gb": round(acc.size * 4 / 1e9, 3)}
    rec.update(clocks.summary(windows))
    print(json.dumps(rec), flush=True)
