"""Forward speed of the step-2 variants (head dims 64 / 128 / 256, soft cap, K/V stages) on SM90.

    PYTHONPATH=. python3 benchmarks/bench_cute_variants.py [--ns 8192,32768] [--out FILE]

Causal, 8 heads, batch 131072 / N, bf16 (and fp16 at D = 128): FLOPs = 4 * D * heads *
(visible pairs), time = median over repeats of `iters` back-to-back calls synchronised
once (the method of benchmarks/bench_forward.py, docs/workloads.md). The rows answer the
questions NOTES.md leaves open: D = 128 unchanged (compare with 582 TF/s at 32K), what
the soft cap costs with the exact tanh and with tanh.approx, D = 64 at 2 vs 3 stages,
and D = 256 at 128 x 80. Needs an SM90 GPU and jax-tvm-ffi.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clocks  # noqa: E402  (run id, SM clock / power medians of every record)
from bench_forward import _median_time  # noqa: E402  (one timing method for all)

# (label, head_dim, dtype, softcap, fast_tanh, num_stages or None for the preferred one)
VARIANTS = [
    ("d128", 128, "bfloat16", None, False, None),
    ("d128-fp16", 128, "float16", None, False, None),
    ("d128-cap", 128, "bfloat16", 30.0, False, None),
    ("d128-cap-fasttanh", 128, "bfloat16", 30.0, True, None),
    ("d64-s3", 64, "bfloat16", None, False, 3),
    ("d64-s2", 64, "bfloat16", None, False, 2),
    ("d64-cap", 64, "bfloat16", 30.0, False, None),
    ("d64-cap-fasttanh", 64, "bfloat16", 30.0, True, None),
    ("d256", 256, "bfloat16", None, False, None),
    ("d256-cap", 256, "bfloat16", 30.0, False, None),
]


def bench(ns, heads=8, labels=None) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jcompilemask.kernels.cute.api import cute_forward, preferred_forward_tiles
    from jcompilemask.kernels.cute.testing import causal_intervals, causal_visible_pairs, tiles_from_intervals

    records = []
    for n in ns:
        B = 131072 // n
        iv = jnp.asarray(causal_intervals(n))
        for label, d, dtype, cap, fast, stages in VARIANTS:
            if labels and label not in labels:
                continue
            bq, bk = preferred_forward_tiles(d, dtype)
            tiles = jnp.asarray(tiles_from_intervals(causal_intervals(n), n, bq, bk))
            kq, kk, kv = jax.random.split(jax.random.PRNGKey(n), 3)
            q, k, v = (jax.random.normal(x, (B, n, heads, d), "float32").astype(dtype) for x in (kq, kk, kv))
            fwd = jax.jit(lambda q, k, v, iv, t, d=d, cap=cap, fast=fast, stages=stages, bq=bq, bk=bk: cute_forward(
                q, k, v, iv, t, scale=1 / math.sqrt(d), softcap=cap, block_q=bq, block_kv=bk,
                num_stages=stages, softcap_fast_tanh=fast))
            clocks.start()
            win = []
            sec = _median_time(lambda: fwd(q, k, v, iv, tiles), warmup=3, repeats=5, windows=win)
            flops = 4 * d * heads * B * causal_visible_pairs(n)
            rec = {"mask": "causal", "n": n, "impl": f"jcm-cute-{label}", "head_dim": d, "dtype": dtype,
                   "softcap": cap, "fast_tanh": fast, "fwd_ms": sec * 1e3, "fwd_tflops": flops / sec / 1e12,
                   **clocks.fields(win)}
            print(f"{label:>18} n={n:>6} B={B:>3}: {rec['fwd_ms']:8.3f} ms {rec['fwd_tflops']:6.1f} TF/s", flush=True)
            records.append(rec)
            del q, k, v
    return records


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="8192,32768")
    ap.add_argument("--only", default="", help="comma-separated labels of VARIANTS")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    recs = bench([int(x) for x in a.ns.split(",")], labels=set(filter(None, a.only.split(","))))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"run": clocks.run_id(), "records": recs}, f, indent=1)


if __name__ == "__main__":
    main()
