"""Run in a subprocess by tests/test_context_parallel.py (8 host devices must be set before
JAX starts): mask_attention(..., context_axis="cp") inside jax.shard_map, with q, k, v
sharded along the sequence, equals the single-device call, forward and gradients, under
the tolerance policy, for every built-in mask and random lowered specs.

Usage: context_parallel_check.py [case-name-substring ...]; prints "OK <n cases>".
"""
import os
import sys

# N host devices; XLA's CPU backend at optimization level 0: these checks compile many
# small programs and run each once, so compile time is what they spend (about half of it
# goes with -O0; the results are compared under the same tolerance policy).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jcompilemask as jcm  # noqa: E402
from jcompilemask import parallel as par  # noqa: E402
from jcompilemask.spec import MaskSpec, Region, Scalar, SegmentIds, k, q, q_len  # noqa: E402
from jcompilemask.testing import assert_within_policy, reference_attention  # noqa: E402

B, HQ, HKV, D = 2, 4, 2, 16


def metadata_for(name, n, rng):
    if name == "prefix_lm":
        return {"prefix_len": rng.integers(0, n + 1, B)}
    if name.startswith("document"):
        ids = np.sort(rng.integers(0, 7, (B, n)), axis=1)
        ids[:, n - rng.integers(0, 9):] = -1
        return {"segment_ids": ids}
    if name == "hstu":
        a = rng.integers(n // 4, n // 2, B)
        g = rng.integers(3, 9, B)
        return {"context_len": a, "history_end": n - g * rng.integers(3, 9, B),
                "group_size": g}
    if name == "shared_prompt":
        lens = rng.integers(n // 16, n // 11 + 1, (B, 3))
        p = n - lens.sum(1)
        starts = p[:, None] + np.concatenate([np.zeros((B, 1), int), np.cumsum(lens, 1)[:, :-1]], 1)
        return {"prompt_len": p, "response_starts": starts}
    if name == "clear":
        return {"text_len": rng.integers(4, 12, B), "image_len": rng.integers(n // 2, n - 12, B)}
    if name.startswith("random"):
        return {"s": rng.integers(0, n + 1, B), "seg": np.sort(rng.integers(-1, 4, (B, n)), axis=1)}
    return None


def random_lowered(seed):
    """A random two-region spec of atoms that lower to intervals (no fallback)."""
    rng = np.random.default_rng(seed)
    s, seg = Scalar("s", max=q_len), SegmentIds("seg")
    atoms = [k <= q, k >= q - 9, k < s, k >= seg.start(q), k < seg.end(q), k >= q // 5 * 5,
             k <= q + 3]

    def rule():
        idx = rng.choice(len(atoms), size=rng.integers(1, 4), replace=False)
        r = atoms[idx[0]]
        for i in idx[1:]:
            r = (r & atoms[i]) if rng.random() < 0.5 else (r | atoms[i])
        return r
    spec = MaskSpec([Region((0, s), rule()), Region((s, q_len), rule())])
    assert not jcm.compile(spec).fallback_regions
    return spec


BUILTINS = {
    "causal": jcm.masks.causal(), "full": jcm.masks.full(),
    "sliding_window": jcm.masks.sliding_window(20, 3, sinks=2),
    "chunked_causal": jcm.masks.chunked_causal(24), "prefix_lm": jcm.masks.prefix_lm(),
    "document": jcm.masks.document(), "document_bidir": jcm.masks.document(causal=False),
    "hstu": jcm.masks.hstu(), "shared_prompt": jcm.masks.shared_prompt(3),
    "clear": jcm.masks.clear(8, 2), "random0": random_lowered(0), "random1": random_lowered(1),
    "dilated": jcm.masks.dilated_window(20, 3, dilation=2),
}
# Residue classes (a ClassDescriptor; the ring runs the class sequence): N and the chunks
# multiples of the dilation.
_seg = SegmentIds("segment_ids")
EXTRA = {"dilated3": jcm.masks.dilated_window(30, 6, dilation=3),
         # packed documents with a dilated window: each class its own descriptor
         "document_dilated": MaskSpec([Region((0, q_len), (k >= _seg.start(q)) & (k < _seg.end(q))
                                              & (k <= q) & (k > q - 24) & ((q - k) % 2 == 0))])}

# (name, mask, devices, N, tile, layout kind, dtype, descriptor passed traced)
CASES = [(f"{m}-p2", m, 2, 128, 16, "balance", jnp.float32, False) for m in BUILTINS]
CASES += [
    ("causal-p8-zigzag-traced", "causal", 8, 256, 16, "zigzag", jnp.float32, True),
    ("hstu-p4-balance", "hstu", 4, 128, 16, "balance", jnp.float32, False),
    ("shared_prompt-p4-balance", "shared_prompt", 4, 128, 16, "balance", jnp.float32, False),
    ("hstu-p4-traced", "hstu", 4, 128, 16, "balance", jnp.float32, True),
    ("document-p4-inorder-bf16", "document", 4, 128, 16, "none", jnp.bfloat16, False),
    ("dilated3-p4-traced", "dilated3", 4, 384, 16, "balance", jnp.float32, True),
    ("document_dilated-p2", "document_dilated", 2, 128, 16, "balance", jnp.float32, False),
    ("document_dilated-p4-traced", "document_dilated", 4, 256, 16, "balance", jnp.float32,
     True),
]


@jax.jit
def references(dense, q, k, v, do):
    """Forward and gradients of the dense reference at both precisions of the tolerance
    policy ("high" on float32 copies, "input" in the inputs' dtype), lse in jax's layout
    [B, N, H] as return_residual gives it. One program, compiled once per shape and dtype
    (the mask is an argument): the cases at one length share it."""
    def at(prec, a, b_, c):
        def f(a, b_, c):
            out, lse = reference_attention(a, b_, c, dense, precision=prec)
            return out, jnp.swapaxes(lse, 1, 2)
        (out, lse), pull = jax.vjp(f, a, b_, c)
        return out, lse, pull((do.astype(out.dtype), jnp.zeros_like(lse)))
    f32 = lambda x: x.astype(jnp.float32)   # noqa: E731
    return at("high", f32(q), f32(k), f32(v)), at("input", q, k, v)


def run_case(name, mask, p, n, tile, kind, dtype, traced):
    rng = np.random.default_rng(sum(map(ord, name)))
    spec = {**BUILTINS, **EXTRA}[mask]
    md = metadata_for(mask, n, rng)
    if md is not None:
        md = {key: np.asarray(val, np.int32) for key, val in md.items()}
    cm = jcm.compile(spec)
    tiles = dict(block_q=tile, block_kv=tile, bwd_block_q=tile, bwd_block_kv=tile)
    desc = cm.instantiate(md, n, n, **tiles)
    if kind == "balance":
        layout = par.balance_permutation(desc, p, 2)
    elif kind == "zigzag":
        layout = par.zigzag_permutation(p)
    else:
        layout = None
    chunks = tuple(range(p)) if layout is None else layout
    ks = jax.random.split(jax.random.key(sum(map(ord, name))), 4)
    qx = jax.random.normal(ks[0], (B, n, HQ, D), jnp.float32).astype(dtype)
    kx = jax.random.normal(ks[1], (B, n, HKV, D), jnp.float32).astype(dtype)
    vx = jax.random.normal(ks[2], (B, n, HKV, D), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, n, HQ, D), jnp.float32).astype(dtype)
    mesh = Mesh(np.array(jax.devices()[:p]), ("cp",))
    seq = P(None, "cp")
    if traced:      # descriptor built inside shard_map (traced): the full ring, looped
        def body(a, b_, c, meta):
            d_ = cm.instantiate(meta, n, n, **tiles)
            return jcm.mask_attention(a, b_, c, d_, context_axis="cp", context_layout=layout,
                                      return_residual=True)
        sm = jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, P()),
                           out_specs=(seq, seq))
        attend = lambda a, b_, c: sm(a, b_, c, md)   # noqa: E731
    else:
        attend = jax.shard_map(
            lambda a, b_, c: jcm.mask_attention(a, b_, c, desc, context_axis="cp",
                                                context_layout=layout, return_residual=True),
            mesh=mesh, in_specs=(seq, seq, seq), out_specs=(seq, seq))

    def with_grads(f, dout):
        def g(a, b_, c):
            (out, lse), pull = jax.vjp(f, a, b_, c)
            return out, lse, pull((dout.astype(out.dtype), jnp.zeros_like(lse)))
        return jax.jit(g)

    # The sequences are put in the layout on the host, before sharding (as
    # permute_sequence's doc says to); the ring's results and gradients are put back in
    # the original order. (Permuting inside the jitted program makes XLA reshard the
    # chunks between devices: at 8 devices most of the program's compile time.)
    perm = lambda x: par.permute_sequence(np.asarray(x), chunks)   # noqa: E731
    shard = lambda x: jax.device_put(perm(x), NamedSharding(mesh, seq))   # noqa: E731
    out, lse, grads = with_grads(attend, shard(do))(shard(qx), shard(kx), shard(vx))
    out, lse, *grads = (par.unpermute_sequence(np.asarray(x), chunks)
                        for x in (out, lse, *grads))
    single = lambda a, b_, c: jcm.mask_attention(a, b_, c, desc, return_residual=True)  # noqa: E731
    s_out, s_lse, s_grads = with_grads(single, do)(qx, kx, vx)
    hi, lo = references(desc.as_dense(), qx, kx, vx, do)
    assert out.dtype == dtype and grads[0].dtype == dtype
    for what, a, h, l_, s in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                 (hi[0], hi[1], *hi[2]), (lo[0], lo[1], *lo[2]),
                                 (s_out, s_lse, *s_grads)):
        assert_within_policy(a, h, l_, f"{name} {what}")
        if dtype == jnp.float32:        # and the single-device call, closely
            fa, fs = np.asarray(a, np.float64), np.asarray(s, np.float64)
            assert np.array_equal(np.isneginf(fa), np.isneginf(fs)), (name, what)
            fin = ~np.isneginf(fs)
            np.testing.assert_allclose(fa[fin], fs[fin], rtol=2e-5, atol=2e-5,
                                       err_msg=f"{name} {what}")
    return par.ring_plan(desc, p, chunks)


if __name__ == "__main__":
    want = sys.argv[1:]
    done = 0
    for case in CASES:
        if want and not any(w in case[0] for w in want):
            continue
        plan = run_case(*case)
        print(case[0], "steps", plan.num_steps, "sends", plan.forward_sends(), "/",
              plan.full_ring_forward_sends(), flush=True)
        done += 1
    print("OK", done, len(jax.devices()))
