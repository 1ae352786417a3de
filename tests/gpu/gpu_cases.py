"""Masks and metadata shared by the GPU end-to-end tests (forward and backward): every
built-in at sizes that exercise the kernels (wide windows, ragged lengths, padding)."""
from __future__ import annotations

import importlib.util

import numpy as np

import jcompilemask as jcm

SPECS = {
    "causal": jcm.masks.causal(), "full": jcm.masks.full(),
    "sliding_window": jcm.masks.sliding_window(200, 31), "chunked_causal": jcm.masks.chunked_causal(300),
    "prefix_lm": jcm.masks.prefix_lm(), "document": jcm.masks.document(),
    "document_bidir": jcm.masks.document(causal=False), "hstu": jcm.masks.hstu(),
    "shared_prompt": jcm.masks.shared_prompt(3), "clear": jcm.masks.clear(32, 2),
}


def metadata(name, b, n, rng):
    """Random metadata of built-in ``name`` for b sequences of length n (None if none)."""
    if name == "prefix_lm":
        return {"prefix_len": rng.integers(0, n + 1, b)}
    if name in ("document", "document_bidir"):
        ids = np.sort(rng.integers(0, 9, (b, n)), axis=1)
        ids[:, n - 37:] = -1
        return {"segment_ids": ids}
    if name == "hstu":
        g = rng.integers(3, 9, b)
        return {"context_len": rng.integers(n // 4, n // 2, b),
                "history_end": n - g * rng.integers(3, 9, b), "group_size": g}
    if name == "shared_prompt":
        lens = rng.integers(n // 16, n // 11, (b, 3))
        p = n - lens.sum(1)
        starts = p[:, None] + np.concatenate([np.zeros((b, 1), int), np.cumsum(lens, 1)[:, :-1]], 1)
        return {"prompt_len": p, "response_starts": starts}
    if name == "clear":
        return {"text_len": rng.integers(16, 100, b), "image_len": rng.integers(n // 2, n - 120, b)}
    return None


def random_spec_case(rng, n=700, b=2):
    """(spec, metadata or None): a random two-region MaskSpec over q, k, a scalar ``s``
    and segment ids ``seg``, whose atoms all lower to intervals (no fallback)."""
    from jcompilemask.spec import MaskSpec, Region, Scalar, SegmentIds, k, q, q_len
    s, seg = Scalar("s", max=q_len), SegmentIds("seg")
    atoms = [k <= q, k >= q - 100, k < s, k >= seg.start(q), k < seg.end(q), k >= q // 64 * 64,
             k <= q + 50, k >= s]

    def rule():
        idx = rng.choice(len(atoms), size=rng.integers(1, 4), replace=False)
        r = atoms[idx[0]]
        for i in idx[1:]:
            r = (r & atoms[i]) if rng.random() < 0.5 else (r | atoms[i])
        return r
    spec = MaskSpec([Region((0, s), rule()), Region((s, q_len), rule())])
    md = {"s": rng.integers(0, n, b)} if "s" in spec.metadata else {}
    if "seg" in spec.metadata:
        md["seg"] = np.sort(rng.integers(-1, 6, (b, n)), axis=1)
    return spec, md or None


def gradient_problems(grads, g_hi, g_lo, dtype):
    """The tolerance-policy failures of (dq, dk, dv), each with where its worst error sits
    (batch, position, head, dim): all three are checked, so one device run says which
    product is wrong and where. Empty when all pass."""
    from jcompilemask.testing import assert_within_policy
    problems = []
    for name, a, h, lo in zip(("dq", "dk", "dv"), grads, g_hi, g_lo):
        assert a.dtype == dtype and a.shape == h.shape, (name, a.dtype, a.shape, h.shape)
        try:
            assert_within_policy(a, h, lo, name)
        except AssertionError as err:
            diff = np.abs(np.asarray(a, np.float32) - np.asarray(h, np.float32))
            worst = np.unravel_index(np.nanargmax(np.where(np.isnan(diff), np.inf, diff)), diff.shape)
            problems.append(f"{err} at {tuple(int(i) for i in worst)} of {diff.shape}")
    return problems


def random_residual_case(rng, n=700, b=2):
    """(spec, metadata or None): a random two-region MaskSpec whose atoms mix intervals with
    atoms that keep a residual predicate the kernels evaluate (a modulus, a metadata
    divisor, a quadratic), so each region lowers to hull intervals + a residual."""
    from jcompilemask.spec import MaskSpec, Region, Scalar, k, q, q_len
    s, d = Scalar("s", max=q_len), Scalar("d", min=1, max=7)
    exact = [k <= q, k >= q - 150, k < s, k >= s, k <= q + 40]
    residual = [(q - k) % 2 == 0, k % d != 1, (k * 3 + q) % 5 < 3, k * k <= q * 7, k % 3 == q % 3]

    def rule():
        r = exact[rng.integers(len(exact))]
        for _ in range(int(rng.integers(1, 3))):
            a = residual[rng.integers(len(residual))] if rng.random() < 0.6 else exact[rng.integers(len(exact))]
            r = (r & a) if rng.random() < 0.6 else (r | a)
        return r
    spec = MaskSpec([Region((0, s), rule()), Region((s, q_len), rule())])
    md = {}
    if "s" in spec.metadata:
        md["s"] = rng.integers(0, n, b).astype(np.int32)
    if "d" in spec.metadata:
        md["d"] = rng.integers(1, 8, b).astype(np.int32)
    return spec, md or None


def random_many_intervals_case(rng, n=700, b=2):
    """(spec, metadata or None): K up to 32 row intervals: a random union of key stripes
    (some with a per-batch period) under a causal or windowed bound."""
    import functools
    from jcompilemask.spec import MaskSpec, Region, Scalar, k, q, q_len
    p = Scalar("p", min=8, max=40)
    count = int(rng.integers(9, 33))
    width = int(rng.integers(1, 6))
    use_p = bool(rng.integers(2))
    step = p if use_p else int(rng.integers(width + 2, 40))
    stripes = functools.reduce(lambda x, y: x | y,
                               [(k >= step * i) & (k < step * i + width) for i in range(count)])
    bound = (k <= q) if rng.integers(2) else (k <= q + 30)
    spec = MaskSpec([Region((0, q_len), stripes & bound)])
    md = {"p": rng.integers(8, 41, b).astype(np.int32)} if use_p else None
    return spec, md


def random_many_runs_dense(rng, n=700, heads=1):
    """bool [heads, n, n]: a fixed pattern of 9-32 runs per row and up to 32 per column,
    as a user's dense mask would have: causal, rows outside a few random row stripes see a
    random set of key stripes, rows inside them see every earlier key, plus the diagonal.
    Row runs come from the key stripes (K), column runs from the row stripes (Kc)."""
    out = np.zeros((heads, n, n), bool)
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    for h in range(heads):
        n_k = int(rng.integers(9, 25))
        key_on = np.zeros(n, bool)
        for s in rng.choice(n - 8, n_k, replace=False):
            key_on[s:s + int(rng.integers(1, 6))] = True
        row_on = np.zeros(n, bool)
        for s in rng.choice(n - 8, int(rng.integers(10, 25)), replace=False):
            row_on[s:s + int(rng.integers(1, 4))] = True
        out[h] = (ki <= qi) & (key_on[None, :] | row_on[:, None] | (ki == qi))
    return out


def registry_names_cute(spec, dtype="bfloat16", d=128, hq=8, hkv=8, softcap=False,
                        mark_available=False):
    """Assert that ``jcompilemask.backends.explain`` for the call ``mask_attention`` makes of
    ``spec`` (dtype, head dim ``d``, ``hq`` / ``hkv`` heads, ``softcap`` or not, no bias) chooses
    cute, the CuTe backward, and cute for every region: issue 16's "explain() names cute"
    (the tests that check values force ``implementation="cute"``; this is the registry's
    own choice). ``mark_available``: with the cute backend marked available (no GPU here),
    so the CPU twins check the same decision. Returns the explanation."""
    import dataclasses
    import jax.numpy as jnp
    from jcompilemask import backends
    cm = jcm.compile(spec, warn=False)
    call = backends.call_for(cm, dtype=jnp.dtype(dtype).name, head_dim=d, head_dim_v=d,
                             num_heads=hq, num_kv_heads=hkv, softcap=softcap)
    real = backends.get("cute")
    if mark_available:
        backends.register(dataclasses.replace(real, available=lambda: None))
    try:
        text = backends.explain(call, mask=cm)
    finally:
        if mark_available:
            backends.register(real)
    runs = [line.strip() for line in text.splitlines() if line.strip().startswith("runs on:")]
    import os
    # $JCOMPILEMASK_CUTE_BACKWARD=0 (the xla backward over the CuTe forward's residuals) is
    # the user's own choice, which explain must then report instead.
    backward = ("backward: xla on the CuTe forward's residuals"
                if os.environ.get(backends.CUTE_BACKWARD_ENV, "").strip() == "0"
                else "backward: the CuTe backward kernel")
    assert "chosen: cute" in text and backward in text, text
    # (a fixed mask from from_dense has no regions, so no per-region lines)
    assert runs or not cm.regions, text
    assert all(line.startswith("runs on: cute (") for line in runs), text
    return text


def check_attention(spec, md, b, n, hq, hkv, d, dtype, impl, seed=0, forward=True, lse=True):
    """mask_attention with ``impl`` against the dense oracle under the tolerance policy:
    out (and lse) when ``forward``, then dq, dk, dv (asserts; random normal inputs). With
    ``impl="cute"`` the registry must also choose cute for that call on its own
    (``registry_names_cute``)."""
    import jax
    import jax.numpy as jnp
    import jcompilemask as jcm
    from jcompilemask.testing import assert_within_policy, reference_attention, reference_gradients
    if impl == "cute":
        registry_names_cute(spec, dtype, d, hq, hkv)
    ks = jax.random.split(jax.random.key(seed), 4)
    mk = lambda kk, h: jax.random.normal(kk, (b, n, h, d), jnp.float32).astype(dtype)  # noqa: E731
    qx, kx, vx, do = mk(ks[0], hq), mk(ks[1], hkv), mk(ks[2], hkv), mk(ks[3], hq)
    from jcompilemask.lower.dense import DenseMask
    mask = spec.as_dense() if isinstance(spec, DenseMask) else spec.as_dense(md, n, n)
    if forward:
        out, res = jax.jit(lambda a, b_, c: jcm.mask_attention(
            a, b_, c, spec, metadata=md, implementation=impl, return_residual=True))(qx, kx, vx)
        hi = reference_attention(qx, kx, vx, mask, precision="high")
        lo = reference_attention(qx, kx, vx, mask, precision="input")
        assert_within_policy(out, hi[0], lo[0], "out")
        if lse:
            assert_within_policy(jnp.swapaxes(res, 1, 2), hi[1], lo[1], "lse")

    def loss(a, b_, c):
        o = jcm.mask_attention(a, b_, c, spec, metadata=md, implementation=impl)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qx, kx, vx)
    g_hi, g_lo = reference_gradients(qx, kx, vx, do, mask)
    problems = gradient_problems(g, g_hi, g_lo, dtype)
    assert not problems, "; ".join(problems)


def compile_checking_remarks(compile_fn, key, monkeypatch, capfd):
    """``compile_fn(key)`` with ptxas's output on (``$JCOMPILEMASK_CUTE_PTXAS_REMARKS``),
    fresh (not from this process's cache), failing on remark C7512: ptxas serializing the
    wgmmas for want of registers costs a GEMM-bound kernel its overlap and fails nothing
    else (session 10: ``static_stage`` at D 64 did that)."""
    from jcompilemask.kernels.cute import api
    monkeypatch.setenv("JCOMPILEMASK_CUTE_PTXAS_REMARKS", "1")
    api._compiled.pop(key, None)
    capfd.readouterr()
    fn = compile_fn(key)
    out = "".join(capfd.readouterr())
    assert "registers" in out, f"no ptxas output for {key.target_name} (served from a cache?):\n{out[-2000:]}"
    assert "C7512" not in out, (f"ptxas serialized the wgmmas of {key.target_name} (C7512): pick a "
                                f"config with fewer live registers\n{out[-3000:]}")
    return fn


def sm90_gpu_reason():
    """Why the CuTe kernels cannot run here (None when they can: cutlass-dsl, jax-tvm-ffi and
    an SM90 GPU visible to JAX)."""
    if importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl is not installed"
    if importlib.util.find_spec("jax_tvm_ffi") is None:
        return "jax-tvm-ffi is not installed"
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return "no GPU visible to JAX"
    cc = getattr(gpus[0], "compute_capability", None)
    if cc is not None and not str(cc).startswith("9"):
        return f"the kernel needs SM90 (Hopper), found compute capability {cc}"
    return None
