"""The CuTe forward and backward kernels launched without XLA in the process (torch tensors
through the kernels' TVM-FFI functions), for compute-sanitizer: under it, JAX's GPU runtime
segfaulted the sanitizer (memcheck in the xla reference, racecheck / synccheck outright).

Two steps, so that the sanitized process never starts a JAX GPU client:

    python3 tests/scripts/gpu_kernels_standalone.py prepare /tmp/case.npz [case]   # jax on CPU
    compute-sanitizer --tool racecheck python3 tests/scripts/gpu_kernels_standalone.py run /tmp/case.npz

``prepare`` builds the Execution Descriptor (jnp preprocess), the dense mask and random
inputs; ``run`` compiles the kernels the registry would use (default configs), launches the
forward, then the backward, and prints the max |error| of o, dq, dk, dv against a float32
dense reference computed with torch (no tolerance decision: tests/gpu make that).
Cases: causal, clear (D 64, K 6 / Kc 7), hstu (default), shared_prompt (Kc 7), stripes
(K 12 / Kc 12: the bit-mask paths); ragged lengths, GQA.
"""
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"          # both steps: no JAX GPU client in the process
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "gpu"))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

CASES = {"causal": (128, 200), "clear": (64, 260), "hstu": (128, 333),
         "shared_prompt": (128, 300), "stripes": (128, 390)}


def prepare(path, name):
    import functools
    import jcompilemask as jcm
    from jcompilemask.kernels.cute.api import preferred_backward_tiles, preferred_forward_tiles
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    from gpu_cases import SPECS, metadata
    d, n = CASES[name]
    rng = np.random.default_rng(0)
    if name == "stripes":
        rule = functools.reduce(lambda a, b: a | b, [(k >= 30 * i) & (k < 30 * i + 3) for i in range(12)])
        spec, md = MaskSpec([Region((0, q_len), rule & (k <= q))]), None
    else:
        spec, md = SPECS[name], metadata(name, 1, n, rng)
    bq, bk = preferred_forward_tiles(d)
    bbq, bbk = preferred_backward_tiles(d)
    desc = jcm.compile(spec).instantiate(md, n, n, block_q=bq, block_kv=bk, bwd_block_q=bbq,
                                         bwd_block_kv=bbk, preprocess="jnp")
    hq, hkv = 4, 2
    x = lambda h: rng.standard_normal((1, n, h, d)).astype(np.float32)  # noqa: E731
    np.savez(path, d=d, n=n, block_q=bq, block_kv=bk, bwd_block_q=bbq, bwd_block_kv=bbk,
             fwd_intervals=np.asarray(desc.fwd_intervals), fwd_tiles=np.asarray(desc.fwd_tiles),
             bwd_intervals=np.asarray(desc.bwd_intervals), bwd_tiles=np.asarray(desc.bwd_tiles),
             bwd_exact=np.asarray(desc.bwd_exact), mask=np.asarray(spec.as_dense(md, n, n)),
             q=x(hq), k=x(hkv), v=x(hkv), do=x(hq))
    print("prepared", name, "D", d, "N", n, "K", desc.num_intervals, "Kc", desc.num_bwd_intervals)


def run(path):
    import math
    import torch
    from jcompilemask.kernels.cute.api import (BackwardKey, ForwardKey, compile_backward,
                                               compile_forward, forward_switches,
                                               preferred_backward_config,
                                               preferred_forward_stages)
    z = np.load(path)
    d, n = int(z["d"]), int(z["n"])
    dev = torch.device("cuda")
    bf = lambda a: torch.from_numpy(a).to(dev, torch.bfloat16).contiguous()  # noqa: E731
    q, k, v, do = bf(z["q"]), bf(z["k"]), bf(z["v"]), bf(z["do"])
    B, N, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = 1.0 / math.sqrt(D)
    fwd_iv = torch.from_numpy(z["fwd_intervals"].astype(np.int32)).to(dev).contiguous()
    fwd_tiles = torch.from_numpy(z["fwd_tiles"].astype(np.uint32)).to(dev).contiguous()
    Bm, Hm, _, K, _ = fwd_iv.shape
    bq, bk = int(z["block_q"]), int(z["block_kv"])
    stages = preferred_forward_stages(D, "bfloat16")
    fkey = ForwardKey("bfloat16", D, D, K, bq, bk, Bm == 1, Hm == 1, scale, num_stages=stages,
                      **forward_switches(D, D, bq, bk, stages))
    fwd = compile_forward(fkey)
    o = torch.empty((B, N, Hq, D), dtype=torch.bfloat16, device=dev)
    lse = torch.empty((B, Hq, N), dtype=torch.float32, device=dev)
    fwd(q, k, v, fwd_iv, fwd_tiles, o, lse)
    torch.cuda.synchronize()

    bbq, bbk = int(z["bwd_block_q"]), int(z["bwd_block_kv"])
    bwd_iv_np = z["bwd_intervals"].astype(np.int32)
    Kc = bwd_iv_np.shape[3]
    if Kc == 0:
        bwd_iv_np = np.zeros((Bm, Hm, N, 1, 2), np.int32)
    bwd_iv = torch.from_numpy(bwd_iv_np).to(dev).contiguous()
    bwd_tiles = torch.from_numpy(z["bwd_tiles"].astype(np.uint32)).to(dev).contiguous()
    exact = torch.from_numpy(np.broadcast_to(z["bwd_exact"].astype(np.int32).reshape(-1), (Bm,)).copy()).to(dev)
    cfg = preferred_backward_config(D)
    bkey = BackwardKey("bfloat16", D, K, Kc, Bm == 1, Hm == 1, scale, cfg)
    bwd = compile_backward(bkey)
    Tq = -(-N // bbq)
    lse2 = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse / math.log(2.0))
    delta = (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()        # [B, Hq, N]
    pad = Tq * bbq - N
    lse2 = torch.nn.functional.pad(lse2, (0, pad), value=math.inf).contiguous()
    delta = torch.nn.functional.pad(delta, (0, pad)).contiguous()
    acc = torch.zeros((B, Hq, Tq, bbq * D), dtype=torch.float32, device=dev)
    sem = torch.zeros((1, 1, 1), dtype=torch.int32, device=dev)
    turns = torch.zeros((Bm, Hm, 1, 1), dtype=torch.int32, device=dev)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    bwd(q, k, v, do, lse2, delta, bwd_iv, bwd_tiles, fwd_iv, exact, turns, acc, sem, acc, sem, dk, dv)
    torch.cuda.synchronize()

    # dQ: the accumulator's fragment order undone (as dq_fragment_unpermute), times scale.
    from jcompilemask.kernels.cute.api import dq_warpgroups
    w = dq_warpgroups(D)
    g = D // w // 8
    x = acc.cpu().numpy().reshape(B, Hq, Tq, w, g, 4, 8, 4, 2, 2)
    x = np.transpose(x, (0, 2, 5, 8, 6, 1, 3, 4, 7, 9)).reshape(B, Tq * bbq, Hq, D)[:, :N]
    dq = x * scale

    # float32 dense reference (torch autograd), GQA by repeating K / V heads.
    mask = torch.from_numpy(np.broadcast_to(z["mask"], (B, Hq, N, N)).copy()).to(dev)
    qf, kf, vf = (torch.from_numpy(z[a]).to(dev).requires_grad_(True) for a in ("q", "k", "v"))
    rep = Hq // Hkv
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf.repeat_interleave(rep, 2)) * scale
    s = s.masked_fill(~mask, -1e30)                  # fully masked rows: p = 0, finite grads
    e = torch.exp(s - s.amax(-1, keepdim=True)) * mask
    p = e / e.sum(-1, keepdim=True).clamp_min(1e-30)
    of = torch.einsum("bhqk,bkhd->bqhd", p, vf.repeat_interleave(rep, 2))
    (of * torch.from_numpy(z["do"]).to(dev)).sum().backward()
    err = lambda a, b: float((torch.as_tensor(a, device=dev).float() - b.float()).abs().max())  # noqa: E731
    print("max |o - ref|", "%.3g" % err(o, of.detach()), "dq %.3g" % err(dq, qf.grad),
          "dk %.3g" % err(dk, kf.grad), "dv %.3g" % err(dv, vf.grad),
          "finite", all(bool(torch.isfinite(t).all()) for t in (o, dk, dv)), flush=True)
    print("done")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("prepare", "run"):
        sys.exit(__doc__)
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "hstu")
    else:
        run(sys.argv[2])
