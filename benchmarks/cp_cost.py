"""Cost report of mask-aware context parallelism, from the descriptor alone (no device).

For each workload (docs/workloads.md: causal, HSTU, shared prompt; batch = 131072 / N
sequences, 8 heads, head dim 128, bf16) and each device count, builds the descriptor with
the jnp preprocess on the CPU, picks the layout (zigzag for causal, else
``balance_permutation`` with the fewest chunks per device, of 2 / 4 / 8, that reaches the
target work ratio) and prints, per configuration:

* work per device: max / min of the visible (query, key) pairs of each device's rows,
  and the same for computed (non-empty) forward tiles;
* bytes sent by the ring plan vs a ring that sends every block, forward (K and V) and
  backward (K and V again, and the float32 dK/dV accumulators with the way home).

Usage::

    python benchmarks/cp_cost.py                       # 64K over 2, 4, 8 devices
    python benchmarks/cp_cost.py --n 4096 --devices 2 4 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import jcompilemask as jcm  # noqa: E402
from jcompilemask import parallel as par  # noqa: E402

import workloads as wl  # noqa: E402

TARGET = 1.1
WORKLOADS = ("causal", "hstu", "shared_prompt")


def layout_for(mask, desc, p, target=TARGET):
    if mask == "causal":
        return par.zigzag_permutation(p)
    best = None
    for cpd in (2, 4, 8):
        try:
            lay = par.balance_permutation(desc, p, cpd)
        except ValueError:           # chunks no longer whole tiles
            break
        r = par.cost_report(desc, par.ring_plan(desc, p, lay), kv_bytes_per_token=1)
        if best is None or r["work_max_min"] < best[0]:
            best = (r["work_max_min"], lay)
        if r["work_max_min"] <= target:
            break
    return best[1]


def report(n, devices, block=128):
    b = wl.batch_for(n)
    kv_token = b * wl.HEADS * 2 * wl.HEAD_DIM * 2          # K and V, bf16
    acc_token = b * wl.HEADS * 2 * wl.HEAD_DIM * 4         # float32 dK, dV
    rows = []
    for mask in WORKLOADS:
        cm = jcm.compile(wl.spec_for(mask, n))
        desc = jax.jit(lambda md: cm.instantiate(md, n, n, block_q=block, block_kv=block,
                                                 bwd_block_q=block, bwd_block_kv=block,
                                                 preprocess="jnp"))(
            wl.metadata_for(mask, n))
        for p in devices:
            lay = layout_for(mask, desc, p)
            plan = par.ring_plan(desc, p, lay)
            r = par.cost_report(desc, plan, kv_bytes_per_token=kv_token,
                                acc_bytes_per_token=acc_token)
            r.update(mask=mask, n=n, batch=b, layout=list(lay))
            rows.append(r)
    return rows


def format_rows(rows):
    head = (f"{'mask':<14}{'N':>7}{'P':>3}{'chunks':>7}{'steps':>6}{'work max/min':>13}"
            f"{'tiles max/min':>14}{'fwd MB':>9}{'full MB':>9}{'skip':>6}{'bwd MB':>9}"
            f"{'full MB':>9}{'skip':>6}")
    lines = [head]
    for r in rows:
        mb = lambda x: x / 2**20   # noqa: E731
        fs = 1 - r["fwd_bytes"] / r["fwd_bytes_full_ring"] if r["fwd_bytes_full_ring"] else 0
        bs = 1 - r["bwd_bytes"] / r["bwd_bytes_full_ring"] if r["bwd_bytes_full_ring"] else 0
        lines.append(f"{r['mask']:<14}{r['n']:>7}{r['devices']:>3}{r['chunks']:>7}"
                     f"{r['steps']:>6}{r['work_max_min']:>13.3f}{r['tiles_max_min']:>14.3f}"
                     f"{mb(r['fwd_bytes']):>9.0f}{mb(r['fwd_bytes_full_ring']):>9.0f}"
                     f"{fs:>6.0%}{mb(r['bwd_bytes']):>9.0f}{mb(r['bwd_bytes_full_ring']):>9.0f}"
                     f"{bs:>6.0%}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    t0 = time.time()
    rows = report(a.n, a.devices, a.block)
    print(format_rows(rows))
    print(f"(batch {wl.batch_for(a.n)}, {wl.HEADS} heads, head dim {wl.HEAD_DIM}, bf16; "
          f"built in {time.time() - t0:.1f} s on {jax.default_backend()})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
