"""Run in a subprocess by tests/test_sharding.py (8 host devices must be set before JAX
starts): ``mask_attention`` under a plain ``jax.jit`` whose q, k, v are sharded over a
2 x 4 mesh along the batch and the heads together (every mask) and along the batch or the
heads alone (one mask of each descriptor structure, ``EVERY_LAYOUT``), for every built-in
mask, random lowered specs, a per-head mask, a mask with fallback regions and a dilated
window (residue classes). Forward (out, lse) and gradients are within the tolerance
policy of the dense reference and agree with the single-device call; the compiled HLO of
every sharded layout has no collective at all (so in particular no all-gather or
all-to-all of q, k, v). Prints ``OK <cases>``."""
import os
import re
import sys

# N host devices; XLA's CPU backend at optimization level 0: these checks compile many
# small programs and run each once, so compile time is what they spend (about half of it
# goes with -O0; the results are compared under the same tolerance policy).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "gpu"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jcompilemask as jcm  # noqa: E402
import gpu_cases  # noqa: E402
from jcompilemask.attention.partition import batch_sharded  # noqa: E402
from jcompilemask.spec import MaskSpec, Region, Scalar, SegmentIds, h, k, q, q_len  # noqa: E402
from jcompilemask.testing import assert_within_policy, reference_attention  # noqa: E402

B, N, HQ, HKV, D = 4, 64, 8, 4, 8          # GQA: 2 query heads per key/value head
TILES = dict(block_q=16, block_kv=16, bwd_block_q=16, bwd_block_kv=16)
COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|all-reduce|reduce-scatter|"
                        r"collective-permute|collective-broadcast)\b")
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
# The masks also run under the batch-only and heads-only layouts: one of each descriptor
# structure that the partitioning rules read (the descriptor's batch, mask heads and
# classes): shared by the batch (causal), per sequence with one interval a row (document)
# and with the most (clear: 6 forward, 7 column intervals), residue classes (dilated) and
# per-class descriptors (document_dilated2). The other built-ins have one of these
# structures (full, sliding_window and chunked_causal causal's; prefix_lm, document_bidir,
# hstu and shared_prompt document's and clear's), so they run under batch x heads only.
EVERY_LAYOUT = ("causal", "document", "clear", "dilated", "document_dilated2")
LAYOUTS = {"batch": P("data"), "heads": P(None, None, "model"),
           "batch_x_heads": P("data", None, "model")}


def cases(rng):
    specs = {"causal": jcm.masks.causal(), "full": jcm.masks.full(),
             "sliding_window": jcm.masks.sliding_window(9, 3, sinks=2),
             "chunked_causal": jcm.masks.chunked_causal(20), "prefix_lm": jcm.masks.prefix_lm(),
             "document": jcm.masks.document(), "document_bidir": jcm.masks.document(False),
             "hstu": jcm.masks.hstu(), "shared_prompt": jcm.masks.shared_prompt(3),
             "clear": jcm.masks.clear(8, 2)}
    for name, spec in specs.items():
        if name == "clear":
            md = {"text_len": rng.integers(4, 20, B), "image_len": rng.integers(16, 40, B)}
        else:
            md = gpu_cases.metadata(name, B, N, rng)
        yield name, spec, md
    for i in range(3):
        spec, md = gpu_cases.random_spec_case(rng, n=N, b=B)
        yield f"random{i}", spec, md
    yield "per_head", MaskSpec([Region((0, q_len), k <= q + h * 3)], num_heads=HQ), None
    # residue classes (a ClassDescriptor): each device views its shard with the classes as
    # heads, so every layout stays local
    yield "dilated", MaskSpec([Region((0, q_len), (k <= q) & (k > q - 12) & ((q - k) % 2 == 0))]), None
    # packed documents with a dilated window: each class has its own descriptor (the inner
    # descriptor's mask heads), replicated over the head devices; with 8 classes that axis
    # has the query heads' size, and must still not be sharded with them
    seg = SegmentIds("segment_ids")
    for c in (2, 8):
        yield (f"document_dilated{c}",
               MaskSpec([Region((0, q_len), (k >= seg.start(q)) & (k < seg.end(q))
                                & (k <= q) & (k > q - 6 * c) & ((q - k) % c == 0))]),
               gpu_cases.metadata("document", B, N, rng))
    s = Scalar("s", max=q_len)
    yield ("fallback", MaskSpec([Region((0, s), k % 4 != 1), Region((s, q_len), k <= q)]),
           {"s": rng.integers(0, N, B)})


def attend_and_grad(q, k, v, desc, do):
    """(out, lse, dq, dk, dv): one program, so one compile per layout."""
    (out, lse), vjp = jax.vjp(
        lambda a, b, c: jcm.mask_attention(a, b, c, desc, return_residual=True), q, k, v)
    # lse comes as [B, Nq, Hq] (jax's layout); the references give [B, Hq, Nq].
    return (out, jnp.swapaxes(lse, 1, 2), *vjp((do, jnp.zeros_like(lse))))


def references(q, k, v, dense, do):
    def ref(prec):
        return lambda a, b, c: reference_attention(a, b, c, dense, precision=prec)

    def grads(prec):
        def loss(a, b, c):
            return jnp.sum(ref(prec)(a, b, c)[0].astype(jnp.float32) * do)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return [(*ref(p)(q, k, v), *grads(p)) for p in ("high", "input")]


def main():
    rng = np.random.default_rng(0)
    keys = jax.random.split(jax.random.key(0), 4)
    qx = jax.random.normal(keys[0], (B, N, HQ, D), jnp.float32)
    kx = jax.random.normal(keys[1], (B, N, HKV, D), jnp.float32)
    vx = jax.random.normal(keys[2], (B, N, HKV, D), jnp.float32)
    do = jax.random.normal(keys[3], (B, N, HQ, D), jnp.float32)
    names = ("out", "lse", "dq", "dk", "dv")
    n = 0
    for name, spec, md in cases(rng):
        desc = jcm.compile(spec).instantiate(md, N, N, **TILES)
        hi, lo = jax.jit(references)(qx, kx, vx, desc.as_dense(), do)
        single = jax.jit(attend_and_grad)(qx, kx, vx, desc, do)
        layouts = (LAYOUTS if name in EVERY_LAYOUT
                   else {"batch_x_heads": LAYOUTS["batch_x_heads"]})
        if "dilated" in name:
            assert isinstance(desc, jcm.ClassDescriptor), desc
            assert desc.per_class == name.startswith("document"), desc
        for layout, spec_ in layouts.items():
            put = lambda x: jax.device_put(x, NamedSharding(mesh, spec_))  # noqa: E731
            # The descriptor shards with the batch where it has one per sequence.
            dspec = P("data") if "batch" in layout and desc.batch == B else P()
            dsh = jax.device_put(desc, NamedSharding(mesh, dspec))
            args = (put(qx), put(kx), put(vx), dsh, put(do))
            compiled = jax.jit(attend_and_grad).lower(*args).compile()
            found = sorted(set(COLLECTIVE.findall(compiled.as_text())))
            assert not found, f"{name}/{layout}: collectives in the compiled HLO: {found}"
            got = compiled(*args)
            for nm, a, s1, h_, l_ in zip(names, got, single, hi, lo):
                where = f"{name}/{layout}/{nm}"
                assert_within_policy(a, h_, l_, where)
                np.testing.assert_allclose(np.asarray(a), np.asarray(s1), rtol=1e-5,
                                           atol=2e-5, err_msg=where)
            if layout == "batch_x_heads":
                assert got[0].sharding.spec[:3] == ("data", None, "model"), got[0].sharding
        n += 1

    # The preprocess inside the sharded jit (the training step builds its descriptor
    # there): metadata sharded on the batch, the descriptor is built per device with no
    # collective (the jnp preprocess's scatters carry the batch as a batching dim).
    for name, spec, md in cases(np.random.default_rng(1)):
        if md is None or name not in ("hstu", "document", "shared_prompt", "prefix_lm"):
            continue
        cm = jcm.compile(spec)

        def step(q, k, v, do, md):
            return attend_and_grad(q, k, v, cm.instantiate(md, N, N, **TILES), do)
        put = lambda x: jax.device_put(x, NamedSharding(mesh, LAYOUTS["batch_x_heads"]))  # noqa: E731
        mdp = {key: jax.device_put(jnp.asarray(val), NamedSharding(mesh, P("data")))
               for key, val in md.items()}
        args = (put(qx), put(kx), put(vx), put(do), mdp)
        compiled = jax.jit(step).lower(*args).compile()
        found = sorted(set(COLLECTIVE.findall(compiled.as_text())))
        assert not found, f"{name}, preprocess in the jit: collectives in the compiled HLO: {found}"
        for a, b in zip(compiled(*args), jax.jit(step)(qx, kx, vx, do, md)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)
        n += 1

    # An additive bias per sequence, shared by the heads: it shards with the batch, its
    # gradient is summed over the head devices (an all-reduce of the bias, nothing else).
    desc = jcm.compile(jcm.masks.causal()).instantiate(None, N, N, **TILES)
    bias = jax.random.normal(keys[3], (B, 1, N, N), jnp.float32)

    def with_bias(q, k, v, bias, do):
        out, vjp = jax.vjp(lambda a, b, c, e: jcm.mask_attention(a, b, c, desc, bias=e),
                           q, k, v, bias)
        return (out, *vjp(do))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, LAYOUTS["batch_x_heads"]))  # noqa: E731

    def batch_sharded_matches(fn, extra, what):
        """``fn(q, k, v, extra, do)`` with q / k / v / do over batch x heads and ``extra``
        over the batch: no collective but all-reduces, the values of the unsharded call."""
        args = (put(qx), put(kx), put(vx), jax.device_put(extra, NamedSharding(mesh, P("data"))),
                put(do))
        compiled = jax.jit(fn).lower(*args).compile()
        found = set(COLLECTIVE.findall(compiled.as_text())) - {"all-reduce"}
        assert not found, f"{what}: collectives in the compiled HLO: {sorted(found)}"
        for a, b in zip(compiled(*args), jax.jit(fn)(qx, kx, vx, extra, do)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)
    batch_sharded_matches(with_bias, bias, "bias")

    # A dense mask known at run time (a traced per-sequence mask), sharded with the batch:
    # its runs are found per device; the only collective is the all-reduce of the run
    # count that picks the tier (one int32).
    dense = jnp.asarray(rng.random((B, 1, N, N)) < 0.05) | jnp.tril(
        jnp.ones((N, N), bool))[None, None]

    def with_dense(q, k, v, m, do):
        out, vjp = jax.vjp(lambda a, b, c: jcm.mask_attention(a, b, c, m), q, k, v)
        return (out, *vjp(do))
    batch_sharded_matches(with_dense, dense, "runtime dense")
    n += 1

    # A dilated window (residue classes) with a per-head bias, heads sharded: the class
    # views and the bias's same-class blocks are taken in mask_attention on the global
    # arrays, so XLA may move data between the head devices; the results must not change
    # (tests/test_row_classes.py checks the unsharded bias path against the oracle).
    spec = MaskSpec([Region((0, q_len), (k <= q) & (k > q - 12) & ((q - k) % 2 == 0))])
    desc = jcm.compile(spec).instantiate(None, N, N, **TILES)
    assert isinstance(desc, jcm.ClassDescriptor), desc
    hbias = jax.random.normal(keys[2], (B, HQ, N, N), jnp.float32)
    args = (put(qx), put(kx), put(vx),
            jax.device_put(hbias, NamedSharding(mesh, P("data", "model"))), put(do))
    got = jax.jit(with_bias)(*args)
    want = jax.jit(with_bias)(qx, kx, vx, hbias, do)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)

    # Query heads over an axis that does not divide the key/value heads: the heads are
    # replicated (whole GQA groups), the batch still shards; results unchanged.
    mq = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))  # noqa: E731
    desc = jcm.compile(jcm.masks.causal()).instantiate(None, N, N, **TILES)
    k2, v2 = kx[:, :, :2], vx[:, :, :2]
    mb = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
    got = jax.jit(attend_and_grad)(mq(qx), mb(k2), mb(v2), desc, mq(do))
    want = jax.jit(attend_and_grad)(qx, k2, v2, desc, do)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)

    # A mesh with Explicit axes (jax.make_mesh's default): the shardings are in the types
    # and the calls run in a shard_map, with no collective either.
    emesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(5)
    desc = jcm.compile(jcm.masks.document()).instantiate(
        gpu_cases.metadata("document", B, N, rng), N, N, **TILES)
    eput = lambda x: jax.device_put(x, NamedSharding(emesh, LAYOUTS["batch_x_heads"]))  # noqa: E731
    args = (eput(qx), eput(kx), eput(vx), jax.device_put(desc, NamedSharding(emesh, P("data"))),
            eput(do))
    compiled = jax.jit(attend_and_grad).lower(*args).compile()
    found = sorted(set(COLLECTIVE.findall(compiled.as_text())))
    assert not found, f"explicit mesh: collectives in the compiled HLO: {found}"
    for a, b in zip(compiled(*args), jax.jit(attend_and_grad)(qx, kx, vx, desc, do)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)

    # The batch-only rule of the preprocess custom call, on a jnp stand-in.
    x = jnp.arange(B * 6, dtype=jnp.int32).reshape(B, 6)
    f = jax.jit(lambda x: batch_sharded(lambda b: lambda a: (a * 2, a.sum(1) + b), B, x))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    compiled = f.lower(xs).compile()
    assert not COLLECTIVE.findall(compiled.as_text()), compiled.as_text()
    y2, ys = compiled(xs)
    np.testing.assert_array_equal(y2, x * 2)
    np.testing.assert_array_equal(ys, x.sum(1) + B // 2)     # each device sees B / 2 rows
    print("OK", n)


if __name__ == "__main__":
    main()
