"""Run in a subprocess by tests/test_ring_backends.py (8 host devices must be set before JAX
starts): ring attention whose steps run a registered backend (tests/ring_fake_backend.py:
its own tiles, bfloat16-rounded partials) over 4 devices -- several steps, so the
float32 merge of rounded partials and the float32 sums of rounded gradients -- against
the single-device call and the dense reference (tolerance policy), forward and gradients.

Usage: ring_backends_check.py [case-name-substring ...]; prints "OK <n cases> <devices>".
"""
import os
import sys

# N host devices; XLA's CPU backend at optimization level 0: these checks compile many
# small programs and run each once, so compile time is what they spend (about half of it
# goes with -O0; the results are compared under the same tolerance policy).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jcompilemask as jcm  # noqa: E402
from jcompilemask import parallel as par  # noqa: E402
from jcompilemask.testing import assert_within_policy, reference_attention  # noqa: E402

import ring_fake_backend as fake  # noqa: E402

B, HQ, HKV, D = 2, 4, 2, 16
TILES = dict(block_q=fake.TILES.block_q, block_kv=fake.TILES.block_kv,
             bwd_block_q=fake.TILES.bwd_block_q, bwd_block_kv=fake.TILES.bwd_block_kv)


def metadata(name, n, rng):
    if name == "hstu":
        g = rng.integers(2, 4, B)
        return {"context_len": rng.integers(n // 4, n // 2, B),
                "history_end": n - g * rng.integers(3, 6, B), "group_size": g}
    return None


SPECS = {"hstu": jcm.masks.hstu(), "causal": jcm.masks.causal()}

# (name, mask, devices, N, layout kind, dtype, descriptor traced, implementation)
CASES = [
    ("hstu-p2-balance-bf16", "hstu", 2, 64, "balance", jnp.bfloat16, False, None),
    ("causal-p4-zigzag-traced-f32", "causal", 4, 128, "zigzag", jnp.float32, True, "fake_ring"),
]


def run_case(name, mask, p, n, kind, dtype, traced, impl):
    rng = np.random.default_rng(sum(map(ord, name)))
    cm = jcm.compile(SPECS[mask])
    md = metadata(mask, n, rng)
    if md is not None:
        md = {key: np.asarray(val, np.int32) for key, val in md.items()}
    desc = cm.instantiate(md, n, n, **TILES)
    layout = {"balance": lambda: par.balance_permutation(desc, p, 2),
              "zigzag": lambda: par.zigzag_permutation(p), "none": lambda: None}[kind]()
    chunks = tuple(range(p)) if layout is None else layout
    ks = jax.random.split(jax.random.key(sum(map(ord, name))), 4)
    mk = lambda kk, h: jax.random.normal(kk, (B, n, h, D), jnp.float32).astype(dtype)  # noqa: E731
    qx, kx, vx, do = mk(ks[0], HQ), mk(ks[1], HKV), mk(ks[2], HKV), mk(ks[3], HQ)
    mesh = Mesh(np.array(jax.devices()[:p]), ("cp",))
    seq = P(None, "cp")
    kw = dict(context_axis="cp", context_layout=layout, return_residual=True,
              implementation=impl)
    if traced:      # descriptor built inside shard_map (traced): the full ring, looped
        sm = jax.shard_map(lambda a, b_, c, meta: jcm.mask_attention(
            a, b_, c, cm.instantiate(meta, n, n, **TILES), **kw), mesh=mesh,
            in_specs=(seq, seq, seq, P()), out_specs=(seq, seq))
        attend = lambda a, b_, c: sm(a, b_, c, md)   # noqa: E731
    else:
        attend = jax.shard_map(lambda a, b_, c: jcm.mask_attention(a, b_, c, desc, **kw),
                               mesh=mesh, in_specs=(seq, seq, seq), out_specs=(seq, seq))

    def cp(a, b_, c):
        perm = lambda x: par.permute_sequence(x, chunks)   # noqa: E731
        out, lse = attend(perm(a), perm(b_), perm(c))
        return par.unpermute_sequence(out, chunks), par.unpermute_sequence(lse, chunks)

    def with_grads(f):
        def g(a, b_, c):
            (out, lse), pull = jax.vjp(f, a, b_, c)
            return out, lse, pull((do.astype(out.dtype), jnp.zeros_like(lse)))
        return jax.jit(g)

    with fake.registered("fake_ring") as seen:
        out, lse, grads = with_grads(cp)(qx, kx, vx)
    cpd = len(chunks) // p
    rows = n // p
    fake.check_seen(seen, batch=desc.batch, rows=rows, k_slots=cpd * desc.num_intervals,
                    kc_slots=cpd * desc.num_bwd_intervals, q_heads=HQ)
    single = lambda a, b_, c: jcm.mask_attention(a, b_, c, desc, return_residual=True,  # noqa: E731
                                                 implementation="xla")
    s_out, s_lse, s_grads = with_grads(single)(qx, kx, vx)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads), (out.dtype, grads)
    got, single = (out, lse, *grads), (s_out, s_lse, *s_grads)
    worst = {}
    if dtype == jnp.bfloat16:       # the tolerance policy against the dense reference
        dense = desc.as_dense()

        def ref(prec):          # lse in jax's layout [B, N, H], as return_residual gives it
            def f(a, b_, c):
                o, lse_ = reference_attention(a, b_, c, dense, precision=prec)
                return o, jnp.swapaxes(lse_, 1, 2)
            return f
        f32 = lambda x: x.astype(jnp.float32)   # noqa: E731
        hi = with_grads(ref("high"))(f32(qx), f32(kx), f32(vx))
        lo = with_grads(ref("input"))(qx, kx, vx)
        for what, a, h, l_ in zip(("out", "lse", "dq", "dk", "dv"), got,
                                  (hi[0], hi[1], *hi[2]), (lo[0], lo[1], *lo[2])):
            assert_within_policy(a, h, l_, f"{name} {what}")
    for what, a, s in zip(("out", "lse", "dq", "dk", "dv"), got, single):
        fa, fs = np.asarray(a, np.float64), np.asarray(s, np.float64)
        assert np.array_equal(np.isneginf(fa), np.isneginf(fs)), (name, what)
        fin = ~np.isneginf(fs)
        # bfloat16-rounded partials merged / summed in float32: a bf16 ulp or two (plus,
        # in bfloat16, the final roundings of both calls)
        worst[what] = np.abs(fa[fin] - fs[fin]).max() / max(1.0, np.abs(fs[fin]).max())
        assert worst[what] <= (2 ** -6 if dtype == jnp.bfloat16 else 2 ** -7), (
            name, what, worst[what])
    return worst


if __name__ == "__main__":
    want = sys.argv[1:]
    done = 0
    for case in CASES:
        if want and not any(w in case[0] for w in want):
            continue
        worst = run_case(*case)
        print(case[0], " ".join(f"{k} {v:.2e}" for k, v in worst.items()), flush=True)
        done += 1
    print("OK", done, len(jax.devices()))
