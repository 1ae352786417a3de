"""Residual predicates as kernel code (jcompilemask.lower.residual_program): the emission
the CuTe kernels will run, executed here on numpy through NumpyOps, against the jnp
evaluator the xla backend uses (CompiledMask.slot_residuals), on random residual specs and
on hand cases that stress floor division / remainder of negative operands, the divisor
clamp, vector reads, per-head residuals and region selection (int32 overflow is refused when
the spec is built, so no emitted expression wraps)."""
from __future__ import annotations

import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask.lower.residual_program import NumpyOps, ResidualProgram, kernel_reason
from jcompilemask.spec import MaskSpec, Region, Scalar, SegmentIds, Vector, h, k, q, q_len

from test_fuzz import _random_metadata, random_spec


def _check(cm, md, n, b):
    """Every slot of both views: NumpyOps emission == slot_residuals, per batch / head."""
    desc = cm.instantiate(md, n, n, preprocess="jnp")
    rows = np.arange(n, dtype=np.int32)
    import jax.numpy as jnp
    for view, prog in (("fwd", ResidualProgram.forward(cm)), ("bwd", ResidualProgram.backward(cm))):
        if view == "bwd" and cm.num_bwd_intervals == 0:
            assert not prog.slots                           # no column view: nothing to emit
            continue
        want = cm.slot_residuals(desc, jnp.asarray(rows), jnp.asarray(rows), view)
        if want is None:
            assert prog.exact
            continue
        want = np.asarray(want)                              # [B|1, Hm|1, R, C, S]
        table = prog.table(desc.metadata, b)
        region = np.asarray(desc.row_region)                 # [B, Nq]
        for bb in range(b):
            ops = NumpyOps(table, bb, q_len=n, kv_len=n)
            for hh in range(cm.spec.mask_heads):
                for m in range(len(prog.slots)):
                    got = prog.emit_slot(ops, m, q=rows[:, None], k=rows[None, :], h=hh,
                                         region=region[min(bb, region.shape[0] - 1)][:, None])
                    got = np.broadcast_to(got, (n, n))
                    ref = want[min(bb, want.shape[0] - 1), min(hh, want.shape[1] - 1), :, :, m]
                    bad = np.argwhere(got != ref)
                    assert bad.size == 0, (view, m, bb, hh, bad[:3], [str(p) for _, p in prog.slots[m]])


@pytest.mark.parametrize("seed", range(40))
def test_random_residual_specs_match_the_evaluator(seed):
    rng = np.random.default_rng(9000 + seed)
    spec, _ = random_spec(rng, nonlinear=True, heads=bool(seed % 3 == 0))
    cm = jcm.compile(spec, warn=False)
    if not cm.residual_regions:
        pytest.skip("this draw lowered exactly (no residual)")
    reasons = [kernel_reason(cm.residual(g, m)) for g in range(len(cm.regions))
               for m in range(cm.num_intervals)]
    if any(reasons):
        assert any("segment ids" in r for r in reasons if r)
        with pytest.raises(ValueError, match="cannot run in a kernel"):
            ResidualProgram.forward(cm)
        return
    n, b = 23, 2
    _check(cm, _random_metadata(rng, spec, b, n, n), n, b)


D = Scalar("d", min=-3, max=9)           # may be <= 0: the divisor clamp
V = Vector("v", 3, min=0, max=40)


@pytest.mark.parametrize("rule,md", [
    ((k <= q) & ((q - k) % 2 == 0), {}),                                   # dilated window
    ((k <= q + 5) & ((q - k) % 3 != 1), {}),                               # negative q - k
    ((k <= q + 9) & (((k - q) // 4) % 2 == 0), {}),                         # floor of negatives
    ((k <= q) & ((q - k) % D == 0), {"d": np.array([3, -2], np.int32)}),   # clamp: d -2 acts as 1
    ((k <= q) & (k % V[q % 3] == 0) & (V[1] >= 0), {"v": np.array([[2, 3, 5], [1, 7, 4]], np.int32)}),
    ((k <= q) & ((q * 7 - k * 3) % 5 < 2), {}),                             # mixed signs
    ((k <= q) & ((q + h) % 2 == k % 2), {}),                                # per-head residual
])
def test_hand_cases(rule, md):
    heads = 2 if any(getattr(n, "name", None) == "h" for n in __import__(
        "jcompilemask.spec.expr", fromlist=["walk"]).walk(rule)) else None
    spec = MaskSpec([Region((0, q_len), rule)], num_heads=heads)
    cm = jcm.compile(spec, warn=False)
    assert cm.residual_regions
    _check(cm, md or None, 29, 2)


def test_region_selection():
    """Two regions with different residuals in the same slot: each row takes its own."""
    spec = MaskSpec([Region((0, 10), (k <= q) & (k % 2 == 0), name="even"),
                     Region((10, q_len), (k <= q) & (k % 3 == 0), name="thirds")])
    cm = jcm.compile(spec, warn=False)
    _check(cm, None, 25, 1)


def test_segment_reads_stay_on_xla():
    seg = SegmentIds("seg")
    cm = jcm.compile(MaskSpec([Region((0, q_len), (k <= q) & (seg.id(k) % 2 == seg.id(q) % 2))]),
                     warn=False)
    res = [cm.residual(0, m) for m in range(cm.num_intervals)]
    assert any(kernel_reason(r) for r in res)
    assert "segment ids 'seg'" in next(kernel_reason(r) for r in res if kernel_reason(r))


def test_parameter_table_layout():
    spec = MaskSpec([Region((0, q_len), (k <= q) & ((q - k) % D == 0) & (k % V[q % 3] == 0))])
    prog = ResidualProgram.forward(jcm.compile(spec, warn=False))
    assert [(p.name, p.kind, p.offset, p.size) for p in prog.params] == [
        ("d", "scalar", 0, 1), ("v", "vector", 1, 3)] or [
        (p.name, p.offset) for p in prog.params] == [("v", 0), ("d", 3)]
    t = prog.table({"d": np.array([4, 5], np.int32), "v": np.array([[1, 2, 3], [4, 5, 6]], np.int32)}, 2)
    assert t.shape == (2, 4) and t.dtype == np.int32


# --------------------------------------------------------------------------------------
# column_periodic: the kernels evaluate a predicate proved 8-periodic in the column index
# once per column class (issue 16; ForwardKey.residual_periodic)
from jcompilemask.lower.residual_program import column_periodic  # noqa: E402


@pytest.mark.parametrize("pred,want", [
    ((q - k) % 2 == 0, True),                  # the dilated window
    ((q + h) % 2 == k % 2, True),              # per head
    ((q - k) % 8 != 3, True),
    ((3 * k + q) % 8 == 1, True),              # odd coefficient: period 8
    ((2 * k) % 16 == 0, True),                 # period 8
    ((k % 4 + q) % 2 == 0, True),
    (q % 3 == 0, True),                        # free of k
    (k % 3 == 0, False),                       # not a power of two
    (k % 16 == 0, False),                      # period 16
    ((q - k) % D == 0, False),                 # a metadata divisor
    (((q - k) % 2 == 0) & (k <= q), False),     # an interval atom
    (k // 64 == q // 64, False),
    (k % V[q % 3] == 0, False),
    (k * k % 2 == 0, False),                   # not affine
])
def test_column_periodic_cases(pred, want):
    assert column_periodic(pred) is want


def _random_expr(rng, depth):
    from jcompilemask.spec.expr import BinOp, Const
    leaves = [q, k, h, Const(int(rng.integers(-20, 20)))]
    if depth == 0 or rng.random() < 0.3:
        return leaves[int(rng.integers(len(leaves)))]
    op = rng.choice(["+", "-", "*c", "%", "//", "min", "max"])
    a = _random_expr(rng, depth - 1)
    if op == "*c":
        return BinOp("*", Const(int(rng.integers(-9, 10))), a)
    if op in ("%", "//"):
        return BinOp(op, a, Const(int(rng.choice([1, 2, 3, 4, 8, 16, 32]))))
    return BinOp(op, a, _random_expr(rng, depth - 1))


def _random_pred(rng, depth=2):
    from jcompilemask.spec.expr import And, Cmp, Not, Or
    r = rng.random()
    if depth == 0 or r < 0.5:
        return Cmp(rng.choice(["<", "<=", "==", "!=", ">", ">="]), _random_expr(rng, 3), _random_expr(rng, 3))
    if r < 0.7:
        return Not(_random_pred(rng, depth - 1))
    cls = And if r < 0.85 else Or
    return cls([_random_pred(rng, depth - 1), _random_pred(rng, depth - 1)])


@pytest.mark.parametrize("seed", range(8))
def test_column_periodic_holds_in_int32(seed):
    """Every random predicate the proof accepts takes equal values at k and k + 8 under the
    kernels' int32 arithmetic (NumpyOps: wrap-around, floor division and remainder), at
    ordinary and at extreme values; the accepted share is reported, so the generator
    keeps exercising the proof."""
    rng = np.random.default_rng(4400 + seed)
    big = 2 ** 31
    qs = np.concatenate([rng.integers(-3000, 3000, 64), rng.integers(big - 5000, big - 9, 16),
                         rng.integers(-big, -big + 5000, 16)]).astype(np.int64)
    ks = np.concatenate([rng.integers(-3000, 3000, 64), rng.integers(big - 5000, big - 9, 16),
                         rng.integers(-big, -big + 5000, 16)]).astype(np.int64)
    accepted = 0
    for _ in range(150):
        pred = _random_pred(rng)
        if not column_periodic(pred):
            continue
        accepted += 1
        prog = ResidualProgram([[(0, pred)]], [], "fwd")
        ops = NumpyOps(np.zeros((1, 1), np.int32))
        qq, kk = qs[:, None].astype(np.int32), ks[None, :].astype(np.int32)
        for hh in (0, 3):
            at = prog.emit(ops, pred, q=qq, k=kk, h=hh)
            k8 = (kk.astype(np.int64) + 8).astype(np.int32)     # wraps as the kernel's int32
            nxt = prog.emit(ops, pred, q=qq, k=k8, h=hh)
            np.testing.assert_array_equal(np.broadcast_to(at, (qq.size, kk.size)),
                                          np.broadcast_to(nxt, (qq.size, kk.size)), err_msg=str(pred))
    assert accepted >= 10, accepted


def test_periodic_slots_of_the_dilated_window():
    spec = MaskSpec([Region((0, q_len), (k <= q) & (k > q - 128) & ((q - k) % 2 == 0))])
    fwd, bwd = ResidualProgram.pair(jcm.compile(spec, warn=False))
    assert fwd.periodic_slots() == (True,) and bwd.periodic_slots() == (True,)
    mixed = MaskSpec([Region((0, q_len), (k < 16) | ((k <= q) & (k > q - 128) & ((q - k) % 2 == 0)))])
    fwd, _ = ResidualProgram.pair(jcm.compile(mixed, warn=False))
    assert fwd.periodic_slots() == (False, True)
