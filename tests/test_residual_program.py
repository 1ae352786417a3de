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
