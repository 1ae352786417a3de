"""The multi-GPU run: batch-sharded training steps and mask-aware context parallelism.

One script for one device call on a machine with several GPUs (or, with ``--smoke``, on
the CPU with virtual devices). Two modes, each timed with ``timing.sustained`` after
warm-up (medians of repeats; ``run`` and the median SM clock of GPU 0 in every record):

* ``shard``: a training step (preprocess + forward + backward of ``mask_attention``)
  under a plain ``jax.jit`` whose q, k, v, dO and metadata are sharded on the batch over
  ``P`` devices, at a fixed per-device batch (weak scaling), beside the same step on one
  device with that per-device batch. Records: ``step_ms``, ``step_ms_1gpu``,
  ``efficiency`` (= one-device time / P-device time; 1.0 is perfect), the collectives in
  the compiled program (``collectives``: a count per kind; q, k, v must not be
  all-gathered) and ``match`` (device 0's gradients equal the one-device gradients of the
  same sequences to within two bf16 ulps of their largest value: the dQ reduce order is
  not fixed, so exact equality is not asked for).
* ``cp``: context parallelism, ``mask_attention(..., context_axis="cp")`` inside
  ``jax.shard_map`` with the sequence sharded over ``P`` devices, forward + backward of one
  sequence of ``n`` tokens in the layout ``balance_permutation`` picks (zigzag for causal)
  and the static ring plan of the concrete descriptor. Records: ``step_ms`` (and
  ``step_ms_1gpu`` where ``n <= --one-gpu-max-n``), ``bytes_sent`` (the plan's, forward
  + backward; ``bytes_full_ring``: a ring that sends every block), ``bytes_hlo`` (what the
  compiled program's collective-permutes move, summed over their source-target pairs),
  ``work_max_min`` (visible pairs per device, max / min) and ``match`` against the
  one-device call where that ran.

Usage (on the device)::

    python benchmarks/multi_gpu.py --out benchmarks/results/h200-multi-gpu.json
    python benchmarks/multi_gpu.py --modes cp --masks hstu --ns 65536,131072 --gpus 2,4
    python benchmarks/multi_gpu.py --smoke --out /tmp/multi.json   # CPU, 8 virtual devices

Records go to ``--out`` (merged by key with what is there) and to stdout as JSON lines,
after each configuration; a table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import clocks  # noqa: E402
import timing  # noqa: E402
import workloads as W  # noqa: E402

KEY = ("gpus", "mode", "mask", "n", "impl")
_COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute|"
                         r"collective-broadcast)(-start)?\(")
_SHAPE = re.compile(r"\b(bf16|f16|f32|f64|s32|u32|s8|u8|pred|s64|u64)\[([0-9,]*)\]")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
          "pred": 1, "s64": 8, "u64": 8}


def collectives(hlo: str) -> dict:
    """Count of each collective kind in an HLO module's text (``-start`` forms included)."""
    out: dict[str, int] = {}
    for m in _COLLECTIVE.finditer(hlo):
        out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def permute_bytes(hlo: str) -> int:
    """Bytes the collective-permutes of an HLO module move: the result shape's bytes times
    the number of source-target pairs, summed over the instructions (a ``-done`` is not
    counted twice: only lines with the op's opening parenthesis and its pairs)."""
    total = 0
    for line in hlo.splitlines():
        if not re.search(r"\bcollective-permute(-start)?\(", line):
            continue
        lhs = line.split("collective-permute", 1)[0]
        shapes = _SHAPE.findall(lhs.split("=", 1)[-1])
        if not shapes:
            continue
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
        n_pairs = 0 if pairs is None else pairs.group(1).count("{")
        if "-start(" in line and len(shapes) >= 2:
            shapes = shapes[len(shapes) // 2:]          # (operand, result[, contexts]) tuples
        nbytes = sum(_BYTES[t] * int(np.prod([int(x) for x in dims.split(",") if x] or [1]))
                     for t, dims in shapes)
        total += nbytes * n_pairs
    return total


def _close(a, b) -> tuple[bool, float]:
    """(within two ulps, in a's dtype, of the largest |b| — the tolerance policy's floor;
    1e-6 for float32 —, max |a - b|)."""
    from jcompilemask.testing import _ulp_of_max
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = float(np.max(np.abs(a64 - b64), initial=0.0))
    return bool(err <= 2 * _ulp_of_max(a, b64) + 1e-6), err


def _sizes(mask, n, smoke):
    """(heads, head dim, dtype, tile kwargs) of a configuration."""
    import jax.numpy as jnp
    if smoke:
        return 2, 16, jnp.float32, dict(block_q=16, block_kv=16, bwd_block_q=16, bwd_block_kv=16)
    return 8, 128, jnp.bfloat16, {}


def _inputs(b, n, h, d, dtype, seed):
    import jax
    ks = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(kk, (b, n, h, d), jax.numpy.float32).astype(dtype) for kk in ks)


def shard_case(mask, n, gpus, per_device_batch, smoke, kw, windows_of):
    """One ``shard`` configuration (module doc)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jcompilemask as jcm

    h, d, dtype, tiles = _sizes(mask, n, smoke)
    devs = jax.devices()[:gpus]
    mesh = Mesh(np.array(devs), ("data",))
    B = gpus * per_device_batch
    cm = jcm.compile(W.spec_for(mask, n))
    md = W.metadata_for(mask, n, batch=B)
    q, k, v, do = _inputs(B, n, h, d, dtype, n + gpus)

    def grads(q, k, v, do, md):
        desc = cm.instantiate(md, n, n, **tiles)

        def loss(a, b_, c):
            o = jcm.mask_attention(a, b_, c, desc)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    row = NamedSharding(mesh, P("data"))
    put = lambda x: jax.device_put(x, row)  # noqa: E731
    args = tuple(put(x) for x in (q, k, v, do))
    mdp = None if md is None else {key: put(jnp.asarray(val)) for key, val in md.items()}
    step = jax.jit(grads)
    hlo = step.lower(*args, mdp).compile().as_text()
    coll = collectives(hlo)
    win: list = []
    t = timing.jax_time(lambda: step(*args, mdp), **kw, windows=win)
    g = step(*args, mdp)

    # one device, the first per_device_batch sequences (device 0's shard)
    one = devs[0]
    sl = lambda x: jax.device_put(x[:per_device_batch], one)  # noqa: E731
    args1 = tuple(sl(x) for x in (q, k, v, do))
    md1 = None if md is None else {key: sl(jnp.asarray(val)) for key, val in md.items()}
    step1 = jax.jit(grads)
    t1 = timing.jax_time(lambda: step1(*args1, md1), **kw, windows=win)
    g1 = step1(*args1, md1)
    checks = [_close(np.asarray(a)[:per_device_batch], np.asarray(b)) for a, b in zip(g, g1)]
    return {"gpus": gpus, "mode": "shard", "mask": mask, "n": n, "impl": "jcm",
            "batch": B, "per_device_batch": per_device_batch, "heads": h, "head_dim": d,
            "step_ms": t * 1e3, "step_ms_1gpu": t1 * 1e3, "efficiency": t1 / t,
            "collectives": coll, "all_gather": coll.get("all-gather", 0),
            "match": all(c[0] for c in checks), "max_diff": max(c[1] for c in checks),
            "bytes_sent": permute_bytes(hlo), **windows_of(win)}


def cp_case(mask, n, gpus, smoke, kw, windows_of, one_gpu_max_n):
    """One ``cp`` configuration (module doc)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import jcompilemask as jcm
    from jcompilemask import parallel as par

    h, d, dtype, tiles = _sizes(mask, n, smoke)
    devs = jax.devices()[:gpus]
    mesh = Mesh(np.array(devs), ("cp",))
    cm = jcm.compile(W.spec_for(mask, n))
    md = W.metadata_for(mask, n, batch=1)
    desc = cm.instantiate(None if md is None else {key: jnp.asarray(val) for key, val in md.items()},
                          n, n, **tiles)
    layout = par.balance_permutation(desc, gpus)
    plan = par.ring_plan(desc, gpus, layout)
    itemsize = jnp.dtype(dtype).itemsize
    cost = par.cost_report(desc, plan, kv_bytes_per_token=h * 2 * d * itemsize,
                           acc_bytes_per_token=h * 2 * d * 4)       # float32 dK / dV
    q, k, v, do = _inputs(1, n, h, d, dtype, n + 7 * gpus)

    def local(q, k, v, do):
        def loss(a, b_, c):
            o = jcm.mask_attention(a, b_, c, desc, context_axis="cp", context_layout=plan)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    spec = P(None, "cp")
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 3))
    perm = tuple(par.permute_sequence(x, layout) for x in (q, k, v, do))
    hlo = step.lower(*perm).compile().as_text()
    win: list = []
    t = timing.jax_time(lambda: step(*perm), **kw, windows=win)
    rec = {"gpus": gpus, "mode": "cp", "mask": mask, "n": n, "impl": "jcm", "batch": 1,
           "heads": h, "head_dim": d, "step_ms": t * 1e3,
           "bytes_sent": cost["fwd_bytes"] + cost["bwd_bytes"],
           "bytes_full_ring": cost["fwd_bytes_full_ring"] + cost["bwd_bytes_full_ring"],
           "bytes_hlo": permute_bytes(hlo), "work_max_min": cost["work_max_min"],
           "tiles_max_min": cost["tiles_max_min"], "chunks": cost["chunks"],
           "steps": cost["steps"], "collectives": collectives(hlo)}
    if n <= one_gpu_max_n:
        one = devs[0]

        def full(q, k, v, do):
            def loss(a, b_, c):
                o = jcm.mask_attention(a, b_, c, desc)
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        step1 = jax.jit(full)
        args1 = tuple(jax.device_put(x, one) for x in (q, k, v, do))
        t1 = timing.jax_time(lambda: step1(*args1), **kw, windows=win)
        g1 = step1(*args1)
        g = [par.unpermute_sequence(x, layout) for x in step(*perm)]
        checks = [_close(a, b) if not smoke else _close_policy(a, b) for a, b in zip(g, g1)]
        rec.update(step_ms_1gpu=t1 * 1e3, speedup=t1 / t, match=all(c[0] for c in checks),
                   max_diff=max(c[1] for c in checks))
    rec.update(windows_of(win))
    return rec


def _close_policy(a, b):
    """float32 smoke runs: the ring merges partial results in another order (1e-5)."""
    err = float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))
    return bool(err <= 1e-4 * max(1.0, float(np.max(np.abs(np.asarray(b)), initial=0.0)))), err


def _merge(path, records):
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("records", [])
    key = lambda r: tuple(r.get(k) for k in KEY) + (r.get("run"),)  # noqa: E731
    new = {key(r) for r in records}
    return [r for r in old if key(r) not in new] + records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="shard,cp")
    ap.add_argument("--masks", default="causal,hstu,shared_prompt")
    ap.add_argument("--ns", default=None, help="sequence lengths (default: shard 8192, cp 65536,131072)")
    ap.add_argument("--gpus", default=None, help="device counts (default: 2, 4, 8 up to the devices present)")
    ap.add_argument("--per-device-batch", type=int, default=None,
                    help="shard mode: sequences per device (default 131072 // n)")
    ap.add_argument("--one-gpu-max-n", type=int, default=65536,
                    help="cp mode: longest sequence also run on one device")
    ap.add_argument("--budget-s", type=float, default=500)
    ap.add_argument("--min-repeat-s", type=float, default=timing.MIN_REPEAT_S)
    ap.add_argument("--smoke", action="store_true", help="CPU, 8 virtual devices, tiny sizes")
    ap.add_argument("--out", default="benchmarks/results/h200-multi-gpu.json")
    args = ap.parse_args(argv)

    import jax
    present = len(jax.devices())
    gpus = ([int(x) for x in args.gpus.split(",")] if args.gpus else
            [g for g in (2, 4, 8) if g <= present])
    if not gpus or max(gpus) > present:
        sys.exit(f"multi_gpu.py: {present} device(s) present; --gpus {gpus or '(none)'} needs "
                 "at least 2 (ask the device tool's status for a multi-GPU kind, or use --smoke)")
    if args.smoke:
        kw = dict(warmup=1, repeats=2, min_repeat_s=0.0, iters=1)
        windows_of = lambda win: {"run": clocks.run_id(), "sm_clock_mhz": None, "power_w": None}  # noqa: E731
    else:
        clocks.start()
        kw = dict(min_repeat_s=args.min_repeat_s)
        windows_of = lambda win: {"run": clocks.run_id(), **clocks.fields(win)}  # noqa: E731
    t0, records = time.time(), []

    def save(rec):
        records.append(rec)
        print(json.dumps(rec), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        merged = _merge(args.out, records)
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "smoke": args.smoke,
                       "run": clocks.run_id(), "records": merged}, f, indent=1)

    for mode in args.modes.split(","):
        ns = ([int(x) for x in args.ns.split(",")] if args.ns else
              ([256] if args.smoke else [8192]) if mode == "shard" else
              ([512] if args.smoke else [65536, 131072]))
        for n in ns:
            for mask in args.masks.split(","):
                for p in gpus:
                    if time.time() - t0 > args.budget_s:
                        print(f"budget spent; stopping before {mode} {mask} {n} x{p}", flush=True)
                        continue
                    try:
                        if mode == "shard":
                            pdb = args.per_device_batch or (1 if args.smoke else max(1, W.TOKENS // n))
                            save(shard_case(mask, n, p, pdb, args.smoke, kw, windows_of))
                        elif mode == "cp":
                            save(cp_case(mask, n, p, args.smoke, kw, windows_of, args.one_gpu_max_n))
                        else:
                            sys.exit(f"--modes: unknown mode {mode!r} (shard, cp)")
                    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                        print(f"{mode} {mask} {n} x{p}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                        save({"gpus": p, "mode": mode, "mask": mask, "n": n, "impl": "jcm",
                              "error": f"{type(e).__name__}: {str(e)[:300]}", **windows_of([])})
    head = ["mode", "mask", "n", "gpus", "step ms", "1-gpu ms", "eff / speedup", "bytes sent (full ring)",
            "work max/min", "match", "sm_clock_mhz"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in records:
        if "error" in r:
            print(f"| {r['mode']} | {r['mask']} | {r['n']} | {r['gpus']} | FAILED: {r['error'][:60]} |")
            continue
        ratio = r.get("efficiency", r.get("speedup"))
        sent = (f"{r['bytes_sent'] / 2**20:.0f} MiB ({r['bytes_full_ring'] / 2**20:.0f})"
                if "bytes_full_ring" in r else f"{r['bytes_sent'] / 2**20:.0f} MiB")
        print(f"| {r['mode']} | {r['mask']} | {r['n']} | {r['gpus']} | {r['step_ms']:.2f} | "
              f"{r.get('step_ms_1gpu', float('nan')):.2f} | {'' if ratio is None else f'{ratio:.3f}'} | "
              f"{sent} | {r.get('work_max_min', '')} | {r.get('match', '')} | {r.get('sm_clock_mhz') or ''} |")
    return records


if __name__ == "__main__":
    main()
