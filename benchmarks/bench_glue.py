"""The CuTe backward's glue alone: what it reads besides Q, K, V and dO (lse2, delta, the
zeroed float32 dQ accumulator) and dQ's conversion from that accumulator, each as the XLA
passes and as the kernels of ``kernels/cute/glue.py``, at the benchmark shapes (131072
tokens per batch, B = 131072 / N, 8 heads, D 128, bf16, the backward's 64-query tiles).

    PYTHONPATH=. python3 benchmarks/bench_glue.py [--ns 8192,32768] [--out PATH]

Impls (``kind``: ``prep`` or ``post``):

- ``xla-prep``: ``api.backward_stats`` with mode None (delta's reduction, lse2's pad, the
  accumulator's zero fill);
- ``cute-prep``: mode ``"fused"`` (one kernel); ``cute-prep-zero``: mode ``"zero"`` (the
  kernel's zeros, XLA's delta and lse2);
- ``xla-post`` / ``cute-post``: ``api.backward_dq`` without / with ``post``.

Each is timed with ``timing.jax_time`` (the sustained loop every benchmark uses); a record
``{kind, impl, n, head_dim, us, gbytes, tb_per_s, run, sm_clock_mhz, power_w}`` per impl,
where ``gbytes`` counts what the pass must move (prep: O and dO read, the accumulator
written; post: the accumulator read, dQ written). Needs the GPU (the cute backend).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOKENS, HEADS, D, BLOCK_Q = 131072, 8, 128, 64
IMPLS = ("xla-prep", "cute-prep", "cute-prep-zero", "xla-post", "cute-post")


def moved_bytes(kind: str, n: int, head_dim: int = D, heads: int = HEADS,
                tokens: int = TOKENS) -> int:
    """Bytes a pass must move at N (``tokens`` / N sequences, bf16 O / dO / dQ, float32
    accumulator).

    >>> moved_bytes("prep", 8192) / 2**20, moved_bytes("post", 8192) / 2**20
    (1024.0, 768.0)
    """
    del n                                   # the bytes depend on the tokens alone
    rows = tokens * heads
    if kind == "prep":
        return rows * head_dim * (2 + 2 + 4)
    return rows * head_dim * (4 + 2)


def measure(impl: str, n: int, head_dim: int = D, heads: int = HEADS, tokens: int = TOKENS,
            **timing_kw) -> dict:
    import jax
    import jax.numpy as jnp

    import clocks
    import timing
    from jcompilemask.kernels.cute import api

    b = max(tokens // n, 1)
    tq = -(-n // BLOCK_Q)
    ks = jax.random.split(jax.random.key(n), 4)
    kind = impl.split("-")[1]
    if kind == "prep":
        out = jax.random.normal(ks[0], (b, n, heads, head_dim), jnp.float32).astype(jnp.bfloat16)
        do = jax.random.normal(ks[1], (b, n, heads, head_dim), jnp.float32).astype(jnp.bfloat16)
        lse = jax.random.normal(ks[2], (b, heads, n), jnp.float32)
        mode = {"xla-prep": None, "cute-prep": "fused", "cute-prep-zero": "zero"}[impl]
        fn = jax.jit(lambda o, d_, l_: api.backward_stats(o, d_, l_, head_dim=head_dim,
                                                          block_q=BLOCK_Q, mode=mode))
        args = (out, do, lse)
    else:
        acc = jax.random.normal(ks[3], (b, heads, tq, BLOCK_Q * head_dim), jnp.float32)
        fn = jax.jit(lambda a: api.backward_dq(a, n, head_dim, BLOCK_Q, head_dim ** -0.5,
                                               jnp.bfloat16, post=impl == "cute-post"))
        args = (acc,)
    windows: list = []
    clocks.start()
    s = timing.jax_time(lambda: fn(*args), windows=windows, **timing_kw)
    nbytes = moved_bytes(kind, n, head_dim, heads, b * n)
    rec = dict(kind=kind, impl=impl, n=n, head_dim=head_dim, us=round(s * 1e6, 2),
               gbytes=round(nbytes / 1e9, 4), tb_per_s=round(nbytes / s / 1e12, 3),
               **clocks.fields(windows))
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", default="8192,32768")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--tokens", type=int, default=TOKENS, help="tokens per batch (B = tokens / N)")
    ap.add_argument("--min-repeat-s", type=float, default=None,
                    help="each timing loop's length (timing.sustained's min_repeat_s)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                  "h200-glue.json"))
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    bad = sorted(set(impls) - set(IMPLS))
    if bad:
        ap.error(f"--impls: unknown {bad}; choose from {','.join(IMPLS)}")
    records = []
    for n in map(int, args.ns.split(",")):
        for impl in impls:
            try:
                kw = {} if args.min_repeat_s is None else {"min_repeat_s": args.min_repeat_s}
                rec = measure(impl, n, tokens=args.tokens, **kw)
            except Exception as err:          # one failing impl keeps the others' figures
                rec = dict(kind=impl.split("-")[1], impl=impl, n=n, error=repr(err)[:500])
            print(json.dumps(rec), flush=True)
            records.append(rec)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    old = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f).get("records", [])
    with open(args.out, "w") as f:
        json.dump({"records": old + records}, f, indent=1)
        f.write("\n")
    return records


if __name__ == "__main__":
    main()
