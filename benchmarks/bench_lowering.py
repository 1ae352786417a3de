"""Lowering benchmark (issue 3): ``compile()`` and the jnp preprocess, steady state.

Per built-in mask:

* ``compile``: building the MaskSpec and lowering it with sympy, fresh -- the compile
  cache and sympy's own cache are cleared first. Budget: 2 s.
* ``instantiate``: the jitted jnp preprocess (metadata -> ExecutionDescriptor) at
  Nq = Nk = N (default 32768), batch B (default 4), forward tiles 128x128, backward tiles
  64x128 (or ``--bwd-tiles 128x128``). Timed after a warm-up call (which traces and
  compiles, reported separately as ``first``), median of ``--repeats`` runs, each on
  freshly sampled metadata with ``block_until_ready``. Budget: 2 s.

Metadata follows docs/workloads.md (HSTU, shared prompt, CLEAR); for CLEAR the row
count is N: a text of U[128, 384] tokens, then an image of N - 384 tokens of width
2^ceil(log2(sqrt(image))), then padding (``clear@paper`` keeps the paper's layout, an
image of N tokens in N + 384 rows). The other masks use plausible values (stated in
``WORKLOADS``).

    python benchmarks/bench_lowering.py       # table + benchmarks/results/cpu-lowering.json
    python benchmarks/bench_lowering.py --n 4096 --masks causal,hstu --check
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

import jcompilemask as jcm
from jcompilemask.lower import compiled as _compiled

BUDGET_S = 2.0
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "cpu-lowering.json")


def _clear_width(image: int) -> int:
    return 2 ** math.ceil(math.log2(math.sqrt(max(image, 1))))


# name -> (spec factory(n), metadata sampler(rng, n, b) or None, rows(n), description)
def _hstu_md(rng, n, b):
    a = rng.integers(n // 4, n // 2 + 1, b)
    g = rng.integers(3, 9, b)
    cnt = rng.integers(3, 9, b)
    return {"context_len": a, "history_end": n - g * cnt, "group_size": g}


def _shared_prompt_md(rng, n, b, r=6):
    lens = rng.integers(n // 16, n // 11 + 1, (b, r))
    p = n - lens.sum(1)
    starts = p[:, None] + np.concatenate([np.zeros((b, 1), np.int64),
                                          np.cumsum(lens, 1)[:, :-1]], 1)
    return {"prompt_len": p, "response_starts": starts}


def _document_md(rng, n, b):
    ids = np.full((b, n), -1, np.int64)
    for s in range(b):
        pos, doc = 0, 0
        end = n - int(rng.integers(0, n // 16))          # trailing padding
        while pos < end:
            ln = int(rng.integers(n // 16, n // 4 + 1))
            ids[s, pos:min(pos + ln, end)] = doc
            pos, doc = pos + ln, doc + 1
    return {"segment_ids": ids}


def _clear_md(image):
    def md(rng, n, b):
        return {"text_len": rng.integers(128, 385, b), "image_len": np.full(b, image(n))}
    return md


WORKLOADS = {
    "causal": (lambda n: jcm.masks.causal(), None, lambda n: n, "k <= q"),
    "full": (lambda n: jcm.masks.full(), None, lambda n: n, "all visible"),
    "sliding_window": (lambda n: jcm.masks.sliding_window(1024, 0), None, lambda n: n,
                       "left 1024, right 0"),
    "chunked_causal": (lambda n: jcm.masks.chunked_causal(1024), None, lambda n: n,
                       "chunks of 1024"),
    "prefix_lm": (lambda n: jcm.masks.prefix_lm(),
                  lambda rng, n, b: {"prefix_len": rng.integers(n // 8, n // 2 + 1, b)},
                  lambda n: n, "prefix ~ U[N/8, N/2]"),
    "document": (lambda n: jcm.masks.document(), _document_md, lambda n: n,
                 "docs ~ U[N/16, N/4] tokens, tail padding"),
    "document_bidir": (lambda n: jcm.masks.document(causal=False), _document_md,
                       lambda n: n, "as document, not causal"),
    "hstu": (lambda n: jcm.masks.hstu(), _hstu_md, lambda n: n, "docs/workloads.md"),
    "shared_prompt": (lambda n: jcm.masks.shared_prompt(6), _shared_prompt_md, lambda n: n,
                      "6 responses ~ U[N/16, N/11] (section 8)"),
    "clear": (lambda n: jcm.masks.clear(_clear_width(n - 384), 2),
              _clear_md(lambda n: n - 384), lambda n: n,
              "text U[128,384] + image N-384, padded to N"),
    "clear@paper": (lambda n: jcm.masks.clear(_clear_width(n), 2), _clear_md(lambda n: n),
                    lambda n: n + 384, "text U[128,384] + image N, padded to N+384"),
}


def time_compile(factory, n, repeats=3):
    """Seconds to build the spec and lower it, with every cache cleared (median)."""
    import sympy.core.cache
    out = []
    for _ in range(repeats):
        _compiled._compile_cached.cache_clear()
        sympy.core.cache.clear_cache()
        t0 = time.perf_counter()
        cm = jcm.compile(factory(n))
        out.append(time.perf_counter() - t0)
    return statistics.median(out), cm


def time_instantiate(cm, sampler, rows, b, tiles, repeats, seed=0):
    rng = np.random.default_rng(seed)
    bq, bk, bbq, bbk = tiles

    def build(md):
        return cm.instantiate(md, rows, rows, block_q=bq, block_kv=bk, bwd_block_q=bbq,
                              bwd_block_kv=bbk)

    fn = jax.jit(build)
    sample = (lambda: None) if sampler is None else (
        lambda: {k_: np.asarray(v, np.int32) for k_, v in sampler(rng, rows, b).items()})
    # Validate once eagerly on concrete values (range checks), outside the timing.
    if sampler is not None:
        cm.spec.normalize_metadata(sample(), rows, rows)
    md = sample()
    t0 = time.perf_counter()
    jax.block_until_ready(fn(md))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        md = sample()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(md))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=32768, help="Nq = Nk (default 32768)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tiles", default="128x128", help="forward tiles, QxKV")
    ap.add_argument("--bwd-tiles", default="64x128", help="backward tiles, QxKV")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--masks", default=",".join(WORKLOADS),
                    help="comma-separated subset of " + ",".join(WORKLOADS))
    ap.add_argument("--out", default=RESULTS, help="JSON path ('' to skip)")
    ap.add_argument("--check", action="store_true", help="exit 1 if over a budget")
    args = ap.parse_args(argv)
    bq, bk = map(int, args.tiles.split("x"))
    bbq, bbk = map(int, args.bwd_tiles.split("x"))
    names = [m for m in args.masks.split(",") if m]
    unknown = [m for m in names if m not in WORKLOADS]
    if unknown:
        ap.error(f"unknown masks {unknown}; choose from {list(WORKLOADS)}")

    print(f"jcompilemask lowering benchmark: N = {args.n}, B = {args.batch}, fwd tiles "
          f"{bq}x{bk}, bwd tiles {bbq}x{bbk}, jax {jax.__version__} on "
          f"{jax.devices()[0].platform} ({os.cpu_count()} CPUs), median of {args.repeats}")
    head = (f"{'mask':<16}{'rows':>7}{'B':>3}{'K':>3}{'Kc':>4}{'compile s':>11}"
            f"{'first s':>9}{'instantiate ms':>16}  budget")
    print(head)
    print("-" * len(head))
    records, ok_all = [], True
    for name in names:
        factory, sampler, rows_of, desc = WORKLOADS[name]
        rows = rows_of(args.n)
        compile_s, cm = time_compile(factory, args.n)
        b = args.batch if sampler is not None else 1
        first, med, best = time_instantiate(cm, sampler, rows, args.batch,
                                            (bq, bk, bbq, bbk), args.repeats)
        ok = compile_s < BUDGET_S and med < BUDGET_S
        ok_all &= ok
        print(f"{name:<16}{rows:>7}{b:>3}{cm.num_intervals:>3}{cm.num_bwd_intervals:>4}"
              f"{compile_s:>11.3f}{first:>9.2f}{med * 1e3:>16.1f}  "
              f"{'ok' if ok else 'OVER'}")
        records.append({
            "mask": name, "n": args.n, "rows": rows, "batch": b,
            "impl": "jcm-jnp-preprocess", "workload": desc,
            "K": cm.num_intervals, "Kc": cm.num_bwd_intervals,
            "tiles": {"fwd": [bq, bk], "bwd": [bbq, bbk]},
            "compile_s": round(compile_s, 4), "first_call_s": round(first, 3),
            "instantiate_ms_median": round(med * 1e3, 2),
            "instantiate_ms_min": round(best * 1e3, 2), "repeats": args.repeats,
            "within_budget": ok})
        if name.startswith("clear"):
            records[-1]["image_tokens"] = int(rows - 384)
    print(f"budgets: compile < {BUDGET_S} s, instantiate < {BUDGET_S} s: "
          f"{'all met' if ok_all else 'SOME OVER'}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"benchmark": "lowering", "device": "cpu",
                       "machine": {"platform": platform.platform(),
                                   "processor": platform.processor() or platform.machine(),
                                   "cpus": os.cpu_count(), "python": sys.version.split()[0],
                                   "jax": jax.__version__},
                       "budget_s": BUDGET_S, "results": records}, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if (ok_all or not args.check) else 1


if __name__ == "__main__":
    sys.exit(main())
