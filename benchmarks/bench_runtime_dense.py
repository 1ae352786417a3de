"""The parts of a run-time dense mask's preprocess (``jcompilemask.lower.dense_runtime``),
timed alone: packing the rows and the columns, the run tables (K 8 by a search per slot;
K 1 and the counts by one reduction), and the whole plan that
``mask_attention`` builds (every tier's descriptor and the bitmap's), on the packed
causal documents mask of ``documents_traced`` (benchmarks/workloads.py).

    PYTHONPATH=. python3 benchmarks/bench_runtime_dense.py [--ns 8192] [--out F.json]

One JSON record per part (``part``, ``n``, ``batch``, ``ms``, ``gb_per_s`` of the mask's
bytes, ``run``, ``sm_clock_mhz``); ``--smoke`` runs small shapes on a CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import clocks  # noqa: E402
import timing  # noqa: E402
import workloads as W  # noqa: E402


def _traced_with_switch(fn, arg, value):
    """``fn`` (jitted) traced once on ``arg`` with ``$JCOMPILEMASK_CUTE_TRANSPOSE_WORDS`` set
    to ``value`` (the switch is read while tracing); later calls reuse that trace."""
    import jax
    old = os.environ.get("JCOMPILEMASK_CUTE_TRANSPOSE_WORDS")
    os.environ["JCOMPILEMASK_CUTE_TRANSPOSE_WORDS"] = value
    try:
        jax.block_until_ready(fn(arg))
    finally:
        if old is None:
            os.environ.pop("JCOMPILEMASK_CUTE_TRANSPOSE_WORDS")
        else:
            os.environ["JCOMPILEMASK_CUTE_TRANSPOSE_WORDS"] = old
    return fn


def parts(n, batch, heads=W.HEADS, head_dim=W.HEAD_DIM):
    """{name: zero-argument callable} of the preprocess parts on one mask."""
    import jax
    import jax.numpy as jnp

    import jcompilemask as jcm
    from jcompilemask.attention.api import runtime_dense_plan
    from jcompilemask.lower import dense_runtime as R

    ids = jnp.asarray(W.metadata_for("documents_traced", n, batch=batch)["segment_ids"])
    arr = jax.jit(lambda s: ((s[:, :, None] == s[:, None, :])
                             & jnp.tril(jnp.ones((n, n), bool))[None])[:, None])(ids)
    q = jnp.zeros((batch, n, heads, head_dim), jnp.bfloat16)
    rows = jax.jit(lambda m: R.pack_words(m, -1))
    cols = jax.jit(lambda m: R.pack_words(m, -2))
    runs = jax.jit(lambda m: R.dense_runs(m, 8, 8)[:6])
    row_words = rows(arr)
    tables = jax.jit(lambda w: R.runs_from_words(w, 8))
    first = jax.jit(R.first_runs_from_words)
    plan = _traced_with_switch(
        jax.jit(lambda m: runtime_dense_plan(q, q, jcm.runtime_dense(m))[::2]), arr, "0")
    from jcompilemask.lower.preprocess import tile_states_from_intervals
    rs, rl = tables(row_words)[:2]
    st_words = jax.jit(lambda w: [R.tile_states_from_words(w, n, n, bq, bk)
                                  for bq, bk in ((128, 128), (64, 128))])
    st_iv = jax.jit(lambda s_, l_: [tile_states_from_intervals(s_, l_, n, n, bq, bk)
                                    for bq, bk in ((128, 128), (64, 128))])
    fns = {}
    if jcm.backends.get("cute").available() is None:
        # the column pack in one CuTe kernel (glue.TransposeWords), checked equal first,
        # and the plan with it (the default where the tiers run on cute; "plan" is the
        # plan with XLA's pack, $JCOMPILEMASK_CUTE_TRANSPOSE_WORDS=0)
        from jcompilemask.kernels.cute import api as cute_api
        cols_k = jax.jit(lambda m: cute_api.transpose_words(R.pack_words(m, -1), n, n))
        if not bool(jnp.all(cols_k(arr) == cols(arr))):
            raise AssertionError("the CuTe column pack differs from pack_words(mask, -2)")
        plan_k = _traced_with_switch(
            jax.jit(lambda m: runtime_dense_plan(q, q, jcm.runtime_dense(m))[::2]), arr, "1")
        fns = {"pack_cols_kernel": lambda: cols_k(arr), "plan_kernel_cols": lambda: plan_k(arr)}
    return arr, {**fns, "pack_rows": lambda: rows(arr), "pack_cols": lambda: cols(arr),
                 "row_tables_from_words": lambda: tables(row_words),
                 "row_first_runs_from_words": lambda: first(row_words),
                 "tile_states_words_2cfg": lambda: st_words(row_words),
                 "tile_states_intervals_2cfg": lambda: st_iv(rs, rl),
                 "dense_runs_k8": lambda: runs(arr), "plan": lambda: plan(arr)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="8192")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    run = os.environ.get("JCM_RUN_ID")
    recs = []
    for n in (int(x) for x in args.ns.split(",")):
        batch = 2 if args.smoke else W.batch_for(n)
        arr, fns = parts(n, batch, *((2, 16) if args.smoke else ()))
        for name, fn in fns.items():
            windows = []
            kw = dict(iters=2, repeats=1) if args.smoke else dict(min_repeat_s=0.25)
            t = timing.jax_time(fn, windows=windows, **kw)
            rec = dict(part=name, n=n, batch=batch, ms=round(t * 1e3, 4),
                       gb_per_s=round(arr.size / t / 1e9, 1), run=run,
                       **({} if args.smoke else clocks.summary(windows)))
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"run": run, "smoke": args.smoke, "records": recs}, f, indent=1)
    return recs


if __name__ == "__main__":
    main()
